#!/usr/bin/env bash
# sockperf ping-pong round trip through one relay pair, side by side in one run (issue 14 item 2):
#   direct     sockperf client -> sockperf server, no relay (the floor)
#   mediaplane user-space plane: a relay through POST /v1/relays, legs rtp:false
#   rtpengine  user space (no kernel module): NG offer/answer, then the same sockperf
# Configurations alternate round by round so drift on the machine hits all of them alike.
# Usage: scripts/bench-pingpong.sh [--rates 1000,20000] [--rounds 3] [--seconds 4] [--out DIR]
# Loopback only; every process started here is ended by PID; ports 4x0xx/17590/22390 on 127.0.0.1.
set -euo pipefail

rates=1000,20000; rounds=3; seconds=4; out=bench-results/pingpong
bin=${MEDIAPLANE_BIN:-target/release/mediaplane}
while (($#)); do
  case $1 in
    --rates) rates=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --seconds) seconds=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
done
for tool in sockperf rtpengine python3 curl; do
  command -v $tool >/dev/null || { echo "bench-pingpong: $tool not found (scripts/install-deps.sh --bench)" >&2; exit 1; }
done
[ -x "$bin" ] || { echo "bench-pingpong: $bin not built (make release)" >&2; exit 1; }

mkdir -p "$out"
work=$(mktemp -d /tmp/mp-pingpong.XXXXXX)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; rm -rf "$work"; }
trap cleanup EXIT

client=41000 server=41002
api=127.0.0.1:17590 ng_port=22390

start_server() { sockperf server -i 127.0.0.1 -p $server >"$work/server.log" 2>&1 & pids+=($!); sleep 0.3; }
stop_all() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; wait 2>/dev/null || true; pids=(); }

# ping-pong to port $1 from the fixed client port; prints "observations p50 p99 max" (µs)
ping() {
  sockperf ping-pong -i 127.0.0.1 -p "$1" --client_ip 127.0.0.1 --client_port $client \
    --mps "$2" -t "$seconds" --full-rtt >"$work/ping.log" 2>&1 || { cat "$work/ping.log" >&2; return 1; }
  sed 's/\x1b\[[0-9;]*m//g' "$work/ping.log" | awk '
    /Total [0-9]+ observations/ { for (i = 1; i <= NF; i++) if ($i == "Total") n = $(i + 1) }
    /<MAX> observation/ { max = $NF }
    /percentile 99.000/ { p99 = $NF }
    /percentile 50.000/ { p50 = $NF }
    END { if (n == "") exit 1; print n, p50, p99, max }'
}

run_direct() { start_server; ping $server "$1"; stop_all; }

run_mediaplane() {
  MEDIAPLANE_API_LISTEN=$api MEDIAPLANE_STORE_PATH="$work/db" MEDIAPLANE_LOG_LEVEL=warn \
    "$bin" serve --reset >"$work/mp.log" 2>&1 & pids+=($!)
  for _ in $(seq 100); do curl -sf "http://$api/v1/relays" >/dev/null && break; sleep 0.1; done
  curl -sf -X POST "http://$api/v1/relays" -H 'content-type: application/json' -d "{\"id\":\"pingpong\",
    \"a\":{\"local\":\"127.0.0.1:40000\",\"remote\":\"127.0.0.1:$client\",\"rtp\":false},
    \"b\":{\"local\":\"127.0.0.1:40002\",\"remote\":\"127.0.0.1:$server\",\"rtp\":false}}" >/dev/null
  start_server; ping 40000 "$1"; stop_all; rm -rf "$work/db"
}

run_rtpengine() {
  rtpengine --foreground --table=-1 --interface=127.0.0.1 --listen-ng=127.0.0.1:$ng_port \
    --port-min=42000 --port-max=42999 --log-stderr --log-level=3 --pidfile="$work/re.pid" \
    >"$work/re.log" 2>&1 & pids+=($!)
  sleep 1
  # offer from the client's port, answer from the server's; the client talks to the answer's port
  local port
  port=$(python3 - "$ng_port" $client $server <<'EOF'
import random, re, socket, sys
def enc(x):
    if isinstance(x, str): x = x.encode()
    if isinstance(x, bytes): return b"%d:%s" % (len(x), x)
    if isinstance(x, list): return b"l" + b"".join(enc(i) for i in x) + b"e"
    return b"d" + b"".join(enc(k) + enc(v) for k, v in sorted(x.items())) + b"e"
def ng(d):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
    s.sendto(b"%08x " % random.getrandbits(32) + enc(d), ("127.0.0.1", int(sys.argv[1])))
    return s.recv(65535)
sdp = lambda p: f"v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\nm=audio {p} RTP/AVP 0\r\na=rtpmap:0 PCMU/8000\r\n"
ng({"command": "offer", "call-id": "pingpong", "from-tag": "a", "sdp": sdp(sys.argv[2])})
answer = ng({"command": "answer", "call-id": "pingpong", "from-tag": "a", "to-tag": "b", "sdp": sdp(sys.argv[3])})
print(re.search(rb"m=audio (\d+)", answer).group(1).decode())
EOF
)
  start_server; ping "$port" "$1"; stop_all
}

results="$out/pingpong.tsv"
echo -e "rate\tround\trelay\tobservations\tp50_us\tp99_us\tmax_us" >"$results"
for rate in ${rates//,/ }; do
  for round in $(seq "$rounds"); do
    for relay in direct mediaplane rtpengine; do
      line=$(run_$relay "$rate") || line="- - - -"
      echo -e "$rate\t$round\t$relay\t${line// /$'\t'}" | tee -a "$results"
    done
  done
done
echo "wrote $results"
