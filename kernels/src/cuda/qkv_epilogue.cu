// What follows a pass's Q/K/V product, in one launch instead of about a dozen candle ops: the
// biases added, RoPE applied to Q and K by each row's angles, Q written out, K and V written
// into the layer's f16 cache at each row's position. The device engine runs it where the
// fused attention runs and nothing else needs K and V apart (no shift hook, no Q/K norm:
// target-engine/src/device/forward.rs). Compiled at run time by NVRTC after common.cuh; run
// on the CPU by the suite under kernels/tests/cuda_emu/.
//
// Layouts:
//   q_in, k_in, v_in  rows of the product (n rows, row strides ld_q, ld_k, ld_v floats):
//                     q_in (n, n_head * hd), k_in and v_in (n, n_kv_head * hd)
//   bq, bk, bv        the biases (n_head * hd, n_kv_head * hd, ...) or null
//   cos, sin          (n, hd / 2): each row's angles
//   pos               (n) u32: each row's position (< cap)
//   q_out             (n, n_head, hd) f32
//   k_cache, v_cache  (n_kv_head, cap, hd) f16 bits
// RoPE pairs: (m, m + hd / 2) with `interleaved` 0 (rotate-half), (2m, 2m + 1) with 1.
// Grid (n), any number of threads; a row past its cache is left unwritten and its Q is NaN.

__device__ __forceinline__ void rope_pair(int m, int half, int interleaved, int* a, int* b) {
    if (interleaved) {
        *a = 2 * m;
        *b = 2 * m + 1;
    } else {
        *a = m;
        *b = m + half;
    }
}

extern "C" __global__ void qkv_epilogue(const float* q_in, const float* k_in, const float* v_in,
                                        int ld_q, int ld_k, int ld_v, const float* bq,
                                        const float* bk, const float* bv, const float* cos,
                                        const float* sin, const unsigned* pos, float* q_out,
                                        unsigned short* k_cache, unsigned short* v_cache,
                                        int n_head, int n_kv_head, int hd, int cap,
                                        int interleaved) {
    const int row = blockIdx.x;
    const int half = hd / 2;
    const unsigned p = pos[row];
    const float* qr = q_in + (size_t)row * ld_q;
    const float* kr = k_in + (size_t)row * ld_k;
    const float* vr = v_in + (size_t)row * ld_v;
    const float* c = cos + (size_t)row * half;
    const float* s = sin + (size_t)row * half;
    float* qo = q_out + (size_t)row * n_head * hd;
    if (p >= (unsigned)cap) {
        for (int i = threadIdx.x; i < n_head * hd; i += blockDim.x)
            qo[i] = __int_as_float(0x7fc00000);
        return;
    }
    // Q and K: one rotated pair a step.
    for (int i = threadIdx.x; i < (n_head + n_kv_head) * half; i += blockDim.x) {
        const int is_k = i >= n_head * half;
        const int j = is_k ? i - n_head * half : i;
        const int head = j / half, m = j % half;
        int a, b;
        rope_pair(m, half, interleaved, &a, &b);
        const int at = head * hd;
        const float* in = is_k ? kr : qr;
        const float* bias = is_k ? bk : bq;
        float x = in[at + a], y = in[at + b];
        if (bias) {
            x += bias[at + a];
            y += bias[at + b];
        }
        const float ra = x * c[m] - y * s[m];
        const float rb = x * s[m] + y * c[m];
        if (is_k) {
            unsigned short* dst = k_cache + ((size_t)head * cap + p) * hd;
            dst[a] = f16_bits(ra);
            dst[b] = f16_bits(rb);
        } else {
            qo[at + a] = ra;
            qo[at + b] = rb;
        }
    }
    // V: biased and rounded.
    for (int i = threadIdx.x; i < n_kv_head * hd; i += blockDim.x) {
        const int head = i / hd, d = i % hd;
        float x = vr[i];
        if (bv) x += bv[i];
        v_cache[((size_t)head * cap + p) * hd + d] = f16_bits(x);
    }
}
