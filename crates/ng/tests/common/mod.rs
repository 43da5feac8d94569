//! A real relay in-process: SessionManager + user-space data plane + serve_ng on loopback,
//! and a small NG client.
// Each test binary uses a different part of this module.
#![allow(dead_code, unused_imports)]

use mediaplane_control::config::{Limits, MediaConfig};
use mediaplane_control::manager::SessionManager;
use mediaplane_control::store::Store;
use mediaplane_dataplane::{Dataplane, DataplaneEvent, UserspaceConfig, UserspaceDataplane};
use mediaplane_ng::{serve_ng, NgConfig};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// The relay's `loop-protect` mark.
pub const INSTANCE_ID: &str = "mp-ng-test";

pub struct Relay {
    pub mgr: Arc<SessionManager>,
    pub ng: SocketAddr,
    dp: Arc<UserspaceDataplane>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Relay {
    pub fn start(media_ip: &str, port_min: u16, port_max: u16, media_timeout: Duration) -> Relay {
        Self::start_with(MediaConfig { ip: media_ip.parse().unwrap(), port_min, port_max, ..Default::default() }, media_timeout)
    }

    pub fn start_with(media: MediaConfig, media_timeout: Duration) -> Relay {
        let (tx, rx) = mediaplane_dataplane::event_channel();
        let dp = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, Some(tx)).unwrap());
        let mgr = Arc::new(SessionManager::open(Store::in_memory().unwrap(), dp.clone(), media, Limits::default()).unwrap());
        // The slow path's reports and the learning windows, as `mediaplane serve` runs them.
        mediaplane_control::learn_sources(mgr.clone(), Some(rx)).unwrap();
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let sock = rt.block_on(tokio::net::UdpSocket::bind("127.0.0.1:0")).unwrap();
        let ng = sock.local_addr().unwrap();
        let cfg = NgConfig {
            listen: ng,
            media_timeout,
            allow: vec!["127.0.0.1".parse().unwrap()],
            recording_dir: None,
            dtmf_log_dest: None,
            forward_to: None,
            instance_id: Some(INSTANCE_ID.into()),
        };
        rt.spawn(serve_ng(sock, mgr.clone(), cfg, Default::default()));
        Relay { mgr, ng, dp, rt: Some(rt) }
    }

    pub fn relays(&self) -> usize {
        self.mgr.read(|m, _| m.relays.len())
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_timeout(Duration::from_secs(2));
        }
        let _ = self.dp.shutdown();
    }
}

mod ng_test;
pub use mediaplane_ng::client::{g711_sdp, list, offer_answer, text, NgClient};
pub use ng_test::*;
