//! Session errors, and the one place that turns them into what the client sees.

use std::io;

use bytes::BytesMut;

use crate::protocol::frame::FrameError;
use crate::protocol::message::{error_response, ErrorMessage};
use crate::protocol::startup::StartupError;

/// The message a panic carries, from its payload (`panic!` makes a `&str` or a `String`).
pub fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    payload
        .downcast_ref::<&str>()
        .copied()
        .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
        .unwrap_or("a panic without a message")
}

/// Who failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    Client,
    Server,
    Proxy,
}

/// Why a session ended early.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("client connection failed: {0}")]
    ClientIo(#[source] io::Error),
    #[error("upstream connection failed: {0}")]
    ServerIo(#[source] io::Error),
    #[error("invalid startup packet: {0}")]
    Startup(#[from] StartupError),
    #[error("client sent an invalid message: {0}")]
    ClientFrame(#[source] FrameError),
    #[error("upstream sent an invalid message: {0}")]
    ServerFrame(#[source] FrameError),
    #[error("client sent unexpected message type {0:?}")]
    UnexpectedClientMessage(char),
    #[error("upstream sent unexpected message type {0:?}")]
    UnexpectedServerMessage(char),
    #[error("client sent a malformed {0} message")]
    MalformedClientMessage(&'static str),
    #[error("client sent a {0} message during COPY FROM STDIN, which only CopyData, CopyDone or CopyFail may follow")]
    MessageDuringCopyIn(&'static str),
    #[error("the client did not complete its startup packet within {0:?}")]
    StartupTimeout(std::time::Duration),
    #[error("pgfence could not connect to upstream {upstream}: {reason}")]
    UpstreamConnect { upstream: String, reason: String },
    #[error("sorry, too many clients already (limits.max_client_connections = {0})")]
    TooManyClients(usize),
    #[error("pgfence is shutting down")]
    Shutdown,
    #[error("terminating connection due to administrator command (KILL_CLIENT in pgfence's admin console)")]
    Killed,
    #[error("client_encoding {0} is not supported through pgfence: its multi-byte characters can hide statement boundaries from the fence")]
    UnsupportedEncoding(String),
    #[error("pgfence cannot tell where the statements of this Query end: it holds a \\' in a literal, and standard_conforming_strings may change in the unsynced extended-protocol messages before it (send Sync before the Query)")]
    QueryLexingInDoubt,
    #[error("pgfence cannot tell where the BEGIN ATOMIC body of a CREATE FUNCTION or PROCEDURE in this Query ends (a column label named case or end?), so nor where its statements end: quote the label (AS \"case\"), or send the statement in a Query of its own")]
    AtomicBodyInDoubt,
    #[error("user {0:?} may not use the pgfence admin console (admin.users)")]
    NotAdmin(String),
    #[error("the client sent data before pgfence answered its encryption request")]
    EncryptionAfterStartup,
    #[error("the client asked for encryption on a connection that is already encrypted")]
    EncryptionTwice,
    #[error("TLS handshake with the client failed: {0}")]
    TlsHandshake(#[source] io::Error),
    #[error("pgfence requires TLS from its clients (client_tls.sslmode = {0})")]
    TlsRequired(pgfence_config::ClientSslMode),
    #[error("certificate authentication failed for user {user:?}: the client certificate is for {cn:?} (client_tls.sslmode = verify-full)")]
    CertificateUserMismatch { user: String, cn: String },
    #[error("SCRAM channel binding cannot pass through pgfence: the client uses TLS to pgfence and pgfence uses its own TLS connection to the server")]
    ChannelBindingThroughProxy,
    /// A panic in the session's protocol logic, with its message.
    #[error("pgfence internal error: {0}")]
    Bug(String),
}

impl SessionError {
    /// Who is at fault, for logs.
    pub fn side(&self) -> Side {
        match self {
            SessionError::ClientIo(_)
            | SessionError::Startup(_)
            | SessionError::ClientFrame(_)
            | SessionError::UnexpectedClientMessage(_)
            | SessionError::MalformedClientMessage(_)
            | SessionError::MessageDuringCopyIn(_)
            | SessionError::StartupTimeout(_)
            | SessionError::EncryptionAfterStartup
            | SessionError::EncryptionTwice
            | SessionError::TlsHandshake(_)
            | SessionError::TlsRequired(_)
            | SessionError::CertificateUserMismatch { .. }
            | SessionError::ChannelBindingThroughProxy
            | SessionError::QueryLexingInDoubt
            | SessionError::AtomicBodyInDoubt => Side::Client,
            SessionError::ServerIo(_)
            | SessionError::ServerFrame(_)
            | SessionError::UnexpectedServerMessage(_)
            | SessionError::UpstreamConnect { .. } => Side::Server,
            SessionError::TooManyClients(_)
            | SessionError::Shutdown
            | SessionError::Killed
            | SessionError::NotAdmin(_)
            | SessionError::UnsupportedEncoding(_)
            | SessionError::Bug(_) => Side::Proxy,
        }
    }

    /// SQLSTATE the client is told.
    fn sqlstate(&self) -> &'static str {
        match self {
            SessionError::TooManyClients(_) => "53300",
            SessionError::UnsupportedEncoding(_)
            | SessionError::QueryLexingInDoubt
            | SessionError::AtomicBodyInDoubt => "0A000",
            SessionError::NotAdmin(_)
            | SessionError::TlsRequired(_)
            | SessionError::CertificateUserMismatch { .. }
            | SessionError::ChannelBindingThroughProxy
            | SessionError::Startup(StartupError::NoUser) => "28000",
            SessionError::Shutdown | SessionError::Killed => "57P01",
            // feature_not_supported, as PostgreSQL answers an unsupported version.
            SessionError::Startup(StartupError::Version { .. }) => "0A000",
            SessionError::UpstreamConnect { .. } | SessionError::ServerIo(_) => "08006",
            SessionError::Startup(_)
            | SessionError::ClientFrame(_)
            | SessionError::UnexpectedClientMessage(_)
            | SessionError::MalformedClientMessage(_)
            | SessionError::MessageDuringCopyIn(_)
            | SessionError::EncryptionAfterStartup
            | SessionError::EncryptionTwice
            | SessionError::StartupTimeout(_) => "08P01",
            SessionError::ClientIo(_)
            | SessionError::TlsHandshake(_)
            | SessionError::ServerFrame(_)
            | SessionError::UnexpectedServerMessage(_)
            | SessionError::Bug(_) => "XX000",
        }
    }

    fn hint(&self) -> Option<&'static str> {
        match self {
            SessionError::UpstreamConnect { .. } => Some(
                "Check that PostgreSQL is running and reachable at pgfence's --upstream address, and upstream.sslmode and upstream.sslrootcert if it uses TLS.",
            ),
            SessionError::ServerIo(_) => Some(
                "The server process may have crashed or been terminated, or the network to it failed: see the server's log. A COMMIT that was in flight may or may not have committed.",
            ),
            SessionError::Bug(_) => Some(
                "This is a bug in pgfence, not in the application: pgfence's log has its details (\"pgfence bug\"); please report it. This session's server connection was closed, so an open transaction rolled back; other sessions go on.",
            ),
            SessionError::ChannelBindingThroughProxy => Some(
                "Connect with channel_binding=disable: pgfence hides SCRAM-SHA-256-PLUS when its connection to the server uses TLS.",
            ),
            SessionError::TlsRequired(mode) if mode.requires_certificate() => Some(
                "Connect with sslmode=require (or verify-ca, verify-full), and sslcert and sslkey naming a client certificate signed by a CA of client_tls.ca_file.",
            ),
            SessionError::TlsRequired(_) => {
                Some("Connect with sslmode=require (or verify-ca, verify-full) in the connection string.")
            }
            SessionError::CertificateUserMismatch { .. } => Some(
                "Log in as the user the certificate's common name (CN) names, or use a certificate issued for this user.",
            ),
            SessionError::ClientFrame(FrameError::TooLarge { .. }) => Some(
                "Raise limits.max_message_size in pgfence's configuration if this is intended.",
            ),
            _ => None,
        }
    }

    /// Whether the client connection can still take an error message.
    pub fn client_can_hear(&self) -> bool {
        !matches!(
            self,
            SessionError::ClientIo(_) | SessionError::TlsHandshake(_)
        )
    }

    /// Appends the FATAL ErrorResponse that tells the client why its session ends.
    pub fn to_client(&self, out: &mut BytesMut) {
        self.to_client_hinted(out, self.hint());
    }

    /// [`SessionError::to_client`] for a session pgfence ends (shutdown, `KILL_CLIENT`)
    /// while requests it sent are unanswered: the server may still run them, a COMMIT
    /// included, which PostgreSQL's own 57P01 would have rolled back.
    pub fn to_client_in_flight(&self, out: &mut BytesMut) {
        self.to_client_hinted(
            out,
            Some("Requests of this session were still in flight: the server may have run them or not. A COMMIT among them may or may not have committed."),
        );
    }

    fn to_client_hinted(&self, out: &mut BytesMut, hint: Option<&str>) {
        let message = match self {
            // PostgreSQL's words, as they are.
            SessionError::Startup(e @ StartupError::NoUser) => e.to_string(),
            _ => self.to_string(),
        };
        if let SessionError::Startup(StartupError::Version { major, .. }) = self {
            if *major < 3 {
                // A protocol 2 client reads errors in that protocol's format, as PostgreSQL
                // sends them: `E`, then the text, NUL-terminated, no length.
                out.extend_from_slice(b"E");
                out.extend_from_slice(format!("FATAL:  {message}\n").as_bytes());
                out.extend_from_slice(b"\0");
                return;
            }
        }
        error_response(
            out,
            &ErrorMessage {
                severity: "FATAL",
                code: self.sqlstate(),
                message: &message,
                detail: None,
                hint,
            },
        );
    }
}
