//! A request body relayed in pieces (`protocol::pieces`): read from the client a piece
//! at a time as the worker grants credit, never whole. The first part was read before
//! submission (it names the model of a form); it goes first. A client that breaks off
//! or sends a body the limits refuse cancels the request on the worker, which cancels
//! it on the backend.

use std::sync::Arc;

use crossbeam_channel::Receiver;
use log::debug;

use super::Session;
use crate::protocol::binary;
use crate::protocol::pieces::{FEATURE_BODY_PIECES, PIECE_BYTES};
use crate::protocol::RequestMessage;
use crate::server::dispatcher::runtime::Input;
use crate::server::dispatcher::{ClientEvent, Event, Failure, Needs, Who};
use crate::server::fingerprint::Fingerprints;
use crate::server::http::pieces::{refusal, BodyStream};
use crate::server::http::request::ReadError;

/// The body still to send.
pub(super) struct Upload {
    stream: BodyStream,
    /// What was read before submission and not sent yet.
    first: Vec<u8>,
    /// The next piece's number.
    next: u64,
    /// The last piece went out.
    sent_all: bool,
    /// The request as submitted, with whom and what for: to send it again with its
    /// body whole when no worker takes pieces ([`Session::whole_instead`]).
    submitted: Option<(Arc<RequestMessage>, Who, Needs)>,
}

impl Upload {
    pub(super) fn new(stream: BodyStream, first: Vec<u8>) -> Upload {
        Upload {
            stream,
            first,
            next: 0,
            sent_all: false,
            submitted: None,
        }
    }

    /// Remembers the submission (see [`Upload::submitted`]).
    pub(super) fn submitted(&mut self, msg: Arc<RequestMessage>, who: Who, needs: Needs) {
        self.submitted = Some((msg, who, needs));
    }

    /// The next piece and whether it is the last.
    fn piece(
        &mut self,
        conn: &mut crate::server::http::request::Conn,
    ) -> Result<(Vec<u8>, bool), ReadError> {
        let mut data = if self.first.is_empty() {
            Vec::new()
        } else {
            let n = self.first.len().min(PIECE_BYTES);
            let rest = self.first.split_off(n);
            std::mem::replace(&mut self.first, rest)
        };
        if data.len() < PIECE_BYTES {
            let want = PIECE_BYTES - data.len();
            self.stream.read_into(conn, &mut data, want)?;
        }
        Ok((data, self.first.is_empty() && self.stream.is_done()))
    }
}

impl Session<'_, '_> {
    /// Sends pieces up to the worker's credit `until`. `Err(outcome)`: the upload broke
    /// off and the request is over (cancelled, the client told when it can hear).
    pub(super) fn send_pieces(&mut self, until: u64) -> Result<(), &'static str> {
        let Some(mut upload) = self.upload.take() else {
            return Ok(());
        };
        while upload.next < until && !upload.sent_all {
            let (data, last) = match upload.piece(self.conn) {
                Ok(piece) => piece,
                Err(e) => return Err(self.upload_broke(&e)),
            };
            let piece = Event::BodyPiece {
                id: self.id,
                seq: upload.next,
                chunk: binary::encode(&data),
                last,
            };
            if self.ctx.inputs.send(Input::Event(piece)).is_err() {
                return Err("server_shutting_down");
            }
            upload.next += 1;
            upload.sent_all = last;
        }
        if !upload.sent_all {
            self.upload = Some(upload);
        }
        Ok(())
    }

    /// A request no worker takes in pieces (an older worker) goes again with its body
    /// whole, read now, when it has a length and fits one message once encoded, as it
    /// would have before pieces existed. `None`: `event` stands (the client gets the
    /// clear `body_pieces_unsupported`); `Some(Err)`: the body broke off meanwhile.
    pub(super) fn whole_instead(
        &mut self,
        event: &ClientEvent,
    ) -> Option<Result<Receiver<ClientEvent>, &'static str>> {
        let ClientEvent::Failed(Failure::UnsupportedCapability { capability, .. }) = event else {
            return None;
        };
        if *capability != FEATURE_BODY_PIECES {
            return None;
        }
        let upload = self.upload.as_mut().filter(|u| u.next == 0)?;
        let len = upload.stream.length()?;
        let (msg, who, needs) = upload.submitted.take()?;
        let max = self.ctx.cfg.max_ws_message_bytes;
        if binary::encoded_len(len).saturating_add(msg.wire_len()) > max {
            return None;
        }
        let mut body = std::mem::take(&mut upload.first);
        let left = len.saturating_sub(upload.stream.read_so_far());
        if let Err(e) = upload.stream.read_into(self.conn, &mut body, left) {
            self.upload = None;
            return Some(Err(self.upload_broke(&e)));
        }
        self.upload = None;
        let mut whole = (*msg).clone();
        whole.body = Arc::from(binary::encode(&body));
        drop(body);
        whole.body_encoding = Some(binary::BASE64.to_string());
        whole.headers.remove("content-length");
        debug!(
            "request {}: no worker takes pieces; its {len} bytes go whole",
            self.wire
        );
        let (reply, events) = crossbeam_channel::unbounded();
        let submit = Input::Submit {
            id: self.id,
            msg: Arc::new(whole),
            who,
            needs: Needs {
                pieces: false,
                ..needs
            },
            prints: Fingerprints::None,
            progress: false,
            reply: reply.into(),
            continuable: false,
        };
        if self.ctx.inputs.send(submit).is_err() {
            return None;
        }
        Some(Ok(events))
    }

    fn upload_broke(&mut self, e: &ReadError) -> &'static str {
        let _ = self
            .ctx
            .inputs
            .send(Input::Event(Event::ClientGone(self.id)));
        self.keep_alive = false;
        match refusal(e) {
            Some(api) => {
                debug!(
                    "request {}: body refused midway: {}",
                    self.wire, api.message
                );
                self.status = api.status;
                let wire = self.wire.clone();
                crate::server::reply::write_error(self.conn, self.style, &api, false, Some(&wire));
                "body_refused"
            }
            None => {
                debug!("request {}: client broke off its upload", self.wire);
                self.status = 499;
                "client_disconnect"
            }
        }
    }
}
