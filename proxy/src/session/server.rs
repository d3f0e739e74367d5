//! Server replies in the Ready phase: each is matched to the request it answers (the queue
//! in [`super::replies`]) and forwarded, swallowed (replies to pgfence's own messages) or
//! turned into what the client must see (a rejection).

use std::sync::Arc;

use fence_core::rejection::Rejection;
use tracing::debug;

use crate::error::SessionError;
use crate::protocol::frame::next_frame;
use crate::protocol::message::{self as msg, Backend};

use super::replies::{AfterCheck, Injected, Origin, Pending, Request};
use super::{CommitCheck, CopyFromClient, CopyIn, Flushed, Hold, Prepared, Session};

/// `in_failed_sql_transaction`: the transaction had already failed before pgfence's check.
const IN_FAILED_TRANSACTION: &[u8] = b"25P02";
/// invalid_sql_statement_name: a Bind named a statement the server does not have.
const NO_SUCH_STATEMENT: &[u8] = b"26000";
/// The statement pgfence runs in a batch of its own (see `Session::run_own_statement`).
const OWN_STATEMENT_NAME: &[u8] = b"pgfence_own";
/// `syntax_error`: in a simple Query, the whole string failed to parse and none of it ran.
const SYNTAX_ERROR: &[u8] = b"42601";
/// `schema "pgfence" does not exist`: the check's schema was never installed here.
const NO_SUCH_SCHEMA: &[u8] = b"3F000";
/// `function pgfence.check(...) does not exist`: an older schema than this pgfence's.
const NO_SUCH_FUNCTION: &[u8] = b"42883";
/// Errors a Bind raises before it creates its portal (PostgreSQL's `exec_bind_message`): no
/// such statement, a malformed message (parameter counts), a failed block, and a named
/// portal already there (`duplicate_cursor`). After any other error the portal exists, not
/// defined: executed in the failed block, it answers EmptyQueryResponse.
const BIND_ERRORS_BEFORE_PORTAL: [&[u8]; 4] =
    [NO_SUCH_STATEMENT, b"08P01", IN_FAILED_TRANSACTION, b"42P03"];

impl Session {
    pub(super) fn on_server_frame(&mut self, tag: u8, frame: &[u8]) -> Result<(), SessionError> {
        let Some(kind) = Backend::from_tag(tag) else {
            return Err(SessionError::UnexpectedServerMessage(tag as char));
        };
        match kind {
            // Not those of pgfence's own requests (a `log_statement` echo of its check or
            // question): they are not the client's.
            Backend::NoticeResponse => self.forward_if_client(frame),
            Backend::NotificationResponse => self.forward_notification(frame),
            Backend::ParameterStatus => {
                let hold = !self.held_status.is_empty() || self.at_own_sync();
                if hold && self.held_status.is_empty() {
                    self.held_seen = self.login.params.clone();
                }
                self.on_parameter_status(frame)?;
                if hold {
                    self.hold_status(frame);
                } else {
                    self.to_client.extend_from_slice(frame);
                }
            }
            Backend::ParseComplete | Backend::BindComplete | Backend::CloseComplete => {
                let origin = self.replies.pop().map(|p| p.origin);
                match origin {
                    Some(Origin::Client) | None => self.to_client.extend_from_slice(frame),
                    Some(origin) if kind == Backend::ParseComplete => self.fence.prepared(origin),
                    Some(_) => {}
                }
            }
            Backend::RowDescription | Backend::NoData => match self.replies.front() {
                Some(p) if p.request == Request::Describe => {
                    let origin = p.origin;
                    self.replies.pop();
                    if origin == Origin::Client {
                        self.to_client.extend_from_slice(frame);
                    }
                }
                // pgfence's statements in a Query: a check, or the fast path's rejection (it
                // stands in for the client's statement, whose error is all the client sees).
                Some(p)
                    if p.request == Request::Query && (p.plan.in_check() || p.plan.fast_reject) => {
                }
                _ => self.forward_if_client(frame),
            },
            Backend::DataRow => match self.replies.front() {
                Some(p) if p.origin == Origin::Injected(Injected::ReadAudit) => {
                    self.read_audit_answer.on_reply(b'D', frame)?;
                }
                Some(p)
                    if p.origin == Origin::Injected(Injected::Check)
                        || (p.request == Request::Query && p.plan.in_check()) =>
                {
                    self.observe_check_result(msg::first_column(frame));
                }
                _ => self.forward_if_client(frame),
            },
            Backend::CommandComplete | Backend::EmptyQueryResponse | Backend::PortalSuspended => {
                if !self.fence.accepted.is_empty() {
                    match msg::command_tag(frame) {
                        b"ROLLBACK" => self.settle_accepted(false),
                        b"PREPARE TRANSACTION" => {
                            self.fence.hint_outlives_prepare = true;
                            self.settle_accepted(false);
                        }
                        _ => {}
                    }
                }
                if self.fence.drop_in_flight && frame.get(5) == Some(&b'D') {
                    let tag = msg::command_tag(frame);
                    if tag.starts_with(b"DEALLOCATE") || tag == b"DISCARD ALL" {
                        // See `FenceSettings::dropping_prepared`.
                        self.fence.forget_prepared();
                    }
                }
                self.on_statement_done(kind, frame)
            }
            Backend::ErrorResponse => self.on_error(frame),
            Backend::ReadyForQuery => self.on_ready(frame),
            Backend::CopyInResponse => {
                self.on_copy_in_response();
                if self.copy_from_client == CopyFromClient::MayStart {
                    // (Not when the client already sent its CopyDone or CopyFail behind the
                    // COPY, without waiting for this.)
                    self.copy_from_client = CopyFromClient::Running;
                }
                self.forward_if_client(frame);
            }
            Backend::ParameterDescription
            | Backend::CopyOutResponse
            | Backend::CopyBothResponse
            | Backend::CopyData
            | Backend::CopyDone
            | Backend::FunctionCallResponse => self.forward_if_client(frame),
            Backend::Authentication
            | Backend::BackendKeyData
            | Backend::NegotiateProtocolVersion => {
                return Err(SessionError::UnexpectedServerMessage(tag as char))
            }
        }
        Ok(())
    }

    /// Forwards a notification naming its sender as the sender's client knows it: a
    /// backend that serves a client of this pgfence by the pid pgfence gave that client
    /// (its own session's included, so that a client can tell its own notifications by
    /// comparing with the pid of its BackendKeyData, as libpq's `PQbackendPID` advises);
    /// any other backend by its own pid.
    fn forward_notification(&mut self, frame: &[u8]) {
        // Sent at pgfence's own Sync: PostgreSQL would send it right before the client's
        // next ReadyForQuery, as the ParameterStatus held with it (see `held_status`).
        let held = !self.held_status.is_empty()
            || !self.held_notifications.is_empty()
            || self.at_own_sync();
        let given = frame.get(5..9).and_then(|sender| {
            let sender = i32::from_be_bytes([sender[0], sender[1], sender[2], sender[3]]);
            match self.client_key {
                Some((pid, _)) if sender == self.backend_pid => Some(pid),
                _ => self.shared.cancel.client_pid(&self.upstream, sender),
            }
        });
        let to = if held {
            &mut self.held_notifications
        } else {
            &mut self.to_client
        };
        let at = to.len();
        to.extend_from_slice(frame);
        if let Some(pid) = given {
            to[at + 5..at + 9].copy_from_slice(&pid.to_be_bytes());
        }
    }

    fn forward_if_client(&mut self, frame: &[u8]) {
        if self
            .replies
            .front()
            .is_none_or(|p| p.origin == Origin::Client)
        {
            self.to_client.extend_from_slice(frame);
        }
    }

    fn on_statement_done(&mut self, kind: Backend, frame: &[u8]) {
        let Some(front) = self.replies.front_mut() else {
            self.to_client.extend_from_slice(frame);
            return;
        };
        if front.request == Request::Query {
            if front.origin != Origin::Client {
                return;
            }
            let in_check = front.plan.in_check();
            let before_final_check =
                front.plan.at_end && front.plan.checks.last() == Some(&(front.plan.done + 1));
            front.plan.done += 1;
            if in_check {
                // The check passed: the statement before it is complete after all.
                self.release_held_complete();
                return;
            }
            if before_final_check {
                self.held_complete = Some(frame.to_vec());
                return;
            }
            if self.check_failed
                && kind == Backend::CommandComplete
                && msg::command_tag(frame) == b"ROLLBACK"
            {
                // The COMMIT after a failed check: the client was told of the failure.
                return;
            }
            self.to_client.extend_from_slice(frame);
            return;
        }
        if front.request == Request::Execute {
            let origin = front.origin;
            self.replies.pop();
            if origin == Origin::Client {
                self.to_client.extend_from_slice(frame);
            }
            return;
        }
        self.forward_if_client(frame);
    }

    // Out of line: an error is never the per-message path, and inlined into `on_server_frame`
    // it made the compiler move that out of `on_server_bytes` (+170 instructions per
    // select-only transaction under callgrind).
    #[inline(never)]
    fn on_error(&mut self, frame: &[u8]) {
        if self
            .replies
            .front()
            .is_some_and(|p| p.origin == Origin::Injected(Injected::ReadAudit))
        {
            // The read audit's question, asked again (nothing else was in flight): the
            // session checks reads (see `Session::apply_read_audit`). A FATAL error ends the
            // session as the server's.
            let fields = msg::error_fields(frame);
            if matches!(fields.severity, b"FATAL" | b"PANIC") {
                self.to_client.extend_from_slice(frame);
            }
            self.read_audit_answer = super::read_audit::Answer::Failed(
                String::from_utf8_lossy(fields.code).into_owned(),
                String::from_utf8_lossy(fields.message).into_owned(),
            );
            return;
        }
        if self.copy_from_client == CopyFromClient::Running {
            // The COPY failed: the server left copy-in mode (and drops copy data from now).
            self.copy_from_client = CopyFromClient::None;
        }
        let fields = msg::error_fields(frame);
        let rejection = if fields.code.starts_with(b"FN") {
            Rejection::from_server(
                std::str::from_utf8(fields.code).unwrap_or_default(),
                &String::from_utf8_lossy(fields.message),
            )
        } else {
            None
        };
        // A check of this transaction accepted a token for the rejection's resource: the
        // fence it names may be that token, which the rejection rolls back.
        let advanced_here = rejection
            .as_ref()
            .and_then(|r| r.resource.as_ref())
            .is_some_and(|resource| self.fence.accepted.iter().any(|(r, _)| r == resource));
        if !self.fence.accepted.is_empty() {
            // Whatever failed, the transaction of the accepted tokens may not commit.
            self.settle_accepted(false);
        }
        if self.copy_in == CopyIn::Started {
            // The COPY failed: the server left copy-in mode and answers the next Sync.
            self.copy_in = CopyIn::Sent;
        }
        let Some(front) = self.replies.front() else {
            // An error nothing asked for (e.g. the server shutting down): pass it on.
            self.to_client.extend_from_slice(frame);
            return;
        };
        let (request, origin, fast) = (front.request, front.origin, front.plan.fast_reject);
        let about = match origin {
            Origin::Injected(Injected::Check | Injected::FastReject) if rejection.is_some() => {
                front.before.clone()
            }
            _ => None,
        };
        // A check before a COMMIT (the client's next statement) that fails skips the rest
        // of the Query too: does the client have statements after that COMMIT?
        let mut skips_client_work =
            request == Request::Query && front.plan.statements > front.plan.done + 2;
        // An error of the client's own statement in a Query pgfence inserted checks into:
        // its position is in the text sent, not in the client's.
        let inserted = (request == Request::Query && !front.plan.inserted.is_empty())
            .then(|| front.plan.inserted.clone());
        let from_check = match request {
            // The server parses the whole string before it runs any of it: a syntax error
            // there is the client's, even while the check that comes first is answered.
            Request::Query => front.plan.in_check() && fields.code != SYNTAX_ERROR,
            _ => matches!(
                origin,
                Origin::Injected(Injected::Check | Injected::PrepareCheck(_))
            ),
        };
        // A check before a COMMIT is in the last batch sent (the client's next messages
        // wait for its ReadyForQuery, see `CommitCheck`); one in an earlier batch is a check
        // of its own Sync.
        let before_commit = from_check && self.replies.front_in_last_batch();
        if fields.code == NO_SUCH_STATEMENT
            && ((request == Request::Bind && origin == Origin::Injected(Injected::Check))
                || (request == Request::Query && from_check))
        {
            // Dropped behind pgfence's back (a client's `DEALLOCATE pgfence_check_session`):
            // this check (its Bind, or its `EXECUTE` in a Query) fails, the next one
            // prepares its statement again.
            self.fence.forget_prepared();
        }
        if !request.is_sync_point() {
            let failed = self.replies.pop();
            let mut skipped = self.replies.skip_to_sync();
            // Only a check in the last batch is the pending COMMIT's: one placed earlier (before
            // a Query inside a batch) fails the Queries after it, that COMMIT's too.
            let commit_after_check =
                before_commit && matches!(self.commit_check, CommitCheck::Pending { .. });
            if !commit_after_check
                && self
                    .replies
                    .front()
                    .is_some_and(|p| p.origin == Origin::Client && !p.request.ends_a_skip())
            {
                // A Query (or FunctionCall) of the client's with no Sync in flight: the
                // server skips it too, and all after it, up to the Sync still to come. A
                // COMMIT among them never runs, and what the client sends next, held until
                // they were answered, goes to the server as it is, up to that Sync.
                while let Some(p) = self.replies.pop() {
                    skipped.push(p);
                }
                self.commit_check = CommitCheck::None;
                if self.hold == Hold::Waiting {
                    self.hold = Hold::None;
                }
            }
            for p in &skipped {
                if p.origin == Origin::Client && p.request.is_sync_point() {
                    // Never answered: its start is not a query's latency.
                    self.sync_sent.pop_front();
                }
            }
            // No Sync in flight: the server skips what the client sends up to its Sync.
            self.skipping_to_sync = self.replies.is_empty();
            // The client's COMMIT is the first of its messages skipped after a check.
            skips_client_work = skipped
                .iter()
                .filter(|p| p.origin == Origin::Client)
                .count()
                > 1;
            // Undone last first: each puts back what its name stood for before it.
            for skipped in skipped.into_iter().rev() {
                self.refused(skipped, None);
            }
            if let Some(failed) = failed {
                self.refused(failed, Some(fields.code));
            }
            if !from_check
                && self.replies.front().is_some_and(|p| {
                    p.origin == Origin::Injected(Injected::CheckSync(AfterCheck::Release))
                })
            {
                // A client message sent before a statement pgfence checks first (a Parse of
                // `VACUUM` under a name in use) failed: PostgreSQL skips the rest of the
                // batch, that statement included. The held message is dropped, and the
                // batch after it up to the client's Sync (see `Hold::Failed`).
                self.check_failed = true;
            }
            if from_check && matches!(self.commit_check, CommitCheck::Pending { .. }) {
                self.sync_after_skipped_commit();
            }
            if from_check && self.flushed == Flushed::Check && self.replies.is_empty() {
                // The check before a Query or FunctionCall held inside its batch failed (the
                // last thing sent: a check of an earlier sync point leaves that in the
                // queue): the server skips up to a Sync, so pgfence sends one. Its
                // ReadyForQuery answers the held message, as PostgreSQL answers a Query that
                // fails, and what the client sends after it runs, in a new transaction.
                msg::sync(&mut self.to_server);
                self.replies.push(
                    Request::Sync,
                    Origin::Injected(Injected::CheckSync(AfterCheck::Release)),
                );
                self.skipping_to_sync = false;
                self.tx.end_batch();
                self.tx.batch_begun = false;
            }
        }
        if from_check {
            self.observe_check_latency();
            if fields.code == IN_FAILED_TRANSACTION && !skips_client_work {
                // The transaction had failed before: its COMMIT rolls back as usual.
                self.release_held_complete();
                if let CommitCheck::Sent { found_failed }
                | CommitCheck::Pending { found_failed, .. } = &mut self.commit_check
                {
                    // Not when a check of an earlier Sync met the failed block: the
                    // COMMIT's own statements (the rest of its Query) may fail first.
                    *found_failed |= before_commit;
                }
                return;
            }
            // A rejection, or a failed transaction whose COMMIT had more statements after it
            // in the same Query or batch: PostgreSQL would have rolled back at the COMMIT
            // and run them, but the server skipped them after the check's error, so the
            // client gets that error (current transaction is aborted) rather than a COMMIT
            // that looks like it rolled back and statements that silently never ran.
            self.check_failed = true;
            // The implicit transaction failed at its end: no command tag for its last
            // statement, as from PostgreSQL.
            self.held_complete = None;
        }
        if let Origin::Injected(Injected::PrepareIdle(statement)) = origin {
            // pgfence's own, in a Sync of its own: simple Queries' checks stay SQL text.
            debug!(
                ?statement,
                code = %String::from_utf8_lossy(fields.code),
                message = %String::from_utf8_lossy(fields.message),
                "cannot prepare the check statement"
            );
            return;
        }
        if let Some(r) = &rejection {
            let path = if fast || origin == Origin::Injected(Injected::FastReject) {
                "fast"
            } else {
                "database"
            };
            // The fast path learns the fence only from pgfence's own check, and not where
            // it may be this transaction's own advance: any statement may raise FN001 with
            // any text, and a fence learnt that the database does not hold makes the fast
            // path reject leaders the database accepts.
            let learns = from_check && !advanced_here;
            self.report_rejection(r, path, about.as_ref(), learns);
            // The client sees the rejection as from a constraint: without the PL/pgSQL
            // call stack of pgfence's functions.
            msg::without_location(frame, &mut self.to_client);
            return;
        }
        if from_check
            && (fields.code == NO_SUCH_SCHEMA || fields.code == NO_SUCH_FUNCTION)
            && memchr::memmem::find(fields.message, b"pgfence").is_some()
        {
            let hint = self.schema_missing(fields.message);
            msg::with_hint(frame, hint.as_bytes(), &mut self.to_client);
            return;
        }
        match inserted {
            Some(inserted) if !from_check => {
                let map = |mut p: u64| {
                    for &(at, added) in inserted.iter().rev() {
                        if p > at {
                            p = p.saturating_sub(added);
                        }
                    }
                    p
                };
                msg::with_position(frame, map, &mut self.to_client);
            }
            _ => self.to_client.extend_from_slice(frame),
        }
    }

    /// The check failed for want of pgfence's schema (or of this version's functions) in
    /// the session's database: every write there fails until it is installed. Logged at
    /// WARN once per database and process; returns the hint the client gets.
    #[cold]
    fn schema_missing(&self, message: &[u8]) -> String {
        let database = &self.database;
        if self.shared.first_report_of_missing_schema(database) {
            let upstream = self.shared.config().upstream.to_string();
            tracing::warn!(
                database = database.as_str(),
                error = %String::from_utf8_lossy(message),
                "writes through pgfence fail in this database (and reads whose text may \
                 write): schema pgfence is missing or older than this pgfence; run \
                 `pgfence install --upstream {upstream} --database {database:?}` (or with \
                 --config and pgfence's file)"
            );
        }
        // The client is not told where the server is.
        format!(
            "pgfence's schema is missing in database \"{database}\", or older than this \
             pgfence: run `pgfence install --database {database}` against the server behind \
             pgfence (with pgfence's --upstream, or --config and its file; see pgfence's \
             README), then try again."
        )
    }

    /// The server refused `request` (its error) or skipped it (after an error earlier in
    /// its batch): what pgfence assumed when sending it does not hold.
    /// - A Parse of one of pgfence's statements: the statement does not exist (or, refused
    ///   in an aborted transaction, no longer does); the next use prepares it (a client
    ///   learns why from the error, if it was not skipped).
    /// - A client's Parse or Bind: the server kept the statement or portal of that name it
    ///   had before (a Parse of an existing name fails with 42P05, a Bind of an existing
    ///   portal with 42P03), or none, and pgfence puts back what it knew of it; `failed_with`
    ///   is the error of a request refused, `None` for one skipped. Except after a refused
    ///   Parse of the unnamed statement, which the server dropped first (a portal of a
    ///   statement pgfence does not know counts as one that may run anything), and a Bind
    ///   that failed after it created its portal (see [`BIND_ERRORS_BEFORE_PORTAL`]). When a
    ///   later request of the same name is in flight, it is that request's `before` that
    ///   changes: it was sent as if this one had happened.
    fn refused(&mut self, request: Pending, failed_with: Option<&[u8]>) {
        self.fence.not_prepared(request.origin);
        if request.origin != Origin::Client {
            return;
        }
        let before = request.before;
        // What the name stands for on the server now.
        let now = match request.request {
            Request::Parse if request.name.is_none() => before.filter(|_| failed_with.is_none()),
            Request::Parse => before,
            Request::Bind => match failed_with {
                Some(code) if !BIND_ERRORS_BEFORE_PORTAL.contains(&code) => {
                    Some(self.prepared(b""))
                }
                _ => before,
            },
            Request::CloseStatement | Request::ClosePortal => before,
            _ => return,
        };
        // A later request of that name in flight was sent as if this one had happened: what
        // it would put back is `now`. Otherwise pgfence's view of the name is `now`.
        let statement = request.request.sets_statement();
        if let Some(next) = self
            .replies
            .next_named_mut(statement, request.name.as_deref())
        {
            next.before = now;
            return;
        }
        let put = |names: &mut super::Names, name: Box<[u8]>, p: Option<Arc<Prepared>>| {
            match p {
                Some(p) => names.insert(name, p),
                None => names.remove(&name),
            };
        };
        match (statement, request.name) {
            (true, None) => self.unnamed_statement = now,
            (true, Some(name)) => put(&mut self.statements, name, now),
            (false, None) => self.unnamed_portal = now,
            (false, Some(name)) => put(&mut self.portals, name, now),
        }
    }

    /// The check right before a client's lone COMMIT Query failed: after an error in the
    /// extended protocol the server skips messages up to a Sync, so the COMMIT will never be
    /// answered. Send that Sync; its ReadyForQuery (failed block) stands for the COMMIT's,
    /// and `on_ready` ends the block with pgfence's ROLLBACK as for any skipped COMMIT.
    fn sync_after_skipped_commit(&mut self) {
        if let Some(front) = self.replies.front_mut() {
            if front.request == Request::Query && front.origin == Origin::Client {
                front.request = Request::Sync;
                msg::sync(&mut self.to_server);
            }
        }
    }

    /// A COPY FROM STDIN started. The Syncs the client sent after its Execute or Query (see
    /// [`CopyFromClient`]) are ignored by the server and owe no ReadyForQuery.
    fn on_copy_in_response(&mut self) {
        if !self
            .replies
            .front()
            .is_some_and(|p| matches!(p.request, Request::Execute | Request::Query))
        {
            return;
        }
        for _ in 0..self.replies.copy_in_started() {
            self.sync_sent.pop_front();
        }
        if self.copy_in == CopyIn::Sent && self.replies.len() == 1 {
            self.copy_in = CopyIn::Started;
        }
    }

    /// Sends the client a ReadyForQuery of pgfence's making, after the ParameterStatus
    /// messages held for it.
    pub(super) fn ready_to_client(&mut self, status: u8) {
        self.release_held_status();
        msg::ready_for_query(&mut self.to_client, status);
    }

    /// Whether what the server sends now comes with the ReadyForQuery of a Sync of
    /// pgfence's inside the client's batch (learning the state, or a check before a
    /// statement it checks first), which PostgreSQL would send with the client's next one.
    fn at_own_sync(&self) -> bool {
        self.replies.front().is_some_and(|p| {
            matches!(
                p.origin,
                Origin::Injected(Injected::StateSync | Injected::CheckSync(AfterCheck::Release))
            )
        })
    }

    /// Holds a ParameterStatus for the client's next ReadyForQuery (see `held_status`),
    /// behind those held already; a later one of the same setting takes the held one's
    /// place. (A value held from pgfence's Sync once reached the client after the newer one
    /// the client's own Sync brought, and the client kept the old value: review L, stop
    /// 55.)
    #[cold]
    fn hold_status(&mut self, frame: &[u8]) {
        let name = |f: &[u8]| msg::cstr(msg::body(f)).map(|(name, _)| name.to_vec());
        let new = name(frame);
        let mut held = Vec::with_capacity(self.held_status.len() + frame.len());
        let mut replaced = false;
        let mut at = 0;
        while let Ok(Some((_, len))) = next_frame(&self.held_status[at..], u32::MAX) {
            let old = &self.held_status[at..at + len];
            if name(old) == new {
                held.extend_from_slice(frame);
                replaced = true;
            } else {
                held.extend_from_slice(old);
            }
            at += len;
        }
        if !replaced {
            held.extend_from_slice(frame);
        }
        self.held_status = held;
    }

    /// Sends the client the ParameterStatus messages held for its ReadyForQuery, but those
    /// that tell it a value it already had (a setting changed and changed back: PostgreSQL
    /// would report neither).
    fn release_held_status(&mut self) {
        if !self.held_notifications.is_empty() {
            let held = std::mem::take(&mut self.held_notifications);
            self.to_client.extend_from_slice(&held);
        }
        if self.held_status.is_empty() {
            return;
        }
        let held = std::mem::take(&mut self.held_status);
        let seen = std::mem::take(&mut self.held_seen);
        let mut frames = Vec::new();
        let mut at = 0;
        while let Ok(Some((_, len))) = next_frame(&held[at..], u32::MAX) {
            frames.push(&held[at..at + len]);
            at += len;
        }
        // In PostgreSQL's order for one ReadyForQuery: by name, case aside (15's list of
        // settings is sorted so).
        frames.sort_by_key(|f| msg::cstr(msg::body(f)).map(|(name, _)| name.to_ascii_lowercase()));
        for frame in frames {
            if !seen.iter().any(|(_, f)| **f == *frame) {
                self.to_client.extend_from_slice(frame);
            }
        }
    }

    /// Forwards the CommandComplete held back for the end of an implicit transaction.
    fn release_held_complete(&mut self) {
        if let Some(frame) = self.held_complete.take() {
            self.to_client.extend_from_slice(&frame);
        }
    }

    /// A ReadyForQuery ended the transaction before the client's Binds still in flight (the
    /// start of the next batch): their statements' comment directives, which the ended
    /// transaction's went with, belong to the transaction they run in, which goes on (see
    /// `TxState::on_ready`). Each Bind bound what the next Bind of its portal found there,
    /// the last one what the portal holds now.
    #[cold]
    fn keep_bound_directives(&mut self) {
        let binds: Vec<_> = self.replies.client_binds().collect();
        let mut bound = Vec::with_capacity(binds.len());
        for (i, (portal, _)) in binds.iter().enumerate() {
            let statement = match binds[i + 1..].iter().find(|(next, _)| next == portal) {
                Some((_, before)) => before.cloned(),
                None => self.portal(portal.unwrap_or_default()),
            };
            bound.extend(statement);
        }
        for statement in bound {
            self.tx.add_directives(&statement.analysis.directives);
        }
    }

    /// Resets the check's per-backend hint after a prepared transaction (see
    /// `FenceSettings::hint_outlives_prepare`), once the session is idle with nothing in
    /// flight: in a transaction of its own, before anything the client sends next. In the
    /// extended protocol, with a statement of pgfence's own and the unnamed portal (none
    /// is open outside a transaction): a simple Query would drop the client's unnamed
    /// statement.
    fn reset_hint_if_stale(&mut self, status: u8) {
        if self.fence.hint_outlives_prepare
            && status == b'I'
            && self.replies.is_empty()
            && self.commit_check == CommitCheck::None
        {
            self.fence.hint_outlives_prepare = false;
            self.run_own_statement(
                b"RESET pgfence.accepted",
                Origin::Injected(Injected::ResetHint),
            );
        }
    }

    /// Runs `sql` (one statement) in a batch of pgfence's own, to its own Sync, every reply
    /// answering `origin`: not as a simple Query, which would drop the client's unnamed
    /// statement. Only between the client's transactions or in a failed block: it binds
    /// the unnamed portal, which only a transaction keeps, and a failed block (where only
    /// a statement that ends it may run) has nothing to execute in it anyway.
    fn run_own_statement(&mut self, sql: &[u8], origin: Origin) {
        let out = &mut self.to_server;
        // Closed first, as the checks' statements are: a client may have taken the name.
        msg::close(out, b'S', OWN_STATEMENT_NAME);
        self.replies.push(Request::Close, origin);
        msg::parse(out, OWN_STATEMENT_NAME, sql);
        self.replies.push(Request::Parse, origin);
        msg::bind_text(out, b"", OWN_STATEMENT_NAME, &[]);
        self.replies.push(Request::Bind, origin);
        msg::execute(out, b"");
        self.replies.push(Request::Execute, origin);
        msg::close(out, b'S', OWN_STATEMENT_NAME);
        self.replies.push(Request::Close, origin);
        msg::sync(out);
        self.replies.push(Request::Sync, origin);
    }

    /// A request waiting for the replies in flight before its own check (see
    /// `Session::waits_for_replies`) goes on; not when they were pgfence's own check.
    fn release_waiting(&mut self, answered: Option<Origin>) {
        if self.hold == Hold::Waiting
            && self.flushed == Flushed::No
            && !matches!(answered, Some(Origin::Injected(Injected::CheckSync(_))))
        {
            self.hold = Hold::None;
        }
    }

    fn on_ready(&mut self, frame: &[u8]) {
        let status = msg::ready_status(frame);
        // Pop up to and including the sync point this answers. What is still in flight
        // before it got no reply: the server skipped it, after an error that came before
        // it was sent (see `on_error` for those sent before the error).
        let mut answered = None;
        while let Some(p) = self.replies.pop() {
            if p.request.is_sync_point() {
                answered = Some(p.origin);
                let behind_commit = match self.commit_check {
                    // The batch's COMMIT, checked with no Sync: this Query or FunctionCall
                    // went after its check when that check is answered (none is left in
                    // flight), whatever checks the Query carries in its own text.
                    CommitCheck::Sent { .. } => {
                        p.request == Request::FunctionCall
                            || p.plan.checks.is_empty()
                            || !self.replies.check_in_flight()
                    }
                    // A Query that carries the check before its own COMMIT in its text is
                    // answered even when the check fails, and keeps it (see `on_ready`'s
                    // end); a lone COMMIT Query carries none.
                    CommitCheck::Pending { .. } => {
                        p.request == Request::FunctionCall || p.plan.checks.is_empty()
                    }
                    CommitCheck::None | CommitCheck::RollingBack { .. } => false,
                };
                if p.origin == Origin::Client
                    && matches!(p.request, Request::Query | Request::FunctionCall)
                    && behind_commit
                {
                    // A Query or FunctionCall answered behind a COMMIT pgfence checked with no
                    // Sync (of the client's batch, or a lone COMMIT Query itself): the check
                    // passed and the COMMIT ran (after a failed one the server skips all up to
                    // a Sync, this message included: see `on_error`).
                    self.commit_check = CommitCheck::None;
                }
                break;
            }
            // Undone first first: a later request of the same name is still in the queue
            // and gets what this one leaves (see `refused`).
            self.refused(p, None);
        }
        let settled = self.replies.is_empty();
        if settled {
            self.fence.drop_in_flight = false;
        }
        // Nothing in flight after this ReadyForQuery changes the state it reports (at most
        // the start of a batch that changes none, sent before a request that waits for it).
        let state_settled = self.replies.state_settled();
        if !self.fence.accepted.is_empty() && status != b'T' {
            // Idle: the transaction committed (a failure would have come as an error first).
            self.settle_accepted(status == b'I');
        }
        self.tx.on_ready(status, state_settled);
        if state_settled && status == b'I' && self.tx.batch_has_bind {
            self.keep_bound_directives();
        }
        self.release_held_complete();
        if settled {
            match self.commit_check {
                CommitCheck::Pending {
                    found_failed,
                    query,
                } if status == b'E' && (self.check_failed || found_failed) => {
                    // The check before the client's COMMIT failed, so the server skipped the
                    // COMMIT and left the block failed: end it before anything else runs.
                    // As the client sent its COMMIT: a Query drops the unnamed statement,
                    // an extended-protocol batch leaves it.
                    let rollback = Origin::Injected(Injected::Rollback);
                    if query {
                        msg::query(&mut self.to_server, b"ROLLBACK");
                        self.replies.push(Request::Query, rollback);
                    } else {
                        self.run_own_statement(b"ROLLBACK", rollback);
                    }
                    self.commit_check = CommitCheck::RollingBack { found_failed };
                    return;
                }
                CommitCheck::RollingBack { found_failed } => {
                    if found_failed && !self.check_failed {
                        msg::write_message(&mut self.to_client, b'C', |o| {
                            msg::put_cstr(o, b"ROLLBACK")
                        });
                    }
                    self.commit_check = CommitCheck::None;
                    self.hold = Hold::None;
                }
                CommitCheck::Pending { .. } => {
                    self.commit_check = CommitCheck::None;
                    self.hold = Hold::None;
                }
                CommitCheck::None | CommitCheck::Sent { .. } => self.release_waiting(answered),
            }
        } else if state_settled && self.commit_check == CommitCheck::None {
            // A request in the middle of its batch waiting for the state before the batch.
            self.release_waiting(answered);
        }
        match answered {
            Some(Origin::Injected(
                Injected::ResetHint | Injected::PrepareIdle(_) | Injected::StateSync,
            )) => {}
            Some(Origin::Injected(Injected::ReadAudit)) => {
                self.question_answered();
                let answer = std::mem::take(&mut self.read_audit_answer);
                let asked_at = self.question_sent_at();
                self.apply_read_audit(answer, asked_at, true);
            }
            Some(Origin::Injected(Injected::CheckSync(AfterCheck::Release))) => {
                self.hold = if self.check_failed {
                    Hold::Failed(status)
                } else {
                    Hold::Passed
                };
                self.check_failed = false;
            }
            _ => {
                self.check_failed = false;
                if let Some(sent) = self.sync_sent.pop_front() {
                    self.shared.metrics.query_latency.observe(sent.elapsed());
                }
                self.release_held_status();
                self.to_client.extend_from_slice(frame);
            }
        }
        self.reset_hint_if_stale(status);
    }
}
