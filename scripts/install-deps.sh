#!/usr/bin/env bash
# Install what building and testing mediaplane needs, and nothing twice: Debian packages are
# installed only when missing (apt-get as root), so running this again is fast and harmless.
set -euo pipefail

packages=(
  clang llvm libelf-dev zlib1g-dev pkg-config bpftool libbpf-dev   # BPF programs + libbpf-rs
  iproute2 ethtool iptables                                        # network-namespace testbed (iptables: random loss in a namespace)
  kamailio sip-tester                                              # SIP interop tests (Kamailio + SIPp)
  kamailio-websocket-modules                                       # SIP over WebSocket for the browser SIP client (SIP.js)
  rtpengine-daemon                                                 # the latching interop test's baseline, and make bench's
  make libssl-dev                                                  # SRTP: the srtp crate builds libsrtp against OpenSSL
  openssl                                                          # DTLS interop: s_server / s_client as the independent DTLS-SRTP peer
  gstreamer1.0-tools gstreamer1.0-plugins-base gstreamer1.0-plugins-good gstreamer1.0-plugins-bad  # SDES interop peer (srtpenc/srtpdec)
  gstreamer1.0-rtsp gir1.2-gst-rtsp-server-1.0 python3-gi        # RTSP interop: gst-rtsp-server as the camera (tests/peers/camera.py)
  ffmpeg                                                           # RTSP interop: the viewers
  chromium                                                         # WebRTC interop: a real browser (headless, fake media) calls through the relay
  prometheus                                                       # promtool: the /metrics test lints the exposition
  redis-server                                                     # the Redis store's tests run a real Redis (7.x)
  systemd man-db util-linux                                        # unit verification (systemd-analyze, man pages), setpriv
)
# rtpengine runs in user space, started by the tests and benchmarks themselves (its kernel module
# is not needed). `--bench` (make bench) adds sockperf for scripts/bench-pingpong.sh.
if [[ " $* " == *" --bench "* ]]; then
  packages+=(sockperf)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]})); then
  if [ "$(id -u)" -ne 0 ]; then
    echo "missing Debian packages: ${missing[*]}" >&2
    echo "run 'make deps' as root (or install them) first" >&2
    exit 1
  fi
  echo "installing: ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  # The downloaded .debs (chromium's alone is ~100 MB) are not needed once installed.
  apt-get clean
  # Under systemd the package's own service starts (any interface, NG on localhost:2223, which the
  # tests' relays use): stop and disable the one this script just installed.
  if [[ " ${missing[*]} " == *" rtpengine-daemon "* ]] && [ -d /run/systemd/system ]; then
    systemctl disable --now rtpengine-daemon.service >/dev/null 2>&1 || true
  fi
fi

if ! command -v cargo >/dev/null 2>&1; then
  [ -x "$HOME/.cargo/bin/cargo" ] || { echo "cargo not found: install Rust (rustup) first" >&2; exit 1; }
fi

# SIP.js, which the WebRTC interop test serves to Chromium, pinned by its lockfile
# (crates/mediaplane/tests/browser). npm comes with the machine's Node.js; where there is none,
# Debian's (as root).
browser_dir="$(cd "$(dirname "$0")/.." && pwd)/crates/mediaplane/tests/browser"
if [ ! -f "$browser_dir/node_modules/sip.js/lib/index.js" ]; then
  if ! command -v npm >/dev/null 2>&1; then
    if [ "$(id -u)" -ne 0 ]; then
      echo "npm not found: install Node.js and npm, or run 'make deps' as root" >&2
      exit 1
    fi
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
    apt-get clean
  fi
  (cd "$browser_dir" && npm ci --no-audit --no-fund --loglevel=error)
fi
