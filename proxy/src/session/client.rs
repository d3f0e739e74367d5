//! Client messages in the Ready phase: which handler takes each one, and what every handler
//! asks before it forwards, holds or checks (what is in flight, whether a batch is open).
//! The simple protocol's Query is handled in [`super::query`], the extended protocol's
//! Parse, Bind, Execute and Close in [`super::extended`].

use fence_core::classify::{analyze_with, Analysis};
use fence_core::directive::Directive;
use fence_core::lexer::LexOptions;

use crate::error::SessionError;
use crate::protocol::message::{self as msg, Frontend};

use super::read_audit::Verdict;
use super::replies::{AfterCheck, Injected, Origin, Request};
use super::tx::{Bound, View};
use super::{CommitCheck, CopyFromClient, CopyIn, Flow, Flushed, Hold, Remembered, Session};

impl Session {
    pub(super) fn on_client_frame(&mut self, tag: u8, frame: &[u8]) -> Result<Flow, SessionError> {
        let Some(kind) = Frontend::from_tag(tag) else {
            return Err(SessionError::UnexpectedClientMessage(tag as char));
        };
        if !msg::well_formed(kind, frame) {
            return Err(SessionError::MalformedClientMessage(kind.name()));
        }
        if self.copy_from_client != CopyFromClient::None {
            match kind {
                Frontend::CopyData | Frontend::Sync | Frontend::Flush | Frontend::Terminate => {}
                Frontend::CopyDone | Frontend::CopyFail => {
                    self.copy_from_client = CopyFromClient::None;
                }
                _ => return Err(SessionError::MessageDuringCopyIn(kind.name())),
            }
        }
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
        // (A Parse names its statement right after the 5-byte header.)
        let unnamed = frame.get(5) == Some(&0);
        // Nothing in flight that may fail and make the server skip a Query sent now, which
        // then drops the unnamed statement (a Close of it may be skipped so: not counted).
        let query_runs = kind == Frontend::Query && self.replies.is_empty();
        match kind {
            Frontend::Query | Frontend::Parse | Frontend::Bind | Frontend::FunctionCall
                if self.verdict != Verdict::Fixed && !self.handled_again =>
            {
                // A Query drops the unnamed statement: pgfence's own only where the client's
                // message would drop or replace it too, or there is none.
                let drops_nothing = !self.unnamed_statement_alive
                    || kind == Frontend::Query
                    || (kind == Frontend::Parse && unnamed);
                self.refresh_read_audit(drops_nothing);
            }
            _ => {}
        }
        self.batch_open = match kind {
            Frontend::Parse
            | Frontend::Bind
            | Frontend::Describe
            | Frontend::Execute
            | Frontend::Close => true,
            Frontend::Sync | Frontend::Query | Frontend::FunctionCall => false,
            _ => self.batch_open,
        };
        if kind == Frontend::Parse && unnamed {
            self.unnamed_statement_alive = true;
        }
        match kind {
            Frontend::Query => {
                let queued = self.to_server.len();
                let flow = self.on_query(frame)?;
                if query_runs && flow != Flow::Hold && self.to_server.len() > queued {
                    self.unnamed_statement_alive = false;
                }
                // Counted once: a Query held comes back here to be handled again.
                if flow != Flow::Hold {
                    self.shared.stats.queries.add();
                    // Only a Query that went upstream starts anything (the fast path may
                    // answer a stale one without a round trip).
                    if self.to_server.len() > queued && self.query_copies_in {
                        self.copy_from_client = CopyFromClient::MayStart;
                    }
                }
                return Ok(flow);
            }
            Frontend::Parse => return self.on_parse(frame),
            Frontend::Bind => return self.on_bind(frame),
            Frontend::Execute => return self.on_execute(frame),
            Frontend::Describe => self.forward(frame, Request::Describe),
            Frontend::Close => self.on_close(frame)?,
            Frontend::Sync
                if self.copy_in == CopyIn::Started
                    || self.copy_from_client == CopyFromClient::Running =>
            {
                // Ignored by the server in copy-in mode: no reply owed, nothing ends.
                self.to_server.extend_from_slice(frame);
            }
            Frontend::Sync
                if self.copy_in == CopyIn::Sent
                    || self.copy_from_client == CopyFromClient::MayStart =>
            {
                // Ignored if the COPY started, the end of a failed batch if it did not:
                // either way no transaction commits here, so no check.
                self.forward(frame, Request::SyncInCopy);
            }
            Frontend::Sync => {
                if self.directives_in_doubt() {
                    return Ok(self.hold_until_answered());
                }
                if self.fence.enabled && self.tx.sync_needs_check() {
                    self.inject_check(false);
                    self.tx.end();
                } else if self.tx.view == View::Idle && !self.tx.batch_begun {
                    // The batch's implicit transaction ends here with nothing to check: its
                    // comments end with it, and must not fence what is pipelined behind.
                    self.tx.directives.clear();
                } else if self.tx.view == View::Unknown || self.tx.batch_begun {
                    self.tx.sync_point_in_doubt();
                }
                self.tx.end_batch();
                self.forward(frame, Request::Sync);
                if let CommitCheck::Sent { found_failed } = self.commit_check {
                    self.commit_check = CommitCheck::Pending {
                        found_failed,
                        query: false,
                    };
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
    pub(super) fn forward(&mut self, frame: &[u8], request: Request) {
        self.to_server.extend_from_slice(frame);
        self.sent(request);
        self.replies.push(request, Origin::Client);
    }

    /// Notes when a client request that ends in ReadyForQuery went upstream.
    #[inline]
    pub(super) fn sent(&mut self, request: Request) {
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

    pub(super) fn analyze(&mut self, sql: &[u8]) -> Analysis {
        let analysis = analyze_with(sql, self.lex);
        if analysis.mentions_fencing {
            self.fence.forget_session_token();
        }
        analysis
    }

    /// A held message comes back: `Some(true)` when pgfence's precheck passed, `Some(false)`
    /// when it failed (and the message must be dropped), `None` when nothing was held.
    pub(super) fn take_hold(&mut self) -> Option<Result<(), u8>> {
        match std::mem::replace(&mut self.hold, Hold::None) {
            Hold::Passed => Some(Ok(())),
            Hold::Failed(status) => Some(Err(status)),
            Hold::None | Hold::Waiting => None,
        }
    }

    /// Whether a message that may be checked, or checked behind, waits for the state: the
    /// transaction's comment directives are in doubt (see `TxState::directives_in_doubt`),
    /// and a ReadyForQuery in flight will tell. A comment token pipelined behind a
    /// `ROLLBACK` once fenced the next transaction with it.
    #[inline]
    pub(super) fn directives_in_doubt(&self) -> bool {
        self.tx.directives_in_doubt && !self.replies.is_empty() && self.replies.ready_tells_state()
    }

    /// Keeps the client's message being handled, and stops reading the client, until what
    /// is in flight is answered (see [`Hold::Waiting`]); then the message is handled again.
    pub(super) fn hold_until_answered(&mut self) -> Flow {
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
    pub(super) fn lexing_in_doubt(&self, sql: &[u8]) -> bool {
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
        // A change of `client_encoding` may be in flight too, reported the same way: to an
        // encoding pgfence refuses (SJIS, BIG5, GBK, ...), where the second byte of a
        // character may be `\`. There `E'表'` (0x95 0x5C) is a whole literal to the
        // server and an unfinished one to pgfence, which once took a stale INSERT after it
        // for part of that literal. Text with a `\` right after a byte above 0x7F is in
        // doubt (in UTF-8 too: `E'é\n'`, which only waits, or counts as unknown).
        if memchr::memmem::find_iter(sql, b"\\").any(|i| i > 0 && sql[i - 1] >= 0x80) {
            return true;
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
    pub(super) fn waits_for_replies(&self, analysis: &Analysis) -> bool {
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
    pub(super) fn precheck_possible(&self) -> bool {
        self.fence.enabled && self.tx.view == View::Idle && !self.tx.batch_has_execute
    }

    /// Whether a statement that cannot run in a transaction block, sent as a Query now,
    /// runs on the server as it would alone: no block is open, and no Execute since the
    /// last sync point makes PostgreSQL refuse it "within a pipeline" (see
    /// [`super::tx::TxState::batch_pipelined`]).
    pub(super) fn runs_alone(&self) -> bool {
        self.fence.enabled && self.tx.view == View::Idle && !self.tx.batch_pipelined
    }

    /// Whether a statement that cannot run in a transaction block, sent as a Query now inside
    /// a batch, waits to learn the state first: the batch ended its transaction with an
    /// Executed `COMMIT` or `ROLLBACK` (the view is unknown until a ReadyForQuery), and
    /// nothing after it makes PostgreSQL refuse the statement "within a pipeline" or opened a
    /// block.
    pub(super) fn learns_state_first(&self) -> bool {
        self.tx.view == View::Unknown && self.batch_ended_its_transaction()
    }

    /// Whether what the batch sent since its last Execute lets PostgreSQL run a statement
    /// that cannot run in a transaction block, if that Execute ended the transaction: none
    /// of it pipelines or opens a block, and no check before a `COMMIT` of it is known to
    /// have failed.
    fn batch_ended_its_transaction(&self) -> bool {
        !self.tx.batch_pipelined
            && self.batch_commits_inside()
            && matches!(
                self.commit_check,
                CommitCheck::None
                    | CommitCheck::Sent {
                        found_failed: false
                    }
            )
    }

    /// Whether a statement that cannot run in a transaction block, bound now to `portal`
    /// inside a batch, learns the state first (see [`Session::learn_state_first`]): the
    /// batch ran Executes, none made PostgreSQL refuse the statement "within a pipeline" or
    /// opened a block (behind an Executed `COMMIT`, `ROLLBACK` or `DISCARD ALL`, or Executes
    /// of empty statements), and, for a statement that `keeps_portals` (it runs in its
    /// transaction, see `Statement::runs_in_block`), no portal was bound since the last that
    /// ended a transaction, which a Sync of pgfence's would end (but the unnamed one when
    /// this Bind replaces it). The others commit that transaction as they run, which ends
    /// its portals as the Sync would. PostgreSQL runs the statement as alone; unchecked
    /// there, a stale `VACUUM FULL` committed what a function of an index expression wrote
    /// (stop 54).
    pub(super) fn learns_state_at_bind(&self, portal: &[u8], keeps_portals: bool) -> bool {
        let kept = keeps_portals
            && match self.tx.bound_since_end {
                Bound::Nothing => false,
                Bound::Unnamed => !portal.is_empty(),
                Bound::Named => true,
            };
        self.tx.batch_has_execute && !kept && self.batch_ended_its_transaction()
    }

    /// Holds the client's message being handled (a statement that cannot run in a
    /// transaction block, inside a batch that ended its transaction: see
    /// [`Session::learns_state_first`] and [`Session::learns_state_at_bind`]) until pgfence
    /// knows whether it runs alone. A Flush brings the replies in flight; behind an error
    /// the message goes on to the server as it is, which skips it. Once they are all in, a
    /// Sync of pgfence's tells whether a block is open (it ends only a transaction that has
    /// run nothing), and the message is handled again: checked first on its own when none
    /// is. `directives` are the statement's own; `force`: the statement needs the check
    /// whether or not the transaction it commits wrote.
    pub(super) fn learn_state_first(&mut self, directives: &[Directive], force: bool) -> Flow {
        if self.replies.is_empty() && self.tx.sync_needs_check() {
            // A Bind since the COMMIT may have written (see `TxState::on_bind`), in the
            // transaction that Sync would commit, as PostgreSQL commits it before the
            // statement: checked there, with the statement's own directives, and held for
            // the answer as a check before it on its own is. If a block is open, the check
            // runs in it and the statement fails there as it would.
            self.commit_check = CommitCheck::None;
            self.tx.add_directives(directives);
            self.inject_check_with_sync(force, AfterCheck::Release);
            self.tx.end_batch();
        } else if self.replies.is_empty() {
            // Every reply came without an error (else the client's messages would go to the
            // server as they are, up to its Sync): a check before a COMMIT of the batch
            // passed, and the COMMIT ran.
            self.commit_check = CommitCheck::None;
            msg::sync(&mut self.to_server);
            self.replies
                .push(Request::Sync, Origin::Injected(Injected::StateSync));
            self.tx.end_batch();
        } else {
            msg::flush(&mut self.to_server);
            self.flushed = Flushed::ForPrecheck;
        }
        self.hold_until_answered()
    }

    /// Whether a Query or FunctionCall sent now lands inside an extended-protocol batch,
    /// before its Sync: an Execute or a Bind was sent since the last sync point (a Bind
    /// starts the implicit transaction, and its parameters' conversion may write: a Query
    /// pgfence planned no check for once committed such a write after a flushed Bind), or
    /// requests of a batch are in flight behind it. The server runs such a message in the batch's
    /// implicit transaction and commits it at the message's end, with what the batch wrote
    /// before it (unless a block is open).
    fn inside_batch(&self) -> bool {
        self.tx.batch_has_execute
            || self.tx.batch_has_bind
            || (!self.replies.is_empty() && !self.replies.ends_at_sync_point())
    }

    /// Inside a batch, behind transaction control whose ReadyForQuery is still owed: a check
    /// placed now would fail in a failed block (25P02) and make the server skip the message
    /// it precedes, which PostgreSQL would answer. Whether a block is open, or failed, is
    /// known at that ReadyForQuery; wait for it when what the batch sent after it changes no
    /// state (the server answers it at once). Behind a statement of the batch no check runs
    /// in a failed block: that statement fails first, and the message is skipped anyway.
    pub(super) fn waits_for_state_inside_batch(&self) -> bool {
        self.tx.view == View::Unknown && self.replies.ready_tells_state()
    }

    /// Checks the batch's transaction before the Query or FunctionCall being handled, which
    /// commits it, and holds that message until the check is answered (see
    /// [`Flushed::Check`]): behind a failed check the server would skip it without a reply,
    /// where PostgreSQL answers it.
    pub(super) fn check_inside_batch_first(&mut self, force: bool) -> Flow {
        self.inject_check_inside_batch(force);
        self.tx.end();
        msg::flush(&mut self.to_server);
        self.flushed = Flushed::Check;
        self.hold_until_answered()
    }

    /// Whether the batch's transaction may commit at a Query or FunctionCall inside it: no
    /// block is known to be open or failed, and no `BEGIN` of this batch opened one.
    pub(super) fn batch_commits_inside(&self) -> bool {
        self.fence.enabled
            && matches!(self.tx.view, View::Idle | View::Unknown)
            && !self.tx.batch_begun
            && self.inside_batch()
    }

    /// A FunctionCall outside a transaction block is a transaction of its own, committed
    /// before pgfence could add anything to it: like a statement that cannot run in a
    /// block, it is checked first, in a transaction of its own. Inside a block, the check
    /// at COMMIT covers it. Inside an extended-protocol batch, before its Sync, it commits
    /// the batch's implicit transaction: checked first in that transaction, with no Sync
    /// (if the check fails, the server skips the call and the rest of the batch).
    fn on_function_call(&mut self, frame: &[u8]) -> Flow {
        if self.directives_in_doubt() {
            return self.hold_until_answered();
        }
        if self.fence.enabled {
            match self.take_hold() {
                Some(Ok(())) => {}
                Some(Err(status)) => {
                    // The check's error went to the client; the call never runs.
                    self.ready_to_client(status);
                    return Flow::Continue;
                }
                None if self.precheck_possible() && self.replies.is_empty() => {
                    self.remember_function_call(frame);
                    self.inject_check_with_sync(true, AfterCheck::Release);
                    return self.hold_until_answered();
                }
                None if self.batch_commits_inside() => {
                    if self.waits_for_state_inside_batch() {
                        return self.hold_until_answered();
                    }
                    if !self.tx.dirty {
                        // What a rejection names: the call, where the batch's transaction
                        // wrote nothing before it (the log named the `COMMIT` before it;
                        // review P, stop 55).
                        self.remember_function_call(frame);
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
            self.remember_function_call(frame);
        }
        self.forward(frame, Request::FunctionCall);
        Flow::Continue
    }

    /// Keeps a FunctionCall as what a check is owed for: it has no text, so the rejection
    /// log names the function by its oid.
    #[cold]
    fn remember_function_call(&mut self, frame: &[u8]) {
        let oid = frame
            .get(5..9)
            .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
        let text = format!("FunctionCall (function oid {oid})");
        Remembered::query(&mut self.last_write, text.as_bytes());
    }
}
