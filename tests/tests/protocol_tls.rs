//! TLS that pgfence terminates for its clients (`[client_tls]`, PgBouncer's
//! `client_tls_*`). Certificates are made per test (a CA and a certificate for `localhost`
//! and `127.0.0.1`); the upstream connection stays plain.
//!
//! - [`tls_clients_get_tls_and_the_fence`]: `sslmode=allow`. psql with `verify-full`
//!   connects over TLS (and fails against a CA that did not sign pgfence's certificate); a
//!   plain client still connects; the fence works over TLS (a token accepted, a stale one
//!   rejected with FN001); `SHOW CLIENTS` shows the TLS version and suite of a TLS session
//!   and nothing for a plain one; 20 MB of COPY out and in pass through TLS intact, so
//!   records the socket did not take at once are flushed.
//! - [`require_refuses_plain_logins`]: `sslmode=require`. A plain TCP login gets FATAL 28000
//!   naming the setting, with a hint; over TLS it works; a plain CancelRequest (what libpq
//!   sends) still cancels a TLS session's query; clients of the Unix-domain socket need no
//!   TLS, as with PostgreSQL.
//! - [`disable_declines_tls`]: the default. An SSLRequest is answered `N` and the plain
//!   login that follows works; `sslmode=require` clients are refused by their own libpq.
//! - [`bad_tls_input_is_refused`], byte-exact: an SSLRequest with bytes after it in the same
//!   packet gets `N` and FATAL 08P01; a second SSLRequest inside TLS gets FATAL 08P01;
//!   garbage instead of a TLS ClientHello and a client that closes mid-handshake close
//!   only their own connection, and pgfence keeps serving.
//! - [`direct_tls_negotiation`]: a client that opens with a TLS ClientHello (PostgreSQL 17's
//!   `sslnegotiation=direct`) and offers ALPN `postgresql` gets a session; one without
//!   ALPN is closed after the handshake, as PostgreSQL closes it; with TLS off the
//!   ClientHello is an invalid startup packet (FATAL 08P01).
//! - [`psycopg_over_tls`]: the psycopg scripts (extended protocol, pipelining, COPY,
//!   notifications, cancel, SCRAM login) through pgfence with `sslmode=require` and clients
//!   on `verify-full`.
//! - [`verify_modes_check_client_certificates`]: `verify-full` lets in a client whose
//!   certificate, signed by a CA of `client_tls.ca_file`, names the user it logs in as;
//!   refuses a certificate for another user (FATAL 28000, byte-exact), a client without a
//!   certificate, one from another CA, and a plain login (FATAL 28000 naming the mode);
//!   `verify-ca` checks the chain only, and `SHOW CLIENTS` shows each session's
//!   certificate CN; `require` with a CA file asks for a certificate
//!   but lets in a client without one, and still refuses one from another CA.
//! - [`reload_swaps_the_certificate`]: a client that does not trust the certificate shows
//!   in pgfence's log (INFO, TLS handshake failed); RELOAD with a certificate from another CA
//!   serves it to new clients; a key file that does not go with the certificate fails the reload and the
//!   previous certificate stays in force.

use std::io::{Read, Write};
use std::process::Command;
use std::time::Duration;

use harness::tls::TestCerts;
use harness::wire::{self, split_messages, Msg};
use harness::{
    pg_bin_dir, psql_conninfo, python_or_skip, run_command, run_python, PgCluster, Proxy,
    ProxyProcess, APP_DB, SUPERUSER,
};
use pgfence_config::ClientSslMode;

const PSQL_TIMEOUT: Duration = Duration::from_secs(120);

fn tls_config(
    cluster: &PgCluster,
    certs: &TestCerts,
    mode: ClientSslMode,
) -> pgfence_config::Config {
    let mut config = Proxy::config_for(cluster);
    config.client_tls.sslmode = mode;
    config.client_tls.cert_file = Some(certs.cert_file.clone());
    config.client_tls.key_file = Some(certs.key_file.clone());
    config
}

/// psql on `port` as `postgres` on `app`, with `conn` (more key=value pairs, e.g. TLS
/// settings) and `sql`; the outcome.
fn psql(port: u16, conn: &str, sql: &str) -> harness::Outcome {
    psql_conninfo(
        port,
        &format!("user={SUPERUSER} dbname={APP_DB} {conn}"),
        sql,
    )
}

/// Like [`psql`], and the run must succeed: its stdout.
fn psql_ok(port: u16, conn: &str, sql: &str) -> String {
    let out = psql(port, conn, sql);
    assert!(
        out.success(),
        "psql {conn:?} -c {sql:?} failed ({})\n{}{}",
        out.describe(),
        out.stdout,
        out.stderr
    );
    out.stdout
}

fn ssl_of_session(port: u16, conn: &str) -> String {
    // The upstream connection is plain; what psql reports is its own connection.
    psql_ok(port, conn, "\\conninfo")
}

#[test]
fn tls_clients_get_tls_and_the_fence() {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    cluster.psql(
        APP_DB,
        "CREATE TABLE charges (amount int); CREATE TABLE bulk (n int, line text)",
    );
    let certs = TestCerts::new("pgfence test CA");
    let mut config = tls_config(&cluster, &certs, ClientSslMode::Allow);
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = Proxy::start(config);
    let port = proxy.port();
    let verify = certs.verify_full();

    let info = ssl_of_session(port, &verify);
    assert!(info.contains("SSL connection (protocol: TLSv1.3"), "{info}");
    let plain = ssl_of_session(port, "sslmode=disable");
    assert!(!plain.contains("SSL connection"), "{plain}");

    // Verification is real: a CA that did not sign pgfence's certificate is refused.
    let other = TestCerts::new("another CA");
    let out = psql(port, &other.verify_full(), "SELECT 1");
    assert!(
        !out.success(),
        "a foreign CA must fail verify-full: {}",
        out.stdout
    );
    assert!(
        out.stderr.contains("certificate verify failed"),
        "{}",
        out.stderr
    );

    // The fence over TLS.
    let token =
        |t: u32| format!("{verify} options='-c fencing.resource=billing -c fencing.token={t}'");
    psql_ok(port, &token(34), "INSERT INTO charges VALUES (100)");
    let stale = psql(port, &token(33), "INSERT INTO charges VALUES (100)");
    assert!(!stale.success());
    assert!(
        stale
            .stderr
            .contains("stale fencing token 33 for resource \"billing\""),
        "{}",
        stale.stderr
    );
    assert_eq!(
        cluster.psql(APP_DB, "SELECT count(*) FROM charges").trim(),
        "1"
    );

    // SHOW CLIENTS: the TLS session's version and suite; nothing for the plain console.
    let mut tls = certs.connect(proxy.addr());
    tls.write_all(&wire::startup(SUPERUSER, APP_DB)).unwrap();
    let login = read_until_ready(&mut tls);
    assert!(login.iter().any(|m| m.tag == b'K'), "{login:?}");
    let clients = psql_ok(port, "sslmode=disable dbname=pgfence", "SHOW CLIENTS");
    let tls_rows: Vec<_> = clients
        .lines()
        .filter(|l| l.contains("TLSv1_3/TLS13_"))
        .collect();
    assert_eq!(tls_rows.len(), 1, "one TLS client:\n{clients}");
    assert!(
        clients
            .lines()
            .any(|l| l.contains("|pgfence|") && l.ends_with('|')),
        "the console's own plain session has an empty tls column:\n{clients}"
    );
    tls.write_all(&wire::query("SELECT 41 + 1")).unwrap();
    let reply = read_until_ready(&mut tls);
    let row = reply.iter().find_map(Msg::data_row).expect("a row");
    assert_eq!(row, vec![Some(b"42".to_vec())]);
    // A reply larger than the socket buffers, to a client that reads late.
    tls.write_all(&wire::query("SELECT repeat('x', 10000000)"))
        .unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let reply = read_until_ready(&mut tls);
    let row = reply.iter().find_map(Msg::data_row).expect("a row");
    assert_eq!(row[0].as_ref().map(Vec::len), Some(10_000_000));
    tls.write_all(&wire::terminate()).unwrap();

    // 20 MB each way: more than the socket buffers take at once.
    let sql =
        "COPY (SELECT g, repeat(md5(g::text), 3) FROM generate_series(1, 200000) g) TO STDOUT";
    let through = psql_ok(port, &verify, sql);
    let direct = cluster.psql(APP_DB, &format!("{sql};"));
    assert!(through.len() > 19_000_000, "{} bytes", through.len());
    assert!(
        through == direct,
        "COPY out through TLS differs from PostgreSQL's"
    );
    let mut cmd = Command::new(pg_bin_dir().join("psql"));
    cmd.args(["-X", "-v", "ON_ERROR_STOP=1", "-c", "COPY bulk FROM STDIN"])
        .arg(format!(
            "host=127.0.0.1 port={port} user={SUPERUSER} dbname={APP_DB} {verify} \
             options='-c fencing.resource=billing -c fencing.token=34'"
        ));
    let copied = run_command(&mut cmd, Some(through.as_bytes()), PSQL_TIMEOUT);
    assert!(
        copied.success(),
        "COPY in over TLS: {}{}",
        copied.stdout,
        copied.stderr
    );
    assert_eq!(copied.stdout.trim(), "COPY 200000");
    let check = cluster.psql(
        APP_DB,
        "SELECT count(*), sum(n), sum(length(line)) FROM bulk",
    );
    assert_eq!(check.trim(), "200000|20000100000|19200000");
    proxy.shutdown().unwrap();
}

/// The complete messages at the start of `bytes`, and how many bytes they take.
fn complete_messages(bytes: &[u8]) -> (Vec<Msg>, usize) {
    let mut at = 0;
    while let Some(header) = bytes.get(at..at + 5) {
        let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
        if bytes.len() < at + 1 + len {
            break;
        }
        at += 1 + len;
    }
    (split_messages(&bytes[..at]), at)
}

/// Reads messages from a TLS stream up to and including ReadyForQuery.
fn read_until_ready<S: Read>(s: &mut S) -> Vec<Msg> {
    let mut bytes = Vec::new();
    let mut chunk = vec![0u8; 64 * 1024];
    let mut msgs = Vec::new();
    loop {
        let (done, used) = complete_messages(&bytes);
        bytes.drain(..used);
        let ready = done.iter().any(|m| m.tag == b'Z');
        msgs.extend(done);
        if ready {
            return msgs;
        }
        let n = s.read(&mut chunk).expect("read from pgfence");
        assert!(n > 0, "pgfence closed after {msgs:?}");
        bytes.extend_from_slice(&chunk[..n]);
    }
}

/// Reads until the peer closes (or fails); the messages read.
fn read_to_close<S: Read>(s: &mut S) -> Vec<Msg> {
    let mut bytes = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => return split_messages(&bytes),
            Ok(n) => bytes.extend_from_slice(&chunk[..n]),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn require_refuses_plain_logins() {
    let cluster = PgCluster::start();
    let certs = TestCerts::new("pgfence test CA");
    let dir = tempfile::tempdir().unwrap();
    let mut config = tls_config(&cluster, &certs, ClientSslMode::Require);
    config.unix_socket_dir = Some(dir.path().display().to_string());
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let port = proxy.port();

    let plain = psql(port, "sslmode=disable", "SELECT 1");
    assert!(!plain.success());
    assert!(
        plain.stderr.contains(
            "FATAL:  pgfence requires TLS from its clients (client_tls.sslmode = require)"
        ),
        "{}",
        plain.stderr
    );
    assert!(
        plain.stderr.contains("HINT:  Connect with sslmode=require"),
        "{}",
        plain.stderr
    );
    // The SQLSTATE, byte-exact.
    let mut raw = wire::RawConn::connect(proxy.addr());
    raw.send(&wire::startup(SUPERUSER, APP_DB));
    let refused = raw.until_closed();
    assert_eq!(refused.len(), 1, "{refused:?}");
    wire::assert_error(&refused[0], "FATAL", "28000");

    assert_eq!(psql_ok(port, &certs.verify_full(), "SELECT 1").trim(), "1");
    // prefer: libpq asks for TLS, gets it.
    let info = ssl_of_session(port, "sslmode=prefer");
    assert!(info.contains("SSL connection"), "{info}");

    // Local clients need no TLS.
    let local = psql(
        port,
        &format!("host={} sslmode=disable", dir.path().display()),
        "SELECT 2",
    );
    assert!(local.success(), "{}{}", local.stderr, proxy.logs());
    assert_eq!(local.stdout.trim(), "2");

    // libpq 15 sends a CancelRequest on a new plain connection, whatever its session uses.
    let mut cmd = Command::new(pg_bin_dir().join("psql"));
    cmd.args(["-X", "-At", "-c", "SELECT pg_sleep(60)"])
        .arg(format!(
            "host=127.0.0.1 port={port} user={SUPERUSER} dbname={APP_DB} {}",
            certs.verify_full()
        ));
    let sleeper = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let watcher = harness::connect_to(&cluster.connstr(APP_DB)).await;
    let sleeping = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE 'SELECT pg_sleep(60)%' AND state = 'active'";
    let start = std::time::Instant::now();
    while watcher
        .query_one(sleeping, &[])
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the sleep never started"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // SIGINT makes psql send the cancel request.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(sleeper.id() as i32),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let out = sleeper.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("canceling statement due to user request"),
        "{stderr}\n{}",
        proxy.logs()
    );
    assert!(start.elapsed() < Duration::from_secs(30));
}

#[test]
fn disable_declines_tls() {
    let cluster = PgCluster::start();
    let proxy = Proxy::for_cluster(&cluster);
    let mut raw = wire::RawConn::connect(proxy.addr());
    raw.send(&wire::ssl_request());
    assert_eq!(raw.read_bytes(1), b"N");
    raw.send(&wire::startup(SUPERUSER, APP_DB));
    let login = raw.until_ready();
    assert_eq!(login.last().and_then(Msg::ready_status), Some(b'I'));

    let out = psql(proxy.port(), "sslmode=require", "SELECT 1");
    assert!(!out.success());
    assert!(
        out.stderr
            .contains("server does not support SSL, but SSL was required"),
        "{}",
        out.stderr
    );
    assert_eq!(
        psql_ok(proxy.port(), "sslmode=prefer", "SELECT 1").trim(),
        "1"
    );
    proxy.shutdown().unwrap();
}

#[test]
fn bad_tls_input_is_refused() {
    let cluster = PgCluster::start();
    let certs = TestCerts::new("pgfence test CA");
    let proxy = Proxy::start(tls_config(&cluster, &certs, ClientSslMode::Allow));
    let addr = proxy.addr();

    // Bytes after the SSLRequest, before the answer: declined, then refused.
    let mut raw = wire::RawConn::connect(addr);
    let mut packet = wire::ssl_request();
    packet.extend_from_slice(&wire::startup(SUPERUSER, APP_DB));
    raw.send(&packet);
    assert_eq!(raw.read_bytes(1), b"N");
    let refused = raw.until_closed();
    assert_eq!(refused.len(), 1, "{refused:?}");
    let text = wire::assert_error(&refused[0], "FATAL", "08P01");
    assert!(
        text.contains("before pgfence answered its encryption request"),
        "{text}"
    );

    // A second SSLRequest inside TLS.
    let mut tls = certs.connect(addr);
    tls.write_all(&wire::ssl_request()).unwrap();
    let refused = read_to_close(&mut tls);
    assert_eq!(refused.len(), 1, "{refused:?}");
    let text = wire::assert_error(&refused[0], "FATAL", "08P01");
    assert!(text.contains("already encrypted"), "{text}");

    // Garbage where the ClientHello belongs: that connection closes.
    let mut raw = wire::RawConn::connect(addr);
    raw.send(&wire::ssl_request());
    assert_eq!(raw.read_bytes(1), b"S");
    let _ = raw.try_send(b"GET / HTTP/1.1\r\nHost: pgfence\r\n\r\n");
    let rest = raw.read_to_end();
    assert!(!rest.windows(4).any(|w| w == b"HTTP"), "{rest:?}");

    // A client that goes away mid-handshake.
    let mut tcp = std::net::TcpStream::connect(addr).unwrap();
    tcp.write_all(&wire::ssl_request()).unwrap();
    let mut s = [0u8; 1];
    tcp.read_exact(&mut s).unwrap();
    tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .unwrap();
    drop(tcp);

    // pgfence still serves, over TLS and plain.
    assert_eq!(
        psql_ok(proxy.port(), &certs.verify_full(), "SELECT 3").trim(),
        "3"
    );
    assert_eq!(
        psql_ok(proxy.port(), "sslmode=disable", "SELECT 4").trim(),
        "4"
    );
    proxy.shutdown().unwrap();
}

#[test]
fn direct_tls_negotiation() {
    let cluster = PgCluster::start();
    let certs = TestCerts::new("pgfence test CA");
    let proxy = Proxy::start(tls_config(&cluster, &certs, ClientSslMode::Allow));
    let mut tls = certs
        .connect_direct(proxy.addr(), true)
        .expect("direct TLS");
    assert_eq!(tls.conn.alpn_protocol(), Some(&b"postgresql"[..]));
    tls.write_all(&wire::startup(SUPERUSER, APP_DB)).unwrap();
    let login = read_until_ready(&mut tls);
    assert_eq!(login.last().and_then(Msg::ready_status), Some(b'I'));
    tls.write_all(&wire::query("SELECT 'direct'")).unwrap();
    let reply = read_until_ready(&mut tls);
    let row = reply.iter().find_map(Msg::data_row).expect("a row");
    assert_eq!(row, vec![Some(b"direct".to_vec())]);
    tls.write_all(&wire::terminate()).unwrap();

    // Without ALPN: the handshake may finish, the session does not start.
    if let Ok(mut tls) = certs.connect_direct(proxy.addr(), false) {
        let _ = tls.write_all(&wire::startup(SUPERUSER, APP_DB));
        let got = read_to_close(&mut tls);
        assert!(got.is_empty(), "{got:?}");
    }
    proxy.shutdown().unwrap();

    // TLS off: a ClientHello is no startup packet.
    let plain = Proxy::for_cluster(&cluster);
    let mut raw = wire::RawConn::connect(plain.addr());
    raw.send(&[0x16, 0x03, 0x01, 0x00, 0x05, 0x01, 0x00, 0x00, 0x01, 0x00]);
    let refused = raw.until_closed();
    assert_eq!(refused.len(), 1, "{refused:?}");
    wire::assert_error(&refused[0], "FATAL", "08P01");
    plain.shutdown().unwrap();
}

#[test]
fn psycopg_over_tls() {
    if python_or_skip("psycopg_over_tls").is_none() {
        return;
    }
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let certs = TestCerts::new("pgfence test CA");
    let proxy = Proxy::start(tls_config(&cluster, &certs, ClientSslMode::Require));
    let dsn = format!("{} {}", proxy.connstr(APP_DB), certs.verify_full());
    let direct = cluster.connstr(APP_DB);
    for (script, tests) in [
        (
            "test_smoke.py",
            &["parameterized_query", "pipeline", "copy"][..],
        ),
        (
            "test_protocol.py",
            &[
                "parameters",
                "pipeline",
                "copy",
                "notifications",
                "cancel",
                "scram_login",
            ][..],
        ),
    ] {
        let out = run_python(script, &[("PG_DIRECT_DSN", &direct), ("PGFENCE_DSN", &dsn)]);
        for name in tests {
            assert!(
                out.lines().any(|l| l.starts_with(&format!("ok {name} "))),
                "{script} {name} over TLS did not report ok:\n{out}"
            );
        }
    }
    proxy.shutdown().unwrap();
}

#[test]
fn reload_swaps_the_certificate() {
    let cluster = PgCluster::start();
    let first = TestCerts::new("first CA");
    let second = TestCerts::new("second CA");
    let mut config = tls_config(&cluster, &first, ClientSslMode::Allow);
    // The files pgfence reads: copies, replaced below.
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("pgfence.crt");
    let key = dir.path().join("pgfence.key");
    std::fs::copy(&first.cert_file, &cert).unwrap();
    std::fs::copy(&first.key_file, &key).unwrap();
    config.client_tls.cert_file = Some(cert.clone());
    config.client_tls.key_file = Some(key.clone());
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let port = proxy.port();
    psql_ok(port, &first.verify_full(), "SELECT 1");
    assert!(!psql(port, &second.verify_full(), "SELECT 1").success());
    // The client's refusal of the certificate shows in pgfence's log.
    harness::operating::wait_for_log(&proxy, 0, "TLS handshake with the client failed");

    std::fs::copy(&second.cert_file, &cert).unwrap();
    std::fs::copy(&second.key_file, &key).unwrap();
    psql_ok(port, "sslmode=disable dbname=pgfence", "RELOAD");
    psql_ok(port, &second.verify_full(), "SELECT 1");
    assert!(!psql(port, &first.verify_full(), "SELECT 1").success());

    // A key that does not go with the certificate: the reload fails, nothing changes.
    std::fs::copy(&first.key_file, &key).unwrap();
    let failed = psql(port, "sslmode=disable dbname=pgfence", "RELOAD");
    assert!(!failed.success());
    assert!(
        failed.stderr.contains("does not go with the certificate"),
        "{}",
        failed.stderr
    );
    psql_ok(port, &second.verify_full(), "SELECT 1");
}

/// libpq's TLS settings that verify pgfence and present the client certificate `cert`.
fn with_cert(certs: &TestCerts, (cert, key): &(std::path::PathBuf, std::path::PathBuf)) -> String {
    format!(
        "{} sslcert={} sslkey={}",
        certs.verify_full(),
        harness::quote_conn_value(&cert.display().to_string()),
        harness::quote_conn_value(&key.display().to_string())
    )
}

#[test]
fn verify_modes_check_client_certificates() {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, "CREATE ROLE alice LOGIN");
    let certs = TestCerts::new("pgfence test CA");
    let foreign = TestCerts::new("another CA");
    let postgres_cert = (
        certs.client_cert_file.clone(),
        certs.client_key_file.clone(),
    );
    let alice_cert = certs.client_cert("alice");
    let foreign_cert = (
        foreign.client_cert_file.clone(),
        foreign.client_key_file.clone(),
    );
    let as_alice = |port: u16, conn: &str| {
        psql_conninfo(
            port,
            &format!("user=alice dbname={APP_DB} {conn}"),
            "SELECT current_user",
        )
    };

    let mut config = tls_config(&cluster, &certs, ClientSslMode::VerifyFull);
    config.client_tls.ca_file = Some(certs.ca_file.clone());
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args(["--config", "{config}"])
        .start();
    let port = proxy.port();
    // The certificate names the user: in, as with PostgreSQL's clientcert=verify-full.
    assert_eq!(
        psql_ok(port, &with_cert(&certs, &postgres_cert), "SELECT 1").trim(),
        "1"
    );
    let alice = as_alice(port, &with_cert(&certs, &alice_cert));
    assert!(alice.success(), "{}{}", alice.stderr, proxy.logs());
    assert_eq!(alice.stdout.trim(), "alice");
    // Alice's certificate does not make her postgres.
    let other = psql(port, &with_cert(&certs, &alice_cert), "SELECT 1");
    assert!(!other.success());
    assert!(
        other.stderr.contains(
            "FATAL:  certificate authentication failed for user \"postgres\": the client certificate is for \"alice\" (client_tls.sslmode = verify-full)"
        ),
        "{}",
        other.stderr
    );
    harness::operating::wait_for_log(&proxy, 0, "client certificate is not for the user");
    // Byte-exact: one FATAL 28000, then the connection closes.
    let (cert_pem, key_pem) = (&alice_cert.0, &alice_cert.1);
    let mut raw = certs.connect_with_client_cert(proxy.addr(), cert_pem, key_pem);
    raw.write_all(&wire::startup(SUPERUSER, APP_DB)).unwrap();
    let refused = read_to_close(&mut raw);
    assert_eq!(refused.len(), 1, "{refused:?}");
    wire::assert_error(&refused[0], "FATAL", "28000");
    // No certificate, or one from a CA pgfence does not trust: the handshake fails.
    let logs_before = proxy.logs().len();
    assert!(!psql(port, &certs.verify_full(), "SELECT 1").success());
    harness::operating::wait_for_log(&proxy, logs_before, "TLS handshake with the client failed");
    let logs_before = proxy.logs().len();
    assert!(!psql(port, &with_cert(&certs, &foreign_cert), "SELECT 1").success());
    harness::operating::wait_for_log(&proxy, logs_before, "TLS handshake with the client failed");
    // Plain TCP: refused, naming the mode.
    let plain = psql(port, "sslmode=disable", "SELECT 1");
    assert!(
        plain.stderr.contains(
            "FATAL:  pgfence requires TLS from its clients (client_tls.sslmode = verify-full)"
        ) && plain.stderr.contains("client_tls.ca_file"),
        "{}",
        plain.stderr
    );
    drop(proxy);

    // verify-ca: the chain is checked, the name is not.
    config.client_tls.sslmode = ClientSslMode::VerifyCa;
    let proxy = Proxy::start(config.clone());
    let port = proxy.port();
    assert_eq!(
        psql_ok(port, &with_cert(&certs, &alice_cert), "SELECT current_user").trim(),
        SUPERUSER
    );
    assert!(!psql(port, &certs.verify_full(), "SELECT 1").success());
    assert!(!psql(port, &with_cert(&certs, &foreign_cert), "SELECT 1").success());
    // SHOW CLIENTS names the certificate a session sent (last column).
    let mut open = certs.connect_with_client_cert(proxy.addr(), cert_pem, key_pem);
    open.write_all(&wire::startup(SUPERUSER, APP_DB)).unwrap();
    let login = read_until_ready(&mut open);
    assert!(login.iter().any(|m| m.tag == b'K'), "{login:?}");
    let console = format!("{} dbname=pgfence", with_cert(&certs, &postgres_cert));
    let clients = psql_ok(port, &console, "SHOW CLIENTS");
    assert!(
        clients
            .lines()
            .any(|l| l.contains(&format!("|{SUPERUSER}|{APP_DB}|")) && l.ends_with("|alice")),
        "the session with alice's certificate:\n{clients}"
    );
    assert!(
        clients
            .lines()
            .any(|l| l.contains("|pgfence|") && l.ends_with(&format!("|{SUPERUSER}"))),
        "the console with postgres's certificate:\n{clients}"
    );
    drop(open);
    drop(proxy);

    // require with a CA file: a certificate is asked for, not required; one that is sent
    // must chain to the CA.
    config.client_tls.sslmode = ClientSslMode::Require;
    let proxy = Proxy::start(config);
    let port = proxy.port();
    assert_eq!(psql_ok(port, &certs.verify_full(), "SELECT 1").trim(), "1");
    assert_eq!(
        psql_ok(port, &with_cert(&certs, &alice_cert), "SELECT 2").trim(),
        "2"
    );
    assert!(!psql(port, &with_cert(&certs, &foreign_cert), "SELECT 1").success());
}
