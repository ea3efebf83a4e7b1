// Fused causal attention for the device engine: any query rows at any absolute positions
// against a position-indexed f32 KV cache with grouped query heads. One pass over the keys
// with an online softmax (FlashAttention-2's order), so no score matrix reaches memory; the
// products run on tensor cores (mma.sync m16n8k16, f16 in, f32 accumulate).
//
// Compiled at run time by NVRTC on the GPU machine (no build cost on the build machine), after
// common.cuh in one program with the other kernels here, and on the CPU by the suite as plain
// C++ with SPECRAG_EMULATE defined: kernels/tests/cuda_emu/
// then runs every thread of a block as an OS thread and gives mma.sync and the warp shuffle
// the register layouts the PTX ISA documents, so this very source is checked against a
// reference without a GPU (kernels/tests/flash_attention_emulated.rs).
//
// Layouts (all contiguous):
//   q    (n, n_head, HD) f32      the pass's query rows, RoPE applied
//   k, v (n_kv_head, cap, HD) f16 the layer's cache (IEEE half bits), row = absolute position
//   pos  (n) u32                  each query row's position; it reads keys 0..=pos
//   out  (n, n_head, HD) f32, or bf16 bits (the `_bf16` entry points)
// Grid (ceil(n / 64), n_head), 128 threads: each warp owns 16 query rows of one head.

#define FA_ROWS 64
#define FA_KEYS 64
#define FA_THREADS 128

// Dynamic shared memory a launch needs for head size `hd`: keys and values [64][hd + 8] in
// f16, 64 row positions and the tile's key count.
#define FA_SHARED_BYTES(hd) (2 * 2 * FA_KEYS * ((hd) + 8) + 4 * (FA_ROWS + 1))


__device__ __forceinline__ unsigned pack_f16x2(float lo, float hi) {
    return (unsigned)f16_bits(lo) | ((unsigned)f16_bits(hi) << 16);
}

// Two consecutive f16 of shared memory as one register (the lower index in the low half).
__device__ __forceinline__ unsigned ld_f16x2(const unsigned short* p) {
    return (unsigned)p[0] | ((unsigned)p[1] << 16);
}

template <int HD, class Out>
__device__ void flash_attention(const float* __restrict__ q, const unsigned short* __restrict__ k,
                                const unsigned short* __restrict__ v,
                                const unsigned* __restrict__ pos,
                                Out* __restrict__ out, int n, int n_head, int n_kv_head,
                                int cap, float scale) {
    // Keys (and the query staging) and values as f16, [FA_KEYS][KS] each: rows padded by 8
    // halves (16 bytes) so that a warp's fragment loads fall in distinct banks.
    const int KS = HD + 8;
    unsigned short* ks = (unsigned short*)smem;
    unsigned short* vs = ks + FA_KEYS * KS;
    int* rows_pos = (int*)(vs + FA_KEYS * KS);
    int* top = rows_pos + FA_ROWS;

    const int tid = threadIdx.x;
    const int warp = tid >> 5, lane = tid & 31;
    const int g = lane >> 2, t = lane & 3;
    const int row0 = blockIdx.x * FA_ROWS;
    const int head = blockIdx.y;
    // A launch this layout does not fit (too little shared memory, another block size) gets
    // NaN rows and writes nothing else: the engine's check at load sees it and attends with
    // candle ops (a trap would leave the context unusable for them too).
    if (dynamic_smem_bytes() < FA_SHARED_BYTES(HD) || blockDim.x != FA_THREADS) {
        for (int i = tid; i < FA_ROWS * HD; i += blockDim.x) {
            if (row0 + i / HD < n)
                store(out + ((size_t)(row0 + i / HD) * n_head + head) * HD + i % HD,
                      __int_as_float(0x7fc00000));
        }
        return;
    }
    const int kv_head = head / (n_head / n_kv_head);
    const unsigned short* kh = k + (size_t)kv_head * cap * HD;
    const unsigned short* vh = v + (size_t)kv_head * cap * HD;
    // exp2 instead of exp: the softmax scale carries log2(e).
    const float qscale = scale * 1.4426950408889634f;

    // Positions of the tile's rows, at most the cache's last row (as the reference reads
    // them); rows past n read key 0 only and are not written.
    if (tid < FA_ROWS) {
        int r = row0 + tid;
        rows_pos[tid] = r >= n ? 0 : pos[r] < (unsigned)cap ? (int)pos[r] : cap - 1;
    }
    if (tid == 0) *top = 0;
    __syncthreads();
    if (tid < FA_ROWS) atomicMax(top, rows_pos[tid] + 1);

    // The query rows, scaled, staged as f16 through the key buffer.
    for (int i = tid; i < FA_ROWS * (HD / 4); i += FA_THREADS) {
        int r = i / (HD / 4), d = (i % (HD / 4)) * 4;
        float4 x;
        x.x = x.y = x.z = x.w = 0.f;
        if (row0 + r < n) x = *(const float4*)(q + ((size_t)(row0 + r) * n_head + head) * HD + d);
        unsigned short* dst = ks + r * KS + d;
        dst[0] = f16_bits(x.x * qscale);
        dst[1] = f16_bits(x.y * qscale);
        dst[2] = f16_bits(x.z * qscale);
        dst[3] = f16_bits(x.w * qscale);
    }
    __syncthreads();
    const int keys_end = *top;
    // This warp's 16 rows as A fragments, one per 16 columns of HD.
    unsigned qa[HD / 16][4];
    const int ra = warp * 16 + g;
#pragma unroll
    for (int s = 0; s < HD / 16; ++s) {
        qa[s][0] = ld_f16x2(ks + ra * KS + s * 16 + 2 * t);
        qa[s][1] = ld_f16x2(ks + (ra + 8) * KS + s * 16 + 2 * t);
        qa[s][2] = ld_f16x2(ks + ra * KS + s * 16 + 2 * t + 8);
        qa[s][3] = ld_f16x2(ks + (ra + 8) * KS + s * 16 + 2 * t + 8);
    }
    const int p0 = rows_pos[ra], p1 = rows_pos[ra + 8];

    const float neg_inf = __int_as_float(0xff800000);
    float o[HD / 8][4];
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
    float m0 = neg_inf, m1 = neg_inf, l0 = 0.f, l1 = 0.f;

    for (int k0 = 0; k0 < keys_end; k0 += FA_KEYS) {
        __syncthreads();  // every warp is done with the previous tile (and the query staging)
        // The tile's keys and values, 8 halves (16 bytes) a thread and step; rows past the
        // last one read are zeros (they may hold anything, NaN included).
        for (int i = tid; i < FA_KEYS * (HD / 8); i += FA_THREADS) {
            int j = i / (HD / 8), d = (i % (HD / 8)) * 8;
            uint4 x, y;
            x.x = x.y = x.z = x.w = 0u;
            y = x;
            if (k0 + j < keys_end) {
                x = *(const uint4*)(kh + (size_t)(k0 + j) * HD + d);
                y = *(const uint4*)(vh + (size_t)(k0 + j) * HD + d);
            }
            *(uint4*)(ks + j * KS + d) = x;
            *(uint4*)(vs + j * KS + d) = y;
        }
        __syncthreads();

        // Scores of this warp's 16 rows against the tile's 64 keys, 8 keys per accumulator.
        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; ++j) {
            s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
            const unsigned short* kr = ks + (j * 8 + g) * KS + 2 * t;
#pragma unroll
            for (int c = 0; c < HD / 16; ++c) {
                unsigned b[2] = {ld_f16x2(kr + c * 16), ld_f16x2(kr + c * 16 + 8)};
                mma_16816(s[j], qa[c], b);
            }
        }
        // Causal by position: key k0 + 8j + 2t (+1) against rows g (s[j][0..1]) and g + 8
        // (s[j][2..3]).
        float mx0 = neg_inf, mx1 = neg_inf;
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; ++j) {
            int key = k0 + j * 8 + 2 * t;
            if (key > p0) s[j][0] = neg_inf;
            if (key + 1 > p0) s[j][1] = neg_inf;
            if (key > p1) s[j][2] = neg_inf;
            if (key + 1 > p1) s[j][3] = neg_inf;
            mx0 = fmaxf(mx0, fmaxf(s[j][0], s[j][1]));
            mx1 = fmaxf(mx1, fmaxf(s[j][2], s[j][3]));
        }
        // Every row reads key 0 in the first tile, so the running maxima are finite from then.
        const float n0 = fmaxf(m0, quad_max(mx0)), n1 = fmaxf(m1, quad_max(mx1));
        const float a0 = exp2f(m0 - n0), a1 = exp2f(m1 - n1);
        m0 = n0;
        m1 = n1;
        float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
        for (int j = 0; j < FA_KEYS / 8; ++j) {
            s[j][0] = exp2f(s[j][0] - n0);
            s[j][1] = exp2f(s[j][1] - n0);
            s[j][2] = exp2f(s[j][2] - n1);
            s[j][3] = exp2f(s[j][3] - n1);
            sum0 += s[j][0] + s[j][1];
            sum1 += s[j][2] + s[j][3];
        }
        // Per-lane partial sums; the quad's are added once at the end.
        l0 = l0 * a0 + sum0;
        l1 = l1 * a1 + sum1;
#pragma unroll
        for (int j = 0; j < HD / 8; ++j) {
            o[j][0] *= a0;
            o[j][1] *= a0;
            o[j][2] *= a1;
            o[j][3] *= a1;
        }
        // The probabilities are already laid out as A fragments: 16 keys = two accumulators.
#pragma unroll
        for (int c = 0; c < FA_KEYS / 16; ++c) {
            unsigned pa[4] = {pack_f16x2(s[2 * c][0], s[2 * c][1]),
                              pack_f16x2(s[2 * c][2], s[2 * c][3]),
                              pack_f16x2(s[2 * c + 1][0], s[2 * c + 1][1]),
                              pack_f16x2(s[2 * c + 1][2], s[2 * c + 1][3])};
#pragma unroll
            for (int j = 0; j < HD / 8; ++j) {
                // B is V's keys c * 16 + 2t, +1 (and + 8, + 9) at dimension j * 8 + g: two
                // rows per register.
                const unsigned short* vc = vs + (c * 16 + 2 * t) * KS + j * 8 + g;
                unsigned b[2] = {(unsigned)vc[0] | ((unsigned)vc[KS] << 16),
                                 (unsigned)vc[8 * KS] | ((unsigned)vc[9 * KS] << 16)};
                mma_16816(o[j], pa, b);
            }
        }
    }

    l0 = quad_sum(l0);
    l1 = quad_sum(l1);
    const int r0 = row0 + ra, r1 = r0 + 8;
#pragma unroll
    for (int j = 0; j < HD / 8; ++j) {
        int d = j * 8 + 2 * t;
        if (r0 < n) {
            Out* dst = out + ((size_t)r0 * n_head + head) * HD + d;
            store(dst, o[j][0] / l0);
            store(dst + 1, o[j][1] / l0);
        }
        if (r1 < n) {
            Out* dst = out + ((size_t)r1 * n_head + head) * HD + d;
            store(dst, o[j][2] / l1);
            store(dst + 1, o[j][3] / l1);
        }
    }
}


#define FA_ENTRY(HD, SUFFIX, OUT)                                                           \
    extern "C" __global__ void __launch_bounds__(FA_THREADS)                                \
        flash_attention_##HD##SUFFIX(const float* q, const unsigned short* k,               \
                                     const unsigned short* v, const unsigned* pos, OUT* out, \
                                     int n, int n_head, int n_kv_head, int cap,             \
                                     float scale) {                                         \
        flash_attention<HD, OUT>(q, k, v, pos, out, n, n_head, n_kv_head, cap, scale);      \
    }

// The output in f32, or as bf16 (the output projection's input, `_bf16`).
FA_ENTRY(64, , float)
FA_ENTRY(128, , float)
FA_ENTRY(64, _bf16, bf16_t)
FA_ENTRY(128, _bf16, bf16_t)
