//! The driver scripts of `tests/python/` and `tests/node/`, run directly against PostgreSQL
//! (which checks the scripts' own expectations) and through pgfence in every fence mode.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use crate::{process, PgCluster, Proxy, APP_DB};

/// Runs `interpreter script` (`cmd`, set up but for `env`) with `env` added, killing it
/// after `timeout`: its stdout, or its failure (the command, how it ended, stdout and
/// stderr).
pub(crate) fn run_script(
    mut cmd: Command,
    interpreter: &Path,
    script: &Path,
    env: &[(&str, &str)],
    timeout: Duration,
) -> Result<String, String> {
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = process::run(&mut cmd, None, timeout);
    if !out.success() {
        return Err(format!(
            "{} {} failed ({})\n--- stdout ---\n{}--- stderr ---\n{}",
            interpreter.display(),
            script.display(),
            out.describe(),
            out.stdout,
            out.stderr
        ));
    }
    Ok(out.stdout)
}

/// Runs a driver script with env vars: its output, or why it failed (the shape of
/// [`crate::try_run_python`] and [`crate::try_run_node`]).
pub type ScriptRunner = fn(&str, &[(&str, &str)]) -> Result<String, String>;

/// Runs `script` with `run` ([`crate::try_run_python`] or [`crate::try_run_node`]) against a
/// fresh cluster's `app` database: directly, through pgfence with the fence on (fast path
/// on, and off so the database rejects every stale write), and with it off. The script gets
/// `PG_DIRECT_DSN`, `PGFENCE_DSN` (through pgfence) and `PGFENCE_FENCE` (`on` where stale
/// writes must be rejected, `off` where they must land). Each way, every name of `tests`
/// must report `ok`; every way is run and reported before the test fails, so one run shows
/// them all.
pub fn run_in_every_fence_mode(script: &str, tests: &[&str], run: ScriptRunner) {
    let cluster = PgCluster::start();
    cluster.psql(APP_DB, &fence_core::sql::install_sql(None));
    let fenced = Proxy::for_cluster(&cluster);
    let mut config = Proxy::config_for(&cluster);
    config.fence.fast_path = false;
    let database_only = Proxy::start(config);
    let mut config = Proxy::config_for(&cluster);
    config.fence.enabled = false;
    let plain = Proxy::start(config);

    let direct = cluster.connstr(APP_DB);
    let targets = [
        ("direct", None, "off"),
        ("fence on", Some(fenced.connstr(APP_DB)), "on"),
        (
            "fence on, no fast path",
            Some(database_only.connstr(APP_DB)),
            "on",
        ),
        ("fence off", Some(plain.connstr(APP_DB)), "off"),
    ];
    let mut failures = Vec::new();
    for (mode, through, fence) in &targets {
        let mut env = vec![
            ("PG_DIRECT_DSN", direct.as_str()),
            ("PGFENCE_FENCE", *fence),
        ];
        if let Some(dsn) = through {
            env.push(("PGFENCE_DSN", dsn.as_str()));
        }
        match run(script, &env) {
            Ok(out) => {
                eprintln!("{mode} {script}:\n{out}");
                let missing: Vec<_> = tests
                    .iter()
                    .filter(|name| !out.lines().any(|l| l.starts_with(&format!("ok {name} "))))
                    .collect();
                if !missing.is_empty() {
                    failures.push(format!("{mode}: no `ok` for {missing:?} in:\n{out}"));
                }
            }
            Err(failure) => {
                eprintln!("{mode} {script}:\n{failure}");
                failures.push(format!("{mode}: {failure}"));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}
