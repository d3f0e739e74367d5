//! The billing story of SPEC section 1, end to end through pgfence with real clients:
//! instance A writes with token 33 (accepted), instance B with 34 (accepted), A writes with 33
//! again: rejected with exactly the FN001 of SPEC section 5, none of A's last transaction is
//! in the table, the fence is 34, and A's session is usable and outside any transaction
//! afterwards (a `ROLLBACK` then warns `there is no transaction in progress`, so what the
//! client was told matches the server).
//!
//! Every story runs for each token source (startup `options`, `SET fencing.*`, a plain
//! comment, a sqlcommenter comment, the configured default resource with a session token),
//! in autocommit and in an explicit transaction, through a pgfence with the fast path on and
//! one with it off:
//!
//! - [`story_tokio_postgres`]: extended protocol (`execute`, BEGIN/COMMIT included), the
//!   transaction API (simple BEGIN/COMMIT, extended writes, `INSERT ... RETURNING`),
//!   pipelined (every statement in flight at once), and one multi-statement simple Query.
//! - [`story_psql`]: psql, simple protocol, one statement per Query; instance B is a second
//!   psql run from A's script (`\!`) so that A keeps its session.
//! - [`story_psycopg`]: `tests/python/test_fence_story.py`, psycopg extended and pipeline
//!   mode.
//!
//! A's last writes call `nextval` on a sequence of the story: the database path runs them
//! (the sequence moves, the rows roll back), the fast path must not run them at all (the
//! sequence does not move). So the tests also show which path rejected.

use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::path::Path;

use futures_util::FutureExt;

use harness::fence::{
    self, assert_psql_rejection, assert_rejected, connect_with_notices, drain_notices, psql_script,
    sqlstate, Expected,
};
use harness::{
    pg_bin_dir, python_or_skip, quote_conn_value, run_python, PgCluster, Proxy, APP_DB, SUPERUSER,
};
use pgfence_config::DefaultResource;
use tokio_postgres::Client;

const TOKEN_A: i64 = 33;
const TOKEN_B: i64 = 34;
/// `there is no transaction in progress`: a ROLLBACK outside a transaction block.
const NO_TRANSACTION: &str = "25P01";
/// `in_failed_sql_transaction`.
const IN_FAILED_TRANSACTION: &str = "25P02";

/// Where a session's token comes from (SPEC section 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    /// `options=-c fencing.token=N -c fencing.resource=R` in the connection string.
    Options,
    /// `SET fencing.token = N; SET fencing.resource = 'R'` after connecting.
    Set,
    /// `/* fencing_token=N fencing_resource=R */` before every write.
    Comment,
    /// `/*fencing_resource='R',fencing_token='N'*/` after every write, URL-encoded.
    SqlCommenter,
    /// The configured default resource of the session's user, `options=-c fencing.token=N`.
    Default,
}

const SOURCES: [Source; 5] = [
    Source::Options,
    Source::Set,
    Source::Comment,
    Source::SqlCommenter,
    Source::Default,
];

impl Source {
    /// Whether pgfence itself knows the token and the resource of a write, so that the fast
    /// path (when on) rejects a stale one before it runs. A `SET` goes by the server; so
    /// does the configured default resource, which the server may replace with its own
    /// (`ALTER ROLE ... SET fencing.resource`).
    fn fast_path_knows(self) -> bool {
        matches!(
            self,
            Source::Options | Source::Comment | Source::SqlCommenter
        )
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// One write per implicit transaction.
    Autocommit,
    /// `BEGIN`, two writes, `COMMIT`.
    Explicit,
}

const MODES: [Mode; 2] = [Mode::Autocommit, Mode::Explicit];

/// One story: its own resource, sequence and (for [`Source::Default`]) user.
#[derive(Debug, Clone, Copy)]
struct Story {
    id: usize,
    source: Source,
    mode: Mode,
    fast: bool,
}

impl Story {
    /// All combinations of sources and modes, for both proxies, numbered from `first`.
    fn all(first: usize) -> Vec<Story> {
        let mut stories = Vec::new();
        for fast in [true, false] {
            for source in SOURCES {
                for mode in MODES {
                    stories.push(Story {
                        id: first + stories.len(),
                        source,
                        mode,
                        fast,
                    });
                }
            }
        }
        stories
    }

    fn resource(&self) -> String {
        match self.source {
            Source::Default => format!("default_{}", self.id),
            // A colon, so the sqlcommenter comment has something to URL-encode.
            _ => format!("story:{}", self.id),
        }
    }

    fn user(&self) -> String {
        match self.source {
            Source::Default => format!("story_user_{}", self.id),
            _ => SUPERUSER.to_string(),
        }
    }

    /// The `options` connection parameter of a session with `token`, if any.
    fn options(&self, token: i64) -> Option<String> {
        match self.source {
            Source::Options => Some(format!(
                "-c fencing.token={token} -c fencing.resource={}",
                self.resource()
            )),
            Source::Default => Some(format!("-c fencing.token={token}")),
            _ => None,
        }
    }

    fn connstr(&self, proxy: &Proxy, token: i64) -> String {
        let mut s = proxy.connstr_as(APP_DB, &self.user(), None);
        if let Some(options) = self.options(token) {
            write!(s, " options={}", quote_conn_value(&options)).unwrap();
        }
        s
    }

    /// Statements a session runs first.
    fn setup(&self, token: i64) -> Vec<String> {
        match self.source {
            Source::Set => vec![
                format!("SET fencing.token = {token}"),
                format!("SET fencing.resource = '{}'", self.resource()),
            ],
            _ => Vec::new(),
        }
    }

    /// One write of `who`, carrying `token` when the source is a comment.
    fn write(&self, who: &str, token: i64) -> String {
        let id = self.id;
        let insert = format!(
            "INSERT INTO story (story, who, token, n) VALUES ({id}, '{who}', {token}, \
             nextval('story_seq_{id}'))"
        );
        match self.source {
            Source::Comment => format!(
                "/* fencing_token={token} fencing_resource={} */ {insert}",
                self.resource()
            ),
            Source::SqlCommenter => format!(
                "{insert} /*fencing_resource='{}',fencing_token='{token}'*/",
                self.resource().replace(':', "%3A")
            ),
            _ => insert,
        }
    }

    /// The names of the rows one transaction of `who` writes.
    fn rows(&self, who: &str) -> Vec<String> {
        match self.mode {
            Mode::Autocommit => vec![who.to_string()],
            Mode::Explicit => vec![format!("{who}a"), format!("{who}b")],
        }
    }

    /// Whether A's stale writes are rejected by the fast path (without running).
    fn expect_fast(&self) -> bool {
        self.fast && self.source.fast_path_knows()
    }

    fn stale(&self) -> Expected {
        fence::stale(&self.resource(), TOKEN_A, TOKEN_B)
    }

    fn describe(&self, driver: &str) -> String {
        format!(
            "story {} ({driver}, {:?}, {:?}, fast path {})",
            self.id,
            self.source,
            self.mode,
            if self.fast { "on" } else { "off" }
        )
    }
}

/// A cluster with the story table, and two pgfence in front of it: fast path on and off.
struct World {
    cluster: PgCluster,
    fast: Proxy,
    slow: Proxy,
}

impl World {
    fn new(stories: &[Story]) -> World {
        let cluster = PgCluster::start();
        let mut sql = fence_core::sql::install_sql(None);
        sql.push_str(
            "\nCREATE TABLE story (story int, who text, token bigint, n bigint);\n\
             GRANT ALL ON story TO PUBLIC;\n",
        );
        for s in stories {
            writeln!(sql, "CREATE SEQUENCE story_seq_{};", s.id).unwrap();
            if s.source == Source::Default {
                writeln!(sql, "CREATE ROLE {} LOGIN;", s.user()).unwrap();
            }
        }
        sql.push_str("GRANT ALL ON ALL SEQUENCES IN SCHEMA public TO PUBLIC;\n");
        cluster.psql(APP_DB, &sql);

        let mut config = Proxy::config_for(&cluster);
        config.fence.defaults = stories
            .iter()
            .filter(|s| s.source == Source::Default)
            .map(|s| DefaultResource {
                database: APP_DB.to_string(),
                user: Some(s.user()),
                resource: s.resource(),
            })
            .collect();
        let fast = Proxy::start(config.clone());
        config.fence.fast_path = false;
        let slow = Proxy::start(config);
        World {
            cluster,
            fast,
            slow,
        }
    }

    fn proxy(&self, story: &Story) -> &Proxy {
        if story.fast {
            &self.fast
        } else {
            &self.slow
        }
    }

    /// What the story left in the database, read directly: the rows' names in order of
    /// insertion, the sequence's value, and the fence.
    async fn outcome(&self, story: &Story) -> (Vec<String>, i64, Option<i64>) {
        let db = self.cluster.connect(APP_DB).await;
        let id = story.id as i32;
        let rows = db
            .query("SELECT who FROM story WHERE story = $1 ORDER BY n", &[&id])
            .await
            .unwrap()
            .iter()
            .map(|r| r.get(0))
            .collect();
        let seq: i64 = db
            .query_one(
                &format!(
                    "SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM story_seq_{}",
                    story.id
                ),
                &[],
            )
            .await
            .unwrap()
            .get(0);
        let fence = db
            .query_opt(
                "SELECT token FROM pgfence.fences WHERE resource = $1",
                &[&story.resource()],
            )
            .await
            .unwrap()
            .map(|r| r.get(0));
        (rows, seq, fence)
    }

    /// Checks the end state: A's first and B's transactions are there, none of A's last,
    /// the fence is B's token, and the sequence moved for exactly `stale_runs` of A's last
    /// writes (those the database ran before rejecting the transaction; the fast path runs
    /// none).
    async fn assert_outcome(&self, story: &Story, stale_runs: usize, context: &str) {
        let (rows, seq, fence) = self.outcome(story).await;
        let mut expected = story.rows("A1");
        expected.extend(story.rows("B"));
        assert_eq!(rows, expected, "{context}: rows in the table");
        assert_eq!(fence, Some(TOKEN_B), "{context}: the fence");
        assert_eq!(
            seq,
            (expected.len() + stale_runs) as i64,
            "{context}: nextval calls (the fast path must not run a stale write; the database \
             path runs it and rolls it back)"
        );
    }
}

// ---------------------------------------------------------------------------------------
// tokio-postgres
// ---------------------------------------------------------------------------------------

/// How a tokio-postgres client runs a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Driver {
    /// Every statement (BEGIN and COMMIT too) with `Client::execute`: Parse/Bind/Execute/Sync.
    Extended,
    /// `Client::transaction` (simple BEGIN and COMMIT), writes with `query` and `RETURNING`.
    TransactionApi,
    /// Prepared statements, all executions in flight at once (one Sync each).
    Pipelined,
    /// The whole transaction as one multi-statement simple Query (`batch_execute`).
    Simple,
}

const DRIVERS: [Driver; 4] = [
    Driver::Extended,
    Driver::TransactionApi,
    Driver::Pipelined,
    Driver::Simple,
];

/// The result of each statement of one transaction, in order: BEGIN (explicit mode), the
/// writes, COMMIT (explicit mode). A driver that sends the transaction as one unit gives one
/// result.
type Trace = Vec<Result<(), tokio_postgres::Error>>;

async fn run_transaction(
    client: &mut Client,
    driver: Driver,
    story: &Story,
    who: &str,
    token: i64,
) -> Trace {
    let writes: Vec<String> = story
        .rows(who)
        .iter()
        .map(|w| story.write(w, token))
        .collect();
    let explicit = story.mode == Mode::Explicit;
    let ok = |r: Result<u64, tokio_postgres::Error>| r.map(|_| ());
    match driver {
        Driver::Extended => {
            let mut trace = Vec::new();
            if explicit {
                trace.push(ok(client.execute("BEGIN", &[]).await));
            }
            for w in &writes {
                trace.push(ok(client.execute(w.as_str(), &[]).await));
            }
            if explicit {
                trace.push(ok(client.execute("COMMIT", &[]).await));
            }
            trace
        }
        Driver::TransactionApi => {
            let returning = |w: &String| match w.find(" /*fencing_resource") {
                // sqlcommenter puts its comment last.
                Some(at) => format!("{} RETURNING n{}", &w[..at], &w[at..]),
                None => format!("{w} RETURNING n"),
            };
            if !explicit {
                let r = client.query(returning(&writes[0]).as_str(), &[]).await;
                return vec![r.map(|rows| assert_eq!(rows.len(), 1))];
            }
            let tx = client.transaction().await.expect("BEGIN");
            let mut trace = vec![Ok(())];
            for w in &writes {
                trace.push(tx.query(returning(w).as_str(), &[]).await.map(|_| ()));
            }
            trace.push(tx.commit().await);
            trace
        }
        Driver::Pipelined => {
            let client = &*client;
            let mut sqls = Vec::new();
            if explicit {
                sqls.push("BEGIN".to_string());
            }
            sqls.extend(writes);
            if explicit {
                sqls.push("COMMIT".to_string());
            }
            let mut statements = Vec::new();
            for sql in &sqls {
                statements.push(client.prepare(sql).await.expect("prepare"));
            }
            let futures = statements.iter().map(|s| client.execute(s, &[]));
            futures_util::future::join_all(futures)
                .await
                .into_iter()
                .map(ok)
                .collect()
        }
        Driver::Simple => {
            let text = if explicit {
                format!("BEGIN; {}; COMMIT", writes.join("; "))
            } else {
                writes.join("; ")
            };
            vec![client.batch_execute(&text).await]
        }
    }
}

/// Asserts how A's last transaction was rejected; returns how many of its writes ran.
fn assert_stale_trace(trace: &Trace, story: &Story, driver: Driver, context: &str) -> usize {
    let stale = story.stale();
    let writes = story.rows("A2").len();
    // The database path runs a write before rejecting its transaction, the fast path not.
    let runs = if story.expect_fast() { 0 } else { writes };
    let codes: Vec<Option<String>> = trace.iter().map(sqlstate).collect();
    let rejected_write = |context: &str| {
        // The first write is rejected; the transaction is failed, so the second write is
        // refused and COMMIT rolls back (without an error), as in PostgreSQL.
        assert_eq!(trace.len(), 4, "{context}");
        assert!(trace[0].is_ok(), "{context}: BEGIN: {:?}", trace[0]);
        assert_rejected(&trace[1], &stale, context);
        assert_eq!(
            codes[2].as_deref(),
            Some(IN_FAILED_TRANSACTION),
            "{context}: the write after the rejected one: {:?}",
            trace[2]
        );
        assert!(
            trace[3].is_ok(),
            "{context}: COMMIT of a failed transaction: {:?}",
            trace[3]
        );
    };
    let rejected_commit = |context: &str| {
        // The writes ran; the COMMIT is rejected, like a deferred constraint.
        assert_eq!(trace.len(), 4, "{context}");
        for (i, r) in trace[..3].iter().enumerate() {
            assert!(r.is_ok(), "{context}: statement {i}: {r:?}");
        }
        assert_rejected(&trace[3], &stale, context);
    };
    match (story.mode, driver) {
        (_, Driver::Simple) | (Mode::Autocommit, Driver::TransactionApi) => {
            assert_eq!(trace.len(), 1, "{context}");
            assert_rejected(&trace[0], &stale, context);
            // A Query of several statements is the database's to reject (the fast path
            // answers for one of one statement only).
            if driver == Driver::Simple && story.mode == Mode::Explicit {
                writes
            } else {
                runs
            }
        }
        (Mode::Autocommit, _) => {
            // Every write is its own transaction: each one is rejected.
            for r in trace {
                assert_rejected(r, &stale, context);
            }
            runs
        }
        (Mode::Explicit, _) if story.expect_fast() => {
            rejected_write(context);
            0
        }
        (Mode::Explicit, Driver::Pipelined) if codes[1].is_some() => {
            // Every statement has its own Sync and all are in flight before BEGIN's
            // ReadyForQuery says a transaction block is open: pgfence then checks at the
            // first write's Sync (as if it ended an implicit transaction), and that check,
            // whose lock would have lasted to the end of the transaction, rejects it there.
            rejected_write(&format!("{context} (checked at the first write's Sync)"));
            1
        }
        (Mode::Explicit, _) => {
            rejected_commit(context);
            runs
        }
    }
}

/// The session after the rejection: usable, and outside any transaction (a ROLLBACK warns
/// that there is none), so what the client believes matches the server.
async fn assert_usable_and_idle(
    client: &Client,
    notices: &mut tokio::sync::mpsc::UnboundedReceiver<tokio_postgres::error::DbError>,
    context: &str,
) {
    drain_notices(notices);
    client
        .batch_execute("ROLLBACK")
        .await
        .unwrap_or_else(|e| panic!("{context}: ROLLBACK after the rejection: {e:?}"));
    let one: i32 = client
        .query_one("SELECT 1", &[])
        .await
        .unwrap_or_else(|e| panic!("{context}: SELECT after the rejection: {e:?}"))
        .get(0);
    assert_eq!(one, 1);
    assert_eq!(
        drain_notices(notices),
        vec![NO_TRANSACTION.to_string()],
        "{context}: the server session is still in a transaction after the rejection"
    );
}

async fn tokio_story(world: &World, story: &Story, driver: Driver) {
    let context = story.describe(&format!("{driver:?}"));
    let proxy = world.proxy(story);
    let (mut a, mut a_notices) = connect_with_notices(&story.connstr(proxy, TOKEN_A)).await;
    for s in story.setup(TOKEN_A) {
        a.batch_execute(&s).await.unwrap();
    }
    for r in run_transaction(&mut a, driver, story, "A1", TOKEN_A).await {
        r.unwrap_or_else(|e| panic!("{context}: A with {TOKEN_A}: {e:?}"));
    }

    let (mut b, _) = connect_with_notices(&story.connstr(proxy, TOKEN_B)).await;
    for s in story.setup(TOKEN_B) {
        b.batch_execute(&s).await.unwrap();
    }
    for r in run_transaction(&mut b, driver, story, "B", TOKEN_B).await {
        r.unwrap_or_else(|e| panic!("{context}: B with {TOKEN_B}: {e:?}"));
    }

    let trace = run_transaction(&mut a, driver, story, "A2", TOKEN_A).await;
    let runs = assert_stale_trace(&trace, story, driver, &context);
    assert_usable_and_idle(&a, &mut a_notices, &context).await;
    world.assert_outcome(story, runs, &context).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn story_tokio_postgres() {
    let mut stories = Vec::new();
    for (n, driver) in DRIVERS.into_iter().enumerate() {
        stories.extend(Story::all(n * 100).into_iter().map(|s| (s, driver)));
    }
    let plain: Vec<Story> = stories.iter().map(|(s, _)| *s).collect();
    let world = World::new(&plain);
    let mut failed = Vec::new();
    for (story, driver) in stories {
        // Every failing story is reported, not just the first.
        let run = AssertUnwindSafe(tokio_story(&world, &story, driver));
        if run.catch_unwind().await.is_err() {
            failed.push(story.describe(&format!("{driver:?}")));
        }
    }
    assert!(
        failed.is_empty(),
        "{} stories failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// psql
// ---------------------------------------------------------------------------------------

/// psql's statements of one transaction, one per line.
fn psql_transaction(story: &Story, who: &str, token: i64) -> String {
    let mut sql = String::new();
    let explicit = story.mode == Mode::Explicit;
    if explicit {
        sql.push_str("BEGIN;\n");
    }
    for w in story.rows(who) {
        writeln!(sql, "{};", story.write(&w, token)).unwrap();
    }
    if explicit {
        sql.push_str("COMMIT;\n");
    }
    sql
}

/// What psql prints on stdout (`-At`, command tags included) for a successful transaction.
fn psql_tags(story: &Story, who: &str) -> Vec<&'static str> {
    let mut tags = Vec::new();
    let explicit = story.mode == Mode::Explicit;
    if explicit {
        tags.push("BEGIN");
    }
    tags.extend(story.rows(who).iter().map(|_| "INSERT 0 1"));
    if explicit {
        tags.push("COMMIT");
    }
    tags
}

fn psql_story(world: &World, story: &Story, dir: &Path) {
    let context = story.describe("psql");
    let proxy = world.proxy(story);
    let psql = pg_bin_dir().join("psql");
    let user = story.user();

    // B: a psql of its own, started from A's script so that A keeps its session.
    let b_sql = dir.join(format!("b_{}.sql", story.id));
    let b_out = dir.join(format!("b_{}.out", story.id));
    let mut b_script = String::new();
    for s in story.setup(TOKEN_B) {
        writeln!(b_script, "{s};").unwrap();
    }
    b_script.push_str(&psql_transaction(story, "B", TOKEN_B));
    std::fs::write(&b_sql, b_script).unwrap();
    let b_env = story
        .options(TOKEN_B)
        .map(|o| format!("PGOPTIONS='{o}' "))
        .unwrap_or_default();
    let b_command = format!(
        "\\! {b_env}{} -X -At -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p {} -U {user} -d {APP_DB} \
         -f {} > {} 2>&1; echo \"exit $?\" >> {}\n",
        psql.display(),
        proxy.port(),
        b_sql.display(),
        b_out.display(),
        b_out.display()
    );

    let mut script = String::new();
    for s in story.setup(TOKEN_A) {
        writeln!(script, "{s};").unwrap();
    }
    script.push_str(&psql_transaction(story, "A1", TOKEN_A));
    script.push_str(&b_command);
    script.push_str(&psql_transaction(story, "A2", TOKEN_A));
    script.push_str("ROLLBACK;\nSELECT 'usable';\n");

    let mut cmd = proxy.psql_cmd();
    // psql_cmd logs in as postgres; the default-resource stories need their own user.
    cmd.args(["-U", &user]);
    if let Some(o) = story.options(TOKEN_A) {
        cmd.env("PGOPTIONS", o);
    }
    let run = psql_script(cmd, APP_DB, &script);
    let b = std::fs::read_to_string(&b_out).unwrap_or_default();
    assert!(
        b.trim_end().ends_with("exit 0"),
        "{context}: B's psql failed:\n{b}"
    );
    assert!(run.success, "{context}: psql failed: {}", run.stderr);

    // stdout: the tags of what succeeded, nothing of the rejected writes or COMMIT.
    let mut expected: Vec<&str> = story.setup(TOKEN_A).iter().map(|_| "SET").collect();
    expected.extend(psql_tags(story, "A1"));
    match (story.mode, story.expect_fast()) {
        (Mode::Autocommit, _) => {}
        // The failed transaction's COMMIT rolls back, as in PostgreSQL.
        (Mode::Explicit, true) => expected.extend(["BEGIN", "ROLLBACK"]),
        // The writes ran; the COMMIT was rejected.
        (Mode::Explicit, false) => expected.extend(["BEGIN", "INSERT 0 1", "INSERT 0 1"]),
    }
    expected.extend(["ROLLBACK", "usable"]);
    let got: Vec<&str> = run.stdout.lines().collect();
    assert_eq!(
        got, expected,
        "{context}: psql's stdout\n--- stderr ---\n{}",
        run.stderr
    );

    // stderr: the rejection exactly once, then the proof that no transaction is open.
    assert_psql_rejection(&run.stderr, &story.stale(), &context);
    let warning = "WARNING:  25P01: there is no transaction in progress";
    assert_eq!(
        run.stderr.lines().filter(|l| l.ends_with(warning)).count(),
        1,
        "{context}: the session is still in a transaction after the rejection:\n{}",
        run.stderr
    );
    let aborted = run
        .stderr
        .lines()
        .filter(|l| l.contains("ERROR:  25P02:"))
        .count();
    let expected_aborted = usize::from(story.mode == Mode::Explicit && story.expect_fast());
    assert_eq!(aborted, expected_aborted, "{context}:\n{}", run.stderr);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn story_psql() {
    let stories = Story::all(0);
    let world = World::new(&stories);
    let dir = tempfile::tempdir().unwrap();
    let mut failed = Vec::new();
    for story in stories {
        let run = AssertUnwindSafe(async {
            tokio::task::block_in_place(|| psql_story(&world, &story, dir.path()));
            let runs = if story.expect_fast() {
                0
            } else {
                story.rows("A2").len()
            };
            world
                .assert_outcome(&story, runs, &story.describe("psql"))
                .await;
        });
        if run.catch_unwind().await.is_err() {
            failed.push(story.describe("psql"));
        }
    }
    assert!(
        failed.is_empty(),
        "{} stories failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

// ---------------------------------------------------------------------------------------
// psycopg
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn story_psycopg() {
    if python_or_skip("story_psycopg").is_none() {
        return;
    }
    // The script runs PER_RUN stories per proxy, numbered from its STORY_FIRST_ID, story
    // `first + n` with token source number `n % 5` (its SOURCES has the same order); this
    // creates their sequences and users.
    const PER_RUN: usize = 20;
    let mut stories = Vec::new();
    for fast in [true, false] {
        for n in 0..PER_RUN {
            stories.push(Story {
                id: stories.len(),
                source: SOURCES[n % SOURCES.len()],
                mode: Mode::Autocommit,
                fast,
            });
        }
    }
    let world = World::new(&stories);
    for (first, proxy, fast) in [(0, &world.fast, "on"), (PER_RUN, &world.slow, "off")] {
        let out = tokio::task::block_in_place(|| {
            run_python(
                "test_fence_story.py",
                &[
                    ("PG_DIRECT_DSN", &world.cluster.connstr(APP_DB)),
                    ("PGFENCE_DSN", &proxy.connstr(APP_DB)),
                    ("STORY_FAST_PATH", fast),
                    ("STORY_FIRST_ID", &first.to_string()),
                    ("STORY_COUNT", &PER_RUN.to_string()),
                ],
            )
        });
        eprintln!("psycopg stories, fast path {fast}:\n{out}");
        for name in ["extended", "pipeline"] {
            assert!(
                out.lines().any(|l| l.starts_with(&format!("ok {name} "))),
                "no `ok {name}` in:\n{out}"
            );
        }
        let stories_run = out.lines().filter(|l| l.starts_with("story ")).count();
        assert_eq!(stories_run, PER_RUN, "stories that ran:\n{out}");
    }
}
