"""psycopg 3 through pgfence (PGFENCE_DSN), beyond the smoke script: parameterized queries,
pipeline mode (with an error inside the pipeline), COPY both ways, named server-side
cursors, autocommit on and off (checked behind pgfence's back with direct_dsn()),
notifications, cancel, and a SCRAM login. Runs against PostgreSQL directly when
PGFENCE_DSN is not set, so the expectations themselves are checked there."""

import os
import threading
import time

import psycopg
from psycopg import errors, pq

from pgfence_test import direct_dsn, run

# Every test uses tables named after this process, so runs can share a database.
SUFFIX = f"{os.getpid()}_{'proxy' if os.environ.get('PGFENCE_DSN') else 'direct'}"


def table(name):
    return f"{name}_{SUFFIX}"


def direct_count(t):
    with psycopg.connect(direct_dsn(), autocommit=True) as conn:
        return conn.execute(f"SELECT count(*) FROM {t}").fetchone()[0]


def test_parameters(dsn):
    with psycopg.connect(dsn) as conn:
        t = table("params")
        conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, name text, tags text[], doc jsonb, at timestamptz)")
        rows = [(i, f"name {i} é", [f"t{i}", "x"], psycopg.types.json.Jsonb({"i": i}), None) for i in range(100)]
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO {t} VALUES (%s, %s, %s, %s, %s)", rows)
            cur.execute(f"SELECT name, tags, doc FROM {t} WHERE id = %(id)s", {"id": 42})
            assert cur.fetchone() == ("name 42 é", ["t42", "x"], {"i": 42})
            cur.execute(f"SELECT count(*) FROM {t} WHERE id = ANY(%s)", ([1, 2, 3, 1000],))
            assert cur.fetchone() == (3,)
            # Binary parameters and results, a prepared statement reused many times.
            bcur = conn.cursor(binary=True)
            for i in range(10):
                bcur.execute(f"SELECT id, name FROM {t} WHERE id = %b", (i,), prepare=True)
                assert bcur.fetchone() == (i, f"name {i} é")
            # An error, then the session goes on after the rollback.
            try:
                cur.execute(f"INSERT INTO {t} (id) VALUES (%s)", (1,))
            except errors.UniqueViolation:
                pass
            else:
                raise AssertionError("duplicate accepted")
        conn.rollback()
        # The table was created in the rolled-back transaction: gone too.
        with psycopg.connect(direct_dsn()) as d:
            assert d.execute("SELECT to_regclass(%s)", (t,)).fetchone() == (None,)
        conn.execute(f"CREATE TABLE {t} (id int)")
        conn.execute(f"INSERT INTO {t} VALUES (%s)", (7,))
        conn.commit()
        assert direct_count(t) == 1


def test_autocommit(dsn):
    t = table("autocommit")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {t} (id int)")
        conn.execute(f"INSERT INTO {t} VALUES (1)")
        assert direct_count(t) == 1, "autocommit: visible at once"
        assert conn.info.transaction_status == pq.TransactionStatus.IDLE
        # An explicit transaction block inside autocommit.
        with conn.transaction():
            conn.execute(f"INSERT INTO {t} VALUES (2)")
            assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
            assert direct_count(t) == 1
        assert direct_count(t) == 2
        # Nested transaction (a savepoint) rolled back by an exception.
        with conn.transaction():
            conn.execute(f"INSERT INTO {t} VALUES (3)")
            try:
                with conn.transaction():
                    conn.execute(f"INSERT INTO {t} VALUES (4)")
                    raise RuntimeError("roll back the savepoint")
            except RuntimeError:
                pass
        assert direct_count(t) == 3
        # Statements that cannot run in a transaction block need autocommit.
        conn.execute(f"VACUUM {t}")

    with psycopg.connect(dsn) as conn:  # autocommit off: psycopg opens a transaction
        conn.execute(f"INSERT INTO {t} VALUES (10)")
        assert conn.info.transaction_status == pq.TransactionStatus.INTRANS
        assert direct_count(t) == 3, "not committed yet"
        conn.rollback()
        conn.execute(f"INSERT INTO {t} VALUES (11)")
        conn.commit()
        assert direct_count(t) == 4
        try:
            conn.execute(f"VACUUM {t}")
        except errors.ActiveSqlTransaction:
            conn.rollback()
        else:
            raise AssertionError("VACUUM ran inside a transaction block")
        conn.autocommit = True
        conn.execute(f"VACUUM {t}")
        rows = conn.execute(f"SELECT id FROM {t} ORDER BY id").fetchall()
        assert rows == [(1,), (2,), (3,), (11,)], rows


def test_pipeline(dsn):
    t = table("pipeline")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {t} (id int PRIMARY KEY, v text)")
        with conn.pipeline() as p:
            cur = conn.cursor()
            cur.executemany(f"INSERT INTO {t} VALUES (%s, %s)", [(i, f"v{i}") for i in range(500)])
            c1 = conn.execute(f"SELECT count(*) FROM {t}")
            c2 = conn.execute("SELECT %s::text || %s::text", ("a", "b"))
            p.sync()
            c3 = conn.execute(f"SELECT v FROM {t} WHERE id = %s", (499,), prepare=True)
            assert c1.fetchone() == (500,)
            assert c2.fetchone() == ("ab",)
            assert c3.fetchone() == ("v499",)
        assert direct_count(t) == 500

        # An error inside the pipeline: the statements after it up to the next sync are
        # not run; those after the sync are; the connection stays usable. Where psycopg
        # reports the error (at the failing execute or at the sync) depends on timing.
        try:
            with conn.pipeline() as p:
                conn.execute(f"INSERT INTO {t} VALUES (1000, 'before the error')")
                p.sync()
                conn.execute(f"INSERT INTO {t} VALUES (1001, 'same batch as the error')")
                conn.execute("SELECT 1/0")
                conn.execute(f"INSERT INTO {t} VALUES (1002, 'skipped')")
                p.sync()
        except errors.DivisionByZero:
            pass
        else:
            raise AssertionError("the division by zero was not reported")
        assert direct_count(t) == 501, "only the insert before the sync committed"
        ids = [r[0] for r in conn.execute(f"SELECT id FROM {t} WHERE id >= 1000 ORDER BY id")]
        assert ids == [1000], ids

        # A pipeline inside a transaction, rolled back.
        with conn.transaction(force_rollback=True):
            with conn.pipeline():
                for i in range(2000, 2010):
                    conn.execute(f"INSERT INTO {t} VALUES (%s, 'rolled back')", (i,))
        assert direct_count(t) == 501


def test_copy(dsn):
    t = table("copy")
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute(f"CREATE TABLE {t} (id int, t text, b bytea)")
        with cur.copy(f"COPY {t} FROM STDIN") as copy:
            for i in range(3000):
                copy.write_row((i, f"row {i}\n\\ é", bytes([i % 256, 0])))
        with cur.copy(f"COPY {t} (id, t) FROM STDIN (FORMAT csv)") as copy:
            copy.write(b"5000,\"a, b\"\n5001,\"c\"\n")
        conn.commit()
        assert direct_count(t) == 3002
        with cur.copy(f"COPY (SELECT id, t, b FROM {t} WHERE id < 3000 ORDER BY id) TO STDOUT") as copy:
            copy.set_types(["int4", "text", "bytea"])
            rows = list(copy.rows())
        assert len(rows) == 3000
        assert rows[1234] == (1234, "row 1234\n\\ é", bytes([1234 % 256, 0])), rows[1234]
        with cur.copy(f"COPY (SELECT id FROM {t} ORDER BY id DESC LIMIT 2) TO STDOUT (FORMAT csv)") as copy:
            data = b"".join(bytes(b) for b in copy)
        assert data == b"5001\n5000\n", data
        # A COPY that fails in the middle, inside a transaction.
        try:
            with cur.copy(f"COPY {t} (id) FROM STDIN") as copy:
                copy.write(b"1\n2\nthree\n")
        except errors.InvalidTextRepresentation:
            conn.rollback()
        else:
            raise AssertionError("bad COPY data accepted")
        # The client gives up (CopyFail).
        try:
            with cur.copy(f"COPY {t} (id) FROM STDIN") as copy:
                copy.write(b"1\n")
                raise RuntimeError("client gives up")
        except RuntimeError:
            pass
        except psycopg.errors.QueryCanceled:
            pass
        conn.rollback()
        assert direct_count(t) == 3002


def test_server_side_cursor(dsn):
    t = table("cursor")
    with psycopg.connect(dsn) as conn:
        conn.execute(f"CREATE TABLE {t} AS SELECT g AS id FROM generate_series(1, 5000) g")
        conn.commit()
        with conn.cursor(name="big", scrollable=True) as cur:
            cur.itersize = 333
            cur.execute(f"SELECT id FROM {t} WHERE id > %s ORDER BY id", (1000,))
            assert cur.fetchone() == (1001,)
            assert len(cur.fetchmany(500)) == 500
            assert sum(r[0] for r in cur) == sum(range(1502, 5001))
            cur.scroll(10, mode="absolute")
            assert cur.fetchone() == (1011,)
            cur.scroll(-2)
            assert cur.fetchone() == (1010,)
        # Two named cursors open at once, interleaved.
        with conn.cursor(name="a") as a, conn.cursor(name="b") as b:
            a.execute(f"SELECT id FROM {t} ORDER BY id")
            b.execute(f"SELECT -id FROM {t} ORDER BY id")
            for i in range(1, 50):
                assert a.fetchone() == (i,)
                assert b.fetchone() == (-i,)
        conn.commit()
        # A cursor over a statement that fails after some rows.
        with conn.cursor(name="fails") as cur:
            cur.execute(f"SELECT 10 / (3000 - id) FROM {t} ORDER BY id")
            try:
                cur.fetchall()
            except errors.DivisionByZero:
                pass
            else:
                raise AssertionError("division by zero in the cursor not reported")
        conn.rollback()
        assert conn.execute("SELECT 'usable'").fetchone() == ("usable",)


def test_notifications(dsn):
    channel = f"ch_{SUFFIX}"
    with psycopg.connect(dsn, autocommit=True) as listener, psycopg.connect(dsn, autocommit=True) as sender:
        listener.execute(f"LISTEN {channel}")
        sender.execute("SELECT pg_notify(%s, %s)", (channel, "one"))
        with sender.transaction():
            sender.execute(f"NOTIFY {channel}, 'two'")
        listener.execute(f"NOTIFY {channel}, 'self'")
        received = []
        for n in listener.notifies(timeout=10, stop_after=3):
            received.append((n.channel, n.payload, n.pid))
        # The sender is named by the pid its own client was given (libpq's PQbackendPID),
        # so a listener can tell its own notifications from the others'.
        sender_pid, own_pid = sender.info.backend_pid, listener.info.backend_pid
        assert sender_pid != own_pid
        assert received == [
            (channel, "one", sender_pid),
            (channel, "two", sender_pid),
            (channel, "self", own_pid),
        ], (received, sender_pid, own_pid)


def test_cancel(dsn):
    with psycopg.connect(dsn) as conn:
        # Cancel until it lands: a cancel that arrives before the query started is lost.
        done = threading.Event()

        def cancel_until_done():
            while not done.wait(0.3):
                conn.cancel()

        canceller = threading.Thread(target=cancel_until_done)
        canceller.start()
        started = time.monotonic()
        try:
            conn.execute("SELECT pg_sleep(30)")
        except errors.QueryCanceled:
            pass
        else:
            raise AssertionError("pg_sleep was not cancelled")
        finally:
            done.set()
            canceller.join()
        assert time.monotonic() - started < 10
        conn.rollback()
        assert conn.execute("SELECT 'after cancel'").fetchone() == ("after cancel",)


def test_scram_login(dsn):
    # Same server and database, as the SCRAM user of the harness.
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    info.update(user="scramuser", password="scrampass")
    with psycopg.connect(**info) as conn:
        assert conn.execute("SELECT current_user").fetchone() == ("scramuser",)
    info["password"] = "wrong"
    try:
        psycopg.connect(**info)
    except psycopg.OperationalError as e:
        assert "password authentication failed" in str(e), e
    else:
        raise AssertionError("logged in with a wrong password")


if __name__ == "__main__":
    run(globals())
