//! Shared by the NG tests of the binary: a small NG (bencode over UDP) client, SDP helpers, and
//! the relay views of the HTTP API.

// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

use mediaplane_ng::bencode::Value;
use std::net::{SocketAddr, UdpSocket};

#[path = "../../../ng/tests/common/ng_test.rs"]
mod ng_test;
pub use mediaplane_ng::client::{delete, list, offer_answer, text, NgClient};
pub use ng_test::*;

/// A G.711 A-law SDP body of a party receiving RTP on `ip:port`.
pub fn sdp(ip: &str, port: u16, sess: u32) -> String {
    mediaplane_ng::client::g711_sdp(ip, port, sess, 8)
}

/// The RTP relay id of media section 0 of a call.
pub fn rtp_relay(call: &str) -> String {
    mediaplane_ng::calls::rtp_relay_id(&mediaplane_ng::calls::call_key(call), 0)
}

/// A free UDP port on loopback (bound, then released).
pub fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}
