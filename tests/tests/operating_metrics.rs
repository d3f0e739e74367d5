//! Prometheus metrics of the real `pgfence` binary (`--metrics-addr`, SPEC section 7),
//! scraped over HTTP and parsed before and after known traffic.
//!
//! - [`counters_move_by_what_happened`]: fence checks by resource and outcome, rejections by
//!   resource, reason and path, the highest token per resource, the client and upstream
//!   connection gauges while a session is open, the latency histograms' counts; every
//!   sample belongs to a typed family and the text is OpenMetrics with its content type.
//! - [`upstream_errors_are_counted`]: a session pointed at a dead upstream, and one whose
//!   server connection is terminated, each count one upstream error.
//! - [`other_paths_are_not_found`]: only `GET /metrics` answers 200.
//! - [`sessions_go_to_the_worker_with_the_fewest`]: with `--threads 2`, a session opened
//!   after a short one closed goes to the short one's worker, and the per-worker gauges
//!   count what is open.

use std::net::SocketAddr;

use harness::fence::{self, assert_rejected, sqlstate};
use harness::operating::{eventually, http, scrape, Exposition};
use harness::{free_port, quote_conn_value, PgCluster, Proxy, ProxyProcess, APP_DB, SUPERUSER};
use pgfence_config::{Config, DefaultResource};
use tokio_postgres::Client;

const CHECKS: &str = "pgfence_fence_checks_total";
const REJECTIONS: &str = "pgfence_rejections_total";
const TOKEN: &str = "pgfence_fence_token";
const CLIENTS: &str = "pgfence_client_connections";
const UPSTREAMS: &str = "pgfence_upstream_connections";
const UPSTREAMS_IDLE: &str = "pgfence_upstream_idle_connections";
const UPSTREAM_ERRORS: &str = "pgfence_upstream_errors_total";
const CHECK_LATENCY: &str = "pgfence_fence_check_duration_seconds";
const QUERY_LATENCY: &str = "pgfence_query_duration_seconds";
const WORKER_SESSIONS: &str = "pgfence_worker_sessions";
/// What pgfence's text is, and says it is.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn metrics_addr() -> SocketAddr {
    SocketAddr::from(([127, 0, 0, 1], free_port()))
}

/// A cluster with schema `pgfence` in `app` (table `ledger`) and in `postgres`.
async fn cluster() -> PgCluster {
    let cluster = PgCluster::start();
    let app = cluster.connect(APP_DB).await;
    fence::install(&app).await;
    app.batch_execute("CREATE TABLE ledger (id int)")
        .await
        .expect("create table ledger");
    fence::install(&cluster.connect("postgres").await).await;
    cluster
}

/// Sessions of `app` are fenced on `billing` unless they name another resource; sessions of
/// `postgres` are not fenced.
fn config(cluster: &PgCluster) -> Config {
    let mut config = Proxy::config_for(cluster);
    config.fence.defaults = vec![DefaultResource {
        database: APP_DB.into(),
        user: None,
        resource: "billing".into(),
    }];
    config
}

async fn session(port: u16, db: &str, options: &str) -> Client {
    let mut connstr = format!("host=127.0.0.1 port={port} user={SUPERUSER} dbname={db}");
    if !options.is_empty() {
        connstr.push_str(&format!(" options={}", quote_conn_value(options)));
    }
    harness::connect_to(&connstr).await
}

/// `value(name, labels)` in `after` minus in `before`.
fn delta(before: &Exposition, after: &Exposition, name: &str, labels: &[(&str, &str)]) -> f64 {
    after.value(name, labels) - before.value(name, labels)
}

/// Buckets are cumulative and end with `+Inf` = `_count`; the sum is positive once counted.
fn assert_histogram(e: &Exposition, name: &str) {
    let mut buckets: Vec<(f64, f64)> = e
        .series(&format!("{name}_bucket"))
        .into_iter()
        .map(|(labels, v)| {
            let le = &labels["le"];
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().expect("numeric le")
            };
            (le, v)
        })
        .collect();
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    assert!(buckets.len() > 2, "{name}: buckets {buckets:?}");
    assert!(
        buckets.windows(2).all(|w| w[0].1 <= w[1].1),
        "{name}: buckets not cumulative: {buckets:?}"
    );
    let count = e.must(&format!("{name}_count"), &[]);
    assert_eq!(
        buckets.last().map(|b| (b.0, b.1)),
        Some((f64::INFINITY, count))
    );
    if count > 0.0 {
        assert!(e.must(&format!("{name}_sum"), &[]) > 0.0, "{name}_sum");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn counters_move_by_what_happened() {
    let cluster = cluster().await;
    let config = config(&cluster);
    let metrics = metrics_addr();
    let proxy = ProxyProcess::builder()
        .config(config.clone())
        .args([
            "--config",
            "{config}",
            "--metrics-addr",
            &metrics.to_string(),
        ])
        .start();
    let other = Proxy::start(config);

    let response = http(metrics, "GET /metrics HTTP/1.1");
    assert_eq!(response.status, 200, "{response:?}");
    assert_eq!(response.header("content-type"), Some(OPENMETRICS));
    let before = Exposition::parse(&response.body);
    assert!(
        before.eof,
        "OpenMetrics text ends with # EOF:\n{}",
        before.text
    );
    for (family, kind) in [
        ("pgfence_fence_checks", "counter"),
        ("pgfence_rejections", "counter"),
        (TOKEN, "gauge"),
        (CLIENTS, "gauge"),
        (UPSTREAMS, "gauge"),
        (UPSTREAMS_IDLE, "gauge"),
        ("pgfence_upstream_reused", "counter"),
        ("pgfence_upstream_errors", "counter"),
        ("pgfence_read_audit_questions", "counter"),
        (CHECK_LATENCY, "histogram"),
        (QUERY_LATENCY, "histogram"),
    ] {
        assert_eq!(
            before.types.get(family).map(String::as_str),
            Some(kind),
            "# TYPE of {family}:\n{}",
            before.text
        );
        assert!(before.help.contains_key(family), "# HELP of {family}");
    }
    assert_eq!(before.must(UPSTREAM_ERRORS, &[]), 0.0);
    // The harness's readiness probe (a TCP connection) may still be counted for a moment.
    let before = eventually(
        "no client connections before the test starts",
        || {
            let e = scrape(metrics);
            (e.must(CLIENTS, &[]) == 0.0 && e.must(UPSTREAMS, &[]) == 0.0).then_some(e)
        },
        || scrape(metrics).text,
    );
    assert!(before.series(TOKEN).is_empty(), "no fence known yet");

    // One open session: one client and one upstream connection.
    let a = session(
        proxy.port(),
        APP_DB,
        "-c fencing.token=5 -c fencing.resource=billing",
    )
    .await;
    let open = scrape(metrics);
    assert_eq!(open.must(CLIENTS, &[]), 1.0, "{}", open.text);
    assert_eq!(open.must(UPSTREAMS, &[]), 1.0, "{}", open.text);

    // A read-only query is not checked.
    a.simple_query("SELECT 1").await.expect("SELECT 1");
    let read = scrape(metrics);
    assert_eq!(read.series(CHECKS), before.series(CHECKS), "{}", read.text);
    assert_eq!(
        delta(&open, &read, &format!("{QUERY_LATENCY}_count"), &[]),
        1.0
    );

    // Accepted: billing is at 5.
    a.batch_execute("INSERT INTO ledger VALUES (1)")
        .await
        .expect("token 5 is accepted");
    let accepted = scrape(metrics);
    let billing_accepted = [("resource", "billing"), ("outcome", "accepted")];
    let billing_rejected = [("resource", "billing"), ("outcome", "rejected")];
    assert_eq!(delta(&read, &accepted, CHECKS, &billing_accepted), 1.0);
    assert_eq!(delta(&read, &accepted, CHECKS, &billing_rejected), 0.0);
    assert_eq!(
        accepted.must(TOKEN, &[("database", APP_DB), ("resource", "billing")]),
        5.0
    );
    assert_eq!(
        delta(&read, &accepted, &format!("{CHECK_LATENCY}_count"), &[]),
        1.0
    );

    // The leader writes 7 through the other pgfence; then two stale writes (database path,
    // then fast path), one for the default resource (database path: the server may name
    // another resource, see `FenceSettings::new`), a missing token, an invalid token, and an
    // unfenced write.
    session(
        other.port(),
        APP_DB,
        "-c fencing.token=7 -c fencing.resource=billing",
    )
    .await
    .batch_execute("INSERT INTO ledger VALUES (100)")
    .await
    .expect("token 7 is accepted");
    for path in ["database", "fast"] {
        assert_rejected(
            &a.batch_execute("INSERT INTO ledger VALUES (2)").await,
            &fence::stale("billing", 5, 7),
            path,
        );
    }
    // A token for the default resource: checked by the database.
    let d = session(proxy.port(), APP_DB, "-c fencing.token=6").await;
    assert_rejected(
        &d.batch_execute("INSERT INTO ledger VALUES (2)").await,
        &fence::stale("billing", 6, 7),
        "default resource",
    );
    let m = session(proxy.port(), APP_DB, "").await;
    assert_rejected(
        &m.batch_execute("INSERT INTO ledger VALUES (3)").await,
        &fence::missing("billing"),
        "missing",
    );
    assert_eq!(
        sqlstate(
            &m.batch_execute("/* fencing_token=x1 */ INSERT INTO ledger VALUES (4)")
                .await
        )
        .as_deref(),
        Some("FN003"),
        "invalid"
    );
    // Resource names that are not valid are the client's text: one label for all of them.
    for bad in ["bad/res1", "bad/res2"] {
        assert_eq!(
            sqlstate(
                &m.batch_execute(&format!(
                    "/* fencing_token=4 fencing_resource={bad} */ INSERT INTO ledger VALUES (4)"
                ))
                .await
            )
            .as_deref(),
            Some("FN003"),
            "invalid resource {bad}"
        );
    }
    let unfenced = session(proxy.port(), "postgres", "").await;
    unfenced
        .batch_execute("CREATE TEMP TABLE scratch (id int); INSERT INTO scratch VALUES (1)")
        .await
        .expect("an unfenced write commits");
    // A new leader's token through this proxy raises the gauge to 10.
    let b = session(
        proxy.port(),
        APP_DB,
        "-c fencing.token=10 -c fencing.resource=billing",
    )
    .await;
    b.batch_execute("INSERT INTO ledger VALUES (5)")
        .await
        .expect("token 10 is accepted");

    let after = scrape(metrics);
    let rejections = |reason: &str, path: &str| {
        delta(
            &accepted,
            &after,
            REJECTIONS,
            &[("resource", "billing"), ("reason", reason), ("path", path)],
        )
    };
    assert_eq!(rejections("stale", "database"), 2.0, "{}", after.text);
    assert_eq!(rejections("stale", "fast"), 1.0, "{}", after.text);
    assert_eq!(rejections("missing", "database"), 1.0, "{}", after.text);
    assert_eq!(rejections("invalid", "database"), 1.0, "{}", after.text);
    assert_eq!(
        delta(
            &accepted,
            &after,
            REJECTIONS,
            &[
                ("resource", "(invalid)"),
                ("reason", "invalid"),
                ("path", "database")
            ]
        ),
        2.0,
        "{}",
        after.text
    );
    assert!(!after.text.contains("bad/res"), "{}", after.text);
    let all_rejections: f64 = after.series(REJECTIONS).iter().map(|(_, v)| v).sum();
    assert_eq!(all_rejections, 7.0, "{}", after.text);
    assert_eq!(delta(&accepted, &after, CHECKS, &billing_rejected), 5.0);
    assert_eq!(delta(&accepted, &after, CHECKS, &billing_accepted), 1.0);
    assert_eq!(
        delta(
            &accepted,
            &after,
            CHECKS,
            &[("resource", ""), ("outcome", "unfenced")]
        ),
        1.0,
        "{}",
        after.text
    );
    assert_eq!(
        after.must(TOKEN, &[("database", APP_DB), ("resource", "billing")]),
        10.0
    );
    // Every check that went to the database was timed: two stale, missing, three invalid,
    // unfenced, accepted (the fast path asks nothing).
    assert_eq!(
        delta(&accepted, &after, &format!("{CHECK_LATENCY}_count"), &[]),
        8.0,
        "{}",
        after.text
    );
    // Every client Query answered by the server was timed: the seven writes above that went
    // to the database and the token-10 write. The fast path answers by itself when the
    // session is idle, or, when the client sent its write before the server's ReadyForQuery
    // of the previous one reached pgfence, makes the server fail it (one more).
    let queries = delta(&accepted, &after, &format!("{QUERY_LATENCY}_count"), &[]);
    assert!(
        queries == 8.0 || queries == 9.0,
        "{queries}: {}",
        after.text
    );
    assert_histogram(&after, CHECK_LATENCY);
    assert_histogram(&after, QUERY_LATENCY);
    assert_eq!(
        after.must(CLIENTS, &[]),
        5.0,
        "a, d, m, unfenced, b:\n{}",
        after.text
    );
    assert_eq!(after.must(UPSTREAMS, &[]), 5.0, "{}", after.text);
    assert_eq!(after.must(UPSTREAM_ERRORS, &[]), 0.0);

    // Sessions closed: the gauges go back to 0, their idle server connections are kept.
    assert_eq!(after.must(UPSTREAMS_IDLE, &[]), 0.0, "{}", after.text);
    drop((a, d, m, unfenced, b));
    eventually(
        "the connection gauges back to 0, five idle upstream connections",
        || {
            let e = scrape(metrics);
            (e.must(CLIENTS, &[]) == 0.0
                && e.must(UPSTREAMS, &[]) == 0.0
                && e.must(UPSTREAMS_IDLE, &[]) == 5.0)
                .then_some(())
        },
        || scrape(metrics).text,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_errors_are_counted() {
    // Nothing listens at the upstream port of this one.
    let dead_metrics = metrics_addr();
    let dead_upstream = format!("127.0.0.1:{}", free_port());
    let dead = ProxyProcess::start(&[
        "--upstream",
        &dead_upstream,
        "--metrics-addr",
        &dead_metrics.to_string(),
    ]);
    let err = match harness::try_connect_to(&dead.connstr(APP_DB)).await {
        Ok(_) => panic!("connected through a proxy whose upstream is down"),
        Err(e) => e,
    };
    assert_eq!(
        err.as_db_error().map(|e| e.code().code()),
        Some("08006"),
        "{err:?}"
    );
    let e = scrape(dead_metrics);
    assert_eq!(e.must(UPSTREAM_ERRORS, &[]), 1.0, "{}", e.text);
    assert_eq!(e.must(UPSTREAMS, &[]), 0.0, "{}", e.text);

    // A server connection terminated under a session.
    let cluster = PgCluster::start();
    let metrics = metrics_addr();
    let proxy = ProxyProcess::for_cluster(&cluster, &["--metrics-addr", &metrics.to_string()]);
    let victim = proxy.connect(APP_DB).await;
    let pid: i32 = victim
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .expect("pg_backend_pid")
        .get(0);
    assert_eq!(scrape(metrics).must(UPSTREAM_ERRORS, &[]), 0.0);
    cluster
        .connect("postgres")
        .await
        .execute("SELECT pg_terminate_backend($1)", &[&pid])
        .await
        .expect("terminate the session's server");
    eventually(
        "one upstream error after the server connection was terminated",
        || {
            let e = scrape(metrics);
            (e.must(UPSTREAM_ERRORS, &[]) == 1.0
                && e.must(UPSTREAMS, &[]) == 0.0
                && e.must(CLIENTS, &[]) == 0.0)
                .then_some(())
        },
        || scrape(metrics).text,
    );
    assert!(victim.simple_query("SELECT 1").await.is_err());
}

#[test]
fn other_paths_are_not_found() {
    let metrics = metrics_addr();
    let upstream = format!("127.0.0.1:{}", free_port());
    let _proxy = ProxyProcess::start(&[
        "--upstream",
        &upstream,
        "--metrics-addr",
        &metrics.to_string(),
    ]);
    for request in [
        "GET / HTTP/1.1",
        "GET /metric HTTP/1.1",
        "GET /metrics/x HTTP/1.1",
        "POST /metrics HTTP/1.1",
    ] {
        let r = http(metrics, request);
        assert_eq!(r.status, 404, "{request}: {r:?}");
        assert!(r.body.contains("/metrics"), "{request}: says where: {r:?}");
    }
    let r = http(metrics, "GET /metrics?name[]=x HTTP/1.1");
    assert_eq!(r.status, 200, "a query string is ignored: {r:?}");
    Exposition::parse(&r.body);
}

/// `pgfence_worker_sessions{worker}` of `e`, for workers 0 and 1.
fn per_worker(e: &Exposition) -> [f64; 2] {
    [
        e.must(WORKER_SESSIONS, &[("worker", "0")]),
        e.must(WORKER_SESSIONS, &[("worker", "1")]),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_go_to_the_worker_with_the_fewest() {
    let cluster = PgCluster::start();
    let metrics = metrics_addr();
    let proxy = ProxyProcess::for_cluster(
        &cluster,
        &["--threads", "2", "--metrics-addr", &metrics.to_string()],
    );
    // The harness's readiness probe (a TCP connection) may still be open for a moment.
    eventually(
        "no sessions on either worker before the test starts",
        || (per_worker(&scrape(metrics)) == [0.0, 0.0]).then_some(()),
        || scrape(metrics).text,
    );
    assert_eq!(
        scrape(metrics)
            .types
            .get(WORKER_SESSIONS)
            .map(String::as_str),
        Some("gauge")
    );

    // A long-lived session, a short one beside it, then another long-lived one: dealt
    // out round-robin, the two long-lived sessions would share a thread.
    let long = proxy.connect(APP_DB).await;
    let short = proxy.connect(APP_DB).await;
    let e = scrape(metrics);
    assert_eq!(per_worker(&e), [1.0, 1.0], "{}", e.text);
    drop(short);
    eventually(
        "the short session closed",
        || (scrape(metrics).must(CLIENTS, &[]) == 1.0).then_some(()),
        || scrape(metrics).text,
    );
    let other = proxy.connect(APP_DB).await;
    let e = scrape(metrics);
    assert_eq!(per_worker(&e), [1.0, 1.0], "{}", e.text);
    for client in [&long, &other] {
        client.simple_query("SELECT 1").await.expect("SELECT 1");
    }

    drop((long, other));
    eventually(
        "no sessions left on either worker",
        || (per_worker(&scrape(metrics)) == [0.0, 0.0]).then_some(()),
        || scrape(metrics).text,
    );
}
