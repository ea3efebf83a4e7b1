// One decode step of several requests at one layer, in one launch: each request's new K/V
// row written into its own cache (f16) and its query row attending to that cache's rows
// 0..=pos. The device engine's batched decode (target-engine/src/device/fused.rs) launches it
// once per layer instead of a few ops per request. Compiled at run time by NVRTC after
// common.cuh; run on the CPU by the suite under kernels/tests/cuda_emu/
// (kernels/tests/flash_attention_emulated.rs).
//
// Layouts (contiguous):
//   q            r rows of (n_head, HD) f32, row stride ld_q: one query row per request, RoPE
//                applied
//   k_new, v_new r rows of (n_kv_head, HD) f32, row stride ld_kv: the new K (rotated) and V
//                (column ranges of qkv_epilogue.cu's rows, or contiguous)
//   k_caches[i], v_caches[i]               request i's layer cache, (n_kv_head, caps[i], HD) f16
//   pos          (r) u32                   request i's row position (< caps[i])
//   out          (r, n_head, HD) f32, or bf16 bits (the `_bf16` entry points)
//   part         (r, n_head, splits, HD + 2) f32, with splits > 1 only: each split's running
//                max, sum and unnormalized output, merged by decode_merge
// Grid (r, n_head, splits), 128 threads. A request's keys 0..=pos are cut into `splits`
// consecutive ranges, one per block (split-K, as flash-decoding does: one request at a few
// heads would otherwise keep a handful of SMs busy over a long cache); inside a block four
// warps split the range, each with its own online softmax, merged at the end. With one split
// the block writes `out` itself; with more, decode_merge weighs the splits into `out`. The
// new row is read from k_new/v_new rounded to f16 (what the cache holds), so no block waits
// for another's write; split 0 of the first head of each group writes it.

#define DA_THREADS 128
#define DA_WARPS (DA_THREADS / 32)
// Dynamic shared memory a launch needs for head size `hd`.
#define DA_SHARED_BYTES(hd) (4 * DA_WARPS * (2 + (hd)))


template <int HD, class Out>
__device__ void decode_attention(const float* __restrict__ q, const float* __restrict__ k_new,
                                 const float* __restrict__ v_new,
                                 const unsigned long long* __restrict__ k_caches,
                                 const unsigned long long* __restrict__ v_caches,
                                 const unsigned* __restrict__ caps,
                                 const unsigned* __restrict__ pos, Out* __restrict__ out,
                                 float* __restrict__ part, int ld_q, int ld_kv, int n_head,
                                 int n_kv_head, int splits, float scale) {
    // Each lane holds HD / 32 consecutive dimensions. Dynamic shared memory
    // (DA_SHARED_BYTES): each warp's running max, sum and output, merged at the end.
    const int PER = HD / 32;
    float* part_m = (float*)smem;
    float* part_l = part_m + DA_WARPS;
    float* part_o = part_l + DA_WARPS;  // [DA_WARPS][HD]
    const int r = blockIdx.x, head = blockIdx.y, split = blockIdx.z;
    // A launch this layout does not fit, or a row past its cache: a NaN output row and no
    // write (the engine's check at load sees it; a trap would leave the context unusable).
    // With several splits the NaN goes into the split's part, which decode_merge carries on.
    if (dynamic_smem_bytes() < DA_SHARED_BYTES(HD) || blockDim.x != DA_THREADS ||
        pos[r] >= caps[r] || splits < 1 || (int)gridDim.z != splits) {
        if (splits > 1 && split >= splits) return;
        // Words whose bits are a NaN as f32 and as two bf16 halves alike.
        const float nan = __int_as_float(0x7fc07fc0);
        const int words = splits > 1 ? HD + 2 : HD * (int)sizeof(Out) / 4;
        float* dst = splits > 1 ? part + (((size_t)r * n_head + head) * splits + split) * (HD + 2)
                                : (float*)(out + ((size_t)r * n_head + head) * HD);
        for (int d = threadIdx.x; d < words; d += blockDim.x) dst[d] = nan;
        return;
    }
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int group = n_head / n_kv_head;
    const int kv_head = head / group;
    const int p = (int)pos[r];
    const size_t cap = caps[r];
    unsigned short* kc = (unsigned short*)k_caches[r] + (size_t)kv_head * cap * HD;
    unsigned short* vc = (unsigned short*)v_caches[r] + (size_t)kv_head * cap * HD;
    const float* kn = k_new + (size_t)r * ld_kv + (size_t)kv_head * HD;
    const float* vn = v_new + (size_t)r * ld_kv + (size_t)kv_head * HD;
    const float* qr = q + (size_t)r * ld_q + (size_t)head * HD;
    const float qscale = scale * 1.4426950408889634f;

    // This block's keys: split `split` of 0..=p cut into `splits` ranges of `per` keys (the
    // last ones may be short or empty).
    const int per = (p + splits) / splits;  // ceil((p + 1) / splits)
    const int first = split * per, last = p + 1 < first + per ? p + 1 : first + per;

    // The new row as the cache holds it; split 0 of the group's first head writes it.
    if (head % group == 0 && split == 0) {
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
    for (int j = first + warp; j < last; j += DA_WARPS) {
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
    // A warp that saw no key keeps m = -inf and l = 0: its weight below is 0.
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = l;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) part_o[warp * HD + lane * PER + i] = o[i];
    __syncthreads();
    // Unrolled, so that `weight` stays in registers.
    float top = neg_inf;
#pragma unroll
    for (int w = 0; w < DA_WARPS; ++w) top = fmaxf(top, part_m[w]);
    float total = 0.f, weight[DA_WARPS];
#pragma unroll
    for (int w = 0; w < DA_WARPS; ++w) {
        weight[w] = part_l[w] > 0.f ? exp2f(part_m[w] - top) : 0.f;
        total += part_l[w] * weight[w];
    }
    if (splits == 1) {
        for (int d = tid; d < HD; d += DA_THREADS) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < DA_WARPS; ++w) acc += part_o[w * HD + d] * weight[w];
            store(out + ((size_t)r * n_head + head) * HD + d, acc / total);
        }
        return;
    }
    // The split's (max, sum, output) relative to its max; an empty split's sum is 0.
    float* dst = part + (((size_t)r * n_head + head) * splits + split) * (HD + 2);
    if (tid == 0) {
        dst[0] = top;
        dst[1] = total;
    }
    for (int d = tid; d < HD; d += DA_THREADS) {
        float acc = 0.f;
#pragma unroll
        for (int w = 0; w < DA_WARPS; ++w) acc += part_o[w * HD + d] * weight[w];
        dst[2 + d] = acc;
    }
}

// The splits of decode_attention weighed into one output row per request and head. Grid
// (r, n_head), 128 threads; `part` and `out` as above.
template <int HD, class Out>
__device__ void decode_merge(const float* __restrict__ part, Out* __restrict__ out,
                             int n_head, int splits) {
    const int r = blockIdx.x, head = blockIdx.y;
    const float* src = part + ((size_t)r * n_head + head) * splits * (HD + 2);
    const float neg_inf = __int_as_float(0xff800000);
    float top = neg_inf;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, src[(size_t)s * (HD + 2)]);
    float total = 0.f;
    for (int s = 0; s < splits; ++s) {
        const float* sp = src + (size_t)s * (HD + 2);
        // A NaN part (a misfit block) makes the row NaN; an empty split weighs nothing.
        if (sp[1] != 0.f || sp[1] != sp[1]) total += sp[1] * exp2f(sp[0] - top);
    }
    for (int d = threadIdx.x; d < HD; d += blockDim.x) {
        float acc = 0.f;
        for (int s = 0; s < splits; ++s) {
            const float* sp = src + (size_t)s * (HD + 2);
            if (sp[1] != 0.f || sp[1] != sp[1]) acc += sp[2 + d] * exp2f(sp[0] - top);
        }
        store(out + ((size_t)r * n_head + head) * HD + d, acc / total);
    }
}

#define DA_ENTRY(HD, SUFFIX, OUT)                                                            \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_attention_##HD##SUFFIX(  \
        const float* q, const float* k_new, const float* v_new,                              \
        const unsigned long long* k_caches, const unsigned long long* v_caches,              \
        const unsigned* caps, const unsigned* pos, OUT* out, float* part, int ld_q,          \
        int ld_kv, int n_head, int n_kv_head, int splits, float scale) {                     \
        decode_attention<HD, OUT>(q, k_new, v_new, k_caches, v_caches, caps, pos, out, part, \
                                  ld_q, ld_kv, n_head, n_kv_head, splits, scale);            \
    }                                                                                        \
    extern "C" __global__ void __launch_bounds__(DA_THREADS) decode_merge_##HD##SUFFIX(      \
        const float* part, OUT* out, int n_head, int splits) {                               \
        decode_merge<HD, OUT>(part, out, n_head, splits);                                    \
    }

// The output in f32, or as bf16 (the output projection's input, `_bf16`).
DA_ENTRY(64, , float)
DA_ENTRY(128, , float)
DA_ENTRY(64, _bf16, bf16_t)
DA_ENTRY(128, _bf16, bf16_t)
