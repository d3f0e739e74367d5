"""A leader that pauses: run (not a test script) by tests/tests/fence_pause.rs.

Connects through pgfence (PGFENCE_DSN) with token TOKEN for RESOURCE in its startup options,
opens a transaction, inserts (TAG, TOKEN) into table `paused`, prints `written`, then sleeps
SLEEP seconds and commits. The Rust test stops this process with SIGSTOP right after
`written` (mid-transaction, before COMMIT), lets a new leader advance the fence, and resumes
it with SIGCONT. Prints one JSON line with the outcome of the COMMIT (the error's fields, or
`committed`), then one with psycopg's transaction status and whether the connection still
works.
"""

import json
import os
import sys
import time

import psycopg


def main():
    dsn = os.environ["PGFENCE_DSN"]
    token = int(os.environ["TOKEN"])
    resource = os.environ["RESOURCE"]
    tag = os.environ["TAG"]
    sleep = float(os.environ.get("SLEEP", "1"))
    options = f"-c fencing.token={token} -c fencing.resource={resource}"
    conn = psycopg.connect(dsn, options=options)
    conn.execute("INSERT INTO paused (tag, token) VALUES (%s, %s)", (tag, token))
    print("written", flush=True)
    time.sleep(sleep)
    outcome = {"committed": False}
    try:
        conn.commit()
        outcome["committed"] = True
    except psycopg.Error as e:
        d = e.diag
        outcome.update(
            sqlstate=e.sqlstate,
            severity=d.severity_nonlocalized,
            message=d.message_primary,
            detail=d.message_detail,
            hint=d.message_hint,
        )
    print(json.dumps(outcome), flush=True)
    status = conn.info.transaction_status.name
    conn.autocommit = True
    works = conn.execute("SELECT 1").fetchone() == (1,)
    print(json.dumps({"status": status, "works": works}), flush=True)
    conn.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
