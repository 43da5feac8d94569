//! The OpenAPI description (`crates/control/openapi.json`, served at `GET /openapi.json`)
//! against the real daemon: the spec's operations and the router's routes (read from
//! `crates/control/src/api.rs`) are the same set, and every operation, called on a running
//! `mediaplane serve` with the spec's example body, answers the spec's success status (so no
//! path is missing, no method wrong, no example rejected). Its error codes are the
//! `ErrorCode` enum's, and each operation's (`x-error-codes`) have its error responses'
//! statuses; `tests/api.rs` holds every error the daemon answers it to them.

mod api_doc;
mod common;

use mediaplane_control::error_code::ErrorCode;
use serde_json::{json, Value};
use std::collections::BTreeSet;

const SPEC: &str = include_str!("../../control/openapi.json");
const API_RS: &str = include_str!("../../control/src/api.rs");
const METHODS: [&str; 5] = ["get", "post", "put", "patch", "delete"];

/// (METHOD, path) of every `.route(...)` of the router, from its source.
fn router_routes() -> BTreeSet<(String, String)> {
    let batch = API_RS.lines().find_map(|l| l.trim().strip_prefix("const BATCH_PATH: &str = \"")?.strip_suffix("\";")).expect("BATCH_PATH");
    let mut out = BTreeSet::new();
    for line in API_RS.lines().map(str::trim).filter(|l| l.starts_with(".route(")) {
        let rest = &line[".route(".len()..];
        let (path, handlers) = match rest.strip_prefix('"') {
            Some(r) => r.split_once('"').unwrap(),
            None => (batch, rest.strip_prefix("BATCH_PATH").unwrap_or_else(|| panic!("unknown route path in {line}"))),
        };
        let methods: Vec<&str> = METHODS.iter().copied().filter(|m| handlers.contains(&format!("{m}(")) || handlers.contains(&format!(".{m}("))).collect();
        assert!(!methods.is_empty(), "no method in {line}");
        for m in methods {
            out.insert((m.to_uppercase(), path.to_string()));
        }
    }
    assert!(out.len() > 15, "{out:?}");
    out
}

fn spec_operations(spec: &Value) -> BTreeSet<(String, String)> {
    let mut out = BTreeSet::new();
    for (path, item) in spec["paths"].as_object().unwrap() {
        for m in METHODS.iter().filter(|m| item.get(**m).is_some()) {
            out.insert((m.to_uppercase(), path.clone()));
        }
    }
    out
}

#[test]
fn the_spec_describes_exactly_the_routes_and_its_examples_work() {
    let spec: Value = serde_json::from_str(SPEC).expect("openapi.json is JSON");
    assert!(spec["openapi"].as_str().unwrap().starts_with("3."));
    let routes = router_routes();
    let ops = spec_operations(&spec);
    assert_eq!(routes.difference(&ops).collect::<Vec<_>>(), Vec::<&(String, String)>::new(), "routes missing from the spec");
    assert_eq!(ops.difference(&routes).collect::<Vec<_>>(), Vec::<&(String, String)>::new(), "spec operations the router does not have");

    let tmp = common::TempDir::new("openapi");
    // With the RTSP proxy, so its routes answer (the example path is on demand: never pulled).
    let rtsp = format!("127.0.0.1:{}", common::free_port());
    let d = common::Daemon::start(&tmp.0.join("s.db"), &["--rtsp-listen", &rtsp]);
    let (status, served) = d.call("GET", "/openapi.json", None);
    assert_eq!((status, &served), (200, &spec), "the daemon serves the spec");
    // What the probes below must not see (answered with codes the spec has for them).
    for (method, path, status) in [("GET", "/v1/nope", 404), ("PUT", "/v1/rooms", 405)] {
        let (s, v) = d.call(method, path, None);
        assert_eq!(s, status, "{method} {path}: {v}");
        api_doc::assert_documented(method, path, s, &v);
    }

    // POSTs first (shortest path first: a room before its participants), then PUTs, GETs, then
    // DELETEs (longest path first). Path parameters: bob subscribes to alice's "main".
    let mut order: Vec<(String, String)> = ops.into_iter().collect();
    let rank = |m: &str| ["POST", "PUT", "GET", "DELETE"].iter().position(|x| *x == m).unwrap();
    order.sort_by_key(|(m, p)| (rank(m), if m == "DELETE" { usize::MAX - p.len() } else { p.len() }, p.clone()));
    let mut setup_done = false;
    let mut consumer = String::from("(no subscription yet)");
    let mut whip_publisher = String::from("(no WHIP session yet)");
    for (method, path) in order {
        let op = &spec["paths"][&path][method.to_lowercase()];
        let success: u16 = op["responses"].as_object().unwrap().keys().find(|k| k.starts_with('2')).expect("a success response").parse().unwrap();
        let url = path
            .replace("{room}", "r1")
            .replace("{pid}", "bob")
            .replace("{stream}", "main")
            .replace("{publisher}", "alice")
            .replace("{id}", "call1")
            .replace("{name}", "door")
            .replace("{consumer}", &consumer);
        // A participant's settings are a WebRTC participant's (bob is plain: refused).
        let url = match (&method[..], &path[..]) {
            ("PUT", "/v1/rooms/{room}/participants/{pid}") => url.replace("/bob", &format!("/{whip_publisher}")),
            _ => url,
        };
        if method == "POST" && path == "/v1/rooms/{room}/participants/{pid}/streams" && !setup_done {
            // Beside the examples: bob, and alice's stream for bob to subscribe to.
            assert_eq!(d.call("POST", "/v1/rooms/r1/participants", Some(json!({"id": "bob", "remote": "127.0.0.1:5006"}))).0, 201);
            // Simulcast, so its consumer has layers to choose.
            let main = json!({"name": "main", "layers": [0x100, 0x101, 0x102], "codec": "vp8"});
            assert_eq!(d.call("POST", "/v1/rooms/r1/participants/alice/streams", Some(main)).0, 201);
            setup_done = true;
        }
        let body = op["requestBody"]["content"]["application/json"]["example"].clone();
        let sdp = op["requestBody"]["content"]["application/sdp"]["example"].as_str();
        assert_eq!(op.get("requestBody").is_some(), !body.is_null() || sdp.is_some(), "{method} {path}: a body needs an example");
        let (status, answer) = match &method[..] {
            "GET" if path == "/metrics" || path == "/" => {
                let r = ureq::get(&format!("{}{url}", d.api)).call().unwrap();
                (r.status(), Value::Null)
            }
            // WHIP and WHEP: an SDP offer, an SDP answer. WHEP subscribes to what WHIP published.
            "POST" if sdp.is_some() => {
                let url = format!("{}{}", d.api, url.replace("/alice", &format!("/{whip_publisher}")));
                let r = ureq::post(&url).set("Content-Type", "application/sdp").send_string(sdp.unwrap());
                let r = r.unwrap_or_else(|e| panic!("{method} {url}: {e}"));
                let location = r.header("Location").unwrap_or_default().to_string();
                assert!(r.content_type() == "application/sdp" && location.starts_with("/v1/rooms/r1/participants/"), "{method} {url}: {location}");
                if path.starts_with("/v1/whip") {
                    whip_publisher = location.rsplit('/').next().unwrap().to_string();
                }
                (r.status(), Value::Null)
            }
            _ => d.call(&method, &url, if body.is_null() { None } else { Some(body) }),
        };
        assert_eq!(status, success, "{method} {url}: {answer}");
        if let Some(id) = answer.get("consumer").and_then(Value::as_u64) {
            consumer = id.to_string();
        }
    }
    assert!(setup_done);
    assert_eq!(d.call("GET", "/health", None).1["rooms"], 0, "everything the probes made, they deleted");
}

fn names(codes: impl IntoIterator<Item = ErrorCode>) -> BTreeSet<&'static str> {
    codes.into_iter().map(ErrorCode::as_str).collect()
}

/// `Error.code` lists exactly the enum's codes.
#[test]
fn the_error_codes_are_the_enum() {
    let spec: Value = serde_json::from_str(SPEC).unwrap();
    let listed: BTreeSet<&str> =
        spec["components"]["schemas"]["Error"]["properties"]["code"]["enum"].as_array().unwrap().iter().map(|c| c.as_str().unwrap()).collect();
    let all = names(ErrorCode::ALL.iter().copied());
    assert_eq!(all.difference(&listed).collect::<Vec<_>>(), Vec::<&&str>::new(), "codes missing from openapi.json's Error.code");
    assert_eq!(listed.difference(&all).collect::<Vec<_>>(), Vec::<&&str>::new(), "openapi.json's Error.code names codes that do not exist");
}

/// Each operation lists the codes it can answer (`x-error-codes`, all of the enum), and its
/// error responses are exactly their statuses; every code is answered somewhere; what answers
/// without a token is what the router lets through (`api::OPEN_PATHS`), and everything else
/// may answer 401 and 403.
#[test]
fn each_operation_documents_its_codes_and_their_statuses() {
    let spec: Value = serde_json::from_str(SPEC).unwrap();
    let mut answered: BTreeSet<&str> = names(api_doc::codes(&spec["x-fallback-error-codes"], "x-fallback-error-codes"));
    let mut open = BTreeSet::new();
    for (method, path) in spec_operations(&spec) {
        let op = &spec["paths"][&path][method.to_lowercase()];
        let what = format!("{method} {path}");
        let codes = api_doc::codes(&op["x-error-codes"], &what);
        let statuses: BTreeSet<String> = codes.iter().map(|c| c.status().as_u16().to_string()).collect();
        let responses: BTreeSet<String> = op["responses"].as_object().unwrap().keys().filter(|k| !k.starts_with('2')).cloned().collect();
        assert_eq!(responses, statuses, "{what}: its error responses are not the statuses of its x-error-codes {codes:?}");
        for status in &responses {
            assert_eq!(op["responses"][status]["$ref"], "#/components/responses/Error", "{what} {status}");
        }
        let needs_token = op.get("security") != Some(&json!([]));
        assert_eq!(codes.contains(&ErrorCode::Unauthorized), needs_token, "{what}: 401 exactly when it needs the token");
        assert_eq!(codes.contains(&ErrorCode::Forbidden), needs_token, "{what}: 403 (a room token beyond its room) exactly when it needs the token");
        let json_body = op["requestBody"]["content"].get("application/json").is_some();
        if json_body {
            for c in [ErrorCode::BadRequest, ErrorCode::WrongShape, ErrorCode::TooLarge] {
                assert!(codes.contains(&c), "{what} takes JSON: it can answer {c}");
            }
        }
        if !needs_token {
            open.insert(path.clone());
        }
        answered.extend(names(codes));
    }
    let all = names(ErrorCode::ALL.iter().copied());
    assert_eq!(all.difference(&answered).collect::<Vec<_>>(), Vec::<&&str>::new(), "codes no operation lists");
    let router_open: BTreeSet<String> = mediaplane_control::api::OPEN_PATHS.iter().map(|p| p.to_string()).collect();
    assert_eq!(open, router_open, "the operations whose security is empty are the paths the router answers without a token");
}
