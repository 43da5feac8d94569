/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Packet parsing for the TC programs. It mirrors mediaplane_core::packet::parse_frame and
 * mediaplane_core::rtp (demux, RtpHeader::parse, parse_rtcp_compound) check for check, so the
 * kernel and the reference classify() agree on what is forwardable.
 *
 * Everything goes through bpf_skb_load_bytes: it works on non-linear skbs and keeps the
 * verifier simple; the fan-out (clones) dominates the cost anyway. Bigger helpers are
 * __noinline so their buffers do not add to the main program's stack frame (512 bytes shared
 * with the bpf_loop callbacks). */
#ifndef MEDIAPLANE_PARSE_H
#define MEDIAPLANE_PARSE_H

#include "common.h"

#define PARSE_OK (-1)

struct mp_pkt {
	__u32 l3_off;
	__u32 l4_off;
	__u32 payload_off;
	__u32 payload_len; /* from the UDP length field */
	__u32 ip_len;      /* IP header + payload (IPv4 total length, IPv6 40 + payload length) */
	__u8 family;       /* MP_FAMILY_* */
	__u8 vlan_in_data; /* an 802.1Q/802.1ad tag sits in the frame bytes (not offloaded) */
	__u8 ip_csum_bad;  /* IPv4: the header checksum is wrong (the stack's ip_rcv would drop it) */
	__u8 first_fragment; /* CNT_PASS_FRAGMENT of an IPv4 datagram's first fragment: family,
	                        addresses and ports are filled in (order.h holds its stream) */
	__u8 saddr[16];
	__u8 daddr[16];
	__be16 sport;
	__be16 dport;
};

static __always_inline __u16 rd16(const __u8 *b)
{
	return ((__u16)b[0] << 8) | b[1];
}

static __always_inline __u32 rd32(const __u8 *b)
{
	return ((__u32)b[0] << 24) | ((__u32)b[1] << 16) | ((__u32)b[2] << 8) | b[3];
}

/* No memcmp in BPF: compare 16-byte addresses word by word. */
static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	__u32 x[4], y[4];
	__builtin_memcpy(x, a, 16);
	__builtin_memcpy(y, b, 16);
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

static __always_inline int is_ipv6_ext_header(__u8 nexthdr)
{
	switch (nexthdr) {
	case 0:   /* hop-by-hop */
	case 43:  /* routing */
	case 50:  /* ESP */
	case 51:  /* AH */
	case 60:  /* destination options */
	case 135: /* mobility */
	case 139: /* HIP */
	case 140: /* shim6 */
		return 1;
	}
	return 0;
}

/* Ethernet (+ one VLAN tag) / IPv4 or IPv6 / UDP. Returns PARSE_OK or the CNT_PASS_* counter
 * saying why the packet goes to the stack. */
static __noinline int parse_udp(struct __sk_buff *skb, struct mp_pkt *p)
{
	__u32 len = skb->len;
	__u8 b[40];
	__u32 l3 = ETH_HLEN, l4, ip_end;

	if (skb->gso_segs > 1)
		return CNT_PASS_GSO;
	if (bpf_skb_load_bytes(skb, 12, b, 2))
		return CNT_PASS_TRUNCATED;
	__u16 proto = rd16(b);
	if (proto == ETH_P_8021Q || proto == ETH_P_8021AD) {
		if (skb->vlan_present)
			return CNT_PASS_VLAN; /* one offloaded tag plus one in the data */
		if (bpf_skb_load_bytes(skb, 16, b, 2))
			return CNT_PASS_TRUNCATED;
		proto = rd16(b);
		if (proto == ETH_P_8021Q || proto == ETH_P_8021AD)
			return CNT_PASS_VLAN;
		l3 += 4;
		p->vlan_in_data = 1;
	}
	if (proto == ETH_P_IP) {
		if (len < l3 + 20 || bpf_skb_load_bytes(skb, l3, b, 20))
			return CNT_PASS_TRUNCATED;
		if (b[0] >> 4 != 4)
			return CNT_PASS_BAD_IP_HEADER;
		__u32 ihl = (b[0] & 0x0f) * 4;
		if (ihl < 20)
			return CNT_PASS_BAD_IP_HEADER;
		__u32 total = rd16(b + 2);
		if (total < ihl || total > len - l3)
			return CNT_PASS_BAD_IP_HEADER;
		if (ihl > 20)
			return CNT_PASS_IP_OPTIONS;
		if (rd16(b + 6) & 0x3fff) { /* MF or a fragment offset */
			__u8 u[4];
			if ((rd16(b + 6) & 0x1fff) == 0 && b[9] == IPPROTO_UDP_NR && ihl == 20 && total >= 28 &&
			    !bpf_skb_load_bytes(skb, l3 + 20, u, 4)) {
				p->first_fragment = 1;
				p->l4_off = l3 + 20;
				p->family = MP_FAMILY_V4;
				__builtin_memcpy(p->saddr, b + 12, 4);
				__builtin_memcpy(p->daddr, b + 16, 4);
				__builtin_memcpy(&p->sport, u, 2);
				__builtin_memcpy(&p->dport, u + 2, 2);
			}
			return CNT_PASS_FRAGMENT;
		}
		if (b[9] != IPPROTO_UDP_NR)
			return CNT_PASS_NOT_UDP;
		__u32 hsum = 0;
#pragma unroll
		for (int k = 0; k < 20; k += 2)
			hsum += rd16(b + k);
		hsum = (hsum & 0xffff) + (hsum >> 16);
		hsum = (hsum & 0xffff) + (hsum >> 16);
		p->ip_csum_bad = hsum != 0xffff;
		p->family = MP_FAMILY_V4;
		__builtin_memcpy(p->saddr, b + 12, 4);
		__builtin_memcpy(p->daddr, b + 16, 4);
		l4 = l3 + 20;
		ip_end = l3 + total;
		p->ip_len = total;
	} else if (proto == ETH_P_IPV6) {
		if (len < l3 + 40 || bpf_skb_load_bytes(skb, l3, b, 40))
			return CNT_PASS_TRUNCATED;
		if (b[0] >> 4 != 6)
			return CNT_PASS_BAD_IP_HEADER;
		__u32 plen = rd16(b + 4);
		if (40 + plen > len - l3)
			return CNT_PASS_BAD_IP_HEADER;
		if (b[6] != IPPROTO_UDP_NR) {
			if (b[6] == 44)
				return CNT_PASS_FRAGMENT;
			return is_ipv6_ext_header(b[6]) ? CNT_PASS_IPV6_EXT : CNT_PASS_NOT_UDP;
		}
		p->family = MP_FAMILY_V6;
		__builtin_memcpy(p->saddr, b + 8, 16);
		__builtin_memcpy(p->daddr, b + 24, 16);
		l4 = l3 + 40;
		ip_end = l3 + 40 + plen;
		p->ip_len = 40 + plen;
	} else {
		return CNT_PASS_NOT_IP;
	}
	if (l4 + 8 > ip_end || bpf_skb_load_bytes(skb, l4, b, 8))
		return CNT_PASS_TRUNCATED;
	__u32 udp_len = rd16(b + 4);
	if (udp_len < 8 || l4 + udp_len != ip_end)
		return CNT_PASS_BAD_UDP_LENGTH;
	__builtin_memcpy(&p->sport, b, 2);
	__builtin_memcpy(&p->dport, b + 2, 2);
	p->l3_off = l3;
	p->l4_off = l4;
	p->payload_off = l4 + 8;
	p->payload_len = udp_len - 8;
	return PARSE_OK;
}

/* ---- RTP / RTCP / STUN (RFC 7983 demux, RFC 5761 RTCP mux) ---- */

enum media_kind { MK_STUN, MK_RTP, MK_RTCP, MK_OTHER };

struct mp_payload_head {
	__u8 b[20];
	__u32 have; /* bytes of b that are valid: min(payload_len, 20) rounded down to 20/12/2/1/0 */
};

static __always_inline int load_head(struct __sk_buff *skb, const struct mp_pkt *p, struct mp_payload_head *h)
{
	__u32 n = p->payload_len, off = p->payload_off;
	h->have = 0;
	if (n >= 20) {
		if (bpf_skb_load_bytes(skb, off, h->b, 20))
			return -1;
		h->have = 20;
	} else if (n >= 12) {
		if (bpf_skb_load_bytes(skb, off, h->b, 12))
			return -1;
		h->have = 12;
	} else if (n >= 2) {
		if (bpf_skb_load_bytes(skb, off, h->b, 2))
			return -1;
		h->have = 2;
	} else if (n == 1) {
		if (bpf_skb_load_bytes(skb, off, h->b, 1))
			return -1;
		h->have = 1;
	}
	return 0;
}

static __always_inline enum media_kind demux(const struct mp_pkt *p, const struct mp_payload_head *h)
{
	if (h->have == 0)
		return MK_OTHER;
	__u8 b0 = h->b[0];
	if (b0 <= 3) {
		/* STUN: >= 20 bytes, top two bits zero, length % 4 == 0, magic cookie. */
		if (p->payload_len >= 20 && h->have >= 20 && (b0 & 0xc0) == 0 && rd16(h->b + 2) % 4 == 0 &&
		    rd32(h->b + 4) == 0x2112a442)
			return MK_STUN;
		return MK_OTHER;
	}
	if (b0 >= 128 && b0 <= 191 && h->have >= 2) {
		__u8 b1 = h->b[1];
		return (b1 >= 192 && b1 <= 223) ? MK_RTCP : MK_RTP;
	}
	return MK_OTHER;
}

/* RtpHeader::parse on the `len` bytes at `off`, whose first byte is b0: where the payload
 * starts and how long it is (padding excluded). -1: not valid RTP. */
static __always_inline int rtp_bounds(struct __sk_buff *skb, __u32 off, __u32 len, __u8 b0, __u32 *poff, __u32 *plen)
{
	if (len < 12 || b0 >> 6 != 2)
		return -1;
	__u32 at = 12 + 4 * (b0 & 0x0f);
	if (len < at)
		return -1;
	if (b0 & 0x10) {
		__u8 x[4];
		if (len < at + 4 || bpf_skb_load_bytes(skb, off + at, x, 4))
			return -1;
		at += 4 + 4 * (__u32)rd16(x + 2);
		if (len < at)
			return -1;
	}
	__u32 pad = 0;
	if (b0 & 0x20) {
		__u8 last;
		if (bpf_skb_load_bytes(skb, off + len - 1, &last, 1))
			return -1;
		pad = last;
		if (pad == 0 || at + pad > len)
			return -1;
	}
	*poff = at;
	*plen = len - at - pad;
	return 0;
}

/* RtpHeader::parse: returns 0 and the SSRC, or -1 (malformed). */
static __always_inline int rtp_ssrc(struct __sk_buff *skb, const struct mp_pkt *p, const struct mp_payload_head *h,
				    __u32 *ssrc)
{
	__u32 poff, plen;
	if (h->have < 12 || rtp_bounds(skb, p->payload_off, p->payload_len, h->b[0], &poff, &plen))
		return -1;
	*ssrc = rd32(h->b + 8);
	return 0;
}

struct mp_rtcp_walk {
	struct __sk_buff *skb;
	__u32 base;
	__u32 len;
	__u32 at;
	__u32 bad;
};

static long rtcp_walk_step(__u32 index, void *ctx)
{
	struct mp_rtcp_walk *w = ctx;
	__u8 x[4];
	if (w->at >= w->len)
		return 1;
	if (w->len - w->at < 4 || bpf_skb_load_bytes(w->skb, w->base + w->at, x, 4)) {
		w->bad = 1;
		return 1;
	}
	__u32 plen = ((__u32)rd16(x + 2) + 1) * 4;
	if (x[0] >> 6 != 2 || plen < 8 || w->at + plen > w->len) {
		w->bad = 1;
		return 1;
	}
	w->at += plen;
	return 0;
}

/* parse_rtcp_compound: every packet's version and length must be consistent; the SSRC is the
 * first packet's sender SSRC. Returns 0 or -1 (malformed). */
static __always_inline int rtcp_ssrc(struct __sk_buff *skb, const struct mp_pkt *p, __u32 *ssrc)
{
	__u32 len = p->payload_len;
	__u8 x[4];
	if (len < 8)
		return -1;
	struct mp_rtcp_walk w = { .skb = skb, .base = p->payload_off, .len = len };
	/* Each packet is >= 8 bytes: len / 8 + 1 steps always reach the end or an error. */
	bpf_loop(len / 8 + 1, rtcp_walk_step, &w, 0);
	if (w.bad || w.at != len)
		return -1;
	if (bpf_skb_load_bytes(skb, p->payload_off + 4, x, 4))
		return -1;
	*ssrc = rd32(x);
	return 0;
}

#endif
