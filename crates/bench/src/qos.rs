//! QoS metrics as pure accumulators and functions (no I/O), named as in DESIGN.md
//! "Measurement definitions".
//!
//! Units: every time value here is in **nanoseconds** unless a name says otherwise
//! (`_ms` for the E-model, which G.107 defines in milliseconds).

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

// ---------------------------------------------------------------------------------------------
// Summary statistics
// ---------------------------------------------------------------------------------------------

/// {count, min, p50, mean, p99, max} of a sample. Percentiles are nearest-rank: the p-th
/// percentile is the smallest value with at least p % of the sample at or below it.
/// An empty sample is all zeros with `count == 0` (JSON has no NaN).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub count: u64,
    pub min: f64,
    pub p50: f64,
    pub mean: f64,
    pub p99: f64,
    pub max: f64,
}

impl Summary {
    /// Summary of a sample (sorted in place).
    pub fn of(values: &mut [f64]) -> Summary {
        if values.is_empty() {
            return Summary::default();
        }
        values.sort_by(f64::total_cmp);
        let n = values.len();
        Summary {
            count: n as u64,
            min: values[0],
            p50: values[nearest_rank(n, 50.0)],
            mean: values.iter().sum::<f64>() / n as f64,
            p99: values[nearest_rank(n, 99.0)],
            max: values[n - 1],
        }
    }

    /// Summary of an hdrhistogram. Quantiles carry the histogram's precision (3 significant
    /// digits for [`ValueRecorder`]); min/max/mean are exact only through [`ValueRecorder`].
    pub fn of_histogram(h: &Histogram<u64>) -> Summary {
        if h.is_empty() {
            return Summary::default();
        }
        Summary {
            count: h.len(),
            min: h.min() as f64,
            p50: h.value_at_quantile(0.50) as f64,
            mean: h.mean(),
            p99: h.value_at_quantile(0.99) as f64,
            max: h.max() as f64,
        }
    }
}

/// Index (0-based, into a sorted sample of `n > 0` values) of the nearest-rank `pct` percentile.
pub fn nearest_rank(n: usize, pct: f64) -> usize {
    let rank = ((pct / 100.0) * n as f64).ceil() as usize; // 1-based
    rank.clamp(1, n) - 1
}

/// Records non-negative values (ns) into a histogram (1 ns .. 100 s, 3 significant digits)
/// and keeps exact min / max / sum beside it, so the summary's extremes and mean are exact.
#[derive(Debug, Clone)]
pub struct ValueRecorder {
    pub histogram: Histogram<u64>,
    min: u64,
    max: u64,
    sum: u128,
}

impl Default for ValueRecorder {
    fn default() -> Self {
        Self::new()
    }
}

impl ValueRecorder {
    pub const HIGHEST_NS: u64 = 100_000_000_000;

    /// 3 significant digits (0.1 %), about 220 KiB of buckets.
    pub fn new() -> ValueRecorder {
        Self::with_digits(3)
    }

    /// 2 significant digits (1 %) in an eighth of the memory: for the per-flow secondary
    /// measures (send lateness, delay variation) of plans with thousands of flows.
    pub fn compact() -> ValueRecorder {
        Self::with_digits(2)
    }

    fn with_digits(digits: u8) -> ValueRecorder {
        ValueRecorder { histogram: Histogram::new_with_bounds(1, Self::HIGHEST_NS, digits).expect("static histogram bounds"), min: u64::MAX, max: 0, sum: 0 }
    }

    /// Values above 100 s saturate (a delay that large is a bug elsewhere, not a measurement).
    pub fn record(&mut self, value: u64) {
        let value = value.min(Self::HIGHEST_NS);
        self.histogram.saturating_record(value);
        self.min = self.min.min(value);
        self.max = self.max.max(value);
        self.sum += value as u128;
    }

    pub fn count(&self) -> u64 {
        self.histogram.len()
    }

    pub fn summary(&self) -> Summary {
        let n = self.count();
        if n == 0 {
            return Summary::default();
        }
        // Histogram quantiles are bucket values (up to 0.1 % off); clamping them into the exact
        // [min, max] keeps the summary ordered (p99 <= max).
        let quantile = |q: f64| (self.histogram.value_at_quantile(q).clamp(self.min, self.max)) as f64;
        Summary { count: n, min: self.min as f64, p50: quantile(0.50), mean: self.sum as f64 / n as f64, p99: quantile(0.99), max: self.max as f64 }
    }
}

// ---------------------------------------------------------------------------------------------
// RFC 3550 interarrival jitter, RFC 4689 delay variation
// ---------------------------------------------------------------------------------------------

/// RFC 3550 §6.4.1 interarrival jitter, J += (|D| − J)/16, fed in **arrival order**.
///
/// Computed in **nanoseconds** from transit = receive time − send time, where the send time is
/// the harness's own ns timestamp instead of the RTP timestamp: this is what RFC 3550 computes
/// with an ideal media clock, so sender pacing error does not count as network jitter. Convert
/// to RTP timestamp units with `jitter_ns * clock_rate / 1e9`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rfc3550Jitter {
    previous_transit: Option<i64>,
    jitter: f64,
}

impl Rfc3550Jitter {
    pub fn on_packet(&mut self, send_ns: i64, recv_ns: i64) {
        let transit = recv_ns - send_ns;
        if let Some(previous) = self.previous_transit {
            let d = (transit - previous).abs() as f64;
            self.jitter += (d - self.jitter) / 16.0;
        }
        self.previous_transit = Some(transit);
    }

    pub fn jitter_ns(&self) -> f64 {
        self.jitter
    }
}

/// RFC 4689 "jitter", called **delay variation** here to keep it apart from RFC 3550's:
/// |delay(i) − delay(i−1)| over consecutively *received* packets of one stream (lost packets are
/// skipped, as the RFC says). Keeps every value in a (1 %) histogram for the summary.
#[derive(Debug, Clone)]
pub struct DelayVariation {
    previous_delay: Option<i64>,
    pub values: ValueRecorder,
}

impl Default for DelayVariation {
    fn default() -> Self {
        DelayVariation { previous_delay: None, values: ValueRecorder::compact() }
    }
}

impl DelayVariation {
    pub fn on_delay(&mut self, delay_ns: i64) {
        if let Some(previous) = self.previous_delay {
            self.values.record((delay_ns - previous).unsigned_abs());
        }
        self.previous_delay = Some(delay_ns);
    }

    pub fn summary(&self) -> Summary {
        self.values.summary()
    }
}

// ---------------------------------------------------------------------------------------------
// Sequence accounting: loss, duplicates, reordering
// ---------------------------------------------------------------------------------------------

/// What one arriving sequence number was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqOutcome {
    /// First arrival, in order (higher than all before).
    InOrder,
    /// First arrival, but a higher sequence number arrived before it.
    Reordered,
    /// Already received.
    Duplicate,
    /// At or above the tracker's limit: not a packet of this run (counted nowhere else).
    OutOfRange,
}

/// Loss / duplicate / reorder accounting over a 64-bit sequence that starts at 0 (the harness
/// sequence). Remembers every received number in a bitmap bounded by `limit` (the number of
/// packets the sender may send), so memory is `limit / 8` bytes.
///
/// * **lost** = sent − unique received (needs the sender's count; see [`SeqTracker::lost`]);
/// * **duplicates** = arrivals of an already received number;
/// * **reordered** = first arrivals of a number lower than the highest already received
///   (RFC 4737's "reordered" singleton test).
#[derive(Debug, Clone, Default)]
pub struct SeqTracker {
    seen: Vec<u64>,
    limit: u64,
    highest: Option<u64>,
    pub unique: u64,
    pub duplicates: u64,
    pub reordered: u64,
    pub out_of_range: u64,
}

impl SeqTracker {
    pub fn new(limit: u64) -> SeqTracker {
        SeqTracker { seen: vec![0; limit.div_ceil(64) as usize], limit, ..Default::default() }
    }

    pub fn record(&mut self, seq: u64) -> SeqOutcome {
        if seq >= self.limit {
            self.out_of_range += 1;
            return SeqOutcome::OutOfRange;
        }
        let (word, bit) = ((seq / 64) as usize, 1u64 << (seq % 64));
        if self.seen[word] & bit != 0 {
            self.duplicates += 1;
            return SeqOutcome::Duplicate;
        }
        self.seen[word] |= bit;
        self.unique += 1;
        match self.highest {
            Some(h) if seq < h => {
                self.reordered += 1;
                SeqOutcome::Reordered
            }
            _ => {
                self.highest = Some(seq);
                SeqOutcome::InOrder
            }
        }
    }

    pub fn is_received(&self, seq: u64) -> bool {
        seq < self.limit && self.seen[(seq / 64) as usize] & (1 << (seq % 64)) != 0
    }

    /// Packets the sender sent (numbered 0..sent) that never arrived.
    pub fn lost(&self, sent: u64) -> u64 {
        sent.saturating_sub(self.unique)
    }

    /// Loss without the sender's count, RFC 3550 style: expected = highest + 1. Blind to
    /// losses at the tail.
    pub fn lost_by_highest(&self) -> u64 {
        self.highest.map_or(0, |h| (h + 1).saturating_sub(self.unique))
    }

    /// G.113 burst ratio of the loss pattern over sequence numbers 0..sent (see [`burst_ratio`]).
    pub fn burst_ratio(&self, sent: u64) -> Option<f64> {
        burst_ratio((0..sent.min(self.limit)).map(|s| !self.is_received(s)))
    }
}

/// Burst ratio (ITU-T G.113 Appendix I): mean observed loss-run length divided by the mean run
/// length expected for random loss with the same loss rate, 1/(1−p). Equivalently, for a
/// 2-state Markov model with P(lose | previous received) = p and P(receive | previous lost) = q,
/// BurstR = 1/(p+q). 1.0 is random loss, > 1 bursty. `None` without loss (or all lost).
pub fn burst_ratio(lost_pattern: impl IntoIterator<Item = bool>) -> Option<f64> {
    let (mut packets, mut lost, mut runs) = (0u64, 0u64, 0u64);
    let mut previous_lost = false;
    for is_lost in lost_pattern {
        packets += 1;
        if is_lost {
            lost += 1;
            if !previous_lost {
                runs += 1;
            }
        }
        previous_lost = is_lost;
    }
    if lost == 0 || lost == packets {
        return None;
    }
    let loss_rate = lost as f64 / packets as f64;
    let mean_run = lost as f64 / runs as f64;
    Some(mean_run * (1.0 - loss_rate))
}

/// Extends 16-bit RTP sequence numbers to 64 bits across wraps (RFC 3550 A.1 idea): each number
/// is placed at the extended value nearest to the highest seen so far, so late packets from
/// before a wrap land before it. The first packet maps to `2^16 + seq` so a slightly late
/// packet can still be placed before it without going negative.
#[derive(Debug, Clone, Copy, Default)]
pub struct RtpSeqExtender {
    highest: Option<u64>,
}

impl RtpSeqExtender {
    pub fn extend(&mut self, seq: u16) -> u64 {
        let Some(highest) = self.highest else {
            let first = (1u64 << 16) + seq as u64;
            self.highest = Some(first);
            return first;
        };
        let delta = seq.wrapping_sub(highest as u16) as i16 as i64; // -32768..=32767
        let extended = (highest as i64 + delta).max(0) as u64;
        if extended > highest {
            self.highest = Some(extended);
        }
        extended
    }
}

// ---------------------------------------------------------------------------------------------
// ITU-T G.107 E-model
// ---------------------------------------------------------------------------------------------

/// Simplified ITU-T G.107 E-model: R = R0 − Id(d) − Ie-eff(Ppl), everything else at G.107
/// defaults (R0 = 93.2 = Ro − Is with default parameters, A = 0).
///
/// * Id uses the widely used simplification of G.107's delay impairment (Cole & Rosenbluth,
///   2001): Id = 0.024·d + 0.11·(d − 177.3)·H(d − 177.3), d = one-way mouth-to-ear delay in ms,
///   H the step function. Our measured network delays are µs; pass codec + jitter-buffer delay
///   in `d` if mouth-to-ear is wanted.
/// * Ie-eff = Ie + (95 − Ie)·Ppl/(Ppl/BurstR + Bpl), Ppl = packet loss in percent.
/// * Codec parameters default to **G.711 without packet loss concealment** (G.113 Appendix I):
///   Ie = 0, Bpl = 4.3. (G.711 with PLC would be Bpl = 25.1.)
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct EModel {
    pub r0: f64,
    /// Equipment impairment factor of the codec.
    pub ie: f64,
    /// Packet-loss robustness factor of the codec.
    pub bpl: f64,
}

impl Default for EModel {
    fn default() -> Self {
        EModel::G711
    }
}

impl EModel {
    /// G.711, no PLC: Ie = 0, Bpl = 4.3, R0 = 93.2.
    pub const G711: EModel = EModel { r0: 93.2, ie: 0.0, bpl: 4.3 };

    /// Delay impairment Id for a one-way delay in ms.
    pub fn delay_impairment(one_way_delay_ms: f64) -> f64 {
        let d = one_way_delay_ms.max(0.0);
        0.024 * d + if d > 177.3 { 0.11 * (d - 177.3) } else { 0.0 }
    }

    /// Ie-eff for a loss in percent (0..=100) and a burst ratio (1.0 = random loss).
    pub fn effective_equipment_impairment(&self, loss_percent: f64, burst_ratio: f64) -> f64 {
        let ppl = loss_percent.clamp(0.0, 100.0);
        let burst_ratio = if burst_ratio.is_finite() && burst_ratio > 0.0 { burst_ratio } else { 1.0 };
        self.ie + (95.0 - self.ie) * ppl / (ppl / burst_ratio + self.bpl)
    }

    /// Rating factor R.
    pub fn r_factor(&self, one_way_delay_ms: f64, loss_percent: f64, burst_ratio: f64) -> f64 {
        self.r0 - Self::delay_impairment(one_way_delay_ms) - self.effective_equipment_impairment(loss_percent, burst_ratio)
    }

    /// MOS-CQE for the given conditions (see [`mos_from_r`]).
    pub fn mos(&self, one_way_delay_ms: f64, loss_percent: f64, burst_ratio: f64) -> f64 {
        mos_from_r(self.r_factor(one_way_delay_ms, loss_percent, burst_ratio))
    }
}

/// G.107 Annex B: MOS = 1 for R ≤ 0, 4.5 for R ≥ 100, else 1 + 0.035R + R(R−60)(100−R)·7·10⁻⁶.
pub fn mos_from_r(r: f64) -> f64 {
    if r <= 0.0 {
        1.0
    } else if r >= 100.0 {
        4.5
    } else {
        1.0 + 0.035 * r + r * (r - 60.0) * (100.0 - r) * 7e-6
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64, eps: f64) -> bool {
        (a - b).abs() <= eps
    }

    #[test]
    fn summary_nearest_rank() {
        let mut v: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let s = Summary::of(&mut v);
        assert_eq!(s, Summary { count: 100, min: 1.0, p50: 50.0, mean: 50.5, p99: 99.0, max: 100.0 });

        let s = Summary::of(&mut [7.0]);
        assert_eq!((s.min, s.p50, s.p99, s.max, s.mean), (7.0, 7.0, 7.0, 7.0, 7.0));

        // n = 3: p50 is the 2nd value (ceil(1.5)), p99 the 3rd (ceil(2.97)).
        let s = Summary::of(&mut [3.0, 1.0, 2.0]);
        assert_eq!((s.p50, s.p99, s.mean), (2.0, 3.0, 2.0));

        assert_eq!(Summary::of(&mut []), Summary::default());
    }

    #[test]
    fn value_recorder_exact_extremes() {
        let mut r = ValueRecorder::new();
        for v in [1_000, 2_000, 3_000, 123_457] {
            r.record(v);
        }
        let s = r.summary();
        assert_eq!((s.count, s.min, s.max), (4, 1_000.0, 123_457.0));
        assert!(close(s.mean, (1_000.0 + 2_000.0 + 3_000.0 + 123_457.0) / 4.0, 1e-9));
        assert!(close(s.p50, 2_000.0, 2.0), "{s:?}"); // histogram precision: 3 digits
        for v in [31_032, 31_032] {
            r.record(v);
        }
        let s = r.summary();
        assert!(s.p99 <= s.max && s.p50 >= s.min, "quantiles clamped into [min, max]: {s:?}");
        r.record(0); // zero is recordable (below the histogram's lowest bucket)
        assert_eq!(r.summary().min, 0.0);
        assert_eq!(ValueRecorder::new().summary(), Summary::default());
    }

    #[test]
    fn rfc3550_jitter_by_hand() {
        // transits 100, 110, 100, 130 ns -> |D| = 10, 10, 30
        // J1 = 10/16 = 0.625; J2 = 0.625 + (10 - 0.625)/16 = 1.2109375;
        // J3 = 1.2109375 + (30 - 1.2109375)/16 = 3.010253906...
        let mut j = Rfc3550Jitter::default();
        for (send, recv) in [(0, 100), (20, 130), (40, 140), (60, 190)] {
            j.on_packet(send, recv);
        }
        assert!(close(j.jitter_ns(), 3.010_253_906_25, 1e-9), "{}", j.jitter_ns());

        let mut constant = Rfc3550Jitter::default();
        for i in 0..100 {
            constant.on_packet(i * 20_000_000, i * 20_000_000 + 50_000);
        }
        assert_eq!(constant.jitter_ns(), 0.0);
    }

    #[test]
    fn rfc4689_delay_variation_by_hand() {
        let mut dv = DelayVariation::default();
        for d in [100, 110, 100, 130] {
            dv.on_delay(d);
        }
        let s = dv.summary();
        assert_eq!((s.count, s.min, s.max), (3, 10.0, 30.0));
        assert!(close(s.mean, 50.0 / 3.0, 1e-9));
        assert_eq!(s.p50, 10.0);
    }

    #[test]
    fn seq_tracker_loss_duplicates_reorder() {
        let mut t = SeqTracker::new(10);
        let outcomes: Vec<_> = [0, 1, 3, 2, 3, 5, 9, 10].into_iter().map(|s| t.record(s)).collect();
        use SeqOutcome::*;
        assert_eq!(outcomes, [InOrder, InOrder, InOrder, Reordered, Duplicate, InOrder, InOrder, OutOfRange]);
        assert_eq!((t.unique, t.duplicates, t.reordered, t.out_of_range), (6, 1, 1, 1));
        // sent 0..10: missing 4, 6, 7, 8
        assert_eq!(t.lost(10), 4);
        assert_eq!(t.lost_by_highest(), 4);
        // loss pattern over 0..10: ....L.LLL. -> 4 lost in 2 runs, mean run 2, p = 0.4,
        // BurstR = 2 * (1 - 0.4) = 1.2
        assert!(close(t.burst_ratio(10).unwrap(), 1.2, 1e-12));
    }

    #[test]
    fn burst_ratio_edges() {
        assert_eq!(burst_ratio([false, false]), None);
        assert_eq!(burst_ratio([true, true]), None);
        // isolated losses at rate 1/4: mean run 1, expected run 1/(1-0.25) -> BurstR 0.75
        assert!(close(burst_ratio([true, false, false, false]).unwrap(), 0.75, 1e-12));
    }

    #[test]
    fn rtp_seq_extension_across_wrap() {
        let mut e = RtpSeqExtender::default();
        let base = 1u64 << 16;
        assert_eq!(e.extend(65534), base + 65534);
        assert_eq!(e.extend(65535), base + 65535);
        assert_eq!(e.extend(0), base + 65536);
        assert_eq!(e.extend(1), base + 65537);
        assert_eq!(e.extend(65533), base + 65533, "late packet from before the wrap");
        assert_eq!(e.extend(2), base + 65538);
        // a first packet followed by a slightly older one
        let mut e = RtpSeqExtender::default();
        assert_eq!(e.extend(0), base);
        assert_eq!(e.extend(65535), base - 1);
    }

    #[test]
    fn e_model_g711() {
        let g711 = EModel::G711;
        // no loss, 0 ms: R = 93.2, MOS = 1 + 3.262 + 93.2*33.2*6.8*7e-6 = 4.4093...
        assert!(close(g711.r_factor(0.0, 0.0, 1.0), 93.2, 1e-12));
        assert!(close(mos_from_r(93.2), 4.409_285_824, 1e-9), "{}", mos_from_r(93.2));
        // small delay (1 ms): Id = 0.024 -> R = 93.176, MOS still ~4.41
        assert!(close(g711.r_factor(1.0, 0.0, 1.0), 93.176, 1e-12));
        assert!(close(g711.mos(1.0, 0.0, 1.0), 4.41, 0.005));
        // 200 ms: Id = 4.8 + 0.11 * 22.7 = 7.297
        assert!(close(EModel::delay_impairment(200.0), 7.297, 1e-9));
        // 1 % random loss: Ie-eff = 95 * 1/(1 + 4.3) = 17.9245...
        assert!(close(g711.effective_equipment_impairment(1.0, 1.0), 95.0 / 5.3, 1e-12));
        // burstier loss hurts more: BurstR 2 -> 95 * 1/(0.5 + 4.3)
        assert!(close(g711.effective_equipment_impairment(1.0, 2.0), 95.0 / 4.8, 1e-12));
        // MOS clamps
        assert_eq!(mos_from_r(-5.0), 1.0);
        assert_eq!(mos_from_r(120.0), 4.5);
        // R = 50: 1 + 1.75 + 50*(-10)*50*7e-6 = 2.575
        assert!(close(mos_from_r(50.0), 2.575, 1e-12));
    }
}
