//! BPF_PROG_TEST_RUN of the TC program on crafted frames, compared with the reference: core's
//! per-packet pipeline (`mediaplane_core::pipeline::reference`, on `ForwardingTable::classify()`). Copies really leave through bpf_clone_redirect: each test runs
//! in its own network namespace with a veth pair (v0: the SFU side the packet "arrives" on and
//! copies leave from; v1: the subscribers' side, where an AF_PACKET socket captures them).
//! The rig and the oracle live in tests/common/rig.rs (shared with fuzz_test_run.rs).
//!
//! Run: `cargo test -p mediaplane-ebpf --test test_run` as root.

mod common;

use common::rig::*;
use common::*;
use mediaplane_core::packet::{build_frame, parse_frame, FrameSpec};
use mediaplane_core::rtp::build_rtp;
use mediaplane_core::table::{IngressKey, SourceRule};
use mediaplane_ebpf::{FastPath, LoadOptions, Prefilter, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT, XDP_DROP, XDP_PASS};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

#[test]
fn valid_rtp_fans_out_to_every_subscriber() {
    root_or_skip!("valid_rtp_fans_out_to_every_subscriber");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(3))]);
    rig.apply(&t);
    let before = mediaplane_dataplane::monotonic_ns();
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(42)));
    let after = mediaplane_dataplane::monotonic_ns();
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.streams[&1].tx_copies, 3);
    // The kernel's last-packet time is on the clock of monotonic_ns (the media timeout's).
    let last = s.streams[&1].to_counters().last_rx_ns;
    assert!((before..=after).contains(&last), "last_rx_ns {last} outside the run [{before}, {after}]");
    assert_eq!(s.latency.count, 3, "one latency sample per copy");
    let ds = s.to_dataplane_stats(1);
    assert!(ds.copy_latency.is_some_and(|l| l.count == 3 && l.min_ns > 0 && l.max_ns >= l.p50_ns));
    // Each copy counted for its consumer (rig: stream 1's consumers are 1001..=1003).
    let per_copy = s.streams[&1].tx_bytes / 3;
    let consumers: Vec<(u32, u64, u64)> = s.consumers.iter().map(|(id, c)| (*id, c.tx_copies, c.tx_bytes)).collect();
    assert_eq!(consumers, (1001..=1003).map(|id| (id, 1, per_copy)).collect::<Vec<_>>());
    // A consumer's counters go with its last copy; the others' stay.
    let fewer = table(2, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2))]);
    rig.apply(&fewer);
    let mut left = rig.fp.kernel_consumer_ids();
    left.sort();
    assert_eq!(left, [1001, 1002], "in the kernel's map");
    assert_eq!(rig.fp.map_fill()["consumer_stats"].entries, 2);
    // A stream the kernel leaves to the slow path (here: recorded) has no copies there, and its
    // consumers no kernel counters.
    let mut recorded = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2));
    recorded.record = true;
    rig.apply(&table(3, vec![recorded]));
    assert_eq!(rig.fp.kernel_consumer_ids(), Vec::<u32>::new());
}

#[test]
fn zero_one_and_256_subscribers() {
    root_or_skip!("zero_one_and_256_subscribers");
    let rig = Rig::new();
    for (id, n) in [(1u32, 0usize), (2, 1), (3, 256)] {
        let t = table(id as u64, vec![entry(id, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(n))]);
        rig.apply(&t);
        let got = rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(9)));
        assert_eq!(got.len(), n);
    }
}

#[test]
fn non_rtp_payload_on_a_non_rtp_stream_is_forwarded() {
    root_or_skip!("non_rtp_payload_on_a_non_rtp_stream_is_forwarded");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), false, subscribers_v4(2))]);
    rig.apply(&t);
    for payload in [&b""[..], b"x", b"hello world", &[0xff; 1000]] {
        rig.check(&t, &v4_frame(PUBLISHER, LOCAL, payload));
    }
    // The same payloads on an RTP stream are malformed.
    let t = table(2, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2))]);
    rig.apply(&t);
    for payload in [&b""[..], b"x", b"hello world", &[0x80; 11]] {
        rig.check(&t, &v4_frame(PUBLISHER, LOCAL, payload));
    }
}

#[test]
fn malformed_rtp_variants_follow_the_reference() {
    root_or_skip!("malformed_rtp_variants_follow_the_reference");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1))]);
    rig.apply(&t);
    let mut cases: Vec<Vec<u8>> = Vec::new();
    let mut cc = rtp(1);
    cc[0] |= 0x0f; // 15 CSRCs promised: 72 bytes, have 172 -> valid
    cases.push(cc.clone());
    cc.truncate(60); // now too short for them
    cases.push(cc);
    let mut ext = build_rtp(96, 1, 1, 1, &[]);
    ext[0] |= 0x10;
    ext.extend_from_slice(&[0xbe, 0xde, 0, 1, 0x10, 0xaa, 0, 0]); // valid one-word extension
    cases.push(ext.clone());
    ext[15] = 9; // extension length runs past the end
    cases.push(ext);
    let mut pad = build_rtp(96, 1, 1, 1, &[1, 2, 3, 4]);
    pad[0] |= 0x20;
    *pad.last_mut().unwrap() = 4; // valid padding
    cases.push(pad.clone());
    *pad.last_mut().unwrap() = 0; // zero padding length
    cases.push(pad.clone());
    *pad.last_mut().unwrap() = 200; // longer than the packet
    cases.push(pad);
    cases.push(vec![0x40; 20]); // version 1
                                // RTCP: SR alone, SR + PLI compound, bad length inside the compound, too short.
    let mut sr = vec![0x80, 200, 0, 6];
    sr.extend_from_slice(&0x1111_1111u32.to_be_bytes());
    sr.extend_from_slice(&[0; 20]);
    let mut pli = vec![0x81, 206, 0, 2];
    pli.extend_from_slice(&0x2222_2222u32.to_be_bytes());
    pli.extend_from_slice(&0x1111_1111u32.to_be_bytes());
    cases.push(sr.clone());
    let compound = [sr.clone(), pli].concat();
    cases.push(compound.clone());
    let mut bad = compound.clone();
    bad[3] = 60;
    cases.push(bad);
    let mut badv = compound;
    badv[28] = 0x41; // second packet's version
    cases.push(badv);
    cases.push(sr[..6].to_vec());
    for payload in cases {
        rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &payload));
    }
}

#[test]
fn frames_the_fast_path_cannot_judge_go_to_the_stack() {
    root_or_skip!("frames_the_fast_path_cannot_judge_go_to_the_stack");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2))]);
    rig.apply(&t);
    let good = v4_frame(PUBLISHER, LOCAL, &rtp(1));
    // Truncated at every length from the Ethernet header (test_run needs >= 14 bytes) on.
    // Truncated at every length from a full IPv4 header on (BPF_PROG_TEST_RUN itself refuses
    // IPv4 frames shorter than an IPv4 header, though real ones can reach TC ingress).
    for n in 14 + 20..14 + 28 + 12 {
        rig.check(&t, &good[..n]);
    }
    let mut short_arp = good[..20].to_vec();
    short_arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    rig.check(&t, &short_arp);
    let mut badlen = good.clone();
    badlen[14 + 20 + 5] += 1; // UDP length
    rig.check(&t, &badlen);
    let mut short_udp = good.clone();
    short_udp[14 + 20 + 4..14 + 20 + 6].copy_from_slice(&4u16.to_be_bytes());
    rig.check(&t, &short_udp);
    let mut opts = good.clone();
    opts[14] = 0x46;
    opts[14 + 3] += 4;
    opts.splice(14 + 20..14 + 20, [1, 1, 1, 0]);
    rig.check(&t, &opts);
    for frag in [[0x20, 0], [0, 0x10], [0x20, 0x01]] {
        let mut f = good.clone();
        f[14 + 6] = frag[0]; // MF and/or offset
        f[14 + 7] = frag[1];
        rig.check(&t, &f);
    }
    let mut tcp = good.clone();
    tcp[14 + 9] = 6;
    rig.check(&t, &tcp);
    let mut arp = good.clone();
    arp[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
    rig.check(&t, &arp);
    let mut ihl = good.clone();
    ihl[14] = 0x44; // IHL 16 bytes
    rig.check(&t, &ihl);
    let mut total = good.clone();
    total[14 + 2..14 + 4].copy_from_slice(&2000u16.to_be_bytes());
    rig.check(&t, &total);
    // Ethernet padding after the IP packet is fine (short frames are padded to 60 bytes).
    let mut padded = v4_frame(PUBLISHER, LOCAL, &rtp(1));
    padded.extend_from_slice(&[0; 8]);
    rig.check(&t, &padded);
    // Not ours: another port, another address.
    rig.check(&t, &v4_frame(PUBLISHER, "10.200.0.1:4001", &rtp(1)));
    rig.check(&t, &v4_frame(PUBLISHER, "10.200.0.3:4000", &rtp(1)));
}

/// Found by fuzz_test_run.rs (seed 1795323839313202305, frame #105957): bytes after the IP
/// packet (a trailer; short frames' Ethernet padding) went out with every copy, so a full-size
/// packet plus trailer exceeded the egress MTU and all clones were dropped (tx_errors) though
/// the stack would have trimmed the trailer and sent them. Copies now leave trimmed.
#[test]
fn bytes_after_the_ip_packet_are_trimmed_before_the_fan_out() {
    root_or_skip!("bytes_after_the_ip_packet_are_trimmed_before_the_fan_out");
    let rig = Rig::new();
    let v6pub = "[fd00:200::9]:5000";
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), false, subscribers_v4(3)),
            entry(2, "[fd00:200::1]:4000", None, SourceRule::Fixed(a(v6pub)), false, subscribers(3, "fd00:200::1", "fd00:200::2", 41000)),
        ],
    );
    rig.apply(&t);
    // IPv4 packets of exactly the MTU and just below, with a 30-byte trailer.
    for payload in [LAB_MTU - 28, LAB_MTU - 29] {
        let mut f = v4_frame(PUBLISHER, LOCAL, &vec![0x77; payload]);
        f.extend_from_slice(&[0xee; 30]);
        assert_eq!(rig.check(&t, &f).len(), 3);
    }
    // IPv6, VLAN-tagged, MTU-sized plus trailer.
    let mut spec = FrameSpec::new(a(v6pub), a("[fd00:200::1]:4000"));
    spec.dst_mac = MAC0;
    spec.vlan = Some(790);
    let mut f = build_frame(&spec, &vec![0x66; LAB_MTU - 48]);
    f.extend_from_slice(&[0xee; 29]);
    assert_eq!(rig.check(&t, &f).len(), 3);
    // A short frame with Ethernet padding up to 60 bytes: copies without the padding.
    let mut f = v4_frame(PUBLISHER, LOCAL, b"hi");
    f.resize(60, 0);
    for c in rig.check(&t, &f) {
        assert_eq!(c.len(), 14 + 20 + 8 + 2);
    }
}

#[test]
fn stranger_stun_and_learning() {
    root_or_skip!("stranger_stun_and_learning");
    let rig = Rig::new();
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2)),
            entry(2, "10.200.0.1:4002", None, SourceRule::Learn(None), true, subscribers_v4(1)),
            entry(3, "10.200.0.1:4004", None, SourceRule::Learn(Some(a(PUBLISHER))), true, subscribers_v4(1)),
            entry(4, "10.200.0.1:4006", None, SourceRule::Any, true, subscribers_v4(1)),
        ],
    );
    rig.apply(&t);
    rig.check(&t, &v4_frame("10.200.0.66:5000", LOCAL, &rtp(1)));
    rig.check(&t, &v4_frame("10.200.0.9:5001", LOCAL, &rtp(1))); // right IP, wrong port
    let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
    stun.extend_from_slice(&[7; 12]);
    rig.check(&t, &v4_frame("10.200.0.66:5000", LOCAL, &stun));
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &stun));
    rig.check(&t, &v4_frame(PUBLISHER, "10.200.0.1:4002", &rtp(1)));
    // Learning, following PUBLISHER: its packets are forwarded here, another source's go up.
    rig.check(&t, &v4_frame(PUBLISHER, "10.200.0.1:4004", &rtp(1)));
    rig.check(&t, &v4_frame("10.200.0.66:5000", "10.200.0.1:4004", &rtp(1)));
    rig.check(&t, &v4_frame("10.200.0.9:5001", "10.200.0.1:4004", &rtp(1)));
    // Any source.
    rig.check(&t, &v4_frame(PUBLISHER, "10.200.0.1:4006", &rtp(1)));
    rig.check(&t, &v4_frame("10.200.0.66:5000", "10.200.0.1:4006", &rtp(1)));
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.streams[&1].drop_stranger, 2);
    assert_eq!(s.streams[&1].pass_slow, 2); // the two STUN packets
    assert_eq!(s.streams[&2].pass_slow, 1);
    assert_eq!((s.streams[&3].pass_slow, s.streams[&3].tx_copies), (2, 1));
    assert_eq!((s.streams[&4].drop_stranger, s.streams[&4].tx_copies), (0, 2));
}

/// A browser's transport (a WebRTC participant publishing two SSRCs, keyed, nominated) beside a
/// plain subscriber: the kernel hands what the browser sends to user space whole (its SRTP, and
/// its SRTCP, which the kernel cannot walk), DTLS from anyone too, and drops the rest of a
/// stranger's.
#[test]
fn a_webrtc_transport_goes_to_user_space_whole() {
    root_or_skip!("a_webrtc_transport_goes_to_user_space_whole");
    use mediaplane_core::model::{Model, StreamRef, StreamSpec};
    use mediaplane_core::srtp::{LegSrtp, SrtpKey, SrtpSuite};
    let rig = Rig::new();
    let mut m = Model::new();
    m.create_room("r").unwrap();
    m.add_webrtc_participant("r", "browser", a(LOCAL)).unwrap();
    m.add_participant("r", "plain", a("10.200.0.1:4002"), a("10.200.0.9:5001")).unwrap();
    for (name, ssrc) in [("audio", 1), ("video", 2)] {
        m.publish("r", "browser", name, StreamSpec { ssrc: Some(ssrc), ..Default::default() }).unwrap();
        m.subscribe("r", "plain", StreamRef { publisher: "browser".into(), stream: name.into() }).unwrap();
    }
    m.set_participant_nominated("r", "browser", Some(a(PUBLISHER))).unwrap();
    let key = || Some(SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![7; 30]).unwrap());
    m.set_participant_srtp("r", "browser", LegSrtp { inbound: key(), outbound: key() }).unwrap();
    let t = mediaplane_core::ForwardingTable::compile(&m, 1);
    rig.apply(&t);
    let mut sr = vec![0x80, 200, 0, 6];
    sr.extend_from_slice(&2u32.to_be_bytes());
    sr.extend_from_slice(&[0; 20]);
    // SRTCP: an index and a tag after the (encrypted) reports, which a compound walk refuses.
    let srtcp = [&sr[..], &[0x80, 0, 0, 1], &[0xaa; 10]].concat();
    let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
    stun.extend_from_slice(&[7; 12]);
    for payload in [rtp(1), rtp(2), rtp(3), srtcp.clone(), vec![22, 254, 253, 0, 0], stun.clone()] {
        rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &payload));
    }
    // A stranger's: dropped here, but its DTLS goes up (the handshake judges it against ICE).
    rig.check(&t, &v4_frame("10.200.0.66:5000", LOCAL, &srtcp));
    rig.check(&t, &v4_frame("10.200.0.66:5000", LOCAL, &rtp(1)));
    rig.check(&t, &v4_frame("10.200.0.66:5000", LOCAL, &[22, 254, 253, 0, 0]));
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.global["pass_slow_stream"], 6);
    assert_eq!(s.global["pass_stun"], 1);
    assert_eq!((s.global["drop_stranger"], s.global["drop_malformed"]), (2, 0));
}

#[test]
fn a_relay_reporting_dtmf_passes_up_its_events_and_forwards_its_audio() {
    root_or_skip!("a_relay_reporting_dtmf_passes_up_its_events_and_forwards_its_audio");
    use mediaplane_core::model::{LegSpec, Model, Side};
    let rig = Rig::new();
    let mut m = Model::new();
    // Strict: each leg's source is the one signalled (no learning window).
    let leg = |local: &str, remote: &str| LegSpec { local: a(local), remote: Some(a(remote)), strict: true, rtp: true, follow: Default::default() };
    // The callee where the lab's subscribers are (a resolved neighbour).
    m.create_relay("call", leg(LOCAL, PUBLISHER), leg("10.200.0.1:4002", "10.200.0.2:5001")).unwrap();
    m.set_leg_telephone_events("call", Side::A, vec![101]).unwrap();
    m.set_report_dtmf("call", true).unwrap();
    let t = mediaplane_core::ForwardingTable::compile(&m, 1);
    rig.apply(&t);
    let (audio, event, other) = (build_rtp(8, 1, 160, 7, &[0xd5; 160]), build_rtp(101, 2, 320, 7, &[5, 0x8a, 1, 64]), build_rtp(0, 3, 480, 7, &[0xff; 160]));
    for payload in [&audio, &event, &other, &event] {
        rig.check(&t, &v4_frame(PUBLISHER, LOCAL, payload));
    }
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!((s.global["forwarded"], s.global["pass_dtmf"]), (2, 2));
}

#[test]
fn ssrc_narrowed_streams_and_rtcp_demux() {
    root_or_skip!("ssrc_narrowed_streams_and_rtcp_demux");
    let rig = Rig::new();
    let subs = subscribers_v4(3);
    let t = table(
        1,
        vec![
            entry(1, LOCAL, Some(1), SourceRule::Fixed(a(PUBLISHER)), true, subs[..1].to_vec()),
            entry(2, LOCAL, Some(2), SourceRule::Fixed(a(PUBLISHER)), true, subs[1..].to_vec()),
        ],
    );
    rig.apply(&t);
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(1)));
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(2)));
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(3))); // unknown SSRC: drop no_stream
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, b"not rtp at all")); // malformed
    let mut sr = vec![0x80, 200, 0, 6];
    sr.extend_from_slice(&2u32.to_be_bytes());
    sr.extend_from_slice(&[0; 20]);
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &sr)); // RTCP follows SSRC 2
                                                     // With a wildcard stream too, unknown SSRCs fall back to it.
    let mut t2 = t.clone();
    t2.version = 2;
    let w = entry(3, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), false, subs[2..].to_vec());
    t2.streams.insert(w.key, w);
    rig.apply(&t2);
    rig.check(&t2, &v4_frame(PUBLISHER, LOCAL, &rtp(3)));
    rig.check(&t2, &v4_frame(PUBLISHER, LOCAL, &rtp(1)));
}

#[test]
fn ipv6_and_vlan_tagged_frames_are_forwarded() {
    root_or_skip!("ipv6_and_vlan_tagged_frames_are_forwarded");
    let rig = Rig::new();
    let v6subs = subscribers(3, "fd00:200::1", "fd00:200::2", 41000);
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2)),
            entry(2, "[fd00:200::1]:4000", None, SourceRule::Fixed(a("[fd00:200::9]:5000")), true, v6subs),
        ],
    );
    rig.apply(&t);
    let mut spec = FrameSpec::new(a("[fd00:200::9]:5000"), a("[fd00:200::1]:4000"));
    spec.dst_mac = MAC0;
    rig.check(&t, &build_frame(&spec, &rtp(5)));
    // IPv6 stranger and IPv6 with an extension header (hop-by-hop) / fragment header.
    let mut stranger = spec.clone();
    stranger.src = a("[fd00:200::66]:5000");
    rig.check(&t, &build_frame(&stranger, &rtp(5)));
    let mut hbh = build_frame(&spec, &rtp(5));
    hbh[14 + 6] = 0;
    let before = rig.fp.kernel_stats().unwrap();
    assert_eq!(rig.fp.test_run(&hbh, Some(rig.ifindex)).unwrap().retval, TC_ACT_OK);
    hbh[14 + 6] = 44;
    assert_eq!(rig.fp.test_run(&hbh, Some(rig.ifindex)).unwrap().retval, TC_ACT_OK);
    let d = delta(&before, &rig.fp.kernel_stats().unwrap());
    assert_eq!((d.get("pass_ipv6_ext"), d.get("pass_fragment")), (Some(&1), Some(&1)), "{d:?}");
    // VLAN-tagged IPv4: forwarded, copies leave untagged.
    let mut tagged = FrameSpec::new(a(PUBLISHER), a(LOCAL));
    tagged.dst_mac = MAC0;
    tagged.vlan = Some(42);
    rig.check(&t, &build_frame(&tagged, &rtp(5)));
    // Double tags go to the stack.
    let mut qinq = build_frame(&tagged, &rtp(5));
    qinq.splice(16..16, [0x81, 0x00, 0x00, 0x07]);
    let before = rig.fp.kernel_stats().unwrap();
    assert_eq!(rig.fp.test_run(&qinq, Some(rig.ifindex)).unwrap().retval, TC_ACT_OK);
    let d = delta(&before, &rig.fp.kernel_stats().unwrap());
    assert_eq!(d.get("pass_vlan"), Some(&1), "{d:?}");
}

#[test]
fn unresolved_next_hop_hands_the_whole_packet_to_the_slow_path() {
    root_or_skip!("unresolved_next_hop_hands_the_whole_packet_to_the_slow_path");
    let rig = Rig::new();
    // Two resolvable subscribers and one (10.200.0.3) without a neighbour entry.
    let mut subs = subscribers_v4(2);
    subs.push((a("10.200.0.1:30009"), a("10.200.0.3:40009")));
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subs)]);
    rig.apply(&t);
    let before = rig.fp.kernel_stats().unwrap();
    let run = rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &rtp(1)), Some(rig.ifindex)).unwrap();
    assert_eq!(run.retval, TC_ACT_OK);
    let d = delta(&before, &rig.fp.kernel_stats().unwrap());
    assert_eq!(d.get("pass_no_neigh"), Some(&1), "{d:?}");
    assert_eq!(d.get("tx_copies"), None, "no copy may leave when the packet goes to the slow path");
    assert!(rig.cap.collect(0, Duration::from_millis(150), udp_to(&[40000, 40001, 40009])).is_empty());
    // Mixed address families: the kernel leaves the whole stream to the slow path.
    let t = table(2, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, vec![(a("[fd00:200::1]:1"), a("[fd00:200::2]:2"))])]);
    rig.apply(&t);
    rig.check(&t, &v4_frame(PUBLISHER, LOCAL, &rtp(1)));
    let _ = &rig.lab;
}

#[test]
fn udp_checksum_zero_stays_zero_on_ipv4() {
    root_or_skip!("udp_checksum_zero_stays_zero_on_ipv4");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), false, subscribers_v4(2))]);
    rig.apply(&t);
    let mut f = v4_frame(PUBLISHER, LOCAL, b"no checksum");
    f[14 + 20 + 6] = 0;
    f[14 + 20 + 7] = 0;
    for c in rig.check(&t, &f) {
        assert_eq!(&c[14 + 20 + 6..14 + 20 + 8], &[0, 0]);
    }
}

/// Not a check: the program's run time per copy on this machine, warm (back to back) and cold-ish
/// (1 ms apart, like real media). Copies leave through a veth whose peer drops them, so the time is the
/// program's own work plus clone and transmit; BPF_PROG_TEST_RUN runs in process context, so
/// the receiving veth's softirq (a quick PACKET_OTHERHOST drop) runs inside the helper too. Run:
/// `cargo test --release -p mediaplane-ebpf --test test_run copy_cost -- --ignored --nocapture`
#[test]
#[ignore]
fn copy_cost_microbench() {
    root_or_skip!("copy_cost_microbench");
    let ns = Netns::new("m");
    let v0 = format!("{}a", ns.name);
    let v1 = format!("{}b", ns.name);
    let d0 = format!("{}d", ns.name);
    ns.ip(&["link", "add", &v0, "type", "veth", "peer", "name", &v1]);
    let d1 = format!("{}e", ns.name);
    // The copies' next hop MAC is not d1's: its stack drops them right away (PACKET_OTHERHOST).
    ns.ip(&["link", "add", &d0, "type", "veth", "peer", "name", &d1]);
    for i in [&v0, &v1, &d0, &d1] {
        ns.ip(&["link", "set", i, "up"]);
    }
    ns.ip(&["addr", "add", "10.200.0.1/24", "dev", &v0]);
    ns.ip(&["addr", "add", "10.201.0.1/24", "dev", &d0]);
    ns.ip(&["neigh", "add", "10.201.0.2", "lladdr", "02:00:00:00:00:a1", "dev", &d0, "nud", "permanent"]);
    ns.sysctl("net/ipv4/conf/all/forwarding", "1");
    let _g = ns.enter();
    // MP_AB_OBJECT=<path to another sfu_tc.bpf.o>: measure it too, interleaved with this build.
    let mut planes = vec![("this build".to_string(), FastPath::load(&LoadOptions::default()).expect("load"))];
    if let Ok(path) = std::env::var("MP_AB_OBJECT") {
        let obj = std::fs::read(&path).expect("MP_AB_OBJECT");
        planes.push((path, FastPath::load_object(&LoadOptions::default(), &obj).expect("load MP_AB_OBJECT")));
    }
    let ifx = ifindex(&v0);
    for round in 0..2 {
        for (name, fp) in &planes {
            println!("{name} (round {round})");
            for n in [11usize, 63] {
                let subs: Vec<_> = (0..n).map(|i| (a(&format!("10.201.0.1:{}", 30000 + i)), a(&format!("10.201.0.2:{}", 40000 + i)))).collect();
                let t = table(n as u64, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subs)]);
                fp.apply(Arc::new(t)).unwrap();
                let frame = v4_frame(PUBLISHER, LOCAL, &rtp(1));
                for (label, gap) in [("warm", Duration::ZERO), ("1ms apart", Duration::from_millis(1))] {
                    let mut d: Vec<u64> = Vec::new();
                    let runs = if gap.is_zero() { 5000 } else { 500 };
                    for _ in 0..runs {
                        let r = fp.test_run(&frame, Some(ifx)).unwrap();
                        assert!(r.retval == TC_ACT_REDIRECT || r.retval == TC_ACT_SHOT, "{}", r.retval);
                        d.push(r.duration_ns);
                        if !gap.is_zero() {
                            std::thread::sleep(gap);
                        }
                    }
                    d.sort();
                    let per = |x: u64| x as f64 / n as f64;
                    println!(
                        "copies {n:3} {label:10}: ns/copy p50 {:7.1}  p10 {:7.1}  p90 {:7.1}  mean {:7.1}",
                        per(d[d.len() / 2]),
                        per(d[d.len() / 10]),
                        per(d[d.len() * 9 / 10]),
                        d.iter().sum::<u64>() as f64 / d.len() as f64 / n as f64
                    );
                }
                let s = fp.kernel_stats().unwrap();
                assert_eq!(s.get("tx_errors"), 0, "{:?}", s.global);
            }
        }
    }
}

#[test]
fn next_hop_cache_follows_neighbour_changes() {
    root_or_skip!("next_hop_cache_follows_neighbour_changes");
    let rig = Rig::new();
    let t = table(1, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1))]);
    rig.apply(&t);
    let frame = v4_frame(PUBLISHER, LOCAL, &rtp(1));
    let dst_mac = |fp: &FastPath| {
        let r = fp.test_run(&frame, Some(rig.ifindex)).unwrap();
        assert_eq!(r.retval, TC_ACT_REDIRECT);
        <[u8; 6]>::try_from(&r.data_out[0..6]).unwrap()
    };
    assert_eq!(dst_mac(&rig.fp), MAC1);
    assert_eq!(dst_mac(&rig.fp), MAC1, "cached");
    // The watcher hears the neighbour change and invalidates the cache.
    let gen = rig.fp.next_hop_generation_map().unwrap();
    let read_gen = || {
        use libbpf_rs::MapCore;
        let v = gen.lookup(&0u32.to_ne_bytes(), libbpf_rs::MapFlags::ANY).unwrap().unwrap();
        u32::from_ne_bytes(v[..4].try_into().unwrap())
    };
    let watch = mediaplane_ebpf::nhwatch::NextHopWatch::start(rig.fp.next_hop_generation_map().unwrap(), None).unwrap();
    let g0 = read_gen();
    rig.lab.ns.ip(&["neigh", "replace", "10.200.0.2", "lladdr", "02:00:00:00:00:b1", "dev", &rig.lab.v0, "nud", "permanent"]);
    let start = std::time::Instant::now();
    while read_gen() == g0 && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_ne!(read_gen(), g0, "the watcher saw no change");
    assert_eq!(dst_mac(&rig.fp), [0x02, 0, 0, 0, 0, 0xb1], "re-resolved after the change");
    drop(watch);
    // An explicit invalidation works too.
    rig.lab.ns.ip(&["neigh", "replace", "10.200.0.2", "lladdr", "02:00:00:00:00:a1", "dev", &rig.lab.v0, "nud", "permanent"]);
    rig.fp.invalidate_next_hops().unwrap();
    assert_eq!(dst_mac(&rig.fp), MAC1);
}

/// A stream limited to R packets/s flooded for a second through BPF_PROG_TEST_RUN: it forwards
/// R per second (within 5%), drops and counts the rest; an unlimited stream beside it is untouched.
#[test]
fn rate_limited_stream_forwards_its_rate_under_a_flood() {
    root_or_skip!("rate_limited_stream_forwards_its_rate_under_a_flood");
    const RATE: u32 = 1000;
    let rig = Rig::new();
    let mut limited = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1));
    limited.rate = Some(mediaplane_core::RateLimit { pps: RATE, bps: 0, burst_ms: 10 });
    let free = entry(2, "10.200.0.1:4002", None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1));
    let t = table(1, vec![limited, free]);
    rig.apply(&t);
    let frame = v4_frame(PUBLISHER, LOCAL, &rtp(1));
    let before = rig.fp.kernel_stats().unwrap();
    let start = std::time::Instant::now();
    let (mut runs, mut forwarded) = (0u64, 0u64);
    while start.elapsed() < Duration::from_secs(1) && runs < 5_000_000 {
        let r = rig.fp.test_run(&frame, Some(rig.ifindex)).unwrap();
        runs += 1;
        match r.retval {
            TC_ACT_REDIRECT => forwarded += 1,
            TC_ACT_SHOT => {}
            v => panic!("verdict {v}"),
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let want = RATE as f64 * secs;
    assert!(runs as f64 > 4.0 * want, "flood too slow to test anything: {runs} runs");
    assert!((forwarded as f64 - want).abs() <= 0.05 * want, "{forwarded} forwarded in {secs:.3} s, want {want:.0} ± 5%");
    let d = delta(&before, &rig.fp.kernel_stats().unwrap());
    assert_eq!(d.get("drop_rate_limited").copied().unwrap_or(0), runs - forwarded, "{d:?}");
    assert_eq!(d.get("forwarded").copied().unwrap_or(0), forwarded, "{d:?}");
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.streams[&1].drop_rate_limited, runs - forwarded);
    assert_eq!(s.to_dataplane_stats(1).total.drop_rate_limited, runs - forwarded);
    // The unlimited stream forwards everything.
    let other = v4_frame(PUBLISHER, "10.200.0.1:4002", &rtp(1));
    for _ in 0..100 {
        assert_eq!(rig.fp.test_run(&other, Some(rig.ifindex)).unwrap().retval, TC_ACT_REDIRECT);
    }
    // Lifting the limit lifts it at once.
    let mut t2 = t.clone();
    t2.version = 2;
    let keys: Vec<_> = t2.streams.keys().copied().collect();
    keys.iter().for_each(|k| t2.streams.get_mut(k).unwrap().rate = None);
    rig.apply(&t2);
    for _ in 0..100 {
        assert_eq!(rig.fp.test_run(&frame, Some(rig.ifindex)).unwrap().retval, TC_ACT_REDIRECT);
    }
}
#[test]
fn xdp_prefilter_drops_only_certain_strangers() {
    root_or_skip!("xdp_prefilter_drops_only_certain_strangers");
    let rig = Rig::new();
    let pf = Prefilter::load(&rig.fp).expect("load the XDP pre-filter");
    let subs = subscribers_v4(3);
    let other = "10.200.0.8:5000";
    let t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subs[..2].to_vec()),
            entry(2, "10.200.0.1:4002", None, SourceRule::Learn(None), true, subs[..1].to_vec()),
            entry(3, "10.200.0.1:4004", Some(1), SourceRule::Fixed(a(PUBLISHER)), true, subs[..1].to_vec()),
            entry(4, "10.200.0.1:4006", None, SourceRule::Fixed(a(PUBLISHER)), true, subs[..1].to_vec()),
            entry(5, "10.200.0.1:4006", Some(7), SourceRule::Fixed(a(other)), true, subs[1..2].to_vec()),
            entry(6, "10.200.0.1:4008", None, SourceRule::Fixed(a(PUBLISHER)), false, subs[2..].to_vec()),
            // Mixed families: the kernel leaves its fan-out to the slow path, not its source check.
            entry(7, "10.200.0.1:4010", None, SourceRule::Fixed(a(PUBLISHER)), true, vec![(a("[fd00:200::1]:1"), a("[fd00:200::2]:2"))]),
            entry(8, "[fd00:200::1]:4000", None, SourceRule::Fixed(a("[fd00:200::9]:5000")), true, vec![]),
            // SSRC-narrowed only, two SSRCs, one source (the default conference's address).
            entry(10, "10.200.0.1:4012", Some(1), SourceRule::Fixed(a(PUBLISHER)), true, subs[..1].to_vec()),
            entry(11, "10.200.0.1:4012", Some(2), SourceRule::Fixed(a(PUBLISHER)), true, subs[1..2].to_vec()),
            // A non-RTP wildcard stream beside a narrowed one, one source.
            entry(12, "10.200.0.1:4014", None, SourceRule::Fixed(a(PUBLISHER)), false, subs[..1].to_vec()),
            entry(13, "10.200.0.1:4014", Some(5), SourceRule::Fixed(a(PUBLISHER)), true, subs[1..2].to_vec()),
            // Narrowed, one of them learning (a relay leg would be a learning wildcard: 4002).
            entry(14, "10.200.0.1:4016", Some(1), SourceRule::Learn(None), true, subs[..1].to_vec()),
            entry(15, "10.200.0.1:4016", Some(2), SourceRule::Fixed(a(PUBLISHER)), true, subs[1..2].to_vec()),
            // A learning leg that follows a source already; one that takes any source.
            entry(16, "10.200.0.1:4018", None, SourceRule::Learn(Some(a(PUBLISHER))), true, subs[..1].to_vec()),
            entry(17, "10.200.0.1:4020", None, SourceRule::Any, true, subs[..1].to_vec()),
        ],
    );
    rig.apply(&t);
    let evil = "10.200.0.66:5000";
    let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
    stun.extend_from_slice(&[7; 12]);
    let mut sr = vec![0x80, 200, 0, 6];
    sr.extend_from_slice(&1u32.to_be_bytes());
    sr.extend_from_slice(&[0; 20]);
    let mut ext = build_rtp(96, 1, 1, 1, &[]);
    ext[0] |= 0x10;
    ext.extend_from_slice(&[0xbe, 0xde, 0, 1, 0x10, 0xaa, 0, 0]);
    let mut bad_ext = ext.clone();
    bad_ext[15] = 9;
    let mut pad = build_rtp(96, 1, 1, 1, &[1, 2, 3, 4]);
    pad[0] |= 0x20;
    *pad.last_mut().unwrap() = 4;
    let mut bad_pad = pad.clone();
    *bad_pad.last_mut().unwrap() = 200;
    let stranger = v4_frame(evil, LOCAL, &rtp(1));
    // The XDP counter a frame must be dropped under, or None: it must pass.
    const STRANGER: Option<&str> = Some("xdp_drop_stranger");
    const NO_STREAM: Option<&str> = Some("xdp_drop_no_stream");
    let (n412, n414, n416) = ("10.200.0.1:4012", "10.200.0.1:4014", "10.200.0.1:4016");
    let mut cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        ("stranger RTP", stranger.clone(), STRANGER),
        ("right IP, wrong port", v4_frame("10.200.0.9:5001", LOCAL, &rtp(1)), STRANGER),
        ("stranger RTP with an extension", v4_frame(evil, LOCAL, &ext), STRANGER),
        ("stranger RTP with padding", v4_frame(evil, LOCAL, &pad), STRANGER),
        ("stranger on a non-RTP stream", v4_frame(evil, "10.200.0.1:4008", b"anything"), STRANGER),
        ("stranger, empty payload, non-RTP stream", v4_frame(evil, "10.200.0.1:4008", b""), STRANGER),
        ("stranger on a slow-path stream", v4_frame(evil, "10.200.0.1:4010", &rtp(1)), STRANGER),
        ("owner", v4_frame(PUBLISHER, LOCAL, &rtp(1)), None),
        ("stranger STUN", v4_frame(evil, LOCAL, &stun), None),
        ("stranger STUN, non-RTP stream", v4_frame(evil, "10.200.0.1:4008", &stun), None),
        ("owner STUN", v4_frame(PUBLISHER, LOCAL, &stun), None),
        ("latching stream", v4_frame(evil, "10.200.0.1:4002", &rtp(1)), None),
        ("learning stream following another source", v4_frame(evil, "10.200.0.1:4018", &rtp(1)), None),
        ("stream taking any source", v4_frame(evil, "10.200.0.1:4020", &rtp(1)), None),
        ("SSRC-narrowed, no wildcard, known SSRC", v4_frame(evil, "10.200.0.1:4004", &rtp(1)), STRANGER),
        ("SSRC-narrowed, no wildcard, unknown SSRC", v4_frame(evil, "10.200.0.1:4004", &rtp(2)), NO_STREAM),
        ("SSRC-narrowed with a wildcard of another source", v4_frame(evil, "10.200.0.1:4006", &rtp(3)), None),
        ("narrowed stream's own source (another than the wildcard's)", v4_frame(other, "10.200.0.1:4006", &rtp(7)), None),
        ("stranger garbage on an RTP stream", v4_frame(evil, LOCAL, b"garbage, not RTP"), None),
        ("stranger bad extension", v4_frame(evil, LOCAL, &bad_ext), None),
        ("stranger bad padding", v4_frame(evil, LOCAL, &bad_pad), None),
        ("stranger RTCP", v4_frame(evil, LOCAL, &sr), None),
        ("not ours: port", v4_frame(evil, "10.200.0.1:4001", &rtp(1)), None),
        ("not ours: address", v4_frame(evil, "10.200.0.3:4000", &rtp(1)), None),
        // Narrowed only, one source.
        ("narrowed: stranger, SSRC 1", v4_frame(evil, n412, &rtp(1)), STRANGER),
        ("narrowed: stranger, SSRC 2", v4_frame(evil, n412, &rtp(2)), STRANGER),
        ("narrowed: stranger with an extension, SSRC 2", v4_frame(evil, n412, &ext_ssrc(2)), STRANGER),
        ("narrowed: owner's IP, wrong port, SSRC 1", v4_frame("10.200.0.9:5001", n412, &rtp(1)), STRANGER),
        ("narrowed: stranger, unknown SSRC", v4_frame(evil, n412, &rtp(3)), NO_STREAM),
        ("narrowed: stranger, SSRC 0 (none such)", v4_frame(evil, n412, &rtp(0)), NO_STREAM),
        ("narrowed: owner, SSRC 1", v4_frame(PUBLISHER, n412, &rtp(1)), None),
        ("narrowed: owner, SSRC 2", v4_frame(PUBLISHER, n412, &rtp(2)), None),
        ("narrowed: owner, unknown SSRC", v4_frame(PUBLISHER, n412, &rtp(3)), None),
        ("narrowed: stranger STUN", v4_frame(evil, n412, &stun), None),
        ("narrowed: owner STUN", v4_frame(PUBLISHER, n412, &stun), None),
        ("narrowed: stranger garbage", v4_frame(evil, n412, b"garbage, not RTP"), None),
        ("narrowed: stranger, empty payload", v4_frame(evil, n412, b""), None),
        ("narrowed: stranger bad padding", v4_frame(evil, n412, &bad_pad), None),
        ("narrowed: stranger RTCP, SSRC 1", v4_frame(evil, n412, &sr), None),
        // A non-RTP wildcard plus a narrowed stream: the address wants RTP (classify), and an
        // unknown SSRC falls back to the wildcard stream, whose source it is not.
        ("non-RTP wildcard + narrowed: stranger, its SSRC", v4_frame(evil, n414, &rtp(5)), STRANGER),
        ("non-RTP wildcard + narrowed: stranger, other SSRC", v4_frame(evil, n414, &rtp(6)), STRANGER),
        ("non-RTP wildcard + narrowed: stranger, not RTP", v4_frame(evil, n414, b"anything"), None),
        ("non-RTP wildcard + narrowed: owner, not RTP", v4_frame(PUBLISHER, n414, b"anything"), None),
        ("non-RTP wildcard + narrowed: owner, its SSRC", v4_frame(PUBLISHER, n414, &rtp(5)), None),
        ("non-RTP wildcard + narrowed: owner, other SSRC", v4_frame(PUBLISHER, n414, &rtp(6)), None),
        ("non-RTP wildcard + narrowed: stranger STUN", v4_frame(evil, n414, &stun), None),
        // A latching stream on the address: no one source.
        ("narrowed + latching: stranger, latching SSRC", v4_frame(evil, n416, &rtp(1)), None),
        ("narrowed + latching: stranger, fixed SSRC", v4_frame(evil, n416, &rtp(2)), None),
        ("narrowed + latching: stranger, unknown SSRC", v4_frame(evil, n416, &rtp(3)), None),
    ];
    let mut tcp = stranger.clone();
    tcp[14 + 9] = 6;
    cases.push(("non-UDP", tcp, None));
    for (name, frag) in [("fragment MF", [0x20u8, 0]), ("fragment offset", [0, 0x10])] {
        let mut f = stranger.clone();
        f[14 + 6] = frag[0];
        f[14 + 7] = frag[1];
        cases.push((name, f, None));
    }
    let mut opts = stranger.clone();
    opts[14] = 0x46;
    opts[14 + 3] += 4;
    opts.splice(14 + 20..14 + 20, [1, 1, 1, 0]);
    cases.push(("IP options", opts, None));
    cases.push(("truncated", stranger[..stranger.len() - 10].to_vec(), None));
    let mut badlen = stranger.clone();
    badlen[14 + 20 + 5] += 1;
    cases.push(("bad UDP length", badlen, None));
    let mut v6 = FrameSpec::new(a("[fd00:200::66]:5000"), a("[fd00:200::1]:4000"));
    v6.dst_mac = MAC0;
    cases.push(("IPv6 stranger", build_frame(&v6, &rtp(5)), None));
    let mut tagged = FrameSpec::new(a(evil), a(LOCAL));
    tagged.dst_mac = MAC0;
    tagged.vlan = Some(42);
    cases.push(("VLAN-tagged stranger", build_frame(&tagged, &rtp(5)), None));

    let mut drops = BTreeMap::new();
    for (name, frame, want) in &cases {
        let before = pf.counters().unwrap();
        let verdict = pf.test_run(frame).unwrap();
        let after = pf.counters().unwrap();
        let d = |k: &str| after[k] - before[k];
        if let Some(counter) = want {
            *drops.entry(*counter).or_insert(0) += 1;
            assert_eq!(verdict, XDP_DROP, "{name}: must be dropped");
            // Only certain drops, counted under classify()'s reason: the reference and TC agree.
            assert_eq!(reference(&t, frame), Expect::Drop(tc_counter(counter)), "{name}");
            let f = parse_frame(frame).unwrap();
            let other = if *counter == "xdp_drop_stranger" { "xdp_drop_no_stream" } else { "xdp_drop_stranger" };
            assert_eq!((d(counter), d(other), d("xdp_pass"), d("xdp_drop_bytes")), (1, 0, 0, f.payload_len as u64), "{name}");
        } else {
            assert_eq!(verdict, XDP_PASS, "{name}: must pass");
            assert_eq!((d("xdp_drop_stranger"), d("xdp_drop_no_stream"), d("xdp_pass")), (0, 0, 1), "{name}");
        }
        // Whatever XDP passes, TC still decides as the reference says.
        rig.check(&t, frame);
    }
    assert_eq!(drops, BTreeMap::from([("xdp_drop_stranger", 14), ("xdp_drop_no_stream", 3)]));

    // One table for both programs: the stranger becomes the owner, XDP lets it through at once.
    let mut t2 = t.clone();
    t2.version = 2;
    let keys: Vec<_> = t2.streams.iter().filter(|(_, e)| e.id == 1).map(|(k, _)| *k).collect();
    keys.iter().for_each(|k| t2.streams.get_mut(k).unwrap().source = SourceRule::Fixed(a(evil)));
    rig.apply(&t2);
    assert_eq!(pf.test_run(&stranger).unwrap(), XDP_PASS);
    rig.check(&t2, &stranger);
    // ...and a narrowed stream of another source appearing on the address stops its drops too.
    let mut t3 = t.clone();
    t3.version = 3;
    let narrowed = entry(9, LOCAL, Some(99), SourceRule::Fixed(a(other)), true, subs[2..].to_vec());
    t3.streams.insert(narrowed.key, narrowed);
    rig.apply(&t3);
    assert_eq!(pf.test_run(&stranger).unwrap(), XDP_PASS);
    rig.apply(&t);
    assert_eq!(pf.test_run(&stranger).unwrap(), XDP_DROP);
    // On a narrowed-only address, one SSRC entry changing its source is enough: the placeholder
    // is rewritten, XDP passes both SSRCs' strangers and TC judges them (one is now the source).
    let narrowed_stranger = |ssrc| v4_frame(evil, n412, &rtp(ssrc));
    let mut t4 = t.clone();
    t4.version = 4;
    t4.streams.get_mut(&IngressKey { local: a(n412), ssrc: Some(2) }).unwrap().source = SourceRule::Fixed(a(evil));
    rig.apply(&t4);
    for ssrc in [1, 2, 3] {
        assert_eq!(pf.test_run(&narrowed_stranger(ssrc)).unwrap(), XDP_PASS, "SSRC {ssrc}");
        rig.check(&t4, &narrowed_stranger(ssrc));
    }
    rig.apply(&t);
    for (ssrc, counter) in [(1, "xdp_drop_stranger"), (2, "xdp_drop_stranger"), (3, "xdp_drop_no_stream")] {
        let before = pf.counters().unwrap()[counter];
        assert_eq!(pf.test_run(&narrowed_stranger(ssrc)).unwrap(), XDP_DROP, "SSRC {ssrc}");
        assert_eq!(pf.counters().unwrap()[counter], before + 1, "SSRC {ssrc}");
    }
    pf.reset_counters().unwrap();
    assert!(pf.counters().unwrap().values().all(|v| *v == 0));

    // Mutated frames: whatever XDP drops, the reference drops under the reason XDP counts
    // (never the owner's media, STUN, a latching stream's packet, or a malformed one).
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut rnd = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let (mut dropped, mut passed) = (BTreeMap::new(), 0);
    for i in 0..4000 {
        let (_, base, _) = &cases[i % cases.len()];
        let mut f = base.clone();
        for _ in 0..1 + rnd() % 3 {
            // Mostly the IP/UDP headers and the first payload bytes.
            let at = (14 + rnd() % 40) as usize;
            if at < f.len() {
                f[at] = rnd() as u8;
            }
        }
        if rnd() % 8 == 0 {
            f.truncate((rnd() as usize % f.len()).max(14));
        }
        let before = pf.counters().unwrap();
        if pf.test_run(&f).unwrap() == XDP_DROP {
            let after = pf.counters().unwrap();
            let counter = ["xdp_drop_stranger", "xdp_drop_no_stream"].into_iter().find(|c| after[c] > before[c]).expect("a drop is counted");
            *dropped.entry(counter).or_insert(0) += 1;
            assert_eq!(reference(&t, &f), Expect::Drop(tc_counter(counter)), "XDP dropped ({counter}) {f:02x?}");
        } else {
            passed += 1;
        }
    }
    let n = |c: &str| dropped.get(c).copied().unwrap_or(0);
    assert!(
        n("xdp_drop_stranger") > 100 && n("xdp_drop_no_stream") > 20 && passed > 100,
        "{dropped:?} dropped, {passed} passed: the mutations test too little"
    );
}

/// The TC counter of the verdict an XDP drop counter stands for.
fn tc_counter(xdp: &str) -> &'static str {
    match xdp {
        "xdp_drop_stranger" => "drop_stranger",
        "xdp_drop_no_stream" => "drop_no_stream",
        c => panic!("no XDP drop counter {c}"),
    }
}

/// RTP with a one-word header extension and SSRC `ssrc`.
fn ext_ssrc(ssrc: u32) -> Vec<u8> {
    let mut ext = build_rtp(96, 1, 1, ssrc, &[]);
    ext[0] |= 0x10;
    ext.extend_from_slice(&[0xbe, 0xde, 0, 1, 0x10, 0xaa, 0, 0]);
    ext
}

/// A per-source limit of R packets/s: one source flooding through BPF_PROG_TEST_RUN gets R per
/// second forwarded (within 5%), the rest dropped as `drop_source_limited`; another source
/// sending beside it is not affected; the flooding source's STUN is limited too (same bucket).
#[test]
fn source_limit_holds_a_flooding_source_and_spares_others() {
    root_or_skip!("source_limit_holds_a_flooding_source_and_spares_others");
    const RATE: u32 = 1000;
    let rig = Rig::new();
    let other = "10.200.0.8:5000";
    let mut t = table(
        1,
        vec![
            entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1)),
            // The same source IP on another port and SFU address: the same bucket.
            entry(2, "10.200.0.1:4002", None, SourceRule::Fixed(a("10.200.0.9:5002")), true, subscribers_v4(1)),
            entry(3, "10.200.0.1:4004", None, SourceRule::Fixed(a(other)), true, subscribers_v4(1)),
        ],
    );
    t.set_source_limit(Some(mediaplane_core::RateLimit { pps: RATE, bps: 0, burst_ms: 10 }));
    rig.apply(&t);
    let frames = [v4_frame(PUBLISHER, LOCAL, &rtp(1)), v4_frame("10.200.0.9:5002", "10.200.0.1:4002", &rtp(2))];
    let bystander = v4_frame(other, "10.200.0.1:4004", &rtp(3));
    let before = rig.fp.kernel_stats().unwrap();
    let start = std::time::Instant::now();
    let (mut runs, mut forwarded, mut others) = (0u64, 0u64, 0u64);
    let mut last_bystander = start;
    while start.elapsed() < Duration::from_secs(1) && runs < 5_000_000 {
        let r = rig.fp.test_run(&frames[(runs % 2) as usize], Some(rig.ifindex)).unwrap();
        runs += 1;
        match r.retval {
            TC_ACT_REDIRECT => forwarded += 1,
            TC_ACT_SHOT => {}
            v => panic!("verdict {v}"),
        }
        if last_bystander.elapsed() >= Duration::from_millis(4) {
            // RATE/4 per second: well under the limit, however fast the flood runs.
            last_bystander = std::time::Instant::now();
            let b0 = rig.fp.kernel_stats().unwrap();
            let rv = rig.fp.test_run(&bystander, Some(rig.ifindex)).unwrap().retval;
            assert_eq!(
                rv,
                TC_ACT_REDIRECT,
                "the other source was limited after {runs} runs in {:?}: {:?}",
                start.elapsed(),
                delta(&b0, &rig.fp.kernel_stats().unwrap())
            );
            others += 1;
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let want = RATE as f64 * secs;
    assert!(runs as f64 > 4.0 * want, "flood too slow to test anything: {runs} runs");
    assert!((forwarded as f64 - want).abs() <= 0.05 * want, "{forwarded} forwarded in {secs:.3} s, want {want:.0} ± 5%");
    let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
    stun.extend_from_slice(&[7; 12]);
    // STUN from the flooding source, back to back: mostly over the limit too (a burst of 50 takes
    // a few ms here, in which the bucket lets a few through).
    let stun_frame = v4_frame(PUBLISHER, LOCAL, &stun);
    let t_stun = std::time::Instant::now();
    let stun_passed = (0..50).filter(|_| rig.fp.test_run(&stun_frame, Some(rig.ifindex)).unwrap().retval == TC_ACT_OK).count() as u64;
    let allowed = (RATE as f64 * t_stun.elapsed().as_secs_f64()).ceil() as u64 + 1;
    assert!(stun_passed <= allowed, "{stun_passed} of 50 STUN packets passed, at most {allowed} allowed");
    let stun_dropped = 50 - stun_passed;
    let d = delta(&before, &rig.fp.kernel_stats().unwrap());
    assert_eq!(d.get("drop_source_limited").copied().unwrap_or(0), runs - forwarded + stun_dropped, "{d:?}");
    assert_eq!(d.get("pass_stun").copied().unwrap_or(0), stun_passed, "{d:?}");
    assert_eq!(d.get("forwarded").copied().unwrap_or(0), forwarded + others, "{d:?}");
    assert_eq!(d.get("drop_stranger"), None, "{d:?}");
    let s = rig.fp.kernel_stats().unwrap();
    assert_eq!(s.to_dataplane_stats(1).total.drop_source_limited, runs - forwarded + stun_dropped);
    assert!(!s.to_dataplane_stats(1).extra.contains_key("drop_source_limited"));
    // A stranger is a stranger, never charged: it does not eat the other source's budget.
    for _ in 0..(2 * RATE) {
        assert_eq!(rig.fp.test_run(&v4_frame("10.200.0.8:6666", "10.200.0.1:4004", &rtp(3)), Some(rig.ifindex)).unwrap().retval, TC_ACT_SHOT);
    }
    assert_eq!(rig.fp.test_run(&bystander, Some(rig.ifindex)).unwrap().retval, TC_ACT_REDIRECT);
    // Lifting the limit lifts it at once.
    let mut t2 = t.clone();
    t2.version = 2;
    t2.set_source_limit(None);
    rig.apply(&t2);
    for _ in 0..100 {
        assert_eq!(rig.fp.test_run(&frames[0], Some(rig.ifindex)).unwrap().retval, TC_ACT_REDIRECT);
    }
}

/// A table change returns once the new entries are live: the fan-out range it replaced is
/// freed in the background after a grace period, and a change that finds only retired room
/// waits for that itself instead of failing. Copies stay exactly the table's throughout.
#[test]
fn replaced_fan_out_ranges_are_freed_in_the_background() {
    root_or_skip!("replaced_fan_out_ranges_are_freed_in_the_background");
    // Room for two fan-outs of 4: every change needs the room the one before it retired.
    let rig = Rig::with(&LoadOptions { max_copies: 8, max_streams: 16, pin_dir: None });
    let subs = subscribers_v4(5);
    let t = |v: u64| {
        let copies = if v.is_multiple_of(2) { subs[..4].to_vec() } else { subs[1..].to_vec() };
        Arc::new(table(v, vec![entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, copies)]))
    };
    let frame = v4_frame(PUBLISHER, LOCAL, &rtp(1));
    rig.fp.apply(t(1)).unwrap();
    // Back to back: an apply may find the room still retired and wait; none fails.
    for v in 2..40 {
        rig.fp.apply(t(v)).expect("apply with retired room");
    }
    rig.check(&t(39), &frame);
    // Given the time, the background thread frees the room: no apply waits.
    for v in 40..50 {
        let start = std::time::Instant::now();
        while rig.fp.has_retired() {
            assert!(start.elapsed() < Duration::from_secs(5), "retired range not freed in the background");
            std::thread::sleep(Duration::from_millis(1));
        }
        let r = rig.fp.apply(t(v)).unwrap();
        assert_eq!((r.retired, r.barrier), (1, false), "{r:?}");
    }
    rig.check(&t(49), &frame);
    // Without the thread, applies still succeed (each waits for the barrier it needs).
    rig.fp.stop_reclaimer();
    let waited = (50..53).filter(|v| rig.fp.apply(t(*v)).unwrap().barrier).count();
    assert!(waited >= 2, "{waited}");
    rig.check(&t(52), &frame);
}

/// The kernel's in-path reception quality (bpf/reception.h) against the reference
/// (`mediaplane_core::reception::RtpReception`) fed the same packets: in order, loss, duplicates,
/// reordering, a wrap, a lone jump, a confirmed jump and an SSRC change, then a long random
/// schedule. Sequence accounting must match field for field; jitter (the kernel stamps real
/// arrival times, the reference none) within a tolerance: 1 s of media per packet at 1 kHz,
/// so a test-run microsecond apart is a 0.001-unit difference.
#[test]
fn reception_quality_matches_the_reference() {
    use mediaplane_core::reception::RtpReception;
    root_or_skip!("reception_quality_matches_the_reference");
    let rig = Rig::new();
    let mut e = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1));
    e.clock_rate = 1000;
    let t = table(1, vec![e]);
    rig.apply(&t);
    let mut reference = RtpReception::default();
    let mut send = |ssrc: u32, seq: u16| {
        let ts = (seq as u32).wrapping_mul(1000);
        let run = rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &build_rtp(96, seq, ts, ssrc, &[0x5a; 40])), Some(rig.ifindex)).expect("test run");
        assert_eq!(run.retval, TC_ACT_REDIRECT, "packet {seq} not forwarded");
        reference.on_packet(ssrc, seq, ts, 0, 1000);
    };
    let mut schedule: Vec<(u32, u16)> = Vec::new();
    schedule.extend([0u16, 1, 2, 4, 3, 3, 5, 9, 7, 8, 8, 6].map(|s| (7, s)));
    schedule.extend((65_530u32..65_560).map(|s| (7, s as u16)));
    schedule.extend([(7, 40_000), (7, 25), (7, 30_000), (7, 30_001), (7, 30_002), (8, 100), (8, 101)]);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        rng ^= rng >> 12;
        rng ^= rng << 25;
        rng ^= rng >> 27;
        rng.wrapping_mul(0x2545_f491_4f6c_dd1d)
    };
    let mut seq = 102u16;
    for _ in 0..400 {
        seq = match next() % 20 {
            0 => seq.wrapping_sub((next() % 90) as u16),     // late (or a duplicate)
            1 => seq.wrapping_add(2 + (next() % 10) as u16), // a gap
            _ => seq.wrapping_add(1),
        };
        schedule.push((8, seq));
    }
    for (ssrc, seq) in schedule {
        send(ssrc, seq);
    }
    let kernel = rig.fp.kernel_stats().unwrap().reception.get(&1).copied().expect("the kernel kept reception state");
    let (k, r) = (kernel.report(), reference.report());
    assert_eq!(
        (k.ssrc, k.packets, k.expected, k.lost, k.duplicates, k.reordered, k.jumps, k.resyncs, k.ssrc_changes, k.highest_seq),
        (r.ssrc, r.packets, r.expected, r.lost, r.duplicates, r.reordered, r.jumps, r.resyncs, r.ssrc_changes, r.highest_seq),
        "kernel {k:?}\nreference {r:?}"
    );
    assert!(r.reordered > 10 && r.duplicates > 2 && r.lost > 10, "the schedule exercises everything: {r:?}");
    let tolerance = 16 + r.jitter / 20;
    assert!(k.jitter.abs_diff(r.jitter) <= tolerance, "jitter: kernel {} vs reference {} (±{tolerance})", k.jitter, r.jitter);
    assert_eq!(k.clock_rate, 1000);
    // The report the data plane gives is the kernel's.
    assert_eq!(rig.fp.kernel_stats().unwrap().to_dataplane_stats(1).reception[&1].packets, k.packets);
}

/// A stream of unknown clock rate gets sequence accounting but no jitter; a non-RTP stream none.
#[test]
fn reception_needs_rtp_and_a_clock_rate_for_jitter() {
    root_or_skip!("reception_needs_rtp_and_a_clock_rate_for_jitter");
    let rig = Rig::new();
    let mut e = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(1));
    e.clock_rate = 0;
    let plain = entry(2, "10.200.0.1:4002", None, SourceRule::Fixed(a(PUBLISHER)), false, subscribers_v4(1));
    let t = table(1, vec![e, plain]);
    rig.apply(&t);
    for seq in [1u16, 2, 4] {
        rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &build_rtp(96, seq, seq as u32 * 160, 5, &[0; 20])), Some(rig.ifindex)).unwrap();
        rig.fp.test_run(&v4_frame(PUBLISHER, "10.200.0.1:4002", &build_rtp(96, seq, 0, 5, &[0; 20])), Some(rig.ifindex)).unwrap();
    }
    let s = rig.fp.kernel_stats().unwrap();
    let r = s.reception[&1].report();
    assert_eq!((r.packets, r.expected, r.lost, r.jitter, r.jitter_ms), (3, 4, 1, 0, None));
    assert_eq!(s.streams[&2].tx_copies, 3, "the plain stream was forwarded");
    assert!(!s.reception.contains_key(&2), "a non-RTP stream has no reception state");
}

/// A simulcast stream through the TC program itself: two layers (SSRC-narrowed entries) with
/// three consumers each: paused, on layer 0 and on layer 1 (the last copy, which is the packet
/// itself when it is sent). Every copy is decided and
/// renumbered in the kernel as core's rewriter does it for that consumer; the copies leave with
/// valid IPv4/IPv6 and UDP checksums (a test run's packet is CHECKSUM_NONE: the checksum is
/// updated by the difference, which a wrong byte order breaks).
#[test]
fn simulcast_copies_are_renumbered_per_consumer_with_valid_checksums() {
    root_or_skip!("simulcast_copies_are_renumbered_per_consumer_with_valid_checksums");
    use mediaplane_core::packet::verify_checksums;
    use mediaplane_core::simulcast::{inspect, Codec, Decision, LayerRewriter};
    use mediaplane_core::table::SimulcastLayer;
    for (publisher, local, sfu_ip, sub_ip) in
        [(PUBLISHER, LOCAL, "10.200.0.1", "10.200.0.2"), ("[fd00:200::9]:5000", "[fd00:200::1]:4000", "fd00:200::1", "fd00:200::2")]
    {
        let rig = Rig::new();
        let layers = vec![(1u32, 0x100u32), (2, 0x101)];
        let consumers = [501u32, 502, 503];
        let subs = subscribers(3, sfu_ip, sub_ip, 40000);
        let entries = layers
            .iter()
            .enumerate()
            .map(|(i, &(id, ssrc))| {
                let mut e = entry(id, local, Some(ssrc), SourceRule::Fixed(a(publisher)), true, subs.clone());
                e.clock_rate = 90_000;
                e.simulcast = Some(SimulcastLayer { group: 77, index: i as u8, layers: layers.clone(), codec: Codec::Vp8 });
                for (c, id) in e.copies.iter_mut().zip(consumers) {
                    c.consumer = id;
                }
                e
            })
            .collect();
        let t = table(1, entries);
        rig.apply(&t);
        let targets = [None, Some(0u8), Some(1)];
        let mut core: Vec<LayerRewriter> = targets
            .iter()
            .map(|t| {
                let mut r = LayerRewriter::new(0x100, 90_000);
                r.set_target(*t);
                r
            })
            .collect();
        for (id, t) in consumers.iter().zip(targets) {
            assert!(rig.fp.layer_create(*id, 0x100, 90_000).unwrap());
            rig.fp.layer_set_target(*id, t, None).unwrap();
        }
        let ports: Vec<u16> = subs.iter().map(|(_, to)| to.port()).collect();
        let keep = udp_to(&ports);
        let mut forwarded = 0;
        for f in 0..8u16 {
            for (l, &(_, ssrc)) in layers.iter().enumerate() {
                let key = (l == 0 && f % 4 == 0) || (l == 1 && f == 1);
                let pic = 0x1234 + f + 100 * l as u16;
                let payload = [0x90, 0xe0, 0x80 | (pic >> 8) as u8, pic as u8, (f + 7 * l as u16) as u8, 0x20, if key { 0x10 } else { 0x11 }, 0xab, 0xcd];
                let rtp = build_rtp(96, 1000 * (l as u16 + 1) + f, 90_000 * l as u32 + 3000 * f as u32, ssrc, &payload);
                let frame = v4_frame(publisher, local, &rtp); // (any family: FrameSpec follows the addresses)
                let now = mediaplane_dataplane::monotonic_ns();
                // Core's copies, in copy order.
                let info = inspect(Codec::Vp8, &rtp).unwrap();
                let want: Vec<(u16, Vec<u8>)> = core
                    .iter_mut()
                    .zip(&ports)
                    .filter_map(|(r, port)| match r.on_packet(l as u8, &info, now) {
                        Decision::Forward(w) => {
                            let mut b = rtp.clone();
                            w.apply(&info, &mut b);
                            Some((*port, b))
                        }
                        Decision::Skip(_) => None,
                    })
                    .collect();
                let run = rig.fp.test_run(&frame, Some(rig.ifindex)).unwrap();
                // The last consumer's copy (when it gets one) is the packet itself, handed back.
                let last_sent = want.last().is_some_and(|(p, _)| *p == *ports.last().unwrap());
                let clones = want.len() - usize::from(last_sent);
                let mut got = rig.cap.collect_for(clones, Duration::from_secs(3), Duration::from_millis(30), &keep);
                if last_sent {
                    assert_eq!(run.retval, TC_ACT_REDIRECT);
                    got.push(run.data_out.clone());
                } else {
                    assert_eq!(run.retval, TC_ACT_SHOT, "frame {f} layer {l}: consumed, no copy is the original");
                }
                assert_eq!(got.len(), want.len(), "frame {f} layer {l}: copies");
                for (g, (port, bytes)) in got.iter().zip(&want) {
                    let pf = parse_frame(g).unwrap();
                    assert_eq!(pf.dst.port(), *port, "frame {f} layer {l}");
                    assert!(verify_checksums(g, &pf).ok(), "frame {f} layer {l} to {port}: bad checksum {}", hex(g));
                    assert_eq!(&g[pf.payload..pf.payload + pf.payload_len], &bytes[..], "frame {f} layer {l} to {port}: the rewrite");
                    forwarded += 1;
                }
            }
        }
        // Both forwarding consumers started at a keyframe and got every later packet of their layer.
        assert_eq!(forwarded, 8 + 7, "{local}: copies sent");
        // Each layer's keyframes counted (they answer the keyframe requests of its consumers).
        for (&(id, _), want) in layers.iter().zip([2u64, 1]) {
            assert_eq!(rig.fp.kernel_stream_raw(id).unwrap().unwrap().keyframes, want, "{local}: stream {id}'s keyframes");
        }
        for (id, r) in consumers.iter().zip(&core) {
            // (Arrival times differ: the kernel's clock read at entry, the test's before the run.)
            let mut k = rig.fp.layer_state(*id).unwrap().unwrap().1;
            k.top_at_ns = r.state().top_at_ns;
            assert_eq!(k, r.state(), "{local}: consumer {id}'s state");
        }
        // What each was forwarded, as it was sent: one SSRC, its renumbered sequence without a
        // gap (the switch from layer 0 to layer 1 is not a loss); the paused one, nothing.
        let fwd = rig.fp.kernel_consumer_reception(&consumers).unwrap();
        assert!(!fwd.contains_key(&501), "{local}: the paused consumer was sent nothing");
        for (id, n) in [(502u32, 8u64), (503, 7)] {
            let r = fwd[&id].report();
            assert_eq!((r.ssrc, r.packets, r.expected, r.lost, r.duplicates, r.reordered), (0x100, n, n, 0, 0, 0), "{local}: consumer {id}: {r:?}");
        }
    }
}

/// Per consumer, the kernel accounts the RTP it sent (reception.h forwarded_account) as it
/// accounts a stream's: a plain fan-out's consumers get the stream's loss, duplicates and
/// reordering passed on, field for field as the reference fed the same packets; the entries come
/// and go with the consumers.
#[test]
fn each_consumer_is_accounted_what_it_was_forwarded() {
    use mediaplane_core::reception::RtpReception;
    root_or_skip!("each_consumer_is_accounted_what_it_was_forwarded");
    let rig = Rig::new();
    let mut e = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(2));
    e.clock_rate = 8000;
    rig.apply(&table(1, vec![e.clone()]));
    let mut reference = RtpReception::default();
    for seq in [0u16, 1, 2, 4, 3, 3, 5, 9, 7, 8, 8, 6, 11, 12] {
        let run = rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &build_rtp(0, seq, seq as u32 * 160, 9, &[0x5a; 40])), Some(rig.ifindex)).unwrap();
        assert_eq!(run.retval, TC_ACT_REDIRECT, "packet {seq} not forwarded");
        reference.on_packet(9, seq, seq as u32 * 160, 0, 8000);
    }
    let r = reference.report();
    assert!(r.lost == 1 && r.duplicates == 2 && r.reordered == 4, "the schedule: {r:?}");
    let fwd = rig.fp.kernel_consumer_reception(&[1001, 1002, 1003]).unwrap();
    assert_eq!(fwd.keys().copied().collect::<Vec<_>>(), [1001, 1002]);
    for (id, k) in &fwd {
        let k = k.report();
        assert_eq!(
            (k.ssrc, k.packets, k.expected, k.lost, k.duplicates, k.reordered, k.highest_seq, k.clock_rate),
            (r.ssrc, r.packets, r.expected, r.lost, r.duplicates, r.reordered, r.highest_seq, 8000),
            "consumer {id}"
        );
    }
    // A consumer that leaves takes its entry along; one that comes starts from nothing.
    let three = entry(1, LOCAL, None, SourceRule::Fixed(a(PUBLISHER)), true, subscribers_v4(3));
    e.copies = three.copies[1..].to_vec();
    rig.apply(&table(2, vec![e]));
    assert_eq!(rig.fp.map_keys("consumer_reception"), 2, "the leaving consumer's entry was deleted");
    rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &build_rtp(0, 13, 13 * 160, 9, &[0x5a; 40])), Some(rig.ifindex)).unwrap();
    let fwd = rig.fp.kernel_consumer_reception(&[1001, 1002, 1003]).unwrap();
    assert_eq!(fwd.keys().copied().collect::<Vec<_>>(), [1002, 1003]);
    assert_eq!((fwd[&1002].report().packets, fwd[&1003].report().packets), (r.packets + 1, 1));
    // dataplane.forwarded_qos = false: the program accounts nothing more.
    rig.configure(mediaplane_ebpf::maps::FastConfigRaw { flags: RIG_CONFIG.flags & !mediaplane_ebpf::maps::config_flags::FORWARDED_QOS, ..RIG_CONFIG });
    rig.fp.test_run(&v4_frame(PUBLISHER, LOCAL, &build_rtp(0, 14, 14 * 160, 9, &[0x5a; 40])), Some(rig.ifindex)).unwrap();
    let off = rig.fp.kernel_consumer_reception(&[1002, 1003]).unwrap();
    assert_eq!((off[&1002].report().packets, off[&1003].report().packets), (r.packets + 1, 1), "accounted with forwarded_qos off");
    assert_eq!(rig.fp.kernel_stats().unwrap().consumers[&1003].tx_copies, 2, "but forwarded");
}

/// The counters of many streams read at once (in batches of neighbouring slots) are what each
/// stream's own read gives: slots asked for and not, runs broken by gaps, the map's first slot,
/// and ids with no slot left out.
#[test]
fn stream_counters_read_in_batches_match_each_streams_own() {
    root_or_skip!("stream_counters_read_in_batches_match_each_streams_own");
    let rig = Rig::new();
    let n = 400u32;
    let entries = (1..=n).map(|id| entry(id, &format!("10.200.0.1:{}", 4000 + 2 * id), None, SourceRule::Any, true, vec![])).collect();
    let t = table(1, entries);
    rig.apply(&t);
    // Stream i receives i % 4 packets.
    for id in 1..=n {
        for k in 0..id % 4 {
            let frame = v4_frame(PUBLISHER, &format!("10.200.0.1:{}", 4000 + 2 * id), &rtp(id * 10 + k));
            rig.fp.test_run(&frame, Some(rig.ifindex)).unwrap();
        }
    }
    // Every stream; a sparse choice (gaps beyond a batch run); a run in the middle; the first
    // and the last alone; unknown ids.
    let every: Vec<u32> = (1..=n).collect();
    let sparse: Vec<u32> = (1..=n).filter(|id| id % 97 == 1).chain([n + 1, 0]).collect();
    let middle: Vec<u32> = (n / 2..n / 2 + 30).filter(|id| id % 3 != 0).collect();
    for ids in [every, sparse, middle, vec![1], vec![n], vec![n + 7]] {
        let batched = rig.fp.kernel_stream_counters(&ids).unwrap();
        let one_by_one: BTreeMap<u32, _> = ids.iter().filter_map(|id| Some((*id, rig.fp.kernel_stream_raw(*id).unwrap()?.to_counters()))).collect();
        assert_eq!(batched.len(), ids.iter().filter(|id| (1..=n).contains(*id)).count());
        assert_eq!(batched, one_by_one);
        for (id, c) in &batched {
            assert_eq!(c.rx_packets, u64::from(id % 4), "stream {id}");
        }
    }
}
