// Elementwise and per-row kernels: widening, embedding, RMSNorm, biases, SiLU·mul, RoPE with the cache store, device argmax, the read probe (part of thaw's kernels: see common.cuh, which comes first).

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
