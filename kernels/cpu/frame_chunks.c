/* Python's frame chunks kept for reuse: not a kernel, a fix for the interpreter the engine's host path runs on.
 *
 * CPython 3.11 to 3.13 keep a thread's Python frames on a data stack made of 16 KiB chunks. A chunk comes from the
 * interpreter's arena allocator (on Linux, an mmap of fresh pages) when a call does not fit the chunk below it, and
 * goes back to it (a munmap) as soon as that call returns. A loop whose calls sit right at a chunk's end therefore
 * maps, faults in and unmaps 16 KiB at every call: 100 times a small call's cost (CPython issue gh-142183, fixed in
 * 3.14 and late 3.13 releases by caching one chunk per thread). Where that end falls depends on how deep the caller
 * already is, so the same engine step is quick in one script and slower in another cell, test or thread.
 *
 * These two functions wrap the arena allocator the interpreter had: small regions (at most LARGEST bytes, so frame
 * chunks and never pymalloc's arenas, which are 256 KiB or 1 MiB) that the interpreter gives back are kept, up to
 * SLOTS of them, and handed out again for the next request of the same size; everything else goes to the wrapped
 * allocator, which also made every region kept here, so a kept region is always one it can free. The interpreter
 * calls them with the GIL held; a spin lock guards the few lines anyway (a thread state freed without the GIL).
 * kvpaging/worker/host_memory.py installs them (PyObject_SetArenaAllocator, through ctypes).
 */
#include <stddef.h>
#include <stdint.h>

/* CPython's PyObjectArenaAllocator (Include/cpython/objimpl.h), the same three members in the same order */
typedef struct {
    void *ctx;
    void *(*alloc)(void *ctx, size_t size);
    void (*free)(void *ctx, void *ptr, size_t size);
} arena_allocator;

#define SLOTS 8
#define LARGEST (64 << 10)

static arena_allocator wrapped;
static void *kept[SLOTS];
static size_t kept_size[SLOTS];
static int num_kept;
static int64_t num_reused;
static char lock;

static void take_lock(void)
{
    while (__atomic_test_and_set(&lock, __ATOMIC_ACQUIRE)) {
    }
}

static void drop_lock(void)
{
    __atomic_clear(&lock, __ATOMIC_RELEASE);
}

static void *keeping_alloc(void *ctx, size_t size)
{
    (void)ctx;
    void *region = NULL;
    take_lock();
    for (int i = num_kept - 1; i >= 0; i--) {
        if (kept_size[i] == size) {
            region = kept[i];
            num_kept--;
            kept[i] = kept[num_kept];
            kept_size[i] = kept_size[num_kept];
            num_reused++;
            break;
        }
    }
    drop_lock();
    return region != NULL ? region : wrapped.alloc(wrapped.ctx, size);
}

static void keeping_free(void *ctx, void *ptr, size_t size)
{
    (void)ctx;
    take_lock();
    if (size <= LARGEST && num_kept < SLOTS) {
        kept[num_kept] = ptr;
        kept_size[num_kept] = size;
        num_kept++;
        ptr = NULL;
    }
    drop_lock();
    if (ptr != NULL) {
        wrapped.free(wrapped.ctx, ptr, size);
    }
}

/* Fill `keeping` with an allocator that wraps `current` (the interpreter's, read with PyObject_GetArenaAllocator).
 * Call it once: the caller then installs `keeping` with PyObject_SetArenaAllocator. */
void kvpaging_keep_frame_chunks(const arena_allocator *current, arena_allocator *keeping)
{
    wrapped = *current;
    keeping->ctx = NULL;
    keeping->alloc = keeping_alloc;
    keeping->free = keeping_free;
}

/* How many regions were handed out again instead of being asked of the wrapped allocator. */
int64_t kvpaging_frame_chunks_reused(void)
{
    return __atomic_load_n(&num_reused, __ATOMIC_RELAXED);
}
