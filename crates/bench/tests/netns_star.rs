//! Privileged tests (tier 2): the netns star testbed and traffic through it.
//! Each skips without root unless CI=true (then it fails). Each stays under ~5 s.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use mediaplane_bench::traffic::{run, Profile, TrafficPlan};
use mediaplane_bench::{added_delay, require_root, AddedDelayMethod, Testbed};

fn addr(ip: IpAddr, port: u16) -> SocketAddr {
    SocketAddr::new(ip, port)
}

/// Voice over the direct path p0 → p1 (routed by the SFU namespace's kernel): every packet
/// arrives, delays are sane, the SFU namespace really forwarded them, teardown leaves nothing.
#[test]
fn star_direct_path_voice() {
    if !require_root("star_direct_path_voice") {
        return;
    }
    let bed = Testbed::star(3).unwrap();
    let prefix = bed.prefix.clone();
    assert_eq!(Testbed::leftovers(&prefix).len(), 4, "sfu + 3 participants");
    assert!(bed.peers.iter().all(|p| p.sfu_if.len() <= 15 && p.peer_if.len() <= 15));
    let (p0, p1, p2) = (&bed.peers[0], &bed.peers[1], &bed.peers[2]);

    let tx = bed.udp_socket(&p0.ns, addr(p0.ip, 0)).unwrap();
    let rx = bed.udp_socket(&p1.ns, addr(p1.ip, 5004)).unwrap();
    let bystander = bed.udp_socket(&p2.ns, addr(p2.ip, 5004)).unwrap();
    let before = bed.link_counters(&bed.sfu_ns, &p1.sfu_if).unwrap();

    let plan = TrafficPlan::new(Duration::from_secs(1)).sender(tx, addr(p1.ip, 5004), 0x1111, Profile::voice()).receiver("p1", rx, [0x1111]).receiver(
        "p2",
        bystander,
        [],
    );
    let report = run(&plan).unwrap();
    let json = serde_json::to_string_pretty(&report).unwrap();

    let copy = report.copy_by_label(0x1111, "p1").unwrap();
    assert_eq!((copy.sent, copy.received, copy.lost, copy.duplicates, copy.reordered), (50, 50, 0, 0, 0), "{json}");
    assert_eq!(copy.bytes, 50 * 172);
    assert!(copy.delay_ns.min > 0.0 && copy.delay_ns.max < 20e6, "delay outside (0, 20 ms): {json}");
    assert_eq!(report.receivers[0].user_timestamps, 0, "kernel timestamps: {json}");
    assert_eq!(report.receivers[1].datagrams, 0, "nothing leaks to p2: {json}");

    let after = bed.link_counters(&bed.sfu_ns, &p1.sfu_if).unwrap();
    assert!(after.tx_packets - before.tx_packets >= 50, "the SFU namespace forwarded the flow: {before:?} {after:?}");

    drop(bed);
    assert_eq!(Testbed::leftovers(&prefix), Vec::<String>::new());
}

/// Namespaces are what they claim, the guard rails hold, and a panic still tears down.
#[test]
fn star_isolation_and_teardown_on_panic() {
    if !require_root("star_isolation_and_teardown_on_panic") {
        return;
    }
    let prefix = std::sync::Mutex::new(String::new());
    let result = std::panic::catch_unwind(|| {
        let bed = Testbed::star(1).unwrap();
        *prefix.lock().unwrap() = bed.prefix.clone();
        let p0 = &bed.peers[0];

        // The participant address exists only inside its namespace.
        assert!(UdpSocket::bind(addr(p0.ip, 0)).is_err(), "10.77.0.2 must not exist in the root namespace");
        let s = bed.udp_socket(&p0.ns, addr(p0.ip, 0)).unwrap();
        assert_eq!(s.local_addr().unwrap().ip(), p0.ip);

        let out = bed.command(&p0.ns, "ip").args(["-br", "addr", "show", "dev", &p0.peer_if]).output().unwrap();
        assert!(String::from_utf8_lossy(&out.stdout).contains("10.77.0.2/24"));
        let forward = bed.in_ns(&bed.sfu_ns, || std::fs::read_to_string("/proc/sys/net/ipv4/ip_forward")).unwrap().unwrap();
        assert_eq!(forward.trim(), "1");

        assert!(bed.in_ns("not-ours", || ()).is_err(), "refuses namespaces it did not create");
        panic!("deliberate");
    });
    assert!(result.is_err());
    let prefix = prefix.into_inner().unwrap();
    assert!(!prefix.is_empty());
    assert_eq!(Testbed::leftovers(&prefix), Vec::<String>::new(), "Drop ran during unwinding");
}

/// The added-delay pipeline end to end with a toy user-space relay in the SFU namespace:
/// p0 sends one flow straight to p1 (direct path) and one to the relay, which copies it to p1
/// and p2. Same run, so the two delays are comparable.
#[test]
fn star_added_delay_through_toy_relay() {
    if !require_root("star_added_delay_through_toy_relay") {
        return;
    }
    let bed = Testbed::star(3).unwrap();
    let (p0, p1, p2) = (&bed.peers[0], &bed.peers[1], &bed.peers[2]);
    let relay_in = bed.udp_socket(&bed.sfu_ns, addr(p0.sfu_ip, 4000)).unwrap();
    relay_in.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let subscribers = [addr(p1.ip, 5006), addr(p2.ip, 5006)];
    let stop = AtomicBool::new(false);

    let report = std::thread::scope(|scope| {
        let relay = scope.spawn(|| {
            let mut buf = [0u8; 2048];
            let mut forwarded = 0u64;
            // Bounded: the test ends in a few seconds; the loop also has an iteration cap.
            for _ in 0..1_000_000 {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                if let Ok((n, _)) = relay_in.recv_from(&mut buf) {
                    for s in subscribers {
                        forwarded += relay_in.send_to(&buf[..n], s).is_ok() as u64;
                    }
                }
            }
            forwarded
        });
        let plan = TrafficPlan::new(Duration::from_secs(1))
            .sender(bed.udp_socket(&p0.ns, addr(p0.ip, 0)).unwrap(), addr(p1.ip, 5004), 1, Profile::voice())
            .sender(bed.udp_socket(&p0.ns, addr(p0.ip, 0)).unwrap(), addr(p0.sfu_ip, 4000), 2, Profile::voice())
            .receiver("p1-direct", bed.udp_socket(&p1.ns, addr(p1.ip, 5004)).unwrap(), [1])
            .receiver("p1", bed.udp_socket(&p1.ns, addr(p1.ip, 5006)).unwrap(), [2])
            .receiver("p2", bed.udp_socket(&p2.ns, addr(p2.ip, 5006)).unwrap(), [2]);
        let report = run(&plan);
        stop.store(true, Ordering::Relaxed);
        assert_eq!(relay.join().unwrap(), 100);
        report.unwrap()
    });
    let json = serde_json::to_string_pretty(&report).unwrap();
    assert_eq!(report.totals.lost, 0, "{json}");
    assert_eq!(report.totals.received, 150, "{json}");

    let direct = report.copy_by_label(1, "p1-direct").unwrap();
    let added = |label: &str| {
        let copy = report.copy_by_label(2, label).unwrap();
        let added = added_delay(&copy.delay_ns, &direct.delay_ns, AddedDelayMethod::QuantileDifference).unwrap();
        eprintln!("added delay {label}: {added:?}");
        added.p50
    };
    let (p1, p2) = (added("p1"), added("p2"));
    // The toy relay's hop, measured in eight runs (debug build, 2-core VM): added p50 20.5-32.3
    // µs to p1, 50.3-66.1 µs to p2. Lower bound: a thread wake-up and a recvfrom/sendto pair is more
    // than 5 µs, which an in-kernel hop stays under (the eBPF relay's whole one-way path measures
    // 5.1 µs in relay_ebpf), so the bound tells a user-space hop from none. Upper: three times
    // the largest p50 measured.
    assert!((5_000.0..=100_000.0).contains(&p1), "added p50 to p1 {:.1} µs, outside 5-100 µs\n{json}", p1 / 1e3);
    assert!((5_000.0..=200_000.0).contains(&p2), "added p50 to p2 {:.1} µs, outside 5-200 µs\n{json}", p2 / 1e3);
    // p2's copy leaves after p1's sendto returned (measured 27.5-33.8 µs later): the relay's
    // copies are sequential, and the report sees it.
    assert!(p2 - p1 >= 5_000.0, "p2's copy only {:.1} µs after p1's\n{json}", (p2 - p1) / 1e3);
}
