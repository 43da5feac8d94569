//! rtpengine's reply key sets for `query`, `delete` and `statistics` (as rtpengine 10.5 sends
//! them: daemon/call_interfaces.c `ng_call_stats`, daemon/statistics.c), filled from the data
//! planes' per-stream counters and the engine's own bookkeeping.
//!
//! What mediaplane does not know (yet) is reported the way rtpengine reports an unknown: an
//! SSRC's MOS blocks are left out until its RTCP gave it a MOS, a stream's `SSRC` is left out
//! until one was seen.

use crate::bencode::Value;
use crate::calls::{self, Call, MediaState};
use mediaplane_control::config::MediaConfig;
use mediaplane_core::call_quality::{MosTotals, QualitySample, QualitySummary};
use mediaplane_core::model::{DemuxedRtcp, Follow, Leg, Relay, Side};
use mediaplane_core::reception::ReceptionReport;
use mediaplane_core::srtp::SrtpSuite;
use mediaplane_core::Model;
use mediaplane_dataplane::Counters;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One instant on the data planes' clock ([`mediaplane_dataplane::monotonic_ns`]) and on the
/// wall clock: converts packet times to the Unix times rtpengine reports.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    pub mono_ns: u64,
    pub wall: SystemTime,
}

impl Clock {
    pub fn now() -> Clock {
        Clock { mono_ns: mediaplane_dataplane::monotonic_ns(), wall: SystemTime::now() }
    }

    /// Unix seconds of the monotonic time `t`.
    pub fn unix_secs(&self, t: u64) -> i64 {
        let at = self.wall.checked_sub(Duration::from_nanos(self.mono_ns.saturating_sub(t))).unwrap_or(UNIX_EPOCH);
        unix_secs(at)
    }
}

pub fn unix_secs(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64)
}

/// rtpengine's commands in the order of its statistics, with their controlstatistics names.
pub const COMMANDS: [(&str, &str); 24] = [
    ("ping", "ping"),
    ("offer", "offer"),
    ("answer", "answer"),
    ("delete", "delete"),
    ("query", "query"),
    ("list", "list"),
    ("start recording", "startrec"),
    ("stop recording", "stoprec"),
    ("start forwarding", "startfwd"),
    ("stop forwarding", "stopfwd"),
    ("block DTMF", "blkdtmf"),
    ("unblock DTMF", "unblkdtmf"),
    ("block media", "blkmedia"),
    ("unblock media", "unblkmedia"),
    ("play media", "playmedia"),
    ("stop media", "stopmedia"),
    ("play DTMF", "playdtmf"),
    ("statistics", "stats"),
    ("silence media", "slnmedia"),
    ("unsilence media", "unslnmedia"),
    ("publish", "pub"),
    ("subscribe request", "subreq"),
    ("subscribe answer", "subans"),
    ("unsubscribe", "unsub"),
];

fn command_index(command: &str) -> Option<usize> {
    let c = crate::protocol::normalize(command);
    COMMANDS.iter().position(|(name, _)| crate::protocol::normalize(name) == c)
}

#[derive(Debug, Default, Clone, Copy)]
struct Timing {
    count: u64,
    total: Duration,
    min: Option<Duration>,
    max: Duration,
}

impl Timing {
    fn add(&mut self, took: Duration) {
        self.count += 1;
        self.total += took;
        self.min = Some(self.min.map_or(took, |m| m.min(took)));
        self.max = self.max.max(took);
    }
}

/// Requests per second of one command, sampled at every media-timeout sweep.
#[derive(Debug, Default, Clone, Copy)]
struct Rate {
    min: Option<f64>,
    max: f64,
    sum: f64,
    samples: u64,
}

/// Per-command counts and handling times, per client (rtpengine's "proxies") and overall.
#[derive(Debug, Default)]
pub struct ControlStats {
    proxies: BTreeMap<IpAddr, ([Timing; 24], u64)>,
    commands: [Timing; 24],
    since_sample: [u64; 24],
    rates: [Rate; 24],
    last_sample: Option<Instant>,
}

impl ControlStats {
    /// One request from `client` handled in `took`; `ok`: it got no error reply.
    pub fn record(&mut self, client: IpAddr, command: &str, took: Duration, ok: bool) {
        let proxy = self.proxies.entry(client).or_default();
        if !ok {
            proxy.1 += 1;
        }
        if let Some(i) = command_index(command) {
            proxy.0[i].add(took);
            self.commands[i].add(took);
            self.since_sample[i] += 1;
        }
    }

    /// Close a request-rate sample (called once per media-timeout sweep).
    pub fn sample(&mut self, now: Instant) {
        if let Some(last) = self.last_sample {
            let secs = now.saturating_duration_since(last).as_secs_f64();
            if secs > 0.0 {
                for (r, n) in self.rates.iter_mut().zip(self.since_sample.iter()) {
                    let rate = *n as f64 / secs;
                    r.min = Some(r.min.map_or(rate, |m| m.min(rate)));
                    r.max = r.max.max(rate);
                    r.sum += rate;
                    r.samples += 1;
                }
            }
        }
        self.since_sample = [0; 24];
        self.last_sample = Some(now);
    }
}

/// Packets, bytes and errors, as rtpengine's `stats` dictionaries count them.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traffic {
    pub packets: u64,
    pub bytes: u64,
    pub errors: u64,
}

impl Traffic {
    /// What a stream received from its party on `leg` (of the RTCP relay: `rtcp`), as
    /// rtpengine counts it: the bytes of an SRTP leg decrypted (the wire's less each packet's
    /// tag, and SRTCP's index; RTCP muxed on the RTP leg is counted as SRTP, 4 bytes short).
    pub fn received(c: &Counters, leg: &Leg, rtcp: bool) -> Traffic {
        let overhead = leg_suite(leg).map_or(0, |s| s.overhead(rtcp) as u64);
        Traffic { packets: c.rx_packets, bytes: c.rx_bytes.saturating_sub(c.rx_packets * overhead), errors: errors(c) }
    }

    /// What the relay sent on (rtpengine's "relayed").
    pub fn relayed(c: &Counters, _: &Leg, _: bool) -> Traffic {
        Traffic { packets: c.tx_copies, bytes: c.tx_bytes, errors: errors(c) }
    }

    pub fn add(&mut self, o: Traffic) {
        self.packets += o.packets;
        self.bytes += o.bytes;
        self.errors += o.errors;
    }

    fn sub(self, o: Traffic) -> Traffic {
        Traffic { packets: self.packets.saturating_sub(o.packets), bytes: self.bytes.saturating_sub(o.bytes), errors: self.errors.saturating_sub(o.errors) }
    }
}

/// Packets received from the party that were not relayed, and copies that could not be sent.
fn errors(c: &Counters) -> u64 {
    c.drop_stranger + c.drop_malformed + c.drop_rate_limited + c.drop_bad_checksum + c.drop_spoofed + c.tx_errors
}

/// Totals since start: what ended calls carried, and rates sampled at `statistics` requests.
#[derive(Debug, Default)]
pub struct TrafficTotals {
    ended: Traffic,
    durations: (f64, f64, u64),
    zero_way: u64,
    one_way: u64,
    last_sample: Option<(Instant, Traffic)>,
    rate: Traffic,
}

impl TrafficTotals {
    /// `call` ended at `now`; `streams`: its streams' last counters.
    pub fn call_ended(&mut self, call: &Call, model: &Model, streams: &BTreeMap<u32, Counters>, now: SystemTime) {
        for (i, m) in call.media.iter().enumerate() {
            if !m.active {
                continue;
            }
            for id in [calls::rtp_relay_id(&call.key, i), calls::rtcp_relay_id(&call.key, i)] {
                let Some(r) = model.relays.get(&id) else { continue };
                let rx = |uid| streams.get(&uid).map_or(0, |c| c.rx_packets);
                for leg in [&r.a, &r.b] {
                    if let Some(c) = streams.get(&leg.uid) {
                        self.ended.add(Traffic::relayed(c, leg, false));
                    }
                }
                if let Some((d, c)) = r.rtcp_demux.as_ref().and_then(|d| Some((d, streams.get(&d.uid)?))) {
                    self.ended.add(Traffic::relayed(c, r.leg(d.of), true));
                }
                if id == calls::rtp_relay_id(&call.key, i) {
                    match (rx(r.a.uid) > 0, rx(r.b.uid) > 0) {
                        (false, false) => self.zero_way += 1,
                        (true, false) | (false, true) => self.one_way += 1,
                        _ => {}
                    }
                }
            }
        }
        let secs = now.duration_since(call.created).unwrap_or_default().as_secs_f64();
        self.durations.0 += secs;
        self.durations.1 += secs * secs;
        self.durations.2 += 1;
    }

    /// Sample the rate of what live calls (`live`) and ended ones relayed since the last sample.
    pub fn sample(&mut self, now: Instant, live: Traffic) {
        let mut total = self.ended;
        total.add(live);
        if let Some((at, before)) = self.last_sample {
            let secs = now.saturating_duration_since(at).as_secs_f64();
            if secs > 0.0 {
                let d = total.sub(before);
                let per_s = |v: u64| (v as f64 / secs).round() as u64;
                self.rate = Traffic { packets: per_s(d.packets), bytes: per_s(d.bytes), errors: per_s(d.errors) };
            }
        }
        self.last_sample = Some((now, total));
    }
}

/// The traffic of every stream of `call`, split into RTP and RTCP.
pub fn call_traffic(call: &Call, model: &Model, streams: &BTreeMap<u32, Counters>, f: fn(&Counters, &Leg, bool) -> Traffic) -> (Traffic, Traffic) {
    relays_traffic(&calls::call_relays(model, call), streams, f)
}

/// [`call_traffic`] of a call's relays ([`calls::call_relays`]).
pub fn relays_traffic(relays: &[(&Relay, bool)], streams: &BTreeMap<u32, Counters>, f: fn(&Counters, &Leg, bool) -> Traffic) -> (Traffic, Traffic) {
    let (mut rtp, mut rtcp) = (Traffic::default(), Traffic::default());
    for &(r, is_rtcp) in relays {
        let acc = if is_rtcp { &mut rtcp } else { &mut rtp };
        for leg in [&r.a, &r.b] {
            if let Some(c) = streams.get(&leg.uid) {
                acc.add(f(c, leg, is_rtcp));
            }
        }
        if let Some((d, c)) = r.rtcp_demux.as_ref().and_then(|d| Some((d, streams.get(&d.uid)?))) {
            rtcp.add(f(c, r.leg(d.of), true));
        }
    }
    (rtp, rtcp)
}

/// The SRTP suite the relay terminates on `leg` (SDES or DTLS-SRTP), once keyed.
fn leg_suite(leg: &Leg) -> Option<SrtpSuite> {
    let srtp = leg.srtp.as_ref()?;
    srtp.inbound.as_ref().or(srtp.outbound.as_ref()).map(|k| k.suite)
}

fn traffic_value(t: Traffic) -> Value {
    Value::dict([("packets", int(t.packets)), ("bytes", int(t.bytes)), ("errors", int(t.errors))])
}

fn int(v: u64) -> Value {
    Value::Int(v.min(i64::MAX as u64) as i64)
}

fn endpoint(a: SocketAddr) -> Value {
    Value::dict([("family", Value::str(family(a.ip()))), ("address", Value::from(a.ip().to_string())), ("port", Value::Int(a.port() as i64))])
}

fn family(ip: IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// What a call reply needs besides the model and the counters.
pub struct CallView<'a> {
    pub call: &'a Call,
    /// The codec of each media section as last signalled ("PCMA/8000"), where known.
    pub codecs: &'a [Option<String>],
    /// The call is forwarded by the kernel (the eBPF plane).
    pub kernel: bool,
    pub clock: Clock,
}

/// The keys of a `query` reply, which rtpengine also sends in reply to `delete`: `created`,
/// `created_us`, `last signal`, `SSRC`, `tags` (per tag its `medias`, per media its `streams`)
/// and `totals`.
pub fn call_reply(
    model: &Model,
    streams: &BTreeMap<u32, Counters>,
    reception: &BTreeMap<u32, ReceptionReport>,
    quality: &BTreeMap<u32, QualitySummary>,
    v: &CallView<'_>,
) -> Vec<(&'static str, Value)> {
    let call = v.call;
    let created = call.created.duration_since(UNIX_EPOCH).unwrap_or_default();
    let mut tags = BTreeMap::new();
    for side in [Side::A, Side::B] {
        let (tag, peer) = match side {
            Side::A => (call.tag_a.clone().unwrap_or_default(), call.tag_b.clone()),
            Side::B => (call.tag_b.clone().unwrap_or_default(), call.tag_a.clone()),
        };
        let medias = call.media.iter().enumerate().map(|(i, m)| media_value(model, streams, reception, v, i, m, side)).collect();
        let mut d = vec![("tag", Value::from(tag.clone())), ("created", Value::Int(created.as_secs() as i64))];
        if let Some(label) = &call.labels[crate::calls::side_index(side)] {
            d.push(("label", Value::from(label.clone())));
        }
        if let Some(p) = peer {
            // rtpengine up to 10.x before subscriptions said "in dialogue with"; 10.5 lists both ways.
            d.push(("in dialogue with", Value::from(p.clone())));
            let sub = || Value::List(vec![Value::dict([("tag", Value::from(p.clone())), ("type", Value::str("offer/answer"))])]);
            d.push(("subscriptions", sub()));
            d.push(("subscribers", sub()));
        }
        d.push(("medias", Value::List(medias)));
        tags.insert(tag.into_bytes(), Value::dict(d));
    }
    let (rtp, rtcp) = call_traffic(call, model, streams, Traffic::received);
    vec![
        ("created", Value::Int(created.as_secs() as i64)),
        ("created_us", Value::Int(created.subsec_micros() as i64)),
        ("last signal", Value::Int(unix_secs(call.last_signal))),
        ("SSRC", Value::Dict(ssrc_stats(call, model, reception, quality))),
        ("tags", Value::Dict(tags)),
        ("totals", Value::dict([("RTP", traffic_value(rtp)), ("RTCP", traffic_value(rtcp))])),
    ]
}

/// Per SSRC received on the call's RTP legs, keyed by the SSRC in decimal as rtpengine keys
/// it: its `cumulative loss` (rtpengine's key) and what mediaplane measures in the path
/// (`mediaplane_core::reception`); and, once the RTCP its owner sent gave a MOS
/// (`mediaplane_core::call_quality`), rtpengine's MOS blocks: `average MOS`, `lowest MOS`,
/// `highest MOS`, `MOS progression`, which Kamailio's `mos_*_pv` AVPs read.
///
/// `cumulative loss` is what mediaplane counted of that SSRC's stream on its way in; rtpengine
/// gives what the SSRC's owner last reported losing of the media it receives.
fn ssrc_stats(call: &Call, model: &Model, reception: &BTreeMap<u32, ReceptionReport>, quality: &BTreeMap<u32, QualitySummary>) -> BTreeMap<Vec<u8>, Value> {
    let mut out: BTreeMap<u32, Vec<(&'static str, Value)>> = BTreeMap::new();
    for i in 0..call.media.len() {
        let Some(r) = model.relays.get(&calls::rtp_relay_id(&call.key, i)) else { continue };
        for leg in [&r.a, &r.b] {
            let Some(rep) = reception.get(&leg.uid) else { continue };
            let mut d = vec![
                ("cumulative loss", Value::Int(rep.lost)),
                ("packets", int(rep.packets)),
                ("expected packets", int(rep.expected)),
                ("duplicates", int(rep.duplicates)),
                ("reordered", int(rep.reordered)),
                ("highest sequence number", int(rep.highest_seq as u64)),
            ];
            if let Some(ms) = rep.jitter_ms {
                // Milliseconds, as rtpengine's MOS blocks give jitter.
                d.push(("jitter", Value::Int(ms.round() as i64)));
                d.push(("jitter (timestamp units)", int(rep.jitter as u64)));
            }
            out.insert(rep.ssrc, d);
        }
    }
    for (ssrc, q) in quality {
        let d = out.entry(*ssrc).or_insert_with(|| vec![("cumulative loss", Value::Int(q.reported_cumulative_lost as i64))]);
        d.extend(mos_blocks(q));
    }
    out.into_iter().map(|(ssrc, d)| (ssrc.to_string().into_bytes(), Value::dict(d))).collect()
}

/// rtpengine's MOS blocks of one SSRC: MOS × 10, round-trip times in µs, jitter in ms, packet
/// loss in %, `reported at` in Unix seconds.
fn mos_blocks(q: &QualitySummary) -> Vec<(&'static str, Value)> {
    fn common(s: &QualitySample) -> Vec<(&'static str, Value)> {
        vec![
            ("MOS", int(s.mos_x10 as u64)),
            ("round-trip time", int(s.rtt_us)),
            ("round-trip time leg", int(s.rtt_leg_us)),
            ("jitter", int(s.jitter_ms as u64)),
            ("packet loss", int(s.packet_loss_pct as u64)),
        ]
    }
    let sample = |s: &QualitySample| {
        let mut d = common(s);
        d.push(("reported at", int(s.reported_at_us / 1_000_000)));
        Value::dict(d)
    };
    let mut average = common(&q.average);
    average.push(("samples", int(q.samples)));
    vec![
        ("average MOS", Value::dict(average)),
        ("lowest MOS", sample(&q.lowest)),
        ("highest MOS", sample(&q.highest)),
        ("MOS progression", Value::dict([("interval", int(q.progression_interval_s)), ("entries", Value::List(q.progression.iter().map(sample).collect()))])),
    ]
}

/// One media of one side: where that party sends (local port), where the relay sends to it
/// (endpoint), what it signalled (advertised endpoint), what it sent (stats).
#[allow(clippy::too_many_arguments)]
fn media_value(
    model: &Model,
    streams: &BTreeMap<u32, Counters>,
    reception: &BTreeMap<u32, ReceptionReport>,
    v: &CallView<'_>,
    i: usize,
    m: &MediaState,
    side: Side,
) -> Value {
    let call = v.call;
    let mut list = Vec::new();
    if m.active {
        for (id, label) in [(calls::rtp_relay_id(&call.key, i), "RTP"), (calls::rtcp_relay_id(&call.key, i), "RTCP")] {
            let Some(r) = model.relays.get(&id) else { continue };
            let (leg, other) = if side == Side::A { (&r.a, &r.b) } else { (&r.b, &r.a) };
            let c = streams.get(&leg.uid).copied().unwrap_or_default();
            let suite = leg_suite(leg);
            // Before its first packet rtpengine reports the stream's creation.
            let last = if c.last_rx_ns > 0 { v.clock.unix_secs(c.last_rx_ns) } else { unix_secs(call.created) };
            let mut flags = vec![Value::str(label)];
            let peer = leg.peer();
            if peer.is_some() {
                flags.push(Value::str("filled"));
            }
            if leg.latched.is_some() && !leg.learning.open {
                flags.push(Value::str("confirmed"));
            }
            // What the kernel forwards itself: not a leg it would have to decrypt, encrypt for
            // the other party, record, judge by payload type or put DTMF into (those go
            // through the slow path on the eBPF plane).
            let controlled = !r.control.or(leg.control).is_off() || !leg.dtmf.is_empty();
            if v.kernel && peer.is_some() && leg.srtp.is_none() && other.srtp.is_none() && !call.recording && !controlled {
                flags.push(Value::str("kernelized"));
            }
            match leg.follow {
                Follow::Strict => flags.push(Value::str("strict source address")),
                Follow::Handover => flags.push(Value::str("media handover")),
                Follow::Window | Follow::Asymmetric => {}
            }
            let mut d = vec![
                ("local port", Value::Int(leg.local.port() as i64)),
                ("local address", Value::from(leg.local.ip().to_string())),
                ("family", Value::str(family(leg.local.ip()))),
            ];
            if let Some(p) = peer {
                d.push(("endpoint", endpoint(p)));
            }
            if let Some(p) = leg.remote {
                d.push(("advertised endpoint", endpoint(p)));
            }
            if let Some(s) = suite {
                d.push(("crypto suite", Value::str(s.name())));
            }
            d.push(("last packet", Value::Int(last)));
            if let Some(r) = reception.get(&leg.uid) {
                d.push(("SSRC", int(r.ssrc as u64)));
            }
            d.push(("flags", Value::List(flags)));
            let received = Traffic::received(&c, leg, label == "RTCP");
            let mut stats = vec![("packets", int(received.packets)), ("bytes", int(received.bytes)), ("errors", int(received.errors))];
            // mediaplane's own: copies sent on (rtpengine counts what it received).
            stats.push(("relayed", int(c.tx_copies)));
            d.push(("stats", Value::dict(stats)));
            list.push(Value::dict(d));
        }
        if let Some(d) = model.relays.get(&calls::rtp_relay_id(&call.key, i)).and_then(|r| Some((r, r.rtcp_demux.as_ref().filter(|d| d.of == side)?))) {
            list.push(demuxed_rtcp_value(streams, v, d));
        }
    }
    let mut flags = vec![];
    if m.active {
        flags.extend([Value::str("initialized"), Value::str("send"), Value::str("recv")]);
    }
    // Per side: a party whose RTCP is demultiplexed for the other still multiplexes.
    if m.mux || m.demux.is_some_and(|d| d != side) {
        flags.push(Value::str("rtcp-mux"));
    }
    // What the relay terminates toward this side's party, in rtpengine's order.
    let s = calls::side_index(side);
    if m.webrtc[s].is_some() {
        flags.push(Value::str("DTLS-SRTP"));
    }
    if m.sdes[s].is_some() {
        flags.push(Value::str("SDES"));
    }
    if m.webrtc[s].is_some() {
        flags.push(Value::str("ICE"));
    }
    // The protocol this side's party speaks (the two differ when the relay bridges SRTP).
    let proto = m.proto_of[s].clone().unwrap_or_else(|| m.proto.clone());
    let mut d = vec![("index", Value::Int(i as i64 + 1)), ("type", Value::from(m.kind.clone())), ("protocol", Value::from(proto))];
    if let Some(Some(codec)) = v.codecs.get(i) {
        d.push(("codec", Value::from(codec.clone())));
    }
    d.push(("streams", Value::List(list)));
    d.push(("flags", Value::List(flags)));
    Value::dict(d)
}

/// The RTCP stream of a party that keeps it apart while the other multiplexes
/// (`rtcp-mux-demux`): its own address on the RTP relay, as an RTCP relay's leg reads.
fn demuxed_rtcp_value(streams: &BTreeMap<u32, Counters>, v: &CallView<'_>, (relay, d): (&Relay, &DemuxedRtcp)) -> Value {
    let leg = relay.leg(d.of);
    let c = streams.get(&d.uid).copied().unwrap_or_default();
    let last = if c.last_rx_ns > 0 { v.clock.unix_secs(c.last_rx_ns) } else { unix_secs(v.call.created) };
    let mut flags = vec![Value::str("RTCP")];
    if d.peer().is_some() {
        flags.push(Value::str("filled"));
    }
    if d.latched.is_some() {
        flags.push(Value::str("confirmed"));
    }
    let mut out = vec![
        ("local port", Value::Int(d.local.port() as i64)),
        ("local address", Value::from(d.local.ip().to_string())),
        ("family", Value::str(family(d.local.ip()))),
    ];
    if let Some(p) = d.peer() {
        out.push(("endpoint", endpoint(p)));
    }
    if let Some(p) = d.remote {
        out.push(("advertised endpoint", endpoint(p)));
    }
    if let Some(s) = leg_suite(leg) {
        out.push(("crypto suite", Value::str(s.name())));
    }
    out.push(("last packet", Value::Int(last)));
    out.push(("flags", Value::List(flags)));
    let received = Traffic::received(&c, leg, true);
    let stats = vec![("packets", int(received.packets)), ("bytes", int(received.bytes)), ("errors", int(received.errors)), ("relayed", int(c.tx_copies))];
    out.push(("stats", Value::dict(stats)));
    Value::dict(out)
}

/// The codec each media section of `sdp` lists first, as rtpengine names it ("PCMA/8000"):
/// from its `a=rtpmap`, or the static payload type's name.
pub fn first_codecs(sdp: &[u8]) -> Vec<Option<String>> {
    let text = String::from_utf8_lossy(sdp);
    let mut out: Vec<Option<String>> = Vec::new();
    let mut first_pt: Option<String> = None;
    for line in text.lines().map(str::trim_end) {
        if let Some(m) = line.strip_prefix("m=") {
            first_pt = m.split_whitespace().nth(3).map(str::to_string);
            out.push(first_pt.as_deref().and_then(static_codec).map(str::to_string));
        } else if let (Some(rtpmap), Some(pt)) = (line.strip_prefix("a=rtpmap:"), first_pt.as_deref()) {
            let mut parts = rtpmap.splitn(2, ' ');
            if parts.next() == Some(pt) {
                if let (Some(name), Some(last)) = (parts.next(), out.last_mut()) {
                    // "opus/48000/2": rtpengine names it without the channels.
                    let mut n = name.split('/');
                    *last = Some(match (n.next(), n.next()) {
                        (Some(enc), Some(rate)) => format!("{enc}/{rate}"),
                        _ => name.to_string(),
                    });
                }
            }
        }
    }
    out
}

fn static_codec(pt: &str) -> Option<&'static str> {
    Some(match pt {
        "0" => "PCMU/8000",
        "3" => "GSM/8000",
        "4" => "G723/8000",
        "8" => "PCMA/8000",
        "9" => "G722/8000",
        "18" => "G729/8000",
        _ => return None,
    })
}

/// What `statistics` reports besides the engine's bookkeeping.
pub struct StatisticsInput<'a> {
    pub sessions: u64,
    pub uptime: Duration,
    pub managed: u64,
    pub deleted: u64,
    pub timed_out: u64,
    /// Requests that failed (error replies, undecodable datagrams).
    pub control_errors: u64,
    /// The most calls held at once since start.
    pub peak_sessions: u64,
    /// Traffic of the calls still up.
    pub live: Traffic,
    /// Active media sections of the calls still up.
    pub media: u64,
    /// The calls are forwarded by the kernel (the eBPF plane).
    pub kernel: bool,
    pub media_config: &'a MediaConfig,
    pub ports_used: u64,
    pub last_port: u16,
    /// Every MOS the relay's RTCP evaluation computed since start.
    pub mos: MosTotals,
}

fn f6(v: f64) -> Value {
    Value::from(format!("{v:.6}"))
}

/// The `statistics` dictionary of rtpengine 10.5: `currentstatistics`, `totalstatistics`,
/// `intervalstatistics` (here since start: mediaplane keeps no reporting interval), `mos`,
/// `controlstatistics`, `interfaces`, `transcoders`.
pub fn statistics(input: &StatisticsInput<'_>, totals: &TrafficTotals, control: &ControlStats) -> Value {
    let split = |t: Traffic| if input.kernel { (Traffic::default(), t) } else { (t, Traffic::default()) };
    let (rate_user, rate_kernel) = split(totals.rate);
    let mut relayed = totals.ended;
    relayed.add(input.live);
    let (rel_user, rel_kernel) = split(relayed);
    let sessions = int(input.sessions);
    let current = Value::dict([
        ("sessionsown", sessions.clone()),
        ("sessionsforeign", Value::Int(0)),
        ("sessionstotal", sessions),
        ("transcodedmedia", Value::Int(0)),
        ("packetrate_user", int(rate_user.packets)),
        ("byterate_user", int(rate_user.bytes)),
        ("errorrate_user", int(rate_user.errors)),
        ("packetrate_kernel", int(rate_kernel.packets)),
        ("byterate_kernel", int(rate_kernel.bytes)),
        ("errorrate_kernel", int(rate_kernel.errors)),
        ("packetrate", int(totals.rate.packets)),
        ("byterate", int(totals.rate.bytes)),
        ("errorrate", int(totals.rate.errors)),
        ("media_userspace", int(if input.kernel { 0 } else { input.media })),
        ("media_kernel", int(if input.kernel { input.media } else { 0 })),
        ("media_mixed", Value::Int(0)),
    ]);
    let (sum, sum2, n) = totals.durations;
    let avg = if n > 0 { sum / n as f64 } else { 0.0 };
    let stddev = if n > 0 { (sum2 / n as f64 - avg * avg).max(0.0).sqrt() } else { 0.0 };
    let total = Value::dict([
        ("uptime", Value::from(input.uptime.as_secs().to_string())),
        ("managedsessions", int(input.managed)),
        ("rejectedsessions", Value::Int(0)),
        ("timeoutsessions", int(input.timed_out)),
        ("silenttimeoutsessions", Value::Int(0)),
        ("finaltimeoutsessions", Value::Int(0)),
        ("offertimeoutsessions", Value::Int(0)),
        ("regularterminatedsessions", int(input.deleted)),
        ("forcedterminatedsessions", Value::Int(0)),
        ("relayedpackets_user", int(rel_user.packets)),
        ("relayedpacketerrors_user", int(rel_user.errors)),
        ("relayedbytes_user", int(rel_user.bytes)),
        ("relayedpackets_kernel", int(rel_kernel.packets)),
        ("relayedpacketerrors_kernel", int(rel_kernel.errors)),
        ("relayedbytes_kernel", int(rel_kernel.bytes)),
        ("relayedpackets", int(relayed.packets)),
        ("relayedpacketerrors", int(relayed.errors)),
        ("relayedbytes", int(relayed.bytes)),
        ("zerowaystreams", int(totals.zero_way)),
        ("onewaystreams", int(totals.one_way)),
        ("avgcallduration", f6(avg)),
        ("totalcallsduration", f6(sum)),
        ("totalcallsduration2", f6(sum2)),
        ("totalcallsduration_stddev", f6(stddev)),
        // mediaplane's own (kept from its earlier reply): NG requests that failed.
        ("controlerrors", int(input.control_errors)),
    ]);

    let mut interval: Vec<(String, Value)> =
        vec![("totalcallsduration".into(), f6(sum)), ("minmanagedsessions".into(), Value::Int(0)), ("maxmanagedsessions".into(), int(input.peak_sessions))];
    for (i, (name, _)) in COMMANDS.iter().enumerate() {
        let t = control.commands[i];
        let avg = if t.count > 0 { t.total.as_secs_f64() / t.count as f64 } else { 0.0 };
        interval.push((format!("min{name}delay"), f6(t.min.unwrap_or_default().as_secs_f64())));
        interval.push((format!("max{name}delay"), f6(t.max.as_secs_f64())));
        interval.push((format!("avg{name}delay"), f6(avg)));
    }
    for (i, (name, _)) in COMMANDS.iter().enumerate() {
        let r = control.rates[i];
        let avg = if r.samples > 0 { r.sum / r.samples as f64 } else { 0.0 };
        for (k, v) in [("min", r.min.unwrap_or(0.0)), ("max", r.max), ("avg", avg)] {
            interval.push((format!("{k}{name}requestrate"), Value::from(format!("{}", v.round() as u64))));
        }
    }
    let interval = Value::Dict(interval.into_iter().map(|(k, v)| (k.into_bytes(), v)).collect());

    let m = &input.mos;
    let mos = Value::dict([
        ("mos_total", f6(m.sum)),
        ("mos2_total", f6(m.sum_squares)),
        ("mos_samples_total", int(m.samples)),
        ("mos_average", f6(m.average())),
        ("mos_stddev", f6(m.stddev())),
    ]);

    let mut proxies = Vec::new();
    for (ip, (timings, errors)) in &control.proxies {
        let mut d: Vec<(String, Value)> = vec![("proxy".into(), Value::from(ip.to_string()))];
        for (i, (_, short)) in COMMANDS.iter().enumerate() {
            d.push((format!("{short}count"), int(timings[i].count)));
            d.push((format!("{short}duration"), f6(timings[i].total.as_secs_f64())));
        }
        d.push(("errorcount".into(), int(*errors)));
        proxies.push(Value::Dict(d.into_iter().map(|(k, v)| (k.into_bytes(), v)).collect()));
    }
    let mut ctl: Vec<(String, Value)> = vec![("proxies".into(), Value::List(proxies))];
    for (i, (_, short)) in COMMANDS.iter().enumerate() {
        ctl.push((format!("total{short}count"), int(control.commands[i].count)));
    }
    let ctl = Value::Dict(ctl.into_iter().map(|(k, v)| (k.into_bytes(), v)).collect());

    let mc = input.media_config;
    let ports = (mc.port_max as u64 + 1).saturating_sub(mc.port_min as u64);
    let used = input.ports_used.min(ports);
    let pct = if ports > 0 { used as f64 * 100.0 / ports as f64 } else { 0.0 };
    let interface = Value::dict([
        ("name", Value::str("default")),
        ("address", Value::from(mc.ip.to_string())),
        (
            "ports",
            Value::dict([
                ("min", Value::Int(mc.port_min as i64)),
                ("max", Value::Int(mc.port_max as i64)),
                ("used", int(used)),
                ("used_pct", Value::from(format!("{pct:.2}"))),
                ("free", int(ports - used)),
                ("totals", int(ports)),
                ("last", Value::Int(input.last_port as i64)),
            ]),
        ),
    ]);

    Value::dict([
        ("currentstatistics", current),
        ("totalstatistics", total),
        ("intervalstatistics", interval),
        ("mos", mos),
        ("controlstatistics", ctl),
        ("interfaces", Value::List(vec![interface])),
        ("transcoders", Value::List(Vec::new())),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_codec_of_each_media_section() {
        let sdp =
            b"v=0\r\nm=audio 4000 RTP/AVP 101 8\r\na=rtpmap:8 PCMA/8000\r\na=rtpmap:101 opus/48000/2\r\nm=video 0 RTP/AVP 96\r\nm=audio 5000 RTP/AVP 0\r\n";
        assert_eq!(first_codecs(sdp), vec![Some("opus/48000".into()), None, Some("PCMU/8000".into())]);
        assert!(first_codecs(b"garbage").is_empty());
    }

    #[test]
    fn control_stats_per_proxy_and_rates() {
        let mut c = ControlStats::default();
        let ip: IpAddr = "127.0.0.1".parse().unwrap();
        let t0 = Instant::now();
        c.sample(t0);
        c.record(ip, "offer", Duration::from_millis(2), true);
        c.record(ip, "offer", Duration::from_millis(4), true);
        c.record(ip, "frobnicate", Duration::from_millis(1), false);
        c.sample(t0 + Duration::from_secs(1));
        c.sample(t0 + Duration::from_secs(2));
        let offer = c.commands[1];
        assert_eq!((offer.count, offer.min, offer.max), (2, Some(Duration::from_millis(2)), Duration::from_millis(4)));
        assert_eq!(c.proxies[&ip].1, 1, "the unknown command is an error of its proxy");
        let r = c.rates[1];
        assert_eq!((r.min, r.max, r.samples), (Some(0.0), 2.0, 2));
    }
}
