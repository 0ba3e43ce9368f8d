/* Confine a process's wildcard binds to one host: an LD_PRELOAD shim for libraries that always bind
 * 0.0.0.0 / [::] (the Mooncake transfer engine's handshake and TCP data listeners).
 *
 * When XLLM_BIND_HOST holds an IPv4 or IPv6 literal (not a wildcard itself), bind() of the IPv4
 * wildcard 0.0.0.0 or the IPv6 wildcard :: on any socket is rewritten, keeping the port:
 *   IPv4 socket, IPv4 host  -> the host
 *   IPv6 socket, IPv4 host  -> the v4-mapped ::ffff:a.b.c.d (fails with EINVAL on an IPV6_V6ONLY
 *                              socket: such a socket cannot listen on an IPv4 host)
 *   IPv6 socket, IPv6 host  -> the host
 *   IPv4 socket, IPv6 host  -> refused: EADDRNOTAVAIL, said once on stderr (an IPv4 socket cannot
 *                              listen on an IPv6 host, and leaving it on 0.0.0.0 would expose it;
 *                              Mooncake's handshake socket is IPv4, so PD needs an IPv4 host)
 * A wildcard or unset XLLM_BIND_HOST leaves the address as it is. Either way a stream socket bound
 * from a wildcard address is handed to the accept guard (peer_guard.c), which closes connections
 * from other local users. Every other bind() goes to the real one unchanged. XLLM_BIND_HOST is read
 * at each call. Built and loaded by memory/bind_host/__init__.py.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

/* peer_guard.c (same library, not exported): guard the listener on fd */
__attribute__((visibility("hidden"))) void xllm_guard_listener(int fd);

typedef int (*bind_fn)(int, const struct sockaddr *, socklen_t);

/* Looked up by the Python side to tell that the shim is loaded. */
const int xllm_bind_host_shim = 1;

static bind_fn real_bind(void) {
    static bind_fn fn; /* the same value whichever thread stores it */
    bind_fn f = __atomic_load_n(&fn, __ATOMIC_RELAXED);
    if (f == NULL) {
        f = (bind_fn)dlsym(RTLD_NEXT, "bind");
        __atomic_store_n(&fn, f, __ATOMIC_RELAXED);
    }
    return f;
}

static int is_wildcard(const struct sockaddr *addr, socklen_t len) {
    if (addr == NULL) return 0;
    if (addr->sa_family == AF_INET && len >= (socklen_t)sizeof(struct sockaddr_in))
        return ((const struct sockaddr_in *)addr)->sin_addr.s_addr == htonl(INADDR_ANY);
    if (addr->sa_family == AF_INET6 && len >= (socklen_t)sizeof(struct sockaddr_in6))
        return IN6_IS_ADDR_UNSPECIFIED(&((const struct sockaddr_in6 *)addr)->sin6_addr);
    return 0;
}

/* bind() of a wildcard address (is_wildcard), moved to XLLM_BIND_HOST as the table above says. */
static int confined_bind(bind_fn next, int fd, const struct sockaddr *addr, socklen_t len) {
    const char *host = getenv("XLLM_BIND_HOST");
    if (host == NULL || *host == '\0') return next(fd, addr, len);

    struct in_addr v4;
    struct in6_addr v6;
    int host_v4 = inet_pton(AF_INET, host, &v4) == 1;
    int host_v6 = !host_v4 && inet_pton(AF_INET6, host, &v6) == 1;
    if ((host_v4 && v4.s_addr == htonl(INADDR_ANY)) ||
        (host_v6 && IN6_IS_ADDR_UNSPECIFIED(&v6)) || (!host_v4 && !host_v6))
        return next(fd, addr, len); /* wildcard host, or not a literal (the Python side checks) */

    if (addr->sa_family == AF_INET) {
        struct sockaddr_in sin;
        memcpy(&sin, addr, sizeof sin);
        if (!host_v4) {
            static int said; /* once: callers may try many ports */
            if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
                fprintf(stderr, "xllm bind_host: refusing to bind IPv4 sockets to 0.0.0.0 (port %u): "
                                "XLLM_BIND_HOST=%s is IPv6\n", ntohs(sin.sin_port), host);
            errno = EADDRNOTAVAIL;
            return -1;
        }
        sin.sin_addr = v4;
        return next(fd, (const struct sockaddr *)&sin, sizeof sin);
    }
    struct sockaddr_in6 sin6; /* AF_INET6 */
    memcpy(&sin6, addr, sizeof sin6);
    if (host_v6) {
        sin6.sin6_addr = v6;
    } else {
        memset(&sin6.sin6_addr, 0, sizeof sin6.sin6_addr);
        sin6.sin6_addr.s6_addr[10] = 0xff;
        sin6.sin6_addr.s6_addr[11] = 0xff;
        memcpy(&sin6.sin6_addr.s6_addr[12], &v4, 4);
    }
    return next(fd, (const struct sockaddr *)&sin6, sizeof sin6);
}

int bind(int fd, const struct sockaddr *addr, socklen_t len) {
    bind_fn next = real_bind();
    if (next == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (!is_wildcard(addr, len)) return next(fd, addr, len);
    int rc = confined_bind(next, fd, addr, len);
    int type = 0;
    socklen_t type_len = sizeof type;
    if (rc == 0 && getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &type_len) == 0 && type == SOCK_STREAM)
        xllm_guard_listener(fd);
    return rc;
}
