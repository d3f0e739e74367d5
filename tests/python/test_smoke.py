"""Smoke test of the psycopg 3 features pgfence must pass through untouched: parameters
(text and binary, prepared), pipeline mode, COPY both ways (text and binary), server-side
cursors. Runs against PostgreSQL directly, or through pgfence when PGFENCE_DSN is set."""

import psycopg
from psycopg import sql

from pgfence_test import run


def test_parameterized_query(dsn):
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT %s::int + %s::int, %s::text", (40, 2, "héllo")).fetchone()
        assert row == (42, "héllo"), row

        cur = conn.cursor(binary=True)
        cur.execute("SELECT %b::int8 * 2, %b::bytea", (21, b"\x00\xff"))
        assert cur.fetchone() == (42, b"\x00\xff")

        # Named prepared statements, reused across executions.
        for i in range(3):
            got = conn.execute("SELECT %s::int * 10", (i,), prepare=True).fetchone()
            assert got == (i * 10,), got
        conn.execute(sql.SQL("SELECT {}").format(sql.Literal("literal"))).fetchone()


def test_pipeline(dsn):
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TEMP TABLE pipe (id int PRIMARY KEY, v text)")
        with conn.pipeline() as p:
            with conn.cursor() as cur:
                cur.executemany("INSERT INTO pipe VALUES (%s, %s)", [(i, f"v{i}") for i in range(100)])
            count = conn.execute("SELECT count(*) FROM pipe")
            total = conn.execute("SELECT sum(id) FROM pipe")
            p.sync()
            assert count.fetchone() == (100,)
            assert total.fetchone() == (4950,)

        # An error aborts the rest of the batch up to its Sync; the session stays usable.
        try:
            with conn.pipeline():
                conn.execute("INSERT INTO pipe VALUES (1, 'duplicate')")
                conn.execute("INSERT INTO pipe VALUES (1000, 'skipped')")
        except psycopg.Error as e:
            assert e.sqlstate == "23505", e.sqlstate
        else:
            raise AssertionError("the duplicate key was accepted")
        assert conn.execute("SELECT count(*) FROM pipe").fetchone() == (100,)


def test_copy(dsn):
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("CREATE TEMP TABLE c (id int, t text, b bytea)")
        with cur.copy("COPY c (id, t, b) FROM STDIN") as copy:
            for i in range(1000):
                copy.write_row((i, f"row {i}\twith tab", bytes([i % 256])))
        cur.execute("SELECT count(*), sum(id) FROM c")
        assert cur.fetchone() == (1000, 499500)

        with cur.copy("COPY c (id, t, b) FROM STDIN (FORMAT BINARY)") as copy:
            copy.set_types(["int4", "text", "bytea"])
            for i in range(1000, 1100):
                copy.write_row((i, "binary", b"\x00\x01"))

        rows = []
        with cur.copy("COPY (SELECT id, t, b FROM c ORDER BY id) TO STDOUT") as copy:
            copy.set_types(["int4", "text", "bytea"])
            rows.extend(copy.rows())
        assert len(rows) == 1100, len(rows)
        assert rows[5] == (5, "row 5\twith tab", b"\x05"), rows[5]
        assert rows[1050] == (1050, "binary", b"\x00\x01"), rows[1050]

        with cur.copy("COPY (SELECT id FROM c WHERE id < 3 ORDER BY id) TO STDOUT (FORMAT BINARY)") as copy:
            copy.set_types(["int4"])
            assert list(copy.rows()) == [(0,), (1,), (2,)]

        with cur.copy("COPY (SELECT 1, 'a') TO STDOUT") as copy:
            raw = b"".join(bytes(block) for block in copy)
        assert raw == b"1\ta\n", raw
        conn.commit()

        # Bad data fails the COPY; after a rollback the session goes on.
        try:
            with cur.copy("COPY c (id) FROM STDIN") as copy:
                copy.write(b"1\nnot a number\n")
        except psycopg.Error as e:
            assert e.sqlstate == "22P02", e.sqlstate
        else:
            raise AssertionError("bad COPY data was accepted")
        conn.rollback()
        cur.execute("SELECT count(*) FROM c")
        assert cur.fetchone() == (1100,)


def test_server_side_cursor(dsn):
    with psycopg.connect(dsn) as conn:
        with conn.cursor(name="smoke_cursor") as cur:
            cur.itersize = 100
            cur.execute("SELECT g FROM generate_series(1, 1000) g")
            assert cur.fetchone() == (1,)
            assert cur.fetchmany(3) == [(2,), (3,), (4,)]
            assert sum(r[0] for r in cur) == sum(range(5, 1001))
            cur.scroll(0, mode="absolute")
            assert cur.fetchone() == (1,)
        conn.commit()

        # WITH HOLD: the cursor outlives its transaction.
        with conn.cursor(name="held_cursor", withhold=True) as cur:
            cur.execute("SELECT g FROM generate_series(1, 10) g")
            conn.commit()
            assert len(cur.fetchall()) == 10


if __name__ == "__main__":
    run(globals())
