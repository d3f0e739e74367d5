//! CancelRequest routing. Each client gets its own BackendKeyData from pgfence; a cancel
//! that carries it is forwarded to the upstream backend that serves that client, with the
//! upstream's real key. An unknown key does nothing, as in PostgreSQL.
//!
//! The registry also maps a backend back to the pid its client was given, so that a
//! notification names its sender as that sender's client knows it (see
//! [`CancelRegistry::client_pid`]).

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

#[cfg(test)]
mod tests {
    use super::*;

    fn target(port: u16, pid: i32) -> CancelTarget {
        CancelTarget {
            upstream: UpstreamAddr::Tcp(([127, 0, 0, 1], port).into()),
            pid,
            key: 7,
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
}
