//! The sockets of a session: TCP, or Unix-domain sockets, for the upstream when its host is
//! a directory (`/var/run/postgresql`, as libpq and PgBouncer read `host`) and for clients
//! of `unix_socket_dir`.
//!
//! A Unix-domain socket skips the loopback TCP stack: at 8 clients on a 2-core machine,
//! pgfence had 6 to 20% more TPS through it than over TCP to the same server
//! (docs/benchmarks.md, "Upstream over a Unix-domain socket").

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use pgfence_config::{Limits, Upstream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{tcp, unix, TcpStream, UnixStream};

use crate::tls::TlsStream;

/// Who a client is, in logs, `SHOW CLIENTS` and `pgfence.history`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientAddr {
    Tcp(SocketAddr),
    /// A client of the Unix-domain socket, shown as PostgreSQL shows one: `[local]`.
    Local,
}

impl std::fmt::Display for ClientAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ClientAddr::Tcp(addr) => addr.fmt(f),
            ClientAddr::Local => f.write_str("[local]"),
        }
    }
}

/// Where an upstream connection goes (the target of its clients' cancel requests).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum UpstreamAddr {
    Tcp(SocketAddr),
    Unix(Arc<Path>),
}

/// Binds the clients' Unix-domain socket at `path`, open to every local user as
/// PostgreSQL's default `unix_socket_permissions` is (the server still authenticates). A
/// socket file left by a pgfence that died is replaced; one that a live process accepts on
/// is not.
pub fn bind_client_socket(path: &Path) -> Result<tokio::net::UnixListener, String> {
    use std::os::unix::fs::PermissionsExt;
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Err(format!(
                "cannot listen on {}: another process accepts connections there",
                path.display()
            ));
        }
        std::fs::remove_file(path)
            .map_err(|e| format!("cannot remove the stale socket {}: {e}", path.display()))?;
    }
    let listener = tokio::net::UnixListener::bind(path)
        .map_err(|e| format!("cannot listen on {}: {e}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777))
        .map_err(|e| format!("cannot make {} accessible: {e}", path.display()))?;
    Ok(listener)
}

/// A connected socket (upstream, or a client's).
#[derive(Debug)]
pub enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    /// A TCP connection after a TLS handshake (a client's, or the server's).
    Tls(Box<TlsStream>),
}

/// The same socket, out of any runtime (kept in the pool between clients).
#[derive(Debug)]
pub enum StdStream {
    Tcp(std::net::TcpStream),
    Unix(std::os::unix::net::UnixStream),
    /// A TLS connection to the server, with its state.
    Tls(std::net::TcpStream, Box<TlsState>),
}

/// Turns TCP keepalive on for `s` as `limits` say (`limits.tcp_keepalive*`).
pub fn keepalive(s: &TcpStream, limits: &Limits) -> io::Result<()> {
    if !limits.tcp_keepalive {
        return Ok(());
    }
    let mut params = socket2::TcpKeepalive::new();
    if let Some(idle) = limits.tcp_keepalives_idle {
        params = params.with_time(idle);
    }
    if let Some(interval) = limits.tcp_keepalives_interval {
        params = params.with_interval(interval);
    }
    if let Some(count) = limits.tcp_keepalives_count {
        params = params.with_retries(count);
    }
    socket2::SockRef::from(s).set_tcp_keepalive(&params)
}

impl Stream {
    /// Connects to `upstream` (TCP with `TCP_NODELAY`, or its Unix-domain socket), and
    /// over TCP asks for TLS when `tls` is given (`upstream.sslmode` says whether a server
    /// that declines may be used without).
    pub async fn connect(
        upstream: &Upstream,
        tls: Option<Arc<rustls::ClientConfig>>,
        limits: &Limits,
    ) -> io::Result<Stream> {
        if let Some(path) = upstream.socket_path() {
            return Ok(Stream::Unix(UnixStream::connect(path).await?));
        }
        let s = TcpStream::connect((upstream.host.as_str(), upstream.port)).await?;
        let _ = s.set_nodelay(true);
        if let Err(e) = keepalive(&s, limits) {
            // As PostgreSQL does when a keepalive setting is refused: the connection is
            // still good.
            tracing::warn!(error = %e, "could not set TCP keepalive on the server connection");
        }
        match tls {
            None => Ok(Stream::Tcp(s)),
            Some(tls) => Stream::start_tls(s, tls, &upstream.host, upstream.sslmode).await,
        }
    }

    /// Asks the server at the other end of `s` for TLS (SSLRequest) and runs the handshake,
    /// checking the certificate against `host` as `tls` says. A server that declines is
    /// used over plain TCP only when `sslmode` is `prefer`.
    pub async fn start_tls(
        mut s: TcpStream,
        tls: Arc<rustls::ClientConfig>,
        host: &str,
        sslmode: pgfence_config::UpstreamSslMode,
    ) -> io::Result<Stream> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(&crate::protocol::startup::SSL_REQUEST_PACKET)
            .await?;
        match s.read_u8().await? {
            b'S' => {
                let tls = TlsStream::connect(s, tls, host).await?;
                Ok(Stream::Tls(Box::new(tls)))
            }
            b'N' if sslmode == pgfence_config::UpstreamSslMode::Prefer => Ok(Stream::Tcp(s)),
            b'N' => Err(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                format!("the server does not support TLS, and upstream.sslmode = {sslmode}"),
            )),
            other => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the server answered the SSLRequest with {:?}",
                    other as char
                ),
            )),
        }
    }

    /// Answers a client's SSLRequest with `S` and runs the TLS handshake; or, given the
    /// `hello` a client opened with (PostgreSQL 17's direct negotiation), runs it from
    /// there, and then requires the ALPN protocol `postgresql` as PostgreSQL does. Only a
    /// plain TCP connection can start TLS.
    pub async fn accept_tls(
        self,
        config: Arc<rustls::ServerConfig>,
        hello: Option<bytes::Bytes>,
    ) -> io::Result<Stream> {
        let Stream::Tcp(mut io) = self else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "TLS is only offered on TCP connections",
            ));
        };
        if hello.is_none() {
            tokio::io::AsyncWriteExt::write_all(&mut io, b"S").await?;
        }
        let direct = hello.is_some();
        let tls = TlsStream::accept(io, config, hello.as_deref().unwrap_or_default()).await?;
        if direct && !tls.alpn_is_postgresql() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "direct TLS without the ALPN protocol \"postgresql\"",
            ));
        }
        Ok(Stream::Tls(Box::new(tls)))
    }

    /// The TLS protocol and cipher suite, for a TLS connection.
    pub fn tls(&self) -> Option<String> {
        match self {
            Stream::Tls(t) => Some(t.describe()),
            _ => None,
        }
    }

    /// The common name of the peer's TLS certificate (see [`TlsStream::peer_common_name`]),
    /// `None` without TLS or without a certificate.
    pub fn tls_peer_common_name(&self) -> Option<String> {
        match self {
            Stream::Tls(t) => t.peer_common_name(),
            _ => None,
        }
    }

    /// Where this socket is connected to.
    pub fn peer(&self) -> io::Result<UpstreamAddr> {
        match self {
            Stream::Tcp(s) => s.peer_addr().map(UpstreamAddr::Tcp),
            Stream::Tls(s) => s.io.peer_addr().map(UpstreamAddr::Tcp),
            Stream::Unix(s) => {
                let addr = s.peer_addr()?;
                let path = addr.as_pathname().ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "unnamed Unix-domain peer")
                })?;
                Ok(UpstreamAddr::Unix(path.into()))
            }
        }
    }

    /// Splits into halves that can be polled at the same time, without a lock.
    pub fn split(&mut self) -> (ReadHalf<'_>, WriteHalf<'_>) {
        match self {
            Stream::Tcp(s) => {
                let (r, w) = s.split();
                (ReadHalf::Tcp(r), WriteHalf::Tcp(w))
            }
            Stream::Unix(s) => {
                let (r, w) = s.split();
                (ReadHalf::Unix(r), WriteHalf::Unix(w))
            }
            Stream::Tls(s) => {
                let TlsStream { io, conn } = &mut **s;
                let (r, w) = io.split();
                (ReadHalf::Tls(r, conn), WriteHalf::Tls(w, conn))
            }
        }
    }

    /// Leaves the runtime (the socket stays non-blocking; a TLS connection keeps its state).
    pub fn into_std(self) -> io::Result<StdStream> {
        match self {
            Stream::Tcp(s) => s.into_std().map(StdStream::Tcp),
            Stream::Unix(s) => s.into_std().map(StdStream::Unix),
            Stream::Tls(t) => {
                let TlsStream { io, conn } = *t;
                Ok(StdStream::Tls(io.into_std()?, Box::new(conn)))
            }
        }
    }

    /// Registers a socket from [`Stream::into_std`] with the current runtime.
    pub fn from_std(stream: StdStream) -> io::Result<Stream> {
        match stream {
            StdStream::Tcp(s) => TcpStream::from_std(s).map(Stream::Tcp),
            StdStream::Unix(s) => UnixStream::from_std(s).map(Stream::Unix),
            StdStream::Tls(s, conn) => Ok(Stream::Tls(Box::new(TlsStream {
                io: TcpStream::from_std(s)?,
                conn: *conn,
            }))),
        }
    }
}

impl StdStream {
    /// The server has sent nothing and has not closed. A byte it did send is consumed: a
    /// connection that is not quiet is closed anyway. The socket must be non-blocking.
    pub fn quiet(&self) -> bool {
        use std::io::Read;
        let mut byte = [0u8; 1];
        let read = match self {
            StdStream::Tcp(s) | StdStream::Tls(s, _) => (&*s).read(&mut byte),
            StdStream::Unix(s) => (&*s).read(&mut byte),
        };
        matches!(read, Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }

    /// Writes what the socket takes now (for TLS, then close_notify).
    pub fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        use std::io::Write;
        match self {
            StdStream::Tcp(s) => s.write(buf),
            StdStream::Unix(s) => s.write(buf),
            StdStream::Tls(s, conn) => {
                let conn = conn
                    .get_mut()
                    .unwrap_or_else(std::sync::PoisonError::into_inner);
                let n = conn.writer().write(buf)?;
                conn.send_close_notify();
                while conn.wants_write() {
                    conn.write_tls(s)?;
                }
                Ok(n)
            }
        }
    }
}

type TlsState = std::sync::Mutex<rustls::Connection>;

/// The read half of a [`Stream`].
pub enum ReadHalf<'a> {
    Tcp(tcp::ReadHalf<'a>),
    Unix(unix::ReadHalf<'a>),
    Tls(tcp::ReadHalf<'a>, &'a TlsState),
}

/// The write half of a [`Stream`].
pub enum WriteHalf<'a> {
    Tcp(tcp::WriteHalf<'a>),
    Unix(unix::WriteHalf<'a>),
    Tls(tcp::WriteHalf<'a>, &'a TlsState),
}

impl WriteHalf<'_> {
    /// Writes what the socket takes now, without waiting (`WouldBlock` if nothing).
    /// Inlined into the forwarding loop: with the TLS arm it was not any more, which cost a
    /// plain TPC-B transaction about 80 instructions (callgrind).
    #[inline(always)]
    pub fn try_write(&self, buf: &[u8]) -> io::Result<usize> {
        match self {
            WriteHalf::Tcp(w) => w.try_write(buf),
            WriteHalf::Unix(w) => w.try_write(buf),
            WriteHalf::Tls(w, conn) => crate::tls::try_write(w.tcp(), conn, buf),
        }
    }

    /// TLS records written but not yet taken by the socket: a write of nothing flushes
    /// them. Always false for a plain socket, whose writes go straight to the kernel.
    pub fn pending(&self) -> bool {
        match self {
            WriteHalf::Tls(_, conn) => crate::tls::pending(conn),
            _ => false,
        }
    }
}

/// The TCP socket under a TLS connection or one of its halves.
trait Tcp {
    fn tcp(&self) -> &TcpStream;
}

impl Tcp for TcpStream {
    fn tcp(&self) -> &TcpStream {
        self
    }
}

impl Tcp for tcp::ReadHalf<'_> {
    fn tcp(&self) -> &TcpStream {
        self.as_ref()
    }
}

impl Tcp for tcp::WriteHalf<'_> {
    fn tcp(&self) -> &TcpStream {
        self.as_ref()
    }
}

// Each takes the type and how its TLS variant gives the socket (mutably) and rustls' state.
macro_rules! delegate_read {
    ($ty:ty, $tls:pat => $parts:expr) => {
        impl AsyncRead for $ty {
            fn poll_read(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &mut ReadBuf<'_>,
            ) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_read(cx, buf),
                    Self::Unix(s) => Pin::new(s).poll_read(cx, buf),
                    $tls => {
                        let (io, conn) = $parts;
                        crate::tls::poll_read(io.tcp(), conn, cx, buf)
                    }
                }
            }
        }
    };
}

macro_rules! delegate_write {
    ($ty:ty, $tls:pat => $parts:expr) => {
        impl AsyncWrite for $ty {
            fn poll_write(
                self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                buf: &[u8],
            ) -> Poll<io::Result<usize>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_write(cx, buf),
                    Self::Unix(s) => Pin::new(s).poll_write(cx, buf),
                    $tls => {
                        let (io, conn) = $parts;
                        crate::tls::poll_write(io.tcp(), conn, cx, buf)
                    }
                }
            }

            fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_flush(cx),
                    Self::Unix(s) => Pin::new(s).poll_flush(cx),
                    $tls => {
                        let (io, conn) = $parts;
                        crate::tls::poll_flush(io.tcp(), conn, cx)
                    }
                }
            }

            fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                match self.get_mut() {
                    Self::Tcp(s) => Pin::new(s).poll_shutdown(cx),
                    Self::Unix(s) => Pin::new(s).poll_shutdown(cx),
                    $tls => {
                        let (io, conn) = $parts;
                        std::task::ready!(crate::tls::poll_close(io.tcp(), conn, cx))?;
                        Pin::new(io).poll_shutdown(cx)
                    }
                }
            }
        }
    };
}

delegate_read!(Stream, Stream::Tls(t) => (&mut t.io, &t.conn));
delegate_read!(ReadHalf<'_>, ReadHalf::Tls(io, conn) => (io, *conn));
delegate_write!(Stream, Stream::Tls(t) => (&mut t.io, &t.conn));
delegate_write!(WriteHalf<'_>, WriteHalf::Tls(io, conn) => (io, *conn));

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[tokio::test]
    async fn a_stale_client_socket_is_replaced_and_a_live_one_kept() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(".s.PGSQL.6432");
        // A socket file nobody accepts on any more, as a pgfence killed with SIGKILL leaves.
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(path.exists());
        let listener = bind_client_socket(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o777);
        // While it accepts, a second pgfence must not take the file over.
        let err = bind_client_socket(&path).unwrap_err();
        assert!(err.contains("another process accepts"), "{err}");
        let client = UnixStream::connect(&path).await.unwrap();
        let (_accepted, _) = listener.accept().await.unwrap();
        drop(client);
    }

    #[test]
    fn clients_show_as_postgres_shows_them() {
        assert_eq!(ClientAddr::Local.to_string(), "[local]");
        let tcp = ClientAddr::Tcp("127.0.0.1:5555".parse().unwrap());
        assert_eq!(tcp.to_string(), "127.0.0.1:5555");
    }
}
