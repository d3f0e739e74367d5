//! The main measurement: every cell, every configuration, interleaved round by round, and
//! the medians the report shows.

use std::time::{Duration, Instant};

use serde::Serialize;

use crate::cli::Args;
use crate::cpu;
use crate::db::Db;
use crate::error::{Error, Result};
use crate::pgbench::{Bench, Run, Target};
use crate::plan::{Cell, Mode, Setup, Workload};
use crate::proc::{self, HOST};
use crate::stack::{Stack, RESOURCE};
use crate::stats::{median, median_interval, Interval};

/// What pgbench's own `-n`-less start would do before a TPC-B run: the same starting point
/// for every run. Sent to PostgreSQL directly, outside the timed part, one statement per
/// Query (VACUUM cannot run in the implicit transaction of a multi-statement Query).
const RESET_TPCB: &[&str] = &[
    "VACUUM pgbench_branches, pgbench_tellers",
    "TRUNCATE pgbench_history",
];

/// One configuration in one cell.
#[derive(Debug, Clone, Serialize)]
pub struct SetupResult {
    pub setup: Setup,
    pub label: &'static str,
    /// Every round that completed, in order.
    pub runs: Vec<Run>,
    /// Rounds that failed, with why.
    pub errors: Vec<String>,
    /// Medians over the completed rounds; `None` when none completed.
    pub median: Option<Medians>,
}

/// Medians over rounds, each taken separately.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Medians {
    pub tps: f64,
    pub mean_ms: f64,
    pub p99_ms: f64,
    /// (max - min) / median of the rounds' TPS: how much the rounds disagree.
    pub tps_spread: f64,
    /// CPU µs per transaction: the whole machine's, the proxy's and the server's.
    pub cpu_us: Option<f64>,
    pub proxy_cpu_us: Option<f64>,
    pub server_cpu_us: Option<f64>,
}

impl SetupResult {
    fn summarise(&mut self) {
        let col = |f: fn(&Run) -> f64| self.runs.iter().map(f).collect::<Vec<f64>>();
        // The median of a figure some rounds may lack (`None`: none has it).
        let measured = |f: fn(&Run) -> Option<f64>| {
            median(&self.runs.iter().filter_map(f).collect::<Vec<f64>>())
        };
        let tps = col(|r| r.tps);
        self.median = median(&tps).map(|m| {
            let (lo, hi) = tps
                .iter()
                .fold((f64::MAX, f64::MIN), |(lo, hi), &t| (lo.min(t), hi.max(t)));
            Medians {
                tps: m,
                mean_ms: median(&col(|r| r.mean_ms)).unwrap_or(f64::NAN),
                p99_ms: median(&col(|r| r.p99_ms)).unwrap_or(f64::NAN),
                tps_spread: if m > 0.0 { (hi - lo) / m } else { 0.0 },
                cpu_us: measured(|r| r.cpu_us),
                proxy_cpu_us: measured(|r| r.proxy_cpu_us),
                server_cpu_us: measured(|r| r.server_cpu_us),
            }
        });
    }
}

/// One cell: every configuration's result, in table order.
#[derive(Debug, Clone, Serialize)]
pub struct CellResult {
    pub cell: Cell,
    pub label: String,
    pub setups: Vec<SetupResult>,
}

impl CellResult {
    fn runs(&self, setup: Setup) -> &[Run] {
        self.setups
            .iter()
            .find(|s| s.setup == setup)
            .map(|s| s.runs.as_slice())
            .unwrap_or_default()
    }

    /// `f(a's run, b's run)` for every round both completed, pairing runs of the same round
    /// (they ran minutes apart at most, so machine drift between rounds cancels out).
    fn paired(&self, a: Setup, b: Setup, f: impl Fn(&Run, &Run) -> Option<f64>) -> Vec<f64> {
        let rb = self.runs(b);
        self.runs(a)
            .iter()
            .filter_map(|x| {
                let y = rb.iter().find(|y| y.round == x.round)?;
                f(x, y)
            })
            .collect()
    }

    /// In how many rounds `keep(a's run, b's run)` held, out of the rounds both completed.
    fn rounds_where(
        &self,
        a: Setup,
        b: Setup,
        keep: impl Fn(&Run, &Run) -> bool,
    ) -> (usize, usize) {
        let rb = self.runs(b);
        let pairs: Vec<bool> = self
            .runs(a)
            .iter()
            .filter_map(|x| Some(keep(x, rb.iter().find(|y| y.round == x.round)?)))
            .collect();
        (pairs.iter().filter(|&&k| k).count(), pairs.len())
    }

    /// Rounds in which `a` had at least `b`'s TPS, and rounds paired.
    pub fn rounds_not_slower(&self, a: Setup, b: Setup) -> (usize, usize) {
        self.rounds_where(a, b, |x, y| x.tps >= y.tps)
    }

    /// Rounds in which `a`'s mean latency was at most `b`'s, and rounds paired.
    pub fn rounds_not_later(&self, a: Setup, b: Setup) -> (usize, usize) {
        self.rounds_where(a, b, |x, y| x.mean_ms <= y.mean_ms)
    }

    /// TPS of `a` over TPS of `b`: the median of the rounds' ratios.
    pub fn tps_ratio(&self, a: Setup, b: Setup) -> Option<f64> {
        median(&self.tps_ratios(a, b))
    }

    /// Mean latency `a` adds to `b`, in µs: the median of the rounds' differences.
    pub fn added_latency_us(&self, a: Setup, b: Setup) -> Option<f64> {
        median(&self.latency_differences_us(a, b))
    }

    /// [`Self::tps_ratio`] with an interval for it.
    pub fn tps_ratio_estimate(&self, a: Setup, b: Setup) -> Option<Estimate> {
        Estimate::of(&self.tps_ratios(a, b))
    }

    /// [`Self::added_latency_us`] with an interval for it.
    pub fn added_latency_estimate(&self, a: Setup, b: Setup) -> Option<Estimate> {
        Estimate::of(&self.latency_differences_us(a, b))
    }

    fn tps_ratios(&self, a: Setup, b: Setup) -> Vec<f64> {
        self.paired(a, b, |x, y| (y.tps > 0.0).then(|| x.tps / y.tps))
    }

    fn latency_differences_us(&self, a: Setup, b: Setup) -> Vec<f64> {
        self.paired(a, b, |x, y| Some((x.mean_ms - y.mean_ms) * 1000.0))
    }
}

/// The median of the rounds' paired values, and the interval that holds the true median
/// with the confidence it states ([`median_interval`]): a median whose interval includes
/// the target is within this run's noise.
#[derive(Debug, Clone, Copy)]
pub struct Estimate {
    pub median: f64,
    pub interval: Interval,
}

impl Estimate {
    fn of(values: &[f64]) -> Option<Estimate> {
        Some(Estimate {
            median: median(values)?,
            interval: median_interval(values)?,
        })
    }
}

/// Where pgbench connects for `setup`; `None` when its server was not started.
fn target(stack: &Stack, setup: Setup, token: i64) -> Option<Target> {
    let proxy = |d: &Option<crate::proc::Daemon>| {
        d.as_ref().map(|d| Target {
            host: HOST.to_string(),
            port: d.port(),
            pgoptions: None,
            commented: false,
        })
    };
    match setup {
        Setup::Direct => Some(Target {
            host: stack.pg_host.clone(),
            port: stack.pg_port,
            pgoptions: None,
            commented: false,
        }),
        Setup::Pgbouncer => proxy(&stack.pgbouncer),
        Setup::NoFence => proxy(&stack.unfenced),
        Setup::NoToken => proxy(&stack.fenced),
        Setup::SessionToken => proxy(&stack.fenced).map(|t| Target {
            pgoptions: Some(format!(
                "-c fencing.resource={RESOURCE} -c fencing.token={token}"
            )),
            ..t
        }),
        Setup::Sqlcommenter => proxy(&stack.fenced).map(|t| Target {
            commented: true,
            ..t
        }),
    }
}

/// The configurations of `args` that can run here (PgBouncer only when installed).
pub fn runnable(args: &Args, stack: &Stack, token: i64) -> Vec<(Setup, Target)> {
    args.configs
        .iter()
        .filter_map(|&s| target(stack, s, token).map(|t| (s, t)))
        .collect()
}

/// Runs every cell of `cells` for every configuration, `args.rounds` times, interleaved;
/// the token configurations present `token` for [`RESOURCE`].
pub fn run_all(
    args: &Args,
    stack: &mut Stack,
    db: &Db,
    bench: &Bench,
    cells: &[Cell],
    token: i64,
) -> Result<Vec<CellResult>> {
    let setups = runnable(args, stack, token);
    let total_runs = cells.len() * setups.len() * args.rounds as usize;
    let started = Instant::now();
    let mut done = 0usize;

    if args.warmup > 0 {
        let clients = args.clients.iter().copied().max().unwrap_or(1);
        let cell = Cell {
            workload: Workload::TpcbLike,
            mode: Mode::Prepared,
            clients,
        };
        eprintln!(
            "pgfence-bench: warming up, {} s of {} per configuration",
            args.warmup,
            cell.label()
        );
        for (setup, t) in &setups {
            reset(db, stack, cell)?;
            if let Err(e) = bench.run(t, cell, args.warmup, &format!("warmup-{}", setup.key())) {
                bail_if_interrupted(&e)?;
                eprintln!("pgfence-bench: warm-up of {} failed: {e}", setup.label());
            }
        }
    }

    let mut results = Vec::new();
    for &cell in cells {
        let mut row: Vec<SetupResult> = setups
            .iter()
            .map(|(s, _)| SetupResult {
                setup: *s,
                label: s.label(),
                runs: Vec::new(),
                errors: Vec::new(),
                median: None,
            })
            .collect();
        for round in 1..=args.rounds {
            // Each round starts one configuration later than the one before: every
            // configuration takes every position in turn, so neither the first run of a cell
            // (right after the previous cell's workload) nor drift within a round always
            // lands on the same one.
            let order = rotated(setups.len(), round);
            for i in order {
                let (setup, t) = &setups[i];
                let name = format!("{}-{}-r{round}", cell.slug(), setup.key());
                let proxy = stack.proxy_pid(*setup);
                let server = stack.server_pid();
                let outcome = stack
                    .ensure_running(*setup)
                    .and_then(|()| reset(db, stack, cell))
                    .and_then(|()| {
                        let before = cpu::sample(proxy, server);
                        let mut run = bench.run(t, cell, args.duration, &name)?;
                        run.round = round;
                        let after = cpu::sample(proxy, server);
                        let cpu = cpu::per_transaction(before, after, run.transactions);
                        run.cpu_us = cpu.machine;
                        run.proxy_cpu_us = cpu.proxy;
                        run.server_cpu_us = cpu.server;
                        Ok(run)
                    });
                done += 1;
                let eta = eta(started, done, total_runs);
                match outcome {
                    Ok(run) => {
                        eprintln!(
                            "[{done}/{total_runs}, {eta} left] {} | round {round}/{} | {:<24} {:>9.0} tps  mean {:.3} ms  p99 {:.3} ms{}",
                            cell.label(),
                            args.rounds,
                            setup.label(),
                            run.tps,
                            run.mean_ms,
                            run.p99_ms,
                            if run.failed > 0 {
                                format!("  ({} failed transactions)", run.failed)
                            } else {
                                String::new()
                            }
                        );
                        row[i].runs.push(run);
                    }
                    Err(e) => {
                        bail_if_interrupted(&e)?;
                        eprintln!(
                            "[{done}/{total_runs}] {} | round {round} | {}: FAILED: {e}",
                            cell.label(),
                            setup.label()
                        );
                        row[i].errors.push(format!("round {round}: {e}"));
                    }
                }
            }
        }
        for s in &mut row {
            s.summarise();
        }
        results.push(CellResult {
            cell,
            label: cell.label(),
            setups: row,
        });
    }
    Ok(results)
}

/// The order of `n` configurations in `round` (1-based): rotated by one per round.
fn rotated(n: usize, round: u32) -> impl Iterator<Item = usize> {
    let start = (round.saturating_sub(1) as usize) % n.max(1);
    (0..n).map(move |k| (start + k) % n)
}

/// Resets the TPC-B tables (directly on PostgreSQL) before a TPC-B run.
fn reset(db: &Db, stack: &Stack, cell: Cell) -> Result<()> {
    proc::check_interrupted()?;
    if cell.workload == Workload::TpcbLike {
        for sql in RESET_TPCB {
            db.execute(&stack.pg_host, stack.pg_port, sql)?;
        }
    }
    Ok(())
}

fn bail_if_interrupted(e: &Error) -> Result<()> {
    match e {
        Error::Interrupted => Err(Error::Interrupted),
        _ => Ok(()),
    }
}

/// Time left, from the pace so far.
fn eta(started: Instant, done: usize, total: usize) -> String {
    if done == 0 {
        return "?".to_string();
    }
    let per = started.elapsed().as_secs_f64() / done as f64;
    let left = Duration::from_secs_f64(per * (total - done) as f64).as_secs();
    format!("{}m{:02}s", left / 60, left % 60)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Mode, Workload};

    fn run(round: u32, tps: f64, mean_ms: f64) -> Run {
        Run {
            tps,
            transactions: 0,
            failed: 0,
            mean_ms,
            p50_ms: mean_ms,
            p99_ms: mean_ms,
            cpu_us: None,
            proxy_cpu_us: None,
            server_cpu_us: None,
            round,
        }
    }

    fn setup(setup: Setup, runs: Vec<Run>) -> SetupResult {
        SetupResult {
            setup,
            label: setup.label(),
            runs,
            errors: Vec::new(),
            median: None,
        }
    }

    #[test]
    fn rounds_rotate_through_every_configuration() {
        assert_eq!(rotated(3, 1).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(rotated(3, 2).collect::<Vec<_>>(), [1, 2, 0]);
        assert_eq!(rotated(3, 4).collect::<Vec<_>>(), [0, 1, 2]);
        assert_eq!(rotated(0, 2).count(), 0);
    }

    #[test]
    fn ratios_pair_runs_of_the_same_round() {
        // The machine is twice as fast in round 2: medians of TPS would say 1.5 / 2.5 = 0.6;
        // the rounds' own ratios say 0.5 each time. Round 3 of `b` failed: not paired.
        let cell = CellResult {
            cell: Cell {
                workload: Workload::SelectOnly,
                mode: Mode::Simple,
                clients: 1,
            },
            label: String::new(),
            setups: vec![
                setup(
                    Setup::NoToken,
                    vec![run(1, 1.0, 2.0), run(2, 2.0, 1.0), run(3, 9.0, 0.1)],
                ),
                setup(Setup::Pgbouncer, vec![run(1, 2.0, 1.0), run(2, 4.0, 0.5)]),
            ],
        };
        assert_eq!(cell.tps_ratio(Setup::NoToken, Setup::Pgbouncer), Some(0.5));
        assert_eq!(
            cell.added_latency_us(Setup::NoToken, Setup::Pgbouncer),
            Some(750.0)
        );
        assert_eq!(cell.tps_ratio(Setup::Direct, Setup::Pgbouncer), None);
    }
}
