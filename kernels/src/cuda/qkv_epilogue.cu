// What follows a pass's Q/K/V product, in one launch instead of about a dozen candle ops: the
// biases added, RoPE applied to Q and K by each row's angles, Q written out, K and V written
// into the layer's f16 cache at each row's position. The device engine runs it where the
// fused attention runs and nothing else needs K and V apart (no shift hook, no Q/K norm:
// target-engine/src/device/forward.rs). A batched decode step's rows belong to several
// caches: there (`rows_mode` 1) K and V are written as f32 after Q in each output row, for
// decode_attention.cu to write into each request's cache. Compiled at run time by NVRTC
// after common.cuh; run on the CPU by the suite under kernels/tests/cuda_emu/.
//
// Layouts:
//   q_in, k_in, v_in  rows of the product (n rows, row strides ld_q, ld_k, ld_v elements):
//                     q_in (n, n_head * hd), k_in and v_in (n, n_kv_head * hd); f32
//                     (qkv_epilogue), or a bf16 GEMM's output as bits (qkv_epilogue_bf16)
//   bq, bk, bv        the biases (n_head * hd, n_kv_head * hd, ...) or null
//   cos, sin          (n, hd / 2): each row's angles
//   pos               (n) u32: each row's position (< cap)
//   out               f32 rows of stride ld_out: Q (n_head * hd) with `rows_mode` 0; Q, K
//                     (n_kv_head * hd) and V (n_kv_head * hd) with 1
//   k_cache, v_cache  (n_kv_head, cap, hd) f16 bits (`rows_mode` 0; unused with 1)
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

template <class T>
__device__ void qkv_epilogue_rows(const T* q_in, const T* k_in, const T* v_in, int ld_q,
                                  int ld_k, int ld_v, const float* bq, const float* bk,
                                  const float* bv, const float* cos, const float* sin,
                                  const unsigned* pos, float* out, int ld_out, int rows_mode,
                                  unsigned short* k_cache, unsigned short* v_cache, int n_head,
                                  int n_kv_head, int hd, int cap, int interleaved) {
    const int row = blockIdx.x;
    const int half = hd / 2;
    const unsigned p = pos[row];
    const T* qr = q_in + (size_t)row * ld_q;
    const T* kr = k_in + (size_t)row * ld_k;
    const T* vr = v_in + (size_t)row * ld_v;
    const float* c = cos + (size_t)row * half;
    const float* s = sin + (size_t)row * half;
    float* qo = out + (size_t)row * ld_out;
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
        const T* in = is_k ? kr : qr;
        const float* bias = is_k ? bk : bq;
        float x = value_of(in[at + a]), y = value_of(in[at + b]);
        if (bias) {
            x += bias[at + a];
            y += bias[at + b];
        }
        const float ra = x * c[m] - y * s[m];
        const float rb = x * s[m] + y * c[m];
        if (is_k && rows_mode) {
            qo[n_head * hd + at + a] = ra;
            qo[n_head * hd + at + b] = rb;
        } else if (is_k) {
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
        float x = value_of(vr[i]);
        if (bv) x += bv[i];
        if (rows_mode)
            qo[(n_head + n_kv_head) * hd + i] = x;
        else
            v_cache[((size_t)head * cap + p) * hd + d] = f16_bits(x);
    }
}

#define QKV_ARGS                                                                               \
    int ld_q, int ld_k, int ld_v, const float *bq, const float *bk, const float *bv,           \
        const float *cos, const float *sin, const unsigned *pos, float *out, int ld_out,       \
        int rows_mode, unsigned short *k_cache, unsigned short *v_cache, int n_head,           \
        int n_kv_head, int hd, int cap, int interleaved
#define QKV_PASS                                                                               \
    ld_q, ld_k, ld_v, bq, bk, bv, cos, sin, pos, out, ld_out, rows_mode, k_cache, v_cache,     \
        n_head, n_kv_head, hd, cap, interleaved

extern "C" __global__ void qkv_epilogue(const float* q_in, const float* k_in, const float* v_in,
                                        QKV_ARGS) {
    qkv_epilogue_rows(q_in, k_in, v_in, QKV_PASS);
}

extern "C" __global__ void qkv_epilogue_bf16(const unsigned short* q_in,
                                             const unsigned short* k_in,
                                             const unsigned short* v_in, QKV_ARGS) {
    qkv_epilogue_rows((const bf16_t*)q_in, (const bf16_t*)k_in, (const bf16_t*)v_in,
                      QKV_PASS);
}
