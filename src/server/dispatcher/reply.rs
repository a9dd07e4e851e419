//! Where the dispatcher thread sends a request's events: the relaying thread's channel,
//! or an [`Answerer`] that acts on them without waking that thread. The second is how a
//! whole answer reaches its client from a thread that is awake already
//! (`server/relay/direct.rs`): while its request runs on a worker, the answerer is lent
//! to that worker's socket ([`WorkerLink`](crate::server::worker_link::WorkerLink)), whose
//! reader thread writes the worker's complete answer the moment it arrives. Only the
//! runtime sees any of this: the state machine names clients by request id alone.

use std::sync::Arc;
use std::time::Instant;

use crossbeam_channel::Sender;
use parking_lot::Mutex;

use super::ids::IdMap;
use super::{ClientEvent, RequestId, WorkerId};
use crate::protocol::ResponseComplete;
use crate::server::worker_link::WorkerLink;

/// Takes a request's events on the dispatcher thread, or its answer on a worker socket's
/// reader thread. It must never block either: a socket it writes to is written without
/// waiting, and anything that would wait goes to the connection thread, which may.
pub trait Answerer: Send {
    /// One event; false when its client is gone (the event was not delivered).
    fn deliver(&mut self, event: ClientEvent) -> bool;
    /// The request went to the worker named `worker`, at `at`.
    fn dispatched(&mut self, worker: &str, at: Instant);
    /// The worker's complete answer, on its socket's reader thread. The dispatcher's own
    /// `Complete` for it then finds the answerer gone and is dropped.
    fn answer(&mut self, rc: &ResponseComplete);
}

/// A request's event sink, as its connection thread chose it.
pub enum Reply {
    Channel(Sender<ClientEvent>),
    Direct(Box<dyn Answerer>),
    /// The answerer is lent to this worker's socket.
    Lent(WorkerId),
}

impl Reply {
    /// Hands one event on; false when its client is gone. Not for [`Reply::Lent`]: the
    /// runtime takes the answerer back first.
    pub(super) fn send(&mut self, event: ClientEvent) -> bool {
        match self {
            Reply::Channel(tx) => tx.send(event).is_ok(),
            Reply::Direct(answerer) => answerer.deliver(event),
            Reply::Lent(_) => false,
        }
    }
}

impl From<Sender<ClientEvent>> for Reply {
    fn from(tx: Sender<ClientEvent>) -> Reply {
        Reply::Channel(tx)
    }
}

impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reply::Channel(_) => f.write_str("Reply::Channel"),
            Reply::Direct(_) => f.write_str("Reply::Direct"),
            Reply::Lent(w) => write!(f, "Reply::Lent(w-{w})"),
        }
    }
}

/// The answerers lent to one worker socket, by request. The dispatcher thread lends and
/// takes back; the socket's reader thread takes one to write its answer. Whoever takes
/// an answerer owns it, so an answer is written once, by one of them.
#[derive(Default)]
pub struct Lent(Mutex<IdMap<Loan>>);

struct Loan {
    answerer: Box<dyn Answerer>,
    /// The worker sent something else for the request first (a chunk, a head, an
    /// error), which the dispatcher has not acted on yet: the answer is its to give.
    spoiled: bool,
}

impl Lent {
    pub fn lend(&self, id: RequestId, answerer: Box<dyn Answerer>) {
        let loan = Loan {
            answerer,
            spoiled: false,
        };
        self.0.lock().insert(id, loan);
    }

    /// Takes one back; `None` when the reader took it (or it was never lent here).
    pub fn take(&self, id: RequestId) -> Option<Box<dyn Answerer>> {
        self.0.lock().remove(&id).map(|loan| loan.answerer)
    }

    /// The reader's take, for a complete answer: `None` also when the request was spoiled.
    pub fn take_for_answer(&self, id: RequestId) -> Option<Box<dyn Answerer>> {
        let mut loans = self.0.lock();
        if loans.get(&id)?.spoiled {
            return None;
        }
        loans.remove(&id).map(|loan| loan.answerer)
    }

    /// The worker sent another message for the request: the reader may not answer it.
    pub fn spoil(&self, id: RequestId) {
        if let Some(loan) = self.0.lock().get_mut(&id) {
            loan.spoiled = true;
        }
    }

    /// Takes every one back (the socket is gone; its requests go elsewhere).
    pub fn take_all(&self) -> Vec<(RequestId, Box<dyn Answerer>)> {
        let loans = self.0.lock().drain().collect::<Vec<_>>();
        loans.into_iter().map(|(id, l)| (id, l.answerer)).collect()
    }
}

/// A request going to `worker`: its direct answerer, if it has one, is lent to that
/// socket, whose reader then writes the answer. One lent to another socket is taken
/// back first (a requeue); when that socket's reader already wrote the answer, nobody is
/// left to tell anything. `dispatch`: the worker's name and when it was sent there.
pub(super) fn lend(
    clients: &mut IdMap<Reply>,
    links: &IdMap<Arc<WorkerLink>>,
    worker: WorkerId,
    wire: &str,
    dispatch: (&str, Instant),
) {
    let Some(id) = super::parse_request_id(wire) else {
        return;
    };
    if !take_back(clients, links, id) {
        clients.remove(&id);
        return;
    }
    let (Some(link), Some(Reply::Direct(_))) = (links.get(&worker), clients.get(&id)) else {
        return;
    };
    if let Some(Reply::Direct(mut answerer)) = clients.insert(id, Reply::Lent(worker)) {
        answerer.dispatched(dispatch.0, dispatch.1);
        link.answers.lend(id, answerer);
    }
}

/// Takes a lent answerer back from its socket; false when that socket's reader has it
/// (it wrote the answer).
pub(super) fn take_back(
    clients: &mut IdMap<Reply>,
    links: &IdMap<Arc<WorkerLink>>,
    id: RequestId,
) -> bool {
    let Some(Reply::Lent(worker)) = clients.get(&id) else {
        return true;
    };
    match links.get(worker).and_then(|link| link.answers.take(id)) {
        Some(answerer) => {
            clients.insert(id, Reply::Direct(answerer));
            true
        }
        None => false,
    }
}

/// Takes back everything lent to a socket that is going away.
pub(super) fn take_back_all(clients: &mut IdMap<Reply>, link: &WorkerLink) {
    for (id, answerer) in link.answers.take_all() {
        clients.insert(id, Reply::Direct(answerer));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Counting(usize);

    impl Answerer for Counting {
        fn deliver(&mut self, _event: ClientEvent) -> bool {
            self.0 += 1;
            self.0 < 2
        }
        fn dispatched(&mut self, _worker: &str, _at: Instant) {}
        fn answer(&mut self, _rc: &ResponseComplete) {}
    }

    #[test]
    fn a_lent_answerer_is_taken_once() {
        let lent = Lent::default();
        lent.lend(1, Box::new(Counting(0)));
        lent.lend(2, Box::new(Counting(0)));
        assert!(lent.take_for_answer(1).is_some());
        assert!(lent.take(1).is_none(), "taken twice");
        lent.lend(3, Box::new(Counting(0)));
        lent.spoil(3);
        assert!(
            lent.take_for_answer(3).is_none(),
            "a spoiled loan is not answered"
        );
        assert!(lent.take(3).is_some(), "but it is taken back");
        let rest = lent.take_all();
        assert_eq!(rest.len(), 1);
        assert_eq!(rest[0].0, 2);
        assert!(lent.take(2).is_none());
    }

    fn link() -> Arc<WorkerLink> {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let ours = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        Arc::new(WorkerLink::new(crate::net::Stream::plain(ours), false))
    }

    #[test]
    fn a_direct_answerer_is_lent_taken_back_and_lost_to_the_reader() {
        let id: RequestId = 7;
        let wire = super::super::wire_request_id(id);
        let links: IdMap<Arc<WorkerLink>> = [(1, link()), (2, link())].into_iter().collect();
        let mut clients = IdMap::default();
        clients.insert(id, Reply::Direct(Box::new(Counting(0))));
        lend(&mut clients, &links, 1, &wire, ("w1", Instant::now()));
        assert!(matches!(clients.get(&id), Some(Reply::Lent(1))));
        // A requeue to worker 2 takes it back from worker 1's socket first.
        lend(&mut clients, &links, 2, &wire, ("w2", Instant::now()));
        assert!(matches!(clients.get(&id), Some(Reply::Lent(2))));
        assert!(links[&1].answers.take(id).is_none());
        // Worker 2's reader answers: the dispatcher's later events find nobody.
        assert!(links[&2].answers.take_for_answer(id).is_some());
        assert!(!take_back(&mut clients, &links, id));
        // A channel reply is never lent.
        let (tx, _rx) = crossbeam_channel::unbounded();
        clients.insert(id, Reply::from(tx));
        lend(&mut clients, &links, 1, &wire, ("w1", Instant::now()));
        assert!(matches!(clients.get(&id), Some(Reply::Channel(_))));
        assert!(take_back(&mut clients, &links, id));
    }

    #[test]
    fn a_socket_going_away_gives_back_all_it_was_lent() {
        let links: IdMap<Arc<WorkerLink>> = [(1, link())].into_iter().collect();
        let mut clients = IdMap::default();
        for id in [3, 4] {
            clients.insert(id, Reply::Direct(Box::new(Counting(0))));
            let wire = super::super::wire_request_id(id);
            lend(&mut clients, &links, 1, &wire, ("w1", Instant::now()));
        }
        take_back_all(&mut clients, &links[&1]);
        assert!(clients.values().all(|r| matches!(r, Reply::Direct(_))));
    }

    #[test]
    fn a_channel_reports_a_receiver_that_is_gone() {
        let (tx, rx) = crossbeam_channel::unbounded();
        let mut reply = Reply::from(tx);
        assert!(reply.send(ClientEvent::Interrupted));
        assert!(matches!(rx.try_recv(), Ok(ClientEvent::Interrupted)));
        drop(rx);
        assert!(!reply.send(ClientEvent::Interrupted));
    }

    #[test]
    fn an_answerer_takes_the_events_and_says_whether_its_client_is_there() {
        let mut reply = Reply::Direct(Box::new(Counting(0)));
        assert!(reply.send(ClientEvent::Interrupted));
        assert!(!reply.send(ClientEvent::Interrupted));
        assert_eq!(format!("{reply:?}"), "Reply::Direct");
        assert_eq!(format!("{:?}", Reply::Lent(3)), "Reply::Lent(w-3)");
    }
}
