//! What a crypto leg needs before its media flows: ICE-lite connectivity checks ([`ice`], on
//! [`stun`]) and the DTLS-SRTP handshake that yields its SRTP keys ([`dtls`]). Sans-I/O: the
//! control plane feeds them the datagrams the data plane hands up and sends what they return.
//! And the SDP of WHIP/WHEP sessions ([`sdp`]): a browser's offer read, the SFU's answer written.

pub mod dtls;
pub mod ice;
pub mod sdp;
pub mod stun;

/// `n` random bytes in hex, from OpenSSL's generator: names nobody has to guess or choose.
pub fn random_hex(n: usize) -> String {
    let mut raw = vec![0u8; n];
    openssl::rand::rand_bytes(&mut raw).expect("OpenSSL's random generator");
    raw.iter().map(|b| format!("{b:02x}")).collect()
}
