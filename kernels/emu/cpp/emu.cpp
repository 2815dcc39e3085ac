// The CPU emulator's launch machinery and its C entry points (one per kernel).
#include "shim.h"

#include <atomic>
#include <barrier>
#include <signal.h>
#include <unistd.h>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

thread_local emu_uint3 threadIdx;
emu_uint3 blockIdx;
emu_uint3 blockDim;
emu_uint3 gridDim;

namespace {
struct Block {
    std::unique_ptr<std::barrier<>> all;
    std::vector<std::unique_ptr<std::barrier<>>> warps;
    std::vector<float> exchange;
    // Lanes of each warp that have returned: a shuffle over the full mask then reads a lane
    // that no longer exists — undefined on a GPU (garbage or a hang), an abort here.
    std::unique_ptr<std::atomic<int>[]> exited;
};
Block* current = nullptr;
}  // namespace

void emu_syncthreads() { current->all->arrive_and_wait(); }

float emu_shfl_xor(float v, int lane_mask) {
    unsigned t = threadIdx.x, w = t / 32, lane = t % 32;
    current->exchange[t] = v;
    current->warps[w]->arrive_and_wait();
    // (After the barrier: every lane has either arrived or returned, and counted itself.)
    if (current->exited[w].load() > 0) {
        fprintf(stderr,
                "thaw emulator: a full-warp shuffle in warp %u of block (%u, %u) after %d of its "
                "lanes returned (undefined on a GPU)\n",
                w, blockIdx.x, blockIdx.y, current->exited[w].load());
        abort();
    }
    float r = current->exchange[w * 32 + (lane ^ (unsigned)lane_mask)];
    current->warps[w]->arrive_and_wait();
    return r;
}

#include "../../src/cuda/common.cuh"
#include "../../src/cuda/elementwise.cu"
#include "../../src/cuda/attention.cu"
#include "../../src/cuda/gemv.cu"

namespace {
std::mutex one_launch;  // the grid state above is global: one launch at a time per process

// Runs `f` as a grid of blocks of `threads` threads (a multiple of 32), one block at a time.
// The launch running now, for the fault handler's message.
const char* volatile running = "(no kernel: host code)";
struct sigaction previous_segv;

// A load or store outside every mapping — in the emulator, usually a guard page of an emulated
// device allocation (src/fence.rs): an out-of-bounds access, which on a GPU would read another
// allocation's bytes or raise a sticky CUDA_ERROR_ILLEGAL_ADDRESS. Names the kernel, then hands
// the fault to the handler that was there before (Rust's), which ends the process.
void on_segv(int sig, siginfo_t* info, void* ctx) {
    char msg[256];
    int n = snprintf(msg, sizeof msg,
                     "thaw emulator: memory fault at %p in %s (out of bounds of an emulated "
                     "device allocation?)\n",
                     info->si_addr, running);
    if (n > 0) (void)!write(2, msg, (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1);
    sigaction(SIGSEGV, &previous_segv, nullptr);
    (void)sig;
    (void)ctx;
}

void install_fault_handler() {
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
}

template <class F>
void launch(const char* name, unsigned gx, unsigned gy, unsigned threads, F f) {
    std::lock_guard<std::mutex> guard(one_launch);
    static std::once_flag handler;
    std::call_once(handler, install_fault_handler);
    running = name;
    gridDim = emu_uint3{gx, gy, 1};
    blockDim = emu_uint3{threads, 1, 1};
    for (unsigned y = 0; y < gy; y++) {
        for (unsigned x = 0; x < gx; x++) {
            blockIdx = emu_uint3{x, y, 0};
            Block b;
            b.all = std::make_unique<std::barrier<>>(threads);
            for (unsigned w = 0; w < threads / 32; w++)
                b.warps.push_back(std::make_unique<std::barrier<>>(32));
            b.exchange.assign(threads, 0.0f);
            b.exited = std::make_unique<std::atomic<int>[]>(threads / 32);
            current = &b;
            std::vector<std::thread> ts;
            ts.reserve(threads);
            for (unsigned t = 0; t < threads; t++) {
                ts.emplace_back([&b, &f, t] {
                    threadIdx = emu_uint3{t, 0, 0};
                    f();
                    // An exited thread no longer holds up barriers (as on a GPU).
                    b.exited[t / 32]++;
                    b.all->arrive_and_drop();
                    b.warps[t / 32]->arrive_and_drop();
                });
            }
            for (auto& t : ts) t.join();
            current = nullptr;
        }
    }
    running = "(no kernel: host code)";
}
}  // namespace

extern "C" {
void thaw_emu_widen(unsigned grid, unsigned block, const void* src, int kind, float* dst, i64 n) {
    launch(__func__, grid, 1, block, [=] { widen(src, kind, dst, n); });
}
void thaw_emu_embed(unsigned rows, unsigned block, const void* table, int kind, const u32* ids,
                    int d, float* out) {
    launch(__func__, rows, 1, block, [=] { embed(table, kind, ids, d, out); });
}
void thaw_emu_rmsnorm(unsigned rows, unsigned block, const float* x, const u32* map,
                      const float* w, int d, float eps, void* out, int out_kind) {
    launch(__func__, rows, 1, block, [=] { rmsnorm(x, map, w, d, eps, out, out_kind); });
}
void thaw_emu_add_bias(unsigned grid, unsigned block, float* x, const float* b, int d, i64 n) {
    launch(__func__, grid, 1, block, [=] { add_bias(x, b, d, n); });
}
void thaw_emu_silu_mul(unsigned grid, unsigned block, const float* g, const float* u, void* out,
                       int out_kind, i64 n) {
    launch(__func__, grid, 1, block, [=] { silu_mul(g, u, out, out_kind, n); });
}
void thaw_emu_rope_store(unsigned rows, unsigned block, float* q, const float* k, const float* v,
                         const float* cos_t, const float* sin_t, int n_heads, int n_kv, int hd,
                         void* kc, void* vc, int kv_kind, const i64* slot, i64 layer_off) {
    // As the GPU launch: slices of `block` threads over the row's work.
    unsigned slices = ((unsigned)(n_heads * (hd / 2) + n_kv * (hd / 2) + n_kv * hd) + block - 1) / block;
    launch(__func__, rows, slices, block, [=] {
        rope_store(q, k, v, cos_t, sin_t, n_heads, n_kv, hd, kc, vc, kv_kind, slot, layer_off);
    });
}
void thaw_emu_argmax_rows(unsigned rows, unsigned block, const float* x, int n, u32* ids) {
    launch(__func__, rows, 1, block, [=] { argmax_rows(x, n, ids); });
}
void thaw_emu_gemv(int which, unsigned grid, unsigned block, const void* w0, const void* w1,
                   const void* w2, float* y0, float* y1, float* y2, int n0, int n1, int n2,
                   int w_kind, const void* x, int rows, int K, const float* norm, float eps,
                   float beta) {
    static const char* const names[] = {"gemv", "gemv1", "gemv1v", "gemv1r"};
    launch(which >= 0 && which < 4 ? names[which] : "gemv?", grid, 1, block, [=] {
        if (which == 1)
            gemv1(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta);
        else if (which == 2)
            gemv1v(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta);
        else if (which == 3)
            gemv1r(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta);
        else
            gemv(w0, w1, w2, y0, y1, y2, n0, n1, n2, w_kind, x, rows, K, norm, eps, beta);
    });
}
void thaw_emu_attention(unsigned rows, unsigned kv_heads, const float* q, const void* kc,
                        const void* vc, int kv_kind, const u32* rows_map, const u32* pos,
                        const u32* table_off, const u32* tables, int block_size, i64 block_stride,
                        i64 layer_off, int n_heads, int n_kv, int hd, float scale, void* out,
                        int out_kind, int chunk, int nsplit, float* part) {
    launch(__func__, rows, kv_heads * (unsigned)nsplit, DEC_WARPS * 32, [=] {
        attention(q, kc, vc, kv_kind, rows_map, pos, table_off, tables, block_size, block_stride,
                  layer_off, n_heads, n_kv, hd, scale, out, out_kind, chunk, nsplit, part);
    });
    if (chunk > 0) {
        launch("attention_merge", rows, (unsigned)n_heads, 32, [=] {
            attention_merge(part, rows_map, pos, chunk, nsplit, n_heads, hd, out, out_kind);
        });
    }
}
void thaw_emu_attention_prefill(unsigned tiles, unsigned kv_heads, const float* q, const void* kc,
                                const void* vc, int kv_kind, const u32* tile_row0,
                                const u32* tile_rows, const u32* pos, const u32* table_off,
                                const u32* tables, int block_size, i64 block_stride,
                                i64 layer_off, int n_heads, int n_kv, int hd, float scale,
                                void* out, int out_kind) {
    launch(__func__, tiles, kv_heads, ATT_WARPS * 32, [=] {
        attention_prefill(q, kc, vc, kv_kind, tile_row0, tile_rows, pos, table_off, tables,
                          block_size, block_stride, layer_off, n_heads, n_kv, hd, scale, out,
                          out_kind);
    });
}
// The emulator's own check, tested: `exit_lanes` lanes of one warp return, the others then sum
// over the full warp (aborts unless exit_lanes is 0; the sum of ones otherwise).
void thaw_emu_selftest_shuffle_after_exit(int exit_lanes, float* out) {
    launch("selftest", 1, 1, 32, [=] {
        if ((int)threadIdx.x >= 32 - exit_lanes) return;
        float v = warp_sum(1.0f);
        if (threadIdx.x == 0) *out = v;
    });
}
}
