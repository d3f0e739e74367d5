//! CancelRequest routing. Each client gets its own BackendKeyData from pgfence; a cancel
//! that carries it is forwarded to the upstream backend that serves that client, with the
//! upstream's real key. An unknown key does nothing, as in PostgreSQL.

use dashmap::DashMap;
use tokio::io::AsyncWriteExt;
use tokio::net::{TcpStream, UnixStream};

use crate::net::{Stream, UpstreamAddr};

/// Where a cancel for one client session must go.
#[derive(Debug, Clone)]
pub struct CancelTarget {
    pub upstream: UpstreamAddr,
    pub pid: i32,
    pub key: i32,
}

/// Live sessions by the key pgfence gave their client.
#[derive(Debug, Default)]
pub struct CancelRegistry {
    sessions: DashMap<(i32, i32), CancelTarget>,
}

impl CancelRegistry {
    /// Registers a session and returns the `(pid, key)` to hand its client.
    pub fn register(&self, target: CancelTarget) -> (i32, i32) {
        loop {
            let pid = rand::random::<i32>() & 0x7fff_ffff;
            let key = rand::random::<i32>();
            if let dashmap::Entry::Vacant(e) = self.sessions.entry((pid, key)) {
                e.insert(target);
                return (pid, key);
            }
        }
    }

    /// Forgets a session when it ends.
    pub fn unregister(&self, pid: i32, key: i32) {
        self.sessions.remove(&(pid, key));
    }

    /// The session a client's cancel refers to.
    pub fn lookup(&self, pid: i32, key: i32) -> Option<CancelTarget> {
        self.sessions.get(&(pid, key)).map(|t| t.clone())
    }
}

/// Sends a CancelRequest for `target` to its upstream server.
pub async fn send_cancel(target: CancelTarget) -> std::io::Result<()> {
    let mut packet = [0u8; 16];
    packet[0..4].copy_from_slice(&16u32.to_be_bytes());
    packet[4..8].copy_from_slice(&80877102u32.to_be_bytes());
    packet[8..12].copy_from_slice(&target.pid.to_be_bytes());
    packet[12..16].copy_from_slice(&target.key.to_be_bytes());
    let mut stream = match &target.upstream {
        UpstreamAddr::Tcp(addr) => Stream::Tcp(TcpStream::connect(addr).await?),
        UpstreamAddr::Unix(path) => Stream::Unix(UnixStream::connect(path).await?),
    };
    stream.write_all(&packet).await?;
    stream.shutdown().await
}
