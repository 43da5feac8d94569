//! What `mediaplane bench relay` measures: the result types the run fills in ([`crate::bench_relay`])
//! and the report renders ([`crate::relay_report`]), in a module of their own so that neither of
//! the two imports the other's internals.

use mediaplane_bench::qos::Summary;
use serde::Serialize;

/// One (relay, N calls) run.
#[derive(Debug, Clone, Serialize)]
pub struct RelayRun {
    pub relay: String,
    /// What the calls' legs spoke (`rtp`, `sdes-rtp`: see `bench relay --media`).
    pub media: String,
    pub calls: usize,
    pub calls_up: usize,
    pub setup_failures: usize,
    /// The first few set-up errors, verbatim.
    pub setup_errors: Vec<String>,
    pub setup_rate_target: f64,
    /// Calls set up per second, measured (first offer to last answer).
    pub setup_rate_achieved: f64,
    /// NG round trip of offers and answers, ns.
    pub offer_ns: Summary,
    pub answer_ns: Summary,
    pub legs: usize,
    /// Legs the relay had latched before media started (mediaplane only; rtpengine: None).
    pub legs_latched: Option<usize>,
    pub latch_seconds: f64,
    /// CPU of the relay process, ms per second, with every call up and latched but silent
    /// (`--idle-seconds`, before the media); None: not measured (or no relay).
    pub idle_cpu_ms_per_s: Option<f64>,
    pub seconds: f64,
    /// Packets the generator planned and sent; the difference is generator shortfall (it fell
    /// more than 1 s behind, or its socket buffer was full), not relay loss.
    pub planned: u64,
    pub sent: u64,
    pub send_errors: u64,
    pub received: u64,
    pub lost: u64,
    pub loss_pct: f64,
    pub duplicates: u64,
    pub unexpected: u64,
    /// SRTP packets the parties could not unprotect (what the relay protected toward the caller).
    pub srtp_failed: u64,
    /// SRTP packets a party refused as replays: what a relay duplicated, on an SRTP leg (the
    /// probe inside is unreadable, so they are not in `duplicates`).
    pub srtp_replayed: u64,
    /// SRTP calls: the median time the generator took to protect one packet. It is inside the
    /// caller-to-callee one-way delay (the send time is written before protecting).
    pub generator_srtp_protect_p50_ns: Option<f64>,
    /// Legs with any loss.
    pub legs_with_loss: usize,
    /// One-way delay over all packets of all legs, ns.
    pub delay_ns: Summary,
    /// RFC 4689 delay variation: p99 per leg, then median and worst over legs, ns.
    pub delay_variation_p99_median_ns: f64,
    pub delay_variation_p99_max_ns: f64,
    /// RFC 3550 jitter, mean over legs, ns.
    pub jitter_mean_ns: f64,
    /// G.107 MOS (G.711, Ie = 0, Bpl = 4.3; measured delay and loss): mean and worst leg.
    pub mos_mean: f64,
    pub mos_min: f64,
    /// CPU of the relay process during the media run (all threads), ns; BPF program run time.
    pub relay_cpu_ns: u64,
    pub bpf_run_ns: u64,
    /// (relay CPU + BPF run time) as % of one core over the media run.
    pub cpu_pct: f64,
    /// (relay CPU + BPF run time) per relayed packet.
    pub cpu_per_packet_ns: Option<f64>,
    /// Added delay (DESIGN.md): this run's one-way delay p50 / p99 minus the `kernel-forward`
    /// run's (the same path without a relay) at the same call count in the same invocation.
    pub added_delay_p50_ns: Option<f64>,
    pub added_delay_p99_ns: Option<f64>,
    /// Busy time of the whole machine per relayed packet during the media run (the sender
    /// does not spin here): generator and receivers, the relay, and the kernel's packet work
    /// (veth, XDP page copies, TC, skb clones and redirects, socket delivery), which runs in
    /// whichever task raised it, mostly the sender, so the eBPF relay's share of it is in none
    /// of the CPU columns above. Compare with `kernel-forward` (the same generator work, no
    /// relay); tick-sampled, and the receivers' wake-ups depend on how bursty the relay is, so
    /// only differences of several µs mean anything.
    pub machine_cpu_per_packet_ns: Option<f64>,
    /// mediaplane: packets forwarded by the kernel and packets seen by the user-space slow path
    /// during the media run.
    pub kernel_forwarded: Option<u64>,
    pub slow_path_rx: Option<u64>,
    pub relay_rss_kib: u64,
    pub relay_bpf_memlock_bytes: u64,
    pub generator_cpu_ns: u64,
    pub receiver_cpu_ns: u64,
    pub delete_failures: usize,
    pub delete_ns: Summary,
    /// What the relay still held after every delete (mediaplane: relays in the model).
    pub left_after_delete: Option<u64>,
}

impl RelayRun {
    /// The relay, and the media when it is not plain RTP: what a table row or a plot line is.
    pub fn label(&self) -> String {
        if self.media == "rtp" {
            self.relay.clone()
        } else {
            format!("{} ({})", self.relay, self.media)
        }
    }
}

/// One sample of a capacity ramp.
#[derive(Debug, Clone, Serialize)]
pub struct CapacitySample {
    pub sessions: usize,
    pub elapsed_s: f64,
    /// Sessions per second over the last window.
    pub rate: f64,
    /// Latency of one install request over the last window, ns.
    pub request_ns: Summary,
    pub rss_kib: u64,
    pub bpf_memlock_bytes: u64,
}

#[derive(Debug, Clone, Serialize)]
pub struct CapacityRamp {
    /// "ng" (offer + answer: 2 relay sessions, RTP and RTCP), "http" (POST /v1/relays) or
    /// "http-batchN" (POST /v1/batch/relays, N relays per request).
    pub api: String,
    pub dataplane: String,
    pub target: usize,
    pub installed: usize,
    pub seconds: f64,
    pub rate_mean: f64,
    /// CPU time of the daemon (all threads) per installed session, ns: what a set-up costs the
    /// server, independent of how fast the client (sharing the cores) could ask.
    pub daemon_cpu_ns_per_session: f64,
    pub stopped_by: String,
    pub samples: Vec<CapacitySample>,
}

/// What one mutation of the session manager costs in-process at a model size.
#[derive(Debug, Clone, Serialize)]
pub struct MutationCost {
    pub relays: usize,
    pub model_clone_ns: f64,
    /// Recompiling what one relay creation touched ([`mediaplane_core::ForwardingTable::update`]).
    pub table_update_ns: f64,
    /// Compiling the whole table (what every mutation cost before updates were incremental).
    pub table_compile_ns: f64,
    pub store_save_ns: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct Capacity {
    pub ramps: Vec<CapacityRamp>,
    pub mutation_cost: Vec<MutationCost>,
}
