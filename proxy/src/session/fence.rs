//! The fence inside a session: what pgfence injects, the fast path, and rejection reports.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::SystemTime;

use bytes::{Bytes, BytesMut};
use fence_core::classify::analyze_with;
use fence_core::directive::Directive;
use fence_core::lexer::LexOptions;
use fence_core::rejection::Rejection;
use fence_core::sql::{self, CheckArgs};
use fence_core::token::{Resource, Token};
use pgfence_config::Config;
use tracing::{info, warn};

use crate::error::SessionError;
use crate::metrics::{CheckLabels, FenceLabels, RejectionLabels};
use crate::net::ClientAddr;
use crate::protocol::message as msg;
use crate::protocol::startup::{options_settings, Startup};
use crate::state::RejectionRecord;

use super::replies::{AfterCheck, Injected, Origin, Request};
use super::tx::View;
use super::{Prepared, Remembered, Session};

/// Client encodings pgfence cannot lex safely (see `on_parameter_status`).
const UNSAFE_ENCODINGS: &[&str] = &[
    "SJIS",
    "SHIFT_JIS_2004",
    "BIG5",
    "GBK",
    "UHC",
    "GB18030",
    "JOHAB",
];

/// How to count the characters of the client's text: error positions are character
/// indexes, and pgfence maps them past the checks it inserts into a query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Chars {
    /// Not known, or a multi-byte encoding other than UTF-8: positions are left as they are.
    #[default]
    Unknown,
    /// A single-byte encoding (other than the two below).
    Bytes,
    /// LATIN1 (ISO 8859-1): single-byte, each byte the Unicode character of its value.
    Latin1,
    /// SQL_ASCII: bytes as the client sent them, counted one a character.
    SqlAscii,
    Utf8,
}

impl Chars {
    fn of(encoding: &str) -> Chars {
        match encoding {
            "UTF8" => Chars::Utf8,
            "SQL_ASCII" => Chars::SqlAscii,
            "LATIN1" => Chars::Latin1,
            e if ["LATIN", "ISO_8859_", "WIN", "KOI8"]
                .iter()
                .any(|p| e.starts_with(p)) =>
            {
                Chars::Bytes
            }
            _ => Chars::Unknown,
        }
    }
}

/// pgfence's own prepared statement and portal names on the upstream connection.
pub const CHECK_NAME: &[u8] = b"pgfence_check";
pub const GUARDED_CHECK_NAME: &[u8] = b"pgfence_check_guarded";
pub const SESSION_CHECK_NAME: &[u8] = b"pgfence_check_session";
pub const FAST_REJECT_NAME: &[u8] = b"pgfence_fast_reject";
const FAST_REJECT_SQL: &[u8] = b"SELECT pgfence.fast_reject($1::text, $2::bigint, $3::bigint)";

/// The statements a check can bind (all three may exist on one upstream connection).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckStatement {
    /// [`sql::guarded_check_sql`], for a session that looks unfenced: no parameters.
    Guarded,
    /// The call with the session's constants as literals ([`sql::check_call_literal`]): no
    /// parameters.
    Session,
    /// [`sql::CHECK_SQL`], six parameters: for comment directives, or `force`.
    Plain,
}

impl CheckStatement {
    fn name(self) -> &'static [u8] {
        match self {
            CheckStatement::Guarded => GUARDED_CHECK_NAME,
            CheckStatement::Session => SESSION_CHECK_NAME,
            CheckStatement::Plain => CHECK_NAME,
        }
    }
}

/// Fence settings of one session, fixed when it starts.
#[derive(Debug)]
pub struct FenceSettings {
    pub enabled: bool,
    pub fast_path: bool,
    pub default_resource: Option<String>,
    pub allow_missing: Vec<String>,
    pub client: String,
    /// Resource and token from the startup packet (not the configured default resource: see
    /// [`FenceSettings::new`]), while
    /// the session has sent nothing that could change them (the fast path's knowledge of
    /// the session token).
    pub session_resource: Option<Resource>,
    pub session_token: Option<Token>,
    /// pgfence's statements exist on the upstream connection: the checks (by
    /// [`CheckStatement`]) and the fast path's rejection.
    checks_prepared: [bool; 3],
    pub fast_reject_prepared: bool,
    /// The check's Bind messages for a transaction without fencing comments, which depend
    /// only on these settings, by [`CheckStatement`] (the plain one's is with `force`).
    binds: [Option<Bytes>; 3],
    /// The session has shown signs of being fenced (fencing settings at startup, a default
    /// resource, or its last check accepted a token): its checks skip the guard of
    /// [`sql::guarded_check_sql`], which would only cost them. Either statement is correct.
    pub looks_fenced: bool,
    /// Tokens a check accepted in the transaction still open: they become fences, which
    /// the fast path may act on, only once it commits (see `Session::settle_accepted`).
    pub accepted: Vec<(String, i64)>,
    /// A transaction whose check accepted a token was prepared (`PREPARE TRANSACTION`). The
    /// check recorded its per-backend hint `pgfence.accepted` as a session setting, which
    /// PostgreSQL keeps at `PREPARE TRANSACTION` even if the prepared transaction is rolled
    /// back later: a hint that claims a fence the database may not have, on which every
    /// later write with that token fails with 40001. pgfence resets it as soon as the
    /// session is idle with nothing in flight (see `Session::reset_hint_if_stale`).
    pub hint_outlives_prepare: bool,
    /// A statement that may drop pgfence's statements (`DEALLOCATE`, `DISCARD`, a portal
    /// pgfence does not know) went upstream and its replies are not all in: its
    /// CommandComplete makes pgfence forget them again (see [`Self::dropping_prepared`]).
    pub drop_in_flight: bool,
    /// The check statement a simple Query's check, sent as SQL text, stood for since it was
    /// last prepared: the next such check prepares it (see `Session::simple_check`).
    pub sent_as_text: Option<CheckStatement>,
}

impl FenceSettings {
    pub fn new(
        config: &Config,
        startup: &Startup,
        database: &str,
        user: &str,
        peer: ClientAddr,
    ) -> FenceSettings {
        let mut session_resource = None;
        let mut session_token = None;
        // As PostgreSQL applies them, the last one winning: `options` first, then the
        // startup packet's own parameters (`process_startup_options`).
        let mut settings = startup
            .param("options")
            .map(options_settings)
            .unwrap_or_default();
        settings.extend(
            startup
                .params
                .iter()
                .map(|(k, v)| {
                    (
                        String::from_utf8_lossy(k).to_ascii_lowercase(),
                        String::from_utf8_lossy(v).into_owned(),
                    )
                })
                .filter(|(k, _)| k.starts_with("fencing.")),
        );
        let default_resource = config
            .fence
            .default_resource(database, user)
            .map(str::to_string);
        let looks_fenced = !settings.is_empty() || default_resource.is_some();
        // Not the configured default resource where the startup packet names none: the
        // check falls back on it only where the server has no `fencing.resource` either,
        // and one set by `ALTER ROLE` or `ALTER DATABASE` (or in postgresql.conf) does not
        // show in the startup packet. The fast path once rejected a leader's token for the
        // default resource that the database accepted for its own.
        for (name, value) in settings {
            match name.as_str() {
                "fencing.resource" => session_resource = Resource::parse(value.as_bytes()).ok(),
                "fencing.token" => session_token = Token::parse(value.as_bytes()).ok(),
                _ => {}
            }
        }
        FenceSettings {
            // A replication connection takes replication commands, which pgfence's own
            // statements would break: it is passed through (README, known limitations).
            enabled: config.fence.enabled && !startup.replication(),
            fast_path: config.fence.fast_path,
            default_resource,
            allow_missing: config.fence.allow_missing(),
            client: peer.to_string(),
            session_resource,
            session_token,
            checks_prepared: [false; 3],
            fast_reject_prepared: false,
            binds: Default::default(),
            looks_fenced,
            accepted: Vec::new(),
            hint_outlives_prepare: false,
            drop_in_flight: false,
            sent_as_text: None,
        }
    }

    /// pgfence's prepared statements are gone from the upstream connection (`DISCARD`,
    /// `DEALLOCATE ALL`): the next use prepares them again.
    pub fn forget_prepared(&mut self) {
        self.checks_prepared = [false; 3];
        self.fast_reject_prepared = false;
    }

    /// A statement that may drop pgfence's statements goes upstream: they are forgotten
    /// now, so that no check after it binds one it drops, and again when it completes (a
    /// Parse of pgfence's sent before it and answered since no longer stands either).
    pub fn dropping_prepared(&mut self) {
        self.forget_prepared();
        self.drop_in_flight = true;
    }

    /// The server answered a Parse of `origin` with ParseComplete: if it was one of
    /// pgfence's statements, it exists now.
    pub fn prepared(&mut self, origin: Origin) {
        match origin {
            Origin::Injected(
                Injected::PrepareCheck(statement) | Injected::PrepareIdle(statement),
            ) => {
                self.checks_prepared[statement as usize] = true;
            }
            Origin::Injected(Injected::Prepare) => self.fast_reject_prepared = true,
            _ => {}
        }
    }

    /// A request of `origin` failed or was skipped after an error: if it was the Parse of one
    /// of pgfence's statements, that statement does not exist, and its next use prepares it.
    /// The others stay (preparing an existing one again would fail with 42P05).
    pub fn not_prepared(&mut self, origin: Origin) {
        match origin {
            Origin::Injected(
                Injected::PrepareCheck(statement) | Injected::PrepareIdle(statement),
            ) => {
                self.checks_prepared[statement as usize] = false;
            }
            Origin::Injected(Injected::Prepare) => self.fast_reject_prepared = false,
            _ => {}
        }
    }

    /// The session may have changed its fencing settings in a way pgfence cannot follow.
    pub fn forget_session_token(&mut self) {
        self.session_resource = None;
        self.session_token = None;
    }

    /// A (resource, token, known fence) this statement would commit with that is already
    /// known to be stale. Only values pgfence knows for sure count. None when the
    /// transaction's comments so far (`earlier`) and this statement's are not valid, or
    /// carry two tokens for one resource: the check reports that (FN003), not the fast path.
    pub fn stale(
        &self,
        earlier: &[Directive],
        directives: &[Directive],
        known: &crate::state::DatabaseFences,
    ) -> Option<(Resource, Token, i64)> {
        if !directives.is_empty() && self.directives_conflict(earlier, directives) {
            return None;
        }
        let check = |resource: Option<Resource>, token: Option<Token>| {
            let (resource, token) = (resource?, token?);
            let fence = known.get(resource.as_str())?;
            (token.get() < fence).then_some((resource, token, fence))
        };
        for d in directives {
            let resource = match &d.resource {
                Some(r) => Resource::parse(r).ok(),
                None => self.session_resource.clone(),
            };
            let token = match &d.token {
                Some(t) => Token::parse(t).ok(),
                None => self.session_token,
            };
            if let Some(found) = check(resource.clone(), token) {
                return Some(found);
            }
        }
        // A comment token for the session's resource, earlier in the transaction or on this
        // statement, is the one the check compares (SPEC section 2), not the session's.
        let overridden = earlier.iter().chain(directives).any(|d| {
            d.token.is_some()
                && match (&d.resource, &self.session_resource) {
                    (None, _) => true,
                    (Some(r), Some(s)) => r.as_slice() == s.as_str().as_bytes(),
                    _ => false,
                }
        });
        if overridden {
            return None;
        }
        check(self.session_resource.clone(), self.session_token)
    }

    /// Whether these comments would make the check fail with FN003: a token or a resource
    /// that is not valid, or two tokens for one resource (a comment without a resource is
    /// for the session's, or the default).
    fn directives_conflict(&self, earlier: &[Directive], directives: &[Directive]) -> bool {
        let fallback = self
            .session_resource
            .as_ref()
            .map(|r| r.as_str().as_bytes())
            .or(self.default_resource.as_deref().map(str::as_bytes));
        let mut seen: Vec<(&[u8], i64)> = Vec::new();
        for d in earlier.iter().chain(directives) {
            let resource = match &d.resource {
                Some(r) if Resource::parse(r).is_err() => return true,
                Some(r) => Some(r.as_slice()),
                None => fallback,
            };
            let Some(raw) = &d.token else { continue };
            let Ok(token) = Token::parse(raw) else {
                return true;
            };
            let Some(resource) = resource else { continue };
            match seen.iter().find(|(r, _)| *r == resource) {
                Some(&(_, t)) if t != token.get() => return true,
                Some(_) => {}
                None => seen.push((resource, token.get())),
            }
        }
        false
    }
}

impl Session {
    fn check_args<'a>(&'a self, force: bool) -> CheckArgs<'a> {
        CheckArgs {
            directives: &self.tx.directives,
            default_resource: self.fence.default_resource.as_deref(),
            allow_missing: &self.fence.allow_missing,
            client: &self.fence.client,
            force,
        }
    }

    /// Prepares the check statement this transaction's check uses, if needed.
    ///
    /// A transaction without fencing comments and without `force` passes only what is
    /// constant for the session (its default resource, the policy's `allow_missing`, the
    /// client address), so its statement has these as literals and no parameters: a Bind
    /// converts nothing (docs/fence-locking.md). While the session looks unfenced, that
    /// statement is the guarded one.
    fn prepare_check(&mut self, force: bool) -> CheckStatement {
        let statement = self.check_statement(force);
        if !self.fence.checks_prepared[statement as usize] {
            // Marked prepared when the server says so (ParseComplete): until then, another
            // check prepares it again, since this Parse may yet be skipped after an error
            // pgfence has not seen (the Close makes that harmless).
            self.send_prepare(statement, Injected::PrepareCheck(statement));
        }
        statement
    }

    /// The statement this transaction's check uses (see [`Session::prepare_check`]).
    fn check_statement(&self, force: bool) -> CheckStatement {
        if force || !self.tx.directives.is_empty() {
            CheckStatement::Plain
        } else if !self.fence.looks_fenced && self.fence.default_resource.is_none() {
            CheckStatement::Guarded
        } else {
            CheckStatement::Session
        }
    }

    /// Sends the Parse of `statement`, as `injected`.
    fn send_prepare(&mut self, statement: CheckStatement, injected: Injected) {
        let sql = match statement {
            CheckStatement::Guarded => {
                sql::guarded_check_sql(&self.fence.allow_missing, &self.fence.client)
            }
            CheckStatement::Session => {
                let mut sql = Vec::with_capacity(128);
                self.check_literal(&mut sql);
                sql
            }
            CheckStatement::Plain => sql::CHECK_SQL.as_bytes().to_vec(),
        };
        // Closed first: pgfence may have forgotten a statement that still exists (a
        // DEALLOCATE of another name, or one that failed), and a Parse of an existing
        // name fails (42P05).
        let origin = Origin::Injected(injected);
        msg::close(&mut self.to_server, b'S', statement.name());
        self.replies.push(Request::Close, origin);
        msg::parse(&mut self.to_server, statement.name(), &sql);
        self.replies.push(Request::Parse, origin);
    }

    /// Appends the check of a rewritten simple Query: `EXECUTE` of the check's statement
    /// when the upstream connection has it, so that the server neither parses nor plans the
    /// call again (37,500 of the 73,600 instructions its check cost an autocommit `UPDATE`
    /// without a token, docs/benchmarks.md#simple-execute); otherwise the call as SQL text. Returns the
    /// statement to prepare before this Query when the session is idle: from the second
    /// check sent as text, so that a session with a single write pays no Parse for it.
    pub(super) fn simple_check(&mut self, out: &mut Vec<u8>) -> Option<CheckStatement> {
        let statement = self.check_statement(false);
        if statement == CheckStatement::Plain {
            // Its arguments are this transaction's comments: as literals.
            self.check_literal(out);
            return None;
        }
        if self.fence.checks_prepared[statement as usize] {
            out.extend_from_slice(b"EXECUTE ");
            out.extend_from_slice(statement.name());
            return None;
        }
        self.check_literal(out);
        if self.fence.sent_as_text == Some(statement) {
            Some(statement)
        } else {
            self.fence.sent_as_text = Some(statement);
            None
        }
    }

    /// Prepares `statement` for the simple Queries' checks, right before the client's Query
    /// and while nothing is in flight and no block is open: with a Sync of its own, so that
    /// its failure cannot fail anything of the client's, and replies that are pgfence's
    /// alone. The Query itself still carries the check as text (should the Parse fail, the
    /// client sees the check's own error, not a missing statement's).
    pub(super) fn prepare_before_query(&mut self, statement: CheckStatement) {
        self.fence.sent_as_text = None;
        self.send_prepare(statement, Injected::PrepareIdle(statement));
        msg::sync(&mut self.to_server);
        self.replies.push(
            Request::Sync,
            Origin::Injected(Injected::PrepareIdle(statement)),
        );
    }

    /// Injects the check (extended protocol messages) into the upstream stream, here.
    pub(super) fn inject_check(&mut self, force: bool) {
        let statement = self.prepare_check(force);
        if self.tx.directives.is_empty() {
            let slot = statement as usize;
            let bind = match self.fence.binds[slot].take() {
                Some(bind) => bind,
                None => {
                    let mut bind = BytesMut::new();
                    let params = match statement {
                        CheckStatement::Plain => {
                            sql::check_params(&self.check_args(force)).to_vec()
                        }
                        CheckStatement::Guarded | CheckStatement::Session => Vec::new(),
                    };
                    msg::bind_text(&mut bind, CHECK_NAME, statement.name(), &params);
                    bind.freeze()
                }
            };
            self.to_server.extend_from_slice(&bind);
            self.fence.binds[slot] = Some(bind);
        } else {
            let params = sql::check_params(&self.check_args(force));
            msg::bind_text(&mut self.to_server, CHECK_NAME, statement.name(), &params);
        }
        self.replies
            .push(Request::Bind, Origin::Injected(Injected::Check));
        msg::execute(&mut self.to_server, CHECK_NAME);
        let about = self.rejection_subject();
        self.replies
            .push_about(Request::Execute, Origin::Injected(Injected::Check), about);
        // The portal ends with the transaction. A transaction that goes on after the check
        // (a check before a Sync while pgfence cannot tell whether a block is open) may be
        // checked again: close the portal then, so it can be bound again.
        if self.tx.view == View::Unknown {
            self.close_check_portal();
        }
        self.tx.directives.clear();
        self.check_sent = Some(std::time::Instant::now());
        self.shared.stats.checks.add();
    }

    fn close_check_portal(&mut self) {
        msg::close(&mut self.to_server, b'P', CHECK_NAME);
        self.replies
            .push(Request::Close, Origin::Injected(Injected::Check));
    }

    /// Injects a check before a Query or FunctionCall inside an extended-protocol batch,
    /// which commits the batch's implicit transaction, unless a `BEGIN` in that Query makes
    /// the transaction a block that goes on: the check's portal is closed after it either way.
    pub(super) fn inject_check_inside_batch(&mut self, force: bool) {
        let closes = self.tx.view == View::Unknown;
        self.inject_check(force);
        if !closes {
            self.close_check_portal();
        }
    }

    /// Injects a check that runs to its own Sync.
    pub(super) fn inject_check_with_sync(&mut self, force: bool, after: AfterCheck) {
        self.inject_check(force);
        msg::sync(&mut self.to_server);
        self.replies
            .push(Request::Sync, Origin::Injected(Injected::CheckSync(after)));
    }

    /// How many characters `text` of the client's has, when pgfence can tell.
    pub(super) fn char_count(&self, text: &[u8]) -> Option<u64> {
        match self.chars {
            Chars::Unknown => None,
            Chars::Bytes | Chars::Latin1 | Chars::SqlAscii => Some(text.len() as u64),
            // Every byte but UTF-8's continuation bytes starts a character.
            Chars::Utf8 => Some(text.iter().filter(|&&b| b & 0xC0 != 0x80).count() as u64),
        }
    }

    /// Appends the check as SQL text, for a rewritten simple Query.
    pub(super) fn check_literal(&self, out: &mut Vec<u8>) {
        sql::check_call_literal(&self.check_args(false), out);
    }

    /// Stands in for the client's Execute: runs pgfence's rejection function instead, so the
    /// server-side transaction fails exactly as the client is told.
    pub(super) fn inject_fast_reject_execute(
        &mut self,
        resource: &Resource,
        token: Token,
        fence: i64,
    ) {
        if !self.fence.fast_reject_prepared {
            // Closed first, as the checks' statements are (see `prepare_check`).
            let origin = Origin::Injected(Injected::Prepare);
            msg::close(&mut self.to_server, b'S', FAST_REJECT_NAME);
            self.replies.push(Request::Close, origin);
            msg::parse(&mut self.to_server, FAST_REJECT_NAME, FAST_REJECT_SQL);
            self.replies.push(Request::Parse, origin);
        }
        let params = [
            Some(resource.as_str().as_bytes().to_vec()),
            Some(token.get().to_string().into_bytes()),
            Some(fence.to_string().into_bytes()),
        ];
        // A portal of pgfence's own: binding the unnamed one would drop a client's
        // suspended there. The rejection fails its (sub)transaction, which drops it; closed
        // first all the same, so that a client's portal of that name cannot turn the
        // rejection into 42P03.
        msg::close(&mut self.to_server, b'P', FAST_REJECT_NAME);
        self.replies
            .push(Request::Close, Origin::Injected(Injected::FastReject));
        msg::bind_text(
            &mut self.to_server,
            FAST_REJECT_NAME,
            FAST_REJECT_NAME,
            &params,
        );
        self.replies
            .push(Request::Bind, Origin::Injected(Injected::FastReject));
        msg::execute(&mut self.to_server, FAST_REJECT_NAME);
        let about = self.rejection_subject();
        self.replies.push_about(
            Request::Execute,
            Origin::Injected(Injected::FastReject),
            about,
        );
    }

    /// The fences the fast path knows in the session's database: each database holds its
    /// own, and one learnt in another once made the fast path reject a leader whose
    /// database had none. Looked up at first use, which follows the login.
    #[inline]
    pub(super) fn known_fences(&self) -> &crate::state::DatabaseFences {
        self.fences
            .get_or_init(|| self.shared.fences.of(&self.database))
    }

    /// `pgfence_fence_token` of this database's `resource` is now `token`.
    fn set_fence_gauge(&self, resource: &str, token: i64) {
        self.shared
            .metrics
            .fence_token
            .get_or_create(&FenceLabels {
                database: self.database.clone(),
                resource: resource.to_owned(),
            })
            .set(token);
    }

    /// Learns fences from a check's result (`resource=token,...`).
    pub(super) fn observe_check_result(&mut self, value: Option<&[u8]>) {
        self.observe_check_latency();
        self.shared.check_ran(&self.database);
        self.fence.looks_fenced = value.is_some();
        let metrics = &self.shared.metrics;
        let Some(value) = value else {
            metrics
                .checks
                .get_or_create(&CheckLabels {
                    resource: String::new(),
                    outcome: "unfenced",
                })
                .inc();
            return;
        };
        for (resource, token) in sql::parse_check_result(value) {
            metrics
                .checks
                .get_or_create(&CheckLabels {
                    resource: resource.clone(),
                    outcome: "accepted",
                })
                .inc();
            self.fence.accepted.push((resource, token));
        }
    }

    /// The transaction whose checks accepted [`FenceSettings::accepted`] ended: committed,
    /// they are fences now (the fast path learns them, the gauge and the log say so);
    /// otherwise (an error, `ROLLBACK`, `PREPARE TRANSACTION`) they are forgotten. A fence
    /// learned from a transaction that never committed would make the fast path reject
    /// tokens the database accepts.
    pub(super) fn settle_accepted(&mut self, committed: bool) {
        if !committed {
            self.fence.accepted.clear();
            return;
        }
        for (resource, token) in std::mem::take(&mut self.fence.accepted) {
            if self.fence.session_token.is_some_and(|t| t.get() != token)
                && self
                    .fence
                    .session_resource
                    .as_ref()
                    .is_some_and(|r| r.as_str() == resource)
            {
                // The server committed with another token for the session's resource than
                // the one pgfence believes the session has: a comment's, or one a function
                // set (`set_config` in a procedure whose text pgfence never sees). The fast
                // path stops using its belief rather than reject the leader with it.
                self.fence.forget_session_token();
            }
            let before = self.known_fences().get(&resource);
            self.known_fences().observe(&resource, token);
            if before.is_none_or(|b| b < token) {
                self.set_fence_gauge(&resource, token);
                // What this pgfence knew, not the fence's previous value: another
                // instance may have moved it since, and after a start nothing is known.
                // `pgfence.history` records every advance.
                info!(
                    resource = %resource,
                    token,
                    known_before = before,
                    client = %self.client_addr,
                    session = self.id,
                    "higher token accepted"
                );
            }
        }
    }

    /// Follows the server settings that change how SQL text is lexed.
    pub(super) fn on_parameter_status(&mut self, frame: &[u8]) -> Result<(), SessionError> {
        let Some((name, rest)) = msg::cstr(msg::body(frame)) else {
            return Ok(());
        };
        let value = msg::cstr(rest).map(|(v, _)| v).unwrap_or_default();
        self.login.set_param(name, frame);
        match name {
            b"standard_conforming_strings" => {
                let scs = value != b"off";
                let new = LexOptions {
                    standard_conforming_strings: scs,
                };
                if scs != self.lex.standard_conforming_strings
                    && self.unnamed_statement.as_ref().is_some_and(|p| {
                        memchr::memchr(b'\\', &p.sql).is_some()
                            && analyze_with(&p.sql, new) != p.analysis
                    })
                {
                    // Analyses made under the old setting are not reused (a portal pgfence
                    // no longer knows is treated as one that may write). One that reads
                    // alike under both is kept (forgotten, a `VACUUM` bound behind a
                    // `COMMIT` that ended the block which changed the setting got the check
                    // of an unknown portal, which made PostgreSQL refuse it; reviews L and
                    // N, stop 55).
                    self.unnamed_statement = None;
                    self.names_forgotten = true;
                }
                self.lex.standard_conforming_strings = scs;
            }
            b"client_encoding" => {
                // In these encodings a multi-byte character may end in a byte that reads as
                // `\` or `'`: statement boundaries found by pgfence's lexer could differ from
                // the server's, and a COMMIT could slip past the check.
                let name = String::from_utf8_lossy(value).to_ascii_uppercase();
                if UNSAFE_ENCODINGS.contains(&name.as_str()) {
                    return Err(SessionError::UnsupportedEncoding(name));
                }
                self.chars = Chars::of(&name);
            }
            _ => {}
        }
        Ok(())
    }

    /// Records how long the check in flight took.
    pub(super) fn observe_check_latency(&mut self) {
        if let Some(sent) = self.check_sent.take() {
            self.shared.metrics.check_latency.observe(sent.elapsed());
        }
    }

    /// The prepared statement a check or fast-path rejection sent now is about (`None`: a
    /// simple Query's, or none): the last one a check is owed for.
    fn rejection_subject(&self) -> Option<Arc<Prepared>> {
        match &self.last_write {
            Some(Remembered::Prepared(p)) => Some(p.clone()),
            _ => None,
        }
    }

    /// Reports a rejection once: log event, metrics, `SHOW REJECTIONS`; learns the fence if
    /// `learns`. `about`: the statement the rejected request was sent for, when it kept one
    /// (see [`Replies::push_about`](super::replies::Replies::push_about)); otherwise the
    /// last one a check is owed for, which is the rejected transaction's unless the client
    /// pipelined simple Queries.
    pub(super) fn report_rejection(
        &self,
        rejection: &Rejection,
        path: &'static str,
        about: Option<&Arc<Prepared>>,
        learns: bool,
    ) {
        if let (Some(resource), Some(fence), true) = (&rejection.resource, rejection.fence, learns)
        {
            if self
                .known_fences()
                .get(resource)
                .is_none_or(|known| known < fence)
            {
                self.known_fences().observe(resource, fence);
                self.set_fence_gauge(resource, fence);
            }
        }
        // The write the transaction was rejected for, rather than its COMMIT.
        let text = match about {
            Some(p) => Some(&p.sql[..]),
            None => self
                .last_write
                .as_ref()
                .or(self.last_sql.as_ref())
                .map(Remembered::text),
        };
        let statement = text
            .map(|t| loggable_text(t, self.chars, 200))
            .unwrap_or_default();
        let resource = rejection.resource.clone().unwrap_or_default();
        let token = rejection.token.clone().unwrap_or_default();
        // String fields as `&str`, not `%` (Display): the text format then quotes and
        // escapes them, so a statement or application_name with a newline cannot forge
        // a log line of its own, and a value with spaces stays one field.
        warn!(
            resource = resource.as_str(),
            token = token.as_str(),
            fence = rejection.fence,
            reason = rejection.reason.as_str(),
            path,
            client_addr = self.client_addr.as_str(),
            user = self.user.as_str(),
            database = self.database.as_str(),
            application_name = self.application_name.as_str(),
            backend_pid = self.backend_pid,
            session = self.id,
            statement = statement.as_str(),
            "fence rejected"
        );
        self.shared.stats.rejections.fetch_add(1, Ordering::Relaxed);
        // A name that is not a resource is the client's text: as a label, any client could
        // make new series without end. So is a valid name with no fence behind it (a
        // missing token): only one configured, a default, or with a fence this pgfence
        // knows of is a label of its own (a review added 80,000 series with comments
        // naming new resources). The log and SHOW REJECTIONS keep the text.
        let label = if resource.is_empty() {
            resource.clone()
        } else if Resource::parse(resource.as_bytes()).is_err() {
            INVALID_RESOURCE_LABEL.to_string()
        } else if rejection.reason == fence_core::rejection::Reason::Missing
            && !self.shared.config().fence.resources.contains_key(&resource)
            && self.fence.default_resource.as_deref() != Some(resource.as_str())
            && self.known_fences().get(&resource).is_none()
        {
            UNKNOWN_RESOURCE_LABEL.to_string()
        } else {
            resource.clone()
        };
        let metrics = &self.shared.metrics;
        metrics
            .rejections
            .get_or_create(&RejectionLabels {
                resource: label.clone(),
                reason: rejection.reason.as_str(),
                path,
            })
            .inc();
        metrics
            .checks
            .get_or_create(&CheckLabels {
                resource: label,
                outcome: "rejected",
            })
            .inc();
        if path == "fast" {
            self.shared
                .stats
                .fast_rejections
                .fetch_add(1, Ordering::Relaxed);
        }
        self.shared.remember_rejection(RejectionRecord {
            at: SystemTime::now(),
            resource,
            token,
            fence: rejection.fence,
            reason: rejection.reason.as_str(),
            path,
            client_addr: self.client_addr.clone(),
            user: self.user.clone(),
            database: self.database.clone(),
            application_name: self.application_name.clone(),
            backend_pid: self.backend_pid,
            statement,
        });
    }
}

/// The `resource` label of rejections whose resource name is not valid (FN003).
pub const INVALID_RESOURCE_LABEL: &str = "(invalid)";

/// The `resource` label of missing-token rejections (FN002) for a resource that is neither
/// configured nor a default, and has no fence pgfence knows of.
pub const UNKNOWN_RESOURCE_LABEL: &str = "(unknown)";

/// The first `max` characters of a client's SQL text, for a log line, without losing a
/// byte: LATIN1 as the Unicode characters its bytes stand for, UTF-8 (and SQL_ASCII, most
/// often UTF-8) as it is, and every other byte (invalid UTF-8, or a non-ASCII byte of an
/// encoding pgfence does not convert) as `\xNN`, which counts as one character.
pub fn loggable_text(text: &[u8], chars: Chars, max: usize) -> String {
    fn escape(out: &mut String, b: u8) {
        use std::fmt::Write;
        let _ = write!(out, "\\x{b:02X}");
    }
    let mut out = String::with_capacity(text.len().min(max));
    match chars {
        Chars::Latin1 => out.extend(text.iter().take(max).map(|&b| char::from(b))),
        Chars::Utf8 | Chars::SqlAscii => {
            let mut n = 0;
            'text: for chunk in text.utf8_chunks() {
                for c in chunk.valid().chars() {
                    if n == max {
                        break 'text;
                    }
                    out.push(c);
                    n += 1;
                }
                for &b in chunk.invalid() {
                    if n == max {
                        break 'text;
                    }
                    escape(&mut out, b);
                    n += 1;
                }
            }
        }
        Chars::Bytes | Chars::Unknown => {
            for &b in text.iter().take(max) {
                if b.is_ascii() {
                    out.push(char::from(b));
                } else {
                    escape(&mut out, b);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{loggable_text, Chars};

    #[test]
    fn logged_text_loses_no_byte() {
        let latin1 = b"INSERT INTO t VALUES ('caf\xE9')";
        assert_eq!(
            loggable_text(latin1, Chars::Latin1, 200),
            "INSERT INTO t VALUES ('café')"
        );
        assert_eq!(
            loggable_text(latin1, Chars::Bytes, 200),
            "INSERT INTO t VALUES ('caf\\xE9')"
        );
        assert_eq!(
            loggable_text(latin1, Chars::Utf8, 200),
            "INSERT INTO t VALUES ('caf\\xE9')"
        );
        assert_eq!(
            loggable_text("日本 é".as_bytes(), Chars::Utf8, 200),
            "日本 é"
        );
        // Cut at characters, an escaped byte counting as one.
        assert_eq!(loggable_text("日本語".as_bytes(), Chars::Utf8, 2), "日本");
        assert_eq!(loggable_text(b"a\xFF\xFEb", Chars::SqlAscii, 2), "a\\xFF");
        assert_eq!(
            loggable_text(&[0xE9; 300], Chars::Latin1, 200),
            "é".repeat(200)
        );
        assert_eq!(loggable_text(b"ab\xE9", Chars::Unknown, 3), "ab\\xE9");
    }
}
