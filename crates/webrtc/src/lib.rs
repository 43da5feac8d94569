//! What a crypto leg needs before its media flows: ICE-lite connectivity checks ([`ice`], on
//! [`stun`]) and the DTLS-SRTP handshake that yields its SRTP keys ([`dtls`]). Sans-I/O: the
//! control plane feeds them the datagrams the data plane hands up and sends what they return.

pub mod dtls;
pub mod ice;
pub mod stun;
