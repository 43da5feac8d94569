//! EbpfDataplane end to end in network namespaces with real UDP sockets: a star of
//! participants around an SFU namespace, table updates under load, a hitless restart.
//!
//! Run: `cargo test -p mediaplane-ebpf --test dataplane` as root.

mod common;

use common::rig::root_or_skip;
use common::*;
use mediaplane_bench::process::Supervised;
use mediaplane_core::model::{Model, StreamRef, StreamSpec};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::{Dataplane, DataplaneError, UserspaceConfig};
use mediaplane_ebpf::{EbpfConfig, EbpfDataplane, XdpPrefilter};
use std::collections::BTreeMap;
use std::net::UdpSocket;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Participants p0..p(n-1) on the star, each publishing "main"; `subs` lists (subscriber, publisher).
fn star_model(n: usize, subs: &[(usize, usize)]) -> Model {
    let mut m = Model::new();
    m.create_room("r").unwrap();
    for i in 0..n {
        m.add_participant("r", &format!("p{i}"), Star::sfu_addr(i), Star::participant_addr(i)).unwrap();
        m.publish("r", &format!("p{i}"), "main", StreamSpec::default()).unwrap();
    }
    for (s, p) in subs {
        m.subscribe("r", &format!("p{s}"), StreamRef { publisher: format!("p{p}"), stream: "main".into() }).unwrap();
    }
    m
}

/// The pre-filter forced on: these tests hold it to its behaviour on veth, where "auto" (the
/// default) leaves it off (auto_xdp_prefilter_leaves_veth_alone).
fn config(star: &Star, pin_dir: &Path) -> EbpfConfig {
    let mut cfg = EbpfConfig::new(star.sfu_ifs.clone(), pin_dir);
    cfg.userspace = UserspaceConfig { workers: 1, ..UserspaceConfig::default() };
    cfg.xdp_prefilter = XdpPrefilter::On;
    cfg
}

/// (publisher index, sequence) of each RTP packet received.
fn received(sock: &UdpSocket, quiet: Duration) -> BTreeMap<(u32, u16), usize> {
    let mut out = BTreeMap::new();
    for (_, d) in drain(sock, quiet, Duration::from_secs(10)) {
        let h = RtpHeader::parse(&d).expect("RTP copy");
        *out.entry((h.ssrc - 1, h.sequence)).or_insert(0) += 1;
    }
    out
}

#[test]
fn star_every_participant_gets_exactly_its_subscriptions() {
    root_or_skip!("star_every_participant_gets_exactly_its_subscriptions");
    const N: usize = 4;
    const PACKETS: u16 = 30;
    let star = Star::new(N);
    let fs = Bpffs::new();
    // Full mesh except: p3 does not subscribe to p0.
    let subs: Vec<(usize, usize)> = (0..N).flat_map(|s| (0..N).map(move |p| (s, p))).filter(|(s, p)| s != p && (*s, *p) != (3, 0)).collect();
    let table = Arc::new(ForwardingTable::compile(&star_model(N, &subs), 1));
    let socks: Vec<UdpSocket> = (0..N).map(|i| star.socket(i, 5000)).collect();
    let stranger = star.socket(0, 5001);

    let g = star.sfu.enter();
    let dp = EbpfDataplane::new(config(&star, &fs.dir.join("star")), None).expect("ebpf data plane");
    drop(g); // its threads live in the SFU namespace; the test thread need not
    assert_eq!(dp.name(), "ebpf");
    assert!(dp.hooks().iter().all(|(_, kind)| *kind == "tcx" || *kind == "xdp"), "{:?}", dp.hooks());
    assert_eq!(dp.hooks().iter().filter(|(_, kind)| *kind == "tcx").count(), N, "{:?}", dp.hooks());
    {
        let _g = star.sfu.enter(); // the slow path binds its sockets in apply()
        dp.apply(table.clone()).unwrap();
    }

    // Round-robin sends; the first packets find no neighbour entries: slow path.
    for seq in 0..PACKETS {
        for (i, s) in socks.iter().enumerate() {
            s.send_to(&build_rtp(96, seq, seq as u32 * 160, i as u32 + 1, &[i as u8; 100]), Star::sfu_addr(i)).unwrap();
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    for (i, s) in socks.iter().enumerate() {
        let got = received(s, Duration::from_millis(400));
        let mut want = BTreeMap::new();
        for (sub, p) in &subs {
            if *sub == i {
                for seq in 0..PACKETS {
                    want.insert((*p as u32, seq), 1);
                }
            }
        }
        assert_eq!(got, want, "participant {i}");
    }
    let st = dp.stats();
    let expected_copies = subs.len() as u64 * PACKETS as u64;
    assert_eq!(st.total.tx_copies, expected_copies, "{st:?}");
    assert_eq!(st.total.rx_packets, N as u64 * PACKETS as u64, "{st:?}");
    assert!(st.extra["forwarded"] > 0, "the kernel path forwarded nothing: {:?}", st.extra);
    assert!(st.copy_latency.is_some());
    // Reading a few streams' counters gives what the full stats say for them.
    let some: Vec<u32> = st.streams.keys().copied().take(3).chain([u32::MAX]).collect();
    let few = dp.stream_counters(&some);
    assert_eq!(few.len(), 3, "{few:?}");
    for (id, c) in &few {
        assert_eq!(c, &st.streams[id], "stream {id}");
    }

    // A stranger's flood (right IP, wrong port) is dropped by the XDP pre-filter, before TC,
    // and counted there; not one copy leaves.
    assert_eq!(dp.hooks().iter().filter(|(_, kind)| *kind == "xdp").count(), N, "{:?}", dp.hooks());
    for ifname in &star.sfu_ifs {
        let d = link_details(&star, ifname);
        assert!(d.contains("prog/xdp") && !d.contains("xdpgeneric"), "not native XDP on {ifname}: {d}");
    }
    const FLOOD: u64 = 3000;
    let before = dp.stats();
    let tc_runs_before = before.extra["bpf_run_count"];
    for seq in 0..FLOOD as u16 {
        stranger.send_to(&build_rtp(96, seq, 0, 99, b"evil"), Star::sfu_addr(0)).unwrap();
    }
    for (i, s) in socks.iter().enumerate() {
        assert!(received(s, Duration::from_millis(300)).is_empty(), "participant {i} got a stranger's packet");
    }
    let after = dp.stats();
    let d = |k: &str| after.extra[k] - before.extra[k];
    assert_eq!(d("xdp_drop_stranger"), FLOOD, "{:?}", after.extra);
    assert_eq!(d("xdp_drop_bytes"), FLOOD * 16, "{:?}", after.extra);
    assert!(d("xdp_run_count") >= FLOOD, "{:?}", after.extra);
    assert!(after.extra["bpf_run_count"] - tc_runs_before < FLOOD / 10, "TC saw the flood: {:?}", after.extra);
    // One set of counters: the flood is in the totals a dashboard reads, counted once (by XDP,
    // not again by TC), with the breakdown by hook in `extra`.
    assert_eq!(after.total.drop_stranger - before.total.drop_stranger, FLOOD, "counted once, in the totals");
    assert_eq!(after.total.rx_packets - before.total.rx_packets, FLOOD);
    assert_eq!(after.total.rx_bytes - before.total.rx_bytes, FLOOD * 16);
    assert_eq!(after.total.tx_copies, before.total.tx_copies, "copies went out");
    // Its STUN still reaches the slow path (the user-space plane counts it).
    let mut stun = vec![0, 1, 0, 0, 0x21, 0x12, 0xa4, 0x42];
    stun.extend_from_slice(&[7; 12]);
    stranger.send_to(&stun, Star::sfu_addr(0)).unwrap();
    let start = Instant::now();
    while dp.stats().total.slow_stun == after.total.slow_stun && start.elapsed() < Duration::from_secs(3) {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(dp.stats().total.slow_stun, after.total.slow_stun + 1, "the stranger's STUN was not passed up");
    assert_eq!(dp.stats().extra["xdp_drop_stranger"], after.extra["xdp_drop_stranger"]);

    dp.shutdown().unwrap();
    assert!(!fs.dir.join("star").exists(), "shutdown removes the pins");
    for ifname in &star.sfu_ifs {
        assert!(!link_details(&star, ifname).contains("xdp"), "shutdown left the XDP pre-filter on {ifname}");
    }
}

#[test]
fn refuses_to_start_without_interface_or_bpffs() {
    root_or_skip!("refuses_to_start_without_interface_or_bpffs");
    let fs = Bpffs::new();
    let e = EbpfDataplane::new(EbpfConfig::new(vec!["mp-no-such-if".into()], fs.dir.join("x")), None).err().expect("must fail");
    assert!(e.to_string().contains("mp-no-such-if not found"), "{e}");
    let e = EbpfDataplane::new(EbpfConfig::new(vec!["lo".into()], std::env::temp_dir().join(unique("nobpffs"))), None).err().expect("must fail");
    assert!(matches!(e, DataplaneError::Unsupported(_)) && e.to_string().contains("bpffs"), "{e}");
}

/// Table flips under load: no duplicate ever, the always-subscribed participant gets every
/// packet, and a removed subscriber gets nothing sent while it was removed.
#[test]
fn table_updates_under_load_are_atomic() {
    root_or_skip!("table_updates_under_load_are_atomic");
    const ROUNDS: usize = 20;
    const PER_ROUND: u16 = 40;
    let star = Star::new(3);
    let fs = Bpffs::new();
    let with = Arc::new(ForwardingTable::compile(&star_model(3, &[(1, 0), (2, 0)]), 1));
    let without = Arc::new(ForwardingTable::compile(&star_model(3, &[(1, 0)]), 2));
    let socks: Vec<UdpSocket> = (0..3).map(|i| star.socket(i, 5000)).collect();
    let _g = star.sfu.enter();
    let dp = EbpfDataplane::new(config(&star, &fs.dir.join("atomic")), None).expect("ebpf data plane");
    dp.apply(with.clone()).unwrap();
    // Warm up: resolve neighbours both ways so the kernel path carries the load.
    for (i, s) in socks.iter().enumerate() {
        s.send_to(b"warm-up", Star::sfu_addr(i)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(200));
    for s in &socks {
        drain(s, Duration::from_millis(100), Duration::from_secs(1));
    }

    let mut forbidden = Vec::new(); // sequences p2 must not get
    let mut seq: u16 = 0;
    let mut version = 2;
    for round in 0..ROUNDS {
        let removed = round % 2 == 1;
        let mut t = if removed { (*without).clone() } else { (*with).clone() };
        version += 1;
        t.version = version;
        dp.apply(Arc::new(t)).unwrap();
        for _ in 0..PER_ROUND {
            socks[0].send_to(&build_rtp(96, seq, 0, 1, &[7; 64]), Star::sfu_addr(0)).unwrap();
            if removed {
                forbidden.push(seq);
            }
            seq += 1;
            std::thread::sleep(Duration::from_micros(200));
        }
    }
    let total = seq;
    let p1 = received(&socks[1], Duration::from_millis(400));
    let p2 = received(&socks[2], Duration::from_millis(400));
    assert!(p1.values().chain(p2.values()).all(|n| *n == 1), "duplicates");
    assert_eq!(p1.len(), total as usize, "the steady subscriber lost packets");
    for s in &forbidden {
        assert!(!p2.contains_key(&(0, *s)), "p2 got seq {s}, sent while it was unsubscribed");
    }
    let allowed = total as usize - forbidden.len();
    assert_eq!(p2.len(), allowed, "p2 missed packets sent while subscribed");
    let st = dp.stats();
    assert!(st.extra["forwarded"] >= total as u64 - 5, "kernel path not used: {:?}", st.extra);
    dp.shutdown().unwrap();
}

/// Role of the child process in the restart test: run the data plane until killed.
const DAEMON_ENV: &str = "MEDIAPLANE_EBPF_TEST_DAEMON";

#[test]
fn hitless_restart_after_kill_9() {
    if let Ok(spec) = std::env::var(DAEMON_ENV) {
        // Child: "<sfu netns>|<pin dir>|<if,if>": start, apply, say ready, wait to be killed.
        let parts: Vec<&str> = spec.split('|').collect();
        let ns = Netns { name: parts[0].into() };
        let _g = ns.enter();
        std::mem::forget(ns);
        let mut cfg = EbpfConfig::new(parts[2].split(',').map(String::from).collect(), parts[1]);
        cfg.userspace = UserspaceConfig { workers: 1, ..UserspaceConfig::default() };
        cfg.xdp_prefilter = XdpPrefilter::On;
        let dp = EbpfDataplane::new(cfg, None).expect("daemon start");
        dp.apply(Arc::new(ForwardingTable::compile(&star_model(2, &[(1, 0)]), 1))).unwrap();
        println!("DAEMON-READY");
        std::thread::sleep(Duration::from_secs(60));
        std::process::exit(3); // never reached unless the parent forgot us
    }
    root_or_skip!("hitless_restart_after_kill_9");
    let star = Star::new(2);
    let fs = Bpffs::new();
    let pin_dir = fs.dir.join("restart");
    let socks: Vec<UdpSocket> = (0..2).map(|i| star.socket(i, 5000)).collect();
    let table = Arc::new(ForwardingTable::compile(&star_model(2, &[(1, 0)]), 1));

    let spawn = || {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--exact", "hitless_restart_after_kill_9", "--nocapture", "--test-threads=1"])
            .env(DAEMON_ENV, format!("{}|{}|{}", star.sfu.name, pin_dir.display(), star.sfu_ifs.join(",")))
            .stdout(std::process::Stdio::piped());
        // Dropped: SIGKILL, and reaped.
        let mut daemon = Supervised::spawn("daemon", &mut cmd).expect("spawn daemon");
        let mut out = std::io::BufReader::new(daemon.child_mut().stdout.take().unwrap());
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut line = String::new();
        while Instant::now() < deadline {
            line.clear();
            if std::io::BufRead::read_line(&mut out, &mut line).unwrap_or(0) == 0 {
                break;
            }
            if line.contains("DAEMON-READY") {
                return daemon;
            }
        }
        panic!("daemon did not start");
    };
    let daemon = spawn();
    // Resolve neighbours, then stream p0 -> p1 across a kill -9 and a restart.
    socks[1].send_to(b"warm-up", Star::sfu_addr(1)).unwrap();
    socks[0].send_to(b"warm-up", Star::sfu_addr(0)).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    drain(&socks[1], Duration::from_millis(100), Duration::from_secs(1));

    let sender = socks[0].try_clone().unwrap();
    let streaming = std::thread::spawn(move || {
        for seq in 0..1500u16 {
            sender.send_to(&build_rtp(96, seq, 0, 1, &[1; 64]), Star::sfu_addr(0)).unwrap();
            std::thread::sleep(Duration::from_micros(1000));
        }
    });
    std::thread::sleep(Duration::from_millis(300));
    drop(daemon); // SIGKILL: only the pins keep the kernel path alive
    std::thread::sleep(Duration::from_millis(300));
    for ifname in &star.sfu_ifs {
        assert!(link_details(&star, ifname).contains("xdp"), "the pinned XDP pre-filter did not outlive the process on {ifname}");
    }
    // Restart in this process: adopt the pins, then apply the same table (nothing to rewrite).
    let g = star.sfu.enter();
    let dp = EbpfDataplane::new(config(&star, &pin_dir), None).expect("restart");
    assert!(dp.fast_path().adopted());
    let report = dp.fast_path().apply(table.clone()).unwrap();
    assert_eq!((report.streams_written, report.streams_deleted), (0, 0), "adoption rewrote entries");
    drop(g);
    streaming.join().unwrap();
    let got = received(&socks[1], Duration::from_millis(400));
    let lost: Vec<u16> = (0..1500u16).filter(|s| !got.contains_key(&(0, *s))).collect();
    assert!(lost.is_empty(), "{} packets lost across the restart, first {:?}", lost.len(), &lost[..lost.len().min(10)]);
    assert!(got.values().all(|n| *n == 1), "duplicates");
    // Counters survived the restart too (pinned).
    assert!(dp.stats().extra["forwarded"] >= 1500);

    // reset: a new instance with reset removes the stale state instead of adopting it.
    drop(dp); // dropped without shutdown: the kernel path stays pinned, as after a crash
    let g = star.sfu.enter();
    let mut cfg = config(&star, &pin_dir);
    cfg.reset = true;
    let dp = EbpfDataplane::new(cfg, None).expect("start with reset");
    assert!(!dp.fast_path().adopted());
    drop(g);
    dp.shutdown().unwrap();
    assert!(!pin_dir.exists());
    for ifname in &star.sfu_ifs {
        assert!(!link_details(&star, ifname).contains("xdp"), "shutdown left the XDP pre-filter on {ifname}");
    }
}

/// `ip -d link show` of an SFU-side interface (shows "xdp" while an XDP program is attached).
fn link_details(star: &Star, ifname: &str) -> String {
    let out = std::process::Command::new("ip").args(["-n", &star.sfu.name, "-d", "link", "show", ifname]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(out.status.success() && text.contains(ifname), "{text}");
    text
}

/// Native XDP on a veth with a jumbo MTU needs a multi-buffer (xdp.frags) program: the
/// pre-filter attaches there too, and jumbo datagrams still reach their subscribers.
#[test]
fn xdp_prefilter_attaches_on_a_jumbo_mtu_veth() {
    root_or_skip!("xdp_prefilter_attaches_on_a_jumbo_mtu_veth");
    let star = Star::new(2);
    for (i, ifname) in star.sfu_ifs.iter().enumerate() {
        star.sfu.ip(&["link", "set", ifname, "mtu", "9000"]);
        star.participants[i].ip(&["link", "set", &format!("{}p{i}", star.sfu.name), "mtu", "9000"]);
    }
    let fs = Bpffs::new();
    let socks: Vec<UdpSocket> = (0..2).map(|i| star.socket(i, 5000)).collect();
    let g = star.sfu.enter();
    let dp = EbpfDataplane::new(config(&star, &fs.dir.join("jumbo")), None).expect("ebpf data plane on jumbo veths");
    assert_eq!(dp.hooks().iter().filter(|(_, kind)| *kind == "xdp").count(), 2, "{:?}", dp.hooks());
    dp.apply(Arc::new(ForwardingTable::compile(&star_model(2, &[(1, 0)]), 1))).unwrap();
    drop(g);
    for seq in 0..20u16 {
        socks[0].send_to(&build_rtp(96, seq, 0, 1, &[5; 8000]), Star::sfu_addr(0)).unwrap();
        std::thread::sleep(Duration::from_millis(2));
    }
    let got = received(&socks[1], Duration::from_millis(400));
    assert_eq!(got.len(), 20, "{got:?}");
    dp.shutdown().unwrap();
}

/// By default ("auto") the pre-filter goes on every interface but veth, where it would make
/// the driver copy every packet (media included) into a page of its own first.
#[test]
fn auto_xdp_prefilter_leaves_veth_alone() {
    root_or_skip!("auto_xdp_prefilter_leaves_veth_alone");
    let star = Star::new(2);
    let fs = Bpffs::new();
    let _g = star.sfu.enter();
    assert_eq!(mediaplane_ebpf::attach::driver_of(&star.sfu_ifs[0]).as_deref(), Some("veth"));
    let mut cfg = config(&star, &fs.dir.join("auto"));
    cfg.xdp_prefilter = XdpPrefilter::Auto;
    let dp = EbpfDataplane::new(cfg, None).expect("ebpf data plane");
    assert!(dp.hooks().iter().all(|(_, kind)| *kind != "xdp"), "{:?}", dp.hooks());
    assert!(dp.prefilter().is_none());
    for ifname in &star.sfu_ifs {
        assert!(!link_details(&star, ifname).contains("xdp"), "{ifname}");
    }
    dp.shutdown().unwrap();
}
