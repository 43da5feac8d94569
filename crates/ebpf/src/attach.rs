//! Attaching the program at TC ingress: a tcx link (kernel >= 6.6) pinned so it outlives the
//! process, or a clsact filter (which outlives the process by itself) as the fallback. The XDP
//! pre-filter gets an XDP link (native mode where the driver has it, e.g. veth), pinned the same
//! way.
//!
//! Adoption after a restart replaces the program atomically: `bpf_link_update` on the pinned
//! tcx link, or `tc filter replace` on our clsact handle. Packets never see a detached hook.

use libbpf_rs::{AsRawLibbpf, Link, Program, TcHook, TcHookBuilder, TC_INGRESS};
use mediaplane_dataplane::DataplaneError;
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;

/// How to hook TC ingress.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// tcx, falling back to clsact when the kernel has no tcx.
    #[default]
    Auto,
    Tcx,
    Clsact,
}

/// clsact filter identity: fixed so a restarted or resetting process finds its own filter.
pub const CLSACT_HANDLE: u32 = 0x6d70; // "mp"
pub const CLSACT_PRIORITY: u32 = 0x6d70;

/// One interface's hook.
pub enum Attachment {
    Tcx { ifname: String, link: Link, pin: Option<PathBuf> },
    Clsact { ifname: String, hook: SendTcHook },
    Xdp { ifname: String, link: Link, pin: Option<PathBuf> },
}

/// A [`TcHook`] that may cross threads.
pub struct SendTcHook(TcHook);
// SAFETY: the only pointer in bpf_tc_hook is the custom qdisc name, which our hooks never set
// (null); the rest is plain integers.
unsafe impl Send for SendTcHook {}
unsafe impl Sync for SendTcHook {}

impl std::fmt::Debug for Attachment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Attachment::Tcx { ifname, pin, .. } => write!(f, "tcx({ifname}, pin {pin:?})"),
            Attachment::Clsact { ifname, .. } => write!(f, "clsact({ifname})"),
            Attachment::Xdp { ifname, pin, .. } => write!(f, "xdp({ifname}, pin {pin:?})"),
        }
    }
}

/// The pin of the tcx link of `ifname` inside a pin dir.
pub fn link_pin_path(pin_dir: &Path, ifname: &str) -> PathBuf {
    pin_dir.join(format!("link_ingress_{ifname}"))
}

/// The pin of the XDP link of `ifname` inside a pin dir.
pub fn xdp_link_pin_path(pin_dir: &Path, ifname: &str) -> PathBuf {
    pin_dir.join(format!("link_xdp_{ifname}"))
}

/// Attach (or adopt, replacing its program atomically) the XDP pre-filter on `ifname`. The link
/// is created without mode flags: the kernel picks native XDP when the driver supports it
/// (veth, most NICs) and generic XDP otherwise.
pub fn attach_xdp(prog: &Program<'_>, ifname: &str, pin_dir: Option<&Path>) -> Result<Attachment, DataplaneError> {
    let ifindex = ifindex_of(ifname)?;
    let pin = pin_dir.map(|d| xdp_link_pin_path(d, ifname));
    if let Some(p) = pin.as_deref().filter(|p| p.exists()) {
        let mut link = Link::open(p).map_err(|e| DataplaneError::Other(format!("opening pinned link {}: {e}", p.display())))?;
        link.update_prog(prog).map_err(|e| DataplaneError::Other(format!("replacing the XDP program on {ifname}: {e}")))?;
        tracing::info!(ifname, "adopted pinned XDP link");
        return Ok(Attachment::Xdp { ifname: ifname.into(), link, pin });
    }
    // SAFETY: the program pointer is valid while `prog` is.
    let raw = unsafe { libbpf_rs::libbpf_sys::bpf_program__attach_xdp(prog.as_libbpf_object().as_ptr(), ifindex as i32) };
    let Some(raw) = NonNull::new(raw) else {
        let e = std::io::Error::last_os_error();
        return Err(DataplaneError::Other(format!(
            "XDP attach on {ifname}: {e} (another XDP program there, or a driver limit? set dataplane.xdp_prefilter = \"off\" to run without)"
        )));
    };
    // SAFETY: a fresh link from libbpf, owned from here on.
    let mut link = unsafe { Link::from_ptr(raw) };
    if let Some(p) = &pin {
        link.pin(p).map_err(|e| DataplaneError::Other(format!("pinning link {}: {e}", p.display())))?;
    }
    Ok(Attachment::Xdp { ifname: ifname.into(), link, pin })
}

/// The driver of `ifname` as `ethtool -i` names it (ETHTOOL_GDRVINFO), in the calling thread's
/// network namespace; None if the device does not say.
pub fn driver_of(ifname: &str) -> Option<String> {
    const SIOCETHTOOL: libc::c_ulong = 0x8946;
    const ETHTOOL_GDRVINFO: u32 = 0x3;
    #[repr(C)]
    struct DrvInfo {
        cmd: u32,
        driver: [u8; 32],
        rest: [u8; 196 - 36],
    }
    let mut info = DrvInfo { cmd: ETHTOOL_GDRVINFO, driver: [0; 32], rest: [0; 160] };
    // SAFETY: an ifreq naming the device and pointing at `info`, which outlives the ioctl; the
    // socket is closed before returning.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return None;
        }
        let mut ifr: libc::ifreq = std::mem::zeroed();
        for (d, s) in ifr.ifr_name.iter_mut().zip(ifname.bytes().take(libc::IFNAMSIZ - 1)) {
            *d = s as libc::c_char;
        }
        ifr.ifr_ifru.ifru_data = (&mut info as *mut DrvInfo).cast();
        let r = libc::ioctl(fd, SIOCETHTOOL, &mut ifr);
        libc::close(fd);
        if r != 0 {
            return None;
        }
    }
    let end = info.driver.iter().position(|b| *b == 0).unwrap_or(32);
    Some(String::from_utf8_lossy(&info.driver[..end]).into_owned()).filter(|d| !d.is_empty())
}

pub fn ifindex_of(ifname: &str) -> Result<u32, DataplaneError> {
    let c = std::ffi::CString::new(ifname).map_err(|_| DataplaneError::Other(format!("bad interface name {ifname:?}")))?;
    // SAFETY: c is a valid NUL-terminated string.
    let i = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if i == 0 {
        return Err(DataplaneError::Other(format!("interface {ifname} not found (in this network namespace)")));
    }
    Ok(i)
}

fn clsact_hook(prog: &Program<'_>, ifindex: u32) -> TcHook {
    let mut b = TcHookBuilder::new(prog.as_fd());
    b.ifindex(ifindex as i32).replace(true).handle(CLSACT_HANDLE).priority(CLSACT_PRIORITY);
    b.hook(TC_INGRESS)
}

fn attach_tcx(prog: &Program<'_>, ifname: &str, ifindex: u32, pin: Option<&Path>) -> Result<Attachment, DataplaneError> {
    if let Some(p) = pin.filter(|p| p.exists()) {
        let mut link = Link::open(p).map_err(|e| DataplaneError::Other(format!("opening pinned link {}: {e}", p.display())))?;
        link.update_prog(prog).map_err(|e| DataplaneError::Other(format!("replacing the program on {ifname}: {e}")))?;
        tracing::info!(ifname, "adopted pinned tcx link");
        return Ok(Attachment::Tcx { ifname: ifname.into(), link, pin: Some(p.to_path_buf()) });
    }
    // SAFETY: the program pointer is valid while `prog` is; NULL opts are allowed.
    let raw = unsafe { libbpf_rs::libbpf_sys::bpf_program__attach_tcx(prog.as_libbpf_object().as_ptr(), ifindex as i32, std::ptr::null()) };
    let Some(raw) = NonNull::new(raw) else {
        let e = std::io::Error::last_os_error();
        return Err(DataplaneError::Io { context: format!("tcx attach on {ifname}"), source: e });
    };
    // SAFETY: a fresh link from libbpf, owned from here on.
    let mut link = unsafe { Link::from_ptr(raw) };
    if let Some(p) = pin {
        link.pin(p).map_err(|e| DataplaneError::Other(format!("pinning link {}: {e}", p.display())))?;
    }
    Ok(Attachment::Tcx { ifname: ifname.into(), link, pin: pin.map(Path::to_path_buf) })
}

fn attach_clsact(prog: &Program<'_>, ifname: &str, ifindex: u32) -> Result<Attachment, DataplaneError> {
    let mut hook = clsact_hook(prog, ifindex);
    // EEXIST: the clsact qdisc is already there (ours from before, or someone else's).
    if let Err(e) = hook.create() {
        if e.kind() != libbpf_rs::ErrorKind::AlreadyExists {
            return Err(DataplaneError::Other(format!("creating clsact on {ifname}: {e}")));
        }
    }
    let hook = hook.attach().map_err(|e| DataplaneError::Other(format!("clsact attach on {ifname}: {e}")))?;
    Ok(Attachment::Clsact { ifname: ifname.into(), hook: SendTcHook(hook) })
}

/// Attach (or adopt) `prog` at TC ingress of `ifname`. With `pin_dir`, a tcx link is pinned
/// there (and adopted from there on the next start).
pub fn attach_ingress(prog: &Program<'_>, ifname: &str, mode: AttachMode, pin_dir: Option<&Path>) -> Result<Attachment, DataplaneError> {
    let ifindex = ifindex_of(ifname)?;
    let pin = pin_dir.map(|d| link_pin_path(d, ifname));
    match mode {
        AttachMode::Tcx => attach_tcx(prog, ifname, ifindex, pin.as_deref()),
        AttachMode::Clsact => attach_clsact(prog, ifname, ifindex),
        AttachMode::Auto => match attach_tcx(prog, ifname, ifindex, pin.as_deref()) {
            Ok(a) => Ok(a),
            Err(DataplaneError::Io { source, .. })
                if matches!(source.raw_os_error(), Some(libc::EINVAL) | Some(libc::EOPNOTSUPP) | Some(524 /* ENOTSUPP */)) =>
            {
                tracing::info!(ifname, "no tcx ({source}): falling back to clsact");
                attach_clsact(prog, ifname, ifindex)
            }
            Err(e) => Err(e),
        },
    }
}

impl Attachment {
    pub fn ifname(&self) -> &str {
        match self {
            Attachment::Tcx { ifname, .. } | Attachment::Clsact { ifname, .. } | Attachment::Xdp { ifname, .. } => ifname,
        }
    }

    pub fn is_tcx(&self) -> bool {
        matches!(self, Attachment::Tcx { .. })
    }

    /// "tcx", "clsact" or "xdp".
    pub fn kind(&self) -> &'static str {
        match self {
            Attachment::Tcx { .. } => "tcx",
            Attachment::Clsact { .. } => "clsact",
            Attachment::Xdp { .. } => "xdp",
        }
    }

    /// Detach and remove the pin.
    pub fn detach(self) -> Result<(), DataplaneError> {
        match self {
            Attachment::Tcx { ifname, mut link, pin } | Attachment::Xdp { ifname, mut link, pin } => {
                // The interface may be gone already (netns deleted): the link is then defunct.
                if let Err(e) = link.detach() {
                    tracing::debug!(ifname, "link detach: {e}");
                }
                if pin.is_some() {
                    let _ = link.unpin();
                }
                Ok(())
            }
            Attachment::Clsact { ifname, mut hook } => hook.0.detach().or_else(|e| {
                if e.kind() == libbpf_rs::ErrorKind::NotFound {
                    Ok(())
                } else {
                    Err(DataplaneError::Other(format!("clsact detach on {ifname}: {e}")))
                }
            }),
        }
    }
}

/// Remove our clsact filter from `ifname` if present (stale state of a dead instance).
pub fn detach_stale_clsact(prog: &Program<'_>, ifname: &str) {
    if let Ok(ifindex) = ifindex_of(ifname) {
        let mut hook = clsact_hook(prog, ifindex);
        let _ = hook.detach();
    }
}
