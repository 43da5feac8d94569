// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* mediaplane TC ingress fast path: SFU fan-out and SIP relay forwarding.
 *
 * Per packet, in the order of ForwardingTable::classify():
 *   parse (cannot judge -> stack) -> stream on (dst ip, dst port)? (no -> stack, not ours)
 *   -> STUN (-> stack) -> an ICE + DTLS-SRTP address (STREAM_F_ADDRESS_UP: -> stack) -> RTCP from a consumer's own address (STREAM_F_FEEDBACK): valid -> stack,
 *      where the slow path routes the feedback to the publishers; broken -> drop malformed
 *   -> RTP/RTCP validity if the stream(s) need RTP (bad -> drop malformed)
 *   -> SSRC-narrowed entry, else the wildcard entry (none -> drop no_stream; RTCP to a consumer's
 *      address: drop stranger, it is not the consumer's)
 *   -> source: the stream's source, or any if it takes any -> on; a learning relay leg's other
 *      sources -> stack (relayed and reported there); otherwise -> drop stranger
 *   -> per-source limit (if any), on every packet not dropped above (STUN and learnt sources
 *      included, before they go up): over it -> drop source_limited
 *   -> rate limit (if any): over it -> drop rate_limited
 *   -> resolve every copy's next hop (bpf_fib_lookup); any failure -> the whole packet to the
 *      stack, where the user-space plane sends all copies (no copy lost, none duplicated)
 *      (a per-copy-slot cache skips the lookup while nothing changed, see mp_nh_cache)
 *   -> pop a VLAN tag, trim bytes after the IP packet (Ethernet padding/trailer)
 *   -> per copy: rewrite addresses/ports/MACs with incremental checksums (direct packet access,
 *      plain arithmetic; the checksum helpers under CHECKSUM_COMPLETE), bpf_clone_redirect
 *   -> an RTP packet updates its stream's reception quality (reception.h)
 *   -> the last copy is the original itself: bpf_redirect (TC_ACT_REDIRECT); no copies at all:
 *      consume it (TC_ACT_SHOT). Both count as forwarded.
 * "To the stack" is TC_ACT_OK: the user-space data plane's sockets are the slow path. */

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_core_read.h>

#include "common.h"
#include "maps.h"
#include "parse.h"
#include "checksum.h"
#include "rpf.h"
#include "order.h"
#include "header.h"
#include "reception.h"
#include "layer_rewrite.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";

extern void *bpf_cast_to_kern_ctx(void *obj) __ksym;

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

/* A global function: the verifier checks it once, on its own, instead of once per path of its
 * callers (its log2 branches would multiply theirs). */
__noinline int record_copy_latency(__u64 ns)
{
	__u32 zero = 0;
	struct mp_latency_hist *h = bpf_map_lookup_elem(&copy_latency, &zero);
	if (!h)
		return 0;
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
	return 0;
}

/* State shared with the bpf_loop callbacks: per CPU (fanout_scratch), off the stack, which the
 * call chain main -> copy callback -> layer_decide/layer_write would otherwise overrun (512
 * bytes). One run uses it from the fan-out's start to its end; no other run of this program on
 * this CPU comes in between (copies leave through queues; TC ingress runs in softirq, which does
 * not nest). */
struct mp_fanout {
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
	__u32 gen;    /* next-hop generation (nh_gen) read at entry */
	__u32 direct; /* rewrite with direct packet access (headers linear, not CHECKSUM_COMPLETE) */
	__u32 partial;/* skb->ip_summed == CHECKSUM_PARTIAL: the UDP checksum field holds the
		       * pseudo-header sum only */
	__u32 last_ifindex; /* != 0: the last copy is the original, to bpf_redirect there */
	/* Header fields as currently written in the packet: each copy is rewritten from the
	 * previous one, checksums adjusted by the difference. */
	__u8 cur_addrs[32]; /* saddr then daddr; IPv4 uses the first 8 bytes */
	__be16 cur_ports[2];
	/* A simulcast layer (else MP_LAYER_NONE): each copy is decided and renumbered for its
	 * consumer. */
	__u32 layer;
	/* The packet is RTP of an RTP stream (rx_is_rtp): each copy sent is accounted to its
	 * consumer as forwarded, with these header fields (a layer copy: with its rewritten ones). */
	__u32 rtp;
	__u32 rtp_head0;
	__u32 clock_rate;
	__u64 rtp_ts_ssrc;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_fanout);
} fanout_scratch SEC(".maps");

/* What the bpf_loop callbacks get (a callback's context must be on the stack): the packet, the
 * fan-out state and, with a layer, its edit. */
struct mp_fanout_ctx {
	struct __sk_buff *skb;
	struct mp_fanout *f;
	struct mp_layer_scratch *ls;
};

static __always_inline struct mp_copy_rewrite *copy_of(struct mp_fanout *f, __u32 i)
{
	__u32 idx = f->copies_base + i;
	struct mp_copy_rewrite *c = bpf_map_lookup_elem(&copies, &idx);
	if (!c || c->stream_id != f->stream_id)
		return NULL;
	return c;
}

static __always_inline struct mp_nh_cache *nh_entry(struct mp_fanout *f, __u32 i)
{
	__u32 k = (f->copies_base + i) & (NH_CACHE_SIZE - 1);
	return bpf_map_lookup_elem(&nh_cache, &k);
}

/* The entry was resolved for this very copy (addresses and ports), in this generation. */
static __always_inline int nh_matches(const struct mp_nh_cache *e, const struct mp_copy_rewrite *c, __u32 gen)
{
	const __u32 *k = (const __u32 *)c;
	return e->gen == gen && e->key[0] == k[0] && e->key[1] == k[1] && e->key[2] == k[2] && e->key[3] == k[3] &&
	       e->key[4] == k[4] && e->key[5] == k[5] && e->key[6] == k[6] && e->key[7] == k[7] && e->key[8] == k[8];
}

/* bpf_fib_lookup for one copy; on success the cache entry is rewritten whole. Returns 0 or the
 * CNT_PASS_* reason. */
static __noinline int resolve(struct __sk_buff *skb, struct mp_fanout *f, const struct mp_copy_rewrite *c, struct mp_nh_cache *e)
{
	__u32 zero = 0;
	struct bpf_fib_lookup *fib = bpf_map_lookup_elem(&fib_scratch, &zero);
	if (!fib)
		return CNT_PASS_ERROR;
	__builtin_memset(fib, 0, sizeof(*fib));
	fib->l4_protocol = IPPROTO_UDP_NR;
	fib->sport = c->from_port;
	fib->dport = c->to_port;
	fib->tot_len = f->ip_len;
	fib->ifindex = f->ifindex;
	if (f->family == MP_FAMILY_V4) {
		fib->family = AF_INET;
		__builtin_memcpy(&fib->ipv4_src, c->from_addr, 4);
		__builtin_memcpy(&fib->ipv4_dst, c->to_addr, 4);
	} else {
		fib->family = AF_INET6;
		__builtin_memcpy(fib->ipv6_src, c->from_addr, 16);
		__builtin_memcpy(fib->ipv6_dst, c->to_addr, 16);
	}
	long rc = bpf_fib_lookup(skb, fib, sizeof(*fib), 0);
	if (rc != BPF_FIB_LKUP_RET_SUCCESS)
		return rc == BPF_FIB_LKUP_RET_NO_NEIGH ? CNT_PASS_NO_NEIGH : CNT_PASS_FIB_FAIL;
	__builtin_memcpy(e->key, c, sizeof(e->key));
	e->in_ifindex = f->ifindex;
	e->out_ifindex = fib->ifindex;
	e->gen = f->gen;
	e->max_len = f->ip_len;
	__builtin_memcpy(e->dmac, fib->dmac, ETH_ALEN);
	__builtin_memcpy(e->smac, fib->smac, ETH_ALEN);
	e->expires_ns = f->t0 + NH_CACHE_TTL_NS;
	return 0;
}

/* Next hop of copy i: the cached one when it is still good, else a fresh lookup. */
static __always_inline int next_hop(struct __sk_buff *skb, struct mp_fanout *f, const struct mp_copy_rewrite *c, struct mp_nh_cache *e)
{
	if (nh_matches(e, c, f->gen) && e->in_ifindex == f->ifindex && f->ip_len <= e->max_len && f->t0 < e->expires_ns)
		return 0;
	return resolve(skb, f, c, e);
}

/* Pass 1: resolve every copy's next hop before sending anything. */
static long resolve_next_hop(__u32 i, void *ctx)
{
	struct mp_fanout_ctx *x = ctx;
	struct mp_fanout *f = x->f;
	struct mp_copy_rewrite *c = copy_of(f, i);
	if (!c) {
		f->fail = CNT_PASS_STALE_COPY;
		return 1;
	}
	struct mp_nh_cache *e = nh_entry(f, i);
	if (!e) {
		f->fail = CNT_PASS_ERROR;
		return 1;
	}
	int rc = next_hop(x->skb, f, c, e);
	if (rc) {
		f->fail = rc;
		return 1;
	}
	return 0;
}

/* The UDP checksum after addresses changed by `da` and ports by `dp`. IPv4 zero means "none"
 * and stays; a computed zero is sent as 0xffff (RFC 768, RFC 8200). Under CHECKSUM_PARTIAL the
 * field holds the (uncomplemented) pseudo-header sum: only the addresses enter it. */
static __always_inline __u16 udp_csum_update(__u16 check, __u64 da, __u64 dp, int partial, int v4)
{
	if (v4 && check == 0)
		return 0;
	__u16 r = partial ? csum_fold64((__u64)check + da) : csum_replace(check, da + dp);
	return r ? r : 0xffff;
}

/* Rewrite MACs, addresses, ports and checksums with direct packet access: no helper calls.
 * After VLAN pop the IP header is at 14. Returns -1 if the headers are not in the linear part. */
static __always_inline int rewrite_direct(struct __sk_buff *skb, struct mp_fanout *f, const struct mp_copy_rewrite *c,
					  const struct mp_nh_cache *e)
{
	void *data = (void *)(long)skb->data;
	void *end = (void *)(long)skb->data_end;
	__u32 np[1];
	__builtin_memcpy(np, &c->from_port, 4);
	__u64 dp = csum_delta((const __u32 *)f->cur_ports, np, 1);
	if (f->family == MP_FAMILY_V4) {
		if (data + ETH_HLEN + 20 + 8 > end)
			return -1;
		__u8 *eth = data;
		__u8 *ip = data + ETH_HLEN;
		__u8 *udp = data + ETH_HLEN + 20;
		__u32 na[2];
		__builtin_memcpy(na, c->from_addr, 4);
		__builtin_memcpy(na + 1, c->to_addr, 4);
		__u64 da = csum_delta((const __u32 *)f->cur_addrs, na, 2);
		__builtin_memcpy(eth, e->dmac, ETH_ALEN);
		__builtin_memcpy(eth + 6, e->smac, ETH_ALEN);
		__u16 *ipcheck = (__u16 *)(ip + 10);
		*ipcheck = csum_replace(*ipcheck, da);
		__builtin_memcpy(ip + 12, na, 8);
		__u16 *ucheck = (__u16 *)(udp + 6);
		*ucheck = udp_csum_update(*ucheck, da, dp, f->partial, 1);
		__builtin_memcpy(udp, np, 4);
		__builtin_memcpy(f->cur_addrs, na, 8);
	} else {
		if (data + ETH_HLEN + 40 + 8 > end)
			return -1;
		__u8 *eth = data;
		__u8 *ip = data + ETH_HLEN;
		__u8 *udp = data + ETH_HLEN + 40;
		__u32 na[8];
		__builtin_memcpy(na, c->from_addr, 32); /* from_addr and to_addr are contiguous */
		__u64 da = csum_delta((const __u32 *)f->cur_addrs, na, 8);
		__builtin_memcpy(eth, e->dmac, ETH_ALEN);
		__builtin_memcpy(eth + 6, e->smac, ETH_ALEN);
		__builtin_memcpy(ip + 8, na, 32);
		__u16 *ucheck = (__u16 *)(udp + 6);
		*ucheck = udp_csum_update(*ucheck, da, dp, f->partial, 0);
		__builtin_memcpy(udp, np, 4);
		__builtin_memcpy(f->cur_addrs, na, 32);
	}
	__builtin_memcpy(f->cur_ports, np, 4);
	return 0;
}

/* The same with the checksum helpers, which also keep skb->csum right under
 * CHECKSUM_COMPLETE (and work on non-linear headers). */
static __always_inline int rewrite_helpers(struct __sk_buff *skb, struct mp_fanout *f, const struct mp_copy_rewrite *c,
					   const struct mp_nh_cache *e)
{
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
	__u8 macs[12];
	__builtin_memcpy(macs, e->dmac, ETH_ALEN);
	__builtin_memcpy(macs + 6, e->smac, ETH_ALEN);
	return bpf_skb_store_bytes(skb, 0, macs, 12, 0) ? -1 : 0;
}

/* A copy for c's consumer was sent (or failed): its per-consumer counters, where it has them. */
static __always_inline void count_consumer(const struct mp_copy_rewrite *c, __u32 bytes, int sent)
{
	__u32 consumer = c->consumer;
	if (!consumer)
		return;
	struct mp_consumer_counters *cc = bpf_map_lookup_elem(&consumer_stats, &consumer);
	if (!cc)
		return;
	if (sent) {
		cc->tx_copies += 1;
		cc->tx_bytes += bytes;
	} else {
		cc->tx_errors += 1;
	}
}

/* A copy for c's consumer was sent: its RTP as forwarded (reception.h forwarded_account). */
static __always_inline void account_forwarded(const struct mp_copy_rewrite *c, const struct mp_fanout *f,
					      const struct mp_layer_scratch *ls)
{
	if (!c->consumer || !f->rtp)
		return;
	if (ls)
		forwarded_account(c->consumer, (f->rtp_head0 & 0xffff0000) | ls->lo.seq, (__u64)ls->lo.ts << 32 | ls->lo.ssrc,
				  f->clock_rate, f->t0);
	else
		forwarded_account(c->consumer, f->rtp_head0, f->rtp_ts_ssrc, f->clock_rate, f->t0);
}

/* Pass 2: one copy per call. */
static __always_inline long send_copy(__u32 i, struct mp_fanout_ctx *x, int direct)
{
	struct mp_fanout *f = x->f;
	struct __sk_buff *skb = x->skb;
	struct mp_copy_rewrite *c = copy_of(f, i);
	struct mp_nh_cache *e = nh_entry(f, i);
	if (!c || !e) {
		f->errors++;
		return 0;
	}
	struct mp_layer_scratch *ls = x->ls;
	if (ls && layer_decide(c->consumer, f->layer, &ls->le.in, f->t0, &ls->lo) != MP_LAYER_FORWARD)
		return 0; /* not for this consumer (another layer, a duplicate...) */
	/* Pass 1 left this copy's entry good; re-check it anyway (a nested run on this CPU could
	 * have reused it) and resolve again on any doubt. */
	if (next_hop(skb, f, c, e)) {
		f->errors++;
		count_consumer(c, 0, 0);
		return 0;
	}
	if ((direct ? rewrite_direct(skb, f, c, e) : rewrite_helpers(skb, f, c, e)) ||
	    (ls && layer_write(skb, f->l4_off + 8, f->family, &ls->le, &ls->lo))) {
		/* The headers may be half rewritten: every later copy would carry wrong
		 * checksums. Stop and count the rest as errors. */
		f->errors += f->count - i;
		count_consumer(c, 0, 0);
		return 1;
	}
	if (i + 1 == f->count) {
		/* The last copy needs no clone: the program redirects the original itself. */
		f->last_ifindex = e->out_ifindex;
		f->sent++;
		count_consumer(c, f->payload_len, 1);
		account_forwarded(c, f, ls);
		return 0;
	}
	if (bpf_clone_redirect(skb, e->out_ifindex, 0)) {
		f->errors++;
		count_consumer(c, 0, 0);
		return 0;
	}
	f->sent++;
	count_consumer(c, f->payload_len, 1);
	record_copy_latency(bpf_ktime_get_ns() - f->t0);
	account_forwarded(c, f, ls);
	return 0;
}

static long send_copy_direct(__u32 i, void *ctx)
{
	return send_copy(i, ctx, 1);
}

static long send_copy_helpers(__u32 i, void *ctx)
{
	return send_copy(i, ctx, 0);
}

/* The first n bytes are in the linear part (direct packet access reaches them). The loads are
 * spelled out: the verifier wants each context field read at its own constant offset, and clang
 * would otherwise share one computed address between them. */
static __always_inline int linear_upto(struct __sk_buff *skb, __u32 n)
{
	long data, end;
	asm volatile("%0 = *(u32 *)(%1 + %2)" : "=r"(data) : "r"(skb), "i"(__builtin_offsetof(struct __sk_buff, data)));
	asm volatile("%0 = *(u32 *)(%1 + %2)" : "=r"(end) : "r"(skb), "i"(__builtin_offsetof(struct __sk_buff, data_end)));
	return data + n <= end;
}

/* RateParams::admit (mediaplane_core::ratelimit), under the stream's lock. Global: verified
 * once on its own (see record_copy_latency). */
__noinline int rate_admit(__u32 slot, __u64 now, __u64 bytes)
{
	struct mp_rate *r = bpf_map_lookup_elem(&stream_rate, &slot);
	if (!r)
		return 1;
	int ok = 0;
	bpf_spin_lock(&r->lock);
	__u64 tp = r->tat_packets > now ? r->tat_packets : now;
	__u64 tb = r->tat_bytes > now ? r->tat_bytes : now;
	if ((r->interval_ns == 0 || tp - now <= r->tau_ns) && (r->byte_cost_q16 == 0 || tb - now <= r->tau_ns)) {
		r->tat_packets = tp + r->interval_ns;
		r->tat_bytes = tb + ((bytes * r->byte_cost_q16) >> 16);
		ok = 1;
	}
	bpf_spin_unlock(&r->lock);
	return ok;
}

/* One GCRA bucket advanced by compare-and-swap: charged (1) or over its tolerance (0). A few
 * lost races in a row mean a flood on this very source: refuse rather than spin. */
static __always_inline int gcra_cas(__u64 *tat, __u64 now, __u64 cost, __u64 tau)
{
#pragma unroll
	for (int i = 0; i < 3; i++) {
		__u64 old = *(volatile __u64 *)tat;
		__u64 t = old > now ? old : now;
		if (t - now > tau)
			return 0;
		if (__sync_val_compare_and_swap(tat, old, t + cost) == old)
			return 1;
	}
	return 0;
}

/* The per-source limit (RateParams::admit on the source's bucket). Off, or no bucket to be had:
 * admit. Global: verified once on its own. */
__noinline int source_admit_key(const struct mp_source_key *k, __u64 now, __u64 bytes)
{
	__u32 zero = 0;
	const struct mp_source_limit *l = bpf_map_lookup_elem(&source_limit, &zero);
	if (!k || !l || (l->interval_ns == 0 && l->byte_cost_q16 == 0))
		return 1;
	struct mp_source_state *st = bpf_map_lookup_elem(&source_rate, k);
	if (!st) {
		struct mp_source_state fresh = {};
		bpf_map_update_elem(&source_rate, k, &fresh, BPF_NOEXIST);
		st = bpf_map_lookup_elem(&source_rate, k);
		if (!st)
			return 1;
	}
	/* Both limits must hold: check the byte bucket before charging the packet bucket. */
	if (l->byte_cost_q16) {
		__u64 tb = *(volatile __u64 *)&st->tat_bytes;
		if ((tb > now ? tb : now) - now > l->tau_ns)
			return 0;
	}
	if (l->interval_ns && !gcra_cas(&st->tat_packets, now, l->interval_ns, l->tau_ns))
		return 0;
	if (l->byte_cost_q16 && !gcra_cas(&st->tat_bytes, now, (bytes * l->byte_cost_q16) >> 16, l->tau_ns))
		return 0;
	return 1;
}

static __always_inline int source_admit(const __u8 *saddr, __u32 family, __u64 now, __u64 bytes)
{
	struct mp_source_key k = {};
	__builtin_memcpy(k.addr, saddr, 16);
	k.family = family;
	return source_admit_key(&k, now, bytes);
}

static __always_inline int pass_slow(struct mp_stream_counters *sc, __u32 why)
{
	count(why, 1);
	if (sc)
		sc->pass_slow += 1;
	return TC_ACT_OK;
}

/* To the slow path, in stream order (see order.h) when the configuration asks for it. */
static __always_inline int pass_in_order(struct __sk_buff *skb, struct mp_stream_counters *sc, struct mp_stream_path *sp,
					 __u32 slot, __u32 cflags, __u64 now, __u32 why)
{
	if (cflags & MP_CFG_HOLD_ORDER)
		order_mark(skb, sp, slot, now);
	return pass_slow(sc, why);
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
		else if (why == CNT_DROP_RATE_LIMITED)
			sc->drop_rate_limited += 1;
		else if (why == CNT_DROP_MALFORMED)
			sc->drop_malformed += 1;
		else if (why == CNT_DROP_BAD_CHECKSUM)
			sc->drop_bad_checksum += 1;
		else if (why == CNT_DROP_SPOOFED)
			sc->drop_spoofed += 1;
	}
	return TC_ACT_SHOT;
}

/* The packet comes from the source the stream names. Never from a zero port: a learning stream
 * that follows no source yet has none. */
static __always_inline int from_source(const struct mp_stream_value *e, const struct mp_pkt *p)
{
	return e->src_port && e->src_port == p->sport && same_addr(e->src_addr, p->saddr);
}

/* A fragmented datagram goes up to be reassembled: its first fragment (the one with the UDP
 * header, and the RTP header after it) holds its stream in the slow path like any packet handed
 * up (order.h), and its mark carries over to the reassembled datagram, which the slow path
 * acknowledges. A learning stream is held only for the source it follows (the kernel forwards
 * nothing else of it). */
static __noinline void hold_first_fragment(struct __sk_buff *skb, const struct mp_pkt *p, __u64 now)
{
	const struct mp_fast_config *cfg = fast_config_get();
	if (!cfg || !(cfg->flags & MP_CFG_HOLD_ORDER))
		return;
	struct mp_ingress_key key = {};
	__builtin_memcpy(key.addr, p->daddr, 16);
	key.port = p->dport;
	key.family = p->family;
	struct mp_stream_value *e = bpf_map_lookup_elem(&streams, &key);
	if (!e)
		return;
	if (e->flags & STREAM_F_NARROWED) {
		/* The SSRC of the RTP header after the UDP header (a fragmented datagram is media, not
		 * RTCP). */
		__u8 rtp[12];
		if (bpf_skb_load_bytes(skb, p->l4_off + 8, rtp, 12) || rtp[0] >> 6 != 2)
			return;
		key.has_ssrc = 1;
		key.ssrc = rd32(rtp + 8);
		struct mp_stream_value *n = bpf_map_lookup_elem(&streams, &key);
		if (n)
			e = n;
	}
	if (!(e->flags & STREAM_F_PRESENT))
		return;
	if (!(e->flags & STREAM_F_ANY_SOURCE) && !from_source(e, p))
		return;
	order_mark(skb, stream_path_of(e), e->stats_slot, now);
}

SEC("tc")
int sfu_ingress(struct __sk_buff *skb)
{
	__u64 t0 = bpf_ktime_get_ns();
	struct mp_pkt p = {};
	int rc = parse_udp(skb, &p);
	if (rc != PARSE_OK) {
		if (p.first_fragment)
			hold_first_fragment(skb, &p, t0);
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
	/* Map values stay valid (RCU) for the whole run: no copies needed. */
	const struct mp_stream_value *wildcard = found;
	int has_any = wildcard->flags & STREAM_F_PRESENT;
	int narrowed = wildcard->flags & STREAM_F_NARROWED;
	struct mp_stream_counters *any_sc = has_any ? stream_counters_of(wildcard) : NULL;

	struct mp_payload_head head = {};
	if (load_head(skb, &p, &head))
		return pass_slow(any_sc, CNT_PASS_ERROR);
	enum media_kind kind = demux(&p, &head);
	if (kind == MK_STUN) {
		if (!source_admit(p.saddr, p.family, t0, p.payload_len))
			return drop(NULL, CNT_DROP_SOURCE_LIMITED, p.payload_len);
		return pass_slow(any_sc, CNT_PASS_STUN);
	}
	/* An ICE + DTLS-SRTP address: everything is crypto, for user space. DTLS from anyone (the
	 * handshake checks it against ICE); anything else only from the address ICE nominated (one
	 * source for every stream there): a stranger's is dropped here, whatever it is. */
	if (wildcard->flags & STREAM_F_ADDRESS_UP) {
		int dtls = head.have && head.b[0] >= 20 && head.b[0] <= 63;
		if (!dtls && !from_source(wildcard, &p))
			return drop(any_sc, CNT_DROP_STRANGER, p.payload_len);
		if (!source_admit(p.saddr, p.family, t0, p.payload_len))
			return drop(NULL, CNT_DROP_SOURCE_LIMITED, p.payload_len);
		return pass_slow(any_sc, CNT_PASS_SLOW_STREAM);
	}
	/* A consumer's RTCP: PLI/FIR/NACK for the publishers, coalesced in user space. Checked
	 * before the SSRC lookup: its sender SSRC is the consumer's, not a stream's. */
	if (kind == MK_RTCP && (wildcard->flags & STREAM_F_FEEDBACK) && from_source(wildcard, &p)) {
		__u32 sender;
		if (rtcp_ssrc(skb, &p, &sender))
			return drop(any_sc, CNT_DROP_MALFORMED, p.payload_len);
		if (!source_admit(p.saddr, p.family, t0, p.payload_len))
			return drop(NULL, CNT_DROP_SOURCE_LIMITED, p.payload_len);
		return pass_slow(any_sc, CNT_PASS_FEEDBACK);
	}

	__u32 ssrc = 0;
	int wants_rtp = narrowed || (has_any && (wildcard->flags & STREAM_F_RTP));
	if (wants_rtp) {
		int bad = kind == MK_RTP ? rtp_ssrc(skb, &p, &head, &ssrc)
			: kind == MK_RTCP ? rtcp_ssrc(skb, &p, &ssrc) : -1;
		if (bad)
			return drop(any_sc, CNT_DROP_MALFORMED, p.payload_len);
	}

	const struct mp_stream_value *entry = NULL;
	if (wants_rtp && narrowed) {
		key.has_ssrc = 1;
		key.ssrc = ssrc;
		struct mp_stream_value *s = bpf_map_lookup_elem(&streams, &key);
		if (s) {
			entry = s;
		}
	}
	if (!entry) {
		if (!has_any)
			return drop(NULL, kind == MK_RTCP && (wildcard->flags & STREAM_F_FEEDBACK) ? CNT_DROP_STRANGER : CNT_DROP_NO_STREAM,
				    p.payload_len);
		entry = wildcard;
	}
	struct mp_stream_counters *sc = stream_counters_of(entry);

	/* Not the stream's source: a stranger, unless the stream takes any source, or is learning
	 * its source (then the slow path relays the packet and reports the source). */
	int any_source = entry->flags & STREAM_F_ANY_SOURCE;
	int learn = 0;
	if (!any_source && !from_source(entry, &p)) {
		if (!(entry->flags & STREAM_F_LATCH))
			return drop(sc, CNT_DROP_STRANGER, p.payload_len);
		learn = 1;
	}
	/* What the kernel hands up whole (SRTP, recorded, under call control, too many copies):
	 * the host's own stack checks it on its way to the slow path's socket (UDP checksum,
	 * rp_filter), so the checks below, which stand in for the stack on what the kernel
	 * forwards itself, are not made twice. A learning leg's other sources go the long way. */
	if (!learn && ((entry->flags & STREAM_F_SLOW) || entry->copies_count > MAX_FANOUT)) {
		if (!source_admit(p.saddr, p.family, t0, p.payload_len))
			return drop(NULL, CNT_DROP_SOURCE_LIMITED, p.payload_len);
		return pass_slow(sc, CNT_PASS_SLOW_STREAM);
	}
	/* The reverse-path result is cached per stream for its one source only. */
	int one_source = !any_source && !learn;

	/* Only what the host would accept, from where the source can be. */
	const struct mp_fast_config *cfg = fast_config_get();
	__u32 cflags = cfg ? cfg->flags : 0;
	struct mp_stream_path *sp = stream_path_of(entry);
	struct sk_buff *kskb = bpf_cast_to_kern_ctx(skb);
	__u8 summed = BPF_CORE_READ_BITFIELD(kskb, ip_summed);
	if (cflags & MP_CFG_VERIFY_CSUM) {
		if (p.ip_csum_bad)
			return drop(sc, CNT_DROP_BAD_CHECKSUM, p.payload_len);
		int cv = udp_checksum_verdict(skb, &p, summed);
		if (cv == CSUM_BAD)
			return drop(sc, CNT_DROP_BAD_CHECKSUM, p.payload_len);
		if (cv == CSUM_ERROR)
			return pass_in_order(skb, sc, sp, entry->stats_slot, cflags, t0, CNT_PASS_ERROR);
	}
	__u32 zero = 0;
	__u32 *gen = bpf_map_lookup_elem(&nh_gen, &zero);
	__u32 nhgen = gen ? *gen : 0;
	if (!rpf_ok(skb, &p, cfg, one_source ? sp : NULL, nhgen))
		return drop(sc, CNT_DROP_SPOOFED, p.payload_len);

	if (!source_admit(p.saddr, p.family, t0, p.payload_len))
		return drop(NULL, CNT_DROP_SOURCE_LIMITED, p.payload_len);
	if (learn)
		return pass_in_order(skb, sc, sp, entry->stats_slot, cflags, t0, CNT_PASS_UNLATCHED);
	/* A few packets per second, not held in order: RTP does not wait for them. */
	if ((entry->flags & STREAM_F_RTCP_UP) && kind == MK_RTCP)
		return pass_slow(sc, CNT_PASS_RTCP);
	if ((entry->flags & STREAM_F_PT_UP) && kind == MK_RTP && head.have >= 2) {
		__u8 pt = head.b[1] & 0x7f;
		if (pt == entry->up_pt[0] || pt == entry->up_pt[1])
			return pass_in_order(skb, sc, sp, entry->stats_slot, cflags, t0, CNT_PASS_DTMF);
	}
	if ((entry->flags & STREAM_F_RATE) && !rate_admit(entry->stats_slot, t0, p.payload_len))
		return drop(sc, CNT_DROP_RATE_LIMITED, p.payload_len);
	__u32 slot = entry->stats_slot;
	if ((cflags & MP_CFG_HOLD_ORDER) && sp && order_held(sp, t0))
		return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_IN_ORDER);

	struct mp_fanout *f = bpf_map_lookup_elem(&fanout_scratch, &zero);
	if (!f)
		return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_ERROR);
	__builtin_memset(f, 0, sizeof(*f));
	f->t0 = t0;
	f->stream_id = entry->id;
	f->copies_base = entry->copies_base;
	f->count = entry->copies_count;
	f->ifindex = skb->ifindex;
	f->ip_len = p.ip_len;
	f->l3_off = p.l3_off;
	f->l4_off = p.l4_off;
	f->payload_len = p.payload_len;
	f->family = p.family;
	f->gen = nhgen;
	f->layer = MP_LAYER_NONE;
	__builtin_memcpy(f->cur_addrs, p.saddr, 16);
	if (p.family == MP_FAMILY_V4)
		__builtin_memcpy(f->cur_addrs + 4, p.daddr, 4);
	else
		__builtin_memcpy(f->cur_addrs + 16, p.daddr, 16);
	f->cur_ports[0] = p.sport;
	f->cur_ports[1] = p.dport;
	f->rtp = (cflags & MP_CFG_FORWARDED_QOS) && rx_is_rtp(entry->flags, head.have, rd32(head.b));
	f->rtp_head0 = rd32(head.b);
	f->rtp_ts_ssrc = (__u64)rd32(head.b + 4) << 32 | rd32(head.b + 8);
	f->clock_rate = entry->clock_rate;
	struct mp_fanout_ctx x = { .skb = skb, .f = f };

	if ((entry->flags & STREAM_F_SIMULCAST) && entry->copies_count > 0) {
		/* Its RTCP went up above (STREAM_F_RTCP_UP): what is left is valid RTP. */
		struct mp_layer_scratch *ls = bpf_map_lookup_elem(&layer_scratch, &zero);
		if (!ls || kind != MK_RTP || layer_inspect(skb, p.payload_off, p.payload_len, entry->codec, &ls->le.in) ||
		    layer_cur_init(skb, p.payload_off, &ls->le.in, &ls->le.cur))
			return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_ERROR);
		f->layer = entry->layer;
		x.ls = ls;
	}
	if (entry->copies_count > 0) {
		bpf_loop(entry->copies_count, resolve_next_hop, &x, 0);
		if (f->fail)
			return pass_in_order(skb, sc, sp, slot, cflags, t0, f->fail);
		/* Copies leave untagged: the egress device (possibly a VLAN device) tags them. */
		if (p.vlan_in_data || skb->vlan_present) {
			if (bpf_skb_vlan_pop(skb))
				return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_ERROR);
			if (p.vlan_in_data) {
				f->l3_off -= 4;
				f->l4_off -= 4;
			}
		}
		/* Bytes after the IP packet (Ethernet padding, a trailer) are not part of it: the
		 * stack trims them (ip_rcv) and so does the fast path, or a full-size packet plus
		 * trailer exceeds the egress MTU and its copies are dropped on the way out. */
		__u32 frame_len = f->l3_off + p.ip_len;
		if (skb->len > frame_len && bpf_skb_change_tail(skb, frame_len, 0))
			return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_ERROR);
		if (write_own_header(skb, f->l3_off, p.family, cfg))
			return pass_in_order(skb, sc, sp, slot, cflags, t0, CNT_PASS_ERROR);
		/* Direct packet access needs the headers in the linear part and a checksum state
		 * it can follow: CHECKSUM_COMPLETE (skb->csum) is left to the helpers. */
		__u32 hdr_end = ETH_HLEN + (p.family == MP_FAMILY_V4 ? 20 : 40) + 8;
		if (summed != MP_CHECKSUM_COMPLETE) {
			if (!linear_upto(skb, hdr_end))
				bpf_skb_pull_data(skb, hdr_end);
			f->direct = linear_upto(skb, hdr_end);
			f->partial = summed == MP_CHECKSUM_PARTIAL;
		}
		if (f->direct)
			bpf_loop(entry->copies_count, send_copy_direct, &x, 0);
		else
			bpf_loop(entry->copies_count, send_copy_helpers, &x, 0);
	}

	/* In-path QoS of what the kernel forwarded (the slow path accounts for what it does). */
	reception_account((__u64)slot << 32 | entry->flags, (__u64)head.have << 32 | entry->clock_rate, rd32(head.b),
			  (__u64)rd32(head.b + 4) << 32 | rd32(head.b + 8), t0);

	count(CNT_RX_PACKETS, 1);
	count(CNT_RX_BYTES, p.payload_len);
	count(CNT_FORWARDED, 1);
	count(CNT_TX_COPIES, f->sent);
	count(CNT_TX_BYTES, (__u64)f->sent * p.payload_len);
	count(CNT_TX_ERRORS, f->errors);
	if (sc) {
		sc->rx_packets += 1;
		sc->rx_bytes += p.payload_len;
		sc->tx_copies += f->sent;
		sc->tx_bytes += (__u64)f->sent * p.payload_len;
		sc->tx_errors += f->errors;
		sc->last_rx_ns = t0;
		if (x.ls && x.ls->le.in.keyframe_start)
			sc->keyframes += 1;
	}
	if (f->last_ifindex) {
		record_copy_latency(bpf_ktime_get_ns() - t0);
		return bpf_redirect(f->last_ifindex, 0);
	}
	return TC_ACT_SHOT;
}

/* What user space asks of layer_ctl: the frame it runs on is 14 bytes of no meaning, this, and
 * (MP_LAYER_OP_PACKET) an RTP packet. Rust mirror: src/maps.rs LayerRequestRaw. */
struct mp_layer_request {
	__u32 op;       /* MP_LAYER_OP_* */
	__u32 consumer;
	__u32 arg;      /* OP_PACKET: the packet's layer; OP_TARGET: the target layer (MP_LAYER_NONE)
			 * | the temporal ceiling (MP_TEMPORAL_ALL) << 8 */
	__u32 codec;    /* OP_PACKET: MP_CODEC_* */
	__u64 now_ns;   /* OP_PACKET: when it arrived (bpf_ktime_get_ns's clock) */
};

#define MP_LAYER_OP_PACKET 1
#define MP_LAYER_OP_TARGET 2

/* Never attached: user space runs it with BPF_PROG_TEST_RUN to change a consumer's target and
 * to decide (and rewrite) a packet the slow path forwards, with the kernel's own rules under the
 * state's lock. Returns an mp_layer_verdict; the rewritten packet comes back in data_out. */
SEC("tc")
int layer_ctl(struct __sk_buff *skb)
{
	struct mp_layer_request r;
	__u32 at = ETH_HLEN + sizeof(r);
	if (bpf_skb_load_bytes(skb, ETH_HLEN, &r, sizeof(r)))
		return MP_LAYER_INVALID;
	if (r.op == MP_LAYER_OP_TARGET)
		return layer_set_target(r.consumer, r.arg);
	if (r.op != MP_LAYER_OP_PACKET || skb->len < at)
		return MP_LAYER_INVALID;
	struct mp_layer_edit le;
	struct mp_layer_out lo = {};
	if (layer_inspect(skb, at, skb->len - at, r.codec, &le.in) || layer_cur_init(skb, at, &le.in, &le.cur))
		return MP_LAYER_INVALID;
	int v = layer_decide(r.consumer, r.arg, &le.in, r.now_ns, &lo);
	if (v == MP_LAYER_FORWARD && layer_write(skb, at, 0, &le, &lo))
		return MP_LAYER_INVALID;
	return v;
}
