//! Mutated client messages after login, through the `pgfence` binary in front of a real
//! PostgreSQL: pgfence must never panic, never hang, and never close a session quietly.
//!
//! `protocol_bad_input.rs` sends chosen bad frames; `protocol_random.rs` sends random but
//! well-formed sessions. This test sits between them. Each session logs in (with a session
//! token or not) and runs rounds of a few messages, each drawn from a corpus of the messages
//! a client sends once logged in (Query, Parse, Bind, Describe, Execute, Close, Sync, Flush,
//! FunctionCall, CopyData, CopyDone, CopyFail, Terminate), one in five mutated: body cut
//! short, extended, bytes changed, a count or length replaced by an extreme value, string
//! terminators removed, a body of random bytes; rarely an unknown tag or a bad length field.
//! Frames always carry the length of what is sent, so that a reader waiting for the rest of
//! a message is never what the test sees.
//!
//! After each round comes a probe: `CopyFail` (ends a COPY FROM STDIN the round started;
//! ignored otherwise), `Sync`, `ROLLBACK; SELECT 'probe-N-a'`, `Sync`, `ROLLBACK; SELECT
//! 'probe-N-b'` (the Syncs end what an error left to skip). The round passes when the second
//! probe's row and ReadyForQuery arrive, or when the connection closes after a FATAL (or
//! PANIC) ErrorResponse, or after the round's own Terminate. It fails on a close without an
//! error, or on no answer within [`ROUND_TIMEOUT`]. At the end pgfence's log must hold no
//! panic, and a new session must work.
//!
//! Sessions: `PGFENCE_FUZZ_SESSIONS` (default 1000) from seed `PGFENCE_FUZZ_FIRST_SEED`
//! (default 1); a failure names its seed and the round's bytes.
//!
//! [`mutated_console_messages_never_panic_hang_or_close_quietly`] does the same on the admin
//! console (database `pgfence`), with its commands for Queries and Parses and a
//! `KILL_CLIENT` of a made-up id for probe (its error names the id):
//! `PGFENCE_FUZZ_CONSOLE_SESSIONS` (default 300).
//!
//! [`mutated_startup_packets_never_panic_or_hang`] does the same for the first packet of a
//! connection: StartupMessages (with fencing options, some invalid), SSLRequest,
//! GSSENCRequest and CancelRequest, mutated alike, one per connection. Each connection must
//! end within [`ROUND_TIMEOUT`]: logged in (then Terminate), or closed after a FATAL
//! error (a packet cut short meets the startup timeout of 1 s; protocol 2 gets that
//! protocol's error format), or, for a CancelRequest, closed without a word as PostgreSQL
//! does. `PGFENCE_FUZZ_STARTUPS` (default 2000).
//!
//! [`mutated_server_messages_never_panic_or_close_quietly`] turns it around: the client's
//! rounds are well-formed, and a relay between pgfence and PostgreSQL changes what the
//! server sends (bodies mutated alike, a message's type or ReadyForQuery status replaced,
//! a message sent twice; logins too in one connection of four). pgfence must never panic
//! nor close a session without a FATAL error; a round left unanswered once the relay has
//! changed a reply of its session is allowed (a client of PostgreSQL itself would wait the
//! same), and those sessions end when their server processes do.
//! `PGFENCE_FUZZ_SERVER_SESSIONS` (default 300).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harness::wire::{self, Msg, RawConn, Read1};
use harness::{PgCluster, Proxy, ProxyProcess, APP_DB, SUPERUSER};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The message cap of this test's pgfence (`limits.max_message_size`).
const MAX_MESSAGE: u32 = 64 * 1024;
/// How long a round may take to be answered.
const ROUND_TIMEOUT: Duration = Duration::from_secs(20);
/// How often a round that waits for its answer asks whether to go on waiting.
const WAIT_SLICE: Duration = Duration::from_millis(250);

/// Statements of the corpus: reads, writes, transaction control, COPY both ways, fencing
/// settings and comments, statements pgfence treats apart.
const STATEMENTS: &[&str] = &[
    "SELECT 1",
    "SELECT n FROM fz",
    "BEGIN",
    "COMMIT",
    "ROLLBACK",
    "SAVEPOINT s",
    "ROLLBACK TO SAVEPOINT s",
    "INSERT INTO fz VALUES (1)",
    "UPDATE fz SET n = n + 1",
    "/* fencing_token=9 fencing_resource=fz */ UPDATE fz SET n = n + 1",
    "DELETE FROM fz WHERE n > 100 /*fencing_resource='fz',fencing_token='9'*/",
    "SET fencing.token = 5",
    "SET fencing.resource = 'fz'",
    "RESET fencing.token",
    "COPY fz FROM STDIN",
    "COPY fz TO STDOUT",
    "DO $$BEGIN UPDATE fz SET n = 0 WHERE n < 0; END$$",
    "PREPARE q AS SELECT 1",
    "EXECUTE q",
    "DEALLOCATE ALL",
    "DISCARD ALL",
    "LISTEN fz",
    "NOTIFY fz",
    "VACUUM fz",
    "SELECT $1::int + 1",
    "",
];

/// Names of statements and portals: unnamed, and one name reused.
const NAMES: &[&str] = &["", "s1"];

/// Values written into counts, lengths and oids.
const EXTREMES_32: &[u32] = &[0xFFFF_FFFF, 0x7FFF_FFFF, 0x8000_0000, 0, 0xFFFF, 1 << 20];
const EXTREMES_16: &[u16] = &[0xFFFF, 0x7FFF, 0x8000, 0];

/// Safe functions for FunctionCall (their oids are looked up at the start).
const FUNCTIONS: &[&str] = &["int4pl(int4,int4)", "lower(text)", "pg_backend_pid()"];

/// The admin console's corpus (database `pgfence`): its commands, misspelt ones, and
/// statements it refuses. `KILL_CLIENT 1` names a session long gone.
const CONSOLE_COMMANDS: &[&str] = &[
    "SHOW FENCES",
    "SHOW REJECTIONS",
    "SHOW CLIENTS",
    "SHOW SERVERS",
    "SHOW STATS",
    "SHOW CONFIG",
    "SHOW VERSION",
    "show help;",
    "RELOAD",
    "KILL_CLIENT 1",
    "KILL_CLIENT -1",
    "KILL_CLIENT",
    "SHOW",
    "SELECT 1",
    "BEGIN",
    "",
];

struct Gen {
    rng: StdRng,
    functions: Vec<u32>,
    /// What Query and Parse messages hold.
    statements: &'static [&'static str],
    /// Whether rounds hold mutated messages, or only well-formed ones (when the server's
    /// side is mutated instead).
    mutated: bool,
}

impl Gen {
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.rng.gen_range(0..items.len())]
    }

    /// A valid message of the corpus: (tag, body).
    fn message(&mut self) -> (u8, Vec<u8>) {
        let framed = match self.rng.gen_range(0..100) {
            0..=17 => wire::query(self.pick(self.statements).as_bytes()),
            18..=31 => {
                let name = self.pick(NAMES);
                let sql = self.pick(self.statements);
                let types: Vec<u32> = (0..self.rng.gen_range(0..3)).map(|_| 23).collect();
                wire::parse(name, sql, &types)
            }
            32..=45 => {
                let portal = self.pick(NAMES);
                let statement = self.pick(NAMES);
                let params: Vec<Option<&[u8]>> = (0..self.rng.gen_range(0..3))
                    .map(|i| if i == 1 { None } else { Some(&b"41"[..]) })
                    .collect();
                wire::bind(portal, statement, &params)
            }
            46..=51 => {
                let kind = self.pick(b"SPx");
                wire::describe(kind, self.pick(NAMES))
            }
            52..=63 => {
                let rows = self.pick(&[0, 1, 2]);
                wire::execute(self.pick(NAMES), rows)
            }
            64..=67 => {
                let kind = self.pick(b"SPx");
                wire::close(kind, self.pick(NAMES))
            }
            68..=77 => wire::sync(),
            78..=81 => wire::flush(),
            82..=86 => {
                let oid = self.functions[self.rng.gen_range(0..self.functions.len())];
                let args: Vec<Option<&[u8]>> = (0..self.rng.gen_range(0..3))
                    .map(|_| Some(&b"7"[..]))
                    .collect();
                wire::function_call(oid, &args)
            }
            87..=92 => wire::copy_data(b"5\n"),
            93..=95 => wire::copy_done(),
            96..=98 => wire::copy_fail("fuzz"),
            _ => wire::terminate(),
        };
        (framed[0], framed[5..].to_vec())
    }

    /// Changes `body` in one of several ways (or not at all). A FunctionCall keeps its
    /// function's oid: an arbitrary function, called with arbitrary arguments, could sleep
    /// or terminate backends.
    fn mutate(&mut self, tag: u8, body: &mut Vec<u8>) {
        let keep = if tag == b'F' { 4.min(body.len()) } else { 0 };
        match self.rng.gen_range(0..12) {
            0 if body.len() > keep => {
                let at = self.rng.gen_range(keep..body.len());
                body.truncate(at);
            }
            1 => {
                for _ in 0..self.rng.gen_range(1..16) {
                    body.push(self.rng.gen());
                }
            }
            2 if body.len() > keep => {
                for _ in 0..self.rng.gen_range(1..4) {
                    let at = self.rng.gen_range(keep..body.len());
                    body[at] = self.rng.gen();
                }
            }
            3 if body.len() >= keep + 4 => {
                let at = self.rng.gen_range(keep..=body.len() - 4);
                let v = self.pick(EXTREMES_32);
                body[at..at + 4].copy_from_slice(&v.to_be_bytes());
            }
            4 if body.len() >= keep + 2 => {
                let at = self.rng.gen_range(keep..=body.len() - 2);
                let v = self.pick(EXTREMES_16);
                body[at..at + 2].copy_from_slice(&v.to_be_bytes());
            }
            5 => {
                for b in body.iter_mut().skip(keep) {
                    if *b == 0 {
                        *b = b'x';
                    }
                }
            }
            6 if tag != b'F' => {
                let len = self.rng.gen_range(0..64);
                *body = (0..len).map(|_| self.rng.gen()).collect();
            }
            _ => {}
        }
    }

    /// One round's messages, as bytes, and whether they hold a Terminate.
    fn round(&mut self) -> (Vec<u8>, bool) {
        let mut out = Vec::new();
        let mut terminates = false;
        for _ in 0..self.rng.gen_range(1..=8) {
            let (mut tag, mut body) = self.message();
            if self.mutated {
                if self.rng.gen_bool(0.2) {
                    self.mutate(tag, &mut body);
                }
                match self.rng.gen_range(0..100) {
                    // An unknown or backend-only tag: pgfence refuses it (FATAL 08P01).
                    0 | 1 => tag = self.rng.gen(),
                    // A length field below its own size, or beyond the cap.
                    2 => {
                        out.push(tag);
                        let len: u32 = self.pick(&[0, 3, MAX_MESSAGE + 5, 0xFFFF_FFF0]);
                        out.extend_from_slice(&len.to_be_bytes());
                        return (out, terminates);
                    }
                    _ => {}
                }
            }
            terminates |= tag == b'X';
            out.extend(wire::frame(tag, &body));
        }
        (out, terminates)
    }
}

/// What a round came to.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Outcome {
    /// The probe was answered: the session goes on.
    Answered,
    /// The connection closed after this FATAL error.
    ClosedWithError(Fatal),
    /// The connection closed after the round's Terminate.
    Terminated,
}

/// How a round failed.
#[derive(Debug)]
enum Failure {
    /// The connection closed without a FATAL error (and the round sent no Terminate).
    Quiet(String),
    /// No answer to the probe within the round's time.
    Timeout(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Quiet(e) | Failure::Timeout(e) => f.write_str(e),
        }
    }
}

/// Sends the round's bytes and the probe, and reads until the probe's answer or the close,
/// or until `give_up` says so of the time waited with no answer. On the admin console the
/// probe is a `KILL_CLIENT` of a made-up id, whose error names it.
fn run_round(
    conn: &mut RawConn,
    bytes: &[u8],
    terminates: bool,
    n: usize,
    console: bool,
    give_up: &dyn Fn(Duration) -> bool,
) -> Result<Outcome, Failure> {
    // (The console's errors spell the command in capitals.)
    let name = |ab: &str| {
        let name = format!("probe-{n}-{ab}");
        if console {
            name.to_uppercase()
        } else {
            name
        }
    };
    let marker = name("b");
    let probe = |m: &str| {
        if console {
            format!("KILL_CLIENT {m}")
        } else {
            format!("ROLLBACK; SELECT '{m}'")
        }
    };
    let answer = if console { b'E' } else { b'D' };
    let mut all = bytes.to_vec();
    all.extend(wire::copy_fail("probe"));
    all.extend(wire::sync());
    all.extend(wire::query(probe(&name("a"))));
    all.extend(wire::sync());
    all.extend(wire::query(probe(&marker)));
    // pgfence may close before it has read everything (a FATAL on the first bad frame).
    let _ = conn.try_send(&all);
    let mut seen: Vec<Msg> = Vec::new();
    let mut probed = false;
    let start = Instant::now();
    loop {
        match conn.next(WAIT_SLICE) {
            Ok(Read1::Msg(m)) => {
                if m.tag == answer && m.body.windows(marker.len()).any(|w| w == marker.as_bytes()) {
                    probed = true;
                }
                if probed && m.tag == b'Z' {
                    return Ok(Outcome::Answered);
                }
                seen.push(m);
            }
            Ok(Read1::Closed) => {
                return match (last_fatal(&seen), terminates) {
                    (Some(fatal), _) => Ok(Outcome::ClosedWithError(fatal)),
                    (None, true) => Ok(Outcome::Terminated),
                    (None, false) => Err(closed_quietly(&seen)),
                };
            }
            Err(e) if is_timeout(&e) && !give_up(start.elapsed()) => {}
            Err(e) => {
                return Err(Failure::Timeout(format!(
                    "no answer to the probe within {:?} ({e}); last replies: {:?}",
                    start.elapsed(),
                    tail(&seen)
                )))
            }
        }
    }
}

/// A FATAL (or PANIC) error a connection closed after.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Fatal {
    code: String,
    message: String,
}

/// The FATAL (or PANIC) error that `seen` ends with, if it does.
fn last_fatal(seen: &[Msg]) -> Option<Fatal> {
    seen.last()
        .filter(|m| m.tag == b'E' && matches!(m.field(b'V').as_deref(), Some("FATAL" | "PANIC")))
        .map(|m| Fatal {
            code: m.sqlstate().unwrap_or_default(),
            message: m.field(b'M').unwrap_or_default(),
        })
}

fn closed_quietly(seen: &[Msg]) -> Failure {
    Failure::Quiet(format!(
        "the connection closed without a FATAL error; last replies: {:?}",
        tail(seen)
    ))
}

/// Whether `RawConn::next` failed for want of a message in time.
fn is_timeout(e: &str) -> bool {
    e.starts_with("no complete message")
}

/// What an error says, without its variable part: for grouping errors in a summary.
fn reason(message: &str) -> String {
    match message.find("message type") {
        Some(at) => &message[..at + "message type".len()],
        None => message.split(':').next().unwrap_or_default(),
    }
    .to_string()
}

fn tail(msgs: &[Msg]) -> &[Msg] {
    &msgs[msgs.len().saturating_sub(6)..]
}

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}={v:?} is not a number"))
        })
        .unwrap_or(default)
}

#[test]
fn mutated_messages_never_panic_hang_or_close_quietly() {
    let sessions = env_or("PGFENCE_FUZZ_SESSIONS", 1000);
    let first_seed = env_or("PGFENCE_FUZZ_FIRST_SEED", 1);
    let (cluster, functions) = fuzz_cluster();
    let mut config = Proxy::config_for(&cluster);
    config.limits.max_message_size = MAX_MESSAGE;
    let proxy = fuzz_proxy(config);
    fuzz_sessions(&cluster, &proxy, first_seed, sessions, &functions, false);
    assert_unharmed(&cluster, &proxy);
}

/// The same on the admin console, whose messages pgfence answers itself (one
/// `SHOW FENCES` asks the server).
#[test]
fn mutated_console_messages_never_panic_hang_or_close_quietly() {
    let sessions = env_or("PGFENCE_FUZZ_CONSOLE_SESSIONS", 300);
    let first_seed = env_or("PGFENCE_FUZZ_FIRST_SEED", 1);
    let (cluster, functions) = fuzz_cluster();
    let mut config = Proxy::config_for(&cluster);
    config.limits.max_message_size = MAX_MESSAGE;
    config.admin.users = vec![SUPERUSER.into()];
    config.admin.database = APP_DB.into();
    let proxy = fuzz_proxy(config);
    fuzz_sessions(&cluster, &proxy, first_seed, sessions, &functions, true);
    assert_unharmed(&cluster, &proxy);
}

/// A cluster with schema `pgfence` and table `fz` in `app`, and the oids of [`FUNCTIONS`].
fn fuzz_cluster() -> (PgCluster, Vec<u32>) {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster.psql(APP_DB, "CREATE TABLE fz (n int)");
    let functions: Vec<u32> = FUNCTIONS
        .iter()
        .map(|f| {
            let oid = cluster.psql(APP_DB, &format!("SELECT '{f}'::regprocedure::oid"));
            oid.trim().parse().expect("a function oid")
        })
        .collect();
    (cluster, functions)
}

/// The `pgfence` binary with `config`, on two worker threads.
fn fuzz_proxy(config: pgfence_config::Config) -> ProxyProcess {
    ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}", "--threads", "2"])
        .start()
}

/// Runs the seeded sessions through `proxy` (on the admin console if `console`), and
/// prints how their rounds ended.
fn fuzz_sessions(
    cluster: &PgCluster,
    proxy: &ProxyProcess,
    first_seed: u64,
    sessions: u64,
    functions: &[u32],
    console: bool,
) {
    let count = if console {
        "PGFENCE_FUZZ_CONSOLE_SESSIONS"
    } else {
        "PGFENCE_FUZZ_SESSIONS"
    };
    let (mut answered, mut terminated) = (0u32, 0u32);
    let mut fatal: std::collections::BTreeMap<String, u32> = Default::default();
    let mut rounds = 0usize;
    for seed in first_seed..first_seed + sessions {
        let mut gen = Gen {
            rng: StdRng::seed_from_u64(seed),
            functions: functions.to_vec(),
            statements: if console {
                CONSOLE_COMMANDS
            } else {
                STATEMENTS
            },
            mutated: true,
        };
        // A statement that runs long (a changed digit in pg_sleep's argument, a lock) ends
        // with an error instead of holding the round past its timeout.
        let mut options = "-c statement_timeout=5s -c lock_timeout=2s".to_string();
        if gen.rng.gen_bool(0.5) {
            options.push_str(" -c fencing.token=7 -c fencing.resource=fz");
        }
        let database = if console { "pgfence" } else { APP_DB };
        let login = std::panic::catch_unwind(|| {
            RawConn::login_with_options(proxy.addr(), SUPERUSER, database, &options)
        });
        let mut conn = login.unwrap_or_else(|failed| {
            assert_no_server_crash(cluster, &format!("before seed {seed}'s login"));
            std::panic::resume_unwind(failed)
        });
        for _ in 0..gen.rng.gen_range(1..=8) {
            rounds += 1;
            let (bytes, terminates) = gen.round();
            let give_up = |waited| waited >= ROUND_TIMEOUT;
            let outcome = run_round(&mut conn, &bytes, terminates, rounds, console, &give_up)
                .unwrap_or_else(|e| {
                    panic!(
                        "seed {seed} (PGFENCE_FUZZ_FIRST_SEED={seed} {count}=1): {e}\n\
                         round's bytes: {bytes:?}\npgfence's log:\n{}",
                        proxy.logs()
                    )
                });
            let goes_on = outcome == Outcome::Answered;
            match outcome {
                Outcome::Answered => answered += 1,
                Outcome::Terminated => terminated += 1,
                Outcome::ClosedWithError(closed) => {
                    // Not a protocol violation: maybe a server process gone.
                    if closed.code != "08P01" {
                        assert_no_server_crash(cluster, &format!("by seed {seed}'s end"));
                    }
                    *fatal.entry(reason(&closed.message)).or_default() += 1;
                }
            }
            if !goes_on {
                break;
            }
        }
    }
    let closed: u32 = fatal.values().sum();
    let place = if console { "on the admin console" } else { "" };
    eprintln!(
        "{sessions} sessions {place} from seed {first_seed}, {rounds} rounds: {answered} \
         answered, {closed} closed with a FATAL error, {terminated} ended by their Terminate"
    );
    for (reason, n) in &fatal {
        eprintln!("  {n:5}  FATAL {reason}");
    }

    // The generator reaches both kinds of outcome, or it tests less than it claims.
    if sessions >= 50 {
        assert!(answered > 0 && closed > 0, "{answered} answered, {fatal:?}");
    }
}

/// pgfence logged no panic, and serves a new session; no PostgreSQL process crashed.
fn assert_unharmed(cluster: &PgCluster, proxy: &ProxyProcess) {
    let logs = proxy.logs();
    assert!(
        !logs.contains("panicked") && !logs.contains("pgfence bug"),
        "pgfence panicked:\n{logs}"
    );
    assert_no_server_crash(cluster, "by the end");
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    let rows = conn.query_rows("SELECT 'still serving'");
    assert_eq!(rows, vec![vec![Some(b"still serving".to_vec())]]);
}

/// No PostgreSQL process crashed `when` (say, by a seed's end): a crash restarts the
/// server and ends every session, which hides what pgfence did.
fn assert_no_server_crash(cluster: &PgCluster, when: &str) {
    let server = cluster.server_log();
    assert!(
        !server.contains("was terminated by signal"),
        "a PostgreSQL process crashed {when} (one known cause, with or without pgfence: an Execute \
         of the unnamed portal left by a simple Query that failed in a transaction block, \
         docs/postgresql-crash.md); the server's log:\n{server}"
    );
}

/// How long a round of the server-side fuzz waits once the relay has changed a reply of its
/// session, which may then never be answered (see
/// [`mutated_server_messages_never_panic_or_close_quietly`]).
const SERVER_ROUND_TIMEOUT: Duration = Duration::from_secs(3);
/// The chance that the relay changes one message of the server's.
const SERVER_MUTATION_RATE: f64 = 0.03;
/// Mixed into a session's seed for its relay's choices, which then differ from the
/// session's own.
const SERVER_SEED_SALT: u64 = 0x5e4_7e4;
/// Backend message types, for a mutation that turns a message into another type.
const BACKEND_TAGS: &[u8] = b"123ACDEGHIKNRSTVWZcdnstv";

/// The server's side: a relay between pgfence and PostgreSQL changes what the server sends
/// ([`MutatingRelay`]) while sessions run well-formed rounds of the corpus. pgfence must
/// never panic, and never close a session without a FATAL error. Once the relay has
/// changed a session's replies, its rounds may go unanswered (a ReadyForQuery turned into
/// another message, the probe's row changed; pgfence then counts one reply too few or too
/// many): a client of PostgreSQL itself would wait the same. Such a session outlives its
/// client, as a PostgreSQL backend would, until its server process ends: at the end the
/// test ends them all, and then no session may be left but the admin console's.
/// `PGFENCE_FUZZ_SERVER_SESSIONS` (default 300) from seed `PGFENCE_FUZZ_FIRST_SEED`.
#[test]
fn mutated_server_messages_never_panic_or_close_quietly() {
    let sessions = env_or("PGFENCE_FUZZ_SERVER_SESSIONS", 300);
    let first_seed = env_or("PGFENCE_FUZZ_FIRST_SEED", 1);
    let (cluster, functions) = fuzz_cluster();
    let relay = MutatingRelay::start(cluster.port());
    let mut config = Proxy::config_for(&cluster);
    config.upstream.port = relay.port;
    // A server connection per session, so that the session's seed decides what changes.
    config.pool.reuse_servers = false;
    config.admin.users = vec![SUPERUSER.into()];
    config.admin.database = APP_DB.into();
    let proxy = fuzz_proxy(config);
    let (mut answered, mut terminated, mut stalled, mut changes) = (0u32, 0u32, 0u32, 0usize);
    let mut fatal: std::collections::BTreeMap<String, u32> = Default::default();
    let mut rounds = 0usize;
    for seed in first_seed..first_seed + sessions {
        relay.arm(seed);
        let mut gen = Gen {
            rng: StdRng::seed_from_u64(seed),
            functions: functions.clone(),
            statements: STATEMENTS,
            mutated: false,
        };
        let mut options = "-c statement_timeout=5s -c lock_timeout=2s".to_string();
        if gen.rng.gen_bool(0.5) {
            options.push_str(" -c fencing.token=7 -c fencing.resource=fz");
        }
        // A round waits long for its answer, but not once the relay has changed a reply
        // of its session.
        let give_up =
            |waited| waited >= ROUND_TIMEOUT || (waited >= SERVER_ROUND_TIMEOUT && relay.changed());
        let login = log_in_through_relay(proxy.addr(), &options, &give_up);
        let mut session = match login {
            Ok(Login::Ready(conn)) => Some(conn),
            Ok(Login::Closed(closed)) => {
                *fatal.entry(reason(&closed.message)).or_default() += 1;
                None
            }
            Err(Failure::Timeout(_)) if relay.changed() => {
                stalled += 1;
                None
            }
            Err(e) => panic!(
                "seed {seed} (PGFENCE_FUZZ_FIRST_SEED={seed} PGFENCE_FUZZ_SERVER_SESSIONS=1), \
                 login: {e}\nthe relay's changes: {:?}\npgfence's log:\n{}",
                relay.take(),
                proxy.logs()
            ),
        };
        let mut left = gen.rng.gen_range(1..=8);
        while let (Some(conn), 1..) = (session.as_mut(), left) {
            left -= 1;
            rounds += 1;
            let (bytes, terminates) = gen.round();
            match run_round(conn, &bytes, terminates, rounds, false, &give_up) {
                Ok(Outcome::Answered) => {
                    answered += 1;
                    continue;
                }
                Ok(Outcome::Terminated) => terminated += 1,
                Ok(Outcome::ClosedWithError(closed)) => {
                    *fatal.entry(reason(&closed.message)).or_default() += 1
                }
                Err(Failure::Timeout(_)) if relay.changed() => stalled += 1,
                Err(e) => panic!(
                    "seed {seed} (PGFENCE_FUZZ_FIRST_SEED={seed} \
                     PGFENCE_FUZZ_SERVER_SESSIONS=1): {e}\nround's bytes: {bytes:?}\n\
                     the relay's changes: {:?}\npgfence's log:\n{}",
                    relay.take(),
                    proxy.logs()
                ),
            }
            session = None;
        }
        changes += relay.take().len();
    }
    let closed: u32 = fatal.values().sum();
    eprintln!(
        "{sessions} sessions from seed {first_seed}, {rounds} rounds, {changes} server \
         messages changed: {answered} answered, {closed} closed with a FATAL error, \
         {terminated} ended by their Terminate, {stalled} unanswered after a change in \
         their session"
    );
    for (reason, n) in &fatal {
        eprintln!("  {n:5}  FATAL {reason}");
    }
    if sessions >= 50 {
        assert!(
            answered > 0 && closed > 0 && changes > 0,
            "{answered} answered, {changes} changes, {fatal:?}"
        );
    }

    assert_no_server_crash(&cluster, "by the end");
    // Sessions whose rounds went unanswered wait for a reply the server will not send, as a
    // client of PostgreSQL itself would. Their clients closed, but pgfence goes on until
    // it has run what a client sent before closing, as PostgreSQL does; their server
    // processes are still there. When those end, pgfence ends the sessions too.
    relay.pass_through();
    let ended = cluster.psql(
        APP_DB,
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE datname = 'app' AND backend_type = 'client backend' AND pid <> pg_backend_pid()",
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let (mut console, _) = RawConn::login(proxy.addr(), SUPERUSER, "pgfence");
        let clients = console.query_rows("SHOW CLIENTS");
        if clients.len() == 1 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "sessions left after their server processes ended ({} of them, {} ended): \
             {clients:?}\npgfence's log:\n{}",
            clients.len() - 1,
            ended.trim(),
            proxy.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_unharmed(&cluster, &proxy);
}

/// How a login through the relay ended.
enum Login {
    /// At a ReadyForQuery.
    Ready(RawConn),
    /// pgfence closed the connection after this FATAL error.
    Closed(Fatal),
}

/// Logs in through pgfence, whose server's login messages the relay may change.
fn log_in_through_relay(
    proxy: SocketAddr,
    options: &str,
    give_up: &dyn Fn(Duration) -> bool,
) -> Result<Login, Failure> {
    let mut conn = RawConn::connect(proxy);
    conn.send(&wire::startup_version(
        wire::PROTOCOL_3_0,
        &[
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
            ("options", options.as_bytes()),
        ],
    ));
    let start = Instant::now();
    let mut seen = Vec::new();
    loop {
        match conn.next(WAIT_SLICE) {
            Ok(Read1::Msg(m)) if m.tag == b'Z' => return Ok(Login::Ready(conn)),
            Ok(Read1::Msg(m)) => seen.push(m),
            Ok(Read1::Closed) => {
                return match last_fatal(&seen) {
                    Some(fatal) => Ok(Login::Closed(fatal)),
                    None => Err(closed_quietly(&seen)),
                }
            }
            Err(e) if is_timeout(&e) && !give_up(start.elapsed()) => {}
            Err(e) => {
                return Err(Failure::Timeout(format!(
                    "no ReadyForQuery within {:?} ({e}); last replies: {:?}",
                    start.elapsed(),
                    tail(&seen)
                )))
            }
        }
    }
}

/// A TCP relay between pgfence and PostgreSQL that changes what the server sends once a
/// connection has logged in (after its first ReadyForQuery; from its first message in one
/// connection of four). Each message, with chance
/// [`SERVER_MUTATION_RATE`], gets its body mutated as the client-side fuzz does, or its
/// type replaced, or its ReadyForQuery status replaced, or is sent twice; each message's
/// length field still holds what follows. What pgfence sends goes through unchanged. A
/// connection draws its changes from the seed armed when it was accepted.
struct MutatingRelay {
    port: u16,
    state: Arc<Mutex<RelayState>>,
}

#[derive(Default)]
struct RelayState {
    /// The seed of the connections accepted now; none: they pass through unchanged.
    seed: Option<u64>,
    /// What the relay changed since the test last took it.
    made: Vec<String>,
}

impl MutatingRelay {
    fn start(upstream: u16) -> MutatingRelay {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind the relay");
        let port = listener.local_addr().unwrap().port();
        let state = Arc::new(Mutex::new(RelayState::default()));
        let shared = state.clone();
        std::thread::spawn(move || {
            for client in listener.incoming() {
                let Ok(client) = client else { continue };
                let Ok(server) = TcpStream::connect(("127.0.0.1", upstream)) else {
                    continue;
                };
                let seed = shared.lock().unwrap().seed;
                let state = shared.clone();
                std::thread::spawn(move || relay_connection(client, server, seed, state));
            }
        });
        MutatingRelay { port, state }
    }

    /// Seeds the connections accepted from now on, and forgets what was changed.
    fn arm(&self, seed: u64) {
        let mut state = self.state.lock().unwrap();
        state.seed = Some(seed);
        state.made.clear();
    }

    /// Leaves the connections accepted from now on unchanged.
    fn pass_through(&self) {
        self.state.lock().unwrap().seed = None;
    }

    /// Whether anything was changed since the last [`Self::arm`] or [`Self::take`].
    fn changed(&self) -> bool {
        !self.state.lock().unwrap().made.is_empty()
    }

    /// What was changed since the last call.
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.state.lock().unwrap().made)
    }
}

/// Relays one connection until either side closes it (unchanged without a seed).
fn relay_connection(
    client: TcpStream,
    server: TcpStream,
    seed: Option<u64>,
    state: Arc<Mutex<RelayState>>,
) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut from_client, mut to_server) =
        (client.try_clone().unwrap(), server.try_clone().unwrap());
    std::thread::spawn(move || {
        let _ = std::io::copy(&mut from_client, &mut to_server);
        let _ = to_server.shutdown(std::net::Shutdown::Both);
    });
    let rate = if seed.is_some() {
        SERVER_MUTATION_RATE
    } else {
        0.0
    };
    let mut gen = Gen {
        rng: StdRng::seed_from_u64(seed.unwrap_or_default() ^ SERVER_SEED_SALT),
        functions: Vec::new(),
        statements: STATEMENTS,
        mutated: true,
    };
    let (mut from_server, mut to_client) = (server, client);
    // One connection in four has its login messages changed too.
    let mut logged_in = rate > 0.0 && gen.rng.gen_bool(0.25);
    let mut pending = Vec::new();
    let mut chunk = vec![0u8; 16 * 1024];
    while let Ok(n @ 1..) = from_server.read(&mut chunk) {
        pending.extend_from_slice(&chunk[..n]);
        let mut out = Vec::new();
        while pending.len() >= 5 {
            let len = u32::from_be_bytes([pending[1], pending[2], pending[3], pending[4]]) as usize;
            if pending.len() < 1 + len {
                break;
            }
            let tag = pending[0];
            let body = pending[5..1 + len].to_vec();
            pending.drain(..1 + len);
            if logged_in && gen.rng.gen_bool(rate) {
                let (frames, what) = mutate_server_message(&mut gen, tag, body);
                state.lock().unwrap().made.push(what);
                out.extend(frames);
            } else {
                out.extend(wire::frame(tag, &body));
            }
            logged_in |= tag == b'Z';
        }
        if to_client.write_all(&out).is_err() {
            break;
        }
    }
    let _ = to_client.shutdown(std::net::Shutdown::Both);
}

/// One change to a server message: the frames that stand for it, and what was done.
fn mutate_server_message(gen: &mut Gen, tag: u8, mut body: Vec<u8>) -> (Vec<u8>, String) {
    let was = format!("{:?} {:?}", tag as char, shorten(&body));
    let (tag, what) = match gen.rng.gen_range(0..10) {
        0..=5 => {
            gen.mutate(tag, &mut body);
            (tag, format!("body now {:?}", shorten(&body)))
        }
        6 => {
            let new: u8 = gen.rng.gen();
            (new, format!("type now {:?}", new as char))
        }
        7 => {
            let new = gen.pick(BACKEND_TAGS);
            (new, format!("type now {:?}", new as char))
        }
        8 if tag == b'Z' => {
            body = vec![gen.pick(b"IETX")];
            (tag, format!("status now {:?}", body[0] as char))
        }
        _ => {
            let mut twice = wire::frame(tag, &body);
            twice.extend(wire::frame(tag, &body));
            return (twice, format!("{was}: sent twice"));
        }
    };
    (wire::frame(tag, &body), format!("{was}: {what}"))
}

/// The first bytes of `body`, for a failure's message.
fn shorten(body: &[u8]) -> String {
    let head = &body[..body.len().min(40)];
    let more = if body.len() > head.len() { "..." } else { "" };
    format!("{}{more}", String::from_utf8_lossy(head))
}

/// A first packet of the corpus.
fn startup_packet(rng: &mut StdRng) -> Vec<u8> {
    let options: &[&[u8]] = &[
        b"",
        b"-c fencing.token=7 -c fencing.resource=fz",
        b"-c fencing.token=-1",
        b"-c fencing.token=99999999999999999999 -c fencing.resource=fz",
        b"-c fencing.resource=bad/name",
        b"-c statement_timeout=5s",
    ];
    match rng.gen_range(0..10) {
        0 => wire::ssl_request(),
        1 => wire::gssenc_request(),
        2 => wire::cancel_request(rng.gen(), rng.gen()),
        _ => {
            let option = options[rng.gen_range(0..options.len())];
            let mut params: Vec<(&str, &[u8])> = vec![("user", SUPERUSER.as_bytes())];
            if rng.gen_bool(0.8) {
                params.push(("database", APP_DB.as_bytes()));
            }
            if !option.is_empty() {
                params.push(("options", option));
            }
            if rng.gen_bool(0.2) {
                params.push(("application_name", b"fuzz"));
            }
            if rng.gen_bool(0.05) {
                params.push(("replication", b"database"));
            }
            wire::startup_version(wire::PROTOCOL_3_0, &params)
        }
    }
}

/// Changes a first packet: its body (after the length) cut, extended, bytes changed, its
/// version or request code replaced, string terminators removed; the length field is
/// kept true but for rare extreme values.
fn mutate_startup(rng: &mut StdRng, packet: &mut Vec<u8>) {
    let body_len = packet.len() - 4;
    match rng.gen_range(0..8) {
        0 if body_len > 0 => packet.truncate(4 + rng.gen_range(0..body_len)),
        1 => {
            for _ in 0..rng.gen_range(1..16) {
                packet.push(rng.gen());
            }
        }
        2 if body_len > 0 => {
            for _ in 0..rng.gen_range(1..4) {
                let at = 4 + rng.gen_range(0..body_len);
                packet[at] = rng.gen();
            }
        }
        3 if body_len >= 4 => {
            let code: u32 = match rng.gen_range(0..4) {
                0 => rng.gen(),
                1 => 2 << 16,
                2 => (3 << 16) | 2,
                _ => 1234 << 16 | rng.gen_range(5670..5682),
            };
            packet[4..8].copy_from_slice(&code.to_be_bytes());
        }
        4 => {
            for b in packet.iter_mut().skip(8) {
                if *b == 0 {
                    *b = b'x';
                }
            }
        }
        _ => {}
    }
    let len = u32::try_from(packet.len()).expect("small packet");
    let len = if rng.gen_bool(0.05) {
        *[0u32, 4, 7, 0x7FFF_FFFF, 0xFFFF_FFFF, len + 100]
            .get(rng.gen_range(0..6))
            .unwrap()
    } else {
        len
    };
    packet[..4].copy_from_slice(&len.to_be_bytes());
}

/// Sends one first packet and reads until the connection ends. `Err` on a hang, or an
/// end that is neither a login, nor a FATAL error, nor a cancel's silent close.
fn run_startup(proxy: SocketAddr, packet: &[u8], cancel: bool) -> Result<(), String> {
    let mut conn = TcpStream::connect(proxy).map_err(|e| format!("connect: {e}"))?;
    // pgfence may close before it has read everything.
    let _ = conn.write_all(packet);
    let deadline = Instant::now() + ROUND_TIMEOUT;
    let mut got = Vec::new();
    let mut logged_in = false;
    let mut answered = false;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!("no end within {ROUND_TIMEOUT:?}; received {got:?}"));
        }
        conn.set_read_timeout(Some(left))
            .map_err(|e| e.to_string())?;
        let mut chunk = [0u8; 8192];
        match conn.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => break,
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                ) => {}
            Err(e) => return Err(format!("read: {e}")),
        }
        // An encryption request is answered with one byte before any message.
        let messages = match got.first() {
            Some(b'N' | b'S') if got.len() == 1 || !got[1..].starts_with(b"E") => &got[1..],
            _ => &got[..],
        };
        if !logged_in && complete(messages).iter().any(|m| m.tag == b'Z') {
            logged_in = true;
            let _ = conn.write_all(&wire::terminate());
        }
        if !answered && got.len() == 1 && matches!(got[0], b'N' | b'S') {
            // Declined (or TLS offered, which this client does not take): log in in plain
            // text, as libpq does after an `N`.
            answered = true;
            let _ = conn.write_all(&wire::startup(SUPERUSER, APP_DB));
        }
    }
    let messages = match got.first() {
        Some(b'N' | b'S') => &got[1..],
        _ => &got[..],
    };
    let msgs = complete(messages);
    let fatal = msgs.last().is_some_and(|m| {
        m.tag == b'E' && matches!(m.field(b'V').as_deref(), Some("FATAL") | Some("PANIC"))
    });
    // A protocol 2 request is refused in that protocol's format, as PostgreSQL does.
    let fatal_v2 = got.starts_with(b"EFATAL:") && got.ends_with(b"\0");
    if logged_in || fatal || fatal_v2 || (cancel && got.is_empty()) {
        Ok(())
    } else {
        Err(format!(
            "closed without a FATAL error or a login; received {got:?}"
        ))
    }
}

/// The complete messages at the front of `bytes`.
fn complete(mut bytes: &[u8]) -> Vec<Msg> {
    let mut out = Vec::new();
    while bytes.len() >= 5 {
        let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
        if len < 4 || bytes.len() < 1 + len {
            break;
        }
        out.push(Msg {
            tag: bytes[0],
            body: bytes[5..1 + len].to_vec(),
        });
        bytes = &bytes[1 + len..];
    }
    out
}

#[test]
fn mutated_startup_packets_never_panic_or_hang() {
    let packets = env_or("PGFENCE_FUZZ_STARTUPS", 2000);
    let first_seed = env_or("PGFENCE_FUZZ_FIRST_SEED", 1);
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let mut config = Proxy::config_for(&cluster);
    config.limits.startup_timeout = Duration::from_secs(1);
    let proxy = fuzz_proxy(config);
    // Eight connections at a time: a packet cut short waits for the startup timeout.
    let failures: Vec<String> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..8)
            .map(|worker| {
                let proxy = proxy.addr();
                scope.spawn(move || {
                    let mut failures = Vec::new();
                    for seed in (first_seed..first_seed + packets).skip(worker).step_by(8) {
                        let mut rng = StdRng::seed_from_u64(seed);
                        let mut packet = startup_packet(&mut rng);
                        if rng.gen_bool(0.5) {
                            mutate_startup(&mut rng, &mut packet);
                        }
                        // A cancel is closed without a word, as PostgreSQL closes it,
                        // whatever it holds.
                        let cancel =
                            packet.get(4..8) == Some(&wire::CANCEL_REQUEST_CODE.to_be_bytes()[..]);
                        if let Err(e) = run_startup(proxy, &packet, cancel) {
                            failures.push(format!(
                                "seed {seed} (PGFENCE_FUZZ_FIRST_SEED={seed} \
                                 PGFENCE_FUZZ_STARTUPS=1): {e}\npacket: {packet:?}"
                            ));
                        }
                    }
                    failures
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().expect("a worker"))
            .collect()
    });
    assert!(
        failures.is_empty(),
        "{} of {packets} first packets failed:\n{}\npgfence's log:\n{}",
        failures.len(),
        failures.join("\n"),
        proxy.logs()
    );
    assert_unharmed(&cluster, &proxy);
}
