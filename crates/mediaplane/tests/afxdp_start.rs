//! The AF_XDP plane says at start what it cannot do, and what it got: zero-copy asked of a
//! driver that has none (veth) and the loopback interface are start-up errors naming the fix,
//! and leave no XDP program behind; `auto` binds veth in copy mode and says so.

mod common;

use common::netns::{NetnsServe, API};
use mediaplane_bench::netns::Testbed;
use std::time::Duration;

/// Whether `ifname` in the SFU namespace carries an XDP program.
fn has_xdp(tb: &Testbed, ifname: &str) -> bool {
    let out = tb.command(&tb.sfu_ns, "ip").args(["-d", "link", "show", "dev", ifname]).output().unwrap();
    assert!(out.status.success(), "ip link show {ifname}");
    String::from_utf8_lossy(&out.stdout).contains("prog/xdp")
}

#[test]
fn afxdp_refuses_what_it_cannot_run_on_and_says_what_it_bound() {
    if !mediaplane_bench::require_root("afxdp_refuses_what_it_cannot_run_on_and_says_what_it_bound") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let dir = common::TempDir::new("afxdp-start");
    let store = dir.0.join("store.db");
    let zerocopy = dir.0.join("zerocopy.toml");
    std::fs::write(&zerocopy, "[dataplane]\nafxdp_mode = \"zerocopy\"\n").unwrap();

    let (status, err) = NetnsServe::run_to_exit(&tb, API, "afxdp", &store, &["--reset", "--config", zerocopy.to_str().unwrap()], Duration::from_secs(20));
    assert!(!status.success(), "zero-copy on veth must not start: {err}");
    assert!(err.contains("zero-copy bind") && err.contains("afxdp_mode"), "the error names the mode and the fix: {err}");
    for p in &tb.peers {
        assert!(!has_xdp(&tb, &p.sfu_if), "{}: an XDP program left behind after a failed start", p.sfu_if);
    }

    let (status, err) = NetnsServe::run_to_exit(&tb, API, "afxdp", &store, &["--reset", "--interface", "lo"], Duration::from_secs(20));
    assert!(!status.success(), "loopback must not start: {err}");
    assert!(err.contains("loopback"), "the error says loopback: {err}");

    // The default binds veth in copy mode (it has no zero-copy) and says so.
    let s = NetnsServe::start(&tb, "afxdp", &store, &["--reset"]);
    let extra = &s.api("GET", "/v1/stats", None)["extra"];
    assert_eq!(extra["afxdp_zero_copy_queues"], 0, "{extra}");
    for p in &tb.peers {
        assert!(has_xdp(&tb, &p.sfu_if), "{}: the plane's XDP program", p.sfu_if);
    }
    drop(s);
    for p in &tb.peers {
        assert!(!has_xdp(&tb, &p.sfu_if), "{}: the XDP program detached at shutdown", p.sfu_if);
    }
}

/// On a host that does not forward (most media servers: `ip_forward` 0), the plane still takes
/// every datagram by AF_XDP and sends every copy by its rings; a source is judged by the input
/// route lookup, which needs no forwarding (`bpf_fib_lookup` answers nothing there).
#[test]
fn afxdp_forwards_on_a_host_that_does_not_forward() {
    if !mediaplane_bench::require_root("afxdp_forwards_on_a_host_that_does_not_forward") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    for key in ["net.ipv4.ip_forward=0", "net.ipv4.conf.all.rp_filter=1", "net.ipv4.conf.default.rp_filter=1"] {
        assert!(tb.command(&tb.sfu_ns, "sysctl").args(["-qw", key]).status().unwrap().success(), "{key}");
    }
    let dir = common::TempDir::new("afxdp-nofwd");
    let s = NetnsServe::start(&tb, "afxdp", &dir.0.join("store.db"), &["--reset"]);
    let sfu = |i: usize| std::net::SocketAddr::new(tb.peers[i].sfu_ip, 40000);
    let peer = |i: usize| std::net::SocketAddr::new(tb.peers[i].ip, 5004);
    s.api("POST", "/v1/rooms", Some(serde_json::json!({"id": "r"})));
    for i in 0..2 {
        s.api("POST", "/v1/rooms/r/participants", Some(serde_json::json!({"id": format!("p{i}"), "local": sfu(i), "remote": peer(i)})));
    }
    s.api("POST", "/v1/rooms/r/participants/p0/streams", Some(serde_json::json!({"name": "main"})));
    s.api("POST", "/v1/rooms/r/participants/p1/subscriptions", Some(serde_json::json!({"publisher": "p0", "stream": "main"})));
    let socks: Vec<std::net::UdpSocket> = (0..2).map(|i| tb.udp_socket(&tb.peers[i].ns, peer(i)).unwrap()).collect();
    // The SFU's neighbour entry for p1 first, as a real participant's signalling would make it.
    socks[1].send_to(b"", std::net::SocketAddr::new(tb.peers[1].sfu_ip, 9)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    for seq in 0..20u16 {
        socks[0].send_to(&mediaplane_core::rtp::build_rtp(0, seq, 0, 42, &[seq as u8; 160]), sfu(0)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(300));
    socks[1].set_nonblocking(true).unwrap();
    let mut buf = [0u8; 2048];
    let mut got = 0;
    while let Ok((_, from)) = socks[1].recv_from(&mut buf) {
        assert_eq!(from, sfu(1), "copies come from p1's SFU address");
        got += 1;
    }
    let extra = &s.api("GET", "/v1/stats", None)["extra"];
    assert_eq!(got, 20, "every packet reached the subscriber: {extra}");
    assert_eq!((extra["xsk_redirected"].as_u64(), extra["afxdp_tx_frames"].as_u64()), (Some(20), Some(20)), "all by AF_XDP: {extra}");
    assert_eq!(extra["afxdp_rx_spoofed"].as_u64(), Some(0), "{extra}");
}

/// If the AF_XDP thread fails (here on purpose: MEDIAPLANE_AFXDP_FAIL_AFTER, debug builds), the
/// media carries on by the plane's sockets: the thread's sockets close as it unwinds, their
/// XSKMAP slots empty, and the XDP program passes the datagrams to the stack. Only what was on
/// its rings then is lost; the failure is logged and shown (afxdp_thread_failed).
#[test]
fn a_failed_afxdp_thread_leaves_the_media_to_the_sockets() {
    if !mediaplane_bench::require_root("a_failed_afxdp_thread_leaves_the_media_to_the_sockets") {
        return;
    }
    let tb = Testbed::star(2).unwrap();
    let dir = common::TempDir::new("afxdp-fail");
    // No backtrace: printing one (as under RUST_BACKTRACE=1) keeps the failed thread's sockets,
    // and what reaches them, for as long as it takes.
    let env = [("MEDIAPLANE_AFXDP_FAIL_AFTER", "10"), ("RUST_BACKTRACE", "0")];
    let s = NetnsServe::start_with_env(&tb, "afxdp", &dir.0.join("store.db"), &["--reset"], &env);
    let sfu = |i: usize| std::net::SocketAddr::new(tb.peers[i].sfu_ip, 40000);
    let peer = |i: usize| std::net::SocketAddr::new(tb.peers[i].ip, 5004);
    s.api("POST", "/v1/rooms", Some(serde_json::json!({"id": "r"})));
    for i in 0..2 {
        s.api("POST", "/v1/rooms/r/participants", Some(serde_json::json!({"id": format!("p{i}"), "local": sfu(i), "remote": peer(i)})));
    }
    s.api("POST", "/v1/rooms/r/participants/p0/streams", Some(serde_json::json!({"name": "main"})));
    s.api("POST", "/v1/rooms/r/participants/p1/subscriptions", Some(serde_json::json!({"publisher": "p0", "stream": "main"})));
    let socks: Vec<std::net::UdpSocket> = (0..2).map(|i| tb.udp_socket(&tb.peers[i].ns, peer(i)).unwrap()).collect();
    socks[1].send_to(b"", std::net::SocketAddr::new(tb.peers[1].sfu_ip, 9)).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    const SENT: u16 = 40;
    for seq in 0..SENT {
        socks[0].send_to(&mediaplane_core::rtp::build_rtp(0, seq, 0, 42, &[seq as u8; 160]), sfu(0)).unwrap();
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(300));
    socks[1].set_nonblocking(true).unwrap();
    let mut buf = [0u8; 2048];
    let mut got = 0u16;
    while socks[1].recv_from(&mut buf).is_ok() {
        got += 1;
    }
    let stats = s.api("GET", "/v1/stats", None);
    let extra = &stats["extra"];
    assert_eq!(extra["afxdp_thread_failed"], 1, "{extra}");
    assert!(s.api("GET", "/health", None).is_object(), "the daemon is up");
    // Ten went by AF_XDP; the eleventh was on the ring as the thread failed; the rest by the sockets.
    assert!(got >= SENT - 1, "{got} of {SENT} reached the subscriber after the AF_XDP thread failed: {extra}");
    assert_eq!(extra["afxdp_tx_frames"], 10, "{extra}");
}
