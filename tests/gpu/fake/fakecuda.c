/*
 * A stand-in NVIDIA driver for tests/gpu/selftest.sh, on machines without a GPU: one shared
 * library that answers as libcuda.so.1 (the checkpoint API and the few device calls stasis makes)
 * and as libnvidia-ml.so.1 (the fingerprint and memory in use). The real `stasis` and
 * `stasis-gpu-roundtrip` load it through STASIS_LIBCUDA / STASIS_LIBNVML; the CPU stand-in for
 * torch (tests/gpu/fake/torch) loads it too, which makes its process a CUDA process to stasis
 * (libcuda.so mapped, a state the "driver" knows).
 *
 * Nothing here touches a GPU and no time it produces is a GPU time. What it does model:
 *  - the process states and the legal transitions of the checkpoint API (lock, checkpoint,
 *    restore, unlock; anything else is CUDA_ERROR_ILLEGAL_STATE), kept per pid in
 *    $STASIS_FAKE_GPU_DIR/proc/<pid> so that the caller (stasis) and the workload share them;
 *  - CUDA calls block while the process is not RUNNING (stasisFakeLaunch, which the fake torch
 *    calls for every step): a workload left LOCKED or CHECKPOINTED stops counting;
 *  - device memory: cuMemAlloc adds to the process's bytes; NVML's "used" counts the bytes of
 *    live processes that hold the GPU (RUNNING or LOCKED), so a checkpoint releases them;
 *  - the GPU and driver NVML describes: STASIS_FAKE_GPU_MODEL, STASIS_FAKE_GPU_DRIVER and
 *    STASIS_FAKE_GPU_UUID (defaults: an H200 on 580.159.04), read by the process that loads
 *    the library, so a restore can be made to run on "another node";
 *  - CUDA_VISIBLE_DEVICES: "" or "-1" hides the GPU (cuInit: CUDA_ERROR_NO_DEVICE), as the real
 *    driver does;
 *  - STASIS_FAKE_GPU_HANG=<lock|checkpoint|restore|unlock>: that call never returns (a hung
 *    driver call); STASIS_FAKE_GPU_FAIL=<call>: that call fails with CUDA_ERROR_OUT_OF_MEMORY
 *    and changes nothing (a restore that finds its GPU memory taken, cuda-checkpoint #44).
 * Every state-changing call is appended to $STASIS_FAKE_GPU_DIR/calls.log as
 * "<caller comm> <caller pid> <call> <target pid> [pairs N]", so tests can see who drove the GPU.
 *
 * Build: cc -shared -fPIC -O2 -o libcuda.so.1 fakecuda.c (selftest.sh does).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_ILLEGAL_STATE = 401,
};
enum { RUNNING = 0, LOCKED = 1, CHECKPOINTED = 2 };
enum { NVML_SUCCESS = 0, NVML_ERROR_INVALID_ARGUMENT = 2, NVML_ERROR_DRIVER_NOT_LOADED = 9 };

static const unsigned long long MEMORY_TOTAL = 143771566080ULL; /* an H200's 141 GiB (NVML) */
static const unsigned long long MEMORY_RESERVED = 512ULL << 20; /* the driver's own share */

static const char *env_or(const char *name, const char *fallback) {
    const char *v = getenv(name);
    return v && *v ? v : fallback;
}
static const char *dir(void) { return getenv("STASIS_FAKE_GPU_DIR"); }
static const char *model(void) { return env_or("STASIS_FAKE_GPU_MODEL", "NVIDIA H200"); }
static const char *driver(void) { return env_or("STASIS_FAKE_GPU_DRIVER", "580.159.04"); }
static const char *uuid(void) {
    return env_or("STASIS_FAKE_GPU_UUID", "GPU-5a5a5a5a-0000-4000-8000-000000000001");
}
static int cuda_version(void) { return atoi(driver()) >= 580 ? 13000 : 12080; }

static void copy_str(char *out, size_t len, const char *s) {
    if (!out || len == 0)
        return;
    snprintf(out, len, "%s", s);
}

/* ---- per-process state, shared between the caller and the workload through files ---- */

static int state_path(int pid, char *out, size_t len) {
    if (!dir())
        return -1;
    snprintf(out, len, "%s/proc/%d", dir(), pid);
    return 0;
}

/* Reads pid's state and device bytes; -1 when the pid is no CUDA process the driver knows. */
static int read_state(int pid, int *state, unsigned long long *bytes) {
    char p[4096];
    if (state_path(pid, p, sizeof p))
        return -1;
    FILE *f = fopen(p, "r");
    if (!f)
        return -1;
    int ok = fscanf(f, "%d %llu", state, bytes) == 2;
    fclose(f);
    return ok ? 0 : -1;
}

static int write_state(int pid, int state, unsigned long long bytes) {
    char p[4096], tmp[4200];
    if (state_path(pid, p, sizeof p))
        return -1;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", p, getpid());
    FILE *f = fopen(tmp, "w");
    if (!f)
        return -1;
    fprintf(f, "%d %llu\n", state, bytes);
    fclose(f);
    return rename(tmp, p);
}

/* Serialises read-modify-write of the state files between processes. */
static int lock_dir(void) {
    char p[4096];
    if (!dir())
        return -1;
    snprintf(p, sizeof p, "%s/lock", dir());
    int fd = open(p, O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    if (fd >= 0)
        flock(fd, LOCK_EX);
    return fd;
}
static void unlock_dir(int fd) {
    if (fd >= 0)
        close(fd);
}

static int alive(int pid) {
    char p[64], buf[512];
    snprintf(p, sizeof p, "/proc/%d/stat", pid);
    FILE *f = fopen(p, "r");
    if (!f)
        return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *close_paren = strrchr(buf, ')');
    return close_paren && close_paren[1] == ' ' && close_paren[2] != 'Z' && close_paren[2] != 'X';
}

static void log_call(const char *call, int pid, int pairs) {
    char p[4096], comm[64] = "?";
    if (!dir())
        return;
    FILE *c = fopen("/proc/self/comm", "r");
    if (c) {
        if (fgets(comm, sizeof comm, c))
            comm[strcspn(comm, "\n")] = 0;
        fclose(c);
    }
    snprintf(p, sizeof p, "%s/calls.log", dir());
    FILE *f = fopen(p, "a");
    if (!f)
        return;
    if (pairs >= 0)
        fprintf(f, "%s %d %s %d pairs %d\n", comm, getpid(), call, pid, pairs);
    else
        fprintf(f, "%s %d %s %d\n", comm, getpid(), call, pid);
    fclose(f);
}

static void maybe_hang(const char *call) {
    const char *h = getenv("STASIS_FAKE_GPU_HANG");
    if (h && strcmp(h, call) == 0)
        for (;;)
            pause();
}

/* One state change: from `from` to `to`, or CUDA_ERROR_ILLEGAL_STATE. */
static int transition(const char *call, int pid, int from, int to, int pairs) {
    if (!dir())
        return CUDA_ERROR_NOT_INITIALIZED;
    log_call(call, pid, pairs);
    maybe_hang(call);
    const char *fail = getenv("STASIS_FAKE_GPU_FAIL");
    if (fail && strcmp(fail, call) == 0)
        return CUDA_ERROR_OUT_OF_MEMORY;
    int fd = lock_dir();
    int state;
    unsigned long long bytes;
    int rc = CUDA_SUCCESS;
    if (read_state(pid, &state, &bytes) || !alive(pid))
        rc = CUDA_ERROR_INVALID_VALUE;
    else if (state != from)
        rc = CUDA_ERROR_ILLEGAL_STATE;
    else if (write_state(pid, to, bytes))
        rc = CUDA_ERROR_INVALID_VALUE;
    unlock_dir(fd);
    return rc;
}

/* ---- libcuda: what stasis calls ---- */

int cuInit(unsigned flags) {
    (void)flags;
    const char *vis = getenv("CUDA_VISIBLE_DEVICES");
    if (!dir())
        return CUDA_ERROR_NO_DEVICE;
    if (vis && (*vis == 0 || strcmp(vis, "-1") == 0))
        return CUDA_ERROR_NO_DEVICE;
    char p[4096];
    snprintf(p, sizeof p, "%s/proc", dir());
    mkdir(p, 0700);
    return CUDA_SUCCESS;
}
int cuDriverGetVersion(int *v) {
    if (!v)
        return CUDA_ERROR_INVALID_VALUE;
    *v = cuda_version();
    return CUDA_SUCCESS;
}
int cuDeviceGetCount(int *n) {
    if (!n)
        return CUDA_ERROR_INVALID_VALUE;
    *n = 1;
    return CUDA_SUCCESS;
}
int cuDeviceGet(int *dev, int ordinal) {
    if (!dev || ordinal != 0)
        return CUDA_ERROR_INVALID_DEVICE;
    *dev = 0;
    return CUDA_SUCCESS;
}
static int parse_uuid(unsigned char out[16]) {
    const char *s = uuid();
    if (strncmp(s, "GPU-", 4) == 0)
        s += 4;
    int n = 0;
    for (; *s && n < 16; s++) {
        if (*s == '-')
            continue;
        unsigned v;
        if (sscanf(s, "%2x", &v) != 1)
            return -1;
        out[n++] = (unsigned char)v;
        s++;
    }
    return n == 16 ? 0 : -1;
}
int cuDeviceGetUuid_v2(unsigned char *out, int dev) {
    if (!out || dev != 0)
        return CUDA_ERROR_INVALID_VALUE;
    return parse_uuid(out) ? CUDA_ERROR_INVALID_VALUE : CUDA_SUCCESS;
}
int cuDeviceGetUuid(unsigned char *out, int dev) { return cuDeviceGetUuid_v2(out, dev); }
int cuDeviceGetName(char *name, int len, int dev) {
    if (!name || len <= 0 || dev != 0)
        return CUDA_ERROR_INVALID_VALUE;
    copy_str(name, (size_t)len, model());
    return CUDA_SUCCESS;
}
int cuGetErrorName(int code, const char **s) {
    if (!s)
        return CUDA_ERROR_INVALID_VALUE;
    switch (code) {
    case CUDA_SUCCESS: *s = "CUDA_SUCCESS"; return CUDA_SUCCESS;
    case CUDA_ERROR_INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return CUDA_SUCCESS;
    case CUDA_ERROR_OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return CUDA_SUCCESS;
    case CUDA_ERROR_NOT_INITIALIZED: *s = "CUDA_ERROR_NOT_INITIALIZED"; return CUDA_SUCCESS;
    case CUDA_ERROR_NO_DEVICE: *s = "CUDA_ERROR_NO_DEVICE"; return CUDA_SUCCESS;
    case CUDA_ERROR_ILLEGAL_STATE: *s = "CUDA_ERROR_ILLEGAL_STATE"; return CUDA_SUCCESS;
    default: return CUDA_ERROR_INVALID_VALUE;
    }
}

int cuCheckpointProcessGetState(int pid, int *state) {
    unsigned long long bytes;
    if (!state)
        return CUDA_ERROR_INVALID_VALUE;
    if (!dir())
        return CUDA_ERROR_NOT_INITIALIZED;
    if (read_state(pid, state, &bytes) || !alive(pid))
        return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}
int cuCheckpointProcessGetRestoreThreadId(int pid, int *tid) {
    int state;
    if (!tid || cuCheckpointProcessGetState(pid, &state))
        return CUDA_ERROR_INVALID_VALUE;
    *tid = pid;
    return CUDA_SUCCESS;
}
int cuCheckpointProcessLock(int pid, void *args) {
    (void)args;
    return transition("lock", pid, RUNNING, LOCKED, -1);
}
int cuCheckpointProcessCheckpoint(int pid, void *args) {
    (void)args;
    return transition("checkpoint", pid, LOCKED, CHECKPOINTED, -1);
}
/* CUcheckpointRestoreArgs: gpuPairs at offset 0, gpuPairsCount at offset 8. */
struct restore_args {
    void *pairs;
    unsigned count;
};
int cuCheckpointProcessRestore(int pid, void *args) {
    const struct restore_args *a = args;
    return transition("restore", pid, CHECKPOINTED, LOCKED, a ? (int)a->count : 0);
}
int cuCheckpointProcessUnlock(int pid, void *args) {
    (void)args;
    return transition("unlock", pid, LOCKED, RUNNING, -1);
}

/* ---- libcuda: what the workload (the fake torch) calls ---- */

/* Makes the calling process a CUDA process: RUNNING, no device memory yet. */
int cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    static int token;
    if (dev != 0 || !dir())
        return CUDA_ERROR_INVALID_DEVICE;
    int fd = lock_dir();
    int state;
    unsigned long long bytes;
    int rc = CUDA_SUCCESS;
    if (read_state(getpid(), &state, &bytes) && write_state(getpid(), RUNNING, 0))
        rc = CUDA_ERROR_INVALID_VALUE;
    unlock_dir(fd);
    if (ctx)
        *ctx = &token;
    return rc;
}

/* Blocks while the process is not RUNNING, as every CUDA call does when it is locked. */
int stasisFakeLaunch(void) {
    int state;
    unsigned long long bytes;
    for (;;) {
        if (read_state(getpid(), &state, &bytes))
            return CUDA_ERROR_NOT_INITIALIZED;
        if (state == RUNNING)
            return CUDA_SUCCESS;
        usleep(1000);
    }
}

int cuMemAlloc_v2(unsigned long long *dptr, size_t size) {
    static unsigned long long next = 0x7f0000000000ULL;
    int rc = stasisFakeLaunch();
    if (rc)
        return rc;
    int fd = lock_dir();
    int state;
    unsigned long long bytes;
    if (read_state(getpid(), &state, &bytes) == 0)
        write_state(getpid(), state, bytes + size);
    unlock_dir(fd);
    if (dptr)
        *dptr = next;
    next += (size + 0xfffff) & ~0xfffffULL;
    return CUDA_SUCCESS;
}

/* ---- libnvidia-ml ---- */

int nvmlInit_v2(void) { return dir() ? NVML_SUCCESS : NVML_ERROR_DRIVER_NOT_LOADED; }
int nvmlShutdown(void) { return NVML_SUCCESS; }
int nvmlSystemGetDriverVersion(char *v, unsigned len) {
    copy_str(v, len, driver());
    return NVML_SUCCESS;
}
int nvmlSystemGetCudaDriverVersion_v2(int *v) {
    if (!v)
        return NVML_ERROR_INVALID_ARGUMENT;
    *v = cuda_version();
    return NVML_SUCCESS;
}
int nvmlSystemGetCudaDriverVersion(int *v) { return nvmlSystemGetCudaDriverVersion_v2(v); }
int nvmlDeviceGetCount_v2(unsigned *n) {
    if (!n)
        return NVML_ERROR_INVALID_ARGUMENT;
    *n = 1;
    return NVML_SUCCESS;
}
static int the_device;
int nvmlDeviceGetHandleByIndex_v2(unsigned i, void **dev) {
    if (i != 0 || !dev)
        return NVML_ERROR_INVALID_ARGUMENT;
    *dev = &the_device;
    return NVML_SUCCESS;
}
int nvmlDeviceGetName(void *dev, char *s, unsigned len) {
    (void)dev;
    copy_str(s, len, model());
    return NVML_SUCCESS;
}
int nvmlDeviceGetUUID(void *dev, char *s, unsigned len) {
    (void)dev;
    copy_str(s, len, uuid());
    return NVML_SUCCESS;
}

/* Device memory of live processes that hold the GPU, plus the driver's own. */
static unsigned long long used_bytes(void) {
    char p[4096];
    unsigned long long used = MEMORY_RESERVED;
    if (!dir())
        return used;
    snprintf(p, sizeof p, "%s/proc", dir());
    DIR *d = opendir(p);
    if (!d)
        return used;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid = atoi(e->d_name), state;
        unsigned long long bytes;
        if (pid > 0 && !strchr(e->d_name, '.') && read_state(pid, &state, &bytes) == 0 &&
            alive(pid) && (state == RUNNING || state == LOCKED))
            used += bytes;
    }
    closedir(d);
    return used;
}
struct nvml_memory {
    unsigned long long total, free, used;
};
int nvmlDeviceGetMemoryInfo(void *dev, struct nvml_memory *m) {
    (void)dev;
    if (!m)
        return NVML_ERROR_INVALID_ARGUMENT;
    m->total = MEMORY_TOTAL;
    m->used = used_bytes();
    m->free = m->total > m->used ? m->total - m->used : 0;
    return NVML_SUCCESS;
}
int nvmlDeviceGetPersistenceMode(void *dev, unsigned *mode) {
    (void)dev;
    if (!mode)
        return NVML_ERROR_INVALID_ARGUMENT;
    *mode = 0; /* off, as on the lent machines: nothing keeps the driver up between processes */
    return NVML_SUCCESS;
}
int nvmlDeviceGetMigMode(void *dev, unsigned *current, unsigned *pending) {
    (void)dev;
    if (!current || !pending)
        return NVML_ERROR_INVALID_ARGUMENT;
    *current = *pending = 0;
    return NVML_SUCCESS;
}
