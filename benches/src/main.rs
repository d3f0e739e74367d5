//! `pgfence-bench`, the pgbench overhead runner (docs/benchmarks.md): starts PostgreSQL,
//! pgfence and PgBouncer, measures every configuration side by side, and writes the table,
//! Markdown, JSON and chart. `--help` documents every option.
#![forbid(unsafe_code)]

mod chart;
mod cli;
mod cpu;
mod db;
mod error;
mod measure;
mod pgbench;
mod plan;
mod postgres;
mod proc;
mod report;
mod stack;
mod stale;
mod stats;

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{SystemTime, UNIX_EPOCH};

use clap::Parser;

use crate::cli::Args;
use crate::db::{Db, Login};
use crate::error::{Error, Result};
use crate::pgbench::{Bench, Scripts};
use crate::plan::Transport;
use crate::report::{Environment, Report};
use crate::stack::{Programs, Stack, RESOURCE, TOKEN};
use crate::stale::{Tokens, STALE_RESOURCE};

fn main() -> ExitCode {
    let mut args = Args::parse();
    if let Err(e) = args.validate() {
        eprintln!("pgfence-bench: {e}");
        return ExitCode::from(2);
    }
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => {
            eprintln!("pgfence-bench: some runs failed; see the notes above");
            ExitCode::from(1)
        }
        Err(Error::Interrupted) => {
            eprintln!("pgfence-bench: interrupted; everything it started is stopped");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("pgfence-bench: {e}");
            ExitCode::from(1)
        }
    }
}

/// The whole run. `Ok(false)` when some measurements failed but a report was written.
/// Everything started is stopped when `stack` drops, on every path out of here.
fn run(args: &Args) -> Result<bool> {
    proc::watch_signals()?;
    let started = SystemTime::now();
    let load_start = load_average();
    // The code measured is the code at the start: commits made during a run do not count.
    let git = workspace_git();
    let programs = Programs::find(args)?;
    let mut stack = Stack::start_postgres(args, programs)?;
    let db = Db::new(Login::new(&args.user, &args.database))?;
    let (host, port) = (stack.pg_host.clone(), stack.pg_port);

    if !args.skip_init {
        stack.init_pgbench(args)?;
    }
    let scale = if args.skip_init {
        db.query_text(&host, port, "SELECT count(*) FROM pgbench_branches")?
            .and_then(|s| s.parse().ok())
            .filter(|&n: &u32| n > 0)
            .ok_or(Error::Usage(
                "--skip-init: no pgbench tables in --database; drop --skip-init".to_string(),
            ))?
    } else {
        args.scale
    };

    let mut notes = Vec::new();
    let stale_secs = args.stale_secs();
    stack.install_fence(args)?;
    // Tokens equal to the fences already there (with --upstream, an earlier run's) are
    // accepted without moving anything.
    let fence_of = |r: &str| -> Result<Option<i64>> {
        Ok(db
            .query_text(
                &host,
                port,
                &format!("SELECT token FROM pgfence.fences WHERE resource = '{r}'"),
            )?
            .and_then(|t| t.parse().ok()))
    };
    let token = fence_of(RESOURCE)?.unwrap_or(TOKEN).max(TOKEN);
    let current = fence_of(STALE_RESOURCE)?.unwrap_or(2 * TOKEN).max(1);
    let tokens = Tokens {
        current,
        stale: current - 1,
    };
    stack.start_proxies(args)?;
    if args.configs.contains(&plan::Setup::Pgbouncer) && stack.pgbouncer.is_none() {
        notes.push("PgBouncer is not installed: its configuration was skipped".to_string());
    }

    let scripts = Scripts::write(&stack.dir().join("scripts"), RESOURCE, token)?;
    let bench = Bench {
        pgbench: stack.programs.pgbench.clone(),
        user: args.user.clone(),
        database: args.database.clone(),
        scale,
        max_jobs: args.max_jobs,
        scripts: scripts.clone(),
        log_dir: stack.dir().join("logs"),
    };
    let cells = plan::cells(&args.workloads, &args.modes, &args.clients);
    let results = measure::run_all(args, &mut stack, &db, &bench, &cells, token)?;

    let stale = if stale_secs > 0 {
        match stale::run(&stack, &db, tokens, stale_secs, args.rounds) {
            Ok(rows) => Some(rows),
            Err(Error::Interrupted) => return Err(Error::Interrupted),
            Err(e) => {
                eprintln!("pgfence-bench: the stale-writer scenario failed: {e}");
                notes.push(format!("stale writer failed: {e}"));
                None
            }
        }
    } else {
        None
    };
    let memory = if args.idle_sessions > 0 {
        match stale::idle_memory(&stack, &db, tokens.current, args.idle_sessions) {
            Ok(m) => Some(m),
            Err(Error::Interrupted) => return Err(Error::Interrupted),
            Err(e) => {
                eprintln!("pgfence-bench: the idle-session measurement failed: {e}");
                notes.push(format!("idle sessions failed: {e}"));
                None
            }
        }
    } else {
        None
    };
    let bench_fence_after = fence_of(RESOURCE)?.map(|t| t.to_string());

    let environment = environment(args, &stack, &db, load_start, git)?;
    let report = Report {
        started_utc: utc(started, true),
        command: args.reproduce(),
        environment,
        duration_secs: args.duration,
        rounds: args.rounds,
        scale,
        cells: results,
        stale_tokens: stale.as_ref().map(|_| tokens),
        stale,
        memory,
        bench_fence_after,
        notes,
    };
    let all_ok = report
        .cells
        .iter()
        .all(|c| c.setups.iter().all(|s| s.errors.is_empty()));
    let dir = write_report(args, &report, started, &stack.dir().join("scripts"))?;
    print!("{}", report::text(&report));
    println!(
        "\nWritten: {0}/results.md, {0}/results.json, {0}/chart.svg",
        dir.display()
    );
    Ok(all_ok)
}

/// Writes results.md, results.json, chart.svg and the scripts into a new directory.
fn write_report(
    args: &Args,
    report: &Report,
    started: SystemTime,
    scripts: &Path,
) -> Result<PathBuf> {
    let dir = args.out_dir.join(utc(started, false));
    fs::create_dir_all(dir.join("scripts")).map_err(Error::io("create", &dir))?;
    let write = |name: &str, text: &str| {
        let path = dir.join(name);
        fs::write(&path, text).map_err(Error::io("write", &path))
    };
    write("results.md", &report::markdown(report))?;
    let json = serde_json::to_string_pretty(report).map_err(|e| Error::Parse {
        what: "the results as JSON",
        detail: e.to_string(),
    })?;
    write("results.json", &json)?;
    let title = format!(
        "pgfence overhead: pgbench TPS by configuration ({})",
        report.started_utc
    );
    let footer = format!(
        "scale {}, {} s x {} round(s) per configuration, interleaved; {} CPUs, load {} -> {}; {}",
        report.scale,
        report.duration_secs,
        report.rounds,
        report.environment.cpus,
        report.environment.load_average_start,
        report.environment.load_average_end,
        report.environment.postgres
    );
    write("chart.svg", &chart::svg(&report.cells, &title, &footer))?;
    for entry in fs::read_dir(scripts)
        .map_err(Error::io("list", scripts))?
        .flatten()
    {
        let to = dir.join("scripts").join(entry.file_name());
        fs::copy(entry.path(), &to).map_err(Error::io("copy to", &to))?;
    }
    Ok(dir)
}

fn environment(
    args: &Args,
    stack: &Stack,
    db: &Db,
    load_start: String,
    pgfence_git: Option<String>,
) -> Result<Environment> {
    let first_line = |program: &Path, arg: &str| {
        Command::new(program)
            .arg(arg)
            .output()
            .ok()
            .map(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .next()
                    .unwrap_or("")
                    .to_string()
            })
            .unwrap_or_default()
    };
    let postgres = db
        .query_text(&stack.pg_host, stack.pg_port, "SHOW server_version")?
        .map(|v| format!("PostgreSQL {v}"))
        .unwrap_or_default();
    let server = match &args.upstream {
        Some(u) => format!("--upstream {u}"),
        None => {
            let mut s = format!(
                "throwaway, data in {}, shared_buffers 256MB, synchronous_commit off, fsync on",
                stack.dir().parent().unwrap_or(Path::new("/")).display()
            );
            for p in &args.pg_setting {
                s.push_str(&format!(", {p}"));
            }
            s
        }
    };
    Ok(Environment {
        cpus: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0),
        load_average_start: load_start,
        load_average_end: load_average(),
        kernel: fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|k| format!("Linux {}", k.trim()))
            .unwrap_or_default(),
        postgres,
        pgbench: first_line(&stack.programs.pgbench, "--version"),
        pgbouncer: stack
            .programs
            .pgbouncer
            .as_ref()
            .map(|p| first_line(p, "--version")),
        pgfence_git,
        server,
        pgfence_threads: args.pgfence_threads.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
        }),
        proxy_upstream: match args.proxy_upstream {
            Transport::Tcp => "TCP".to_string(),
            Transport::Unix => "its Unix-domain socket".to_string(),
        },
    })
}

/// `git describe --always --dirty` of the workspace, if it is a git checkout.
fn workspace_git() -> Option<String> {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap_or(Path::new("."));
    Command::new("git")
        .arg("-C")
        .arg(workspace)
        .args(["describe", "--always", "--dirty"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| format!("git {}", String::from_utf8_lossy(&o.stdout).trim()))
}

/// The 1, 5 and 15 minute load averages.
fn load_average() -> String {
    fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// `t` in UTC: `2024-05-01T12:34:56Z`, or `20240501T123456Z` for a directory name.
fn utc(t: SystemTime, readable: bool) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let (days, rest) = ((secs / 86_400) as i64, secs % 86_400);
    let (h, m, s) = (rest / 3600, rest % 3600 / 60, rest % 60);
    // Howard Hinnant's civil_from_days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let mo = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(mo <= 2);
    if readable {
        format!("{y:04}-{mo:02}-{d:02}T{h:02}:{m:02}:{s:02}Z")
    } else {
        format!("{y:04}{mo:02}{d:02}T{h:02}{m:02}{s:02}Z")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn utc_dates() {
        let t = |s| UNIX_EPOCH + Duration::from_secs(s);
        assert_eq!(utc(t(0), true), "1970-01-01T00:00:00Z");
        assert_eq!(utc(t(951_782_400), true), "2000-02-29T00:00:00Z");
        assert_eq!(utc(t(1_714_566_896), false), "20240501T123456Z");
    }
}
