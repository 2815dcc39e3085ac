// Just enough of CUDA C for the kernels (src/cuda/*.cu) to compile as C++ and run on the CPU: one OS thread per
// CUDA thread, blocks one after another, std::barrier for __syncthreads and warp shuffles,
// __shared__ as function statics (safe because only one block runs at a time).
#pragma once
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define THAW_CUDA_EMU 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
#define KERNEL static

struct emu_uint3 {
    unsigned x, y, z;
};
extern thread_local emu_uint3 threadIdx;
extern emu_uint3 blockIdx;
extern emu_uint3 blockDim;
extern emu_uint3 gridDim;

struct float4 {
    float x, y, z, w;
};
struct float2 {
    float x, y;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

// A GPU faults on a vector load off its size's boundary ("misaligned address"); the emulator
// aborts, so a test catches what the GPU would.
inline void emu_check_align(const void* p, unsigned bytes) {
    if ((uintptr_t)p % bytes != 0) {
        fprintf(stderr, "thaw emulator: misaligned %u-byte load at %p\n", bytes, p);
        abort();
    }
}
inline float4 make_float4(float a, float b, float c, float d) { return float4{a, b, c, d}; }

inline float __uint_as_float(unsigned u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
inline unsigned __float_as_uint(float f) {
    unsigned u;
    memcpy(&u, &f, 4);
    return u;
}
inline float emu_f16_to_f32(unsigned short x) {
    _Float16 h;
    memcpy(&h, &x, 2);
    return (float)h;
}
inline unsigned short emu_f32_to_f16(float f) {
    _Float16 h = (_Float16)f;
    unsigned short x;
    memcpy(&x, &h, 2);
    return x;
}

void emu_syncthreads();
float emu_shfl_xor(float v, int lane_mask);
#define __syncthreads() emu_syncthreads()
#define __shfl_xor_sync(mask, v, o) emu_shfl_xor((v), (o))
