/* A parallel for over work items that never waits for a thread that has not started.
 *
 * The caller and up to num_threads - 1 pool workers claim chunks of items from a shared counter;
 * the call returns when every item is done. A worker the OS has descheduled (another process wants
 * the core) simply claims nothing, and the caller does its share, where a fork-join region with a
 * closing barrier would stall the whole step until that worker runs again. Which thread computes
 * an item never changes its result.
 */
#ifndef CONVEYOR_POOL_H
#define CONVEYOR_POOL_H
#include <stdint.h>

typedef void (*pool_fn)(void *ctx, int64_t item);

void pool_for(int64_t items, pool_fn fn, void *ctx, int64_t num_threads);

#endif
