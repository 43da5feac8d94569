//! A bounded UDP flood: as many (or as paced) datagrams as one thread can push with `sendmmsg`,
//! for load and abuse tests. Always bounded by a duration and a packet cap.

use std::net::{SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

/// Never more than this many packets from one flood, whatever the rate.
pub const MAX_FLOOD_PACKETS: u64 = 500_000_000;
const BATCH: usize = 64;

#[derive(Debug, Clone, Copy, Default, serde::Serialize, serde::Deserialize)]
pub struct FloodReport {
    pub sent: u64,
    pub send_errors: u64,
    pub seconds: f64,
    pub rate_pps: f64,
}

/// Send `payload` to `dest` from `socket` for `duration`, at `rate_pps` (None: as fast as
/// possible), in `sendmmsg` batches of up to 64.
pub fn flood(socket: &UdpSocket, dest: SocketAddr, payload: &[u8], duration: Duration, rate_pps: Option<f64>) -> FloodReport {
    let to = socket2::SockAddr::from(dest);
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut _, iov_len: payload.len() };
    let mut hdrs: Vec<libc::mmsghdr> = (0..BATCH)
        .map(|_| {
            let mut h: libc::mmsghdr = unsafe { std::mem::zeroed() };
            h.msg_hdr.msg_name = to.as_ptr() as *mut _;
            h.msg_hdr.msg_namelen = to.len();
            h.msg_hdr.msg_iov = &mut iov;
            h.msg_hdr.msg_iovlen = 1;
            h
        })
        .collect();
    let start = Instant::now();
    let end = start + duration;
    let mut r = FloodReport::default();
    while r.sent < MAX_FLOOD_PACKETS {
        let now = Instant::now();
        if now >= end {
            break;
        }
        let mut n = BATCH;
        if let Some(rate) = rate_pps {
            // Stay on the schedule: how many packets are due by now.
            let due = (now.duration_since(start).as_secs_f64() * rate) as u64;
            if due <= r.sent + r.send_errors {
                std::thread::sleep(Duration::from_micros(100));
                continue;
            }
            n = ((due - r.sent - r.send_errors) as usize).min(BATCH);
        }
        // SAFETY: hdrs point at `iov` and `to`, both alive for the whole loop.
        let sent = unsafe { libc::sendmmsg(socket.as_raw_fd(), hdrs.as_mut_ptr(), n as u32, 0) };
        if sent > 0 {
            r.sent += sent as u64;
        } else {
            r.send_errors += 1;
            std::thread::yield_now();
        }
    }
    r.seconds = start.elapsed().as_secs_f64();
    r.rate_pps = r.sent as f64 / r.seconds.max(1e-9);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paced_flood_keeps_its_rate_and_stops_on_time() {
        let rx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let tx = UdpSocket::bind("127.0.0.1:0").unwrap();
        let r = flood(&tx, rx.local_addr().unwrap(), b"x", Duration::from_millis(300), Some(10_000.0));
        assert!(r.seconds < 0.5, "bounded in time: {r:?}");
        assert!((2_500..=3_300).contains(&r.sent), "about 3000 packets at 10 kpps: {r:?}");
    }
}
