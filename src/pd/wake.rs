//! Waiting on a socket for as long as it takes, yet stoppable: the listener thread blocks in
//! `poll` on its listening socket and an eventfd, which a shutdown signals. It used to wake
//! every 10 ms to look at the shutdown flag (100 wake-ups a second on an idle engine, and up
//! to 10 ms before a first connection was taken).

use std::io;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};

/// A wake-up for a thread blocked in [`Wake::readable`].
pub struct Wake(OwnedFd);

impl Wake {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd takes no pointers; a descriptor it returns is new and ours alone.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh, open descriptor nothing else owns.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    /// Wakes the waiter, now or whenever it next waits (the count stays set).
    pub fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: 8 readable bytes from a live local into the eventfd this owns. A full
        // counter (2^64 - 2 wake-ups) is the only failure, and it is signalled then anyway.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), one.len()) };
    }

    /// Blocks until `fd` is readable (true; for a listener: a connection to accept, or an
    /// error to read) or this was woken (false).
    pub fn readable(&self, fd: impl AsFd) -> bool {
        let mut fds = [
            libc::pollfd {
                fd: fd.as_fd().as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.0.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two pollfds in a live local array, both descriptors open while borrowed
        // (`fd` by the caller, the eventfd by `self`); no timeout.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, -1) };
        // Interrupted by a signal (n < 0): the caller looks at its flags and waits again.
        n > 0 && fds[1].revents == 0 && fds[0].revents != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    #[test]
    fn a_waiter_returns_for_a_connection_and_for_a_wake_up_and_otherwise_sleeps() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let wake = Arc::new(Wake::new().unwrap());
        // A connection: readable.
        let _c = TcpStream::connect(addr).unwrap();
        assert!(wake.readable(&listener));
        let _ = listener.accept().unwrap();
        // Nothing pending: it blocks until woken from another thread, then says so.
        let w = wake.clone();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            w.wake();
        });
        let start = Instant::now();
        assert!(!wake.readable(&listener));
        assert!(
            start.elapsed() >= Duration::from_millis(150),
            "returned before the wake-up: {:?}",
            start.elapsed()
        );
        waker.join().unwrap();
        // The wake-up stays set: a later wait returns at once, even with a connection pending.
        let _c2 = TcpStream::connect(addr).unwrap();
        assert!(!wake.readable(&listener));
    }
}
