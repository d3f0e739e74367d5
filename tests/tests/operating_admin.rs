//! The admin console (virtual database `pgfence`, SPEC section 7) of the real `pgfence`
//! binary, with psql and tokio-postgres.
//!
//! - [`psql_runs_every_command`]: psql `-c` (aligned, unaligned, `-x`) and a script with
//!   `\x on`: SHOW HELP, SHOW FENCES (the rows of `SELECT * FROM pgfence.fences`), SHOW
//!   REJECTIONS, SHOW CLIENTS, SHOW SERVERS, SHOW STATS, SHOW CONFIG, RELOAD.
//! - [`simple_query_columns_and_content`]: each command's exact columns (numbers typed
//!   `int8`, NULL where there is none) and plausible content after known traffic (two rejections newest first, an open session with its
//!   application_name, counters), case-insensitive commands; an unknown command and the
//!   extended protocol are errors after which the console session stays usable.
//! - [`only_admin_users_get_in`]: a user not in `admin.users` gets FATAL 28000; an admin user
//!   still needs the right upstream password.
//! - [`extended_protocol_batch_gets_one_error`]: a Parse/Bind/Describe/Execute/Sync batch on
//!   raw protocol gets one ErrorResponse and one ReadyForQuery, as PostgreSQL answers a
//!   failed batch.
//! - [`pipelined_console_commands_are_answered_in_order`]: commands sent back to back,
//!   `SHOW FENCES` (answered by the server) among them, are answered in order; stray copy
//!   messages are ignored and a FunctionCall refused, as PostgreSQL would; a malformed
//!   message ends the session, as on any session.
//! - [`kill_client_ends_one_session`]: `KILL_CLIENT` ends a session in the middle of a
//!   transaction (FATAL 57P01, its insert rolled back, its backend gone rather than kept)
//!   and leaves another session alone; unknown and malformed ids are errors. `SHOW VERSION`.
//! - [`kill_client_ends_sessions_in_flight_and_not_reading`]: `KILL_CLIENT` of a session
//!   with a COMMIT in flight says the COMMIT may have committed; of one whose client does
//!   not read, it ends the session and its backend all the same.
//! - [`numbers_are_typed_int8`]: the RowDescription of each command types its numbers.
//! - [`show_fences_without_the_schema_says_what_to_do`]: an `admin.database` without schema
//!   pgfence gets the server's 42P01 with a hint naming `admin.database` and `pgfence
//!   install`; the console stays usable.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::process::Command;
use std::time::{Duration, SystemTime};

use harness::fence::{self, assert_rejected};
use harness::operating::{connect_from, run_command};
use harness::wire::{self, RawConn};
use harness::{
    quote_conn_value, try_connect_to, PgCluster, Proxy, ProxyProcess, APP_DB, MD5_PASSWORD,
    MD5_USER, SCRAM_PASSWORD, SCRAM_USER, SUPERUSER,
};
use pgfence_config::{Config, DefaultResource};
use tokio_postgres::{Client, SimpleQueryMessage};

const CONSOLE: &str = "pgfence";

/// A cluster with schema `pgfence` and table `ledger` in `app`, and pgfence in front of it:
/// `app` sessions fenced on `billing` by default, console users `postgres` and `md5user`,
/// console database `app`.
async fn setup() -> (PgCluster, ProxyProcess, Config) {
    let cluster = PgCluster::start();
    let direct = cluster.connect(APP_DB).await;
    fence::install(&direct).await;
    direct
        .batch_execute("CREATE TABLE ledger (id int)")
        .await
        .expect("create table ledger");
    let mut config = Proxy::config_for(&cluster);
    config.fence.defaults = vec![DefaultResource {
        database: APP_DB.into(),
        user: None,
        resource: "billing".into(),
    }];
    config.admin.users = vec![SUPERUSER.into(), MD5_USER.into()];
    config.admin.database = APP_DB.into();
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args(["--config", "{config}"])
        .start();
    (cluster, proxy, config)
}

fn connstr(port: u16, application_name: &str, options: &str) -> String {
    let mut s = format!(
        "host=127.0.0.1 port={port} user={SUPERUSER} dbname={APP_DB} application_name={}",
        quote_conn_value(application_name)
    );
    if !options.is_empty() {
        s.push_str(&format!(" options={}", quote_conn_value(options)));
    }
    s
}

/// Sessions left open by [`traffic`].
struct Traffic {
    /// Wrote billing 5 and orders 8.
    _writer: Client,
    /// Application `rejected-app`: a missing token, then an invalid one, both rejected.
    _rejected: Client,
    /// The local address and backend pid of `rejected-app`.
    addr: SocketAddr,
    pid: i32,
}

/// Through `proxy`: billing accepted at 5 and at 8 on `orders`, then a missing token and an
/// invalid one rejected (in that order) in a session called `rejected-app`.
async fn traffic(proxy: &ProxyProcess) -> Traffic {
    let writer = harness::connect_to(&connstr(
        proxy.port(),
        "writer",
        "-c fencing.token=5 -c fencing.resource=billing",
    ))
    .await;
    writer
        .batch_execute("INSERT INTO ledger VALUES (1)")
        .await
        .expect("billing 5 accepted");
    writer
        .batch_execute(
            "/* fencing_token=8 fencing_resource=orders */ INSERT INTO ledger VALUES (2)",
        )
        .await
        .expect("orders 8 accepted");
    let (client, addr) =
        connect_from(proxy.addr(), &connstr(proxy.port(), "rejected-app", "")).await;
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0);
    assert_rejected(
        &client.batch_execute("INSERT INTO ledger VALUES (3)").await,
        &fence::missing("billing"),
        "missing",
    );
    assert_rejected(
        &client
            .batch_execute("/* fencing_token=x9 */ INSERT INTO ledger VALUES (4)")
            .await,
        &fence::invalid_token("billing", "x9"),
        "invalid",
    );
    Traffic {
        _writer: writer,
        _rejected: client,
        addr,
        pid,
    }
}

/// psql on the console: `psql -X -h .. -p .. -U postgres -d pgfence <args>`; stdout, or a
/// panic with stderr.
fn psql(proxy: &ProxyProcess, args: &[&str]) -> String {
    run_psql(proxy.psql_cmd().args(["-d", CONSOLE]).args(args), None)
}

fn run_psql(cmd: &mut Command, stdin: Option<&str>) -> String {
    let out = run_command(cmd, stdin.map(str::as_bytes));
    assert!(out.success(), "psql {cmd:?} failed: {out:?}");
    out.stdout
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_runs_every_command() {
    let (cluster, proxy, _) = setup().await;
    let _traffic = traffic(&proxy).await;

    // Aligned output, as an operator types it.
    let help = psql(&proxy, &["-c", "SHOW HELP"]);
    let header = help.lines().next().unwrap_or_default();
    assert!(
        header.contains("command") && header.contains("description"),
        "{help}"
    );
    for command in [
        "SHOW FENCES",
        "SHOW REJECTIONS",
        "SHOW CLIENTS",
        "SHOW SERVERS",
        "SHOW STATS",
        "SHOW CONFIG",
        "SHOW VERSION",
        "RELOAD",
        "KILL_CLIENT id",
        "SHOW HELP",
    ] {
        assert!(help.contains(command), "{command} missing from:\n{help}");
    }
    assert!(help.contains("(10 rows)"), "{help}");

    // SHOW FENCES is the fences table of the console database.
    let fences = psql(&proxy, &["-At", "-c", "SHOW FENCES"]);
    let table = cluster.psql(APP_DB, "SELECT * FROM pgfence.fences ORDER BY resource");
    assert_eq!(fences, table);
    let resources: Vec<&str> = fences
        .lines()
        .map(|l| &l[..l.find('|').unwrap_or(0)])
        .collect();
    assert_eq!(resources, ["billing", "orders"], "{fences}");
    let aligned = psql(&proxy, &["-c", "SHOW FENCES"]);
    assert!(
        aligned
            .lines()
            .next()
            .is_some_and(|h| h.contains("resource")
                && h.contains("token")
                && h.contains("updated_at")),
        "{aligned}"
    );

    // Expanded with -x.
    let clients = psql(&proxy, &["-x", "-c", "SHOW CLIENTS"]);
    assert!(clients.contains("-[ RECORD 1 ]"), "{clients}");
    assert!(
        clients
            .lines()
            .any(|l| l.starts_with("application_name") && l.ends_with("| rejected-app")),
        "{clients}"
    );

    // Expanded with \x in a script: the newest rejection is record 1.
    let script = "\\x on\nSHOW REJECTIONS;\n";
    let out = psql_stdin(&proxy, script);
    let records: Vec<&str> = out.split("-[ RECORD ").skip(1).collect();
    assert_eq!(records.len(), 2, "{out}");
    let field = |record: &str, name: &str| -> String {
        record
            .lines()
            .find(|l| l.split('|').next().map(str::trim) == Some(name))
            .and_then(|l| l.split_once('|'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| panic!("no {name} in record {record}"))
    };
    assert_eq!(field(records[0], "reason"), "invalid", "{out}");
    assert_eq!(field(records[1], "reason"), "missing", "{out}");
    assert_eq!(field(records[0], "application_name"), "rejected-app");

    // Unaligned stats; RELOAD; SHOW CONFIG.
    let stats = psql(&proxy, &["-At", "-F", "=", "-c", "SHOW STATS"]);
    assert!(stats.lines().any(|l| l == "rejections=2"), "{stats}");
    assert_eq!(psql(&proxy, &["-c", "RELOAD"]).trim(), "RELOAD");
    let config = psql(&proxy, &["-At", "-F", "=", "-c", "SHOW CONFIG"]);
    assert!(
        config.lines().any(|l| l == "admin.database=app"),
        "{config}"
    );
    // What an operator sees (shown with --nocapture; the README's samples come from here).
    eprintln!(
        "$ psql -d pgfence -c 'SHOW FENCES'\n{aligned}\n$ psql -d pgfence -x -c 'SHOW REJECTIONS'\n{}\n$ psql -d pgfence -c 'SHOW STATS'\n{}",
        psql(&proxy, &["-x", "-c", "SHOW REJECTIONS"]),
        psql(&proxy, &["-c", "SHOW STATS"])
    );
}

/// psql on the console reading `script` from stdin.
fn psql_stdin(proxy: &ProxyProcess, script: &str) -> String {
    run_psql(
        proxy
            .psql_cmd()
            .args(["-d", CONSOLE, "-v", "ON_ERROR_STOP=1", "-f", "-"]),
        Some(script),
    )
}

/// A console command's result: column names and rows of text.
struct Table {
    columns: Vec<String>,
    rows: Vec<Vec<String>>,
}

impl Table {
    /// The rows as maps column -> value.
    fn records(&self) -> Vec<BTreeMap<&str, &str>> {
        self.rows
            .iter()
            .map(|r| {
                self.columns
                    .iter()
                    .map(String::as_str)
                    .zip(r.iter().map(String::as_str))
                    .collect()
            })
            .collect()
    }

    /// Two-column tables (SHOW STATS, SHOW CONFIG) as a map.
    fn pairs(&self) -> BTreeMap<&str, &str> {
        self.rows
            .iter()
            .map(|r| (r[0].as_str(), r[1].as_str()))
            .collect()
    }
}

async fn show(client: &Client, command: &str) -> Table {
    let messages = client
        .simple_query(command)
        .await
        .unwrap_or_else(|e| panic!("{command}: {e:?}"));
    let mut columns = None;
    let mut rows = Vec::new();
    let mut completed = None;
    for m in messages {
        match m {
            SimpleQueryMessage::RowDescription(cols) => {
                columns = Some(cols.iter().map(|c| c.name().to_string()).collect())
            }
            SimpleQueryMessage::Row(row) => {
                if columns.is_none() {
                    columns = Some(row.columns().iter().map(|c| c.name().to_string()).collect());
                }
                rows.push(
                    (0..row.len())
                        .map(|i| row.get(i).unwrap_or("<NULL>").to_string())
                        .collect(),
                );
            }
            SimpleQueryMessage::CommandComplete(n) => completed = Some(n),
            _ => {}
        }
    }
    assert_eq!(completed, Some(rows.len() as u64), "{command}: row count");
    Table {
        columns: columns.unwrap_or_else(|| panic!("{command}: no RowDescription")),
        rows,
    }
}

fn parse_time(text: &str) -> SystemTime {
    humantime::parse_rfc3339(text).unwrap_or_else(|e| panic!("not an RFC 3339 time {text:?}: {e}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn simple_query_columns_and_content() {
    let started = SystemTime::now() - Duration::from_secs(1);
    let (cluster, proxy, config) = setup().await;
    let traffic = traffic(&proxy).await;
    let (session_addr, session_pid) = (traffic.addr, traffic.pid);
    let admin = proxy.connect(CONSOLE).await;

    // SHOW FENCES: the rows of pgfence.fences in the console database, as text.
    let fences = show(&admin, "SHOW FENCES").await;
    assert_eq!(fences.columns, ["resource", "token", "updated_at"]);
    let direct = show(
        &cluster.connect(APP_DB).await,
        "SELECT * FROM pgfence.fences ORDER BY resource",
    )
    .await;
    assert_eq!(fences.columns, direct.columns);
    assert_eq!(fences.rows, direct.rows);
    assert_eq!(fences.rows.len(), 2);
    assert_eq!((&*fences.rows[0][0], &*fences.rows[0][1]), ("billing", "5"));
    assert_eq!((&*fences.rows[1][0], &*fences.rows[1][1]), ("orders", "8"));

    // SHOW REJECTIONS: newest first, with the log fields.
    let rejections = show(&admin, "SHOW REJECTIONS").await;
    assert_eq!(
        rejections.columns,
        [
            "time",
            "resource",
            "token",
            "fence",
            "reason",
            "path",
            "client_addr",
            "user",
            "database",
            "application_name",
            "backend_pid",
            "statement",
        ]
    );
    let records = rejections.records();
    assert_eq!(records.len(), 2, "{:?}", rejections.rows);
    let pid = session_pid.to_string();
    let addr = session_addr.to_string();
    for (r, reason, token, statement) in [
        (
            &records[0],
            "invalid",
            "x9",
            "/* fencing_token=x9 */ INSERT INTO ledger VALUES (4)",
        ),
        (&records[1], "missing", "", "INSERT INTO ledger VALUES (3)"),
    ] {
        let expected: BTreeMap<&str, &str> = [
            ("resource", "billing"),
            ("token", token),
            ("fence", "<NULL>"),
            ("reason", reason),
            ("path", "database"),
            ("client_addr", addr.as_str()),
            ("user", SUPERUSER),
            ("database", APP_DB),
            ("application_name", "rejected-app"),
            ("backend_pid", pid.as_str()),
            ("statement", statement),
        ]
        .into_iter()
        .collect();
        let mut got = r.clone();
        let time = got.remove("time").expect("time column");
        assert_eq!(got, expected);
        let at = parse_time(time);
        assert!(at >= started && at <= SystemTime::now(), "{time}");
    }
    assert!(
        parse_time(records[0]["time"]) >= parse_time(records[1]["time"]),
        "newest first: {:?}",
        rejections.rows
    );

    // SHOW CLIENTS: the open session with its application_name, and the console itself.
    let clients = show(&admin, "SHOW CLIENTS").await;
    assert_eq!(
        clients.columns,
        [
            "id",
            "addr",
            "user",
            "database",
            "application_name",
            "backend_pid",
            "connected_at",
            "tls",
            "certificate_cn"
        ]
    );
    let records = clients.records();
    let mine: Vec<_> = records
        .iter()
        .filter(|r| r["application_name"] == "rejected-app")
        .collect();
    assert_eq!(mine.len(), 1, "{:?}", clients.rows);
    assert_eq!(mine[0]["addr"], addr);
    assert_eq!(mine[0]["user"], SUPERUSER);
    assert_eq!(mine[0]["tls"], "", "a plain connection");
    assert_eq!(mine[0]["certificate_cn"], "", "no certificate");
    assert_eq!(mine[0]["database"], APP_DB);
    assert_eq!(mine[0]["backend_pid"], pid);
    assert!(mine[0]["id"].parse::<u64>().is_ok(), "{:?}", mine[0]);
    parse_time(mine[0]["connected_at"]);
    assert!(
        records.iter().any(|r| r["database"] == CONSOLE),
        "the console session is a client too: {:?}",
        clients.rows
    );
    let ids: Vec<u64> = records
        .iter()
        .map(|r| r["id"].parse().expect("id"))
        .collect();
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "sorted by id: {ids:?}");

    // SHOW STATS: counters since start.
    let stats = show(&admin, "show stats;").await;
    assert_eq!(stats.columns, ["stat", "value"]);
    let stats = stats.pairs();
    let stat = |name: &str| -> u64 {
        stats
            .get(name)
            .unwrap_or_else(|| panic!("no stat {name}: {stats:?}"))
            .parse()
            .expect("numeric stat")
    };
    assert_eq!(
        stats.keys().copied().collect::<Vec<_>>(),
        [
            "clients_active",
            "clients_total",
            "fast_rejections",
            "fence_checks",
            "queries",
            "read_audit_questions",
            "rejections",
            "servers_idle",
            "servers_reused",
            "upstream_errors"
        ]
    );
    assert_eq!(stat("rejections"), 2);
    assert_eq!(stat("fast_rejections"), 0);
    assert_eq!(stat("upstream_errors"), 0);
    // writer, rejected-app, the console.
    assert_eq!(stat("clients_active"), 3);
    assert!(stat("clients_total") >= 3, "{stats:?}");
    assert!(stat("fence_checks") >= 4, "{stats:?}");
    assert!(stat("queries") >= 5, "{stats:?}");

    // SHOW CONFIG: what the file says.
    let shown = show(&admin, "SHOW CONFIG").await;
    assert_eq!(shown.columns, ["key", "value"]);
    let shown = shown.pairs();
    let listen = proxy.addr().to_string();
    let port = config.upstream.port.to_string();
    for (key, value) in [
        ("listen", listen.as_str()),
        ("upstream.host", "127.0.0.1"),
        ("upstream.port", port.as_str()),
        ("admin.database", APP_DB),
        ("admin.users", "[\"postgres\", \"md5user\"]"),
        ("fence.on_missing_token", "reject"),
        ("fence.fast_path", "true"),
        ("limits.connect_timeout", "10s"),
        ("limits.max_message_size", "268435456"),
        ("telemetry.log_format", "text"),
    ] {
        assert_eq!(shown.get(key).copied(), Some(value), "{key}: {shown:?}");
    }

    // SHOW HELP.
    let help = show(&admin, "SHOW HELP").await;
    assert_eq!(help.columns, ["command", "description"]);
    let commands: Vec<&str> = help.rows.iter().map(|r| r[0].as_str()).collect();
    assert_eq!(
        commands,
        [
            "SHOW FENCES",
            "SHOW REJECTIONS",
            "SHOW CLIENTS",
            "SHOW SERVERS",
            "SHOW STATS",
            "SHOW CONFIG",
            "SHOW VERSION",
            "RELOAD",
            "KILL_CLIENT id",
            "SHOW HELP"
        ]
    );
    assert!(help.rows.iter().all(|r| !r[1].is_empty()));

    // An unknown command is an error; the console stays usable.
    let err = admin
        .simple_query("SHOW TABLES")
        .await
        .expect_err("SHOW TABLES is no console command");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "42601", "{db:?}");
    assert!(db.message().contains("SHOW HELP"), "{db:?}");
    assert_eq!(show(&admin, "SHOW HELP").await.rows.len(), 10);
    // So is the extended protocol, with an error that says why.
    let err = admin
        .query("SHOW HELP", &[])
        .await
        .expect_err("the console speaks the simple protocol only");
    let db = err.as_db_error().expect("a server error");
    assert_eq!(db.code().code(), "0A000", "{db:?}");
    assert!(db.message().contains("simple query protocol"), "{db:?}");
    assert_eq!(show(&admin, "SHOW STATS").await.rows.len(), 10);
    assert!(
        admin.simple_query("").await.is_ok(),
        "an empty query is fine"
    );
    drop(traffic);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_admin_users_get_in() {
    let (_cluster, proxy, _) = setup().await;
    let err =
        match try_connect_to(&proxy.connstr_as(CONSOLE, SCRAM_USER, Some(SCRAM_PASSWORD))).await {
            Ok(_) => panic!("{SCRAM_USER} is not in admin.users"),
            Err(e) => e,
        };
    let db = err.as_db_error().unwrap_or_else(|| panic!("{err:?}"));
    assert_eq!(db.code().code(), "28000", "{db:?}");
    assert_eq!(db.severity(), "FATAL", "{db:?}");
    assert!(
        db.message().contains(SCRAM_USER) && db.message().contains("admin.users"),
        "{db:?}"
    );

    // psql says so too.
    let out = run_command(
        proxy
            .psql_cmd()
            .args(["-U", SCRAM_USER, "-d", CONSOLE, "-c", "SHOW HELP"])
            .env("PGPASSWORD", SCRAM_PASSWORD),
        None,
    );
    assert_eq!(out.code, Some(2), "psql cannot connect: {out:?}");
    assert!(
        out.stderr.contains("FATAL") && out.stderr.contains("admin console"),
        "{out:?}"
    );

    // An admin user logs in with its upstream password, and only with it.
    let err = match try_connect_to(&proxy.connstr_as(CONSOLE, MD5_USER, Some("wrong"))).await {
        Ok(_) => panic!("{MD5_USER} logged in to the console with a wrong password"),
        Err(e) => e,
    };
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("28P01"),
        "{err:?}"
    );
    let admin = try_connect_to(&proxy.connstr_as(CONSOLE, MD5_USER, Some(MD5_PASSWORD)))
        .await
        .expect("md5user with its password");
    assert_eq!(show(&admin, "SHOW HELP").await.rows.len(), 10);

    // Refused logins are the client's doing, not upstream errors, once their sessions ended.
    let mut stats = BTreeMap::new();
    for _ in 0..500 {
        stats = show(&admin, "SHOW STATS")
            .await
            .pairs()
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if stats["clients_active"] == "1" {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(stats["clients_active"], "1", "{stats:?}");
    assert_eq!(stats["upstream_errors"], "0", "{stats:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn extended_protocol_batch_gets_one_error() {
    let (_cluster, proxy, _) = setup().await;
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, CONSOLE);
    let batch = [
        wire::parse("", "SHOW HELP", &[]),
        wire::bind("", "", &[]),
        wire::describe(b'P', ""),
        wire::execute("", 0),
        wire::sync(),
    ]
    .concat();
    // Two batches in one write: each is answered by one error and its ReadyForQuery.
    conn.send(&[batch.clone(), batch].concat());
    for n in 0..2 {
        let replies = conn.until_ready();
        assert_eq!(replies.len(), 2, "batch {n}: {replies:?}");
        let message = wire::assert_error(&replies[0], "ERROR", "0A000");
        assert!(message.contains("simple query protocol"), "{message}");
        assert_eq!(replies[1].ready_status(), Some(b'I'));
    }
    conn.send(&wire::query("SHOW STATS"));
    let replies = conn.until_ready();
    let tags: Vec<u8> = replies.iter().map(|m| m.tag).collect();
    assert_eq!(tags.first(), Some(&b'T'), "{replies:?}");
    assert_eq!(&tags[tags.len() - 2..], b"CZ", "{replies:?}");
}

/// Commands sent back to back, one of them answered by the server (`SHOW FENCES`), are
/// answered in order; copy messages outside a COPY are ignored and a FunctionCall refused,
/// as PostgreSQL would. (Until 2026-12-06 the answers of pgfence's own commands overtook
/// `SHOW FENCES`'s, and the others ended the session; `SHOW FENCES` ended with the tag
/// `SELECT n` where the others end with `SHOW n`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pipelined_console_commands_are_answered_in_order() {
    let (_cluster, proxy, _) = setup().await;
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, CONSOLE);
    conn.send(
        &[
            wire::query("SHOW FENCES"),
            wire::query("SHOW VERSION"),
            wire::copy_data(b"stray"),
            wire::copy_done(),
            wire::copy_fail("stray"),
            wire::function_call(1598, &[]),
            wire::query("SHOW FENCES"),
            wire::query("SHOW HELP"),
        ]
        .concat(),
    );
    let first_column = |replies: &[wire::Msg]| {
        let description = replies
            .iter()
            .find(|m| m.tag == b'T')
            .expect("a RowDescription");
        let body = &description.body[2..];
        String::from_utf8_lossy(&body[..body.iter().position(|&b| b == 0).unwrap()]).to_string()
    };
    let fences = conn.until_ready();
    assert_eq!(first_column(&fences), "resource", "{fences:?}");
    // Its command tag is the console's, not that of the query the server ran.
    let rows = fences.iter().filter(|m| m.tag == b'D').count();
    let tag = fences
        .iter()
        .find(|m| m.tag == b'C')
        .expect("a CommandComplete");
    assert_eq!(tag.body, format!("SHOW {rows}\0").as_bytes(), "{fences:?}");
    let version = conn.until_ready();
    assert_eq!(first_column(&version), "version", "{version:?}");
    let call = conn.until_ready();
    assert_eq!(call.len(), 2, "{call:?}");
    let message = wire::assert_error(&call[0], "ERROR", "0A000");
    assert!(message.contains("function calls"), "{message}");
    let fences = conn.until_ready();
    assert_eq!(first_column(&fences), "resource", "{fences:?}");
    let help = conn.until_ready();
    assert_eq!(first_column(&help), "command", "{help:?}");

    // A message that does not hold what its type says ends the session, as on any other.
    conn.send(&wire::frame(b'S', b"x"));
    let replies = conn.until_closed();
    assert_eq!(replies.len(), 1, "{replies:?}");
    let message = wire::assert_error(&replies[0], "FATAL", "08P01");
    assert_eq!(message, "client sent a malformed Sync message");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_client_ends_one_session() {
    let (cluster, proxy, _) = setup().await;
    let direct = cluster.connect(APP_DB).await;
    let admin = proxy.connect(CONSOLE).await;

    let version = show(&admin, "SHOW VERSION").await;
    assert_eq!(version.columns, ["version"]);
    assert_eq!(
        version.rows,
        [[format!("pgfence {}", env!("CARGO_PKG_VERSION"))]]
    );

    // The victim, on raw protocol, in the middle of a fenced transaction.
    let options: &[u8] = b"-c fencing.token=5 -c fencing.resource=billing";
    let mut victim = RawConn::connect(proxy.addr());
    victim.send(&wire::startup_version(
        196608,
        &[
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
            ("options", options),
        ],
    ));
    victim.until_ready();
    victim.send(&wire::query("SELECT pg_backend_pid()"));
    let replies = victim.until_ready();
    let pid: i32 = replies
        .iter()
        .find_map(|m| m.data_row())
        .and_then(|row| row[0].clone())
        .map(|v| {
            String::from_utf8(v)
                .expect("pid text")
                .parse()
                .expect("pid")
        })
        .unwrap_or_else(|| panic!("no pid in {replies:?}"));
    victim.send(&wire::query("BEGIN; INSERT INTO ledger VALUES (41)"));
    assert_eq!(
        victim.until_ready().last().and_then(|m| m.ready_status()),
        Some(b'T')
    );

    // A bystander with the same settings.
    let bystander = harness::connect_to(&connstr(
        proxy.port(),
        "bystander",
        "-c fencing.token=5 -c fencing.resource=billing",
    ))
    .await;
    bystander
        .batch_execute("INSERT INTO ledger VALUES (42)")
        .await
        .expect("bystander writes before the kill");

    let clients = show(&admin, "SHOW CLIENTS").await;
    let id = clients
        .records()
        .iter()
        .find(|c| c["backend_pid"] == pid.to_string())
        .map(|c| c["id"].to_string())
        .unwrap_or_else(|| panic!("no client with backend_pid {pid}: {:?}", clients.rows));

    // Ids that name no client, or are no number, are errors; the console goes on.
    for (command, code) in [
        ("KILL_CLIENT 987654321", "42704"),
        ("KILL_CLIENT x", "42601"),
    ] {
        let err = admin
            .simple_query(command)
            .await
            .expect_err(command)
            .as_db_error()
            .cloned()
            .unwrap_or_else(|| panic!("{command}: not a database error"));
        assert_eq!(err.code().code(), code, "{command}: {err:?}");
        assert!(err.message().contains("SHOW CLIENTS"), "{command}: {err:?}");
    }

    admin
        .simple_query(&format!("KILL_CLIENT {id}"))
        .await
        .expect("KILL_CLIENT");
    let fatal = match victim.next(Duration::from_secs(5)) {
        Ok(wire::Read1::Msg(m)) => m,
        other => panic!("the killed session got no error: {other:?}"),
    };
    let message = wire::assert_error(&fatal, "FATAL", "57P01");
    assert!(message.contains("KILL_CLIENT"), "{message}");
    assert!(
        matches!(victim.next(Duration::from_secs(5)), Ok(wire::Read1::Closed)),
        "the killed session stays open"
    );

    // Its server connection was closed, not kept: the backend exits, the insert is gone.
    assert!(
        backend_gone(&direct, pid, Duration::from_secs(5)).await,
        "backend {pid} of the killed session is still there"
    );
    let ids: Vec<i32> = direct
        .query("SELECT id FROM ledger ORDER BY id", &[])
        .await
        .expect("ledger")
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(ids, [42], "the killed transaction's insert must roll back");

    // The console no longer lists it; the bystander is listed and still works.
    let clients = show(&admin, "SHOW CLIENTS").await;
    let records = clients.records();
    assert!(records.iter().all(|c| c["id"] != id), "{:?}", clients.rows);
    assert!(
        records.iter().any(|c| c["application_name"] == "bystander"),
        "{:?}",
        clients.rows
    );
    bystander
        .batch_execute("INSERT INTO ledger VALUES (43)")
        .await
        .expect("the bystander is not killed");
}

/// Whether backend `pid` leaves `pg_stat_activity` within `within`.
async fn backend_gone(direct: &tokio_postgres::Client, pid: i32, within: Duration) -> bool {
    let until = std::time::Instant::now() + within;
    loop {
        let row = direct
            .query_one(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = $1",
                &[&pid],
            )
            .await
            .expect("pg_stat_activity");
        if row.get::<_, i64>(0) == 0 {
            return true;
        }
        if std::time::Instant::now() > until {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `KILL_CLIENT` of a session whose COMMIT is in flight: the server may still commit it
/// (pgfence closes the connection; the backend finishes what it runs), so the FATAL 57P01
/// says so in its hint (a review saw a client told 57P01, which from PostgreSQL means
/// rolled back, for a COMMIT that committed; stop 55). And of a session whose client does
/// not read: it ends all the same, with its backend (its goodbye waited for the client
/// to read, and the session and backend stayed until the client closed).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_client_ends_sessions_in_flight_and_not_reading() {
    let (cluster, proxy, _) = setup().await;
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute(
            "CREATE FUNCTION slow_check() RETURNS trigger LANGUAGE plpgsql AS \
               $$ BEGIN PERFORM pg_sleep(2); RETURN NULL; END $$; \
             CREATE CONSTRAINT TRIGGER slow AFTER INSERT ON ledger \
               DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_check()",
        )
        .await
        .expect("deferred trigger");
    let admin = proxy.connect(CONSOLE).await;
    let kill = |application_name: &'static str| {
        let admin = &admin;
        async move {
            let clients = show(admin, "SHOW CLIENTS").await;
            let id = clients
                .records()
                .iter()
                .find(|c| c["application_name"] == application_name)
                .map(|c| (c["id"].to_string(), c["backend_pid"].to_string()))
                .unwrap_or_else(|| panic!("no client {application_name}: {:?}", clients.rows));
            admin
                .simple_query(&format!("KILL_CLIENT {}", id.0))
                .await
                .expect("KILL_CLIENT");
            id.1.parse::<i32>().expect("backend pid")
        }
    };
    let login = |application_name: &str| {
        let mut conn = RawConn::connect(proxy.addr());
        conn.send(&wire::startup_version(
            196608,
            &[
                ("user", SUPERUSER.as_bytes()),
                ("database", APP_DB.as_bytes()),
                ("application_name", application_name.as_bytes()),
                ("options", b"-c fencing.token=5"),
            ],
        ));
        conn.until_ready();
        conn
    };

    let mut committing = login("committing");
    committing.send(&wire::query("BEGIN; INSERT INTO ledger VALUES (51)"));
    committing.until_ready();
    committing.send(&wire::query("COMMIT"));
    tokio::time::sleep(Duration::from_millis(500)).await;
    kill("committing").await;
    let fatal = match committing.next(Duration::from_secs(5)) {
        Ok(wire::Read1::Msg(m)) => m,
        other => panic!("the killed session got no error: {other:?}"),
    };
    wire::assert_error(&fatal, "FATAL", "57P01");
    let hint = fatal.field(b'H').unwrap_or_default();
    assert!(
        hint.contains("may or may not have committed"),
        "the goodbye does not say the COMMIT in flight may have committed: {fatal:?}"
    );

    let mut deaf = login("deaf");
    deaf.send(&wire::query(
        "SELECT repeat('x', 1000000) FROM generate_series(1, 500)",
    ));
    tokio::time::sleep(Duration::from_secs(1)).await;
    let pid = kill("deaf").await;
    assert!(
        backend_gone(&direct, pid, Duration::from_secs(10)).await,
        "the backend of a killed client that does not read is still there"
    );
    let clients = show(&admin, "SHOW CLIENTS").await;
    assert!(
        clients
            .records()
            .iter()
            .all(|c| c["application_name"] != "deaf"),
        "{:?}",
        clients.rows
    );
    drop(deaf);
}

/// `SHOW STATS` counts each client Query once, also one pgfence holds until the check
/// before it is answered (a Query inside an extended-protocol batch that wrote, whose
/// transaction it commits) and then handles again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_held_for_its_check_counts_once() {
    let (_cluster, proxy, _config) = setup().await;
    let admin = proxy.connect(CONSOLE).await;
    let stat = |name: &'static str| {
        let admin = &admin;
        async move {
            let stats = show(admin, "SHOW STATS").await;
            let value: u64 = stats.pairs()[name].parse().expect("numeric stat");
            value
        }
    };
    let (queries, checks) = (stat("queries").await, stat("fence_checks").await);
    let mut session = RawConn::login_with_options(
        proxy.addr(),
        SUPERUSER,
        APP_DB,
        "-c fencing.token=5 -c fencing.resource=billing",
    );
    let parse = |sql: &str| wire::parse("", sql, &[]);
    session.send(
        &[
            parse("INSERT INTO ledger VALUES (1)"),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::query("SELECT 1"),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = session.until_ready();
    assert!(replies.iter().all(|m| m.tag != b'E'), "{replies:?}");
    session.until_ready();
    // The Execute and the Query (the console's own are not counted); the check before the
    // Query.
    assert_eq!(stat("queries").await, queries + 2);
    assert_eq!(stat("fence_checks").await, checks + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn show_fences_without_the_schema_says_what_to_do() {
    let cluster = PgCluster::start();
    let mut config = Proxy::config_for(&cluster);
    config.admin.users = vec![SUPERUSER.into()];
    config.admin.database = "postgres".into();
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}"])
        .start();
    let (admin, _) = connect_from(proxy.addr(), &proxy.connstr(CONSOLE)).await;
    let err = admin
        .simple_query("SHOW FENCES")
        .await
        .expect_err("no pgfence.fences in postgres");
    let db = err.as_db_error().unwrap_or_else(|| panic!("{err:?}"));
    assert_eq!(db.code().code(), "42P01", "{db:?}");
    let hint = db.hint().unwrap_or_default();
    assert!(
        hint.contains("admin.database (\"postgres\"") && hint.contains("pgfence install"),
        "{db:?}"
    );
    assert_eq!(show(&admin, "SHOW VERSION").await.rows.len(), 1);
}

/// Each column's name and type OID, from the RowDescription the console answers `command`
/// with (raw protocol: tokio-postgres' simple query does not show types).
fn column_types(proxy: &ProxyProcess, command: &str) -> Vec<(String, u32)> {
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, CONSOLE);
    conn.send(&wire::query(command));
    let replies = conn.until_ready();
    let description = replies
        .iter()
        .find(|m| m.tag == b'T')
        .unwrap_or_else(|| panic!("{command}: no RowDescription in {replies:?}"));
    let body = &description.body;
    let count = u16::from_be_bytes([body[0], body[1]]);
    let mut at = 2;
    (0..count)
        .map(|_| {
            let end = at + body[at..].iter().position(|&b| b == 0).expect("a name");
            let name = String::from_utf8_lossy(&body[at..end]).into_owned();
            let oid = &body[end + 7..end + 11];
            at = end + 19;
            (name, u32::from_be_bytes([oid[0], oid[1], oid[2], oid[3]]))
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn numbers_are_typed_int8() {
    const INT8: u32 = 20;
    const TEXT: u32 = 25;
    let (_cluster, proxy, _) = setup().await;
    let _session = proxy.connect(APP_DB).await;
    for (command, numbers) in [
        ("SHOW STATS", &["value"][..]),
        ("SHOW CLIENTS", &["id", "backend_pid"]),
        ("SHOW REJECTIONS", &["fence", "backend_pid"]),
        (
            "SHOW SERVERS",
            &["backend_pid", "idle_seconds", "age_seconds"],
        ),
        ("SHOW CONFIG", &[]),
    ] {
        let types = column_types(&proxy, command);
        assert!(!types.is_empty(), "{command}");
        for (name, oid) in &types {
            let expected = if numbers.contains(&name.as_str()) {
                INT8
            } else {
                TEXT
            };
            assert_eq!(*oid, expected, "{command}: column {name}: {types:?}");
        }
    }
}
