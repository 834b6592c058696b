/* The XDP program of PASSING's AF_XDP path (host/csrc/xsk.c): an IPv4 UDP datagram to the port in
 * `passing_port` goes to the XSK socket of the queue it arrived on (`passing_xsks`, keyed by queue), and
 * everything else, or one whose queue has no socket, goes on to the kernel (XDP_PASS). Fragments go to the
 * kernel too: PASSING never fragments, so a fragment is not its.
 *
 * Built at install time by host/setup.py (clang -target bpf) and embedded in the library; never committed
 * compiled. */
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/in.h>
#include <linux/ip.h>
#include <linux/udp.h>
#include <bpf/bpf_endian.h>
#include <bpf/bpf_helpers.h>

struct {
    __uint(type, BPF_MAP_TYPE_XSKMAP);
    __uint(max_entries, 64);
    __type(key, __u32);
    __type(value, __u32);
} passing_xsks SEC(".maps");

struct {
    __uint(type, BPF_MAP_TYPE_ARRAY);
    __uint(max_entries, 1);
    __type(key, __u32);
    __type(value, __u32); /* the UDP port, host byte order; 0: none */
} passing_port SEC(".maps");

SEC("xdp")
int passing_steer(struct xdp_md *ctx) {
    void *data = (void *)(long)ctx->data;
    void *end = (void *)(long)ctx->data_end;
    struct ethhdr *eth = data;
    if ((void *)(eth + 1) > end || eth->h_proto != bpf_htons(ETH_P_IP)) return XDP_PASS;
    struct iphdr *ip = (void *)(eth + 1);
    if ((void *)(ip + 1) > end || ip->version != 4 || ip->ihl < 5 || ip->protocol != IPPROTO_UDP) return XDP_PASS;
    if (ip->frag_off & bpf_htons(0x3FFF)) return XDP_PASS; /* MF set or an offset: a fragment */
    struct udphdr *udp = (void *)ip + ip->ihl * 4;
    if ((void *)(udp + 1) > end) return XDP_PASS;
    __u32 key = 0;
    __u32 *port = bpf_map_lookup_elem(&passing_port, &key);
    if (!port || *port == 0 || bpf_ntohs(udp->dest) != *port) return XDP_PASS;
    return bpf_redirect_map(&passing_xsks, ctx->rx_queue_index, XDP_PASS);
}

char LICENSE[] SEC("license") = "Dual BSD/GPL";
