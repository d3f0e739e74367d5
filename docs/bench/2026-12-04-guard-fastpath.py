#!/usr/bin/env python3
"""2026-12-04: what the guard before COMMIT costs the server, sent as pgfence sends it (Bind
and Execute of a prepared SELECT) and as a FunctionCall message of a PL/pgSQL function doing
the same test (the fast path skips parse analysis, planning and the portal).

One connection, raw protocol, straight to PostgreSQL. Each transaction is one write of
Bind/Execute of BEGIN, of `UPDATE guard_fastpath SET n = n + 1 WHERE id = 7`, of the guard
(none, the prepared SELECT, or the FunctionCall), of COMMIT, then Sync. The figure is the
backend's own CPU time (utime + stime of /proc/<backend pid>/stat) per transaction, median
over rounds, the variants interleaved. Run it on the database's host, against a server with
trust authentication for USER:

    python3 docs/bench/2026-12-04-guard-fastpath.py HOST PORT USER DATABASE [TXNS] [ROUNDS] [VARIANT]

VARIANT (`none`, `select` or `fcall`) runs that variant alone, without warm-up, for counting
a backend's instructions under callgrind (the postmaster started under
`valgrind --tool=callgrind --trace-children=yes`): the difference between a run of 1,200
and one of 200 transactions, over 1,000, is what one transaction costs.
"""
import os
import socket
import struct
import sys

host, port, user, database = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
txns = int(sys.argv[5]) if len(sys.argv) > 5 else 20000
rounds = int(sys.argv[6]) if len(sys.argv) > 6 else 5
only = sys.argv[7] if len(sys.argv) > 7 else None

GUARD = ("SELECT CASE WHEN pg_catalog.current_setting('fencing.resource', true) IS NULL "
         "AND pg_catalog.current_setting('fencing.token', true) IS NULL THEN NULL ELSE 1 END")
SETUP = """
DROP TABLE IF EXISTS guard_fastpath;
CREATE TABLE guard_fastpath (id int PRIMARY KEY, n int);
INSERT INTO guard_fastpath SELECT g, 0 FROM generate_series(1, 100) g;
CREATE OR REPLACE FUNCTION guard_fastpath() RETURNS int LANGUAGE plpgsql AS $$
BEGIN
  IF pg_catalog.current_setting('fencing.resource', true) IS NULL
     AND pg_catalog.current_setting('fencing.token', true) IS NULL THEN
    RETURN NULL;
  END IF;
  RETURN 1;
END $$;
"""


def msg(tag, body):
    return tag + struct.pack("!I", len(body) + 4) + body


def cstr(s):
    return s.encode() + b"\0"


sock = socket.create_connection((host, port))
sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
startup = struct.pack("!I", 196608) + cstr("user") + cstr(user) + cstr("database") + cstr(database) + b"\0"
sock.sendall(struct.pack("!I", len(startup) + 4) + startup)
pending = b""


def replies(ready_for_query=1):
    """Reads messages up to the given number of ReadyForQuery; exits on an ErrorResponse."""
    global pending
    seen, out = 0, []
    while True:
        while len(pending) >= 5:
            tag, length = pending[0:1], struct.unpack("!I", pending[1:5])[0]
            if len(pending) < 1 + length:
                break
            out.append((tag, pending[5:1 + length]))
            pending = pending[1 + length:]
            if tag == b"E":
                sys.exit("server error: %r" % out[-1][1])
            if tag == b"Z":
                seen += 1
                if seen == ready_for_query:
                    return out
        chunk = sock.recv(65536)
        if not chunk:
            sys.exit("server closed the connection")
        pending += chunk


backend = next(struct.unpack("!I", body[:4])[0] for tag, body in replies() if tag == b"K")
sock.sendall(msg(b"Q", cstr(SETUP)))
replies()
sock.sendall(msg(b"Q", cstr("SELECT 'guard_fastpath()'::regprocedure::oid")))
oid = int(next(body for tag, body in replies() if tag == b"D")[6:])


def parse(name, sql):
    return msg(b"P", cstr(name) + cstr(sql) + b"\0\0")


def execute(name):
    return msg(b"B", b"\0" + cstr(name) + b"\0\0\0\0\0\0") + msg(b"E", b"\0\0\0\0\0")


sock.sendall(parse("b", "BEGIN") + parse("u", "UPDATE guard_fastpath SET n = n + 1 WHERE id = 7")
             + parse("g", GUARD) + parse("c", "COMMIT") + msg(b"S", b""))
replies()
# none: no guard; select: the guard as pgfence sends it (Bind and Execute of the prepared
# SELECT); fcall: the same test as a FunctionCall of guard_fastpath().
# FunctionCall: the function, no argument format codes, no arguments, a text result. The
# server answers it with its own ReadyForQuery, so that variant reads two.
function_call = msg(b"F", struct.pack("!Ihhh", oid, 0, 0, 0))
variants = {
    "none": (execute("b") + execute("u") + execute("c") + msg(b"S", b""), 1),
    "select": (execute("b") + execute("u") + execute("g") + execute("c") + msg(b"S", b""), 1),
    "fcall": (execute("b") + execute("u") + function_call + execute("c") + msg(b"S", b""), 2),
}


def backend_cpu():
    fields = open("/proc/%d/stat" % backend).read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if only is not None:
    variants = {only: variants[only]}
for message, ready in variants.values():  # warm-up; each variant must run without error
    for _ in range(0 if only is not None else 500):
        sock.sendall(message)
        replies(ready)
per_txn = {name: [] for name in variants}
for _ in range(rounds):
    for name, (message, ready) in variants.items():
        before = backend_cpu()
        for _ in range(txns):
            sock.sendall(message)
            replies(ready)
        per_txn[name].append((backend_cpu() - before) / txns * 1e6)
print("backend CPU per transaction, µs (median, then every round, %d transactions each)" % txns)
for name, values in per_txn.items():
    ordered = sorted(values)
    print("%-7s %6.1f   %s" % (name, ordered[len(ordered) // 2], " ".join("%.1f" % v for v in values)))
sock.sendall(msg(b"Q", cstr("DROP TABLE guard_fastpath; DROP FUNCTION guard_fastpath()")))
replies()
