//! TLS from pgfence to the upstream server (`upstream.sslmode`, libpq's names; PgBouncer's
//! `server_tls_sslmode`). The server is a test cluster with `ssl = on` and a certificate
//! from a CA made per test.
//!
//! - [`server_connections_use_tls`]: `verify-full`, with the server refusing plain TCP
//!   logins (`hostnossl ... reject`). `pgfence install` gets in; the backend sees TLS
//!   (`pg_stat_ssl`); the fence works (a token accepted, a stale one rejected); a kept
//!   connection (`SHOW SERVERS` shows its TLS version) serves the next client with its TLS
//!   state (same backend, still TLS) and can be cancelled; a plain client's SCRAM login
//!   works, since `SCRAM-SHA-256-PLUS` is hidden and the client does not ask for channel
//!   binding; a TLS client's default `channel_binding=prefer` gets FATAL 28000 saying why
//!   and what to do, and `channel_binding=disable` logs in.
//!   Every server connection ends with TLS's close_notify: the server logs no connection
//!   cut short, neither for the refused login nor for the sessions open or kept at
//!   shutdown.
//! - [`verification_and_fallback`]: `verify-full` refuses a CA that did not sign the
//!   server's certificate and a certificate for another name; `verify-ca` accepts the
//!   latter; `require` accepts any certificate but needs TLS; `prefer` falls back to plain
//!   TCP on a server without TLS.
//! - [`client_certificate_to_the_server`]: a server that wants a client certificate
//!   (`clientcert=verify-ca`) lets pgfence in with `upstream.sslcert`/`sslkey` and refuses
//!   it without.

use std::time::Duration;

use harness::fence::{assert_rejected, stale};
use harness::tls::TestCerts;
use harness::{
    connect_to, psql_conninfo, try_connect_to, PgCluster, Proxy, APP_DB, SCRAM_PASSWORD,
    SCRAM_USER, SUPERUSER,
};
use pgfence_config::{ClientSslMode, Config, UpstreamSslMode};

const SSL_OF_BACKEND: &str = "SELECT ssl, version FROM pg_stat_ssl WHERE pid = pg_backend_pid()";

fn upstream_tls(cluster: &PgCluster, mode: UpstreamSslMode, ca: Option<&TestCerts>) -> Config {
    let mut config = Proxy::config_for(cluster);
    config.upstream.sslmode = mode;
    config.upstream.sslrootcert = ca.map(|c| c.ca_file.clone());
    config
}

/// What a client gets through a pgfence with `config` that must refuse it: the error, as
/// text.
async fn refusal(config: Config) -> String {
    let proxy = Proxy::start(config);
    let err = try_connect_to(&proxy.connstr(APP_DB)).await.unwrap_err();
    proxy.shutdown().unwrap();
    format!("{err:?}")
}

/// Whether the backend of a session through a pgfence with `config` sees TLS.
async fn backend_tls_through(config: Config) -> bool {
    let proxy = Proxy::start(config);
    let client = connect_to(&proxy.connstr(APP_DB)).await;
    let (ssl, _) = backend_ssl(&client).await;
    drop(client);
    proxy.shutdown().unwrap();
    ssl
}

async fn backend_ssl(client: &tokio_postgres::Client) -> (bool, Option<String>) {
    let row = client.query_one(SSL_OF_BACKEND, &[]).await.unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_connections_use_tls() {
    let cluster = PgCluster::start();
    cluster.psql(
        APP_DB,
        "CREATE TABLE charges (amount int); GRANT ALL ON charges TO PUBLIC",
    );
    let server = TestCerts::new("server CA");
    cluster.enable_ssl(&server.cert_file, &server.key_file);
    // From here on, only TLS gets in over TCP.
    cluster.refuse_plain_tcp();
    let plain = try_connect_to(&cluster.connstr(APP_DB)).await.unwrap_err();
    assert!(format!("{plain:?}").contains("no encryption"), "{plain:?}");
    let proxy_certs = TestCerts::new("pgfence CA");
    let mut config = upstream_tls(&cluster, UpstreamSslMode::VerifyFull, Some(&server));
    // `pgfence install` connects as the proxy does.
    pgfence::install::install(&config, APP_DB, SUPERUSER, None, None)
        .await
        .unwrap();
    config.client_tls.sslmode = ClientSslMode::Allow;
    config.client_tls.cert_file = Some(proxy_certs.cert_file.clone());
    config.client_tls.key_file = Some(proxy_certs.key_file.clone());
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = Proxy::start(config);

    let token = |t: u32| {
        format!(
            "{} options='-c fencing.resource=billing -c fencing.token={t}'",
            proxy.connstr(APP_DB)
        )
    };
    let leader = connect_to(&token(34)).await;
    let (ssl, version) = backend_ssl(&leader).await;
    assert!(ssl, "the server connection uses TLS");
    assert_eq!(version.as_deref(), Some("TLSv1.3"));
    leader
        .batch_execute("INSERT INTO charges VALUES (100)")
        .await
        .unwrap();
    let deposed = connect_to(&token(33)).await;
    let r = deposed
        .batch_execute("INSERT INTO charges VALUES (100)")
        .await;
    assert_rejected(&r, &stale("billing", 33, 34), "token 33 after 34");
    drop(deposed);

    // The leader leaves; its TLS connection is kept and serves the next such client.
    let pid: i32 = leader
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    drop(leader);
    let console = connect_to(&proxy.connstr("pgfence")).await;
    let start = std::time::Instant::now();
    loop {
        let rows = console.simple_query("SHOW SERVERS").await.unwrap();
        let kept: Vec<_> = rows
            .iter()
            .filter_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(r) => r.get("tls").map(str::to_string),
                _ => None,
            })
            .collect();
        if !kept.is_empty() {
            assert!(kept.iter().all(|t| t.starts_with("TLSv1_3/")), "{kept:?}");
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "nothing was kept"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let next = connect_to(&token(34)).await;
    let again: i32 = next
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(again, pid, "the kept TLS connection is reused");
    assert!(backend_ssl(&next).await.0);
    next.batch_execute("INSERT INTO charges VALUES (100)")
        .await
        .unwrap();
    assert_eq!(
        cluster.psql(APP_DB, "SELECT count(*) FROM charges").trim(),
        "2"
    );
    // A cancel request reaches the TLS session's backend (sent to the server over TLS;
    // `cancel::tests` shows the bytes on the wire).
    let next = harness::fence::cancelled_sleep(next).await;
    assert!(backend_ssl(&next).await.0);

    // SCRAM from a plain client: PLUS is hidden, the client does not bind, the login works.
    let scram = connect_to(&proxy.connstr_as(APP_DB, SCRAM_USER, Some(SCRAM_PASSWORD))).await;
    assert!(backend_ssl(&scram).await.0);

    // SCRAM from a TLS client: libpq's default channel_binding=prefer would be refused by
    // the server as a downgrade; pgfence says why first.
    let scram_tls = format!(
        "user={SCRAM_USER} password={SCRAM_PASSWORD} dbname={APP_DB} {}",
        proxy_certs.verify_full()
    );
    let out = psql_conninfo(proxy.port(), &scram_tls, "SELECT 1");
    assert!(!out.success());
    assert!(
        out.stderr
            .contains("SCRAM channel binding cannot pass through pgfence")
            && out
                .stderr
                .contains("HINT:  Connect with channel_binding=disable"),
        "{}",
        out.stderr
    );
    let out = psql_conninfo(
        proxy.port(),
        &format!("{scram_tls} channel_binding=disable"),
        SSL_OF_BACKEND,
    );
    assert!(out.success(), "{}", out.stderr);
    assert_eq!(out.stdout.trim(), "t|TLSv1.3");
    drop((scram, console));
    proxy.shutdown().unwrap();
    // Kept connections were closed with Terminate and TLS's close_notify: their backends
    // ended without the errors PostgreSQL logs for a TLS peer that just goes away.
    let watcher = cluster.psql(
        APP_DB,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
    );
    let start = std::time::Instant::now();
    let mut left = watcher;
    while left.trim() != "0" {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "backends left: {left}"
        );
        std::thread::sleep(Duration::from_millis(20));
        left = cluster.psql(
            APP_DB,
            "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        );
    }
    let log = cluster.server_log();
    for sign in [
        "SSL error",
        "could not receive data from client",
        "unexpected EOF",
    ] {
        assert!(!log.contains(sign), "{sign:?} in the server log:\n{log}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verification_and_fallback() {
    let plain_cluster = PgCluster::start();
    let cluster = PgCluster::start();
    let server = TestCerts::new("server CA");
    cluster.enable_ssl(&server.cert_file, &server.key_file);
    let other = TestCerts::new("another CA");

    // Whoever signed it, verify-full wants our CA.
    let refused = refusal(upstream_tls(
        &cluster,
        UpstreamSslMode::VerifyFull,
        Some(&other),
    ))
    .await;
    assert!(
        refused.contains("08006") && refused.contains("certificate"),
        "{refused}"
    );

    // A certificate from our CA for another name: verify-full refuses, verify-ca accepts.
    let mut renamed = PgCluster::start();
    let elsewhere = TestCerts::for_names("server CA 2", &["db.elsewhere.example"]);
    renamed.enable_ssl(&elsewhere.cert_file, &elsewhere.key_file);
    let refused = refusal(upstream_tls(
        &renamed,
        UpstreamSslMode::VerifyFull,
        Some(&elsewhere),
    ))
    .await;
    assert!(
        refused.contains("certificate not valid for name"),
        "{refused}"
    );
    assert!(
        backend_tls_through(upstream_tls(
            &renamed,
            UpstreamSslMode::VerifyCa,
            Some(&elsewhere)
        ))
        .await
    );
    renamed.stop_server();

    // require: any certificate, but TLS or nothing.
    assert!(backend_tls_through(upstream_tls(&cluster, UpstreamSslMode::Require, None)).await);
    let refused = refusal(upstream_tls(&plain_cluster, UpstreamSslMode::Require, None)).await;
    assert!(
        refused.contains("the server does not support TLS, and upstream.sslmode = require"),
        "{refused}"
    );

    // prefer: TLS where offered, plain TCP where not.
    for (target, tls) in [(&cluster, true), (&plain_cluster, false)] {
        let used = backend_tls_through(upstream_tls(target, UpstreamSslMode::Prefer, None)).await;
        assert_eq!(used, tls);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_certificate_to_the_server() {
    let cluster = PgCluster::start();
    let certs = TestCerts::new("server CA");
    cluster.enable_ssl(&certs.cert_file, &certs.key_file);
    cluster.require_client_certs(&certs.ca_file);

    let refused = refusal(upstream_tls(
        &cluster,
        UpstreamSslMode::VerifyFull,
        Some(&certs),
    ))
    .await;
    assert!(
        refused.contains("connection requires a valid client certificate"),
        "{refused}"
    );

    let mut config = upstream_tls(&cluster, UpstreamSslMode::VerifyFull, Some(&certs));
    config.upstream.sslcert = Some(certs.client_cert_file.clone());
    config.upstream.sslkey = Some(certs.client_key_file.clone());
    let with = Proxy::start(config);
    let client = connect_to(&with.connstr(APP_DB)).await;
    let row = client
        .query_one(
            "SELECT ssl, client_dn FROM pg_stat_ssl WHERE pid = pg_backend_pid()",
            &[],
        )
        .await
        .unwrap();
    assert!(row.get::<_, bool>(0));
    assert_eq!(
        row.get::<_, Option<String>>(1).as_deref(),
        Some("/CN=postgres")
    );
    drop(client);
    with.shutdown().unwrap();
}
