//! The kernel's simulcast rewrite (bpf/layer_rewrite.h) equals core's `LayerRewriter`: the same
//! packets and target changes, fed to both, give the same decisions, the same bytes out and the
//! same state after every step. Random publishers (2-4 layers, VP8 with 7- or 15-bit picture
//! ids, H.264 with single NAL units, STAP-A and FU-A), loss, duplicates, reordering, target
//! changes and pauses, temporal layers (VP8 TID, with and without the sync bit) under changing
//! ceilings, clock jumps, and malformed packets (truncated descriptors, padding, CSRCs,
//! header extensions). The kernel side runs through `layer_ctl` (BPF_PROG_TEST_RUN), the same
//! functions the TC program calls per copy; test_run.rs
//! (`simulcast_copies_are_renumbered_per_consumer_with_valid_checksums`) drives the TC program
//! itself, checksums included.
//!
//! Half the cases hand the consumer's state from core to the kernel at a random step
//! (`FastPath::layer_load`, the slow path's hand-over) and go on there.
//!
//! A failure names its seed: `MP_LAYER_SEED=<seed> cargo test -p mediaplane-ebpf --test layers`
//! replays it. `MP_LAYER_CASES` sets how many cases run (default 300).
//!
//! Run as root.

mod common;

use common::layer_gen::{h264_payload, mangle, vp8_payload, LayerSource};
use common::Rng;

use mediaplane_core::rtp::build_rtp;
use mediaplane_core::simulcast::{inspect, Codec, Decision, LayerRewriter, Skip, MAX_LAYERS};
use mediaplane_ebpf::layers::LayerVerdict;
use mediaplane_ebpf::{FastPath, LoadOptions};

#[derive(Debug, Clone)]
enum Event {
    /// A target layer (None: pause) and temporal ceiling (None: all).
    Target(Option<u8>, Option<u8>),
    Packet {
        layer: u8,
        at_ns: u64,
        bytes: Vec<u8>,
    },
}

/// A publisher of `layers` layers seen by the SFU, with target changes among its packets.
fn scenario(rng: &mut Rng) -> (Codec, Vec<Event>) {
    let codec = if rng.chance(75) { Codec::Vp8 } else { Codec::H264 };
    let layers = 2 + rng.below_u64(3) as u8;
    let wide = rng.chance(70);
    let loss = rng.below(20);
    let dup = rng.below(8);
    let late_window = rng.below_u64(8) as usize;
    let key_p = 5 + rng.below(40);
    let mut src: Vec<LayerSource> = (0..layers).map(|_| LayerSource::random(rng)).collect();
    let mut now: u64 = 1_000_000_000 + rng.below_u64(1 << 40);
    let mut sent: Vec<(u8, u64, Vec<u8>)> = Vec::new();
    for _ in 0..(10 + rng.below_u64(80)) {
        now += rng.below_u64(40_000_000);
        if rng.chance(1) {
            now += rng.below_u64(1 << 50); // a clock far ahead: the switch's timestamp gap saturates
        }
        for (l, s) in src.iter_mut().enumerate() {
            let key = rng.chance(key_p);
            s.next_frame_layer(key, rng);
            for k in 0..(1 + rng.below_u64(3)) {
                let start = k == 0;
                let payload = match codec {
                    Codec::Vp8 => vp8_payload(s, wide, start, key, rng),
                    Codec::H264 => h264_payload(start, key, rng),
                };
                let mut bytes = build_rtp(96, s.seq, s.ts, 0x1000 + l as u32, &payload);
                if rng.chance(3) {
                    mangle(&mut bytes, rng);
                }
                sent.push((l as u8, now + k * 100_000, bytes));
                s.seq = s.seq.wrapping_add(1);
            }
            s.ts = s.ts.wrapping_add(3000);
            s.pic = (s.pic + 1) & 0x7fff;
            if rng.chance(2) {
                // A jump in the numbering (a restarted encoder, a long gap): a segment's range
                // is kept within its span.
                s.seq = s.seq.wrapping_add(10_000 + rng.below_u64(20_000) as u16);
            }
            if rng.chance(30) {
                s.tl0 = s.tl0.wrapping_add(1);
            }
        }
    }
    // The network: loss, duplicates, and each packet up to late_window places late.
    let mut arrivals: Vec<(usize, Event)> = Vec::new();
    for (i, (layer, at_ns, bytes)) in sent.into_iter().enumerate() {
        if rng.chance(loss) {
            continue;
        }
        let copies = if rng.chance(dup) { 2 } else { 1 };
        for _ in 0..copies {
            let order = i * 16 + rng.below_u64(late_window as u64 * 16 + 1) as usize;
            arrivals.push((order, Event::Packet { layer, at_ns, bytes: bytes.clone() }));
        }
    }
    arrivals.sort_by_key(|(o, _)| *o);
    let (mut target, mut temporal) = (Some(0), None);
    let mut events = vec![Event::Target(target, temporal)];
    let mut last_at = 0;
    for (_, e) in arrivals {
        if rng.chance(4) {
            if rng.chance(50) {
                target = if rng.chance(10) { None } else { Some(rng.below_u64(layers as u64 + 1) as u8) };
            } else {
                temporal = if rng.chance(25) { None } else { Some(rng.below_u64(4) as u8) };
            }
            events.push(Event::Target(target, temporal));
        }
        // Arrival times never run backwards; a packet of another layer now and then (a layer
        // index the stream does not have).
        if let Event::Packet { layer, at_ns, bytes } = e {
            last_at = last_at.max(at_ns);
            let layer = if rng.chance(1) { MAX_LAYERS as u8 + rng.below_u64(3) as u8 } else { layer };
            events.push(Event::Packet { layer, at_ns: last_at, bytes });
        }
    }
    (codec, events)
}

fn verdict_of(d: Decision) -> LayerVerdict {
    match d {
        Decision::Forward(_) => LayerVerdict::Forward,
        Decision::Skip(s) => LayerVerdict::Skip(s),
    }
}

/// Run one scenario through both; Err: the first difference.
fn run_case(fp: &FastPath, consumer: u32, seed: u64) -> Result<(usize, usize, usize), String> {
    let mut rng = Rng(seed);
    let (codec, events) = scenario(&mut rng);
    let ssrc = rng.next() as u32;
    let clock_rate = if rng.chance(80) { 90_000 } else { rng.below_u64(200_000) as u32 };
    fp.layer_remove(consumer);
    assert!(fp.layer_create(consumer, ssrc, clock_rate).unwrap());
    let mut core = LayerRewriter::new(ssrc, clock_rate);
    let (mut forwarded, mut temporal_dropped) = (0, 0);
    // Half the cases hand the consumer over at some step, as the slow path does when a stream
    // it decided alone comes to the kernel: core's state replaces the kernel's (`layer_load`).
    let handover_at = rng.chance(50).then(|| rng.below_u64(events.len() as u64) as usize);
    for (step, e) in events.iter().enumerate() {
        if handover_at == Some(step) {
            fp.layer_remove(consumer);
            fp.layer_load(consumer, ssrc, clock_rate, &core.state()).map_err(|e| format!("step {step}: loading: {e}"))?;
        }
        match e {
            Event::Target(t, tt) => {
                core.set_target(*t);
                core.set_temporal(*tt);
                let v = fp.layer_set_target(consumer, *t, *tt).unwrap();
                if v != LayerVerdict::Forward {
                    return Err(format!("step {step}: target {t:?}: kernel said {v:?}"));
                }
            }
            Event::Packet { layer, at_ns, bytes } => {
                let (kv, kbytes) = fp.layer_packet(consumer, *layer, codec, *at_ns, bytes).unwrap();
                let want = match inspect(codec, bytes) {
                    None => (LayerVerdict::Invalid, None),
                    Some(info) => {
                        let d = core.on_packet(*layer, &info, *at_ns);
                        let out = match d {
                            Decision::Forward(r) => {
                                let mut b = bytes.clone();
                                r.apply(&info, &mut b);
                                Some(b)
                            }
                            Decision::Skip(_) => None,
                        };
                        (verdict_of(d), out)
                    }
                };
                temporal_dropped += (kv == LayerVerdict::Skip(Skip::TemporalLayer)) as usize;
                if kv != want.0 {
                    return Err(format!("step {step}: layer {layer} packet {bytes:02x?}: kernel {kv:?}, core {:?}", want.0));
                }
                if let Some(b) = want.1 {
                    forwarded += 1;
                    if kbytes != b {
                        return Err(format!("step {step}: layer {layer}: kernel wrote {kbytes:02x?}, core {b:02x?}"));
                    }
                }
            }
        }
        let (kssrc, kstate) = fp.layer_state(consumer).unwrap().expect("state");
        if kssrc != ssrc || kstate != core.state() {
            return Err(format!("step {step} ({e:?}): states differ\n kernel {kstate:?}\n core   {:?}", core.state()));
        }
    }
    Ok((events.len(), forwarded, temporal_dropped))
}

#[test]
fn the_kernel_rewrites_as_core_does() {
    if !common::require_root("the_kernel_rewrites_as_core_does") {
        return;
    }
    let fp = FastPath::load(&LoadOptions::default()).expect("load");
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<u64>().ok());
    let seeds: Vec<u64> = match env("MP_LAYER_SEED") {
        Some(s) => vec![s],
        None => {
            let base = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64;
            (0..env("MP_LAYER_CASES").unwrap_or(300)).map(|i| base.wrapping_add(i.wrapping_mul(0x9e37_79b9))).collect()
        }
    };
    let (mut steps, mut forwarded, mut temporal_dropped) = (0, 0, 0);
    for (i, seed) in seeds.iter().enumerate() {
        match run_case(&fp, 1 + i as u32, *seed) {
            Ok((s, f, t)) => {
                steps += s;
                forwarded += f;
                temporal_dropped += t;
            }
            Err(e) => panic!("seed {seed}: {e}\nreplay: MP_LAYER_SEED={seed} cargo test -p mediaplane-ebpf --test layers"),
        }
        fp.layer_remove(1 + i as u32);
    }
    println!("{} cases, {steps} steps, {forwarded} packets forwarded, {temporal_dropped} above a temporal ceiling: kernel = core", seeds.len());
    assert!(forwarded > steps / 20, "the scenarios forward too little to show anything ({forwarded} of {steps})");
    assert!(temporal_dropped > steps / 200, "the scenarios drop too few temporal layers to show anything ({temporal_dropped} of {steps})");
}

#[test]
fn requests_for_a_consumer_without_state_say_so() {
    if !common::require_root("requests_for_a_consumer_without_state_say_so") {
        return;
    }
    let fp = FastPath::load(&LoadOptions::default()).expect("load");
    assert_eq!(fp.layer_set_target(77, Some(0), None).unwrap(), LayerVerdict::NoState);
    let p = build_rtp(96, 1, 1, 1, &[0x10, 0]);
    assert_eq!(fp.layer_packet(77, 0, Codec::Vp8, 1, &p).unwrap().0, LayerVerdict::NoState);
    assert_eq!(fp.layer_packet(77, 0, Codec::Vp8, 1, &[1, 2, 3]).unwrap().0, LayerVerdict::Invalid);
    assert!(fp.layer_create(77, 5, 0).unwrap());
    assert!(!fp.layer_create(77, 6, 0).unwrap(), "an existing state is kept");
    assert_eq!(fp.layer_state(77).unwrap().map(|(s, _)| s), Some(5));
    fp.layer_remove(77);
    assert_eq!(fp.layer_state(77).unwrap(), None);
}
