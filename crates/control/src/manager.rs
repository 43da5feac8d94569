//! The session manager: the single writer of the model. Every mutation is applied to a copy,
//! compiled, installed in the data plane, persisted, and only then becomes the model; a failure
//! at any step leaves model, data plane and store as they were.
//!
//! A mutation costs what it touches, not the number of sessions: the model and table are
//! persistent maps (O(1) copies), only the rooms and relays a mutation names in its [`Change`]s
//! are recompiled, and the data plane is handed just the keys that changed.
//!
//! One writer at a time (a mutex held across compile, data plane apply and store commit);
//! readers take the last committed [`Snapshot`] without a lock, so a big mutation never makes a
//! read wait.

use crate::config::{Limits, MediaConfig};
use crate::store::{Change, Store, StoreError};
use arc_swap::ArcSwap;
use mediaplane_core::call_quality::{CallQuality, MosTotals, QualitySummary};
use mediaplane_core::model::{ModelError, Relay, Side};
use mediaplane_core::{ForwardingTable, Model};
use mediaplane_dataplane::{Dataplane, DataplaneError, DataplaneStats};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum ManagerError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("data plane refused the update: {0}")]
    Dataplane(#[from] DataplaneError),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("limit reached: at most {max} {what}")]
    Limit { what: &'static str, max: usize },
    #[error("no free port left in {ip} {min}-{max}")]
    NoFreePort { ip: IpAddr, min: u16, max: u16 },
    #[error(transparent)]
    Interface(#[from] crate::config::InterfaceError),
    /// One operation of a batch failed (so the whole batch did): which one, and why.
    #[error("{item}: {source}")]
    BatchItem { item: String, source: Box<ManagerError> },
    /// The request gave up (its deadline passed) before the change began to commit: nothing
    /// of it was applied.
    #[error("abandoned before it was applied")]
    Abandoned,
    /// Something the process needs could not be made (e.g. its DTLS certificate).
    #[error("{0}")]
    Internal(String),
    /// A well-formed request the SFU cannot carry out as asked (e.g. a WHEP offer that can
    /// receive none of the publisher's streams).
    #[error("{0}")]
    Unsupported(String),
    /// What is asked for exists but cannot be given yet (e.g. WHEP of a browser whose
    /// simulcast layers are still being learned): try again in a second.
    #[error("{0}")]
    NotReady(String),
}

/// The fate of one request's mutation, shared by the request (which may give up at its
/// deadline) and the writer (which commits only if the request has not given up). Exactly one
/// of the two wins; the loser learns it from the state.
#[derive(Debug, Default)]
pub struct Ticket(AtomicU8);

const PENDING: u8 = 0;
const COMMITTING: u8 = 1;
const ABANDONED: u8 = 2;

impl Ticket {
    pub fn new() -> Ticket {
        Ticket(AtomicU8::new(PENDING))
    }

    /// The requester gives up: true if nothing was or will be applied, false if the change
    /// was already committing (it then runs to its end).
    pub fn abandon(&self) -> bool {
        match self.0.compare_exchange(PENDING, ABANDONED, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) => true,
            Err(state) => state == ABANDONED,
        }
    }

    pub fn is_abandoned(&self) -> bool {
        self.0.load(Ordering::Acquire) == ABANDONED
    }

    /// The writer reaches the point of no return: false if the requester gave up first.
    fn begin_commit(&self) -> bool {
        self.0.compare_exchange(PENDING, COMMITTING, Ordering::AcqRel, Ordering::Acquire).is_ok()
    }
}

/// What readers see: the model and the table installed with it, swapped whole after each
/// committed mutation. Readers clone an `Arc` and never wait for a writer.
#[derive(Debug)]
pub struct Snapshot {
    pub model: Model,
    pub table: Arc<ForwardingTable>,
}

/// The model's relays by id.
type Relays = imbl::OrdMap<String, Relay>;

pub struct SessionManager {
    /// Held by the one writer for a whole mutation; readers never take it.
    store: Mutex<Store>,
    current: ArcSwap<Snapshot>,
    dataplane: Arc<dyn Dataplane>,
    media: MediaConfig,
    limits: Limits,
    /// RTCP evaluation (round-trip times, MOS) per relay, from the reports its legs relay
    /// ([`DataplaneEvent::Rtcp`](mediaplane_dataplane::DataplaneEvent::Rtcp)), with the uid of
    /// the relay's A leg it belongs to: a relay made again under the same id (a Call-ID deleted
    /// and offered again) starts over. Not stored: a restart starts it over.
    quality: Mutex<HashMap<String, (u32, CallQuality)>>,
    /// Every MOS computed since start, deleted calls' included.
    mos_totals: Mutex<MosTotals>,
    /// ICE-lite and DTLS-SRTP state of the ICE relay legs ([`crate::crypto_legs`]).
    crypto_legs: crate::crypto_legs::CryptoLegs,
    /// The relays the first learning window to close was found in, and when it closes
    /// ([`SessionManager::close_learning`]).
    next_window_close: Mutex<Option<(Relays, Option<u64>)>>,
    /// The RTSP proxy, when it serves (the API's `/v1/rtsp` routes ask it).
    rtsp: std::sync::OnceLock<Arc<dyn crate::rtsp_paths::RtspPaths>>,
    /// Where the DTMF events of relays that report them go ([`SessionManager::report_dtmf_to`]).
    dtmf_reports: std::sync::OnceLock<std::sync::mpsc::SyncSender<DtmfReport>>,
    /// DTMF reports lost to a full (or gone) reporter queue.
    dtmf_reports_lost: std::sync::atomic::AtomicU64,
}

/// An RFC 4733 event a relay's party sent (reported at its end, once), for whoever logs them
/// (NG's DTMF log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DtmfReport {
    pub relay: String,
    /// The leg whose peer sent it.
    pub side: Side,
    pub source: SocketAddr,
    /// 0-9, 10 (*), 11 (#), 12-15 (A-D), or another event code.
    pub code: u8,
    /// RFC 4733's volume field (dB below 0 dBm0).
    pub volume: u8,
    /// How long it lasted, in RTP timestamp units of its payload type's clock rate.
    pub duration: u16,
    /// Its RTP payload type: the signalling names its clock rate (a `telephone-event/48000`
    /// beside opus counts in 48 kHz units, one at 8000 in 8 kHz units).
    pub payload_type: u8,
    /// The leg's clock rate (8000 if unknown): its first codec's, for a reporter that cannot
    /// read the payload type's own.
    pub clock_rate: u32,
    /// When its end arrived, µs since the Unix epoch.
    pub wall_us: u64,
}

impl SessionManager {
    /// Load the stored sessions and install them: after a restart, media flows again.
    pub fn open(mut store: Store, dataplane: Arc<dyn Dataplane>, media: MediaConfig, limits: Limits) -> Result<SessionManager, ManagerError> {
        let mut model = store.load()?;
        // A browser's room session cannot outlive the daemon: its handshake state and keys are
        // not stored, so it could never be keyed again. Its participant goes (the browser
        // re-joins).
        let rooms = model.remove_webrtc_participants();
        if !rooms.is_empty() {
            tracing::info!(rooms = rooms.len(), "WebRTC participants of the last run removed");
            store.save(&model, &rooms.into_iter().map(Change::Room).collect::<Vec<_>>())?;
        }
        let table = Arc::new(compile(&model, 1, &limits));
        dataplane.apply(table.clone())?;
        let crypto_legs = crate::crypto_legs::CryptoLegs::open(&mut store)?;
        crypto_legs.resume(&model);
        Ok(SessionManager {
            store: Mutex::new(store),
            current: ArcSwap::from_pointee(Snapshot { model, table }),
            dataplane,
            media,
            limits,
            quality: Mutex::new(HashMap::new()),
            mos_totals: Mutex::new(MosTotals::default()),
            crypto_legs,
            next_window_close: Mutex::new(None),
            rtsp: std::sync::OnceLock::new(),
            dtmf_reports: std::sync::OnceLock::new(),
            dtmf_reports_lost: std::sync::atomic::AtomicU64::new(0),
        })
    }

    /// The RTSP proxy registers itself (once) when it starts serving.
    pub fn set_rtsp_paths(&self, paths: Arc<dyn crate::rtsp_paths::RtspPaths>) {
        let _ = self.rtsp.set(paths);
    }

    pub fn rtsp_paths(&self) -> Option<&Arc<dyn crate::rtsp_paths::RtspPaths>> {
        self.rtsp.get()
    }

    pub(crate) fn crypto_legs(&self) -> &crate::crypto_legs::CryptoLegs {
        &self.crypto_legs
    }

    pub fn dataplane(&self) -> &Arc<dyn Dataplane> {
        &self.dataplane
    }

    /// The media address and port range new relay legs get their local addresses from.
    pub fn media_config(&self) -> &MediaConfig {
        &self.media
    }

    /// Apply `f` to a copy of the model; install and persist the result, or change nothing.
    pub fn mutate<R>(&self, f: impl FnOnce(&mut Model, &MediaConfig) -> Result<(R, Vec<Change>), ManagerError>) -> Result<R, ManagerError> {
        self.mutate_for(&Ticket::new(), f)
    }

    /// [`Self::mutate`] for a request that may be abandoned: the change commits only if
    /// `ticket` can be moved to committing once it is computed; an abandoned ticket changes
    /// nothing ([`ManagerError::Abandoned`]).
    pub fn mutate_for<R>(
        &self,
        ticket: &Ticket,
        f: impl FnOnce(&mut Model, &MediaConfig) -> Result<(R, Vec<Change>), ManagerError>,
    ) -> Result<R, ManagerError> {
        let mut store = self.store.lock();
        if ticket.is_abandoned() {
            return Err(ManagerError::Abandoned);
        }
        let current = self.current.load_full();
        let mut next = current.model.clone();
        let (out, changes) = f(&mut next, &self.media)?;
        check_limits(&next, &changes, &self.limits)?;
        let mut table = (*current.table).clone();
        let changed = table.update(&current.model, &next, changes.iter().map(Change::owner));
        #[cfg(debug_assertions)]
        if next.rooms.len() + next.relays.len() < 500 {
            let full = compile(&next, table.version, &self.limits);
            debug_assert!(table == full, "a mutation changed a room or relay it did not name in its changes");
        }
        // The point of no return: from here the change is applied unless the data plane or the
        // store refuses it (and then it is rolled back).
        if !ticket.begin_commit() {
            return Err(ManagerError::Abandoned);
        }
        let table = Arc::new(table);
        self.dataplane.apply_changes(table.clone(), &changed)?;
        if let Err(e) = store.save(&next, &changes) {
            // Not persisted, so not accepted: put the previous table back.
            if let Err(e2) = self.dataplane.apply_changes(current.table.clone(), &changed) {
                tracing::error!(error = %e2, "could not restore the previous table after a store failure");
            }
            return Err(e.into());
        }
        self.current.store(Arc::new(Snapshot { model: next, table }));
        Ok(out)
    }

    /// Read the current model and table. Never waits for a mutation in progress: it sees the
    /// state before it until it commits.
    pub fn read<R>(&self, f: impl FnOnce(&Model, &ForwardingTable) -> R) -> R {
        let s = self.current.load();
        f(&s.model, &s.table)
    }

    /// The current model and table, to read (and serialize) at leisure.
    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.current.load_full()
    }

    /// The slow path relayed a packet from `source` to a leg that is learning its source:
    /// follow it if the leg's rules say so ([`Model::latch`]). Nothing is written when nothing
    /// changes (most reports: a straggler, a source after the window).
    pub fn latch(&self, stream: u32, source: SocketAddr) -> Result<bool, ManagerError> {
        if self.read(|m, _| m.demuxed_rtcp_by_uid(stream).is_some()) {
            return self.latch_demuxed_rtcp(stream, source);
        }
        let now = unix_ms();
        let follows = |m: &Model| {
            let (id, side) = m.relay_leg_by_uid(stream).map(|(id, s)| (id.to_string(), s))?;
            m.clone().latch(&id, side, source, now).ok()
        };
        // Most reports change nothing (a straggler, a stranger during the window): decide that
        // on a copy of the snapshot (O(1)), without the writer's lock.
        if self.read(|m, _| follows(m)) != Some(true) {
            return Ok(false);
        }
        self.mutate(|m, _| {
            let Some((id, side)) = m.relay_leg_by_uid(stream).map(|(id, s)| (id.to_string(), s)) else {
                return Ok((false, vec![]));
            };
            let changed = m.latch(&id, side, source, now)?;
            if changed {
                tracing::info!(relay = %id, side = ?side, %source, "following a new source");
            }
            Ok((changed, if changed { vec![Change::Relay(id)] } else { vec![] }))
        })
    }

    /// [`SessionManager::latch`] for the RTCP address of a party that keeps RTCP apart
    /// ([`mediaplane_core::model::DemuxedRtcp`]).
    fn latch_demuxed_rtcp(&self, stream: u32, source: SocketAddr) -> Result<bool, ManagerError> {
        if self.read(|m, _| m.clone().latch_demuxed_rtcp(stream, source).ok()) != Some(true) {
            return Ok(false);
        }
        self.mutate(|m, _| {
            let Some(id) = m.demuxed_rtcp_by_uid(stream).map(|(id, _)| id.to_string()) else {
                return Ok((false, vec![]));
            };
            let changed = m.latch_demuxed_rtcp(stream, source)?;
            if changed {
                tracing::info!(relay = %id, %source, "following a new RTCP source");
            }
            Ok((changed, if changed { vec![Change::Relay(id)] } else { vec![] }))
        })
    }

    /// Lock the source of every relay leg whose learning window has ended. Returns how many
    /// relays changed.
    pub fn close_learning(&self) -> Result<usize, ManagerError> {
        let now = unix_ms();
        if !self.read(|m, _| self.next_window_close(m).is_some_and(|at| now >= at)) {
            return Ok(0);
        }
        self.mutate(|m, _| {
            let ids = m.close_learning(now);
            Ok((ids.len(), ids.into_iter().map(Change::Relay).collect()))
        })
    }

    /// When the first learning window of `m`'s relays ends with a source to lock, found once
    /// per set of relays (a window only opens or latches by a mutation, which makes a new map):
    /// the check runs ten times a second and walked thousands of relays each time.
    fn next_window_close(&self, m: &Model) -> Option<u64> {
        let mut next = self.next_window_close.lock();
        match &*next {
            Some((relays, at)) if relays.ptr_eq(&m.relays) => *at,
            _ => {
                let at = m.relays.values().flat_map(|r| [r.a.window_closes_at(), r.b.window_closes_at()]).flatten().min();
                *next = Some((m.relays.clone(), at));
                at
            }
        }
    }

    pub fn stats(&self) -> DataplaneStats {
        self.dataplane.stats()
    }

    /// Counters of just these streams (see [`Dataplane::stream_counters`]).
    pub fn stream_counters(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, mediaplane_dataplane::Counters> {
        self.dataplane.stream_counters(ids)
    }

    /// Reception quality of just these streams (see [`mediaplane_dataplane::Dataplane::stream_reception`]).
    pub fn stream_reception(&self, ids: &[u32]) -> std::collections::BTreeMap<u32, mediaplane_core::reception::ReceptionReport> {
        self.dataplane.stream_reception(ids)
    }

    /// RTCP that relay leg `stream` relayed from `source`: evaluated with the clock rate of the
    /// media its sender receives (the other leg's), if `source` is the party the leg follows
    /// (a stranger's reports, relayed by a leg that takes any source, are not its party's).
    /// RTCP of anything but a relay leg is ignored.
    pub fn on_rtcp(&self, stream: u32, source: SocketAddr, at_ns: u64, wall_us: u64, packet: &[u8]) {
        let Some((id, generation, clock_rate)) = self.read(|m, _| {
            // A party's RTCP on its RTP leg, or on the RTCP address it keeps apart.
            let (id, side, peer) = match m.relay_leg_by_uid(stream) {
                Some((id, side)) => (id, side, m.relays.get(id)?.leg(side).peer()),
                None => m.demuxed_rtcp_by_uid(stream).map(|(id, d)| (id, d.of, d.peer()))?,
            };
            let relay = m.relays.get(id)?;
            let receives = relay.leg(side.other());
            (peer == Some(source)).then(|| (id.to_string(), relay.a.uid, receives.clock_rate))
        }) else {
            return;
        };
        let mut quality = self.quality.lock();
        let entry = quality.entry(id).or_insert_with(|| (generation, CallQuality::new()));
        if entry.0 != generation {
            *entry = (generation, CallQuality::new());
        }
        let computed = entry.1.on_rtcp(packet, at_ns, wall_us, clock_rate);
        drop(quality);
        if !computed.is_empty() {
            let mut totals = self.mos_totals.lock();
            computed.into_iter().for_each(|mos| totals.add(mos));
        }
    }

    /// Hand the DTMF events of relays with [`Relay::report_dtmf`] to `reports` (once; later
    /// calls are ignored). A full queue loses the report, with a warning.
    pub fn report_dtmf_to(&self, reports: std::sync::mpsc::SyncSender<DtmfReport>) {
        let _ = self.dtmf_reports.set(reports);
    }

    /// An event's end the slow path saw on `stream` from `source`
    /// ([`DataplaneEvent::Dtmf`](mediaplane_dataplane::DataplaneEvent::Dtmf)): reported if the
    /// stream is a relay leg whose peer is `source` and someone takes reports.
    pub fn on_dtmf(&self, stream: u32, source: SocketAddr, payload_type: u8, event: [u8; 4], wall_us: u64) {
        let Some(reports) = self.dtmf_reports.get() else { return };
        let Some((relay, side, clock_rate)) = self.read(|m, _| {
            let (id, side) = m.relay_leg_by_uid(stream)?;
            let relay = m.relays.get(id)?;
            let (leg, receives) = if side == Side::A { (&relay.a, &relay.b) } else { (&relay.b, &relay.a) };
            (relay.report_dtmf && leg.peer() == Some(source)).then(|| (id.to_string(), side, leg.clock_rate.or(receives.clock_rate)))
        }) else {
            return;
        };
        let [code, flags, d0, d1] = event;
        let report = DtmfReport {
            relay,
            side,
            source,
            code,
            volume: flags & 0x3f,
            duration: u16::from_be_bytes([d0, d1]),
            payload_type,
            clock_rate: clock_rate.filter(|r| *r > 0).unwrap_or(8000),
            wall_us,
        };
        if let Err(e) = reports.try_send(report) {
            self.dtmf_reports_lost.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::warn!(stream, %source, error = %e, "DTMF event not reported: the reporter is behind or gone");
        }
    }

    /// DTMF events not reported because the reporter's queue was full or gone
    /// (`mediaplane_dtmf_reports_lost_total`).
    pub fn dtmf_reports_lost(&self) -> u64 {
        self.dtmf_reports_lost.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every MOS computed since start (rtpengine's `statistics` `mos`).
    pub fn mos_totals(&self) -> MosTotals {
        *self.mos_totals.lock()
    }

    /// The MOS summaries (by reporting SSRC) of these relays' RTCP. An SSRC reported on in two
    /// of them (RTCP moved between ports) keeps the summary with more samples.
    pub fn relay_quality(&self, relays: &[String]) -> BTreeMap<u32, QualitySummary> {
        let snapshot = self.snapshot();
        let current = |id: &String, generation: u32| snapshot.model.relays.get(id).is_some_and(|r| r.a.uid == generation);
        let quality = self.quality.lock();
        let mut out: BTreeMap<u32, QualitySummary> = BTreeMap::new();
        for q in relays.iter().filter_map(|id| quality.get(id).filter(|(g, _)| current(id, *g)).map(|(_, q)| q)) {
            for (ssrc, s) in q.summaries() {
                if out.get(&ssrc).is_none_or(|o| o.samples < s.samples) {
                    out.insert(ssrc, s);
                }
            }
        }
        out
    }

    /// Forget the RTCP evaluation of relays that no longer exist (or were made again).
    pub fn prune_quality(&self) {
        let snapshot = self.snapshot();
        self.quality.lock().retain(|id, (generation, _)| snapshot.model.relays.get(id).is_some_and(|r| r.a.uid == *generation));
    }

    /// Forget everything (model, store, data plane tables).
    pub fn reset(&self) -> Result<(), ManagerError> {
        let mut store = self.store.lock();
        let table = Arc::new(compile(&Model::new(), self.current.load().table.version + 1, &self.limits));
        self.dataplane.apply(table.clone())?;
        store.clear()?;
        self.current.store(Arc::new(Snapshot { model: Model::new(), table }));
        self.quality.lock().clear();
        Ok(())
    }
}

/// Now on the wall clock, in milliseconds since the Unix epoch: the time learning windows are
/// kept in (they are stored, and must mean the same after a restart).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// Check the caps on what changed (whole-model counts are O(1); per-room checks only for rooms
/// this mutation touched).
/// The table for `model` with the configured rate limits.
/// The whole table with the configured limits (at start; changes then go through
/// [`ForwardingTable::update`], which keeps both limits).
fn compile(model: &Model, version: u64, limits: &Limits) -> ForwardingTable {
    let mut table = ForwardingTable::compile_with_rate(model, version, limits.stream_rate());
    table.set_source_limit(limits.source_rate());
    table
}

fn check_limits(model: &Model, changes: &[Change], l: &Limits) -> Result<(), ManagerError> {
    let over = |what, max| Err(ManagerError::Limit { what, max });
    if model.rooms.len() > l.max_rooms {
        return over("rooms", l.max_rooms);
    }
    if model.relays.len() > l.max_relays {
        return over("relays", l.max_relays);
    }
    for c in changes {
        let Change::Room(id) = c else { continue };
        let Some(room) = model.rooms.get(id) else { continue };
        if room.participants.len() > l.max_participants_per_room {
            return over("participants per room", l.max_participants_per_room);
        }
        let mut subscribers: std::collections::HashMap<&mediaplane_core::model::StreamRef, usize> = Default::default();
        for p in room.participants.values() {
            // A browser's simulcast sections still learning their layers count already: when
            // they become streams, nothing may refuse them.
            let pending = p.webrtc.as_ref().map_or(0, |w| w.pending.len());
            if p.streams.len() + pending > l.max_streams_per_participant {
                return over("streams per participant", l.max_streams_per_participant);
            }
            for s in p.subscriptions.keys() {
                let n = subscribers.entry(s).or_default();
                *n += 1;
                if *n > l.max_subscribers_per_stream {
                    return over("subscribers per stream", l.max_subscribers_per_stream);
                }
            }
        }
    }
    Ok(())
}

/// A free local address on `media.ip`: an even port whose odd neighbour (RTCP) is free too.
/// Addresses in `exclude` are taken too (reserved earlier in the same request). The search
/// resumes after the last port claimed and wraps around, so allocating is O(1) amortised
/// however many ports are in use.
pub fn allocate_local(model: &Model, media: &MediaConfig, exclude: &[SocketAddr]) -> Result<SocketAddr, ManagerError> {
    allocate_on(model, media, media.ip, exclude)
}

/// [`allocate_local`] on address `ip` (a relay interface's), in the same port range.
pub fn allocate_on(model: &Model, media: &MediaConfig, ip: IpAddr, exclude: &[SocketAddr]) -> Result<SocketAddr, ManagerError> {
    let first = media.port_min as u32 + (media.port_min % 2) as u32;
    let last = media.port_max as u32; // the RTCP port must stay <= port_max
    if first < last {
        let hint = model.last_claimed_port() as u32 + 1;
        let hint = hint + (hint % 2);
        let start = if (first..last).contains(&hint) { hint } else { first };
        let free = |a: &SocketAddr| model.owner_of(a).is_none() && !exclude.contains(a);
        for port in (start..last).step_by(2).chain((first..start).step_by(2)) {
            let rtp = SocketAddr::new(ip, port as u16);
            let rtcp = SocketAddr::new(ip, port as u16 + 1);
            if free(&rtp) && free(&rtcp) {
                return Ok(rtp);
            }
        }
    }
    Err(ManagerError::NoFreePort { ip, min: media.port_min, max: media.port_max })
}

/// The relay side named in an API path.
pub fn parse_side(s: &str) -> Option<Side> {
    match s {
        "a" => Some(Side::A),
        "b" => Some(Side::B),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mediaplane_dataplane::{UserspaceConfig, UserspaceDataplane};

    fn media() -> MediaConfig {
        MediaConfig { ip: "127.78.0.1".parse().unwrap(), port_min: 40001, port_max: 40006, ..Default::default() }
    }

    #[test]
    fn allocation_skips_used_ports_and_runs_out_cleanly() {
        let mut m = Model::new();
        m.create_room("r").unwrap();
        let a1 = allocate_local(&m, &media(), &[]).unwrap();
        assert_eq!(a1.port(), 40002, "even port");
        m.add_participant("r", "x", a1, "127.78.1.1:5000".parse().unwrap()).unwrap();
        let a2 = allocate_local(&m, &media(), &[]).unwrap();
        assert_eq!(a2.port(), 40004);
        m.add_participant("r", "y", a2, "127.78.1.2:5000".parse().unwrap()).unwrap();
        assert!(matches!(allocate_local(&m, &media(), &[]), Err(ManagerError::NoFreePort { .. })));
        // A freed port is found again after the search wraps around.
        m.remove_participant("r", "x").unwrap();
        assert_eq!(allocate_local(&m, &media(), &[]).unwrap().port(), 40002);
        assert_eq!(
            allocate_local(&m, &media(), &[a1, SocketAddr::new(a1.ip(), 40003)]).map_err(|e| e.to_string()).unwrap_err(),
            "no free port left in 127.78.0.1 40001-40006"
        );
    }

    /// A learning window is locked once it ends, also one opened after the check last looked
    /// (the first window to end is found once per set of relays, not on every check).
    #[test]
    fn learning_windows_close_when_due_however_the_relays_changed() {
        use mediaplane_core::model::LegSpec;
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), Limits::default()).unwrap();
        let leg = |local: &str, remote: &str| LegSpec {
            local: local.parse().unwrap(),
            remote: Some(remote.parse().unwrap()),
            strict: false,
            rtp: true,
            follow: Default::default(),
        };
        let relay = |id: &str, ports: (u16, u16), window_ms: u64| {
            mgr.mutate(|m, _| {
                m.create_relay(id, leg(&format!("127.78.0.1:{}", ports.0), "127.78.2.1:6000"), leg(&format!("127.78.0.1:{}", ports.1), "127.78.2.2:7000"))?;
                let now = unix_ms();
                m.open_learning(id, Side::A, now + window_ms)?;
                m.latch(id, Side::A, "127.78.2.9:6000".parse().unwrap(), now)?;
                Ok(((), vec![Change::Relay(id.into())]))
            })
            .unwrap()
        };
        let open = |id: &str| mgr.read(|m, _| m.relays[id].a.learning.open);
        relay("far", (40002, 40004), 60_000);
        assert_eq!(mgr.close_learning().unwrap(), 0);
        // A window that ends before the one the last check found.
        relay("near", (40006, 40001), 50);
        assert_eq!(mgr.close_learning().unwrap(), 0);
        std::thread::sleep(std::time::Duration::from_millis(80));
        assert_eq!(mgr.close_learning().unwrap(), 1, "the near window ended");
        assert!(!open("near") && open("far"));
    }

    /// A DTMF event the reporter's full queue cannot take is lost, and counted.
    #[test]
    fn dtmf_reports_a_full_queue_cannot_take_are_counted_lost() {
        use mediaplane_core::model::LegSpec;
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), Limits::default()).unwrap();
        let leg = |local: &str, remote: &str| LegSpec {
            local: local.parse().unwrap(),
            remote: Some(remote.parse().unwrap()),
            strict: false,
            rtp: true,
            follow: Default::default(),
        };
        mgr.mutate(|m, _| {
            m.create_relay("call", leg("127.78.0.1:40002", "127.78.2.1:6000"), leg("127.78.0.1:40004", "127.78.2.2:7000"))?;
            m.set_report_dtmf("call", true)?;
            Ok(((), vec![Change::Relay("call".into())]))
        })
        .unwrap();
        let (uid, source) = (mgr.read(|m, _| m.relays["call"].a.uid), "127.78.2.1:6000".parse().unwrap());
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        mgr.report_dtmf_to(tx);
        let end = [5, 0x8a, 3, 0x20];
        mgr.on_dtmf(uid, source, 101, end, 1);
        mgr.on_dtmf(uid, source, 101, end, 2);
        assert_eq!(mgr.dtmf_reports_lost(), 1);
        let r = rx.try_recv().unwrap();
        assert_eq!((r.code, r.duration, r.payload_type, r.wall_us), (5, 800, 101, 1));
        // A stranger's is not reported at all (nor lost).
        mgr.on_dtmf(uid, "127.78.2.9:6000".parse().unwrap(), 101, end, 3);
        assert_eq!((mgr.dtmf_reports_lost(), rx.try_recv().is_err()), (1, true));
    }

    /// RTCP of a relay leg is evaluated only from the address the leg follows, and a relay
    /// made again under the same id starts its evaluation over.
    #[test]
    fn rtcp_is_evaluated_from_the_followed_party_only_and_per_relay_generation() {
        use mediaplane_core::model::LegSpec;
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), Limits::default()).unwrap();
        let (pa, pb): (SocketAddr, SocketAddr) = ("127.78.2.1:6000".parse().unwrap(), "127.78.2.2:7000".parse().unwrap());
        let leg = |local: &str, remote| LegSpec { local: local.parse().unwrap(), remote: Some(remote), strict: false, rtp: true, follow: Default::default() };
        let make = |mgr: &SessionManager| {
            mgr.mutate(|m, _| {
                m.create_relay("call", leg("127.78.0.1:40002", pa), leg("127.78.0.1:40004", pb))?;
                for side in [Side::A, Side::B] {
                    m.set_leg_signal(
                        "call",
                        side,
                        mediaplane_core::LegSignal { remote: Some(if side == Side::A { pa } else { pb }), clock_rate: Some(8000), ..Default::default() },
                    )?;
                }
                Ok(((), vec![Change::Relay("call".into())]))
            })
            .unwrap()
        };
        make(&mgr);
        let uid = |side| mgr.read(|m, _| if side == Side::A { m.relays["call"].a.uid } else { m.relays["call"].b.uid });
        // A's SR, B's report on it after 10 ms; B's SR, A's report on it after 10 ms.
        use mediaplane_core::call_quality::{build_report, ReportBlock};
        let sr = |ssrc: u32, mid: u32| build_report(ssrc, Some(mid), &[]);
        let rr = |ssrc: u32, about: u32, lsr: u32| build_report(ssrc, None, &[ReportBlock { about, jitter: 80, lsr, dlsr: 1, ..Default::default() }]);
        let exchange = |from_b: SocketAddr, t: u64| {
            mgr.on_rtcp(uid(Side::A), pa, t, 0, &sr(0xa, 0x10000));
            mgr.on_rtcp(uid(Side::B), from_b, t + 10_000_000, 0, &rr(0xb, 0xa, 0x10000));
            mgr.on_rtcp(uid(Side::B), from_b, t + 10_000_000, 0, &sr(0xb, 0x20000));
            mgr.on_rtcp(uid(Side::A), pa, t + 20_000_000, 0, &rr(0xa, 0xb, 0x20000));
        };
        let ids = ["call".to_string()];
        exchange("127.78.9.9:7000".parse().unwrap(), 1_000_000_000);
        assert!(mgr.relay_quality(&ids).is_empty(), "a stranger's reports count for nobody");
        exchange(pb, 3_000_000_000);
        let q = mgr.relay_quality(&ids);
        // Each leg: 10 ms less the DLSR of 1/65536 s (15 µs).
        assert_eq!(q.get(&0xa).map(|s| (s.samples, s.lowest.rtt_us)), Some((1, 2 * (10_000 - 15))), "{q:?}");
        assert_eq!(mgr.mos_totals().samples, 1);
        // The call ends and is made again under the same id: nothing of the old one is shown.
        mgr.mutate(|m, _| Ok((m.delete_relay("call").map(|_| ())?, vec![Change::Relay("call".into())]))).unwrap();
        make(&mgr);
        assert!(mgr.relay_quality(&ids).is_empty());
        mgr.prune_quality();
        assert!(mgr.quality.lock().is_empty());
        assert_eq!(mgr.mos_totals().samples, 1, "the totals keep what was computed");
    }

    #[test]
    fn failed_mutation_changes_nothing() {
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let limits = Limits { max_rooms: 2, max_participants_per_room: 1, ..Default::default() };
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), limits).unwrap();
        mgr.mutate(|m, _| Ok((m.create_room("r")?, vec![Change::Room("r".into())]))).unwrap();
        let before = mgr.read(|m, t| (m.clone(), t.version));
        let r: Result<(), _> = mgr.mutate(|m, _| {
            m.create_room("other")?;
            m.create_room("r")?; // fails: exists
            Ok(((), vec![]))
        });
        assert!(matches!(r, Err(ManagerError::Model(ModelError::Exists { .. }))));
        assert_eq!(mgr.read(|m, t| (m.clone(), t.version)), before);
    }

    #[test]
    fn limits_are_clear_errors() {
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let limits = Limits { max_rooms: 1, max_participants_per_room: 1, ..Default::default() };
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), limits).unwrap();
        mgr.mutate(|m, _| Ok((m.create_room("r")?, vec![Change::Room("r".into())]))).unwrap();
        let e = mgr.mutate(|m, _| Ok((m.create_room("s")?, vec![Change::Room("s".into())]))).unwrap_err();
        assert_eq!(e.to_string(), "limit reached: at most 1 rooms");
        let add = |id: &str, port: u16| {
            mgr.mutate(|m, _| {
                m.add_participant("r", id, SocketAddr::new("127.78.0.1".parse().unwrap(), port), "127.78.1.1:5000".parse().unwrap())?;
                Ok(((), vec![Change::Room("r".into())]))
            })
        };
        add("a", 40010).unwrap();
        assert!(matches!(add("b", 40012), Err(ManagerError::Limit { what: "participants per room", max: 1 })));
        assert_eq!(mgr.read(|m, _| m.rooms["r"].participants.len()), 1, "nothing changed");
    }

    /// A browser's simulcast section still learning its layers counts against
    /// `max_streams_per_participant` from the offer on: an offer or a publish beyond the limit
    /// is refused then, so the stream the section becomes once heard is refused by nothing (had
    /// it been let in, every learning mutation would fail on the limit, all rooms' with it).
    #[test]
    fn a_pending_simulcast_section_counts_against_the_stream_limit() {
        use mediaplane_core::model::{PendingSimulcast, StreamIdExtensions, StreamSpec};
        let dp: Arc<dyn Dataplane> = Arc::new(UserspaceDataplane::new(UserspaceConfig { workers: 1, ..Default::default() }, None).unwrap());
        let limits = Limits { max_streams_per_participant: 2, ..Default::default() };
        let mgr = SessionManager::open(Store::in_memory().unwrap(), dp, media(), limits).unwrap();
        let ids = StreamIdExtensions { rid: 10, mid: Some(9) };
        let section = |name: &str, mid: &str| PendingSimulcast {
            name: name.into(),
            mid: mid.into(),
            rids: vec!["q".into(), "h".into()],
            ssrcs: vec![None; 2],
            spec: StreamSpec { clock_rate: Some(90000), codec: Some(mediaplane_core::simulcast::Codec::Vp8), ..Default::default() },
            heard_at_ms: None,
            offered_at_ms: unix_ms(),
        };
        let uid = mgr
            .mutate(|m, _| {
                m.create_room("r")?;
                let uid = m.add_webrtc_participant("r", "w", "127.78.0.1:40020".parse().unwrap())?;
                m.publish("r", "w", "cam", StreamSpec { ssrc: Some(7), ..Default::default() })?;
                Ok((uid, vec![Change::Room("r".into())]))
            })
            .unwrap();
        let pend = |name: &str, mid: &str| {
            let s = section(name, mid);
            mgr.mutate(move |m, _| Ok((m.add_pending_simulcast("r", "w", ids, s)?, vec![Change::Room("r".into())])))
        };
        // One stream and one section learning: 2, at the limit.
        pend("video", "1").unwrap();
        // A second section, or a stream published through the API meanwhile, would make 3.
        assert!(matches!(pend("video-2", "2"), Err(ManagerError::Limit { what: "streams per participant", max: 2 })));
        let publish = mgr.mutate(|m, _| Ok((m.publish("r", "w", "mic", StreamSpec { ssrc: Some(8), ..Default::default() })?, vec![Change::Room("r".into())])));
        assert!(matches!(publish, Err(ManagerError::Limit { what: "streams per participant", max: 2 })), "{publish:?}");
        // Its layers heard: it becomes a stream, within the limit.
        mgr.on_stream_id(uid, 100, Some("1"), "q");
        mgr.on_stream_id(uid, 101, Some("1"), "h");
        let (pending, video) = mgr.read(|m, _| {
            let w = m.participant("r", "w").unwrap();
            (w.webrtc.as_ref().unwrap().pending.len(), w.streams.get("video").map(|s| s.layers.iter().map(|l| l.ssrc).collect::<Vec<_>>()))
        });
        assert_eq!((pending, video), (0, Some(vec![100, 101])), "published with both layers");
    }
}
