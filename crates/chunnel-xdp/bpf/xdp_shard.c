// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// chunnel-xdp: XDP sharding offload for the chunnel-kv wire format.
//
// Two programs share the maps of this object:
//
// * `xdp_shard` (XDP, server interface ingress): an IPv4/UDP datagram to the *steering port*
//   (`config.steer_port`, at `config.ip` or any address when 0) carries one bincode-encoded
//   `chunnel_kv::Msg::Request` (no negotiation tag: the client's per-shard stack is
//   `Serialize<bincode> | UDP`). The program reads the key, computes
//   `fnv1a64(key) % config.shards` -- the same function as `chunnel_std::shard::shard_of` --,
//   rewrites the UDP destination port to that shard's port (`shard_ports[shard]`), zeroes the
//   UDP checksum (legal for IPv4; the port changed and, on veth, the field holds only a
//   partial pseudo-header sum anyway) and returns XDP_PASS: the kernel delivers the request
//   straight to the shard's own socket. It records the sender (address, port) in `flows`.
// * `tc_shard_egress` (tc/TCX, same interface egress): a UDP datagram leaving a shard port
//   (`is_shard_port`) for a sender recorded in `flows` gets its source port rewritten back
//   to the steering port, so the client's connected UDP socket (connected to the steering
//   address) accepts the reply. Replies to other peers (client-push clients that talk to
//   the shard ports themselves) are untouched.
//
// Wire format parsed (bincode 2, `config::standard()`: little endian varints -- a value
// < 251 is one byte; 251, 252, 253 announce a u16, u32, u64 that follows):
//   varint(variant = 0: Request) varint(client u64) varint(id u64)
//   varint(op variant: 0 Get, 1 Put, 2 Delete) varint(key length) key bytes ...
// A datagram to the steering port that does not parse, or whose key is longer than
// MAX_KEY, is counted and passed unchanged (no socket listens on the steering port, so the
// kernel drops it; the client's retry fails the same way and it times out).
//
// Built by build.rs with:
//   clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c xdp_shard.c -o xdp_shard.o

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/pkt_cls.h>
#include <linux/udp.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name
#define XDP_INLINE inline __attribute__((always_inline))
#define offsetof(t, m) __builtin_offsetof(t, m)

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_map_update_elem)(void *map, const void *key, const void *value,
				   __u64 flags) = (void *)BPF_FUNC_map_update_elem;
static long (*bpf_skb_store_bytes)(struct __sk_buff *skb, __u32 offset, const void *from,
				   __u32 len, __u64 flags) = (void *)BPF_FUNC_skb_store_bytes;
static long (*bpf_l4_csum_replace)(struct __sk_buff *skb, __u32 offset, __u64 from, __u64 to,
				   __u64 flags) = (void *)BPF_FUNC_l4_csum_replace;

#define MAX_SHARDS 64
#define MAX_KEY 256

// Counter slots (keep in sync with src/shard.rs).
enum {
	CNT_RX_TOTAL = 0,  // every frame the XDP program saw
	CNT_STEERED = 1,   // requests steered to a shard
	CNT_PASS_OTHER = 2, // not for the steering port: passed unchanged
	CNT_MALFORMED = 3, // for the steering port, but did not parse / key too long / no config
	CNT_EGRESS_REWRITTEN = 4, // replies whose source port became the steering port
	CNT_MAX = 5,
};

struct config {
	__u32 ip;         // steering IPv4 address, network order; 0 = any
	__u16 steer_port; // network order; 0 = off
	__u16 pad;
	__u32 shards;     // 1..=MAX_SHARDS
	__u32 pad2;
};

struct flow {
	__u32 ip;   // client address, network order
	__u16 port; // client port, network order
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

// Shard index -> UDP port (network order).
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, MAX_SHARDS);
	__type(key, __u32);
	__type(value, __u32);
} shard_ports SEC(".maps");

// UDP port (network order, as u32) -> 1, for the egress program.
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, MAX_SHARDS);
	__type(key, __u32);
	__type(value, __u32);
} is_shard_port SEC(".maps");

// Senders seen on the steering port.
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, struct flow);
	__type(value, __u32);
} flows SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

// Requests steered, by shard index.
struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, MAX_SHARDS);
	__type(key, __u32);
	__type(value, __u64);
} steered SEC(".maps");

static XDP_INLINE void count(void *map, __u32 slot)
{
	__u64 *v = bpf_map_lookup_elem(map, &slot);
	if (v)
		*v += 1; // per-CPU slot: no atomic needed
}

// Skips one bincode varint at payload offset *off; returns its value's low 32 bits through
// *val, or -1 if the datagram ends first. `off` stays bounded (< 64) for the verifier.
static XDP_INLINE int varint(__u8 *p, void *end, __u32 *off, __u32 *val)
{
	__u32 o = *off & 63;
	__u8 *b = p + o;
	if ((void *)(b + 1) > end)
		return -1;
	__u8 tag = b[0];
	if (tag < 251) {
		*val = tag;
		*off = o + 1;
		return 0;
	}
	if (tag == 251) {
		if ((void *)(b + 3) > end)
			return -1;
		*val = (__u32)b[1] | ((__u32)b[2] << 8);
		*off = o + 3;
		return 0;
	}
	if (tag == 252) {
		if ((void *)(b + 5) > end)
			return -1;
		*val = (__u32)b[1] | ((__u32)b[2] << 8) | ((__u32)b[3] << 16) | ((__u32)b[4] << 24);
		*off = o + 5;
		return 0;
	}
	if (tag == 253) {
		if ((void *)(b + 9) > end)
			return -1;
		// Only the low 32 bits are kept (the caller uses varints > 32 bits only to skip).
		*val = (__u32)b[1] | ((__u32)b[2] << 8) | ((__u32)b[3] << 16) | ((__u32)b[4] << 24);
		if (b[5] | b[6] | b[7] | b[8])
			*val = 0xffffffff;
		*off = o + 9;
		return 0;
	}
	return -1; // 254 (u128) never appears in a request
}

SEC("xdp")
int xdp_shard(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;

	count(&counters, CNT_RX_TOTAL);

	struct config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || cfg->steer_port == 0)
		goto pass;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != __builtin_bswap16(ETH_P_IP))
		goto pass;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl != 5 ||
	    ip->protocol != IPPROTO_UDP)
		goto pass;
	if (ip->frag_off & __builtin_bswap16(0x3fff))
		goto pass;
	if (cfg->ip != 0 && ip->daddr != cfg->ip)
		goto pass;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end || udp->dest != cfg->steer_port)
		goto pass;

	// From here on the datagram is ours: steer it or count it malformed.
	__u32 shards = cfg->shards;
	if (shards == 0 || shards > MAX_SHARDS)
		goto malformed;
	__u8 *p = (void *)(udp + 1);
	__u32 off = 0, v = 0;
	if (varint(p, data_end, &off, &v) || v != 0) // Msg::Request
		goto malformed;
	if (varint(p, data_end, &off, &v)) // client
		goto malformed;
	if (varint(p, data_end, &off, &v)) // id
		goto malformed;
	if (varint(p, data_end, &off, &v) || v > 2) // op
		goto malformed;
	__u32 klen = 0;
	if (varint(p, data_end, &off, &klen) || klen > MAX_KEY)
		goto malformed;
	// Byte offset of the key from the start of the frame, bounded for the verifier; each
	// byte is bounds-checked on its own (the mask keeps clang from turning the checks into
	// arithmetic on data_end, which the verifier refuses).
	__u32 base = (__u32)((void *)p - data) + (off & 63);
	__u64 h = 0xcbf29ce484222325ULL;
	for (__u32 i = 0; i < MAX_KEY; i++) {
		if (i >= klen)
			break;
		__u32 o = (base + i) & 0x7ff;
		__u8 *b = data + o;
		if ((void *)(b + 1) > data_end)
			goto malformed;
		h ^= *b;
		h *= 0x100000001b3ULL;
	}
	__u32 shard = h % shards;
	__u32 *port = bpf_map_lookup_elem(&shard_ports, &shard);
	if (!port || *port == 0)
		goto malformed;

	struct flow f = {.ip = ip->saddr, .port = udp->source, .pad = 0};
	if (!bpf_map_lookup_elem(&flows, &f)) {
		__u32 one = 1;
		bpf_map_update_elem(&flows, &f, &one, BPF_ANY);
	}
	udp->dest = (__u16)*port;
	udp->check = 0;
	count(&steered, shard);
	count(&counters, CNT_STEERED);
	return XDP_PASS;

malformed:
	count(&counters, CNT_MALFORMED);
	return XDP_PASS;
pass:
	count(&counters, CNT_PASS_OTHER);
	return XDP_PASS;
}

#define ETH_LEN sizeof(struct ethhdr)
#define UDP_OFF (ETH_LEN + sizeof(struct iphdr))

SEC("classifier")
int tc_shard_egress(struct __sk_buff *skb)
{
	void *data = (void *)(long)skb->data;
	void *data_end = (void *)(long)skb->data_end;
	__u32 zero = 0;

	struct config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || cfg->steer_port == 0)
		return TC_ACT_OK;
	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != __builtin_bswap16(ETH_P_IP))
		return TC_ACT_OK;
	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl != 5 ||
	    ip->protocol != IPPROTO_UDP)
		return TC_ACT_OK;
	struct udphdr *udp = (void *)(ip + 1);
	if ((void *)(udp + 1) > data_end)
		return TC_ACT_OK;
	__u32 sport = udp->source;
	if (!bpf_map_lookup_elem(&is_shard_port, &sport))
		return TC_ACT_OK;
	struct flow f = {.ip = ip->daddr, .port = udp->dest, .pad = 0};
	if (!bpf_map_lookup_elem(&flows, &f))
		return TC_ACT_OK;

	__u16 old = udp->source;
	__u16 new = cfg->steer_port;
	// Ports are not part of the pseudo header: for CHECKSUM_PARTIAL this is a no-op (the
	// checksum is completed later over the new port), otherwise an incremental update.
	bpf_l4_csum_replace(skb, UDP_OFF + offsetof(struct udphdr, check), old, new,
			    BPF_F_MARK_MANGLED_0 | sizeof(__u16));
	bpf_skb_store_bytes(skb, UDP_OFF + offsetof(struct udphdr, source), &new, sizeof(new), 0);
	count(&counters, CNT_EGRESS_REWRITTEN);
	return TC_ACT_OK;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
