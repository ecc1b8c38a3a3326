/* A stand-in for libcuda.so.1 as strict as the CUDA driver's public contract: the calls a small
 * CUDA program makes (a context, device memory, work on a stream) and, by driver generation,
 * the checkpoint API (cuCheckpointProcess*) that another process calls on it.
 *
 * Built by the tests with gcc, one library per generation:
 *   -DDRIVER_VERSION=12040                                r550: no checkpoint API
 *   -DDRIVER_VERSION=12080 -DCHECKPOINT_API               r570: the API; restore args must be zero
 *   -DDRIVER_VERSION=13000 -DCHECKPOINT_API -DREMAP       r580: restore onto other GPUs (gpuPairs)
 *
 * The sources every behaviour below cites:
 *   [README]  NVIDIA/cuda-checkpoint's README: a suspend locks the driver APIs that launch work
 *             or touch GPU state (they block until resumed; CPU threads run on), completes the
 *             work already submitted (stream callbacks too), copies device memory "into
 *             allocations managed by the CUDA driver" in the process, then releases every GPU
 *             resource; a resume re-acquires the GPUs, copies the memory back to its original
 *             addresses and unlocks.
 *   [API]     The CUDA driver API reference, checkpoint group (and cuda-python's docs of it):
 *             lock only from RUNNING, left RUNNING when its timeout passes (0: no timeout);
 *             checkpoint only from LOCKED; restore only from CHECKPOINTED, onto a GPU with room
 *             and of the same chip, pairs covering every GPU; restore needs cuInit in the caller
 *             (or persistence mode); unlock only from LOCKED; reserved fields must be zero.
 *   [CRIU]    CRIU's plugins/cuda README and history: the calls are served by a
 *             checkpoint/restore thread inside the target (a stopped target cannot serve them);
 *             cuda-checkpoint on a process without CUDA prints "initialization error".
 *   [#25] [#30] [#35] [#37] [#41] [#44] [#58]  NVIDIA/cuda-checkpoint issues: root without
 *             persistence mode gets NOT_PERMITTED and the target dies; with NCCL a call on a
 *             peer hangs while one is locked; pairs must be a full permutation of the node's
 *             GPUs; GetState returns 304 in some containers; caller and target share a PID
 *             namespace; a restore out of memory leaves the process CHECKPOINTED, after which
 *             restore is 304 and unlock 401 for good; lock has crashed a target.
 *
 * Everything lives in the folder FAKE_CUDA_STATE names (mode 1777: targets of other users
 * write there too); every access takes an exclusive flock on <folder>/lock.
 *   gpus         what the kernel-mode driver sees, one GPU a line in index order:
 *                  <uuid> <total bytes> <context bytes> <name...>
 *   fill         memory something else holds: <uuid> <bytes> a line
 *   persistence  "off": persistence mode is off (default on)
 *   proc-<pid>   a process that initialised CUDA, written by itself:
 *                  <start time> <state> <uuid|-> <device bytes> <context bytes> <copy bytes> <wedged>
 *   sock-<pid>   where its checkpoint thread listens [CRIU]
 *   script       lines the test writes:
 *                  fail <function> <pid|*> <CUresult number> <once|always> [<state left>]
 *                  delay <function> <pid|*> <milliseconds>     sleeps before the call acts
 *                  hang <function> <pid|*>                     blocks until the line is removed
 *                  crash <function> <pid|*>                    the target dies as the call comes
 *                  rate <bytes per second>                     checkpoint and restore copy speed
 *   calls        appended per checkpoint call: <function>\t<pid|->\t<arguments>\t<CUresult name>
 *
 * A target's device memory is host memory mapped at the address cuMemAlloc returns: touched
 * only when written, unless FAKE_CUDA_RESIDENT=1 (a simulated node measures device memory as
 * resident memory) touches it at once. A checkpoint copies it into malloc'd memory of the
 * target, charged to the target's memory cgroup as the driver's copy is [README].
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#ifndef DRIVER_VERSION
#define DRIVER_VERSION 12040
#endif

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_OUT_OF_MEMORY 2
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_NO_DEVICE 100
#define CUDA_ERROR_INVALID_DEVICE 101
#define CUDA_ERROR_INVALID_CONTEXT 201
#define CUDA_ERROR_OPERATING_SYSTEM 304
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_NOT_PERMITTED 800
#define CUDA_ERROR_TIMEOUT 909
#define CUDA_ERROR_UNKNOWN 999

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef void (*CUhostFn)(void *);
typedef struct { unsigned char bytes[16]; } CUuuid;

#define UNUSED __attribute__((unused))

static const struct { int code; const char *name, *text; } RESULTS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
#define NRESULTS (sizeof RESULTS / sizeof RESULTS[0])

/* CUprocessState, with the transitions newer drivers report (4 and 5). */
static const char *STATE_NAMES[] = {"running", "locked", "checkpointed", "failed",
                                    "checkpointing", "restoring"};
enum { RUNNING, LOCKED, CHECKPOINTED, FAILED, CHECKPOINTING, RESTORING, NSTATES };

CUresult cuGetErrorName(CUresult error, const char **out) {
    for (size_t i = 0; i < NRESULTS; i++)
        if (RESULTS[i].code == error) { *out = RESULTS[i].name; return CUDA_SUCCESS; }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuGetErrorString(CUresult error, const char **out) {
    for (size_t i = 0; i < NRESULTS; i++)
        if (RESULTS[i].code == error) { *out = RESULTS[i].text; return CUDA_SUCCESS; }
    *out = NULL;
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult cuDriverGetVersion(int *version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = DRIVER_VERSION;
    return CUDA_SUCCESS;
}

/* --- the shared folder ------------------------------------------------------------------ */

static int path_of(char *out, size_t size, const char *name) {
    const char *root = getenv("FAKE_CUDA_STATE");
    if (!root || !*root) return -1;
    return snprintf(out, size, "%s/%s", root, name) < (int)size ? 0 : -1;
}

/* An exclusive lock on the folder: -1 when there is no folder to share. */
static int take(void) {
    char path[4096];
    if (path_of(path, sizeof path, "lock") != 0) return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {}
    return fd;
}

static void give(int fd) {
    if (fd >= 0) { flock(fd, LOCK_UN); close(fd); }
}

static void sleep_ms(long ms) {
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
}

/* The process's start time (clock ticks since boot): a record of a pid that now names another
 * process is not that process's. 0 when it cannot be read. */
static unsigned long long start_time(int pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p) return 0;
    unsigned long long value = 0;
    /* Field 22 is the start time: the 20th after the command name. */
    for (int field = 0; p && field < 20; field++) p = strchr(p + 1, ' ');
    if (p) sscanf(p + 1, "%llu", &value);
    return value;
}

/* This process's pid as the node numbers it (the first of NSpid): a process in a PID namespace
 * of its own is numbered so by the driver and by whoever calls it from the host. */
static int self_pid(void) {
    char line[256];
    int pid = getpid();
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return pid;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "NSpid: %d", &pid) == 1) break;
    fclose(f);
    return pid;
}

static int exists(int pid) { return pid > 0 && !(kill(pid, 0) != 0 && errno == ESRCH); }

/* One GPU of the node: [API] a restore or an allocation needs room on it. */
typedef struct { char uuid[64]; unsigned long long total, context; char name[96]; } gpu_t;
#define MAX_GPUS 16

static int read_gpus(gpu_t *gpus) {
    char path[4096], line[512];
    int n = 0;
    if (path_of(path, sizeof path, "gpus") != 0) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    while (n < MAX_GPUS && fgets(line, sizeof line, f)) {
        int offset = 0;
        if (sscanf(line, "%63s %llu %llu %n", gpus[n].uuid, &gpus[n].total, &gpus[n].context,
                   &offset) >= 3) {
            snprintf(gpus[n].name, sizeof gpus[n].name, "%s", offset ? line + offset : "");
            gpus[n].name[strcspn(gpus[n].name, "\n")] = 0;
            n++;
        }
    }
    fclose(f);
    return n;
}

/* A process's record: what it holds where, and its checkpoint state. */
typedef struct {
    unsigned long long start, device, context, copy;
    int state, wedged;
    char uuid[64];
} record_t;

static int read_record(int pid, record_t *r) {
    char name[64], path[4096], state[32];
    snprintf(name, sizeof name, "proc-%d", pid);
    if (path_of(path, sizeof path, name) != 0) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int ok = fscanf(f, "%llu %31s %63s %llu %llu %llu %d", &r->start, state, r->uuid, &r->device,
                    &r->context, &r->copy, &r->wedged) == 7;
    fclose(f);
    if (!ok) return -1;
    r->state = RUNNING;
    for (int i = 0; i < NSTATES; i++)
        if (strcmp(state, STATE_NAMES[i]) == 0) r->state = i;
    return 0;
}

/* Bytes live processes and fills hold on ``uuid``, leaving out process ``except``. Called with
 * the folder locked. */
static unsigned long long held_on(const char *uuid, int except) {
    char path[4096], line[256];
    unsigned long long sum = 0;
    if (path_of(path, sizeof path, "fill") == 0) {
        FILE *f = fopen(path, "r");
        if (f) {
            char who[64];
            unsigned long long bytes;
            while (fgets(line, sizeof line, f))
                if (sscanf(line, "%63s %llu", who, &bytes) == 2 && strcmp(who, uuid) == 0)
                    sum += bytes;
            fclose(f);
        }
    }
    const char *root = getenv("FAKE_CUDA_STATE");
    DIR *dir = root ? opendir(root) : NULL;
    if (!dir) return sum;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL) {
        int pid;
        record_t r;
        if (sscanf(entry->d_name, "proc-%d", &pid) != 1 || pid == except) continue;
        if (read_record(pid, &r) != 0 || strcmp(r.uuid, uuid) != 0) continue;
        if (!exists(pid) || start_time(pid) != r.start) continue;  /* gone: it holds nothing */
        sum += r.device + r.context;
    }
    closedir(dir);
    return sum;
}

static const gpu_t *gpu_named(const gpu_t *gpus, int n, const char *uuid) {
    for (int i = 0; i < n; i++)
        if (strcasecmp(gpus[i].uuid, uuid) == 0) return &gpus[i];
    return NULL;
}

/* What ``uuid`` has free for process ``pid``. Called with the folder locked. */
static unsigned long long free_on(const char *uuid, int pid) {
    gpu_t gpus[MAX_GPUS];
    const gpu_t *g = gpu_named(gpus, read_gpus(gpus), uuid);
    if (!g) return 0;
    unsigned long long held = held_on(uuid, pid);
    return held >= g->total ? 0 : g->total - held;
}

/* --- the test's script ---------------------------------------------------------------------- */

static int matches(const char *want_fn, const char *want_pid, const char *fn, int pid) {
    char who[16];
    snprintf(who, sizeof who, "%d", pid);
    return strcmp(want_fn, fn) == 0 && (strcmp(want_pid, "*") == 0 || strcmp(want_pid, who) == 0);
}

/* The scripted failure of this call, if any (a "once" is used up); -1 for none. Called with
 * the folder locked. */
static CUresult scripted(const char *fn, int pid, int *leaves) {
    char path[4096], tmp[4200], line[512];
    *leaves = -1;
    if (path_of(path, sizeof path, "script") != 0) return -1;
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    char *kept = NULL;
    size_t kept_len = 0;
    FILE *rest = open_memstream(&kept, &kept_len);
    CUresult found = -1;
    int used_once = 0;
    while (fgets(line, sizeof line, f)) {
        char kind[16], want_fn[64], want_pid[16], when[16] = "", state[32] = "";
        int code;
        int n = sscanf(line, "%15s %63s %15s %d %15s %31s", kind, want_fn, want_pid, &code, when,
                       state);
        if (found == -1 && n >= 5 && strcmp(kind, "fail") == 0 && matches(want_fn, want_pid, fn, pid)) {
            found = code;
            for (int i = 0; n == 6 && i < NSTATES; i++)
                if (strcmp(state, STATE_NAMES[i]) == 0) *leaves = i;
            if (strcmp(when, "once") == 0) { used_once = 1; continue; }
        }
        fputs(line, rest);
    }
    fclose(f);
    fclose(rest);
    if (used_once) {
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        FILE *out = fopen(tmp, "w");
        if (out) {
            fwrite(kept, 1, kept_len, out);
            fclose(out);
            rename(tmp, path);
        }
    }
    free(kept);
    return found;
}

/* Whether a script line ``<kind> <fn> <pid|*>`` names this call (``fn`` NULL: any line of
 * that kind, whose number goes to ``value``). Takes the lock unless ``locked``. */
static int script_line(const char *kind, const char *fn, int pid, long *value, int locked) {
    char path[4096], line[512];
    int found = 0;
    if (path_of(path, sizeof path, "script") != 0) return 0;
    int fd = locked ? -1 : take();
    FILE *f = fopen(path, "r");
    if (f) {
        while (fgets(line, sizeof line, f)) {
            char k[16], want_fn[64] = "", want_pid[16] = "";
            long number = 0;
            if (sscanf(line, "%15s", k) != 1 || strcmp(k, kind) != 0) continue;
            if (!fn) {
                if (sscanf(line, "%*s %ld", &number) == 1) { *value = number; found = 1; }
                continue;
            }
            int n = sscanf(line, "%*s %63s %15s %ld", want_fn, want_pid, &number);
            if (n >= 2 && matches(want_fn, want_pid, fn, pid)) {
                found = 1;
                if (value) *value += number;
            }
        }
        fclose(f);
    }
    give(fd);
    return found;
}

static int script_says(const char *kind, const char *fn, int pid, long *value) {
    return script_line(kind, fn, pid, value, 0);
}

static const char *result_name(CUresult r) {
    const char *name = NULL;
    return cuGetErrorName(r, &name) == CUDA_SUCCESS ? name : "CUDA_ERROR_UNKNOWN";
}

static void log_call(const char *fn, int pid, const char *args, CUresult r) {
    char path[4096], who[16] = "-";
    if (path_of(path, sizeof path, "calls") != 0) return;
    int fd = take();
    FILE *f = fopen(path, "a");
    if (f) {
        if (pid != -1) snprintf(who, sizeof who, "%d", pid);
        fprintf(f, "%s\t%s\t%s\t%s\n", fn, who, args, result_name(r));
        fclose(f);
    }
    give(fd);
}

/* --- a CUDA process: its context, memory and work ------------------------------------------ */

typedef struct alloc {
    char *device;   /* stands in for the GPU memory, at the address cuMemAlloc gave out */
    char *copy;     /* the checkpoint's copy in the process's own memory [README] */
    size_t size;
    struct alloc *next;
} alloc_t;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static int initialised;        /* cuInit succeeded in this process */
static int state = RUNNING;    /* this process's checkpoint state */
static int locking;            /* a lock is being taken: new calls wait [README] */
static int busy;               /* calls under way and stream work in flight [README] */
static int wedged;             /* a restore ran out of memory [#44] */
static int have_context;
static char gpu[64] = "-";     /* the GPU of its context */
static unsigned long long context_bytes, device_bytes, copy_bytes;
static alloc_t *allocs;
static pthread_t server;
static int serving;

/* Its record, for GetState, for NVML's stand-in and for the room others see. Called with
 * ``mu`` held. */
static void write_record(void) {
    char name[64], path[4096], tmp[4200];
    int me = self_pid();
    snprintf(name, sizeof name, "proc-%d", me);
    if (path_of(path, sizeof path, name) != 0) return;
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", path, me);
    int fd = take();
    FILE *f = fopen(tmp, "w");
    if (f) {
        fprintf(f, "%llu %s %s %llu %llu %llu %d\n", start_time(me), STATE_NAMES[state],
                gpu, device_bytes, have_context ? context_bytes : 0, copy_bytes, wedged);
        fclose(f);
        chmod(tmp, 0644);
        rename(tmp, path);
    }
    give(fd);
}

/* A call that touches the GPU: it waits while the process is locked or checkpointed, and
 * counts as work a lock waits for [README]. */
static void enter(void) {
    pthread_mutex_lock(&mu);
    while (state != RUNNING || locking) pthread_cond_wait(&changed, &mu);
    busy++;
    pthread_mutex_unlock(&mu);
}

static void leave(void) {
    pthread_mutex_lock(&mu);
    busy--;
    pthread_cond_broadcast(&changed);
    pthread_mutex_unlock(&mu);
}

static long copy_rate(void) {
    long rate = 0;
    return script_says("rate", NULL, 0, &rate) ? rate : 0;
}

/* Copies ``size`` bytes at the scripted rate, in 16 MiB steps. */
static void slow_copy(char *to, const char *from, size_t size, long rate) {
    const size_t step = 16u << 20;
    for (size_t done = 0; done < size; done += step) {
        size_t n = size - done < step ? size - done : step;
        memcpy(to + done, from + done, n);
        if (rate > 0) sleep_ms((long)((double)n * 1000.0 / (double)rate));
    }
}

/* The requests of the checkpoint API, served in this process [CRIU]; each answers a CUresult.
 * Called with ``mu`` held; returns with it held. */
static CUresult serve_lock(unsigned int timeout_ms) {
    if (state != RUNNING) return CUDA_ERROR_ILLEGAL_STATE;  /* [API] */
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_ms / 1000;
    until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec++; until.tv_nsec -= 1000000000L; }
    locking = 1;  /* calls from now on wait [README] */
    while (busy > 0) {
        /* Submitted work is completed first; past the timeout it stays RUNNING [API]. */
        if (timeout_ms == 0) pthread_cond_wait(&changed, &mu);
        else if (pthread_cond_timedwait(&changed, &mu, &until) == ETIMEDOUT) break;
    }
    locking = 0;
    if (busy > 0) {
        pthread_cond_broadcast(&changed);
        return CUDA_ERROR_TIMEOUT;
    }
    state = LOCKED;
    write_record();
    return CUDA_SUCCESS;
}

static CUresult serve_checkpoint(void) {
    if (state != LOCKED) return CUDA_ERROR_ILLEGAL_STATE;  /* [API] */
    long rate = copy_rate();
    state = CHECKPOINTING;
    write_record();
    pthread_mutex_unlock(&mu);
    /* Copied into the process's own memory, then every GPU resource released [README]. */
    for (alloc_t *a = allocs; a; a = a->next) {
        a->copy = malloc(a->size);
        if (!a->copy) abort();  /* as the host's OOM killer would end it */
        slow_copy(a->copy, a->device, a->size, rate);
    }
    for (alloc_t *a = allocs; a; a = a->next) madvise(a->device, a->size, MADV_DONTNEED);
    pthread_mutex_lock(&mu);
    copy_bytes = device_bytes;
    device_bytes = 0;
    have_context = 0;
    state = CHECKPOINTED;
    write_record();
    return CUDA_SUCCESS;
}

/* ``pairs``: "<old>=<new>" words, or NULL for none. */
static CUresult serve_restore(char *pairs) {
    if (state != CHECKPOINTED) return CUDA_ERROR_ILLEGAL_STATE;  /* [API] */
    if (wedged) return CUDA_ERROR_OPERATING_SYSTEM;  /* for good after one out of memory [#44] */
    char onto[64];
    snprintf(onto, sizeof onto, "%s", gpu);
    pairs += strspn(pairs, " \n");
    if (*pairs) {
        /* A full permutation of every GPU the kernel-mode driver sees, CUDA_VISIBLE_DEVICES or
         * not, each onto the same chip [#35] [API]. */
        gpu_t gpus[MAX_GPUS];
        int n = read_gpus(gpus), seen_old[MAX_GPUS] = {0}, seen_new[MAX_GPUS] = {0}, count = 0;
        for (char *word = strtok(pairs, " \n"); word; word = strtok(NULL, " \n"), count++) {
            char *eq = strchr(word, '=');
            if (!eq) return CUDA_ERROR_INVALID_VALUE;
            *eq = 0;
            const gpu_t *old = gpu_named(gpus, n, word), *new = gpu_named(gpus, n, eq + 1);
            if (!old || !new || strcmp(old->name, new->name) != 0) return CUDA_ERROR_INVALID_VALUE;
            if (seen_old[old - gpus]++ || seen_new[new - gpus]++) return CUDA_ERROR_INVALID_VALUE;
            if (strcasecmp(old->uuid, gpu) == 0) snprintf(onto, sizeof onto, "%s", new->uuid);
        }
        if (count != n) return CUDA_ERROR_INVALID_VALUE;
    }
    int fd = take();
    unsigned long long room = free_on(onto, self_pid());
    give(fd);
    if (room < copy_bytes + context_bytes) {
        wedged = 1;  /* stays CHECKPOINTED, and no later restore works [#44] */
        write_record();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    long rate = copy_rate();
    state = RESTORING;
    snprintf(gpu, sizeof gpu, "%s", onto);
    device_bytes = copy_bytes;
    have_context = 1;
    write_record();
    pthread_mutex_unlock(&mu);
    /* Back to the original addresses [README]. */
    for (alloc_t *a = allocs; a; a = a->next) {
        slow_copy(a->device, a->copy, a->size, rate);
        free(a->copy);
        a->copy = NULL;
    }
    pthread_mutex_lock(&mu);
    copy_bytes = 0;
    state = LOCKED;
    write_record();
    return CUDA_SUCCESS;
}

static CUresult serve_unlock(void) {
    if (state != LOCKED) return CUDA_ERROR_ILLEGAL_STATE;  /* wedged: still CHECKPOINTED [#44] */
    state = RUNNING;
    write_record();
    pthread_cond_broadcast(&changed);
    return CUDA_SUCCESS;
}

static void serve_one(int conn) {
    char request[8192];
    ssize_t n = 0, got;
    while (n < (ssize_t)sizeof request - 1 && (got = read(conn, request + n, sizeof request - 1 - n)) > 0) {
        n += got;
        if (memchr(request, '\n', (size_t)n)) break;
    }
    if (n <= 0) return;
    request[n] = 0;
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    unsigned int timeout_ms = 0;
    char word[32] = "";
    sscanf(request, "%31s", word);
    pthread_mutex_lock(&mu);
    if (strcmp(word, "lock") == 0 && sscanf(request, "lock %u", &timeout_ms) == 1) {
        r = serve_lock(timeout_ms);
    } else if (strcmp(word, "checkpoint") == 0) {
        r = serve_checkpoint();
    } else if (strcmp(word, "restore") == 0) {
        r = serve_restore(request + strlen("restore"));
    } else if (strcmp(word, "unlock") == 0) {
        r = serve_unlock();
    } else if (strcmp(word, "set") == 0) {
        /* The test puts the process in a state (as a driver failure would leave it). */
        char name[32] = "";
        sscanf(request, "set %31s", name);
        for (int i = 0; i < NSTATES; i++)
            if (strcmp(name, STATE_NAMES[i]) == 0) { state = i; r = CUDA_SUCCESS; }
        write_record();
        pthread_cond_broadcast(&changed);
    }
    pthread_mutex_unlock(&mu);
    char answer[32];
    int len = snprintf(answer, sizeof answer, "%d\n", r);
    if (write(conn, answer, (size_t)len) != len) {}
}

static void *serve(void *listener) {
    int fd = (int)(intptr_t)listener;
    for (;;) {
        int conn = accept4(fd, NULL, NULL, SOCK_CLOEXEC);
        if (conn < 0) {
            if (errno == EINTR) continue;
            return NULL;
        }
        serve_one(conn);
        close(conn);
    }
}

static int socket_path(int pid, struct sockaddr_un *addr) {
    char name[64];
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    snprintf(name, sizeof name, "sock-%d", pid);
    return path_of(addr->sun_path, sizeof addr->sun_path, name);
}

/* The checkpoint thread of a process that initialised CUDA [CRIU]. */
static void start_serving(void) {
    struct sockaddr_un addr;
    if (serving || socket_path(self_pid(), &addr) != 0) return;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    unlink(addr.sun_path);
    if (bind(fd, (struct sockaddr *)&addr, sizeof addr) != 0 || listen(fd, 16) != 0) {
        close(fd);
        return;
    }
    chmod(addr.sun_path, 0666);
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);  /* signals stay with the program's threads */
    if (pthread_create(&server, NULL, serve, (void *)(intptr_t)fd) == 0) {
        pthread_detach(server);
        serving = 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A child of fork() has no checkpoint thread and no CUDA: it initialises anew. */
static void forked(void) {
    initialised = serving = have_context = 0;
    state = RUNNING;
    locking = busy = wedged = 0;
    device_bytes = copy_bytes = 0;
    allocs = NULL;
    snprintf(gpu, sizeof gpu, "-");
}

CUresult cuInit(unsigned int flags) {
    char args[32];
    int leaves, fd = take();
    CUresult r = fd < 0 ? -1 : scripted("cuInit", -1, &leaves);
    give(fd);
    if (r == -1) r = flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) {
        pthread_mutex_lock(&mu);
        if (!initialised) {
            static int at_fork;
            if (!at_fork++) pthread_atfork(NULL, NULL, forked);
            initialised = 1;
            start_serving();
            write_record();
        }
        pthread_mutex_unlock(&mu);
    }
    snprintf(args, sizeof args, "flags=%u", flags);
    log_call("cuInit", -1, args, r);
    return r;
}

/* The GPUs this process may use: CUDA_VISIBLE_DEVICES (UUIDs or indexes, up to the first it
 * does not know, as CUDA reads it), else all of them. */
static int visible(gpu_t *out) {
    gpu_t all[MAX_GPUS];
    int n = read_gpus(all), count = 0;
    const char *list = getenv("CUDA_VISIBLE_DEVICES");
    if (!list) {
        memcpy(out, all, sizeof all);
        return n;
    }
    char copy[1024];
    snprintf(copy, sizeof copy, "%s", list);
    for (char *word = strtok(copy, ","); word && count < MAX_GPUS; word = strtok(NULL, ",")) {
        char *end;
        long index = strtol(word, &end, 10);
        const gpu_t *g = *end == 0 && *word ? (index >= 0 && index < n ? &all[index] : NULL)
                                             : gpu_named(all, n, word);
        if (!g) break;
        out[count++] = *g;
    }
    return count;
}

CUresult cuDeviceGetCount(int *count) {
    gpu_t gpus[MAX_GPUS];
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = visible(gpus);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    gpu_t gpus[MAX_GPUS];
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal < 0 || ordinal >= visible(gpus)) return CUDA_ERROR_INVALID_DEVICE;
    *device = ordinal;
    return CUDA_SUCCESS;
}

static CUresult device_uuid(CUuuid *uuid, CUdevice device) {
    gpu_t gpus[MAX_GPUS];
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= visible(gpus)) return CUDA_ERROR_INVALID_DEVICE;
    unsigned int b[16];
    if (sscanf(gpus[device].uuid, "GPU-%2x%2x%2x%2x-%2x%2x-%2x%2x-%2x%2x-%2x%2x%2x%2x%2x%2x", &b[0],
               &b[1], &b[2], &b[3], &b[4], &b[5], &b[6], &b[7], &b[8], &b[9], &b[10], &b[11],
               &b[12], &b[13], &b[14], &b[15]) != 16)
        return CUDA_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++) uuid->bytes[i] = (unsigned char)b[i];
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid *uuid, CUdevice device) { return device_uuid(uuid, device); }
CUresult cuDeviceGetUuid_v2(CUuuid *uuid, CUdevice device) { return device_uuid(uuid, device); }

/* The context: it takes the board's context bytes on its GPU, where there is room. */
static CUresult make_context(CUcontext *ctx, CUdevice device) {
    gpu_t gpus[MAX_GPUS];
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    if (device < 0 || device >= visible(gpus)) return CUDA_ERROR_INVALID_DEVICE;
    enter();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    if (!have_context) {
        int fd = take();
        unsigned long long room = free_on(gpus[device].uuid, self_pid());
        give(fd);
        if (room < gpus[device].context) {
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            snprintf(gpu, sizeof gpu, "%s", gpus[device].uuid);
            context_bytes = gpus[device].context;
            have_context = 1;
            write_record();
        }
    }
    pthread_mutex_unlock(&mu);
    leave();
    if (r == CUDA_SUCCESS) *ctx = (CUcontext)&have_context;
    return r;
}

CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device) { return make_context(ctx, device); }
CUresult cuCtxCreate_v2(CUcontext *ctx, unsigned int flags, CUdevice device) {
    (void)flags;
    return make_context(ctx, device);
}

CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    return ctx == (CUcontext)&have_context || ctx == NULL ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ptr || size == 0) return CUDA_ERROR_INVALID_VALUE;
    enter();
    CUresult r = CUDA_SUCCESS;
    pthread_mutex_lock(&mu);
    int fd = take();
    unsigned long long room = have_context ? free_on(gpu, self_pid()) : 0;
    give(fd);
    alloc_t *a = NULL;
    if (!have_context) {
        r = CUDA_ERROR_INVALID_CONTEXT;
    } else if (room < device_bytes + context_bytes + size) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else if (!(a = calloc(1, sizeof *a))) {
        r = CUDA_ERROR_OUT_OF_MEMORY;
    } else {
        a->device = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (a->device == MAP_FAILED) {
            free(a);
            r = CUDA_ERROR_OUT_OF_MEMORY;
        } else {
            const char *resident = getenv("FAKE_CUDA_RESIDENT");
            if (resident && strcmp(resident, "1") == 0)
                for (size_t at = 0; at < size; at += 4096) a->device[at] = 1;
            a->size = size;
            a->next = allocs;
            allocs = a;
            device_bytes += size;
            write_record();
            *ptr = (CUdeviceptr)(uintptr_t)a->device;
        }
    }
    pthread_mutex_unlock(&mu);
    leave();
    return r;
}

CUresult cuMemAlloc(CUdeviceptr *ptr, size_t size) { return cuMemAlloc_v2(ptr, size); }

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    enter();
    CUresult r = CUDA_ERROR_INVALID_VALUE;
    pthread_mutex_lock(&mu);
    for (alloc_t **at = &allocs; *at; at = &(*at)->next) {
        alloc_t *a = *at;
        if ((CUdeviceptr)(uintptr_t)a->device != ptr) continue;
        *at = a->next;
        munmap(a->device, a->size);
        device_bytes -= a->size;
        free(a);
        write_record();
        r = CUDA_SUCCESS;
        break;
    }
    pthread_mutex_unlock(&mu);
    leave();
    return r;
}

CUresult cuMemFree(CUdeviceptr ptr) { return cuMemFree_v2(ptr); }

/* The allocation holding [ptr, ptr + size), or NULL. Called with ``mu`` held. */
static alloc_t *holding(CUdeviceptr ptr, size_t size) {
    for (alloc_t *a = allocs; a; a = a->next) {
        CUdeviceptr base = (CUdeviceptr)(uintptr_t)a->device;
        if (ptr >= base && ptr + size <= base + a->size) return a;
    }
    return NULL;
}

static CUresult copy_device(void *host, CUdeviceptr device, size_t size, int to_device) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    enter();
    pthread_mutex_lock(&mu);
    alloc_t *a = holding(device, size);
    pthread_mutex_unlock(&mu);
    if (a) {
        if (to_device) memcpy((void *)(uintptr_t)device, host, size);
        else memcpy(host, (void *)(uintptr_t)device, size);
    }
    leave();
    return a ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr device, const void *host, size_t size) {
    return copy_device((void *)host, device, size, 1);
}
CUresult cuMemcpyDtoH_v2(void *host, CUdeviceptr device, size_t size) {
    return copy_device(host, device, size, 0);
}

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    enter();
    gpu_t gpus[MAX_GPUS];
    pthread_mutex_lock(&mu);
    int fd = take();
    const gpu_t *g = gpu_named(gpus, read_gpus(gpus), gpu);
    *total = g ? g->total : 0;
    *free_bytes = g ? free_on(gpu, -1) : 0;
    give(fd);
    pthread_mutex_unlock(&mu);
    leave();
    return g ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

/* Work on a stream: the host function runs on a thread of its own, and counts as submitted
 * work until it returns; a lock waits for it [README: "including stream callbacks"]. */
typedef struct { CUhostFn fn; void *data; } work_t;

static void *run_work(void *arg) {
    work_t work = *(work_t *)arg;
    free(arg);
    work.fn(work.data);
    leave();
    return NULL;
}

CUresult cuLaunchHostFunc(CUstream stream, CUhostFn fn, void *data) {
    (void)stream;
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    enter();  /* its busy count is given back when the function returns */
    work_t *work = malloc(sizeof *work);
    pthread_t thread;
    if (!work) { leave(); return CUDA_ERROR_OUT_OF_MEMORY; }
    work->fn = fn;
    work->data = data;
    if (pthread_create(&thread, NULL, run_work, work) != 0) {
        free(work);
        leave();
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    pthread_detach(thread);
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize(void) {
    if (!initialised) return CUDA_ERROR_NOT_INITIALIZED;
    enter();
    pthread_mutex_lock(&mu);
    while (busy > 1) pthread_cond_wait(&changed, &mu);  /* all but this call */
    pthread_mutex_unlock(&mu);
    leave();
    return CUDA_SUCCESS;
}

#ifdef CHECKPOINT_API

typedef struct { CUuuid oldUuid, newUuid; } CUcheckpointGpuPair;
typedef struct {
    unsigned int timeoutMs, reserved0;
    uint64_t reserved1[7];
} CUcheckpointLockArgs;
typedef struct {
    CUcheckpointGpuPair *gpuPairs;
    unsigned int gpuPairsCount;
    char reserved[52 - sizeof(CUcheckpointGpuPair *)];
    uint64_t reserved1;
} CUcheckpointRestoreArgs;
typedef struct { uint64_t reserved[8]; } CUcheckpointArgs;  /* checkpoint and unlock args */

_Static_assert(sizeof(CUcheckpointLockArgs) == 64, "lock args are 64 bytes");
_Static_assert(sizeof(CUcheckpointRestoreArgs) == 64, "restore args are 64 bytes");
_Static_assert(sizeof(CUcheckpointArgs) == 64, "args are 64 bytes");

static int zero(const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        if (b[i]) return 0;
    return 1;
}

static UNUSED void uuid_text(const CUuuid *u, char *out) {
    const unsigned char *b = u->bytes;
    sprintf(out, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x",
            b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12],
            b[13], b[14], b[15]);
}

static int same_pid_namespace(int pid) {
    char mine[64] = "", theirs[64] = "", path[64];
    snprintf(path, sizeof path, "/proc/%d/ns/pid", pid);
    if (readlink("/proc/self/ns/pid", mine, sizeof mine - 1) < 0) return 1;
    if (readlink(path, theirs, sizeof theirs - 1) < 0) return 1;
    return strcmp(mine, theirs) == 0;
}

static int persistence_off(void) {
    char path[4096], word[16] = "";
    if (path_of(path, sizeof path, "persistence") != 0) return 0;
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    int off = fscanf(f, "%15s", word) == 1 && strcmp(word, "off") == 0;
    fclose(f);
    return off;
}

/* Sends one request to the target's checkpoint thread and waits for its answer, without a
 * bound: a target that cannot serve (stopped, wedged) leaves the caller waiting [CRIU]. */
static CUresult ask_target(int pid, const char *request) {
    struct sockaddr_un addr;
    if (socket_path(pid, &addr) != 0) return CUDA_ERROR_UNKNOWN;
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return CUDA_ERROR_OPERATING_SYSTEM;
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) {
        close(fd);
        return exists(pid) ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_VALUE;
    }
    size_t len = strlen(request);
    CUresult r = CUDA_ERROR_OPERATING_SYSTEM;
    if (write(fd, request, len) == (ssize_t)len) {
        char answer[32] = "";
        ssize_t n, got = 0;
        while (got < (ssize_t)sizeof answer - 1 &&
               (n = read(fd, answer + got, sizeof answer - 1 - got)) > 0)
            got += n;
        /* A target that died under the call answers nothing. */
        if (got > 0) sscanf(answer, "%d", &r);
        else r = exists(pid) ? CUDA_ERROR_OPERATING_SYSTEM : CUDA_ERROR_INVALID_VALUE;
    }
    close(fd);
    return r;
}

/* One checkpoint call on ``pid``: the checks the driver makes, the test's script, then the
 * request to the target (NULL: GetState, answered from its record). */
static CUresult act(const char *fn, int pid, const char *args, int valid, const char *request,
                    int *state_out) {
    long ms = 0;
    if (script_says("delay", fn, pid, &ms) && ms > 0) sleep_ms(ms);
    while (script_says("hang", fn, pid, NULL)) sleep_ms(20);  /* [#30] */
    int fd = take();
    int leaves = -1;
    record_t rec;
    CUresult r = -1;
    if (fd < 0) r = CUDA_ERROR_UNKNOWN;  /* no FAKE_CUDA_STATE: nothing to act on */
    /* GetState needs no cuInit in the caller; the others do [API]. */
    else if (request && !initialised) r = CUDA_ERROR_NOT_INITIALIZED;
    else if (pid <= 0 || !exists(pid)) r = CUDA_ERROR_INVALID_VALUE;
    else if (!valid) r = CUDA_ERROR_INVALID_VALUE;
    /* A process that never initialised CUDA: "initialization error" [CRIU]. */
    else if (read_record(pid, &rec) != 0 || rec.start != start_time(pid)) r = CUDA_ERROR_NOT_INITIALIZED;
    else if (!same_pid_namespace(pid)) r = CUDA_ERROR_NOT_PERMITTED;  /* [#41] */
    else if ((r = scripted(fn, pid, &leaves)) != -1) {
        /* as scripted */
    } else if (request && geteuid() == 0 && persistence_off()) {
        kill(pid, SIGKILL);  /* as root without persistence mode the target died [#25] */
        r = CUDA_ERROR_NOT_PERMITTED;
    } else if (request && script_line("crash", fn, pid, NULL, 1)) {
        kill(pid, SIGKILL);  /* [#58] */
        r = CUDA_ERROR_UNKNOWN;
    }
    give(fd);
    if (r == -1 && request) r = ask_target(pid, request);
    else if (r == -1) {
        r = CUDA_SUCCESS;
        *state_out = rec.state;
    }
    if (leaves != -1) {
        char set[32];
        snprintf(set, sizeof set, "set %s\n", STATE_NAMES[leaves]);
        ask_target(pid, set);
    }
    log_call(fn, pid, args, r);
    return r;
}

CUresult cuCheckpointProcessGetState(int pid, int *state_out) {
    if (!state_out) return CUDA_ERROR_INVALID_VALUE;
    return act("cuCheckpointProcessGetState", pid, "-", 1, NULL, state_out);
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    char text[64] = "-", request[64];
    int valid = 1;
    unsigned int timeout_ms = 0;
    if (args) {
        snprintf(text, sizeof text, "timeoutMs=%u", args->timeoutMs);
        valid = args->reserved0 == 0 && zero(args->reserved1, sizeof args->reserved1);
        timeout_ms = args->timeoutMs;
    }
    snprintf(request, sizeof request, "lock %u\n", timeout_ms);
    return act("cuCheckpointProcessLock", pid, text, valid, request, NULL);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointArgs *args) {
    return act("cuCheckpointProcessCheckpoint", pid, args ? "args" : "-",
               !args || zero(args, sizeof *args), "checkpoint\n", NULL);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    char text[4096] = "-", request[4200] = "restore\n";
    int valid = 1;
    if (args) {
#ifdef REMAP
        unsigned int n = args->gpuPairsCount;
        valid = zero(args->reserved, sizeof args->reserved) && args->reserved1 == 0 &&
                (n == 0) == (args->gpuPairs == NULL) && n <= MAX_GPUS;
        if (valid && n == 0) snprintf(text, sizeof text, "gpuPairs=none");
        if (valid && n > 0) {
            size_t at = (size_t)snprintf(text, sizeof text, "gpuPairs=");
            size_t req = (size_t)snprintf(request, sizeof request, "restore");
            for (unsigned int i = 0; i < n; i++) {
                char old[48], new[48];
                uuid_text(&args->gpuPairs[i].oldUuid, old);
                uuid_text(&args->gpuPairs[i].newUuid, new);
                at += (size_t)snprintf(text + at, sizeof text - at, "%s%s>%s", i ? "," : "", old, new);
                req += (size_t)snprintf(request + req, sizeof request - req, " %s=%s", old, new);
            }
            snprintf(request + req, sizeof request - req, "\n");
        }
#else
        /* r570's restore args are reserved bytes only, to be zeroed: pairs are refused. */
        valid = zero(args, sizeof *args);
        snprintf(text, sizeof text, valid ? "gpuPairs=none" : "args-not-zero");
#endif
    }
    return act("cuCheckpointProcessRestore", pid, text, valid, request, NULL);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointArgs *args) {
    return act("cuCheckpointProcessUnlock", pid, args ? "args" : "-",
               !args || zero(args, sizeof *args), "unlock\n", NULL);
}

#endif /* CHECKPOINT_API */
