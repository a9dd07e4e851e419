//! A resume of a stream this relay does not hold: its relay died (or a balancer sent
//! the client here), and a worker connected to both relays may hold it
//! ([`crate::protocol::held`]). The dispatcher asks the workers that hold streams
//! ([`Event::Attach`]); the one that holds it sends the events after the client's last
//! one, numbered as the first relay numbered them, then the rest live. Written as they
//! come; nothing is kept here (a client that drops again resumes the same way).

use std::io::Write;
use std::time::{Duration, Instant};

use crossbeam_channel::RecvTimeoutError;
use log::info;

use super::held::unknown;
use super::Owner;
use crate::protocol::held::{Attach, NOT_HELD};
use crate::server::dispatcher::runtime::Input;
use crate::server::dispatcher::{wire_request_id, ClientEvent, Event, Failure};
use crate::server::errors::{ApiError, Style};
use crate::server::http::request::{Conn, Request};
use crate::server::http::response::{self, Framing};
use crate::server::relay::HANGUP_CHECK;
use crate::server::reply::write_error;
use crate::server::Ctx;

/// How long the workers may take to say whether they hold the stream.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Serves the resume of stream `id` after event `last`; returns whether the
/// connection may be reused.
pub fn serve(
    conn: &mut Conn,
    ctx: &Ctx,
    req: &Request,
    id: &str,
    last: u64,
    owner: &Owner,
    token: &str,
) -> bool {
    let keep = req.keep_alive;
    let rid = ctx.next_request_id();
    let msg = Attach {
        request_id: wire_request_id(rid),
        stream_id: id.to_string(),
        after: last,
        proof: owner.proof(token),
    };
    let (reply, events) = crossbeam_channel::unbounded();
    if ctx
        .inputs
        .send(Input::Attach {
            id: rid,
            msg,
            reply,
        })
        .is_err()
    {
        return write_error(conn, Style::OpenAi, &unknown(), keep, None);
    }
    let gone = || {
        let _ = ctx.inputs.send(Input::Event(Event::ClientGone(rid)));
    };
    let framing = if req.http10 {
        Framing::UntilClose
    } else {
        Framing::Chunked
    };
    let started = Instant::now();
    let mut opened = false;
    loop {
        let event = match events.recv_timeout(HANGUP_CHECK) {
            Ok(event) => event,
            Err(RecvTimeoutError::Timeout) => {
                if !opened && started.elapsed() >= ANSWER_WAIT {
                    gone();
                    return write_error(conn, Style::OpenAi, &unknown(), keep, Some(id));
                }
                if opened && conn.stream.peer_closed() {
                    gone();
                    return false;
                }
                continue;
            }
            Err(RecvTimeoutError::Disconnected) => return false,
        };
        let mut buf = Vec::new();
        if !opened && matches!(event, ClientEvent::Chunk(_) | ClientEvent::Head(_)) {
            info!("request {id}: resumed after event {last} from a worker's copy");
            let headers = [
                ("content-type", "text/event-stream"),
                ("cache-control", "no-cache"),
                ("x-request-id", id),
            ];
            buf = response::head(200, &headers, framing, keep);
            opened = true;
        }
        match event {
            ClientEvent::Chunk(text) => response::push_chunk(&mut buf, text.as_bytes(), framing),
            ClientEvent::Head(_) => {}
            ClientEvent::Complete(_) if !opened => {
                // The client has the whole answer.
                let head = response::head(204, &[("x-request-id", id)], Framing::Length(0), keep);
                return conn.stream.write_all(&head).is_ok() && keep;
            }
            ClientEvent::Complete(_) => {
                response::push_end(&mut buf, framing);
                let ok = conn.stream.write_all(&buf).is_ok();
                return ok && keep && framing != Framing::UntilClose;
            }
            ClientEvent::Failed(f) => {
                let e = refusal(&f);
                if !opened {
                    return write_error(conn, Style::OpenAi, &e, keep, Some(id));
                }
                response::push_chunk(&mut buf, e.sse_event(Style::OpenAi).as_bytes(), framing);
                response::push_end(&mut buf, framing);
                let _ = conn.stream.write_all(&buf);
                return false;
            }
            _ => continue,
        }
        if conn.stream.write_all(&buf).is_err() {
            gone();
            return false;
        }
    }
}

/// The client's answer for a failed attach: the worker's resume codes as the relay's
/// own; a stream no worker holds is unknown, as here.
fn refusal(f: &Failure) -> ApiError {
    match f {
        Failure::WorkerError {
            status,
            code,
            message,
        } if code != NOT_HELD => ApiError::new(status.unwrap_or(502), code, message.clone()),
        Failure::WorkerError { .. } => unknown(),
        other => ApiError::from_failure_for(other, 0, Style::OpenAi),
    }
}
