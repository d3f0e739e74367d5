"""psycopg 3 features beyond test_smoke.py and test_protocol.py, with the fence through
them: pipeline mode (an error in the middle of a pipeline, `executemany`, a fenced
transaction entirely in a pipeline, a stale token in a pipeline), server-side prepared
statements that psycopg evicts (protocol-level Close and SQL `DEALLOCATE`) and
`prepare_threshold` changed at runtime, two-phase commit (`tpc_*`), named server-side
cursors in a fenced transaction, a holdable named cursor whose query writes at commit,
binary COPY, autocommit toggling with nested transactions
(savepoints) and `SET fencing.token` in the middle of a session, and cancel (`cancel()` and
`cancel_safe()`), each followed by fenced writes on the same connection.

Every test checks what landed (rows, fence rows, prepared transactions) with a direct
connection to PostgreSQL (`direct_dsn()`), and what the driver was told.

The script runs directly against PostgreSQL, and through pgfence with the fence on and with
it off (tests/tests/protocol_python.rs). Where the fence is enforced, stale writes are
rejected with exactly FN001 and nothing of them lands, and accepted ones move the fence;
where it is not (directly, fence off), the same stale writes land and pgfence never writes a
fence row. Whether the pgfence behind PGFENCE_DSN enforces the fence is taken from env
PGFENCE_FENCE (`on`/`off`) when set, else probed once: a write with a token through it
either creates that resource's fence row (enforced) or not (printed as a `mode:` line).

Stale writes are tried two ways: with the fence advanced through pgfence (so its fast path
knows it and rejects the write itself), and with the fence advanced behind pgfence's back
(a direct `pgfence.check` call, so the database rejects the transaction at its end).
"""

import decimal
import os
import threading
import time

import psycopg
from psycopg import errors, pq
from psycopg.pq import TransactionStatus

from fence_expect import assert_error, stale
from pgfence_test import direct_dsn, proxy_dsn, run

TOKEN_A = 33
TOKEN_B = 34
# Tables and resources are named after this process, so runs can share a database.
SUFFIX = f"{os.getpid()}_{'proxy' if proxy_dsn() else 'direct'}"


def table(name):
    return f"adv_{name}_{SUFFIX}"


def resource(name):
    r = f"adv.{name}.{SUFFIX}"
    assert len(r) <= 63, r
    return r


def connect(dsn, token=None, res=None, **kwargs):
    """A psycopg connection with the session's fencing settings in the startup packet."""
    options = []
    if res is not None:
        options.append(f"-c fencing.resource={res}")
    if token is not None:
        options.append(f"-c fencing.token={token}")
    if options:
        kwargs["options"] = " ".join(options)
    return psycopg.connect(dsn, **kwargs)


def direct_val(query, params=()):
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        row = d.execute(query, params).fetchone()
        return row[0] if row else None


def direct_ids(t):
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        return [r[0] for r in d.execute(f"SELECT id FROM {t} ORDER BY id")]


def fence_of(res):
    return direct_val("SELECT token FROM pgfence.fences WHERE resource = %s", (res,))


def advance_behind_back(res, token):
    """Moves the fence of `res` to `token` directly in PostgreSQL, as a leader on another
    pgfence would: this pgfence's fast path does not know, so the database must reject."""
    with psycopg.connect(direct_dsn()) as d:
        d.execute("SELECT set_config('fencing.resource', %s, true), set_config('fencing.token', %s, true)", (res, str(token)))
        d.execute("SELECT pgfence.check(NULL, NULL, NULL, NULL, 'test_psycopg_advanced', true)")
        d.commit()
    assert fence_of(res) == token


def take_fence(dsn, res, t, token=TOKEN_B, row=None):
    """Another leader writes with `token` through `dsn` (so the fast path learns the fence
    where the fence is enforced)."""
    with connect(dsn, token=token, res=res, autocommit=True) as b:
        b.execute(f"INSERT INTO {t} (id) VALUES (%s)", (row if row is not None else 900000 + token,))


def _fence_enforced():
    through = proxy_dsn()
    if through is None:
        return False
    env = os.environ.get("PGFENCE_FENCE")
    if env:
        return env == "on"
    res = resource("probe")
    with connect(through, token=1, res=res, autocommit=True) as c:
        c.execute("SELECT pg_current_xact_id()")
    return fence_of(res) == 1


FENCED = _fence_enforced()
print(f"mode: {'fence enforced' if FENCED else 'fence not enforced'}"
      f" ({'through pgfence' if proxy_dsn() else 'direct'})", flush=True)


def assert_fence(res, token, context=""):
    """The fence of `res` is `token` (callers pass what it must be in this mode: without the
    fence pgfence writes no fence row, so it is None or what advance_behind_back set)."""
    got = fence_of(res)
    assert got == token, f"{context}: fence of {res} is {got}, want {token}"


def expect_stale(action, res, token, fence, context):
    """Runs `action`: where the fence is enforced it must raise exactly FN001 (returns
    True), elsewhere it must succeed (returns False)."""
    try:
        action()
    except psycopg.Error as e:
        if not FENCED:
            raise AssertionError(f"{context}: failed without the fence: {e!r}") from e
        assert_error(e, stale(res, token, fence), context)
        return True
    assert not FENCED, f"{context}: the stale write was accepted"
    return False


def assert_idle(conn, context):
    status = conn.info.transaction_status
    assert status == TransactionStatus.IDLE, f"{context}: transaction status {status.name}"


# --- pipeline mode -------------------------------------------------------------------


def test_pipeline_error_mid_pipeline(dsn):
    t, res = table("pipe_err"), resource("pipe_err")
    with connect(dsn, token=TOKEN_A, res=res) as conn:  # autocommit off
        conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        conn.commit()
        # Many statements, the 11th fails: psycopg raises, the rest is skipped, the
        # transaction is failed and rolled back.
        reached = []
        try:
            with conn.pipeline():
                for i in range(10):
                    conn.execute(f"INSERT INTO {t} VALUES (%s, 'before')", (i,))
                conn.execute("SELECT 1 / (%s - 1)", (1,))
                for i in range(10, 20):
                    conn.execute(f"INSERT INTO {t} VALUES (%s, 'after')", (i,))
                    reached.append(i)
                conn.commit()
        except errors.DivisionByZero:
            pass
        else:
            raise AssertionError("the division by zero was not reported")
        assert conn.info.transaction_status in (TransactionStatus.INERROR, TransactionStatus.IDLE)
        conn.rollback()
        assert_idle(conn, "after the failed pipeline")
        assert direct_ids(t) == [], "nothing of the failed transaction landed"

        # The connection works, with prepared statements and fenced writes, in and out of
        # pipelines.
        for i in range(100, 105):
            conn.execute(f"INSERT INTO {t} VALUES (%s, 'after the error')", (i,), prepare=True)
        conn.commit()
        with conn.pipeline():
            conn.execute(f"INSERT INTO {t} VALUES (%s, 'pipelined')", (105,))
            conn.execute(f"UPDATE {t} SET v = 'updated' WHERE id = %s", (100,))
            conn.commit()
        assert direct_ids(t) == list(range(100, 106))
        assert direct_val(f"SELECT v FROM {t} WHERE id = 100") == "updated"
        assert_fence(res, TOKEN_A if FENCED else None, "fenced writes after the error")

    # Autocommit: one batch per sync; the failed batch leaves nothing, the earlier one
    # committed, and the connection writes afterwards.
    with connect(dsn, token=TOKEN_A, res=res, autocommit=True) as conn:
        try:
            with conn.pipeline() as p:
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'batch 1')", (200,))
                p.sync()
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'batch 2')", (201,))
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'duplicate')", (200,))
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'batch 2')", (202,))
                p.sync()
        except errors.UniqueViolation:
            pass
        else:
            raise AssertionError("the duplicate key was not reported")
        assert_idle(conn, "autocommit after the failed batch")
        ids = [i for i in direct_ids(t) if i >= 200]
        assert ids == [200], ids
        with conn.pipeline():
            for i in range(300, 320):
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'after')", (i,))
        assert len([i for i in direct_ids(t) if i >= 300]) == 20
        assert conn.execute("SELECT current_setting('fencing.token')").fetchone() == (str(TOKEN_A),)
    assert_fence(res, TOKEN_A if FENCED else None, "autocommit pipeline")


def test_pipeline_executemany(dsn):
    t, res = table("pipe_many"), resource("pipe_many")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
    with connect(dsn, token=TOKEN_A, res=res) as conn:
        with conn.pipeline():
            with conn.cursor() as cur:
                cur.executemany(f"INSERT INTO {t} VALUES (%s, %s)", [(i, f"v{i}") for i in range(300)])
            with conn.cursor() as cur:
                cur.executemany(
                    f"UPDATE {t} SET v = %s WHERE id = %s RETURNING id",
                    [(f"u{i}", i) for i in range(0, 300, 30)],
                    returning=True,
                )
                returned = []
                while True:
                    returned.append(cur.fetchone()[0])
                    if not cur.nextset():
                        break
            assert direct_ids(t) == [], "not committed yet"
            conn.commit()
        assert returned == list(range(0, 300, 30)), returned
        assert len(direct_ids(t)) == 300
        assert direct_val(f"SELECT v FROM {t} WHERE id = 30") == "u30"
        assert_fence(res, TOKEN_A if FENCED else None, "executemany")
        # executemany in autocommit pipeline mode (each statement its own transaction).
        conn.autocommit = True
        with conn.pipeline():
            conn.cursor().executemany(f"INSERT INTO {t} VALUES (%s, %s)", [(i, "ac") for i in range(1000, 1100)])
        assert len(direct_ids(t)) == 400
    assert_fence(res, TOKEN_A if FENCED else None, "autocommit executemany")


def test_pipeline_fenced_transaction(dsn):
    t, res = table("pipe_tx"), resource("pipe_tx")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
    with connect(dsn, autocommit=True) as conn:
        # The whole fenced transaction in one pipeline: the token by comment, with
        # BEGIN, writes, reads and COMMIT pipelined.
        with conn.pipeline():
            with conn.transaction():
                for i in range(50):
                    conn.execute(
                        f"/* fencing_resource={res} fencing_token={TOKEN_A} */ INSERT INTO {t} VALUES (%s, 'tx')",
                        (i,),
                    )
                count = conn.execute(f"SELECT count(*) FROM {t}")
            with conn.transaction():
                conn.execute(f"/* fencing_resource={res} fencing_token={TOKEN_B} */ INSERT INTO {t} VALUES (%s, 'tx2')", (50,))
        assert count.fetchone() == (50,)
        assert_idle(conn, "after the pipelined transactions")
        assert len(direct_ids(t)) == 51
        assert_fence(res, TOKEN_B if FENCED else None, "pipelined transactions")
        # The same with the token set by SET LOCAL inside the pipelined block.
        with conn.pipeline():
            with conn.transaction():
                conn.execute("SELECT set_config('fencing.resource', %s, true)", (res,))
                conn.execute("SET LOCAL fencing.token = 35")
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'set local')", (60,))
        assert 60 in direct_ids(t)
        assert_fence(res, 35 if FENCED else None, "SET LOCAL in a pipeline")
        assert conn.execute("SELECT current_setting('fencing.token', true)").fetchone() in ((None,), ("",))


def test_pipeline_stale_token(dsn):
    t = table("pipe_stale")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")

    # Fast path: the fence was advanced through this pgfence.
    res = resource("pipe_stale_fast")
    take_fence(dsn, res, t, TOKEN_B)
    with connect(dsn, token=TOKEN_A, res=res) as conn:
        def pipelined():
            with conn.pipeline():
                for i in range(20):
                    conn.execute(f"INSERT INTO {t} VALUES (%s, 'stale')", (i,))
                conn.commit()

        if expect_stale(pipelined, res, TOKEN_A, TOKEN_B, "stale pipeline (fast path)"):
            conn.rollback()
            assert_idle(conn, "after the stale pipeline")
            assert [i for i in direct_ids(t) if i < 1000] == [], "nothing of the stale pipeline landed"
        else:
            assert len([i for i in direct_ids(t) if i < 1000]) == 20
        assert conn.execute("SELECT 'usable'").fetchone() == ("usable",)
        conn.rollback()
    assert_fence(res, TOKEN_B if FENCED else None, "stale pipeline (fast path)")

    # Database path: the fence advanced behind pgfence's back; the check at COMMIT fails.
    res = resource("pipe_stale_db")
    advance_behind_back(res, TOKEN_B)
    with connect(dsn, token=TOKEN_A, res=res, autocommit=True) as conn:
        def pipelined_tx():
            with conn.pipeline():
                with conn.transaction():
                    for i in range(100, 120):
                        conn.execute(f"INSERT INTO {t} VALUES (%s, 'stale')", (i,))

        if expect_stale(pipelined_tx, res, TOKEN_A, TOKEN_B, "stale pipeline (database)"):
            assert_idle(conn, "after the stale pipelined transaction")
            assert [i for i in direct_ids(t) if 100 <= i < 120] == []
            # The rejection is known now: the same again is rejected (fast path).
            expect_stale(pipelined_tx, res, TOKEN_A, TOKEN_B, "stale pipeline again")
            assert [i for i in direct_ids(t) if 100 <= i < 120] == []
            assert_idle(conn, "after the second stale pipelined transaction")
        else:
            assert len([i for i in direct_ids(t) if 100 <= i < 120]) == 20
        # A newer token on the same connection works at once.
        conn.execute("SET fencing.token = 40")
        with conn.pipeline():
            with conn.transaction():
                conn.execute(f"INSERT INTO {t} VALUES (%s, 'new leader')", (500,))
        assert 500 in direct_ids(t)
    assert_fence(res, 40 if FENCED else TOKEN_B, "new token after the stale pipeline")


# --- prepared statements -------------------------------------------------------------


def _prepared_names(conn):
    return sorted(r[0] for r in conn.execute("SELECT name FROM pg_prepared_statements"))


def test_prepared_eviction(dsn):
    import psycopg._connection_base as base

    t, res = table("prep"), resource("prep")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v int)")
    # psycopg evicts with a protocol-level Close when libpq has it (17+), else with SQL
    # `DEALLOCATE name`: both ways, by switching psycopg's own capability flag.
    ways = [("close", True), ("deallocate", False)] if base._HAS_SEND_CLOSE else [("deallocate", False)]
    saved = base._HAS_SEND_CLOSE
    try:
        for n, (way, has_close) in enumerate(ways):
            base._HAS_SEND_CLOSE = has_close
            for autocommit in (False, True):
                offset = n * 10000 + (5000 if autocommit else 0)
                with connect(dsn, token=TOKEN_A, res=res, prepare_threshold=0, autocommit=autocommit) as conn:
                    conn.prepared_max = 2
                    for i in range(25):
                        # 25 distinct statements (different texts), every one prepared as
                        # _pg3_N; psycopg keeps 2 and deallocates the others.
                        conn.execute(f"INSERT INTO {t} VALUES (%s, %s) /* stmt {i} */", (offset + i, i))
                        got = conn.execute(f"SELECT v + {i} FROM {t} WHERE id = %s", (offset + i,)).fetchone()
                        assert got == (2 * i,), (way, i, got)
                        if i % 5 == 4 and not autocommit:
                            conn.commit()
                    if not autocommit:
                        conn.commit()
                    names = [x for x in _prepared_names(conn) if x.startswith("_pg3_")]
                    assert len(names) <= 3, (way, names)
                    # An error, a rollback (psycopg then deallocates all with DEALLOCATE ALL),
                    # then more prepared fenced writes.
                    try:
                        conn.execute(f"INSERT INTO {t} VALUES (%s, 0)", (offset,))
                    except errors.UniqueViolation:
                        if not autocommit:
                            conn.rollback()
                    else:
                        raise AssertionError("duplicate accepted")
                    for i in range(25, 30):
                        conn.execute(f"INSERT INTO {t} VALUES (%s, %s) /* stmt {i} */", (offset + i, i))
                    if not autocommit:
                        conn.commit()
                    assert_idle(conn, f"{way} autocommit={autocommit}")
                got = direct_val(f"SELECT count(*) FROM {t} WHERE id >= %s AND id < %s", (offset, offset + 1000))
                assert got == 30, (way, autocommit, got)
    finally:
        base._HAS_SEND_CLOSE = saved
    assert_fence(res, TOKEN_A if FENCED else None, "prepared eviction")

    # A stale write through a prepared statement psycopg already has, in both paths.
    take_fence(dsn, res, t, TOKEN_B, row=999999)
    with connect(dsn, token=TOKEN_A, res=res, prepare_threshold=0) as conn:
        conn.prepared_max = 2
        for i in range(3):
            def write(i=i):
                conn.execute(f"INSERT INTO {t} VALUES (%s, %s) /* stale {i} */", (700000 + i, i))
                conn.commit()

            if expect_stale(write, res, TOKEN_A, TOKEN_B, f"stale prepared write {i}"):
                conn.rollback()
        assert_idle(conn, "after the stale prepared writes")
    landed = direct_val(f"SELECT count(*) FROM {t} WHERE id >= 700000 AND id < 700010")
    assert landed == (0 if FENCED else 3), landed


def test_prepare_threshold_runtime(dsn):
    t, res = table("threshold"), resource("threshold")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    with connect(dsn, token=TOKEN_A, res=res, prepare_threshold=1) as conn:
        query = f"INSERT INTO {t} VALUES (%s)"
        for i in range(5):
            conn.execute(query, (i,))
        conn.commit()
        prepared = [x for x in _prepared_names(conn) if x.startswith("_pg3_")]
        assert prepared, "psycopg prepared nothing with prepare_threshold=1"
        conn.rollback()
        # No more preparing: the unnamed statement from now on; psycopg keeps the ones it has.
        conn.prepare_threshold = None
        for i in range(5, 15):
            conn.execute(query, (i,))
            conn.execute(f"INSERT INTO {t} VALUES (%s) /* new text {i} */", (100 + i,))
        conn.commit()
        now = [x for x in _prepared_names(conn) if x.startswith("_pg3_")]
        assert set(now) <= set(prepared), (now, prepared)
        conn.rollback()
        # And back to preparing everything.
        conn.prepare_threshold = 0
        for i in range(15, 20):
            conn.execute(f"INSERT INTO {t} VALUES (%s) /* again {i} */", (i,))
        conn.commit()
        assert_idle(conn, "after switching prepare_threshold")
    assert len(direct_ids(t)) == 30
    assert_fence(res, TOKEN_A if FENCED else None, "prepare_threshold at runtime")


def _show(r):
    return (pq.ExecStatus(r.status).name, r.error_field(pq.DiagnosticField.SQLSTATE))


def test_statement_name_reparse(dsn):
    """A named statement that writes stays what the server has, whatever Parse of the same
    name the server refused (42P05: it exists) or skipped (an error earlier in the batch):
    its Execute with a stale token is rejected, and nothing lands. (psycopg's low-level
    libpq API, as a driver that reuses statement names would send it.)"""
    t = table("reparse")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (who text)")
    failures = []
    for route in ("refused", "skipped"):
        for path in ("database", "fast"):
            res = resource(f"reparse_{route}_{path}")
            if path == "fast":
                with connect(dsn, token=TOKEN_B, res=res, autocommit=True) as b:
                    b.execute(f"INSERT INTO {t} VALUES ('token {TOKEN_B}')")
            else:
                advance_behind_back(res, TOKEN_B)
            who = f"stale {route} {path}"
            with connect(dsn, token=TOKEN_A, res=res, autocommit=True) as conn:
                pg = conn.pgconn
                r = pg.prepare(b"adv_s1", f"INSERT INTO {t} VALUES ('{who}')".encode())
                assert _show(r) == ("COMMAND_OK", None), _show(r)
                if route == "refused":
                    r = pg.prepare(b"adv_s1", b"SELECT 1")
                    assert _show(r) == ("FATAL_ERROR", b"42P05"), _show(r)
                else:
                    pg.enter_pipeline_mode()
                    pg.send_query_params(b"SELECT 1/0", None)
                    pg.send_close_prepared(b"adv_s1")
                    pg.send_prepare(b"adv_s1", b"SELECT 1")
                    pg.pipeline_sync()
                    got = []
                    while True:
                        r = pg.get_result()
                        got.append(_show(r))
                        if r.status == pq.ExecStatus.PIPELINE_SYNC:
                            break
                        assert pg.get_result() is None
                    pg.exit_pipeline_mode()
                    assert got == [
                        ("FATAL_ERROR", b"22012"),
                        ("PIPELINE_ABORTED", None),
                        ("PIPELINE_ABORTED", None),
                        ("PIPELINE_SYNC", None),
                    ], got
                # The server still has the INSERT under this name.
                r = pg.exec_prepared(b"adv_s1", [])
                context = f"Execute of the INSERT after a {route} re-Parse ({path} path)"
                want = ("FATAL_ERROR", b"FN001") if FENCED else ("COMMAND_OK", None)
                landed = direct_val(f"SELECT count(*) FROM {t} WHERE who = %s", (who,))
                if _show(r) != want or landed != (0 if FENCED else 1):
                    failures.append(f"{context}: got {_show(r)}, want {want}; {landed} stale row(s) landed")
                assert conn.pgconn.transaction_status == pq.TransactionStatus.IDLE
    # Every case is tried before the test fails, so one run shows them all.
    assert not failures, "\n".join(failures)


# --- two-phase commit ----------------------------------------------------------------


def _max_prepared_transactions():
    return int(direct_val("SHOW max_prepared_transactions"))


def _prepared_xacts(*xids):
    """Which of `xids` (psycopg Xids) are prepared in the server."""
    gids = [str(x) for x in xids]
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        return [r[0] for r in d.execute("SELECT gid FROM pg_prepared_xacts WHERE gid = ANY(%s)", (gids,))]


def test_two_phase_commit(dsn):
    if _max_prepared_transactions() == 0:
        # Checked directly: the server itself cannot prepare transactions.
        print("skip two_phase_commit: the server has max_prepared_transactions = 0", flush=True)
        return
    created = []
    try:
        _two_phase_commit(dsn, created)
    finally:
        # A transaction left prepared would hold its locks (on its fence row too) forever.
        left = _prepared_xacts(*created) if created else []
        with psycopg.connect(direct_dsn(), autocommit=True) as d:
            for gid in left:
                d.execute(f"ROLLBACK PREPARED '{gid}'")
        assert left == [], f"left prepared (rolled back directly now): {left}"


def _tpc_connect(dsn, created, **kwargs):
    """A connection whose statements (pgfence's included) give up after 10 s, and whose
    xids are recorded in `created` for the cleanup."""
    conn = connect(dsn, **kwargs)
    conn.execute("SET statement_timeout = '10s'")
    conn.commit()
    make = conn.xid

    def xid(*args):
        x = make(*args)
        created.append(x)
        return x

    conn.xid = xid
    return conn


def _two_phase_commit(dsn, created):
    t = table("tpc")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")

    # A current token: prepared, then committed; the fence moves when the prepared
    # transaction (which holds the check's advance) commits.
    res = resource("tpc")
    with _tpc_connect(dsn, created, token=TOKEN_A, res=res) as conn:
        xid = conn.xid(42, f"gtx-{SUFFIX}", "branch-1")
        conn.tpc_begin(xid)
        conn.execute(f"INSERT INTO {t} VALUES (%s)", (1,))
        conn.tpc_prepare()
        assert _prepared_xacts(xid) == [str(xid)], "not prepared"
        assert direct_ids(t) == []
        # The check's advance of the fence is part of the prepared transaction.
        assert_fence(res, None, "at PREPARE TRANSACTION")
        conn.tpc_commit()
        assert _prepared_xacts(xid) == []
        assert direct_ids(t) == [1]
        assert_fence(res, TOKEN_A if FENCED else None, "at COMMIT PREPARED")
        assert_idle(conn, "after tpc_commit")
        # tpc_recover and a rollback of a prepared transaction.
        xid2 = conn.xid(42, f"gtx2-{SUFFIX}", "branch-1")
        conn.tpc_begin(xid2)
        conn.execute(f"INSERT INTO {t} VALUES (%s)", (2,))
        conn.tpc_prepare()
        # Recovered from another connection (through the same path); rolled back by
        # this one (ROLLBACK PREPARED).
        with psycopg.connect(dsn) as other:
            assert any(x.gtrid == f"gtx2-{SUFFIX}" for x in other.tpc_recover())
        conn.tpc_rollback()
        assert _prepared_xacts(xid2) == []
        # One-phase: tpc_commit without tpc_prepare.
        conn.tpc_begin(conn.xid(42, f"gtx3-{SUFFIX}", "b"))
        conn.execute(f"INSERT INTO {t} VALUES (%s)", (3,))
        conn.tpc_commit()
        assert direct_ids(t) == [1, 3]
        conn.execute(f"INSERT INTO {t} VALUES (%s)", (4,))
        conn.commit()
    assert direct_ids(t) == [1, 3, 4]
    assert_fence(res, TOKEN_A if FENCED else None, "after two-phase commits")

    # A stale token: rejected at the write (fast path) or at PREPARE TRANSACTION
    # (database); nothing is left prepared and nothing lands.
    for path, res in (("fast", resource("tpc_fast")), ("database", resource("tpc_db"))):
        if path == "fast":
            take_fence(dsn, res, t, TOKEN_B, row=1000)
        else:
            advance_behind_back(res, TOKEN_B)
        gtrid = f"stale-{path}-{SUFFIX}"
        with _tpc_connect(dsn, created, token=TOKEN_A, res=res) as conn:
            stale_xid = conn.xid(42, gtrid, "b")
            new_xid = conn.xid(42, gtrid + "-new", "b")

            def two_phase():
                conn.tpc_begin(stale_xid)
                conn.execute(f"INSERT INTO {t} VALUES (%s)", (2000 if path == "fast" else 3000,))
                conn.tpc_prepare()
                conn.tpc_commit()

            go_on = conn
            if expect_stale(two_phase, res, TOKEN_A, TOKEN_B, f"stale two-phase ({path})"):
                assert _prepared_xacts(stale_xid) == [], f"{path}: left prepared"
                try:
                    conn.tpc_rollback()
                    assert_idle(conn, f"after the stale two-phase ({path})")
                except psycopg.errors.UndefinedObject:
                    # Rejected at PREPARE TRANSACTION (the database path): nothing was
                    # prepared, which psycopg learns from its ROLLBACK PREPARED. psycopg
                    # marks the transaction prepared before PREPARE runs, so it stays in
                    # two-phase mode, as after any PREPARE TRANSACTION that fails (a
                    # deferred constraint, say): go on with a new connection.
                    assert path == "database", path
                    conn.close()
                    go_on = _tpc_connect(dsn, created, token=TOKEN_A, res=res)
                stale_ids = [i for i in direct_ids(t) if i in (2000, 3000)]
                assert stale_ids == [], (path, direct_ids(t))
            else:
                assert _prepared_xacts(stale_xid) == []
            # The session goes on, with a new token.
            with go_on:
                go_on.execute("SET fencing.token = 50")
                go_on.commit()
                go_on.tpc_begin(new_xid)
                go_on.execute(f"INSERT INTO {t} VALUES (%s)", (4000 if path == "fast" else 5000,))
                go_on.tpc_prepare()
                go_on.tpc_commit()
                assert_idle(go_on, f"after the new token ({path})")
                assert _prepared_xacts(stale_xid, new_xid) == []
        assert_fence(res, 50 if FENCED else (None if path == "fast" else TOKEN_B), f"new token ({path})")
    ids = direct_ids(t)
    want = [1, 3, 4, 1000, 4000, 5000] + ([] if FENCED else [2000, 3000])
    assert ids == sorted(want), ids


def test_failed_commit_then_lower_token(dsn):
    """A check passes, then the COMMIT fails after it (a deferred constraint): the token of
    that transaction was never accepted, so a later write with a lower token that is still
    above the fence must land, as the database decides. (pgfence's fast path must not have
    learned the fence from the check of a transaction that did not commit.)"""
    t, res = table("deferred"), resource("deferred")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(
            f"""
            CREATE TABLE {t} (id int PRIMARY KEY);
            CREATE FUNCTION {t}_fail() RETURNS trigger LANGUAGE plpgsql AS $$
                BEGIN IF NEW.id = 40 THEN RAISE EXCEPTION 'deferred failure {t}'; END IF; RETURN NULL; END $$;
            CREATE CONSTRAINT TRIGGER {t}_t AFTER INSERT ON {t}
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION {t}_fail();
            """
        )
    with connect(dsn, token=30, res=res, autocommit=True) as conn:
        conn.execute(f"INSERT INTO {t} VALUES (30)")
    assert_fence(res, 30 if FENCED else None, "token 30")
    for autocommit in (True, False):
        with connect(dsn, token=40, res=res, autocommit=autocommit) as conn:
            try:
                conn.execute(f"INSERT INTO {t} VALUES (40)")
                if not autocommit:
                    conn.commit()
            except errors.RaiseException as e:
                assert f"deferred failure {t}" in str(e), e
            else:
                raise AssertionError("the deferred constraint did not fail")
            assert_idle(conn, "after the failed COMMIT")
        assert_fence(res, 30 if FENCED else None, "after the failed COMMIT of token 40")
    # Token 35: above the fence (30), below the token whose transaction failed (40).
    with connect(dsn, token=35, res=res) as conn:
        conn.execute(f"INSERT INTO {t} VALUES (35)")
        conn.commit()
    assert direct_ids(t) == [30, 35]
    assert_fence(res, 35 if FENCED else None, "token 35")


# --- server-side cursors -------------------------------------------------------------


def test_named_cursor_fenced_transaction(dsn):
    t, src, res = table("cur"), table("cur_src"), resource("cur")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {src} AS SELECT g AS id FROM generate_series(1, 2000) g")
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    with connect(dsn, token=TOKEN_A, res=res) as conn:
        with conn.cursor(name="adv_cur") as cur:
            cur.itersize = 7
            cur.execute(f"SELECT id FROM {src} WHERE id %% 10 = %s ORDER BY id", (3,))
            seen = [r[0] for r in cur]
        assert len(seen) == 200 and seen[0] == 3, seen[:3]
        # A write in the same transaction, after the cursor, committed with the check.
        with conn.cursor() as w:
            w.executemany(f"INSERT INTO {t} VALUES (%s)", [(i,) for i in seen[:50]])
        # A second cursor, fetched while writes interleave.
        with conn.cursor(name="adv_cur2") as cur:
            cur.itersize = 3
            cur.execute(f"SELECT id FROM {src} WHERE id > 1990 ORDER BY id")
            for (i,) in cur:
                conn.execute(f"INSERT INTO {t} VALUES (%s)", (i,))
        assert direct_ids(t) == [], "not committed yet"
        conn.commit()
        assert len(direct_ids(t)) == 60
        assert_fence(res, TOKEN_A if FENCED else None, "cursor transaction")
        assert_idle(conn, "after the cursor transaction")

    # The same with a stale token, fast path and database: nothing lands.
    for path, res2 in (("fast", resource("cur_fast")), ("database", resource("cur_db"))):
        if path == "fast":
            take_fence(dsn, res2, t, TOKEN_B, row=10000)
        else:
            advance_behind_back(res2, TOKEN_B)
        with connect(dsn, token=TOKEN_A, res=res2) as conn:
            def cursor_then_write():
                with conn.cursor(name="adv_stale_cur") as cur:
                    cur.itersize = 5
                    cur.execute(f"SELECT id FROM {src} WHERE id <= 20 ORDER BY id")
                    rows = [r[0] for r in cur]
                assert rows == list(range(1, 21))
                conn.execute(f"INSERT INTO {t} VALUES (%s)", (20000 if path == "fast" else 30000,))
                conn.commit()

            if expect_stale(cursor_then_write, res2, TOKEN_A, TOKEN_B, f"stale cursor transaction ({path})"):
                conn.rollback()
                assert_idle(conn, f"after the stale cursor transaction ({path})")
            # Reads still work; with a new token, named cursors too (with a stale one the
            # fast path rejects FETCH, which the classifier takes for a possible write).
            assert conn.execute(f"SELECT count(*) FROM {src}").fetchone() == (2000,)
            conn.execute("SET fencing.token = 50")
            with conn.cursor(name="adv_after") as cur:
                cur.execute(f"SELECT count(*) FROM {src}")
                assert cur.fetchone() == (2000,)
            conn.rollback()
        mine = 20000 if path == "fast" else 30000
        landed = [i for i in direct_ids(t) if mine <= i < mine + 10000]
        assert landed == ([] if FENCED else [mine]), (path, landed)
    landed = [i for i in direct_ids(t) if i >= 20000]
    assert landed == ([] if FENCED else [20000, 30000]), landed


def test_named_cursor_withhold_writes_at_commit(dsn):
    """A named cursor `withhold=True` in autocommit is `DECLARE ... WITH HOLD`: PostgreSQL
    runs its query when the statement's transaction commits, after pgfence's check. A query
    that writes must be fenced all the same."""
    t, fn, res = table("hold"), table("hold_fn"), resource("hold")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
        d.execute(f"CREATE FUNCTION {fn}(n int) RETURNS int LANGUAGE sql"
                  f" AS $$ INSERT INTO {t} VALUES (n) RETURNING n $$")
    advance_behind_back(res, TOKEN_B)
    with connect(dsn, token=TOKEN_A, res=res, autocommit=True) as conn:
        def declare_stale():
            with conn.cursor(name="adv_hold_stale", withhold=True) as cur:
                cur.execute(f"SELECT {fn}(g) FROM generate_series(1, 3) g")
                assert [r[0] for r in cur.fetchall()] == [1, 2, 3]

        expect_stale(declare_stale, res, TOKEN_A, TOKEN_B, "stale holdable cursor")
        assert_idle(conn, "after the stale holdable cursor")
    assert direct_ids(t) == ([] if FENCED else [1, 2, 3])
    with connect(dsn, token=TOKEN_B, res=res, autocommit=True) as conn:
        with conn.cursor(name="adv_hold", withhold=True) as cur:
            cur.execute(f"SELECT {fn}(g) FROM generate_series(11, 13) g")
            assert [r[0] for r in cur.fetchall()] == [11, 12, 13]
    assert [i for i in direct_ids(t) if i > 10] == [11, 12, 13]
    assert_fence(res, TOKEN_B, "after the current leader's holdable cursor")


# --- COPY ----------------------------------------------------------------------------


def test_copy_binary(dsn):
    t, res = table("copy"), resource("copy")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, t text, b bytea, n numeric)")
    with connect(dsn, token=TOKEN_A, res=res) as conn, conn.cursor() as cur:
        with cur.copy(f"COPY {t} (id, t, b, n) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["int4", "text", "bytea", "numeric"])
            for i in range(2000):
                copy.write_row((i, f"r{i}", bytes([i % 256, 0, 255]), decimal.Decimal(i) / 4))
        cur.execute(f"INSERT INTO {t} (id) VALUES (%s)", (5000,))
        assert direct_ids(t) == []
        conn.commit()
        assert len(direct_ids(t)) == 2001
        assert direct_val(f"SELECT b FROM {t} WHERE id = 257") == bytes([1, 0, 255])
        assert_fence(res, TOKEN_A if FENCED else None, "binary COPY")
        # Binary COPY out of the same rows.
        with cur.copy(f"COPY (SELECT id, n FROM {t} WHERE id < 3 ORDER BY id) TO STDOUT (FORMAT BINARY)") as copy:
            copy.set_types(["int4", "numeric"])
            rows = list(copy.rows())
        assert [r[0] for r in rows] == [0, 1, 2], rows
        conn.commit()

    # Stale: in a transaction (fast path, then database), and in autocommit.
    for path, autocommit in (("fast", False), ("database", False), ("fast", True), ("database", True)):
        res2 = resource(f"copy_{path}_{int(autocommit)}")
        if path == "fast":
            take_fence(dsn, res2, t, TOKEN_B, row=100000 + len(res2) + (1000 if autocommit else 0))
        else:
            advance_behind_back(res2, TOKEN_B)
        base = {("fast", False): 10000, ("database", False): 20000, ("fast", True): 30000, ("database", True): 40000}[(path, autocommit)]
        with connect(dsn, token=TOKEN_A, res=res2, autocommit=autocommit) as conn, conn.cursor() as cur:
            def stale_copy():
                with cur.copy(f"COPY {t} (id, t) FROM STDIN (FORMAT BINARY)") as copy:
                    copy.set_types(["int4", "text"])
                    for i in range(base, base + 100):
                        copy.write_row((i, "stale"))
                if not autocommit:
                    conn.commit()

            context = f"stale binary COPY ({path}, autocommit={autocommit})"
            if expect_stale(stale_copy, res2, TOKEN_A, TOKEN_B, context):
                conn.rollback()
            assert_idle(conn, context)
            got = [i for i in direct_ids(t) if base <= i < base + 100]
            assert len(got) == (0 if FENCED else 100), (context, len(got))
            # A COPY ... TO STDOUT only reads: the stale token does not stop it.
            with cur.copy(f"COPY (SELECT count(*) FROM {t} WHERE id < 0) TO STDOUT") as copy:
                assert b"".join(bytes(b) for b in copy) == b"0\n", context
            with cur.copy(f"COPY {t} (id) TO STDOUT (FORMAT csv)") as copy:
                assert b"".join(bytes(b) for b in copy).count(b"\n") == len(direct_ids(t)), context
            # With a new token, the connection copies both ways again.
            conn.execute("SET fencing.token = 60")
            with cur.copy("COPY (SELECT 1) TO STDOUT") as copy:
                assert b"".join(bytes(b) for b in copy) == b"1\n"
            with cur.copy(f"COPY {t} (id) FROM STDIN (FORMAT BINARY)") as copy:
                copy.set_types(["int4"])
                copy.write_row((base + 500,))
            if not autocommit:
                conn.commit()
            assert base + 500 in direct_ids(t), context
        assert_fence(res2, 60 if FENCED else (None if path == "fast" else TOKEN_B), context)


# --- autocommit, savepoints, SET fencing.token ---------------------------------------


def test_autocommit_savepoints_set_token(dsn):
    t, res = table("ac"), resource("ac")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    with connect(dsn, res=res) as conn:
        conn.execute("SET fencing.token = 10")
        conn.execute(f"INSERT INTO {t} VALUES (1)")
        conn.commit()
        assert_fence(res, 10 if FENCED else None, "SET in a transaction")
        # Autocommit on: every statement its own transaction.
        conn.autocommit = True
        conn.execute(f"INSERT INTO {t} VALUES (2)")
        assert 2 in direct_ids(t)
        conn.execute("SET fencing.token = 11")
        conn.execute(f"INSERT INTO {t} VALUES (3)")
        assert_fence(res, 11 if FENCED else None, "SET in autocommit")
        # Nested transactions: the inner one fails and is rolled back to its savepoint.
        with conn.transaction():
            conn.execute(f"INSERT INTO {t} VALUES (4)")
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {t} VALUES (5)")
                    conn.execute(f"INSERT INTO {t} VALUES (4)")  # duplicate: fails
            except errors.UniqueViolation:
                pass
            else:
                raise AssertionError("duplicate accepted")
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {t} VALUES (6)")
                    raise RuntimeError("roll back the savepoint")
            except RuntimeError:
                pass
            with conn.transaction():
                conn.execute(f"INSERT INTO {t} VALUES (7)")
            assert direct_ids(t) == [1, 2, 3], "the outer transaction has not committed"
        assert direct_ids(t) == [1, 2, 3, 4, 7]
        assert_idle(conn, "after the nested transactions")
        # Autocommit off again: SET in a rolled-back transaction is undone.
        conn.autocommit = False
        conn.execute("SET fencing.token = 99")
        conn.rollback()
        assert conn.execute("SHOW fencing.token").fetchone() == ("11",)
        conn.execute(f"INSERT INTO {t} VALUES (8)")
        conn.commit()
        assert_fence(res, 11 if FENCED else None, "after the undone SET")
        # A session token advanced by another leader: stale now (fast path knows).
        take_fence(dsn, res, t, 20, row=100)
        def stale_write():
            conn.execute(f"INSERT INTO {t} VALUES (9)")
            conn.commit()

        if expect_stale(stale_write, res, 11, 20, "stale SET token"):
            conn.rollback()
            assert 9 not in direct_ids(t)
        assert_idle(conn, "after the stale write")
        # Nested transactions with the stale token: rejected at the outer COMMIT.
        conn.autocommit = True
        def nested_stale():
            with conn.transaction():
                conn.execute("SELECT 1")
                with conn.transaction():
                    conn.execute(f"INSERT INTO {t} VALUES (10)")

        if expect_stale(nested_stale, res, 11, 20, "stale nested"):
            assert 10 not in direct_ids(t)
        assert_idle(conn, "after the stale nested transaction")
        # The new token mid-session: accepted at once.
        conn.execute("SET fencing.token = 21")
        with conn.transaction():
            with conn.transaction():
                conn.execute(f"INSERT INTO {t} VALUES (11)")
        conn.execute(f"INSERT INTO {t} VALUES (12)")
        assert {11, 12} <= set(direct_ids(t))
        assert_fence(res, 21 if FENCED else None, "new token mid-session")
        assert conn.execute("SHOW fencing.token").fetchone() == ("21",)


# --- cancel --------------------------------------------------------------------------


def _cancel_until(conn, method, done):
    while not done.wait(0.3):
        getattr(conn, method)()


def test_cancel_then_fenced_writes(dsn):
    t, res = table("cancel"), resource("cancel")
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        d.execute(f"CREATE TABLE {t} (id int PRIMARY KEY)")
    methods = ["cancel"] + (["cancel_safe"] if hasattr(psycopg.Connection, "cancel_safe") else [])
    print(f"cancel methods: {methods}", flush=True)
    with connect(dsn, token=TOKEN_A, res=res) as conn:
        for n, method in enumerate(methods):
            for in_tx_write in (False, True):
                if in_tx_write:
                    conn.execute(f"INSERT INTO {t} VALUES (%s)", (1000 + n,))
                done = threading.Event()
                canceller = threading.Thread(target=_cancel_until, args=(conn, method, done))
                canceller.start()
                started = time.monotonic()
                try:
                    conn.execute("SELECT pg_sleep(30)")
                except errors.QueryCanceled:
                    pass
                else:
                    raise AssertionError(f"{method}: pg_sleep was not cancelled")
                finally:
                    done.set()
                    canceller.join()
                assert time.monotonic() - started < 10, method
                assert conn.info.transaction_status == TransactionStatus.INERROR
                conn.rollback()
                assert 1000 + n not in direct_ids(t), "the write before the cancel was rolled back"
                # Fenced writes on the same connection, extended and simple protocol.
                conn.execute(f"INSERT INTO {t} VALUES (%s)", (n * 10 + int(in_tx_write),))
                conn.execute(f"INSERT INTO {t} VALUES ({n * 10 + 5 + int(in_tx_write)})")
                conn.commit()
                assert_idle(conn, f"after {method}")
        # Cancel in autocommit, a pipelined write after it.
        conn.autocommit = True
        done = threading.Event()
        canceller = threading.Thread(target=_cancel_until, args=(conn, methods[-1], done))
        canceller.start()
        try:
            conn.execute("SELECT pg_sleep(30)")
        except errors.QueryCanceled:
            pass
        else:
            raise AssertionError("pg_sleep was not cancelled in autocommit")
        finally:
            done.set()
            canceller.join()
        with conn.pipeline():
            conn.execute(f"INSERT INTO {t} VALUES (%s)", (500,))
    want = sorted([n * 10 + k for n in range(len(methods)) for k in (0, 1, 5, 6)] + [500])
    assert direct_ids(t) == want, direct_ids(t)
    assert_fence(res, TOKEN_A if FENCED else None, "after the cancels")
    # A cancel, then the token becomes stale (another leader writes), then a write: the
    # pg_sleep runs before (the fast path would reject it with a stale token: it is a
    # function call, which the classifier takes for a possible write).
    with connect(dsn, token=TOKEN_A, res=res) as conn:
        done = threading.Event()
        canceller = threading.Thread(target=_cancel_until, args=(conn, "cancel", done))
        canceller.start()
        try:
            conn.execute("SELECT pg_sleep(30)")
        except errors.QueryCanceled:
            conn.rollback()
        finally:
            done.set()
            canceller.join()
        take_fence(dsn, res, t, TOKEN_B, row=600)

        def stale_write():
            conn.execute(f"INSERT INTO {t} VALUES (%s)", (700,))
            conn.commit()

        if expect_stale(stale_write, res, TOKEN_A, TOKEN_B, "stale after cancel"):
            conn.rollback()
        assert_idle(conn, "after the stale write")
    assert (700 in direct_ids(t)) == (not FENCED)


if __name__ == "__main__":
    run(globals())
