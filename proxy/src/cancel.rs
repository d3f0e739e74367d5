//! CancelRequest routing. Each client gets its own BackendKeyData from pgfence; a cancel
//! that carries it is forwarded to the upstream backend that serves that client, with the
//! upstream's real key. An unknown key does nothing, as in PostgreSQL.
//!
//! A cancel for a session whose server connection uses TLS goes to the server over TLS too
//! (as libpq 17 sends it), so the backend's key never crosses the network in plain text.
//!
//! The registry also maps a backend back to the pid its client was given, so that a
//! notification names its sender as that sender's client knows it (see
//! [`CancelRegistry::client_pid`]).
//!
//! A cancel can reach its backend twice: PostgreSQL (up to 16 at least) signals the backend,
//! then its process group, which is the backend again. When the server process that sends
//! them is descheduled between the two, the first signal cancels the statement, the client
//! sees the error and sends its next statement, and the second signal cancels that one.
//! A session therefore counts its cancels still being forwarded ([`InFlight`]) and holds its
//! client's next messages, and its server connection back from the pool, until the server
//! has closed every cancel connection: it has sent both signals then.
//!
//! A cancel that comes while the session's read audit asks its question (see
//! `session::read_audit`) would cancel the question, not the client's statement sent behind
//! it, and the statement would run on. It is held until the question is answered, and the
//! session then forwards it ([`InFlight::defer_while_asking`]). The client's cancel
//! connection stays open until then ([`InFlight::forwarded`]), as PostgreSQL's stays until
//! the backend is signalled.

use std::fmt;
use std::sync::atomic::{AtomicU32, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use pgfence_config::UpstreamSslMode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};

use crate::net::{Stream, UpstreamAddr};

/// Where a cancel for one client session must go.
#[derive(Debug, Clone)]
pub struct CancelTarget {
    pub upstream: UpstreamAddr,
    pub pid: i32,
    pub key: i32,
    /// The session's server connection uses TLS: so does its cancel.
    pub tls: Option<CancelTls>,
    /// The session's cancels being forwarded now.
    pub in_flight: Arc<InFlight>,
}

/// How many cancel requests of one session pgfence is forwarding now, and whether one waits
/// for the session's read audit question.
#[derive(Debug, Default)]
pub struct InFlight {
    count: AtomicU32,
    settled: tokio::sync::Notify,
    /// [`QUIET`], [`ASKING`] or [`ASKING_CANCELLED`].
    question: AtomicU8,
}

/// No question of pgfence's own is running in the session.
const QUIET: u8 = 0;
/// The read audit's question is running: a cancel now would cancel it.
const ASKING: u8 = 1;
/// The question is running, and a client's cancel waits for its answer.
const ASKING_CANCELLED: u8 = 2;

impl InFlight {
    /// A cancel is being forwarded: its server may not have sent every signal yet.
    #[inline]
    pub fn busy(&self) -> bool {
        self.count.load(Ordering::Acquire) != 0
    }

    /// The session sends its read audit question: cancels wait for the answer.
    pub fn asking(&self) {
        self.question.store(ASKING, Ordering::Release);
    }

    /// The question is answered: a cancel that came meanwhile, which the session forwards
    /// now ([`forward_counted`]), counted as in flight already, so that the client's cancel
    /// connection waiting in [`InFlight::forwarded`] does not take the answer for the end.
    pub fn answered(self: &Arc<Self>) -> Option<Counted> {
        let counted = self.start();
        (self.question.swap(QUIET, Ordering::AcqRel) == ASKING_CANCELLED).then_some(counted)
    }

    /// The session ends: a cancel held for its question is dropped (nothing is left to
    /// cancel), and the client's cancel connection waiting for it is let go.
    pub fn abandon(&self) {
        if self.question.swap(QUIET, Ordering::AcqRel) == ASKING_CANCELLED {
            self.settled.notify_waiters();
        }
    }

    /// Ready when no cancel is held for the question, and none is being forwarded: a cancel
    /// held when this is called has been forwarded, and its server has taken it (or the
    /// session ended).
    pub async fn forwarded(&self) {
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.cancel_held() && !self.busy() {
                return;
            }
            notified.await;
        }
    }

    /// A client's cancel waits for the question's answer.
    pub fn cancel_held(&self) -> bool {
        self.question.load(Ordering::Acquire) == ASKING_CANCELLED
    }

    /// A client's cancel came: true when the session is asking its question, which then
    /// forwards the cancel once answered (two cancels then make one, as two signals before
    /// the backend handles one do); false when it must be forwarded now.
    pub fn defer_while_asking(&self) -> bool {
        match self.question.compare_exchange(
            ASKING,
            ASKING_CANCELLED,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => true,
            Err(now) => now == ASKING_CANCELLED,
        }
    }

    /// Counts one cancel until the guard is dropped.
    fn start(self: &Arc<Self>) -> Counted {
        self.count.fetch_add(1, Ordering::AcqRel);
        Counted(self.clone())
    }

    /// Ready when no cancel is being forwarded. Each forward ends within
    /// `limits.connect_timeout`, so this does too.
    pub async fn settled(&self) {
        loop {
            let notified = self.settled.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if !self.busy() {
                return;
            }
            notified.await;
        }
    }
}

/// One cancel being forwarded; dropped when it is done, failed or timed out.
#[derive(Debug)]
pub struct Counted(Arc<InFlight>);

impl Drop for Counted {
    fn drop(&mut self) {
        if self.0.count.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.settled.notify_waiters();
        }
    }
}

/// How to reach the server over TLS for a cancel: what the session's connection used.
#[derive(Clone)]
pub struct CancelTls {
    pub config: Arc<rustls::ClientConfig>,
    /// The name the server's certificate is checked against (`upstream.host`).
    pub host: String,
    /// `upstream.sslmode` when the session started: only `prefer` lets a server that
    /// declines TLS have the cancel in plain TCP.
    pub sslmode: UpstreamSslMode,
}

impl fmt::Debug for CancelTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CancelTls")
            .field("host", &self.host)
            .field("sslmode", &self.sslmode)
            .finish_non_exhaustive()
    }
}

/// Live sessions by the key pgfence gave their client.
#[derive(Debug, Default)]
pub struct CancelRegistry {
    sessions: DashMap<(i32, i32), CancelTarget>,
    /// The pid each live session's client was given, by its upstream backend.
    client_pids: DashMap<(UpstreamAddr, i32), i32>,
}

impl CancelRegistry {
    /// Registers a session and returns the `(pid, key)` to hand its client.
    pub fn register(&self, target: CancelTarget) -> (i32, i32) {
        loop {
            let pid = rand::random::<i32>() & 0x7fff_ffff;
            let key = rand::random::<i32>();
            if let dashmap::Entry::Vacant(e) = self.sessions.entry((pid, key)) {
                // A kept server connection serves one client at a time: a later session on
                // the same backend replaces the entry of the one before.
                self.client_pids
                    .insert((target.upstream.clone(), target.pid), pid);
                e.insert(target);
                return (pid, key);
            }
        }
    }

    /// Forgets a session when it ends.
    pub fn unregister(&self, pid: i32, key: i32) {
        if let Some((_, target)) = self.sessions.remove(&(pid, key)) {
            self.client_pids
                .remove_if(&(target.upstream, target.pid), |_, given| *given == pid);
        }
    }

    /// The session a client's cancel refers to.
    pub fn lookup(&self, pid: i32, key: i32) -> Option<CancelTarget> {
        self.sessions.get(&(pid, key)).map(|t| t.clone())
    }

    /// The pid pgfence gave the client of the session that `backend` of `upstream` serves,
    /// if a live session does.
    pub fn client_pid(&self, upstream: &UpstreamAddr, backend: i32) -> Option<i32> {
        self.client_pids
            .get(&(upstream.clone(), backend))
            .map(|pid| *pid)
    }
}

/// Forwards a client's cancel for `target`, connecting (TLS handshake included) within
/// `limit` (`limits.connect_timeout`), so that a server that never answers does not keep
/// the task; what went wrong, for the log. The cancel counts as in flight from this call,
/// before the future is first polled.
pub fn forward(
    target: CancelTarget,
    limit: Duration,
) -> impl std::future::Future<Output = Result<(), String>> {
    forward_counted(target.in_flight.start(), target, limit)
}

/// [`forward`], for a cancel counted as in flight already.
pub async fn forward_counted(
    counted: Counted,
    target: CancelTarget,
    limit: Duration,
) -> Result<(), String> {
    let _counted = counted;
    match crate::deadline::timeout(limit, send_cancel(target)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("timed out after {limit:?}")),
    }
}

/// Sends a CancelRequest for `target` to its upstream server, and waits until the server
/// closes the connection: it has then signalled the backend, so the client, whose own
/// connection pgfence closes next, is told as late as PostgreSQL would tell it (libpq's
/// `PQcancel` waits for that close before it returns).
pub async fn send_cancel(target: CancelTarget) -> std::io::Result<()> {
    let mut packet = [0u8; 16];
    packet[0..4].copy_from_slice(&16u32.to_be_bytes());
    packet[4..8].copy_from_slice(&80877102u32.to_be_bytes());
    packet[8..12].copy_from_slice(&target.pid.to_be_bytes());
    packet[12..16].copy_from_slice(&target.key.to_be_bytes());
    let mut stream = match (&target.upstream, target.tls) {
        (UpstreamAddr::Tcp(addr), None) => Stream::Tcp(TcpStream::connect(addr).await?),
        (UpstreamAddr::Tcp(addr), Some(tls)) => {
            let s = TcpStream::connect(addr).await?;
            Stream::start_tls(s, tls.config, &tls.host, tls.sslmode).await?
        }
        (UpstreamAddr::Unix(path), _) => Stream::Unix(UnixStream::connect(path).await?),
    };
    stream.write_all(&packet).await?;
    stream.shutdown().await?;
    // The server sends nothing: whatever ends the read (end of stream, or a reset), the
    // request was handled.
    let mut end = [0u8; 1];
    let _ = stream.read(&mut end).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::TcpListener;

    /// A CancelRequest for pid 4242, key 7.
    const CANCEL_4242: [u8; 16] = [0, 0, 0, 16, 4, 210, 22, 46, 0, 0, 16, 146, 0, 0, 0, 7];

    /// What a fake server received on its one connection.
    #[derive(Debug, PartialEq, Eq)]
    enum Received {
        /// Bytes in plain TCP, with no SSLRequest first.
        Plain(Vec<u8>),
        /// An SSLRequest, then (after `N`) these bytes in plain TCP.
        Declined(Vec<u8>),
        /// An SSLRequest, then these bytes inside TLS.
        Tls(Vec<u8>),
        /// An SSLRequest left unanswered, then these bytes before the client went away.
        Unanswered(Vec<u8>),
    }

    /// No answer to the SSLRequest: the server holds the connection without a word.
    const SILENT: u8 = 0;

    /// A server on a free port that answers an SSLRequest with `answer` (`S`: then runs
    /// the TLS handshake with pgfence's own acceptor, as the server's end; [`SILENT`]:
    /// nothing).
    async fn fake_server(
        answer: u8,
        server_tls: Arc<rustls::ServerConfig>,
    ) -> (u16, tokio::task::JoinHandle<Received>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut first = [0u8; 8];
            s.read_exact(&mut first).await.unwrap();
            let mut rest = Vec::new();
            if first != crate::protocol::startup::SSL_REQUEST_PACKET {
                rest.extend_from_slice(&first);
                s.read_to_end(&mut rest).await.unwrap();
                return Received::Plain(rest);
            }
            if answer == b'S' {
                let mut tls = Stream::Tcp(s).accept_tls(server_tls, None).await.unwrap();
                tls.read_to_end(&mut rest).await.unwrap();
                Received::Tls(rest)
            } else if answer == SILENT {
                s.read_to_end(&mut rest).await.unwrap();
                Received::Unanswered(rest)
            } else {
                s.write_all(&[answer]).await.unwrap();
                s.read_to_end(&mut rest).await.unwrap();
                Received::Declined(rest)
            }
        });
        (port, task)
    }

    fn tls_target(
        port: u16,
        sslmode: UpstreamSslMode,
        client_tls: Arc<rustls::ClientConfig>,
    ) -> CancelTarget {
        CancelTarget {
            tls: Some(CancelTls {
                config: client_tls,
                host: "localhost".to_string(),
                sslmode,
            }),
            ..target(port, 4242)
        }
    }

    /// A plain session's cancel is the 16-byte CancelRequest in plain TCP; a TLS session's
    /// goes over TLS (the server reads it from the TLS stream, and nothing in plain text).
    #[tokio::test]
    async fn a_cancel_uses_tls_when_its_session_does() {
        let (server_tls, client_tls) = crate::tls::tests::configs();
        let (port, server) = fake_server(b'S', server_tls.clone()).await;
        send_cancel(target(port, 4242)).await.unwrap();
        assert_eq!(server.await.unwrap(), Received::Plain(CANCEL_4242.to_vec()));

        let (port, server) = fake_server(b'S', server_tls).await;
        send_cancel(tls_target(port, UpstreamSslMode::Require, client_tls))
            .await
            .unwrap();
        assert_eq!(server.await.unwrap(), Received::Tls(CANCEL_4242.to_vec()));
    }

    /// A server that declines TLS gets no cancel in plain text unless `upstream.sslmode`
    /// is `prefer`.
    #[tokio::test]
    async fn a_server_declining_tls_gets_the_cancel_only_under_prefer() {
        let (server_tls, client_tls) = crate::tls::tests::configs();
        let (port, server) = fake_server(b'N', server_tls.clone()).await;
        let err = send_cancel(tls_target(
            port,
            UpstreamSslMode::Require,
            client_tls.clone(),
        ))
        .await
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("the server does not support TLS, and upstream.sslmode = require"),
            "{err}"
        );
        assert_eq!(server.await.unwrap(), Received::Declined(Vec::new()));

        let (port, server) = fake_server(b'N', server_tls).await;
        send_cancel(tls_target(port, UpstreamSslMode::Prefer, client_tls))
            .await
            .unwrap();
        assert_eq!(
            server.await.unwrap(),
            Received::Declined(CANCEL_4242.to_vec())
        );
    }

    /// A session counts its cancel as in flight from the moment it is forwarded until the
    /// server has closed the cancel's connection, and `settled` waits for that.
    #[tokio::test]
    async fn a_cancel_is_in_flight_until_the_server_closes_its_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let (close, closed) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 16];
            s.read_exact(&mut request).await.unwrap();
            closed.await.unwrap();
            request
        });
        let target = target(port, 4242);
        let in_flight = target.in_flight.clone();
        assert!(!in_flight.busy());
        let forward = tokio::spawn(forward(target, Duration::from_secs(10)));
        while !in_flight.busy() {
            tokio::task::yield_now().await;
        }
        let settled = in_flight.settled();
        tokio::pin!(settled);
        let waited = tokio::time::timeout(Duration::from_millis(100), settled.as_mut()).await;
        assert!(
            waited.is_err(),
            "settled while the server still held the cancel"
        );
        close.send(()).unwrap();
        assert_eq!(server.await.unwrap(), CANCEL_4242);
        tokio::time::timeout(Duration::from_secs(10), settled)
            .await
            .expect("settled once the server closed");
        assert!(!in_flight.busy());
        forward.await.unwrap().unwrap();
    }

    /// A cancel that comes while the session asks its question is held (a second one
    /// with it) and handed to the session at the answer, once; one that comes before the
    /// question or after its answer goes at once.
    #[test]
    fn a_cancel_waits_for_the_question() {
        let in_flight = Arc::new(InFlight::default());
        assert!(
            !in_flight.defer_while_asking(),
            "no question: forwarded now"
        );
        assert!(in_flight.answered().is_none());
        in_flight.asking();
        assert!(in_flight.defer_while_asking());
        assert!(
            in_flight.defer_while_asking(),
            "a second cancel joins the first"
        );
        let counted = in_flight.answered();
        assert!(counted.is_some(), "the session forwards it");
        assert!(in_flight.busy(), "counted in flight from the answer");
        drop(counted);
        assert!(in_flight.answered().is_none(), "once");
        assert!(!in_flight.busy());
        assert!(
            !in_flight.defer_while_asking(),
            "after the answer: forwarded now"
        );
        in_flight.asking();
        assert!(in_flight.answered().is_none(), "no cancel came");
        assert!(!in_flight.defer_while_asking());
    }

    /// A task waiting in [`InFlight::forwarded`], a moment after it started.
    async fn wait_forwarded(in_flight: &Arc<InFlight>) -> tokio::task::JoinHandle<()> {
        let waiting = tokio::spawn({
            let in_flight = in_flight.clone();
            async move { in_flight.forwarded().await }
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        waiting
    }

    /// The client's connection for a held cancel waits until the session has forwarded it
    /// and the server has taken it, or until the session ends.
    #[tokio::test]
    async fn a_held_cancels_connection_waits_for_its_forward() {
        let in_flight = Arc::new(InFlight::default());
        in_flight.asking();
        assert!(in_flight.defer_while_asking());
        let waiting = wait_forwarded(&in_flight).await;
        assert!(!waiting.is_finished(), "the question is not answered yet");
        let counted = in_flight.answered().expect("the held cancel");
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "answered, the cancel not taken yet");
        drop(counted);
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("done once the server took the cancel")
            .unwrap();

        in_flight.asking();
        assert!(in_flight.defer_while_asking());
        let waiting = wait_forwarded(&in_flight).await;
        assert!(!waiting.is_finished());
        in_flight.abandon();
        tokio::time::timeout(Duration::from_secs(10), waiting)
            .await
            .expect("let go when the session ends")
            .unwrap();
    }

    fn target(port: u16, pid: i32) -> CancelTarget {
        CancelTarget {
            upstream: UpstreamAddr::Tcp(([127, 0, 0, 1], port).into()),
            pid,
            key: 7,
            tls: None,
            in_flight: Arc::default(),
        }
    }

    /// A backend maps to the pid its current client was given; a kept connection's next
    /// session takes the mapping over, and the one before it ending does not remove it.
    #[test]
    fn a_backend_maps_to_its_current_clients_pid() {
        let registry = CancelRegistry::default();
        let upstream = target(5432, 100).upstream;
        assert_eq!(registry.client_pid(&upstream, 100), None);
        let first = registry.register(target(5432, 100));
        assert_eq!(registry.client_pid(&upstream, 100), Some(first.0));
        let other = registry.register(target(5433, 100));
        assert_eq!(registry.client_pid(&upstream, 100), Some(first.0));
        assert_eq!(
            registry.client_pid(&target(5433, 0).upstream, 100),
            Some(other.0)
        );
        let second = registry.register(target(5432, 100));
        assert_eq!(registry.client_pid(&upstream, 100), Some(second.0));
        registry.unregister(first.0, first.1);
        assert_eq!(registry.client_pid(&upstream, 100), Some(second.0));
        assert!(registry.lookup(second.0, second.1).is_some());
        registry.unregister(second.0, second.1);
        assert_eq!(registry.client_pid(&upstream, 100), None);
        assert!(registry.lookup(first.0, first.1).is_none());
    }

    /// The forward ends only when the server has closed the connection (it has then
    /// signalled the backend): the client's own cancel connection is closed after it.
    #[tokio::test]
    async fn a_forward_waits_for_the_server_to_close() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let hold = Duration::from_millis(300);
        let server = tokio::spawn(async move {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut request = [0u8; 16];
            s.read_exact(&mut request).await.unwrap();
            tokio::time::sleep(hold).await;
            request
        });
        let started = std::time::Instant::now();
        forward(target(port, 4242), Duration::from_secs(5))
            .await
            .unwrap();
        assert!(started.elapsed() >= hold, "{:?}", started.elapsed());
        assert_eq!(server.await.unwrap(), CANCEL_4242);
    }

    /// A server that takes the connection and never answers the SSLRequest: forwarding
    /// gives up after the limit instead of waiting for ever.
    #[tokio::test]
    async fn forwarding_to_a_silent_server_gives_up_after_the_limit() {
        let (server_tls, client_tls) = crate::tls::tests::configs();
        let (port, server) = fake_server(SILENT, server_tls).await;
        let started = std::time::Instant::now();
        let limit = Duration::from_millis(300);
        // The test's own bound, so that a forward that never gives up fails instead of
        // hanging the suite.
        let forwarding = forward(
            tls_target(port, UpstreamSslMode::Require, client_tls),
            limit,
        );
        let err = tokio::time::timeout(Duration::from_secs(5), forwarding)
            .await
            .expect("forward gives up by itself")
            .unwrap_err();
        let took = started.elapsed();
        assert_eq!(err, "timed out after 300ms");
        assert!(took >= limit && took < Duration::from_secs(5), "{took:?}");
        // It asked for TLS, waited, gave up, and sent nothing else.
        assert_eq!(server.await.unwrap(), Received::Unanswered(Vec::new()));
    }
}
