//! Bad input over raw TCP, through pgfence in front of a real PostgreSQL.
//!
//! Each case checks that the offending client gets a FATAL ErrorResponse (SQLSTATE 08P01)
//! where the protocol allows one, that its connection closes, that its upstream backend goes
//! away, and that other sessions through the same proxy (one idle, one with a transaction
//! open across all the cases) keep working during and after:
//!
//! - [`startup_phase_garbage_is_refused`]: an HTTP request instead of a startup packet,
//!   startup lengths below 8 / above the cap / negative, protocol version 2 (the same
//!   SQLSTATE PostgreSQL gives), no user (28000 and PostgreSQL's words), a truncated startup packet then close, a client that never
//!   finishes its startup (startup timeout).
//! - [`ready_phase_bad_frames_are_refused`]: after login, a truncated frame then close,
//!   length < 4, a length beyond `limits.max_message_size` (and a message just under it
//!   passing), a negative length, an unknown tag; and a Query where the server asked for a
//!   password (authentication phase).
//! - [`encryption_requests_are_declined_then_startup_works`]: SSLRequest and GSSENCRequest
//!   answered `N`, then a normal login; bytes sent before the answer are refused.
//! - [`cancel_with_unknown_key_does_nothing`]: a CancelRequest with a made-up key, or with
//!   a live session's pid and a wrong key, cancels nothing.
//! - [`upstream_down_gives_fatal_naming_it`]: no server at the upstream address: FATAL
//!   08006 naming it; an upstream that stops mid-session and comes back.
//! - [`a_backend_that_dies_gives_fatal_08006`]: a server process killed mid-session (it
//!   says nothing): the client gets pgfence's FATAL 08006 with a hint; a server's own FATAL
//!   (an idle-session timeout) reaches the client alone.
//! - [`a_session_that_panics_gets_fatal_xx000_and_the_others_go_on`]: a bug's panic in one
//!   session (a failpoint of debug builds) ends that session alone, with FATAL XX000; its
//!   open transaction rolls back, `SHOW CLIENTS` forgets it, `pgfence_panics_total`
//!   counts it, the log says what and who.
//! - [`pgfence_memory_stays_bounded`]: a client that pipelines Syncs for seconds without
//!   reading a reply, one that reads a 100 MB row or copy data only after a while (it
//!   streams through), and one that receives a 50 MB row and sends a 50 MB Query, leave
//!   the `pgfence` binary's RSS within a few MiB of where it was.
//! - [`the_binary_s_worker_threads_time_out_silent_clients`]: the same startup timeout in
//!   the `pgfence` binary, whose sessions run on worker threads (runtimes of their own).

use std::io::ErrorKind;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use harness::operating::scrape;
use harness::wire::{self, assert_error, RawConn, Read1};
use harness::{
    free_port, try_connect_to, PgCluster, Proxy, ProxyProcess, APP_DB, SCRAM_USER, SUPERUSER,
};

/// The message cap of these tests' proxies.
const MAX_MESSAGE: u32 = 64 * 1024;

fn proxy_for(cluster: &PgCluster) -> Proxy {
    let mut config = Proxy::config_for(cluster);
    config.limits.max_message_size = MAX_MESSAGE;
    config.limits.startup_timeout = Duration::from_secs(1);
    // These tests count upstream backends to see each session's end; a kept idle server
    // connection would count too (protocol_pool tests what is kept).
    config.pool.reuse_servers = false;
    Proxy::start(config)
}

fn install_fence(cluster: &PgCluster) {
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
}

/// Sessions through the proxy that must not notice anything: one idle between queries, one
/// inside a transaction that writes before the bad input and commits after it.
struct Bystanders {
    idle: RawConn,
    in_tx: RawConn,
    rounds: u32,
}

impl Bystanders {
    fn start(proxy: SocketAddr, cluster: &PgCluster) -> Bystanders {
        cluster.psql(APP_DB, "CREATE TABLE bystander (n int)");
        let (idle, _) = RawConn::login(proxy, SUPERUSER, APP_DB);
        let (mut in_tx, _) = RawConn::login(proxy, SUPERUSER, APP_DB);
        in_tx.send(&wire::query("BEGIN; INSERT INTO bystander VALUES (1)"));
        let replies = in_tx.until_ready();
        assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'T'));
        Bystanders {
            idle,
            in_tx,
            rounds: 0,
        }
    }

    /// Both sessions answer a query correctly (simple and extended protocol).
    fn check(&mut self, after: &str) {
        self.rounds += 1;
        let n = self.rounds.to_string();
        self.idle.send(&wire::query(format!("SELECT {n}::int + 1")));
        let replies = self.idle.until_ready();
        let rows: Vec<_> = replies.iter().filter_map(|m| m.data_row()).collect();
        assert_eq!(
            rows,
            vec![vec![Some((self.rounds + 1).to_string().into_bytes())]],
            "idle bystander after {after}: {replies:?}"
        );
        let mut batch = wire::parse("", "INSERT INTO bystander VALUES ($1)", &[]);
        batch.extend(wire::bind("", "", &[Some(n.as_bytes())]));
        batch.extend(wire::execute("", 0));
        batch.extend(wire::sync());
        self.in_tx.send(&batch);
        let replies = self.in_tx.until_ready();
        let tags: Vec<u8> = replies.iter().map(|m| m.tag).collect();
        assert_eq!(
            tags, b"12CZ",
            "bystander in a transaction after {after}: {replies:?}"
        );
        assert_eq!(replies[3].ready_status(), Some(b'T'));
    }

    /// Commits the open transaction; every row must be there.
    fn finish(mut self, cluster: &PgCluster) {
        self.in_tx.send(&wire::query("COMMIT"));
        let replies = self.in_tx.until_ready();
        assert_eq!(
            replies.first().and_then(|m| m.command_tag()).as_deref(),
            Some("COMMIT"),
            "{replies:?}"
        );
        let count = cluster.psql(APP_DB, "SELECT count(*) FROM bystander");
        assert_eq!(count.trim(), (self.rounds + 1).to_string());
        self.idle.send(&wire::terminate());
        assert!(self.idle.until_closed().is_empty());
    }
}

/// Client backends connected to `cluster` other than the one asking.
fn other_backends(cluster: &PgCluster) -> usize {
    cluster
        .psql(
            "postgres",
            "SELECT count(*) FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )
        .trim()
        .parse()
        .expect("a count")
}

/// Waits until `cluster` has `want` other client backends (a closed session's backend may
/// take a moment to exit).
fn wait_for_backends(cluster: &PgCluster, want: usize, case: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = other_backends(cluster);
        if n == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "after {case}: {n} upstream backends, expected {want} (a session leaked?)"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Sends `bytes` on a fresh connection and expects one FATAL 08P01 error, then the close.
/// Returns the error message.
fn expect_refused(proxy: SocketAddr, prefix: &[u8], bytes: &[u8]) -> String {
    let mut conn = RawConn::connect(proxy);
    conn.send(prefix);
    if !prefix.is_empty() {
        // Let the proxy act on the prefix first (a login), so the case is what follows.
        let _ = conn.until_ready();
    }
    // The proxy may close before reading everything; a reset while writing is fine.
    let _ = conn.try_send(bytes);
    let replies = conn.until_closed();
    assert_eq!(
        replies.len(),
        1,
        "expected exactly one ErrorResponse for {bytes:?}, got {replies:?}"
    );
    assert_error(&replies[0], "FATAL", "08P01")
}

fn login_bytes() -> Vec<u8> {
    wire::startup(SUPERUSER, APP_DB)
}

#[test]
fn startup_phase_garbage_is_refused() {
    let cluster = PgCluster::start();
    install_fence(&cluster);
    let proxy = proxy_for(&cluster);
    let mut others = Bystanders::start(proxy.addr(), &cluster);
    let baseline = other_backends(&cluster);
    assert_eq!(baseline, 2);

    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "an HTTP request",
            b"GET / HTTP/1.1\r\nHost: localhost\r\n\r\n".to_vec(),
        ),
        ("length 4", vec![0, 0, 0, 4, 0, 3, 0, 0]),
        ("length 0", vec![0; 8]),
        ("a negative length", {
            let mut b = (-16i32).to_be_bytes().to_vec();
            b.extend(wire::PROTOCOL_3_0.to_be_bytes());
            b.extend([0u8; 8]);
            b
        }),
        ("a length beyond 10000", {
            let mut b = 10_001u32.to_be_bytes().to_vec();
            b.extend(wire::PROTOCOL_3_0.to_be_bytes());
            b
        }),
        ("an unterminated parameter list", {
            let mut b = wire::startup(SUPERUSER, APP_DB);
            b.pop();
            let len = u32::try_from(b.len()).unwrap();
            b[..4].copy_from_slice(&len.to_be_bytes());
            b
        }),
        ("a cancel request of the wrong size", {
            wire::startup_packet(wire::CANCEL_REQUEST_CODE, &[0; 4])
        }),
    ];
    for (case, bytes) in &cases {
        let message = expect_refused(proxy.addr(), &[], bytes);
        eprintln!("{case}: {message}");
        wait_for_backends(&cluster, baseline, case);
        others.check(case);
    }

    // Protocol 2: refused as PostgreSQL refuses it, in protocol 2's error format (no
    // SQLSTATE: `E`, text, NUL). Protocol 4: a protocol 3 error, SQLSTATE 0A000 from both.
    let direct_addr = SocketAddr::from(([127, 0, 0, 1], cluster.port()));
    let v2 = wire::startup_version(2 << 16, &[("user", b"postgres"), ("database", b"app")]);
    let mut replies = Vec::new();
    for addr in [direct_addr, proxy.addr()] {
        let mut conn = RawConn::connect(addr);
        conn.send(&v2);
        let reply = conn.read_to_end();
        let text = String::from_utf8_lossy(&reply).into_owned();
        assert!(
            text.starts_with("EFATAL:  ") && text.ends_with("\n\0"),
            "{addr}: {text:?}"
        );
        assert!(
            text.contains("unsupported frontend protocol 2.0"),
            "{text:?}"
        );
        replies.push(text);
    }
    eprintln!("protocol 2: {replies:?}");
    others.check("protocol version 2");
    let v4 = wire::startup_version(4 << 16, &[("user", b"postgres"), ("database", b"app")]);
    for addr in [direct_addr, proxy.addr()] {
        let mut conn = RawConn::connect(addr);
        conn.send(&v4);
        let replies = conn.until_closed();
        assert_eq!(replies.len(), 1, "{addr}: {replies:?}");
        let message = assert_error(&replies[0], "FATAL", "0A000");
        assert!(message.contains("4.0"), "{message}");
    }
    others.check("protocol version 4");
    // No user: PostgreSQL's SQLSTATE and words.
    let no_user = wire::startup_version(3 << 16, &[("database", b"app")]);
    for addr in [direct_addr, proxy.addr()] {
        let mut conn = RawConn::connect(addr);
        conn.send(&no_user);
        let replies = conn.until_closed();
        assert_eq!(replies.len(), 1, "{addr}: {replies:?}");
        let message = assert_error(&replies[0], "FATAL", "28000");
        assert_eq!(
            message,
            "no PostgreSQL user name specified in startup packet"
        );
    }
    others.check("no user");

    // A truncated startup packet, then close: nothing to answer, nothing left behind.
    let mut conn = RawConn::connect(proxy.addr());
    let full = login_bytes();
    conn.send(&full[..full.len() - 3]);
    conn.shutdown_write();
    assert!(conn.until_closed().is_empty());
    wait_for_backends(&cluster, baseline, "a truncated startup packet");
    others.check("a truncated startup packet");

    // Half a startup packet and then silence: the startup timeout (1 s here) ends it.
    let started = Instant::now();
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&full[..6]);
    let replies = conn.until_closed();
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "08P01");
    others.check("a startup timeout");

    // Connect and close at once, many times: nothing to say, nothing to leak.
    for _ in 0..20 {
        drop(RawConn::connect(proxy.addr()));
    }
    others.check("connect-and-close");
    wait_for_backends(&cluster, baseline, "connect-and-close");

    others.finish(&cluster);
}

#[test]
fn ready_phase_bad_frames_are_refused() {
    let cluster = PgCluster::start();
    install_fence(&cluster);
    let proxy = proxy_for(&cluster);
    let mut others = Bystanders::start(proxy.addr(), &cluster);
    let baseline = other_backends(&cluster);
    let login = login_bytes();

    let over_cap = {
        let mut b = vec![b'Q'];
        b.extend((MAX_MESSAGE + 1).to_be_bytes());
        b.extend(b"SELECT 1");
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("length 3", vec![b'Q', 0, 0, 0, 3]),
        ("length 0", vec![b'S', 0, 0, 0, 0]),
        ("a negative length", vec![b'Q', 0xff, 0xff, 0xff, 0xf0, 0]),
        ("a length beyond the cap", over_cap),
        ("an unknown tag", wire::frame(b'z', b"")),
        ("a backend tag", wire::frame(b'Z', b"I")),
        ("a NUL tag", wire::frame(0, b"")),
        // Bodies PostgreSQL would refuse with ERROR 08P01 `invalid message format`, which
        // for a Sync or Flush leaves the replies owed out of step.
        ("a Sync with a body", wire::frame(b'S', b"x")),
        ("a Flush with a body", wire::frame(b'H', b"\0")),
        (
            "a Query with bytes after its text",
            wire::frame(b'Q', b"SELECT 1\0x"),
        ),
        (
            "a Bind whose parameter overruns it",
            wire::frame(b'B', b"\0\0\0\0\0\x01\0\0\0\x09ab\0\0"),
        ),
        (
            "a Parse missing parameter types",
            wire::frame(b'P', b"\0SELECT $1\0\0\x01"),
        ),
        ("an Execute without its row limit", wire::frame(b'E', b"\0")),
        ("a Describe without its name", wire::frame(b'D', b"S")),
    ];
    for (case, bytes) in &cases {
        let message = expect_refused(proxy.addr(), &login, bytes);
        eprintln!("{case}: {message}");
        if case.contains("cap") {
            assert!(message.contains(&MAX_MESSAGE.to_string()), "{message}");
        }
        if case.contains("with a body") || case.contains("overruns") || case.contains("missing") {
            assert!(message.contains("malformed"), "{message}");
        }
        wait_for_backends(&cluster, baseline, case);
        others.check(case);
    }

    // A bad frame after a valid message in the same write: the session ends with the
    // FATAL error; whatever of the valid message's replies came before it is intact.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    let mut bytes = wire::query("SELECT 42");
    bytes.extend(wire::frame(b'z', b""));
    conn.send(&bytes);
    let replies = conn.until_closed();
    let tags: Vec<u8> = replies.iter().map(|m| m.tag).collect();
    let (last, before) = tags.split_last().expect("an error");
    assert!(b"TDCZ".starts_with(before) && *last == b'E', "{replies:?}");
    assert_error(replies.last().unwrap(), "FATAL", "08P01");
    wait_for_backends(&cluster, baseline, "a bad frame after a good one");
    others.check("a bad frame after a good one");

    // Inside COPY FROM STDIN, a message that is not copy data: PostgreSQL would fail the
    // COPY and swallow the message, whose replies pgfence would wait for; it refuses it.
    cluster.psql(APP_DB, "CREATE TABLE copied (n int)");
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    conn.send(&wire::query("COPY copied FROM STDIN"));
    assert_eq!(conn.recv().tag, b'G');
    let mut bytes = wire::copy_data(b"1\n");
    bytes.extend(wire::sync());
    bytes.extend(wire::function_call(1598, &[]));
    conn.send(&bytes);
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    let message = assert_error(&replies[0], "FATAL", "08P01");
    assert!(
        message.contains("FunctionCall message during COPY FROM STDIN"),
        "{message}"
    );
    wait_for_backends(&cluster, baseline, "a FunctionCall inside COPY");
    others.check("a FunctionCall inside COPY");
    // After the server failed the COPY (a bad row), the client may go on without CopyDone,
    // as PostgreSQL lets it; the copy data it still sends is dropped.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    conn.send(&wire::query("COPY copied FROM STDIN"));
    assert_eq!(conn.recv().tag, b'G');
    conn.send(&wire::copy_data(b"not a number\n"));
    let replies = conn.until_ready();
    assert_eq!(
        replies[0].sqlstate().as_deref(),
        Some("22P02"),
        "{replies:?}"
    );
    let mut bytes = wire::copy_data(b"2\n");
    bytes.extend(wire::query("SELECT count(*) FROM copied"));
    conn.send(&bytes);
    let rows: Vec<_> = conn
        .until_ready()
        .iter()
        .filter_map(|m| m.data_row())
        .collect();
    assert_eq!(rows, vec![vec![Some(b"0".to_vec())]]);
    conn.send(&wire::terminate());
    assert!(conn.until_closed().is_empty());

    // A message just under the cap passes.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    let filler = "x".repeat(usize::try_from(MAX_MESSAGE).unwrap() - 100);
    conn.send(&wire::query(format!("SELECT length('{filler}')")));
    let replies = conn.until_ready();
    let rows: Vec<_> = replies.iter().filter_map(|m| m.data_row()).collect();
    assert_eq!(
        rows,
        vec![vec![Some(filler.len().to_string().into_bytes())]],
        "{replies:?}"
    );
    conn.send(&wire::terminate());
    assert!(conn.until_closed().is_empty());

    // The cap is on what clients send: server replies beyond it pass.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    conn.send(&wire::query("SELECT repeat('y', 300000)"));
    let replies = conn.until_ready();
    let rows: Vec<_> = replies.iter().filter_map(|m| m.data_row()).collect();
    assert_eq!(rows, vec![vec![Some(vec![b'y'; 300_000])]], "{replies:?}");
    conn.send(&wire::terminate());
    assert!(conn.until_closed().is_empty());

    // A truncated frame, then the client goes away: the upstream session ends too.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&login);
    conn.until_ready();
    let q = wire::query("SELECT 1");
    conn.send(&q[..q.len() - 4]);
    conn.shutdown_write();
    assert!(conn.until_closed().is_empty());
    wait_for_backends(&cluster, baseline, "a truncated frame then close");
    others.check("a truncated frame then close");

    // A Query while the server waits for a SCRAM password: refused, no password leaks.
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&wire::startup(SCRAM_USER, APP_DB));
    let auth = conn.recv();
    assert_eq!(auth.tag, b'R', "{auth:?}");
    assert_eq!(&auth.body[..4], &10u32.to_be_bytes(), "AuthenticationSASL");
    conn.send(&wire::query("SELECT 1"));
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "08P01");
    wait_for_backends(&cluster, baseline, "a query during authentication");
    others.check("a query during authentication");

    others.finish(&cluster);
}

#[test]
fn encryption_requests_are_declined_then_startup_works() {
    let cluster = PgCluster::start();
    let proxy = proxy_for(&cluster);
    for requests in [
        vec![wire::ssl_request()],
        vec![wire::gssenc_request()],
        // libpq with gssencmode=prefer and sslmode=prefer asks for both, GSS first.
        vec![wire::gssenc_request(), wire::ssl_request()],
    ] {
        let mut conn = RawConn::connect(proxy.addr());
        for request in &requests {
            conn.send(request);
            assert_eq!(conn.read_bytes(1), b"N");
        }
        conn.send(&login_bytes());
        let replies = conn.until_ready();
        assert_eq!(replies[0].tag, b'R');
        conn.send(&wire::query("SELECT 'plain'"));
        let replies = conn.until_ready();
        let rows: Vec<_> = replies.iter().filter_map(|m| m.data_row()).collect();
        assert_eq!(rows, vec![vec![Some(b"plain".to_vec())]]);
    }
    // A second request of one kind is refused as the version it spells, as PostgreSQL
    // does, not declined again until the startup timeout (a review).
    for (request, version) in [
        (wire::ssl_request(), "1234.5679"),
        (wire::gssenc_request(), "1234.5680"),
    ] {
        let mut conn = RawConn::connect(proxy.addr());
        conn.send(&request);
        assert_eq!(conn.read_bytes(1), b"N");
        conn.send(&request);
        let replies = conn.until_closed();
        let message = assert_error(&replies[0], "FATAL", "0A000");
        assert!(message.contains(version), "{message}");
    }

    // And as real clients ask for it.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        for mode in ["prefer", "disable"] {
            let connstr = format!("{} sslmode={mode}", proxy.connstr(APP_DB));
            let client = try_connect_to(&connstr).await.expect(mode);
            client.simple_query("SELECT 1").await.expect(mode);
        }
        let connstr = format!("{} sslmode=require", proxy.connstr(APP_DB));
        let Err(err) = try_connect_to(&connstr).await else {
            panic!("sslmode=require cannot succeed against N");
        };
        eprintln!("sslmode=require: {err}");
    });
    let out = proxy.psql(APP_DB, "SELECT 'psql over sslmode=prefer'");
    assert_eq!(out, "psql over sslmode=prefer\n");

    // A client that sends its startup packet without waiting for the answer to its
    // SSLRequest: like PostgreSQL, `N` and then FATAL 08P01 (bytes that arrived before the
    // answer could have been injected by a man in the middle), both to the same bytes.
    let mut bytes = wire::ssl_request();
    bytes.extend(login_bytes());
    let direct_addr = SocketAddr::from(([127, 0, 0, 1], cluster.port()));
    for addr in [direct_addr, proxy.addr()] {
        let mut conn = RawConn::connect(addr);
        conn.send(&bytes);
        assert_eq!(conn.read_bytes(1), b"N", "{addr}");
        let replies = conn.until_closed();
        assert_eq!(replies.len(), 1, "{addr}: {replies:?}");
        let message = assert_error(&replies[0], "FATAL", "08P01");
        eprintln!("{addr}: {message}");
    }
}

#[test]
fn cancel_with_unknown_key_does_nothing() {
    let cluster = PgCluster::start();
    install_fence(&cluster);
    let proxy = proxy_for(&cluster);
    let (mut busy, startup) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    let key = startup
        .iter()
        .find(|m| m.tag == b'K')
        .expect("BackendKeyData");
    let pid = i32::from_be_bytes(key.body[..4].try_into().unwrap());
    let secret = i32::from_be_bytes(key.body[4..8].try_into().unwrap());
    let real_pid: i32 = {
        busy.send(&wire::query("SELECT pg_backend_pid()"));
        let replies = busy.until_ready();
        let row = replies.iter().find_map(|m| m.data_row()).unwrap();
        String::from_utf8(row[0].clone().unwrap())
            .unwrap()
            .parse()
            .unwrap()
    };
    busy.send(&wire::query("SELECT pg_sleep(1), 'slept'"));
    std::thread::sleep(Duration::from_millis(200));
    for (what, p, k) in [
        ("a made-up key", 12345, 67890),
        (
            "the session's pid with a wrong key",
            pid,
            secret.wrapping_add(1),
        ),
        ("the upstream's real pid", real_pid, secret),
    ] {
        let mut conn = RawConn::connect(proxy.addr());
        conn.send(&wire::cancel_request(p, k));
        let replies = conn.until_closed();
        assert!(replies.is_empty(), "cancel with {what}: {replies:?}");
    }
    let replies = busy.until_ready();
    assert!(
        replies.iter().all(|m| m.tag != b'E'),
        "a cancel with a wrong key cancelled the query: {replies:?}"
    );
    let rows: Vec<_> = replies.iter().filter_map(|m| m.data_row()).collect();
    assert_eq!(rows.len(), 1, "{replies:?}");
    assert_eq!(rows[0][1].as_deref(), Some(&b"slept"[..]));

    // The right key still works, afterwards (sent until it lands: a cancel that arrives
    // before the query started is lost).
    busy.send(&wire::query("SELECT pg_sleep(30)"));
    let first = loop {
        std::thread::sleep(Duration::from_millis(200));
        let mut conn = RawConn::connect(proxy.addr());
        conn.send(&wire::cancel_request(pid, secret));
        assert!(conn.until_closed().is_empty());
        if let Ok(Read1::Msg(m)) = busy.next(Duration::from_millis(500)) {
            break m;
        }
    };
    let mut replies = vec![first];
    if replies[0].tag != b'Z' {
        replies.extend(busy.until_ready());
    }
    let error = replies.iter().find(|m| m.tag == b'E').expect("cancelled");
    assert_error(error, "ERROR", "57014");
}

/// Logs in through pgfence at `addr`, which cannot reach its upstream: the one reply, a
/// FATAL 08006, and its message.
fn login_refused_upstream(addr: SocketAddr) -> String {
    let mut conn = RawConn::connect(addr);
    conn.send(&login_bytes());
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "08006")
}

/// An upstream that accepts connections and says nothing: a client's login ends with
/// FATAL 08006 after `limits.connect_timeout`, rather than hold both connections for good
/// (a review found them in CLOSE-WAIT, the client slots all taken). And what a client names
/// itself is logged escaped: a database name with a line break forges no log line.
#[test]
fn a_silent_upstream_ends_the_login_and_names_stay_on_their_line() {
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for conn in silent.incoming() {
            held.push(conn);
        }
    });
    let mut config = pgfence_config::Config::default();
    config.upstream.port = port;
    config.limits.connect_timeout = Duration::from_secs(1);
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let message = login_refused_upstream(proxy.addr());
    assert!(
        message.contains("no reply to the startup packet"),
        "{message}"
    );

    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&wire::startup_version(
        wire::PROTOCOL_3_0,
        &[
            ("user", b"postgres"),
            ("database", b"db\nFORGED line"),
            ("replication", b"true"),
        ],
    ));
    conn.until_closed();
    let logs = proxy.logs();
    assert!(logs.contains("replication connection"), "{logs}");
    assert!(!logs.lines().any(|l| l.starts_with("FORGED")), "{logs}");
}

/// What a client sent before it left runs, as on PostgreSQL: a pipelined `COMMIT` behind a
/// Terminate, or behind the end of what the client sends (a half-closed socket, whose
/// replies it still reads). pgfence once closed the server connection at once, and the
/// backend died before it read the `COMMIT` (a review; older than stop 51).
#[test]
fn what_a_client_sent_before_it_left_still_runs() {
    let cluster = PgCluster::start();
    install_fence(&cluster);
    cluster.psql(APP_DB, "CREATE TABLE left_behind (tag text)");
    // The binary: its worker runtimes have no tokio timer (see `pgfence::deadline`).
    let proxy = ProxyProcess::builder()
        .config(Proxy::config_for(&cluster))
        .args(["--config", "{config}"])
        .start();
    let pipeline = |tag: &str| {
        [
            wire::query("BEGIN"),
            wire::query(format!("INSERT INTO left_behind VALUES ('{tag}')")),
            wire::query("SELECT pg_sleep(0.2)"),
            wire::query("COMMIT"),
        ]
        .concat()
    };
    // Terminate behind it, the socket left open and unread.
    let (mut terminated, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    terminated.send(&[pipeline("terminated"), wire::terminate()].concat());
    // Half-closed: every reply still comes.
    let (mut half, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    half.send(&pipeline("half-closed"));
    half.try_clone_stream()
        .shutdown(std::net::Shutdown::Write)
        .unwrap();
    let replies = half.until_closed();
    assert_eq!(
        replies.iter().filter(|m| m.tag == b'Z').count(),
        4,
        "{replies:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let rows = cluster.psql(
            APP_DB,
            "SELECT string_agg(tag, ',' ORDER BY tag) FROM left_behind",
        );
        if rows.trim() == "half-closed,terminated" {
            break;
        }
        assert!(Instant::now() < deadline, "committed: {rows:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(terminated);
    let logs = proxy.logs();
    assert!(!logs.contains("pgfence bug"), "{logs}");
}

#[test]
fn upstream_down_gives_fatal_naming_it() {
    // Nothing listens on this port.
    let dead_port = free_port();
    let mut config = pgfence_config::Config::default();
    config.upstream.port = dead_port;
    config.limits.connect_timeout = Duration::from_secs(2);
    let proxy = Proxy::start(config);
    let message = login_refused_upstream(proxy.addr());
    let upstream = format!("127.0.0.1:{dead_port}");
    assert!(message.contains(&upstream), "{message}");

    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let Err(err) = rt.block_on(try_connect_to(&proxy.connstr(APP_DB))) else {
        panic!("no upstream, no session");
    };
    let db = err.as_db_error().expect("a server error, not an I/O error");
    assert_eq!(db.code().code(), "08006");
    assert_eq!(db.severity(), "FATAL");
    assert!(db.message().contains(&upstream), "{db:?}");
    drop(proxy);

    // An upstream that goes away mid-session and comes back.
    let mut cluster = PgCluster::start();
    let proxy = proxy_for(&cluster);
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    cluster.stop_server();
    // PostgreSQL says goodbye (57P01 admin_shutdown), pgfence passes it on and closes.
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "57P01");
    let message = login_refused_upstream(proxy.addr());
    assert!(
        message.contains(&format!("127.0.0.1:{}", cluster.port())),
        "{message}"
    );
    cluster.start_server();
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    let rows = conn.query_rows("SELECT 'back'");
    assert_eq!(rows, vec![vec![Some(b"back".to_vec())]]);
}

#[test]
fn a_backend_that_dies_gives_fatal_08006() {
    // A server process killed mid-session says nothing; pgfence tells its client.
    let cluster = PgCluster::start();
    let proxy = proxy_for(&cluster);
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    conn.send(&wire::query("SELECT pg_backend_pid()"));
    let pid = conn
        .until_ready()
        .iter()
        .find_map(|m| m.data_row())
        .and_then(|row| row[0].clone())
        .map(|pid| String::from_utf8(pid).unwrap().parse::<i32>().unwrap())
        .expect("the backend's pid");
    kill(Pid::from_raw(pid), Signal::SIGKILL).expect("kill the backend");
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    let message = assert_error(&replies[0], "FATAL", "08006");
    assert!(
        message.contains("the server closed the connection unexpectedly"),
        "{message}"
    );
    let hint = replies[0].field(b'H').unwrap_or_default();
    assert!(hint.contains("may or may not have committed"), "{hint}");

    // A server's own FATAL is passed on alone, with nothing of pgfence's after it.
    let mut conn = login_after_restart(proxy.addr());
    conn.send(&wire::query("SET idle_session_timeout = '100ms'"));
    conn.until_ready();
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    assert_error(&replies[0], "FATAL", "57P05");
}

/// Logs in through `proxy` once PostgreSQL, restarting after a crash, takes logins again:
/// a session that still answers `SELECT 1` 300 ms after its login (a login taken before the
/// postmaster saw the crash is ended by its restart; a loaded machine once showed one).
fn login_after_restart(proxy: SocketAddr) -> RawConn {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut conn = RawConn::connect(proxy);
        conn.send(&wire::startup(SUPERUSER, APP_DB));
        let mut seen = Vec::new();
        let mut logged_in = false;
        loop {
            match conn.next(Duration::from_secs(10)) {
                Ok(Read1::Msg(m)) if m.tag == b'Z' && logged_in => return conn,
                Ok(Read1::Msg(m)) if m.tag == b'Z' => {
                    logged_in = true;
                    std::thread::sleep(Duration::from_millis(300));
                    conn.send(&wire::query("SELECT 1"));
                }
                Ok(Read1::Msg(m)) if m.tag == b'E' => {
                    seen.push(m);
                    break;
                }
                Ok(Read1::Msg(m)) => seen.push(m),
                Ok(Read1::Closed) | Err(_) => break,
            }
        }
        assert!(
            Instant::now() < deadline,
            "PostgreSQL did not take logins again after its restart: {seen:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The Query that makes a debug build of pgfence panic (`PGFENCE_TEST_PANIC`, see
/// `proxy/src/failpoint.rs`).
const PANIC_SQL: &str = "SELECT 'pgfence test: panic here'";
/// The counter of panics in `/metrics`.
const PANICS: &str = "pgfence_panics_total";

#[test]
fn a_session_that_panics_gets_fatal_xx000_and_the_others_go_on() {
    let cluster = PgCluster::start();
    install_fence(&cluster);
    let mut config = Proxy::config_for(&cluster);
    config.pool.reuse_servers = false;
    config.admin.users = vec![SUPERUSER.into()];
    let metrics = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}", "--threads", "2"])
        .args(["--metrics-addr", &metrics.to_string()])
        .env("PGFENCE_TEST_PANIC", PANIC_SQL)
        .start();
    assert_eq!(scrape(metrics).must(PANICS, &[]), 0.0);
    let mut bystanders = Bystanders::start(proxy.addr(), &cluster);
    let backends = other_backends(&cluster);

    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    conn.send(&wire::query("BEGIN; INSERT INTO bystander VALUES (100)"));
    conn.until_ready();
    conn.send(&wire::query(PANIC_SQL));
    let replies = conn.until_closed();
    assert_eq!(
        replies.len(),
        1,
        "one FATAL error, then the close (the failpoint needs a debug build of pgfence): \
         {replies:?}"
    );
    let message = assert_error(&replies[0], "FATAL", "XX000");
    assert_eq!(
        message,
        "pgfence internal error: PGFENCE_TEST_PANIC: a panic the test asked for"
    );
    let hint = replies[0].field(b'H').unwrap_or_default();
    assert!(hint.contains("bug in pgfence"), "{hint}");
    // Its server connection is closed, not kept: the open transaction rolls back (the
    // bystanders' row count below leaves no room for its row).
    wait_for_backends(&cluster, backends, "the session that panicked");
    bystanders.check("a session that panicked");

    // The console lists the bystanders and itself, not the session that panicked.
    let (mut console, _) = RawConn::login(proxy.addr(), SUPERUSER, "pgfence");
    console.send(&wire::query("SHOW CLIENTS"));
    let replies = console.until_ready();
    let rows = replies.iter().filter(|m| m.data_row().is_some()).count();
    assert_eq!(rows, 3, "{replies:?}");

    // Operators can alert on it, and the log says what failed and where (the panic hook),
    // and whose session it was.
    assert_eq!(scrape(metrics).must(PANICS, &[]), 1.0);
    let logs = proxy.logs();
    assert!(
        logs.contains("pgfence bug: a thread panicked") && logs.contains("failpoint.rs"),
        "{logs}"
    );
    assert!(
        logs.lines()
            .any(|l| l.contains("pgfence bug: a session panicked")
                && l.contains("user=\"postgres\"")
                && l.contains("database=\"app\"")),
        "{logs}"
    );
    bystanders.finish(&cluster);
}

#[test]
fn missing_upstream_socket_gives_fatal_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut config = pgfence_config::Config::default();
    config.upstream.host = dir.path().display().to_string();
    config.upstream.port = 5999;
    let proxy = Proxy::start(config);
    let message = login_refused_upstream(proxy.addr());
    let socket = dir.path().join(".s.PGSQL.5999").display().to_string();
    assert!(message.contains(&socket), "{message}");
}

#[test]
fn the_binary_s_worker_threads_time_out_silent_clients() {
    let cluster = PgCluster::start();
    let mut config = Proxy::config_for(&cluster);
    config.limits.startup_timeout = Duration::from_secs(1);
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}", "--threads", "2"])
        .start();
    // One silent client per worker thread (sessions are dealt out in turn), and a session
    // that logs in between them, unaffected.
    let full = login_bytes();
    let started = Instant::now();
    let mut silent: Vec<RawConn> = (0..2)
        .map(|_| {
            let mut conn = RawConn::connect(proxy.addr());
            conn.send(&full[..6]);
            conn
        })
        .collect();
    let (mut working, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    for conn in &mut silent {
        let replies = conn.until_closed();
        assert_eq!(replies.len(), 1, "{replies:?}");
        assert_error(&replies[0], "FATAL", "08P01");
    }
    let elapsed = started.elapsed();
    assert!(
        elapsed >= Duration::from_millis(900) && elapsed < Duration::from_secs(10),
        "closed after {elapsed:?}, with a startup timeout of 1 s"
    );
    working.send(&wire::query("SELECT 1"));
    assert!(working.until_ready().iter().any(|m| m.tag == b'D'));
}

/// VmRSS of process `pid`, KiB.
fn rss_kib(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("a VmRSS line")
}

/// How much more than `base` KiB process `pid` holds: looked at until below `limit` KiB,
/// for up to 2 s.
fn settled_growth(pid: u32, base: u64, limit: u64) -> u64 {
    let until = Instant::now() + Duration::from_secs(2);
    loop {
        let grown = rss_kib(pid).saturating_sub(base);
        if grown < limit || Instant::now() > until {
            return grown;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// pgfence reads ahead of the server, so a client that pipelines without reading replies
/// (5-byte Syncs, each owing a reply pgfence tracks) once grew it by hundreds of MB in
/// seconds, until the OOM killer took every session; PostgreSQL alone stops reading such a
/// client once its replies cannot be written. And buffers that a large message grew were
/// kept by the idle session (99 MB after a 50 MB row). Found by a review, 2026-12-06.
#[test]
fn pgfence_memory_stays_bounded() {
    use std::io::Write;
    let cluster = PgCluster::start();
    let mut config = Proxy::config_for(&cluster);
    config.pool.reuse_servers = false;
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let (mut warm, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    warm.send(&wire::query("SELECT 1"));
    warm.until_ready();
    let base = rss_kib(proxy.pid());

    // Syncs for 4 s, no reply read; then the same to the admin console, which answers
    // by itself (a review once grew pgfence past 2 GB that way), and `SHOW CONFIG`s.
    for (database, what, message) in [
        (APP_DB, "Syncs", wire::sync()),
        ("pgfence", "Syncs to the console", wire::sync()),
        ("pgfence", "SHOW CONFIGs", wire::query("SHOW CONFIG")),
    ] {
        let (flood, _) = RawConn::login(proxy.addr(), SUPERUSER, database);
        let mut socket = flood.try_clone_stream();
        socket
            .set_write_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        let messages = message.repeat(65_000 / message.len());
        let until = Instant::now() + Duration::from_secs(4);
        let mut sent = 0usize;
        while Instant::now() < until {
            match socket.write(&messages) {
                Ok(n) => sent += n,
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) => panic!("after {sent} bytes of {what}: {e}"),
            }
        }
        let grown = rss_kib(proxy.pid()).saturating_sub(base);
        eprintln!("{sent} bytes of {what} unread: pgfence grew by {grown} KiB");
        assert!(
            grown < 32 * 1024,
            "pgfence grew by {grown} KiB while a client sent {sent} bytes of {what} without \
             reading"
        );
        drop((socket, flood));
    }

    // A 100 MB row the client reads only after a while: it goes on as it arrives, as
    // through PgBouncer (held whole, three sessions' 300 MB rows took pgfence past 1 GB;
    // a review, stop 55), and the server waits for the client. With COPY TO STDOUT too.
    for (sql, tag) in [
        ("SELECT repeat('z', 100000000)", b'D'),
        ("COPY (SELECT repeat('z', 100000000)) TO STDOUT", b'd'),
    ] {
        let (mut slow, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
        slow.send(&wire::query(sql));
        std::thread::sleep(Duration::from_secs(2));
        let grown = rss_kib(proxy.pid()).saturating_sub(base);
        eprintln!("a 100 MB message unread: pgfence grew by {grown} KiB");
        assert!(
            grown < 32 * 1024,
            "pgfence grew by {grown} KiB while a client did not read a 100 MB message"
        );
        let replies = slow.until_ready();
        let message = replies.iter().find(|m| m.tag == tag).expect("the message");
        assert!(
            message.body.len() > 100_000_000
                && message.body[message.body.len() - 100_000_000..]
                    .iter()
                    .filter(|&&b| b != b'z')
                    .count()
                    <= 1,
            "the message arrived changed ({} bytes)",
            message.body.len()
        );
        slow.send(&wire::query("SELECT 1"));
        assert!(slow.until_ready().iter().any(|m| m.tag == b'D'));
    }

    // Over the extended protocol, a row streamed while the client's Sync is still to come
    // (in a later write): the server sends the row's end only at a Sync or Flush, which
    // pgfence did not read while it streamed, and the session hung (review O, stop 55).
    let (mut later, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    for _ in 0..3 {
        later.send(
            &[
                wire::parse("", "SELECT repeat('x', 300000)", &[]),
                wire::bind("", "", &[]),
                wire::execute("", 0),
            ]
            .concat(),
        );
        std::thread::sleep(Duration::from_millis(300));
        later.send(&wire::sync());
        let replies = later.until_ready();
        assert!(
            replies
                .iter()
                .any(|m| m.tag == b'D' && m.body.len() == 2 + 4 + 300_000),
            "{:?}",
            replies.iter().map(|m| m.tag as char).collect::<String>()
        );
    }

    // A 50 MB row and a 50 MB Query, then the session idles.
    let (mut big, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);
    big.send(&wire::query("SELECT repeat('x', 50000000)"));
    let replies = big.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "big row failed");
    big.send(&wire::query(format!(
        "SELECT length('{}')",
        "y".repeat(50_000_000)
    )));
    let replies = big.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "big Query failed");
    // The session gives its buffers back once it has written the last reply, a moment
    // after the client read it.
    let grown = settled_growth(proxy.pid(), base, 32 * 1024);
    eprintln!("after a 50 MB row and Query, idle: pgfence holds {grown} KiB more");
    assert!(
        grown < 32 * 1024,
        "pgfence keeps {grown} KiB more for an idle session that once had a 50 MB row and Query"
    );
    big.send(&wire::query("SELECT 1"));
    big.until_ready();
}
