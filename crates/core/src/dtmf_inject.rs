//! Putting RFC 4733 DTMF events into a party's audio (NG `play DTMF`), as the party's own
//! packets carry them: see [`crate::model::DtmfEvent`]. Sans-I/O, one [`Injector`] per stream,
//! driven by the stream's RTP packets (their timestamps are its clock).

use crate::model::DtmfEvent;
use crate::rtp::RtpHeader;

/// End packets sent per event (RFC 4733 §2.5.1.4: three, for loss).
const END_PACKETS: u8 = 3;

/// Where one stream's events stand.
#[derive(Debug, Default, Clone)]
pub struct Injector {
    /// The last event played to its end (ids only grow).
    done: u32,
    playing: Option<Playing>,
    /// After an event: audio passes until this timestamp (the pause before the next).
    pause_until: Option<u32>,
    /// The party's previous timestamp and its packet time in timestamp units.
    last_ts: Option<u32>,
    step: u32,
}

#[derive(Debug, Clone, Copy)]
struct Playing {
    id: u32,
    start_ts: u32,
    /// End packets sent, and the duration they all carry.
    ends: u8,
    end_duration: u16,
}

impl Injector {
    /// The packet to send instead of `packet` (an RTP packet of the stream, `header` parsed
    /// from it), or None: send it as it is. `events`: the stream's queue; `clock_rate` its RTP
    /// clock (0: unknown, 8 kHz).
    pub fn rewrite(&mut self, events: &[DtmfEvent], clock_rate: u32, header: &RtpHeader, packet: &[u8]) -> Option<Vec<u8>> {
        let rate = if clock_rate == 0 { 8000 } else { clock_rate };
        let ts = header.timestamp;
        // The packet time, from consecutive timestamps (a jump of over a second is a new start).
        let delta = self.last_ts.map(|l| ts.wrapping_sub(l)).filter(|d| (1..=rate).contains(d));
        self.step = delta.unwrap_or(if self.step == 0 { rate / 50 } else { self.step });
        self.last_ts = Some(ts);
        if let Some(until) = self.pause_until {
            if (ts.wrapping_sub(until) as i32) < 0 {
                return None;
            }
            self.pause_until = None;
        }
        let mut p = match self.playing {
            Some(p) => p,
            None => {
                let next = events.iter().find(|e| e.id > self.done)?;
                Playing { id: next.id, start_ts: ts, ends: 0, end_duration: 0 }
            }
        };
        // An event taken off the queue (it expired) is not finished.
        let Some(event) = events.iter().find(|e| e.id == p.id) else {
            self.playing = None;
            self.done = p.id;
            return None;
        };
        let total = (u64::from(event.duration_ms) * u64::from(rate) / 1000).clamp(1, 0xffff) as u32;
        let covered = ts.wrapping_sub(p.start_ts).saturating_add(self.step);
        let first = self.playing.is_none();
        let end = p.ends > 0 || covered >= total;
        if end && p.ends == 0 {
            p.end_duration = covered.min(0xffff) as u16;
        }
        let duration = if end { p.end_duration } else { covered as u16 };
        if end {
            p.ends += 1;
        }
        if p.ends >= END_PACKETS {
            self.playing = None;
            self.done = p.id;
            self.pause_until = Some(ts.wrapping_add(self.step).wrapping_add((u64::from(event.pause_ms) * u64::from(rate) / 1000) as u32));
        } else {
            self.playing = Some(p);
        }
        Some(event_packet(header, packet, event, p.start_ts, first, end, duration))
    }
}

/// `packet`'s header (SSRC, sequence number, CSRCs, extensions kept) carrying the event: its
/// payload type, the event's start as timestamp, the marker on its first packet, no padding.
fn event_packet(header: &RtpHeader, packet: &[u8], event: &DtmfEvent, start_ts: u32, first: bool, end: bool, duration: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(header.payload_offset + 4);
    out.extend_from_slice(&packet[..header.payload_offset]);
    out[0] &= !0x20;
    out[1] = (u8::from(first) << 7) | (event.payload_type & 0x7f);
    out[4..8].copy_from_slice(&start_ts.to_be_bytes());
    let [hi, lo] = duration.to_be_bytes();
    out.extend_from_slice(&[event.code, (u8::from(end) << 7) | (event.volume & 0x3f), hi, lo]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtp::build_rtp;

    fn event(id: u32, code: u8, duration_ms: u32, pause_ms: u32) -> DtmfEvent {
        DtmfEvent { id, code, volume: 8, duration_ms, pause_ms, payload_type: 101, queued_ms: 0 }
    }

    /// Feed `n` A-law packets 20 ms apart from `seq0`; what leaves: (seq, pt, marker, ts, payload).
    fn feed(inj: &mut Injector, events: &[DtmfEvent], seq0: u16, n: u16) -> Vec<(u16, u8, bool, u32, Vec<u8>)> {
        (seq0..seq0 + n)
            .map(|seq| {
                let p = build_rtp(8, seq, 1000 + u32::from(seq) * 160, 7, &[0xd5; 160]);
                let h = RtpHeader::parse(&p).unwrap();
                let out = inj.rewrite(events, 8000, &h, &p).unwrap_or(p);
                let h = RtpHeader::parse(&out).unwrap();
                (h.sequence, h.payload_type, out[1] & 0x80 != 0, h.timestamp, out[h.payload_offset..].to_vec())
            })
            .collect()
    }

    #[test]
    fn an_event_replaces_the_partys_packets_for_its_duration_then_ends_three_times() {
        let mut inj = Injector::default();
        // 100 ms: five 20 ms packets of event, the fifth the first end packet, two more ends.
        let out = feed(&mut inj, &[event(1, 5, 100, 0)], 0, 10);
        let events: Vec<_> = out.iter().filter(|o| o.1 == 101).collect();
        assert_eq!(events.len(), 7);
        assert!(events.iter().all(|e| e.3 == 1000), "every packet of the event carries its start");
        assert_eq!(events.iter().map(|e| e.2).collect::<Vec<_>>(), [true, false, false, false, false, false, false], "the marker on the first");
        let durations: Vec<u16> = events.iter().map(|e| u16::from_be_bytes([e.4[2], e.4[3]])).collect();
        assert_eq!(durations, [160, 320, 480, 640, 800, 800, 800]);
        let ends: Vec<bool> = events.iter().map(|e| e.4[1] & 0x80 != 0).collect();
        assert_eq!(ends, [false, false, false, false, true, true, true]);
        assert!(events.iter().all(|e| e.4[0] == 5 && e.4[1] & 0x3f == 8));
        // Sequence numbers run on untouched; audio comes back after.
        assert_eq!(out.iter().map(|o| o.0).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
        assert!(out[7..].iter().all(|o| o.1 == 8 && o.4 == vec![0xd5; 160]));
    }

    #[test]
    fn queued_events_play_in_order_with_their_pause_and_once() {
        let mut inj = Injector::default();
        let queue = [event(3, 1, 60, 40), event(4, 2, 60, 0)];
        let out = feed(&mut inj, &queue, 0, 14);
        let codes: Vec<(u8, u32)> = out.iter().filter(|o| o.1 == 101).map(|o| (o.4[0], o.3)).collect();
        // 3 packets of '1' (the third ends) + 2 more ends; 40 ms of audio; then '2'.
        assert_eq!(codes.iter().filter(|c| c.0 == 1).count(), 5);
        assert_eq!(codes.iter().filter(|c| c.0 == 2).count(), 5);
        let first_two = out.iter().position(|o| o.1 == 101 && o.4[0] == 2).unwrap();
        assert_eq!(out[5..first_two].iter().filter(|o| o.1 == 8).count(), 2, "40 ms of pause: two packets of audio");
        // Played once: the same queue later plays nothing.
        assert!(feed(&mut inj, &queue, 14, 10).iter().all(|o| o.1 == 8));
        // An event taken off the queue mid-way stops it.
        let mut inj = Injector::default();
        feed(&mut inj, &[event(9, 3, 1000, 0)], 0, 3);
        assert!(feed(&mut inj, &[], 3, 3).iter().all(|o| o.1 == 8));
    }
}
