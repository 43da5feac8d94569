//! Native traffic generator and receivers.
//!
//! [`run`] drives one sender thread (all flows, paced on absolute deadlines) and one receiver
//! thread (epoll over all receiver sockets, kernel receive timestamps), then reports per copy
//! (flow × receiver) loss, duplicates, reordering, one-way delay, RFC 3550 jitter and RFC 4689
//! delay variation. Two threads whatever the plan's size: fits a 2-core machine.
//!
//! # Wire format
//!
//! * **RTP** ([`PayloadFormat::Rtp`]): 12-byte RTP header (V=2, PT, seq, timestamp, SSRC = flow
//!   id), then the 16-byte probe (harness sequence u64 BE, send time u64 BE in CLOCK_REALTIME
//!   ns), zero padding up to the profile's size. The harness sequence (0, 1, 2, ...) is what loss
//!   accounting uses, so an SFU that rewrites RTP sequence numbers does not disturb it.
//! * **VP8 simulcast layer** ([`PayloadFormat::Vp8`], PT [`VP8_PAYLOAD_TYPE`]): the RTP header,
//!   a 4-byte VP8 payload descriptor (RFC 7741: X, S at a frame's first packet, I with a 15-bit
//!   picture id = the frame number), one VP8 payload header byte (inverse key frame bit: a
//!   keyframe every `keyframe_every` frames), then the probe with the flow id (u32 BE) after it:
//!   an SFU that forwards a simulcast layer under another SSRC, renumbered, leaves it intact.
//! * **Raw** ([`PayloadFormat::Raw`], the thesis preset): harness sequence u64 BE, send time
//!   u64 BE, flow id u16 BE: 18 bytes of UDP payload = a 46-byte IP packet, the smallest Ethernet
//!   payload. Its first byte is 0 (sequence < 2⁵⁶), so it never looks like RTP (RFC 7983).
//!
//! # Timing
//!
//! Send time is read (CLOCK_REALTIME) immediately before `sendto`; receive time is the kernel's
//! SO_TIMESTAMPNS stamp, taken when the packet enters the receiving namespace's device
//! (`net.core.netdev_tstamp_prequeue=1`), so receiver wake-up latency is not counted. Sender and
//! receivers share one clock (same machine), so one-way delay = receive − send is valid.
//! Pacing: `clock_nanosleep(TIMER_ABSTIME)` to `spin` before each deadline (timer slack 1 ns),
//! then busy-wait; per-burst lateness is reported.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap, HashSet};
use std::io;
use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, ensure};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};
use socket2::{SockAddr, SockRef};

use crate::qos::{DelayVariation, EModel, Rfc3550Jitter, SeqTracker, Summary, ValueRecorder};
use mediaplane_dataplane::srtp::{Context as SrtpContext, SrtpDrop};
use mediaplane_dataplane::sys::Epoll;
pub use rtcp::{RtcpSent, RTCP_INTERVAL};

pub mod rtcp;

pub const RTP_HEADER_LEN: usize = 12;
/// Harness sequence + send time.
pub const PROBE_LEN: usize = 16;
/// Raw probe: sequence + send time + flow id (u16).
pub const RAW_PROBE_LEN: usize = 18;
pub const MIN_RTP_PACKET: usize = RTP_HEADER_LEN + PROBE_LEN;
/// The payload type that marks [`PayloadFormat::Vp8`] packets (decoding needs no plan).
pub const VP8_PAYLOAD_TYPE: u8 = 100;
/// VP8 payload descriptor (X, I, 15-bit picture id) + the payload header's first byte.
const VP8_PREFIX_LEN: usize = 5;
/// The VP8 probe: sequence + send time + flow id (u32).
const VP8_PROBE_LEN: usize = PROBE_LEN + 4;
pub const MIN_VP8_PACKET: usize = RTP_HEADER_LEN + VP8_PREFIX_LEN + VP8_PROBE_LEN;
/// Largest UDP payload over IPv4.
pub const MAX_PACKET: usize = 65_507;

// Bounds that keep every run finite and its memory small.
pub const MAX_DURATION: Duration = Duration::from_secs(3600);
pub const MAX_DRAIN: Duration = Duration::from_secs(10);
pub const MAX_PLANNED_PACKETS: u64 = 50_000_000;
pub const MAX_PACKETS_PER_SEC: f64 = 1_000_000.0;
/// A sender more than this late gives up its remaining bursts (they are reported `not_sent`).
pub const MAX_LATENESS: Duration = Duration::from_secs(1);

// ---------------------------------------------------------------------------------------------
// Profiles and presets
// ---------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PayloadFormat {
    /// Sequence + send time + flow id only (flow ids must fit in 16 bits).
    Raw,
    /// RTP header + probe; `clock_rate` drives the RTP timestamp.
    Rtp { payload_type: u8, clock_rate: u32 },
    /// One simulcast layer of VP8 video (90 kHz, PT [`VP8_PAYLOAD_TYPE`]): a burst is a frame,
    /// every `keyframe_every`-th frame (the first included) a keyframe.
    Vp8 { keyframe_every: u32 },
}

/// What one sender sends: packets of `packet_size` UDP payload bytes, `packets_per_sec` on
/// average, grouped into `bursts_per_sec` evenly spaced bursts (a burst = a video frame; voice
/// has one packet per burst). Packets per burst vary by one so the average rate is exact.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub name: String,
    pub format: PayloadFormat,
    pub packet_size: usize,
    pub packets_per_sec: f64,
    pub bursts_per_sec: f64,
}

impl Profile {
    /// The thesis' probe: 25 packets/s of the smallest frame carrying sequence and timestamp
    /// (18-byte raw UDP payload, 46-byte IP packet), non-RTP.
    pub fn thesis() -> Profile {
        Profile { name: "thesis".into(), format: PayloadFormat::Raw, packet_size: RAW_PROBE_LEN, packets_per_sec: 25.0, bursts_per_sec: 25.0 }
    }

    /// G.711 µ-law, 20 ms packetization: 50 packets/s of 172 bytes (12 RTP + 160 payload), PT 0.
    pub fn voice() -> Profile {
        Profile {
            name: "voice".into(),
            format: PayloadFormat::Rtp { payload_type: 0, clock_rate: 8000 },
            packet_size: RTP_HEADER_LEN + 160,
            packets_per_sec: 50.0,
            bursts_per_sec: 50.0,
        }
    }

    /// Video: 1.5 Mbit/s of RTP payload+header in 1200-byte packets, sent as 30 frames/s bursts
    /// (5.2 packets per frame on average), PT 96, 90 kHz clock.
    pub fn video() -> Profile {
        Profile {
            name: "video".into(),
            format: PayloadFormat::Rtp { payload_type: 96, clock_rate: 90_000 },
            packet_size: 1200,
            packets_per_sec: 0.0,
            bursts_per_sec: 30.0,
        }
        .with_bitrate(1_500_000.0)
    }

    /// Layer `layer` (0-2) of a three-layer VP8 simulcast publisher at 30 frames/s, a keyframe
    /// a second: 0 ≈ 150 kbit/s (one 600-byte packet a frame), 1 ≈ 500 kbit/s (two of 1,000
    /// bytes), 2 ≈ 1.5 Mbit/s (1,200-byte packets, 5.2 a frame), what browsers send for 180p,
    /// 360p and 720p.
    pub fn simulcast_layer(layer: u8) -> Profile {
        let (packet_size, packets_per_sec) = match layer {
            0 => (600, 30.0),
            1 => (1000, 60.0),
            _ => (1200, 1_500_000.0 / 8.0 / 1200.0),
        };
        Profile { name: format!("vp8-l{layer}"), format: PayloadFormat::Vp8 { keyframe_every: 30 }, packet_size, packets_per_sec, bursts_per_sec: 30.0 }
    }

    /// Set the UDP-payload bit rate, keeping packet size and burst rate.
    pub fn with_bitrate(mut self, bits_per_sec: f64) -> Profile {
        self.packets_per_sec = bits_per_sec / 8.0 / self.packet_size as f64;
        self
    }

    /// Set the packet rate. A one-packet-per-burst profile (thesis, voice) stays one packet per
    /// burst; a burst profile (video) keeps its burst rate and grows its bursts.
    pub fn with_rate(mut self, packets_per_sec: f64) -> Profile {
        if self.packets_per_sec == self.bursts_per_sec {
            self.bursts_per_sec = packets_per_sec;
        }
        self.packets_per_sec = packets_per_sec;
        self
    }

    pub fn bitrate(&self) -> f64 {
        self.packets_per_sec * self.packet_size as f64 * 8.0
    }

    /// Bursts sent in `duration` (burst k leaves at k / bursts_per_sec, all before `duration`).
    pub fn burst_count(&self, duration: Duration) -> u64 {
        // The epsilon keeps e.g. 0.29 s × 100/s from flooring to 28.
        (duration.as_secs_f64() * self.bursts_per_sec + 1e-6).floor().max(0.0) as u64
    }

    fn packets_per_burst(&self) -> f64 {
        self.packets_per_sec / self.bursts_per_sec
    }

    /// Packets in burst `k`: floor((k+1)·r) − floor(k·r), r = packets per burst. Telescopes, so
    /// the bursts of a run add up to exactly [`Profile::planned_packets`].
    pub fn packets_in_burst(&self, k: u64) -> u64 {
        let r = self.packets_per_burst();
        ((k + 1) as f64 * r).floor() as u64 - (k as f64 * r).floor() as u64
    }

    pub fn planned_packets(&self, duration: Duration) -> u64 {
        (self.burst_count(duration) as f64 * self.packets_per_burst()).floor() as u64
    }

    fn validate(&self) -> anyhow::Result<()> {
        let min = match self.format {
            PayloadFormat::Raw => RAW_PROBE_LEN,
            PayloadFormat::Rtp { .. } => MIN_RTP_PACKET,
            PayloadFormat::Vp8 { keyframe_every } => {
                ensure!(keyframe_every > 0, "profile {}: keyframe_every must be positive", self.name);
                MIN_VP8_PACKET
            }
        };
        ensure!((min..=MAX_PACKET).contains(&self.packet_size), "profile {}: packet_size {} outside {min}..={MAX_PACKET}", self.name, self.packet_size);
        ensure!(
            self.packets_per_sec.is_finite() && self.packets_per_sec > 0.0 && self.packets_per_sec <= MAX_PACKETS_PER_SEC,
            "profile {}: packets_per_sec {} outside (0, {MAX_PACKETS_PER_SEC}]",
            self.name,
            self.packets_per_sec
        );
        ensure!(
            self.bursts_per_sec.is_finite() && self.bursts_per_sec > 0.0 && self.bursts_per_sec <= self.packets_per_sec,
            "profile {}: bursts_per_sec {} outside (0, packets_per_sec]",
            self.name,
            self.bursts_per_sec
        );
        Ok(())
    }
}

/// The named presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Preset {
    Thesis,
    Voice,
    Video,
}

impl Preset {
    pub fn profile(self) -> Profile {
        match self {
            Preset::Thesis => Profile::thesis(),
            Preset::Voice => Profile::voice(),
            Preset::Video => Profile::video(),
        }
    }
}

impl FromStr for Preset {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> anyhow::Result<Preset> {
        match s {
            "thesis" => Ok(Preset::Thesis),
            "voice" => Ok(Preset::Voice),
            "video" => Ok(Preset::Video),
            _ => bail!("unknown preset {s:?} (thesis, voice, video)"),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Probe encoding
// ---------------------------------------------------------------------------------------------

/// What a receiver learns from one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Probe {
    pub flow_id: u32,
    pub seq: u64,
    pub send_ns: i64,
}

/// RTP header fields of one packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RtpFields {
    pub payload_type: u8,
    pub marker: bool,
    pub sequence: u16,
    pub timestamp: u32,
    pub ssrc: u32,
}

/// Write a raw probe into the first 18 bytes of `buf` (the rest is left as is: padding).
pub fn encode_raw(buf: &mut [u8], flow_id: u16, seq: u64, send_ns: i64) {
    buf[0..8].copy_from_slice(&seq.to_be_bytes());
    buf[8..16].copy_from_slice(&(send_ns as u64).to_be_bytes());
    buf[16..18].copy_from_slice(&flow_id.to_be_bytes());
}

/// Write an RTP header and the probe into the first 28 bytes of `buf`.
pub fn encode_rtp(buf: &mut [u8], rtp: RtpFields, seq: u64, send_ns: i64) {
    buf[0] = 0x80; // V=2, no padding, no extension, no CSRC
    buf[1] = (rtp.marker as u8) << 7 | (rtp.payload_type & 0x7f);
    buf[2..4].copy_from_slice(&rtp.sequence.to_be_bytes());
    buf[4..8].copy_from_slice(&rtp.timestamp.to_be_bytes());
    buf[8..12].copy_from_slice(&rtp.ssrc.to_be_bytes());
    buf[12..20].copy_from_slice(&seq.to_be_bytes());
    buf[20..28].copy_from_slice(&(send_ns as u64).to_be_bytes());
}

/// Write the VP8 descriptor (picture id `picture_id`, S at a frame's first packet), the payload
/// header's first byte (P = 0 on a keyframe's first packet) and the probe after the RTP header
/// [`encode_rtp`] wrote: `buf[12..12 + 25]`.
pub fn encode_vp8(buf: &mut [u8], frame_start: bool, keyframe: bool, picture_id: u16, flow_id: u32, seq: u64, send_ns: i64) {
    let b = &mut buf[RTP_HEADER_LEN..];
    b[0] = 0x80 | if frame_start { 0x10 } else { 0 }; // X, S, partition 0
    b[1] = 0x80; // I: a picture id follows
    b[2..4].copy_from_slice(&(0x8000 | (picture_id & 0x7fff)).to_be_bytes()); // M: 15 bits
    b[4] = if keyframe && frame_start { 0x00 } else { 0x01 }; // inverse key frame flag
    let p = &mut b[VP8_PREFIX_LEN..];
    p[0..8].copy_from_slice(&seq.to_be_bytes());
    p[8..16].copy_from_slice(&(send_ns as u64).to_be_bytes());
    p[16..20].copy_from_slice(&flow_id.to_be_bytes());
}

/// Whether a datagram is RTCP (RFC 5761 4: version 2, packet type 192-223): a keyframe request
/// or report an SFU sends a publisher, counted apart from malformed probes.
pub fn is_rtcp(d: &[u8]) -> bool {
    d.len() >= 8 && d[0] >> 6 == 2 && (192..=223).contains(&d[1])
}

/// Decode a probe: RTP (version 2 in the first byte; the probe starts at the RTP payload, so
/// CSRCs or header extensions added on the way are tolerated; a VP8 layer's after its
/// descriptor, with its flow id, as its SSRC may be the SFU's) or raw.
pub fn decode_probe(d: &[u8]) -> Option<Probe> {
    let be64 = |b: &[u8]| u64::from_be_bytes(b[..8].try_into().unwrap());
    if d.first()? >> 6 == 2 {
        let h = mediaplane_core::rtp::RtpHeader::parse(d).ok()?;
        if h.payload_type == VP8_PAYLOAD_TYPE {
            let prefix = d.get(h.payload_offset..h.payload_offset + VP8_PREFIX_LEN)?;
            // Exactly the descriptor encode_vp8 writes (an SFU rewrites its picture id in place).
            if prefix[0] & 0x80 == 0 || prefix[1] != 0x80 || prefix[2] & 0x80 == 0 {
                return None;
            }
            let at = h.payload_offset + VP8_PREFIX_LEN;
            let p = d.get(at..at + VP8_PROBE_LEN)?;
            return Some(Probe { flow_id: u32::from_be_bytes(p[16..20].try_into().unwrap()), seq: be64(&p[0..8]), send_ns: be64(&p[8..16]) as i64 });
        }
        let p = d.get(h.payload_offset..h.payload_offset + PROBE_LEN)?;
        Some(Probe { flow_id: h.ssrc, seq: be64(&p[0..8]), send_ns: be64(&p[8..16]) as i64 })
    } else {
        let p = d.get(..RAW_PROBE_LEN)?;
        Some(Probe { flow_id: u16::from_be_bytes([p[16], p[17]]) as u32, seq: be64(&p[0..8]), send_ns: be64(&p[8..16]) as i64 })
    }
}

// ---------------------------------------------------------------------------------------------
// Plan and report
// ---------------------------------------------------------------------------------------------

/// One flow: `profile` packets from `socket` to `dest`. `flow_id` is the SSRC (RTP) or the
/// 16-bit sender id (raw); unique within a plan. Several flows may share a socket through
/// `UdpSocket::try_clone`.
#[derive(Debug)]
pub struct SenderSpec {
    /// Shared, so one socket can send a flow and receive its peer's (one fd per party port).
    pub socket: Arc<UdpSocket>,
    pub dest: SocketAddr,
    pub flow_id: u32,
    pub profile: Profile,
    /// Protect every packet with this SRTP session before sending (an SDES-SRTP party); the
    /// protect time is inside the measured one-way delay, and reported on its own.
    pub srtp: Option<Arc<SrtpContext>>,
    /// Send an RTCP SR (+ SDES CNAME) about this flow to `dest` every [`RTCP_INTERVAL`], as a
    /// browser's RTP sender does ([`rtcp`]). RTP formats only, not with `srtp`.
    pub sender_reports: bool,
}

/// A receiving socket and the flows it should get; anything else is counted `unexpected`.
/// [`run`] raises its receive buffer and enables SO_TIMESTAMPNS on it; reading uses
/// MSG_DONTWAIT so the socket's blocking mode is untouched. Datagrams queued before the run
/// are discarded.
#[derive(Debug)]
pub struct ReceiverSpec {
    pub label: String,
    pub socket: Arc<UdpSocket>,
    pub expects: Vec<u32>,
    /// Unprotect every datagram with this SRTP session before reading it (after its kernel
    /// receive time was taken); one that fails is counted `srtp_failed`.
    pub srtp: Option<Arc<SrtpContext>>,
    /// Send the RTCP a browser's receive streams send ([`rtcp`]: an RR per received stream
    /// every [`RTCP_INTERVAL`], a PLI at a start off a keyframe, NACKs for gaps) from `socket`.
    /// RTP flows only, not with `srtp`.
    pub feedback: Option<Feedback>,
}

/// Where a receiver's RTCP goes and whom it speaks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Feedback {
    /// The receiver's own SSRC (the sender SSRC of its RTCP).
    pub ssrc: u32,
    /// Where it sends its RTCP (the SFU address its media comes from: RTCP multiplexed).
    pub to: SocketAddr,
}

#[derive(Debug)]
pub struct TrafficPlan {
    pub senders: Vec<SenderSpec>,
    pub receivers: Vec<ReceiverSpec>,
    /// Sending time.
    pub duration: Duration,
    /// How long receivers keep listening after the last send (ends earlier once every expected
    /// copy is complete and `settle` has passed).
    pub drain: Duration,
    /// After the last send, the earliest time receivers may stop even if complete: late
    /// duplicates or strays in this window are still counted.
    pub settle: Duration,
    /// Busy-wait margin before each send deadline.
    pub spin: Duration,
    /// Time between [`run`] starting and the first deadline (receiver thread start-up).
    pub lead: Duration,
    /// Spread senders' first bursts evenly over one interval instead of sending all at once.
    pub stagger: bool,
}

impl TrafficPlan {
    pub fn new(duration: Duration) -> TrafficPlan {
        TrafficPlan {
            senders: Vec::new(),
            receivers: Vec::new(),
            duration,
            drain: Duration::from_millis(500),
            settle: Duration::from_millis(30),
            spin: Duration::from_micros(20),
            lead: Duration::from_millis(20),
            stagger: true,
        }
    }

    pub fn sender(mut self, socket: impl Into<Arc<UdpSocket>>, dest: SocketAddr, flow_id: u32, profile: Profile) -> TrafficPlan {
        self.senders.push(SenderSpec { socket: socket.into(), dest, flow_id, profile, srtp: None, sender_reports: false });
        self
    }

    /// [`TrafficPlan::sender`] that also sends an RTCP SR about its flow every [`RTCP_INTERVAL`].
    pub fn sender_with_reports(mut self, socket: impl Into<Arc<UdpSocket>>, dest: SocketAddr, flow_id: u32, profile: Profile) -> TrafficPlan {
        self.senders.push(SenderSpec { socket: socket.into(), dest, flow_id, profile, srtp: None, sender_reports: true });
        self
    }

    /// [`TrafficPlan::sender`] of SRTP: every packet protected with `srtp` (an outbound session).
    pub fn srtp_sender(mut self, socket: impl Into<Arc<UdpSocket>>, dest: SocketAddr, flow_id: u32, profile: Profile, srtp: Arc<SrtpContext>) -> TrafficPlan {
        self.senders.push(SenderSpec { socket: socket.into(), dest, flow_id, profile, srtp: Some(srtp), sender_reports: false });
        self
    }

    pub fn receiver(mut self, label: impl Into<String>, socket: impl Into<Arc<UdpSocket>>, expects: impl IntoIterator<Item = u32>) -> TrafficPlan {
        self.receivers.push(ReceiverSpec { label: label.into(), socket: socket.into(), expects: expects.into_iter().collect(), srtp: None, feedback: None });
        self
    }

    /// [`TrafficPlan::receiver`] that sends a browser's RTCP about what it receives to `feedback.to`.
    pub fn receiver_with_feedback(
        mut self,
        label: impl Into<String>,
        socket: impl Into<Arc<UdpSocket>>,
        expects: impl IntoIterator<Item = u32>,
        feedback: Feedback,
    ) -> TrafficPlan {
        let expects = expects.into_iter().collect();
        self.receivers.push(ReceiverSpec { label: label.into(), socket: socket.into(), expects, srtp: None, feedback: Some(feedback) });
        self
    }

    /// [`TrafficPlan::receiver`] of SRTP: every datagram unprotected with `srtp` (an inbound session).
    pub fn srtp_receiver(
        mut self,
        label: impl Into<String>,
        socket: impl Into<Arc<UdpSocket>>,
        expects: impl IntoIterator<Item = u32>,
        srtp: Arc<SrtpContext>,
    ) -> TrafficPlan {
        self.receivers.push(ReceiverSpec {
            label: label.into(),
            socket: socket.into(),
            expects: expects.into_iter().collect(),
            srtp: Some(srtp),
            feedback: None,
        });
        self
    }

    fn validate(&self) -> anyhow::Result<HashMap<u32, u64>> {
        ensure!(!self.duration.is_zero() && self.duration <= MAX_DURATION, "duration {:?} outside (0, {MAX_DURATION:?}]", self.duration);
        ensure!(self.drain <= MAX_DRAIN, "drain {:?} above {MAX_DRAIN:?}", self.drain);
        ensure!(self.spin <= Duration::from_millis(1) && self.lead <= Duration::from_secs(1), "spin at most 1 ms, lead at most 1 s");
        let mut planned = HashMap::new();
        let mut total = 0u64;
        for s in &self.senders {
            s.profile.validate()?;
            if s.profile.format == PayloadFormat::Raw {
                ensure!(s.flow_id <= u16::MAX as u32, "flow {}: raw flows need 16-bit flow ids", s.flow_id);
            }
            if s.sender_reports {
                ensure!(s.profile.format != PayloadFormat::Raw && s.srtp.is_none(), "flow {}: sender reports need plain RTP (not raw, not SRTP)", s.flow_id);
            }
            let n = s.profile.planned_packets(self.duration);
            ensure!(planned.insert(s.flow_id, n).is_none(), "flow id {} used twice", s.flow_id);
            total += n;
        }
        ensure!(total <= MAX_PLANNED_PACKETS, "plan sends {total} packets, limit {MAX_PLANNED_PACKETS}");
        for r in &self.receivers {
            for f in &r.expects {
                ensure!(planned.contains_key(f), "receiver {} expects flow {f}, which no sender sends", r.label);
                if r.feedback.is_some() {
                    let raw = self.senders.iter().any(|s| s.flow_id == *f && s.profile.format == PayloadFormat::Raw);
                    ensure!(!raw && r.srtp.is_none(), "receiver {}: feedback needs plain RTP flows (flow {f})", r.label);
                }
            }
        }
        Ok(planned)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct SenderReport {
    pub flow_id: u32,
    pub dest: SocketAddr,
    pub profile: String,
    pub planned: u64,
    pub sent: u64,
    pub sent_bytes: u64,
    /// sendto failures (e.g. EAGAIN with a full socket buffer, no route).
    pub send_errors: u64,
    /// Packets given up because the sender fell more than [`MAX_LATENESS`] behind.
    pub not_sent: u64,
    /// Per burst: actual send start − deadline, ns.
    pub lateness_ns: Summary,
    /// SRTP senders: the time protecting one packet took (inside the one-way delay), ns.
    #[serde(default)]
    pub srtp_protect_ns: Option<Summary>,
    /// SRTP senders: packets libsrtp refused to protect (not sent; counted in `send_errors` too).
    #[serde(default)]
    pub srtp_protect_failed: u64,
    /// RTCP SRs sent ([`SenderSpec::sender_reports`]), and those the socket refused.
    #[serde(default)]
    pub sender_reports: u64,
    #[serde(default)]
    pub rtcp_send_errors: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReceiverReport {
    pub label: String,
    pub local_addr: Option<SocketAddr>,
    /// Every datagram read during the run.
    pub datagrams: u64,
    /// Well-formed probes of flows this receiver does not expect (an SFU leak or echo).
    pub unexpected: u64,
    pub unexpected_flows: Vec<u32>,
    /// Datagrams that are not probes, or truncated.
    pub malformed: u64,
    /// RTCP datagrams (e.g. an SFU's keyframe requests to a publisher): not probes, not malformed.
    #[serde(default)]
    pub rtcp: u64,
    /// SRTP receivers: datagrams that failed to unprotect (authentication, not SRTP).
    #[serde(default)]
    pub srtp_failed: u64,
    /// SRTP receivers: datagrams libsrtp refused as replays (a duplicate on the way; its probe
    /// is unreadable, so it is not in the copy's `duplicates`).
    #[serde(default)]
    pub srtp_replayed: u64,
    /// Packets without a kernel timestamp, stamped in user space instead.
    pub user_timestamps: u64,
    /// The RTCP it sent ([`ReceiverSpec::feedback`]).
    #[serde(default)]
    pub rtcp_sent: RtcpSent,
}

/// One copy = one (flow, receiver) pair.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CopyReport {
    pub flow_id: u32,
    /// Index into [`TrafficReport::receivers`].
    pub receiver: usize,
    pub receiver_label: String,
    pub sent: u64,
    /// Unique packets received.
    pub received: u64,
    pub bytes: u64,
    pub lost: u64,
    pub loss_percent: f64,
    pub duplicates: u64,
    pub reordered: u64,
    /// Probes with a sequence number the sender never used.
    pub out_of_range: u64,
    /// One-way delay of unique packets, ns.
    pub delay_ns: Summary,
    /// RFC 3550 interarrival jitter in ns (see [`Rfc3550Jitter`]).
    pub jitter_ns: f64,
    /// RFC 4689 |delay(i) − delay(i−1)|, ns.
    pub delay_variation_ns: Summary,
    /// G.113 burst ratio of the loss pattern; `None` without loss.
    pub burst_ratio: Option<f64>,
    /// E-model MOS as if this copy were G.711 voice ([`EModel::G711`]) with the measured mean
    /// one-way delay, loss and burst ratio (no codec or jitter-buffer delay added).
    pub mos_g711: f64,
    /// Packets whose receive time preceded their send time (clock step): counted as delay 0.
    pub negative_delays: u64,
    /// The full one-way delay distribution (ns), for added delay; not serialized.
    #[serde(skip, default = "empty_histogram")]
    pub delay_histogram: Histogram<u64>,
}

fn empty_histogram() -> Histogram<u64> {
    ValueRecorder::new().histogram
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Totals {
    pub sent: u64,
    /// Σ over copies of the flow's sent packets: what perfect delivery would bring.
    pub expected_copies: u64,
    pub received: u64,
    pub lost: u64,
    pub duplicates: u64,
    pub reordered: u64,
    pub unexpected: u64,
    pub malformed: u64,
    #[serde(default)]
    pub srtp_failed: u64,
    #[serde(default)]
    pub srtp_replayed: u64,
    pub send_errors: u64,
    /// RTCP packets sent: senders' SRs and receivers' RRs, PLIs and NACKs.
    #[serde(default)]
    pub rtcp_sent: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TrafficReport {
    pub started_unix_ns: i64,
    /// First deadline → last send, ns.
    pub send_duration_ns: u64,
    pub senders: Vec<SenderReport>,
    pub receivers: Vec<ReceiverReport>,
    pub copies: Vec<CopyReport>,
    pub totals: Totals,
    /// CPU time of the sender thread (CLOCK_THREAD_CPUTIME_ID), ns.
    pub generator_cpu_ns: u64,
    pub receiver_cpu_ns: u64,
    /// Busy time of all CPUs while the plan ran (/proc/stat: everything but idle and iowait):
    /// the generator and whatever it drives, the kernel's softirq packet work included, which
    /// runs in whichever task raised it (mostly the sender) and so is in no process's CPU
    /// time. Meaningful only with `spin` zero: a spinning sender is busy by construction.
    #[serde(default)]
    pub machine_busy_ns: u64,
}

impl TrafficReport {
    pub fn copy(&self, flow_id: u32, receiver: usize) -> Option<&CopyReport> {
        self.copies.iter().find(|c| c.flow_id == flow_id && c.receiver == receiver)
    }

    pub fn copy_by_label(&self, flow_id: u32, receiver_label: &str) -> Option<&CopyReport> {
        self.copies.iter().find(|c| c.flow_id == flow_id && c.receiver_label == receiver_label)
    }
}

// ---------------------------------------------------------------------------------------------
// run
// ---------------------------------------------------------------------------------------------

/// Execute a plan: send every flow, receive on every receiver, report. Blocks for about
/// `lead + duration + settle` (complete delivery) up to `lead + duration + drain`.
pub fn run(plan: &TrafficPlan) -> anyhow::Result<TrafficReport> {
    let planned = plan.validate()?;
    for r in &plan.receivers {
        prepare_receiver(&r.socket)?;
    }
    let flow_index: HashMap<u32, usize> = plan.senders.iter().enumerate().map(|(i, s)| (s.flow_id, i)).collect();
    let shared =
        Shared { sent: plan.senders.iter().map(|_| AtomicU64::new(0)).collect(), sender_done: AtomicBool::new(false), sender_done_at: AtomicU64::new(0) };
    // Every flow's and copy's statistics exist before the clock starts: with thousands of flows
    // their histograms are gigabytes, and building them must not eat into the first sends.
    let sender_accs = new_sender_accs(plan);
    let receiver_accs = new_receiver_accs(plan, &planned);
    let busy0 = machine_busy_ns();
    let started_unix_ns = realtime_ns();
    let t0 = monotonic_ns() + plan.lead.as_nanos() as u64;

    let (sender_out, receiver_out) = std::thread::scope(|scope| {
        let receiver = scope.spawn(|| receive_loop(plan, receiver_accs, &flow_index, &shared, t0));
        let sender = scope.spawn(|| send_loop(plan, sender_accs, &shared, t0));
        let sender_out = sender.join();
        // Whatever happened to the sender, let the receiver finish its drain.
        if !shared.sender_done.load(Ordering::Acquire) {
            shared.sender_done_at.store(monotonic_ns(), Ordering::Release);
            shared.sender_done.store(true, Ordering::Release);
        }
        (sender_out, receiver.join())
    });
    let busy = machine_busy_ns().saturating_sub(busy0);
    let sender_out = sender_out.unwrap_or_else(|p| std::panic::resume_unwind(p));
    let receiver_out = receiver_out.unwrap_or_else(|p| std::panic::resume_unwind(p))?;
    let mut report = build_report(plan, started_unix_ns, sender_out, receiver_out);
    report.machine_busy_ns = busy;
    Ok(report)
}

/// Busy time of all CPUs since boot, ns: the `cpu` line of /proc/stat without idle and iowait
/// (guest time is inside user). 0 where /proc/stat is unreadable.
pub fn machine_busy_ns() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    // cpu user nice system idle iowait irq softirq steal ...
    let ticks: u64 = stat
        .lines()
        .find(|l| l.starts_with("cpu "))
        .map(|l| l.split_whitespace().skip(1).take(8).enumerate().filter(|(i, _)| *i != 3 && *i != 4).filter_map(|(_, v)| v.parse::<u64>().ok()).sum())
        .unwrap_or(0);
    // SAFETY: sysconf has no memory-safety preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    ticks * (1_000_000_000 / hz)
}

struct Shared {
    /// Per sender (plan order), packets sent so far.
    sent: Vec<AtomicU64>,
    sender_done: AtomicBool,
    sender_done_at: AtomicU64,
}

struct SenderOutcome {
    per_sender: Vec<SenderAcc>,
    send_duration_ns: u64,
    cpu_ns: u64,
}

struct SenderAcc {
    sent: u64,
    sent_bytes: u64,
    send_errors: u64,
    not_sent: u64,
    lateness: ValueRecorder,
    /// SRTP senders only.
    protect: Option<ValueRecorder>,
    protect_failed: u64,
    sender_reports: u64,
    rtcp_send_errors: u64,
}

fn new_sender_accs(plan: &TrafficPlan) -> Vec<SenderAcc> {
    plan.senders
        .iter()
        .map(|s| SenderAcc {
            sent: 0,
            sent_bytes: 0,
            send_errors: 0,
            not_sent: 0,
            lateness: ValueRecorder::compact(),
            protect: s.srtp.as_ref().map(|_| ValueRecorder::compact()),
            protect_failed: 0,
            sender_reports: 0,
            rtcp_send_errors: 0,
        })
        .collect()
}

fn send_loop(plan: &TrafficPlan, mut accs: Vec<SenderAcc>, shared: &Shared, t0: u64) -> SenderOutcome {
    // Timer slack 1 ns: the default 50 µs slack would make every wake-up late.
    // SAFETY: prctl with integer arguments, affects this thread only.
    unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong, 0, 0, 0) };
    let spin_ns = plan.spin.as_nanos() as u64;
    let n = plan.senders.len().max(1) as u64;

    struct FlowState {
        buf: Vec<u8>,
        /// SRTP senders: `buf` protected (SRTP adds the authentication tag).
        wire: Vec<u8>,
        dest: SockAddr,
        bursts: u64,
        interval_ns: f64,
        offset_ns: u64,
        next_seq: u64,
        rtp_seq_base: u16,
        rtp_ts_base: u32,
        /// Monotonic time of the first burst (media time 0).
        first_ns: u64,
    }
    /// An SR about `flow` (RTP formats: validated): NTP now, the RTP timestamp of now on the
    /// flow's media clock, what was sent so far.
    fn send_sender_report(spec: &SenderSpec, flow: &FlowState, acc: &mut SenderAcc, now: u64) {
        let clock_rate = match spec.profile.format {
            PayloadFormat::Rtp { clock_rate, .. } => clock_rate,
            PayloadFormat::Vp8 { .. } => 90_000,
            PayloadFormat::Raw => return,
        };
        let media = (now.saturating_sub(flow.first_ns) as u128 * clock_rate as u128 / 1_000_000_000) as u32;
        let payload_octets = acc.sent_bytes.saturating_sub(acc.sent * RTP_HEADER_LEN as u64);
        let cname = spec.socket.local_addr().map(|a| a.to_string()).unwrap_or_default();
        let sr =
            rtcp::sender_report(spec.flow_id, rtcp::ntp(realtime_ns()), flow.rtp_ts_base.wrapping_add(media), acc.sent as u32, payload_octets as u32, &cname);
        match SockRef::from(&spec.socket).send_to_with_flags(&sr, &flow.dest, libc::MSG_DONTWAIT) {
            Ok(_) => acc.sender_reports += 1,
            Err(_) => acc.rtcp_send_errors += 1,
        }
    }
    let mut flows: Vec<FlowState> = plan
        .senders
        .iter()
        .enumerate()
        .map(|(j, s)| {
            let interval_ns = 1e9 / s.profile.bursts_per_sec;
            let offset_ns = if plan.stagger { (j as f64 * interval_ns / n as f64) as u64 } else { 0 };
            // Deterministic but flow-specific RTP bases (RFC 3550 wants them random-looking).
            let mix = s.flow_id.wrapping_mul(0x9e37_79b1);
            FlowState {
                buf: vec![0; s.profile.packet_size],
                wire: Vec::with_capacity(if s.srtp.is_some() { s.profile.packet_size + 64 } else { 0 }),
                dest: SockAddr::from(s.dest),
                bursts: s.profile.burst_count(plan.duration),
                interval_ns,
                offset_ns,
                next_seq: 0,
                rtp_seq_base: (mix >> 16) as u16,
                rtp_ts_base: mix.rotate_left(7),
                first_ns: t0 + offset_ns,
            }
        })
        .collect();
    /// What is due: burst k of sender j, or its k-th SR (k from 1).
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Due {
        Burst(usize, u64),
        Report(usize, u64),
    }
    let duration_ns = plan.duration.as_nanos() as u64;
    // SR k (from 1) of a flow leaves k - 1/2 intervals after its first burst (libwebrtc's first
    // report comes half an interval after the start), while within the duration.
    let report_at = |f: &FlowState, k: u64| {
        let after = k * rtcp::RTCP_INTERVAL_NS - rtcp::RTCP_INTERVAL_NS / 2;
        (after < duration_ns).then(|| t0 + f.offset_ns + after)
    };
    // Min-heap of (deadline, what): bounded by the number of bursts and reports in the plan.
    let mut heap: BinaryHeap<Reverse<(u64, Due)>> =
        flows.iter().enumerate().filter(|(_, f)| f.bursts > 0).map(|(j, f)| Reverse((t0 + f.offset_ns, Due::Burst(j, 0)))).collect();
    for (j, f) in flows.iter().enumerate().filter(|(j, f)| plan.senders[*j].sender_reports && f.bursts > 0) {
        if let Some(at) = report_at(f, 1) {
            heap.push(Reverse((at, Due::Report(j, 1))));
        }
    }
    let give_up_at = t0 + (plan.duration + MAX_LATENESS).as_nanos() as u64;
    let mut last_send = t0;

    while let Some(Reverse((deadline, due))) = heap.pop() {
        sleep_until(deadline, spin_ns);
        let start = monotonic_ns();
        let (j, k) = match due {
            Due::Burst(j, k) => (j, k),
            Due::Report(j, k) => {
                if start <= give_up_at {
                    send_sender_report(&plan.senders[j], &flows[j], &mut accs[j], start);
                }
                if let Some(at) = report_at(&flows[j], k + 1) {
                    heap.push(Reverse((at, Due::Report(j, k + 1))));
                }
                continue;
            }
        };
        let spec = &plan.senders[j];
        let flow = &mut flows[j];
        let acc = &mut accs[j];
        if start > give_up_at {
            acc.not_sent += spec.profile.planned_packets(plan.duration) - flow.next_seq;
            continue;
        }
        acc.lateness.record(start.saturating_sub(deadline));
        let in_burst = spec.profile.packets_in_burst(k);
        let socket = SockRef::from(&spec.socket);
        for p in 0..in_burst {
            let seq = flow.next_seq;
            flow.next_seq += 1;
            let send_ns = realtime_ns();
            match spec.profile.format {
                PayloadFormat::Raw => encode_raw(&mut flow.buf, spec.flow_id as u16, seq, send_ns),
                PayloadFormat::Rtp { payload_type, clock_rate } => {
                    let media_time = (k as f64 * clock_rate as f64 / spec.profile.bursts_per_sec).round() as u64;
                    let rtp = RtpFields {
                        payload_type,
                        // Video: last packet of a frame; voice: first packet of the talkspurt.
                        marker: if in_burst > 1 { p == in_burst - 1 } else { seq == 0 },
                        sequence: flow.rtp_seq_base.wrapping_add(seq as u16),
                        timestamp: flow.rtp_ts_base.wrapping_add(media_time as u32),
                        ssrc: spec.flow_id,
                    };
                    encode_rtp(&mut flow.buf, rtp, seq, send_ns)
                }
                PayloadFormat::Vp8 { keyframe_every } => {
                    let media_time = (k as f64 * 90_000.0 / spec.profile.bursts_per_sec).round() as u64;
                    let rtp = RtpFields {
                        payload_type: VP8_PAYLOAD_TYPE,
                        marker: p == in_burst - 1,
                        sequence: flow.rtp_seq_base.wrapping_add(seq as u16),
                        timestamp: flow.rtp_ts_base.wrapping_add(media_time as u32),
                        ssrc: spec.flow_id,
                    };
                    encode_rtp(&mut flow.buf, rtp, seq, send_ns);
                    encode_vp8(&mut flow.buf, p == 0, k % keyframe_every as u64 == 0, k as u16, spec.flow_id, seq, send_ns)
                }
            }
            let wire = match &spec.srtp {
                None => &flow.buf,
                Some(ctx) => {
                    flow.wire.clear();
                    flow.wire.extend_from_slice(&flow.buf);
                    let t = monotonic_ns();
                    let r = ctx.protect(&mut flow.wire);
                    if let Some(p) = acc.protect.as_mut() {
                        p.record(monotonic_ns() - t);
                    }
                    if r.is_err() {
                        acc.protect_failed += 1;
                        acc.send_errors += 1;
                        continue;
                    }
                    &flow.wire
                }
            };
            // MSG_DONTWAIT: a full socket buffer is a counted error, never a stalled generator.
            match socket.send_to_with_flags(wire, &flow.dest, libc::MSG_DONTWAIT) {
                Ok(_) => {
                    acc.sent += 1;
                    acc.sent_bytes += wire.len() as u64;
                }
                Err(_) => acc.send_errors += 1,
            }
        }
        shared.sent[j].store(acc.sent, Ordering::Release);
        last_send = monotonic_ns();
        if k + 1 < flow.bursts {
            let next = t0 + flow.offset_ns + ((k + 1) as f64 * flow.interval_ns).round() as u64;
            heap.push(Reverse((next, Due::Burst(j, k + 1))));
        }
    }
    shared.sender_done_at.store(monotonic_ns(), Ordering::Release);
    shared.sender_done.store(true, Ordering::Release);
    SenderOutcome { per_sender: accs, send_duration_ns: last_send.saturating_sub(t0), cpu_ns: thread_cpu_ns() }
}

/// Sleep (absolute, CLOCK_MONOTONIC) until `spin_ns` before `deadline`, then busy-wait.
fn sleep_until(deadline: u64, spin_ns: u64) {
    let wake = deadline.saturating_sub(spin_ns);
    if monotonic_ns() < wake {
        let ts = libc::timespec { tv_sec: (wake / 1_000_000_000) as libc::time_t, tv_nsec: (wake % 1_000_000_000) as libc::c_long };
        // Absolute deadline: EINTR just retries to the same instant (bounded by the deadline).
        // SAFETY: valid timespec pointer; remaining-time pointer unused with TIMER_ABSTIME.
        while unsafe { libc::clock_nanosleep(libc::CLOCK_MONOTONIC, libc::TIMER_ABSTIME, &ts, std::ptr::null_mut()) } == libc::EINTR {}
    }
    while monotonic_ns() < deadline {
        std::hint::spin_loop();
    }
}

/// Statistics of one copy while receiving.
struct CopyAcc {
    seq: SeqTracker,
    bytes: u64,
    delays: ValueRecorder,
    jitter: Rfc3550Jitter,
    variation: DelayVariation,
    negative_delays: u64,
}

struct ReceiverAcc {
    copies: HashMap<u32, CopyAcc>,
    datagrams: u64,
    unexpected: u64,
    unexpected_flows: HashSet<u32>,
    malformed: u64,
    rtcp: u64,
    srtp_failed: u64,
    srtp_replayed: u64,
    user_timestamps: u64,
    /// Receivers that send RTCP: its state, and the media clock of each flow it expects.
    feedback: Option<(rtcp::FeedbackState, HashMap<u32, u32>)>,
}

struct ReceiverOutcome {
    per_receiver: Vec<ReceiverAcc>,
    cpu_ns: u64,
}

fn prepare_receiver(socket: &UdpSocket) -> anyhow::Result<()> {
    let fd = socket.as_raw_fd();
    let on: libc::c_int = 1;
    setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_TIMESTAMPNS, on)?;
    // 4 MiB so a burst is never dropped by a small default buffer; SO_RCVBUFFORCE (root)
    // ignores net.core.rmem_max, the fallback is capped by it.
    let size: libc::c_int = 4 << 20;
    if setsockopt_int(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, size).is_err() {
        let _ = SockRef::from(socket).set_recv_buffer_size(size as usize);
    }
    // Discard anything queued before the run (bounded).
    let mut buf = [0u8; 2048];
    for _ in 0..100_000 {
        if SockRef::from(socket).recv_with_flags(as_uninit(&mut buf), libc::MSG_DONTWAIT).is_err() {
            break;
        }
    }
    Ok(())
}

fn new_receiver_accs(plan: &TrafficPlan, planned: &HashMap<u32, u64>) -> Vec<ReceiverAcc> {
    let clock_rate = |flow: &u32| match plan.senders.iter().find(|s| s.flow_id == *flow).map(|s| s.profile.format) {
        Some(PayloadFormat::Rtp { clock_rate, .. }) => clock_rate,
        _ => 90_000,
    };
    plan.receivers
        .iter()
        .map(|r| ReceiverAcc {
            feedback: r.feedback.map(|f| {
                let cname = r.socket.local_addr().map(|a| a.to_string()).unwrap_or_default();
                (rtcp::FeedbackState::new(f.ssrc, cname, u64::MAX), r.expects.iter().map(|f| (*f, clock_rate(f))).collect())
            }),
            copies: r
                .expects
                .iter()
                .map(|f| {
                    let acc = CopyAcc {
                        seq: SeqTracker::new(planned[f]),
                        bytes: 0,
                        delays: ValueRecorder::new(),
                        jitter: Rfc3550Jitter::default(),
                        variation: DelayVariation::default(),
                        negative_delays: 0,
                    };
                    (*f, acc)
                })
                .collect(),
            datagrams: 0,
            unexpected: 0,
            unexpected_flows: HashSet::new(),
            malformed: 0,
            rtcp: 0,
            srtp_failed: 0,
            srtp_replayed: 0,
            user_timestamps: 0,
        })
        .collect()
}

fn receive_loop(plan: &TrafficPlan, mut accs: Vec<ReceiverAcc>, flow_index: &HashMap<u32, usize>, shared: &Shared, t0: u64) -> anyhow::Result<ReceiverOutcome> {
    let epoll = Epoll::new()?;
    for (i, r) in plan.receivers.iter().enumerate() {
        epoll.add(r.socket.as_raw_fd(), i as u64)?;
    }
    let drain_ns = plan.drain.as_nanos() as u64;
    let settle_ns = plan.settle.as_nanos() as u64;
    // Hard stop even if the sender never reports done.
    let hard_stop = t0 + (plan.duration + MAX_LATENESS + plan.drain).as_nanos() as u64;
    let mut buf = vec![0u8; MAX_PACKET + 1];
    // SRTP receivers: the datagram unprotected.
    let mut clear = Vec::with_capacity(2048);
    let mut ready = Vec::with_capacity(64);
    // Receivers' RTCP: reports until the media ends; what is to be sent.
    let media_end = t0 + plan.duration.as_nanos() as u64;
    for (fb, _) in accs.iter_mut().filter_map(|a| a.feedback.as_mut()) {
        fb.until_ns = media_end;
    }
    let mut outbox: rtcp::Outbox = Vec::new();

    loop {
        let now = monotonic_ns();
        let mut stop_at = hard_stop;
        if shared.sender_done.load(Ordering::Acquire) {
            let done_at = shared.sender_done_at.load(Ordering::Acquire);
            stop_at = stop_at.min(done_at + drain_ns);
            if now >= done_at + settle_ns && all_complete(&accs, flow_index, shared) {
                break;
            }
        }
        if now >= stop_at {
            break;
        }
        // Receiver reports that are due (checked at every wake-up: at most 10 ms late).
        for (i, acc) in accs.iter_mut().enumerate() {
            let ReceiverAcc { feedback: Some((fb, _)), copies, .. } = acc else { continue };
            fb.due_reports(now, |flow| copies.get(&flow).map_or(0.0, |c| c.jitter.jitter_ns()), &mut outbox);
            send_feedback(&plan.receivers[i], fb, &mut outbox);
        }
        // Wake at least every 10 ms to notice the sender finishing.
        let timeout_ms = ((stop_at - now) / 1_000_000).clamp(1, 10) as i32;
        epoll.wait(&mut ready, timeout_ms)?;
        for &token in &ready {
            let i = token as usize;
            let fd = plan.receivers[i].socket.as_raw_fd();
            // Bounded per wake-up so one busy socket cannot starve the others or the clock.
            for _ in 0..256 {
                match recv_timestamped(fd, &mut buf) {
                    Ok((len, truncated, kernel_ns)) => {
                        let recv_ns = kernel_ns.unwrap_or_else(realtime_ns);
                        let mut d = &buf[..len];
                        if let Some(ctx) = &plan.receivers[i].srtp {
                            clear.clear();
                            clear.extend_from_slice(d);
                            let r = if truncated { Err(SrtpDrop::Invalid) } else { ctx.unprotect(&mut clear) };
                            if let Err(e) = r {
                                accs[i].datagrams += 1;
                                match e {
                                    SrtpDrop::Replay => accs[i].srtp_replayed += 1,
                                    _ => accs[i].srtp_failed += 1,
                                }
                                continue;
                            }
                            d = &clear;
                        }
                        on_datagram(&mut accs[i], d, truncated, recv_ns, kernel_ns.is_none());
                        if let Some((fb, clocks)) = accs[i].feedback.as_mut() {
                            if !truncated {
                                on_feedback(fb, clocks, d, &mut outbox);
                                send_feedback(&plan.receivers[i], fb, &mut outbox);
                            }
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    // ICMP errors queued on the socket (e.g. ECONNREFUSED): not data, go on.
                    Err(_) => break,
                }
            }
        }
    }
    Ok(ReceiverOutcome { per_receiver: accs, cpu_ns: thread_cpu_ns() })
}

/// A datagram at a receiver that sends RTCP: an SR's time is kept, an expected flow's RTP
/// packet may call for a PLI or NACKs (into `outbox`).
fn on_feedback(fb: &mut rtcp::FeedbackState, clocks: &HashMap<u32, u32>, d: &[u8], outbox: &mut rtcp::Outbox) {
    let now = monotonic_ns();
    if is_rtcp(d) {
        fb.on_rtcp(d, now);
        return;
    }
    let (Some(probe), Ok(h)) = (decode_probe(d), mediaplane_core::rtp::RtpHeader::parse(d)) else { return };
    let Some(&clock_rate) = clocks.get(&probe.flow_id) else { return };
    // A VP8 keyframe's first packet: S in the descriptor, P = 0 in the payload header.
    let keyframe_start = (h.payload_type == VP8_PAYLOAD_TYPE)
        .then(|| d.get(h.payload_offset..h.payload_offset + VP8_PREFIX_LEN).is_some_and(|p| p[0] & 0x10 != 0 && p[4] & 0x01 == 0));
    fb.on_rtp(probe.flow_id, clock_rate, &h, keyframe_start, now, outbox);
}

/// Send what `outbox` holds from the receiver's socket to its RTCP destination, counted.
fn send_feedback(spec: &ReceiverSpec, fb: &mut rtcp::FeedbackState, outbox: &mut rtcp::Outbox) {
    let Some(to) = spec.feedback.map(|f| SockAddr::from(f.to)) else { return };
    for (kind, p) in outbox.drain(..) {
        let ok = SockRef::from(&*spec.socket).send_to_with_flags(&p, &to, libc::MSG_DONTWAIT).is_ok();
        fb.sent.count(kind, ok);
    }
}

fn all_complete(accs: &[ReceiverAcc], flow_index: &HashMap<u32, usize>, shared: &Shared) -> bool {
    accs.iter().all(|r| r.copies.iter().all(|(flow, c)| c.seq.unique >= shared.sent[flow_index[flow]].load(Ordering::Acquire)))
}

fn on_datagram(acc: &mut ReceiverAcc, d: &[u8], truncated: bool, recv_ns: i64, user_stamped: bool) {
    acc.datagrams += 1;
    acc.user_timestamps += user_stamped as u64;
    if is_rtcp(d) {
        acc.rtcp += 1;
        return;
    }
    let probe = match decode_probe(d) {
        Some(p) if !truncated => p,
        _ => {
            acc.malformed += 1;
            return;
        }
    };
    let Some(copy) = acc.copies.get_mut(&probe.flow_id) else {
        acc.unexpected += 1;
        acc.unexpected_flows.insert(probe.flow_id);
        return;
    };
    use crate::qos::SeqOutcome::*;
    match copy.seq.record(probe.seq) {
        Duplicate | OutOfRange => return,
        InOrder | Reordered => {}
    }
    copy.bytes += d.len() as u64;
    let delay = recv_ns - probe.send_ns;
    if delay < 0 {
        copy.negative_delays += 1;
    }
    copy.delays.record(delay.max(0) as u64);
    copy.jitter.on_packet(probe.send_ns, recv_ns);
    copy.variation.on_delay(delay);
}

fn build_report(plan: &TrafficPlan, started_unix_ns: i64, s: SenderOutcome, r: ReceiverOutcome) -> TrafficReport {
    let senders: Vec<SenderReport> = plan
        .senders
        .iter()
        .zip(&s.per_sender)
        .map(|(spec, acc)| SenderReport {
            flow_id: spec.flow_id,
            dest: spec.dest,
            profile: spec.profile.name.clone(),
            planned: spec.profile.planned_packets(plan.duration),
            sent: acc.sent,
            sent_bytes: acc.sent_bytes,
            send_errors: acc.send_errors,
            not_sent: acc.not_sent,
            lateness_ns: acc.lateness.summary(),
            srtp_protect_ns: acc.protect.as_ref().map(ValueRecorder::summary),
            srtp_protect_failed: acc.protect_failed,
            sender_reports: acc.sender_reports,
            rtcp_send_errors: acc.rtcp_send_errors,
        })
        .collect();
    let sent_by_flow: HashMap<u32, u64> = senders.iter().map(|s| (s.flow_id, s.sent)).collect();

    let mut copies = Vec::new();
    let mut receivers = Vec::new();
    for (i, (spec, acc)) in plan.receivers.iter().zip(r.per_receiver).enumerate() {
        // Report copies in the order the receiver listed its flows.
        let mut by_flow = acc.copies;
        for flow in &spec.expects {
            let Some(c) = by_flow.remove(flow) else {
                continue;
            };
            let sent = sent_by_flow[flow];
            let lost = c.seq.lost(sent);
            let loss_percent = if sent > 0 { 100.0 * lost as f64 / sent as f64 } else { 0.0 };
            let delay = c.delays.summary();
            let burst_ratio = c.seq.burst_ratio(sent);
            copies.push(CopyReport {
                flow_id: *flow,
                receiver: i,
                receiver_label: spec.label.clone(),
                sent,
                received: c.seq.unique,
                bytes: c.bytes,
                lost,
                loss_percent,
                duplicates: c.seq.duplicates,
                reordered: c.seq.reordered,
                out_of_range: c.seq.out_of_range,
                delay_ns: delay,
                jitter_ns: c.jitter.jitter_ns(),
                delay_variation_ns: c.variation.summary(),
                burst_ratio,
                mos_g711: EModel::G711.mos(delay.mean / 1e6, loss_percent, burst_ratio.unwrap_or(1.0)),
                negative_delays: c.negative_delays,
                delay_histogram: c.delays.histogram,
            });
        }
        let mut unexpected_flows: Vec<u32> = acc.unexpected_flows.into_iter().collect();
        unexpected_flows.sort();
        receivers.push(ReceiverReport {
            label: spec.label.clone(),
            local_addr: spec.socket.local_addr().ok(),
            datagrams: acc.datagrams,
            unexpected: acc.unexpected,
            unexpected_flows,
            malformed: acc.malformed,
            rtcp: acc.rtcp,
            srtp_failed: acc.srtp_failed,
            srtp_replayed: acc.srtp_replayed,
            user_timestamps: acc.user_timestamps,
            rtcp_sent: acc.feedback.as_ref().map(|(fb, _)| fb.sent).unwrap_or_default(),
        });
    }

    let totals = Totals {
        sent: senders.iter().map(|s| s.sent).sum(),
        expected_copies: copies.iter().map(|c| c.sent).sum(),
        received: copies.iter().map(|c| c.received).sum(),
        lost: copies.iter().map(|c| c.lost).sum(),
        duplicates: copies.iter().map(|c| c.duplicates).sum(),
        reordered: copies.iter().map(|c| c.reordered).sum(),
        unexpected: receivers.iter().map(|r| r.unexpected).sum(),
        malformed: receivers.iter().map(|r| r.malformed).sum(),
        srtp_failed: receivers.iter().map(|r| r.srtp_failed).sum(),
        srtp_replayed: receivers.iter().map(|r| r.srtp_replayed).sum(),
        send_errors: senders.iter().map(|s| s.send_errors).sum(),
        rtcp_sent: senders.iter().map(|s| s.sender_reports).sum::<u64>() + receivers.iter().map(|r| r.rtcp_sent.packets()).sum::<u64>(),
    };
    TrafficReport {
        started_unix_ns,
        send_duration_ns: s.send_duration_ns,
        senders,
        receivers,
        copies,
        totals,
        generator_cpu_ns: s.cpu_ns,
        receiver_cpu_ns: r.cpu_ns,
        machine_busy_ns: 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Small syscall wrappers
// ---------------------------------------------------------------------------------------------

fn clock_ns(clock: libc::clockid_t) -> i64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid timespec pointer; these clocks always exist on Linux.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    timespec_ns(&ts)
}

// time_t / c_long are i64 here but i32 on 32-bit targets: keep the conversion portable.
#[allow(clippy::useless_conversion)]
fn timespec_ns(ts: &libc::timespec) -> i64 {
    i64::from(ts.tv_sec) * 1_000_000_000 + i64::from(ts.tv_nsec)
}

/// CLOCK_REALTIME in ns: the clock of SO_TIMESTAMPNS, used for one-way delay.
pub fn realtime_ns() -> i64 {
    clock_ns(libc::CLOCK_REALTIME)
}

/// CLOCK_MONOTONIC in ns: the clock of send deadlines.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC) as u64
}

fn thread_cpu_ns() -> u64 {
    clock_ns(libc::CLOCK_THREAD_CPUTIME_ID) as u64
}

fn setsockopt_int(fd: libc::c_int, level: libc::c_int, name: libc::c_int, value: libc::c_int) -> io::Result<()> {
    // SAFETY: pointer and length describe a live c_int.
    let rc = unsafe { libc::setsockopt(fd, level, name, (&value as *const libc::c_int).cast(), std::mem::size_of::<libc::c_int>() as libc::socklen_t) };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

fn as_uninit(buf: &mut [u8]) -> &mut [std::mem::MaybeUninit<u8>] {
    // SAFETY: initialized bytes are valid MaybeUninit<u8>; recv only writes bytes into them.
    unsafe { &mut *(buf as *mut [u8] as *mut [std::mem::MaybeUninit<u8>]) }
}

/// recvmsg(MSG_DONTWAIT) returning (length, truncated, kernel SO_TIMESTAMPNS time in ns).
fn recv_timestamped(fd: libc::c_int, buf: &mut [u8]) -> io::Result<(usize, bool, Option<i64>)> {
    // u64 array: cmsg buffers must be aligned for cmsghdr.
    let mut control = [0u64; 16];
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    // SAFETY: zeroed msghdr is valid; all pointers below outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg describes valid buffers.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let truncated = msg.msg_flags & libc::MSG_TRUNC != 0;
    let mut stamp = None;
    // SAFETY: the CMSG_* helpers walk the control buffer the kernel just filled.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_TIMESTAMPNS {
                let ts: libc::timespec = std::ptr::read_unaligned(libc::CMSG_DATA(cmsg).cast());
                stamp = Some(timespec_ns(&ts));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    Ok((n as usize, truncated, stamp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_match_their_definitions() {
        let voice = Profile::voice();
        assert_eq!(voice.packet_size, 172);
        assert_eq!(voice.planned_packets(Duration::from_secs(1)), 50);
        assert!((voice.bitrate() - 68_800.0).abs() < 1e-6);

        let thesis = Profile::thesis();
        assert_eq!(thesis.packet_size + 20 + 8, 46, "46-byte IP packet");
        assert_eq!(thesis.planned_packets(Duration::from_secs(2)), 50);

        let video = Profile::video();
        assert!((video.bitrate() - 1_500_000.0).abs() < 1e-6);
        assert_eq!(video.burst_count(Duration::from_secs(1)), 30);
        // 156.25 packets/s in 30 bursts: 5 or 6 per burst, 156 in one second.
        let per_burst: Vec<u64> = (0..30).map(|k| video.packets_in_burst(k)).collect();
        assert!(per_burst.iter().all(|&n| n == 5 || n == 6), "{per_burst:?}");
        assert_eq!(per_burst.iter().sum::<u64>(), video.planned_packets(Duration::from_secs(1)));
        assert_eq!(video.planned_packets(Duration::from_secs(1)), 156);

        assert_eq!(Profile::voice().with_rate(100.0).planned_packets(Duration::from_millis(290)), 29);
        assert_eq!("video".parse::<Preset>().unwrap().profile(), Profile::video());
        assert!("nope".parse::<Preset>().is_err());
    }

    #[test]
    fn probe_roundtrip() {
        let mut buf = vec![0u8; 172];
        let rtp = RtpFields { payload_type: 0, marker: true, sequence: 65535, timestamp: 7, ssrc: 0xdead_beef };
        encode_rtp(&mut buf, rtp, 42, 1_700_000_000_123_456_789);
        let h = mediaplane_core::rtp::RtpHeader::parse(&buf).unwrap();
        assert_eq!((h.payload_type, h.marker, h.sequence, h.timestamp, h.ssrc), (0, true, 65535, 7, 0xdead_beef));
        assert_eq!(mediaplane_core::rtp::demux(&buf), mediaplane_core::rtp::MediaKind::Rtp);
        assert_eq!(decode_probe(&buf), Some(Probe { flow_id: 0xdead_beef, seq: 42, send_ns: 1_700_000_000_123_456_789 }));

        let mut raw = [0u8; RAW_PROBE_LEN];
        encode_raw(&mut raw, 513, 9, 123);
        assert_eq!(mediaplane_core::rtp::demux(&raw), mediaplane_core::rtp::MediaKind::Other);
        assert_eq!(decode_probe(&raw), Some(Probe { flow_id: 513, seq: 9, send_ns: 123 }));

        assert_eq!(decode_probe(&buf[..20]), None, "RTP too short for the probe");
        assert_eq!(decode_probe(&raw[..10]), None);
        assert_eq!(decode_probe(&[]), None);
    }

    /// The VP8 layer format is what the SFU's own inspector reads: keyframes only at a frame's
    /// first packet when asked, the picture id where it looks; the probe and flow id survive an
    /// SFU's SSRC, sequence and picture-id rewrite; RTCP is told apart.
    #[test]
    fn vp8_layer_probe_is_what_the_sfu_inspects() {
        use mediaplane_core::simulcast::{inspect, Codec};
        let profile = Profile::simulcast_layer(0);
        profile.validate().unwrap();
        let mut buf = vec![0u8; profile.packet_size];
        let rtp = RtpFields { payload_type: VP8_PAYLOAD_TYPE, marker: true, sequence: 9, timestamp: 3000, ssrc: 3001 };
        for (start, key, expect_key) in [(true, true, true), (false, true, false), (true, false, false)] {
            encode_rtp(&mut buf, rtp, 5, 77);
            encode_vp8(&mut buf, start, key, 0x7abc, 3001, 5, 77);
            let info = inspect(Codec::Vp8, &buf).unwrap();
            assert_eq!(info.keyframe_start, expect_key, "start {start} key {key}");
            assert_eq!(info.picture_id.map(|p| (p.value, p.wide)), Some((0x7abc, true)));
            assert_eq!(decode_probe(&buf), Some(Probe { flow_id: 3001, seq: 5, send_ns: 77 }));
        }
        // What a simulcast consumer receives: another SSRC, sequence number and picture id.
        buf[8..12].copy_from_slice(&0x1234_5678u32.to_be_bytes());
        buf[2..4].copy_from_slice(&1u16.to_be_bytes());
        buf[14..16].copy_from_slice(&0x8001u16.to_be_bytes());
        assert_eq!(decode_probe(&buf), Some(Probe { flow_id: 3001, seq: 5, send_ns: 77 }));
        assert_eq!(decode_probe(&buf[..MIN_VP8_PACKET - 1]), None);
        let pli = [0x81, 206, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2];
        assert!(is_rtcp(&pli) && !is_rtcp(&buf));
    }

    #[test]
    fn plan_validation() {
        let sock = || UdpSocket::bind("127.0.0.1:0").unwrap();
        let dest: SocketAddr = "127.0.0.1:9".parse().unwrap();
        let dup = TrafficPlan::new(Duration::from_millis(10)).sender(sock(), dest, 1, Profile::voice()).sender(sock(), dest, 1, Profile::voice());
        assert!(run(&dup).is_err());
        let raw_big_id = TrafficPlan::new(Duration::from_millis(10)).sender(sock(), dest, 70_000, Profile::thesis());
        assert!(run(&raw_big_id).is_err());
        let unknown = TrafficPlan::new(Duration::from_millis(10)).receiver("r", sock(), [5]);
        assert!(run(&unknown).is_err());
        let too_long = TrafficPlan::new(Duration::from_secs(7200));
        assert!(run(&too_long).is_err());
    }

    /// Loopback needs no root: every preset end to end, one receiver getting two flows plus a
    /// stray it did not ask for.
    #[test]
    fn loopback_presets_end_to_end() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let rx2 = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to_rx = rx.local_addr().unwrap();
        let to_rx2 = rx2.local_addr().unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let plan = TrafficPlan::new(Duration::from_millis(400))
            .sender(tx.try_clone().unwrap(), to_rx, 10, Profile::voice())
            .sender(tx.try_clone().unwrap(), to_rx, 11, Profile::video())
            .sender(tx, to_rx2, 12, Profile::thesis())
            .sender(UdpSocket::bind("127.0.0.1:0").unwrap(), to_rx, 13, Profile::thesis())
            .receiver("rx", rx, [10, 11])
            .receiver("rx2", rx2, [12]);
        let report = run(&plan).unwrap();
        let json = serde_json::to_string_pretty(&report).unwrap();

        let voice = report.copy(10, 0).unwrap();
        assert_eq!((voice.sent, voice.received, voice.lost, voice.duplicates), (20, 20, 0, 0), "{json}");
        let video = report.copy_by_label(11, "rx").unwrap();
        assert_eq!(video.sent, Profile::video().planned_packets(Duration::from_millis(400)));
        assert_eq!(video.received, video.sent, "{json}");
        assert_eq!(video.bytes, video.sent * 1200);
        let thesis = report.copy(12, 1).unwrap();
        assert_eq!((thesis.sent, thesis.received), (10, 10), "{json}");
        assert_eq!(report.receivers[0].unexpected, 10, "flow 13 is a stray at rx: {json}");
        assert_eq!(report.receivers[0].unexpected_flows, vec![13]);
        assert_eq!(report.totals.expected_copies, report.totals.received);
        assert_eq!(report.receivers.iter().map(|r| r.user_timestamps).sum::<u64>(), 0, "kernel timestamps");
        for c in &report.copies {
            // Loopback on an idle machine: µs; allow a loaded CI box plenty.
            assert!(c.delay_ns.max < 50e6, "{json}");
            assert!(c.delay_ns.min > 0.0, "{json}");
            assert!(c.mos_g711 > 4.4, "{json}");
        }
        // Pacing keeps the generator cheap: well under the 400 ms it ran (spinning the whole
        // time would be ~400 ms).
        assert!(report.generator_cpu_ns < 200_000_000, "{json}");
    }

    /// An SRTP sender is read by a receiver holding its key, and refused by one holding another.
    #[test]
    fn srtp_flows_protect_and_unprotect() {
        use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
        let key = |b: u8| SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![b; 30]).unwrap();
        let ctx = |b: u8, outbound: bool| Arc::new(SrtpContext::new(&key(b), outbound).unwrap());
        let (rx, wrong) = (UdpSocket::bind("127.0.0.1:0").unwrap(), UdpSocket::bind("127.0.0.1:0").unwrap());
        let (to_rx, to_wrong) = (rx.local_addr().unwrap(), wrong.local_addr().unwrap());
        let plan = TrafficPlan::new(Duration::from_millis(200))
            .srtp_sender(UdpSocket::bind("127.0.0.1:0").unwrap(), to_rx, 20, Profile::voice(), ctx(1, true))
            .srtp_sender(UdpSocket::bind("127.0.0.1:0").unwrap(), to_wrong, 21, Profile::voice(), ctx(1, true))
            .srtp_receiver("rx", rx, [20], ctx(1, false))
            .srtp_receiver("wrong key", wrong, [21], ctx(2, false));
        let report = run(&plan).unwrap();
        let json = serde_json::to_string_pretty(&report).unwrap();
        let good = report.copy(20, 0).unwrap();
        assert_eq!((good.sent, good.received, good.lost), (10, 10, 0), "{json}");
        // 172 bytes of RTP + the 80-bit tag on the wire; the receiver counts what it read clear.
        assert_eq!(report.senders[0].sent_bytes, 10 * 182, "{json}");
        assert_eq!(good.bytes, 10 * 172, "{json}");
        assert_eq!(report.senders[0].srtp_protect_ns.unwrap().count, 10, "{json}");
        assert_eq!(report.receivers[0].srtp_failed, 0, "{json}");
        let bad = report.copy(21, 1).unwrap();
        assert_eq!((bad.received, report.receivers[1].srtp_failed, report.totals.srtp_failed), (0, 10, 10), "{json}");
    }

    /// A relay that duplicates a packet on an SRTP leg: the receiver's libsrtp refuses the
    /// second copy as a replay, counted `srtp_replayed` (not `srtp_failed`, and not a copy's
    /// `duplicates`: its probe was never read).
    #[test]
    fn srtp_replay_is_counted_as_replayed() {
        use mediaplane_core::srtp::{SrtpKey, SrtpSuite};
        let key = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![3; 30]).unwrap();
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to_rx = rx.local_addr().unwrap();
        // The "relay": forwards every datagram once, and the first REPLAYED of them twice.
        const REPLAYED: usize = 3;
        let relay = UdpSocket::bind("127.0.0.1:0").unwrap();
        let to_relay = relay.local_addr().unwrap();
        relay.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let forwarder = {
            let stop = stop.clone();
            std::thread::spawn(move || {
                let (mut buf, mut forwarded) = ([0u8; 2048], 0usize);
                // Bounded: 10 s of 50 ms timeouts at most.
                for _ in 0..200 {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let Ok(n) = relay.recv(&mut buf) else { continue };
                    let copies = if forwarded < REPLAYED { 2 } else { 1 };
                    for _ in 0..copies {
                        relay.send_to(&buf[..n], to_rx).unwrap();
                    }
                    forwarded += 1;
                }
                forwarded
            })
        };
        let plan = TrafficPlan::new(Duration::from_millis(200))
            .srtp_sender(UdpSocket::bind("127.0.0.1:0").unwrap(), to_relay, 30, Profile::voice(), Arc::new(SrtpContext::new(&key, true).unwrap()))
            .srtp_receiver("rx", rx, [30], Arc::new(SrtpContext::new(&key, false).unwrap()));
        let report = run(&plan).unwrap();
        stop.store(true, Ordering::Release);
        assert_eq!(forwarder.join().unwrap(), 10);
        let json = serde_json::to_string_pretty(&report).unwrap();
        let copy = report.copy(30, 0).unwrap();
        assert_eq!((copy.sent, copy.received, copy.lost, copy.duplicates), (10, 10, 0, 0), "{json}");
        let r = &report.receivers[0];
        assert_eq!((r.srtp_replayed, r.srtp_failed), (REPLAYED as u64, 0), "{json}");
        assert_eq!((report.totals.srtp_replayed, report.totals.srtp_failed), (REPLAYED as u64, 0), "{json}");
    }
}
