//! Fuzz driver for the real TC program: thousands of random and mutated frames through
//! BPF_PROG_TEST_RUN, each judged by the oracle of test_run.rs (tests/common/rig.rs: core's
//! per-packet pipeline, `mediaplane_core::pipeline::reference` on `classify()`, on what
//! `parse_frame()` makes of the frame). For every frame:
//! the verdict (forward / drop / to the stack) and its counter match; the program never
//! forwards what the model would not; copies go only to the model's subscribers of that
//! stream, each once, payload unchanged, checksums as valid as the original's. Each frame also
//! runs through the XDP pre-filter first (as on the wire): whatever it drops, the reference
//! drops under the reason the pre-filter counts (`xdp_drop_stranger`: Stranger,
//! `xdp_drop_no_stream`: NoStream), and it counts every frame once.
//!
//! Frames start valid — RTP (CSRCs, extensions, padding), RTCP compounds, STUN, other payloads,
//! IPv4/IPv6, VLAN-tagged — to the addresses of a model with fixed-source, latching,
//! SSRC-narrowed, non-RTP, empty and mixed-family streams, from publishers and strangers; most
//! are then mutated: bit flips, byte values, truncation, trailing bytes, IP/UDP length fields,
//! IHL, fragment bits, protocol, ethertype, VLAN tags added/removed, ports, addresses, RTP/RTCP
//! header fields; checksums and lengths are re-fixed for some so the mutation reaches the
//! deeper checks.
//!
//! Layer state too: two simulcast streams (VP8 in three layers over IPv4, H.264 in two over
//! IPv6) whose publishers send on with loss, duplicates, reordering, jumps and mangled packets,
//! while the control plane retargets their consumers now and then (a layer, one the stream
//! lacks, a pause; one consumer has no state in the kernel). Each layer packet's copies are
//! judged against core's `LayerRewriter` per consumer, kept in step with the kernel: which
//! consumers get a copy, each copy's rewritten bytes, and after every packet each consumer's
//! whole state (segments, numbering, counters) equal to the kernel's. RTCP (compounds with SR,
//! RR, SDES, BYE, PLI, NACK, malformed ones) is judged as the kernel must treat it: a
//! publisher's to the slow path where it is timed or evaluated (`pass_rtcp`), a consumer's
//! feedback to the slow path that routes it (`pass_feedback`), anything else by classify().
//! Per consumer, what the kernel accounted as forwarded (its RTP as sent: bpf/reception.h) must
//! equal core's `RtpReception` fed every copy judged above, sequence field for sequence field.
//!
//! Seeded: the seed is printed; MEDIAPLANE_FUZZ_SEED=<n> replays a run, MEDIAPLANE_FUZZ_FRAMES
//! sets the count (default 10000, a few seconds). `make fuzz` runs it longer.
//!
//! Run: `cargo test -p mediaplane-ebpf --test fuzz_test_run -- --nocapture` as root.

mod common;

use common::layer_gen::{h264_payload, mangle, vp8_payload, LayerSource};
use common::rig::*;
use common::*;
use mediaplane_core::feedback::{FeedbackEntry, FeedbackRoute};
use mediaplane_core::packet::{build_frame, internet_checksum, parse_frame, udp_checksum, FrameSpec};
use mediaplane_core::reception::RtpReception;
use mediaplane_core::rtp::{build_rtp, demux, MediaKind, RtpHeader};
use mediaplane_core::simulcast::{inspect, Codec, Decision, LayerRewriter};
use mediaplane_core::srtp::Protection;
use mediaplane_core::table::{ForwardingTable, SimulcastLayer, SourceRule, StreamEntry};
use mediaplane_core::Verdict;
use mediaplane_ebpf::layers::LayerVerdict;
use mediaplane_ebpf::{Prefilter, XDP_DROP, XDP_PASS};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

const PUBLISHER2: &str = "10.200.0.8:6000";
const PUBLISHER6: &str = "[fd00:200::9]:5000";
const SSRCS: [u32; 4] = [0x1111_1111, 0x2222_2222, 0x3333_3333, 0x4444_4444];

/// Every kind of stream the kernel distinguishes, on two address families.
fn fuzz_table() -> ForwardingTable {
    let v4 = |n, base| subscribers(n, "10.200.0.1", "10.200.0.2", base);
    let v6 = |n, base| subscribers(n, "fd00:200::1", "fd00:200::2", base);
    let fixed = |s| SourceRule::Fixed(a(s));
    let mut t = table(
        1,
        vec![
            entry(1, "10.200.0.1:4000", None, fixed(PUBLISHER), true, v4(3, 40000)),
            // SSRC-narrowed only.
            entry(2, "10.200.0.1:4002", Some(SSRCS[0]), fixed(PUBLISHER), true, v4(1, 40100)),
            entry(3, "10.200.0.1:4002", Some(SSRCS[1]), fixed(PUBLISHER), true, v4(2, 40200)),
            // Narrowed beside a non-RTP wildcard of another publisher.
            entry(4, "10.200.0.1:4004", Some(SSRCS[2]), fixed(PUBLISHER2), true, v4(1, 40300)),
            entry(5, "10.200.0.1:4004", None, fixed(PUBLISHER2), false, v4(2, 40400)),
            // A relay leg learning its source, following none yet.
            entry(6, "10.200.0.1:4006", None, SourceRule::Learn(None), true, v4(1, 40500)),
            entry(7, "10.200.0.1:4008", None, fixed(PUBLISHER), false, v4(2, 40600)),
            entry(8, "10.200.0.1:4010", None, fixed(PUBLISHER), true, vec![]),
            // Mixed address families: the kernel leaves the stream to the slow path.
            entry(9, "10.200.0.1:4012", None, fixed(PUBLISHER), true, v6(1, 41900)),
            entry(10, "[fd00:200::1]:4000", None, fixed(PUBLISHER6), true, v6(2, 41000)),
            entry(11, "[fd00:200::1]:4002", Some(SSRCS[3]), fixed(PUBLISHER6), true, v6(1, 41100)),
            entry(12, "[fd00:200::1]:4004", None, SourceRule::Learn(None), false, v6(1, 41200)),
            entry(13, "[fd00:200::1]:4006", None, fixed(PUBLISHER6), false, v6(3, 41300)),
            // Learning and following a source; taking any source.
            // (Relay legs: their RTCP goes up for the control plane's report evaluation.)
            StreamEntry { evaluate_rtcp: true, ..entry(14, "10.200.0.1:4014", None, SourceRule::Learn(Some(a(PUBLISHER))), true, v4(1, 40700)) },
            entry(15, "10.200.0.1:4016", None, SourceRule::Any, true, v4(1, 40800)),
            StreamEntry { evaluate_rtcp: true, ..entry(16, "[fd00:200::1]:4008", None, SourceRule::Learn(Some(a(PUBLISHER6))), true, v6(1, 41400)) },
            entry(17, "[fd00:200::1]:4010", None, SourceRule::Any, false, v6(1, 41500)),
        ],
    );
    for g in GROUPS {
        for (i, &ssrc) in g.ssrcs.iter().enumerate() {
            let subs = if g.local.starts_with('[') { v6(g.consumers.len(), g.sub_base) } else { v4(g.consumers.len(), g.sub_base) };
            let mut e = entry(g.first_id + i as u32, g.local, Some(ssrc), fixed(g.publisher), true, subs);
            e.clock_rate = 90_000;
            e.simulcast = Some(SimulcastLayer { group: g.first_id, index: i as u8, layers: g.layers(), codec: g.codec });
            for (c, &consumer) in e.copies.iter_mut().zip(g.consumers) {
                c.consumer = consumer;
            }
            t.streams.insert(e.key, e);
        }
    }
    // Consumers' addresses: beside a wildcard stream, narrowed-only streams, a non-RTP wildcard
    // stream, and none at all (a subscriber that publishes nothing).
    for (local, source) in [
        ("10.200.0.1:4000", PUBLISHER),
        ("10.200.0.1:4002", PUBLISHER),
        ("10.200.0.1:4004", PUBLISHER2),
        ("10.200.0.1:4018", PUBLISHER),
        ("[fd00:200::1]:4012", PUBLISHER6),
    ] {
        let route = FeedbackRoute {
            ssrc: SSRCS[0],
            stream: 2,
            consumer: 2001,
            publisher_ssrc: SSRCS[0],
            layers: Vec::new(),
            from: a("10.200.0.1:4002"),
            to: a(PUBLISHER),
            outbound: Protection::Clear,
        };
        let entry = FeedbackEntry { consumer: format!("r/{local}"), local: a(local), source: a(source), routes: vec![route], inbound: Protection::Clear };
        t.feedback.insert(a(local), entry);
    }
    t
}

/// A simulcast stream of the fuzz table: one SSRC-narrowed entry per layer (ids from
/// `first_id`), every consumer on each layer's copy list. The first consumer has no layer state
/// in the kernel (the control plane has not made it yet): it must get nothing. (Consumer ids
/// are apart from the ones `entry` gives the other streams' copies.)
struct Group {
    local: &'static str,
    publisher: &'static str,
    codec: Codec,
    first_id: u32,
    ssrcs: &'static [u32],
    consumers: &'static [u32],
    sub_base: u16,
}

impl Group {
    fn layers(&self) -> Vec<(u32, u32)> {
        self.ssrcs.iter().enumerate().map(|(i, &ssrc)| (self.first_id + i as u32, ssrc)).collect()
    }
    fn with_state(&self) -> &'static [u32] {
        &self.consumers[1..]
    }
}

const GROUPS: [Group; 2] = [
    Group {
        local: "10.200.0.1:4020",
        publisher: PUBLISHER,
        codec: Codec::Vp8,
        first_id: 18,
        ssrcs: &[0x5100_0000, 0x5100_0001, 0x5100_0002],
        consumers: &[9001, 9002, 9003, 9004],
        sub_base: 40900,
    },
    Group {
        local: "[fd00:200::1]:4020",
        publisher: PUBLISHER6,
        codec: Codec::H264,
        first_id: 21,
        ssrcs: &[0x5200_0000, 0x5200_0001],
        consumers: &[9101, 9102, 9103],
        sub_base: 41600,
    },
];

/// The publishers of [`GROUPS`]: each layer's numbering, carried on from packet to packet with
/// loss, duplicates and reordering, so the consumers' rewriters see streams they can follow.
struct Publishers {
    layers: Vec<Vec<LayerSource>>,
}

impl Publishers {
    fn new(rng: &mut Rng) -> Publishers {
        let layers = GROUPS.iter().map(|g| g.ssrcs.iter().map(|_| LayerSource::random(rng)).collect()).collect();
        Publishers { layers }
    }

    /// The next packet of a random layer of a random group, as a frame from its publisher.
    fn frame(&mut self, rng: &mut Rng, log: &mut Vec<String>) -> Vec<u8> {
        let gi = rng.below(GROUPS.len());
        let g = &GROUPS[gi];
        let layer = rng.below(g.ssrcs.len());
        let src = &mut self.layers[gi][layer];
        let start = rng.chance(50);
        if start {
            src.ts = src.ts.wrapping_add(3000);
            src.pic = (src.pic + 1) & 0x7fff;
            if rng.chance(30) {
                src.tl0 = src.tl0.wrapping_add(1);
            }
        }
        let key = start && rng.chance(15);
        if start {
            src.next_frame_layer(key, rng);
        }
        let payload = match g.codec {
            Codec::Vp8 => vp8_payload(src, true, start, key, rng),
            Codec::H264 => h264_payload(start, key, rng),
        };
        // Mostly in order; some loss, duplicates, reordering, and now and then a jump.
        let seq = match rng.below(100) {
            0..=79 => src.seq,
            80..=87 => src.seq.wrapping_add(1 + rng.below(3) as u16),
            88..=93 => src.seq.wrapping_sub(1),
            94..=98 => src.seq.wrapping_sub(2 + rng.below(6) as u16),
            _ => src.seq.wrapping_add(rng.below(40_000) as u16),
        };
        if seq.wrapping_sub(src.seq) < 0x8000 {
            src.seq = seq.wrapping_add(1);
        }
        let mut rtp = build_rtp(96, seq, src.ts, g.ssrcs[layer], &payload);
        if rng.chance(5) {
            mangle(&mut rtp, rng);
            log.push("mangled".into());
        }
        let mut spec = FrameSpec::new(a(g.publisher), a(g.local));
        spec.dst_mac = MAC0;
        log.push(format!("simulcast {} layer {layer} seq {seq} start {start} key {key}", g.local));
        build_frame(&spec, &rtp)
    }
}

/// Core's rewriter per consumer of [`GROUPS`] (those with state), kept in step with the kernel's.
struct LayerModel {
    rewriters: BTreeMap<u32, LayerRewriter>,
}

impl LayerModel {
    /// Create every consumer's state in the kernel and in core, on random targets.
    fn new(rig: &Rig, rng: &mut Rng) -> LayerModel {
        let mut rewriters = BTreeMap::new();
        for g in &GROUPS {
            for &consumer in g.with_state() {
                assert!(rig.fp.layer_create(consumer, g.ssrcs[0], 90_000).unwrap());
                let mut r = LayerRewriter::new(g.ssrcs[0], 90_000);
                let target = Some(rng.below(g.ssrcs.len()) as u8);
                r.set_target(target);
                assert_eq!(rig.fp.layer_set_target(consumer, target, None).unwrap(), LayerVerdict::Forward);
                rewriters.insert(consumer, r);
            }
        }
        LayerModel { rewriters }
    }

    /// A control-plane decision: a new target (a layer, one the stream lacks, or a pause).
    fn retarget(&mut self, rig: &Rig, rng: &mut Rng) -> Result<String, String> {
        let g = &GROUPS[rng.below(GROUPS.len())];
        let consumer = rng.pick(g.consumers);
        let target = if rng.chance(15) { None } else { Some(rng.below(g.ssrcs.len() + 1) as u8) };
        let temporal = if rng.chance(40) { None } else { Some(rng.below(4) as u8) };
        let verdict = rig.fp.layer_set_target(consumer, target, temporal).map_err(|e| e.to_string())?;
        let want = if let Some(r) = self.rewriters.get_mut(&consumer) {
            r.set_target(target);
            r.set_temporal(temporal);
            LayerVerdict::Forward
        } else {
            LayerVerdict::NoState
        };
        require(verdict == want, format!("target {target:?} for consumer {consumer}: the kernel said {verdict:?}, want {want:?}"))?;
        Ok(format!("consumer {consumer} target {target:?} temporal {temporal:?}"))
    }

    /// Refine the reference's `Forward` of a simulcast layer's packet (after the run): what
    /// the kernel does per consumer is what core's rewriter decides at the kernel's time of the
    /// packet (read back from the state of a consumer that took it; with none, time does not
    /// matter; the time must lie within the run). A packet the rewrite cannot read goes to the
    /// slow path before anything else is looked at (the kernel's rule; what classify() forwards
    /// as RTP always reads), even one too big for the egress link.
    fn refine(&mut self, rig: &Rig, t: &ForwardingTable, frame: &[u8], want: Expect, before_ns: u64) -> Result<Expect, String> {
        let after_ns = mediaplane_dataplane::monotonic_ns();
        if !matches!(want, Expect::Forward(_) | Expect::Pass("pass_fib_fail")) {
            return Ok(want);
        }
        let Some(e) = reference_stream(t, frame).and_then(|id| t.streams.values().find(|e| e.id == id)) else { return Ok(want) };
        let Some(layer) = &e.simulcast else { return Ok(want) };
        let f = parse_frame(frame).map_err(|e| e.to_string())?;
        let rtp = &frame[f.payload..f.payload + f.payload_len];
        let Some(info) = inspect(layer.codec, rtp) else { return Ok(Expect::Pass("pass_error")) };
        let Expect::Forward(copies) = &want else { return Ok(want) };
        let mut out = Vec::new();
        let mut last_is_original = false;
        for (i, c) in e.copies.iter().enumerate() {
            let Some(r) = self.rewriters.get_mut(&c.consumer) else { continue };
            let (_, kernel) = rig.fp.layer_state(c.consumer).map_err(|e| e.to_string())?.ok_or(format!("consumer {}: no state in the kernel", c.consumer))?;
            // (A late packet that fills a gap leaves the time of the top packet as it was.)
            let now = if kernel.forwarded > r.stats.forwarded { kernel.top_at_ns } else { before_ns };
            if kernel.top_at_ns != r.state().top_at_ns {
                require(
                    (before_ns..=after_ns).contains(&now),
                    format!("consumer {}: sent at {now} ns, outside the run ({before_ns}..={after_ns})", c.consumer),
                )?;
            }
            if let Decision::Forward(w) = r.on_packet(layer.index, &info, now) {
                let mut b = rtp.to_vec();
                w.apply(&info, &mut b);
                out.push((c.from, c.to, b));
                last_is_original = i + 1 == copies.len();
            }
            require(r.state() == kernel, format!("consumer {}: states differ\n kernel {kernel:?}\n core   {:?}", c.consumer, r.state()))?;
        }
        Ok(Expect::Layered(out, last_is_original))
    }
}

/// What each consumer was sent, as core's `RtpReception` counts it over the copies' headers (no
/// times: the kernel's are its own, so jitter is not compared).
#[derive(Default)]
struct ForwardedModel(BTreeMap<u32, RtpReception>);

impl ForwardedModel {
    /// The copies of `frame` the kernel sent (judged right): each RTP one to its consumer.
    fn on_copies(&mut self, t: &ForwardingTable, frame: &[u8], copies: &[Vec<u8>]) {
        let Some(f) = parse_frame(frame).ok() else { return };
        let Verdict::Forward(e) = t.classify(f.dst, f.src, &frame[f.payload..f.payload + f.payload_len]) else { return };
        if !e.rtp {
            return;
        }
        for c in copies {
            let Ok(p) = parse_frame(c) else { continue };
            let payload = &c[p.payload..p.payload + p.payload_len];
            let Some(copy) = e.copies.iter().find(|k| k.to == p.dst && k.consumer != 0) else { continue };
            if demux(payload) == MediaKind::Rtp {
                if let Ok(h) = RtpHeader::parse(payload) {
                    self.0.entry(copy.consumer).or_default().on_packet(h.ssrc, h.sequence, h.timestamp, 0, e.clock_rate);
                }
            }
        }
    }

    fn check(&self, rig: &Rig) -> Result<(), String> {
        let ids: Vec<u32> = self.0.keys().copied().collect();
        let kernel = rig.fp.kernel_consumer_reception(&ids).map_err(|e| e.to_string())?;
        for (id, m) in &self.0 {
            let Some(k) = kernel.get(id) else { return Err(format!("consumer {id}: the kernel accounted nothing forwarded, the model {:?}", m.report())) };
            let (k, m) = (k.report(), m.report());
            let fields = |r: &mediaplane_core::reception::ReceptionReport| {
                (r.ssrc, r.packets, r.expected, r.lost, r.duplicates, r.reordered, r.jumps, r.resyncs, r.ssrc_changes, r.highest_seq)
            };
            require(fields(&k) == fields(&m), format!("consumer {id}: forwarded as the kernel accounted it {k:?}, the model {m:?}"))?;
        }
        Ok(())
    }
}

fn require(ok: bool, what: String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what)
    }
}

fn ssrc(rng: &mut Rng) -> u32 {
    if rng.chance(80) {
        rng.pick(&SSRCS)
    } else {
        rng.next() as u32
    }
}

fn payload_len(rng: &mut Rng) -> usize {
    match rng.below(20) {
        0 => 1380 + rng.below(200), // around the MTU
        1..=3 => rng.below(12),
        _ => rng.below(240),
    }
}

/// A valid RTP packet: CSRCs, a one-byte-header extension and padding as the dice say.
fn rtp_packet(rng: &mut Rng) -> Vec<u8> {
    let n = payload_len(rng);
    let body = rng.bytes(n);
    let (pt, seq, ts, ssrc) = (rng.below(128) as u8, rng.next() as u16, rng.next() as u32, ssrc(rng));
    let mut p = build_rtp(pt, seq, ts, ssrc, &[]);
    let cc = if rng.chance(20) { 1 + rng.below(15) } else { 0 };
    p[0] |= cc as u8;
    p.extend(rng.bytes(4 * cc));
    if rng.chance(25) {
        p[0] |= 0x10;
        let words = rng.below(4);
        p.extend_from_slice(&[0xbe, 0xde, 0, words as u8]);
        p.extend(rng.bytes(4 * words));
    }
    p.extend(body);
    if rng.chance(15) {
        p[0] |= 0x20;
        let pad = 1 + rng.below(16);
        p.extend(std::iter::repeat_n(0u8, pad - 1));
        p.push(pad as u8);
    }
    p
}

/// An RTCP compound: SR or RR first, then RR / SDES / BYE / PLI / NACK packets (and rarely a
/// header-only packet, which makes it invalid).
fn rtcp_packet(rng: &mut Rng) -> Vec<u8> {
    let sender = ssrc(rng);
    let mut out = Vec::new();
    for i in 0..1 + rng.below(3) {
        let pt = if i == 0 { rng.pick(&[200u8, 201]) } else { rng.pick(&[201u8, 202, 203, 205, 206]) };
        if i > 0 && rng.chance(10) {
            // Header only (length 0): shorter than any RTCP packet may be.
            out.extend_from_slice(&[0x80, pt, 0, 0]);
            continue;
        }
        let words = match pt {
            200 => 6,
            205 | 206 => 2 + rng.below(3),
            _ => 1 + rng.below(4),
        };
        out.extend_from_slice(&[0x80 | rng.below(2) as u8, pt]);
        out.extend_from_slice(&(words as u16).to_be_bytes());
        out.extend_from_slice(&(if i == 0 { sender } else { rng.next() as u32 }).to_be_bytes());
        out.extend(rng.bytes(4 * (words - 1)));
    }
    out
}

fn stun_packet(rng: &mut Rng) -> Vec<u8> {
    let attrs = 4 * rng.below(6);
    let mut p = vec![0, rng.pick(&[1u8, 0x11]), 0, attrs as u8, 0x21, 0x12, 0xa4, 0x42];
    p.extend(rng.bytes(12 + attrs));
    p
}

fn any_payload(rng: &mut Rng) -> Vec<u8> {
    match rng.below(10) {
        0..=3 => rtp_packet(rng),
        4..=5 => rtcp_packet(rng),
        6 => stun_packet(rng),
        7 => Vec::new(),
        _ => {
            let n = payload_len(rng);
            rng.bytes(n)
        }
    }
}

/// A valid frame to one of the model's addresses (or a neighbour of one), from its publisher
/// most of the time.
fn seed_frame(rng: &mut Rng, t: &ForwardingTable, log: &mut Vec<String>) -> Vec<u8> {
    let locals: Vec<SocketAddr> = t.streams.keys().map(|k| k.local).chain(t.feedback.keys().copied()).collect();
    let dst = match rng.below(10) {
        0 => rng.pick(&[a("10.200.0.1:4001"), a("10.200.0.3:4000"), a("[fd00:200::1]:4001"), a("[fd00:200::3]:4000")]),
        _ => rng.pick(&locals),
    };
    let src = if dst.is_ipv4() {
        rng.pick(&[a(PUBLISHER), a(PUBLISHER), a(PUBLISHER), a(PUBLISHER2), a("10.200.0.66:5000"), a("10.200.0.9:5001")])
    } else {
        rng.pick(&[a(PUBLISHER6), a(PUBLISHER6), a("[fd00:200::66]:5000"), a("[fd00:200::9]:5001")])
    };
    let mut spec = FrameSpec::new(src, dst);
    spec.dst_mac = MAC0;
    if rng.chance(15) {
        spec.vlan = Some(rng.below(4096) as u16);
    }
    let payload = any_payload(rng);
    log.push(format!("seed {src} -> {dst} vlan {:?} payload {} bytes", spec.vlan, payload.len()));
    build_frame(&spec, &payload)
}

/// Where the headers would be, read from the bytes without validating anything.
struct Layout {
    /// Offset of the ethertype the IP header follows.
    ethertype: usize,
    l3: usize,
    v6: bool,
    l4: usize,
    payload: usize,
}

fn layout(f: &[u8]) -> Layout {
    let be = |at: usize| f.get(at..at + 2).map_or(0, |b| u16::from_be_bytes([b[0], b[1]]));
    let tagged = matches!(be(12), 0x8100 | 0x88a8);
    let ethertype = if tagged { 16 } else { 12 };
    let l3 = ethertype + 2;
    let v6 = be(ethertype) == 0x86dd || (be(ethertype) != 0x0800 && f.get(l3).is_some_and(|b| b >> 4 == 6));
    let l4 = if v6 { l3 + 40 } else { l3 + 4 * (f.get(l3).map_or(5, |b| b & 0x0f) as usize).max(5) };
    Layout { ethertype, l3, v6, l4, payload: l4 + 8 }
}

fn put16(f: &mut [u8], at: usize, v: u16) -> bool {
    match f.get_mut(at..at + 2) {
        Some(s) => {
            s.copy_from_slice(&v.to_be_bytes());
            true
        }
        None => false,
    }
}

fn put(f: &mut [u8], at: usize, v: &[u8]) -> bool {
    match f.get_mut(at..at + v.len()) {
        Some(s) => {
            s.copy_from_slice(v);
            true
        }
        None => false,
    }
}

/// A length near `actual`, or a wild one.
fn length_value(rng: &mut Rng, actual: usize) -> u16 {
    match rng.below(6) {
        0 => 0,
        1 => 0xffff,
        2 => rng.next() as u16,
        _ => (actual as i64 + rng.below(17) as i64 - 8).clamp(0, 0xffff) as u16,
    }
}

/// Apply one random mutation; returns its description.
fn mutate(rng: &mut Rng, f: &mut Vec<u8>) -> String {
    let r = rng.next(); // the "any value" choice of the picks below
    let l = layout(f);
    let len = f.len();
    match rng.below(24) {
        0..=2 => {
            // Bit flip, mostly in the headers.
            let hot = (l.payload + 24).min(len);
            let at = if rng.chance(75) { rng.below(hot) } else { rng.below(len) };
            let bit = rng.below(8);
            f[at] ^= 1 << bit;
            format!("flip bit {bit} of byte {at}")
        }
        3..=4 => {
            let at = if rng.chance(75) { rng.below((l.payload + 24).min(len)) } else { rng.below(len) };
            let v = rng.pick(&[0u8, 0xff, 0x80, 0x7f, 0x40, 0x45, 0x46, 0x4f, 0x60, 0x11, 0x06, 0x2c, 0xc8, 0xbf, 0xc0, 0xdf, 0xe0, r as u8]);
            f[at] = v;
            format!("byte {at} = {v:#04x}")
        }
        5 => {
            let n = 14 + rng.below(len.saturating_sub(14).max(1));
            f.truncate(n);
            format!("truncate to {n}")
        }
        6 => {
            let k = 1 + rng.below(64);
            f.extend(rng.bytes(k));
            format!("append {k} bytes")
        }
        7 => {
            let (at, actual) = if l.v6 { (l.l3 + 4, len.saturating_sub(l.l3 + 40)) } else { (l.l3 + 2, len.saturating_sub(l.l3)) };
            let v = length_value(rng, actual);
            put16(f, at, v);
            format!("IP length = {v}")
        }
        8 => {
            let v = length_value(rng, len.saturating_sub(l.l4));
            put16(f, l.l4 + 4, v);
            format!("UDP length = {v}")
        }
        9 if !l.v6 => {
            let ihl = rng.below(16) as u8;
            if let Some(b) = f.get_mut(l.l3) {
                *b = (*b & 0xf0) | ihl;
            }
            format!("IHL = {ihl}")
        }
        10 if !l.v6 => {
            let v = rng.pick(&[0x2000u16, 0x4000, 0x0001, 0x1fff, 0x6000, 0x8000, r as u16]);
            put16(f, l.l3 + 6, v);
            format!("frag field = {v:#06x}")
        }
        11 => {
            let p = rng.pick(&[6u8, 17, 0, 1, 43, 44, 50, 51, 58, 59, 60, 135, 139, 140, 255, r as u8]);
            put(f, l.l3 + if l.v6 { 6 } else { 9 }, &[p]);
            format!("protocol = {p}")
        }
        12 => {
            let t = rng.pick(&[0x0800u16, 0x86dd, 0x8100, 0x88a8, 0x0806, 0x0000, r as u16]);
            let at = if rng.chance(70) { l.ethertype } else { 12 };
            put16(f, at, t);
            format!("ethertype at {at} = {t:#06x}")
        }
        13 => {
            let tpid = rng.pick(&[0x8100u16, 0x88a8]);
            let tci = rng.next() as u16;
            let mut tag = tpid.to_be_bytes().to_vec();
            tag.extend_from_slice(&tci.to_be_bytes());
            f.splice(12..12, tag);
            format!("insert tag {tpid:#06x}/{tci:#06x}")
        }
        14 if l.ethertype == 16 && len >= 18 => {
            f.drain(12..16);
            "remove the VLAN tag".into()
        }
        15 => {
            let p = rng.pick(&[4000u16, 4001, 4002, 4004, 4006, 4008, 4010, 4012, 4014, 4016, 0, r as u16]);
            put16(f, l.l4 + 2, p);
            format!("dst port = {p}")
        }
        16 => {
            let p = rng.pick(&[5000u16, 6000, 5001, 0, r as u16]);
            put16(f, l.l4, p);
            format!("src port = {p}")
        }
        17 => {
            if l.v6 {
                let ip = rng.pick(&[[0xfd00u16, 0x200, 0, 0, 0, 0, 0, 9], [0xfd00, 0x200, 0, 0, 0, 0, 0, 0x66], [0, 0, 0, 0, 0, 0xffff, 0x0ac8, 0x0009]]);
                let b: Vec<u8> = ip.iter().flat_map(|w| w.to_be_bytes()).collect();
                put(f, l.l3 + 8, &b);
                format!("src ip6 = {ip:x?}")
            } else {
                let ip = rng.pick(&[[10u8, 200, 0, 9], [10, 200, 0, 8], [10, 200, 0, 66], [0, 0, 0, 0], [255, 255, 255, 255]]);
                put(f, l.l3 + 12, &ip);
                format!("src ip = {ip:?}")
            }
        }
        18 => {
            if l.v6 {
                let last = rng.pick(&[1u8, 3]);
                put(f, l.l3 + 39, &[last]);
                format!("dst ip6 last byte = {last}")
            } else {
                let ip = rng.pick(&[[10u8, 200, 0, 1], [10, 200, 0, 3], [127, 0, 0, 1]]);
                put(f, l.l3 + 16, &ip);
                format!("dst ip = {ip:?}")
            }
        }
        19 => {
            // RTP/RTCP first byte: version, padding, extension, CSRC count / report count.
            let mask = rng.pick(&[0x20u8, 0x10, 0x0f, 0x01, 0x08, 0xc0, 0x40, 0x80]);
            if let Some(b) = f.get_mut(l.payload) {
                *b ^= mask;
            }
            format!("payload byte 0 ^= {mask:#04x}")
        }
        20 => {
            let v = rng.pick(&[127u8, 128, 191, 192, 200, 201, 206, 223, 224, 255, r as u8]);
            put(f, l.payload + 1, &[v]);
            format!("payload byte 1 = {v}")
        }
        21 => {
            let s = ssrc(rng);
            let at = l.payload + rng.pick(&[4usize, 8]);
            put(f, at, &s.to_be_bytes());
            format!("SSRC at payload+{} = {s:#x}", at - l.payload)
        }
        22 => {
            // RTCP length / RTP extension length / a word near the start of the payload.
            let at = l.payload + rng.pick(&[2usize, 14, 18, 26, 30, 34]);
            let v = rng.pick(&[0u16, 1, 2, 6, 7, 0xff, 0xffff, r as u16]);
            put16(f, at, v);
            format!("payload u16 at {} = {v}", at - l.payload)
        }
        23 if len > l.payload => {
            // Shorten the payload and keep the lengths consistent: the frame still parses.
            let k = 1 + rng.below((len - l.payload).min(40));
            f.truncate(len - k);
            fix_lengths(f);
            format!("shrink payload by {k} (lengths fixed)")
        }
        _ => {
            // Last byte (RTP padding count).
            let v = rng.pick(&[0u8, 1, 4, 200, 255]);
            if let Some(b) = f.last_mut() {
                *b = v;
            }
            format!("last byte = {v}")
        }
    }
}

/// Make the IP and UDP length fields describe the frame as it is (when the layout is sane).
fn fix_lengths(f: &mut [u8]) {
    let l = layout(f);
    if l.payload > f.len() {
        return;
    }
    let udp = (f.len() - l.l4) as u16;
    if l.v6 {
        put16(f, l.l3 + 4, udp);
    } else {
        put16(f, l.l3 + 2, (f.len() - l.l3) as u16);
    }
    put16(f, l.l4 + 4, udp);
}

/// Recompute the IPv4 header and UDP checksums of a frame that parses.
fn fix_checksums(f: &mut [u8]) {
    let Ok(p) = parse_frame(f) else { return };
    if p.src.is_ipv4() {
        put16(f, p.l3 + 10, 0);
        let c = internet_checksum(&f[p.l3..p.l4]);
        put16(f, p.l3 + 10, c);
    }
    put16(f, p.l4 + 6, 0);
    let c = udp_checksum(p.src.ip(), p.dst.ip(), &f[p.l4..p.payload + p.payload_len]);
    put16(f, p.l4 + 6, c);
}

/// A frame and what was done to it. A quarter are the simulcast publishers' next packets,
/// mostly left intact so their consumers' rewrites go somewhere.
fn fuzz_frame(rng: &mut Rng, t: &ForwardingTable, publishers: &mut Publishers) -> (Vec<u8>, Vec<String>) {
    let mut log = Vec::new();
    let simulcast = rng.chance(25);
    let mut f = if simulcast { publishers.frame(rng, &mut log) } else { seed_frame(rng, t, &mut log) };
    if rng.chance(if simulcast { 15 } else { 80 }) {
        for _ in 0..1 + rng.below(4) {
            let m = mutate(rng, &mut f);
            log.push(m);
        }
        if rng.chance(25) {
            fix_lengths(&mut f);
            log.push("fix lengths".into());
        }
        if rng.chance(60) {
            fix_checksums(&mut f);
            log.push("fix checksums".into());
        }
    } else if rng.chance(10) {
        // Valid frames with a broken checksum: dropped (bad_checksum) where the source is right,
        // never forwarded, never "repaired".
        let l = layout(&f);
        if let Some(b) = f.get_mut(l.l4 + 6) {
            *b ^= 0x5a;
        }
        log.push("corrupt the UDP checksum".into());
    }
    (f, log)
}

/// BPF_PROG_TEST_RUN refuses frames shorter than the L3 header their ethertype announces
/// (the skb it builds must hold one); real frames like that can reach TC, the lab cannot make
/// them.
fn test_run_may_refuse(f: &[u8]) -> bool {
    let et = u16::from_be_bytes([f[12], f[13]]);
    (et == 0x0800 && f.len() < 14 + 20) || (et == 0x86dd && f.len() < 14 + 40)
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().map(|v| v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

/// Run `f` through the XDP pre-filter: its drop counter ("xdp_drop_stranger" or
/// "xdp_drop_no_stream") if it dropped it, None if it passed; Err if that disagrees with the
/// reference's verdict `want` or the counters.
fn judge_xdp(pf: &Prefilter, f: &[u8], want: &Expect) -> Result<Option<&'static str>, String> {
    let before = pf.counters().map_err(|e| e.to_string())?;
    let verdict = pf.test_run(f).map_err(|e| format!("XDP test run: {e}"))?;
    let after = pf.counters().map_err(|e| e.to_string())?;
    let d = |k: &str| after[k] - before[k];
    let moved = (d("xdp_drop_stranger"), d("xdp_drop_no_stream"), d("xdp_pass"));
    match verdict {
        XDP_PASS if moved == (0, 0, 1) => Ok(None),
        XDP_DROP => {
            let (counter, tc) = match moved {
                (1, 0, 0) => ("xdp_drop_stranger", "drop_stranger"),
                (0, 1, 0) => ("xdp_drop_no_stream", "drop_no_stream"),
                _ => return Err(format!("XDP dropped it, counters moved (stranger, no stream, pass) = {moved:?}")),
            };
            if *want != Expect::Drop(tc) {
                return Err(format!("XDP dropped it as {counter}, the reference says {want:?}"));
            }
            Ok(Some(counter))
        }
        v => Err(format!("XDP verdict {v}, counters moved (stranger, no stream, pass) = {moved:?}")),
    }
}

/// Judge `frames` frames of seed `seed`; the first mismatches, described, if any. Now and
/// then the control plane moves a simulcast consumer to another target.
fn run(rig: &Rig, pf: &Prefilter, t: &ForwardingTable, seed: u64, frames: u64) -> (BTreeMap<String, u64>, Vec<String>) {
    let mut rng = Rng(seed);
    let mut publishers = Publishers::new(&mut rng);
    let mut model = LayerModel::new(rig, &mut rng);
    let mut forwarded = ForwardedModel::default();
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    let mut failures = Vec::new();
    let fail = |failures: &mut Vec<String>, i: u64, e: String, log: &[String], f: &[u8]| {
        failures.push(format!("frame #{i}: {e}\n  made by: {}\n  frame: {}", log.join("; "), hex(f)));
        failures.len() >= 5
    };
    for i in 0..frames {
        if rng.chance(2) {
            if let Err(e) = model.retarget(rig, &mut rng) {
                failures.push(format!("before frame #{i}: {e}"));
                break;
            }
            *seen.entry("layer target changed".into()).or_default() += 1;
        }
        let (f, log) = fuzz_frame(&mut rng, t, &mut publishers);
        if f.len() < 14 {
            continue; // BPF_PROG_TEST_RUN needs an Ethernet header
        }
        if test_run_may_refuse(&f) && rig.fp.test_run(&f, Some(rig.ifindex)).is_err() {
            *seen.entry("refused by BPF_PROG_TEST_RUN".into()).or_default() += 1;
            continue;
        }
        let want = reference(t, &f);
        let label = match &want {
            Expect::Forward(c) => format!("forward {} copies", c.len().min(2)).replace("2 copies", "2+ copies"),
            Expect::Drop(c) | Expect::Pass(c) => c.to_string(),
            Expect::Layered(..) => unreachable!("the reference does not decide layers"),
        };
        *seen.entry(label).or_default() += 1;
        match judge_xdp(pf, &f, &want) {
            Ok(Some(counter)) => *seen.entry(counter.to_string()).or_default() += 1,
            Ok(None) => {}
            Err(e) => {
                if fail(&mut failures, i, e, &log, &f) {
                    break;
                }
            }
        }
        // TC judges every frame, including those XDP dropped (it must still be right on its own).
        let before_ns = mediaplane_dataplane::monotonic_ns();
        let (mut refined, mut model_err) = (None, None);
        let judged = rig.judge_refined(t, &f, Duration::ZERO, &any_copy, &mut |want| match model.refine(rig, t, &f, want.clone(), before_ns) {
            Ok(r) => {
                refined = Some(r.clone());
                r
            }
            Err(e) => {
                model_err = Some(e);
                want
            }
        });
        if let Some(Expect::Layered(c, last_is_original)) = refined {
            let label = match (c.is_empty(), last_is_original) {
                (true, _) => "layer: no consumer's",
                (false, true) => "layer: rewritten copies, the last the packet itself",
                (false, false) => "layer: rewritten copies",
            };
            *seen.entry(label.into()).or_default() += 1;
        }
        match model_err.map(Err).unwrap_or(judged) {
            Ok(copies) => forwarded.on_copies(t, &f, &copies),
            Err(e) => {
                if fail(&mut failures, i, e, &log, &f) {
                    break;
                }
            }
        }
    }
    if let Err(e) = forwarded.check(rig) {
        failures.push(e);
    }
    *seen.entry("consumers accounted as forwarded".into()).or_default() += forwarded.0.len() as u64;
    // Copies that arrived late would have been missed above.
    let late = rig.cap.collect_for(0, Duration::ZERO, Duration::from_millis(300), any_copy);
    if !late.is_empty() {
        failures.push(format!("{} copies arrived after their frame was judged: {}", late.len(), describe(&late)));
    }
    (seen, failures)
}

#[test]
fn random_and_mutated_frames_follow_the_reference() {
    root_or_skip!("random_and_mutated_frames_follow_the_reference");
    let seed = env_u64("MEDIAPLANE_FUZZ_SEED").unwrap_or_else(|| {
        let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap();
        t.as_nanos() as u64 ^ ((std::process::id() as u64) << 32)
    });
    let frames = env_u64("MEDIAPLANE_FUZZ_FRAMES").unwrap_or(10000);
    println!("fuzz seed {seed}, {frames} frames (replay: MEDIAPLANE_FUZZ_SEED={seed} MEDIAPLANE_FUZZ_FRAMES={frames})");
    let rig = Rig::new();
    let pf = Prefilter::load(&rig.fp).expect("load the XDP pre-filter");
    let t = fuzz_table();
    rig.apply(&t);
    let start = Instant::now();
    let (seen, failures) = run(&rig, &pf, &t, seed, frames);
    println!("{:.1} s; expected verdicts: {seen:?}", start.elapsed().as_secs_f64());
    assert!(failures.is_empty(), "seed {seed}: the kernel disagrees with the reference:\n{}", failures.join("\n"));
    // The generator must keep reaching every verdict, or the run proves little.
    if frames >= 2000 {
        for v in [
            "forward 1 copies",
            "forward 2+ copies",
            "drop_stranger",
            "drop_malformed",
            "drop_no_stream",
            "pass_not_ours",
            "pass_stun",
            "pass_unlatched",
            "pass_slow_stream",
            "pass_rtcp",
            "pass_feedback",
            "pass_truncated",
            "pass_bad_udp_length",
            "pass_bad_ip_header",
            "pass_not_udp",
            "pass_vlan",
            "xdp_drop_stranger",
            "xdp_drop_no_stream",
            "layer target changed",
            "layer: rewritten copies",
            "layer: rewritten copies, the last the packet itself",
            "layer: no consumer's",
            "consumers accounted as forwarded",
        ] {
            assert!(seen.get(v).copied().unwrap_or(0) > 0, "seed {seed}: no frame reached {v}: {seen:?}");
        }
    }
}

/// The generator's helpers themselves: seeds are valid, fixes make frames parse again.
#[test]
fn generator_makes_valid_seeds_and_fixes() {
    let t = fuzz_table();
    let mut rng = Rng(7);
    for _ in 0..500 {
        let f = seed_frame(&mut rng, &t, &mut Vec::new());
        let p = parse_frame(&f).expect("seed frames parse");
        assert!(mediaplane_core::packet::verify_checksums(&f, &p).ok());
        let mut g = f.clone();
        let k = (g.len() - p.payload).min(3);
        g.truncate(g.len() - k);
        fix_lengths(&mut g);
        fix_checksums(&mut g);
        let q = parse_frame(&g).expect("fixed frames parse");
        assert!(mediaplane_core::packet::verify_checksums(&g, &q).ok());
    }
    // Same seed, same frames.
    let (mut r1, mut r2) = (Rng(42), Rng(42));
    let (mut p1, mut p2) = (Publishers::new(&mut r1), Publishers::new(&mut r2));
    for _ in 0..50 {
        assert_eq!(fuzz_frame(&mut r1, &t, &mut p1).0, fuzz_frame(&mut r2, &t, &mut p2).0);
    }
}
