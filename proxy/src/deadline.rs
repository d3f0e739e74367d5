//! Coarse timeouts for sessions, without tokio's timer.
//!
//! A runtime with tokio's timer pays for it at every park: the timer wheel is checked and
//! the clock read at each wake-up, whether a timer is pending or not. For a session's round
//! trip that was about 800 instructions (23 million of the 264 million of the callgrind
//! recipe in docs/benchmarks.md), yet sessions only time out while they open, log in and
//! close. Sleeping on another runtime's timer instead woke that runtime's thread to start
//! and to cancel every sleep (-7% new connections per second, docs/benchmarks.md).
//!
//! So the worker runtimes have no timer, and a session's timeout is a deadline in one list:
//! registering it takes a lock, never a system call unless the list was empty. One thread,
//! `pgfence-deadlines`, looks at the list every [`TICK`] while it holds anything, wakes the
//! tasks whose deadline has passed and forgets the ones whose timeout was dropped; with
//! nothing in the list it sleeps until a deadline comes. A timeout fires up to one tick
//! late, which the seconds these timeouts are set to (startup, connect, reset) can afford.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_util::task::AtomicWaker;

/// How often the list is looked at while it is not empty: the most a timeout fires late.
pub const TICK: Duration = Duration::from_millis(100);

/// A timeout expired (the future it bounded did not finish in time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Elapsed;

/// One registered deadline.
#[derive(Debug, Default)]
struct State {
    fired: AtomicBool,
    waker: AtomicWaker,
}

/// Deadlines not yet passed, with the timeouts that wait for them (gone once dropped).
static LIST: Mutex<Vec<(Instant, Weak<State>)>> = Mutex::new(Vec::new());
/// The thread that fires deadlines, once started.
static THREAD: Mutex<Option<std::thread::Thread>> = Mutex::new(None);

/// Starts the thread that fires deadlines, if it is not running yet. The proxy calls this
/// when it starts, so that a failure shows there; a timeout started before would start it.
pub fn start() -> std::io::Result<()> {
    wake_or_start().map(|_| ())
}

/// Wakes the thread that fires deadlines, or starts it: `true` if it was running.
fn wake_or_start() -> std::io::Result<bool> {
    let mut thread = THREAD.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(thread) = &*thread {
        thread.unpark();
        return Ok(true);
    }
    let handle = std::thread::Builder::new()
        .name("pgfence-deadlines".to_owned())
        .spawn(fire_deadlines)?;
    *thread = Some(handle.thread().clone());
    Ok(false)
}

fn fire_deadlines() {
    let mut due = Vec::new();
    loop {
        let empty = {
            let mut list = LIST.lock().unwrap_or_else(PoisonError::into_inner);
            let now = Instant::now();
            list.retain(|(at, state)| {
                let Some(state) = state.upgrade() else {
                    return false;
                };
                if *at > now {
                    return true;
                }
                due.push(state);
                false
            });
            list.is_empty()
        };
        // Woken outside the lock: waking a task on another runtime writes to its driver.
        for state in due.drain(..) {
            state.fired.store(true, Ordering::Release);
            state.waker.wake();
        }
        if empty {
            // Until `register` puts a deadline into the empty list (`unpark` before `park`
            // is not lost).
            std::thread::park();
        } else {
            std::thread::sleep(TICK);
        }
    }
}

fn register(at: Instant) -> Arc<State> {
    let state = Arc::new(State::default());
    let was_empty = {
        let mut list = LIST.lock().unwrap_or_else(PoisonError::into_inner);
        list.push((at, Arc::downgrade(&state)));
        list.len() == 1
    };
    if was_empty {
        if let Err(e) = wake_or_start() {
            tracing::error!(error = %e, "cannot start the thread that fires timeouts: sessions will not time out");
        }
    }
    state
}

/// Completes once `duration` has passed (up to one [`TICK`] later). Registers its deadline
/// when first polled, and withdraws it when dropped.
pub fn sleep(duration: Duration) -> Sleep {
    Sleep {
        at: Instant::now() + duration,
        state: None,
    }
}

/// See [`sleep`].
#[derive(Debug)]
pub struct Sleep {
    at: Instant,
    state: Option<Arc<State>>,
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let at = self.at;
        let state = match &self.state {
            Some(state) => state,
            None if Instant::now() >= at => return Poll::Ready(()),
            None => self.state.insert(register(at)),
        };
        state.waker.register(cx.waker());
        if state.fired.load(Ordering::Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

/// `future`'s output, or [`Elapsed`] if it has not finished after `duration` (up to one
/// [`TICK`] more). `future` is polled first, so one that is ready at once registers nothing.
pub async fn timeout<F: Future>(duration: Duration, future: F) -> Result<F::Output, Elapsed> {
    tokio::select! {
        biased;
        output = future => Ok(output),
        () = sleep(duration) => Err(Elapsed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A runtime without tokio's timer, as the workers have.
    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_io()
            .build()
            .unwrap()
    }

    fn pending_count() -> usize {
        LIST.lock()
            .unwrap()
            .iter()
            .filter(|(_, s)| s.strong_count() > 0)
            .count()
    }

    #[test]
    fn a_timeout_fires_on_a_runtime_without_a_timer() {
        let started = Instant::now();
        let out = runtime().block_on(timeout(
            Duration::from_millis(150),
            std::future::pending::<()>(),
        ));
        let elapsed = started.elapsed();
        assert_eq!(out, Err(Elapsed));
        assert!(elapsed >= Duration::from_millis(150), "{elapsed:?}");
        assert!(
            elapsed < Duration::from_millis(150) + 10 * TICK,
            "{elapsed:?}"
        );
    }

    #[test]
    fn a_future_that_finishes_in_time_gives_its_output_and_leaves_nothing_behind() {
        let rt = runtime();
        assert_eq!(
            rt.block_on(timeout(Duration::from_secs(60), async { 7 })),
            Ok(7)
        );
        // Pending at first, then done: its deadline is withdrawn with the timeout.
        let (tx, rx) = tokio::sync::oneshot::channel();
        let out = rt.block_on(async {
            let waiting = tokio::spawn(timeout(Duration::from_secs(60), rx));
            tokio::task::yield_now().await;
            tx.send(5).unwrap();
            waiting.await.unwrap()
        });
        assert_eq!(out, Ok(Ok(5)));
        assert!(
            LIST.lock()
                .unwrap()
                .iter()
                .all(|(at, s)| s.strong_count() == 0
                    || *at < Instant::now() + Duration::from_secs(59)),
            "the 60 s deadline is still waited for"
        );
    }

    #[test]
    fn many_timeouts_fire_and_the_list_empties() {
        let rt = runtime();
        let outs = rt.block_on(async {
            let tasks: Vec<_> = (0..50u64)
                .map(|i| {
                    tokio::spawn(timeout(
                        Duration::from_millis(10 * (i % 5)),
                        std::future::pending::<()>(),
                    ))
                })
                .collect();
            let mut outs = Vec::new();
            for t in tasks {
                outs.push(t.await.unwrap());
            }
            outs
        });
        assert!(outs.iter().all(|o| *o == Err(Elapsed)));
        let deadline = Instant::now() + 10 * TICK;
        while pending_count() > 0 && Instant::now() < deadline {
            std::thread::sleep(TICK);
        }
        assert_eq!(pending_count(), 0);
    }
}
