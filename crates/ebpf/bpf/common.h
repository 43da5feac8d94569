/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Constants shared by every mediaplane BPF program: what vmlinux.h does not carry (uapi
 * #defines), counter indices and flags. The Rust mirror lives in src/maps.rs: change both. */
#ifndef MEDIAPLANE_COMMON_H
#define MEDIAPLANE_COMMON_H

/* uapi/linux/pkt_cls.h: #defines, so absent from vmlinux.h. */
#define TC_ACT_UNSPEC (-1)
#define TC_ACT_OK 0
#define TC_ACT_SHOT 2
#define TC_ACT_REDIRECT 7

#define ETH_HLEN 14
#define ETH_ALEN 6
#define ETH_P_IP 0x0800
#define ETH_P_IPV6 0x86DD
#define ETH_P_8021Q 0x8100
#define ETH_P_8021AD 0x88A8
#define AF_INET 2
#define AF_INET6 10
#define IPPROTO_UDP_NR 17


/* Address families as stored in map keys (not AF_*: independent of the libc). */
#define MP_FAMILY_V4 4
#define MP_FAMILY_V6 6

/* stream_value.flags */
#define STREAM_F_PRESENT (1u << 0)  /* a real stream; unset on the placeholder wildcard entry that
                                      only says "this local address has SSRC-narrowed streams" */
#define STREAM_F_RTP (1u << 1)      /* payload must be valid RTP/RTCP */
#define STREAM_F_NARROWED (1u << 2) /* (wildcard entry only) some stream on this local has an SSRC */
#define STREAM_F_LATCH (1u << 3)    /* a relay leg learning its source: packets from src_addr/src_port
                                      (when src_port is set) are forwarded, others go to the slow
                                      path, which relays them and reports the source */
#define STREAM_F_SLOW (1u << 4)     /* the kernel cannot fan this one out (mixed address families,
                                      too many copies): slow path */
#define STREAM_F_RATE (1u << 5)     /* rate limited: stream_rate[stats_slot] */
#define STREAM_F_ONE_SOURCE (1u << 6) /* (wildcard entry only) every stream on this local address
                                        (the wildcard one, if real, and every SSRC-narrowed one)
                                        has the same fixed source, in this entry's src_addr/src_port
                                        (also on the placeholder): a packet from any other source is
                                        never forwarded (read by the XDP pre-filter; TC ignores it) */
#define STREAM_F_ANY_SOURCE (1u << 7) /* any source is forwarded (a relay leg that locked its
                                        source, or an asymmetric one): no source check */
#define STREAM_F_RTCP_UP (1u << 8)  /* its RTCP goes to the slow path, which relays it and hands it
                                      to the control plane (a relay's reports: RTT, MOS) or times an
                                      SFU publisher's sender reports (consumers' RTT) */
#define STREAM_F_FEEDBACK (1u << 9) /* (wildcard entry only) a consumer's address: RTCP from the
                                      source in this entry (the placeholder too) is feedback, which
                                      the slow path routes to the publishers (core feedback.rs) */
#define STREAM_F_SIMULCAST (1u << 10) /* one layer of a simulcast stream: each copy is decided and
                                        renumbered for its consumer (layer_rewrite.h) */
#define STREAM_F_ADDRESS_UP (1u << 11) /* (wildcard entry only) an ICE + DTLS-SRTP address (a WebRTC
                                         participant's transport, an ICE relay leg): all that is not
                                         STUN goes to the slow path, which judges it as classify()
                                         does (DTLS, SRTP, and SRTCP, which cannot be walked here) */
#define STREAM_F_PT_UP (1u << 12)   /* RTP of the payload types in up_pt goes to the slow path (a relay
                                       leg's RFC 4733 events, reported from there); the rest is forwarded */

/* Source addresses whose rate-limit buckets the kernel keeps (LRU). */
#define MAX_SOURCES 65536

/* XDP pre-filter counters (index into its `xdp_counters` per-CPU array). Rust mirror:
 * src/prefilter.rs XDP_COUNTERS. */
enum mp_xdp_counter {
	XDP_CNT_DROP_STRANGER = 0, /* dropped: classify() says Stranger (see prefilter_xdp.bpf.c) */
	XDP_CNT_DROP_BYTES,        /* UDP payload bytes of both kinds of drop */
	XDP_CNT_PASS,              /* everything else, left to TC and the stack */
	XDP_CNT_DROP_NO_STREAM,    /* dropped: not the address's one source, and an SSRC no stream
	                              there has (classify() says NoStream; TC: drop_no_stream) */
	XDP_CNT__MAX,
};

/* Copies per stream the kernel fans out itself (size of the per-CPU next-hop scratch). */
#define MAX_FANOUT 4096

/* Next-hop cache: entries (a power of two >= MAX_FANOUT) and how long one may be used without
 * a fresh bpf_fib_lookup even when no change was signalled. */
#define NH_CACHE_SIZE 8192
#define NH_CACHE_TTL_NS 1000000000ull

/* skb->ip_summed */
#define MP_CHECKSUM_NONE 0
#define MP_CHECKSUM_UNNECESSARY 1
#define MP_CHECKSUM_COMPLETE 2
#define MP_CHECKSUM_PARTIAL 3

/* Global per-CPU counters (index into the `counters` array). The first eight mirror fields of
 * mediaplane_dataplane::Counters and count only packets the kernel decided itself (forwarded or
 * dropped); packets handed to the stack are counted by the user-space slow path that reads
 * them, so merged totals count every packet once. */
enum mp_counter {
#define MP_COUNTER(name) CNT_##name,
#include "counters.def"
#undef MP_COUNTER
	CNT__MAX,
};

/* fast_config.flags */
#define MP_CFG_VERIFY_CSUM (1u << 0) /* verify IPv4 header and UDP checksums the device did not */
#define MP_CFG_KEEP_DSCP (1u << 1)   /* copies keep the publisher's DSCP instead of fast_config.dscp */
#define MP_CFG_HOLD_ORDER (1u << 2)  /* keep a stream in the slow path while it holds packets there */
#define MP_CFG_FORWARDED_QOS (1u << 3) /* account each consumer's RTP as forwarded (reception.h) */

/* Reverse-path check modes (the values of net.ipv4.conf.*.rp_filter). */
#define MP_RPF_OFF 0
#define MP_RPF_STRICT 1
#define MP_RPF_LOOSE 2

/* Packets the fast path hands up in stream order carry a mark (the slow path reads it with
 * SO_RCVMARK and acknowledges it): MP_ORDER_MARK | seq << MP_ORDER_SLOT_BITS | stats slot, with a
 * per-stream sequence number of MP_ORDER_SEQ_MASK bits. Streams whose slot needs more bits are
 * not held. */
#define MP_ORDER_MARK 0x80000000u
#define MP_ORDER_SLOT_BITS 21
#define MP_ORDER_SEQ_MASK 0x3ffu
/* A stream stops waiting for the slow path when it acknowledged nothing for this long (a packet
 * lost on its way up must not pin the stream to the slow path). */
#define MP_ORDER_HOLD_MAX_NS 50000000ull

/* Per-copy latency histogram (struct mp_latency_hist): 16 exact buckets for 0..15 ns, then 8
 * linear sub-buckets per power of two up to 2^40 ns. */
#define LAT_EXACT 16
#define LAT_SUB 8
#define LAT_MAX_EXP 40
#define LAT_BUCKETS (LAT_EXACT + (LAT_MAX_EXP - 4) * LAT_SUB)

#endif
