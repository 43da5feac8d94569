# mediaplane: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo

.PHONY: disk-report all deps build release test lint demo bench fuzz fuzz-smoke fuzz-cargo fuzz-bpf clean deb deb-tools deb-assets

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --workspace

release: deps
	$(CARGO) build --release -p mediaplane

# Unit, loopback, kernel (BPF_PROG_TEST_RUN, network namespaces) and interop tests.
# Privileged tests fail rather than skip when CI=true.
# The .deb test (crates/mediaplane/tests/deb_package.rs) packages the debug build with cargo-deb,
# installs it, starts it as the unit would and removes it.
test: disk-report deps deb-tools lint
	$(CARGO) test --workspace --no-fail-fast
	$(MAKE) fuzz-smoke

# A CI run builds from nothing; incremental caches would only add ~2 GB to its disk.
ifeq ($(CI),true)
export CARGO_INCREMENTAL := 0
endif

# Free space where the build writes, printed first so a "No space left on device" later in the
# log can be read against it (a fresh `make test` under CI=true writes about 3.5 GB: 2.3 GB in
# target/, 1 GB in fuzz/target, plus Debian packages and cargo's registry).
disk-report:
	@df -h $(CURDIR) | awk 'NR == 2 { print "disk: " $$4 " free on " $$6 " before the build" }'

# Formatting (rustfmt.toml) and clippy with warnings as errors, on every target; first in `make
# test`, so a style slip fails in seconds rather than after the tests.
lint: deps
	@rustup component list --installed 2>/dev/null | grep -q '^rustfmt' || rustup component add rustfmt
	@rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy
	$(CARGO) fmt --all --check
	cd fuzz && $(CARGO) fmt --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

# Coverage-guided fuzzing (cargo-fuzz, nightly): a seconds-long run of every target in
# `make test`, longer runs with `make fuzz` (FUZZ_SECONDS per target). `make fuzz` also runs the
# kernel program's fuzz driver (root; BPF_PROG_TEST_RUN against core's per-packet pipeline and,
# for simulcast layers, core's per-consumer rewriter) over BPF_FUZZ_FRAMES
# random and mutated frames (`make test` runs 10000 of them in cargo test); a failure prints its
# seed, MEDIAPLANE_FUZZ_SEED=<seed> replays it.
FUZZ_TARGETS := frame rtp_rtcp classify api_json bencode sdp stun whip_offer dtls_record srtp_input fragments rtsp
FUZZ_SECONDS ?= 300
BPF_FUZZ_FRAMES ?= 500000
fuzz-smoke:
	$(MAKE) fuzz-cargo FUZZ_SECONDS=8

fuzz: fuzz-bpf fuzz-cargo

fuzz-bpf:
	MEDIAPLANE_FUZZ_FRAMES=$(BPF_FUZZ_FRAMES) $(CARGO) test --release -p mediaplane-ebpf --test fuzz_test_run -- --nocapture

fuzz-cargo:
	@rustup toolchain list | grep -q '^nightly' || { echo "cargo fuzz needs a nightly toolchain (rustup toolchain install nightly)" >&2; exit 1; }
	@$(CARGO) fuzz --version >/dev/null 2>&1 || $(CARGO) install --locked cargo-fuzz
	cd fuzz && $(CARGO) +nightly fuzz build -O
	cd fuzz && for t in $(FUZZ_TARGETS); do \
	  log=target/fuzz-$$t.log; \
	  if ! $(CARGO) +nightly fuzz run -O $$t -- -max_total_time=$(FUZZ_SECONDS) >$$log 2>&1; then \
	    tail -40 $$log; echo "fuzz target $$t failed: crash input in fuzz/artifacts/$$t" >&2; exit 1; \
	  fi; \
	  echo "fuzz $$t: $$(grep -E '^Done' $$log)"; \
	done

# A real multi-party conference in network namespaces, through each data plane.
demo: release
	target/release/mediaplane demo

# The full sweep (N = 2..12, 16, 32, 64; both scenarios; every data plane), about 40 min here.
BENCH_DATAPLANES ?= userspace,ebpf,ebpf-xdp
bench: release
	@scripts/install-deps.sh --bench
	target/release/mediaplane bench sfu --dataplanes $(BENCH_DATAPLANES) --out bench-results
	# Simulcast video: the per-consumer rewrite against plain fan-out of the same copies, and the
	# share of packets the kernel handles (about 10 min here).
	target/release/mediaplane bench sfu --preset simulcast --sizes 4,8,16 --dataplanes $(BENCH_DATAPLANES) --out bench-results/simulcast
	# What checksum verification and the reverse-path check cost per packet (BPF run time, A/B).
	$(CARGO) test --release -p mediaplane-ebpf --test fidelity checks_cost -- --ignored --nocapture
	# What SRTP costs per encrypted copy (protect) and per browser packet (unprotect), per suite.
	$(CARGO) test --release -p mediaplane-dataplane --test srtp_cost -- --ignored --nocapture
	# One publisher to N - 1 subscribers, plain against every participant on SRTP (GCM, CM+HMAC):
	# CPU per encrypted copy and added delay beside the plain planes (about 10 min here).
	target/release/mediaplane bench sfu --preset encrypted --sizes 2,4,8,16,32,64 --seconds 5 --dataplanes $(BENCH_DATAPLANES) --out bench-results/encrypted
	# Relay: 750 and 1800 calls (the seed's sizes) x 3 relays and the no-relay baseline, then the
	# install-capacity ramps (NG, HTTP, HTTP batches);
	# 5000/10000 calls and 30 s runs take about an hour here: run those by hand.
	target/release/mediaplane bench relay --calls 750,1800 --seconds 10 --capacity 1000000 --capacity-seconds 240 --out bench-results/relay
	# SRTP <-> RTP bridging (the caller SDES-SRTP, the callee plain RTP) beside the same calls in plain RTP.
	target/release/mediaplane bench relay --calls 200,750 --seconds 10 --media rtp,sdes-rtp --relays kernel-forward,mediaplane-userspace,mediaplane-ebpf,rtpengine --skip-capacity --out bench-results/relay-srtp
	target/release/mediaplane bench overload --out bench-results/overload
	# RTSP: one camera to 1, 10, 100 UDP viewers and 10 TCP ones, mediaplane's proxy on the socket
	# and eBPF planes beside gst-rtsp-server restreaming the same camera (about 3 min here).
	target/release/mediaplane bench rtsp --out bench-results/rtsp
	# Round trip through one relay pair, sockperf ping-pong: no relay, mediaplane, rtpengine.
	scripts/bench-pingpong.sh --out bench-results/pingpong

# The Debian package: target/debian/mediaplane_<version>_<arch>.deb (release build; binary,
# systemd unit, default configuration as a conffile, man pages, bash/zsh/fish completions).
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)
deb: release deb-tools
	$(MAKE) deb-assets BIN=$(TARGET_DIR)/release/mediaplane
	$(CARGO) deb -p mediaplane --no-build

deb-tools:
	@$(CARGO) deb --version >/dev/null 2>&1 || $(CARGO) install --locked cargo-deb

# Man pages and completions, generated from the clap definitions by the binary itself.
BIN ?= $(TARGET_DIR)/release/mediaplane
deb-assets:
	rm -rf deploy/gen && mkdir -p deploy/gen/man deploy/gen/completions
	$(BIN) man --out-dir deploy/gen/man && gzip -9n deploy/gen/man/*.1
	$(BIN) completions bash > deploy/gen/completions/mediaplane.bash
	$(BIN) completions zsh > deploy/gen/completions/_mediaplane
	$(BIN) completions fish > deploy/gen/completions/mediaplane.fish

clean:
	$(CARGO) clean
