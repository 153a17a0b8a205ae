/* hexir's cpu thread pool, linked into every cpu library the compiler builds.

   The runtime parks its worker threads in hexir_pool_work (entered once through ctypes, which
   releases the GIL for good) and hands a launch's chunks to them with hexir_pool_run: between
   the chunks of a launch there is no Python, no lock and no system call while the workers spin
   (a Python thread pool costs ~50 us a chunk on a 2-core VM, ~20 us on a 16-core host).

   One launch at a time (the runtime serialises callers). hexir_pool_run publishes the launch in
   `claim`: generation << 32 | chunks << 16 | next chunk. A thread takes chunk `next` with a
   compare-and-swap on that word, so it can never take a chunk of a launch it has not seen, nor
   one past its end; the launch's fields it then reads were written before the word (release /
   acquire) and stay until `pending` reaches 0, which waits for that very chunk. Idle workers spin
   on `generation` for a while, then sleep on it (a futex); `sleepers` tells the caller whether it
   must wake them.

   A kernel is `void k(T *a0, ..., int64_t s0, ..., int64_t first, int64_t last)`: every argument
   of the integer class, so on x86-64 (System V) and AArch64 it is called through one pointer type
   taking MAX_ARGS words: its own arguments first, the chunk's bounds right after them, the rest
   zeros that it never reads (the caller cleans the stack in both conventions). */
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

typedef intptr_t word;
enum { MAX_ARGS = 32, SPINS = 1 << 14 };  /* pause: 10-140 cycles by CPU, so ~0.1-1 ms */
typedef void (*kernel)(word, word, word, word, word, word, word, word, word, word, word, word, word, word, word,
                       word, word, word, word, word, word, word, word, word, word, word, word, word, word, word,
                       word, word);

static struct {
    _Atomic uint64_t claim;
    _Atomic uint32_t generation;
    _Atomic int64_t pending;
    _Atomic int32_t sleepers;
    kernel function;
    const word *args;
    int count;
    const int64_t *bounds;
} pool;

static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ volatile("yield");
#endif
}

/* Run `function` on its `count` arguments and the bounds [first, last). */
static void call(kernel function, const word *args, int count, int64_t first, int64_t last) {
    word a[MAX_ARGS] = {0};
    memcpy(a, args, sizeof(word) * count);
    a[count] = first;
    a[count + 1] = last;
    function(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15],
             a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23], a[24], a[25], a[26], a[27], a[28], a[29], a[30],
             a[31]);
}

/* Run chunks of launch `generation` until none is left. */
static void run_chunks(uint32_t generation) {
    for (;;) {
        uint64_t claim = atomic_load_explicit(&pool.claim, memory_order_acquire);
        do {
            if ((uint32_t)(claim >> 32) != generation || (claim & 0xffff) >= ((claim >> 16) & 0xffff))
                return;
        } while (!atomic_compare_exchange_weak_explicit(&pool.claim, &claim, claim + 1, memory_order_acq_rel,
                                                        memory_order_acquire));
        uint64_t chunk = claim & 0xffff;
        call(pool.function, pool.args, pool.count, pool.bounds[chunk], pool.bounds[chunk + 1]);
        atomic_fetch_sub_explicit(&pool.pending, 1, memory_order_release);
    }
}

/* The most arguments (pointers and sizes, without the bounds) a kernel run by the pool may take. */
int hexir_pool_max_args(void) { return MAX_ARGS - 2; }

/* A worker: take the chunks of each launch published after the one it last saw; never returns. */
void hexir_pool_work(void) {
    uint32_t seen = atomic_load(&pool.generation);
    for (;;) {
        uint32_t now;
        int spins = 0;
        while ((now = atomic_load_explicit(&pool.generation, memory_order_acquire)) == seen) {
            if (++spins < SPINS) {
                relax();
                continue;
            }
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
            spins = 0;
        }
        seen = now;
        run_chunks(now);
    }
}

/* Run `function` on `count` arguments for chunks [bounds[i], bounds[i + 1]), i < chunks (at most
   65535: they are counted in 16 bits of `claim`), on the workers and this thread; return when
   every chunk is done. */
void hexir_pool_run(kernel function, const word *args, int count, const int64_t *bounds, int chunks) {
    pool.function = function;
    pool.args = args;
    pool.count = count;
    pool.bounds = bounds;
    atomic_store_explicit(&pool.pending, chunks, memory_order_relaxed);
    uint32_t generation = atomic_load(&pool.generation) + 1;
    atomic_store_explicit(&pool.claim, (uint64_t)generation << 32 | (uint64_t)chunks << 16, memory_order_release);
    atomic_store(&pool.generation, generation);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    run_chunks(generation);
    while (atomic_load_explicit(&pool.pending, memory_order_acquire) > 0)
        relax();
}

/* Run `count` launches in order, each five words: function, args, its count, bounds, chunks (as
   hexir_pool_run takes them). A launch of one chunk runs on this thread alone, without the pool:
   a host program's kernels in one foreign call (the runtime holds the pool if any has more). */
void hexir_pool_sequence(const word *launches, int count) {
    for (const word *l = launches; l < launches + 5 * count; l += 5) {
        const int64_t *bounds = (const int64_t *)l[3];
        if (l[4] == 1)
            call((kernel)l[0], (const word *)l[1], (int)l[2], bounds[0], bounds[1]);
        else
            hexir_pool_run((kernel)l[0], (const word *)l[1], (int)l[2], bounds, (int)l[4]);
    }
}
