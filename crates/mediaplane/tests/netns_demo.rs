//! The demo as a test: a real conference in network namespaces through `mediaplane serve`.
//! `demo` exits non-zero on any loss, duplicate or unexpected copy, or if a data plane fails;
//! the JSON results are checked copy by copy here as well, for every data plane the demo ran, and
//! its output must show the WebRTC room on each (the demo refuses to start without Chromium).

use serde_json::Value;
use std::process::Command;

/// One demo at a time: each runs three Chromiums per data plane, and two demos side by side on
/// a 2-core CI machine starve the browsers (a page then misses a keyframe for the whole wait).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The demo's default data planes, each of which must report.
const PLANES: [&str; 2] = ["userspace", "ebpf"];

fn demo(tag: &str, args: &[&str]) -> Vec<Value> {
    let _turn = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let json = std::env::temp_dir().join(format!("mp-demo-{tag}-{}.json", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_mediaplane")).arg("demo").args(args).arg("--json").arg(&json).output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "demo failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    std::fs::remove_file(&json).unwrap();
    let ran: Vec<&str> = v.iter().map(|r| r["dataplane"].as_str().unwrap_or("?")).collect();
    assert_eq!(ran, PLANES, "every data plane reports:\n{stdout}");
    for plane in PLANES {
        assert!(stdout.contains(&format!("[{plane}] WebRTC room: 3 browsers")), "the WebRTC room ran on {plane}:\n{stdout}");
    }
    v
}

#[test]
fn four_participants_one_stream_each() {
    if !mediaplane_bench::require_root("four_participants_one_stream_each") {
        return;
    }
    for r in &demo("one", &["--participants", "4", "--seconds", "1"]) {
        // 4 participants x 3 streams x 50 packets, each exactly once.
        assert_eq!(r["copies_expected"], 600, "{}", r["dataplane"]);
        assert_eq!(r["copies_received"], 600, "{}", r["dataplane"]);
        assert_eq!((r["lost"].as_u64(), r["duplicates"].as_u64(), r["unexpected"].as_u64()), (Some(0), Some(0), Some(0)), "{}", r["dataplane"]);
        assert_eq!(r["daemon_stats"]["total"]["tx_copies"], 600, "{}", r["dataplane"]);
    }
}

#[test]
fn two_qualities_only_upper_half_gets_high() {
    if !mediaplane_bench::require_root("two_qualities_only_upper_half_gets_high") {
        return;
    }
    for r in &demo("two", &["--participants", "4", "--seconds", "1", "--two-streams"]) {
        // p0, p1 get the 3 others' low streams; p2, p3 also their high streams.
        for (i, streams) in [3, 3, 6, 6].into_iter().enumerate() {
            let p = &r["participants"][i];
            assert_eq!(p["streams"], streams, "{}: {p}", r["dataplane"]);
            assert_eq!(p["expected"], streams * 50, "{}: {p}", r["dataplane"]);
            assert_eq!(p["received"], p["expected"], "{}: {p}", r["dataplane"]);
            assert_eq!(p["unexpected"], 0, "{}: {p}", r["dataplane"]);
        }
    }
}
