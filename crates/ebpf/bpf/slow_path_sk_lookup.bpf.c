// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* mediaplane slow-path steering (sk_lookup, attached to the daemon's network namespace).
 *
 * What the TC fast path hands to the stack (STUN, a relay leg's first packet to latch, a copy
 * whose next hop is unresolved) must reach the user-space slow path. Binding one socket per SFU
 * address would cost a file descriptor and kernel memory per session and cap a relay at the
 * fd limit; instead every UDP packet to an address that has a stream entry is given to one of
 * the slow path's few catch-all sockets (picked by the source's hash, so a flow stays on one
 * worker). The socket learns the original destination from IP(V6)_ORIGDSTADDR.
 * Anything else (no entry, TCP) gets the normal socket lookup. */

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "common.h"
#include "stream_map.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

/* `streams` (stream_map.h) is the fast path's map, shared by fd (see src/steer.rs). */

/* Catch-all sockets: [0, MP_STEER_MAX) IPv4, [MP_STEER_MAX, 2 * MP_STEER_MAX) IPv6. */
#define MP_STEER_MAX 64
struct {
	__uint(type, BPF_MAP_TYPE_SOCKMAP);
	__uint(max_entries, 2 * MP_STEER_MAX);
	__type(key, __u32);
	__type(value, __u64);
} steer_sockets SEC(".maps");

/* How many sockets of each family are in steer_sockets: [0] IPv4, [1] IPv6. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u32);
} steer_count SEC(".maps");

/* Packets steered, and packets whose socket could not be assigned (counted, then the normal
 * lookup runs). */
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 2);
	__type(key, __u32);
	__type(value, __u64);
} steer_stats SEC(".maps");

static __always_inline void steer_count_inc(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&steer_stats, &idx);
	if (c)
		*c += 1;
}

SEC("sk_lookup")
int mp_slow_path_steer(struct bpf_sk_lookup *ctx)
{
	struct mp_ingress_key key = {};
	__u32 fam, hash;

	if (ctx->protocol != IPPROTO_UDP_NR)
		return SK_PASS;
	/* Context fields are read one by one (the verifier refuses pointer arithmetic on ctx). */
	if (ctx->family == AF_INET) {
		__u32 ip = ctx->local_ip4;
		__builtin_memcpy(key.addr, &ip, 4);
		key.family = MP_FAMILY_V4;
		fam = 0;
		hash = ctx->remote_ip4;
	} else if (ctx->family == AF_INET6) {
		__u32 ip[4];
		ip[0] = ctx->local_ip6[0];
		ip[1] = ctx->local_ip6[1];
		ip[2] = ctx->local_ip6[2];
		ip[3] = ctx->local_ip6[3];
		__builtin_memcpy(key.addr, ip, 16);
		key.family = MP_FAMILY_V6;
		fam = 1;
		hash = ctx->remote_ip6[0];
		hash ^= ctx->remote_ip6[1];
		hash ^= ctx->remote_ip6[2];
		hash ^= ctx->remote_ip6[3];
	} else {
		return SK_PASS;
	}
	key.port = bpf_htons(ctx->local_port); /* local_port is in host order */
	if (!bpf_map_lookup_elem(&streams, &key))
		return SK_PASS; /* not an SFU address (the wildcard entry exists for every one) */

	__u32 *n = bpf_map_lookup_elem(&steer_count, &fam);
	if (!n || *n == 0 || *n > MP_STEER_MAX)
		return SK_PASS;
	hash ^= ctx->remote_port * 0x9e3779b1u;
	hash ^= hash >> 16;
	__u32 idx = fam * MP_STEER_MAX + hash % *n;
	struct bpf_sock *sk = bpf_map_lookup_elem(&steer_sockets, &idx);
	if (!sk) {
		steer_count_inc(1);
		return SK_PASS;
	}
	long err = bpf_sk_assign(ctx, sk, 0);
	bpf_sk_release(sk);
	steer_count_inc(err ? 1 : 0);
	return SK_PASS;
}
