//! Authentication relayed between client and server, and the admin console's messages.

use std::time::SystemTime;

use tracing::debug;

use crate::cancel::CancelTarget;
use crate::error::SessionError;
use crate::protocol::message as msg;
use crate::state::ClientInfo;

use super::{Flow, Hold, Phase, Session};

/// The authentication request codes pgfence looks at: AuthenticationOk and
/// AuthenticationSASL (the list of SASL mechanisms).
const AUTH_OK: [u8; 4] = 0i32.to_be_bytes();
const AUTH_SASL: [u8; 4] = 10i32.to_be_bytes();

/// The SASL mechanism with channel binding, which a proxy cannot pass through.
const SCRAM_PLUS: &[u8] = b"SCRAM-SHA-256-PLUS";

/// A SASLInitialResponse for SCRAM-SHA-256 whose GS2 header says `y`: the client supports
/// channel binding and, told the server does not, would have the server refuse it as a
/// downgrade (PostgreSQL does when its own connection uses TLS).
fn asks_for_channel_binding(frame: &[u8]) -> bool {
    let body = msg::body(frame);
    let Some(end) = body.iter().position(|&b| b == 0) else {
        return false;
    };
    body[..end] == *b"SCRAM-SHA-256" && body.get(end + 5..end + 7) == Some(b"y,")
}

impl Session {
    /// During authentication the client may only answer the server's requests.
    pub(super) fn on_auth_client_frame(
        &mut self,
        tag: u8,
        frame: &[u8],
    ) -> Result<Flow, SessionError> {
        match tag {
            b'p' => {
                if std::mem::take(&mut self.plus_hidden) && asks_for_channel_binding(frame) {
                    return Err(SessionError::ChannelBindingThroughProxy);
                }
                self.to_server.extend_from_slice(frame);
                Ok(Flow::Continue)
            }
            // The session's end sends Terminate upstream (see `Session::release`).
            b'X' => Ok(Flow::Terminate),
            _ => Err(SessionError::UnexpectedClientMessage(tag as char)),
        }
    }

    /// Relays authentication; swaps BackendKeyData for pgfence's own key.
    pub(super) fn on_auth_server_frame(
        &mut self,
        tag: u8,
        frame: &[u8],
    ) -> Result<(), SessionError> {
        match tag {
            b'K' => {
                let body = msg::body(frame);
                if body.len() < 8 {
                    return Err(SessionError::UnexpectedServerMessage('K'));
                }
                let pid = i32::from_be_bytes([body[0], body[1], body[2], body[3]]);
                let key = i32::from_be_bytes([body[4], body[5], body[6], body[7]]);
                self.backend_pid = pid;
                self.login.backend_key = frame.into();
                let (cpid, ckey) = self.shared.cancel.register(CancelTarget {
                    upstream: self.upstream.clone(),
                    pid,
                    key,
                    tls: self.cancel_tls.clone(),
                    in_flight: self.cancels.clone(),
                });
                self.client_key = Some((cpid, ckey));
                msg::backend_key_data(&mut self.to_client, cpid, ckey);
                tracing::Span::current().record("backend_pid", pid);
            }
            b'Z' if self.read_audit_asked && !self.admin => self.ask_read_audit(frame),
            b'Z' => {
                self.phase = if self.admin {
                    Phase::Admin
                } else {
                    Phase::Ready
                };
                self.tx.on_ready(msg::ready_status(frame), true);
                self.to_client.extend_from_slice(frame);
                self.shared.clients.insert(
                    self.id,
                    ClientInfo {
                        addr: self.client_addr.clone(),
                        tls: self.tls.clone(),
                        certificate_cn: self.client_cn.clone(),
                        user: self.user.clone(),
                        database: self.database.clone(),
                        application_name: self.application_name.clone(),
                        backend_pid: self.backend_pid,
                        connected_at: SystemTime::now(),
                        stop: self.stop.clone(),
                    },
                );
                debug!(
                    user = self.user.as_str(),
                    database = self.database.as_str(),
                    backend_pid = self.backend_pid,
                    "session ready"
                );
            }
            b'S' => {
                self.on_parameter_status(frame)?;
                self.to_client.extend_from_slice(frame);
            }
            b'R' => {
                let body = msg::body(frame);
                // Anything but AuthenticationOk asked the client for credentials: such a
                // connection is never handed to another client.
                if body.get(..4) != Some(&AUTH_OK) {
                    self.reusable_login = false;
                }
                if self.upstream_tls && body.get(..4) == Some(&AUTH_SASL) {
                    // AuthenticationSASL over TLS to the server: SCRAM-SHA-256-PLUS would
                    // bind the login to the server's TLS connection, which the client does
                    // not see.
                    self.plus_hidden = true;
                    let kept = body[4..]
                        .split(|&b| b == 0)
                        .filter(|m| !m.is_empty() && *m != SCRAM_PLUS);
                    msg::write_message(&mut self.to_client, b'R', |o| {
                        o.extend_from_slice(&AUTH_SASL);
                        for mechanism in kept {
                            msg::put_cstr(o, mechanism);
                        }
                        o.extend_from_slice(&[0]);
                    });
                } else {
                    self.to_client.extend_from_slice(frame);
                }
            }
            b'E' | b'N' | b'v' => self.to_client.extend_from_slice(frame),
            _ => return Err(SessionError::UnexpectedServerMessage(tag as char)),
        }
        Ok(())
    }

    /// A message to the admin console. It answers as a PostgreSQL server would, in order:
    /// while the server answers a command for it (`SHOW FENCES`), what the client sent next
    /// waits.
    pub(super) fn on_admin_frame(&mut self, tag: u8, frame: &[u8]) -> Result<Flow, SessionError> {
        if self.console_asked {
            return Ok(self.hold_until_answered());
        }
        // Checked as a session's messages are (see `on_client_frame`).
        if let Some(kind) = msg::Frontend::from_tag(tag) {
            if !msg::well_formed(kind, frame) {
                return Err(SessionError::MalformedClientMessage(kind.name()));
            }
        }
        if self.discard_until_sync.is_some() && !matches!(tag, b'S' | b'X') {
            // As PostgreSQL does after an error in an extended-protocol batch: one error,
            // then the rest of the batch is skipped up to its Sync.
            return Ok(Flow::Continue);
        }
        match tag {
            b'Q' => {
                let sql =
                    msg::query_text(frame).ok_or(SessionError::MalformedClientMessage("Query"))?;
                match crate::admin::answer(&self.shared, &self.user, sql, &mut self.to_client) {
                    crate::admin::Answer::Upstream(sql) => {
                        msg::query(&mut self.to_server, sql);
                        self.console_asked = true;
                    }
                    crate::admin::Answer::Done => {}
                }
                Ok(Flow::Continue)
            }
            b'X' => Ok(Flow::Terminate),
            b'S' => {
                self.discard_until_sync = None;
                msg::ready_for_query(&mut self.to_client, b'I');
                Ok(Flow::Continue)
            }
            // Ignored, as PostgreSQL ignores copy messages outside a COPY (the end of a COPY
            // that failed may still be on its way).
            b'H' | b'd' | b'c' | b'f' => Ok(Flow::Continue),
            b'P' | b'B' | b'D' | b'E' | b'C' => {
                self.discard_until_sync = Some(b'I');
                self.console_refuses(
                    "the pgfence admin console supports the simple query protocol only",
                );
                Ok(Flow::Continue)
            }
            b'F' => {
                // A function call is answered like a Query: its error, then ReadyForQuery.
                self.console_refuses("the pgfence admin console does not run function calls");
                msg::ready_for_query(&mut self.to_client, b'I');
                Ok(Flow::Continue)
            }
            _ => Err(SessionError::UnexpectedClientMessage(tag as char)),
        }
    }

    fn console_refuses(&mut self, message: &str) {
        msg::error_response(
            &mut self.to_client,
            &msg::ErrorMessage {
                severity: "ERROR",
                code: "0A000",
                message,
                detail: None,
                hint: Some("Use psql, or simple_query in your driver."),
            },
        );
    }

    /// The server's reply to a command of the admin console goes to the client as it is,
    /// but for its command tag: `SHOW n`, as the console's other `SHOW` commands end, not
    /// the `SELECT n` of the query behind it. Its ReadyForQuery lets the client's next
    /// messages through.
    pub(super) fn on_console_server_frame(&mut self, tag: u8, frame: &[u8]) {
        match msg::body(frame).strip_prefix(b"SELECT ") {
            Some(rows) if tag == b'C' => msg::write_message(&mut self.to_client, b'C', |o| {
                o.extend_from_slice(b"SHOW ");
                o.extend_from_slice(rows);
            }),
            // `relation "pgfence.fences" does not exist`: the schema is in other databases.
            _ if tag == b'E' && msg::error_fields(frame).code == b"42P01" => {
                let database = self.shared.config().admin.database.clone();
                let hint = format!(
                    "SHOW FENCES reads pgfence.fences in admin.database (\"{database}\" \
                     here), where schema pgfence is not installed: set admin.database to a \
                     database that has it, or run `pgfence install --database {database}`."
                );
                msg::with_hint(frame, hint.as_bytes(), &mut self.to_client);
            }
            _ => self.to_client.extend_from_slice(frame),
        }
        if tag == b'Z' {
            self.console_asked = false;
            if self.hold == Hold::Waiting {
                self.hold = Hold::None;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::asks_for_channel_binding;

    fn initial_response(mechanism: &str, data: &[u8]) -> Vec<u8> {
        let mut body = mechanism.as_bytes().to_vec();
        body.push(0);
        body.extend_from_slice(&(data.len() as i32).to_be_bytes());
        body.extend_from_slice(data);
        let mut frame = vec![b'p'];
        frame.extend_from_slice(&(body.len() as i32 + 4).to_be_bytes());
        frame.extend_from_slice(&body);
        frame
    }

    #[test]
    fn only_scram_with_the_y_flag_asks_for_channel_binding() {
        let y = initial_response("SCRAM-SHA-256", b"y,,n=,r=abc");
        assert!(asks_for_channel_binding(&y));
        let n = initial_response("SCRAM-SHA-256", b"n,,n=,r=abc");
        assert!(!asks_for_channel_binding(&n));
        let plus = initial_response("SCRAM-SHA-256-PLUS", b"p=tls-server-end-point,,n=,r=x");
        assert!(!asks_for_channel_binding(&plus));
        // Truncated or malformed frames are not a request (the server judges them).
        assert!(!asks_for_channel_binding(&y[..y.len() - 10]));
        assert!(!asks_for_channel_binding(b"p\0\0\0\x08abcd"));
        assert!(!asks_for_channel_binding(b"p"));
    }
}
