//! Interop, NG statistics: the same call through rtpengine 10.5 and through `mediaplane serve`
//! on each data plane, in a namespace testbed (caller and callee in namespaces of their own):
//! G.711 RTP both ways for 4 s, and every 500 ms an RTCP SR each way whose report block echoes
//! the last SR the party heard (LSR/DLSR), so that rtpengine computes a MOS. Then:
//!
//! * `query` and `statistics` of each relay: mediaplane's carry every key path of rtpengine's
//!   live replies, with the same types (the per-SSRC MOS blocks included);
//!   rtpengine's live replies carry the reference paths the unit tests hold mediaplane to
//!   (tests/data), so that reference cannot go stale; the counts agree between the relays.
//! * Kamailio's rtpengine module reads a BYE's `delete` reply into its MOS AVPs (`mos_*_pv`) and
//!   `$rtpstat` (a `query`): its log lines are compared between rtpengine and mediaplane —
//!   `$rtpstat` exactly; the MOS AVPs within what timing explains (which SR falls into
//!   rtpengine's one-sample-per-second window varies); so are `statistics`' MOS totals. The
//!   round-trip AVP of each relay, rtpengine's included, is held to the round trips its run's
//!   parties measured themselves (the host's timing differs between runs).
//!
//! Needs root, kamailio (+ its rtpengine module) and rtpengine; skipped otherwise, except under
//! CI=true, where that is a failure. MP_KEEP_TMP=1 keeps the run's directory.

mod common;
mod ng_common;

use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::build_rtp;
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup, NG};
use mediaplane_ng::bencode::Value;
use ng_common::*;
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const CALL: &str = "ng-stats-interop@interop_ng_stats.test";
const KAMAILIO: &str = "127.0.0.1:5060";
const PACKETS: u16 = 200;
const SSRC_CALLER: u32 = 0x11111111;
const SSRC_CALLEE: u32 = 0x22222222;

fn kamailio_cfg(modules: &Path) -> String {
    let modparams = [
        ("mos_min_pv", "mos_min"),
        ("mos_max_pv", "mos_max"),
        ("mos_average_pv", "mos_average"),
        ("mos_average_packetloss_pv", "mos_average_packetloss"),
        ("mos_average_jitter_pv", "mos_average_jitter"),
        ("mos_average_roundtrip_pv", "mos_average_roundtrip"),
        ("mos_average_samples_pv", "mos_average_samples"),
    ]
    .map(|(param, avp)| format!("modparam(\"rtpengine\", \"{param}\", \"$avp({avp})\")\n"))
    .concat();
    let route = r#"    if (is_method("BYE")) {
        xlog("L_NOTICE", "NGSTATS rtpstat=[$rtpstat]\n");
        rtpengine_delete();
        xlog("L_NOTICE", "NGSTATS mos min=[$avp(mos_min)] max=[$avp(mos_max)] average=[$avp(mos_average)] packetloss=[$avp(mos_average_packetloss)] jitter=[$avp(mos_average_jitter)] roundtrip=[$avp(mos_average_roundtrip)] samples=[$avp(mos_average_samples)]\n");
        sl_send_reply("200", "OK");
    }"#;
    sip::script(KAMAILIO.parse().unwrap(), NG.parse().unwrap(), modules, &modparams, route)
}

/// Fraction lost (of 256) every report block gives: 1 % in the MOS blocks.
const FRACTION_LOST: u32 = 5;

/// An RTCP SR of `ssrc` with one report block about `about`, echoing `lsr` (the middle 32 bits
/// of the NTP time of the last SR heard from `about`) and the delay since then.
fn sender_report(ssrc: u32, about: u32, sent: u32, heard: Option<(u32, Instant)>) -> Vec<u8> {
    let now = ntp_now();
    let (lsr, dlsr) = heard.map_or((0, 0), |(lsr, at)| (lsr, (at.elapsed().as_secs_f64() * 65536.0) as u32));
    let frac = ((now.subsec_nanos() as u64) << 32) / 1_000_000_000;
    let mut p = vec![0x81, 200, 0, 12];
    for w in [ssrc, now.as_secs() as u32, frac as u32, sent * 160, sent, sent * 172, about, FRACTION_LOST << 24 | 2, sent, 20, lsr, dlsr] {
        p.extend_from_slice(&w.to_be_bytes());
    }
    p
}

/// The wall clock as an NTP time (since 1900).
fn ntp_now() -> Duration {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap() + Duration::from_secs(2_208_988_800)
}

/// The round-trip time (µs) a party measures, as RFC 3550 §6.4.1 has it, from an SR that
/// reaches it now: its report block echoes the party's own last SR (LSR) and the delay since
/// (DLSR). None when it echoes none yet.
fn endpoint_rtt_us(p: &[u8]) -> Option<f64> {
    if p.len() < 52 || p[1] != 200 || p[0] & 0x1f == 0 {
        return None;
    }
    let (lsr, dlsr) = (u32::from_be_bytes(p[44..48].try_into().unwrap()), u32::from_be_bytes(p[48..52].try_into().unwrap()));
    let now = ntp_now();
    let middle = (now.as_secs() as u32) << 16 | ((((now.subsec_nanos() as u64) << 32) / 1_000_000_000) >> 16) as u32;
    (lsr != 0).then(|| middle.wrapping_sub(lsr).wrapping_sub(dlsr) as f64 * 1e6 / 65536.0)
}

/// The LSR of a received SR (the middle 32 bits of its NTP time).
fn lsr_of(p: &[u8]) -> Option<u32> {
    (p.len() >= 28 && p[1] == 200).then(|| u32::from_be_bytes([p[10], p[11], p[12], p[13]]))
}

/// RTP both ways at 50 packets/s and an SR each way every 25 packets; the longest round trip
/// (µs) either party measured from the SRs it received (through the relay both ways).
fn media(rtp: [(&UdpSocket, SocketAddr, u32); 2], rtcp: [(&UdpSocket, SocketAddr, u32); 2]) -> f64 {
    for (s, _, _) in rtp.iter().chain(rtcp.iter()) {
        s.set_nonblocking(true).unwrap();
    }
    let mut heard: [Option<(u32, Instant)>; 2] = [None, None];
    let mut longest = 0f64;
    let start = Instant::now();
    let mut buf = [0u8; 2048];
    for seq in 0..PACKETS {
        std::thread::sleep((start + Duration::from_millis(20) * seq as u32).saturating_duration_since(Instant::now()));
        for (s, to, ssrc) in rtp {
            s.send_to(&build_rtp(8, seq, seq as u32 * 160, ssrc, &[0xd5; 160]), to).unwrap();
        }
        if seq % 25 == 10 {
            for (i, (s, to, ssrc)) in rtcp.iter().enumerate() {
                let about = rtcp[1 - i].2;
                s.send_to(&sender_report(*ssrc, about, seq as u32, heard[i]), *to).unwrap();
            }
            // Each party notes when the other's SR reached it to within 0.1 ms (its DLSR counts
            // from then), so the round-trip times are the relay's and the network's, not the
            // test's polling.
            let (fresh, deadline) = ([heard[0].map(|h| h.0), heard[1].map(|h| h.0)], Instant::now() + Duration::from_millis(10));
            while Instant::now() < deadline && (0..2).any(|i| heard[i].map(|h| h.0) == fresh[i]) {
                for (i, (s, _, _)) in rtcp.iter().enumerate() {
                    while let Ok((n, _)) = s.recv_from(&mut buf) {
                        if let Some(lsr) = lsr_of(&buf[..n]) {
                            heard[i] = Some((lsr, Instant::now()));
                            longest = longest.max(endpoint_rtt_us(&buf[..n]).unwrap_or(0.0));
                        }
                    }
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        }
        for (s, _, _) in rtp {
            while s.recv_from(&mut buf).is_ok() {}
        }
        for (i, (s, _, _)) in rtcp.iter().enumerate() {
            while let Ok((n, _)) = s.recv_from(&mut buf) {
                if let Some(lsr) = lsr_of(&buf[..n]) {
                    heard[i] = Some((lsr, Instant::now()));
                    longest = longest.max(endpoint_rtt_us(&buf[..n]).unwrap_or(0.0));
                }
            }
        }
    }
    longest
}

struct Run {
    query: Value,
    statistics: Value,
    /// Kamailio's `$rtpstat` and its MOS AVPs after `rtpengine_delete`, as it logged them.
    rtpstat: String,
    mos: String,
    /// The longest round trip the parties measured themselves, µs ([`media`]).
    endpoint_rtt_us: f64,
}

fn run(relay: &str, tmp: &Path) -> Run {
    let tb = Testbed::star(2).expect("testbed");
    let (caller, callee) = (&tb.peers[0], &tb.peers[1]);
    let mut relay_proc = RelayProc::start_binary(&tb, relay, tmp, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &RelaySetup::default())
        .unwrap_or_else(|e| panic!("starting {relay}: {e:#}"));
    let dir = tmp.join(relay);
    std::fs::create_dir_all(&dir).unwrap();
    let launcher = tb.command(&tb.sfu_ns, sip::which("kamailio").unwrap().to_str().unwrap());
    let mut kamailio = sip::Kamailio::start_script(launcher, &kamailio_cfg(&sip::kamailio_module_dir().unwrap()), 5060, &dir)
        .unwrap_or_else(|e| panic!("starting kamailio: {e}"));
    let log = kamailio.log.clone();

    let (cip, eip) = (caller.ip.to_string(), callee.ip.to_string());
    let offer = ng_in(&tb, offer_answer("offer", CALL, "caller-tag", None, &sdp(&cip, 6000, 1), &cip));
    let to_callee = advertised(&offer);
    let answer = ng_in(&tb, offer_answer("answer", CALL, "caller-tag", Some("callee-tag"), &sdp(&eip, 7000, 2), &eip));
    let to_caller = advertised(&answer);
    let rtcp = |a: SocketAddr| SocketAddr::new(a.ip(), a.port() + 1);
    let sock = |ns: &str, ip, port| tb.udp_socket(ns, SocketAddr::new(ip, port)).unwrap();
    let (a, a_rtcp) = (sock(&caller.ns, caller.ip, 6000), sock(&caller.ns, caller.ip, 6001));
    let (b, b_rtcp) = (sock(&callee.ns, callee.ip, 7000), sock(&callee.ns, callee.ip, 7001));
    let endpoint_rtt_us =
        media([(&a, to_caller, SSRC_CALLER), (&b, to_callee, SSRC_CALLEE)], [(&a_rtcp, rtcp(to_caller), SSRC_CALLER), (&b_rtcp, rtcp(to_callee), SSRC_CALLEE)]);
    std::thread::sleep(Duration::from_millis(300));
    let query = ng_in(&tb, vec![("command", "query".into()), ("call-id", CALL.into())]);
    let statistics = ng_in(&tb, vec![("command", "statistics".into())]);

    // The BYE, as a SIP UA sends it through the proxy: Kamailio deletes the call over NG.
    let bye = tb
        .in_ns(&tb.sfu_ns, || {
            let s = UdpSocket::bind("127.0.0.1:0").unwrap();
            s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
            let port = s.local_addr().unwrap().port();
            let msg = format!(
                "BYE sip:callee@{KAMAILIO} SIP/2.0\r\nVia: SIP/2.0/UDP 127.0.0.1:{port};branch=z9hG4bK-ngstats-1\r\nMax-Forwards: 70\r\n\
                 From: <sip:caller@127.0.0.1>;tag=caller-tag\r\nTo: <sip:callee@127.0.0.1>;tag=callee-tag\r\nCall-ID: {CALL}\r\n\
                 CSeq: 2 BYE\r\nContent-Length: 0\r\n\r\n"
            );
            s.send_to(msg.as_bytes(), KAMAILIO).unwrap();
            let mut buf = [0u8; 4096];
            s.recv_from(&mut buf).map(|(n, _)| String::from_utf8_lossy(&buf[..n]).to_string())
        })
        .unwrap();
    let bye = bye.unwrap_or_else(|e| panic!("[{relay}] no reply to the BYE: {e}\n{}", sip::log_tail(&log, 20)));
    assert!(bye.starts_with("SIP/2.0 200"), "[{relay}] {bye}");
    let list = ng_in(&tb, vec![("command", "list".into())]);
    assert_eq!(list.get("calls").and_then(Value::as_list).map(<[Value]>::len), Some(0), "[{relay}] the BYE deleted the call: {list:?}");

    let logged = std::fs::read_to_string(&log).unwrap_or_default();
    let line = |tag: &str| logged.lines().find_map(|l| l.split_once(tag).map(|(_, rest)| rest.to_string())).unwrap_or_default();
    let (rtpstat, mos) = (line("NGSTATS rtpstat="), line("NGSTATS mos "));
    assert!(!rtpstat.is_empty() && !mos.is_empty(), "[{relay}] Kamailio logged no statistics:\n{}", sip::log_tail(&log, 30));
    let _ = kamailio.proc.terminate(Duration::from_secs(3));
    relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    Run { query, statistics, rtpstat, mos, endpoint_rtt_us }
}

fn int_at(v: &Value, keys: &[&str]) -> i64 {
    keys.iter().try_fold(v, |v, k| v.get(k)).and_then(Value::as_int).unwrap_or_else(|| panic!("no integer at {keys:?} in {v:?}"))
}

/// The key paths of `reply` with their types, as strings (the shape of the reference).
fn paths_of(reply: &Value) -> BTreeMap<String, String> {
    key_paths(reply).into_iter().filter(|(k, _)| k != "result").map(|(k, v)| (k, v.to_string())).collect()
}

#[test]
fn ng_statistics_match_rtpengine_and_feed_kamailio() {
    if !sip::ready("ng_statistics_match_rtpengine_and_feed_kamailio", &["kamailio", "rtpengine"]) {
        return;
    }
    let tmp = common::TempDir::new("ng-stats");
    let runs: Vec<(&str, Run)> = ["rtpengine", "mediaplane-userspace", "mediaplane-ebpf"].into_iter().map(|r| (r, run(r, &tmp.0))).collect();
    let rtpe = &runs[0].1;

    // rtpengine's live replies still carry the reference mediaplane's unit tests hold it to.
    for (command, reply) in [("query", &rtpe.query), ("statistics", &rtpe.statistics)] {
        let stale = missing_key_paths(&rtpengine_key_paths(command), reply, &[]);
        assert!(stale.is_empty(), "rtpengine's live {command} reply lacks reference paths {stale:#?}: regenerate tests/data");
    }
    let mut report = String::new();
    for (relay, r) in &runs {
        report += &format!("[{relay}] Kamailio: $rtpstat=[{}\n[{relay}] Kamailio: MOS AVPs {}\n", r.rtpstat, r.mos);
        report += &format!("[{relay}] statistics mos: {:?}\n", r.statistics.get("statistics").and_then(|s| s.get("mos")));
        report += &format!("[{relay}] the parties' longest round trip: {:.0} µs\n", r.endpoint_rtt_us);
    }
    eprintln!("{report}");
    for (relay, r) in &runs[1..] {
        for (command, theirs, ours) in [("query", &rtpe.query, &r.query), ("statistics", &rtpe.statistics, &r.statistics)] {
            let missing = missing_key_paths(&paths_of(theirs), ours, &[]);
            assert!(missing.is_empty(), "[{relay}] {command} lacks rtpengine's {missing:#?}");
        }
        // The same traffic, counted the same way (RTP and RTCP received, UDP payload bytes).
        for keys in [["totals", "RTP", "packets"], ["totals", "RTP", "bytes"], ["totals", "RTCP", "packets"], ["totals", "RTCP", "bytes"]] {
            assert_eq!(int_at(&r.query, &keys), int_at(&rtpe.query, &keys), "[{relay}] {keys:?}");
        }
        assert_eq!(r.rtpstat, rtpe.rtpstat, "[{relay}] Kamailio's $rtpstat differs from rtpengine's");
    }
    // The RTCP of the test is good enough for rtpengine to compute a MOS (else the comparison
    // of the MOS AVPs says nothing).
    let theirs = mos_avps(&rtpe.mos).unwrap_or_else(|| panic!("rtpengine computed no MOS: {}", rtpe.mos));
    // The round-trip time (µs) a relay measures from a party's SR to the other's report of it,
    // as it receives that report, is part of the round trip the party measures when the report
    // reaches it (through the relay again, on the same clock). Each run against its own
    // parties, not against rtpengine's run: the time is the host's as much as the relay's
    // (measured 0.13 to 0.96 ms, the parties' longest 0.29 to 2.9 ms; but once 5.2 ms on the
    // eBPF plane while a build ran on the 2 cores, where rtpengine's run had 0.5 ms: no
    // tolerance between runs holds both). Not "at most the parties' longest": the relay's
    // samples are not the parties' (rtpengine's 403 µs once, against its parties' longest 381
    // µs, in a CI run), hence twice that, which still catches a unit or clock error.
    for (relay, r) in &runs {
        let rtt = mos_avps(&r.mos).unwrap_or_else(|| panic!("[{relay}] Kamailio read no MOS: {}", r.mos))["roundtrip"];
        assert!(
            rtt > 0.0 && rtt <= 2.0 * r.endpoint_rtt_us,
            "[{relay}] MOS AVP roundtrip {rtt} µs: not within (0, 2 x {:.0}], twice the parties' longest round trip through the relay",
            r.endpoint_rtt_us
        );
    }
    for (relay, r) in &runs[1..] {
        let ours = mos_avps(&r.mos).unwrap_or_else(|| panic!("[{relay}] Kamailio read no MOS from mediaplane: {}", r.mos));
        let near = |key: &str, tolerance: f64| {
            assert!((ours[key] - theirs[key]).abs() <= tolerance, "[{relay}] MOS AVP {key}: {} vs rtpengine's {} (±{tolerance})", ours[key], theirs[key]);
        };
        // MOS in tenths; packet loss in %, jitter in ms (from the reports themselves).
        for (key, tolerance) in [("min", 0.1), ("max", 0.1), ("average", 0.1), ("packetloss", 0.0), ("jitter", 1.0)] {
            near(key, tolerance + 1e-9);
        }
        assert!(ours["samples"] >= 1.0 && (ours["samples"] - theirs["samples"]).abs() <= 2.0, "[{relay}] samples {} vs {}", ours["samples"], theirs["samples"]);
        // `statistics` `mos`: every MOS computed (one per report block with both legs known).
        let totals = |st: &Value, key: &str| -> f64 {
            let v = st.get("statistics").and_then(|s| s.get("mos")).and_then(|m| m.get(key)).unwrap_or_else(|| panic!("no mos.{key}"));
            v.as_int().map(|i| i as f64).or_else(|| v.as_str().and_then(|t| t.parse().ok())).unwrap_or_else(|| panic!("mos.{key}: {v:?}"))
        };
        let (n_ours, n_theirs) = (totals(&r.statistics, "mos_samples_total"), totals(&rtpe.statistics, "mos_samples_total"));
        assert!(n_ours >= 1.0 && (n_ours - n_theirs).abs() <= 2.0, "[{relay}] MOS samples {n_ours} vs rtpengine's {n_theirs}");
        let (avg_ours, avg_theirs) = (totals(&r.statistics, "mos_average"), totals(&rtpe.statistics, "mos_average"));
        assert!((avg_ours - avg_theirs).abs() <= 0.1 + 1e-9, "[{relay}] MOS average {avg_ours} vs rtpengine's {avg_theirs}");
    }
}

/// Kamailio's logged MOS AVPs (`min=[4.3] … samples=[2]`) as numbers; `None` if any is empty.
fn mos_avps(line: &str) -> Option<BTreeMap<String, f64>> {
    let avps: BTreeMap<String, f64> = line
        .split_whitespace()
        .filter_map(|kv| kv.split_once("=["))
        .map(|(k, v)| Some((k.to_string(), v.trim_end_matches(']').parse().ok()?)))
        .collect::<Option<_>>()?;
    (avps.len() == 7).then_some(avps)
}
