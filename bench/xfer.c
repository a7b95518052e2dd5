// Where CRIU's pages can go during a freeze, and how fast (bench/freeze-transport.sh): the
// pages of a populated buffer are vmspliced into a 1 MiB pipe, as CRIU's parasite drains a
// frozen task, then moved on by one of
//   tmpfs  splice into a new file on tmpfs (CRIU's memwrite into image files today: every page
//          lands in a newly allocated page-cache page)
//   tcp    splice into a loopback TCP socket, received into memory already faulted in (CRIU's
//          page server, `runc checkpoint --page-server`)
//   pipe   read() from the pipe into memory already faulted in (CRIU's image streaming,
//          `criu dump --stream`, where the streamer owns the pipe)
// Single-threaded sender, like CRIU. Prints one JSON object.
//   cc -O2 -pthread -o xfer bench/xfer.c && ./xfer <MiB> tmpfs|tcp|pipe [tmpfs file]
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static const size_t PIPE_BYTES = 1 << 20;
static size_t total;
static char *dst;
static int rx_fd;

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static void die(const char *what) { perror(what); exit(1); }

static char *populated(size_t n) {
  char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) die("mmap");
  for (size_t i = 0; i < n; i += 4096) p[i] = (char)(i >> 12) | 1;
  return p;
}

static void *tcp_receiver(void *unused) {
  (void)unused;
  for (size_t off = 0; off < total;) {
    ssize_t r = recv(rx_fd, dst + off, total - off, 0);
    if (r <= 0) die("recv");
    off += (size_t)r;
  }
  return NULL;
}

// A connected loopback pair: the sending end is returned, the receiving end in rx_fd.
static int loopback_pair(void) {
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  int ls = socket(AF_INET, SOCK_STREAM, 0), tx = socket(AF_INET, SOCK_STREAM, 0), buf = 8 << 20;
  if (ls < 0 || tx < 0 || bind(ls, (void *)&a, sizeof a) || getsockname(ls, (void *)&a, &len) ||
      listen(ls, 1) || connect(tx, (void *)&a, sizeof a))
    die("loopback");
  if ((rx_fd = accept(ls, NULL, NULL)) < 0) die("accept");
  setsockopt(rx_fd, SOL_SOCKET, SO_RCVBUF, &buf, sizeof buf);
  setsockopt(tx, SOL_SOCKET, SO_SNDBUF, &buf, sizeof buf);
  close(ls);
  return tx;
}

int main(int argc, char **argv) {
  if (argc < 3) { fprintf(stderr, "usage: xfer <MiB> tmpfs|tcp|pipe [tmpfs file]\n"); return 2; }
  total = strtoul(argv[1], NULL, 10) << 20;
  const char *mode = argv[2], *file = argc > 3 ? argv[3] : "/dev/shm/stasis-xfer.img";
  int to_file = !strcmp(mode, "tmpfs"), to_tcp = !strcmp(mode, "tcp"), to_mem = !strcmp(mode, "pipe");
  if (!to_file && !to_tcp && !to_mem) { fprintf(stderr, "xfer: unknown mode %s\n", mode); return 2; }
  char *src = populated(total);
  if (!to_file) dst = populated(total);  // the receiver's memory, faulted in beforehand
  int p[2], out = -1;
  if (pipe(p) || fcntl(p[1], F_SETPIPE_SZ, PIPE_BYTES) < 0) die("pipe");
  pthread_t rx;
  if (to_file && (out = open(file, O_WRONLY | O_CREAT | O_TRUNC, 0600)) < 0) die("open");
  if (to_tcp) {
    out = loopback_pair();
    if (pthread_create(&rx, NULL, tcp_receiver, NULL)) die("pthread_create");
  }
  double t0 = now(), drain = 0;
  for (size_t off = 0; off < total;) {
    double a = now();
    struct iovec iv = {src + off, PIPE_BYTES < total - off ? PIPE_BYTES : total - off};
    ssize_t n = vmsplice(p[1], &iv, 1, 0);
    if (n <= 0) die("vmsplice");
    drain += now() - a;
    for (ssize_t left = n; left > 0;) {
      ssize_t m = to_mem ? read(p[0], dst + off + (n - left), (size_t)left)
                         : splice(p[0], NULL, out, NULL, (size_t)left, SPLICE_F_MOVE);
      if (m <= 0) die("move");
      left -= m;
    }
    off += (size_t)n;
  }
  if (to_tcp) pthread_join(rx, NULL);
  double t = now() - t0;
  if (to_file) unlink(file);
  printf("{\"mode\":\"%s\",\"mib\":%zu,\"ms\":%.0f,\"gbs\":%.2f,\"drain_ms\":%.0f}\n", mode,
         total >> 20, t * 1e3, total / t / 1e9, drain * 1e3);
  return 0;
}
