//! The replies the server still owes, in order, and what to do with each.
//!
//! Every message sent upstream that the server answers gets an entry: the client's own
//! messages (their replies are forwarded) and the ones pgfence injects (their replies are
//! swallowed, and their errors turned into what the client sees). This is how pgfence stays
//! in step with pipelined extended-protocol traffic.

use std::collections::VecDeque;
use std::sync::Arc;

use super::fence::CheckStatement;
use super::Prepared;

/// Which request a reply answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// A simple Query: replies until ReadyForQuery.
    Query,
    Parse,
    Bind,
    /// Describe of a statement (`S`, ParameterDescription then RowDescription/NoData) or of
    /// a portal (`P`, RowDescription/NoData).
    Describe,
    Execute,
    /// pgfence's own Close.
    Close,
    /// A client's Close of a statement (`S`): like a Parse, it changes what the name
    /// stands for, unless the server skips it.
    CloseStatement,
    /// A client's Close of a portal (`P`).
    ClosePortal,
    /// Answered by ReadyForQuery.
    Sync,
    /// A Sync sent after the Execute of a `COPY ... FROM STDIN` and before its CopyDone or
    /// CopyFail. PostgreSQL ignores Sync in copy-in mode: this one is answered only if the
    /// COPY failed to start (see [`Replies::copy_in_started`]).
    SyncInCopy,
    /// A FunctionCall: FunctionCallResponse then ReadyForQuery.
    FunctionCall,
}

impl Request {
    /// Whether this request (a client's) changes what a statement name stands for.
    #[inline]
    pub fn sets_statement(self) -> bool {
        matches!(self, Request::Parse | Request::CloseStatement)
    }

    /// Whether this request (a client's) changes what a portal name stands for.
    #[inline]
    pub fn sets_portal(self) -> bool {
        matches!(self, Request::Bind | Request::ClosePortal)
    }

    /// Whether this request (a client's) leaves the transaction's state as it was when it
    /// succeeds: a Parse, Bind, Describe or Close. (When it fails, the server skips the rest
    /// of its batch, which then changes nothing either until its Sync.)
    #[inline]
    pub fn keeps_transaction_state(self) -> bool {
        matches!(
            self,
            Request::Parse
                | Request::Bind
                | Request::Describe
                | Request::CloseStatement
                | Request::ClosePortal
        )
    }

    /// Whether ReadyForQuery ends this request.
    pub fn is_sync_point(self) -> bool {
        matches!(
            self,
            Request::Query | Request::Sync | Request::SyncInCopy | Request::FunctionCall
        )
    }

    /// Ends the server's skipping after an error in the extended protocol: a Sync. (A
    /// Query or FunctionCall sent before that Sync is skipped like the rest.)
    pub fn ends_a_skip(self) -> bool {
        matches!(self, Request::Sync | Request::SyncInCopy)
    }
}

/// Who sent the request, and so what happens to its replies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// The client's message: forward the replies.
    Client,
    /// Injected by pgfence: swallow the replies.
    Injected(Injected),
}

/// What an injected request was for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Injected {
    /// Preparing the fast-path rejection statement.
    Prepare,
    /// Preparing this check statement: in an aborted transaction it fails with 25P02 as the
    /// check itself would.
    PrepareCheck(CheckStatement),
    /// Preparing this check statement, for the `EXECUTE` of simple Queries' checks, while
    /// the session is idle with nothing in flight: Close, Parse and a Sync of its own, whose
    /// replies, an error included, are pgfence's alone.
    PrepareIdle(CheckStatement),
    /// Binding or executing the commit-time check.
    Check,
    /// Binding the fast-path rejection (its Execute stands in for the client's).
    FastReject,
    /// The Sync after a check pgfence runs in its own transaction before a statement that
    /// cannot run in a transaction block (or a FunctionCall outside one).
    CheckSync(AfterCheck),
    /// Ends a transaction block whose COMMIT the server skipped because the check before it
    /// failed (see `CommitCheck`).
    Rollback,
    /// `RESET pgfence.accepted` after a prepared transaction (see
    /// `FenceSettings::hint_outlives_prepare`): its replies are pgfence's alone.
    ResetHint,
    /// A Sync of pgfence's own inside a batch whose replies are all in, without an error,
    /// sent to learn from its ReadyForQuery whether a transaction block is open (see
    /// `Session::learns_state_first`). The ParameterStatus messages before it are held for
    /// the client's next ReadyForQuery, where PostgreSQL would have sent them.
    StateSync,
    /// The read audit's question again, while the session is idle with nothing in flight
    /// (see `Session::refresh_read_audit`): its replies are pgfence's alone.
    ReadAudit,
}

/// What to do once a check that ran in its own Sync is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterCheck {
    /// The client's message is held until the check is answered.
    Release,
}

/// A simple Query's plan: which of its statements pgfence added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QueryPlan {
    /// Indexes (in statement order) of the injected check statements, ascending.
    pub checks: Vec<u32>,
    /// Statements answered so far.
    pub done: u32,
    /// The query was rewritten to the fast-path rejection.
    pub fast_reject: bool,
    /// The last check stands for the end of the implicit transaction (it follows the
    /// client's last statement).
    pub at_end: bool,
    /// How many statements the query sent upstream has, pgfence's included. (Counts are
    /// `u32`, which a Query's at most 1 GiB of text cannot exceed: every reply owed is one
    /// `Pending`, moved in and out of the queue, so its size counts.)
    pub statements: u32,
    /// Where pgfence inserted text into the client's query: (character index in the text
    /// sent, characters inserted), ascending; error positions after them are moved back.
    pub inserted: Vec<(u64, u64)>,
}

impl QueryPlan {
    /// Whether the statement being answered now is one pgfence added.
    #[inline]
    pub fn in_check(&self) -> bool {
        !self.checks.is_empty() && self.checks.contains(&self.done)
    }
}

/// One reply the server owes.
#[derive(Debug, Clone)]
pub struct Pending {
    pub request: Request,
    pub origin: Origin,
    /// For `Query`: the plan. Boxed elsewhere would cost an allocation per query; the
    /// empty plan allocates nothing.
    pub plan: QueryPlan,
    /// For a client's Parse, Bind or Close: the statement or portal it names (`None`: the
    /// unnamed one), whose analysis pgfence must put back if the server refuses or skips the
    /// request.
    pub name: Option<Box<[u8]>>,
    /// What that name stood for before (`None`: nothing pgfence knew of). For pgfence's
    /// check and fast-path rejection: the client's statement they are about, for the
    /// rejection log (see [`Replies::push_about`]).
    pub before: Option<Arc<Prepared>>,
}

/// Entries beyond which an empty queue gives its memory back.
const SHRINK_QUEUE_ABOVE: usize = 1024;

/// The queue of owed replies.
#[derive(Debug, Default)]
pub struct Replies {
    queue: VecDeque<Pending>,
    /// How many client Parses and statement Closes are in the queue (see
    /// [`Self::statement_in_doubt`]).
    statement_changes: u32,
}

impl Replies {
    #[inline]
    pub fn push(&mut self, request: Request, origin: Origin) {
        self.push_about(request, origin, None);
    }

    /// pgfence's request about the client's statement `about` (a check, a fast-path
    /// rejection): the client may send more before the server answers, and the rejection
    /// log names this one.
    #[inline]
    pub fn push_about(&mut self, request: Request, origin: Origin, about: Option<Arc<Prepared>>) {
        self.queue.push_back(Pending {
            request,
            origin,
            plan: QueryPlan::default(),
            name: None,
            before: about,
        });
    }

    /// A client's Parse, Bind or Close of statement or portal `name`.
    #[inline]
    pub fn push_named(&mut self, request: Request, name: &[u8], before: Option<Arc<Prepared>>) {
        debug_assert!(!request.is_sync_point(), "{request:?} is not named");
        if request.sets_statement() {
            self.statement_changes += 1;
        }
        self.queue.push_back(Pending {
            request,
            origin: Origin::Client,
            plan: QueryPlan::default(),
            // The unnamed statement and portal, most drivers' every query: no allocation.
            name: (!name.is_empty()).then(|| name.into()),
            before,
        });
    }

    /// The client's Binds in flight, in the order sent: the portal each names (`None`: the
    /// unnamed one) and what that portal stood for before it.
    pub fn client_binds(&self) -> impl Iterator<Item = (Option<&[u8]>, Option<&Arc<Prepared>>)> {
        self.queue
            .iter()
            .filter(|p| p.request == Request::Bind && p.origin == Origin::Client)
            .map(|p| (p.name.as_deref(), p.before.as_ref()))
    }

    /// Whether a client's Parse or Close of a statement is in flight (see
    /// [`Replies::statement_in_doubt`]): almost never, and then only is that looked at.
    #[inline]
    pub fn statements_change(&self) -> bool {
        self.statement_changes != 0
    }

    /// Whether a Bind of statement `name` (empty: the unnamed one) sent now may run
    /// something else than pgfence thinks: the client's last Parse or Close of that name in
    /// flight is in an earlier batch (a Query, Sync or FunctionCall went after it), and the
    /// server may yet refuse or skip it, and those before it, and keep what the name stood
    /// for before one of them; the Bind runs that, because an error in an earlier batch does
    /// not skip it. Returns what the name stood for, as pgfence knew it, before each of
    /// those requests (their `before`), latest first.
    pub fn statement_in_doubt<'a>(
        &'a self,
        name: &'a [u8],
    ) -> Option<impl Iterator<Item = Option<&'a Arc<Prepared>>> + 'a> {
        if self.statement_changes == 0 {
            return None;
        }
        let name = (!name.is_empty()).then_some(name);
        let sets = move |p: &Pending| {
            p.request.sets_statement() && p.origin == Origin::Client && p.name.as_deref() == name
        };
        let last = self.queue.iter().rposition(sets)?;
        if !self.queue.range(last..).any(|p| p.request.is_sync_point()) {
            // In this batch: if it fails, the server skips the Bind too.
            return None;
        }
        Some(
            self.queue
                .range(..=last)
                .rev()
                .filter(move |p| sets(p))
                .map(|p| p.before.as_ref()),
        )
    }

    /// Whether the client's last request of this batch (since the last sync point) that
    /// sets portal `name` (empty: the unnamed one) is a Close: an Execute of it then runs
    /// nothing (the server answers 34000, or skips it after an earlier error).
    pub fn portal_closed_in_batch(&self, name: &[u8]) -> bool {
        let name = (!name.is_empty()).then_some(name);
        for p in self.queue.iter().rev() {
            if p.request.is_sync_point() {
                return false;
            }
            if p.request.sets_portal() && p.origin == Origin::Client && p.name.as_deref() == name {
                return p.request == Request::ClosePortal;
            }
        }
        false
    }

    /// The first client request still owed a reply that changes what statement `name`
    /// (when `statement`; else portal `name`) stands for (`None`: the unnamed one): a Parse
    /// or Close of the statement, a Bind or Close of the portal.
    pub fn next_named_mut(&mut self, statement: bool, name: Option<&[u8]>) -> Option<&mut Pending> {
        self.queue.iter_mut().find(|p| {
            let sets = if statement {
                p.request.sets_statement()
            } else {
                p.request.sets_portal()
            };
            sets && p.origin == Origin::Client && p.name.as_deref() == name
        })
    }

    #[inline]
    pub fn push_query(&mut self, plan: QueryPlan) {
        self.queue.push_back(Pending {
            request: Request::Query,
            origin: Origin::Client,
            plan,
            name: None,
            before: None,
        });
    }

    /// Whether an Execute of pgfence's check (see `Session::inject_check`) is still owed
    /// its reply.
    pub fn check_in_flight(&self) -> bool {
        self.queue
            .iter()
            .any(|p| p.request == Request::Execute && p.origin == Origin::Injected(Injected::Check))
    }

    #[inline]
    pub fn front(&self) -> Option<&Pending> {
        self.queue.front()
    }

    #[inline]
    pub fn front_mut(&mut self) -> Option<&mut Pending> {
        self.queue.front_mut()
    }

    #[inline]
    pub fn pop(&mut self) -> Option<Pending> {
        let p = self.queue.pop_front();
        if let Some(p) = &p {
            if p.request.sets_statement() && p.origin == Origin::Client {
                self.statement_changes -= 1;
            }
        }
        p
    }

    #[inline]
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Gives back the memory of a queue a long pipeline grew, once it is empty.
    #[inline]
    pub fn shrink_when_empty(&mut self) {
        if self.queue.is_empty() && self.queue.capacity() > SHRINK_QUEUE_ABOVE {
            self.queue = VecDeque::new();
        }
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Whether a ReadyForQuery is sure to come: a Query, Sync or FunctionCall is owed one.
    pub fn awaits_ready(&self) -> bool {
        self.queue
            .iter()
            .any(|p| p.request.is_sync_point() && p.request != Request::SyncInCopy)
    }

    /// Whether a ReadyForQuery will answer everything in flight: something is, and the last
    /// request sent is a Query, Sync or FunctionCall, so no batch is half sent.
    #[inline]
    pub fn ends_at_sync_point(&self) -> bool {
        self.queue
            .back()
            .is_some_and(|p| p.request.is_sync_point() && p.request != Request::SyncInCopy)
    }

    /// Walks back from the last request sent to the last sync point in flight: `None` when
    /// one of those requests may change the transaction's state (anything but a client's
    /// [`Request::keeps_transaction_state`]), else whether such a sync point is in flight.
    fn state_since_last_sync_point(&self) -> Option<bool> {
        for p in self.queue.iter().rev() {
            if p.request.is_sync_point() {
                return Some(p.request != Request::SyncInCopy);
            }
            if p.origin != Origin::Client || !p.request.keeps_transaction_state() {
                return None;
            }
        }
        Some(false)
    }

    /// Whether the request at the front is in the last batch sent: no Query, Sync or
    /// FunctionCall in flight before the last request.
    pub fn front_in_last_batch(&self) -> bool {
        let before_last = self.queue.len().saturating_sub(1);
        !self
            .queue
            .iter()
            .take(before_last)
            .any(|p| p.request.is_sync_point())
    }

    /// Whether a ReadyForQuery in flight will tell the transaction's state as it is at this
    /// point of the client's stream: a Query, Sync or FunctionCall is in flight, and the
    /// half-sent batch after it (if any) changes no state. The server answers that sync
    /// point now, and the batch only at its own Sync, so a request that depends on that
    /// state can wait for the ReadyForQuery in the middle of its batch.
    #[inline]
    pub fn ready_tells_state(&self) -> bool {
        match self.queue.back() {
            None => false,
            // A batch's first message, or a Query: what drivers send.
            Some(last) if last.request.is_sync_point() => last.request != Request::SyncInCopy,
            Some(_) => self.state_since_last_sync_point() == Some(true),
        }
    }

    /// Whether what is still in flight leaves the transaction's state as the last
    /// ReadyForQuery reported it: nothing, or the start of a batch that changes no state
    /// (see [`Self::ready_tells_state`]).
    #[inline]
    pub fn state_settled(&self) -> bool {
        self.queue.is_empty() || self.state_since_last_sync_point() == Some(false)
    }

    /// The server answered the Execute at the front with CopyInResponse: it is in copy-in
    /// mode and ignores the Syncs the client sent since (they come right after the Execute).
    /// Drops their entries and returns how many there were; afterwards the Execute is the
    /// only entry left if nothing else was sent since.
    pub fn copy_in_started(&mut self) -> usize {
        let mut dropped = 0;
        while self
            .queue
            .get(1)
            .is_some_and(|p| p.request == Request::SyncInCopy)
        {
            self.queue.remove(1);
            dropped += 1;
        }
        dropped
    }

    /// After an error in the extended protocol the server skips every message up to the
    /// next Sync, Queries and FunctionCalls included: drops their entries and returns them
    /// (none of them happened). Without a Sync in flight it stops at the first Query or
    /// FunctionCall, which the server skips too, up to a Sync yet to be sent: the caller
    /// knows whether that is the client's (see `Session::on_error`) or pgfence's, after a
    /// check before a client's COMMIT (see `Session::sync_after_skipped_commit`).
    pub fn skip_to_sync(&mut self) -> Vec<Pending> {
        let sync_in_flight = self.queue.iter().any(|p| p.request.ends_a_skip());
        let mut skipped = Vec::new();
        while self.queue.front().is_some_and(|p| {
            if sync_in_flight {
                !p.request.ends_a_skip()
            } else {
                !p.request.is_sync_point()
            }
        }) {
            skipped.extend(self.pop());
        }
        skipped
    }
}

#[cfg(test)]
mod tests {
    use super::{Injected, Origin, QueryPlan, Replies, Request};

    fn queue(requests: &[Request]) -> Replies {
        let mut replies = Replies::default();
        for &request in requests {
            match request {
                Request::Query => replies.push_query(QueryPlan::default()),
                Request::Parse | Request::Bind | Request::CloseStatement | Request::ClosePortal => {
                    replies.push_named(request, b"", None)
                }
                _ => replies.push(request, Origin::Client),
            }
        }
        replies
    }

    /// Pops up to and including the first sync point, as a ReadyForQuery does.
    fn answer_first_batch(replies: &mut Replies) {
        while let Some(p) = replies.pop() {
            if p.request.is_sync_point() {
                break;
            }
        }
    }

    #[test]
    fn an_error_skips_queries_up_to_the_sync_in_flight() {
        use Request::*;
        let requests = |skipped: &[super::Pending]| -> Vec<Request> {
            skipped.iter().map(|p| p.request).collect()
        };
        let mut synced = queue(&[Bind, Execute, Query, FunctionCall, Parse, Sync, Query]);
        synced.pop();
        assert_eq!(
            requests(&synced.skip_to_sync()),
            [Execute, Query, FunctionCall, Parse]
        );
        assert_eq!(synced.front().map(|p| p.request), Some(Sync));
        // No Sync in flight: the caller decides about the Query (the client's Sync, or
        // pgfence's after a check before a COMMIT).
        let mut unsynced = queue(&[Bind, Execute, Query, Parse]);
        unsynced.pop();
        assert_eq!(requests(&unsynced.skip_to_sync()), [Execute]);
        assert_eq!(unsynced.front().map(|p| p.request), Some(Query));
        let mut in_copy = queue(&[Execute, Query, SyncInCopy]);
        in_copy.pop();
        assert_eq!(requests(&in_copy.skip_to_sync()), [Query]);
        assert_eq!(in_copy.front().map(|p| p.request), Some(SyncInCopy));
    }

    #[test]
    fn a_ready_for_query_tells_the_state_behind_requests_that_keep_it() {
        use Request::*;
        assert!(
            !queue(&[]).ready_tells_state(),
            "nothing in flight: nothing to wait for"
        );
        assert!(queue(&[Parse, Bind, Execute, Sync]).ready_tells_state());
        assert!(queue(&[Query]).ready_tells_state());
        let mut half_sent = queue(&[Execute, Sync, ClosePortal, Parse, Bind, Describe]);
        assert!(half_sent.ready_tells_state());
        assert!(!half_sent.state_settled(), "the Sync is not answered yet");
        answer_first_batch(&mut half_sent);
        assert!(half_sent.state_settled());
        assert!(
            !half_sent.ready_tells_state(),
            "no ReadyForQuery owed before the batch"
        );
        // A statement in the half-sent batch may change the state: no waiting behind it.
        let mut behind_statement = queue(&[Sync, Bind, Execute, Bind]);
        assert!(!behind_statement.ready_tells_state());
        answer_first_batch(&mut behind_statement);
        assert!(!behind_statement.state_settled());
        assert!(!queue(&[Execute, SyncInCopy]).ready_tells_state());
        assert!(!queue(&[Sync, FunctionCall, Bind, Execute]).ready_tells_state());
        // pgfence's own requests are not the client's: they may be a check.
        let mut injected = queue(&[Sync]);
        injected.push(Bind, Origin::Injected(Injected::Check));
        assert!(!injected.ready_tells_state());
    }

    #[test]
    fn a_check_is_in_the_last_batch_only_with_no_sync_point_before_the_last_request() {
        use Request::*;
        let check = Origin::Injected(Injected::Check);
        // A check before a COMMIT in the batch being sent, or before a lone COMMIT Query.
        let mut replies = Replies::default();
        replies.push(Bind, check);
        replies.push(Execute, check);
        replies.push(Execute, Origin::Client);
        assert!(replies.front_in_last_batch());
        replies.push(Sync, Origin::Client);
        assert!(replies.front_in_last_batch());
        let mut lone = Replies::default();
        lone.push(Bind, check);
        lone.push(Execute, check);
        lone.push_query(QueryPlan::default());
        assert!(lone.front_in_last_batch());
        // A check of an earlier Sync, with a COMMIT Query pipelined behind it.
        let mut earlier = Replies::default();
        earlier.push(Bind, check);
        earlier.push(Execute, check);
        earlier.push(Sync, Origin::Client);
        earlier.push_query(QueryPlan::default());
        assert!(!earlier.front_in_last_batch());
    }
}
