// One decode step of several requests at one layer, in one launch: each request's new K/V
// row written into its own cache (f16) and its query row attending to that cache's rows
// 0..=pos. The device engine's batched decode (target-engine/src/device/fused.rs) launches it
// once per layer instead of a few ops per request. Compiled at run time by NVRTC after
// common.cuh; run on the CPU by the suite under kernels/tests/cuda_emu/
// (kernels/tests/flash_attention_emulated.rs).
//
// Layouts (contiguous):
//   q            (r, n_head, HD) f32       one query row per request, RoPE applied
//   k_new, v_new (r, n_kv_head, HD) f32    the rows' new K (rotated) and V
//   k_caches[i], v_caches[i]               request i's layer cache, (n_kv_head, caps[i], HD) f16
//   pos          (r) u32                   request i's row position (< caps[i])
//   out          (r, n_head, HD) f32
// Grid (r, n_head), 128 threads: four warps split the keys, each with its own online softmax,
// merged at the end. The new row is read from k_new/v_new rounded to f16 (what the cache
// holds), so no block waits for another's write; the first head of each group writes it.

#define DA_THREADS 128
#define DA_WARPS (DA_THREADS / 32)
// Dynamic shared memory a launch needs for head size `hd`.
#define DA_SHARED_BYTES(hd) (4 * DA_WARPS * (2 + (hd)))


template <int HD>
__device__ void decode_attention(const float* __restrict__ q, const float* __restrict__ k_new,
                                 const float* __restrict__ v_new,
                                 const unsigned long long* __restrict__ k_caches,
                                 const unsigned long long* __restrict__ v_caches,
                                 const unsigned* __restrict__ caps,
                                 const unsigned* __restrict__ pos, float* __restrict__ out,
                                 int n_head, int n_kv_head, float scale) {
    // Each lane holds HD / 32 consecutive dimensions. Dynamic shared memory
    // (DA_SHARED_BYTES): each warp's running max, sum and output, merged at the end.
    const int PER = HD / 32;
    float* part_m = (float*)smem;
    float* part_l = part_m + DA_WARPS;
    float* part_o = part_l + DA_WARPS;  // [DA_WARPS][HD]
    const int r = blockIdx.x, head = blockIdx.y;
    // A launch this layout does not fit, or a row past its cache: a NaN output row and no
    // write (the engine's check at load sees it; a trap would leave the context unusable).
    if (dynamic_smem_bytes() < DA_SHARED_BYTES(HD) || blockDim.x != DA_THREADS ||
        pos[r] >= caps[r]) {
        for (int d = threadIdx.x; d < HD; d += blockDim.x)
            out[((size_t)r * n_head + head) * HD + d] = __int_as_float(0x7fc00000);
        return;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = n_head / n_kv_head;
    const int kv_head = head / group;
    const int p = (int)pos[r];
    const size_t cap = caps[r];
    unsigned short* kc = (unsigned short*)k_caches[r] + (size_t)kv_head * cap * HD;
    unsigned short* vc = (unsigned short*)v_caches[r] + (size_t)kv_head * cap * HD;
    const float* kn = k_new + ((size_t)r * n_kv_head + kv_head) * HD;
    const float* vn = v_new + ((size_t)r * n_kv_head + kv_head) * HD;
    const float* qr = q + ((size_t)r * n_head + head) * HD;
    const float qscale = scale * 1.4426950408889634f;

    // The new row as the cache holds it; the group's first head writes it.
    if (head % group == 0) {
        for (int d = tid; d < HD; d += DA_THREADS) {
            kc[(size_t)p * HD + d] = f16_bits(kn[d]);
            vc[(size_t)p * HD + d] = f16_bits(vn[d]);
        }
    }

    float qv[PER], o[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) {
        qv[i] = qr[lane * PER + i] * qscale;
        o[i] = 0.f;
    }
    const float neg_inf = __int_as_float(0xff800000);
    float m = neg_inf, l = 0.f;
    for (int j = warp; j <= p; j += DA_WARPS) {
        float kj[PER], vj[PER];
        if (j == p) {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                kj[i] = f16_value(f16_bits(kn[lane * PER + i]));
                vj[i] = f16_value(f16_bits(vn[lane * PER + i]));
            }
        } else {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                kj[i] = f16_value(kc[(size_t)j * HD + lane * PER + i]);
                vj[i] = f16_value(vc[(size_t)j * HD + lane * PER + i]);
            }
        }
        float dot = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) dot += qv[i] * kj[i];
        const float s = warp_sum(dot);
        const float mn = fmaxf(m, s);
        const float a = exp2f(m - mn), e = exp2f(s - mn);
        l = l * a + e;
#pragma unroll
        for (int i = 0; i < PER; ++i) o[i] = o[i] * a + e * vj[i];
        m = mn;
    }
    // A warp that saw no key (p < warp) keeps m = -inf and l = 0: its weight below is 0.
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) part_o[warp * HD + lane * PER + i] = o[i];
    __syncthreads();
    float top = neg_inf;
    for (int w = 0; w < DA_WARPS; ++w) top = fmaxf(top, part_m[w]);
    float total = 0.f, weight[DA_WARPS];
    for (int w = 0; w < DA_WARPS; ++w) {
        weight[w] = part_l[w] > 0.f ? exp2f(part_m[w] - top) : 0.f;
        total += part_l[w] * weight[w];
    }
    for (int d = tid; d < HD; d += DA_THREADS) {
        float acc = 0.f;
        for (int w = 0; w < DA_WARPS; ++w) acc += part_o[w * HD + d] * weight[w];
        out[((size_t)r * n_head + head) * HD + d] = acc / total;
    }
}

#define DA_ENTRY(HD)                                                                         \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attention_##HD(          \
        const float* q, const float* k_new, const float* v_new,                              \
        const unsigned long long* k_caches, const unsigned long long* v_caches,              \
        const unsigned* caps, const unsigned* pos, float* out, int n_head, int n_kv_head,    \
        float scale) {                                                                       \
        decode_attention<HD>(q, k_new, v_new, k_caches, v_caches, caps, pos, out, n_head,    \
                             n_kv_head, scale);                                              \
    }

DA_ENTRY(64)
DA_ENTRY(128)
