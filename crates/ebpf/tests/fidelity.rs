//! The kernel path forwards what a careful host would, as a careful host would (issue: "faithful,
//! not just fast"), through BPF_PROG_TEST_RUN in the rig of tests/common/rig.rs:
//! - only packets the host's stack would accept: IPv4 header and UDP checksums verified (zero
//!   accepted on IPv4 only), the rest dropped and counted as `drop_bad_checksum`;
//! - only sources that pass the reverse-path check of their ingress (`drop_spoofed`);
//! - copies carry the SFU's own IP header (TTL/hop limit, DSCP policy, ECN, DF and ID, flow label);
//! - a stream handed to the slow path stays there until the slow path has sent what it holds
//!   (no packet overtakes another), and returns once it has.
//!
//! Run: `cargo test -p mediaplane-ebpf --test fidelity` as root.

mod common;

use common::rig::*;
use common::*;
use mediaplane_core::packet::{build_frame, internet_checksum, parse_frame, FrameSpec};
use mediaplane_core::table::SourceRule;
use mediaplane_ebpf::maps::{config_flags, FastConfigRaw, RpfMode};
use mediaplane_ebpf::{TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use std::time::Duration;

const V6_LOCAL: &str = "[fd00:200::1]:4000";
const V6_PUBLISHER: &str = "[fd00:200::9]:5000";

fn v6_frame(src: &str, dst: &str, payload: &[u8]) -> Vec<u8> {
    let mut spec = FrameSpec::new(a(src), a(dst));
    spec.dst_mac = MAC0;
    build_frame(&spec, payload)
}

fn v6_subscribers(n: usize) -> Vec<(std::net::SocketAddr, std::net::SocketAddr)> {
    subscribers(n, "fd00:200::1", "fd00:200::2", 40000)
}

/// Run `frame` and return (verdict, the counters that moved).
fn run(rig: &Rig, frame: &[u8]) -> (u32, std::collections::BTreeMap<&'static str, u64>) {
    let before = rig.fp.kernel_stats().unwrap();
    let r = rig.fp.test_run(frame, Some(rig.ifindex)).unwrap();
    (r.retval, delta(&before, &rig.fp.kernel_stats().unwrap()))
}

#[test]
fn bad_checksums_are_dropped_where_the_host_would_drop_them() {
    root_or_skip!("bad_checksums_are_dropped_where_the_host_would_drop_them");
    let rig = Rig::new();
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2)),
            entry(2, V6_LOCAL, None, SourceRule::Fixed(a(V6_PUBLISHER)), true, v6_subscribers(2)),
        ],
    );
    rig.apply(&t);
    let good4 = v4_frame(PUBLISHER, LOCAL, &rtp(7));
    let good6 = v6_frame(V6_PUBLISHER, V6_LOCAL, &rtp(7));
    rig.check(&t, &good4);
    rig.check(&t, &good6);
    let (l4_v4, l4_v6) = (14 + 20, 14 + 40);
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut f = good4.clone();
    f[l4_v4 + 6] ^= 0x01;
    cases.push(("IPv4, bad UDP checksum", f));
    let mut f = good4.clone();
    f[14 + 10] ^= 0x80;
    cases.push(("IPv4, bad header checksum", f));
    let mut f = good4.clone();
    *f.last_mut().unwrap() ^= 0x40;
    cases.push(("IPv4, payload changed after the checksum", f));
    let mut f = good6.clone();
    f[l4_v6 + 6] = 0;
    f[l4_v6 + 7] = 0;
    cases.push(("IPv6, zero UDP checksum", f));
    let mut f = good6.clone();
    f[l4_v6 + 6] ^= 0x10;
    cases.push(("IPv6, bad UDP checksum", f));
    for (what, f) in &cases {
        let (verdict, d) = run(&rig, f);
        assert_eq!(verdict, TC_ACT_SHOT, "{what}: {d:?}");
        assert_eq!(d.get("drop_bad_checksum"), Some(&1), "{what}: {d:?}");
        assert!(!d.contains_key("tx_copies"), "{what}: {d:?}");
        // And the reference agrees, copies and all.
        rig.check(&t, f);
    }
    let s = rig.fp.kernel_stats().unwrap();
    let total = s.to_dataplane_stats(1).total;
    assert_eq!(total.drop_bad_checksum, 2 * cases.len() as u64, "counted in the totals every plane reports");
    assert_eq!(s.streams[&1].drop_bad_checksum + s.streams[&2].drop_bad_checksum, 2 * cases.len() as u64, "and per stream");
    // IPv4 without a checksum is valid (udp_checksum_zero_stays_zero_on_ipv4 checks the copies).
    let mut f = good4.clone();
    f[l4_v4 + 6] = 0;
    f[l4_v4 + 7] = 0;
    assert_eq!(run(&rig, &f).0, TC_ACT_REDIRECT);
    // A stranger's bad packet is a stranger's: the source is judged first (as the XDP
    // pre-filter does, which reads no checksum).
    let mut f = v4_frame("10.200.0.7:5000", LOCAL, &rtp(7));
    f[l4_v4 + 6] ^= 1;
    assert_eq!(run(&rig, &f).1.get("drop_stranger"), Some(&1));
    // Verification off (A/B measurements only): the bad packet is fanned out unchanged.
    rig.configure(FastConfigRaw { flags: 0, ..RIG_CONFIG });
    assert_eq!(run(&rig, &cases[0].1).0, TC_ACT_REDIRECT);
}

/// Every length (chunking, odd tails) and the position of a flipped bit anywhere in a large
/// datagram: the sum is computed over all of it.
#[test]
fn checksum_verification_covers_every_byte_of_every_length() {
    root_or_skip!("checksum_verification_covers_every_byte_of_every_length");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), false, subscribers_v4(1))]);
    rig.apply(&t);
    let lens: Vec<usize> = (0..=20).chain([255, 256, 257, 503, 504, 505, 511, 512, 513, 1023, 1024, 1025, 1400, 1469, 1472]).collect();
    for len in lens {
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let good = v4_frame(PUBLISHER, LOCAL, &payload);
        assert_eq!(run(&rig, &good).0, TC_ACT_REDIRECT, "valid, {len} bytes");
        for at in [0, len / 3, len / 2, len.saturating_sub(1)] {
            if len == 0 {
                break;
            }
            let mut bad = good.clone();
            let p = 14 + 20 + 8 + at;
            bad[p] = bad[p].wrapping_add(1);
            let (v, d) = run(&rig, &bad);
            assert_eq!((v, d.get("drop_bad_checksum")), (TC_ACT_SHOT, Some(&1)), "{len} bytes, byte {at} changed: {d:?}");
        }
    }
}

/// A second interface (a veth pair inside the lab's namespace; 10.200.7.0/24 and fd00:207::/64 behind it) and a route into the lab's
/// void (10.200.9.0/24 blackholed): sources there arriving on v0 are judged by the mode.
#[test]
fn reverse_path_check_follows_the_interface_mode() {
    root_or_skip!("reverse_path_check_follows_the_interface_mode");
    let rig = Rig::new();
    let dummy = format!("{}d", rig.lab.ns.name);
    let dummy_peer = format!("{}e", rig.lab.ns.name);
    rig.lab.ns.ip(&["link", "add", &dummy, "type", "veth", "peer", "name", &dummy_peer]);
    rig.lab.ns.ip(&["link", "set", &dummy, "up"]);
    rig.lab.ns.ip(&["link", "set", &dummy_peer, "up"]);
    rig.lab.ns.ip(&["addr", "add", "10.200.7.1/24", "dev", &dummy]);
    rig.lab.ns.ip(&["addr", "add", "fd00:207::1/64", "dev", &dummy, "nodad"]);
    rig.lab.ns.ip(&["route", "add", "blackhole", "10.200.9.0/24"]);
    let elsewhere = "10.200.7.5:5000"; // reachable, but not through v0
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1)),
            entry(2, "10.200.0.1:4002", None, SourceRule::Fixed(a(elsewhere)), true, subscribers_v4(1)),
            entry(3, "10.200.0.1:4004", None, SourceRule::Fixed(a("10.200.9.5:5000")), true, subscribers_v4(1)),
            entry(4, "10.200.0.1:4006", None, SourceRule::Fixed(a("10.201.0.5:5000")), true, subscribers_v4(1)),
            entry(5, V6_LOCAL, None, SourceRule::Fixed(a(V6_PUBLISHER)), true, v6_subscribers(1)),
            entry(6, "[fd00:200::1]:4002", None, SourceRule::Fixed(a("[fd00:207::5]:5000")), true, v6_subscribers(1)),
        ],
    );
    rig.apply(&t);
    let frames = [
        v4_frame(PUBLISHER, LOCAL, &rtp(1)),
        v4_frame(elsewhere, "10.200.0.1:4002", &rtp(1)),
        v4_frame("10.200.9.5:5000", "10.200.0.1:4004", &rtp(1)),
        v4_frame("10.201.0.5:5000", "10.200.0.1:4006", &rtp(1)),
        v6_frame(V6_PUBLISHER, V6_LOCAL, &rtp(1)),
        v6_frame("[fd00:207::5]:5000", "[fd00:200::1]:4002", &rtp(1)),
    ];
    // (v4 mode, v6 mode) -> forwarded? per frame: on-link, other interface, blackholed, no
    // route at all (the lab has no default route), v6 on-link, v6 other interface.
    let cases = [
        (RpfMode::Off, RpfMode::Off, [true, true, true, true, true, true]),
        (RpfMode::Loose, RpfMode::Loose, [true, true, false, false, true, true]),
        (RpfMode::Strict, RpfMode::Strict, [true, false, false, false, true, false]),
    ];
    for (m4, m6, want) in cases {
        rig.fp.set_rpf_mode(rig.ifindex, m4).unwrap();
        rig.configure(FastConfigRaw { rpf_v6: m6 as u8, ..RIG_CONFIG });
        rig.fp.invalidate_next_hops().unwrap(); // as the daemon does when a mode changes
        for (f, ok) in frames.iter().zip(want) {
            let p = parse_frame(f).unwrap();
            for round in 0..2 {
                // The second round takes the per-stream cache where the first one passed.
                let (v, d) = run(&rig, f);
                if ok {
                    assert_eq!(v, TC_ACT_REDIRECT, "{m4:?}/{m6:?}: {} should pass (round {round}): {d:?}", p.src);
                } else {
                    assert_eq!((v, d.get("drop_spoofed")), (TC_ACT_SHOT, Some(&1)), "{m4:?}/{m6:?}: {} is spoofed here: {d:?}", p.src);
                }
            }
        }
    }
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.to_dataplane_stats(1).total.drop_spoofed, 2 * (2 + 4), "in the totals");
    assert_eq!(s.streams[&3].drop_spoofed, 2 * 2, "and per stream");
    // A pass is remembered only until the routes change: the on-link publisher's subnet moves
    // to the dummy interface, and its packets on v0 are spoofed from the next one on (the
    // next-hop watcher bumps the generation; here, by hand).
    rig.lab.ns.ip(&["route", "add", "10.200.0.9/32", "dev", &dummy]);
    rig.fp.invalidate_next_hops().unwrap();
    assert_eq!(run(&rig, &frames[0]).1.get("drop_spoofed"), Some(&1), "strict, after the route moved");
}

/// Copies carry the SFU's own header: the publisher's TTL 1, EF marking with ECN, an IP ID
/// and no DF (or IPv6 hop limit 1, traffic class and flow label) are not what leaves.
#[test]
fn copies_carry_the_sfus_own_ip_header() {
    root_or_skip!("copies_carry_the_sfus_own_ip_header");
    let rig = Rig::new();
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(3)),
            entry(2, V6_LOCAL, None, SourceRule::Fixed(a(V6_PUBLISHER)), true, v6_subscribers(3)),
        ],
    );
    rig.apply(&t);
    let mut f4 = v4_frame(PUBLISHER, LOCAL, &rtp(9));
    f4[14 + 1] = (46 << 2) | 1; // EF, ECT(1)
    f4[14 + 4..14 + 8].copy_from_slice(&[0x12, 0x34, 0, 0]); // ID 0x1234, no DF
    f4[14 + 8] = 1; // TTL 1
    f4[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
    let c = internet_checksum(&f4[14..34]);
    f4[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
    let mut f6 = v6_frame(V6_PUBLISHER, V6_LOCAL, &rtp(9));
    f6[14..18].copy_from_slice(&[0x6b, 0x8a, 0xbc, 0xde]); // traffic class 0xb8 (EF), flow label 0xabcde
    f6[14 + 7] = 1; // hop limit 1
    let mut ids = Vec::new();
    for (cfg, what) in [
        (RIG_CONFIG, "DSCP 0"),
        (FastConfigRaw { dscp: 34, ttl: 77, hop_limit: 99, ..RIG_CONFIG }, "DSCP AF41, the host's TTL 77 / hop limit 99"),
        (FastConfigRaw { flags: RIG_CONFIG.flags | config_flags::KEEP_DSCP, ..RIG_CONFIG }, "the publisher's DSCP kept"),
    ] {
        rig.configure(cfg);
        for f in [&f4, &f6] {
            // rig.check holds every copy to own_header under `cfg`; here, the values spelled out.
            let got = rig.check(&t, f);
            assert_eq!(got.len(), 3, "{what}");
            let want_tclass = if cfg.flags & config_flags::KEEP_DSCP != 0 { 46 << 2 } else { cfg.dscp << 2 };
            for c in &got {
                let p = parse_frame(c).unwrap();
                let ip = &c[p.l3..];
                if p.src.is_ipv4() {
                    assert_eq!((ip[1], &ip[6..8], ip[8]), (want_tclass, &[0x40u8, 0][..], cfg.ttl), "{what}");
                    ids.push(u16::from_be_bytes([ip[4], ip[5]]));
                } else {
                    assert_eq!(((ip[0] << 4) | (ip[1] >> 4), ip[1] & 0x0f, ip[2], ip[3], ip[7]), (want_tclass, 0, 0, 0, cfg.hop_limit), "{what}");
                }
            }
        }
    }
    assert!(ids.iter().any(|id| *id != 0x1234), "the IPv4 ID is the SFU's, not the publisher's: {ids:?}");
}

/// The order hold (bpf/order.h): a packet handed up (here: its copy is over the link's MTU)
/// is numbered and marked; while the slow path has not acknowledged the last one handed up,
/// later packets of the stream follow it up; acknowledged, the stream is forwarded in the kernel
/// again. A lost packet is covered by a later acknowledgement (first in, first out), and a hold
/// whose last packet was lost ends by itself. No step waits on anything but the program.
#[test]
fn a_stream_leaves_the_kernel_path_in_order_and_returns_when_the_slow_path_is_empty() {
    root_or_skip!("a_stream_leaves_the_kernel_path_in_order_and_returns_when_the_slow_path_is_empty");
    use mediaplane_ebpf::maps::order_mark;
    let rig = Rig::new();
    rig.configure(FastConfigRaw { flags: RIG_CONFIG.flags | config_flags::HOLD_ORDER, ..RIG_CONFIG });
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2))]);
    rig.apply(&t);
    let slot = rig.fp.stats_slot(1).unwrap();
    let paths = rig.fp.stream_paths();
    let big = v4_frame(PUBLISHER, LOCAL, &mediaplane_core::rtp::build_rtp(96, 1, 1, 5, &[1; 1600]));
    let small = v4_frame(PUBLISHER, LOCAL, &rtp(5));
    let up = |frame: &[u8], why: &str, seq: u32| {
        let before = rig.fp.kernel_stats().unwrap();
        let r = rig.fp.test_run(frame, Some(rig.ifindex)).unwrap();
        let d = delta(&before, &rig.fp.kernel_stats().unwrap());
        assert_eq!((r.retval, d.get(why)), (TC_ACT_OK, Some(&1)), "{why}: {d:?}");
        assert_eq!(r.mark, order_mark(slot, seq), "{why}: marked as packet {seq} of its stream");
    };
    let forwarded = |what: &str| {
        let (v, d) = run(&rig, &small);
        assert_eq!((v, d.get("tx_copies")), (TC_ACT_REDIRECT, Some(&2)), "{what}: {d:?}");
    };
    forwarded("nothing held yet");
    up(&big, "pass_fib_fail", 1);
    up(&small, "pass_in_order", 2);
    assert_eq!(paths.order_seqs(slot), Some((2, 0)));
    // The slow path sent packet 1: packet 2 is still up there.
    paths.ack_mark(order_mark(slot, 1));
    up(&small, "pass_in_order", 3);
    // Packet 2 was lost on its way up; packet 3 was sent: that covers everything before it.
    paths.ack_mark(order_mark(slot, 3));
    assert_eq!(paths.order_seqs(slot), Some((3, 3)));
    forwarded("the slow path has sent the last packet handed up");
    // Marks without the order bit are not ours.
    paths.ack_mark(slot);
    assert_eq!(paths.order_seqs(slot), Some((3, 3)));

    // The last packet handed up is lost: the hold ends after MP_ORDER_HOLD_MAX_NS (50 ms).
    up(&big, "pass_fib_fail", 4);
    up(&small, "pass_in_order", 5);
    std::thread::sleep(Duration::from_millis(80));
    forwarded("no acknowledgement for 80 ms: the hold ended");
    forwarded("and stays ended");
    // An acknowledgement arriving after that costs one more packet's trip, no more.
    paths.ack_mark(order_mark(slot, 4));
    up(&small, "pass_in_order", 6);
    paths.ack_mark(order_mark(slot, 6));
    forwarded("acknowledged again");
}

/// Not a check: what checksum verification and the reverse-path check cost per packet, in BPF
/// run time, A/B in one run (the same frame, the program reconfigured between interleaved
/// rounds of single BPF_PROG_TEST_RUNs, each timed by the kernel; a round's mean is a sample,
/// the medians and spread over rounds are reported; one copy, so nothing is cloned). The frame
/// arrives unverified (CHECKSUM_NONE, as from a device without receive checksum offload): the
/// sum is computed. The reverse-path check is measured both cached (the normal case: once per
/// stream and route change) and uncached (a route or neighbour change before every packet).
/// Run: `cargo test --release -p mediaplane-ebpf --test fidelity checks_cost -- --ignored --nocapture`
#[test]
#[ignore]
fn checks_cost_microbench() {
    root_or_skip!("checks_cost_microbench");
    const ROUNDS: usize = 31;
    const RUNS: usize = 300;
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1))]);
    rig.apply(&t);
    let base = FastConfigRaw { flags: 0, ..RIG_CONFIG };
    let verify = FastConfigRaw { flags: config_flags::VERIFY_CSUM, ..RIG_CONFIG };
    // (name, config, IPv4 rp_filter mode, bump the next-hop generation before each run)
    let variants = [
        ("no checks", base, RpfMode::Off, false),
        ("checksum", verify, RpfMode::Off, false),
        ("rp_filter strict (cached)", base, RpfMode::Strict, false),
        ("rp_filter strict (uncached)", base, RpfMode::Strict, true),
        ("checksum + rp_filter (cached)", verify, RpfMode::Strict, false),
    ];
    println!("payload  variant                          median ns  p10-p90 ns     vs no checks");
    for payload_len in [160usize, 1200] {
        let frame = v4_frame(PUBLISHER, LOCAL, &mediaplane_core::rtp::build_rtp(96, 1, 1, 7, &vec![0x5a; payload_len]));
        let mut samples: Vec<Vec<u64>> = vec![Vec::new(); variants.len()];
        for _ in 0..ROUNDS {
            for (k, (_, cfg, mode, bump)) in variants.iter().enumerate() {
                rig.fp.configure(cfg).unwrap();
                rig.fp.set_rpf_mode(rig.ifindex, *mode).unwrap();
                rig.fp.invalidate_next_hops().unwrap();
                // Single runs (a repeated run would see its own rewritten copy the second time).
                let runs: Vec<u64> = (0..RUNS)
                    .map(|_| {
                        if *bump {
                            // A new generation before every run: every run looks the source up.
                            rig.fp.invalidate_next_hops().unwrap();
                        }
                        let r = rig.fp.test_run(&frame, Some(rig.ifindex)).unwrap();
                        assert_eq!(r.retval, TC_ACT_REDIRECT);
                        r.duration_ns
                    })
                    .collect();
                samples[k].push(runs.iter().sum::<u64>() / runs.len() as u64);
            }
        }
        let median = |v: &mut Vec<u64>| {
            v.sort();
            (v[v.len() / 2], v[v.len() / 10], v[v.len() * 9 / 10])
        };
        let (b, _, _) = median(&mut samples[0].clone());
        for (k, (name, ..)) in variants.iter().enumerate() {
            let (m, lo, hi) = median(&mut samples[k]);
            println!("{payload_len:>7}  {name:<31}  {m:>9}  {lo:>5}-{hi:<5}  {:>+8}", m as i64 - b as i64);
        }
    }
}

/// The first fragment of a fragmented datagram (UDP and RTP headers inside) holds its stream
/// like any packet handed up, SSRC-narrowed addresses included; later fragments carry nothing
/// to look up and are not counted.
#[test]
fn a_fragmented_datagram_holds_its_stream_in_order() {
    root_or_skip!("a_fragmented_datagram_holds_its_stream_in_order");
    let rig = Rig::new();
    rig.configure(FastConfigRaw { flags: RIG_CONFIG.flags | config_flags::HOLD_ORDER, ..RIG_CONFIG });
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1)),
            entry(2, "10.200.0.1:4002", Some(77), SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1)),
        ],
    );
    rig.apply(&t);
    let paths = rig.fp.stream_paths();
    for (stream, local, ssrc) in [(1u32, LOCAL, 5u32), (2, "10.200.0.1:4002", 77)] {
        let slot = rig.fp.stats_slot(stream).unwrap();
        let whole = v4_frame(PUBLISHER, local, &mediaplane_core::rtp::build_rtp(96, 1, 1, ssrc, &[1; 1400]));
        // The first 8 * 100 bytes of the datagram, MF set; then the rest at offset 800.
        let mut first = whole[..14 + 20 + 800].to_vec();
        first[14 + 2..14 + 4].copy_from_slice(&(20u16 + 800).to_be_bytes());
        first[14 + 6] = 0x20; // MF
        let mut later = whole[..14 + 20].to_vec();
        later.extend_from_slice(&whole[14 + 20 + 800..]);
        let len = (later.len() - 14) as u16;
        later[14 + 2..14 + 4].copy_from_slice(&len.to_be_bytes());
        later[14 + 6..14 + 8].copy_from_slice(&(800u16 / 8).to_be_bytes());
        for f in [&mut first, &mut later] {
            f[14 + 10..14 + 12].copy_from_slice(&[0, 0]);
            let c = internet_checksum(&f[14..34]);
            f[14 + 10..14 + 12].copy_from_slice(&c.to_be_bytes());
        }
        let mark = |seq| mediaplane_ebpf::maps::order_mark(slot, seq);
        let r = rig.fp.test_run(&first, Some(rig.ifindex)).unwrap();
        assert_eq!((r.retval, r.mark), (TC_ACT_OK, mark(1)), "stream {stream}: first fragment");
        let r = rig.fp.test_run(&later, Some(rig.ifindex)).unwrap();
        assert_eq!((r.retval, r.mark), (TC_ACT_OK, 0), "stream {stream}: a later fragment");
        assert_eq!(paths.order_seqs(slot), Some((1, 0)), "stream {stream}");
        let before = rig.fp.kernel_stats().unwrap();
        let r = rig.fp.test_run(&v4_frame(PUBLISHER, local, &mediaplane_core::rtp::build_rtp(96, 2, 2, ssrc, &[2; 100])), Some(rig.ifindex)).unwrap();
        let d = delta(&before, &rig.fp.kernel_stats().unwrap());
        assert_eq!((r.retval, r.mark, d.get("pass_in_order")), (TC_ACT_OK, mark(2), Some(&1)), "stream {stream}: the next packet follows the datagram up");
        paths.ack_mark(mark(1));
        paths.ack_mark(mark(2));
        assert_eq!(run(&rig, &v4_frame(PUBLISHER, local, &mediaplane_core::rtp::build_rtp(96, 3, 3, ssrc, &[3; 100]))).0, TC_ACT_REDIRECT);
    }
}
