"""SQLAlchemy 2 through pgfence (PGFENCE_DSN), and directly against PostgreSQL when
PGFENCE_DSN is not set, so the expectations themselves are checked there. Both PostgreSQL
dialects: `postgresql+psycopg` (a sync engine) and `postgresql+asyncpg` (an async engine
under asyncio); each test below exists once per dialect (`psycopg_x`, `asyncpg_x`).

What SQLAlchemy adds on top of its driver: connect-time introspection (the psycopg
dialect's hstore lookup with `to_regtype`, `use_native_hstore=True` by default; the asyncpg
dialect's json/jsonb codec setup), a connection pool that rolls a connection back when it
is returned, its own transaction handling (`begin()`, `begin_nested()` savepoints,
`begin_twophase()`: `PREPARE TRANSACTION` / `COMMIT PREPARED`), and "insertmanyvalues"
(an `executemany` of an INSERT sent as multi-row INSERTs, a page at a time). The fencing
token comes through the dialect's `connect_args`: libpq `options` for psycopg,
`server_settings` for asyncpg.

Environment (besides PG_DIRECT_DSN / PGFENCE_DSN): PGFENCE_FENCE, `on` (the default when
PGFENCE_DSN is set) when the pgfence behind PGFENCE_DSN enforces fences, `off` for one with
`fence.enabled = false`. Where the fence is enforced, a stale write fails with
`sqlalchemy.exc.DBAPIError` whose `.orig` is exactly FN001, nothing of it lands, and the
fence moves only with accepted tokens; where it is not (directly, or fence off), the same
stale writes land and no fence row appears. Reads, connect-time introspection and
`COPY ... TO STDOUT` work with a stale token everywhere.

Every test has a deadline (DEADLINE), so a hang is a FAIL of that test, not a kill of the
script.
"""

import asyncio
import io
import threading

import psycopg
import sqlalchemy as sa
from psycopg.conninfo import conninfo_to_dict
from sqlalchemy import orm
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from fence_expect import stale
from pgfence_test import direct_dsn, fence_enforced, run, run_mode, run_suffix

FENCED = fence_enforced()
MODE = run_mode()
# Tables and resources are named after this process, so runs can share a database.
SUFFIX = run_suffix()
# One test's deadline, in seconds.
DEADLINE = 20
TOKEN_A = 33
TOKEN_B = 34


def table(name):
    return f"sqla_{name}_{SUFFIX}"


def resource(name):
    r = f"sqla.{name}.{SUFFIX}"
    assert len(r) <= 63, r
    return r


# --- direct checks (psycopg straight to PostgreSQL) ------------------------------------


def direct_all(query, params=()):
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        cur = d.execute(query, params)
        return cur.fetchall() if cur.description else None


def direct_ids(t):
    return [r[0] for r in direct_all(f"SELECT id FROM {t} ORDER BY id")]


def fence_of(res):
    rows = direct_all("SELECT token FROM pgfence.fences WHERE resource = %s", (res,))
    return rows[0][0] if rows else None


def assert_fence(res, token, context):
    """The fence of `res` is `token` where the fence is enforced; elsewhere nothing calls
    pgfence.check, so there is no fence row."""
    got, want = fence_of(res), (token if FENCED else None)
    assert got == want, f"{context}: fence of {res} is {got}, want {want}"


def prepared_gids(gids):
    rows = direct_all("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (list(gids),))
    return sorted(r[0] for r in rows)


def roll_back_prepared(gids):
    """Rolls back (directly) whichever of `gids` are still prepared: one left behind would
    hold its locks, its fence row's too, forever. Returns them."""
    left = prepared_gids(gids)
    for gid in left:
        direct_all(f"ROLLBACK PREPARED '{gid}'")
    return left


def run_two_phase(eng, scenario, t, res):
    """Runs `scenario(c, t, res, gids)` on a sync Connection of `eng`, then disposes of it
    and rolls back (directly) whatever of `gids` it left prepared, which fails the test."""
    gids = []
    try:
        with eng.connect() as c:
            scenario(c, t, res, gids)
    finally:
        eng.dispose()
        left = roll_back_prepared(gids)
        assert left == [], f"left prepared (rolled back directly now): {left}"


async def run_two_phase_async(eng, scenario, t, res):
    """`run_two_phase` on an AsyncEngine: AsyncConnection has no begin_twophase(), so the
    scenario runs with the sync API (`run_sync`), on the asyncpg dialect."""
    gids = []
    try:
        async with eng.connect() as c:
            await c.run_sync(scenario, t, res, gids)
    finally:
        await eng.dispose()
        left = roll_back_prepared(gids)
        assert left == [], f"left prepared (rolled back directly now): {left}"


def hstore_available():
    """Creates extension hstore (directly) when the server has it, so the psycopg dialect's
    connect-time lookup finds the type; whether it could."""
    try:
        direct_all("CREATE EXTENSION IF NOT EXISTS hstore")
    except psycopg.errors.FeatureNotSupported:
        return False
    except psycopg.errors.UndefinedFile:
        return False
    return True


HSTORE = hstore_available()
print(f"mode: {MODE}, hstore {'installed' if HSTORE else 'not available'}", flush=True)


def model(name):
    """A declarative model (its own registry) on a new table `table(name)`, created
    directly."""

    class Base(orm.DeclarativeBase):
        pass

    class Item(Base):
        __tablename__ = table(name)
        id: orm.Mapped[int] = orm.mapped_column(primary_key=True)
        v: orm.Mapped[str]

    direct_all(f"CREATE TABLE {Item.__tablename__} (id int PRIMARY KEY, v text NOT NULL)")
    return Item


# --- engines ---------------------------------------------------------------------------


def url(dsn, driver):
    info = conninfo_to_dict(dsn)
    return sa.URL.create(
        f"postgresql+{driver}",
        username=info.get("user"),
        password=info.get("password"),
        host=info.get("host"),
        port=int(info["port"]) if "port" in info else None,
        database=info.get("dbname"),
    )


def engine(dsn, token=None, res=None, **kwargs):
    """A `postgresql+psycopg` engine whose connections carry `token` and `res` as libpq
    `options` (the startup packet)."""
    options = []
    if res is not None:
        options.append(f"-c fencing.resource={res}")
    if token is not None:
        options.append(f"-c fencing.token={token}")
    args = {"connect_timeout": 10}
    if options:
        args["options"] = " ".join(options)
    return sa.create_engine(url(dsn, "psycopg"), connect_args=args, **kwargs)


def async_engine(dsn, token=None, res=None, **kwargs):
    """A `postgresql+asyncpg` engine whose connections carry `token` and `res` as
    `server_settings` (startup parameters)."""
    settings = {}
    if res is not None:
        settings["fencing.resource"] = res
    if token is not None:
        settings["fencing.token"] = str(token)
    args = {"ssl": False, "timeout": 10, "server_settings": settings}
    return create_async_engine(url(dsn, "asyncpg"), connect_args=args, **kwargs)


# --- expectations ----------------------------------------------------------------------


def server_error(err):
    """(sqlstate, severity, message, detail, hint) of the server error behind a
    DBAPIError's `.orig` (psycopg's error itself; asyncpg's is the adapter error's cause)."""
    orig = err.orig
    if isinstance(orig, psycopg.Error):
        d = orig.diag
        return (orig.sqlstate, d.severity_nonlocalized, d.message_primary, d.message_detail, d.message_hint)
    cause = orig.__cause__
    return (orig.sqlstate, cause.severity_en, cause.message, cause.detail, cause.hint)


def check_stale(err, res, context):
    """Where the fence is enforced `err` (None: the write went through) must be a
    DBAPIError carrying exactly FN001 for TOKEN_A against TOKEN_B; elsewhere the write must
    have gone through. Returns whether it was rejected."""
    if not FENCED:
        assert err is None, f"{context}: failed without the fence: {err!r}"
        return False
    assert err is not None, f"{context}: the stale write was accepted"
    assert isinstance(err, sa.exc.DBAPIError), f"{context}: not a DBAPIError: {err!r}"
    code, message, detail, hint = stale(res, TOKEN_A, TOKEN_B)
    got, want = server_error(err), (code, "ERROR", message, detail, hint)
    assert got == want, f"{context}: {err}\n got  {got}\n want {want}"
    return True


def bounded(fn, deadline=DEADLINE):
    """A `test_x(dsn)` that runs `fn(dsn)` in a thread and fails if it has not returned
    within `deadline` seconds (the thread is a daemon: a hung one does not keep the script
    alive)."""

    def test(dsn):
        outcome = {}

        def body():
            try:
                fn(dsn)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                outcome["error"] = e
            outcome["done"] = True

        t = threading.Thread(target=body, daemon=True)
        t.start()
        t.join(deadline)
        if "done" not in outcome:
            raise AssertionError(f"{fn.__name__} did not finish within {deadline} s")
        if "error" in outcome:
            raise outcome["error"]

    test.__name__ = fn.__name__
    return test


def aio(fn):
    """A `test_x(dsn)` that runs coroutine function `fn(dsn)` under asyncio.run with a
    deadline, in a thread bounded a little later: a cancelled coroutine that hangs again
    (closing its connections, say) still fails the test in time."""

    def loop(dsn):
        asyncio.run(asyncio.wait_for(fn(dsn), DEADLINE))

    loop.__name__ = fn.__name__
    return bounded(loop, DEADLINE + 5)


# --- postgresql+psycopg ----------------------------------------------------------------


@bounded
def test_psycopg_orm_round_trip(dsn):
    Item = model("pg_orm")
    res = resource("pg_orm")
    eng = engine(dsn, TOKEN_A, res)
    try:
        with orm.Session(eng) as s:
            assert s.execute(sa.text("SHOW fencing.token")).scalar() == str(TOKEN_A)
            assert s.execute(sa.text("SHOW fencing.resource")).scalar() == res
            s.rollback()
            with s.begin():
                s.add_all([Item(id=1, v="one"), Item(id=2, v="two")])
            assert direct_ids(Item.__tablename__) == [1, 2]
            assert_fence(res, TOKEN_A, "ORM insert")
            with s.begin():
                item = s.get(Item, 2)
                assert item.v == "two"
                item.v = "updated"
            with s.begin():
                got = s.scalars(sa.select(Item.v).order_by(Item.id)).all()
                assert got == ["one", "updated"], got
        # Core, on a Connection: insert, update, select, in one transaction.
        with eng.begin() as c:
            c.execute(sa.insert(Item), {"id": 3, "v": "core"})
            c.execute(sa.update(Item).where(Item.id == 1).values(v="core update"))
            rows = c.execute(sa.select(Item.id, Item.v).order_by(Item.id)).all()
            assert [tuple(r) for r in rows] == [(1, "core update"), (2, "updated"), (3, "core")], rows
        assert direct_all(f"SELECT v FROM {Item.__tablename__} ORDER BY id") == [("core update",), ("updated",), ("core",)]
        assert_fence(res, TOKEN_A, "Core writes")
    finally:
        eng.dispose()


@bounded
def test_psycopg_stale_token(dsn):
    Item = model("pg_stale")
    t = Item.__tablename__
    res = resource("pg_stale")
    direct_all(f"INSERT INTO {t} VALUES (1, 'before')")
    # A newer leader writes with TOKEN_B through the tested target (so pgfence's fast path
    # knows the fence; with the fast path off the database rejects).
    newer = engine(dsn, TOKEN_B, res)
    with newer.begin() as c:
        c.execute(sa.insert(Item), {"id": 2, "v": "B"})
    newer.dispose()
    assert_fence(res, TOKEN_B, "newer leader")

    # A new engine of the deposed leader: its first connection runs the dialect's
    # connect-time introspection (the hstore lookup: to_regtype) with the stale token.
    eng = engine(dsn, TOKEN_A, res, pool_size=1, max_overflow=0)
    try:
        with eng.connect() as c:
            assert eng.dialect._has_native_hstore is HSTORE, eng.dialect._has_native_hstore
            if HSTORE:
                assert c.execute(sa.text("SELECT 'a=>1'::hstore")).scalar() == {"a": "1"}
            pid = c.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            # Reads.
            assert c.execute(sa.select(Item.v).where(Item.id == 2)).scalar() == "B"
            c.rollback()
            # A stale Core write, rejected (at the INSERT or at COMMIT), then the same
            # connection goes on after a rollback.
            err = None
            try:
                c.execute(sa.insert(Item), {"id": 10, "v": "stale core"})
                c.commit()
            except sa.exc.DBAPIError as e:
                err = e
            check_stale(err, res, "stale Core insert")
            c.rollback()
            assert c.execute(sa.text("SELECT pg_backend_pid()")).scalar() == pid
            assert c.execute(sa.select(sa.func.count()).select_from(Item)).scalar() == (2 if FENCED else 3)
            c.rollback()
        # ORM: a stale flush of an insert, and a stale update.
        for what in ("insert", "update"):
            err = None
            try:
                with orm.Session(eng) as s, s.begin():
                    if what == "insert":
                        s.add(Item(id=11, v="stale orm"))
                    else:
                        s.get(Item, 1).v = "stale update"
            except sa.exc.DBAPIError as e:
                err = e
            check_stale(err, res, f"stale ORM {what}")
        # The same pooled connection (pool_size 1): a read after the rejections.
        with orm.Session(eng) as s:
            assert s.execute(sa.text("SELECT pg_backend_pid()")).scalar() == pid
            got = s.scalars(sa.select(Item.v).order_by(Item.id)).all()
        want = ["before", "B"] if FENCED else ["stale update", "B", "stale core", "stale orm"]
        assert got == want, got
        # COPY ... TO STDOUT on the raw DBAPI connection, in a transaction.
        raw = eng.raw_connection()
        try:
            cur = raw.cursor()
            with cur.copy(f"COPY {t} (id, v) TO STDOUT") as copy:
                table_rows = sorted(tuple(r) for r in copy.rows())
            with cur.copy(f"COPY (SELECT v FROM {t} WHERE id = 2) TO STDOUT") as copy:
                query_rows = b"".join(bytes(b) for b in copy)
            raw.commit()
        finally:
            raw.close()
        assert len(table_rows) == len(want) and query_rows == b"B\n", (table_rows, query_rows)
        assert direct_all(f"SELECT v FROM {t} ORDER BY id") == [(v,) for v in want]
        assert_fence(res, TOKEN_B, "after the stale writes")
    finally:
        eng.dispose()


@bounded
def test_psycopg_pool_reuse(dsn):
    Item = model("pg_pool")
    t = Item.__tablename__
    res = resource("pg_pool")
    eng = engine(dsn, TOKEN_A, res, pool_size=2, max_overflow=0, pool_timeout=10)
    try:
        pids = set()
        for i in range(6):
            with eng.begin() as c:
                pids.add(c.execute(sa.text("SELECT pg_backend_pid()")).scalar())
                c.execute(sa.insert(Item), {"id": i, "v": "checkout"})
        # Two at once.
        with eng.connect() as c1, eng.connect() as c2:
            p1 = c1.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            p2 = c2.execute(sa.text("SELECT pg_backend_pid()")).scalar()
            assert p1 != p2
            pids |= {p1, p2}
            c1.execute(sa.insert(Item), {"id": 100, "v": "c1"})
            c2.execute(sa.insert(Item), {"id": 101, "v": "c2"})
            c1.commit()
            c2.commit()
        assert len(pids) == 2, pids
        # Returned mid-transaction (a write not committed), and returned with a failed
        # transaction: the pool's reset-on-return rolls both back.
        c = eng.connect()
        c.execute(sa.insert(Item), {"id": 200, "v": "never committed"})
        c.close()
        c = eng.connect()
        c.execute(sa.insert(Item), {"id": 201, "v": "never committed"})
        try:
            c.execute(sa.text("SELECT 1/0"))
        except sa.exc.DBAPIError as e:
            assert e.orig.sqlstate == "22012", e
        else:
            raise AssertionError("1/0 succeeded")
        c.close()
        for i in (300, 301, 302):
            with eng.begin() as c:
                assert c.execute(sa.text("SHOW fencing.token")).scalar() == str(TOKEN_A)
                c.execute(sa.insert(Item), {"id": i, "v": "after reset"})
        assert eng.pool.checkedin() == 2, eng.pool.status()
        assert direct_ids(t) == [0, 1, 2, 3, 4, 5, 100, 101, 300, 301, 302]
        assert_fence(res, TOKEN_A, "pool")
    finally:
        eng.dispose()


def two_phase(c, t, res, gids):
    """On sync Connection `c` (with TOKEN_A for `res`): `begin_twophase()`, prepare and
    commit, then prepare and roll back, then a plain transaction; each xid goes to
    `gids` first, for the cleanup."""
    Item = sa.table(t, sa.column("id"), sa.column("v"))
    tx = c.begin_twophase()
    gids.append(tx.xid)
    c.execute(sa.insert(Item), [{"id": 1, "v": "2pc"}, {"id": 2, "v": "2pc"}])
    tx.prepare()
    assert prepared_gids(gids) == [tx.xid], "not prepared"
    assert direct_ids(t) == []
    # The check's advance of the fence belongs to the prepared transaction.
    assert fence_of(res) is None
    tx.commit()
    assert prepared_gids(gids) == []
    assert direct_ids(t) == [1, 2]
    assert_fence(res, TOKEN_A, "COMMIT PREPARED")
    tx = c.begin_twophase()
    gids.append(tx.xid)
    c.execute(sa.insert(Item), {"id": 3, "v": "rolled back"})
    tx.prepare()
    assert prepared_gids(gids) == [tx.xid], "not prepared"
    tx.rollback()
    assert prepared_gids(gids) == []
    # The connection goes on: a plain transaction.
    with c.begin():
        c.execute(sa.insert(Item), {"id": 4, "v": "after"})
    assert direct_ids(t) == [1, 2, 4]
    assert_fence(res, TOKEN_A, "after two-phase")


@bounded
def test_psycopg_two_phase(dsn):
    t = model("pg_tpc").__tablename__
    res = resource("pg_tpc")
    run_two_phase(engine(dsn, TOKEN_A, res), two_phase, t, res)


def stale_two_phase(c, t, res, gids):
    """On sync Connection `c` (with TOKEN_A for `res`, whose fence is TOKEN_B): a
    `begin_twophase()` transaction is rejected (at its INSERT by the fast path, or at
    PREPARE TRANSACTION by the database) where the fence is enforced and commits where it
    is not; nothing is left prepared, and the connection goes on."""
    Item = sa.table(t, sa.column("id"), sa.column("v"))
    tx = c.begin_twophase()
    gids.append(tx.xid)
    err = None
    try:
        c.execute(sa.insert(Item), {"id": 10, "v": "stale 2pc"})
        tx.prepare()
        tx.commit()
    except sa.exc.DBAPIError as e:
        err = e
    rejected = check_stale(err, res, "stale two-phase")
    assert prepared_gids(gids) == [], "left prepared"
    if rejected:
        try:
            tx.rollback()
        except sa.exc.ProgrammingError:
            # psycopg takes its transaction as prepared once PREPARE TRANSACTION was sent,
            # so after one that failed (here FN001; as well a deferred constraint) its
            # ROLLBACK PREPARED finds nothing (42704), and it refuses a plain rollback:
            # the connection is dropped and the next statement gets a new one.
            c.invalidate()
    assert c.execute(sa.text("SHOW fencing.token")).scalar() == str(TOKEN_A)
    c.rollback()
    with c.begin():
        c.execute(sa.text(f"SET LOCAL fencing.token = {TOKEN_B}"))
        c.execute(sa.insert(Item), {"id": 11, "v": "current token"})
    assert direct_ids(t) == ([11] if FENCED else [10, 11])
    assert_fence(res, TOKEN_B, "after the stale two-phase")


@bounded
def test_psycopg_stale_two_phase(dsn):
    t = model("pg_stale_tpc").__tablename__
    res = resource("pg_stale_tpc")
    newer = engine(dsn, TOKEN_B, res)
    with newer.begin() as c:
        c.execute(sa.text(f"INSERT INTO {t} VALUES (1, 'B')"))
    newer.dispose()
    direct_all(f"DELETE FROM {t}")
    run_two_phase(engine(dsn, TOKEN_A, res), stale_two_phase, t, res)


@bounded
def test_psycopg_savepoints(dsn):
    Item = model("pg_nested")
    res = resource("pg_nested")
    eng = engine(dsn, TOKEN_A, res)
    try:
        with orm.Session(eng) as s, s.begin():
            s.add(Item(id=1, v="outer"))
            s.flush()
            try:
                with s.begin_nested():
                    s.add(Item(id=1, v="duplicate"))
            except sa.exc.IntegrityError:
                pass
            else:
                raise AssertionError("duplicate accepted")
            nested = s.begin_nested()
            s.add(Item(id=2, v="rolled back"))
            s.flush()
            nested.rollback()
            with s.begin_nested():
                s.add(Item(id=3, v="inner"))
            assert direct_ids(Item.__tablename__) == []
        assert direct_ids(Item.__tablename__) == [1, 3]
        assert_fence(res, TOKEN_A, "savepoints")
    finally:
        eng.dispose()


@bounded
def test_psycopg_executemany(dsn):
    Item = model("pg_many")
    res = resource("pg_many")
    eng = engine(dsn, TOKEN_A, res, insertmanyvalues_page_size=100)
    try:
        with eng.begin() as c:
            c.execute(sa.insert(Item), [{"id": i, "v": f"v{i}"} for i in range(450)])
            got = c.execute(sa.insert(Item).returning(Item.id), [{"id": 1000 + i, "v": "r"} for i in range(250)])
            assert sorted(got.scalars()) == [1000 + i for i in range(250)]
            assert direct_ids(Item.__tablename__) == []
        with orm.Session(eng) as s, s.begin():
            s.add_all([Item(id=2000 + i, v="orm") for i in range(300)])
        assert len(direct_ids(Item.__tablename__)) == 1000
        assert_fence(res, TOKEN_A, "executemany")
    finally:
        eng.dispose()


# --- postgresql+asyncpg ----------------------------------------------------------------


async def pid_of(conn):
    return (await conn.execute(sa.text("SELECT pg_backend_pid()"))).scalar()


@aio
async def test_asyncpg_orm_round_trip(dsn):
    Item = model("apg_orm")
    res = resource("apg_orm")
    eng = async_engine(dsn, TOKEN_A, res)
    try:
        async with AsyncSession(eng) as s:
            assert (await s.execute(sa.text("SHOW fencing.token"))).scalar() == str(TOKEN_A)
            assert (await s.execute(sa.text("SHOW fencing.resource"))).scalar() == res
            await s.rollback()
            async with s.begin():
                s.add_all([Item(id=1, v="one"), Item(id=2, v="two")])
            assert direct_ids(Item.__tablename__) == [1, 2]
            assert_fence(res, TOKEN_A, "ORM insert")
            async with s.begin():
                item = await s.get(Item, 2)
                assert item.v == "two"
                item.v = "updated"
            async with s.begin():
                got = (await s.scalars(sa.select(Item.v).order_by(Item.id))).all()
                assert got == ["one", "updated"], got
        async with eng.begin() as c:
            await c.execute(sa.insert(Item), {"id": 3, "v": "core"})
            await c.execute(sa.update(Item).where(Item.id == 1).values(v="core update"))
            rows = (await c.execute(sa.select(Item.id, Item.v).order_by(Item.id))).all()
            assert [tuple(r) for r in rows] == [(1, "core update"), (2, "updated"), (3, "core")], rows
        assert direct_all(f"SELECT v FROM {Item.__tablename__} ORDER BY id") == [("core update",), ("updated",), ("core",)]
        assert_fence(res, TOKEN_A, "Core writes")
    finally:
        await eng.dispose()


@aio
async def test_asyncpg_stale_token(dsn):
    Item = model("apg_stale")
    t = Item.__tablename__
    res = resource("apg_stale")
    direct_all(f"INSERT INTO {t} VALUES (1, 'before')")
    newer = async_engine(dsn, TOKEN_B, res)
    async with newer.begin() as c:
        await c.execute(sa.insert(Item), {"id": 2, "v": "B"})
    await newer.dispose()
    assert_fence(res, TOKEN_B, "newer leader")

    # A new engine of the deposed leader: its first connection runs the dialect's
    # connect-time setup (server version, json/jsonb codecs: type introspection).
    eng = async_engine(dsn, TOKEN_A, res, pool_size=1, max_overflow=0)
    try:
        async with eng.connect() as c:
            assert (await c.execute(sa.text("""SELECT '{"a": 1}'::jsonb"""))).scalar() == {"a": 1}
            pid = await pid_of(c)
            assert (await c.execute(sa.select(Item.v).where(Item.id == 2))).scalar() == "B"
            await c.rollback()
            err = None
            try:
                await c.execute(sa.insert(Item), {"id": 10, "v": "stale core"})
                await c.commit()
            except sa.exc.DBAPIError as e:
                err = e
            check_stale(err, res, "stale Core insert")
            await c.rollback()
            assert await pid_of(c) == pid
            count = (await c.execute(sa.select(sa.func.count()).select_from(Item))).scalar()
            assert count == (2 if FENCED else 3), count
            await c.rollback()
        for what in ("insert", "update"):
            err = None
            try:
                async with AsyncSession(eng) as s, s.begin():
                    if what == "insert":
                        s.add(Item(id=11, v="stale orm"))
                    else:
                        (await s.get(Item, 1)).v = "stale update"
            except sa.exc.DBAPIError as e:
                err = e
            check_stale(err, res, f"stale ORM {what}")
        async with AsyncSession(eng) as s:
            assert (await s.execute(sa.text("SELECT pg_backend_pid()"))).scalar() == pid
            got = (await s.scalars(sa.select(Item.v).order_by(Item.id))).all()
        want = ["before", "B"] if FENCED else ["stale update", "B", "stale core", "stale orm"]
        assert got == want, got
        # COPY ... TO STDOUT on the raw asyncpg connection.
        async with eng.connect() as c:
            raw = (await c.get_raw_connection()).driver_connection
            out = io.BytesIO()
            await raw.copy_from_table(t, columns=["id", "v"], output=out)
            query_out = io.BytesIO()
            await raw.copy_from_query(f"SELECT v FROM {t} WHERE id = 2", output=query_out)
        assert len(out.getvalue().splitlines()) == len(want), out.getvalue()
        assert query_out.getvalue() == b"B\n", query_out.getvalue()
        assert direct_all(f"SELECT v FROM {t} ORDER BY id") == [(v,) for v in want]
        assert_fence(res, TOKEN_B, "after the stale writes")
    finally:
        await eng.dispose()


@aio
async def test_asyncpg_pool_reuse(dsn):
    Item = model("apg_pool")
    t = Item.__tablename__
    res = resource("apg_pool")
    eng = async_engine(dsn, TOKEN_A, res, pool_size=2, max_overflow=0, pool_timeout=10)
    try:
        pids = set()
        for i in range(6):
            async with eng.begin() as c:
                pids.add(await pid_of(c))
                await c.execute(sa.insert(Item), {"id": i, "v": "checkout"})

        async def concurrent(i):
            async with eng.begin() as c:
                await c.execute(sa.insert(Item), {"id": i, "v": "concurrent"})
                await c.execute(sa.text("SELECT pg_sleep(0.05)"))
                return await pid_of(c)

        got = await asyncio.gather(*(concurrent(100 + i) for i in range(4)))
        pids |= set(got)
        assert len(pids) == 2, pids
        c = await eng.connect()
        await c.execute(sa.insert(Item), {"id": 200, "v": "never committed"})
        await c.close()
        c = await eng.connect()
        await c.execute(sa.insert(Item), {"id": 201, "v": "never committed"})
        try:
            await c.execute(sa.text("SELECT 1/0"))
        except sa.exc.DBAPIError as e:
            assert e.orig.sqlstate == "22012", e
        else:
            raise AssertionError("1/0 succeeded")
        await c.close()
        for i in (300, 301, 302):
            async with eng.begin() as c:
                assert (await c.execute(sa.text("SHOW fencing.token"))).scalar() == str(TOKEN_A)
                await c.execute(sa.insert(Item), {"id": i, "v": "after reset"})
        assert eng.pool.checkedin() == 2, eng.pool.status()
        assert direct_ids(t) == [0, 1, 2, 3, 4, 5, 100, 101, 102, 103, 300, 301, 302]
        assert_fence(res, TOKEN_A, "pool")
    finally:
        await eng.dispose()


@aio
async def test_asyncpg_two_phase(dsn):
    t = model("apg_tpc").__tablename__
    res = resource("apg_tpc")
    await run_two_phase_async(async_engine(dsn, TOKEN_A, res), two_phase, t, res)


@aio
async def test_asyncpg_stale_two_phase(dsn):
    t = model("apg_stale_tpc").__tablename__
    res = resource("apg_stale_tpc")
    newer = async_engine(dsn, TOKEN_B, res)
    async with newer.begin() as c:
        await c.execute(sa.text(f"INSERT INTO {t} VALUES (1, 'B')"))
    await newer.dispose()
    direct_all(f"DELETE FROM {t}")
    await run_two_phase_async(async_engine(dsn, TOKEN_A, res), stale_two_phase, t, res)


@aio
async def test_asyncpg_savepoints(dsn):
    Item = model("apg_nested")
    res = resource("apg_nested")
    eng = async_engine(dsn, TOKEN_A, res)
    try:
        async with AsyncSession(eng) as s, s.begin():
            s.add(Item(id=1, v="outer"))
            await s.flush()
            try:
                async with s.begin_nested():
                    s.add(Item(id=1, v="duplicate"))
            except sa.exc.IntegrityError:
                pass
            else:
                raise AssertionError("duplicate accepted")
            nested = await s.begin_nested()
            s.add(Item(id=2, v="rolled back"))
            await s.flush()
            await nested.rollback()
            async with s.begin_nested():
                s.add(Item(id=3, v="inner"))
            assert direct_ids(Item.__tablename__) == []
        assert direct_ids(Item.__tablename__) == [1, 3]
        assert_fence(res, TOKEN_A, "savepoints")
    finally:
        await eng.dispose()


@aio
async def test_asyncpg_executemany(dsn):
    Item = model("apg_many")
    res = resource("apg_many")
    eng = async_engine(dsn, TOKEN_A, res, insertmanyvalues_page_size=100)
    try:
        async with eng.begin() as c:
            await c.execute(sa.insert(Item), [{"id": i, "v": f"v{i}"} for i in range(450)])
            got = await c.execute(sa.insert(Item).returning(Item.id), [{"id": 1000 + i, "v": "r"} for i in range(250)])
            assert sorted(got.scalars()) == [1000 + i for i in range(250)]
            assert direct_ids(Item.__tablename__) == []
        async with AsyncSession(eng) as s, s.begin():
            s.add_all([Item(id=2000 + i, v="orm") for i in range(300)])
        assert len(direct_ids(Item.__tablename__)) == 1000
        assert_fence(res, TOKEN_A, "executemany")
    finally:
        await eng.dispose()


run(globals())
