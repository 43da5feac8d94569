/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* UDP checksum verification for the TC fast path: it must forward only what the host's stack
 * would accept (udp_rcv drops a bad checksum before any socket sees it; the IPv4 header checksum
 * is checked in parse_udp). The device's verdict is used where it gave one (CHECKSUM_UNNECESSARY;
 * CHECKSUM_PARTIAL: a local sender, the checksum is not computed yet); otherwise the sum is
 * computed here, in 512-byte chunks (bpf_csum_diff's limit). Mirrors
 * mediaplane_core::packet::verify_checksums. Also the one's complement helpers the per-copy
 * rewrite and the header policy update checksums with. */
#ifndef MEDIAPLANE_CHECKSUM_H
#define MEDIAPLANE_CHECKSUM_H

#include "common.h"
#include "parse.h"

#define CSUM_CHUNK 512

struct mp_csum_scratch {
	__u8 b[CSUM_CHUNK];
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_csum_scratch);
} csum_scratch SEC(".maps");

struct mp_csum_walk {
	struct __sk_buff *skb;
	struct mp_csum_scratch *buf;
	__u32 off;
	__u32 end;
	__u64 sum;
	__u32 err;
};

/* `size` bytes at off into the sum (size a constant multiple of 4: every piece starts at an
 * offset from the UDP header that is a multiple of 4, so one's complement sums just add). */
static __always_inline int csum_piece(struct mp_csum_walk *w, __u32 size)
{
	if (bpf_skb_load_bytes(w->skb, w->off, w->buf->b, size))
		return -1;
	__s64 s = bpf_csum_diff(NULL, 0, (__be32 *)w->buf->b, size, 0);
	if (s < 0)
		return -1;
	w->sum += (__u32)s;
	w->off += size;
	return 0;
}

/* Whole CSUM_CHUNKs of [off, end); the rest is csum_tail's. */
static long csum_step(__u32 index, void *ctx)
{
	struct mp_csum_walk *w = ctx;
	if (!w->buf || w->end - w->off < CSUM_CHUNK)
		return 1;
	if (csum_piece(w, CSUM_CHUNK)) {
		w->err = 1;
		return 1;
	}
	return 0;
}

/* The last end - off < CSUM_CHUNK bytes, in constant-size pieces (the verifier wants constant
 * lengths), the final 1-3 zero-padded (RFC 768 pads an odd length with a zero byte). */
static __noinline int csum_tail(struct mp_csum_walk *w)
{
	if (!w->buf)
		return -1;
	__u32 n = w->end - w->off;
	if ((n & 256) && csum_piece(w, 256))
		return -1;
	if ((n & 128) && csum_piece(w, 128))
		return -1;
	if ((n & 64) && csum_piece(w, 64))
		return -1;
	if ((n & 32) && csum_piece(w, 32))
		return -1;
	if ((n & 16) && csum_piece(w, 16))
		return -1;
	if ((n & 8) && csum_piece(w, 8))
		return -1;
	if ((n & 4) && csum_piece(w, 4))
		return -1;
	__u32 rem = n & 3;
	if (!rem)
		return 0;
	*(__u32 *)w->buf->b = 0;
	long r = rem == 1 ? bpf_skb_load_bytes(w->skb, w->off, w->buf->b, 1)
		: rem == 2 ? bpf_skb_load_bytes(w->skb, w->off, w->buf->b, 2)
			   : bpf_skb_load_bytes(w->skb, w->off, w->buf->b, 3);
	if (r)
		return -1;
	__s64 s = bpf_csum_diff(NULL, 0, (__be32 *)w->buf->b, 4, 0);
	if (s < 0)
		return -1;
	w->sum += (__u32)s;
	w->off += rem;
	return 0;
}

/* ---- one's complement arithmetic (RFC 1624), on words as they lie in the packet ---- */

static __always_inline __u16 csum_fold64(__u64 x)
{
	x = (x & 0xffffffff) + (x >> 32);
	x = (x & 0xffff) + (x >> 16);
	x = (x & 0xffff) + (x >> 16);
	x = (x & 0xffff) + (x >> 16);
	return (__u16)x;
}

/* Sum of (new - old) over n 32-bit words. */
static __always_inline __u64 csum_delta(const __u32 *old, const __u32 *new, int n)
{
	__u64 acc = 0;
#pragma unroll
	for (int k = 0; k < n; k++)
		acc += (__u64)new[k] + (__u32)~old[k];
	return acc;
}

/* A checksum field (the complement of a sum) after the covered data changed by `delta`. */
static __always_inline __u16 csum_replace(__u16 check, __u64 delta)
{
	return ~csum_fold64((__u64)(__u16)~check + delta);
}

enum mp_csum_verdict { CSUM_OK, CSUM_BAD, CSUM_ERROR };

/* The UDP checksum of the parsed packet. `summed` is skb->ip_summed. */
static __noinline int udp_checksum_verdict(struct __sk_buff *skb, const struct mp_pkt *p, __u32 summed)
{
	if (summed == MP_CHECKSUM_PARTIAL || summed == MP_CHECKSUM_UNNECESSARY)
		return CSUM_OK;
	__be16 stored = 0;
	if (bpf_skb_load_bytes(skb, p->l4_off + 6, &stored, 2))
		return CSUM_ERROR;
	if (stored == 0)
		return p->family == MP_FAMILY_V4 ? CSUM_OK : CSUM_BAD; /* IPv6: RFC 8200 8.1 */
	__u32 zero = 0;
	struct mp_csum_scratch *buf = bpf_map_lookup_elem(&csum_scratch, &zero);
	if (!buf)
		return CSUM_ERROR;
	/* The pseudo-header, in the packet's byte order like the rest of the sum. */
	__u32 udp_len = p->payload_len + 8;
	__u32 plen;
	if (p->family == MP_FAMILY_V4) {
		__builtin_memcpy(buf->b, p->saddr, 4);
		__builtin_memcpy(buf->b + 4, p->daddr, 4);
		buf->b[8] = 0;
		buf->b[9] = IPPROTO_UDP_NR;
		buf->b[10] = udp_len >> 8;
		buf->b[11] = udp_len & 0xff;
		plen = 12;
	} else {
		__builtin_memcpy(buf->b, p->saddr, 16);
		__builtin_memcpy(buf->b + 16, p->daddr, 16);
		buf->b[32] = 0;
		buf->b[33] = 0;
		buf->b[34] = udp_len >> 8;
		buf->b[35] = udp_len & 0xff;
		buf->b[36] = 0;
		buf->b[37] = 0;
		buf->b[38] = 0;
		buf->b[39] = IPPROTO_UDP_NR;
		plen = 40;
	}
	__s64 ps = bpf_csum_diff(NULL, 0, (__be32 *)buf->b, plen, 0);
	if (ps < 0)
		return CSUM_ERROR;
	struct mp_csum_walk w = { .skb = skb, .buf = buf, .off = p->l4_off, .end = p->l4_off + udp_len, .sum = (__u32)ps };
	/* 65535 / 512 chunks cover any UDP datagram. */
	bpf_loop(128, csum_step, &w, 0);
	if (w.err || csum_tail(&w) || w.off != w.end)
		return CSUM_ERROR;
	return csum_fold64(w.sum) == 0xffff ? CSUM_OK : CSUM_BAD;
}

#endif
