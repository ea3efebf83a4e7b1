// What the run-time kernels here share: the warp-wide and conversion instructions they use,
// as inline PTX. The engine compiles this file and every kernel after it as one NVRTC program
// (target-engine/src/device/fused.rs); on the CPU, kernels/tests/cuda_emu/emu.h gives the same
// functions instead (with SPECRAG_EMULATE defined this file is empty).
#ifndef SPECRAG_EMULATE

// Every kernel's dynamic shared memory (the launch gives its size), declared once for the
// program.
extern __shared__ __align__(16) unsigned char smem[];

// D = A x B + D for a warp's 16x8 tile (A 16x16, B 16x8 in f16, D in f32), in the register
// layouts of the PTX ISA's mma.m16n8k16.
__device__ __forceinline__ void mma_16816(float* d, const unsigned* a, const unsigned* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// x rounded to the nearest f16, as its bits.
__device__ __forceinline__ unsigned short f16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// x rounded to the nearest bf16, as its bits.
__device__ __forceinline__ unsigned short bf16_bits(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// The value of bf16 bits.
__device__ __forceinline__ float bf16_value(unsigned short h) {
    return __uint_as_float((unsigned)h << 16);
}

// The value of f16 bits.
__device__ __forceinline__ float f16_value(unsigned short h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

// The dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
    unsigned n;
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
    return n;
}

// Across the four lanes of a quad (lanes 4g .. 4g + 3).
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// Across the 32 lanes of a warp.
__device__ __forceinline__ float warp_sum(float x) {
    for (int m = 16; m > 0; m >>= 1) x += __shfl_xor_sync(0xffffffffu, x, m);
    return x;
}

#endif

// Elements as the kernels read and write them, in both builds (the GPU's and emu.h's): f32,
// or bf16 as bits (a bf16 GEMM's input or output).
struct bf16_t {
    unsigned short bits;
};
__device__ __forceinline__ float value_of(float x) { return x; }
__device__ __forceinline__ float value_of(bf16_t x) { return bf16_value(x.bits); }
__device__ __forceinline__ void store(float* p, float v) { *p = v; }
__device__ __forceinline__ void store(bf16_t* p, float v) { p->bits = bf16_bits(v); }
