//! Every API endpoint's success and error paths against a real `mediaplane serve`, and a check
//! that no bad input takes the daemon down.

mod api_doc;
mod common;

use api_doc::{assert_documented, assert_documented_text};
use common::{Daemon, TempDir};
use serde_json::{json, Value};

fn code(v: &Value) -> &str {
    v["code"].as_str().unwrap_or("")
}

/// [`Daemon::call`], holding every error answer to `openapi.json`: a code of the `ErrorCode`
/// enum, with its status, that the operation lists in its `x-error-codes`.
fn call(d: &Daemon, method: &str, path: &str, body: Option<Value>) -> (u16, Value) {
    let (s, v) = d.call(method, path, body);
    assert_documented(method, path, s, &v);
    (s, v)
}

#[test]
fn every_endpoint_success_and_error_paths() {
    let dir = TempDir::new("api");
    let mut d = Daemon::start(&dir.0.join("s.db"), &[]);

    let (s, v) = call(&d, "GET", "/health", None);
    assert_eq!((s, v["status"].as_str()), (200, Some("ok")));
    assert_eq!(v["dataplane"], "userspace");

    // Rooms.
    assert_eq!(call(&d, "POST", "/v1/rooms", Some(json!({"id": "conf"}))).0, 201);
    let (s, v) = call(&d, "POST", "/v1/rooms", Some(json!({"id": "conf"})));
    assert_eq!((s, code(&v)), (409, "exists"));
    let (s, v) = call(&d, "POST", "/v1/rooms", Some(json!({"id": "bad/id"})));
    assert_eq!((s, code(&v)), (400, "invalid"));
    assert!(v["error"].as_str().unwrap().contains("invalid id"));
    let (s, v) = call(&d, "POST", "/v1/rooms", Some(json!({"name": "conf"})));
    assert_eq!((s, code(&v)), (422, "wrong_shape"), "unknown/missing fields: {v}");
    assert!(v["error"].as_str().unwrap().contains("id"), "{v}");
    let (s, v) = call(&d, "GET", "/v1/rooms", None);
    assert_eq!((s, v["rooms"].clone()), (200, json!(["conf"])));
    assert_eq!(call(&d, "GET", "/v1/rooms/conf", None).0, 200);
    let (s, v) = call(&d, "GET", "/v1/rooms/nope", None);
    assert_eq!((s, code(&v)), (404, "not_found"));
    // A room's ceiling on its publishers: set, shown, refused out of range, lifted.
    let (s, v) = call(&d, "PUT", "/v1/rooms/conf", Some(json!({"publisher_max_kbps": 800})));
    assert_eq!((s, v["publisher_max_kbps"].as_u64()), (200, Some(800)), "{v}");
    assert_eq!(call(&d, "GET", "/v1/rooms/conf", None).1["publisher_max_kbps"], 800);
    let (s, v) = call(&d, "PUT", "/v1/rooms/conf", Some(json!({"publisher_max_kbps": 5})));
    assert_eq!((s, code(&v)), (400, "invalid"), "{v}");
    assert!(v["error"].as_str().unwrap().contains("30 to 100000"), "{v}");
    assert_eq!(call(&d, "PUT", "/v1/rooms/nope", Some(json!({}))).0, 404);
    assert_eq!(call(&d, "POST", "/v1/rooms/conf/participants", Some(json!({"id": "plain", "remote": "127.0.0.1:5000"}))).0, 201);
    let (s, v) = call(&d, "PUT", "/v1/rooms/conf/participants/plain", Some(json!({"max_kbps": 600})));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("not a WebRTC participant"), "a plain participant has no REMB to obey: {s} {v}");
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/plain", None).0, 200);
    assert_eq!(call(&d, "PUT", "/v1/rooms/conf", Some(json!({}))).0, 200);
    assert!(call(&d, "GET", "/v1/rooms/conf", None).1.get("publisher_max_kbps").is_none(), "lifted");
    let (s, v) = call(&d, "PUT", "/v1/rooms/conf/participants/nobody", Some(json!({"max_kbps": 600})));
    assert_eq!((s, code(&v)), (404, "not_found"), "{v}");
    let (s, v) = call(&d, "POST", "/v1/rooms", Some(json!({"id": "capped", "publisher_max_kbps": 10})));
    assert_eq!((s, code(&v)), (400, "invalid"), "a room is not created with a ceiling out of range: {v}");
    assert_eq!(call(&d, "GET", "/v1/rooms/capped", None).0, 404, "nothing half-made");

    // Malformed bodies: not JSON, wrong content type, too large.
    let r = ureq::post(&format!("{}/v1/rooms", d.api)).set("content-type", "application/json").send_string("{not json");
    match r {
        Err(ureq::Error::Status(400, resp)) => assert_eq!(resp.into_json::<Value>().unwrap()["code"], "bad_request"),
        other => panic!("syntax error must be a 400: {other:?}"),
    }
    match ureq::post(&format!("{}/v1/rooms", d.api)).set("content-type", "text/plain").send_string("{}") {
        Err(ureq::Error::Status(415, resp)) => assert_eq!(resp.into_json::<Value>().unwrap()["code"], "unsupported_media_type"),
        other => panic!("wrong content type must be a 415: {other:?}"),
    }
    // Announce a 200 kB body and wait: the limit must answer 413 before reading any of it.
    {
        use std::io::{Read, Write};
        let mut tcp = std::net::TcpStream::connect(d.listen).unwrap();
        tcp.set_read_timeout(Some(std::time::Duration::from_secs(5))).unwrap();
        write!(tcp, "POST /v1/rooms HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 200000\r\nexpect: 100-continue\r\n\r\n").unwrap();
        let mut resp = vec![0u8; 4096];
        let n = tcp.read(&mut resp).unwrap();
        let text = String::from_utf8_lossy(&resp[..n]);
        assert!(text.starts_with("HTTP/1.1 413"), "{text}");
        assert!(text.contains("too_large"), "{text}");
    }

    // Participants.
    let add = |id: &str, remote: &str, local: Option<&str>| json!({"id": id, "remote": remote, "local": local});
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(add("alice", "127.79.0.10:5000", Some("127.79.0.1:42000"))));
    assert_eq!((s, v["local"].as_str()), (201, Some("127.79.0.1:42000")));
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(add("bob", "127.79.0.11:5000", None)));
    assert_eq!(s, 201, "{v}");
    assert!(v["local"].as_str().unwrap().starts_with("127.0.0.1:"), "allocated from the media range: {v}");
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(add("bob", "127.79.0.12:5000", None)));
    assert_eq!((s, code(&v)), (409, "exists"));
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(add("carol", "127.79.0.12:5000", Some("127.79.0.1:42000"))));
    assert_eq!((s, code(&v)), (409, "address_in_use"));
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(json!({"id": "carol", "remote": "not-an-address"})));
    assert_eq!((s, code(&v)), (422, "wrong_shape"));
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants", Some(add("carol", "0.0.0.0:5000", None)));
    assert_eq!((s, code(&v)), (400, "invalid"));
    let (s, v) = call(&d, "POST", "/v1/rooms/nope/participants", Some(add("carol", "127.79.0.12:5000", None)));
    assert_eq!((s, code(&v)), (404, "not_found"));
    assert_eq!(call(&d, "GET", "/v1/rooms/conf/participants/alice", None).0, 200);
    assert_eq!(call(&d, "GET", "/v1/rooms/conf/participants/zed", None).0, 404);

    // Streams and subscriptions.
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants/alice/streams", Some(json!({"name": "low", "ssrc": 1})));
    assert_eq!(s, 201, "{v}");
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants/alice/streams", Some(json!({"name": "low"})));
    assert_eq!((s, code(&v)), (409, "exists"));
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants/alice/streams", Some(json!({"name": "dup", "ssrc": 1})));
    assert_eq!((s, code(&v)), (409, "address_in_use"));
    assert_eq!(call(&d, "POST", "/v1/rooms/conf/participants/zed/streams", Some(json!({"name": "x"}))).0, 404);
    let sub = |p: &str, s: &str| json!({"publisher": p, "stream": s});
    assert_eq!(call(&d, "POST", "/v1/rooms/conf/participants/bob/subscriptions", Some(sub("alice", "low"))).0, 201);
    let (s, v) = call(&d, "POST", "/v1/rooms/conf/participants/alice/subscriptions", Some(sub("alice", "low")));
    assert_eq!((s, code(&v)), (400, "invalid"));
    assert_eq!(call(&d, "POST", "/v1/rooms/conf/participants/bob/subscriptions", Some(sub("alice", "nope"))).0, 404);
    let (s, t) = call(&d, "GET", "/v1/table", None);
    assert_eq!(s, 200);
    assert_eq!(t["streams"][0]["copies"][0]["subscriber"], "conf/bob");
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/bob/subscriptions/alice/low", None).0, 200);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/bob/subscriptions/alice/low", None).0, 404);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/alice/streams/low", None).0, 200);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/alice/streams/low", None).0, 404);

    // Relays.
    let relay = json!({"id": "call1", "a": {"remote": "127.79.1.10:7000"}, "b": {"remote": "127.79.1.11:7000", "strict": true}});
    let (s, v) = call(&d, "POST", "/v1/relays", Some(relay.clone()));
    assert_eq!(s, 201, "{v}");
    assert_ne!(v["a"]["local"], v["b"]["local"], "two distinct allocated ports");
    assert_eq!(call(&d, "POST", "/v1/relays", Some(relay)).0, 409);
    assert_eq!(call(&d, "GET", "/v1/relays", None).1["relays"], json!(["call1"]));
    assert_eq!(call(&d, "GET", "/v1/relays/call1", None).0, 200);
    assert_eq!(call(&d, "GET", "/v1/relays/nope", None).0, 404);
    let (s, _) = call(&d, "POST", "/v1/relays", Some(json!({"id": "c2", "a": {}})));
    assert_eq!(s, 422, "missing leg b");

    // Relay batches: all or nothing, the failing item named with its own status and code.
    let batch_relay = |id: &str| json!({"id": id, "a": {"remote": "127.79.1.20:7000"}, "b": {"remote": "127.79.1.21:7000"}});
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({"create": [batch_relay("b1"), batch_relay("b2"), batch_relay("call1")]})));
    assert_eq!((s, code(&v)), (409, "exists"), "{v}");
    assert!(v["error"].as_str().unwrap().starts_with("create[2] (id \"call1\")"), "{v}");
    assert_eq!(call(&d, "GET", "/v1/relays", None).1["relays"], json!(["call1"]), "a failed batch changes nothing");
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({"create": [batch_relay("b1"), batch_relay("b2")]})));
    assert_eq!(s, 200, "{v}");
    assert_eq!(v["created"].as_array().unwrap().len(), 2, "{v}");
    assert!(v["created"][1]["b"]["local"].is_string(), "allocated addresses are returned: {v}");
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({"delete": ["b1", "nope"]})));
    assert_eq!((s, code(&v)), (404, "not_found"), "{v}");
    assert!(v["error"].as_str().unwrap().starts_with("delete[1] (id \"nope\")"), "{v}");
    // Deletes run first, so one batch can replace a relay.
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({"delete": ["b1", "b2"], "create": [batch_relay("b2")]})));
    assert_eq!((s, v["deleted"].clone()), (200, json!(["b1", "b2"])), "{v}");
    assert_eq!(call(&d, "GET", "/v1/relays", None).1["relays"], json!(["b2", "call1"]));
    assert_eq!(call(&d, "DELETE", "/v1/relays/b2", None).0, 200);
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({})));
    assert_eq!((s, code(&v)), (400, "invalid"), "an empty batch: {v}");
    let many: Vec<Value> = (0..10_001).map(|_| json!("x")).collect();
    let (s, v) = call(&d, "POST", "/v1/batch/relays", Some(json!({"delete": many})));
    assert_eq!((s, code(&v)), (400, "invalid"), "more than 10,000 operations: {v}");

    // Stats and metrics.
    let (s, v) = call(&d, "GET", "/v1/stats", None);
    assert_eq!(s, 200);
    assert_eq!(v["dataplane"], "userspace");
    assert!(v["streams"].as_array().unwrap().iter().any(|x| x["label"] == "relay:call1/a"), "{v}");
    let metrics = ureq::get(&format!("{}/metrics", d.api)).call().unwrap().into_string().unwrap();
    assert!(metrics.contains("\nmediaplane_received_packets_total "), "{metrics}");
    assert!(metrics.contains("mediaplane_table_version"), "{metrics}");
    assert!(metrics.contains("mediaplane_build_info{version=\"0.1.0\",dataplane=\"userspace\"} 1"), "{metrics}");
    assert!(metrics.contains("mediaplane_dropped_packets_total{reason=\"source_limited\"} 0"), "{metrics}");
    assert!(!metrics.contains("mediaplane_stream_"), "per-stream series are opt-in: {metrics}");
    assert_eq!(v["total"]["drop_source_limited"], 0, "{v}");
    // Memory the daemon holds (the user-space plane has no BPF maps).
    assert!(v["memory"]["rss_bytes"].as_u64().unwrap() > 1 << 20, "{v}");
    assert_eq!(v["memory"]["bpf_map_bytes"], 0, "{v}");
    assert!(metrics.lines().any(|l| l.starts_with("mediaplane_resident_memory_bytes ") && !l.ends_with(" 0")), "{metrics}");
    // HTTP requests by matched route (the pattern, not the path), method and status.
    assert!(metrics.contains("mediaplane_http_requests_total{method=\"POST\",route=\"/v1/batch/relays\",status=\"400\"} 2"), "{metrics}");
    assert!(metrics.contains("mediaplane_http_requests_total{method=\"GET\",route=\"/v1/relays/{id}\",status=\"200\"}"), "{metrics}");
    // Request ids: the client's is kept, else one is made; either is echoed.
    let r = ureq::get(&format!("{}/health", d.api)).set("x-request-id", "client-id-42").call().unwrap();
    assert_eq!(r.header("x-request-id"), Some("client-id-42"));
    let r = ureq::get(&format!("{}/health", d.api)).call().unwrap();
    assert_eq!(r.header("x-request-id").map(str::len), Some(36), "a UUID");

    // A path parameter that does not decode is a JSON error too.
    for path in ["/v1/rooms/%FF", "/v1/rooms/conf/consumers/%FF", "/v1/relays/%C3"] {
        let (s, v) = call(&d, "GET", path, None);
        assert!(s == 400 && code(&v) == "invalid" && v["error"].as_str().unwrap().contains("UTF-8"), "{path}: {s} {v}");
    }

    // Unknown endpoint and wrong method are JSON errors too.
    let (s, v) = call(&d, "GET", "/v2/nothing", None);
    assert_eq!((s, code(&v)), (404, "not_found"));
    let (s, v) = call(&d, "PUT", "/v1/rooms", Some(json!({})));
    assert_eq!((s, code(&v)), (405, "method_not_allowed"));

    // Deletions.
    assert_eq!(call(&d, "DELETE", "/v1/relays/call1", None).0, 200);
    assert_eq!(call(&d, "DELETE", "/v1/relays/call1", None).0, 404);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/alice", None).0, 200);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf/participants/alice", None).0, 404);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf", None).0, 200);
    assert_eq!(call(&d, "DELETE", "/v1/rooms/conf", None).0, 404);

    assert!(d.alive(), "no input may take the daemon down");
    assert!(d.terminate().success(), "graceful shutdown exits 0");
}

#[test]
fn ctl_prints_results_and_api_errors() {
    let dir = TempDir::new("ctl");
    let d = Daemon::start(&dir.0.join("s.db"), &[]);
    let ctl = |args: &[&str]| std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane")).arg("ctl").arg("--api").arg(&d.api).args(args).output().unwrap();
    let out = ctl(&["room", "create", "r1"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let out = ctl(&["participant", "add", "r1", "p", "--remote", "127.79.2.10:5000"]);
    assert!(out.status.success());
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["id"], "p");
    let out = ctl(&["room", "create", "r1"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("409") && err.contains("already exists"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane")).args(["ctl", "--api", "http://127.0.0.1:1", "health"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot reach"));
}

#[test]
fn bad_config_is_a_clear_startup_error() {
    let dir = TempDir::new("cfg");
    let cfg = dir.0.join("bad.toml");
    std::fs::write(&cfg, "[media]\nport_min = 9\nport_max = 2\n").unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane")).args(["serve", "--config", cfg.to_str().unwrap()]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("port range"));
}

#[test]
fn token_and_limits_are_enforced() {
    let dir = TempDir::new("auth");
    let cfg = dir.0.join("c.toml");
    std::fs::write(&cfg, "[api]\ntoken = \"s3cret\"\n[limits]\nmax_rooms = 1\n").unwrap();
    let d = Daemon::start_with_token(&dir.0.join("s.db"), &["--config", cfg.to_str().unwrap()], "s3cret");
    match ureq::get(&format!("{}/v1/rooms", d.api)).call() {
        Err(ureq::Error::Status(401, r)) => assert_eq!(r.into_json::<Value>().unwrap()["code"], "unauthorized"),
        other => panic!("no token must be a 401: {other:?}"),
    }
    match ureq::get(&format!("{}/v1/rooms", d.api)).set("authorization", "Bearer wrong").call() {
        Err(ureq::Error::Status(401, _)) => {}
        other => panic!("a wrong token must be a 401: {other:?}"),
    }
    // Liveness probes and the API's description answer without credentials; nothing else does.
    let anonymous = |method: &str, path: &str| match ureq::request(method, &format!("{}{path}", d.api)).call() {
        Ok(r) => (r.status(), r.into_string().unwrap()),
        Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap()),
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let (s, body) = anonymous("GET", "/health");
    assert!(s == 200 && body.contains("\"status\":\"ok\""), "{s} {body}");
    assert_eq!(anonymous("HEAD", "/health").0, 200);
    let (s, body) = anonymous("GET", "/openapi.json");
    assert!(s == 200 && body.contains("\"openapi\""), "{s} {body}");
    for (method, path) in
        [("GET", "/metrics"), ("GET", "/v1/stats"), ("POST", "/v1/rooms"), ("DELETE", "/v1/rooms/x"), ("HEAD", "/v1/rooms"), ("POST", "/health")]
    {
        let (s, body) = anonymous(method, path);
        assert_eq!(s, 401, "{method} {path} without the token: {body}");
        if method != "HEAD" {
            assert_documented_text(method, path, s, &body);
        }
    }
    assert_eq!(call(&d, "POST", "/v1/rooms", Some(json!({"id": "one"}))).0, 201);
    let (s, v) = call(&d, "POST", "/v1/rooms", Some(json!({"id": "two"})));
    assert_eq!((s, code(&v)), (403, "limit"));
    assert!(v["error"].as_str().unwrap().contains("at most 1 rooms"));
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["ctl", "--api", &d.api, "room", "list"])
        .env("MEDIAPLANE_TOKEN", "s3cret")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn a_second_daemon_on_the_same_store_exits_with_a_clear_error() {
    let dir = TempDir::new("store-lock");
    let store = dir.0.join("s.db");
    let mut d = Daemon::start(&store, &[]);
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["serve", "--listen", "127.0.0.1:0", "--store", store.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("database is locked"), "{err}");
    assert!(d.alive(), "the first daemon is untouched");
    assert!(d.terminate().success());
}

#[test]
fn non_loopback_listen_without_token_is_refused() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_mediaplane"))
        .args(["serve", "--listen", "0.0.0.0:0", "--store", "/nonexistent/never-opened.db"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("api.token"));
}

/// WHIP and WHEP as a client meets them: the offer's media type, what a malformed or an
/// unsupported offer gets, the answer and its resource, a restart that drops the browsers'
/// sessions (they cannot be resumed), and the page loading without the token.
#[test]
fn whip_and_whep_answer_offers_and_refuse_what_they_cannot_take() {
    let offer = whip_offer_example();
    let dir = TempDir::new("whip");
    let (cfg, store) = (dir.0.join("c.toml"), dir.0.join("s.db"));
    let mut d = daemon_with_token(&cfg, &store, "s3cret");
    let post = |d: &Daemon, path: &str, ctype: &str, body: &str| -> (u16, String, String) {
        let r = ureq::post(&format!("{}{path}", d.api)).set("authorization", "Bearer s3cret").set("content-type", ctype).send_string(body);
        let (s, location, body) = match r {
            Ok(r) => (r.status(), r.header("location").unwrap_or_default().to_string(), r.into_string().unwrap()),
            Err(ureq::Error::Status(s, r)) => (s, String::new(), r.into_string().unwrap()),
            Err(e) => panic!("{path}: {e}"),
        };
        assert_documented_text("POST", path, s, &body);
        (s, location, body)
    };
    let (s, _, body) = post(&d, "/v1/whip/r", "application/json", &offer);
    assert!(s == 415 && body.contains("unsupported_media_type"), "{s} {body}");
    let (s, _, body) = post(&d, "/v1/whip/r", "application/sdp", "v=0\r\nnot an offer");
    assert!(s == 400 && body.contains("invalid_sdp"), "{s} {body}");
    let (s, _, body) = post(&d, "/v1/whip/r?participant=x&nope=1", "application/sdp", &offer);
    assert!(s == 400 && body.contains("\"invalid\"") && body.contains("nope"), "an unknown query parameter: {s} {body}");
    // A fingerprint that is none is malformed as a missing one is (400); one in a hash the SFU
    // does not compute is a valid offer it cannot take (422).
    let fp = "sha-256 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2:BC:B9:DB:3D:98:14:8D:1A:BB:EA:33:0C:A4:60:A8:8E";
    let no_fp: String = offer.split_inclusive("\r\n").filter(|l| !l.starts_with("a=fingerprint")).collect();
    for (what, bad, want) in [
        ("missing", no_fp, (400, "invalid_sdp")),
        ("malformed", offer.replace(fp, "sha-256 0F:74"), (400, "invalid_sdp")),
        ("not hex", offer.replace(fp, "sha-256 not:hex"), (400, "invalid_sdp")),
        ("in md5", offer.replace(fp, "md5 0F:74:31:25:CB:A2:13:EC:28:6F:6D:2C:61:FF:5D:C2"), (422, "unsupported_sdp")),
    ] {
        let (s, _, body) = post(&d, "/v1/whip/r", "application/sdp", &bad);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!((s, code(&v)), want, "a fingerprint {what}: {body}");
        assert!(v["error"].as_str().unwrap().contains("fingerprint"), "{body}");
    }
    let simulcast = offer.replace("a=ssrc:2222 cname:c\r\n", "a=rid:h send\r\na=simulcast:send h\r\n");
    let (s, _, body) = post(&d, "/v1/whip/r", "application/sdp", &simulcast);
    assert!(s == 422 && body.contains("simulcast") && body.contains("rtp-stream-id"), "without the RID extension: {s} {body}");
    assert_eq!(call(&d, "GET", "/v1/rooms/r", None).0, 404, "a refused offer changes nothing");

    let (s, location, answer) = post(&d, "/v1/whip/r?participant=alice", "application/sdp", &offer);
    assert_eq!((s, location.as_str()), (201, "/v1/rooms/r/participants/alice"), "{answer}");
    assert!(answer.contains("a=ice-lite") && answer.contains("a=setup:passive") && answer.contains("m=video"), "{answer}");
    let (s, _, _) = post(&d, "/v1/whip/r?participant=alice", "application/sdp", &offer);
    assert_eq!(s, 409, "the name is taken");
    // WHEP: what alice publishes; a section offering its formats on other payload types gets
    // them renumbered (its consumers say to which); one offering other encodings cannot.
    let recv = offer.replace("a=sendonly", "a=recvonly").replace("a=ssrc:1111 cname:c\r\n", "").replace("a=ssrc:2222 cname:c\r\n", "");
    let renumbered = recv.replace("SAVPF 111", "SAVPF 109").replace("rtpmap:111", "rtpmap:109").replace("SAVPF 96", "SAVPF 100").replace(":96 ", ":100 ");
    let (s, _, answer) = post(&d, "/v1/whep/r/alice?participant=carol", "application/sdp", &renumbered);
    assert!(s == 201 && answer.contains("a=rtpmap:100 VP8/90000") && answer.contains("a=rtpmap:109 opus/48000/2"), "{s} {answer}");
    let (_, room) = call(&d, "GET", "/v1/rooms/r", None);
    let mut renumbered_to: Vec<u64> =
        room["participants"]["carol"]["subscriptions"].as_array().unwrap().iter().filter_map(|c| c["payload_type"].as_u64()).collect();
    renumbered_to.sort();
    assert_eq!(renumbered_to, [100, 109], "{room}");
    assert_eq!(call(&d, "DELETE", "/v1/rooms/r/participants/carol", None).0, 200);
    let other = recv.replace("VP8/90000", "VP9/90000").replace("opus/48000/2", "G722/8000");
    let (s, _, body) = post(&d, "/v1/whep/r/alice", "application/sdp", &other);
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!((s, code(&v)), (422, "unsupported"), "{body}");
    assert_eq!(v["error"], "the offer cannot receive audio (opus/48000/2 on payload type 111), video (VP8/90000 on payload type 96)", "{body}");
    let (s, location, answer) = post(&d, "/v1/whep/r/alice?participant=bob", "application/sdp", &recv);
    assert_eq!((s, location.as_str()), (201, "/v1/rooms/r/participants/bob"), "{answer}");
    assert!(answer.contains("a=ssrc:2222 cname:alice") && answer.contains("a=sendonly"), "{answer}");
    let (_, room) = call(&d, "GET", "/v1/rooms/r", None);
    assert_eq!(room["participants"]["bob"]["subscriptions"].as_array().map(Vec::len), Some(2), "{room}");
    assert_eq!(room["participants"]["alice"]["remote"], "0.0.0.0:9", "no peer before ICE");
    // No trickle ICE: the SFU is ICE-lite and needs none of the client's candidates.
    let patch = ureq::request("PATCH", &format!("{}/v1/rooms/r/participants/alice", d.api)).set("authorization", "Bearer s3cret").call();
    assert!(matches!(patch, Err(ureq::Error::Status(405, _))), "{patch:?}");
    // The page loads without the token.
    assert_eq!(ureq::get(&format!("{}/", d.api)).call().unwrap().status(), 200);
    // A WebRTC participant's own ceiling: set and shown; refused out of range; lifted.
    let (s, v) = call(&d, "PUT", "/v1/rooms/r/participants/alice", Some(json!({"max_kbps": 600})));
    assert_eq!((s, v["max_kbps"].as_u64()), (200, Some(600)), "{v}");
    assert_eq!(call(&d, "GET", "/v1/rooms/r/participants/alice", None).1["webrtc"]["max_kbps"], 600);
    let (s, v) = call(&d, "PUT", "/v1/rooms/r/participants/alice", Some(json!({"max_kbps": 200_000})));
    assert_eq!((s, code(&v)), (400, "invalid"), "{v}");
    assert_eq!(call(&d, "PUT", "/v1/rooms/r/participants/alice", Some(json!({}))).0, 200);
    assert!(call(&d, "GET", "/v1/rooms/r/participants/alice", None).1["webrtc"].get("max_kbps").is_none(), "lifted");

    // Simulcast as Chromium offers it (RIDs, the extensions naming them, no SSRC): answered
    // with the RIDs, waiting for the layers' first packets; WHEP of it meanwhile says when to
    // try again.
    let rids = "a=extmap:9 urn:ietf:params:rtp-hdrext:sdes:mid\r\na=extmap:10 urn:ietf:params:rtp-hdrext:sdes:rtp-stream-id\r\n\
                a=rid:f send\r\na=rid:h send\r\na=rid:q send\r\na=simulcast:send f;h;q\r\n";
    let simulcast = offer.replace("a=ssrc:2222 cname:c\r\n", rids);
    let (s, _, answer) = post(&d, "/v1/whip/r?participant=carol", "application/sdp", &simulcast);
    assert_eq!(s, 201, "{answer}");
    for line in [
        "a=rid:h recv",
        "a=simulcast:recv f;h;q",
        "a=extmap:10 urn:ietf:params:rtp-hdrext:sdes:rtp-stream-id",
        "a=extmap:9 urn:ietf:params:rtp-hdrext:sdes:mid",
    ] {
        assert!(answer.lines().any(|l| l == line), "{line:?} missing from {answer}");
    }
    let (_, room) = call(&d, "GET", "/v1/rooms/r", None);
    let carol = &room["participants"]["carol"];
    assert_eq!(carol["webrtc"]["pending"][0]["rids"], json!(["q", "h", "f"]), "lowest first by name: {carol}");
    assert!(carol["streams"]["audio"]["ssrc"] == 1111 && carol["streams"].get("video").is_none(), "{carol}");
    let whep =
        ureq::post(&format!("{}/v1/whep/r/carol", d.api)).set("authorization", "Bearer s3cret").set("content-type", "application/sdp").send_string(&recv);
    match whep {
        Err(ureq::Error::Status(503, r)) => {
            assert_eq!(r.header("retry-after"), Some("1"));
            assert_documented_text("POST", "/v1/whep/r/carol", 503, &r.into_string().unwrap());
        }
        other => panic!("WHEP of a publisher still learning its layers: {other:?}"),
    }
    let vp9 = simulcast.replace("VP8/90000", "VP9/90000").replace("H264/90000", "AV1/90000");
    let (s, _, body) = post(&d, "/v1/whip/r?participant=dave", "application/sdp", &vp9);
    assert!(s == 422 && body.contains("keyframes"), "{s} {body}");

    // A restart cannot resume the browsers' sessions: they are gone, the room stays.
    d.terminate();
    let d = Daemon::start_with_token(&store, &["--config", cfg.to_str().unwrap()], "s3cret");
    let (s, room) = call(&d, "GET", "/v1/rooms/r", None);
    assert_eq!((s, room["participants"].as_object().map(|p| p.len())), (200, Some(0)), "{room}");
}

/// A participant keyed at join (SDES): its keys are checked, stored (a restart keeps them), and
/// never shown again; its streams must be RTP.
#[test]
fn sdes_participants_take_keys_that_no_response_shows() {
    use base64::Engine as _;
    let b64 = |n: usize, b: u8| base64::engine::general_purpose::STANDARD.encode(vec![b; n]);
    let dir = TempDir::new("sdes-participant");
    let store = dir.0.join("s.db");
    let mut d = Daemon::start(&store, &[]);
    assert_eq!(call(&d, "POST", "/v1/rooms", Some(json!({"id": "r"}))).0, 201);
    let join =
        |d: &Daemon, id: &str, srtp: Value| call(d, "POST", "/v1/rooms/r/participants", Some(json!({"id": id, "remote": "127.0.0.1:5004", "srtp": srtp})));

    let (s, v) = join(&d, "bad", json!({"suite": "F8_128_HMAC_SHA1_80", "inbound": b64(30, 1), "outbound": b64(30, 2)}));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("suite"), "{v}");
    let (s, v) = join(&d, "bad", json!({"suite": "AES_CM_128_HMAC_SHA1_80", "inbound": "not base64!", "outbound": b64(30, 2)}));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("base64"), "{v}");
    let (s, v) = join(&d, "bad", json!({"suite": "AES_CM_128_HMAC_SHA1_80", "inbound": b64(28, 1), "outbound": b64(30, 2)}));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("30-byte"), "{v}");
    let (s, v) = join(&d, "bad", json!({"suite": "AEAD_AES_128_GCM", "inbound": b64(28, 1)}));
    assert_eq!(s, 422, "both directions need a key (a body of the wrong shape, as everywhere in the API): {v}");
    assert_eq!(call(&d, "GET", "/v1/rooms/r/participants/bad", None).0, 404, "a refused join changes nothing");

    let (s, v) = join(&d, "gw", json!({"suite": "aead_aes_128_gcm", "inbound": b64(28, 0x11), "outbound": b64(28, 0x22)}));
    assert_eq!((s, &v["srtp"]), (201, &json!({"suite": "AEAD_AES_128_GCM"})), "{v}");
    let (s, v) = call(&d, "POST", "/v1/rooms/r/participants/gw/streams", Some(json!({"name": "data", "rtp": false})));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("RTP"), "{v}");
    assert_eq!(call(&d, "POST", "/v1/rooms/r/participants/gw/streams", Some(json!({"name": "audio", "ssrc": 7}))).0, 201);
    // One address, one session per direction: no stream on an address of its own.
    let (s, v) = call(&d, "POST", "/v1/rooms/r/participants/gw/streams", Some(json!({"name": "video", "ssrc": 8, "local": "127.0.0.1:41000"})));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("own address"), "{v}");
    // It receives RTP only: a plain participant's non-RTP stream cannot be subscribed to.
    assert_eq!(call(&d, "POST", "/v1/rooms/r/participants", Some(json!({"id": "plain", "remote": "127.0.0.1:5006"}))).0, 201);
    assert_eq!(call(&d, "POST", "/v1/rooms/r/participants/plain/streams", Some(json!({"name": "data", "rtp": false}))).0, 201);
    let (s, v) = call(&d, "POST", "/v1/rooms/r/participants/gw/subscriptions", Some(json!({"publisher": "plain", "stream": "data"})));
    assert!(s == 400 && v["error"].as_str().unwrap().contains("RTP only"), "{v}");
    // A key as an a=crypto line carries it is taken as well.
    let inline = format!("inline:{}|2^31|1:1", b64(30, 3));
    let (s, v) = join(&d, "sip", json!({"suite": "AES_CM_128_HMAC_SHA1_80", "inbound": inline, "outbound": b64(30, 4)}));
    assert_eq!(s, 201, "{v}");

    let shown = |d: &Daemon| {
        let (_, p) = call(d, "GET", "/v1/rooms/r/participants/gw", None);
        let (_, room) = call(d, "GET", "/v1/rooms/r", None);
        for text in [p.to_string(), room.to_string()] {
            assert!(!text.contains("master") && !text.contains(&b64(28, 0x11)) && !text.contains("17,17"), "a key is shown: {text}");
        }
        p
    };
    let p = shown(&d);
    assert_eq!(p["srtp"], json!({"inbound": {"suite": "AEAD_AES_128_GCM"}, "outbound": {"suite": "AEAD_AES_128_GCM"}}), "{p}");
    d.terminate();
    let d = Daemon::start(&store, &[]);
    assert_eq!(shown(&d)["srtp"], p["srtp"], "stored: the participant still speaks SRTP after a restart");
}

/// Room tokens: issued with the API token, each reaches WHIP and WHEP into its room, reading the
/// room and leaving it, nothing else, until it expires; a changed API token revokes them.
#[test]
fn room_tokens_reach_only_joining_and_leaving_their_room() {
    let offer = whip_offer_example();
    let dir = TempDir::new("room-tokens");
    let (cfg, store) = (dir.0.join("c.toml"), dir.0.join("s.db"));
    let mut d = daemon_with_token(&cfg, &store, "s3cret");
    // (status, body) of a request with `bearer`.
    let with = |d: &Daemon, bearer: &str, method: &str, path: &str, sdp: Option<&str>| -> (u16, String) {
        let req = ureq::request(method, &format!("{}{path}", d.api)).set("authorization", &format!("Bearer {bearer}"));
        let r = match sdp {
            Some(body) => req.set("content-type", "application/sdp").send_string(body),
            None => req.call(),
        };
        let (s, body) = match r {
            Ok(r) => (r.status(), r.into_string().unwrap()),
            Err(ureq::Error::Status(s, r)) => (s, r.into_string().unwrap()),
            Err(e) => panic!("{method} {path}: {e}"),
        };
        assert_documented_text(method, path, s, &body);
        (s, body)
    };

    let (s, v) = call(&d, "POST", "/v1/rooms/r/tokens", Some(json!({"ttl_s": 3600})));
    assert_eq!(s, 201, "{v}");
    let token = v["token"].as_str().unwrap().to_string();
    assert_eq!(v["room"], "r");
    assert_eq!(call(&d, "POST", "/v1/rooms/r/tokens", Some(json!({"ttl_s": 0}))).0, 400);
    let (s, v) = call(&d, "POST", "/v1/rooms/r/tokens", Some(json!({"ttl": 60})));
    assert_eq!((s, code(&v)), (422, "wrong_shape"), "{v}");
    let r = ureq::post(&format!("{}/v1/rooms/r/tokens", d.api)).set("authorization", "Bearer s3cret").send_string("{ttl_s");
    match r {
        Err(ureq::Error::Status(400, resp)) => assert_eq!(resp.into_json::<Value>().unwrap()["code"], "bad_request", "not JSON, as everywhere"),
        other => panic!("a token request that is not JSON: {other:?}"),
    }
    assert_eq!(call(&d, "POST", "/v1/rooms/bad%20id/tokens", None).0, 400);

    // What joining needs: WHIP into r (which creates it), reading r, WHEP from it, leaving.
    let (s, body) = with(&d, &token, "POST", "/v1/whip/r?participant=alice", Some(&offer));
    assert_eq!(s, 201, "{body}");
    let (s, body) = with(&d, &token, "GET", "/v1/rooms/r", None);
    assert!(s == 200 && body.contains("alice"), "{s} {body}");
    // (WHEP with an offer that receives: the example offer sends only.)
    let recv = offer.replace("a=sendonly", "a=recvonly").replace("a=ssrc:1111 cname:c\r\n", "").replace("a=ssrc:2222 cname:c\r\n", "");
    let (s, body) = with(&d, &token, "POST", "/v1/whep/r/alice?participant=bob", Some(&recv));
    assert!(s == 201 && body.contains("a=ssrc:2222 cname:alice"), "WHEP is reached and answered: {s} {body}");
    // Nothing beyond it: other rooms, the rest of the API, issuing tokens.
    assert_eq!(call(&d, "POST", "/v1/rooms", Some(json!({"id": "other"}))).0, 201);
    for (method, path) in [
        ("GET", "/v1/rooms/other"),
        ("POST", "/v1/whip/other"),
        ("GET", "/v1/rooms"),
        ("GET", "/v1/stats"),
        ("GET", "/v1/rooms/r/participants/alice"),
        ("DELETE", "/v1/rooms/r"),
        ("POST", "/v1/rooms/r/tokens"),
    ] {
        let (s, body) = with(&d, &token, method, path, if method == "POST" { Some(&offer) } else { None });
        assert!(s == 403 && body.contains("\"forbidden\"") && body.contains("room token"), "{method} {path}: {s} {body}");
    }
    let (s, _) = with(&d, &token, "DELETE", "/v1/rooms/r/participants/alice", None);
    assert_eq!(s, 200, "leaving");
    // A forged or altered token is no token.
    for forged in [token.replace(":r", ":other"), format!("{token}x"), "mpr1:99999999999:00:r".into()] {
        assert_eq!(with(&d, &forged, "GET", "/v1/rooms/r", None).0, 401, "{forged}");
    }
    // Expiry.
    let (_, v) = call(&d, "POST", "/v1/rooms/r/tokens", Some(json!({"ttl_s": 1})));
    let short = v["token"].as_str().unwrap().to_string();
    std::thread::sleep(std::time::Duration::from_millis(2100));
    let (s, body) = with(&d, &short, "GET", "/v1/rooms/r", None);
    assert!(s == 401 && body.contains("expired"), "{s} {body}");
    // A new API token revokes every room token.
    d.terminate();
    let d = daemon_with_token(&cfg, &store, "rotated");
    assert_eq!(with(&d, &token, "GET", "/v1/rooms/r", None).0, 401);
}

/// The WHIP offer of the OpenAPI description's example.
fn whip_offer_example() -> String {
    let spec: Value = serde_json::from_str(include_str!("../../control/openapi.json")).unwrap();
    spec["paths"]["/v1/whip/{room}"]["post"]["requestBody"]["content"]["application/sdp"]["example"].as_str().unwrap().to_string()
}

/// A daemon whose API token `token` comes from the configuration file `cfg` (written here).
fn daemon_with_token(cfg: &std::path::Path, store: &std::path::Path, token: &str) -> Daemon {
    std::fs::write(cfg, format!("[api]\ntoken = \"{token}\"\n")).unwrap();
    Daemon::start_with_token(store, &["--config", cfg.to_str().unwrap()], token)
}
