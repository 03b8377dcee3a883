/* An emulated CUDA runtime for the tests: the entry points of libcudart that the engine's
 * native chunk ring calls, with the same names, signatures and error codes, on the CPU.
 *
 * "Device memory" is host memory: a device pointer is an address in this process.  Each
 * stream is a worker thread that runs its queue in order; cudaMemcpyAsync queues a memcpy
 * that reads its source only when it runs, so a ring that reused a chunk before its copy
 * finished would land wrong bytes, and the tests would see it.  Events complete when the
 * stream reaches them.  Page-locking is recorded, and a copy from memory nobody locked is
 * counted (the real runtime would run it synchronously, at pageable speed).
 *
 * As strict as a driver where the engine could go wrong: the last error is per thread, and
 * cudaEventQuery records cudaErrorNotReady there as the real runtime does; each device has a
 * primary context, made on first use by a thread with none current (on the thread's device,
 * 0 unless it set one: a context "nobody asked for" is counted per device), and the driver's
 * entry points for a thread's contexts (exported here too: cuCtxGetCurrent / cuCtxSetCurrent,
 * a stack with cuCtxPushCurrent / cuCtxPopCurrent, cuDevicePrimaryCtxRetain); streams and
 * events belong to the device current when they were made, and a record on another device's
 * stream fails; stream 0 is the current device's default stream and stream 2
 * (cudaStreamPerThread) the calling thread's own; cudaStreamWaitEvent orders a
 * stream after an event; a "kernel" (emu_launch_fill) writes device memory later, on a
 * consumer's stream; an asynchronous fault is sticky: every later call returns it;
 * cudaHostRegister takes page-aligned ranges only and may be given a cost per MiB; a
 * framework's caching allocator (emu_alloc / emu_free) hands a freed block to the next
 * allocation for its stream at once, while work queued elsewhere may still use it.
 *
 * Controls for the tests (emu_*): delays, copies that do nothing (to time the ring alone),
 * a copy or a registration that fails (at issue or, like a fault on the device, when it
 * runs: a sticky error that later calls return), slow kernels, and counters.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef int cudaError_t;
enum {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorHostMemoryAlreadyRegistered = 712,
    cudaErrorHostMemoryNotRegistered = 713,
};

#define MAX_REGIONS 4096
#define MAX_DEVICES 8

typedef struct op {
    struct op *next;
    int kind; /* 0 copy, 1 event record, 2 wait for an event, 3 a kernel that fills (or copies) memory,
                 4 a kernel that spins until a flag in memory is set (a collective waiting for its peer),
                 5 cudaMemcpy's staged copy (its source freed after) */
    int value;
    int64_t delay_ns;
    void *dst;
    const void *src;
    size_t n;
    struct event *event;
    int64_t gen;
    int64_t seq; /* this copy's number, for an injected failure */
} op_t;

typedef struct stream {
    pthread_t thread;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    op_t *head, *tail;
    int busy, stop, device;
} stream_t;

typedef struct event {
    int64_t recorded, completed;
    int device;
    int pending;   /* queued operations that name it: freed after the last, as a driver does */
    int destroyed;
} event_t;

/* a device's primary context: what cuCtxGetCurrent hands out */
typedef struct context {
    int device;
} context_t;

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static struct { uintptr_t addr; size_t n; } g_regions[MAX_REGIONS];
static int g_nregions;
static int g_devices = 1;
static context_t g_contexts[MAX_DEVICES];
static int g_primary[MAX_DEVICES];      /* the device's primary context exists */
static int64_t g_ctx_made[MAX_DEVICES]; /* primary contexts made per device since the last reset */
static int64_t g_retained[MAX_DEVICES]; /* cuDevicePrimaryCtxRetain's references not released yet */
static int64_t g_bad_releases;          /* releases with no reference left (since the last reset) */
static int g_ctx_gen = 1;               /* bumped by emu_reset: every thread's binding is forgotten */
static stream_t *g_default[MAX_DEVICES];
static int64_t g_register_ns_per_mib;   /* cudaHostRegister sleeps this long per MiB */

/* per thread, as the runtime keeps them: the device cudaSetDevice chose (0 until then), the
 * context current (device + 1, or 0: none) in the generation it was bound in, the last error */
static __thread int t_device = 0;
static __thread int t_ctx = 0;
static __thread int t_ctx_gen = 0;
static __thread int t_last = 0;
/* the thread's context stack below the current one (cuCtxPushCurrent), and its per-thread
 * default streams */
#define MAX_STACK 16
static __thread int t_stack[MAX_STACK];
static __thread int t_stack_gen[MAX_STACK];
static __thread int t_depth = 0;
static __thread stream_t *t_ptds[MAX_DEVICES];

static int64_t g_copy_delay_ns;      /* each copy sleeps this long when it runs */
static int g_noop;                   /* copies move no bytes */
static int64_t g_fail_copy = -1;     /* the copy with this number fails */
static int g_fail_code, g_fail_async;
static int g_fail_register;          /* cudaHostRegister returns this */
static int g_fail_set_device;        /* cudaSetDevice returns this */
static int64_t g_fail_event_after = -1; /* event records past this many fail */
static cudaError_t g_sticky;         /* an asynchronous failure: later calls return it */

/* counters: copies issued, bytes, copies from memory not page-locked, copies issued from a
 * thread whose current device is not the stream's, registrations live, streams live, events
 * live, copies queued at most, events recorded */
static int64_t g_copies, g_bytes, g_pageable, g_wrong_device, g_streams, g_events, g_max_queued,
    g_queued, g_records, g_registers;
static int64_t g_pool_reused; /* allocations served from a freed block of the caching allocator */

static void sleep_ns(int64_t ns) {
    struct timespec ts = {ns / 1000000000, ns % 1000000000};
    while (nanosleep(&ts, &ts) != 0) {
    }
}

static cudaError_t fail(cudaError_t e) {
    t_last = e;
    return e;
}

static cudaError_t sticky(void) {
    cudaError_t e = g_sticky;
    return e ? fail(e) : e;
}

static void make_primary(int d) {
    pthread_mutex_lock(&g_lock);
    if (!g_primary[d]) {
        g_primary[d] = 1;
        g_ctx_made[d]++;
        g_contexts[d].device = d;
    }
    pthread_mutex_unlock(&g_lock);
}

static int current_ctx(void) { return t_ctx && t_ctx_gen == g_ctx_gen ? t_ctx : 0; }

/* the runtime's teardown at process exit (its library destructor, after the interpreter's
 * atexit hooks): a thread that calls it meanwhile or after crashes a real process; here it
 * ends the process with status 86, naming the entry point */
static volatile int g_down;

static void check_up(const char *what) {
    if (g_down) {
        static const char msg[] = "emucudart: a CUDA call during the runtime's teardown at exit: ";
        ssize_t w = write(2, msg, sizeof msg - 1);
        w += write(2, what, strlen(what));
        w += write(2, "\n", 1);
        (void)w;
        _exit(86);
    }
}

/* EMUCUDART_TEARDOWN_MS: how long the teardown takes (a real one destroys contexts): the
 * window in which another thread's call is caught */
__attribute__((destructor)) static void teardown(void) {
    g_down = 1;
    const char *ms = getenv("EMUCUDART_TEARDOWN_MS");
    if (ms && atoi(ms) > 0)
        sleep_ns((int64_t)atoi(ms) * 1000000);
}

/* the device of the context current to this thread; a call that needs one on a thread with
 * none binds (and, the first time, makes) the primary context of the thread's device */
static int need_ctx(void) {
    check_up("a call that needs a context");
    int c = current_ctx();
    if (c)
        return c - 1;
    make_primary(t_device);
    t_ctx = t_device + 1;
    t_ctx_gen = g_ctx_gen;
    return t_device;
}

static void *stream_main(void *arg);

static stream_t *new_stream_thread(int d) {
    stream_t *n = calloc(1, sizeof *n);
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->cond, NULL);
    n->device = d;
    pthread_create(&n->thread, NULL, stream_main, n);
    return n;
}

/* stream 0: the default stream of the current context's device; stream 2
 * (cudaStreamPerThread): this thread's own default stream there (both made on first use) */
static stream_t *resolve(stream_t *s) {
    if (s && (uintptr_t)s != 2)
        return s;
    int d = need_ctx();
    if (s) {
        if (!t_ptds[d])
            t_ptds[d] = new_stream_thread(d);
        return t_ptds[d];
    }
    pthread_mutex_lock(&g_lock);
    if (!g_default[d])
        g_default[d] = new_stream_thread(d);
    s = g_default[d];
    pthread_mutex_unlock(&g_lock);
    return s;
}

/* an operation naming ``e`` is done with it: the last frees a destroyed event (under g_lock) */
static void event_done(event_t *e) {
    if (--e->pending == 0 && e->destroyed)
        free(e);
}

static void *stream_main(void *arg) {
    stream_t *s = arg;
    pthread_mutex_lock(&s->lock);
    for (;;) {
        while (!s->head && !s->stop)
            pthread_cond_wait(&s->cond, &s->lock);
        if (!s->head)
            break;
        op_t *o = s->head;
        s->head = o->next;
        if (!s->head)
            s->tail = NULL;
        s->busy = 1;
        pthread_mutex_unlock(&s->lock);
        if (o->kind == 0) {
            if (g_copy_delay_ns)
                sleep_ns(g_copy_delay_ns);
            pthread_mutex_lock(&g_lock);
            int failing = g_sticky == cudaSuccess && o->seq == g_fail_copy && g_fail_async;
            if (failing)
                g_sticky = g_fail_code;
            int skip = g_sticky != cudaSuccess;
            g_queued--;
            pthread_mutex_unlock(&g_lock);
            if (!skip && !g_noop)
                memcpy(o->dst, o->src, o->n);
        } else if (o->kind == 1) {
            pthread_mutex_lock(&g_lock);
            if (o->gen > o->event->completed)
                o->event->completed = o->gen;
            event_done(o->event);
            pthread_cond_broadcast(&g_done);
            pthread_mutex_unlock(&g_lock);
        } else if (o->kind == 2) {
            /* cudaStreamWaitEvent: nothing after this runs before the event's record has */
            pthread_mutex_lock(&g_lock);
            while (!g_sticky && o->event->completed < o->gen)
                pthread_cond_wait(&g_done, &g_lock);
            event_done(o->event);
            pthread_mutex_unlock(&g_lock);
        } else if (o->kind == 5) {
            /* cudaMemcpy's staged bytes, landed late */
            if (g_copy_delay_ns)
                sleep_ns(g_copy_delay_ns);
            if (!g_sticky)
                memcpy(o->dst, o->src, o->n);
            free((void *)o->src);
        } else if (o->kind == 4) {
            while (!g_sticky && !__atomic_load_n((int *)o->dst, __ATOMIC_ACQUIRE))
                sleep_ns(100000);
        } else {
            if (o->delay_ns)
                sleep_ns(o->delay_ns);
            /* a kernel reads its source only when it runs: memory freed meanwhile may have
               been handed out and written again (see the caching allocator below) */
            if (!g_sticky && o->src)
                memcpy(o->dst, o->src, o->n);
            else if (!g_sticky)
                memset(o->dst, o->value, o->n);
        }
        free(o);
        pthread_mutex_lock(&s->lock);
        s->busy = 0;
        if (!s->head) {
            /* under g_lock, which a synchronising thread holds from its idle check to its wait:
               the wake cannot fall between the two (s->lock is let go first: the other order
               is the synchronising thread's) */
            pthread_mutex_unlock(&s->lock);
            pthread_mutex_lock(&g_lock);
            pthread_cond_broadcast(&g_done);
            pthread_mutex_unlock(&g_lock);
            pthread_mutex_lock(&s->lock);
        }
    }
    pthread_mutex_unlock(&s->lock);
    return NULL;
}

static void push(stream_t *s, op_t *o) {
    pthread_mutex_lock(&s->lock);
    o->next = NULL;
    if (s->tail)
        s->tail->next = o;
    else
        s->head = o;
    s->tail = o;
    pthread_cond_signal(&s->cond);
    pthread_mutex_unlock(&s->lock);
}

/* a copy (kind 0) or a kernel stand-in (kind 3) queued on ``s`` */
static cudaError_t queue_op(stream_t *s, int kind, void *dst, const void *src, size_t n, int64_t seq, int value,
                            int64_t delay_ns) {
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return fail(cudaErrorMemoryAllocation);
    o->kind = kind;
    o->dst = dst;
    o->src = src;
    o->n = n;
    o->seq = seq;
    o->value = value;
    o->delay_ns = delay_ns;
    push(s, o);
    return cudaSuccess;
}

/* ---- the runtime's entry points ---------------------------------------------------------- */

cudaError_t cudaGetLastError(void) {
    /* a sticky error cannot be cleared: the context is unusable */
    cudaError_t e = t_last;
    t_last = cudaSuccess;
    return e ? e : g_sticky;
}

cudaError_t cudaPeekAtLastError(void) { return t_last ? t_last : g_sticky; }

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle: return "invalid resource handle";
    case cudaErrorNotReady: return "device not ready";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
    case cudaErrorHostMemoryAlreadyRegistered: return "part or all of the requested memory range is already mapped";
    case cudaErrorHostMemoryNotRegistered: return "pointer does not correspond to a registered memory region";
    default: return "unknown error";
    }
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = g_devices;
    return cudaSuccess;
}

/* as since CUDA 12: the device's primary context is made (if need be) and made current */
cudaError_t cudaSetDevice(int d) {
    if (d < 0 || d >= g_devices)
        return fail(cudaErrorInvalidDevice);
    if (g_fail_set_device)
        return fail(g_fail_set_device);
    t_device = d;
    make_primary(d);
    t_ctx = d + 1;
    t_ctx_gen = g_ctx_gen;
    return cudaSuccess;
}

/* the current context's device, else the thread's (no context is made) */
cudaError_t cudaGetDevice(int *d) {
    int c = current_ctx();
    *d = c ? c - 1 : t_device;
    return cudaSuccess;
}

/* ---- the driver's entry points for a thread's context ---------------------------------------- */

int cuCtxGetCurrent(context_t **out) {
    int c = current_ctx();
    *out = c ? &g_contexts[c - 1] : NULL;
    return 0;
}

int cuCtxSetCurrent(context_t *ctx) {
    check_up("cuCtxSetCurrent");
    if (ctx && (ctx < g_contexts || ctx >= g_contexts + MAX_DEVICES || !g_primary[ctx->device]))
        return 201; /* CUDA_ERROR_INVALID_CONTEXT */
    t_ctx = ctx ? ctx->device + 1 : 0;
    t_ctx_gen = g_ctx_gen;
    return 0;
}

int cuInit(unsigned int flags) { return flags ? 1 : 0; }

int cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= g_devices)
        return 101; /* CUDA_ERROR_INVALID_DEVICE */
    *dev = ordinal;
    return 0;
}

/* the device's primary context, made if need be (not made current), and retained: each
 * retain needs its release, as the driver counts them (the runtime holds a reference of its own
 * that a release too many would take away, destroying the context under the framework) */
int cuDevicePrimaryCtxRetain(context_t **out, int dev) {
    check_up("cuDevicePrimaryCtxRetain");
    if (dev < 0 || dev >= g_devices)
        return 101;
    make_primary(dev);
    pthread_mutex_lock(&g_lock);
    g_retained[dev]++;
    pthread_mutex_unlock(&g_lock);
    *out = &g_contexts[dev];
    return 0;
}

/* a release with no retain left fails (CUDA_ERROR_INVALID_CONTEXT) and is counted */
int cuDevicePrimaryCtxRelease(int dev) {
    check_up("cuDevicePrimaryCtxRelease");
    if (dev < 0 || dev >= g_devices)
        return 101;
    pthread_mutex_lock(&g_lock);
    int rc = 0;
    if (g_retained[dev] > 0) {
        g_retained[dev]--;
    } else {
        g_bad_releases++;
        rc = 201;
    }
    pthread_mutex_unlock(&g_lock);
    return rc;
}

/* ``ctx`` current, the one before kept below it; the thread's runtime device is untouched */
int cuCtxPushCurrent(context_t *ctx) {
    check_up("cuCtxPushCurrent");
    if (!ctx || ctx < g_contexts || ctx >= g_contexts + MAX_DEVICES || !g_primary[ctx->device])
        return 201;
    if (t_depth == MAX_STACK)
        return 2; /* CUDA_ERROR_OUT_OF_MEMORY */
    t_stack[t_depth] = current_ctx();
    t_stack_gen[t_depth] = g_ctx_gen;
    t_depth++;
    t_ctx = ctx->device + 1;
    t_ctx_gen = g_ctx_gen;
    return 0;
}

int cuCtxPopCurrent(context_t **out) {
    check_up("cuCtxPopCurrent");
    if (t_depth == 0)
        return 201;
    int was = current_ctx();
    t_depth--;
    t_ctx = t_stack[t_depth];
    t_ctx_gen = t_stack_gen[t_depth];
    if (out)
        *out = was ? &g_contexts[was - 1] : NULL;
    return 0;
}

cudaError_t cudaHostRegister(void *p, size_t n, unsigned int flags) {
    (void)flags;
    need_ctx();
    if (g_sticky)
        return sticky();
    if (g_register_ns_per_mib)
        sleep_ns((int64_t)((double)g_register_ns_per_mib * (double)n / (1 << 20)));
    pthread_mutex_lock(&g_lock);
    cudaError_t e = cudaSuccess;
    if (g_fail_register) {
        e = g_fail_register;
    } else if (!p || !n || (uintptr_t)p % 4096 || n % 4096) {
        e = cudaErrorInvalidValue;
    } else if (g_nregions == MAX_REGIONS) {
        e = cudaErrorMemoryAllocation;
    } else {
        for (int i = 0; i < g_nregions; i++)
            if (g_regions[i].addr < (uintptr_t)p + n && (uintptr_t)p < g_regions[i].addr + g_regions[i].n)
                e = cudaErrorHostMemoryAlreadyRegistered;
    }
    if (e == cudaSuccess) {
        g_regions[g_nregions].addr = (uintptr_t)p;
        g_regions[g_nregions].n = n;
        g_nregions++;
        g_registers++;
    }
    pthread_mutex_unlock(&g_lock);
    return e ? fail(e) : e;
}

cudaError_t cudaHostUnregister(void *p) {
    need_ctx();
    pthread_mutex_lock(&g_lock);
    cudaError_t e = cudaErrorHostMemoryNotRegistered;
    for (int i = 0; i < g_nregions; i++)
        if (g_regions[i].addr == (uintptr_t)p) {
            g_regions[i] = g_regions[--g_nregions];
            e = cudaSuccess;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    return e ? fail(e) : e;
}

static int locked(const void *p, size_t n) {
    for (int i = 0; i < g_nregions; i++)
        if (g_regions[i].addr <= (uintptr_t)p && (uintptr_t)p + n <= g_regions[i].addr + g_regions[i].n)
            return 1;
    return 0;
}

cudaError_t cudaStreamCreateWithFlags(stream_t **out, unsigned int flags) {
    (void)flags;
    int d = need_ctx();
    if (g_sticky)
        return sticky();
    stream_t *s = calloc(1, sizeof *s);
    if (!s)
        return fail(cudaErrorMemoryAllocation);
    pthread_mutex_init(&s->lock, NULL);
    pthread_cond_init(&s->cond, NULL);
    s->device = d;
    if (pthread_create(&s->thread, NULL, stream_main, s) != 0) {
        free(s);
        return fail(cudaErrorMemoryAllocation);
    }
    pthread_mutex_lock(&g_lock);
    g_streams++;
    pthread_mutex_unlock(&g_lock);
    *out = s;
    return cudaSuccess;
}

cudaError_t cudaStreamCreate(stream_t **out) { return cudaStreamCreateWithFlags(out, 0); }

cudaError_t cudaStreamSynchronize(stream_t *s) {
    check_up("cudaStreamSynchronize");
    s = resolve(s);
    /* the idle check and the wait under g_lock, so the stream's wake cannot fall between them
       (it cost a lost millisecond per synchronisation, which a real stream does not) */
    pthread_mutex_lock(&g_lock);
    for (;;) {
        pthread_mutex_lock(&s->lock);
        int idle = !s->head && !s->busy;
        pthread_mutex_unlock(&s->lock);
        if (idle)
            break;
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 1000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&g_done, &g_lock, &ts);
    }
    pthread_mutex_unlock(&g_lock);
    return sticky();
}

cudaError_t cudaStreamDestroy(stream_t *s) {
    need_ctx();
    if (!s)
        return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&s->lock);
    s->stop = 1;
    pthread_cond_signal(&s->cond);
    pthread_mutex_unlock(&s->lock);
    pthread_join(s->thread, NULL);
    pthread_mutex_destroy(&s->lock);
    pthread_cond_destroy(&s->cond);
    free(s);
    pthread_mutex_lock(&g_lock);
    g_streams--;
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, stream_t *s) {
    int d = need_ctx();
    if (kind != 1 /* cudaMemcpyHostToDevice */)
        return fail(cudaErrorInvalidValue);
    s = resolve(s);
    if (g_sticky)
        return sticky();
    pthread_mutex_lock(&g_lock);
    int64_t seq = g_copies++;
    g_bytes += (int64_t)n;
    if (!locked(src, n))
        g_pageable++;
    if (d != s->device)
        g_wrong_device++;
    int now = seq == g_fail_copy && !g_fail_async;
    if (now) {
        pthread_mutex_unlock(&g_lock);
        return fail(g_fail_code);
    }
    g_queued++;
    if (g_queued > g_max_queued)
        g_max_queued = g_queued;
    pthread_mutex_unlock(&g_lock);
    return queue_op(s, 0, dst, src, n, seq, 0, 0);
}

/* "synchronous", from any host memory: as the real runtime does from pageable memory, the
 * source is staged (copied to memory of the runtime's own) and the call returns, while the copy
 * to the device runs later on the legacy default stream of the current device: a caller that
 * needs the bytes there synchronises that stream */
cudaError_t cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    need_ctx();
    if (kind != 1 /* cudaMemcpyHostToDevice */)
        return fail(cudaErrorInvalidValue);
    if (g_sticky)
        return sticky();
    if (g_noop || !n)
        return cudaSuccess;
    void *staged = malloc(n);
    if (!staged)
        return fail(cudaErrorMemoryAllocation);
    memcpy(staged, src, n);
    op_t *o = calloc(1, sizeof *o);
    if (!o) {
        free(staged);
        return fail(cudaErrorMemoryAllocation);
    }
    o->kind = 5;
    o->dst = dst;
    o->src = staged;
    o->n = n;
    push(resolve(NULL), o);
    return cudaSuccess;
}

cudaError_t cudaEventCreateWithFlags(event_t **out, unsigned int flags) {
    (void)flags;
    int d = need_ctx();
    if (g_sticky)
        return sticky();
    event_t *e = calloc(1, sizeof *e);
    if (!e)
        return fail(cudaErrorMemoryAllocation);
    e->device = d;
    pthread_mutex_lock(&g_lock);
    g_events++;
    pthread_mutex_unlock(&g_lock);
    *out = e;
    return cudaSuccess;
}

cudaError_t cudaEventCreate(event_t **out) { return cudaEventCreateWithFlags(out, 0); }

cudaError_t cudaEventDestroy(event_t *e) {
    need_ctx();
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&g_lock);
    g_events--;
    e->destroyed = 1;
    if (e->pending == 0)
        free(e);
    pthread_mutex_unlock(&g_lock);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(event_t *e, stream_t *s) {
    need_ctx();
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    s = resolve(s);
    if (g_sticky)
        return sticky();
    if (e->device != s->device) /* an event and a stream of different devices */
        return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&g_lock);
    int refuse = g_fail_event_after >= 0 && g_records >= g_fail_event_after;
    g_records++;
    int64_t gen = refuse ? 0 : ++e->recorded;
    if (!refuse)
        e->pending++;
    pthread_mutex_unlock(&g_lock);
    if (refuse)
        return fail(cudaErrorIllegalAddress);
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return fail(cudaErrorMemoryAllocation);
    o->kind = 1;
    o->event = e;
    o->gen = gen;
    push(s, o);
    return cudaSuccess;
}

/* "not ready" is recorded as the thread's last error, as the real runtime does (a caller that
 * checks cudaGetLastError next sees it unless it was cleared) */
cudaError_t cudaEventQuery(event_t *e) {
    need_ctx();
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&g_lock);
    cudaError_t r = g_sticky ? g_sticky : (e->completed >= e->recorded ? cudaSuccess : cudaErrorNotReady);
    pthread_mutex_unlock(&g_lock);
    return r ? fail(r) : r;
}

cudaError_t cudaEventSynchronize(event_t *e) {
    need_ctx();
    if (!e)
        return fail(cudaErrorInvalidResourceHandle);
    pthread_mutex_lock(&g_lock);
    while (!g_sticky && e->completed < e->recorded)
        pthread_cond_wait(&g_done, &g_lock);
    pthread_mutex_unlock(&g_lock);
    return sticky();
}

/* work queued on the stream after this waits for the event's last record to complete */
cudaError_t cudaStreamWaitEvent(stream_t *s, event_t *e, unsigned int flags) {
    need_ctx();
    if (!e || flags)
        return fail(!e ? cudaErrorInvalidResourceHandle : cudaErrorInvalidValue);
    s = resolve(s);
    if (g_sticky)
        return sticky();
    op_t *o = calloc(1, sizeof *o);
    if (!o)
        return fail(cudaErrorMemoryAllocation);
    o->kind = 2;
    o->event = e;
    pthread_mutex_lock(&g_lock);
    o->gen = e->recorded;
    e->pending++;
    pthread_mutex_unlock(&g_lock);
    push(s, o);
    return cudaSuccess;
}

/* the names the driver exports them under (its header maps the plain ones to these) */
int cuDevicePrimaryCtxRelease_v2(int dev) { return cuDevicePrimaryCtxRelease(dev); }
int cuCtxPushCurrent_v2(context_t *ctx) { return cuCtxPushCurrent(ctx); }
int cuCtxPopCurrent_v2(context_t **out) { return cuCtxPopCurrent(out); }

/* ---- the driver's entry points for what the runtime's above do ------------------------------
 * The driver route (a process that maps no runtime): the same operations, but as the driver
 * has them: a call on a thread with no current context fails (CUDA_ERROR_INVALID_CONTEXT)
 * where the runtime binds its device's primary context, and no error is kept for a later
 * call.  The error codes the engine meets are the runtime's numbers. */

static int drv_ctx(const char *what) {
    check_up(what);
    return current_ctx() ? 0 : 201;
}

#define DRIVER_CALL(what, call)                                                                 \
    do {                                                                                         \
        int rc_ = drv_ctx(what);                                                                 \
        if (rc_)                                                                                 \
            return rc_;                                                                          \
        rc_ = (call);                                                                            \
        t_last = 0;                                                                              \
        return rc_;                                                                              \
    } while (0)

int cuCtxGetDevice(int *d) {
    int c = current_ctx();
    if (!c)
        return 201;
    *d = c - 1;
    return 0;
}
int cuMemHostRegister_v2(void *p, size_t n, unsigned int flags) {
    DRIVER_CALL("cuMemHostRegister", cudaHostRegister(p, n, flags));
}
int cuMemHostUnregister(void *p) { DRIVER_CALL("cuMemHostUnregister", cudaHostUnregister(p)); }
int cuMemcpyHtoDAsync_v2(unsigned long long dst, const void *src, size_t n, stream_t *s) {
    DRIVER_CALL("cuMemcpyHtoDAsync", cudaMemcpyAsync((void *)(uintptr_t)dst, src, n, 1, s));
}
int cuMemcpyHtoD_v2(unsigned long long dst, const void *src, size_t n) {
    DRIVER_CALL("cuMemcpyHtoD", cudaMemcpy((void *)(uintptr_t)dst, src, n, 1));
}
int cuEventCreate(event_t **out, unsigned int flags) {
    DRIVER_CALL("cuEventCreate", cudaEventCreateWithFlags(out, flags));
}
int cuEventRecord(event_t *e, stream_t *s) { DRIVER_CALL("cuEventRecord", cudaEventRecord(e, s)); }
int cuEventQuery(event_t *e) { DRIVER_CALL("cuEventQuery", cudaEventQuery(e)); }
int cuEventSynchronize(event_t *e) { DRIVER_CALL("cuEventSynchronize", cudaEventSynchronize(e)); }
int cuEventDestroy_v2(event_t *e) { DRIVER_CALL("cuEventDestroy", cudaEventDestroy(e)); }
int cuStreamCreate(stream_t **out, unsigned int flags) {
    DRIVER_CALL("cuStreamCreate", cudaStreamCreateWithFlags(out, flags));
}
int cuStreamSynchronize(stream_t *s) { DRIVER_CALL("cuStreamSynchronize", cudaStreamSynchronize(s)); }
int cuStreamWaitEvent(stream_t *s, event_t *e, unsigned int flags) {
    DRIVER_CALL("cuStreamWaitEvent", cudaStreamWaitEvent(s, e, flags));
}
int cuStreamDestroy_v2(stream_t *s) { DRIVER_CALL("cuStreamDestroy", cudaStreamDestroy(s)); }
int cuGetErrorString(int e, const char **out) {
    const char *s = cudaGetErrorString(e);
    if (e != 0 && strcmp(s, "unknown error") == 0) {
        *out = NULL;
        return 1; /* CUDA_ERROR_INVALID_VALUE: a code the driver does not know */
    }
    *out = s;
    return 0;
}

/* ---- controls for the tests -------------------------------------------------------------- */

void emu_reset(void) {
    pthread_mutex_lock(&g_lock);
    g_copy_delay_ns = 0;
    g_noop = 0;
    g_fail_copy = -1;
    g_fail_code = 0;
    g_fail_async = 0;
    g_fail_register = 0;
    g_fail_set_device = 0;
    g_fail_event_after = -1;
    g_sticky = cudaSuccess;
    g_register_ns_per_mib = 0;
    /* every context is forgotten: each thread starts with none current, as a fresh process's */
    g_ctx_gen++;
    for (int d = 0; d < MAX_DEVICES; d++) {
        g_primary[d] = 0;
        g_ctx_made[d] = 0;
        g_retained[d] = 0;
    }
    g_bad_releases = 0;
    g_copies = g_bytes = g_pageable = g_wrong_device = g_max_queued = g_records = g_registers = 0;
    g_pool_reused = 0;
    pthread_mutex_unlock(&g_lock);
}

void emu_set_devices(int n) { g_devices = n < 1 ? 1 : n > MAX_DEVICES ? MAX_DEVICES : n; }
void emu_set_copy_delay_ns(int64_t ns) { g_copy_delay_ns = ns; }
void emu_set_noop(int on) { g_noop = on; }

/* the copy numbered n (from 0 since the last reset) fails with code: at issue, or when it
 * runs (async), as a device fault does */
void emu_fail_copy(int64_t n, int code, int async) {
    pthread_mutex_lock(&g_lock);
    g_fail_copy = n;
    g_fail_code = code;
    g_fail_async = async;
    pthread_mutex_unlock(&g_lock);
}

void emu_fail_register(int code) { g_fail_register = code; }
void emu_fail_set_device(int code) { g_fail_set_device = code; }
void emu_set_register_cost(int64_t ns_per_mib) { g_register_ns_per_mib = ns_per_mib; }

/* references to device d's primary context retained and not released; releases refused */
int64_t emu_primary_refs(int d) { return d >= 0 && d < MAX_DEVICES ? g_retained[d] : -1; }
int64_t emu_bad_releases(void) { return g_bad_releases; }

/* primary contexts made on device d since the last reset */
int64_t emu_contexts(int d) { return d >= 0 && d < MAX_DEVICES ? g_ctx_made[d] : -1; }

/* a kernel stand-in: on stream s (0: the current device's default), after delay_ns, sets n
 * bytes at dst to value; work queued before it on s runs first, as on a device */
cudaError_t emu_launch_fill(stream_t *s, void *dst, int value, size_t n, int64_t delay_ns) {
    need_ctx();
    s = resolve(s);
    if (g_sticky)
        return sticky();
    return queue_op(s, 3, dst, NULL, n, 0, value, delay_ns);
}
void emu_fail_event_record_after(int64_t n) { g_fail_event_after = n; }

/* a kernel stand-in that reads: on stream s, after delay_ns, copies n bytes from src to dst
 * (src is read then, not now: as a framework's queued operation reads its operands) */
cudaError_t emu_launch_copy(stream_t *s, void *dst, const void *src, size_t n, int64_t delay_ns) {
    need_ctx();
    s = resolve(s);
    if (g_sticky)
        return sticky();
    return queue_op(s, 3, dst, src, n, 0, 0, delay_ns);
}

/* a kernel stand-in that spins on stream s until the int at flag is set (by the host): work
 * queued after it on s waits as long, as behind a collective whose peer has not answered */
cudaError_t emu_launch_wait_flag(stream_t *s, int *flag) {
    need_ctx();
    s = resolve(s);
    if (g_sticky)
        return sticky();
    return queue_op(s, 4, flag, NULL, sizeof(int), 0, 0, 0);
}

/* ---- a framework's caching allocator (torch's, CuPy's pool), stream-ordered ---------------
 * A block freed goes back at once to the pool of the stream it was allocated for, whatever
 * is still queued on other streams that reads or writes it, and the next allocation of the
 * same rounded size for that stream gets it back: safe for work on that stream (it runs in
 * order), not for another stream's (a ring's copies) unless that stream waits for an event
 * recorded after the last work on the block. */
#define POOL_ROUND 512
typedef struct block {
    struct block *next;
    void *p;
    size_t n;
    stream_t *stream;
} block_t;
static block_t *g_pool_free, *g_pool_used;

void *emu_alloc(size_t n, stream_t *s) {
    size_t r = (n + POOL_ROUND - 1) / POOL_ROUND * POOL_ROUND;
    if (!r)
        r = POOL_ROUND;
    pthread_mutex_lock(&g_lock);
    block_t **at = &g_pool_free, *b = NULL;
    for (; *at; at = &(*at)->next)
        if ((*at)->n == r && (*at)->stream == s) {
            b = *at;
            *at = b->next;
            g_pool_reused++;
            break;
        }
    pthread_mutex_unlock(&g_lock);
    if (!b) {
        b = calloc(1, sizeof *b);
        if (!b || posix_memalign(&b->p, 256, r)) {
            free(b);
            return NULL;
        }
        b->n = r;
        b->stream = s;
    }
    pthread_mutex_lock(&g_lock);
    b->next = g_pool_used;
    g_pool_used = b;
    pthread_mutex_unlock(&g_lock);
    return b->p;
}

/* back to its stream's pool, at once (0: not a block of the pool) */
int emu_free(void *p) {
    pthread_mutex_lock(&g_lock);
    for (block_t **at = &g_pool_used; *at; at = &(*at)->next)
        if ((*at)->p == p) {
            block_t *b = *at;
            *at = b->next;
            b->next = g_pool_free;
            g_pool_free = b;
            pthread_mutex_unlock(&g_lock);
            return 1;
        }
    pthread_mutex_unlock(&g_lock);
    return 0;
}

/* a thread of the process's own (no interpreter) that calls the runtime every ns until the
 * process ends: a call during the teardown at exit, for the emulator's own test of it */
static void *calling(void *arg) {
    for (;;) {
        sleep_ns((int64_t)(intptr_t)arg);
        event_t *e = NULL;
        cudaEventQuery(e);
    }
    return NULL;
}

void emu_call_every(int64_t ns) {
    pthread_t t;
    if (pthread_create(&t, NULL, calling, (void *)(intptr_t)ns) == 0)
        pthread_detach(t);
}

/* allocations served from a freed block since the last reset */
int64_t emu_pool_reused(void) { return g_pool_reused; }

/* out[0..9]: copies, bytes, pageable copies, copies from a thread on another device, regions
 * registered now, streams live, events live, most copies queued at once, event records,
 * registrations made */
void emu_stats(int64_t *out) {
    pthread_mutex_lock(&g_lock);
    out[0] = g_copies;
    out[1] = g_bytes;
    out[2] = g_pageable;
    out[3] = g_wrong_device;
    out[4] = g_nregions;
    out[5] = g_streams;
    out[6] = g_events;
    out[7] = g_max_queued;
    out[8] = g_records;
    out[9] = g_registers;
    pthread_mutex_unlock(&g_lock);
}
