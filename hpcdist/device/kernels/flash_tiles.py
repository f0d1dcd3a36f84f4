"""The tile machinery of tiled (flash) attention, in CUDA C (flash_source.py's kernels use it):
the kinds of arithmetic (``MMA``: FMA in T, bf16 or TF32 tensor cores through ``mma.sync``),
the shared-memory tiles (16-byte loads, transposed copies for bf16), and a warp's products on
the PTX ISA's per-lane fragments: lane l (group g = l / 4, index t = l % 4) holds rows g and
g + 8, columns 8j + 2t and 8j + 2t + 1 of each 8-column slice j. The device's instructions
are inline PTX under ``__CUDACC_RTC__``; cudasim.h models each of them, so every kind runs on
the CPU too. Measurements: docs/results.md, "Tiled attention, cuDNN, Llama"."""

TILES = r"""
#ifndef D_PAD
#define D_PAD 64                 // the head size, padded to a multiple of 16
#endif
#ifndef MMA
#define MMA 0                    // 0: FMA in T; 1: bf16 tensor cores; 2: TF32 tensor cores
#endif
#ifndef WARPS
#define WARPS 4
#endif
#ifndef CT
#define CT 64                    // columns of the tile each warp's loop steps over
#endif
#define RT (16 * WARPS)          // rows of a block's tile
#define FULL 0xffffffffu
#define NEG_INF ((F)(-__int_as_float(0x7f800000)))
#define LOG2E ((F)1.4426950408889634)
#define LN2 ((F)0.6931471805599453)

// S: what q, k, v and dy are read as and what shared memory keeps: bf16 words (the launcher
// rounds fp32 to them once a call: flash_pack), TF32 values in float, or T itself
#if MMA == 1
typedef unsigned short S;
typedef float F;                 // accumulators
#define PAD 8
#define TRANS 1                  // bf16 keeps transposed copies: B fragments of 32-bit loads
#elif MMA == 2
typedef float S;
typedef float F;
#define PAD 4
#define TRANS 0
#else
typedef T S;
typedef A F;
#define PAD (16 / (int)sizeof(T))
#define TRANS 0
#endif
#define VEC (16 / (int)sizeof(S))  // elements in a 16-byte load
#define LD (D_PAD + PAD)         // row stride of a [rows][D_PAD] tile (16-byte multiple)
#define LDS (CT + PAD)           // row stride of a warp's [16][CT] scratch
#define LDR (RT + PAD)           // row stride of a transposed [D_PAD][RT] tile
#define LDC (CT + PAD)           // row stride of a transposed [D_PAD][CT] tile

#ifdef __CUDACC_RTC__            // the device's instructions (cudasim.h models each)
__device__ __forceinline__ void mma_bf16_16816(float& c0, float& c1, float& c2, float& c3,
        unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_tf32_1688(float& c0, float& c1, float& c2, float& c3,
        unsigned a0, unsigned a1, unsigned a2, unsigned a3, unsigned b0, unsigned b1) {
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ float to_tf32(float x) {
    unsigned u;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(u) : "f"(x));
    return __uint_as_float(u);
}
__device__ __forceinline__ unsigned ld_u32(const unsigned short* p) {
    return *(const unsigned*)p;
}
__device__ __forceinline__ unsigned pack_bf16x2(float lo, float hi) {
    unsigned u;                          // round to nearest even, lo in the low half
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(u) : "f"(hi), "f"(lo));
    return u;
}
template <class X> __device__ __forceinline__ void copy16(X* dst, const X* src) {
    *(uint4*)dst = *(const uint4*)src;
}
template <class X> __device__ __forceinline__ void zero16(X* dst) {
    *(uint4*)dst = make_uint4(0, 0, 0, 0);
}
#endif

// a value as shared memory keeps it
__device__ __forceinline__ S to_s(F x) {
#if MMA == 1                     // round to nearest even; a NaN stays a (quiet) NaN
    unsigned u = __float_as_uint((float)x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#elif MMA == 2
    return to_tf32((float)x);
#else
    return (S)x;
#endif
}
#if MMA == 1
__device__ __forceinline__ unsigned pack2(F lo, F hi) { return pack_bf16x2(lo, hi); }
#endif

__device__ __forceinline__ F group_max(F v) {   // over the 4 lanes that share a row
    v = max(v, __shfl_xor_sync(FULL, v, 1));
    return max(v, __shfl_xor_sync(FULL, v, 2));
}
__device__ __forceinline__ F group_sum(F v) {
    v += __shfl_xor_sync(FULL, v, 1);
    return v + __shfl_xor_sync(FULL, v, 2);
}

// rows [0, n) of a matrix (row stride ``stride``, ``hs`` columns from ``src``) into a
// [rows][LD] tile, zeros past n rows and hs columns, and with TRANS its transpose into a
// [D_PAD][ldt] tile; the whole block takes part. ``vec``: 16-byte loads (every row start and
// hs a multiple of VEC elements, the launcher checked).
template <int ROWS, bool TR>
__device__ void load_tile(S* dst, S* dst_t, int ldt, const S* src, long long stride, int n,
                          int hs, int vec) {
    if (vec) {
        for (int e = threadIdx.x; e < ROWS * (D_PAD / VEC); e += blockDim.x) {
            int r = e / (D_PAD / VEC), c = (e % (D_PAD / VEC)) * VEC;
            if (r < n && c < hs) copy16(dst + r * LD + c, src + (long long)r * stride + c);
            else zero16(dst + r * LD + c);
#if MMA == 2
            for (int i = 0; i < VEC; i++) dst[r * LD + c + i] = to_tf32(dst[r * LD + c + i]);
#endif
            if (TR)
                for (int i = 0; i < VEC; i++) dst_t[(c + i) * ldt + r] = dst[r * LD + c + i];
        }
        return;
    }
    for (int e = threadIdx.x; e < ROWS * D_PAD; e += blockDim.x) {
        int r = e / D_PAD, c = e % D_PAD;
        S x = (r < n && c < hs) ? src[(long long)r * stride + c] : (S)0;
#if MMA == 2
        x = to_tf32(x);
#endif
        dst[r * LD + c] = x;
        if (TR) dst_t[c * ldt + r] = x;
    }
}

// acc (16 x 8N) += a (16 x K, row stride lda) b (K x 8N): b's element (k, n) at
// b[n * BN + k * BK]; bf16 wants BK 1 (two neighbours along k make one 32-bit register)
template <int N, int BN, int BK>
__device__ __forceinline__ void mma_nt(F (&acc)[N][4], const S* a, int lda, const S* b, int K) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if MMA == 1
    for (int k0 = 0; k0 < K; k0 += 16) {
        unsigned a0 = ld_u32(a + g * lda + k0 + 2 * t), a1 = ld_u32(a + (g + 8) * lda + k0 + 2 * t);
        unsigned a2 = ld_u32(a + g * lda + k0 + 8 + 2 * t);
        unsigned a3 = ld_u32(a + (g + 8) * lda + k0 + 8 + 2 * t);
#pragma unroll
        for (int j = 0; j < N; j++) {
            const S* col = b + (8 * j + g) * BN;
            unsigned b0 = ld_u32(col + k0 + 2 * t), b1 = ld_u32(col + k0 + 8 + 2 * t);
            mma_bf16_16816(acc[j][0], acc[j][1], acc[j][2], acc[j][3], a0, a1, a2, a3, b0, b1);
        }
    }
#elif MMA == 2
    for (int k0 = 0; k0 < K; k0 += 8) {
        unsigned a0 = __float_as_uint(a[g * lda + k0 + t]);
        unsigned a1 = __float_as_uint(a[(g + 8) * lda + k0 + t]);
        unsigned a2 = __float_as_uint(a[g * lda + k0 + t + 4]);
        unsigned a3 = __float_as_uint(a[(g + 8) * lda + k0 + t + 4]);
#pragma unroll
        for (int j = 0; j < N; j++) {
            long long col = (long long)(8 * j + g) * BN;
            unsigned b0 = __float_as_uint(b[col + (long long)(k0 + t) * BK]);
            unsigned b1 = __float_as_uint(b[col + (long long)(k0 + t + 4) * BK]);
            mma_tf32_1688(acc[j][0], acc[j][1], acc[j][2], acc[j][3], a0, a1, a2, a3, b0, b1);
        }
    }
#else
    for (int k = 0; k < K; k++) {
        F x0 = (F)a[g * lda + k], x1 = (F)a[(g + 8) * lda + k];
#pragma unroll
        for (int j = 0; j < N; j++) {
            F y0 = (F)b[(long long)(8 * j + 2 * t) * BN + (long long)k * BK];
            F y1 = (F)b[(long long)(8 * j + 2 * t + 1) * BN + (long long)k * BK];
            acc[j][0] += x0 * y0; acc[j][1] += x0 * y1;
            acc[j][2] += x1 * y0; acc[j][3] += x1 * y1;
        }
    }
#endif
}

// acc (16 x 8N) += p (16 x 8M, this warp's fragments) b (8M x 8N): bf16 packs p into A
// fragments in registers (b transposed: BN its row stride, BK 1); the other kinds write p to
// the warp's scratch tile and read it back
template <int N, int M, int BN, int BK>
__device__ __forceinline__ void mma_pn(F (&acc)[N][4], F (&p)[M][4], S* scratch, const S* b) {
    int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
#if MMA == 1
#pragma unroll
    for (int kk = 0; kk < M / 2; kk++) {
        unsigned a0 = pack2(p[2 * kk][0], p[2 * kk][1]), a1 = pack2(p[2 * kk][2], p[2 * kk][3]);
        unsigned a2 = pack2(p[2 * kk + 1][0], p[2 * kk + 1][1]);
        unsigned a3 = pack2(p[2 * kk + 1][2], p[2 * kk + 1][3]);
        int k0 = 16 * kk;
#pragma unroll
        for (int j = 0; j < N; j++) {
            const S* col = b + (8 * j + g) * BN;
            unsigned b0 = ld_u32(col + k0 + 2 * t), b1 = ld_u32(col + k0 + 8 + 2 * t);
            mma_bf16_16816(acc[j][0], acc[j][1], acc[j][2], acc[j][3], a0, a1, a2, a3, b0, b1);
        }
    }
#else
#pragma unroll
    for (int j = 0; j < M; j++) {
        scratch[g * LDS + 8 * j + 2 * t] = to_s(p[j][0]);
        scratch[g * LDS + 8 * j + 2 * t + 1] = to_s(p[j][1]);
        scratch[(g + 8) * LDS + 8 * j + 2 * t] = to_s(p[j][2]);
        scratch[(g + 8) * LDS + 8 * j + 2 * t + 1] = to_s(p[j][3]);
    }
    __syncwarp();
    mma_nt<N, BN, BK>(acc, scratch, LDS, b, 8 * M);
    __syncwarp();                        // (the scratch is written again by the next call)
#endif
}

"""
