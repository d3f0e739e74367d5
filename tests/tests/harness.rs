//! Self-tests of the harness: clusters start, answer, authenticate as configured, run side
//! by side and leave nothing behind; the in-process proxy and the process runner start and
//! stop. None of these depend on pgfence forwarding anything.

use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

use harness::{
    free_port, try_connect_to, PgCluster, Proxy, ProxyProcess, Signal, APP_DB, MD5_PASSWORD,
    MD5_USER, SCRAM_PASSWORD, SCRAM_USER,
};

#[tokio::test]
async fn cluster_answers_select_1_over_tokio_postgres_and_psql() {
    let started = Instant::now();
    let cluster = PgCluster::start();
    eprintln!("cluster started in {:?}", started.elapsed());

    let client = cluster.connect(APP_DB).await;
    let row = client
        .query_one("SELECT 1::int4", &[])
        .await
        .expect("SELECT 1");
    assert_eq!(row.get::<_, i32>(0), 1);

    assert_eq!(cluster.psql(APP_DB, "SELECT 1"), "1\n");
    let settings = cluster.psql(
        "postgres",
        "SHOW max_connections; SHOW track_commit_timestamp; SHOW max_prepared_transactions;",
    );
    assert_eq!(settings, "300\non\n10\n");
}

#[tokio::test]
async fn passwords_are_required_and_stored_as_configured() {
    let cluster = PgCluster::start();

    for (user, password) in [(MD5_USER, MD5_PASSWORD), (SCRAM_USER, SCRAM_PASSWORD)] {
        let ok = try_connect_to(&cluster.connstr_as(APP_DB, user, Some(password)))
            .await
            .unwrap_or_else(|e| panic!("{user} with the right password: {e:?}"));
        let who: String = ok
            .query_one("SELECT current_user::text", &[])
            .await
            .expect("current_user")
            .get(0);
        assert_eq!(who, user);
        // Test roles can create tables in app.
        ok.batch_execute(&format!("CREATE TABLE {user}_t (id int)"))
            .await
            .expect("create a table in app");

        let err = match try_connect_to(&cluster.connstr_as(APP_DB, user, Some("wrong"))).await {
            Ok(_) => panic!("{user} logged in with a wrong password"),
            Err(e) => e,
        };
        let code = err.as_db_error().map(|d| d.code().code().to_string());
        assert_eq!(
            code.as_deref(),
            Some("28P01"),
            "{user} with a wrong password: {err:?}"
        );

        assert!(
            try_connect_to(&cluster.connstr_as(APP_DB, user, None))
                .await
                .is_err(),
            "{user} logged in without a password"
        );
    }

    let stored = cluster.psql(
        "postgres",
        "SELECT rolname || ' ' || split_part(rolpassword, '$', 1) FROM pg_authid \
         WHERE rolname IN ('md5user', 'scramuser') ORDER BY 1",
    );
    assert!(stored.starts_with("md5user md5"), "{stored}");
    assert!(stored.contains("scramuser SCRAM-SHA-256"), "{stored}");

    // psql (libpq) authenticates the same way.
    let out = cluster
        .psql_cmd()
        .args(["-Atq", "-U", SCRAM_USER, "-d", APP_DB, "-c", "SELECT 42"])
        .env("PGPASSWORD", SCRAM_PASSWORD)
        .output()
        .expect("run psql as scramuser");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "42\n",
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn two_clusters_run_in_parallel() {
    let started = Instant::now();
    let handles: Vec<_> = (0..2)
        .map(|_| std::thread::spawn(PgCluster::start))
        .collect();
    let clusters: Vec<PgCluster> = handles
        .into_iter()
        .map(|h| h.join().expect("a cluster start panicked"))
        .collect();
    eprintln!("two clusters started in {:?}", started.elapsed());

    assert_ne!(clusters[0].port(), clusters[1].port());
    let dirs: Vec<String> = clusters
        .iter()
        .map(|c| c.psql("postgres", "SHOW data_directory"))
        .collect();
    assert_ne!(dirs[0], dirs[1]);
    for c in &clusters {
        c.psql(APP_DB, "CREATE TABLE t (id int); INSERT INTO t VALUES (1);");
        assert_eq!(c.psql(APP_DB, "SELECT count(*) FROM t"), "1\n");
    }
}

#[test]
fn drop_stops_the_server_and_removes_the_directory() {
    let cluster = PgCluster::start();
    let dir = cluster.dir().to_path_buf();
    let pid_file = std::fs::read_to_string(cluster.data_dir().join("postmaster.pid"))
        .expect("read postmaster.pid");
    let pid = pid_file
        .lines()
        .next()
        .expect("pid line")
        .trim()
        .to_string();
    let port = cluster.port();
    assert!(Path::new(&format!("/proc/{pid}")).exists());

    let started = Instant::now();
    drop(cluster);
    eprintln!("cluster stopped and removed in {:?}", started.elapsed());

    assert!(!dir.exists(), "{} still exists", dir.display());
    // pg_ctl returns once postmaster.pid is gone, a moment before the postmaster exits.
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_running(&pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!is_running(&pid), "postmaster {pid} still runs");
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still accepts"
    );
}

/// True if process `pid` exists and is not a zombie.
fn is_running(pid: &str) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| !rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

#[test]
fn cluster_is_cleaned_up_when_the_test_panics() {
    let dir = std::sync::Mutex::new(None);
    let result = std::panic::catch_unwind(|| {
        let cluster = PgCluster::start();
        *dir.lock().expect("lock") = Some(cluster.dir().to_path_buf());
        panic!("deliberate");
    });
    assert!(result.is_err());
    let dir = dir
        .lock()
        .expect("lock")
        .clone()
        .expect("the cluster started");
    assert!(
        !dir.exists(),
        "{} still exists after a panic",
        dir.display()
    );
}

#[test]
fn builder_settings_win_over_the_defaults() {
    let cluster = PgCluster::builder()
        .setting("max_connections", "50")
        .setting("work_mem", "'5MB'")
        .start();
    assert_eq!(
        cluster.psql("postgres", "SHOW max_connections; SHOW work_mem"),
        "50\n5MB\n"
    );
}

#[test]
fn free_ports_are_distinct_and_bindable() {
    let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
    let mut unique = ports.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ports.len());
    for p in ports.iter().take(5) {
        std::net::TcpListener::bind(("127.0.0.1", *p)).expect("a free port binds");
    }
}

#[test]
fn in_process_proxy_starts_and_stops() {
    let cluster = PgCluster::start();
    let proxy = Proxy::for_cluster(&cluster);
    assert_eq!(proxy.config().upstream.port, cluster.port());
    assert_eq!(proxy.config().listen, proxy.addr());

    let started = Instant::now();
    proxy.shutdown().expect("pgfence::run returned an error");
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "shutdown took {:?}",
        started.elapsed()
    );
}

/// The process runner, driven with python's http.server instead of pgfence (whose binary
/// may not exist yet): readiness, logs, signals, exit status, kill on drop.
#[test]
fn process_runner_waits_for_the_port_signals_and_kills() {
    let Some(py) = ["/usr/bin/python3", "/usr/local/bin/python3"]
        .iter()
        .map(Path::new)
        .find(|p| p.is_file())
    else {
        eprintln!("SKIP process_runner: no python3");
        return;
    };
    let mut proc = ProxyProcess::builder()
        .program(py)
        .args(["-u", "-m", "http.server", "--bind", "127.0.0.1", "{port}"])
        .start();
    assert!(TcpStream::connect(proc.addr()).is_ok());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !proc.logs().contains("Serving HTTP") && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        proc.logs().contains(&format!("port {}", proc.port())),
        "{}",
        proc.logs()
    );

    proc.signal(Signal::SIGSTOP);
    proc.signal(Signal::SIGCONT);
    assert!(proc.wait_timeout(Duration::from_millis(200)).is_none());
    proc.signal(Signal::SIGTERM);
    let status = proc
        .wait_timeout(Duration::from_secs(10))
        .expect("exit after SIGTERM");
    assert!(!status.success());
}
