//! `mediaplane bench overload --quick`: a stranger's flood beside a conference must leave the
//! daemon alive, reach no participant, and be counted as stranger drops, in both planes.

use serde_json::Value;
use std::process::Command;

#[test]
fn overload_quick_strangers_are_dropped_and_counted_and_serve_survives() {
    if !mediaplane_bench::require_root("bench_overload_smoke") {
        return;
    }
    let out_dir = std::env::temp_dir().join(format!("mp-overload-smoke-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_mediaplane")).args(["bench", "overload", "--quick", "--out"]).arg(&out_dir).output().unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(out_dir.join("overload.json")).unwrap()).unwrap();
    assert_eq!(v.len(), 2);
    for r in &v {
        assert_eq!(r["serve_alive"], true, "{r}");
        assert_eq!(r["copies_to_strangers"], 0, "{r}");
        let (sent, dropped) = (r["flood"]["sent"].as_u64().unwrap(), r["stranger_drops"].as_u64().unwrap());
        assert!(sent > 0 && dropped > 0 && dropped <= sent, "every counted drop was sent: {r}");
        assert!(r["capacity_pps"].as_f64().unwrap() > 0.0);
        assert_eq!(r["api_errors"], 0, "the API answers during the flood: {r}");
        // The default conference publishes SSRC-narrowed streams: the XDP pre-filter still
        // drops the whole flood (every stream on the address has its owner as source).
        assert_eq!(r["streams"], "ssrc");
        if r["dataplane"] == "ebpf-xdp" {
            assert_eq!(r["xdp_drops"].as_u64(), Some(dropped), "every stranger dropped by XDP: {r}");
        }
    }
    std::fs::remove_dir_all(&out_dir).unwrap();
}

/// With streams that take any SSRC too, the eBPF plane's XDP pre-filter drops the whole flood
/// (and the A/B plane without it drops it in TC).
#[test]
fn overload_quick_wildcard_streams_xdp_drops_the_flood() {
    if !mediaplane_bench::require_root("bench_overload_smoke_xdp") {
        return;
    }
    let out_dir = std::env::temp_dir().join(format!("mp-overload-smoke-xdp-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["bench", "overload", "--quick", "--wildcard-streams", "--dataplanes", "ebpf-xdp,ebpf-noxdp", "--out"])
        .arg(&out_dir)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let v: Vec<Value> = serde_json::from_str(&std::fs::read_to_string(out_dir.join("overload.json")).unwrap()).unwrap();
    assert_eq!(v.len(), 2);
    for r in &v {
        assert_eq!((r["serve_alive"].as_bool(), r["copies_to_strangers"].as_u64()), (Some(true), Some(0)), "{r}");
        assert_eq!(r["streams"], "wildcard");
        let (sent, dropped, xdp) = (r["flood"]["sent"].as_u64().unwrap(), r["stranger_drops"].as_u64().unwrap(), r["xdp_drops"].as_u64().unwrap());
        assert!(sent > 0 && dropped > 0 && dropped <= sent, "{r}");
        if r["dataplane"] == "ebpf-xdp" {
            assert_eq!(xdp, dropped, "every stranger dropped by XDP: {r}");
            assert!(r["xdp_run_time_ns"].as_u64().unwrap() > 0, "{r}");
        } else {
            assert_eq!((xdp, r["xdp_run_time_ns"].as_u64().unwrap()), (0, 0), "no pre-filter: {r}");
        }
    }
    std::fs::remove_dir_all(&out_dir).unwrap();
}
