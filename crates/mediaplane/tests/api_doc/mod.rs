//! The API's error codes as `crates/control/openapi.json` documents them: each operation's
//! `x-error-codes` (and `x-fallback-error-codes` for a path or method no operation has), for the
//! tests that call the API to hold every error they are answered to it.

#![allow(dead_code)]

use mediaplane_control::error_code::ErrorCode;
use serde_json::Value;

pub const SPEC: &str = include_str!("../../../control/openapi.json");

pub fn spec() -> Value {
    serde_json::from_str(SPEC).expect("openapi.json is JSON")
}

/// The codes a list of the spec names (`x-error-codes`); panics on a name that is no code.
pub fn codes(list: &Value, what: &str) -> Vec<ErrorCode> {
    let names = list.as_array().unwrap_or_else(|| panic!("{what}: no list of error codes"));
    names.iter().map(|n| n.as_str().and_then(ErrorCode::parse).unwrap_or_else(|| panic!("{what}: {n} is no ErrorCode"))).collect()
}

/// The spec's path template a concrete `path` (query dropped) is: `{x}` segments take any one
/// segment; of several, the one with the most literal segments.
pub fn template_of(spec: &Value, path: &str) -> Option<String> {
    let path = path.split('?').next().unwrap();
    let segs: Vec<&str> = path.split('/').collect();
    let mut best: Option<(usize, &String)> = None;
    for t in spec["paths"].as_object().unwrap().keys() {
        let tsegs: Vec<&str> = t.split('/').collect();
        if tsegs.len() != segs.len() {
            continue;
        }
        let literal = |s: &str| !s.starts_with('{');
        if tsegs.iter().zip(&segs).all(|(t, s)| !literal(t) || t == s) {
            let n = tsegs.iter().filter(|s| literal(s)).count();
            if best.is_none_or(|(b, _)| n > b) {
                best = Some((n, t));
            }
        }
    }
    best.map(|(_, t)| t.clone())
}

/// The codes the spec says `method` on `path` can answer.
pub fn documented_codes(spec: &Value, method: &str, path: &str) -> (String, Vec<ErrorCode>) {
    let m = if method.eq_ignore_ascii_case("head") { "get".to_string() } else { method.to_lowercase() };
    match template_of(spec, path) {
        Some(t) if spec["paths"][&t].get(&m).is_some() => {
            let what = format!("{} {t}", m.to_uppercase());
            let codes = codes(&spec["paths"][&t][&m]["x-error-codes"], &what);
            (what, codes)
        }
        _ => ("(no operation)".into(), codes(&spec["x-fallback-error-codes"], "x-fallback-error-codes")),
    }
}

/// An answer of `method` on `path`: if it is an error, its body names a code, with that code's
/// status, that the spec lists for the operation.
pub fn assert_documented(method: &str, path: &str, status: u16, body: &Value) {
    if status < 400 {
        return;
    }
    let name = body["code"].as_str().unwrap_or_else(|| panic!("{method} {path}: error {status} without a code: {body}"));
    let code = ErrorCode::parse(name).unwrap_or_else(|| panic!("{method} {path}: {name:?} is no ErrorCode ({status} {body})"));
    assert_eq!(code.status().as_u16(), status, "{method} {path}: {name} answered with another status than its own: {body}");
    let (op, listed) = documented_codes(&spec(), method, path);
    assert!(listed.contains(&code), "{method} {path} answered {status} {name}, which openapi.json's {op} does not list (x-error-codes {listed:?}): {body}");
}

/// [`assert_documented`] of an answer whose body is text (JSON when it is an error).
pub fn assert_documented_text(method: &str, path: &str, status: u16, body: &str) {
    if status >= 400 {
        let v: Value = serde_json::from_str(body).unwrap_or_else(|_| panic!("{method} {path}: error {status} is not JSON: {body}"));
        assert_documented(method, path, status, &v);
    }
}
