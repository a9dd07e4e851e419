//! A connection thread's second doorbell: it sleeps in `poll` on its client's socket
//! and on this `eventfd`, so the dispatcher thread can call it back for the rare answer
//! it cannot finish alone, while the usual one (written whole) needs no call at all.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

use crate::net::Stream;

/// An `eventfd` in non-blocking mode: [`Wake::signal`] rings, [`Wake::clear`] resets.
pub struct Wake(OwnedFd);

/// What ended a [`Wake::poll`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    /// The socket has bytes, an end, or an error for a reader.
    Socket,
    /// The doorbell rang.
    Rung,
    /// Neither, within the timeout (or a signal interrupted the wait).
    Timeout,
}

impl Wake {
    pub fn new() -> io::Result<Wake> {
        // SAFETY: plain call; a non-negative result is a new descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and nothing else owns it.
        Ok(Wake(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Rings; rings not yet cleared add up to one wake.
    pub fn signal(&self) {
        let one: u64 = 1;
        // SAFETY: writes the eight bytes of `one`, a live local, to our descriptor.
        // A full counter (2^64 - 2 rings) would fail with EAGAIN: the bell rings anyway.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }

    /// Resets the counter without waiting.
    pub fn clear(&self) {
        let mut count: u64 = 0;
        // SAFETY: reads at most eight bytes into `count`, a live local.
        let _ = unsafe { libc::read(self.0.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
    }

    /// Waits for `socket` to be readable or for a ring, at most `timeout` (`None`:
    /// without end). `socket: None` waits for a ring alone.
    pub fn poll(&self, socket: Option<&Stream>, timeout: Option<Duration>) -> Woke {
        let mut fds = [
            libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: socket.map_or(-1, |s| s.as_raw_fd()),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        let count: libc::nfds_t = if socket.is_some() { 2 } else { 1 };
        let ms = timeout.map_or(-1, |t| {
            // Rounded up: a wait must not end before its time.
            let ms = t.as_micros().div_ceil(1000);
            i32::try_from(ms).unwrap_or(i32::MAX)
        });
        // SAFETY: `fds` is a live array of at least `count` pollfd entries.
        let ready = unsafe { libc::poll(fds.as_mut_ptr(), count, ms) };
        if ready <= 0 {
            return Woke::Timeout;
        }
        if fds[1].revents != 0 && socket.is_some() {
            Woke::Socket
        } else if fds[0].revents != 0 {
            Woke::Rung
        } else {
            Woke::Timeout
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn a_ring_wakes_a_wait_and_clearing_silences_it() {
        let wake = Wake::new().unwrap();
        assert_eq!(wake.poll(None, Some(Duration::ZERO)), Woke::Timeout);
        wake.signal();
        wake.signal();
        assert_eq!(wake.poll(None, Some(Duration::ZERO)), Woke::Rung);
        wake.clear();
        assert_eq!(wake.poll(None, Some(Duration::ZERO)), Woke::Timeout);
    }

    #[test]
    fn a_ring_from_another_thread_ends_a_wait_without_end() {
        let wake = std::sync::Arc::new(Wake::new().unwrap());
        let ringer = wake.clone();
        let t = std::thread::spawn(move || ringer.signal());
        assert_eq!(wake.poll(None, None), Woke::Rung);
        t.join().unwrap();
    }

    #[test]
    fn bytes_or_an_end_on_the_socket_wake_the_wait() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, _) = listener.accept().unwrap();
        let server = Stream::plain(server);
        let wake = Wake::new().unwrap();
        let fd = Some(&server);
        assert_eq!(wake.poll(fd, Some(Duration::ZERO)), Woke::Timeout);
        client.write_all(b"x").unwrap();
        assert_eq!(wake.poll(fd, None), Woke::Socket);
        drop(client);
        assert_eq!(wake.poll(fd, None), Woke::Socket);
    }
}
