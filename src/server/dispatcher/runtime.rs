//! The dispatcher thread: receives [`Input`]s from the socket threads, feeds them to the
//! [`Dispatcher`] state machine with the real clock, and carries out its actions by
//! sending on the right channel. It sleeps until the next event or the nearest deadline;
//! there is no polling interval.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::{Receiver, RecvTimeoutError, Sender};
use log::debug;

use super::{Action, ClientEvent, Dispatcher, Event, RequestId, WorkerId};
use crate::protocol::{RegisterMessage, RequestMessage, ServerMessage};
use crate::server::shared::Shared;
use crate::ws::{close_code, Outgoing};

/// What a worker's writer thread is asked to put on the socket.
pub type Outbound = Outgoing<ServerMessage>;

/// Inputs from the socket threads: an [`Event`] plus the channels that go with it.
#[derive(Debug)]
pub enum Input {
    Submit {
        id: RequestId,
        msg: Arc<RequestMessage>,
        reply: Sender<ClientEvent>,
    },
    WorkerJoined {
        id: WorkerId,
        register: RegisterMessage,
        remote: String,
        outbound: Sender<Outbound>,
    },
    Event(Event),
}

/// Runs the dispatcher until it reports that shutdown is complete (or every input
/// sender is gone).
pub fn run(mut core: Dispatcher, inputs: Receiver<Input>, shared: Arc<Shared>) {
    let mut clients: HashMap<RequestId, Sender<ClientEvent>> = HashMap::new();
    let mut workers: HashMap<WorkerId, Sender<Outbound>> = HashMap::new();
    let mut models_version = u64::MAX;
    loop {
        let received = match core.next_deadline() {
            Some(at) => inputs.recv_deadline(at),
            None => inputs.recv().map_err(|_| RecvTimeoutError::Disconnected),
        };
        let now = Instant::now();
        let mut actions = match received {
            Ok(input) => {
                let event = route_input(input, &mut clients, &mut workers);
                core.handle(event, now)
            }
            Err(RecvTimeoutError::Timeout) => Vec::new(),
            Err(RecvTimeoutError::Disconnected) => return,
        };
        if core.next_deadline().is_some_and(|at| at <= now) {
            actions.extend(core.tick(now));
        }
        let exit = execute(actions, &mut clients, &mut workers);
        shared.publish(&core.gauges());
        if core.models_version() != models_version {
            models_version = core.models_version();
            shared.set_models(core.registry().routable_models());
        }
        if exit {
            return;
        }
    }
}

fn route_input(
    input: Input,
    clients: &mut HashMap<RequestId, Sender<ClientEvent>>,
    workers: &mut HashMap<WorkerId, Sender<Outbound>>,
) -> Event {
    match input {
        Input::Submit { id, msg, reply } => {
            clients.insert(id, reply);
            Event::Submit { id, msg }
        }
        Input::WorkerJoined {
            id,
            register,
            remote,
            outbound,
        } => {
            workers.insert(id, outbound);
            Event::WorkerJoined {
                id,
                register,
                remote,
            }
        }
        Input::Event(event) => {
            if let Event::WorkerLeft { id, .. } = &event {
                workers.remove(id);
            }
            event
        }
    }
}

/// Carries out actions; returns true when the process should exit.
fn execute(
    actions: Vec<Action>,
    clients: &mut HashMap<RequestId, Sender<ClientEvent>>,
    workers: &mut HashMap<WorkerId, Sender<Outbound>>,
) -> bool {
    let mut exit = false;
    for action in actions {
        match action {
            Action::ToWorker(id, msg) => {
                if let Some(tx) = workers.get(&id) {
                    // A closed channel means the socket is going away; its WorkerLeft
                    // event is already on its way to us.
                    let _ = tx.send(Outgoing::Message(msg));
                }
            }
            Action::CloseWorker(id, reason) => {
                if let Some(tx) = workers.remove(&id) {
                    let _ = tx.send(Outgoing::Close(close_code_for(&reason), reason));
                }
            }
            Action::ToClient(id, event) => {
                let delivered = if event.is_final() {
                    clients.remove(&id).map(|tx| tx.send(event).is_ok())
                } else {
                    clients.get(&id).map(|tx| tx.send(event).is_ok())
                };
                if delivered != Some(true) {
                    debug!("client of request {id} is gone; event dropped");
                }
            }
            Action::Exit => exit = true,
        }
    }
    exit
}

fn close_code_for(reason: &str) -> u16 {
    if reason.contains("protocol") {
        close_code::PROTOCOL
    } else if reason == "drained" {
        close_code::NORMAL
    } else {
        close_code::GOING_AWAY
    }
}
