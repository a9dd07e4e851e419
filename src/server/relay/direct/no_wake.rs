//! Systems without `eventfd`: no doorbell, so no outlet is made and every answer takes
//! the connection thread's channel (`Wake::new` fails).

use std::io;
use std::time::Duration;

use crate::net::Stream;

pub struct Wake;

/// What Linux's doorbell reports; no wait here ever ends but in a timeout.
#[allow(dead_code)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Woke {
    Socket,
    Rung,
    Timeout,
}

impl Wake {
    pub fn new() -> io::Result<Wake> {
        Err(io::ErrorKind::Unsupported.into())
    }

    pub fn signal(&self) {}

    pub fn clear(&self) {}

    pub fn poll(&self, _socket: Option<&Stream>, _timeout: Option<Duration>) -> Woke {
        Woke::Timeout
    }
}
