// Runs a CUDA C kernel source on the CPU, as C++20, for the suite: every thread of a block is
// an OS thread, __syncthreads a barrier of the block, and the warp-wide operations the
// kernels use (mma.sync m16n8k16 with f16 inputs and f32 accumulators, __shfl_xor_sync) are
// carried out through a scratch area of the warp with the register layouts the PTX ISA
// documents. Blocks run one after another and share one buffer as their shared memory.
// Include it, then the kernel sources with SPECRAG_EMULATE defined (driver.cpp does).
#pragma once
#include <atomic>
#include <barrier>
#include <cstdlib>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(n)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};
struct float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

alignas(16) unsigned char smem[1 << 16];
thread_local dim3 threadIdx, blockIdx;
dim3 blockDim, gridDim;

namespace emu {
constexpr int kMaxWarps = 32;
unsigned dynamic_smem = 0;
std::barrier<>* block_barrier;
std::unique_ptr<std::barrier<>> warp_barriers[kMaxWarps];
struct WarpScratch {
    unsigned a[32][4];
    unsigned b[32][2];
    float c[32][4];
    float x[32];
};
WarpScratch scratch[kMaxWarps];

inline int warp() { return threadIdx.x / 32; }
inline int lane() { return threadIdx.x % 32; }
inline void warp_sync() { warp_barriers[warp()]->arrive_and_wait(); }

inline float f16_to_f32(unsigned short bits) {
    _Float16 h;
    std::memcpy(&h, &bits, 2);
    return (float)h;
}
inline float lo(unsigned r) { return f16_to_f32((unsigned short)(r & 0xffff)); }
inline float hi(unsigned r) { return f16_to_f32((unsigned short)(r >> 16)); }

// The element (row, col) of a warp's 16x16 A fragment, (k, n) of its 16x8 B fragment.
inline float a_at(const WarpScratch& s, int row, int col) {
    int g = row % 8, t = (col % 8) / 2;
    int reg = (row >= 8 ? 1 : 0) + (col >= 8 ? 2 : 0);
    unsigned r = s.a[g * 4 + t][reg];
    return col % 2 ? hi(r) : lo(r);
}
inline float b_at(const WarpScratch& s, int k, int n) {
    int t = (k % 8) / 2;
    unsigned r = s.b[n * 4 + t][k >= 8 ? 1 : 0];
    return k % 2 ? hi(r) : lo(r);
}

// Runs `kernel` over `grid` with `threads` threads a block and `shared` bytes of dynamic
// shared memory (at most sizeof smem).
template <class Kernel>
void launch(dim3 grid, unsigned threads, unsigned shared, Kernel kernel) {
    if (shared > sizeof smem) std::abort();
    dynamic_smem = shared;
    gridDim = grid;
    blockDim = dim3{threads, 1, 1};
    for (unsigned b = 0; b < grid.x * grid.y * grid.z; ++b) {
        const dim3 block_at{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
        std::barrier<> block((std::ptrdiff_t)threads);
        block_barrier = &block;
        for (unsigned w = 0; w < threads / 32; ++w) {
            warp_barriers[w] = std::make_unique<std::barrier<>>(32);
        }
        std::vector<std::thread> pool;
        for (unsigned t = 0; t < threads; ++t) {
            pool.emplace_back([=] {
                threadIdx = dim3{t, 0, 0};
                blockIdx = block_at;
                kernel();
            });
        }
        for (auto& th : pool) th.join();
    }
}
}  // namespace emu

inline void __syncthreads() { emu::block_barrier->arrive_and_wait(); }

inline unsigned dynamic_smem_bytes() { return emu::dynamic_smem; }

[[noreturn]] inline void __trap() { std::abort(); }

inline float __int_as_float(unsigned bits) {
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline int atomicMax(int* p, int v) {
    std::atomic_ref<int> a(*p);
    int old = a.load();
    while (old < v && !a.compare_exchange_weak(old, v)) {
    }
    return old;
}

inline unsigned short f16_bits(float x) {
    _Float16 h = (_Float16)x;  // round to nearest even, as cvt.rn.f16.f32
    unsigned short bits;
    std::memcpy(&bits, &h, 2);
    return bits;
}

inline float f16_value(unsigned short bits) { return emu::f16_to_f32(bits); }

// Round to nearest even, NaN kept a NaN (as cvt.rn.bf16.f32).
inline unsigned short bf16_bits(float x) {
    unsigned u;
    std::memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

inline float bf16_value(unsigned short bits) {
    unsigned u = (unsigned)bits << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}

inline float __shfl_xor_sync(unsigned, float v, int mask) {
    auto& s = emu::scratch[emu::warp()];
    s.x[emu::lane()] = v;
    emu::warp_sync();
    float r = s.x[emu::lane() ^ mask];
    emu::warp_sync();
    return r;
}

inline float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

inline float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

inline float warp_sum(float x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

// D = A x B + D for the warp's 16x8 tile: each lane gives its A, B and D registers and takes
// back its D registers (row g or g + 8, columns 2t and 2t + 1).
inline void mma_16816(float* d, const unsigned* a, const unsigned* b) {
    auto& s = emu::scratch[emu::warp()];
    int l = emu::lane();
    std::memcpy(s.a[l], a, sizeof s.a[l]);
    std::memcpy(s.b[l], b, sizeof s.b[l]);
    emu::warp_sync();
    int g = l / 4, t = l % 4;
    for (int i = 0; i < 4; ++i) {
        int row = g + (i >= 2 ? 8 : 0), col = 2 * t + i % 2;
        float acc = 0.f;
        for (int k = 0; k < 16; ++k) acc += a_at(s, row, k) * b_at(s, k, col);
        d[i] += acc;
    }
    emu::warp_sync();
}
