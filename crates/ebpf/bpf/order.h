/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Stream order across the two paths. When the fast path must hand a packet of an established
 * stream up (a next hop not resolved yet, a copy too big for its link, a helper failure), that
 * packet takes the slow path's longer way; a later packet of the same stream forwarded in the
 * kernel would overtake it. So such a packet is counted (stream_path.up) and marked
 * (MP_ORDER_MARK | stats slot, read by the slow path with SO_RCVMARK), the slow path acknowledges
 * each marked packet once it has sent its copies (stream_path.done, through mmap), and while the
 * two differ every later packet of the stream goes up too: the stream leaves the kernel path
 * only in order and returns to it only when the slow path holds none of its packets.
 * A hold that sees no acknowledgement for MP_ORDER_HOLD_MAX_NS ends: a packet lost on its way
 * up (a full socket buffer) must not pin the stream to the slow path. */
#ifndef MEDIAPLANE_ORDER_H
#define MEDIAPLANE_ORDER_H

#include "common.h"
#include "maps.h"

/* Does the stream still have packets in the slow path? */
static __always_inline int order_held(struct mp_stream_path *sp, __u64 now)
{
	__u64 up = *(volatile __u64 *)&sp->up;
	__u64 done = *(volatile __u64 *)&sp->done;
	if ((__s64)(up - done) <= 0)
		return 0;
	if (done != sp->seen_done) {
		sp->seen_done = done;
		sp->progress_ns = now;
		return 1;
	}
	if (now - sp->progress_ns < MP_ORDER_HOLD_MAX_NS)
		return 1;
	/* No acknowledgement for too long: stop waiting for what was lost. */
	__sync_fetch_and_add(&sp->up, done - up);
	return 0;
}

/* Hand the packet up in order: count and mark it (a packet already carrying a mark is left
 * alone and not counted: the mark is the host's). */
static __always_inline void order_mark(struct __sk_buff *skb, struct mp_stream_path *sp, __u32 slot, __u64 now)
{
	if (!sp || skb->mark != 0 || slot & MP_ORDER_MARK)
		return;
	__u64 up = *(volatile __u64 *)&sp->up;
	__u64 done = *(volatile __u64 *)&sp->done;
	if ((__s64)(up - done) <= 0) {
		/* A hold begins. */
		sp->seen_done = done;
		sp->progress_ns = now;
	}
	__sync_fetch_and_add(&sp->up, 1);
	skb->mark = MP_ORDER_MARK | slot;
}

#endif
