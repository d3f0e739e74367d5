//! The fence lives in the database (SPEC section 1), so it is shared by every pgfence in
//! front of it and survives a pgfence restart. These tests run the real `pgfence` binary
//! (`harness::ProxyProcess`), with JSON logs so the rejections' `path` can be read.
//!
//! - [`two_instances_share_the_fence`]: schema installed with `pgfence install`; a token
//!   accepted through one instance fences writes through the other, in both directions, for
//!   sessions opened before and after the advance; the other instance had never seen the
//!   newer token, so its first rejection comes from the database check.
//! - [`restart_loses_no_fence`]: after a pgfence is killed (SIGKILL) or stopped (SIGTERM) and
//!   a new one started, a stale token is still rejected, by the database; the current
//!   leader still writes and advances.

use std::process::Command;
use std::time::Duration;

use harness::fence::{assert_rejected, stale};
use harness::{PgCluster, Proxy, ProxyProcess, Signal, APP_DB};
use tokio_postgres::Client;

/// A client through `proxy` holding `token` for `resource` from its startup options.
async fn leader(proxy: &ProxyProcess, resource: &str, token: i64) -> Client {
    harness::connect_to(&format!(
        "{} options='-c fencing.token={token} -c fencing.resource={resource}'",
        proxy.connstr(APP_DB)
    ))
    .await
}

async fn write(client: &Client, tag: &str) -> Result<(), tokio_postgres::Error> {
    client
        .execute("INSERT INTO inst (tag) VALUES ($1)", &[&tag])
        .await
        .map(|_| ())
}

/// `pgfence --log-format json` with the test config of `cluster`.
fn start(cluster: &PgCluster) -> ProxyProcess {
    ProxyProcess::builder()
        .config(Proxy::config_for(cluster))
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .start()
}

/// The `path` of every `fence rejected` event in the process's log.
fn rejection_paths(proxy: &ProxyProcess) -> Vec<String> {
    proxy
        .logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["message"] == "fence rejected")
        .map(|v| v["path"].as_str().unwrap_or_default().to_string())
        .collect()
}

/// Installs the schema with `pgfence install` and creates the table `inst`.
async fn setup() -> (PgCluster, Client) {
    let cluster = PgCluster::start();
    let out = Command::new(ProxyProcess::binary())
        .args(["install", "--database", APP_DB, "--user", "postgres"])
        .args(["--upstream", &format!("127.0.0.1:{}", cluster.port())])
        .output()
        .expect("run pgfence install");
    assert!(
        out.status.success(),
        "pgfence install: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute("CREATE TABLE inst (tag text)")
        .await
        .unwrap();
    (cluster, direct)
}

async fn tags(direct: &Client) -> Vec<String> {
    direct
        .query("SELECT tag FROM inst ORDER BY tag", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_instances_share_the_fence() {
    let (cluster, direct) = setup().await;
    let one = start(&cluster);
    let two = start(&cluster);
    let r = "shared";

    // A holds 33 through instance two and writes; B takes over with 34 through one.
    let a = leader(&two, r, 33).await;
    write(&a, "a 33").await.unwrap();
    let b = leader(&one, r, 34).await;
    write(&b, "b 34").await.unwrap();
    // A's next write, through two, which never saw 34: rejected by the database.
    assert_rejected(
        &write(&a, "a 33 again").await,
        &stale(r, 33, 34),
        "A via two",
    );
    // A session opened afterwards through two.
    let a2 = leader(&two, r, 33).await;
    assert_rejected(
        &write(&a2, "a 33 new session").await,
        &stale(r, 33, 34),
        "A2 via two",
    );
    assert_eq!(
        rejection_paths(&two).first().map(String::as_str),
        Some("database")
    );

    // And the other way round: 35 through two fences 34 through one.
    let c = leader(&two, r, 35).await;
    write(&c, "c 35").await.unwrap();
    assert_rejected(
        &write(&b, "b 34 again").await,
        &stale(r, 34, 35),
        "B via one",
    );
    assert_eq!(rejection_paths(&one), vec!["database".to_string()]);

    assert_eq!(tags(&direct).await, vec!["a 33", "b 34", "c 35"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restart_loses_no_fence() {
    let (cluster, direct) = setup().await;
    let r = "restarted";
    let mut first = start(&cluster);
    write(&leader(&first, r, 50).await, "50").await.unwrap();
    // This instance learned 50: its fast path rejects 49.
    assert_rejected(
        &write(&leader(&first, r, 49).await, "49 before").await,
        &stale(r, 49, 50),
        "before the restart",
    );
    assert_eq!(rejection_paths(&first), vec!["fast".to_string()]);

    // Killed: nothing is flushed, nothing needs to be.
    first.kill();
    let mut second = start(&cluster);
    assert_rejected(
        &write(&leader(&second, r, 49).await, "49 after kill").await,
        &stale(r, 49, 50),
        "after SIGKILL",
    );
    assert_eq!(rejection_paths(&second), vec!["database".to_string()]);
    write(&leader(&second, r, 50).await, "50 after kill")
        .await
        .unwrap();
    write(&leader(&second, r, 51).await, "51").await.unwrap();

    // Stopped cleanly, then started again.
    second.signal(Signal::SIGTERM);
    assert!(
        second.wait_timeout(Duration::from_secs(30)).is_some(),
        "pgfence did not stop on SIGTERM"
    );
    let third = start(&cluster);
    assert_rejected(
        &write(&leader(&third, r, 50).await, "50 after stop").await,
        &stale(r, 50, 51),
        "after SIGTERM",
    );
    assert_eq!(rejection_paths(&third), vec!["database".to_string()]);

    assert_eq!(tags(&direct).await, vec!["50", "50 after kill", "51"]);
    let fence: i64 = direct
        .query_one(
            "SELECT token FROM pgfence.fences WHERE resource = $1",
            &[&r],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(fence, 51);
}
