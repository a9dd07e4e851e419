//! The power extension: sleeping boxes woken on demand, idle boxes that ask to sleep.
//!
//! ```text
//! worker → server  "register" gains {"wake": {"mac": "aa:bb:cc:dd:ee:ff",
//!                   "broadcast": "192.168.1.255:9"}}: where a magic packet wakes this
//!                   box. With it, the server remembers the box as asleep when it leaves.
//! both             feature "wake_peers": the worker sends magic packets for the server.
//! server → worker  {"type":"wake_peer","worker_name":"gpu-box-2",
//!                   "mac":"aa:bb:cc:dd:ee:ff","broadcast":"192.168.1.255:9"}
//! both             feature "sleep": the worker asks before it suspends.
//! worker → server  {"type":"sleep_request"}
//! server → worker  {"type":"sleep_answer","granted":true}
//!                  {"type":"sleep_answer","granted":false,"reason":"requests queued for qwen3:8b"}
//! both             feature "owner_yield": the worker says when the box's owner uses it.
//! worker → server  {"type":"owner_status","busy":true}   (takes nothing new meanwhile)
//!                  {"type":"owner_status","busy":false}  (takes work again)
//! ```
//!
//! A granted worker gets no new requests, finishes what it has, disconnects and
//! suspends. Unknown to an original peer: the fields are ignored, the types never sent.

use crate::power::WakeAddress;

/// Both sides: the server may ask this worker to send magic packets (`wake_peer`).
pub const FEATURE_WAKE_PEERS: &str = "wake_peers";
/// Both sides: `sleep_request` / `sleep_answer` are understood.
pub const FEATURE_SLEEP: &str = "sleep";
/// Both sides: `owner_status` is understood.
pub const FEATURE_OWNER_YIELD: &str = "owner_yield";

/// Reads `register.wake` leniently: anything but a valid MAC and address is absent.
pub(super) fn wake_from(value: Option<serde_json::Value>) -> Option<WakeAddress> {
    let value = value?;
    let mac = value.get("mac")?.as_str()?;
    let broadcast = value.get("broadcast")?.as_str()?;
    WakeAddress::parse(mac, broadcast)
}

#[cfg(test)]
mod tests {
    use crate::protocol::{to_json, RegisterMessage, ServerMessage, WorkerMessage};

    #[test]
    fn the_power_messages_round_trip_and_bad_wake_addresses_are_dropped() {
        let text = r#"{"type":"register","worker_name":"gpu","models":["m"],"max_concurrent":1,"wake":{"mac":"AA:BB:CC:DD:EE:FF","broadcast":"192.168.1.255"}}"#;
        let Ok(WorkerMessage::Register(RegisterMessage { wake: Some(w), .. })) =
            WorkerMessage::parse(text)
        else {
            panic!("wake address not read");
        };
        assert_eq!(
            (w.mac.as_str(), w.broadcast.as_str()),
            ("aa:bb:cc:dd:ee:ff", "192.168.1.255:9")
        );
        for bad in [
            r#""wake":"x""#,
            r#""wake":{"mac":"zz","broadcast":"1.2.3.4"}"#,
        ] {
            let text = format!(r#"{{"type":"register","models":[],"max_concurrent":1,{bad}}}"#);
            let Ok(WorkerMessage::Register(r)) = WorkerMessage::parse(&text) else {
                panic!("register lost for a bad wake field");
            };
            assert_eq!(r.wake, None);
        }
        let peer = ServerMessage::WakePeer {
            worker_name: "gpu".into(),
            mac: "aa:bb:cc:dd:ee:ff".into(),
            broadcast: "192.168.1.255:9".into(),
        };
        let json = to_json(&peer);
        assert_eq!(
            json,
            r#"{"type":"wake_peer","worker_name":"gpu","mac":"aa:bb:cc:dd:ee:ff","broadcast":"192.168.1.255:9"}"#
        );
        assert_eq!(ServerMessage::parse(&json), Ok(peer));
        let answer = ServerMessage::SleepAnswer {
            granted: false,
            reason: Some("busy".into()),
        };
        let json = to_json(&answer);
        assert_eq!(
            json,
            r#"{"type":"sleep_answer","granted":false,"reason":"busy"}"#
        );
        assert_eq!(ServerMessage::parse(&json), Ok(answer));
        assert_eq!(
            to_json(&WorkerMessage::SleepRequest {}),
            r#"{"type":"sleep_request"}"#
        );
        assert_eq!(
            WorkerMessage::parse(r#"{"type":"sleep_request"}"#),
            Ok(WorkerMessage::SleepRequest {})
        );
    }
}
