//! Which of a session's sockets may have something to read, and whether its drain notice
//! came.
//!
//! The forwarding loop waits on both of its sockets at once. Polling a socket that has
//! nothing costs tokio a lock and a waker comparison, and a loop that polled both sockets
//! at every turn made about nine read polls per round trip, two of which read anything
//! (callgrind). Each socket gets its own waker instead: tokio keeps it while the socket
//! has nothing, and it marks its socket readable before it wakes the task, so a turn polls
//! only the sockets that were marked. The drain token's notice gets a mark too: asking a
//! `CancellationToken` whether it is cancelled takes its lock, at every turn.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::BytesMut;
use tokio::io::AsyncRead;

/// One socket's mark, or one future's, and the waker tokio keeps for it.
pub(super) struct Marked {
    mark: Arc<Mark>,
    waker: Waker,
}

struct Mark {
    /// The socket may have something, or the future may be ready: poll it. Cleared only
    /// right before a poll, which either finds data (and sets it again) or leaves this
    /// waker with tokio.
    set: AtomicBool,
    task: Waker,
}

impl Wake for Mark {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.set.store(true, Ordering::Release);
        self.task.wake_by_ref();
    }
}

impl Marked {
    /// A mark for one socket or future of the task whose waker is `task`; set, so that the
    /// first turn polls it (which leaves this mark's waker with tokio).
    pub(super) fn new(task: &Waker) -> Marked {
        let mark = Arc::new(Mark {
            set: AtomicBool::new(true),
            task: task.clone(),
        });
        let waker = Waker::from(mark.clone());
        Marked { mark, waker }
    }

    /// Reads from `socket` into `buf` when it was marked readable; pending otherwise.
    pub(super) fn read<'a, R: AsyncRead + Unpin>(
        &'a self,
        socket: &'a mut R,
        buf: &'a mut BytesMut,
    ) -> impl Future<Output = io::Result<usize>> + 'a {
        std::future::poll_fn(move |cx| {
            if !cx.waker().will_wake(&self.mark.task) {
                // Polled by another task than the one this mark wakes: poll as usual.
                return tokio_util::io::poll_read_buf(Pin::new(&mut *socket), cx, buf);
            }
            if !self.mark.set.swap(false, Ordering::Acquire) {
                return Poll::Pending;
            }
            let mut own = Context::from_waker(&self.waker);
            let polled = tokio_util::io::poll_read_buf(Pin::new(&mut *socket), &mut own, buf);
            if polled.is_ready() {
                // There may be more: poll again at the next turn.
                self.mark.set.store(true, Ordering::Relaxed);
            }
            polled
        })
    }

    /// Polls `fut` when it woke the task since it was last polled; pending otherwise. `fut`
    /// must keep the waker it was last polled with, as tokio's `Notified` does.
    pub(super) fn poll<'a, F: Future + ?Sized>(
        &'a self,
        mut fut: Pin<&'a mut F>,
    ) -> impl Future<Output = F::Output> + 'a {
        std::future::poll_fn(move |cx| {
            if !cx.waker().will_wake(&self.mark.task) {
                return fut.as_mut().poll(cx);
            }
            // A plain load first: the mark is rarely set, and the swap is a locked operation.
            if !self.mark.set.load(Ordering::Relaxed)
                || !self.mark.set.swap(false, Ordering::Acquire)
            {
                return Poll::Pending;
            }
            fut.as_mut().poll(&mut Context::from_waker(&self.waker))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (a, b) = tokio::join!(TcpStream::connect(addr), listener.accept());
        (a.unwrap(), b.unwrap().0)
    }

    /// Data that arrives while the task waits is read; a socket that was not marked is not
    /// polled (its own waker stays with tokio) and is read once data marks it.
    #[tokio::test(flavor = "current_thread")]
    async fn reads_what_arrives_on_either_socket() {
        let (mut a_far, mut a) = pair().await;
        let (mut b_far, mut b) = pair().await;
        let task = std::future::poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
        let (ra, rb) = (Marked::new(&task), Marked::new(&task));
        let (mut abuf, mut bbuf) = (BytesMut::with_capacity(64), BytesMut::with_capacity(64));
        // A lost wake-up would hang the test: it fails on time instead.
        let limit = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
        for round in 0..20u8 {
            let far = if round % 3 == 0 {
                &mut a_far
            } else {
                &mut b_far
            };
            let writer = async move {
                tokio::task::yield_now().await;
                far.write_all(&[round]).await.unwrap();
            };
            let reader = async {
                tokio::select! {
                    r = ra.read(&mut a, &mut abuf) => ('a', r.unwrap()),
                    r = rb.read(&mut b, &mut bbuf) => ('b', r.unwrap()),
                }
            };
            let both = tokio::time::timeout_at(limit, async { tokio::join!(reader, writer) });
            let ((side, n), ()) = both.await.expect("a read never woke");
            assert_eq!(n, 1, "round {round}");
            assert_eq!(
                side,
                if round % 3 == 0 { 'a' } else { 'b' },
                "round {round}"
            );
        }
        assert_eq!(abuf.len() + bbuf.len(), 20);
    }

    /// A future is polled at the first turn and then only after it woke the task; the
    /// drain token's notice gets through.
    #[tokio::test(flavor = "current_thread")]
    async fn polls_a_future_only_after_it_woke_the_task() {
        struct Counted<'a> {
            polls: &'a std::cell::Cell<u32>,
            waker: &'a std::cell::RefCell<Option<Waker>>,
            ready: &'a std::cell::Cell<bool>,
        }
        impl Future for Counted<'_> {
            type Output = ();
            fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
                self.polls.set(self.polls.get() + 1);
                if self.ready.get() {
                    return Poll::Ready(());
                }
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        }
        let (polls, waker, ready) = Default::default();
        let mut fut = std::pin::pin!(Counted {
            polls: &polls,
            waker: &waker,
            ready: &ready,
        });
        let task = std::future::poll_fn(|cx| Poll::Ready(cx.waker().clone())).await;
        let woken = Marked::new(&task);
        // One turn of a loop: poll once, with this task's waker.
        macro_rules! turn {
            () => {{
                let mut polled = std::pin::pin!(woken.poll(fut.as_mut()));
                std::future::poll_fn(|cx| {
                    Poll::Ready(polled.as_mut().poll(cx)).map(|p| p.is_ready())
                })
                .await
            }};
        }
        assert!(!turn!());
        assert_eq!(polls.get(), 1, "the first turn polls it");
        assert!(!turn!());
        assert!(!turn!());
        assert_eq!(polls.get(), 1, "not woken: not polled");
        ready.set(true);
        waker.borrow_mut().take().expect("it kept a waker").wake();
        assert!(turn!());
        assert_eq!(polls.get(), 2);

        let token = tokio_util::sync::CancellationToken::new();
        let drain = token.cancelled();
        tokio::pin!(drain);
        let woken = Marked::new(&task);
        let canceller = async {
            tokio::task::yield_now().await;
            token.cancel();
        };
        let waited = tokio::time::timeout(std::time::Duration::from_secs(10), async {
            tokio::join!(woken.poll(drain.as_mut()), canceller)
        });
        waited.await.expect("the drain notice never woke the task");
    }

    /// A read polled by another task than the mark's falls back to an ordinary poll.
    #[tokio::test(flavor = "current_thread")]
    async fn another_task_reads_as_usual() {
        let (mut far, mut near) = pair().await;
        let other = Waker::noop().clone();
        let readable = Marked::new(&other);
        readable.mark.set.store(false, Ordering::Relaxed);
        far.write_all(b"x").await.unwrap();
        let mut buf = BytesMut::with_capacity(8);
        let read = readable.read(&mut near, &mut buf);
        let n = tokio::time::timeout(std::time::Duration::from_secs(10), read)
            .await
            .expect("the read never woke")
            .unwrap();
        assert_eq!((n, &buf[..]), (1, &b"x"[..]));
    }
}
