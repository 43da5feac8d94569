//! `mediaplane bench rtsp --quick` runs in seconds and writes real results: gst-rtsp-server
//! restreaming the camera, mediaplane's proxy on the socket and eBPF planes, UDP and TCP viewers;
//! every viewer received the camera's packets, matched against the anchor; on the eBPF plane
//! the UDP viewers' copies were made by the kernel and the TCP viewers' went through the slow
//! path. Root only (namespaces, BPF); under CI=true not being root is a failure.

use serde_json::Value;
use std::process::Command;

#[test]
fn bench_rtsp_quick_writes_real_results() {
    if !mediaplane_bench::require_root("bench_rtsp_smoke") {
        return;
    }
    let out = std::env::temp_dir().join(format!("mp-bench-rtsp-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let st = Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["bench", "rtsp", "--quick", "--subjects", "gst,userspace,ebpf", "--out", out.to_str().unwrap()])
        .status()
        .expect("run mediaplane bench rtsp");
    assert!(st.success(), "bench rtsp --quick failed (see its output above)");
    let runs: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    // 1 and 3 UDP viewers and 2 TCP ones for each subject.
    assert_eq!(runs.len(), 9, "{runs:#?}");
    for r in &runs {
        let (subject, viewers, anchor) = (r["subject"].as_str().unwrap(), r["viewers"].as_u64().unwrap(), r["anchor_packets"].as_u64().unwrap());
        // 2 s of 25 fps video and 50 audio packets/s reach the anchor.
        assert!(anchor >= 100, "{r:#}");
        assert!(r["copies"].as_u64().unwrap() + 10 * viewers >= anchor * viewers, "every viewer gets about what the anchor does: {r:#}");
        assert!(r["added_delay_us"]["count"].as_u64().unwrap() > 0 && r["cpu_ns"].as_u64().unwrap() > 0, "{r:#}");
        if subject == "ebpf" {
            let (forwarded, slow) = (r["kernel_forwarded"].as_u64().unwrap(), r["slow_path"].as_u64().unwrap());
            match r["transport"].as_str().unwrap() {
                "udp" => assert!(forwarded > 0 && slow == 0, "UDP viewers' copies are the kernel's: {r:#}"),
                _ => assert!(slow > 0, "a TCP viewer's copy goes through user space: {r:#}"),
            }
        }
    }
}
