//! A server connection kept for the next client with the same startup packet (PgBouncer's
//! session pooling): a new client logs in on it by the login reply the server gave, and a
//! client that leaves it clean has it reset with `DISCARD ALL` and put back in the pool.

use std::time::Instant;

use bytes::BytesMut;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tracing::debug;

use crate::error::SessionError;
use crate::net::Stream;
use crate::pool::{LoginReply, Parked, PoolKey, ServerInfo};
use crate::protocol::next_frame;

use super::{
    read_audit, tx, CommitCheck, CopyIn, Hold, Phase, Session, FAIL_WRITE_TIMEOUT, RESET_TIMEOUT,
    SERVER_MAX_MESSAGE,
};

/// Asks a kept connection for a ReadyForQuery before a client gets it, within `timeout`:
/// with `ask_audit` by asking whether reads may write in its database ([`read_audit`],
/// whose answer it returns), else with a Sync. An idle backend reports what a configuration
/// reload changed (`default_transaction_read_only`, `in_hot_standby` after a promotion, ...)
/// only with its next ReadyForQuery: without this round trip the client's login would give
/// the values of the last reset, and libpq's `target_session_attrs` could pick the wrong
/// server. A connection the server ended meanwhile fails here, and the session makes a new
/// one.
pub(super) async fn refresh_kept(
    server: &mut Stream,
    login: &mut LoginReply,
    timeout: std::time::Duration,
    ask_audit: bool,
) -> Result<Option<read_audit::Answer>, SessionError> {
    use crate::protocol::message as msg;
    let mut out = BytesMut::new();
    let mut answer = read_audit::Answer::None;
    if ask_audit {
        msg::query(&mut out, read_audit::QUERY);
    } else {
        msg::sync(&mut out);
    }
    let refresh = exchange(server, &out, |tag, frame| match tag {
        b'S' => {
            if let Some((name, _)) = msg::cstr(msg::body(frame)) {
                login.set_param(name, frame);
            }
            Ok(())
        }
        b'N' => Ok(()),
        _ if ask_audit => answer.on_reply(tag, frame),
        _ => Err(SessionError::UnexpectedServerMessage(tag as char)),
    });
    crate::deadline::timeout(timeout, refresh)
        .await
        .unwrap_or(Err(SessionError::ServerIo(
            std::io::ErrorKind::TimedOut.into(),
        )))?;
    Ok(ask_audit.then_some(answer))
}

/// Sends `request` on an idle server connection and hands every reply but the closing
/// ReadyForQuery to `on_reply`, which refuses what it does not expect. Ends with that
/// ReadyForQuery, which must say idle and be the last bytes the server sent.
async fn exchange(
    server: &mut Stream,
    request: &[u8],
    mut on_reply: impl FnMut(u8, &[u8]) -> Result<(), SessionError>,
) -> Result<(), SessionError> {
    server
        .write_all(request)
        .await
        .map_err(SessionError::ServerIo)?;
    server.flush().await.map_err(SessionError::ServerIo)?;
    let mut buf = BytesMut::with_capacity(1024);
    loop {
        while let Some((tag, len)) =
            next_frame(&buf, SERVER_MAX_MESSAGE).map_err(SessionError::ServerFrame)?
        {
            let frame = buf.split_to(len);
            if tag == b'Z' && crate::protocol::message::ready_status(&frame) == b'I' {
                return match buf.first() {
                    None => Ok(()),
                    Some(&next) => Err(SessionError::UnexpectedServerMessage(next as char)),
                };
            }
            on_reply(tag, &frame)?;
        }
        if server
            .read_buf(&mut buf)
            .await
            .map_err(SessionError::ServerIo)?
            == 0
        {
            return Err(SessionError::ServerIo(
                std::io::ErrorKind::UnexpectedEof.into(),
            ));
        }
    }
}

impl Session {
    /// Logs a client in on a kept server connection: the client gets the login reply the
    /// server gave, with pgfence's own cancel key for it, as if the server had just sent it.
    pub(super) fn replay_login(&mut self, login: LoginReply) -> Result<(), SessionError> {
        use crate::protocol::message::write_message;
        let mut frame = BytesMut::new();
        write_message(&mut frame, b'R', |o| bytes::BufMut::put_i32(o, 0));
        self.on_auth_server_frame(b'R', &frame)?;
        for (_, param) in &login.params {
            self.on_auth_server_frame(b'S', param)?;
        }
        self.on_auth_server_frame(b'K', &login.backend_key)?;
        frame.clear();
        crate::protocol::message::ready_for_query(&mut frame, b'I');
        self.on_auth_server_frame(b'Z', &frame)?;
        Ok(())
    }

    /// Whether the server session is idle and clean enough to be reset and kept.
    fn poolable(&self) -> bool {
        self.phase == Phase::Ready
            && self.reusable_login
            && !self.client_left_mid_message
            && self.server_fatal.is_none()
            && self.tx.view == tx::View::Idle
            && self.replies.is_empty()
            // At a sync point: after a batch the client never synced (it left), the reset's
            // `DISCARD ALL` would end the batch's implicit transaction, and commit what a
            // Bind of it wrote (a review).
            && !self.batch_open
            && self.hold == Hold::None
            && self.copy_in == CopyIn::None
            && self.commit_check == CommitCheck::None
            && self.held_complete.is_none()
            && self.discard_until_sync.is_none()
            && self.to_server.is_empty()
            && !self.login.backend_key.is_empty()
    }

    /// After the client left: keeps the server connection for the next client when it can
    /// be reset, else ends the server session with Terminate.
    pub(super) async fn release(
        &mut self,
        mut server: Stream,
        born: Instant,
        key: Option<PoolKey>,
    ) {
        if let Some(key) = key.filter(|_| self.poolable()) {
            // A cancel still on its way could hit the reset, or the next client's statement.
            let cancels = self.cancels.clone();
            let reset = async {
                cancels.settled().await;
                self.reset(&mut server).await
            };
            match crate::deadline::timeout(RESET_TIMEOUT, reset).await {
                Ok(Ok(())) => {
                    let tls = server.tls();
                    if let Ok(stream) = server.into_std() {
                        let login = std::mem::take(&mut self.login);
                        let info = ServerInfo {
                            user: self.user.clone(),
                            database: self.database.clone(),
                            application_name: self.application_name.clone(),
                            backend_pid: self.backend_pid,
                            tls,
                        };
                        let config = self.shared.config();
                        self.shared.pool.put(
                            key,
                            Parked::new(stream, login, info, born),
                            &config.pool,
                        );
                    }
                    return;
                }
                Ok(Err(e)) => debug!(error = %e, "server reset failed: closing the connection"),
                Err(_) => debug!("server reset timed out: closing the connection"),
            }
        }
        let terminate = &crate::protocol::message::TERMINATE;
        // Shutting the stream down sends TLS's close_notify after the Terminate.
        let goodbye = async {
            server.write_all(terminate).await?;
            server.shutdown().await
        };
        let _ = crate::deadline::timeout(FAIL_WRITE_TIMEOUT, goodbye).await;
    }

    /// `DISCARD ALL` (PgBouncer's `server_reset_query`): drops what the session left
    /// behind (settings, prepared statements, temporary tables, LISTEN, session advisory
    /// locks) and records the parameters it reports back.
    async fn reset(&mut self, server: &mut Stream) -> Result<(), SessionError> {
        let mut out = BytesMut::new();
        crate::protocol::message::query(&mut out, b"DISCARD ALL");
        exchange(server, &out, |tag, frame| match tag {
            b'S' => self.on_parameter_status(frame),
            b'C' | b'N' => Ok(()),
            _ => Err(SessionError::UnexpectedServerMessage(tag as char)),
        })
        .await
    }
}
