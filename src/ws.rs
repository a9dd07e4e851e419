//! WebSocket plumbing shared by the server's worker sockets and the worker daemon.
//!
//! Each socket has one reader with its own [`WebSocketContext`] over its own clone of
//! the [`Stream`](crate::net::Stream), so a blocked read never holds up a write. Control
//! replies the reading context produces (pong, close echo) are captured by [`ReadHalf`]
//! and handed to the socket's writing side, so frames never interleave.
//! Large text messages are split into frames of at most [`FRAME_BYTES`], because
//! deployed peers refuse frames above 16 MiB.

use std::io::{self, Read, Write};

use tungstenite::protocol::frame::coding::{Data, OpCode};
use tungstenite::protocol::frame::Frame;
use tungstenite::protocol::{Role, WebSocketConfig, WebSocketContext};
use tungstenite::Message;

/// Largest frame we send.
pub const FRAME_BYTES: usize = 4 * 1024 * 1024;

/// Reader/writer configuration: messages up to `max_message` bytes in any framing.
pub fn config(max_message: usize) -> WebSocketConfig {
    // The default 128 KiB read buffer per socket would dominate idle memory with many
    // workers; messages larger than this still work, the buffer grows on demand.
    WebSocketConfig::default()
        .read_buffer_size(16 * 1024)
        .write_buffer_size(16 * 1024)
        .max_message_size(Some(max_message))
        .max_frame_size(Some(max_message))
}

/// The reading side's stream: reads from the socket, keeps anything the context wants
/// to write so the caller can pass it to the writer thread.
pub struct ReadHalf<S: Read> {
    pub stream: S,
    pending: Vec<u8>,
}

impl<S: Read> ReadHalf<S> {
    pub fn new(stream: S) -> ReadHalf<S> {
        ReadHalf {
            stream,
            pending: Vec::new(),
        }
    }

    /// Control-frame bytes produced while reading, to be written by the writer.
    pub fn take_pending(&mut self) -> Option<Vec<u8>> {
        (!self.pending.is_empty()).then(|| std::mem::take(&mut self.pending))
    }
}

impl<S: Read> Read for ReadHalf<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.read(buf)
    }
}

impl<S: Read> Write for ReadHalf<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pending.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The writing side: a context and its stream.
pub struct Writer<S: Read + Write> {
    ctx: WebSocketContext,
    pub stream: S,
}

impl<S: Read + Write> Writer<S> {
    pub fn new(stream: S, role: Role, max_message: usize) -> Writer<S> {
        Writer {
            ctx: WebSocketContext::new(role, Some(config(max_message))),
            stream,
        }
    }

    /// Queues a text message, fragmenting it when large. Call [`Writer::flush`] after.
    pub fn text(&mut self, text: String) -> tungstenite::Result<()> {
        if text.len() <= FRAME_BYTES {
            return self.ctx.write(&mut self.stream, Message::text(text));
        }
        self.fragments(text.into_bytes(), Data::Text)
    }

    /// Queues a binary message, fragmenting it when large. Call [`Writer::flush`] after.
    pub fn binary(&mut self, bytes: Vec<u8>) -> tungstenite::Result<()> {
        if bytes.len() <= FRAME_BYTES {
            return self.ctx.write(&mut self.stream, Message::binary(bytes));
        }
        self.fragments(bytes, Data::Binary)
    }

    fn fragments(&mut self, bytes: Vec<u8>, kind: Data) -> tungstenite::Result<()> {
        let parts: Vec<&[u8]> = bytes.chunks(FRAME_BYTES).collect();
        let last = parts.len() - 1;
        for (i, part) in parts.into_iter().enumerate() {
            let opcode = if i == 0 {
                OpCode::Data(kind)
            } else {
                OpCode::Data(Data::Continue)
            };
            let frame = Frame::message(part.to_vec(), opcode, i == last);
            self.ctx.write(&mut self.stream, Message::Frame(frame))?;
        }
        Ok(())
    }

    /// Writes bytes that a [`ReadHalf`] captured, after whatever is already queued.
    pub fn raw(&mut self, bytes: &[u8]) -> tungstenite::Result<()> {
        self.ctx.flush(&mut self.stream)?;
        self.stream.write_all(bytes)?;
        Ok(())
    }

    pub fn flush(&mut self) -> tungstenite::Result<()> {
        self.ctx.flush(&mut self.stream)
    }

    /// Sends a close frame with `reason` (truncated to fit a control frame).
    pub fn close(&mut self, code: u16, reason: &str) -> tungstenite::Result<()> {
        let mut reason = reason.to_string();
        while reason.len() > 120 {
            reason.pop();
        }
        let frame = tungstenite::protocol::CloseFrame {
            code: code.into(),
            reason: reason.into(),
        };
        self.ctx.close(&mut self.stream, Some(frame))
    }
}

/// Appends `payload` as the unmasked text frames a server sends: one frame, or
/// fragments of at most [`FRAME_BYTES`] when it is larger.
pub fn server_frames(out: &mut Vec<u8>, payload: &[u8]) {
    server_message(out, payload, Data::Text);
}

/// [`server_frames`] for a binary message.
pub fn server_binary_frames(out: &mut Vec<u8>, payload: &[u8]) {
    server_message(out, payload, Data::Binary);
}

fn server_message(out: &mut Vec<u8>, payload: &[u8], kind: Data) {
    use tungstenite::protocol::frame::FrameHeader;
    let frames = payload.len().div_ceil(FRAME_BYTES).max(1);
    out.reserve(payload.len() + 10 * frames);
    for i in 0..frames {
        let part = &payload[i * FRAME_BYTES..payload.len().min((i + 1) * FRAME_BYTES)];
        let header = FrameHeader {
            is_final: i + 1 == frames,
            opcode: if i == 0 {
                OpCode::Data(kind)
            } else {
                OpCode::Data(Data::Continue)
            },
            ..FrameHeader::default()
        };
        // Writing into a Vec cannot fail.
        let _ = header.format(part.len() as u64, out);
        out.extend_from_slice(part);
    }
}

/// WebSocket close codes we use.
pub mod close_code {
    pub const NORMAL: u16 = 1000;
    pub const GOING_AWAY: u16 = 1001;
    pub const PROTOCOL: u16 = 1002;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read_back(frames: Vec<u8>) -> String {
        let mut ctx = WebSocketContext::new(Role::Client, Some(config(64 << 20)));
        let mut io = ReadHalf::new(io::Cursor::new(frames));
        match ctx.read(&mut io) {
            Ok(Message::Text(t)) => t.to_string(),
            other => panic!("not one text message: {other:?}"),
        }
    }

    #[test]
    fn server_frames_read_back_whole_empty_small_and_fragmented() {
        let big = "y".repeat(2 * FRAME_BYTES + 5);
        for text in ["", "hello", big.as_str()] {
            let mut out = Vec::new();
            server_frames(&mut out, text.as_bytes());
            assert_eq!(read_back(out), text, "{} bytes", text.len());
        }
    }
}
