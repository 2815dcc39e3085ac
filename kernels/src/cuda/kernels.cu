// thaw's CUDA kernels, compiled at run time by NVRTC for the device's architecture.
//
// No headers: NVRTC ships none by default, so the 16-bit conversions are written out (bf16 by
// bit operations, rounding to nearest even like the CPU's `half` crate; f16 with PTX `cvt`).
// Matrix products are cuBLAS's; these are the memory-bound pieces between them. Every kernel
// mirrors a CPU function in `ops.rs` (same formula, same order where it matters) so the two
// backends can be compared on the same weights.
//
// Element kinds (`kind` arguments): 0 = f32, 1 = bf16, 2 = f16.
//
// The same file is compiled for the CPU by the test-only emulator (kernels/emu: `THAW_CUDA_EMU`,
// one OS thread per CUDA thread, barriers for __syncthreads and shuffles), so every kernel's
// logic is tested against the CPU backend's functions on machines without a GPU.

#ifndef KERNEL
#define KERNEL extern "C" __global__
#endif

typedef unsigned short u16;
typedef unsigned int u32;
typedef long long i64;

#define NEG_INF __int_as_float(0xff800000u)

__device__ __forceinline__ float bf16_to_f32(u16 x) { return __uint_as_float(((u32)x) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u);  // quiet NaN
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

#ifdef THAW_CUDA_EMU
__device__ __forceinline__ float f16_to_f32(u16 x) { return emu_f16_to_f32(x); }
__device__ __forceinline__ u16 f32_to_f16(float f) { return emu_f32_to_f16(f); }
#else
__device__ __forceinline__ float f16_to_f32(u16 x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
#endif

__device__ __forceinline__ float load_elem(const void* p, i64 i, int kind) {
    if (kind == 0) return ((const float*)p)[i];
    if (kind == 1) return bf16_to_f32(((const u16*)p)[i]);
    return f16_to_f32(((const u16*)p)[i]);
}

__device__ __forceinline__ void store_elem(void* p, i64 i, float v, int kind) {
    if (kind == 0) ((float*)p)[i] = v;
    else if (kind == 1) ((u16*)p)[i] = f32_to_bf16(v);
    else ((u16*)p)[i] = f32_to_f16(v);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
__device__ float block_sum(float v) {
    __shared__ float part[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // `part` may still be read by a previous call
    if (lane == 0) part[warp] = v;
    __syncthreads();
    float t = lane < nw ? part[lane] : 0.0f;
    return warp_sum(t);
}

// `dst[i] = src[i]` widened to f32 (norm weights and biases, once at load).
KERNEL void widen(const void* src, int kind, float* dst, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        dst[i] = load_elem(src, i, kind);
}

// Row r of `out` (f32, [n, d]) = row ids[r] of the embedding table. Grid: n blocks.
KERNEL void embed(const void* table, int kind, const u32* ids, int d, float* out) {
    i64 src = (i64)ids[blockIdx.x] * d, dst = (i64)blockIdx.x * d;
    for (int i = threadIdx.x; i < d; i += blockDim.x) out[dst + i] = load_elem(table, src + i, kind);
}

// out[r] = x[rows ? rows[r] : r] / sqrt(mean(x²) + eps) * w, stored as `out_kind`. Grid: n blocks.
KERNEL void rmsnorm(const float* x, const u32* rows, const float* w, int d, float eps,
                                   void* out, int out_kind) {
    int r = blockIdx.x;
    const float* xr = x + (i64)(rows ? rows[r] : r) * d;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < d; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss);
    float scale = 1.0f / sqrtf(ss / (float)d + eps);
    for (int i = threadIdx.x; i < d; i += blockDim.x)
        store_elem(out, (i64)r * d + i, xr[i] * scale * w[i], out_kind);
}

// x[i] += b[i % d] over `n` elements (Q/K/V biases).
KERNEL void add_bias(float* x, const float* b, int d, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)
        x[i] += b[i % d];
}

// out = silu(g) · u, stored as `out_kind`.
KERNEL void silu_mul(const float* g, const float* u, void* out, int out_kind, i64 n) {
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
        float v = g[i];
        store_elem(out, i, v / (1.0f + expf(-v)) * u[i], out_kind);
    }
}

// Per row r (grid: n blocks): "rotate half" RoPE on its query and key heads with the row's angles
// (cos/sin `[n, hd/2]`, computed on the host in f64 exactly as the CPU does), then the rotated
// key and the value stored into the paged cache at element `slot[r] + layer_off`.
KERNEL void rope_store(float* q, const float* k, const float* v, const float* cos_t,
                                      const float* sin_t, int n_heads, int n_kv, int hd,
                                      void* kc, void* vc, int kv_kind, const i64* slot,
                                      i64 layer_off) {
    // Grid: (rows, slices). A row's work — its query pairs, key pairs, values — is one index
    // range spread over gridDim.y blocks: a decode step has one row, and one block walking it
    // alone took 14 µs per layer on an H200 (latency, not bandwidth).
    int r = blockIdx.x, half = hd / 2;
    const float* c = cos_t + (i64)r * half;
    const float* s = sin_t + (i64)r * half;
    float* qr = q + (i64)r * n_heads * hd;
    int kv_dim = n_kv * hd;
    const float* kr = k + (i64)r * kv_dim;
    const float* vr = v + (i64)r * kv_dim;
    i64 at = slot[r] + layer_off;
    int nq = n_heads * half, nk = n_kv * half, total = nq + nk + kv_dim;
    for (int t = blockIdx.y * blockDim.x + threadIdx.x; t < total; t += gridDim.y * blockDim.x) {
        if (t < nq) {
            int h = t / half, i = t % half;
            float x1 = qr[h * hd + i], x2 = qr[h * hd + i + half];
            qr[h * hd + i] = x1 * c[i] - x2 * s[i];
            qr[h * hd + i + half] = x2 * c[i] + x1 * s[i];
        } else if (t < nq + nk) {
            int h = (t - nq) / half, i = (t - nq) % half;
            float x1 = kr[h * hd + i], x2 = kr[h * hd + i + half];
            store_elem(kc, at + h * hd + i, x1 * c[i] - x2 * s[i], kv_kind);
            store_elem(kc, at + h * hd + i + half, x2 * c[i] + x1 * s[i], kv_kind);
        } else {
            int e = t - nq - nk;
            store_elem(vc, at + e, vr[e], kv_kind);
        }
    }
}

#define ATT_WARPS 4
#define ATT_MAX_GROUP 8
#define ATT_MAX_PER_LANE 4  // head_dim <= 128

// One warp's attention state for one query row and the `group` query heads of one KV head:
// queries and weighted values in registers (element lane + 32·j of each head), and an online
// softmax per head (running max m, running sum l). Both attention kernels are built on it, so
// the arithmetic per position is the same in each.
struct RowState {
    float qv[ATT_MAX_GROUP][ATT_MAX_PER_LANE], acc[ATT_MAX_GROUP][ATT_MAX_PER_LANE];
    float m[ATT_MAX_GROUP], l[ATT_MAX_GROUP];

    // Loads the queries of heads head0 .. head0 + group - 1.
    __device__ __forceinline__ void init(const float* q, i64 head0, int group, int hd, int lane) {
        int per = (hd + 31) / 32;
#pragma unroll
        for (int g = 0; g < ATT_MAX_GROUP; g++) {
            m[g] = NEG_INF;
            l[g] = 0.0f;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
                int d = lane + 32 * j;
                bool ok = g < group && j < per && d < hd;
                qv[g][j] = ok ? q[(head0 + g) * hd + d] : 0.0f;
                acc[g][j] = 0.0f;
            }
        }
    }

    // Folds in one position's key and value (this lane's elements).
    __device__ __forceinline__ void add(const float* kk, const float* vv, int group, float scale) {
#pragma unroll
        for (int g = 0; g < ATT_MAX_GROUP; g++) {
            if (g >= group) break;
            float s = 0.0f;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) s += qv[g][j] * kk[j];
            s = warp_sum(s) * scale;
            float mn = fmaxf(m[g], s);
            float corr = expf(m[g] - mn);  // exp(-inf) = 0 on the first position
            float e = expf(s - mn);
            l[g] = l[g] * corr + e;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) acc[g][j] = acc[g][j] * corr + e * vv[j];
            m[g] = mn;
        }
    }

    // Folds in the first `nu` of U positions at once (decode): the U·group scores' warp sums
    // are interleaved — independent shuffles pipeline, where one position at a time waited out
    // each reduction in turn — and each head's running max and sums are corrected once per U
    // positions instead of once per position. Scores are the same as `add`'s; only the softmax
    // update is grouped.
    template <int U>
    __device__ __forceinline__ void add_n(const float (*kk)[ATT_MAX_PER_LANE],
                                          const float (*vv)[ATT_MAX_PER_LANE], int nu, int group,
                                          float scale) {
        float s[U][ATT_MAX_GROUP];
#pragma unroll
        for (int u = 0; u < U; u++) {
#pragma unroll
            for (int g = 0; g < ATT_MAX_GROUP; g++) {
                s[u][g] = 0.0f;
                if (g < group) {
#pragma unroll
                    for (int j = 0; j < ATT_MAX_PER_LANE; j++) s[u][g] += qv[g][j] * kk[u][j];
                }
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < U; u++) {
#pragma unroll
                for (int g = 0; g < ATT_MAX_GROUP; g++)
                    if (g < group) s[u][g] += __shfl_xor_sync(0xffffffffu, s[u][g], o);
            }
        }
#pragma unroll
        for (int g = 0; g < ATT_MAX_GROUP; g++) {
            if (g >= group) break;
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < U; u++) {
                s[u][g] *= scale;
                if (u < nu) mn = fmaxf(mn, s[u][g]);
            }
            float corr = expf(m[g] - mn);  // exp(-inf) = 0 on the first positions
            l[g] *= corr;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) acc[g][j] *= corr;
#pragma unroll
            for (int u = 0; u < U; u++) {
                if (u < nu) {
                    float e = expf(s[u][g] - mn);
                    l[g] += e;
#pragma unroll
                    for (int j = 0; j < ATT_MAX_PER_LANE; j++) acc[g][j] += e * vv[u][j];
                }
            }
            m[g] = mn;
        }
    }
};

// Warps of the per-row (decode) attention kernel: a decode row is one block per KV head, so
// positions are split over many warps (4 left an H200's decode step 36 µs per layer in it).
#define DEC_WARPS 8
#define DEC_UNROLL 4  // positions a warp has in flight

// Causal GQA attention over a paged cache. Grid: (rows, kv heads); block: DEC_WARPS warps. The
// block serves the `group` query heads that share KV head `blockIdx.y`, so each key and value row
// is read once for all of them. Warp w takes positions w, w + DEC_WARPS, …; lanes split the head
// dimension (lane + 32·j). Each warp keeps an online softmax (running max, sum, weighted values)
// per head; the warps' partial results are merged at the end.
// Position p of the row's sequence sits at element
// table[p / block_size] · block_stride + layer_off + (p % block_size) · kv_dim + kvh · hd.
//
// Flash-decoding (`chunk` > 0): a long context is too few blocks for the GPU (a decode row has
// one per KV head), so grid.y is n_kv · nsplit and block (x, y) serves positions
// [s·chunk, (s+1)·chunk) of its row, s = y / n_kv. A row whose positions fit one chunk is
// finished here as without splits; otherwise each split writes its unnormalized state (max, sum,
// weighted values) per head to `part` ([row x][head][split][hd + 2] f32) and `attention_merge`
// combines them, exactly as the warps of one block are combined below.
// The cache's kind is a template parameter (the entry point dispatches once): chosen per load at
// run time it put every position's loads in branches of their own.
struct DecShared {
    float m[DEC_WARPS][ATT_MAX_GROUP], l[DEC_WARPS][ATT_MAX_GROUP];
    float acc[DEC_WARPS][ATT_MAX_GROUP][ATT_MAX_PER_LANE * 32];
};

template <int KVK>
__device__ __forceinline__ float load_kv(const void* p, i64 i) {
    if (KVK == 0) return ((const float*)p)[i];
    if (KVK == 1) return bf16_to_f32(((const u16*)p)[i]);
    return f16_to_f32(((const u16*)p)[i]);
}

template <int KVK>
__device__ __forceinline__ void attention_body(
    const float* q, const void* kc, const void* vc, const u32* rows_map, const u32* pos_of_row,
    const u32* table_off, const u32* tables, int block_size, i64 block_stride, i64 layer_off,
    int n_heads, int n_kv, int hd, float scale, void* out, int out_kind, int chunk, int nsplit,
    float* part, DecShared& sh) {
    int r = rows_map ? (int)rows_map[blockIdx.x] : (int)blockIdx.x;
    int kvh = blockIdx.y % n_kv, split = blockIdx.y / n_kv;
    int group = n_heads / n_kv, kv_dim = n_kv * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int per = (hd + 31) / 32;
    u32 pos = pos_of_row[r];
    const u32* table = tables + table_off[r];
    // This block's positions [lo, hi]; a split past the row's end has nothing to do.
    u32 lo = 0, hi = pos;
    int parts = 1;
    if (chunk > 0) {
        lo = (u32)split * (u32)chunk;
        if (lo > pos) return;
        hi = lo + (u32)chunk - 1 < pos ? lo + (u32)chunk - 1 : pos;
        parts = (int)(pos / (u32)chunk) + 1;
    }

    RowState st;
    st.init(q, (i64)r * n_heads + kvh * group, group, hd, lane);
    // DEC_UNROLL of the warp's positions are loaded before the first is folded in: each
    // position is a dependent pair of loads (block table, then keys and values), and one at a
    // time a warp waited out that latency per position (24 µs per layer on an H200 at ~100
    // positions). Positions are still folded in the same order.
    for (u32 p0 = lo + warp; p0 <= hi; p0 += DEC_WARPS * DEC_UNROLL) {
        float kk[DEC_UNROLL][ATT_MAX_PER_LANE], vv[DEC_UNROLL][ATT_MAX_PER_LANE];
        // The block-table entries first, all in flight together, then the keys and values
        // they locate (one table read per position before its keys: a wait per position).
        u32 blk[DEC_UNROLL];
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            u32 p = p0 + u * DEC_WARPS;
            blk[u] = p <= hi ? table[p / block_size] : 0u;
        }
#pragma unroll
        for (int u = 0; u < DEC_UNROLL; u++) {
            u32 p = p0 + u * DEC_WARPS;
            bool in = p <= hi;
            i64 base = in ? (i64)blk[u] * block_stride + layer_off +
                                (i64)(p % block_size) * kv_dim + (i64)kvh * hd
                          : 0;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
                int d = lane + 32 * j;
                bool ok = in && j < per && d < hd;
                kk[u][j] = ok ? load_kv<KVK>(kc, base + d) : 0.0f;
                vv[u][j] = ok ? load_kv<KVK>(vc, base + d) : 0.0f;
            }
        }
        // The warp's valid positions of this pass are a prefix of its DEC_UNROLL.
        int nu = (int)((hi - p0) / DEC_WARPS) + 1;
        st.add_n<DEC_UNROLL>(kk, vv, nu < DEC_UNROLL ? nu : DEC_UNROLL, group, scale);
    }
    // Merge the warps: each publishes (m, l, acc) per head; warp 0 combines them.
    float (*sm)[ATT_MAX_GROUP] = sh.m;
    float (*sl)[ATT_MAX_GROUP] = sh.l;
    float (*sacc)[ATT_MAX_GROUP][ATT_MAX_PER_LANE * 32] = sh.acc;
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; g++) {
        if (g < group) {
            if (lane == 0) {
                sm[warp][g] = st.m[g];
                sl[warp][g] = st.l[g];
            }
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) sacc[warp][g][lane + 32 * j] = st.acc[g][j];
        }
    }
    __syncthreads();
    if (warp != 0) return;
    for (int g = 0; g < group; g++) {
        float mx = NEG_INF;
        for (int w = 0; w < DEC_WARPS; w++) mx = fmaxf(mx, sm[w][g]);
        float total = 0.0f;
        float o[ATT_MAX_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (int w = 0; w < DEC_WARPS; w++) {
            if (sm[w][g] == NEG_INF) continue;  // a warp that saw no position
            float f = expf(sm[w][g] - mx);
            total += sl[w][g] * f;
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) o[j] += sacc[w][g][lane + 32 * j] * f;
        }
        if (parts > 1) {
            float* dst = part + (((i64)blockIdx.x * n_heads + kvh * group + g) * nsplit + split) *
                                    (hd + 2);
            if (lane == 0) {
                dst[0] = mx;
                dst[1] = total;
            }
#pragma unroll
            for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
                int d = lane + 32 * j;
                if (j < per && d < hd) dst[2 + d] = o[j];
            }
            continue;
        }
        float inv = 1.0f / total;
#pragma unroll
        for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (j < per && d < hd)
                store_elem(out, ((i64)r * n_heads + kvh * group + g) * hd + d, o[j] * inv, out_kind);
        }
    }
}

KERNEL void __launch_bounds__(DEC_WARPS * 32)
attention(const float* q, const void* kc, const void* vc, int kv_kind, const u32* rows_map,
          const u32* pos_of_row, const u32* table_off, const u32* tables, int block_size,
          i64 block_stride, i64 layer_off, int n_heads, int n_kv, int hd, float scale, void* out,
          int out_kind, int chunk, int nsplit, float* part) {
    __shared__ DecShared sh;
#define ATT_BODY(K)                                                                             \
    attention_body<K>(q, kc, vc, rows_map, pos_of_row, table_off, tables, block_size,           \
                      block_stride, layer_off, n_heads, n_kv, hd, scale, out, out_kind, chunk,  \
                      nsplit, part, sh)
    if (kv_kind == 1) ATT_BODY(1);
    else if (kv_kind == 2) ATT_BODY(2);
    else ATT_BODY(0);
#undef ATT_BODY
}

// Combines the splits of `attention` with `chunk` > 0 for rows of more than one split. Grid:
// (rows, query heads); one warp, lanes over the head dimension.
KERNEL void attention_merge(const float* part, const u32* rows_map, const u32* pos_of_row,
                            int chunk, int nsplit, int n_heads, int hd, void* out, int out_kind) {
    int r = rows_map ? (int)rows_map[blockIdx.x] : (int)blockIdx.x, head = blockIdx.y;
    int lane = threadIdx.x & 31, per = (hd + 31) / 32;
    int parts = (int)(pos_of_row[r] / (u32)chunk) + 1;
    if (parts == 1) return;  // finished by `attention`
    const float* src = part + ((i64)blockIdx.x * n_heads + head) * nsplit * (hd + 2);
    float mx = NEG_INF;
    for (int s = 0; s < parts; s++) mx = fmaxf(mx, src[s * (hd + 2)]);
    float total = 0.0f;
    float o[ATT_MAX_PER_LANE] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int s = 0; s < parts; s++) {
        const float* ps = src + s * (hd + 2);
        float f = expf(ps[0] - mx);
        total += ps[1] * f;
#pragma unroll
        for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
            int d = lane + 32 * j;
            if (j < per && d < hd) o[j] += ps[2 + d] * f;
        }
    }
    float inv = 1.0f / total;
#pragma unroll
    for (int j = 0; j < ATT_MAX_PER_LANE; j++) {
        int d = lane + 32 * j;
        if (j < per && d < hd)
            store_elem(out, ((i64)r * n_heads + head) * hd + d, o[j] * inv, out_kind);
    }
}

#define PF_KEYS 32  // keys staged in shared memory per tile

// Flash-style causal attention for prefill: a block serves a tile of up to ATT_WARPS consecutive
// query rows of one sequence (warp w: row tile_row0[t] + w, all `group` heads of KV head
// blockIdx.y, q and accumulators in registers as in `attention`). Keys and values are staged
// PF_KEYS positions at a time in shared memory by the whole block and read from there by every
// row of the tile, with an online softmax per (row, head) — so each key/value row leaves global
// memory once per tile instead of once per query row. Same arithmetic per position as
// `attention`; a row's positions are visited in order by one warp.
KERNEL void __launch_bounds__(ATT_WARPS * 32)
attention_prefill(const float* q, const void* kc, const void* vc, int kv_kind,
                  const u32* tile_row0, const u32* tile_rows, const u32* pos_of_row,
                  const u32* table_off, const u32* tables, int block_size, i64 block_stride,
                  i64 layer_off, int n_heads, int n_kv, int hd, float scale, void* out,
                  int out_kind) {
    __shared__ float ks[PF_KEYS][ATT_MAX_PER_LANE * 32];
    __shared__ float vs[PF_KEYS][ATT_MAX_PER_LANE * 32];
    int kvh = blockIdx.y;
    int group = n_heads / n_kv, kv_dim = n_kv * hd;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int per = (hd + 31) / 32;
    u32 r0 = tile_row0[blockIdx.x], nr = tile_rows[blockIdx.x];
    bool active = (u32)warp < nr;
    u32 r = r0 + (active ? (u32)warp : 0u);
    u32 pos = pos_of_row[r];
    u32 last = pos_of_row[r0 + nr - 1];  // the tile's rows are consecutive positions
    const u32* table = tables + table_off[r0];

    RowState st;
    st.init(q, (i64)r * n_heads + kvh * group, group, hd, lane);
    for (u32 base = 0; base <= last; base += PF_KEYS) {
        u32 cnt = last + 1 - base < PF_KEYS ? last + 1 - base : PF_KEYS;
        __syncthreads();  // every warp is done with the previous tile
        for (u32 i = threadIdx.x; i < cnt * (u32)hd; i += blockDim.x) {
            u32 j = i / hd, d = i % hd, p = base + j;
            i64 at = (i64)table[p / block_size] * block_stride + layer_off +
                     (i64)(p % block_size) * kv_dim + (i64)kvh * hd + d;
            ks[j][d] = load_elem(kc, at, kv_kind);
            vs[j][d] = load_elem(vc, at, kv_kind);
        }
        __syncthreads();
        if (!active || pos < base) continue;
        u32 end = pos + 1 - base < cnt ? pos + 1 - base : cnt;
        for (u32 j = 0; j < end; j++) {
            float kk[ATT_MAX_PER_LANE], vv[ATT_MAX_PER_LANE];
#pragma unroll
            for (int jj = 0; jj < ATT_MAX_PER_LANE; jj++) {
                int d = lane + 32 * jj;
                bool ok = jj < per && d < hd;
                kk[jj] = ok ? ks[j][d] : 0.0f;
                vv[jj] = ok ? vs[j][d] : 0.0f;
            }
            st.add(kk, vv, group, scale);
        }
    }
    if (!active) return;
#pragma unroll
    for (int g = 0; g < ATT_MAX_GROUP; g++) {
        if (g >= group) break;
        float inv = 1.0f / st.l[g];
#pragma unroll
        for (int jj = 0; jj < ATT_MAX_PER_LANE; jj++) {
            int d = lane + 32 * jj;
            if (jj < per && d < hd)
                store_elem(out, ((i64)r * n_heads + kvh * group + g) * hd + d, st.acc[g][jj] * inv,
                           out_kind);
        }
    }
}

// Greedy sampling on the device (grid: rows; block: a power of two up to 1024): ids[r] = the
// first index of row r's maximum, as the CPU sampler's argmax — so a greedy step copies back one
// id per sequence instead of a vocabulary of logits. NaN never wins (the CPU differs only when
// element 0 is NaN); a row of -inf gives 0.
KERNEL void argmax_rows(const float* x, int n, u32* ids) {
    __shared__ float sv[1024];
    __shared__ int si[1024];
    const float* row = x + (i64)blockIdx.x * n;
    int t = threadIdx.x;
    float bv = NEG_INF;
    int bi = 0x7fffffff;
    for (int i = t; i < n; i += blockDim.x) {
        float v = row[i];
        if (v > bv) {  // strictly greater: a thread keeps the first of equal values it saw
            bv = v;
            bi = i;
        }
    }
    sv[t] = bv;
    si[t] = bi;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (t < s) {
            float ov = sv[t + s];
            int oi = si[t + s];
            if (ov > sv[t] || (ov == sv[t] && oi < si[t])) {
                sv[t] = ov;
                si[t] = oi;
            }
        }
        __syncthreads();
    }
    if (t == 0) ids[blockIdx.x] = si[0] == 0x7fffffff ? 0u : (u32)si[0];
}

// 8 bytes at `p`; with STREAM, kept out of L1 (`L1::no_allocate`): weights no other thread
// reads, so the activations every block re-reads stay there.
template <bool STREAM>
__device__ __forceinline__ uint2 load8(const void* p) {
#ifndef THAW_CUDA_EMU
    if (STREAM) {
        uint2 v;
        asm("ld.global.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
        return v;
    }
#endif
    return *(const uint2*)p;
}

// Four consecutive elements of kind KIND from element `i` (8-byte aligned for 16-bit kinds, two
// 8-byte loads for f32) as f32.
template <int KIND, bool STREAM>
__device__ __forceinline__ void load4(const void* p, i64 i, float* out) {
    if (KIND == 0) {
        uint2 a = load8<STREAM>((const float*)p + i), b = load8<STREAM>((const float*)p + i + 2);
        out[0] = __uint_as_float(a.x); out[1] = __uint_as_float(a.y);
        out[2] = __uint_as_float(b.x); out[3] = __uint_as_float(b.y);
        return;
    }
    uint2 v = load8<STREAM>((const u16*)p + i);
    u16 h[4] = {(u16)(v.x & 0xffffu), (u16)(v.x >> 16), (u16)(v.y & 0xffffu), (u16)(v.y >> 16)};
    #pragma unroll
    for (int j = 0; j < 4; j++) out[j] = KIND == 1 ? bf16_to_f32(h[j]) : f16_to_f32(h[j]);
}

// `v` rounded to kind KIND and back (what storing it as that kind and loading it gives).
template <int KIND>
__device__ __forceinline__ float round_to(float v) {
    if (KIND == 1) return bf16_to_f32(f32_to_bf16(v));
    if (KIND == 2) return f16_to_f32(f32_to_f16(v));
    return v;
}

// Matrix-vector products for decode: `y[r, n] = Σ_k W[n, k]·x[r, k] + beta·y[r, n]` for
// r < rows ≤ GEMV_MAX_ROWS, W `[N, K]` row-major of kind `w_kind`, x in W's kind, y f32, f32
// accumulation — for up to three matrices that share x and K in one launch (q, k, v; gate, up),
// so the small ones (k, v: 8 MB on an 8B model) do not each pay a launch and a half-empty grid.
//
// A decode step reads every weight once; a GEMM library tiles a one-row product over too few
// blocks to keep HBM busy. Here a block owns OUTS consecutive outputs of one matrix and splits
// K over all its threads: each thread reads 4 elements of each of the OUTS rows per step (a
// warp's loads of one row are 256 contiguous bytes; weights bypass L1, read once by one
// thread), multiplies them by the same 4 elements of x (read once per block, not once per
// output), and the block reduces its partial sums through shared memory. Kinds are template
// parameters (the entry points dispatch once), so the loads of two steps — 2·OUTS weight loads
// and the x loads — are all in flight before the first multiply (checked in the SASS): a kind
// chosen per load at run time put each load in a branch of its own. K a multiple of 4, W and x 8-byte aligned (the
// caller checks). Output groups beyond the grid are strided over it: the emulator runs a small
// grid, and a GPU launch has either a block per group or (`Gpu::gemv_persistent`) as many
// blocks as fit on the device at once, each computing the norm's scale once for all its groups.
//
// With `norm` (f32 weights, K of them), x is the f32 residual and the product is of its RMSNorm,
// as the `rmsnorm` kernel would have stored it: each block first sums x² over the row (x is
// small and cached; the weights are what streams from memory), then multiplies W by
// x·scale·norm rounded to W's kind — the same activations the unfused step (and the CPU) feed
// the product, without a kernel of their own or a round trip through memory.
#define GEMV_MAX_ROWS 8
#define GEMV_MAX_WARPS 8
#define GEMV_STEPS 2  // 4-element steps per thread per pass

#define GEMV_ARGS                                                                               \
    const void *w0, const void *w1, const void *w2, float *y0, float *y1, float *y2, int n0,     \
        int n1, int n2, int w_kind, const void *x, int rows, int K, const float *norm,           \
        float eps, float beta

// (The three matrices are picked by selects, not an array indexed at run time: that would put
// the array in local memory.)
template <int ROWS, int OUTS, int WK, bool NORM>
__device__ __forceinline__ void gemv_body(GEMV_ARGS, float (*red)[OUTS * ROWS + ROWS]) {
    constexpr int XK = NORM ? 0 : WK;  // x's kind: the f32 residual under a norm
    (void)w_kind;                      // = WK (the entry point dispatched on it)
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = blockDim.x >> 5;
    const int groups = K >> 2;
    const int b0 = (n0 + OUTS - 1) / OUTS, b1 = (n1 + OUTS - 1) / OUTS;
    const int total = b0 + b1 + (n2 + OUTS - 1) / OUTS;
    // The norm's scale per row, once per block (every output group of the block shares x).
    float scale[ROWS];
    #pragma unroll
    for (int r = 0; r < ROWS; r++) scale[r] = 1.0f;
    if (NORM) {
        float ss[ROWS];
        #pragma unroll
        for (int r = 0; r < ROWS; r++) ss[r] = 0.0f;
        for (int g = t; g < groups; g += blockDim.x) {
            #pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r >= rows) break;
                float xv[4];
                load4<0, false>(x, (i64)r * K + 4 * (i64)g, xv);
                ss[r] += xv[0] * xv[0] + xv[1] * xv[1] + xv[2] * xv[2] + xv[3] * xv[3];
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            float v = warp_sum(ss[r]);
            if (lane == 0) red[warp][OUTS * ROWS + r] = v;
        }
        __syncthreads();
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            float sq = 0.0f;
            for (int k = 0; k < nwarps; k++) sq += red[k][OUTS * ROWS + r];
            scale[r] = 1.0f / sqrtf(sq / (float)K + eps);
        }
    }
    for (int b = blockIdx.x; b < total; b += gridDim.x) {
        const int m = b < b0 ? 0 : b < b0 + b1 ? 1 : 2;
        const int o0 = (b - (m == 0 ? 0 : m == 1 ? b0 : b0 + b1)) * OUTS;
        const int N = m == 0 ? n0 : m == 1 ? n1 : n2;
        const int outs = N - o0 < OUTS ? N - o0 : OUTS;
        const void* w = m == 0 ? w0 : m == 1 ? w1 : w2;
        float acc[OUTS][ROWS];
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            #pragma unroll
            for (int o = 0; o < OUTS; o++) acc[o][r] = 0.0f;
        }
        // GEMV_STEPS steps per pass, their loads unconditional (a step past the row re-reads
        // the pass's first and is not added): all 2·OUTS weight loads and the x loads issue
        // before the first multiply waits. (A loop unrolled by the compiler keeps its bounds
        // check between steps, and the second step's loads behind the first's multiplies.)
        for (int g0 = t; g0 < groups; g0 += GEMV_STEPS * blockDim.x) {
            int gs[GEMV_STEPS];
            bool ok[GEMV_STEPS];
            #pragma unroll
            for (int u = 0; u < GEMV_STEPS; u++) {
                const int g = g0 + u * blockDim.x;
                ok[u] = g < groups;
                gs[u] = ok[u] ? g : g0;
            }
            float wv[GEMV_STEPS][OUTS][4], nv[GEMV_STEPS][4];
            #pragma unroll
            for (int u = 0; u < GEMV_STEPS; u++) {
                #pragma unroll
                for (int o = 0; o < OUTS; o++) {
                    // A last block's missing rows read row o0 again (in bounds), not stored.
                    const int row = o0 + (o < outs ? o : 0);
                    load4<WK, true>(w, (i64)row * K + 4 * (i64)gs[u], wv[u][o]);
                }
                if (NORM) load4<0, false>(norm, 4 * (i64)gs[u], nv[u]);
            }
            #pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r >= rows) break;
                float xv[GEMV_STEPS][4];
                #pragma unroll
                for (int u = 0; u < GEMV_STEPS; u++)
                    load4<XK, false>(x, (i64)r * K + 4 * (i64)gs[u], xv[u]);
                #pragma unroll
                for (int u = 0; u < GEMV_STEPS; u++) {
                    if (!ok[u]) continue;
                    if (NORM) {
                        #pragma unroll
                        for (int i = 0; i < 4; i++)
                            xv[u][i] = round_to<WK>(xv[u][i] * scale[r] * nv[u][i]);
                    }
                    #pragma unroll
                    for (int o = 0; o < OUTS; o++)
                        acc[o][r] += wv[u][o][0] * xv[u][0] + wv[u][o][1] * xv[u][1] +
                                     wv[u][o][2] * xv[u][2] + wv[u][o][3] * xv[u][3];
                }
            }
        }
        #pragma unroll
        for (int r = 0; r < ROWS; r++) {
            if (r >= rows) break;
            #pragma unroll
            for (int o = 0; o < OUTS; o++) {
                float v = warp_sum(acc[o][r]);
                if (lane == 0) red[warp][o * ROWS + r] = v;
            }
        }
        __syncthreads();
        if (t < outs * rows) {
            const int o = t / rows, r = t % rows;
            float v = 0.0f;
            for (int k = 0; k < nwarps; k++) v += red[k][o * ROWS + r];
            const i64 i = (i64)r * N + o0 + o;
            float* y = m == 0 ? y0 : m == 1 ? y1 : y2;
            y[i] = beta == 0.0f ? v : v + beta * y[i];
        }
        __syncthreads();  // `red` is reused by the next block's outputs
    }
}

#define GEMV_BODY(ROWS, OUTS, WK, NORM)                                                         \
    gemv_body<ROWS, OUTS, WK, NORM>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K,      \
                                    norm, eps, beta, red)
#define GEMV_CALL(ROWS, OUTS)                                                                   \
    __shared__ float red[GEMV_MAX_WARPS][(OUTS) * (ROWS) + (ROWS)];                              \
    if (norm) {                                                                                  \
        if (w_kind == 1) GEMV_BODY(ROWS, OUTS, 1, true);                                         \
        else if (w_kind == 2) GEMV_BODY(ROWS, OUTS, 2, true);                                    \
        else GEMV_BODY(ROWS, OUTS, 0, true);                                                     \
    } else {                                                                                     \
        if (w_kind == 1) GEMV_BODY(ROWS, OUTS, 1, false);                                        \
        else if (w_kind == 2) GEMV_BODY(ROWS, OUTS, 2, false);                                   \
        else GEMV_BODY(ROWS, OUTS, 0, false);                                                    \
    }

// Batch rows 2..=8 (registers for 8 rows), one row (the decode that matters: fewer registers,
// more blocks resident), one row with 8 outputs per block (twice the loads in flight per
// thread; `Gpu::gemv_wide` picks between the two one-row forms).
KERNEL void gemv(GEMV_ARGS) { GEMV_CALL(GEMV_MAX_ROWS, 4) }
KERNEL void gemv1(GEMV_ARGS) { GEMV_CALL(1, 4) }
KERNEL void gemv1w(GEMV_ARGS) { GEMV_CALL(1, 8) }

// Device-memory read bandwidth probe: sums `n` floats (each thread a strided slice), so the
// roofline is measured on the device in the same run as the decode it bounds.
KERNEL void read_probe(const float4* p, i64 n4, float* sink) {
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (i64 i = blockIdx.x * (i64)blockDim.x + threadIdx.x; i < n4; i += (i64)gridDim.x * blockDim.x) {
        float4 v = p[i];
        a.x += v.x; a.y += v.y; a.z += v.z; a.w += v.w;
    }
    float s = a.x + a.y + a.z + a.w;
    if (s == 1234.5f) sink[0] = s;  // never true for zeros; keeps the loads alive
}
