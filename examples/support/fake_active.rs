//! The fake backend's count of requests it works on, and their highest number at once.
//!
//! A request counts from its arrival until it is answered, or until its client is seen
//! gone: a worker that cancels a request (its client or its relay went away) closes the
//! connection and may hand the slot to the next request at once, while the fake backend
//! may still be in a `delay` pause, as a real backend notices a hang-up at its next token.
//! Counting that abandoned connection would report more requests at once than the worker
//! ever had open. So each arrival first looks at the connections still counted (a
//! non-blocking peek): one whose client closed it stops counting then. The worker closes
//! the old connection before it opens the next, so the check never misses a hang-up.

use std::net::TcpStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::Mutex;

/// The requests counted in `Stats::active` and their connections.
#[derive(Default, Debug)]
pub struct Active {
    open: Mutex<Vec<Arc<Counted>>>,
}

#[derive(Debug)]
pub struct Counted {
    client: Option<TcpStream>,
    off: AtomicBool,
}

impl Active {
    /// A request on `conn` arrived: counted in `now` (and `max`) until [`Active::end`].
    pub fn begin(&self, now: &AtomicUsize, max: &AtomicUsize, conn: &TcpStream) -> Arc<Counted> {
        let me = Arc::new(Counted {
            client: conn.try_clone().ok(),
            off: AtomicBool::new(false),
        });
        let mut open = self.open.lock();
        open.retain(|c| {
            let gone = c.client.as_ref().is_some_and(client_gone);
            if gone {
                stop_counting(now, c);
            }
            !gone
        });
        open.push(me.clone());
        let n = now.fetch_add(1, Ordering::SeqCst) + 1;
        max.fetch_max(n, Ordering::SeqCst);
        me
    }

    /// The request was answered (or failed).
    pub fn end(&self, now: &AtomicUsize, me: &Arc<Counted>) {
        self.open.lock().retain(|c| !Arc::ptr_eq(c, me));
        stop_counting(now, me);
    }
}

fn stop_counting(now: &AtomicUsize, c: &Counted) {
    if !c.off.swap(true, Ordering::SeqCst) {
        now.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Whether the peer closed `conn` (end of stream or an error), without blocking and
/// without changing the socket's mode for the thread serving it.
#[cfg(unix)]
fn client_gone(conn: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    extern "C" {
        fn recv(fd: i32, buf: *mut u8, len: usize, flags: i32) -> isize;
    }
    const MSG_PEEK: i32 = 0x2;
    const MSG_DONTWAIT: i32 = 0x40;
    let mut byte = 0u8;
    // SAFETY: a one-byte buffer we own; the descriptor is open for as long as `conn`.
    let n = unsafe { recv(conn.as_raw_fd(), &mut byte, 1, MSG_PEEK | MSG_DONTWAIT) };
    let would_block =
        n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::WouldBlock;
    n == 0 || (n < 0 && !would_block)
}

#[cfg(not(unix))]
fn client_gone(_: &TcpStream) -> bool {
    false
}
