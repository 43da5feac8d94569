//! Every error code the API answers, with its HTTP status and what it means: the one list the
//! handlers build their errors from ([`crate::api::ApiError::new`] takes nothing else), the
//! README's error table and `openapi.json`'s `Error.code` are checked against
//! (`crates/mediaplane/tests/docs.rs`, `crates/mediaplane/tests/openapi.rs`).

use axum::http::StatusCode;

macro_rules! codes {
    ($($variant:ident $name:literal $status:ident $meaning:literal;)*) => {
        /// An API error's `code`: one HTTP status each.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum ErrorCode {
            $(#[doc = $meaning] $variant,)*
        }

        impl ErrorCode {
            /// Every code, in the order the README's table lists them.
            pub const ALL: &'static [ErrorCode] = &[$(ErrorCode::$variant,)*];

            /// The `code` of the JSON body.
            pub const fn as_str(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $name,)*
                }
            }

            /// The status every error with this code is answered with.
            pub const fn status(self) -> StatusCode {
                match self {
                    $(ErrorCode::$variant => StatusCode::$status,)*
                }
            }

            /// What it means, in one line (the README's table says the same).
            pub const fn meaning(self) -> &'static str {
                match self {
                    $(ErrorCode::$variant => $meaning,)*
                }
            }
        }
    };
}

codes! {
    BadRequest "bad_request" BAD_REQUEST "the body is not JSON, or could not be read";
    Invalid "invalid" BAD_REQUEST "a value is not allowed: an id, an address, a key, a layer, a number out of range, a path or query parameter";
    InvalidSdp "invalid_sdp" BAD_REQUEST "the WHIP/WHEP body is not an SDP offer, or lacks what one must carry (ICE credentials, a readable `a=fingerprint`)";
    Unauthorized "unauthorized" UNAUTHORIZED "no bearer token, a wrong one, or an expired or altered room token";
    Forbidden "forbidden" FORBIDDEN "a room token used beyond WHIP, WHEP, reading and leaving its own room";
    Limit "limit" FORBIDDEN "a configured limit (`[limits]`) would be exceeded; nothing was changed";
    NotFound "not_found" NOT_FOUND "no such room, participant, stream, consumer or relay, or no such endpoint";
    MethodNotAllowed "method_not_allowed" METHOD_NOT_ALLOWED "the path exists, the method does not";
    Exists "exists" CONFLICT "a room, participant, stream, subscription or relay of that id exists already";
    AddressInUse "address_in_use" CONFLICT "the local address (or the ingress it needs) is taken by another session";
    TooLarge "too_large" PAYLOAD_TOO_LARGE "the body is larger than `api.max_body` (`api.max_batch_body` for the batch)";
    UnsupportedMediaType "unsupported_media_type" UNSUPPORTED_MEDIA_TYPE "the body's `Content-Type` is not the endpoint's (`application/json`, or `application/sdp` for WHIP/WHEP)";
    WrongShape "wrong_shape" UNPROCESSABLE_ENTITY "JSON of the wrong shape: a missing, unknown or mistyped field";
    UnsupportedSdp "unsupported_sdp" UNPROCESSABLE_ENTITY "an SDP offer the SFU cannot take: not bundled, no `rtcp-mux`, a fingerprint hash it does not compute, more than 64 sections";
    Unsupported "unsupported" UNPROCESSABLE_ENTITY "a WHIP/WHEP offer with nothing the SFU can take or give as offered (formats, payload types, simulcast without RIDs)";
    NoFreePort "no_free_port" SERVICE_UNAVAILABLE "no free port left in the media port range";
    DataplaneFull "dataplane_full" SERVICE_UNAVAILABLE "a kernel map has no room: raise `dataplane.max_streams` or `max_copies`; nothing was changed";
    NotReady "not_ready" SERVICE_UNAVAILABLE "not yet (a WHEP of a publisher whose simulcast layers are still being learned): retry after `Retry-After` seconds";
    Timeout "timeout" SERVICE_UNAVAILABLE "not answered within `api.timeout_ms`; `applied` says whether its change was applied";
    Internal "internal" INTERNAL_SERVER_ERROR "the daemon failed inside (a bug, or something it needs could not be made)";
    Dataplane "dataplane" INTERNAL_SERVER_ERROR "the data plane refused the update; nothing was changed";
    Store "store" INTERNAL_SERVER_ERROR "the store could not be written (nothing was changed) or read";
    Metrics "metrics" INTERNAL_SERVER_ERROR "collecting the metrics failed";
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl ErrorCode {
    /// The code named `name`.
    pub fn parse(name: &str) -> Option<ErrorCode> {
        ErrorCode::ALL.iter().copied().find(|c| c.as_str() == name)
    }

    /// The README's error table, as `crates/mediaplane/tests/docs.rs` expects to find it.
    pub fn markdown_table() -> String {
        let mut t = String::from("| code | status | meaning |\n| --- | --- | --- |\n");
        for c in ErrorCode::ALL {
            t += &format!("| `{}` | {} | {} |\n", c.as_str(), c.status().as_u16(), c.meaning());
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_are_distinct_snake_case_errors() {
        let mut names: Vec<&str> = ErrorCode::ALL.iter().map(|c| c.as_str()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), ErrorCode::ALL.len(), "a code is named twice");
        for c in ErrorCode::ALL {
            assert!(c.as_str().bytes().all(|b| b.is_ascii_lowercase() || b == b'_'), "{c}");
            assert!(c.status().is_client_error() || c.status().is_server_error(), "{c}: {}", c.status());
            assert!(!c.meaning().is_empty() && !c.meaning().contains('|') && !c.meaning().contains('\n'), "{c}: one table cell");
            assert_eq!(ErrorCode::parse(c.as_str()), Some(*c));
        }
    }
}
