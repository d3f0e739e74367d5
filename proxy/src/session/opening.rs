//! The first bytes of a connection: startup packets (TLS when pgfence offers it, GSS
//! encryption declined, cancel requests served), the connection to the upstream server, and the FATAL error a
//! client gets when its session cannot start.

use std::time::Instant;

use bytes::{Buf, BytesMut};
use pgfence_config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::{debug, info, warn};

use crate::cancel;
use crate::error::SessionError;
use crate::net::{ClientAddr, Stream};
use crate::protocol::message::error_fields;
use crate::protocol::next_frame;
use crate::protocol::startup::{next_startup, Startup, StartupError, StartupPacket};
use crate::state::Shared;

use super::{Stop, READ_CHUNK, SERVER_MAX_MESSAGE};

/// How long a login refused for lack of connection slots is tried again, after pgfence
/// closed kept connections to free some (their backends give the slots back as they exit).
const SLOTS_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Pause between two such tries (at the resolution of [`crate::deadline`]).
const SLOTS_RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// A client whose startup packet pgfence read and accepted: what its session starts from.
pub(super) struct Accepted {
    /// The connection, over TLS if the client asked for it.
    pub client: Stream,
    pub startup: Startup,
    /// The startup packet's length at the front of the read buffer.
    pub packet_len: usize,
    /// The client's TLS protocol and cipher suite, if it uses TLS.
    pub tls: Option<String>,
    /// The common name of the client's certificate, if it sent one.
    pub client_cn: Option<String>,
    /// It asked for the admin console (virtual database `pgfence`), and may use it.
    pub admin: bool,
}

/// Opens a client's session: the TLS handshake when the client asks for it and pgfence
/// offers it, then the startup packet, within `limits.startup_timeout`. A cancel request is
/// served here; a client that may not log in (TLS required, a certificate for another
/// user, too many clients, not an admin) gets its FATAL error. `Ok(None)`: the connection
/// ended here without an error of the session's.
pub(super) async fn accept(
    mut client: Stream,
    cbuf: &mut BytesMut,
    peer: &ClientAddr,
    shared: &Shared,
    config: &Config,
    stop: &Stop,
) -> Result<Option<Accepted>, SessionError> {
    let startup_until = Instant::now() + config.limits.startup_timeout;
    let tls_config = match &client {
        Stream::Tcp(_) => shared.client_tls(),
        _ => None,
    };
    let mut tls = None;
    let mut client_cn = None;
    let startup = loop {
        // The TLS handshake and the startup packet share the startup timeout.
        let left = startup_until.saturating_duration_since(Instant::now());
        let opening = tokio::select! {
            r = crate::deadline::timeout(left, read_startup(&mut client, cbuf, tls.is_none() && tls_config.is_some())) => match r {
                Ok(r) => r,
                Err(_) => Err(SessionError::StartupTimeout(config.limits.startup_timeout)),
            },
            _ = stop.drain.cancelled() => Err(SessionError::Shutdown),
        };
        let (Ok(Opening::Tls { direct }), Some(tls_config)) = (&opening, &tls_config) else {
            break opening;
        };
        // Direct: the ClientHello read so far goes to the handshake.
        let hello = direct.then(|| cbuf.split().freeze());
        let left = startup_until.saturating_duration_since(Instant::now());
        let handshake = tokio::select! {
            r = crate::deadline::timeout(left, client.accept_tls(tls_config.clone(), hello)) => r,
            _ = stop.drain.cancelled() => return Err(SessionError::Shutdown),
        };
        // A client that fails its handshake cannot read a plaintext error: it is closed.
        client = match handshake {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                // Worth a line: a certificate the client does not trust fails here.
                info!(client = %peer, error = %e, "TLS handshake with the client failed");
                return Err(SessionError::TlsHandshake(e));
            }
            Err(_) => return Err(SessionError::StartupTimeout(config.limits.startup_timeout)),
        };
        tls = client.tls();
        client_cn = client.tls_peer_common_name();
        debug!(
            tls = tls.as_deref(),
            certificate_cn = client_cn.as_deref(),
            "TLS established"
        );
    };
    let (startup, packet_len) = match startup {
        Ok(Opening::Startup(s, n)) => (s, n),
        // `Tls` only comes when offered, and the loop above answered it.
        Ok(Opening::Closed | Opening::Tls { .. }) => return Ok(None),
        Ok(Opening::Cancel { pid, key }) => {
            match shared.cancel.lookup(pid, key) {
                Some(target) if target.in_flight.defer_while_asking() => {
                    debug!(
                        backend_pid = target.pid,
                        "cancel request held until the read audit's question is answered"
                    );
                    // The client's connection closes when PostgreSQL would close it, once
                    // the server has taken the cancel (the session forwards it), within
                    // the limit of any forwarded cancel.
                    let limit = config.limits.connect_timeout;
                    let forwarded = target.in_flight.forwarded();
                    if crate::deadline::timeout(limit, forwarded).await.is_err() {
                        debug!(
                            backend_pid = target.pid,
                            "cancel connection closed before the held cancel was forwarded"
                        );
                    }
                }
                Some(target) => {
                    debug!(
                        backend_pid = target.pid,
                        tls = target.tls.is_some(),
                        "forwarding cancel request"
                    );
                    let limit = config.limits.connect_timeout;
                    if let Err(e) = cancel::forward(target, limit).await {
                        warn!(error = %e, client = %peer, "cannot forward cancel request to upstream");
                    }
                }
                None => debug!("cancel request with an unknown key ignored"),
            }
            return Ok(None);
        }
        Err(e) => return tell_client(&mut client, e).await.map(|()| None),
    };
    let tls_mode = config.client_tls.sslmode;
    if tls.is_none() && tls_mode.requires_tls() && matches!(peer, ClientAddr::Tcp(_)) {
        return tell_client(&mut client, SessionError::TlsRequired(tls_mode))
            .await
            .map(|()| None);
    }
    if tls.is_some() && tls_mode == pgfence_config::ClientSslMode::VerifyFull {
        // The handshake checked the chain (verify-ca); verify-full also binds the
        // certificate to the user, as PostgreSQL's clientcert=verify-full.
        let cn = client_cn.clone().unwrap_or_default();
        if cn != startup.user() {
            let user = startup.user();
            info!(client = %peer, user = user.as_str(), certificate_cn = cn.as_str(), "client certificate is not for the user");
            return tell_client(
                &mut client,
                SessionError::CertificateUserMismatch { user, cn },
            )
            .await
            .map(|()| None);
        }
    }
    if let Some(limit) = shared.too_many_clients(config) {
        return tell_client(&mut client, SessionError::TooManyClients(limit))
            .await
            .map(|()| None);
    }
    let admin = startup.database() == crate::admin::DATABASE;
    if admin && !config.admin.users.contains(&startup.user()) {
        return tell_client(&mut client, SessionError::NotAdmin(startup.user()))
            .await
            .map(|()| None);
    }
    Ok(Some(Accepted {
        client,
        startup,
        packet_len,
        tls,
        client_cn,
        admin,
    }))
}

/// Sends a FATAL error to a client whose session cannot start, then closes.
pub(super) async fn tell_client(client: &mut Stream, e: SessionError) -> Result<(), SessionError> {
    let mut out = BytesMut::new();
    e.to_client(&mut out);
    let _ = client.write_all(&out).await;
    let _ = client.shutdown().await;
    Err(e)
}

pub(super) async fn connect_upstream(shared: &Shared, config: &Config) -> Result<Stream, String> {
    let connect = Stream::connect(&config.upstream, shared.upstream_tls(), &config.limits);
    match crate::deadline::timeout(config.limits.connect_timeout, connect).await {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(match config.upstream.socket_path() {
            Some(path) => format!("{e} (socket {})", path.display()),
            None => e.to_string(),
        }),
        Err(_) => Err(format!(
            "timed out after {:?}",
            config.limits.connect_timeout
        )),
    }
}

/// Sends a client's startup packet on a fresh server connection and reads the server's
/// first reply into `sbuf`, for the session to relay. If the server refuses the login for
/// lack of connection slots (53300) and pgfence closes connections it kept to free some,
/// the login is tried again on a new connection, about every 100 ms for up to 2 s, so that the
/// client does not pay for pgfence's idle connections. A refusal pgfence cannot relieve
/// (no connection kept), or one that lasts, reaches the client as the server sent it.
pub(super) async fn first_reply(
    mut server: Stream,
    startup: &[u8],
    sbuf: &mut BytesMut,
    shared: &Shared,
    config: &Config,
) -> Result<Stream, SessionError> {
    let until = std::time::Instant::now() + SLOTS_RETRY_FOR;
    let mut freed = false;
    loop {
        server
            .write_all(startup)
            .await
            .map_err(SessionError::ServerIo)?;
        server.flush().await.map_err(SessionError::ServerIo)?;
        let (tag, len) = loop {
            if let Some(frame) =
                next_frame(sbuf, SERVER_MAX_MESSAGE).map_err(SessionError::ServerFrame)?
            {
                break frame;
            }
            if sbuf.capacity() - sbuf.len() < 1024 {
                sbuf.reserve(READ_CHUNK);
            }
            // A server that accepted the connection and says nothing (PostgreSQL's own
            // `authentication_timeout` bounds a client's login): the client is told, and
            // the session ends, rather than hold both connections for good.
            let read =
                crate::deadline::timeout(config.limits.connect_timeout, server.read_buf(sbuf))
                    .await
                    .map_err(|_| SessionError::UpstreamConnect {
                        upstream: config.upstream.to_string(),
                        reason: format!(
                            "no reply to the startup packet within {:?} (limits.connect_timeout)",
                            config.limits.connect_timeout
                        ),
                    })?;
            if read.map_err(SessionError::ServerIo)? == 0 {
                // The session's loop reports the closed connection (after what it said).
                return Ok(server);
            }
        };
        if tag != b'E' || error_fields(&sbuf[..len]).code != b"53300" {
            return Ok(server);
        }
        freed |= shared.free_server_slots() > 0;
        if !freed || std::time::Instant::now() + SLOTS_RETRY_EVERY > until {
            return Ok(server);
        }
        crate::deadline::sleep(SLOTS_RETRY_EVERY).await;
        let _ = server.shutdown().await;
        server = match connect_upstream(shared, config).await {
            Ok(s) => s,
            // The refusal stands: the session relays it.
            Err(_) => return Ok(server),
        };
        sbuf.clear();
    }
}

/// The content type of a TLS handshake record, the first byte a TLS client sends.
const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// How a connection opened.
pub(super) enum Opening {
    Startup(Startup, usize),
    Cancel {
        pid: i32,
        key: i32,
    },
    /// The client asked for TLS, which pgfence offers: answer `S` and run the handshake;
    /// or (`direct`, PostgreSQL 17's `sslnegotiation=direct`) it opened with a TLS
    /// ClientHello, which the handshake reads from the buffer first.
    Tls {
        direct: bool,
    },
    Closed,
}

/// Reads startup packets until a StartupMessage or a CancelRequest, or an SSLRequest or a
/// TLS ClientHello when pgfence offers TLS (`offer_tls`); other encryption requests are
/// declined (`N`) on the way.
pub(super) async fn read_startup(
    client: &mut Stream,
    buf: &mut BytesMut,
    offer_tls: bool,
) -> Result<Opening, SessionError> {
    // Each kind of request is answered once, as PostgreSQL does: a second one is refused
    // as the protocol version it spells (1234.5679, 1234.5680), not declined without end.
    let (mut ssl_declined, mut gss_declined) = (false, false);
    loop {
        // A TLS handshake record where a startup packet's length belongs (its first byte
        // would make a length of at least 369 MB).
        if offer_tls && buf.first() == Some(&TLS_HANDSHAKE_RECORD) {
            return Ok(Opening::Tls { direct: true });
        }
        match next_startup(buf)? {
            Some((request @ (StartupPacket::SslRequest | StartupPacket::GssEncRequest), n)) => {
                buf.advance(n);
                if !buf.is_empty() {
                    // Bytes after an encryption request, before our answer: a client that
                    // did not wait, or an attempt to slip plaintext in ahead of the
                    // handshake (CVE-2021-23214). Declined, then refused, as PostgreSQL does.
                    let _ = client.write_all(b"N").await;
                    return Err(SessionError::EncryptionAfterStartup);
                }
                if matches!(client, Stream::Tls(_)) {
                    return Err(SessionError::EncryptionTwice);
                }
                if offer_tls && matches!(request, StartupPacket::SslRequest) {
                    return Ok(Opening::Tls { direct: false });
                }
                let (declined, minor) = match request {
                    StartupPacket::SslRequest => (&mut ssl_declined, 5679),
                    _ => (&mut gss_declined, 5680),
                };
                if std::mem::replace(declined, true) {
                    return Err(SessionError::Startup(StartupError::Version {
                        major: 1234,
                        minor,
                    }));
                }
                client
                    .write_all(b"N")
                    .await
                    .map_err(SessionError::ClientIo)?;
                continue;
            }
            Some((StartupPacket::Cancel { pid, key }, _)) => {
                return Ok(Opening::Cancel { pid, key })
            }
            Some((StartupPacket::Startup(s), n)) => return Ok(Opening::Startup(s, n)),
            None => {}
        }
        buf.reserve(READ_CHUNK);
        let n = client.read_buf(buf).await.map_err(SessionError::ClientIo)?;
        if n == 0 {
            return Ok(Opening::Closed);
        }
    }
}
