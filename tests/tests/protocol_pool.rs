//! Server connections kept between client sessions (`[pool]`, PgBouncer's session mode).
//!
//! - [`idle_server_is_reset_and_reused`]: a client that leaves with its server session idle
//!   hands the backend to the next client with the same startup packet; everything the first
//!   left behind (settings, its fencing token, prepared statements, temporary tables, LISTEN,
//!   advisory locks) is gone; writes, the fence and cancel work on the reused connection.
//! - [`only_clean_identical_passwordless_logins_are_reused`]: a session that ends inside a
//!   transaction, a different startup packet, and a login the server asked a password for
//!   never get (or give) a kept connection: a wrong password is still refused.
//! - [`client_gone_mid_message_is_not_kept`]: over raw TCP, a truncated frame then close
//!   closes the server connection; a Terminate right after a query keeps it.
//! - [`server_gone_while_idle_is_dropped_and_replaced`]: a kept backend terminated on the
//!   server is dropped by the next sweep (no longer listed or counted) and not handed out.
//! - [`server_out_of_slots_frees_kept_connections`]: a login the server refuses for lack of
//!   connection slots (53300) closes the kept connections and tries the login again, so the
//!   client gets in; with nothing kept, the refusal reaches the client at once.
//! - [`reuse_off_and_idle_timeout`]: `reuse_servers = false` keeps nothing;
//!   `server_idle_timeout` closes kept connections.
//! - [`a_kept_connection_reports_settings_a_reload_changed`]: a reload that changes a
//!   reported setting (`default_transaction_read_only`) while a connection sits kept: the
//!   next client's login says the new value, as a new backend's would; and a kept
//!   connection whose backend was terminated is replaced at once, the client none the wiser.
//! - [`connections_have_tcp_keepalive`]: `limits.tcp_keepalive*` arm keepalive timers on
//!   pgfence's client and server connections (read from `/proc/net/tcp`), and off, none.
//! - [`kept_backend_keeps_its_temporary_schema`]: the known limitation README states (a
//!   kept connection is a used backend): a statement re-planned on a new backend is not on
//!   a kept one, as with PostgreSQL alone; `reuse_servers = false` behaves as a new backend.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use harness::wire::{self, RawConn};
use harness::{
    connect_to, try_connect_to, wait_for_none, PgCluster, Proxy, APP_DB, SCRAM_PASSWORD,
    SCRAM_USER, SUPERUSER,
};
use pgfence_config::Config;
use tokio_postgres::{Client, SimpleQueryMessage};

const WAIT: Duration = Duration::from_secs(10);

fn proxy_with(cluster: &PgCluster, edit: impl FnOnce(&mut Config)) -> Proxy {
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let mut config = Proxy::config_for(cluster);
    config.admin.users = vec!["postgres".into()];
    edit(&mut config);
    Proxy::start(config)
}

async fn backend_pid(client: &Client) -> i32 {
    client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// One value of the admin console's SHOW STATS.
async fn stat(proxy: &Proxy, name: &str) -> u64 {
    // The console logs in to the server: it needs a slot too.
    let console = connect_retrying(&proxy.connstr("pgfence")).await;
    for message in console.simple_query("SHOW STATS").await.unwrap() {
        if let SimpleQueryMessage::Row(row) = message {
            if row.get(0) == Some(name) {
                return row.get(1).unwrap().parse().unwrap();
            }
        }
    }
    panic!("SHOW STATS has no {name}");
}

/// Waits until SHOW STATS says `servers_idle` is `n`.
async fn wait_idle_servers(proxy: &Proxy, n: u64) {
    let start = Instant::now();
    loop {
        let idle = stat(proxy, "servers_idle").await;
        if idle == n {
            return;
        }
        assert!(
            start.elapsed() < WAIT,
            "servers_idle is {idle} after {WAIT:?}, expected {n}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until backend `pid` is gone from the server.
async fn wait_backend_gone(direct: &Client, pid: i32) {
    let sql = format!("SELECT count(*) FROM pg_stat_activity WHERE pid = {pid}");
    wait_for_none(direct, &sql, WAIT, &format!("backend {pid}")).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_server_is_reset_and_reused() {
    let cluster = PgCluster::start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute("CREATE TABLE pooled (x int)")
        .await
        .unwrap();

    let first = proxy.connect(APP_DB).await;
    let pid = backend_pid(&first).await;
    first
        .batch_execute(
            "SET application_name = 'first'; SET work_mem = '7MB'; \
             SET fencing.resource = 'leak'; SET fencing.token = '99'; \
             PREPARE leftover AS SELECT 1; CREATE TEMP TABLE scratch (x int); \
             LISTEN somewhere; SELECT pg_advisory_lock(42)",
        )
        .await
        .unwrap();
    drop(first);
    wait_idle_servers(&proxy, 1).await;
    // SHOW SERVERS lists it: backend pid, user, database, application name at login.
    let console = connect_to(&proxy.connstr("pgfence")).await;
    let rows: Vec<Vec<String>> = console
        .simple_query("SHOW SERVERS")
        .await
        .unwrap()
        .into_iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(r) => {
                Some((0..4).map(|i| r.get(i).unwrap().to_string()).collect())
            }
            _ => None,
        })
        .collect();
    assert_eq!(
        rows,
        [[
            pid.to_string(),
            "postgres".into(),
            APP_DB.into(),
            String::new()
        ]]
    );

    let second = proxy.connect(APP_DB).await;
    assert_eq!(
        backend_pid(&second).await,
        pid,
        "the idle backend is reused"
    );
    wait_idle_servers(&proxy, 0).await;
    let row = second
        .query_one(
            "SELECT current_setting('application_name'), current_setting('work_mem'), \
             (SELECT count(*) FROM pg_prepared_statements WHERE name = 'leftover'), \
             to_regclass('pg_temp.scratch') IS NULL, \
             (SELECT count(*) FROM pg_listening_channels()), \
             (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' \
                AND pid = pg_backend_pid()), \
             coalesce(current_setting('fencing.resource', true), '') \
                || coalesce(current_setting('fencing.token', true), '')",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, String>(0), "", "application_name reset");
    assert_eq!(row.get::<_, String>(1), "4MB", "work_mem reset");
    assert_eq!(row.get::<_, i64>(2), 0, "prepared statements deallocated");
    assert!(row.get::<_, bool>(3), "temporary table dropped");
    assert_eq!(row.get::<_, i64>(4), 0, "LISTEN undone");
    assert_eq!(row.get::<_, i64>(5), 0, "advisory lock released");
    // Above all, the first client's fencing token does not carry over.
    assert_eq!(
        row.get::<_, String>(6),
        "",
        "fencing.resource and fencing.token reset"
    );

    // Writes and the fence work on the reused connection (pgfence's own prepared check was
    // deallocated by the reset and is prepared again).
    second
        .batch_execute(
            "SET fencing.resource = 'pool'; SET fencing.token = '5'; \
             INSERT INTO pooled VALUES (1)",
        )
        .await
        .unwrap();
    second
        .batch_execute("SET fencing.token = '4'")
        .await
        .unwrap();
    let stale = second.batch_execute("INSERT INTO pooled VALUES (2)").await;
    assert_eq!(
        harness::fence::sqlstate(&stale).as_deref(),
        Some("FN001"),
        "{stale:?}"
    );

    // Cancel reaches the reused backend through the key pgfence gave this client.
    let _second = harness::fence::cancelled_sleep(second).await;
    assert_eq!(stat(&proxy, "servers_reused").await, 1);
    let n: i64 = direct
        .query_one("SELECT count(*) FROM pooled", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_clean_identical_passwordless_logins_are_reused() {
    let cluster = PgCluster::start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = cluster.connect(APP_DB).await;

    // Gone inside a transaction: the backend is closed, not kept.
    let open = proxy.connect(APP_DB).await;
    let open_pid = backend_pid(&open).await;
    open.batch_execute("BEGIN; SELECT 1").await.unwrap();
    drop(open);
    wait_backend_gone(&direct, open_pid).await;
    assert_eq!(stat(&proxy, "servers_idle").await, 0);

    // A kept backend goes only to the same startup packet.
    let plain = proxy.connect(APP_DB).await;
    let plain_pid = backend_pid(&plain).await;
    drop(plain);
    wait_idle_servers(&proxy, 1).await;
    let other = connect_to(&format!("{} application_name=other", proxy.connstr(APP_DB))).await;
    assert_ne!(backend_pid(&other).await, plain_pid);
    assert_eq!(stat(&proxy, "servers_idle").await, 1);
    drop(other);
    wait_idle_servers(&proxy, 2).await;

    // A login the server asked a password for is never kept, so a wrong password is
    // refused as ever.
    let scram = |password: &str| proxy.connstr_as(APP_DB, SCRAM_USER, Some(password));
    let first = try_connect_to(&scram(SCRAM_PASSWORD)).await.unwrap();
    let scram_pid = backend_pid(&first).await;
    drop(first);
    wait_backend_gone(&direct, scram_pid).await;
    assert_eq!(stat(&proxy, "servers_idle").await, 2);
    let wrong = try_connect_to(&scram("not-the-password")).await;
    assert_eq!(
        harness::fence::sqlstate(&wrong).as_deref(),
        Some("28P01"),
        "{wrong:?}"
    );
    let again = try_connect_to(&scram(SCRAM_PASSWORD)).await.unwrap();
    assert_ne!(backend_pid(&again).await, scram_pid);
}

/// A raw-protocol session through `proxy`, logged in as the superuser.
fn raw_login(proxy: &Proxy) -> RawConn {
    let mut conn = RawConn::connect(proxy.addr());
    conn.send(&wire::startup(SUPERUSER, APP_DB));
    conn.until_ready();
    conn
}

/// The backend of the session that last ran `SELECT <marker>`.
async fn pid_that_ran(direct: &Client, marker: &str) -> i32 {
    direct
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE query = $1",
            &[&format!("SELECT {marker}")],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_gone_mid_message_is_not_kept() {
    let cluster = PgCluster::start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = cluster.connect(APP_DB).await;

    // Half a Query, then the client closes: the server connection is closed.
    let mut conn = raw_login(&proxy);
    conn.send(&wire::query("SELECT 1001"));
    conn.until_ready();
    let pid = pid_that_ran(&direct, "1001").await;
    let q = wire::query("SELECT 1");
    conn.send(&q[..q.len() - 4]);
    conn.shutdown_write();
    assert!(conn.until_closed().is_empty());
    wait_backend_gone(&direct, pid).await;
    assert_eq!(stat(&proxy, "servers_idle").await, 0);

    // A query, its reply, then Terminate: kept.
    let mut conn = raw_login(&proxy);
    conn.send(&wire::query("SELECT 1002"));
    conn.until_ready();
    let pid = pid_that_ran(&direct, "1002").await;
    conn.send(&wire::terminate());
    assert!(conn.until_closed().is_empty());
    wait_idle_servers(&proxy, 1).await;
    // The same startup packet gets it (tokio-postgres's would not: it sends other
    // parameters).
    let mut again = raw_login(&proxy);
    let rows = again.query_rows("SELECT pg_backend_pid()");
    assert_eq!(rows, vec![vec![Some(pid.to_string().into_bytes())]]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_gone_while_idle_is_dropped_and_replaced() {
    let cluster = PgCluster::start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = cluster.connect(APP_DB).await;
    let first = proxy.connect(APP_DB).await;
    let pid = backend_pid(&first).await;
    drop(first);
    wait_idle_servers(&proxy, 1).await;
    direct
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .unwrap();
    wait_backend_gone(&direct, pid).await;
    // The sweep drops it without a client asking: no longer listed nor counted.
    wait_idle_servers(&proxy, 0).await;

    let second = proxy.connect(APP_DB).await;
    assert_ne!(backend_pid(&second).await, pid);
    assert_eq!(stat(&proxy, "servers_reused").await, 0);
    assert_eq!(stat(&proxy, "servers_idle").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_out_of_slots_frees_kept_connections() {
    // Eight slots: the test's direct connection, four connections pgfence keeps, and three
    // more direct ones that fill the server. A backend leaves pg_stat_activity before it
    // gives its slot back, and each SHOW STATS is an admin session that logs in to the
    // server: on a loaded machine a slot can still be taken a moment after its connection
    // ended, so the test's own logins retry a refusal (pgfence's clients do not).
    let cluster = PgCluster::builder()
        .setting("max_connections", "8")
        .setting("superuser_reserved_connections", "0")
        .start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = connect_retrying(&cluster.connstr(APP_DB)).await;
    // The setup's own connections gone, as far as pg_stat_activity tells.
    wait_for_none(
        &direct,
        "SELECT count(*) FROM pg_stat_activity \
         WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        WAIT,
        "other backends",
    )
    .await;
    let named = |name: &str| format!("{} application_name={name}", proxy.connstr(APP_DB));
    // Four sessions that cannot share a kept connection (different startup packets) end:
    // four slots are held by idle connections pgfence keeps.
    let mut open = Vec::new();
    for i in 0..4 {
        open.push(connect_to(&named(&format!("kept{i}"))).await);
    }
    drop(open);
    wait_idle_servers(&proxy, 4).await;
    let mut fillers = Vec::new();
    for i in 0..3 {
        let connstr = format!("{} application_name=filler{i}", cluster.connstr(APP_DB));
        fillers.push(connect_retrying(&connstr).await);
    }

    // The server refuses the login: pgfence closes the connections it kept, and tries
    // again until one of their backends has exited. The client never sees the refusal.
    let sixth = connect_to(&named("sixth")).await;
    assert!(backend_pid(&sixth).await > 0);
    assert_eq!(
        stat(&proxy, "servers_idle").await,
        0,
        "kept connections closed"
    );
    // A full server with nothing kept: the refusal reaches the client, at once. The slots
    // left are counted once only this test's connections remain (the direct one, the
    // sixth's backend, the fillers): the admin session of the SHOW STATS above, or a
    // closed kept connection, can linger in pg_stat_activity a moment, and counting it
    // would leave a slot free.
    let held = 2 + fillers.len();
    wait_for_none(
        &direct,
        &format!(
            "SELECT count(*) - {held} FROM pg_stat_activity WHERE backend_type = 'client backend'"
        ),
        WAIT,
        "backends besides this test's connections",
    )
    .await;
    for i in 0..8 - held {
        let connstr = format!("{} application_name=more{i}", cluster.connstr(APP_DB));
        fillers.push(connect_retrying(&connstr).await);
    }
    let asked = Instant::now();
    let refused = try_connect_to(&named("seventh")).await;
    assert_eq!(
        harness::fence::sqlstate(&refused).as_deref(),
        Some("53300"),
        "{refused:?}"
    );
    assert!(
        asked.elapsed() < Duration::from_secs(1),
        "refused only after {:?}: retried with nothing to free",
        asked.elapsed()
    );
    drop((fillers, sixth, direct));
}

/// Connects, trying again while the server refuses for lack of slots (53300).
async fn connect_retrying(connstr: &str) -> tokio_postgres::Client {
    let start = Instant::now();
    loop {
        let result = try_connect_to(connstr).await;
        if harness::fence::sqlstate(&result).as_deref() != Some("53300") {
            return result.unwrap_or_else(|e| panic!("could not connect with `{connstr}`: {e:?}"));
        }
        assert!(start.elapsed() < WAIT, "no slot after {WAIT:?}: {connstr}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reuse_off_and_idle_timeout() {
    let cluster = PgCluster::start();
    let direct = cluster.connect(APP_DB).await;

    let off = proxy_with(&cluster, |c| c.pool.reuse_servers = false);
    let first = off.connect(APP_DB).await;
    let pid = backend_pid(&first).await;
    drop(first);
    wait_backend_gone(&direct, pid).await;
    let second = off.connect(APP_DB).await;
    assert_ne!(backend_pid(&second).await, pid);
    assert_eq!(stat(&off, "servers_idle").await, 0);

    let short = proxy_with(&cluster, |c| {
        c.pool.server_idle_timeout = Duration::from_millis(500)
    });
    let kept = short.connect(APP_DB).await;
    let pid = backend_pid(&kept).await;
    drop(kept);
    wait_idle_servers(&short, 1).await;
    // The sweep runs every second: closed within about 1.5 s of being kept.
    wait_idle_servers(&short, 0).await;
    wait_backend_gone(&direct, pid).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unix_socket_upstream() {
    let cluster = PgCluster::start();
    let socket_dir = cluster.socket_dir().display().to_string();
    let proxy = proxy_with(&cluster, |c| c.upstream.host = socket_dir.clone());
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute("CREATE TABLE over_unix (x int)")
        .await
        .unwrap();

    // The backend's client is a Unix-domain socket: no server address (TCP would have one).
    let first = proxy.connect(APP_DB).await;
    let over: Option<String> = first
        .query_one("SELECT inet_server_addr()::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(
        over, None,
        "the proxy's upstream connection is not over TCP"
    );
    let tcp: Option<String> = direct
        .query_one("SELECT inet_server_addr()::text", &[])
        .await
        .unwrap()
        .get(0);
    assert!(tcp.is_some(), "the direct connection is over TCP");

    // The fence: a token accepted, a stale one rejected with FN001.
    first
        .batch_execute(
            "SET fencing.resource = 'unix'; SET fencing.token = '5'; \
             INSERT INTO over_unix VALUES (1)",
        )
        .await
        .unwrap();
    let stale = proxy.connect(APP_DB).await;
    stale
        .batch_execute("SET fencing.resource = 'unix'; SET fencing.token = '4'")
        .await
        .unwrap();
    let r = stale
        .batch_execute("INSERT INTO over_unix VALUES (2)")
        .await;
    assert_eq!(
        harness::fence::sqlstate(&r).as_deref(),
        Some("FN001"),
        "{r:?}"
    );
    drop(stale);

    // Cancel goes to the backend over the same socket.
    let pid = backend_pid(&first).await;
    let first = harness::fence::cancelled_sleep(first).await;

    // Kept between clients, and handed out only while the server has not closed it.
    drop(first);
    wait_idle_servers(&proxy, 2).await;
    let second = proxy.connect(APP_DB).await;
    let reused = backend_pid(&second).await;
    assert_eq!(stat(&proxy, "servers_reused").await, 1);
    drop(second);
    wait_idle_servers(&proxy, 2).await;
    let kept: Vec<i32> = direct
        .query(
            "SELECT pid FROM pg_stat_activity WHERE backend_type = 'client backend' \
             AND datname = $1 AND pid <> pg_backend_pid() AND client_addr IS NULL",
            &[&APP_DB],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert!(kept.contains(&pid) || kept.contains(&reused), "{kept:?}");
    for victim in &kept {
        direct
            .execute("SELECT pg_terminate_backend($1)", &[victim])
            .await
            .unwrap();
        wait_backend_gone(&direct, *victim).await;
    }
    let third = proxy.connect(APP_DB).await;
    assert!(!kept.contains(&backend_pid(&third).await));
    assert_eq!(stat(&proxy, "servers_reused").await, 1);
    let n: i64 = direct
        .query_one("SELECT count(*) FROM over_unix", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(n, 1);
}

/// Prepares a statement, then makes the session's first temporary table, then runs `SET
/// TRANSACTION ISOLATION LEVEL` right after a Describe of that statement, in one implicit
/// transaction. On a backend whose temporary schema the table created, the Describe re-plans
/// the statement (its search path changed), takes a snapshot, and the SET fails with 25001.
/// On a backend that already had a temporary schema, nothing is re-planned and the SET
/// succeeds. Returns the SQLSTATE of the last step's error, if any.
fn describe_then_set_isolation(conn: &mut RawConn) -> Option<String> {
    let mut first = wire::parse("a", "SELECT g FROM generate_series(1, 5) g", &[]);
    first.extend(wire::bind("", "a", &[]));
    first.extend(wire::execute("", 0));
    first.extend(wire::parse(
        "",
        "CREATE TEMP TABLE IF NOT EXISTS t (x int)",
        &[],
    ));
    first.extend(wire::bind("", "", &[]));
    first.extend(wire::execute("", 0));
    first.extend(wire::sync());
    conn.send(&first);
    let replies = conn.until_ready();
    assert!(
        replies.iter().all(|m| m.tag != b'E'),
        "the statement and the temporary table: {replies:?}"
    );
    let mut second = wire::parse("", "SET TRANSACTION ISOLATION LEVEL REPEATABLE READ", &[]);
    second.extend(wire::sync());
    conn.send(&second);
    conn.until_ready();
    let mut third = wire::describe(b'S', "a");
    third.extend(wire::bind("p", "", &[]));
    third.extend(wire::execute("p", 0));
    third.extend(wire::sync());
    conn.send(&third);
    let replies = conn.until_ready();
    let error = replies.iter().find(|m| m.tag == b'E');
    if error.is_none() {
        assert!(
            replies
                .iter()
                .any(|m| m.command_tag().as_deref() == Some("SET")),
            "no error and no SET: {replies:?}"
        );
    }
    error.and_then(|m| m.sqlstate())
}

/// Whether the session's backend has a temporary schema (`pg_my_temp_schema()`).
fn has_temp_schema(conn: &mut RawConn) -> bool {
    let rows = conn.query_rows("SELECT pg_my_temp_schema() <> 0");
    rows == vec![vec![Some(b"t".to_vec())]]
}

/// A client that makes a temporary table, through `proxy`, and leaves; returns the row of
/// its `pg_backend_pid()`.
fn leave_a_temp_schema(proxy: &Proxy) -> Vec<Vec<Option<Vec<u8>>>> {
    let mut conn = raw_login(proxy);
    conn.query_rows("CREATE TEMP TABLE scratch (x int)");
    let pid = conn.query_rows("SELECT pg_backend_pid()");
    conn.send(&wire::terminate());
    conn.until_closed();
    pid
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kept_backend_keeps_its_temporary_schema() {
    let cluster = PgCluster::start();
    let direct_addr = SocketAddr::from(([127, 0, 0, 1], cluster.port()));

    // PostgreSQL alone: a new backend re-plans; one that made (and dropped) a temporary
    // table before, then ran DISCARD ALL as pgfence does, does not.
    let (mut new, _) = RawConn::login(direct_addr, SUPERUSER, APP_DB);
    assert!(!has_temp_schema(&mut new));
    assert_eq!(
        describe_then_set_isolation(&mut new).as_deref(),
        Some("25001")
    );
    let (mut used, _) = RawConn::login(direct_addr, SUPERUSER, APP_DB);
    used.query_rows("CREATE TEMP TABLE scratch (x int)");
    used.query_rows("DROP TABLE scratch");
    used.query_rows("DISCARD ALL");
    assert!(has_temp_schema(&mut used));
    assert_eq!(describe_then_set_isolation(&mut used), None);

    // Through pgfence, the next client gets the first one's backend: reset, its table
    // gone, its temporary schema kept, so it answers as the used backend above.
    let kept = proxy_with(&cluster, |_| {});
    let pid = leave_a_temp_schema(&kept);
    wait_idle_servers(&kept, 1).await;
    let mut next = raw_login(&kept);
    assert_eq!(next.query_rows("SELECT pg_backend_pid()"), pid);
    assert_eq!(
        next.query_rows("SELECT to_regclass('pg_temp.scratch')"),
        vec![vec![None]]
    );
    assert!(has_temp_schema(&mut next));
    assert_eq!(describe_then_set_isolation(&mut next), None);

    // With reuse_servers = false, every client gets a new backend, answering as the new
    // one above.
    let fresh = proxy_with(&cluster, |c| c.pool.reuse_servers = false);
    let pid = leave_a_temp_schema(&fresh);
    let mut next = raw_login(&fresh);
    assert_ne!(next.query_rows("SELECT pg_backend_pid()"), pid);
    assert!(!has_temp_schema(&mut next));
    assert_eq!(
        describe_then_set_isolation(&mut next).as_deref(),
        Some("25001")
    );
}

/// Keepalive timers of established IPv4 TCP sockets on 127.0.0.1, from `/proc/net/tcp`:
/// (local port, remote port, seconds until the timer fires), for sockets whose timer is a
/// keepalive one (`tr` 2).
fn keepalive_timers() -> Vec<(u16, u16, f64)> {
    let table = std::fs::read_to_string("/proc/net/tcp").expect("/proc/net/tcp");
    let port = |addr: &str| u16::from_str_radix(addr.rsplit(':').next().unwrap(), 16).unwrap();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (timer, when) = f[5].split_once(':')?;
            // State 01 is ESTABLISHED; `when` counts USER_HZ (100 a second) ticks.
            (f[3] == "01" && timer == "02").then(|| {
                let ticks = u64::from_str_radix(when, 16).unwrap_or(u64::MAX);
                (port(f[1]), port(f[2]), ticks as f64 / 100.0)
            })
        })
        .collect()
}

/// PostgreSQL sets `SO_KEEPALIVE` on its client connections, so that a client that vanished
/// (host frozen, network cut, no FIN or RST) is found and its transaction's locks freed;
/// behind pgfence its `tcp_keepalives_*` reach only pgfence's connection. pgfence sets
/// keepalive on its own connections to clients and to the server (`limits.tcp_keepalive`,
/// with `tcp_keepalives_idle` here 7 s); `tcp_keepalive = false` sets none (found by a
/// review, 2026-12-06: a vanished client's transaction held its row locks for good).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_have_tcp_keepalive() {
    let cluster = PgCluster::start();
    for on in [true, false] {
        let proxy = proxy_with(&cluster, |c| {
            c.limits.tcp_keepalive = on;
            c.limits.tcp_keepalives_idle = Some(Duration::from_secs(7));
            c.limits.tcp_keepalives_interval = Some(Duration::from_secs(2));
            c.limits.tcp_keepalives_count = Some(3);
        });
        let mut raw = raw_login(&proxy);
        raw.send(&wire::query("SELECT 1"));
        raw.until_ready();
        // A socket with data not yet acknowledged shows its retransmit timer instead
        // (the client's delayed ACK): looked at again until both show, for up to 2 s.
        let deadline = Instant::now() + Duration::from_secs(2);
        let (timers, client_side, server_side) = loop {
            let timers = keepalive_timers();
            // pgfence's end of the client's connection, and its connections to the server
            // (the harness's own direct connections keep tokio-postgres' 2 hours).
            let client_side = timers
                .iter()
                .any(|&(local, _, s)| local == proxy.port() && s <= 7.0);
            let server_side = timers
                .iter()
                .any(|&(_, remote, s)| remote == cluster.port() && s <= 7.0);
            if (client_side && server_side) || Instant::now() > deadline {
                break (timers, client_side, server_side);
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        assert_eq!(
            (client_side, server_side),
            (on, on),
            "tcp_keepalive = {on}: keepalive timers {timers:?}"
        );
    }
}

/// The value a login's ParameterStatus gives `name`, if any.
fn login_param(msgs: &[wire::Msg], name: &str) -> Option<String> {
    msgs.iter().filter(|m| m.tag == b'S').find_map(|m| {
        let mut parts = m.body.split(|&b| b == 0);
        (parts.next()? == name.as_bytes())
            .then(|| String::from_utf8_lossy(parts.next().unwrap_or_default()).into_owned())
    })
}

/// `ALTER SYSTEM <change>`, then a reload of the configuration.
async fn alter_system(direct: &Client, change: &str) {
    // ALTER SYSTEM cannot share a query string (an implicit transaction) with anything.
    direct
        .batch_execute(&format!("ALTER SYSTEM {change}"))
        .await
        .unwrap();
    direct
        .batch_execute("SELECT pg_reload_conf()")
        .await
        .unwrap();
}

/// An idle backend reports what a configuration reload changed only with its next
/// ReadyForQuery: a kept connection's login, replayed as it was at its last reset, once
/// told the next client `default_transaction_read_only = off` after the server had turned
/// it on, so that libpq's `target_session_attrs=read-write` accepted a read-only server
/// (found by a review, 2026-12-06). pgfence now asks the kept connection for a
/// ReadyForQuery first; a kept connection that fails it is replaced by a new one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_reports_settings_a_reload_changed() {
    let cluster = PgCluster::start();
    let proxy = proxy_with(&cluster, |_| {});
    let direct = cluster.connect(APP_DB).await;
    let login = || {
        let mut conn = RawConn::connect(proxy.addr());
        conn.send(&wire::startup(SUPERUSER, APP_DB));
        let msgs = conn.until_ready();
        (conn, msgs)
    };
    let (mut first, msgs) = login();
    assert_eq!(
        login_param(&msgs, "default_transaction_read_only").as_deref(),
        Some("off")
    );
    first.send(&wire::query("SELECT 'first'"));
    first.until_ready();
    let kept_pid = pid_that_ran(&direct, "'first'").await;
    first.send(&wire::terminate());
    wait_idle_servers(&proxy, 1).await;

    alter_system(&direct, "SET default_transaction_read_only = on").await;
    // The postmaster has read the file once a new backend starts with the new value.
    let deadline = Instant::now() + WAIT;
    loop {
        let fresh = cluster.connect(APP_DB).await;
        let row = fresh
            .query_one("SHOW default_transaction_read_only", &[])
            .await
            .unwrap();
        if row.get::<_, String>(0) == "on" {
            break;
        }
        assert!(Instant::now() < deadline, "the reload never took effect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut second, msgs) = login();
    assert_eq!(
        login_param(&msgs, "default_transaction_read_only").as_deref(),
        Some("on"),
        "the login on the kept connection must report the reloaded value"
    );
    second.send(&wire::query("SELECT 'second'"));
    second.until_ready();
    assert_eq!(
        pid_that_ran(&direct, "'second'").await,
        kept_pid,
        "the kept connection was used"
    );
    second.send(&wire::terminate());
    wait_idle_servers(&proxy, 1).await;
    alter_system(&direct, "RESET default_transaction_read_only").await;

    // A kept backend terminated before the sweep sees it: the next client gets a new one.
    direct
        .execute("SELECT pg_terminate_backend($1)", &[&kept_pid])
        .await
        .unwrap();
    wait_backend_gone(&direct, kept_pid).await;
    let (mut third, msgs) = login();
    assert!(msgs.iter().all(|m| m.tag != b'E'), "{msgs:?}");
    third.send(&wire::query("SELECT 'third'"));
    let replies = third.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "{replies:?}");
    assert_ne!(pid_that_ran(&direct, "'third'").await, kept_pid);
}
