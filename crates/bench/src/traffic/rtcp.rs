//! The RTCP a WebRTC endpoint sends beside its media (RFC 3550, RFC 4585), for parties that ask
//! for it ([`super::TrafficPlan::sender_with_reports`], [`super::TrafficPlan::receiver_with_feedback`]):
//!
//! * a **publisher**, per RTP stream (a simulcast layer is one), an SR with SDES CNAME every
//!   [`RTCP_INTERVAL`] (libwebrtc's video report interval), the first half an interval after
//!   the stream's start (as libwebrtc's RTCP sender): NTP time, the RTP timestamp of that
//!   instant, packet and octet counts;
//! * a **receiver**, per received stream (libwebrtc runs one RTCP sender per receive stream),
//!   an RR with SDES CNAME every [`RTCP_INTERVAL`], the first half an interval after the
//!   stream's first packet: extended
//!   highest sequence number, cumulative and fractional loss, jitter, LSR/DLSR of the last SR
//!   heard about the stream's SSRC (the SFU forwards the publisher's); for video (VP8), a PLI
//!   at the stream's first packet unless that starts a keyframe (the decoder cannot start
//!   elsewhere); a generic NACK for every gap in the RTP sequence numbers it sees, at most
//!   [`MAX_NACKS_PER_INTERVAL`] packets per stream and interval, gaps longer than
//!   [`MAX_NACK_GAP`] asked for with a PLI instead (video; once per interval at most).
//!
//! What it does not send: transport-wide congestion control feedback and REMB (a browser sends
//! those too, transport-cc every 50-100 ms), so the RTCP load here is a floor of a browser's.
//! Sequence numbers and SSRCs are the ones on the wire: what the SFU sent the receiver.

use std::collections::HashMap;

use mediaplane_core::call_quality::{build_report, parse_reports, ReportBlock};
use mediaplane_core::feedback::build;
use mediaplane_core::rtp::RtpHeader;
use serde::{Deserialize, Serialize};

/// Report interval of senders and receivers (libwebrtc's for video).
pub const RTCP_INTERVAL_NS: u64 = 1_000_000_000;
pub const RTCP_INTERVAL: std::time::Duration = std::time::Duration::from_nanos(RTCP_INTERVAL_NS);
/// NACKed packets per received stream and report interval, at most (a gap's NACK packet names up
/// to 17).
pub const MAX_NACKS_PER_INTERVAL: u32 = 64;
/// A gap longer than this is not NACKed (the frames are gone for a decoder): a PLI instead.
pub const MAX_NACK_GAP: u32 = 100;
/// SSRCs whose last SR a receiver remembers, at most.
const MAX_SR_SEEN: usize = 4096;
/// Seconds from 1900 (NTP) to 1970 (Unix).
const NTP_UNIX_OFFSET: u64 = 2_208_988_800;

/// The RTCP one receiver sent during a run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RtcpSent {
    /// Receiver reports (each a compound RR + SDES about one received stream).
    pub reports: u64,
    pub plis: u64,
    /// NACK packets (each names up to 17 sequence numbers).
    pub nacks: u64,
    /// Sequence numbers NACKed.
    pub nacked: u64,
    /// RTCP packets the socket refused (counted in none of the above).
    pub send_errors: u64,
}

impl RtcpSent {
    pub fn packets(&self) -> u64 {
        self.reports + self.plis + self.nacks
    }

    /// Count `kind` as sent (`ok`) or refused.
    pub(super) fn count(&mut self, kind: RtcpKind, ok: bool) {
        match (ok, kind) {
            (false, _) => self.send_errors += 1,
            (true, RtcpKind::Report) => self.reports += 1,
            (true, RtcpKind::Pli) => self.plis += 1,
            (true, RtcpKind::Nack(n)) => {
                self.nacks += 1;
                self.nacked += n as u64;
            }
        }
    }
}

/// What a receiver's RTCP packet is (its compound's message after the RR).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RtcpKind {
    Report,
    Pli,
    /// A NACK of this many sequence numbers.
    Nack(u32),
}

/// RTCP packets to send, with what each is.
pub(super) type Outbox = Vec<(RtcpKind, Vec<u8>)>;

/// 64-bit NTP timestamp of a Unix time in ns: (seconds, fraction).
pub fn ntp(unix_ns: i64) -> (u32, u32) {
    let ns = unix_ns.max(0) as u64;
    let secs = ns / 1_000_000_000 + NTP_UNIX_OFFSET;
    let frac = ((ns % 1_000_000_000) << 32) / 1_000_000_000;
    (secs as u32, frac as u32)
}

/// SDES with one chunk: `ssrc`'s CNAME, null-terminated and padded to 32 bits.
fn sdes_cname(ssrc: u32, cname: &str) -> Vec<u8> {
    let name = &cname.as_bytes()[..cname.len().min(255)];
    let mut chunk = ssrc.to_be_bytes().to_vec();
    chunk.extend_from_slice(&[1, name.len() as u8]);
    chunk.extend_from_slice(name);
    // The item list ends with a zero octet; pad with more to the 32-bit boundary.
    chunk.push(0);
    while !chunk.len().is_multiple_of(4) {
        chunk.push(0);
    }
    let mut p = vec![0x81, 202];
    p.extend_from_slice(&((chunk.len() / 4) as u16).to_be_bytes());
    p.extend_from_slice(&chunk);
    p
}

/// A publisher's compound SR + SDES CNAME (RFC 3550 6.4.1): no report blocks (it receives
/// nothing on this stream).
pub fn sender_report(ssrc: u32, ntp: (u32, u32), rtp_timestamp: u32, packets: u32, octets: u32, cname: &str) -> Vec<u8> {
    let mut p = vec![0x80, 200, 0, 6];
    for w in [ssrc, ntp.0, ntp.1, rtp_timestamp, packets, octets] {
        p.extend_from_slice(&w.to_be_bytes());
    }
    p.extend(sdes_cname(ssrc, cname));
    p
}

/// One received stream, as its receiver's RTCP sees it.
struct Stream {
    /// The SSRC on the wire (the SFU's for a simulcast consumer).
    ssrc: u32,
    clock_rate: u32,
    /// Extended sequence numbers (RFC 3550 A.1): the first, the highest.
    base: u32,
    max: u32,
    received: u64,
    /// At the last report, for its fraction lost.
    expected_prior: u64,
    received_prior: u64,
    next_report_ns: u64,
    /// NACKed sequence numbers and PLIs in the current interval, and when it ends.
    nacked_in_interval: u32,
    pli_in_interval: bool,
    interval_ends_ns: u64,
}

/// What one receiver's RTCP needs: its streams (by flow id) and the last SR of each SSRC.
pub(super) struct FeedbackState {
    ssrc: u32,
    cname: String,
    /// Reports are sent up to this time (the end of the media), monotonic ns.
    pub(super) until_ns: u64,
    streams: HashMap<u32, Stream>,
    /// SSRC → (NTP middle 32 bits, monotonic ns it arrived).
    last_sr: HashMap<u32, (u32, u64)>,
    pub(super) sent: RtcpSent,
}

impl FeedbackState {
    pub(super) fn new(ssrc: u32, cname: String, until_ns: u64) -> FeedbackState {
        FeedbackState { ssrc, cname, until_ns, streams: HashMap::new(), last_sr: HashMap::new(), sent: RtcpSent::default() }
    }

    /// An RTCP datagram arrived: remember the SRs in it (for LSR/DLSR).
    pub(super) fn on_rtcp(&mut self, d: &[u8], now_ns: u64) {
        let Some((srs, _)) = parse_reports(d) else { return };
        for sr in srs {
            if self.last_sr.len() < MAX_SR_SEEN || self.last_sr.contains_key(&sr.ssrc) {
                self.last_sr.insert(sr.ssrc, (sr.ntp_middle, now_ns));
            }
        }
    }

    /// An RTP packet of flow `flow` (clock `clock_rate`) arrived: the feedback it calls for (a
    /// PLI at a stream's start, NACKs for a gap), each a compound RR + message, pushed to `out`.
    /// `keyframe_start`: video (VP8) only, whether it is the first packet of a keyframe; a
    /// stream without keyframes (None) is never asked for one.
    pub(super) fn on_rtp(&mut self, flow: u32, clock_rate: u32, h: &RtpHeader, keyframe_start: Option<bool>, now_ns: u64, out: &mut Outbox) {
        let seq = h.sequence as u32;
        let s = match self.streams.get_mut(&flow) {
            Some(s) => s,
            None => {
                let s = Stream {
                    ssrc: h.ssrc,
                    clock_rate,
                    base: seq,
                    max: seq,
                    received: 1,
                    expected_prior: 0,
                    received_prior: 0,
                    next_report_ns: now_ns + RTCP_INTERVAL_NS / 2,
                    nacked_in_interval: 0,
                    pli_in_interval: false,
                    interval_ends_ns: now_ns + RTCP_INTERVAL_NS,
                };
                let s = self.streams.entry(flow).or_insert(s);
                if keyframe_start == Some(false) {
                    s.pli_in_interval = true;
                    out.push((RtcpKind::Pli, [build_report(self.ssrc, None, &[]), build::pli(self.ssrc, h.ssrc)].concat()));
                }
                return;
            }
        };
        if now_ns >= s.interval_ends_ns {
            (s.nacked_in_interval, s.pli_in_interval, s.interval_ends_ns) = (0, false, now_ns + RTCP_INTERVAL_NS);
        }
        s.ssrc = h.ssrc;
        s.received += 1;
        // Extended sequence number nearest the highest so far.
        let delta = (h.sequence.wrapping_sub(s.max as u16)) as i16;
        if delta <= 0 {
            return; // reordered or duplicate: nothing to ask for
        }
        let ext = s.max.wrapping_add(delta as u32);
        let gap = delta as u32 - 1;
        let first_missing = s.max.wrapping_add(1);
        s.max = ext;
        if gap == 0 {
            return;
        }
        if gap > MAX_NACK_GAP {
            if keyframe_start.is_some() && !s.pli_in_interval {
                s.pli_in_interval = true;
                out.push((RtcpKind::Pli, [build_report(self.ssrc, None, &[]), build::pli(self.ssrc, h.ssrc)].concat()));
            }
            return;
        }
        // One NACK packet per 17 missing numbers (packet id + 16-bit mask), within the budget.
        let budget = MAX_NACKS_PER_INTERVAL.saturating_sub(s.nacked_in_interval);
        let ask = gap.min(budget);
        let mut k = 0;
        while k < ask {
            let n = (ask - k).min(17);
            let pid = first_missing.wrapping_add(k) as u16;
            let blp = (0..n - 1).fold(0u16, |m, b| m | 1 << b);
            out.push((RtcpKind::Nack(n), [build_report(self.ssrc, None, &[]), build::nack(self.ssrc, h.ssrc, pid, blp)].concat()));
            k += n;
        }
        s.nacked_in_interval += ask;
    }

    /// Receiver reports due at `now_ns` (one compound RR + SDES per stream whose interval
    /// passed), pushed to `out`. `jitter_ns(flow)`: the stream's RFC 3550 jitter, ns.
    pub(super) fn due_reports(&mut self, now_ns: u64, jitter_ns: impl Fn(u32) -> f64, out: &mut Outbox) {
        if now_ns >= self.until_ns {
            return;
        }
        for (flow, s) in self.streams.iter_mut().filter(|(_, s)| now_ns >= s.next_report_ns) {
            s.next_report_ns += RTCP_INTERVAL_NS;
            let expected = s.max.wrapping_sub(s.base) as u64 + 1;
            let lost = expected as i64 - s.received as i64;
            let (exp_int, rec_int) = (expected - s.expected_prior, s.received - s.received_prior);
            (s.expected_prior, s.received_prior) = (expected, s.received);
            let lost_int = exp_int as i64 - rec_int as i64;
            let fraction_lost = if exp_int == 0 || lost_int <= 0 { 0 } else { ((lost_int << 8) / exp_int as i64).min(255) as u8 };
            let (lsr, dlsr) = match self.last_sr.get(&s.ssrc) {
                Some(&(mid, at)) => (mid, ((now_ns.saturating_sub(at) as u128 * 65_536) / 1_000_000_000) as u32),
                None => (0, 0),
            };
            let block = ReportBlock {
                reporter: self.ssrc,
                about: s.ssrc,
                fraction_lost,
                cumulative_lost: lost.clamp(-(1 << 23), (1 << 23) - 1) as i32,
                highest_seq: s.max,
                jitter: (jitter_ns(*flow) * s.clock_rate as f64 / 1e9) as u32,
                lsr,
                dlsr,
            };
            out.push((RtcpKind::Report, [build_report(self.ssrc, None, &[block]), sdes_cname(self.ssrc, &self.cname)].concat()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_core::rtp::{build_rtp, parse_rtcp_compound};

    fn rtp(seq: u16, ssrc: u32) -> RtpHeader {
        RtpHeader::parse(&build_rtp(100, seq, 0, ssrc, &[0; 30])).unwrap()
    }

    /// Sequence numbers a compound's NACKs name (RFC 4585 6.2.1).
    fn nacked(p: &[u8]) -> Vec<u16> {
        let pk = parse_rtcp_compound(p).unwrap();
        assert_eq!(pk[0].packet_type, 201, "a compound starts with an RR");
        let n = pk.iter().find(|x| x.packet_type == 205).unwrap().bytes;
        let (pid, blp) = (u16::from_be_bytes([n[12], n[13]]), u16::from_be_bytes([n[14], n[15]]));
        std::iter::once(pid).chain((0..16).filter(|b| blp & 1 << b != 0).map(|b| pid.wrapping_add(b + 1))).collect()
    }

    #[test]
    fn sender_report_reads_back() {
        let sr = sender_report(0x3000, ntp(1_700_000_000_500_000_000), 90_000, 10, 12_000, "10.0.0.2:5004");
        let pk = parse_rtcp_compound(&sr).unwrap();
        assert_eq!((pk[0].packet_type, pk[0].sender_ssrc, pk[1].packet_type, pk[1].sender_ssrc), (200, 0x3000, 202, 0x3000));
        let (srs, blocks) = parse_reports(&sr).unwrap();
        // Middle 32 bits: low 16 of the seconds, high 16 of the fraction (0.5 s = 0x8000...).
        assert_eq!((srs[0].ssrc, srs[0].ntp_middle & 0xffff), (0x3000, 0x8000));
        assert!(blocks.is_empty());
        assert_eq!(ntp(0), (NTP_UNIX_OFFSET as u32, 0));
    }

    #[test]
    fn a_receiver_asks_for_a_keyframe_and_lost_packets_and_reports() {
        let mut f = FeedbackState::new(0x4d50_0001, "rx".into(), u64::MAX);
        let mut out = Vec::new();
        // Starting on a keyframe: no PLI; elsewhere: one.
        f.on_rtp(1, 90_000, &rtp(65_530, 0xaa), Some(true), 0, &mut out);
        assert!(out.is_empty());
        f.on_rtp(2, 90_000, &rtp(7, 0xbb), Some(false), 0, &mut out);
        let (kind, pli) = out.pop().unwrap();
        assert_eq!(kind, RtcpKind::Pli);
        let pk = parse_rtcp_compound(&pli).unwrap();
        assert_eq!((pk[1].packet_type, pk[1].count, &pk[1].bytes[8..12]), (206, 1, &0xbb_u32.to_be_bytes()[..]));
        // In order, across the wrap: nothing. A gap of 3 across the wrap: one NACK of all three.
        f.on_rtp(1, 90_000, &rtp(65_531, 0xaa), Some(false), 1, &mut out);
        f.on_rtp(1, 90_000, &rtp(65_535, 0xaa), Some(false), 2, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(nacked(&out.pop().unwrap().1), [65_532, 65_533, 65_534]);
        f.on_rtp(1, 90_000, &rtp(20, 0xaa), Some(false), 3, &mut out);
        assert_eq!(out.len(), 2, "20 missing: 17 + 3");
        assert_eq!((out[0].0, out[1].0), (RtcpKind::Nack(17), RtcpKind::Nack(3)));
        assert_eq!(nacked(&out[0].1), (0..17).collect::<Vec<u16>>());
        assert_eq!(nacked(&out[1].1), [17, 18, 19]);
        out.clear();
        // A late packet of the gap asks for nothing (and counts as received).
        f.on_rtp(1, 90_000, &rtp(5, 0xaa), Some(false), 4, &mut out);
        assert!(out.is_empty());
        // The budget: 64 per interval (23 used); a gap beyond MAX_NACK_GAP is a PLI.
        f.on_rtp(1, 90_000, &rtp(80, 0xaa), Some(false), 5, &mut out);
        assert_eq!(out.iter().map(|p| nacked(&p.1).len()).sum::<usize>(), 41, "the budget's rest");
        out.clear();
        f.on_rtp(1, 90_000, &rtp(81 + 200, 0xaa), Some(false), 6, &mut out);
        assert_eq!(parse_rtcp_compound(&out.pop().unwrap().1).unwrap()[1].packet_type, 206);

        // The SFU's SR about 0xaa, then the report a second after the first packet.
        f.on_rtcp(&sender_report(0xaa, (5, 0x1234_0000), 0, 0, 0, "pub"), RTCP_INTERVAL_NS / 4);
        f.due_reports(RTCP_INTERVAL_NS / 2 - 1, |_| 0.0, &mut out);
        assert!(out.is_empty(), "not due yet");
        f.due_reports(RTCP_INTERVAL_NS / 2, |flow| if flow == 1 { 1e6 } else { 0.0 }, &mut out);
        assert_eq!(out.len(), 2, "one report per stream");
        let (_, blocks) = out.iter().map(|p| parse_reports(&p.1).unwrap()).find(|(_, b)| b[0].about == 0xaa).unwrap();
        let b = blocks[0];
        // 65_530 to 281 after one wrap: 288 expected, 7 received (65_530, 65_531, 65_535, 20, 5, 80, 281).
        assert_eq!(b.highest_seq, 65_536 + 281);
        let expected = 65_536 + 281 - 65_530 + 1;
        assert_eq!(b.cumulative_lost, expected - 7);
        assert_eq!(b.fraction_lost, (((expected - 7) << 8) / expected) as u8);
        assert_eq!((b.jitter, b.lsr, b.dlsr), (90, (5 << 16) | 0x1234, 16_384), "1 ms = 90 ticks; a quarter second since the SR");
        // The next a whole interval later.
        f.due_reports(RTCP_INTERVAL_NS * 3 / 2 - 1, |_| 0.0, &mut out);
        assert_eq!(out.len(), 2);
        f.due_reports(RTCP_INTERVAL_NS * 3 / 2, |_| 0.0, &mut out);
        assert_eq!(out.len(), 4);
        // Nothing after the media's end.
        let mut f = FeedbackState::new(1, "rx".into(), 10);
        f.on_rtp(1, 90_000, &rtp(1, 0xaa), Some(true), 0, &mut out);
        out.clear();
        f.due_reports(RTCP_INTERVAL_NS, |_| 0.0, &mut out);
        assert!(out.is_empty());
    }
    /// Through loopback: a VP8 publisher's SRs and an audio flow without, one receiver of both
    /// sending its RTCP to a stand-in SFU socket.
    #[test]
    fn loopback_parties_send_their_rtcp() {
        use super::super::{run, Feedback, Profile, TrafficPlan};
        use std::net::UdpSocket;
        let bind = || UdpSocket::bind("127.0.0.1:0").unwrap();
        let (rx, sfu) = (bind(), bind());
        let to_rx = rx.local_addr().unwrap();
        let feedback = Feedback { ssrc: 0x4d50_0000, to: sfu.local_addr().unwrap() };
        let plan = TrafficPlan::new(std::time::Duration::from_millis(2500))
            .sender_with_reports(bind(), to_rx, 3000, Profile::simulcast_layer(0))
            .sender(bind(), to_rx, 42, Profile::voice())
            .receiver_with_feedback("rx", rx, [3000, 42], feedback);
        let report = run(&plan).unwrap();
        let json = serde_json::to_string_pretty(&report).unwrap();
        // SRs at 0.5 s and 1.5 s of the VP8 flow's 2.5 s, none of the other; both reached the receiver.
        assert_eq!((report.senders[0].sender_reports, report.senders[1].sender_reports), (2, 0), "{json}");
        let r = &report.receivers[0];
        assert_eq!((r.rtcp, r.malformed, r.unexpected), (2, 0, 0), "{json}");
        // An RR per stream half a second after its first packet and a second later; no PLI (the VP8 flow
        // starts on a keyframe, voice has none), no NACK (nothing lost).
        assert_eq!(r.rtcp_sent, RtcpSent { reports: 4, ..Default::default() }, "{json}");
        assert_eq!(report.totals.rtcp_sent, 6, "{json}");
        sfu.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 1500];
        let mut blocks = Vec::new();
        while let Ok(n) = sfu.recv(&mut buf) {
            let (srs, b) = parse_reports(&buf[..n]).unwrap();
            assert!(srs.is_empty() && b.len() == 1 && b[0].reporter == 0x4d50_0000, "{b:?}");
            blocks.push(b[0]);
        }
        assert_eq!(blocks.len(), 4);
        for ssrc in [3000, 42] {
            let of: Vec<&ReportBlock> = blocks.iter().filter(|b| b.about == ssrc).collect();
            assert_eq!(of.len(), 2, "{blocks:?}");
            assert!(of.iter().all(|b| b.cumulative_lost == 0 && b.fraction_lost == 0), "{of:?}");
            assert!(of[1].highest_seq > of[0].highest_seq, "{of:?}");
        }
        // The VP8 stream's second report echoes an SR it heard (LSR: the one at 0.5 s or, if it
        // came first, at 1.5 s), voice's none.
        let last = |ssrc| blocks.iter().rev().find(|b| b.about == ssrc).unwrap();
        assert!(last(3000).lsr != 0 && last(3000).dlsr < 2 * 65_536, "{blocks:?}");
        assert_eq!(last(42).lsr, 0);
    }
    #[test]
    fn rtcp_needs_plain_rtp() {
        use super::super::{run, Feedback, Profile, TrafficPlan};
        use std::net::UdpSocket;
        let bind = || UdpSocket::bind("127.0.0.1:0").unwrap();
        let to = bind().local_addr().unwrap();
        let short = std::time::Duration::from_millis(10);
        let e = run(&TrafficPlan::new(short).sender_with_reports(bind(), to, 1, Profile::thesis())).unwrap_err();
        assert!(e.to_string().contains("sender reports need plain RTP"), "{e}");
        let feedback = Feedback { ssrc: 9, to };
        let e = run(&TrafficPlan::new(short).sender(bind(), to, 1, Profile::thesis()).receiver_with_feedback("rx", bind(), [1], feedback)).unwrap_err();
        assert!(e.to_string().contains("feedback needs plain RTP flows"), "{e}");
    }
}
