"""Shared helpers of the psycopg test scripts in this directory (see README.md).

A script defines functions `test_<name>(dsn)` and ends with `run(globals())`: each test runs
against `target_dsn()` (the proxy when PGFENCE_DSN is set, else PostgreSQL directly), prints
`ok <name>` or `FAIL <name>` with the traceback, and the script exits 1 if any failed.
"""

import os
import sys
import time
import traceback


def direct_dsn():
    """The libpq connection string of PostgreSQL itself (PG_DIRECT_DSN, required)."""
    dsn = os.environ.get("PG_DIRECT_DSN")
    if not dsn:
        sys.exit("PG_DIRECT_DSN is not set: run this script through harness::run_python")
    return dsn


def proxy_dsn():
    """The connection string through pgfence (PGFENCE_DSN), or None when not set."""
    return os.environ.get("PGFENCE_DSN") or None


def fence_enforced():
    """Whether stale writes must be rejected: through pgfence, unless PGFENCE_FENCE is `off`
    (directly, or with the fence off, they land)."""
    return proxy_dsn() is not None and os.environ.get("PGFENCE_FENCE", "on") == "on"


def run_mode():
    """How this run goes: `direct`, `fenced` (through pgfence, fence enforced) or `proxy`."""
    if proxy_dsn() is None:
        return "direct"
    return "fenced" if fence_enforced() else "proxy"


def run_suffix():
    """Ends the names of a run's tables, channels and resources (this process and how it
    runs), so that runs can share a database."""
    return f"{os.getpid()}_{run_mode()}"


def target_dsn():
    """What the tests exercise: pgfence when PGFENCE_DSN is set, else PostgreSQL directly."""
    return proxy_dsn() or direct_dsn()


def run(namespace):
    """Runs every `test_*` function of `namespace` (a module's globals()) in file order."""
    dsn = target_dsn()
    tests = [(name, fn) for name, fn in namespace.items() if name.startswith("test_") and callable(fn)]
    failed = 0
    for name, fn in tests:
        short = name[len("test_"):]
        started = time.monotonic()
        try:
            fn(dsn)
        except Exception:  # noqa: BLE001 - report every failure, keep going
            failed += 1
            print(f"FAIL {short}", flush=True)
            traceback.print_exc()
        else:
            print(f"ok {short} ({(time.monotonic() - started) * 1000:.0f} ms)", flush=True)
    print(f"summary: ok={len(tests) - failed} failed={failed}", flush=True)
    sys.exit(1 if failed else 0)
