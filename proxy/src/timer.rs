//! Timeouts for sessions on worker threads.
//!
//! A tokio runtime with a timer checks its timer wheel and reads the clock every time its
//! thread parks: a callgrind profile of the proxy put that at about a tenth of its
//! instructions, paid on every message. Sessions only need timers at their edges (connect,
//! startup, reset, last words to a failing client), so [`crate::Workers`] build their
//! runtimes without one, and a session's timeout sleeps on the runtime that started the
//! workers instead. On any other runtime (sessions run on the caller's runtime, tests)
//! [`timeout`] is tokio's own.

use std::cell::OnceCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::runtime::Handle;
use tokio::task::JoinHandle;

thread_local! {
    /// On a worker thread: the runtime whose timer its sessions use.
    static TIMERS: OnceCell<Handle> = const { OnceCell::new() };
}

/// Makes this (worker) thread's timeouts sleep on `timers`' runtime.
pub(crate) fn use_timers_of(timers: Handle) {
    TIMERS.with(|t| {
        let _ = t.set(timers);
    });
}

/// The deadline passed before the future completed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Elapsed;

/// `fut`'s output, or [`Elapsed`] after `limit`.
pub(crate) async fn timeout<F: Future>(limit: Duration, fut: F) -> Result<F::Output, Elapsed> {
    let Some(timers) = TIMERS.with(|t| t.get().cloned()) else {
        return tokio::time::timeout(limit, fut).await.map_err(|_| Elapsed);
    };
    // The sleep is made on the timer's runtime: made here, it would look for this one's.
    let sleep = AbortOnDrop(timers.spawn(async move { tokio::time::sleep(limit).await }));
    tokio::select! {
        biased;
        out = fut => Ok(out),
        // The timer's runtime shutting down ends the wait as well: the process is exiting.
        _ = sleep => Err(Elapsed),
    }
}

/// A task that is aborted when its handle is dropped: a timeout that is no longer awaited
/// leaves no sleeping task behind.
struct AbortOnDrop(JoinHandle<()>);

impl Future for AbortOnDrop {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.0).poll(cx).map(|_| ())
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime without a timer, as on a worker, using the test's runtime for timeouts.
    fn worker(timers: Handle) -> tokio::runtime::Runtime {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap();
        rt.block_on(async { use_timers_of(timers) });
        rt
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_worker_times_out_on_the_timers_runtime() {
        let timers = Handle::current();
        let out = std::thread::spawn(move || {
            let rt = worker(timers);
            rt.block_on(async {
                let late = timeout(Duration::from_millis(20), std::future::pending::<()>()).await;
                let quick = timeout(Duration::from_secs(5), async { 7 }).await;
                (late, quick)
            })
        })
        .join()
        .unwrap();
        assert_eq!(out, (Err(Elapsed), Ok(7)));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 1)]
    async fn a_finished_timeout_leaves_no_sleeping_task() {
        let timers = Handle::current();
        let metrics = timers.metrics();
        std::thread::spawn(move || {
            let rt = worker(timers);
            rt.block_on(async {
                for _ in 0..10 {
                    let _ = timeout(Duration::from_secs(3600), async {}).await;
                }
            })
        })
        .join()
        .unwrap();
        // Aborted tasks are gone once the runtime has run their cancellation.
        for _ in 0..100 {
            if metrics.num_alive_tasks() == 0 {
                break;
            }
            tokio::task::yield_now().await;
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(metrics.num_alive_tasks(), 0);
    }

    #[tokio::test]
    async fn elsewhere_it_is_tokio_s_timeout() {
        let late = timeout(Duration::from_millis(10), std::future::pending::<()>()).await;
        assert_eq!(late, Err(Elapsed));
    }
}
