//! One live daemon per pin dir: a second `serve --dataplane ebpf` on the pins of a live one
//! refuses to start (naming the pin dir and the holder's PID) and the first keeps forwarding;
//! `--adopt-live-pins` overrides. (A dead instance's pins are adopted without it:
//! hitless_restart.rs.)

mod common;

use common::netns::NetnsServe;
use common::TempDir;
use mediaplane_bench::netns::Testbed;
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use std::net::{SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::time::Duration;

/// Removes the pin directory (which detaches pinned links) if a failed test left it.
struct PinGuard(PathBuf);
impl Drop for PinGuard {
    fn drop(&mut self) {
        let _ = mediaplane_ebpf::remove_pins(&self.0);
    }
}

/// Second daemon's API (the first is on common::netns::API), inside the SFU namespace.
const SECOND_API: &str = "127.0.0.1:7581";

/// `n` RTP packets from `tx` to `to`; the sequence numbers `rx` received, in order.
fn media(tx: &UdpSocket, rx: &UdpSocket, to: SocketAddr, base: u16, n: u16) -> Vec<u16> {
    for seq in base..base + n {
        tx.send_to(&build_rtp(0, seq, 0, 1, &[3; 160]), to).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    rx.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
    let mut buf = [0u8; 2048];
    let mut got = Vec::new();
    while let Ok((len, _)) = rx.recv_from(&mut buf) {
        got.push(RtpHeader::parse(&buf[..len]).unwrap().sequence);
    }
    got
}

#[test]
fn a_second_serve_on_live_pins_is_refused_unless_told_to_adopt_them() {
    if !mediaplane_bench::require_root("pin_lock") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-lock", tb.prefix));
    let _guard = PinGuard(pin_dir.clone());
    // Both stores (and SQLite's -wal/-shm beside them) go with the directory, pass or fail.
    let tmp = TempDir::new(&format!("{}-lock", tb.prefix));
    let (store, store2) = (tmp.0.join("first.db"), tmp.0.join("second.db"));
    let pins = ["--pin-dir", pin_dir.to_str().unwrap()];
    let (p0, p1) = (&tb.peers[0], &tb.peers[1]);
    let sfu0 = SocketAddr::new(p0.sfu_ip, 40000);

    let mut first = NetnsServe::start_shared_bpffs(&tb, "ebpf", &store, &[&pins[..], &["--reset"]].concat());
    first.two_party_room();
    let tx = tb.udp_socket(&p0.ns, SocketAddr::new(p0.ip, 5004)).unwrap();
    let rx = tb.udp_socket(&p1.ns, SocketAddr::new(p1.ip, 5004)).unwrap();
    // Warm-up (neighbour resolution), then the kernel path carries the stream.
    assert_eq!(media(&tx, &rx, sfu0, 0, 10).len(), 10, "the first daemon forwards");
    let forwarded = |s: &NetnsServe| s.api("GET", "/v1/stats", None)["extra"]["forwarded"].as_u64().unwrap();
    let before = forwarded(&first);

    // A second daemon on the same pins, with or without --reset: refused, nothing touched.
    for extra in [&[][..], &["--reset"][..]] {
        let (status, stderr) = NetnsServe::run_to_exit(&tb, SECOND_API, "ebpf", &store2, &[&pins[..], extra].concat(), Duration::from_secs(20));
        assert!(!status.success(), "the second daemon {extra:?} must fail: {status:?}\n{stderr}");
        assert!(stderr.contains(&pin_dir.display().to_string()), "names the pin dir: {stderr}");
        assert!(stderr.contains(&format!("pid {}", first.pid())), "names the holder: {stderr}");
        assert!(stderr.contains("live") && stderr.contains("--adopt-live-pins"), "{stderr}");
        assert!(!store2.exists(), "refused before opening its store");
    }
    assert!(pin_dir.join("streams").exists(), "the live instance's pins are still there");
    assert_eq!(media(&tx, &rx, sfu0, 100, 50), (100..150).collect::<Vec<u16>>(), "the first daemon still forwards, every packet once");
    assert!(forwarded(&first) >= before + 50, "in the kernel: {} -> {}", before, forwarded(&first));

    // --adopt-live-pins: it starts (sharing the maps: the documented danger).
    let mut second = NetnsServe::start_shared_bpffs_on(&tb, SECOND_API, "ebpf", &store2, &[&pins[..], &["--adopt-live-pins"]].concat());
    assert_eq!(second.api("GET", "/health", None)["status"], "ok");
    // It dies without cleaning up, the first shuts down gracefully: every pin is gone.
    second.kill9();
    assert!(first.terminate(), "graceful shutdown of the first daemon");
    assert!(!pin_dir.exists(), "a graceful shutdown removes the pins");
}
