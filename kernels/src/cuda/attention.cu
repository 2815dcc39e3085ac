// Paged GQA attention: the per-row decode kernel with flash-decoding splits and their merge, and the flash-style prefill kernel (part of thaw's kernels: see common.cuh, which comes first).

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

// (THAW_SKIP_*: compile.rs compiles this file as two programs at once, decode and prefill.)
#ifndef THAW_SKIP_DECODE
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
    // A KV cache is f32 or bf16 (`KvDtype`; the host refuses others): an f16 instantiation
    // would only lengthen the compile.
    if (kv_kind == 1) ATT_BODY(1);
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
#endif

#define PF_KEYS 32  // keys staged in shared memory per tile

// Flash-style causal attention for prefill: a block serves a tile of up to ATT_WARPS consecutive
// query rows of one sequence (warp w: row tile_row0[t] + w, all `group` heads of KV head
// blockIdx.y, q and accumulators in registers as in `attention`). Keys and values are staged
// PF_KEYS positions at a time in shared memory by the whole block and read from there by every
// row of the tile, with an online softmax per (row, head) — so each key/value row leaves global
// memory once per tile instead of once per query row. Same arithmetic per position as
// `attention`; a row's positions are visited in order by one warp.
#ifndef THAW_SKIP_PREFILL
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
#endif
