//! Transport-wide congestion-control feedback for a publisher's transport
//! (draft-holmer-rmcat-transport-wide-cc-extensions-01): which of its transport-wide sequence
//! numbers arrived, and when. A browser's send-side estimate grows only on this feedback (or on
//! REMB); without it a publisher stays at its start bitrate for the whole call.
//!
//! Sans-I/O, as the rest of core: [`TransportFeedback::on_packet`] records an arrival,
//! [`TransportFeedback::poll_timeout`] says when the next feedback is due and
//! [`TransportFeedback::handle_timeout`] builds it (RTCP transport feedback, PT 205 FMT 15).
//!
//! Every number from the first not yet reported to the highest heard is reported, received or
//! lost, once; a packet arriving after its number was reported lost stays lost (the sender's
//! loss estimate sees it as such, as libwebrtc's own receiver does once its window moved on).

use std::collections::BTreeMap;

/// The URI of the transport-wide sequence number header extension.
pub const TRANSPORT_CC_URI: &str = "http://www.ietf.org/id/draft-holmer-rmcat-transport-wide-cc-extensions-01";

/// How often feedback goes to a sending transport: libwebrtc's receivers send it every 50 to
/// 250 ms depending on the rate; 100 ms keeps it under 1 % of a 1 Mbit/s uplink.
pub const FEEDBACK_INTERVAL_NS: u64 = 100_000_000;

/// Arrivals kept for one transport before feedback is sent early: bounds the memory a flood
/// can take, and bounds one feedback packet (see [`MAX_STATUSES`]).
pub const MAX_PENDING: usize = 512;

/// A gap longer than this before the first number heard is not reported number by number: the
/// sender restarted its numbering, or the gap is not worth a feedback packet of losses.
const MAX_REPORTED_GAP: i64 = 512;

/// Numbers one feedback packet reports at most (received or lost): with [`MAX_PENDING`] deltas
/// of two bytes it stays under 1,400 bytes.
const MAX_STATUSES: usize = 1_024;

/// Receive deltas are in 250 µs ticks; the reference time in 64 ms units (256 ticks).
const TICK_NS: u64 = 250_000;
const TICKS_PER_REFERENCE: i64 = 256;
/// The reference time is 24 bits.
const REFERENCE_MASK: i64 = (1 << 24) - 1;

const RTPFB: u8 = 205;
const FMT_TRANSPORT_CC: u8 = 15;

/// What one transport's receiver keeps between feedbacks.
#[derive(Debug, Default, Clone)]
pub struct TransportFeedback {
    /// The last number heard, unwrapped (16-bit numbers extended with the wraps seen).
    last: Option<i64>,
    /// Arrivals not yet reported: unwrapped number → arrival (ns, the caller's monotonic clock).
    pending: BTreeMap<i64, u64>,
    /// The first number not yet reported.
    next: Option<i64>,
    /// The feedback packet count field: one more with every packet sent.
    count: u8,
    /// When the next feedback is due (None: nothing to report).
    due_ns: Option<u64>,
    /// Packets that arrived after their number was reported lost, or twice.
    pub late: u64,
    /// Feedback packets built.
    pub sent: u64,
}

impl TransportFeedback {
    pub fn new() -> TransportFeedback {
        TransportFeedback::default()
    }

    /// A packet with transport-wide sequence number `seq` arrived at `arrival_ns`.
    pub fn on_packet(&mut self, seq: u16, arrival_ns: u64) {
        let unwrapped = match self.last {
            None => i64::from(seq),
            Some(last) => last + i64::from(seq.wrapping_sub(last as u16) as i16),
        };
        self.last = Some(self.last.map_or(unwrapped, |l| l.max(unwrapped)));
        if self.next.is_some_and(|n| unwrapped < n) || self.pending.contains_key(&unwrapped) {
            self.late += 1;
            return;
        }
        self.pending.insert(unwrapped, arrival_ns);
        let due = if self.pending.len() >= MAX_PENDING { arrival_ns } else { arrival_ns + FEEDBACK_INTERVAL_NS };
        self.due_ns = Some(self.due_ns.map_or(due, |d| d.min(due)));
    }

    /// When [`TransportFeedback::handle_timeout`] has something to send (None: nothing heard
    /// since the last feedback).
    pub fn poll_timeout(&self) -> Option<u64> {
        self.due_ns
    }

    /// The feedback due at `now_ns`, from `sender_ssrc` (the SFU's) about `media_ssrc` (one of
    /// the transport's streams; receivers read the numbers, not this): one RTCP packet each, in
    /// order. Empty when nothing is due.
    pub fn handle_timeout(&mut self, now_ns: u64, sender_ssrc: u32, media_ssrc: u32) -> Vec<Vec<u8>> {
        if self.due_ns.is_none_or(|d| now_ns < d) {
            return Vec::new();
        }
        self.due_ns = None;
        let mut out = Vec::new();
        while let Some((&first, _)) = self.pending.first_key_value() {
            let base = match self.next {
                Some(n) if first - n <= MAX_REPORTED_GAP => n,
                _ => first,
            };
            let (packet, next) = self.build(base, sender_ssrc, media_ssrc);
            // The first arrival always fits (its delta is under 64 ms, its gap under
            // MAX_STATUSES), so every packet reports at least one.
            debug_assert!(next > first);
            self.pending = self.pending.split_off(&next);
            self.next = Some(next);
            self.count = self.count.wrapping_add(1);
            self.sent += 1;
            out.push(packet);
        }
        out
    }

    /// One feedback packet from number `base` on, with as many of the pending arrivals as its
    /// deltas and size allow; and the first number it does not report.
    fn build(&self, base: i64, sender_ssrc: u32, media_ssrc: u32) -> (Vec<u8>, i64) {
        let first_arrival = *self.pending.values().next().expect("called with arrivals pending");
        let reference = (first_arrival / TICK_NS) as i64 / TICKS_PER_REFERENCE;
        let mut previous = reference * TICKS_PER_REFERENCE;
        // One symbol a number: 0 not received, 1 a one-byte delta, 2 a two-byte delta.
        let mut symbols: Vec<u8> = Vec::new();
        let mut deltas: Vec<i16> = Vec::new();
        let mut next = base;
        for (&seq, &arrival) in &self.pending {
            let delta = (arrival / TICK_NS) as i64 - previous;
            let Ok(delta) = i16::try_from(delta) else { break }; // the next packet starts anew
            if symbols.len() + (seq - next) as usize + 1 > MAX_STATUSES {
                break;
            }
            symbols.resize(symbols.len() + (seq - next) as usize, 0);
            symbols.push(if (0..=255).contains(&delta) { 1 } else { 2 });
            deltas.push(delta);
            previous += i64::from(delta);
            next = seq + 1;
        }
        let mut p = vec![0x80 | FMT_TRANSPORT_CC, RTPFB, 0, 0];
        p.extend_from_slice(&sender_ssrc.to_be_bytes());
        p.extend_from_slice(&media_ssrc.to_be_bytes());
        p.extend_from_slice(&(base as u16).to_be_bytes());
        p.extend_from_slice(&(symbols.len() as u16).to_be_bytes());
        p.extend_from_slice(&((reference & REFERENCE_MASK) as u32).to_be_bytes()[1..]);
        p.push(self.count);
        for chunk in chunks(&symbols) {
            p.extend_from_slice(&chunk.to_be_bytes());
        }
        for d in deltas {
            match u8::try_from(d) {
                Ok(small) => p.push(small),
                Err(_) => p.extend_from_slice(&d.to_be_bytes()),
            }
        }
        // Padded to 32 bits as RTCP requires: P set, the last byte the padding's length.
        let padding = (4 - p.len() % 4) % 4;
        if padding > 0 {
            p.resize(p.len() + padding - 1, 0);
            p.push(padding as u8);
            p[0] |= 0x20;
        }
        let words = (p.len() / 4 - 1) as u16;
        p[2..4].copy_from_slice(&words.to_be_bytes());
        (p, next)
    }
}

/// The packet status chunks for `symbols`: a run-length chunk for 14 or more of a kind, else a
/// one-bit vector of 14 (received or not) or a two-bit vector of 7. A vector chunk's slots past
/// the last number are zero (receivers read as many statuses as the count says).
fn chunks(symbols: &[u8]) -> Vec<u16> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < symbols.len() {
        let run = symbols[i..].iter().take(0x1fff).take_while(|&&s| s == symbols[i]).count();
        if run >= 14 {
            out.push(u16::from(symbols[i]) << 13 | run as u16);
            i += run;
            continue;
        }
        let ahead = &symbols[i..symbols.len().min(i + 14)];
        if ahead.iter().all(|&s| s <= 1) {
            let bits = ahead.iter().enumerate().fold(0u16, |c, (k, &s)| c | u16::from(s) << (13 - k));
            out.push(0x8000 | bits);
            i += ahead.len();
        } else {
            let ahead = &ahead[..ahead.len().min(7)];
            let bits = ahead.iter().enumerate().fold(0u16, |c, (k, &s)| c | u16::from(s) << (12 - 2 * k));
            out.push(0xc000 | bits);
            i += ahead.len();
        }
    }
    out
}

/// A REMB (draft-alvestrand-rmcat-remb-03) from `sender_ssrc`: `bps` is the most the
/// transport sending `ssrcs` should send (browsers cap their send-side estimate at it).
pub fn remb(sender_ssrc: u32, bps: u64, ssrcs: &[u32]) -> Vec<u8> {
    let ssrcs = &ssrcs[..ssrcs.len().min(255)];
    // An 18-bit mantissa and a 6-bit exponent: the value rounded down to what they can say.
    let exp = (64 - bps.leading_zeros()).saturating_sub(18);
    let mantissa = (bps >> exp) as u32;
    let mut p = vec![0x80 | 15, 206, 0, (4 + ssrcs.len()) as u8];
    p.extend_from_slice(&sender_ssrc.to_be_bytes());
    p.extend_from_slice(&[0; 4]); // media SSRC: unused
    p.extend_from_slice(b"REMB");
    p.push(ssrcs.len() as u8);
    p.extend_from_slice(&((exp << 18 | mantissa) & 0xff_ffff).to_be_bytes()[1..]);
    for s in ssrcs {
        p.extend_from_slice(&s.to_be_bytes());
    }
    p
}

/// The transport-wide sequence number a packet carries in extension element `id`, if any.
pub fn sequence_of(header: &crate::rtp::RtpHeader, packet: &[u8], id: u8) -> Option<u16> {
    let elements = header.extension_elements(packet).ok()?;
    let (_, data) = elements.into_iter().find(|(i, _)| *i == id)?;
    Some(u16::from_be_bytes([*data.first()?, *data.get(1)?]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What a receiver of `packet` reads: (base, fb count, reference, [(seq, arrival in ticks
    /// since reference or None)]), decoded independently of [`chunks`] by the draft's rules.
    fn decode(packet: &[u8]) -> (u16, u8, i64, Vec<(u16, Option<i64>)>) {
        assert_eq!((packet[0] & 0xdf, packet[1]), (0x80 | FMT_TRANSPORT_CC, RTPFB));
        assert_eq!((u16::from_be_bytes([packet[2], packet[3]]) as usize + 1) * 4, packet.len(), "length field");
        let end = if packet[0] & 0x20 != 0 { packet.len() - *packet.last().unwrap() as usize } else { packet.len() };
        let base = u16::from_be_bytes([packet[12], packet[13]]);
        let count = u16::from_be_bytes([packet[14], packet[15]]) as usize;
        let reference = i64::from(u32::from_be_bytes([0, packet[16], packet[17], packet[18]]));
        let mut sizes = Vec::new();
        let mut at = 20;
        while sizes.len() < count {
            let c = u16::from_be_bytes([packet[at], packet[at + 1]]);
            at += 2;
            let left = count - sizes.len();
            match (c >> 15, (c >> 14) & 1) {
                (0, _) => sizes.extend(std::iter::repeat_n((c >> 13 & 3) as u8, (c & 0x1fff) as usize).take(left)),
                (_, 0) => sizes.extend((0..14).map(|k| (c >> (13 - k) & 1) as u8).take(left)),
                _ => sizes.extend((0..7).map(|k| (c >> (12 - 2 * k) & 3) as u8).take(left)),
            }
        }
        let mut t = reference * TICKS_PER_REFERENCE;
        let mut out = Vec::new();
        for (k, s) in sizes.into_iter().enumerate() {
            let seq = base.wrapping_add(k as u16);
            match s {
                0 => out.push((seq, None)),
                1 => {
                    t += i64::from(packet[at]);
                    at += 1;
                    out.push((seq, Some(t)));
                }
                2 => {
                    t += i64::from(i16::from_be_bytes([packet[at], packet[at + 1]]));
                    at += 2;
                    out.push((seq, Some(t)));
                }
                _ => panic!("reserved symbol"),
            }
        }
        assert!(end - at < 4, "only padding after the deltas");
        (base, packet[19], reference, out)
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn nothing_heard_nothing_sent() {
        let mut f = TransportFeedback::new();
        assert_eq!(f.poll_timeout(), None);
        assert!(f.handle_timeout(10 * FEEDBACK_INTERVAL_NS, 1, 2).is_empty());
    }

    #[test]
    fn arrivals_and_losses_are_reported_once_each_interval() {
        let mut f = TransportFeedback::new();
        let t0 = 5_000 * MS;
        for (seq, at) in [(100u16, t0), (101, t0 + 2 * MS), (103, t0 + 5 * MS), (102, t0 + 6 * MS)] {
            f.on_packet(seq, at);
        }
        assert_eq!(f.poll_timeout(), Some(t0 + FEEDBACK_INTERVAL_NS));
        assert!(f.handle_timeout(t0 + 50 * MS, 1, 2).is_empty(), "not due yet");
        let sent = f.handle_timeout(t0 + FEEDBACK_INTERVAL_NS, 1, 2);
        let (base, count, reference, statuses) = decode(&sent[0]);
        assert_eq!((sent.len(), base, count), (1, 100, 0));
        let ticks = |at: u64| (at / TICK_NS) as i64;
        assert_eq!(reference * TICKS_PER_REFERENCE, ticks(t0) / 256 * 256);
        // 102 arrived after 103: its delta is negative from 103's.
        assert_eq!(statuses, vec![(100, Some(ticks(t0))), (101, Some(ticks(t0 + 2 * MS))), (102, Some(ticks(t0 + 6 * MS))), (103, Some(ticks(t0 + 5 * MS)))]);
        assert_eq!(f.poll_timeout(), None, "all reported");
        // 104 lost, 105 heard: the next feedback starts where this one ended.
        f.on_packet(105, t0 + 120 * MS);
        f.on_packet(103, t0 + 121 * MS); // a duplicate of a reported number
        let sent = f.handle_timeout(t0 + 300 * MS, 1, 2);
        let (base, count, _, statuses) = decode(&sent[0]);
        assert_eq!((base, count, statuses.len(), statuses[0].1, statuses[1].1.is_some()), (104, 1, 2, None, true));
        assert_eq!(f.late, 1);
    }

    #[test]
    fn numbers_wrap_and_a_restart_does_not_report_a_long_gap() {
        let mut f = TransportFeedback::new();
        f.on_packet(65_534, MS);
        f.on_packet(1, 2 * MS);
        let (base, _, _, statuses) = decode(&f.handle_timeout(200 * MS, 1, 2)[0]);
        assert_eq!((base, statuses.len()), (65_534, 4), "65534, 65535 (lost), 0 (lost), 1");
        f.on_packet(30_000, 300 * MS);
        let (base, _, _, statuses) = decode(&f.handle_timeout(500 * MS, 1, 2)[0]);
        assert_eq!((base, statuses.len()), (30_000, 1));
    }

    #[test]
    fn a_delta_beyond_two_bytes_starts_a_new_packet() {
        let mut f = TransportFeedback::new();
        f.on_packet(1, MS);
        f.on_packet(2, MS + 9_000 * MS); // 36,000 ticks: more than an i16
        let sent = f.handle_timeout(10_000 * MS, 1, 2);
        assert_eq!(sent.len(), 2);
        let (first, second) = (decode(&sent[0]), decode(&sent[1]));
        assert_eq!((first.0, first.3.len(), second.0, second.3.len()), (1, 1, 2, 1));
        assert_eq!((first.1, second.1), (0, 1), "feedback counts go up");
    }

    #[test]
    fn a_flood_is_reported_early_and_in_bounded_packets() {
        let mut f = TransportFeedback::new();
        for seq in 0..MAX_PENDING as u16 {
            f.on_packet(seq * 2, MS); // every other number lost
        }
        assert_eq!(f.poll_timeout(), Some(MS), "due at once");
        let sent = f.handle_timeout(MS, 1, 2);
        assert!(sent.iter().all(|p| p.len() <= 1_400), "{:?}", sent.iter().map(Vec::len).collect::<Vec<_>>());
        let reported: usize = sent.iter().map(|p| decode(p).3.iter().filter(|s| s.1.is_some()).count()).sum();
        assert_eq!(reported, MAX_PENDING);
    }

    /// What webrtc-rs's `rtcp` crate (a parser the project did not write) reads of `packet`:
    /// (seq, arrival in µs since its reference) per number reported.
    fn decode_with_rtcp_crate(packet: &[u8]) -> Vec<(u16, Option<i64>)> {
        use rtcp::transport_feedbacks::transport_layer_cc::{PacketStatusChunk, SymbolTypeTcc, TransportLayerCc};
        use webrtc_util::Unmarshal;
        let mut buf = packet;
        let p = TransportLayerCc::unmarshal(&mut buf).expect("a valid transport feedback");
        let mut symbols = Vec::new();
        for c in &p.packet_chunks {
            match c {
                PacketStatusChunk::RunLengthChunk(r) => symbols.extend(std::iter::repeat_n(r.packet_status_symbol, r.run_length as usize)),
                PacketStatusChunk::StatusVectorChunk(v) => symbols.extend(v.symbol_list.iter().copied()),
            }
        }
        symbols.truncate(p.packet_status_count as usize);
        let mut t = i64::from(p.reference_time) * 64_000;
        let mut deltas = p.recv_deltas.iter();
        let mut out = Vec::new();
        for (k, s) in symbols.into_iter().enumerate() {
            let seq = p.base_sequence_number.wrapping_add(k as u16);
            if s == SymbolTypeTcc::PacketNotReceived {
                out.push((seq, None));
            } else {
                t += deltas.next().expect("a delta for every packet received").delta;
                out.push((seq, Some(t)));
            }
        }
        assert!(deltas.next().is_none());
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2_000, ..Default::default() })]
        /// Whatever arrives (gaps, reordering, duplicates, long silences, wraps), each number
        /// heard is reported received exactly once with its arrival to the tick, as an
        /// independent parser reads it, and nothing heard goes unreported.
        #[test]
        fn every_arrival_is_reported_once_to_the_tick(
            start in proptest::prelude::any::<u16>(),
            steps in proptest::collection::vec((-3i32..40, 0u64..2_000_000_000, proptest::prelude::any::<bool>()), 1..600),
        ) {
            let mut f = TransportFeedback::new();
            let (mut seq, mut at) = (start, 1_000_000_000u64);
            let mut heard: std::collections::HashMap<u16, u64> = std::collections::HashMap::new();
            let mut reported: std::collections::HashMap<u16, i64> = std::collections::HashMap::new();
            let poll = |f: &mut TransportFeedback, now: u64, reported: &mut std::collections::HashMap<u16, i64>| {
                for p in f.handle_timeout(now, 1, 2) {
                    proptest::prop_assert!(p.len() <= 1_400);
                    for (s, t) in decode_with_rtcp_crate(&p) {
                        if let Some(t) = t {
                            proptest::prop_assert!(reported.insert(s, t).is_none(), "{s} reported received twice");
                        }
                    }
                }
                Ok(())
            };
            for (step, gap, check) in steps {
                seq = seq.wrapping_add(step as u16);
                // Mostly a packet every few ms, sometimes seconds of silence.
                at += if gap > 1_900_000_000 { gap * 5 } else { gap % 20_000_000 };
                let late = f.late;
                f.on_packet(seq, at);
                if f.late == late {
                    heard.insert(seq, at);
                }
                if check {
                    poll(&mut f, at, &mut reported)?;
                }
            }
            poll(&mut f, u64::MAX, &mut reported)?;
            proptest::prop_assert_eq!(reported.len(), heard.len());
            for (s, at) in heard {
                // The crate reads µs; the tick is 250 µs.
                proptest::prop_assert_eq!(reported.get(&s).copied(), Some((at / TICK_NS) as i64 * 250 % ((1 << 24) * 64_000)), "seq {}", s);
            }
        }
    }

    /// REMB as webrtc-rs's parser reads it: the bitrate (rounded down to 18 significant bits)
    /// and the SSRCs.
    #[test]
    fn remb_says_the_ceiling_for_the_ssrcs() {
        use rtcp::payload_feedbacks::receiver_estimated_maximum_bitrate::ReceiverEstimatedMaximumBitrate;
        use webrtc_util::Unmarshal;
        for (bps, expect) in [(400_000u64, 400_000f32), (10_000_000_000, 9_999_941_632.0), (262_143, 262_143.0), (30_000, 30_000.0)] {
            let p = remb(7, bps, &[1, 2]);
            let r = ReceiverEstimatedMaximumBitrate::unmarshal(&mut &p[..]).unwrap();
            assert_eq!((r.sender_ssrc, r.bitrate, r.ssrcs), (7, expect, vec![1, 2]), "{bps}");
        }
    }

    #[test]
    fn the_sequence_number_is_read_from_either_extension_form() {
        use crate::rtp::RtpHeader;
        // One-byte form: id 3, length 2 (L=1), then padding.
        let mut one = vec![0x90, 96, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0xbe, 0xde, 0, 1, 0x31, 0x12, 0x34, 0];
        one.extend_from_slice(b"payload");
        let h = RtpHeader::parse(&one).unwrap();
        assert_eq!((sequence_of(&h, &one, 3), sequence_of(&h, &one, 4)), (Some(0x1234), None));
        let mut two = vec![0x90, 96, 0, 1, 0, 0, 0, 0, 0, 0, 0, 9, 0x10, 0x00, 0, 1, 5, 2, 0xab, 0xcd];
        two.extend_from_slice(b"payload");
        let h = RtpHeader::parse(&two).unwrap();
        assert_eq!(sequence_of(&h, &two, 5), Some(0xabcd));
    }
}
