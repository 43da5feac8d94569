//! Call quality from the RTCP the parties exchange through a relay: round-trip times from
//! sender and receiver reports (RFC 3550 6.4), and a MOS per reporting SSRC, as rtpengine
//! computes them for its NG `query`/`delete` replies (so Kamailio's MOS AVPs mean the same).
//!
//! * An SR of SSRC `s` passing the relay is remembered (its NTP middle 32 bits, when it passed;
//!   the last [`SENDER_REPORTS_KEPT`] per SSRC).
//! * A report block from reporter `r` about `s` echoing that SR (LSR) with its delay (DLSR) gives
//!   the round-trip time of the leg between the relay and `r`: now − SR passed − DLSR. It is kept
//!   as the last leg time of `s`'s media (the leg towards `r`).
//! * The call's round-trip time for `r` is that leg plus the other leg (the last leg time of `r`'s
//!   own media, measured from the other party's reports). Without the other leg there is no MOS
//!   (rtpengine's default MOS-CQ); a block that echoes no SR counts its own leg as 0, as in
//!   rtpengine.
//! * Each block becomes a sample of `r` — the quality `r` receives: the block's jitter (in ms,
//!   with the clock rate of `s`'s media), its fraction lost (in %), the round-trip times and the
//!   MOS. A sample less than [`SAMPLE_SPACING_NS`] after the previous one of `r` is not kept.
//!
//! MOS (× 10, as an integer, as rtpengine gives it): effective latency = RTT/1000 (ms) +
//! 2 × jitter (ms) + 10; R = 93.2 − latency/40 (below 160 ms) or 93.2 − (latency − 120)/10;
//! R −= 2.5 × loss (%); MOS = 1 + 0.035 R + 7·10⁻⁶ R (R − 60)(100 − R) (1.0 when R < 0).
//!
//! Sans-I/O: times are passed in (a monotonic clock in ns for intervals, the wall clock in µs
//! for what is shown).

use crate::rtp::parse_rtcp_compound;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};

/// Sender reports remembered per SSRC (rtpengine keeps 10).
pub const SENDER_REPORTS_KEPT: usize = 10;
/// Samples of one reporter closer together than this: only the first is kept.
pub const SAMPLE_SPACING_NS: u64 = 1_000_000_000;
/// A round-trip time above this (µs) is taken as a wrong LSR/DLSR and not used.
pub const MAX_RTT_US: i64 = 10_000_000;
/// SSRCs followed per relay (rtpengine keeps about as many per party): the least recently
/// heard goes first.
pub const MAX_SSRCS: usize = 20;
/// Samples kept per SSRC for the progression: when full, every other one is dropped, so the
/// kept ones still span the whole call (more thinly). Averages, lowest and highest cover every
/// sample.
pub const MAX_SAMPLES: usize = 256;

const RTCP_SR: u8 = 200;
const RTCP_RR: u8 = 201;
const REPORT_BLOCK_LEN: usize = 24;

/// The sender info of an SR that matters here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SenderReport {
    pub ssrc: u32,
    /// Middle 32 bits of its NTP timestamp: what a receiver echoes as LSR.
    pub ntp_middle: u32,
}

/// One reception report block (RFC 3550 6.4.1) with the SSRC of its reporter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReportBlock {
    pub reporter: u32,
    /// The SSRC whose media the block is about.
    pub about: u32,
    pub fraction_lost: u8,
    /// Cumulative number of packets lost (24-bit signed).
    pub cumulative_lost: i32,
    pub highest_seq: u32,
    /// Interarrival jitter, timestamp units.
    pub jitter: u32,
    pub lsr: u32,
    /// Delay since that SR, 1/65536 s.
    pub dlsr: u32,
}

/// The SRs and report blocks of an RTCP compound packet, in order. Packets of other types are
/// skipped; an SR or RR whose length does not hold its blocks is skipped whole. `None` when the
/// compound itself is not valid RTCP.
pub fn parse_reports(compound: &[u8]) -> Option<(Vec<SenderReport>, Vec<ReportBlock>)> {
    let packets = parse_rtcp_compound(compound).ok()?;
    let (mut srs, mut blocks) = (Vec::new(), Vec::new());
    for p in packets {
        let first_block = match p.packet_type {
            RTCP_SR => 28,
            RTCP_RR => 8,
            _ => continue,
        };
        let b = p.bytes;
        if b.len() < first_block + p.count as usize * REPORT_BLOCK_LEN {
            continue;
        }
        let word = |at: usize| u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        if p.packet_type == RTCP_SR {
            srs.push(SenderReport { ssrc: p.sender_ssrc, ntp_middle: word(10) });
        }
        for i in 0..p.count as usize {
            let at = first_block + i * REPORT_BLOCK_LEN;
            let lost = word(at + 4);
            blocks.push(ReportBlock {
                reporter: p.sender_ssrc,
                about: word(at),
                fraction_lost: (lost >> 24) as u8,
                // Sign-extend the 24-bit count.
                cumulative_lost: ((lost << 8) as i32) >> 8,
                highest_seq: word(at + 8),
                jitter: word(at + 12),
                lsr: word(at + 16),
                dlsr: word(at + 20),
            });
        }
    }
    Some((srs, blocks))
}

/// An SR of `ssrc` (NTP time with `ntp_middle` as its middle 32 bits, other sender info zero)
/// or, without `ntp_middle`, an RR, carrying `blocks` (their `reporter` is `ssrc`): what
/// [`parse_reports`] reads, for generators and tests.
pub fn build_report(ssrc: u32, ntp_middle: Option<u32>, blocks: &[ReportBlock]) -> Vec<u8> {
    let mut words = vec![ssrc];
    if let Some(mid) = ntp_middle {
        words.extend([mid >> 16, mid << 16, 0, 0, 0]);
    }
    for b in blocks {
        words.extend([b.about, (b.fraction_lost as u32) << 24 | (b.cumulative_lost as u32 & 0x00ff_ffff), b.highest_seq, b.jitter, b.lsr, b.dlsr]);
    }
    let packet_type = if ntp_middle.is_some() { RTCP_SR } else { RTCP_RR };
    let mut p = vec![0x80 | blocks.len() as u8, packet_type];
    p.extend_from_slice(&(words.len() as u16).to_be_bytes());
    words.iter().for_each(|w| p.extend_from_slice(&w.to_be_bytes()));
    p
}

/// MOS × 10 (10..=44), truncated, as rtpengine computes it.
pub fn mos_x10(rtt_us: u64, jitter_ms: u32, packet_loss_pct: u32) -> u32 {
    let latency = (rtt_us / 1000) as f64 + jitter_ms as f64 * 2.0 + 10.0;
    let mut r = if latency < 160.0 { 93.2 - latency / 40.0 } else { 93.2 - (latency - 120.0) / 10.0 };
    r -= packet_loss_pct as f64 * 2.5;
    if r < 0.0 {
        10
    } else {
        ((1.0 + 0.035 * r + 0.000007 * r * (r - 60.0) * (100.0 - r)) * 10.0) as u32
    }
}

/// What one report block said, evaluated.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct QualitySample {
    /// MOS × 10; 0 = none (the round-trip time of a leg was not known yet).
    pub mos_x10: u32,
    /// Round-trip time of the whole call (both legs), µs; 0 = unknown.
    pub rtt_us: u64,
    /// Round-trip time between the relay and the reporter, µs; 0 = unknown.
    pub rtt_leg_us: u64,
    pub jitter_ms: u32,
    /// Fraction lost, in percent.
    pub packet_loss_pct: u32,
    /// When it was reported, µs since the Unix epoch.
    pub reported_at_us: u64,
}

/// The MOS summary of one SSRC (the quality its owner receives): what rtpengine reports as
/// `average MOS`, `lowest MOS`, `highest MOS` and `MOS progression`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QualitySummary {
    /// Averages over the samples with a MOS (`reported_at_us` unused).
    pub average: QualitySample,
    /// Samples with a MOS that the average covers.
    pub samples: u64,
    pub lowest: QualitySample,
    pub highest: QualitySample,
    /// About ten samples spread over the call, and the interval they aim for (s).
    pub progression_interval_s: u64,
    pub progression: Vec<QualitySample>,
    /// Cumulative loss of the media it receives, as its last report block said.
    pub reported_cumulative_lost: i32,
}

/// Every MOS computed, summed (as rtpengine's `statistics` `mos` totals sample them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MosTotals {
    pub samples: u64,
    /// Sum of the MOS values (1.0..=5.0 each) and of their squares.
    pub sum: f64,
    pub sum_squares: f64,
}

impl MosTotals {
    pub fn add(&mut self, mos_x10: u32) {
        let mos = mos_x10 as f64 / 10.0;
        self.samples += 1;
        self.sum += mos;
        self.sum_squares += mos * mos;
    }

    pub fn average(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            self.sum / self.samples as f64
        }
    }

    pub fn stddev(&self) -> f64 {
        if self.samples == 0 {
            0.0
        } else {
            (self.sum_squares / self.samples as f64 - self.average().powi(2)).max(0.0).sqrt()
        }
    }
}

/// When the last sender reports of one SSRC passed (RFC 3550 6.4.1): a report block that echoes
/// one (LSR) with its delay since (DLSR) gives the round-trip time of the path between here and
/// the block's reporter. A relay keeps these per SSRC, an SFU per published stream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SenderReportTimes {
    /// (NTP middle 32 bits, when it passed, monotonic ns), oldest first.
    passed: VecDeque<(u32, u64)>,
}

impl SenderReportTimes {
    /// An SR with NTP middle bits `ntp_middle` passed at `at_ns`.
    pub fn on_sender_report(&mut self, ntp_middle: u32, at_ns: u64) {
        if self.passed.len() == SENDER_REPORTS_KEPT {
            self.passed.pop_front();
        }
        self.passed.push_back((ntp_middle, at_ns));
    }

    /// The latest SR: (NTP middle 32 bits, when it passed), what a receiver report echoes.
    pub fn last(&self) -> Option<(u32, u64)> {
        self.passed.back().copied()
    }

    /// The round-trip time (µs) a block arriving at `at_ns` with `lsr` and `dlsr` gives: at_ns −
    /// when that SR passed − DLSR. None when it echoes no SR (LSR or DLSR 0), one not kept here,
    /// or the result is not in (0, [`MAX_RTT_US`]] (a wrong LSR/DLSR).
    pub fn rtt_us(&self, lsr: u32, dlsr: u32, at_ns: u64) -> Option<u64> {
        if lsr == 0 || dlsr == 0 {
            return None;
        }
        let &(_, sr_at) = self.passed.iter().rev().find(|(mid, _)| *mid == lsr)?;
        let rtt = (at_ns as i64 - sr_at as i64) / 1000 - (dlsr as i64 * 1_000_000 / 65536);
        (rtt > 0 && rtt <= MAX_RTT_US).then_some(rtt as u64)
    }
}

#[derive(Debug, Clone, Default)]
struct SsrcState {
    /// Its last SRs.
    sender_reports: SenderReportTimes,
    /// Round-trip time (µs) of the leg towards the receivers of this SSRC's media, last measured.
    last_rtt_leg_us: u64,
    /// Samples of this SSRC as a reporter.
    samples: VecDeque<QualitySample>,
    last_sample_ns: Option<u64>,
    without_mos: u64,
    with_mos: u64,
    /// Sums over the samples with a MOS.
    sums: [u64; 5],
    lowest: Option<QualitySample>,
    highest: Option<QualitySample>,
    cumulative_lost: i32,
    last_heard_ns: u64,
}

/// The RTCP evaluation of one call (one media section of it: the relay its RTCP passes).
#[derive(Debug, Clone, Default)]
pub struct CallQuality {
    ssrcs: HashMap<u32, SsrcState>,
}

impl CallQuality {
    pub fn new() -> Self {
        Self::default()
    }

    /// An RTCP compound packet the relay passed at `at_ns` (monotonic) / `wall_us`.
    /// `clock_rate` is that of the media its reporter receives (the other party's), for jitter
    /// in ms; without it a report block gives its leg's round-trip time but no sample (as in
    /// rtpengine). Invalid RTCP changes nothing.
    ///
    /// Returns the MOS (× 10) of every block that gave one, kept as a sample or not: what
    /// rtpengine's process-wide MOS totals sample.
    pub fn on_rtcp(&mut self, compound: &[u8], at_ns: u64, wall_us: u64, clock_rate: Option<u32>) -> Vec<u32> {
        let Some((srs, blocks)) = parse_reports(compound) else {
            return Vec::new();
        };
        for sr in srs {
            self.ssrc(sr.ssrc, at_ns).sender_reports.on_sender_report(sr.ntp_middle, at_ns);
        }
        let rate = clock_rate.filter(|r| *r > 0);
        blocks.iter().map(|b| self.on_block(b, at_ns, wall_us, rate)).filter(|mos| *mos != 0).collect()
    }

    /// The block's MOS × 10 (0: none).
    fn on_block(&mut self, b: &ReportBlock, at_ns: u64, wall_us: u64, clock_rate: Option<u32>) -> u32 {
        // The leg towards the reporter, from the SR of `about` the block echoes.
        let mut rtt_leg_us = 0u64;
        if let Some(about) = self.ssrcs.get_mut(&b.about) {
            if let Some(rtt) = about.sender_reports.rtt_us(b.lsr, b.dlsr, at_ns) {
                rtt_leg_us = rtt;
                about.last_rtt_leg_us = rtt;
            }
        }
        let Some(clock_rate) = clock_rate else {
            return 0;
        };
        let r = self.ssrc(b.reporter, at_ns);
        r.cumulative_lost = b.cumulative_lost;
        // The whole call: this leg and the leg towards the other party (the reporter's own media);
        // unknown while the other leg is (rtpengine then takes this leg as 0 if it is unknown).
        let rtt_us = if r.last_rtt_leg_us != 0 { rtt_leg_us + r.last_rtt_leg_us } else { 0 };
        let jitter_ms = (b.jitter as u64 * 1000 / clock_rate as u64).min(u32::MAX as u64) as u32;
        let packet_loss_pct = b.fraction_lost as u32 * 100 / 256;
        let mos = if rtt_us == 0 { 0 } else { mos_x10(rtt_us, jitter_ms, packet_loss_pct) };
        let sample = QualitySample { mos_x10: mos, rtt_us, rtt_leg_us, jitter_ms, packet_loss_pct, reported_at_us: wall_us };
        if r.last_sample_ns.is_some_and(|last| at_ns.saturating_sub(last) < SAMPLE_SPACING_NS) {
            return mos;
        }
        r.last_sample_ns = Some(at_ns);
        if r.samples.len() == MAX_SAMPLES {
            let mut i = 0;
            r.samples.retain(|_| {
                i += 1;
                i % 2 == 1
            });
        }
        r.samples.push_back(sample);
        if mos == 0 {
            r.without_mos += 1;
        } else {
            r.with_mos += 1;
            for (sum, v) in r.sums.iter_mut().zip([mos as u64, rtt_us, rtt_leg_us, jitter_ms as u64, packet_loss_pct as u64]) {
                *sum += v;
            }
            if r.lowest.is_none_or(|l| mos < l.mos_x10) {
                r.lowest = Some(sample);
            }
        }
        if r.highest.is_none_or(|h| mos > h.mos_x10) {
            r.highest = Some(sample);
        }
        mos
    }

    fn ssrc(&mut self, ssrc: u32, at_ns: u64) -> &mut SsrcState {
        if !self.ssrcs.contains_key(&ssrc) && self.ssrcs.len() >= MAX_SSRCS {
            if let Some(oldest) = self.ssrcs.iter().min_by_key(|(_, s)| s.last_heard_ns).map(|(k, _)| *k) {
                self.ssrcs.remove(&oldest);
            }
        }
        let s = self.ssrcs.entry(ssrc).or_default();
        s.last_heard_ns = at_ns;
        s
    }

    /// The summary of `ssrc` as a reporter: `None` until one of its samples had a MOS.
    pub fn summary(&self, ssrc: u32) -> Option<QualitySummary> {
        let s = self.ssrcs.get(&ssrc)?;
        let (lowest, highest) = (s.lowest?, s.highest?);
        let n = s.with_mos.max(1);
        let avg = |i: usize| s.sums[i] / n;
        let average = QualitySample {
            mos_x10: avg(0) as u32,
            rtt_us: avg(1),
            rtt_leg_us: avg(2),
            jitter_ms: avg(3) as u32,
            packet_loss_pct: avg(4) as u32,
            reported_at_us: 0,
        };
        // About ten entries, spaced by a tenth of the time the samples span.
        let (first, last) = (s.samples.front()?.reported_at_us, s.samples.back()?.reported_at_us);
        let interval = last.saturating_sub(first) / 10;
        let mut next = first;
        let mut progression = Vec::new();
        for sample in &s.samples {
            if sample.reported_at_us < next {
                continue;
            }
            next += interval;
            progression.push(*sample);
        }
        Some(QualitySummary {
            average,
            samples: s.with_mos,
            lowest,
            highest,
            progression_interval_s: interval / 1_000_000,
            progression,
            reported_cumulative_lost: s.cumulative_lost,
        })
    }

    /// Every SSRC with a summary.
    pub fn summaries(&self) -> BTreeMap<u32, QualitySummary> {
        self.ssrcs.keys().filter_map(|k| self.summary(*k).map(|s| (*k, s))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: u32 = 0x1111_1111;
    const B: u32 = 0x2222_2222;
    const S: u64 = 1_000_000_000;
    const WALL0: u64 = 1_700_000_000_000_000;

    /// An SR of `ssrc` (NTP middle bits `mid`) with report blocks (about, fraction lost,
    /// cumulative lost, jitter, lsr, dlsr).
    fn sr(ssrc: u32, mid: u32, blocks: &[(u32, u8, i32, u32, u32, u32)]) -> Vec<u8> {
        build_report(ssrc, Some(mid), &report_blocks(ssrc, blocks))
    }

    fn rr(ssrc: u32, blocks: &[(u32, u8, i32, u32, u32, u32)]) -> Vec<u8> {
        build_report(ssrc, None, &report_blocks(ssrc, blocks))
    }

    /// (about, fraction lost, cumulative lost, jitter, lsr, dlsr), highest sequence number 7.
    fn report_blocks(reporter: u32, blocks: &[(u32, u8, i32, u32, u32, u32)]) -> Vec<ReportBlock> {
        blocks
            .iter()
            .map(|&(about, fraction_lost, cumulative_lost, jitter, lsr, dlsr)| ReportBlock {
                reporter,
                about,
                fraction_lost,
                cumulative_lost,
                highest_seq: 7,
                jitter,
                lsr,
                dlsr,
            })
            .collect()
    }

    /// A's and B's SRs at 0, and A's report on B's 1 s later: the leg towards A is known, so
    /// B's reports on A give a MOS.
    fn with_the_leg_towards_a_known() -> CallQuality {
        let mut q = CallQuality::new();
        q.on_rtcp(&sr(A, 0xa000, &[]), 0, WALL0, Some(8000));
        q.on_rtcp(&sr(B, 0xb000, &[]), 0, WALL0, Some(8000));
        q.on_rtcp(&rr(A, &[(B, 0, 0, 8, 0xb000, 65536)]), S + 2_000_000, WALL0, Some(8000));
        q
    }

    /// An echo of a kept SR gives arrival − passed − DLSR; an echo of nothing kept, of an SR
    /// pushed out by ten newer ones, without DLSR, or out of (0, 10 s], gives nothing.
    #[test]
    fn sender_report_times_give_the_round_trip_of_an_echo() {
        let ms = 1_000_000u64;
        let mut t = SenderReportTimes::default();
        t.on_sender_report(0x1111, 1_000 * ms);
        t.on_sender_report(0x2222, 2_000 * ms);
        // Echoed 600 ms after it passed, held 500 ms (0x8000 / 65536 s): 100 ms.
        assert_eq!(t.rtt_us(0x2222, 0x8000, 2_600 * ms), Some(100_000));
        assert_eq!(t.rtt_us(0x1111, 0x8000, 1_540 * ms), Some(40_000));
        assert_eq!(t.rtt_us(0x3333, 0x8000, 2_600 * ms), None, "never passed");
        assert_eq!(t.rtt_us(0x2222, 0, 2_600 * ms), None, "no DLSR: echoes nothing");
        assert_eq!(t.rtt_us(0x2222, 0x8000, 2_400 * ms), None, "negative: a wrong DLSR");
        assert_eq!(t.rtt_us(0x2222, 0x8000, 13_000 * ms), None, "above 10 s");
        for i in 0..SENDER_REPORTS_KEPT as u32 {
            t.on_sender_report(0x5000 + i, (3_000 + u64::from(i)) * ms);
        }
        assert_eq!(t.rtt_us(0x2222, 0x8000, 2_600 * ms), None, "pushed out by ten newer ones");
        assert_eq!(t.rtt_us(0x5000, 0x8000, 3_700 * ms), Some(200_000));
    }

    #[test]
    fn report_blocks_are_read_with_their_reporter_and_signed_loss() {
        let mut compound = sr(A, 0x1234_5678, &[(B, 64, -3, 80, 0xabcd, 0x10000)]);
        compound.extend(rr(B, &[(A, 0, 5, 8, 0, 0)]));
        compound.extend([0x81, 206, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]); // a PLI: skipped
        let (srs, blocks) = parse_reports(&compound).unwrap();
        assert_eq!(srs, vec![SenderReport { ssrc: A, ntp_middle: 0x1234_5678 }]);
        assert_eq!(blocks.len(), 2);
        assert_eq!(
            blocks[0],
            ReportBlock { reporter: A, about: B, fraction_lost: 64, cumulative_lost: -3, highest_seq: 7, jitter: 80, lsr: 0xabcd, dlsr: 0x10000 }
        );
        assert_eq!((blocks[1].reporter, blocks[1].about, blocks[1].cumulative_lost), (B, A, 5));
        // What build_report writes, parse_reports reads back.
        let block = ReportBlock { reporter: B, about: A, fraction_lost: 255, cumulative_lost: -8_388_608, highest_seq: 9, jitter: 1, lsr: 2, dlsr: 3 };
        assert_eq!(
            parse_reports(&build_report(B, Some(0xdead_beef), &[block, block])),
            Some((vec![SenderReport { ssrc: B, ntp_middle: 0xdead_beef }], vec![block, block]))
        );
        // A block count the length does not hold: that packet is skipped, the rest is read.
        let mut short = rr(B, &[(A, 0, 0, 0, 0, 0)]);
        short[0] = 0x82;
        short.extend(sr(A, 1, &[]));
        assert_eq!(parse_reports(&short).unwrap(), (vec![SenderReport { ssrc: A, ntp_middle: 1 }], vec![]));
        assert_eq!(parse_reports(&[0x80, 200, 0]), None);
    }

    #[test]
    fn mos_follows_rtpengines_formula() {
        // 20 ms RTT, 2 ms jitter, no loss: latency 34 → R = 92.35 → MOS 4.39.
        assert_eq!(mos_x10(20_000, 2, 0), 43);
        assert_eq!(mos_x10(1_000, 0, 0), 44);
        // 300 ms: R = 93.2 − (314 − 120)/10 = 73.8 → MOS 3.78.
        assert_eq!(mos_x10(300_000, 2, 0), 37);
        // 10 % loss takes 25 off R: 92.35 − 25 = 67.35 → MOS 3.46.
        assert_eq!(mos_x10(20_000, 2, 10), 34);
        // R below 0: the floor, 1.0.
        assert_eq!(mos_x10(20_000, 2, 40), 10);
    }

    /// A call where each party reports on the other every `period`, echoing the other's last SR
    /// after `hold` (DLSR), and the legs take `leg_a`/`leg_b` there and back.
    #[test]
    fn round_trip_times_add_up_over_both_legs_and_give_a_mos() {
        let mut q = CallQuality::new();
        let (leg_a, leg_b) = (4_000u64, 16_000u64); // µs
        let dlsr = 0x8000u32; // 0.5 s
        let hold_us = 500_000u64;
        let t = |s: u64, us: u64| s * S + us * 1000;
        // A's SR passes at 0 s; B echoes it: RTT leg towards B = 16 ms. No MOS yet (A's leg unknown).
        q.on_rtcp(&sr(A, 0xa000, &[]), t(0, 0), WALL0, Some(8000));
        q.on_rtcp(&rr(B, &[(A, 0, 0, 16, 0xa000, dlsr)]), t(0, leg_b + hold_us), WALL0 + 516_000, Some(8000));
        assert_eq!(q.summary(B), None, "no MOS without the other leg");
        // B's SR passes at 2 s; A echoes it: leg towards A = 4 ms, call RTT = 4 + 16 ms.
        q.on_rtcp(&sr(B, 0xb000, &[]), t(2, 0), WALL0 + 2 * 1_000_000, Some(8000));
        assert_eq!(q.on_rtcp(&rr(A, &[(B, 0, 0, 16, 0xb000, dlsr)]), t(2, leg_a + hold_us), WALL0 + 2_504_000, Some(8000)), vec![43]);
        let a = q.summary(A).expect("A has a MOS");
        assert_eq!((a.lowest.rtt_us, a.lowest.rtt_leg_us, a.lowest.jitter_ms), (20_000, 4_000, 2));
        assert_eq!((a.average.mos_x10, a.samples, a.highest.mos_x10), (43, 1, 43));
        // B again, a second later, now with both legs known.
        q.on_rtcp(&sr(A, 0xa100, &[]), t(4, 0), WALL0 + 4_000_000, Some(8000));
        q.on_rtcp(&rr(B, &[(A, 26, 2, 16, 0xa100, dlsr)]), t(4, leg_b + hold_us), WALL0 + 4_516_000, Some(8000));
        let b = q.summary(B).expect("B has a MOS now");
        assert_eq!((b.lowest.rtt_us, b.lowest.packet_loss_pct, b.reported_cumulative_lost), (20_000, 10, 2));
        assert_eq!(b.lowest.mos_x10, mos_x10(20_000, 2, 10));
        // Its first sample (no MOS) is in the progression but not in the average; highest is the MOS one.
        assert_eq!((b.samples, b.progression.len(), b.highest.mos_x10), (1, 2, b.lowest.mos_x10));
    }

    #[test]
    fn unusable_reports_give_no_round_trip_time() {
        let mut q = CallQuality::new();
        q.on_rtcp(&sr(A, 0xa000, &[]), S, WALL0, Some(8000));
        q.on_rtcp(&sr(B, 0xb000, &[]), S, WALL0, Some(8000));
        let rtt_of = |q: &CallQuality, who| q.ssrcs[&who].last_rtt_leg_us;
        // An LSR no SR had, a zero DLSR, a DLSR longer than the time since the SR, a 20 s RTT.
        for (lsr, dlsr, at) in [(0xdead, 100, 2 * S), (0xa000, 0, 2 * S), (0xa000, 3 * 65536, 2 * S), (0xa000, 1, 22 * S)] {
            q.on_rtcp(&rr(B, &[(A, 0, 0, 8, lsr, dlsr)]), at, WALL0, Some(8000));
            assert_eq!(rtt_of(&q, A), 0, "lsr {lsr:#x} dlsr {dlsr} at {at}");
        }
        // Without a clock rate, a block gives its leg's round-trip time but no sample.
        q.on_rtcp(&rr(A, &[(B, 0, 0, 8, 0xb000, 65536)]), 3 * S, WALL0, None);
        assert_eq!(rtt_of(&q, B), 1_000_000);
        assert!(q.ssrcs[&A].samples.is_empty() && q.ssrcs[&A].last_sample_ns.is_none());
        // Invalid RTCP changes nothing.
        let state = |q: &CallQuality| format!("{:?}", q.ssrcs.get(&A).map(|s| (&s.sender_reports, s.last_rtt_leg_us, &s.samples)));
        let before = state(&q);
        assert!(q.on_rtcp(&[0x80, 201, 0, 9, 1, 2, 3, 4], 4 * S, WALL0, Some(8000)).is_empty());
        assert_eq!(state(&q), before);
        assert_eq!(q.ssrcs.len(), 2);
    }

    #[test]
    fn a_long_call_keeps_samples_spanning_all_of_it() {
        let mut q = with_the_leg_towards_a_known();
        let n = 3 * MAX_SAMPLES as u64;
        for i in 0..n {
            q.on_rtcp(&rr(B, &[(A, 0, 0, 8, 0xa000, 65536)]), (2 + i) * S, WALL0 + i * 1_000_000, Some(8000));
        }
        let b = q.summary(B).unwrap();
        assert_eq!(b.samples, n, "the average covers every sample");
        let kept = &q.ssrcs[&B].samples;
        assert!(kept.len() <= MAX_SAMPLES && kept.len() >= MAX_SAMPLES / 2, "{}", kept.len());
        assert_eq!(kept.front().unwrap().reported_at_us, WALL0, "still from the start");
        assert!(kept.back().unwrap().reported_at_us >= WALL0 + (n - 2) * 1_000_000, "to the end");
        assert!((10..=12).contains(&b.progression.len()), "{}", b.progression.len());
    }

    #[test]
    fn samples_closer_than_a_second_are_not_kept_and_ssrcs_are_bounded() {
        let mut q = with_the_leg_towards_a_known();
        for i in 0..25u64 {
            // B every 400 ms: one in three (0, 1.2, 2.4 … s after its first) is kept.
            q.on_rtcp(&rr(B, &[(A, 0, 0, 8, 0xa000, 65536)]), S + 3_000_000 + i * 400_000_000, WALL0 + i * 400_000, Some(8000));
        }
        let b = q.summary(B).unwrap();
        assert_eq!(b.samples, 9);
        // The progression spans the kept samples: about ten, a tenth of the span apart.
        assert_eq!(b.progression_interval_s, 0);
        assert_eq!(b.progression.len(), 9);
        for i in 0..(MAX_SSRCS as u32 + 5) {
            q.on_rtcp(&sr(0x5000 + i, 1, &[]), 100 * S + i as u64, WALL0, Some(8000));
        }
        assert_eq!(q.ssrcs.len(), MAX_SSRCS);
        assert!(q.summary(B).is_none(), "the least recently heard went first");
    }
}
