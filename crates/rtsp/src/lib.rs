//! The RTSP proxy (issue 43): each configured path's upstream (a camera, another RTSP server) is
//! pulled once, and any number of viewers watch it. The upstream's tracks are publishers in the
//! forwarding model and each viewer's track is a consumer of one, so the media is forwarded by
//! whichever data plane runs (on the eBPF plane, by the kernel) and never by this crate: RTSP
//! here is control only, as in the seed that put the forwarding on a network processor.
//!
//! `message`, `transport` and `describe` are sans-I/O (and fuzzed); `upstream` and `server`
//! are the tokio tasks that speak them.

pub mod auth;
pub mod describe;
pub mod message;
mod server;
pub mod transport;
mod upstream;

pub use server::{serve_rtsp, RtspProxy};

/// The room a path's publishers and viewers live in.
pub fn room_of(path: &str) -> String {
    format!("rtsp.{path}")
}

/// The publisher of a path's track `i` (the upstream's stream on it is [`STREAM`]).
pub fn source_of(track: usize) -> String {
    format!("source-{track}")
}

/// The name of the one stream each source publishes.
pub const STREAM: &str = "rtp";
