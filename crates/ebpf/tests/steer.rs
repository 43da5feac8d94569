//! The eBPF plane's slow path without a socket per SFU address: packets to an address with a
//! stream entry reach a catch-all socket through the sk_lookup program, the user-space plane
//! reads their destination from IP(V6)_ORIGDSTADDR, and sends its copies from the right SFU
//! address on a raw socket. IPv4 and IPv6, end to end through real sockets (no TC program here:
//! every packet takes the slow path, as unlatched or unresolved ones do).
//!
//! Run: `cargo test -p mediaplane-ebpf --test steer` as root.

mod common;

use common::*;
use mediaplane_core::model::{Model, StreamRef, StreamSpec};
use mediaplane_core::rtp::build_rtp;
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::{Dataplane, UserspaceConfig, UserspaceDataplane};
use mediaplane_ebpf::steer::SlowPathSteering;
use mediaplane_ebpf::{FastPath, LoadOptions};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// Room `id`: `pub` (local sfu:4000, sending from `pub_addr`) publishes, `sub` (local sfu:4002,
/// receiving on `sub_addr`) subscribes.
fn room(m: &mut Model, id: &str, sfu: &str, pub_addr: SocketAddr, sub_addr: SocketAddr) {
    m.create_room(id).unwrap();
    m.add_participant(id, "pub", a(&format!("{sfu}:4000")), pub_addr).unwrap();
    m.add_participant(id, "sub", a(&format!("{sfu}:4002")), sub_addr).unwrap();
    m.publish(id, "pub", "main", StreamSpec::default()).unwrap();
    m.subscribe(id, "sub", StreamRef { publisher: "pub".into(), stream: "main".into() }).unwrap();
}

#[test]
fn slow_path_is_steered_and_sends_from_the_sfu_address_v4_and_v6() {
    if !require_root("slow_path_is_steered_and_sends_from_the_sfu_address_v4_and_v6") {
        return;
    }
    let ns = Netns::new("st");
    for addr in ["10.201.0.1/32", "10.201.0.2/32", "10.201.0.3/32"] {
        ns.ip(&["addr", "add", addr, "dev", "lo"]);
    }
    for addr in ["fd00:201::1/128", "fd00:201::2/128", "fd00:201::3/128"] {
        ns.ip(&["addr", "add", addr, "dev", "lo", "nodad"]);
    }
    ns.run(|| {
        let (pub4, sub4) = (a("10.201.0.2:5000"), a("10.201.0.3:6000"));
        let (pub6, sub6) = (a("[fd00:201::2]:5000"), a("[fd00:201::3]:6000"));
        let mut m = Model::new();
        room(&mut m, "v4", "10.201.0.1", pub4, sub4);
        room(&mut m, "v6", "[fd00:201::1]", pub6, sub6);
        let table = Arc::new(ForwardingTable::compile(&m, 1));

        let fast = FastPath::load(&LoadOptions::default()).unwrap();
        let slow = UserspaceDataplane::new(UserspaceConfig { workers: 2, steered: true, ..Default::default() }, None).unwrap();
        let (v4, v6) = slow.steering_fds().expect("steered mode");
        assert_eq!((v4.len(), v6.len()), (2, 2), "a catch-all socket per worker and family");
        let steering = SlowPathSteering::attach(&fast.streams_map(), &v4, &v6).unwrap();
        fast.apply(table.clone()).unwrap();
        slow.apply(table).unwrap();

        // No socket is bound to the SFU addresses: they are free for anyone to bind.
        for sfu in ["10.201.0.1:4000", "10.201.0.1:4002", "[fd00:201::1]:4000", "[fd00:201::1]:4002"] {
            drop(UdpSocket::bind(sfu).unwrap_or_else(|e| panic!("{sfu} is held by the slow path: {e}")));
        }

        const N: u16 = 20;
        for (publisher, subscriber, sfu) in [(pub4, sub4, "10.201.0.1"), (pub6, sub6, "[fd00:201::1]")] {
            let tx = UdpSocket::bind(publisher).unwrap();
            let rx = UdpSocket::bind(subscriber).unwrap();
            rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let to = a(&format!("{sfu}:4000"));
            let from_sfu = a(&format!("{sfu}:4002"));
            // A stranger (the subscriber's own socket) is dropped, not forwarded.
            rx.send_to(&build_rtp(0, 999, 0, 7, b"stranger"), to).unwrap();
            for seq in 0..N {
                tx.send_to(&build_rtp(0, seq, 160 * seq as u32, 7, &[seq as u8; 40]), to).unwrap();
            }
            let mut buf = [0u8; 1500];
            for seq in 0..N {
                let (n, src) = rx.recv_from(&mut buf).unwrap_or_else(|e| panic!("copy {seq} via {sfu}: {e}"));
                assert_eq!(src, from_sfu, "the copy leaves from the subscriber's SFU address");
                assert_eq!(&buf[..n], &build_rtp(0, seq, 160 * seq as u32, 7, &[seq as u8; 40])[..], "payload untouched");
            }
            rx.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
            assert!(rx.recv_from(&mut buf).is_err(), "nothing more: the stranger's packet was dropped");
        }
        let st = slow.stats();
        assert_eq!(st.total.tx_copies, 2 * N as u64, "{st:?}");
        assert_eq!(st.total.drop_stranger, 2, "{st:?}");
        assert_eq!(st.total.tx_errors, 0, "{st:?}");
        let (steered, failed) = steering.stats();
        assert_eq!((steered, failed), (2 * (N as u64 + 1), 0));
        slow.shutdown().unwrap();
    });
}

/// Copies larger than their path (here `lo` at MTU 1500): a header-included raw packet is never
/// fragmented (EMSGSIZE), so the slow path sends them on a raw UDP socket where the kernel
/// fragments them, as for a UDP socket. IPv4 and IPv6; small and large datagrams interleaved.
#[test]
fn slow_path_fragments_copies_larger_than_the_path_v4_and_v6() {
    if !require_root("slow_path_fragments_copies_larger_than_the_path_v4_and_v6") {
        return;
    }
    let ns = Netns::new("sf");
    ns.ip(&["link", "set", "dev", "lo", "mtu", "1500"]);
    for addr in ["10.202.0.1/32", "10.202.0.2/32", "10.202.0.3/32"] {
        ns.ip(&["addr", "add", addr, "dev", "lo"]);
    }
    for addr in ["fd00:202::1/128", "fd00:202::2/128", "fd00:202::3/128"] {
        ns.ip(&["addr", "add", addr, "dev", "lo", "nodad"]);
    }
    ns.run(|| {
        let (pub4, sub4) = (a("10.202.0.2:5000"), a("10.202.0.3:6000"));
        let (pub6, sub6) = (a("[fd00:202::2]:5000"), a("[fd00:202::3]:6000"));
        let mut m = Model::new();
        room(&mut m, "v4", "10.202.0.1", pub4, sub4);
        room(&mut m, "v6", "[fd00:202::1]", pub6, sub6);
        let table = Arc::new(ForwardingTable::compile(&m, 1));
        let fast = FastPath::load(&LoadOptions::default()).unwrap();
        let slow = UserspaceDataplane::new(UserspaceConfig { workers: 1, steered: true, ..Default::default() }, None).unwrap();
        let (v4, v6) = slow.steering_fds().expect("steered mode");
        let _steering = SlowPathSteering::attach(&fast.streams_map(), &v4, &v6).unwrap();
        fast.apply(table.clone()).unwrap();
        slow.apply(table).unwrap();

        const SIZES: [usize; 4] = [200, 9000, 1473, 3000];
        let datagram = |seq: u16| {
            let body: Vec<u8> = (0..SIZES[seq as usize % SIZES.len()] - 12).map(|k| (k * 3 + seq as usize) as u8).collect();
            build_rtp(0, seq, 0, 7, &body)
        };
        for (publisher, subscriber, sfu) in [(pub4, sub4, "10.202.0.1"), (pub6, sub6, "[fd00:202::1]")] {
            let tx = UdpSocket::bind(publisher).unwrap();
            let rx = UdpSocket::bind(subscriber).unwrap();
            rx.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
            let mut buf = vec![0u8; 65536];
            for seq in 0..2 * SIZES.len() as u16 {
                tx.send_to(&datagram(seq), a(&format!("{sfu}:4000"))).unwrap();
                let (n, src) = rx.recv_from(&mut buf).unwrap_or_else(|e| panic!("copy {seq} ({} bytes) via {sfu}: {e}", datagram(seq).len()));
                assert_eq!(src, a(&format!("{sfu}:4002")), "the copy leaves from the subscriber's SFU address");
                assert!(buf[..n] == datagram(seq)[..], "copy {seq} via {sfu}: payload intact ({n} bytes)");
            }
        }
        // A worker adds its batch's counters after sending it: the last copy can arrive first.
        let want = 4 * SIZES.len() as u64;
        let start = std::time::Instant::now();
        while slow.stats().total.tx_copies < want && start.elapsed() < Duration::from_secs(2) {
            std::thread::sleep(Duration::from_millis(5));
        }
        let st = slow.stats();
        assert_eq!((st.total.tx_copies, st.total.tx_errors), (want, 0), "{st:?}");
        slow.shutdown().unwrap();
    });
}
