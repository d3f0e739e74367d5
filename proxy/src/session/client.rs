//! Client messages in the Ready phase: forwarded byte for byte, inspected on the way, and
//! where the fence needs it, preceded by or standing in for pgfence's own messages.

use std::sync::Arc;

use fence_core::classify::{analyze_with, Analysis, StatementKind};
use fence_core::lexer::{is_keyword, LexOptions, Lexer, TokKind};

use crate::error::SessionError;
use crate::protocol::message::{self as msg, Frontend};

use super::replies::{AfterCheck, Injected, Origin, QueryPlan, Request};
use super::tx::View;
use super::{CommitCheck, CopyIn, Flow, Flushed, Hold, Prepared, Remembered, Session};

/// Whether `sql` is `COPY ... FROM STDIN`: `COPY` first, then `FROM STDIN` outside
/// parentheses (so not the `FROM` of `COPY (SELECT ... FROM t) TO STDOUT`).
fn is_copy_from_stdin(sql: &[u8], options: LexOptions) -> bool {
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
    let text = name.text(sql);
    let spelled: Option<Vec<u8>> = match name.kind {
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

/// A count of statements in a Query, as [`QueryPlan`] keeps it: a message of at most 1 GiB
/// cannot hold more than `u32::MAX`.
fn count(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Session {
    pub(super) fn on_client_frame(&mut self, tag: u8, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(kind) = Frontend::from_tag(tag) else {
            return Err(SessionError::UnexpectedClientMessage(tag as char));
        };
        if let Some(status) = self.discard_until_sync {
            // A failed precheck stands for this batch: the server never sees it. Terminate
            // still ends the session, as it ends PostgreSQL's skipping to Sync.
            match kind {
                Frontend::Sync => {
                    self.discard_until_sync = None;
                    self.tx.batch_begun = false;
                    self.ready_to_client(status);
                }
                Frontend::Terminate => return Ok(Flow::Terminate),
                _ => {}
            }
            return Ok(Flow::Continue);
        }
        if self.skipping_to_sync {
            match kind {
                Frontend::Sync => self.skipping_to_sync = false,
                Frontend::Terminate => {}
                _ => {
                    self.to_server.extend_from_slice(frame);
                    return Ok(Flow::Continue);
                }
            }
        }
        if self.copy_through {
            return Ok(self.copy_through_hold(kind, frame));
        }
        if self.copy_in != CopyIn::None {
            match kind {
                Frontend::Sync | Frontend::Flush | Frontend::CopyData => {}
                // The COPY ends here; any other message means the client is not copying
                // (and would end a COPY the server started with a protocol error).
                _ => self.copy_in = CopyIn::None,
            }
        }
        match kind {
            Frontend::Query => {
                let flow = self.on_query(frame)?;
                // Counted once: a Query held comes back here to be handled again.
                if flow != Flow::Hold {
                    self.shared.stats.queries.add();
                }
                return Ok(flow);
            }
            Frontend::Parse => return self.on_parse(frame),
            Frontend::Bind => return self.on_bind(frame),
            Frontend::Execute => return self.on_execute(frame),
            Frontend::Describe => self.forward(frame, Request::Describe),
            Frontend::Close => self.on_close(frame)?,
            Frontend::Sync if self.copy_in == CopyIn::Started => {
                // Ignored by the server in copy-in mode: no reply owed, nothing ends.
                self.to_server.extend_from_slice(frame);
            }
            Frontend::Sync if self.copy_in == CopyIn::Sent => {
                // Ignored if the COPY started, the end of a failed batch if it did not:
                // either way no transaction commits here, so no check.
                self.forward(frame, Request::SyncInCopy);
            }
            Frontend::Sync => {
                if self.fence.enabled && self.tx.sync_needs_check() {
                    self.inject_check(false);
                    self.tx.end();
                }
                self.tx.end_batch();
                self.forward(frame, Request::Sync);
                if let CommitCheck::Sent { found_failed } = self.commit_check {
                    self.commit_check = CommitCheck::Pending { found_failed };
                    self.hold = Hold::Waiting;
                    return Ok(Flow::Pause);
                }
            }
            Frontend::FunctionCall => return Ok(self.on_function_call(frame)),
            Frontend::Flush
            | Frontend::CopyData
            | Frontend::CopyDone
            | Frontend::CopyFail
            | Frontend::Password => self.to_server.extend_from_slice(frame),
            // The session's end sends Terminate upstream, or keeps the connection.
            Frontend::Terminate => return Ok(Flow::Terminate),
        }
        Ok(Flow::Continue)
    }

    /// A client message while pgfence waits for a Query holding `COPY ... FROM STDIN` to be
    /// answered (see `Session::copy_through`): copy messages go upstream, the first other
    /// one is held until the Query is answered.
    #[cold]
    #[inline(never)]
    fn copy_through_hold(&mut self, kind: Frontend, frame: &[u8]) -> Flow {
        if matches!(
            kind,
            Frontend::CopyData | Frontend::CopyDone | Frontend::CopyFail
        ) {
            self.to_server.extend_from_slice(frame);
            return Flow::Continue;
        }
        self.copy_through = false;
        Flow::Hold
    }

    #[inline]
    fn forward(&mut self, frame: &[u8], request: Request) {
        self.to_server.extend_from_slice(frame);
        self.sent(request);
        self.replies.push(request, Origin::Client);
    }

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

    /// Notes when a client request that ends in ReadyForQuery went upstream.
    #[inline]
    fn sent(&mut self, request: Request) {
        if request.is_sync_point() {
            self.tx.batch_begun = false;
            if matches!(request, Request::Query | Request::FunctionCall) {
                // It ends the transaction its batch's Executes ran in (or makes it a block
                // with its `BEGIN`): what follows in the batch starts a new one, as after a
                // Sync (PostgreSQL runs a `VACUUM` alone there).
                self.tx.end_batch();
            }
            self.sync_sent.push_back(std::time::Instant::now());
        }
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

    /// A SQL `PREPARE` of this name went upstream (see [`prepared_in_sql`]): pgfence no
    /// longer knows what the name runs.
    fn forget_prepared_in_sql(&mut self, prepared: &PreparedInSql) {
        match prepared {
            PreparedInSql::No => {}
            PreparedInSql::Name(name) => {
                self.statements.remove(name);
                self.names_forgotten = true;
            }
            PreparedInSql::Unknown => {
                self.statements.clear();
                self.names_forgotten = true;
            }
        }
    }

    /// Whether a statement pgfence knew as `old` (`None`: none) runs as `new` does, as far as
    /// the fence cares: the same kinds of statements, with the same fencing comments.
    fn same_for_the_fence(&self, old: Option<&Arc<Prepared>>, new: Option<&Arc<Prepared>>) -> bool {
        match (old, new) {
            (Some(old), Some(new)) => {
                fn kinds(p: &Prepared) -> impl Iterator<Item = StatementKind> + '_ {
                    p.analysis.statements.iter().map(|s| s.kind)
                }
                old.copy_in == new.copy_in
                    && old.analysis.directives == new.analysis.directives
                    && kinds(old).eq(kinds(new))
            }
            // Nothing of that name on the server: a refused Parse leaves the Bind failing.
            (None, _) => !self.names_forgotten,
            (Some(_), None) => false,
        }
    }

    fn analyze(&mut self, sql: &[u8]) -> Analysis {
        let analysis = analyze_with(sql, self.lex);
        if analysis.mentions_fencing {
            self.fence.forget_session_token();
        }
        analysis
    }

    /// A held message comes back: `Some(true)` when pgfence's precheck passed, `Some(false)`
    /// when it failed (and the message must be dropped), `None` when nothing was held.
    fn take_hold(&mut self) -> Option<Result<(), u8>> {
        match std::mem::replace(&mut self.hold, Hold::None) {
            Hold::Passed => Some(Ok(())),
            Hold::Failed(status) => Some(Err(status)),
            Hold::None | Hold::Waiting => None,
        }
    }

    /// Keeps the client's message being handled, and stops reading the client, until what
    /// is in flight is answered (see [`Hold::Waiting`]); then the message is handled again.
    fn hold_until_answered(&mut self) -> Flow {
        self.hold = Hold::Waiting;
        Flow::Hold
    }

    /// Whether where `sql`'s statements end, and so what they are, depends on
    /// `standard_conforming_strings` (a `\'` in a plain literal) while a change of it may be
    /// in flight: the server parses `sql` under the setting its requests before `sql` leave,
    /// which pgfence learns (ParameterStatus) only with the ReadyForQuery that ends them. A
    /// Query sent behind a `SET standard_conforming_strings = off` once hid a `COMMIT` from
    /// pgfence this way (a literal to pgfence, a statement to the server) and committed a
    /// stale write. Such a text waits for that ReadyForQuery when one is owed.
    fn lexing_in_doubt(&self, sql: &[u8]) -> bool {
        // An Execute since the last sync point may have changed the setting even once it is
        // answered (a batch the client flushed and read): the server reports it only with
        // the ReadyForQuery of its sync point. Cheapest first: the common case has nothing
        // in flight.
        if !self.fence.enabled
            || (self.replies.is_empty() && !self.tx.batch_has_execute)
            || memchr::memchr(b'\\', sql).is_none()
            || (!self.tx.batch_has_execute && self.replies.state_settled())
        {
            return false;
        }
        let other = LexOptions {
            standard_conforming_strings: !self.lex.standard_conforming_strings,
        };
        analyze_with(sql, self.lex) != analyze_with(sql, other)
    }

    /// Whether a request running `analysis` waits for the replies in flight before pgfence
    /// plans its check, because where the check goes depends on them (see
    /// [`super::tx::TxState::placement_depends_on_replies`]): a pipelined COMMIT of a block
    /// an earlier request may have failed, or a savepoint command behind a `BEGIN` or
    /// `COMMIT` still in flight. It waits for the last ReadyForQuery owed, which the server
    /// sends now: so only at the start of a batch, or behind the part of one that changes
    /// no transaction state (a `Close`, `Parse` and `Bind` before a `COMMIT`; see
    /// [`super::replies::Replies::ready_tells_state`]). The server answers a batch only at
    /// its Sync, so pgfence cannot wait behind a statement of one, and its prediction
    /// stands there (see [`CommitCheck`]).
    fn waits_for_replies(&self, analysis: &Analysis) -> bool {
        // Cheapest first: a client that waits for each reply has nothing in flight, and the
        // queue is walked only for a statement that would wait.
        self.fence.enabled
            && !self.replies.is_empty()
            && analysis
                .statements
                .iter()
                .any(|s| self.tx.placement_depends_on_replies(s.kind))
            && self.replies.ready_tells_state()
    }

    /// Whether a statement that cannot run in a transaction block is checked on its own
    /// first: only when nothing is open or in flight, else it runs (and fails, or runs as
    /// part of the transaction) like any other statement and the commit check covers it.
    fn precheck_possible(&self) -> bool {
        self.fence.enabled && self.tx.view == View::Idle && !self.tx.batch_has_execute
    }

    /// Whether a statement that cannot run in a transaction block, sent as a Query now,
    /// runs on the server as it would alone: no block is open, and no Execute since the
    /// last sync point makes PostgreSQL refuse it "within a pipeline" (see
    /// [`super::tx::TxState::batch_pipelined`]).
    fn runs_alone(&self) -> bool {
        self.fence.enabled && self.tx.view == View::Idle && !self.tx.batch_pipelined
    }

    /// Whether a statement that cannot run in a transaction block, sent as a Query now inside
    /// a batch, waits to learn the state first: the batch ended its transaction with an
    /// Executed `COMMIT` or `ROLLBACK` (the view is unknown until a ReadyForQuery), and
    /// nothing after it makes PostgreSQL refuse the statement "within a pipeline" or opened a
    /// block.
    fn learns_state_first(&self) -> bool {
        self.tx.view == View::Unknown
            && !self.tx.batch_pipelined
            && self.batch_commits_inside()
            && matches!(
                self.commit_check,
                CommitCheck::None
                    | CommitCheck::Sent {
                        found_failed: false
                    }
            )
    }

    /// Whether a Query or FunctionCall sent now lands inside an extended-protocol batch,
    /// before its Sync: an Execute was sent since the last sync point, or requests of a
    /// batch are in flight behind it. The server runs such a message in the batch's
    /// implicit transaction and commits it at the message's end, with what the batch wrote
    /// before it (unless a block is open).
    fn inside_batch(&self) -> bool {
        self.tx.batch_has_execute
            || (!self.replies.is_empty() && !self.replies.ends_at_sync_point())
    }

    /// Inside a batch, behind transaction control whose ReadyForQuery is still owed: a check
    /// placed now would fail in a failed block (25P02) and make the server skip the message
    /// it precedes, which PostgreSQL would answer. Whether a block is open, or failed, is
    /// known at that ReadyForQuery; wait for it when what the batch sent after it changes no
    /// state (the server answers it at once). Behind a statement of the batch no check runs
    /// in a failed block: that statement fails first, and the message is skipped anyway.
    fn waits_for_state_inside_batch(&self) -> bool {
        self.tx.view == View::Unknown && self.replies.ready_tells_state()
    }

    /// Checks the batch's transaction before the Query or FunctionCall being handled, which
    /// commits it, and holds that message until the check is answered (see
    /// [`Flushed::Check`]): behind a failed check the server would skip it without a reply,
    /// where PostgreSQL answers it.
    fn check_inside_batch_first(&mut self, force: bool) -> Flow {
        self.inject_check_inside_batch(force);
        self.tx.end();
        msg::flush(&mut self.to_server);
        self.flushed = Flushed::Check;
        self.hold_until_answered()
    }

    /// Whether the batch's transaction may commit at a Query or FunctionCall inside it: no
    /// block is known to be open or failed, and no `BEGIN` of this batch opened one.
    fn batch_commits_inside(&self) -> bool {
        self.fence.enabled
            && matches!(self.tx.view, View::Idle | View::Unknown)
            && !self.tx.batch_begun
            && self.inside_batch()
    }

    fn on_query(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(sql) = msg::query_text(frame) else {
            return Err(SessionError::MalformedClientMessage("Query"));
        };
        if self.lexing_in_doubt(sql) {
            if !self.replies.ready_tells_state() {
                return Err(SessionError::QueryLexingInDoubt);
            }
            return Ok(self.hold_until_answered());
        }
        // Analysed where it lies, without the copies a prepared statement keeps.
        let analysis = &self.analyze(sql);
        if analysis.may_write() {
            Remembered::query(&mut self.last_write, sql);
        }
        Remembered::query(&mut self.last_sql, sql);
        if analysis
            .statements
            .iter()
            .any(|s| s.kind == StatementKind::Discard)
        {
            self.fence.dropping_prepared();
        }
        if analysis.prepares_in_sql {
            for statement in analysis.statements.iter().filter(|s| s.prepares_in_sql) {
                self.forget_prepared_in_sql(&prepared_in_sql(statement.text(sql), self.lex));
            }
        }
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
        if single == Some(StatementKind::NonTransactional) {
            match self.take_hold() {
                Some(Ok(())) => {
                    self.forward(frame, Request::Query);
                    return Ok(Flow::Continue);
                }
                Some(Err(status)) => {
                    self.ready_to_client(status);
                    return Ok(Flow::Continue);
                }
                None if self.runs_alone() && self.replies.is_empty() => {
                    self.tx.add_directives(&analysis.directives);
                    self.inject_check_with_sync(true, AfterCheck::Release);
                    return Ok(self.hold_until_answered());
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
                    return Ok(self.hold_until_answered());
                }
                None if self.learns_state_first() => {
                    // Inside a batch, behind an Executed `COMMIT` or `ROLLBACK` of it and only
                    // empty statements or a Parse, Bind, Describe or Close since: PostgreSQL
                    // runs the statement in a new transaction, outside a block unless the
                    // `COMMIT` chained one. A Flush brings the replies in flight; behind an
                    // error the statement goes on to the server as it is, which skips it.
                    // Once they are all in, a Sync of pgfence's tells whether a block is open
                    // (it ends only a transaction that has run nothing), and the statement is
                    // handled again: checked first on its own when none is.
                    if self.replies.is_empty() {
                        // Every reply came without an error (else the client's messages would
                        // go to the server as they are, up to its Sync): a check before a
                        // COMMIT of the batch passed, and the COMMIT ran.
                        self.commit_check = CommitCheck::None;
                        msg::sync(&mut self.to_server);
                        self.replies
                            .push(Request::Sync, Origin::Injected(Injected::StateSync));
                        self.tx.end_batch();
                    } else {
                        msg::flush(&mut self.to_server);
                        self.flushed = Flushed::ForPrecheck;
                    }
                    return Ok(self.hold_until_answered());
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
                        return Ok(self.hold_until_answered());
                    }
                    self.tx.add_directives(&analysis.directives);
                    return Ok(self.check_inside_batch_first(true));
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
                    return Ok(self.hold_until_answered());
                }
                None => {}
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
        if self.fence.fast_path && analysis.may_write() && !checked_first {
            if let Some((resource, token, fence)) =
                self.fence.stale(&analysis.directives, &self.shared.fences)
            {
                return Ok(self.fast_reject_query(analysis, resource, token, fence));
            }
        }
        // A Query that starts with `BEGIN` makes a block of the batch's transaction: it does
        // not end there, and its COMMIT is checked (a check before the `BEGIN` would take a
        // snapshot first, and a `BEGIN ISOLATION LEVEL` then fail).
        let opens_block = analysis
            .statements
            .first()
            .is_some_and(|s| s.kind == StatementKind::Begin);
        if !checked_first
            && !opens_block
            && self.tx.sync_needs_check()
            && self.batch_commits_inside()
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
        self.tx.add_directives(&analysis.directives);
        if matches!(
            single,
            Some(StatementKind::Commit | StatementKind::PrepareTransaction)
        ) && self.tx.commit_needs_check()
        {
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
            };
            self.hold = Hold::Waiting;
            return Ok(Flow::Pause);
        }
        // Nothing in flight and no block open: pgfence may prepare a statement first.
        // Not in the middle of a batch whose replies pgfence has read (see `Flushed`): the
        // Sync of the statement's preparation would commit what the batch ran.
        let quiet = self.tx.view == View::Idle
            && self.replies.is_empty()
            && !self.tx.batch_has_execute
            && self.commit_check == CommitCheck::None;
        let plan = self.tx.plan_simple(analysis);
        if plan.is_empty() {
            self.forward(frame, Request::Query);
            return Ok(Flow::Continue);
        }
        // Rewrite: the client's text with check statements where transactions end.
        let mut text = Vec::with_capacity(sql.len() + 256);
        let mut checks = Vec::with_capacity(plan.before.len() + 1);
        let mut copied = 0;
        let mut inserted = Vec::new();
        let mut chars_before = 0;
        let mut prepare = None;
        for (n, &(offset, index)) in plan.before.iter().enumerate() {
            text.extend_from_slice(&sql[copied..offset]);
            let at = text.len();
            prepare = prepare.or(self.simple_check(&mut text));
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
        if plan.at_end {
            text.extend_from_slice(b"\n;");
            prepare = prepare.or(self.simple_check(&mut text));
            checks.push(count(analysis.statements.len() + plan.before.len()));
        }
        self.shared.stats.checks.add();
        self.tx.directives.clear();
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
            };
            self.hold = Hold::Waiting;
            self.copy_through = analysis
                .statements
                .iter()
                .any(|s| is_copy_from_stdin(s.text(sql), self.lex));
            return Ok(Flow::Pause);
        }
        Ok(Flow::Continue)
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
        if self.tx.view == View::Idle && self.replies.is_empty() && !analysis.tx_control() {
            // Nothing open upstream: answer without a round trip.
            self.report_rejection(&rejection, "fast");
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

    /// A FunctionCall outside a transaction block is a transaction of its own, committed
    /// before pgfence could add anything to it: like a statement that cannot run in a
    /// block, it is checked first, in a transaction of its own. Inside a block, the check
    /// at COMMIT covers it. Inside an extended-protocol batch, before its Sync, it commits
    /// the batch's implicit transaction: checked first in that transaction, with no Sync
    /// (if the check fails, the server skips the call and the rest of the batch).
    fn on_function_call(&mut self, frame: &[u8]) -> Flow {
        if self.fence.enabled {
            match self.take_hold() {
                Some(Ok(())) => {}
                Some(Err(status)) => {
                    // The check's error went to the client; the call never runs.
                    self.ready_to_client(status);
                    return Flow::Continue;
                }
                None if self.precheck_possible() && self.replies.is_empty() => {
                    self.inject_check_with_sync(true, AfterCheck::Release);
                    return self.hold_until_answered();
                }
                None if self.batch_commits_inside() => {
                    if self.waits_for_state_inside_batch() {
                        return self.hold_until_answered();
                    }
                    return self.check_inside_batch_first(true);
                }
                None if self.replies.awaits_ready() && !self.tx.batch_has_execute => {
                    // Whether a block is open is known once the replies in flight are in.
                    return self.hold_until_answered();
                }
                None => {}
            }
        }
        // Outside a block and a batch the call is a transaction of its own (checked first),
        // ended with it; elsewhere it may have written to the transaction that goes on.
        if self.tx.view != View::Idle || self.inside_batch() {
            self.tx.dirty = true;
        }
        self.forward(frame, Request::FunctionCall);
        Flow::Continue
    }

    fn on_parse(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
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
            Some(p) => self.statements.insert(name.into(), p),
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

    fn portal(&self, name: &[u8]) -> Option<Arc<Prepared>> {
        if name.is_empty() {
            self.unnamed_portal.clone()
        } else {
            self.portals.get(name).cloned()
        }
    }

    fn on_bind(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some((portal, statement)) = msg::bind_names(frame) else {
            return Err(SessionError::MalformedClientMessage("Bind"));
        };
        let mut prepared = self.statement(statement);
        let doubtful = self
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
        let non_transactional = prepared.as_ref().is_some_and(|p| {
            matches!(&*p.analysis.statements, [only] if only.kind == StatementKind::NonTransactional)
        });
        // A Bind held for its precheck comes back here whatever its statement has become
        // meanwhile (a Parse before it that failed made pgfence forget the name). Nothing is
        // held for almost every Bind: no write to the hold then.
        let held = if self.hold == Hold::None {
            None
        } else {
            self.take_hold()
        };
        match held {
            Some(Ok(())) => {}
            Some(Err(status)) => {
                self.discard_until_sync = Some(status);
                return Ok(Flow::Continue);
            }
            None if non_transactional && self.precheck_possible() => {
                if let Some(p) = &prepared {
                    self.tx.add_directives(&p.analysis.directives);
                }
                self.inject_check_with_sync(true, AfterCheck::Release);
                return Ok(self.hold_until_answered());
            }
            None => {}
        }
        if prepared
            .as_ref()
            .is_some_and(|p| p.tx_control && self.waits_for_replies(&p.analysis))
        {
            return Ok(self.hold_until_answered());
        }
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

    fn on_execute(&mut self, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(portal) = msg::execute_portal(frame) else {
            return Err(SessionError::MalformedClientMessage("Execute"));
        };
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
            Some(p) => p.tx_control && self.waits_for_replies(&p.analysis),
            None => {
                self.fence.enabled
                    && self.tx.placement_depends_on_replies(kind)
                    && self.replies.ready_tells_state()
            }
        };
        if waits {
            return Ok(self.hold_until_answered());
        }
        self.shared.stats.queries.add();
        self.tx.on_execute(kind);
        if let Some(p) = &prepared {
            if p.analysis.may_write() {
                self.last_write = Some(Remembered::Prepared(p.clone()));
            }
            self.last_sql = Some(Remembered::Prepared(p.clone()));
        }
        if let Some(p) = &prepared {
            self.forget_prepared_in_sql(&p.prepares);
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
            if self.fence.fast_path && p.analysis.may_write() {
                if let Some((resource, token, fence)) = self
                    .fence
                    .stale(&p.analysis.directives, &self.shared.fences)
                {
                    self.inject_fast_reject_execute(&resource, token, fence);
                    return Ok(Flow::Continue);
                }
            }
            self.tx.add_directives(&p.analysis.directives);
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
        } else if kind == StatementKind::Execute && self.tx.commit_needs_check() {
            // Checked as if it committed. Most likely it does not, and the transaction goes
            // on: the check closes its portal, so that the next check can bind it again.
            // And if the check fails, the block stays failed, as after a statement that
            // failed (not ended as after a COMMIT, see `CommitCheck`).
            self.tx.view = View::Unknown;
            self.inject_check(false);
        }
        self.tx.on_statement(kind);
        self.note_copy_in(prepared.as_deref());
        self.forward(frame, Request::Execute);
        Ok(Flow::Continue)
    }

    /// The Execute of `prepared` goes upstream now: a `COPY ... FROM STDIN` may start.
    fn note_copy_in(&mut self, prepared: Option<&Prepared>) {
        if prepared.is_some_and(|p| p.copy_in) {
            self.copy_in = CopyIn::Sent;
        }
    }

    fn on_close(&mut self, frame: &[u8]) -> Result<(), SessionError> {
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
    use super::{is_copy_from_stdin, prepared_in_sql, PreparedInSql};

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
}
