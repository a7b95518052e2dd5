// This machine's memory limits, the floor under a freeze and a restore (bench/large.sh):
//   copy_gbs         memcpy between two buffers already faulted in (what CRIU's page copy
//                    can at best do: it moves every page once)
//   first_touch_gbs  writing fresh anonymous memory (page faults + zeroing + the write: what a
//                    restore pays to bring a page into a new process, whatever brings it)
// Single-threaded, like CRIU's dump and restore of one process. Prints one JSON object.
//   cc -O2 -o membw bench/membw.c && ./membw [MiB]
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec / 1e9;
}

static char *fresh(size_t n) {
  char *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) { perror("mmap"); exit(1); }
  return p;
}

int main(int argc, char **argv) {
  size_t mib = argc > 1 ? strtoul(argv[1], NULL, 10) : 1024;
  size_t n = mib << 20;
  double best_touch = 0, best_copy = 0;
  for (int round = 0; round < 3; round++) {
    char *a = fresh(n), *b = fresh(n);
    double t = now();
    memset(a, round + 1, n);
    double touch = n / (now() - t) / 1e9;
    memset(b, 0, n);
    t = now();
    memcpy(b, a, n);
    double copy = n / (now() - t) / 1e9;
    if (b[n - 1] != round + 1) return 2;
    if (touch > best_touch) best_touch = touch;
    if (copy > best_copy) best_copy = copy;
    munmap(a, n);
    munmap(b, n);
  }
  printf("{\"mib\":%zu,\"copy_gbs\":%.2f,\"first_touch_gbs\":%.2f}\n", mib, best_copy, best_touch);
  return 0;
}
