//! Replication connections (`replication=database` for logical replication,
//! `replication=true` for physical) through pgfence: they take replication commands, which
//! pgfence's own statements would break, so they are passed through without the fence and
//! their server connections are not kept.
//!
//! - [`replication_connections_pass_through`]: `IDENTIFY_SYSTEM` answers as PostgreSQL
//!   does; a logical slot is created, and its changes streamed (`pg_recvlogical`, COPY both
//!   ways), through pgfence; `pg_basebackup` with a streamed WAL copies a cluster through
//!   it; no walsender is left behind (nothing kept); other sessions are still fenced.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use harness::fence::{assert_rejected, stale};
use harness::{
    connect_to, pg_bin_dir, run_command, wait_for_none, PgCluster, Proxy, APP_DB, SUPERUSER,
};

const WAIT: Duration = Duration::from_secs(60);

/// A PostgreSQL client program from the server's bin dir, pointed at `port` on 127.0.0.1.
fn client(program: &str, port: u16) -> Command {
    let mut cmd = Command::new(pg_bin_dir().join(program));
    cmd.args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", SUPERUSER]);
    cmd
}

/// Runs `cmd`; its stdout, or a panic with everything it said.
fn output(cmd: &mut Command) -> String {
    let out = run_command(cmd, None, WAIT);
    assert!(
        out.success(),
        "{cmd:?} failed ({:?}):\n{}\n{}",
        out.status,
        out.stdout,
        out.stderr
    );
    out.stdout
}

/// `psql` on a replication connection of the given kind, running one command.
fn replication_psql(port: u16, kind: &str, command: &str) -> String {
    output(client("psql", port).args([
        "-X",
        "-At",
        "-d",
        &format!("dbname={APP_DB} replication={kind}"),
        "-c",
        command,
    ]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replication_connections_pass_through() {
    let cluster = PgCluster::builder().setting("wal_level", "logical").start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster.psql(APP_DB, "CREATE TABLE charges (amount int)");
    let proxy = Proxy::for_cluster(&cluster);

    for kind in ["database", "true"] {
        let direct = replication_psql(cluster.port(), kind, "IDENTIFY_SYSTEM");
        let through = replication_psql(proxy.port(), kind, "IDENTIFY_SYSTEM");
        // systemid|timeline|xlogpos|dbname: the WAL position may move in between.
        let fields = |s: &str| {
            let f: Vec<String> = s.trim().split('|').map(str::to_string).collect();
            (f[0].clone(), f[1].clone(), f[3].clone())
        };
        assert_eq!(fields(&through), fields(&direct), "replication={kind}");
    }

    // Logical: a slot created through pgfence, its changes streamed through pgfence.
    replication_psql(
        proxy.port(),
        "database",
        "CREATE_REPLICATION_SLOT pgfence_test LOGICAL test_decoding",
    );
    cluster.psql(APP_DB, "INSERT INTO charges VALUES (7)");
    let out = tempfile::NamedTempFile::new().unwrap();
    let mut receiver = client("pg_recvlogical", proxy.port())
        .args([
            "-d",
            APP_DB,
            "-S",
            "pgfence_test",
            "--start",
            "--no-loop",
            "-f",
        ])
        .arg(out.path())
        .args(["-F", "0", "-s", "1"])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start pg_recvlogical");
    let start = Instant::now();
    let changes = loop {
        let changes = std::fs::read_to_string(out.path()).unwrap_or_default();
        if changes.contains("COMMIT") {
            break changes;
        }
        if let Some(status) = receiver.try_wait().unwrap() {
            panic!("pg_recvlogical ended ({status}) after: {changes:?}");
        }
        assert!(start.elapsed() < WAIT, "no change streamed: {changes:?}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = receiver.kill();
    let _ = receiver.wait();
    assert!(
        changes.contains("table public.charges: INSERT: amount[integer]:7"),
        "{changes}"
    );

    // Physical: a base backup with its WAL streamed alongside, both through pgfence.
    let backup = tempfile::tempdir().unwrap();
    let target = backup.path().join("copy");
    output(client("pg_basebackup", proxy.port()).args([
        "-D",
        &target.display().to_string(),
        "-X",
        "stream",
        "-c",
        "fast",
        "--no-sync",
    ]));
    for file in ["PG_VERSION", "backup_manifest", "global/pg_control"] {
        assert!(
            Path::new(&target).join(file).exists(),
            "no {file} in the copy"
        );
    }

    // Nothing kept: the walsenders end with their clients.
    let direct = cluster.connect(APP_DB).await;
    wait_for_none(
        &direct,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'walsender'",
        Duration::from_secs(10),
        "walsender(s), kept by pgfence?",
    )
    .await;

    // Other sessions are still fenced.
    let session = |token: u32| {
        format!(
            "{} options='-c fencing.resource=billing -c fencing.token={token}'",
            proxy.connstr(APP_DB)
        )
    };
    let leader = connect_to(&session(34)).await;
    leader
        .batch_execute("INSERT INTO charges VALUES (100)")
        .await
        .unwrap();
    let deposed = connect_to(&session(33)).await;
    let refused = deposed
        .batch_execute("INSERT INTO charges VALUES (200)")
        .await;
    assert_rejected(&refused, &stale("billing", 33, 34), "token 33 after 34");
    direct
        .batch_execute("SELECT pg_drop_replication_slot('pgfence_test')")
        .await
        .unwrap();
}
