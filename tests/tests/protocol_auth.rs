//! Authentication through pgfence, which stores no passwords: the server's challenge goes
//! to the client and the client's answer to the server, untouched.
//!
//! - [`md5_and_scram_users_log_in`]: `md5user` and `scramuser` log in through the fenced
//!   proxy with tokio-postgres and psql, and write; wrong passwords get the server's own
//!   error (28P01, the same message as directly); a missing password fails.
//! - [`cleartext_password_method`]: a role whose `pg_hba.conf` line says `password`.
//! - [`sasl_exchange_is_relayed_byte_for_byte`]: the AuthenticationSASL message (the
//!   mechanisms offered) is the server's, and no `-PLUS` mechanism appears.
//! - [`concurrent_scram_logins`]: 24 SCRAM logins at once through one proxy.

use std::net::SocketAddr;

use harness::wire::{self, RawConn};
use harness::{
    try_connect_to, PgCluster, Proxy, APP_DB, MD5_PASSWORD, MD5_USER, SCRAM_PASSWORD, SCRAM_USER,
};

fn fenced_proxy(cluster: &PgCluster) -> Proxy {
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    Proxy::for_cluster(cluster)
}

/// The error a login with `password` gets at `connstr_of(user, password)`.
async fn login_error(connstr: &str) -> tokio_postgres::Error {
    match try_connect_to(connstr).await {
        Ok(_) => panic!("logged in with `{connstr}`"),
        Err(e) => e,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn md5_and_scram_users_log_in() {
    let cluster = PgCluster::start();
    let proxy = fenced_proxy(&cluster);
    for (user, password) in [(MD5_USER, MD5_PASSWORD), (SCRAM_USER, SCRAM_PASSWORD)] {
        let client = try_connect_to(&proxy.connstr_as(APP_DB, user, Some(password)))
            .await
            .unwrap_or_else(|e| panic!("{user} through pgfence: {e:?}"));
        let row = client
            .query_one("SELECT current_user::text, session_user::text", &[])
            .await
            .unwrap();
        assert_eq!(row.get::<_, String>(0), user);
        assert_eq!(row.get::<_, String>(1), user);
        // A write, so the fence's check runs as this (unprivileged) role too.
        client
            .batch_execute(&format!(
                "CREATE TABLE {user}_t (x int); INSERT INTO {user}_t VALUES (1)"
            ))
            .await
            .unwrap();
        let n: i64 = client
            .query_one(&format!("SELECT count(*) FROM {user}_t"), &[])
            .await
            .unwrap()
            .get(0);
        assert_eq!(n, 1);

        // Wrong password: the server's error, exactly as PostgreSQL words it.
        let direct = login_error(&cluster.connstr_as(APP_DB, user, Some("wrong"))).await;
        let through = login_error(&proxy.connstr_as(APP_DB, user, Some("wrong"))).await;
        let (direct, through) = (
            direct.as_db_error().expect("a server error"),
            through
                .as_db_error()
                .expect("a server error through pgfence"),
        );
        assert_eq!(through.code().code(), "28P01", "{through:?}");
        assert_eq!(through.severity(), "FATAL");
        assert_eq!(through.message(), direct.message());
        assert_eq!(
            through.message(),
            format!("password authentication failed for user \"{user}\"")
        );

        // No password at all: the client gives up when asked for one.
        let e = login_error(&proxy.connstr_as(APP_DB, user, None)).await;
        assert!(
            e.as_db_error().is_none() && format!("{e:?}").contains("password missing"),
            "{user} without a password: {e:?}"
        );

        // psql, password from the environment.
        let mut cmd = proxy.psql_cmd();
        cmd.args(["-U", user, "-d", APP_DB, "-Atc", "SELECT current_user"])
            .env("PGPASSWORD", password);
        let out = cmd.output().expect("run psql");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout), format!("{user}\n"));
        let mut cmd = proxy.psql_cmd();
        cmd.args(["-U", user, "-d", APP_DB, "-Atc", "SELECT 1"])
            .env("PGPASSWORD", "wrong");
        let out = cmd.output().expect("run psql");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            stderr.contains(&format!(
                "password authentication failed for user \"{user}\""
            )),
            "{stderr}"
        );
    }
    // The proxy keeps serving after failed logins.
    let client = proxy.connect(APP_DB).await;
    client.simple_query("SELECT 1").await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleartext_password_method() {
    let cluster = PgCluster::start();
    let hba = cluster.data_dir().join("pg_hba.conf");
    let rules = std::fs::read_to_string(&hba).expect("read pg_hba.conf");
    std::fs::write(
        &hba,
        format!("host all pwuser 127.0.0.1/32 password\n{rules}"),
    )
    .expect("write pg_hba.conf");
    cluster.psql(
        "postgres",
        "CREATE ROLE pwuser LOGIN PASSWORD 'pwpass'; SELECT pg_reload_conf();",
    );
    let proxy = fenced_proxy(&cluster);
    // The server asks for a cleartext password (AuthenticationCleartextPassword, code 3).
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&wire::startup("pwuser", APP_DB));
    let ask = conn.recv();
    assert_eq!(
        (ask.tag, ask.body.clone()),
        (b'R', 3u32.to_be_bytes().to_vec())
    );
    conn.send(&wire::frame(b'p', b"pwpass\0"));
    let replies = conn.until_ready();
    assert_eq!(replies[0].body, 0u32.to_be_bytes(), "{replies:?}");

    let client = try_connect_to(&proxy.connstr_as(APP_DB, "pwuser", Some("pwpass")))
        .await
        .expect("cleartext password through pgfence");
    let who: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(who, "pwuser");
    let e = login_error(&proxy.connstr_as(APP_DB, "pwuser", Some("nope"))).await;
    assert_eq!(e.code().map(|c| c.code()), Some("28P01"));
}

#[test]
fn sasl_exchange_is_relayed_byte_for_byte() {
    let cluster = PgCluster::start();
    let proxy = fenced_proxy(&cluster);
    let direct = SocketAddr::from(([127, 0, 0, 1], cluster.port()));
    let mut offers = Vec::new();
    let mut goodbyes = Vec::new();
    for addr in [direct, proxy.addr()] {
        let mut conn = RawConn::connect(addr);
        conn.send(&wire::startup(SCRAM_USER, APP_DB));
        let ask = conn.recv();
        assert_eq!(ask.tag, b'R');
        assert_eq!(&ask.body[..4], &10u32.to_be_bytes(), "AuthenticationSASL");
        offers.push(ask.body.clone());
        // A client that gives up half way: whatever the server says to that.
        conn.send(&wire::terminate());
        goodbyes.push(conn.until_closed());

        let mut conn = RawConn::connect(addr);
        conn.send(&wire::startup(MD5_USER, APP_DB));
        let ask = conn.recv();
        assert_eq!(ask.tag, b'R');
        assert_eq!(
            &ask.body[..4],
            &5u32.to_be_bytes(),
            "AuthenticationMD5Password"
        );
        // A malformed answer gets the server's error (the proxy does not judge it).
        conn.send(&wire::frame(b'p', b"md5nothex\0"));
        let replies = conn.until_closed();
        assert_eq!(replies.len(), 1, "{replies:?}");
        wire::assert_error(&replies[0], "FATAL", "28P01");
    }
    assert_eq!(offers[0], offers[1], "the mechanisms offered differ");
    // PostgreSQL answers a Terminate during SASL with an error nobody reads; pgfence may
    // close on the Terminate at once. Nothing but the server's words either way.
    assert!(
        goodbyes[1].is_empty() || goodbyes[1] == goodbyes[0],
        "Terminate during SASL: {goodbyes:?}"
    );
    let mechanisms = String::from_utf8_lossy(&offers[1][4..]).into_owned();
    assert!(mechanisms.contains("SCRAM-SHA-256\0"), "{mechanisms:?}");
    assert!(!mechanisms.contains("PLUS"), "{mechanisms:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_scram_logins() {
    let cluster = PgCluster::start();
    let proxy = fenced_proxy(&cluster);
    let connstr = proxy.connstr_as(APP_DB, SCRAM_USER, Some(SCRAM_PASSWORD));
    let wrong = proxy.connstr_as(APP_DB, SCRAM_USER, Some("wrong"));
    let logins = (0..24).map(|i| {
        let (connstr, wrong) = (connstr.clone(), wrong.clone());
        tokio::spawn(async move {
            if i % 4 == 3 {
                let e = login_error(&wrong).await;
                assert_eq!(e.code().map(|c| c.code()), Some("28P01"));
                return;
            }
            let client = try_connect_to(&connstr)
                .await
                .unwrap_or_else(|e| panic!("login {i}: {e:?}"));
            let n: i32 = client
                .query_one("SELECT $1::int4", &[&i])
                .await
                .unwrap()
                .get(0);
            assert_eq!(n, i);
        })
    });
    for r in futures_util::future::join_all(logins).await {
        r.expect("a login task panicked");
    }
}
