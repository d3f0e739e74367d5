//! Which of a session's sockets may have something to read.
//!
//! The forwarding loop waits on both of its sockets at once. Polling a socket that has
//! nothing costs tokio a lock and a waker comparison, and a loop that polled both sockets
//! at every turn made about nine read polls per round trip, two of which read anything
//! (callgrind). Each socket gets its own waker instead: tokio keeps it while the socket
//! has nothing, and it marks its socket readable before it wakes the task, so a turn polls
//! only the sockets that were marked.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

use bytes::BytesMut;
use tokio::io::AsyncRead;

/// One socket's mark and the waker tokio keeps for it.
pub(super) struct Readable {
    mark: Arc<Mark>,
    waker: Waker,
}

struct Mark {
    /// The socket may have something: poll it. Cleared only right before a poll, which
    /// either finds data (and sets it again) or leaves this waker with tokio.
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

impl Readable {
    /// A mark for one socket of the task whose waker is `task`; set, so that the first turn
    /// polls the socket.
    pub(super) fn new(task: &Waker) -> Readable {
        let mark = Arc::new(Mark {
            set: AtomicBool::new(true),
            task: task.clone(),
        });
        let waker = Waker::from(mark.clone());
        Readable { mark, waker }
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
        let (ra, rb) = (Readable::new(&task), Readable::new(&task));
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

    /// A read polled by another task than the mark's falls back to an ordinary poll.
    #[tokio::test(flavor = "current_thread")]
    async fn another_task_reads_as_usual() {
        let (mut far, mut near) = pair().await;
        let other = Waker::noop().clone();
        let readable = Readable::new(&other);
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
