/* Who owns the other end of an accepted TCP connection, when that end is on this host.
 *
 * The kernel records the creator's uid on every socket. A local peer's socket is the one whose local
 * address is our peer address and whose remote address is our local address; its owner is asked of
 * the kernel by that exact 4-tuple over the sock_diag netlink interface (what `ss` uses: one lookup,
 * no privilege needed) or, where that is unavailable, found in /proc/net/tcp and /proc/net/tcp6. A
 * socket no process holds any more (closed: a TIME_WAIT entry, or inode 0) has no owner to trust.
 * A peer on another host or in another network namespace has no socket here: it cannot be checked.
 * Thread-safe: no state is shared between calls.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <linux/inet_diag.h>
#include <linux/netlink.h>
#include <linux/sock_diag.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

enum { LOOKUP_AUTO = 0, LOOKUP_DIAG = 1, LOOKUP_PROC = 2 }; /* memory/bind_host/__init__.py: _LOOKUPS */
enum { ST_TIME_WAIT = 6, ST_LISTEN = 10 }; /* the kernel's TCP states (include/net/tcp_states.h) */

struct endpoint {
    unsigned char addr[16]; /* network order; the first 4 bytes for AF_INET */
    uint16_t port;          /* host order */
};
struct conn {
    int family; /* AF_INET (a v4-mapped IPv6 connection is written as IPv4) or AF_INET6 */
    struct endpoint local, peer;
};
struct owner {
    unsigned uid;
    unsigned long inode; /* 0: no process holds the socket */
    int state;
};

static int addr_len(int family) { return family == AF_INET ? 4 : 16; }

static int endpoint_of(const struct sockaddr_storage *ss, struct endpoint *e, int *family) {
    memset(e, 0, sizeof *e);
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *s = (const struct sockaddr_in *)ss;
        memcpy(e->addr, &s->sin_addr, 4);
        e->port = ntohs(s->sin_port);
        *family = AF_INET;
        return 0;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)ss;
        int mapped = IN6_IS_ADDR_V4MAPPED(&s->sin6_addr);
        memcpy(e->addr, mapped ? &s->sin6_addr.s6_addr[12] : s->sin6_addr.s6_addr, mapped ? 4 : 16);
        e->port = ntohs(s->sin6_port);
        *family = mapped ? AF_INET : AF_INET6;
        return 0;
    }
    return -1;
}

static int conn_of(int fd, struct conn *c) {
    struct sockaddr_storage l, p;
    socklen_t ll = sizeof l, pl = sizeof p;
    int fl, fp;
    if (getsockname(fd, (struct sockaddr *)&l, &ll) != 0 || getpeername(fd, (struct sockaddr *)&p, &pl) != 0)
        return -1;
    if (endpoint_of(&l, &c->local, &fl) != 0 || endpoint_of(&p, &c->peer, &fp) != 0 || fl != fp) return -1;
    c->family = fl;
    return 0;
}

/* The socket whose local end is src and remote end is dst, by sock_diag: 1 found, 0 none, -1 cannot
 * ask. (-ENOENT also answers a kernel without the TCP diag module: the caller checks.) */
static int diag_lookup(int family, const struct endpoint *src, const struct endpoint *dst, struct owner *o) {
    struct {
        struct nlmsghdr nlh;
        struct inet_diag_req_v2 req;
    } msg;
    memset(&msg, 0, sizeof msg);
    msg.nlh.nlmsg_len = sizeof msg;
    msg.nlh.nlmsg_type = SOCK_DIAG_BY_FAMILY;
    msg.nlh.nlmsg_flags = NLM_F_REQUEST;
    msg.req.sdiag_family = (unsigned char)family;
    msg.req.sdiag_protocol = IPPROTO_TCP;
    msg.req.idiag_states = ~0U;
    msg.req.id.idiag_sport = htons(src->port);
    msg.req.id.idiag_dport = htons(dst->port);
    memcpy(msg.req.id.idiag_src, src->addr, addr_len(family));
    memcpy(msg.req.id.idiag_dst, dst->addr, addr_len(family));
    msg.req.id.idiag_cookie[0] = msg.req.id.idiag_cookie[1] = INET_DIAG_NOCOOKIE;

    int s = socket(AF_NETLINK, SOCK_DGRAM | SOCK_CLOEXEC, NETLINK_SOCK_DIAG);
    if (s < 0) return -1;
    struct sockaddr_nl kernel = {.nl_family = AF_NETLINK};
    long buf[1024]; /* aligned for nlmsghdr */
    ssize_t n = -1;
    if (sendto(s, &msg, sizeof msg, 0, (struct sockaddr *)&kernel, sizeof kernel) == (ssize_t)sizeof msg)
        n = recv(s, buf, sizeof buf, MSG_DONTWAIT); /* the kernel answers within sendto */
    close(s);
    const struct nlmsghdr *h = (const struct nlmsghdr *)buf;
    if (n < (ssize_t)sizeof *h || !NLMSG_OK(h, (size_t)n)) return -1;
    if (h->nlmsg_type == NLMSG_ERROR) {
        const struct nlmsgerr *e = NLMSG_DATA(h);
        return h->nlmsg_len >= NLMSG_LENGTH(sizeof *e) && e->error == -ENOENT ? 0 : -1;
    }
    if (h->nlmsg_type != SOCK_DIAG_BY_FAMILY || h->nlmsg_len < NLMSG_LENGTH(sizeof(struct inet_diag_msg)))
        return -1;
    const struct inet_diag_msg *m = NLMSG_DATA(h);
    /* no established match makes the kernel fall back to a listener: that is not this connection */
    if (ntohs(m->id.idiag_sport) != src->port || ntohs(m->id.idiag_dport) != dst->port) return 0;
    o->uid = m->idiag_uid;
    o->inode = m->idiag_inode;
    o->state = m->idiag_state;
    return 1;
}

/* Whether /proc/net/tcp{,6}'s hex address (host-order 32-bit words) is addr of family. */
static int hex_addr_is(const char *hex, int family, const unsigned char *addr) {
    size_t len = strlen(hex);
    unsigned char got[16], want[16];
    if (len != 8 && len != 32) return 0;
    for (size_t i = 0; i < len / 8; i++) {
        char word[9];
        memcpy(word, hex + 8 * i, 8);
        word[8] = '\0';
        uint32_t w = (uint32_t)strtoul(word, NULL, 16);
        memcpy(got + 4 * i, &w, 4);
    }
    if (len == 8) return family == AF_INET && memcmp(got, addr, 4) == 0;
    if (family == AF_INET6) return memcmp(got, addr, 16) == 0;
    memset(want, 0, 10); /* an IPv6 socket with a v4-mapped address: ::ffff:a.b.c.d */
    want[10] = want[11] = 0xff;
    memcpy(want + 12, addr, 4);
    return memcmp(got, want, 16) == 0;
}

/* The peer's socket from /proc/net/tcp and tcp6: 1 found, 0 none, -1 neither file readable. */
static int proc_lookup(const struct conn *c, struct owner *o) {
    static const char *const files[] = {"/proc/net/tcp", "/proc/net/tcp6"};
    int opened = 0;
    for (size_t i = 0; i < sizeof files / sizeof *files; i++) {
        FILE *f = fopen(files[i], "re");
        if (f == NULL) continue;
        opened = 1;
        char line[512], lhex[33], rhex[33];
        unsigned lport, rport, state, uid;
        unsigned long inode;
        int found = 0;
        while (!found && fgets(line, sizeof line, f) != NULL) {
            if (sscanf(line, " %*u: %32[0-9A-Fa-f]:%x %32[0-9A-Fa-f]:%x %x %*x:%*x %*x:%*x %*x %u %*d %lu",
                       lhex, &lport, rhex, &rport, &state, &uid, &inode) != 7)
                continue; /* the header */
            found = lport == c->peer.port && rport == c->local.port &&
                    hex_addr_is(lhex, c->family, c->peer.addr) && hex_addr_is(rhex, c->family, c->local.addr);
        }
        fclose(f);
        if (found) {
            o->uid = uid;
            o->inode = inode;
            o->state = (int)state;
            return 1;
        }
    }
    return opened ? 0 : -1;
}

/* Whether the peer's address is this host's (loopback, ours, or an interface's); when the
 * interfaces cannot be listed, assume it is (the caller then refuses rather than admits). */
static int peer_is_local(const struct conn *c) {
    const unsigned char *a = c->peer.addr;
    if (c->family == AF_INET ? a[0] == 127 : IN6_IS_ADDR_LOOPBACK((const struct in6_addr *)a)) return 1;
    if (memcmp(a, c->local.addr, addr_len(c->family)) == 0) return 1;
    struct ifaddrs *ifs, *i;
    if (getifaddrs(&ifs) != 0) return 1;
    int local = 0;
    for (i = ifs; i != NULL && !local; i = i->ifa_next) {
        if (i->ifa_addr == NULL || i->ifa_addr->sa_family != c->family) continue;
        const void *mine = c->family == AF_INET
                               ? (const void *)&((struct sockaddr_in *)i->ifa_addr)->sin_addr
                               : (const void *)&((struct sockaddr_in6 *)i->ifa_addr)->sin6_addr;
        local = memcmp(mine, a, addr_len(c->family)) == 0;
    }
    freeifaddrs(ifs);
    return local;
}

/* The owner of the other end of the TCP connection fd; method: LOOKUP_AUTO (sock_diag, else
 * /proc), LOOKUP_DIAG or LOOKUP_PROC (one only: for tests). Returns
 *    1  that end is a socket on this host held by a process; *uid is its owner
 *    0  that end is not on this host (or not in this network namespace): it cannot be checked
 *   -1  that end is local but its socket is gone (closed) or cannot be found; or fd is no TCP/IP
 *       connection */
int xllm_peer_owner(int fd, int method, unsigned *uid) {
    struct conn c;
    struct owner o;
    int found = -1;
    if (conn_of(fd, &c) != 0) return -1;
    if (method != LOOKUP_PROC) {
        found = diag_lookup(c.family, &c.peer, &c.local, &o);
        struct owner self;
        if (found == 0 && method == LOOKUP_AUTO && diag_lookup(c.family, &c.local, &c.peer, &self) != 1)
            found = -1; /* sock_diag cannot even find our own end: ask /proc */
    }
    if (found < 0 && method != LOOKUP_DIAG) found = proc_lookup(&c, &o);
    if (found == 1 && o.inode != 0 && o.state != ST_TIME_WAIT && o.state != ST_LISTEN) {
        *uid = o.uid;
        return 1;
    }
    return peer_is_local(&c) ? -1 : 0;
}
