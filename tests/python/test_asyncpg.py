"""asyncpg through pgfence (PGFENCE_DSN), and directly against PostgreSQL when PGFENCE_DSN is
not set, so the expectations themselves are checked there.

asyncpg uses the extended protocol its own way: named prepared statements cached per
connection (Parse/Describe, then Bind/Execute), binary formats, `executemany` pipelining
every Bind/Execute before one Sync, binary COPY (`copy_records_to_table`), cursors
(Execute with a row limit, PortalSuspended) in transactions, savepoints for nested
transactions, type introspection queries on first use of a type, a CancelRequest when a
query times out, LISTEN/NOTIFY, `server_settings` sent as startup parameters, and a reset
query (`SELECT pg_advisory_unlock_all(); CLOSE ALL; UNLISTEN *; RESET ALL;`) when a pool
takes a connection back.

Environment (besides PG_DIRECT_DSN / PGFENCE_DSN): PGFENCE_FENCE, `on` (the default when
PGFENCE_DSN is set) when the pgfence behind PGFENCE_DSN enforces fences, `off` for one run
with `fence.enabled = false`. Where the fence is not enforced (directly, or fence off),
the stale writes of the tests must land, and no fence row appears: the same tests check
the opposite outcome, so each shows what the fence changes.

Every test runs under asyncio.run with a deadline, so a hang is a FAIL of that test, not a
kill of the script.
"""

import asyncio
import datetime
import decimal
import io
import os
import time
import uuid

import asyncpg

from fence_expect import stale
from pgfence_test import direct_dsn, fence_enforced, run, run_suffix

FENCED = fence_enforced()
# Tables, channels and resources are named after this process, so runs can share a database.
SUFFIX = run_suffix()
# One test's deadline.
DEADLINE = 90
TOKEN_A = 33
TOKEN_B = 34


def table(name):
    return f"apg_{name}_{SUFFIX}"


def resource(name):
    r = f"apg.{name}.{SUFFIX}"
    assert len(r) <= 63, r
    return r


def parse_conninfo(dsn):
    """A libpq key=value connection string as a dict (quotes and backslash escapes as libpq
    reads them)."""
    out = {}
    i, n = 0, len(dsn)
    while i < n:
        while i < n and dsn[i].isspace():
            i += 1
        if i >= n:
            break
        eq = dsn.index("=", i)
        key = dsn[i:eq].strip()
        i = eq + 1
        while i < n and dsn[i].isspace():
            i += 1
        value = []
        if i < n and dsn[i] == "'":
            i += 1
            while dsn[i] != "'":
                if dsn[i] == "\\":
                    i += 1
                value.append(dsn[i])
                i += 1
            i += 1
        else:
            while i < n and not dsn[i].isspace():
                if dsn[i] == "\\":
                    i += 1
                value.append(dsn[i])
                i += 1
        out[key] = "".join(value)
    return out


def connect_kwargs(dsn):
    """asyncpg.connect keyword arguments for a libpq key=value string."""
    info = parse_conninfo(dsn)
    kwargs = {}
    for key, value in info.items():
        if key == "host":
            kwargs["host"] = value
        elif key == "port":
            kwargs["port"] = int(value)
        elif key == "user":
            kwargs["user"] = value
        elif key == "dbname":
            kwargs["database"] = value
        elif key == "password":
            kwargs["password"] = value
        elif key == "connect_timeout":
            kwargs["timeout"] = float(value)
        elif key == "sslmode":
            kwargs["ssl"] = value
        else:
            raise AssertionError(f"connection parameter {key} not mapped to asyncpg")
    kwargs.setdefault("ssl", "disable")
    return kwargs


def url_of(dsn, **query):
    """A postgresql:// URL for a libpq key=value string, with `query` parameters."""
    from urllib.parse import quote, urlencode

    info = parse_conninfo(dsn)
    auth = quote(info["user"], safe="")
    if "password" in info:
        auth += ":" + quote(info["password"], safe="")
    q = urlencode(query, quote_via=quote)
    return f"postgresql://{auth}@{info['host']}:{info['port']}/{quote(info['dbname'], safe='')}" + (f"?{q}" if q else "")


async def connect(dsn, token=None, res=None, **kwargs):
    """An asyncpg connection to `dsn`, with a session token and resource as startup
    parameters (`server_settings`) when given."""
    settings = dict(kwargs.pop("server_settings", {}))
    if token is not None:
        settings["fencing.token"] = str(token)
    if res is not None:
        settings["fencing.resource"] = res
    return await asyncpg.connect(**connect_kwargs(dsn), server_settings=settings, **kwargs)


async def direct():
    return await asyncpg.connect(**connect_kwargs(direct_dsn()))


async def direct_val(query, *args):
    d = await direct()
    try:
        return await d.fetchval(query, *args)
    finally:
        await d.close()


async def direct_count(t, where="true"):
    return await direct_val(f"SELECT count(*) FROM {t} WHERE {where}")


async def fence_of(res):
    """The fence of `res` in pgfence's table (None: no fence row), read directly."""
    return await direct_val("SELECT token FROM pgfence.fences WHERE resource = $1", res)


async def assert_fence(res, token):
    """The fence of `res` is `token` when the fence is enforced; there is no fence row when
    it is not (direct, or fence off: nothing calls pgfence.check)."""
    got = await fence_of(res)
    want = token if FENCED else None
    assert got == want, f"fence of {res}: {got}, expected {want}"


def assert_stale_error(err, res, token, fence, context):
    """`err` is exactly the FN001 of SPEC section 5 (fence_expect.stale), severity ERROR,
    without pgfence's call stack."""
    assert isinstance(err, asyncpg.PostgresError), f"{context}: not a server error: {err!r}"
    code, message, detail, hint = stale(res, token, fence)
    got = (err.sqlstate, err.severity_en, err.message, err.detail, err.hint)
    want = (code, "ERROR", message, detail, hint)
    assert got == want, f"{context}: {type(err).__name__}: {err}\n got  {got}\n want {want}"
    assert err.context is None, f"{context}: pgfence's call stack leaked: {err.context}"


async def expect_stale(action, res, token, fence, context):
    """Runs `action()` (a coroutine function): when the fence is enforced it must fail with
    exactly FN001; otherwise it must succeed. Returns whether it was rejected."""
    try:
        await action()
    except asyncpg.PostgresError as e:
        if not FENCED:
            raise AssertionError(f"{context}: failed without a fence: {e!r}") from e
        assert_stale_error(e, res, token, fence, context)
        return True
    assert not FENCED, f"{context}: the stale write was accepted"
    return False


async def assert_idle(conn, context):
    """asyncpg believes no transaction is open, and the server agrees: a ROLLBACK warns
    25P01 (there is no transaction in progress), and the connection answers."""
    assert not conn.is_in_transaction(), f"{context}: asyncpg believes a transaction is open"
    notices = []

    def on_log(_conn, message):
        notices.append(message.sqlstate)

    conn.add_log_listener(on_log)
    try:
        await conn.execute("ROLLBACK")
        assert await conn.fetchval("SELECT 'usable'") == "usable"
    finally:
        conn.remove_log_listener(on_log)
    assert notices == ["25P01"], f"{context}: a transaction was still open on the server: {notices}"


async def take_fence(dsn, res, t, token=TOKEN_B):
    """A newer leader writes one row with `token` (through the tested target), so the fence
    of `res` is `token` when it is enforced."""
    b = await connect(dsn, token, res)
    try:
        await b.execute(f"INSERT INTO {t} (id, who) VALUES ($1, 'B')", -token)
    finally:
        await b.close()
    await assert_fence(res, token)


def aio(fn):
    """A `test_x(dsn)` that runs coroutine function `fn(dsn)` under asyncio.run, with a
    deadline."""

    def test(dsn):
        async def bounded():
            return await asyncio.wait_for(fn(dsn), DEADLINE)

        asyncio.run(bounded())

    test.__name__ = fn.__name__
    return test


# ---------------------------------------------------------------------------------------


@aio
async def test_statement_cache(dsn):
    t = table("cache")
    conn = await connect(dsn)
    try:
        await conn.execute(
            f"CREATE TABLE {t} (id int8 PRIMARY KEY, name text, amount numeric, at timestamptz, "
            "u uuid, b bytea, tags text[], doc jsonb, f float8, ok bool)"
        )
        at = datetime.datetime(2024, 2, 29, 12, 30, 15, 123456, tzinfo=datetime.timezone.utc)
        rows = [
            (i, f"name {i} é", decimal.Decimal(f"{i}.25"), at + datetime.timedelta(days=i),
             uuid.UUID(int=i), bytes([i % 256, 0, 255]), [f"t{i}", "x"], f'{{"i": {i}}}', i / 4, i % 2 == 0)
            for i in range(200)
        ]
        await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)", rows)
        query = f"SELECT id, name, amount, at, u, b, tags, doc, f, ok FROM {t} WHERE id = $1"
        for i in (0, 7, 199, 7, 42):
            r = await conn.fetchrow(query, i)
            assert tuple(r) == rows[i], (tuple(r), rows[i])
        assert await conn.fetchval(f"SELECT count(*) FROM {t} WHERE id = ANY($1)", [1, 2, 3, 1000]) == 3
        assert await conn.fetchval(f"SELECT count(*) FROM {t} WHERE id = ANY($1)", [5]) == 1
        got = await conn.fetch(f"SELECT id, tags FROM {t} WHERE id < $1 ORDER BY id", 3)
        assert [tuple(r) for r in got] == [(0, ["t0", "x"]), (1, ["t1", "x"]), (2, ["t2", "x"])], got
        # The cache: each query text is one named prepared statement on the server,
        # prepared once however often it ran.
        prepared = await conn.fetch("SELECT name, statement FROM pg_prepared_statements")
        by_text = {}
        for p in prepared:
            by_text.setdefault(p["statement"], []).append(p["name"])
        assert len(by_text.get(query, [])) == 1, prepared
        assert all(name.startswith("__asyncpg_stmt_") for name in by_text[query]), prepared
        # An explicit prepared statement, its attributes, used many times.
        stmt = await conn.prepare(f"SELECT id, name FROM {t} WHERE id >= $1 ORDER BY id LIMIT 3")
        assert [a.name for a in stmt.get_attributes()] == ["id", "name"]
        assert [p.name for p in stmt.get_parameters()] == ["int8"]
        for start in range(0, 150, 10):
            assert [tuple(r) for r in await stmt.fetch(start)] == [(i, f"name {i} é") for i in range(start, start + 3)]
        assert await stmt.fetchval(198) == 198
        assert (await stmt.fetchrow(199))["name"] == "name 199 é"
        # An error, then the session goes on (and the cache still works).
        try:
            await conn.execute(f"INSERT INTO {t} (id) VALUES ($1)", 1)
        except asyncpg.UniqueViolationError:
            pass
        else:
            raise AssertionError("duplicate accepted")
        r = await conn.fetchrow(query, 42)
        assert tuple(r) == rows[42]
        assert await direct_count(t) == 200
        # startup parameters other than fencing.* reach the server
        other = await connect(dsn, server_settings={"application_name": f"apg_{SUFFIX}", "search_path": "pg_catalog, public"})
        try:
            assert await other.fetchval("SHOW application_name") == f"apg_{SUFFIX}"
            assert await other.fetchval("SHOW search_path") == "pg_catalog, public"
        finally:
            await other.close()
    finally:
        await conn.close()


@aio
async def test_executemany(dsn):
    t = table("many")
    conn = await connect(dsn)
    try:
        await conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        # Outside a transaction: one implicit transaction, every Bind/Execute before one Sync.
        await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(i, f"v{i}") for i in range(1000)])
        assert await direct_count(t) == 1000
        # Atomic: a duplicate key at row 300 of 500 leaves nothing.
        try:
            await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(2000 + i if i != 300 else 5, "dup") for i in range(500)])
        except asyncpg.UniqueViolationError:
            pass
        else:
            raise AssertionError("duplicate accepted")
        assert await direct_count(t) == 1000
        assert not conn.is_in_transaction()
        # Inside a transaction: rolled back, then committed.
        tr = conn.transaction()
        await tr.start()
        await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(i, "rolled back") for i in range(3000, 3100)])
        assert await conn.fetchval(f"SELECT count(*) FROM {t}") == 1100
        assert await direct_count(t) == 1000
        await tr.rollback()
        assert await direct_count(t) == 1000
        async with conn.transaction():
            await conn.executemany(f"UPDATE {t} SET v = $2 WHERE id = $1", [(i, "updated") for i in range(0, 1000, 2)])
            await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(i, "new") for i in range(4000, 4050)])
            assert await direct_count(t, "v = 'updated'") == 0
        assert await direct_count(t, "v = 'updated'") == 500
        assert await direct_count(t) == 1050
    finally:
        await conn.close()


@aio
async def test_session_token(dsn):
    t = table("session")
    res = resource("session")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text)")
    await setup.close()

    # Token and resource as startup parameters (server_settings).
    conn = await connect(dsn, 10, res)
    try:
        assert await conn.fetchval("SHOW fencing.token") == "10"
        assert await conn.fetchval("SHOW fencing.resource") == res
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {t} VALUES ($1, $2)", 1, "settings")
            await conn.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(2, "settings"), (3, "settings")])
            assert await direct_count(t) == 0, "visible before COMMIT"
        assert await direct_count(t) == 3
        await assert_fence(res, 10)
        await conn.execute(f"INSERT INTO {t} VALUES ($1, 'autocommit')", 4)
        assert await direct_count(t) == 4
    finally:
        await conn.close()

    # `options` as a startup parameter.
    conn = await connect(dsn, server_settings={"options": f"-c fencing.token=11 -c fencing.resource={res}"})
    try:
        assert await conn.fetchval("SHOW fencing.token") == "11"
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {t} VALUES ($1, 'options')", 5)
        await assert_fence(res, 11)
    finally:
        await conn.close()

    # `options` in a URL, as an application's connection string would carry it.
    url = url_of(dsn, options=f"-c fencing.token=12 -c fencing.resource={res}", sslmode="disable")
    conn = await asyncpg.connect(url)
    try:
        assert await conn.fetchval("SHOW fencing.token") == "12"
        await conn.execute(f"INSERT INTO {t} VALUES ($1, 'url')", 6)
        await assert_fence(res, 12)
    finally:
        await conn.close()
    assert await direct_count(t) == 6


@aio
async def test_stale_token(dsn):
    t = table("stale")
    res = resource("stale")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text)")
    await setup.close()

    a = await connect(dsn, TOKEN_A, res)  # the leader, soon deposed
    try:
        await a.execute(f"INSERT INTO {t} VALUES ($1, 'A1')", 1)
        await assert_fence(res, TOKEN_A)
        await take_fence(dsn, res, t)

        # Autocommit, extended protocol (a cached prepared statement: same text as A1).
        rejected = await expect_stale(
            lambda: a.execute(f"INSERT INTO {t} VALUES ($1, 'A1')", 2), res, TOKEN_A, TOKEN_B, "autocommit"
        )
        await assert_idle(a, "after autocommit")
        assert await direct_count(t, "id = 2") == (0 if rejected else 1)

        # An explicit transaction: rejected at the write (fast path) or at COMMIT.
        async def transaction():
            async with a.transaction():
                await a.execute(f"INSERT INTO {t} VALUES ($1, 'A2')", 3)
                await a.fetchval(f"UPDATE {t} SET who = 'A2 updated' WHERE id = $1 RETURNING who", 1)

        rejected = await expect_stale(transaction, res, TOKEN_A, TOKEN_B, "transaction")
        await assert_idle(a, "after the transaction")
        assert await direct_count(t, "id = 3 OR who = 'A2 updated'") == (0 if rejected else 2)
        # A simple-protocol write (no arguments: asyncpg sends a Query message).
        rejected = await expect_stale(
            lambda: a.execute(f"INSERT INTO {t} VALUES (4, 'simple')"), res, TOKEN_A, TOKEN_B, "simple"
        )
        await assert_idle(a, "after the simple query")
        assert await direct_count(t, "id = 4") == (0 if rejected else 1)
    finally:
        await a.close()

    # The token from SET (pgfence's fast path does not know it: the database rejects).
    c = await connect(dsn)
    try:
        await c.execute(f"SET fencing.resource = '{res}'")
        await c.execute(f"SET fencing.token = {TOKEN_A}")

        async def set_transaction():
            async with c.transaction():
                await c.execute(f"INSERT INTO {t} VALUES ($1, 'C')", 5)

        rejected = await expect_stale(set_transaction, res, TOKEN_A, TOKEN_B, "SET token")
        await assert_idle(c, "after SET token")
        assert await direct_count(t, "id = 5") == (0 if rejected else 1)
    finally:
        await c.close()
    await assert_fence(res, TOKEN_B)
    assert await direct_count(t, "who = 'B'") == 1


@aio
async def test_stale_executemany(dsn):
    t = table("stale_many")
    res = resource("stale_many")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text)")
    await setup.close()
    a = await connect(dsn, TOKEN_A, res)
    try:
        await a.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(i, "A1") for i in range(1, 51)])
        assert await direct_count(t) == 50
        await take_fence(dsn, res, t)
        rows = [(i, "A2") for i in range(100, 400)]
        rejected = await expect_stale(
            lambda: a.executemany(f"INSERT INTO {t} VALUES ($1, $2)", rows), res, TOKEN_A, TOKEN_B, "executemany"
        )
        await assert_idle(a, "after executemany")
        assert await direct_count(t, "who = 'A2'") == (0 if rejected else 300)

        async def in_transaction():
            async with a.transaction():
                await a.executemany(f"INSERT INTO {t} VALUES ($1, $2)", [(i, "A3") for i in range(500, 800)])
                await a.executemany(f"UPDATE {t} SET who = 'A3 updated' WHERE id = $1", [(i,) for i in range(1, 51)])

        rejected = await expect_stale(in_transaction, res, TOKEN_A, TOKEN_B, "executemany in a transaction")
        await assert_idle(a, "after executemany in a transaction")
        assert await direct_count(t, "who LIKE 'A3%'") == (0 if rejected else 350)
    finally:
        await a.close()
    await assert_fence(res, TOKEN_B)


@aio
async def test_set_config_token(dsn):
    """A deposed leader gets a new token mid-session with set_config() in an extended-protocol
    statement: its next write carries the new token (the fast path must not go on using
    the stale startup token)."""
    t = table("set_config")
    res = resource("set_config")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text)")
    await setup.close()
    await take_fence(dsn, res, t)
    a = await connect(dsn, TOKEN_A, res)
    try:
        rejected = await expect_stale(
            lambda: a.execute(f"INSERT INTO {t} VALUES ($1, 'A stale')", 1), res, TOKEN_A, TOKEN_B, "startup token"
        )
        assert await direct_count(t, "id = 1") == (0 if rejected else 1)
        assert await a.fetchval("SELECT set_config('fencing.token', $1, false)", "35") == "35"
        async with a.transaction(isolation="serializable"):
            await a.execute(f"INSERT INTO {t} VALUES ($1, 'A renewed')", 2)
        await a.execute(f"INSERT INTO {t} VALUES ($1, 'A renewed')", 3)
        assert await direct_count(t, "who = 'A renewed'") == 2
        await assert_fence(res, 35)
    finally:
        await a.close()


@aio
async def test_error_then_fenced_write(dsn):
    """The first write of a fenced session fails (a unique violation, extended protocol);
    the session's next writes, in autocommit and in a transaction, work."""
    t = table("error_first")
    res = resource("error_first")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    await setup.execute(f"INSERT INTO {t} VALUES (1)")
    await setup.close()
    a = await connect(dsn, 3, res)
    try:
        try:
            await a.execute(f"INSERT INTO {t} VALUES ($1)", 1)
        except asyncpg.UniqueViolationError:
            pass
        else:
            raise AssertionError("duplicate accepted")
        await a.execute(f"INSERT INTO {t} VALUES ($1)", 2)
        async with a.transaction():
            await a.execute(f"INSERT INTO {t} VALUES ($1)", 3)
        await a.executemany(f"INSERT INTO {t} VALUES ($1)", [(4,), (5,)])
        assert await direct_count(t) == 5
        await assert_fence(res, 3)
    finally:
        await a.close()


@aio
async def test_savepoints(dsn):
    t = table("savepoint")
    res = resource("savepoint")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text)")
    await setup.close()
    a = await connect(dsn, TOKEN_A, res)
    try:
        async with a.transaction():
            await a.execute(f"INSERT INTO {t} VALUES ($1, 'outer')", 1)
            try:
                async with a.transaction():  # SAVEPOINT
                    await a.execute(f"INSERT INTO {t} VALUES ($1, 'rolled back')", 2)
                    raise RuntimeError("roll back to the savepoint")
            except RuntimeError:
                pass
            try:
                async with a.transaction():
                    await a.execute(f"INSERT INTO {t} VALUES ($1, 'duplicate')", 1)
            except asyncpg.UniqueViolationError:
                pass
            else:
                raise AssertionError("duplicate accepted")
            async with a.transaction():
                await a.execute(f"INSERT INTO {t} VALUES ($1, 'inner')", 3)
                async with a.transaction():
                    await a.execute(f"INSERT INTO {t} VALUES ($1, 'innermost')", 4)
            assert await direct_count(t) == 0
        got = [tuple(r) for r in await (await direct()).fetch(f"SELECT id, who FROM {t} ORDER BY id")]
        assert got == [(1, "outer"), (3, "inner"), (4, "innermost")], got
        await assert_fence(res, TOKEN_A)

        await take_fence(dsn, res, t)

        async def nested():
            async with a.transaction():
                await a.execute(f"INSERT INTO {t} VALUES ($1, 'stale outer')", 10)
                async with a.transaction():
                    await a.execute(f"INSERT INTO {t} VALUES ($1, 'stale inner')", 11)

        rejected = await expect_stale(nested, res, TOKEN_A, TOKEN_B, "savepoints")
        await assert_idle(a, "after savepoints")
        assert await direct_count(t, "who LIKE 'stale%'") == (0 if rejected else 2)
    finally:
        await a.close()


@aio
async def test_copy_records(dsn):
    t = table("copy_in")
    res = resource("copy_in")
    setup = await connect(dsn)
    await setup.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, who text, amount numeric, at timestamptz, b bytea)")
    await setup.close()
    at = datetime.datetime(2024, 1, 1, tzinfo=datetime.timezone.utc)

    def records(start, n, who):
        return [(i, who, decimal.Decimal(i) / 100, at + datetime.timedelta(seconds=i), bytes([i % 256]) * 3) for i in range(start, start + n)]

    a = await connect(dsn, TOKEN_A, res)
    try:
        async with a.transaction():
            tag = await a.copy_records_to_table(t, records=records(0, 2000, "A1"))
            assert tag == "COPY 2000", tag
            assert await direct_count(t) == 0
        assert await direct_count(t) == 2000
        got = await (await direct()).fetchrow(f"SELECT id, who, amount, at, b FROM {t} WHERE id = 1234")
        assert tuple(got) == records(1234, 1, "A1")[0], got
        await assert_fence(res, TOKEN_A)
        # Autocommit (its own implicit transaction), some columns only.
        tag = await a.copy_records_to_table(t, records=[(i, "A1 cols") for i in range(5000, 5010)], columns=["id", "who"])
        assert tag == "COPY 10", tag
        assert await direct_count(t) == 2010

        await take_fence(dsn, res, t)

        async def stale_copy():
            async with a.transaction():
                await a.copy_records_to_table(t, records=records(10000, 500, "A2"))

        rejected = await expect_stale(stale_copy, res, TOKEN_A, TOKEN_B, "COPY in a transaction")
        await assert_idle(a, "after COPY in a transaction")
        assert await direct_count(t, "who = 'A2'") == (0 if rejected else 500)

        rejected = await expect_stale(
            lambda: a.copy_records_to_table(t, records=records(20000, 300, "A3")), res, TOKEN_A, TOKEN_B, "autocommit COPY"
        )
        await assert_idle(a, "after autocommit COPY")
        assert await direct_count(t, "who = 'A3'") == (0 if rejected else 300)
    finally:
        await a.close()
    await assert_fence(res, TOKEN_B)


@aio
async def test_copy_out(dsn):
    t = table("copy_out")
    conn = await connect(dsn)
    try:
        await conn.execute(f"CREATE TABLE {t} AS SELECT g AS id, 'row ' || g || E'\\t,\"' AS t FROM generate_series(1, 3000) g")
        buf = io.BytesIO()
        tag = await conn.copy_from_query(f"SELECT id, t FROM {t} WHERE id > $1 ORDER BY id", 2990, output=buf, format="csv")
        assert tag == "COPY 10", tag
        lines = buf.getvalue().decode().splitlines()
        assert lines[0] == '2991,"row 2991\t,"""', lines[0]
        assert len(lines) == 10, lines
        # Binary, to a callback, the whole table.
        chunks = []

        async def sink(data):
            chunks.append(bytes(data))

        tag = await conn.copy_from_table(t, output=sink, format="binary")
        assert tag == "COPY 3000", tag
        data = b"".join(chunks)
        assert data.startswith(b"PGCOPY\n\xff\r\n\x00") and data.endswith(b"\xff\xff"), data[:20]
        # Text COPY in from a file-like object, then the data round-trips.
        tag = await conn.copy_to_table(t, source=io.BytesIO(b"5000\tfive thousand\n5001\t\\N\n"))
        assert tag == "COPY 2", tag
        assert await direct_count(t) == 3002
        buf = io.BytesIO()
        await conn.copy_from_query(f"SELECT t FROM {t} WHERE id >= $1 ORDER BY id", 5000, output=buf)
        assert buf.getvalue() == b"five thousand\n\\N\n", buf.getvalue()
        # A COPY that fails in the middle; the session goes on.
        try:
            await conn.copy_to_table(t, source=io.BytesIO(b"6000\tok\nnot a number\tbad\n"))
        except asyncpg.InvalidTextRepresentationError:
            pass
        else:
            raise AssertionError("bad COPY data accepted")
        assert await direct_count(t) == 3002
        assert await conn.fetchval("SELECT 'usable'") == "usable"
    finally:
        await conn.close()


@aio
async def test_cursor(dsn):
    t = table("cursor")
    res = resource("cursor")
    conn = await connect(dsn, 5, res)
    try:
        await conn.execute(f"CREATE TABLE {t} AS SELECT g AS id FROM generate_series(1, 5000) g")
        async with conn.transaction():
            total, count = 0, 0
            async for r in conn.cursor(f"SELECT id FROM {t} WHERE id > $1 ORDER BY id", 1000, prefetch=333):
                total += r["id"]
                count += 1
            assert (count, total) == (4000, sum(range(1001, 5001))), (count, total)
            # A cursor object: fetch, forward, fetchrow; two cursors interleaved.
            cur = await conn.cursor(f"SELECT id FROM {t} ORDER BY id")
            other = await conn.cursor(f"SELECT -id FROM {t} ORDER BY id")
            assert [r[0] for r in await cur.fetch(5)] == [1, 2, 3, 4, 5]
            assert await cur.forward(10) == 10
            assert (await cur.fetchrow())[0] == 16
            for i in range(1, 20):
                assert (await other.fetchrow())[0] == -i
            assert [r[0] for r in await cur.fetch(3)] == [17, 18, 19]
            # A write in the same transaction, then a cursor over a statement that fails
            # after some rows: the transaction fails and is rolled back.
            await conn.execute(f"DELETE FROM {t} WHERE id > $1", 4000)
            bad = await conn.cursor("SELECT 10 / (3000 - g) FROM generate_series(1, 5000) g")
            assert len(await bad.fetch(100)) == 100
            try:
                await bad.fetch(5000)
            except asyncpg.DivisionByZeroError:
                pass
            else:
                raise AssertionError("division by zero in the cursor not reported")
            try:
                await conn.fetchval("SELECT 1")
            except asyncpg.InFailedSQLTransactionError:
                pass
            else:
                raise AssertionError("the transaction is not failed after the cursor's error")
            # Leaving the block commits: PostgreSQL answers a failed transaction's COMMIT
            # with ROLLBACK.
        assert not conn.is_in_transaction()
    finally:
        await conn.close()
    assert await direct_count(t) == 5000, "the failed transaction's DELETE was not rolled back"

    conn = await connect(dsn, 5, res)
    try:
        async with conn.transaction():
            n = 0
            async for _ in conn.cursor(f"SELECT id FROM {t}", prefetch=1000):
                n += 1
            assert n == 5000
            await conn.execute(f"DELETE FROM {t} WHERE id > $1", 4000)
        assert await direct_count(t) == 4000
        await assert_fence(res, 5)
    finally:
        await conn.close()


@aio
async def test_cancel(dsn):
    conn = await connect(dsn)
    marker = f"cancel_{SUFFIX}"
    try:
        pid = conn.get_server_pid()
        for how in ("timeout", "wait_for", "transaction"):
            started = time.monotonic()
            try:
                if how == "timeout":
                    await conn.execute(f"SELECT pg_sleep(10) /* {marker} */", timeout=0.5)
                elif how == "wait_for":
                    await asyncio.wait_for(conn.fetchval(f"SELECT pg_sleep($1) /* {marker} */", 10.0), 0.5)
                else:
                    async with conn.transaction():
                        await conn.execute(f"CREATE TEMP TABLE apg_cancel_{os.getpid()} (v int)")
                        await conn.fetch(f"SELECT pg_sleep(10) /* {marker} */", timeout=0.5)
            except asyncio.TimeoutError:
                pass
            else:
                raise AssertionError(f"{how}: pg_sleep was not interrupted")
            # The connection is usable at once: the server's backend was cancelled (else it
            # would sleep on, and this query would wait for it).
            assert await conn.fetchval("SELECT 'after cancel'", timeout=5) == "after cancel"
            assert time.monotonic() - started < 5, f"{how}: {time.monotonic() - started:.1f} s"
            assert not conn.is_in_transaction()
            assert conn.get_server_pid() == pid
            active = await direct_val(
                "SELECT count(*) FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1",
                f"%pg_sleep%{marker}%",
            )
            assert active == 0, f"{how}: pg_sleep still running on the server"
        # The temporary table of the cancelled transaction was rolled back.
        assert await conn.fetchval("SELECT to_regclass($1)", f"pg_temp.apg_cancel_{os.getpid()}") is None
    finally:
        await conn.close()


@aio
async def test_notifications(dsn):
    channel = f"apg_ch_{SUFFIX}"
    listener = await connect(dsn)
    sender = await connect(dsn)
    try:
        queue = asyncio.Queue()

        def on_notify(_conn, pid, ch, payload):
            queue.put_nowait((pid, ch, payload))

        await listener.add_listener(channel, on_notify)
        await sender.execute("SELECT pg_notify($1, $2)", channel, "one")
        async with sender.transaction():
            await sender.execute(f"NOTIFY {channel}, 'two'")
            await sender.execute(f"NOTIFY {channel}, 'not sent: rolled back'")
            await sender.execute("SAVEPOINT s")
            await sender.execute("ROLLBACK TO SAVEPOINT s")
        tr = sender.transaction()
        await tr.start()
        await sender.execute(f"NOTIFY {channel}, 'rolled back'")
        await tr.rollback()
        await listener.execute(f"NOTIFY {channel}, 'self'")
        received = [await asyncio.wait_for(queue.get(), 10) for _ in range(4)]
        sender_pid, own_pid = sender.get_server_pid(), listener.get_server_pid()
        assert sender_pid != own_pid
        assert received == [
            (sender_pid, channel, "one"),
            (sender_pid, channel, "two"),
            (sender_pid, channel, "not sent: rolled back"),
            (own_pid, channel, "self"),
        ], (received, sender_pid, own_pid)
        # UNLISTEN: nothing more arrives.
        await listener.remove_listener(channel, on_notify)
        await sender.execute(f"NOTIFY {channel}, 'after UNLISTEN'")
        assert await listener.fetchval("SELECT 'roundtrip'") == "roundtrip"
        await asyncio.sleep(0.3)
        assert queue.empty(), queue.get_nowait()
    finally:
        await listener.close()
        await sender.close()


@aio
async def test_custom_types(dsn):
    mood = f"apg_mood_{SUFFIX}"
    point = f"apg_point_{SUFFIX}"
    t = table("types")
    res = resource("types")
    setup = await connect(dsn)
    await setup.execute(
        f"CREATE TYPE {mood} AS ENUM ('sad', 'ok', 'happy'); "
        f"CREATE TYPE {point} AS (x int, y text, m {mood}); "
        f"CREATE TABLE {t} (id int PRIMARY KEY, m {mood}, p {point}, ms {mood}[])"
    )
    await setup.close()
    conn = await connect(dsn, 7, res)  # a fresh connection: it introspects the types
    try:
        async with conn.transaction():
            await conn.execute(f"INSERT INTO {t} VALUES ($1, $2, $3, $4)", 1, "happy", (3, "three", "ok"), ["sad", "ok"])
            await conn.executemany(
                f"INSERT INTO {t} VALUES ($1, $2, $3, $4)", [(i, "sad", (i, str(i), "happy"), []) for i in range(2, 20)]
            )
        r = await conn.fetchrow(f"SELECT m, p, ms FROM {t} WHERE id = $1", 1)
        assert r["m"] == "happy" and tuple(r["p"]) == (3, "three", "ok") and r["ms"] == ["sad", "ok"], r
        assert r["p"]["y"] == "three"
        assert await conn.fetchval(f"SELECT count(*) FROM {t} WHERE m = $1", "sad") == 18
        assert await conn.fetchval(f"SELECT $1::{mood}[]", ["ok", "happy"]) == ["ok", "happy"]
        await assert_fence(res, 7)
        assert await direct_count(t) == 19
    finally:
        await conn.close()


@aio
async def test_invalidated_statement(dsn):
    t = table("alter")
    conn = await connect(dsn)
    other = await connect(dsn)
    try:
        await conn.execute(f"CREATE TABLE {t} (id int, a text)")
        await conn.execute(f"INSERT INTO {t} VALUES (1, 'one')")
        query = f"SELECT * FROM {t} WHERE id = $1"
        assert tuple(await conn.fetchrow(query, 1)) == (1, "one")
        # Another session changes the result type: outside a transaction, asyncpg drops the
        # statement on "cached plan must not change result type" and prepares it again.
        await other.execute(f"ALTER TABLE {t} ADD COLUMN b int DEFAULT 7")
        assert tuple(await conn.fetchrow(query, 1)) == (1, "one", 7)
        # Inside a transaction it cannot retry: InvalidCachedStatementError, the transaction
        # fails, and after it the new statement works.
        await other.execute(f"ALTER TABLE {t} ADD COLUMN c text DEFAULT 'c'")
        try:
            async with conn.transaction():
                await conn.fetchrow(query, 1)
        except asyncpg.InvalidCachedStatementError:
            pass
        else:
            raise AssertionError("no InvalidCachedStatementError inside the transaction")
        assert not conn.is_in_transaction()
        assert tuple(await conn.fetchrow(query, 1)) == (1, "one", 7, "c")
        # The column type changes (same count of columns).
        await other.execute(f"ALTER TABLE {t} ALTER COLUMN b TYPE text")
        assert tuple(await conn.fetchrow(query, 1)) == (1, "one", "7", "c")
        # A prepared write whose table changed under it still runs.
        await conn.execute(f"INSERT INTO {t} (id, a) VALUES ($1, $2)", 2, "two")
        await other.execute(f"ALTER TABLE {t} ADD COLUMN d int")
        await conn.execute(f"INSERT INTO {t} (id, a) VALUES ($1, $2)", 3, "three")
        assert await direct_count(t) == 3
    finally:
        await conn.close()
        await other.close()


@aio
async def test_read_only_stale(dsn):
    t = table("readonly")
    res = resource("readonly")
    mood = f"apg_ro_mood_{SUFFIX}"
    setup = await connect(dsn)
    await setup.execute(
        f"CREATE TYPE {mood} AS ENUM ('a', 'b'); "
        f"CREATE TABLE {t} (id int PRIMARY KEY, who text, m {mood} DEFAULT 'a')"
    )
    await setup.close()
    await take_fence(dsn, res, t)
    a = await connect(dsn, TOKEN_A, res)  # deposed from the start: reads only
    try:
        assert await a.fetchval(f"SELECT count(*) FROM {t}") == 1
        assert (await a.fetchrow(f"SELECT id, who FROM {t} WHERE id = $1", -TOKEN_B))["who"] == "B"
        # First use of the enum: asyncpg's type introspection query.
        assert await a.fetchval(f"SELECT m FROM {t} WHERE id = $1", -TOKEN_B) == "a"
        assert await a.fetchval(f"SELECT $1::{mood}", "b") == "b"
        async with a.transaction():
            assert [r["id"] for r in await a.fetch(f"SELECT id FROM {t}")] == [-TOKEN_B]
            async for r in a.cursor("SELECT g FROM generate_series(1, 100) g", prefetch=7):
                pass
            async with a.transaction():  # a savepoint
                assert await a.fetchval("SELECT 1") == 1
        async with a.transaction(readonly=True, isolation="repeatable_read"):
            assert await a.fetchval(f"SELECT who FROM {t}") == "B"
        stmt = await a.prepare(f"SELECT who FROM {t} WHERE id = $1")
        for _ in range(3):
            assert await stmt.fetchval(-TOKEN_B) == "B"
        buf = io.BytesIO()
        await a.copy_from_query(f"SELECT who FROM {t} WHERE id = $1", -TOKEN_B, output=buf)
        assert buf.getvalue() == b"B\n"
        await a.execute("SELECT 1; SELECT 2")
        await a.reset()  # what a pool runs when it takes the connection back
        # The session is stale for writes all the same.
        rejected = await expect_stale(
            lambda: a.execute(f"INSERT INTO {t} (id, who) VALUES ($1, 'A')", 1), res, TOKEN_A, TOKEN_B, "write"
        )
        assert await direct_count(t, "who = 'A'") == (0 if rejected else 1)
        await assert_idle(a, "after the write")
    finally:
        await a.close()
    # A pool of stale sessions: reads, releases (the reset query), reads again.
    pool = await asyncpg.create_pool(
        **connect_kwargs(dsn), min_size=2, max_size=2,
        server_settings={"fencing.token": str(TOKEN_A), "fencing.resource": res},
    )
    try:
        for _ in range(5):
            async with pool.acquire() as c:
                assert await c.fetchval(f"SELECT who FROM {t} WHERE id = $1", -TOKEN_B) == "B"
        assert await pool.fetchval(f"SELECT count(*) FROM {t} WHERE who = 'B'") == 1
    finally:
        await pool.close()
    await assert_fence(res, TOKEN_B)


if __name__ == "__main__":
    run(globals())
