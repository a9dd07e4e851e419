//! Cache affinity across relays (extension, feature [`FEATURE_AFFINITY_REPORTS`]).
//!
//! Each relay remembers which worker it sent which prompt prefixes (see
//! `server/dispatcher/affinity.rs`), but with several relays behind a load balancer a
//! conversation's next turn often reaches a relay that never saw the turn before. The
//! workers are the shared memory: a relay tells a worker the prefixes of the request it
//! is about to send, and the worker passes them on to its other relays, which remember
//! them as held by that worker. Nothing is shared between the relays themselves.
//!
//! One message type, `prefixes`, in both directions:
//!
//! * server → worker, just before a `request`: `{"type":"prefixes","model":"m",
//!   "prefixes":[...]}`, the fingerprints of that request's prompt;
//! * worker → every other relay: the same object, "I was sent these".
//!
//! A fingerprint is a 64-bit keyed hash of a prompt prefix (`server/fingerprint.rs`),
//! never text; the relays derive the key from the shared `WORKER_SECRET`, so the same
//! prompt has the same fingerprints on every relay. Compact: at most [`SENT_PREFIXES`]
//! per message (the longest first: the conversation so far, which its next turn
//! repeats; then the shortest: a system prompt many conversations share), and a reader
//! keeps at most [`MAX_PREFIXES`], whatever arrives.
//!
//! Opt-in: a worker serving several relays lists the feature in `register`; a server
//! that lists it back sends and reads `prefixes`. An original server never sees the
//! message (a worker sends it only to relays that acked) and an original worker is
//! never sent one.

use serde::{Deserialize, Deserializer, Serialize};

/// A worker serving several relays lists it; a server that lists it back sends the
/// `prefixes` of each request it dispatches there, and reads those the worker reports
/// from its other relays.
pub const FEATURE_AFFINITY_REPORTS: &str = "affinity_reports";
/// Fingerprints a server puts in one message.
pub const SENT_PREFIXES: usize = 4;
/// Fingerprints a reader keeps of one message (the rest is skipped unparsed).
pub const MAX_PREFIXES: usize = 8;

/// `prefixes`: the prompt-prefix fingerprints of a request for `model`, longest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct PrefixNote {
    pub model: String,
    pub prefixes: Vec<u64>,
}

impl PrefixNote {
    /// The note for a request's fingerprints (`prints`, shortest first as the relay
    /// computes them): the longest ones, then the shortest; `None` when there are none.
    pub fn of(model: &str, prints: &[u64]) -> Option<PrefixNote> {
        let (first, longest) = prints.split_first()?;
        let mut prefixes: Vec<u64> = longest
            .iter()
            .rev()
            .take(SENT_PREFIXES - 1)
            .copied()
            .collect();
        prefixes.push(*first);
        Some(PrefixNote {
            model: model.to_string(),
            prefixes,
        })
    }
}

/// A `prefixes` list as read: at most [`MAX_PREFIXES`] numbers kept, however long the
/// list is, so a hostile peer cannot make the reader hold more.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Bounded(pub Vec<u64>);

impl<'de> Deserialize<'de> for Bounded {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Bounded, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = Bounded;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a list of unsigned 64-bit fingerprints")
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Bounded, A::Error> {
                let mut kept = Vec::new();
                while kept.len() < MAX_PREFIXES {
                    match seq.next_element::<u64>()? {
                        Some(p) => kept.push(p),
                        None => return Ok(Bounded(kept)),
                    }
                }
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(Bounded(kept))
            }
        }
        d.deserialize_seq(Visit)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{to_json, ServerMessage, WorkerMessage};

    #[test]
    fn a_note_carries_the_longest_prefixes_then_the_shortest() {
        assert_eq!(PrefixNote::of("m", &[]), None);
        assert_eq!(PrefixNote::of("m", &[7]).map(|n| n.prefixes), Some(vec![7]));
        let note = PrefixNote::of("m", &[1, 2, 3, 4, 5, 6]).expect("note");
        assert_eq!(note.prefixes, vec![6, 5, 4, 1]);
    }

    #[test]
    fn both_directions_round_trip_and_a_long_list_is_cut() {
        let note = PrefixNote {
            model: "m".into(),
            prefixes: vec![u64::MAX, 1],
        };
        let text = to_json(&ServerMessage::Prefixes(note.clone()));
        assert_eq!(
            text,
            format!(
                r#"{{"type":"prefixes","model":"m","prefixes":[{},1]}}"#,
                u64::MAX
            )
        );
        assert_eq!(
            ServerMessage::parse(&text),
            Ok(ServerMessage::Prefixes(note.clone()))
        );
        let text = to_json(&WorkerMessage::Prefixes(note.clone()));
        assert_eq!(
            WorkerMessage::parse(&text),
            Ok(WorkerMessage::Prefixes(note))
        );
        let many: Vec<u64> = (0..10_000).collect();
        let text = serde_json::json!({"type": "prefixes", "model": "m", "prefixes": many});
        match WorkerMessage::parse(&text.to_string()) {
            Ok(WorkerMessage::Prefixes(n)) => assert_eq!(n.prefixes, (0..8).collect::<Vec<_>>()),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_malformed_note_is_an_error_not_a_crash() {
        for text in [
            r#"{"type":"prefixes","model":"m"}"#,
            r#"{"type":"prefixes","prefixes":[1]}"#,
            r#"{"type":"prefixes","model":"m","prefixes":[-1]}"#,
            r#"{"type":"prefixes","model":"m","prefixes":"x"}"#,
        ] {
            assert!(WorkerMessage::parse(text).is_err(), "{text}");
            assert!(ServerMessage::parse(text).is_err(), "{text}");
        }
    }
}
