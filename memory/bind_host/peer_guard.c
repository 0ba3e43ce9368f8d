/* Admit only this user's and root's local peers on the listeners the bind shim confines.
 *
 * The Mooncake transfer engine authenticates nobody: whoever reaches its handshake or TCP data port
 * can read and write the registered KV memory, and binding loopback (bind_host.c) still lets every
 * local user in. So bind() hands each stream socket it binds from a wildcard address (Mooncake's two
 * listeners) to xllm_guard_listener, and accept() / accept4() on such a listener look up who owns
 * the peer's socket (peer_owner.c) and close the connection at once, before the library reads or
 * writes a byte of it, when that owner is neither this process's effective uid nor root, or when a
 * local peer's socket cannot be found. Peers on other hosts cannot be checked this way and are let
 * through (memory/transfer.py warns when the host is not loopback). Every other accept() is the
 * real one, unchanged.
 *
 * After a refusal a non-blocking listener is accepted again (so the caller gets the next connection
 * or EAGAIN, as epoll loops expect); a blocking one only while another connection is already queued,
 * else the call fails with EAGAIN rather than blocking past the caller's own timeout or stop flag.
 *
 * Exported, read by memory/bind_host/__init__.py: xllm_peers_refused (connections closed so far)
 * and xllm_listener_guarded(inode). Refusals are also written to stderr: the 1st, 2nd, 4th, 8th...
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

/* peer_owner.c: 1 and *uid for a live local peer socket, 0 for a peer not on this host, -1 else;
 * method 0: sock_diag, else /proc */
int xllm_peer_owner(int fd, int method, unsigned *uid);

#define MAX_LISTENERS 64

static unsigned long listener_inodes[MAX_LISTENERS]; /* 0: free; read without the lock */
static int listener_fds[MAX_LISTENERS];              /* to tell a slot whose socket is gone */
static pthread_mutex_t listeners_lock = PTHREAD_MUTEX_INITIALIZER;

/* Connections closed by the guard in this process. */
unsigned long xllm_peers_refused;

static unsigned long inode_of(int fd) {
    struct stat st;
    return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) ? (unsigned long)st.st_ino : 0;
}

/* Guard the listener on fd (bind_host.c calls it for each stream socket bound from a wildcard). */
__attribute__((visibility("hidden"))) void xllm_guard_listener(int fd) {
    unsigned long ino = inode_of(fd);
    if (ino == 0) return;
    pthread_mutex_lock(&listeners_lock);
    int slot = -1;
    for (int i = 0; i < MAX_LISTENERS; i++) {
        unsigned long cur = listener_inodes[i];
        if (cur == ino) {
            slot = -2; /* bound again: already guarded */
            break;
        }
        if (slot == -1 && (cur == 0 || inode_of(listener_fds[i]) != cur)) slot = i; /* free or stale */
    }
    if (slot >= 0) {
        listener_fds[slot] = fd;
        __atomic_store_n(&listener_inodes[slot], ino, __ATOMIC_RELEASE);
    } else if (slot == -1) {
        fprintf(stderr, "xllm peer_guard: more than %d wildcard listeners; fd %d is NOT guarded\n",
                MAX_LISTENERS, fd);
    }
    pthread_mutex_unlock(&listeners_lock);
}

/* Whether the listening socket with this inode is guarded. */
int xllm_listener_guarded(unsigned long ino) {
    if (ino == 0) return 0;
    for (int i = 0; i < MAX_LISTENERS; i++)
        if (__atomic_load_n(&listener_inodes[i], __ATOMIC_ACQUIRE) == ino) return 1;
    return 0;
}

static void report(int conn, int found, unsigned uid, unsigned long n) {
    struct sockaddr_storage l, p;
    socklen_t ll = sizeof l, pl = sizeof p;
    char host[INET6_ADDRSTRLEN] = "?";
    unsigned lport = 0, pport = 0;
    if (getsockname(conn, (struct sockaddr *)&l, &ll) == 0)
        lport = ntohs(l.ss_family == AF_INET ? ((struct sockaddr_in *)&l)->sin_port
                                             : ((struct sockaddr_in6 *)&l)->sin6_port);
    if (getpeername(conn, (struct sockaddr *)&p, &pl) == 0) {
        int v4 = p.ss_family == AF_INET;
        pport = ntohs(v4 ? ((struct sockaddr_in *)&p)->sin_port : ((struct sockaddr_in6 *)&p)->sin6_port);
        inet_ntop(p.ss_family, v4 ? (void *)&((struct sockaddr_in *)&p)->sin_addr
                                  : (void *)&((struct sockaddr_in6 *)&p)->sin6_addr, host, sizeof host);
    }
    char why[64];
    if (found == 1)
        snprintf(why, sizeof why, "its socket belongs to uid %u", uid);
    else
        snprintf(why, sizeof why, "its socket cannot be found (closed)");
    fprintf(stderr,
            "xllm peer_guard: closed a connection to port %u from %s port %u: %s, and only uid %u and "
            "root are admitted; %lu refused so far\n",
            lport, host, pport, why, (unsigned)geteuid(), n);
}

/* Whether the new connection conn may be served; counts and reports a refusal. */
static int admit(int conn) {
    unsigned uid = 0;
    int found = xllm_peer_owner(conn, 0, &uid);
    if (found == 0 || (found == 1 && (uid == geteuid() || uid == 0))) return 1;
    unsigned long n = __atomic_add_fetch(&xllm_peers_refused, 1, __ATOMIC_RELAXED);
    if ((n & (n - 1)) == 0) report(conn, found, uid, n);
    return 0;
}

static int accept_again(int fd) {
    int flags = fcntl(fd, F_GETFL);
    if (flags >= 0 && (flags & O_NONBLOCK)) return 1;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    return poll(&p, 1, 0) > 0;
}

typedef int (*accept4_fn)(int, struct sockaddr *, socklen_t *, int);

static accept4_fn real_accept4(void) {
    static accept4_fn fn; /* the same value whichever thread stores it */
    accept4_fn f = __atomic_load_n(&fn, __ATOMIC_RELAXED);
    if (f == NULL) {
        f = (accept4_fn)dlsym(RTLD_NEXT, "accept4");
        __atomic_store_n(&fn, f, __ATOMIC_RELAXED);
    }
    return f;
}

int accept4(int fd, struct sockaddr *addr, socklen_t *len, int flags) {
    accept4_fn next = real_accept4();
    if (next == NULL) {
        errno = ENOSYS;
        return -1;
    }
    if (xllm_listener_guarded(inode_of(fd)) == 0) return next(fd, addr, len, flags);
    socklen_t want = len != NULL ? *len : 0;
    for (;;) {
        if (len != NULL) *len = want; /* a refused peer's address must not shrink the next one's */
        int conn = next(fd, addr, len, flags);
        if (conn < 0 || admit(conn)) return conn;
        close(conn);
        if (!accept_again(fd)) {
            errno = EAGAIN;
            return -1;
        }
    }
}

/* accept() is accept4() without flags, in glibc and in the kernel. */
int accept(int fd, struct sockaddr *addr, socklen_t *len) { return accept4(fd, addr, len, 0); }
