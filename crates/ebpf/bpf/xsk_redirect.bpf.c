// SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause)
/* mediaplane AF_XDP plane: hands the model's media to user space without the host stack.
 *
 * A UDP datagram to one of the SFU's addresses (`sfu_addrs`, written from the installed table)
 * is redirected to the AF_XDP socket of the queue it arrived on (`xsk_slots` names its XSKMAP
 * slot) when the host stack would certainly deliver it to that address's socket:
 *   - untagged Ethernet, IPv4 without options, or IPv6 whose next header is UDP or a fragment
 *     header carrying UDP; lengths consistent;
 *   - a fragment: the first one (it has the UDP header) is judged as a datagram and, when it is
 *     handed over, its datagram is remembered (`frag_flows`, LRU) so the fragments after it are
 *     too: user space reassembles them. A later fragment arriving before its first passes to the
 *     stack (senders send them in order; such a datagram is then lost on both sides, counted as
 *     user space's reassembly timeouts);
 *   - any size: frames larger than one AF_XDP frame arrive in several (the sockets are bound
 *     with XDP_USE_SG; this program is loaded with frags).
 * Everything else passes (XDP_PASS) to the host stack, which judges it as it judges it for the
 * socket plane and delivers what it accepts to the same plane's socket on that address: what
 * this program does not redirect is not lost, it takes the socket path. What the stack would
 * check of a redirected datagram, user space checks: checksums (XDP cannot sum a payload of any
 * length cheaply) and the source's reverse path (asked of the kernel's input route lookup, which
 * applies rp_filter as the stack does: bpf_fib_lookup answers nothing where forwarding is off,
 * as on most media servers). Counters: enum xsk_counter, `xsk_*` in the plane's stats. */

#include "vmlinux.h"
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_endian.h>

#include "common.h"

char LICENSE[] SEC("license") = "Dual BSD/GPL";


/* An SFU address: (family, port, address); IPv4 in the first four bytes of addr. */
struct mp_xsk_addr {
	__u8 family;
	__u8 pad;
	__be16 port;
	__u8 addr[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, struct mp_xsk_addr);
	__type(value, __u8);
} sfu_addrs SEC(".maps");

/* (ifindex, queue) -> XSKMAP slot. */
struct mp_xsk_queue {
	__u32 ifindex;
	__u32 queue;
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, struct mp_xsk_queue);
	__type(value, __u32);
} xsk_slots SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 1024);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

/* A fragmented datagram: (family, id, source, destination). */
struct mp_frag_key {
	__u8 family;
	__u8 pad[3];
	__u32 id;
	__u8 src[16];
	__u8 dst[16];
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 4096);
	__type(key, struct mp_frag_key);
	__type(value, __u8);
} frag_flows SEC(".maps");

enum xsk_counter {
	XSK_CNT_REDIRECTED,
	XSK_CNT_PASS_FRAGMENT,
	XSK_CNT_FRAGMENT,
	XSK_CNT_PASS_NO_SOCKET,
	XSK_CNT__MAX,
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, XSK_CNT__MAX);
	__type(key, __u32);
	__type(value, __u64);
} xsk_counters SEC(".maps");

static __always_inline void xcount(__u32 idx)
{
	__u64 *c = bpf_map_lookup_elem(&xsk_counters, &idx);
	if (c)
		*c += 1;
}

/* xdp.frags: loaded as able to see multi-buffer frames, so that interfaces with an MTU above a
 * page (veth refuses single-buffer XDP there) can carry it; such frames pass to the stack. */
SEC("xdp.frags")
int xsk_redirect(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *end = (void *)(long)ctx->data_end;
	struct ethhdr *eth = data;
	struct mp_xsk_addr dst = {};
	struct mp_frag_key frag = {};
	__u8 src[16] = {};
	struct udphdr *udp;
	int later_fragment = 0, fragment = 0;

	if ((void *)(eth + 1) > end)
		return XDP_PASS;
	if (eth->h_proto == bpf_htons(ETH_P_IP)) {
		struct iphdr *ip = (void *)(eth + 1);
		if ((void *)(ip + 1) > end || ip->ihl != 5 || ip->version != 4 || ip->protocol != IPPROTO_UDP_NR)
			return XDP_PASS;
		dst.family = MP_FAMILY_V4;
		__builtin_memcpy(dst.addr, &ip->daddr, 4);
		__builtin_memcpy(src, &ip->saddr, 4);
		if (ip->frag_off & bpf_htons(0x3fff)) {
			fragment = 1;
			later_fragment = (ip->frag_off & bpf_htons(0x1fff)) != 0;
			frag.id = ip->id;
		}
		udp = (void *)(ip + 1);
	} else if (eth->h_proto == bpf_htons(ETH_P_IPV6)) {
		struct ipv6hdr *ip6 = (void *)(eth + 1);
		if ((void *)(ip6 + 1) > end)
			return XDP_PASS;
		dst.family = MP_FAMILY_V6;
		__builtin_memcpy(dst.addr, &ip6->daddr, 16);
		__builtin_memcpy(src, &ip6->saddr, 16);
		if (ip6->nexthdr == 44) {
			struct frag_hdr *fh = (void *)(ip6 + 1);
			if ((void *)(fh + 1) > end || fh->nexthdr != IPPROTO_UDP_NR)
				return XDP_PASS;
			fragment = 1;
			later_fragment = (fh->frag_off & bpf_htons(0xfff8)) != 0;
			frag.id = fh->identification;
			udp = (void *)(fh + 1);
		} else if (ip6->nexthdr == IPPROTO_UDP_NR) {
			udp = (void *)(ip6 + 1);
		} else {
			/* Other extension headers: the stack's. */
			return XDP_PASS;
		}
	} else {
		return XDP_PASS;
	}
	if (fragment) {
		frag.family = dst.family;
		__builtin_memcpy(frag.src, src, 16);
		__builtin_memcpy(frag.dst, dst.addr, 16);
	}
	if (later_fragment) {
		/* No UDP header: handed over when its first fragment was. */
		if (!bpf_map_lookup_elem(&frag_flows, &frag)) {
			xcount(XSK_CNT_PASS_FRAGMENT);
			return XDP_PASS;
		}
	} else {
		if ((void *)(udp + 1) > end)
			return XDP_PASS;
		dst.port = udp->dest;
		if (!bpf_map_lookup_elem(&sfu_addrs, &dst))
			return XDP_PASS;
		if (fragment) {
			__u8 one = 1;
			bpf_map_update_elem(&frag_flows, &frag, &one, BPF_ANY);
		}
	}
	struct mp_xsk_queue q = { .ifindex = ctx->ingress_ifindex, .queue = ctx->rx_queue_index };
	__u32 *slot = bpf_map_lookup_elem(&xsk_slots, &q);
	if (!slot) {
		xcount(XSK_CNT_PASS_NO_SOCKET);
		return XDP_PASS;
	}
	xcount(fragment ? XSK_CNT_FRAGMENT : XSK_CNT_REDIRECTED);
	/* No socket in the slot (not bound yet, or closed): the stack's. */
	return bpf_redirect_map(&xsks, *slot, XDP_PASS);
}
