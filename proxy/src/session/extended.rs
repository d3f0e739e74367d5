//! The extended protocol's Parse, Bind, Execute and Close: what each statement and portal
//! name stands for (so that an Execute knows what it runs), and the check placed before
//! an Execute that commits.

use std::sync::Arc;

use fence_core::classify::StatementKind;
use fence_core::directive::Directive;
use fence_core::lexer::{LexOptions, Lexer, TokKind};

use crate::error::SessionError;
use crate::protocol::message as msg;

use super::query::is_copy_from_stdin;
use super::replies::{AfterCheck, Request};
use super::tx::{Bound, View};
use super::{CommitCheck, CopyFromClient, CopyIn, Flow, Hold, Prepared, Remembered, Session};

/// The prepared statement a SQL `PREPARE name AS ...` replaces.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PreparedInSql {
    /// Not a `PREPARE` (or a malformed one).
    No,
    Name(Box<[u8]>),
    /// A name pgfence does not spell as the server would (`U&"..."`, too long to compare,
    /// bytes the server may fold): any name.
    Unknown,
}

/// The name a SQL `PREPARE name ...` statement (`sql`, see
/// `fence_core::classify::Statement::prepares_in_sql`) prepares. The proxy forgets what it
/// knew of that name: the server's statement of it is now the one prepared in SQL, or after
/// a `PREPARE` that failed (the name in use) the one it had. (A statement that `DEALLOCATE`
/// or `DISCARD ALL` drops changes nothing pgfence relies on: a name it still knows is only
/// ever run again after a `PREPARE`, or after a Parse it sees.)
pub(super) fn prepared_in_sql(sql: &[u8], options: LexOptions) -> PreparedInSql {
    let Some(name) = Lexer::with_options(sql, options)
        .filter(|t| !matches!(t.kind, TokKind::Comment { .. }))
        .nth(1)
    else {
        return PreparedInSql::No; // a syntax error
    };
    spelled_name(name.kind, name.text(sql))
}

/// A statement name as the server spells it, from its token (see [`prepared_in_sql`]).
fn spelled_name(kind: TokKind, text: &[u8]) -> PreparedInSql {
    let spelled: Option<Vec<u8>> = match kind {
        // Folded to lower case; PostgreSQL may fold bytes >= 0x80 too, in single-byte
        // encodings.
        TokKind::Ident if text.is_ascii() => Some(text.to_ascii_lowercase()),
        TokKind::QuotedIdent => text
            .strip_prefix(b"\"")
            .and_then(|t| t.strip_suffix(b"\""))
            .map(|inner| {
                let mut unquoted = Vec::with_capacity(inner.len());
                let mut doubled = false;
                for &b in inner {
                    doubled = b == b'"' && !doubled;
                    if !doubled {
                        unquoted.push(b);
                    }
                }
                unquoted
            }),
        _ => None,
    };
    // PostgreSQL compares names by their first NAMEDATALEN - 1 (63) bytes.
    match spelled {
        Some(n) if !n.is_empty() && n.len() < 63 => PreparedInSql::Name(n.into()),
        _ => PreparedInSql::Unknown,
    }
}

/// Whether running `p` may prepare a statement in SQL: a `PREPARE`, or an `EXECUTE` of
/// another statement, which may be one.
fn may_prepare(p: &Prepared) -> bool {
    !matches!(p.prepares, PreparedInSql::No) || executes_in_sql(p)
}

/// Whether running `p` commits the transaction it runs in as it runs, before anything of
/// pgfence's after it could check that transaction: a statement that cannot run in a
/// transaction block and does not run in one alike (`VACUUM`, `CREATE INDEX CONCURRENTLY`,
/// `CREATE DATABASE`, ..., not `ANALYZE`, `REINDEX` or `CLUSTER` of one table), `DISCARD
/// ALL`, `COMMIT PREPARED` or `ROLLBACK PREPARED`.
fn commits_as_it_runs(p: &Prepared) -> bool {
    matches!(&*p.analysis.statements, [only]
        if only.commits_at_once
            || only.kind == StatementKind::FinishPrepared
            || (only.kind == StatementKind::NonTransactional
                && !only.runs_in_block
                && !only.may_commit_inside))
}

/// Whether `p` is a SQL `EXECUTE`.
fn executes_in_sql(p: &Prepared) -> bool {
    p.analysis
        .statements
        .iter()
        .any(|s| s.kind == StatementKind::Execute)
}

impl Session {
    /// Forwards a Parse or Bind of statement or portal `name`, which stood for `before` (see
    /// `Pending::name`).
    fn forward_named(
        &mut self,
        frame: &[u8],
        request: Request,
        name: &[u8],
        before: Option<Arc<Prepared>>,
    ) {
        self.to_server.extend_from_slice(frame);
        self.replies.push_named(request, name, before);
    }

    pub(super) fn prepared(&mut self, sql: &[u8]) -> Arc<Prepared> {
        let analysis = self.analyze(sql);
        Arc::new(Prepared {
            sql: sql.into(),
            copy_in: is_copy_from_stdin(sql, self.lex),
            prepares: if analysis.prepares_in_sql {
                prepared_in_sql(sql, self.lex)
            } else {
                PreparedInSql::No
            },
            tx_control: analysis.tx_control(),
            analysis,
        })
    }

    /// The comment directives of the prepared statement that `EXPLAIN ... EXECUTE name` or
    /// `CREATE TABLE ... AS EXECUTE name` (`text`) runs, if it has any: they are its own,
    /// as at an `EXECUTE` (see [`Session::executed_directives`]). Looked for only once a
    /// statement parsed under a name had comments.
    pub(super) fn executed_inside(&self, text: &[u8]) -> Option<Vec<Directive>> {
        if !self.named_directives {
            return None;
        }
        let mut words = Lexer::with_options(text, self.lex)
            .filter(|t| !matches!(t.kind, TokKind::Comment { .. }));
        let first = words.next()?;
        let word = |t: &fence_core::lexer::Tok, w: &[u8]| {
            t.kind == TokKind::Ident && t.text(text).eq_ignore_ascii_case(w)
        };
        if !word(&first, b"explain") && !word(&first, b"create") {
            return None;
        }
        words.find(|t| word(t, b"execute"))?;
        let name = words.next()?;
        let PreparedInSql::Name(name) = spelled_name(name.kind, name.text(text)) else {
            return None;
        };
        let runs = &self.statements.get(&name)?.analysis.directives;
        (!runs.is_empty()).then(|| runs.to_vec())
    }

    /// The comment directives of the statement a SQL `EXECUTE` (`text`) runs where the
    /// extended protocol parsed it: its own, as at an Execute of it. Not those of a SQL
    /// `PREPARE`'s text, which pgfence would have to follow to its reply (the name keeps
    /// the statement it had when the `PREPARE` fails): a review made a stale `EXECUTE`
    /// commit with the current token of a `PREPARE` that failed (README, Known
    /// limitations).
    pub(super) fn executed_directives(&self, text: &[u8]) -> &[Directive] {
        let PreparedInSql::Name(name) = prepared_in_sql(text, self.lex) else {
            return &[];
        };
        self.statements
            .get(&name)
            .map_or(&[], |p| &p.analysis.directives)
    }

    /// A SQL `PREPARE` of this name went upstream (see [`prepared_in_sql`]): pgfence no
    /// longer knows what the name runs.
    pub(super) fn forget_prepared_in_sql(&mut self, prepared: &PreparedInSql) {
        match prepared {
            PreparedInSql::No => {}
            PreparedInSql::Name(name) => {
                if let Some(old) = self.statements.remove(name) {
                    self.prepare_hidden |= may_prepare(&old);
                    if old.tx_control {
                        self.control_forgotten.insert(name.clone());
                    }
                }
                self.names_forgotten = true;
            }
            PreparedInSql::Unknown => {
                self.prepare_hidden |= self.statements.values().any(|p| may_prepare(p));
                for (name, old) in self.statements.drain() {
                    if old.tx_control {
                        self.control_forgotten.insert(name);
                    }
                }
                self.names_forgotten = true;
            }
        }
    }

    /// A SQL `EXECUTE` (`text`, one statement) went upstream: it runs the statement of that
    /// name, which may be a `PREPARE` parsed in the extended protocol (SQL `PREPARE` takes
    /// neither `PREPARE` nor `EXECUTE`), or an `EXECUTE` of one. What it may prepare is
    /// forgotten: every name when pgfence cannot tell which, or when the name is one it
    /// forgot and a statement it forgot may have been such a one.
    pub(super) fn executed_in_sql(&mut self, text: &[u8]) {
        let hidden = match prepared_in_sql(text, self.lex) {
            PreparedInSql::No => return,
            PreparedInSql::Name(name) => match self.statements.get(&name) {
                Some(p) if !may_prepare(p) => return,
                Some(p) if !executes_in_sql(p) => p.prepares.clone(),
                Some(_) => PreparedInSql::Unknown,
                None if self.prepare_hidden => PreparedInSql::Unknown,
                None => return,
            },
            PreparedInSql::Unknown => {
                if !self.prepare_hidden && !self.statements.values().any(|p| may_prepare(p)) {
                    return;
                }
                PreparedInSql::Unknown
            }
        };
        self.forget_prepared_in_sql(&hidden);
    }

    /// Whether a SQL `EXECUTE` (`text`, one statement) may end its transaction. SQL
    /// `PREPARE` takes only statements that cannot (`SELECT`, `INSERT`, `UPDATE`, `DELETE`,
    /// `MERGE`, `VALUES`), but `EXECUTE` also runs a statement parsed in the extended
    /// protocol, a `COMMIT` among them. So it may, where its name may stand for transaction
    /// control (or an `EXECUTE` of some) parsed so: one pgfence knows, one a Parse or Close
    /// in flight may leave, one it forgot (`control_forgotten`), or a name it
    /// cannot spell. Else it runs within the transaction, whose comment directives go on:
    /// taken for a possible `COMMIT`, a block's comment token once ended at an `EXECUTE`
    /// of a statement prepared in SQL, and a stale write after it committed unfenced.
    pub(super) fn execute_may_end(&self, text: &[u8]) -> bool {
        let PreparedInSql::Name(name) = prepared_in_sql(text, self.lex) else {
            return true;
        };
        let controls = |p: Option<&Arc<Prepared>>| match p {
            Some(p) => p.tx_control,
            None => self.control_forgotten.contains(&name),
        };
        controls(self.statements.get(&name))
            || self
                .replies
                .statement_in_doubt(&name)
                .is_some_and(|mut olds| olds.any(controls))
    }

    /// Whether a SQL `EXECUTE` (`text`) that may end its transaction (see
    /// [`Session::execute_may_end`]) surely does not: it runs transaction control parsed in
    /// the extended protocol that ends nothing (`BEGIN`, `SAVEPOINT`, `ROLLBACK TO`), so
    /// the transaction's comment directives go on past it.
    pub(super) fn execute_keeps_transaction(&self, text: &[u8]) -> bool {
        let PreparedInSql::Name(name) = prepared_in_sql(text, self.lex) else {
            return false;
        };
        let keeps = |p: Option<&Arc<Prepared>>| {
            p.is_some_and(|p| {
                !p.analysis
                    .statements
                    .iter()
                    .any(|s| s.kind.may_end_transaction())
            })
        };
        keeps(self.statements.get(&name))
            && self
                .replies
                .statement_in_doubt(&name)
                .is_none_or(|mut olds| olds.all(keeps))
    }

    /// Whether a statement pgfence knew as `old` (`None`: none) runs as `new` does, as far as
    /// the fence cares: the same statements as the classifier tells them apart (kind, and
    /// whether each commits inside, at once, changes the schema, prepares, or depends on a
    /// block), preparing the same name, with the same fencing comments.
    fn same_for_the_fence(&self, old: Option<&Arc<Prepared>>, new: Option<&Arc<Prepared>>) -> bool {
        match (old, new) {
            (Some(old), Some(new)) => {
                fn shape(p: &Prepared) -> impl Iterator<Item = impl PartialEq> + '_ {
                    p.analysis.statements.iter().map(|s| {
                        (
                            s.kind,
                            s.may_commit_inside,
                            s.commits_at_once,
                            s.runs_in_block,
                            s.changes_schema,
                            s.prepares_in_sql,
                            s.block_sensitive,
                        )
                    })
                }
                old.copy_in == new.copy_in
                    && old.prepares == new.prepares
                    && old.analysis.directives == new.analysis.directives
                    && shape(old).eq(shape(new))
            }
            // Nothing of that name on the server: a refused Parse leaves the Bind failing.
            (None, _) => !self.names_forgotten,
            (Some(_), None) => false,
        }
    }

    pub(super) fn on_parse(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some((name, sql)) = msg::parse_message(frame) else {
            return Err(SessionError::MalformedClientMessage("Parse"));
        };
        if self.lexing_in_doubt(sql) {
            if self.replies.ready_tells_state() {
                return Ok(self.hold_until_answered());
            }
            // Behind a statement of its batch: the server would report the setting only at
            // its Sync. The statement is one pgfence does not know, which may run anything (a
            // portal of it is checked as if it committed).
            let before = if name.is_empty() {
                self.unnamed_statement.take()
            } else {
                self.names_forgotten = true;
                // It may be a `PREPARE`, run later by a SQL `EXECUTE` of its name, or a
                // `COMMIT` that one runs.
                self.prepare_hidden = true;
                self.control_forgotten.insert(name.into());
                self.statements.remove(name)
            };
            self.forward_named(frame, Request::Parse, name, before);
            return Ok(Flow::Continue);
        }
        // Drivers that use the unnamed statement (pgbench -M extended, JDBC, psycopg) parse
        // the same text again and again: keep its analysis.
        let same = name.is_empty()
            && self
                .unnamed_statement
                .as_ref()
                .is_some_and(|p| *p.sql == *sql);
        let prepared = if same { None } else { Some(self.prepared(sql)) };
        let waits = match prepared.as_ref().or(self.unnamed_statement.as_ref()) {
            Some(p) => p.tx_control && self.waits_for_replies(&p.analysis),
            None => false,
        };
        if waits {
            return Ok(self.hold_until_answered());
        }
        let before = match prepared {
            Some(p) if name.is_empty() => self.unnamed_statement.replace(p),
            Some(p) => {
                self.named_directives |= !p.analysis.directives.is_empty();
                self.statements.insert(name.into(), p)
            }
            None => self.unnamed_statement.clone(),
        };
        self.forward_named(frame, Request::Parse, name, before);
        Ok(Flow::Continue)
    }

    fn statement(&self, name: &[u8]) -> Option<Arc<Prepared>> {
        if name.is_empty() {
            self.unnamed_statement.clone()
        } else {
            self.statements.get(name).cloned()
        }
    }

    pub(super) fn portal(&self, name: &[u8]) -> Option<Arc<Prepared>> {
        if name.is_empty() {
            self.unnamed_portal.clone()
        } else {
            self.portals.get(name).cloned()
        }
    }

    pub(super) fn on_bind(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some((portal, statement, params)) = msg::bind_names(frame) else {
            return Err(SessionError::MalformedClientMessage("Bind"));
        };
        let mut prepared = self.statement(statement);
        let doubtful = self.replies.statements_change()
            && self
                .replies
                .statement_in_doubt(statement)
                .is_some_and(|mut olds| {
                    !olds.all(|old| self.same_for_the_fence(old, prepared.as_ref()))
                });
        if doubtful {
            // A Parse or Close of the name may yet be refused or skipped, and then this Bind
            // runs the statement the name had (an error in an earlier batch does not skip
            // it). Unless all run alike, the Bind waits for the answer when it starts a
            // batch (or follows only Parses, Binds, Describes and Closes of its own); behind
            // a statement of its batch the portal is one pgfence does not know.
            if self.replies.ready_tells_state() {
                return Ok(self.hold_until_answered());
            }
            prepared = None;
        }
        // Not a `CALL`: it may follow an Execute of its transaction, and is checked right
        // before its own Execute, in that transaction (see `on_execute`).
        let non_transactional = prepared.as_ref().is_some_and(|p| {
            matches!(&*p.analysis.statements,
                [only] if only.kind == StatementKind::NonTransactional && !only.may_commit_inside)
        });
        let runs_in_block = || {
            prepared
                .as_ref()
                .is_some_and(|p| p.analysis.statements.iter().any(|s| s.runs_in_block))
        };
        // A Bind held for its precheck comes back here whatever its statement has become
        // meanwhile (a Parse before it that failed made pgfence forget the name). Nothing is
        // held for almost every Bind: no write to the hold then.
        let held = if self.hold == Hold::None {
            None
        } else {
            self.take_hold()
        };
        self.prechecked = non_transactional && held == Some(Ok(()));
        match held {
            Some(Ok(())) => {}
            Some(Err(status)) => {
                self.discard_until_sync = Some(status);
                return Ok(Flow::Continue);
            }
            // Not behind another Bind of the batch: the check's Sync would end the portal it
            // bound (review K: 34000 for the leader's Execute of it). The check then goes
            // right before the Execute (see `on_execute`).
            None if non_transactional
                && self.precheck_possible()
                && !(self.tx.batch_has_bind && runs_in_block()) =>
            {
                if let Some(p) = &prepared {
                    self.tx.add_directives(&p.analysis.directives);
                    // What a rejection log names (it once named the session's last Query).
                    self.last_write = Some(Remembered::Prepared(p.clone()));
                }
                self.inject_check_with_sync(true, AfterCheck::Release);
                return Ok(self.hold_until_answered());
            }
            // Behind an Executed `COMMIT`, `ROLLBACK` or `DISCARD ALL` of its batch, or
            // Executes of empty statements: once pgfence knows no block is open, it comes
            // back here and is checked first as above.
            None if non_transactional && self.learns_state_at_bind(portal, runs_in_block()) => {
                if let Some(p) = &prepared {
                    self.last_write = Some(Remembered::Prepared(p.clone()));
                }
                let directives = prepared
                    .as_ref()
                    .map_or(&[][..], |p| &p.analysis.directives);
                return Ok(self.learn_state_first(directives, true));
            }
            // `DISCARD ALL`, `COMMIT PREPARED` or `ROLLBACK PREPARED` where PostgreSQL runs
            // it (no Execute of the batch pipelined it): it commits at once what the batch's
            // Binds wrote (binding plans a statement, which may run a function that writes),
            // unchecked until a review found it (stop 55). Checked before it, with a Sync of
            // pgfence's, as at the batch's Sync; its commit would end the portals that Sync
            // ends.
            None if self.tx.dirty
                && !non_transactional
                && prepared.as_deref().is_some_and(commits_as_it_runs)
                && (self.precheck_possible() || self.learns_state_at_bind(portal, false)) =>
            {
                return Ok(self.learn_state_first(&[], false));
            }
            None => {}
        }
        if prepared
            .as_ref()
            .is_some_and(|p| p.tx_control && self.waits_for_replies(&p.analysis))
        {
            return Ok(self.hold_until_answered());
        }
        if self.fence.enabled {
            let clean = !self.tx.dirty;
            self.tx.on_bind(
                prepared.as_ref().map(|p| {
                    p.analysis
                        .statements
                        .first()
                        .map_or(StatementKind::Empty, |s| s.kind)
                }),
                params,
            );
            // The statement's comment directives belong to the transaction its Bind runs
            // in (its Execute can only run there too), as they would at its Execute.
            if let Some(p) = &prepared {
                self.tx.add_directives(&p.analysis.directives);
            }
            if clean && self.tx.dirty {
                // The statement a rejection log names, as its Execute would (a checked
                // read is named only while the transaction is clean).
                if let Some(p) = &prepared {
                    self.last_write = Some(Remembered::Prepared(p.clone()));
                }
            }
        }
        self.tx.bound_since_end = self.tx.bound_since_end.max(if portal.is_empty() {
            Bound::Unnamed
        } else {
            Bound::Named
        });
        let before = if portal.is_empty() {
            std::mem::replace(&mut self.unnamed_portal, prepared)
        } else if let Some(p) = prepared {
            self.portals.insert(portal.into(), p)
        } else {
            self.portals.remove(portal)
        };
        self.forward_named(frame, Request::Bind, portal, before);
        Ok(Flow::Continue)
    }

    pub(super) fn on_execute(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(portal) = msg::execute_portal(frame) else {
            return Err(SessionError::MalformedClientMessage("Execute"));
        };
        if self.directives_in_doubt() {
            return Ok(self.hold_until_answered());
        }
        let prepared = self.portal(portal);
        if prepared.is_none() && self.replies.portal_closed_in_batch(portal) {
            // Closed earlier in this batch: it runs nothing, and a check before it could
            // only change the error (25P02 in a failed block, where PostgreSQL says 34000).
            self.shared.stats.queries.add();
            self.forward(frame, Request::Execute);
            return Ok(Flow::Continue);
        }
        // A portal pgfence did not see bound may run anything, a COMMIT included: one of a
        // statement prepared in SQL (maybe over one parsed as COMMIT: see
        // `prepared_in_sql`), or whose Parse was refused before it (the unnamed one).
        let kind = match &prepared {
            Some(p) => p
                .analysis
                .statements
                .first()
                .map_or(StatementKind::Empty, |s| s.kind),
            None => StatementKind::Execute,
        };
        let waits = match &prepared {
            // A `DO` or `CALL`, when whether a block is open is still in flight and the
            // next ReadyForQuery tells: in a block it is atomic (and in a failed one it fails),
            // so the check before it is for outside one only.
            Some(p) if p.analysis.may_commit_inside() => {
                self.fence.enabled
                    && self.tx.view == View::Unknown
                    && !self.replies.is_empty()
                    && self.replies.ready_tells_state()
            }
            Some(p) => p.tx_control && self.waits_for_replies(&p.analysis),
            // Anything, a `COMMIT` or a `CALL` included: as for either.
            None => {
                self.fence.enabled
                    && (self.tx.placement_depends_on_replies(kind)
                        || (self.tx.view == View::Unknown && !self.replies.is_empty()))
                    && self.replies.ready_tells_state()
            }
        };
        if waits {
            return Ok(self.hold_until_answered());
        }
        let prechecked = std::mem::take(&mut self.prechecked);
        // Whether an Execute of this batch leaves it pipelined (before this one's).
        let pipelined = self.tx.batch_pipelined;
        // A SQL `EXECUTE` that cannot end its transaction runs as the statement it names.
        let kind = match (&prepared, kind) {
            (Some(p), StatementKind::Execute)
                if self.fence.enabled
                    && p.analysis
                        .statements
                        .first()
                        .is_some_and(|first| !self.execute_may_end(first.text(&p.sql))) =>
            {
                StatementKind::MayWrite
            }
            _ => kind,
        };
        self.shared.stats.queries.add();
        self.tx.on_execute(kind);
        if prepared
            .as_ref()
            .is_some_and(|p| p.analysis.statements.iter().any(|s| s.commits_at_once))
        {
            // PostgreSQL commits it at once (it runs only first in its batch): what follows
            // starts a new transaction, not pipelined (a `VACUUM` Query after a `DISCARD
            // ALL` of the batch runs, as on PostgreSQL).
            self.tx.batch_pipelined = false;
            self.tx.bound_since_end = Bound::Nothing;
        }
        if let Some(p) = &prepared {
            if self.owes_check_for(&p.analysis) {
                self.last_write = Some(Remembered::Prepared(p.clone()));
            }
            self.last_sql = Some(Remembered::Prepared(p.clone()));
        }
        // A SQL `EXECUTE`: the comment directives of what it runs.
        let mut runs = None;
        if let Some(p) = &prepared {
            if p.prepares != PreparedInSql::No {
                self.forget_prepared_in_sql(&p.prepares);
            }
            if executes_in_sql(p) {
                if let Some(first) = p.analysis.statements.first() {
                    runs = Some(self.executed_directives(first.text(&p.sql)).to_vec());
                    self.executed_in_sql(first.text(&p.sql));
                }
            } else if self.fence.enabled && self.named_directives {
                runs = self.executed_inside(&p.sql);
            }
        }
        if kind == StatementKind::Discard || prepared.is_none() {
            // A portal pgfence does not know may run `DISCARD ALL` or `DEALLOCATE ALL` (its
            // statement's Parse was refused, leaving the server's older one): its next
            // check prepares its statement again rather than bind one that may be gone.
            self.fence.dropping_prepared();
        }
        if !self.fence.enabled {
            if matches!(
                kind,
                StatementKind::Begin
                    | StatementKind::Commit
                    | StatementKind::Rollback
                    | StatementKind::PrepareTransaction
                    | StatementKind::Execute
            ) {
                self.tx.view = View::Unknown;
            }
            self.note_copy_in(prepared.as_deref());
            self.forward(frame, Request::Execute);
            return Ok(Flow::Continue);
        }
        if let Some(p) = &prepared {
            // Not in a failed block, where the Execute fails anyway (and with 34000 if its
            // portal is gone, which pgfence does not track: a stand-in would fail its Bind
            // with 25P02 instead).
            if self.fence.fast_path && p.analysis.may_write() && self.tx.view != View::Failed {
                if let Some((resource, token, fence)) = self.fence.stale(
                    &self.tx.directives,
                    &p.analysis.directives,
                    self.known_fences(),
                ) {
                    self.inject_fast_reject_execute(&resource, token, fence);
                    return Ok(Flow::Continue);
                }
            }
            self.tx.add_directives(&p.analysis.directives);
            if let Some(runs) = &runs {
                self.tx.add_directives(runs);
            }
        }
        if matches!(
            kind,
            StatementKind::Commit | StatementKind::PrepareTransaction
        ) && self.tx.commit_needs_check()
        {
            self.inject_check(false);
            self.commit_check = CommitCheck::Sent {
                found_failed: false,
            };
        } else if prepared
            .as_ref()
            .is_none_or(|p| p.analysis.may_commit_inside())
            && !matches!(self.tx.view, View::InBlock | View::Failed)
        {
            // A `DO` or `CALL` outside a block runs non-atomic: a `COMMIT` inside it
            // commits what the transaction wrote until then (the batch's earlier Executes
            // too), the check at the Sync too late. A forced check right before it, in its
            // transaction, compares the token now and holds the accept lock over what it
            // commits; what it writes after its own `COMMIT` is checked at the Sync, with
            // the same comment directives. Its portal is closed after it (the view is
            // unknown), since the transaction goes on. So for a portal pgfence does not
            // know, which may be a `CALL`: a check that is not forced passes while the
            // transaction has written nothing yet, and the `CALL` then commits unchecked.
            // Only its own comment directives go on: what it writes after a `COMMIT` of its
            // own is in a new transaction, which the earlier statements' comments are not
            // for (they once fenced a stale write after a `DO` that committed, with the
            // current token of a read before it).
            self.tx.view = View::Unknown;
            self.inject_check(true);
            if let Some(p) = &prepared {
                self.tx.add_directives(&p.analysis.directives);
            }
        } else if !prechecked
            && !pipelined
            && self.tx.dirty
            && !matches!(self.tx.view, View::InBlock | View::Failed)
            && prepared.as_deref().is_some_and(commits_as_it_runs)
        {
            // A statement that commits the batch's transaction as it runs, not checked at
            // its Bind since (or checked before a Bind after its own): a Bind since may have
            // written, which it would commit unchecked (review N, stop 55: a stale write
            // through a Bind between the Bind and the Execute of a `DISCARD ALL` or a
            // `VACUUM` committed). A forced check right before it makes PostgreSQL refuse
            // it "within a pipeline", and the transaction, with that write, rolls back, where
            // directly it would run.
            self.tx.view = View::Unknown;
            self.inject_check(true);
        } else if !prechecked
            && !pipelined
            && kind == StatementKind::NonTransactional
            && !matches!(self.tx.view, View::InBlock | View::Failed)
            && prepared
                .as_ref()
                .is_some_and(|p| p.analysis.statements.iter().any(|s| s.runs_in_block))
        {
            // A statement that cannot be fenced atomically, not checked first at its Bind
            // (bound behind another portal of the batch, whose end a Sync of pgfence's would
            // be, as one bound behind an Executed `COMMIT`, `ROLLBACK` or `DISCARD ALL` of
            // it): first in a new transaction, PostgreSQL would run it as alone
            // (`ANALYZE` or `REINDEX` of a partitioned table commits a transaction per
            // partition, with what functions of its index expressions write), and the check
            // at the Sync would come too late (review K: a stale `ANALYZE` behind an
            // Executed `COMMIT` committed). A forced check right before it, in its
            // transaction, makes it a pipelined statement: run in that transaction, or
            // refused "within a pipeline" (`VACUUM`, or a `REINDEX` of a partitioned table,
            // where PostgreSQL would run it). So only for those that run in a block alike
            // (`Statement::runs_in_block`), which keep the batch's other portals: a `VACUUM`
            // ends them itself, and is checked at its Bind with a Sync of pgfence's (see
            // `learns_state_at_bind`). Its portal is closed after it (the view is unknown),
            // as the transaction goes on to the check at the Sync.
            self.tx.view = View::Unknown;
            self.inject_check(true);
        } else if kind == StatementKind::Execute {
            // Checked as if it committed. Most likely it does not, and the transaction goes
            // on: the check closes its portal, so that the next check can bind it again.
            // And if the check fails, the block stays failed, as after a statement that
            // failed (not ended as after a COMMIT, see `CommitCheck`). The comment
            // directives end with it, as at a `COMMIT`, also where nothing was written to
            // check (they once fenced a stale write after an `EXECUTE` of a `COMMIT`).
            if self.tx.commit_needs_check() {
                self.tx.view = View::Unknown;
                self.inject_check(false);
            }
            let keeps = prepared.as_ref().is_some_and(|p| {
                p.analysis
                    .statements
                    .first()
                    .is_some_and(|first| self.execute_keeps_transaction(first.text(&p.sql)))
            });
            if !keeps {
                self.tx.directives.clear();
            }
        }
        if prepared
            .as_deref()
            .is_some_and(|p| p.analysis.statements.iter().any(|s| s.changes_schema))
        {
            self.tx.note_schema_change();
        }
        self.tx.on_statement(kind);
        if (self.tx.dirty || !self.tx.directives.is_empty())
            && !matches!(self.tx.view, View::InBlock | View::Failed)
            && prepared.as_deref().is_some_and(commits_as_it_runs)
        {
            // It commits the transaction it runs in, checked before it (above, or at its
            // Bind): what follows in the batch runs in a new one, which the comment tokens of
            // this statement and those before it are not for (a `/* fencing_token=34 */
            // VACUUM` once fenced a stale session's `INSERT` after it with 34; review N,
            // stop 55). (In a block it fails, and the block with it.)
            self.tx.end();
        }
        self.note_copy_in(prepared.as_deref());
        self.forward(frame, Request::Execute);
        Ok(Flow::Continue)
    }

    /// The Execute of `prepared` goes upstream now: a `COPY ... FROM STDIN` may start.
    fn note_copy_in(&mut self, prepared: Option<&Prepared>) {
        if prepared.is_some_and(|p| p.copy_in) {
            self.copy_in = CopyIn::Sent;
            self.copy_from_client = CopyFromClient::MayStart;
        }
    }

    pub(super) fn on_close(&mut self, frame: &[u8]) -> Result<(), SessionError> {
        let Some((kind, name)) = msg::target(frame) else {
            return Err(SessionError::MalformedClientMessage("Close"));
        };
        // What the name stood for is put back if the server skips the Close (see
        // `refused`).
        let (request, before) = match (kind, name.is_empty()) {
            (b'S', true) => (Request::CloseStatement, self.unnamed_statement.take()),
            (b'S', false) => (Request::CloseStatement, self.statements.remove(name)),
            (b'P', true) => (Request::ClosePortal, self.unnamed_portal.take()),
            (b'P', false) => (Request::ClosePortal, self.portals.remove(name)),
            // The server refuses it: nothing changes.
            _ => (Request::Close, None),
        };
        if request == Request::Close {
            self.forward(frame, request);
        } else {
            self.forward_named(frame, request, name, before);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{prepared_in_sql, PreparedInSql};

    #[test]
    fn names_prepared_in_sql_are_spelled_as_the_server_does() {
        let prepares = |sql: &str| prepared_in_sql(sql.as_bytes(), Default::default());
        let name = |n: &str| PreparedInSql::Name(n.as_bytes().into());
        assert_eq!(prepares("PREPARE q AS SELECT 1"), name("q"));
        assert_eq!(
            prepares("prepare Ins (int) AS INSERT INTO t VALUES ($1)"),
            name("ins")
        );
        assert_eq!(prepares("/* c */ PREPARE \"Ins\" AS SELECT 1"), name("Ins"));
        assert_eq!(
            prepares("-- c\nPREPARE \"a\"\"b\" AS SELECT 1"),
            name("a\"b")
        );
        assert_eq!(
            prepares("PREPARE transaction AS SELECT 1"),
            name("transaction")
        );
        assert_eq!(
            prepares("PREPARE U&\"q\" AS SELECT 1"),
            PreparedInSql::Unknown
        );
        let long = format!("PREPARE {} AS SELECT 1", "q".repeat(63));
        assert_eq!(prepares(&long), PreparedInSql::Unknown);
        assert_eq!(prepares("PREPARE \"q"), PreparedInSql::Unknown);
        assert_eq!(prepares("PREPARE"), PreparedInSql::No);
    }
}
