//! SRTP key material as the model and the tables carry it: which suite and which master key
//! and salt protect one direction of a leg. No cryptography here: the data planes hand these to
//! libsrtp (the kernel path leaves SRTP legs to user space, where AES-NI is).

use serde::{Deserialize, Serialize};

/// An SRTP crypto suite (RFC 4568 §6.2, RFC 6188 and RFC 7714 names, as SDES `a=crypto` lines
/// carry them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum SrtpSuite {
    #[serde(rename = "AES_CM_128_HMAC_SHA1_80")]
    AesCm128HmacSha1_80,
    #[serde(rename = "AES_CM_128_HMAC_SHA1_32")]
    AesCm128HmacSha1_32,
    /// RFC 7714 (AES-GCM, a 16-byte tag): what DTLS-SRTP prefers, when the peer offers it.
    #[serde(rename = "AEAD_AES_128_GCM")]
    AeadAes128Gcm,
    /// RFC 6188: AES-CM with 192- and 256-bit keys.
    #[serde(rename = "AES_192_CM_HMAC_SHA1_80")]
    Aes192CmHmacSha1_80,
    #[serde(rename = "AES_192_CM_HMAC_SHA1_32")]
    Aes192CmHmacSha1_32,
    #[serde(rename = "AES_256_CM_HMAC_SHA1_80")]
    Aes256CmHmacSha1_80,
    #[serde(rename = "AES_256_CM_HMAC_SHA1_32")]
    Aes256CmHmacSha1_32,
    #[serde(rename = "AEAD_AES_256_GCM")]
    AeadAes256Gcm,
}

impl SrtpSuite {
    /// Every suite mediaplane offers in SDES `a=crypto` lines, in that order: rtpengine 10.5's
    /// order (AEAD first, then the longer keys), without its F8 and NULL suites (libsrtp has no
    /// F8; a NULL cipher sends the media in the clear).
    pub const ALL: [SrtpSuite; 8] = [
        SrtpSuite::AeadAes256Gcm,
        SrtpSuite::AeadAes128Gcm,
        SrtpSuite::Aes256CmHmacSha1_80,
        SrtpSuite::Aes256CmHmacSha1_32,
        SrtpSuite::Aes192CmHmacSha1_80,
        SrtpSuite::Aes192CmHmacSha1_32,
        SrtpSuite::AesCm128HmacSha1_80,
        SrtpSuite::AesCm128HmacSha1_32,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SrtpSuite::AesCm128HmacSha1_80 => "AES_CM_128_HMAC_SHA1_80",
            SrtpSuite::AesCm128HmacSha1_32 => "AES_CM_128_HMAC_SHA1_32",
            SrtpSuite::AeadAes128Gcm => "AEAD_AES_128_GCM",
            SrtpSuite::Aes192CmHmacSha1_80 => "AES_192_CM_HMAC_SHA1_80",
            SrtpSuite::Aes192CmHmacSha1_32 => "AES_192_CM_HMAC_SHA1_32",
            SrtpSuite::Aes256CmHmacSha1_80 => "AES_256_CM_HMAC_SHA1_80",
            SrtpSuite::Aes256CmHmacSha1_32 => "AES_256_CM_HMAC_SHA1_32",
            SrtpSuite::AeadAes256Gcm => "AEAD_AES_256_GCM",
        }
    }

    /// The suite an SDP names (case-insensitive), if mediaplane speaks it.
    pub fn from_name(name: &str) -> Option<SrtpSuite> {
        Self::ALL.into_iter().find(|s| s.name().eq_ignore_ascii_case(name))
    }

    /// An AEAD suite (AES-GCM, RFC 7714): no separate authentication.
    pub fn is_aead(self) -> bool {
        matches!(self, SrtpSuite::AeadAes128Gcm | SrtpSuite::AeadAes256Gcm)
    }

    /// Bytes a protected packet carries beyond the plain one (no MKI): the authentication tag;
    /// SRTCP also its 4-byte E flag and index, and an 80-bit tag in every AES-CM suite
    /// (RFC 4568 6.2, RFC 6188: the 32-bit tag of `_32` is SRTP's only).
    pub fn overhead(self, rtcp: bool) -> usize {
        let tag = match (self.is_aead(), self.name().ends_with("_32"), rtcp) {
            (true, _, _) => 16,
            (false, true, false) => 4,
            (false, _, _) => 10,
        };
        tag + if rtcp { 4 } else { 0 }
    }

    /// Master key plus master salt, bytes: what an `inline:` key carries.
    pub fn master_len(self) -> usize {
        let key = match self {
            SrtpSuite::AesCm128HmacSha1_80 | SrtpSuite::AesCm128HmacSha1_32 | SrtpSuite::AeadAes128Gcm => 16,
            SrtpSuite::Aes192CmHmacSha1_80 | SrtpSuite::Aes192CmHmacSha1_32 => 24,
            SrtpSuite::Aes256CmHmacSha1_80 | SrtpSuite::Aes256CmHmacSha1_32 | SrtpSuite::AeadAes256Gcm => 32,
        };
        // RFC 7714 §12: a 96-bit master salt for AES-GCM; 112 bits for AES-CM.
        key + if self.is_aead() { 12 } else { 14 }
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
            assert!(err.contains(&format!("{}-byte", s.master_len())), "{err}");
        }
        // RFC 4568, 6188 and 7714: key plus salt, and the SRTP / SRTCP overhead.
        let sizes: Vec<(&str, usize, usize, usize)> = SrtpSuite::ALL.iter().map(|s| (s.name(), s.master_len(), s.overhead(false), s.overhead(true))).collect();
        assert_eq!(
            sizes,
            [
                ("AEAD_AES_256_GCM", 44, 16, 20),
                ("AEAD_AES_128_GCM", 28, 16, 20),
                ("AES_256_CM_HMAC_SHA1_80", 46, 10, 14),
                ("AES_256_CM_HMAC_SHA1_32", 46, 4, 14),
                ("AES_192_CM_HMAC_SHA1_80", 38, 10, 14),
                ("AES_192_CM_HMAC_SHA1_32", 38, 4, 14),
                ("AES_CM_128_HMAC_SHA1_80", 30, 10, 14),
                ("AES_CM_128_HMAC_SHA1_32", 30, 4, 14),
            ]
        );
        assert_eq!(SrtpSuite::from_name("F8_128_HMAC_SHA1_80"), None);
        let k = SrtpKey::new(SrtpSuite::AesCm128HmacSha1_80, vec![0xab; 30]).unwrap();
        assert!(!format!("{k:?}").contains("ab"), "keys never reach debug output");
    }
}
