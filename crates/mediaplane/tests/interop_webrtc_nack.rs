//! Interop, a lossy subscriber's NACKs answered by the SFU (issue 41): a headless Chromium
//! publishes 640x360 video through the SFU to a second Chromium whose downlink drops 5 % of UDP
//! at random (iptables `statistic`, in its namespace). The subscriber NACKs what it lost; the SFU
//! sends those copies again from what it sent (`core::send_history`) instead of asking the
//! publisher, whose uplink then carries no one subscriber's loss.
//!
//! Checked on every plane (a browser's copies are made in user space on each), from the pages'
//! getStats over 12 s once video flows and the daemon's stats:
//! - the subscriber NACKed (the loss bit), the SFU sent copies again (`retransmit_sent`), and the
//!   publisher received at most a quarter of the subscriber's NACKs (measured: none);
//! - the anchor, on the user-space plane with `dataplane.retransmit = false`: the publisher
//!   receives the subscriber's NACKs (at least half of them; the router coalesces repeats).
//!
//! Needs root, chromium and iptables; skipped without them, except under CI=true, where that is
//! a failure.

mod common;

use common::browser::{self, Browser};
use common::netns::NetnsServe;
use mediaplane_bench::netns::Testbed;
use serde_json::Value;
use std::time::{Duration, Instant};

const TOKEN: &str = "nack-interop-token";
const API_PORT: u16 = 7583;
const LOSS: &str = "0.05";
const MEASURE: Duration = Duration::from_secs(12);

/// What one run saw over [`MEASURE`]: NACKs the subscriber sent, NACKs the publisher received,
/// copies the SFU sent again, frames the subscriber decoded.
#[derive(Debug, Default, Clone, Copy)]
struct Seen {
    subscriber_nacks: u64,
    publisher_nacks: u64,
    resent: u64,
    frames: u64,
}

fn iptables(tb: &Testbed, op: &str) -> bool {
    let peer = &tb.peers[1];
    let args = [op, "INPUT", "-p", "udp", "-m", "statistic", "--mode", "random", "--probability", LOSS, "-j", "DROP"];
    std::process::Command::new("ip").args(["netns", "exec", &peer.ns, "iptables"]).args(args).status().is_ok_and(|s| s.success())
}

fn run(tb: &Testbed, plane: &str, retransmit: bool, dir: &std::path::Path, chromium: &str) -> Seen {
    let name = format!("{plane}-{}", if retransmit { "on" } else { "off" });
    let config = dir.join(format!("{name}.toml"));
    std::fs::write(&config, format!("[api]\ntoken = \"{TOKEN}\"\n[media]\nip = \"{}\"\n[dataplane]\nretransmit = {retransmit}\n", tb.peers[0].sfu_ip)).unwrap();
    let _serve = NetnsServe::start_on(tb, &format!("0.0.0.0:{API_PORT}"), plane, &dir.join(format!("{name}.db")), &["--reset", "-c", config.to_str().unwrap()]);
    let start = |i: usize, who: &str| {
        let bdir = dir.join(format!("{name}-{who}"));
        std::fs::create_dir_all(&bdir).unwrap();
        let origin = format!("http://{}:{API_PORT}", tb.peers[i].sfu_ip);
        let page = format!("{origin}/?room=nack&name={who}&join=1&token={TOKEN}&size=640x360");
        let mut launcher = tb.command(&tb.peers[i].ns, chromium);
        launcher.arg(format!("--unsafely-treat-insecure-origin-as-secure={origin}"));
        Browser::start(launcher, &bdir, &page)
    };
    let publisher = start(0, "pub");
    let viewer = start(1, "sub");
    let read = |publisher: &Browser, viewer: &Browser| -> Seen {
        let v = viewer.page_stats().map(|s| s["received"]["pub"]["in_video"].clone()).unwrap_or(Value::Null);
        let p = publisher.page_stats().map(|s| s["sent"]["out_video"].clone()).unwrap_or(Value::Null);
        let stats = common::netns::try_api_as(tb, &format!("127.0.0.1:{API_PORT}"), Some(TOKEN), "GET", "/v1/stats", None).unwrap_or_default();
        let extra = |k: &str| stats["extra"][k].as_u64().or(stats["extra"][format!("userspace.{k}")].as_u64()).unwrap_or(0);
        Seen {
            subscriber_nacks: v["nacks"].as_u64().unwrap_or(0),
            publisher_nacks: p["nacks"].as_u64().unwrap_or(0),
            resent: extra("retransmit_sent"),
            frames: v["frames_decoded"].as_u64().unwrap_or(0),
        }
    };
    // Video flows first (the loss from then on: the handshakes are not what is measured).
    let deadline = Instant::now() + Duration::from_secs(30);
    while read(&publisher, &viewer).frames == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(300));
    }
    assert!(iptables(tb, "-A"), "iptables in {}", tb.peers[1].ns);
    let before = read(&publisher, &viewer);
    std::thread::sleep(MEASURE);
    let after = read(&publisher, &viewer);
    assert!(iptables(tb, "-D"), "iptables -D in {}", tb.peers[1].ns);
    drop((publisher, viewer));
    let seen = Seen {
        subscriber_nacks: after.subscriber_nacks.saturating_sub(before.subscriber_nacks),
        publisher_nacks: after.publisher_nacks.saturating_sub(before.publisher_nacks),
        resent: after.resent.saturating_sub(before.resent),
        frames: after.frames.saturating_sub(before.frames),
    };
    eprintln!("  [{name}] {seen:?} (before: {before:?})");
    seen
}

#[test]
fn a_lossy_subscribers_nacks_are_answered_by_the_sfu_not_the_publisher() {
    if !mediaplane_bench::require_root("interop_webrtc_nack") {
        return;
    }
    let Some(chromium) = browser::chromium("interop_webrtc_nack") else { return };
    if mediaplane_bench::sip::missing(&["iptables"]).is_some() {
        assert!(std::env::var("CI").as_deref() != Ok("true"), "iptables is not installed (make deps installs it)");
        eprintln!("skipped: iptables is not installed");
        return;
    }
    let tb = Testbed::star(2).expect("testbed");
    let dir = common::TempDir::new("webrtc-nack");
    let mut failures = Vec::new();
    for plane in common::planes() {
        let s = run(&tb, &plane, true, &dir.0, &chromium);
        // At most a quarter reach the publisher: what the SFU never sent (lost before it, e.g.
        // its slow path behind on a loaded machine) is the publisher's to send. Measured 0 of
        // 13-29 here; 24 of 51 once in a loaded CI run before a held copy's repeated NACKs were
        // kept from the publisher.
        if !(s.frames > 100 && s.subscriber_nacks >= 10 && s.resent > 0 && s.publisher_nacks * 4 <= s.subscriber_nacks) {
            failures.push(format!("{plane}: the SFU did not answer the subscriber's NACKs itself: {s:?}"));
        }
    }
    let anchor = run(&tb, "userspace", false, &dir.0, &chromium);
    if !(anchor.subscriber_nacks >= 10 && anchor.resent == 0 && anchor.publisher_nacks * 2 >= anchor.subscriber_nacks) {
        failures.push(format!("anchor (retransmit off): the publisher did not get the subscriber's NACKs: {anchor:?}"));
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
