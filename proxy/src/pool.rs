//! Idle server connections kept between client sessions (PgBouncer's session mode).
//!
//! A connection is parked after its client left with the server session idle and reset
//! (`DISCARD ALL`), under the exact startup packet its login used and the upstream it goes
//! to. The next client sending the same startup packet gets it, with the login reply the
//! server gave (parameters as they are after the reset, and the server's cancel key), and
//! starts without a new backend process: no fork, no authentication, no cold caches.
//!
//! Parked sockets are plain `std` sockets, registered with no runtime: the worker thread
//! that takes one registers it with its own I/O driver.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use pgfence_config::Pool as PoolConfig;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use tracing::{debug, info};

use crate::net::StdStream;

/// What a parked connection is kept under.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolKey {
    /// The upstream and how pgfence connects to it ([`upstream_key`]).
    pub upstream: String,
    /// The startup packet, byte for byte.
    pub startup: Box<[u8]>,
}

/// A parameter's name and the ParameterStatus message that reports its value.
pub type ParameterStatus = (Box<[u8]>, Box<[u8]>);

/// What a client is told at login when it gets a parked connection.
#[derive(Debug, Clone, Default)]
pub struct LoginReply {
    /// The server's ParameterStatus messages, one per parameter, latest value.
    pub params: Vec<ParameterStatus>,
    /// The server's BackendKeyData message (pgfence gives each client its own key).
    pub backend_key: Box<[u8]>,
}

impl LoginReply {
    /// Records a ParameterStatus message for `name`, replacing an older one.
    pub fn set_param(&mut self, name: &[u8], frame: &[u8]) {
        match self.params.iter_mut().find(|(n, _)| &**n == name) {
            Some(slot) => slot.1 = frame.into(),
            None => self.params.push((name.into(), frame.into())),
        }
    }
}

/// Who a kept connection is logged in as (`SHOW SERVERS`).
#[derive(Debug, Clone, Default)]
pub struct ServerInfo {
    pub user: String,
    pub database: String,
    pub application_name: String,
    pub backend_pid: i32,
    /// TLS protocol and cipher suite of the connection to the server, if it uses TLS.
    pub tls: Option<String>,
}

/// A kept connection as `SHOW SERVERS` lists it.
#[derive(Debug, Clone)]
pub struct IdleServer {
    pub info: ServerInfo,
    pub idle_for: Duration,
    pub age: Duration,
}

/// An idle server connection.
#[derive(Debug)]
pub struct Parked {
    pub stream: StdStream,
    pub login: LoginReply,
    pub info: ServerInfo,
    /// When the connection was opened (for `server_lifetime`).
    pub born: Instant,
    parked_at: Instant,
}

impl Parked {
    pub fn new(stream: StdStream, login: LoginReply, info: ServerInfo, born: Instant) -> Parked {
        Parked {
            stream,
            login,
            info,
            born,
            parked_at: Instant::now(),
        }
    }

    fn expired(&self, config: &PoolConfig, now: Instant) -> bool {
        now.duration_since(self.parked_at) >= config.server_idle_timeout
            || now.duration_since(self.born) >= config.server_lifetime
    }

    /// The server has said nothing since the reset and has not closed: a parked session
    /// the server ended (`pg_terminate_backend`, `idle_session_timeout`, a restart) has sent
    /// an error or EOF by now.
    fn quiet(&self) -> bool {
        self.stream.quiet()
    }
}

/// Ends a parked server session politely (Terminate), without waiting.
fn close(parked: Parked, why: &'static str) {
    let mut stream = parked.stream;
    let _ = stream.write(&crate::protocol::message::TERMINATE);
    debug!(why, "closed an idle server connection");
}

/// The idle server connections of one pgfence process.
#[derive(Debug, Default)]
pub struct ServerPool {
    idle: Mutex<HashMap<PoolKey, Vec<Parked>>>,
    /// How many are idle (`pgfence_upstream_idle_connections`).
    idle_gauge: Gauge,
    /// Connections handed to a client instead of opening one (`pgfence_upstream_reused`).
    reused: Counter,
}

impl ServerPool {
    /// A pool that keeps `idle_gauge` and `reused` (the metrics') up to date.
    pub fn new(idle_gauge: Gauge, reused: Counter) -> ServerPool {
        ServerPool {
            idle: Mutex::default(),
            idle_gauge,
            reused,
        }
    }

    /// Connections handed to a client instead of opening one, since start.
    pub fn reused(&self) -> u64 {
        self.reused.get()
    }

    fn count(&self, idle: &HashMap<PoolKey, Vec<Parked>>) {
        let n = idle.values().map(Vec::len).sum::<usize>();
        self.idle_gauge.set(i64::try_from(n).unwrap_or(i64::MAX));
    }

    /// A live parked connection for `key`, if there is one; expired or dead ones met on the
    /// way are closed.
    pub fn take(&self, key: &PoolKey, config: &PoolConfig) -> Option<Parked> {
        let now = Instant::now();
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let list = idle.get_mut(key)?;
        let mut found = None;
        // Most recently parked first: the rest age out when load drops.
        while let Some(parked) = list.pop() {
            if parked.expired(config, now) {
                close(parked, "expired");
            } else if !parked.quiet() {
                close(parked, "closed by the server while idle");
            } else {
                found = Some(parked);
                break;
            }
        }
        if list.is_empty() {
            idle.remove(key);
        }
        self.count(&idle);
        if found.is_some() {
            self.reused.inc();
        }
        found
    }

    /// Keeps `parked` for the next client with the same key, unless the pool is full or the
    /// connection is too old.
    pub fn put(&self, key: PoolKey, parked: Parked, config: &PoolConfig) {
        if parked.expired(config, Instant::now()) {
            return close(parked, "server_lifetime reached");
        }
        let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        if idle.values().map(Vec::len).sum::<usize>() >= config.max_idle_servers {
            drop(idle);
            return close(parked, "max_idle_servers reached");
        }
        idle.entry(key).or_default().push(parked);
        self.count(&idle);
    }

    /// Closes connections idle longer than `server_idle_timeout`, older than
    /// `server_lifetime`, or to another upstream than `upstream` (after a reload; see
    /// [`upstream_key`]), and those the server ended while they were idle (a restart, a
    /// crash, `pg_terminate_backend`), which it logs: they would otherwise stay listed and
    /// counted until a client asked for one.
    pub fn sweep(&self, config: &PoolConfig, upstream: &str) {
        let now = Instant::now();
        let mut expired = Vec::new();
        let mut ended = Vec::new();
        {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            for (key, list) in idle.iter_mut() {
                let moved = key.upstream != upstream;
                let mut i = 0;
                while i < list.len() {
                    if moved || list[i].expired(config, now) {
                        expired.push(list.swap_remove(i));
                    } else if !list[i].quiet() {
                        ended.push(list.swap_remove(i));
                    } else {
                        i += 1;
                    }
                }
            }
            idle.retain(|_, list| !list.is_empty());
            self.count(&idle);
        }
        for parked in expired {
            close(parked, "idle timeout, lifetime or upstream changed");
        }
        for parked in ended {
            info!(
                backend_pid = parked.info.backend_pid,
                user = parked.info.user.as_str(),
                database = parked.info.database.as_str(),
                "an idle server connection was closed by the server (restart, crash or \
                 termination); it is no longer kept"
            );
            close(parked, "closed by the server while idle");
        }
    }

    /// Closes every idle connection (shutdown, pooling turned off by a reload, a server out
    /// of connection slots); returns how many.
    pub fn clear(&self) -> usize {
        let all: Vec<Parked> = {
            let mut idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
            let all = idle.drain().flat_map(|(_, list)| list).collect();
            self.count(&idle);
            all
        };
        let n = all.len();
        for parked in all {
            close(parked, "pool cleared");
        }
        n
    }

    /// The kept connections, by backend pid.
    pub fn list(&self) -> Vec<IdleServer> {
        let now = Instant::now();
        let idle = self.idle.lock().unwrap_or_else(|e| e.into_inner());
        let mut all: Vec<IdleServer> = idle
            .values()
            .flatten()
            .map(|p| IdleServer {
                info: p.info.clone(),
                idle_for: now.duration_since(p.parked_at),
                age: now.duration_since(p.born),
            })
            .collect();
        all.sort_by_key(|s| s.info.backend_pid);
        all
    }

    /// How many idle connections are kept.
    pub fn idle_count(&self) -> usize {
        usize::try_from(self.idle_gauge.get()).unwrap_or(0)
    }
}

/// How often idle connections are checked for timeouts.
pub const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// What kept connections are filed under besides the startup packet: the upstream's
/// `host:port` and its `sslmode`, so that a reload that changes either stops handing out
/// connections made the old way.
pub fn upstream_key(upstream: &pgfence_config::Upstream) -> String {
    format!("{upstream} sslmode={}", upstream.sslmode)
}
