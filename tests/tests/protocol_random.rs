//! Randomized differential protocol test: random sessions of simple-protocol queries and
//! pipelined extended-protocol batches, sent as the same raw bytes straight to PostgreSQL,
//! through pgfence with the fence on, and through pgfence with the fence off; the replies
//! must be the same, step by step.
//!
//! It hunts for pgfence's view of the protocol state drifting from the server's: pgfence
//! injects its own Parse/Bind/Execute (or appends its check to a Query) where a transaction
//! that wrote may end, hides their replies, and tracks the replies it is owed in a queue. An
//! error in a batch, a name that already exists, a suspended portal, a transaction ended
//! inside a batch or a Query pipelined behind one must not put that queue out of step.
//!
//! Three clusters are copies of one template set up alike (the fence schema, table `r`), so
//! object ids match, as in `protocol_differential.rs`. Tokens only ever increase (1000 plus
//! the number of sessions run so far), so the fence never rejects anything and the replies
//! must be byte-identical; only BackendKeyData is normalised.
//!
//! The generator (a seeded [`StdRng`]) draws, per session, a startup variant (no token;
//! `options=-c fencing.resource=rnd -c fencing.token=T`; no session token but
//! `/* fencing_token=T fencing_resource=rnd */` comments), a reset of `r`, then random steps:
//!
//! - simple Query: one to four statements among transaction control (`BEGIN`, `COMMIT`,
//!   `ROLLBACK`, `END`, `START TRANSACTION`, `ABORT`, `COMMIT AND CHAIN`,
//!   `ROLLBACK AND CHAIN`, `SAVEPOINT s`,
//!   `ROLLBACK TO SAVEPOINT s`, `RELEASE s`), writes to `r` (INSERT, UPDATE, DELETE, upsert,
//!   a data-modifying CTE, a DO block, SELECT ... FOR UPDATE; with fencing comments in token
//!   sessions), reads, failing statements (division by zero, duplicate key, NOT NULL, an
//!   unknown table, a syntax error), `SET [LOCAL] fencing.token`, `set_config()`, `SET
//!   [LOCAL] fencing.resource` (a second resource, also named by some comments) and `RESET`
//!   in token sessions,
//!   the empty query, and statements pgfence treats apart or that change session state:
//!   cursors (`DECLARE`, `WITH HOLD`, `FOR UPDATE`, `FETCH`, `MOVE`, `CLOSE`), SQL
//!   `PREPARE`/`EXECUTE`/`DEALLOCATE` (`PREPARE` also under the extended protocol's
//!   statement names), `DISCARD`, `SET [LOCAL]` of other settings, `RESET
//!   ALL`, `SET TRANSACTION`, `BEGIN ISOLATION LEVEL ...`, `LISTEN`/`NOTIFY`, `COPY ... TO
//!   STDOUT`, a temporary table, `LOCK`, `TRUNCATE`, `VACUUM`; sometimes several Query messages
//!   pipelined in one write; a Query holding `COPY r FROM STDIN` (alone or among other
//!   statements) followed in the same write by its rows (some bad) and CopyDone or
//!   CopyFail; a two-phase commit (`PREPARE TRANSACTION` in a Query or an extended batch,
//!   `COMMIT PREPARED` or `ROLLBACK PREPARED` pipelined right after it, so that no prepared
//!   transaction outlives its step and holds locks);
//! - extended protocol batches of Parse (named or unnamed, names reused: 42P05), Bind (to
//!   statements that may not exist: 26000; wrong parameter counts), Describe S/P, Execute
//!   (with a row limit on multi-row SELECTs: PortalSuspended, then more Executes of the
//!   portal), Close, Flush, mid-batch Syncs, ending with Sync (sometimes two), sometimes
//!   followed in the same write by a simple Query; or ending with Flush only, the batch
//!   continued (and synced) by the next step. Execute, Describe and Close of the unnamed
//!   portal come only after a Bind of it in the same batch (see `Gen::unnamed_bound`: a
//!   PostgreSQL 15.18 backend crash otherwise); `COPY r FROM STDIN` parsed too, every
//!   Execute of a portal that may hold it followed by rows and CopyDone or CopyFail (copy
//!   messages the server gets outside a copy are ignored, by protocol);
//! - at the end, Terminate (the server rolls back what is open).
//!
//! [`random_sessions_with_queries_inside_batches_same_replies`] runs the same kind of
//! sessions with Queries drawn inside extended-protocol batches too, between their
//! Parse/Bind/Execute and their Sync ([`Gen::inside_batch`]): the server runs such a Query in
//! the batch's implicit transaction and commits that at its end, or skips it without a reply
//! when the batch failed before it. Such a step cannot count its ReadyForQuery beforehand:
//! it ends with [`Out::EndOfStep`] and is read up to that. Its first run (2026-12-03) found a
//! lone `SAVEPOINT` there failing in an implicit block with pgfence's check; the stale
//! variant, [`random_stale_sessions_with_queries_inside_batches_never_commit_a_write`] (which
//! also draws FunctionCalls there), found a FunctionCall committing the batch's stale write
//! unchecked within 12 seeds. Both fixed (`fence_semantics::
//! a_query_or_function_call_inside_a_batch_is_checked_with_what_the_batch_wrote`).
//! [`random_sessions_with_function_calls_same_replies`] adds FunctionCall messages of a
//! function that writes (`w(k)`, [`W_SCHEMA`]) to those sessions, alone and inside batches,
//! and requires PostgreSQL to have answered some of them.
//!
//! A backend crash (signal 11, "Failed process was running: FETCH ...") is PostgreSQL
//! 15.18's own: a Describe of a statement prepared as `FETCH 2 FROM c` while cursor `c` was
//! open, sent after the cursor is gone, crashes it, straight to the server too (`BEGIN;
//! DECLARE c CURSOR FOR ...`, Parse `FETCH 2 FROM c`, `ROLLBACK`, Describe S; seed 1325,
//! session 4 of the stale run with Queries inside batches, found 2026-12-03). The stale run
//! prints the server's log when a side closes the connection.
//!
//! A second test, [`random_stale_sessions_never_commit_a_write`], checks the fence rather
//! than transparency: the same kind of sessions, every token stale (both resources fenced
//! above it, and a default resource so that a write without a token is rejected too),
//! through pgfence with the fast path off and on, must leave `r` as it was (same rows, same
//! writing transactions) and no prepared transaction behind, whatever they send; through
//! pgfence with the fence off most sessions must change `r` (the oracle can fail). Its
//! sessions also draw [`Gen::stale_extra`]: writes the text does not show plainly (a
//! function, a procedure, a trigger, a view, `MERGE`, `EXPLAIN ANALYZE`, a FunctionCall
//! message, calls spelled `"w"(`, `U&"\0077"(`, `w /* */ (`), statement boundaries hidden in
//! literals and comments, read-only transactions and `standard_conforming_strings`. A
//! classifier that took quoted names for non-calls is caught within 40 seeds. On 2026-12-02
//! its first runs (seeds 1 to 2000) found stale writes committed after a Parse skipped or
//! refused while later requests of its name were in flight, and behind a pipelined change
//! of `standard_conforming_strings`, and a session hung by a Terminate after a failed
//! pre-check; all fixed (see [`STALE_REGRESSION_SEEDS`]).
//!
//! Each step is one write; its replies are read up to the number of ReadyForQuery its Syncs
//! and Queries owe (a step ending in Flush: up to one completion per message, or the first
//! error). On a mismatch the test fails with the seed, session, step, every message sent in
//! the session so far and the replies of both sides.
//!
//! Environment (defaults: seeds 1..=40 and [`REGRESSION_SEEDS`], 5 sessions of 25 steps
//! each, about 25 s; with Queries inside batches seeds 1..=40 and
//! [`INSIDE_REGRESSION_SEEDS`]; stale runs below):
//!
//! - `PGFENCE_RANDOM_SEED=n`: run seed `n` only;
//! - `PGFENCE_RANDOM_SEEDS=count` (and `PGFENCE_RANDOM_FIRST_SEED=n`, default 1): run
//!   `count` seeds from `n`;
//! - `PGFENCE_RANDOM_SESSIONS`, `PGFENCE_RANDOM_STEPS`: sessions per seed, steps per session
//!   (fewer steps keep the first ones as they were: cut a session at its failing step);
//! - `PGFENCE_RANDOM_SESSION=k`: only session `k` of each seed (sessions are generated
//!   independently, and each resets `r` first);
//! - `PGFENCE_RANDOM_DROP=3,5,7.2`: leave out steps 3 and 5 and message 2 of step 7 (counted
//!   from 0 as printed), to shrink a failure by hand;
//! - `PGFENCE_RANDOM_KEEP_GOING=1`: after a mismatch go on with the next session, and fail
//!   at the end with all of them;
//! - `PGFENCE_RANDOM_LOOSE_ERRORS=1`: compare errors and notices without their source
//!   location (file, line, routine), to look past a known difference of that kind.
//!
//! Every difference this test found is fixed. On 2026-12-01 (seeds 1..=1306 passed) the
//! last ones were pipelined COMMITs of a block that had failed meanwhile, savepoint
//! commands pipelined behind a `BEGIN` that never ran, and a syntax error in a Query
//! pgfence put a check at the start of. On 2026-12-02 the statements and COPY above were
//! added, and found: a Query of `COPY ... FROM STDIN; COMMIT` hanging (pgfence held the copy
//! data back while it waited for the Query's replies); `LOCK`, `DECLARE ... CURSOR`, `SET
//! LOCAL` and `DISCARD ALL` alone, outside a block or behind a `BEGIN` in flight, doing
//! something else because pgfence's check made the Query an implicit block, and `VACUUM`
//! there failing; a batch whose Parse before a prechecked `VACUUM` failed running on after
//! the precheck's Sync; a session unable to write after a rolled-back prepared transaction
//! (the check's hint outlived it); pgfence binding its check statement after a `DISCARD
//! ALL` it could not know of; and a transaction made read-only after it wrote, which
//! pgfence cannot check (README's "Known limitations"; the generator avoids it). README's
//! "Known limitations" lists what pgfence still answers differently.

use std::collections::{BTreeSet, HashMap};
use std::fmt;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::wire::{self, Msg, RawConn, Read1};
use harness::{PgCluster, Proxy, APP_DB, SUPERUSER};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Seeds beyond the default range whose sessions found a difference, run by default too
/// (with this generator): 1094 and 1242, a failing Parse before a `VACUUM` pgfence checks
/// first; 2341, a prepared transaction rolled back whose check's hint outlived it; 2509
/// and 2860, an Execute of `DISCARD ALL` under a name pgfence had forgotten; 5146, 5322
/// and 5480, transaction control run under a name pgfence had forgotten (its check's
/// portal outlived the check, and the next check could not bind it); 5625, a `DEALLOCATE
/// ALL` behind a check whose statement was being prepared; 5678, 5732 and 5764, a portal
/// whose Bind failed after creating it, executed in the failed block (EmptyQueryResponse);
/// 9717, a Bind of a name whose Parse was in doubt checked before its Execute in a block
/// that had failed (the client's `ROLLBACK TO` skipped); 10281, a pre-check run for a
/// `VACUUM` sent after a flushed batch had failed (its Sync ended the server's skipping);
/// 26580, a Close of a statement the server skipped, which pgfence took as done; 35610, a
/// portal closed earlier in its batch executed in a failed block (a check before it said
/// 25P02, not 34000); 34894 (the same with the Close in an earlier batch), 51243 and 57295
/// (a `COMMIT` behind a Close in a batch sent behind one that failed the block), a check
/// placed in the middle of a batch where pgfence could not wait for the state before it;
/// 31407 and 60947, a check at the Sync of a batch that began a block, which ran in the
/// block before the client's `SET TRANSACTION ISOLATION LEVEL` (25001); 44790 and 46554,
/// found when that check moved to the next Sync: its 25P02 in a failed block taken for the
/// one of a pipelined COMMIT's check.
///
/// Not among them: seed 38026 (run from seed 38000, session 2, step 10), a `SET TRANSACTION
/// ISOLATION LEVEL` that failed with 25001 through pgfence and not directly. It follows
/// the kept server connection, not the fence: with `reuse_servers = false` on the fenced
/// pgfence the same difference showed through the unfenced one instead. The state behind
/// it is the backend's temporary schema, which outlives `DISCARD ALL`: a prepared statement
/// is re-planned (taking a snapshot) when that schema appears after it was planned, so the
/// same sequence re-plans on a backend without one and not on a backend that has one;
/// PostgreSQL alone does the same (README, known limitations).
const REGRESSION_SEEDS: &[u64] = &[
    1094, 1242, 2341, 2509, 2860, 5146, 5322, 5480, 5625, 5678, 5732, 5764, 9717, 10281, 26580,
    31407, 34894, 35610, 44790, 46554, 51243, 57295, 60947,
];

/// The fencing resource of the token sessions.
const RESOURCE: &str = "rnd";
/// A second resource, named by some comments and `SET fencing.resource`.
const RESOURCE_2: &str = "rnd2";
/// How long a side may take to answer one step.
const STEP_TIMEOUT: Duration = Duration::from_secs(10);

/// One frontend message, kept readable for failure reports.
#[derive(Clone, Debug)]
enum Out {
    Query(String),
    Parse {
        name: &'static str,
        sql: String,
    },
    Bind {
        portal: &'static str,
        statement: &'static str,
        params: Vec<String>,
    },
    Describe {
        kind: u8,
        name: &'static str,
    },
    Execute {
        portal: &'static str,
        max_rows: i32,
    },
    Close {
        kind: u8,
        name: &'static str,
    },
    Flush,
    Sync,
    Terminate,
    CopyData(String),
    CopyDone,
    CopyFail,
    /// FunctionCall of `w(k)` (stale runs only; see [`W_OID`]).
    FunctionCall(u32),
    /// Sync, [`END_OF_STEP_CLOSES`] Closes of a statement that does not exist, Sync: ends
    /// a step whose replies cannot be counted beforehand (a Query inside a batch gets no
    /// reply when an error before it in the batch makes the server skip it), so that its
    /// replies are read up to these. The first Sync ends any skipping; a Close of a
    /// statement that does not exist succeeds, even in a failed block, and changes nothing;
    /// and no step of the generator holds that many Closes in a row (a batch has at most
    /// four units), so the replies `Z`, that many `3`, `Z` end the step and only it.
    EndOfStep,
}

thread_local! {
    /// The oid of function `w(int)` in the stale run's cluster, for [`Out::FunctionCall`]
    /// (per test thread: each stale test has its own cluster).
    static W_OID: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

thread_local! {
    /// FunctionCallResponses PostgreSQL sent directly in this thread's run (a FunctionCall
    /// is not counted in `pg_stat_user_functions`).
    static CALLS_ANSWERED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// How many CloseCompletes mark the end of a step's replies ([`Out::EndOfStep`]).
const END_OF_STEP_CLOSES: usize = 5;

impl Out {
    fn bytes(&self) -> Vec<u8> {
        match self {
            Out::Query(sql) => wire::query(sql),
            Out::Parse { name, sql } => wire::parse(name, sql, &[]),
            Out::Bind {
                portal,
                statement,
                params,
            } => {
                let params: Vec<Option<&[u8]>> =
                    params.iter().map(|p| Some(p.as_bytes())).collect();
                wire::bind(portal, statement, &params)
            }
            Out::Describe { kind, name } => wire::describe(*kind, name),
            Out::Execute { portal, max_rows } => wire::execute(portal, *max_rows),
            Out::Close { kind, name } => wire::close(*kind, name),
            Out::Flush => wire::flush(),
            Out::Sync => wire::sync(),
            Out::Terminate => wire::terminate(),
            Out::CopyData(data) => wire::copy_data(data.as_bytes()),
            Out::CopyDone => wire::copy_done(),
            Out::CopyFail => wire::copy_fail("given up"),
            Out::FunctionCall(k) => {
                let oid = W_OID
                    .get()
                    .expect("w's oid is known before a function call");
                wire::function_call(oid, &[Some(k.to_string().as_bytes())])
            }
            Out::EndOfStep => {
                let mut bytes = wire::sync();
                for _ in 0..END_OF_STEP_CLOSES {
                    bytes.extend(wire::close(b'S', "end_of_step"));
                }
                bytes.extend(wire::sync());
                bytes
            }
        }
    }
}

impl fmt::Display for Out {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Out::Query(sql) => write!(f, "Query {sql:?}"),
            Out::Parse { name, sql } => write!(f, "Parse {name:?} {sql:?}"),
            Out::Bind {
                portal,
                statement,
                params,
            } => write!(
                f,
                "Bind portal {portal:?} statement {statement:?} params {params:?}"
            ),
            Out::Describe { kind, name } => write!(f, "Describe {} {name:?}", *kind as char),
            Out::Execute { portal, max_rows } => {
                write!(f, "Execute {portal:?} max_rows {max_rows}")
            }
            Out::Close { kind, name } => write!(f, "Close {} {name:?}", *kind as char),
            Out::Flush => write!(f, "Flush"),
            Out::Sync => write!(f, "Sync"),
            Out::Terminate => write!(f, "Terminate"),
            Out::CopyData(data) => write!(f, "CopyData {data:?}"),
            Out::CopyDone => write!(f, "CopyDone"),
            Out::CopyFail => write!(f, "CopyFail"),
            Out::FunctionCall(k) => write!(f, "FunctionCall w({k})"),
            Out::EndOfStep => write!(
                f,
                "Sync, {END_OF_STEP_CLOSES} x Close S \"end_of_step\", Sync (end of step)"
            ),
        }
    }
}

/// How the session presents a token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    NoToken,
    /// `options=-c fencing.resource=rnd -c fencing.token=T`, sometimes comments too.
    Options,
    /// No session token; comments on some writes.
    Comments,
}

struct Session {
    kind: Kind,
    token: u64,
    steps: Vec<Vec<Out>>,
}

impl Session {
    fn startup(&self) -> Vec<u8> {
        let options = format!(
            "-c fencing.resource={RESOURCE} -c fencing.token={}",
            self.token
        );
        let mut params: Vec<(&str, &[u8])> = vec![
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
        ];
        if self.kind == Kind::Options {
            params.push(("options", options.as_bytes()));
        }
        wire::startup_version(wire::PROTOCOL_3_0, &params)
    }

    fn describe_startup(&self) -> String {
        match self.kind {
            Kind::NoToken => "startup: user postgres, database app, no token".to_string(),
            Kind::Options => format!(
                "startup: user postgres, database app, options \
                 '-c fencing.resource={RESOURCE} -c fencing.token={}'",
                self.token
            ),
            Kind::Comments => format!(
                "startup: user postgres, database app, no session token; comments with token {}",
                self.token
            ),
        }
    }
}

/// Draws one session's steps.
struct Gen {
    rng: StdRng,
    kind: Kind,
    token: u64,
    /// Parameters of the statement last parsed under each name (the generator's guess;
    /// a wrong guess gives a Bind error, which is fine).
    params: HashMap<&'static str, usize>,
    /// The unnamed portal was bound earlier in the batch being drawn. Execute, Describe and
    /// Close of the unnamed portal come only after that: PostgreSQL 15.18 keeps the unnamed
    /// portal of a simple Query that failed in `ROLLBACK TO SAVEPOINT`, and an Execute of it
    /// after a later Query can crash the backend (signal 11; found by this test).
    unnamed_bound: bool,
    /// Statements and portals that may hold a `COPY ... FROM STDIN` (never forgotten: copy
    /// data after an Execute that did not start a copy is ignored by the server).
    copy_in_statements: BTreeSet<&'static str>,
    copy_in_portals: BTreeSet<&'static str>,
    /// A stale run's session: also draws [`Gen::stale_extra`] and FunctionCalls, which need
    /// the stale run's schema (and would change the replies' object ids anyway).
    stale: bool,
    /// Also draws Queries (and, in stale runs, FunctionCalls) inside extended-protocol
    /// batches, between their Parse/Bind/Execute and their Sync: see
    /// [`Gen::inside_batch`].
    inside_batches: bool,
    /// Draws FunctionCalls of `w(k)` outside stale runs too (the clusters have [`W_SCHEMA`]).
    function_calls: bool,
    /// The batch being drawn holds a message sent inside it: the step ends with
    /// [`Out::EndOfStep`].
    uncounted: bool,
}

const STATEMENT_NAMES: &[&str] = &["", "a", "b"];
const PORTAL_NAMES: &[&str] = &["", "p"];

impl Gen {
    /// A portal name for Execute, Describe or Close without a Bind before it in the unit.
    fn bound_portal(&mut self) -> &'static str {
        if self.unnamed_bound && self.chance(0.5) {
            ""
        } else {
            "p"
        }
    }

    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.rng.gen_range(0..items.len())]
    }

    fn chance(&mut self, p: f64) -> bool {
        self.rng.gen_bool(p)
    }

    fn key(&mut self) -> u32 {
        self.rng.gen_range(1..=6)
    }

    fn comment(&mut self, sql: String) -> String {
        let p = match self.kind {
            Kind::NoToken => 0.0,
            Kind::Options => 0.25,
            Kind::Comments => 0.6,
        };
        if !self.chance(p) {
            return sql;
        }
        let t = self.token;
        let r = if self.chance(0.8) {
            RESOURCE
        } else {
            RESOURCE_2
        };
        if self.chance(0.7) {
            format!("/* fencing_token={t} fencing_resource={r} */ {sql}")
        } else {
            format!("{sql} /*fencing_resource='{r}',fencing_token='{t}'*/")
        }
    }

    fn tx_control(&mut self) -> String {
        let choices: &[(&str, u32)] = &[
            ("BEGIN", 10),
            ("COMMIT", 8),
            ("ROLLBACK", 5),
            ("END", 1),
            ("START TRANSACTION", 1),
            ("ABORT", 1),
            ("COMMIT AND CHAIN", 1),
            ("ROLLBACK AND CHAIN", 1),
            ("SAVEPOINT s", 5),
            ("ROLLBACK TO SAVEPOINT s", 3),
            ("RELEASE s", 2),
        ];
        let total: u32 = choices.iter().map(|c| c.1).sum();
        let mut at = self.rng.gen_range(0..total);
        for (sql, w) in choices {
            if at < *w {
                return sql.to_string();
            }
            at -= w;
        }
        unreachable!()
    }

    fn write(&mut self) -> String {
        let k = self.key();
        let sql = match self.rng.gen_range(0..9) {
            0 | 1 => format!("INSERT INTO r VALUES ({k}, {})", k * 10),
            2 | 3 => format!("UPDATE r SET v = v + 1 WHERE id = {k}"),
            4 => format!("DELETE FROM r WHERE id = {k}"),
            5 => format!(
                "INSERT INTO r VALUES ({k}, 0) ON CONFLICT (id) DO UPDATE SET v = r.v + 100"
            ),
            6 => format!(
                "WITH w AS (UPDATE r SET v = v + 1 WHERE id = {k} RETURNING id) \
                 SELECT count(*) FROM w"
            ),
            7 => format!("DO $$ BEGIN UPDATE r SET v = v - 1 WHERE id = {k}; END $$"),
            _ => format!("SELECT id FROM r WHERE id = {k} FOR UPDATE"),
        };
        self.comment(sql)
    }

    fn read(&mut self) -> String {
        let k = self.key();
        match self.rng.gen_range(0..5) {
            0 => "SELECT id, v FROM r ORDER BY id".to_string(),
            1 => "SELECT count(*), sum(v) FROM r".to_string(),
            2 => "SELECT 1 AS one".to_string(),
            3 => "SELECT g FROM generate_series(1, 5) g".to_string(),
            _ => format!("SELECT v FROM r WHERE id = {k}"),
        }
    }

    fn failing(&mut self) -> String {
        match self.rng.gen_range(0..6) {
            0 => "SELECT 1/0".to_string(),
            1 => {
                let sql = format!("INSERT INTO r VALUES ({}, 1)", self.rng.gen_range(1..=3));
                self.comment(sql)
            }
            2 => "INSERT INTO r VALUES (NULL, 1)".to_string(),
            3 => "SELECT * FROM no_such_table".to_string(),
            4 => "UPDATE r SET v = 1/0 WHERE id = 2".to_string(),
            _ => "SELEC 1".to_string(),
        }
    }

    fn token_setting(&mut self) -> String {
        let t = self.token;
        match self.rng.gen_range(0..9) {
            0 | 1 => format!("SET fencing.token = {t}"),
            2 => format!("SET LOCAL fencing.token = {t}"),
            3 => format!(
                "SELECT set_config('fencing.token', '{t}', {})",
                self.chance(0.5)
            ),
            4 => format!("SET fencing.resource = '{RESOURCE_2}'"),
            5 => format!("SET LOCAL fencing.resource = '{RESOURCE_2}'"),
            6 => "RESET fencing.resource".to_string(),
            _ => "RESET fencing.token".to_string(),
        }
    }

    /// Cursors, SQL-level prepared statements, `DISCARD`, settings, notifications, `COPY
    /// ... TO STDOUT`, temporary tables: statements pgfence treats specially or that change
    /// session state it may track.
    fn other(&mut self) -> String {
        let k = self.key();
        match self.rng.gen_range(0..36) {
            0 => "DECLARE c CURSOR FOR SELECT id, v FROM r ORDER BY id".to_string(),
            1 => "DECLARE h CURSOR WITH HOLD FOR SELECT g FROM generate_series(1, 5) g".to_string(),
            2 => format!("DECLARE u CURSOR FOR SELECT id FROM r WHERE id = {k} FOR UPDATE"),
            3 | 4 => self
                .pick(&["FETCH 2 FROM c", "FETCH ALL FROM h", "FETCH u"])
                .to_string(),
            5 => self
                .pick(&["MOVE 1 IN c", "CLOSE c", "CLOSE h", "CLOSE ALL"])
                .to_string(),
            6 => "PREPARE q (int, int) AS INSERT INTO r VALUES ($1, $2)".to_string(),
            // Also under a name the extended protocol uses (its Parse then fails with 42P05,
            // and its Bind runs this). Chosen by `k`, drawn anyway, so that the generator's
            // random stream, and the sessions of earlier seeds, stay as they were.
            7 => match k {
                1 => format!("PREPARE a AS INSERT INTO r VALUES ({k}, 0)"),
                2 => "PREPARE b AS SELECT count(*) FROM r".to_string(),
                _ => "PREPARE qs AS SELECT count(*) FROM r".to_string(),
            },
            8 | 9 => {
                let sql = format!("EXECUTE q({k}, {})", k * 10);
                self.comment(sql)
            }
            10 => "EXECUTE qs".to_string(),
            11 => self
                .pick(&["DEALLOCATE q", "DEALLOCATE ALL", "DEALLOCATE PREPARE qs"])
                .to_string(),
            12 => self
                .pick(&["DISCARD ALL", "DISCARD PLANS", "DISCARD TEMP"])
                .to_string(),
            13 => self
                .pick(&[
                    "SET application_name = 'rnd'",
                    "SET LOCAL application_name = 'rnd2'",
                    "RESET application_name",
                    "SET search_path = public",
                    "SET TIME ZONE 'UTC'",
                ])
                .to_string(),
            14 => "RESET ALL".to_string(),
            15 => self
                .pick(&["LISTEN ch", "UNLISTEN *", "UNLISTEN ch"])
                .to_string(),
            16 => self
                .pick(&["NOTIFY ch, 'x'", "SELECT pg_notify('ch', 'y')"])
                .to_string(),
            17 | 18 => "COPY r TO STDOUT".to_string(),
            19 => "COPY (SELECT id, v FROM r ORDER BY id) TO STDOUT WITH (FORMAT csv)".to_string(),
            20 => {
                "COPY (SELECT id FROM r) TO STDOUT WITH (FORMAT csv, FORCE_QUOTE (id))".to_string()
            }
            21 => "CREATE TEMP TABLE IF NOT EXISTS t (x int)".to_string(),
            22 => {
                let sql = format!("INSERT INTO t VALUES ({k})");
                self.comment(sql)
            }
            23 => "DROP TABLE IF EXISTS t".to_string(),
            24 => {
                let sql = format!("INSERT INTO r VALUES ({k}, 1) RETURNING id, v");
                self.comment(sql)
            }
            25 => format!("SELECT pg_advisory_xact_lock({k})"),
            26 => "SHOW fencing.token".to_string(),
            27 => "SELECT current_setting('fencing.token', true)".to_string(),
            28 => "SHOW transaction_isolation".to_string(),
            29 => "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ".to_string(),
            30 => "BEGIN ISOLATION LEVEL SERIALIZABLE".to_string(),
            // Not `READ ONLY`: after a write it makes a block pgfence's check cannot run in
            // (README, "Known limitations").
            31 => "BEGIN READ WRITE".to_string(),
            32 => {
                let sql = format!("TRUNCATE r; INSERT INTO r VALUES ({k}, {k})");
                self.comment(sql)
            }
            33 => self
                .pick(&["LOCK TABLE r IN ROW EXCLUSIVE MODE", "LOCK r"])
                .to_string(),
            34 => "VACUUM r".to_string(),
            _ => "SELECT 1; SELECT 2".to_string(),
        }
    }

    /// Statements for the stale run only: writes that the text does not show plainly
    /// (functions, procedures, triggers, views, `MERGE`, `EXPLAIN ANALYZE`, calls spelled
    /// oddly, statement boundaries hidden in literals and comments), read-only transactions,
    /// and `standard_conforming_strings`, which changes where a literal ends.
    fn stale_extra(&mut self) -> String {
        let k = self.key();
        let sql = match self.rng.gen_range(0..30) {
            0 => format!("SELECT w({k})"),
            1 => format!("SELECT * FROM w({k})"),
            2 => format!("SELECT id, w(id) FROM r WHERE id = {k}"),
            3 => format!("CALL p({k})"),
            4 => format!("INSERT INTO s VALUES ({k})"),
            5 => format!("INSERT INTO rv VALUES ({}, 1)", k + 20),
            6 => format!("UPDATE rv SET v = 0 WHERE id = {k}"),
            7 => format!(
                "MERGE INTO r USING (VALUES ({k})) AS src(id) ON r.id = src.id \
                 WHEN MATCHED THEN UPDATE SET v = r.v + 7 WHEN NOT MATCHED THEN INSERT VALUES (src.id, 7)"
            ),
            8 => format!("EXPLAIN ANALYZE UPDATE r SET v = v + 1 WHERE id = {k}"),
            9 => format!("EXPLAIN (ANALYZE, COSTS OFF) DELETE FROM r WHERE id = {k}"),
            10 => format!("SELECT \"w\"({k})"),
            11 => format!("SELECT w /* a call */ ({k})"),
            12 => format!("SELECT U&\"\\0077\"({k})"),
            13 => format!("SELECT public.w({k})"),
            14 => format!("WITH x AS (SELECT w({k})) SELECT * FROM x"),
            15 => format!("VALUES (w({k}))"),
            16 => format!("SELECT CASE WHEN true THEN w({k}) END"),
            17 => format!("COPY (SELECT w({k})) TO STDOUT"),
            18 => format!("DECLARE c CURSOR FOR SELECT w({k})"),
            19 => "PREPARE qw (int) AS UPDATE r SET v = v + 5 WHERE id = $1".to_string(),
            20 => format!("EXECUTE qw({k})"),
            21 => format!("SELECT ';' AS semi, w({k})"),
            22 => format!("SELECT E'it\\'s' AS s, w({k})"),
            23 => format!("SELECT $x$;$x$ AS d; UPDATE r SET v = v + 3 WHERE id = {k}"),
            24 => format!("SELECT 1; -- ; comment\nUPDATE r SET v = 9 WHERE id = {k}"),
            25 => format!("/* a /* nested */ comment; */ UPDATE r SET v = 8 WHERE id = {k}"),
            26 => self
                .pick(&[
                    "BEGIN READ ONLY",
                    "SET TRANSACTION READ ONLY",
                    "SET default_transaction_read_only = on",
                    "RESET default_transaction_read_only",
                ])
                .to_string(),
            27 => self
                .pick(&[
                    "SET standard_conforming_strings = off",
                    "SET LOCAL standard_conforming_strings = off",
                    "RESET standard_conforming_strings",
                ])
                .to_string(),
            // One literal, or a literal, an UPDATE and a comment: which one depends on
            // `standard_conforming_strings`.
            28 => format!("SELECT 'x\\'; UPDATE r SET v = 77 WHERE id = {k}; -- '"),
            _ => format!("SELECT 'x\\'; SELECT 1 AS one; -- '; UPDATE r SET v = 78 WHERE id = {k}"),
        };
        self.comment(sql)
    }

    /// One SQL statement from the pool.
    fn statement(&mut self) -> String {
        // Short-circuits outside stale runs: their random stream stays as it was.
        if self.stale && self.chance(0.15) {
            return self.stale_extra();
        }
        let roll = self.rng.gen_range(0..115);
        match roll {
            0..=24 => self.tx_control(),
            25..=59 => self.write(),
            60..=77 => self.read(),
            78..=91 => self.failing(),
            92..=95 if self.kind == Kind::Options => self.token_setting(),
            92..=95 => self.read(),
            96..=99 => String::new(),
            _ => self.other(),
        }
    }

    /// Rows for `COPY r FROM STDIN`, sometimes bad (an error inside the copy).
    fn copy_rows(&mut self) -> Vec<Out> {
        let mut out = Vec::new();
        for _ in 0..self.rng.gen_range(0..=2) {
            let row = match self.rng.gen_range(0..10) {
                0 => "x\t1\n".to_string(),
                1 => "1\t1\n".to_string(),
                _ => {
                    let k = self.rng.gen_range(7..=40);
                    format!("{k}\t{}\n", k * 10)
                }
            };
            out.push(Out::CopyData(row));
        }
        out.push(if self.chance(0.85) {
            Out::CopyDone
        } else {
            Out::CopyFail
        });
        out
    }

    /// A `COPY r FROM STDIN`, sometimes with statements around it in its Query.
    fn copy_in_sql(&mut self) -> String {
        let copy = self.comment("COPY r FROM STDIN".to_string());
        let mut parts = Vec::new();
        if self.chance(0.3) {
            parts.push(self.statement());
        }
        parts.push(copy);
        if self.chance(0.3) {
            parts.push(self.statement());
        }
        parts.retain(|s| !s.is_empty() && !s.contains("SELECT 1; SELECT 2"));
        parts.join("; ")
    }

    /// A two-phase commit resolved in the same write: a prepared transaction left behind
    /// would hold the fence's lock (and rows of `r`) and block the rest of the session.
    fn two_phase_step(&mut self) -> Vec<Out> {
        let write = self.write();
        let prepare = format!("PREPARE TRANSACTION 'g{}'", self.token);
        let end = if self.chance(0.6) {
            "COMMIT"
        } else {
            "ROLLBACK"
        };
        let resolve = format!("{end} PREPARED 'g{}'", self.token);
        let first = match self.rng.gen_range(0..3) {
            0 => format!("BEGIN; {write}; {prepare}"),
            1 => format!("{write}; {prepare}"),
            _ => prepare.clone(),
        };
        if self.chance(0.5) {
            vec![Out::Query(first), Out::Query(resolve)]
        } else {
            vec![
                Out::Query(format!("BEGIN; {write}")),
                Out::Parse {
                    name: "",
                    sql: prepare,
                },
                Out::Bind {
                    portal: "",
                    statement: "",
                    params: vec![],
                },
                Out::Execute {
                    portal: "",
                    max_rows: 0,
                },
                Out::Sync,
                Out::Query(resolve),
            ]
        }
    }

    fn simple_sql(&mut self) -> String {
        let n = match self.rng.gen_range(0..8) {
            0..=3 => 1,
            4 | 5 => 2,
            6 => 3,
            _ => 4,
        };
        if n == 1 {
            return self.statement();
        }
        let parts: Vec<String> = (0..n)
            .map(|_| self.statement())
            .filter(|s| !s.is_empty())
            .collect();
        parts.join("; ")
    }

    fn simple_step(&mut self) -> Vec<Out> {
        if self.calls_w() && self.chance(0.04) {
            let k = self.key();
            return vec![Out::FunctionCall(k)];
        }
        if self.chance(0.03) {
            return self.two_phase_step();
        }
        let n = if self.chance(0.15) {
            self.rng.gen_range(2..=3)
        } else {
            1
        };
        let mut out = Vec::new();
        for _ in 0..n {
            if self.chance(0.08) {
                out.push(Out::Query(self.copy_in_sql()));
                out.extend(self.copy_rows());
            } else {
                out.push(Out::Query(self.simple_sql()));
            }
        }
        out
    }

    /// SQL for a Parse, and its number of parameters.
    fn parse_sql(&mut self) -> (String, usize) {
        match self.rng.gen_range(0..100) {
            0..=3 => ("INSERT INTO r VALUES ($1, $2)".to_string(), 2),
            4..=5 => ("SELECT $1::int * 2 AS doubled".to_string(), 1),
            6..=15 => ("SELECT g FROM generate_series(1, 5) g".to_string(), 0),
            16..=18 => (self.comment("COPY r FROM STDIN".to_string()), 0),
            _ => (self.statement(), 0),
        }
    }

    fn bind_params(&mut self, statement: &'static str) -> Vec<String> {
        let mut n = self.params.get(statement).copied().unwrap_or(0);
        if self.chance(0.05) {
            n = self.rng.gen_range(0..=2);
        }
        (0..n)
            .map(|_| self.rng.gen_range(1..=7u32).to_string())
            .collect()
    }

    fn execute(&mut self, out: &mut Vec<Out>, portal: &'static str) {
        let copy_in = self.copy_in_portals.contains(portal);
        if self.chance(0.2) {
            out.push(Out::Execute {
                portal,
                max_rows: 2,
            });
            if copy_in {
                out.extend(self.copy_rows());
            }
            for _ in 0..self.rng.gen_range(0..=3) {
                let max_rows = self.pick(&[0, 1, 2]);
                out.push(Out::Execute { portal, max_rows });
                if copy_in {
                    out.extend(self.copy_rows());
                }
            }
        } else {
            out.push(Out::Execute {
                portal,
                max_rows: 0,
            });
            if copy_in {
                out.extend(self.copy_rows());
            }
        }
    }

    /// Notes what a Bind of `statement` to `portal` may hold.
    fn bound(&mut self, portal: &'static str, statement: &'static str) {
        self.unnamed_bound |= portal.is_empty();
        if self.copy_in_statements.contains(statement) {
            self.copy_in_portals.insert(portal);
        }
    }

    /// Whether FunctionCalls of `w(k)` are drawn (short-circuited first: the random streams
    /// of runs without them stay as they were).
    fn calls_w(&self) -> bool {
        self.stale || self.function_calls
    }

    /// A Query (or, in stale runs, a FunctionCall) inside an extended-protocol batch. The
    /// server runs it in the batch's implicit transaction and commits that at its end, so
    /// what the batch wrote before it is committed there (or, behind a `BEGIN` it holds,
    /// kept in a block); if something before it in the batch failed, the server skips it
    /// without a reply, up to the Sync.
    fn inside_batch(&mut self, out: &mut Vec<Out>) {
        self.uncounted = true;
        if self.calls_w() && self.chance(0.15) {
            let k = self.key();
            out.push(Out::FunctionCall(k));
            return;
        }
        // It may be a lone `VACUUM r`: PostgreSQL runs it behind only a Parse, Bind,
        // Describe, Close, Executes of empty statements or an Executed `COMMIT` or
        // `ROLLBACK`, and refuses it "within a pipeline" behind an Execute of any other
        // statement of its transaction; through pgfence too.
        let sql = self.simple_sql();
        out.push(Out::Query(sql));
    }

    /// One unit of an extended-protocol batch. `syncs`: whether a Sync may appear.
    fn unit(&mut self, out: &mut Vec<Out>, syncs: bool) {
        // Short-circuits unless drawn: other runs' random streams stay as they were.
        if self.inside_batches && syncs && self.chance(0.1) {
            self.inside_batch(out);
            return;
        }
        match self.rng.gen_range(0..100) {
            0..=54 => {
                // Parse, Bind, Execute, with Describes now and then.
                let name = if self.chance(0.65) {
                    ""
                } else {
                    self.pick(&STATEMENT_NAMES[1..])
                };
                let (sql, n) = self.parse_sql();
                self.params.insert(name, n);
                if sql.contains("FROM STDIN") {
                    self.copy_in_statements.insert(name);
                }
                out.push(Out::Parse { name, sql });
                if self.chance(0.15) {
                    out.push(Out::Describe { kind: b'S', name });
                }
                let portal = if self.chance(0.8) { "" } else { "p" };
                let params = self.bind_params(name);
                out.push(Out::Bind {
                    portal,
                    statement: name,
                    params,
                });
                self.bound(portal, name);
                if self.chance(0.15) {
                    out.push(Out::Describe {
                        kind: b'P',
                        name: portal,
                    });
                }
                self.execute(out, portal);
            }
            55..=69 => {
                // Bind and Execute of a statement that may or may not exist.
                let statement = if self.chance(0.1) {
                    "nope"
                } else {
                    self.pick(STATEMENT_NAMES)
                };
                let portal = self.pick(PORTAL_NAMES);
                let params = self.bind_params(statement);
                out.push(Out::Bind {
                    portal,
                    statement,
                    params,
                });
                self.bound(portal, statement);
                self.execute(out, portal);
            }
            70..=74 => {
                let portal = self.bound_portal();
                self.execute(out, portal);
            }
            75..=79 => {
                let kind = self.pick(b"SP");
                let name = if kind == b'S' {
                    self.pick(STATEMENT_NAMES)
                } else {
                    self.bound_portal()
                };
                out.push(Out::Close { kind, name });
            }
            80..=84 => {
                let kind = self.pick(b"SP");
                let name = if kind == b'S' {
                    self.pick(STATEMENT_NAMES)
                } else {
                    self.bound_portal()
                };
                out.push(Out::Describe { kind, name });
            }
            85..=89 => out.push(Out::Flush),
            _ if syncs => {
                out.push(Out::Sync);
                self.unnamed_bound = false;
            }
            _ => out.push(Out::Flush),
        }
    }

    /// An extended-protocol batch. Returns the messages and whether the batch stays open
    /// (ends with Flush, no Sync: the next step continues it).
    fn extended_step(&mut self) -> (Vec<Out>, bool) {
        let open = self.chance(0.08);
        let mut out = Vec::new();
        for _ in 0..self.rng.gen_range(1..=4) {
            self.unit(&mut out, !open);
        }
        if open {
            out.push(Out::Flush);
            return (out, true);
        }
        out.push(Out::Sync);
        self.unnamed_bound = false;
        if self.chance(0.07) {
            out.push(Out::Sync);
        }
        if self.chance(0.1) {
            out.push(Out::Query(self.simple_sql()));
        }
        if std::mem::take(&mut self.uncounted) {
            out.push(Out::EndOfStep);
        }
        (out, false)
    }

    fn session(mut self, steps: usize) -> Session {
        let mut out = vec![vec![Out::Query(
            "TRUNCATE r; INSERT INTO r VALUES (1, 10), (2, 20), (3, 30)".to_string(),
        )]];
        let mut open = false;
        for _ in 0..steps {
            if !open && self.chance(0.4) {
                out.push(self.simple_step());
            } else {
                let (step, still_open) = self.extended_step();
                out.push(step);
                open = still_open;
            }
        }
        out.push(vec![Out::Terminate]);
        Session {
            kind: self.kind,
            token: self.token,
            steps: out,
        }
    }
}

/// What a run's sessions draw besides the common pool.
#[derive(Clone, Copy, Debug, Default)]
struct Draw {
    /// [`Gen::stale_extra`] and FunctionCalls (the stale run's schema).
    stale: bool,
    /// Queries (and FunctionCalls) inside batches ([`Gen::inside_batch`]).
    inside_batches: bool,
    /// FunctionCalls of `w(k)` without the rest of the stale run's draws.
    function_calls: bool,
}

fn generate(seed: u64, session: usize, steps: usize, token: u64, draw: Draw) -> Session {
    let mix = seed
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(session as u64)
        .wrapping_mul(0xBF58_476D_1CE4_E5B9);
    let mut rng = StdRng::seed_from_u64(mix);
    let kind = match rng.gen_range(0..10) {
        0..=3 => Kind::NoToken,
        4..=7 => Kind::Options,
        _ => Kind::Comments,
    };
    Gen {
        rng,
        kind,
        token,
        params: HashMap::new(),
        unnamed_bound: false,
        copy_in_statements: BTreeSet::new(),
        copy_in_portals: BTreeSet::new(),
        stale: draw.stale,
        inside_batches: draw.inside_batches,
        function_calls: draw.function_calls,
        uncounted: false,
    }
    .session(steps)
}

/// How far to read one step's replies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Expect {
    /// This many ReadyForQuery.
    Ready(usize),
    /// A batch without Sync, flushed: one completion per message, or up to an error.
    Completions(usize),
    /// Nothing (the batch failed in an earlier step and is skipped up to its Sync).
    Nothing,
    /// The connection's end.
    Closed,
    /// Up to the replies of [`Out::EndOfStep`].
    EndOfStep,
}

fn expect(step: &[Out], batch_failed: bool) -> Expect {
    if step.iter().any(|m| matches!(m, Out::Terminate)) {
        return Expect::Closed;
    }
    if step.iter().any(|m| matches!(m, Out::EndOfStep)) {
        return Expect::EndOfStep;
    }
    let ready = step
        .iter()
        .filter(|m| matches!(m, Out::Sync | Out::Query(_) | Out::FunctionCall(_)))
        .count();
    if ready > 0 {
        return Expect::Ready(ready);
    }
    if batch_failed {
        return Expect::Nothing;
    }
    Expect::Completions(
        step.iter()
            .filter(|m| {
                !matches!(
                    m,
                    Out::Flush | Out::CopyData(_) | Out::CopyDone | Out::CopyFail
                )
            })
            .count(),
    )
}

/// What one side answered to one step.
#[derive(Clone, PartialEq, Eq)]
struct Replies {
    msgs: Vec<Msg>,
    /// How reading ended if not as expected (timeout, closed).
    trouble: Option<String>,
}

fn read(conn: &mut RawConn, expect: Expect) -> Replies {
    let deadline = Instant::now() + STEP_TIMEOUT;
    let mut msgs = Vec::new();
    let (mut ready, mut done) = (0, 0);
    let target_done = |ready: usize, done: usize, msgs: &[Msg]| match expect {
        Expect::Ready(n) => ready == n,
        Expect::Completions(n) => done == n || msgs.last().is_some_and(|m| m.tag == b'E'),
        Expect::Nothing => true,
        Expect::Closed => false,
        Expect::EndOfStep => {
            let end = END_OF_STEP_CLOSES + 2;
            msgs.len() >= end && {
                let tail = &msgs[msgs.len() - end..];
                tail[0].tag == b'Z'
                    && tail[end - 1].tag == b'Z'
                    && tail[1..end - 1].iter().all(|m| m.tag == b'3')
            }
        }
    };
    if matches!(expect, Expect::Nothing | Expect::Completions(0)) {
        return Replies {
            msgs,
            trouble: None,
        };
    }
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match conn.next(left.max(Duration::from_millis(1))) {
            Ok(Read1::Msg(m)) => {
                match m.tag {
                    b'Z' => ready += 1,
                    b'1' | b'2' | b'3' | b'n' | b'T' | b'C' | b's' | b'I' => done += 1,
                    _ => {}
                }
                msgs.push(normalise(m));
                if target_done(ready, done, &msgs) {
                    return Replies {
                        msgs,
                        trouble: None,
                    };
                }
            }
            Ok(Read1::Closed) => {
                let trouble = (expect != Expect::Closed).then(|| "connection closed".to_string());
                return Replies { msgs, trouble };
            }
            Err(e) => {
                return Replies {
                    msgs,
                    trouble: Some(e),
                }
            }
        }
    }
}

/// Replaces what legitimately differs: BackendKeyData. With `PGFENCE_RANDOM_LOOSE_ERRORS=1`
/// also the source location (file, line, routine) of errors and notices, to look past a
/// known difference of that kind for others.
fn normalise(mut m: Msg) -> Msg {
    static LOOSE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    if m.tag == b'K' {
        m.body.iter_mut().for_each(|b| *b = 0);
    }
    // A notification names its sender by pid: the server's own, or the one pgfence gave.
    if m.tag == b'A' && m.body.len() >= 4 {
        m.body[..4].iter_mut().for_each(|b| *b = 0);
    }
    let loose =
        *LOOSE.get_or_init(|| std::env::var("PGFENCE_RANDOM_LOOSE_ERRORS").is_ok_and(|v| v == "1"));
    if loose && matches!(m.tag, b'E' | b'N') {
        let mut body = Vec::new();
        for (code, value) in m.fields() {
            if !matches!(code, b'F' | b'L' | b'R') {
                body.push(code);
                body.extend_from_slice(value.as_bytes());
                body.push(0);
            }
        }
        body.push(0);
        m.body = body;
    }
    m
}

fn show(r: &Replies) -> String {
    let mut s: String = r.msgs.iter().map(|m| format!("    {m:?}\n")).collect();
    if let Some(t) = &r.trouble {
        s.push_str(&format!("    !! {t}\n"));
    }
    s
}

/// Which messages to leave out (`PGFENCE_RANDOM_DROP`).
#[derive(Default)]
struct Omit {
    steps: BTreeSet<usize>,
    messages: BTreeSet<(usize, usize)>,
}

impl Omit {
    fn from_env() -> Omit {
        let mut d = Omit::default();
        let Ok(spec) = std::env::var("PGFENCE_RANDOM_DROP") else {
            return d;
        };
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let bad = || panic!("PGFENCE_RANDOM_DROP: bad item {item:?} (want 5 or 5.2)");
            match item.split_once('.') {
                Some((s, m)) => {
                    d.messages.insert((
                        s.parse().unwrap_or_else(|_| bad()),
                        m.parse().unwrap_or_else(|_| bad()),
                    ));
                }
                None => {
                    d.steps.insert(item.parse().unwrap_or_else(|_| bad()));
                }
            }
        }
        d
    }

    /// The session's steps as sent: (number as generated, messages).
    fn apply(&self, steps: &[Vec<Out>]) -> Vec<(usize, Vec<Out>)> {
        steps
            .iter()
            .enumerate()
            .filter(|(i, _)| !self.steps.contains(i))
            .map(|(i, step)| {
                let kept = step
                    .iter()
                    .enumerate()
                    .filter(|(j, _)| !self.messages.contains(&(i, *j)))
                    .map(|(_, m)| m.clone())
                    .collect();
                (i, kept)
            })
            .filter(|(_, step): &(usize, Vec<Out>)| !step.is_empty())
            .collect()
    }
}

fn show_steps(steps: &[(usize, Vec<Out>)], upto: usize) -> String {
    let mut s = String::new();
    for (i, step) in steps.iter().take(upto + 1) {
        s.push_str(&format!("  step {i}:\n"));
        for (j, m) in step.iter().enumerate() {
            s.push_str(&format!("    {i}.{j} {m}\n"));
        }
    }
    s
}

struct Targets {
    direct: SocketAddr,
    others: [(&'static str, SocketAddr); 2],
}

/// Ends a session cut short by a mismatch: Terminate, and wait (a little) for each side to
/// close, so that what it had open is rolled back before the next session starts.
fn end(direct: &mut RawConn, others: &mut [(&str, RawConn)]) {
    let conns = std::iter::once(direct).chain(others.iter_mut().map(|(_, c)| c));
    for c in conns {
        if c.try_send(&wire::terminate()).is_ok() {
            while let Ok(Read1::Msg(_)) = c.next(Duration::from_secs(2)) {}
        }
    }
}

/// Why a session failed.
enum Failure {
    /// PostgreSQL itself did not answer as the generator expected: a flaw of the generator.
    Direct(String),
    /// pgfence's replies differ from PostgreSQL's.
    Mismatch(String),
}

/// Runs one session on the three sides in lockstep; `Err` describes the first mismatch.
fn run_session(
    targets: &Targets,
    seed: u64,
    number: usize,
    session: &Session,
    drop: &Omit,
) -> Result<(), Failure> {
    let steps = drop.apply(&session.steps);
    let fail = |step: usize, label: &str, mode: &str, want: &Replies, have: &Replies| {
        let at = steps.iter().position(|(i, _)| *i == step).unwrap_or(0);
        format!(
            "seed {seed}, session {number}, step {label}, {mode}: replies differ\n\
             reproduce: PGFENCE_RANDOM_SEED={seed} PGFENCE_RANDOM_SESSION={number} \
             cargo test -p pgfence-tests --test protocol_random\n\
             {}\nsent (steps of this session so far, each step one write):\n{}\
             --- PostgreSQL ---\n{}--- through pgfence, {mode} ---\n{}",
            session.describe_startup(),
            show_steps(&steps, at),
            show(want),
            show(have)
        )
    };
    let startup = session.startup();
    let mut direct = RawConn::connect(targets.direct);
    let mut others: Vec<(&str, RawConn)> = targets
        .others
        .iter()
        .map(|&(mode, addr)| (mode, RawConn::connect(addr)))
        .collect();
    direct.send(&startup);
    for (_, c) in &mut others {
        c.send(&startup);
    }
    let want = read(&mut direct, Expect::Ready(1));
    if let Some(t) = &want.trouble {
        panic!("seed {seed}, session {number}: login directly: {t}");
    }
    // Every side's replies are read before comparing, so that after a mismatch nothing
    // of the step is still running on any server when the next session starts.
    let got: Vec<Replies> = others
        .iter_mut()
        .map(|(_, c)| read(c, Expect::Ready(1)))
        .collect();
    for ((mode, _), have) in others.iter().zip(&got) {
        if *have != want {
            let report = fail(0, "login", mode, &want, have);
            end(&mut direct, &mut others);
            return Err(Failure::Mismatch(report));
        }
    }
    let mut batch_failed = false;
    for (i, step) in &steps {
        let bytes: Vec<u8> = step.iter().flat_map(Out::bytes).collect();
        let expect = expect(step, batch_failed);
        direct.send(&bytes);
        for (_, c) in &mut others {
            // A side that closed early shows in its replies.
            let _ = c.try_send(&bytes);
        }
        let want = read(&mut direct, expect);
        CALLS_ANSWERED
            .set(CALLS_ANSWERED.get() + want.msgs.iter().filter(|m| m.tag == b'V').count());
        if let Some(t) = &want.trouble {
            return Err(Failure::Direct(format!(
                "seed {seed}, session {number}, step {i}: PostgreSQL did not answer as the \
                 generator expected ({expect:?}): {t}\n{}\nsent:\n{}received:\n{}",
                session.describe_startup(),
                show_steps(&steps, steps.iter().position(|(j, _)| j == i).unwrap_or(0)),
                show(&want)
            )));
        }
        for m in &want.msgs {
            match m.tag {
                b'E' => batch_failed = true,
                b'Z' => batch_failed = false,
                _ => {}
            }
        }
        let got: Vec<Replies> = others.iter_mut().map(|(_, c)| read(c, expect)).collect();
        for ((mode, _), have) in others.iter().zip(&got) {
            if *have != want {
                let report = fail(*i, &i.to_string(), mode, &want, have);
                end(&mut direct, &mut others);
                return Err(Failure::Mismatch(report));
            }
        }
    }
    Ok(())
}

fn env_num(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| {
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?}: not a number"))
    })
}

fn start_cluster() -> PgCluster {
    // No autovacuum: an automatic ANALYZE of `r` on one cluster and not the other
    // invalidates its prepared statements there, and a Describe of one then takes a snapshot
    // (PostgreSQL analyses it again), so that a `BEGIN ISOLATION LEVEL` after it in the same
    // batch fails with 25001 on that cluster only (seed 83828, session 0, 1 run in about 20,
    // with the fence on or off).
    let cluster = PgCluster::builder()
        .setting("track_functions", "'all'")
        .setting("autovacuum", "off")
        .start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster.psql(APP_DB, "CREATE TABLE r (id int PRIMARY KEY, v int)");
    cluster
}

/// What to run, from the environment (see the module documentation).
struct Run {
    seeds: Vec<u64>,
    sessions: usize,
    steps: usize,
    only_session: Option<usize>,
    keep_going: bool,
    drop: Omit,
}

impl Run {
    /// `default_seeds` unless `PGFENCE_RANDOM_SEED(S)` says otherwise.
    fn from_env(default_seeds: impl Iterator<Item = u64>) -> Run {
        let seeds = match (
            env_num("PGFENCE_RANDOM_SEED"),
            env_num("PGFENCE_RANDOM_SEEDS"),
        ) {
            (Some(seed), _) => vec![seed],
            (None, Some(count)) => {
                let first = env_num("PGFENCE_RANDOM_FIRST_SEED").unwrap_or(1);
                (first..first + count).collect()
            }
            (None, None) => default_seeds.collect(),
        };
        Run {
            seeds,
            sessions: env_num("PGFENCE_RANDOM_SESSIONS").unwrap_or(5) as usize,
            steps: env_num("PGFENCE_RANDOM_STEPS").unwrap_or(25) as usize,
            only_session: env_num("PGFENCE_RANDOM_SESSION").map(|s| s as usize),
            keep_going: std::env::var("PGFENCE_RANDOM_KEEP_GOING").is_ok_and(|v| v == "1"),
            drop: Omit::from_env(),
        }
    }

    /// (seed, session number) of every session to run, in order.
    fn cases(&self) -> Vec<(u64, usize)> {
        let sessions = (0..self.sessions).filter(|&n| self.only_session.is_none_or(|s| s == n));
        let sessions: Vec<usize> = sessions.collect();
        self.seeds
            .iter()
            .flat_map(|&seed| sessions.iter().map(move |&n| (seed, n)))
            .collect()
    }

    fn describe(&self) -> String {
        let seeds = &self.seeds;
        let which = if seeds.len() > 8 {
            format!(
                "{} from {} to {}",
                seeds.len(),
                seeds[0],
                seeds[seeds.len() - 1]
            )
        } else {
            format!("{seeds:?}")
        };
        let only = self
            .only_session
            .map(|s| format!(" (session {s} only)"))
            .unwrap_or_default();
        format!(
            "seeds {which}{only}, {} sessions of {} steps per seed",
            self.sessions, self.steps
        )
    }
}

/// Panics with the first line of every report and the first report in full, if any.
fn fail_if_any(failures: &[String], what: &str) {
    if let Some(first) = failures.first() {
        let firsts: Vec<&str> = failures
            .iter()
            .map(|f| f.lines().next().unwrap_or_default())
            .collect();
        panic!(
            "{} {what}:\n{}\n\nfirst one in full:\n{first}",
            failures.len(),
            firsts.join("\n"),
        );
    }
}

#[test]
fn random_sessions_same_replies_direct_and_through_pgfence() {
    same_replies(
        Run::from_env((1..=40).chain(REGRESSION_SEEDS.iter().copied())),
        Draw::default(),
    );
}

/// The same, with Queries inside extended-protocol batches ([`Gen::inside_batch`]), each
/// such step read up to [`Out::EndOfStep`]. Seeds 1 to 40 and [`INSIDE_REGRESSION_SEEDS`] by
/// default, or as `PGFENCE_RANDOM_SEED(S)` say.
#[test]
fn random_sessions_with_queries_inside_batches_same_replies() {
    same_replies(
        Run::from_env((1..=40).chain(INSIDE_REGRESSION_SEEDS.iter().copied())),
        Draw {
            inside_batches: true,
            ..Draw::default()
        },
    );
}

/// Seeds beyond the default range of [`random_sessions_with_function_calls_same_replies`]
/// that found a difference, run by default too: 102, a Query inside the batch of an
/// extended-protocol `COMMIT` pgfence had checked, which opened a block that failed; a check
/// before the batch's Sync then met that failed block (25P02), and pgfence took it for the
/// `COMMIT`'s and ended the client's block with a `ROLLBACK` of its own; 1647, a
/// FunctionCall alone (a transaction of its own, checked first) that left the session
/// marked as written: the check before the Sync of the next batch, which opened a block,
/// took a snapshot there, and a `SET TRANSACTION ISOLATION LEVEL` after it failed; 28275,
/// a `VACUUM` Query after an Execute of `DISCARD ALL` in its batch, which PostgreSQL
/// commits at once: pgfence took the batch for pipelined, checked it first, and the check
/// made the server refuse the `VACUUM` "within a pipeline"; 30326, a Query `BEGIN` inside a
/// batch that had written (with `SET LOCAL fencing.token`), then two Syncs: pgfence checked
/// at the second Sync, inside the block the `BEGIN` had opened, and the check's snapshot made
/// the next `BEGIN ISOLATION LEVEL SERIALIZABLE` fail (25001). A Sync whose batch executed
/// nothing ends nothing that wrote. 31309, a Query ending in `BEGIN` inside a batch that
/// had written: the check before it took a snapshot, and the Query's `SET TRANSACTION
/// ISOLATION LEVEL` failed (25001). 32094, a FunctionCall held behind a Sync and an
/// Execute of a closed portal in a failed block: the Execute's error left nothing in
/// flight to release it, and the session hung.
const FUNCTION_CALL_REGRESSION_SEEDS: &[u64] = &[102, 1647, 28275, 30326, 31309, 32094];

/// The same, with FunctionCall messages too: of `w(k)` ([`W_SCHEMA`], a function that
/// writes to `r` when row `k` exists), alone as a step and inside extended-protocol batches
/// ([`Gen::inside_batch`]), where the server commits the batch's implicit transaction at
/// the call's end. pgfence checks the token before such a call, with no Sync of its own in
/// a batch; its check and the replies it hides must leave the client's replies as they
/// are. Seeds 1 to 40 by default.
#[test]
fn random_sessions_with_function_calls_same_replies() {
    same_replies(
        Run::from_env((1..=40).chain(FUNCTION_CALL_REGRESSION_SEEDS.iter().copied())),
        Draw {
            inside_batches: true,
            function_calls: true,
            ..Draw::default()
        },
    );
}

/// Seeds beyond the default range of [`random_sessions_with_queries_inside_batches_same_replies`]
/// that found a difference, run by default too: 165, a Query holding `BEGIN` inside a batch
/// that wrote, whose check's portal then outlived the check (the next check failed with
/// 42P03 in the block); 231 and 407, a lone `ROLLBACK TO SAVEPOINT` inside a batch while
/// pgfence could not tell whether a block was open, which got a check added (and failed in
/// an implicit block, with another error location); 1116 and 1300, a lone `VACUUM` behind a
/// Query behind an Execute of its batch, which PostgreSQL runs in a new transaction (the
/// Query ended the Execute's), and pgfence checked first in the same one (an Execute there
/// made it fail "within a pipeline"); 1120, a Query inside a batch, behind a Query with
/// `BEGIN` in a failed block, which pgfence checked first (the check failed there, and the
/// server skipped the Query, which PostgreSQL answers).
/// 5723, a Query starting with `BEGIN ISOLATION LEVEL SERIALIZABLE` inside a batch that
/// had run a `NOTIFY`, which pgfence checked first (its check took a snapshot, and the
/// `BEGIN` failed with 25001; such a Query does not end the transaction). And two found in
/// pgfence's first version of holding such a Query until its check is answered (see
/// `Flushed::Check`): 6152, a Query inside a batch held for its check, then sent with the
/// preparation of the simple-protocol check statement, whose Sync committed what the batch
/// wrote (PostgreSQL rolled it back when the Query failed); 5927, the check of an earlier
/// Sync failing in a failed block, taken for the held Query's (which got a ReadyForQuery
/// the server never sent). 46279, a Query whose text carried a check of its own, sent into
/// a batch whose `COMMIT` pgfence had checked with no Sync: its ReadyForQuery did not end
/// that `COMMIT`'s check, so an Execute of a `DO` after it waited for replies the server
/// sends only at the client's Flush, which the Execute held back (the session hung).
const INSIDE_REGRESSION_SEEDS: &[u64] = &[165, 231, 407, 1116, 1120, 1300, 5723, 5927, 6152, 46279];

/// Runs `plan`'s sessions straight to PostgreSQL and through pgfence with the fence on and
/// off, and fails on the first difference in their replies (or every one, with
/// `PGFENCE_RANDOM_KEEP_GOING=1`).
fn same_replies(plan: Run, draw: Draw) {
    let direct = start_cluster();
    let fenced = start_cluster();
    let plain = start_cluster();
    if draw.function_calls {
        let oids: Vec<String> = [&direct, &fenced, &plain]
            .iter()
            .map(|cluster| {
                cluster.psql(APP_DB, W_SCHEMA);
                cluster.psql(APP_DB, "SELECT 'w(int)'::regprocedure::oid")
            })
            .collect();
        assert!(
            oids.iter().all(|oid| *oid == oids[0]),
            "w(int) has one oid on all three clusters: {oids:?}"
        );
        W_OID.set(Some(oids[0].trim().parse().expect("an oid")));
    }
    // The read audit asked again before every transaction where it may be: its question,
    // injected between the client's messages, must change nothing the client sees.
    let mut config = Proxy::config_for(&fenced);
    config.fence.read_audit_max_age = Duration::ZERO;
    let fenced_proxy = Proxy::start(config);
    let mut config = Proxy::config_for(&plain);
    config.fence.enabled = false;
    let plain_proxy = Proxy::start(config);
    let targets = Targets {
        direct: SocketAddr::from(([127, 0, 0, 1], direct.port())),
        others: [
            ("fence on", fenced_proxy.addr()),
            ("fence off", plain_proxy.addr()),
        ],
    };

    let started = Instant::now();
    let mut failures = Vec::new();
    let mut run = 0u64;
    let mut steps_run = 0usize;
    eprintln!(
        "protocol_random: {}{}",
        plan.describe(),
        match (draw.inside_batches, draw.function_calls) {
            (true, true) => ", Queries and FunctionCalls inside batches",
            (true, false) => ", Queries inside batches",
            (false, true) => ", FunctionCalls",
            (false, false) => "",
        }
    );
    for (seed, number) in plan.cases() {
        // Tokens only increase over the clusters' life: the fence never rejects.
        let token = 1000 + run;
        run += 1;
        let session = generate(seed, number, plan.steps, token, draw);
        steps_run += session.steps.len();
        let result = run_session(&targets, seed, number, &session, &plan.drop);
        if let Err(Failure::Direct(report)) = result {
            let log = direct.server_log();
            let tail: Vec<&str> = log.lines().rev().take(30).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            panic!(
                "{report}\nthe direct server's log ends with:\n{}",
                tail.join("\n")
            );
        }
        if let Err(Failure::Mismatch(report)) = result {
            eprintln!("{report}");
            failures.push(report);
            if !plan.keep_going {
                break;
            }
        }
    }
    eprintln!(
        "protocol_random: {run} sessions, {steps_run} steps in {:.1?}, {} mismatching",
        started.elapsed(),
        failures.len()
    );
    fail_if_any(&failures, "session(s) with different replies");
    // The fence was really on: pgfence's check ran upstream (and pgfence hid it).
    let calls = wait_for_calls(&fenced, "schemaname = 'pgfence'");
    eprintln!("pgfence.check ran {calls} times through the fenced proxy");
    if draw.function_calls {
        let calls = CALLS_ANSWERED.get();
        eprintln!("PostgreSQL answered {calls} FunctionCalls of w() directly");
        // A handful of sessions (one reproduced alone) may well have none.
        assert!(
            calls > 0 || run < 20,
            "no FunctionCall of w() ran in {run} sessions: were they drawn?"
        );
    }
}

/// The calls of the functions `filter` picks on `cluster` (SQL calls: not FunctionCall
/// messages), once there is at least one. An
/// idle backend flushes its function counts within 10 s (PostgreSQL's PGSTAT_IDLE_INTERVAL),
/// and a short run's calls may all come in its first second.
fn wait_for_calls(cluster: &PgCluster, filter: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let calls: u64 = cluster
            .psql(
                APP_DB,
                &format!(
                    "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions WHERE {filter}"
                ),
            )
            .trim()
            .parse()
            .expect("a count");
        if calls >= 1 {
            return calls;
        }
        assert!(
            Instant::now() < deadline,
            "no call of the functions where {filter}: were they run?"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Function `w(k)`, called by FunctionCall messages ([`Out::FunctionCall`]): writes to
/// row `k` of `r` if it exists.
const W_SCHEMA: &str = "
CREATE FUNCTION w(k int) RETURNS int LANGUAGE plpgsql
    AS $$ BEGIN UPDATE r SET v = v + 1000 WHERE id = k; RETURN k; END $$;
";

/// Objects the stale run's extra statements write through (to `r`, which the oracle reads).
const STALE_SCHEMA: &str = "
CREATE PROCEDURE p(k int) LANGUAGE plpgsql AS $$ BEGIN
    UPDATE r SET v = v + 2000 WHERE id = k;
    -- For even keys it commits inside, where it runs non-atomic (outside a block), and
    -- writes again after.
    IF k % 2 = 0 THEN
        COMMIT;
        UPDATE r SET v = v + 2000 WHERE id = k;
    END IF;
END $$;
CREATE TABLE s (k int);
CREATE FUNCTION s_to_r() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    INSERT INTO r VALUES (NEW.k + 50, 0) ON CONFLICT (id) DO UPDATE SET v = r.v + 1;
    RETURN NEW;
END $$;
CREATE TRIGGER s_to_r AFTER INSERT ON s FOR EACH ROW EXECUTE FUNCTION s_to_r();
CREATE VIEW rv AS SELECT id, v FROM r;
";

/// Seeds of the stale run beyond its default range that found a stale write committed or a
/// session hung, run by default too: 981, a Terminate after a failed pre-check ignored;
/// 1263, a Query behind `SET standard_conforming_strings = off` read under the old setting;
/// 1500 and 1964, a Bind in a later batch of a statement whose Parse the server skipped or
/// refused; 1638, two refused Parses of one name in flight; 3611, pgfence acting on messages
/// the server skipped after a flushed batch had failed (fixed with seed 10281 of
/// [`REGRESSION_SEEDS`]); 33365, a skipped Close of a prepared INSERT's name, then a Parse
/// of that name refused with a Bind of it in the next batch; 35213, a `COMMIT` pipelined
/// behind a Query whose `ROLLBACK TO SAVEPOINT` revived a failed block that wrote; 116012,
/// an Execute of a `CALL` whose name a failed SQL `PREPARE` had made pgfence forget, after
/// a check that passed because nothing was written yet.
const STALE_REGRESSION_SEEDS: &[u64] = &[981, 1263, 1500, 1638, 1964, 3611, 33365, 35213, 116012];

/// The fence of both resources in the stale run: above every token its sessions get.
const STALE_FENCE: u64 = 1_000_000;

/// A side of the stale run.
struct StaleSide {
    mode: &'static str,
    addr: SocketAddr,
    /// The fence is on: nothing the session wrote may commit.
    fenced: bool,
}

/// What the sessions of the stale run can have committed, read directly: every row of `r`
/// with the transaction that wrote it (an UPDATE, DELETE or INSERT that committed shows,
/// even if it put back the same values), and the prepared transactions left over.
#[derive(Clone, PartialEq, Eq, Debug)]
struct Committed {
    rows: Vec<String>,
    prepared: Vec<String>,
}

fn committed(observer: &mut RawConn) -> Committed {
    let mut column = |sql: &str| -> Vec<String> {
        observer.send(&wire::query(sql));
        observer
            .until_ready()
            .iter()
            .filter_map(Msg::data_row)
            .map(|row| {
                row.iter()
                    .map(|c| String::from_utf8_lossy(c.as_deref().unwrap_or(b"NULL")).into_owned())
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect()
    };
    Committed {
        rows: column("SELECT id, v, xmin FROM r ORDER BY id"),
        prepared: column("SELECT gid FROM pg_prepared_xacts ORDER BY gid"),
    }
}

/// Runs one session on `addr`, reading each step's replies as the generator expects them;
/// `Err` if the side did not answer so (it hung or closed), with the step. Returns the
/// replies: to the login, then to each step from step 1.
fn run_alone(
    addr: SocketAddr,
    session: &Session,
    drop: &Omit,
) -> Result<Vec<Replies>, (Vec<Replies>, usize)> {
    let mut conn = RawConn::connect(addr);
    conn.send(&session.startup());
    let mut all = vec![read(&mut conn, Expect::Ready(1))];
    if all[0].trouble.is_some() {
        return Err((all, 0));
    }
    let mut batch_failed = false;
    // Step 0 resets `r`: the harness does that directly.
    for (i, step) in drop.apply(&session.steps).iter().filter(|(i, _)| *i > 0) {
        let bytes: Vec<u8> = step.iter().flat_map(Out::bytes).collect();
        let expect = expect(step, batch_failed);
        let _ = conn.try_send(&bytes);
        let replies = read(&mut conn, expect);
        for m in &replies.msgs {
            match m.tag {
                b'E' => batch_failed = true,
                b'Z' => batch_failed = false,
                _ => {}
            }
        }
        let trouble = replies.trouble.is_some();
        let refused = refused_lexing(&replies);
        all.push(replies);
        if refused {
            // README's known limitation: the session ends here, by design.
            return Ok(all);
        }
        if trouble {
            end(&mut conn, &mut []);
            return Err((all, *i));
        }
    }
    Ok(all)
}

/// pgfence ended the session with `FATAL 0A000` because it could not tell where a Query's
/// statements end (a `\'` in a literal, sent inside a batch behind a statement that may
/// change `standard_conforming_strings`): README's "Known limitations".
fn refused_lexing(replies: &Replies) -> bool {
    replies.msgs.last().is_some_and(|m| {
        m.tag == b'E'
            && m.field(b'V').as_deref() == Some("FATAL")
            && m.sqlstate().as_deref() == Some("0A000")
            && m.field(b'M')
                .is_some_and(|text| text.contains("cannot tell where the statements"))
    })
}

/// Logs in on `addr` with `options`, runs `sql` and expects no error.
fn run_as_leader(addr: SocketAddr, options: &str, sql: &str) {
    let mut conn = RawConn::login_with_options(addr, SUPERUSER, APP_DB, options);
    conn.send(&wire::query(sql));
    let replies = conn.until_ready();
    assert!(
        replies.iter().all(|m| m.tag != b'E'),
        "the leader's write through {addr} failed: {replies:?}"
    );
    conn.send(&wire::terminate());
    conn.until_closed();
}

/// The same random sessions, every token stale: both resources are fenced at
/// [`STALE_FENCE`], and the database has a default resource (`rnd`), so that a write
/// without a token is rejected too (FN002). Whatever a session sends, nothing it wrote may
/// commit: after each session `r` must hold exactly the rows, written by exactly the
/// transaction, it held before, and no prepared transaction may be left. Each session runs
/// through pgfence with the fast path off (only the database check stands in the way), with
/// the fast path on, and with the fence off, where writes must commit (the oracle is not
/// blind). Seeds: 1 to 20 and [`STALE_REGRESSION_SEEDS`] by default, or as
/// `PGFENCE_RANDOM_SEED(S)` say.
#[test]
fn random_stale_sessions_never_commit_a_write() {
    never_commit(
        Run::from_env((1..=20).chain(STALE_REGRESSION_SEEDS.iter().copied())),
        false,
    );
}

/// The same, with Queries and FunctionCalls inside extended-protocol batches
/// ([`Gen::inside_batch`]): such a message commits what its batch wrote before it, so
/// pgfence must check there. Seeds 1 to 20 and [`STALE_INSIDE_REGRESSION_SEEDS`] by default,
/// or as `PGFENCE_RANDOM_SEED(S)` say.
#[test]
fn random_stale_sessions_with_queries_inside_batches_never_commit_a_write() {
    never_commit(
        Run::from_env((1..=20).chain(STALE_INSIDE_REGRESSION_SEEDS.iter().copied())),
        true,
    );
}

/// Seeds of [`random_stale_sessions_with_queries_inside_batches_never_commit_a_write`] beyond
/// its default range that found a failure, run by default too: 1291, a check before a Query
/// inside a batch that failed while a later Query's check before its `COMMIT` was pending,
/// taken for that one (pgfence waited for the skipped Query, holding back the Sync).
const STALE_INSIDE_REGRESSION_SEEDS: &[u64] = &[1291];

/// Runs `plan`'s stale sessions (see [`random_stale_sessions_never_commit_a_write`]).
fn never_commit(plan: Run, inside_batches: bool) {
    let cluster = start_cluster();
    cluster.psql(APP_DB, W_SCHEMA);
    cluster.psql(APP_DB, STALE_SCHEMA);
    let w_oid = cluster.psql(APP_DB, "SELECT 'w(int)'::regprocedure::oid");
    W_OID.set(Some(w_oid.trim().parse().expect("an oid")));
    let proxy = |enabled: bool, fast_path: bool| {
        let mut config = Proxy::config_for(&cluster);
        config.fence.enabled = enabled;
        config.fence.fast_path = fast_path;
        // The classifier alone decides which transactions skip the check: `w(k)` takes one
        // argument, so the read audit would have every read checked, and the skipping
        // would go untested.
        config.fence.read_audit = false;
        config.fence.defaults.push(pgfence_config::DefaultResource {
            database: APP_DB.to_string(),
            user: None,
            resource: RESOURCE.to_string(),
        });
        Proxy::start(config)
    };
    let checked = proxy(true, false);
    let fast = proxy(true, true);
    let off = proxy(false, false);
    // The new leader writes to both resources through both fenced proxies: the database
    // holds the fence, and the fast path has seen it.
    for addr in [checked.addr(), fast.addr()] {
        for resource in [RESOURCE, RESOURCE_2] {
            run_as_leader(
                addr,
                &format!("-c fencing.resource={resource} -c fencing.token={STALE_FENCE}"),
                // A write each time (`DO NOTHING` would not be one, and not be fenced).
                "INSERT INTO r VALUES (100, 0) ON CONFLICT (id) DO UPDATE SET v = r.v + 1",
            );
        }
    }
    let sides = [
        StaleSide {
            mode: "fence on, fast path off",
            addr: checked.addr(),
            fenced: true,
        },
        StaleSide {
            mode: "fence on, fast path on",
            addr: fast.addr(),
            fenced: true,
        },
        StaleSide {
            mode: "fence off",
            addr: off.addr(),
            fenced: false,
        },
    ];
    let (mut observer, _) = RawConn::login(
        SocketAddr::from(([127, 0, 0, 1], cluster.port())),
        SUPERUSER,
        APP_DB,
    );
    observer.send(&wire::query(
        "SELECT resource || ' ' || token FROM pgfence.fences ORDER BY resource",
    ));
    let fences: Vec<String> = observer
        .until_ready()
        .iter()
        .filter_map(Msg::data_row)
        .map(|row| String::from_utf8_lossy(row[0].as_deref().unwrap_or_default()).into_owned())
        .collect();
    assert_eq!(
        fences,
        [
            format!("{RESOURCE} {STALE_FENCE}"),
            format!("{RESOURCE_2} {STALE_FENCE}")
        ],
        "the leader's writes did not fence both resources"
    );
    eprintln!(
        "protocol_random (stale): {}{}",
        plan.describe(),
        if inside_batches {
            ", Queries inside batches"
        } else {
            ""
        }
    );
    let started = Instant::now();
    let mut failures = Vec::new();
    let (mut run, mut rejections, mut refused) = (0u64, 0usize, 0usize);
    let mut committed_unfenced = 0usize;
    'sessions: for (seed, number) in plan.cases() {
        let token = 1000 + run;
        run += 1;
        let draw = Draw {
            stale: true,
            inside_batches,
            function_calls: false,
        };
        let session = generate(seed, number, plan.steps, token, draw);
        for side in &sides {
            observer.send(&wire::query(
                "TRUNCATE r; INSERT INTO r VALUES (1, 10), (2, 20), (3, 30)",
            ));
            observer.until_ready();
            let before = committed(&mut observer);
            let result = run_alone(side.addr, &session, &plan.drop);
            let after = committed(&mut observer);
            for gid in &after.prepared {
                observer.send(&wire::query(format!("ROLLBACK PREPARED '{gid}'")));
                observer.until_ready();
            }
            let replies = match &result {
                Ok(r) | Err((r, _)) => r,
            };
            refused += usize::from(replies.last().is_some_and(refused_lexing));
            if side.fenced {
                rejections += replies
                    .iter()
                    .flat_map(|r| &r.msgs)
                    .filter(|m| m.tag == b'E')
                    .filter(|m| m.sqlstate().is_some_and(|s| s.starts_with("FN")))
                    .count();
            } else {
                committed_unfenced += usize::from(after != before);
            }
            let trouble = result.as_ref().err().map(|(_, at)| *at);
            if !side.fenced || (after == before && trouble.is_none()) {
                continue;
            }
            let mut report = format!(
                "seed {seed}, session {number}, {}: {}\n\
                 reproduce: PGFENCE_RANDOM_SEED={seed} PGFENCE_RANDOM_SESSION={number} \
                 cargo test -p pgfence-tests --test protocol_random random_stale\n{}\n",
                side.mode,
                match trouble {
                    Some(at) => format!("pgfence did not answer step {at} as expected"),
                    None => "a stale session committed a write".to_string(),
                },
                session.describe_startup(),
            );
            if after != before {
                report.push_str(&format!(
                    "r before: {:?}\nr after:  {:?}\nprepared transactions left: {:?}\n",
                    before.rows, after.rows, after.prepared
                ));
            }
            let sent = plan.drop.apply(&session.steps);
            for ((i, step), replies) in sent.iter().filter(|(i, _)| *i > 0).zip(&replies[1..]) {
                report.push_str(&format!("  step {i}:\n"));
                for (j, m) in step.iter().enumerate() {
                    report.push_str(&format!("    {i}.{j} {m}\n"));
                }
                report.push_str(&show(replies));
            }
            if trouble.is_some() {
                // A closed connection may be a backend that crashed.
                let log = cluster.server_log();
                let tail: Vec<&str> = log.lines().rev().take(20).collect();
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                report.push_str(&format!(
                    "the server's log ends with:\n{}\n",
                    tail.join("\n")
                ));
            }
            eprintln!("{report}");
            failures.push(report);
            if !plan.keep_going {
                break 'sessions;
            }
        }
    }
    eprintln!(
        "protocol_random (stale): {run} sessions in {:.1?}: {} failing with the fence on \
         ({rejections} FN rejections), {committed_unfenced} committed a write with the fence off, \
         {refused} ended by pgfence's FATAL 0A000 (a Query it cannot split, inside a batch)",
        started.elapsed(),
        failures.len()
    );
    fail_if_any(&failures, "stale session(s) failed");
    assert!(rejections > 0, "no FN rejection at all: was the fence on?");
    assert!(
        committed_unfenced * 2 >= run as usize,
        "with the fence off only {committed_unfenced} of {run} sessions committed a write: \
         the oracle may be blind"
    );
}
