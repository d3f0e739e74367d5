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

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use pgfence_config::Config;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

use crate::state::Shared;

/// How to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShutdownMode {
    Drain,
    WaitForClients,
}

/// Serves clients accepted on `listener` until `shutdown` completes, then drains.
pub async fn run(
    listener: TcpListener,
    config: Arc<Config>,
    shutdown: impl Future<Output = ()> + Send,
) -> std::io::Result<()> {
    let shared = Arc::new(Shared::new(config));
    run_with(listener, shared, async move {
        shutdown.await;
        ShutdownMode::Drain
    })
    .await
}

/// Like [`run`], with state the caller keeps (reload, admin) and a choice of shutdown.
pub async fn run_with(
    listener: TcpListener,
    shared: Arc<Shared>,
    shutdown: impl Future<Output = ShutdownMode> + Send,
) -> std::io::Result<()> {
    let tracker = TaskTracker::new();
    let drain = CancellationToken::new();
    let kill = CancellationToken::new();
    tokio::pin!(shutdown);
    let mode = loop {
        tokio::select! {
            mode = &mut shutdown => break mode,
            accepted = listener.accept() => match accepted {
                Ok((stream, peer)) => {
                    let shared = shared.clone();
                    let stop = crate::session::Stop { drain: drain.clone(), kill: kill.clone() };
                    tracker.spawn(crate::session::serve(stream, peer, shared, stop));
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
    tracker.close();
    let timeout = shared.config().limits.shutdown_timeout;
    info!(
        ?mode,
        sessions = tracker.len(),
        ?timeout,
        "shutting down: no longer accepting clients"
    );
    if mode == ShutdownMode::Drain {
        drain.cancel();
    }
    if tokio::time::timeout(timeout, tracker.wait()).await.is_err() {
        drain.cancel();
        if tokio::time::timeout(Duration::from_secs(1), tracker.wait())
            .await
            .is_err()
        {
            warn!(
                sessions = tracker.len(),
                "shutdown timeout reached: closing remaining sessions"
            );
            kill.cancel();
            let _ = tokio::time::timeout(Duration::from_secs(2), tracker.wait()).await;
        }
    }
    Ok(())
}
