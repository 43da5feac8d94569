//! The BPF_PROG_TEST_RUN rig shared by test_run.rs (crafted frames) and fuzz_test_run.rs
//! (random and mutated frames): a lab of two namespaces joined by a veth pair, the program
//! loaded in the first, a capture on the second, and the oracle — `ForwardingTable::classify()`
//! on what `parse_frame()` makes of the frame — that every run is judged against.

use super::*;
use mediaplane_core::packet::{build_frame, parse_frame, verify_checksums, FrameError, FrameSpec};
use mediaplane_core::pipeline::{reference as reference_effects, Dropped, Effect};
use mediaplane_core::rtp::{build_rtp, demux, MediaKind};
use mediaplane_core::table::{Copy, DropReason, ForwardingTable, IngressKey, SlowReason, SourceRule, StreamEntry, Verdict};
use mediaplane_ebpf::maps::{config_flags, flags, kernel_entries, FastConfigRaw};
use mediaplane_ebpf::{FastPath, KernelStats, LoadOptions, TC_ACT_OK, TC_ACT_REDIRECT, TC_ACT_SHOT};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

pub const MAC0: [u8; 6] = [0x02, 0, 0, 0, 0, 0xa0];
pub const MAC1: [u8; 6] = [0x02, 0, 0, 0, 0, 0xa1];
/// MTU of the lab's veth pair: a copy whose IP packet is larger cannot leave (bpf_fib_lookup
/// says "fragmentation needed"), so the kernel hands such packets to the stack.
pub const LAB_MTU: usize = 1500;

pub fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// A namespace with v0 (10.200.0.1/24, fd00:200::1/64, forwarding on) and its veth peer v1 in
/// a second namespace, standing for every subscriber (10.200.0.2, fd00:200::2 resolved
/// permanently to v1's MAC). v1 lives apart so that the SFU side's forwarding never bounces
/// captured copies back (IPv6 forwarding is a per-namespace switch).
pub struct Lab {
    pub ns: Netns,
    pub peer: Netns,
    pub v0: String,
    pub v1: String,
}

impl Lab {
    pub fn new() -> Lab {
        let ns = Netns::new("t");
        let peer = Netns::new("p");
        let v0 = format!("{}a", ns.name);
        let v1 = format!("{}b", ns.name);
        ns.ip(&["link", "add", &v0, "address", "02:00:00:00:00:a0", "type", "veth", "peer", "name", &v1, "address", "02:00:00:00:00:a1"]);
        ns.ip(&["link", "set", &v1, "netns", &peer.name]);
        ns.ip(&["link", "set", &v0, "up", "mtu", &LAB_MTU.to_string()]);
        peer.ip(&["link", "set", &v1, "up"]);
        ns.ip(&["addr", "add", "10.200.0.1/24", "dev", &v0]);
        ns.ip(&["addr", "add", "fd00:200::1/64", "dev", &v0, "nodad"]);
        ns.ip(&["neigh", "add", "10.200.0.2", "lladdr", "02:00:00:00:00:a1", "dev", &v0, "nud", "permanent"]);
        ns.ip(&["neigh", "add", "fd00:200::2", "lladdr", "02:00:00:00:00:a1", "dev", &v0, "nud", "permanent"]);
        ns.sysctl(&format!("net/ipv4/conf/{v0}/forwarding"), "1");
        ns.sysctl("net/ipv6/conf/all/forwarding", "1");
        Lab { ns, peer, v0, v1 }
    }
}

pub fn entry(id: u32, local: &str, ssrc: Option<u32>, source: SourceRule, rtp: bool, copies: Vec<(SocketAddr, SocketAddr)>) -> StreamEntry {
    let key = IngressKey { local: a(local), ssrc };
    StreamEntry {
        id,
        label: format!("s{id}"),
        key,
        source,
        rtp,
        copies: copies
            .into_iter()
            .enumerate()
            .map(|(i, (from, to))| Copy {
                subscriber: format!("sub{i}"),
                from,
                to,
                outbound: Default::default(),
                consumer: id * 1000 + i as u32 + 1,
                layer: None,
                max_layer: None,
                auto_layer: true,
                temporal_layer: None,
                payload_type: None,
                rtcp: None,
            })
            .collect(),
        rate: None,
        record: false,
        inbound: Default::default(),
        clock_rate: if rtp { 8000 } else { 0 },
        evaluate_rtcp: false,
        simulcast: None,
        handshake: false,
        stream_ids: None,
        publisher_feedback: None,
        reverse: mediaplane_core::srtp::Protection::Clear,
        control: Default::default(),
        dtmf: Vec::new(),
    }
}

pub fn table(version: u64, entries: Vec<StreamEntry>) -> ForwardingTable {
    ForwardingTable { version, streams: entries.into_iter().map(|e| (e.key, e)).collect(), ..Default::default() }
}

/// `n` subscribers, all on 10.200.0.2 (one neighbour) with distinct ports.
pub fn subscribers_v4(n: usize) -> Vec<(SocketAddr, SocketAddr)> {
    subscribers(n, "10.200.0.1", "10.200.0.2", 40000)
}

/// `n` (from, to) copies: from `sfu_ip`:`port - 10000`, to `sub_ip`:`port`, ports from `base` on.
pub fn subscribers(n: usize, sfu_ip: &str, sub_ip: &str, base: u16) -> Vec<(SocketAddr, SocketAddr)> {
    let (sfu, sub) = (sfu_ip.parse().unwrap(), sub_ip.parse().unwrap());
    (0..n as u16).map(|i| (SocketAddr::new(sfu, base + i - 10000), SocketAddr::new(sub, base + i))).collect()
}

pub const PUBLISHER: &str = "10.200.0.9:5000";
pub const LOCAL: &str = "10.200.0.1:4000";

/// What the reference says the kernel must do with a frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Fan out these (from, to) copies and consume the original.
    Forward(Vec<(SocketAddr, SocketAddr)>),
    /// Consume and count under this counter.
    Drop(&'static str),
    /// To the stack, counted under this counter.
    Pass(&'static str),
    /// A simulcast layer's packet: the copies its consumers' rewriters decided, in copy-list
    /// order, each (from, to, payload as rewritten), and whether the last of them is the
    /// stream's last copy (the packet itself, redirected). Never [`reference`]'s answer: the
    /// fuzz driver's per-consumer model refines a `Forward` into it.
    Layered(Vec<(SocketAddr, SocketAddr, Vec<u8>)>, bool),
}

/// The ethertype after at most one VLAN tag (what `parse_frame` dispatches on).
fn inner_ethertype(frame: &[u8]) -> Option<u16> {
    let be = |at: usize| frame.get(at..at + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    match be(12)? {
        0x8100 | 0x88a8 => be(16),
        t => Some(t),
    }
}

/// The IPv6 next-header values the kernel counts as extension headers (bpf/parse.h).
const IPV6_EXT_HEADERS: [u8; 8] = [0, 43, 50, 51, 60, 135, 139, 140];

/// What the kernel must do with `frame`: the frame checks the TC program makes itself, then core's
/// per-packet pipeline on its payload (`mediaplane_core::pipeline::reference`), except where the
/// kernel hands a packet to the slow path instead of deciding it.
pub fn reference(t: &ForwardingTable, frame: &[u8]) -> Expect {
    let f = match parse_frame(frame) {
        Ok(f) => f,
        Err(e) => {
            // The same verdict (to the stack) for the same frames; the kernel only names a few
            // reasons more precisely than the parser: a second VLAN tag, and IPv6 extension or
            // fragment headers (which the parser reports as "not UDP").
            let v6 = inner_ethertype(frame) == Some(0x86dd);
            return Expect::Pass(match e {
                FrameError::Truncated => "pass_truncated",
                FrameError::NotIp(0x8100 | 0x88a8) => "pass_vlan",
                FrameError::NotIp(_) => "pass_not_ip",
                FrameError::NotUdp(44) if v6 => "pass_fragment",
                FrameError::NotUdp(n) if v6 && IPV6_EXT_HEADERS.contains(&n) => "pass_ipv6_ext",
                FrameError::NotUdp(_) => "pass_not_udp",
                FrameError::IpOptions => "pass_ip_options",
                FrameError::Fragment => "pass_fragment",
                FrameError::BadIpHeader => "pass_bad_ip_header",
                FrameError::BadUdpLength => "pass_bad_udp_length",
            });
        }
    };
    // Traffic to addresses without streams is not ours: the kernel leaves it to the stack
    // (classify() calls it NoStream because it only ever sees the SFU's own sockets).
    if !t.is_local(f.dst) {
        return Expect::Pass("pass_not_ours");
    }
    let payload = &frame[f.payload..f.payload + f.payload_len];
    // An ICE + DTLS-SRTP address: DTLS from anyone and the rest from its one source go up, the
    // rest is a stranger's (even what classify() would call malformed first).
    let wildcard = t.streams.get(&mediaplane_core::IngressKey { local: f.dst, ssrc: None }).filter(|w| w.handshake);
    if let Some(w) = wildcard.filter(|_| demux(payload) != MediaKind::Stun) {
        let dtls = matches!(payload.first(), Some(20..=63));
        return match w.source {
            SourceRule::Fixed(s) if s != f.src && !dtls => Expect::Drop("drop_stranger"),
            _ => Expect::Pass("pass_slow_stream"),
        };
    }
    // Core's per-packet pipeline decides; what the kernel does of it differs where it hands a
    // packet to the slow path instead of deciding itself.
    let effects = reference_effects(t, f.dst, f.src, payload);
    if effects.iter().any(|e| matches!(e, Effect::Feedback(_) | Effect::Dropped { why: Dropped::MalformedFeedback, .. })) {
        // The slow path routes it (and forwards a sender report in it).
        return Expect::Pass("pass_feedback");
    }
    match effects.first() {
        Some(Effect::Dropped { why: Dropped::Model(reason), .. }) => match reason {
            DropReason::NoStream => Expect::Drop("drop_no_stream"),
            DropReason::Stranger => Expect::Drop("drop_stranger"),
            DropReason::Malformed => Expect::Drop("drop_malformed"),
            DropReason::BadChecksum | DropReason::Spoofed => unreachable!("classify() judges payloads, not frames"),
        },
        Some(Effect::SlowPath { reason: SlowReason::Stun, .. }) => Expect::Pass("pass_stun"),
        // An SRTP stream: the kernel hands it up whole.
        Some(Effect::SlowPath { reason: SlowReason::Handshake, .. }) => Expect::Pass("pass_slow_stream"),
        Some(Effect::Received { stream, .. }) => {
            let e = t.streams.values().find(|e| e.id == *stream).expect("the pipeline's stream is the table's");
            let k = &kernel_entries(t, None)[&mediaplane_ebpf::maps::KeyRaw::new(e.key.local, e.key.ssrc)];
            let slow = k.flags & flags::SLOW != 0;
            let unlatched = effects.iter().any(|e| matches!(e, Effect::Unlatched { .. }));
            // A stream the kernel hands up whole goes up right after its source check: the
            // host's stack checks the frame on its way to the slow path's socket.
            if slow && !unlatched {
                return Expect::Pass("pass_slow_stream");
            }
            // Frame-level, after the source check: only what the host would accept (RIG_CONFIG
            // verifies checksums; no interface of the lab has a reverse-path mode).
            if !verify_checksums(frame, &f).ok() {
                return Expect::Drop("drop_bad_checksum");
            }
            // The kernel hands a learning leg's other sources up; the slow path relays them.
            if unlatched {
                return Expect::Pass("pass_unlatched");
            }
            // A relay leg whose DTMF is reported: its event payload types go up, the rest stays.
            let event_up =
                k.flags & flags::PT_UP != 0 && demux(payload) == MediaKind::Rtp && payload.get(1).is_some_and(|b| [k.layer.0, k.layer.1].contains(&(b & 0x7f)));
            let ip_len = f.payload + f.payload_len - f.l3;
            if slow {
                Expect::Pass("pass_slow_stream")
            } else if e.rtcp_to_slow_path() && e.rtp && e.inbound.is_clear() && demux(payload) == MediaKind::Rtcp {
                Expect::Pass("pass_rtcp")
            } else if event_up {
                Expect::Pass("pass_dtmf")
            } else if !e.copies.is_empty() && ip_len > LAB_MTU {
                // Copies too big for the egress link: the slow path (and the stack) deal with it.
                Expect::Pass("pass_fib_fail")
            } else {
                Expect::Forward(
                    effects
                        .iter()
                        .filter_map(|e| match e {
                            Effect::Send { from, to, copy: Some(_), .. } => Some((*from, *to)),
                            _ => None,
                        })
                        .collect(),
                )
            }
        }
        other => unreachable!("the pipeline's first effect {other:?} for {}", describe(&[frame.to_vec()])),
    }
}

/// The stream the kernel must account a frame to (its per-stream counters), per classify().
pub fn reference_stream(t: &ForwardingTable, frame: &[u8]) -> Option<u32> {
    let f = parse_frame(frame).ok()?;
    if !t.is_local(f.dst) {
        return None;
    }
    // An ICE + DTLS-SRTP address decides before any lookup: on its wildcard stream.
    let wildcard = t.streams.get(&mediaplane_core::IngressKey { local: f.dst, ssrc: None });
    if wildcard.is_some_and(|w| w.handshake) {
        return wildcard.map(|w| w.id);
    }
    match t.classify(f.dst, f.src, &frame[f.payload..f.payload + f.payload_len]) {
        Verdict::Forward(e) | Verdict::Learn(e) => Some(e.id),
        // Handed up before its stream is looked up: counted on the address's wildcard stream.
        Verdict::Feedback { .. } => t.streams.get(&mediaplane_core::IngressKey { local: f.dst, ssrc: None }).map(|e| e.id),
        Verdict::Drop { stream, .. } | Verdict::SlowPath { stream, .. } => stream,
    }
}

pub fn delta(before: &KernelStats, after: &KernelStats) -> BTreeMap<&'static str, u64> {
    after.global.iter().map(|(k, v)| (*k, v - before.get(k))).filter(|(_, v)| *v > 0).collect()
}

/// The UDP frames arriving on v1 whose destination port is one of `ports`.
pub fn udp_to(ports: &[u16]) -> impl Fn(&[u8]) -> bool + '_ {
    move |fr: &[u8]| parse_frame(fr).is_ok_and(|f| ports.contains(&f.dst.port()))
}

/// Everything arriving on v1 that the program could have sent: any frame to the subscribers'
/// MAC (nothing else in the lab sends there) and any UDP datagram at all.
pub fn any_copy(fr: &[u8]) -> bool {
    fr.get(0..6) == Some(&MAC1[..]) || parse_frame(fr).is_ok()
}

/// `Err(message)` unless `cond`.
macro_rules! ensure {
    ($cond:expr, $($fmt:tt)+) => {
        if !$cond {
            return Err(format!($($fmt)+));
        }
    };
}

/// The fast path as the daemon configures it (the host's TTL and hop limit are 64 in the lab's
/// fresh namespace; DSCP 0), except the order hold: nothing acknowledges packets handed up
/// here, so it is tested on its own (test_run.rs, order_*).
pub const RIG_CONFIG: FastConfigRaw =
    FastConfigRaw { flags: config_flags::VERIFY_CSUM | config_flags::FORWARDED_QOS, ttl: 64, hop_limit: 64, dscp: 0, rpf_v6: 0 };

/// A loaded program in the lab's namespace, with a capture on v1.
pub struct Rig {
    pub lab: Lab,
    pub fp: FastPath,
    pub cap: Capture,
    pub ifindex: u32,
    /// What the program was last configured with (the copies are judged by it).
    pub config: std::cell::Cell<FastConfigRaw>,
    _g: NetnsGuard,
}

impl Rig {
    pub fn new() -> Rig {
        Rig::with(&LoadOptions::default())
    }

    /// A rig whose program has maps of other sizes.
    pub fn with(opts: &LoadOptions) -> Rig {
        let lab = Lab::new();
        let g = lab.ns.enter();
        let fp = FastPath::load(opts).expect("load");
        fp.configure(&RIG_CONFIG).expect("configure");
        let v1 = lab.v1.clone();
        let cap = lab.peer.run(move || Capture::new(&v1));
        let ifindex = ifindex(&lab.v0);
        Rig { lab, fp, cap, ifindex, config: std::cell::Cell::new(RIG_CONFIG), _g: g }
    }

    /// Configure the program (fast_config) and judge copies by it from now on.
    pub fn configure(&self, cfg: FastConfigRaw) {
        self.fp.configure(&cfg).expect("configure");
        self.config.set(cfg);
    }

    pub fn apply(&self, t: &ForwardingTable) {
        self.fp.apply(Arc::new(t.clone())).expect("apply");
    }

    /// Run `frame` through the program, check verdict, counters and copies against the
    /// reference, and return the captured copies. Panics on any difference.
    pub fn check(&self, t: &ForwardingTable, frame: &[u8]) -> Vec<Vec<u8>> {
        // Listen on every copy port of the table: a frame to any of them is a copy.
        let ports: Vec<u16> = t.streams.values().flat_map(|e| e.copies.iter().map(|c| c.to.port())).collect();
        let keep = udp_to(&ports);
        self.judge(t, frame, Duration::from_millis(100), &keep).unwrap_or_else(|e| panic!("{e}"))
    }

    /// [`Rig::check`] returning the difference instead of panicking. Copies are the captured
    /// frames `keep` accepts; after the expected ones, the capture waits `grace` for more
    /// (zero: takes only what is already queued).
    pub fn judge(&self, t: &ForwardingTable, frame: &[u8], grace: Duration, keep: &dyn Fn(&[u8]) -> bool) -> Result<Vec<Vec<u8>>, String> {
        self.judge_refined(t, frame, grace, keep, &mut |want| want)
    }

    /// [`Rig::judge`] with the reference's answer passed through `refine` after the run and
    /// before the judging (it may read what the run left in the maps, e.g. the time a layer
    /// rewrite took for "now").
    pub fn judge_refined(
        &self,
        t: &ForwardingTable,
        frame: &[u8],
        grace: Duration,
        keep: &dyn Fn(&[u8]) -> bool,
        refine: &mut dyn FnMut(Expect) -> Expect,
    ) -> Result<Vec<Vec<u8>>, String> {
        let want = reference(t, frame);
        let before = self.fp.kernel_stats().map_err(|e| e.to_string())?;
        let run = self.fp.test_run(frame, Some(self.ifindex)).map_err(|e| format!("{want:?}: {e}"))?;
        let after = self.fp.kernel_stats().map_err(|e| e.to_string())?;
        let want = refine(want);
        let d = delta(&before, &after);
        // Per-stream counters move for the classified stream only (none when there is none).
        let moved: Vec<u32> = after.streams.iter().filter(|(id, c)| before.streams.get(id) != Some(c)).map(|(id, _)| *id).collect();
        let stream = reference_stream(t, frame);
        ensure!(moved == stream.into_iter().collect::<Vec<_>>(), "{want:?}: per-stream counters moved for {moved:?}, want {stream:?}");
        match &want {
            Expect::Forward(_) | Expect::Layered(..) => {
                // The last copy is the packet itself, redirected: BPF_PROG_TEST_RUN hands it
                // back (data_out) instead of transmitting it. A layer's payloads are each
                // consumer's rewrite (by destination).
                let mut payloads = BTreeMap::new();
                let (copies, last_is_original) = match &want {
                    Expect::Forward(c) => (c.clone(), !c.is_empty()),
                    Expect::Layered(c, last) => {
                        payloads = c.iter().map(|(_, to, p)| (*to, p.clone())).collect();
                        (c.iter().map(|(from, to, _)| (*from, *to)).collect::<Vec<_>>(), *last)
                    }
                    _ => unreachable!(),
                };
                let want_ret = if last_is_original { TC_ACT_REDIRECT } else { TC_ACT_SHOT };
                ensure!(run.retval == want_ret, "{want:?}: verdict {} (want {want_ret}), counters {d:?}", run.retval);
                ensure!(d.get("forwarded") == Some(&1), "{want:?}: counters {d:?}");
                ensure!(d.get("rx_packets") == Some(&1), "{want:?}: counters {d:?}");
                ensure!(d.get("tx_copies").copied().unwrap_or(0) == copies.len() as u64, "{want:?}: counters {d:?}");
                ensure!(!d.contains_key("tx_errors"), "{want:?}: counters {d:?}");
                let clones = copies.len() - usize::from(last_is_original);
                let mut got = self.cap.collect_for(clones, Duration::from_secs(3), grace, keep);
                if last_is_original {
                    got.push(run.data_out.clone());
                }
                verify_copies(frame, &copies, &payloads, &got, &self.config.get())?;
                Ok(got)
            }
            Expect::Drop(counter) => {
                ensure!(run.retval == TC_ACT_SHOT, "{want:?}: verdict {}, counters {d:?}", run.retval);
                ensure!(d.get(counter) == Some(&1), "{want:?}: counters {d:?}");
                ensure!(!d.contains_key("tx_copies"), "{want:?}: counters {d:?}");
                let got = self.cap.collect_for(0, Duration::ZERO, grace, keep);
                ensure!(got.is_empty(), "{want:?}: a dropped packet was copied: {}", describe(&got));
                Ok(vec![])
            }
            Expect::Pass(counter) => {
                ensure!(run.retval == TC_ACT_OK, "{want:?}: verdict {}, counters {d:?}", run.retval);
                ensure!(run.data_out == frame, "{want:?}: the packet went to the stack modified: {}", hex(&run.data_out));
                ensure!(d.get(counter) == Some(&1), "{want:?}: counters {d:?}");
                // The kernel counts only what it decides: the slow path counts the rest.
                ensure!(!d.contains_key("rx_packets"), "{want:?}: counters {d:?}");
                let got = self.cap.collect_for(0, Duration::ZERO, grace, keep);
                ensure!(got.is_empty(), "{want:?}: a passed packet was copied: {}", describe(&got));
                Ok(vec![])
            }
        }
    }
}

/// Source and destination of each frame, for messages.
pub fn describe(frames: &[Vec<u8>]) -> String {
    frames.iter().map(|f| parse_frame(f).map_or_else(|e| format!("<{e}: {}>", hex(f)), |p| format!("{}->{}", p.src, p.dst))).collect::<Vec<_>>().join(", ")
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Exactly the expected copies (each once), correct headers and MACs, payload unchanged (or, for
/// a destination in `payloads`, that one), no bytes after the IP packet, checksums valid exactly
/// when the original's were (never broken, never laundered: a valid packet's copies are valid).
pub fn verify_copies(
    original: &[u8],
    expected: &[(SocketAddr, SocketAddr)],
    payloads: &BTreeMap<SocketAddr, Vec<u8>>,
    got: &[Vec<u8>],
    cfg: &FastConfigRaw,
) -> Result<(), String> {
    let of = parse_frame(original).map_err(|e| format!("forwarded an unparsable frame: {e}"))?;
    let payload = &original[of.payload..of.payload + of.payload_len];
    let want_ck = verify_checksums(original, &of);
    let mut seen = Vec::new();
    for fr in got {
        let f = parse_frame(fr).map_err(|e| format!("a copy does not parse ({e}): {}", hex(fr)))?;
        ensure!(f.vlan.is_none(), "copies leave untagged: {}", hex(fr));
        ensure!(fr[0..6] == MAC1, "dst MAC from the neighbour table: {}", hex(fr));
        ensure!(fr[6..12] == MAC0, "src MAC of the egress device: {}", hex(fr));
        ensure!(fr.len() == f.payload + f.payload_len, "copies carry no bytes after the IP packet: {} -> {} is {} bytes", f.src, f.dst, fr.len());
        own_header(fr, &f, cfg, original)?;
        let want_payload = payloads.get(&f.dst).map_or(payload, |p| &p[..]);
        ensure!(
            &fr[f.payload..f.payload + f.payload_len] == want_payload,
            "payload on {} -> {} is {}, want {}",
            f.src,
            f.dst,
            hex(&fr[f.payload..f.payload + f.payload_len]),
            hex(want_payload)
        );
        let c = verify_checksums(fr, &f);
        ensure!(
            c == want_ck,
            "checksums {c:?} on copy {} -> {}, the original's were {want_ck:?}{}",
            f.src,
            f.dst,
            if want_ck.ok() { " (a valid packet's copy must be valid)" } else { "" }
        );
        seen.push((f.src, f.dst));
    }
    let mut want = expected.to_vec();
    seen.sort();
    want.sort();
    ensure!(seen == want, "copies differ from the fan-out list: got {seen:?}, want {want:?}");
    Ok(())
}

/// A copy's IP header is the SFU's own (bpf/header.h): TTL / hop limit and DSCP of the
/// configuration, ECN Not-ECT, IPv4 DF (with an ID of the SFU's), IPv6 flow label 0.
pub fn own_header(fr: &[u8], f: &mediaplane_core::packet::UdpFrame, cfg: &FastConfigRaw, original: &[u8]) -> Result<(), String> {
    let ip = &fr[f.l3..];
    let o = parse_frame(original).map_err(|e| e.to_string())?;
    let oip = &original[o.l3..];
    let orig_tclass = if o.src.is_ipv4() { oip[1] } else { (oip[0] << 4) | (oip[1] >> 4) };
    let want_tclass = if cfg.flags & config_flags::KEEP_DSCP != 0 { orig_tclass & 0xfc } else { cfg.dscp << 2 };
    if f.src.is_ipv4() {
        ensure!(ip[8] == cfg.ttl, "TTL {} on copy {} -> {}, want {}", ip[8], f.src, f.dst, cfg.ttl);
        ensure!(ip[1] == want_tclass, "TOS {:#x} on copy {} -> {}, want {want_tclass:#x}", ip[1], f.src, f.dst);
        ensure!(ip[6..8] == [0x40, 0], "flags {:02x?} on copy {} -> {}, want DF", &ip[6..8], f.src, f.dst);
    } else {
        let tclass = (ip[0] << 4) | (ip[1] >> 4);
        let flow = u32::from_be_bytes([0, ip[1] & 0x0f, ip[2], ip[3]]);
        ensure!(ip[7] == cfg.hop_limit, "hop limit {} on copy {} -> {}, want {}", ip[7], f.src, f.dst, cfg.hop_limit);
        ensure!(tclass == want_tclass && flow == 0, "traffic class {tclass:#x} / flow label {flow:#x} on copy {} -> {}", f.src, f.dst);
    }
    Ok(())
}

pub fn v4_frame(src: &str, dst: &str, payload: &[u8]) -> Vec<u8> {
    let mut spec = FrameSpec::new(a(src), a(dst));
    spec.dst_mac = MAC0;
    build_frame(&spec, payload)
}

pub fn rtp(ssrc: u32) -> Vec<u8> {
    build_rtp(96, 7, 1234, ssrc, &[0x5a; 160])
}

#[allow(unused_macros)] // not every test file that includes common/ uses it
macro_rules! root_or_skip {
    ($name:expr) => {
        if !require_root($name) {
            return;
        }
    };
}
#[allow(unused_imports)]
pub(crate) use root_or_skip;
