//! VP8 over RTP as the video tests read it, and GStreamer's decoder as their judge.

use mediaplane_bench::sip;
use mediaplane_core::rtp::RtpHeader;
use std::net::{Ipv4Addr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};

/// The VP8 payload (after the RFC 7741 descriptor) of a packet that starts partition 0 of a
/// frame; None for any other packet.
fn vp8_frame_start(rtp: &[u8]) -> Option<&[u8]> {
    let h = RtpHeader::parse(rtp).ok()?;
    let b = rtp.get(h.payload_offset..h.payload_offset + h.payload_len)?;
    let d = *b.first()?;
    let (extended, start, partition) = (d & 0x80 != 0, d & 0x10 != 0, d & 0x07);
    let mut i = 1;
    if extended {
        let x = *b.get(1)?;
        i = 2;
        if x & 0x80 != 0 {
            i += if b.get(i).is_some_and(|p| p & 0x80 != 0) { 2 } else { 1 };
        }
        i += usize::from(x & 0x40 != 0) + usize::from(x & 0x30 != 0);
    }
    (start && partition == 0).then(|| b.get(i..)).flatten()
}

/// Whether an RTP packet carries the start of a VP8 keyframe (the payload header's P bit is 0).
pub fn vp8_keyframe_start(rtp: &[u8]) -> bool {
    vp8_frame_start(rtp).is_some_and(|p| p.first().is_some_and(|b| b & 1 == 0))
}

/// The picture size a VP8 keyframe starting in `rtp` announces (RFC 6386 9.1: after the 3-byte
/// frame tag, the start code 9d 01 2a and two 14-bit little-endian dimensions).
pub fn vp8_keyframe_size(rtp: &[u8]) -> Option<(u16, u16)> {
    let p = vp8_frame_start(rtp)?;
    if p.len() < 10 || p[0] & 1 != 0 || p[3..6] != [0x9d, 0x01, 0x2a] {
        return None;
    }
    let dim = |at: usize| u16::from_le_bytes([p[at], p[at + 1]]) & 0x3fff;
    Some((dim(6), dim(8)))
}

pub fn is_pli(rtcp: &[u8]) -> bool {
    mediaplane_core::rtp::parse_rtcp_compound(rtcp).is_ok_and(|ps| ps.iter().any(|p| p.packet_type == 206 && p.count == 1))
}

/// Decode `packets` (VP8 RTP with payload type 96, in order) with GStreamer (`rtpvp8depay !
/// vp8dec`), fed on loopback port `port`: how many frames the decoder output, and its log
/// (in `dir`, named after `tag`).
pub fn decode(packets: &[Vec<u8>], port: u16, dir: &Path, tag: &str) -> (usize, String) {
    let log = dir.join(format!("decode-{tag}.log"));
    let frames = dir.join(format!("frames-{tag}"));
    std::fs::create_dir_all(&frames).unwrap();
    let mut cmd = std::process::Command::new("gst-launch-1.0");
    // A file per decoded frame, scaled down to almost nothing (the count is what matters).
    let pipeline = format!(
        "udpsrc address=127.0.0.1 port={port} buffer-size=8388608 \
         caps=application/x-rtp,media=video,encoding-name=VP8,clock-rate=90000,payload=96 \
         ! rtpvp8depay ! vp8dec ! videoscale ! video/x-raw,width=16,height=16 ! multifilesink location={}/f%05d.raw",
        frames.display()
    );
    cmd.args(pipeline.split_whitespace()).stdout(std::process::Stdio::null()).stderr(std::fs::File::create(&log).unwrap());
    let mut gst = sip::spawn_group("gst-launch-1.0", &mut cmd).unwrap_or_else(|e| panic!("{e}"));
    sip::wait_udp_bound(&mut gst, port, Duration::from_secs(10)).unwrap_or_else(|e| panic!("{e}\n{}", sip::log_tail(&log, 20)));
    let out = UdpSocket::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
    for p in packets {
        out.send_to(p, (Ipv4Addr::LOCALHOST, port)).unwrap();
        std::thread::sleep(Duration::from_micros(200));
    }
    // The last frame is output when... there is no next one: count what settles.
    let count = || std::fs::read_dir(&frames).map_or(0, |d| d.count());
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut last = (count(), Instant::now());
    while Instant::now() < deadline && last.1.elapsed() < Duration::from_millis(700) {
        std::thread::sleep(Duration::from_millis(100));
        let n = count();
        if n != last.0 {
            last = (n, Instant::now());
        }
    }
    drop(gst);
    (last.0, std::fs::read_to_string(&log).unwrap_or_default())
}
