/* SPDX-License-Identifier: (LGPL-2.1 OR BSD-2-Clause) */
/* Simulcast in the kernel: mediaplane_core::simulcast::LayerRewriter, rule for rule, on a state
 * kept per consumer in `layer_state` (its Rust mirror: src/maps.rs LayerStateRaw, which converts
 * to core's RewriterState). A consumer receives one layer at a time on one SSRC, with continuous
 * sequence numbers, timestamps and VP8 picture ids; it moves to another layer only at a keyframe
 * of it. The core module documents why the rules make the renumbering exact; tests/layers.rs
 * holds this file to the core on random schedules, loss and reordering.
 *
 * Who does what: the kernel decides every packet (sfu_ingress per copy, layer_ctl for what the
 * slow path forwards), under the state's lock, so a consumer's packets of different layers
 * (different flows, maybe different CPUs) are decided one at a time. User space creates and
 * deletes the states, sets each consumer's target layer (layer_ctl, MP_LAYER_OP_TARGET) and
 * reads them back (to map NACKs and sender reports, and to ask for keyframes).
 *
 * Temporal layers (VP8 TID) of the layer received are decided here too, on the newest packet of
 * the layer (in layer_on_packet): a dropped frame cuts the segment (layer_cut) and the next kept
 * packet continues it (layer_continue), so the drop takes no number (simulcast.rs documents the
 * rule). */
#ifndef MEDIAPLANE_LAYER_REWRITE_H
#define MEDIAPLANE_LAYER_REWRITE_H

#include "common.h"
#include "parse.h"

#define MP_MAX_LAYERS 4        /* simulcast::MAX_LAYERS */
#define MP_LAYER_HISTORY 8     /* simulcast::HISTORY */
#define MP_DEDUPE_WINDOW 64    /* simulcast::DEDUPE_WINDOW */
#define MP_SEGMENT_SPAN 0x4000 /* simulcast::SEGMENT_SPAN */
#define MP_STAP_A_SCAN 16      /* simulcast::STAP_A_SCAN */
#define MP_LAYER_NONE 0xff     /* no target: paused */
#define MP_TEMPORAL_ALL 0xff   /* simulcast::ALL_TEMPORAL: no temporal ceiling */
/* mp_layer_state.cut */
#define MP_CUT 1
#define MP_CUT_PICTURES 2 /* the dropped packets had picture ids */
/* mp_layer_pkt.temporal: 0, or MP_TID_PRESENT | MP_TID_SYNC? | TID */
#define MP_TID_PRESENT 0x80
#define MP_TID_SYNC 0x40

/* stream_value.codec */
#define MP_CODEC_VP8 0
#define MP_CODEC_H264 1

/* What became of a packet for a consumer (simulcast::Decision; 0 is never a verdict). */
enum mp_layer_verdict {
	MP_LAYER_FORWARD = 1,
	MP_LAYER_OTHER_LAYER,
	MP_LAYER_WAITING_KEYFRAME,
	MP_LAYER_DUPLICATE,
	MP_LAYER_LATE,
	MP_LAYER_PAUSED,
	MP_LAYER_NO_STATE, /* the consumer has no state (user space creates it with the copy) */
	MP_LAYER_INVALID,  /* layer_ctl: not RTP, or an unknown operation */
	MP_LAYER_TEMPORAL, /* above the consumer's temporal ceiling */
};

struct mp_layer_segment {
	__u16 start;
	__u16 highest;
	__u16 seq_offset;
	__u16 pic_offset;
	__u32 ts_offset;
	__u8 layer;
	__u8 tl0_offset;
	__u16 pad;
};

struct mp_layer_state {
	struct bpf_spin_lock lock;
	__u32 ssrc;       /* what the consumer receives on */
	__u32 clock_rate; /* 90000 when unknown */
	__u8 target;      /* MP_LAYER_NONE: paused */
	__u8 open;
	__u8 nsegs;
	__u8 newest_set;  /* bit l: newest[l] is set */
	__u16 newest[MP_MAX_LAYERS];
	__u16 top_seq;
	__u16 top_pic;
	__u32 top_ts;
	__u8 top_tl0;
	__u8 temporal_target;  /* MP_TEMPORAL_ALL: no ceiling */
	__u8 temporal_current; /* the ceiling in force */
	__u8 cut;              /* MP_CUT, MP_CUT_PICTURES (simulcast::Cut) */
	__u16 cut_next_seq;
	__u16 cut_resume_seq;
	__u64 top_at_ns;
	__u64 sent;
	__u64 forwarded;
	__u64 switches;
	__u64 duplicates;
	__u64 late;
	struct mp_layer_segment seg[MP_LAYER_HISTORY];
	__u64 temporal_dropped;
	__u16 cut_next_pic;
	__u16 cut_resume_pic;
	__u32 pad;
};

/* By consumer uid. User space creates an entry (BPF_NOEXIST) for each consumer of the installed
 * table (within a tick of its copies; until then its copies are skipped, as before its first
 * keyframe) and deletes it with the consumer; programs never create one. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(map_flags, BPF_F_NO_PREALLOC);
	__uint(max_entries, 65536); /* = copies max_entries */
	__type(key, __u32);
	__type(value, struct mp_layer_state);
} layer_state SEC(".maps");

/* What the rewrite needs of one packet (simulcast::PacketInfo); offsets from the RTP header. */
struct mp_layer_pkt {
	__u32 ts;
	__u16 seq;
	__u16 pic;
	__u16 pic_at; /* 0: no picture id */
	__u16 tl0_at; /* 0: no TL0PICIDX */
	__u8 pic_wide;
	__u8 tl0;
	__u8 keyframe_start;
	__u8 frame_start;
	__u8 temporal; /* 0: none; MP_TID_PRESENT | MP_TID_SYNC | TID */
	__u8 pad[3];
};

/* The header values a packet goes out with (simulcast::Rewrite). */
struct mp_layer_out {
	__u32 ssrc;
	__u32 ts;
	__u16 seq;
	__u16 pic;
	__u8 tl0;
	__u8 pad[3];
};

static __always_inline int seq_newer(__u16 a, __u16 b)
{
	return a != b && (__u16)(a - b) < 0x8000;
}

/* simulcast::h264_keyframe_start, the payload at `off` (`n` bytes). */
static __always_inline int h264_keyframe_start(struct __sk_buff *skb, __u32 off, __u32 n, __u8 b0, __u8 b1)
{
#define MP_H264_KEY(t) ((t) == 5 || (t) == 7)
	__u8 t = b0 & 0x1f;
	if (t == 28)
		return n >= 2 && (b1 & 0x80) && MP_H264_KEY(b1 & 0x1f);
	if (t != 24)
		return MP_H264_KEY(t);
	__u32 i = 1;
	for (int k = 0; k < MP_STAP_A_SCAN; k++) {
		__u8 h[3];
		if (i + 2 >= n || bpf_skb_load_bytes(skb, off + (i & 0xffff), h, 3))
			return 0;
		__u32 size = rd16(h);
		if (size == 0 || i + 2 + size > n)
			return 0;
		if (MP_H264_KEY(h[2] & 0x1f))
			return 1;
		i += 2 + size;
	}
	return 0;
#undef MP_H264_KEY
}

/* simulcast::inspect of the RTP packet of `len` bytes at `off`. -1: not valid RTP. */
__noinline int layer_inspect(struct __sk_buff *skb, __u32 off, __u32 len, __u32 codec, struct mp_layer_pkt *out)
{
	__u32 poff, plen;
	__u8 h[8];
	if (!out || len < 8 || bpf_skb_load_bytes(skb, off, h, 8) || rtp_bounds(skb, off, len, h[0], &poff, &plen))
		return -1;
	__builtin_memset(out, 0, sizeof(*out));
	out->seq = rd16(h + 2);
	out->ts = rd32(h + 4);
	if (plen == 0)
		return 0;
	/* The descriptor and the byte after it: at most 7 bytes. */
	__u8 p[8] = {};
	__u32 n = plen < 8 ? plen : 8;
	__u32 size = (n - 1) & 7;
	asm volatile("" : "+r"(size)); /* keep the bound visible: size + 1 is in [1, 8] */
	if (bpf_skb_load_bytes(skb, off + poff, p, size + 1))
		return -1;
	if (codec == MP_CODEC_H264) {
		out->keyframe_start = h264_keyframe_start(skb, off + poff, plen, p[0], p[1]);
		return 0;
	}
	/* RFC 7741 4.2 (vp8_descriptor): the byte at index i exists iff i < n (n <= 8 covers all).
	 * Bytes at a variable index come out of one word (the verifier refuses variable offsets
	 * into the stack as clang writes them). Little-endian: p[i] is bits 8i..8i+7. */
	__u64 w;
	__builtin_memcpy(&w, p, 8);
#define P_AT(i) ((__u8)(w >> (((i) & 7) * 8)))
	__u8 b0 = p[0];
	__u32 at = 1;
	if (b0 & 0x80) {
		if (n < 2)
			return 0;
		__u8 x = p[1];
		at = 2;
		if (x & 0x80) {
			if (n < 3)
				return 0;
			__u8 m = p[2];
			if (m & 0x80) {
				if (n < 4)
					return 0;
				out->pic = ((__u16)(m & 0x7f) << 8) | p[3];
				out->pic_wide = 1;
				out->pic_at = poff + 2;
				at = 4;
			} else {
				out->pic = m;
				out->pic_at = poff + 2;
				at = 3;
			}
		}
		if (x & 0x40) {
			if (n <= at)
				goto no_descriptor;
			out->tl0 = P_AT(at);
			out->tl0_at = poff + at;
			at += 1;
		}
		if (x & 0x30) {
			if (n <= at)
				goto no_descriptor;
			__u8 t = P_AT(at);
			if (x & 0x20)
				out->temporal = MP_TID_PRESENT | (t & 0x20 ? MP_TID_SYNC : 0) | t >> 6;
			at += 1;
		}
	}
	out->frame_start = (b0 & 0x10) && (b0 & 0x07) == 0;
	out->keyframe_start = out->frame_start && at < n && !(P_AT(at) & 1);
	return 0;
#undef P_AT
no_descriptor:
	/* A truncated descriptor: vp8_descriptor() says None, nothing of it is used. */
	out->pic_at = 0;
	out->tl0_at = 0;
	out->pic = 0;
	out->tl0 = 0;
	out->pic_wide = 0;
	out->temporal = 0;
	return 0;
}

/* Segment::reach: extend g's range to seq when newer, its start following within the span. */
static __always_inline void seg_reach(struct mp_layer_segment *g, __u16 seq)
{
	if (seq_newer(seq, g->highest)) {
		g->highest = seq;
		if ((__u16)(g->highest - g->start) > MP_SEGMENT_SPAN)
			g->start = g->highest - MP_SEGMENT_SPAN;
	}
}

/* LayerRewriter::emit for segment i (< nsegs), under the lock. */
static __always_inline int layer_emit(struct mp_layer_state *st, __u32 i, const struct mp_layer_pkt *in, __u64 now,
				      struct mp_layer_out *out)
{
	i &= MP_LAYER_HISTORY - 1;
	struct mp_layer_segment g = st->seg[i];
	__u16 s = in->seq;
	__u16 o = s + g.seq_offset;
	int first = st->forwarded == 0;
	__u16 behind = st->top_seq - o;
	int newer = !first && seq_newer(o, st->top_seq);
	int current = i == 0 && st->open;
	/* Paused, the newest segment still takes the numbers a cut kept for packets on their way. */
	int kept_by_cut = i == 0 && (st->cut & MP_CUT) && seq_newer(st->cut_next_seq, o);
	if (!current && !kept_by_cut && newer) {
		st->late += 1;
		return MP_LAYER_LATE;
	}
	if (!first && !newer) {
		if (behind >= MP_DEDUPE_WINDOW) {
			st->late += 1;
			return MP_LAYER_LATE;
		}
		__u64 bit = 1ull << (behind & 63);
		if (st->sent & bit) {
			st->duplicates += 1;
			return MP_LAYER_DUPLICATE;
		}
		st->sent |= bit;
	}
	out->ssrc = st->ssrc;
	out->seq = o;
	out->ts = in->ts + g.ts_offset;
	out->pic = (in->pic + g.pic_offset) & (in->pic_wide ? 0x7fff : 0x7f);
	out->tl0 = in->tl0 + g.tl0_offset;
	if (first || newer) {
		__u16 ahead = o - st->top_seq;
		st->sent = (first || ahead >= 64) ? 1 : (st->sent << (ahead & 63)) | 1;
		st->top_seq = o;
		st->top_ts = out->ts;
		if (in->pic_at)
			st->top_pic = out->pic & 0x7fff;
		if (in->tl0_at)
			st->top_tl0 = out->tl0;
		st->top_at_ns = now;
		/* Older segments all of whose numbers are out of the window take nothing more. */
		for (__u32 k = 1; k < MP_LAYER_HISTORY; k++) {
			if (k >= st->nsegs)
				break;
			struct mp_layer_segment *old = &st->seg[k];
			if ((__u16)(o - (__u16)(old->highest + old->seq_offset)) >= MP_DEDUPE_WINDOW) {
				st->nsegs = k;
				break;
			}
		}
	}
	seg_reach(&st->seg[i], s);
	st->forwarded += 1;
	return MP_LAYER_FORWARD;
}

/* LayerRewriter::open_segment, under the lock. */
static __always_inline void layer_open_segment(struct mp_layer_state *st, __u32 layer, const struct mp_layer_pkt *in, __u64 now)
{
	struct mp_layer_segment g = { .layer = layer, .start = in->seq, .highest = in->seq };
	/* After a cut the numbers up to the first dropped one are taken (kept packets on their way). */
	__u16 top_seq = st->top_seq, top_pic = st->top_pic;
	if (st->cut & MP_CUT) {
		top_seq = st->cut_next_seq - 1;
		if (st->cut & MP_CUT_PICTURES)
			top_pic = (st->cut_next_pic - 1) & 0x7fff;
	}
	st->cut = 0;
	if (st->nsegs > 0) {
		/* ticks = clamp(elapsed * clock_rate / 1e9, 1, u32::MAX), without a 128-bit product. */
		__u64 dt = now > st->top_at_ns ? now - st->top_at_ns : 0;
		__u64 rate = st->clock_rate, secs = dt / 1000000000ull, rem = dt % 1000000000ull;
		__u64 ticks = secs > 0xffffffffull / (rate ? rate : 1) ? 0xffffffffull : secs * rate + rem * rate / 1000000000ull;
		if (ticks < 1)
			ticks = 1;
		if (ticks > 0xffffffffull)
			ticks = 0xffffffffull;
		g.seq_offset = top_seq + 1 - in->seq;
		g.ts_offset = st->top_ts + (__u32)ticks - in->ts;
		g.pic_offset = in->pic_at ? (__u16)(top_pic + 1 - in->pic) & 0x7fff : 0;
		g.tl0_offset = in->tl0_at ? (__u8)(st->top_tl0 + 1 - in->tl0) : 0;
		st->switches += 1;
	}
	for (__u32 k = MP_LAYER_HISTORY - 1; k > 0; k--)
		st->seg[k] = st->seg[k - 1];
	st->seg[0] = g;
	if (st->nsegs < MP_LAYER_HISTORY)
		st->nsegs += 1;
	st->open = 1;
	/* A keyframe: every temporal layer can start here. */
	st->temporal_current = st->temporal_target;
}

/* LayerRewriter::cut_segment: the newest packet of a dropped frame, the current segment ends
 * before it. Under the lock, with nsegs > 0. */
static __always_inline void layer_cut(struct mp_layer_state *st, const struct mp_layer_pkt *in)
{
	__u16 s = in->seq;
	struct mp_layer_segment *g = &st->seg[0];
	if (!(st->cut & MP_CUT)) {
		seg_reach(g, s - 1);
		st->cut = MP_CUT;
		st->cut_next_seq = s + g->seq_offset;
		if (in->pic_at) {
			st->cut |= MP_CUT_PICTURES;
			st->cut_next_pic = (in->pic + g->pic_offset) & 0x7fff;
			st->cut_resume_pic = 0;
		}
	}
	st->cut_resume_seq = s + 1;
	if ((st->cut & MP_CUT_PICTURES) && in->pic_at)
		st->cut_resume_pic = (in->pic + 1) & 0x7fff;
}

/* LayerRewriter::continue_segment: the first kept packet after a cut. Under the lock, nsegs > 0. */
static __always_inline void layer_continue(struct mp_layer_state *st, const struct mp_layer_pkt *in)
{
	struct mp_layer_segment c = st->seg[0];
	/* The first packet of the picture after the last one dropped: what lies between was the rest
	 * of that picture. */
	__u16 mask = in->pic_wide ? 0x7fff : 0x7f;
	if (in->frame_start && (st->cut & MP_CUT_PICTURES) && in->pic_at && (in->pic & mask) == (st->cut_resume_pic & mask))
		st->cut_resume_seq = in->seq;
	if (st->cut & MP_CUT_PICTURES)
		c.pic_offset = (__u16)(st->cut_next_pic - st->cut_resume_pic) & 0x7fff;
	c.start = st->cut_resume_seq;
	c.highest = st->cut_resume_seq;
	c.seq_offset = st->cut_next_seq - st->cut_resume_seq;
	st->cut = 0;
	for (__u32 k = MP_LAYER_HISTORY - 1; k > 0; k--)
		st->seg[k] = st->seg[k - 1];
	st->seg[0] = c;
	if (st->nsegs < MP_LAYER_HISTORY)
		st->nsegs += 1;
}

/* LayerRewriter::on_packet for a packet of `layer`, under the lock. */
static __always_inline int layer_on_packet(struct mp_layer_state *st, __u32 layer, const struct mp_layer_pkt *in, __u64 now,
					   struct mp_layer_out *out)
{
	if (layer >= MP_MAX_LAYERS)
		return MP_LAYER_OTHER_LAYER;
	__u16 s = in->seq;
	__u8 bit = 1 << layer;
	int is_newest = !(st->newest_set & bit) || seq_newer(s, st->newest[layer & 3]);
	if (is_newest) {
		st->newest[layer & 3] = s;
		st->newest_set |= bit;
	}
	int current = st->nsegs > 0 && st->open ? st->seg[0].layer : MP_LAYER_NONE;
	/* The segment it belongs to; emit has one call site (the verifier walks it once). */
	int found = -1;
	if (st->target == layer && current != (int)layer && in->keyframe_start && is_newest) {
		layer_open_segment(st, layer, in, now);
		found = 0;
	} else if (is_newest && current == (int)layer) {
		/* Temporal layers, decided on the newest packet of the layer received (which belongs
		 * to the open segment, or continues a cut one). */
		if (in->frame_start) {
			/* Down at once; up only at a sync frame, to its layer (follow_temporal_target). */
			__u8 tid = in->temporal & 3;
			if (!in->temporal || st->temporal_target < st->temporal_current)
				st->temporal_current = st->temporal_target;
			else if ((in->temporal & MP_TID_SYNC) && tid > st->temporal_current && tid <= st->temporal_target)
				st->temporal_current = tid;
		}
		if (in->temporal && (in->temporal & 3) > st->temporal_current) {
			layer_cut(st, in);
			st->temporal_dropped += 1;
			return MP_LAYER_TEMPORAL;
		}
		if (st->cut)
			layer_continue(st, in);
		found = 0;
	} else {
		for (__u32 i = 0; i < MP_LAYER_HISTORY; i++) {
			if (i >= st->nsegs)
				break;
			struct mp_layer_segment *g = &st->seg[i];
			if (g->layer != layer)
				continue;
			int after_start = !seq_newer(g->start, s);
			int open = i == 0 && st->open && !st->cut;
			int belongs = open ? after_start : after_start && !seq_newer(s, g->highest);
			if (belongs) {
				found = i;
				break;
			}
		}
	}
	if (found >= 0)
		return layer_emit(st, found, in, now, out);
	if (st->target == MP_LAYER_NONE)
		return MP_LAYER_PAUSED;
	return st->nsegs == 0 ? MP_LAYER_WAITING_KEYFRAME : MP_LAYER_OTHER_LAYER;
}

/* Decide one packet of `layer` for `consumer`: MP_LAYER_FORWARD with `out` filled, or why not.
 * The functions called per copy are global: the verifier checks each once, on its own. */
__noinline int layer_decide(__u32 consumer, __u32 layer, const struct mp_layer_pkt *in, __u64 now, struct mp_layer_out *out)
{
	if (!in || !out)
		return MP_LAYER_INVALID;
	struct mp_layer_state *st = bpf_map_lookup_elem(&layer_state, &consumer);
	if (!st)
		return MP_LAYER_NO_STATE;
	bpf_spin_lock(&st->lock);
	int v = layer_on_packet(st, layer, in, now, out);
	bpf_spin_unlock(&st->lock);
	return v;
}

/* LayerRewriter::set_target and set_temporal (the keyframe request interval is user space's):
 * `arg` is the target layer (MP_LAYER_NONE: pause) | the temporal ceiling << 8
 * (MP_TEMPORAL_ALL: none). */
__noinline int layer_set_target(__u32 consumer, __u32 arg)
{
	__u8 target = arg, temporal = arg >> 8;
	struct mp_layer_state *st = bpf_map_lookup_elem(&layer_state, &consumer);
	if (!st)
		return MP_LAYER_NO_STATE;
	bpf_spin_lock(&st->lock);
	st->temporal_target = temporal;
	if (st->target != target) {
		st->target = target;
		if (target == MP_LAYER_NONE)
			st->open = 0;
	}
	bpf_spin_unlock(&st->lock);
	return MP_LAYER_FORWARD;
}

/* One byte changed from a to b at an offset of parity `odd` from the UDP header: the difference
 * of the one's complement sum (~old + new), in the byte order bpf_l4_csum_replace adds it in:
 * 16-bit words as loaded from the packet natively (on a little-endian CPU the byte at an even
 * offset is a word's low half). */
static __always_inline __u32 csum_byte(__u8 a, __u8 b, int odd)
{
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
	int high = odd;
#else
	int high = !odd;
#endif
	__u32 o = high ? (__u32)a << 8 : a, n = high ? (__u32)b << 8 : b;
	return (~o & 0xffff) + n;
}

/* The fields of a packet's RTP header that copies rewrite, as they are now. */
struct mp_layer_cur {
	__u8 hdr[10]; /* RTP bytes 2..12: sequence number, timestamp, SSRC */
	__u8 pic[2];
	__u8 tl0;
	__u8 pad[3];
};

/* A packet's RTP fields as copies rewrite them: where they are, what is there now, and what
 * the next copy writes. */
struct mp_layer_edit {
	struct mp_layer_pkt in;
	struct mp_layer_cur cur;  /* as the previous copy left them */
	struct mp_layer_cur next; /* layer_write's scratch */
};

/* Write `o` into the RTP packet at `off` and into e->cur. With `family` (MP_FAMILY_*; 0: no
 * checksum to keep, layer_ctl) the UDP checksum (at off - 2) by the difference: a no-op under
 * CHECKSUM_PARTIAL, a zero IPv4 checksum stays zero, a computed zero goes out as 0xffff. Offsets from the UDP header have the parity
 * of offsets from the RTP header (which starts 8 bytes after it). Its bytes are built in e, not
 * on the stack: this frame adds to the fan-out's call chain, near the 512-byte limit. */
__noinline int layer_write(struct __sk_buff *skb, __u32 off, __u32 family, struct mp_layer_edit *e, const struct mp_layer_out *o)
{
	if (!e || !o)
		return -1;
	struct mp_layer_cur *n = &e->next, *c = &e->cur;
	__u32 pic_at = e->in.pic_at, tl0_at = e->in.tl0_at, wide = e->in.pic_wide;
	n->hdr[0] = o->seq >> 8;
	n->hdr[1] = o->seq;
	n->hdr[2] = o->ts >> 24;
	n->hdr[3] = o->ts >> 16;
	n->hdr[4] = o->ts >> 8;
	n->hdr[5] = o->ts;
	n->hdr[6] = o->ssrc >> 24;
	n->hdr[7] = o->ssrc >> 16;
	n->hdr[8] = o->ssrc >> 8;
	n->hdr[9] = o->ssrc;
	n->pic[0] = wide ? 0x80 | ((o->pic >> 8) & 0x7f) : o->pic & 0x7f;
	n->pic[1] = o->pic;
	n->tl0 = o->tl0;
	__u32 delta = 0;
	for (int k = 0; k < 10; k++)
		delta += csum_byte(c->hdr[k], n->hdr[k], k & 1);
	if (pic_at) {
		delta += csum_byte(c->pic[0], n->pic[0], pic_at & 1);
		if (wide)
			delta += csum_byte(c->pic[1], n->pic[1], (pic_at + 1) & 1);
	}
	if (tl0_at)
		delta += csum_byte(c->tl0, n->tl0, tl0_at & 1);
	*c = *n;
	if (bpf_skb_store_bytes(skb, off + 2, c->hdr, 10, 0))
		return -1;
	if (pic_at && bpf_skb_store_bytes(skb, off + pic_at, c->pic, wide ? 2 : 1, 0))
		return -1;
	if (tl0_at && bpf_skb_store_bytes(skb, off + tl0_at, &c->tl0, 1, 0))
		return -1;
	/* BPF_F_MARK_MANGLED_0: an IPv4 zero ("none") stays, a result of zero is sent as 0xffff
	 * (RFC 768; on IPv6 zero is never valid, RFC 8200). */
	if (family && bpf_l4_csum_replace(skb, off - 2, 0, delta, BPF_F_MARK_MANGLED_0))
		return -1;
	return 0;
}

/* A simulcast packet's edit and the current copy's values, per CPU: off the stack, which the
 * fan-out's call chain has nearly used up. One program run uses it from the inspection to its
 * last copy; no other run on this CPU comes in between (copies leave through queues, and the
 * program hooks only ingress). */
struct mp_layer_scratch {
	struct mp_layer_edit le;
	struct mp_layer_out lo;
};

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct mp_layer_scratch);
} layer_scratch SEC(".maps");

/* cur from the packet as it arrived. */
static __always_inline int layer_cur_init(struct __sk_buff *skb, __u32 off, const struct mp_layer_pkt *in, struct mp_layer_cur *cur)
{
	__builtin_memset(cur, 0, sizeof(*cur));
	if (bpf_skb_load_bytes(skb, off + 2, cur->hdr, 10))
		return -1;
	if (in->pic_at && bpf_skb_load_bytes(skb, off + in->pic_at, cur->pic, in->pic_wide ? 2 : 1))
		return -1;
	if (in->tl0_at && bpf_skb_load_bytes(skb, off + in->tl0_at, &cur->tl0, 1))
		return -1;
	return 0;
}

#endif
