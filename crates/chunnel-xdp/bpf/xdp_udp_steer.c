// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// chunnel-xdp: steer one UDP destination (IPv4 address + port) to an AF_XDP socket.
//
// Every frame is classified; IPv4/UDP frames whose destination port (and address, when one
// is configured) match `config` are redirected to the XSK registered at `xsks[rx_queue]`;
// everything else (ARP, other ports, IPv6, fragments) goes to the kernel with XDP_PASS, so
// ARP and other applications keep working on the interface.
//
// Per-verdict counters live in `counters` (a per-CPU array) so user space and tests can see
// exactly where packets went.
//
// Built by build.rs (or scripts/build-bpf.sh) with:
//   clang -O2 -g -target bpf -I/usr/include/x86_64-linux-gnu -c xdp_udp_steer.c -o xdp_udp_steer.o
// Only kernel UAPI headers (linux-libc-dev) are needed: the few libbpf helper macros used are
// defined below, so libbpf-dev is not required.

#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>

#define SEC(name) __attribute__((section(name), used))
#define __uint(name, val) int (*name)[val]
#define __type(name, val) typeof(val) *name
#define XDP_INLINE inline __attribute__((always_inline))

static void *(*bpf_map_lookup_elem)(void *map, const void *key) = (void *)BPF_FUNC_map_lookup_elem;
static long (*bpf_redirect_map)(void *map, __u64 key, __u64 flags) = (void *)BPF_FUNC_redirect_map;

// Counter slots (keep in sync with src/bpf.rs).
enum {
	CNT_RX_TOTAL = 0,   // every frame the program saw
	CNT_REDIRECTED = 1, // matched and handed to the XSK
	CNT_PASS_OTHER = 2, // not ours: passed to the kernel
	CNT_NO_SOCKET = 3,  // matched, but no XSK on this queue: passed to the kernel
	CNT_MAX = 4,
};

struct config {
	__u32 ip;   // destination IPv4 address, network order; 0 = any
	__u16 port; // destination UDP port, network order; 0 = steer nothing
	__u16 pad;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, struct config);
} config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_XSKMAP);
	__uint(max_entries, 64);
	__type(key, __u32);
	__type(value, __u32);
} xsks SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, CNT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} counters SEC(".maps");

static XDP_INLINE void count(__u32 slot)
{
	__u64 *v = bpf_map_lookup_elem(&counters, &slot);
	if (v)
		*v += 1; // per-CPU slot: no atomic needed
}

SEC("xdp")
int xdp_udp_steer(struct xdp_md *ctx)
{
	void *data = (void *)(long)ctx->data;
	void *data_end = (void *)(long)ctx->data_end;
	__u32 zero = 0;

	count(CNT_RX_TOTAL);

	struct config *cfg = bpf_map_lookup_elem(&config, &zero);
	if (!cfg || cfg->port == 0)
		goto pass;

	struct ethhdr *eth = data;
	if ((void *)(eth + 1) > data_end || eth->h_proto != __builtin_bswap16(ETH_P_IP))
		goto pass;

	struct iphdr *ip = (void *)(eth + 1);
	if ((void *)(ip + 1) > data_end || ip->version != 4 || ip->ihl < 5 ||
	    ip->protocol != IPPROTO_UDP)
		goto pass;
	// Fragments (MF set or a non-zero offset) go to the kernel, which reassembles them.
	if (ip->frag_off & __builtin_bswap16(0x3fff))
		goto pass;
	if (cfg->ip != 0 && ip->daddr != cfg->ip)
		goto pass;

	struct udphdr *udp = (void *)ip + ip->ihl * 4;
	if ((void *)(udp + 1) > data_end || udp->dest != cfg->port)
		goto pass;

	// Lower two bits of flags = the action when the map has no socket at this key.
	if (bpf_redirect_map(&xsks, ctx->rx_queue_index, 0) == XDP_REDIRECT) {
		count(CNT_REDIRECTED);
		return XDP_REDIRECT;
	}
	count(CNT_NO_SOCKET);
	return XDP_PASS;

pass:
	count(CNT_PASS_OTHER);
	return XDP_PASS;
}

char LICENSE[] SEC("license") = "Dual MIT/GPL";
