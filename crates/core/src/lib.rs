//! mediaplane core: everything that decides, nothing that does I/O.
//!
//! * [`packet`] parses and builds Ethernet/IPv4/IPv6/UDP frames and checks checksums;
//! * [`rtp`] parses RTP (RFC 3550, RFC 8285 extensions) and RTCP compound packets, detects STUN;
//! * [`model`] holds rooms, participants, published streams, subscriptions and SIP relay pairs;
//! * [`srtp`] SRTP key material of relay legs (suites, keys; the ciphers are libsrtp's);
//! * [`feedback`] routes subscribers' RTCP feedback (PLI, FIR, NACK) to publishers, coalescing keyframe requests;
//! * [`call_quality`] round-trip times and MOS from the RTCP reports a relay passes (as rtpengine);
//! * [`reception`] in-path reception quality of an RTP stream (loss, duplicates, reordering, jitter);
//! * [`simulcast`] one layer of a simulcast stream per consumer, renumbered exactly across switches;
//! * [`ratelimit`] per-stream packet/bit-rate limits (token buckets), shared by the data planes;
//! * [`transport_feedback`] transport-wide congestion-control feedback to a publisher's transport;
//! * [`table`] compiles a model into forwarding tables and holds [`table::ForwardingTable::classify`],
//!   the reference decision every data plane must reproduce packet for packet.
//!
//! Data planes (crates `mediaplane-dataplane`, `mediaplane-ebpf`) are drivers that install tables
//! and move packets; they never re-derive forwarding decisions from the model.

pub mod call_quality;
pub mod dtmf_inject;
pub mod feedback;
pub mod layer_choice;
pub mod model;
mod model_ng;
pub mod packet;
pub mod pipeline;
pub mod ratelimit;
pub mod reception;
pub mod remote_estimate;
pub mod rtp;
pub mod send_history;
pub mod simulcast;
pub mod srtp;
pub mod table;
pub mod transport_feedback;

pub use model::{Model, ModelError};
pub use model_ng::LegSignal;
pub use ratelimit::RateLimit;
pub use table::{Copy, DropReason, ForwardingTable, IngressKey, SlowReason, SourceRule, StreamEntry, Verdict};
