//! The RTSP server viewers talk to, and the proxy's state: its paths, each pulled by an
//! [`crate::upstream`] task, and its viewers' sessions.
//!
//! A viewer's SETUP of track `i` adds a participant `v<session>-<i>` to the path's room: local =
//! a fresh even port on `media.ip` (the `server_port` answered), remote = the viewer's address
//! and `client_port`. PLAY subscribes each of its participants to the source of its track, PAUSE
//! unsubscribes, TEARDOWN (or the session timeout) removes them. The copies are the data plane's.

use crate::describe::Presentation;
use crate::message::{decode, Message, Request, Response, MAX_BODY, MAX_HEAD};
use crate::transport::{Lower, TransportSpec};
use crate::{room_of, source_of, STREAM};
use mediaplane_control::config::{MediaConfig, RtspSection};
use mediaplane_control::manager::{allocate_local, ManagerError, SessionManager};
use mediaplane_control::store::Change;
use mediaplane_core::model::{Model, StreamRef};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// How long a DESCRIBE waits for an upstream being (re)connected before answering 503.
const DESCRIBE_WAIT: Duration = Duration::from_secs(3);
/// Viewer sessions one proxy holds (each is up to [`crate::describe::MAX_TRACKS`] participants).
const MAX_SESSIONS: usize = 4096;
/// Concurrent RTSP connections.
const MAX_CONNECTIONS: usize = 4096;
const METHODS: &str = "OPTIONS, DESCRIBE, SETUP, PLAY, PAUSE, TEARDOWN, GET_PARAMETER, SET_PARAMETER";

/// A path while its upstream is pulled: its description and the uid of each track's stream.
#[derive(Debug)]
pub(crate) struct Live {
    pub presentation: Presentation,
    #[allow(dead_code)] // for the path state in the API, next
    pub stream_uids: Vec<u32>,
}

pub(crate) struct PathState {
    pub name: String,
    pub source: url::Url,
    pub live: watch::Sender<Option<Arc<Live>>>,
}

struct ViewerSession {
    path: String,
    /// Track index → its participant id.
    tracks: BTreeMap<usize, String>,
    playing: bool,
    last_seen: Instant,
}

pub struct RtspProxy {
    pub(crate) manager: Arc<SessionManager>,
    pub(crate) paths: BTreeMap<String, Arc<PathState>>,
    sessions: Mutex<HashMap<String, ViewerSession>>,
    timeout: Duration,
    connections: std::sync::atomic::AtomicUsize,
}

/// Serve RTSP on `listener` until the process ends: pull every configured path and answer
/// viewers. Rooms of paths left from an earlier run (their viewers' sessions died with it) are
/// removed first.
pub async fn serve_rtsp(listener: TcpListener, manager: Arc<SessionManager>, cfg: RtspSection) -> anyhow::Result<()> {
    let mut paths = BTreeMap::new();
    for p in &cfg.paths {
        let source = url::Url::parse(&p.source).map_err(|e| anyhow::anyhow!("rtsp path {}: source {:?}: {e}", p.name, p.source))?;
        let (live, _) = watch::channel(None);
        paths.insert(p.name.clone(), Arc::new(PathState { name: p.name.clone(), source, live }));
    }
    let proxy = Arc::new(RtspProxy {
        manager,
        paths,
        sessions: Mutex::new(HashMap::new()),
        timeout: Duration::from_secs(cfg.session_timeout_secs),
        connections: Default::default(),
    });
    let stale = proxy.blocking(|model, _| {
        let rooms: Vec<String> = model.rooms.keys().filter(|r| r.starts_with("rtsp.")).cloned().collect();
        for r in &rooms {
            model.delete_room(r)?;
        }
        Ok(((), rooms.into_iter().map(Change::Room).collect()))
    });
    stale.await?;
    for path in proxy.paths.values() {
        tokio::spawn(crate::upstream::pull(proxy.clone(), path.clone()));
    }
    tokio::spawn(reap(proxy.clone()));
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "RTSP accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        use std::sync::atomic::Ordering::Relaxed;
        if proxy.connections.fetch_add(1, Relaxed) >= MAX_CONNECTIONS {
            proxy.connections.fetch_sub(1, Relaxed);
            tracing::warn!(%peer, "RTSP connection refused: {MAX_CONNECTIONS} open");
            continue;
        }
        let p = proxy.clone();
        tokio::spawn(async move {
            if let Err(e) = p.connection(stream, peer).await {
                tracing::debug!(%peer, error = %e, "RTSP connection ended");
            }
            p.connections.fetch_sub(1, Relaxed);
        });
    }
}

/// Sessions whose viewer stopped talking end after the timeout (their copies stop with them).
async fn reap(proxy: Arc<RtspProxy>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let expired: Vec<String> = {
            let sessions = proxy.sessions.lock();
            sessions.iter().filter(|(_, s)| s.last_seen.elapsed() > proxy.timeout).map(|(id, _)| id.clone()).collect()
        };
        for id in expired {
            tracing::info!(session = %id, "RTSP session timed out");
            if let Err(e) = proxy.end_session(&id).await {
                tracing::warn!(session = %id, error = %e, "removing a timed-out RTSP session failed");
            }
        }
    }
}

impl RtspProxy {
    /// Run a model change on the blocking pool (the manager's writer lock and the data plane's
    /// install are synchronous).
    pub(crate) async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Model, &MediaConfig) -> Result<(R, Vec<Change>), ManagerError> + Send + 'static,
    ) -> Result<R, ManagerError> {
        let m = self.manager.clone();
        tokio::task::spawn_blocking(move || m.mutate(f)).await.unwrap_or_else(|e| Err(ManagerError::Internal(format!("model change task failed: {e}"))))
    }

    /// The participants of playing viewers of `path`, with their track: what a (re)connected
    /// upstream's sources are subscribed to.
    pub(crate) fn playing_viewers(&self, path: &str) -> Vec<(String, usize)> {
        let sessions = self.sessions.lock();
        sessions.values().filter(|s| s.path == path && s.playing).flat_map(|s| s.tracks.iter().map(|(t, pid)| (pid.clone(), *t))).collect()
    }

    async fn connection(&self, mut stream: TcpStream, peer: SocketAddr) -> std::io::Result<()> {
        let _ = stream.set_nodelay(true);
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        let mut chunk = [0u8; 4096];
        loop {
            loop {
                match decode(&buf) {
                    Ok(Some((msg, used))) => {
                        buf.drain(..used);
                        if let Message::Request(req) = msg {
                            let resp = self.handle(&req, peer).await;
                            stream.write_all(&resp.to_bytes()).await?;
                        }
                        // Interleaved frames (a TCP viewer's RTCP) and stray responses: nothing
                        // to do with them yet.
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let mut resp = Response { status: 400, reason: "Bad Request".into(), headers: Default::default(), body: Vec::new() };
                        resp.headers.set("Connection", "close");
                        resp = resp.with_body("text/plain", format!("{e}\n").into_bytes());
                        stream.write_all(&resp.to_bytes()).await?;
                        return Ok(());
                    }
                }
            }
            if buf.len() > MAX_HEAD + MAX_BODY + 4 {
                return Ok(());
            }
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn handle(&self, req: &Request, peer: SocketAddr) -> Response {
        if req.headers.cseq().is_none() {
            return Response::to(req, 400).with_body("text/plain", b"missing CSeq\n".to_vec());
        }
        if let Some(id) = req.headers.session() {
            if let Some(s) = self.sessions.lock().get_mut(id) {
                s.last_seen = Instant::now();
            }
        }
        let result = match req.method.as_str() {
            "OPTIONS" => Ok(Response::to(req, 200).with("Public", METHODS)),
            "DESCRIBE" => self.describe(req).await,
            "SETUP" => self.setup(req, peer).await,
            "PLAY" => self.play(req, true).await,
            "PAUSE" => self.play(req, false).await,
            "TEARDOWN" => self.teardown(req).await,
            "GET_PARAMETER" | "SET_PARAMETER" => match req.headers.session() {
                Some(id) if !self.sessions.lock().contains_key(id) => Err((454, "no such session".into())),
                _ => Ok(Response::to(req, 200)),
            },
            _ => Err((501, format!("{} is not implemented", req.method))),
        };
        match result {
            Ok(r) => r,
            Err((status, why)) => {
                tracing::debug!(method = %req.method, uri = %req.uri, status, why = %why, "RTSP request refused");
                let mut r = Response::to(req, status).with_body("text/plain", format!("{why}\n").into_bytes());
                if status == 405 || status == 501 {
                    r = r.with("Allow", METHODS);
                }
                r
            }
        }
    }

    /// The path and track a request URL names: `rtsp://host/<path>[/trackID=<i>]`.
    fn target(&self, uri: &str) -> Result<(Arc<PathState>, Option<usize>), (u16, String)> {
        let url = url::Url::parse(uri).map_err(|_| (400, format!("bad URL {uri:?}")))?;
        let path = url.path().trim_matches('/');
        let (name, track) = match path.rsplit_once('/') {
            Some((name, last)) if last.starts_with("trackID=") => {
                let i = last["trackID=".len()..].parse::<usize>().map_err(|_| (404, format!("no track {last:?}")))?;
                (name, Some(i))
            }
            _ => (path, None),
        };
        let state = self.paths.get(name).ok_or_else(|| (404, format!("no path {name:?}")))?;
        Ok((state.clone(), track))
    }

    async fn live(&self, path: &PathState) -> Option<Arc<Live>> {
        let mut rx = path.live.subscribe();
        let wait = async { rx.wait_for(|l| l.is_some()).await.ok().and_then(|l| l.clone()) };
        tokio::time::timeout(DESCRIBE_WAIT, wait).await.ok().flatten()
    }

    async fn describe(&self, req: &Request) -> Result<Response, (u16, String)> {
        let (path, track) = self.target(&req.uri)?;
        if track.is_some() {
            return Err((404, "DESCRIBE names a path, not a track".into()));
        }
        let live = self.live(&path).await.ok_or((503, format!("upstream of {} is not available", path.name)))?;
        let origin = self.manager.media_config().ip;
        let sdp = live.presentation.served(origin, session_version());
        let base = format!("{}/", req.uri.trim_end_matches('/'));
        Ok(Response::to(req, 200).with("Content-Base", base).with_body("application/sdp", sdp.into_bytes()))
    }

    async fn setup(&self, req: &Request, peer: SocketAddr) -> Result<Response, (u16, String)> {
        let (path, track) = self.target(&req.uri)?;
        let live = self.live(&path).await.ok_or((503, format!("upstream of {} is not available", path.name)))?;
        let track = match (track, live.presentation.tracks.len()) {
            (Some(t), n) if t < n => t,
            (None, 1) => 0,
            (Some(t), _) => return Err((404, format!("no track {t}"))),
            (None, _) => return Err((459, "SETUP names the path of several tracks: name one (trackID=<i>)".into())),
        };
        let offered = TransportSpec::parse_list(req.headers.get("Transport").unwrap_or(""));
        // UDP unicast to the viewer's own address; TCP interleaved and multicast are not served yet.
        let Some(mut chosen) = offered.into_iter().find(|t| t.lower == Lower::Udp && !t.multicast && t.client_port.is_some()) else {
            return Err((461, "only RTP/AVP over UDP unicast with client_port is served".into()));
        };
        if chosen.destination.as_deref().is_some_and(|d| d.parse::<std::net::IpAddr>().ok() != Some(peer.ip())) {
            // Sending a camera's media to a third address on a viewer's say-so is an amplifier.
            return Err((403, "destination must be the viewer's own address".into()));
        }
        let (rtp_port, _) = chosen.client_port.unwrap_or_default();
        let remote = SocketAddr::new(peer.ip(), rtp_port);
        let (session_id, new) = match req.headers.session() {
            Some(id) => {
                let sessions = self.sessions.lock();
                let s = sessions.get(id).ok_or((454, "no such session".to_string()))?;
                if s.path != path.name {
                    return Err((459, "a session's tracks must belong to one path".into()));
                }
                if s.tracks.contains_key(&track) {
                    return Err((455, format!("track {track} is set up already")));
                }
                (id.to_string(), false)
            }
            None => {
                if self.sessions.lock().len() >= MAX_SESSIONS {
                    return Err((453, format!("{MAX_SESSIONS} sessions open")));
                }
                (session_id(), true)
            }
        };
        let room = room_of(&path.name);
        let pid = format!("v{session_id}-{track}");
        let local = {
            let (room, pid) = (room.clone(), pid.clone());
            self.blocking(move |model, media| {
                ensure_room(model, &room)?;
                let local = allocate_local(model, media, &[])?;
                model.add_participant(&room, &pid, local, remote)?;
                Ok((local, vec![Change::Room(room)]))
            })
        };
        let local = local.await.map_err(|e| (500, e.to_string()))?;
        {
            let mut sessions = self.sessions.lock();
            let s = sessions.entry(session_id.clone()).or_insert_with(|| ViewerSession {
                path: path.name.clone(),
                tracks: BTreeMap::new(),
                playing: false,
                last_seen: Instant::now(),
            });
            s.tracks.insert(track, pid);
        }
        if new {
            tracing::info!(path = %path.name, session = %session_id, viewer = %remote, "RTSP viewer set up");
        }
        chosen.server_port = Some((local.port(), local.port() + 1));
        chosen.interleaved = None;
        Ok(Response::to(req, 200).with("Transport", chosen.to_header()).with("Session", format!("{session_id};timeout={}", self.timeout.as_secs())))
    }

    async fn play(&self, req: &Request, play: bool) -> Result<Response, (u16, String)> {
        let (path, _) = self.target(&req.uri)?;
        let id = req.headers.session().ok_or((454, "PLAY and PAUSE need a Session".to_string()))?.to_string();
        let tracks: Vec<(String, usize)> = {
            let mut sessions = self.sessions.lock();
            let s = sessions.get_mut(&id).filter(|s| s.path == path.name).ok_or((454, "no such session".to_string()))?;
            if s.tracks.is_empty() {
                return Err((455, "no track set up".into()));
            }
            s.playing = play;
            s.tracks.iter().map(|(t, pid)| (pid.clone(), *t)).collect()
        };
        let room = room_of(&path.name);
        let r = self.blocking(move |model, _| {
            if play {
                subscribe_viewers(model, &room, &tracks)?;
            } else {
                for (pid, t) in &tracks {
                    let from = StreamRef { publisher: source_of(*t), stream: STREAM.into() };
                    if model.room(&room)?.participants.get(pid).is_some_and(|p| p.subscriptions.contains_key(&from)) {
                        model.unsubscribe(&room, pid, &from)?;
                    }
                }
            }
            Ok(((), vec![Change::Room(room)]))
        });
        r.await.map_err(|e| (500, e.to_string()))?;
        let mut resp = Response::to(req, 200).with("Session", format!("{id};timeout={}", self.timeout.as_secs()));
        if play {
            resp = resp.with("Range", "npt=0.000-");
        }
        Ok(resp)
    }

    async fn teardown(&self, req: &Request) -> Result<Response, (u16, String)> {
        let id = req.headers.session().ok_or((454, "TEARDOWN needs a Session".to_string()))?.to_string();
        if !self.sessions.lock().contains_key(&id) {
            return Err((454, "no such session".into()));
        }
        self.end_session(&id).await.map_err(|e| (500, e.to_string()))?;
        Ok(Response::to(req, 200))
    }

    async fn end_session(&self, id: &str) -> Result<(), ManagerError> {
        let Some(s) = self.sessions.lock().remove(id) else { return Ok(()) };
        let room = room_of(&s.path);
        tracing::info!(path = %s.path, session = %id, "RTSP session ended");
        self.blocking(move |model, _| {
            for pid in s.tracks.values() {
                if model.room(&room).is_ok_and(|r| r.participants.contains_key(pid)) {
                    model.remove_participant(&room, pid)?;
                }
            }
            Ok(((), vec![Change::Room(room)]))
        })
        .await
    }
}

/// Subscribe each viewer participant to its track's source, where the source is there (an
/// upstream being reconnected subscribes them when it is back).
pub(crate) fn subscribe_viewers(model: &mut Model, room: &str, viewers: &[(String, usize)]) -> Result<(), ManagerError> {
    for (pid, t) in viewers {
        let source = source_of(*t);
        let r = model.room(room)?;
        if r.participants.contains_key(pid) && r.participants.get(&source).is_some_and(|p| p.streams.contains_key(STREAM)) {
            model.subscribe(room, pid, StreamRef { publisher: source, stream: STREAM.into() })?;
        }
    }
    Ok(())
}

pub(crate) fn ensure_room(model: &mut Model, room: &str) -> Result<(), ManagerError> {
    if !model.rooms.contains_key(room) {
        model.create_room(room)?;
    }
    Ok(())
}

/// A session id: 16 hex digits, unguessable (it is the only thing that lets a request act on a
/// session).
fn session_id() -> String {
    let mut b = [0u8; 8];
    getrandom::getrandom(&mut b).expect("the OS random source failed");
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn session_version() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}
