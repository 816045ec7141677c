// CUDA C on the CPU: what a kernel source needs from CUDA, given its CUDA meaning, so the
// very text NVRTC compiles for the GPU compiles with g++ and runs here (tests/cuda_cpu.py
// compiles it with `-include cuda_host.h` and launches kernels through ctypes).
//
// Execution model. A launch runs its blocks one after another (the last first in "high"
// order, below); the threads of a block are
// fibers (ucontext stacks) on one OS thread, and a fiber runs until a *sync point*:
// __syncthreads (the block's barrier), a warp shuffle or __syncwarp (its warp's barrier), or
// its end. The scheduler then resumes the LOWEST-numbered runnable thread ("low" order) or
// the highest ("high"). So one thread runs as far ahead of the others as CUDA allows: thread
// 0 (and warp 0) reaches its next barrier before thread 1 starts its current phase. Any read
// of shared memory that a missing __syncthreads leaves unordered sees the wrong value
// deterministically: e.g. warp 0 reads sh[1..] before warp 1 has written them, or warp 0
// overwrites sh[0] while the other warps have yet to read it. Memory between sync points is
// never interleaved, so atomics are plain read-modify-writes.
//
// __shared__ is `static`: one copy per kernel/function, shared by the fibers of the block
// being run, which is exactly CUDA's "one copy per block" because blocks never overlap (a
// thread_local would be the same thing here, since all fibers share one OS thread; what would
// be wrong is per-fiber storage). Dynamic (extern) shared memory is not supported. Every
// __shared__ variable lives in the linker section "cuda_shared", which is filled with 0xff
// bytes before each block runs: a block starts with NaN floats (of every width) and -1
// integers in its shared memory, as a GPU block starts with whatever was there, so a read
// before this block's write cannot pass by finding the previous block's value.
//
// Warp shuffles: each lane deposits its value and waits; when every lane named in the mask
// (that exists in the block) has arrived, every lane's result is computed at once, so no
// lane can overwrite its value before another read it. A lane shuffling with a mask that
// omits itself, lanes with different masks, a __syncthreads reached while other threads of
// the block have exited, or a barrier nobody can pass (deadlock) fail the launch with a
// message (cuda_cpu_error()). A shuffle from a lane outside the mask returns NaN bits.
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define __shared__ static __attribute__((section("cuda_shared"), used))

// ---- dimensions -------------------------------------------------------------------------
struct dim3 { unsigned x = 1, y = 1, z = 1; };
typedef dim3 uint3;
static dim3 threadIdx, blockIdx, blockDim, gridDim;   // set by the scheduler per fiber
static const int warpSize = 32;

// ---- __half and __nv_bfloat16: round to nearest even, as __float2half / __float2bfloat16
static inline unsigned short cpu_f2h(float f) {
    uint32_t x, sign, ax, h, rem;
    memcpy(&x, &f, 4);
    sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) return (unsigned short)(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (ax >= 0x477ff000u) return (unsigned short)(sign | 0x7c00u);   // >= 65520: inf
    if (ax < 0x38800000u) {                           // below 2^-14: a subnormal half
        float af;
        memcpy(&af, &ax, 4);
        return (unsigned short)(sign | (uint32_t)nearbyintf(af * 16777216.0f));
    }
    h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13));
    rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) h++;
    return (unsigned short)(sign | h);
}
static inline float cpu_h2f(unsigned short h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, x;
    if (e == 0) {
        float v = ldexpf((float)m, -24);
        return sign ? -v : v;
    }
    x = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    float f;
    memcpy(&f, &x, 4);
    return f;
}
static inline unsigned short cpu_f2bf(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((x >> 16) | 0x40u);   // nan
    return (unsigned short)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
static inline float cpu_bf2f(unsigned short b) {
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, 4);
    return f;
}
struct __half {
    unsigned short bits;
    __half() = default;
    __half(float f) : bits(cpu_f2h(f)) {}
    operator float() const { return cpu_h2f(bits); }
};
struct __nv_bfloat16 {
    unsigned short bits;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : bits(cpu_f2bf(f)) {}
    operator float() const { return cpu_bf2f(bits); }
};
static inline float __half2float(__half h) { return cpu_h2f(h.bits); }
static inline __half __float2half(float f) { return __half(f); }
static inline float __bfloat162float(__nv_bfloat16 b) { return cpu_bf2f(b.bits); }
static inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }

// ---- math intrinsics (macros: glibc's math.h already declares __expf and friends) ---------
#define __expf(x) expf(x)
#define __logf(x) logf(x)
#define __powf(x, y) powf(x, y)
#define __fdividef(x, y) ((x) / (y))
static inline float rsqrtf(float v) { return 1.0f / sqrtf(v); }
static inline double rsqrt(double v) { return 1.0 / sqrt(v); }
static inline float __saturatef(float v) { return v < 0.0f ? 0.0f : v > 1.0f ? 1.0f : v; }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline float min(float a, float b) { return fminf(a, b); }
static inline float max(float a, float b) { return fmaxf(a, b); }
static inline double min(double a, double b) { return fmin(a, b); }
static inline double max(double a, double b) { return fmax(a, b); }

// ---- the fiber scheduler ------------------------------------------------------------------
namespace cpu {
enum State { RUN, AT_BLOCK, AT_WARP, DONE };
struct Fiber { ucontext_t ctx; State st; dim3 tid; };
struct Warp { unsigned mask, arrived, exists; uint64_t val[32], out[32]; int src[32]; };
struct Run {
    Fiber* f = nullptr;
    char* stacks = nullptr;
    Warp* warps = nullptr;
    ucontext_t sched;
    int n = 0, cur = 0, at_block = 0, done = 0, from = 0, high = 0;
    bool failed = false;
    void (*body)(void**) = nullptr;
    void** args = nullptr;
};
static Run R;
static char error[1024];
static const size_t STACK = 128 * 1024;

// The memory clobbers: another fiber may have written any shared or global value meanwhile
static void yield() {
    asm volatile("" ::: "memory");
    swapcontext(&R.f[R.cur].ctx, &R.sched);
    asm volatile("" ::: "memory");
}

static void fail(const char* what, int a, int b) {     // from inside a fiber: never resumed
    snprintf(error, sizeof error, "block (%u,%u,%u) thread %d: ", blockIdx.x, blockIdx.y,
             blockIdx.z, R.cur);
    size_t k = strlen(error);
    snprintf(error + k, sizeof error - k, what, a, b);
    R.failed = true;
    yield();
    abort();
}

static void fiber_main() {
    R.body(R.args);
    R.f[R.cur].st = DONE;
    R.done++;                                   // returns to R.sched through uc_link
}

static void block_barrier() {
    R.f[R.cur].st = AT_BLOCK;
    R.at_block++;
    yield();
}

// position in the scheduling order <-> thread number
static int thread_at(int pos) { return R.high ? R.n - 1 - pos : pos; }
static int pos_of(int t) { return R.high ? R.n - 1 - t : t; }

static uint64_t warp_exchange(unsigned mask, uint64_t bits, int src) {
    int t = R.cur, lane = t & 31;
    Warp& w = R.warps[t >> 5];
    if (!((mask >> lane) & 1u)) fail("warp sync with mask %#x that omits its own lane %d",
                                     (int)mask, lane);
    if (w.arrived && w.mask != mask) fail("warp sync masks differ: %#x vs %#x", (int)mask,
                                          (int)w.mask);
    w.mask = mask;
    w.val[lane] = bits, w.src[lane] = src, w.arrived |= 1u << lane;
    R.f[t].st = AT_WARP;
    unsigned need = mask & w.exists;
    if ((w.arrived & need) == need) {           // the last lane in: every result at once
        int base = t & ~31;
        for (int l = 0; l < 32; l++) {
            if (!((w.arrived >> l) & 1u)) continue;
            int s = w.src[l];
            bool ok = s >= 0 && s < 32 && ((w.arrived >> s) & 1u);
            w.out[l] = ok ? w.val[s] : ~(uint64_t)0;
            R.f[base + l].st = RUN;
            int p = pos_of(base + l);
            if (p < R.from) R.from = p;
        }
        w.arrived = 0;
    }
    yield();
    return w.out[lane];
}

static void deadlock() {
    int at_block = 0, at_warp = 0, first_warp = -1;
    for (int t = 0; t < R.n; t++) {
        at_block += R.f[t].st == AT_BLOCK;
        if (R.f[t].st == AT_WARP && first_warp < 0) first_warp = t;
        at_warp += R.f[t].st == AT_WARP;
    }
    snprintf(error, sizeof error, "block (%u,%u,%u): deadlock: %d threads at __syncthreads, "
             "%d at a warp sync (first: thread %d), %d exited", blockIdx.x, blockIdx.y,
             blockIdx.z, at_block, at_warp, first_warp, R.done);
    R.failed = true;
}

// the bounds of section "cuda_shared", from the linker (null where a source has no __shared__)
extern "C" char __start_cuda_shared[] __attribute__((weak, visibility("hidden")));
extern "C" char __stop_cuda_shared[] __attribute__((weak, visibility("hidden")));

static void poison_shared() {
    if (__start_cuda_shared != nullptr)
        memset(__start_cuda_shared, 0xff, (size_t)(__stop_cuda_shared - __start_cuda_shared));
}

static void run_block() {
    poison_shared();
    R.at_block = R.done = R.from = 0;
    for (int t = 0; t < R.n; t++) {
        Fiber& f = R.f[t];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = R.stacks + (size_t)t * STACK;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &R.sched;
        makecontext(&f.ctx, fiber_main, 0);
        f.st = RUN;
        f.tid.x = t % blockDim.x, f.tid.y = t / blockDim.x % blockDim.y;
        f.tid.z = t / (blockDim.x * blockDim.y);
    }
    for (int w = 0; w < (R.n + 31) / 32; w++) {
        int lanes = R.n - 32 * w < 32 ? R.n - 32 * w : 32;
        R.warps[w].arrived = 0, R.warps[w].exists = lanes == 32 ? ~0u : (1u << lanes) - 1;
    }
    while (!R.failed && R.done < R.n) {
        int p = R.from;
        while (p < R.n && R.f[thread_at(p)].st != RUN) p++;
        if (p == R.n) { deadlock(); return; }
        R.from = p;                              // nothing runnable before p
        R.cur = thread_at(p);
        threadIdx = R.f[R.cur].tid;
        swapcontext(&R.sched, &R.f[R.cur].ctx);
        if (R.at_block && R.at_block + R.done == R.n) {
            if (R.done) {
                snprintf(error, sizeof error, "block (%u,%u,%u): __syncthreads reached by %d "
                         "threads while %d have exited", blockIdx.x, blockIdx.y, blockIdx.z,
                         R.at_block, R.done);
                R.failed = true;
                return;
            }
            for (int t = 0; t < R.n; t++) R.f[t].st = RUN;
            R.at_block = 0, R.from = 0;
        }
    }
}

// Run body(args) as a kernel launch; 0 on success, else 1 and the reason in cuda_cpu_error().
static int launch(const unsigned* grid, const unsigned* block, int high,
                  void (*body)(void**), void** args) {
    gridDim.x = grid[0], gridDim.y = grid[1], gridDim.z = grid[2];
    blockDim.x = block[0], blockDim.y = block[1], blockDim.z = block[2];
    R.n = (int)(block[0] * block[1] * block[2]);
    if (R.n < 1 || R.n > 1024) {
        snprintf(error, sizeof error, "block of %d threads (CUDA allows 1..1024)", R.n);
        return 1;
    }
    R.f = new Fiber[R.n];
    R.warps = new Warp[(R.n + 31) / 32];
    R.stacks = (char*)malloc((size_t)R.n * STACK);
    R.body = body, R.args = args, R.high = high, R.failed = false;
    error[0] = 0;
    // blocks in order, or (high) the last first: a block reading what another block of
    // the launch writes sees it written in one order and not in the other
    for (unsigned z = 0; z < grid[2] && !R.failed; z++)
        for (unsigned y = 0; y < grid[1] && !R.failed; y++)
            for (unsigned x = 0; x < grid[0] && !R.failed; x++) {
                blockIdx.x = high ? grid[0] - 1 - x : x;
                blockIdx.y = high ? grid[1] - 1 - y : y;
                blockIdx.z = high ? grid[2] - 1 - z : z;
                run_block();
            }
    free(R.stacks);
    delete[] R.warps;
    delete[] R.f;
    return R.failed ? 1 : 0;
}
}  // namespace cpu

extern "C" const char* cuda_cpu_error() { return cpu::error; }

static inline void __syncthreads() { cpu::block_barrier(); }
static inline void __syncwarp(unsigned mask = 0xffffffffu) {
    cpu::warp_exchange(mask, 0, threadIdx.x & 31);
}

// The shuffles: the source lane by CUDA's rules (width a power of two <= 32), then one
// exchange of the value's bytes (up to 8).
template <class V> static V cpu_shfl(unsigned mask, V v, int src) {
    static_assert(sizeof(V) <= 8, "shuffle of more than 8 bytes");
    uint64_t bits = 0;
    memcpy(&bits, &v, sizeof(V));
    bits = cpu::warp_exchange(mask, bits, src);
    memcpy(&v, &bits, sizeof(V));
    return v;
}
static inline int cpu_lane() { return cpu::R.cur & 31; }
template <class V> static V __shfl_sync(unsigned mask, V v, int src, int width = 32) {
    return cpu_shfl(mask, v, cpu_lane() / width * width + src % width);
}
template <class V> static V __shfl_xor_sync(unsigned mask, V v, int lane_mask, int width = 32) {
    int lane = cpu_lane(), s = lane ^ lane_mask;
    return cpu_shfl(mask, v, s >= (lane / width + 1) * width ? lane : s);
}
template <class V> static V __shfl_down_sync(unsigned mask, V v, unsigned d, int width = 32) {
    int lane = cpu_lane();
    return cpu_shfl(mask, v, lane % width + (int)d >= width ? lane : lane + (int)d);
}
template <class V> static V __shfl_up_sync(unsigned mask, V v, unsigned d, int width = 32) {
    int lane = cpu_lane();
    return cpu_shfl(mask, v, lane % width < (int)d ? lane : lane - (int)d);
}

// ---- atomics: fibers never interleave between sync points, so these are plain ----------
template <class V> static V atomicAdd(V* p, V v) { V o = *p; *p = o + v; return o; }
template <class V> static V atomicSub(V* p, V v) { V o = *p; *p = o - v; return o; }
template <class V> static V atomicMax(V* p, V v) { V o = *p; *p = o > v ? o : v; return o; }
template <class V> static V atomicMin(V* p, V v) { V o = *p; *p = o < v ? o : v; return o; }
template <class V> static V atomicExch(V* p, V v) { V o = *p; *p = v; return o; }
template <class V> static V atomicCAS(V* p, V cmp, V v) {
    V o = *p;
    if (o == cmp) *p = v;
    return o;
}
