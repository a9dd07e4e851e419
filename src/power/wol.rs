//! Wake-on-LAN: a box's wake address and the magic packet that wakes it.
//!
//! The packet is 6 bytes of `0xFF` followed by the target's MAC address 16 times, sent
//! as one UDP datagram to the LAN's broadcast address (port 9, "discard", by custom).
//! A NIC armed for WoL (`ethtool -s eth0 wol g`) powers the box on when it sees it.

use std::net::{SocketAddr, UdpSocket};

use serde::{Deserialize, Serialize};

/// Longest broadcast address text kept (`[ffff:...]:65535` fits with room).
const MAX_ADDR_LEN: usize = 64;
/// The port a broadcast address without one is sent to.
pub const DEFAULT_PORT: u16 = 9;

/// Where a sleeping box is woken: its MAC address (lower-case `aa:bb:cc:dd:ee:ff`) and
/// the broadcast address of its LAN (`192.168.1.255:9`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WakeAddress {
    pub mac: String,
    pub broadcast: String,
}

impl WakeAddress {
    /// A validated wake address from untrusted text: a MAC of six hex bytes and a
    /// socket address (or bare IP, given port 9). `None` for anything else.
    pub fn parse(mac: &str, broadcast: &str) -> Option<WakeAddress> {
        let bytes = parse_mac(mac)?;
        let target = parse_target(broadcast)?;
        Some(WakeAddress {
            mac: format_mac(&bytes),
            broadcast: target.to_string(),
        })
    }

    /// The datagram's destination.
    pub fn target(&self) -> Option<SocketAddr> {
        parse_target(&self.broadcast)
    }
}

/// Six bytes from `aa:bb:cc:dd:ee:ff` or `aa-bb-cc-dd-ee-ff` (either case).
pub fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let text = text.trim();
    if text.len() != 17 {
        return None;
    }
    let mut out = [0u8; 6];
    let mut parts = text.split([':', '-']);
    for byte in &mut out {
        let part = parts.next()?;
        if part.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(part, 16).ok()?;
    }
    // All zeros is the loopback interface's "address": no NIC answers to it.
    (parts.next().is_none() && out != [0; 6]).then_some(out)
}

fn format_mac(bytes: &[u8; 6]) -> String {
    bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

fn parse_target(text: &str) -> Option<SocketAddr> {
    let text = text.trim();
    if text.is_empty() || text.len() > MAX_ADDR_LEN {
        return None;
    }
    text.parse::<SocketAddr>().ok().or_else(|| {
        text.parse::<std::net::IpAddr>()
            .ok()
            .map(|ip| SocketAddr::new(ip, DEFAULT_PORT))
    })
}

/// The 102-byte magic packet for `mac`.
pub fn magic_packet(mac: &[u8; 6]) -> [u8; 102] {
    let mut packet = [0xFFu8; 102];
    for chunk in packet[6..].chunks_mut(6) {
        chunk.copy_from_slice(mac);
    }
    packet
}

/// Sends the magic packet for `wake` once (callers repeat it if they want to: UDP may
/// drop it). Errors are returned as text for the log line.
pub fn send_magic_packet(wake: &WakeAddress) -> Result<(), String> {
    let mac = parse_mac(&wake.mac).ok_or_else(|| format!("bad MAC address {:?}", wake.mac))?;
    let target = wake
        .target()
        .ok_or_else(|| format!("bad broadcast address {:?}", wake.broadcast))?;
    let bind: SocketAddr = if target.is_ipv4() {
        ([0, 0, 0, 0], 0).into()
    } else {
        (std::net::Ipv6Addr::UNSPECIFIED, 0).into()
    };
    let socket = UdpSocket::bind(bind).map_err(|e| format!("cannot open UDP socket: {e}"))?;
    socket
        .set_broadcast(true)
        .map_err(|e| format!("cannot enable broadcast: {e}"))?;
    socket
        .send_to(&magic_packet(&mac), target)
        .map_err(|e| format!("cannot send to {target}: {e}"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn macs_are_six_hex_bytes_and_never_all_zero() {
        assert_eq!(
            parse_mac("AA-bb-0c-dd-ee-01"),
            Some([0xaa, 0xbb, 0x0c, 0xdd, 0xee, 0x01])
        );
        for bad in [
            "",
            "aa:bb:cc:dd:ee",
            "aa:bb:cc:dd:ee:ff:00",
            "aa:bb:cc:dd:ee:gg",
            "aaa:b:cc:dd:ee:ff",
            "00:00:00:00:00:00",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn addresses_are_normalized_and_bounded() {
        let w = WakeAddress::parse("AA:BB:CC:DD:EE:FF", "192.168.1.255").unwrap();
        assert_eq!(w.mac, "aa:bb:cc:dd:ee:ff");
        assert_eq!(w.broadcast, "192.168.1.255:9");
        assert_eq!(
            WakeAddress::parse("aa:bb:cc:dd:ee:ff", "127.0.0.1:4000")
                .unwrap()
                .broadcast,
            "127.0.0.1:4000"
        );
        assert!(WakeAddress::parse("aa:bb:cc:dd:ee:ff", "lan").is_none());
        assert!(WakeAddress::parse("aa:bb:cc:dd:ee:ff", &"1".repeat(100)).is_none());
    }

    #[test]
    fn the_packet_is_six_ff_then_the_mac_sixteen_times_over_udp() {
        let listener = UdpSocket::bind("127.0.0.1:0").unwrap();
        let wake = WakeAddress::parse(
            "01:02:03:04:05:06",
            &listener.local_addr().unwrap().to_string(),
        )
        .unwrap();
        send_magic_packet(&wake).unwrap();
        let mut buf = [0u8; 200];
        let (n, _) = listener.recv_from(&mut buf).unwrap();
        assert_eq!(n, 102);
        assert_eq!(&buf[..6], &[0xFF; 6]);
        for i in 0..16 {
            assert_eq!(&buf[6 + 6 * i..12 + 6 * i], &[1, 2, 3, 4, 5, 6]);
        }
    }
}
