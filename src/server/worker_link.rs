//! The server's sending half of one worker socket.
//!
//! The dispatcher sends its messages here. When nothing is queued and the socket takes
//! the frame at once (plain TCP; see [`Stream::send_now`]), the bytes go out from the
//! dispatcher's own thread, with no other thread woken. Otherwise, on a TLS socket, a
//! full send buffer or a part left over, they wait in order in a queue that the socket's
//! writer thread drains with blocking writes. That thread is the only one that may block
//! on a slow worker; it alone writes while anything is queued, so frames never
//! interleave. Under load this saves a thread wake-up per request and writes all the
//! frames of a dispatcher batch in one `send`.

use std::io::Write;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};
use tungstenite::protocol::Role;

use super::dispatcher::reply::Lent;
use crate::net::Stream;
use crate::protocol::{raw_bodies, ServerMessage};
use crate::ws::{self, Writer};

pub struct WorkerLink {
    state: Mutex<State>,
    /// Signalled when the queue gains bytes or a close is asked for.
    work: Condvar,
    /// A clone of the socket for the non-blocking sends.
    stream: Stream,
    /// Whole answers this socket's reader writes when they arrive (`dispatcher/reply.rs`).
    pub answers: Lent,
    /// The worker listed [`raw_bodies::FEATURE_RAW_BODIES`]: requests go to it as binary
    /// messages, their bodies unescaped.
    pub raw_bodies: bool,
}

impl std::fmt::Debug for WorkerLink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WorkerLink")
    }
}

#[derive(Default)]
struct State {
    /// Frames waiting for the writer thread, in order.
    queue: Vec<u8>,
    /// The writer thread is writing bytes it took from the queue.
    writing: bool,
    /// Asked to close: the queue is written first, later sends are dropped.
    close: Option<(u16, String)>,
    /// The socket failed; everything is dropped.
    broken: bool,
}

impl WorkerLink {
    pub fn new(stream: Stream, raw_bodies: bool) -> WorkerLink {
        WorkerLink {
            state: Mutex::new(State::default()),
            work: Condvar::new(),
            stream,
            answers: Lent::default(),
            raw_bodies,
        }
    }

    /// Frames and sends one message.
    pub fn send(&self, msg: &ServerMessage) {
        let mut frames = Vec::new();
        push_message(&mut frames, msg, self.raw_bodies);
        self.send_frames(frames);
    }

    /// Sends ready frames (several messages, or control frames the reader produced).
    pub fn send_frames(&self, frames: Vec<u8>) {
        if frames.is_empty() {
            return;
        }
        let mut st = self.state.lock();
        if st.close.is_some() || st.broken {
            return;
        }
        let mut start = 0;
        if st.queue.is_empty() && !st.writing {
            match self.stream.send_now(&frames) {
                Ok(n) if n == frames.len() => return,
                Ok(n) => start = n,
                Err(_) => {
                    // The reader sees the broken socket too and reports the worker gone.
                    st.broken = true;
                    self.work.notify_one();
                    return;
                }
            }
        }
        if start == 0 && st.queue.is_empty() {
            st.queue = frames;
        } else {
            st.queue.extend_from_slice(&frames[start..]);
        }
        self.work.notify_one();
    }

    /// Asks for a close frame after whatever is queued; the socket is then shut down.
    pub fn close(&self, code: u16, reason: String) {
        let mut st = self.state.lock();
        if st.close.is_none() {
            st.close = Some((code, reason));
        }
        self.work.notify_one();
    }

    /// Closes with "going away": the socket or the dispatcher is ending.
    pub fn going_away(&self) {
        self.close(ws::close_code::GOING_AWAY, "closing".into());
    }

    /// The writer thread's body: writes queued bytes (blocking, up to `timeout` per
    /// write) until asked to close or the socket fails, then closes and shuts the socket
    /// down, which also ends the reader blocked on it.
    pub fn write_loop(&self, stream: Stream, max: usize, timeout: Duration) {
        let _ = stream.set_write_timeout(Some(timeout));
        let mut w = Writer::new(stream, Role::Server, max);
        let close = loop {
            let bytes = {
                let mut st = self.state.lock();
                st.writing = false;
                while st.queue.is_empty() && st.close.is_none() && !st.broken {
                    self.work.wait(&mut st);
                }
                if st.broken {
                    break None;
                }
                if st.queue.is_empty() {
                    break st.close.take();
                }
                st.writing = true;
                std::mem::take(&mut st.queue)
            };
            if w.stream.write_all(&bytes).is_err() {
                self.state.lock().broken = true;
                break None;
            }
        };
        if let Some((code, reason)) = close {
            let _ = w.close(code, &reason);
        }
        w.stream.shutdown();
    }
}

/// Appends `msg` as the server's (unmasked) frames: text, or binary for a request to a
/// worker that reads bodies unescaped (`raw_bodies`).
pub fn push_message(out: &mut Vec<u8>, msg: &ServerMessage, raw_bodies: bool) {
    if let (ServerMessage::Request(req), true) = (msg, raw_bodies) {
        if let Some(bytes) = raw_bodies::encode_request(req) {
            ws::server_binary_frames(out, &bytes);
            return;
        }
    }
    let text = crate::protocol::to_json_sized(msg, msg.text_hint());
    ws::server_frames(out, text.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::net::{TcpListener, TcpStream};
    use tungstenite::protocol::WebSocketContext;
    use tungstenite::Message;

    fn pair() -> (Stream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let a = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (b, _) = l.accept().unwrap();
        (Stream::plain(a), b)
    }

    fn cancel(id: String) -> ServerMessage {
        ServerMessage::Cancel {
            request_id: id,
            reason: crate::protocol::CancelReason::Timeout,
        }
    }

    fn read_texts(peer: TcpStream, n: usize) -> Vec<String> {
        let mut ctx = WebSocketContext::new(Role::Client, None);
        let mut s = peer;
        let mut out = Vec::new();
        while out.len() < n {
            match ctx.read(&mut s).unwrap() {
                Message::Text(t) => out.push(t.to_string()),
                Message::Close(_) => break,
                _ => {}
            }
        }
        out
    }

    #[test]
    fn inline_and_queued_frames_arrive_whole_and_in_order() {
        let (ours, peer) = pair();
        let link = std::sync::Arc::new(WorkerLink::new(ours.try_clone().unwrap(), false));
        let writer = {
            let link = link.clone();
            std::thread::spawn(move || link.write_loop(ours, 1 << 20, Duration::from_secs(5)))
        };
        // Far more than a socket buffer holds: later sends find the queue busy and wait
        // behind the leftover of an earlier one.
        let big = "x".repeat(300_000);
        for i in 0..40 {
            link.send(&cancel(format!("{i}-{big}")));
        }
        let reader = std::thread::spawn(move || read_texts(peer, 40));
        let texts = reader.join().unwrap();
        assert_eq!(texts.len(), 40);
        for (i, t) in texts.iter().enumerate() {
            assert!(t.contains(&format!("\"{i}-x")), "message {i} out of order");
        }
        link.close(ws::close_code::NORMAL, "done".into());
        writer.join().unwrap();
    }

    #[test]
    fn close_goes_out_after_the_queue_and_later_sends_are_dropped() {
        let (ours, mut peer) = pair();
        let link = std::sync::Arc::new(WorkerLink::new(ours.try_clone().unwrap(), false));
        link.send(&cancel("a".into()));
        link.close(ws::close_code::NORMAL, "drained".into());
        link.send(&cancel("b".into()));
        link.write_loop(ours, 1 << 20, Duration::from_secs(5));
        let mut all = Vec::new();
        peer.read_to_end(&mut all).unwrap();
        let text = String::from_utf8_lossy(&all);
        assert!(text.contains("\"a\"") && !text.contains("\"b\""), "{text}");
        assert!(text.contains("drained"), "no close frame: {text}");
    }
}
