// The element-wise steps around the bf16 GEMMs, each in one launch instead of an op and a
// cast: RMSNorm (f32 rows in, bf16 out) and SwiGLU (silu(gate) * up, f32 or the gate/up
// GEMM's bf16 output in, bf16 out) write a GEMM's input; add_bf16 adds a GEMM's bf16 output
// (the attention output's and the FFN's projections) to the f32 residual stream. The device
// engine runs them on a GPU with bf16 weights and the fused kernels on
// (target-engine/src/device/forward.rs). Compiled at run time by NVRTC after common.cuh; run on
// the CPU by the suite under kernels/tests/cuda_emu/.

// x (rows, cols) f32 contiguous, w (cols) f32; out (rows, cols) bf16 bits:
// out = bf16(x * w / sqrt(mean(x^2) + eps)). Grid (rows), 128 threads.
extern "C" __global__ void rms_norm_bf16(const float* x, const float* w, unsigned short* out,
                                         int cols, float eps) {
    // Dynamic shared memory: one partial sum per warp (launch with 128 bytes).
    float* part = (float*)smem;
    const float* xr = x + (size_t)blockIdx.x * cols;
    unsigned short* o = out + (size_t)blockIdx.x * cols;
    float sum = 0.f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) sum += xr[i] * xr[i];
    sum = warp_sum(sum);
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    if (lane == 0) part[warp] = sum;
    __syncthreads();
    float total = 0.f;
    for (int i = 0; i < (int)(blockDim.x + 31) / 32; ++i) total += part[i];
    const float inv = 1.f / sqrtf(total / (float)cols + eps);
    for (int i = threadIdx.x; i < cols; i += blockDim.x) o[i] = bf16_bits(xr[i] * inv * w[i]);
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
