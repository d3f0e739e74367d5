//! The concurrency checker through pgfence: 10 clients write in parallel through an
//! in-process pgfence to one resource while a separate task advances the leader's token at
//! random moments; now and then a client keeps its old token for a while (a paused leader).
//! Every committed write records the token it was made with. Afterwards the invariant of SPEC
//! section 4 is checked over what PostgreSQL committed, in commit order
//! (`pg_xact_commit_timestamp`, see `harness::checker`): tokens never decrease, and no write
//! commits below the fence of its time.
//!
//! The clients mix token sources and protocols, as applications would:
//! - 3 with the token in the startup packet (`options=-c fencing.token=N`, reconnecting when
//!   the token changes), each transaction one simple Query `BEGIN ...; INSERT; COMMIT`;
//! - 3 with the token from `SET fencing.token` (simple), the INSERT with the extended
//!   protocol, `BEGIN` and a lone `COMMIT` as simple queries;
//! - 4 with the token in a comment on the INSERT, the whole transaction pipelined with the
//!   extended protocol (`BEGIN`, INSERT and `COMMIT` in flight at once).
//!
//! [`checker_through_pgfence`] runs it under READ COMMITTED, REPEATABLE READ and SERIALIZABLE
//! (no violation allowed; stale writes must be rejected; 40001 is an acceptable outcome),
//! then through a pgfence with `fence.enabled = false`, where the checker must report
//! violations (it is not blind). The figures are printed for the record.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use harness::checker::{advance_leader_until, Level};
use harness::checker::{check_database, InvariantReport, COMMIT_US_SQL};
use harness::fence::install;
use harness::{quote_conn_value, PgCluster, Proxy};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_postgres::{Client, Statement};

const RESOURCE: &str = "billing";
/// Wall time of one run.
const RUN_FOR: Duration = Duration::from_secs(3);

/// How a client presents its token and talks to pgfence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Startup `options`, one simple Query per transaction.
    StartupSimple,
    /// `SET fencing.token`, extended INSERT, simple BEGIN and COMMIT.
    SetExtended,
    /// A comment on the INSERT, BEGIN/INSERT/COMMIT pipelined, extended protocol.
    CommentPipelined,
}

impl Kind {
    fn index(self) -> usize {
        match self {
            Kind::StartupSimple => 0,
            Kind::SetExtended => 1,
            Kind::CommentPipelined => 2,
        }
    }
}

const CLIENTS: [Kind; 10] = [
    Kind::StartupSimple,
    Kind::StartupSimple,
    Kind::StartupSimple,
    Kind::SetExtended,
    Kind::SetExtended,
    Kind::SetExtended,
    Kind::CommentPipelined,
    Kind::CommentPipelined,
    Kind::CommentPipelined,
    Kind::CommentPipelined,
];

#[derive(Debug, Default)]
struct Counts {
    transactions: AtomicU64,
    commits: AtomicU64,
    rejections: AtomicU64,
    serialization_failures: AtomicU64,
    deadlocks: AtomicU64,
    reconnects: AtomicU64,
    /// Commits and FN001 rejections by client kind (index [`Kind::index`]), to show that
    /// every token source and protocol was exercised.
    by_kind: [(AtomicU64, AtomicU64); 3],
}

/// What the clients of one run share.
struct Run {
    level: Level,
    fenced: bool,
    connstr: String,
    /// The current leader's token, advanced at random moments by a separate task.
    leader: AtomicI64,
    counts: Counts,
    deadline: Instant,
}

/// One client's connection and what it last told the server about its token.
struct Conn {
    client: Client,
    /// The token the session carries (startup option or SET), if any.
    session_token: Option<i64>,
    /// BEGIN, COMMIT and the INSERT with the comment of `.2`'s token, prepared
    /// ([`Kind::CommentPipelined`]): executions of prepared statements are sent in the order
    /// they are first polled, so a pipeline keeps its order.
    pipeline: Option<(Statement, Statement, i64, Statement)>,
}

async fn connect(run: &Run, kind: Kind, token: i64) -> Conn {
    let connstr = match kind {
        Kind::StartupSimple => format!(
            "{} options={}",
            run.connstr,
            quote_conn_value(&format!(
                "-c fencing.resource={RESOURCE} -c fencing.token={token}"
            ))
        ),
        Kind::SetExtended => format!(
            "{} options={}",
            run.connstr,
            quote_conn_value(&format!("-c fencing.resource={RESOURCE}"))
        ),
        Kind::CommentPipelined => run.connstr.clone(),
    };
    let client = harness::connect_to(&connstr).await;
    Conn {
        client,
        session_token: (kind == Kind::StartupSimple).then_some(token),
        pipeline: None,
    }
}

/// One write transaction with `token`; the row records the token.
async fn transaction(
    conn: &mut Conn,
    kind: Kind,
    run: &Run,
    id: i32,
    token: i64,
) -> Result<(), tokio_postgres::Error> {
    let insert = format!(
        "INSERT INTO writes (resource, client, token) VALUES ('{RESOURCE}', {id}, {token})"
    );
    let begin = run.level.begin();
    match kind {
        Kind::StartupSimple => {
            conn.client
                .batch_execute(&format!("{begin}; {insert}; COMMIT"))
                .await
        }
        Kind::SetExtended => {
            if conn.session_token != Some(token) {
                conn.client
                    .batch_execute(&format!("SET fencing.token = {token}"))
                    .await?;
                conn.session_token = Some(token);
            }
            conn.client.batch_execute(begin).await?;
            conn.client.execute(insert.as_str(), &[]).await?;
            conn.client.batch_execute("COMMIT").await
        }
        Kind::CommentPipelined => {
            // The INSERT's text carries the token: prepared again when the token changes.
            let insert = format!(
                "/* fencing_token={token} fencing_resource={RESOURCE} */ INSERT INTO writes \
                 (resource, client, token) VALUES ('{RESOURCE}', {id}, {token})"
            );
            if conn.pipeline.as_ref().map(|p| p.2) != Some(token) {
                let (b, c) = match conn.pipeline.take() {
                    Some((b, c, ..)) => (b, c),
                    None => (
                        conn.client.prepare(begin).await?,
                        conn.client.prepare("COMMIT").await?,
                    ),
                };
                let i = conn.client.prepare(&insert).await?;
                conn.pipeline = Some((b, c, token, i));
            }
            let (b, c, _, i) = conn.pipeline.as_ref().expect("prepared above");
            let (rb, ri, rc) = tokio::join!(
                conn.client.execute(b, &[]),
                conn.client.execute(i, &[]),
                conn.client.execute(c, &[]),
            );
            rb?;
            ri?;
            rc.map(|_| ())
        }
    }
}

async fn client_loop(kind: Kind, id: i32, run: Arc<Run>) {
    let mut rng = StdRng::from_entropy();
    let mut token = run.leader.load(Ordering::SeqCst);
    let mut conn = connect(&run, kind, token).await;
    let mut paused_for = 0u32;
    while Instant::now() < run.deadline {
        if paused_for > 0 {
            paused_for -= 1;
        } else {
            token = run.leader.load(Ordering::SeqCst);
            if rng.gen_ratio(1, 30) {
                // A leader that pauses keeps writing with the token it had.
                paused_for = rng.gen_range(5..40);
            }
        }
        if kind == Kind::StartupSimple && conn.session_token != Some(token) {
            conn = connect(&run, kind, token).await;
            run.counts.reconnects.fetch_add(1, Ordering::Relaxed);
        }
        if rng.gen_ratio(1, 10) {
            tokio::time::sleep(Duration::from_micros(rng.gen_range(0..3000))).await;
        }
        run.counts.transactions.fetch_add(1, Ordering::Relaxed);
        let result = transaction(&mut conn, kind, &run, id, token).await;
        let counts = &run.counts;
        let counter = match &result {
            Ok(()) => &counts.commits,
            Err(e) => match e.code().map(|c| c.code()) {
                Some("FN001") if run.fenced => &counts.rejections,
                Some("40001") => &counts.serialization_failures,
                Some("40P01") => &counts.deadlocks,
                _ => panic!(
                    "client {id} ({kind:?}), token {token}, {:?}: unexpected error {e:?}",
                    run.level
                ),
            },
        };
        counter.fetch_add(1, Ordering::Relaxed);
        let (commits, rejections) = &counts.by_kind[kind.index()];
        match &result {
            Ok(()) => commits.fetch_add(1, Ordering::Relaxed),
            Err(e) if e.code().map(|c| c.code()) == Some("FN001") => {
                rejections.fetch_add(1, Ordering::Relaxed)
            }
            Err(_) => 0,
        };
        if result.is_err() {
            // A write rejected inside the block leaves it failed, as any failed statement
            // does; after a rejected COMMIT this only warns.
            conn.client
                .batch_execute("ROLLBACK")
                .await
                .unwrap_or_else(|e| panic!("client {id}: ROLLBACK after an error: {e:?}"));
        }
    }
}

/// The figures of one run.
struct Figures {
    level: Level,
    fenced: bool,
    transactions: u64,
    commits: u64,
    rejections: u64,
    serialization_failures: u64,
    deadlocks: u64,
    reconnects: u64,
    /// (commits, rejections) by client kind.
    by_kind: [(u64, u64); 3],
    advances: i64,
    report: InvariantReport,
}

impl Figures {
    fn print(&self) {
        eprintln!(
            "fence_concurrency: {:?}, fence {}: {} clients, {} transactions, {} commits, {} \
             leader advances, {} FN001 rejections, {} 40001, {} deadlocks, {} reconnects; \
             (commits, rejections) by startup/SET/comment client: {:?}; {}",
            self.level,
            if self.fenced { "on" } else { "off" },
            CLIENTS.len(),
            self.transactions,
            self.commits,
            self.advances,
            self.rejections,
            self.serialization_failures,
            self.deadlocks,
            self.reconnects,
            self.by_kind,
            self.report
        );
    }
}

async fn run_workload(cluster: &PgCluster, level: Level, fenced: bool) -> Figures {
    let db = format!("conc_{level:?}_{}", if fenced { "on" } else { "off" }).to_lowercase();
    cluster.psql("postgres", &format!("CREATE DATABASE {db}"));
    let admin = cluster.connect(&db).await;
    install(&admin).await;
    admin
        .batch_execute(
            "CREATE TABLE writes (id bigserial PRIMARY KEY, resource text NOT NULL, \
             client integer NOT NULL, token bigint NOT NULL)",
        )
        .await
        .unwrap();
    let mut config = Proxy::config_for(cluster);
    config.fence.enabled = fenced;
    let proxy = Proxy::start(config);

    let run = Arc::new(Run {
        level,
        fenced,
        connstr: proxy.connstr(&db),
        leader: AtomicI64::new(1),
        counts: Counts::default(),
        deadline: Instant::now() + RUN_FOR,
    });
    let advancer = {
        let run = run.clone();
        tokio::spawn(async move { advance_leader_until(&run.leader, run.deadline).await })
    };
    let tasks: Vec<_> = CLIENTS
        .iter()
        .zip(0..)
        .map(|(&kind, id)| tokio::spawn(client_loop(kind, id, run.clone())))
        .collect();
    for task in tasks {
        task.await.expect("a client task panicked");
    }
    advancer.await.unwrap();
    drop(proxy);

    let writes_sql = format!("SELECT resource, token, {COMMIT_US_SQL} FROM writes");
    let report = check_database(&admin, &writes_sql)
        .await
        .expect("load committed writes");
    let rows: i64 = admin
        .query_one("SELECT count(*) FROM writes", &[])
        .await
        .unwrap()
        .get(0);
    let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let c = &run.counts;
    assert_eq!(
        rows as u64,
        n(&c.commits),
        "{level:?}: committed rows vs commits"
    );
    assert_eq!(
        report.missing_commit_ts, 0,
        "track_commit_timestamp must be on"
    );
    let figures = Figures {
        level,
        fenced,
        transactions: n(&c.transactions),
        commits: n(&c.commits),
        rejections: n(&c.rejections),
        serialization_failures: n(&c.serialization_failures),
        deadlocks: n(&c.deadlocks),
        reconnects: n(&c.reconnects),
        by_kind: [0, 1, 2].map(|k| (n(&c.by_kind[k].0), n(&c.by_kind[k].1))),
        advances: run.leader.load(Ordering::SeqCst) - 1,
        report,
    };
    figures.print();
    figures
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checker_through_pgfence() {
    let cluster = PgCluster::start();
    for level in [
        Level::ReadCommitted,
        Level::RepeatableRead,
        Level::Serializable,
    ] {
        let f = run_workload(&cluster, level, true).await;
        assert_eq!(f.report.violations(), 0, "{level:?}: {}", f.report);
        assert_eq!(f.deadlocks, 0, "{level:?}: deadlocks");
        assert!(
            f.commits > 100,
            "{level:?}: too few commits ({})",
            f.commits
        );
        assert!(f.rejections > 0, "{level:?}: no stale write was rejected");
        for (kind, (commits, rejections)) in f.by_kind.iter().enumerate() {
            assert!(
                *commits > 0 && *rejections > 0,
                "{level:?}: client kind {kind} made {commits} commits, {rejections} rejections"
            );
        }
        assert!(
            f.report.advances > 10,
            "{level:?}: the fence hardly moved: {}",
            f.report
        );
    }
    // The same workload through pgfence with the fence off: the checker must see it.
    let f = run_workload(&cluster, Level::ReadCommitted, false).await;
    assert!(
        f.report.violations() > 0,
        "without the fence the checker found no violation: it is blind ({})",
        f.report
    );
}
