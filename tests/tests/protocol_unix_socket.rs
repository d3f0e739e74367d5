//! Clients of pgfence's own Unix-domain socket (`unix_socket_dir`, PgBouncer's setting of
//! the same name), through the `pgfence` binary.
//!
//! - [`clients_connect_through_the_socket`]: the socket is `<dir>/.s.PGSQL.<port>`, open to
//!   every local user; tokio-postgres and psql connect through it; the fence works (a token
//!   accepted, recorded in `pgfence.history` with the client shown as `[local]`, a stale one
//!   rejected); a cancel request sent through the socket cancels; SIGTERM removes the file.

use std::os::unix::fs::PermissionsExt;
use std::process::Command;
use std::time::Duration;

use harness::{connect_to, pg_bin_dir, PgCluster, Proxy, ProxyProcess, Signal, APP_DB, SUPERUSER};

const WAIT: Duration = Duration::from_secs(10);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_connect_through_the_socket() {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster.psql(APP_DB, "CREATE TABLE charges (amount int)");
    let dir = tempfile::tempdir().unwrap();
    let socket_dir = dir.path().display().to_string();
    let mut config = Proxy::config_for(&cluster);
    config.unix_socket_dir = Some(socket_dir.clone());
    let mut proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let socket = dir.path().join(format!(".s.PGSQL.{}", proxy.port()));
    let mode = std::fs::metadata(&socket)
        .unwrap_or_else(|e| panic!("no socket at {}: {e}\n{}", socket.display(), proxy.logs()))
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o777, "every local user may connect");

    let connstr = |token: u32| {
        format!(
            "host={socket_dir} port={} dbname={APP_DB} user={SUPERUSER} \
             options='-c fencing.resource=billing -c fencing.token={token}'",
            proxy.port()
        )
    };
    let leader = connect_to(&connstr(34)).await;
    leader
        .batch_execute("INSERT INTO charges VALUES (100)")
        .await
        .unwrap();
    let shown: String = leader
        .query_one(
            "SELECT client_addr FROM pgfence.history WHERE resource = 'billing'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(shown, "[local]");

    let stale = connect_to(&connstr(33)).await;
    let r = stale
        .batch_execute("INSERT INTO charges VALUES (100)")
        .await;
    assert_eq!(
        harness::fence::sqlstate(&r).as_deref(),
        Some("FN001"),
        "{r:?}"
    );

    // A cancel request through the socket reaches the leader's backend.
    let leader = harness::fence::cancelled_sleep(leader).await;

    let out = Command::new(pg_bin_dir().join("psql"))
        .args([
            "-X",
            "-At",
            "-h",
            &socket_dir,
            "-p",
            &proxy.port().to_string(),
        ])
        .args(["-U", SUPERUSER, "-d", APP_DB])
        .args(["-c", "SELECT sum(amount) FROM charges"])
        .env_remove("PGOPTIONS")
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "100");
    drop((leader, stale));

    proxy.signal(Signal::SIGTERM);
    let status = proxy.wait_timeout(WAIT).expect("pgfence exits on SIGTERM");
    assert!(status.success(), "{status:?}\n{}", proxy.logs());
    assert!(!socket.exists(), "the socket file is removed at exit");
}
