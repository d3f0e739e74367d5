//! The first bytes of a connection: startup packets (declining TLS and GSS encryption,
//! serving cancel requests), the connection to the upstream server, and the FATAL error a
//! client gets when its session cannot start.

use bytes::{Buf, BytesMut};
use pgfence_config::Config;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::SessionError;
use crate::net::Stream;
use crate::protocol::startup::{next_startup, Startup, StartupPacket};

use super::READ_CHUNK;

/// Sends a FATAL error to a client whose session cannot start, then closes.
pub(super) async fn tell_client(client: &mut Stream, e: SessionError) -> Result<(), SessionError> {
    let mut out = BytesMut::new();
    e.to_client(&mut out);
    let _ = client.write_all(&out).await;
    let _ = client.shutdown().await;
    Err(e)
}

pub(super) async fn connect_upstream(config: &Config) -> Result<Stream, String> {
    let connect = Stream::connect(&config.upstream);
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

/// How a connection opened.
pub(super) enum Opening {
    Startup(Startup, usize),
    Cancel { pid: i32, key: i32 },
    Closed,
}

/// Reads startup packets until a StartupMessage or a CancelRequest, declining TLS and GSS
/// encryption (`N`) on the way.
pub(super) async fn read_startup(
    client: &mut Stream,
    buf: &mut BytesMut,
) -> Result<Opening, SessionError> {
    loop {
        match next_startup(buf)? {
            Some((StartupPacket::SslRequest | StartupPacket::GssEncRequest, n)) => {
                buf.advance(n);
                client
                    .write_all(b"N")
                    .await
                    .map_err(SessionError::ClientIo)?;
                if !buf.is_empty() {
                    // Bytes after an encryption request, before our answer: a client that
                    // did not wait (or an attack on the plaintext downgrade). Answered `N`
                    // and then refused, as PostgreSQL does.
                    return Err(SessionError::EncryptionAfterStartup);
                }
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
