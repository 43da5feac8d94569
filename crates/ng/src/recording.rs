//! Call recording (`record-call`, `start recording`, `stop recording`): one pcap per call, with
//! a metadata file beside it.
//!
//! The data planes hand every forwarded packet of a recorded relay to the process-wide tap
//! ([`mediaplane_dataplane::record`]; the kernel plane leaves recorded relays to its slow path,
//! which does). One writer thread turns them into pcap records (Ethernet/IP/UDP as the packet
//! arrived at the relay: its source, the relay's address) in `<dir>/<call key>.pcap`, buffered
//! and flushed every 100 ms, so a call costs a write per flush, not per packet. Files are named
//! by the call key (a hash of the Call-ID: any Call-ID gives a safe file name); the Call-ID,
//! tags, media addresses and times are in `<call key>.json`.

use mediaplane_core::packet::{build_frame, FrameSpec};
use mediaplane_dataplane::record::{self, RecordedPacket};
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// How often buffered records reach the files.
const FLUSH_EVERY: Duration = Duration::from_millis(100);
/// Packets that may wait for the writer before the tap drops (and counts) them.
const QUEUE: usize = 65_536;
/// pcap: microsecond timestamps, Ethernet frames.
const PCAP_MAGIC: u32 = 0xa1b2_c3d4;
const LINKTYPE_ETHERNET: u32 = 1;
const SNAPLEN: u32 = 65_535;

/// The recordings of a daemon: where they go, and the writer thread.
pub struct Recordings {
    dir: PathBuf,
    /// Call keys whose files the writer closes at its next flush.
    closing: Arc<Mutex<HashSet<String>>>,
    writer: Option<std::thread::JoinHandle<()>>,
}

impl Recordings {
    /// Start recording into `dir` (created if missing): listen on the data planes' tap and write.
    pub fn start(dir: &Path) -> std::io::Result<Recordings> {
        std::fs::create_dir_all(dir)?;
        let rx = record::listen(QUEUE);
        let closing = Arc::new(Mutex::new(HashSet::new()));
        let writer = {
            let (dir, closing) = (dir.to_path_buf(), closing.clone());
            std::thread::Builder::new().name("mp-recorder".into()).spawn(move || write_loop(&dir, rx, &closing))?
        };
        Ok(Recordings { dir: dir.to_path_buf(), closing, writer: Some(writer) })
    }

    pub fn pcap_path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.pcap"))
    }

    pub fn metadata_path(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.json"))
    }

    /// Write a call's metadata (replacing what was there).
    pub fn write_metadata(&self, key: &str, meta: &serde_json::Value) {
        let path = self.metadata_path(key);
        let tmp = path.with_extension("json.tmp");
        let written = std::fs::write(&tmp, serde_json::to_vec_pretty(meta).unwrap_or_default()).and_then(|()| std::fs::rename(&tmp, &path));
        if let Err(e) = written {
            tracing::warn!(path = %path.display(), error = %e, "recording metadata not written");
        }
    }

    /// The call ended (or its recording stopped): its pcap is flushed and closed.
    pub fn close(&self, key: &str) {
        self.closing.lock().insert(key.to_string());
    }
}

impl Drop for Recordings {
    fn drop(&mut self) {
        record::stop();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
    }
}

/// Unix seconds, for metadata.
pub fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn write_loop(dir: &Path, rx: Receiver<RecordedPacket>, closing: &Mutex<HashSet<String>>) {
    let mut files: HashMap<String, BufWriter<File>> = HashMap::new();
    let mut last_flush = Instant::now();
    loop {
        let ended = match rx.recv_timeout(FLUSH_EVERY) {
            Ok(p) => {
                write_packet(dir, &mut files, &p);
                false
            }
            Err(RecvTimeoutError::Timeout) => false,
            Err(RecvTimeoutError::Disconnected) => true,
        };
        if ended || last_flush.elapsed() >= FLUSH_EVERY {
            for (key, f) in &mut files {
                if let Err(e) = f.flush() {
                    tracing::warn!(key, error = %e, "recording not flushed");
                }
            }
            let done: Vec<String> = closing.lock().drain().collect();
            for key in done {
                files.remove(&key);
            }
            last_flush = Instant::now();
        }
        if ended {
            return;
        }
    }
}

/// The call key of a recorded relay stream's label (`relay:<key>-<n>[-rtcp]/<side>`).
fn call_key(label: &str) -> Option<String> {
    let id = label.strip_prefix("relay:")?.rsplit_once('/')?.0;
    crate::calls::parse_relay_id(id).map(|(key, _, _)| key)
}

fn write_packet(dir: &Path, files: &mut HashMap<String, BufWriter<File>>, p: &RecordedPacket) {
    let Some(key) = call_key(&p.label) else { return };
    if !files.contains_key(&key) {
        match open_pcap(&dir.join(format!("{key}.pcap"))) {
            Ok(f) => {
                files.insert(key.clone(), f);
            }
            Err(e) => {
                tracing::warn!(key, error = %e, "recording file not opened");
                return;
            }
        }
    }
    let f = files.get_mut(&key).expect("inserted above");
    let frame = build_frame(&FrameSpec::new(p.src, p.dst), &p.payload);
    let t = p.at.duration_since(UNIX_EPOCH).unwrap_or_default();
    let len = frame.len() as u32;
    let mut rec = Vec::with_capacity(16 + frame.len());
    for v in [t.as_secs() as u32, t.subsec_micros(), len, len] {
        rec.extend_from_slice(&v.to_le_bytes());
    }
    rec.extend_from_slice(&frame);
    if let Err(e) = f.write_all(&rec) {
        tracing::warn!(key, error = %e, "recording not written");
    }
}

/// Open a call's pcap for appending (a call recorded again after a stop goes on in the same
/// file); a new file starts with the pcap header.
fn open_pcap(path: &Path) -> std::io::Result<BufWriter<File>> {
    let mut f = BufWriter::with_capacity(64 * 1024, std::fs::OpenOptions::new().create(true).append(true).open(path)?);
    if f.get_ref().metadata()?.len() == 0 {
        let mut h = Vec::with_capacity(24);
        h.extend_from_slice(&PCAP_MAGIC.to_le_bytes());
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&4u16.to_le_bytes());
        h.extend_from_slice(&0i32.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&SNAPLEN.to_le_bytes());
        h.extend_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        f.write_all(&h)?;
    }
    Ok(f)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_name_their_call() {
        let key = crate::calls::call_key("a call");
        let id = crate::calls::rtp_relay_id(&key, 1);
        assert_eq!(call_key(&format!("relay:{id}/a")), Some(key.clone()));
        assert_eq!(call_key(&format!("relay:{}/b", crate::calls::rtcp_relay_id(&key, 0))), Some(key));
        assert_eq!(call_key("room/p/s"), None);
    }
}
