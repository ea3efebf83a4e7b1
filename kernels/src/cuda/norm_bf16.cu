// The element-wise steps around the bf16 GEMMs, each in one launch instead of an op and a
// cast: RMSNorm (f32 rows in, bf16 out) and SwiGLU (silu(gate) * up, f32 or the gate/up
// GEMM's bf16 output in, bf16 out) write a GEMM's input; add_bf16 adds a GEMM's bf16 output
// (the attention output's and the FFN's projections) to the f32 residual stream, and
// add_rms_norm_bf16 does that and the next RMSNorm in one launch. The device
// engine runs them on a GPU with bf16 weights and the fused kernels on
// (target-engine/src/device/forward.rs). Compiled at run time by NVRTC after common.cuh; run on
// the CPU by the suite under kernels/tests/cuda_emu/.

// The sum over the block of each thread's `x` (at most 32 warps), for every thread: dynamic
// shared memory holds one partial per warp (launch with 128 bytes).
__device__ __forceinline__ float block_sum(float x) {
    float* part = (float*)smem;
    x = warp_sum(x);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = x;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) total += part[i];
    return total;
}

// x (rows, cols) f32 contiguous, w (cols) f32; out (rows, cols) bf16 bits:
// out = bf16(x * w / sqrt(mean(x^2) + eps)). Grid (rows), 128 threads, 128 bytes of shared
// memory.
extern "C" __global__ void rms_norm_bf16(const float* x, const float* w, unsigned short* out,
                                         int cols, float eps) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    unsigned short* o = out + (size_t)blockIdx.x * cols;
    float sum = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += xr[i] * xr[i];
    const float inv = 1.f / sqrtf(block_sum(sum) / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = bf16_bits(xr[i] * inv * w[i]);
}

// The residual add and the next RMSNorm in one launch: x (rows, cols) f32 contiguous; delta
// rows of `cols` bf16 bits with row stride ld_d (a bf16 GEMM's output); w (cols) f32.
// sum (rows, cols) f32 = x + delta, each the f32 sum (as add_bf16); then delta's own elements
// are overwritten with bf16(sum * w / sqrt(mean(sum^2) + eps)) (as rms_norm_bf16 of sum):
// each row is read and rewritten by one block, every element by the thread that read it.
// Grid (rows), 128 threads, 128 bytes of shared memory.
extern "C" __global__ void add_rms_norm_bf16(const float* x, unsigned short* delta, int ld_d,
                                             const float* w, float* sum, int cols, float eps) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    unsigned short* d = delta + (size_t)blockIdx.x * ld_d;
    float* s = sum + (size_t)blockIdx.x * cols;
    float sq = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float v = xr[i] + bf16_value(d[i]);
        s[i] = v;
        sq += v * v;
    }
    const float inv = 1.f / sqrtf(block_sum(sq) / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) d[i] = bf16_bits(s[i] * inv * w[i]);
}

// gate, up: rows of `cols` read with row strides ld_g, ld_u (column ranges of one product);
// out (rows, cols) bf16 bits: bf16(gate / (1 + exp(-gate)) * up). Grid (rows), any threads.
extern "C" __global__ void swiglu_bf16(const float* gate, const float* up, int ld_g, int ld_u,
                                       unsigned short* out, int cols) {
    const float* g = gate + (size_t)blockIdx.x * ld_g;
    const float* u = up + (size_t)blockIdx.x * ld_u;
    unsigned short* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float a = g[i];
        o[i] = bf16_bits(a / (1.f + expf(-a)) * u[i]);
    }
}

// swiglu_bf16 over the gate/up GEMM's bf16 output (bits), read without a cast to f32.
extern "C" __global__ void swiglu_bf16_in(const unsigned short* gate, const unsigned short* up,
                                          int ld_g, int ld_u, unsigned short* out, int cols) {
    const unsigned short* g = gate + (size_t)blockIdx.x * ld_g;
    const unsigned short* u = up + (size_t)blockIdx.x * ld_u;
    unsigned short* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float a = bf16_value(g[i]);
        o[i] = bf16_bits(a / (1.f + expf(-a)) * bf16_value(u[i]));
    }
}

// x (rows, cols) f32 contiguous; delta rows of `cols` bf16 bits read with row stride ld_d;
// out (rows, cols) f32: x + delta, each sum one f32 rounding. Grid (rows), any threads.
extern "C" __global__ void add_bf16(const float* x, const unsigned short* delta, int ld_d,
                                    float* out, int cols) {
    const float* xr = x + (size_t)blockIdx.x * cols;
    const unsigned short* d = delta + (size_t)blockIdx.x * ld_d;
    float* o = out + (size_t)blockIdx.x * cols;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = xr[i] + bf16_value(d[i]);
}
