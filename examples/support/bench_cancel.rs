//! The worker's cancel path, timed: `cancel` message -> backend socket closed.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crossbeam_channel::Receiver;
use tungstenite::Message;

use super::fake_backend::Observed;
use super::http_load::Samples;
use super::{WorkerProcess, MODEL};

/// Keeps only the "connection closed" observations (requests are counted elsewhere).
pub fn drain_requests(observed: Receiver<Observed>) -> Receiver<Duration> {
    let (tx, rx) = crossbeam_channel::unbounded();
    std::thread::spawn(move || {
        for o in observed {
            if let Observed::ClientClosed(_) = o {
                let _ = tx.send(Duration::ZERO);
            }
        }
    });
    rx
}

/// The worker's own cancel latency: a minimal in-process server registers the real
/// worker, dispatches a streaming request the backend holds open, sends `cancel`, and
/// times how long until the backend sees its connection closed.
pub fn cancel_latency(backend: SocketAddr, closed: &Receiver<Duration>, rounds: usize) -> Samples {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let worker = WorkerProcess::start(addr, backend, "1");
    let (stream, _) = listener.accept().expect("worker connects");
    stream.set_nodelay(true).ok();
    let mut ws = tungstenite::accept(stream).expect("upgrade");
    let _register = ws.read().expect("register");
    let ack = r#"{"type":"register_ack","worker_id":"w-bench","models":["bench"],"protocol_version":"1"}"#;
    ws.send(Message::text(ack)).expect("ack");
    let mut out = Vec::new();
    for i in 0..rounds {
        let id = format!("r-{i}");
        let body = format!(r#"{{\"model\":\"{MODEL}\",\"stream\":true,\"scenario\":\"hang\"}}"#);
        let req = format!(
            r#"{{"type":"request","request_id":"{id}","model":"{MODEL}","endpoint_path":"/v1/chat/completions","is_streaming":true,"body":"{body}"}}"#
        );
        ws.send(Message::text(req)).expect("request");
        // Wait for the first chunk: the backend is now holding the stream open.
        loop {
            let Ok(Message::Text(t)) = ws.read() else {
                continue;
            };
            if t.contains("response_chunk") {
                break;
            }
        }
        let cancel =
            format!(r#"{{"type":"cancel","request_id":"{id}","reason":"client_disconnect"}}"#);
        let t0 = Instant::now();
        ws.send(Message::text(cancel)).expect("cancel");
        closed
            .recv_timeout(Duration::from_secs(10))
            .expect("backend saw the close");
        out.push(t0.elapsed());
        // Consume the worker's note that the request is over.
        loop {
            let Ok(Message::Text(t)) = ws.read() else {
                continue;
            };
            if t.contains("\"error\"") || t.contains("response_complete") {
                break;
            }
        }
    }
    drop(worker);
    Samples(out)
}
