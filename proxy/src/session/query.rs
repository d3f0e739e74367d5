//! The simple protocol's Query: analysed where it lies, forwarded as it is, or rewritten
//! with pgfence's checks where its transactions end; checked first on its own when it holds
//! a statement that cannot run in a transaction block, or ends a batch's transaction.

use fence_core::classify::{Analysis, StatementKind};
use fence_core::directive::Directive;
use fence_core::lexer::{is_keyword, LexOptions, Lexer, TokKind};

use crate::error::SessionError;
use crate::protocol::message as msg;

use super::extended::prepared_in_sql;
use super::replies::{AfterCheck, QueryPlan, Request};
use super::tx::{SimplePlan, View};
use super::{CommitCheck, Flow, Flushed, Hold, Remembered, Session};

/// Whether a statement starting at `sql` may be a `COPY` (cheap: its first word, or a
/// comment before it).
#[inline]
fn may_be_copy(sql: &[u8]) -> bool {
    match sql {
        [b'/', b'*', ..] | [b'-', b'-', ..] => true,
        [c, o, p, y, rest @ ..] => {
            [*c, *o, *p, *y].eq_ignore_ascii_case(b"copy")
                && !rest
                    .first()
                    .is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b >= 0x80)
        }
        _ => false,
    }
}

/// Whether `sql` is `COPY ... FROM STDIN`: `COPY` first, then `FROM STDIN` outside
/// parentheses (so not the `FROM` of `COPY (SELECT ... FROM t) TO STDOUT`).
pub(super) fn is_copy_from_stdin(sql: &[u8], options: LexOptions) -> bool {
    let mut tokens = Lexer::with_options(sql, options)
        .filter(|t| !matches!(t.kind, TokKind::Comment { .. }))
        .take_while(|t| t.kind != TokKind::Semicolon);
    if !tokens
        .next()
        .is_some_and(|t| t.kind == TokKind::Ident && is_keyword(t.text(sql), "copy"))
    {
        return false;
    }
    let mut depth = 0usize;
    let mut after_from = false;
    for t in tokens {
        match t.kind {
            TokKind::LParen => depth += 1,
            TokKind::RParen => depth = depth.saturating_sub(1),
            TokKind::Ident if depth == 0 => {
                if after_from {
                    return is_keyword(t.text(sql), "stdin");
                }
                after_from = is_keyword(t.text(sql), "from");
            }
            _ => after_from = false,
        }
    }
    false
}

/// What [`Session::note_query`] found a Query's statements run of prepared statements'
/// comments: (statement index, directives), for those that have any.
type Executed = Option<Vec<(usize, Box<[Directive]>)>>;

/// A count of statements in a Query, as [`QueryPlan`] keeps it: a message of at most 1 GiB
/// cannot hold more than `u32::MAX`.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Session {
    pub(super) fn on_query(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(sql) = msg::query_text(frame) else {
            return Err(SessionError::MalformedClientMessage("Query"));
        };
        crate::failpoint::panic_on_query(sql);
        if self.directives_in_doubt() {
            return Ok(self.hold_until_answered());
        }
        if self.lexing_in_doubt(sql) {
            if !self.replies.ready_tells_state() {
                return Err(SessionError::QueryLexingInDoubt);
            }
            return Ok(self.hold_until_answered());
        }
        // Analysed where it lies, without the copies a prepared statement keeps.
        let mut analysis = self.analyze(sql);
        if self.fence.enabled && analysis.body_in_doubt {
            return Err(SessionError::AtomicBodyInDoubt);
        }
        let executed = self.note_query(sql, &analysis);
        if self.fence.enabled {
            self.resolve_sql_executes(sql, &mut analysis, executed);
        }
        let analysis = &analysis;
        if analysis.statements.iter().any(|s| s.changes_schema) {
            self.tx.note_schema_change();
        }
        self.query_copies_in = analysis.statements.iter().any(|s| {
            s.kind == StatementKind::MayWrite
                && may_be_copy(&sql[s.start..])
                && is_copy_from_stdin(s.text(sql), self.lex)
        });
        if !self.fence.enabled {
            if analysis.tx_control() {
                self.tx.view = View::Unknown;
            }
            self.forward(frame, Request::Query);
            return Ok(Flow::Continue);
        }
        let single = match &*analysis.statements {
            [only] => Some(only.kind),
            _ => None,
        };
        // What a check is owed for: this Query, from where it is checked or rejected, and
        // not before a check of the batch it ends, which is the batch's.
        let owes = self.owes_check_for(analysis);
        if single == Some(StatementKind::NonTransactional) {
            self.remember_write(owes, sql);
            if let Some(flow) = self.non_transactional_query(frame, analysis) {
                return Ok(flow);
            }
        }
        // Back after the check before it inside its batch (see `Flushed::Check`).
        let checked_first = match self.take_hold() {
            Some(Ok(())) => true,
            Some(Err(status)) => {
                self.ready_to_client(status);
                return Ok(Flow::Continue);
            }
            None => false,
        };
        if self.waits_for_replies(analysis) {
            return Ok(self.hold_until_answered());
        }
        // Only a Query of one statement: it stands for the whole Query, where one of several
        // would drop the others, and with them what PostgreSQL runs before the stale write
        // (an earlier transaction's COMMIT, a SAVEPOINT, a SELECT's rows). The check rejects
        // those where their transaction commits.
        if self.fence.fast_path && single.is_some() && analysis.may_write() && !checked_first {
            if let Some((resource, token, fence)) = self.fence.stale(
                &self.tx.directives,
                &analysis.directives,
                self.known_fences(),
            ) {
                self.remember_write(owes, sql);
                return Ok(self.fast_reject_query(analysis, resource, token, fence));
            }
        }
        // A Query that starts with `BEGIN` makes a block of the batch's transaction: it does
        // not end there, and its COMMIT is checked (a check before the `BEGIN` would take a
        // snapshot first, and a `BEGIN ISOLATION LEVEL` then fail). So does one whose last
        // transaction control is a `BEGIN`: what commits before it inside the Query (at a
        // `COMMIT`, or an `EXECUTE` that may be one) gets the check placed there, with the
        // batch's writes in its transaction; if the Query fails, all of it rolls back. (A
        // check before it would take a snapshot, and its `SET TRANSACTION ISOLATION LEVEL`
        // then fail.)
        let opens_block = || {
            analysis
                .statements
                .first()
                .is_some_and(|s| s.kind == StatementKind::Begin)
                || analysis
                    .statements
                    .iter()
                    .rev()
                    .find(|s| s.kind == StatementKind::Begin || s.kind.may_end_transaction())
                    .is_some_and(|s| s.kind == StatementKind::Begin)
        };
        if !checked_first
            && self.tx.sync_needs_check()
            && self.batch_commits_inside()
            && !opens_block()
        {
            if self.waits_for_state_inside_batch() {
                return Ok(self.hold_until_answered());
            }
            // The Query ends the batch's implicit transaction: what the batch wrote is checked
            // before it, as at a Sync, and the Query's own statements as if it came alone (a
            // check added to its text would make a lone `SAVEPOINT`, `LOCK` or `SET LOCAL`
            // run in an implicit block, and one it takes for block-sensitive would get none).
            return Ok(self.check_inside_batch_first(false));
        }
        self.remember_write(owes, sql);
        if matches!(
            single,
            Some(StatementKind::Commit | StatementKind::PrepareTransaction)
        ) && self.tx.commit_needs_check()
        {
            self.tx.add_directives(&analysis.directives);
            return Ok(self.commit_query_with_check(frame));
        }
        // Nothing in flight and no block open: pgfence may prepare a statement first.
        // Not in the middle of a batch whose replies pgfence has read (see `Flushed`): the
        // Sync of the statement's preparation would commit what the batch ran, Binds
        // included (see `TxState::on_bind`), before the Query's check.
        let quiet = self.tx.view == View::Idle
            && self.replies.is_empty()
            && !self.tx.batch_has_execute
            && !self.tx.batch_has_bind
            && self.commit_check == CommitCheck::None;
        let plan = self.tx.plan_simple(analysis);
        if plan.is_empty() {
            let mut next = 0;
            self.scope_directives(sql, analysis, &mut next, analysis.statements.len());
            self.end_query_directives(analysis, &plan);
            self.forward(frame, Request::Query);
            return Ok(Flow::Continue);
        }
        Ok(self.query_with_checks(sql, analysis, &plan, quiet))
    }

    /// Adds to the transaction's directives those of the Query's statements from `*next` up
    /// to `last` (excluded; all of them when `last` is past the end), each in its
    /// transaction's: at a statement that ends one (`COMMIT`, `PREPARE TRANSACTION`,
    /// `ROLLBACK`, and `EXECUTE`, which may), the directives gathered so far end with it.
    /// A comment applies to the transaction that contains its statement (SPEC section 2),
    /// not to another one of the same Query string: a later transaction's comment token
    /// once let an earlier transaction's stale write commit.
    fn scope_directives(&mut self, sql: &[u8], analysis: &Analysis, next: &mut usize, last: usize) {
        let last = last.min(analysis.statements.len());
        for st in &analysis.statements[(*next).min(last)..last] {
            self.tx
                .add_directives(&analysis.directives[st.directives.clone()]);
            if st.kind.may_end_transaction()
                && !(st.kind == StatementKind::Execute
                    && self.execute_keeps_transaction(st.text(sql)))
            {
                self.tx.directives.clear();
            }
        }
        *next = (*next).max(last);
    }

    /// A SQL `EXECUTE` that cannot end its transaction (see [`Session::execute_may_end`])
    /// is planned as the statement that may write it runs, not as a possible `COMMIT`; and
    /// the comment directives of what it runs (`executed`, see [`Session::note_query`])
    /// count as its own.
    fn resolve_sql_executes(&self, sql: &[u8], analysis: &mut Analysis, executed: Executed) {
        for st in analysis.statements.iter_mut() {
            if st.kind == StatementKind::Execute && !self.execute_may_end(st.text(sql)) {
                st.kind = StatementKind::MayWrite;
            }
        }
        let Some(executed) = executed else {
            return;
        };
        let old = std::mem::take(&mut analysis.directives);
        let mut directives = Vec::with_capacity(old.len() + executed.len());
        let mut executed = executed.into_iter().peekable();
        let (mut copied, mut added) = (0, 0);
        for (i, st) in analysis.statements.iter_mut().enumerate() {
            let own = st.directives.clone();
            directives.extend_from_slice(&old[copied..own.end]);
            copied = own.end;
            let runs = executed.next_if(|(at, _)| *at == i).map(|(_, d)| d);
            let more = runs.as_ref().map_or(0, |d| d.len());
            directives.extend(runs.into_iter().flat_map(Vec::from));
            st.directives = own.start + added..own.end + added + more;
            added += more;
        }
        directives.extend_from_slice(&old[copied..]);
        analysis.directives = directives;
    }

    /// After a Query's statements: its directives live on only in a block still open.
    fn end_query_directives(&mut self, analysis: &Analysis, plan: &SimplePlan) {
        match plan.ends_in_block {
            Some(false) if !analysis.statements.is_empty() => self.tx.directives.clear(),
            None => self.tx.sync_point_in_doubt(),
            _ => {}
        }
    }

    /// What a Query changes whether or not the fence is on: the text kept for rejection
    /// logs, and the prepared statements it drops or replaces, statement by statement.
    /// (What a check is owed for, `last_write`, is kept once the Query goes on: see
    /// `Session::on_query`.) Returns, for each SQL `EXECUTE` whose statement has comment
    /// directives, its index and those directives.
    fn note_query(&mut self, sql: &[u8], analysis: &Analysis) -> Executed {
        Remembered::query(&mut self.last_sql, sql);
        // `None` almost always: dropping it costs nothing, where an empty Vec's drop was
        // a call per Query (TPC-B -M simple +168 instructions a transaction, callgrind).
        let mut executed: Executed = None;
        for (i, statement) in analysis.statements.iter().enumerate() {
            match statement.kind {
                StatementKind::Discard => self.fence.dropping_prepared(),
                StatementKind::Execute => {
                    let text = statement.text(sql);
                    let runs = self.executed_directives(text);
                    if !runs.is_empty() {
                        executed.get_or_insert_with(Vec::new).push((i, runs.into()));
                    }
                    self.executed_in_sql(text);
                }
                _ if statement.prepares_in_sql => {
                    self.forget_prepared_in_sql(&prepared_in_sql(statement.text(sql), self.lex))
                }
                StatementKind::MayWrite | StatementKind::ReadOnly if self.named_directives => {
                    if let Some(runs) = self.executed_inside(statement.text(sql)) {
                        executed.get_or_insert_with(Vec::new).push((i, runs.into()));
                    }
                }
                _ => {}
            }
        }
        executed
    }

    /// Keeps a Query's text as what a check is owed for, if it is (`owes`, see
    /// [`Session::owes_check_for`]).
    #[inline]
    fn remember_write(&mut self, owes: bool, sql: &[u8]) {
        if owes {
            Remembered::query(&mut self.last_write, sql);
        }
    }

    /// A Query of one statement that cannot run in a transaction block (`VACUUM`, ...):
    /// checked first in a transaction of its own where it runs alone (SPEC section 3), or
    /// held until pgfence knows where it runs. `None`: handled as any other Query.
    #[cold]
    #[inline(never)]
    fn non_transactional_query(&mut self, frame: &[u8], analysis: &Analysis) -> Option<Flow> {
        match self.take_hold() {
            Some(Ok(())) => {
                self.forward(frame, Request::Query);
                Some(Flow::Continue)
            }
            Some(Err(status)) => {
                self.ready_to_client(status);
                Some(Flow::Continue)
            }
            None if self.runs_alone() && self.replies.is_empty() => {
                self.tx.add_directives(&analysis.directives);
                self.inject_check_with_sync(true, AfterCheck::Release);
                Some(self.hold_until_answered())
            }
            None if self.runs_alone() && self.batch_commits_inside() => {
                // Inside a batch, behind only its Parse, Bind, Describe or Close and
                // Executes of empty statements: the server runs the statement as it
                // would outside one (it ends the transaction they started), but an
                // Execute of pgfence's check there would make it fail "within a
                // pipeline". A Flush brings their replies: once they are in, the
                // statement is checked first on its own (the transaction it ends has run
                // nothing), or, if one of them failed, goes on to the server, which
                // skips it.
                msg::flush(&mut self.to_server);
                self.flushed = Flushed::ForPrecheck;
                Some(self.hold_until_answered())
            }
            None if self.learns_state_first() => {
                // Inside a batch, behind an Executed `COMMIT` or `ROLLBACK` of it and only
                // empty statements or a Parse, Bind, Describe or Close since: PostgreSQL
                // runs the statement in a new transaction, outside a block unless the
                // `COMMIT` chained one.
                Some(self.learn_state_first(&analysis.directives, true))
            }
            None if self.tx.batch_pipelined && self.batch_commits_inside() => {
                // Inside a batch, behind an Execute of its transaction that pipelines:
                // the statement commits what the batch wrote (PostgreSQL refuses one that
                // cannot run in a block "within a pipeline" there anyway, or, when the
                // batch's `COMMIT AND CHAIN` opened one, "inside a transaction block").
                // Checked first, in that transaction, with no Sync (which would end the
                // client's batch); a check appended to the Query would make it an
                // implicit block, and the error the second one.
                if self.waits_for_state_inside_batch() {
                    return Some(self.hold_until_answered());
                }
                self.tx.add_directives(&analysis.directives);
                Some(self.check_inside_batch_first(true))
            }
            None if (self.precheck_possible() || self.tx.view == View::Unknown)
                && self.replies.ends_at_sync_point() =>
            {
                // Replies are still owed (a pipelining client: tokio-postgres closes a
                // statement with Close and Sync after its query returned). Checked with
                // them in flight, the statement would have to share a query string with
                // the check, and fail to run in a transaction block: wait for them. So
                // when transaction control is in flight: its replies tell whether the
                // statement runs in a block (and fails) or can be checked first.
                Some(self.hold_until_answered())
            }
            None => None,
        }
    }

    /// A Query that is a lone `COMMIT` (or `PREPARE TRANSACTION`) of a block that wrote.
    fn commit_query_with_check(&mut self, frame: &[u8]) -> Flow {
        // A lone COMMIT: the check right before it, with no Sync of its own, so that
        // the server answers both in one write. If the check fails, the server skips the
        // COMMIT up to a Sync: pgfence then sends one and ends the failed block with its
        // own ROLLBACK (see `CommitCheck`), so a rejection looks like a deferred
        // constraint failing at COMMIT (error, then ReadyForQuery idle). Until then no
        // other client message may reach the server.
        self.inject_check(false);
        self.tx.end();
        self.tx.view = View::Unknown;
        self.forward(frame, Request::Query);
        self.commit_check = CommitCheck::Pending {
            found_failed: false,
            query: true,
        };
        self.hold = Hold::Waiting;
        Flow::Pause
    }

    /// Sends the Query's text with pgfence's check statements inserted where `plan` puts
    /// them (before an inner COMMIT, at the end of an implicit transaction). `quiet`: nothing
    /// is in flight and no block is open, so the check statement may be prepared first.
    fn query_with_checks(
        &mut self,
        sql: &[u8],
        analysis: &Analysis,
        plan: &SimplePlan,
        quiet: bool,
    ) -> Flow {
        // Rewrite: the client's text with check statements where transactions end.
        let mut text = Vec::with_capacity(sql.len() + 256);
        let mut checks = Vec::with_capacity(plan.before.len() + 1);
        let mut copied = 0;
        let mut inserted = Vec::new();
        let mut chars_before = 0;
        let mut prepare = None;
        let mut next = 0;
        for (n, &(offset, index)) in plan.before.iter().enumerate() {
            text.extend_from_slice(&sql[copied..offset]);
            let at = text.len();
            // The check before statement `index` (a COMMIT, or an EXECUTE that may be one)
            // carries the comments of its transaction, that statement's own included.
            self.scope_directives(sql, analysis, &mut next, index);
            self.tx.add_directives(
                &analysis.directives[analysis.statements[index].directives.clone()],
            );
            next = index + 1;
            prepare = prepare.or(self.simple_check(&mut text));
            let st = &analysis.statements[index];
            if !(st.kind == StatementKind::Execute && self.execute_keeps_transaction(st.text(sql)))
            {
                self.tx.directives.clear();
            }
            text.extend_from_slice(b";\n");
            if let Some(counted) = self.char_count(&sql[copied..offset]) {
                // The check's text is ASCII: one character per byte.
                chars_before += counted;
                let added = (text.len() - at) as u64;
                inserted.push((chars_before, added));
                chars_before += added;
            }
            copied = offset;
            checks.push(count(index + n));
        }
        if inserted.len() != plan.before.len() {
            inserted.clear();
        }
        text.extend_from_slice(&sql[copied..]);
        self.scope_directives(sql, analysis, &mut next, analysis.statements.len());
        if plan.at_end {
            text.extend_from_slice(b"\n;");
            prepare = prepare.or(self.simple_check(&mut text));
            checks.push(count(analysis.statements.len() + plan.before.len()));
            self.tx.directives.clear();
        }
        self.end_query_directives(analysis, plan);
        self.shared.stats.checks.add();
        self.check_sent = Some(std::time::Instant::now());
        if let (Some(statement), true) = (prepare, quiet) {
            self.prepare_before_query(statement);
        }
        self.sent(Request::Query);
        msg::query(&mut self.to_server, &text);
        let statements = count(analysis.statements.len() + checks.len());
        self.replies.push_query(QueryPlan {
            checks,
            done: 0,
            fast_reject: false,
            at_end: plan.at_end,
            statements,
            inserted,
        });
        if !plan.before.is_empty() {
            // A check before an inner COMMIT: see `CommitCheck`.
            self.commit_check = CommitCheck::Pending {
                found_failed: false,
                query: true,
            };
            self.hold = Hold::Waiting;
            self.copy_through = analysis
                .statements
                .iter()
                .any(|s| is_copy_from_stdin(s.text(sql), self.lex));
            return Flow::Pause;
        }
        Flow::Continue
    }

    /// A simple Query that would write with a known-stale token.
    fn fast_reject_query(
        &mut self,
        analysis: &Analysis,
        resource: fence_core::token::Resource,
        token: fence_core::token::Token,
        fence: i64,
    ) -> Flow {
        let rejection = fence_core::rejection::Rejection::stale(&resource, token, fence);
        if self.tx.view == View::Idle
            && self.replies.is_empty()
            && !self.tx.batch_has_execute
            && !self.tx.batch_has_bind
            && !analysis.tx_control()
            && !self.unnamed_statement_alive
        {
            // Nothing open upstream: answer without a round trip. (Not inside a batch whose
            // replies are in: the failing Query rolls back what its Executes and Binds
            // wrote, and the rejection upstream below does so too. Not while the client
            // has an unnamed statement: PostgreSQL drops it at any Query.)
            self.report_rejection(&rejection, "fast", None, false);
            msg::error_response(
                &mut self.to_client,
                &msg::ErrorMessage {
                    severity: "ERROR",
                    code: rejection.reason.sqlstate(),
                    message: &rejection.message,
                    detail: Some(&rejection.detail),
                    hint: Some(&rejection.hint),
                },
            );
            self.ready_to_client(b'I');
            return Flow::Continue;
        }
        // A transaction is open: make it fail upstream exactly as the client is told.
        let mut text = Vec::with_capacity(128);
        fence_core::sql::fast_reject_literal(resource.as_str(), token.get(), fence, &mut text);
        self.sent(Request::Query);
        msg::query(&mut self.to_server, &text);
        self.replies.push_query(QueryPlan {
            checks: Vec::new(),
            done: 0,
            fast_reject: true,
            at_end: false,
            statements: 1,
            inserted: Vec::new(),
        });
        Flow::Continue
    }
}

#[cfg(test)]
mod tests {
    use super::{is_copy_from_stdin, may_be_copy};

    #[test]
    fn copy_from_stdin_is_recognised() {
        let yes = |sql: &str| is_copy_from_stdin(sql.as_bytes(), Default::default());
        assert!(yes("COPY t FROM STDIN"));
        assert!(yes("copy t (a, b) from stdin with (format csv)"));
        assert!(yes("/* c */ COPY \"T\" FROM\nstdin;"));
        assert!(yes("COPY s.t FROM STDIN (FORMAT binary)"));
        assert!(!yes("COPY t TO STDOUT"));
        assert!(!yes("COPY (SELECT a FROM stdin) TO STDOUT"));
        assert!(!yes("COPY t FROM '/tmp/file'"));
        assert!(!yes("COPY t FROM PROGRAM 'cat'"));
        assert!(!yes("SELECT 'COPY t FROM STDIN'"));
        assert!(!yes("SELECT 1; COPY t FROM STDIN"));
        assert!(!yes(""));
    }

    #[test]
    fn only_statements_that_may_be_copy_are_looked_at() {
        let may = |sql: &str| may_be_copy(sql.as_bytes());
        assert!(may("COPY t FROM STDIN"));
        assert!(may("copy(x)"));
        assert!(may("CoPy"));
        assert!(may("/* c */ COPY t FROM STDIN"));
        assert!(may("-- c\nCOPY t FROM STDIN"));
        assert!(!may("COPYX t"));
        assert!(!may("copy_t"));
        assert!(!may("UPDATE t SET a = 1"));
        assert!(!may("cop"));
        assert!(!may(""));
    }
}
