//! `pgfence.check` directly against PostgreSQL, without the proxy.
//!
//! - [`check_function_outcomes_locks_and_privileges`]: every row of SPEC section 4's outcome
//!   table, the exact FN001/FN002/FN003 texts, the lock behaviour of each race (same-token
//!   transactions do not wait for each other, an advance waits for them, the first-insert race,
//!   REPEATABLE READ / SERIALIZABLE snapshots), `fast_reject`, privileges and re-installation.
//! - [`concurrent_checker`]: 8 clients writing with a leader token that a separate task
//!   advances at random moments (some clients keep an old token for a while, like a paused
//!   leader), under READ COMMITTED, REPEATABLE READ and SERIALIZABLE, with the check pipelined
//!   with COMMIT as the proxy sends it; then the invariant checker over what was committed.
//!   The same workload without the check must make the checker report violations.
//! - [`the_read_audit_finds_each_way_a_read_calls_a_function`]: the schema audit behind
//!   `fence.read_audit`, with and without its event trigger, and
//!   [`the_read_audit_verdict_under_concurrent_ddl`]: its locking.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fence_core::sql::{install_sql, CHECK_SQL, SCHEMA_VERSION};
use harness::checker::{advance_leader_until, Level};
use harness::PgCluster;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio_postgres::error::DbError;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

use harness::checker::{check_database, InvariantReport, COMMIT_US_SQL};

const CLIENTS: usize = 8;
/// Wall time of one workload run; four runs keep the test well under 30 s.
const RUN_FOR: Duration = Duration::from_secs(4);
/// Bound on one client's transactions in a run, should the machine be fast.
const MAX_TXNS_PER_CLIENT: u64 = 20_000;
/// How long a lock wait is given to show that it really waits.
const BLOCKED_FOR: Duration = Duration::from_millis(300);

const WRITES_TABLE: &str = "CREATE TABLE writes (
    id bigserial PRIMARY KEY,
    resource text NOT NULL,
    client integer NOT NULL,
    token bigint NOT NULL
)";

// ---------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------

/// Creates database `db` with the pgfence schema (installed twice: it must be idempotent)
/// and the `writes` table; returns a superuser client on it.
async fn fresh_database(cluster: &PgCluster, db: &str) -> Client {
    cluster.psql("postgres", &format!("CREATE DATABASE {db}"));
    let client = cluster.connect(db).await;
    let sql = install_sql(None);
    client
        .batch_execute(&sql)
        .await
        .expect("install the pgfence schema");
    client
        .batch_execute(&sql)
        .await
        .expect("install the pgfence schema a second time");
    client
        .batch_execute(WRITES_TABLE)
        .await
        .expect("create the writes table");
    client
}

/// The check's call as the tests make it: one directive per (resource, token) pair.
async fn check(
    client: &Client,
    resources: &[Option<&str>],
    tokens: &[Option<&str>],
    default_resource: Option<&str>,
    force: bool,
) -> Result<Option<String>, tokio_postgres::Error> {
    let allow: Vec<String> = vec!["relaxed".into()];
    let row = client
        .query_one(
            CHECK_SQL,
            &[
                &resources,
                &tokens,
                &default_resource,
                &allow,
                &"tests",
                &force,
            ],
        )
        .await?;
    Ok(row.get(0))
}

/// `BEGIN`, one row into `writes`, so the transaction has written.
async fn begin_write(client: &Client, begin: &str) {
    client.batch_execute(begin).await.expect("begin");
    client
        .execute(
            "INSERT INTO writes (resource, client, token) VALUES ('x', 0, 0)",
            &[],
        )
        .await
        .expect("insert");
}

fn db_error(result: Result<Option<String>, tokio_postgres::Error>) -> DbError {
    match result {
        Ok(v) => panic!("expected an error, the check returned {v:?}"),
        Err(e) => e
            .as_db_error()
            .unwrap_or_else(|| panic!("not a server error: {e:?}"))
            .clone(),
    }
}

fn assert_error(e: &DbError, code: &str, message: &str, detail: &str, hint: &str) {
    assert_eq!(e.code().code(), code, "{e:?}");
    assert_eq!(e.message(), message);
    assert_eq!(e.detail(), Some(detail));
    assert_eq!(e.hint(), Some(hint));
}

fn assert_stale(e: &DbError, r: &str, t: i64, f: i64) {
    assert_error(
        e,
        "FN001",
        &format!("stale fencing token {t} for resource \"{r}\": token {f} was already accepted"),
        &format!(
            "A newer holder of the lease on \"{r}\" has written with token {f}. This transaction \
             was rolled back and none of its writes were applied."
        ),
        &format!(
            "This client is no longer the leader for \"{r}\": stop writing, and re-acquire the \
             lease to get a new token."
        ),
    );
}

const FN003_DETAIL: &str = "This transaction was rolled back.";
const FN003_HINT: &str = "Fencing tokens are integers from 0 to 9223372036854775807; resources \
                          are 1 to 63 characters from [A-Za-z0-9_.:-].";

fn assert_invalid(e: &DbError, message: &str) {
    assert_error(e, "FN003", message, FN003_DETAIL, FN003_HINT);
}

async fn fence_of(client: &Client, resource: &str) -> Option<i64> {
    client
        .query_opt(
            "SELECT token FROM pgfence.fences WHERE resource = $1",
            &[&resource],
        )
        .await
        .expect("read the fence")
        .map(|row| row.get(0))
}

// ---------------------------------------------------------------------------------------
// Outcomes, texts, locks, privileges
// ---------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread")]
async fn check_function_outcomes_locks_and_privileges() {
    let cluster = PgCluster::start();
    let a = fresh_database(&cluster, "fence_unit").await;
    let b = cluster.connect("fence_unit").await;
    let c = cluster.connect("fence_unit").await;
    let billing = [Some("billing")];

    // A transaction that did not write is not checked (unless forced).
    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        check(&a, &billing, &[Some("1")], None, false)
            .await
            .unwrap(),
        None
    );
    assert_eq!(fence_of(&a, "billing").await, None);
    a.batch_execute("ROLLBACK").await.unwrap();

    // No fence row: created, accepted, recorded.
    begin_write(&a, "BEGIN").await;
    assert_eq!(
        check(&a, &billing, &[Some("5")], None, false)
            .await
            .unwrap()
            .as_deref(),
        Some("billing=5")
    );
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fence_of(&a, "billing").await, Some(5));

    // Equal: accepted. Higher: advanced. Lower: FN001.
    begin_write(&a, "BEGIN").await;
    assert_eq!(
        check(&a, &billing, &[Some("5")], None, false)
            .await
            .unwrap()
            .as_deref(),
        Some("billing=5")
    );
    a.batch_execute("COMMIT").await.unwrap();
    begin_write(&a, "BEGIN").await;
    assert_eq!(
        check(&a, &billing, &[Some("0007")], None, false)
            .await
            .unwrap()
            .as_deref(),
        Some("billing=7")
    );
    a.batch_execute("COMMIT").await.unwrap();
    begin_write(&a, "BEGIN").await;
    assert_stale(
        &db_error(check(&a, &billing, &[Some("6")], None, false).await),
        "billing",
        6,
        7,
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    assert_eq!(fence_of(&a, "billing").await, Some(7));
    let history: Vec<(Option<i64>, i64, String, String)> = a
        .query(
            "SELECT previous_token, new_token, db_user, client_addr FROM pgfence.history \
             WHERE resource = 'billing' ORDER BY id",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3)))
        .collect();
    let who = ("postgres".to_string(), "tests".to_string());
    assert_eq!(
        history,
        vec![
            (None, 5, who.0.clone(), who.1.clone()),
            (Some(5), 7, who.0, who.1)
        ]
    );

    // Missing token: FN002, unless the resource allows it.
    begin_write(&a, "BEGIN").await;
    let e = db_error(check(&a, &billing, &[None], None, false).await);
    assert_error(
        &e,
        "FN002",
        "missing fencing token for resource \"billing\": the transaction wrote without a token",
        "Resource \"billing\" requires a fencing token on every write transaction. This \
         transaction was rolled back.",
        "Set fencing.token (options=-c fencing.token=N, or SET fencing.token = N), or add /* \
         fencing_token=N */ to a statement of the transaction.",
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    begin_write(&a, "BEGIN").await;
    assert_eq!(
        check(&a, &[Some("relaxed")], &[None], None, false)
            .await
            .unwrap(),
        None
    );
    a.batch_execute("ROLLBACK").await.unwrap();

    // Invalid tokens and resources, conflicts, tokens without a resource: FN003.
    let long = "9".repeat(100);
    for (token, shown) in [
        ("9223372036854775808", "9223372036854775808"),
        ("-1", "-1"),
        (" 7", " 7"),
        ("", ""),
        (long.as_str(), &long[..64]),
    ] {
        begin_write(&a, "BEGIN").await;
        let e = db_error(check(&a, &billing, &[Some(token)], None, false).await);
        assert_invalid(
            &e,
            &format!(
                "invalid fencing token \"{shown}\" for resource \"billing\": expected an integer \
                 from 0 to 9223372036854775807"
            ),
        );
        a.batch_execute("ROLLBACK").await.unwrap();
    }
    let long = "r".repeat(64);
    for resource in ["", "bill ing", "billing\n", "bïlling", long.as_str()] {
        begin_write(&a, "BEGIN").await;
        let e = db_error(check(&a, &[Some(resource)], &[Some("1")], None, false).await);
        assert_invalid(
            &e,
            &format!(
                "invalid fencing resource \"{resource}\": expected 1 to 63 characters from \
                 [A-Za-z0-9_.:-]"
            ),
        );
        a.batch_execute("ROLLBACK").await.unwrap();
    }
    begin_write(&a, "BEGIN").await;
    let e = db_error(
        check(
            &a,
            &[Some("billing"), None],
            &[Some("7"), Some("8")],
            Some("billing"),
            false,
        )
        .await,
    );
    assert_error(
        &e,
        "FN003",
        "conflicting fencing tokens 7 and 8 for resource \"billing\" in one transaction",
        FN003_DETAIL,
        "A transaction belongs to one leader: use one token per resource.",
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    begin_write(&a, "BEGIN").await;
    let e = db_error(check(&a, &[None], &[Some("7")], None, false).await);
    assert_invalid(
        &e,
        "fencing token 7 has no resource: set fencing.resource or add fencing_resource to the \
         comment",
    );
    a.batch_execute("ROLLBACK").await.unwrap();

    // Session settings, the default resource, several resources (sorted result).
    begin_write(
        &a,
        "BEGIN; SET LOCAL fencing.token = 7; SET LOCAL fencing.resource = 'billing'",
    )
    .await;
    assert_eq!(
        check(&a, &[], &[], None, false).await.unwrap().as_deref(),
        Some("billing=7")
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    begin_write(&a, "BEGIN; SET LOCAL fencing.token = 7").await;
    assert_eq!(
        check(
            &a,
            &[Some("zeta"), Some("alpha")],
            &[None, Some("3")],
            Some("billing"),
            false
        )
        .await
        .unwrap()
        .as_deref(),
        Some("alpha=3,billing=7,zeta=7")
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    begin_write(&a, "BEGIN").await;
    assert_eq!(
        check(&a, &[], &[], None, false).await.unwrap(),
        None,
        "unfenced session"
    );
    a.batch_execute("ROLLBACK").await.unwrap();
    a.batch_execute("BEGIN").await.unwrap();
    assert_eq!(
        check(&a, &billing, &[Some("7")], None, true)
            .await
            .unwrap()
            .as_deref(),
        Some("billing=7"),
        "forced check of a transaction that did not write"
    );
    a.batch_execute("ROLLBACK").await.unwrap();

    // Same-token transactions share the fence; an advance waits until they end.
    begin_write(&a, "BEGIN").await;
    check(&a, &billing, &[Some("7")], None, false)
        .await
        .unwrap();
    begin_write(&b, "BEGIN").await;
    let same = tokio::time::timeout(
        Duration::from_secs(5),
        check(&b, &billing, &[Some("7")], None, false),
    );
    assert_eq!(
        same.await
            .expect("a same-token transaction must not wait")
            .unwrap()
            .as_deref(),
        Some("billing=7")
    );
    begin_write(&c, "BEGIN").await;
    let advance = check(&c, &billing, &[Some("8")], None, false);
    tokio::pin!(advance);
    assert!(
        tokio::time::timeout(BLOCKED_FOR, &mut advance)
            .await
            .is_err(),
        "an advance must wait for the in-flight transactions holding the old token"
    );
    a.batch_execute("COMMIT").await.unwrap();
    assert!(tokio::time::timeout(BLOCKED_FOR, &mut advance)
        .await
        .is_err());
    b.batch_execute("COMMIT").await.unwrap();
    assert_eq!(advance.await.unwrap().as_deref(), Some("billing=8"));
    // ... and while the advance is uncommitted, the old token waits, then is rejected.
    begin_write(&a, "BEGIN").await;
    let old = check(&a, &billing, &[Some("7")], None, false);
    tokio::pin!(old);
    assert!(tokio::time::timeout(BLOCKED_FOR, &mut old).await.is_err());
    c.batch_execute("COMMIT").await.unwrap();
    assert_stale(&db_error(old.await), "billing", 7, 8);
    a.batch_execute("ROLLBACK").await.unwrap();

    // Two advancers: the second one re-reads under its lock.
    begin_write(&a, "BEGIN").await;
    check(&a, &billing, &[Some("10")], None, false)
        .await
        .unwrap();
    begin_write(&b, "BEGIN").await;
    let second = check(&b, &billing, &[Some("9")], None, false);
    tokio::pin!(second);
    assert!(tokio::time::timeout(BLOCKED_FOR, &mut second)
        .await
        .is_err());
    a.batch_execute("COMMIT").await.unwrap();
    assert_stale(&db_error(second.await), "billing", 9, 10);
    b.batch_execute("ROLLBACK").await.unwrap();

    // First-insert race: the loser waits for the winner, then takes the locked path.
    begin_write(&a, "BEGIN").await;
    check(&a, &[Some("orders")], &[Some("1")], None, false)
        .await
        .unwrap();
    begin_write(&b, "BEGIN").await;
    let loser = check(&b, &[Some("orders")], &[Some("2")], None, false);
    tokio::pin!(loser);
    assert!(tokio::time::timeout(BLOCKED_FOR, &mut loser).await.is_err());
    a.batch_execute("COMMIT").await.unwrap();
    assert_eq!(loser.await.unwrap().as_deref(), Some("orders=2"));
    b.batch_execute("COMMIT").await.unwrap();
    assert_eq!(fence_of(&a, "orders").await, Some(2));

    // REPEATABLE READ / SERIALIZABLE: an advance committed after the snapshot is never
    // missed, whether this transaction's token is the old fence or newer than it.
    for (level, offset) in [
        ("REPEATABLE READ", 0),
        ("REPEATABLE READ", 1),
        ("SERIALIZABLE", 0),
        ("SERIALIZABLE", 1),
    ] {
        let before = fence_of(&a, "billing").await.unwrap();
        let token = (before + offset).to_string();
        let token = token.as_str();
        begin_write(&a, &format!("BEGIN ISOLATION LEVEL {level}")).await;
        a.query("SELECT * FROM pgfence.fences", &[]).await.unwrap(); // the snapshot
        begin_write(&b, "BEGIN").await;
        let newer = (before + 2).to_string();
        check(&b, &billing, &[Some(newer.as_str())], None, false)
            .await
            .unwrap();
        b.batch_execute("COMMIT").await.unwrap();
        let e = db_error(check(&a, &billing, &[Some(token)], None, false).await);
        assert!(
            e.code().code() == "40001" || e.code().code() == "FN001",
            "{level}, token {token}: {e:?}"
        );
        a.batch_execute("ROLLBACK").await.unwrap();
    }
    // The first-insert race under REPEATABLE READ: 40001, not a second "first" token.
    begin_write(&a, "BEGIN ISOLATION LEVEL REPEATABLE READ").await;
    begin_write(&b, "BEGIN").await;
    check(&b, &[Some("invoices")], &[Some("5")], None, false)
        .await
        .unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    let e = db_error(check(&a, &[Some("invoices")], &[Some("4")], None, false).await);
    assert_eq!(e.code().code(), "40001", "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();

    // The fast path's function never accepts: FN001 with the highest known fence.
    let fence = fence_of(&a, "billing").await.unwrap();
    for known in [1, fence + 5] {
        let e = a
            .query_one("SELECT pgfence.fast_reject('billing', 2, $1)", &[&known])
            .await
            .unwrap_err();
        assert_stale(e.as_db_error().unwrap(), "billing", 2, known.max(fence));
    }
    let mut literal = Vec::new();
    fence_core::sql::fast_reject_literal("billing", 3, fence, &mut literal);
    let e = a
        .batch_execute(std::str::from_utf8(&literal).unwrap())
        .await
        .unwrap_err();
    assert_stale(e.as_db_error().unwrap(), "billing", 3, fence);

    // The literal form of the check (simple protocol), under both string syntaxes.
    let directives = [fence_core::directive::Directive {
        resource: Some(b"billing".to_vec()),
        token: Some(fence.to_string().into_bytes()),
    }];
    let args = fence_core::sql::CheckArgs {
        directives: &directives,
        default_resource: Some("lit.default"),
        allow_missing: &["it's\\".to_string(), "lit.default".to_string()],
        client: "127.0.0.1:1",
        force: true,
    };
    let mut literal = Vec::new();
    fence_core::sql::check_call_literal(&args, &mut literal);
    for scs in ["on", "off"] {
        a.batch_execute(&format!("SET standard_conforming_strings = {scs}"))
            .await
            .unwrap();
        let row = a
            .query_one(std::str::from_utf8(&literal).unwrap(), &[])
            .await
            .unwrap();
        assert_eq!(
            row.get::<_, Option<String>>(0),
            Some(format!("billing={fence}"))
        );
    }

    // Privileges: a role with EXECUTE only cannot touch the fences, but can be fenced.
    a.batch_execute(
        "CREATE ROLE fence_app LOGIN; GRANT ALL ON TABLE writes TO fence_app; \
         GRANT ALL ON SEQUENCE writes_id_seq TO fence_app",
    )
    .await
    .unwrap();
    a.batch_execute(&install_sql(Some("fence_app")))
        .await
        .unwrap();
    let app = harness::connect_to(&cluster.connstr_as("fence_unit", "fence_app", None)).await;
    for sql in [
        "UPDATE pgfence.fences SET token = 0",
        "DELETE FROM pgfence.fences",
        "INSERT INTO pgfence.fences VALUES ('x', 1, now())",
        "TRUNCATE pgfence.fences",
        "SELECT * FROM pgfence.fences FOR SHARE",
        "INSERT INTO pgfence.history (resource, new_token) VALUES ('x', 1)",
        "SELECT pgfence.raise_stale('billing', 1, 2)",
    ] {
        let e = app.batch_execute(sql).await.unwrap_err();
        assert_eq!(
            e.as_db_error().map(|e| e.code().code()),
            Some("42501"),
            "{sql}: {e:?}"
        );
    }
    app.query("SELECT * FROM pgfence.fences", &[])
        .await
        .expect("SELECT is granted");
    begin_write(&app, "BEGIN").await;
    let next = (fence + 1).to_string();
    assert_eq!(
        check(&app, &billing, &[Some(next.as_str())], None, false)
            .await
            .unwrap(),
        Some(format!("billing={next}"))
    );
    app.batch_execute("COMMIT").await.unwrap();
    // Not even the owner lowers a fence or deletes one by accident.
    for sql in [
        "UPDATE pgfence.fences SET token = 0",
        "DELETE FROM pgfence.fences",
    ] {
        a.batch_execute(sql).await.expect_err(sql);
    }

    // Re-installing keeps the fences; a schema from a newer pgfence is never downgraded.
    a.batch_execute(&install_sql(None)).await.unwrap();
    assert_eq!(fence_of(&a, "billing").await, Some(fence + 1));
    let version: i32 = a
        .query_one("SELECT version FROM pgfence.schema_version", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, SCHEMA_VERSION);
    a.batch_execute("UPDATE pgfence.schema_version SET version = version + 1")
        .await
        .unwrap();
    let e = a.batch_execute(&install_sql(None)).await.unwrap_err();
    let message = e.as_db_error().map(DbError::message).unwrap_or_default();
    assert!(message.contains("is installed"), "{e:?}");
    a.batch_execute("ROLLBACK").await.unwrap();
}

// ---------------------------------------------------------------------------------------
// The concurrent checker
// ---------------------------------------------------------------------------------------

/// Whether the workload runs `pgfence.check` before each COMMIT.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fencing {
    Checked,
    Unchecked,
}

/// What happened to the transactions of one run.
#[derive(Debug, Default)]
struct Counts {
    transactions: AtomicU64,
    commits: AtomicU64,
    rejections: AtomicU64,
    serialization_failures: AtomicU64,
    deadlocks: AtomicU64,
}

#[derive(Debug)]
struct RunResult {
    level: Level,
    fencing: Fencing,
    counts: Counts,
    leader_advances: i64,
    report: InvariantReport,
}

impl RunResult {
    fn print(&self) {
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        eprintln!(
            "fence_sql checker: {:?}, {:?}: {CLIENTS} clients, {} transactions, {} commits, \
             {} leader advances, {} FN001 rejections, {} 40001, {} deadlocks; {}",
            self.level,
            self.fencing,
            n(&self.counts.transactions),
            n(&self.counts.commits),
            self.leader_advances,
            n(&self.counts.rejections),
            n(&self.counts.serialization_failures),
            n(&self.counts.deadlocks),
            self.report,
        );
    }
}

struct Statements {
    insert: Statement,
    check: Statement,
}

/// One write transaction; with [`Fencing::Checked`], the check and the COMMIT are sent
/// pipelined (both requests are written before the check's reply is read), as the proxy
/// does. If the check fails the server turns the COMMIT into a ROLLBACK.
async fn write_transaction(
    client: &Client,
    stmts: &Statements,
    level: Level,
    fencing: Fencing,
    (resource, client_id, token): (&str, i32, i64),
) -> Result<(), tokio_postgres::Error> {
    client.batch_execute(level.begin()).await?;
    let result = async {
        client
            .execute(&stmts.insert, &[&resource, &client_id, &token])
            .await?;
        match fencing {
            Fencing::Checked => {
                let resources: &[&str] = &[resource];
                let tokens: &[String] = &[token.to_string()];
                let allow: &[&str] = &[];
                let params: [&(dyn ToSql + Sync); 6] = [
                    &resources,
                    &tokens,
                    &None::<&str>,
                    &allow,
                    &"checker",
                    &false,
                ];
                let check = client.query_one(&stmts.check, &params);
                let commit = client.batch_execute("COMMIT");
                let (check, commit) = tokio::join!(check, commit);
                check?;
                commit
            }
            Fencing::Unchecked => client.batch_execute("COMMIT").await,
        }
    }
    .await;
    if result.is_err() {
        // Only needed when BEGIN or the INSERT failed; harmless (a warning) otherwise.
        client.batch_execute("ROLLBACK").await?;
    }
    result
}

/// What the clients of one run share.
struct Run {
    resource: String,
    level: Level,
    fencing: Fencing,
    /// The current leader's token, advanced at random moments by a separate task.
    leader: AtomicI64,
    counts: Counts,
    deadline: Instant,
}

/// One client: writes with the leader's current token, or, now and then, like a leader
/// that paused, keeps writing with the token it had for a number of transactions.
async fn client_loop(client: Client, client_id: i32, run: Arc<Run>) {
    let stmts = Statements {
        insert: client
            .prepare("INSERT INTO writes (resource, client, token) VALUES ($1, $2, $3)")
            .await
            .unwrap(),
        check: client.prepare(CHECK_SQL).await.unwrap(),
    };
    let mut rng = StdRng::from_entropy();
    let mut paused: Option<(i64, u32)> = None; // (token kept, transactions left)
    for _ in 0..MAX_TXNS_PER_CLIENT {
        if Instant::now() >= run.deadline {
            break;
        }
        let token = match paused {
            Some((token, left)) if left > 0 => {
                paused = Some((token, left - 1));
                token
            }
            _ => {
                let token = run.leader.load(Ordering::SeqCst);
                paused = rng.gen_ratio(1, 30).then(|| (token, rng.gen_range(5..40)));
                token
            }
        };
        if rng.gen_ratio(1, 10) {
            // A short stall between learning the token and writing.
            tokio::time::sleep(Duration::from_micros(rng.gen_range(0..3000))).await;
        }
        let counts = &run.counts;
        counts.transactions.fetch_add(1, Ordering::Relaxed);
        let txn = (run.resource.as_str(), client_id, token);
        let result = write_transaction(&client, &stmts, run.level, run.fencing, txn).await;
        let counter = match &result {
            Ok(()) => &counts.commits,
            Err(e) => match e.code().map(|c| c.code()) {
                Some("FN001") => &counts.rejections,
                Some("40001") => &counts.serialization_failures,
                Some("40P01") => &counts.deadlocks,
                _ => panic!(
                    "client {client_id}, token {token}, {:?}: unexpected error {e:?}",
                    run.level
                ),
            },
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}

/// Runs the workload in a database of its own and checks the invariant over the result.
async fn run_workload(cluster: &PgCluster, level: Level, fencing: Fencing) -> RunResult {
    let db = format!("checker_{level:?}_{fencing:?}").to_lowercase();
    let admin = fresh_database(cluster, &db).await;
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(cluster.connect(&db).await);
    }
    let run = Arc::new(Run {
        resource: "billing".to_string(),
        level,
        fencing,
        leader: AtomicI64::new(1),
        counts: Counts::default(),
        deadline: Instant::now() + RUN_FOR,
    });

    let advancer = {
        let run = run.clone();
        tokio::spawn(async move { advance_leader_until(&run.leader, run.deadline).await })
    };
    let tasks: Vec<_> = clients
        .into_iter()
        .zip(0..)
        .map(|(client, id)| tokio::spawn(client_loop(client, id, run.clone())))
        .collect();
    for task in tasks {
        task.await.expect("a client task panicked");
    }
    advancer.await.unwrap();

    let writes_sql = format!("SELECT resource, token, {COMMIT_US_SQL} FROM writes");
    let report = check_database(&admin, &writes_sql)
        .await
        .expect("load committed writes");
    let committed: i64 = admin
        .query_one("SELECT count(*) FROM writes", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        committed as u64,
        run.counts.commits.load(Ordering::Relaxed),
        "commits vs rows"
    );
    assert_eq!(
        report.missing_commit_ts, 0,
        "track_commit_timestamp must be on"
    );
    let run = Arc::try_unwrap(run).ok().expect("all clients are done");
    let result = RunResult {
        level,
        fencing,
        leader_advances: run.leader.load(Ordering::SeqCst) - 1,
        counts: run.counts,
        report,
    };
    result.print();
    result
}

#[tokio::test(flavor = "multi_thread")]
async fn concurrent_checker() {
    let cluster = PgCluster::start();
    for level in [
        Level::ReadCommitted,
        Level::RepeatableRead,
        Level::Serializable,
    ] {
        let run = run_workload(&cluster, level, Fencing::Checked).await;
        let n = |c: &AtomicU64| c.load(Ordering::Relaxed);
        assert_eq!(run.report.violations(), 0, "{level:?}: {}", run.report);
        assert_eq!(n(&run.counts.deadlocks), 0, "{level:?}: deadlocks");
        assert!(
            n(&run.counts.commits) > 100,
            "{level:?}: too few commits: {run:?}"
        );
        assert!(
            n(&run.counts.rejections) > 0,
            "{level:?}: no stale token was ever rejected"
        );
        assert!(
            run.report.advances > 10,
            "{level:?}: the fence hardly moved: {run:?}"
        );
    }
    // A checker that cannot fail proves nothing: without the check, it must see violations.
    let run = run_workload(&cluster, Level::ReadCommitted, Fencing::Unchecked).await;
    assert!(
        run.report.violations() > 0,
        "the unchecked workload produced no violation: the checker is blind ({})",
        run.report
    );
}

/// `pgfence.reads_may_write()` and `pgfence.read_audit_objects()` (the proxy's read
/// audit): each way the schema lets a read call a function of the database's own is found,
/// the event trigger keeps the verdict as objects come and go, and without the trigger the
/// function audits the catalog itself.
#[tokio::test(flavor = "multi_thread")]
async fn the_read_audit_finds_each_way_a_read_calls_a_function() {
    let cluster = PgCluster::start();
    let client = fresh_database(&cluster, "audit").await;
    client
        .batch_execute(
            "CREATE TABLE a_t (x int);
             CREATE FUNCTION a_bool(i int, j int) RETURNS boolean LANGUAGE sql AS 'SELECT i > j';
             CREATE FUNCTION a_add(a int, b int) RETURNS int LANGUAGE sql AS 'SELECT a + b';
             CREATE FUNCTION a_cmp(a int, b int) RETURNS int LANGUAGE sql AS 'SELECT 0';
             CREATE FUNCTION a_imm(a int, b int) RETURNS int LANGUAGE sql IMMUTABLE AS 'SELECT a';
             CREATE TYPE a_e AS ENUM ('x');
             CREATE FUNCTION a_e_int(e a_e, m int, explicit boolean) RETURNS int
                 LANGUAGE sql AS 'SELECT 1';
             CREATE FUNCTION a_text(i int, j int) RETURNS text LANGUAGE sql AS 'SELECT i::text';
             CREATE TYPE a_range AS RANGE (subtype = float8);
             CREATE TEMP TABLE a_temp (x int CHECK (x > a_imm(1, 2)));
             CREATE MATERIALIZED VIEW a_mv AS SELECT a_text(1, 2) AS t;",
        )
        .await
        .unwrap();
    // Functions called by name (which the classifier sees), a range type's constructors,
    // a temporary table, a materialized view (reading it runs nothing): no way in.
    assert_eq!(read_verdict(&client).await, (false, false, vec![]));
    let ways = [
        (
            "CREATE VIEW a_v AS SELECT a_text(1, 2) AS t",
            "view public.a_v",
            "DROP VIEW a_v",
        ),
        (
            "CREATE VIEW a_lo AS SELECT pg_catalog.lo_create(0) AS o",
            "view public.a_lo",
            "DROP VIEW a_lo",
        ),
        (
            "CREATE VIEW a_msg AS SELECT pg_logical_emit_message(true, 'p', 'x') AS lsn",
            "view public.a_msg",
            "DROP VIEW a_msg",
        ),
        (
            // Takes a transaction id (and the sequence's change outlives a rollback).
            "CREATE SEQUENCE a_s; CREATE VIEW a_seq AS SELECT nextval('a_s') AS n",
            "view public.a_seq",
            "DROP VIEW a_seq; DROP SEQUENCE a_s",
        ),
        (
            "CREATE VIEW a_ts AS SELECT * FROM ts_stat('SELECT a_text(1, 2)::tsvector')",
            "view public.a_ts",
            "DROP VIEW a_ts",
        ),
        (
            "CREATE POLICY a_p ON a_t USING (a_bool(x, 0))",
            "row-level security policy a_p on public.a_t",
            "DROP POLICY a_p ON a_t",
        ),
        (
            "CREATE DOMAIN a_d AS int CHECK (a_bool(VALUE, 0))",
            "domain public.a_d",
            "DROP DOMAIN a_d",
        ),
        (
            "ALTER TABLE a_t ADD CONSTRAINT a_c CHECK (x > a_imm(1, 2))",
            "constraint a_c on public.a_t",
            "ALTER TABLE a_t DROP CONSTRAINT a_c",
        ),
        (
            "CREATE INDEX a_i ON a_t ((a_imm(x, 1)))",
            "index public.a_i",
            // Dropping an index is not audited: the next audited command lowers it.
            "DROP INDEX a_i; CREATE VIEW a_plain AS SELECT 1 AS one; DROP VIEW a_plain",
        ),
        (
            "CREATE OPERATOR ### (FUNCTION = a_add, LEFTARG = int, RIGHTARG = int)",
            "operator public.###(integer,integer)",
            "DROP OPERATOR ### (int, int)",
        ),
        (
            "CREATE OPERATOR ~~~ (FUNCTION = pg_catalog.lo_unlink, RIGHTARG = oid)",
            "operator public.~~~(NONE,oid)",
            "DROP OPERATOR ~~~ (NONE, oid)",
        ),
        (
            "CREATE CAST (a_e AS int) WITH FUNCTION a_e_int(a_e, int, boolean)",
            "cast public.a_e AS integer",
            "DROP CAST (a_e AS int)",
        ),
        (
            "CREATE AGGREGATE a_sum(int) (SFUNC = a_add, STYPE = int)",
            "aggregate public.a_sum(integer)",
            "DROP AGGREGATE a_sum(int)",
        ),
        (
            "CREATE OPERATOR CLASS a_ops FOR TYPE int USING btree AS
                 OPERATOR 1 <, OPERATOR 3 =, FUNCTION 1 a_cmp(int, int)",
            "operator family a_ops support function public.a_cmp(integer,integer)",
            "DROP OPERATOR FAMILY a_ops USING btree",
        ),
        (
            "CREATE FUNCTION a_full(r a_t) RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "function public.a_full(public.a_t) (callable as an attribute, x.a_full)",
            "DROP FUNCTION a_full(a_t)",
        ),
        (
            "CREATE FUNCTION a_one(r a_t, j int DEFAULT 0) RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "function public.a_one(public.a_t,integer) (callable as an attribute, x.a_one)",
            "DROP FUNCTION a_one(a_t, int)",
        ),
        (
            "CREATE FUNCTION a_poly(e anyelement) RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "function public.a_poly(anyelement) (callable as an attribute, x.a_poly)",
            "DROP FUNCTION a_poly(anyelement)",
        ),
        (
            "CREATE FUNCTION a_var(VARIADIC e anyarray) RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "function public.a_var(anyarray) (callable as an attribute, x.a_var)",
            "DROP FUNCTION a_var(anyarray)",
        ),
        (
            "CREATE DOMAIN a_dt AS a_t;
             CREATE FUNCTION a_dom(d a_dt) RETURNS int LANGUAGE sql AS 'SELECT 1'",
            "function public.a_dom(public.a_dt) (callable as an attribute, x.a_dom)",
            "DROP FUNCTION a_dom(a_dt); DROP DOMAIN a_dt",
        ),
        (
            // t.f is f(t::int) through an implicit cast without a function.
            "CREATE CAST (a_t AS int) WITH INOUT AS IMPLICIT;
             CREATE FUNCTION a_int(i int) RETURNS int LANGUAGE sql AS 'SELECT i'",
            "function public.a_int(integer) (callable as an attribute, x.a_int)",
            "DROP FUNCTION a_int(int); DROP CAST (a_t AS int)",
        ),
        (
            "CREATE FUNCTION public.upper(i int, j int) RETURNS int LANGUAGE sql AS 'SELECT i'",
            "function public.upper(integer,integer) (a built-in's name)",
            "DROP FUNCTION public.upper(int, int)",
        ),
        (
            // `ORDER BY join(1, 2)` calls it; the classifier may take it for `JOIN (`.
            "CREATE FUNCTION join(i int, j int) RETURNS int LANGUAGE sql AS 'SELECT i'",
            "function public.\"join\"(integer,integer) (a name the classifier may take for a keyword)",
            "DROP FUNCTION join(int, int)",
        ),
    ];
    for (create, object, drop) in ways {
        client.batch_execute(create).await.unwrap();
        assert_eq!(
            read_verdict(&client).await,
            (true, true, vec![object.to_string()]),
            "after {create}"
        );
        client.batch_execute(drop).await.unwrap();
        assert_eq!(
            read_verdict(&client).await,
            (false, false, vec![]),
            "after {drop}"
        );
    }
    // A function of one argument that no relation's whole row can be passed as: only
    // field selection (`(1).f`) or a function in FROM (`g.f`) reaches it by attribute
    // notation, which the classifier takes for calls from schema version 9. A proxy of an
    // earlier version asks `pgfence.reads_may_write()`, and is told reads may write.
    client
        .batch_execute(
            "CREATE FUNCTION a_scalar(i int, j text DEFAULT '') RETURNS int
                 LANGUAGE sql AS 'SELECT i'",
        )
        .await
        .unwrap();
    assert_eq!(read_verdict(&client).await, (false, false, vec![]));
    let legacy: bool = client
        .query_one("SELECT pgfence.reads_may_write()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(legacy, "a proxy before version 9 must check reads");
    let legacy_objects: Vec<String> = client
        .query("SELECT o FROM pgfence.read_audit_objects(8) AS o", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        legacy_objects,
        ["function public.a_scalar(integer,text) (callable as an attribute, x.a_scalar)"]
    );
    client
        .batch_execute("DROP FUNCTION a_scalar(int, text)")
        .await
        .unwrap();
    // A DDL rolled back leaves the verdict as it was.
    client
        .batch_execute("BEGIN; CREATE VIEW a_v AS SELECT a_text(1, 2) AS t; ROLLBACK")
        .await
        .unwrap();
    assert_eq!(read_verdict(&client).await, (false, false, vec![]));
    // Without the event trigger (it takes a superuser to create), the kept verdict may be
    // stale, and the function audits the catalog instead.
    client
        .batch_execute(
            "DROP EVENT TRIGGER pgfence_read_audit;
             CREATE VIEW a_v AS SELECT a_text(1, 2) AS t;",
        )
        .await
        .unwrap();
    assert_eq!(
        read_verdict(&client).await,
        (false, true, vec!["view public.a_v".to_string()])
    );
    // Installing again as a superuser brings the trigger back, and a fresh verdict.
    client.batch_execute(&install_sql(None)).await.unwrap();
    assert_eq!(
        read_verdict(&client).await,
        (true, true, vec!["view public.a_v".to_string()])
    );
}

/// The kept verdict, `pgfence.reads_may_write()` and `pgfence.read_audit_objects()`.
async fn read_verdict(client: &Client) -> (bool, bool, Vec<String>) {
    let kept: bool = client
        .query_one("SELECT EXISTS (SELECT 1 FROM pgfence.read_audit)", &[])
        .await
        .unwrap()
        .get(0);
    // The proxy's question (proxy/src/session/read_audit.rs).
    let asked: bool = client
        .query_one("SELECT pgfence.reads_may_write(9)", &[])
        .await
        .unwrap()
        .get(0);
    let objects: Vec<String> = client
        .query("SELECT o FROM pgfence.read_audit_objects() AS o", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    (kept, asked, objects)
}

/// The read audit's event trigger under concurrent DDL never waits for a lock: a review
/// found that when every command locked one verdict row, DDL in concurrent transactions
/// queued, deadlocked and failed with 40001 under REPEATABLE READ, and a later version that
/// only shared the lock still deadlocked a lowering against a transaction that kept the
/// verdict true. Concurrent raises, keeps and lowerings go through at once, under READ
/// COMMITTED and REPEATABLE READ; a lowering that cannot see an object a concurrent
/// transaction adds leaves that transaction's row, so the verdict ends true.
#[tokio::test(flavor = "multi_thread")]
async fn the_read_audit_verdict_under_concurrent_ddl() {
    let cluster = PgCluster::start();
    let first = fresh_database(&cluster, "concurrent_ddl").await;
    let second = cluster.connect("concurrent_ddl").await;
    first
        .batch_execute(
            "CREATE TABLE c_x (a int);
             CREATE FUNCTION c_two(i int, j int) RETURNS int LANGUAGE sql AS 'SELECT i';",
        )
        .await
        .unwrap();
    assert!(!read_verdict(&first).await.0);
    for level in ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"] {
        // Two raises, then two keeps, in concurrent transactions.
        for (a, b) in [("c_a", "c_b"), ("c_c", "c_d")] {
            first
                .batch_execute(&format!(
                    "BEGIN ISOLATION LEVEL {level};
                     CREATE FUNCTION {a}(r c_x) RETURNS int LANGUAGE sql AS 'SELECT 1'"
                ))
                .await
                .unwrap();
            second
                .batch_execute(&format!(
                    "BEGIN ISOLATION LEVEL {level}; SET LOCAL lock_timeout = '2s';
                     CREATE FUNCTION {b}(r c_x) RETURNS int LANGUAGE sql AS 'SELECT 1'; COMMIT"
                ))
                .await
                .unwrap_or_else(|e| panic!("{level}: concurrent DDL waited or failed: {e:?}"));
            first
                .batch_execute("COMMIT")
                .await
                .unwrap_or_else(|e| panic!("{level}: the first DDL failed at COMMIT: {e:?}"));
            assert!(read_verdict(&first).await.0, "{level}");
        }
        first
            .batch_execute("DROP FUNCTION c_a(c_x), c_b(c_x), c_c(c_x), c_d(c_x)")
            .await
            .unwrap();
    }
    // A transaction keeps the verdict true by a view it adds, while another drops the only
    // object it can see: the lowering goes through at once, and the verdict stays true.
    first
        .batch_execute("CREATE FUNCTION c_one(r c_x) RETURNS int LANGUAGE sql AS 'SELECT 1'")
        .await
        .unwrap();
    first
        .batch_execute("BEGIN; CREATE VIEW c_v AS SELECT c_two(1, 2) AS x")
        .await
        .unwrap();
    second
        .batch_execute(
            "BEGIN; SET LOCAL lock_timeout = '2s'; ALTER TABLE c_x ADD COLUMN b int;
             DROP FUNCTION c_one(c_x)",
        )
        .await
        .unwrap_or_else(|e| panic!("the lowering waited: {e:?}"));
    // The first transaction now waits for the second's table lock (as without pgfence),
    // which commits: no deadlock.
    let reading = tokio::spawn(async move {
        first.batch_execute("SELECT * FROM c_x").await.unwrap();
        first
    });
    tokio::time::sleep(BLOCKED_FOR).await;
    second.batch_execute("COMMIT").await.unwrap();
    let first = reading.await.unwrap();
    first.batch_execute("COMMIT").await.unwrap();
    assert_eq!(
        read_verdict(&first).await,
        (true, true, vec!["view public.c_v".to_string()])
    );
    // With nothing left, the next audited command lowers it.
    first.batch_execute("DROP VIEW c_v").await.unwrap();
    assert_eq!(read_verdict(&first).await, (false, false, vec![]));
}
