/* A stand-in for libnvidia-ml.so.1: the C ABI nvidia-ml-py loads with ctypes, answered from a
 * text file the test writes (re-read on every call, so a test changes the node as it goes).
 *
 * Built by the tests with gcc, one library per driver generation:
 *   -DPROCESS_API=3 -DMEMORY_V2 -DMIG   a modern driver (R510 and later)
 *   -DPROCESS_API=2 -DMIG               R470: process records v2, no memory v2
 *   -DPROCESS_API=1                     R418: only the first process records
 * Every generation also exports the unversioned process calls with the v1 record, as real
 * drivers do for old binaries.
 *
 * The file named by FAKE_NVML_NODE holds one line per GPU and per process:
 *   driver <version>
 *   gpu <uuid> <total> <reserved> <used> <utilization|-1> <mig 0|1> <state> <name...>
 *   proc <gpu index> <compute|graphics|mps> <pid> <used bytes|-1>
 *   sample <gpu index> <pid> <timestamp µs> <SM utilization %>
 * state: ok; lost (every query answers GPU_IS_LOST); nohandle (the handle cannot be had);
 * noperm (the handle is refused for permissions).
 *
 * Where FAKE_CUDA_STATE names the folder of the libcuda stand-in (tests/agent/fake_cuda/), its
 * CUDA processes are listed too, with what they hold on their GPU now: as on a real node, NVML
 * stops listing a process whose memory a checkpoint released, and lists it again once restored.
 */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <strings.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SUCCESS 0
#define ERROR_UNINITIALIZED 1
#define ERROR_INVALID_ARGUMENT 2
#define ERROR_NOT_SUPPORTED 3
#define ERROR_NO_PERMISSION 4
#define ERROR_NOT_FOUND 6
#define ERROR_INSUFFICIENT_SIZE 7
#define ERROR_LIBRARY_NOT_FOUND 12
#define ERROR_GPU_IS_LOST 15
#define ERROR_ARGUMENT_VERSION_MISMATCH 25
#define ERROR_UNKNOWN 999

#define MAX_GPUS 16
#define MAX_PROCS 256
#define NOT_AVAILABLE 0xFFFFFFFFFFFFFFFFULL

typedef struct {
    char uuid[96];
    char name[96];
    unsigned long long total, reserved, used;
    int utilization, mig;
    char state[16];
} gpu_t;

typedef struct {
    int gpu;
    char kind[16];
    unsigned int pid;
    unsigned long long used;
} proc_t;

/* What NVML hands out as a device handle: an opaque pointer, here one per index. */
typedef struct { int index; } device_t;

typedef struct { unsigned int pid; unsigned long long used; } process_v1_t;
typedef struct {
    unsigned int pid;
    unsigned long long used;
    unsigned int gpu_instance, compute_instance;
} process_v2_t;
typedef struct { unsigned long long total, free, used; } memory_v1_t;
typedef struct {
    unsigned int version;
    unsigned long long total, reserved, free, used;
} memory_v2_t;
typedef struct { unsigned int gpu, memory; } utilization_t;

#define MEMORY_V2_VERSION ((unsigned int)(sizeof(memory_v2_t) | (2 << 24)))

typedef struct {
    int gpu;
    unsigned int pid;
    unsigned long long stamp;
    unsigned int sm;
} sample_t;

typedef struct {
    unsigned int pid;
    unsigned long long stamp;
    unsigned int sm, mem, enc, dec;
} utilization_sample_t;

static sample_t samples[MAX_PROCS];
static int sample_count;
static device_t devices[MAX_GPUS];
static gpu_t gpus[MAX_GPUS];
static proc_t procs[MAX_PROCS];
static int gpu_count, proc_count, initialised;
static char driver[32] = "550.54.15";

/* A process's start time (field 22 of /proc/<pid>/stat); 0 when it cannot be read. */
static unsigned long long started(unsigned int pid) {
    char path[64], buf[4096];
    snprintf(path, sizeof path, "/proc/%u/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    unsigned long long value = 0;
    for (int field = 0; p && field < 20; field++) p = strchr(p + 1, ' ');
    if (p) sscanf(p + 1, "%llu", &value);
    return value;
}

/* The libcuda stand-in's live processes that hold memory, as compute processes. */
static void add_cuda_processes(void) {
    const char *root = getenv("FAKE_CUDA_STATE");
    DIR *dir = root ? opendir(root) : NULL;
    if (!dir) return;
    struct dirent *entry;
    while ((entry = readdir(dir)) != NULL && proc_count < MAX_PROCS) {
        unsigned int pid;
        char path[4096], state[32], uuid[96];
        unsigned long long start, device, context, copy;
        int wedged;
        if (sscanf(entry->d_name, "proc-%u", &pid) != 1 || strchr(entry->d_name, '.')) continue;
        snprintf(path, sizeof path, "%s/%s", root, entry->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        int ok = fscanf(f, "%llu %31s %95s %llu %llu %llu %d", &start, state, uuid, &device,
                        &context, &copy, &wedged) == 7;
        fclose(f);
        if (!ok || device + context == 0 || started(pid) != start ||
            (kill((int)pid, 0) != 0 && errno == ESRCH)) continue;
        for (int g = 0; g < gpu_count; g++) {
            if (strcasecmp(gpus[g].uuid, uuid) != 0) continue;
            proc_t p = {.gpu = g, .pid = pid, .used = device + context};
            snprintf(p.kind, sizeof p.kind, "compute");
            procs[proc_count++] = p;
        }
    }
    closedir(dir);
}

static int load(void) {
    const char *path = getenv("FAKE_NVML_NODE");
    FILE *f = path ? fopen(path, "r") : NULL;
    char line[512];
    gpu_count = proc_count = sample_count = 0;
    if (!f) return ERROR_LIBRARY_NOT_FOUND;
    while (fgets(line, sizeof line, f)) {
        gpu_t g;
        proc_t p;
        long long used;
        int offset = 0;
        sample_t u;
        if (sscanf(line, "driver %31s", driver) == 1) continue;
        if (sample_count < MAX_PROCS &&
            sscanf(line, "sample %d %u %llu %u", &u.gpu, &u.pid, &u.stamp, &u.sm) == 4) {
            samples[sample_count++] = u;
            continue;
        }
        if (gpu_count < MAX_GPUS &&
            sscanf(line, "gpu %95s %llu %llu %llu %d %d %15s %n", g.uuid, &g.total, &g.reserved,
                   &g.used, &g.utilization, &g.mig, g.state, &offset) == 7 && offset) {
            snprintf(g.name, sizeof g.name, "%s", line + offset);
            g.name[strcspn(g.name, "\n")] = 0;
            devices[gpu_count].index = gpu_count;
            gpus[gpu_count++] = g;
        } else if (proc_count < MAX_PROCS &&
                   sscanf(line, "proc %d %15s %u %lld", &p.gpu, p.kind, &p.pid, &used) == 4) {
            p.used = used < 0 ? NOT_AVAILABLE : (unsigned long long)used;
            procs[proc_count++] = p;
        }
    }
    fclose(f);
    add_cuda_processes();
    return SUCCESS;
}

/* The GPU behind a handle, after the checks every device query makes. */
static int device(const device_t *handle, gpu_t **out) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (load() != SUCCESS) return ERROR_UNKNOWN;
    if (!handle || handle->index < 0 || handle->index >= gpu_count) return ERROR_INVALID_ARGUMENT;
    *out = &gpus[handle->index];
    if (strcmp((*out)->state, "lost") == 0) return ERROR_GPU_IS_LOST;
    return SUCCESS;
}

int nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    int ret = load();
    if (ret == SUCCESS) initialised = 1;
    return ret;
}
int nvmlInit_v2(void) { return nvmlInitWithFlags(0); }
int nvmlInit(void) { return nvmlInitWithFlags(0); }

int nvmlShutdown(void) {
    if (!initialised) return ERROR_UNINITIALIZED;
    initialised = 0;
    return SUCCESS;
}

const char *nvmlErrorString(int result) {
    switch (result) {
    case SUCCESS: return "Success";
    case ERROR_UNINITIALIZED: return "Uninitialized";
    case ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case ERROR_NOT_SUPPORTED: return "Not Supported";
    case ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case ERROR_GPU_IS_LOST: return "GPU is lost";
    case ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

int nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (strlen(driver) + 1 > length) return ERROR_INSUFFICIENT_SIZE;
    strcpy(version, driver);
    return SUCCESS;
}

int nvmlDeviceGetCount_v2(unsigned int *count) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (load() != SUCCESS) return ERROR_UNKNOWN;
    *count = (unsigned int)gpu_count;
    return SUCCESS;
}

int nvmlDeviceGetHandleByIndex_v2(unsigned int index, device_t **handle) {
    if (!initialised) return ERROR_UNINITIALIZED;
    if (load() != SUCCESS) return ERROR_UNKNOWN;
    if (index >= (unsigned int)gpu_count) return ERROR_INVALID_ARGUMENT;
    if (strcmp(gpus[index].state, "nohandle") == 0) return ERROR_GPU_IS_LOST;
    if (strcmp(gpus[index].state, "noperm") == 0) return ERROR_NO_PERMISSION;
    *handle = &devices[index];
    return SUCCESS;
}

static int copy_text(const char *text, char *out, unsigned int length) {
    if (strlen(text) + 1 > length) return ERROR_INSUFFICIENT_SIZE;
    strcpy(out, text);
    return SUCCESS;
}

/* A lost GPU still tells its UUID and name from the driver's cache, as real ones do. */
int nvmlDeviceGetUUID(const device_t *handle, char *uuid, unsigned int length) {
    gpu_t *g;
    int ret = device(handle, &g);
    return ret == SUCCESS || ret == ERROR_GPU_IS_LOST ? copy_text(g->uuid, uuid, length) : ret;
}

int nvmlDeviceGetName(const device_t *handle, char *name, unsigned int length) {
    gpu_t *g;
    int ret = device(handle, &g);
    return ret == SUCCESS || ret == ERROR_GPU_IS_LOST ? copy_text(g->name, name, length) : ret;
}

/* Memory of the processes on a GPU; one in two lists (compute and graphics) counts once. */
static unsigned long long process_bytes(int index) {
    unsigned long long sum = 0;
    for (int i = 0; i < proc_count; i++) {
        int seen = 0;
        for (int j = 0; j < i; j++)
            seen |= procs[j].gpu == index && procs[j].pid == procs[i].pid;
        if (procs[i].gpu == index && !seen && procs[i].used != NOT_AVAILABLE) sum += procs[i].used;
    }
    return sum;
}

int nvmlDeviceGetMemoryInfo(const device_t *handle, memory_v1_t *memory) {
    gpu_t *g;
    int ret = device(handle, &g);
    if (ret != SUCCESS) return ret;
    /* v1 counts the driver's reserve as used: what made NVIDIA add v2. */
    memory->total = g->total;
    memory->used = g->used + process_bytes(handle->index) + g->reserved;
    memory->free = g->total - memory->used;
    return SUCCESS;
}

#ifdef MEMORY_V2
int nvmlDeviceGetMemoryInfo_v2(const device_t *handle, memory_v2_t *memory) {
    gpu_t *g;
    int ret = device(handle, &g);
    if (ret != SUCCESS) return ret;
    if (memory->version != MEMORY_V2_VERSION) return ERROR_ARGUMENT_VERSION_MISMATCH;
    memory->total = g->total;
    memory->reserved = g->reserved;
    memory->used = g->used + process_bytes(handle->index);
    memory->free = g->total - g->reserved - memory->used;
    return SUCCESS;
}
#endif

int nvmlDeviceGetUtilizationRates(const device_t *handle, utilization_t *rates) {
    gpu_t *g;
    int ret = device(handle, &g);
    if (ret != SUCCESS) return ret;
    if (g->utilization < 0) return ERROR_NOT_SUPPORTED;
    rates->gpu = (unsigned int)g->utilization;
    rates->memory = 0;
    return SUCCESS;
}

#ifdef MIG
int nvmlDeviceGetMigMode(const device_t *handle, unsigned int *current, unsigned int *pending) {
    gpu_t *g;
    int ret = device(handle, &g);
    if (ret != SUCCESS) return ret;
    *current = *pending = (unsigned int)g->mig;
    return SUCCESS;
}
#endif

/* Both record layouts through one path: NVML's two-call protocol (ask the count with no
 * buffer, then fill), the count written back either way. */
static int list(const device_t *handle, const char *kind, unsigned int *count, void *out,
                size_t record) {
    gpu_t *g;
    int ret = device(handle, &g);
    unsigned int found = 0;
    if (ret != SUCCESS) return ret;
    if (!count) return ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < proc_count; i++)
        if (procs[i].gpu == handle->index && strcmp(procs[i].kind, kind) == 0) found++;
    if (found == 0) {
        *count = 0;
        return SUCCESS;
    }
    if (!out || *count < found) {
        *count = found;
        return ERROR_INSUFFICIENT_SIZE;
    }
    unsigned int n = 0;
    for (int i = 0; i < proc_count; i++) {
        if (procs[i].gpu != handle->index || strcmp(procs[i].kind, kind) != 0) continue;
        if (record == sizeof(process_v1_t)) {
            process_v1_t *p = (process_v1_t *)out + n;
            p->pid = procs[i].pid;
            p->used = procs[i].used;
        } else {
            process_v2_t *p = (process_v2_t *)out + n;
            p->pid = procs[i].pid;
            p->used = procs[i].used;
            p->gpu_instance = p->compute_instance = 0xFFFFFFFF;
        }
        n++;
    }
    *count = n;
    return SUCCESS;
}

#define PROCESS_CALLS(name, kind)                                                              \
    int name(const device_t *h, unsigned int *c, process_v1_t *p) {                            \
        return list(h, kind, c, p, sizeof *p);                                                 \
    }
#define PROCESS_CALLS_V2(name, kind)                                                           \
    int name(const device_t *h, unsigned int *c, process_v2_t *p) {                            \
        return list(h, kind, c, p, sizeof *p);                                                 \
    }

PROCESS_CALLS(nvmlDeviceGetComputeRunningProcesses, "compute")
PROCESS_CALLS(nvmlDeviceGetGraphicsRunningProcesses, "graphics")
#if PROCESS_API >= 2
PROCESS_CALLS(nvmlDeviceGetMPSComputeRunningProcesses, "mps")
PROCESS_CALLS_V2(nvmlDeviceGetComputeRunningProcesses_v2, "compute")
PROCESS_CALLS_V2(nvmlDeviceGetGraphicsRunningProcesses_v2, "graphics")
PROCESS_CALLS_V2(nvmlDeviceGetMPSComputeRunningProcesses_v2, "mps")
#endif
#if PROCESS_API >= 3
PROCESS_CALLS_V2(nvmlDeviceGetComputeRunningProcesses_v3, "compute")
PROCESS_CALLS_V2(nvmlDeviceGetGraphicsRunningProcesses_v3, "graphics")
PROCESS_CALLS_V2(nvmlDeviceGetMPSComputeRunningProcesses_v3, "mps")
#endif

/* Samples newer than lastSeen; none at all is NOT_FOUND, as on a real driver. */
int nvmlDeviceGetProcessUtilization(const device_t *handle, utilization_sample_t *out,
                                    unsigned int *count, unsigned long long lastSeen) {
    gpu_t *g;
    int ret = device(handle, &g);
    unsigned int found = 0, n = 0;
    if (ret != SUCCESS) return ret;
    if (!count) return ERROR_INVALID_ARGUMENT;
    for (int i = 0; i < sample_count; i++)
        if (samples[i].gpu == handle->index && samples[i].stamp > lastSeen) found++;
    if (found == 0) return ERROR_NOT_FOUND;
    if (!out || *count < found) {
        *count = found;
        return ERROR_INSUFFICIENT_SIZE;
    }
    for (int i = 0; i < sample_count; i++) {
        if (samples[i].gpu != handle->index || samples[i].stamp <= lastSeen) continue;
        out[n].pid = samples[i].pid;
        out[n].stamp = samples[i].stamp;
        out[n].sm = samples[i].sm;
        out[n].mem = out[n].enc = out[n].dec = 0;
        n++;
    }
    *count = n;
    return SUCCESS;
}
