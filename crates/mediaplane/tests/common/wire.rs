//! What reaches a receiver on the wire: AF_PACKET captures inside a testbed's namespaces.

use mediaplane_bench::netns::Testbed;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

/// A raw AF_PACKET socket on `ifname` inside namespace `ns`, non-blocking.
pub fn capture(tb: &Testbed, ns: &str, ifname: &str) -> OwnedFd {
    let ifname = std::ffi::CString::new(ifname).unwrap();
    tb.in_ns(ns, move || unsafe {
        let proto = (libc::ETH_P_ALL as u16).to_be();
        let fd = libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_NONBLOCK, proto as i32);
        assert!(fd >= 0, "AF_PACKET socket: {}", std::io::Error::last_os_error());
        // Every frame on the link is queued here until drained: make room for all of them.
        let size: libc::c_int = 32 << 20;
        libc::setsockopt(fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, (&size as *const libc::c_int).cast(), 4);
        let mut sll: libc::sockaddr_ll = std::mem::zeroed();
        sll.sll_family = libc::AF_PACKET as u16;
        sll.sll_protocol = proto;
        sll.sll_ifindex = libc::if_nametoindex(ifname.as_ptr()) as i32;
        let r = libc::bind(fd, (&sll as *const libc::sockaddr_ll).cast(), std::mem::size_of::<libc::sockaddr_ll>() as u32);
        assert_eq!(r, 0, "bind AF_PACKET: {}", std::io::Error::last_os_error());
        OwnedFd::from_raw_fd(fd)
    })
    .unwrap()
}

/// Every frame queued on a capture, in arrival order.
pub fn frames(cap: &OwnedFd) -> Vec<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    loop {
        // SAFETY: buf is valid for its length.
        let n = unsafe { libc::recv(cap.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        if n <= 0 {
            return out;
        }
        out.push(buf[..n as usize].to_vec());
    }
}

/// Transmit checksum offload off: the frames carry final checksums (with offload, veth frames
/// hold only a partial sum), and the receiving side sees them unverified (CHECKSUM_NONE).
pub fn ethtool_tx_off(tb: &Testbed, ns: &str, ifname: &str) {
    let st = tb.command(ns, "ethtool").args(["-K", ifname, "tx", "off"]).stdout(std::process::Stdio::null()).status().unwrap();
    assert!(st.success(), "ethtool -K {ifname} tx off");
}
