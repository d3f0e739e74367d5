//! TLS with rustls: terminated for clients (`[client_tls]`), and to the upstream server
//! (`upstream.sslmode`).
//!
//! A client asks with an SSLRequest; pgfence answers `S` and the TLS handshake follows on
//! the same socket, before the startup packet (PostgreSQL's protocol). pgfence asks the
//! server the same way. The session then
//! reads and writes plaintext through [`TlsStream`], an adapter written for the forwarding
//! loop: its two halves are polled at once by one task, a write can be tried without a
//! waker (as on a plain socket), and records rustls could not send yet are reported
//! ([`TlsStream`]'s `pending`) so that the loop flushes them.

use std::io::{self, BufRead, Read, Write};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{ready, Context, Poll};

use pgfence_config::{ClientSslMode, ClientTls, Upstream, UpstreamSslMode};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::ReadBuf;
use tokio::net::TcpStream;

/// The ALPN protocol name PostgreSQL 17 servers and clients use.
const ALPN_POSTGRESQL: &[u8] = b"postgresql";

/// The rustls configuration for clients' TLS, or `None` when `sslmode` is `disable`.
/// Reads the certificate and key files; errors name the file and what is wrong with it.
pub fn acceptor(tls: &ClientTls) -> Result<Option<Arc<rustls::ServerConfig>>, String> {
    if tls.sslmode == ClientSslMode::Disable {
        return Ok(None);
    }
    let (Some(cert_file), Some(key_file)) = (&tls.cert_file, &tls.key_file) else {
        return Err("client_tls needs cert_file and key_file".into());
    };
    let (certs, key) = read_identity(
        cert_file,
        key_file,
        "client_tls.cert_file",
        "client_tls.key_file",
    )?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("client_tls: {e}"))?;
    let builder = match &tls.ca_file {
        // Clients are asked for a certificate: the verify modes refuse a client without
        // one, the others let it in (PgBouncer's `client_tls_ca_file`). One it sends must
        // chain to a CA of the file, whatever the mode.
        Some(ca_file) => {
            let roots = read_roots(ca_file, "client_tls.ca_file")?;
            let verifier =
                rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider);
            let verifier = if tls.sslmode.requires_certificate() {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            let verifier = verifier
                .build()
                .map_err(|e| format!("client_tls.ca_file {}: {e}", ca_file.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "client_tls: the key in {} does not go with the certificate in {}: {e}",
            key_file.display(),
            cert_file.display()
        )
    })?;
    // Clients that name a protocol (libpq 17) name this one; clients that name none are
    // served too.
    config.alpn_protocols = vec![ALPN_POSTGRESQL.to_vec()];
    // No session resumption, as PostgreSQL (which turns tickets and its session cache
    // off): libpq does not resume sessions, so tickets would be bytes and work for nothing.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Some(Arc::new(config)))
}

/// The rustls configuration for the upstream connection, or `None` when `sslmode` is
/// `disable`. `prefer` and `require` accept any certificate (libpq's meaning); `verify-ca`
/// checks the chain against `sslrootcert`, `verify-full` the host name too.
pub fn connector(upstream: &Upstream) -> Result<Option<Arc<rustls::ClientConfig>>, String> {
    let mode = upstream.sslmode;
    if mode == UpstreamSslMode::Disable {
        return Ok(None);
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("upstream TLS: {e}"))?;
    let chain = match (&upstream.sslrootcert, mode) {
        (Some(path), UpstreamSslMode::VerifyCa | UpstreamSslMode::VerifyFull) => {
            let roots = read_roots(path, "upstream.sslrootcert")?;
            let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
                roots,
                provider.clone(),
            )
            .build()
            .map_err(|e| format!("upstream.sslrootcert {}: {e}", path.display()))?;
            Some(webpki)
        }
        (None, UpstreamSslMode::VerifyCa | UpstreamSslMode::VerifyFull) => {
            return Err(format!(
                "upstream.sslmode = {mode} needs upstream.sslrootcert"
            ))
        }
        _ => None,
    };
    let verifier = ServerVerifier {
        chain,
        any_name: mode != UpstreamSslMode::VerifyFull,
        provider,
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(verifier));
    let config = match (&upstream.sslcert, &upstream.sslkey) {
        (Some(cert_file), Some(key_file)) => {
            let (certs, key) =
                read_identity(cert_file, key_file, "upstream.sslcert", "upstream.sslkey")?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                format!(
                    "upstream: the key in {} does not go with the certificate in {}: {e}",
                    key_file.display(),
                    cert_file.display()
                )
            })?
        }
        _ => builder.with_no_client_auth(),
    };
    Ok(Some(Arc::new(config)))
}

/// How pgfence checks the server's certificate, by `upstream.sslmode` as libpq does:
/// `verify-full` checks the chain against `sslrootcert` and the name against `host`,
/// `verify-ca` the chain only, `prefer` and `require` nothing (encryption without
/// authentication of the server). The handshake's signatures are checked in every mode.
#[derive(Debug)]
struct ServerVerifier {
    /// The CAs' verifier; `None` for `prefer` and `require`.
    chain: Option<Arc<rustls::client::WebPkiServerVerifier>>,
    /// Accept a certificate issued for another name (all modes but `verify-full`).
    any_name: bool,
    provider: Arc<rustls::crypto::CryptoProvider>,
}

impl rustls::client::danger::ServerCertVerifier for ServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &rustls::pki_types::ServerName<'_>,
        ocsp: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        let Some(chain) = &self.chain else {
            return Ok(rustls::client::danger::ServerCertVerified::assertion());
        };
        match chain.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(
                NotValidForName | NotValidForNameContext { .. },
            )) if self.any_name => Ok(rustls::client::danger::ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// Every certificate in the PEM file `path`; an error names the setting, the file and
/// `what` could not be read.
fn read_certificates(
    path: &std::path::Path,
    setting: &str,
    what: &str,
) -> Result<Vec<CertificateDer<'static>>, String> {
    CertificateDer::pem_file_iter(path)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{setting} {}: cannot read {what}: {e}", path.display()))
}

/// The CA certificates of a PEM file; errors name the setting and the file.
fn read_roots(path: &std::path::Path, setting: &str) -> Result<Arc<rustls::RootCertStore>, String> {
    let certs = read_certificates(path, setting, "PEM certificates")?;
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(certs);
    if added == 0 {
        return Err(format!(
            "{setting} {}: no usable CA certificate in the file",
            path.display()
        ));
    }
    Ok(Arc::new(roots))
}

/// A certificate chain and its key from PEM files; errors name the setting and the file.
fn read_identity(
    cert_file: &std::path::Path,
    key_file: &std::path::Path,
    cert_setting: &str,
    key_setting: &str,
) -> Result<(Vec<CertificateDer<'static>>, PrivateKeyDer<'static>), String> {
    let certs = read_certificates(cert_file, cert_setting, "a PEM certificate")?;
    if certs.is_empty() {
        return Err(format!(
            "{cert_setting} {}: no certificate in the file (expected -----BEGIN CERTIFICATE-----)",
            cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(key_file).map_err(|e| {
        format!(
            "{key_setting} {}: cannot read a PEM private key: {e}",
            key_file.display()
        )
    })?;
    Ok((certs, key))
}

/// A TLS connection over TCP: the socket and rustls' state. The forwarding loop polls the
/// read and the write half at once in one task, so the state sits behind a lock that is
/// never contended.
pub struct TlsStream {
    pub(crate) io: TcpStream,
    pub(crate) conn: Mutex<rustls::Connection>,
}

impl std::fmt::Debug for TlsStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsStream").field("io", &self.io).finish()
    }
}

/// The socket as `std::io`'s Read and Write: what it takes or has now, `WouldBlock`
/// otherwise (which also clears tokio's readiness, so that a poll for it then waits).
struct Sync<'a>(&'a TcpStream);

impl Read for Sync<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.try_read(buf)
    }
}

impl Write for Sync<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.try_write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.0.try_write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn lock(conn: &Mutex<rustls::Connection>) -> MutexGuard<'_, rustls::Connection> {
    conn.lock().unwrap_or_else(PoisonError::into_inner)
}

fn tls_error(e: rustls::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, e)
}

impl TlsStream {
    /// Runs the server side of a handshake on `io` (the client has been answered `S`, or
    /// opened with TLS: `read` is what was already read of it).
    pub async fn accept(
        io: TcpStream,
        config: Arc<rustls::ServerConfig>,
        mut read: &[u8],
    ) -> io::Result<Self> {
        let mut conn: rustls::Connection = rustls::ServerConnection::new(config)
            .map_err(tls_error)?
            .into();
        while !read.is_empty() {
            conn.read_tls(&mut read)?;
            conn.process_new_packets().map_err(tls_error)?;
        }
        let tls = TlsStream {
            io,
            conn: Mutex::new(conn),
        };
        std::future::poll_fn(|cx| handshake(&tls.io, &tls.conn, cx)).await?;
        Ok(tls)
    }

    /// Runs the client side of a handshake with the server at `io` (which answered `S`),
    /// for the name `host`.
    pub async fn connect(
        io: TcpStream,
        config: Arc<rustls::ClientConfig>,
        host: &str,
    ) -> io::Result<Self> {
        let name = rustls::pki_types::ServerName::try_from(host.to_string()).map_err(|e| {
            io::Error::new(io::ErrorKind::InvalidInput, format!("host {host:?}: {e}"))
        })?;
        let conn = rustls::ClientConnection::new(config, name).map_err(tls_error)?;
        let tls = TlsStream {
            io,
            conn: Mutex::new(conn.into()),
        };
        std::future::poll_fn(|cx| handshake(&tls.io, &tls.conn, cx)).await?;
        Ok(tls)
    }

    /// The peers agreed on the ALPN protocol `postgresql`.
    pub fn alpn_is_postgresql(&self) -> bool {
        lock(&self.conn).alpn_protocol() == Some(ALPN_POSTGRESQL)
    }

    /// The common name (CN) of the certificate the peer presented: `None` without a
    /// certificate, `Some("")` for one without a common name. PostgreSQL's
    /// `clientcert=verify-full` compares the first one with the user name, as here.
    pub fn peer_common_name(&self) -> Option<String> {
        let conn = lock(&self.conn);
        let cert = conn.peer_certificates()?.first()?;
        let name = x509_parser::parse_x509_certificate(cert)
            .ok()
            .and_then(|(_, cert)| {
                let cn = cert.subject().iter_common_name().next()?;
                cn.as_str().ok().map(str::to_owned)
            });
        Some(name.unwrap_or_default())
    }

    /// The protocol version and cipher suite, as `SHOW CLIENTS` shows them.
    pub fn describe(&self) -> String {
        let conn = lock(&self.conn);
        let version = conn.protocol_version().and_then(|v| v.as_str());
        let suite = conn
            .negotiated_cipher_suite()
            .and_then(|s| s.suite().as_str());
        format!("{}/{}", version.unwrap_or("?"), suite.unwrap_or("?"))
    }
}

/// Drives a handshake to its end.
fn handshake(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    let mut conn = lock(conn);
    loop {
        ready!(send(io, &mut conn, cx))?;
        if !conn.is_handshaking() {
            return Poll::Ready(Ok(()));
        }
        if ready!(receive(io, &mut conn, cx))? == 0 {
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the peer closed the connection during the TLS handshake",
            )));
        }
    }
}

/// Reads what the socket has into rustls and processes it; pending (with the waker
/// registered) while the socket has nothing. `Ok(0)` is the end of the socket's stream.
/// A record rustls refuses ends the connection, after the alert that says why if the
/// socket takes it.
fn receive(
    io: &TcpStream,
    conn: &mut rustls::Connection,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    loop {
        match conn.read_tls(&mut Sync(io)) {
            Ok(n) => {
                if let Err(e) = conn.process_new_packets() {
                    let _ = conn.write_tls(&mut Sync(io));
                    return Poll::Ready(Err(tls_error(e)));
                }
                return Poll::Ready(Ok(n));
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => ready!(io.poll_read_ready(cx))?,
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
}

/// Sends every record rustls holds; pending (with the waker registered) while the socket
/// is full.
fn send(
    io: &TcpStream,
    conn: &mut rustls::Connection,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    while conn.wants_write() {
        match conn.write_tls(&mut Sync(io)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => ready!(io.poll_write_ready(cx))?,
            Err(e) => return Poll::Ready(Err(e)),
        }
    }
    Poll::Ready(Ok(()))
}

/// Sends what the socket takes now; the rest stays with rustls (see [`pending`]).
fn try_send(io: &TcpStream, conn: &mut rustls::Connection) -> io::Result<()> {
    while conn.wants_write() {
        match conn.write_tls(&mut Sync(io)) {
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Reads plaintext into `buf`. A peer that closes its socket without TLS's close_notify
/// is read as the end of the stream, as on a plain socket (PostgreSQL clients commonly
/// do; the session notices a message cut short).
#[inline(never)]
pub(crate) fn poll_read(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    cx: &mut Context<'_>,
    buf: &mut ReadBuf<'_>,
) -> Poll<io::Result<()>> {
    let mut conn = lock(conn);
    loop {
        let mut reader = conn.reader();
        let mut copied = 0;
        loop {
            match reader.fill_buf() {
                // The peer's close_notify, after everything it sent: the end of the stream.
                Ok([]) => return Poll::Ready(Ok(())),
                Ok(chunk) => {
                    let n = chunk.len().min(buf.remaining());
                    buf.put_slice(&chunk[..n]);
                    reader.consume(n);
                    copied += n;
                    if buf.remaining() == 0 {
                        break;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Poll::Ready(Ok(())),
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        if copied > 0 || buf.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        // At the end of the socket's stream, the next turn reads the end (with or without
        // close_notify).
        ready!(receive(io, &mut conn, cx))?;
    }
}

/// Writes plaintext: records left from before go first (so that a slow reader slows the
/// writer), then `buf` is taken whole or in part and sent as far as the socket takes it.
#[inline(never)]
pub(crate) fn poll_write(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    cx: &mut Context<'_>,
    buf: &[u8],
) -> Poll<io::Result<usize>> {
    let mut conn = lock(conn);
    ready!(send(io, &mut conn, cx))?;
    if buf.is_empty() {
        return Poll::Ready(Ok(0));
    }
    let n = conn.writer().write(buf)?;
    try_send(io, &mut conn)?;
    Poll::Ready(Ok(n))
}

/// Like [`poll_write`] without waiting: `WouldBlock` while earlier records are still queued.
#[inline(never)]
pub(crate) fn try_write(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    buf: &[u8],
) -> io::Result<usize> {
    let mut conn = lock(conn);
    try_send(io, &mut conn)?;
    if conn.wants_write() {
        return Err(io::ErrorKind::WouldBlock.into());
    }
    let n = conn.writer().write(buf)?;
    try_send(io, &mut conn)?;
    Ok(n)
}

#[inline(never)]
pub(crate) fn poll_flush(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    send(io, &mut lock(conn), cx)
}

/// Sends close_notify (rustls queues it once) and flushes; the caller then shuts the
/// socket down.
#[inline(never)]
pub(crate) fn poll_close(
    io: &TcpStream,
    conn: &Mutex<rustls::Connection>,
    cx: &mut Context<'_>,
) -> Poll<io::Result<()>> {
    let mut conn = lock(conn);
    conn.send_close_notify();
    send(io, &mut conn, cx)
}

/// Records rustls holds that the socket did not take yet: the forwarding loop flushes them.
#[inline(never)]
pub(crate) fn pending(conn: &Mutex<rustls::Connection>) -> bool {
    lock(conn).wants_write()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::net::Stream;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A self-signed certificate for `localhost`, and configurations for both ends.
    pub(crate) fn configs() -> (Arc<rustls::ServerConfig>, Arc<rustls::ClientConfig>) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec!["localhost".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (cert_file, key_file) = (dir.path().join("c.pem"), dir.path().join("k.pem"));
        std::fs::write(&cert_file, cert.pem()).unwrap();
        std::fs::write(&key_file, key.serialize_pem()).unwrap();
        let server = acceptor(&ClientTls {
            sslmode: ClientSslMode::Require,
            cert_file: Some(cert_file),
            key_file: Some(key_file),
            ca_file: None,
        })
        .unwrap()
        .unwrap();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert.der().clone()).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        (server, Arc::new(client))
    }

    /// A blocking rustls client on its own thread running `client`, against pgfence's
    /// side of the handshake; returns that side.
    async fn pair(
        client: impl FnOnce(rustls::StreamOwned<rustls::ClientConnection, std::net::TcpStream>)
            + Send
            + 'static,
    ) -> (Stream, std::thread::JoinHandle<()>) {
        let (server_config, client_config) = configs();
        // Small fixed socket buffers on both ends (which turns the kernel's autotuning
        // off): with tcp_rmem up to 32 MiB, as on this machine, a client's receive buffer
        // could otherwise take everything a test sends, and a socket that must fill would
        // not. pgfence's side inherits the listener's send buffer size.
        const BUFFER: u32 = 64 << 10;
        let listening = tokio::net::TcpSocket::new_v4().unwrap();
        listening.set_send_buffer_size(BUFFER).unwrap();
        listening.bind("127.0.0.1:0".parse().unwrap()).unwrap();
        let listener = listening.listen(16).unwrap();
        let addr = listener.local_addr().unwrap();
        let connecting = tokio::net::TcpSocket::new_v4().unwrap();
        connecting.set_recv_buffer_size(BUFFER).unwrap();
        let (connected, accepted) = tokio::join!(connecting.connect(addr), listener.accept());
        let tcp = connected.unwrap().into_std().unwrap();
        tcp.set_nonblocking(false).unwrap();
        let thread = std::thread::spawn(move || {
            let mut tcp = tcp;
            let mut s = [0u8; 1];
            std::io::Read::read_exact(&mut tcp, &mut s).unwrap();
            assert_eq!(&s, b"S");
            let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
            let conn = rustls::ClientConnection::new(client_config, name).unwrap();
            client(rustls::StreamOwned::new(conn, tcp));
        });
        let (tcp, _) = accepted.unwrap();
        let stream = Stream::Tcp(tcp)
            .accept_tls(server_config, None)
            .await
            .unwrap();
        (stream, thread)
    }

    async fn read_all(stream: &mut Stream) -> Vec<u8> {
        let mut got = Vec::new();
        stream.read_to_end(&mut got).await.unwrap();
        got
    }

    /// Runs `test` on a runtime of its own thread and fails if it has not finished within
    /// 10 s: a read that spins without returning cannot be timed out from its own runtime.
    fn within_10s<F: std::future::Future<Output = ()> + 'static>(
        test: impl FnOnce() -> F + Send + 'static,
    ) {
        let (done, finished) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap()
                .block_on(test());
            let _ = done.send(());
        });
        finished
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("the test finished (a panic or a hang otherwise)");
    }

    #[test]
    fn a_close_notify_and_a_bare_close_both_end_the_stream() {
        within_10s(|| async {
            let (mut stream, thread) = pair(|mut c| {
                c.write_all(b"hello").unwrap();
                c.conn.send_close_notify();
                c.flush().unwrap();
            })
            .await;
            assert_eq!(read_all(&mut stream).await, b"hello");
            thread.join().unwrap();

            // Without close_notify, as many PostgreSQL clients close.
            let (mut stream, thread) = pair(|mut c| {
                c.write_all(b"bye").unwrap();
                c.flush().unwrap();
            })
            .await;
            assert_eq!(read_all(&mut stream).await, b"bye");
            thread.join().unwrap();
        });
    }

    #[tokio::test]
    async fn records_the_socket_did_not_take_are_flushed() {
        const TOTAL: usize = 8 << 20;
        let (mut stream, thread) = pair(|mut c| {
            // Read slowly at first, so that pgfence's writes fill the socket.
            std::thread::sleep(std::time::Duration::from_millis(200));
            let mut got = Vec::new();
            std::io::Read::read_to_end(&mut c, &mut got).unwrap();
            assert_eq!(got.len(), TOTAL);
            assert!(got.iter().enumerate().all(|(i, b)| *b == (i % 251) as u8));
        })
        .await;
        let data: Vec<u8> = (0..TOTAL).map(|i| (i % 251) as u8).collect();
        let (_, mut w) = stream.split();
        let mut sent = 0;
        let mut queued_at_some_point = false;
        while sent < TOTAL {
            match w.try_write(&data[sent..(sent + 100_000).min(TOTAL)]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    queued_at_some_point |= w.pending();
                    // What the session's loop does: a write of nothing flushes.
                    assert_eq!(w.write(&[]).await.unwrap(), 0);
                }
                Err(e) => panic!("{e}"),
            }
        }
        w.flush().await.unwrap();
        assert!(!w.pending());
        assert!(
            queued_at_some_point,
            "the socket never filled: the test proves nothing"
        );
        stream.shutdown().await.unwrap();
        thread.join().unwrap();
    }
}
