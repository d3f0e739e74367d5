//! Graceful shutdown of the `pgfence` binary (`ProxyProcess`), as `proxy/src/server.rs`
//! documents it:
//!
//! - [`sigterm_waits_for_clients`]: SIGTERM stops accepting at once; open sessions, idle or
//!   in a transaction, keep working; the process exits (status 0) as soon as the last client
//!   disconnects.
//! - [`sigterm_closes_what_is_left_after_the_timeout`]: after `limits.shutdown_timeout`
//!   idle sessions are closed with FATAL 57P01, a session still in a transaction a moment
//!   later, its transaction rolled back; then the process exits.
//! - [`sigint_closes_idle_sessions`]: SIGINT closes idle sessions at once (FATAL 57P01),
//!   lets a session in a transaction finish it and closes it right after its COMMIT; then
//!   the process exits.
//! - [`sigquit_closes_every_session_now`], [`a_second_sigterm_closes_every_session_now`]:
//!   immediate shutdown, open transactions rolled back, as in PgBouncer.
//! - [`sigint_after_sigterm_closes_idle_sessions`]: a wait for clients becomes a drain.
//! - [`a_new_pgfence_gets_the_metrics_port_during_the_drain`]: the metrics port is released
//!   with the client port, so a rolling restart's new process starts.

use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use harness::wire::{self, assert_error, RawConn};
use harness::{PgCluster, Proxy, ProxyProcess, Signal, APP_DB, SUPERUSER};

fn start(cluster: &PgCluster, shutdown_timeout: Duration) -> ProxyProcess {
    setup(cluster);
    proxy(cluster, shutdown_timeout, |_| {})
}

/// Schema pgfence and table `t` in `app`.
fn setup(cluster: &PgCluster) {
    cluster.psql(
        APP_DB,
        &format!(
            "{}\nCREATE TABLE t (id int PRIMARY KEY);",
            fence_core::sql::install_sql(None)
        ),
    );
}

/// pgfence in front of `cluster` (set up by [`start`]), its config changed by `edit`.
fn proxy(
    cluster: &PgCluster,
    shutdown_timeout: Duration,
    edit: impl FnOnce(&mut pgfence_config::Config),
) -> ProxyProcess {
    let mut config = Proxy::config_for(cluster);
    config.limits.shutdown_timeout = shutdown_timeout;
    edit(&mut config);
    ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start()
}

/// A cluster, pgfence in front of it with `shutdown_timeout`, and two sessions: one idle,
/// one in a transaction that inserted 1 into `t`.
fn two_sessions(shutdown_timeout: Duration) -> (PgCluster, ProxyProcess, RawConn, RawConn) {
    let cluster = PgCluster::start();
    let proxy = start(&cluster, shutdown_timeout);
    let idle = login(&proxy);
    let mut busy = login(&proxy);
    exec(&mut busy, "BEGIN; INSERT INTO t VALUES (1)");
    (cluster, proxy, idle, busy)
}

fn login(proxy: &ProxyProcess) -> RawConn {
    RawConn::login(proxy.addr(), SUPERUSER, APP_DB).0
}

/// Sends one simple query and returns its command tags; fails on an error.
fn exec(conn: &mut RawConn, sql: &str) -> Vec<String> {
    conn.send(&wire::query(sql));
    let replies = conn.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "{sql}: {replies:?}");
    replies.iter().filter_map(|m| m.command_tag()).collect()
}

/// Waits until connecting to `addr` is refused: the listener is closed.
fn wait_refused(addr: SocketAddr) {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match TcpStream::connect_timeout(&addr, Duration::from_secs(1)) {
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => return,
            // The listener closed with this probe in its queue: the next one is refused.
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!("connecting to {addr}: {e}"),
            Ok(_) => {}
        }
        assert!(
            Instant::now() < deadline,
            "{addr} still accepts connections 5 s after the signal"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn ids(cluster: &PgCluster) -> String {
    cluster.psql(
        APP_DB,
        "SELECT string_agg(id::text, ',' ORDER BY id) FROM t",
    )
}

/// The session is told pgfence is shutting down, and closed.
fn expect_goodbye(conn: &mut RawConn) {
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "57P01");
}

#[test]
fn sigterm_waits_for_clients() {
    let (cluster, mut proxy, mut idle, mut busy) = two_sessions(Duration::from_secs(30));

    proxy.signal(Signal::SIGTERM);
    wait_refused(proxy.addr());
    assert_eq!(exec(&mut idle, "INSERT INTO t VALUES (2)"), ["INSERT 0 1"]);
    assert_eq!(exec(&mut busy, "INSERT INTO t VALUES (3)"), ["INSERT 0 1"]);
    assert_eq!(exec(&mut busy, "COMMIT"), ["COMMIT"]);
    assert_eq!(ids(&cluster).trim(), "1,2,3");
    // Both still connected and idle: SIGTERM does not close them.
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        proxy.try_status().is_none(),
        "exited with clients connected"
    );
    assert_eq!(exec(&mut idle, "SELECT 1"), ["SELECT 1"]);

    idle.send(&wire::terminate());
    assert!(idle.until_closed().is_empty());
    std::thread::sleep(Duration::from_millis(300));
    assert!(
        proxy.try_status().is_none(),
        "exited with a client connected"
    );
    busy.send(&wire::terminate());
    assert!(busy.until_closed().is_empty());
    let left = Instant::now();
    let status = proxy
        .wait_timeout(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running 5 s after the last client left"));
    assert!(status.success(), "{status}\n{}", proxy.logs());
    eprintln!("exited {:?} after the last client left", left.elapsed());
}

#[test]
fn sigterm_closes_what_is_left_after_the_timeout() {
    let (cluster, mut proxy, mut idle, mut busy) = two_sessions(Duration::from_secs(2));

    let signalled = Instant::now();
    proxy.signal(Signal::SIGTERM);
    wait_refused(proxy.addr());
    expect_goodbye(&mut idle);
    let idle_closed = signalled.elapsed();
    expect_goodbye(&mut busy);
    let busy_closed = signalled.elapsed();
    assert!(
        idle_closed >= Duration::from_millis(1900) && idle_closed < Duration::from_secs(6),
        "idle session closed {idle_closed:?} after SIGTERM; the timeout is 2 s"
    );
    assert!(
        busy_closed >= idle_closed && busy_closed < Duration::from_secs(8),
        "session in a transaction closed {busy_closed:?} after SIGTERM"
    );
    let status = proxy
        .wait_timeout(Duration::from_secs(10))
        .expect("exits after closing what was left");
    assert!(status.success(), "{status}");
    // The open transaction did not commit.
    assert_eq!(ids(&cluster).trim(), "");
}

#[test]
fn sigint_closes_idle_sessions() {
    let (cluster, mut proxy, mut idle, mut busy) = two_sessions(Duration::from_secs(30));

    let signalled = Instant::now();
    proxy.signal(Signal::SIGINT);
    expect_goodbye(&mut idle);
    assert!(
        signalled.elapsed() < Duration::from_secs(3),
        "idle session closed {:?} after SIGINT",
        signalled.elapsed()
    );
    wait_refused(proxy.addr());
    // The transaction goes on to its end, then the session is closed.
    assert_eq!(exec(&mut busy, "INSERT INTO t VALUES (2)"), ["INSERT 0 1"]);
    busy.send(&wire::query("COMMIT"));
    let replies = busy.until_ready();
    assert_eq!(
        replies
            .iter()
            .filter_map(|m| m.command_tag())
            .collect::<Vec<_>>(),
        ["COMMIT"],
        "{replies:?}"
    );
    assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'I'));
    expect_goodbye(&mut busy);
    assert_eq!(ids(&cluster).trim(), "1,2");
    let status = proxy
        .wait_timeout(Duration::from_secs(5))
        .expect("exits once every session is closed");
    assert!(status.success(), "{status}");
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "{:?}",
        signalled.elapsed()
    );
}

/// Two sessions, one idle and one in a transaction; `signals` are sent in turn, then both
/// are closed at once with FATAL 57P01, the transaction rolled back, and the process exits
/// well before its 30 s shutdown timeout.
fn closes_every_session_now(signals: &[Signal]) {
    let (cluster, mut proxy, mut idle, mut busy) = two_sessions(Duration::from_secs(30));

    let signalled = Instant::now();
    for (i, &signal) in signals.iter().enumerate() {
        if i > 0 {
            // The first one took effect: no longer accepting, sessions still open.
            wait_refused(proxy.addr());
            assert_eq!(exec(&mut idle, "SELECT 1"), ["SELECT 1"]);
        }
        proxy.signal(signal);
    }
    expect_goodbye(&mut idle);
    expect_goodbye(&mut busy);
    let status = proxy
        .wait_timeout(Duration::from_secs(5))
        .unwrap_or_else(|| panic!("still running 5 s after {signals:?}"));
    assert!(status.success(), "{status}\n{}", proxy.logs());
    assert!(
        signalled.elapsed() < Duration::from_secs(10),
        "{:?} after {signals:?}; the shutdown timeout is 30 s",
        signalled.elapsed()
    );
    assert_eq!(ids(&cluster).trim(), "", "the open transaction committed");
    let logs = proxy.logs();
    assert!(logs.contains("closing every session now"), "{logs}");
    assert!(logs.contains("pgfence stopped"), "{logs}");
}

#[test]
fn sigquit_closes_every_session_now() {
    closes_every_session_now(&[Signal::SIGQUIT]);
}

#[test]
fn a_second_sigterm_closes_every_session_now() {
    closes_every_session_now(&[Signal::SIGTERM, Signal::SIGTERM]);
}

#[test]
fn sigint_after_sigterm_closes_idle_sessions() {
    let (cluster, mut proxy, mut idle, mut busy) = two_sessions(Duration::from_secs(30));

    proxy.signal(Signal::SIGTERM);
    wait_refused(proxy.addr());
    assert_eq!(exec(&mut idle, "SELECT 1"), ["SELECT 1"]);
    let signalled = Instant::now();
    proxy.signal(Signal::SIGINT);
    expect_goodbye(&mut idle);
    assert!(
        signalled.elapsed() < Duration::from_secs(3),
        "idle session closed {:?} after SIGINT",
        signalled.elapsed()
    );
    // The transaction goes on to its end, then the session is closed.
    assert_eq!(exec(&mut busy, "COMMIT"), ["COMMIT"]);
    expect_goodbye(&mut busy);
    assert_eq!(ids(&cluster).trim(), "1");
    let status = proxy
        .wait_timeout(Duration::from_secs(5))
        .expect("exits once every session is closed");
    assert!(status.success(), "{status}");
}

#[test]
fn a_new_pgfence_gets_the_metrics_port_during_the_drain() {
    let metrics: SocketAddr = format!("127.0.0.1:{}", harness::free_port())
        .parse()
        .expect("an address");
    let with_metrics = |c: &mut pgfence_config::Config| c.telemetry.metrics_addr = Some(metrics);
    let cluster = PgCluster::start();
    setup(&cluster);
    let old = proxy(&cluster, Duration::from_secs(30), with_metrics);
    let mut idle = login(&old);
    old.signal(Signal::SIGTERM);
    wait_refused(old.addr());
    // The old process still serves its session, and no longer holds the metrics port: a
    // new one (a rolling restart) starts with the same metrics address.
    assert_eq!(exec(&mut idle, "SELECT 1"), ["SELECT 1"]);
    let mut new = proxy(&cluster, Duration::from_secs(30), with_metrics);
    std::thread::sleep(Duration::from_millis(300));
    assert!(new.try_status().is_none(), "{}", new.logs());
    let mut conn = login(&new);
    assert_eq!(exec(&mut conn, "SELECT 1"), ["SELECT 1"]);
    TcpStream::connect_timeout(&metrics, Duration::from_secs(1))
        .unwrap_or_else(|e| panic!("the new process serves metrics on {metrics}: {e}"));
}
