//! The RTSP server viewers talk to, and the proxy's state: its paths, each pulled by an
//! [`crate::upstream`] task, and its viewers' sessions.
//!
//! A viewer's SETUP of track `i` adds a participant `v<session>-<i>` to the path's room: local =
//! a fresh even port on `media.ip` (the `server_port` answered), remote = the viewer's address
//! and `client_port`. PLAY subscribes each of its participants to the source of its track, PAUSE
//! unsubscribes, TEARDOWN (or the session timeout) removes them. The copies are the data plane's.

use crate::auth::Verifier;
use crate::describe::Presentation;
use crate::message::{decode, Message, Request, Response, MAX_BODY, MAX_HEAD};
use crate::transport::{Lower, TransportSpec};
use crate::{room_of, source_of, STREAM};
use mediaplane_control::config::{MediaConfig, RtspPath, RtspSection};
use mediaplane_control::manager::{allocate_local, ManagerError, SessionManager};
use mediaplane_control::metrics::{RtspMetrics, RtspSessionEnd};
use mediaplane_control::rtsp_paths::{RtspPathError, RtspPaths};
use mediaplane_control::store::Change;
use mediaplane_core::model::{Model, StreamRef, StreamSpec};
use parking_lot::Mutex;
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};

/// How long a DESCRIBE waits for an upstream being (re)connected before answering 503.
const DESCRIBE_WAIT: Duration = Duration::from_secs(3);
/// Viewer sessions one proxy holds (each is up to [`crate::describe::MAX_TRACKS`] participants).
const MAX_SESSIONS: usize = 4096;
/// Concurrent RTSP connections.
const MAX_CONNECTIONS: usize = 4096;
/// A request must arrive whole within this of its first byte (or the session timeout, if
/// shorter): a client trickling a request holds no connection for longer.
const REQUEST_DEADLINE: Duration = Duration::from_secs(10);
const METHODS: &str = "OPTIONS, DESCRIBE, ANNOUNCE, SETUP, PLAY, PAUSE, RECORD, TEARDOWN, GET_PARAMETER, SET_PARAMETER";

/// A path while its upstream is pulled: its description and the uid of each track's stream.
#[derive(Debug)]
pub(crate) struct Live {
    pub presentation: Presentation,
    #[allow(dead_code)] // for the path state in the API, next
    pub stream_uids: Vec<u32>,
}

pub(crate) struct PathState {
    pub name: String,
    pub config: RtspPath,
    /// `read_users` and `publish_users` split into (name, password).
    read_users: Vec<(String, String)>,
    publish_users: Vec<(String, String)>,
    /// Its pull, aborted when the path is removed.
    pull: Mutex<Option<tokio::task::AbortHandle>>,
    /// The upstream it is pulled from; None: published into (ANNOUNCE, SETUP, RECORD).
    pub source: Option<url::Url>,
    /// A publisher path's description, as the connection that announced it gave it (until that
    /// connection closes, or its session ends).
    announced: Mutex<Option<Announcement>>,
    pub live: watch::Sender<Option<Arc<Live>>>,
    /// Pulled only while watched, released this long after the last viewer left.
    pub on_demand: Option<Duration>,
    /// Bumped by every DESCRIBE and SETUP: what wakes an on-demand path's pull.
    pub demand: watch::Sender<u64>,
    /// Subscribers of its sources other than RTSP viewers (browsers over WHEP), as (participant,
    /// track, payload type) when the upstream was lost: subscribed again when it is back.
    pub kept_subscribers: Mutex<Vec<(String, usize, Option<u8>)>>,
    /// The upstream's packets did not carry the SSRC it named: its sources take any (and are
    /// watched over RTSP only).
    pub ssrc_unreliable: std::sync::atomic::AtomicBool,
}

/// What a publisher's ANNOUNCE said, kept for its SETUPs and RECORD.
struct Announcement {
    connection: u64,
    presentation: Presentation,
}

impl PathState {
    /// The source URL as shown in logs and the API: its password as `***`.
    pub fn config_source(&self) -> String {
        let Some(source) = &self.source else { return self.config.source.clone() };
        let mut shown = source.clone();
        if shown.password().is_some() {
            let _ = shown.set_password(Some("***"));
        }
        shown.to_string()
    }
}

/// A viewer's session, or a publisher's (`publishes`: its tracks are the path's sources).
struct ViewerSession {
    path: String,
    /// Track index → its participant id.
    tracks: BTreeMap<usize, String>,
    /// A publisher's: track index → its stream's uid.
    streams: BTreeMap<usize, u32>,
    publishes: bool,
    /// Playing (a viewer), or recording (a publisher).
    playing: bool,
    last_seen: Instant,
    /// Interleaved on this connection (RTP over RTSP's TCP): the session ends with it.
    connection: Option<u64>,
    /// The connection that set it up: not closed for idling while the session lasts.
    origin: u64,
    /// The address that set it up (`rtsp.max_sessions_per_client` counts by it).
    client: std::net::IpAddr,
    /// An interleaved publisher's channels on its connection, taken out when it ends.
    inbound: Option<(InboundChannels, Vec<u8>)>,
    /// The tasks that carry its tracks' copies onto that connection, or take its receiver
    /// reports.
    relays: Vec<tokio::task::AbortHandle>,
    /// Track index → where the camera's RTCP for it goes.
    rtcp: BTreeMap<usize, RtcpSink>,
}

/// Where a viewer's track gets the camera's RTCP (its sender reports: what players synchronise
/// audio and video with). RTCP is forwarded unchanged, as the media is: same SSRCs, same clock.
enum RtcpSink {
    /// From the odd port beside its participant's (its `server_port`'s second) to its
    /// `client_port`'s second.
    Udp { socket: Arc<tokio::net::UdpSocket>, to: SocketAddr },
    /// Interleaved on its connection, on the channel after its RTP's.
    Interleaved { out: mpsc::Sender<Vec<u8>>, channel: u8 },
}

impl ViewerSession {
    fn new(path: &str, publishes: bool, connection: Option<u64>, origin: u64, client: std::net::IpAddr) -> ViewerSession {
        ViewerSession {
            path: path.to_string(),
            tracks: BTreeMap::new(),
            streams: BTreeMap::new(),
            publishes,
            playing: false,
            last_seen: Instant::now(),
            connection,
            origin,
            client,
            inbound: None,
            relays: Vec::new(),
            rtcp: BTreeMap::new(),
        }
    }
}

impl Drop for ViewerSession {
    fn drop(&mut self) {
        for r in &self.relays {
            r.abort();
        }
        if let Some((map, channels)) = &self.inbound {
            let mut map = map.lock();
            for c in channels {
                map.remove(c);
            }
        }
    }
}

/// What one RTSP connection's handler needs besides the request: where its writes go (in
/// order: answers, then interleaved media) and its id.
struct Connection {
    id: u64,
    /// The viewer's address (an IPv4 one as such, even on a dual-stack listener).
    peer: SocketAddr,
    out: mpsc::Sender<Vec<u8>>,
    /// What an interleaved publisher's frames on each channel are (its session takes its
    /// channels out when it ends).
    inbound: InboundChannels,
}

type InboundChannels = Arc<Mutex<HashMap<u8, Inbound>>>;

/// A channel of an interleaved publisher (RTP over its RTSP connection).
enum Inbound {
    /// A track's RTP: handed to the data plane at `to` (its source's address) from `socket`,
    /// the address the source was declared with, so the source check holds.
    Rtp { socket: Arc<std::net::UdpSocket>, to: SocketAddr },
    /// A track's RTCP (its sender reports): on to the track's viewers.
    Rtcp { path: String, track: usize },
}

/// Frames queued for one TCP connection. A viewer that reads slower than its media arrives
/// fills it, and its media is dropped (counted) instead of stalling anyone else.
const TCP_QUEUE: usize = 512;
const TCP_SEND_BUFFER: usize = 256 * 1024;

pub struct RtspProxy {
    pub(crate) manager: Arc<SessionManager>,
    pub(crate) paths: Mutex<BTreeMap<String, Arc<PathState>>>,
    sessions: Mutex<HashMap<String, ViewerSession>>,
    timeout: Duration,
    connections: std::sync::atomic::AtomicUsize,
    /// Connections held per client address, at most `max_per_client` each.
    per_client: Mutex<HashMap<std::net::IpAddr, usize>>,
    max_per_client: usize,
    /// Sessions one client address may hold (`rtsp.max_sessions_per_client`).
    max_sessions_per_client: usize,
    next_connection: std::sync::atomic::AtomicU64,
    pub(crate) metrics: RtspMetrics,
    /// Where paths added through the API start their pulls (the API calls in from its own tasks).
    runtime: tokio::runtime::Handle,
    me: std::sync::Weak<RtspProxy>,
    verifier: Verifier,
    /// Ports an upstream pull picked and asked its camera to send to, not yet claimed in the
    /// model: no one else is given them meanwhile.
    reserved: Mutex<Vec<SocketAddr>>,
}

/// Ports held in [`RtspProxy::reserved`] until this is dropped.
pub(crate) struct Reservation<'a> {
    proxy: &'a RtspProxy,
    ports: Vec<SocketAddr>,
}

impl Reservation<'_> {
    pub(crate) fn ports(&self) -> &[SocketAddr] {
        &self.ports
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.proxy.reserved.lock().retain(|a| !self.ports.contains(a));
    }
}

/// Serve RTSP on `listener` until the process ends: pull every configured path and answer
/// viewers. Rooms of paths left from an earlier run (their viewers' sessions died with it) are
/// removed first.
pub async fn serve_rtsp(listener: TcpListener, manager: Arc<SessionManager>, cfg: RtspSection, metrics: RtspMetrics) -> anyhow::Result<()> {
    let proxy = Arc::new_cyclic(|me| RtspProxy {
        manager,
        paths: Mutex::new(BTreeMap::new()),
        sessions: Mutex::new(HashMap::new()),
        timeout: Duration::from_secs(cfg.session_timeout_secs),
        connections: Default::default(),
        per_client: Default::default(),
        max_per_client: cfg.max_connections_per_client,
        max_sessions_per_client: cfg.max_sessions_per_client,
        next_connection: Default::default(),
        metrics,
        runtime: tokio::runtime::Handle::current(),
        me: me.clone(),
        verifier: Verifier::new("mediaplane", &session_id()),
        reserved: Mutex::new(Vec::new()),
    });
    let stale = proxy.blocking(|model, _| {
        let rooms: Vec<String> = model.rooms.keys().filter(|r| r.starts_with("rtsp.")).cloned().collect();
        for r in &rooms {
            model.delete_room(r)?;
        }
        Ok(((), rooms.into_iter().map(Change::Room).collect()))
    });
    stale.await?;
    for p in &cfg.paths {
        proxy.start_path(p.clone()).map_err(|e| anyhow::anyhow!("rtsp path {}: {e}", p.name))?;
    }
    proxy.manager.set_rtsp_paths(proxy.clone());
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
        let Some(held) = proxy.admit(peer.ip()) else {
            proxy.metrics.connection_refused();
            continue; // dropped: closed
        };
        let p = proxy.clone();
        tokio::spawn(async move {
            if let Err(e) = p.clone().connection(stream, peer).await {
                tracing::debug!(%peer, error = %e, "RTSP connection ended");
            }
            drop(held);
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
            // A publisher's session ends with its connection (ffmpeg sends no keep-alive).
            sessions.iter().filter(|(_, s)| !s.publishes && s.last_seen.elapsed() > proxy.timeout).map(|(id, _)| id.clone()).collect()
        };
        for id in expired {
            tracing::info!(session = %id, "RTSP session timed out");
            if let Err(e) = proxy.end_session(&id, RtspSessionEnd::Timeout).await {
                tracing::warn!(session = %id, error = %e, "removing a timed-out RTSP session failed");
            }
        }
    }
}

/// A connection counted against the server's and its client's limits until dropped.
struct Admitted {
    proxy: Arc<RtspProxy>,
    client: std::net::IpAddr,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.proxy.connections.fetch_sub(1, std::sync::atomic::Ordering::Relaxed);
        let mut per_client = self.proxy.per_client.lock();
        if let Some(n) = per_client.get_mut(&self.client) {
            *n -= 1;
            if *n == 0 {
                per_client.remove(&self.client);
            }
        }
    }
}

impl RtspProxy {
    /// Count a new connection from `client`, or None when it or the server holds too many.
    fn admit(self: &Arc<Self>, client: std::net::IpAddr) -> Option<Admitted> {
        let client = client.to_canonical();
        let mut per_client = self.per_client.lock();
        let held = per_client.get(&client).copied().unwrap_or(0);
        if held >= self.max_per_client {
            tracing::warn!(%client, "RTSP connection refused: {held} open from this address (rtsp.max_connections_per_client)");
            return None;
        }
        use std::sync::atomic::Ordering::Relaxed;
        if self.connections.fetch_add(1, Relaxed) >= MAX_CONNECTIONS {
            self.connections.fetch_sub(1, Relaxed);
            tracing::warn!(%client, "RTSP connection refused: {MAX_CONNECTIONS} open");
            return None;
        }
        per_client.insert(client, held + 1);
        Some(Admitted { proxy: self.clone(), client })
    }

    /// Serve `config` as a path: pulled from now on, or when first asked for.
    fn start_path(&self, config: RtspPath) -> Result<Arc<PathState>, RtspPathError> {
        config.validate().map_err(RtspPathError::Invalid)?;
        let source = match config.is_published() {
            true => None,
            false => Some(url::Url::parse(&config.source).map_err(|e| RtspPathError::Invalid(format!("the source is not a URL: {e}")))?),
        };
        let mut paths = self.paths.lock();
        if paths.contains_key(&config.name) {
            return Err(RtspPathError::Exists(config.name));
        }
        let (live, _) = watch::channel(None);
        let (demand, _) = watch::channel(0);
        let on_demand = config.on_demand.then(|| Duration::from_secs(config.release_after_secs));
        let name = config.name.clone();
        let split = |users: &[String]| users.iter().filter_map(|u| u.split_once(':')).map(|(n, p)| (n.to_string(), p.to_string())).collect();
        let (read_users, publish_users) = (split(&config.read_users), split(&config.publish_users));
        let path = Arc::new(PathState {
            name: name.clone(),
            config,
            read_users,
            publish_users,
            pull: Mutex::new(None),
            source,
            announced: Mutex::new(None),
            live,
            on_demand,
            demand,
            kept_subscribers: Mutex::new(Vec::new()),
            ssrc_unreliable: Default::default(),
        });
        let me = self.me.upgrade().ok_or_else(|| RtspPathError::Failed("the proxy is shutting down".into()))?;
        if let Some(url) = path.source.clone() {
            let task = self.runtime.spawn(crate::upstream::pull(me, path.clone(), url));
            *path.pull.lock() = Some(task.abort_handle());
        }
        paths.insert(name.clone(), path.clone());
        self.metrics.declare_paths(std::iter::once(name.as_str()));
        Ok(path)
    }

    /// `n` free local addresses, held from everyone else until the reservation is dropped.
    pub(crate) fn reserve(&self, n: usize) -> Result<Reservation<'_>, ManagerError> {
        let media = self.manager.media_config().clone();
        let mut reserved = self.reserved.lock();
        let mut picked: Vec<SocketAddr> = Vec::new();
        self.manager.read(|model, _| {
            for _ in 0..n {
                let exclude: Vec<SocketAddr> = reserved.iter().chain(&picked).copied().collect();
                picked.push(allocate_local(model, &media, &exclude)?);
            }
            Ok::<_, ManagerError>(())
        })?;
        reserved.extend(&picked);
        Ok(Reservation { proxy: self, ports: picked })
    }

    pub(crate) fn me(&self) -> std::sync::Weak<RtspProxy> {
        self.me.clone()
    }

    /// A path's state as the API shows it.
    fn describe_path(&self, path: &PathState) -> serde_json::Value {
        let live = path.live.borrow().clone();
        let tracks: Vec<serde_json::Value> = match &live {
            None => Vec::new(),
            Some(l) => {
                let counters = self.manager.stream_counters(&l.stream_uids);
                l.presentation
                    .tracks
                    .iter()
                    .zip(&l.stream_uids)
                    .map(|(t, uid)| {
                        let c = counters.get(uid).cloned().unwrap_or_default();
                        serde_json::json!({"kind": t.kind, "clock_rate": t.clock_rate, "stream": uid, "rx_packets": c.rx_packets, "rx_bytes": c.rx_bytes, "copies": c.tx_copies})
                    })
                    .collect()
            }
        };
        serde_json::json!({
            "name": path.name,
            "source": path.config_source(),
            "on_demand": path.config.on_demand,
            "release_after_secs": path.config.release_after_secs,
            "read_users": path.read_users.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            "publish_users": path.publish_users.iter().map(|(n, _)| n.as_str()).collect::<Vec<_>>(),
            "room": room_of(&path.name),
            "upstream": {"playing": live.is_some(), "tracks": tracks},
            "viewers": self.viewers_of(&path.name),
        })
    }

    /// Run a model change on the blocking pool (the manager's writer lock and the data plane's
    /// install are synchronous).
    pub(crate) async fn blocking<R: Send + 'static>(
        &self,
        f: impl FnOnce(&mut Model, &MediaConfig) -> Result<(R, Vec<Change>), ManagerError> + Send + 'static,
    ) -> Result<R, ManagerError> {
        let m = self.manager.clone();
        tokio::task::spawn_blocking(move || m.mutate(f)).await.unwrap_or_else(|e| Err(ManagerError::Internal(format!("model change task failed: {e}"))))
    }

    /// Viewer sessions of `path`.
    pub(crate) fn viewers_of(&self, path: &str) -> usize {
        self.sessions.lock().values().filter(|s| s.path == path && !s.publishes).count()
    }

    /// The participants of every viewer session of `path`.
    pub(crate) fn viewer_participants(&self, path: &str) -> std::collections::HashSet<String> {
        let sessions = self.sessions.lock();
        sessions.values().filter(|s| s.path == path).flat_map(|s| s.tracks.values().cloned()).collect()
    }

    /// The participants of playing viewers of `path`, with their track: what a (re)connected
    /// upstream's sources are subscribed to.
    pub(crate) fn playing_viewers(&self, path: &str) -> Vec<(String, usize)> {
        let sessions = self.sessions.lock();
        sessions.values().filter(|s| s.path == path && s.playing && !s.publishes).flat_map(|s| s.tracks.iter().map(|(t, pid)| (pid.clone(), *t))).collect()
    }

    async fn connection(self: Arc<Self>, stream: TcpStream, peer: SocketAddr) -> std::io::Result<()> {
        let _ = stream.set_nodelay(true);
        // A peer gone without a FIN (a NAT that dropped the connection, a crashed encoder) is
        // found within about a minute: a publisher's session ends with its connection.
        let keepalive = socket2::TcpKeepalive::new().with_time(Duration::from_secs(30)).with_interval(Duration::from_secs(10)).with_retries(3);
        let _ = socket2::SockRef::from(&stream).set_tcp_keepalive(&keepalive);
        // What the kernel holds for a viewer that stopped reading is bounded too (autotuning
        // would let it grow to megabytes per connection); enough for 16 Mbit/s at 100 ms.
        let _ = socket2::SockRef::from(&stream).set_send_buffer_size(TCP_SEND_BUFFER);
        let (mut rd, mut wr) = stream.into_split();
        let (out, mut queued) = mpsc::channel::<Vec<u8>>(TCP_QUEUE);
        let writer = tokio::spawn(async move {
            while let Some(bytes) = queued.recv().await {
                if wr.write_all(&bytes).await.is_err() {
                    return;
                }
            }
        });
        let peer = SocketAddr::new(peer.ip().to_canonical(), peer.port());
        let conn = Connection { id: self.next_connection.fetch_add(1, std::sync::atomic::Ordering::Relaxed), peer, out, inbound: Default::default() };
        let result = self.read_requests(&mut rd, &conn).await;
        // Interleaved sessions end with their connection (RFC 2326 §10.12); UDP ones time out.
        let mine: Vec<String> = self.sessions.lock().iter().filter(|(_, s)| s.connection == Some(conn.id)).map(|(id, _)| id.clone()).collect();
        for id in mine {
            if let Err(e) = self.end_session(&id, RtspSessionEnd::ConnectionClosed).await {
                tracing::warn!(session = %id, error = %e, "removing an interleaved session failed");
            }
        }
        // An announcement not followed by a session is forgotten with its connection.
        for path in self.paths.lock().values() {
            let mut announced = path.announced.lock();
            if announced.as_ref().is_some_and(|a| a.connection == conn.id) {
                *announced = None;
            }
        }
        drop(conn);
        let _ = writer.await;
        result
    }

    async fn read_requests(self: &Arc<Self>, rd: &mut tokio::net::tcp::OwnedReadHalf, conn: &Connection) -> std::io::Result<()> {
        let mut buf: Vec<u8> = Vec::with_capacity(4096);
        let mut chunk = [0u8; 4096];
        let closed = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "writer gone");
        // When the bytes of the message under way began to come (None: none under way).
        let mut request_started: Option<Instant> = None;
        loop {
            loop {
                match decode(&buf) {
                    Ok(Some((msg, used))) => {
                        buf.drain(..used);
                        request_started = None;
                        match msg {
                            Message::Request(req) => {
                                let resp = self.handle(&req, conn).await;
                                conn.out.send(resp.to_bytes()).await.map_err(|_| closed())?;
                            }
                            Message::Interleaved { channel, data } => self.inbound(conn, channel, &data),
                            // Stray responses: nothing to do with them.
                            Message::Response(_) => {}
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        let mut resp = Response { status: 400, reason: "Bad Request".into(), headers: Default::default(), body: Vec::new() };
                        resp.headers.set("Connection", "close");
                        resp = resp.with_body("text/plain", format!("{e}\n").into_bytes());
                        conn.out.send(resp.to_bytes()).await.map_err(|_| closed())?;
                        return Ok(());
                    }
                }
            }
            if buf.len() > MAX_HEAD + MAX_BODY + 4 {
                return Ok(());
            }
            // A request under way must be done by its deadline; a connection between requests
            // may idle as long as a session it set up lasts, else for the session timeout.
            let wait = match buf.is_empty() {
                true => self.timeout,
                false => self.timeout.min(REQUEST_DEADLINE).saturating_sub(request_started.get_or_insert_with(Instant::now).elapsed()),
            };
            let n = match tokio::time::timeout(wait, rd.read(&mut chunk)).await {
                Ok(read) => read?,
                Err(_) if buf.is_empty() && self.sessions.lock().values().any(|s| s.origin == conn.id) => continue,
                Err(_) => {
                    tracing::debug!(peer = %conn.peer, partial = buf.len(), "RTSP connection closed: silent without a session, or a request not finished in time");
                    self.metrics.connection_timed_out();
                    return Ok(());
                }
            };
            if n == 0 {
                return Ok(());
            }
            buf.extend_from_slice(&chunk[..n]);
        }
    }

    async fn handle(self: &Arc<Self>, req: &Request, conn: &Connection) -> Response {
        if req.headers.cseq().is_none() {
            return Response::to(req, 400).with_body("text/plain", b"missing CSeq\n".to_vec());
        }
        if let Some(id) = req.headers.session() {
            if let Some(s) = self.sessions.lock().get_mut(id) {
                s.last_seen = Instant::now();
            }
        }
        if req.method != "OPTIONS" {
            if let Some(refused) = self.refuse_unauthenticated(req) {
                return refused;
            }
        }
        let result = match req.method.as_str() {
            "OPTIONS" => Ok(Response::to(req, 200).with("Public", METHODS)),
            "DESCRIBE" => self.describe(req).await,
            "ANNOUNCE" => self.announce(req, conn).await,
            "SETUP" => self.setup(req, conn).await,
            "PLAY" => self.play(req, true).await,
            "PAUSE" => self.play(req, false).await,
            "RECORD" => self.record(req, conn).await,
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
                if status >= 500 && status != 503 {
                    // The server's own failure (not an upstream that is away): worth a look.
                    tracing::warn!(method = %req.method, uri = %req.uri, status, why = %why, "RTSP request failed");
                } else {
                    tracing::debug!(method = %req.method, uri = %req.uri, status, why = %why, "RTSP request refused");
                }
                let mut r = Response::to(req, status).with_body("text/plain", format!("{why}\n").into_bytes());
                if status == 405 || status == 501 {
                    r = r.with("Allow", METHODS);
                }
                r
            }
        }
    }

    /// A 401 for a request on a path with `read_users` (or, to publish, `publish_users`) that
    /// does not prove one of them.
    fn refuse_unauthenticated(&self, req: &Request) -> Option<Response> {
        // A request in a session acts on the session's path, whatever its URL names.
        let of_session = req.headers.session().and_then(|id| self.sessions.lock().get(id).map(|s| s.path.clone()));
        let path = match of_session {
            Some(name) => self.paths.lock().get(&name).cloned()?,
            None => self.target(&req.uri).ok()?.0,
        };
        let users = if self.publishing(req) { &path.publish_users } else { &path.read_users };
        if users.is_empty() {
            return None;
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        if self.verifier.verify(req.headers.get("Authorization"), &req.method, users, now) {
            return None;
        }
        self.metrics.unauthorized();
        let mut r = Response::to(req, 401);
        let stale = self.verifier.is_stale(req.headers.get("Authorization"), now);
        for c in self.verifier.challenges(now, stale) {
            r.headers.0.push(("WWW-Authenticate".into(), c));
        }
        Some(r)
    }

    /// A request of a publisher: ANNOUNCE, RECORD, a SETUP to record, or one in a publisher's
    /// session.
    fn publishing(&self, req: &Request) -> bool {
        match req.method.as_str() {
            "ANNOUNCE" | "RECORD" => true,
            "SETUP" if records(req) => true,
            _ => req.headers.session().is_some_and(|id| self.sessions.lock().get(id).is_some_and(|s| s.publishes)),
        }
    }

    /// The path and track a request URL names: `rtsp://host/<path>[/<track>]`, the track as
    /// this proxy's viewers name it (`trackID=<i>`) or a publisher's announcement did.
    fn target(&self, uri: &str) -> Result<(Arc<PathState>, TrackName), (u16, String)> {
        let url = url::Url::parse(uri).map_err(|_| (400, format!("bad URL {uri:?}")))?;
        let path = url.path().trim_matches('/');
        let paths = self.paths.lock();
        if let Some(state) = paths.get(path) {
            return Ok((state.clone(), TrackName::Path));
        }
        let no_path = || (404, format!("no path {path:?}"));
        let (name, last) = path.rsplit_once('/').ok_or_else(no_path)?;
        let state = paths.get(name).cloned().ok_or_else(no_path)?;
        let track = match last.strip_prefix("trackID=") {
            Some(i) => TrackName::Index(i.parse().map_err(|_| (404, format!("no track {last:?}")))?),
            None => TrackName::Control(last.to_string()),
        };
        Ok((state, track))
    }

    async fn live(&self, path: &PathState) -> Option<Arc<Live>> {
        path.demand.send_modify(|n| *n += 1);
        let mut rx = path.live.subscribe();
        let wait = async { rx.wait_for(|l| l.is_some()).await.ok().and_then(|l| l.clone()) };
        tokio::time::timeout(DESCRIBE_WAIT, wait).await.ok().flatten()
    }

    async fn describe(&self, req: &Request) -> Result<Response, (u16, String)> {
        let (path, track) = self.target(&req.uri)?;
        if track != TrackName::Path {
            return Err((404, "DESCRIBE names a path, not a track".into()));
        }
        let live = self.live(&path).await.ok_or((503, format!("upstream of {} is not available", path.name)))?;
        let origin = self.manager.media_config().ip;
        let sdp = live.presentation.served(origin, session_version());
        // Scheme, host and path only: a query would end up between the path and a track's name.
        let mut base = url::Url::parse(&req.uri).map_err(|_| (400, "bad URL".to_string()))?;
        base.set_query(None);
        base.set_fragment(None);
        let base = format!("{}/", base.as_str().trim_end_matches('/'));
        Ok(Response::to(req, 200).with("Content-Base", base).with_body("application/sdp", sdp.into_bytes()))
    }

    /// Whether `client` may open one more session: 453 past the proxy's or its own limit.
    fn may_open_session(&self, sessions: &HashMap<String, ViewerSession>, client: std::net::IpAddr) -> Result<(), (u16, String)> {
        if sessions.len() >= MAX_SESSIONS {
            self.metrics.session_refused();
            return Err((453, format!("{MAX_SESSIONS} sessions open")));
        }
        let held = sessions.values().filter(|s| s.client == client).count();
        if held >= self.max_sessions_per_client {
            self.metrics.session_refused();
            tracing::warn!(%client, held, "RTSP session refused (rtsp.max_sessions_per_client)");
            return Err((453, format!("{held} sessions open from this address (rtsp.max_sessions_per_client)")));
        }
        Ok(())
    }

    async fn setup(self: &Arc<Self>, req: &Request, conn: &Connection) -> Result<Response, (u16, String)> {
        let (path, track) = self.target(&req.uri)?;
        if records(req) {
            return self.setup_publisher(req, conn, path, track).await;
        }
        let live = self.live(&path).await.ok_or((503, format!("upstream of {} is not available", path.name)))?;
        let track = match (track, live.presentation.tracks.len()) {
            (TrackName::Index(t), n) if t < n => t,
            (TrackName::Path, 1) => 0,
            (TrackName::Index(t), _) => return Err((404, format!("no track {t}"))),
            (TrackName::Control(c), _) => return Err((404, format!("no track {c:?}"))),
            (TrackName::Path, _) => return Err((459, "SETUP names the path of several tracks: name one (trackID=<i>)".into())),
        };
        let offered = TransportSpec::parse_list(req.headers.get("Transport").unwrap_or(""));
        // The first choice served: UDP unicast to the viewer's own address, or interleaved on
        // this connection. Multicast is not served yet.
        // Plain RTP (AVP, AVPF) only: the media is not protected, so SAVP would be a lie.
        let served = |t: &TransportSpec| !t.multicast && !t.profile.to_ascii_uppercase().contains("SAVP") && (t.lower == Lower::Tcp || t.client_port.is_some());
        let Some(mut chosen) = offered.into_iter().find(served) else {
            return Err((461, "served: RTP/AVP over UDP unicast with client_port, or RTP/AVP/TCP interleaved".into()));
        };
        let interleaved = chosen.lower == Lower::Tcp;
        if chosen.destination.as_deref().is_some_and(|d| d.parse::<std::net::IpAddr>().ok() != Some(conn.peer.ip())) {
            // Sending a camera's media to a third address on a viewer's say-so is an amplifier.
            return Err((403, "destination must be the viewer's own address".into()));
        }
        let (session_id, new) = match req.headers.session() {
            Some(id) => {
                let sessions = self.sessions.lock();
                let s = sessions.get(id).filter(|s| !s.publishes).ok_or((454, "no such session".to_string()))?;
                if s.path != path.name {
                    return Err((459, "a session's tracks must belong to one path".into()));
                }
                if s.tracks.contains_key(&track) {
                    return Err((455, format!("track {track} is set up already")));
                }
                if s.connection != interleaved.then_some(conn.id) {
                    return Err((461, "a session's tracks all go over UDP, or all interleaved on the connection that set it up".into()));
                }
                (id.to_string(), false)
            }
            None => {
                self.may_open_session(&self.sessions.lock(), conn.peer.ip())?;
                (session_id(), true)
            }
        };
        let room = room_of(&path.name);
        let pid = format!("v{session_id}-{track}");
        let media_ip = self.manager.media_config().ip;
        // An interleaved track's copies go to the proxy itself, at the odd port beside the
        // participant's (reserved with it, never handed out): it frames them onto the connection.
        let viewer = SocketAddr::new(conn.peer.ip(), chosen.client_port.unwrap_or_default().0);
        let remote = move |local: SocketAddr| match interleaved {
            true => SocketAddr::new(media_ip, local.port() + 1),
            false => viewer,
        };
        let local = {
            let (room, pid, remote) = (room.clone(), pid.clone(), remote);
            let reserved = self.reserved.lock().clone();
            self.blocking(move |model, media| {
                ensure_room(model, &room)?;
                let local = allocate_local(model, media, &reserved)?;
                model.add_participant(&room, &pid, local, remote(local))?;
                Ok((local, vec![Change::Room(room)]))
            })
        };
        let local = local.await.map_err(|e| (500, e.to_string()))?;
        let rtcp_at = SocketAddr::new(local.ip(), local.port() + 1);
        let bound = match interleaved {
            false => {
                let to = SocketAddr::new(conn.peer.ip(), chosen.client_port.map_or(0, |(_, rtcp)| rtcp));
                self.take_receiver_reports(rtcp_at, &session_id).map(|(socket, task)| (task, RtcpSink::Udp { socket, to }))
            }
            true => {
                let channel = chosen.interleaved.map(|(rtp, _)| rtp).unwrap_or((track * 2) as u8);
                chosen.interleaved = Some((channel, channel.wrapping_add(1)));
                let sink = RtcpSink::Interleaved { out: conn.out.clone(), channel: channel.wrapping_add(1) };
                self.relay_interleaved(local, remote(local), channel, conn.out.clone()).map(|task| (task, sink))
            }
        };
        let undo = || self.undo_setup(&path.name, &pid);
        let (relay, sink) = match bound {
            Ok(b) => b,
            Err(e) => {
                let _ = undo().await;
                return Err((500, format!("binding {rtcp_at}: {e}")));
            }
        };
        let gone = self.gone_meanwhile(&path.name, &session_id, new);
        if let Some(refusal) = gone {
            relay.abort();
            let _ = undo().await;
            return Err(refusal);
        }
        {
            let mut sessions = self.sessions.lock();
            let s = sessions
                .entry(session_id.clone())
                .or_insert_with(|| ViewerSession::new(&path.name, false, interleaved.then_some(conn.id), conn.id, conn.peer.ip()));
            s.tracks.insert(track, pid);
            s.relays.push(relay);
            s.rtcp.insert(track, sink);
            self.metrics.set_sessions(sessions.len());
        }
        if new {
            tracing::info!(path = %path.name, session = %session_id, viewer = %conn.peer, interleaved, "RTSP viewer set up");
        }
        if interleaved {
            chosen.client_port = None;
        } else {
            // From and to the media address, which is not the RTSP listener's.
            chosen.server_port = Some((local.port(), local.port() + 1));
            chosen.source = Some(local.ip().to_string());
            chosen.interleaved = None;
        }
        Ok(Response::to(req, 200).with("Transport", chosen.to_header()).with("Session", format!("{session_id};timeout={}", self.timeout.as_secs())))
    }

    /// Take back the participant a SETUP of `path` added; and the path's room, which that SETUP
    /// made again, if the path was removed meanwhile and nobody else is in it.
    async fn undo_setup(&self, path: &str, pid: &str) -> Result<(), ManagerError> {
        let gone = !self.paths.lock().contains_key(path);
        let (room, pid) = (room_of(path), pid.to_string());
        self.blocking(move |model, _| {
            if model.room(&room).is_ok_and(|r| r.participants.contains_key(&pid)) {
                model.remove_participant(&room, &pid)?;
            }
            if gone && model.room(&room).is_ok_and(|r| r.participants.is_empty()) {
                model.delete_room(&room)?;
            }
            Ok(((), vec![Change::Room(room)]))
        })
        .await
    }

    /// Take back the source a publisher's SETUP added, if it is still the one it added (a newer
    /// publisher's SETUP may have replaced it meanwhile).
    async fn undo_source(&self, path: &str, pid: &str, uid: u32) -> Result<(), ManagerError> {
        let (room, pid) = (room_of(path), pid.to_string());
        self.blocking(move |model, _| {
            if source_uid(model, &room, &pid) == Some(uid) {
                model.remove_participant(&room, &pid)?;
            }
            Ok(((), vec![Change::Room(room)]))
        })
        .await
    }

    /// What ended while a SETUP added its participant: the path (removed) or the session it
    /// joins (TEARDOWN, timeout). Nothing is brought back to life.
    fn gone_meanwhile(&self, path: &str, session: &str, new: bool) -> Option<(u16, String)> {
        if !self.paths.lock().contains_key(path) {
            Some((404, format!("path {path} was removed")))
        } else if !new && !self.sessions.lock().contains_key(session) {
            Some((454, "the session ended".to_string()))
        } else {
            None
        }
    }

    /// A UDP viewer's RTCP port on the proxy's side: its receiver reports arrive there (read and
    /// let go, so its sender gets no ICMP errors) and the camera's sender reports leave from it.
    /// Its reports keep the session alive, as requests do (RFC 2326 12.37).
    fn take_receiver_reports(&self, at: SocketAddr, session: &str) -> std::io::Result<(Arc<tokio::net::UdpSocket>, tokio::task::AbortHandle)> {
        let socket = std::net::UdpSocket::bind(at)?;
        socket.set_nonblocking(true)?;
        let socket = Arc::new(tokio::net::UdpSocket::from_std(socket)?);
        let reader = socket.clone();
        let (me, session) = (self.me.clone(), session.to_string());
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while reader.recv_from(&mut buf).await.is_ok() {
                let Some(proxy) = me.upgrade() else { return };
                let mut sessions = proxy.sessions.lock();
                if let Some(s) = sessions.get_mut(&session) {
                    s.last_seen = Instant::now();
                }
            }
        });
        Ok((socket, task.abort_handle()))
    }

    /// The camera's RTCP for `track` of `path`, to every playing viewer of it.
    pub(crate) fn forward_rtcp(&self, path: &str, track: usize, packet: &[u8]) {
        let sessions = self.sessions.lock();
        for s in sessions.values().filter(|s| s.playing && s.path == path && !s.publishes) {
            match s.rtcp.get(&track) {
                Some(RtcpSink::Udp { socket, to }) => {
                    let _ = socket.try_send_to(packet, *to);
                }
                Some(RtcpSink::Interleaved { out, channel }) => {
                    if let Some(frame) = crate::message::interleaved(*channel, packet) {
                        if out.try_send(frame).is_err() {
                            self.metrics.tcp_dropped();
                        }
                    }
                }
                None => {}
            }
        }
    }

    /// Carry the copies the data plane sends from `from` to `at` onto a viewer's connection as
    /// interleaved frames on `channel`; what its queue has no room for is dropped and counted.
    fn relay_interleaved(
        self: &Arc<Self>,
        from: SocketAddr,
        at: SocketAddr,
        channel: u8,
        out: mpsc::Sender<Vec<u8>>,
    ) -> std::io::Result<tokio::task::AbortHandle> {
        let socket = std::net::UdpSocket::bind(at)?;
        socket.set_nonblocking(true)?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let proxy = self.clone();
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let Ok((n, source)) = socket.recv_from(&mut buf).await else { return };
                if source != from {
                    continue; // only the data plane's copies, from the participant's own address
                }
                let Some(frame) = crate::message::interleaved(channel, &buf[..n]) else { continue };
                match out.try_send(frame) {
                    Ok(()) => {}
                    Err(mpsc::error::TrySendError::Full(_)) => {
                        proxy.metrics.tcp_dropped();
                    }
                    Err(mpsc::error::TrySendError::Closed(_)) => return,
                }
            }
        });
        Ok(task.abort_handle())
    }

    async fn play(&self, req: &Request, play: bool) -> Result<Response, (u16, String)> {
        let (path, _) = self.target(&req.uri)?;
        let id = req.headers.session().ok_or((454, "PLAY and PAUSE need a Session".to_string()))?.to_string();
        let tracks: Vec<(String, usize)> = {
            let mut sessions = self.sessions.lock();
            let s = sessions.get_mut(&id).filter(|s| s.path == path.name).ok_or((454, "no such session".to_string()))?;
            if s.publishes {
                return Err((455, "a publisher's session RECORDs; it does not PLAY".into()));
            }
            if s.tracks.is_empty() {
                return Err((455, "no track set up".into()));
            }
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
        // Playing only once subscribed: a refused PLAY (a limit) leaves it as it was, and an
        // upstream reconnecting subscribes only what played.
        if let Some(s) = self.sessions.lock().get_mut(&id) {
            s.playing = play;
        }
        let mut resp = Response::to(req, 200).with("Session", format!("{id};timeout={}", self.timeout.as_secs()));
        if play {
            resp = resp.with("Range", "npt=0.000-");
        }
        Ok(resp)
    }

    /// A publisher's ANNOUNCE: the description of what it will RECORD into a publisher path.
    /// One publisher at a time, the newest: an encoder that restarts (or lost its connection
    /// without a FIN) takes its path back at once, from the one it left behind.
    async fn announce(&self, req: &Request, conn: &Connection) -> Result<Response, (u16, String)> {
        let (path, track) = self.target(&req.uri)?;
        if track != TrackName::Path {
            return Err((404, "ANNOUNCE names a path, not a track".into()));
        }
        if path.source.is_some() {
            return Err((455, format!("path {} is pulled from its upstream; it takes no publisher", path.name)));
        }
        if !req.headers.get("Content-Type").is_some_and(|t| t.trim().to_ascii_lowercase().starts_with("application/sdp")) {
            return Err((415, "ANNOUNCE carries an SDP (Content-Type: application/sdp)".into()));
        }
        let presentation = Presentation::parse(&req.body).map_err(|e| (400, format!("the announced SDP: {e}")))?;
        let previous: Vec<String> = self.sessions.lock().iter().filter(|(_, s)| s.publishes && s.path == path.name).map(|(id, _)| id.clone()).collect();
        for id in previous {
            tracing::info!(path = %path.name, session = %id, publisher = %conn.peer, "RTSP publisher replaced by a newer one");
            self.end_session(&id, RtspSessionEnd::Replaced).await.map_err(|e| (500, e.to_string()))?;
        }
        tracing::info!(path = %path.name, publisher = %conn.peer, tracks = presentation.tracks.len(), "RTSP publisher announced");
        *path.announced.lock() = Some(Announcement { connection: conn.id, presentation });
        Ok(Response::to(req, 200))
    }

    /// A publisher's SETUP of one announced track: the track becomes the path's source
    /// `source-<i>`, on a fresh port of the SFU (its `server_port`), accepting only the
    /// publisher's `client_port`; or, interleaved, fed from its frames on this connection.
    async fn setup_publisher(self: &Arc<Self>, req: &Request, conn: &Connection, path: Arc<PathState>, name: TrackName) -> Result<Response, (u16, String)> {
        if path.source.is_some() {
            return Err((455, format!("path {} is pulled from its upstream; it takes no publisher", path.name)));
        }
        let (track, clock_rate) = {
            let announced = path.announced.lock();
            let a = announced.as_ref().filter(|a| a.connection == conn.id).ok_or((455, "ANNOUNCE the path on this connection first".to_string()))?;
            let i = announced_track(&a.presentation, &name).ok_or((404, "no such track in the announcement".to_string()))?;
            (i, a.presentation.tracks[i].clock_rate)
        };
        let offered = TransportSpec::parse_list(req.headers.get("Transport").unwrap_or(""));
        let served = |t: &TransportSpec| !t.multicast && !t.profile.to_ascii_uppercase().contains("SAVP") && (t.lower == Lower::Tcp || t.client_port.is_some());
        let mut chosen =
            offered.into_iter().find(served).ok_or((461, "recorded: RTP/AVP over UDP unicast with client_port, or RTP/AVP/TCP interleaved".to_string()))?;
        let interleaved = chosen.lower == Lower::Tcp;
        let (session_id, new) = match req.headers.session() {
            Some(id) => {
                let sessions = self.sessions.lock();
                let s = sessions.get(id).filter(|s| s.publishes && s.path == path.name).ok_or((454, "no such session".to_string()))?;
                if s.tracks.contains_key(&track) {
                    return Err((455, format!("track {track} is set up already")));
                }
                (id.to_string(), false)
            }
            None => {
                let sessions = self.sessions.lock();
                self.may_open_session(&sessions, conn.peer.ip())?;
                if sessions.values().any(|s| s.publishes && s.path == path.name) {
                    return Err((455, format!("path {} has a publisher", path.name)));
                }
                (session_id(), true)
            }
        };
        let room = room_of(&path.name);
        let pid = source_of(track);
        let publisher = SocketAddr::new(conn.peer.ip(), chosen.client_port.unwrap_or_default().0);
        let reserved = self.reserved.lock().clone();
        let added = {
            let (room, pid) = (room.clone(), pid.clone());
            self.blocking(move |model, media| {
                ensure_room(model, &room)?;
                if model.room(&room)?.participants.contains_key(&pid) {
                    model.remove_participant(&room, &pid)?;
                }
                let local = allocate_local(model, media, &reserved)?;
                // Interleaved media enters from the odd port beside the source's (reserved with
                // it): the proxy sends each frame from there.
                let remote = if interleaved { SocketAddr::new(media.ip, local.port() + 1) } else { publisher };
                model.add_participant(&room, &pid, local, remote)?;
                let uid = model.publish(&room, &pid, STREAM, StreamSpec { clock_rate, ..StreamSpec::default() })?;
                Ok(((local, uid), vec![Change::Room(room)]))
            })
        };
        let (local, uid) = added.await.map_err(|e| (500, e.to_string()))?;
        let undo = || self.undo_source(&path.name, &pid, uid);
        let side = SocketAddr::new(local.ip(), local.port() + 1);
        let socket = match std::net::UdpSocket::bind(side).and_then(|s| s.set_nonblocking(true).map(|()| s)) {
            Ok(s) => s,
            Err(e) => {
                let _ = undo().await;
                return Err((500, format!("binding {side}: {e}")));
            }
        };
        let mut interleaved_on = None;
        let relay = match interleaved {
            true => {
                let channel = chosen.interleaved.map(|(rtp, _)| rtp).unwrap_or((track * 2) as u8);
                chosen.interleaved = Some((channel, channel.wrapping_add(1)));
                let mut inbound = conn.inbound.lock();
                inbound.insert(channel, Inbound::Rtp { socket: Arc::new(socket), to: local });
                inbound.insert(channel.wrapping_add(1), Inbound::Rtcp { path: path.name.clone(), track });
                interleaved_on = Some(channel);
                None
            }
            false => match self.relay_publisher_rtcp(socket, conn.peer.ip(), &path.name, track) {
                Ok(task) => Some(task),
                Err(e) => {
                    let _ = undo().await;
                    return Err((500, format!("listening at {side}: {e}")));
                }
            },
        };
        let forget_channels = || {
            if let Some(c) = interleaved_on {
                let mut map = conn.inbound.lock();
                map.remove(&c);
                map.remove(&c.wrapping_add(1));
            }
        };
        // What changed while the source was added: the path or the session went, or a newer
        // publisher announced (it took the path: this one's SETUP is refused).
        let mut refusal = self.gone_meanwhile(&path.name, &session_id, new);
        {
            let mut sessions = self.sessions.lock();
            let announced = path.announced.lock().as_ref().is_some_and(|a| a.connection == conn.id);
            let other = sessions.iter().any(|(id, s)| s.publishes && s.path == path.name && *id != session_id);
            if refusal.is_none() && (!announced || other) {
                refusal = Some((455, format!("path {} has a newer publisher", path.name)));
            }
            if refusal.is_none() {
                let s = sessions.entry(session_id.clone()).or_insert_with(|| ViewerSession::new(&path.name, true, Some(conn.id), conn.id, conn.peer.ip()));
                s.tracks.insert(track, pid.clone());
                s.streams.insert(track, uid);
                s.relays.extend(relay.clone());
                if let Some(c) = interleaved_on {
                    let (_, channels) = s.inbound.get_or_insert_with(|| (conn.inbound.clone(), Vec::new()));
                    channels.extend([c, c.wrapping_add(1)]);
                }
                self.metrics.set_sessions(sessions.len());
            }
        }
        if let Some(refusal) = refusal {
            if let Some(r) = relay {
                r.abort();
            }
            forget_channels();
            let _ = self.undo_source(&path.name, &pid, uid).await;
            return Err(refusal);
        }
        if interleaved {
            chosen.client_port = None;
        } else {
            // To the media address, which is not the RTSP listener's: ffmpeg sends to `source`,
            // GStreamer to `destination` (where the stream goes, RFC 2326 §12.39).
            chosen.server_port = Some((local.port(), local.port() + 1));
            chosen.source = Some(local.ip().to_string());
            chosen.destination = Some(local.ip().to_string());
            chosen.interleaved = None;
        }
        Ok(Response::to(req, 200).with("Transport", chosen.to_header()).with("Session", format!("{session_id};timeout={}", self.timeout.as_secs())))
    }

    /// A UDP publisher's RTCP port on the SFU's side: its sender reports arrive there, and go on
    /// to the track's viewers.
    fn relay_publisher_rtcp(
        &self,
        socket: std::net::UdpSocket,
        publisher: std::net::IpAddr,
        path: &str,
        track: usize,
    ) -> std::io::Result<tokio::task::AbortHandle> {
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let (me, path) = (self.me.clone(), path.to_string());
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                if from.ip() == publisher && is_rtcp(&buf[..n]) {
                    let Some(proxy) = me.upgrade() else { return };
                    proxy.forward_rtcp(&path, track, &buf[..n]);
                }
            }
        });
        Ok(task.abort_handle())
    }

    /// A frame an interleaved publisher sent on `channel`: into the data plane (RTP), or on to
    /// the viewers (RTCP). A viewer's frames (its receiver reports) are let go.
    fn inbound(&self, conn: &Connection, channel: u8, data: &[u8]) {
        match conn.inbound.lock().get(&channel) {
            // Counted with the TCP drops: a frame lost on its way between TCP and the data plane.
            Some(Inbound::Rtp { socket, to }) if socket.send_to(data, *to).is_err() => self.metrics.tcp_dropped(),
            Some(Inbound::Rtp { .. }) => {}
            Some(Inbound::Rtcp { path, track }) if is_rtcp(data) => self.forward_rtcp(path, *track, data),
            Some(Inbound::Rtcp { .. }) => {}
            None => {}
        }
    }

    /// A publisher's RECORD: its tracks, all set up, become the path's sources; the viewers
    /// waiting for it start receiving.
    async fn record(&self, req: &Request, conn: &Connection) -> Result<Response, (u16, String)> {
        let (path, _) = self.target(&req.uri)?;
        let id = req.headers.session().ok_or((454, "RECORD needs a Session".to_string()))?.to_string();
        let streams = {
            let sessions = self.sessions.lock();
            let s = sessions.get(&id).filter(|s| s.path == path.name && s.publishes).ok_or((454, "no such session".to_string()))?;
            s.streams.clone()
        };
        let presentation = path
            .announced
            .lock()
            .as_ref()
            .filter(|a| a.connection == conn.id)
            .map(|a| a.presentation.clone())
            .ok_or((455, "ANNOUNCE the path on this connection first".to_string()))?;
        if let Some(missing) = (0..presentation.tracks.len()).find(|t| !streams.contains_key(t)) {
            return Err((455, format!("track {missing} is not set up")));
        }
        let room = room_of(&path.name);
        let viewers = self.playing_viewers(&path.name);
        let subscribed = self.blocking(move |model, _| {
            subscribe_viewers(model, &room, &viewers)?;
            Ok(((), vec![Change::Room(room)]))
        });
        subscribed.await.map_err(|e| (500, e.to_string()))?;
        let tracks = streams.len();
        {
            // Under the sessions lock: a session ended meanwhile (a newer publisher) does not
            // come back as the path's description.
            let mut sessions = self.sessions.lock();
            let s = sessions.get_mut(&id).filter(|s| s.streams == streams).ok_or((454, "the session ended".to_string()))?;
            s.playing = true;
            path.live.send_replace(Some(Arc::new(Live { presentation, stream_uids: streams.into_values().collect() })));
        }
        self.metrics.upstream(&path.name, true);
        tracing::info!(path = %path.name, publisher = %conn.peer, tracks, "RTSP publisher recording");
        Ok(Response::to(req, 200).with("Session", format!("{id};timeout={}", self.timeout.as_secs())))
    }

    async fn teardown(&self, req: &Request) -> Result<Response, (u16, String)> {
        let id = req.headers.session().ok_or((454, "TEARDOWN needs a Session".to_string()))?.to_string();
        if !self.sessions.lock().contains_key(&id) {
            return Err((454, "no such session".into()));
        }
        self.end_session(&id, RtspSessionEnd::Teardown).await.map_err(|e| (500, e.to_string()))?;
        Ok(Response::to(req, 200))
    }

    async fn end_session(&self, id: &str, why: RtspSessionEnd) -> Result<(), ManagerError> {
        let s = {
            let mut sessions = self.sessions.lock();
            let Some(s) = sessions.remove(id) else { return Ok(()) };
            self.metrics.set_sessions(sessions.len());
            s
        };
        self.metrics.session_ended(why);
        let mine: Vec<u32> = s.streams.values().copied().collect();
        if s.publishes {
            // The path goes quiet until the next publisher; its viewers stay and wait for it.
            // What a newer publisher holds already (its description, its announcement) stays.
            if let Some(path) = self.paths.lock().get(&s.path) {
                let live_is_mine = path.live.borrow().as_ref().is_some_and(|l| l.stream_uids == mine);
                if live_is_mine && path.live.send_replace(None).is_some() {
                    self.metrics.upstream(&s.path, false);
                }
                let mut announced = path.announced.lock();
                if announced.as_ref().is_some_and(|a| Some(a.connection) == s.connection) {
                    *announced = None;
                }
            }
            tracing::info!(path = %s.path, session = %id, "RTSP publisher ended");
        }
        let room = room_of(&s.path);
        tracing::info!(path = %s.path, session = %id, "RTSP session ended");
        let publishes = s.publishes;
        let pids: Vec<(usize, String)> = s.tracks.iter().map(|(t, p)| (*t, p.clone())).collect();
        let streams = s.streams.clone();
        drop(s); // its relays and interleaved channels stop
        self.blocking(move |model, _| {
            for (track, pid) in &pids {
                // A publisher's sources only while they are its own (a newer one's replaced them).
                let own = !publishes || source_uid(model, &room, pid) == streams.get(track).copied();
                if own && model.room(&room).is_ok_and(|r| r.participants.contains_key(pid)) {
                    model.remove_participant(&room, pid)?;
                }
            }
            Ok(((), vec![Change::Room(room)]))
        })
        .await
    }
}

impl RtspPaths for RtspProxy {
    fn list(&self) -> Vec<serde_json::Value> {
        let paths: Vec<Arc<PathState>> = self.paths.lock().values().cloned().collect();
        paths.iter().map(|p| self.describe_path(p)).collect()
    }

    fn get(&self, name: &str) -> Option<serde_json::Value> {
        let path = self.paths.lock().get(name).cloned()?;
        Some(self.describe_path(&path))
    }

    fn add(&self, config: RtspPath) -> Result<serde_json::Value, RtspPathError> {
        let path = self.start_path(config)?;
        tracing::info!(path = %path.name, source = %path.config_source(), "RTSP path added");
        Ok(self.describe_path(&path))
    }

    fn remove(&self, name: &str) -> Result<(), RtspPathError> {
        let path = self.paths.lock().remove(name).ok_or_else(|| RtspPathError::NotFound(name.to_string()))?;
        if let Some(pull) = path.pull.lock().take() {
            pull.abort();
        }
        if path.live.send_replace(None).is_some() {
            self.metrics.upstream(name, false);
        }
        let ended: Vec<ViewerSession> = {
            let mut sessions = self.sessions.lock();
            let ids: Vec<String> = sessions.iter().filter(|(_, s)| s.path == name).map(|(id, _)| id.clone()).collect();
            let ended = ids.iter().filter_map(|id| sessions.remove(id)).collect();
            self.metrics.set_sessions(sessions.len());
            ended
        };
        for _ in &ended {
            self.metrics.session_ended(RtspSessionEnd::Teardown);
        }
        drop(ended); // their relays stop
        let room = room_of(name);
        self.manager
            .mutate(|model, _| {
                if model.rooms.contains_key(&room) {
                    model.delete_room(&room)?;
                }
                Ok(((), vec![Change::Room(room.clone())]))
            })
            .map_err(|e| RtspPathError::Failed(e.to_string()))?;
        tracing::info!(path = %name, "RTSP path removed");
        Ok(())
    }
}

/// What a request URL names below its path.
#[derive(Debug, Clone, PartialEq, Eq)]
enum TrackName {
    /// Nothing: the path itself.
    Path,
    /// `trackID=<i>`, as this proxy's descriptions name tracks.
    Index(usize),
    /// Anything else: a publisher's own control (`streamid=0` from ffmpeg, `stream=0` from
    /// GStreamer).
    Control(String),
}

/// RTCP as a sender's reports start: version 2, a packet type of RFC 3550's (SR to APP).
pub(crate) fn is_rtcp(p: &[u8]) -> bool {
    p.len() >= 8 && p[0] >> 6 == 2 && (200..=204).contains(&p[1])
}

/// The uid of the stream source `pid` of `room` publishes, if it does.
fn source_uid(model: &Model, room: &str, pid: &str) -> Option<u32> {
    model.room(room).ok()?.participants.get(pid)?.streams.get(STREAM).map(|s| s.uid)
}

/// A SETUP that asks to record (a publisher's: `mode=record` in any choice it offers).
fn records(req: &Request) -> bool {
    TransportSpec::parse_list(req.headers.get("Transport").unwrap_or("")).iter().any(|t| t.mode.as_deref() == Some("RECORD"))
}

/// The index of the announced track a publisher's SETUP names.
fn announced_track(presentation: &Presentation, name: &TrackName) -> Option<usize> {
    let tracks = &presentation.tracks;
    let named = |c: &str| tracks.iter().position(|t| t.control.as_deref().is_some_and(|tc| tc == c || tc.ends_with(&format!("/{c}"))));
    match name {
        TrackName::Path => (tracks.len() == 1).then_some(0),
        TrackName::Index(i) => named(&format!("trackID={i}")).or((*i < tracks.len()).then_some(*i)),
        TrackName::Control(c) => named(c),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_publishers_setup_names_an_announced_track() {
        let sdp = b"v=0\r\ns=-\r\nt=0 0\r\nm=video 0 RTP/AVP 96\r\na=control:streamid=0\r\nm=audio 0 RTP/AVP 97\r\na=control:rtsp://h/live/streamid=1\r\n";
        let p = Presentation::parse(sdp).unwrap();
        let track = |n: TrackName| announced_track(&p, &n);
        assert_eq!(track(TrackName::Control("streamid=0".into())), Some(0));
        assert_eq!(track(TrackName::Control("streamid=1".into())), Some(1), "an absolute control URL");
        assert_eq!(track(TrackName::Control("stream=0".into())), None);
        assert_eq!(track(TrackName::Index(1)), Some(1));
        assert_eq!(track(TrackName::Index(2)), None);
        assert_eq!(track(TrackName::Path), None, "two tracks: the path alone names none");
    }
}
