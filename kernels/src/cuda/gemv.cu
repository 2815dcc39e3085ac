// Matrix-vector products for decode (part of thaw's kernels: see common.cuh, which comes first).

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
#else
    emu_check_align(p, 8);
#endif
    return *(const uint2*)p;
}

// 16 bytes at `p` (16-byte aligned), likewise.
template <bool STREAM>
__device__ __forceinline__ uint4 load16(const void* p) {
#ifndef THAW_CUDA_EMU
    if (STREAM) {
        uint4 v;
        asm("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
            : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
            : "l"(p));
        return v;
    }
#else
    emu_check_align(p, 16);
#endif
    return *(const uint4*)p;
}

// The two 16-bit elements of `v` (low first) as f32.
template <int KIND>
__device__ __forceinline__ void unpack2(unsigned v, float* out) {
    const u16 lo = (u16)(v & 0xffffu), hi = (u16)(v >> 16);
    out[0] = KIND == 1 ? bf16_to_f32(lo) : f16_to_f32(lo);
    out[1] = KIND == 1 ? bf16_to_f32(hi) : f16_to_f32(hi);
}

// VEC (4 or 8) consecutive elements of kind KIND from element `i`, as f32. VEC = 4: one 8-byte
// load of 16-bit elements or two of f32 (8-byte aligned); VEC = 8: one 16-byte load of 16-bit
// elements or two of f32 (16-byte aligned) — the widest load a thread can issue, so half the
// load instructions for the same bytes in flight.
template <int KIND, int VEC, bool STREAM>
__device__ __forceinline__ void loadv(const void* p, i64 i, float* out) {
    if (VEC == 8) {
        if (KIND == 0) {
            uint4 a = load16<STREAM>((const float*)p + i), b = load16<STREAM>((const float*)p + i + 4);
            out[0] = __uint_as_float(a.x); out[1] = __uint_as_float(a.y);
            out[2] = __uint_as_float(a.z); out[3] = __uint_as_float(a.w);
            out[4] = __uint_as_float(b.x); out[5] = __uint_as_float(b.y);
            out[6] = __uint_as_float(b.z); out[7] = __uint_as_float(b.w);
            return;
        }
        uint4 v = load16<STREAM>((const u16*)p + i);
        unpack2<KIND>(v.x, out); unpack2<KIND>(v.y, out + 2);
        unpack2<KIND>(v.z, out + 4); unpack2<KIND>(v.w, out + 6);
        return;
    }
    if (KIND == 0) {
        uint2 a = load8<STREAM>((const float*)p + i), b = load8<STREAM>((const float*)p + i + 2);
        out[0] = __uint_as_float(a.x); out[1] = __uint_as_float(a.y);
        out[2] = __uint_as_float(b.x); out[3] = __uint_as_float(b.y);
        return;
    }
    uint2 v = load8<STREAM>((const u16*)p + i);
    unpack2<KIND>(v.x, out); unpack2<KIND>(v.y, out + 2);
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
// K over all its threads: each thread reads VEC elements of each of the OUTS rows per step (a
// warp's loads of one row are 32·VEC contiguous elements; weights bypass L1, read once by one
// thread), multiplies them by the same VEC elements of x (read once per block, not once per
// output), and the block reduces its partial sums through shared memory. Kinds are template
// parameters (the entry points dispatch once), so the loads of two steps — 2·OUTS weight loads
// and the x loads — are all in flight before the first multiply (checked in the SASS,
// `scripts/kernel-report.sh gemv1`): a kind chosen per load at run time put each load in a branch
// of its own. K a multiple of VEC; W, x and the norm's weights 8-byte aligned for VEC = 4,
// 16-byte for VEC = 8 (the caller checks; the loader puts data sections on 256-byte device
// boundaries, so a checkpoint's tensors are 16-byte aligned wherever their offsets are).
// Output groups beyond the grid are strided over it: the emulator runs a small grid, and a GPU launch has either a
// block per group or (`Gpu::gemv_persistent`) as many blocks as fit on the device at once, each
// computing the norm's scale once for all its groups.
//
// With `norm` (f32 weights, K of them), x is the f32 residual and the product is of its RMSNorm,
// as the `rmsnorm` kernel would have stored it: each block first sums x² over the row (x is
// small and cached; the weights are what streams from memory), then multiplies W by
// x·scale·norm rounded to W's kind — the same activations the unfused step (and the CPU) feed
// the product, without a kernel of their own or a round trip through memory.
#define GEMV_MAX_ROWS 8
#define GEMV_MAX_WARPS 8
#define GEMV_STEPS 2  // VEC-element steps per thread per pass

// A launch's output groups: `per` consecutive outputs of one of its (up to) three matrices,
// the matrices' groups in order — group b is outputs [first(b), first(b) + per) of matrix
// matrix(b).
struct GemvGroups {
    int per, b0, b1, total;
    __device__ GemvGroups(int n0, int n1, int n2, int per_)
        : per(per_), b0((n0 + per_ - 1) / per_), b1((n1 + per_ - 1) / per_),
          total(b0 + b1 + (n2 + per_ - 1) / per_) {}
    __device__ __forceinline__ int matrix(int b) const { return b < b0 ? 0 : b < b0 + b1 ? 1 : 2; }
    __device__ __forceinline__ int first(int b) const {
        const int m = matrix(b);
        return (b - (m == 0 ? 0 : m == 1 ? b0 : b0 + b1)) * per;
    }
};

#define GEMV_ARGS                                                                               \
    const void *w0, const void *w1, const void *w2, float *y0, float *y1, float *y2, int n0,     \
        int n1, int n2, int w_kind, const void *x, int rows, int K, const float *norm,           \
        float eps, float beta

// (The three matrices are picked by selects, not an array indexed at run time: that would put
// the array in local memory.)
template <int ROWS, int OUTS, int WK, bool NORM, int VEC>
__device__ __forceinline__ void gemv_body(GEMV_ARGS, float (*red)[OUTS * ROWS + ROWS]) {
    constexpr int XK = NORM ? 0 : WK;  // x's kind: the f32 residual under a norm
    (void)w_kind;                      // = WK (the entry point dispatched on it)
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = blockDim.x >> 5;
    const int groups = K / VEC;
    const GemvGroups groups_of(n0, n1, n2, OUTS);
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
                float xv[VEC];
                loadv<0, VEC, false>(x, (i64)r * K + VEC * (i64)g, xv);
                #pragma unroll
                for (int i = 0; i < VEC; i++) ss[r] += xv[i] * xv[i];
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
    for (int b = blockIdx.x; b < groups_of.total; b += gridDim.x) {
        const int m = groups_of.matrix(b), o0 = groups_of.first(b);
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
            float wv[GEMV_STEPS][OUTS][VEC], nv[GEMV_STEPS][VEC];
            #pragma unroll
            for (int u = 0; u < GEMV_STEPS; u++) {
                #pragma unroll
                for (int o = 0; o < OUTS; o++) {
                    // A last block's missing rows read row o0 again (in bounds), not stored.
                    const int row = o0 + (o < outs ? o : 0);
                    loadv<WK, VEC, true>(w, (i64)row * K + VEC * (i64)gs[u], wv[u][o]);
                }
                if (NORM) loadv<0, VEC, false>(norm, VEC * (i64)gs[u], nv[u]);
            }
            #pragma unroll
            for (int r = 0; r < ROWS; r++) {
                if (r >= rows) break;
                float xv[GEMV_STEPS][VEC];
                #pragma unroll
                for (int u = 0; u < GEMV_STEPS; u++)
                    loadv<XK, VEC, false>(x, (i64)r * K + VEC * (i64)gs[u], xv[u]);
                #pragma unroll
                for (int u = 0; u < GEMV_STEPS; u++) {
                    if (!ok[u]) continue;
                    if (NORM) {
                        #pragma unroll
                        for (int i = 0; i < VEC; i++)
                            xv[u][i] = round_to<WK>(xv[u][i] * scale[r] * nv[u][i]);
                    }
                    #pragma unroll
                    for (int o = 0; o < OUTS; o++) {
                        #pragma unroll
                        for (int i = 0; i < VEC; i++) acc[o][r] += wv[u][o][i] * xv[u][i];
                    }
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

#define GEMV_BODY(ROWS, OUTS, WK, NORM, VEC)                                                    \
    gemv_body<ROWS, OUTS, WK, NORM, VEC>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, \
                                         norm, eps, beta, red)
// Weights in f32 or bf16 (the host sends f16 weights to cuBLAS): each instantiation adds to
// NVRTC's compile.
#define GEMV_CALL(ROWS, OUTS, VEC)                                                              \
    __shared__ float red[GEMV_MAX_WARPS][(OUTS) * (ROWS) + (ROWS)];                              \
    if (norm) {                                                                                  \
        if (w_kind == 1) GEMV_BODY(ROWS, OUTS, 1, true, VEC);                                    \
        else GEMV_BODY(ROWS, OUTS, 0, true, VEC);                                                \
    } else {                                                                                     \
        if (w_kind == 1) GEMV_BODY(ROWS, OUTS, 1, false, VEC);                                   \
        else GEMV_BODY(ROWS, OUTS, 0, false, VEC);                                               \
    }

// Batch rows 2..=8 (registers for 8 rows), one row (the decode that matters: fewer registers,
// more blocks resident), one row with 16-byte loads (twice the bytes in flight per thread for
// the same load instructions; `Gpu::gemv_vec16` picks it where the product is 16-byte aligned
// and `gemv1r` below does not take it).
// (THAW_SKIP_*: compile.rs compiles this file as three programs at once, one per family.)
#ifndef THAW_SKIP_GEMV_ROWS
KERNEL void gemv(GEMV_ARGS) { GEMV_CALL(GEMV_MAX_ROWS, 4, 4) }
#endif
#ifndef THAW_SKIP_GEMV_ONE
KERNEL void gemv1(GEMV_ARGS) { GEMV_CALL(1, 4, 4) }
KERNEL void gemv1v(GEMV_ARGS) { GEMV_CALL(1, 4, 8) }
#endif

// One-row products, a warp per GEMV_WR outputs (`gemv1r`): the activations are staged once per
// block in shared memory (normalized and rounded to W's kind under a norm, exactly as the
// `rmsnorm` kernel stores them), then each warp streams its rows with 16-byte loads — GEMV_WU
// loads of each row in flight per lane, the first pass's issued before the staging so that it
// overlaps their latency — and reduces within the warp. Unlike `gemv1v`, no block barrier
// follows the staging: a warp that finishes its rows frees its registers at once, and
// the block-wide reduction after every group of outputs is gone. 16-byte aligned operands, K a
// multiple of 8 and K elements of W's kind within GEMV_XS_BYTES (the caller checks).
#define GEMV_WR 2
#define GEMV_WU 4
#define GEMV_XS_BYTES 40960  // (with the rest, within the 48 KiB of static shared memory)

// One pass of a warp's weight loads: GEMV_WU vectors (`v0`, `v0` + 32, …) of each of its
// GEMV_WR rows from `o0` (a vector past the row re-reads `v0`, a row past N re-reads row o0:
// in bounds, never added or stored). All loads issue before any is used.
template <int WK>
__device__ __forceinline__ void gemv_warp_loads(const void* w, int K, int nv, int N, int o0,
                                                int v0, float (*wv)[GEMV_WR][8]) {
    #pragma unroll
    for (int u = 0; u < GEMV_WU; u++) {
        const int v = v0 + 32 * u < nv ? v0 + 32 * u : v0;
        #pragma unroll
        for (int r = 0; r < GEMV_WR; r++) {
            const int row = o0 + (o0 + r < N ? r : 0);
            loadv<WK, 8, true>(w, (i64)row * K + 8 * (i64)v, wv[u][r]);
        }
    }
}

template <int WK, bool NORM>
__device__ __forceinline__ void gemv_warp_body(GEMV_ARGS, unsigned char* xs, float* red) {
    (void)w_kind;
    (void)rows;  // one row
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, nwarps = blockDim.x >> 5;
    const int nv = K / 8;  // 8-element vectors per row
    const GemvGroups groups_of(n0, n1, n2, nwarps * GEMV_WR);
    const int total = groups_of.total;
    // The warp's rows in output group b: matrix, its height, first row, weights.
    auto group = [&](int b, int& N, int& o0, const void*& w) {
        const int m = groups_of.matrix(b);
        N = m == 0 ? n0 : m == 1 ? n1 : n2;
        o0 = groups_of.first(b) + warp * GEMV_WR;
        w = m == 0 ? w0 : m == 1 ? w1 : w2;
        return m;
    };
    // The first group's first pass of weight loads issues before x is staged: the staging (a
    // reduction over x, a barrier or two) then overlaps their latency instead of preceding it.
    float wv[GEMV_WU][GEMV_WR][8];
    bool preloaded = false;
    if ((int)blockIdx.x < total) {
        int N, o0;
        const void* w;
        group(blockIdx.x, N, o0, w);
        if (o0 < N && lane < nv) {
            gemv_warp_loads<WK>(w, K, nv, N, o0, lane, wv);
            preloaded = true;
        }
    }
    float scale = 1.0f;
    if (NORM) {
        float ss = 0.0f;
        for (int v = t; v < nv; v += blockDim.x) {
            float xv[8];
            loadv<0, 8, false>(x, 8 * (i64)v, xv);
            #pragma unroll
            for (int i = 0; i < 8; i++) ss += xv[i] * xv[i];
        }
        ss = warp_sum(ss);
        if (lane == 0) red[warp] = ss;
        __syncthreads();
        float sq = 0.0f;
        for (int k = 0; k < nwarps; k++) sq += red[k];
        scale = 1.0f / sqrtf(sq / (float)K + eps);
    }
    // x (or its norm) into shared memory, in W's kind.
    for (int v = t; v < nv; v += blockDim.x) {
        float xv[8];
        loadv<NORM ? 0 : WK, 8, false>(x, 8 * (i64)v, xv);
        if (NORM) {
            float nw[8];
            loadv<0, 8, false>(norm, 8 * (i64)v, nw);
            #pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = round_to<WK>(xv[i] * scale * nw[i]);
        }
        if (WK == 1) {
            unsigned p[4];
            #pragma unroll
            for (int i = 0; i < 4; i++)
                p[i] = (unsigned)f32_to_bf16(xv[2 * i]) | ((unsigned)f32_to_bf16(xv[2 * i + 1]) << 16);
            ((uint4*)xs)[v] = uint4{p[0], p[1], p[2], p[3]};
        } else {
            #pragma unroll
            for (int i = 0; i < 8; i++) ((float*)xs)[8 * v + i] = xv[i];
        }
    }
    __syncthreads();
    for (int b = blockIdx.x; b < total; b += gridDim.x) {
        int N, o0;
        const void* w;
        const int m = group(b, N, o0, w);
        if (o0 >= N) continue;  // (no block barrier below)
        float acc[GEMV_WR];
        #pragma unroll
        for (int r = 0; r < GEMV_WR; r++) acc[r] = 0.0f;
        for (int v0 = lane; v0 < nv; v0 += 32 * GEMV_WU) {
            if (!preloaded) gemv_warp_loads<WK>(w, K, nv, N, o0, v0, wv);
            preloaded = false;
            #pragma unroll
            for (int u = 0; u < GEMV_WU; u++) {
                const int v = v0 + 32 * u;
                if (v >= nv) continue;
                float xv[8];
                loadv<WK, 8, false>(xs, 8 * (i64)v, xv);
                #pragma unroll
                for (int r = 0; r < GEMV_WR; r++) {
                    #pragma unroll
                    for (int i = 0; i < 8; i++) acc[r] += wv[u][r][i] * xv[i];
                }
            }
        }
        float* y = m == 0 ? y0 : m == 1 ? y1 : y2;
        #pragma unroll
        for (int r = 0; r < GEMV_WR; r++) {
            const float v = warp_sum(acc[r]);
            if (lane == 0 && o0 + r < N) y[o0 + r] = beta == 0.0f ? v : v + beta * y[o0 + r];
        }
    }
}

#ifndef THAW_SKIP_GEMV_WARP
KERNEL void gemv1r(GEMV_ARGS) {
    __shared__ uint4 xs4[GEMV_XS_BYTES / 16];  // (uint4: 16-byte aligned)
    unsigned char* xs = (unsigned char*)xs4;
    __shared__ float red[GEMV_MAX_WARPS];
    if (norm) {
        if (w_kind == 1) gemv_warp_body<1, true>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta, xs, red);
        else gemv_warp_body<0, true>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta, xs, red);
    } else {
        if (w_kind == 1) gemv_warp_body<1, false>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta, xs, red);
        else gemv_warp_body<0, false>(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta, xs, red);
    }
}
#endif
