//! Prometheus metrics, served as text over HTTP at `/metrics` when `--metrics-addr` is set.
//!
//! The HTTP side is deliberately tiny (GET /metrics, anything else 404): it is scraped by
//! one Prometheus, not browsed.

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tracing::{debug, warn};

use crate::sharded::LatencyHistogram;

/// What prometheus-client's text encoder writes is OpenMetrics (`# EOF`, counter families
/// typed without their `_total` suffix), not the Prometheus 0.0.4 text format: say so, or a
/// scraper parses it with the wrong grammar.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Labels of `pgfence_fence_checks_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CheckLabels {
    pub resource: String,
    /// `accepted`, `rejected`, or `unfenced` (the transaction wrote without any resource).
    pub outcome: &'static str,
}

/// Labels of `pgfence_rejections_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RejectionLabels {
    pub resource: String,
    pub reason: &'static str,
    pub path: &'static str,
}

/// Labels of `pgfence_fence_token`: each database holds its own fences.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FenceLabels {
    pub database: String,
    pub resource: String,
}

/// Labels of `pgfence_worker_sessions`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WorkerLabel {
    /// The worker thread's number, 0 to `--threads` - 1.
    pub worker: usize,
}

/// Panics in any of pgfence's threads since it started, each a bug: process-wide, as panics
/// are, and counted by the binary's panic hook.
static PANICS: LazyLock<Counter> = LazyLock::new(Counter::default);

/// Counts a panic (`pgfence_panics_total`).
pub fn count_panic() {
    PANICS.inc();
}

/// Every metric pgfence exports.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    pub checks: Family<CheckLabels, Counter>,
    pub rejections: Family<RejectionLabels, Counter>,
    pub fence_token: Family<FenceLabels, Gauge>,
    pub client_connections: Gauge,
    pub upstream_connections: Gauge,
    pub upstream_idle: Gauge,
    pub upstream_reused: Counter,
    pub upstream_errors: Counter,
    pub read_audit_questions: Counter,
    /// Client sessions per worker thread (only with worker threads, as the binary runs).
    pub worker_sessions: Family<WorkerLabel, Gauge>,
    pub check_latency: LatencyHistogram,
    pub query_latency: LatencyHistogram,
}

impl Default for Metrics {
    fn default() -> Self {
        let mut registry = Registry::default();
        let checks = Family::<CheckLabels, Counter>::default();
        let rejections = Family::<RejectionLabels, Counter>::default();
        let fence_token = Family::<FenceLabels, Gauge>::default();
        let client_connections = Gauge::default();
        let upstream_connections = Gauge::default();
        let upstream_idle = Gauge::default();
        let upstream_reused = Counter::default();
        let upstream_errors = Counter::default();
        let read_audit_questions = Counter::default();
        let worker_sessions = Family::<WorkerLabel, Gauge>::default();
        // 50 µs .. ~1.6 s
        let check_latency = LatencyHistogram::doubling_from(Duration::from_micros(50));
        let query_latency = LatencyHistogram::doubling_from(Duration::from_micros(50));
        registry.register(
            "pgfence_fence_checks",
            "Commit-time fence checks by resource and outcome",
            checks.clone(),
        );
        registry.register(
            "pgfence_rejections",
            "Rejected transactions by resource, reason (stale, missing, invalid) and path (fast, database)",
            rejections.clone(),
        );
        registry.register(
            "pgfence_fence_token",
            "Highest token pgfence has seen accepted, per database and resource",
            fence_token.clone(),
        );
        registry.register(
            "pgfence_client_connections",
            "Client connections open now",
            client_connections.clone(),
        );
        registry.register(
            "pgfence_upstream_connections",
            "Upstream connections serving a client session now",
            upstream_connections.clone(),
        );
        registry.register(
            "pgfence_upstream_idle_connections",
            "Upstream connections kept idle for the next client ([pool])",
            upstream_idle.clone(),
        );
        registry.register(
            "pgfence_upstream_reused",
            "Client sessions that got a kept upstream connection instead of a new one",
            upstream_reused.clone(),
        );
        registry.register(
            "pgfence_upstream_errors",
            "Upstream connection failures (connect errors, broken connections)",
            upstream_errors.clone(),
        );
        registry.register(
            "pgfence_read_audit_questions",
            "Questions to the read audit (pgfence.reads_may_write): at session starts, and again once an answer is fence.read_audit_max_age old",
            read_audit_questions.clone(),
        );
        registry.register(
            "pgfence_panics",
            "Panics in pgfence's threads, each a bug: see the log's \"pgfence bug\" events",
            PANICS.clone(),
        );
        registry.register(
            "pgfence_worker_sessions",
            "Client sessions open now on each worker thread (--threads)",
            worker_sessions.clone(),
        );
        registry.register(
            "pgfence_fence_check_duration_seconds",
            "Time from sending a fence check upstream to its reply",
            check_latency.clone(),
        );
        registry.register(
            "pgfence_query_duration_seconds",
            "Time from forwarding a Query or Sync to its ReadyForQuery",
            query_latency.clone(),
        );
        Metrics {
            registry,
            checks,
            rejections,
            fence_token,
            client_connections,
            upstream_connections,
            upstream_idle,
            upstream_reused,
            upstream_errors,
            read_audit_questions,
            worker_sessions,
            check_latency,
            query_latency,
        }
    }
}

impl Metrics {
    /// The exposition text.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = encode(&mut out, &self.registry);
        out
    }
}

/// Serves `/metrics` on `listener` until the task is dropped.
pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>) {
    loop {
        match listener.accept().await {
            Ok((stream, peer)) => {
                let metrics = metrics.clone();
                tokio::spawn(async move {
                    if let Err(e) = answer(stream, &metrics).await {
                        debug!(%peer, error = %e, "metrics request failed");
                    }
                });
            }
            Err(e) => {
                warn!(error = %e, "metrics accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn answer(mut stream: TcpStream, metrics: &Metrics) -> std::io::Result<()> {
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    let read = async {
        loop {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            head.extend_from_slice(&buf[..n]);
            if head.windows(4).any(|w| w == b"\r\n\r\n") || head.len() > 8192 {
                break;
            }
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(5), read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "request head timeout"))??;
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (
        parts.next().unwrap_or_default(),
        parts.next().unwrap_or_default(),
    );
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    let response = if method == b"GET" && path == b"/metrics" {
        let body = metrics.render();
        format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    } else {
        let body = "not found: metrics are at /metrics\n";
        format!(
            "HTTP/1.1 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        )
    };
    // A scraper that does not read gets 10 s, as its request did 5: a hundred of them once
    // held a gigabyte of rendered pages open.
    let write = async {
        stream.write_all(response.as_bytes()).await?;
        stream.shutdown().await
    };
    tokio::time::timeout(Duration::from_secs(10), write)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "response timeout"))?
}
