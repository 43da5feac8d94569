//! Interop, endpoint latching: Kamailio's rtpengine module drives a relay over NG while SIPp does
//! the SIP signalling and this test is both media endpoints.
//!
//! Testbed: a star of two namespaces around a relay namespace (as `mediaplane bench relay`). The
//! relay (`mediaplane serve --ng-listen` on the user-space or the eBPF plane, or rtpengine 10.5 in
//! user space, the baseline), Kamailio and every SIPp process run in the relay namespace, SIP on
//! its loopback. The caller's media sockets live in peer 0's namespace, the callee's in peer 1's:
//! the relay advertises its address on the caller's link to both, so on the eBPF plane the media
//! really crosses the TC programs.
//!
//! Each scenario is one call: a SIPp UAC and a SIPp UAS of its own (the XML is rendered here, with
//! the test's media addresses in the SDP and the call's rtpengine flags in `X-RTP-Flags`, which
//! Kamailio appends to `rtpengine_offer`/`rtpengine_answer`). SIPp logs every INVITE it sends,
//! every answer and offer it receives (the relay's address from the rewritten SDP); the test tails
//! those logs to send RTP (20 ms pacing, one SSRC and sequence per direction) to the addresses
//! the relay advertised, to move the caller between sockets at the scenario's moments, and to
//! stop before the BYE. It then counts what arrived, by SSRC and sequence number, on which
//! socket, and checks each scenario's expectations over time windows between those events.
//!
//! Scenarios (all concurrent, each with its own ports and SSRCs; ~10 s):
//! * S1: a re-INVITE moves the caller's RTP port (P1 → P2); the callee answers 200 ms late; the
//!   caller switches to P2 50 ms after that answer. The return path must follow to P2.
//! * S2: NAT rebinding (the caller sends from N1, not its SDP port, then from N2) 1 s after the
//!   answer, inside rtpengine's learning window: the return path follows.
//! * S3a/b/c: the same rebinding 6 s after the answer, after the window closed: no flags (N2's
//!   packets are relayed but the return path stays on N1: one-way audio), `media-handover` (it
//!   follows), `strict-source` (N2's packets are dropped).
//! * S4: hold with `c=IN IP4 0.0.0.0` + `a=sendonly` (the UAS checks the relay passed the zero
//!   address through and answers `a=recvonly`), then unhold. S4b: the same hold with the real
//!   address: rtpengine does not gate media by direction attributes, only the zero address stops
//!   what goes to the held party.
//!
//! rtpengine's default endpoint learning ("delayed"): for 3 s after every offer or answer the
//! relay sends to the newest source of the party's packets, then locks it. What rtpengine 10.5
//! does here, beyond that (the expectations follow it):
//! * S1: the re-INVITE that moves the caller's port also gets the callee a new relay port in the
//!   forwarded offer (no `port-latching` flag); the callee follows its SDP, as a phone does.
//! * S3c: `strict-source` still learns in the window: the caller's packets from N1 (not its SDP
//!   port) are relayed and N1 locked; only after that are N2's dropped.
//! * S4/S4b: `a=sendonly`/`a=recvonly` do not gate media; `c=0.0.0.0` stops what goes to the held
//!   party although it keeps sending from its old port (not learned back until the unhold).
//!
//! Needs root, kamailio (+ its rtpengine module), sipp, and for the baseline rtpengine; skipped
//! otherwise, except under CI=true, where that is a failure. The three tests run one at a time.
//! MP_KEEP_TMP=1 keeps the run's directory (configs, SIPp logs, the relay's log).

mod common;

use common::sipp::{recv_answer, recv_offer, sipp_command, sipp_completed, Bed, Relay, KAMAILIO};
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip;
use mediaplane_core::rtp::build_rtp;
use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::path::Path;
use std::time::{Duration, Instant};
/// What every offer and answer carries; a scenario's `X-RTP-Flags` are appended.
const BASE_FLAGS: &str = "trust-address replace-origin replace-session-connection ICE=remove";
const PACKET_INTERVAL: Duration = Duration::from_millis(20);
/// How often a call's driver looks at the SIPp logs and its sockets.
const POLL: Duration = Duration::from_millis(2);
/// The caller stops sending this long before its BYE (a relay deletes the call on BYE).
const STOP_BEFORE_BYE: Duration = Duration::from_millis(300);
/// After the last packet: time for it to arrive.
const DRAIN: Duration = Duration::from_millis(200);
const CALL_DEADLINE: Duration = Duration::from_secs(40);

/// A media socket of the call: the caller's SDP ports (P1, P2), the caller's "NAT bindings" (N1,
/// N2: same address, other ports, never in SDP), and the callee's one socket.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Debug)]
enum Port {
    P1,
    P2,
    N1,
    N2,
    Callee,
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Dir {
    /// caller → callee
    Up,
    /// callee → caller
    Down,
}

impl Dir {
    fn label(self) -> &'static str {
        match self {
            Dir::Up => "caller→callee",
            Dir::Down => "callee→caller",
        }
    }
}

/// How an INVITE puts the call on hold, if it does; the UAS answers a hold with `a=recvonly`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Hold {
    No,
    /// `c=IN IP4 0.0.0.0` and `a=sendonly` (the UAS checks it still sees 0.0.0.0).
    ZeroAddress,
    /// `a=sendonly` with the caller's real address.
    SendOnly,
}

/// One INVITE of a call (the first or a re-INVITE), as the UAC sends it and the UAS answers it.
struct Invite {
    /// The caller's m= port.
    sdp_port: Port,
    hold: Hold,
    /// The UAS pauses this long before its 200 OK.
    answer_delay_ms: u64,
    /// The UAC pauses this long after its ACK (then the next INVITE, or the BYE).
    then_ms: u64,
}

impl Invite {
    fn plain(sdp_port: Port, then_ms: u64) -> Invite {
        Invite { sdp_port, hold: Hold::No, answer_delay_ms: 0, then_ms }
    }
}

/// The caller moves to socket `to` (sends only from there) `delay_ms` after the answer to INVITE
/// number `after_answer` (1-based) arrived.
struct Move {
    after_answer: usize,
    delay_ms: u64,
    to: Port,
}

struct Scenario {
    id: &'static str,
    title: &'static str,
    /// rtpengine flags of this call's offers and answers (`X-RTP-Flags`; none if empty).
    flags: &'static str,
    invites: Vec<Invite>,
    /// The caller's first sending socket.
    caller_sends_from: Port,
    moves: Vec<Move>,
    /// Expectations, given what happened: the same for every relay (mediaplane's are what
    /// rtpengine does).
    check: fn(&CallRecord, &mut Checks),
}

fn scenarios() -> Vec<Scenario> {
    vec![
        Scenario {
            id: "S1",
            title: "re-INVITE moves the caller's RTP port P1 → P2, callee answers 200 ms late",
            flags: "",
            invites: vec![Invite::plain(Port::P1, 2000), Invite { sdp_port: Port::P2, hold: Hold::No, answer_delay_ms: 200, then_ms: 3600 }],
            caller_sends_from: Port::P1,
            moves: vec![Move { after_answer: 2, delay_ms: 50, to: Port::P2 }],
            check: check_s1,
        },
        Scenario {
            id: "S2",
            title: "NAT rebinding N1 → N2 1 s after the answer (inside the learning window)",
            flags: "",
            invites: vec![Invite::plain(Port::P1, 4000)],
            caller_sends_from: Port::N1,
            moves: vec![Move { after_answer: 1, delay_ms: 1000, to: Port::N2 }],
            check: check_s2,
        },
        rebinding_after_lock("S3a", "", check_s3a),
        rebinding_after_lock("S3b", "media-handover", check_s3b),
        rebinding_after_lock("S3c", "strict-source", check_s3c),
        hold_and_unhold("S4", Hold::ZeroAddress, check_s4),
        hold_and_unhold("S4b", Hold::SendOnly, check_s4b),
    ]
}

fn hold_and_unhold(id: &'static str, hold: Hold, check: fn(&CallRecord, &mut Checks)) -> Scenario {
    Scenario {
        id,
        title: match hold {
            Hold::ZeroAddress => "hold (c=0.0.0.0, sendonly / recvonly) for 2 s, then unhold",
            _ => "hold (real address, sendonly / recvonly) for 2 s, then unhold",
        },
        flags: "",
        invites: vec![Invite::plain(Port::P1, 2000), Invite { sdp_port: Port::P1, hold, answer_delay_ms: 0, then_ms: 2000 }, Invite::plain(Port::P1, 2500)],
        caller_sends_from: Port::P1,
        moves: vec![],
        check,
    }
}

fn rebinding_after_lock(id: &'static str, flags: &'static str, check: fn(&CallRecord, &mut Checks)) -> Scenario {
    Scenario {
        id,
        title: match flags {
            "" => "NAT rebinding N1 → N2 6 s after the answer (learning window closed), no flags",
            "media-handover" => "NAT rebinding N1 → N2 6 s after the answer, media-handover",
            _ => "NAT rebinding N1 → N2 6 s after the answer, strict-source",
        },
        flags,
        invites: vec![Invite::plain(Port::P1, 9000)],
        caller_sends_from: Port::N1,
        moves: vec![Move { after_answer: 1, delay_ms: 6000, to: Port::N2 }],
        check,
    }
}

// ---------------------------------------------------------------------------------------------
// Expectations
// ---------------------------------------------------------------------------------------------

/// Packets a direction may lose overall (the relay's first packets while it latches).
const MAX_LOST: usize = 2;
/// Packets a window may miss at the expected socket (in flight across a change).
const MAX_MISSING: usize = 3;
/// A move or an answer takes effect within this long.
const SETTLE: Duration = Duration::from_millis(100);
/// Before the first window: the first packets latch the relay.
const FIRST_SETTLE: Duration = Duration::from_millis(200);

fn check_s1(r: &CallRecord, c: &mut Checks) {
    let (Some(a1), Some(i2), Some(moved), Some(end)) = (r.at("answered 1"), r.at("inviting 2"), r.at("moved 1"), r.at("end")) else {
        return c.incomplete(r);
    };
    c.delivered(r, Dir::Up, a1..end, &[Port::Callee], MAX_LOST, "the whole call (the caller's move included)");
    c.delivered(r, Dir::Down, a1 + FIRST_SETTLE..i2, &[Port::P1], MAX_MISSING, "before the re-INVITE");
    c.delivered(r, Dir::Down, moved + SETTLE..end, &[Port::P2], MAX_MISSING, "from 100 ms after the caller moved to P2 to the end");
    c.check(end - moved >= Duration::from_secs(3), format!("the call ran {:.1} s after the move (≥ 3 s)", (end - moved).as_secs_f64()));
}

fn check_s2(r: &CallRecord, c: &mut Checks) {
    let (Some(a1), Some(moved), Some(end)) = (r.at("answered 1"), r.at("moved 1"), r.at("end")) else {
        return c.incomplete(r);
    };
    c.delivered(r, Dir::Up, a1..end, &[Port::Callee], MAX_LOST, "the whole call (from N1, then N2)");
    c.delivered(r, Dir::Down, a1 + FIRST_SETTLE..moved, &[Port::N1], MAX_MISSING, "before the rebinding: to N1, where the caller sends from");
    c.delivered(r, Dir::Down, moved + SETTLE..end, &[Port::N2], MAX_MISSING, "from 100 ms after the rebinding: follows to N2");
}

/// S3a/b/c before the move: the caller sends from N1, so the relay sends there.
fn check_s3_before_move(r: &CallRecord, c: &mut Checks) -> Option<(Instant, Instant, Instant)> {
    let (Some(a1), Some(moved), Some(end)) = (r.at("answered 1"), r.at("moved 1"), r.at("end")) else {
        c.incomplete(r);
        return None;
    };
    c.delivered(r, Dir::Down, a1 + FIRST_SETTLE..moved, &[Port::N1], MAX_MISSING, "before the rebinding: to N1");
    Some((a1, moved, end))
}

fn check_s3a(r: &CallRecord, c: &mut Checks) {
    let Some((a1, moved, end)) = check_s3_before_move(r, c) else { return };
    c.delivered(r, Dir::Up, a1..end, &[Port::Callee], MAX_LOST, "the whole call: N2's packets are still relayed to the callee");
    c.delivered(r, Dir::Down, moved + SETTLE..end, &[Port::N1], MAX_MISSING, "after the rebinding: the return path stays on the locked N1 (one-way audio)");
    c.at_most(r, Dir::Down, a1..end, &[Port::N2], MAX_MISSING, "N2 (the new binding) hears ~nothing");
}

fn check_s3b(r: &CallRecord, c: &mut Checks) {
    let Some((a1, moved, end)) = check_s3_before_move(r, c) else { return };
    c.delivered(r, Dir::Up, a1..end, &[Port::Callee], MAX_LOST, "the whole call (from N1, then N2)");
    c.delivered(r, Dir::Down, moved + SETTLE..end, &[Port::N2], MAX_MISSING, "from 100 ms after the rebinding: media-handover follows to N2");
}

fn check_s3c(r: &CallRecord, c: &mut Checks) {
    let Some((a1, moved, end)) = check_s3_before_move(r, c) else { return };
    c.delivered(r, Dir::Up, a1..moved, &[Port::Callee], MAX_LOST, "before the rebinding (from N1)");
    let from_n2 = r.sent.iter().filter(|s| s.dir == Dir::Up && s.from == Port::N2).count();
    let from_n2_arrived = r.sent.iter().filter(|s| s.dir == Dir::Up && s.from == Port::N2 && r.arrived(Dir::Up, s.seq, &[Port::Callee])).count();
    c.check(from_n2 > 0 && from_n2_arrived == 0, format!("strict-source: of {from_n2} packets from N2, {from_n2_arrived} reached the callee (0 expected)"));
    c.delivered(r, Dir::Down, moved + SETTLE..end, &[Port::N1], MAX_MISSING, "after the rebinding: the return path stays on the locked N1");
}

fn check_s4(r: &CallRecord, c: &mut Checks) {
    check_hold(r, c, false);
}

/// rtpengine does not gate media by direction attributes: only the zero address stops it.
fn check_s4b(r: &CallRecord, c: &mut Checks) {
    check_hold(r, c, true);
}

fn check_hold(r: &CallRecord, c: &mut Checks, caller_hears_on_hold: bool) {
    let (Some(a1), Some(hold), Some(held), Some(unhold), Some(resumed), Some(end)) =
        (r.at("answered 1"), r.at("inviting 2"), r.at("answered 2"), r.at("inviting 3"), r.at("answered 3"), r.at("end"))
    else {
        return c.incomplete(r);
    };
    c.delivered(r, Dir::Up, a1..hold, &[Port::Callee], MAX_LOST, "before the hold");
    c.delivered(r, Dir::Down, a1 + FIRST_SETTLE..hold, &[Port::P1], MAX_MISSING, "before the hold");
    c.delivered(r, Dir::Up, held + SETTLE..unhold, &[Port::Callee], MAX_MISSING, "on hold: the caller's music on hold reaches the callee");
    if caller_hears_on_hold {
        c.delivered(r, Dir::Down, held + SETTLE..unhold, &[Port::P1], MAX_MISSING, "on hold (sendonly, real address): still relayed to the caller");
    } else {
        c.at_most(r, Dir::Down, held + SETTLE..unhold, &[Port::P1], 0, "on hold (c=0.0.0.0): nothing reaches the caller");
    }
    c.delivered(r, Dir::Up, resumed + SETTLE..end, &[Port::Callee], MAX_MISSING, "after the unhold");
    c.delivered(r, Dir::Down, resumed + SETTLE..end, &[Port::P1], MAX_MISSING, "after the unhold");
}

/// The outcome of each expectation, printed as a list; the failed ones fail the test.
#[derive(Default)]
struct Checks {
    results: Vec<(bool, String)>,
}

impl Checks {
    fn check(&mut self, ok: bool, what: String) {
        self.results.push((ok, what));
    }

    fn incomplete(&mut self, r: &CallRecord) {
        self.check(false, format!("the call's SIP timeline is incomplete: {:?}", r.events.keys().collect::<Vec<_>>()));
    }

    /// Of `dir`'s packets sent in `window`, all but `max_missing` arrived at one of `at`.
    fn delivered(&mut self, r: &CallRecord, dir: Dir, window: std::ops::Range<Instant>, at: &[Port], max_missing: usize, when: &str) {
        let (sent, arrived) = r.window(dir, &window, at);
        let missing = sent - arrived;
        let ok = sent >= 10 && missing <= max_missing;
        self.check(ok, format!("{}, {when}: {arrived} of {sent} at {at:?} ({missing} missing, ≤ {max_missing} allowed)", dir.label()));
    }

    /// Of `dir`'s packets sent in `window`, at most `max` arrived at one of `at`.
    fn at_most(&mut self, r: &CallRecord, dir: Dir, window: std::ops::Range<Instant>, at: &[Port], max: usize, when: &str) {
        let (sent, arrived) = r.window(dir, &window, at);
        self.check(sent >= 10 && arrived <= max, format!("{}, {when}: {arrived} of {sent} at {at:?} (≤ {max} expected)", dir.label()));
    }

    fn failed(&self) -> impl Iterator<Item = &str> {
        self.results.iter().filter(|(ok, _)| !ok).map(|(_, what)| what.as_str())
    }
}

// ---------------------------------------------------------------------------------------------
// One call
// ---------------------------------------------------------------------------------------------

/// Per-call addresses: call `index` uses its own ports and SSRCs.
struct CallPlan<'a> {
    index: usize,
    scenario: &'a Scenario,
    caller_ip: IpAddr,
    callee_ip: IpAddr,
}

impl CallPlan<'_> {
    fn port(&self, p: Port) -> u16 {
        let i = self.index as u16;
        match p {
            Port::P1 => 20000 + 100 * i,
            Port::P2 => 20002 + 100 * i,
            Port::N1 => 20010 + 100 * i,
            Port::N2 => 20012 + 100 * i,
            Port::Callee => 30000 + 100 * i,
        }
    }

    fn addr(&self, p: Port) -> SocketAddr {
        SocketAddr::new(if p == Port::Callee { self.callee_ip } else { self.caller_ip }, self.port(p))
    }

    fn ssrc(&self, dir: Dir) -> u32 {
        match dir {
            Dir::Up => 0xca11_0000 + self.index as u32,
            Dir::Down => 0xca1e_0000 + self.index as u32,
        }
    }

    fn uas_sip_port(&self) -> u16 {
        5100 + 10 * self.index as u16
    }

    /// The caller's sockets: the SDP ports and the ones it sends from.
    fn caller_ports(&self) -> Vec<Port> {
        let sc = self.scenario;
        let mut ports: Vec<Port> = sc.invites.iter().map(|i| i.sdp_port).chain([sc.caller_sends_from]).chain(sc.moves.iter().map(|m| m.to)).collect();
        ports.sort();
        ports.dedup();
        ports
    }
}

/// A packet the test sent.
struct Sent {
    dir: Dir,
    seq: u16,
    at: Instant,
    from: Port,
}

/// What happened in one call.
struct CallRecord {
    id: &'static str,
    title: &'static str,
    flags: &'static str,
    /// SIP and media moments: "inviting N", "answered N", "offered N" (SIPp's logs, as the test
    /// saw them), "moved N" (the caller's Nth move), "end" (last packet sent).
    events: BTreeMap<String, Instant>,
    sent: Vec<Sent>,
    /// Every arrival of each packet: the socket it arrived at.
    arrivals: HashMap<(Dir, u16), Vec<Port>>,
    /// Datagrams at this call's sockets that are not its RTP (socket → count).
    strays: BTreeMap<Port, usize>,
    uac: Result<(), String>,
    uas: Result<(), String>,
}

impl CallRecord {
    fn at(&self, event: &str) -> Option<Instant> {
        self.events.get(event).copied()
    }

    fn arrived(&self, dir: Dir, seq: u16, at: &[Port]) -> bool {
        self.arrivals.get(&(dir, seq)).is_some_and(|ports| ports.iter().any(|p| at.contains(p)))
    }

    /// (sent in `window`, of those arrived at one of `at`).
    fn window(&self, dir: Dir, window: &std::ops::Range<Instant>, at: &[Port]) -> (usize, usize) {
        let sent: Vec<&Sent> = self.sent.iter().filter(|s| s.dir == dir && window.contains(&s.at)).collect();
        let arrived = sent.iter().filter(|s| self.arrived(dir, s.seq, at)).count();
        (sent.len(), arrived)
    }

    /// The per-scenario table: per direction sent / received / lost / duplicates, and per
    /// receiving socket what arrived there.
    fn table(&self, plan: &CallPlan) -> String {
        let mut t = String::new();
        let flags = if self.flags.is_empty() { "no flags".to_string() } else { format!("flags: {}", self.flags) };
        let _ = writeln!(t, "{}: {} ({flags})", self.id, self.title);
        let _ = writeln!(t, "  {:<15} {:>6} {:>9} {:>6} {:>5}", "direction", "sent", "received", "lost", "dups");
        for dir in [Dir::Up, Dir::Down] {
            let sent = self.sent.iter().filter(|s| s.dir == dir).count();
            let received = self.arrivals.keys().filter(|(d, _)| *d == dir).count();
            let dups: usize = self.arrivals.iter().filter(|((d, _), _)| *d == dir).map(|(_, v)| v.len() - 1).sum();
            let _ = writeln!(t, "  {:<15} {sent:>6} {received:>9} {:>6} {dups:>5}", dir.label(), sent - received);
        }
        let _ = writeln!(t, "  {:<27} {:>9} {:>9}", "receiving socket", "received", "stray");
        let mut ports = plan.caller_ports();
        ports.push(Port::Callee);
        for p in ports {
            let n: usize = self.arrivals.values().map(|v| v.iter().filter(|q| **q == p).count()).sum();
            let label = format!("{p:?} {}", plan.addr(p));
            let _ = writeln!(t, "  {label:<27} {n:>9} {:>9}", self.strays.get(&p).copied().unwrap_or(0));
        }
        t
    }
}

/// Run one call: its SIPp UAS and UAC, and both media endpoints, until the caller stopped
/// sending before its BYE and SIPp finished.
fn run_call(tb: &Testbed, dir: &Path, plan: &CallPlan) -> CallRecord {
    let sc = plan.scenario;
    std::fs::write(dir.join(format!("{}-uac.xml", sc.id)), uac_xml(plan)).unwrap();
    std::fs::write(dir.join(format!("{}-uas.xml", sc.id)), uas_xml(plan)).unwrap();
    let (caller_ns, callee_ns) = (&tb.peers[0].ns, &tb.peers[1].ns);
    let bind = |ns: &str, p: Port| {
        let s = tb.udp_socket(ns, plan.addr(p)).unwrap_or_else(|e| panic!("{}: binding {p:?} {}: {e}", sc.id, plan.addr(p)));
        s.set_nonblocking(true).unwrap();
        (p, s)
    };
    let mut sockets: Vec<(Port, UdpSocket)> = plan.caller_ports().into_iter().map(|p| bind(caller_ns, p)).collect();
    sockets.push(bind(callee_ns, Port::Callee));

    let mut record = CallRecord {
        id: sc.id,
        title: sc.title,
        flags: sc.flags,
        events: BTreeMap::new(),
        sent: Vec::new(),
        arrivals: HashMap::new(),
        strays: BTreeMap::new(),
        uac: Ok(()),
        uas: Ok(()),
    };
    let uas_port = plan.uas_sip_port();
    let mut uas = sip::spawn_group("sipp uas", &mut sipp_command(tb, dir, sc.id, "uas", uas_port)).unwrap();
    if let Err(e) = sip::wait_udp_bound(&mut uas, uas_port, Duration::from_secs(10)) {
        record.uas = Err(e);
        return record;
    }
    let mut uac_cmd = sipp_command(tb, dir, sc.id, "uac", uas_port + 1);
    let mut uac = sip::spawn_group("sipp uac", uac_cmd.arg(KAMAILIO)).unwrap();

    let (mut uac_log, mut uas_log) = (sip::LogTail::new(dir.join(format!("{}-uac.log", sc.id))), sip::LogTail::new(dir.join(format!("{}-uas.log", sc.id))));
    // Where each party sends: the relay's address from the latest SDP it received (the callee
    // keeps its last real one when an offer says 0.0.0.0, as a phone on hold keeps talking).
    let (mut caller_target, mut callee_target): (Option<SocketAddr>, Option<SocketAddr>) = (None, None);
    let mut caller_from = sc.caller_sends_from;
    let mut moves_done = 0;
    let (mut seq_up, mut seq_down) = (0u16, 0u16);
    let mut next_send: Option<Instant> = None;
    let mut stop: Option<Instant> = None;
    let deadline = Instant::now() + CALL_DEADLINE;
    let payload = [0xd5u8; 160];
    let mut buf = [0u8; 2048];
    loop {
        let now = Instant::now();
        for line in uas_log.lines() {
            if let Some((event, addr)) = sip::parse_sipp_event(&line) {
                if let Some(a) = addr.filter(|a| !a.ip().is_unspecified()) {
                    callee_target = Some(a);
                }
                record.events.entry(event).or_insert(now);
            }
        }
        for line in uac_log.lines() {
            if let Some((event, addr)) = sip::parse_sipp_event(&line) {
                if event.starts_with("answered") {
                    caller_target = addr.or(caller_target);
                    // Media starts with the first answer; stops before the BYE that follows the last.
                    next_send.get_or_insert(now);
                    if event == format!("answered {}", sc.invites.len()) {
                        let last = sc.invites.last().unwrap();
                        stop = Some(now + Duration::from_millis(last.then_ms) - STOP_BEFORE_BYE);
                    }
                }
                record.events.entry(event).or_insert(now);
            }
        }
        if let Some(m) = sc.moves.get(moves_done) {
            if record.at(&format!("answered {}", m.after_answer)).is_some_and(|t| now >= t + Duration::from_millis(m.delay_ms)) {
                caller_from = m.to;
                moves_done += 1;
                record.events.insert(format!("moved {moves_done}"), now);
            }
        }
        if let Some(due) = next_send.filter(|due| now >= *due && stop.is_none_or(|s| now < s)) {
            let socket = |p: Port| &sockets.iter().find(|(q, _)| *q == p).unwrap().1;
            if let Some(to) = caller_target {
                let _ = socket(caller_from).send_to(&build_rtp(8, seq_up, seq_up as u32 * 160, plan.ssrc(Dir::Up), &payload), to);
                record.sent.push(Sent { dir: Dir::Up, seq: seq_up, at: now, from: caller_from });
                seq_up += 1;
            }
            if let Some(to) = callee_target {
                let _ = socket(Port::Callee).send_to(&build_rtp(8, seq_down, seq_down as u32 * 160, plan.ssrc(Dir::Down), &payload), to);
                record.sent.push(Sent { dir: Dir::Down, seq: seq_down, at: now, from: Port::Callee });
                seq_down += 1;
            }
            record.events.insert("end".into(), now);
            next_send = Some(due + PACKET_INTERVAL);
        }
        for (port, s) in &sockets {
            loop {
                match s.recv_from(&mut buf) {
                    Ok((n, _)) => {
                        let rtp = &buf[..n];
                        let ssrc = (n >= 12).then(|| u32::from_be_bytes([rtp[8], rtp[9], rtp[10], rtp[11]]));
                        let dir = match (ssrc, *port) {
                            (Some(x), Port::Callee) if x == plan.ssrc(Dir::Up) => Some(Dir::Up),
                            (Some(x), p) if p != Port::Callee && x == plan.ssrc(Dir::Down) => Some(Dir::Down),
                            _ => None,
                        };
                        match dir {
                            Some(d) => record.arrivals.entry((d, u16::from_be_bytes([rtp[2], rtp[3]]))).or_default().push(*port),
                            None => *record.strays.entry(*port).or_default() += 1,
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                    Err(e) => panic!("{}: receiving on {port:?}: {e}", sc.id),
                }
            }
        }
        let caller_gave_up = stop.is_none() && !uac.alive();
        if stop.is_some_and(|s| now >= s + DRAIN) || now >= deadline || caller_gave_up {
            break;
        }
        std::thread::sleep(POLL);
    }
    record.uac = sip::sipp_result(&mut uac, dir, sc.id, "uac");
    record.uas = sip::sipp_result(&mut uas, dir, sc.id, "uas");
    record
}

// ---------------------------------------------------------------------------------------------
// SIPp scenarios
// ---------------------------------------------------------------------------------------------

/// The caller: each INVITE (logged as "inviting N" before it is sent; its answer's relay address
/// as "answered N IP PORT"), its ACK and pause, then the BYE.
fn uac_xml(plan: &CallPlan) -> String {
    let sc = plan.scenario;
    let uas = format!("sip:callee@127.0.0.1:{}", plan.uas_sip_port());
    let flags = if sc.flags.is_empty() { String::new() } else { format!("\n      X-RTP-Flags: {}", sc.flags) };
    let mut x = format!("<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n<!DOCTYPE scenario SYSTEM \"sipp.dtd\">\n<scenario name=\"{} caller\">\n", sc.id);
    let dialog = |cseq: usize, method: &str, to_tag: &str| {
        format!(
            "{method} {uas} SIP/2.0
      Via: SIP/2.0/[transport] [local_ip]:[local_port];branch=[branch]
      From: <sip:caller@[local_ip]:[local_port]>;tag=caller[pid]-[call_number]
      To: <{uas}>{to_tag}
      Call-ID: [call_id]
      CSeq: {cseq} {method}
      Contact: <sip:caller@[local_ip]:[local_port]>
      Max-Forwards: 70"
        )
    };
    for (i, inv) in sc.invites.iter().enumerate() {
        let n = i + 1;
        let to_tag = if n == 1 { "" } else { "[peer_tag_param]" };
        let (conn, direction) = match inv.hold {
            Hold::No => (plan.caller_ip.to_string(), "sendrecv"),
            Hold::ZeroAddress => ("0.0.0.0".to_string(), "sendonly"),
            Hold::SendOnly => (plan.caller_ip.to_string(), "sendonly"),
        };
        let _ = write!(
            x,
            r#"  <nop><action><log message="inviting {n}"/></action></nop>
  <send retrans="500">
    <![CDATA[

      {head}{flags}
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=caller 1 {n} IN IP4 {ip}
      s=-
      c=IN IP4 {conn}
      t=0 0
      m=audio {port} RTP/AVP 8
      a=rtpmap:8 PCMA/8000
      a=ptime:20
      a={direction}

    ]]>
  </send>
{answer}  <send>
    <![CDATA[

      {ack}
      Content-Length: 0

    ]]>
  </send>
  <pause milliseconds="{then}"/>
"#,
            head = dialog(n, "INVITE", to_tag),
            answer = recv_answer(n, "m=audio ([0-9]+)"),
            ip = plan.caller_ip,
            port = plan.port(inv.sdp_port),
            ack = dialog(n, "ACK", "[peer_tag_param]"),
            then = inv.then_ms,
        );
    }
    let _ = write!(
        x,
        r#"  <send retrans="500">
    <![CDATA[

      {bye}
      Content-Length: 0

    ]]>
  </send>
  <recv response="200"/>
  <Reference variables="c_line,m_line"/>
</scenario>
"#,
        bye = dialog(sc.invites.len() + 1, "BYE", "[peer_tag_param]")
    );
    x
}

/// The callee: each INVITE's relay address logged as "offered N IP PORT" (a hold INVITE must
/// still say 0.0.0.0, or the call fails), the 200 OK after the scenario's delay, the ACK; the BYE.
fn uas_xml(plan: &CallPlan) -> String {
    let sc = plan.scenario;
    let mut x = format!("<?xml version=\"1.0\" encoding=\"ISO-8859-1\" ?>\n<!DOCTYPE scenario SYSTEM \"sipp.dtd\">\n<scenario name=\"{} callee\">\n", sc.id);
    let mut references = vec!["c_line", "m_line"];
    for (i, inv) in sc.invites.iter().enumerate() {
        let n = i + 1;
        let hold_check = if inv.hold == Hold::ZeroAddress {
            references.push("zero_address");
            "\n      <ereg regexp=\"c=IN IP4 0\\.0\\.0\\.0\" search_in=\"body\" check_it=\"true\" assign_to=\"zero_address\"/>"
        } else {
            ""
        };
        let delay = if inv.answer_delay_ms > 0 { format!("  <pause milliseconds=\"{}\"/>\n", inv.answer_delay_ms) } else { String::new() };
        let to_tag = if n == 1 { ";tag=callee[pid]-[call_number]" } else { "" };
        let _ = write!(
            x,
            r#"{offer}{delay}  <send retrans="500">
    <![CDATA[

      SIP/2.0 200 OK
      [last_Via:]
      [last_From:]
      [last_To:]{to_tag}
      [last_Call-ID:]
      [last_CSeq:]
      Contact: <sip:callee@[local_ip]:[local_port]>
      Content-Type: application/sdp
      Content-Length: [len]

      v=0
      o=callee 1 {n} IN IP4 {ip}
      s=-
      c=IN IP4 {ip}
      t=0 0
      m=audio {port} RTP/AVP 8
      a=rtpmap:8 PCMA/8000
      a=ptime:20
      a={direction}

    ]]>
  </send>
  <recv request="ACK" crlf="true"/>
"#,
            offer = recv_offer(n, "m=audio ([0-9]+)", hold_check),
            ip = plan.callee_ip,
            port = plan.port(Port::Callee),
            direction = if inv.hold == Hold::No { "sendrecv" } else { "recvonly" },
        );
    }
    let _ = write!(x, "{}  <Reference variables=\"{}\"/>\n</scenario>\n", sip::UAS_BYE_OK, references.join(","));
    x
}

// ---------------------------------------------------------------------------------------------
// The run
// ---------------------------------------------------------------------------------------------

fn run_scenarios(relay: Relay) {
    let Some(bed) = Bed::start("latching", relay, BASE_FLAGS) else { return };
    let tb = &bed.tb;

    let scenarios = scenarios();
    let plans: Vec<CallPlan> =
        scenarios.iter().enumerate().map(|(index, scenario)| CallPlan { index, scenario, caller_ip: tb.peers[0].ip, callee_ip: tb.peers[1].ip }).collect();
    let records = bed.run_calls(&plans, run_call);

    let mut report = String::new();
    let mut failures = Vec::new();
    for (plan, record) in plans.iter().zip(&records) {
        let mut checks = Checks::default();
        for (ok, what) in sipp_completed(&record.uac, &record.uas) {
            checks.check(ok, what);
        }
        (plan.scenario.check)(record, &mut checks);
        report += &record.table(plan);
        for (ok, what) in &checks.results {
            let _ = writeln!(report, "  {} {what}", if *ok { "ok  " } else { "FAIL" });
        }
        failures.extend(checks.failed().map(|f| format!("{}: {f}", record.id)));
    }
    let received = records.iter().map(|r| r.arrivals.values().map(Vec::len).sum::<usize>()).sum();
    bed.finish(received, report, failures);
}

relay_tests!(run_scenarios, latching_rtpengine, latching_mediaplane_userspace, latching_mediaplane_ebpf, latching_mediaplane_afxdp);
