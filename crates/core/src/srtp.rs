//! SRTP key material as the model and the tables carry it: which suite and which master key
//! and salt protect one direction of a leg. No cryptography here: the data planes hand these to
//! libsrtp (the kernel path leaves SRTP legs to user space, where AES-NI is).

use serde::{Deserialize, Serialize};

/// An SRTP crypto suite (RFC 4568 §6.2 names, as SDES `a=crypto` lines carry them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SrtpSuite {
    #[serde(rename = "AES_CM_128_HMAC_SHA1_80")]
    AesCm128HmacSha1_80,
    #[serde(rename = "AES_CM_128_HMAC_SHA1_32")]
    AesCm128HmacSha1_32,
    /// RFC 7714 (AES-GCM, a 16-byte tag): what DTLS-SRTP prefers, when the peer offers it.
    #[serde(rename = "AEAD_AES_128_GCM")]
    AeadAes128Gcm,
}

impl SrtpSuite {
    /// Every suite mediaplane offers in SDES `a=crypto` lines, in that order (strongest tag
    /// first, as rtpengine and browsers do). AES-GCM is negotiated over DTLS-SRTP only.
    pub const ALL: [SrtpSuite; 2] = [SrtpSuite::AesCm128HmacSha1_80, SrtpSuite::AesCm128HmacSha1_32];

    pub fn name(self) -> &'static str {
        match self {
            SrtpSuite::AesCm128HmacSha1_80 => "AES_CM_128_HMAC_SHA1_80",
            SrtpSuite::AesCm128HmacSha1_32 => "AES_CM_128_HMAC_SHA1_32",
            SrtpSuite::AeadAes128Gcm => "AEAD_AES_128_GCM",
        }
    }

    /// The suite an SDP names (case-insensitive), if mediaplane speaks it.
    pub fn from_name(name: &str) -> Option<SrtpSuite> {
        Self::ALL.into_iter().find(|s| s.name().eq_ignore_ascii_case(name))
    }

    /// Bytes a protected packet carries beyond the plain one (no MKI): the authentication tag;
    /// SRTCP also its 4-byte E flag and index, and an 80-bit tag in both AES-CM suites
    /// (RFC 4568 6.2: the 32-bit tag of `_32` is SRTP's only).
    pub fn overhead(self, rtcp: bool) -> usize {
        match (self, rtcp) {
            (SrtpSuite::AesCm128HmacSha1_80, false) => 10,
            (SrtpSuite::AesCm128HmacSha1_32, false) => 4,
            (SrtpSuite::AesCm128HmacSha1_80 | SrtpSuite::AesCm128HmacSha1_32, true) => 4 + 10,
            (SrtpSuite::AeadAes128Gcm, false) => 16,
            (SrtpSuite::AeadAes128Gcm, true) => 4 + 16,
        }
    }

    /// Master key plus master salt, bytes: what an `inline:` key carries.
    pub fn master_len(self) -> usize {
        match self {
            SrtpSuite::AesCm128HmacSha1_80 | SrtpSuite::AesCm128HmacSha1_32 => 16 + 14,
            // RFC 7714 §12: a 96-bit master salt.
            SrtpSuite::AeadAes128Gcm => 16 + 12,
        }
    }
}

/// The master key and salt one direction of a leg is protected with.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SrtpKey {
    pub suite: SrtpSuite,
    /// Key then salt, [`SrtpSuite::master_len`] bytes.
    pub master: Vec<u8>,
}

impl SrtpKey {
    /// A key of the right length for its suite, or why not.
    pub fn new(suite: SrtpSuite, master: Vec<u8>) -> Result<SrtpKey, String> {
        if master.len() != suite.master_len() {
            return Err(format!("{} takes a {}-byte master key and salt, not {} bytes", suite.name(), suite.master_len(), master.len()));
        }
        Ok(SrtpKey { suite, master })
    }
}

/// Keys stay out of logs and debug output.
impl std::fmt::Debug for SrtpKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SrtpKey({}, {} bytes)", self.suite.name(), self.master.len())
    }
}

/// How packets cross one side of the relay: as they are, or SRTP the relay terminates. A leg
/// speaking SRTP whose key is not negotiated yet (`Srtp(None)`) passes nothing in that
/// direction: the relay can neither read nor protect its media.
#[derive(Debug, Clone, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Protection {
    #[default]
    Clear,
    Srtp(Option<SrtpKey>),
}

impl Protection {
    pub fn is_clear(&self) -> bool {
        *self == Protection::Clear
    }
}

/// SRTP on a relay leg's wire (SDES: both keys come from SDP `a=crypto` lines).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LegSrtp {
    /// How the leg's peer protects what it sends (its own `a=crypto`): the relay unprotects it.
    pub inbound: Option<SrtpKey>,
    /// How the relay protects what it sends the peer (the `a=crypto` the relay gave it).
    pub outbound: Option<SrtpKey>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn suites_round_trip_their_names_and_keys_check_their_length() {
        for s in SrtpSuite::ALL {
            assert_eq!(SrtpSuite::from_name(s.name()), Some(s));
            assert_eq!(SrtpSuite::from_name(&s.name().to_lowercase()), Some(s));
            assert!(SrtpKey::new(s, vec![7; s.master_len()]).is_ok());
            let err = SrtpKey::new(s, vec![7; 16]).unwrap_err();
            assert!(err.contains("30-byte"), "{err}");
        }
        assert_eq!(SrtpSuite::from_name("F8_128_HMAC_SHA1_80"), None);
        let k = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![0xab; 30]).unwrap();
        assert!(!format!("{k:?}").contains("ab"), "keys never reach debug output");
    }
}
