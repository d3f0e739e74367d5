"""The billing story through pgfence with psycopg 3 (run by tests/tests/fence_story.rs).

Instance A writes with token 33 (accepted), B with 34 (accepted), A with 33 again: rejected
with exactly FN001, none of A's last transaction in the table, the fence at 34, and A's
connection usable, idle (psycopg's transaction status and the server agree: a ROLLBACK warns
that no transaction is in progress). For each token source, in autocommit and in a
transaction, with the extended protocol (parameters, so psycopg does not fall back to the
simple protocol) and in pipeline mode.

Environment (besides PGFENCE_DSN / PG_DIRECT_DSN): STORY_FAST_PATH (on/off, whether the
pgfence behind PGFENCE_DSN has the fast path), STORY_FIRST_ID and STORY_COUNT (the stories
whose sequences and users the Rust test created: story FIRST+n uses SOURCES[n % 5]).
"""

import os
import traceback

import psycopg
from psycopg.pq import TransactionStatus

from fence_expect import assert_error, stale
from pgfence_test import direct_dsn, run

TOKEN_A = 33
TOKEN_B = 34
SOURCES = ["options", "set", "comment", "sqlcommenter", "default"]
FAST = os.environ.get("STORY_FAST_PATH") == "on"
FIRST = int(os.environ.get("STORY_FIRST_ID", "0"))
COUNT = int(os.environ.get("STORY_COUNT", "20"))
MODES = ["autocommit", "explicit"]

_next = {"n": 0}


def next_story(source):
    """The id of the next unused story whose source is `source`."""
    n = _next["n"]
    while SOURCES[n % len(SOURCES)] != source:
        n += 1
    _next["n"] = n + 1
    assert n < COUNT, "more stories than the Rust test prepared"
    return FIRST + n


class Story:
    def __init__(self, source, mode, driver):
        self.source = source
        self.mode = mode
        self.driver = driver
        self.id = next_story(source)

    def __str__(self):
        return f"story {self.id} {self.driver} {self.source} {self.mode}"

    @property
    def resource(self):
        return f"default_{self.id}" if self.source == "default" else f"story:{self.id}"

    def connect(self, dsn, token, autocommit):
        kwargs = {"autocommit": autocommit}
        if self.source == "options":
            kwargs["options"] = f"-c fencing.token={token} -c fencing.resource={self.resource}"
        elif self.source == "default":
            kwargs["options"] = f"-c fencing.token={token}"
            kwargs["user"] = f"story_user_{self.id}"
        conn = psycopg.connect(dsn, **kwargs)
        if self.source == "set":
            # On a connection that is not in autocommit, SET starts the transaction that
            # the first write joins; SET is transactional but is committed with it.
            conn.execute(f"SET fencing.token = {token}")
            conn.execute(f"SET fencing.resource = '{self.resource}'")
            conn.commit()
        return conn

    def rows(self, who):
        return [who] if self.mode == "autocommit" else [who + "a", who + "b"]

    def write(self, token):
        """(query, params) of one write; `%%` is psycopg's escape of `%`."""
        insert = (
            "INSERT INTO story (story, who, token, n) "
            f"VALUES (%s, %s, %s, nextval('story_seq_{self.id}'))"
        )
        if self.source == "comment":
            return f"/* fencing_token={token} fencing_resource={self.resource} */ {insert}"
        if self.source == "sqlcommenter":
            encoded = self.resource.replace(":", "%%3A")
            return f"{insert} /*fencing_resource='{encoded}',fencing_token='{token}'*/"
        return insert

    def expect_fast(self):
        # Not for the configured default resource: the server may replace it with its own
        # (ALTER ROLE ... SET fencing.resource), so the fast path leaves it to the check.
        return FAST and self.source in ("options", "comment", "sqlcommenter")

    def transaction(self, conn, who, token):
        """Runs one transaction of `who`; returns the error raised, if any, and where."""
        query = self.write(token)
        explicit = self.mode == "explicit"
        try:
            if self.driver == "pipeline":
                with conn.pipeline():
                    for row in self.rows(who):
                        conn.execute(query, (self.id, row, token))
                    if explicit:
                        conn.commit()
            else:
                for row in self.rows(who):
                    conn.execute(query, (self.id, row, token))
                if explicit:
                    try:
                        conn.commit()
                    except psycopg.Error as e:
                        return e, "commit"
        except psycopg.Error as e:
            return e, "write"
        except IndexError as e:
            if self.driver == "pipeline" and str(e) == PSYCOPG_PIPELINE_RACE:
                return e, "write"
            raise
        return None, None


def check_story(dsn, story):
    explicit = story.mode == "explicit"
    a = story.connect(dsn, TOKEN_A, autocommit=not explicit)
    notices = []
    a.add_notice_handler(lambda d: notices.append(d.sqlstate))
    err, where = story.transaction(a, "A1", TOKEN_A)
    assert err is None, f"A with {TOKEN_A}: {err!r}"

    with story.connect(dsn, TOKEN_B, autocommit=not explicit) as b:
        err, where = story.transaction(b, "B", TOKEN_B)
        assert err is None, f"B with {TOKEN_B}: {err!r}"

    err, where = story.transaction(a, "A2", TOKEN_A)
    assert err is not None, "A's stale transaction was not rejected"
    if story.driver == "pipeline" and not explicit and not story.expect_fast():
        # Rejected at the end of the implicit transaction (the pipeline's Sync), after the
        # write's CommandComplete: exactly what PostgreSQL sends when a deferred constraint
        # fails there, which libpq's pipeline mode cannot take. pgfence must do no worse.
        want = deferred_failure_in_pipeline()
        got = (type(err).__name__, str(err))
        # psycopg itself sometimes trips over this reply (an IndexError out of its pipeline
        # queue, seen against PostgreSQL directly too): that is no worse either.
        race = ("IndexError", PSYCOPG_PIPELINE_RACE)
        assert got in (want, race), f"{story}: {got}, PostgreSQL with a deferred constraint: {want}"
        a.close()
        check_outcome(story)
        return
    assert_error(err, stale(story.resource, TOKEN_A, TOKEN_B), str(story))
    if story.driver == "extended" and explicit:
        # The fast path rejects the write before it runs, the database at COMMIT.
        want = "write" if story.expect_fast() else "commit"
        assert where == want, f"rejected at {where}, expected at {want}"
    if explicit and story.expect_fast():
        # A write was rejected inside the transaction (before it ran): the transaction is
        # failed, and the application rolls back, as after any failed statement.
        status = a.info.transaction_status
        assert status == TransactionStatus.INERROR, f"after a rejected write: {status.name}"
        a.rollback()
    # Otherwise the rejection ended the transaction, like a deferred constraint at COMMIT.
    status = a.info.transaction_status
    assert status == TransactionStatus.IDLE, f"psycopg believes the transaction is {status.name}"

    # The server agrees: no transaction is open, and the connection works.
    a.autocommit = True
    notices.clear()
    a.execute("ROLLBACK")
    assert a.execute("SELECT 1").fetchone() == (1,)
    assert notices == ["25P01"], f"a transaction was still open on the server: {notices}"
    a.close()
    check_outcome(story)


def check_outcome(story):
    """A's first and B's rows are there, none of A's last; the sequence moved only for the
    stale writes the database ran (the fast path runs none); the fence is B's token."""
    with psycopg.connect(direct_dsn(), autocommit=True) as d:
        rows = [r[0] for r in d.execute("SELECT who FROM story WHERE story = %s ORDER BY n", (story.id,))]
        assert rows == story.rows("A1") + story.rows("B"), f"rows: {rows}"
        seq = d.execute(f"SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM story_seq_{story.id}").fetchone()[0]
        good = len(rows)
        want = good if story.expect_fast() else good + len(story.rows("A2"))
        assert seq == want, f"nextval ran {seq} times, expected {want} (fast path {story.expect_fast()})"
        fence = d.execute("SELECT token FROM pgfence.fences WHERE resource = %s", (story.resource,)).fetchone()
        assert fence == (TOKEN_B,), f"fence {fence}"


_deferred = {}
# What psycopg raises, now and then, when an autocommit pipeline's implicit commit fails
# after the statement's CommandComplete (it depends on how the replies arrive in reads).
PSYCOPG_PIPELINE_RACE = "pop from an empty deque"


def deferred_failure_in_pipeline():
    """(exception type, message) psycopg raises, against PostgreSQL itself, for an insert in
    autocommit pipeline mode whose implicit commit fails on a deferred constraint trigger."""
    if "result" in _deferred:
        return _deferred["result"]
    with psycopg.connect(direct_dsn(), autocommit=True) as c:
        c.execute(
            """
            CREATE TABLE IF NOT EXISTS story_deferred (v int);
            CREATE OR REPLACE FUNCTION story_deferred_fail() RETURNS trigger LANGUAGE plpgsql
                AS $$ BEGIN RAISE EXCEPTION 'deferred failure' USING ERRCODE = 'FN001'; END $$;
            DROP TRIGGER IF EXISTS story_deferred_t ON story_deferred;
            CREATE CONSTRAINT TRIGGER story_deferred_t AFTER INSERT ON story_deferred
                DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION story_deferred_fail();
            """
        )
    for _ in range(5):
        c = psycopg.connect(direct_dsn(), autocommit=True)
        try:
            with c.pipeline():
                c.execute("INSERT INTO story_deferred VALUES (%s)", (1,))
        except psycopg.Error as e:
            _deferred["result"] = (type(e).__name__, str(e))
            return _deferred["result"]
        except IndexError as e:
            # psycopg's own race (see PSYCOPG_PIPELINE_RACE), directly against PostgreSQL.
            if str(e) != PSYCOPG_PIPELINE_RACE:
                raise
        else:
            raise AssertionError("the deferred constraint did not fail")
        finally:
            c.close()
    raise AssertionError(f"psycopg raised IndexError({PSYCOPG_PIPELINE_RACE!r}) 5 times in a row")


def run_stories(dsn, driver):
    failed = []
    for mode in MODES:
        for source in SOURCES:
            story = Story(source, mode, driver)
            try:
                check_story(dsn, story)
            except Exception as e:  # noqa: BLE001 - report every story
                failed.append(f"{story}: {e!r}")
                print(f"{story}: FAIL {e!r}", flush=True)
                traceback.print_exc()
            else:
                print(f"{story}: ok", flush=True)
    assert not failed, "\n".join(failed)


def test_extended(dsn):
    run_stories(dsn, "extended")


def test_pipeline(dsn):
    run_stories(dsn, "pipeline")


if __name__ == "__main__":
    run(globals())
