/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Reverse-path check (anti-spoofing). XDP and TC run before the kernel's own rp_filter
 * (fib_validate_source), so without this a stranger's link could inject packets carrying a
 * publisher's source address and have them fanned out. The source must be reachable back
 * through the ingress interface (strict) or through any interface (loose), as the interface's
 * rp_filter says (IPv4, kept in rpf_mode by user space) or fast_config.rpf_v6 (IPv6).
 * A stream has one source: a passed check is remembered per stream (ingress, next-hop
 * generation, source) and runs again only when a route, neighbour or mode changes. */
#ifndef MEDIAPLANE_RPF_H
#define MEDIAPLANE_RPF_H

#include "common.h"
#include "maps.h"
#include "parse.h"

static __always_inline __u32 rpf_mode_for(const struct mp_pkt *p, __u32 ifindex, const struct mp_fast_config *cfg)
{
	if (p->family == MP_FAMILY_V6)
		return cfg ? cfg->rpf_v6 : MP_RPF_OFF;
	__u32 *m = bpf_map_lookup_elem(&rpf_mode, &ifindex);
	return m ? *m : MP_RPF_OFF;
}

/* 1 if the source passes, 0 if not. */
static __noinline int rpf_lookup(struct __sk_buff *skb, const struct mp_pkt *p, __u32 mode)
{
	__u32 zero = 0;
	struct bpf_fib_lookup *fib = bpf_map_lookup_elem(&fib_scratch, &zero);
	if (!fib)
		return 1;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->l4_protocol = IPPROTO_UDP_NR;
	fib->sport = p->dport;
	fib->dport = p->sport;
	fib->ifindex = skb->ifindex;
	if (p->family == MP_FAMILY_V4) {
		fib->family = AF_INET;
		__builtin_memcpy(&fib->ipv4_src, p->daddr, 4);
		__builtin_memcpy(&fib->ipv4_dst, p->saddr, 4);
	} else {
		fib->family = AF_INET6;
		__builtin_memcpy(fib->ipv6_src, p->daddr, 16);
		__builtin_memcpy(fib->ipv6_dst, p->saddr, 16);
	}
	long rc = bpf_fib_lookup(skb, fib, sizeof(*fib), BPF_FIB_LOOKUP_SKIP_NEIGH);
	/* Forwarding off on the ingress: no lookup can say anything (and the fast path forwards
	 * nothing there); the host's own check applies on the way up. */
	if (rc == BPF_FIB_LKUP_RET_FWD_DISABLED || rc < 0)
		return 1; /* (rc < 0: the helper failed, which says nothing about the source) */
	/* No route back, a blackhole or prohibit route, or a local/broadcast source: spoofed. */
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return 0;
	return mode != MP_RPF_STRICT || fib->ifindex == skb->ifindex;
}

/* 1 if the packet's source passes the reverse-path check on its ingress. `sp` caches a pass for
 * a fixed-source stream (NULL: no cache). */
static __always_inline int rpf_ok(struct __sk_buff *skb, const struct mp_pkt *p, const struct mp_fast_config *cfg,
				  struct mp_stream_path *sp, __u32 gen)
{
	__u32 ifindex = skb->ifindex;
	__u64 key = (((__u64)ifindex << 32) | gen) + 1;
	if (sp && sp->rpf_ok == key && same_addr(sp->rpf_src, p->saddr))
		return 1;
	__u32 mode = rpf_mode_for(p, ifindex, cfg);
	if (mode != MP_RPF_OFF && !rpf_lookup(skb, p, mode))
		return 0;
	if (sp) {
		__builtin_memcpy(sp->rpf_src, p->saddr, 16);
		sp->rpf_ok = key;
	}
	return 1;
}

#endif
