"""FlashAttention-2's kernels over the tiles of flash_tiles.py: the forward (online softmax over
key tiles, O and the log-sum-exp kept), D = rowsum(dy * y), and the backward as two kernels
without atomics (a block owns its keys for dk, dv; another its queries for dq), each
recomputing the probabilities tile by tile from the log-sum-exp. A block is ``WARPS`` warps,
each owning 16 rows of the block's tile and stepping over tiles of ``CT`` columns. Grouped
queries read their shared kv head; queries and keys carry global positions (a causal mask at
any offset: context parallelism's blocks). flash.py compiles it per head size and kind."""
from .flash_tiles import TILES

FLASH_SOURCE = TILES + r"""
// fp32 -> bf16 words, n elements (the bf16 kernels' inputs, rounded once a call)
extern "C" __global__ void flash_pack(const T* x, S* y, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = to_s((F)x[i]);
}

// Queries i (global position q_pos + i) see keys j (k_pos + j): all of them, or with
// ``causal`` those at or before their own position. q (B, Tq, row stride sq), its head h at
// columns oq + h hs; k and v (B, Tk, sk / sv), kv head h / (nh / nkv) at ok / ov + that hs.
// Scores are kept in base 2 (scale log2 e folded in): exp2 is one instruction.

// y (B, Tq, nh hs) = softmax(scale q k^T, visible) v; lse (B, nh, Tq) its log-sum-exp (-inf
// for a query that sees nothing, whose y is 0). Grid (query tiles, nh, B), RT queries a block.
extern "C" __global__ void flash_fwd(const S* q, const S* k, const S* v, T* y, A* lse,
        int Tq, int Tk, int nh, int nkv, int hs, long long sq, long long sk, long long sv,
        int oq, int ok, int ov, int q_pos, int k_pos, int causal, int vec, A scale) {
    extern __shared__ unsigned char smem[];
    S* Qs = (S*)smem;
    S* Ks = Qs + RT * LD;
    S* Vs = Ks + CT * LD;
    S* Vt = Vs + CT * LD;                // (bf16: v's transpose, [D_PAD][LDC])
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    S* scratch = Vt + TRANS * D_PAD * LDC + warp * 16 * LDS;
    int h = blockIdx.y, b = blockIdx.z, kh = h / (nh / nkv);
    int i0 = (gridDim.x - 1 - blockIdx.x) * RT;          // the longest rows first
    const S* qb = q + (long long)b * Tq * sq + oq + (long long)h * hs;
    const S* kb = k + (long long)b * Tk * sk + ok + (long long)kh * hs;
    const S* vb = v + (long long)b * Tk * sv + ov + (long long)kh * hs;
    load_tile<RT, false>(Qs, Qs, 0, qb + (long long)i0 * sq, sq, min(RT, Tq - i0), hs, vec);
    int kend = causal ? min(Tk, max(0, q_pos + i0 + RT - k_pos)) : Tk;
    int wrow = i0 + warp * 16, row[2] = {wrow + g, wrow + g + 8};
    F scale2 = (F)scale * LOG2E;
    F m[2] = {NEG_INF, NEG_INF}, l[2] = {0, 0}, o[D_PAD / 8][4];
#pragma unroll
    for (int d = 0; d < D_PAD / 8; d++) o[d][0] = o[d][1] = o[d][2] = o[d][3] = 0;
    for (int j0 = 0; j0 < kend; j0 += CT) {
        __syncthreads();                                  // (the last tile is read)
        load_tile<CT, false>(Ks, Ks, 0, kb + (long long)j0 * sk, sk, min(CT, Tk - j0), hs, vec);
        load_tile<CT, TRANS>(Vs, Vt, LDC, vb + (long long)j0 * sv, sv, min(CT, Tk - j0), hs,
                             vec);
        __syncthreads();
        F s[CT / 8][4];
#pragma unroll
        for (int j = 0; j < CT / 8; j++) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0;
        mma_nt<CT / 8, LD, 1>(s, Qs + warp * 16 * LD, LD, Ks, D_PAD);
        // a mask only where this warp's rows meet the tile's edge or the diagonal
        bool edge = j0 + CT > Tk || (causal && k_pos + j0 + CT - 1 > q_pos + wrow);
        F mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
        for (int j = 0; j < CT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = j0 + 8 * j + 2 * t + (e & 1), r = row[e >> 1];
                bool seen = !edge || (col < Tk && (!causal || k_pos + col <= q_pos + r));
                s[j][e] = seen ? s[j][e] * scale2 : NEG_INF;
                mx[e >> 1] = max(mx[e >> 1], s[j][e]);
            }
        F base[2], corr[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            F mnew = max(m[r], group_max(mx[r]));
            base[r] = mnew == NEG_INF ? (F)0 : mnew;     // a row that has seen nothing yet
            corr[r] = exp2(m[r] - base[r]);
            m[r] = mnew;
            l[r] *= corr[r];
        }
#pragma unroll
        for (int j = 0; j < CT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                s[j][e] = exp2(s[j][e] - base[e >> 1]);
                l[e >> 1] += s[j][e];
            }
#pragma unroll
        for (int d = 0; d < D_PAD / 8; d++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[d][e] *= corr[e >> 1];
#if TRANS
        mma_pn<D_PAD / 8, CT / 8, LDC, 1>(o, s, scratch, Vt);   // o += p v (v^T kept)
#else
        mma_pn<D_PAD / 8, CT / 8, 1, LD>(o, s, scratch, Vs);    // o += p v
#endif
    }
    long long C = (long long)nh * hs;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        F total = group_sum(l[r]);
        if (row[r] >= Tq) continue;
        F inv = total > 0 ? (F)1 / total : (F)0;
        T* yr = y + ((long long)b * Tq + row[r]) * C + (long long)h * hs;
#pragma unroll
        for (int d = 0; d < D_PAD / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = 8 * d + 2 * t + e;
                if (c < hs) yr[c] = (T)(o[d][2 * r + e] * inv);
            }
        if (t == 0)
            lse[((long long)b * nh + h) * Tq + row[r]] =
                total > 0 ? (A)((m[r] + log2(total)) * LN2) : (A)NEG_INF;
    }
}

// dvec (B, nh, Tq) = rowsum(dy * y) per head, a warp a row (the backward's D); with bf16 dy
// rounded into dy16 on the way (the kernels' input)
extern "C" __global__ void flash_dot(const T* y, const T* dy, A* dvec, S* dy16, int B, int Tq,
                                     int nh, int hs) {
    long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (w >= (long long)B * Tq * nh) return;             // (whole warps leave together)
    int h = (int)(w % nh);
    long long bi = w / nh, b = bi / Tq, i = bi % Tq;
    long long at = bi * nh * hs + (long long)h * hs;
    F acc = 0;
    for (int c = lane; c < hs; c += 32) {
        acc += (F)y[at + c] * (F)dy[at + c];
#if MMA == 1
        dy16[at + c] = to_s((F)dy[at + c]);
#endif
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_down_sync(FULL, acc, o);
    if (lane == 0) dvec[(b * nh + h) * Tq + i] = (A)acc;
}

// dk, dv (laid out as k, v) of y = flash_fwd(q, k, v): a block owns RT keys of one kv head and
// loops over the query tiles (of every query head sharing it) that see them: no atomics.
// p = exp(scale q k - lse), ds = p (dy v - dvec); dv = p^T dy, dk = scale ds^T q.
// Grid (key tiles, nkv, B).
__device__ __forceinline__ void bwd_kv(int kh, int b, int tile, const S* q, const S* k,
        const S* v, const S* dy, const A* lse, const A* dvec, T* dk, T* dv, int Tq, int Tk,
        int nh, int nkv, int hs, long long sq, long long sk, long long sv, int oq, int ok,
        int ov, int q_pos, int k_pos, int causal, int vec, A scale) {
    extern __shared__ unsigned char smem[];
    A* stat = (A*)smem;                                   // lse (base 2), dvec of the tile
    S* Ks = (S*)(stat + 2 * CT);
    S* Vs = Ks + RT * LD;
    S* Qs = Vs + RT * LD;
    S* Ds = Qs + CT * LD;                                 // dy's tile
    S* Qt = Ds + CT * LD;                                 // (bf16: transposes of q, dy)
    S* Dt = Qt + TRANS * D_PAD * LDC;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    S* scratch = Dt + TRANS * D_PAD * LDC + warp * 16 * LDS;
    int group = nh / nkv;
    int j0 = tile * RT;
    long long C = (long long)nh * hs;
    load_tile<RT, false>(Ks, Ks, 0, k + (long long)b * Tk * sk + ok + (long long)kh * hs +
                         (long long)j0 * sk, sk, min(RT, Tk - j0), hs, vec);
    load_tile<RT, false>(Vs, Vs, 0, v + (long long)b * Tk * sv + ov + (long long)kh * hs +
                         (long long)j0 * sv, sv, min(RT, Tk - j0), hs, vec);
    int wkey = j0 + warp * 16, key[2] = {wkey + g, wkey + g + 8};
    F scale2 = (F)scale * LOG2E;
    F gk[D_PAD / 8][4], gv[D_PAD / 8][4];
#pragma unroll
    for (int d = 0; d < D_PAD / 8; d++)
#pragma unroll
        for (int e = 0; e < 4; e++) gk[d][e] = gv[d][e] = 0;
    int first = causal ? max(0, k_pos + j0 - q_pos) / CT * CT : 0;
    for (int h = kh * group; h < (kh + 1) * group; h++) {
        const S* qb = q + (long long)b * Tq * sq + oq + (long long)h * hs;
        const S* db = dy + (long long)b * Tq * C + (long long)h * hs;
        const A* lb = lse + ((long long)b * nh + h) * Tq;
        const A* vb = dvec + ((long long)b * nh + h) * Tq;
        for (int i0 = first; i0 < Tq; i0 += CT) {
            __syncthreads();                              // (the last tile is read)
            load_tile<CT, TRANS>(Qs, Qt, LDC, qb + (long long)i0 * sq, sq, min(CT, Tq - i0),
                                 hs, vec);
            load_tile<CT, TRANS>(Ds, Dt, LDC, db + (long long)i0 * C, C, min(CT, Tq - i0), hs,
                                 vec);
            for (int c = threadIdx.x; c < CT; c += blockDim.x) {
                stat[c] = i0 + c < Tq ? (A)((F)lb[i0 + c] * LOG2E) : (A)0;
                stat[CT + c] = i0 + c < Tq ? vb[i0 + c] : (A)0;
            }
            __syncthreads();
            F s[CT / 8][4], dp[CT / 8][4];
#pragma unroll
            for (int j = 0; j < CT / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) s[j][e] = dp[j][e] = 0;
            mma_nt<CT / 8, LD, 1>(s, Ks + warp * 16 * LD, LD, Qs, D_PAD);    // k q^T
            mma_nt<CT / 8, LD, 1>(dp, Vs + warp * 16 * LD, LD, Ds, D_PAD);   // v dy^T
            bool edge = i0 + CT > Tq || wkey + 16 > Tk ||
                        (causal && k_pos + wkey + 15 > q_pos + i0);
#pragma unroll
            for (int j = 0; j < CT / 8; j++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int c = 8 * j + 2 * t + (e & 1), i = i0 + c, key_e = key[e >> 1];
                    bool seen = !edge || (i < Tq && key_e < Tk &&
                                          (!causal || k_pos + key_e <= q_pos + i));
                    F p = seen ? exp2(s[j][e] * scale2 - (F)stat[c]) : (F)0;
                    s[j][e] = p;
                    dp[j][e] = p * (dp[j][e] - (F)stat[CT + c]);
                }
#if TRANS
            mma_pn<D_PAD / 8, CT / 8, LDC, 1>(gv, s, scratch, Dt);    // dv += p^T dy
            mma_pn<D_PAD / 8, CT / 8, LDC, 1>(gk, dp, scratch, Qt);   // dk += ds^T q
#else
            mma_pn<D_PAD / 8, CT / 8, 1, LD>(gv, s, scratch, Ds);
            mma_pn<D_PAD / 8, CT / 8, 1, LD>(gk, dp, scratch, Qs);
#endif
        }
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (key[r] >= Tk) continue;
        T* kr = dk + ((long long)b * Tk + key[r]) * sk + ok + (long long)kh * hs;
        T* vr = dv + ((long long)b * Tk + key[r]) * sv + ov + (long long)kh * hs;
#pragma unroll
        for (int d = 0; d < D_PAD / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = 8 * d + 2 * t + e;
                if (c < hs) {
                    kr[c] = (T)(gk[d][2 * r + e] * (F)scale);
                    vr[c] = (T)gv[d][2 * r + e];
                }
            }
    }
}

// dq (laid out as q): a block owns RT queries and loops over the key tiles they see;
// dq = scale ds k. Grid (query tiles, nh, B).
__device__ __forceinline__ void bwd_q(int h, int b, int tile, const S* q, const S* k,
        const S* v, const S* dy, const A* lse, const A* dvec, T* dq, int Tq, int Tk, int nh,
        int nkv, int hs, long long sq, long long sk, long long sv, int oq, int ok, int ov,
        int q_pos, int k_pos, int causal, int vec, A scale) {
    extern __shared__ unsigned char smem[];
    S* Qs = (S*)smem;
    S* Ds = Qs + RT * LD;
    S* Ks = Ds + RT * LD;
    S* Vs = Ks + CT * LD;
    S* Kt = Vs + CT * LD;                                 // (bf16: k's transpose)
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    S* scratch = Kt + TRANS * D_PAD * LDC + warp * 16 * LDS;
    int kh = h / (nh / nkv);
    int i0 = tile * RT;
    long long C = (long long)nh * hs;
    load_tile<RT, false>(Qs, Qs, 0, q + (long long)b * Tq * sq + oq + (long long)h * hs +
                         (long long)i0 * sq, sq, min(RT, Tq - i0), hs, vec);
    load_tile<RT, false>(Ds, Ds, 0, dy + ((long long)b * Tq + i0) * C + (long long)h * hs, C,
                         min(RT, Tq - i0), hs, vec);
    const S* kb = k + (long long)b * Tk * sk + ok + (long long)kh * hs;
    const S* vb = v + (long long)b * Tk * sv + ov + (long long)kh * hs;
    int wrow = i0 + warp * 16, row[2] = {wrow + g, wrow + g + 8};
    F scale2 = (F)scale * LOG2E, lr[2], dr[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        long long at = ((long long)b * nh + h) * Tq + row[r];
        lr[r] = row[r] < Tq ? (F)lse[at] * LOG2E : (F)0;
        dr[r] = row[r] < Tq ? (F)dvec[at] : (F)0;
    }
    F gq[D_PAD / 8][4];
#pragma unroll
    for (int d = 0; d < D_PAD / 8; d++) gq[d][0] = gq[d][1] = gq[d][2] = gq[d][3] = 0;
    int kend = causal ? min(Tk, max(0, q_pos + i0 + RT - k_pos)) : Tk;
    for (int j0 = 0; j0 < kend; j0 += CT) {
        __syncthreads();
        load_tile<CT, TRANS>(Ks, Kt, LDC, kb + (long long)j0 * sk, sk, min(CT, Tk - j0), hs,
                             vec);
        load_tile<CT, false>(Vs, Vs, 0, vb + (long long)j0 * sv, sv, min(CT, Tk - j0), hs, vec);
        __syncthreads();
        F s[CT / 8][4], dp[CT / 8][4];
#pragma unroll
        for (int j = 0; j < CT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) s[j][e] = dp[j][e] = 0;
        mma_nt<CT / 8, LD, 1>(s, Qs + warp * 16 * LD, LD, Ks, D_PAD);        // q k^T
        mma_nt<CT / 8, LD, 1>(dp, Ds + warp * 16 * LD, LD, Vs, D_PAD);       // dy v^T
        bool edge = j0 + CT > Tk || (causal && k_pos + j0 + CT - 1 > q_pos + wrow);
#pragma unroll
        for (int j = 0; j < CT / 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = j0 + 8 * j + 2 * t + (e & 1), r = e >> 1;
                bool seen = !edge || (col < Tk && row[r] < Tq &&
                                      (!causal || k_pos + col <= q_pos + row[r]));
                F p = seen ? exp2(s[j][e] * scale2 - lr[r]) : (F)0;
                s[j][e] = p * (dp[j][e] - dr[r]);
            }
#if TRANS
        mma_pn<D_PAD / 8, CT / 8, LDC, 1>(gq, s, scratch, Kt);               // dq += ds k
#else
        mma_pn<D_PAD / 8, CT / 8, 1, LD>(gq, s, scratch, Ks);
#endif
    }
#pragma unroll
    for (int r = 0; r < 2; r++) {
        if (row[r] >= Tq) continue;
        T* qr = dq + ((long long)b * Tq + row[r]) * sq + oq + (long long)h * hs;
#pragma unroll
        for (int d = 0; d < D_PAD / 8; d++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int c = 8 * d + 2 * t + e;
                if (c < hs) qr[c] = (T)(gq[d][2 * r + e] * (F)scale);
            }
    }
}

#define BWD_ARGS q, k, v, dy, lse, dvec
#define BWD_REST Tq, Tk, nh, nkv, hs, sq, sk, sv, oq, ok, ov, q_pos, k_pos, causal, vec, scale

// dk, dv: grid (key tiles, nkv, B)
extern "C" __global__ void flash_bwd_kv(const S* q, const S* k, const S* v, const S* dy,
        const A* lse, const A* dvec, T* dk, T* dv, int Tq, int Tk, int nh, int nkv, int hs,
        long long sq, long long sk, long long sv, int oq, int ok, int ov, int q_pos, int k_pos,
        int causal, int vec, A scale) {
    bwd_kv(blockIdx.y, blockIdx.z, blockIdx.x, BWD_ARGS, dk, dv, BWD_REST);
}

// dq: grid (query tiles, nh, B), the longest rows first
extern "C" __global__ void flash_bwd_q(const S* q, const S* k, const S* v, const S* dy,
        const A* lse, const A* dvec, T* dq, int Tq, int Tk, int nh, int nkv, int hs,
        long long sq, long long sk, long long sv, int oq, int ok, int ov, int q_pos, int k_pos,
        int causal, int vec, A scale) {
    bwd_q(blockIdx.y, blockIdx.z, gridDim.x - 1 - blockIdx.x, BWD_ARGS, dq, BWD_REST);
}

// both in one launch over one set of tiles (Tq = Tk): grid (tiles, nkv + nh, B), the first
// nkv rows of blocks dk and dv, the rest dq (a block takes one branch whole)
extern "C" __global__ void flash_bwd_kvq(const S* q, const S* k, const S* v, const S* dy,
        const A* lse, const A* dvec, T* dk, T* dv, T* dq, int Tq, int Tk, int nh, int nkv,
        int hs, long long sq, long long sk, long long sv, int oq, int ok, int ov, int q_pos,
        int k_pos, int causal, int vec, A scale) {
    if ((int)blockIdx.y < nkv)
        bwd_kv(blockIdx.y, blockIdx.z, blockIdx.x, BWD_ARGS, dk, dv, BWD_REST);
    else
        bwd_q(blockIdx.y - nkv, blockIdx.z, gridDim.x - 1 - blockIdx.x, BWD_ARGS, dq,
              BWD_REST);
}
"""
