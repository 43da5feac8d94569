//! A request past `api.timeout_ms` answers 503 `timeout` and says whether its change was
//! applied, and the sessions agree: a change that had begun to commit at the deadline runs to
//! its end (`"applied": true`, with its result); one still waiting is abandoned whole
//! (`"applied": false`). A data plane that takes 300 ms to install makes both cases happen on
//! cue: it wraps the real user-space plane and only adds the delay.

use mediaplane_control::api::router;
use mediaplane_control::config::{ApiConfig, Limits, MediaConfig, MetricsSection};
use mediaplane_control::manager::SessionManager;
use mediaplane_control::metrics::Metrics;
use mediaplane_control::store::Store;
use mediaplane_core::table::IngressKey;
use mediaplane_core::ForwardingTable;
use mediaplane_dataplane::{Dataplane, DataplaneError, DataplaneStats, UserspaceConfig, UserspaceDataplane};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::{Duration, Instant};

const INSTALL_DELAY: Duration = Duration::from_millis(300);
const TIMEOUT_MS: u64 = 100;

struct SlowInstall(UserspaceDataplane);

impl Dataplane for SlowInstall {
    fn name(&self) -> &'static str {
        "slow-userspace"
    }
    fn apply(&self, table: Arc<ForwardingTable>) -> Result<(), DataplaneError> {
        self.0.apply(table)
    }
    fn apply_changes(&self, table: Arc<ForwardingTable>, changed: &[IngressKey]) -> Result<(), DataplaneError> {
        std::thread::sleep(INSTALL_DELAY);
        self.0.apply_changes(table, changed)
    }
    fn stats(&self) -> DataplaneStats {
        self.0.stats()
    }
    fn shutdown(&self) -> Result<(), DataplaneError> {
        self.0.shutdown()
    }
}

/// The real router on a loopback port, its runtime on a thread of its own; the base URL.
fn serve() -> String {
    let dp = UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap();
    let media = MediaConfig { ip: "127.87.0.1".parse().unwrap(), port_min: 40000, port_max: 40999, ..Default::default() };
    let mgr = Arc::new(SessionManager::open(Store::in_memory().unwrap(), Arc::new(SlowInstall(dp)), media, Limits::default()).unwrap());
    let cfg = ApiConfig { timeout_ms: TIMEOUT_MS, ..ApiConfig::default() };
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let metrics = Metrics::new(mgr.clone(), &MetricsSection::default());
            axum::serve(listener, router(mgr, &cfg, metrics)).await.unwrap();
        });
    });
    url
}

fn call(method: &str, url: &str, body: Option<Value>) -> (u16, Value, Duration) {
    let t = Instant::now();
    let req = ureq::request(method, url).timeout(Duration::from_secs(10));
    let r = match body {
        Some(b) => req.send_json(b),
        None => req.call(),
    };
    let took = t.elapsed();
    match r {
        Ok(resp) => (resp.status(), resp.into_json().unwrap(), took),
        Err(ureq::Error::Status(code, resp)) => (code, resp.into_json().unwrap(), took),
        Err(e) => panic!("{method} {url}: {e}"),
    }
}

#[test]
fn a_change_committing_at_the_deadline_is_applied_and_says_so() {
    let url = serve();
    let (status, v, took) = call("POST", &format!("{url}/v1/rooms"), Some(json!({"id": "late"})));
    assert_eq!((status, v["code"].as_str(), v["applied"].as_bool()), (503, Some("timeout"), Some(true)), "{v}");
    assert_eq!(v["result"], json!({"id": "late"}), "the result it would have had");
    assert!(took >= INSTALL_DELAY, "answered when the commit ended ({took:?}), not before");
    assert_eq!(call("GET", &format!("{url}/v1/rooms"), None).1["rooms"], json!(["late"]));
}

#[test]
fn a_change_still_waiting_at_the_deadline_is_abandoned_whole() {
    let url = serve();
    // The first change holds the writer for 300 ms; the second waits behind it past its deadline.
    let first = {
        let url = url.clone();
        std::thread::spawn(move || call("POST", &format!("{url}/v1/rooms"), Some(json!({"id": "first"}))))
    };
    std::thread::sleep(Duration::from_millis(30));
    let (status, v, took) = call("POST", &format!("{url}/v1/rooms"), Some(json!({"id": "second"})));
    assert_eq!((status, v["code"].as_str(), v["applied"].as_bool()), (503, Some("timeout"), Some(false)), "{v}");
    assert!(took < INSTALL_DELAY, "an abandoned change answers at its deadline ({took:?})");
    let (status, v, _) = first.join().unwrap();
    assert_eq!((status, v["applied"].as_bool()), (503, Some(true)), "{v}");
    // After the writer is free the second change still has not happened, and never will.
    std::thread::sleep(INSTALL_DELAY);
    assert_eq!(call("GET", &format!("{url}/v1/rooms"), None).1["rooms"], json!(["first"]));
    // A change in time is applied normally.
    let (status, v, _) = call("GET", &format!("{url}/health"), None);
    assert_eq!((status, v["rooms"].as_u64()), (200, Some(1)), "{v}");
}
