# mediaplane: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
CARGO ?= cargo

.PHONY: all deps build release test demo bench clean

all: build

deps:
	@scripts/install-deps.sh

build: deps
	$(CARGO) build --workspace

release: deps
	$(CARGO) build --release -p mediaplane

# Unit, loopback, kernel (BPF_PROG_TEST_RUN, network namespaces) and interop tests.
# Privileged tests fail rather than skip when CI=true.
test: deps
	$(CARGO) test --workspace --no-fail-fast

# A real multi-party conference in network namespaces, through each data plane.
demo: release
	target/release/mediaplane demo

# The full sweep (N = 2..12, 16, 32, 64; both scenarios; every data plane), < 30 min here.
BENCH_DATAPLANES ?= userspace,ebpf
bench: release
	target/release/mediaplane bench sfu --dataplanes $(BENCH_DATAPLANES) --out bench-results

clean:
	$(CARGO) clean
