/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Copies are the SFU's own packets, the same on every plane and both paths of the kernel plane:
 * IPv4 TTL / IPv6 hop limit as the host sends (fast_config.ttl / hop_limit), DSCP from the
 * policy (fast_config.dscp, or the publisher's with MP_CFG_KEEP_DSCP), ECN Not-ECT, IPv4 DF set
 * with an ID of the SFU's own (random; a Linux UDP socket with the default IP_PMTUDISC_WANT sets
 * DF and still draws an ID from its generator; an atomic datagram's ID means nothing, RFC 6864),
 * IPv6 flow label 0. Written once per packet, before the per-copy address rewrite. */
#ifndef MEDIAPLANE_HEADER_H
#define MEDIAPLANE_HEADER_H

#include "common.h"
#include "maps.h"
#include "parse.h"
#include "checksum.h"

#define MP_DEFAULT_TTL 64

static __always_inline __u8 policy_tclass(const struct mp_fast_config *cfg, __u8 tclass)
{
	if (cfg && (cfg->flags & MP_CFG_KEEP_DSCP))
		return tclass & 0xfc;
	return cfg ? (__u8)(cfg->dscp << 2) : 0;
}

/* Returns 0, or -1 if a helper failed (nothing sent yet: the caller hands the packet up). */
static __noinline int write_own_header(struct __sk_buff *skb, __u32 l3_off, __u32 family, const struct mp_fast_config *cfg)
{
	__u8 h[12];
	if (family == MP_FAMILY_V4) {
		if (bpf_skb_load_bytes(skb, l3_off, h, 12))
			return -1;
		__u8 ttl = cfg && cfg->ttl ? cfg->ttl : MP_DEFAULT_TTL;
		__u8 tos = policy_tclass(cfg, h[1]);
		/* The 16-bit words that change: (version/IHL, TOS), ID, flags/fragment, (TTL, protocol). */
		__u16 old[4] = { rd16(h), rd16(h + 4), rd16(h + 6), rd16(h + 8) };
		__u16 id = (__u16)bpf_get_prandom_u32();
		__u16 new[4] = { (__u16)(((__u16)h[0] << 8) | tos), id, 0x4000, (__u16)(((__u16)ttl << 8) | h[9]) };
		/* RFC 1624, in host order like the words. */
		__u64 delta = 0;
#pragma unroll
		for (int k = 0; k < 4; k++)
			delta += (__u16)~old[k] + (__u32)new[k];
		__u16 check = csum_replace(rd16(h + 10), delta);
		h[1] = tos;
		h[4] = id >> 8;
		h[5] = id & 0xff;
		h[6] = 0x40;
		h[7] = 0;
		h[8] = ttl;
		h[10] = check >> 8;
		h[11] = check & 0xff;
		return bpf_skb_store_bytes(skb, l3_off, h, 12, BPF_F_RECOMPUTE_CSUM) ? -1 : 0;
	}
	if (bpf_skb_load_bytes(skb, l3_off, h, 8))
		return -1;
	__u8 hop = cfg && cfg->hop_limit ? cfg->hop_limit : MP_DEFAULT_TTL;
	__u8 tclass = policy_tclass(cfg, (__u8)((h[0] << 4) | (h[1] >> 4)));
	__u8 v[4] = { (__u8)(0x60 | (tclass >> 4)), (__u8)(tclass << 4), 0, 0 };
	if (h[0] != v[0] || h[1] != v[1] || h[2] != v[2] || h[3] != v[3]) {
		if (bpf_skb_store_bytes(skb, l3_off, v, 4, BPF_F_RECOMPUTE_CSUM))
			return -1;
	}
	if (h[7] != hop && bpf_skb_store_bytes(skb, l3_off + 7, &hop, 1, BPF_F_RECOMPUTE_CSUM))
		return -1;
	return 0;
}

#endif
