//! `mediaplane`: serve | ctl | demo | bench (the last two: the `mediaplane-harness` crate).

mod ctl;

use anyhow::Context;
use clap::{CommandFactory, Parser, Subcommand};
use mediaplane_control::{Config, DataplaneKind};
use mediaplane_dataplane::{Dataplane, DataplaneEvent, UserspaceConfig, UserspaceDataplane};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(name = "mediaplane", version, about = "Media forwarding plane for SFUs and SIP media relays, with an eBPF kernel fast path")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the daemon: HTTP/JSON API + a data plane, sessions kept in an embedded store.
    Serve(ServeArgs),
    /// Talk to a running daemon's API.
    Ctl(ctl::CtlArgs),
    /// Run a real multi-party conference in network namespaces and print what everyone received.
    Demo(mediaplane_harness::DemoArgs),
    /// Benchmarks: every data plane side by side in one run; writes JSON, CSV and an HTML report.
    #[command(subcommand)]
    Bench(mediaplane_harness::BenchCommand),
    /// Write the man pages (roff): mediaplane.1 to standard output, or it and one page per
    /// subcommand (mediaplane-serve.1, ...) into --out-dir.
    #[command(hide = true)]
    Man {
        #[arg(long)]
        out_dir: Option<PathBuf>,
    },
    /// Write a shell completion script to standard output.
    #[command(hide = true)]
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// TOML configuration file; every key has a default, and every key can be set from the
    /// environment as MEDIAPLANE_<SECTION>_<KEY> (e.g. MEDIAPLANE_API_LISTEN), over the file and
    /// under these flags (see README).
    #[arg(long, short, env = "MEDIAPLANE_CONFIG")]
    config: Option<PathBuf>,
    /// API listen address (overrides api.listen).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Data plane (overrides dataplane.kind).
    #[arg(long, value_parser = parse_kind)]
    dataplane: Option<DataplaneKind>,
    /// eBPF: interface to attach to; repeat for several (overrides dataplane.interfaces).
    #[arg(long = "interface")]
    interfaces: Vec<String>,
    /// eBPF: bpffs directory for this instance's pinned maps and links (overrides dataplane.pin_dir).
    #[arg(long)]
    pin_dir: Option<PathBuf>,
    /// eBPF: start even if a LIVE instance holds the pin dir, sharing its maps and links
    /// (sets dataplane.adopt_live_pins). DANGEROUS: two daemons then write the same maps and
    /// undo each other's tables. Not needed after a crash: a dead instance's pins are adopted.
    #[arg(long)]
    adopt_live_pins: bool,
    /// Store: a SQLite file path (overrides store.path), or a Redis URL (`redis://host:port/db`,
    /// `redis+unix:///path/redis.sock`; overrides store.url).
    #[arg(long)]
    store: Option<PathBuf>,
    /// User-space worker threads, 0 = one per core (overrides dataplane.workers).
    #[arg(long)]
    workers: Option<usize>,
    /// NG protocol (rtpengine-compatible, for Kamailio's/OpenSIPS's rtpengine module) on this
    /// UDP address (overrides ng.listen).
    #[arg(long)]
    ng_listen: Option<SocketAddr>,
    /// RTSP proxy on this TCP address (overrides rtsp.listen).
    #[arg(long)]
    rtsp_listen: Option<SocketAddr>,
    /// RTSP: serve an upstream as a path, `name=rtsp://host[:port]/path`, or a path publishers
    /// RECORD into, `name=publisher` (repeatable; added to rtsp.paths).
    #[arg(long = "rtsp-path", value_parser = mediaplane_control::config::RtspPath::parse_arg)]
    rtsp_paths: Vec<mediaplane_control::config::RtspPath>,
    /// NG: delete calls whose media stopped for this many seconds (overrides ng.media_timeout_secs).
    #[arg(long)]
    ng_media_timeout: Option<u64>,
    /// NG: report each DTMF event a party sends, as JSON over UDP to this address (rtpengine's
    /// --dtmf-log-dest; overrides ng.dtmf_log_dest).
    #[arg(long)]
    dtmf_log_dest: Option<SocketAddr>,
    /// Start empty: forget stored sessions (and, for eBPF, stale pinned state).
    #[arg(long)]
    reset: bool,
    /// eBPF: where the XDP pre-filter goes: auto (every interface but veth), on, off (sets
    /// dataplane.xdp_prefilter).
    #[arg(long, value_parser = ["auto", "on", "off"])]
    xdp_prefilter: Option<String>,
    /// eBPF: no XDP pre-filter (the same as --xdp-prefilter off).
    #[arg(long, conflicts_with = "xdp_prefilter")]
    no_xdp_prefilter: bool,
}

fn parse_kind(s: &str) -> Result<DataplaneKind, String> {
    match s {
        "userspace" => Ok(DataplaneKind::Userspace),
        "ebpf" => Ok(DataplaneKind::Ebpf),
        "afxdp" => Ok(DataplaneKind::Afxdp),
        _ => Err(format!("unknown data plane {s:?}: use userspace, ebpf or afxdp")),
    }
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Ctl(args) => ctl::run(args),
        Command::Demo(args) => mediaplane_harness::demo(args),
        Command::Bench(cmd) => mediaplane_harness::bench(cmd),
        Command::Man { out_dir } => man(out_dir),
        Command::Completions { shell } => {
            // Into memory first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "mediaplane", &mut script);
            std::io::Write::write_all(&mut std::io::stdout(), &script).map_err(Into::into)
        }
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

/// The man pages, from the same clap definitions as `--help`.
fn man(out_dir: Option<PathBuf>) -> anyhow::Result<()> {
    let cmd = Cli::command();
    let Some(dir) = out_dir else {
        clap_mangen::Man::new(cmd).render(&mut std::io::stdout())?;
        return Ok(());
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let write = |name: &str, c: clap::Command| -> anyhow::Result<()> {
        let path = dir.join(format!("{name}.1"));
        let mut out = Vec::new();
        clap_mangen::Man::new(c).title(name.to_string()).render(&mut out)?;
        std::fs::write(&path, out).with_context(|| format!("writing {}", path.display()))
    };
    for sub in cmd.get_subcommands().filter(|s| !s.is_hide_set()) {
        // clap takes a command's name as &'static str; this runs once, then the process exits.
        let name: &'static str = Box::leak(format!("mediaplane-{}", sub.get_name()).into_boxed_str());
        write(name, sub.clone().name(name))?;
    }
    write("mediaplane", cmd)
}

fn init_logging(cfg: &Config) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(&cfg.log.level));
    // Colour only for a person at a terminal: never into a file, a pipe or the journal.
    use std::io::IsTerminal;
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(std::io::stderr().is_terminal());
    if cfg.log.format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}

/// Raise the soft RLIMIT_NOFILE to the hard limit (what a service manager's LimitNOFILE allows)
/// and say what the data plane can hold with it: the user-space plane keeps one socket per SFU
/// address per worker; the eBPF plane's sessions cost no file descriptors.
fn raise_fd_limit(cfg: &Config) {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    let raised = unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) == 0 && {
            let soft = r.rlim_cur;
            r.rlim_cur = r.rlim_max;
            soft != r.rlim_max && libc::setrlimit(libc::RLIMIT_NOFILE, &r) == 0
        }
    };
    // SAFETY: as above.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) };
    let limit = r.rlim_cur;
    match cfg.dataplane.kind {
        DataplaneKind::Userspace => {
            let workers = if cfg.dataplane.workers == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { cfg.dataplane.workers };
            // A few hundred descriptors for the store, the API, epoll and eventfds.
            let addresses = limit.saturating_sub(256) / workers as u64;
            tracing::info!(fd_limit = limit, raised, workers, "the user-space plane can hold about {addresses} SFU addresses (one socket per address per worker): a relay leg or a participant is one, an NG call two to four");
        }
        DataplaneKind::Ebpf => {
            tracing::info!(fd_limit = limit, raised, "the ebpf plane's sessions cost no file descriptors (kernel map entries: dataplane.max_streams)")
        }
        DataplaneKind::Afxdp => {
            raise_memlock_limit();
            // As the user-space plane: its sockets carry what the XDP program passes to the stack.
            tracing::info!(fd_limit = limit, raised, "the afxdp plane keeps a socket per SFU address and worker, as the user-space plane does")
        }
    }
}

/// Raise the soft RLIMIT_MEMLOCK to the hard limit: the AF_XDP plane's packet memory (UMEM) is
/// charged to it.
fn raise_memlock_limit() {
    let mut r = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a valid struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) == 0 && r.rlim_cur != r.rlim_max {
            r.rlim_cur = r.rlim_max;
            libc::setrlimit(libc::RLIMIT_MEMLOCK, &r);
        }
        libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r);
    }
    let limit = if r.rlim_cur == libc::RLIM_INFINITY { "unlimited".to_string() } else { format!("{} MiB", r.rlim_cur >> 20) };
    tracing::info!(memlock = %limit, "the afxdp plane's packet memory (dataplane.afxdp_frames x 2 KiB per interface queue) counts against the locked-memory limit");
}

fn serve(args: ServeArgs) -> anyhow::Result<()> {
    // Defaults < file < MEDIAPLANE_<SECTION>_<KEY> variables < the flags below.
    let mut env = Vec::new();
    for (k, v) in std::env::vars_os() {
        match (k.into_string(), v.into_string()) {
            (Ok(k), Ok(v)) => env.push((k, v)),
            (Ok(k), Err(_)) if k.starts_with("MEDIAPLANE_") => anyhow::bail!("{k} is not UTF-8"),
            _ => {}
        }
    }
    let mut cfg = Config::resolve(args.config.as_deref(), env).map_err(anyhow::Error::msg)?;
    if let Some(l) = args.listen {
        cfg.api.listen = l;
    }
    if let Some(k) = args.dataplane {
        cfg.dataplane.kind = k;
    }
    if !args.interfaces.is_empty() {
        cfg.dataplane.interfaces = args.interfaces.clone();
    }
    if let Some(p) = args.pin_dir {
        cfg.dataplane.pin_dir = p;
    }
    if args.adopt_live_pins {
        cfg.dataplane.adopt_live_pins = true;
    }
    if let Some(s) = args.store {
        match s.to_str().filter(|s| s.starts_with("redis://") || s.starts_with("rediss://") || s.starts_with("redis+unix://")) {
            Some(url) => cfg.store.url = Some(url.to_string()),
            None => cfg.store.path = s,
        }
    }
    if let Some(w) = args.workers {
        cfg.dataplane.workers = w;
    }
    if let Some(l) = args.ng_listen {
        cfg.ng.listen = Some(l);
    }
    if let Some(l) = args.rtsp_listen {
        cfg.rtsp.listen = Some(l);
    }
    cfg.rtsp.paths.extend(args.rtsp_paths.iter().cloned());
    if let Some(t) = args.ng_media_timeout {
        cfg.ng.media_timeout_secs = t;
    }
    if let Some(d) = args.dtmf_log_dest {
        cfg.ng.dtmf_log_dest = Some(d);
    }
    use mediaplane_control::config::XdpPrefilterMode;
    match (args.xdp_prefilter.as_deref(), args.no_xdp_prefilter) {
        (_, true) | (Some("off"), _) => cfg.dataplane.xdp_prefilter = XdpPrefilterMode::Off,
        (Some("on"), _) => cfg.dataplane.xdp_prefilter = XdpPrefilterMode::On,
        (Some(_), _) => cfg.dataplane.xdp_prefilter = XdpPrefilterMode::Auto,
        (None, false) => {}
    }
    cfg.validate().map_err(anyhow::Error::msg)?;
    init_logging(&cfg);
    raise_fd_limit(&cfg);

    let (tx, rx) = mediaplane_dataplane::event_channel();
    let dataplane = build_dataplane(&cfg, tx, args.reset)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    let ng = match cfg.ng.listen {
        Some(listen) => Some(rt.block_on(tokio::net::UdpSocket::bind(listen)).with_context(|| format!("binding NG on {listen}"))?),
        None => None,
    };
    let ng_cfg = mediaplane_ng::NgConfig {
        listen: cfg.ng.listen.unwrap_or(mediaplane_ng::NgConfig::default().listen),
        media_timeout: std::time::Duration::from_secs(cfg.ng.media_timeout_secs),
        allow: cfg.ng.allow.clone(),
        recording_dir: cfg.ng.recording_dir.clone(),
        instance_id: cfg.ng.instance_id.clone(),
        dtmf_log_dest: cfg.ng.dtmf_log_dest,
        forward_to: cfg.ng.forward_to,
    };
    let rtsp = match cfg.rtsp.listen {
        Some(listen) => Some(rt.block_on(tokio::net::TcpListener::bind(listen)).with_context(|| format!("binding RTSP on {listen}"))?),
        None => None,
    };
    let rtsp_cfg = cfg.rtsp.clone();
    let api_listen = cfg.api.listen;
    let served = rt.block_on(mediaplane_control::serve_with(cfg, dataplane, Some(rx), args.reset, shutdown_signal(), move |manager, metrics| {
        if let Some(socket) = ng {
            tracing::info!(listen = %ng_cfg.listen, "NG protocol listening");
            let (manager, ng_metrics) = (manager.clone(), metrics.ng.clone());
            tokio::spawn(async move {
                if let Err(e) = mediaplane_ng::serve_ng(socket, manager, ng_cfg, ng_metrics).await {
                    tracing::error!(error = %e, "NG listener stopped");
                }
            });
        }
        if let Some(listener) = rtsp {
            let rtsp_metrics = metrics.rtsp.clone();
            tracing::info!(listen = ?listener.local_addr().ok(), paths = rtsp_cfg.paths.len(), "RTSP proxy listening");
            tokio::spawn(async move {
                if let Err(e) = mediaplane_rtsp::serve_rtsp(listener, manager, rtsp_cfg, rtsp_metrics).await {
                    tracing::error!(error = format!("{e:#}"), "RTSP proxy stopped");
                }
            });
        }
        // Store open, sessions restored, data plane up, NG and the API bound.
        tracing::info!("ready");
        sd_notify(&format!("READY=1\nSTATUS=serving the API on {api_listen}\nMAINPID={}", std::process::id()));
    }));
    // Tasks still running (an RTSP session ending, a pull giving up) may be waiting on the data
    // plane that just stopped: they are not waited for beyond this.
    rt.shutdown_timeout(std::time::Duration::from_secs(2));
    served
}

fn build_dataplane(cfg: &Config, events: std::sync::mpsc::SyncSender<DataplaneEvent>, reset: bool) -> anyhow::Result<Arc<dyn Dataplane>> {
    let us = UserspaceConfig {
        workers: cfg.dataplane.workers,
        batch: cfg.dataplane.batch,
        header: mediaplane_dataplane::HeaderPolicy::from_host(cfg.dataplane.dscp),
        forwarded_qos: cfg.dataplane.forwarded_qos,
        retransmit: cfg.dataplane.retransmit,
        ..Default::default()
    };
    match cfg.dataplane.kind {
        DataplaneKind::Userspace => Ok(Arc::new(UserspaceDataplane::new(us, Some(events)).context("starting the user-space data plane")?)),
        DataplaneKind::Afxdp => {
            let mode = match cfg.dataplane.afxdp_mode {
                mediaplane_control::config::AfxdpMode::Auto => mediaplane_dataplane::afxdp::BindMode::Auto,
                mediaplane_control::config::AfxdpMode::Copy => mediaplane_dataplane::afxdp::BindMode::Copy,
                mediaplane_control::config::AfxdpMode::Zerocopy => mediaplane_dataplane::afxdp::BindMode::ZeroCopy,
            };
            let acfg = mediaplane_ebpf::AfxdpConfig { interfaces: cfg.dataplane.interfaces.clone(), userspace: us, mode, frames: cfg.dataplane.afxdp_frames };
            let dp = mediaplane_ebpf::AfxdpDataplane::new(acfg, Some(events)).context("starting the afxdp data plane")?;
            tracing::info!(interfaces = ?cfg.dataplane.interfaces, "AF_XDP sockets bound, XDP program attached");
            Ok(Arc::new(dp))
        }
        DataplaneKind::Ebpf => {
            let mut ecfg = mediaplane_ebpf::EbpfConfig::new(cfg.dataplane.interfaces.clone(), cfg.dataplane.pin_dir.clone());
            ecfg.userspace = us;
            ecfg.reset = reset;
            ecfg.adopt_live_pins = cfg.dataplane.adopt_live_pins;
            ecfg.max_streams = cfg.dataplane.max_streams;
            ecfg.max_copies = cfg.dataplane.max_copies;
            ecfg.xdp_prefilter = match cfg.dataplane.xdp_prefilter {
                mediaplane_control::config::XdpPrefilterMode::Auto => mediaplane_ebpf::XdpPrefilter::Auto,
                mediaplane_control::config::XdpPrefilterMode::On => mediaplane_ebpf::XdpPrefilter::On,
                mediaplane_control::config::XdpPrefilterMode::Off => mediaplane_ebpf::XdpPrefilter::Off,
            };
            ecfg.verify_checksums = cfg.dataplane.verify_checksums;
            ecfg.hold_order = cfg.dataplane.hold_order;
            ecfg.rpf_v6 = match cfg.dataplane.rp_filter_v6 {
                mediaplane_control::config::RpFilterMode::Strict => mediaplane_ebpf::maps::RpfMode::Strict,
                mediaplane_control::config::RpFilterMode::Loose => mediaplane_ebpf::maps::RpfMode::Loose,
                mediaplane_control::config::RpFilterMode::Off => mediaplane_ebpf::maps::RpfMode::Off,
            };
            let dp = mediaplane_ebpf::EbpfDataplane::new(ecfg, Some(events)).context("starting the ebpf data plane")?;
            tracing::info!(hooks = ?dp.hooks(), adopted = dp.fast_path().adopted(), "kernel fast path attached");
            Ok(Arc::new(dp))
        }
    }
}

/// Resolves on SIGINT or SIGTERM: both mean a graceful shutdown.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    tracing::info!("shutdown requested");
    sd_notify("STOPPING=1");
}

/// systemd's readiness protocol (Type=notify): one datagram to `$NOTIFY_SOCKET` (a path, or
/// `@name` in the abstract namespace). Without the variable (not under systemd) it does nothing.
fn sd_notify(state: &str) {
    let Some(path) = std::env::var_os("NOTIFY_SOCKET") else { return };
    let sent = (|| -> std::io::Result<()> {
        use std::os::unix::ffi::OsStrExt;
        let sock = std::os::unix::net::UnixDatagram::unbound()?;
        let bytes = path.as_bytes();
        let addr = match bytes.strip_prefix(b"@") {
            Some(name) => <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name)?,
            None => std::os::unix::net::SocketAddr::from_pathname(std::path::Path::new(&path))?,
        };
        sock.send_to_addr(state.as_bytes(), &addr).map(drop)
    })();
    if let Err(e) = sent {
        tracing::warn!(error = %e, state, "sd_notify failed");
    }
}
