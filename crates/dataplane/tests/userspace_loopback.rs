//! The user-space plane over real loopback sockets: four participants, a two-quality publisher,
//! a stranger and garbage. Every participant must get exactly the copies it subscribed to.

use mediaplane_core::model::{StreamRef, StreamSpec};
use mediaplane_core::rtp::{build_rtp, RtpHeader};
use mediaplane_core::{ForwardingTable, Model};
use mediaplane_dataplane::{Dataplane, UserspaceConfig, UserspaceDataplane};
use std::collections::BTreeMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Held by the flood tests and the loss-sensitive ones: on a 2-core machine a flood beside a
/// zero-loss check can overflow its socket buffers.
fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn a(s: &str) -> SocketAddr {
    s.parse().unwrap()
}

/// SFU transport of participant i and its own media address, on a per-test loopback subnet.
fn sfu_addr(net: u8, i: usize) -> SocketAddr {
    a(&format!("127.77.{net}.1:{}", 41000 + 2 * i))
}
fn peer_addr(net: u8, i: usize) -> SocketAddr {
    a(&format!("127.77.{net}.{}:5000", 10 + i))
}

fn conference(net: u8, n: usize) -> Model {
    let mut m = Model::new();
    m.create_room("conf").unwrap();
    for i in 0..n {
        let p = format!("p{i}");
        m.add_participant("conf", &p, sfu_addr(net, i), peer_addr(net, i)).unwrap();
        m.publish("conf", &p, "low", StreamSpec { ssrc: Some(1000 + i as u32), ..Default::default() }).unwrap();
    }
    for i in 0..n {
        for j in 0..n {
            if i != j {
                m.subscribe("conf", &format!("p{i}"), StreamRef { publisher: format!("p{j}"), stream: "low".into() }).unwrap();
            }
        }
    }
    m
}

/// Receive until `want` datagrams arrived or `quiet` passed without any; returns (from, ssrc, seq).
fn drain(sock: &UdpSocket, want: usize, quiet: Duration) -> Vec<(SocketAddr, u32, u16)> {
    sock.set_read_timeout(Some(quiet)).unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                let h = RtpHeader::parse(&buf[..n]).expect("copies are valid RTP, payload unchanged");
                assert_eq!(&buf[h.payload_offset..n], &payload_for(h.ssrc, h.sequence)[..], "payload changed");
                got.push((from, h.ssrc, h.sequence));
                if got.len() > want + 100 {
                    break;
                }
            }
            Err(_) => break,
        }
    }
    got
}

fn payload_for(ssrc: u32, seq: u16) -> Vec<u8> {
    (0..160).map(|k| (ssrc as u8).wrapping_add(seq as u8).wrapping_add(k as u8)).collect()
}

fn send(sock: &UdpSocket, to: SocketAddr, ssrc: u32, count: u16) {
    for seq in 0..count {
        sock.send_to(&build_rtp(0, seq, seq as u32 * 160, ssrc, &payload_for(ssrc, seq)), to).unwrap();
    }
}

#[test]
fn four_participants_two_qualities_strangers_and_garbage() {
    const NET: u8 = 1;
    const N: usize = 4;
    const PACKETS: u16 = 50;
    let mut model = conference(NET, N);
    // p0 also publishes "high" on its own SFU port; only the upper half subscribes.
    let high_local = a(&format!("127.77.{NET}.1:41100"));
    model.publish("conf", "p0", "high", StreamSpec { local: Some(high_local), ssrc: Some(2000), rtp: true, clock_rate: None, ..Default::default() }).unwrap();
    for s in ["p2", "p3"] {
        model.subscribe("conf", s, StreamRef { publisher: "p0".into(), stream: "high".into() }).unwrap();
    }
    let table = Arc::new(ForwardingTable::compile(&model, 1));
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap();
    dp.apply(table.clone()).unwrap();

    let peers: Vec<UdpSocket> = (0..N).map(|i| UdpSocket::bind(peer_addr(NET, i)).unwrap()).collect();
    for (i, p) in peers.iter().enumerate() {
        send(p, sfu_addr(NET, i), 1000 + i as u32, PACKETS);
    }
    send(&peers[0], high_local, 2000, PACKETS);

    // A stranger injecting into p1's stream, and garbage from the legitimate source.
    let stranger = UdpSocket::bind(a(&format!("127.77.{NET}.99:5000"))).unwrap();
    send(&stranger, sfu_addr(NET, 1), 1001, 10);
    for junk in [&b"garbage!"[..], &[0x80, 0, 1], &[]] {
        peers[1].send_to(junk, sfu_addr(NET, 1)).unwrap();
    }

    for (i, p) in peers.iter().enumerate() {
        let high = i >= 2;
        let want = (N - 1) * PACKETS as usize + if high { PACKETS as usize } else { 0 };
        let got = drain(p, want, Duration::from_millis(500));
        let mut per_ssrc: BTreeMap<u32, Vec<u16>> = BTreeMap::new();
        for (from, ssrc, seq) in &got {
            assert_eq!(*from, sfu_addr(NET, i), "copies come from the subscriber's own SFU address");
            per_ssrc.entry(*ssrc).or_default().push(*seq);
        }
        let mut expected: Vec<u32> = (0..N).filter(|j| *j != i).map(|j| 1000 + j as u32).collect();
        if high {
            expected.push(2000);
        }
        assert_eq!(per_ssrc.keys().copied().collect::<Vec<_>>(), expected, "participant {i} got the wrong streams");
        for (ssrc, seqs) in per_ssrc {
            let mut sorted = seqs.clone();
            sorted.sort();
            sorted.dedup();
            assert_eq!(sorted.len(), seqs.len(), "duplicates of {ssrc} at p{i}");
            assert_eq!(seqs.len(), PACKETS as usize, "p{i} lost packets of {ssrc}");
        }
    }
    let st = dp.stats();
    assert_eq!(st.total.drop_stranger, 10);
    assert_eq!(st.total.drop_malformed, 3);
    let copies = (N * (N - 1) + 2) as u64 * PACKETS as u64;
    assert_eq!(st.total.tx_copies, copies);
    assert_eq!(st.total.tx_errors, 0);
    let p1_stream = table.streams.values().find(|e| e.label == "conf/p1/low").unwrap().id;
    assert_eq!(st.streams[&p1_stream].drop_stranger, 10);
    assert_eq!(st.streams[&p1_stream].tx_copies, (N as u64 - 1) * PACKETS as u64);
    dp.shutdown().unwrap();
}

#[test]
fn table_updates_apply_atomically_while_traffic_flows() {
    const NET: u8 = 2;
    let _x = exclusive();
    let mut model = conference(NET, 3);
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap();
    dp.apply(Arc::new(ForwardingTable::compile(&model, 1))).unwrap();
    let peers: Vec<UdpSocket> = (0..3).map(|i| UdpSocket::bind(peer_addr(NET, i)).unwrap()).collect();
    // Receivers drain while the sender streams, so their socket buffers never overflow.
    let receivers: Vec<_> = peers[1..]
        .iter()
        .map(|p| {
            let p = p.try_clone().unwrap();
            std::thread::spawn(move || drain(&p, 3000, Duration::from_millis(500)))
        })
        .collect();
    let sender = peers[0].try_clone().unwrap();
    let to = sfu_addr(NET, 0);
    let t = std::thread::spawn(move || {
        for burst in 0..30u16 {
            for seq in burst * 100..(burst + 1) * 100 {
                sender.send_to(&build_rtp(0, seq, seq as u32 * 160, 1000, &payload_for(1000, seq)), to).unwrap();
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    });
    // Unsubscribe p2 from p0 and resubscribe, repeatedly, while p0 streams.
    let sref = StreamRef { publisher: "p0".into(), stream: "low".into() };
    for v in 0..20u64 {
        if v % 2 == 0 {
            model.unsubscribe("conf", "p2", &sref).unwrap();
        } else {
            model.subscribe("conf", "p2", sref.clone()).unwrap();
        }
        dp.apply(Arc::new(ForwardingTable::compile(&model, v + 2))).unwrap();
        std::thread::sleep(Duration::from_millis(1));
    }
    t.join().unwrap();
    let mut received = receivers.into_iter().map(|r| r.join().unwrap());
    let (got1, got2) = (received.next().unwrap(), received.next().unwrap());
    // p1 stayed subscribed throughout: every packet exactly once.
    let mut seqs: Vec<u16> = got1.iter().map(|g| g.2).collect();
    seqs.sort();
    let n = seqs.len();
    seqs.dedup();
    assert_eq!(seqs.len(), n, "no duplicates across updates");
    assert_eq!(n, 3000, "p1 lost packets during updates");
    assert_eq!(dp.stats().total.tx_errors, 0);
    // p2 ends subscribed (20 flips); it never gets a duplicate.
    let mut s2: Vec<u16> = got2.iter().filter(|g| g.1 == 1000).map(|g| g.2).collect();
    let n2 = s2.len();
    s2.sort();
    s2.dedup();
    assert_eq!(s2.len(), n2, "no duplicates for the flapping subscriber");
}

#[test]
fn bind_failure_keeps_the_old_table() {
    const NET: u8 = 3;
    let model = conference(NET, 2);
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap();
    let t1 = Arc::new(ForwardingTable::compile(&model, 1));
    dp.apply(t1.clone()).unwrap();
    // Someone else holds an address the next table needs (no SO_REUSEPORT: exclusive).
    let squatter = UdpSocket::bind(a(&format!("127.77.{NET}.1:41200"))).unwrap();
    let mut m2 = model.clone();
    m2.publish("conf", "p0", "high", StreamSpec { local: Some(squatter.local_addr().unwrap()), ssrc: None, rtp: true, clock_rate: None, ..Default::default() })
        .unwrap();
    let err = dp.apply(Arc::new(ForwardingTable::compile(&m2, 2))).unwrap_err();
    assert!(err.to_string().contains("41200"), "{err}");
    assert_eq!(dp.table().version, 1);
}

/// A publisher limited to R packets/s floods its stream: its subscriber gets R per second (within
/// 5%), the excess is counted as `drop_rate_limited`, nothing else changes.
#[test]
fn rate_limited_stream_forwards_its_rate_under_a_flood() {
    const NET: u8 = 9;
    const RATE: u32 = 500;
    let _x = exclusive();
    const SECS: f64 = 1.5;
    let model = conference(NET, 2);
    let table = ForwardingTable::compile_with_rate(&model, 1, Some(mediaplane_core::RateLimit { pps: RATE, bps: 0, burst_ms: 10 }));
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap();
    dp.apply(Arc::new(table)).unwrap();
    let p0 = UdpSocket::bind(peer_addr(NET, 0)).unwrap();
    let p1 = UdpSocket::bind(peer_addr(NET, 1)).unwrap();
    p1.set_read_timeout(Some(Duration::from_millis(10))).unwrap();
    let big: libc::c_int = 8 << 20;
    // SAFETY: valid fd and option buffer.
    unsafe { libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(&p1), libc::SOL_SOCKET, libc::SO_RCVBUF, &big as *const _ as *const libc::c_void, 4) };
    let pkt = build_rtp(0, 1, 160, 1000, &payload_for(1000, 1));
    // Flood (bounded in count and time) while receiving.
    let start = Instant::now();
    let (mut sent, mut received) = (0u64, 0u64);
    let mut buf = [0u8; 2048];
    while start.elapsed().as_secs_f64() < SECS && sent < 2_000_000 {
        for _ in 0..64 {
            if p0.send_to(&pkt, sfu_addr(NET, 0)).is_ok() {
                sent += 1;
            }
        }
        // 20x the limit (see source_limit_holds_a_flooding_source_and_spares_others).
        if sent as f64 > 20.0 * RATE as f64 * start.elapsed().as_secs_f64() {
            std::thread::sleep(Duration::from_millis(2));
        }
        p1.set_nonblocking(true).unwrap();
        while p1.recv_from(&mut buf).is_ok() {
            received += 1;
        }
        p1.set_nonblocking(false).unwrap();
    }
    let flood_time = start.elapsed().as_secs_f64();
    // What the SFU still had queued is judged late (the bucket refills meanwhile): allow for it.
    while p1.recv_from(&mut buf).is_ok() {
        received += 1;
    }
    let want = RATE as f64 * flood_time;
    assert!(sent as f64 > 4.0 * want, "the flood was too slow to test anything: {sent} sent");
    assert!((received as f64 - want).abs() <= 0.05 * want, "{received} forwarded, want {want:.0} ± 5% ({sent} sent)");
    let st = dp.stats();
    assert!(st.total.drop_rate_limited > 0);
    assert_eq!(st.total.tx_copies, received, "every forwarded copy arrived");
    assert_eq!(st.total.drop_stranger + st.total.drop_malformed + st.total.drop_no_stream, 0);
    dp.shutdown().unwrap();
}

/// A per-source limit of R packets/s: p0 floods its stream and gets R per second forwarded
/// (within 5%), the excess counted as `drop_source_limited`; p1, another source sending beside
/// it, loses nothing; a stranger's packets are dropped as strangers, not charged.
#[test]
fn source_limit_holds_a_flooding_source_and_spares_others() {
    const NET: u8 = 10;
    const RATE: u32 = 500;
    let _x = exclusive();
    const SECS: f64 = 1.5;
    let model = conference(NET, 3);
    let mut table = ForwardingTable::compile(&model, 1);
    table.set_source_limit(Some(mediaplane_core::RateLimit { pps: RATE, bps: 0, burst_ms: 10 }));
    let p0_stream = table.streams.values().find(|e| e.label == "conf/p0/low").unwrap().id;
    let p1_stream = table.streams.values().find(|e| e.label == "conf/p1/low").unwrap().id;
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap();
    dp.apply(Arc::new(table)).unwrap();
    let socks: Vec<UdpSocket> = (0..3).map(|i| UdpSocket::bind(peer_addr(NET, i)).unwrap()).collect();
    let stranger = UdpSocket::bind(a(&format!("127.77.{NET}.99:5000"))).unwrap();
    let big: libc::c_int = 8 << 20;
    for s in &socks {
        // SAFETY: valid fd and option buffer.
        unsafe { libc::setsockopt(std::os::fd::AsRawFd::as_raw_fd(s), libc::SOL_SOCKET, libc::SO_RCVBUF, &big as *const _ as *const libc::c_void, 4) };
        s.set_nonblocking(true).unwrap();
    }
    let flood = build_rtp(0, 1, 160, 1000, &payload_for(1000, 1));
    let mut buf = [0u8; 2048];
    // p2 counts p0's and p1's copies.
    let mut count = |got: &mut [u64; 2]| {
        while let Ok((n, _)) = socks[2].recv_from(&mut buf) {
            match RtpHeader::parse(&buf[..n]).unwrap().ssrc {
                1000 => got[0] += 1,
                1001 => got[1] += 1,
                s => panic!("unexpected ssrc {s}"),
            }
        }
        while socks[0].recv_from(&mut buf).is_ok() {}
        while socks[1].recv_from(&mut buf).is_ok() {}
    };
    let mut got = [0u64; 2];
    let start = Instant::now();
    let (mut sent, mut p1_sent, mut seq) = (0u64, 0u64, 0u16);
    while start.elapsed().as_secs_f64() < SECS && sent < 2_000_000 {
        for _ in 0..64 {
            if socks[0].send_to(&flood, sfu_addr(NET, 0)).is_ok() {
                sent += 1;
            }
        }
        // 20x the limit is flood enough; flat out, the sender starves the SFU's workers on 2
        // cores, and a worker that does not run for longer than the burst loses its tokens.
        if sent as f64 > 20.0 * RATE as f64 * start.elapsed().as_secs_f64() {
            std::thread::sleep(Duration::from_millis(2));
        }
        // p1: about 100 packets/s, and a stranger as often.
        if start.elapsed().as_millis() as u64 / 10 >= p1_sent {
            socks[1].send_to(&build_rtp(0, seq, 0, 1001, &payload_for(1001, seq)), sfu_addr(NET, 1)).unwrap();
            stranger.send_to(&build_rtp(0, seq, 0, 1001, &payload_for(1001, seq)), sfu_addr(NET, 1)).unwrap();
            p1_sent += 1;
            seq += 1;
        }
        count(&mut got);
    }
    let flood_time = start.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(200));
    count(&mut got);
    let want = RATE as f64 * flood_time;
    assert!(sent as f64 > 4.0 * want, "the flood was too slow to test anything: {sent} sent");
    assert!((got[0] as f64 - want).abs() <= 0.05 * want, "{} of p0's packets forwarded, want {want:.0} ± 5% ({sent} sent)", got[0]);
    assert_eq!(got[1], p1_sent, "the other source lost packets");
    let st = dp.stats();
    assert!(st.total.drop_source_limited > 0);
    assert_eq!(st.streams[&p0_stream].rx_packets, got[0], "admitted packets are the forwarded ones");
    assert_eq!(st.streams[&p0_stream].drop_source_limited, 0, "counted in totals only");
    assert_eq!(st.total.drop_stranger, p1_sent, "strangers are strangers");
    assert_eq!(st.streams[&p1_stream].drop_stranger, p1_sent);
    // Everything p0's socket group read is either admitted or source-limited.
    assert_eq!(st.total.rx_packets, st.total.drop_source_limited + got[0] + 2 * p1_sent);
    dp.shutdown().unwrap();
}

/// A relay whose leg A speaks SRTP (SDES terminated): A's packets reach B unprotected, B's reach
/// A protected with the relay's key; a stranger's forged packets fail authentication, are
/// dropped and counted, and are never reported as a source to follow.
#[test]
fn srtp_leg_is_unprotected_protected_and_only_its_key_holder_is_learnt() {
    use mediaplane_core::model::{LegSpec, Side};
    use mediaplane_core::srtp::{LegSrtp, SrtpKey, SrtpSuite};
    use mediaplane_dataplane::srtp::{protect, unprotect, Context};
    use mediaplane_dataplane::DataplaneEvent;
    const NET: u8 = 6;
    let (la, lb) = (a(&format!("127.77.{NET}.1:42000")), a(&format!("127.77.{NET}.1:42002")));
    let (pa, pb, stranger) = (peer_addr(NET, 0), peer_addr(NET, 1), peer_addr(NET, 2));
    let theirs = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, (0..30).collect()).unwrap();
    let ours = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_32, (100..130).collect()).unwrap();
    let mut m = Model::new();
    let leg = |local, remote| LegSpec { local, remote: Some(remote), strict: false, rtp: true, follow: Default::default() };
    m.create_relay("call", leg(la, pa), leg(lb, pb)).unwrap();
    m.open_learning("call", Side::A, u64::MAX).unwrap();
    m.set_leg_srtp("call", Side::A, Some(LegSrtp { inbound: Some(theirs.clone()), outbound: Some(ours.clone()) })).unwrap();
    let (tx, events) = mediaplane_dataplane::event_channel();
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, Some(tx)).unwrap();
    dp.apply(Arc::new(ForwardingTable::compile(&m, 1))).unwrap();
    let (sa, sb, ss) = (UdpSocket::bind(pa).unwrap(), UdpSocket::bind(pb).unwrap(), UdpSocket::bind(stranger).unwrap());
    let before = |name: &str| dp.stats().extra.get(name).copied().unwrap_or(0);
    let auth_failed = before("srtp_auth_failed");

    // The stranger forges 20 packets with A's SSRC: none passes, none is reported.
    send(&ss, la, 0xa, 20);
    assert!(drain(&sb, 0, Duration::from_millis(300)).is_empty(), "forged SRTP reached B");
    assert_eq!(before("srtp_auth_failed") - auth_failed, 20);
    assert!(events.try_iter().all(|e| !matches!(e, DataplaneEvent::Unlatched { source, .. } if source == stranger)), "a forger was reported as a source");

    // A's own packets, protected with its key, reach B as RTP; A is reported (learning).
    let a_tx = Arc::new(Context::new(&theirs, true).unwrap());
    for seq in 0..20u16 {
        let clear = build_rtp(0, seq, seq as u32 * 160, 0xa, &payload_for(0xa, seq));
        sa.send_to(&protect(Some(&a_tx), &clear).unwrap(), la).unwrap();
    }
    let got = drain(&sb, 20, Duration::from_millis(300));
    assert_eq!(got.iter().map(|(_, ssrc, seq)| (*ssrc, *seq)).collect::<Vec<_>>(), (0..20).map(|s| (0xa, s)).collect::<Vec<_>>());
    assert!(events.try_iter().any(|e| matches!(e, DataplaneEvent::Unlatched { source, .. } if source == pa)));

    // B's RTP reaches A protected with the relay's key (the 4-byte tag of _32).
    send(&sb, lb, 0xb, 10);
    let a_rx = Arc::new(Context::new(&ours, false).unwrap());
    sa.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut buf = [0u8; 2048];
    for seq in 0..10u16 {
        let (n, from) = sa.recv_from(&mut buf).expect("B's copy reaches A");
        assert_eq!(from, la);
        let clear = build_rtp(0, seq, seq as u32 * 160, 0xb, &payload_for(0xb, seq));
        assert_eq!(n, clear.len() + 4);
        assert_eq!(unprotect(Some(&a_rx), &buf[..n]).expect("authenticates with the relay's key"), clear);
    }
    dp.shutdown().unwrap();
}

/// Stopping the plane while another thread installs changes finishes (the two once took their
/// locks in opposite orders and deadlocked: an RTSP session ending as the daemon stopped).
#[test]
fn stopping_while_changes_are_installed_finishes() {
    const NET: u8 = 9;
    let _x = exclusive();
    for round in 0..8 {
        let dp = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 2, ..Default::default() }, None).unwrap());
        let installer = {
            let dp = dp.clone();
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_millis(400);
                let mut n = 0;
                while std::time::Instant::now() < deadline {
                    // Tables with a different set of sockets each time: every install changes sockets.
                    let model = conference(NET, 2 + n % 3);
                    let _ = dp.apply(Arc::new(ForwardingTable::compile(&model, n as u64 + 1)));
                    n += 1;
                }
            })
        };
        std::thread::sleep(Duration::from_millis(5 + round));
        let (done, finished) = std::sync::mpsc::channel();
        let stopper = {
            let dp = dp.clone();
            std::thread::spawn(move || {
                dp.shutdown().unwrap();
                let _ = done.send(());
            })
        };
        assert!(finished.recv_timeout(Duration::from_secs(10)).is_ok(), "round {round}: shutdown did not finish beside an install");
        stopper.join().unwrap();
        installer.join().unwrap();
    }
}
