/*
 * libnrt_sim.c -- a stand-in for the Neuron runtime library (libnrt.so.1) for tests and CI.
 *
 * It exports the real symbols with the real signatures, struct layouts, enum values and status codes, and
 * computes a NEFF made by the fake compiler (tests/device_sim/neuronx_cc.py) by calling into Python
 * (tests/device_sim/compute.py, which runs the module's StableHLO on XLA CPU).
 *
 * CHECKED AGAINST (aws-neuron/aws-neuron-sdk, read with the project's search tool; facts only, no code):
 *   src/libnrt/include/nrt/nrt.h (commit 86a92868):
 *     nrt_tensor_placement_t DEVICE=0 HOST=1 VIRTUAL=2; nrt_framework_type_t INVALID=0 NO_FW=1 TENSORFLOW=2
 *     PYTORCH=3 MXNET=4 PRECHECK=5; nrt_dtype_t (hardware codes) UNKNOWN/INVALID=0x0 FP8_E3=0xD FP8_E4=0xE
 *     FP8_E5=0xF FLOAT16=0x7 BFLOAT16=0x6 FLOAT32=0xA FP32R=0xB UINT8=0x3 UINT16=0x5 UINT32=0x9 UINT64=0x1
 *     INT8=0x2 INT16=0x4 INT32=0x8 INT64=0xC; typedef struct nrt_model nrt_model_t; typedef struct
 *     nrt_tensor nrt_tensor_t; typedef void nrt_tensor_set_t; and the signatures of nrt_init, nrt_close
 *     (void), nrt_load, nrt_load_collectives (its ids are named ctx_device_id/ctx_device_count), nrt_unload,
 *     nrt_get_total_vnc_count / nrt_get_visible_vnc_count ("can be called before nrt_init()") and their
 *     deprecated *_nc_count twins, nrt_allocate_tensor_set, nrt_destroy_tensor_set (void),
 *     nrt_add_tensor_to_tensor_set, nrt_get_tensor_from_tensor_set, nrt_execute, nrt_tensor_allocate,
 *     nrt_tensor_free (void), nrt_tensor_read, nrt_tensor_write, nrt_tensor_get_size (size_t);
 *     nrt_vnc_memory_stats_t {size_t bytes_used; size_t bytes_limit;} ("ALWAYS add to the end of this struct")
 *     and nrt_get_vnc_memory_stats(uint32_t vnc, nrt_vnc_memory_stats_t *stats, size_t stats_size_in, size_t
 *     *stats_size_out) (the caller's and the library's struct sizes, "for compatibility purposes").
 *   src/libnrt/include/nrt/nrt_experimental.h (commit 86a92868):
 *     nrt_tensor_usage_t INPUT=0 OUTPUT=1; NRT_TENSOR_NAME_MAX 256; nrt_tensor_info_t {char name[256];
 *     nrt_tensor_usage_t usage; size_t size; nrt_dtype_t dtype; uint32_t *shape; uint32_t ndim;} (296 bytes
 *     on LP64: offsets 0/256/264/272/280/288, asserted below); nrt_tensor_info_array_t {uint64_t
 *     tensor_count; nrt_tensor_info_t tensor_array[];}; nrt_get_model_tensor_info, nrt_free_model_tensor_info.
 *   src/libnrt/include/nrt/nrt_status.h (commit 56dcc0f9, and a newer copy that adds the codes >= 11 and
 *     nrt_get_status_as_str; the docs' nrt_status page lists the same): every NRT_STATUS value below, and
 *     `const char *nrt_get_status_as_str(NRT_STATUS)`.
 *   src/libnrt/include/nrt/nrt_version.h (commit a232445a): nrt_version_t {uint64_t rt_major, rt_minor,
 *     rt_patch, rt_maintenance; char rt_detail[128]; char git_hash[64];}; nrt_get_version(ver, size).
 *   neuron-runtime/nrt-developer-guide.rst: call order; nrt_init reserves the process's NeuronCores
 *     exclusively; nrt_load's vnc is an index among the cores the process owns (0 = its first one);
 *     NEURON_RT_VISIBLE_CORES is a list/range that must be contiguous; nrt_get_tensor_from_tensor_set
 *     returns NRT_FAILURE for an unknown name; nrt_tensor_free / nrt_destroy_tensor_set set the pointer NULL.
 *   neuron-runtime/nrt-troubleshoot.rst: a core in use fails the other process "during runtime
 *     initialization" with "NRT:nrt_allocate_neuron_cores NeuronCore(s) not available - Requested:nc1-nc1
 *     Available:0"; a NEFF version mismatch fails the load ("NEFF version mismatch supported: .. received: ..").
 *   about-neuron/.../logical-neuroncore-config.rst: Trn2 has 8 physical cores per chip; LNC (1 or 2,
 *     default 2) set by NEURON_LOGICAL_NC_CONFIG; the NEFF must be compiled for the runtime's LNC.
 *   neuron-runtime/guides/configuration-guide.rst: NEURON_RT_NUMERICAL_ERRORS_VERBOSITY none (default) /
 *     critical / debug / verbose, "any other value causes nrt_init() to fail with NRT_INVALID".
 *
 * DECISIONS (where the sources leave a choice):
 *   - Before nrt_init every call returns NRT_UNINITIALIZED (13), after nrt_close NRT_CLOSED (14): the
 *     header's "unique retcodes ... outside the scope of nrt_init() and nrt_close()" (the older developer
 *     guide says NRT_FAILURE; the header wins). Exempt, as documented: the vnc counts, nrt_get_version,
 *     nrt_get_status_as_str. nrt_init after nrt_close starts the runtime again (AWS's nrtpy reset()
 *     relies on that); a second nrt_init while running returns NRT_FAILURE with a line on stderr.
 *   - A busy core: the runtime takes its cores at nrt_init (developer guide), so that is where a core held
 *     by another process fails, with NRT_FAILURE (1). Neither NRT_EXEC_NC_BUSY (1005, an execution status:
 *     "locked by another model/thread" in the guide's table) nor NRT_RESOURCE: the troubleshooting page puts
 *     the failure in initialization, and reports from real machines show nrt_init's status for it as
 *     "NRT_FAILURE: nrt_allocate_neuron_cores: Logical Neuron Core(s) not available". A core is held with
 *     flock() on $NRTSIM_STATE_DIR/core<P>.lock, one file per PHYSICAL core P, so an LNC=1 process and an
 *     LNC=2 process contend for the same silicon.
 *   - vnc beyond the process's cores at nrt_load: NRT_LOAD_NOT_ENOUGH_NC (9) ("failed to allocate enough
 *     NCs for loading a NEFF"); vnc < -1: NRT_INVALID.
 *   - A Python exception during compute: PyErr_Print and NRT_FAILURE (1), not NRT_EXEC_COMPLETED_WITH_ERR
 *     (1004): 1004 means the device ran the NEFF to the end and flagged an error (event double clear,
 *     parity); an exception in the simulator means nothing ran (a simulator bug, or a module it cannot run,
 *     e.g. collectives across processes), and a binding must not read it as a hardware fault.
 *   - NaN in a float output: NRT_EXEC_COMPLETED_WITH_NUM_ERR (1003) only when NEURON_RT_NUMERICAL_ERRORS_
 *     VERBOSITY is not "none" (its default), after the outputs are written.
 *   - Stale pointers (freed tensor, unloaded model, destroyed set, unknown address): NRT_INVALID_HANDLE (3);
 *     every handle is looked up in a registry before it is dereferenced.
 *   - nrt_init with NRT_FRAMEWORK_TYPE_INVALID (0) or a value past PRECHECK: NRT_INVALID. A non-contiguous or
 *     out-of-range NEURON_RT_VISIBLE_CORES, or an LNC other than 1/2: NRT_FAILURE from nrt_init (and from the
 *     vnc counts called before it), with the reason on stderr.
 *   - Tensors are zero-filled at allocation (the guide's example relies on unwritten inputs being zeros).
 *   - Device memory is accounted per logical core: the bytes of live NRT_TENSOR_PLACEMENT_DEVICE tensors. An
 *     allocation past the core's HBM returns NRT_RESOURCE with a line on stderr (the header's "resource"
 *     status; the runtime's wording is not public). The HBM of a logical core is 12 GiB per physical core
 *     times the LNC (Trn2: 96 GiB for 8 physical cores; 24 GiB at LNC=2, the runtime's total_hbm of
 *     25769803776), or NRTSIM_HBM_BYTES, read at every call so that a test can change it in a running
 *     process. nrt_get_vnc_memory_stats reports them; its vnc is an index among the process's cores, as
 *     nrt_tensor_allocate's (the header says "Local VNC (within the instance)"); another index: NRT_INVALID.
 *     It copies min(stats_size_in, its own struct size) bytes and reports that size in *stats_size_out.
 *     NOT REAL: a loaded NEFF takes no device memory here (on a core its instructions and scratchpad do),
 *     and host-placement tensors none (they live in host memory there too).
 *
 * NOT REAL (extensions for tests, all prefixed nrtsim_): nrtsim_inject, nrtsim_clear_injections, nrtsim_counters,
 * nrtsim_reset_counters; env NRTSIM_INJECT, NRTSIM_NUM_DEVICES, NRTSIM_STATE_DIR, NRTSIM_COMPUTE, NRTSIM_HBM_BYTES.
 *
 * THE SIMULATOR'S NEFF (written by neuronx_cc.py; a real NEFF is a different container): bytes 0..1023 a
 * header: magic "NRTSIMNEFF\0\0" (12 bytes), u32 format version (1), u32 lnc, u32 reserved, u64
 * table_offset, u64 table_size, u64 payload_offset, u64 payload_size (all little-endian), zeros to 1024;
 * then the tensor table, one ASCII line per tensor "in|out <name> <size> <dtype code> <ndim> <d0> ...";
 * then the payload (a gzip tar the compute module reads).
 *
 * Threading: one mutex guards all runtime state. The GIL is never requested while the mutex is held
 * (nrt_execute snapshots its inputs under the mutex, releases it, runs Python, then takes it again to
 * write the outputs), so a thread holding the GIL and waiting for the mutex cannot deadlock with one
 * holding the mutex.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#define NRT_EXPORT __attribute__((visibility("default")))

/* ------------------------------------------------------------------ the real types (nrt_status.h) */
typedef enum {
    NRT_SUCCESS = 0,
    NRT_FAILURE = 1,
    NRT_INVALID = 2,
    NRT_INVALID_HANDLE = 3,
    NRT_RESOURCE = 4,
    NRT_TIMEOUT = 5,
    NRT_HW_ERROR = 6,
    NRT_QUEUE_FULL = 7,
    NRT_LOAD_NOT_ENOUGH_NC = 9,
    NRT_UNSUPPORTED_NEFF_VERSION = 10,
    NRT_FAIL_HOST_MEM_ALLOC = 11,
    NRT_UNINITIALIZED = 13,
    NRT_CLOSED = 14,
    NRT_QUEUE_EMPTY = 15,
    NRT_EXEC_UNIT_UNRECOVERABLE = 101,
    NRT_EXEC_BAD_INPUT = 1002,
    NRT_EXEC_COMPLETED_WITH_NUM_ERR = 1003,
    NRT_EXEC_COMPLETED_WITH_ERR = 1004,
    NRT_EXEC_NC_BUSY = 1005,
    NRT_EXEC_OOB = 1006,
    NRT_COLL_PENDING = 1100,
    NRT_EXEC_HW_ERR_COLLECTIVES = 1200,
    NRT_EXEC_HW_ERR_HBM_UE = 1201,
    NRT_EXEC_HW_ERR_NC_UE = 1202,
    NRT_EXEC_HW_ERR_DMA_ABORT = 1203,
    NRT_EXEC_SW_NQ_OVERFLOW = 1204,
    NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE = 1205,
    NRT_NETWORK_PROXY_FAILURE = 1206,
} NRT_STATUS;

/* nrt.h */
typedef enum {
    NRT_TENSOR_PLACEMENT_DEVICE,
    NRT_TENSOR_PLACEMENT_HOST,
    NRT_TENSOR_PLACEMENT_VIRTUAL,
} nrt_tensor_placement_t;

typedef enum {
    NRT_FRAMEWORK_TYPE_INVALID = 0,
    NRT_FRAMEWORK_TYPE_NO_FW = 1,
    NRT_FRAMEWORK_TYPE_TENSORFLOW,
    NRT_FRAMEWORK_TYPE_PYTORCH,
    NRT_FRAMEWORK_TYPE_MXNET,
    NRT_FRAMEWORK_TYPE_PRECHECK,
} nrt_framework_type_t;

typedef enum nrt_dtype {
    NRT_DTYPE_UNKNOWN = 0x0,
    NRT_DTYPE_FP8_E3 = 0xD,
    NRT_DTYPE_FP8_E4 = 0xE,
    NRT_DTYPE_FP8_E5 = 0xF,
    NRT_DTYPE_FLOAT16 = 0x7,
    NRT_DTYPE_BFLOAT16 = 0x6,
    NRT_DTYPE_FLOAT32 = 0xA,
    NRT_DTYPE_FP32R = 0xB,
    NRT_DTYPE_UINT8 = 0x3,
    NRT_DTYPE_UINT16 = 0x5,
    NRT_DTYPE_UINT32 = 0x9,
    NRT_DTYPE_UINT64 = 0x1,
    NRT_DTYPE_INT8 = 0x2,
    NRT_DTYPE_INT16 = 0x4,
    NRT_DTYPE_INT32 = 0x8,
    NRT_DTYPE_INT64 = 0xC,
} nrt_dtype_t;

typedef struct nrt_model nrt_model_t;
typedef struct nrt_tensor nrt_tensor_t;
typedef void nrt_tensor_set_t;

/* nrt_experimental.h */
typedef enum nrt_tensor_usage {
    NRT_TENSOR_USAGE_INPUT = 0,
    NRT_TENSOR_USAGE_OUTPUT,
} nrt_tensor_usage_t;

#define NRT_TENSOR_NAME_MAX 256

typedef struct nrt_tensor_info {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    size_t size;
    nrt_dtype_t dtype;
    uint32_t *shape;
    uint32_t ndim;
} nrt_tensor_info_t;

typedef struct nrt_tensor_info_array {
    uint64_t tensor_count;
    nrt_tensor_info_t tensor_array[];
} nrt_tensor_info_array_t;

/* nrt_version.h */
#define RT_VERSION_DETAIL_LEN 128
#define GIT_HASH_LEN 64

typedef struct nrt_version {
    uint64_t rt_major;
    uint64_t rt_minor;
    uint64_t rt_patch;
    uint64_t rt_maintenance;
    char rt_detail[RT_VERSION_DETAIL_LEN];
    char git_hash[GIT_HASH_LEN];
} nrt_version_t;

#if defined(__LP64__)
_Static_assert(sizeof(nrt_tensor_info_t) == 296, "nrt_tensor_info_t is 296 bytes on LP64");
_Static_assert(offsetof(nrt_tensor_info_t, usage) == 256, "usage at 256");
_Static_assert(offsetof(nrt_tensor_info_t, size) == 264, "size at 264");
_Static_assert(offsetof(nrt_tensor_info_t, dtype) == 272, "dtype at 272");
_Static_assert(offsetof(nrt_tensor_info_t, shape) == 280, "shape at 280");
_Static_assert(offsetof(nrt_tensor_info_t, ndim) == 288, "ndim at 288");
_Static_assert(offsetof(nrt_tensor_info_array_t, tensor_array) == 8, "tensor_array at 8");
_Static_assert(sizeof(nrt_version_t) == 32 + 128 + 64, "nrt_version_t is 224 bytes");
#endif

/* ------------------------------------------------------------------ the simulator's own objects */
#define SIM_MAGIC_MODEL 0x4d4f44454c53494dULL  /* each object carries a tag: a second check after the */
#define SIM_MAGIC_TENSOR 0x54454e534f52534dULL /* registry lookup, against a registry bug */
#define SIM_MAGIC_SET 0x54534554534554ULL

#define PHYS_CORES_PER_DEVICE 8 /* Trainium2: eight NeuronCore-v3 per chip */
#define MAX_PHYS_CORES 1024

#define NEFF_HEADER_SIZE 1024
static const char NEFF_MAGIC[12] = {'N', 'R', 'T', 'S', 'I', 'M', 'N', 'E', 'F', 'F', 0, 0};
#define NEFF_FORMAT_VERSION 1 /* the newest the simulated runtime loads */

typedef struct {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_usage_t usage;
    size_t size;
    nrt_dtype_t dtype;
    uint32_t ndim;
    uint32_t *shape;
} sim_tensor_desc_t;

struct nrt_model {
    uint64_t magic;
    int32_t vnc; /* index among the process's cores */
    int collectives;
    uint32_t ctx_device_id, ctx_device_count;
    unsigned char *neff; /* a copy: the caller may unmap its buffer after nrt_load */
    size_t neff_size;
    size_t n_tensors;
    sim_tensor_desc_t *tensors;
};

struct nrt_tensor {
    uint64_t magic;
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_placement_t placement;
    int vnc;
    size_t size;
    unsigned char *data;
};

typedef struct {
    char name[NRT_TENSOR_NAME_MAX];
    nrt_tensor_t *tensor;
} sim_set_entry_t;

typedef struct {
    uint64_t magic;
    size_t n, cap;
    sim_set_entry_t *entries;
} sim_tensor_set_t;

/* A registry of live handles of one kind: a pointer is dereferenced only once it is found here. */
typedef struct {
    void **items;
    size_t n, cap;
} registry_t;

static bool registry_add(registry_t *r, void *p) {
    if (r->n == r->cap) {
        size_t cap = r->cap ? r->cap * 2 : 16;
        void **items = realloc(r->items, cap * sizeof(void *));
        if (!items) return false;
        r->items = items;
        r->cap = cap;
    }
    r->items[r->n++] = p;
    return true;
}

static bool registry_has(const registry_t *r, const void *p) {
    if (!p) return false;
    for (size_t i = 0; i < r->n; i++)
        if (r->items[i] == p) return true;
    return false;
}

static bool registry_remove(registry_t *r, const void *p) {
    for (size_t i = 0; i < r->n; i++)
        if (r->items[i] == p) {
            r->items[i] = r->items[--r->n];
            return true;
        }
    return false;
}

/* The counters, in the order nrtsim_counters reports them (tests/device_sim/__init__.py names them). */
enum {
    C_BYTES_WRITTEN, C_BYTES_READ, C_LOADS, C_UNLOADS, C_EXECUTES, C_TENSORS_ALLOCATED, C_TENSORS_FREED,
    C_INITS, C_CLOSES, C_LIVE_MODELS, C_LIVE_TENSORS, C_COLLECTIVE_LOADS, C_COUNT
};

/* An injected status: the next `remaining` calls of `function` return `status` and do nothing else. */
typedef struct {
    char function[64];
    int status;
    int remaining;
} injection_t;
#define MAX_INJECTIONS 64

typedef enum { RT_NEVER_STARTED, RT_RUNNING, RT_CLOSED } rt_phase_t;

static struct {
    pthread_mutex_t lock;
    rt_phase_t phase;
    int lnc;
    uint32_t total_vnc;
    uint32_t first_vnc, n_visible; /* the process's cores: logical cores first_vnc .. first_vnc+n_visible-1 */
    int lock_fds[MAX_PHYS_CORES];
    size_t n_lock_fds;
    bool check_numerics;
    registry_t models, tensors, sets, infos;
    size_t hbm_used[MAX_PHYS_CORES]; /* bytes of live device tensors per logical core (process index) */
    uint64_t counters[C_COUNT];
    injection_t injections[MAX_INJECTIONS];
} rt = {.lock = PTHREAD_MUTEX_INITIALIZER};

#define LOG(...) (fprintf(stderr, "nrtsim: " __VA_ARGS__), fputc('\n', stderr), fflush(stderr))

/* ------------------------------------------------------------------ injection (caller holds rt.lock) */
static bool take_injection(const char *function, int *status) {
    for (int i = 0; i < MAX_INJECTIONS; i++) {
        injection_t *in = &rt.injections[i];
        if (in->remaining > 0 && strcmp(in->function, function) == 0) {
            in->remaining--;
            *status = in->status;
            return true;
        }
    }
    return false;
}

static void add_injection(const char *function, int status, int count) {
    injection_t *slot = NULL;
    for (int i = 0; i < MAX_INJECTIONS && !slot; i++)
        if (strcmp(rt.injections[i].function, function) == 0) slot = &rt.injections[i];
    for (int i = 0; i < MAX_INJECTIONS && !slot; i++)
        if (rt.injections[i].remaining <= 0) slot = &rt.injections[i];
    if (!slot) {
        LOG("injection table full, %s:%d ignored", function, status);
        return;
    }
    snprintf(slot->function, sizeof slot->function, "%s", function);
    slot->status = status;
    slot->remaining = count;
}

/* NRTSIM_INJECT="nrt_execute:1005:1,nrt_load:4:1" */
static void parse_inject_env(void) {
    const char *spec = getenv("NRTSIM_INJECT");
    if (!spec || !*spec) return;
    char *copy = strdup(spec), *save = NULL;
    if (!copy) return;
    for (char *item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char function[64];
        int status, count = 1;
        int got = sscanf(item, " %63[^:]:%d:%d", function, &status, &count);
        if (got < 2)
            LOG("NRTSIM_INJECT: cannot read '%s' (want function:status[:count])", item);
        else
            add_injection(function, status, count);
    }
    free(copy);
}

/* Every exported function starts with one of these, under rt.lock. */
#define INJECTED(fn)                                  \
    do {                                              \
        int injected_status_;                         \
        if (take_injection(fn, &injected_status_)) {  \
            pthread_mutex_unlock(&rt.lock);           \
            return (NRT_STATUS)injected_status_;      \
        }                                             \
    } while (0)

static NRT_STATUS phase_status(void) {
    return rt.phase == RT_RUNNING ? NRT_SUCCESS : rt.phase == RT_CLOSED ? NRT_CLOSED : NRT_UNINITIALIZED;
}

#define REQUIRE_RUNNING()                       \
    do {                                        \
        NRT_STATUS phase_ = phase_status();     \
        if (phase_ != NRT_SUCCESS) {            \
            pthread_mutex_unlock(&rt.lock);     \
            return phase_;                      \
        }                                       \
    } while (0)

#define UNLOCK_RETURN(value)            \
    do {                                \
        pthread_mutex_unlock(&rt.lock); \
        return (value);                 \
    } while (0)

/* ------------------------------------------------------------------ cores */
static int env_int(const char *name, int fallback) {
    const char *v = getenv(name);
    if (!v || !*v) return fallback;
    char *end;
    long x = strtol(v, &end, 10);
    return (*end == '\0') ? (int)x : -1;
}

/* The machine and the process's view of it from the environment; false (with a line on stderr) when the
 * configuration is not one the runtime accepts. */
static bool read_core_config(int *lnc, uint32_t *total, uint32_t *first, uint32_t *count) {
    int devices = env_int("NRTSIM_NUM_DEVICES", 1);
    if (devices < 1 || devices * PHYS_CORES_PER_DEVICE > MAX_PHYS_CORES) {
        LOG("NRTSIM_NUM_DEVICES='%s' is not a device count", getenv("NRTSIM_NUM_DEVICES"));
        return false;
    }
    /* NEURON_LOGICAL_NC_CONFIG, or NEURON_RT_VIRTUAL_CORE_SIZE (TorchNeuron's and NxD Inference's docs); both
     * set and different: refused. */
    const char *lnc_env = getenv("NEURON_LOGICAL_NC_CONFIG"), *vcs_env = getenv("NEURON_RT_VIRTUAL_CORE_SIZE");
    *lnc = env_int("NEURON_LOGICAL_NC_CONFIG", env_int("NEURON_RT_VIRTUAL_CORE_SIZE", 2));
    if (lnc_env && *lnc_env && vcs_env && *vcs_env && env_int("NEURON_RT_VIRTUAL_CORE_SIZE", 2) != *lnc) {
        LOG("NEURON_LOGICAL_NC_CONFIG='%s' and NEURON_RT_VIRTUAL_CORE_SIZE='%s' disagree", lnc_env, vcs_env);
        return false;
    }
    if (*lnc != 1 && *lnc != 2) {
        LOG("logical core size %d (NEURON_LOGICAL_NC_CONFIG / NEURON_RT_VIRTUAL_CORE_SIZE): LNC can only be 1 or 2",
            *lnc);
        return false;
    }
    *total = (uint32_t)(devices * PHYS_CORES_PER_DEVICE / *lnc);
    const char *visible = getenv("NEURON_RT_VISIBLE_CORES");
    if (!visible || !*visible) {
        int num = env_int("NEURON_RT_NUM_CORES", 0);
        if (num < 0 || (uint32_t)num > *total) {
            LOG("NEURON_RT_NUM_CORES='%s': the instance has %u NeuronCores", getenv("NEURON_RT_NUM_CORES"), *total);
            return false;
        }
        *first = 0; /* NUM_CORES picks free cores; the simulator takes the lowest ones */
        *count = num ? (uint32_t)num : *total;
        return true;
    }
    /* "a", "a-b", lists of those; the result must be contiguous and increasing (developer guide). */
    long expect = -1, lo_all = -1, hi_all = -1;
    const char *p = visible;
    while (*p) {
        char *end;
        long lo = strtol(p, &end, 10), hi = lo;
        if (end == p || lo < 0) goto bad;
        p = end;
        if (*p == '-') {
            hi = strtol(p + 1, &end, 10);
            if (end == p + 1 || hi < lo) goto bad;
            p = end;
        }
        if (*p == ',') p++;
        else if (*p) goto bad;
        if (expect >= 0 && lo != expect) {
            LOG("NRT:nrt_allocate_neuron_cores Neuron cores are not contiguous (NEURON_RT_VISIBLE_CORES=%s)", visible);
            return false;
        }
        if (lo_all < 0) lo_all = lo;
        hi_all = hi;
        expect = hi + 1;
    }
    if (lo_all < 0) goto bad;
    if ((uint32_t)hi_all >= *total) {
        LOG("NRT:nrt_allocate_neuron_cores NEURON_RT_VISIBLE_CORES=%s asks for lnc%ld, the instance has %u "
            "logical NeuronCores (LNC=%d)", visible, hi_all, *total, *lnc);
        return false;
    }
    *first = (uint32_t)lo_all;
    *count = (uint32_t)(hi_all - lo_all + 1);
    return true;
bad:
    LOG("NEURON_RT_VISIBLE_CORES='%s' is not a list of core indices and ranges", visible);
    return false;
}

static void release_cores(void) {
    for (size_t i = 0; i < rt.n_lock_fds; i++) close(rt.lock_fds[i]); /* closing drops the flock */
    rt.n_lock_fds = 0;
}

static const char *state_dir(void) {
    const char *dir = getenv("NRTSIM_STATE_DIR");
    return (dir && *dir) ? dir : NULL;
}

/* flock every physical core under the process's logical cores; NRT_FAILURE if another process holds one. */
static NRT_STATUS acquire_cores(void) {
    const char *dir = state_dir();
    char fallback[256];
    if (!dir) {
        snprintf(fallback, sizeof fallback, "%s/nrtsim-%ld", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
                 (long)getuid());
        dir = fallback;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        LOG("cannot create the state directory %s: %s", dir, strerror(errno));
        return NRT_FAILURE;
    }
    uint32_t first_phys = rt.first_vnc * (uint32_t)rt.lnc, n_phys = rt.n_visible * (uint32_t)rt.lnc;
    for (uint32_t p = first_phys; p < first_phys + n_phys; p++) {
        char path[512];
        snprintf(path, sizeof path, "%s/core%u.lock", dir, p);
        int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0666);
        if (fd < 0) {
            LOG("cannot open %s: %s", path, strerror(errno));
            release_cores();
            return NRT_FAILURE;
        }
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
            close(fd);
            release_cores();
            /* The real runtime's words (nrt-troubleshoot), with the core range it asked for. */
            LOG("ERROR NRT:nrt_allocate_neuron_cores Logical Neuron Core(s) not available - Requested:lnc%u-lnc%u "
                "Available:0 Logical Core size:%d (cores busy: physical core %u is held by another process)",
                rt.first_vnc, rt.first_vnc + rt.n_visible - 1, rt.lnc, p);
            return NRT_FAILURE;
        }
        char pid[32];
        int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
        if (ftruncate(fd, 0) == 0 && write(fd, pid, (size_t)len) < 0) { /* the holder's pid, for people */ }
        rt.lock_fds[rt.n_lock_fds++] = fd;
    }
    return NRT_SUCCESS;
}

/* ------------------------------------------------------------------ object lifetimes (rt.lock held) */
static void free_model(nrt_model_t *m) {
    for (size_t i = 0; i < m->n_tensors; i++) free(m->tensors[i].shape);
    free(m->tensors);
    free(m->neff);
    m->magic = 0;
    free(m);
}

static void free_tensor(nrt_tensor_t *t) {
    free(t->data);
    t->magic = 0;
    free(t);
}

static void free_set(sim_tensor_set_t *s) {
    free(s->entries);
    s->magic = 0;
    free(s);
}

static void free_info(nrt_tensor_info_array_t *a) {
    for (uint64_t i = 0; i < a->tensor_count; i++) free(a->tensor_array[i].shape);
    free(a);
}

/* nrt_close drops everything: handles from before it are stale (NRT_CLOSED now, NRT_INVALID_HANDLE after a
 * new nrt_init). */
static void drop_all(void) {
    for (size_t i = 0; i < rt.models.n; i++) free_model(rt.models.items[i]);
    for (size_t i = 0; i < rt.tensors.n; i++) free_tensor(rt.tensors.items[i]);
    for (size_t i = 0; i < rt.sets.n; i++) free_set(rt.sets.items[i]);
    for (size_t i = 0; i < rt.infos.n; i++) free_info(rt.infos.items[i]);
    rt.models.n = rt.tensors.n = rt.sets.n = rt.infos.n = 0;
    rt.counters[C_LIVE_MODELS] = rt.counters[C_LIVE_TENSORS] = 0;
    memset(rt.hbm_used, 0, sizeof rt.hbm_used);
}

/* ------------------------------------------------------------------ init / close / version */
NRT_EXPORT NRT_STATUS nrt_init(nrt_framework_type_t framework, const char *fw_version, const char *fal_version) {
    pthread_mutex_lock(&rt.lock);
    parse_inject_env();
    INJECTED("nrt_init");
    if (rt.phase == RT_RUNNING) {
        LOG("nrt_init: the runtime is already initialized in this process (call nrt_close first)");
        UNLOCK_RETURN(NRT_FAILURE);
    }
    if (framework < NRT_FRAMEWORK_TYPE_NO_FW || framework > NRT_FRAMEWORK_TYPE_PRECHECK) {
        LOG("nrt_init: framework type %d is not a valid nrt_framework_type_t", (int)framework);
        UNLOCK_RETURN(NRT_INVALID);
    }
    (void)fw_version;
    (void)fal_version;
    const char *verbosity = getenv("NEURON_RT_NUMERICAL_ERRORS_VERBOSITY");
    rt.check_numerics = false;
    if (verbosity && *verbosity) {
        if (strcasecmp(verbosity, "none") == 0) rt.check_numerics = false;
        else if (!strcasecmp(verbosity, "critical") || !strcasecmp(verbosity, "debug") ||
                 !strcasecmp(verbosity, "verbose"))
            rt.check_numerics = true;
        else {
            LOG("nrt_init: NEURON_RT_NUMERICAL_ERRORS_VERBOSITY='%s' is not none/critical/debug/verbose", verbosity);
            UNLOCK_RETURN(NRT_INVALID);
        }
    }
    if (!read_core_config(&rt.lnc, &rt.total_vnc, &rt.first_vnc, &rt.n_visible)) UNLOCK_RETURN(NRT_FAILURE);
    NRT_STATUS st = acquire_cores();
    if (st != NRT_SUCCESS) UNLOCK_RETURN(st);
    rt.phase = RT_RUNNING;
    rt.counters[C_INITS]++;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT void nrt_close(void) {
    pthread_mutex_lock(&rt.lock);
    int ignored;
    if (take_injection("nrt_close", &ignored) || rt.phase != RT_RUNNING) {
        pthread_mutex_unlock(&rt.lock);
        return;
    }
    drop_all();
    release_cores();
    rt.phase = RT_CLOSED;
    rt.counters[C_CLOSES]++;
    pthread_mutex_unlock(&rt.lock);
}

NRT_EXPORT NRT_STATUS nrt_get_version(nrt_version_t *ver, size_t size) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_get_version");
    pthread_mutex_unlock(&rt.lock);
    if (!ver) return NRT_INVALID;
    nrt_version_t v;
    memset(&v, 0, sizeof v);
    v.rt_major = 2;
    v.rt_minor = 99;
    v.rt_patch = 0;
    v.rt_maintenance = 0;
    snprintf(v.rt_detail, sizeof v.rt_detail, "Neuron runtime simulator (neuron_compile tests/device_sim)");
    snprintf(v.git_hash, sizeof v.git_hash, "nrtsim");
    memcpy(ver, &v, size < sizeof v ? size : sizeof v); /* `size` keeps older callers' structs intact */
    return NRT_SUCCESS;
}

NRT_EXPORT const char *nrt_get_status_as_str(NRT_STATUS status) {
    switch (status) {
#define CASE(x) \
    case x:     \
        return #x
        CASE(NRT_SUCCESS); CASE(NRT_FAILURE); CASE(NRT_INVALID); CASE(NRT_INVALID_HANDLE); CASE(NRT_RESOURCE);
        CASE(NRT_TIMEOUT); CASE(NRT_HW_ERROR); CASE(NRT_QUEUE_FULL); CASE(NRT_LOAD_NOT_ENOUGH_NC);
        CASE(NRT_UNSUPPORTED_NEFF_VERSION); CASE(NRT_FAIL_HOST_MEM_ALLOC); CASE(NRT_UNINITIALIZED);
        CASE(NRT_CLOSED); CASE(NRT_QUEUE_EMPTY); CASE(NRT_EXEC_UNIT_UNRECOVERABLE); CASE(NRT_EXEC_BAD_INPUT);
        CASE(NRT_EXEC_COMPLETED_WITH_NUM_ERR); CASE(NRT_EXEC_COMPLETED_WITH_ERR); CASE(NRT_EXEC_NC_BUSY);
        CASE(NRT_EXEC_OOB); CASE(NRT_COLL_PENDING); CASE(NRT_EXEC_HW_ERR_COLLECTIVES);
        CASE(NRT_EXEC_HW_ERR_HBM_UE); CASE(NRT_EXEC_HW_ERR_NC_UE); CASE(NRT_EXEC_HW_ERR_DMA_ABORT);
        CASE(NRT_EXEC_SW_NQ_OVERFLOW); CASE(NRT_EXEC_HW_ERR_REPAIRABLE_HBM_UE); CASE(NRT_NETWORK_PROXY_FAILURE);
#undef CASE
    }
    return "NRT_UNKNOWN_STATUS";
}

/* Documented as callable before nrt_init: before it, they read the environment as nrt_init would. */
static NRT_STATUS vnc_count(const char *fn, uint32_t *out, bool visible) {
    pthread_mutex_lock(&rt.lock);
    INJECTED(fn);
    if (!out) UNLOCK_RETURN(NRT_INVALID);
    if (rt.phase == RT_RUNNING) {
        *out = visible ? rt.n_visible : rt.total_vnc;
        UNLOCK_RETURN(NRT_SUCCESS);
    }
    int lnc;
    uint32_t total, first, count;
    if (!read_core_config(&lnc, &total, &first, &count)) UNLOCK_RETURN(NRT_FAILURE);
    *out = visible ? count : total;
    UNLOCK_RETURN(NRT_SUCCESS);
}

/* Runtimes before the logical-core API have only the *_nc_count calls: NRTSIM_OLD_RUNTIME builds one. */
#ifndef NRTSIM_OLD_RUNTIME
NRT_EXPORT NRT_STATUS nrt_get_total_vnc_count(uint32_t *vnc_count_out) {
    return vnc_count("nrt_get_total_vnc_count", vnc_count_out, false);
}
NRT_EXPORT NRT_STATUS nrt_get_visible_vnc_count(uint32_t *vnc_count_out) {
    return vnc_count("nrt_get_visible_vnc_count", vnc_count_out, true);
}
#endif
NRT_EXPORT NRT_STATUS nrt_get_total_nc_count(uint32_t *vnc_count_out) { /* deprecated twin */
    return vnc_count("nrt_get_total_nc_count", vnc_count_out, false);
}
NRT_EXPORT NRT_STATUS nrt_get_visible_nc_count(uint32_t *vnc_count_out) { /* deprecated twin */
    return vnc_count("nrt_get_visible_nc_count", vnc_count_out, true);
}

/* ------------------------------------------------------------------ models */
static uint32_t rd32(const unsigned char *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t rd64(const unsigned char *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

/* Parse the NEFF into `m` (rt.lock held). */
static NRT_STATUS parse_neff(nrt_model_t *m, const unsigned char *neff, size_t size) {
    if (size < NEFF_HEADER_SIZE) {
        LOG("nrt_load: NEFF of %zu bytes is truncated (its header alone is %d bytes)", size, NEFF_HEADER_SIZE);
        return NRT_INVALID;
    }
    if (memcmp(neff, NEFF_MAGIC, sizeof NEFF_MAGIC) != 0) {
        LOG("nrt_load: not a NEFF (bad magic)");
        return NRT_INVALID;
    }
    uint32_t version = rd32(neff + 12), lnc = rd32(neff + 16);
    if (version == 0 || version > NEFF_FORMAT_VERSION) {
        LOG("nrt_load: NEFF version mismatch supported: %d received: %u", NEFF_FORMAT_VERSION, version);
        return NRT_UNSUPPORTED_NEFF_VERSION;
    }
    if (lnc != (uint32_t)rt.lnc) {
        LOG("nrt_load: the NEFF was compiled for LNC=%u (neuronx-cc --lnc %u) but the runtime runs with LNC=%d "
            "(NEURON_LOGICAL_NC_CONFIG=%d)", lnc, lnc, rt.lnc, rt.lnc);
        return NRT_INVALID;
    }
    uint64_t t_off = rd64(neff + 24), t_size = rd64(neff + 32), p_off = rd64(neff + 40), p_size = rd64(neff + 48);
    if (t_off < NEFF_HEADER_SIZE || t_off > size || t_size > size - t_off || p_off > size || p_size > size - p_off) {
        LOG("nrt_load: NEFF sections lie outside its %zu bytes (truncated?)", size);
        return NRT_INVALID;
    }
    char *table = malloc(t_size + 1);
    if (!table) return NRT_RESOURCE;
    memcpy(table, neff + t_off, t_size);
    table[t_size] = '\0';
    NRT_STATUS st = NRT_SUCCESS;
    char *save = NULL;
    for (char *line = strtok_r(table, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        char kind[8], name[NRT_TENSOR_NAME_MAX];
        unsigned long long bytes;
        unsigned dtype, ndim;
        int used = 0;
        if (sscanf(line, "%7s %255s %llu %u %u%n", kind, name, &bytes, &dtype, &ndim, &used) != 5 ||
            (strcmp(kind, "in") && strcmp(kind, "out")) || ndim > 64) {
            LOG("nrt_load: bad tensor table line '%s'", line);
            st = NRT_INVALID;
            break;
        }
        sim_tensor_desc_t *grown = realloc(m->tensors, (m->n_tensors + 1) * sizeof *grown);
        if (!grown) { st = NRT_RESOURCE; break; }
        m->tensors = grown;
        sim_tensor_desc_t *d = &m->tensors[m->n_tensors++];
        memset(d, 0, sizeof *d);
        snprintf(d->name, sizeof d->name, "%s", name);
        d->usage = strcmp(kind, "in") == 0 ? NRT_TENSOR_USAGE_INPUT : NRT_TENSOR_USAGE_OUTPUT;
        d->size = (size_t)bytes;
        d->dtype = (nrt_dtype_t)dtype;
        d->ndim = ndim;
        d->shape = calloc(ndim ? ndim : 1, sizeof(uint32_t));
        if (!d->shape) { st = NRT_RESOURCE; break; }
        const char *p = line + used;
        for (unsigned i = 0; i < ndim; i++) {
            int n = 0;
            if (sscanf(p, "%u%n", &d->shape[i], &n) != 1) {
                LOG("nrt_load: bad shape in tensor table line '%s'", line);
                st = NRT_INVALID;
                break;
            }
            p += n;
        }
        if (st != NRT_SUCCESS) break;
    }
    free(table);
    return st;
}

static NRT_STATUS load(const char *fn, const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count_arg,
                       bool collectives, uint32_t ctx_id, uint32_t ctx_count, nrt_model_t **model) {
    pthread_mutex_lock(&rt.lock);
    INJECTED(fn);
    REQUIRE_RUNNING();
    if (!neff_bytes || !model) UNLOCK_RETURN(NRT_INVALID);
    if (collectives && (ctx_count == 0 || ctx_id >= ctx_count)) {
        LOG("%s: device id %u is not below the device count %u", fn, ctx_id, ctx_count);
        UNLOCK_RETURN(NRT_INVALID);
    }
    /* The runtime developer guide: NEURON_RT_ROOT_COMM_ID ("host:port" of the collectives bootstrap) is mandatory
     * for collective operators. The status a real runtime gives without it is not documented: NRT_FAILURE. */
    if (collectives) {
        const char *root = getenv("NEURON_RT_ROOT_COMM_ID");
        const char *colon = root ? strrchr(root, ':') : NULL;
        if (!root || !*root || !colon || colon == root || !colon[1]) {
            LOG("%s: NEURON_RT_ROOT_COMM_ID='%s' is not host:port (mandatory for collectives)", fn, root ? root : "");
            UNLOCK_RETURN(NRT_FAILURE);
        }
    }
    if (vnc < -1) UNLOCK_RETURN(NRT_INVALID);
    int32_t replicas = vnc_count_arg > 1 ? vnc_count_arg : 1; /* deprecated; -1 (or 1) is the norm */
    if (vnc == -1) { /* "first free VNC": the least loaded of the process's cores */
        size_t best = (size_t)-1;
        for (uint32_t c = 0; c < rt.n_visible; c++) {
            size_t load_c = 0;
            for (size_t i = 0; i < rt.models.n; i++) load_c += ((nrt_model_t *)rt.models.items[i])->vnc == (int32_t)c;
            if (load_c < best) { best = load_c; vnc = (int32_t)c; }
        }
    }
    if (vnc < 0 || (uint32_t)vnc + (uint32_t)replicas > rt.n_visible) {
        LOG("%s: NeuronCore %d is not one of this process's %u (NEURON_RT_VISIBLE_CORES; vnc counts from 0)", fn,
            vnc, rt.n_visible);
        UNLOCK_RETURN(NRT_LOAD_NOT_ENOUGH_NC);
    }
    nrt_model_t *m = calloc(1, sizeof *m);
    if (!m) UNLOCK_RETURN(NRT_RESOURCE);
    NRT_STATUS st = parse_neff(m, neff_bytes, size);
    if (st == NRT_SUCCESS && !(m->neff = malloc(size))) st = NRT_RESOURCE;
    if (st == NRT_SUCCESS && !registry_add(&rt.models, m)) st = NRT_RESOURCE;
    if (st != NRT_SUCCESS) {
        free_model(m);
        UNLOCK_RETURN(st);
    }
    memcpy(m->neff, neff_bytes, size);
    m->neff_size = size;
    m->magic = SIM_MAGIC_MODEL;
    m->vnc = vnc;
    m->collectives = collectives;
    m->ctx_device_id = ctx_id;
    m->ctx_device_count = ctx_count;
    rt.counters[C_LOADS]++;
    rt.counters[C_LIVE_MODELS]++;
    if (collectives) rt.counters[C_COLLECTIVE_LOADS]++;
    *model = m;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT NRT_STATUS nrt_load(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count_arg,
                               nrt_model_t **model) {
    return load("nrt_load", neff_bytes, size, vnc, vnc_count_arg, false, 0, 0, model);
}

NRT_EXPORT NRT_STATUS nrt_load_collectives(const void *neff_bytes, size_t size, int32_t vnc, int32_t vnc_count_arg,
                                           uint32_t ctx_device_id, uint32_t ctx_device_count, nrt_model_t **model) {
    return load("nrt_load_collectives", neff_bytes, size, vnc, vnc_count_arg, true, ctx_device_id, ctx_device_count,
                model);
}

static bool valid_model(const nrt_model_t *m) {
    return registry_has(&rt.models, m) && m->magic == SIM_MAGIC_MODEL;
}

NRT_EXPORT NRT_STATUS nrt_unload(nrt_model_t *model) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_unload");
    REQUIRE_RUNNING();
    if (!valid_model(model)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    registry_remove(&rt.models, model);
    free_model(model);
    rt.counters[C_UNLOADS]++;
    rt.counters[C_LIVE_MODELS]--;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT NRT_STATUS nrt_get_model_tensor_info(nrt_model_t *model, nrt_tensor_info_array_t **tensor_info) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_get_model_tensor_info");
    REQUIRE_RUNNING();
    if (!valid_model(model)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    if (!tensor_info) UNLOCK_RETURN(NRT_INVALID);
    nrt_tensor_info_array_t *a =
        calloc(1, sizeof(nrt_tensor_info_array_t) + model->n_tensors * sizeof(nrt_tensor_info_t));
    if (!a) UNLOCK_RETURN(NRT_RESOURCE);
    for (size_t i = 0; i < model->n_tensors; i++) {
        const sim_tensor_desc_t *d = &model->tensors[i];
        nrt_tensor_info_t *t = &a->tensor_array[i];
        snprintf(t->name, sizeof t->name, "%s", d->name);
        t->usage = d->usage;
        t->size = d->size;
        t->dtype = d->dtype;
        t->ndim = d->ndim;
        t->shape = calloc(d->ndim ? d->ndim : 1, sizeof(uint32_t));
        if (!t->shape) {
            a->tensor_count = i;
            free_info(a);
            UNLOCK_RETURN(NRT_RESOURCE);
        }
        memcpy(t->shape, d->shape, d->ndim * sizeof(uint32_t));
    }
    a->tensor_count = model->n_tensors;
    if (!registry_add(&rt.infos, a)) {
        free_info(a);
        UNLOCK_RETURN(NRT_RESOURCE);
    }
    *tensor_info = a;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT NRT_STATUS nrt_free_model_tensor_info(nrt_tensor_info_array_t *tensor_info) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_free_model_tensor_info");
    REQUIRE_RUNNING();
    if (!registry_remove(&rt.infos, tensor_info)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    free_info(tensor_info);
    UNLOCK_RETURN(NRT_SUCCESS);
}

/* ------------------------------------------------------------------ tensors */
static bool valid_tensor(const nrt_tensor_t *t) {
    return registry_has(&rt.tensors, t) && t->magic == SIM_MAGIC_TENSOR;
}

#define HBM_PER_PHYS_CORE (12ULL << 30) /* Trn2: 96 GiB of HBM for 8 physical NeuronCores */

/* The HBM of one logical core (see DECISIONS): NRTSIM_HBM_BYTES, else 12 GiB per physical core times the LNC. */
static size_t hbm_limit(void) {
    const char *env = getenv("NRTSIM_HBM_BYTES");
    if (env && *env) {
        char *end = NULL;
        unsigned long long v = strtoull(env, &end, 10);
        if (end && *end == '\0') return (size_t)v;
        LOG("NRTSIM_HBM_BYTES='%s' is not a number of bytes: ignored", env);
    }
    return (size_t)(HBM_PER_PHYS_CORE * (unsigned long long)(rt.lnc > 0 ? rt.lnc : 2));
}

NRT_EXPORT NRT_STATUS nrt_tensor_allocate(nrt_tensor_placement_t tensor_placement, int vnc, size_t size,
                                          const char *name, nrt_tensor_t **tensor) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_tensor_allocate");
    REQUIRE_RUNNING();
    if (!tensor) UNLOCK_RETURN(NRT_INVALID);
    if ((int)tensor_placement < NRT_TENSOR_PLACEMENT_DEVICE || tensor_placement > NRT_TENSOR_PLACEMENT_VIRTUAL) {
        LOG("nrt_tensor_allocate: placement %d is not an nrt_tensor_placement_t", (int)tensor_placement);
        UNLOCK_RETURN(NRT_INVALID);
    }
    if (tensor_placement == NRT_TENSOR_PLACEMENT_DEVICE && (vnc < 0 || (uint32_t)vnc >= rt.n_visible)) {
        LOG("nrt_tensor_allocate: device tensor '%s' on NeuronCore %d, this process has %u", name ? name : "",
            vnc, rt.n_visible);
        UNLOCK_RETURN(NRT_INVALID);
    }
    bool on_device = tensor_placement == NRT_TENSOR_PLACEMENT_DEVICE;
    if (on_device && size > hbm_limit() - (rt.hbm_used[vnc] < hbm_limit() ? rt.hbm_used[vnc] : hbm_limit())) {
        LOG("nrt_tensor_allocate: device tensor '%s' of %zu bytes does not fit on NeuronCore %d: %zu of %zu bytes "
            "in use", name ? name : "", size, vnc, rt.hbm_used[vnc], hbm_limit());
        UNLOCK_RETURN(NRT_RESOURCE);
    }
    nrt_tensor_t *t = calloc(1, sizeof *t);
    unsigned char *data = calloc(size ? size : 1, 1); /* zero-filled, as the guide's example relies on */
    if (!t || !data || !registry_add(&rt.tensors, t)) {
        free(t);
        free(data);
        UNLOCK_RETURN(NRT_RESOURCE);
    }
    t->magic = SIM_MAGIC_TENSOR;
    snprintf(t->name, sizeof t->name, "%s", name ? name : "");
    t->placement = tensor_placement;
    t->vnc = vnc;
    t->size = size;
    t->data = data;
    if (on_device) rt.hbm_used[vnc] += size;
    rt.counters[C_TENSORS_ALLOCATED]++;
    rt.counters[C_LIVE_TENSORS]++;
    *tensor = t;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT void nrt_tensor_free(nrt_tensor_t **tensor) {
    pthread_mutex_lock(&rt.lock);
    int ignored;
    if (take_injection("nrt_tensor_free", &ignored) || rt.phase != RT_RUNNING || !tensor || !*tensor) {
        pthread_mutex_unlock(&rt.lock);
        return;
    }
    if (!valid_tensor(*tensor)) {
        LOG("nrt_tensor_free: %p is not a live tensor (freed twice?)", (void *)*tensor);
        pthread_mutex_unlock(&rt.lock);
        return;
    }
    registry_remove(&rt.tensors, *tensor);
    if ((*tensor)->placement == NRT_TENSOR_PLACEMENT_DEVICE) rt.hbm_used[(*tensor)->vnc] -= (*tensor)->size;
    free_tensor(*tensor);
    *tensor = NULL;
    rt.counters[C_TENSORS_FREED]++;
    rt.counters[C_LIVE_TENSORS]--;
    pthread_mutex_unlock(&rt.lock);
}

static NRT_STATUS check_range(const char *fn, const nrt_tensor_t *t, const void *buf, size_t offset, size_t size) {
    if (!buf) return NRT_INVALID;
    if (offset > t->size || size > t->size - offset) {
        LOG("%s: bytes [%zu, %zu) lie outside tensor '%s' of %zu bytes", fn, offset, offset + size, t->name, t->size);
        return NRT_INVALID;
    }
    return NRT_SUCCESS;
}

NRT_EXPORT NRT_STATUS nrt_tensor_write(nrt_tensor_t *tensor, const void *buf, size_t offset, size_t size) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_tensor_write");
    REQUIRE_RUNNING();
    if (!valid_tensor(tensor)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    NRT_STATUS st = check_range("nrt_tensor_write", tensor, buf, offset, size);
    if (st != NRT_SUCCESS) UNLOCK_RETURN(st);
    memcpy(tensor->data + offset, buf, size);
    rt.counters[C_BYTES_WRITTEN] += size;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT NRT_STATUS nrt_tensor_read(const nrt_tensor_t *tensor, void *buf, size_t offset, size_t size) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_tensor_read");
    REQUIRE_RUNNING();
    if (!valid_tensor(tensor)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    NRT_STATUS st = check_range("nrt_tensor_read", tensor, buf, offset, size);
    if (st != NRT_SUCCESS) UNLOCK_RETURN(st);
    memcpy(buf, tensor->data + offset, size);
    rt.counters[C_BYTES_READ] += size;
    UNLOCK_RETURN(NRT_SUCCESS);
}

/* nrt.h's struct: fields are only ever added at its end. */
typedef struct nrt_vnc_memory_stats {
    size_t bytes_used;
    size_t bytes_limit;
} nrt_vnc_memory_stats_t;

NRT_EXPORT NRT_STATUS nrt_get_vnc_memory_stats(uint32_t vnc, nrt_vnc_memory_stats_t *stats, size_t stats_size_in,
                                               size_t *stats_size_out) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_get_vnc_memory_stats");
    REQUIRE_RUNNING();
    if (!stats || vnc >= rt.n_visible) UNLOCK_RETURN(NRT_INVALID);
    nrt_vnc_memory_stats_t mine = {.bytes_used = rt.hbm_used[vnc], .bytes_limit = hbm_limit()};
    size_t n = stats_size_in < sizeof mine ? stats_size_in : sizeof mine;
    memcpy(stats, &mine, n);
    if (stats_size_out) *stats_size_out = n;
    UNLOCK_RETURN(NRT_SUCCESS);
}

/* Returns a size, not a status: 0 for an injected call or a stale handle. */
NRT_EXPORT size_t nrt_tensor_get_size(const nrt_tensor_t *tensor) {
    pthread_mutex_lock(&rt.lock);
    int ignored;
    size_t size = 0;
    if (!take_injection("nrt_tensor_get_size", &ignored) && rt.phase == RT_RUNNING && valid_tensor(tensor))
        size = tensor->size;
    pthread_mutex_unlock(&rt.lock);
    return size;
}

/* ------------------------------------------------------------------ tensor sets */
static sim_tensor_set_t *valid_set(const void *s) {
    sim_tensor_set_t *set = (sim_tensor_set_t *)s;
    return registry_has(&rt.sets, set) && set->magic == SIM_MAGIC_SET ? set : NULL;
}

NRT_EXPORT NRT_STATUS nrt_allocate_tensor_set(nrt_tensor_set_t **result) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_allocate_tensor_set");
    REQUIRE_RUNNING();
    if (!result) UNLOCK_RETURN(NRT_INVALID);
    sim_tensor_set_t *s = calloc(1, sizeof *s);
    if (!s || !registry_add(&rt.sets, s)) {
        free(s);
        UNLOCK_RETURN(NRT_RESOURCE);
    }
    s->magic = SIM_MAGIC_SET;
    *result = s;
    UNLOCK_RETURN(NRT_SUCCESS);
}

NRT_EXPORT void nrt_destroy_tensor_set(nrt_tensor_set_t **tensor_set) {
    pthread_mutex_lock(&rt.lock);
    int ignored;
    if (take_injection("nrt_destroy_tensor_set", &ignored) || rt.phase != RT_RUNNING || !tensor_set) {
        pthread_mutex_unlock(&rt.lock);
        return;
    }
    sim_tensor_set_t *s = valid_set(*tensor_set);
    if (!s) {
        if (*tensor_set) LOG("nrt_destroy_tensor_set: %p is not a live tensor set", *tensor_set);
        pthread_mutex_unlock(&rt.lock);
        return;
    }
    registry_remove(&rt.sets, s);
    free_set(s); /* the tensors stay: they belong to the caller */
    *tensor_set = NULL;
    pthread_mutex_unlock(&rt.lock);
}

NRT_EXPORT NRT_STATUS nrt_add_tensor_to_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                                   nrt_tensor_t *tensor) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_add_tensor_to_tensor_set");
    REQUIRE_RUNNING();
    sim_tensor_set_t *s = valid_set(tensor_set);
    if (!s || !valid_tensor(tensor)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    if (!tensor_name || strlen(tensor_name) >= NRT_TENSOR_NAME_MAX) UNLOCK_RETURN(NRT_INVALID);
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->entries[i].name, tensor_name) == 0) { /* add/replace */
            s->entries[i].tensor = tensor;
            UNLOCK_RETURN(NRT_SUCCESS);
        }
    if (s->n == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 8;
        sim_set_entry_t *e = realloc(s->entries, cap * sizeof *e);
        if (!e) UNLOCK_RETURN(NRT_RESOURCE);
        s->entries = e;
        s->cap = cap;
    }
    snprintf(s->entries[s->n].name, NRT_TENSOR_NAME_MAX, "%s", tensor_name);
    s->entries[s->n++].tensor = tensor;
    UNLOCK_RETURN(NRT_SUCCESS);
}

static sim_set_entry_t *set_find(sim_tensor_set_t *s, const char *name) {
    for (size_t i = 0; i < s->n; i++)
        if (strcmp(s->entries[i].name, name) == 0) return &s->entries[i];
    return NULL;
}

NRT_EXPORT NRT_STATUS nrt_get_tensor_from_tensor_set(nrt_tensor_set_t *tensor_set, const char *tensor_name,
                                                     nrt_tensor_t **tensor) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_get_tensor_from_tensor_set");
    REQUIRE_RUNNING();
    sim_tensor_set_t *s = valid_set(tensor_set);
    if (!s) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    if (!tensor_name || !tensor) UNLOCK_RETURN(NRT_INVALID);
    sim_set_entry_t *e = set_find(s, tensor_name);
    if (!e) UNLOCK_RETURN(NRT_FAILURE); /* the developer guide: not found -> NRT_FAILURE, *tensor untouched */
    *tensor = e->tensor;
    UNLOCK_RETURN(NRT_SUCCESS);
}

/* ------------------------------------------------------------------ execution */
typedef struct {
    const char *name;
    size_t size;
    nrt_dtype_t dtype;
    nrt_tensor_t *tensor;
    unsigned char *bytes; /* inputs: a snapshot; outputs: the result from Python */
} io_t;

/* Every tensor of `usage` is in `set` under its name, live, of exactly its size (rt.lock held). */
static NRT_STATUS bind_io(const nrt_model_t *m, sim_tensor_set_t *set, nrt_tensor_usage_t usage, io_t *io,
                          size_t *n) {
    const char *which = usage == NRT_TENSOR_USAGE_INPUT ? "input" : "output";
    for (size_t i = 0; i < m->n_tensors; i++) {
        const sim_tensor_desc_t *d = &m->tensors[i];
        if (d->usage != usage) continue;
        sim_set_entry_t *e = set_find(set, d->name);
        if (!e) {
            LOG("nrt_execute: %s tensor '%s' (expected %zu bytes) is not in the %s set (given: none)", which,
                d->name, d->size, which);
            return NRT_INVALID;
        }
        if (!valid_tensor(e->tensor)) {
            LOG("nrt_execute: %s tensor '%s' in the %s set was freed", which, d->name, which);
            return NRT_INVALID_HANDLE;
        }
        if (e->tensor->size != d->size) {
            LOG("nrt_execute: %s tensor '%s': expected %zu bytes, given %zu", which, d->name, d->size,
                e->tensor->size);
            return NRT_INVALID;
        }
        io[*n] = (io_t){.name = d->name, .size = d->size, .dtype = d->dtype, .tensor = e->tensor};
        (*n)++;
    }
    return NRT_SUCCESS;
}

static bool has_nan(const unsigned char *p, size_t size, nrt_dtype_t dtype) {
    if (dtype == NRT_DTYPE_FLOAT32) {
        for (size_t i = 0; i + 4 <= size; i += 4) {
            uint32_t v;
            memcpy(&v, p + i, 4);
            if ((v & 0x7f800000u) == 0x7f800000u && (v & 0x007fffffu)) return true;
        }
    } else if (dtype == NRT_DTYPE_BFLOAT16 || dtype == NRT_DTYPE_FLOAT16) {
        uint16_t exp = dtype == NRT_DTYPE_BFLOAT16 ? 0x7f80 : 0x7c00, man = dtype == NRT_DTYPE_BFLOAT16 ? 0x7f : 0x3ff;
        for (size_t i = 0; i + 2 <= size; i += 2) {
            uint16_t v;
            memcpy(&v, p + i, 2);
            if ((v & exp) == exp && (v & man)) return true;
        }
    }
    return false;
}

/* Run the NEFF in Python: compute.execute(neff, {name: bytes}) -> {name: bytes}. Called WITHOUT rt.lock. */
static NRT_STATUS compute(const unsigned char *neff, size_t neff_size, io_t *in, size_t n_in, io_t *out,
                          size_t n_out) {
    if (!Py_IsInitialized()) {
        LOG("nrt_execute: no Python interpreter in this process; the simulator computes through Python");
        return NRT_FAILURE;
    }
    PyGILState_STATE gil = PyGILState_Ensure();
    NRT_STATUS st = NRT_FAILURE;
    PyObject *module = NULL, *fn = NULL, *neff_obj = NULL, *inputs = NULL, *result = NULL;
    const char *module_name = getenv("NRTSIM_COMPUTE");
    if (!module_name || !*module_name) module_name = "tests.device_sim.compute";
    if (!(module = PyImport_ImportModule(module_name))) goto python_error;
    if (!(fn = PyObject_GetAttrString(module, "execute"))) goto python_error;
    if (!(neff_obj = PyBytes_FromStringAndSize((const char *)neff, (Py_ssize_t)neff_size))) goto python_error;
    if (!(inputs = PyDict_New())) goto python_error;
    for (size_t i = 0; i < n_in; i++) {
        PyObject *b = PyBytes_FromStringAndSize((const char *)in[i].bytes, (Py_ssize_t)in[i].size);
        if (!b || PyDict_SetItemString(inputs, in[i].name, b) != 0) {
            Py_XDECREF(b);
            goto python_error;
        }
        Py_DECREF(b);
    }
    if (!(result = PyObject_CallFunctionObjArgs(fn, neff_obj, inputs, NULL))) goto python_error;
    if (!PyDict_Check(result)) {
        LOG("nrt_execute: %s.execute returned %s, not a dict", module_name, Py_TYPE(result)->tp_name);
        goto done;
    }
    for (size_t i = 0; i < n_out; i++) {
        PyObject *value = PyDict_GetItemString(result, out[i].name); /* borrowed */
        Py_buffer view;
        if (!value) {
            LOG("nrt_execute: %s.execute gave no output '%s'", module_name, out[i].name);
            goto done;
        }
        if (PyObject_GetBuffer(value, &view, PyBUF_C_CONTIGUOUS) != 0) goto python_error;
        if ((size_t)view.len != out[i].size) {
            LOG("nrt_execute: output '%s': the computation gave %zd bytes, the tensor has %zu", out[i].name, view.len,
                out[i].size);
            PyBuffer_Release(&view);
            goto done;
        }
        out[i].bytes = malloc(out[i].size ? out[i].size : 1);
        if (!out[i].bytes) {
            PyBuffer_Release(&view);
            goto done;
        }
        memcpy(out[i].bytes, view.buf, out[i].size);
        PyBuffer_Release(&view);
    }
    st = NRT_SUCCESS;
    goto done;
python_error:
    LOG("nrt_execute: the computation raised (Python traceback follows); returning NRT_FAILURE");
    PyErr_Print();
done:
    Py_XDECREF(result);
    Py_XDECREF(inputs);
    Py_XDECREF(neff_obj);
    Py_XDECREF(fn);
    Py_XDECREF(module);
    PyGILState_Release(gil);
    return st;
}

static void free_io(io_t *io, size_t n) {
    for (size_t i = 0; i < n; i++) free(io[i].bytes);
    free(io);
}

NRT_EXPORT NRT_STATUS nrt_execute(nrt_model_t *model, const nrt_tensor_set_t *input_set,
                                  nrt_tensor_set_t *output_set) {
    pthread_mutex_lock(&rt.lock);
    INJECTED("nrt_execute");
    REQUIRE_RUNNING();
    if (!valid_model(model)) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    sim_tensor_set_t *ins = valid_set(input_set), *outs = valid_set(output_set);
    if (!ins || !outs) UNLOCK_RETURN(NRT_INVALID_HANDLE);
    io_t *in = calloc(model->n_tensors + 1, sizeof *in), *out = calloc(model->n_tensors + 1, sizeof *out);
    unsigned char *neff = malloc(model->neff_size);
    size_t n_in = 0, n_out = 0, neff_size = model->neff_size;
    NRT_STATUS st = (in && out && neff) ? NRT_SUCCESS : NRT_RESOURCE;
    if (st == NRT_SUCCESS) st = bind_io(model, ins, NRT_TENSOR_USAGE_INPUT, in, &n_in);
    if (st == NRT_SUCCESS) st = bind_io(model, outs, NRT_TENSOR_USAGE_OUTPUT, out, &n_out);
    for (size_t i = 0; st == NRT_SUCCESS && i < n_in; i++) { /* snapshot: the lock is dropped for Python */
        if (!(in[i].bytes = malloc(in[i].size ? in[i].size : 1))) st = NRT_RESOURCE;
        else memcpy(in[i].bytes, in[i].tensor->data, in[i].size);
    }
    if (st == NRT_SUCCESS) {
        memcpy(neff, model->neff, neff_size);
        rt.counters[C_EXECUTES]++;
    }
    pthread_mutex_unlock(&rt.lock);
    if (st == NRT_SUCCESS) st = compute(neff, neff_size, in, n_in, out, n_out);
    free(neff);
    if (st != NRT_SUCCESS) {
        free_io(in, n_in);
        free_io(out, n_out);
        return st;
    }
    pthread_mutex_lock(&rt.lock);
    bool nan = false;
    for (size_t i = 0; i < n_out && st == NRT_SUCCESS; i++) {
        if (!valid_tensor(out[i].tensor) || out[i].tensor->size != out[i].size) {
            LOG("nrt_execute: output tensor '%s' was freed during the execution", out[i].name);
            st = NRT_INVALID_HANDLE;
            break;
        }
        memcpy(out[i].tensor->data, out[i].bytes, out[i].size);
        nan = nan || (rt.check_numerics && has_nan(out[i].bytes, out[i].size, out[i].dtype));
    }
    pthread_mutex_unlock(&rt.lock);
    free_io(in, n_in);
    free_io(out, n_out);
    if (st == NRT_SUCCESS && nan) return NRT_EXEC_COMPLETED_WITH_NUM_ERR;
    return st;
}

/* ------------------------------------------------------------------ the simulator's own exports */
NRT_EXPORT void nrtsim_inject(const char *function, int status, int count) {
    if (!function) return;
    pthread_mutex_lock(&rt.lock);
    add_injection(function, status, count);
    pthread_mutex_unlock(&rt.lock);
}

NRT_EXPORT void nrtsim_counters(uint64_t *out, int n) {
    pthread_mutex_lock(&rt.lock);
    for (int i = 0; i < n && i < C_COUNT; i++) out[i] = rt.counters[i];
    pthread_mutex_unlock(&rt.lock);
}

/* Zeroes the event counters; live_models / live_tensors keep counting what is alive. */
NRT_EXPORT void nrtsim_reset_counters(void) {
    pthread_mutex_lock(&rt.lock);
    uint64_t live_models = rt.counters[C_LIVE_MODELS], live_tensors = rt.counters[C_LIVE_TENSORS];
    memset(rt.counters, 0, sizeof rt.counters);
    rt.counters[C_LIVE_MODELS] = live_models;
    rt.counters[C_LIVE_TENSORS] = live_tensors;
    pthread_mutex_unlock(&rt.lock);
}

/* Forgets every pending injection. */
NRT_EXPORT void nrtsim_clear_injections(void) {
    pthread_mutex_lock(&rt.lock);
    memset(rt.injections, 0, sizeof rt.injections);
    pthread_mutex_unlock(&rt.lock);
}
