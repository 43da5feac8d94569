//! Room tokens: what a participant's browser (or any WHIP/WHEP client) holds instead of the API
//! token. One names a room and an expiry, signed with a key derived from the API token, and
//! reaches only what joining that room needs: WHIP and WHEP into it, reading it, and leaving it.
//! Nothing is stored: a token lives until it expires or the API token changes.
//!
//! `mpr1:<expiry, unix seconds>:<HMAC-SHA256 hex>:<room>` (room last: ids may hold `.`, never
//! `:`).

use openssl::hash::MessageDigest;
use openssl::pkey::PKey;
use openssl::sign::Signer;

const PREFIX: &str = "mpr1";
/// The longest a token may be asked to live: 30 days.
pub const MAX_TTL_S: u64 = 30 * 86_400;
pub const DEFAULT_TTL_S: u64 = 86_400;

/// The key room tokens are signed with, derived from the API token (so rotating it revokes
/// every room token).
#[derive(Clone)]
pub struct RoomTokens {
    key: Vec<u8>,
}

/// Why a presented room token is refused.
#[derive(Debug, PartialEq, Eq)]
pub enum Refused {
    /// Not a room token at all (perhaps a wrong API token).
    Malformed,
    BadSignature,
    Expired,
}

impl RoomTokens {
    pub fn new(api_token: &str) -> RoomTokens {
        let key = openssl::sha::sha256(format!("mediaplane room tokens\0{api_token}").as_bytes()).to_vec();
        RoomTokens { key }
    }

    fn mac(&self, expiry: u64, room: &str) -> String {
        let pkey = PKey::hmac(&self.key).expect("an HMAC key");
        let mut signer = Signer::new(MessageDigest::sha256(), &pkey).expect("HMAC-SHA256");
        signer.update(format!("{PREFIX}:{expiry}:{room}").as_bytes()).expect("HMAC update");
        signer.sign_to_vec().expect("HMAC").iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A token for `room`, valid until `expiry` (unix seconds).
    pub fn issue(&self, room: &str, expiry: u64) -> String {
        format!("{PREFIX}:{expiry}:{}:{room}", self.mac(expiry, room))
    }

    /// The room `token` is for, if it is ours and valid at `now` (unix seconds).
    pub fn verify<'t>(&self, token: &'t str, now: u64) -> Result<&'t str, Refused> {
        let mut parts = token.splitn(4, ':');
        let (Some(PREFIX), Some(expiry), Some(mac), Some(room)) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
            return Err(Refused::Malformed);
        };
        let expiry: u64 = expiry.parse().map_err(|_| Refused::Malformed)?;
        let expected = self.mac(expiry, room);
        // Constant time: the comparison says nothing of how much of a forged MAC was right.
        if mac.len() != expected.len() || !openssl::memcmp::eq(mac.as_bytes(), expected.as_bytes()) {
            return Err(Refused::BadSignature);
        }
        if now >= expiry {
            return Err(Refused::Expired);
        }
        Ok(room)
    }
}

/// Whether a room token for `room` reaches `method path`: WHIP into the room, WHEP from it,
/// reading the room, and removing one of its participants (a WHIP/WHEP resource: leaving).
pub fn reaches(room: &str, method: &axum::http::Method, path: &str) -> bool {
    use axum::http::Method;
    let segments: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    match (method, segments.as_slice()) {
        (&Method::POST, ["v1", "whip", r]) => *r == room,
        (&Method::POST, ["v1", "whep", r, _publisher]) => *r == room,
        (&Method::GET, ["v1", "rooms", r]) => *r == room,
        (&Method::DELETE, ["v1", "rooms", r, "participants", _pid]) => *r == room,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::Method;

    #[test]
    fn a_token_names_its_room_until_it_expires_and_nothing_else_passes() {
        let tokens = RoomTokens::new("s3cret");
        let t = tokens.issue("demo.room-1", 1_000);
        assert_eq!(tokens.verify(&t, 999), Ok("demo.room-1"));
        assert_eq!(tokens.verify(&t, 1_000), Err(Refused::Expired));
        // Another room, another expiry or another API token: the signature no longer matches.
        assert_eq!(tokens.verify(&t.replace(":demo.room-1", ":other"), 0), Err(Refused::BadSignature));
        assert_eq!(tokens.verify(&t.replacen(":1000:", ":9000:", 1), 0), Err(Refused::BadSignature));
        assert_eq!(RoomTokens::new("rotated").verify(&t, 0), Err(Refused::BadSignature));
        for junk in ["", "s3cret", "mpr1:", "mpr1:x:ab:r", "mpr2:1000:ab:r", "mpr1:1000:ab"] {
            assert!(tokens.verify(junk, 0).is_err(), "{junk:?}");
        }
    }

    #[test]
    fn a_room_token_reaches_only_joining_and_leaving_its_room() {
        for (m, p) in
            [(Method::POST, "/v1/whip/r"), (Method::POST, "/v1/whep/r/alice"), (Method::GET, "/v1/rooms/r"), (Method::DELETE, "/v1/rooms/r/participants/alice")]
        {
            assert!(reaches("r", &m, p), "{m} {p}");
            assert!(!reaches("other", &m, p), "{m} {p} of another room");
        }
        for (m, p) in [
            (Method::GET, "/v1/rooms"),
            (Method::DELETE, "/v1/rooms/r"),
            (Method::POST, "/v1/rooms/r/participants"),
            (Method::POST, "/v1/rooms/r/participants/alice/streams"),
            (Method::POST, "/v1/rooms/r/tokens"),
            (Method::GET, "/v1/rooms/r/participants/alice"),
            (Method::GET, "/v1/stats"),
            (Method::POST, "/v1/relays"),
            (Method::GET, "/v1/whip/r"),
            (Method::POST, "/v1/whip/r/extra"),
            (Method::POST, "/v1/whep/r"),
        ] {
            assert!(!reaches("r", &m, p), "{m} {p}");
        }
    }
}
