/* A stand-in for libcuda.so.1: cuInit, cuDriverGetVersion, the error strings and, by driver
 * generation, the checkpoint API (cuCheckpointProcess*), acting on real pids.
 *
 * Built by the tests with gcc, one library per generation:
 *   -DDRIVER_VERSION=12040                                r550: no checkpoint API
 *   -DDRIVER_VERSION=12080 -DCHECKPOINT_API               r570: the API; restore args must be zero
 *   -DDRIVER_VERSION=13000 -DCHECKPOINT_API -DREMAP       r580: restore onto other GPUs (gpuPairs)
 *
 * Everything lives in the folder FAKE_CUDA_STATE names, so the test and the process under test
 * share it; every call takes an exclusive flock on <folder>/lock first.
 *   state-<pid>  the pid's state: running (also when absent), locked, checkpointed, failed,
 *                checkpointing, restoring
 *   script       lines the test writes:
 *                  fail <function> <pid|*> <CUresult number> <once|always> [<state left>]
 *                  delay <function> <pid|*> <milliseconds>
 *                a "fail" returns that CUresult instead of acting (cuInit's pid is *) and, if
 *                given, leaves the pid in <state left>; a "once" line is removed when it fires.
 *                A "delay" sleeps (outside the lock) before the call acts.
 *   calls        appended per call: <function>\t<pid|->\t<arguments>\t<CUresult name>
 *                arguments: "-" for NULL args; lock: timeoutMs=<ms>; restore: gpuPairs=none or
 *                gpuPairs=<old>><new>,...; cuInit: flags=<n>.
 *
 * As the driver: a pid that does not exist (kill(pid, 0) says ESRCH) is CUDA_ERROR_INVALID_VALUE
 * (the header lists no other code for a bad pid); any nonzero reserved byte in an args struct is
 * CUDA_ERROR_INVALID_VALUE ("must be zeroed"), which is also how r570 refuses gpuPairs; a call
 * before cuInit is CUDA_ERROR_NOT_INITIALIZED; lock only from running, checkpoint only from
 * locked, restore only from checkpointed (then locked), unlock only from locked, else
 * CUDA_ERROR_ILLEGAL_STATE.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#ifndef DRIVER_VERSION
#define DRIVER_VERSION 12040
#endif

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_INITIALIZED 3
#define CUDA_ERROR_ILLEGAL_STATE 401
#define CUDA_ERROR_UNKNOWN 999

typedef int CUresult;

/* Helpers of the checkpoint API, which r550 leaves out. */
#define UNUSED __attribute__((unused))

static const struct { int code; const char *name, *text; } RESULTS[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};
#define NRESULTS (sizeof RESULTS / sizeof RESULTS[0])

static const char *STATE_NAMES[] = {"running", "locked", "checkpointed", "failed",
                                    "checkpointing", "restoring"};
enum { RUNNING, LOCKED, CHECKPOINTED, FAILED, NSTATES = 6 };

static int initialised;

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
    int fd = open(path, O_RDWR | O_CREAT, 0644);
    if (fd < 0) return -1;
    while (flock(fd, LOCK_EX) != 0 && errno == EINTR) {}
    return fd;
}

static void give(int fd) {
    if (fd >= 0) { flock(fd, LOCK_UN); close(fd); }
}

static const char *result_name(CUresult r) {
    const char *name = NULL;
    return cuGetErrorName(r, &name) == CUDA_SUCCESS ? name : "CUDA_ERROR_UNKNOWN";
}

static void log_call(const char *fn, int pid, const char *args, CUresult r) {
    char path[4096], who[16] = "-";
    if (path_of(path, sizeof path, "calls") != 0) return;
    FILE *f = fopen(path, "a");
    if (!f) return;
    if (pid != -1) snprintf(who, sizeof who, "%d", pid);
    fprintf(f, "%s\t%s\t%s\t%s\n", fn, who, args, result_name(r));
    fclose(f);
}

static UNUSED int get_state(int pid) {
    char path[4096], name[32] = "";
    snprintf(path, sizeof path, "state-%d", pid);
    char full[4096];
    if (path_of(full, sizeof full, path) != 0) return RUNNING;
    FILE *f = fopen(full, "r");
    if (!f) return RUNNING;
    if (fscanf(f, "%31s", name) != 1) name[0] = 0;
    fclose(f);
    for (int i = 0; i < NSTATES; i++)
        if (strcmp(name, STATE_NAMES[i]) == 0) return i;
    return RUNNING;
}

static UNUSED void set_state(int pid, int state) {
    char name[64], full[4096], tmp[4200];
    snprintf(name, sizeof name, "state-%d", pid);
    if (path_of(full, sizeof full, name) != 0) return;
    snprintf(tmp, sizeof tmp, "%s.tmp", full);
    FILE *f = fopen(tmp, "w");
    if (!f) return;
    fprintf(f, "%s\n", STATE_NAMES[state]);
    fclose(f);
    rename(tmp, full);
}

static int matches(const char *want_fn, const char *want_pid, const char *fn, int pid) {
    char who[16];
    snprintf(who, sizeof who, "%d", pid);
    return strcmp(want_fn, fn) == 0 && (strcmp(want_pid, "*") == 0 || strcmp(want_pid, who) == 0);
}

/* The scripted failure for this call, if any (a "once" is used up); -1 for none. */
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

/* The scripted delay of this call in milliseconds: the caller sleeps it outside the lock. */
static UNUSED long delay_of(const char *fn, int pid) {
    char path[4096], line[512];
    long total = 0;
    if (path_of(path, sizeof path, "script") != 0) return 0;
    int fd = take();
    FILE *f = fopen(path, "r");
    if (f) {
        while (fgets(line, sizeof line, f)) {
            char kind[16], want_fn[64], want_pid[16];
            long ms;
            if (sscanf(line, "%15s %63s %15s %ld", kind, want_fn, want_pid, &ms) == 4 &&
                strcmp(kind, "delay") == 0 && matches(want_fn, want_pid, fn, pid))
                total += ms;
        }
        fclose(f);
    }
    give(fd);
    return total;
}

CUresult cuInit(unsigned int flags) {
    char args[32];
    int leaves, fd = take();
    CUresult r = scripted("cuInit", -1, &leaves);
    if (r == -1) r = flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    if (r == CUDA_SUCCESS) initialised = 1;
    snprintf(args, sizeof args, "flags=%u", flags);
    log_call("cuInit", -1, args, r);
    give(fd);
    return r;
}

#ifdef CHECKPOINT_API

typedef struct { unsigned char bytes[16]; } CUuuid;
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

/* One checkpoint call: the checks every call makes, a scripted failure, then the transition
 * from ``from`` to ``to`` (from -1: any state, no transition, as GetState). */
static CUresult act(const char *fn, int pid, const char *args, int valid, int from, int to) {
    long ms = delay_of(fn, pid);
    if (ms > 0) {
        struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
        while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {}
    }
    int fd = take();
    int leaves = -1;
    CUresult r;
    if (fd < 0) r = CUDA_ERROR_UNKNOWN;  /* no FAKE_CUDA_STATE: nothing to act on */
    else if (!initialised) r = CUDA_ERROR_NOT_INITIALIZED;
    else if (pid <= 0 || (kill(pid, 0) != 0 && errno == ESRCH)) r = CUDA_ERROR_INVALID_VALUE;
    else if (!valid) r = CUDA_ERROR_INVALID_VALUE;
    else if ((r = scripted(fn, pid, &leaves)) != -1) {
        if (leaves != -1) set_state(pid, leaves);
    } else if (from != -1 && get_state(pid) != from) r = CUDA_ERROR_ILLEGAL_STATE;
    else {
        r = CUDA_SUCCESS;
        if (from != -1) set_state(pid, to);
    }
    log_call(fn, pid, args, r);
    give(fd);
    return r;
}

CUresult cuCheckpointProcessGetState(int pid, int *state) {
    if (!state) return CUDA_ERROR_INVALID_VALUE;
    CUresult r = act("cuCheckpointProcessGetState", pid, "-", 1, -1, -1);
    if (r == CUDA_SUCCESS) {
        int fd = take();
        *state = get_state(pid);
        give(fd);
    }
    return r;
}

CUresult cuCheckpointProcessLock(int pid, CUcheckpointLockArgs *args) {
    char text[64] = "-";
    int valid = 1;
    if (args) {
        snprintf(text, sizeof text, "timeoutMs=%u", args->timeoutMs);
        valid = args->reserved0 == 0 && zero(args->reserved1, sizeof args->reserved1);
    }
    return act("cuCheckpointProcessLock", pid, text, valid, RUNNING, LOCKED);
}

CUresult cuCheckpointProcessCheckpoint(int pid, CUcheckpointArgs *args) {
    return act("cuCheckpointProcessCheckpoint", pid, args ? "args" : "-",
               !args || zero(args, sizeof *args), LOCKED, CHECKPOINTED);
}

CUresult cuCheckpointProcessRestore(int pid, CUcheckpointRestoreArgs *args) {
    char text[4096] = "-";
    int valid = 1;
    if (args) {
#ifdef REMAP
        unsigned int n = args->gpuPairsCount;
        valid = zero(args->reserved, sizeof args->reserved) && args->reserved1 == 0 &&
                (n == 0) == (args->gpuPairs == NULL) && n <= 64;
        if (valid && n == 0) snprintf(text, sizeof text, "gpuPairs=none");
        if (valid && n > 0) {
            size_t at = (size_t)snprintf(text, sizeof text, "gpuPairs=");
            for (unsigned int i = 0; i < n && at + 90 < sizeof text; i++) {
                char old[48], new[48];
                uuid_text(&args->gpuPairs[i].oldUuid, old);
                uuid_text(&args->gpuPairs[i].newUuid, new);
                at += (size_t)snprintf(text + at, sizeof text - at, "%s%s>%s", i ? "," : "", old,
                                       new);
            }
        }
#else
        /* r570's restore args are reserved bytes only, to be zeroed: pairs are refused. */
        valid = zero(args, sizeof *args);
        snprintf(text, sizeof text, valid ? "gpuPairs=none" : "args-not-zero");
#endif
    }
    return act("cuCheckpointProcessRestore", pid, text, valid, CHECKPOINTED, LOCKED);
}

CUresult cuCheckpointProcessUnlock(int pid, CUcheckpointArgs *args) {
    return act("cuCheckpointProcessUnlock", pid, args ? "args" : "-",
               !args || zero(args, sizeof *args), LOCKED, RUNNING);
}

#endif /* CHECKPOINT_API */
