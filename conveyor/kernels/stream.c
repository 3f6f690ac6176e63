/* The machine's wall for a decode step: how fast the threads of the pool read a buffer far larger
 * than the caches, split as the matmuls split their weights (contiguous chunks per claim). Every
 * decode figure is reported as a share of it. */
#include <stdint.h>

#include "kernels.h"

typedef long long v8 __attribute__((vector_size(64)));

typedef struct {
    const uint8_t *buf;
    int64_t chunk, bytes;
    v8 sums[256];   /* one per item: nothing is shared between threads but the item counter */
} stream_job;

static void read_chunk(void *arg, int64_t item) {
    stream_job *j = arg;
    const int64_t start = item * j->chunk, end = start + j->chunk < j->bytes ? start + j->chunk : j->bytes;
    v8 a = {0}, b = {0}, c = {0}, d = {0};
    for (int64_t i = start; i + 256 <= end; i += 256) {
        /* as the matmuls do: ahead of the hardware prefetcher, which stops at 4 KiB pages */
        __builtin_prefetch(j->buf + i + 8192, 0, 1);
        __builtin_prefetch(j->buf + i + 8192 + 64, 0, 1);
        __builtin_prefetch(j->buf + i + 8192 + 128, 0, 1);
        __builtin_prefetch(j->buf + i + 8192 + 192, 0, 1);
        a ^= *(const v8 *)(j->buf + i);
        b ^= *(const v8 *)(j->buf + i + 64);
        c ^= *(const v8 *)(j->buf + i + 128);
        d ^= *(const v8 *)(j->buf + i + 192);
    }
    j->sums[item % 256] ^= a ^ b ^ c ^ d;
}

/* XOR of every 64-byte line of buf (bytes a multiple of 256, buf 64-byte aligned), read by num_threads
 * threads in items of `chunk` bytes; the result only keeps the reads from being optimised away. */
int64_t kq_stream_read(const uint8_t *buf, int64_t bytes, int64_t chunk, int64_t num_threads) {
    static stream_job job;
    job.buf = buf;
    job.chunk = chunk;
    job.bytes = bytes;
    for (int i = 0; i < 256; i++) job.sums[i] = (v8){0};
    pool_for((bytes + chunk - 1) / chunk, read_chunk, &job, num_threads);
    v8 s = {0};
    for (int i = 0; i < 256; i++) s ^= job.sums[i];
    return s[0] ^ s[1] ^ s[2] ^ s[3] ^ s[4] ^ s[5] ^ s[6] ^ s[7];
}
