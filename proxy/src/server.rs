//! The accept loop and shutdown.
//!
//! One task per client session, tracked so that shutdown can wait for them. Two ways to
//! stop, as in PgBouncer:
//! - [`ShutdownMode::Drain`] (SIGINT): stop accepting, close each session as soon as it is
//!   idle (no transaction open, nothing in flight), close the rest after
//!   `limits.shutdown_timeout`.
//! - [`ShutdownMode::WaitForClients`] (SIGTERM): stop accepting, let sessions run until
//!   their clients disconnect, for up to `limits.shutdown_timeout`; then drain as above for
//!   a last second and close what is left.
//! - [`ShutdownMode::Immediate`] (SIGQUIT, or a second signal during a shutdown): close
//!   every session now; open transactions roll back.
//!
//! A shutdown in progress only ever becomes less patient: from waiting for clients to
//! draining, from either to immediate.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pgfence_config::Config;
use prometheus_client::metrics::gauge::Gauge;
use tokio::net::{TcpListener, UnixListener};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::metrics::{Metrics, WorkerLabel};
use crate::net::{ClientAddr, Stream};
use crate::state::Shared;

/// Threads that run client sessions, each with its own single-threaded runtime (and so
/// its own I/O driver): a session's reads, writes and wakeups stay on one thread, without
/// the work-stealing scheduler's bookkeeping. A new session goes to the worker with the
/// fewest sessions open (ties dealt out round-robin), so that clients coming and going do
/// not pile the long-lived sessions onto one thread. Their runtimes have no timer (see
/// [`crate::deadline`]): nothing that runs on them may use `tokio::time`.
#[derive(Debug)]
pub struct Workers {
    handles: Vec<tokio::runtime::Handle>,
    /// Sessions open on each worker: `pgfence_worker_sessions{worker}`.
    sessions: Vec<Gauge>,
    next: AtomicUsize,
}

/// A session's place on its worker, given back when the session ends (dropped).
#[derive(Debug)]
struct WorkerSession(Gauge);

impl Drop for WorkerSession {
    fn drop(&mut self) {
        self.0.dec();
    }
}

impl Workers {
    /// Starts `n` worker threads (at least one), counting their sessions in `metrics`.
    pub fn start(n: usize, metrics: &Metrics) -> std::io::Result<Workers> {
        crate::deadline::start()?;
        let mut handles = Vec::new();
        let mut sessions = Vec::new();
        for worker in 0..n.max(1) {
            // No timer: sessions time out with `crate::deadline`, which costs a park nothing.
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_io()
                .build()?;
            handles.push(runtime.handle().clone());
            sessions.push(
                metrics
                    .worker_sessions
                    .get_or_create(&WorkerLabel { worker })
                    .clone(),
            );
            std::thread::Builder::new()
                .name(format!("pgfence-worker-{worker}"))
                .spawn(move || runtime.block_on(std::future::pending::<()>()))?;
        }
        Ok(Workers {
            handles,
            sessions,
            next: AtomicUsize::new(0),
        })
    }

    /// The worker for a new session, by number: the one with the fewest sessions, the first
    /// of them from a starting point that moves on at every call.
    fn pick(&self) -> (usize, WorkerSession) {
        let n = self.handles.len();
        let start = self.next.fetch_add(1, Ordering::Relaxed) % n;
        let worker = (start..start + n)
            .map(|i| i % n)
            .min_by_key(|&i| self.sessions[i].get())
            .unwrap_or(start);
        self.sessions[worker].inc();
        (worker, WorkerSession(self.sessions[worker].clone()))
    }
}

/// How to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    Drain,
    WaitForClients,
    Immediate,
}

impl ShutdownMode {
    /// Its name in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            ShutdownMode::WaitForClients => "wait_for_clients",
            ShutdownMode::Drain => "drain",
            ShutdownMode::Immediate => "immediate",
        }
    }

    /// How patient a mode is; a shutdown in progress only moves to a lower one.
    fn patience(self) -> u8 {
        match self {
            ShutdownMode::WaitForClients => 2,
            ShutdownMode::Drain => 1,
            ShutdownMode::Immediate => 0,
        }
    }
}

/// Serves clients accepted on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let shared = Arc::new(
        Shared::new(config)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?,
    );
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(ShutdownMode::Drain).await;
    });
    run_with(listener, None, shared, None, rx).await
}

/// Like [`run`], with clients of a Unix-domain socket too (`unix`, bound by the caller, who
/// removes its file after), state the caller keeps (reload, admin), worker threads
/// (`None`: sessions run on the caller's runtime) and a choice of shutdown: the first mode
/// received starts it, a later less patient one takes over (see the module's doc).
pub async fn run_with(
    listener: TcpListener,
    unix: Option<UnixListener>,
    shared: Arc<Shared>,
    workers: Option<Workers>,
    mut shutdown: tokio::sync::mpsc::Receiver<ShutdownMode>,
) -> std::io::Result<()> {
    let tracker = TaskTracker::new();
    let drain = CancellationToken::new();
    let kill = CancellationToken::new();
    let sweeper = tokio::spawn(sweep_idle_servers(shared.clone()));
    let mode = loop {
        tokio::select! {
            Some(mode) = shutdown.recv() => break mode,
            accepted = accept(&listener, unix.as_ref()) => match accepted {
                Ok((stream, peer)) => {
                    let shared = shared.clone();
                    let stop = crate::session::Stop::for_session(&drain, &kill);
                    match &workers {
                        None => {
                            tracker.spawn(crate::session::serve(stream, peer, shared, stop));
                        }
                        Some(workers) => {
                            // Re-register the socket with the worker's own I/O driver.
                            let Ok(stream) = stream.into_std() else { continue };
                            let (worker, place) = workers.pick();
                            tracker.spawn_on(
                                async move {
                                    let _place = place;
                                    match Stream::from_std(stream) {
                                        Ok(stream) => crate::session::serve(stream, peer, shared, stop).await,
                                        Err(e) => warn!(error = %e, "cannot register client socket"),
                                    }
                                },
                                &workers.handles[worker],
                            );
                        }
                    }
                }
                Err(e) => {
                    // Out of file descriptors and the like: keep serving the others.
                    warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    drop(listener);
    drop(unix);
    tracker.close();
    let timeout = shared.config().limits.shutdown_timeout;
    info!(
        mode = mode.as_str(),
        sessions = tracker.len(),
        ?timeout,
        "shutting down: no longer accepting clients"
    );
    let mut mode = mode;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        match mode {
            ShutdownMode::WaitForClients => {}
            ShutdownMode::Drain => drain.cancel(),
            ShutdownMode::Immediate => {
                // After `drain`, always: sessions only listen for `kill` once draining.
                drain.cancel();
                kill.cancel();
                break;
            }
        }
        tokio::select! {
            () = tracker.wait() => break,
            () = tokio::time::sleep_until(deadline) => {
                info!(
                    sessions = tracker.len(),
                    "shutdown timeout reached: closing sessions as they become idle, the rest in 1 s"
                );
                drain.cancel();
                if tokio::time::timeout(Duration::from_secs(1), tracker.wait())
                    .await
                    .is_err()
                {
                    warn!(
                        sessions = tracker.len(),
                        "shutdown timeout reached: closing remaining sessions"
                    );
                    mode = ShutdownMode::Immediate;
                    continue;
                }
                break;
            }
            Some(next) = shutdown.recv() => {
                if next.patience() < mode.patience() {
                    info!(?next, sessions = tracker.len(), "shutdown: less patient from now on");
                    mode = next;
                }
            }
        }
    }
    if mode == ShutdownMode::Immediate {
        let _ = tokio::time::timeout(Duration::from_secs(2), tracker.wait()).await;
    }
    sweeper.abort();
    shared.pool.clear();
    Ok(())
}

/// The next client of either listener.
async fn accept(
    tcp: &TcpListener,
    unix: Option<&UnixListener>,
) -> std::io::Result<(Stream, ClientAddr)> {
    let unix = async {
        match unix {
            Some(listener) => listener.accept().await,
            None => std::future::pending().await,
        }
    };
    tokio::select! {
        accepted = tcp.accept() => accepted.map(|(s, peer)| (Stream::Tcp(s), ClientAddr::Tcp(peer))),
        accepted = unix => accepted.map(|(s, _)| (Stream::Unix(s), ClientAddr::Local)),
    }
}

/// Closes idle server connections past their timeouts, and all of them while the
/// configuration says not to keep any.
async fn sweep_idle_servers(shared: Arc<Shared>) {
    let mut tick = tokio::time::interval(crate::pool::SWEEP_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let config = shared.config();
        if config.pool.reuse_servers {
            shared
                .pool
                .sweep(&config.pool, &crate::pool::upstream_key(&config.upstream));
        } else {
            shared.pool.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(metrics: &Metrics) -> Vec<i64> {
        (0..3)
            .map(|worker| {
                metrics
                    .worker_sessions
                    .get_or_create(&WorkerLabel { worker })
                    .get()
            })
            .collect()
    }

    #[test]
    fn a_new_session_goes_to_the_worker_with_the_fewest() {
        let metrics = Metrics::default();
        let workers = Workers::start(3, &metrics).expect("start three workers");
        assert_eq!(open(&metrics), [0, 0, 0]);

        // Equal loads: round-robin.
        let a = workers.pick();
        let b = workers.pick();
        let c = workers.pick();
        assert_eq!([a.0, b.0, c.0], [0, 1, 2]);
        assert_eq!(open(&metrics), [1, 1, 1]);

        // A short session ends: its worker gets the next one, wherever the turn stands.
        drop(b);
        assert_eq!(open(&metrics), [1, 0, 1]);
        let d = workers.pick();
        assert_eq!(d.0, 1);
        drop(a);
        drop(c);
        let e = workers.pick();
        let f = workers.pick();
        let mut rest = [e.0, f.0];
        rest.sort_unstable();
        assert_eq!(rest, [0, 2], "the two empty workers, not worker 1 again");
        assert_eq!(open(&metrics), [1, 1, 1]);
        drop((d, e, f));
        assert_eq!(open(&metrics), [0, 0, 0]);
    }
}
