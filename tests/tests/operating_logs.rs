//! Rejection logs as operators read them (SPEC section 7), from the real `pgfence` binary.
//!
//! - [`json_log_has_one_event_per_rejection`]: with `--log-format json`, every stderr line is
//!   a JSON object; each rejected transaction (database path: stale in autocommit and at an
//!   explicit COMMIT, missing, invalid; fast path: stale in autocommit and inside a
//!   transaction) is exactly one WARN `fence rejected` event with resource, token, fence,
//!   reason, path, client_addr, user, database, application_name, backend_pid, session and
//!   the first 200 characters of the statement; a token accepted above the highest this
//!   pgfence knew is an INFO `higher token accepted` event;
//!   no INFO-or-above event other than a rejection carries statement text; connections open
//!   and close at DEBUG.
//! - [`a_rejection_names_its_own_transactions_statement`]: two stale writes pipelined in
//!   one batch are logged each with its own statement; a batch's write checked before a
//!   Query that ends its transaction is named, not the Query; a FunctionCall by its oid; a
//!   checked read that wrote (through a view) is logged with the read, not the session's
//!   earlier write.
//! - [`a_database_without_the_schema_says_how_to_install_it`]: writes fail with the
//!   server's 3F000 and a hint naming `pgfence install`, in both protocols, logged at WARN
//!   once; reads go on.
//! - [`broken_connections_are_logged`]: a session whose backend is terminated is a WARN
//!   naming the client; a client that breaks the protocol an INFO naming it.
//! - [`text_log_without_fast_path`]: the default text format, and `fence.fast_path = false`:
//!   a repeated stale write is rejected by the database every time.

use std::net::SocketAddr;

use harness::fence::{self, assert_rejected, sqlstate};
use harness::operating::{
    connect_from, eventually, int_field, json_events, level, message, str_field, wait_for_log,
    Event,
};
use harness::wire::{self, RawConn};
use harness::{quote_conn_value, PgCluster, Proxy, ProxyProcess, APP_DB, SUPERUSER};
use pgfence_config::{Config, DefaultResource};
use serde_json::Value;
use tokio_postgres::Client;

/// In every statement the tests send, so that statement text is recognisable in logs.
const MARKER: &str = "stmt-marker-q7";

/// A cluster with schema `pgfence` and table `ledger` in `app`.
async fn cluster_with_ledger() -> PgCluster {
    let cluster = PgCluster::start();
    let direct = cluster.connect(APP_DB).await;
    fence::install(&direct).await;
    direct
        .batch_execute("CREATE TABLE ledger (id int, note text)")
        .await
        .expect("create table ledger");
    cluster
}

/// Sessions of database `app` are fenced on `billing` unless they name another resource.
fn config(cluster: &PgCluster) -> Config {
    let mut config = Proxy::config_for(cluster);
    config.fence.defaults = vec![DefaultResource {
        database: APP_DB.into(),
        user: None,
        resource: "billing".into(),
    }];
    config
}

/// A connection string for `app` with `application_name` and startup `options`.
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

async fn session(addr: SocketAddr, app: &str, options: &str) -> (Client, SocketAddr) {
    connect_from(addr, &connstr(addr.port(), app, options)).await
}

async fn backend_pid(client: &Client) -> i64 {
    let pid: i32 = client
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid()")
        .get(0);
    i64::from(pid)
}

/// An INSERT into `ledger` carrying [`MARKER`].
fn insert(id: i32, note: &str) -> String {
    format!("INSERT INTO ledger VALUES ({id}, '{MARKER} {note}')")
}

/// What one `fence rejected` event must say.
struct ExpectedEvent<'a> {
    application_name: &'a str,
    client: SocketAddr,
    backend_pid: i64,
    resource: &'a str,
    token: &'a str,
    fence: Option<i64>,
    reason: &'a str,
    path: &'a str,
    statement: &'a str,
}

fn assert_event(event: &Event, e: &ExpectedEvent) {
    let ctx = format!(
        "{} ({} {}): {event:?}",
        e.application_name, e.reason, e.path
    );
    assert_eq!(level(event), "WARN", "{ctx}");
    assert_eq!(message(event), "fence rejected", "{ctx}");
    assert_eq!(str_field(event, "resource"), e.resource, "{ctx}");
    assert_eq!(str_field(event, "token"), e.token, "{ctx}");
    assert_eq!(
        event.get("fence").and_then(Value::as_i64),
        e.fence,
        "fence of {ctx}"
    );
    assert_eq!(str_field(event, "reason"), e.reason, "{ctx}");
    assert_eq!(str_field(event, "path"), e.path, "{ctx}");
    assert_eq!(
        str_field(event, "client_addr"),
        e.client.to_string(),
        "{ctx}"
    );
    assert_eq!(str_field(event, "user"), SUPERUSER, "{ctx}");
    assert_eq!(str_field(event, "database"), APP_DB, "{ctx}");
    assert_eq!(
        str_field(event, "application_name"),
        e.application_name,
        "{ctx}"
    );
    assert_eq!(int_field(event, "backend_pid"), e.backend_pid, "{ctx}");
    // The id SHOW CLIENTS lists; sessions are numbered from 1.
    assert!(int_field(event, "session") >= 1, "session of {ctx}");
    assert_eq!(str_field(event, "statement"), e.statement, "{ctx}");
}

#[tokio::test]
async fn json_log_has_one_event_per_rejection() {
    let cluster = cluster_with_ledger().await;
    let config = config(&cluster);
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "debug")
        .start();
    // Another pgfence in front of the same database: the new leader writes through it, so
    // the proxy under test learns of the higher tokens only from the database.
    let other = Proxy::start(config);
    let leader = |options: &'static str| {
        let connstr = connstr(other.port(), "leader", options);
        async move { harness::connect_to(&connstr).await }
    };

    // Accepted: the fence of billing advances from nothing to 5.
    let (a, a_addr) = session(
        proxy.addr(),
        "writer-a",
        "-c fencing.token=5 -c fencing.resource=billing",
    )
    .await;
    let a_pid = backend_pid(&a).await;
    a.batch_execute(&insert(1, "accepted"))
        .await
        .expect("token 5 is accepted");

    // The new leader writes 7 elsewhere; writer-a's next write is stale. The proxy only knows
    // 5: the database rejects it. The statement is longer than 200 characters.
    leader("-c fencing.token=7 -c fencing.resource=billing")
        .await
        .batch_execute(&insert(100, "leader"))
        .await
        .expect("token 7 is accepted");
    let long = insert(2, &format!("database {}", "x".repeat(300)));
    assert_rejected(
        &a.batch_execute(&long).await,
        &fence::stale("billing", 5, 7),
        "writer-a, database path",
    );
    // Now the proxy knows 7: the fast path rejects without asking the database.
    let fast = insert(3, "fast");
    assert_rejected(
        &a.batch_execute(&fast).await,
        &fence::stale("billing", 5, 7),
        "writer-a, fast path",
    );

    // Fast path inside an explicit transaction, over the extended protocol: one rejection,
    // the statements after it fail as in any aborted transaction, COMMIT rolls back.
    let (t, t_addr) = session(
        proxy.addr(),
        "writer-tx",
        "-c fencing.token=6 -c fencing.resource=billing",
    )
    .await;
    let t_pid = backend_pid(&t).await;
    t.batch_execute("BEGIN").await.expect("BEGIN");
    let tx_first = insert(4, "tx first");
    assert_rejected(
        &t.execute(tx_first.as_str(), &[]).await,
        &fence::stale("billing", 6, 7),
        "writer-tx, first write",
    );
    assert_eq!(
        sqlstate(&t.execute(insert(5, "tx second").as_str(), &[]).await).as_deref(),
        Some("25P02"),
        "writer-tx, second write in the aborted transaction"
    );
    t.batch_execute("COMMIT").await.expect("COMMIT rolls back");

    // Missing token: the configured default resource billing requires one.
    let (m, m_addr) = session(proxy.addr(), "writer-missing", "").await;
    let m_pid = backend_pid(&m).await;
    let missing = insert(6, "missing");
    assert_rejected(
        &m.batch_execute(&missing).await,
        &fence::missing("billing"),
        "writer-missing",
    );

    // Invalid token, in a comment.
    let invalid = format!("/* fencing_token=abc */ {}", insert(7, "invalid"));
    assert_rejected(
        &m.batch_execute(&invalid).await,
        &fence::invalid_token("billing", "abc"),
        "writer-missing, invalid token",
    );

    // Database path at an explicit COMMIT, two writes in the transaction: one event.
    leader("-c fencing.token=9 -c fencing.resource=orders")
        .await
        .batch_execute(&insert(101, "orders leader"))
        .await
        .expect("orders token 9 is accepted");
    let (mut o, o_addr) = session(
        proxy.addr(),
        "writer-orders",
        "-c fencing.token=8 -c fencing.resource=orders",
    )
    .await;
    let o_pid = backend_pid(&o).await;
    let commit = async {
        let tx = o.build_transaction().start().await?;
        tx.execute(insert(8, "orders one").as_str(), &[]).await?;
        tx.execute(insert(9, "orders two").as_str(), &[]).await?;
        tx.commit().await
    }
    .await;
    assert_rejected(
        &commit,
        &fence::stale("orders", 8, 9),
        "writer-orders at COMMIT",
    );

    // A later accepted write raises the fence the proxy knows (7, learned from a rejection).
    let (b, _) = session(
        proxy.addr(),
        "writer-b",
        "-c fencing.token=10 -c fencing.resource=billing",
    )
    .await;
    b.batch_execute(&insert(10, "accepted b"))
        .await
        .expect("token 10 is accepted");
    drop((a, t, m, o, b));

    // At least the harness's readiness probe has come and gone.
    let logs = wait_for_log(&proxy, 0, "client disconnected");
    let events = json_events(&logs);
    let rejected: Vec<&Event> = events
        .iter()
        .filter(|e| message(e) == "fence rejected")
        .collect();
    let of = |app: &str| -> Vec<&Event> {
        rejected
            .iter()
            .copied()
            .filter(|e| e.get("application_name").and_then(Value::as_str) == Some(app))
            .collect()
    };
    assert_eq!(
        rejected.len(),
        6,
        "one event per rejected transaction:\n{logs}"
    );
    let writer_a = of("writer-a");
    assert_eq!(writer_a.len(), 2, "{writer_a:?}");
    let first_200: String = long.chars().take(200).collect();
    assert_event(
        writer_a[0],
        &ExpectedEvent {
            application_name: "writer-a",
            client: a_addr,
            backend_pid: a_pid,
            resource: "billing",
            token: "5",
            fence: Some(7),
            reason: "stale",
            path: "database",
            statement: &first_200,
        },
    );
    assert_event(
        writer_a[1],
        &ExpectedEvent {
            application_name: "writer-a",
            client: a_addr,
            backend_pid: a_pid,
            resource: "billing",
            token: "5",
            fence: Some(7),
            reason: "stale",
            path: "fast",
            statement: &fast,
        },
    );
    let writer_tx = of("writer-tx");
    assert_eq!(writer_tx.len(), 1, "{writer_tx:?}");
    assert_event(
        writer_tx[0],
        &ExpectedEvent {
            application_name: "writer-tx",
            client: t_addr,
            backend_pid: t_pid,
            resource: "billing",
            token: "6",
            fence: Some(7),
            reason: "stale",
            path: "fast",
            statement: &tx_first,
        },
    );
    let writer_missing = of("writer-missing");
    assert_eq!(writer_missing.len(), 2, "{writer_missing:?}");
    assert_event(
        writer_missing[0],
        &ExpectedEvent {
            application_name: "writer-missing",
            client: m_addr,
            backend_pid: m_pid,
            resource: "billing",
            token: "",
            fence: None,
            reason: "missing",
            path: "database",
            statement: &missing,
        },
    );
    assert_event(
        writer_missing[1],
        &ExpectedEvent {
            application_name: "writer-missing",
            client: m_addr,
            backend_pid: m_pid,
            resource: "billing",
            token: "abc",
            fence: None,
            reason: "invalid",
            path: "database",
            statement: &invalid,
        },
    );
    let writer_orders = of("writer-orders");
    assert_eq!(writer_orders.len(), 1, "{writer_orders:?}");
    let orders = writer_orders[0];
    assert_eq!(str_field(orders, "client_addr"), o_addr.to_string());
    assert_eq!(int_field(orders, "backend_pid"), o_pid);
    assert_eq!(str_field(orders, "resource"), "orders");
    assert_eq!(str_field(orders, "token"), "8");
    assert_eq!(int_field(orders, "fence"), 9);
    assert_eq!(str_field(orders, "reason"), "stale");
    assert_eq!(str_field(orders, "path"), "database");
    let statement = str_field(orders, "statement");
    assert!(
        !statement.is_empty() && statement.chars().count() <= 200,
        "{orders:?}"
    );

    // Tokens above what this pgfence knew, at INFO: billing 5 (writer-a, nothing known
    // before), 10 (writer-b, 7 known). The leader's 7 and 9 were learned from rejections,
    // not from accepted writes here.
    let advanced: Vec<&Event> = events
        .iter()
        .filter(|e| message(e) == "higher token accepted")
        .collect();
    assert_eq!(advanced.len(), 2, "higher token accepted events:\n{logs}");
    for (event, known_before, token) in [(advanced[0], None, 5), (advanced[1], Some(7), 10)] {
        assert_eq!(level(event), "INFO", "{event:?}");
        assert_eq!(str_field(event, "resource"), "billing", "{event:?}");
        assert_eq!(
            event.get("known_before").and_then(Value::as_i64),
            known_before,
            "{event:?}"
        );
        assert_eq!(int_field(event, "token"), token, "{event:?}");
    }
    assert_eq!(str_field(advanced[0], "client"), a_addr.to_string());

    // Statement text appears only in rejections, at INFO and above.
    for event in &events {
        let loud = matches!(level(event), "INFO" | "WARN" | "ERROR");
        if loud && message(event) != "fence rejected" {
            let text = serde_json::to_string(event).expect("serialize an event");
            assert!(
                !text.contains(MARKER) && !text.contains("INSERT"),
                "statement text in a {} event: {text}",
                level(event)
            );
        }
    }
    // Connections open and close at DEBUG.
    for what in ["client connected", "client disconnected"] {
        let found: Vec<&Event> = events.iter().filter(|e| message(e) == what).collect();
        assert!(!found.is_empty(), "no {what:?} event:\n{logs}");
        assert!(
            found.iter().all(|e| level(e) == "DEBUG"),
            "{what:?} above DEBUG: {found:?}"
        );
    }
    // A line as written (shown with --nocapture; the README's sample comes from here).
    let sample = logs
        .lines()
        .filter(|l| l.contains("\"fence rejected\""))
        .nth(1);
    eprintln!("sample rejection line: {}", sample.unwrap_or_default());
}

#[tokio::test]
async fn text_log_without_fast_path() {
    let cluster = cluster_with_ledger().await;
    let mut config = config(&cluster);
    config.fence.fast_path = false;
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args(["--config", "{config}"])
        .env("RUST_LOG", "info")
        .start();
    let other = Proxy::start(config);
    let leader = harness::connect_to(&connstr(
        other.port(),
        "leader",
        "-c fencing.token=7 -c fencing.resource=billing",
    ))
    .await;

    let (a, a_addr) = session(
        proxy.addr(),
        "writer-a",
        "-c fencing.token=5 -c fencing.resource=billing",
    )
    .await;
    a.batch_execute(&insert(1, "accepted"))
        .await
        .expect("token 5 is accepted");
    leader
        .batch_execute(&insert(100, "leader"))
        .await
        .expect("token 7 is accepted");
    // The second statement spans two lines, the second looking like a log line of its own.
    let forged = "2026-01-01T00:00:00.000000Z  WARN pgfence: fence rejected resource=forged";
    for (n, note) in ["stale".to_string(), format!("stale\n{forged}")]
        .iter()
        .enumerate()
    {
        assert_rejected(
            &a.batch_execute(&insert(2 + n as i32, note)).await,
            &fence::stale("billing", 5, 7),
            &format!("stale write {n}"),
        );
    }

    let logs = proxy.logs();
    let lines: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("fence rejected"))
        .collect();
    assert_eq!(lines.len(), 2, "one line per rejection:\n{logs}");
    for (i, line) in lines.iter().enumerate() {
        assert!(
            serde_json::from_str::<Value>(line).is_err(),
            "text by default: {line}"
        );
        // Strings are quoted, so that a value with spaces (a statement) reads as one field.
        for part in [
            " WARN ",
            "resource=\"billing\"",
            "token=\"5\"",
            "fence=7",
            "reason=\"stale\"",
            "path=\"database\"",
            &format!("client_addr=\"{a_addr}\""),
            "user=\"postgres\"",
            "database=\"app\"",
            "application_name=\"writer-a\"",
            "backend_pid=",
            &format!(
                "statement=\"INSERT INTO ledger VALUES ({}, '{MARKER} stale",
                2 + i
            ),
        ] {
            assert!(line.contains(part), "{part:?} missing from: {line}");
        }
    }
    assert!(
        lines[1].contains(&format!("stale\\n{forged}')\"")),
        "the newline of the statement is escaped: {}",
        lines[1]
    );
    let advanced: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("higher token accepted"))
        .collect();
    assert_eq!(advanced.len(), 1, "one higher token (5):\n{logs}");
    assert!(
        advanced[0].contains(" INFO ")
            && advanced[0].contains("token=5")
            && !advanced[0].contains("known_before"),
        "{}",
        advanced[0]
    );
}

/// Whether a reply is the error FN001 (stale).
fn has_fn001(replies: &[wire::Msg]) -> bool {
    replies
        .iter()
        .any(|m| m.sqlstate().as_deref() == Some("FN001"))
}

/// The statements the `fence rejected` events of `proxy` name, in order.
fn rejected_statements(proxy: &ProxyProcess) -> Vec<String> {
    json_events(&proxy.logs())
        .iter()
        .filter(|e| message(e) == "fence rejected")
        .map(|e| str_field(e, "statement").to_string())
        .collect()
}

/// A rejection names its own transaction's statement:
/// - two autocommit writes pipelined in one batch (each to its Sync), both stale and both
///   rejected by the database: each event names its own write, though pgfence has read the
///   second before the first's rejection comes back;
/// - where reads are checked (`fence.skip_read_only = false`), a transaction that only
///   reads names its read, not the session's last write, in both protocols.
#[tokio::test]
async fn a_rejection_names_its_own_transactions_statement() {
    let cluster = cluster_with_ledger().await;
    let mut config = config(&cluster);
    config.fence.skip_read_only = false;
    // Every rejection from the database, so the second write of the pipeline is not
    // rejected locally once the first rejection taught pgfence the fence.
    config.fence.fast_path = false;
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .start();
    let other = Proxy::start(config);
    let options = "-c fencing.token=5 -c fencing.resource=billing";
    let (a, _) = session(proxy.addr(), "writer-a", options).await;
    a.batch_execute(&insert(1, "accepted"))
        .await
        .expect("token 5 is accepted");
    harness::connect_to(&connstr(
        other.port(),
        "leader",
        "-c fencing.token=7 -c fencing.resource=billing",
    ))
    .await
    .batch_execute(&insert(100, "leader"))
    .await
    .expect("token 7 is accepted");

    // Two stale autocommit writes in one batch.
    let (first, second) = (insert(2, "pipelined first"), insert(3, "pipelined second"));
    let mut raw = RawConn::login_with_options(proxy.addr(), SUPERUSER, APP_DB, options);
    let mut batch = Vec::new();
    for sql in [&first, &second] {
        batch.extend(wire::parse("", sql.as_str(), &[]));
        batch.extend(wire::bind("", "", &[]));
        batch.extend(wire::execute("", 0));
        batch.extend(wire::sync());
    }
    raw.send(&batch);
    for n in ["first", "second"] {
        let replies = raw.until_ready();
        assert!(
            has_fn001(&replies),
            "the {n} pipelined write is rejected: {replies:?}"
        );
    }
    // A stale write in a batch, then a Query that ends the batch's transaction: the check
    // before the Query is the batch's (the Query never runs).
    let in_batch = insert(4, "batch before a query");
    raw.send(
        &[
            wire::parse("", in_batch.as_str(), &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::query(insert(5, "query ending the batch")),
            wire::sync(),
        ]
        .concat(),
    );
    let replies = raw.until_ready();
    assert!(
        has_fn001(&replies),
        "the batch's write is rejected: {replies:?}"
    );
    raw.until_ready();
    // A FunctionCall that writes (`lo_creat`) in a block: named by its function's oid.
    raw.send(&wire::query("BEGIN"));
    raw.until_ready();
    raw.send(&wire::function_call(957, &[Some(b"-1")]));
    raw.until_ready();
    raw.send(&wire::query("COMMIT"));
    let replies = raw.until_ready();
    assert!(
        has_fn001(&replies),
        "the FunctionCall's block is rejected: {replies:?}"
    );
    // Reads that are checked, after the session's accepted write. The check rejects only
    // a transaction that wrote: these read a view whose function writes.
    cluster
        .connect(APP_DB)
        .await
        .batch_execute(
            "CREATE FUNCTION note_read() RETURNS int LANGUAGE sql AS \
               $$ INSERT INTO ledger VALUES (0, 'read') RETURNING 1 $$; \
             CREATE VIEW noted AS SELECT note_read() AS n",
        )
        .await
        .expect("create a view that writes");
    let read_simple = format!("BEGIN; SELECT n AS \"{MARKER} simple read\" FROM noted");
    a.batch_execute(&read_simple).await.expect("BEGIN and read");
    assert_rejected(
        &a.batch_execute("COMMIT").await,
        &fence::stale("billing", 5, 7),
        "a read-only block at COMMIT",
    );
    let read_extended = format!("SELECT n AS \"{MARKER} extended read\" FROM noted");
    assert_rejected(
        &a.query(read_extended.as_str(), &[]).await.map(drop),
        &fence::stale("billing", 5, 7),
        "an autocommit read, extended protocol",
    );

    // A statement checked before its Bind, in a transaction of its own (it cannot be fenced
    // atomically), after a read: named, not the read (review I, stop 54).
    raw.send(&wire::query("SELECT 1"));
    raw.until_ready();
    raw.send(
        &[
            wire::parse("", "VACUUM ledger", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::sync(),
        ]
        .concat(),
    );
    assert!(has_fn001(&raw.until_ready()), "the stale VACUUM");
    // A FunctionCall inside a batch, checked first in the batch's transaction: named, not
    // the statement before it (the `COMMIT`, or the `VACUUM` above; review P, stop 55).
    raw.send(
        &[
            wire::parse("", "COMMIT", &[]),
            wire::bind("", "", &[]),
            wire::execute("", 0),
            wire::function_call(957, &[Some(b"-1")]),
            wire::sync(),
        ]
        .concat(),
    );
    assert!(
        has_fn001(&raw.until_ready()),
        "the stale FunctionCall in a batch"
    );
    // A client whose encoding is LATIN1: its text converted, not U+FFFD (review H, stop 54).
    let mut latin1 = RawConn::login_with_params(
        proxy.addr(),
        &[
            ("user", SUPERUSER.as_bytes()),
            ("database", APP_DB.as_bytes()),
            ("options", options.as_bytes()),
            ("client_encoding", b"LATIN1"),
        ],
    );
    let mut text = insert(6, "caf").into_bytes();
    text.insert(text.len() - 2, 0xE9);
    latin1.send(&wire::query(&text));
    assert!(has_fn001(&latin1.until_ready()), "the LATIN1 write");

    let function_call = "FunctionCall (function oid 957)".to_string();
    let expected = [
        first,
        second,
        in_batch,
        function_call,
        read_simple,
        read_extended,
        "VACUUM ledger".to_string(),
        "FunctionCall (function oid 957)".to_string(),
        insert(6, "café"),
    ];
    let statements = eventually(
        "every rejection logged",
        || Some(rejected_statements(&proxy)).filter(|s| s.len() >= expected.len()),
        || proxy.logs(),
    );
    assert_eq!(statements, expected, "logs:\n{}", proxy.logs());
}

#[tokio::test]
async fn a_database_without_the_schema_says_how_to_install_it() {
    let cluster = PgCluster::start();
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute("CREATE TABLE ledger (id int, note text)")
        .await
        .expect("create table ledger");
    let proxy = ProxyProcess::builder()
        .config(Proxy::config_for(&cluster))
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .start();
    let (client, _) = session(proxy.addr(), "no-schema", "").await;
    let hint = format!("run `pgfence install --database {APP_DB}`");
    for (protocol, result) in [
        ("simple", client.batch_execute(&insert(1, "simple")).await),
        (
            "extended",
            client.execute(&insert(2, "extended"), &[]).await.map(drop),
        ),
        (
            "simple again",
            client.batch_execute(&insert(3, "again")).await,
        ),
    ] {
        let e = result.expect_err(protocol);
        let db = e.as_db_error().unwrap_or_else(|| panic!("{protocol}: {e}"));
        assert_eq!(db.code().code(), "3F000", "{protocol}: {db:?}");
        assert!(
            db.hint().is_some_and(|h| h.contains(&hint)),
            "{protocol}: {db:?}"
        );
    }
    let one: i32 = client
        .query_one("SELECT 1", &[])
        .await
        .expect("reads go on")
        .get(0);
    assert_eq!(one, 1);
    // Reads of built-ins a newcomer or a monitor runs first (psql's `\l`) skip the check,
    // which needs the schema: they once failed with 3F000 too (review H, stop 54).
    for read in [
        "SELECT pg_catalog.pg_get_userbyid(d.datdba), \
         pg_catalog.pg_encoding_to_char(d.encoding), \
         pg_catalog.array_to_string(d.datacl, E'\\n') FROM pg_catalog.pg_database d",
        "SELECT pg_size_pretty(pg_database_size(current_database())), \
         txid_current_if_assigned(), pg_current_xact_id_if_assigned()",
    ] {
        client.simple_query(read).await.expect(read);
    }
    let logs = proxy.logs();
    let warned: Vec<Event> = json_events(&logs)
        .into_iter()
        .filter(|e| level(e) == "WARN" && str_field(e, "database") == APP_DB)
        .collect();
    assert_eq!(warned.len(), 1, "one WARN for the database:\n{logs}");
    // The operator's command names the server (run as the hint says, without it, it went
    // to 127.0.0.1:5432); the client's hint does not.
    let command = format!(
        "run `pgfence install --upstream 127.0.0.1:{} --database {APP_DB:?}`",
        cluster.port()
    );
    assert!(message(&warned[0]).contains(&command), "{:?}", warned[0]);
    assert_eq!(
        direct
            .query_one("SELECT count(*) FROM ledger", &[])
            .await
            .expect("count")
            .get::<_, i64>(0),
        0
    );
    // The read audit's question failed once (an error in the server's log); later
    // sessions do not ask again for a while.
    for n in 0..3 {
        let (client, _) = session(proxy.addr(), &format!("later {n}"), "").await;
        client.simple_query("SELECT 1").await.expect("reads go on");
    }
    let asked = cluster
        .server_log()
        .matches("SELECT pgfence.reads_may_write(9)")
        .count();
    assert_eq!(asked, 1, "{}", cluster.server_log());
}

/// A schema older than version 9 (here: without `pgfence.reads_may_write(integer)`) cannot
/// answer for this pgfence's classifier: every transaction is checked, reads too, and one
/// WARN per database names the SQLSTATE and the fix.
#[tokio::test]
async fn a_schema_older_than_version_9_checks_reads_and_is_reported_once() {
    let cluster = cluster_with_ledger().await;
    let direct = cluster.connect(APP_DB).await;
    direct
        .batch_execute("DROP FUNCTION pgfence.reads_may_write(integer)")
        .await
        .expect("drop the function");
    let mut config = config(&cluster);
    config.admin.users = vec![SUPERUSER.into()];
    let proxy = ProxyProcess::builder()
        .config(config)
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .start();
    let admin = harness::connect_to(&format!(
        "host=127.0.0.1 port={} user={SUPERUSER} dbname=pgfence",
        proxy.addr().port()
    ))
    .await;
    let checks_done = || async {
        let stats = admin.simple_query("SHOW STATS").await.expect("SHOW STATS");
        stats
            .iter()
            .find_map(|m| match m {
                tokio_postgres::SimpleQueryMessage::Row(row)
                    if row.get(0) == Some("fence_checks") =>
                {
                    row.get(1).map(|v| v.parse::<u64>().expect("a count"))
                }
                _ => None,
            })
            .expect("fence_checks")
    };
    for n in 0..3 {
        let (client, _) = session(proxy.addr(), &format!("reader {n}"), "-c fencing.token=5").await;
        let before = checks_done().await;
        client.simple_query("SELECT 1").await.expect("reads go on");
        assert_eq!(checks_done().await, before + 1, "the read was not checked");
        client
            .batch_execute(&insert(n, "fenced"))
            .await
            .expect("a write with a token");
    }
    let (stale, _) = session(proxy.addr(), "stale", "-c fencing.token=4").await;
    let result = stale.batch_execute(&insert(9, "stale")).await;
    assert_eq!(sqlstate(&result).as_deref(), Some("FN001"), "{result:?}");
    let logs = proxy.logs();
    let warned: Vec<Event> = json_events(&logs)
        .into_iter()
        .filter(|e| level(e) == "WARN" && str_field(e, "database") == APP_DB)
        .filter(|e| message(e).contains("older than version 9"))
        .collect();
    assert_eq!(warned.len(), 1, "one WARN for the database:\n{logs}");
    assert_eq!(
        str_field(&warned[0], "sqlstate"),
        "42883",
        "{:?}",
        warned[0]
    );
    assert!(
        message(&warned[0]).contains(&format!("`pgfence install --database {APP_DB:?}`")),
        "{:?}",
        warned[0]
    );
}

#[tokio::test]
async fn broken_connections_are_logged() {
    let cluster = cluster_with_ledger().await;
    let proxy = ProxyProcess::builder()
        .config(config(&cluster))
        .args(["--config", "{config}", "--log-format", "json"])
        .env("RUST_LOG", "info")
        .start();
    let (victim, victim_addr) = session(proxy.addr(), "victim", "").await;
    let pid = backend_pid(&victim).await;
    let direct = cluster.connect(APP_DB).await;
    direct
        .execute("SELECT pg_terminate_backend($1::int)", &[&(pid as i32)])
        .await
        .expect("terminate the victim's backend");
    let from = 0;
    wait_for_log(&proxy, from, "server connection failed");

    // A Query whose length says 3: less than the length field itself.
    let mut raw = harness::wire::RawConn::login(proxy.addr(), SUPERUSER, APP_DB).0;
    raw.send(&[b'Q', 0, 0, 0, 3]);
    let _ = raw.until_closed();
    let logs = wait_for_log(&proxy, from, "broke the protocol");

    let events = json_events(&logs);
    let failed: Vec<&Event> = events
        .iter()
        .filter(|e| message(e).contains("server connection failed"))
        .collect();
    assert_eq!(failed.len(), 1, "{logs}");
    assert_eq!(level(failed[0]), "WARN");
    assert_eq!(str_field(failed[0], "client"), victim_addr.to_string());
    let broke: Vec<&Event> = events
        .iter()
        .filter(|e| message(e).contains("broke the protocol"))
        .collect();
    assert_eq!(broke.len(), 1, "{logs}");
    assert_eq!(level(broke[0]), "INFO");
    assert!(
        str_field(broke[0], "client").starts_with("127.0.0.1:"),
        "{logs}"
    );
    drop(victim);
}
