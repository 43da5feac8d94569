/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* The stream table: the one map every mediaplane program reads (the TC fast path owns it, the
 * XDP pre-filter shares it by fd). Rust mirror: src/maps.rs (KeyRaw, StreamValueRaw). */
#ifndef MEDIAPLANE_STREAM_MAP_H
#define MEDIAPLANE_STREAM_MAP_H

#include "common.h"

/* Where a packet enters: local address + UDP port, optionally narrowed by SSRC.
 * IPv4 addresses use addr[0..4], the rest zero. Ports in network order. */
struct mp_ingress_key {
	__u8 addr[16];
	__be16 port;
	__u8 family;   /* MP_FAMILY_V4 / MP_FAMILY_V6 */
	__u8 has_ssrc; /* 0: the wildcard entry of this local address */
	__u32 ssrc;    /* host order, 0 when has_ssrc == 0 */
};

struct mp_stream_value {
	__u32 id;         /* StreamEntry::id */
	__u32 flags;      /* STREAM_F_* */
	__u8 src_addr[16];/* the Fixed source (unless STREAM_F_LATCH) */
	__be16 src_port;
	union {
		struct {
			__u8 layer; /* STREAM_F_SIMULCAST: which layer of its stream this is (0 = lowest) */
			__u8 codec; /* STREAM_F_SIMULCAST: MP_CODEC_* (where keyframes and picture ids are) */
		};
		/* STREAM_F_PT_UP (a relay leg, never simulcast): RTP of these payload types goes to the
		 * slow path (0xff: none); the rest is forwarded here. */
		__u8 up_pt[2];
	};
	__u32 stats_slot; /* index into stream_stats */
	__u32 copies_base;/* first index into copies[] */
	__u32 copies_count;
	__u32 clock_rate; /* RTP clock rate (Hz) of the payload, 0 = unknown: no jitter measured */
};

/* Stream entries. No prealloc: a replaced value is freed after an RCU grace period, so a
 * program that looked up the old value keeps reading a stable copy of it. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536); /* resized by the loader */
	__type(key, struct mp_ingress_key);
	__type(value, struct mp_stream_value);
} streams SEC(".maps");

#endif
