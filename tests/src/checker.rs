//! The fencing invariant of SPEC section 4, checked over what a PostgreSQL server actually
//! committed. Every concurrency test of the fence (directly against PostgreSQL, or through
//! the proxy) ends with this check.
//!
//! **The invariant**: for each resource, ordered by commit, the tokens of committed write
//! transactions never decrease; and no transaction commits with a token lower than the fence
//! at its commit.
//!
//! **Commit order** is the commit timestamp, `pg_xact_commit_timestamp(xmin)` (the server
//! needs `track_commit_timestamp = on`), in microseconds. Two conflicting transactions are
//! ordered by the fence's row lock: the second one takes its commit timestamp only after the
//! first released its locks, i.e. after the first took its own. Unrelated transactions can
//! still **tie** at microsecond resolution. Ties are resolved in the order most favourable to
//! the system under test (within a group of equal timestamps the tokens may come in any
//! order, so only comparisons with strictly earlier commits count), and every tie group that
//! contains different tokens is counted in [`InvariantReport::ambiguous_ties`] so a test can
//! show how much this leniency could hide (it should be 0 or close to it). A wall clock
//! stepping backwards during a run would also confuse the order; the tests assume it does not.
//!
//! **The fence at a commit** is the highest `new_token` of `pgfence.history` rows committed
//! strictly before it (the history row of a transaction's own advance has the same
//! timestamp and the same token, so it neither helps nor hurts).
//!
//! The functions are pure over plain rows ([`check_invariant`]) with a loader for the usual
//! case ([`check_database`]), so the end-to-end test through the proxy can reuse them.

use std::collections::BTreeMap;
use std::fmt;

/// SQL for the commit time of the row version's inserting transaction, in microseconds
/// since the epoch (NULL if the server did not record it). Use it on insert-only tables:
/// an UPDATE gives the row the updater's `xmin`.
pub const COMMIT_US_SQL: &str =
    "(extract(epoch FROM pg_catalog.pg_xact_commit_timestamp(xmin)) * 1000000)::bigint";

/// One committed write transaction (one row of the test's insert-only table).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommittedWrite {
    /// The resource the write was fenced on.
    pub resource: String,
    /// The token the writer used.
    pub token: i64,
    /// Commit timestamp in microseconds (see [`COMMIT_US_SQL`]).
    pub commit_us: i64,
}

/// One committed fence advance: a row of `pgfence.history`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FenceAdvance {
    /// The resource whose fence moved.
    pub resource: String,
    /// The fence after the advance.
    pub new_token: i64,
    /// Commit timestamp of the advancing transaction, in microseconds.
    pub commit_us: i64,
}

/// What [`check_invariant`] found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct InvariantReport {
    /// Committed writes examined.
    pub writes: usize,
    /// Fence advances examined.
    pub advances: usize,
    /// Writes whose token is lower than that of a write committed strictly before them.
    pub decreases: usize,
    /// Writes whose token is lower than the fence committed strictly before them.
    pub below_fence: usize,
    /// Groups of writes (and advances) with the same commit timestamp and different tokens:
    /// ordered favourably, see the module documentation.
    pub ambiguous_ties: usize,
    /// Rows without a commit timestamp (not examined; `track_commit_timestamp` off?).
    pub missing_commit_ts: usize,
    /// The first few violations, described for a failure message.
    pub examples: Vec<String>,
}

impl InvariantReport {
    /// Number of invariant violations: 0 is the only acceptable value for a fenced workload.
    pub fn violations(&self) -> usize {
        self.decreases + self.below_fence
    }

    fn example(&mut self, text: String) {
        if self.examples.len() < 10 {
            self.examples.push(text);
        }
    }
}

impl fmt::Display for InvariantReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} writes, {} fence advances: {} violations ({} token decreases, {} below the fence), \
             {} ambiguous commit-timestamp ties",
            self.writes,
            self.advances,
            self.violations(),
            self.decreases,
            self.below_fence,
            self.ambiguous_ties
        )?;
        if self.missing_commit_ts > 0 {
            write!(
                f,
                ", {} rows without commit timestamp",
                self.missing_commit_ts
            )?;
        }
        for example in &self.examples {
            write!(f, "\n  {example}")?;
        }
        Ok(())
    }
}

/// Checks the invariant over committed writes and fence advances of any number of
/// resources. Input order does not matter.
pub fn check_invariant(writes: &[CommittedWrite], advances: &[FenceAdvance]) -> InvariantReport {
    let mut report = InvariantReport {
        writes: writes.len(),
        advances: advances.len(),
        ..InvariantReport::default()
    };
    // Per resource: commit timestamp -> tokens of the writes / advances committed then.
    type Timeline = BTreeMap<i64, (Vec<i64>, Vec<i64>)>;
    let mut timelines: BTreeMap<&str, Timeline> = BTreeMap::new();
    for w in writes {
        let at = timelines
            .entry(&w.resource)
            .or_default()
            .entry(w.commit_us)
            .or_default();
        at.0.push(w.token);
    }
    for a in advances {
        let at = timelines
            .entry(&a.resource)
            .or_default()
            .entry(a.commit_us)
            .or_default();
        at.1.push(a.new_token);
    }
    for (resource, timeline) in &timelines {
        // Highest write token and highest fence committed strictly before the current group.
        let mut max_write: Option<(i64, i64)> = None; // (token, commit_us)
        let mut fence: Option<(i64, i64)> = None;
        for (&commit_us, (tokens, fences)) in timeline {
            let lowest = tokens.iter().copied().min();
            let highest = tokens.iter().copied().max();
            let distinct_writes = lowest != highest;
            let fence_above_a_write = match (lowest, fences.iter().copied().max()) {
                (Some(low), Some(f)) => f > low,
                _ => false,
            };
            if distinct_writes || fence_above_a_write {
                report.ambiguous_ties += 1;
            }
            for &token in tokens {
                if let Some((max, at)) = max_write.filter(|&(max, _)| token < max) {
                    report.decreases += 1;
                    report.example(format!(
                        "resource {resource:?}: token {token} committed at {commit_us} after \
                         token {max} committed at {at}"
                    ));
                }
                if let Some((f, at)) = fence.filter(|&(f, _)| token < f) {
                    report.below_fence += 1;
                    report.example(format!(
                        "resource {resource:?}: token {token} committed at {commit_us} below \
                         the fence {f} advanced at {at}"
                    ));
                }
            }
            if let Some(high) = highest {
                if !matches!(max_write, Some((max, _)) if max >= high) {
                    max_write = Some((high, commit_us));
                }
            }
            if let Some(high) = fences.iter().copied().max() {
                if !matches!(fence, Some((f, _)) if f >= high) {
                    fence = Some((high, commit_us));
                }
            }
        }
    }
    report
}

/// Loads committed writes with `writes_sql` and the fence advances from `pgfence.history`,
/// then runs [`check_invariant`]. `writes_sql` must return `(resource text, token bigint,
/// commit_us bigint)` rows, e.g.
/// `format!("SELECT resource, token, {COMMIT_US_SQL} FROM writes")`.
pub async fn check_database(
    client: &tokio_postgres::Client,
    writes_sql: &str,
) -> Result<InvariantReport, tokio_postgres::Error> {
    let mut missing = 0;
    let mut writes = Vec::new();
    for row in client.query(writes_sql, &[]).await? {
        match row.get::<_, Option<i64>>(2) {
            Some(commit_us) => writes.push(CommittedWrite {
                resource: row.get(0),
                token: row.get(1),
                commit_us,
            }),
            None => missing += 1,
        }
    }
    let history_sql = format!("SELECT resource, new_token, {COMMIT_US_SQL} FROM pgfence.history");
    let mut advances = Vec::new();
    for row in client.query(history_sql.as_str(), &[]).await? {
        match row.get::<_, Option<i64>>(2) {
            Some(commit_us) => advances.push(FenceAdvance {
                resource: row.get(0),
                new_token: row.get(1),
                commit_us,
            }),
            None => missing += 1,
        }
    }
    let mut report = check_invariant(&writes, &advances);
    report.missing_commit_ts = missing;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(resource: &str, token: i64, commit_us: i64) -> CommittedWrite {
        CommittedWrite {
            resource: resource.to_owned(),
            token,
            commit_us,
        }
    }

    fn a(resource: &str, new_token: i64, commit_us: i64) -> FenceAdvance {
        FenceAdvance {
            resource: resource.to_owned(),
            new_token,
            commit_us,
        }
    }

    #[test]
    fn clean_history_passes() {
        let writes = [w("r", 1, 10), w("r", 1, 11), w("r", 2, 12), w("r", 2, 13)];
        let advances = [a("r", 1, 10), a("r", 2, 12)];
        let report = check_invariant(&writes, &advances);
        assert_eq!(report.violations(), 0, "{report}");
        assert_eq!(report.ambiguous_ties, 0);
    }

    #[test]
    fn decrease_is_found_in_any_input_order() {
        let writes = [w("r", 1, 30), w("r", 2, 20), w("r", 1, 10)];
        let report = check_invariant(&writes, &[]);
        assert_eq!(report.decreases, 1, "{report}");
        assert_eq!(report.examples.len(), 1);
    }

    #[test]
    fn below_fence_is_found() {
        let report = check_invariant(&[w("r", 3, 20)], &[a("r", 5, 10)]);
        assert_eq!(report.below_fence, 1, "{report}");
        assert_eq!(report.decreases, 0);
    }

    #[test]
    fn resources_are_independent() {
        let writes = [w("a", 5, 10), w("b", 1, 20)];
        let report = check_invariant(&writes, &[a("a", 5, 10)]);
        assert_eq!(report.violations(), 0, "{report}");
    }

    #[test]
    fn ties_are_ordered_favourably_and_counted() {
        let writes = [w("r", 2, 10), w("r", 1, 10), w("r", 2, 11)];
        let report = check_invariant(&writes, &[a("r", 2, 10)]);
        assert_eq!(report.violations(), 0, "{report}");
        assert_eq!(report.ambiguous_ties, 1);
        // A later commit still has to respect the tie group's highest token.
        let report = check_invariant(&[w("r", 2, 10), w("r", 1, 10), w("r", 1, 11)], &[]);
        assert_eq!(report.decreases, 1, "{report}");
    }
}

/// The isolation level a checker workload runs its transactions at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Level {
    ReadCommitted,
    RepeatableRead,
    Serializable,
}

impl Level {
    /// The `BEGIN` that opens a transaction at this level.
    pub fn begin(self) -> &'static str {
        match self {
            Level::ReadCommitted => "BEGIN ISOLATION LEVEL READ COMMITTED",
            Level::RepeatableRead => "BEGIN ISOLATION LEVEL REPEATABLE READ",
            Level::Serializable => "BEGIN ISOLATION LEVEL SERIALIZABLE",
        }
    }
}

/// The lease service of a checker workload: hands out a new leader token at random moments
/// (every 1 to 30 ms) until `deadline`.
pub async fn advance_leader_until(
    leader: &std::sync::atomic::AtomicI64,
    deadline: std::time::Instant,
) {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::StdRng::from_entropy();
    while std::time::Instant::now() < deadline {
        let pause = std::time::Duration::from_micros(rng.gen_range(1_000..30_000));
        tokio::time::sleep(pause).await;
        leader.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}
