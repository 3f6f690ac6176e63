/* All-reduce (sum) of float32 between the tensor-parallel ranks of one machine, through shared memory.
 *
 * gloo's TCP all-reduce costs ~0.5 ms on loopback, and a step makes two per layer. Here each rank
 * copies its part into its own slot of a shared segment, publishes a round number, waits until every
 * rank has published it, and sums all slots in rank order, so every rank gets the same bits. A
 * second round number says "done reading"; a rank waits for it before it overwrites its slot in
 * the next call. The wait spins (the peer is normally microseconds behind), yields after a while,
 * and checks now and then that every peer process is still alive: a dead peer ends the call with
 * an error instead of a hang.
 *
 * Segment: `world` counters, one per 64-byte line, then `world` slots of `slot_elems` floats.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>
#include <time.h>

#include "kernels.h"
#if defined(__x86_64__)
#include <immintrin.h>
#define PAUSE() _mm_pause()
#else
#define PAUSE() ((void)0)
#endif

#define LINE_INT64S 8

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* A process that exited but is not yet reaped (a killed child of ours) still answers kill(pid, 0):
 * its state in /proc says Z (zombie) or X (dead). */
static int process_alive(pid_t pid) {
    if (kill(pid, 0) != 0 && errno == ESRCH) return 0;
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL) return 1;   /* no /proc: trust kill() */
    size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    const char *close_paren = strrchr(buf, ')');
    return !(close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'));
}

static int peers_alive(const int64_t *pids, int world, int rank) {
    for (int r = 0; r < world; r++)
        if (r != rank && !process_alive((pid_t)pids[r])) return 0;
    return 1;
}

/* Until every rank's counter is >= target: 0, or -1 on timeout, -2 when a peer process is gone. */
static int wait_all(_Atomic int64_t *counters, int world, int rank, int64_t target, const int64_t *pids,
                    int64_t timeout_ns) {
    int64_t spins = 0, started = 0;
    for (int r = 0; r < world; r++) {
        while (atomic_load_explicit(&counters[r * LINE_INT64S], memory_order_acquire) < target) {
            if (++spins < 20000) { PAUSE(); continue; }
            sched_yield();
            if ((spins & 1023) == 0) {
                int64_t t = now_ns();
                if (started == 0) started = t;
                if (!peers_alive(pids, world, rank)) return -2;
                if (t - started > timeout_ns) return -1;
            }
        }
    }
    return 0;
}

/* x[0:n] = the sum over ranks of their x, for n <= slot_elems. `round` counts calls from 1, the same on
 * every rank. Returns 0, -1 (a peer did not answer within timeout_ns) or -2 (a peer process is gone). */
int shm_allreduce(float *x, int64_t n, void *segment, int64_t slot_elems, int rank, int world, int64_t round,
                  const int64_t *pids, int64_t timeout_ns) {
    _Atomic int64_t *counters = (_Atomic int64_t *)segment;
    float *slots = (float *)((char *)segment + (int64_t)world * LINE_INT64S * sizeof(int64_t));
    /* Every rank has finished reading the previous round before this slot is written again. */
    int status = wait_all(counters, world, rank, 2 * (round - 1), pids, timeout_ns);
    if (status) return status;
    memcpy(slots + (int64_t)rank * slot_elems, x, (size_t)n * sizeof(float));
    atomic_store_explicit(&counters[rank * LINE_INT64S], 2 * round - 1, memory_order_release);
    status = wait_all(counters, world, rank, 2 * round - 1, pids, timeout_ns);
    if (status) return status;
    memcpy(x, slots, (size_t)n * sizeof(float));
    for (int r = 1; r < world; r++) {
        const float *s = slots + (int64_t)r * slot_elems;
        for (int64_t i = 0; i < n; i++) x[i] += s[i];
    }
    atomic_store_explicit(&counters[rank * LINE_INT64S], 2 * round, memory_order_release);
    return 0;
}
