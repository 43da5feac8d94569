//! Consumers as the API, `ctl` and `/metrics` show them: each subscription of the model (a
//! [`mediaplane_core::model::Consumer`]) with where its copies go and what the data plane counted
//! for it, including what the consumer's own receiver reports said.

use mediaplane_core::model::Model;
use mediaplane_dataplane::{ConsumerCounters, Dataplane};
use serde::Serialize;
use std::net::SocketAddr;

/// One consumer.
#[derive(Debug, Clone, Serialize)]
pub struct ConsumerView {
    pub id: u32,
    pub room: String,
    pub subscriber: String,
    pub publisher: String,
    pub stream: String,
    /// The published stream's id (its counters in `/v1/stats`).
    pub stream_id: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssrc: Option<u32>,
    /// The SFU address its copies leave from, and where they go.
    pub local: SocketAddr,
    pub remote: SocketAddr,
    pub tx_copies: u64,
    pub tx_bytes: u64,
    pub tx_errors: u64,
    pub feedback_routed: u64,
    pub feedback_coalesced: u64,
    /// Its latest receiver report about the stream (none until it sent one).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub report: Option<ReportView>,
    /// Its latest REMB naming the stream, bits per second.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub remb_bps: Option<u64>,
    /// The round-trip time between the SFU and the consumer, ms: from its latest report block
    /// that echoed a sender report of the stream (none until one did), and how long ago.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtt_ms: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rtt_age_ms: Option<u64>,
    /// Of a simulcast stream: which layer it wants and receives.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub layers: Option<LayersView>,
    /// Its RTP as the SFU sent it (in-path, every copy): loss passed on, duplicates and
    /// reordering forwarded, jitter of the stream as it got it (none until an RTP copy was sent;
    /// see [`mediaplane_dataplane::Dataplane::consumer_reception`]). Beside `report`, what the
    /// consumer said it received: the difference is its own link.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub forwarded: Option<mediaplane_core::reception::ReceptionReport>,
    /// For labels: `room/subscriber<-publisher/stream`.
    #[serde(skip)]
    pub label: String,
}

/// A simulcast consumer's layers: what was asked for (`preferred`, `max`), what that means
/// (`wanted`), and what the data plane does (`current`, from the next keyframe on `target`):
/// `target` is `wanted` lowered by the consumer's own reports (`auto_limit`) and by layers its
/// publisher does not send (`absent`); see `mediaplane_core::layer_choice`.
#[derive(Debug, Clone, Serialize)]
pub struct LayersView {
    /// How many layers the stream has.
    pub count: u8,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub preferred: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<u8>,
    /// Whether its own reports may lower it (`auto_layer`; off: only the API and absent layers).
    pub auto: bool,
    pub wanted: u8,
    /// None until its first keyframe (or until the data plane has seen the stream).
    pub current: Option<u8>,
    pub target: Option<u8>,
    /// The highest temporal layer it should take (`temporal_layer`; absent: all), the one it
    /// takes now, and the packets above it not sent.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temporal: Option<u8>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temporal_current: Option<u8>,
    pub temporal_dropped: u64,
    /// The SSRC it receives every layer on.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ssrc: Option<u32>,
    pub forwarded: u64,
    pub switches: u64,
    pub keyframe_requests: u64,
    pub duplicates_dropped: u64,
    pub late_dropped: u64,
    /// The highest layer the consumer's loss reports and REMBs allow now (absent: no limit).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub auto_limit: Option<u8>,
    /// Automatic steps down (loss, REMB) and back up.
    pub auto_steps_down: u64,
    pub auto_steps_up: u64,
    /// Windows in which its NACKs were judged as its loss (it sent no report block then).
    pub auto_nack_windows: u64,
    /// Changes of layer because one went absent or came back.
    pub fallbacks: u64,
    /// Layers the publisher does not send now (none for a second: absent).
    pub absent: Vec<u8>,
}

/// A consumer's receiver report block, in the units people read.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ReportView {
    /// Loss since its previous report, percent (the block's fraction lost, 8-bit).
    pub fraction_lost_pct: f64,
    pub cumulative_lost: i32,
    pub highest_seq: u32,
    /// Interarrival jitter in RTP timestamp units, and in milliseconds when the stream's clock
    /// rate is known.
    pub jitter: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jitter_ms: Option<f64>,
    /// How long ago it arrived.
    pub age_ms: u64,
}

/// The consumers of `room` (all rooms when none; only consumer `only` when given), without
/// counters, sorted by id.
fn of_model(model: &Model, room: Option<&str>, only: Option<u32>) -> Vec<(ConsumerView, Option<u32>)> {
    let mut out = Vec::new();
    for (rid, r) in model.rooms.iter().filter(|(rid, _)| room.is_none_or(|x| x == rid.as_str())) {
        for (pid, p) in &r.participants {
            for (sref, c) in p.subscriptions.iter().filter(|(_, c)| only.is_none_or(|id| id == c.uid)) {
                let Some(s) = r.participants.get(&sref.publisher).and_then(|publ| publ.streams.get(&sref.stream)) else { continue };
                let view = ConsumerView {
                    id: c.uid,
                    room: rid.clone(),
                    subscriber: pid.clone(),
                    publisher: sref.publisher.clone(),
                    stream: sref.stream.clone(),
                    stream_id: s.uid,
                    ssrc: s.ssrc,
                    local: p.local,
                    remote: p.remote,
                    tx_copies: 0,
                    tx_bytes: 0,
                    tx_errors: 0,
                    feedback_routed: 0,
                    feedback_coalesced: 0,
                    report: None,
                    remb_bps: None,
                    rtt_ms: None,
                    rtt_age_ms: None,
                    forwarded: None,
                    layers: (!s.layers.is_empty()).then(|| LayersView {
                        count: s.layers.len() as u8,
                        preferred: c.preferred_layer,
                        max: c.max_layer,
                        auto: c.auto_layer,
                        wanted: c.wanted_layer(s.layers.len()),
                        current: None,
                        target: None,
                        temporal: c.temporal_layer,
                        temporal_current: None,
                        temporal_dropped: 0,
                        ssrc: s.layers.first().map(|l| l.ssrc),
                        forwarded: 0,
                        switches: 0,
                        keyframe_requests: 0,
                        duplicates_dropped: 0,
                        late_dropped: 0,
                        auto_limit: None,
                        auto_steps_down: 0,
                        auto_nack_windows: 0,
                        auto_steps_up: 0,
                        fallbacks: 0,
                        absent: Vec::new(),
                    }),
                    label: format!("{rid}/{pid}<-{}/{}", sref.publisher, sref.stream),
                };
                out.push((view, s.clock_rate));
            }
        }
    }
    out.sort_by_key(|(v, _)| v.id);
    out
}

/// The consumers of `room` (all rooms when none) with their counters, read from `dataplane`
/// for just them.
pub fn list(model: &Model, room: Option<&str>, dataplane: &dyn Dataplane) -> Vec<ConsumerView> {
    with_counters(of_model(model, room, None), dataplane)
}

/// Consumer `id` of `room`, if it has one.
pub fn one(model: &Model, room: &str, id: u32, dataplane: &dyn Dataplane) -> Option<ConsumerView> {
    with_counters(of_model(model, Some(room), Some(id)), dataplane).pop()
}

fn with_counters(views: Vec<(ConsumerView, Option<u32>)>, dataplane: &dyn Dataplane) -> Vec<ConsumerView> {
    let ids: Vec<u32> = views.iter().map(|(v, _)| v.id).collect();
    let counters = dataplane.consumer_counters(&ids);
    let mut forwarded = dataplane.consumer_reception(&ids);
    let now = mediaplane_dataplane::monotonic_ns();
    views
        .into_iter()
        .map(|(mut v, clock_rate)| {
            let c: ConsumerCounters = counters.get(&v.id).copied().unwrap_or_default();
            (v.tx_copies, v.tx_bytes, v.tx_errors) = (c.tx_copies, c.tx_bytes, c.tx_errors);
            (v.feedback_routed, v.feedback_coalesced) = (c.feedback_routed, c.feedback_coalesced);
            v.report = c.report.map(|r| ReportView {
                fraction_lost_pct: f64::from(r.fraction_lost) * 100.0 / 256.0,
                cumulative_lost: r.cumulative_lost,
                highest_seq: r.highest_seq,
                jitter: r.jitter,
                jitter_ms: clock_rate.filter(|c| *c > 0).map(|c| f64::from(r.jitter) * 1000.0 / f64::from(c)),
                age_ms: now.saturating_sub(r.at_ns) / 1_000_000,
            });
            v.remb_bps = c.remb_bps;
            v.forwarded = forwarded.remove(&v.id);
            v.rtt_ms = c.rtt_us.map(|us| us as f64 / 1000.0);
            v.rtt_age_ms = c.rtt_us.map(|_| now.saturating_sub(c.rtt_at_ns) / 1_000_000);
            if let (Some(l), Some(state)) = (&mut v.layers, c.layer) {
                (l.current, l.target) = (state.current, state.target);
                l.forwarded = state.stats.forwarded;
                l.switches = state.stats.switches;
                l.keyframe_requests = state.stats.keyframe_requests;
                l.duplicates_dropped = state.stats.duplicates;
                l.late_dropped = state.stats.late;
                (l.temporal_current, l.temporal_dropped) = (state.temporal_current, state.stats.temporal_dropped);
                l.auto_limit = state.auto_limit;
                (l.auto_steps_down, l.auto_steps_up, l.fallbacks) = (state.choice.steps_down, state.choice.steps_up, state.choice.fallbacks);
                l.auto_nack_windows = state.choice.nack_judgements;
                l.absent = (0..l.count).filter(|i| state.absent & (1 << i) != 0).collect();
            }
            v
        })
        .collect()
}
