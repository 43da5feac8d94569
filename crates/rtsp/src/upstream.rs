//! Pulling a path's upstream: DESCRIBE, SETUP of every track over UDP to ports of the SFU, PLAY,
//! then keep-alives while its media flows; reconnect with backoff when it fails or goes quiet.
//!
//! Each track's sender becomes a publisher in the path's room (participant `source-<i>`, local =
//! the `client_port` given upstream, remote = the upstream's `server_port`), so only the
//! camera's address may inject into it (the forwarding model's source check).

use crate::auth::Challenge;
use crate::describe::{control_url, Presentation};
use crate::message::{decode, Message, Request, Response};
use crate::server::{ensure_room, subscribe_viewers, Live, PathState};
use crate::transport::TransportSpec;
use crate::{room_of, source_of, RtspProxy, STREAM};
use anyhow::{anyhow, bail, Context};
use mediaplane_control::store::Change;
use mediaplane_core::model::{PayloadFormat, StreamRef, StreamSpec};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// An upstream whose tracks all stay silent this long is reconnected (a camera that restarted
/// behind a connection that did not close, a session it dropped).
const MEDIA_TIMEOUT: Duration = Duration::from_secs(5);
const BACKOFF_FIRST: Duration = Duration::from_millis(500);
const BACKOFF_MAX: Duration = Duration::from_secs(30);
const USER_AGENT: &str = concat!("mediaplane/", env!("CARGO_PKG_VERSION"));

/// Pull `path` for as long as the process runs.
pub(crate) async fn pull(proxy: Arc<RtspProxy>, path: Arc<PathState>, source: url::Url) {
    let mut backoff = BACKOFF_FIRST;
    let mut demand = path.demand.subscribe();
    loop {
        if path.on_demand.is_some() && proxy.viewers_of(&path.name) == 0 {
            // Nobody watches: wait for a DESCRIBE or SETUP (one that came meanwhile counts).
            if demand.changed().await.is_err() {
                return;
            }
        }
        demand.mark_unchanged();
        let started = Instant::now();
        let result = pull_once(&proxy, &path, &source).await;
        if path.live.send_replace(None).is_some() {
            proxy.metrics.upstream(&path.name, false);
        }
        if let Err(e) = release_sources(&proxy, &path).await {
            tracing::warn!(path = %path.name, error = %e, "removing the upstream's sources failed");
        }
        match result {
            Ok(()) => {
                tracing::info!(path = %path.name, "upstream released");
                backoff = BACKOFF_FIRST;
                // The requests of the viewers it served are spent: only a new one pulls again.
                demand.mark_unchanged();
                continue;
            }
            Err(e) => tracing::warn!(path = %path.name, source = %path.config_source(), error = format!("{e:#}"), "upstream lost"),
        }
        // A session that ran for a while starts the backoff again.
        if started.elapsed() > BACKOFF_MAX {
            backoff = BACKOFF_FIRST;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(BACKOFF_MAX);
    }
}

async fn pull_once(proxy: &RtspProxy, path: &PathState, source: &url::Url) -> anyhow::Result<()> {
    // Credentials go in Authorization headers, never in request lines (or logs).
    let credentials = credentials_of(source);
    let mut bare = source.clone();
    let _ = bare.set_username("");
    let _ = bare.set_password(None);
    let url = &bare;
    let host = url.host_str().ok_or_else(|| anyhow!("{url} has no host"))?;
    let port = url.port().unwrap_or(554);
    let media = proxy.manager.media_config().clone();
    let tcp = tokio::time::timeout(REQUEST_TIMEOUT, connect_from(media.ip, host, port)).await.context("connecting")??;
    let peer = tcp.peer_addr()?;
    let mut c = Client { tcp, buf: Vec::new(), cseq: 0, session: None, credentials, challenge: None, nc: 0 };

    let r = c.request("DESCRIBE", url.as_str(), &[("Accept", "application/sdp")]).await?;
    if r.status == 401 && c.credentials.is_none() {
        bail!("the upstream asks for credentials: give them in the source URL (rtsp://user:password@host/path)");
    }
    if r.status != 200 {
        bail!("DESCRIBE answered {} {}", r.status, r.reason);
    }
    let presentation = Presentation::parse(&r.body).context("upstream SDP")?;
    let base = r.headers.get("Content-Base").or(r.headers.get("Content-Location")).and_then(|b| url::Url::parse(b).ok()).unwrap_or_else(|| url.clone());

    // Ports for every track (held from other pulls and viewers until claimed), then SETUP each
    // to them.
    let reservation = proxy.reserve(presentation.tracks.len())?;
    let locals = reservation.ports().to_vec();
    let mut remotes = Vec::new();
    let mut ssrcs = Vec::new();
    let mut timeout = None;
    for (track, local) in presentation.tracks.iter().zip(&locals) {
        let at = control_url(&base, track.control.as_deref()).ok_or_else(|| anyhow!("bad control URL {:?}", track.control))?;
        let ask = TransportSpec::udp((local.port(), local.port() + 1)).to_header();
        let r = c.request("SETUP", at.as_str(), &[("Transport", ask.as_str())]).await?;
        if r.status != 200 {
            bail!("SETUP {at} answered {} {}", r.status, r.reason);
        }
        let t = TransportSpec::parse(r.headers.get("Transport").unwrap_or("")).context("SETUP answer's Transport")?;
        let (server_rtp, _) = t.server_port.ok_or_else(|| anyhow!("SETUP {at}: no server_port in the answer"))?;
        remotes.push(SocketAddr::new(peer.ip(), server_rtp));
        ssrcs.push(t.ssrc.or(track.ssrc()));
        if c.session.is_none() {
            c.session = r.headers.session().map(String::from);
        }
        // The session's timeout is told here (RFC 2326 §12.37); PLAY's answer seldom repeats it.
        timeout = r.headers.get("Session").and_then(session_timeout).or(timeout);
    }

    // The sources go into the model before PLAY, so the first packet finds them.
    let room = room_of(&path.name);
    let viewers = proxy.playing_viewers(&path.name);
    // Each track's SSRC and format as SDP names them, so that browsers can watch the path over
    // WHEP from its room (the SFU announces the SSRC; its copies keep the camera's).
    // Unless an earlier pull found that its packets carry another one.
    let trusted = !path.ssrc_unreliable.load(std::sync::atomic::Ordering::Relaxed);
    let specs: Vec<StreamSpec> = presentation.tracks.iter().zip(&ssrcs).map(|(t, ssrc)| source_spec(t, ssrc.filter(|_| trusted))).collect();
    let narrowed = specs.iter().any(|s| s.ssrc.is_some());
    let kept = std::mem::take(&mut *path.kept_subscribers.lock());
    let claimed = locals.clone();
    let stream_uids = proxy
        .blocking(move |model, _| {
            ensure_room(model, &room)?;
            let mut uids = Vec::new();
            for (i, (local, remote)) in claimed.iter().zip(&remotes).enumerate() {
                let pid = source_of(i);
                if model.room(&room)?.participants.contains_key(&pid) {
                    model.remove_participant(&room, &pid)?;
                }
                model.add_participant(&room, &pid, *local, *remote)?;
                uids.push(model.publish(&room, &pid, STREAM, specs[i].clone())?);
            }
            subscribe_viewers(model, &room, &viewers)?;
            // Browsers that watched before the upstream was lost, if they are still there.
            for (pid, track, pt) in &kept {
                let to = StreamRef { publisher: source_of(*track), stream: STREAM.into() };
                let r = model.room(&room)?;
                if r.participants.contains_key(pid) && r.participants.get(&to.publisher).is_some_and(|p| p.streams.contains_key(STREAM)) {
                    model.subscribe(&room, pid, to.clone())?;
                    model.set_consumer_payload_type(&room, pid, &to, *pt)?;
                }
            }
            Ok((uids, vec![Change::Room(room)]))
        })
        .await?;

    // The camera's RTCP (sender reports) to the odd port beside each track's: on to its viewers.
    let _rtcp = relay_sender_reports(proxy, &path.name, &locals, peer.ip())?;
    let r = c.request("PLAY", base.as_str(), &[("Range", "npt=0.000-")]).await?;
    if r.status != 200 {
        bail!("PLAY answered {} {}", r.status, r.reason);
    }
    tracing::info!(path = %path.name, source = %url, tracks = stream_uids.len(), "upstream playing");
    let keepalive = r.headers.get("Session").and_then(session_timeout).or(timeout).unwrap_or(60).clamp(2, 600) / 2;
    path.live.send_replace(Some(Arc::new(Live { presentation, stream_uids: stream_uids.clone() })));
    proxy.metrics.upstream(&path.name, true);
    let result = c.keep_alive(proxy, path, &base, Duration::from_secs(keepalive), &stream_uids, narrowed).await;
    if c.session.is_some() {
        // Best effort: the upstream times the session out anyway.
        let _ = tokio::time::timeout(Duration::from_millis(500), c.send("TEARDOWN", base.as_str(), &[])).await;
    }
    result
}

/// What a source publishes for `track`: its clock, and, for audio and video, the format and
/// SSRC a WHEP answer needs (a camera that names no SSRC is watched over RTSP only).
pub(crate) fn source_spec(track: &crate::describe::Track, ssrc: Option<u32>) -> StreamSpec {
    let media = matches!(track.kind.as_str(), "audio" | "video") && ssrc.is_some();
    let format = track.rtpmap().filter(|_| media).zip(track.payload_types.first()).map(|(rtpmap, &pt)| PayloadFormat {
        kind: track.kind.clone(),
        pt,
        rtpmap,
        fmtp: track.fmtp(),
    });
    StreamSpec { clock_rate: track.clock_rate, ssrc: ssrc.filter(|_| format.is_some()), format, ..StreamSpec::default() }
}

/// A connection to the upstream from the media address: an RTSP server sends UDP media to the
/// address the connection came from, which must be the one the SFU's ports are on.
async fn connect_from(ip: std::net::IpAddr, host: &str, port: u16) -> anyhow::Result<TcpStream> {
    let mut last = None;
    for to in tokio::net::lookup_host((host, port)).await?.filter(|a| a.is_ipv4() == ip.is_ipv4()) {
        let socket = if ip.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.bind(SocketAddr::new(ip, 0))?;
        match socket.connect(to).await {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.map(Into::into).unwrap_or_else(|| anyhow!("{host} has no address of the media address's family ({ip})")))
}

/// Tasks that end when this is dropped.
struct Tasks(Vec<tokio::task::JoinHandle<()>>);

impl Drop for Tasks {
    fn drop(&mut self) {
        for t in &self.0 {
            t.abort();
        }
    }
}

/// Listen at each track's RTCP port (its RTP port + 1) for what the camera at `camera` sends,
/// and hand it to the proxy for the track's viewers.
fn relay_sender_reports(proxy: &RtspProxy, path: &str, locals: &[SocketAddr], camera: std::net::IpAddr) -> anyhow::Result<Tasks> {
    let mut tasks = Tasks(Vec::new());
    for (track, local) in locals.iter().enumerate() {
        let at = SocketAddr::new(local.ip(), local.port() + 1);
        let socket = std::net::UdpSocket::bind(at).with_context(|| format!("binding the RTCP port {at}"))?;
        socket.set_nonblocking(true)?;
        let socket = tokio::net::UdpSocket::from_std(socket)?;
        let (me, path) = (proxy.me(), path.to_string());
        tasks.0.push(tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            while let Ok((n, from)) = socket.recv_from(&mut buf).await {
                if from.ip() == camera && crate::server::is_rtcp(&buf[..n]) {
                    if let Some(proxy) = me.upgrade() {
                        proxy.forward_rtcp(&path, track, &buf[..n]);
                    }
                }
            }
        }));
    }
    Ok(tasks)
}

/// Remove the path's sources; remember who else than its RTSP viewers subscribed to them.
async fn release_sources(proxy: &RtspProxy, path: &PathState) -> Result<(), mediaplane_control::manager::ManagerError> {
    let room = room_of(&path.name);
    let viewers = proxy.viewer_participants(&path.name);
    let kept = proxy
        .blocking(move |model, _| {
            let Ok(r) = model.room(&room) else { return Ok((Vec::new(), vec![])) };
            let sources: Vec<String> = r.participants.keys().filter(|p| p.starts_with("source-")).cloned().collect();
            let mut kept = Vec::new();
            for (pid, p) in r.participants.iter().filter(|(pid, _)| !viewers.contains(*pid) && !sources.contains(pid)) {
                for (to, c) in &p.subscriptions {
                    let track = to.publisher.strip_prefix("source-").and_then(|i| i.parse::<usize>().ok());
                    if let Some(track) = track.filter(|_| sources.contains(&to.publisher)) {
                        kept.push((pid.clone(), track, c.payload_type));
                    }
                }
            }
            for pid in &sources {
                model.remove_participant(&room, pid)?;
            }
            Ok((kept, vec![Change::Room(room)]))
        })
        .await?;
    path.kept_subscribers.lock().extend(kept);
    Ok(())
}

/// `Session: id;timeout=N`'s N.
fn session_timeout(v: &str) -> Option<u64> {
    v.split(';').skip(1).find_map(|p| p.trim().strip_prefix("timeout=")).and_then(|t| t.trim().parse().ok())
}

struct Client {
    tcp: TcpStream,
    buf: Vec<u8>,
    cseq: u32,
    session: Option<String>,
    /// User and password from the source URL.
    credentials: Option<(String, String)>,
    /// The upstream's latest challenge, answered in every request from then on.
    challenge: Option<Challenge>,
    /// Requests answered to the challenge's nonce (Digest's `nc`).
    nc: u32,
}

/// The percent-decoded user and password of a URL, if it has a user.
fn credentials_of(url: &url::Url) -> Option<(String, String)> {
    let decode = |s: &str| percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned();
    (!url.username().is_empty()).then(|| (decode(url.username()), decode(url.password().unwrap_or(""))))
}

impl Client {
    async fn send(&mut self, method: &str, uri: &str, headers: &[(&str, &str)]) -> anyhow::Result<u32> {
        self.cseq += 1;
        let mut req = Request::new(method, uri, self.cseq);
        req.headers.set("User-Agent", USER_AGENT);
        for (n, v) in headers {
            req.headers.set(n, *v);
        }
        if let Some(s) = &self.session {
            req.headers.set("Session", s.clone());
        }
        if let (Some(c), Some((user, password))) = (&self.challenge, &self.credentials) {
            self.nc += 1;
            let cnonce = format!("{:08x}", self.cseq.wrapping_mul(0x9e37_79b9) ^ std::process::id());
            req.headers.set("Authorization", c.authorization(user, password, method, uri, self.nc, &cnonce));
        }
        self.tcp.write_all(&req.to_bytes()).await?;
        Ok(self.cseq)
    }

    /// One request and its response (interleaved data and other messages in between are
    /// skipped).
    async fn request(&mut self, method: &str, uri: &str, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
        let r = self.request_once(method, uri, headers).await?;
        if r.status != 401 || self.credentials.is_none() {
            return Ok(r);
        }
        // Challenged (first time, or a stale nonce): answer it once.
        let offered = r.headers.0.iter().filter(|(n, _)| n.eq_ignore_ascii_case("WWW-Authenticate")).map(|(_, v)| v.as_str());
        let challenge = Challenge::choose(offered).ok_or_else(|| {
            let all: Vec<&str> = r.headers.0.iter().filter(|(n, _)| n.eq_ignore_ascii_case("WWW-Authenticate")).map(|(_, v)| v.as_str()).collect();
            anyhow!("{method}: the upstream asks for an authentication this proxy does not speak: {all:?}")
        })?;
        (self.challenge, self.nc) = (Some(challenge), 0);
        let r = self.request_once(method, uri, headers).await?;
        if r.status == 401 {
            bail!("{method}: the upstream refused the source URL's credentials");
        }
        Ok(r)
    }

    async fn request_once(&mut self, method: &str, uri: &str, headers: &[(&str, &str)]) -> anyhow::Result<Response> {
        let cseq = self.send(method, uri, headers).await?;
        let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
        loop {
            while let Some(msg) = self.next_message()? {
                if let Message::Response(r) = msg {
                    if r.headers.cseq() == Some(cseq) {
                        return Ok(r);
                    }
                }
            }
            tokio::time::timeout_at(deadline, self.fill()).await.map_err(|_| anyhow!("{method}: no answer in {REQUEST_TIMEOUT:?}"))??;
        }
    }

    fn next_message(&mut self) -> anyhow::Result<Option<Message>> {
        match decode(&self.buf).context("upstream's RTSP framing")? {
            Some((m, used)) => {
                self.buf.drain(..used);
                Ok(Some(m))
            }
            None => Ok(None),
        }
    }

    async fn fill(&mut self) -> anyhow::Result<()> {
        let mut chunk = [0u8; 4096];
        let n = self.tcp.read(&mut chunk).await?;
        if n == 0 {
            bail!("the upstream closed the connection");
        }
        self.buf.extend_from_slice(&chunk[..n]);
        Ok(())
    }

    /// Keep the upstream's session alive while its media arrives; fail when the connection
    /// closes, the framing breaks, or every track has been silent for [`MEDIA_TIMEOUT`]; end
    /// (Ok) when an on-demand path has had no viewer for its release time.
    async fn keep_alive(&mut self, proxy: &RtspProxy, path: &PathState, base: &url::Url, every: Duration, uids: &[u32], narrowed: bool) -> anyhow::Result<()> {
        let mut unwatched_since = Instant::now();
        let mut keepalive = tokio::time::interval(every);
        keepalive.tick().await;
        let mut watchdog = tokio::time::interval(Duration::from_secs(1));
        let (mut last_count, mut last_change) = (0u64, Instant::now());
        let mut method = "GET_PARAMETER";
        // A keep-alive sent again to answer a fresh challenge (at most once in a row).
        let mut answered_challenge = false;
        loop {
            tokio::select! {
                _ = keepalive.tick() => { self.send(method, base.as_str(), &[]).await?; }
                r = self.fill() => {
                    r?;
                    while let Some(m) = self.next_message()? {
                        let Message::Response(r) = m else { continue };
                        if matches!(r.status, 405 | 501) && method == "GET_PARAMETER" {
                            // Servers without GET_PARAMETER take OPTIONS as a keep-alive.
                            method = "OPTIONS";
                        }
                        // A Digest nonce expired (a camera's live for minutes): answer the new
                        // challenge now, or the session would lapse unrefreshed.
                        let offered = r.headers.0.iter().filter(|(n, _)| n.eq_ignore_ascii_case("WWW-Authenticate")).map(|(_, v)| v.as_str());
                        match Challenge::choose(offered) {
                            Some(c) if r.status == 401 && !answered_challenge && self.credentials.is_some() => {
                                (self.challenge, self.nc, answered_challenge) = (Some(c), 0, true);
                                self.send(method, base.as_str(), &[]).await?;
                            }
                            _ => answered_challenge = false,
                        }
                    }
                }
                _ = watchdog.tick() => {
                    if let Some(release) = path.on_demand {
                        if proxy.viewers_of(&path.name) > 0 {
                            unwatched_since = Instant::now();
                        } else if unwatched_since.elapsed() >= release {
                            return Ok(());
                        }
                    }
                    let counters = proxy.manager.stream_counters(uids);
                    let count: u64 = counters.values().map(|c| c.rx_packets).sum();
                    if count != last_count {
                        (last_count, last_change) = (count, Instant::now());
                    } else if last_change.elapsed() > MEDIA_TIMEOUT {
                        if narrowed && count == 0 {
                            // Nothing at all on the SSRC the camera named: perhaps everything on
                            // another (`drop_no_stream`). The next pull takes any.
                            path.ssrc_unreliable.store(true, std::sync::atomic::Ordering::Relaxed);
                            bail!("no media on the SSRC the upstream named for {MEDIA_TIMEOUT:?}: pulled again taking any SSRC (WHEP off for this path)");
                        }
                        bail!("no media for {MEDIA_TIMEOUT:?}");
                    }
                }
            }
        }
    }
}
