// cudasim.h: CUDA's execution model on the CPU, for hpcdist's own kernels (cudasim.py).
//
// The grid's blocks run one after another; the threads of a block run as fibers (ucontext),
// each until it reaches __syncthreads, a warp shuffle or its end, in an order the launch
// chooses (forward, reversed, or a seeded shuffle: a race inside a block shows as a different
// result). Pointers are bounds-checked (Ptr): a read or write outside an array is reported
// with the array's name, the index, the thread and the block, and goes to a scratch element
// instead of memory. What this cannot show: speed, coalescing, races between blocks (blocks
// never overlap here), and the GPU's own math library (libm's expf is not CUDA's).
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <type_traits>
#include <vector>
#include <ucontext.h>

using std::exp; using std::log; using std::sqrt; using std::tanh; using std::fabs;
using std::exp2; using std::log2;
using std::max; using std::min;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static          // one copy: the blocks of a grid run one at a time

struct dim3 { unsigned x = 1, y = 1, z = 1; };
static dim3 threadIdx, blockIdx, blockDim, gridDim;

// ---- what went wrong: the first fault of a launch, in words ---------------------------------
static char sim_error[1024];
static int sim_failed = 0;
static const char* sim_kernel = "";

static void sim_fail(const char* fmt, ...) {
    if (sim_failed) return;
    sim_failed = 1;
    int n = snprintf(sim_error, sizeof sim_error, "%s, block (%u,%u,%u), thread (%u,%u,%u): ",
                     sim_kernel, blockIdx.x, blockIdx.y, blockIdx.z,
                     threadIdx.x, threadIdx.y, threadIdx.z);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sim_error + n, sizeof sim_error - n, fmt, ap);
    va_end(ap);
}

// ---- bounds-checked pointers: every T* of a kernel's source becomes a Ptr<T> -----------------
static unsigned char sim_scratch[64];             // where an out-of-bounds access goes

template <class T> struct Ptr {
    T* base = nullptr;
    long long n = 0, off = 0;
    const char* name = "a null pointer";

    Ptr() = default;
    Ptr(T* b, long long count, const char* label) : base(b), n(count), name(label) {}
    template <size_t N> Ptr(T (&a)[N]) : base(a), n(N), name("a __shared__ array") {}
    template <class U, class = std::enable_if_t<std::is_convertible<U*, T*>::value>>
    Ptr(const Ptr<U>& o) : base(o.base), n(o.n), off(o.off), name(o.name) {}
    template <class U, class = std::enable_if_t<!std::is_convertible<U*, T*>::value>, class = void>
    explicit Ptr(const Ptr<U>& o)                  // (A*)smem: the same bytes, another type
        : base((T*)(void*)o.base), n(o.n * (long long)sizeof(U) / (long long)sizeof(T)),
          off(o.off * (long long)sizeof(U) / (long long)sizeof(T)), name(o.name) {}

    T& operator[](long long i) const {
        long long at = off + i;
        if (at < 0 || at >= n) {
            sim_fail("%s[%lld] is outside its %lld elements", name, at, n);
            return *(T*)(void*)sim_scratch;
        }
        return base[at];
    }
    T& operator*() const { return (*this)[0]; }
    Ptr operator+(long long i) const { Ptr p = *this; p.off += i; return p; }
    Ptr operator-(long long i) const { Ptr p = *this; p.off -= i; return p; }
    Ptr& operator+=(long long i) { off += i; return *this; }
};

// CUDA's atomicAdd takes int, unsigned, unsigned long long, float and double (no bf16 struct
// of our own): anything else fails to compile here as it does in NVRTC
template <class T> constexpr bool sim_atomic_type() {
    return std::is_same<T, int>::value || std::is_same<T, unsigned>::value ||
           std::is_same<T, unsigned long long>::value || std::is_same<T, float>::value ||
           std::is_same<T, double>::value;
}
template <class T> T atomicAdd(Ptr<T> p, T v) {
    static_assert(sim_atomic_type<T>(), "atomicAdd: no overload for this type in CUDA");
    T old = *p; *p = old + v; return old;
}
template <class T> T atomicAdd(T* p, T v) {
    static_assert(sim_atomic_type<T>(), "atomicAdd: no overload for this type in CUDA");
    T old = *p; *p = old + v; return old;
}

static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline unsigned __float_as_uint(float f) { unsigned u; memcpy(&u, &f, 4); return u; }
static inline float __uint_as_float(unsigned u) { float f; memcpy(&f, &u, 4); return f; }

// ---- the threads of a block, as fibers ------------------------------------------------------
enum { READY, AT_SYNC, AT_SHUFFLE, AT_MMA, DONE };
enum { MMA_BF16_16816 = 1, MMA_TF32_1688 = 2 };
struct Fiber { ucontext_t ctx; std::vector<char> stack; int state; dim3 tid; int src;
               bool xor_lane; uint64_t value, result; long barriers;
               int mma; uint32_t a[4], b[2]; float c[4]; };
static std::vector<Fiber> sim_fibers;
static ucontext_t sim_main;
static int sim_current = 0;
static std::function<void()> sim_body;
static Ptr<unsigned char> sim_dynamic;             // extern __shared__ memory of this launch

static void sim_park(int state) {
    Fiber& f = sim_fibers[sim_current];
    f.state = state;
    swapcontext(&f.ctx, &sim_main);
}

static void __syncthreads() { sim_fibers[sim_current].barriers++; sim_park(AT_SYNC); }

template <class V> V sim_shuffle(unsigned mask, V v, int lane, bool xor_lane) {
    if (mask != 0xffffffffu) sim_fail("a warp shuffle with a partial mask is not modelled");
    Fiber& f = sim_fibers[sim_current];
    static_assert(sizeof(V) <= 8, "a shuffle moves at most 8 bytes");
    f.value = 0;
    memcpy(&f.value, &v, sizeof(V));
    f.src = lane;
    f.xor_lane = xor_lane;
    sim_park(AT_SHUFFLE);
    V out;
    memcpy(&out, &sim_fibers[sim_current].result, sizeof(V));
    return out;
}
template <class V> V __shfl_down_sync(unsigned mask, V v, int delta) {
    return sim_shuffle(mask, v, delta, false);
}
template <class V> V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
    return sim_shuffle(mask, v, lane_mask, true);
}
static void __syncwarp(unsigned mask = 0xffffffffu) { sim_shuffle(mask, 0, 0, false); }
// blocks run one after another here: every write is seen by the next block without a fence
static inline void __threadfence() {}

// ---- the warp's matrix instructions (mma.sync), as the PTX ISA lays out their fragments ----
// A lane of group g = lane / 4, index t = lane % 4 holds, of m16n8k16 (bf16, two a register):
// A rows g and g + 8 at columns 2t, 2t+1 (a0, a1) and 2t+8, 2t+9 (a2, a3); B (k x n) rows 2t,
// 2t+1 and 2t+8, 2t+9 of column g (b0, b1); C/D rows g, g+8 at columns 2t, 2t+1. Of m16n8k8
// (tf32, one value a register): A (g, t) (g+8, t) (g, t+4) (g+8, t+4); B (t, g) (t+4, g).
// The products are summed in double and rounded once (the hardware's order and rounding
// inside the instruction are its own: the kernels' tolerance covers the difference).
static void sim_mma(int kind, uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                    uint32_t b0, uint32_t b1, float& c0, float& c1, float& c2, float& c3) {
    Fiber& f = sim_fibers[sim_current];
    f.mma = kind;
    f.a[0] = a0; f.a[1] = a1; f.a[2] = a2; f.a[3] = a3; f.b[0] = b0; f.b[1] = b1;
    f.c[0] = c0; f.c[1] = c1; f.c[2] = c2; f.c[3] = c3;
    sim_park(AT_MMA);
    Fiber& d = sim_fibers[sim_current];
    c0 = d.c[0]; c1 = d.c[1]; c2 = d.c[2]; c3 = d.c[3];
}
static inline float sim_bf16(uint32_t word, int half) {
    return __uint_as_float(((word >> (16 * half)) & 0xffffu) << 16);
}
static inline float sim_tf32(uint32_t word) { return __uint_as_float(word & 0xffffe000u); }
static void mma_bf16_16816(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                           unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    sim_mma(MMA_BF16_16816, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}
static void mma_tf32_1688(float& c0, float& c1, float& c2, float& c3, unsigned a0, unsigned a1,
                          unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    sim_mma(MMA_TF32_1688, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3);
}
// two fp32 -> bf16x2 as cvt.rn.bf16x2.f32: to nearest even, lo in the low half (a NaN stays
// a NaN)
static inline unsigned sim_bf16_bits(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    u += 0x7fffu + ((u >> 16) & 1u);
    return u >> 16;
}
static inline unsigned pack_bf16x2(float lo, float hi) {
    return sim_bf16_bits(lo) | (sim_bf16_bits(hi) << 16);
}
// fp32 -> tf32 as cvt.rna.tf32.f32: to nearest, ties away from zero (10 bits of mantissa)
static inline float to_tf32(float x) {
    uint32_t u = __float_as_uint(x);
    if ((u & 0x7f800000u) != 0x7f800000u) u += 0x1000u;
    return __uint_as_float(u & 0xffffe000u);
}
// two 16-bit words at an even index as one 32-bit register (the low half first)
static inline unsigned ld_u32(Ptr<const unsigned short> p) {
    if ((p.off & 1) || ((uintptr_t)p.base & 3))
        sim_fail("%s: a 32-bit load at element %lld, not 4-byte aligned", p.name, p.off);
    return (unsigned)p[0] | ((unsigned)p[1] << 16);
}
static inline unsigned ld_u32(Ptr<unsigned short> p) { return ld_u32(Ptr<const unsigned short>(p)); }

// 16 bytes from src to dst (uint4 loads and stores on the device): both 16-byte aligned
template <class X> static void sim_check16(const Ptr<X>& p, const char* what) {
    if ((((uintptr_t)(p.base + p.off)) & 15) != 0)
        sim_fail("%s: a 16-byte %s at element %lld, not 16-byte aligned", p.name, what, p.off);
}
template <class X> static void copy16(Ptr<X> dst, Ptr<const X> src) {
    sim_check16(dst, "store");
    sim_check16(src, "load");
    for (int i = 0; i < (int)(16 / sizeof(X)); i++) dst[i] = src[i];
}
template <class X> static void copy16(Ptr<X> dst, Ptr<X> src) { copy16(dst, Ptr<const X>(src)); }
template <class X> static void zero16(Ptr<X> dst) {
    sim_check16(dst, "store");
    for (int i = 0; i < (int)(16 / sizeof(X)); i++) dst[i] = (X)0;
}

static void sim_warp_mma(int lo) {
    double A[16][16] = {}, Bm[16][8] = {}, C[16][8];
    int kind = sim_fibers[lo].mma;
    for (int l = 0; l < 32; l++) {
        Fiber& f = sim_fibers[lo + l];
        int g = l / 4, t = l % 4;
        if (kind == MMA_BF16_16816) {
            for (int h = 0; h < 2; h++) {
                A[g][2 * t + h] = sim_bf16(f.a[0], h);     A[g + 8][2 * t + h] = sim_bf16(f.a[1], h);
                A[g][2 * t + 8 + h] = sim_bf16(f.a[2], h); A[g + 8][2 * t + 8 + h] = sim_bf16(f.a[3], h);
                Bm[2 * t + h][g] = sim_bf16(f.b[0], h);    Bm[2 * t + 8 + h][g] = sim_bf16(f.b[1], h);
            }
        } else {
            A[g][t] = sim_tf32(f.a[0]);     A[g + 8][t] = sim_tf32(f.a[1]);
            A[g][t + 4] = sim_tf32(f.a[2]); A[g + 8][t + 4] = sim_tf32(f.a[3]);
            Bm[t][g] = sim_tf32(f.b[0]);    Bm[t + 4][g] = sim_tf32(f.b[1]);
        }
        C[g][2 * t] = f.c[0]; C[g][2 * t + 1] = f.c[1];
        C[g + 8][2 * t] = f.c[2]; C[g + 8][2 * t + 1] = f.c[3];
    }
    int K = kind == MMA_BF16_16816 ? 16 : 8;
    for (int l = 0; l < 32; l++) {
        Fiber& f = sim_fibers[lo + l];
        int g = l / 4, t = l % 4, rows[4] = {g, g, g + 8, g + 8};
        for (int i = 0; i < 4; i++) {
            int r = rows[i], c = 2 * t + (i & 1);
            double acc = C[r][c];
            for (int k = 0; k < K; k++) acc += A[r][k] * Bm[k][c];
            f.c[i] = (float)acc;
        }
    }
}

static void sim_entry() { sim_body(); sim_fibers[sim_current].state = DONE; }

// A warp whose live lanes all wait at a shuffle gets its values: lane l reads lane l + delta
// (its own value past the warp's end, as CUDA does) or lane l ^ mask; reading a lane that has
// exited is a fault. A warp whose 32 lanes all wait at the same matrix instruction gets its
// products; a matrix instruction with lanes missing, or lanes at another instruction, is a fault.
static bool sim_release_warps(int nthreads) {
    bool any = false;
    for (int w = 0; w * 32 < nthreads; w++) {
        int lo = w * 32, hi = std::min(nthreads, lo + 32), shuffle = 0, mma = 0, live = 0;
        for (int t = lo; t < hi; t++) {
            live += sim_fibers[t].state != DONE;
            shuffle += sim_fibers[t].state == AT_SHUFFLE;
            mma += sim_fibers[t].state == AT_MMA;
        }
        if (!(shuffle + mma) || shuffle + mma != live) continue;
        if (mma) {
            int kind = -1;
            for (int t = lo; t < hi; t++) {
                Fiber& f = sim_fibers[t];
                if (f.state == DONE) continue;
                if (f.state != AT_MMA || (kind >= 0 && f.mma != kind) || live != 32) {
                    sim_current = t;
                    threadIdx = f.tid;
                    sim_fail("a warp matrix instruction (mma.sync) reached by %d of its 32 lanes%s",
                             mma, f.state == AT_MMA ? " (or by lanes at another shape)"
                             : ", the others at a shuffle");
                    return false;
                }
                kind = f.mma;
            }
            sim_warp_mma(lo);
            for (int t = lo; t < hi; t++) sim_fibers[t].state = READY;
            any = true;
            continue;
        }
        for (int t = lo; t < hi; t++) {
            Fiber& f = sim_fibers[t];
            if (f.state != AT_SHUFFLE) continue;
            int s = f.xor_lane ? lo + ((t - lo) ^ f.src) : t + f.src;
            if (s - lo >= 32) f.result = f.value;
            else if (s >= hi || sim_fibers[s].state != AT_SHUFFLE) {
                sim_current = t;
                threadIdx = f.tid;
                sim_fail("a warp shuffle reads lane %d, which has exited or does not exist",
                         s - lo);
                f.result = f.value;
            } else f.result = sim_fibers[s].value;
        }
        for (int t = lo; t < hi; t++)
            if (sim_fibers[t].state == AT_SHUFFLE) sim_fibers[t].state = READY;
        any = true;
    }
    return any;
}

static void sim_run_block(const std::vector<int>& order, int nthreads) {
    for (int t = 0; t < nthreads; t++) {
        Fiber& f = sim_fibers[t];
        f.state = READY;
        f.barriers = 0;
        f.tid.x = t % blockDim.x;
        f.tid.y = (t / blockDim.x) % blockDim.y;
        f.tid.z = t / (blockDim.x * blockDim.y);
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = &sim_main;
        makecontext(&f.ctx, sim_entry, 0);
    }
    for (;;) {
        for (int t : order) {
            if (sim_fibers[t].state != READY) continue;
            sim_current = t;
            threadIdx = sim_fibers[t].tid;
            swapcontext(&sim_main, &sim_fibers[t].ctx);
        }
        if (sim_release_warps(nthreads)) continue;
        if (sim_failed) return;
        int live = 0, at_sync = 0;
        for (int t = 0; t < nthreads; t++) {
            live += sim_fibers[t].state != DONE;
            at_sync += sim_fibers[t].state == AT_SYNC;
        }
        if (!live) return;
        if (at_sync == live) {
            // CUDA: a barrier must be reached by every thread of the block, or by none
            long k = -1;
            for (int t = 0; t < nthreads; t++)
                if (sim_fibers[t].state == AT_SYNC) k = std::max(k, sim_fibers[t].barriers);
            for (int t = 0; t < nthreads; t++)
                if (sim_fibers[t].barriers != k) {
                    sim_current = t;
                    threadIdx = sim_fibers[t].tid;
                    sim_fail("%s __syncthreads number %ld that others wait at (a barrier in "
                             "divergent code)", sim_fibers[t].state == DONE ? "exited before"
                             : "is at another barrier than", k);
                    return;
                }
            for (int t = 0; t < nthreads; t++)
                if (sim_fibers[t].state == AT_SYNC) sim_fibers[t].state = READY;
            continue;
        }
        sim_fail("deadlock: %d threads wait at __syncthreads while %d wait at a shuffle or a "
                 "matrix instruction (a barrier in divergent code)", at_sync, live - at_sync);
        return;                                     // (the parked fibers are dropped)
    }
}

// Runs ``body`` (the kernel's call) over the grid. order: 0 threads and blocks in index
// order, 1 reversed, 2 shuffled with ``seed``.
static void sim_launch(const char* kernel, dim3 grid, dim3 block, long long shared_bytes,
                       int order, unsigned long long seed, std::function<void()> body) {
    static std::vector<unsigned char> dynamic;
    sim_kernel = kernel;
    sim_failed = 0;
    sim_error[0] = 0;
    gridDim = grid;
    blockDim = block;
    int nthreads = (int)(block.x * block.y * block.z);
    if (nthreads < 1 || nthreads > 1024) {
        sim_fail("a block of %d threads (CUDA allows 1 to 1024)", nthreads);
        return;
    }
    dynamic.assign((size_t)std::max(shared_bytes, 0LL) + 1, 0xA5);
    sim_dynamic = Ptr<unsigned char>(dynamic.data(), shared_bytes, "extern __shared__ memory");
    if ((int)sim_fibers.size() < nthreads) sim_fibers.resize(nthreads);
    for (int t = 0; t < nthreads; t++)
        if (sim_fibers[t].stack.empty()) sim_fibers[t].stack.resize(256 * 1024);
    sim_body = body;
    std::mt19937_64 rng(seed);
    std::vector<int> threads(nthreads);
    for (int t = 0; t < nthreads; t++) threads[t] = order == 1 ? nthreads - 1 - t : t;
    long long nblocks = (long long)grid.x * grid.y * grid.z;
    std::vector<long long> blocks(nblocks);
    for (long long b = 0; b < nblocks; b++) blocks[b] = order == 1 ? nblocks - 1 - b : b;
    if (order == 2) std::shuffle(blocks.begin(), blocks.end(), rng);
    for (long long b : blocks) {
        blockIdx.x = (unsigned)(b % grid.x);
        blockIdx.y = (unsigned)((b / grid.x) % grid.y);
        blockIdx.z = (unsigned)(b / ((long long)grid.x * grid.y));
        if (order == 2) std::shuffle(threads.begin(), threads.end(), rng);
        std::fill(dynamic.begin(), dynamic.end(), (unsigned char)0xA5);   // not zeros
        sim_run_block(threads, nthreads);
        if (sim_failed) return;
    }
}
