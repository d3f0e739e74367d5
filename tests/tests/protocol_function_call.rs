//! The FunctionCall message (`F`, libpq's `PQfn`, used by its large-object functions)
//! through pgfence with a fenced resource. The byte-exact replies are in the differential
//! test; this is about the fence not being bypassed by it.
//!
//! Outside a transaction block a function call is a transaction of its own that commits
//! before anything could be added to it, so pgfence checks the token first, in a
//! transaction of its own (as for statements that cannot run in a block); inside a block the
//! check at COMMIT covers it. A stale or missing token stops the call (`lo_creat`, which
//! writes) in both cases.

use harness::wire::{self, assert_error, Msg, RawConn};
use harness::{PgCluster, Proxy, APP_DB, SUPERUSER};

fn large_objects(cluster: &PgCluster) -> String {
    cluster
        .psql(APP_DB, "SELECT count(*) FROM pg_largeobject_metadata")
        .trim()
        .to_string()
}

fn exchange(conn: &mut RawConn, bytes: &[u8]) -> Vec<Msg> {
    conn.send(bytes);
    conn.until_ready()
}

#[test]
fn function_calls_are_fenced() {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let mut config = Proxy::config_for(&cluster);
    config.fence.defaults.push(pgfence_config::DefaultResource {
        database: APP_DB.into(),
        user: None,
        resource: "billing".into(),
    });
    let proxy = Proxy::start(config);
    let lo_creat: u32 = cluster
        .psql(APP_DB, "SELECT 'lo_creat(int4)'::regprocedure::oid")
        .trim()
        .parse()
        .unwrap();
    let call = wire::function_call(lo_creat, &[Some(b"-1")]);
    let (mut conn, _) = RawConn::login(proxy.addr(), SUPERUSER, APP_DB);

    // No token: FN002, nothing created, the session goes on.
    let replies = exchange(&mut conn, &call);
    assert_eq!(replies.len(), 2, "{replies:?}");
    assert_error(&replies[0], "ERROR", "FN002");
    assert_eq!(replies[1].ready_status(), Some(b'I'));
    assert_eq!(large_objects(&cluster), "0");

    // The current leader's token: the call runs and returns its result.
    exchange(&mut conn, &wire::query("SET fencing.token = 10"));
    let replies = exchange(&mut conn, &call);
    assert_eq!(
        replies.iter().map(|m| m.tag).collect::<Vec<_>>(),
        b"VZ",
        "{replies:?}"
    );
    assert_eq!(large_objects(&cluster), "1");
    let fence = cluster.psql(
        APP_DB,
        "SELECT token FROM pgfence.fences WHERE resource = 'billing'",
    );
    assert_eq!(fence.trim(), "10");

    // A deposed leader's token: FN001 outside a block ...
    exchange(&mut conn, &wire::query("SET fencing.token = 9"));
    let replies = exchange(&mut conn, &call);
    assert_error(&replies[0], "ERROR", "FN001");
    assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'I'));
    assert_eq!(large_objects(&cluster), "1");

    // Also when the call is pipelined behind a query (pgfence waits for its reply to
    // know whether a block is open).
    let mut bytes = wire::query("SELECT 1");
    bytes.extend(&call);
    conn.send(&bytes);
    let replies = conn.until_ready();
    assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'I'));
    let replies = conn.until_ready();
    assert_error(&replies[0], "ERROR", "FN001");
    assert_eq!(large_objects(&cluster), "1");

    // ... and at COMMIT inside one, which rolls the call back.
    exchange(&mut conn, &wire::query("BEGIN"));
    let replies = exchange(&mut conn, &call);
    assert_eq!(
        replies[0].tag, b'V',
        "inside a block the call runs: {replies:?}"
    );
    let replies = exchange(&mut conn, &wire::query("COMMIT"));
    assert_error(&replies[0], "ERROR", "FN001");
    assert_eq!(replies.last().and_then(|m| m.ready_status()), Some(b'I'));
    assert_eq!(large_objects(&cluster), "1");

    // The leader again, inside a block (the call pipelined behind BEGIN): committed.
    exchange(&mut conn, &wire::query("SET fencing.token = 10"));
    let mut bytes = wire::query("BEGIN");
    bytes.extend(&call);
    conn.send(&bytes);
    conn.until_ready();
    let replies = conn.until_ready();
    assert_eq!(replies[0].tag, b'V', "{replies:?}");
    let replies = exchange(&mut conn, &wire::query("COMMIT"));
    assert_eq!(
        replies[0].command_tag().as_deref(),
        Some("COMMIT"),
        "{replies:?}"
    );
    assert_eq!(large_objects(&cluster), "2");
}
