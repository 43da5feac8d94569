//! The AF_XDP plane's XDP program (bpf/xsk_redirect.bpf.c) under BPF_PROG_TEST_RUN, in a
//! namespace: named cases, then random and mutated frames against an oracle written from what
//! the program promises (hand over exactly the UDP datagrams to the SFU's addresses, and the
//! later fragments of those it handed over; pass everything else to the stack; the source's
//! reverse path and the checksums are user space's to check).
//!
//! The program runs as on the namespace's loopback device (its ifindex names the queue's slot).
//! With no AF_XDP socket in the XSKMAP slot the redirect falls back to XDP_PASS, so what the
//! program decided is read from its counters: `xsk_redirected` / `xsk_fragments` (handed over),
//! `xsk_pass_*` (passed, and why), none (not the plane's).

mod common;

use common::require_root;
use mediaplane_core::packet::{build_frame, parse_frame, FrameSpec};
use mediaplane_ebpf::afxdp::XskRedirect;
use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, SocketAddr};

const SFU: &str = "10.201.0.1:40000";
const SFU6: &str = "[fd00:201::1]:40000";
const PEER: &str = "10.201.0.2:5004";
const PEER6: &str = "[fd00:201::2]:5004";
/// Routed by the other interface (the program does not judge sources).
const ELSEWHERE: &str = "10.202.0.2:5004";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Redirected,
    Fragment,
    PassFragment,
    PassNoSocket,
    /// Not the plane's: passed without a counter.
    NotOurs,
}

fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// `udp` (header + payload) as IPv4 fragments of at most `mtu` bytes of IP packet.
fn fragments_v4(src: SocketAddr, dst: SocketAddr, id: u16, payload: &[u8], mtu: usize) -> Vec<Vec<u8>> {
    let whole = build_frame(&FrameSpec::new(src, dst), payload);
    let f = parse_frame(&whole).unwrap();
    let (head, udp) = (&whole[..f.l3 + 20], &whole[f.l4..]);
    let per = (mtu - 20) / 8 * 8;
    udp.chunks(per)
        .enumerate()
        .map(|(i, piece)| {
            let more = (i + 1) * per < udp.len();
            let mut frame = head.to_vec();
            let ip = &mut frame[14..34];
            ip[2..4].copy_from_slice(&((20 + piece.len()) as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&id.to_be_bytes());
            ip[6..8].copy_from_slice(&(((i * per / 8) as u16) | if more { 0x2000 } else { 0 }).to_be_bytes());
            frame.extend_from_slice(piece);
            frame
        })
        .collect()
}

/// What the program must do with `frame`, given the SFU's addresses and the fragmented
/// datagrams it handed over so far (updated). Written from the program's promise, header by
/// header: what it does not look at (lengths beyond the headers it reads, checksums) is user
/// space's to judge, so a datagram with a wrong UDP length is still handed over.
fn oracle(f: &[u8], sfu: &HashSet<SocketAddr>, flows: &mut HashSet<(IpAddr, IpAddr, u32)>) -> Verdict {
    let be16 = |at: usize| u16::from_be_bytes([f[at], f[at + 1]]);
    if f.len() < 14 {
        return Verdict::NotOurs;
    }
    let (src, dst, l4, fragment, later, id): (IpAddr, IpAddr, usize, bool, bool, u32) = match be16(12) {
        0x0800 => {
            if f.len() < 34 || f[14] != 0x45 || f[23] != 17 {
                return Verdict::NotOurs;
            }
            let frag = be16(20);
            let v4 = |at: usize| IpAddr::from(<[u8; 4]>::try_from(&f[at..at + 4]).unwrap());
            (v4(26), v4(30), 34, frag & 0x3fff != 0, frag & 0x1fff != 0, u32::from(be16(18)))
        }
        0x86dd => {
            if f.len() < 54 {
                return Verdict::NotOurs;
            }
            let v6 = |at: usize| IpAddr::from(<[u8; 16]>::try_from(&f[at..at + 16]).unwrap());
            match f[20] {
                44 if f.len() >= 62 && f[54] == 17 => (v6(22), v6(38), 62, true, be16(56) & 0xfff8 != 0, u32::from_be_bytes(f[58..62].try_into().unwrap())),
                17 => (v6(22), v6(38), 54, false, false, 0),
                _ => return Verdict::NotOurs,
            }
        }
        _ => return Verdict::NotOurs,
    };
    if later {
        return if flows.contains(&(src, dst, id)) { Verdict::Fragment } else { Verdict::PassFragment };
    }
    if f.len() < l4 + 8 || !sfu.contains(&SocketAddr::new(dst, be16(l4 + 2))) {
        return Verdict::NotOurs;
    }
    if fragment {
        flows.insert((src, dst, id));
        Verdict::Fragment
    } else {
        Verdict::Redirected
    }
}

fn observed(before: &BTreeMap<&str, u64>, after: &BTreeMap<&str, u64>) -> Verdict {
    let moved: Vec<&str> = after.iter().filter(|(k, v)| before[*k] != **v).map(|(k, _)| *k).collect();
    match moved.as_slice() {
        [] => Verdict::NotOurs,
        ["xsk_redirected"] => Verdict::Redirected,
        ["xsk_fragments"] => Verdict::Fragment,
        ["xsk_pass_fragment"] => Verdict::PassFragment,
        ["xsk_pass_no_socket"] => Verdict::PassNoSocket,
        other => panic!("more than one counter moved: {other:?}"),
    }
}

/// BPF_PROG_TEST_RUN without an interface runs the program as if the frame arrived on the
/// calling thread's namespace's loopback device, queue 0: its slot is keyed by that ifindex.
/// (Nothing is sent: a test run only returns the verdict.)
fn loopback() -> u32 {
    common::ifindex("lo")
}

#[test]
fn the_redirect_program_hands_over_exactly_the_planes_datagrams() {
    if !require_root("the_redirect_program_hands_over_exactly_the_planes_datagrams") {
        return;
    }
    let xa = loopback();
    let verdicts = {
        let x = XskRedirect::load().expect("load");
        x.add_addresses(&[a(SFU), a(SFU6)]).unwrap();
        let run = |frame: &[u8]| -> Verdict {
            let before = x.counters().unwrap();
            assert_eq!(x.test_run(frame).unwrap(), 2, "XDP_PASS (no socket in the slot) or the fallback of a redirect");
            observed(&before, &x.counters().unwrap())
        };
        let mut out = Vec::new();
        // No socket slot for the queue yet.
        out.push(("no socket slot", run(&build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"rtp")), Verdict::PassNoSocket));
        x.set_slot(xa, 0, 0).unwrap();
        let frags = fragments_v4(a(PEER), a(SFU), 7, &[5; 3000], 1500);
        let stray = fragments_v4(a(PEER), a(SFU), 8, &[5; 3000], 1500);
        let mut tcp = build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"x");
        tcp[14 + 9] = 6;
        let mut options = build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"x");
        options[14] = 0x46;
        let cases: Vec<(&str, Vec<u8>, Verdict)> = vec![
            ("datagram to the SFU", build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"rtp"), Verdict::Redirected),
            ("IPv6 datagram to the SFU", build_frame(&FrameSpec::new(a(PEER6), a(SFU6)), b"rtp"), Verdict::Redirected),
            ("another port", build_frame(&FrameSpec::new(a(PEER), a("10.201.0.1:40001")), b"rtp"), Verdict::NotOurs),
            ("a source routed by another interface (user space judges it)", build_frame(&FrameSpec::new(a(ELSEWHERE), a(SFU)), b"rtp"), Verdict::Redirected),
            ("TCP", tcp, Verdict::NotOurs),
            ("IPv4 options", options, Verdict::NotOurs),
            ("first fragment", frags[0].clone(), Verdict::Fragment),
            ("its next fragment", frags[1].clone(), Verdict::Fragment),
            ("a later fragment whose first was not seen", stray[1].clone(), Verdict::PassFragment),
            ("cut inside the IP header", build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"rtp")[..30].to_vec(), Verdict::NotOurs),
            ("cut inside the UDP header", build_frame(&FrameSpec::new(a(PEER), a(SFU)), b"rtp")[..38].to_vec(), Verdict::NotOurs),
        ];
        for (name, frame, want) in cases {
            out.push((name, run(&frame), want));
        }
        out
    };
    for (name, got, want) in &verdicts {
        assert_eq!(got, want, "{name}");
    }
}

/// Random and mutated frames: the program's verdict is the oracle's for every one. A failure
/// prints the seed; MEDIAPLANE_FUZZ_SEED=<seed> replays it.
#[test]
fn random_and_mutated_frames_follow_the_oracle() {
    if !require_root("random_and_mutated_frames_follow_the_oracle") {
        return;
    }
    let frames: usize = std::env::var("MEDIAPLANE_FUZZ_FRAMES").ok().and_then(|v| v.parse().ok()).unwrap_or(3000);
    let seed: u64 = std::env::var("MEDIAPLANE_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| std::process::id() as u64 ^ 0x9e37_79b9);
    let xa = loopback();
    let failures = {
        let x = XskRedirect::load().expect("load");
        let sfu: HashSet<SocketAddr> = [a(SFU), a(SFU6), a("10.201.0.1:40002")].into_iter().collect();
        x.add_addresses(&sfu.iter().copied().collect::<Vec<_>>()).unwrap();
        x.set_slot(xa, 0, 0).unwrap();
        let mut flows = HashSet::new();
        let mut rng = seed | 1;
        let mut next = move || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        let sources = [PEER, ELSEWHERE, "10.201.0.9:1", PEER6];
        let dests = [SFU, "10.201.0.1:40002", "10.201.0.1:40001", SFU6, "[fd00:201::1]:7"];
        let mut failures = Vec::new();
        for i in 0..frames {
            let (src, dst) = (a(sources[next() as usize % sources.len()]), a(dests[next() as usize % dests.len()]));
            if src.is_ipv4() != dst.is_ipv4() {
                continue;
            }
            let payload = vec![(next() & 0xff) as u8; (next() % 2000) as usize];
            let mut frame = if src.is_ipv4() && next() % 3 == 0 {
                let f = fragments_v4(src, dst, (next() % 4) as u16, &payload, 576);
                f[next() as usize % f.len()].clone()
            } else {
                build_frame(&FrameSpec::new(src, dst), &payload)
            };
            // Mutate: flip bytes in the headers, or cut the frame short.
            match next() % 4 {
                0 => {
                    let at = next() as usize % frame.len().min(70);
                    frame[at] ^= 1 << (next() % 8);
                }
                // (Not below an Ethernet header: no device hands XDP less, and a test run
                // refuses it.)
                1 => frame.truncate(14 + next() as usize % (frame.len() - 13)),
                _ => {}
            }
            let want = oracle(&frame, &sfu, &mut flows);
            let before = x.counters().unwrap();
            x.test_run(&frame).unwrap();
            let got = observed(&before, &x.counters().unwrap());
            if got != want {
                failures.push(format!("frame {i}: program {got:?}, oracle {want:?}: {:02x?}", &frame[..frame.len().min(80)]));
            }
        }
        failures
    };
    assert!(failures.is_empty(), "seed {seed}: {} frames differ, first: {}", failures.len(), failures[0]);
}
