//! The first bytes of a connection: startup packets (TLS when pgfence offers it, GSS
//! encryption declined, cancel requests served), the connection to the upstream server, and the FATAL error a
//! client gets when its session cannot start.

use bytes::{Buf, BytesMut};
use pgfence_config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::SessionError;
use crate::net::Stream;
use crate::protocol::message::error_fields;
use crate::protocol::next_frame;
use crate::protocol::startup::{next_startup, Startup, StartupPacket};
use crate::state::Shared;

use super::{READ_CHUNK, SERVER_MAX_MESSAGE};

/// How long a login refused for lack of connection slots is tried again, after pgfence
/// closed kept connections to free some (their backends give the slots back as they exit).
const SLOTS_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(2);

/// Pause between two such tries (at the resolution of [`crate::deadline`]).
const SLOTS_RETRY_EVERY: std::time::Duration = std::time::Duration::from_millis(50);

/// Sends a FATAL error to a client whose session cannot start, then closes.
pub(super) async fn tell_client(client: &mut Stream, e: SessionError) -> Result<(), SessionError> {
    let mut out = BytesMut::new();
    e.to_client(&mut out);
    let _ = client.write_all(&out).await;
    let _ = client.shutdown().await;
    Err(e)
}

pub(super) async fn connect_upstream(shared: &Shared, config: &Config) -> Result<Stream, String> {
    let connect = Stream::connect(&config.upstream, shared.upstream_tls());
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
            if server
                .read_buf(sbuf)
                .await
                .map_err(SessionError::ServerIo)?
                == 0
            {
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
