//! One client session: startup, authentication passed through, then the forwarding loop.
//!
//! One task per client, one upstream connection per client (session mode), one `select!`
//! loop that reads both sides and writes both sides without ever blocking one direction on
//! the other. [`opening`] reads the startup packet and connects upstream, [`login`] relays
//! authentication (and serves the admin console). Client messages are inspected in
//! [`client`] (the simple protocol's Query in [`query`], the extended protocol's in
//! [`extended`]), server replies in [`server`]; [`fence`] builds pgfence's checks;
//! [`replies`] keeps the queue of replies the server still owes and [`tx`] what pgfence knows
//! of the server-side transaction; [`kept`] hands a clean server connection to the next
//! client.

mod client;
mod extended;
mod fence;
mod kept;
mod login;
mod opening;
mod query;
mod read_audit;
mod readable;
pub mod replies;
mod server;
pub mod tx;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use bytes::{Buf, BytesMut};
use fence_core::classify::Analysis;
use pgfence_config::Config;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use tracing::{debug, debug_span, error, info, warn, Instrument};

use crate::cancel;
use crate::error::SessionError;
use crate::net::{ClientAddr, Stream, UpstreamAddr};
use crate::pool::{LoginReply, PoolKey};
use crate::protocol::next_frame;
use crate::protocol::startup::Startup;
use crate::state::Shared;

use self::fence::FenceSettings;
use self::opening::{accept, connect_upstream, first_reply, tell_client, Accepted};
use self::readable::Marked;
use self::replies::{Origin, Replies, Request};
use self::tx::TxState;

/// Output buffered for one side beyond which pgfence stops reading the other side.
const HIGH_WATER: usize = 1 << 20;
/// Read buffer growth step.
const READ_CHUNK: usize = 16 * 1024;
/// Requests in flight to the server beyond which pgfence stops reading the client (as
/// PostgreSQL stops reading while its replies cannot be written): each holds an entry of
/// about 150 bytes until answered, whatever its own size (a Sync is 5 bytes), so a client
/// that pipelines without reading would otherwise grow pgfence's memory without bound.
/// Far above what the server can leave unanswered before the client's next Sync or Flush
/// (its 8 KiB output buffer, of replies of at least 5 bytes).
const MAX_OWED_REPLIES: usize = 8192;
/// An empty buffer whose allocation grew past this (a large message went through) is
/// given back when the session is idle: an idle session keeps `READ_CHUNK`s, not the
/// largest message it saw.
const SHRINK_BUFFERS_ABOVE: usize = 256 * 1024;
/// Largest server message: `limits.max_message_size` protects pgfence from its clients, and
/// must not cut off a result row PostgreSQL is willing to send (a field may hold 1 GB).
const SERVER_MAX_MESSAGE: u32 = i32::MAX as u32;
/// Replaces `buf` with a new `READ_CHUNK` one if it is empty and its allocation is larger
/// than `SHRINK_BUFFERS_ABOVE` (`try_reclaim` tells without allocating).
#[inline]
fn shrink_when_empty(buf: &mut BytesMut) {
    if buf.is_empty() && buf.try_reclaim(SHRINK_BUFFERS_ABOVE + 1) {
        *buf = BytesMut::with_capacity(READ_CHUNK);
    }
}

/// How long resetting a server connection for the next client may take.
const RESET_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);
/// How long the last words to a client whose session fails may take to write.
const FAIL_WRITE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// A server message for the client at least this large goes on as its bytes arrive,
/// rather than whole (see `Session::streams_to_client`).
const STREAM_ABOVE: usize = 256 * 1024;

/// A statement the client prepared, or the one behind a portal.
#[derive(Debug)]
pub(crate) struct Prepared {
    pub sql: Box<[u8]>,
    pub analysis: Analysis,
    /// `COPY ... FROM STDIN`: executing it puts the server in copy-in mode.
    pub copy_in: bool,
    /// It is a SQL `PREPARE`: executing it replaces a prepared statement.
    pub prepares: extended::PreparedInSql,
    /// It runs transaction control (`Analysis::tx_control`): only then may its Parse, Bind
    /// or Execute wait for the replies in flight (see `Session::waits_for_replies`).
    pub tx_control: bool,
}

/// A statement's text kept for rejection logs, which show its first 200 characters.
pub(crate) enum Remembered {
    /// A prepared statement (or portal), held by the session anyway.
    Prepared(Arc<Prepared>),
    /// The start of a simple Query's text, in a buffer reused from query to query.
    Query(Vec<u8>),
}

impl Remembered {
    /// Enough bytes for 200 characters of any encoding pgfence accepts.
    const QUERY_PREFIX: usize = 1024;

    /// Remembers `sql`, a simple Query's text, in `slot`: without allocating once `slot`
    /// holds a query.
    fn query(slot: &mut Option<Remembered>, sql: &[u8]) {
        let sql = &sql[..sql.len().min(Self::QUERY_PREFIX)];
        match slot {
            Some(Remembered::Query(text)) => {
                text.clear();
                text.extend_from_slice(sql);
            }
            _ => *slot = Some(Remembered::Query(sql.to_vec())),
        }
    }

    pub(crate) fn text(&self) -> &[u8] {
        match self {
            Remembered::Prepared(p) => &p.sql,
            Remembered::Query(text) => text,
        }
    }
}

/// Named statements or portals. Looked up at every Bind and Execute, so hashed with
/// foldhash rather than std's SipHash (callgrind: 650 fewer instructions per prepared
/// TPC-B transaction). Names come from the client, but the map is its session's own:
/// colliding names would slow down only that client.
pub(crate) type Names = foldhash::HashMap<Box<[u8]>, Arc<Prepared>>;

/// A `COPY ... FROM STDIN` run with the extended protocol, as far as pgfence can tell.
/// PostgreSQL ignores Sync (and Flush) in copy-in mode, so a Sync sent then neither ends the
/// implicit transaction nor gets a ReadyForQuery: no check may go before it (the server
/// would take pgfence's messages for a protocol violation inside the COPY), and no reply is
/// owed for it once the COPY started.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyIn {
    None,
    /// The COPY's Execute went upstream; not yet known whether it started.
    Sent,
    /// The server answered CopyInResponse; copy-in mode lasts until CopyDone or CopyFail.
    Started,
}

/// A `COPY ... FROM STDIN` as the client sees it, in either protocol. Once its Query or
/// Execute is sent, only copy data, CopyDone, CopyFail, Sync, Flush and Terminate may
/// follow until the client ends the COPY, or learns that it failed or never started. The
/// server takes any other message for a protocol violation that fails the COPY, and
/// swallows it: pgfence would wait for that message's replies (or hold it until the COPY's
/// replies, which wait for the client's data) and the session would hang. So pgfence
/// refuses such a message (FATAL 08P01), including one sent before the server said whether
/// the COPY started: no driver sends one (libpq waits for CopyInResponse and refuses COPY
/// in pipeline mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CopyFromClient {
    None,
    /// Sent, not yet answered: it may start, or fail, or never run.
    MayStart,
    /// The server answered CopyInResponse.
    Running,
}

/// Where the session is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Authentication messages are relayed until the first ReadyForQuery.
    Auth,
    /// The login's ReadyForQuery is held while pgfence asks whether reads may write
    /// ([`read_audit`]).
    ReadAudit,
    /// Normal traffic.
    Ready,
    /// The admin console (virtual database `pgfence`).
    Admin,
}

/// A client message held back until pgfence's own check is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    None,
    /// The check is in flight, or replies owed that must come first (see
    /// [`CommitCheck::Pending`], and a statement that needs its check alone): do not read
    /// client messages.
    Waiting,
    /// The check passed: send the held message.
    Passed,
    /// The check failed (the error was forwarded): drop the held message; the client gets a
    /// ReadyForQuery with this status.
    Failed(u8),
}

/// Why pgfence sent a Flush of its own inside a client's batch (its requests are answered
/// only at a Sync or Flush) and holds the client's message being handled, a Query or
/// FunctionCall, until everything in flight is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flushed {
    No,
    /// To learn whether the batch's Parse, Bind, Describe or Close in flight failed, before a
    /// statement that cannot run in a transaction block, which is then checked first on its
    /// own (or, behind a failure, goes to the server, which skips it).
    ForPrecheck,
    /// Behind pgfence's check before a Query or FunctionCall that commits the batch's
    /// transaction: the message goes on once the check passed ([`Hold::Passed`]). If the
    /// check fails, the server skips up to a Sync, which pgfence then sends itself: the
    /// message is answered with that ReadyForQuery ([`Hold::Failed`]), as PostgreSQL answers
    /// a Query that fails, and what the client sent after it runs.
    Check,
}

/// A check that went out right before a client's COMMIT or PREPARE TRANSACTION inside its
/// batch (extended protocol) or query string (simple protocol). If the check fails, the
/// server skips the COMMIT with the rest of the batch and leaves the transaction block
/// failed, where PostgreSQL would have ended it (as when a deferred constraint fails at
/// COMMIT). pgfence then ends it with its own ROLLBACK before the client's next message runs,
/// so what the client is told (ReadyForQuery idle) is the server's state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CommitCheck {
    None,
    /// The check went upstream; the batch's Sync not yet. `found_failed`: the check met a
    /// transaction that had already failed (25P02, not forwarded), so the client's COMMIT
    /// never ran either.
    Sent {
        found_failed: bool,
    },
    /// The batch's Sync (or the Query) went upstream: client messages wait for its
    /// ReadyForQuery. `query`: the COMMIT is (in) a simple Query, which drops the client's
    /// unnamed statement even when the server skips the COMMIT after the failed check (as
    /// PostgreSQL runs it): pgfence's ROLLBACK then goes as a Query too.
    Pending {
        found_failed: bool,
        query: bool,
    },
    /// pgfence's ROLLBACK is in flight; its ReadyForQuery goes to the client, after a
    /// `ROLLBACK` command tag for the client's COMMIT when `found_failed` (what PostgreSQL
    /// answers to the COMMIT of a failed transaction).
    RollingBack {
        found_failed: bool,
    },
}

/// What to do after a client message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flow {
    Continue,
    /// Stop here and keep this message until the hold is released.
    Hold,
    /// This message was taken; read no further ones until the hold is released.
    Pause,
    /// The client said goodbye.
    Terminate,
}

/// How the server, or the admin console for one session, tells a session to stop.
#[derive(Debug, Clone)]
pub(crate) struct Stop {
    /// Close at the next idle moment (no transaction open, nothing in flight).
    pub drain: CancellationToken,
    /// Close now. Only ever cancelled after `drain` (the forwarding loop relies on it: it
    /// waits for one of the two at a time).
    pub kill: CancellationToken,
    /// `KILL_CLIENT` stopped this session, not a shutdown: it says so to the client.
    killed: Arc<AtomicBool>,
}

impl Stop {
    /// One session's tokens: cancelled with the server's, or alone by [`Stop::kill_now`].
    pub fn for_session(drain: &CancellationToken, kill: &CancellationToken) -> Stop {
        Stop {
            drain: drain.child_token(),
            kill: kill.child_token(),
            killed: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Ends this session now (`KILL_CLIENT`): an open transaction is rolled back, since its
    /// server connection is closed rather than kept.
    pub fn kill_now(&self) {
        self.killed.store(true, Ordering::Relaxed);
        self.drain.cancel();
        self.kill.cancel();
    }

    /// What the client is told when the session stops.
    fn reason(&self) -> SessionError {
        if self.killed.load(Ordering::Relaxed) {
            SessionError::Killed
        } else {
            SessionError::Shutdown
        }
    }
}

/// Serves one client connection to its end.
pub(crate) async fn serve(client: Stream, peer: ClientAddr, shared: Arc<Shared>, stop: Stop) {
    let id = shared.next_client_id();
    // A debug span: an enabled span is entered and left at every poll of the session, which
    // a profile put at 5.7% of the proxy's instructions. The events a session logs at info
    // level and above carry the client (and the fence events the session id) themselves.
    let span = debug_span!(
        "session",
        id,
        client = %peer,
        backend_pid = tracing::field::Empty
    );
    async move {
        debug!("client connected");
        let _active = shared.enter();
        let outcome = run_session(client, peer, id, &shared, &stop).await;
        shared.clients.remove(&id);
        match outcome {
            Ok(()) => debug!("client disconnected"),
            Err(e) => {
                if matches!(e.side(), crate::error::Side::Server)
                    && !matches!(e, SessionError::UpstreamConnect { .. })
                {
                    shared.upstream_error();
                    // A server process that crashed or was terminated, a restart, a network
                    // failure: worth an operator's look (connect failures log their own).
                    warn!(
                        client = %peer,
                        session = id,
                        error = e.to_string().as_str(),
                        "a session's server connection failed; the client was told (08006 or \
                         the server's own FATAL), or, in the middle of a large row or copy \
                         data streamed to it, its connection was closed"
                    );
                } else if matches!(
                    e,
                    SessionError::ClientFrame(_)
                        | SessionError::UnexpectedClientMessage(_)
                        | SessionError::MalformedClientMessage(_)
                        | SessionError::MessageDuringCopyIn(_)
                ) {
                    info!(
                        client = %peer,
                        session = id,
                        error = e.to_string().as_str(),
                        "a client broke the protocol; its session was closed with FATAL 08P01"
                    );
                }
                debug!(error = %e, side = ?e.side(), "session ended with an error");
            }
        }
    }
    .instrument(span)
    .await
}

async fn run_session(
    client: Stream,
    peer: ClientAddr,
    id: u64,
    shared: &Arc<Shared>,
    stop: &Stop,
) -> Result<(), SessionError> {
    let config = shared.config();
    if let Stream::Tcp(tcp) = &client {
        let _ = tcp.set_nodelay(true);
        if let Err(e) = crate::net::keepalive(tcp, &config.limits) {
            warn!(error = %e, "could not set TCP keepalive on the client connection");
        }
    }
    let mut cbuf = BytesMut::with_capacity(READ_CHUNK);
    let Some(Accepted {
        mut client,
        startup,
        packet_len,
        tls,
        client_cn,
        admin,
    }) = accept(client, &mut cbuf, &peer, shared, &config, stop).await?
    else {
        return Ok(());
    };
    let upstream_name = config.upstream.to_string();
    let replication = startup.replication();
    if replication && !admin {
        info!(
            client = %peer,
            user = startup.user().as_str(),
            database = startup.database().as_str(),
            "replication connection: passed through without the fence, and not kept"
        );
    }
    let pool_key = (!admin && config.pool.reuse_servers && !replication).then(|| PoolKey {
        upstream: crate::pool::upstream_key(&config.upstream),
        startup: cbuf[..packet_len].into(),
    });
    let mut parked = pool_key
        .as_ref()
        .and_then(|key| shared.pool.take(key, &config.pool))
        .and_then(|p| {
            let born = p.born;
            let login = p.login;
            Stream::from_std(p.stream).ok().map(|s| (s, born, login))
        });
    // Sessions on a kept connection ask whether reads may write with its refresh.
    let known_audit = shared.known_read_audit(&startup.database(), config.fence.read_audit_max_age);
    let mut kept_audit = None;
    let mut kept_asked_at = Instant::now();
    if let Some((server, _, login)) = &mut parked {
        let ask = config.fence.enabled && read_audit::asks(&config) && known_audit.is_none();
        if ask {
            shared.count_read_audit_question();
            kept_asked_at = Instant::now();
        }
        match kept::refresh_kept(server, login, RESET_TIMEOUT, ask).await {
            Ok(answer) => kept_audit = answer,
            Err(e) => {
                debug!(error = %e, "a kept server connection failed its check: connecting anew");
                parked = None;
            }
        }
    }
    let mut sbuf = BytesMut::with_capacity(READ_CHUNK);
    let (mut server, born, reused) = match parked {
        Some((s, born, login)) => (s, born, Some(login)),
        None => match connect_upstream(shared, &config).await {
            Ok(s) if admin => (s, Instant::now(), None),
            Ok(s) => {
                // The startup packet goes upstream exactly as the client sent it.
                let login = first_reply(s, &cbuf[..packet_len], &mut sbuf, shared, &config);
                let s = tokio::select! {
                    s = login => s,
                    _ = stop.kill.cancelled() => Err(SessionError::Shutdown),
                };
                match s {
                    Ok(s) => (s, Instant::now(), None),
                    Err(e) => return tell_client(&mut client, e).await,
                }
            }
            Err(reason) => {
                shared.upstream_error();
                warn!(upstream = %upstream_name, %reason, client = %peer, "cannot connect to upstream");
                return tell_client(
                    &mut client,
                    SessionError::UpstreamConnect {
                        upstream: upstream_name,
                        reason,
                    },
                )
                .await;
            }
        },
    };
    let upstream_addr = server.peer().map_err(SessionError::ServerIo)?;
    shared.metrics.upstream_connections.inc();
    let _upstream = scopeguard(|| {
        shared.metrics.upstream_connections.dec();
    });
    // A session on a TLS server connection sends its cancel requests over TLS too (see
    // `crate::cancel`).
    let upstream_tls = matches!(server, Stream::Tls(_));
    let cancel_tls = if upstream_tls {
        shared.upstream_tls().map(|tls| cancel::CancelTls {
            config: tls,
            host: config.upstream.host.clone(),
            sslmode: config.upstream.sslmode,
        })
    } else {
        None
    };
    let mut session = Session::new(
        shared.clone(),
        config,
        id,
        peer,
        &startup,
        upstream_addr,
        stop.clone(),
    );
    if let Some((learnt, known)) = known_audit {
        session.take_known_read_audit(learnt, known);
    }
    session.tls = tls;
    session.client_cn = client_cn;
    session.upstream_tls = upstream_tls;
    session.cancel_tls = cancel_tls;
    if admin {
        // The console logs in to the upstream server, which checks the password.
        session.admin = true;
        let packet = startup.encode_with_database(&session.shared.config().admin.database);
        session.to_server.extend_from_slice(&packet);
    } else if let Some(login) = reused {
        debug!("reusing an idle server connection");
        if let Some(answer) = kept_audit {
            session.apply_read_audit(answer, kept_asked_at, false);
        }
        session.replay_login(login)?;
    }
    cbuf.advance(packet_len);
    crate::state::Stats::add(&shared.stats.clients_total);
    let result = session.run(client, &mut server, cbuf, sbuf, stop).await;
    session.finish();
    if result.is_ok() {
        session.release(server, born, pool_key).await;
    } else {
        // Closed, not dropped: over TLS the server then sees close_notify, a clean end,
        // rather than a connection cut (which PostgreSQL logs as a reset).
        let _ = crate::deadline::timeout(FAIL_WRITE_TIMEOUT, server.shutdown()).await;
    }
    let server_side = matches!(&result, Err(e) if matches!(e.side(), crate::error::Side::Server));
    match session.server_fatal {
        Some(true) if !server_side => Err(SessionError::ServerIo(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "the server ended the session",
        ))),
        // The server closing after refusing the client's login is no upstream failure.
        Some(false) if server_side => Ok(()),
        _ => result,
    }
}

/// Writes `buf` whole and flushes it (a TLS connection may hold the last records back).
async fn write_out(w: &mut crate::net::WriteHalf<'_>, buf: &[u8]) -> std::io::Result<()> {
    w.write_all(buf).await?;
    w.flush().await
}

/// The state of one client session.
pub(crate) struct Session {
    shared: Arc<Shared>,
    id: u64,
    phase: Phase,
    /// This is an admin console session.
    admin: bool,
    /// The admin console's command to the server (`SHOW FENCES`) is not answered yet.
    console_asked: bool,
    /// Who is connected, for logs, rejections and `SHOW CLIENTS`.
    client_addr: String,
    /// The client's TLS protocol and cipher suite, if it uses TLS.
    tls: Option<String>,
    /// The common name of the client's certificate, if it sent one.
    client_cn: Option<String>,
    user: String,
    database: String,
    /// The fences the fast path knows in `database`, looked up at first use (see
    /// [`Session::known_fences`]).
    fences: std::sync::OnceLock<Arc<crate::state::DatabaseFences>>,
    application_name: String,
    upstream: UpstreamAddr,
    /// The upstream backend's real pid (0 until BackendKeyData).
    backend_pid: i32,
    /// The key pgfence gave the client, registered for cancel routing.
    client_key: Option<(i32, i32)>,
    /// This session's cancel requests being forwarded: until the server has closed their
    /// connections, a late signal could still cancel the next statement (see `crate::cancel`).
    cancels: Arc<cancel::InFlight>,
    max_message: u32,
    to_server: BytesMut,
    to_client: BytesMut,
    replies: Replies,
    tx: TxState,
    fence: FenceSettings,
    statements: Names,
    /// pgfence has forgotten a statement the server may still have (a SQL `PREPARE`, a
    /// Parse it could not read, the unnamed one after `standard_conforming_strings`
    /// changed): a name it does not know may stand for something.
    names_forgotten: bool,
    /// A statement pgfence forgot may have prepared a statement in SQL when run (a
    /// `PREPARE` parsed in the extended protocol, an `EXECUTE`, a Parse it could not read):
    /// a SQL `EXECUTE` of a name it does not know may prepare any name (see
    /// `Session::executed_in_sql`).
    prepare_hidden: bool,
    /// Names pgfence forgot (see `names_forgotten`) that may still stand on the server for
    /// a statement parsed in the extended protocol that controls transactions: a SQL
    /// `EXECUTE` of one may end its transaction (see `Session::execute_may_end`).
    control_forgotten: foldhash::HashSet<Box<[u8]>>,
    /// A statement parsed in the extended protocol under a name had comment directives
    /// (see `Session::executed_inside`).
    named_directives: bool,
    /// The last Bind was of a statement that cannot be fenced atomically, checked first in
    /// a transaction of its own (`Session::on_bind`): its Execute needs no check before it.
    prechecked: bool,
    /// Ends the session `limits.shutdown_timeout` after its client left with replies owed
    /// (see `Session::stay_for_owed_replies`).
    grace_after_client: Option<tokio_util::task::AbortOnDropHandle<()>>,
    unnamed_statement: Option<Arc<Prepared>>,
    portals: Names,
    unnamed_portal: Option<Arc<Prepared>>,
    hold: Hold,
    /// While [`Hold::Waiting`] for a Query that holds `COPY ... FROM STDIN` (see
    /// [`CommitCheck`]): the client's copy messages still go upstream, or the server would
    /// wait for them and the Query never be answered. The first other message is held.
    copy_through: bool,
    /// Whether the client may be in the middle of a `COPY ... FROM STDIN` (see
    /// [`CopyFromClient`]).
    copy_from_client: CopyFromClient,
    /// Whether the Query being handled holds a `COPY ... FROM STDIN` (set by `on_query`,
    /// read when it returns).
    query_copies_in: bool,
    /// After a failed precheck of an extended-protocol batch: drop client messages up to
    /// the Sync, answer it with ReadyForQuery of this status.
    discard_until_sync: Option<u8>,
    /// An extended-protocol request failed and the client has not sent the Sync that ends
    /// its batch: the server skips everything up to it (Terminate aside), so pgfence passes
    /// it on as it is, adding nothing and learning nothing from it.
    skipping_to_sync: bool,
    /// pgfence sent a Flush and holds the client's message being handled until every
    /// request in flight is answered (see [`Flushed`]).
    flushed: Flushed,
    /// An injected check failed and its error was forwarded: the client's COMMIT that
    /// follows reports `ROLLBACK`, which the client must not see.
    check_failed: bool,
    /// How to lex SQL text (follows `standard_conforming_strings`).
    lex: fence_core::lexer::LexOptions,
    /// How to count the characters of the client's text (follows `client_encoding`).
    chars: fence::Chars,
    /// The latest statement text the client sent, for rejection logs.
    last_sql: Option<Remembered>,
    /// The latest statement a check is owed for (see [`Session::owes_check_for`]): what a
    /// rejection at COMMIT is about.
    last_write: Option<Remembered>,
    /// An extended-protocol `COPY ... FROM STDIN` in progress.
    copy_in: CopyIn,
    /// A check right before a COMMIT inside the client's batch, until the batch is answered.
    commit_check: CommitCheck,
    /// The CommandComplete of the last statement of a simple Query, held until the check
    /// pgfence appended for the end of the implicit transaction passes: PostgreSQL commits
    /// before it reports the last statement complete, so a client gets a command tag or an
    /// error for it, never both.
    held_complete: Option<Vec<u8>>,
    /// ParameterStatus messages the server sent with the ReadyForQuery of pgfence's own
    /// Sync ([`replies::Injected::StateSync`]), held for the client's next ReadyForQuery,
    /// which PostgreSQL would have sent them with.
    held_status: Vec<u8>,
    /// The ParameterStatus messages the client had seen when the first of `held_status`
    /// was held (see `Session::release_held_status`).
    held_seen: Vec<crate::pool::ParameterStatus>,
    /// NotificationResponse messages the server sent at pgfence's own Sync (or behind
    /// those), held as `held_status` is.
    held_notifications: BytesMut,
    /// Bytes still to come of a server message streamed to the client as they arrive (see
    /// `Session::streams_to_client`): until they are through, nothing else is written to
    /// the client, and client messages wait.
    server_stream_left: usize,
    /// When each client Query, Sync or FunctionCall still in flight was sent (latency).
    sync_sent: std::collections::VecDeque<Instant>,
    /// When the check in flight was sent (latency).
    check_sent: Option<Instant>,
    /// The server sent FATAL (or PANIC), ending the session: `Some(true)` when that is an
    /// upstream failure (a session terminated, a server that cannot take the login),
    /// `Some(false)` when the client caused it (credentials refused, no such database). It
    /// decides the upstream error count however the session then ends: the client often
    /// goes away before pgfence reads the end of the server connection.
    server_fatal: Option<bool>,
    /// The login reply as the server stands now, for the next client of this connection.
    login: LoginReply,
    /// The server accepted the login without asking for credentials (see [`crate::pool`]).
    reusable_login: bool,
    /// The server connection uses TLS: the server's `SCRAM-SHA-256-PLUS` is hidden from
    /// the client, since channel binding cannot pass through pgfence.
    upstream_tls: bool,
    /// How this session's cancel requests reach the server over TLS, when its connection
    /// uses TLS.
    cancel_tls: Option<cancel::CancelTls>,
    /// SCRAM-SHA-256-PLUS was hidden and the client's SASLInitialResponse is still to come.
    plus_hidden: bool,
    /// The client closed in the middle of a message.
    client_left_mid_message: bool,
    /// This session's stop, for `KILL_CLIENT` (registered with the client in `SHOW CLIENTS`).
    stop: Stop,
    /// Whether reads may write in the database is still to be asked or answered
    /// ([`read_audit`]); meanwhile every transaction is checked.
    read_audit_asked: bool,
    /// The answer so far, while [`Phase::ReadAudit`] or [`read_audit::Verdict::Asking`].
    read_audit_answer: read_audit::Answer,
    /// When the session asks whether reads may write again ([`read_audit`]).
    verdict: read_audit::Verdict,
    /// `fence.read_audit_max_age` when the session started.
    read_audit_max_age: std::time::Duration,
    /// Questions in a row that failed in a way that passes (see `read_audit::PASSING`):
    /// each waits twice as long as the one before to be asked again.
    read_audit_failures: u32,
    /// A Parse, Bind, Describe, Execute or Close was sent since the client's last sync point:
    /// nothing of pgfence's own may run in between.
    batch_open: bool,
    /// The client parsed the unnamed statement, and sent no Query since (which drops it):
    /// a Query of pgfence's own would drop it behind the client's back.
    unnamed_statement_alive: bool,
    /// The client message being handled was held before (`Flow::Hold`): it is not asked
    /// about again (asking made it wait for the answer, and asking again each time it came
    /// back would hold it for ever).
    handled_again: bool,
    /// The login's ReadyForQuery, held while [`Phase::ReadAudit`].
    read_audit_ready: Vec<u8>,
}

impl Session {
    fn new(
        shared: Arc<Shared>,
        config: Arc<Config>,
        id: u64,
        peer: ClientAddr,
        startup: &Startup,
        upstream: UpstreamAddr,
        stop: Stop,
    ) -> Session {
        let user = startup.user();
        let database = startup.database();
        let application_name = startup.param_str("application_name").unwrap_or_default();
        let fence = FenceSettings::new(&config, startup, &database, &user, peer);
        let read_audit_asked = fence.enabled && read_audit::asks(&config);
        Session {
            max_message: config.limits.max_message_size,
            tx: TxState::with_audit(
                !config.fence.skip_read_only || read_audit_asked,
                read_audit_asked,
            ),
            shared,
            id,
            phase: Phase::Auth,
            admin: false,
            console_asked: false,
            client_addr: peer.to_string(),
            tls: None,
            client_cn: None,
            user,
            database,
            fences: std::sync::OnceLock::new(),
            application_name,
            upstream,
            backend_pid: 0,
            client_key: None,
            cancels: Arc::default(),
            to_server: BytesMut::with_capacity(READ_CHUNK),
            to_client: BytesMut::with_capacity(READ_CHUNK),
            replies: Replies::default(),
            fence,
            statements: Names::default(),
            names_forgotten: false,
            prepare_hidden: false,
            control_forgotten: foldhash::HashSet::default(),
            named_directives: false,
            prechecked: false,
            grace_after_client: None,
            unnamed_statement: None,
            portals: Names::default(),
            unnamed_portal: None,
            hold: Hold::None,
            copy_through: false,
            copy_from_client: CopyFromClient::None,
            query_copies_in: false,
            discard_until_sync: None,
            skipping_to_sync: false,
            flushed: Flushed::No,
            check_failed: false,
            last_sql: None,
            last_write: None,
            copy_in: CopyIn::None,
            commit_check: CommitCheck::None,
            held_complete: None,
            held_status: Vec::new(),
            held_seen: Vec::new(),
            held_notifications: BytesMut::new(),
            server_stream_left: 0,
            lex: fence_core::lexer::LexOptions::default(),
            chars: fence::Chars::default(),
            sync_sent: std::collections::VecDeque::new(),
            check_sent: None,
            server_fatal: None,
            login: LoginReply::default(),
            reusable_login: true,
            upstream_tls: false,
            cancel_tls: None,
            plus_hidden: false,
            client_left_mid_message: false,
            stop,
            read_audit_asked,
            read_audit_answer: read_audit::Answer::None,
            verdict: read_audit::Verdict::Fixed,
            read_audit_max_age: config.fence.read_audit_max_age,
            read_audit_failures: 0,
            batch_open: false,
            unnamed_statement_alive: false,
            handled_again: false,
            read_audit_ready: Vec::new(),
        }
    }

    /// The forwarding loop.
    async fn run(
        &mut self,
        mut client: Stream,
        server: &mut Stream,
        mut cbuf: BytesMut,
        mut sbuf: BytesMut,
        stop: &Stop,
    ) -> Result<(), SessionError> {
        let (mut cr, mut cw) = client.split();
        let client_tls = matches!(cw, crate::net::WriteHalf::Tls(..));
        let (mut sr, mut sw) = server.split();
        let server_tls = matches!(sw, crate::net::WriteHalf::Tls(..));
        let task = std::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await;
        let (server_readable, client_readable) = (Marked::new(&task), Marked::new(&task));
        let mut client_open = true;
        // `drain` is polled only when it woke the task (its mark, see [`Marked`]): polling it,
        // or asking the token, at every turn takes a lock in tokio's Notify or the token's.
        let drain = stop.drain.cancelled();
        let kill = stop.kill.cancelled();
        tokio::pin!(drain, kill);
        let drain_woken = Marked::new(&task);
        let mut draining = stop.drain.is_cancelled();
        // Bytes already read from the server (its first reply to the login) and from the
        // client (beyond its startup packet) are processed first.
        if let Err(e) = self.guarded(|s| s.on_server_bytes(&mut sbuf)) {
            return Err(self.fail(&mut cw, e).await);
        }
        let mut client_pending = !cbuf.is_empty();
        let cancels = self.cancels.clone();
        // A buffer may have grown past `READ_CHUNK` since the last look (see
        // `shrink_when_empty`), which costs a call per buffer: looked for only then.
        let mut outgrown = self.outgrown();
        loop {
            if client_pending && cancels.busy() {
                // What the client sends while one of its cancels is on its way waits for it
                // (a few milliseconds, at most `limits.connect_timeout`). Waiting here rather
                // than in the select! below keeps its future off every turn of this loop.
                cancels.settled().await;
            }
            if client_pending && self.reads_client() {
                client_pending = false;
                let flow = self.guarded(|s| s.on_client_bytes(&mut cbuf));
                outgrown |= self.outgrown();
                match flow {
                    Ok(Flow::Terminate) => client_open = false,
                    // Copy data the client sent along with the Query it paused at.
                    Ok(Flow::Pause) => client_pending = self.copy_through && !cbuf.is_empty(),
                    Ok(Flow::Hold | Flow::Continue) => {}
                    Err(e) => return Err(self.fail(&mut cw, e).await),
                }
            }
            // A cancel the client sent before it left waits for the read audit's question:
            // the session stays until the answer forwards it, so that the statement behind
            // the question is cancelled (and does not commit), as directly.
            if !client_open && self.to_server.is_empty() && !cancels.cancel_held() {
                if !self.answers_after_client_left() {
                    // Part of a message the client never finished: not a clean goodbye.
                    self.client_left_mid_message = !cbuf.is_empty();
                    return Ok(());
                }
                self.stay_for_owed_replies(stop);
            }
            if draining
                && self.phase == Phase::Ready
                && self.replies.is_empty()
                && self.tx.view == tx::View::Idle
                && self.to_server.is_empty()
                && self.to_client.is_empty()
            {
                return Err(self.say_goodbye(&mut cw, stop.reason()).await);
            }
            // Not while the client's own replies pile up (it does not read): the admin
            // console answers without the server, and a flood of `SHOW CONFIG` once grew
            // the process past 2 GB.
            let read_client = client_open
                && self.reads_client()
                && self.to_server.len() < HIGH_WATER
                && self.to_client.len() < HIGH_WATER
                && self.replies.len() < MAX_OWED_REPLIES;
            let read_server = self.to_client.len() < HIGH_WATER;
            if self.replies.is_empty() {
                if outgrown {
                    // Looked at again next time if one of them is not empty yet.
                    outgrown = false;
                    for buf in [
                        &mut cbuf,
                        &mut sbuf,
                        &mut self.to_server,
                        &mut self.to_client,
                    ] {
                        outgrown |= !buf.is_empty();
                        shrink_when_empty(buf);
                    }
                }
                self.replies.shrink_when_empty();
            }
            // A read buffer grows only here (see `Session::outgrown`).
            if cbuf.capacity() - cbuf.len() < 1024 {
                cbuf.reserve(READ_CHUNK);
                outgrown = true;
            }
            if sbuf.capacity() - sbuf.len() < 1024 {
                sbuf.reserve(READ_CHUNK);
                outgrown = true;
            }
            tokio::select! {
                // Replies first: they free the client's buffers soonest.
                biased;
                r = server_readable.read(&mut sr, &mut sbuf), if read_server => {
                    let n = match r {
                        Ok(n) => n,
                        Err(e) => return Err(self.server_lost(&mut cw, e).await),
                    };
                    if n == 0 {
                        // The server closed: pass on whatever it said last.
                        if let Err(e) = self.guarded(|s| s.on_server_bytes(&mut sbuf)) {
                            return Err(self.fail(&mut cw, e).await);
                        }
                        let eof = std::io::Error::new(
                            std::io::ErrorKind::UnexpectedEof,
                            "the server closed the connection unexpectedly",
                        );
                        return Err(self.server_lost(&mut cw, eof).await);
                    }
                    let was_waiting = self.hold == Hold::Waiting;
                    if let Err(e) = self.guarded(|s| s.on_server_bytes(&mut sbuf)) {
                        return Err(self.fail(&mut cw, e).await);
                    }
                    outgrown |= self.outgrown();
                    if was_waiting && self.hold != Hold::Waiting {
                        client_pending = true;
                        self.copy_through = false;
                    }
                }
                r = client_readable.read(&mut cr, &mut cbuf), if read_client => {
                    let n = r.map_err(SessionError::ClientIo)?;
                    if n == 0 {
                        // The client went away without Terminate: as if it had sent one.
                        client_open = false;
                    } else {
                        client_pending = true;
                    }
                }
                // A write of nothing flushes TLS records the socket did not take before.
                r = sw.write(&self.to_server), if !self.to_server.is_empty() || (server_tls && sw.pending()) => {
                    let n = match r {
                        Ok(n) => n,
                        Err(e) => return Err(self.server_lost(&mut cw, e).await),
                    };
                    self.to_server.advance(n);
                }
                r = cw.write(&self.to_client), if !self.to_client.is_empty() || (client_tls && cw.pending()) => {
                    let n = r.map_err(SessionError::ClientIo)?;
                    self.to_client.advance(n);
                }
                _ = drain_woken.poll(drain.as_mut()), if !draining => {
                    draining = true;
                }
                // `kill` comes after `drain`: until then, polling it at every turn (a lock
                // in tokio's Notify) would only cost.
                _ = &mut kill, if draining => {
                    return Err(self.say_goodbye(&mut cw, stop.reason()).await);
                }
            }
            // Write what is ready without another trip through select!.
            if !self.to_server.is_empty() {
                match sw.try_write(&self.to_server) {
                    Ok(n) => self.to_server.advance(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(self.server_lost(&mut cw, e).await),
                }
            }
            if !self.to_client.is_empty() {
                match cw.try_write(&self.to_client) {
                    Ok(n) => self.to_client.advance(n),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(SessionError::ClientIo(e)),
                }
            }
        }
    }

    /// Runs one step of the session's protocol logic. A panic there, a bug of pgfence's
    /// (logged by the panic hook in `main.rs`), ends this session alone, with a FATAL error
    /// the client can read rather than a bare close. What the step added for the client is
    /// dropped: it may end mid-message.
    fn guarded<T>(
        &mut self,
        step: impl FnOnce(&mut Self) -> Result<T, SessionError>,
    ) -> Result<T, SessionError> {
        let owed = self.to_client.len();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(self))) {
            Ok(result) => result,
            Err(payload) => {
                self.to_client.truncate(owed);
                self.on_bug(&*payload)
            }
        }
    }

    #[cold]
    fn on_bug<T>(&mut self, payload: &(dyn std::any::Any + Send)) -> Result<T, SessionError> {
        let panic = crate::error::panic_message(payload);
        error!(
            client = %self.client_addr,
            user = self.user.as_str(),
            database = self.database.as_str(),
            application_name = self.application_name.as_str(),
            backend_pid = self.backend_pid,
            panic,
            "pgfence bug: a session panicked; it ends with FATAL XX000 and its server connection is closed"
        );
        Err(SessionError::Bug(panic.to_owned()))
    }

    /// Ends the session over invalid input from either side: the client gets what it is
    /// already owed, then a FATAL error saying why (08P01 for its own protocol violations).
    async fn fail(&mut self, cw: &mut crate::net::WriteHalf<'_>, e: SessionError) -> SessionError {
        // Not after part of a streamed message, which the client could not read past.
        if self.server_stream_left == 0 {
            e.to_client(&mut self.to_client);
        }
        // A client that does not read cannot hold the session task forever.
        let _ = crate::deadline::timeout(FAIL_WRITE_TIMEOUT, write_out(cw, &self.to_client)).await;
        e
    }

    /// Ends the session over the server connection's end or failure. What the server sent
    /// before goes to the client; then, unless that held the server's own FATAL error (an
    /// administrator's termination, a timeout), a FATAL error of pgfence's saying that the
    /// server connection was lost (08006): a server process that crashed or was killed, or a
    /// network that failed, says nothing itself, and the client should not have to guess
    /// whether pgfence or the server went away.
    async fn server_lost(
        &mut self,
        cw: &mut crate::net::WriteHalf<'_>,
        e: std::io::Error,
    ) -> SessionError {
        let e = SessionError::ServerIo(e);
        if self.server_fatal.is_none() {
            return self.fail(cw, e).await;
        }
        let _ = crate::deadline::timeout(FAIL_WRITE_TIMEOUT, write_out(cw, &self.to_client)).await;
        e
    }

    /// Tells the client why pgfence ends its session: shutting down, or `KILL_CLIENT`. What
    /// it is owed goes first; then the error, which says so when requests are unanswered
    /// (the server may still commit a COMMIT among them: a review found a client told
    /// 57P01 for a COMMIT that committed, stop 55). Not after part of a message streamed
    /// (see `server_stream_left`): the client could not read it. A client that does not
    /// read cannot hold the session (it held `KILL_CLIENT`'s and a shutdown's end).
    async fn say_goodbye(
        &mut self,
        cw: &mut crate::net::WriteHalf<'_>,
        e: SessionError,
    ) -> SessionError {
        if self.server_stream_left == 0 {
            if self.replies.is_empty() {
                e.to_client(&mut self.to_client);
            } else {
                e.to_client_in_flight(&mut self.to_client);
            }
        }
        let _ = crate::deadline::timeout(FAIL_WRITE_TIMEOUT, write_out(cw, &self.to_client)).await;
        e
    }

    /// Whether a statement sent now is one a check is owed for, as a rejection log names
    /// it: one that may write; or, where reads are checked, a read that is the first
    /// statement of its transaction to owe the check (a read after a write leaves the
    /// write named).
    #[inline]
    fn owes_check_for(&self, analysis: &Analysis) -> bool {
        analysis.may_write()
            || (self.tx.check_reads
                && !self.tx.dirty
                && analysis
                    .statements
                    .iter()
                    .any(|s| s.kind == fence_core::classify::StatementKind::ReadOnly))
    }

    /// Whether an output buffer may have grown past `SHRINK_BUFFERS_ABOVE` in the handling
    /// just done, which alone appends to them. A `BytesMut` that cannot take more grows when
    /// its bytes do not fit; it reuses its start when that is free (`reserve`), so it
    /// grows past a size only when it holds more than half of it then: past 256 KiB, more
    /// than `READ_CHUNK`. (Bytes written since only make it hold less.)
    #[inline]
    fn outgrown(&self) -> bool {
        self.to_server.len() > READ_CHUNK || self.to_client.len() > READ_CHUNK
    }

    /// The client left (Terminate, or the end of what it sends) with replies owed: the
    /// session stays for them, as PostgreSQL runs what a client sent before it left (a
    /// pipelined COMMIT included), for at most `limits.shutdown_timeout`. What the server
    /// holds back until a Sync or a Flush is flushed (a Flush more changes nothing).
    #[cold]
    #[inline(never)]
    fn stay_for_owed_replies(&mut self, stop: &Stop) {
        if self.grace_after_client.is_none() {
            let stop = stop.clone();
            let grace = self.shared.config().limits.shutdown_timeout;
            self.grace_after_client = Some(tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
                async move {
                    crate::deadline::sleep(grace).await;
                    stop.drain.cancel();
                    stop.kill.cancel();
                },
            )));
        }
        if !self.replies.ends_at_sync_point() {
            crate::protocol::message::flush(&mut self.to_server);
        }
    }

    /// Whether the server still owes replies to what the client sent before it left, and
    /// will send them without more from the client (not in `COPY FROM STDIN`, which waits
    /// for its data: PostgreSQL ends that at the client's end of file).
    fn answers_after_client_left(&self) -> bool {
        self.phase == Phase::Ready
            && !self.replies.is_empty()
            && self.copy_in == CopyIn::None
            && self.copy_from_client == CopyFromClient::None
    }

    /// Whether client messages are read and handled now.
    #[inline]
    fn reads_client(&self) -> bool {
        (self.hold != Hold::Waiting || self.copy_through) && self.server_stream_left == 0
    }

    /// Processes every complete client message in `buf`.
    fn on_client_bytes(&mut self, buf: &mut BytesMut) -> Result<Flow, SessionError> {
        let mut at = 0;
        let mut flow = Flow::Continue;
        while let Some((tag, len)) =
            next_frame(&buf[at..], self.max_message).map_err(SessionError::ClientFrame)?
        {
            let frame = &buf[at..at + len];
            flow = match self.phase {
                Phase::Auth | Phase::ReadAudit => self.on_auth_client_frame(tag, frame)?,
                Phase::Ready => self.on_client_frame(tag, frame)?,
                Phase::Admin => self.on_admin_frame(tag, frame)?,
            };
            // A message held comes back to be handled again (see `read_audit`).
            self.handled_again = flow == Flow::Hold;
            if flow == Flow::Hold {
                break;
            }
            at += len;
            if matches!(flow, Flow::Terminate | Flow::Pause) {
                break;
            }
        }
        buf.advance(at);
        Ok(flow)
    }

    /// Processes every complete server message in `buf`; a large row or copy data for the
    /// client goes on as it arrives (see `server_stream_left`).
    fn on_server_bytes(&mut self, buf: &mut BytesMut) -> Result<(), SessionError> {
        if self.server_stream_left > 0 {
            let n = self.server_stream_left.min(buf.len());
            self.to_client.extend_from_slice(&buf[..n]);
            buf.advance(n);
            self.server_stream_left -= n;
            if self.server_stream_left > 0 {
                return Ok(());
            }
        }
        let mut at = 0;
        while let Some((tag, len)) =
            next_frame(&buf[at..], SERVER_MAX_MESSAGE).map_err(SessionError::ServerFrame)?
        {
            let frame = &buf[at..at + len];
            if tag == b'E' {
                let fields = crate::protocol::message::error_fields(frame);
                if fields.severity == b"FATAL" || fields.severity == b"PANIC" {
                    let client_caused = self.phase == Phase::Auth
                        && (fields.code.starts_with(b"28") || fields.code == b"3D000");
                    self.server_fatal = Some(!client_caused);
                    if self.phase == Phase::Auth && fields.code == b"53300" {
                        // The admin console's login (`first_reply` retries the others), or
                        // one it gave up on: free what is kept now, for the next try.
                        self.shared.free_server_slots();
                    }
                }
            }
            match self.phase {
                Phase::Auth => self.on_auth_server_frame(tag, frame)?,
                Phase::ReadAudit => self.on_read_audit_frame(tag, frame)?,
                Phase::Ready => self.on_server_frame(tag, frame)?,
                // Only SHOW FENCES asks the server.
                Phase::Admin => self.on_console_server_frame(tag, frame),
            }
            at += len;
        }
        if buf.len() - at >= 5 && self.streams_to_client(&buf[at..]) {
            if self
                .replies
                .front()
                .is_some_and(|p| p.request == Request::Execute)
            {
                // The server sends an Execute's output as its buffer fills, the rest only
                // at a Sync or Flush, which pgfence does not read from the client while it
                // streams: one of its own (review O, stop 55: a 300 KB row whose Sync came
                // in a later write hung the session; psycopg's pipelines did so).
                crate::protocol::message::flush(&mut self.to_server);
            }
            self.to_client.extend_from_slice(&buf[at..]);
            let total = 1
                + u32::from_be_bytes([buf[at + 1], buf[at + 2], buf[at + 3], buf[at + 4]]) as usize;
            self.server_stream_left = total - (buf.len() - at);
            at = buf.len();
        }
        buf.advance(at);
        if self.copy_from_client == CopyFromClient::MayStart && self.replies.is_empty() {
            // Everything sent is answered without a CopyInResponse: the COPY failed, or never
            // ran (an error before it).
            self.copy_from_client = CopyFromClient::None;
        }
        if self.flushed != Flushed::No && self.replies.is_empty() {
            if self.hold == Hold::Waiting {
                // Answered, or skipped after an error of the client's earlier in the batch
                // (the held message then goes on as it is, and the server skips it too).
                self.hold = if self.flushed == Flushed::Check && !self.skipping_to_sync {
                    Hold::Passed
                } else {
                    Hold::None
                };
            }
            self.flushed = Flushed::No;
        } else if self.skipping_to_sync && self.hold == Hold::Waiting && self.replies.is_empty() {
            // An error skipped the rest of the client's batch, and nothing is left in flight
            // to answer what a message of it waits for (its Sync is behind it): the held
            // message goes on as it is, and the server skips it too. A FunctionCall held
            // behind a failing Execute once hung the session so.
            self.hold = Hold::None;
        }
        Ok(())
    }

    /// Whether the incomplete server message at the start of `rest` (its header read) goes
    /// on to the client as its bytes arrive: a row (DataRow) or copy data (CopyData) of
    /// at least `STREAM_ABOVE` bytes for the client, which pgfence forwards as it is.
    /// Held whole, a few sessions' `SELECT repeat('x', 300000000)` took pgfence past 1 GB
    /// (PgBouncer: 4 MB; a review, stop 55).
    #[inline]
    fn streams_to_client(&self, rest: &[u8]) -> bool {
        let total = 1 + u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
        total >= STREAM_ABOVE
            && self.phase == Phase::Ready
            && match (rest[0], self.replies.front()) {
                (b'D' | b'd', None) => true,
                (b'D', Some(p)) => {
                    p.origin == Origin::Client
                        && !(p.request == Request::Query && p.plan.in_check())
                }
                (b'd', Some(p)) => p.origin == Origin::Client,
                _ => false,
            }
    }

    /// Cleans up shared state when the session ends (again when it is dropped, for a
    /// session that ends in a panic outside [`Session::guarded`]).
    fn finish(&mut self) {
        self.cancels.abandon();
        if let Some((pid, key)) = self.client_key.take() {
            self.shared.cancel.unregister(pid, key);
        }
        self.shared.clients.remove(&self.id);
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        self.finish();
    }
}

/// Runs `f` when dropped.
struct Defer<F: FnMut()>(F);

impl<F: FnMut()> Drop for Defer<F> {
    fn drop(&mut self) {
        (self.0)()
    }
}

fn scopeguard<F: FnMut()>(f: F) -> Defer<F> {
    Defer(f)
}
