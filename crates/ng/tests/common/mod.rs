//! A real relay in-process: SessionManager + user-space data plane + serve_ng on loopback,
//! and a small NG client.
#![allow(dead_code)]

use mediaplane_control::config::{Limits, MediaConfig};
use mediaplane_control::manager::SessionManager;
use mediaplane_control::store::Store;
use mediaplane_dataplane::{Dataplane, DataplaneEvent, UserspaceConfig, UserspaceDataplane};
use mediaplane_ng::bencode::Value;
use mediaplane_ng::{protocol, serve_ng, NgConfig};
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::Duration;

pub struct Relay {
    pub mgr: Arc<SessionManager>,
    pub ng: SocketAddr,
    dp: Arc<UserspaceDataplane>,
    rt: Option<tokio::runtime::Runtime>,
}

impl Relay {
    pub fn start(media_ip: &str, port_min: u16, port_max: u16, media_timeout: Duration) -> Relay {
        let (tx, rx) = std::sync::mpsc::channel::<DataplaneEvent>();
        let dp = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, Some(tx)).unwrap());
        let media = MediaConfig { ip: media_ip.parse().unwrap(), port_min, port_max };
        let mgr = Arc::new(SessionManager::open(Store::in_memory().unwrap(), dp.clone(), media, Limits::default()).unwrap());
        // The slow path's latch events, as `mediaplane serve` wires them.
        let m = mgr.clone();
        std::thread::spawn(move || {
            for DataplaneEvent::Unlatched { stream, source } in rx {
                let _ = m.latch(stream, source);
            }
        });
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        let sock = rt.block_on(tokio::net::UdpSocket::bind("127.0.0.1:0")).unwrap();
        let ng = sock.local_addr().unwrap();
        let cfg = NgConfig { listen: ng, media_timeout, allow: vec!["127.0.0.1".parse().unwrap()] };
        rt.spawn(serve_ng(sock, mgr.clone(), cfg));
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

pub struct Client {
    pub sock: UdpSocket,
    server: SocketAddr,
    n: u32,
}

impl Client {
    pub fn new(server: SocketAddr) -> Client {
        let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
        sock.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        Client { sock, server, n: 0 }
    }

    /// Send raw bytes; the raw reply, if any arrives within the read timeout.
    pub fn raw(&self, datagram: &[u8]) -> Option<Vec<u8>> {
        self.sock.send_to(datagram, self.server).unwrap();
        let mut buf = vec![0u8; 65536];
        match self.sock.recv_from(&mut buf) {
            Ok((n, _)) => Some(buf[..n].to_vec()),
            Err(_) => None,
        }
    }

    /// One command with a fresh cookie: (the request datagram, the reply dictionary).
    pub fn call(&mut self, pairs: Vec<(&str, Value)>) -> (Vec<u8>, Value) {
        self.n += 1;
        let cookie = format!("{}_{}", std::process::id(), self.n);
        let d = protocol::frame(cookie.as_bytes(), &Value::dict(pairs));
        let r = self.raw(&d).expect("NG reply");
        let (c, v) = protocol::parse_frame(&r).unwrap();
        assert_eq!(c, cookie.as_bytes());
        (d, v)
    }

    pub fn cmd(&mut self, pairs: Vec<(&str, Value)>) -> Value {
        self.call(pairs).1
    }
}

pub fn text(v: &Value, k: &str) -> String {
    v.get(k).and_then(Value::as_str).unwrap_or_default().to_string()
}

pub fn list(items: &[&str]) -> Value {
    Value::List(items.iter().map(|s| Value::str(s)).collect())
}
