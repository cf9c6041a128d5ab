// A step's work split between threads (issue 33). Built with -DSTEP_THREADS (wasm/step_module.py), the
// module imports one shared memory; the caller's thread and every helper are instances of it over that
// memory, each with its own stack. A helper calls step_helper and stays there until step_stop: it spins
// on the job word, and sleeps (memory.atomic.wait32) only after no job came for a while, since a wake-up
// costs more than a projection takes. The caller's thread runs part 0 of each job, then spins until the
// others are done. Parts are whole output rows or whole attention heads, so no number depends on how many
// threads computed it. Without STEP_THREADS a job is one part on the caller's thread.
#pragma once
#include "kernels.h"

typedef void (*part_fn)(const void* ctx, int part, int parts);

#define MAX_THREADS 8  // parts of a job; step.c keeps attention scratch for each

// [lo, hi) of n items (n % unit == 0) for `part` of `parts`, in whole units
static inline void part_range(int n, int unit, int part, int parts, int* lo, int* hi) {
  const int units = n / unit;
  *lo = units * part / parts * unit;
  *hi = units * (part + 1) / parts * unit;
}

EXPORT int32_t step_max_threads(void) { return MAX_THREADS; }

#ifdef STEP_THREADS
#define SPINS (1 << 18)  // about a millisecond of polling before a helper sleeps
#define SEQ __ATOMIC_SEQ_CST

static int32_t helpers = 0;   // helpers inside step_helper
static int32_t job_word = 0;  // a job's sequence number << 4 | its parts: a helper joins if its id < parts
static int32_t job_left = 0;  // helpers still inside the current job
static int32_t sleepers = 0;  // helpers in memory.atomic.wait32
static part_fn job_fn;
static const void* job_ctx;

// A helper thread's loop (its id: the order it entered). A helper counted in a job cannot miss it: it read
// the job word before counting itself, and the next job waits for this one to be done.
EXPORT void step_helper(void) {
  int32_t seen = __atomic_load_n(&job_word, SEQ);
  const int32_t id = __atomic_add_fetch(&helpers, 1, SEQ);
  for (;;) {
    int32_t word;
    for (int spins = 0; (word = __atomic_load_n(&job_word, SEQ)) == seen;) {
      if (++spins < SPINS) continue;
      __atomic_add_fetch(&sleepers, 1, SEQ);  // before the wait reads the word: parallel() reads sleepers after writing it
      __builtin_wasm_memory_atomic_wait32(&job_word, seen, -1);
      __atomic_sub_fetch(&sleepers, 1, SEQ);
      spins = 0;
    }
    seen = word;
    if (!(word & 15)) {  // step_stop
      __atomic_sub_fetch(&helpers, 1, SEQ);
      return;
    }
    if (id < (word & 15)) {
      job_fn(job_ctx, id, word & 15);
      __atomic_sub_fetch(&job_left, 1, SEQ);
    }
  }
}

EXPORT int32_t step_threads(void) { return 1 + __atomic_load_n(&helpers, SEQ); }

// Every helper returns from step_helper (a job word of no parts): the host lets its threads end.
EXPORT void step_stop(void) {
  __atomic_store_n(&job_word, ((__atomic_load_n(&job_word, SEQ) >> 4) + 1) << 4, SEQ);
  __builtin_wasm_memory_atomic_notify(&job_word, (uint32_t)-1);
}

static void parallel(part_fn fn, const void* ctx) {
  int parts = 1 + __atomic_load_n(&helpers, SEQ);
  if (parts > MAX_THREADS) parts = MAX_THREADS;
  if (parts == 1) {
    fn(ctx, 0, 1);
    return;
  }
  job_fn = fn, job_ctx = ctx;
  __atomic_store_n(&job_left, parts - 1, SEQ);
  __atomic_store_n(&job_word, ((__atomic_load_n(&job_word, SEQ) >> 4) + 1) << 4 | parts, SEQ);  // only this thread writes it
  if (__atomic_load_n(&sleepers, SEQ)) __builtin_wasm_memory_atomic_notify(&job_word, (uint32_t)-1);
  fn(ctx, 0, parts);
  while (__atomic_load_n(&job_left, SEQ)) {
  }
}
#else
EXPORT int32_t step_threads(void) { return 1; }

EXPORT void step_stop(void) {}

static inline void parallel(part_fn fn, const void* ctx) { fn(ctx, 0, 1); }
#endif
