//! The API keeps answering while big changes apply: `/health` and NG pings are served from
//! snapshots on the async runtime while 10,000-relay batches compile, install and commit on the
//! blocking pool. And a change past `api.timeout_ms` answers 503 saying whether it was applied,
//! which the daemon's state then confirms.

mod common;
mod ng_common;

use common::netns::{NetnsServe, API};
use mediaplane_bench::netns::Testbed;
use serde_json::{json, Value};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// 10,000 relays are 20,000 sockets in the user-space plane (one worker): above this machine's
/// 20,000-descriptor hard limit, which the sandbox does not let even root raise. The kernel
/// plane's sessions cost no descriptor, so the test runs there (in a namespace of its own).
const RELAYS: usize = 10_000;
const NG: &str = "127.0.0.1:2223";

/// The two tests one after the other: the other's 10,000-relay batch would share the two cores
/// with the polls being timed.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn batch(prefix: &str, n: usize) -> Value {
    let create: Vec<Value> =
        (0..n).map(|i| json!({"id": format!("{prefix}{i}"), "a": {"remote": "10.99.1.1:7000"}, "b": {"remote": "10.99.2.1:7000"}})).collect();
    json!({"create": create})
}

/// The daemon on the kernel plane in `tb`'s SFU namespace, with room for two batches' streams.
fn start<'t>(tb: &'t Testbed, dir: &common::TempDir, extra_config: &str, extra_args: &[&str]) -> NetnsServe<'t> {
    let cfg = dir.0.join("mediaplane.toml");
    // 20,000 even ports: room for one batch's 20,000 legs (each keeps its odd neighbour for RTCP).
    let media = tb.peers[0].sfu_ip;
    std::fs::write(&cfg, format!("[media]\nip = \"{media}\"\nport_min = 20000\nport_max = 60000\n[dataplane]\nmax_streams = 65536\n{extra_config}")).unwrap();
    let mut args = vec!["--reset", "--config", cfg.to_str().unwrap()];
    args.extend_from_slice(extra_args);
    NetnsServe::start(tb, "ebpf", &dir.0.join("s.db"), &args)
}

/// (status, body) of a POST made from inside the SFU namespace.
fn post(tb: &Testbed, path: &str, body: Value) -> (u16, Value) {
    post_bytes(tb, path, serde_json::to_vec(&body).unwrap())
}

fn post_bytes(tb: &Testbed, path: &str, body: Vec<u8>) -> (u16, Value) {
    let url = format!("http://{API}{path}");
    let req = ureq::post(&url).timeout(Duration::from_secs(120)).set("content-type", "application/json");
    tb.in_ns(&tb.sfu_ns, move || match req.send_bytes(&body) {
        Ok(resp) => (resp.status(), resp.into_json::<Value>().unwrap()),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json::<Value>().unwrap()),
        Err(e) => panic!("POST {path}: transport error {e}"),
    })
    .unwrap()
}

fn relays(serve: &NetnsServe) -> u64 {
    serve.api("GET", "/health", None)["relays"].as_u64().unwrap()
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

#[test]
fn health_and_ng_pings_answer_while_10000_relay_batches_apply() {
    if !mediaplane_bench::require_root("health_and_ng_pings_answer_while_10000_relay_batches_apply") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::star(2).unwrap();
    let dir = common::TempDir::new("api-conc");
    let serve = start(&tb, &dir, "", &["--ng-listen", NG]);
    let busy = AtomicBool::new(true);

    let (batches, mut health, mut pings) = std::thread::scope(|s| {
        // /health every 2 ms on a kept-alive connection, for as long as the batches run.
        let health = s.spawn(|| {
            tb.in_ns(&tb.sfu_ns, || {
                let agent = ureq::AgentBuilder::new().timeout(Duration::from_secs(5)).build();
                let mut took = Vec::new();
                while busy.load(Ordering::Relaxed) && took.len() < 100_000 {
                    let t = Instant::now();
                    let r = agent.get(&format!("http://{API}/health")).call().expect("/health failed during a batch");
                    assert_eq!(r.status(), 200);
                    took.push(t.elapsed());
                    std::thread::sleep(Duration::from_millis(2));
                }
                took
            })
            .unwrap()
        });
        let pings = s.spawn(|| {
            tb.in_ns(&tb.sfu_ns, || {
                let mut ng = ng_common::NgClient::bind("127.0.0.1:0", NG.parse().unwrap(), Duration::from_secs(1), "conc").unwrap();
                let mut took = Vec::new();
                while busy.load(Ordering::Relaxed) && took.len() < 100_000 {
                    let t = Instant::now();
                    let v = ng.request(vec![("command", "ping".into())]).expect("NG ping unanswered during a batch");
                    assert_eq!(ng_common::text(&v, "result"), "pong");
                    took.push(t.elapsed());
                    std::thread::sleep(Duration::from_millis(5));
                }
                took
            })
            .unwrap()
        });
        // Create 10,000, delete them, twice: four big changes.
        let delete = |prefix: &str| json!({"delete": (0..RELAYS).map(|i| format!("{prefix}{i}")).collect::<Vec<_>>()});
        let mut batches = Vec::new();
        for body in [batch("x", RELAYS), delete("x"), batch("y", RELAYS), delete("y")] {
            let t = Instant::now();
            let (status, v) = post(&tb, "/v1/batch/relays", body);
            batches.push(t.elapsed());
            if status != 200 {
                busy.store(false, Ordering::Relaxed);
                panic!("batch failed: {status} {}", v["error"]);
            }
        }
        busy.store(false, Ordering::Relaxed);
        (batches, health.join().expect("health poller"), pings.join().expect("NG pinger"))
    });
    health.sort();
    pings.sort();
    let (p99, max) = (percentile(&health, 0.99), *health.last().unwrap());
    eprintln!(
        "batches took {batches:?}; /health: {} polls, median {:?}, p99 {p99:?}, max {max:?}; NG ping: {} pings, median {:?}, p99 {:?}, max {:?}",
        health.len(),
        percentile(&health, 0.5),
        pings.len(),
        percentile(&pings, 0.5),
        percentile(&pings, 0.99),
        pings.last().unwrap()
    );
    assert!(health.len() >= 50, "too few polls during the batches ({}) to judge", health.len());
    assert!(p99 < Duration::from_millis(10), "/health p99 {p99:?} during batches");
    assert!(max < Duration::from_millis(50), "/health max {max:?} during batches");
    assert!(percentile(&pings, 0.99) < Duration::from_millis(10), "NG ping p99 during batches");
    assert_eq!(relays(&serve), 0);
}

#[test]
fn a_change_past_the_timeout_is_a_503_that_says_whether_it_was_applied() {
    if !mediaplane_bench::require_root("a_change_past_the_timeout_is_a_503_that_says_whether_it_was_applied") {
        return;
    }
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let tb = Testbed::star(2).unwrap();
    let dir = common::TempDir::new("api-timeout");
    // Far below what 10,000 relays take to compile, install and commit.
    let serve = start(&tb, &dir, "[api]\ntimeout_ms = 50\n", &[]);
    let body = serde_json::to_vec(&batch("t", RELAYS)).unwrap();
    let t = Instant::now();
    let (status, v) = post_bytes(&tb, "/v1/batch/relays", body);
    let took = t.elapsed();
    assert_eq!((status, v["code"].as_str()), (503, Some("timeout")), "{}", v["error"]);
    let applied = v["applied"].as_bool().expect("a 503 timeout says whether the change was applied");
    // Whichever it was, the daemon's state agrees, wholly: all 10,000 or none.
    let now = relays(&serve);
    eprintln!("503 after {took:?}, applied: {applied}, relays now {now}");
    if applied {
        assert_eq!(now, RELAYS as u64);
        assert_eq!(v["result"]["created"].as_array().map(Vec::len), Some(RELAYS), "an applied change carries its result");
    } else {
        assert_eq!(now, 0, "{}", v["error"]);
        assert!(took < Duration::from_secs(1), "an abandoned change answers at its deadline, not when the work would end ({took:?})");
    }
    // And the daemon still takes changes.
    let (s, v) = post(&tb, "/v1/relays", json!({"id": "after", "a": {"remote": "10.99.1.1:7000"}, "b": {"remote": "10.99.2.1:7000"}}));
    assert_eq!(s, 201, "{v}");
}
