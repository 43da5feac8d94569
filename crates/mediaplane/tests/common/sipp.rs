//! The SIP interop bed shared by `interop_latching` and `interop_codecs`: a star testbed of two
//! peer namespaces around a relay namespace, the relay under test in it (rtpengine 10.5 in user
//! space, or `mediaplane serve` on the user-space or eBPF plane, NG on [`NG`]) and Kamailio
//! driving it (SIP on [`KAMAILIO`]); SIPp processes run in the relay namespace, their logs
//! tailed by the test. One bed at a time per test binary: the tests share the machine's cores
//! and time-sensitive windows.

use super::TempDir;
use mediaplane_bench::netns::Testbed;
use mediaplane_bench::sip::{self, Kamailio, KamailioConfig};
use mediaplane_harness::bench_relay::{RelayProc, RelaySetup, NG};
// SIPp's log tailing and process helpers live in mediaplane_bench::sip (shared with other tests).
#[allow(unused_imports)] // not every test binary uses all of them
pub use mediaplane_bench::sip::{parse_sipp_event, sipp_command, sipp_result, LogTail};
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

/// Kamailio's SIP address in the relay namespace.
pub const KAMAILIO: &str = "127.0.0.1:5060";
/// Kamailio's SIP-over-WebSocket port ([`Bed::start_websocket`]), on the relay's address on
/// peer 0's link.
pub const WEBSOCKET_PORT: u16 = 8088;

static SERIAL: Mutex<()> = Mutex::new(());

/// The three tests of an interop file, one per relay: `relay_tests!(run, rtpengine_test,
/// userspace_test, ebpf_test)` where `run(Relay)` runs the file's scenarios on that relay.
#[macro_export]
macro_rules! relay_tests {
    ($run:ident, $rtpengine:ident, $userspace:ident, $ebpf:ident) => {
        #[test]
        fn $rtpengine() {
            $run($crate::common::sipp::Relay::Rtpengine);
        }

        #[test]
        fn $userspace() {
            $run($crate::common::sipp::Relay::MediaplaneUserspace);
        }

        #[test]
        fn $ebpf() {
            $run($crate::common::sipp::Relay::MediaplaneEbpf);
        }
    };
    ($run:ident, $rtpengine:ident, $userspace:ident, $ebpf:ident, $afxdp:ident) => {
        relay_tests!($run, $rtpengine, $userspace, $ebpf);

        #[test]
        fn $afxdp() {
            $run($crate::common::sipp::Relay::MediaplaneAfxdp);
        }
    };
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Relay {
    Rtpengine,
    MediaplaneUserspace,
    MediaplaneEbpf,
    /// The AF_XDP plane (`--dataplane afxdp`; a relay's SRTP per packet in its AF_XDP thread).
    MediaplaneAfxdp,
}

impl Relay {
    /// Its name for [`RelayProc`].
    pub fn name(self) -> &'static str {
        match self {
            Relay::Rtpengine => "rtpengine",
            Relay::MediaplaneUserspace => "mediaplane-userspace",
            Relay::MediaplaneEbpf => "mediaplane-ebpf",
            Relay::MediaplaneAfxdp => "mediaplane-afxdp",
        }
    }
}

/// A running bed: the testbed, the relay, Kamailio, the run's directory.
pub struct Bed {
    pub relay: Relay,
    pub tb: Testbed,
    pub tmp: TempDir,
    relay_proc: RelayProc,
    kamailio: Kamailio,
    /// Kamailio's WebSocket address ([`Bed::start_websocket`]).
    pub websocket: Option<SocketAddr>,
    /// Whether the eBPF plane should forward the media in the kernel: true unless a leg's media
    /// is terminated (SRTP to plain RTP goes through user space, per packet); then it must have
    /// handed the media up to its slow path.
    pub media_in_kernel: bool,
    started: Instant,
    _one_at_a_time: MutexGuard<'static, ()>,
}

impl Bed {
    /// The bed for test `<prefix>_<relay>`, with Kamailio's `base_flags` on every offer and
    /// answer; None (after saying why) when the tools are missing outside CI.
    pub fn start(prefix: &str, relay: Relay, base_flags: &str) -> Option<Bed> {
        Bed::start_inner(prefix, relay, base_flags, false)
    }

    /// [`Bed::start`] with Kamailio also taking SIP over WebSocket on [`WEBSOCKET_PORT`] of the
    /// relay's address on peer 0's link ([`KamailioConfig::websocket`]: a WebSocket caller is
    /// bridged to plain RTP).
    pub fn start_websocket(prefix: &str, relay: Relay, base_flags: &str) -> Option<Bed> {
        Bed::start_inner(prefix, relay, base_flags, true)
    }

    fn start_inner(prefix: &str, relay: Relay, base_flags: &str, websocket: bool) -> Option<Bed> {
        let test = format!("{prefix}_{}", relay.name().replace('-', "_"));
        let tools: &[&str] = if relay == Relay::Rtpengine { &["kamailio", "sipp", "rtpengine"] } else { &["kamailio", "sipp"] };
        if !sip::ready(&test, tools) {
            return None;
        }
        let one_at_a_time = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
        let started = Instant::now();
        let tmp = TempDir::new(prefix);
        let tb = Testbed::star(2).expect("testbed");
        let relay_proc = RelayProc::start_binary(&tb, relay.name(), &tmp.0, Path::new(env!("CARGO_BIN_EXE_mediaplane")), &RelaySetup::default())
            .unwrap_or_else(|e| panic!("starting {}: {e:#}", relay.name()));
        let modules = sip::kamailio_module_dir().unwrap();
        let websocket = websocket.then(|| SocketAddr::new(tb.peers[0].sfu_ip, WEBSOCKET_PORT));
        let kamailio_cfg =
            KamailioConfig { listen: KAMAILIO.parse().unwrap(), ng: NG.parse().unwrap(), next_hop: None, flags: base_flags, modules: &modules, websocket };
        let kamailio = Kamailio::start(tb.command(&tb.sfu_ns, sip::which("kamailio").unwrap().to_str().unwrap()), &kamailio_cfg, &tmp.0)
            .unwrap_or_else(|e| panic!("starting kamailio: {e}"));
        Some(Bed { relay, tb, tmp, relay_proc, kamailio, websocket, media_in_kernel: true, started, _one_at_a_time: one_at_a_time })
    }

    /// Run `call` for every plan at once (a thread each), in the bed's testbed and directory.
    pub fn run_calls<P: Sync, R: Send>(&self, plans: &[P], call: impl Fn(&Testbed, &Path, &P) -> R + Sync) -> Vec<R> {
        std::thread::scope(|s| {
            let handles: Vec<_> = plans.iter().map(|plan| s.spawn(|| call(&self.tb, &self.tmp.0, plan))).collect();
            handles.into_iter().map(|h| h.join().expect("call thread panicked")).collect()
        })
    }

    /// On the eBPF plane, the media crossed the TC programs. With [`Bed::media_in_kernel`]: every
    /// packet the endpoints `received` was forwarded in the kernel but those the BPF program
    /// handed up to the slow path, and those are only the first packets of a leg whose source
    /// was not latched yet (`pass_unlatched`, relayed by the slow path, which reports the source
    /// to the kernel): no other reason to go up, and at most 2 % of what was received (measured:
    /// 18 of 4,543 in interop_latching, 6 of 600 in interop_codecs). Without it (SRTP ↔ RTP is
    /// per-packet crypto in user space): every received packet was handed up. A line in `report`,
    /// a failure if not; a counter missing from the stats panics.
    fn check_kernel_path(&self, received: usize, report: &mut String, failures: &mut Vec<String>) {
        if self.relay != Relay::MediaplaneEbpf {
            return;
        }
        let stats = super::netns::try_api(&self.tb, "GET", "/v1/stats", None).unwrap_or_else(|e| panic!("GET /v1/stats: {e}"));
        let counter = |k: &str| stats["extra"][k].as_u64().unwrap_or_else(|| panic!("no {k} in the stats: {}", stats["extra"])) as usize;
        let (forwarded, unlatched, slow_stream) = (counter("forwarded"), counter("pass_unlatched"), counter("pass_slow_stream"));
        // Every other reason the kernel hands a packet of the relay's streams up.
        let others: Vec<(&str, usize)> = mediaplane_ebpf::maps::SLOW_PATH_PASSES
            .iter()
            .filter(|k| !["pass_unlatched", "pass_slow_stream"].contains(k))
            .map(|k| (*k, counter(k)))
            .filter(|(_, n)| *n > 0)
            .collect();
        let (ok, line) = if self.media_in_kernel {
            let ok = received > 0 && forwarded + unlatched >= received && unlatched * 50 <= received && slow_stream == 0 && others.is_empty();
            (ok, format!("{forwarded} packets forwarded by the BPF program, {unlatched} handed up unlatched, {slow_stream} as slow streams, others {others:?}; {received} received by the endpoints"))
        } else {
            let ok = received > 0 && slow_stream + unlatched >= received;
            (ok, format!("{slow_stream} packets handed up by the BPF program as slow streams and {unlatched} unlatched, {received} received by the endpoints"))
        };
        let _ = writeln!(report, "  {} kernel path: {line}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(format!("kernel path: {line}"));
        }
    }

    /// Check the kernel path ([`Bed::check_kernel_path`]: on the eBPF plane, the `received`
    /// packets the endpoints counted were forwarded in the kernel, or handed up), print the
    /// report; fail with `failures` and the logs' tails, or stop the relay cleanly.
    /// MP_KEEP_TMP=1 keeps the run's directory.
    /// Restart mediaplane on its store ([`mediaplane_harness::bench_relay::RelayProc::restart`]).
    #[allow(dead_code)] // Not every test binary restarts.
    pub fn restart_relay(&mut self) -> anyhow::Result<()> {
        self.relay_proc.restart(&self.tb)
    }

    pub fn finish(self, received: usize, mut report: String, mut failures: Vec<String>) {
        self.check_kernel_path(received, &mut report, &mut failures);
        let Bed { relay, tb, tmp, mut relay_proc, kamailio, started, .. } = self;
        let seconds = started.elapsed().as_secs_f64();
        eprintln!("=== {} ({seconds:.1} s, testbed {}) ===\n{report}", relay.name(), tb.prefix);
        let diag = || format!("\n--- kamailio ---\n{}\n--- {} ---\n{}", kamailio.log_tail(15), relay.name(), sip::log_tail(relay_proc.log_path(), 15));
        if std::env::var_os("MP_KEEP_TMP").is_some() {
            eprintln!("kept {}", tmp.0.display());
            std::mem::forget(tmp);
        }
        assert!(failures.is_empty(), "{}: {} expectation(s) failed:\n{}{}", relay.name(), failures.len(), failures.join("\n"), diag());
        drop(kamailio);
        relay_proc.stop().unwrap_or_else(|e| panic!("{e:#}"));
    }
}

/// SIPp receiving the 200 OK to INVITE number `n` (provisional responses optional): its c=
/// address and the port of the m= line `m_regexp` matches (its group) are logged as
/// "answered N IP PORT"; the call fails if either is missing.
pub fn recv_answer(n: usize, m_regexp: &str) -> String {
    format!(
        r#"  <recv response="100" optional="true"/>
  <recv response="180" optional="true"/>
  <recv response="200">
    <action>
      <ereg regexp="c=IN IP4 ([0-9.]+)" search_in="body" check_it="true" assign_to="c_line,answer_ip"/>
      <ereg regexp="{m_regexp}" search_in="body" check_it="true" assign_to="m_line,answer_port"/>
      <log message="answered {n} [$answer_ip] [$answer_port]"/>
    </action>
  </recv>
"#
    )
}

/// SIPp receiving INVITE number `n`: its c= address and the port of the m= line `m_regexp`
/// matches (its group) are logged as "offered N IP PORT"; `checks` are further `<ereg>`
/// actions. The call fails if a check does.
pub fn recv_offer(n: usize, m_regexp: &str, checks: &str) -> String {
    format!(
        r#"  <recv request="INVITE" crlf="true">
    <action>
      <ereg regexp="c=IN IP4 ([0-9.]+)" search_in="body" check_it="true" assign_to="c_line,offer_ip"/>
      <ereg regexp="{m_regexp}" search_in="body" check_it="true" assign_to="m_line,offer_port"/>{checks}
      <log message="offered {n} [$offer_ip] [$offer_port]"/>
    </action>
  </recv>
"#
    )
}

/// "SIPp UAC/UAS completed the call" checks, as (ok, what).
pub fn sipp_completed(uac: &Result<(), String>, uas: &Result<(), String>) -> [(bool, String); 2] {
    [("UAC", uac), ("UAS", uas)].map(|(role, result)| {
        (result.is_ok(), format!("SIPp {role} completed the call{}", result.as_ref().err().map(|e| format!(": {e}")).unwrap_or_default()))
    })
}
