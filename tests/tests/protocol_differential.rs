//! Differential protocol test: the same byte sequences, sent raw over TCP straight to
//! PostgreSQL and through pgfence, must get the same reply bytes.
//!
//! Three clusters are copies of one template with the same setup (the fence schema
//! installed in each), so object ids and everything else in the replies match: one is
//! spoken to directly, one through pgfence with the fence on (the product: pgfence injects
//! its check into writing transactions and must hide it), one through pgfence with the fence
//! off. Only BackendKeyData (pgfence hands out its own) and the sender pid in
//! NotificationResponse are normalised.
//!
//! [`SCRIPT`] covers: trust login; simple queries (one and several statements, empty, an
//! error half way, pipelined queries, a failed transaction and its COMMIT); the extended
//! protocol (named and unnamed statements, Describe of statements and portals, pipelined
//! batches, an error mid-batch, Flush, Execute with a row limit and PortalSuspended, Close,
//! errors for unknown statements); COPY FROM STDIN with CopyData/CopyDone, CopyFail and bad
//! data, both protocols (libpq's and tokio-postgres's message orders), COPY TO STDOUT in text
//! and binary; FunctionCall (`abs(int4)`, NULL, an unknown function); LISTEN/NOTIFY to self;
//! notices from a DO block; ParameterStatus; SQL that is not valid UTF-8; savepoints and
//! commits in both protocols; Terminate. Further sessions: a LATIN1 client encoding, startup
//! parameters (`application_name`, `options`), a first extended-protocol write that fails
//! (without a token and with one), and protocol version 3.1 with a `_pq_` option
//! (NegotiateProtocolVersion).

use std::net::SocketAddr;

use harness::wire::{self, Msg, RawConn};
use harness::{PgCluster, Proxy, APP_DB, SUPERUSER};

/// How to read the replies to one step.
#[derive(Debug, Clone, Copy)]
enum Until {
    /// This many ReadyForQuery messages.
    Ready(usize),
    /// Up to the first message with this tag.
    Tag(u8),
    /// The connection's end.
    Closed,
}

/// Bytes to send and how far to read the replies.
struct Step {
    name: String,
    send: Vec<u8>,
    until: Until,
}

fn step(name: &str, send: Vec<u8>, until: Until) -> Step {
    Step {
        name: name.to_string(),
        send,
        until,
    }
}

fn cat(parts: &[Vec<u8>]) -> Vec<u8> {
    parts.concat()
}

fn q(sql: &str) -> Vec<u8> {
    wire::query(sql)
}

/// Parse + Bind + Execute of `sql` with text parameters, unnamed statement and portal.
fn pbe(sql: &str, params: &[Option<&[u8]>]) -> Vec<u8> {
    cat(&[
        wire::parse("", sql, &[]),
        wire::bind("", "", params),
        wire::execute("", 0),
    ])
}

/// One login and its steps.
struct Session {
    name: &'static str,
    startup: Vec<u8>,
    steps: Vec<Step>,
}

/// The main session's steps. `abs_oid` is the oid of `abs(int4)`.
fn main_steps(abs_oid: u32) -> Vec<Step> {
    use Until::*;
    vec![
        step(
            "simple select",
            q("SELECT 1 AS one, 'two'::text AS two, NULL::int AS three, 1.5::numeric AS four"),
            Ready(1),
        ),
        step(
            "ddl and dml in one query",
            q("CREATE TABLE d (id int PRIMARY KEY, t text); \
               INSERT INTO d VALUES (1, 'a'), (2, 'b'); SELECT * FROM d ORDER BY id; \
               UPDATE d SET t = t || '!' WHERE id = 2"),
            Ready(1),
        ),
        step(
            "empty queries",
            cat(&[q(""), q(";"), q("-- a comment only"), q("/* block */ ;")]),
            Ready(4),
        ),
        step(
            "error half way through a query",
            cat(&[
                q("INSERT INTO d VALUES (3, 'c'); SELECT 1/0; INSERT INTO d VALUES (4, 'd')"),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(2),
        ),
        step(
            // The server skips everything up to the Sync after an error, a Query included;
            // pgfence must not wait for that Query's ReadyForQuery, nor check it.
            "a Query in the middle of a batch that failed, before its Sync",
            cat(&[
                pbe("INSERT INTO d VALUES (6, 'f')", &[]),
                pbe("SELECT 1/0", &[]),
                q("INSERT INTO d VALUES (7, 'g')"),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(2),
        ),
        step(
            "a FunctionCall in the middle of a batch that failed, before its Sync",
            cat(&[
                pbe("SELECT 1/0", &[]),
                wire::function_call(abs_oid, &[Some(b"-5")]),
                wire::sync(),
                wire::function_call(abs_oid, &[Some(b"-6")]),
            ]),
            Ready(2),
        ),
        step(
            "a Query sent in a batch whose error came back before the batch's Sync was sent",
            cat(&[
                pbe("INSERT INTO d VALUES (6, 'f')", &[]),
                pbe("SELECT 1/0", &[]),
                q("INSERT INTO d VALUES (7, 'g')"),
            ]),
            Tag(b'E'),
        ),
        step(
            "that batch's Sync",
            cat(&[
                q("INSERT INTO d VALUES (7, 'g')"),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(2),
        ),
        step(
            "a block that wrote",
            q("BEGIN; INSERT INTO d VALUES (11, 'k')"),
            Ready(1),
        ),
        step(
            "its COMMIT as a Query behind a Parse that fails, with no Sync in flight",
            cat(&[wire::parse("", "SELEC 1", &[]), q("COMMIT")]),
            Tag(b'E'),
        ),
        step(
            "the Sync the server skipped that COMMIT for, then the block's end",
            cat(&[wire::sync(), q("ROLLBACK"), q("SELECT count(*) FROM d")]),
            Ready(3),
        ),
        step(
            "a Query in the middle of a batch whose writes succeed, before its Sync",
            cat(&[
                pbe("INSERT INTO d VALUES (8, 'h')", &[]),
                q("INSERT INTO d VALUES (9, 'i')"),
                pbe("INSERT INTO d VALUES (10, 'j')", &[]),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(3),
        ),
        step(
            // Each commits what its batch wrote before it (or fails, and rolls it back):
            // pgfence checks before it, and must leave it alone, not in an implicit block
            // with the check (a different error for `SAVEPOINT` and `VACUUM`).
            "lone statements and a FunctionCall inside batches that wrote, before their Sync",
            cat(&[
                pbe("INSERT INTO d VALUES (12, 'l')", &[]),
                q("SAVEPOINT s"),
                wire::sync(),
                pbe("INSERT INTO d VALUES (13, 'm')", &[]),
                q("SET LOCAL application_name = 'inside'"),
                wire::sync(),
                pbe("INSERT INTO d VALUES (14, 'n')", &[]),
                q("VACUUM d"),
                wire::sync(),
                pbe("INSERT INTO d VALUES (15, 'o')", &[]),
                q("DISCARD ALL"),
                wire::sync(),
                pbe("INSERT INTO d VALUES (16, 'p')", &[]),
                wire::function_call(abs_oid, &[Some(b"-7")]),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(11),
        ),
        step(
            // The check before the Query is in the block its `BEGIN` makes of the batch's
            // transaction: its portal must not outlive it (the next check's Bind failed
            // with 42P03 and failed the block).
            "a Query with BEGIN inside a batch that wrote, then a write before the Sync",
            cat(&[
                pbe("INSERT INTO d VALUES (17, 'q')", &[]),
                q("INSERT INTO d VALUES (18, 'r'); BEGIN"),
                pbe("INSERT INTO d VALUES (19, 's')", &[]),
                wire::sync(),
                q("COMMIT"),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(4),
        ),
        step(
            // Behind a `ROLLBACK` of its batch pgfence cannot tell whether a block is open,
            // nor wait: alone, the savepoint commands commit nothing, so they get no check
            // (one made the Query an implicit block, with another error location).
            "lone savepoint commands inside a batch behind its ROLLBACK",
            cat(&[
                pbe("ROLLBACK", &[]),
                pbe("SELECT 1", &[]),
                q("ROLLBACK TO SAVEPOINT s"),
                wire::sync(),
                pbe("COMMIT", &[]),
                q("SAVEPOINT s"),
                wire::sync(),
            ]),
            Ready(4),
        ),
        step(
            // The first Query ends the transaction the batch's Execute ran in: PostgreSQL
            // runs the `VACUUM` alone, in a new one (pgfence's check before it, an Execute
            // in that transaction, made it fail "within a pipeline").
            "VACUUM alone inside a batch, behind a Query behind an Execute",
            cat(&[
                pbe("INSERT INTO d VALUES (20, 't')", &[]),
                q("SELECT 1"),
                q("VACUUM d"),
                wire::sync(),
            ]),
            Ready(3),
        ),
        step(
            // Behind only a Parse, Bind, Describe or Close, PostgreSQL runs the `VACUUM` alone
            // too (it ends the transaction they started): pgfence flushes, reads their
            // replies and checks it first on its own (its check as an Execute in that
            // transaction made it fail "within a pipeline"). The portal bound before it is
            // gone after it, on both.
            "VACUUM alone inside a batch, behind only its Parse, Bind, Describe and Close",
            cat(&[
                wire::parse("", "SELECT 1", &[]),
                wire::bind("vp", "", &[]),
                wire::describe(b'P', "vp"),
                wire::close(b'S', "nothing"),
                q("VACUUM d"),
                wire::execute("vp", 0),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(3),
        ),
        step(
            // Executes of empty statements leave PostgreSQL's pipelining flag as it was: it
            // runs the `VACUUM` alone, and pgfence checks it first on its own, as behind
            // only a Parse (its check as an Execute made it fail "within a pipeline").
            "VACUUM alone inside a batch, behind Executes of empty statements",
            cat(&[
                pbe("", &[]),
                pbe("/* nothing */ ;", &[]),
                q("VACUUM d"),
                pbe("INSERT INTO d VALUES (25, 'y')", &[]),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(3),
        ),
        step(
            // An Execute of a read sets it: PostgreSQL refuses the `VACUUM` "within a
            // pipeline", and so does pgfence's check before it.
            "VACUUM alone inside a batch, behind an Execute of a read",
            cat(&[pbe("SELECT 1", &[]), q("VACUUM d"), wire::sync()]),
            Ready(2),
        ),
        step(
            // An Executed COMMIT ends the transaction: PostgreSQL runs the `VACUUM` in a new
            // one, without the flag. pgfence checks the COMMIT of the block that wrote, then
            // learns that no block is open (a Sync of its own, after every reply came in) and
            // checks the `VACUUM` first on its own (its check appended to the Query made it
            // fail "inside a transaction block"). The setting changed in the block is reported
            // with the `VACUUM`'s ReadyForQuery on both.
            "VACUUM alone inside a batch, behind an Executed COMMIT of a block that wrote",
            cat(&[
                q("BEGIN"),
                pbe("INSERT INTO d VALUES (26, 'z')", &[]),
                pbe("SET application_name = 'vacuum behind commit'", &[]),
                pbe("COMMIT", &[]),
                pbe("", &[]),
                q("VACUUM d"),
                pbe("RESET application_name", &[]),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(4),
        ),
        step(
            // The same behind a ROLLBACK, which ends the implicit transaction of the write
            // before it (with a warning: no block is open).
            "VACUUM alone inside a batch, behind an Executed ROLLBACK",
            cat(&[
                pbe("INSERT INTO d VALUES (27, 'z')", &[]),
                pbe("ROLLBACK", &[]),
                q("VACUUM d"),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(3),
        ),
        step(
            // An Executed `VACUUM` commits transactions of its own as it runs, and PostgreSQL
            // forgets that it was to commit at once: the transaction after it is pipelined,
            // and the `VACUUM` Query is refused "within a pipeline" (pgfence once took the
            // first for a `DISCARD ALL`, checked the Query first on its own, behind a Sync of
            // its own, and it ran; FunctionCalls seed 33176). So after `REINDEX SCHEMA`.
            "VACUUM alone inside a batch, behind an Executed VACUUM",
            cat(&[
                pbe("VACUUM d", &[]),
                wire::flush(),
                q("VACUUM d"),
                pbe("REINDEX SCHEMA public", &[]),
                q("VACUUM d"),
                wire::sync(),
            ]),
            Ready(3),
        ),
        step(
            // A `DISCARD ALL` commits in the one transaction it ran in: the `VACUUM` after
            // it runs, on both.
            "VACUUM alone inside a batch, behind an Executed DISCARD ALL",
            cat(&[
                pbe("DISCARD ALL", &[]),
                wire::flush(),
                q("VACUUM d"),
                wire::sync(),
            ]),
            Ready(2),
        ),
        step(
            // `CREATE SUBSCRIPTION ... WITH (connect = false)` refuses no block and runs in
            // the batch's transaction: the `VACUUM` after it is refused "within a pipeline"
            // and the batch rolls back, on both (pgfence took it for a statement that commits
            // at once, and the `INSERT` and the subscription committed; review I, stop 54).
            "VACUUM inside a batch, behind an Executed CREATE SUBSCRIPTION without connect",
            cat(&[
                pbe("INSERT INTO d VALUES (28, 's')", &[]),
                pbe(
                    "CREATE SUBSCRIPTION ds CONNECTION 'dbname=nowhere' PUBLICATION p \
                     WITH (connect = false)",
                    &[],
                ),
                q("VACUUM d"),
                wire::sync(),
                q(
                    "SELECT (SELECT count(*) FROM pg_subscription WHERE subname = 'ds'), \
                   (SELECT count(*) FROM d WHERE id = 28)",
                ),
            ]),
            Ready(3),
        ),
        step(
            // A statement pgfence checks first, in a transaction of its own, bound behind
            // another portal of the batch: the check's Sync ended that portal, whose Execute
            // then failed 34000 (review K, stop 54). The check goes right before its Execute.
            "ANALYZE bound behind another portal of its batch",
            cat(&[
                wire::parse("an", "SELECT 1", &[]),
                wire::bind("pan", "an", &[]),
                wire::parse("", "ANALYZE d", &[]),
                wire::bind("", "", &[]),
                wire::execute("pan", 0),
                wire::execute("", 0),
                wire::sync(),
                wire::bind("pan", "an", &[]),
                wire::parse("", "ANALYZE d", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
                wire::execute("pan", 0),
                wire::sync(),
            ]),
            Ready(2),
        ),
        step(
            // Behind an Executed `COMMIT` it runs in a new transaction, on both (pgfence
            // checks it right before it, in that transaction).
            "ANALYZE and REINDEX TABLE behind an Executed COMMIT",
            cat(&[
                pbe("COMMIT", &[]),
                pbe("ANALYZE d", &[]),
                wire::sync(),
                pbe("ROLLBACK", &[]),
                pbe("REINDEX TABLE d", &[]),
                wire::sync(),
            ]),
            Ready(2),
        ),
        step(
            // So are a `VACUUM`, a `CONCURRENTLY` statement and a `REINDEX` of a partitioned
            // table: pgfence learns the state with a Sync of its own once the batch's replies
            // are in, and checks each first on its own (a check right before it would make it
            // fail "within a pipeline"; unchecked, a stale `VACUUM FULL` once committed).
            // So behind an Executed empty statement. Behind an error of the batch the server
            // skips it, on both.
            "VACUUM, CONCURRENTLY and REINDEX of a partitioned table behind an Executed COMMIT",
            cat(&[
                q("CREATE TABLE dpx (a int) PARTITION BY RANGE (a); \
                   CREATE TABLE dpx1 PARTITION OF dpx FOR VALUES FROM (0) TO (10); \
                   CREATE INDEX dpx_a ON dpx (a)"),
                pbe("COMMIT", &[]),
                pbe("VACUUM FULL d", &[]),
                wire::sync(),
                pbe("ROLLBACK", &[]),
                wire::flush(),
                pbe("CREATE INDEX CONCURRENTLY dpx1_c ON dpx1 (a)", &[]),
                pbe(
                    "SELECT count(*) FROM pg_class WHERE relname = 'dpx1_c'",
                    &[],
                ),
                wire::sync(),
                pbe("DISCARD ALL", &[]),
                pbe("REINDEX TABLE dpx", &[]),
                wire::sync(),
                pbe("", &[]),
                pbe("REINDEX TABLE dpx", &[]),
                pbe("VACUUM d", &[]),
                wire::sync(),
                pbe("SELECT 1/0", &[]),
                pbe("COMMIT", &[]),
                pbe("VACUUM d", &[]),
                wire::sync(),
                pbe("COMMIT", &[]),
                pbe("SELECT 1", &[]),
                pbe("VACUUM d", &[]),
                wire::sync(),
                pbe("COMMIT", &[]),
                wire::bind("other", "", &[]),
                pbe("VACUUM d", &[]),
                wire::sync(),
            ]),
            Ready(8),
        ),
        step(
            // A block that changed settings, ended by an Executed `COMMIT`, then a `VACUUM`:
            // pgfence's Sync reports the settings mid-batch, which PostgreSQL reports at the
            // client's Sync. They are held for it, a later change of the same setting
            // replacing the held one (the client was told the old value last), and one
            // changed back not told at all, as PostgreSQL does; so for a notification of
            // the block (it came mid-batch through pgfence). A change of
            // `standard_conforming_strings` made pgfence forget the unnamed statement, and
            // the `VACUUM` was refused "within a pipeline" (review L, stop 55).
            "VACUUM behind an Executed COMMIT of a block that changed settings",
            cat(&[
                q("LISTEN dch"),
                pbe("BEGIN", &[]),
                pbe("NOTIFY dch, 'committed'", &[]),
                pbe("SET standard_conforming_strings = off", &[]),
                pbe("SET application_name = 'changed'", &[]),
                pbe("SET DateStyle = 'SQL, DMY'", &[]),
                pbe("COMMIT", &[]),
                pbe("VACUUM d", &[]),
                pbe("SET application_name = ''", &[]),
                pbe("SET DateStyle = 'ISO, YMD'", &[]),
                wire::sync(),
                q("SET standard_conforming_strings = on; SET DateStyle = 'ISO, MDY'; UNLISTEN dch"),
                // A backslash in a comment of the `VACUUM`: it reads alike under both
                // settings (pgfence forgot it, and the `VACUUM` was refused; review N).
                pbe("BEGIN", &[]),
                pbe("SET standard_conforming_strings = off", &[]),
                pbe("COMMIT", &[]),
                pbe("VACUUM d -- \\", &[]),
                wire::sync(),
                q("SET standard_conforming_strings = on"),
                // Behind a Bind that may have written: pgfence's Sync there is a check's,
                // whose settings it holds too; and they come in PostgreSQL's order.
                pbe("BEGIN", &[]),
                pbe("SET application_name = 'a'", &[]),
                pbe("SET TimeZone = 'UTC'", &[]),
                pbe("COMMIT", &[]),
                wire::parse("", "INSERT INTO d VALUES (31, 'b')", &[]),
                wire::bind("pb", "", &[]),
                pbe("VACUUM d", &[]),
                pbe("SET application_name = 'zz'", &[]),
                pbe("SET application_name = ''", &[]),
                pbe("SET DateStyle = 'SQL, DMY'", &[]),
                wire::sync(),
                q("RESET TimeZone; SET DateStyle = 'ISO, MDY'"),
            ]),
            Ready(7),
        ),
        step(
            // A Query inside a batch behind an Executed `BEGIN` runs in the block that
            // `BEGIN` opened (or is skipped, if it failed): pgfence appended its check to it,
            // which took a snapshot in the block, and the client's `BEGIN ISOLATION LEVEL`
            // after it failed 25001 (random FunctionCalls seed 34086, older than stop 54).
            "a Query inside a batch behind an Executed BEGIN",
            cat(&[
                q("BEGIN"),
                pbe("BEGIN", &[]),
                q("RESET application_name"),
                wire::sync(),
                q("BEGIN ISOLATION LEVEL SERIALIZABLE; SHOW transaction_isolation"),
                q("ROLLBACK"),
            ]),
            Ready(5),
        ),
        step(
            // A portal bound before an Executed `DISCARD ALL`, or a `VACUUM` behind an
            // Executed `COMMIT`: the statement's commit ends it (34000 after), on both.
            // pgfence checks what the batch's Binds may have written before it, with a Sync
            // of its own, which ends the portal the same way (review L, stop 55).
            "DISCARD ALL and VACUUM behind a bound portal",
            cat(&[
                wire::parse("", "INSERT INTO d VALUES (29, 'b')", &[]),
                wire::bind("pb", "", &[]),
                pbe("DISCARD ALL", &[]),
                wire::execute("pb", 0),
                wire::sync(),
                pbe("COMMIT", &[]),
                wire::parse("", "INSERT INTO d VALUES (30, 'b')", &[]),
                wire::bind("pb", "", &[]),
                pbe("VACUUM d", &[]),
                wire::execute("pb", 0),
                wire::sync(),
                q("SELECT count(*) FROM d WHERE id IN (29, 30)"),
            ]),
            Ready(3),
        ),
        step(
            // `COMMIT AND CHAIN` opens a new block at once: the `VACUUM` fails in it, on
            // both.
            "VACUUM inside a batch, behind an Executed COMMIT AND CHAIN",
            cat(&[
                pbe("BEGIN", &[]),
                pbe("COMMIT AND CHAIN", &[]),
                q("VACUUM d"),
                wire::sync(),
                q("ROLLBACK"),
            ]),
            Ready(3),
        ),
        step(
            // Behind an Execute of a read after the ROLLBACK, PostgreSQL refuses it "within a
            // pipeline"; pgfence, unsure whether a block is open, checks first as an Execute
            // too (its check appended to the Query made the error "inside a transaction
            // block").
            "VACUUM inside a batch, behind an Executed ROLLBACK and an Execute of a read",
            cat(&[
                pbe("ROLLBACK", &[]),
                pbe("SELECT 1", &[]),
                q("VACUUM d"),
                wire::sync(),
            ]),
            Ready(2),
        ),
        step(
            // In the block a `COMMIT AND CHAIN` opened, the error is "inside a transaction
            // block", on both.
            "VACUUM inside a batch, behind an Executed COMMIT AND CHAIN and an Execute of a read",
            cat(&[
                pbe("BEGIN", &[]),
                pbe("COMMIT AND CHAIN", &[]),
                pbe("SELECT 1", &[]),
                q("VACUUM d"),
                wire::sync(),
                q("ROLLBACK"),
            ]),
            Ready(3),
        ),
        step(
            // The same behind a Query of the batch that wrote (ending its transaction) and a
            // Parse after it.
            "VACUUM alone inside a batch, behind a Query that wrote and a Parse",
            cat(&[
                wire::parse("", "SELECT 2", &[]),
                q("INSERT INTO d VALUES (23, 'w')"),
                wire::parse("", "SELECT 3", &[]),
                q("VACUUM d"),
                wire::sync(),
            ]),
            Ready(3),
        ),
        step(
            // A Parse before it fails: the server skips the `VACUUM` and the rest up to the
            // Sync; through pgfence too, and no check of pgfence's runs in between.
            "VACUUM inside a batch behind a Parse that fails",
            cat(&[
                wire::parse("", "SELEC 1", &[]),
                q("VACUUM d"),
                pbe("INSERT INTO d VALUES (24, 'x')", &[]),
                wire::sync(),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(2),
        ),
        step("a block that fails", q("BEGIN; SELECT 1/0"), Ready(1)),
        step(
            // The first Query's `BEGIN` leaves pgfence unsure whether a block is open: a
            // check before the second Query failed in the failed block (25P02, hidden) and
            // made the server skip that Query, which PostgreSQL answers with its own 25P02.
            "Queries inside a batch in that failed block, the first with BEGIN, behind Closes",
            cat(&[
                wire::close(b'P', "x"),
                q("INSERT INTO d VALUES (21, 'u'); BEGIN"),
                wire::close(b'P', "x"),
                q("SELECT 1; INSERT INTO d VALUES (22, 'v')"),
                wire::sync(),
                q("ROLLBACK"),
            ]),
            Ready(4),
        ),
        step(
            "failed transaction, pipelined simple queries",
            cat(&[
                q("BEGIN; INSERT INTO d VALUES (5, 'e')"),
                q("SELECT nope"),
                q("SELECT 1"),
                q("COMMIT"),
                q("SELECT count(*) FROM d"),
            ]),
            Ready(5),
        ),
        step(
            "named statement, described",
            cat(&[
                wire::parse("s1", "SELECT $1::int + 1 AS n, $2::text AS t", &[23, 25]),
                wire::describe(b'S', "s1"),
                wire::bind("", "s1", &[Some(b"41"), Some(b"x")]),
                wire::describe(b'P', ""),
                wire::execute("", 0),
                s(),
            ]),
            Ready(1),
        ),
        step(
            "pipelined batches",
            cat(&[
                pbe("INSERT INTO d VALUES ($1, $2)", &[Some(b"6"), Some(b"f")]),
                wire::bind("", "", &[Some(b"7"), Some(b"g")]),
                wire::execute("", 0),
                pbe("SELECT count(*) FROM d", &[]),
                s(),
                wire::parse("", "SELECT t FROM d ORDER BY id", &[]),
                wire::bind("", "", &[]),
                wire::describe(b'P', ""),
                wire::execute("", 0),
                s(),
                wire::bind("", "s1", &[None, None]),
                wire::execute("", 0),
                s(),
            ]),
            Ready(3),
        ),
        step(
            "error mid-batch",
            cat(&[
                pbe("INSERT INTO d VALUES (10, 'j')", &[]),
                pbe("SELECT 1/0", &[]),
                pbe("INSERT INTO d VALUES (11, 'k')", &[]),
                s(),
                pbe("SELECT count(*) FROM d WHERE id >= 10", &[]),
                s(),
            ]),
            Ready(2),
        ),
        step(
            "flush",
            cat(&[
                wire::parse("", "SELECT generate_series(1, 3) AS g", &[]),
                wire::bind("", "", &[]),
                wire::describe(b'P', ""),
                wire::execute("", 0),
                wire::flush(),
            ]),
            Tag(b'C'),
        ),
        step("sync after flush", s(), Ready(1)),
        step(
            "write, flush, then sync",
            cat(&[pbe("INSERT INTO d VALUES (12, 'l')", &[]), wire::flush()]),
            Tag(b'C'),
        ),
        step("sync after the flushed write", s(), Ready(1)),
        step(
            "row limit and PortalSuspended",
            cat(&[
                wire::parse("", "SELECT generate_series(1, 5)", &[]),
                wire::bind("p1", "", &[]),
                wire::execute("p1", 2),
                wire::execute("p1", 2),
                wire::execute("p1", 2),
                wire::close(b'P', "p1"),
                s(),
            ]),
            Ready(1),
        ),
        step(
            "copy in, simple protocol",
            q("COPY d FROM STDIN"),
            Tag(b'G'),
        ),
        step(
            "copy data and done",
            cat(&[
                wire::copy_data(b"20\tx\n21\t"),
                wire::copy_data(b"y\n"),
                wire::copy_done(),
            ]),
            Ready(1),
        ),
        step("copy in to fail", q("COPY d FROM STDIN"), Tag(b'G')),
        step(
            "copy fail",
            cat(&[
                wire::copy_data(b"30\tz\n"),
                wire::copy_fail("client gave up"),
            ]),
            Ready(1),
        ),
        step("copy in with bad data", q("COPY d FROM STDIN"), Tag(b'G')),
        step(
            "bad copy data",
            cat(&[wire::copy_data(b"not a number\tz\n"), wire::copy_done()]),
            Ready(1),
        ),
        step(
            "copy out, text and binary",
            cat(&[
                q("COPY (SELECT * FROM d ORDER BY id) TO STDOUT"),
                q("COPY (SELECT id FROM d WHERE id < 3 ORDER BY id) TO STDOUT (FORMAT binary)"),
            ]),
            Ready(2),
        ),
        step(
            "copy in, extended protocol, libpq order",
            cat(&[
                wire::parse("", "COPY d FROM STDIN", &[]),
                wire::bind("", "", &[]),
                wire::describe(b'P', ""),
                wire::execute("", 0),
                s(),
                wire::copy_data(b"40\tq\n"),
                wire::copy_done(),
                s(),
            ]),
            Ready(1),
        ),
        step(
            "copy in, extended protocol, tokio-postgres order",
            cat(&[
                wire::parse("cp", "COPY d (id, t) FROM STDIN", &[]),
                wire::describe(b'S', "cp"),
                s(),
            ]),
            Ready(1),
        ),
        step(
            "tokio-postgres copy: bind, execute, sync",
            cat(&[wire::bind("", "cp", &[]), wire::execute("", 0), s()]),
            Tag(b'G'),
        ),
        step(
            "tokio-postgres copy: data, done, sync",
            cat(&[wire::copy_data(b"41\tr\n42\ts\n"), wire::copy_done(), s()]),
            Ready(1),
        ),
        step(
            "tokio-postgres copy abandoned",
            cat(&[wire::bind("", "cp", &[]), wire::execute("", 0), s()]),
            Tag(b'G'),
        ),
        step(
            "tokio-postgres copy: fail, sync",
            cat(&[wire::copy_fail(""), s()]),
            Ready(1),
        ),
        step(
            "tokio-postgres copy with bad data",
            cat(&[wire::bind("", "cp", &[]), wire::execute("", 0), s()]),
            Tag(b'G'),
        ),
        step(
            "tokio-postgres copy: bad data, done, sync",
            cat(&[wire::copy_data(b"x\n"), wire::copy_done(), s()]),
            Ready(1),
        ),
        step(
            "extended copy of a missing table",
            cat(&[pbe("COPY no_such_table FROM STDIN", &[]), s()]),
            Ready(1),
        ),
        step(
            "copy fail and sync after the failed start",
            cat(&[wire::copy_fail(""), s()]),
            Ready(1),
        ),
        step(
            "copy in, extended protocol, in a transaction",
            cat(&[
                q("BEGIN"),
                pbe("COPY d FROM STDIN", &[]),
                s(),
                wire::copy_data(b"43\tt\n"),
                wire::copy_done(),
                s(),
                q("COMMIT"),
            ]),
            Ready(3),
        ),
        step(
            "function call",
            cat(&[
                wire::function_call(abs_oid, &[Some(b"-42")]),
                wire::function_call(abs_oid, &[None]),
                wire::function_call(1, &[Some(b"1")]),
                wire::function_call(abs_oid, &[Some(b"7")]),
            ]),
            Ready(4),
        ),
        step(
            "listen and notify to self",
            cat(&[
                q("LISTEN ch"),
                q("NOTIFY ch, 'payload'"),
                q("SELECT pg_notify('ch', 'from a function')"),
                pbe("SELECT pg_notify('ch', $1)", &[Some(b"extended")]),
                s(),
                q("BEGIN; NOTIFY ch, 'in a transaction'; NOTIFY ch, 'twice'; COMMIT"),
                q("UNLISTEN *"),
            ]),
            Ready(6),
        ),
        step(
            "notices from a DO block",
            q(
                "DO $$ BEGIN RAISE NOTICE 'hello %', 1; RAISE WARNING 'careful'; \
               INSERT INTO d VALUES (60, 'from DO'); END $$",
            ),
            Ready(1),
        ),
        step(
            "notice from a function, extended protocol",
            cat(&[
                q(
                    "CREATE FUNCTION shout(t text) RETURNS int LANGUAGE plpgsql AS \
                   $$ BEGIN RAISE NOTICE 'shout %', t; RETURN length(t); END $$",
                ),
                pbe("SELECT shout($1)", &[Some(b"abc")]),
                s(),
            ]),
            Ready(2),
        ),
        step(
            "parameter status",
            cat(&[
                q("SET application_name = 'diff'"),
                q("SET TimeZone = 'UTC'"),
                q("BEGIN; SET LOCAL TimeZone = 'Asia/Tokyo'; SELECT now() IS NOT NULL; COMMIT"),
                q("BEGIN; SET DateStyle = 'German'; ROLLBACK"),
                pbe("SELECT set_config('IntervalStyle', 'iso_8601', false)", &[]),
                s(),
                q("RESET ALL"),
            ]),
            Ready(6),
        ),
        step(
            "SQL that is not valid UTF-8",
            cat(&[
                wire::query(b"SELECT '\xff'".as_slice()),
                wire::parse("", b"SELECT '\xfe\xff'".as_slice(), &[]),
                s(),
                wire::query(b"INSERT INTO d VALUES (70, '\xc3\x28')".as_slice()),
            ]),
            Ready(3),
        ),
        step(
            "close and describe of missing objects",
            cat(&[
                wire::close(b'S', "s1"),
                wire::close(b'S', "never"),
                wire::close(b'P', ""),
                s(),
                wire::describe(b'S', "s1"),
                s(),
                wire::bind("", "never", &[]),
                s(),
            ]),
            Ready(3),
        ),
        step(
            "savepoints, both protocols",
            cat(&[
                q("BEGIN"),
                pbe("INSERT INTO d VALUES (50, 'p')", &[]),
                s(),
                q("SAVEPOINT a"),
                q("INSERT INTO d VALUES (50, 'dup')"),
                q("ROLLBACK TO a"),
                pbe("INSERT INTO d VALUES (51, 'q')", &[]),
                s(),
                q("RELEASE a"),
                q("COMMIT"),
            ]),
            Ready(8),
        ),
        step(
            "extended protocol transaction",
            cat(&[
                pbe("BEGIN", &[]),
                s(),
                pbe("INSERT INTO d VALUES (52, 'r')", &[]),
                s(),
                pbe("COMMIT", &[]),
                s(),
                pbe("BEGIN", &[]),
                pbe("INSERT INTO d VALUES (53, 's')", &[]),
                pbe("ROLLBACK", &[]),
                s(),
            ]),
            Ready(4),
        ),
        step(
            "final state",
            q("SELECT id, t FROM d ORDER BY id"),
            Ready(1),
        ),
        step("terminate", wire::terminate(), Closed),
    ]
}

fn sessions(abs_oid: u32) -> Vec<Session> {
    use Until::*;
    vec![
        Session {
            name: "main",
            startup: wire::startup(SUPERUSER, APP_DB),
            steps: main_steps(abs_oid),
        },
        Session {
            name: "latin1",
            startup: startup_with(wire::PROTOCOL_3_0, &[("client_encoding", b"LATIN1")]),
            steps: vec![
                step(
                    "latin1 text",
                    cat(&[
                        wire::query(b"SELECT '\xe9t\xe9'::text AS v, length('\xe9t\xe9')".as_slice()),
                        wire::query(
                            b"CREATE TABLE l (v text); INSERT INTO l VALUES ('caf\xe9')".as_slice(),
                        ),
                        wire::parse("", b"INSERT INTO l VALUES ('\xfc' || $1)".as_slice(), &[]),
                        wire::bind("", "", &[Some(b"\xe0")]),
                        wire::execute("", 0),
                        s(),
                        wire::query("SELECT v, octet_length(v) FROM l ORDER BY v"),
                    ]),
                    Ready(4),
                ),
                step(
                    "latin1 error position after an inner COMMIT",
                    wire::query(
                        b"BEGIN; INSERT INTO l VALUES ('\xe9\xe9'); COMMIT; SELEC 1".as_slice(),
                    ),
                    Ready(1),
                ),
                step("terminate", wire::terminate(), Closed),
            ],
        },
        Session {
            name: "startup parameters",
            startup: startup_with(
                wire::PROTOCOL_3_0,
                &[
                    ("application_name", b"differential"),
                    ("options", b"-c search_path=pg_catalog -c DateStyle=SQL,DMY"),
                    ("TimeZone", b"Europe/Paris"),
                ],
            ),
            steps: vec![
                step(
                    "settings from startup",
                    q("SHOW search_path; SHOW DateStyle; SHOW TimeZone; SELECT current_setting('application_name')"),
                    Ready(1),
                ),
                step("terminate", wire::terminate(), Closed),
            ],
        },
        Session {
            name: "copy before an inner COMMIT, statements that need a block",
            startup: startup_with(
                wire::PROTOCOL_3_0,
                &[(
                    "options",
                    b"-c fencing.resource=differential-copy -c fencing.token=7",
                )],
            ),
            steps: copy_and_block_steps(),
        },
        first_write_fails("first write fails, no token", "first_a", b""),
        first_write_fails(
            "first write fails, session token",
            "first_b",
            b"-c fencing.resource=differential -c fencing.token=5",
        ),
        Session {
            name: "protocol 3.1",
            startup: startup_with(wire::PROTOCOL_3_0 | 1, &[("_pq_.no_such_option", b"1")]),
            steps: vec![
                step("query", q("SELECT 'negotiated'"), Ready(1)),
                step("terminate", wire::terminate(), Closed),
            ],
        },
    ]
}

fn s() -> Vec<u8> {
    wire::sync()
}

/// A startup packet of protocol `version` as the superuser to the app database, with
/// `extra` parameters.
fn startup_with(version: u32, extra: &[(&str, &[u8])]) -> Vec<u8> {
    let mut params: Vec<(&str, &[u8])> = vec![
        ("user", SUPERUSER.as_bytes()),
        ("database", APP_DB.as_bytes()),
    ];
    params.extend_from_slice(extra);
    wire::startup_version(version, &params)
}

/// A Query holding `COPY ... FROM STDIN` before a COMMIT pgfence checks: pgfence waits for
/// the Query's replies before the client's next message, but must let the copy data
/// through (it once waited for them while the server waited for the data). And `LOCK`,
/// `DECLARE ... CURSOR`, `SET LOCAL`, `DISCARD ALL` and `VACUUM` alone, outside a block or
/// behind a `BEGIN` in flight: a check appended to them made the Query an implicit block,
/// where the first three ran (they fail or warn outside one) and the last two failed. And
/// a batch whose Parse of `VACUUM` fails (its name is in use): pgfence's check of the
/// `VACUUM` ended the batch early, and what followed ran.
fn copy_and_block_steps() -> Vec<Step> {
    use Until::*;
    let copy = |sql: &str, rows: &[&str], end: Vec<u8>| {
        let mut out = q(sql);
        for row in rows {
            out.extend(wire::copy_data(row.as_bytes()));
        }
        out.extend(end);
        out
    };
    vec![
        step("table", q("CREATE TABLE cp (id int PRIMARY KEY)"), Ready(1)),
        step(
            "copy fails before an inner COMMIT",
            copy(
                "COPY cp FROM STDIN; COMMIT",
                &["1\n", "x\n"],
                wire::copy_done(),
            ),
            Ready(1),
        ),
        step(
            "copy in a block, COMMIT and a read after it",
            copy(
                "BEGIN; COPY cp FROM STDIN; COMMIT; SELECT count(*) FROM cp",
                &["1\n2\n"],
                wire::copy_done(),
            ),
            Ready(1),
        ),
        step(
            "copy given up before an inner COMMIT (the block stays failed)",
            cat(&[
                copy(
                    "BEGIN; INSERT INTO cp VALUES (3); COPY cp FROM STDIN; COMMIT",
                    &["4\n"],
                    wire::copy_fail("given up"),
                ),
                q("ROLLBACK"),
            ]),
            Ready(2),
        ),
        step(
            "copy before an inner COMMIT, a Query pipelined after the data",
            cat(&[
                copy("COPY cp FROM STDIN; COMMIT", &["5\n"], wire::copy_done()),
                q("SELECT id FROM cp ORDER BY id"),
            ]),
            Ready(2),
        ),
        step(
            "copy with a statement before it that fails",
            copy(
                "INSERT INTO cp VALUES (1); COPY cp FROM STDIN; COMMIT",
                &["6\n"],
                wire::copy_done(),
            ),
            Ready(1),
        ),
        step("LOCK alone", q("LOCK cp"), Ready(1)),
        step(
            "DECLARE FOR UPDATE alone",
            q("DECLARE c CURSOR FOR SELECT id FROM cp FOR UPDATE"),
            Ready(1),
        ),
        step(
            "DECLARE FOR UPDATE in an implicit block",
            q("DECLARE c CURSOR FOR SELECT id FROM cp ORDER BY id FOR UPDATE; FETCH 2 FROM c"),
            Ready(1),
        ),
        step(
            "LOCK behind a BEGIN in flight",
            cat(&[
                q("BEGIN"),
                q("LOCK cp"),
                q("INSERT INTO cp VALUES (9)"),
                q("COMMIT"),
            ]),
            Ready(4),
        ),
        step(
            "DECLARE WITH HOLD alone",
            cat(&[
                q("DECLARE h CURSOR WITH HOLD FOR SELECT id FROM cp ORDER BY id"),
                q("FETCH ALL FROM h"),
            ]),
            Ready(2),
        ),
        step(
            "SET LOCAL behind a BEGIN that never ran (it warns)",
            cat(&[
                q("SELECT 1/0; BEGIN; INSERT INTO cp VALUES (20)"),
                q("SET LOCAL application_name = 'x'"),
                q("SET TRANSACTION ISOLATION LEVEL SERIALIZABLE"),
            ]),
            Ready(3),
        ),
        step(
            "DISCARD ALL and VACUUM behind a BEGIN that never ran",
            cat(&[
                q("INSERT INTO cp VALUES (1); BEGIN; INSERT INTO cp VALUES (21)"),
                q("DISCARD ALL"),
                q("INSERT INTO cp VALUES (1); BEGIN; INSERT INTO cp VALUES (22)"),
                q("VACUUM cp"),
            ]),
            Ready(4),
        ),
        step(
            "DISCARD ALL and VACUUM behind a BEGIN that ran",
            cat(&[
                q("BEGIN; INSERT INTO cp VALUES (23)"),
                q("DISCARD ALL"),
                q("ROLLBACK"),
                q("BEGIN; INSERT INTO cp VALUES (24)"),
                q("VACUUM cp"),
                q("ROLLBACK"),
            ]),
            Ready(6),
        ),
        step(
            "a statement named v",
            cat(&[wire::parse("v", "SELECT 1", &[]), s()]),
            Ready(1),
        ),
        step(
            "Parse of VACUUM under a name in use, then more in the batch",
            cat(&[
                wire::parse("v", "VACUUM cp", &[]),
                wire::bind("", "v", &[]),
                wire::execute("", 0),
                pbe("INSERT INTO cp VALUES (30)", &[]),
                s(),
            ]),
            Ready(1),
        ),
        step("forget every statement", q("DEALLOCATE ALL"), Ready(1)),
        step(
            "DEALLOCATE ALL behind a write whose check is being prepared",
            cat(&[
                pbe("INSERT INTO cp VALUES (31)", &[]),
                s(),
                q("DEALLOCATE ALL"),
            ]),
            Ready(2),
        ),
        step(
            "the next write",
            cat(&[pbe("INSERT INTO cp VALUES (32)", &[]), s()]),
            Ready(1),
        ),
        step(
            "EXECUTE of a statement parsed as COMMIT",
            cat(&[
                wire::parse("cm", "COMMIT", &[]),
                s(),
                q("BEGIN; INSERT INTO cp VALUES (33)"),
                q("EXECUTE cm"),
                q("SELECT count(*) FROM cp"),
                q("BEGIN; INSERT INTO cp VALUES (34)"),
                pbe("EXECUTE cm", &[]),
                s(),
                q("INSERT INTO cp VALUES (35); EXECUTE cm; SELECT count(*) FROM cp"),
            ]),
            Ready(7),
        ),
        step(
            "EXECUTE of a statement parsed as BEGIN, then a write",
            cat(&[
                wire::parse("bg", "BEGIN", &[]),
                s(),
                q("EXECUTE bg"),
                pbe("INSERT INTO cp VALUES (36)", &[]),
                s(),
                q("EXECUTE bg"),
                q("EXECUTE cm"),
            ]),
            Ready(5),
        ),
        step(
            "a block that wrote",
            q("BEGIN; INSERT INTO cp VALUES (37)"),
            Ready(1),
        ),
        step(
            "a Bind that fails after creating its portal",
            cat(&[
                wire::parse("", "UPDATE cp SET id = 1/0", &[]),
                wire::bind("fp", "", &[]),
                wire::execute("fp", 0),
                s(),
            ]),
            Ready(1),
        ),
        step(
            "that portal executed in the failed block",
            cat(&[wire::execute("fp", 0), wire::execute("fp", 0), s()]),
            Ready(1),
        ),
        step("rolled back", q("ROLLBACK"), Ready(1)),
        // Skipped to the Sync: what the client sends after an error it has read, in a batch
        // it flushed and did not sync. pgfence once ran a pre-check there for a VACUUM, whose
        // own Sync ended the skipping (26000 for the skipped Parse's statement).
        step(
            "a flushed batch that fails",
            cat(&[wire::describe(b'S', "nope"), wire::flush()]),
            Tag(b'E'),
        ),
        step(
            "a VACUUM and a Query in the skipped rest of it",
            cat(&[
                wire::parse("vb", "VACUUM cp", &[]),
                wire::bind("", "vb", &[]),
                wire::execute("", 0),
                q("INSERT INTO cp VALUES (40)"),
                s(),
            ]),
            Ready(1),
        ),
        step("count", q("SELECT count(*) FROM cp"), Ready(1)),
        step("terminate", wire::terminate(), Closed),
    ]
}

/// A session whose first extended-protocol write fails before pgfence's check: the server
/// skips the check's Parse with the rest of the batch, so the next write must prepare it
/// again (it once bound a statement that did not exist: 26000 instead of INSERT).
fn first_write_fails(name: &'static str, table: &str, options: &'static [u8]) -> Session {
    use Until::*;
    let extra: &[(&str, &[u8])] = if options.is_empty() {
        &[]
    } else {
        &[("options", options)]
    };
    let insert = |id: &'static [u8]| pbe(&format!("INSERT INTO {table} VALUES ($1)"), &[Some(id)]);
    Session {
        name,
        startup: startup_with(wire::PROTOCOL_3_0, extra),
        steps: vec![
            step(
                "table",
                q(&format!(
                    "CREATE TABLE {table} (id int PRIMARY KEY); INSERT INTO {table} VALUES (1)"
                )),
                Ready(1),
            ),
            step("duplicate", cat(&[insert(b"1"), s()]), Ready(1)),
            step("next write", cat(&[insert(b"2"), s()]), Ready(1)),
            step(
                "in a block",
                cat(&[pbe("BEGIN", &[]), insert(b"2"), s(), q("ROLLBACK")]),
                Ready(2),
            ),
            step(
                "block after",
                cat(&[pbe("BEGIN", &[]), insert(b"3"), pbe("COMMIT", &[]), s()]),
                Ready(1),
            ),
            step(
                "error position after an inner COMMIT",
                q(&format!(
                    "BEGIN; SELECT 'é€' AS x; INSERT INTO {table} VALUES (7); COMMIT; SELEC 1"
                )),
                Ready(1),
            ),
            step(
                "syntax error in a COMMIT's query string",
                cat(&[
                    q(&format!("BEGIN; INSERT INTO {table} VALUES (8)")),
                    q("COMMIT; SELEC 1"),
                    q("ROLLBACK"),
                ]),
                Ready(3),
            ),
            step(
                "savepoint commands behind a BEGIN that never ran",
                cat(&[
                    q(&format!("INSERT INTO {table} VALUES (NULL); BEGIN")),
                    q("SAVEPOINT s"),
                    q("RELEASE s"),
                    q("ROLLBACK TO SAVEPOINT s"),
                ]),
                Ready(4),
            ),
            // A write that takes no snapshot, then BEGIN, in one batch: the block holds the
            // write, and nothing commits at the Sync. pgfence once checked there, inside the
            // block, and the check's snapshot made the client's SET TRANSACTION fail (25001).
            step(
                "a write, then BEGIN, in one batch",
                cat(&[pbe("NOTIFY differential", &[]), pbe("BEGIN", &[]), s()]),
                Ready(1),
            ),
            step(
                "SET TRANSACTION first in that block",
                cat(&[
                    pbe("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", &[]),
                    s(),
                    q("COMMIT"),
                ]),
                Ready(2),
            ),
            // The same with an error before the BEGIN, in a block that wrote: the next
            // (empty) batch's Sync gets a check, which meets the failed block. That check's
            // 25P02 once counted as the one before the pipelined COMMIT's, and pgfence
            // answered that COMMIT with ROLLBACK where PostgreSQL fails the Query first.
            step(
                "a block that wrote, for an error before a BEGIN",
                q(&format!("BEGIN; INSERT INTO {table} VALUES (11)")),
                Ready(1),
            ),
            step(
                "an error, then BEGIN, in one batch; an empty batch; a write and COMMIT",
                cat(&[
                    pbe("SELECT 1/0", &[]),
                    pbe("BEGIN", &[]),
                    s(),
                    s(),
                    q(&format!("INSERT INTO {table} VALUES (12); COMMIT")),
                    q("ROLLBACK"),
                ]),
                Ready(4),
            ),
            // pgfence waits for the ReadyForQuery of the failed batch in the middle of the
            // next one, behind its Close. A check placed without it met the failed block
            // (25P02) where PostgreSQL answers the COMMIT with ROLLBACK and runs the rest,
            // and the Execute of a portal that is gone with 34000.
            step(
                "a block that wrote",
                q(&format!("BEGIN; INSERT INTO {table} VALUES (9)")),
                Ready(1),
            ),
            step(
                "a COMMIT behind a Close, behind a batch that failed the block",
                cat(&[
                    pbe("SELECT 1/0", &[]),
                    s(),
                    wire::close(b'S', "nothing"),
                    pbe("COMMIT", &[]),
                    pbe("SELECT 1", &[]),
                    s(),
                ]),
                Ready(2),
            ),
            step(
                "another block that wrote",
                q(&format!("BEGIN; INSERT INTO {table} VALUES (10)")),
                Ready(1),
            ),
            step(
                "a portal bound and closed in it",
                cat(&[
                    wire::parse("ps", "SELECT 1", &[]),
                    wire::bind("pp", "ps", &[]),
                    wire::close(b'P', "pp"),
                    s(),
                ]),
                Ready(1),
            ),
            step(
                "that portal executed behind a Close, behind a batch that failed the block",
                cat(&[
                    pbe("SELECT 1/0", &[]),
                    s(),
                    wire::close(b'S', "nothing"),
                    wire::execute("pp", 0),
                    s(),
                    q("ROLLBACK"),
                ]),
                Ready(3),
            ),
            step(
                "rows",
                q(&format!("SELECT id FROM {table} ORDER BY id")),
                Ready(1),
            ),
            step("terminate", wire::terminate(), Closed),
        ],
    }
}

/// Replaces what legitimately differs: BackendKeyData, and the sender pid of notifications.
fn normalise(mut m: Msg) -> Msg {
    match m.tag {
        b'K' => m.body.iter_mut().for_each(|b| *b = 0),
        b'A' => m.body[..4].iter_mut().for_each(|b| *b = 0),
        _ => {}
    }
    m
}

/// Runs `session` against `addr`: the login's messages, then each step's.
fn run(addr: SocketAddr, session: &Session) -> Vec<(String, Vec<Msg>)> {
    let mut conn = RawConn::connect(addr);
    conn.send(&session.startup);
    let mut out = vec![("login".to_string(), conn.until_ready())];
    for st in &session.steps {
        conn.send(&st.send);
        let replies = match st.until {
            Until::Ready(n) => {
                let mut left = n;
                conn.until(|m| {
                    if m.tag == b'Z' {
                        left -= 1;
                    }
                    left == 0
                })
            }
            Until::Tag(tag) => conn.until(|m| m.tag == tag),
            Until::Closed => conn.until_closed(),
        };
        out.push((st.name.clone(), replies));
    }
    out.into_iter()
        .map(|(name, msgs)| (name, msgs.into_iter().map(normalise).collect()))
        .collect()
}

fn start_cluster() -> PgCluster {
    // Function statistics show that the fenced proxy's check ran; they change no reply.
    let cluster = PgCluster::builder()
        .setting("track_functions", "'all'")
        .start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster
}

#[test]
fn same_bytes_direct_and_through_pgfence() {
    let direct = start_cluster();
    let fenced = start_cluster();
    let plain = start_cluster();
    let abs_oid: u32 = direct
        .psql(APP_DB, "SELECT 'abs(int4)'::regprocedure::oid")
        .trim()
        .parse()
        .expect("the oid of abs(int4)");
    let fenced_proxy = Proxy::for_cluster(&fenced);
    let mut config = Proxy::config_for(&plain);
    config.fence.enabled = false;
    let plain_proxy = Proxy::start(config);

    let direct_addr = SocketAddr::from(([127, 0, 0, 1], direct.port()));
    for session in sessions(abs_oid) {
        let expected = run(direct_addr, &session);
        for (mode, addr) in [
            ("fence on", fenced_proxy.addr()),
            ("fence off", plain_proxy.addr()),
        ] {
            let got = run(addr, &session);
            assert_eq!(got.len(), expected.len());
            for ((name, want), (_, have)) in expected.iter().zip(&got) {
                if want != have {
                    let show = |msgs: &[Msg]| {
                        msgs.iter()
                            .map(|m| format!("    {m:?}"))
                            .collect::<Vec<_>>()
                            .join("\n")
                    };
                    panic!(
                        "session {:?}, step {name:?}, {mode}: replies differ\n\
                         --- PostgreSQL ---\n{}\n--- through pgfence ---\n{}",
                        session.name,
                        show(want),
                        show(have)
                    );
                }
            }
        }
    }
    // The fence was really on: pgfence's check ran upstream (and pgfence hid it).
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let calls: u64 = fenced
            .psql(
                APP_DB,
                "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions \
                 WHERE schemaname = 'pgfence' AND funcname = 'check'",
            )
            .trim()
            .parse()
            .expect("a count");
        if calls >= 10 {
            eprintln!("pgfence.check ran {calls} times through the fenced proxy");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "pgfence.check ran {calls} times: was the fence on?"
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}
