//! Accept locks (schema version 4, docs/fence-locking.md): READ COMMITTED transactions that
//! accept a fence hold a shared advisory lock, the other levels `FOR SHARE`; advancers take
//! both the exclusive advisory lock and the row lock, so every combination of levels still
//! makes an advance wait for the transactions that accepted the old token. And the upgrade
//! from row accept locks: it switches to advisory ones only once every transaction that was
//! open at the upgrade has ended.

use std::time::Duration;

use fence_core::sql::{install_sql, install_sql_with, AcceptLock, CHECK_SQL};
use harness::{PgCluster, Proxy, SUPERUSER};
use tokio_postgres::Client;

/// Long enough to tell a lock wait from a quick answer on a loaded machine.
const BLOCKED_FOR: Duration = Duration::from_millis(700);

async fn database(cluster: &PgCluster, db: &str, sql: &str) -> Client {
    cluster.psql("postgres", &format!("CREATE DATABASE {db}"));
    let client = cluster.connect(db).await;
    client.batch_execute(sql).await.expect("install");
    client
        .batch_execute("CREATE TABLE writes (n int)")
        .await
        .expect("create table writes");
    client
}

/// `BEGIN` at `level`, one write, then the check of `billing` with `token`.
async fn accept(
    client: &Client,
    level: &str,
    token: &str,
) -> Result<Option<String>, tokio_postgres::Error> {
    client
        .batch_execute(&format!(
            "BEGIN ISOLATION LEVEL {level}; INSERT INTO writes VALUES (1)"
        ))
        .await
        .expect("begin and write");
    let none: Vec<Option<&str>> = Vec::new();
    let row = client
        .query_one(
            CHECK_SQL,
            &[
                &vec![Some("billing")],
                &vec![Some(token)],
                &None::<&str>,
                &none,
                &"tests",
                &false,
            ],
        )
        .await?;
    Ok(row.get(0))
}

async fn accept_lock(client: &Client) -> String {
    client
        .query_one("SELECT accept_lock FROM pgfence.schema_version", &[])
        .await
        .expect("read schema_version")
        .get(0)
}

#[tokio::test(flavor = "multi_thread")]
async fn every_mix_of_isolation_levels_makes_an_advance_wait() {
    let cluster = PgCluster::start();
    let a = database(&cluster, "accept_mix", &install_sql(None)).await;
    let b = cluster.connect("accept_mix").await;
    assert_eq!(accept_lock(&a).await, "advisory");
    assert_eq!(
        accept(&a, "READ COMMITTED", "1").await.unwrap().as_deref(),
        Some("billing=1")
    );
    a.batch_execute("COMMIT").await.unwrap();

    let levels = ["READ COMMITTED", "REPEATABLE READ", "SERIALIZABLE"];
    let mut token = 1;
    for holder in levels {
        for advancer in levels {
            // The holder accepts the current token and stays open.
            let current = token.to_string();
            assert_eq!(
                accept(&a, holder, &current).await.unwrap(),
                Some(format!("billing={token}"))
            );
            // Another transaction with the same token, at any level, does not wait.
            let same = tokio::time::timeout(Duration::from_secs(5), accept(&b, advancer, &current))
                .await
                .unwrap_or_else(|_| panic!("{advancer} waited for {holder} with the same token"))
                .unwrap();
            assert_eq!(same, Some(format!("billing={token}")));
            b.batch_execute("COMMIT").await.unwrap();
            // An advance waits until the holder ends, then succeeds.
            let next = (token + 1).to_string();
            let advance = accept(&b, advancer, &next);
            tokio::pin!(advance);
            assert!(
                tokio::time::timeout(BLOCKED_FOR, &mut advance)
                    .await
                    .is_err(),
                "an advance at {advancer} must wait for a {holder} transaction holding the old token"
            );
            a.batch_execute("COMMIT").await.unwrap();
            assert_eq!(
                advance.await.unwrap(),
                Some(format!("billing={next}")),
                "{holder} then {advancer}"
            );
            b.batch_execute("COMMIT").await.unwrap();
            token += 1;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_upgrade_switches_to_advisory_locks_once_old_transactions_ended() {
    let cluster = PgCluster::start();
    // A schema as an older pgfence left it: row accept locks, version 3.
    let a = database(
        &cluster,
        "accept_upgrade",
        &install_sql_with(None, AcceptLock::Row),
    )
    .await;
    a.batch_execute("UPDATE pgfence.schema_version SET version = 3")
        .await
        .unwrap();
    // A transaction open across the upgrade may be running the old functions.
    let old = cluster.connect("accept_upgrade").await;
    old.batch_execute("BEGIN; INSERT INTO writes VALUES (0)")
        .await
        .unwrap();
    let config = Proxy::config_for(&cluster);
    let install = |wait| {
        pgfence::install::install_with(
            &config,
            "accept_upgrade",
            SUPERUSER,
            None,
            None,
            Duration::from_millis(wait),
        )
    };
    install(500).await.expect("upgrade");
    assert_eq!(accept_lock(&a).await, "row", "the old transaction is open");
    let version: i32 = a
        .query_one("SELECT version FROM pgfence.schema_version", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, fence_core::sql::SCHEMA_VERSION);
    // Still on row locks: the next install tries again, and switches once it has ended.
    install(500).await.expect("install again");
    assert_eq!(accept_lock(&a).await, "row");
    old.batch_execute("COMMIT").await.unwrap();
    install(5_000).await.expect("install once it ended");
    assert_eq!(accept_lock(&a).await, "advisory");
    // Which the functions follow: a READ COMMITTED accept holds the advisory lock.
    let b = cluster.connect("accept_upgrade").await;
    accept(&b, "READ COMMITTED", "5").await.unwrap();
    b.batch_execute("COMMIT").await.unwrap();
    accept(&b, "READ COMMITTED", "5").await.unwrap();
    let advisory: i64 = a
        .query_one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(advisory, 1);
    b.batch_execute("COMMIT").await.unwrap();
    // A fresh database is installed with advisory locks at once.
    cluster.psql("postgres", "CREATE DATABASE accept_fresh");
    pgfence::install::install_with(
        &config,
        "accept_fresh",
        SUPERUSER,
        None,
        None,
        Duration::ZERO,
    )
    .await
    .expect("fresh install");
    let fresh = cluster.connect("accept_fresh").await;
    assert_eq!(accept_lock(&fresh).await, "advisory");
}
