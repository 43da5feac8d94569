// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* mediaplane TC ingress fast path: SFU fan-out and SIP relay forwarding.
 *
 * Per packet, in the order of ForwardingTable::classify():
 *   parse (cannot judge -> stack) -> stream on (dst ip, dst port)? (no -> stack, not ours)
 *   -> STUN (-> stack) -> RTP/RTCP validity if the stream(s) need RTP (bad -> drop malformed)
 *   -> SSRC-narrowed entry, else the wildcard entry (none -> drop no_stream)
 *   -> source: unlatched -> stack; not the fixed source -> drop stranger
 *   -> resolve every copy's next hop (bpf_fib_lookup); any failure -> the whole packet to the
 *      stack, where the user-space plane sends all copies (no copy lost, none duplicated)
 *   -> per copy: rewrite addresses/ports/MACs with incremental checksums, bpf_clone_redirect
 *   -> consume the original (TC_ACT_SHOT, counted as forwarded).
 * "To the stack" is TC_ACT_OK: the user-space data plane's sockets are the slow path. */

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "common.h"
#include "maps.h"
#include "parse.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

static __always_inline __u32 log2_u64(__u64 v)
{
	__u32 r = 0;
	if (v >> 32) { v >>= 32; r += 32; }
	if (v >> 16) { v >>= 16; r += 16; }
	if (v >> 8) { v >>= 8; r += 8; }
	if (v >> 4) { v >>= 4; r += 4; }
	if (v >> 2) { v >>= 2; r += 2; }
	if (v >> 1) { r += 1; }
	return r;
}

/* Bucket of a latency in ns: exact below 16, then 8 linear sub-buckets per power of two.
 * src/maps.rs (latency_bucket_bounds) inverts this. */
static __always_inline __u32 latency_bucket(__u64 ns)
{
	if (ns < LAT_EXACT)
		return ns;
	__u32 e = log2_u64(ns);
	if (e >= LAT_MAX_EXP)
		return LAT_BUCKETS - 1;
	return LAT_EXACT + (e - 4) * LAT_SUB + ((ns >> (e - 3)) & (LAT_SUB - 1));
}

static __always_inline void record_copy_latency(__u64 ns)
{
	__u32 zero = 0;
	struct mp_latency_hist *h = bpf_map_lookup_elem(&copy_latency, &zero);
	if (!h)
		return;
	__u32 b = latency_bucket(ns);
	asm volatile("" : "+r"(b)); /* keep the bound check below visible to the verifier */
	if (b >= LAT_BUCKETS)
		b = LAT_BUCKETS - 1;
	h->buckets[b] += 1;
	h->sum += ns;
	h->count += 1;
	if (ns == 0)
		ns = 1; /* min 0 means "none yet" */
	if (h->min == 0 || ns < h->min)
		h->min = ns;
	if (ns > h->max)
		h->max = ns;
}

/* State shared with the bpf_loop callbacks (lives on the program's stack). */
struct mp_fanout {
	struct __sk_buff *skb;
	__u64 t0;
	__u32 stream_id;
	__u32 copies_base;
	__u32 ifindex;
	__u32 ip_len;
	__u32 l3_off;
	__u32 l4_off;
	__u32 payload_len;
	__u32 family;
	__u32 count;  /* copies in the fan-out */
	__u32 fail;   /* CNT_PASS_* of the first copy that cannot be sent, 0 if none */
	__u32 sent;
	__u32 errors;
	/* Header fields as currently written in the packet: each copy is rewritten from the
	 * previous one, checksums adjusted by the difference. */
	__u8 cur_addrs[32]; /* saddr then daddr; IPv4 uses the first 8 bytes */
	__be16 cur_ports[2];
};

static __always_inline struct mp_copy_rewrite *copy_of(struct mp_fanout *f, __u32 i)
{
	__u32 idx = f->copies_base + i;
	struct mp_copy_rewrite *c = bpf_map_lookup_elem(&copies, &idx);
	if (!c || c->stream_id != f->stream_id)
		return NULL;
	return c;
}

/* Pass 1: resolve every copy's next hop before sending anything. */
static long resolve_next_hop(__u32 i, void *ctx)
{
	struct mp_fanout *f = ctx;
	struct mp_copy_rewrite *c = copy_of(f, i);
	if (!c) {
		f->fail = CNT_PASS_STALE_COPY;
		return 1;
	}
	struct bpf_fib_lookup fib = {};
	fib.l4_protocol = IPPROTO_UDP_NR;
	fib.sport = c->from_port;
	fib.dport = c->to_port;
	fib.tot_len = f->ip_len;
	fib.ifindex = f->ifindex;
	if (f->family == MP_FAMILY_V4) {
		fib.family = AF_INET;
		__builtin_memcpy(&fib.ipv4_src, c->from_addr, 4);
		__builtin_memcpy(&fib.ipv4_dst, c->to_addr, 4);
	} else {
		fib.family = AF_INET6;
		__builtin_memcpy(fib.ipv6_src, c->from_addr, 16);
		__builtin_memcpy(fib.ipv6_dst, c->to_addr, 16);
	}
	long rc = bpf_fib_lookup(f->skb, &fib, sizeof(fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS) {
		f->fail = rc == BPF_FIB_LKUP_RET_NO_NEIGH ? CNT_PASS_NO_NEIGH : CNT_PASS_FIB_FAIL;
		return 1;
	}
	__u32 k = i;
	struct mp_nexthop *nh = bpf_map_lookup_elem(&nexthops, &k);
	if (!nh) {
		f->fail = CNT_PASS_ERROR;
		return 1;
	}
	nh->ifindex = fib.ifindex;
	__builtin_memcpy(nh->smac, fib.smac, ETH_ALEN);
	__builtin_memcpy(nh->dmac, fib.dmac, ETH_ALEN);
	return 0;
}

static __always_inline int rewrite_addresses(struct mp_fanout *f, const struct mp_copy_rewrite *c)
{
	struct __sk_buff *skb = f->skb;
	if (f->family == MP_FAMILY_V4) {
		__u8 new[8];
		__builtin_memcpy(new, c->from_addr, 4);
		__builtin_memcpy(new + 4, c->to_addr, 4);
		__s64 diff = bpf_csum_diff((__be32 *)f->cur_addrs, 8, (__be32 *)new, 8, 0);
		if (bpf_skb_store_bytes(skb, f->l3_off + 12, new, 8, 0) ||
		    bpf_l3_csum_replace(skb, f->l3_off + 10, 0, diff, 0) ||
		    bpf_l4_csum_replace(skb, f->l4_off + 6, 0, diff, BPF_F_PSEUDO_HDR | BPF_F_MARK_MANGLED_0))
			return -1;
		__builtin_memcpy(f->cur_addrs, new, 8);
	} else {
		/* from_addr and to_addr are contiguous in the copy: the new saddr|daddr as is. */
		__s64 diff = bpf_csum_diff((__be32 *)f->cur_addrs, 32, (__be32 *)c->from_addr, 32, 0);
		if (bpf_skb_store_bytes(skb, f->l3_off + 8, c->from_addr, 32, 0) ||
		    bpf_l4_csum_replace(skb, f->l4_off + 6, 0, diff, BPF_F_PSEUDO_HDR))
			return -1;
		__builtin_memcpy(f->cur_addrs, c->from_addr, 32);
	}
	/* from_port and to_port are contiguous too: the new sport|dport. */
	__s64 pdiff = bpf_csum_diff((__be32 *)f->cur_ports, 4, (__be32 *)&c->from_port, 4, 0);
	__u64 mangled0 = f->family == MP_FAMILY_V4 ? BPF_F_MARK_MANGLED_0 : 0;
	if (bpf_skb_store_bytes(skb, f->l4_off, &c->from_port, 4, 0) ||
	    bpf_l4_csum_replace(skb, f->l4_off + 6, 0, pdiff, mangled0))
		return -1;
	__builtin_memcpy(f->cur_ports, &c->from_port, 4);
	return 0;
}

/* Pass 2: one copy per call. */
static long send_copy(__u32 i, void *ctx)
{
	struct mp_fanout *f = ctx;
	struct mp_copy_rewrite *c = copy_of(f, i);
	__u32 k = i;
	struct mp_nexthop *nh = bpf_map_lookup_elem(&nexthops, &k);
	if (!c || !nh) {
		f->errors++;
		return 0;
	}
	__u8 macs[12];
	__builtin_memcpy(macs, nh->dmac, ETH_ALEN);
	__builtin_memcpy(macs + 6, nh->smac, ETH_ALEN);
	if (rewrite_addresses(f, c) || bpf_skb_store_bytes(f->skb, 0, macs, 12, 0)) {
		/* The headers may be half rewritten: every later copy would carry wrong
		 * checksums. Stop and count the rest as errors. */
		f->errors += f->count - i;
		return 1;
	}
	if (bpf_clone_redirect(f->skb, nh->ifindex, 0)) {
		f->errors++;
		return 0;
	}
	f->sent++;
	record_copy_latency(bpf_ktime_get_ns() - f->t0);
	return 0;
}

/* No memcmp in BPF: compare 16-byte addresses word by word. */
static __always_inline int same_addr(const __u8 *a, const __u8 *b)
{
	__u32 x[4], y[4];
	__builtin_memcpy(x, a, 16);
	__builtin_memcpy(y, b, 16);
	return x[0] == y[0] && x[1] == y[1] && x[2] == y[2] && x[3] == y[3];
}

static __always_inline int pass_slow(struct mp_stream_counters *sc, __u32 why)
{
	count(why, 1);
	if (sc)
		sc->pass_slow += 1;
	return TC_ACT_OK;
}

static __always_inline int drop(struct mp_stream_counters *sc, __u32 why, __u32 payload_len)
{
	count(CNT_RX_PACKETS, 1);
	count(CNT_RX_BYTES, payload_len);
	count(why, 1);
	if (sc) {
		sc->rx_packets += 1;
		sc->rx_bytes += payload_len;
		if (why == CNT_DROP_STRANGER)
			sc->drop_stranger += 1;
		else if (why == CNT_DROP_MALFORMED)
			sc->drop_malformed += 1;
	}
	return TC_ACT_SHOT;
}

SEC("tc")
int sfu_ingress(struct __sk_buff *skb)
{
	__u64 t0 = bpf_ktime_get_ns();
	struct mp_pkt p = {};
	int rc = parse_udp(skb, &p);
	if (rc != PARSE_OK) {
		count(rc, 1);
		return TC_ACT_OK;
	}

	struct mp_ingress_key key = {};
	__builtin_memcpy(key.addr, p.daddr, 16);
	key.port = p.dport;
	key.family = p.family;
	struct mp_stream_value *found = bpf_map_lookup_elem(&streams, &key);
	if (!found) {
		count(CNT_PASS_NOT_OURS, 1);
		return TC_ACT_OK;
	}
	struct mp_stream_value wildcard = *found;
	int has_any = wildcard.flags & STREAM_F_PRESENT;
	int narrowed = wildcard.flags & STREAM_F_NARROWED;
	struct mp_stream_counters *any_sc = has_any ? stream_counters_of(&wildcard) : NULL;

	struct mp_payload_head head = {};
	if (load_head(skb, &p, &head))
		return pass_slow(any_sc, CNT_PASS_ERROR);
	enum media_kind kind = demux(&p, &head);
	if (kind == MK_STUN)
		return pass_slow(any_sc, CNT_PASS_STUN);

	__u32 ssrc = 0;
	int wants_rtp = narrowed || (has_any && (wildcard.flags & STREAM_F_RTP));
	if (wants_rtp) {
		int bad = kind == MK_RTP ? rtp_ssrc(skb, &p, &head, &ssrc)
			: kind == MK_RTCP ? rtcp_ssrc(skb, &p, &ssrc) : -1;
		if (bad)
			return drop(any_sc, CNT_DROP_MALFORMED, p.payload_len);
	}

	struct mp_stream_value entry;
	int have_entry = 0;
	if (wants_rtp && narrowed) {
		key.has_ssrc = 1;
		key.ssrc = ssrc;
		struct mp_stream_value *s = bpf_map_lookup_elem(&streams, &key);
		if (s) {
			entry = *s;
			have_entry = 1;
		}
	}
	if (!have_entry) {
		if (!has_any)
			return drop(NULL, CNT_DROP_NO_STREAM, p.payload_len);
		entry = wildcard;
	}
	struct mp_stream_counters *sc = stream_counters_of(&entry);

	if (entry.flags & STREAM_F_LATCH)
		return pass_slow(sc, CNT_PASS_UNLATCHED);
	if (!same_addr(entry.src_addr, p.saddr) || entry.src_port != p.sport)
		return drop(sc, CNT_DROP_STRANGER, p.payload_len);
	if ((entry.flags & STREAM_F_SLOW) || entry.copies_count > MAX_FANOUT)
		return pass_slow(sc, CNT_PASS_SLOW_STREAM);

	struct mp_fanout f = {
		.skb = skb,
		.t0 = t0,
		.stream_id = entry.id,
		.copies_base = entry.copies_base,
		.count = entry.copies_count,
		.ifindex = skb->ifindex,
		.ip_len = p.ip_len,
		.l3_off = p.l3_off,
		.l4_off = p.l4_off,
		.payload_len = p.payload_len,
		.family = p.family,
	};
	__builtin_memcpy(f.cur_addrs, p.saddr, 16);
	if (p.family == MP_FAMILY_V4)
		__builtin_memcpy(f.cur_addrs + 4, p.daddr, 4);
	else
		__builtin_memcpy(f.cur_addrs + 16, p.daddr, 16);
	f.cur_ports[0] = p.sport;
	f.cur_ports[1] = p.dport;

	if (entry.copies_count > 0) {
		bpf_loop(entry.copies_count, resolve_next_hop, &f, 0);
		if (f.fail)
			return pass_slow(sc, f.fail);
		/* Copies leave untagged: the egress device (possibly a VLAN device) tags them. */
		if (p.vlan_in_data || skb->vlan_present) {
			if (bpf_skb_vlan_pop(skb))
				return pass_slow(sc, CNT_PASS_ERROR);
			if (p.vlan_in_data) {
				f.l3_off -= 4;
				f.l4_off -= 4;
			}
		}
		bpf_loop(entry.copies_count, send_copy, &f, 0);
	}

	count(CNT_RX_PACKETS, 1);
	count(CNT_RX_BYTES, p.payload_len);
	count(CNT_FORWARDED, 1);
	count(CNT_TX_COPIES, f.sent);
	count(CNT_TX_BYTES, (__u64)f.sent * p.payload_len);
	count(CNT_TX_ERRORS, f.errors);
	if (sc) {
		sc->rx_packets += 1;
		sc->rx_bytes += p.payload_len;
		sc->tx_copies += f.sent;
		sc->tx_bytes += (__u64)f.sent * p.payload_len;
		sc->tx_errors += f.errors;
	}
	return TC_ACT_SHOT;
}
