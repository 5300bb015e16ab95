// DSec egress enforcement: cgroup/sock_addr hooks shared by every sandbox on the node.
//
// One program set serves all sandboxes; every map is keyed by the sandbox's cgroup v2 id.
// Compiled by BCC (egress.py) with -DPIN_DIR="..." and the map sizes below as -D overrides.
// Reads UAPI contexts only (struct bpf_sock_addr), so any nearby kernel header package works.
//
// Verdicts and layouts here must match ebpf/maps.py (ctypes) and ebpf/model.py (enums).

#include <uapi/linux/bpf.h>

#ifndef PIN_DIR
#error "PIN_DIR must be defined"
#endif
#ifndef MAX_SANDBOXES
#define MAX_SANDBOXES 4096
#endif
#ifndef MAX_CIDRS
#define MAX_CIDRS 262144
#endif
#ifndef MAX_HOSTS
#define MAX_HOSTS 65536
#endif
#ifndef MAX_BUCKETS
#define MAX_BUCKETS 65536
#endif
#ifndef MAX_COUNTERS
#define MAX_COUNTERS 65536
#endif
#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif
// IP sockets one sandbox may hold, and all the node's sandboxes together (kernel.py derives the
// node's from the ephemeral port range: half of it, so the host always keeps the other half).
#ifndef MAX_SANDBOX_SOCKETS
#define MAX_SANDBOX_SOCKETS 4096
#endif
#ifndef MAX_NODE_SOCKETS
#define MAX_NODE_SOCKETS 14116
#endif
// The ports the node's DNS proxy listeners take (above the kernel's ephemeral range, so no
// autobind lands there); 0: no such range, the dns_ports map alone says which.
#ifndef PROXY_PORT_LO
#define PROXY_PORT_LO 0
#define PROXY_PORT_HI 0
#endif
// A cgroup nested inside a sandbox's cgroup (e.g. one made for `sandbox exec`) inherits the
// programs; we find its sandbox by walking ancestor ids up to this depth.
#define MAX_CGROUP_DEPTH 16

#define DNS_PORT 53
#define DOT_PORT 853
#define HTTPS_PORT 443

// Verdicts (model.Verdict).
#define V_ALLOW 1
#define V_DENY_NO_RULE 2
#define V_DENY_RATE_LIMIT 3
#define V_DENY_EXPIRED 4
#define V_DENY_UNKNOWN_SANDBOX 5
#define V_REDIRECT_DNS 6
#define V_DENY_DOH 7
#define V_DENY_STACK 8
#define V_DENY_PROTOCOL 9
#define V_DENY_BIND 10
#define V_DENY_SOCKETS 11

// Hooks (model.Hook).
#define H_CONNECT4 1
#define H_CONNECT6 2
#define H_SENDMSG4 3
#define H_SENDMSG6 4
#define H_BIND4 5
#define H_BIND6 6
#define H_SOCKET 7

// Sandbox flags (model.SandboxFlags).
#define SF_LOG_ALLOWED 1

// Allow-entry flags.
#define AF_HOST_EXACT 1  // entry names one address, not a range (DoH check skips it)
#define AF_TCP 2         // the entry opens TCP (stream) sockets
#define AF_UDP 4         // the entry opens UDP (datagram) sockets: only when a rule declares it

#define PROTO_TCP 6
#define PROTO_MPTCP 262

struct sbx_cfg {
    u32 proxy4;      // DNS proxy IPv4, network order
    u32 proxy6[4];   // DNS proxy IPv6, network order
    u32 proxy_port;  // DNS proxy port, network order (low 16 bits)
    u32 flags;
};

struct cidr4_key {
    u32 prefixlen;   // 64 (cgid) + 16 (port) + address prefix
    u64 cgid;
    u16 port;        // host order; 0 = any port
    u32 addr;        // network order
} __attribute__((packed));

struct cidr6_key {
    u32 prefixlen;
    u64 cgid;
    u16 port;
    u32 addr[4];
} __attribute__((packed));

struct host4_key {
    u64 cgid;
    u32 addr;
    u16 port;
    u16 pad;
};

struct host6_key {
    u64 cgid;
    u32 addr[4];
    u16 port;
    u16 pad[3];
};

struct allow_val {
    u32 rule;        // rule slot within the sandbox (1-based; 0 = no rule)
    u32 flags;       // AF_*
    u64 expires_ns;  // CLOCK_MONOTONIC deadline; 0 = never
};

struct bucket_key {
    u64 cgid;
    u32 rule;
    u32 pad;
};

// GCRA form of a token bucket: one timestamp instead of (tokens, last refill).
struct bucket {
    struct bpf_spin_lock lock;
    u32 pad;
    u64 tat;          // theoretical arrival time of the next conforming connect
    u64 interval_ns;  // time to earn one token
    u64 tau_ns;       // (burst - 1) * interval_ns
};

struct counter_key {
    u64 cgid;
    u32 rule;
    u32 verdict;
};

struct orig_dst {
    u32 ip6[4];      // original destination (IPv4 in ip6[3] when family == 4)
    u32 port;        // network order
    u32 family;      // 4 or 6
};

struct verdict_event {
    u64 ts_ns;
    u64 cgid;
    u32 pid;
    u32 rule;
    u8 verdict;
    u8 hook;
    u8 family;
    u8 proto;
    u16 port;        // host order
    u16 pad;
    u32 addr[4];     // network order; IPv4 in addr[0]
    char comm[16];
};

BPF_TABLE_PINNED("hash", u64, struct sbx_cfg, sandboxes, MAX_SANDBOXES, PIN_DIR "/sandboxes");
BPF_TABLE_PINNED("lpm_trie", struct cidr4_key, struct allow_val, cidr4, MAX_CIDRS,
                 PIN_DIR "/cidr4", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("lpm_trie", struct cidr6_key, struct allow_val, cidr6, MAX_CIDRS,
                 PIN_DIR "/cidr6", BPF_F_NO_PREALLOC);
BPF_TABLE_PINNED("hash", struct host4_key, struct allow_val, host4, MAX_HOSTS, PIN_DIR "/host4");
BPF_TABLE_PINNED("hash", struct host6_key, struct allow_val, host6, MAX_HOSTS, PIN_DIR "/host6");
// A spin lock needs a plain hash (an LRU hash refuses it with EOPNOTSUPP).
BPF_TABLE_PINNED("hash", struct bucket_key, struct bucket, buckets, MAX_BUCKETS,
                 PIN_DIR "/buckets");
BPF_TABLE_PINNED("percpu_hash", struct counter_key, u64, counters, MAX_COUNTERS,
                 PIN_DIR "/counters");
// Where each socket's DNS query really went (its reply is shown as coming from there): storage
// of the socket itself, freed with it. (An LRU hash keyed by socket cookie was node-wide: one
// sandbox making DNS sockets in a loop evicted its neighbours' entries, and their resolvers
// then dropped replies that seemed to come from the proxy.)
BPF_TABLE_PINNED7("sk_storage", int, struct orig_dst, dns_dst, 0, PIN_DIR "/dns_dst",
                  BPF_F_NO_PREALLOC);
// The peers each datagram socket was allowed to send to (connect or sendto), so the ingress
// program lets in only their replies: a socket the kernel bound by itself (the first sendto
// of a socket never bound) listens on every address, and took datagrams from anywhere. Storage
// of the socket itself (no sandbox evicts a neighbour's peers); the oldest of UDP_PEERS is
// replaced, and a peer not sent to for UDP_PEER_IDLE_NS is forgotten.
#define UDP_PEERS 8
#define UDP_PEER_IDLE_NS (300ULL * 1000000000ULL)
struct udp_peer {
    u32 addr[4];     // network order; IPv4 (also ::ffff:a.b.c.d) in addr[3], family 4
    u16 port;        // network order
    u16 family;      // 4 or 6; 0: an empty slot
    u32 pad;
    u64 seen_ns;     // the last datagram sent to it (CLOCK_MONOTONIC)
};
struct udp_peers {
    struct udp_peer peer[UDP_PEERS];
};
BPF_TABLE_PINNED7("sk_storage", int, struct udp_peers, udp_peers, 0, PIN_DIR "/udp_peers",
                  BPF_F_NO_PREALLOC);
// Well-known DoH/DoT resolver addresses; IPv4 as ::a.b.c.d (addr[3]).
struct doh_key {
    u32 addr[4];
};
BPF_TABLE_PINNED("hash", struct doh_key, u32, doh, 1024, PIN_DIR "/doh");
// The stack's own servers (NATS, Postgres, S3, OpenBao, metrics): denied to every sandbox
// whatever its rules say. Keyed (address, port); IPv4 as ::a.b.c.d like doh. Loopback and
// unspecified destinations are also looked up as 127.0.0.1 / ::1 (a server bound to 0.0.0.0 is
// reachable on every loopback address).
struct stack_key {
    u32 addr[4];
    u32 port;  // host order
};
BPF_TABLE_PINNED("hash", struct stack_key, u32, stack_deny, 4096, PIN_DIR "/stack_deny");
// The ports of the node's DNS proxy listeners (one per sandbox, on loopback; host order):
// no sandbox binds one, also while the node agent restarts and its listener is gone (pinned).
BPF_TABLE_PINNED("hash", u32, u32, dns_ports, MAX_SANDBOXES, PIN_DIR "/dns_ports");
// The node agent's loopback listeners that serve one sandbox alone (its HTTPS proxy), by port
// (host order) -> that sandbox's cgroup id: no other sandbox reaches one, whatever its rules
// (a neighbour whose rules open loopback kept the proxy busy telling its connections apart).
BPF_TABLE_PINNED("hash", u32, u64, private_ports, MAX_SANDBOXES, PIN_DIR "/private_ports");
// IP sockets each sandbox holds (created and not yet released), by cgroup id; key 0: all the
// node's sandboxes together. A sandbox shares the host's network namespace, so each socket it
// binds takes one of the host's ports: one sandbox binding every ephemeral port (57 processes
// of 1,000 sockets) left the node and its neighbours none to connect or send from.
// A TCP connection closed first by its own side keeps its port in TIME_WAIT for a minute
// (TCP_TIMEWAIT_LEN), released or not: a sandbox connecting and closing in a loop held every
// ephemeral port toward one destination with a handful of live sockets. Each connection that
// enters TIME_WAIT (seen by the sock_state program, whatever got it there: close(),
// shutdown() and the peer's FIN, one socket connected again after connect(AF_UNSPEC)) counts,
// in the 4-second slot it entered, for TW_SLOTS slots (64 s >= the kernel's 60 s): what the
// kernel still holds, a burst included.
#define TW_SLOTS 16
#define TW_SLOT_NS 4000000000ULL
struct sock_use {
    u64 live;                // sockets created and not yet released
    u32 closed[TW_SLOTS];    // connections that entered TIME_WAIT in the slot...
    u32 slot[TW_SLOTS];      // ...numbered now / TW_SLOT_NS
};
BPF_TABLE_PINNED("hash", u64, struct sock_use, sock_use, MAX_SANDBOXES + 1,
                 PIN_DIR "/sock_use");
// The last quarter of the node's budget is kept for sandboxes holding fewer than this: a few
// sandboxes with many sockets cannot leave their neighbours none.
#define SMALL_SHARE 256
// A socket's place (storage of the socket itself, not copied to accepted sockets), so whoever
// closes it gives the place back to the count it was taken from. A socket holds a place while
// the sandbox has not released it or while a connection it made is open: a connection holds
// its port past the release until the kernel is done with it (FIN_WAIT, LAST_ACK; then
// TIME_WAIT, counted apart). (64-bit fields: the BPF atomic exchange is 64-bit only here.)
struct sock_hold {
    u64 origin;      // the sandbox's cgroup id
    u64 counted;     // holds a place in the counts now (exchanged: given back once)
    u64 unreleased;  // made, or taken a port of its own, in the sandbox and not yet released
    u64 conn;        // a connection of it is open (sock_state, under the socket's lock)
    u64 connected;   // connect() was called on it: one again (after connect(AF_UNSPEC)) takes
                     // another port while the last may still be in TIME_WAIT (bounded alike)
    u64 listener;    // an accepted socket's connection: its listener's cookie (listen_use)
};
BPF_TABLE_PINNED7("sk_storage", int, struct sock_hold, sock_hold, 0, PIN_DIR "/sock_hold",
                  BPF_F_NO_PREALLOC);
// The sandbox and the listener of a socket, copied to the sockets it accepts (BPF_F_CLONE): an
// accepted connection shares its listener's port and takes no place of its own; the listener
// keeps its place while any of them is open (after its own release too), and a minute more
// when the last one ended in TIME_WAIT. However many connect to it, a listener is one port.
struct sock_link {
    u64 origin;
    u64 cookie;  // the listener's socket cookie (on the listener itself: its own)
};
BPF_TABLE_PINNED7("sk_storage", int, struct sock_link, sock_link, 0, PIN_DIR "/sock_link",
                  BPF_F_NO_PREALLOC | BPF_F_CLONE);
struct listen_use {
    u64 origin;
    s64 children;    // accepted connections open
    u64 holds;       // the released listener's place is held here (exchanged: once)
    u64 released;    // the listener was released
    u64 last_tw_ns;  // when one of its connections last entered TIME_WAIT
};
BPF_TABLE_PINNED("hash", u64, struct listen_use, listen_use, MAX_NODE_SOCKETS,
                 PIN_DIR "/listen_use");

// Connections of a count still in TIME_WAIT (entered within the last TW_SLOTS slots).
static __always_inline u64 lingering(struct sock_use *u, u64 now) {
    u32 current = now / TW_SLOT_NS;
    u64 sum = 0;
#pragma unroll
    for (int i = 0; i < TW_SLOTS; i++)
        if (current - u->slot[i] < TW_SLOTS)
            sum += u->closed[i];
    return sum;
}

// (a release racing another can take a count below zero for a moment: read as none)
static __always_inline u64 live_of(struct sock_use *u) {
    u64 live = u->live;
    return (s64)live < 0 ? 0 : live;
}

static __always_inline void linger_one(struct sock_use *u, u64 now) {
    u32 current = now / TW_SLOT_NS;
    u32 i = current & (TW_SLOTS - 1);
    if (u->slot[i] != current) {  // (CPUs racing at a slot's turn may lose one: a count)
        u->closed[i] = 0;
        u->slot[i] = current;
    }
    __sync_fetch_and_add(&u->closed[i], 1);
}

// Whether one more port-holding socket (or connection) would pass a sandbox's bound or the
// node's, or take the node's last quarter from a sandbox that holds many already.
static __always_inline int over_budget(struct sock_use *mine, struct sock_use *node) {
    u64 now = bpf_ktime_get_ns();
    u64 mine_use = live_of(mine) + lingering(mine, now);
    u64 node_use = live_of(node) + lingering(node, now);
    return mine_use >= MAX_SANDBOX_SOCKETS || node_use >= MAX_NODE_SOCKETS ||
           (node_use >= MAX_NODE_SOCKETS / 4 * 3 && mine_use >= SMALL_SHARE);
}

// The counts a socket of sandbox `cgid` moves: the node's always (a purged sandbox's sockets
// still hold the host's ports), the sandbox's while it is registered (a purged one has no count
// left; and every program of ours reads the sandboxes map: that is how an agent tells its
// programs from others', kernel.py _ours). Either may be 0 (none).
static __always_inline struct sock_use *node_count(void) {
    u64 node_key = 0;
    return sock_use.lookup(&node_key);
}
static __always_inline struct sock_use *own_count(u64 cgid) {
    return sandboxes.lookup(&cgid) ? sock_use.lookup(&cgid) : 0;
}

// Move one place of sandbox `cgid` in the counts (+1 or -1).
static __always_inline void count_place(u64 cgid, s64 delta) {
    struct sock_use *node = node_count(), *mine = own_count(cgid);
    if (node)
        __sync_fetch_and_add(&node->live, delta);
    if (mine)
        __sync_fetch_and_add(&mine->live, delta);
}

// A port kept a minute more by a connection in TIME_WAIT, in the counts of sandbox `cgid`.
static __always_inline void count_linger(u64 cgid) {
    struct sock_use *node = node_count(), *mine = own_count(cgid);
    u64 now = bpf_ktime_get_ns();
    if (node)
        linger_one(node, now);
    if (mine)
        linger_one(mine, now);
}

// Take a socket's place (take: 1) or give it back (0), once each way (the exchange on
// `counted` decides: whoever comes last of a release and a connection's end gives it back).
static __always_inline void move_place(struct sock_hold *hold, u64 take) {
    if (__sync_lock_test_and_set(&hold->counted, take) != take)
        count_place(hold->origin, take ? 1 : -1);
}

// A released listener whose last accepted connection has ended gives its place back, with a
// minute more when a connection of it entered TIME_WAIT within the last (its port is kept).
static __always_inline void settle_listener(u64 key, struct listen_use *l) {
    if (__sync_lock_test_and_set(&l->holds, 0) != 1)
        return;
    count_place(l->origin, -1);
    if (l->last_tw_ns && bpf_ktime_get_ns() - l->last_tw_ns < TW_SLOTS * TW_SLOT_NS)
        count_linger(l->origin);
    listen_use.delete(&key);
}

// A socket of the sandbox that holds no place takes one, within the budget, before it takes a
// port of its own (an accepted socket bound or connected again after connect(AF_UNSPEC)); a
// stream socket's connect() again takes another port while its last may be in TIME_WAIT.
// 1: over the budget (refused). Runs under the socket's lock.
static __always_inline int port_over(struct bpf_sock *sk, u64 cgid, int connecting) {
    if (!sk)
        return 0;
    struct sock_hold *hold = sock_hold.sk_storage_get(sk, 0, 0);
    if (!hold || !hold->origin || hold->conn)
        return 0;  // (created before the count; or connected: the kernel refuses it anyway)
    int first = hold->counted && !(connecting && hold->connected);
    if (connecting)
        hold->connected = 1;
    if (first)
        return 0;
    struct sock_use *mine = sock_use.lookup(&cgid), *node = node_count();
    if (!mine || !node || over_budget(mine, node))
        return 1;
    if (!hold->counted) {
        __sync_lock_test_and_set(&hold->unreleased, 1);  // its release gives it back
        move_place(hold, 1);
    }
    return 0;
}

static __always_inline int reconnect_over(struct bpf_sock_addr *ctx, u64 cgid) {
    return ctx->type == 1 /* SOCK_STREAM */ && port_over(ctx->sk, cgid, 1);
}


// BPF_RINGBUF_OUTPUT, but pinned, so a restarted agent reads the same buffer.
struct events_table_t {
    int key;
    u32 leaf;
    int (*ringbuf_output)(void *, u64, u64);
    void *(*ringbuf_reserve)(u64);
    void (*ringbuf_discard)(void *, u64);
    void (*ringbuf_submit)(void *, u64);
    u32 max_entries;
};
__attribute__((section("maps/ringbuf:" PIN_DIR "/events")))
struct events_table_t events = {.max_entries = RINGBUF_PAGES * PAGE_SIZE};

static __always_inline struct sbx_cfg *find_sandbox(u64 *cgid) {
    u64 id = bpf_get_current_cgroup_id();
    struct sbx_cfg *cfg = sandboxes.lookup(&id);
    if (cfg) {
        *cgid = id;
        return cfg;
    }
    // Slow path: the deepest registered ancestor (nested cgroups inherit the programs).
    struct sbx_cfg *found = 0;
#pragma unroll
    for (int level = 1; level < MAX_CGROUP_DEPTH; level++) {
        u64 anc = bpf_get_current_ancestor_cgroup_id(level);
        if (anc == 0)
            break;
        struct sbx_cfg *c = sandboxes.lookup(&anc);
        if (c) {
            found = c;
            *cgid = anc;
        }
    }
    if (!found)
        *cgid = id;
    return found;
}

static __always_inline void count(u64 cgid, u32 rule, u32 verdict) {
    struct counter_key k = {.cgid = cgid, .rule = rule, .verdict = verdict};
    u64 one = 1;
    u64 *v = counters.lookup(&k);
    if (v)
        *v += 1;  // per-CPU value: no atomics needed
    else
        counters.update(&k, &one);
}

static __always_inline void emit(u64 cgid, u32 rule, u32 verdict, u32 hook, u32 family,
                                 struct bpf_sock_addr *ctx, u32 *addr, u16 port) {
    struct verdict_event *e = events.ringbuf_reserve(sizeof(struct verdict_event));
    if (!e)
        return;  // buffer full: the counters still record the verdict
    e->ts_ns = bpf_ktime_get_ns();
    e->cgid = cgid;
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->rule = rule;
    e->verdict = verdict;
    e->hook = hook;
    e->family = family;
    e->proto = ctx->protocol;
    e->port = port;
    e->pad = 0;
    e->addr[0] = addr[0];
    e->addr[1] = addr[1];
    e->addr[2] = addr[2];
    e->addr[3] = addr[3];
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    events.ringbuf_submit(e, 0);
}

static __always_inline int finish(struct sbx_cfg *cfg, u64 cgid, u32 rule, u32 verdict,
                                  u32 hook, u32 family, struct bpf_sock_addr *ctx, u32 *addr,
                                  u16 port) {
    count(cgid, rule, verdict);
    int allowed = verdict == V_ALLOW || verdict == V_REDIRECT_DNS;
    if (!allowed || (cfg && (cfg->flags & SF_LOG_ALLOWED)))
        emit(cgid, rule, verdict, hook, family, ctx, addr, port);
    return allowed;
}

// Result of an allow-map search: a live entry, an expired one, or nothing.
struct match {
    u32 rule;
    u32 flags;
    u32 expired_rule;
    u32 proto_rule;  // an entry that matched everything but the socket's transport
    u32 want;        // AF_TCP or AF_UDP: the transport of the socket asking
};

static __always_inline int take(struct allow_val *v, u64 now, struct match *m) {
    if (!v)
        return 0;
    if (v->expires_ns && now > v->expires_ns) {
        m->expired_rule = v->rule;
        return 0;
    }
    if (!(v->flags & m->want)) {
        m->proto_rule = v->rule;
        return 0;
    }
    m->rule = v->rule;
    m->flags = v->flags;
    return 1;
}

static __always_inline int is_doh(u32 *addr) {
    struct doh_key k = {};
    k.addr[0] = addr[0];
    k.addr[1] = addr[1];
    k.addr[2] = addr[2];
    k.addr[3] = addr[3];
    return doh.lookup(&k) != 0;
}

static __always_inline int is_stack4(u32 ip, u16 port) {
    struct stack_key k = {.port = port};
    k.addr[3] = ip;
    if (stack_deny.lookup(&k))
        return 1;
    u8 first = ((u8 *)&ip)[0];  // network order: the first octet
    if (first == 127 || ip == 0) {
        k.addr[3] = bpf_htonl(0x7f000001);
        return stack_deny.lookup(&k) != 0;
    }
    return 0;
}

static __always_inline int is_stack6(u32 *ip, u16 port) {
    struct stack_key k = {.port = port};
    k.addr[0] = ip[0];
    k.addr[1] = ip[1];
    k.addr[2] = ip[2];
    k.addr[3] = ip[3];
    if (stack_deny.lookup(&k))
        return 1;
    if (ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && (ip[3] == 0 || ip[3] == bpf_htonl(1))) {
        k.addr[3] = bpf_htonl(1);
        return stack_deny.lookup(&k) != 0;
    }
    return 0;
}

// DoT needs a rule naming port 853; an any-port entry does not open it.
static __always_inline int match4(u64 cgid, u32 addr, u16 port, struct match *m) {
    u64 now = bpf_ktime_get_ns();
    struct host4_key hk = {.cgid = cgid, .addr = addr, .port = port};
    if (take(host4.lookup(&hk), now, m))
        return 1;
    if (port != DOT_PORT) {
        hk.port = 0;
        if (take(host4.lookup(&hk), now, m))
            return 1;
    }
    struct cidr4_key ck = {.prefixlen = 64 + 16 + 32, .cgid = cgid, .port = port, .addr = addr};
    if (take(cidr4.lookup(&ck), now, m))
        return 1;
    if (port != DOT_PORT) {
        ck.port = 0;
        if (take(cidr4.lookup(&ck), now, m))
            return 1;
    }
    return 0;
}

static __always_inline int match6(u64 cgid, u32 *addr, u16 port, struct match *m) {
    u64 now = bpf_ktime_get_ns();
    struct host6_key hk = {.cgid = cgid, .port = port};
    hk.addr[0] = addr[0];
    hk.addr[1] = addr[1];
    hk.addr[2] = addr[2];
    hk.addr[3] = addr[3];
    if (take(host6.lookup(&hk), now, m))
        return 1;
    if (port != DOT_PORT) {
        hk.port = 0;
        if (take(host6.lookup(&hk), now, m))
            return 1;
    }
    struct cidr6_key ck = {.prefixlen = 64 + 16 + 128, .cgid = cgid, .port = port};
    ck.addr[0] = addr[0];
    ck.addr[1] = addr[1];
    ck.addr[2] = addr[2];
    ck.addr[3] = addr[3];
    if (take(cidr6.lookup(&ck), now, m))
        return 1;
    if (port != DOT_PORT) {
        ck.port = 0;
        if (take(cidr6.lookup(&ck), now, m))
            return 1;
    }
    return 0;
}

static __always_inline int rate_ok(u64 cgid, u32 rule) {
    struct bucket_key k = {.cgid = cgid, .rule = rule};
    struct bucket *b = buckets.lookup(&k);
    if (!b)
        return 1;  // rule without a rate limit
    u64 now = bpf_ktime_get_ns();
    int ok = 0;
    bpf_spin_lock(&b->lock);
    u64 tat = b->tat > now ? b->tat : now;
    if (tat - now <= b->tau_ns) {
        b->tat = tat + b->interval_ns;
        ok = 1;
    }
    bpf_spin_unlock(&b->lock);
    return ok;
}

// Decide a connect/sendmsg to an IPv4 destination (also ::ffff:a.b.c.d from a v6 socket:
// events then carry family 4 and the hook says connect6/sendmsg6).
static __always_inline u32 transport_of(struct bpf_sock_addr *ctx) {
    u32 proto = ctx->protocol;
    return (proto == PROTO_TCP || proto == PROTO_MPTCP) ? AF_TCP : AF_UDP;
}

static __always_inline int refuse(struct sbx_cfg *cfg, u64 cgid, struct match *m, u32 hook,
                                  u32 family, struct bpf_sock_addr *ctx, u32 *addr, u16 port) {
    if (m->proto_rule)
        return finish(cfg, cgid, m->proto_rule, V_DENY_PROTOCOL, hook, family, ctx, addr, port);
    u32 v = m->expired_rule ? V_DENY_EXPIRED : V_DENY_NO_RULE;
    return finish(cfg, cgid, m->expired_rule, v, hook, family, ctx, addr, port);
}

// A datagram socket's allowed destination: its replies may come in (see ingress).
static __always_inline void remember_peer(struct bpf_sock_addr *ctx, struct match *m,
                                          u32 family, u32 *addr) {
    struct bpf_sock *sk = ctx->sk;
    if (m->want != AF_UDP || !sk)
        return;
    struct udp_peers *peers = udp_peers.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
    if (!peers)
        return;  // no memory: its replies are dropped (fails closed)
    u64 now = bpf_ktime_get_ns();
    u16 port = (u16)ctx->user_port;
    u32 slot = 0;
    u64 oldest = ~0ULL;
#pragma unroll
    for (u32 i = 0; i < UDP_PEERS; i++) {
        struct udp_peer *p = &peers->peer[i];
        if (p->family == family && p->port == port && p->addr[0] == addr[0] &&
            p->addr[1] == addr[1] && p->addr[2] == addr[2] && p->addr[3] == addr[3]) {
            p->seen_ns = now;
            return;
        }
        u64 seen = p->family ? p->seen_ns : 0;
        if (seen < oldest) {
            oldest = seen;
            slot = i;
        }
    }
    if (slot >= UDP_PEERS)
        return;
    struct udp_peer *p = &peers->peer[slot];
    p->addr[0] = addr[0];
    p->addr[1] = addr[1];
    p->addr[2] = addr[2];
    p->addr[3] = addr[3];
    p->port = port;
    p->seen_ns = now;
    p->family = family;
}

static __always_inline int proxy_port(u16 port);

// Another sandbox's DNS proxy listener (any port of the proxies' range on loopback but the
// sandbox's own): a rule that opens loopback would let a sandbox spend a neighbour's DNS query
// budget (each question is charged to the listener's sandbox) and probe which names it may
// resolve. A sandbox reaches its own proxy through the port-53 redirect. Or another sandbox's
// private listener (private_ports: its HTTPS proxy).
static __always_inline int neighbours_proxy(struct sbx_cfg *cfg, u64 cgid, u16 port) {
    u32 k = port;
    u64 *owner = private_ports.lookup(&k);
    if (owner)  // (its own HTTPS proxy listens in the proxies' range too)
        return *owner != cgid;
    return proxy_port(port) && port != bpf_ntohs((u16)cfg->proxy_port);
}

// Another sandbox's private listener port: no sandbox binds it (its owner would connect to the
// binder's listener), also once the listener is gone (its agent restarting).
static __always_inline int others_private(u64 cgid, u16 port) {
    u32 k = port;
    u64 *owner = private_ports.lookup(&k);
    return owner && *owner != cgid;
}

static __always_inline int decide4(struct bpf_sock_addr *ctx, struct sbx_cfg *cfg, u64 cgid,
                                   u32 ip, u16 port, u32 hook) {
    u32 family = 4;
    u32 ev_addr[4] = {ip, 0, 0, 0};
    struct match m = {.want = transport_of(ctx)};
    if (is_stack4(ip, port))  // before any allow rule: the stack is never a destination
        return finish(cfg, cgid, 0, V_DENY_STACK, hook, family, ctx, ev_addr, port);
    if (((u8 *)&ip)[0] == 127 && neighbours_proxy(cfg, cgid, port))
        return finish(cfg, cgid, 0, V_DENY_STACK, hook, family, ctx, ev_addr, port);
    if (!match4(cgid, ip, port, &m))
        return refuse(cfg, cgid, &m, hook, family, ctx, ev_addr, port);
    if (!(m.flags & AF_HOST_EXACT) && (port == HTTPS_PORT || port == DOT_PORT)) {
        u32 k[4] = {0, 0, 0, ip};
        if (is_doh(k))
            return finish(cfg, cgid, m.rule, V_DENY_DOH, hook, family, ctx, ev_addr, port);
    }
    if (!rate_ok(cgid, m.rule))  // connects, and UDP datagrams sent with an address
        return finish(cfg, cgid, m.rule, V_DENY_RATE_LIMIT, hook, family, ctx, ev_addr, port);
    u32 peer[4] = {0, 0, 0, ip};
    remember_peer(ctx, &m, 4, peer);
    return finish(cfg, cgid, m.rule, V_ALLOW, hook, family, ctx, ev_addr, port);
}

static __always_inline int decide6(struct bpf_sock_addr *ctx, struct sbx_cfg *cfg, u64 cgid,
                                   u32 *ip, u16 port, u32 hook) {
    struct match m = {.want = transport_of(ctx)};
    if (is_stack6(ip, port))
        return finish(cfg, cgid, 0, V_DENY_STACK, hook, 6, ctx, ip, port);
    if (ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(1) &&
        neighbours_proxy(cfg, cgid, port))
        return finish(cfg, cgid, 0, V_DENY_STACK, hook, 6, ctx, ip, port);
    if (!match6(cgid, ip, port, &m))
        return refuse(cfg, cgid, &m, hook, 6, ctx, ip, port);
    if (!(m.flags & AF_HOST_EXACT) && (port == HTTPS_PORT || port == DOT_PORT) && is_doh(ip))
        return finish(cfg, cgid, m.rule, V_DENY_DOH, hook, 6, ctx, ip, port);
    if (!rate_ok(cgid, m.rule))  // connects, and UDP datagrams sent with an address
        return finish(cfg, cgid, m.rule, V_DENY_RATE_LIMIT, hook, 6, ctx, ip, port);
    remember_peer(ctx, &m, 6, ip);
    return finish(cfg, cgid, m.rule, V_ALLOW, hook, 6, ctx, ip, port);
}

static __always_inline void remember_dns(struct bpf_sock_addr *ctx, struct orig_dst *o) {
    struct bpf_sock *sk = ctx->sk;
    if (!sk)
        return;
    struct orig_dst *kept = dns_dst.sk_storage_get(sk, o, BPF_SK_STORAGE_GET_F_CREATE);
    if (kept)
        *kept = *o;  // (a socket asking another server later: its newest)
}

static __always_inline struct orig_dst *dns_of(struct bpf_sock_addr *ctx) {
    struct bpf_sock *sk = ctx->sk;
    if (!sk)
        return 0;
    return dns_dst.sk_storage_get(sk, 0, 0);
}

static __always_inline int hook4(struct bpf_sock_addr *ctx, u32 hook) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    u32 ip = ctx->user_ip4;
    u16 port = bpf_ntohs((u16)ctx->user_port);
    if (!cfg) {
        u32 ev_addr[4] = {ip, 0, 0, 0};
        return finish(0, cgid, 0, V_DENY_UNKNOWN_SANDBOX, hook, 4, ctx, ev_addr, port);
    }
    if (hook == H_CONNECT4 && reconnect_over(ctx, cgid)) {
        u32 ev_addr[4] = {ip, 0, 0, 0};
        return finish(cfg, cgid, 0, V_DENY_SOCKETS, hook, 4, ctx, ev_addr, port);
    }
    if (port == DNS_PORT) {
        struct orig_dst o = {.port = ctx->user_port, .family = 4};
        o.ip6[3] = ip;
        remember_dns(ctx, &o);
        ctx->user_ip4 = cfg->proxy4;
        ctx->user_port = cfg->proxy_port;
        u32 ev_addr[4] = {ip, 0, 0, 0};
        return finish(cfg, cgid, 0, V_REDIRECT_DNS, hook, 4, ctx, ev_addr, port);
    }
    return decide4(ctx, cfg, cgid, ip, port, hook);
}

static __always_inline int is_v4_mapped(u32 *a) {
    return a[0] == 0 && a[1] == 0 && a[2] == bpf_htonl(0x0000ffff);
}

static __always_inline int hook6(struct bpf_sock_addr *ctx, u32 hook) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    u32 ip[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
    u16 port = bpf_ntohs((u16)ctx->user_port);
    if (!cfg)
        return finish(0, cgid, 0, V_DENY_UNKNOWN_SANDBOX, hook, 6, ctx, ip, port);
    if (hook == H_CONNECT6 && reconnect_over(ctx, cgid))
        return finish(cfg, cgid, 0, V_DENY_SOCKETS, hook, 6, ctx, ip, port);
    int mapped = is_v4_mapped(ip);
    if (port == DNS_PORT) {
        struct orig_dst o = {.port = ctx->user_port, .family = 6};
        o.ip6[0] = ip[0];
        o.ip6[1] = ip[1];
        o.ip6[2] = ip[2];
        o.ip6[3] = ip[3];
        remember_dns(ctx, &o);
        if (mapped) {
            // A dual-stack socket talking IPv4: send it to the proxy's IPv4 address.
            ctx->user_ip6[0] = 0;
            ctx->user_ip6[1] = 0;
            ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
            ctx->user_ip6[3] = cfg->proxy4;
        } else {
            ctx->user_ip6[0] = cfg->proxy6[0];
            ctx->user_ip6[1] = cfg->proxy6[1];
            ctx->user_ip6[2] = cfg->proxy6[2];
            ctx->user_ip6[3] = cfg->proxy6[3];
        }
        ctx->user_port = cfg->proxy_port;
        return finish(cfg, cgid, 0, V_REDIRECT_DNS, hook, 6, ctx, ip, port);
    }
    if (mapped)  // ::ffff:a.b.c.d is IPv4 a.b.c.d on the wire: the IPv4 rules decide
        return decide4(ctx, cfg, cgid, ip[3], port, hook);
    return decide6(ctx, cfg, cgid, ip, port, hook);
}

// Replies from the proxy (recvmsg) and the peer name (getpeername) show the address the code
// asked for, so resolvers that check the reply's source keep working.
static __always_inline int restore4(struct bpf_sock_addr *ctx) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    if (!cfg || ctx->user_ip4 != cfg->proxy4 || ctx->user_port != cfg->proxy_port)
        return 1;
    struct orig_dst *o = dns_of(ctx);
    if (!o || o->family != 4)
        return 1;
    ctx->user_ip4 = o->ip6[3];
    ctx->user_port = o->port;
    return 1;
}

static __always_inline int restore6(struct bpf_sock_addr *ctx) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    if (!cfg || ctx->user_port != cfg->proxy_port)
        return 1;
    u32 ip[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
    int from_proxy6 = ip[0] == cfg->proxy6[0] && ip[1] == cfg->proxy6[1] &&
                      ip[2] == cfg->proxy6[2] && ip[3] == cfg->proxy6[3];
    int from_proxy4 = is_v4_mapped(ip) && ip[3] == cfg->proxy4;
    if (!from_proxy6 && !from_proxy4)
        return 1;
    struct orig_dst *o = dns_of(ctx);
    if (!o)
        return 1;
    if (o->family == 4) {
        // sendto(::ffff:a.b.c.d) on a v6 socket runs the *sendmsg4* hook, but its reply comes
        // through recvmsg6: show the IPv4 original as v4-mapped.
        ctx->user_ip6[0] = 0;
        ctx->user_ip6[1] = 0;
        ctx->user_ip6[2] = bpf_htonl(0x0000ffff);
    } else {
        ctx->user_ip6[0] = o->ip6[0];
        ctx->user_ip6[1] = o->ip6[1];
        ctx->user_ip6[2] = o->ip6[2];
    }
    ctx->user_ip6[3] = o->ip6[3];
    ctx->user_port = o->port;
    return 1;
}

// A sandbox shares the host's network, so it listens on loopback only: a wildcard bind
// (0.0.0.0, ::) becomes a loopback bind (its server works for the node, is never exposed on
// the host's interfaces, and takes no inbound connection past the egress rules); a bind to
// another of the host's addresses is refused, as is one to a port of the stack's servers or of
// any sandbox's DNS proxy listener (held while the node agent restarts, it would read and
// answer other sandboxes' questions).
static __always_inline int proxy_port(u16 port) {
    if (PROXY_PORT_LO && port >= PROXY_PORT_LO && port <= PROXY_PORT_HI)
        return 1;  // the whole range: no bind tells a sandbox which are in use
    u32 k = port;
    return dns_ports.lookup(&k) != 0;
}

static __always_inline int bind_refused(struct sbx_cfg *cfg, u64 cgid, u32 verdict, u32 hook,
                                        u32 family, struct bpf_sock_addr *ctx, u32 *addr,
                                        u16 port) {
    return finish(cfg, cgid, 0, verdict, hook, family, ctx, addr, port);
}

static __always_inline int bind_hook4(struct bpf_sock_addr *ctx) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    u32 ip = ctx->user_ip4;
    u16 port = bpf_ntohs((u16)ctx->user_port);
    u32 ev_addr[4] = {ip, 0, 0, 0};
    if (!cfg)
        return bind_refused(0, cgid, V_DENY_UNKNOWN_SANDBOX, H_BIND4, 4, ctx, ev_addr, port);
    if (port_over(ctx->sk, cgid, 0))
        return bind_refused(cfg, cgid, V_DENY_SOCKETS, H_BIND4, 4, ctx, ev_addr, port);
    if (ip == 0) {
        ip = bpf_htonl(0x7f000001);
        ctx->user_ip4 = ip;
    }
    if (((u8 *)&ip)[0] != 127)
        return bind_refused(cfg, cgid, V_DENY_BIND, H_BIND4, 4, ctx, ev_addr, port);
    if (port && (proxy_port(port) || others_private(cgid, port) || is_stack4(ip, port)))
        return bind_refused(cfg, cgid, V_DENY_STACK, H_BIND4, 4, ctx, ev_addr, port);
    return 1;
}

static __always_inline int bind_hook6(struct bpf_sock_addr *ctx) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    u32 ip[4] = {ctx->user_ip6[0], ctx->user_ip6[1], ctx->user_ip6[2], ctx->user_ip6[3]};
    u16 port = bpf_ntohs((u16)ctx->user_port);
    if (!cfg)
        return bind_refused(0, cgid, V_DENY_UNKNOWN_SANDBOX, H_BIND6, 6, ctx, ip, port);
    if (port_over(ctx->sk, cgid, 0))
        return bind_refused(cfg, cgid, V_DENY_SOCKETS, H_BIND6, 6, ctx, ip, port);
    if (is_v4_mapped(ip)) {  // ::ffff:a.b.c.d is IPv4 (events carry family 4, as connect6's)
        u32 v4 = ip[3];
        u32 ev4[4] = {v4, 0, 0, 0};
        if (v4 == 0) {
            v4 = bpf_htonl(0x7f000001);
            ctx->user_ip6[3] = v4;
        }
        if (((u8 *)&v4)[0] != 127)
            return bind_refused(cfg, cgid, V_DENY_BIND, H_BIND6, 4, ctx, ev4, port);
        if (port && (proxy_port(port) || others_private(cgid, port) || is_stack4(v4, port)))
            return bind_refused(cfg, cgid, V_DENY_STACK, H_BIND6, 4, ctx, ev4, port);
        return 1;
    }
    if (ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == 0) {
        ctx->user_ip6[3] = bpf_htonl(1);
        ip[3] = bpf_htonl(1);
    }
    if (!(ip[0] == 0 && ip[1] == 0 && ip[2] == 0 && ip[3] == bpf_htonl(1)))
        return bind_refused(cfg, cgid, V_DENY_BIND, H_BIND6, 6, ctx, ip, port);
    if (port && (proxy_port(port) || others_private(cgid, port) || is_stack6(ip, port)))
        return bind_refused(cfg, cgid, V_DENY_STACK, H_BIND6, 6, ctx, ip, port);
    return 1;
}

int connect4(struct bpf_sock_addr *ctx) { return hook4(ctx, H_CONNECT4); }
int connect6(struct bpf_sock_addr *ctx) { return hook6(ctx, H_CONNECT6); }
int sendmsg4(struct bpf_sock_addr *ctx) { return hook4(ctx, H_SENDMSG4); }
int sendmsg6(struct bpf_sock_addr *ctx) { return hook6(ctx, H_SENDMSG6); }
int recvmsg4(struct bpf_sock_addr *ctx) { return restore4(ctx); }
int recvmsg6(struct bpf_sock_addr *ctx) { return restore6(ctx); }
int getpeername4(struct bpf_sock_addr *ctx) { return restore4(ctx); }
int getpeername6(struct bpf_sock_addr *ctx) { return restore6(ctx); }
int bind4(struct bpf_sock_addr *ctx) { return bind_hook4(ctx); }
int bind6(struct bpf_sock_addr *ctx) { return bind_hook6(ctx); }

// cgroup/sock_create and cgroup/sock_release: a sandbox's IP sockets are counted, and socket()
// fails EPERM past MAX_SANDBOX_SOCKETS for the sandbox or MAX_NODE_SOCKETS for the node's
// sandboxes together. (Bounding binds would not do: bind(port 0), listen() without a bind and
// a datagram socket's first sendto take a port too; a socket holds one port at most.)
static __always_inline void emit_socket(u64 cgid, u32 verdict, struct bpf_sock *sk) {
    struct verdict_event *e = events.ringbuf_reserve(sizeof(struct verdict_event));
    if (!e)
        return;
    __builtin_memset(e, 0, sizeof(*e));
    e->ts_ns = bpf_ktime_get_ns();
    e->cgid = cgid;
    e->pid = bpf_get_current_pid_tgid() >> 32;
    e->verdict = verdict;
    e->hook = H_SOCKET;
    e->family = sk->family == 10 ? 6 : 4;
    e->proto = sk->protocol;
    bpf_get_current_comm(&e->comm, sizeof(e->comm));
    events.ringbuf_submit(e, 0);
}

int sock_create(struct bpf_sock *sk) {
    u64 cgid = 0;
    struct sbx_cfg *cfg = find_sandbox(&cgid);
    if (!cfg) {  // programs attached, sandbox not (or no longer) registered: fails closed
        count(cgid, 0, V_DENY_UNKNOWN_SANDBOX);
        return 0;
    }
    if (sk->protocol == PROTO_MPTCP) {  // (seccomp refuses it first: its subflows are the
        count(cgid, 0, V_DENY_PROTOCOL);  // kernel's sockets, beyond these counts)
        return 0;
    }
    struct sock_use zero = {};
    u64 node_key = 0;
    struct sock_use *mine = sock_use.lookup_or_try_init(&cgid, &zero);
    struct sock_use *node = sock_use.lookup_or_try_init(&node_key, &zero);
    if (!mine || !node || over_budget(mine, node)) {
        count(cgid, 0, V_DENY_SOCKETS);
        emit_socket(cgid, V_DENY_SOCKETS, sk);
        return 0;
    }
    struct sock_hold *hold = sock_hold.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
    struct sock_link *link = sock_link.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
    if (!hold || !link)
        return 0;  // no memory for the marks: refused, never uncounted
    hold->origin = cgid;  // (a new socket's storage starts zeroed: no connection, no listener)
    hold->unreleased = 1;
    hold->counted = 1;
    link->origin = cgid;
    link->cookie = bpf_get_socket_cookie(sk);
    __sync_fetch_and_add(&mine->live, 1);
    __sync_fetch_and_add(&node->live, 1);
    return 1;
}

int sock_release(struct bpf_sock *sk) {
    struct sock_hold *hold = sock_hold.sk_storage_get(sk, 0, 0);
    // (none: created before the count; or an accepted socket that took no port of its own)
    if (!hold || __sync_lock_test_and_set(&hold->unreleased, 0) != 1)
        return 1;
    u64 key = bpf_get_socket_cookie(sk);
    struct listen_use *l = hold->conn ? 0 : listen_use.lookup(&key);
    if (l) {  // a listener that accepted: its open connections keep its port
        if (__sync_lock_test_and_set(&hold->counted, 0) == 1)
            __sync_lock_test_and_set(&l->holds, 1);  // its place moves there
        __sync_lock_test_and_set(&l->released, 1);
        if (l->children <= 0)  // (after the exchanges: the last connection's end, racing,
            settle_listener(key, l);  // reads it as released, and one of them settles)
        return 1;
    }
    if (!hold->conn)  // (after the exchange: the connection's end, racing, reads it as done)
        move_place(hold, 0);
    return 1;
}

// sockops: follows each TCP connection of a sandbox's sockets, made (TCP_CONNECT_CB) or
// accepted (PASSIVE_ESTABLISHED_CB), asking for its state changes. A change to CLOSE ends the
// connection (its port is free, or in TIME_WAIT); from FIN_WAIT1, FIN_WAIT2 or CLOSING it is
// the connection entering TIME_WAIT (tcp_time_wait, then tcp_done; also a rare reset there,
// counted alike), released or not. TCP_LISTEN_CB: a socket of the sandbox holding no place
// (an accepted one, connect(AF_UNSPEC) and listen()) takes a port by listening: counted.
// Runs under the socket's lock, often in softirq: the sandbox is the socket's marks.
int sock_state(struct bpf_sock_ops *skops) {
    u32 op = skops->op;
    struct bpf_sock *sk = skops->sk;
    if (!sk)
        return 1;
    if (op == BPF_SOCK_OPS_PASSIVE_ESTABLISHED_CB) {
        struct sock_link *link = sock_link.sk_storage_get(sk, 0, 0);  // (its listener's copy)
        if (!link || !link->origin)
            return 1;
        struct sock_hold *hold = sock_hold.sk_storage_get(sk, 0, BPF_SK_STORAGE_GET_F_CREATE);
        if (!hold)
            return 1;
        struct listen_use fresh = {.origin = link->origin};
        u64 key = link->cookie;
        struct listen_use *l = listen_use.lookup_or_try_init(&key, &fresh);
        hold->origin = link->origin;
        hold->listener = l ? key : 0;
        link->cookie = bpf_get_socket_cookie(skops);  // (a listener of its own one day)
        __sync_lock_test_and_set(&hold->conn, 1);
        if (l)
            __sync_fetch_and_add(&l->children, 1);
        else  // (no room to follow its listener: it counts as a place of its own, the safe side)
            move_place(hold, 1);
        bpf_sock_ops_cb_flags_set(skops,
                                  skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
        return 1;
    }
    struct sock_hold *hold = sock_hold.sk_storage_get(sk, 0, 0);
    if (!hold || !hold->origin)
        return 1;
    if (op == BPF_SOCK_OPS_TCP_LISTEN_CB) {
        if (!hold->counted) {
            __sync_lock_test_and_set(&hold->unreleased, 1);
            move_place(hold, 1);
        }
        return 1;
    }
    if (op == BPF_SOCK_OPS_TCP_CONNECT_CB) {
        bpf_sock_ops_cb_flags_set(skops,
                                  skops->bpf_sock_ops_cb_flags | BPF_SOCK_OPS_STATE_CB_FLAG);
        if (!hold->conn) {
            __sync_lock_test_and_set(&hold->conn, 1);
            move_place(hold, 1);  // (a socket of the sandbox holds one already: no change)
        }
        return 1;
    }
    if (op != BPF_SOCK_OPS_STATE_CB || skops->args[1] != BPF_TCP_CLOSE)
        return 1;
    if (__sync_lock_test_and_set(&hold->conn, 0) != 1)
        return 1;
    u32 old = skops->args[0];
    int tw = old == BPF_TCP_FIN_WAIT1 || old == BPF_TCP_FIN_WAIT2 || old == BPF_TCP_CLOSING;
    u64 key = hold->listener;
    if (key) {  // an accepted connection: its listener's port
        hold->listener = 0;
        struct listen_use *l = listen_use.lookup(&key);
        if (!l)
            return 1;
        if (tw)
            l->last_tw_ns = bpf_ktime_get_ns();
        if (__sync_fetch_and_add(&l->children, -1) == 1 && l->released)
            settle_listener(key, l);
        return 1;
    }
    if (tw)
        count_linger(hold->origin);
    if (!hold->unreleased)  // (after the exchange: a release racing it reads it as ended)
        move_place(hold, 0);
    return 1;
}

// cgroup_skb/ingress: what reaches the sandbox's sockets. It runs at delivery to a socket,
// after reassembly, with the packet's IP header first.
// - A socket that listens without a bind() of its own is bound by the kernel to every address
//   (no bind hook runs), so the bind hooks alone leave it reachable from anywhere: every packet
//   to a listening socket (a connection request, or the handshake's last ACK) from an address
//   that is not loopback is dropped. The socket's state decides, not the packet's TCP header,
//   so no IPv6 extension header hides a SYN.
// - A datagram socket that is not connected (the kernel binds it to every address at its first
//   sendto) takes, from outside loopback, only datagrams from a peer it was allowed to send to
//   (udp_peers: address and port). A connected one takes only its peer's (the kernel's lookup
//   found the socket before a connect() finished, so its state alone is not enough).
//   (seccomp refuses every other datagram socket; one would take nothing from outside.)
// - "Loopback" is a loopback source that came in on the loopback device: with route_localnet
//   set (kube-proxy sets it) a host on the link could send from 127.0.0.1.
#define ETH_P_IP_BE 0x0008    // htons(0x0800), as skb->protocol holds it
#define ETH_P_IPV6_BE 0xDD86  // htons(0x86DD)
#define SOCK_DGRAM_TYPE 2
#define IPPROTO_UDP_NR 17
#define IPPROTO_UDPLITE_NR 136
#define LOOPBACK_IFINDEX 1  // the loopback device, in every network namespace

static __always_inline int from_peer(struct bpf_sock *sk, u32 family, u32 *src, u16 port) {
    if (sk->state == BPF_TCP_ESTABLISHED) {  // connected: its peer only (port 0: any port)
        u16 peer_port = (u16)sk->dst_port;
        if (peer_port && peer_port != port)
            return 0;
        if (family == 4)
            return sk->dst_ip4 == src[3];
        return sk->dst_ip6[0] == src[0] && sk->dst_ip6[1] == src[1] &&
               sk->dst_ip6[2] == src[2] && sk->dst_ip6[3] == src[3];
    }
    struct udp_peers *peers = udp_peers.sk_storage_get(sk, 0, 0);
    if (!peers)
        return 0;
    u64 now = bpf_ktime_get_ns();
#pragma unroll
    for (u32 i = 0; i < UDP_PEERS; i++) {
        struct udp_peer *p = &peers->peer[i];
        // (signed: a send on another CPU may have stamped it after `now` was read)
        if (p->family == family && p->port == port && p->addr[0] == src[0] &&
            p->addr[1] == src[1] && p->addr[2] == src[2] && p->addr[3] == src[3] &&
            (s64)(now - p->seen_ns) <= (s64)UDP_PEER_IDLE_NS)
            return 1;  // (only a send, which the rules judge again, keeps a peer: a reply
                       // does not, so a rule that expired bounds what comes in too)
    }
    return 0;
}

int ingress(struct __sk_buff *skb) {
    struct bpf_sock *sk = skb->sk;
    if (!sk)
        return 1;
    sk = bpf_sk_fullsock(sk);
    if (!sk)
        return 1;
    int listening = sk->state == BPF_TCP_LISTEN;
    int datagram = sk->type == SOCK_DGRAM_TYPE;
    if (!listening && !datagram)
        return 1;  // (every packet of the sandbox's own connections: a few loads, no lookup)
    // (a lookup in the sandboxes map, whatever its answer: an agent knows its own programs by
    // the maps they use, to detach and adopt them)
    u64 socket_cgroup = bpf_skb_cgroup_id(skb);
    if (sandboxes.lookup(&socket_cgroup) == 0 && socket_cgroup == 0)
        return 1;
    u16 port = 0;  // the datagram's source port, network order
    if (skb->protocol == ETH_P_IP_BE) {  // the source, from the fixed header
        u32 src[4] = {0, 0, 0, 0};
        if (bpf_skb_load_bytes(skb, 12, &src[3], 4) < 0)
            return 0;
        if (((u8 *)&src[3])[0] == 127 && skb->ingress_ifindex == LOOPBACK_IFINDEX)
            return 1;
        if (listening)
            return 0;
        u8 head[10];
        if (bpf_skb_load_bytes(skb, 0, head, sizeof(head)) < 0)
            return 0;
        if (head[9] != IPPROTO_UDP_NR && head[9] != IPPROTO_UDPLITE_NR)
            return 0;
        u32 ihl = (head[0] & 0x0f) * 4;
        if (ihl < 20 || bpf_skb_load_bytes(skb, ihl, &port, 2) < 0)
            return 0;
        return from_peer(sk, 4, src, port);
    }
    if (skb->protocol == ETH_P_IPV6_BE) {
        u32 src[4];
        if (bpf_skb_load_bytes(skb, 8, src, sizeof(src)) < 0)
            return 0;
        if (src[0] == 0 && src[1] == 0 && src[2] == 0 && src[3] == bpf_htonl(1) &&
            skb->ingress_ifindex == LOOPBACK_IFINDEX)
            return 1;  // ::1
        if (listening)
            return 0;
        u8 next = 0;
        if (bpf_skb_load_bytes(skb, 6, &next, 1) < 0)
            return 0;
        // (an extension header before the datagram's own: dropped, fails closed)
        if (next != IPPROTO_UDP_NR && next != IPPROTO_UDPLITE_NR)
            return 0;
        if (bpf_skb_load_bytes(skb, 40, &port, 2) < 0)
            return 0;
        return from_peer(sk, 6, src, port);
    }
    return 0;
}

// cgroup/setsockopt: IP_RECVERR and IPV6_RECVERR (and their RFC 4884 forms) are set as a
// no-op for a sandbox's sockets. With them, an ICMP error from any host, naming the socket's
// address and port in its quoted header, put its payload on the socket's error queue: an
// inbound channel no ingress program sees, to any socket, a loopback-bound one too. The
// option "succeeds" (optlen -1: the kernel skips it), so code that sets it keeps working,
// without the queue of remote errors.
#define SOL_IP_NR 0
#define SOL_IPV6_NR 41
#define IP_RECVERR_NR 11
#define IP_RECVERR_RFC4884_NR 26
#define IPV6_RECVERR_NR 25
#define IPV6_RECVERR_RFC4884_NR 31

int sockopt(struct bpf_sockopt *ctx) {
    // (a lookup in the sandboxes map, whatever its answer: see ingress)
    u64 id = bpf_get_current_cgroup_id();
    if (sandboxes.lookup(&id) == 0 && id == 0)
        return 1;
    int level = ctx->level, name = ctx->optname;
    if ((level == SOL_IP_NR && (name == IP_RECVERR_NR || name == IP_RECVERR_RFC4884_NR)) ||
        (level == SOL_IPV6_NR && (name == IPV6_RECVERR_NR || name == IPV6_RECVERR_RFC4884_NR)))
        ctx->optlen = -1;
    else if (ctx->optlen > (int)PAGE_SIZE)
        ctx->optlen = 0;  // (the kernel's own value: before 6.5 a larger one failed EFAULT)
    return 1;
}
