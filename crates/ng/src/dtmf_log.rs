//! The DTMF log: each RFC 4733 event a party of an NG call sends is reported once, at its end,
//! as one JSON object in one UDP datagram, in rtpengine 10.5's format (`--dtmf-log-dest`),
//! which collectors already parse:
//!
//! ```text
//! {"callid":"…","source_tag":"…","tags":["…","…"],"type":"DTMF","timestamp":1796669578,
//!  "source_ip":"10.77.0.2","event":5,"duration":80,"volume":10}
//! ```
//!
//! `timestamp` is Unix seconds at the event's end, `duration` milliseconds (computed as
//! rtpengine does), `event` and `volume` the packet's fields. The data planes find the events
//! (on the eBPF plane the kernel passes up only those packets); the session manager checks their
//! source ([`SessionManager::on_dtmf`]); this names the call and sends.

use crate::calls::{parse_relay_id, Registry};
use crate::Engine;
use mediaplane_control::manager::{DtmfReport, SessionManager};
use mediaplane_core::model::Side;
use parking_lot::Mutex;
use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;

/// Reports waiting to be sent before new ones are lost (with a warning).
const QUEUE: usize = 1024;

/// The JSON line of `r`, or None if its relay is no NG call's (any more).
pub fn line(registry: &Registry, r: &DtmfReport) -> Option<String> {
    let (key, media, _) = parse_relay_id(&r.relay)?;
    let call = registry.by_key(&key)?;
    let source_tag = match r.side {
        Side::A => call.tag_a.as_deref(),
        Side::B => call.tag_b.as_deref(),
    };
    let tags: Vec<&str> = [call.tag_a.as_deref(), call.tag_b.as_deref()].into_iter().flatten().collect();
    let json = |s: &str| serde_json::Value::from(s).to_string();
    // In units of the event's payload type's rate as its sender's SDP maps it (the leg's first
    // codec's may be another: opus at 48 kHz beside telephone-event/8000).
    let formats = call.media.get(media).and_then(|m| m.formats_of[crate::calls::side_index(r.side)].as_ref());
    let clock_rate = formats.and_then(|f| rtpmap_clock_rate(f, r.payload_type)).unwrap_or(r.clock_rate);
    // rtpengine: (duration * (1000000 / clockrate)) / 1000, in integers.
    let duration_ms = u64::from(r.duration) * u64::from(1_000_000 / clock_rate.max(1)) / 1000;
    Some(format!(
        "{{\"callid\":{},\"source_tag\":{},\"tags\":[{}],\"type\":\"DTMF\",\"timestamp\":{},\"source_ip\":\"{}\",\"event\":{},\"duration\":{},\"volume\":{}}}",
        json(&call.call_id),
        json(source_tag.unwrap_or_default()),
        tags.iter().map(|t| json(t)).collect::<Vec<_>>().join(","),
        r.wall_us / 1_000_000,
        r.source.ip(),
        r.code,
        duration_ms,
        r.volume,
    ))
}

/// The clock rate `a=rtpmap:<pt> name/RATE` gives `payload_type`.
fn rtpmap_clock_rate(formats: &crate::sdp::FormatDescription, payload_type: u8) -> Option<u32> {
    let prefix = format!("rtpmap:{payload_type} ");
    let (_, encoding) = formats.attrs.iter().find_map(|a| a.strip_prefix(&prefix))?.split_once('/')?;
    encoding.split('/').next()?.trim().parse().ok().filter(|r| *r > 0)
}

/// Take the manager's DTMF reports and send each to `dest`, from a thread of its own (a report
/// waits for the engine's lock, never the data plane).
pub fn start(dest: SocketAddr, manager: &SessionManager, engine: Arc<Mutex<Engine>>) -> anyhow::Result<()> {
    let bind: SocketAddr = if dest.is_ipv4() { "0.0.0.0:0".parse()? } else { "[::]:0".parse()? };
    let socket = UdpSocket::bind(bind)?;
    socket.connect(dest).map_err(|e| anyhow::anyhow!("DTMF log destination {dest}: {e}"))?;
    let (tx, rx) = std::sync::mpsc::sync_channel::<DtmfReport>(QUEUE);
    manager.report_dtmf_to(tx);
    std::thread::Builder::new().name("mp-dtmf-log".into()).spawn(move || {
        for report in rx {
            let Some(text) = line(engine.lock().registry(), &report) else { continue };
            if let Err(e) = socket.send(text.as_bytes()) {
                tracing::warn!(%dest, error = %e, "DTMF event not sent to the DTMF log");
            }
        }
    })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calls::{rtp_relay_id, Call};
    use std::time::Instant;

    fn report(relay: &str, side: Side, duration: u16, clock_rate: u32) -> DtmfReport {
        DtmfReport {
            relay: relay.into(),
            side,
            source: "10.77.0.2:6000".parse().unwrap(),
            code: 11,
            volume: 7,
            duration,
            payload_type: 101,
            clock_rate,
            wall_us: 1_796_669_578_250_000,
        }
    }

    #[test]
    fn a_report_reads_as_rtpengines_line() {
        let mut registry = Registry::default();
        let mut call = Call::new("abc\"d@host", Instant::now());
        call.tag_a = Some("caller".into());
        call.tag_b = Some("callee".into());
        let relay = rtp_relay_id(&call.key, 0);
        registry.insert(call);
        assert_eq!(
            line(&registry, &report(&relay, Side::B, 640, 8000)).unwrap(),
            r#"{"callid":"abc\"d@host","source_tag":"callee","tags":["caller","callee"],"type":"DTMF","timestamp":1796669578,"source_ip":"10.77.0.2","event":11,"duration":80,"volume":7}"#
        );
        // rtpengine's integer arithmetic at 48 kHz: 1000000 / 48000 = 20 µs per tick.
        let l = line(&registry, &report(&relay, Side::A, 4800, 48_000)).unwrap();
        assert!(l.contains(r#""source_tag":"caller""#) && l.contains(r#""duration":96,"#), "{l}");
        assert_eq!(line(&registry, &report("ng-0000000000000000-0", Side::A, 640, 8000)), None, "no such call");
    }

    /// Chromium's offer: opus at 48 kHz first, telephone-event at 48000 (110) and 8000 (126).
    /// The event's own payload type says which units its duration is in.
    #[test]
    fn the_duration_is_in_the_events_payload_types_clock_rate() {
        let mut registry = Registry::default();
        let mut call = Call::new("webrtc@host", Instant::now());
        call.tag_a = Some("browser".into());
        let mut media = crate::calls::media_between("10.77.0.2:6000".parse().unwrap(), "10.77.0.3:6000".parse().unwrap());
        media.formats_of[0] = Some(crate::sdp::FormatDescription {
            payload_types: vec![111, 110, 126],
            attrs: vec![
                "rtpmap:111 opus/48000/2".into(),
                "fmtp:111 minptime=10".into(),
                "rtpmap:110 telephone-event/48000".into(),
                "rtpmap:126 telephone-event/8000".into(),
            ],
        });
        call.media.push(media);
        let relay = rtp_relay_id(&call.key, 0);
        registry.insert(call);
        let at = |pt: u8, duration: u16| line(&registry, &DtmfReport { payload_type: pt, ..report(&relay, Side::A, duration, 48_000) }).unwrap();
        assert!(at(126, 800).contains(r#""duration":100,"#), "100 ms at 8 kHz: {}", at(126, 800));
        assert!(at(110, 4800).contains(r#""duration":96,"#), "{}", at(110, 4800));
        // A payload type the SDP does not map: the leg's rate.
        assert!(at(100, 4800).contains(r#""duration":96,"#));
    }
}
