/* The work-claiming thread pool behind every kernel's parallel loop (see pool.h).
 *
 * One job at a time. `state` holds the job's generation in its high 32 bits and the next unclaimed
 * item in its low 32 (all ones while the caller sets a job up). A worker reads the job's fields between
 * two loads of `state` (a seqlock), and claims an item only by a compare-and-swap that names the
 * generation, so a worker that slept through a job can never run an item of the next one with stale
 * fields. A claim takes a contiguous chunk, 1/threads of the items left: a claim is an atomic on a
 * line every claimer writes, and claiming item by item cost a decode step more than the work of its
 * small kernels (q4_1 batch-1 step 4.1 -> 3.5 ms on Zen 4); a chunk also streams its weights in one
 * run. A worker that has not started claims nothing; one descheduled mid-chunk holds back only that
 * chunk. Idle workers spin briefly (the next kernel of a step follows within microseconds), then
 * sleep on a futex.
 */
#define _GNU_SOURCE
#include "kernels.h"

#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define MAX_WORKERS 255
#define SETTING_UP 0xffffffffu
#define SPIN_NS 200000   /* how long an idle worker polls before it sleeps */

#define LINE 64

/* Written by the claimers, read by the caller, set up by the caller: each on a line of its own. */
static _Alignas(LINE) _Atomic uint64_t state;
static _Alignas(LINE) _Atomic int64_t job_done;
static _Alignas(LINE) _Atomic int joined;
static _Alignas(LINE) _Atomic(pool_fn) job_fn;
static _Atomic(void *) job_ctx;
static _Atomic int64_t job_items, job_threads;
static _Alignas(LINE) _Atomic uint32_t wake_word;
static _Atomic int sleepers;
static int num_workers;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int runnable(uint64_t s, uint32_t seen) { return (uint32_t)(s >> 32) != seen && (uint32_t)s != SETTING_UP; }

/* Claim and run chunks of generation `gen` until none is left. */
static void run_items(uint32_t gen, pool_fn fn, void *ctx, int64_t items, int64_t threads) {
    int64_t done = 0;
    for (;;) {
        uint64_t s = atomic_load(&state);
        const int64_t first = (int64_t)(uint32_t)s;
        if ((uint32_t)(s >> 32) != gen || first >= items) break;
        int64_t n = (items - first) / threads;
        if (n < 1) n = 1;
        if (!atomic_compare_exchange_weak(&state, &s, s + (uint64_t)n)) continue;
        for (int64_t i = first; i < first + n; i++) fn(ctx, i);
        done += n;
    }
    if (done) atomic_fetch_add(&job_done, done);
}

static void *worker(void *arg) {
    (void)arg;
    uint32_t seen = (uint32_t)(atomic_load(&state) >> 32);
    for (;;) {
        int64_t idle_since = now_ns();
        uint64_t s;
        while (!runnable(s = atomic_load(&state), seen)) {
            PAUSE();
            if (now_ns() - idle_since < SPIN_NS) continue;
            const uint32_t word = atomic_load(&wake_word);
            atomic_fetch_add(&sleepers, 1);
            if (!runnable(atomic_load(&state), seen))
                syscall(SYS_futex, &wake_word, FUTEX_WAIT_PRIVATE, word, NULL, NULL, 0);
            atomic_fetch_sub(&sleepers, 1);
            idle_since = now_ns();
        }
        const uint32_t gen = (uint32_t)(s >> 32);
        const pool_fn fn = atomic_load_explicit(&job_fn, memory_order_relaxed);
        void *ctx = atomic_load_explicit(&job_ctx, memory_order_relaxed);
        const int64_t items = atomic_load_explicit(&job_items, memory_order_relaxed);
        const int64_t threads = atomic_load_explicit(&job_threads, memory_order_relaxed);
        atomic_thread_fence(memory_order_acquire);
        if (atomic_load_explicit(&state, memory_order_relaxed) >> 32 != gen) continue;   /* a newer job: reread */
        seen = gen;
        if (atomic_fetch_add(&joined, 1) < threads - 1) run_items(gen, fn, ctx, items, threads);
    }
    return NULL;
}

static void after_fork_in_child(void) {   /* the child has no workers; the caller alone runs every item */
    num_workers = 0;
    pthread_mutex_init(&call_lock, NULL);
}

static void start_workers(int64_t wanted) {
    static int registered;
    if (!registered) {
        pthread_atfork(NULL, NULL, after_fork_in_child);
        registered = 1;
    }
    if (wanted > MAX_WORKERS) wanted = MAX_WORKERS;
    while (num_workers < wanted) {
        pthread_t thread;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        pthread_attr_setstacksize(&attr, 8 << 20);   /* the attention kernel keeps its tiles on the stack */
        const int failed = pthread_create(&thread, &attr, worker, NULL);
        pthread_attr_destroy(&attr);
        if (failed) break;
        num_workers++;
    }
}

void pool_for(int64_t items, pool_fn fn, void *ctx, int64_t num_threads) {
    if (items <= 0) return;
    if (num_threads > items) num_threads = items;
    /* One job at a time: a nested or concurrent call runs its items itself. */
    if (num_threads <= 1 || items >= SETTING_UP || pthread_mutex_trylock(&call_lock) != 0) {
        for (int64_t i = 0; i < items; i++) fn(ctx, i);
        return;
    }
    start_workers(num_threads - 1);
    const uint32_t gen = (uint32_t)(atomic_load(&state) >> 32) + 1;
    atomic_store(&state, ((uint64_t)gen << 32) | SETTING_UP);
    atomic_store(&job_fn, fn);
    atomic_store(&job_ctx, ctx);
    atomic_store(&job_items, items);
    atomic_store(&job_threads, num_threads);
    atomic_store(&joined, 0);
    atomic_store(&job_done, 0);
    atomic_store(&state, (uint64_t)gen << 32);
    atomic_fetch_add(&wake_word, 1);
    if (atomic_load(&sleepers) > 0) syscall(SYS_futex, &wake_word, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_items(gen, fn, ctx, items, num_threads);
    /* Only items already claimed are left: wait for them, yielding now and then in case their worker
     * shares a core with us. */
    for (int64_t spins = 0; atomic_load(&job_done) < items; spins++) {
        PAUSE();
        if (spins % 4096 == 4095) sched_yield();
    }
    pthread_mutex_unlock(&call_lock);
}
