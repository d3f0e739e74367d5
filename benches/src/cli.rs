//! Command-line options, and the command line that reproduces a run.

use std::path::PathBuf;

use clap::Parser;

use crate::error::{Error, Result};
use crate::plan::{Mode, Setup, Transport, Workload};

/// pgfence-bench: what pgfence costs, measured with pgbench against PostgreSQL directly,
/// PgBouncer and pgfence side by side.
///
/// Starts a throwaway PostgreSQL (or uses --upstream), loads pgbench's tables, starts
/// pgfence twice (fenced and --no-fence) and PgBouncer in session mode when it is
/// installed, then runs every cell (workload x query mode x clients) against every
/// configuration, interleaved round by round (A B C ... A B C ...) so that a machine whose
/// speed drifts treats them all alike. Prints a table, and writes results.md, results.json
/// and chart.svg to OUT_DIR/<timestamp>/.
///
/// Configurations (--configs): direct = PostgreSQL itself; pgbouncer = PgBouncer, session
/// mode; no-fence = pgfence --no-fence (the proxy alone); no-token = pgfence with the
/// fence on and no token; session-token = token in the startup packet
/// (options=-c fencing.token=N); sqlcommenter = token in a sqlcommenter comment on every
/// statement.
///
/// Then a stale-writer scenario: one client whose token is below the fence loops writes
/// through pgfence (fast path on, the default, and off); reports rejections per second and
/// their latency next to accepted writes. And pgfence's memory with idle sessions.
///
/// With the defaults (8 cells x 6 configurations x 3 rounds x 10 s, plus the stale writer) a
/// run takes about half an hour; `--duration 2 --rounds 1 --scale 1` checks the setup in
/// about two minutes. Every process it starts is stopped, and its directory removed, on
/// exit, on error and on Ctrl-C. See docs/benchmarks.md.
#[derive(Debug, Clone, Parser)]
#[command(
    name = "pgfence-bench",
    version,
    about,
    long_about,
    max_term_width = 100
)]
pub struct Args {
    /// Benchmark this PostgreSQL (HOST:PORT) instead of starting a throwaway one. pgbench -i
    /// drops and recreates the pgbench_* tables there (unless --skip-init) and `pgfence
    /// install` creates schema `pgfence`. A password, if needed, comes from PGPASSWORD.
    #[arg(long, value_name = "HOST:PORT", help_heading = "Server")]
    pub upstream: Option<String>,
    /// User pgbench and the proxies connect as (the superuser of the throwaway server).
    #[arg(long, short = 'U', default_value = "postgres", help_heading = "Server")]
    pub user: String,
    /// Database with the pgbench tables.
    #[arg(long, short = 'd', default_value = "postgres", help_heading = "Server")]
    pub database: String,
    /// pgbench scale factor for `pgbench -i` (100,000 accounts per unit).
    #[arg(long, short = 's', default_value_t = 10, help_heading = "Server")]
    pub scale: u32,
    /// Do not run `pgbench -i`: use the pgbench tables already in --database.
    #[arg(long, help_heading = "Server")]
    pub skip_init: bool,
    /// How pgfence and PgBouncer reach the throwaway server: `tcp` (127.0.0.1) or `unix` (its
    /// Unix-domain socket, as proxies on the database's host would). pgbench connects over
    /// TCP either way, to the proxies and to PostgreSQL directly.
    #[arg(
        long,
        value_name = "HOW",
        default_value = "tcp",
        help_heading = "Server"
    )]
    pub proxy_upstream: Transport,
    /// Extra postgresql.conf line for the throwaway server, NAME=VALUE (repeatable; wins
    /// over the runner's settings: shared_buffers=256MB, synchronous_commit=off,
    /// max_connections = max(100, idle sessions + 50)). E.g. --pg-setting
    /// synchronous_commit=on.
    #[arg(long, value_name = "NAME=VALUE", help_heading = "Server")]
    pub pg_setting: Vec<String>,
    /// Directory for the throwaway server, configs and pgbench logs (a fresh subdirectory,
    /// removed at the end) [default: /dev/shm when it has 2 GiB free, else $TMPDIR or /tmp].
    #[arg(long, value_name = "DIR", help_heading = "Server")]
    pub work_dir: Option<PathBuf>,

    /// Configurations to run, comma-separated. Within each cell they always run in the
    /// order of the table (direct, pgbouncer, no-fence, no-token, session-token,
    /// sqlcommenter), one round after another.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "direct,pgbouncer,no-fence,no-token,session-token,sqlcommenter",
        help_heading = "What to measure"
    )]
    pub configs: Vec<Setup>,
    /// Workloads, comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "select-only,tpcb-like",
        help_heading = "What to measure"
    )]
    pub workloads: Vec<Workload>,
    /// pgbench query modes (-M), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "simple,prepared",
        help_heading = "What to measure"
    )]
    pub modes: Vec<Mode>,
    /// Client counts (pgbench -c), comma-separated.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,8",
        help_heading = "What to measure"
    )]
    pub clients: Vec<u32>,
    /// Most pgbench worker threads (-j is min(clients, this)).
    #[arg(long, default_value_t = 2, help_heading = "What to measure")]
    pub max_jobs: u32,
    /// Seconds per pgbench run.
    #[arg(
        long,
        short = 'T',
        default_value_t = 10,
        help_heading = "What to measure"
    )]
    pub duration: u32,
    /// Runs of every configuration in every cell; the table shows the median.
    #[arg(
        long,
        short = 'r',
        default_value_t = 3,
        help_heading = "What to measure"
    )]
    pub rounds: u32,
    /// Seconds of TPC-B (prepared, most clients) per configuration before measuring,
    /// unrecorded; 0 skips the warm-up.
    #[arg(long, default_value_t = 3, help_heading = "What to measure")]
    pub warmup: u32,
    /// Seconds per stale-writer variant and round [default: --duration]; 0 skips it.
    #[arg(long, help_heading = "What to measure")]
    pub stale_duration: Option<u32>,
    /// Idle sessions opened through a fresh pgfence to measure its memory per session;
    /// 0 skips it.
    #[arg(long, default_value_t = 200, help_heading = "What to measure")]
    pub idle_sessions: u32,
    /// `pgfence --threads N` for every pgfence started [default: pgfence's own, the number
    /// of CPUs].
    #[arg(long, value_name = "N", help_heading = "What to measure")]
    pub pgfence_threads: Option<usize>,

    /// The pgfence binary [default: target/release/pgfence of this workspace, built first
    /// with `cargo build --release -p pgfence`].
    #[arg(long, value_name = "PATH", help_heading = "Programs")]
    pub pgfence_bin: Option<PathBuf>,
    /// Do not run `cargo build` for pgfence; use the binary as it is.
    #[arg(long, help_heading = "Programs")]
    pub no_build: bool,
    /// The pgbouncer binary [default: pgbouncer on PATH, or /usr/sbin/pgbouncer].
    #[arg(long, value_name = "PATH", help_heading = "Programs")]
    pub pgbouncer_bin: Option<PathBuf>,
    /// Directory with initdb, pg_ctl and pgbench [default: `pg_config --bindir`, else the
    /// newest /usr/lib/postgresql/*/bin].
    #[arg(long, value_name = "DIR", help_heading = "Programs")]
    pub pg_bin: Option<PathBuf>,

    /// Where results go: a new subdirectory named after the start time (UTC).
    #[arg(
        long,
        short = 'o',
        default_value = "bench-results",
        value_name = "DIR",
        help_heading = "Output"
    )]
    pub out_dir: PathBuf,
}

impl Args {
    /// Rejects values that cannot work, before anything is started.
    pub fn validate(&mut self) -> Result<()> {
        let bad = |m: &str| Err(Error::Usage(m.to_string()));
        if self.duration == 0 {
            return bad("--duration must be at least 1 second");
        }
        if self.rounds == 0 {
            return bad("--rounds must be at least 1");
        }
        if self.scale == 0 {
            return bad("--scale must be at least 1");
        }
        if self.max_jobs == 0 {
            return bad("--max-jobs must be at least 1");
        }
        if self.pgfence_threads == Some(0) {
            return bad("--pgfence-threads must be at least 1");
        }
        if self.clients.contains(&0) {
            return bad("--clients: every client count must be at least 1");
        }
        for list in [
            self.configs.is_empty(),
            self.workloads.is_empty(),
            self.modes.is_empty(),
            self.clients.is_empty(),
        ] {
            if list {
                return bad("--configs, --workloads, --modes and --clients need a value");
            }
        }
        for s in &self.pg_setting {
            if !s.contains('=') {
                return Err(Error::Usage(format!(
                    "--pg-setting {s:?}: expected NAME=VALUE, e.g. synchronous_commit=on"
                )));
            }
        }
        if self.upstream.is_some() && self.proxy_upstream == Transport::Unix {
            return bad(
                "--proxy-upstream unix applies to the throwaway server: with --upstream, \
                 everything connects to the address given",
            );
        }
        if self.upstream.is_some() && !self.pg_setting.is_empty() {
            return bad("--pg-setting applies to the throwaway server, not to --upstream");
        }
        self.configs.sort();
        self.configs.dedup();
        self.workloads.sort();
        self.workloads.dedup();
        self.modes.sort();
        self.modes.dedup();
        self.clients.sort();
        self.clients.dedup();
        Ok(())
    }

    /// `--pg-setting`s as (name, value) pairs.
    pub fn pg_settings(&self) -> Vec<(String, String)> {
        self.pg_setting
            .iter()
            .filter_map(|s| s.split_once('='))
            .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
            .collect()
    }

    /// Seconds per stale-writer variant.
    pub fn stale_secs(&self) -> u32 {
        self.stale_duration.unwrap_or(self.duration)
    }

    /// The command line that repeats this run, every option spelled out (so that a change
    /// of defaults does not change what it measures).
    pub fn reproduce(&self) -> String {
        let join = |v: Vec<&str>| v.join(",");
        let mut a: Vec<String> = vec!["cargo run --release -p pgfence-benches --".to_string()];
        let mut opt = |k: &str, v: String| a.push(format!("--{k} {}", shell_quote(&v)));
        if let Some(u) = &self.upstream {
            opt("upstream", u.clone());
        }
        opt("user", self.user.clone());
        opt("database", self.database.clone());
        if !self.skip_init {
            opt("scale", self.scale.to_string());
        }
        for s in &self.pg_setting {
            opt("pg-setting", s.clone());
        }
        if self.upstream.is_none() {
            opt("proxy-upstream", self.proxy_upstream.key().to_string());
        }
        opt(
            "configs",
            join(self.configs.iter().map(|c| c.key()).collect()),
        );
        opt(
            "workloads",
            join(self.workloads.iter().map(|w| w.key()).collect()),
        );
        opt("modes", join(self.modes.iter().map(|m| m.key()).collect()));
        opt(
            "clients",
            self.clients
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(","),
        );
        opt("max-jobs", self.max_jobs.to_string());
        opt("duration", self.duration.to_string());
        opt("rounds", self.rounds.to_string());
        opt("warmup", self.warmup.to_string());
        opt("stale-duration", self.stale_secs().to_string());
        opt("idle-sessions", self.idle_sessions.to_string());
        if let Some(n) = self.pgfence_threads {
            opt("pgfence-threads", n.to_string());
        }
        if self.skip_init {
            a.push("--skip-init".to_string());
        }
        a.join(" ")
    }
}

/// `s` as one shell word.
fn shell_quote(s: &str) -> String {
    let plain = |c: char| c.is_ascii_alphanumeric() || "-_.,:/=@+".contains(c);
    if !s.is_empty() && s.chars().all(plain) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', r"'\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_reproduce() {
        let mut args = Args::parse_from(["pgfence-bench"]);
        args.validate().unwrap();
        assert_eq!(args.configs, Setup::ALL.to_vec());
        assert_eq!(args.clients, vec![1, 8]);
        let line = args.reproduce();
        let words = line.split_whitespace().collect::<Vec<_>>();
        assert_eq!(
            words[..6],
            ["cargo", "run", "--release", "-p", "pgfence-benches", "--"]
        );
        let mut again =
            Args::parse_from(std::iter::once("pgfence-bench").chain(words[6..].iter().copied()));
        again.validate().unwrap();
        assert_eq!(again.reproduce(), line);
    }

    #[test]
    fn proxy_upstream_is_for_the_throwaway_server() {
        let mut unix = Args::parse_from(["pgfence-bench", "--proxy-upstream", "unix"]);
        unix.validate().unwrap();
        assert!(unix.reproduce().contains("--proxy-upstream unix"));
        let mut other = Args::parse_from([
            "pgfence-bench",
            "--upstream",
            "db:5432",
            "--proxy-upstream",
            "unix",
        ]);
        assert!(matches!(other.validate(), Err(Error::Usage(m)) if m.contains("--upstream")));
        let mut tcp = Args::parse_from(["pgfence-bench", "--upstream", "db:5432"]);
        tcp.validate().unwrap();
        assert!(!tcp.reproduce().contains("--proxy-upstream"));
    }

    #[test]
    fn quoting() {
        assert_eq!(
            shell_quote("synchronous_commit=on"),
            "synchronous_commit=on"
        );
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
    }
}
