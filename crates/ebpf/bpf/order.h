/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Stream order across the two paths. When the fast path must hand a packet of an established
 * stream up (a next hop not resolved yet, a copy too big for its link, a helper failure), that
 * packet takes the slow path's longer way; a later packet of the same stream forwarded in the
 * kernel would overtake it. So such a packet is numbered (stream_path.up) and marked with its
 * sequence number and stream (read by the slow path with SO_RCVMARK); the slow path, which serves
 * a stream first in, first out, writes the number of the last one it has sent
 * (stream_path.done, through mmap); while the two differ every later packet of the stream goes
 * up too: the stream leaves the kernel path only in order and returns to it when the slow path
 * has sent the last packet handed up. A packet lost on its way up (a full socket buffer, a
 * fragment that never reassembles) is covered by any later acknowledgement; if it was the last,
 * the hold ends after MP_ORDER_HOLD_MAX_NS without progress. */
#ifndef MEDIAPLANE_ORDER_H
#define MEDIAPLANE_ORDER_H

#include "common.h"
#include "maps.h"

static __always_inline int order_pending(__u64 up, __u64 done)
{
	return ((up ^ done) & MP_ORDER_SEQ_MASK) != 0;
}

/* Does the stream still have packets in the slow path? */
static __always_inline int order_held(struct mp_stream_path *sp, __u64 now)
{
	__u64 up = *(volatile __u64 *)&sp->up;
	__u64 done = *(volatile __u64 *)&sp->done;
	if (!order_pending(up, done))
		return 0;
	if (done != sp->seen_done) {
		sp->seen_done = done;
		sp->progress_ns = now;
		return 1;
	}
	if (now - sp->progress_ns < MP_ORDER_HOLD_MAX_NS)
		return 1;
	/* Nothing acknowledged for too long: what went up last was lost. Stop waiting for it. */
	*(volatile __u64 *)&sp->done = up & MP_ORDER_SEQ_MASK;
	return 0;
}

/* Hand the packet up in order: number and mark it (a packet already carrying a mark is left
 * alone: the mark is the host's). */
static __always_inline void order_mark(struct __sk_buff *skb, struct mp_stream_path *sp, __u32 slot, __u64 now)
{
	if (!sp || skb->mark != 0 || slot >> MP_ORDER_SLOT_BITS)
		return;
	__u64 up = *(volatile __u64 *)&sp->up;
	__u64 done = *(volatile __u64 *)&sp->done;
	if (!order_pending(up, done)) {
		/* A hold begins. */
		sp->seen_done = done;
		sp->progress_ns = now;
	}
	__u64 seq = __sync_fetch_and_add(&sp->up, 1) + 1;
	skb->mark = MP_ORDER_MARK | (((__u32)seq & MP_ORDER_SEQ_MASK) << MP_ORDER_SLOT_BITS) | slot;
}

#endif
