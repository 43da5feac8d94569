//! Simulcast publishers' packets for the kernel's layer tests (layers.rs through layer_ctl,
//! fuzz_test_run.rs through the TC program): VP8 and H.264 payloads whose keyframes and
//! descriptors the rewrite reads.

use super::Rng;

/// One layer's numbering as the publisher sends it.
pub struct LayerSource {
    pub seq: u16,
    pub ts: u32,
    pub pic: u16,
    pub tl0: u8,
    /// The frame's temporal layer (0-3) and layer sync bit; TID 4: the descriptor has none.
    pub tid: u8,
    pub sync: bool,
}

impl LayerSource {
    pub fn random(rng: &mut Rng) -> LayerSource {
        LayerSource { seq: rng.next() as u16, ts: rng.next() as u32, pic: rng.next() as u16 & 0x7fff, tl0: rng.next() as u8, tid: 0, sync: false }
    }

    /// A new frame: its temporal layer (0 for a keyframe; now and then none at all).
    pub fn next_frame_layer(&mut self, key: bool, rng: &mut Rng) {
        self.tid = if key {
            0
        } else if rng.chance(5) {
            4
        } else {
            rng.below_u64(4) as u8
        };
        self.sync = rng.chance(20);
    }
}

/// A VP8 payload: descriptor (picture id of 7 or 15 bits, TL0PICIDX, TID) and the first byte of
/// the payload header (P bit clear on a keyframe).
pub fn vp8_payload(src: &LayerSource, wide: bool, start: bool, key: bool, rng: &mut Rng) -> Vec<u8> {
    let temporal = src.tid < 4;
    let mut p = vec![0x80 | if start { 0x10 } else { 0 }, if temporal { 0xe0 } else { 0xd0 }];
    if wide {
        p.extend_from_slice(&[0x80 | (src.pic >> 8) as u8 & 0x7f, src.pic as u8]);
    } else {
        p.push(src.pic as u8 & 0x7f);
    }
    p.push(src.tl0);
    // TID, Y, KEYIDX (or, without T, K's key index alone).
    p.push(if temporal { src.tid << 6 | if src.sync { 0x20 } else { 0 } } else { 0x03 });
    p.push(if key { 0x10 } else { 0x11 });
    p.extend((0..rng.below_u64(20)).map(|_| rng.next() as u8));
    p
}

/// An H.264 payload: an IDR or SPS (keyframe) or a non-IDR slice, alone, in a STAP-A or an FU-A.
pub fn h264_payload(start: bool, key: bool, rng: &mut Rng) -> Vec<u8> {
    let nal = if key {
        if rng.chance(50) {
            0x65
        } else {
            0x67
        }
    } else {
        0x41
    };
    match rng.below_u64(3) {
        0 if start => {
            // STAP-A: a few units, the keyframe's anywhere among them.
            let mut p = vec![0x78];
            let n = 1 + rng.below_u64(20);
            let key_at = rng.below_u64(n);
            for i in 0..n {
                let t = if i == key_at { nal } else { 0x68 };
                let len = 1 + rng.below_u64(4) as usize;
                p.extend_from_slice(&(len as u16).to_be_bytes());
                p.push(t);
                p.extend((1..len).map(|_| rng.next() as u8));
            }
            p
        }
        1 => vec![0x7c, (if start { 0x80 } else { 0 }) | (nal & 0x1f), 1, 2, 3],
        _ => vec![if start { nal } else { 0x41 }, 9, 9],
    }
}

/// Something the rewrite must survive: truncated descriptors, odd payloads, RTP with CSRCs,
/// an extension or padding, and a few packets that are not RTP at all.
pub fn mangle(bytes: &mut Vec<u8>, rng: &mut Rng) {
    match rng.below_u64(6) {
        0 => {
            let keep = 12 + rng.below_u64(8) as usize;
            bytes.truncate(keep.min(bytes.len()));
        }
        1 => {
            // Padding: a valid count, or one longer than the packet.
            bytes[0] |= 0x20;
            let n = 1 + rng.below_u64(4) as u8;
            bytes.extend(std::iter::repeat_n(0, n as usize - 1));
            bytes.push(if rng.chance(80) { n } else { 0xff });
        }
        2 => {
            // One CSRC.
            bytes[0] |= 1;
            bytes.splice(12..12, [1, 2, 3, 4]);
        }
        3 => {
            // A one-byte-header extension of one word.
            bytes[0] |= 0x10;
            bytes.splice(12..12, [0xbe, 0xde, 0, 1, 0x10, 0xaa, 0, 0]);
        }
        4 => bytes.truncate(rng.below_u64(12) as usize),
        _ => {
            let i = 12 + rng.below_u64((bytes.len() - 12).max(1) as u64) as usize;
            if i < bytes.len() {
                bytes[i] = rng.next() as u8;
            }
        }
    }
}
