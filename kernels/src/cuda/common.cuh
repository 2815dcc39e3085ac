// thaw's CUDA kernels, compiled at run time by NVRTC for the device's architecture: this file
// (types, element conversions, reductions) followed by elementwise.cu, attention.cu and gemv.cu,
// concatenated in that order into one program (`compile::SOURCE`).
//
// No headers: NVRTC ships none by default, so the 16-bit conversions are written out (bf16 by
// bit operations, rounding to nearest even like the CPU's `half` crate; f16 with PTX `cvt`).
// Matrix products are cuBLAS's (or, for decode, gemv.cu's); the rest are the memory-bound pieces
// between them. Every kernel
// mirrors a CPU function in `ops.rs` (same formula, same order where it matters) so the two
// backends can be compared on the same weights.
//
// Element kinds (`kind` arguments): 0 = f32, 1 = bf16, 2 = f16.
//
// The same files are compiled for the CPU by the test-only emulator (kernels/emu: `THAW_CUDA_EMU`,
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
