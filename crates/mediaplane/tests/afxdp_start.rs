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
