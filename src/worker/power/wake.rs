//! Where this box is woken: the MAC address and LAN broadcast address of the interface
//! that routes to the relay (Linux: `/proc/net/route` and `/sys/class/net`), unless
//! `WAKE_MAC` / `WAKE_BROADCAST` say otherwise. Also sends magic packets for the relay
//! (`wake_peer`), to wake another box on this LAN.

use std::net::{Ipv4Addr, UdpSocket};

use log::{info, warn};

use super::PowerConfig;
use crate::power::WakeAddress;

/// The wake address to advertise in `register`, if this worker is wakeable.
pub fn address(cfg: &PowerConfig, connect_url: &str) -> Option<WakeAddress> {
    if !cfg.wakeable {
        return None;
    }
    let detected = detect(connect_url);
    let mac = cfg
        .mac
        .clone()
        .or_else(|| detected.as_ref().map(|d| d.0.clone()));
    let broadcast = cfg
        .broadcast
        .clone()
        .or_else(|| detected.as_ref().map(|d| d.1.to_string()));
    match (mac, broadcast) {
        (Some(mac), Some(broadcast)) => {
            let wake = WakeAddress::parse(&mac, &broadcast);
            if wake.is_none() {
                warn!("WAKE_ON_LAN: unusable wake address {mac} via {broadcast}; not wakeable");
            }
            wake
        }
        _ => {
            warn!("WAKE_ON_LAN: cannot tell this box's MAC and broadcast address; set WAKE_MAC and WAKE_BROADCAST");
            None
        }
    }
}

/// (MAC, broadcast IP) of the interface that routes to the relay.
fn detect(connect_url: &str) -> Option<(String, Ipv4Addr)> {
    let host = connect_url.split("://").nth(1)?.split('/').next()?;
    let socket = UdpSocket::bind("0.0.0.0:0").ok()?;
    let with_port = if host.contains(':') {
        host.to_string()
    } else {
        format!("{host}:80")
    };
    socket.connect(with_port).ok()?;
    let std::net::IpAddr::V4(local) = socket.local_addr().ok()?.ip() else {
        return None;
    };
    let routes = std::fs::read_to_string("/proc/net/route").ok()?;
    let (iface, mask) = lan_route(&routes, local)?;
    let mac = std::fs::read_to_string(format!("/sys/class/net/{iface}/address")).ok()?;
    Some((mac.trim().to_string(), broadcast(local, mask)))
}

/// The directly connected route (no gateway) holding `local`, longest mask first:
/// (interface, netmask).
pub fn lan_route(table: &str, local: Ipv4Addr) -> Option<(String, Ipv4Addr)> {
    let hex = |h: &str| {
        u32::from_str_radix(h, 16)
            .ok()
            .map(|x| Ipv4Addr::from(x.to_ne_bytes()))
    };
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            let (dest, gateway, mask) = (hex(f.get(1)?)?, hex(f.get(2)?)?, hex(f.get(7)?)?);
            let inside = u32::from(local) & u32::from(mask) == u32::from(dest);
            (gateway.is_unspecified() && inside && !mask.is_unspecified())
                .then(|| (f[0].to_string(), mask))
        })
        .max_by_key(|(_, mask)| u32::from(*mask).count_ones())
}

pub fn broadcast(local: Ipv4Addr, mask: Ipv4Addr) -> Ipv4Addr {
    Ipv4Addr::from(u32::from(local) | !u32::from(mask))
}

/// The relay asks this worker to wake another box (`wake_peer`).
pub fn wake_peer(name: &str, mac: &str, broadcast: &str) {
    let name: String = name.chars().take(64).filter(|c| !c.is_control()).collect();
    let Some(wake) = WakeAddress::parse(mac, broadcast) else {
        warn!("relay asked to wake `{name}` at an unusable address; ignored");
        return;
    };
    match crate::power::send_magic_packet(&wake) {
        Ok(()) => info!("magic packet for `{name}` sent to {}", wake.broadcast),
        Err(e) => warn!("cannot wake `{name}`: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TABLE: &str =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT
eth0\t00000000\t0101A8C0\t0003\t0\t0\t100\t00000000\t0\t0\t0
eth0\t0001A8C0\t00000000\t0001\t0\t0\t100\t00FFFFFF\t0\t0\t0
docker0\t000011AC\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0
";

    #[test]
    fn the_lan_route_and_broadcast_come_from_the_route_table() {
        // The table is written in the host's byte order; these rows are little-endian.
        if cfg!(target_endian = "big") {
            return;
        }
        let local = Ipv4Addr::new(192, 168, 1, 42);
        let (iface, mask) = lan_route(TABLE, local).unwrap();
        assert_eq!(iface, "eth0");
        assert_eq!(mask, Ipv4Addr::new(255, 255, 255, 0));
        assert_eq!(broadcast(local, mask), Ipv4Addr::new(192, 168, 1, 255));
        assert_eq!(lan_route(TABLE, Ipv4Addr::new(10, 0, 0, 1)), None);
    }

    #[test]
    fn overrides_win_and_a_loopback_relay_detects_nothing() {
        let cfg = PowerConfig {
            wakeable: true,
            mac: Some("AA:BB:CC:DD:EE:FF".into()),
            broadcast: Some("127.0.0.1:9999".into()),
            ..PowerConfig::default()
        };
        let wake = address(&cfg, "ws://127.0.0.1:1/v1/worker/connect").unwrap();
        assert_eq!(wake.mac, "aa:bb:cc:dd:ee:ff");
        assert_eq!(wake.broadcast, "127.0.0.1:9999");
        let detect_only = PowerConfig {
            wakeable: true,
            ..PowerConfig::default()
        };
        assert_eq!(address(&detect_only, "ws://127.0.0.1:1/x"), None);
        assert_eq!(address(&PowerConfig::default(), "ws://127.0.0.1:1/x"), None);
    }
}
