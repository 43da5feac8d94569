//! The simulcast rewrite is exact: across random layer schedules, temporal ceilings, loss,
//! duplication and reordering, a consumer sees no gap that was not a real loss, no duplicate,
//! one SSRC, and timestamps and VP8 picture ids that continue across every switch and every
//! dropped frame (`simulcast` module docs).
//!
//! Failures proptest finds are saved under `proptest-regressions/` and replayed first.

use mediaplane_core::rtp::build_rtp;
use mediaplane_core::simulcast::{inspect, seq_newer, Codec, Decision, LayerRewriter, Skip};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashSet};

const OUT_SSRC: u32 = 0x5151_0001;

/// One packet the publisher sends.
#[derive(Debug, Clone)]
struct Sent {
    layer: u8,
    seq: u16,
    key: bool,
    /// First packet of its frame; the frame's temporal layer and sync bit.
    start: bool,
    tid: u8,
    sync: bool,
    bytes: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Scenario {
    layers: u8,
    /// Per layer: first sequence number, timestamp and picture id.
    starts: Vec<(u16, u32, u16)>,
    /// Per frame time and layer: packets of the frame, and whether it is a keyframe.
    frames: Vec<Vec<(u8, bool)>>,
    /// Per frame time: its temporal layer and sync bit (a keyframe is of layer 0).
    temporal: Vec<(u8, bool)>,
    /// Per packet sent: lost, duplicated; and how far (in arrivals) it may be late.
    lost: Vec<bool>,
    duplicated: Vec<bool>,
    lateness: Vec<u8>,
    /// (arrival index, wanted layer) changes.
    schedule: Vec<(usize, Option<u8>)>,
    /// (arrival index, temporal ceiling) changes.
    ceilings: Vec<(usize, Option<u8>)>,
}

fn scenario() -> impl Strategy<Value = Scenario> {
    (2u8..=3, 5usize..60, 0u8..=6, 0.0f64..0.25, 0.0f64..0.1, 0.05f64..0.6).prop_flat_map(|(layers, nframes, max_late, loss, dup, key_p)| {
        let starts = prop::collection::vec((any::<u16>(), any::<u32>(), 0u16..0x8000), layers as usize);
        let frame = prop::collection::vec((1u8..=3, prop::bool::weighted(key_p)), layers as usize);
        let frames = prop::collection::vec(frame, nframes);
        let max_packets = nframes * layers as usize * 3;
        let lost = prop::collection::vec(prop::bool::weighted(loss), max_packets);
        let duplicated = prop::collection::vec(prop::bool::weighted(dup), max_packets);
        let lateness = prop::collection::vec(0..=max_late, max_packets * 2);
        let schedule = prop::collection::vec((0..max_packets * 2, prop::option::weighted(0.9, 0..layers)), 0..8);
        let temporal = prop::collection::vec((0u8..4, prop::bool::weighted(0.3)), nframes);
        let ceilings = prop::collection::vec((0..max_packets * 2, prop::option::weighted(0.7, 0u8..4)), 0..8);
        (Just(layers), starts, frames, temporal, lost, duplicated, lateness, (schedule, ceilings)).prop_map(
            |(layers, starts, frames, temporal, lost, duplicated, lateness, (mut schedule, mut ceilings))| {
                schedule.sort_by_key(|(at, _)| *at);
                ceilings.sort_by_key(|(at, _)| *at);
                // The consumer wants some layer from the start.
                schedule.insert(0, (0, Some(0)));
                Scenario { layers, starts, frames, temporal, lost, duplicated, lateness, schedule, ceilings }
            },
        )
    })
}

/// The publisher's packets in sending order: per frame time, each layer's frame.
fn publish(s: &Scenario) -> Vec<Sent> {
    let mut next: Vec<(u16, u32, u16)> = s.starts.clone();
    let mut out = Vec::new();
    for (frame, &(tid, sync)) in s.frames.iter().zip(&s.temporal) {
        for (layer, &(packets, key)) in frame.iter().enumerate().take(s.layers as usize) {
            let (seq, ts, pic) = &mut next[layer];
            let tid = if key { 0 } else { tid };
            for k in 0..packets {
                let start = k == 0;
                let b0 = 0x80 | if start { 0x10 } else { 0 };
                let t = tid << 6 | if sync { 0x20 } else { 0 };
                let payload = [b0, 0xe0, 0x80 | (*pic >> 8) as u8, *pic as u8, *pic as u8, t, if key { 0x10 } else { 0x11 }, layer as u8];
                let bytes = build_rtp(96, *seq, *ts, 0x1000 + layer as u32, &payload);
                out.push(Sent { layer: layer as u8, seq: *seq, key: key && start, start, tid, sync, bytes });
                *seq = seq.wrapping_add(1);
            }
            *ts = ts.wrapping_add(3000);
            *pic = (*pic + 1) & 0x7fff;
        }
    }
    out
}

/// What reaches the SFU: loss, duplicates, and each packet at most `lateness` arrivals late.
fn network(s: &Scenario, sent: &[Sent]) -> Vec<usize> {
    let mut arrivals: Vec<(usize, usize)> = Vec::new(); // (order key, index into sent)
    let mut n = 0;
    for (i, _) in sent.iter().enumerate() {
        if s.lost[i] {
            continue;
        }
        for _ in 0..1 + s.duplicated[i] as usize {
            arrivals.push((2 * i + 2 * s.lateness[n % s.lateness.len()] as usize + 1, i));
            n += 1;
        }
    }
    arrivals.sort_by_key(|(k, _)| *k);
    arrivals.into_iter().map(|(_, i)| i).collect()
}

/// A segment as the consumer sees it: opened by a keyframe of `layer` at `start`, sent as `out_start`.
#[derive(Debug)]
struct Segment {
    layer: u8,
    start: u16,
    out_start: u16,
    ts_offset: u32,
    pic_offset: u16,
    tl0_offset: u8,
}

fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let sent = publish(s);
    let arrivals = network(s, &sent);
    let delivered: HashSet<usize> = arrivals.iter().copied().collect();
    let index: BTreeMap<(u8, u16), usize> = sent.iter().enumerate().map(|(i, p)| ((p.layer, p.seq), i)).collect();
    let mut c = LayerRewriter::new(OUT_SSRC, 90_000);
    let mut schedule = s.schedule.iter().peekable();
    let mut newest: BTreeMap<u8, u16> = BTreeMap::new();
    let mut segments: Vec<Segment> = Vec::new();
    let mut outs: HashSet<u16> = HashSet::new();
    let mut top: Option<(u16, u32, u16)> = None; // highest out seq sent: (seq, ts, pic)
    let mut top_tl0 = 0u8;
    // The temporal rule, independently: the ceiling wanted, the one in force, and a pending cut
    // (the number and picture id the first dropped packet would have had; the publisher's
    // sequence number and picture id after the newest dropped one).
    let mut ceilings = s.ceilings.iter().peekable();
    let (mut wanted, mut in_force) = (u8::MAX, u8::MAX);
    let mut cut: Option<(u16, u16, u16, u16)> = None;
    for (n, &i) in arrivals.iter().enumerate() {
        while let Some((_, layer)) = schedule.next_if(|(at, _)| *at <= n) {
            c.set_target(*layer);
        }
        while let Some((_, t)) = ceilings.next_if(|(at, _)| *at <= n) {
            c.set_temporal(*t);
            wanted = t.unwrap_or(u8::MAX);
        }
        let p = &sent[i];
        let info = inspect(Codec::Vp8, &p.bytes).unwrap();
        let is_newest = newest.get(&p.layer).is_none_or(|&m| seq_newer(p.seq, m));
        if is_newest {
            newest.insert(p.layer, p.seq);
        }
        let before = c.current();
        let d = c.on_packet(p.layer, &info, n as u64 * 1_000_000);
        // The switch rule, independently: a keyframe start of the wanted layer that is the
        // newest of its layer always switches, and nothing else does.
        let should_switch = c.target() == Some(p.layer) && before != Some(p.layer) && p.key && is_newest;
        prop_assert_eq!(c.current() != before, should_switch, "switch at arrival {} of {:?}", n, p);
        let judged = !should_switch && is_newest && before == Some(p.layer);
        if judged && p.start {
            if wanted < in_force {
                in_force = wanted;
            } else if p.sync && p.tid > in_force && p.tid <= wanted {
                in_force = p.tid;
            }
        }
        let dropped = judged && p.tid > in_force;
        prop_assert_eq!(d == Decision::Skip(Skip::TemporalLayer), dropped, "temporal decision at arrival {} of {:?}", n, p);
        if dropped {
            let g = segments.last().expect("receiving");
            let src_pic = info.picture_id.unwrap().value;
            let (next, next_pic) =
                cut.map_or((g.out_start.wrapping_add(p.seq.wrapping_sub(g.start)), src_pic.wrapping_add(g.pic_offset) & 0x7fff), |c| (c.0, c.2));
            cut = Some((next, p.seq.wrapping_add(1), next_pic, (src_pic + 1) & 0x7fff));
            continue;
        }
        let continued = judged && cut.is_some();
        let Decision::Forward(r) = d else {
            prop_assert!(!continued, "the first kept packet after a cut goes out");
            if let Decision::Skip(Skip::Duplicate) = d {
                prop_assert!(arrivals[..n].contains(&i), "a first arrival called a duplicate");
            }
            continue;
        };
        prop_assert_eq!(r.ssrc, OUT_SSRC);
        prop_assert!(outs.insert(r.sequence), "sequence number {} sent twice", r.sequence);
        let pic = r.picture_id.unwrap();
        let tl0 = r.tl0picidx.unwrap();
        if should_switch {
            if let Some((seq, ts, tpic)) = top {
                // After a cut, right after the numbers the kept packets before it have.
                let (seq, tpic) = cut.take().map_or((seq, tpic), |c| (c.0.wrapping_sub(1), c.2.wrapping_sub(1) & 0x7fff));
                prop_assert_eq!(r.sequence, seq.wrapping_add(1), "a switch continues the sequence");
                let step = r.timestamp.wrapping_sub(ts);
                prop_assert!((1..1 << 31).contains(&step), "timestamps go forward across a switch");
                prop_assert_eq!(pic, (tpic + 1) & 0x7fff, "picture ids continue across a switch");
                prop_assert_eq!(tl0, top_tl0.wrapping_add(1), "TL0PICIDX continues across a switch");
            }
            in_force = wanted;
            segments.push(Segment {
                layer: p.layer,
                start: p.seq,
                out_start: r.sequence,
                ts_offset: r.timestamp.wrapping_sub(info.timestamp),
                pic_offset: pic.wrapping_sub(info.picture_id.unwrap().value) & 0x7fff,
                tl0_offset: tl0.wrapping_sub(info.tl0picidx.unwrap().0),
            });
        }
        if continued {
            // The dropped frames take no numbers: the packet after the last one dropped has
            // the first one's number and picture id; timestamps and TL0PICIDX keep their offsets.
            let (next, mut resume, next_pic, resume_pic) = cut.take().unwrap();
            // The first packet of the picture after the last one dropped continues right there.
            if p.start && info.picture_id.unwrap().value == resume_pic {
                resume = p.seq;
            }
            let prev = segments.last().unwrap();
            let (ts_offset, tl0_offset) = (prev.ts_offset, prev.tl0_offset);
            segments.push(Segment {
                layer: p.layer,
                start: resume,
                out_start: next,
                ts_offset,
                pic_offset: next_pic.wrapping_sub(resume_pic) & 0x7fff,
                tl0_offset,
            });
            prop_assert_eq!(r.sequence, next.wrapping_add(p.seq.wrapping_sub(resume)), "numbering continues over the dropped frames");
        }
        // Which segment it went out in: the one whose (layer, offsets) map it there.
        let g = segments.iter().rev().find(|g| g.layer == p.layer && r.sequence.wrapping_sub(g.out_start) == p.seq.wrapping_sub(g.start));
        let g = g.ok_or_else(|| TestCaseError::fail(format!("{p:?} sent outside every segment")))?;
        prop_assert_eq!(r.timestamp.wrapping_sub(info.timestamp), g.ts_offset);
        prop_assert_eq!(pic.wrapping_sub(info.picture_id.unwrap().value) & 0x7fff, g.pic_offset);
        prop_assert_eq!(tl0.wrapping_sub(info.tl0picidx.unwrap().0), g.tl0_offset);
        if top.is_none_or(|(seq, _, _)| seq_newer(r.sequence, seq)) {
            top = Some((r.sequence, r.timestamp, pic));
            top_tl0 = tl0;
        }
    }
    // Every number the consumer did not get, between its first and its newest, is a packet of
    // the segment's layer that never reached the SFU.
    let Some((top_seq, _, _)) = top else { return Ok(()) };
    let first = segments[0].out_start;
    let mut m = first;
    while m != top_seq.wrapping_add(1) {
        if !outs.contains(&m) {
            let g = segments.iter().rev().find(|g| !seq_newer(g.out_start, m)).unwrap();
            let seq = g.start.wrapping_add(m.wrapping_sub(g.out_start));
            let lost = index.get(&(g.layer, seq)).is_some_and(|i| !delivered.contains(i));
            prop_assert!(lost, "gap at {} (layer {} seq {}) that was no loss; segments {:?}", m, g.layer, seq, segments);
        }
        m = m.wrapping_add(1);
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn rewrite_has_no_false_gap_and_no_duplicate(s in scenario()) {
        run(&s)?;
    }
}

/// The same property holds when nothing is lost, late or duplicated: then there is no gap at all.
#[test]
fn clean_network_has_no_gap() {
    let s = Scenario {
        layers: 3,
        starts: vec![(65530, 0, 0x7ffe), (100, 5, 3), (30000, 7, 90)],
        frames: (0..40).map(|f| (0..3).map(|_| (2, f % 7 == 0)).collect()).collect(),
        // L1T3 (temporal layers 0, 2, 1, 2), under ceilings that change.
        temporal: (0..40).map(|f| ([0, 2, 1, 2][f % 4], f % 4 == 1 || f % 4 == 2)).collect(),
        lost: vec![false; 400],
        duplicated: vec![false; 400],
        lateness: vec![0],
        schedule: vec![(0, Some(0)), (30, Some(2)), (90, Some(1)), (150, Some(0))],
        ceilings: vec![(20, Some(0)), (70, Some(1)), (130, None), (180, Some(0))],
    };
    run(&s).unwrap();
    let sent = publish(&s);
    let mut c = LayerRewriter::new(OUT_SSRC, 90_000);
    let mut outs = Vec::new();
    let mut schedule = s.schedule.iter().peekable();
    let mut ceilings = s.ceilings.iter().peekable();
    for (n, p) in sent.iter().enumerate() {
        while let Some((_, l)) = schedule.next_if(|(at, _)| *at <= n) {
            c.set_target(*l);
        }
        while let Some((_, t)) = ceilings.next_if(|(at, _)| *at <= n) {
            c.set_temporal(*t);
        }
        if let Decision::Forward(r) = c.on_packet(p.layer, &inspect(Codec::Vp8, &p.bytes).unwrap(), n as u64 * 1_000_000) {
            outs.push(r.sequence);
        }
    }
    assert_eq!(c.stats.switches, 3);
    assert!(c.stats.temporal_dropped > 20, "{:?}", c.stats);
    assert!(outs.windows(2).all(|w| w[1] == w[0].wrapping_add(1)), "{outs:?}");
}

/// Long runs: each layer's sequence numbers wrap around more than once while the consumer stays
/// on it, and a layer it left wraps around under its old segment; nothing freezes, nothing comes
/// back, no gap, no duplicate.
#[test]
fn long_runs_across_wrap_arounds() {
    let mut c = LayerRewriter::new(OUT_SSRC, 90_000);
    let mut seq = [0u16, 40_000];
    let mut out: Option<u16> = None;
    let mut forwarded = 0u64;
    let mut n = 0u64;
    // Layer 0 for 140,000 packets, layer 1 for 140,000, back to layer 0 for 70,000; both layers
    // sending all along, a keyframe every 100 packets.
    for (target, packets) in [(0u8, 140_000u32), (1, 140_000), (0, 70_000)] {
        c.set_target(Some(target));
        for k in 0..packets {
            for layer in 0..2u8 {
                let s = seq[layer as usize];
                seq[layer as usize] = s.wrapping_add(1);
                let key = k % 100 == 0;
                let payload = [if key { 0x10 } else { 0x00 }, if key { 0x10 } else { 0x11 }];
                let p = build_rtp(96, s, 0, 0x1000 + layer as u32, &payload);
                n += 1;
                if let Decision::Forward(r) = c.on_packet(layer, &inspect(Codec::Vp8, &p).unwrap(), n * 1_000_000) {
                    if let Some(prev) = out {
                        assert_eq!(r.sequence, prev.wrapping_add(1), "a gap or a duplicate at packet {n} (layer {layer}, seq {s})");
                    }
                    assert_eq!(layer, c.current().unwrap(), "only the current layer goes out");
                    out = Some(r.sequence);
                    forwarded += 1;
                }
            }
        }
    }
    assert_eq!(c.stats.switches, 2);
    // Everything of the current layer from each switch's keyframe on.
    assert!(forwarded >= 350_000 - 200, "{forwarded}");
    assert_eq!((c.stats.late, c.stats.duplicates), (0, 0));
}
