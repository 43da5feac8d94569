/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* In-path reception quality of an RTP stream: loss, duplicates, reordering, interarrival jitter.
 * A line-for-line mirror of mediaplane_core::reception::RtpReception::on_packet (read that for
 * the why); tests/test_run.rs holds the two against each other. Rust mirror of the struct:
 * src/maps.rs (ReceptionRaw). */
#ifndef MEDIAPLANE_RECEPTION_H
#define MEDIAPLANE_RECEPTION_H

#include "common.h"

#define RX_MAX_DROPOUT 3000
#define RX_MAX_MISORDER 100
#define RX_WINDOW 64
#define RX_MAX_TRANSIT_DELTA 0x00ffffffu
#define RX_NO_PROBATION 0x10000u

/* One per stream (indexed like stream_stats), shared by all CPUs under its lock. */
struct mp_reception {
	struct bpf_spin_lock lock;
	__u32 started;
	__u32 ssrc;
	__u32 clock_rate;
	__u32 max_ext;
	__u32 base_ext;
	__u64 window;
	__u32 probation;
	__u32 has_transit;
	__u64 received;
	__u64 expected_prior;
	__u64 received_prior;
	__u64 duplicates;
	__u64 reordered;
	__u64 jumps;
	__u64 resyncs;
	__u64 ssrc_changes;
	__u32 transit;
	__u32 jitter_q4;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536); /* = streams max_entries */
	__type(key, __u32);
	__type(value, struct mp_reception);
} stream_reception SEC(".maps");

/* The same accounting per consumer, over the copies the fast path sent it, with the headers they
 * left with (a simulcast consumer's renumbered ones): its RTP as forwarded. By consumer uid, made
 * and deleted by user space together with the consumer's consumer_stats entry (the program never
 * creates one); shared by all CPUs under its lock. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536); /* = consumer_stats max_entries */
	__type(key, __u32);
	__type(value, struct mp_reception);
} consumer_reception SEC(".maps");

static __always_inline void rx_restart(struct mp_reception *r, __u32 ssrc, __u16 seq)
{
	if (r->started) {
		r->expected_prior += (__u64)(r->max_ext - r->base_ext) + 1;
		r->received_prior += r->received;
	}
	r->started = 1;
	r->ssrc = ssrc;
	r->max_ext = 0x10000u | seq;
	r->base_ext = r->max_ext;
	r->window = 1;
	r->probation = RX_NO_PROBATION;
	r->received = 1;
	r->has_transit = 0;
}

/* RFC 3550 A.8, jitter kept x16. `arrival`: the arrival time in units of `clock_rate`. */
static __always_inline void rx_jitter(struct mp_reception *r, __u32 ts, __u32 arrival, __u32 clock_rate)
{
	if (clock_rate != r->clock_rate) {
		r->clock_rate = clock_rate;
		r->has_transit = 0;
	}
	if (clock_rate == 0)
		return;
	__u32 transit = arrival - ts;
	if (r->has_transit) {
		__s32 sd = (__s32)(transit - r->transit);
		__u32 d = sd < 0 ? -(__u32)sd : (__u32)sd;
		if (d > RX_MAX_TRANSIT_DELTA)
			d = RX_MAX_TRANSIT_DELTA;
		r->jitter_q4 = r->jitter_q4 + d - ((r->jitter_q4 + 8) >> 4);
	}
	r->transit = transit;
	r->has_transit = 1;
}

/* RtpReception::on_packet, under r->lock. */
static __always_inline void rx_on_packet(struct mp_reception *r, __u32 ssrc, __u16 seq, __u32 ts, __u32 arrival, __u32 clock_rate)
{
	if (!r->started || ssrc != r->ssrc) {
		if (r->started)
			r->ssrc_changes += 1;
		rx_restart(r, ssrc, seq);
		rx_jitter(r, ts, arrival, clock_rate);
		return;
	}
	__u16 delta = seq - (__u16)r->max_ext;
	if (delta == 0) {
		r->duplicates += 1;
		return;
	}
	if (delta < RX_MAX_DROPOUT) {
		r->max_ext += delta;
		r->window = delta < RX_WINDOW ? r->window << delta : 0;
		r->window |= 1;
		r->received += 1;
		r->probation = RX_NO_PROBATION;
		rx_jitter(r, ts, arrival, clock_rate);
		return;
	}
	if (delta > 0xffff - RX_MAX_MISORDER) {
		__u32 back = 0x10000u - delta;
		if (back < RX_WINDOW && (r->window & (1ull << back))) {
			r->duplicates += 1;
			return;
		}
		if (back < RX_WINDOW)
			r->window |= 1ull << back;
		r->received += 1;
		r->reordered += 1;
		__u32 ext = r->max_ext - back;
		if (ext < r->base_ext)
			r->base_ext = ext;
		rx_jitter(r, ts, arrival, clock_rate);
		return;
	}
	if (r->probation == seq) {
		r->resyncs += 1;
		rx_restart(r, ssrc, seq);
		rx_jitter(r, ts, arrival, clock_rate);
		return;
	}
	r->jumps += 1;
	r->probation = (__u16)(seq + 1);
}

/* An RTP packet of an RTP stream: `flags` the stream's STREAM_F_*, `have` the bytes of its head
 * loaded, `head0` their first 4. RTP by RFC 7983/5761 demultiplexing (parse.h demux): first byte
 * 128..191, second byte not an RTCP packet type. */
static __always_inline int rx_is_rtp(__u32 flags, __u32 have, __u32 head0)
{
	__u32 b0 = head0 >> 24, b1 = (head0 >> 16) & 0xff;
	return (flags & STREAM_F_RTP) && have >= 12 && b0 >= 128 && b0 <= 191 && !(b1 >= 192 && b1 <= 223);
}

/* One packet (head0: its first 4 bytes, ts_ssrc: bytes 4..12) into r, under its lock. */
static __always_inline void rx_account(struct mp_reception *r, __u32 head0, __u64 ts_ssrc, __u32 clock_rate, __u64 now_ns)
{
	/* mediaplane_core::reception::arrival_units */
	__u32 arrival = ((now_ns / 1000) * clock_rate) / 1000000;
	bpf_spin_lock(&r->lock);
	rx_on_packet(r, (__u32)ts_ssrc, head0 & 0xffff, ts_ssrc >> 32, arrival, clock_rate);
	bpf_spin_unlock(&r->lock);
}

/* Account one forwarded packet of a stream, if it is RTP on an RTP stream. Global, and every
 * decision is taken here on its arguments: the caller branches on nothing it knows, so its paths
 * (which differ in what they know, e.g. the packet's kind) are not told apart from here on,
 * which would multiply the states the verifier walks through the rest of the program.
 * A BPF call has five arguments, hence the packing:
 *   slot_flags: stats slot << 32 | the stream's STREAM_F_* flags
 *   have_rate:  bytes of `head` loaded << 32 | the stream's clock rate
 *   head0:      the payload's first 4 bytes (V/P/X/CC, M/PT, sequence number)
 *   ts_ssrc:    its bytes 4..12 (timestamp << 32 | SSRC) */
__noinline int reception_account(__u64 slot_flags, __u64 have_rate, __u32 head0, __u64 ts_ssrc, __u64 now_ns)
{
	if (!rx_is_rtp((__u32)slot_flags, have_rate >> 32, head0))
		return 0;
	__u32 slot = slot_flags >> 32;
	struct mp_reception *r = bpf_map_lookup_elem(&stream_reception, &slot);
	if (r)
		rx_account(r, head0, ts_ssrc, (__u32)have_rate, now_ns);
	return 0;
}

/* Account one RTP copy sent to `consumer` (head0, ts_ssrc: the copy's header, packed as for
 * reception_account; the caller checked rx_is_rtp). At the packet's arrival time: jitter as
 * forwarded is the stream's timing as the consumer got it (layer switches included), not the
 * fan-out's own microseconds. Global: verified once, not once per path of the copy callback
 * that calls it. */
__noinline int forwarded_account(__u32 consumer, __u32 head0, __u64 ts_ssrc, __u32 clock_rate, __u64 now_ns)
{
	struct mp_reception *r = bpf_map_lookup_elem(&consumer_reception, &consumer);
	if (r)
		rx_account(r, head0, ts_ssrc, clock_rate, now_ns);
	return 0;
}

#endif
