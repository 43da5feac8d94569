//! The daemon's one metrics registry (`prometheus-client`): it feeds `/metrics`, and the same
//! sources feed `/v1/stats` ([`StatsReading`]) and NG `statistics` ([`NgMetrics`]), so the three
//! cannot disagree.
//!
//! Data-plane counters are not copied into the registry: a [`Collector`] reads them at scrape
//! time and groups them by meaning ([`counter_family`], [`extra_family`]): one family per
//! meaning with a `reason` label, base units (seconds, bytes), `_total` on every counter.

use crate::config::MetricsSection;
use crate::manager::SessionManager;
use mediaplane_core::reception::ReceptionReport;
use mediaplane_dataplane::{Counters, DataplaneStats, LatencyHistogram, MapFill};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::Registry;
use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

/// Request latency buckets, seconds (0.5 ms to 10 s).
const REQUEST_BUCKETS: [f64; 14] = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// The registry and the instruments the request paths update.
pub struct Metrics {
    registry: Registry,
    pub http: HttpMetrics,
    pub ng: NgMetrics,
    pub rtsp: RtspMetrics,
    /// Consumers are listed in `/v1/stats` and have series here (`metrics.per_consumer`).
    pub per_consumer: bool,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpLabels {
    method: String,
    route: String,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct HttpRouteLabels {
    method: String,
    route: String,
}

fn request_histogram() -> Histogram {
    Histogram::new(REQUEST_BUCKETS)
}

/// HTTP requests by route (the matched route pattern, never the raw path: bounded cardinality).
#[derive(Clone, Debug)]
pub struct HttpMetrics {
    requests: Family<HttpLabels, Counter>,
    duration: Family<HttpRouteLabels, Histogram>,
}

impl Default for HttpMetrics {
    fn default() -> Self {
        HttpMetrics { requests: Family::default(), duration: Family::new_with_constructor(request_histogram) }
    }
}

impl HttpMetrics {
    /// `route`: the matched route (e.g. `/v1/relays/{id}`), or `unmatched`.
    pub fn record(&self, method: &str, route: &str, status: u16, elapsed: Duration) {
        // Methods outside the standard set would be a label value per client whim.
        let method = match method {
            "GET" | "POST" | "PUT" | "DELETE" | "PATCH" | "HEAD" | "OPTIONS" => method,
            _ => "other",
        };
        let (method, route) = (method.to_string(), route.to_string());
        self.requests.get_or_create(&HttpLabels { method: method.clone(), route: route.clone(), status }).inc();
        self.duration.get_or_create(&HttpRouteLabels { method, route }).observe(elapsed.as_secs_f64());
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NgLabels {
    command: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NgCommandLabels {
    command: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: &'static str,
}

/// NG commands counted under their own name; any other is `unknown`, a datagram that is not a
/// request at all `invalid`.
pub const NG_COMMANDS: [&str; 9] = ["ping", "offer", "answer", "delete", "query", "list", "statistics", "unknown", "invalid"];

/// Why an NG call ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallEnd {
    Deleted,
    Timeout,
}

/// NG requests and calls. The engine updates them and its `statistics` reply reads them.
#[derive(Clone, Debug)]
pub struct NgMetrics {
    requests: Family<NgLabels, Counter>,
    duration: Family<NgCommandLabels, Histogram>,
    retransmissions: Counter,
    calls: Gauge,
    calls_created: Counter,
    calls_ended: Family<ReasonLabels, Counter>,
}

impl Default for NgMetrics {
    fn default() -> Self {
        let me = NgMetrics {
            requests: Family::default(),
            duration: Family::new_with_constructor(request_histogram),
            retransmissions: Counter::default(),
            calls: Gauge::default(),
            calls_created: Counter::default(),
            calls_ended: Family::default(),
        };
        // Every series from the start: a rate over a series that appears at its first
        // increment misses that increment.
        for command in NG_COMMANDS {
            // An unknown command or a datagram that is no request never succeeds.
            let results: &[&'static str] = if matches!(command, "unknown" | "invalid") { &["error"] } else { &["ok", "error"] };
            for &result in results {
                drop(me.requests.get_or_create(&NgLabels { command, result }));
            }
        }
        for reason in ["deleted", "timeout"] {
            drop(me.calls_ended.get_or_create(&ReasonLabels { reason }));
        }
        me
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PathLabels {
    path: String,
}

/// The RTSP proxy's viewers and upstreams. Its media is counted where every room's is (the
/// path's room `rtsp.<path>`); these are what only the proxy knows.
#[derive(Clone, Debug, Default)]
pub struct RtspMetrics {
    sessions: Gauge,
    sessions_ended: Family<ReasonLabels, Counter>,
    upstream_playing: Family<PathLabels, Gauge>,
    upstream_pulls: Family<PathLabels, Counter>,
    tcp_dropped: Counter,
    unauthorized: Counter,
    connections_refused: Counter,
    connections_timed_out: Counter,
    sessions_refused: Counter,
    /// The paths declared (families cannot be listed), for the totals.
    paths: Arc<parking_lot::Mutex<Vec<String>>>,
}

/// Why an RTSP viewer's session ended.
#[derive(Debug, Clone, Copy)]
pub enum RtspSessionEnd {
    Teardown,
    Timeout,
    ConnectionClosed,
    /// A publisher's, when a newer publisher of its path announced.
    Replaced,
}

/// The RTSP proxy's totals, as `/v1/stats` shows them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RtspTotals {
    pub sessions: u64,
    pub sessions_ended: u64,
    pub upstreams_playing: u64,
    pub upstream_pulls: u64,
    pub tcp_dropped: u64,
    pub unauthorized: u64,
    pub connections_refused: u64,
    pub connections_timed_out: u64,
    pub sessions_refused: u64,
}

const RTSP_END_REASONS: [&str; 4] = ["teardown", "timeout", "connection_closed", "replaced"];

impl RtspMetrics {
    /// Series for every configured path from the start.
    pub fn declare_paths<'a>(&self, paths: impl Iterator<Item = &'a str>) {
        for path in paths {
            let mut known = self.paths.lock();
            if !known.iter().any(|p| p == path) {
                known.push(path.to_string());
            }
            drop(known);
            let l = PathLabels { path: path.to_string() };
            drop(self.upstream_playing.get_or_create(&l));
            drop(self.upstream_pulls.get_or_create(&l));
        }
        for reason in RTSP_END_REASONS {
            drop(self.sessions_ended.get_or_create(&ReasonLabels { reason }));
        }
    }

    pub fn set_sessions(&self, n: usize) {
        self.sessions.set(n as i64);
    }

    pub fn session_ended(&self, why: RtspSessionEnd) {
        let reason = RTSP_END_REASONS[why as usize];
        self.sessions_ended.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// The path's upstream started playing (`true`) or was lost (`false`).
    pub fn upstream(&self, path: &str, playing: bool) {
        let l = PathLabels { path: path.to_string() };
        self.upstream_playing.get_or_create(&l).set(playing as i64);
        if playing {
            self.upstream_pulls.get_or_create(&l).inc();
        }
    }

    pub fn tcp_dropped(&self) {
        self.tcp_dropped.inc();
    }

    /// A request refused for want of a reader's credentials (401).
    pub fn unauthorized(&self) {
        self.unauthorized.inc();
    }

    /// A connection closed as soon as accepted: its client address (or the server) held too many.
    pub fn connection_refused(&self) {
        self.connections_refused.inc();
    }

    /// A SETUP refused (453): its client address held `rtsp.max_sessions_per_client` sessions,
    /// or the server its most.
    pub fn session_refused(&self) {
        self.sessions_refused.inc();
    }

    /// A connection closed for holding no session while silent, or for a request it did not
    /// finish in time.
    pub fn connection_timed_out(&self) {
        self.connections_timed_out.inc();
    }

    pub fn totals(&self) -> RtspTotals {
        let ended = RTSP_END_REASONS.iter().map(|&reason| self.sessions_ended.get(&ReasonLabels { reason }).map_or(0, |c| c.get())).sum();
        RtspTotals {
            sessions: self.sessions.get().max(0) as u64,
            sessions_ended: ended,
            tcp_dropped: self.tcp_dropped.get(),
            unauthorized: self.unauthorized.get(),
            connections_refused: self.connections_refused.get(),
            connections_timed_out: self.connections_timed_out.get(),
            sessions_refused: self.sessions_refused.get(),
            ..self.path_totals()
        }
    }

    fn path_totals(&self) -> RtspTotals {
        let paths = self.paths.lock();
        let labels = paths.iter().map(|path| PathLabels { path: path.clone() });
        let playing = labels.clone().map(|l| self.upstream_playing.get(&l).map_or(0, |g| g.get().max(0) as u64)).sum();
        let pulls = labels.map(|l| self.upstream_pulls.get(&l).map_or(0, |c| c.get())).sum();
        RtspTotals { upstreams_playing: playing, upstream_pulls: pulls, ..Default::default() }
    }
}

/// What NG `statistics` reports from the registry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct NgTotals {
    pub requests: u64,
    pub errors: u64,
    pub calls: u64,
    pub calls_created: u64,
    pub calls_deleted: u64,
    pub calls_timed_out: u64,
}

impl NgMetrics {
    /// The label value of `command` (bounded: unknown commands share one).
    pub fn command_label(command: &str) -> &'static str {
        NG_COMMANDS[..7].iter().find(|c| **c == command).copied().unwrap_or("unknown")
    }

    /// One request handled: `command` as the client sent it.
    pub fn request(&self, command: &str, ok: bool, elapsed: Duration) {
        self.count(Self::command_label(command), ok, elapsed);
    }

    /// A datagram that is no request (not bencode, no dictionary, no command).
    pub fn invalid(&self, elapsed: Duration) {
        self.count("invalid", false, elapsed);
    }

    fn count(&self, command: &'static str, ok: bool, elapsed: Duration) {
        self.requests.get_or_create(&NgLabels { command, result: if ok { "ok" } else { "error" } }).inc();
        self.duration.get_or_create(&NgCommandLabels { command }).observe(elapsed.as_secs_f64());
    }

    /// A retransmitted request answered from the reply cache.
    pub fn retransmission(&self) {
        self.retransmissions.inc();
    }

    pub fn call_created(&self) {
        self.calls_created.inc();
    }

    pub fn call_ended(&self, why: CallEnd) {
        let reason = match why {
            CallEnd::Deleted => "deleted",
            CallEnd::Timeout => "timeout",
        };
        self.calls_ended.get_or_create(&ReasonLabels { reason }).inc();
    }

    /// Calls held now.
    pub fn set_calls(&self, n: usize) {
        self.calls.set(n as i64);
    }

    pub fn totals(&self) -> NgTotals {
        let mut t = NgTotals { calls: self.calls.get().max(0) as u64, calls_created: self.calls_created.get(), ..Default::default() };
        let count = |command, result| self.requests.get(&NgLabels { command, result }).map_or(0, |c| c.get());
        for command in NG_COMMANDS {
            let (ok, err) = (count(command, "ok"), count(command, "error"));
            t.requests += ok + err;
            t.errors += err;
        }
        let ended = |reason| self.calls_ended.get(&ReasonLabels { reason }).map_or(0, |c| c.get());
        (t.calls_deleted, t.calls_timed_out) = (ended("deleted"), ended("timeout"));
        t
    }
}

impl Metrics {
    /// The registry over `manager`'s data plane and model.
    pub fn new(manager: Arc<SessionManager>, cfg: &MetricsSection) -> Arc<Metrics> {
        let mut registry = Registry::default();
        let (http, ng, rtsp) = (HttpMetrics::default(), NgMetrics::default(), RtspMetrics::default());
        registry.register("mediaplane_http_requests", "HTTP API requests by method, matched route and status", http.requests.clone());
        registry.register("mediaplane_http_request_duration_seconds", "HTTP API request latency by method and route", http.duration.clone());
        registry.register("mediaplane_ng_requests", "NG requests by command and result (ok or error)", ng.requests.clone());
        registry.register("mediaplane_ng_request_duration_seconds", "NG request handling time by command", ng.duration.clone());
        registry.register("mediaplane_ng_retransmissions", "NG requests answered from the reply cache (retransmissions)", ng.retransmissions.clone());
        registry.register("mediaplane_ng_calls", "NG calls held", ng.calls.clone());
        registry.register("mediaplane_ng_calls_created", "NG calls created", ng.calls_created.clone());
        registry.register("mediaplane_ng_calls_ended", "NG calls ended, by reason (deleted or timeout)", ng.calls_ended.clone());
        registry.register("mediaplane_rtsp_sessions", "RTSP viewer sessions held", rtsp.sessions.clone());
        registry.register(
            "mediaplane_rtsp_sessions_ended",
            "RTSP sessions (viewers' and publishers') ended, by reason (teardown, timeout, connection_closed, replaced)",
            rtsp.sessions_ended.clone(),
        );
        registry.register("mediaplane_rtsp_upstream_playing", "1 while the path's upstream is pulled and playing", rtsp.upstream_playing.clone());
        registry.register(
            "mediaplane_rtsp_upstream_pulls",
            "Times the path's upstream started playing (the first pull and every reconnection)",
            rtsp.upstream_pulls.clone(),
        );
        registry.register("mediaplane_rtsp_tcp_dropped", "Interleaved RTP not queued to a TCP viewer that read too slowly", rtsp.tcp_dropped.clone());
        registry.register(
            "mediaplane_rtsp_unauthorized",
            "RTSP requests refused (401) on a path with read_users or publish_users, for want of valid credentials",
            rtsp.unauthorized.clone(),
        );
        registry.register(
            "mediaplane_rtsp_connections_refused",
            "RTSP connections closed when accepted: their client address held rtsp.max_connections_per_client, or the server 4096",
            rtsp.connections_refused.clone(),
        );
        registry.register(
            "mediaplane_rtsp_connections_timed_out",
            "RTSP connections closed for idling without a session, or for a request not finished in time",
            rtsp.connections_timed_out.clone(),
        );
        registry.register(
            "mediaplane_rtsp_sessions_refused",
            "RTSP SETUPs refused (453): their client address held rtsp.max_sessions_per_client sessions, or the server its most",
            rtsp.sessions_refused.clone(),
        );
        registry.register_collector(Box::new(DataplaneCollector { manager, per_stream: cfg.per_stream, per_consumer: cfg.per_consumer }));
        Arc::new(Metrics { registry, http, ng, rtsp, per_consumer: cfg.per_consumer })
    }

    /// The OpenMetrics text exposition (what `prometheus-client` writes).
    pub fn encode_openmetrics(&self) -> String {
        let mut out = String::new();
        if let Err(e) = prometheus_client::encoding::text::encode(&mut out, &self.registry) {
            tracing::error!(error = %e, "encoding metrics");
        }
        out
    }

    /// The Prometheus text format 0.0.4 (what `promtool check metrics` and older scrapers read).
    pub fn encode_prometheus(&self) -> String {
        openmetrics_to_prometheus(&self.encode_openmetrics())
    }
}

/// OpenMetrics text to Prometheus text: a counter family is named without `_total` in
/// OpenMetrics' HELP/TYPE lines but with it in Prometheus', and there is no `# UNIT`/`# EOF`.
pub fn openmetrics_to_prometheus(om: &str) -> String {
    let counters: std::collections::HashSet<&str> = om.lines().filter_map(|l| l.strip_prefix("# TYPE ")?.strip_suffix(" counter")).collect();
    let mut out = String::with_capacity(om.len() + 16 * counters.len());
    for line in om.lines() {
        if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        }
        let meta = ["# HELP ", "# TYPE "].into_iter().find_map(|p| Some((p, line.strip_prefix(p)?)));
        match meta {
            Some((p, rest)) => {
                let (name, tail) = rest.split_once(' ').unwrap_or((rest, ""));
                let suffix = if counters.contains(name) { "_total" } else { "" };
                out.push_str(&format!("{p}{name}{suffix} {tail}\n"));
            }
            None => {
                out.push_str(line);
                out.push('\n');
            }
        }
    }
    out
}

/// Resident memory and the kernel memory of the BPF maps the daemon holds, bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Memory {
    pub rss_bytes: u64,
    pub bpf_map_bytes: u64,
}

/// Everything `/v1/stats` and `/metrics` report about the data plane, read once (not to be
/// confused with [`crate::manager::Snapshot`], the committed model and table).
#[derive(Debug, Clone)]
pub struct StatsReading {
    pub stats: DataplaneStats,
    pub memory: Memory,
    pub rooms: usize,
    pub relays: usize,
    /// Installed streams (table entries).
    pub streams: usize,
}

impl StatsReading {
    pub fn take(m: &SessionManager) -> StatsReading {
        Self::from_stats(m, m.stats())
    }

    fn from_stats(m: &SessionManager, stats: DataplaneStats) -> StatsReading {
        use mediaplane_dataplane::sys::{bpf_map_bytes, rss_bytes};
        let (rooms, relays, streams) = m.read(|model, t| (model.rooms.len(), model.relays.len(), t.streams.len()));
        StatsReading { stats, memory: Memory { rss_bytes: rss_bytes(None), bpf_map_bytes: bpf_map_bytes(None) }, rooms, relays, streams }
    }
}

/// Open file descriptors and the soft limit (RLIMIT_NOFILE), from /proc.
fn fds() -> Option<(u64, u64)> {
    let open = std::fs::read_dir("/proc/self/fd").ok()?.count() as u64;
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let max = limits.lines().find(|l| l.starts_with("Max open files"))?.split_whitespace().nth(3)?.parse().ok()?;
    Some((open, max))
}

/// A data-plane counter family: one meaning, maybe split by a label.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CounterFamily {
    pub name: &'static str,
    pub help: &'static str,
    /// The label that tells the members apart (`reason`, `result`, `program`), if any.
    pub label: Option<&'static str>,
    /// Counted in nanoseconds by the data plane, exported in seconds.
    pub nanoseconds: bool,
}

const fn fam(name: &'static str, help: &'static str, label: Option<&'static str>) -> CounterFamily {
    CounterFamily { name, help, label, nanoseconds: false }
}

pub const RECEIVED_PACKETS: CounterFamily = fam("mediaplane_received_packets", "Packets received on SFU addresses", None);
pub const RECEIVED_BYTES: CounterFamily = fam("mediaplane_received_bytes", "UDP payload bytes received on SFU addresses", None);
pub const SENT_PACKETS: CounterFamily = fam("mediaplane_sent_packets", "Copies sent", None);
pub const SENT_BYTES: CounterFamily = fam("mediaplane_sent_bytes", "UDP payload bytes of the copies sent", None);
pub const SEND_ERRORS: CounterFamily =
    fam("mediaplane_send_errors", "Copies that could not be sent (socket error, no route or neighbour, SRTP protect failed)", None);
pub const UNKEYED_COPIES: CounterFamily = fam(
    "mediaplane_unkeyed_copies",
    "Copies not made because their subscriber speaks SRTP but has no key yet (its DTLS handshake not done): expected at every join, not send errors",
    None,
);
pub const DROPPED: CounterFamily = fam("mediaplane_dropped_packets", "Packets dropped, by reason", Some("reason"));
pub const SLOW_PATH: CounterFamily = fam("mediaplane_slow_path_packets", "Packets the slow path handled, by reason", Some("reason"));
pub const KERNEL_FORWARDED: CounterFamily = fam("mediaplane_kernel_forwarded_packets", "Packets the kernel fast path forwarded entirely", None);
pub const PASSED: CounterFamily =
    fam("mediaplane_passed_packets", "Packets the kernel fast path handed to the network stack (and so the slow path), by reason", Some("reason"));
pub const XDP_DROPPED: CounterFamily =
    fam("mediaplane_xdp_dropped_packets", "Packets the XDP pre-filter dropped, by reason (included in mediaplane_dropped_packets_total)", Some("reason"));
pub const XDP_DROPPED_BYTES: CounterFamily = fam("mediaplane_xdp_dropped_bytes", "UDP payload bytes of the packets the XDP pre-filter dropped", None);
pub const XDP_PASSED: CounterFamily = fam("mediaplane_xdp_passed_packets", "Packets the XDP pre-filter let through", None);
pub const BPF_RUN_SECONDS: CounterFamily = CounterFamily {
    nanoseconds: true,
    ..fam("mediaplane_bpf_run_seconds", "Time the kernel spent running the program (kernel.bpf_stats_enabled), by program", Some("program"))
};
pub const BPF_RUNS: CounterFamily = fam("mediaplane_bpf_runs", "Runs of the program (kernel.bpf_stats_enabled), by program", Some("program"));
pub const STEERING: CounterFamily =
    fam("mediaplane_slow_path_steering", "Packets the socket-lookup program steered to the slow path, by result", Some("result"));
pub const NEIGHBOUR: CounterFamily = fam("mediaplane_neighbour_resolutions", "Neighbour resolutions the fast path asked for, by result", Some("result"));
pub const HOST_DROPPED: CounterFamily =
    fam("mediaplane_host_dropped_packets", "The host's own drop counters of its network namespace (/proc/net/snmp, netstat), by reason", Some("reason"));
pub const NOT_RECORDED: CounterFamily =
    fam("mediaplane_not_recorded_packets", "Packets of recorded calls relayed but not recorded (the recording writer fell behind)", None);
pub const EVENTS_DROPPED: CounterFamily = fam(
    "mediaplane_dataplane_events_dropped",
    "Reports of the data plane to the control plane (sources heard, relayed RTCP) dropped because the control plane was behind",
    None,
);
pub const SRTP_DROPPED: CounterFamily = fam(
    "mediaplane_srtp_dropped_packets",
    "Packets of SRTP legs dropped: on arrival (no_key yet, auth_failed, replayed, invalid) or as copies (protect_failed)",
    Some("reason"),
);
pub const TRANSPORT_FEEDBACK: CounterFamily = fam(
    "mediaplane_transport_feedback_packets",
    "Feedback the SFU sends publishers' transports of its own accord: transport-wide congestion-control feedback packets (sent), publishers' packets that arrived after their number was reported lost (late), REMBs with the room's ceiling (remb), receiver reports (rr)",
    Some("kind"),
);
pub const RETRANSMITTED: CounterFamily = fam(
    "mediaplane_retransmitted_packets",
    "Copies the SFU sent a consumer again from its send history, answering the consumer's NACK instead of asking the publisher (sent), and NACKed copies it did not send again: in flight less than 20 ms, or sent three times already (suppressed)",
    Some("result"),
);
pub const FEEDBACK: CounterFamily = fam(
    "mediaplane_feedback_messages",
    "Consumers' RTCP feedback messages, by result: routed to the publisher, coalesced (a keyframe request shortly after another), consumed by the SFU (receiver reports, REMB, TWCC), unroutable (an SSRC the consumer does not receive)",
    Some("result"),
);
pub const AFXDP_HANDED_OVER: CounterFamily =
    fam("mediaplane_afxdp_handed_over_packets", "Packets the AF_XDP plane's XDP program handed to its sockets, by kind (datagram, fragment)", Some("kind"));
pub const AFXDP_PASSED: CounterFamily = fam(
    "mediaplane_afxdp_passed_packets",
    "Packets to the SFU's addresses the AF_XDP plane's XDP program left to the host stack (and the plane's sockets), by reason",
    Some("reason"),
);
pub const AFXDP_SENT: CounterFamily = fam("mediaplane_afxdp_sent_frames", "Copies the AF_XDP plane sent from its TX rings", None);
pub const AFXDP_BY_SOCKET: CounterFamily = fam(
    "mediaplane_afxdp_socket_sends",
    "Copies the AF_XDP plane sent by its socket instead of a ring, by reason (no_neighbour, too_big, ring_full; errors: the socket refused)",
    Some("reason"),
);
pub const AFXDP_RECEIVED: CounterFamily = fam(
    "mediaplane_afxdp_received",
    "What the AF_XDP plane's thread read and did, by kind: frames, fragments, reassembled, gathered, bad_checksum, checksum_partial, spoofed, reassembly_timeouts, reassembly_dropped, next_hop_lookups, source_lookups",
    Some("kind"),
);

/// Where a counter nobody classified goes: still exported, and visible as such.
pub const OTHER: CounterFamily = fam("mediaplane_dataplane_other", "Data-plane counters without a family of their own, by name", Some("counter"));

/// The family and label value of a [`Counters`] field; None: not classified (a test keeps
/// every field classified).
pub fn counter_family(field: &str) -> Option<(CounterFamily, Option<&str>)> {
    Some(match field {
        "rx_packets" => (RECEIVED_PACKETS, None),
        "rx_bytes" => (RECEIVED_BYTES, None),
        "tx_copies" => (SENT_PACKETS, None),
        "tx_bytes" => (SENT_BYTES, None),
        "tx_errors" => (SEND_ERRORS, None),
        "tx_unkeyed" => (UNKEYED_COPIES, None),
        f => {
            if let Some(r) = f.strip_prefix("drop_") {
                (DROPPED, Some(r))
            } else if let Some(r) = f.strip_prefix("slow_") {
                (SLOW_PATH, Some(r))
            } else if let Some(r) = f.strip_prefix("feedback_") {
                (FEEDBACK, Some(r))
            } else {
                return None;
            }
        }
    })
}

/// Reasons counted in totals only (a source or an unknown address is not a stream).
const TOTALS_ONLY: [&str; 2] = ["drop_no_stream", "drop_source_limited"];

/// The family and label value of a [`DataplaneStats::extra`] counter; None: not classified.
pub fn extra_family(name: &str) -> Option<(CounterFamily, Option<&str>)> {
    // The eBPF plane's slow path reports the host counters (and the process-wide recording
    // tap's) under its own prefix.
    let name = name
        .strip_prefix("userspace.")
        .filter(|n| ["host_", "srtp_", "transport_feedback_", "retransmit_"].iter().any(|p| n.starts_with(p)) || ["not_recorded", "events_dropped"].contains(n))
        .unwrap_or(name);
    Some(match name {
        "forwarded" => (KERNEL_FORWARDED, None),
        "xdp_drop_bytes" => (XDP_DROPPED_BYTES, None),
        "xdp_pass" => (XDP_PASSED, None),
        "bpf_run_time_ns" => (BPF_RUN_SECONDS, Some("tc")),
        "xdp_run_time_ns" => (BPF_RUN_SECONDS, Some("xdp")),
        "bpf_run_count" => (BPF_RUNS, Some("tc")),
        "xdp_run_count" => (BPF_RUNS, Some("xdp")),
        "slow_path_steered" => (STEERING, Some("steered")),
        "slow_path_steer_failed" => (STEERING, Some("failed")),
        "not_recorded" => (NOT_RECORDED, None),
        "events_dropped" => (EVENTS_DROPPED, None),
        "xsk_redirected" => (AFXDP_HANDED_OVER, Some("datagram")),
        "xsk_fragments" => (AFXDP_HANDED_OVER, Some("fragment")),
        "afxdp_tx_frames" => (AFXDP_SENT, None),
        n => {
            let prefixed = [
                ("transport_feedback_", TRANSPORT_FEEDBACK),
                ("retransmit_", RETRANSMITTED),
                ("pass_", PASSED),
                ("xdp_drop_", XDP_DROPPED),
                ("neigh_resolve_", NEIGHBOUR),
                ("host_", HOST_DROPPED),
                ("srtp_", SRTP_DROPPED),
                ("xsk_pass_", AFXDP_PASSED),
                ("afxdp_tx_socket_", AFXDP_BY_SOCKET),
                ("afxdp_rx_", AFXDP_RECEIVED),
                ("afxdp_", AFXDP_RECEIVED),
            ];
            let (r, f) = prefixed.into_iter().find_map(|(p, f)| Some((n.strip_prefix(p)?, f)))?;
            (f, Some(r))
        }
    })
}

type Labels = Vec<(&'static str, String)>;

#[derive(Debug, Clone, Copy)]
enum Num {
    U(u64),
    F(f64),
}

struct Samples {
    help: &'static str,
    kind: MetricType,
    series: Vec<(Labels, Num)>,
}

/// Samples grouped by family name, so every family is written once with all its series.
#[derive(Default)]
struct Families(BTreeMap<&'static str, Samples>);

/// (name, help) of the series of an RTP sequence's quality: expected, received, duplicates,
/// reordered (counters), lost, jitter (gauges).
struct RtpQualityNames([(&'static str, &'static str); 6]);

const STREAM_RECEIVED: RtpQualityNames = RtpQualityNames([
    ("mediaplane_stream_rtp_expected_packets", "RTP packets expected from the sequence numbers received (RFC 3550 A.3)"),
    ("mediaplane_stream_rtp_received_packets", "Distinct RTP packets received (duplicates not counted)"),
    ("mediaplane_stream_rtp_duplicate_packets", "RTP packets received again"),
    ("mediaplane_stream_rtp_reordered_packets", "RTP packets that arrived after a later one of their stream"),
    ("mediaplane_stream_rtp_lost_packets", "Cumulative RTP loss: expected - received (RFC 3550 A.3; negative after old duplicates)"),
    ("mediaplane_stream_rtp_jitter_seconds", "RFC 3550 interarrival jitter of the RTP stream as received"),
]);

const CONSUMER_FORWARDED: RtpQualityNames = RtpQualityNames([
    ("mediaplane_consumer_rtp_expected_packets", "RTP packets the consumer was due from the sequence numbers sent to it"),
    ("mediaplane_consumer_rtp_sent_packets", "Distinct RTP packets sent to the consumer (duplicates not counted)"),
    ("mediaplane_consumer_rtp_duplicate_packets", "RTP packets sent to the consumer again"),
    ("mediaplane_consumer_rtp_reordered_packets", "RTP packets sent to the consumer after a later one"),
    ("mediaplane_consumer_rtp_lost_packets", "Cumulative RTP loss passed on to the consumer: expected - sent (RFC 3550 A.3)"),
    ("mediaplane_consumer_rtp_jitter_seconds", "RFC 3550 interarrival jitter of the consumer's RTP as forwarded (timed at arrival)"),
]);

impl Families {
    fn add(&mut self, name: &'static str, help: &'static str, kind: MetricType, labels: Labels, v: Num) {
        let e = self.0.entry(name).or_insert_with(|| Samples { help, kind, series: Vec::new() });
        // The same series twice (e.g. one host counter under two names) would be invalid.
        if !e.series.iter().any(|(l, _)| *l == labels) {
            e.series.push((labels, v));
        }
    }

    fn counter(&mut self, f: CounterFamily, label: Option<&str>, mut labels: Labels, v: u64) {
        if let (Some(k), Some(val)) = (f.label, label) {
            labels.push((k, val.to_string()));
        }
        let v = if f.nanoseconds { Num::F(v as f64 / 1e9) } else { Num::U(v) };
        self.add(f.name, f.help, MetricType::Counter, labels, v);
    }

    fn counters(&mut self, c: &Counters, labels: &Labels, per_stream: bool) {
        for (field, v) in c.fields() {
            if per_stream && TOTALS_ONLY.contains(&field) {
                continue;
            }
            match counter_family(field) {
                Some((f, label)) if per_stream => self.counter(stream_family(f), label, labels.clone(), v),
                Some((f, label)) => self.counter(f, label, labels.clone(), v),
                None => self.counter(OTHER, Some(field), labels.clone(), v),
            }
        }
    }

    /// A stream's in-path reception quality (per-stream series only).
    fn reception(&mut self, r: &ReceptionReport, labels: &Labels) {
        self.rtp_quality(&STREAM_RECEIVED, r, labels);
    }

    /// The quality of an RTP sequence, under `names`.
    fn rtp_quality(&mut self, names: &RtpQualityNames, r: &ReceptionReport, labels: &Labels) {
        let l = || labels.clone();
        let c = MetricType::Counter;
        let [expected, received, duplicates, reordered, lost, jitter] = names.0;
        self.add(expected.0, expected.1, c, l(), Num::U(r.expected));
        self.add(received.0, received.1, c, l(), Num::U(r.packets));
        self.add(duplicates.0, duplicates.1, c, l(), Num::U(r.duplicates));
        self.add(reordered.0, reordered.1, c, l(), Num::U(r.reordered));
        let g = MetricType::Gauge;
        self.add(lost.0, lost.1, g, l(), Num::F(r.lost as f64));
        if let Some(ms) = r.jitter_ms {
            self.add(jitter.0, jitter.1, g, l(), Num::F(ms / 1000.0));
        }
    }

    /// A consumer's series (`metrics.per_consumer`).
    fn consumer(&mut self, c: &crate::consumers::ConsumerView) {
        let l = || vec![("id", c.id.to_string()), ("consumer", c.label.clone())];
        let (k, g) = (MetricType::Counter, MetricType::Gauge);
        self.add("mediaplane_consumer_sent_packets", "Copies sent for the consumer", k, l(), Num::U(c.tx_copies));
        self.add("mediaplane_consumer_sent_bytes", "UDP payload bytes of the copies sent for the consumer", k, l(), Num::U(c.tx_bytes));
        self.add("mediaplane_consumer_send_errors", "Copies for the consumer that could not be sent", k, l(), Num::U(c.tx_errors));
        for (result, v) in [("routed", c.feedback_routed), ("coalesced", c.feedback_coalesced)] {
            let mut labels = l();
            labels.push(("result", result.to_string()));
            self.add("mediaplane_consumer_feedback_messages", "The consumer's RTCP feedback about its stream, by result", k, labels, Num::U(v));
        }
        if let Some(r) = &c.report {
            self.add(
                "mediaplane_consumer_reported_loss_ratio",
                "Fraction lost in the consumer's latest receiver report",
                g,
                l(),
                Num::F(r.fraction_lost_pct / 100.0),
            );
            self.add(
                "mediaplane_consumer_reported_lost_packets",
                "Cumulative loss in the consumer's latest receiver report",
                g,
                l(),
                Num::F(f64::from(r.cumulative_lost)),
            );
            if let Some(ms) = r.jitter_ms {
                self.add(
                    "mediaplane_consumer_reported_jitter_seconds",
                    "Interarrival jitter in the consumer's latest receiver report",
                    g,
                    l(),
                    Num::F(ms / 1000.0),
                );
            }
        }
        if let Some(ms) = c.rtt_ms {
            self.add(
                "mediaplane_consumer_rtt_seconds",
                "Round-trip time between the SFU and the consumer, from its latest report echoing a sender report",
                g,
                l(),
                Num::F(ms / 1000.0),
            );
        }
        if let Some(bps) = c.remb_bps {
            self.add("mediaplane_consumer_remb_bits_per_second", "The consumer's latest REMB estimate naming its stream", g, l(), Num::U(bps));
        }
        if let Some(r) = &c.forwarded {
            self.rtp_quality(&CONSUMER_FORWARDED, r, &l());
        }
    }

    fn gauge(&mut self, name: &'static str, help: &'static str, labels: Labels, v: u64) {
        self.add(name, help, MetricType::Gauge, labels, Num::U(v));
    }

    fn encode(&self, enc: &mut DescriptorEncoder) -> std::fmt::Result {
        for (name, Samples { help, kind, series: samples }) in &self.0 {
            let metric = |v: &Num| -> Box<dyn EncodeMetric> {
                match (kind, *v) {
                    (MetricType::Counter, Num::U(v)) => Box::new(ConstCounter::new(v)),
                    (MetricType::Counter, Num::F(v)) => Box::new(ConstCounter::new(v)),
                    (_, Num::U(v)) => Box::new(ConstGauge::new(v)),
                    (_, Num::F(v)) => Box::new(ConstGauge::new(v)),
                }
            };
            let mut m = enc.encode_descriptor(name, help, None, *kind)?;
            match samples.as_slice() {
                // A family member writes `{...}` even when empty.
                [(labels, v)] if labels.is_empty() => metric(v).encode(m)?,
                _ => {
                    for (labels, v) in samples {
                        metric(v).encode(m.encode_family(labels)?)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// The per-stream twin of a totals family (`mediaplane_stream_*`).
fn stream_family(f: CounterFamily) -> CounterFamily {
    let name = match f.name {
        "mediaplane_received_packets" => "mediaplane_stream_received_packets",
        "mediaplane_received_bytes" => "mediaplane_stream_received_bytes",
        "mediaplane_sent_packets" => "mediaplane_stream_sent_packets",
        "mediaplane_sent_bytes" => "mediaplane_stream_sent_bytes",
        "mediaplane_send_errors" => "mediaplane_stream_send_errors",
        "mediaplane_unkeyed_copies" => "mediaplane_stream_unkeyed_copies",
        "mediaplane_dropped_packets" => "mediaplane_stream_dropped_packets",
        "mediaplane_slow_path_packets" => "mediaplane_stream_slow_path_packets",
        "mediaplane_feedback_messages" => "mediaplane_stream_feedback_messages",
        _ => "mediaplane_stream_other",
    };
    CounterFamily { name, help: "Per stream (metrics.per_stream): see the family without stream_", ..f }
}

/// Reads the data plane and the model at scrape time.
struct DataplaneCollector {
    manager: Arc<SessionManager>,
    per_stream: bool,
    per_consumer: bool,
}

impl std::fmt::Debug for DataplaneCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataplaneCollector").field("per_stream", &self.per_stream).field("per_consumer", &self.per_consumer).finish()
    }
}

impl Collector for DataplaneCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let m = &self.manager;
        // Without per-stream series the per-stream counters are not even read (a kernel map
        // read per stream on the eBPF plane).
        let stats = if self.per_stream { m.stats() } else { m.dataplane().stats_totals() };
        let snap = StatsReading::from_stats(m, stats);
        let labels =
            if self.per_stream { m.read(|_, t| t.streams.values().map(|e| (e.id, e.label.clone())).collect::<HashMap<_, _>>()) } else { HashMap::new() };
        let mut fams = families(&snap, &labels);
        if self.per_consumer {
            for c in m.read(|model, _| crate::consumers::list(model, None, &**m.dataplane())) {
                fams.consumer(&c);
            }
        }
        fams.add(
            "mediaplane_dtmf_reports_lost",
            "DTMF events not reported to the DTMF log: its queue (1024) was full",
            MetricType::Counter,
            vec![],
            Num::U(m.dtmf_reports_lost()),
        );
        if let Some((open, max)) = fds() {
            fams.gauge("mediaplane_open_fds", "Open file descriptors (the user-space plane holds one socket per SFU address per worker)", vec![], open);
            fams.gauge("mediaplane_max_fds", "The soft limit on open file descriptors", vec![], max);
        }
        fams.encode(&mut enc)?;
        if let Some(h) = &snap.stats.copy_latency_histogram {
            encode_latency(&mut enc, h)?;
        }
        Ok(())
    }
}

/// Every family of a snapshot (but the latency histogram). `labels`: per-stream series for
/// the streams in it (empty: none).
fn families(snap: &StatsReading, labels: &HashMap<u32, String>) -> Families {
    let st = &snap.stats;
    let mut f = Families::default();
    f.counters(&st.total, &vec![], false);
    for (name, v) in &st.extra {
        // States, not counts.
        if name == "afxdp_zero_copy_queues" {
            f.gauge("mediaplane_afxdp_zero_copy_queues", "AF_XDP sockets bound in zero-copy mode (the rest: copy mode)", vec![], *v);
            continue;
        }
        if name == "afxdp_thread_failed" {
            f.gauge("mediaplane_afxdp_thread_failed", "1 once the AF_XDP thread failed: the plane then runs on its sockets until restarted", vec![], *v);
            continue;
        }
        match extra_family(name) {
            Some((fam, label)) => f.counter(fam, label, vec![], *v),
            None => f.counter(OTHER, Some(name), vec![], *v),
        }
    }
    if !labels.is_empty() {
        for (id, c) in &st.streams {
            let label = labels.get(id).map_or("removed", String::as_str);
            f.counters(c, &vec![("id", id.to_string()), ("stream", label.to_string())], true);
        }
        for (id, r) in &st.reception {
            let label = labels.get(id).map_or("removed", String::as_str);
            f.reception(r, &vec![("id", id.to_string()), ("stream", label.to_string())]);
        }
    }
    for (map, MapFill { entries, capacity }) in &st.maps {
        f.gauge("mediaplane_map_entries", "Entries in use in a bounded data-plane table (kernel map)", vec![("map", map.clone())], *entries);
        f.gauge("mediaplane_map_capacity", "Capacity of a bounded data-plane table (kernel map)", vec![("map", map.clone())], *capacity);
    }
    f.gauge("mediaplane_table_version", "Version of the forwarding table installed in the data plane", vec![], st.table_version);
    f.gauge("mediaplane_streams", "Streams installed (forwarding table entries)", vec![], snap.streams as u64);
    f.gauge("mediaplane_rooms", "SFU rooms", vec![], snap.rooms as u64);
    f.gauge("mediaplane_relays", "Relays (SIP media relay legs pairs, NG calls included)", vec![], snap.relays as u64);
    f.gauge("mediaplane_resident_memory_bytes", "Resident memory of the daemon", vec![], snap.memory.rss_bytes);
    f.gauge("mediaplane_bpf_map_memory_bytes", "Kernel memory of the BPF maps the daemon holds", vec![], snap.memory.bpf_map_bytes);
    let build = vec![("version", env!("CARGO_PKG_VERSION").to_string()), ("dataplane", st.dataplane.clone())];
    f.gauge("mediaplane_build_info", "Always 1: the daemon's version and data plane", build, 1);
    f
}

fn encode_latency(enc: &mut DescriptorEncoder, h: &LatencyHistogram) -> std::fmt::Result {
    // prometheus-client takes per-bucket counts and accumulates them itself.
    let mut buckets = Vec::with_capacity(h.bounds_ns.len() + 1);
    let mut prev = 0;
    for (b, c) in h.bounds_ns.iter().zip(&h.cumulative) {
        buckets.push((*b as f64 / 1e9, c.saturating_sub(prev)));
        prev = prev.max(*c);
    }
    buckets.push((f64::INFINITY, h.count.saturating_sub(prev)));
    let count = prev.max(h.count);
    let m = enc.encode_descriptor(
        "mediaplane_copy_latency_seconds",
        "Time the data plane took per copy (the eBPF plane: from program entry to the copy's transmission)",
        None,
        MetricType::Histogram,
    )?;
    let mut m = m;
    m.encode_histogram::<prometheus_client::encoding::NoLabelSet>(h.sum_ns as f64 / 1e9, count, &buckets, None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_counter_field_and_known_extra_has_a_family() {
        for (field, _) in Counters::default().fields() {
            let (f, label) = counter_family(field).unwrap_or_else(|| panic!("Counters::{field} has no metric family"));
            assert_eq!(f.label.is_some(), label.is_some(), "{field}");
            assert_ne!(stream_family(f).name, "mediaplane_stream_other", "{field}");
        }
        assert_eq!(counter_family("drop_stranger"), Some((DROPPED, Some("stranger"))));
        assert_eq!(counter_family("slow_stun"), Some((SLOW_PATH, Some("stun"))));
        assert_eq!(counter_family("feedback_coalesced"), Some((FEEDBACK, Some("coalesced"))));
        assert_eq!(extra_family("pass_no_neigh"), Some((PASSED, Some("no_neigh"))));
        assert_eq!(extra_family("userspace.host_udp_in_csum_errors"), Some((HOST_DROPPED, Some("udp_in_csum_errors"))));
        assert_eq!(extra_family("xdp_drop_stranger"), Some((XDP_DROPPED, Some("stranger"))));
        assert_eq!(extra_family("xdp_drop_bytes"), Some((XDP_DROPPED_BYTES, None)));
        assert_eq!(extra_family("userspace.not_recorded"), Some((NOT_RECORDED, None)));
        assert_eq!(extra_family("userspace.events_dropped"), Some((EVENTS_DROPPED, None)));
        assert_eq!(extra_family("userspace.srtp_replayed"), Some((SRTP_DROPPED, Some("replayed"))));
        assert_eq!(extra_family("userspace.transport_feedback_sent"), Some((TRANSPORT_FEEDBACK, Some("sent"))));
        assert_eq!(extra_family("userspace.retransmit_sent"), Some((RETRANSMITTED, Some("sent"))));
        assert_eq!(extra_family("srtp_auth_failed"), Some((SRTP_DROPPED, Some("auth_failed"))));
        assert_eq!(extra_family("bpf_run_time_ns").map(|(f, _)| f.nanoseconds), Some(true));
        assert_eq!(extra_family("userspace.rx_packets"), None);
        assert_eq!(extra_family("xsk_pass_fragment"), Some((AFXDP_PASSED, Some("fragment"))));
        assert_eq!(extra_family("afxdp_tx_socket_no_neighbour"), Some((AFXDP_BY_SOCKET, Some("no_neighbour"))));
        assert_eq!(extra_family("afxdp_rx_spoofed"), Some((AFXDP_RECEIVED, Some("spoofed"))));
        assert_eq!(extra_family("afxdp_reassembly_timeouts"), Some((AFXDP_RECEIVED, Some("reassembly_timeouts"))));
        // Every AF_XDP counter has a family (its XDP program's: ebpf::afxdp::XSK_COUNTERS);
        // the zero-copy count is a gauge of its own.
        for (name, _) in mediaplane_dataplane::afxdp::XskStats::default()
            .fields()
            .into_iter()
            .filter(|(n, _)| !["afxdp_zero_copy_queues", "afxdp_thread_failed"].contains(n))
        {
            assert!(extra_family(name).is_some(), "{name} has no metric family");
        }
        for name in ["xsk_redirected", "xsk_fragments", "xsk_pass_fragment", "xsk_pass_no_socket"] {
            assert!(extra_family(name).is_some(), "{name} has no metric family");
        }
    }

    fn stats() -> StatsReading {
        let mut st = DataplaneStats { dataplane: "test".into(), table_version: 3, ..Default::default() };
        st.total.rx_packets = 10;
        st.total.drop_stranger = 2;
        st.streams.insert(7, Counters { rx_packets: 4, drop_no_stream: 1, ..Default::default() });
        st.extra.insert("host_udp_in_csum_errors".into(), 5);
        st.extra.insert("userspace.host_udp_in_csum_errors".into(), 5);
        st.extra.insert("bpf_run_time_ns".into(), 1_500_000_000);
        st.extra.insert("brand_new".into(), 1);
        st.maps.insert("streams".into(), MapFill { entries: 2, capacity: 16 });
        let mut r = mediaplane_core::reception::RtpReception::default();
        for (seq, at_ms) in [(1u16, 0u64), (2, 30), (4, 40)] {
            r.on_packet(9, seq, seq as u32 * 160, at_ms * 1_000_000, 8000);
        }
        st.reception.insert(7, r.report());
        StatsReading { stats: st, memory: Memory { rss_bytes: 1 << 20, bpf_map_bytes: 0 }, rooms: 1, relays: 0, streams: 2 }
    }

    fn text(snap: &StatsReading, labels: &HashMap<u32, String>, hist: Option<&LatencyHistogram>) -> String {
        #[derive(Debug)]
        struct C(StatsReading, HashMap<u32, String>, Option<LatencyHistogram>);
        impl Collector for C {
            fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
                families(&self.0, &self.1).encode(&mut enc)?;
                match &self.2 {
                    Some(h) => encode_latency(&mut enc, h),
                    None => Ok(()),
                }
            }
        }
        let mut r = Registry::default();
        r.register_collector(Box::new(C(snap.clone(), labels.clone(), hist.cloned())));
        let mut om = String::new();
        prometheus_client::encoding::text::encode(&mut om, &r).unwrap();
        openmetrics_to_prometheus(&om)
    }

    #[test]
    fn families_carry_reasons_units_and_no_per_stream_series_unless_asked() {
        let t = text(&stats(), &HashMap::new(), None);
        assert!(t.contains("# TYPE mediaplane_dropped_packets_total counter\n"), "{t}");
        assert!(t.contains("mediaplane_dropped_packets_total{reason=\"stranger\"} 2\n"), "{t}");
        assert!(t.contains("mediaplane_received_packets_total 10\n"), "{t}");
        assert!(t.contains("mediaplane_bpf_run_seconds_total{program=\"tc\"} 1.5\n"), "{t}");
        assert_eq!(t.matches("mediaplane_host_dropped_packets_total{reason=\"udp_in_csum_errors\"}").count(), 1, "{t}");
        assert!(t.contains("mediaplane_dataplane_other_total{counter=\"brand_new\"} 1\n"), "{t}");
        assert!(t.contains("mediaplane_map_capacity{map=\"streams\"} 16\n"), "{t}");
        assert!(t.contains("mediaplane_build_info{version=\""), "{t}");
        assert!(!t.contains("stream_"), "{t}");
        assert!(!t.contains("# EOF") && !t.contains("# UNIT"), "{t}");
        // Every sample line belongs to the family declared above it, which has HELP and TYPE.
        let mut family = String::new();
        for l in t.lines() {
            if let Some(r) = l.strip_prefix("# TYPE ") {
                family = r.split(' ').next().unwrap().to_string();
            } else if !l.starts_with('#') {
                assert!(l.starts_with(&family), "{l} outside {family}");
            }
        }
        let labels = HashMap::from([(7, "r/p\"0\"/main".to_string())]);
        let t = text(&stats(), &labels, None);
        assert!(t.contains("mediaplane_stream_received_packets_total{id=\"7\",stream=\"r/p\\\"0\\\"/main\"} 4\n"), "{t}");
        assert!(!t.contains("mediaplane_stream_dropped_packets_total{id=\"7\",stream=\"r/p\\\"0\\\"/main\",reason=\"no_stream\"}"), "{t}");
        // Reception quality: 3 of 4 received, one lost; jitter (×16, 8 kHz units): 80 after the
        // packet 10 ms late, then + 240 - 5 for the one 20 ms early = 315 / 16 / 8000 s.
        let sel = "{id=\"7\",stream=\"r/p\\\"0\\\"/main\"}";
        assert!(t.contains(&format!("mediaplane_stream_rtp_expected_packets_total{sel} 4\n")), "{t}");
        assert!(t.contains(&format!("mediaplane_stream_rtp_received_packets_total{sel} 3\n")), "{t}");
        assert!(t.contains(&format!("mediaplane_stream_rtp_lost_packets{sel} 1.0\n")), "{t}");
        assert!(t.contains(&format!("mediaplane_stream_rtp_jitter_seconds{sel} 0.0024609375\n")), "{t}");
    }

    #[test]
    fn copy_latency_is_a_histogram_in_seconds() {
        let h = LatencyHistogram { bounds_ns: vec![1000, 2000], cumulative: vec![3, 5], count: 6, sum_ns: 9000 };
        let t = text(&stats(), &HashMap::new(), Some(&h));
        assert!(t.contains("# TYPE mediaplane_copy_latency_seconds histogram\n"), "{t}");
        assert!(t.contains("mediaplane_copy_latency_seconds_bucket{le=\"0.000001\"} 3\n"), "{t}");
        assert!(t.contains("mediaplane_copy_latency_seconds_bucket{le=\"0.000002\"} 5\n"), "{t}");
        assert!(t.contains("mediaplane_copy_latency_seconds_bucket{le=\"+Inf\"} 6\n"), "{t}");
        assert!(t.contains("mediaplane_copy_latency_seconds_sum 0.000009\n"), "{t}");
        assert!(t.contains("mediaplane_copy_latency_seconds_count 6\n"), "{t}");
    }

    #[test]
    fn ng_totals_come_from_the_registered_counters() {
        let ng = NgMetrics::default();
        ng.request("offer", true, Duration::from_millis(2));
        ng.request("frobnicate", false, Duration::from_millis(1));
        ng.invalid(Duration::ZERO);
        ng.request("invalid", false, Duration::ZERO); // a command of that name is just unknown
        ng.call_created();
        ng.call_ended(CallEnd::Timeout);
        ng.set_calls(0);
        let t = ng.totals();
        assert_eq!((t.requests, t.errors, t.calls_created, t.calls_timed_out, t.calls_deleted), (4, 3, 1, 1, 0));
        let count = |command, result| ng.requests.get(&NgLabels { command, result }).map_or(0, |c| c.get());
        assert_eq!((count("unknown", "error"), count("invalid", "error"), count("offer", "ok")), (2, 1, 1));
        assert_eq!(NgMetrics::command_label("frobnicate"), "unknown");
    }

    #[test]
    fn openmetrics_counters_are_renamed_for_the_prometheus_format() {
        let om = "# HELP a_b Things.\n# TYPE a_b counter\na_b_total{x=\"1\"} 2\n# HELP g A gauge.\n# TYPE g gauge\n# UNIT g bytes\ng 1\n# EOF\n";
        assert_eq!(
            openmetrics_to_prometheus(om),
            "# HELP a_b_total Things.\n# TYPE a_b_total counter\na_b_total{x=\"1\"} 2\n# HELP g A gauge.\n# TYPE g gauge\ng 1\n"
        );
    }
}
