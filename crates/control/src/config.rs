//! `serve` configuration: a TOML file whose every key has a default, so an empty file (or none)
//! is a working configuration.
//!
//! Every key can also be set from the environment as `MEDIAPLANE_<SECTION>_<KEY>` (upper case:
//! `MEDIAPLANE_API_LISTEN`, `MEDIAPLANE_DATAPLANE_PIN_DIR`), derived from the structure below so a
//! new key is covered without more code ([`Config::resolve`]). Precedence: defaults < file <
//! environment < command-line flags. The API token can come from a file (`api.token_file`).

use serde::{Deserialize, Serialize};
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub api: ApiConfig,
    pub dataplane: DataplaneConfig,
    pub media: MediaConfig,
    pub store: StoreConfig,
    pub log: LogConfig,
    pub limits: Limits,
    pub ng: NgSection,
    pub metrics: MetricsSection,
    pub rtsp: RtspSection,
}

/// The RTSP proxy: cameras and media servers pulled once, watched by many viewers.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct RtspSection {
    /// TCP address of the RTSP server; none = no RTSP proxy.
    pub listen: Option<SocketAddr>,
    /// A viewer's session ends this long after its last request (RFC 2326 §12.37; clients
    /// keep it alive with GET_PARAMETER or OPTIONS).
    pub session_timeout_secs: u64,
    /// Connections one client address may hold at once (viewers behind one NAT share one);
    /// more are closed at once and counted.
    pub max_connections_per_client: usize,
    /// Sessions (viewers' and publishers') one client address may hold at once; the next SETUP
    /// that would open another is answered 453.
    pub max_sessions_per_client: usize,
    /// The paths served: `rtsp://<listen>/<name>` is `source` pulled once.
    pub paths: Vec<RtspPath>,
}

impl Default for RtspSection {
    fn default() -> Self {
        RtspSection { listen: None, session_timeout_secs: 60, max_connections_per_client: 64, max_sessions_per_client: 64, paths: Vec::new() }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RtspPath {
    /// Letters, digits, '-', '_' or '.': the URL path viewers ask for.
    pub name: String,
    /// The upstream: `rtsp://host[:port]/path` (a camera, another server); or `publisher`: the
    /// path is published into (ANNOUNCE and RECORD, as ffmpeg and GStreamer's `rtspclientsink`
    /// do), one publisher at a time.
    pub source: String,
    /// Pulled only while watched: from the first viewer's DESCRIBE or SETUP until
    /// `release_after_secs` after the last viewer left. Otherwise pulled from start-up on.
    #[serde(default)]
    pub on_demand: bool,
    #[serde(default = "default_release_after")]
    pub release_after_secs: u64,
    /// Who may watch, as `name:password` (Digest or Basic); empty: anyone who reaches
    /// `rtsp.listen`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub read_users: Vec<String>,
    /// Who may publish into a `publisher` path, as `name:password` (at least one: the newest
    /// publisher takes the path).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub publish_users: Vec<String>,
}

/// [`RtspPath::source`] of a path that is published into rather than pulled.
pub const RTSP_PUBLISHER: &str = "publisher";

/// The host of an `rtsp://` URL (None: not one).
fn url_host(s: &str) -> Option<&str> {
    let rest = s.strip_prefix("rtsp://")?;
    let authority = rest.split(['/', '?', '#']).next().unwrap_or("");
    let host_port = authority.rsplit('@').next().unwrap_or("");
    Some(match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host_port.split(':').next().unwrap_or(""),
    })
}

fn default_release_after() -> u64 {
    10
}

impl RtspPath {
    /// What a path must be, declared in the config or through the API.
    pub fn validate(&self) -> Result<(), String> {
        // It becomes part of a room id (`rtsp.<name>`), so the same characters.
        let name = &self.name;
        if name.is_empty() || name.len() > 48 || !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) {
            return Err(format!("name {name:?} must be 1-48 letters, digits, '-', '_' or '.'"));
        }
        if self.is_published() {
            if self.on_demand {
                return Err(format!("{name:?}: a publisher path is not pulled, so not on demand either"));
            }
            // The newest publisher takes the path: without credentials anyone who reaches the
            // listener could replace it, and feed its viewers.
            if self.publish_users.is_empty() {
                return Err(format!("{name:?}: a publisher path needs publish_users (name:password of each encoder allowed)"));
            }
        } else {
            // The source is never repeated back: it may carry a password.
            let url = url_host(&self.source)
                .ok_or_else(|| format!("{name:?}: the source must be an rtsp://[user:password@]host[:port]/path URL, or {RTSP_PUBLISHER:?}"))?;
            if url.is_empty() {
                return Err(format!("{name:?}: the source has no host"));
            }
            if !self.publish_users.is_empty() {
                return Err(format!("{name:?}: publish_users is for a path whose source is {RTSP_PUBLISHER:?}"));
            }
        }
        for (list, users) in [("read_users", &self.read_users), ("publish_users", &self.publish_users)] {
            if !users.iter().all(|u| u.split_once(':').is_some_and(|(n, p)| !n.is_empty() && !p.is_empty() && !n.contains(['"', '\\']))) {
                return Err(format!("{name:?}: {list} entries are name:password (both non-empty, no quote in the name)"));
            }
        }
        if self.release_after_secs == 0 && self.on_demand {
            return Err(format!("{name:?}: release_after_secs must be at least 1"));
        }
        Ok(())
    }

    /// `name=rtsp://...`, as `--rtsp-path` takes it.
    pub fn parse_arg(s: &str) -> Result<RtspPath, String> {
        let (name, source) = s.split_once('=').ok_or_else(|| format!("{s:?}: expected name=rtsp://host/path or name=publisher"))?;
        Ok(RtspPath {
            name: name.to_string(),
            source: source.to_string(),
            on_demand: false,
            release_after_secs: default_release_after(),
            read_users: Vec::new(),
            publish_users: Vec::new(),
        })
    }

    /// Published into (ANNOUNCE/RECORD) rather than pulled from an upstream.
    pub fn is_published(&self) -> bool {
        self.source == RTSP_PUBLISHER
    }
}

/// What `/metrics` exports beyond the per-plane totals.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MetricsSection {
    /// Series per stream (`mediaplane_stream_*`, labelled with the stream's id and label): off
    /// by default, as they are several series per session (millions at scale).
    pub per_stream: bool,
    /// Series per consumer (`mediaplane_consumer_*`, labelled with the consumer's id and
    /// `room/subscriber<-publisher/stream`), and the consumers in `/v1/stats`: off by default, as
    /// a room of N publishing participants has N×(N-1) of them.
    pub per_consumer: bool,
}

/// The rtpengine NG protocol listener (SIP servers drive calls through it).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct NgSection {
    /// UDP address; none = no NG listener. Anything but loopback needs `allow`.
    pub listen: Option<SocketAddr>,
    /// Delete calls whose media stopped this long.
    pub media_timeout_secs: u64,
    /// SIP servers allowed to send commands (the protocol has no authentication).
    pub allow: Vec<IpAddr>,
    /// Where recorded calls (`record-call`, `start recording`) go: a pcap and a metadata file
    /// per call. None: nothing is recorded, and a request asking for it is told so.
    pub recording_dir: Option<PathBuf>,
    /// This relay's mark in SDP it produces with the `loop-protect` flag (`a=rtpengine:<id>`);
    /// none: 12 random hex digits chosen at start (as rtpengine does), stable until a restart.
    pub instance_id: Option<String>,
    /// Each DTMF event a party of an NG call sends is reported here, one JSON object per UDP
    /// datagram, as rtpengine's `--dtmf-log-dest` does. None: not reported.
    pub dtmf_log_dest: Option<SocketAddr>,
    /// Where NG `start forwarding` sends a call's media: one more copy of each party's RTP,
    /// from an address of its own per party. None: the command is an error.
    pub forward_to: Option<SocketAddr>,
}

impl Default for NgSection {
    fn default() -> Self {
        NgSection { listen: None, media_timeout_secs: 60, allow: Vec::new(), recording_dir: None, instance_id: None, dtmf_log_dest: None, forward_to: None }
    }
}

/// Caps on what one daemon will hold; reaching one is a clear error, never an allocation.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    pub max_rooms: usize,
    pub max_participants_per_room: usize,
    pub max_streams_per_participant: usize,
    /// Fan-out cap: subscribers of one stream.
    pub max_subscribers_per_stream: usize,
    pub max_relays: usize,
    /// Per-stream limit on what a publisher may inject, enforced in both data planes;
    /// 0 = no limit. The bucket holds `stream_burst_ms` worth of the rate.
    pub stream_pps: u32,
    pub stream_kbps: u64,
    pub stream_burst_ms: u32,
    /// Per-source limit: one bucket per source IP address, over everything it sends to any SFU
    /// address (media it may send, STUN, first packets), enforced in both data planes after the
    /// source check (strangers are dropped anyway and never charged); 0 = no limit, the default:
    /// one address legitimately carries many streams (a SIP trunk or SBC relays every call from
    /// one address), so only the operator knows a safe value. Excess is counted as
    /// `drop_source_limited`.
    pub source_pps: u32,
    pub source_kbps: u64,
    pub source_burst_ms: u32,
}

impl Limits {
    /// The per-source rate limit the table carries, if any is configured.
    pub fn source_rate(&self) -> Option<mediaplane_core::RateLimit> {
        (self.source_pps > 0 || self.source_kbps > 0).then_some(mediaplane_core::RateLimit {
            pps: self.source_pps,
            bps: self.source_kbps * 1000,
            burst_ms: self.source_burst_ms,
        })
    }

    /// The per-stream rate limit the table carries, if any is configured.
    pub fn stream_rate(&self) -> Option<mediaplane_core::RateLimit> {
        (self.stream_pps > 0 || self.stream_kbps > 0).then_some(mediaplane_core::RateLimit {
            pps: self.stream_pps,
            bps: self.stream_kbps * 1000,
            burst_ms: self.stream_burst_ms,
        })
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_rooms: 10_000,
            max_participants_per_room: 256,
            max_streams_per_participant: 8,
            max_subscribers_per_stream: 256,
            max_relays: 1_000_000,
            stream_pps: 0,
            stream_kbps: 0,
            stream_burst_ms: mediaplane_core::RateLimit::DEFAULT_BURST_MS,
            source_pps: 0,
            source_kbps: 0,
            source_burst_ms: mediaplane_core::RateLimit::DEFAULT_BURST_MS,
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct ApiConfig {
    /// HTTP/JSON API address. Loopback by default: the API has no authentication yet.
    pub listen: SocketAddr,
    /// Largest request body accepted, bytes.
    pub max_body: usize,
    /// Largest body of `POST /v1/batch/relays` (thousands of relays in one request).
    pub max_batch_body: usize,
    /// Bearer token required on every request; mandatory when `listen` is not loopback.
    pub token: Option<String>,
    /// A file holding the token instead (one line; a trailing newline is not part of it), so the
    /// secret stays out of the configuration and the environment. Not both.
    pub token_file: Option<PathBuf>,
    /// A request taking longer than this is answered 503.
    pub timeout_ms: u64,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum DataplaneKind {
    Userspace,
    Ebpf,
    /// Kernel bypass: an XDP program hands the SFU's datagrams to AF_XDP sockets on
    /// `interfaces`; the user-space engine forwards them from its own frames.
    Afxdp,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct DataplaneConfig {
    pub kind: DataplaneKind,
    /// User-space workers (0 = one per core) and datagrams per recvmmsg.
    pub workers: usize,
    pub batch: usize,
    /// eBPF and AF_XDP: interfaces to attach the programs to (media arrives on them).
    pub interfaces: Vec<String>,
    /// eBPF: bpffs directory for pinned maps and links (per instance).
    pub pin_dir: PathBuf,
    /// eBPF: start even if a LIVE instance holds `pin_dir`, sharing its maps and links.
    /// Dangerous (two daemons writing the same maps); off, a live holder is a start-up error.
    /// A dead instance's pins are adopted either way (hitless restart).
    pub adopt_live_pins: bool,
    /// eBPF: kernel map sizes: stream entries (an SFU stream or one relay direction) and
    /// fan-out copy slots. Memory grows with them; a full map is a clear error.
    pub max_streams: u32,
    pub max_copies: u32,
    /// eBPF: an XDP pre-filter drops certain strangers before the TC program sees them:
    /// "auto" (every interface but veth, where it makes the driver copy every packet), "on",
    /// "off" (e.g. when another XDP program must own the interfaces); true/false mean on/off.
    pub xdp_prefilter: XdpPrefilterMode,
    /// DSCP (0-63) of every copy on every plane; ECN is Not-ECT, TTL/hop limit the host's.
    pub dscp: u8,
    /// eBPF: verify the IPv4 header and UDP checksums of what the kernel forwards when the
    /// device did not (bad ones are dropped and counted as `drop_bad_checksum`). Off only for
    /// A/B measurements: the host drops such packets, the kernel path would fan them out.
    pub verify_checksums: bool,
    /// eBPF: reverse-path check of IPv6 sources ("off", "loose", "strict"); IPv4 follows each
    /// interface's `rp_filter` sysctl as the kernel does. Spoofed sources: `drop_spoofed`.
    pub rp_filter_v6: RpFilterMode,
    /// eBPF: while packets of a stream the kernel handed to the slow path (unresolved neighbour,
    /// copy over the MTU) are not sent yet, hand its later packets up too, so none overtakes
    /// another. Off only for A/B measurements (`pass_in_order` counts what it held).
    pub hold_order: bool,
    /// Every plane: account each consumer's RTP as forwarded (the consumer view's `forwarded`,
    /// `mediaplane_consumer_rtp_*`). Off saves the eBPF program a locked update per copy
    /// (BENCHMARKS.md); consumers then have no `forwarded`.
    pub forwarded_qos: bool,
    /// Every plane: keep what went to each video consumer the SFU makes copies for in user
    /// space (a browser's, all SRTP) for a second, and answer its NACKs from that instead of
    /// asking the publisher. Off: NACKs go to the publisher (rate-bounded), as before.
    pub retransmit: bool,
    /// AF_XDP: how its sockets bind: "auto" (zero-copy where the driver supports it, copy
    /// otherwise), "copy", or "zerocopy" (a start-up error where the driver cannot).
    pub afxdp_mode: AfxdpMode,
    /// AF_XDP: packet frames (2 KiB each) per interface queue, a power of two from 64 to 65,536:
    /// half receive, half carry copies out. Locked memory (RLIMIT_MEMLOCK).
    pub afxdp_frames: u32,
}

/// See [`DataplaneConfig::afxdp_mode`].
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum AfxdpMode {
    #[default]
    Auto,
    Copy,
    Zerocopy,
}

/// A reverse-path check mode, as rp_filter names them.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum RpFilterMode {
    #[default]
    Off,
    Loose,
    Strict,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase", try_from = "XdpPrefilterRepr")]
pub enum XdpPrefilterMode {
    #[default]
    Auto,
    On,
    Off,
}

/// What the key may say: a mode, or the boolean older configurations used.
#[derive(Deserialize)]
#[serde(untagged)]
enum XdpPrefilterRepr {
    Bool(bool),
    Text(String),
}

impl TryFrom<XdpPrefilterRepr> for XdpPrefilterMode {
    type Error = String;
    fn try_from(r: XdpPrefilterRepr) -> Result<Self, String> {
        match r {
            XdpPrefilterRepr::Bool(true) => Ok(XdpPrefilterMode::On),
            XdpPrefilterRepr::Bool(false) => Ok(XdpPrefilterMode::Off),
            XdpPrefilterRepr::Text(t) => match t.as_str() {
                "auto" => Ok(XdpPrefilterMode::Auto),
                "on" => Ok(XdpPrefilterMode::On),
                "off" => Ok(XdpPrefilterMode::Off),
                _ => Err(format!("dataplane.xdp_prefilter must be \"auto\", \"on\" or \"off\", not {t:?}")),
            },
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct MediaConfig {
    /// SFU address used when a participant or relay leg is created without a local address.
    pub ip: IpAddr,
    /// Port range for allocated local addresses (RTP even; the odd port above is kept for RTCP).
    pub port_min: u16,
    pub port_max: u16,
    /// How long a relay leg follows new sources of its party after each signal (offer,
    /// answer), in milliseconds, before it locks the last one (rtpengine: 3 s).
    pub learning_ms: u64,
    /// Named media interfaces for relays, in rtpengine's `interface=` notation: `name/address`
    /// or `name/address!advertised` (behind a 1:1 NAT), or a bare address (named `default`).
    /// A name may be listed once per address family (`external/203.0.113.7`,
    /// `external/2001:db8::7`): NG's `direction`/`from-interface`/`to-interface` pick the
    /// interface of each party, `address-family` the family. Empty: one interface, `default`,
    /// on `ip`. The NG default is the one named `default`, else the first listed.
    pub interfaces: Vec<MediaInterface>,
}

/// One address of a named media interface (see [`MediaConfig::interfaces`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct MediaInterface {
    pub name: String,
    /// Where the relay's sockets are bound.
    pub ip: IpAddr,
    /// What the SDP advertises, when it is not `ip` (the public side of a NAT).
    pub advertise: Option<IpAddr>,
}

impl MediaInterface {
    /// The address the SDP carries.
    pub fn advertised(&self) -> IpAddr {
        self.advertise.unwrap_or(self.ip)
    }
}

impl TryFrom<String> for MediaInterface {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        let (name, rest) = s.split_once('/').unwrap_or(("default", &s));
        let (ip, advertise) = match rest.split_once('!') {
            Some((ip, adv)) => (ip, Some(adv)),
            None => (rest, None),
        };
        let addr = |a: &str| a.trim().parse::<IpAddr>().map_err(|e| format!("media interface {s:?}: {a:?} is not an IP address ({e})"));
        let iface = MediaInterface { name: name.trim().to_string(), ip: addr(ip)?, advertise: advertise.map(addr).transpose()? };
        if iface.name.is_empty() || !iface.name.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c)) {
            return Err(format!("media interface {s:?}: the name must be letters, digits, '-', '_' or '.'"));
        }
        if iface.ip.is_unspecified() {
            return Err(format!("media interface {s:?}: the address must be concrete, not 0.0.0.0 or ::"));
        }
        if iface.advertise.is_some_and(|a| a.is_ipv4() != iface.ip.is_ipv4()) {
            return Err(format!("media interface {s:?}: the advertised address is of another family"));
        }
        Ok(iface)
    }
}

impl From<MediaInterface> for String {
    fn from(i: MediaInterface) -> String {
        match i.advertise {
            Some(a) => format!("{}/{}!{}", i.name, i.ip, a),
            None => format!("{}/{}", i.name, i.ip),
        }
    }
}

/// Why no relay address could be chosen on a media interface.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InterfaceError {
    #[error("no media interface is named {0:?} (configured: {1})")]
    Unknown(String, String),
    #[error("media interface {0:?} has no IPv{1} address")]
    NoFamily(String, u8),
    /// An answer would move its sender's leg, whose address the sender already has.
    #[error("the answer asks for {0}, but its sender was offered {1}; only an offer can move a party")]
    AnswerMoves(String, String),
}

impl MediaConfig {
    /// The relay interfaces: the configured ones, or `default` on `ip`.
    pub fn relay_interfaces(&self) -> Vec<MediaInterface> {
        if self.interfaces.is_empty() {
            vec![MediaInterface { name: "default".into(), ip: self.ip, advertise: None }]
        } else {
            self.interfaces.clone()
        }
    }

    /// The address to bind on interface `name` (the default one when `None`), in family `v4`
    /// (true: IPv4) when given, else the interface's first address.
    pub fn interface_address(&self, name: Option<&str>, v4: Option<bool>) -> Result<MediaInterface, InterfaceError> {
        let all = self.relay_interfaces();
        let name = match name {
            Some(n) => n.to_string(),
            None => all.iter().find(|i| i.name == "default").unwrap_or(&all[0]).name.clone(),
        };
        let named: Vec<&MediaInterface> = all.iter().filter(|i| i.name == name).collect();
        if named.is_empty() {
            let mut names: Vec<&str> = all.iter().map(|i| i.name.as_str()).collect();
            names.dedup();
            return Err(InterfaceError::Unknown(name, names.join(", ")));
        }
        match v4 {
            None => Ok(named[0].clone()),
            Some(v4) => named.iter().find(|i| i.ip.is_ipv4() == v4).map(|i| (*i).clone()).ok_or(InterfaceError::NoFamily(name, if v4 { 4 } else { 6 })),
        }
    }

    /// The interface whose address `ip` is (to find what to advertise for a relay socket).
    pub fn interface_of(&self, ip: IpAddr) -> Option<MediaInterface> {
        self.relay_interfaces().into_iter().find(|i| i.ip == ip)
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct StoreConfig {
    /// SQLite file holding sessions across restarts (the embedded store, the default).
    pub path: PathBuf,
    /// A Redis server instead (`redis://host:port/db` or `redis+unix:///path/redis.sock`): the
    /// sessions outside this machine.
    pub url: Option<String>,
    /// The Redis keys' prefix (`<prefix>:rooms`, `<prefix>:relays`, ...): one per deployment
    /// sharing a Redis.
    pub key_prefix: String,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct LogConfig {
    /// `text` or `json`.
    pub format: String,
    /// tracing filter, e.g. `info` or `mediaplane_control=debug`.
    pub level: String,
}

impl Default for ApiConfig {
    fn default() -> Self {
        ApiConfig { listen: "127.0.0.1:7580".parse().unwrap(), max_body: 64 * 1024, max_batch_body: 4 << 20, token: None, token_file: None, timeout_ms: 5000 }
    }
}
impl Default for DataplaneConfig {
    fn default() -> Self {
        DataplaneConfig {
            kind: DataplaneKind::Userspace,
            workers: 0,
            batch: 32,
            interfaces: Vec::new(),
            pin_dir: PathBuf::from("/sys/fs/bpf/mediaplane"),
            adopt_live_pins: false,
            max_streams: 16384,
            max_copies: 65536,
            xdp_prefilter: XdpPrefilterMode::Auto,
            afxdp_mode: AfxdpMode::Auto,
            afxdp_frames: 4096,
            dscp: 0,
            verify_checksums: true,
            rp_filter_v6: RpFilterMode::Off,
            hold_order: true,
            forwarded_qos: true,
            retransmit: true,
        }
    }
}
impl Default for MediaConfig {
    fn default() -> Self {
        MediaConfig { ip: "127.0.0.1".parse().unwrap(), port_min: 30000, port_max: 39999, learning_ms: 3000, interfaces: Vec::new() }
    }
}
impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig { path: PathBuf::from("mediaplane.db"), url: None, key_prefix: "mediaplane".into() }
    }
}
impl Default for LogConfig {
    fn default() -> Self {
        LogConfig { format: "text".into(), level: "info".into() }
    }
}

impl Config {
    pub fn from_toml(text: &str) -> Result<Config, String> {
        let c: Config = toml::from_str(text).map_err(|e| e.to_string())?;
        c.validate()?;
        Ok(c)
    }

    /// The configuration `serve` runs with before its command-line flags: the defaults, the file
    /// (if any) over them, `MEDIAPLANE_<SECTION>_<KEY>` variables of `env` over that, and the
    /// token read from `api.token_file`. Not validated: the caller applies its flags, then
    /// [`Config::validate`].
    ///
    /// A value is read as TOML (`8`, `true`, `["eth1", "eth2"]`), else as a string, else as a
    /// comma-separated list (`MEDIAPLANE_DATAPLANE_INTERFACES=eth1,eth2`), whichever the key
    /// takes. A variable naming a section but no key of it (`MEDIAPLANE_API_LISTN`) is an error;
    /// other `MEDIAPLANE_*` variables (the client's `MEDIAPLANE_API`, `MEDIAPLANE_TOKEN`) are not
    /// configuration and are left alone.
    pub fn resolve(file: Option<&Path>, env: impl IntoIterator<Item = (String, String)>) -> Result<Config, String> {
        let mut table = match file {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                text.parse::<toml::Table>().map_err(|e| format!("{}: {e}", path.display()))?
            }
            None => toml::Table::new(),
        };
        // Check the file alone first, so its errors name it.
        if let Some(path) = file {
            table_to_config(&table).map_err(|e| format!("{}: {e}", path.display()))?;
        }
        let keys = config_keys();
        let mut env: Vec<(String, String)> = env.into_iter().filter(|(k, _)| k.starts_with(ENV_PREFIX)).collect();
        env.sort();
        for (var, value) in env {
            let Some((section, key)) = env_key(&keys, &var)? else { continue };
            let v = env_value(section, key, &value).map_err(|e| format!("{var}={value:?}: {e}"))?;
            table
                .entry(section)
                .or_insert_with(|| toml::Value::Table(toml::Table::new()))
                .as_table_mut()
                .ok_or_else(|| format!("[{section}] is not a table"))?
                .insert(key.to_string(), v);
        }
        let mut cfg = table_to_config(&table)?;
        cfg.api.read_token_file()?;
        Ok(cfg)
    }

    pub fn load(path: &Path) -> Result<Config, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        Config::from_toml(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn validate(&self) -> Result<(), String> {
        if self.api.timeout_ms == 0 {
            return Err("api.timeout_ms must be at least 1 (every request would time out)".into());
        }
        if self.media.port_min == 0 || self.media.port_min > self.media.port_max {
            return Err(format!("media port range {}-{} is empty or starts at 0", self.media.port_min, self.media.port_max));
        }
        if self.media.ip.is_unspecified() {
            return Err("media.ip must be a concrete address, not 0.0.0.0 or ::".into());
        }
        let mut seen = std::collections::BTreeSet::new();
        for i in &self.media.interfaces {
            if !seen.insert((i.name.as_str(), i.ip.is_ipv4())) {
                let family = if i.ip.is_ipv4() { 4 } else { 6 };
                return Err(format!("media.interfaces: {:?} has more than one IPv{family} address (one per family)", i.name));
            }
        }
        if !self.api.listen.ip().is_loopback() && self.api.token.as_deref().is_none_or(str::is_empty) {
            return Err(format!("api.listen {} is not loopback: set api.token or api.token_file (clients send it as a bearer token)", self.api.listen));
        }
        if let Some(ng) = self.ng.listen {
            if !ng.ip().is_loopback() && self.ng.allow.is_empty() {
                return Err(format!("ng.listen {ng} is not loopback: set ng.allow to the SIP servers that may send commands"));
            }
        }
        let mut names = std::collections::BTreeSet::new();
        for p in &self.rtsp.paths {
            p.validate().map_err(|e| format!("rtsp.paths: {e}"))?;
            if !names.insert(p.name.as_str()) {
                return Err(format!("rtsp.paths: {:?} is declared twice", p.name));
            }
        }
        if self.rtsp.session_timeout_secs == 0 {
            return Err("rtsp.session_timeout_secs must be at least 1".into());
        }
        if self.rtsp.max_connections_per_client == 0 {
            return Err("rtsp.max_connections_per_client must be at least 1".into());
        }
        if self.rtsp.max_sessions_per_client == 0 {
            return Err("rtsp.max_sessions_per_client must be at least 1".into());
        }
        if let Some(id) = &self.ng.instance_id {
            // It becomes an SDP attribute value: one token.
            if id.is_empty() || id.len() > 64 || !id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')) {
                return Err(format!("ng.instance_id {id:?} must be 1-64 letters, digits, '-', '_' or '.'"));
            }
        }
        if self.dataplane.dscp > 63 {
            return Err(format!("dataplane.dscp must be 0-63, not {}", self.dataplane.dscp));
        }
        if !matches!(self.log.format.as_str(), "text" | "json") {
            return Err(format!("log.format must be \"text\" or \"json\", not {:?}", self.log.format));
        }
        Ok(())
    }
}

impl ApiConfig {
    /// Read `token_file` into `token`: one trailing newline (`\n` or `\r\n`) is dropped, an
    /// unreadable or empty file, or a token set both ways, is an error.
    pub fn read_token_file(&mut self) -> Result<(), String> {
        let Some(path) = &self.token_file else { return Ok(()) };
        if self.token.is_some() {
            return Err("api.token and api.token_file are both set: use one".into());
        }
        let text = std::fs::read_to_string(path).map_err(|e| format!("api.token_file {}: {e}", path.display()))?;
        let token = text.strip_suffix('\n').map(|t| t.strip_suffix('\r').unwrap_or(t)).unwrap_or(&text);
        if token.is_empty() {
            return Err(format!("api.token_file {} is empty", path.display()));
        }
        if token.contains(['\n', '\r']) {
            return Err(format!("api.token_file {}: the token must be one line", path.display()));
        }
        self.token = Some(token.to_string());
        Ok(())
    }
}

const ENV_PREFIX: &str = "MEDIAPLANE_";

fn table_to_config(table: &toml::Table) -> Result<Config, String> {
    Config::deserialize(toml::Value::Table(table.clone())).map_err(|e| e.to_string())
}

/// (section, keys) of the configuration, from the defaults serialized (JSON keeps the `None`s of
/// optional keys as nulls, where TOML would drop them).
fn config_keys() -> Vec<(String, Vec<String>)> {
    let v = serde_json::to_value(Config::default()).expect("the default configuration serializes");
    let serde_json::Value::Object(sections) = v else { unreachable!("Config is a struct") };
    sections
        .into_iter()
        .map(|(name, section)| {
            let serde_json::Value::Object(keys) = section else { unreachable!("every section is a struct") };
            (name, keys.into_iter().map(|(k, _)| k).collect())
        })
        .collect()
}

/// The (section, key) a `MEDIAPLANE_*` variable names; None for one that names no section.
fn env_key<'k>(keys: &'k [(String, Vec<String>)], var: &str) -> Result<Option<(&'k str, &'k str)>, String> {
    let rest = &var[ENV_PREFIX.len()..];
    for (section, section_keys) in keys {
        let Some(key) = rest.strip_prefix(&section.to_uppercase()).and_then(|r| r.strip_prefix('_')) else { continue };
        return match section_keys.iter().find(|k| k.to_uppercase() == key) {
            Some(k) => Ok(Some((section, k))),
            None => Err(format!(
                "{var}: [{section}] has no key {:?} (its keys: {})",
                key.to_lowercase(),
                section_keys.iter().map(|k| format!("{ENV_PREFIX}{}_{}", section.to_uppercase(), k.to_uppercase())).collect::<Vec<_>>().join(", ")
            )),
        };
    }
    Ok(None)
}

/// `value` as the TOML value `section.key` takes: TOML, a string, or a comma-separated list.
fn env_value(section: &str, key: &str, value: &str) -> Result<toml::Value, String> {
    let fits = |v: &toml::Value| {
        let mut t = toml::Table::new();
        t.insert(section.to_string(), toml::Value::Table(toml::Table::from_iter([(key.to_string(), v.clone())])));
        table_to_config(&t)
    };
    let parsed = format!("v = {value}").parse::<toml::Table>().ok().and_then(|mut t| t.remove("v"));
    let mut first_error = None;
    let list = toml::Value::Array(value.split(',').map(|s| toml::Value::String(s.trim().to_string())).filter(|v| v.as_str() != Some("")).collect());
    for candidate in parsed.into_iter().chain([toml::Value::String(value.to_string()), list]) {
        match fits(&candidate) {
            Ok(_) => return Ok(candidate),
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Vec<(String, String)> {
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn every_key_has_an_environment_variable() {
        // Set every key of every section from the environment to its default's value written
        // as TOML: the result is the default, so each variable was recognised and parsed.
        let defaults = serde_json::to_value(Config::default()).unwrap();
        let mut vars = Vec::new();
        for (section, keys) in config_keys() {
            for key in keys {
                let v = &defaults[&section][&key];
                assert!(!v.is_object(), "{section}.{key} is a nested table: extend env_key to nested keys");
                if v.is_null() {
                    continue;
                }
                let toml_value: toml::Value = serde_json::from_value(v.clone()).unwrap();
                vars.push((format!("MEDIAPLANE_{}_{}", section.to_uppercase(), key.to_uppercase()), toml_value.to_string()));
            }
        }
        assert!(vars.len() > 30, "{vars:?}");
        assert_eq!(Config::resolve(None, vars).unwrap(), Config::default());
    }

    #[test]
    fn environment_over_file_over_defaults() {
        let dir = std::env::temp_dir().join(format!("mp-config-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("c.toml");
        std::fs::write(&file, "[api]\nlisten = \"127.0.0.1:9000\"\n[dataplane]\nworkers = 3\nbatch = 8\n").unwrap();
        let c = Config::resolve(
            Some(&file),
            env(&[
                ("MEDIAPLANE_DATAPLANE_WORKERS", "5"),
                ("MEDIAPLANE_DATAPLANE_KIND", "ebpf"),
                ("MEDIAPLANE_DATAPLANE_INTERFACES", "eth1, eth2"),
                ("MEDIAPLANE_DATAPLANE_PIN_DIR", "/sys/fs/bpf/x"),
                ("MEDIAPLANE_DATAPLANE_XDP_PREFILTER", "off"),
                ("MEDIAPLANE_NG_LISTEN", "127.0.0.1:2223"),
                ("MEDIAPLANE_NG_ALLOW", "[\"10.0.0.1\", \"10.0.0.2\"]"),
                ("MEDIAPLANE_LOG_LEVEL", "debug"),
                ("MEDIAPLANE_API_TOKEN", "12345"),
                ("MEDIAPLANE_LIMITS_SOURCE_PPS", "2000"),
                // The client's variables and others that name no section are not configuration.
                ("MEDIAPLANE_API", "http://127.0.0.1:7580"),
                ("MEDIAPLANE_TOKEN", "x"),
                ("MEDIAPLANE_FUZZ_SEED", "1"),
                ("PATH", "/usr/bin"),
            ]),
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(c.api.listen, "127.0.0.1:9000".parse().unwrap(), "file over default");
        assert_eq!(c.dataplane.batch, 8);
        assert_eq!(c.dataplane.workers, 5, "environment over file");
        assert_eq!(c.dataplane.kind, DataplaneKind::Ebpf);
        assert_eq!(c.dataplane.interfaces, ["eth1", "eth2"]);
        assert_eq!(c.dataplane.pin_dir, PathBuf::from("/sys/fs/bpf/x"));
        assert_eq!(c.dataplane.xdp_prefilter, XdpPrefilterMode::Off);
        assert_eq!(c.ng.listen, Some("127.0.0.1:2223".parse().unwrap()));
        assert_eq!(c.ng.allow.len(), 2);
        assert_eq!(c.log.level, "debug");
        assert_eq!(c.api.token.as_deref(), Some("12345"), "a number where a string goes is the string");
        assert_eq!(c.limits.source_pps, 2000);
    }

    #[test]
    fn bad_environment_variables_are_errors() {
        let e = Config::resolve(None, env(&[("MEDIAPLANE_API_LISTN", "127.0.0.1:1")])).unwrap_err();
        assert!(e.contains("MEDIAPLANE_API_LISTN") && e.contains("MEDIAPLANE_API_LISTEN"), "{e}");
        let e = Config::resolve(None, env(&[("MEDIAPLANE_DATAPLANE_WORKERS", "many")])).unwrap_err();
        assert!(e.contains("MEDIAPLANE_DATAPLANE_WORKERS"), "{e}");
        let e = Config::resolve(None, env(&[("MEDIAPLANE_DATAPLANE_KIND", "dpdk")])).unwrap_err();
        assert!(e.contains("dpdk"), "{e}");
        let e = Config::resolve(None, env(&[("MEDIAPLANE_API_LISTEN", "")])).unwrap_err();
        assert!(e.contains("MEDIAPLANE_API_LISTEN"), "{e}");
        let missing = std::path::Path::new("/nonexistent/mediaplane.toml");
        assert!(Config::resolve(Some(missing), env(&[])).unwrap_err().contains("/nonexistent/mediaplane.toml"));
    }

    #[test]
    fn token_from_a_file() {
        let dir = std::env::temp_dir().join(format!("mp-token-{}-{}", std::process::id(), line!()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = dir.join("token");
        let with = |text: &str, extra: &[(&str, &str)]| {
            std::fs::write(&f, text).unwrap();
            let mut vars = env(extra);
            vars.push(("MEDIAPLANE_API_TOKEN_FILE".into(), f.display().to_string()));
            Config::resolve(None, vars)
        };
        assert_eq!(with("s3cret\n", &[]).unwrap().api.token.as_deref(), Some("s3cret"));
        assert_eq!(with("s3cret\r\n", &[]).unwrap().api.token.as_deref(), Some("s3cret"));
        assert_eq!(with("s3cret", &[]).unwrap().api.token.as_deref(), Some("s3cret"));
        assert!(with("", &[]).unwrap_err().contains("empty"));
        assert!(with("\n", &[]).unwrap_err().contains("empty"));
        assert!(with("a\nb\n", &[]).unwrap_err().contains("one line"));
        assert!(with("s3cret\n", &[("MEDIAPLANE_API_TOKEN", "x")]).unwrap_err().contains("both"));
        let token_file = f.display().to_string();
        let _ = std::fs::remove_dir_all(&dir);
        let e = Config::resolve(None, env(&[("MEDIAPLANE_API_TOKEN_FILE", &token_file)])).unwrap_err();
        assert!(e.contains("api.token_file"), "{e}");
        // A non-loopback API with the token from a file is a valid configuration.
        let mut c = Config::default();
        c.api.listen = "0.0.0.0:7580".parse().unwrap();
        assert!(c.validate().unwrap_err().contains("api.token_file"));
        c.api.token = Some("t".into());
        c.validate().unwrap();
    }

    #[test]
    fn rtsp_paths_pulled_or_published() {
        let path = |extra: &str| Config::from_toml(&format!("[rtsp]\n[[rtsp.paths]]\nname = \"p\"\n{extra}\n")).and_then(|c| c.validate());
        path("source = \"rtsp://cam/x\"").unwrap();
        path("source = \"publisher\"\npublish_users = [\"ann:pw\"]\nread_users = [\"bob:pw\"]").unwrap();
        for (extra, says) in [
            ("source = \"http://cam/x\"", "rtsp://"),
            ("source = \"rtsp://cam/x\"\npublish_users = [\"ann:pw\"]", "publish_users is for"),
            ("source = \"publisher\"\non_demand = true", "not on demand"),
            ("source = \"publisher\"\npublish_users = [\"ann\"]", "publish_users entries"),
        ] {
            let e = path(extra).unwrap_err();
            assert!(e.contains(says), "{extra}: {e}");
        }
        let e = path("source = \"publisher\"").unwrap_err();
        assert!(e.contains("needs publish_users"), "{e}");
        assert!(RtspPath::parse_arg("in=publisher").unwrap().is_published());
    }

    #[test]
    fn a_zero_request_timeout_is_refused() {
        let e = Config::from_toml("[api]\ntimeout_ms = 0\n").and_then(|c| c.validate()).unwrap_err();
        assert!(e.contains("api.timeout_ms"), "{e}");
    }

    #[test]
    fn empty_file_is_the_default() {
        assert_eq!(Config::from_toml("").unwrap(), Config::default());
        assert!(Config::default().api.listen.ip().is_loopback());
    }

    #[test]
    fn partial_file_overrides_and_typos_are_errors() {
        let c = Config::from_toml("[dataplane]\nkind = \"ebpf\"\ninterfaces = [\"eth1\"]\n").unwrap();
        assert_eq!(c.dataplane.kind, DataplaneKind::Ebpf);
        assert_eq!(c.dataplane.batch, 32);
        assert!(!c.dataplane.adopt_live_pins, "sharing a live instance's pins is never the default");
        assert!(Config::from_toml("[dataplane]\nadopt_live_pins = true\n").unwrap().dataplane.adopt_live_pins);
        let e = Config::from_toml("[api]\nlisten_addr = \"x\"\n").unwrap_err();
        assert!(e.contains("listen_addr"), "{e}");
        let e = Config::from_toml("[media]\nport_min = 5000\nport_max = 10\n").unwrap_err();
        assert!(e.contains("port range"), "{e}");
        let e = Config::from_toml("[api]\nlisten = \"0.0.0.0:7580\"\n").unwrap_err();
        assert!(e.contains("api.token"), "{e}");
        assert!(Config::from_toml("[api]\nlisten = \"0.0.0.0:7580\"\ntoken = \"s3cret\"\n").is_ok());
        let e = Config::from_toml("[ng]\nlisten = \"0.0.0.0:2223\"\n").unwrap_err();
        assert!(e.contains("ng.allow"), "{e}");
        assert!(Config::from_toml("[ng]\nlisten = \"0.0.0.0:2223\"\nallow = [\"10.1.2.3\"]\n").is_ok());
        assert_eq!(Config::from_toml("[ng]\ninstance_id = \"mp-1\"\n").unwrap().ng.instance_id.as_deref(), Some("mp-1"));
        let e = Config::from_toml("[ng]\ninstance_id = \"a b\"\n").unwrap_err();
        assert!(e.contains("ng.instance_id"), "{e}");
    }

    #[test]
    fn source_limits_off_and_xdp_prefilter_auto_by_default() {
        let c = Config::default();
        assert_eq!(c.limits.source_rate(), None);
        assert_eq!(c.dataplane.xdp_prefilter, XdpPrefilterMode::Auto);
        let c = Config::from_toml("[limits]\nsource_pps = 2000\nsource_kbps = 5000\n[dataplane]\nxdp_prefilter = false\n").unwrap();
        assert_eq!(c.limits.source_rate(), Some(mediaplane_core::RateLimit { pps: 2000, bps: 5_000_000, burst_ms: 50 }));
        assert_eq!(c.dataplane.xdp_prefilter, XdpPrefilterMode::Off);
        for (text, want) in
            [("true", XdpPrefilterMode::On), ("\"on\"", XdpPrefilterMode::On), ("\"auto\"", XdpPrefilterMode::Auto), ("\"off\"", XdpPrefilterMode::Off)]
        {
            assert_eq!(Config::from_toml(&format!("[dataplane]\nxdp_prefilter = {text}\n")).unwrap().dataplane.xdp_prefilter, want);
        }
        let e = Config::from_toml("[dataplane]\nxdp_prefilter = \"maybe\"\n").unwrap_err();
        assert!(e.contains("auto"), "{e}");
        assert_eq!(Config::from_toml("[dataplane]\nrp_filter_v6 = \"strict\"\n").unwrap().dataplane.rp_filter_v6, RpFilterMode::Strict);
        assert!(Config::from_toml("[dataplane]\nrp_filter_v6 = \"yes\"\n").is_err());
    }

    #[test]
    fn per_stream_metrics_are_opt_in() {
        assert!(!Config::default().metrics.per_stream);
        assert!(Config::from_toml("[metrics]\nper_stream = true\n").unwrap().metrics.per_stream);
        assert!(!Config::default().metrics.per_consumer);
        assert!(Config::from_toml("[metrics]\nper_consumer = true\n").unwrap().metrics.per_consumer);
        assert!(Config::from_toml("[metrics]\nper_streams = true\n").is_err());
    }

    #[test]
    fn media_interfaces_in_rtpengine_notation() {
        let c = Config::from_toml("[media]\ninterfaces = [\"internal/10.0.0.1\", \"external/203.0.113.7!198.51.100.7\", \"external/fd00::7\"]\n").unwrap();
        let m = &c.media;
        assert_eq!(m.interfaces[1].advertised(), "198.51.100.7".parse::<IpAddr>().unwrap());
        // No `default`: the first listed is the default.
        assert_eq!(m.interface_address(None, None).unwrap().name, "internal");
        assert_eq!(m.interface_address(Some("external"), Some(false)).unwrap().ip, "fd00::7".parse::<IpAddr>().unwrap());
        assert_eq!(m.interface_address(Some("external"), None).unwrap().ip, "203.0.113.7".parse::<IpAddr>().unwrap());
        assert_eq!(m.interface_address(Some("internal"), Some(false)), Err(InterfaceError::NoFamily("internal".into(), 6)));
        let unknown = m.interface_address(Some("dmz"), None).unwrap_err().to_string();
        assert_eq!(unknown, "no media interface is named \"dmz\" (configured: internal, external)");
        assert_eq!(m.interface_of("fd00::7".parse().unwrap()).unwrap().name, "external");
        // Written back as it was read; from the environment as a comma-separated list.
        assert_eq!(String::from(m.interfaces[1].clone()), "external/203.0.113.7!198.51.100.7");
        let e = Config::resolve(None, env(&[("MEDIAPLANE_MEDIA_INTERFACES", "a/10.0.0.1, 10.0.0.2")])).unwrap();
        assert_eq!(e.media.interfaces.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(), ["a", "default"]);
        // None configured: `default` on media.ip.
        assert_eq!(MediaConfig::default().interface_address(None, Some(true)).unwrap().ip, MediaConfig::default().ip);
    }

    #[test]
    fn bad_media_interfaces_are_refused_with_a_reason() {
        for (text, why) in [
            ("x/300.0.0.1", "is not an IP address"),
            ("x/0.0.0.0", "must be concrete"),
            ("x/10.0.0.1!fd00::1", "another family"),
            ("a b/10.0.0.1", "the name must be"),
        ] {
            let e = Config::from_toml(&format!("[media]\ninterfaces = [{text:?}]\n")).unwrap_err();
            assert!(e.contains(why), "{text}: {e}");
        }
        let twice = Config::from_toml("[media]\ninterfaces = [\"x/10.0.0.1\", \"x/10.0.0.2\"]\n").unwrap_err();
        assert!(twice.contains("more than one IPv4 address"), "{twice}");
    }
}
