// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* mediaplane XDP pre-filter, in front of the TC fan-out (sfu_tc.bpf.c) on the same interfaces.
 *
 * It drops (XDP_DROP) only packets ForwardingTable::classify() would certainly drop, before the
 * kernel builds an skb for them; everything else passes (XDP_PASS) to TC, which decides as
 * before. It reads the TC program's `streams` map (shared by fd) and nothing else, and writes
 * only its own counters. A packet is dropped when all of these hold:
 *   - untagged Ethernet, IPv4 without options, not a fragment, UDP, lengths consistent
 *     (what TC's parse_udp would accept); IPv6, VLAN tags and anything odd pass;
 *   - the destination (IP, port) has a wildcard entry flagged STREAM_F_ONE_SOURCE: every stream
 *     on that address (its wildcard stream if it has one, every SSRC-narrowed one) has the same
 *     fixed source, written in that entry (the placeholder of an address with only narrowed
 *     streams carries it too); no stream there latches;
 *   - the packet's source (IP and port) differs from that source;
 *   - the payload is not STUN (STUN goes to the slow path whoever sends it), and if the address
 *     wants RTP (an RTP wildcard stream, or any SSRC-narrowed stream) it is a valid RTP packet
 *     (an invalid one is classify's Malformed, TC counts it; RTCP, whose validity needs a walk
 *     over the compound, is left to TC too).
 * Then no entry the packet can select accepts its source, and classify() drops it:
 *   - as a Stranger when the entry exists: always with a real wildcard stream (an unknown SSRC
 *     falls back to it), and on a narrowed-only address when the SSRC has an entry. Counted as
 *     xdp_drop_stranger;
 *   - as NoStream on a narrowed-only address (placeholder wildcard) when no stream there has the
 *     packet's SSRC: one more lookup tells which. Counted as xdp_drop_no_stream (TC would count
 *     it as drop_no_stream).
 * Those are exactly classify()'s steps before those verdicts: TC, seeing the same entries, would
 * drop the packet the same way (see tests/test_run.rs, xdp_*, and tests/fuzz_test_run.rs). */

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "common.h"
#include "stream_map.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XDP_CNT__MAX);
	__type(key, __u32);
	__type(value, __u64);
} xdp_counters SEC(".maps");

static __always_inline void xcount(__u32 idx, __u64 n)
{
	__u64 *c = bpf_map_lookup_elem(&xdp_counters, &idx);
	if (c)
		*c += n; /* per-CPU; XDP runs in NAPI context, not preempted by itself on this CPU */
}

static __always_inline int pass(void)
{
	xcount(XDP_CNT_PASS, 1);
	return XDP_PASS;
}

/* RtpHeader::parse on the payload [off, off + len) of the frame: 1 = valid RTP. */
static __always_inline int rtp_valid(struct xdp_md *ctx, const __u8 *h, __u32 off, __u32 len)
{
	__u8 b0 = h[0];
	if (len < 12 || b0 >> 6 != 2)
		return 0;
	__u32 need = 12 + 4 * (b0 & 0x0f);
	if (len < need)
		return 0;
	if (b0 & 0x10) {
		__u8 x[4];
		if (len < need + 4 || bpf_xdp_load_bytes(ctx, off + need, x, 4))
			return 0;
		need += 4 + 4 * (((__u32)x[2] << 8) | x[3]);
		if (len < need)
			return 0;
	}
	if (b0 & 0x20) {
		__u8 pad;
		if (bpf_xdp_load_bytes(ctx, off + len - 1, &pad, 1))
			return 0;
		if (pad == 0 || need + pad > len)
			return 0;
	}
	return 1;
}

/* xdp.frags: attachable to devices whose MTU needs multi-buffer XDP (jumbo frames); a frame
 * whose IP packet does not fit its first buffer simply passes (checked against data_end). */
SEC("xdp.frags")
int xdp_prefilter(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	__u8 *eth = data;
	/* Ethernet + IPv4 (no options) + UDP + the first 20 payload bytes when present. */
	if ((void *)(eth + ETH_HLEN + 20 + 8) > end)
		return pass();
	if (((__u16)eth[12] << 8 | eth[13]) != ETH_P_IP)
		return pass(); /* IPv6, VLAN tags, ARP...: TC or the stack decide */
	__u8 *ip = eth + ETH_HLEN;
	if (ip[0] != 0x45) /* version 4, IHL 5: options (or garbage) pass */
		return pass();
	if (ip[9] != IPPROTO_UDP_NR || (((__u16)ip[6] << 8 | ip[7]) & 0x3fff))
		return pass(); /* not UDP, or a fragment */
	__u32 frame_len = (__u32)(end - data);
	__u32 total = (__u16)ip[2] << 8 | ip[3];
	if (total < 28 || total > frame_len - ETH_HLEN)
		return pass();
	__u8 *udp = ip + 20;
	__u32 udp_len = (__u16)udp[4] << 8 | udp[5];
	if (udp_len != total - 20)
		return pass(); /* also udp_len >= 8, as total >= 28 */

	struct mp_ingress_key key = {};
	__builtin_memcpy(key.addr, ip + 16, 4);
	__builtin_memcpy(&key.port, udp + 2, 2);
	key.family = MP_FAMILY_V4;
	const struct mp_stream_value *s = bpf_map_lookup_elem(&streams, &key);
	if (!s)
		return pass(); /* not an SFU address */
	__u32 flags = s->flags;
	if (!(flags & STREAM_F_ONE_SOURCE) || (flags & (STREAM_F_LATCH | STREAM_F_ANY_SOURCE)))
		return pass(); /* streams with other sources (or none fixed yet) there: TC decides */
	__u32 src_words[4] = {};
	__builtin_memcpy(src_words, ip + 12, 4);
	__u32 fixed[4];
	__builtin_memcpy(fixed, s->src_addr, 16);
	__be16 sport;
	__builtin_memcpy(&sport, udp, 2);
	if (fixed[0] == src_words[0] && fixed[1] == 0 && fixed[2] == 0 && fixed[3] == 0 && s->src_port == sport)
		return pass(); /* the registered source */

	/* Not the source: dropped, unless the payload makes classify() decide before the source
	 * check. */
	__u32 len = udp_len - 8;
	__u32 off = ETH_HLEN + 28;
	__u8 *pl = udp + 8;
	__u8 b0 = 0;
	if (len >= 1) {
		if ((void *)(pl + 1) > end)
			return pass();
		b0 = pl[0];
	}
	/* STUN (rtp::demux): >= 20 bytes, top bits 00, length % 4 == 0, magic cookie. */
	if (len >= 20 && b0 <= 3) {
		if ((void *)(pl + 20) > end)
			return pass();
		if ((b0 & 0xc0) == 0 && (pl[3] & 3) == 0 && pl[4] == 0x21 && pl[5] == 0x12 && pl[6] == 0xa4 && pl[7] == 0x42)
			return pass();
	}
	__u32 counter = XDP_CNT_DROP_STRANGER;
	if (flags & (STREAM_F_RTP | STREAM_F_NARROWED)) {
		/* rtp::demux: RTP/RTCP need 128 <= b0 <= 191 and a second byte; RTCP if 192..223. */
		if (len < 12 || b0 < 128 || b0 > 191)
			return pass(); /* malformed for an RTP address: TC counts it */
		if ((void *)(pl + 12) > end)
			return pass();
		if (pl[1] >= 192 && pl[1] <= 223)
			return pass(); /* RTCP */
		if (!rtp_valid(ctx, pl, off, len))
			return pass();
		if ((flags & STREAM_F_NARROWED) && !(flags & STREAM_F_PRESENT)) {
			/* Only narrowed streams here: the SSRC's own entry, or none (NoStream). */
			__u32 ssrc;
			__builtin_memcpy(&ssrc, pl + 8, 4);
			key.has_ssrc = 1;
			key.ssrc = bpf_ntohl(ssrc);
			if (!bpf_map_lookup_elem(&streams, &key))
				counter = XDP_CNT_DROP_NO_STREAM;
		}
	}
	xcount(counter, 1);
	xcount(XDP_CNT_DROP_BYTES, len);
	return XDP_DROP;
}
