//! In-path reception quality of one RTP stream, as its packets arrive (RFC 3550 A.1, A.3, A.8):
//! loss, duplicates, reordering and interarrival jitter, with DESIGN.md's definitions.
//!
//! Every data plane computes it on every packet it accepts, with this integer arithmetic: the
//! user-space plane calls [`RtpReception::on_packet`]; the BPF program mirrors it line for line
//! (`crates/ebpf/bpf/reception.h`), and the eBPF tests hold the two against each other.
//!
//! Sequence numbers are extended with a cycle count (RFC 3550 A.1), starting at cycle 1 so a
//! packet from before the first one seen (reordered across the start) still has a place.
//! A bitmap of the last [`WINDOW`] sequence numbers tells a duplicate from a late packet.

use serde::{Deserialize, Serialize};

/// A jump forward by this much or more is not taken as loss until a second packet confirms it.
pub const MAX_DROPOUT: u16 = 3000;
/// A packet this far (or less) behind the highest is late; further behind, a jump.
pub const MAX_MISORDER: u16 = 100;
/// Sequence numbers behind the highest whose arrival is remembered (duplicate detection).
pub const WINDOW: u32 = 64;
/// |D| larger than this (in timestamp units) is clamped, so the scaled jitter fits 32 bits.
pub const MAX_TRANSIT_DELTA: u32 = 0x00ff_ffff;
/// "No sequence number awaited" in [`RtpReception::probation`].
pub const NO_PROBATION: u32 = 0x1_0000;

/// Reception state of one stream (one SSRC at a time: another SSRC starts it over).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RtpReception {
    /// Some packet was counted.
    pub started: bool,
    pub ssrc: u32,
    /// Clock rate of the last packet's stream (Hz; 0 = unknown, no jitter).
    pub clock_rate: u32,
    /// Extended highest sequence number (cycle << 16 | seq), cycle 1 first.
    pub max_ext: u32,
    /// Extended sequence number of the first packet of this sequence (or an earlier late one).
    pub base_ext: u32,
    /// Bit i: `max_ext - i` arrived (i < [`WINDOW`]).
    pub window: u64,
    /// After a jump: the sequence number that would confirm it ([`NO_PROBATION`]: none).
    pub probation: u32,
    /// Distinct packets of this sequence.
    pub received: u64,
    /// Expected and received of earlier sequences (before a re-sync or an SSRC change).
    pub expected_prior: u64,
    pub received_prior: u64,
    pub duplicates: u64,
    /// Packets that arrived after a later one of their stream.
    pub reordered: u64,
    /// Packets that jumped too far and were not counted (a confirmed jump starts a new sequence).
    pub jumps: u64,
    pub resyncs: u64,
    pub ssrc_changes: u64,
    /// Relative transit time of the last counted packet (timestamp units, wrapping).
    pub transit: u32,
    /// `transit` holds a value.
    pub has_transit: bool,
    /// Interarrival jitter × 16 (RFC 3550 A.8), timestamp units.
    pub jitter_q4: u32,
}

/// What one packet was to its stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arrival {
    /// The first of a sequence (the stream's first, after an SSRC change or a confirmed jump).
    First,
    /// The highest so far (possibly after a gap: loss, until late packets fill it).
    InOrder,
    /// Behind the highest, not seen before.
    Late,
    Duplicate,
    /// Too far from the highest; not counted unless the next packet confirms it.
    Jump,
}

/// Arrival time in timestamp units of a `clock_rate` clock: microseconds × rate / 10^6, in 64
/// bits (exact for ~6 years of uptime at 90 kHz), truncated to the 32 bits RTP timestamps have.
pub fn arrival_units(arrival_ns: u64, clock_rate: u32) -> u32 {
    ((arrival_ns / 1000).wrapping_mul(clock_rate as u64) / 1_000_000) as u32
}

impl RtpReception {
    /// Account one RTP packet (header fields, arrival time on any monotonic ns clock, and its
    /// clock rate, 0 when unknown).
    pub fn on_packet(&mut self, ssrc: u32, seq: u16, timestamp: u32, arrival_ns: u64, clock_rate: u32) -> Arrival {
        if !self.started || ssrc != self.ssrc {
            if self.started {
                self.ssrc_changes += 1;
            }
            self.restart(ssrc, seq);
            self.jitter(timestamp, arrival_ns, clock_rate);
            return Arrival::First;
        }
        let delta = seq.wrapping_sub(self.max_ext as u16);
        let arrival = if delta == 0 {
            Arrival::Duplicate
        } else if delta < MAX_DROPOUT {
            self.max_ext = self.max_ext.wrapping_add(delta as u32);
            self.window = if (delta as u32) < WINDOW { self.window << delta } else { 0 };
            self.window |= 1;
            self.received += 1;
            self.probation = NO_PROBATION;
            Arrival::InOrder
        } else if delta > u16::MAX - MAX_MISORDER {
            let back = 0x1_0000 - delta as u32;
            if back < WINDOW && self.window & (1 << back) != 0 {
                Arrival::Duplicate
            } else {
                if back < WINDOW {
                    self.window |= 1 << back;
                }
                // Further back than the window remembers: counted as late (a duplicate that old
                // cannot be told apart, and shows as negative loss).
                self.received += 1;
                self.reordered += 1;
                let ext = self.max_ext.wrapping_sub(back);
                if ext < self.base_ext {
                    self.base_ext = ext;
                }
                Arrival::Late
            }
        } else if self.probation == seq as u32 {
            // Two packets in sequence after a jump: the source restarted its numbering.
            self.resyncs += 1;
            self.restart(ssrc, seq);
            self.jitter(timestamp, arrival_ns, clock_rate);
            return Arrival::First;
        } else {
            self.jumps += 1;
            self.probation = seq.wrapping_add(1) as u32;
            return Arrival::Jump;
        };
        match arrival {
            Arrival::Duplicate => self.duplicates += 1,
            _ => self.jitter(timestamp, arrival_ns, clock_rate),
        }
        arrival
    }

    /// Start a new sequence at `seq`, folding the current one into the prior totals.
    fn restart(&mut self, ssrc: u32, seq: u16) {
        if self.started {
            self.expected_prior += self.expected_here();
            self.received_prior += self.received;
        }
        self.started = true;
        self.ssrc = ssrc;
        self.max_ext = 0x1_0000 | seq as u32;
        self.base_ext = self.max_ext;
        self.window = 1;
        self.probation = NO_PROBATION;
        self.received = 1;
        self.has_transit = false;
    }

    /// RFC 3550 A.8: J += (|D| - J) / 16, kept × 16 in integers.
    fn jitter(&mut self, timestamp: u32, arrival_ns: u64, clock_rate: u32) {
        if clock_rate != self.clock_rate {
            // Another clock: transit times are not comparable across it.
            self.clock_rate = clock_rate;
            self.has_transit = false;
        }
        if clock_rate == 0 {
            return;
        }
        let transit = arrival_units(arrival_ns, clock_rate).wrapping_sub(timestamp);
        if self.has_transit {
            let d = (transit.wrapping_sub(self.transit) as i32).unsigned_abs().min(MAX_TRANSIT_DELTA);
            self.jitter_q4 = self.jitter_q4.wrapping_add(d).wrapping_sub((self.jitter_q4 + 8) >> 4);
        }
        self.transit = transit;
        self.has_transit = true;
    }

    fn expected_here(&self) -> u64 {
        if self.started {
            (self.max_ext - self.base_ext) as u64 + 1
        } else {
            0
        }
    }

    /// Packets expected since the stream began (every sequence it went through).
    pub fn expected(&self) -> u64 {
        self.expected_prior + self.expected_here()
    }

    /// Distinct packets received since the stream began.
    pub fn received_total(&self) -> u64 {
        self.received_prior + self.received
    }

    /// Cumulative loss (RFC 3550 A.3): expected − received; negative when late duplicates older
    /// than the window were counted.
    pub fn lost(&self) -> i64 {
        self.expected() as i64 - self.received_total() as i64
    }

    /// The report block (RFC 3550 6.4.1) a receiver sends `reporter`'s sender about this stream:
    /// `since` is (expected, received) at the previous block (updated here; fraction lost is of
    /// the interval), `last_sr` the sender's latest SR (NTP middle bits, when it passed) and
    /// `now_ns` the time of the report (for DLSR).
    pub fn report_block(&self, reporter: u32, since: &mut (u64, u64), last_sr: Option<(u32, u64)>, now_ns: u64) -> crate::call_quality::ReportBlock {
        let (expected, received) = (self.expected(), self.received_total());
        let expected_interval = expected.saturating_sub(since.0);
        let lost_interval = expected_interval as i64 - received.saturating_sub(since.1) as i64;
        *since = (expected, received);
        let fraction_lost = if expected_interval == 0 || lost_interval <= 0 { 0 } else { (((lost_interval as u64) << 8) / expected_interval).min(255) as u8 };
        let (lsr, dlsr) =
            last_sr.map_or((0, 0), |(mid, at)| (mid, ((now_ns.saturating_sub(at) as u128 * 65_536) / 1_000_000_000).min(u32::MAX as u128) as u32));
        crate::call_quality::ReportBlock {
            reporter,
            about: self.ssrc,
            fraction_lost,
            // 24 bits, signed.
            cumulative_lost: self.lost().clamp(-0x80_0000, 0x7f_ffff) as i32,
            highest_seq: self.max_ext.wrapping_sub(0x1_0000),
            jitter: self.jitter_q4 >> 4,
            lsr,
            dlsr,
        }
    }

    /// The summary the API and metrics show.
    pub fn report(&self) -> ReceptionReport {
        let expected = self.expected();
        let jitter = self.jitter_q4 >> 4;
        ReceptionReport {
            ssrc: self.ssrc,
            packets: self.received_total(),
            expected,
            lost: self.lost(),
            loss_fraction: if expected == 0 { 0.0 } else { self.lost().max(0) as f64 / expected as f64 },
            duplicates: self.duplicates,
            reordered: self.reordered,
            jumps: self.jumps,
            resyncs: self.resyncs,
            ssrc_changes: self.ssrc_changes,
            highest_seq: (self.max_ext.wrapping_sub(0x1_0000)) & 0xffff,
            clock_rate: self.clock_rate,
            jitter,
            jitter_ms: (self.clock_rate > 0).then(|| self.jitter_q4 as f64 * 1000.0 / 16.0 / self.clock_rate as f64),
        }
    }
}

/// A stream's reception as reported (API, metrics, NG `query`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ReceptionReport {
    /// The SSRC being received (the last one, after an SSRC change).
    pub ssrc: u32,
    /// Distinct packets received.
    pub packets: u64,
    pub expected: u64,
    /// Expected − received (negative: old duplicates counted, see [`RtpReception::lost`]).
    pub lost: i64,
    /// lost / expected (0 when negative or nothing expected).
    pub loss_fraction: f64,
    pub duplicates: u64,
    pub reordered: u64,
    pub jumps: u64,
    pub resyncs: u64,
    pub ssrc_changes: u64,
    /// Highest sequence number received (16 bits).
    pub highest_seq: u32,
    pub clock_rate: u32,
    /// Interarrival jitter, timestamp units (as an RTCP report block carries it).
    pub jitter: u32,
    /// The same in milliseconds; None when the clock rate is unknown.
    pub jitter_ms: Option<f64>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    const MS: u64 = 1_000_000;

    /// Feed (seq, ts, arrival) triples of one SSRC.
    fn feed(packets: &[(u16, u32, u64)], rate: u32) -> (RtpReception, Vec<Arrival>) {
        let mut r = RtpReception::default();
        let v = packets.iter().map(|&(s, t, a)| r.on_packet(7, s, t, a, rate)).collect();
        (r, v)
    }

    #[test]
    fn in_order_stream_has_no_loss_and_no_jitter_when_paced_exactly() {
        let p: Vec<_> = (0..100u16).map(|i| (i, i as u32 * 160, 1_000 * MS + i as u64 * 20 * MS)).collect();
        let (r, v) = feed(&p, 8000);
        assert_eq!(v[0], Arrival::First);
        assert!(v[1..].iter().all(|a| *a == Arrival::InOrder));
        let rep = r.report();
        assert_eq!((rep.packets, rep.expected, rep.lost, rep.duplicates, rep.reordered), (100, 100, 0, 0, 0));
        assert_eq!(rep.jitter, 0);
        assert_eq!(rep.highest_seq, 99);
    }

    #[test]
    fn loss_duplicates_and_reordering_are_told_apart() {
        // 0 1 3 2 2 5 (4 lost), then 1 again.
        let seqs = [0u16, 1, 3, 2, 2, 5, 1];
        let p: Vec<_> = seqs.iter().map(|&s| (s, s as u32 * 160, s as u64 * 20 * MS)).collect();
        let (r, v) = feed(&p, 8000);
        use Arrival::*;
        assert_eq!(v, vec![First, InOrder, InOrder, Late, Duplicate, InOrder, Duplicate]);
        let rep = r.report();
        assert_eq!((rep.packets, rep.expected, rep.lost, rep.duplicates, rep.reordered), (5, 6, 1, 2, 1));
    }

    #[test]
    fn sequence_wraps_without_loss() {
        let p: Vec<_> = (0..200u32).map(|i| ((65_500 + i) as u16, i * 160, i as u64 * 20 * MS)).collect();
        let (r, _) = feed(&p, 8000);
        let rep = r.report();
        assert_eq!((rep.packets, rep.expected, rep.lost), (200, 200, 0));
        assert_eq!(rep.highest_seq, (65_500 + 199) % 65_536);
    }

    #[test]
    fn a_jump_counts_only_once_confirmed() {
        use Arrival::*;
        // A lone wild packet is ignored; two in sequence start a new sequence.
        let p = [(10u16, 0u32, 0u64), (11, 160, 20 * MS), (40_000, 320, 40 * MS), (12, 480, 60 * MS), (50_000, 0, 80 * MS), (50_001, 160, 100 * MS)];
        let (r, v) = feed(&p, 8000);
        assert_eq!(v, vec![First, InOrder, Jump, InOrder, Jump, First]);
        let rep = r.report();
        assert_eq!((rep.packets, rep.expected, rep.lost, rep.jumps, rep.resyncs), (4, 4, 0, 2, 1));
    }

    #[test]
    fn an_ssrc_change_starts_over_and_keeps_the_totals() {
        let mut r = RtpReception::default();
        for s in [0u16, 1, 3] {
            r.on_packet(1, s, 0, 0, 0);
        }
        assert_eq!(r.on_packet(2, 9000, 0, 0, 0), Arrival::First);
        r.on_packet(2, 9001, 0, 0, 0);
        let rep = r.report();
        assert_eq!((rep.ssrc, rep.packets, rep.expected, rep.lost, rep.ssrc_changes), (2, 5, 6, 1, 1));
    }

    #[test]
    fn jitter_follows_rfc3550_a8() {
        // 8 kHz, 20 ms packets; every other packet arrives 10 ms late: |D| = 80 units each time
        // after the first. J(n) = J(n-1) + (80 - J(n-1)) / 16 converges to 80.
        let p: Vec<_> = (0..400u16).map(|i| (i, i as u32 * 160, i as u64 * 20 * MS + if i % 2 == 1 { 10 * MS } else { 0 })).collect();
        let (r, _) = feed(&p, 8000);
        let rep = r.report();
        assert!((78..=80).contains(&rep.jitter), "jitter {}", rep.jitter);
        let ms = rep.jitter_ms.unwrap();
        assert!((9.7..=10.0).contains(&ms), "jitter {ms} ms");
        // The float recurrence gives the same within rounding.
        let mut j = 0f64;
        for _ in 1..400 {
            j += (80.0 - j) / 16.0;
        }
        assert!((j - rep.jitter as f64).abs() <= 1.0, "float {j} vs integer {}", rep.jitter);
        // Without a clock rate there is no jitter at all.
        let (r, _) = feed(&p, 0);
        assert_eq!((r.report().jitter, r.report().jitter_ms), (0, None));
    }

    #[test]
    fn arrival_units_convert_nanoseconds_to_the_clock() {
        assert_eq!(arrival_units(1_000_000_000, 8000), 8000);
        assert_eq!(arrival_units(20 * MS, 90_000), 1800);
        assert_eq!(arrival_units(123, 48_000), 0);
    }

    /// xorshift64*: deterministic, so a failure reproduces with its seed.
    struct Rng(u64);
    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    /// Against a plain model: a sender numbers packets from a random start (wrapping), the
    /// network drops, duplicates and delays some (never by more than the window); received,
    /// expected, loss, duplicates and reordering then equal what a set of sequence numbers says.
    #[test]
    fn random_loss_duplication_and_reordering_match_a_set_model() {
        for seed in 1..300u64 {
            let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15));
            let start = rng.below(65_536) as u32;
            let n = 50 + rng.below(400) as u32;
            // (sent index, arrival order key)
            let mut net: Vec<(u32, u64)> = Vec::new();
            for i in 0..n {
                let first = i == 0; // the first packet arrives first (the base of the count)
                if !first && rng.below(10) == 0 {
                    continue; // lost
                }
                let delay = if first || rng.below(8) != 0 { 0 } else { rng.below(40) };
                net.push((i, (i as u64 + delay) * 4 + 1));
                if !first && rng.below(15) == 0 {
                    net.push((i, (i as u64 + rng.below(40)) * 4 + 2)); // a duplicate
                }
            }
            net.sort_by_key(|&(i, k)| (k, i));
            let mut r = RtpReception::default();
            let mut seen = BTreeSet::new();
            let (mut dups, mut late, mut highest) = (0u64, 0u64, 0u32);
            for &(i, _) in &net {
                let a = r.on_packet(1, (start + i) as u16, i * 160, i as u64 * 20 * MS, 8000);
                if !seen.insert(i) {
                    dups += 1;
                    assert_eq!(a, Arrival::Duplicate, "seed {seed}: packet {i} again");
                } else if i < highest {
                    late += 1;
                    assert_eq!(a, Arrival::Late, "seed {seed}: packet {i} after {highest}");
                }
                highest = highest.max(i);
            }
            let expected = highest as u64 + 1;
            let rep = r.report();
            assert_eq!(rep.packets, seen.len() as u64, "seed {seed}");
            assert_eq!(rep.expected, expected, "seed {seed}");
            assert_eq!(rep.lost, expected as i64 - seen.len() as i64, "seed {seed}");
            assert_eq!((rep.duplicates, rep.reordered), (dups, late), "seed {seed}");
            assert_eq!(rep.highest_seq, (start + highest) & 0xffff, "seed {seed}");
        }
    }
}
