//! `mediaplane bench relay --quick` runs in seconds and writes its outputs with real data:
//! every relay carried every call of both sizes, plain and bridged from SDES-SRTP to RTP,
//! mediaplane without loss, and the capacity phase installed sessions through NG and HTTP. Root only (namespaces, BPF); under CI=true not being
//! root is a failure.

use serde_json::Value;
use std::process::Command;

#[test]
fn bench_relay_quick_writes_real_results() {
    if !mediaplane_bench::require_root("bench_relay_smoke") {
        return;
    }
    let out = std::env::temp_dir().join(format!("mp-bench-relay-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let have_rtpengine = Command::new("rtpengine").arg("--version").output().is_ok();
    // The comparison is the point of the bench: under CI (which installs it) its absence fails.
    assert!(have_rtpengine || !mediaplane_bench::in_ci(), "rtpengine is missing under CI (make deps installs rtpengine-daemon)");
    if !have_rtpengine {
        eprintln!("bench_relay_smoke: rtpengine not installed: running without the rtpengine column");
    }
    let relays =
        if have_rtpengine { "mediaplane-userspace,mediaplane-ebpf,rtpengine,kernel-forward" } else { "mediaplane-userspace,mediaplane-ebpf,kernel-forward" };
    let st = Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["bench", "relay", "--quick", "--media", "rtp,sdes-rtp", "--relays", relays, "--out", out.to_str().unwrap()])
        .status()
        .expect("run mediaplane bench relay");
    assert!(st.success(), "bench relay --quick failed (see its output above)");

    let json: Value = serde_json::from_str(&std::fs::read_to_string(out.join("results.json")).unwrap()).unwrap();
    let runs = json["runs"].as_array().unwrap();
    // Two sizes of every relay with plain RTP, and of every relay but kernel-forward bridged.
    let n = relays.split(',').count();
    assert_eq!(runs.len(), n * 2 + (n - 1) * 2, "{json:#}");
    for r in runs {
        let (relay, calls) = (r["relay"].as_str().unwrap(), r["calls"].as_u64().unwrap());
        let bridged = r["media"] == "sdes-rtp";
        assert!(bridged || r["media"] == "rtp", "{r:#}");
        assert_eq!(r["srtp_failed"], 0, "every packet the relay protected toward the caller unprotects: {r:#}");
        assert_eq!(r["srtp_replayed"], 0, "no duplicate on an SRTP leg: {r:#}");
        // The caller's packets are protected by the generator, and only then.
        assert_eq!(r["generator_srtp_protect_p50_ns"].as_f64().is_some_and(|p| p > 0.0), bridged, "{r:#}");
        assert_eq!(r["calls_up"], calls, "{r:#}");
        assert_eq!(r["setup_failures"], 0, "{r:#}");
        let sent = r["sent"].as_u64().unwrap();
        assert!(sent >= calls * 2 * 45, "two legs of 50 packets/s for 1 s: {r:#}");
        assert!(r["delay_ns"]["p50"].as_f64().unwrap() > 0.0, "{r:#}");
        // Tick-sampled (10 ms): a 1 s quick run may see no busy tick at all, so only its presence.
        assert!(r["machine_cpu_per_packet_ns"].as_f64().is_some(), "{r:#}");
        if relay == "kernel-forward" {
            // The baseline: no relay, no signalling, every packet routed through.
            assert_eq!((r["relay_cpu_ns"].as_u64(), r["offer_ns"]["count"].as_u64()), (Some(0), Some(0)), "{r:#}");
            assert_eq!(r["received"], sent, "{r:#}");
            continue;
        }
        assert!(r["offer_ns"]["count"].as_u64() == Some(calls), "{r:#}");
        // Added delay = through the relay minus the kernel-forward run at the same size.
        let floor = runs.iter().find(|b| b["relay"] == "kernel-forward" && b["calls"] == calls).unwrap();
        let added = r["delay_ns"]["p50"].as_f64().unwrap() - floor["delay_ns"]["p50"].as_f64().unwrap();
        assert!((r["added_delay_p50_ns"].as_f64().unwrap() - added).abs() < 1.0, "{r:#}");
        assert!(r["relay_cpu_ns"].as_u64().unwrap() > 0, "{r:#}");
        if relay.starts_with("mediaplane") {
            assert_eq!(r["lost"], 0, "mediaplane relays without loss: {r:#}");
            assert_eq!(r["received"], sent, "{r:#}");
            assert_eq!(r["legs_latched"], r["legs"], "{r:#}");
            assert_eq!(r["left_after_delete"], 0, "delete frees every relay: {r:#}");
        } else {
            assert!(r["received"].as_u64().unwrap() * 10 >= sent * 9, "{r:#}");
        }
        if relay == "mediaplane-ebpf" && bridged {
            // SRTP is terminated in user space (no AES-CM/HMAC in BPF): both directions go up.
            assert_eq!((r["kernel_forwarded"].as_u64(), r["slow_path_rx"].as_u64()), (Some(0), Some(sent)), "{r:#}");
        } else if relay == "mediaplane-ebpf" {
            assert_eq!(r["kernel_forwarded"], sent, "forwarded by the kernel: {r:#}");
            assert_eq!(r["slow_path_rx"], 0, "{r:#}");
            assert!(r["bpf_run_ns"].as_u64().unwrap() > 0, "{r:#}");
        }
    }
    let ramps = json["capacity"]["ramps"].as_array().unwrap();
    let apis: Vec<&str> = ramps.iter().map(|r| r["api"].as_str().unwrap()).collect();
    assert_eq!(apis, ["ng", "http", "http-batch1000"], "{json:#}");
    for r in ramps {
        assert_eq!(r["installed"], r["target"], "{r:#}");
        assert!(r["samples"].as_array().unwrap().iter().all(|s| s["rss_kib"].as_u64().unwrap() > 0), "{r:#}");
    }
    assert!(!json["capacity"]["mutation_cost"].as_array().unwrap().is_empty());

    let csv = std::fs::read_to_string(out.join("results.csv")).unwrap();
    assert_eq!(csv.lines().count(), runs.len() + 1);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    for plot in ["relay_loss.svg", "relay_cpu_per_packet.svg", "capacity_rate.svg"] {
        assert!(html.contains(plot), "{plot} in the report");
        let svg = std::fs::read_to_string(out.join(plot)).unwrap();
        assert!(svg.contains("<svg") && (svg.contains("polyline") || svg.contains("<path")), "{plot} has data");
    }
    std::fs::remove_dir_all(&out).unwrap();
}
