//! What pgfence knows of the server-side transaction, from the messages it sent and the
//! ReadyForQuery statuses it received, and where the commit-time check goes.
//!
//! The view is exact whenever nothing is in flight (the last ReadyForQuery tells). While
//! pipelined messages are in flight it is a prediction, and every prediction errs towards
//! checking: a check that runs in the middle of a transaction is harmless (it takes the same
//! lock the final check would, held until the transaction ends), a missed one is not.

use fence_core::classify::{Analysis, StatementKind};
use fence_core::directive::Directive;

/// The server-side transaction as pgfence sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum View {
    /// No transaction block is open.
    Idle,
    /// Inside a transaction block.
    InBlock,
    /// Inside a failed transaction block: every statement fails until it ends.
    Failed,
    /// Transaction control is in flight; the next ReadyForQuery will tell.
    Unknown,
}

/// Per-session transaction tracking.
#[derive(Debug)]
pub struct TxState {
    pub view: View,
    /// A statement that may write was sent since the last check or transaction end.
    pub dirty: bool,
    /// Fencing directives of the statements sent in the current transaction.
    pub directives: Vec<Directive>,
    /// A sync point went upstream with `directives` while pgfence could not tell whether
    /// its transaction ends there (transaction control in flight): they belong to the
    /// next statement only if a block is still open. Until a ReadyForQuery tells, what may
    /// be checked waits where it can (see `Session::directives_in_doubt`).
    pub directives_in_doubt: bool,
    /// An Execute was sent since the last Sync (the extended protocol's implicit
    /// transaction may already hold writes).
    pub batch_has_execute: bool,
    /// A Bind was sent since the last sync point: it may have run code (planning folds
    /// `IMMUTABLE` calls, a domain parameter's `CHECK` runs), and written.
    pub batch_has_bind: bool,
    /// The portals bound since the batch's last Execute that ended its transaction (a
    /// `COMMIT`, `ROLLBACK`, `PREPARE TRANSACTION`, `COMMIT PREPARED`, or a statement
    /// PostgreSQL commits at once), or since its sync point: a Sync of pgfence's would end
    /// them.
    pub bound_since_end: Bound,
    /// An Execute since the last Sync ran a statement after which PostgreSQL refuses one
    /// that cannot run in a transaction block "within a pipeline" (its
    /// `XACT_FLAGS_PIPELINING`): any but an empty statement or transaction control, which
    /// leave the flag as it was, and none of `COMMIT`, `ROLLBACK`, `PREPARE TRANSACTION`,
    /// `COMMIT PREPARED` or `ROLLBACK PREPARED` after it (they end the transaction, and the
    /// next one starts without the flag). A `VACUUM` behind only those runs, as behind no
    /// Execute.
    pub batch_pipelined: bool,
    /// The last transaction control sent since the last sync point is a `BEGIN`: at the
    /// next Sync nothing commits (see [`TxState::sync_needs_check`]).
    pub batch_begun: bool,
    /// Check read-only statements too (`fence.skip_read_only = false`, or the read audit's
    /// verdict: see `Session::apply_read_audit`).
    pub check_reads: bool,
    /// The session's reads follow the read audit (it asks, whatever the answer was): its
    /// own DDL makes it check them.
    pub audited: bool,
    /// A statement that [changes the schema](fence_core::classify::Statement::changes_schema)
    /// was sent while `audited`: the session checks its reads from then on. (Whatever
    /// the answer then: a session that had no answer yet, or found no schema `pgfence`,
    /// and made a temporary view after `pgfence install`, would otherwise take the audit's
    /// false, which leaves temporary relations out.)
    pub schema_changed: bool,
}

/// Which portals were bound since a point of the batch (see [`TxState::bound_since_end`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bound {
    Nothing,
    /// Only the unnamed portal, which the next Bind of it replaces.
    Unnamed,
    /// A named portal.
    Named,
}

/// Where a simple Query needs checks.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct SimplePlan {
    /// Byte offsets in the SQL text before which a check statement is inserted, with the
    /// index of the client statement there.
    pub before: Vec<(usize, usize)>,
    /// A check goes after the last statement (the implicit transaction ends there).
    pub at_end: bool,
    /// Whether a block is open after the Query (`None`: not known), as planned.
    pub ends_in_block: Option<bool>,
}

impl SimplePlan {
    pub fn is_empty(&self) -> bool {
        self.before.is_empty() && !self.at_end
    }
}

impl TxState {
    pub fn new(check_reads: bool) -> TxState {
        TxState {
            view: View::Idle,
            dirty: false,
            directives: Vec::new(),
            directives_in_doubt: false,
            batch_has_execute: false,
            batch_has_bind: false,
            bound_since_end: Bound::Nothing,
            batch_pipelined: false,
            batch_begun: false,
            check_reads,
            audited: false,
            schema_changed: false,
        }
    }

    /// [`TxState::new`], for a session whose reads follow the read audit (`audited`).
    pub fn with_audit(check_reads: bool, audited: bool) -> TxState {
        TxState {
            audited,
            ..TxState::new(check_reads)
        }
    }

    /// A statement that changes the schema is being sent: where reads follow the read
    /// audit, they are checked from here (in this Query, too) to the session's end. The
    /// audit leaves out temporary relations, which only their session reads through, and
    /// the text does not tell whether the object is one or hangs on one (a policy on a
    /// temporary table): asking again would not do.
    #[cold]
    pub fn note_schema_change(&mut self) {
        if self.audited {
            self.check_reads = true;
            self.schema_changed = true;
        }
    }

    /// A Bind of a statement of this kind (`None`: one pgfence does not know), with
    /// `params` parameter values, is being sent. Binding plans the statement, which runs
    /// the `IMMUTABLE` functions it calls with constant arguments, and converts its
    /// parameters, which runs a domain's `CHECK`: either may call a function that writes,
    /// with no Execute after it. The transaction is written as by an Execute of the
    /// statement, so the batch's Sync is checked. Whatever the statement, its parameters
    /// are converted (a Parse may declare types its text never uses, even for `COMMIT` or
    /// an empty statement): like a read, that is checked where reads are (the read audit
    /// finds a domain whose `CHECK` calls a function).
    pub fn on_bind(&mut self, kind: Option<StatementKind>, params: usize) {
        self.batch_has_bind = true;
        match kind {
            Some(StatementKind::MayWrite) | None => self.dirty = true,
            Some(StatementKind::ReadOnly) => self.dirty |= self.check_reads,
            Some(_) => self.dirty |= params != 0 && self.check_reads,
        }
    }

    /// An Execute of a statement of this kind is being sent (see [`TxState::on_statement`]
    /// for what it does to the transaction).
    pub fn on_execute(&mut self, kind: StatementKind) {
        self.batch_has_execute = true;
        match kind {
            // PostgreSQL's `StartTransaction` clears the flag: after one of these succeeds
            // the next statement runs in a new transaction (if it fails, the server skips
            // the rest of the batch).
            StatementKind::Commit
            | StatementKind::Rollback
            | StatementKind::PrepareTransaction
            | StatementKind::FinishPrepared => {
                self.batch_pipelined = false;
                self.bound_since_end = Bound::Nothing;
            }
            StatementKind::Empty
            | StatementKind::Begin
            | StatementKind::Savepoint
            | StatementKind::RollbackToSavepoint => {}
            StatementKind::ReadOnly
            | StatementKind::MayWrite
            | StatementKind::NonTransactional
            | StatementKind::Discard
            | StatementKind::Execute => self.batch_pipelined = true,
        }
    }

    /// A sync point (Sync, Query, FunctionCall) ends the batch's implicit transaction.
    pub fn end_batch(&mut self) {
        self.batch_has_execute = false;
        self.batch_has_bind = false;
        self.bound_since_end = Bound::Nothing;
        self.batch_pipelined = false;
    }

    /// A statement of this kind is being sent (extended protocol Execute).
    pub fn on_statement(&mut self, kind: StatementKind) {
        match kind {
            StatementKind::Begin => {
                self.view = View::Unknown;
                self.batch_begun = true;
            }
            StatementKind::Commit | StatementKind::PrepareTransaction | StatementKind::Rollback => {
                self.end();
                self.view = View::Unknown;
                self.batch_begun = false;
            }
            // Outside a block it only fails: nothing to check, and a check added to it would
            // change how it fails.
            StatementKind::RollbackToSavepoint => {
                self.dirty |= self.view != View::Idle;
                if self.view == View::Failed {
                    // The block lives again, with what it wrote before the savepoint: a
                    // COMMIT after it commits that. (If it fails, no savepoint of that
                    // name, what follows is skipped anyway.)
                    self.view = View::InBlock;
                }
            }
            StatementKind::MayWrite | StatementKind::NonTransactional => self.dirty = true,
            // Anything, a COMMIT included (its check went before it): what follows may be in
            // the same transaction, a new one or none.
            StatementKind::Execute => {
                self.dirty = true;
                self.view = View::Unknown;
                self.batch_begun = false;
            }
            StatementKind::ReadOnly => self.dirty |= self.check_reads,
            // `DISCARD ALL` cannot run in a block, so nothing may be appended to it; it writes
            // nothing a fence protects.
            StatementKind::Savepoint
            | StatementKind::Empty
            | StatementKind::FinishPrepared
            | StatementKind::Discard => {}
        }
    }

    /// Adds a statement's fencing directives to the transaction's. A directive equal to one
    /// already there changes nothing in the check (same resource, same token), so it is
    /// kept once: a client that comments every statement alike sends one, not one per
    /// statement, and the check can take its hot path.
    #[inline]
    pub fn add_directives(&mut self, directives: &[Directive]) {
        if directives.is_empty() {
            // Almost every statement: no call, no loop.
            return;
        }
        self.add_each(directives);
    }

    #[inline(never)]
    fn add_each(&mut self, directives: &[Directive]) {
        for d in directives {
            if !self.directives.contains(d) {
                self.directives.push(d.clone());
            }
        }
    }

    /// Forgets what the ended transaction carried.
    pub fn end(&mut self) {
        self.dirty = false;
        self.directives.clear();
        self.directives_in_doubt = false;
    }

    /// A sync point goes upstream while the transaction's end there is not known: its
    /// directives, if any, are in doubt until a ReadyForQuery tells.
    pub fn sync_point_in_doubt(&mut self) {
        self.directives_in_doubt |= !self.directives.is_empty();
    }

    /// Whether a COMMIT sent now needs a check before it.
    pub fn commit_needs_check(&self) -> bool {
        self.dirty && self.view != View::Failed
    }

    /// Whether where the check goes around a statement of `kind` depends on what the
    /// replies in flight may still change: whether the block has failed (the COMMIT of a
    /// failed block is a ROLLBACK, and a check before it would fail with 25P02 and make the
    /// server skip what follows it), or whether a block is open at all (a check after
    /// `SAVEPOINT`, `RELEASE` or `ROLLBACK TO SAVEPOINT` outside one changes how it fails:
    /// in an implicit block of several statements rather than alone).
    pub fn placement_depends_on_replies(&self, kind: StatementKind) -> bool {
        match kind {
            StatementKind::Commit | StatementKind::PrepareTransaction | StatementKind::Execute => {
                self.dirty && matches!(self.view, View::InBlock | View::Unknown)
            }
            StatementKind::RollbackToSavepoint => self.view == View::Unknown,
            StatementKind::Savepoint => self.dirty && self.view == View::Unknown,
            _ => false,
        }
    }

    /// Whether a Sync sent now may end a transaction that wrote. Not after a `BEGIN` of its
    /// batch with no transaction control after it: either the `BEGIN` ran, and the block
    /// (which holds what the batch wrote before it too) goes on past the Sync, to a COMMIT
    /// that is checked; or an error skipped it, and the Sync rolls back. A check there would
    /// run in the block, where `SET TRANSACTION ISOLATION LEVEL` must come first. Nor when
    /// the batch bound and executed nothing: every sync point ends the implicit
    /// transaction, so what the session wrote before it and is still unchecked is in a
    /// block (or was rolled back), and Parse, Describe and Close run no code of the
    /// database's. (A Bind may: see [`TxState::on_bind`].)
    pub fn sync_needs_check(&self) -> bool {
        self.dirty
            && (self.batch_has_execute || self.batch_has_bind)
            && !self.batch_begun
            && !matches!(self.view, View::InBlock | View::Failed)
    }

    /// A ReadyForQuery arrived; `settled` when nothing else is in flight.
    pub fn on_ready(&mut self, status: u8, settled: bool) {
        if !settled {
            return;
        }
        self.directives_in_doubt = false;
        self.view = match status {
            b'T' => View::InBlock,
            b'E' => View::Failed,
            _ => View::Idle,
        };
        if self.view == View::Idle {
            // A Bind sent after the sync point this answers may have written already, in
            // the transaction it started (see `on_bind`): that stays to be checked.
            let bound = self.batch_has_bind && self.dirty;
            self.end();
            self.dirty = bound;
        }
    }

    /// Plans the checks of a simple Query and updates the state as if it was sent.
    pub fn plan_simple(&mut self, analysis: &Analysis) -> SimplePlan {
        let mut plan = SimplePlan::default();
        if analysis.statements.is_empty() {
            // An empty query ends no transaction (a dirty one is a block still open, checked
            // at its COMMIT), and a check added to it would take its EmptyQueryResponse.
            return plan;
        }
        // `None`: not known whether a block is open. Behind an Executed `BEGIN` of the
        // batch (still unsynced) one is: if that `BEGIN` failed, the server skips this
        // Query too. (A check appended there took a snapshot in the block, and the
        // client's `BEGIN ISOLATION LEVEL SERIALIZABLE` after it failed 25001; random
        // FunctionCalls seed 34086, older than stop 54.)
        let mut in_block = match self.view {
            View::Idle => Some(false),
            View::InBlock | View::Failed => Some(true),
            View::Unknown if self.batch_begun => Some(true),
            View::Unknown => None,
        };
        if let [only] = &*analysis.statements {
            let savepoint = matches!(
                only.kind,
                StatementKind::Savepoint | StatementKind::RollbackToSavepoint
            );
            if (only.block_sensitive || savepoint) && in_block != Some(true) {
                // A check after it would make the Query an implicit block, where it does
                // something else than alone outside one (`LOCK` runs, `SET LOCAL` does not
                // warn, `DISCARD ALL` fails, the savepoint commands fail elsewhere). Alone
                // outside a block it writes nothing: it fails, warns, or resets the
                // session. Inside a block (if a `BEGIN` in flight opened one) the COMMIT
                // is checked; and if none is open, what made the session dirty never ran
                // (it was planned in the block that `BEGIN` was to open, and a `BEGIN`
                // fails only in a failed block), or was checked before this Query (sent
                // inside an extended-protocol batch, where pgfence cannot wait for the
                // state: see `Session::inside_batch`). A `SAVEPOINT` or `RELEASE` leaves the
                // session as clean as it was.
                self.dirty |= in_block.is_none() && only.kind != StatementKind::Savepoint;
                plan.ends_in_block = in_block;
                return plan;
            }
        }
        let mut failed = self.view == View::Failed;
        let mut control = false;
        for (i, st) in analysis.statements.iter().enumerate() {
            match st.kind {
                StatementKind::Begin => {
                    in_block = Some(true);
                    control = true;
                }
                StatementKind::Commit | StatementKind::PrepareTransaction => {
                    if self.dirty && !failed {
                        plan.before.push((st.start, i));
                    }
                    self.dirty = false;
                    in_block = Some(false);
                    failed = false;
                    control = true;
                }
                StatementKind::Execute => {
                    // It may be a COMMIT: checked before it as one. It may also have
                    // written, opened a block or ended one.
                    if self.dirty && !failed {
                        plan.before.push((st.start, i));
                    }
                    self.dirty = true;
                    in_block = None;
                    failed = false;
                    control = true;
                }
                StatementKind::Rollback => {
                    self.dirty = false;
                    in_block = Some(false);
                    failed = false;
                    control = true;
                }
                StatementKind::RollbackToSavepoint => {
                    self.dirty |= in_block != Some(false);
                    failed = false;
                }
                StatementKind::MayWrite | StatementKind::NonTransactional => self.dirty = true,
                StatementKind::ReadOnly => self.dirty |= self.check_reads,
                StatementKind::Savepoint
                | StatementKind::Empty
                | StatementKind::FinishPrepared
                | StatementKind::Discard => {}
            }
        }
        if self.dirty && in_block != Some(true) {
            plan.at_end = true;
            self.dirty = false;
        }
        plan.ends_in_block = in_block;
        if control || (self.view == View::Failed && !failed) {
            // A `ROLLBACK TO SAVEPOINT` revives a failed block, unless it fails itself (no
            // such savepoint): the next ReadyForQuery tells, and a COMMIT sent before it
            // waits for it (see `placement_depends_on_replies`).
            self.view = View::Unknown;
        }
        plan
    }
}

#[cfg(test)]
mod tests {
    use super::TxState;
    use fence_core::classify::StatementKind;

    /// PostgreSQL sets its pipelining flag at an Execute of anything but an empty statement
    /// or transaction control, and a sync point ends it.
    #[test]
    fn only_executes_of_statements_pipeline_a_batch() {
        let mut tx = TxState::new(false);
        for kind in [
            StatementKind::Empty,
            StatementKind::Begin,
            StatementKind::Commit,
            StatementKind::Rollback,
            StatementKind::PrepareTransaction,
            StatementKind::Savepoint,
            StatementKind::RollbackToSavepoint,
            StatementKind::FinishPrepared,
        ] {
            tx.on_execute(kind);
            assert!(tx.batch_has_execute);
            assert!(!tx.batch_pipelined, "{kind:?}");
        }
        for kind in [
            StatementKind::ReadOnly,
            StatementKind::MayWrite,
            StatementKind::NonTransactional,
            StatementKind::Discard,
            StatementKind::Execute,
        ] {
            tx.end_batch();
            assert!(!tx.batch_has_execute && !tx.batch_pipelined);
            tx.on_execute(kind);
            tx.on_execute(StatementKind::Empty);
            assert!(tx.batch_pipelined, "{kind:?}");
        }
    }

    /// A statement behind a `COMMIT` or `ROLLBACK` of its batch runs in a new transaction,
    /// which PostgreSQL starts without the pipelining flag; a `BEGIN` or a savepoint command
    /// keeps the transaction, and the flag.
    #[test]
    fn ending_the_transaction_ends_the_pipelining() {
        let mut tx = TxState::new(false);
        for end in [
            StatementKind::Commit,
            StatementKind::Rollback,
            StatementKind::PrepareTransaction,
            StatementKind::FinishPrepared,
        ] {
            tx.on_execute(StatementKind::MayWrite);
            assert!(tx.batch_pipelined);
            tx.on_execute(end);
            assert!(tx.batch_has_execute && !tx.batch_pipelined, "{end:?}");
        }
        for keep in [
            StatementKind::Begin,
            StatementKind::Savepoint,
            StatementKind::RollbackToSavepoint,
            StatementKind::Empty,
        ] {
            tx.on_execute(StatementKind::ReadOnly);
            tx.on_execute(keep);
            assert!(tx.batch_pipelined, "{keep:?}");
        }
    }
}
