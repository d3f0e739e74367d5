//! The stale writer: one client whose token is below the fence loops writes through
//! pgfence. Reports rejections per second and their latency, on the fast path (pgfence
//! already knows the fence and rejects without running the write) and on the database
//! path (`fast_path = false`: the write runs and the commit-time check rolls it back),
//! next to accepted writes directly and through pgfence for scale. Then pgfence's memory
//! with idle sessions.

use std::time::{Duration, Instant};

use serde::Serialize;
use tokio_postgres::Client;

use crate::db::Db;
use crate::error::{Error, Result};
use crate::proc::{self, Daemon, HOST};
use crate::stack::Stack;
use crate::stats;

/// The resource of the stale-writer scenario (not the benchmark's, so the two never meet).
pub const STALE_RESOURCE: &str = "bench-stale";
/// The table the writes go to, created and dropped by the runner.
const TABLE_SQL: &str = "CREATE TABLE IF NOT EXISTS pgfence_bench_stale \
     (id int PRIMARY KEY, n bigint NOT NULL DEFAULT 0); \
     INSERT INTO pgfence_bench_stale VALUES (1, 0) ON CONFLICT DO NOTHING";
/// Dropped at the end (it matters with `--upstream`).
pub const DROP_SQL: &str = "DROP TABLE IF EXISTS pgfence_bench_stale";
const WRITE_SQL: &str = "UPDATE pgfence_bench_stale SET n = n + 1 WHERE id = 1";
/// The SQLSTATE of a stale token.
const STALE_SQLSTATE: &str = "FN001";

/// Tokens of the scenario: `current` is the fence, `stale` is below it.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Tokens {
    pub current: i64,
    pub stale: i64,
}

/// Which writer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Scenario {
    /// Accepted writes, PostgreSQL directly.
    DirectWrite,
    /// Accepted writes (current token) through fenced pgfence.
    FencedWrite,
    /// Stale token, pgfence with the fast path (the default).
    StaleFast,
    /// Stale token, pgfence with `fast_path = false`.
    StaleDatabase,
}

impl Scenario {
    const ALL: [Scenario; 4] = [
        Scenario::DirectWrite,
        Scenario::FencedWrite,
        Scenario::StaleFast,
        Scenario::StaleDatabase,
    ];

    fn label(self) -> &'static str {
        match self {
            Scenario::DirectWrite => "accepted write, direct",
            Scenario::FencedWrite => "accepted write, pgfence (current token)",
            Scenario::StaleFast => "stale write, pgfence fast path (default)",
            Scenario::StaleDatabase => "stale write, pgfence fast_path = false",
        }
    }

    fn rejects(self) -> bool {
        matches!(self, Scenario::StaleFast | Scenario::StaleDatabase)
    }
}

/// Simple or extended protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Protocol {
    /// A Query message per write.
    Simple,
    /// Prepared once, then Bind/Execute/Sync per write.
    Prepared,
}

impl Protocol {
    fn key(self) -> &'static str {
        match self {
            Protocol::Simple => "simple",
            Protocol::Prepared => "prepared",
        }
    }
}

/// One line of the stale-writer table.
#[derive(Debug, Clone, Serialize)]
pub struct StaleRow {
    pub scenario: &'static str,
    pub protocol: &'static str,
    /// `rejected (FN001)` or `committed`: what every write should get.
    pub expected: &'static str,
    /// Median over rounds of writes (or rejections) per second.
    pub per_sec: f64,
    /// Over every write of every round, in ms.
    pub mean_ms: f64,
    pub p99_ms: f64,
    pub writes: u64,
    /// Writes that did not get the expected outcome.
    pub unexpected: u64,
    pub first_unexpected: Option<String>,
}

/// Where each scenario connects.
struct Endpoints {
    direct: (String, u16),
    fenced: u16,
    database_path: u16,
}

/// Runs the scenario: `rounds` rounds of `secs` seconds per scenario and protocol.
pub fn run(
    stack: &Stack,
    db: &Db,
    tokens: Tokens,
    secs: u32,
    rounds: u32,
) -> Result<Vec<StaleRow>> {
    let fenced = stack.fenced.as_ref().ok_or(Error::Usage(
        "the stale writer needs the fenced pgfence".to_string(),
    ))?;
    db.execute(&stack.pg_host, stack.pg_port, TABLE_SQL)?;
    let slow = stack.start_pgfence(
        "pgfence-no-fast-path",
        true,
        Some("[fence]\nfast_path = false\n"),
    )?;
    let ends = Endpoints {
        direct: (stack.pg_host.clone(), stack.pg_port),
        fenced: fenced.port(),
        database_path: slow.port(),
    };
    // Advance the fence through the fast-path pgfence, so that it knows the fence.
    db.block_on(async {
        let c = db
            .connect(HOST, ends.fenced, Some(&options(tokens.current)))
            .await?;
        c.simple_query(WRITE_SQL)
            .await
            .map_err(Error::pg("advancing the fence of resource bench-stale"))
    })?;

    let protocols = [Protocol::Simple, Protocol::Prepared];
    let mut samples: Vec<Vec<u32>> = vec![Vec::new(); Scenario::ALL.len() * 2];
    let mut rates: Vec<Vec<f64>> = vec![Vec::new(); Scenario::ALL.len() * 2];
    let mut unexpected: Vec<(u64, Option<String>)> = vec![(0, None); Scenario::ALL.len() * 2];
    for round in 1..=rounds {
        for (si, &scenario) in Scenario::ALL.iter().enumerate() {
            for (pi, &protocol) in protocols.iter().enumerate() {
                let i = si * 2 + pi;
                let out = db.block_on(writer(db, &ends, tokens, scenario, protocol, secs))?;
                eprintln!(
                    "[stale writer, round {round}/{rounds}] {} ({}): {:.0}/s, mean {:.3} ms{}",
                    scenario.label(),
                    protocol.key(),
                    out.per_sec,
                    stats::mean_us(&out.latencies_us) / 1000.0,
                    if out.unexpected > 0 {
                        format!(", {} unexpected outcomes", out.unexpected)
                    } else {
                        String::new()
                    }
                );
                samples[i].extend(out.latencies_us);
                rates[i].push(out.per_sec);
                unexpected[i].0 += out.unexpected;
                if unexpected[i].1.is_none() {
                    unexpected[i].1 = out.first_unexpected;
                }
            }
        }
    }
    drop(slow);
    db.execute(&stack.pg_host, stack.pg_port, DROP_SQL)?;

    let mut rows = Vec::new();
    for (si, &scenario) in Scenario::ALL.iter().enumerate() {
        for (pi, &protocol) in protocols.iter().enumerate() {
            let i = si * 2 + pi;
            let lat = &mut samples[i];
            rows.push(StaleRow {
                scenario: scenario.label(),
                protocol: protocol.key(),
                expected: if scenario.rejects() {
                    "rejected (FN001)"
                } else {
                    "committed"
                },
                per_sec: stats::median(&rates[i]).unwrap_or(0.0),
                mean_ms: stats::mean_us(lat) / 1000.0,
                p99_ms: stats::percentile_us(lat, 0.99) / 1000.0,
                writes: lat.len() as u64,
                unexpected: unexpected[i].0,
                first_unexpected: unexpected[i].1.take(),
            });
        }
    }
    Ok(rows)
}

/// The startup options carrying `token` for the scenario's resource.
fn options(token: i64) -> String {
    format!("-c fencing.resource={STALE_RESOURCE} -c fencing.token={token}")
}

/// What one writer measured.
struct Measured {
    per_sec: f64,
    latencies_us: Vec<u32>,
    unexpected: u64,
    first_unexpected: Option<String>,
}

async fn writer(
    db: &Db,
    ends: &Endpoints,
    tokens: Tokens,
    scenario: Scenario,
    protocol: Protocol,
    secs: u32,
) -> Result<Measured> {
    let client = match scenario {
        Scenario::DirectWrite => db.connect(&ends.direct.0, ends.direct.1, None).await?,
        Scenario::FencedWrite => {
            db.connect(HOST, ends.fenced, Some(&options(tokens.current)))
                .await?
        }
        Scenario::StaleFast => {
            db.connect(HOST, ends.fenced, Some(&options(tokens.stale)))
                .await?
        }
        Scenario::StaleDatabase => {
            db.connect(HOST, ends.database_path, Some(&options(tokens.stale)))
                .await?
        }
    };
    let statement = match protocol {
        Protocol::Prepared => Some(
            client
                .prepare(WRITE_SQL)
                .await
                .map_err(Error::pg("preparing the stale writer's UPDATE"))?,
        ),
        Protocol::Simple => None,
    };
    let mut m = Measured {
        per_sec: 0.0,
        latencies_us: Vec::new(),
        unexpected: 0,
        first_unexpected: None,
    };
    let started = Instant::now();
    let end = started + Duration::from_secs(u64::from(secs));
    while Instant::now() < end {
        proc::check_interrupted()?;
        let t = Instant::now();
        let outcome = write(&client, statement.as_ref()).await;
        m.latencies_us
            .push(t.elapsed().as_micros().min(u128::from(u32::MAX)) as u32);
        let wrong = match (&outcome, scenario.rejects()) {
            (Ok(()), false) => None,
            (Err(e), true) if e.code().map(|c| c.code()) == Some(STALE_SQLSTATE) => None,
            (Ok(()), true) => Some("committed, expected FN001".to_string()),
            (Err(e), _) => Some(e.to_string()),
        };
        if let Some(w) = wrong {
            m.unexpected += 1;
            m.first_unexpected.get_or_insert(w);
            if client.is_closed() {
                break;
            }
        }
    }
    m.per_sec = m.latencies_us.len() as f64 / started.elapsed().as_secs_f64();
    Ok(m)
}

async fn write(
    client: &Client,
    statement: Option<&tokio_postgres::Statement>,
) -> std::result::Result<(), tokio_postgres::Error> {
    match statement {
        Some(s) => client.execute(s, &[]).await.map(|_| ()),
        None => client.simple_query(WRITE_SQL).await.map(|_| ()),
    }
}

/// pgfence's resident memory with idle sessions.
#[derive(Debug, Clone, Serialize)]
pub struct Memory {
    pub sessions: u32,
    /// RSS with one session open, KiB.
    pub rss_before_kib: u64,
    /// RSS with `sessions` more open and idle, KiB.
    pub rss_after_kib: u64,
    pub per_session_kib: f64,
}

/// Starts a fresh fenced pgfence, opens `sessions` idle sessions (session token, one
/// `SELECT 1` each) and reads its RSS before and after.
pub fn idle_memory(stack: &Stack, db: &Db, token: i64, sessions: u32) -> Result<Memory> {
    let daemon = stack.start_pgfence("pgfence-idle", true, None)?;
    let opts = format!("-c fencing.resource={STALE_RESOURCE} -c fencing.token={token}");
    db.block_on(async {
        let first = db.connect(HOST, daemon.port(), Some(&opts)).await?;
        first
            .simple_query("SELECT 1")
            .await
            .map_err(Error::pg("SELECT 1 through pgfence"))?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let before = rss_kib(&daemon)?;
        let mut clients = Vec::with_capacity(sessions as usize);
        for i in 0..sessions {
            proc::check_interrupted()?;
            let c = db.connect(HOST, daemon.port(), Some(&opts)).await?;
            c.simple_query("SELECT 1")
                .await
                .map_err(Error::pg(format!("SELECT 1 on idle session {i}")))?;
            clients.push(c);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let after = rss_kib(&daemon)?;
        drop(clients);
        drop(first);
        Ok(Memory {
            sessions,
            rss_before_kib: before,
            rss_after_kib: after,
            per_session_kib: after.saturating_sub(before) as f64 / f64::from(sessions.max(1)),
        })
    })
}

/// VmRSS of `daemon`, KiB.
fn rss_kib(daemon: &Daemon) -> Result<u64> {
    let path = format!("/proc/{}/status", daemon.pid());
    let status = std::fs::read_to_string(&path).map_err(Error::io("read", &path))?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .ok_or(Error::Parse {
            what: "resident memory",
            detail: format!("no VmRSS line in {path}"),
        })
}
