//! pgbench: its scripts, one timed run, and reading what it printed and logged.
//!
//! Every configuration runs the same custom scripts, copies of pgbench's built-in
//! `select-only` and `tpcb-like`; the sqlcommenter configuration runs copies that carry the
//! token in a comment on every statement. Latency percentiles come from pgbench's
//! per-transaction logs (`-l`), throughput from its summary.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Serialize;

use crate::error::{Error, Result};
use crate::plan::{Cell, Workload};
use crate::proc;
use crate::stats;

/// pgbench's built-in `select-only`.
const SELECT_ONLY: &[&str] = &["SELECT abalance FROM pgbench_accounts WHERE aid = :aid"];
/// pgbench's built-in `tpcb-like`.
const TPCB_LIKE: &[&str] = &[
    "BEGIN",
    "UPDATE pgbench_accounts SET abalance = abalance + :delta WHERE aid = :aid",
    "SELECT abalance FROM pgbench_accounts WHERE aid = :aid",
    "UPDATE pgbench_tellers SET tbalance = tbalance + :delta WHERE tid = :tid",
    "UPDATE pgbench_branches SET bbalance = bbalance + :delta WHERE bid = :bid",
    "INSERT INTO pgbench_history (tid, bid, aid, delta, mtime) \
     VALUES (:tid, :bid, :aid, :delta, CURRENT_TIMESTAMP)",
    "END",
];

/// The `\set` lines of each script (as in pgbench's built-ins).
fn variables(workload: Workload) -> &'static str {
    match workload {
        Workload::SelectOnly => "\\set aid random(1, 100000 * :scale)\n",
        Workload::TpcbLike => {
            "\\set aid random(1, 100000 * :scale)\n\
             \\set bid random(1, 1 * :scale)\n\
             \\set tid random(1, 10 * :scale)\n\
             \\set delta random(-5000, 5000)\n"
        }
    }
}

/// The script text; with `comment`, appended to every statement (sqlcommenter style: at
/// the end, before the semicolon).
pub fn script(workload: Workload, comment: Option<&str>) -> String {
    let statements = match workload {
        Workload::SelectOnly => SELECT_ONLY,
        Workload::TpcbLike => TPCB_LIKE,
    };
    let mut out = String::from(variables(workload));
    for s in statements {
        out.push_str(s);
        if let Some(c) = comment {
            out.push(' ');
            out.push_str(c);
        }
        out.push_str(";\n");
    }
    out
}

/// The sqlcommenter comment carrying `token` for `resource`.
pub fn sqlcommenter(resource: &str, token: i64) -> String {
    format!("/*fencing_resource='{resource}',fencing_token='{token}'*/")
}

/// The script files of a run, written once.
#[derive(Debug, Clone)]
pub struct Scripts {
    dir: PathBuf,
}

impl Scripts {
    /// Writes plain and commented scripts for every workload into `dir`.
    pub fn write(dir: &Path, resource: &str, token: i64) -> Result<Scripts> {
        fs::create_dir_all(dir).map_err(Error::io("create", dir))?;
        let comment = sqlcommenter(resource, token);
        for w in [Workload::SelectOnly, Workload::TpcbLike] {
            for (commented, text) in [(false, script(w, None)), (true, script(w, Some(&comment)))] {
                let path = Scripts::path_in(dir, w, commented);
                fs::write(&path, text).map_err(Error::io("write", &path))?;
            }
        }
        Ok(Scripts {
            dir: dir.to_path_buf(),
        })
    }

    /// The file of `workload`, with or without the token comment.
    pub fn path(&self, workload: Workload, commented: bool) -> PathBuf {
        Scripts::path_in(&self.dir, workload, commented)
    }

    fn path_in(dir: &Path, workload: Workload, commented: bool) -> PathBuf {
        let suffix = if commented { "-sqlcommenter" } else { "" };
        dir.join(format!("{}{suffix}.sql", workload.key()))
    }
}

/// Where pgbench connects, and how.
#[derive(Debug, Clone)]
pub struct Target {
    pub host: String,
    pub port: u16,
    /// `PGOPTIONS` (the startup packet's `options`), for the session token.
    pub pgoptions: Option<String>,
    /// Run the commented scripts.
    pub commented: bool,
}

/// Everything a run needs besides the target.
#[derive(Debug, Clone)]
pub struct Bench {
    pub pgbench: PathBuf,
    pub user: String,
    pub database: String,
    pub scale: u32,
    pub max_jobs: u32,
    pub scripts: Scripts,
    /// A scratch directory for per-transaction logs.
    pub log_dir: PathBuf,
}

/// What one pgbench run measured.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    /// Transactions per second, without connection time (pgbench's `tps =`).
    pub tps: f64,
    pub transactions: u64,
    pub failed: u64,
    /// Mean, median and 99th percentile latency of the logged transactions, in ms.
    pub mean_ms: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// CPU time of the whole machine per transaction, in µs (see [`crate::cpu`]).
    pub cpu_us: Option<f64>,
    /// CPU time of the proxy per transaction, in µs (`None` for PostgreSQL directly).
    pub proxy_cpu_us: Option<f64>,
    /// CPU time of the PostgreSQL server per transaction, in µs (`None` with `--upstream`).
    pub server_cpu_us: Option<f64>,
    /// Which round of the interleaved measurement this run belongs to (1-based; 0 outside
    /// one): runs of one round ran back to back, so they pair up for ratios.
    pub round: u32,
}

impl Bench {
    /// Runs `cell` against `target` for `secs` seconds.
    pub fn run(&self, target: &Target, cell: Cell, secs: u32, name: &str) -> Result<Run> {
        let dir = self.log_dir.join(name);
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).map_err(Error::io("create", &dir))?;
        let prefix = dir.join("tx");
        let jobs = cell.clients.min(self.max_jobs);
        let mut cmd = proc::command(&self.pgbench, None);
        cmd.args(["-n", "-h", &target.host])
            .args(["-p", &target.port.to_string()])
            .args(["-U", &self.user])
            .args(["-c", &cell.clients.to_string()])
            .args(["-j", &jobs.to_string()])
            .args(["-T", &secs.to_string()])
            .args(["-M", cell.mode.key()])
            .args(["-s", &self.scale.to_string()])
            .arg("-f")
            .arg(self.scripts.path(cell.workload, target.commented))
            .arg("-l")
            .arg(format!("--log-prefix={}", prefix.display()))
            .arg(&self.database);
        if let Some(o) = &target.pgoptions {
            cmd.env("PGOPTIONS", o);
        }
        let what = format!("pgbench ({name})");
        let out = proc::run(&mut cmd, &what, Duration::from_secs(u64::from(secs) + 120));
        let result = out.and_then(|out| {
            let out = out.ok_or(
                &what,
                Some("pgbench stops a client at its first error; the output above says which"),
            )?;
            let summary = parse_summary(&out.stdout)?;
            let mut latencies = read_latencies(&dir)?;
            if latencies.is_empty() {
                return Err(Error::Parse {
                    what: "pgbench's per-transaction log",
                    detail: format!("no transactions logged in {}", dir.display()),
                });
            }
            Ok(Run {
                tps: summary.tps,
                transactions: summary.transactions,
                failed: summary.failed,
                mean_ms: stats::mean_us(&latencies) / 1000.0,
                p50_ms: stats::percentile_us(&mut latencies, 0.50) / 1000.0,
                p99_ms: stats::percentile_us(&mut latencies, 0.99) / 1000.0,
                cpu_us: None,
                proxy_cpu_us: None,
                server_cpu_us: None,
                round: 0,
            })
        });
        let _ = fs::remove_dir_all(&dir);
        result
    }
}

/// The figures of pgbench's summary.
#[derive(Debug, PartialEq)]
struct Summary {
    tps: f64,
    transactions: u64,
    failed: u64,
}

fn parse_summary(stdout: &str) -> Result<Summary> {
    let value = |prefix: &str| {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(prefix))
            .and_then(|rest| rest.split_whitespace().next())
            .map(str::to_string)
    };
    let missing = |what| Error::Parse {
        what,
        detail: proc::tail(stdout, 20),
    };
    let tps = value("tps = ")
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| missing("pgbench's tps line"))?;
    let transactions = value("number of transactions actually processed: ")
        .and_then(|v| v.split('/').next().and_then(|n| n.parse().ok()))
        .ok_or_else(|| missing("pgbench's transaction count"))?;
    // pgbench before 15 has no such line.
    let failed = value("number of failed transactions: ")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    Ok(Summary {
        tps,
        transactions,
        failed,
    })
}

/// The latencies (µs, the third column) of every transaction in the per-thread log files
/// pgbench wrote into `dir`.
fn read_latencies(dir: &Path) -> Result<Vec<u32>> {
    let mut out = Vec::new();
    let entries = fs::read_dir(dir).map_err(Error::io("list", dir))?;
    for entry in entries.flatten() {
        let path = entry.path();
        let text = fs::read_to_string(&path).map_err(Error::io("read", &path))?;
        out.extend(
            text.lines()
                .filter_map(|l| l.split_ascii_whitespace().nth(2)?.parse::<u32>().ok()),
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_of_pgbench_15() {
        let out = "transaction type: /tmp/x/select-only.sql\nscaling factor: 1\n\
            query mode: prepared\nnumber of clients: 8\nnumber of threads: 2\n\
            maximum number of tries: 1\nduration: 2 s\n\
            number of transactions actually processed: 120345\n\
            number of failed transactions: 0 (0.000%)\nlatency average = 0.132 ms\n\
            initial connection time = 5.012 ms\ntps = 60172.512345 (without initial connection time)\n";
        assert_eq!(
            parse_summary(out).unwrap(),
            Summary {
                tps: 60172.512345,
                transactions: 120345,
                failed: 0
            }
        );
        assert!(parse_summary("pgbench: error: connection refused").is_err());
    }

    #[test]
    fn commented_script_has_the_token_on_every_statement() {
        let c = sqlcommenter("bench", 7);
        let text = script(Workload::TpcbLike, Some(&c));
        let statements = text.lines().filter(|l| !l.starts_with('\\'));
        for line in statements {
            assert!(
                line.ends_with("/*fencing_resource='bench',fencing_token='7'*/;"),
                "{line}"
            );
        }
        assert_eq!(
            script(Workload::SelectOnly, None),
            "\\set aid random(1, 100000 * :scale)\n\
             SELECT abalance FROM pgbench_accounts WHERE aid = :aid;\n"
        );
    }
}
