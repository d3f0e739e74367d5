//! The report: one set of rows rendered as a terminal table and as Markdown, the JSON
//! document, and the issue's targets checked against the figures.

use serde::Serialize;

use crate::measure::{CellResult, Estimate};
use crate::plan::{Setup, Workload};
use crate::stale::{Memory, StaleRow, Tokens};

/// Everything a run found; `results.json` is this, serialised.
#[derive(Debug, Serialize)]
pub struct Report {
    /// UTC, `2024-05-01T12:34:56Z`.
    pub started_utc: String,
    /// The command line that repeats the run.
    pub command: String,
    pub environment: Environment,
    pub duration_secs: u32,
    pub rounds: u32,
    pub scale: u32,
    pub cells: Vec<CellResult>,
    pub stale_tokens: Option<Tokens>,
    pub stale: Option<Vec<StaleRow>>,
    pub memory: Option<Memory>,
    /// `SELECT token FROM pgfence.fences WHERE resource = 'bench'` at the end: proof that
    /// the fenced configurations went through the check.
    pub bench_fence_after: Option<String>,
    /// Parts skipped or failed, and why.
    pub notes: Vec<String>,
}

/// Where the figures come from.
#[derive(Debug, Serialize)]
pub struct Environment {
    pub cpus: usize,
    pub load_average_start: String,
    pub load_average_end: String,
    pub kernel: String,
    pub postgres: String,
    pub pgbench: String,
    pub pgbouncer: Option<String>,
    /// `git describe --always --dirty` of the workspace when the run started.
    pub pgfence_git: Option<String>,
    /// "throwaway (settings ...)" or "--upstream HOST:PORT".
    pub server: String,
    /// pgfence's worker threads.
    pub pgfence_threads: usize,
    /// How the proxies reach the server: "TCP" or "its Unix-domain socket".
    pub proxy_upstream: String,
}

/// A table: headers, rows, and which columns are numbers (right-aligned).
struct Table {
    headers: Vec<&'static str>,
    numeric: Vec<bool>,
    rows: Vec<Vec<String>>,
}

impl Table {
    fn text(&self) -> String {
        let widths: Vec<usize> = (0..self.headers.len())
            .map(|i| {
                self.rows
                    .iter()
                    .map(|r| r[i].chars().count())
                    .chain([self.headers[i].chars().count()])
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let line = |cells: Vec<&str>| {
            let parts: Vec<String> = cells
                .iter()
                .enumerate()
                .map(|(i, c)| {
                    if self.numeric[i] {
                        format!("{c:>w$}", w = widths[i])
                    } else {
                        format!("{c:<w$}", w = widths[i])
                    }
                })
                .collect();
            parts.join("  ").trim_end().to_string()
        };
        let mut out = line(self.headers.clone());
        out.push('\n');
        let rule: Vec<String> = widths.iter().map(|w| "-".repeat(*w)).collect();
        out.push_str(&rule.join("  "));
        out.push('\n');
        for r in &self.rows {
            out.push_str(&line(r.iter().map(String::as_str).collect()));
            out.push('\n');
        }
        out
    }

    fn markdown(&self) -> String {
        let esc = |s: &str| s.replace('|', "\\|");
        let mut out = format!(
            "| {} |\n|{}|\n",
            self.headers.join(" | "),
            self.numeric
                .iter()
                .map(|&n| if n { " ---: " } else { " --- " })
                .collect::<Vec<_>>()
                .join("|")
        );
        for r in &self.rows {
            out.push_str(&format!(
                "| {} |\n",
                r.iter().map(|c| esc(c)).collect::<Vec<_>>().join(" | ")
            ));
        }
        out
    }
}

fn fmt_ratio(r: Option<f64>) -> String {
    r.map(|r| format!("{r:.2}x")).unwrap_or_default()
}

/// `78,123`.
pub fn thousands(v: f64) -> String {
    let n = v.round() as i64;
    let digits = n.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    if n < 0 {
        format!("-{out}")
    } else {
        out
    }
}

/// `+12`, `-3`, `0` (never `-0`).
fn signed_us(us: f64) -> String {
    if us.abs() < 0.5 {
        "0".to_string()
    } else {
        format!("{us:+.0}")
    }
}

fn cell_table(cells: &[CellResult], rounds: u32) -> Table {
    let present = |s: Setup| cells.iter().any(|c| c.setups.iter().any(|r| r.setup == s));
    let with_bouncer = present(Setup::Pgbouncer);
    let with_token_ratio =
        present(Setup::NoToken) && (present(Setup::SessionToken) || present(Setup::Sqlcommenter));
    let mut headers = vec![
        "cell",
        "configuration",
        "TPS",
        "mean ms",
        "p99 ms",
        "vs direct",
    ];
    if with_bouncer {
        headers.push("vs PgBouncer");
    }
    if with_token_ratio {
        headers.push("vs no token");
    }
    headers.extend([
        "+µs vs direct",
        "CPU µs/txn",
        "proxy CPU µs/txn",
        "server CPU µs/txn",
        "spread",
    ]);
    let numeric = headers
        .iter()
        .map(|h| !matches!(*h, "cell" | "configuration"))
        .collect();
    let mut rows = Vec::new();
    for c in cells {
        for (i, s) in c.setups.iter().enumerate() {
            let m = s.median;
            let mut row = vec![
                if i == 0 {
                    c.label.clone()
                } else {
                    String::new()
                },
                s.label.to_string(),
            ];
            match m {
                Some(m) => row.extend([
                    thousands(m.tps),
                    format!("{:.3}", m.mean_ms),
                    format!("{:.3}", m.p99_ms),
                ]),
                None => row.extend(["failed".to_string(), String::new(), String::new()]),
            }
            row.push(if s.setup == Setup::Direct {
                String::new()
            } else {
                fmt_ratio(c.tps_ratio(s.setup, Setup::Direct))
            });
            if with_bouncer {
                row.push(if s.setup == Setup::Pgbouncer {
                    String::new()
                } else {
                    fmt_ratio(c.tps_ratio(s.setup, Setup::Pgbouncer))
                });
            }
            if with_token_ratio {
                row.push(if s.setup.has_token() {
                    fmt_ratio(c.tps_ratio(s.setup, Setup::NoToken))
                } else {
                    String::new()
                });
            }
            row.push(if s.setup == Setup::Direct {
                String::new()
            } else {
                c.added_latency_us(s.setup, Setup::Direct)
                    .map(signed_us)
                    .unwrap_or_default()
            });
            let us = |v: Option<f64>| v.map(|v| format!("{v:.0}")).unwrap_or_default();
            row.push(us(m.and_then(|m| m.cpu_us)));
            row.push(us(m.and_then(|m| m.proxy_cpu_us)));
            row.push(us(m.and_then(|m| m.server_cpu_us)));
            let spread = m
                .map(|m| format!("{:.0}%", m.tps_spread * 100.0))
                .unwrap_or_default();
            row.push(if s.runs.len() < rounds as usize {
                format!("{spread} ({} of {rounds} rounds)", s.runs.len())
            } else {
                spread
            });
            rows.push(row);
        }
    }
    Table {
        headers,
        numeric,
        rows,
    }
}

fn stale_table(rows: &[StaleRow]) -> Table {
    let headers = vec![
        "writer",
        "protocol",
        "every write is",
        "per second",
        "mean ms",
        "p99 ms",
        "writes",
        "unexpected",
    ];
    let numeric = vec![false, false, false, true, true, true, true, true];
    let rows = rows
        .iter()
        .map(|r| {
            vec![
                r.scenario.to_string(),
                r.protocol.to_string(),
                r.expected.to_string(),
                thousands(r.per_sec),
                format!("{:.3}", r.mean_ms),
                format!("{:.3}", r.p99_ms),
                thousands(r.writes as f64),
                r.unexpected.to_string(),
            ]
        })
        .collect();
    Table {
        headers,
        numeric,
        rows,
    }
}

/// The issue's targets (issue 5), each with the figure this run measured.
///
/// A verdict compares medians of the rounds' paired values with the target, as the table
/// does. Each also says whether the run settles it: every figure is the median of a few
/// noisy rounds, so it carries the interval that holds the true median (`Estimate`), and
/// a verdict whose intervals reach across the target is "within this run's noise".
fn targets(r: &Report) -> Vec<String> {
    let mut out = Vec::new();
    let cells = &r.cells;
    let ratios = |num: Setup, den: Setup, filter: &dyn Fn(&CellResult) -> bool| {
        cells
            .iter()
            .filter(|c| filter(c))
            .filter_map(|c| c.tps_ratio_estimate(num, den).map(|e| (e, c)))
            .collect::<Vec<_>>()
    };
    let all = |_: &CellResult| true;
    // How often the side that should win did, round by round: a median below the target
    // with wins in about half the rounds is within the noise; with none, it is not.
    let won = |(k, n): (usize, usize)| format!("{k} of {n} rounds");
    let all_cells = ratios(Setup::NoToken, Setup::Pgbouncer, &all);
    if let Some((e, c)) = lowest(&all_cells) {
        out.push(format!(
            "pgfence without tokens >= PgBouncer in every cell (aim 1.25x): lowest {:.2}x \
             ({}; {}; pgfence at least as fast in {}) — {}",
            e.median,
            c.label,
            interval(e, 2),
            won(c.rounds_not_slower(Setup::NoToken, Setup::Pgbouncer)),
            at_least(&all_cells, 1.0, 2)
        ));
    }
    let tpcb = |c: &CellResult| c.cell.workload == Workload::TpcbLike;
    for (den, name) in [
        (Setup::NoToken, "pgfence without tokens"),
        (Setup::NoFence, "pgfence --no-fence"),
    ] {
        let all_tpcb = ratios(Setup::SessionToken, den, &tpcb);
        if let Some((e, c)) = lowest(&all_tpcb) {
            out.push(format!(
                "fenced TPC-B (session token) >= 0.90 of {name} (aim 0.95): lowest {:.2} \
                 ({}; {}) — {}",
                e.median,
                c.label,
                interval(e, 2),
                at_least(&all_tpcb, 0.90, 2)
            ));
        }
    }
    let select = |c: &CellResult| c.cell.workload == Workload::SelectOnly;
    let all_select = ratios(Setup::SessionToken, Setup::NoToken, &select);
    if let Some((e, c)) = lowest(&all_select) {
        out.push(format!(
            "select-only with a session token within 3% of without: lowest {:.3} ({}; {}) — {}",
            e.median,
            c.label,
            interval(e, 3),
            at_least(&all_select, 0.97, 3)
        ));
    }
    for c in cells.iter().filter(|c| c.cell.clients == 1) {
        let (Some(f), Some(b), Some(d)) = (
            c.added_latency_us(Setup::NoToken, Setup::Direct),
            c.added_latency_us(Setup::Pgbouncer, Setup::Direct),
            c.added_latency_estimate(Setup::NoToken, Setup::Pgbouncer),
        ) else {
            continue;
        };
        // pgfence's added latency minus PgBouncer's, round by round, is pgfence's latency
        // minus PgBouncer's: the direct runs cancel out.
        let i = d.interval;
        let verdict = verdict_at_most_zero(d);
        out.push(format!(
            "added latency at one client <= PgBouncer's (aim half), {}: pgfence {} µs, \
             PgBouncer {} µs; pgfence minus PgBouncer, round by round: median {} µs, \
             {:.0}% interval {} to {} µs (pgfence no later in {}) — {verdict}",
            c.label,
            signed_us(f),
            signed_us(b),
            signed_us(d.median),
            i.confidence * 100.0,
            signed_us(i.low),
            signed_us(i.high),
            won(c.rounds_not_later(Setup::NoToken, Setup::Pgbouncer)),
        ));
    }
    if let Some(m) = &r.memory {
        out.push(format!(
            "pgfence RSS with {} idle sessions < 64 KiB per session: {:.1} KiB per session \
             ({} KiB -> {} KiB) — {}",
            m.sessions,
            m.per_session_kib,
            m.rss_before_kib,
            m.rss_after_kib,
            if m.per_session_kib < 64.0 {
                "met"
            } else {
                "NOT met"
            }
        ));
    }
    out
}

/// The verdict on "pgfence minus PgBouncer at most 0", settled when the interval lies on
/// one side of 0.
fn verdict_at_most_zero(d: Estimate) -> &'static str {
    match (
        d.median <= 0.0,
        d.interval.high <= 0.0,
        d.interval.low > 0.0,
    ) {
        (true, true, _) => "met",
        (true, false, _) => "met, within this run's noise",
        (false, _, true) => "NOT met",
        (false, _, false) => "NOT met, within this run's noise",
    }
}

/// The cell with the lowest median.
fn lowest<'a>(estimates: &[(Estimate, &'a CellResult)]) -> Option<(Estimate, &'a CellResult)> {
    estimates
        .iter()
        .copied()
        .min_by(|a, b| a.0.median.total_cmp(&b.0.median))
}

/// "98% interval 0.89 to 1.02", with `digits` decimals.
fn interval(e: Estimate, digits: usize) -> String {
    let i = e.interval;
    format!(
        "{:.0}% interval {:.digits$} to {:.digits$}",
        i.confidence * 100.0,
        i.low,
        i.high
    )
}

/// The verdict on "at least `target` in every cell": met when every median reaches it;
/// settled when every interval does too (met), or when some interval lies wholly below it
/// (not met). That cell need not be the lowest one the line shows, so a settled "NOT met"
/// names it (the one whose interval ends lowest), with `digits` decimals.
fn at_least(estimates: &[(Estimate, &CellResult)], target: f64, digits: usize) -> String {
    let only: Vec<Estimate> = estimates.iter().map(|(e, _)| *e).collect();
    let verdict = verdict_at_least(&only, target);
    let below = estimates
        .iter()
        .filter(|(e, _)| e.interval.high < target)
        .min_by(|a, b| a.0.interval.high.total_cmp(&b.0.interval.high));
    match below {
        Some((e, c)) if verdict == "NOT met" => format!(
            "{verdict}, settled by {}: {:.digits$} ({})",
            c.label,
            e.median,
            interval(*e, digits)
        ),
        _ => verdict.to_string(),
    }
}

fn verdict_at_least(estimates: &[Estimate], target: f64) -> &'static str {
    let met = estimates.iter().all(|e| e.median >= target);
    if met {
        if estimates.iter().all(|e| e.interval.low >= target) {
            "met"
        } else {
            "met, within this run's noise"
        }
    } else if estimates.iter().any(|e| e.interval.high < target) {
        "NOT met"
    } else {
        "NOT met, within this run's noise"
    }
}

/// The terminal report.
pub fn text(r: &Report) -> String {
    let mut out = format!(
        "\n{}\n\nTPS: median of {} round(s) of {} s; mean and p99 latency: medians of the \
         rounds' values. Ratios and +µs: medians of the rounds' own ratios and differences \
         (the runs of a round ran back to back). CPU µs/txn: busy time of the whole machine (client, proxy, server) per \
         transaction; proxy CPU µs/txn: the proxy's own; server CPU µs/txn: PostgreSQL's \
         (medians of the rounds). \
         spread = (max - min) / median TPS.\n\n",
        r.command, r.rounds, r.duration_secs
    );
    out.push_str(&cell_table(&r.cells, r.rounds).text());
    if let Some(stale) = &r.stale {
        out.push_str("\nStale writer (one client, writes in a loop):\n\n");
        out.push_str(&stale_table(stale).text());
    }
    let t = targets(r);
    if !t.is_empty() {
        out.push_str("\nTargets (issue 5):\n");
        for line in t {
            out.push_str(&format!("  - {line}\n"));
        }
    }
    for n in &r.notes {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}

/// `results.md`.
pub fn markdown(r: &Report) -> String {
    let e = &r.environment;
    let mut out = format!(
        "# pgfence benchmark, {}\n\nReproduce:\n\n```sh\n{}\n```\n\n",
        r.started_utc, r.command
    );
    out.push_str(&format!(
        "- machine: {} CPUs, load average {} at the start and {} at the end; {}\n\
         - server: {} ({}); {}; {}\n\
         - pgfence: {}, {} worker thread(s); the proxies reach the server over {}\n\
         - pgbench scale {}, {} s per run, {} round(s) per configuration, interleaved\n\n",
        e.cpus,
        e.load_average_start,
        e.load_average_end,
        e.kernel,
        e.postgres,
        e.server,
        e.pgbench,
        e.pgbouncer
            .as_deref()
            .unwrap_or("PgBouncer not run (not installed, or not in --configs)"),
        e.pgfence_git.as_deref().unwrap_or("unknown commit"),
        e.pgfence_threads,
        e.proxy_upstream,
        r.scale,
        r.duration_secs,
        r.rounds,
    ));
    out.push_str("![TPS per configuration](chart.svg)\n\n## Throughput and latency\n\n");
    out.push_str(
        "TPS is the median over rounds; mean and p99 latency (from pgbench's \
         per-transaction log) are the medians of the rounds' values. Ratios divide TPS, \
         round by round (the configurations of one round ran back to back, each round in an \
         order rotated by one), and show the median of the rounds' ratios. \
         *vs no token*: the token-carrying configuration over pgfence without a token. \
         *+µs vs direct*: mean latency added to PostgreSQL's (median of the rounds' \
         differences). *CPU µs/txn*: busy time of the \
         whole machine (client, proxy, server) per transaction, *proxy CPU µs/txn*: the \
         proxy's own, *server CPU µs/txn*: PostgreSQL's, backends included (medians of the \
         rounds; on a CPU-bound machine these decide throughput, \
         and they move far less than TPS when the machine is noisy). *spread*: (max - min) / \
         median TPS over rounds. How to read it: docs/benchmarks.md.\n\n",
    );
    out.push_str(&cell_table(&r.cells, r.rounds).markdown());
    if let Some(stale) = &r.stale {
        out.push_str("\n## Stale writer\n\n");
        if let Some(t) = r.stale_tokens {
            out.push_str(&format!(
                "One client loops `UPDATE pgfence_bench_stale SET n = n + 1 WHERE id = 1` with \
                 session token {} for resource `bench-stale`, whose fence is {}. Per second: \
                 median over rounds; latency over every write.\n\n",
                t.stale, t.current
            ));
        }
        out.push_str(&stale_table(stale).markdown());
        for row in stale.iter().filter(|r| r.first_unexpected.is_some()) {
            out.push_str(&format!(
                "\nUnexpected outcome, {} ({}): {}\n",
                row.scenario,
                row.protocol,
                row.first_unexpected.as_deref().unwrap_or_default()
            ));
        }
    }
    let t = targets(r);
    if !t.is_empty() {
        out.push_str("\n## Targets (issue 5)\n\n");
        for line in t {
            out.push_str(&format!("- {line}\n"));
        }
    }
    if let Some(f) = &r.bench_fence_after {
        out.push_str(&format!(
            "\nFence of resource `bench` after the run: {f} (the fenced configurations went \
             through the check).\n"
        ));
    }
    let errors: Vec<String> = r
        .cells
        .iter()
        .flat_map(|c| {
            c.setups.iter().flat_map(move |s| {
                s.errors
                    .iter()
                    .map(move |e| format!("{} / {}: {}", c.label, s.label, first_line(e)))
            })
        })
        .collect();
    if !errors.is_empty() || !r.notes.is_empty() {
        out.push_str("\n## Notes\n\n");
        for e in errors.iter().chain(&r.notes) {
            out.push_str(&format!("- {e}\n"));
        }
    }
    out
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(78123.4), "78,123");
        assert_eq!(thousands(999.0), "999");
        assert_eq!(thousands(1_000_000.0), "1,000,000");
        assert_eq!(thousands(0.2), "0");
    }

    fn estimate(median: f64, low: f64, high: f64) -> Estimate {
        Estimate {
            median,
            interval: crate::stats::Interval {
                low,
                high,
                confidence: 0.984,
            },
        }
    }

    #[test]
    fn a_settled_miss_names_its_cell() {
        let cell = |label: &str| CellResult {
            cell: crate::plan::Cell {
                workload: crate::plan::Workload::TpcbLike,
                mode: crate::plan::Mode::Simple,
                clients: 8,
            },
            label: label.to_string(),
            setups: Vec::new(),
        };
        let (low, settled, fine) = (cell("lowest"), cell("settled"), cell("fine"));
        let lowest = estimate(0.90, 0.58, 1.37);
        let below = estimate(0.98, 0.92, 0.99);
        assert_eq!(
            at_least(&[(lowest, &low), (below, &settled)], 1.0, 2),
            "NOT met, settled by settled: 0.98 (98% interval 0.92 to 0.99)"
        );
        assert_eq!(
            at_least(
                &[(lowest, &low), (estimate(1.02, 0.95, 1.10), &fine)],
                1.0,
                2
            ),
            "NOT met, within this run's noise"
        );
    }

    #[test]
    fn verdicts_say_whether_the_run_settles_them() {
        let e = estimate;
        assert_eq!(verdict_at_least(&[e(1.05, 1.01, 1.10)], 1.0), "met");
        assert_eq!(
            verdict_at_least(&[e(1.05, 1.01, 1.10), e(1.02, 0.95, 1.09)], 1.0),
            "met, within this run's noise"
        );
        // One cell below with its whole interval below: settled, whatever the others say.
        assert_eq!(
            verdict_at_least(&[e(0.92, 0.88, 0.96), e(0.98, 0.90, 1.05)], 1.0),
            "NOT met"
        );
        assert_eq!(
            verdict_at_least(&[e(0.98, 0.90, 1.05), e(1.10, 1.05, 1.20)], 1.0),
            "NOT met, within this run's noise"
        );
        // The interval's end on the target counts as reaching it.
        assert_eq!(verdict_at_least(&[e(0.97, 0.97, 0.99)], 0.97), "met");
        assert_eq!(verdict_at_most_zero(e(-15.0, -40.0, -2.0)), "met");
        assert_eq!(
            verdict_at_most_zero(e(-15.0, -40.0, 9.0)),
            "met, within this run's noise"
        );
        assert_eq!(verdict_at_most_zero(e(62.0, 36.0, 102.0)), "NOT met");
        assert_eq!(
            verdict_at_most_zero(e(5.0, -25.0, 19.0)),
            "NOT met, within this run's noise"
        );
    }

    #[test]
    fn tables_align() {
        let t = Table {
            headers: vec!["a", "n"],
            numeric: vec![false, true],
            rows: vec![vec!["xx".into(), "1".into()], vec!["y".into(), "22".into()]],
        };
        assert_eq!(t.text(), "a    n\n--  --\nxx   1\ny   22\n");
        assert_eq!(
            t.markdown(),
            "| a | n |\n| --- | ---: |\n| xx | 1 |\n| y | 22 |\n"
        );
    }
}
