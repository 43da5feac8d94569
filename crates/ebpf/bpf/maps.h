/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Map layouts. Rust mirror: src/maps.rs (its unit tests compare sizes with this BTF). */
#ifndef MEDIAPLANE_MAPS_H
#define MEDIAPLANE_MAPS_H

#include "common.h"
#include "stream_map.h"

/* One output copy: the full rewrite. MACs and ifindex come from bpf_fib_lookup per packet. */
struct mp_copy_rewrite {
	__u8 from_addr[16];
	__u8 to_addr[16];
	__be16 from_port;
	__be16 to_port;
	__u32 stream_id; /* owner, checked against the stream (guards against a reused slot) */
	__u32 consumer;  /* the consumer (subscription) this copy is for, key of consumer_stats; 0 = none */
};

/* Per-consumer per-CPU counters of what the kernel sent for it. */
struct mp_consumer_counters {
	__u64 tx_copies;
	__u64 tx_bytes;
	__u64 tx_errors;
};

/* Per-stream per-CPU counters: only what the kernel decided (see enum mp_counter). */
struct mp_stream_counters {
	__u64 rx_packets;
	__u64 rx_bytes;
	__u64 tx_copies;
	__u64 tx_bytes;
	__u64 tx_errors;
	__u64 drop_stranger;
	__u64 drop_malformed;
	__u64 pass_slow; /* handed to the slow path (STUN, unlatched, no neighbour...) */
	__u64 drop_rate_limited;
	__u64 drop_bad_checksum;
	__u64 drop_spoofed;
	__u64 last_rx_ns; /* bpf_ktime_get_ns() of the last packet forwarded (0 = none); not summed */
	__u64 keyframes;  /* a simulcast layer's keyframe starts forwarded (they answer requests) */
};

/* A stream's rate limit (mediaplane_core::ratelimit: GCRA, the same integer arithmetic) and its
 * state. Written by user space (BPF_F_LOCK) when the stream's limit is installed. */
struct mp_rate {
	struct bpf_spin_lock lock;
	__u32 pad;
	__u64 interval_ns;   /* per packet, 0 = none */
	__u64 byte_cost_q16; /* per payload byte, 1/65536 ns, 0 = none */
	__u64 tau_ns;
	__u64 tat_packets;
	__u64 tat_bytes;
};

/* Next-hop cache entry, one per copy slot (direct-mapped: slot & (NH_CACHE_SIZE - 1)). It is
 * valid for exactly the copy it was resolved for (the first 36 bytes of mp_copy_rewrite: both
 * addresses and ports), arriving on in_ifindex, for IP packets up to max_len bytes (the MTU check
 * bpf_fib_lookup made), while the generation matches (user space bumps it on every route,
 * neighbour, address or link change it hears of) and until expires_ns (a safety net).
 * Only successful lookups are cached. */
struct mp_nh_cache {
	__u32 key[9];
	__u32 in_ifindex;
	__u32 out_ifindex;
	__u32 gen;
	__u32 max_len;
	__u8 dmac[ETH_ALEN];
	__u8 smac[ETH_ALEN];
	__u64 expires_ns;
};

/* Fan-out lists: ranges allocated by user space. A changed list is written to a fresh range,
 * the stream entry flipped to it, and the old range freed only after an RCU barrier. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* resized by the loader */
	__type(key, __u32);
	__type(value, struct mp_copy_rewrite);
} copies SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 65536); /* = streams max_entries */
	__type(key, __u32);
	__type(value, struct mp_stream_counters);
} stream_stats SEC(".maps");

/* By consumer uid. User space creates an entry (zero) before it writes the first copy for the
 * consumer and deletes it once the consumer is gone; the program never creates one, so a copy
 * still in flight for a consumer just deleted is not counted rather than resurrecting it. Not
 * preallocated: a deleted element is freed after an RCU grace period, never reused under a
 * program still holding it (and only live consumers take memory). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536); /* = copies max_entries: every consumer has a copy */
	__type(key, __u32);
	__type(value, struct mp_consumer_counters);
} consumer_stats SEC(".maps");

/* Indexed like stream_stats. Shared by all CPUs (one bucket per stream), under its lock. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* = streams max_entries */
	__type(key, __u32);
	__type(value, struct mp_rate);
} stream_rate SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT__MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

/* Per-copy processing time: entry of the program -> after that copy's clone_redirect. */
struct mp_latency_hist {
	__u64 buckets[LAT_BUCKETS];
	__u64 sum;
	__u64 min; /* 0 = none yet */
	__u64 max;
	__u64 count;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_latency_hist);
} copy_latency SEC(".maps");

/* Per CPU, so entries are never torn by a concurrent writer. NH_CACHE_SIZE >= MAX_FANOUT: the
 * copies of one packet (a contiguous slot range) never share an entry. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, NH_CACHE_SIZE);
	__type(key, __u32);
	__type(value, struct mp_nh_cache);
} nh_cache SEC(".maps");

/* [0]: next-hop generation, bumped by user space (see mp_nh_cache). */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
} nh_gen SEC(".maps");

/* Not used by programs. Updating a map-in-map from user space makes the kernel wait for an
 * RCU grace period (maybe_wait_bpf_programs), i.e. until every program run that could still
 * hold an old stream value has finished: the barrier before freeing fan-out ranges. */
struct barrier_inner {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u32);
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY_OF_MAPS);
	__uint(max_entries, 1);
	__type(key, __u32);
	__array(values, struct barrier_inner);
} rcu_barrier SEC(".maps");

/* Per-source rate limit (mediaplane_core::ratelimit GCRA, as RateParams::admit): the limit in
 * source_limit[0] (all zero = off, written by user space), one bucket per source IP address in
 * an LRU hash (a forgotten idle source loses nothing: an idle bucket equals a fresh one). LRU
 * values cannot hold a bpf_spin_lock: the buckets advance with compare-and-swap. */
struct mp_source_key {
	__u8 addr[16];
	__u8 family; /* MP_FAMILY_* */
	__u8 pad[3];
};

struct mp_source_state {
	__u64 tat_packets;
	__u64 tat_bytes;
};

struct mp_source_limit {
	__u64 interval_ns;
	__u64 byte_cost_q16;
	__u64 tau_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, MAX_SOURCES);
	__type(key, struct mp_source_key);
	__type(value, struct mp_source_state);
} source_rate SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_source_limit);
} source_limit SEC(".maps");

/* What the fast path makes of a copy's IP header, and which checks it runs. Written by user space
 * (fast_config[0]); all zero (no entry written yet) means: no checks, TTL/hop limit 64, DSCP 0. */
struct mp_fast_config {
	__u32 flags;     /* MP_CFG_* */
	__u8 ttl;        /* IPv4 TTL of every copy (the host's net.ipv4.ip_default_ttl) */
	__u8 hop_limit;  /* IPv6 hop limit of every copy (net.ipv6.conf.all.hop_limit) */
	__u8 dscp;       /* DSCP of every copy, unless MP_CFG_KEEP_DSCP */
	__u8 rpf_v6;     /* MP_RPF_* for IPv6 sources (IPv6 has no rp_filter sysctl) */
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_fast_config);
} fast_config SEC(".maps");

/* IPv4 reverse-path mode per ingress ifindex (max of net.ipv4.conf.{all,<dev>}.rp_filter, as the
 * kernel applies it), kept current by user space. No entry: MP_RPF_OFF. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} rpf_mode SEC(".maps");

/* Per-stream path state, indexed like stream_stats; mmapped by user space, which writes `done`.
 * - rpf_ok, rpf_src: (ingress ifindex << 32 | next-hop generation) + 1 in which the source
 *   rpf_src passed the reverse-path check (only for fixed-source streams: one source, so the
 *   check runs once per route change, see rpf.h).
 * - up / done: the sequence number of the last packet of the stream the fast path handed up in
 *   order (marked, see MP_ORDER_MARK) / the sequence number of the last one the slow path has
 *   sent (written by user space; MP_ORDER_SEQ_MASK bits). While they differ, later packets go up
 *   too, so none overtakes one still in the slow path. The slow path serves a stream first in,
 *   first out: its newest acknowledgement covers every earlier packet, sent or lost.
 * - seen_done / progress_ns: the last `done` the program saw and when it changed (or the hold
 *   began): a hold that sees no progress for MP_ORDER_HOLD_MAX_NS ends (what went up last was
 *   lost: it must not pin the stream to the slow path). */
struct mp_stream_path {
	__u64 rpf_ok;
	__u8 rpf_src[16];
	__u64 up;
	__u64 done;
	__u64 seen_done;
	__u64 progress_ns;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(map_flags, BPF_F_MMAPABLE);
	__uint(max_entries, 65536); /* = streams max_entries */
	__type(key, __u32);
	__type(value, struct mp_stream_path);
} stream_path SEC(".maps");

/* bpf_fib_lookup parameters: in a per-CPU map rather than on the stack (the fan-out's call chain
 * is near the 512-byte stack limit). Nothing runs between filling and reading it. */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct bpf_fib_lookup);
} fib_scratch SEC(".maps");

static __always_inline void count(__u32 idx, __u64 n)
{
	__u64 *c = bpf_map_lookup_elem(&counters, &idx);
	if (c)
		*c += n; /* per-CPU, and TC runs with migration disabled: no atomics needed */
}

static __always_inline struct mp_stream_counters *stream_counters_of(const struct mp_stream_value *s)
{
	__u32 slot = s->stats_slot;
	return bpf_map_lookup_elem(&stream_stats, &slot);
}

static __always_inline struct mp_stream_path *stream_path_of(const struct mp_stream_value *s)
{
	__u32 slot = s->stats_slot;
	return bpf_map_lookup_elem(&stream_path, &slot);
}

static __always_inline const struct mp_fast_config *fast_config_get(void)
{
	__u32 zero = 0;
	return bpf_map_lookup_elem(&fast_config, &zero);
}

#endif
