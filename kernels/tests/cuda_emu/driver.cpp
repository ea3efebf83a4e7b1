// Runs the kernels of kernels/src/cuda under emu.h on random data and prints their largest
// difference from attention computed in f64 (kernels/tests/flash_attention_emulated.rs).
//
//   driver N N_HEAD N_KV_HEAD HEAD_DIM CAP LAYOUT SEED AMP
//
// LAYOUT, for flash_attention.cu: `prefill` (rows at CAP - N .. CAP), `scattered` (N distinct
// positions in random order), `decode` (N rows all at CAP - 1); for decode_attention.cu:
// `batch` (N requests, each its own cache of about CAP rows and its row at a random position,
// the new K/V written by the kernel: also checks that row and that no other changed), `split`
// (the same with each request's keys cut into 6 ranges, merged by decode_merge, and Q, K and V
// read as column ranges of one row per request). Cache
// rows past the last position read are NaN: a kernel that reads them shows it. AMP scales
// queries and keys (larger: peakier softmax). `misfit`: launches neither kernel's layout fits
// (flash with half its threads; decode with a row past its cache): every output must be NaN
// and no cache value written.
#define SPECRAG_EMULATE
#include "emu.h"
#include "../../src/cuda/common.cuh"
// In the order the engine compiles them (target-engine/src/device/fused.rs).
#include "../../src/cuda/decode_attention.cu"
#include "../../src/cuda/flash_attention.cu"
#include "../../src/cuda/norm_bf16.cu"
#include "../../src/cuda/qkv_epilogue.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>

// f64 attention of query row `qi` over keys/values 0..=p of one kv head (rows of `hd`).
static void reference(const float* qi, const float* k, const float* v, unsigned p, int hd,
                      double scale, std::vector<double>& out) {
    std::vector<double> s(p + 1);
    double m = -INFINITY;
    for (unsigned j = 0; j <= p; ++j) {
        double dot = 0;
        for (int d = 0; d < hd; ++d) dot += (double)qi[d] * k[(size_t)j * hd + d];
        s[j] = dot * scale;
        m = std::max(m, s[j]);
    }
    double sum = 0;
    for (auto& x : s) sum += (x = std::exp(x - m));
    out.assign(hd, 0.0);
    for (unsigned j = 0; j <= p; ++j) {
        for (int d = 0; d < hd; ++d) out[d] += s[j] / sum * v[(size_t)j * hd + d];
    }
}

// `batch`: decode_attention over `r` requests with caches of different sizes, its keys in
// `splits` ranges (more than 1: merged by decode_merge).
static int run_batch(int r, int nh, int nkv, int hd, int cap0, int splits, std::mt19937& rng,
                     float amp) {
    std::uniform_real_distribution<float> unit(-1.f, 1.f);
    const float scale = 1.f / std::sqrt((float)hd);
    std::vector<unsigned> caps(r), pos(r);
    std::vector<std::vector<unsigned short>> kc(r), vc(r), kc0(r), vc0(r);
    std::vector<unsigned long long> kp(r), vp(r);
    std::vector<float> q((size_t)r * nh * hd), kn((size_t)r * nkv * hd), vn(kn.size());
    for (auto& x : q) x = amp * unit(rng);
    for (auto& x : kn) x = amp * unit(rng);
    for (auto& x : vn) x = unit(rng);
    for (int i = 0; i < r; ++i) {
        caps[i] = (unsigned)(cap0 + 7 * i);
        pos[i] = std::uniform_int_distribution<unsigned>(0, caps[i] - 1)(rng);
        size_t len = (size_t)nkv * caps[i] * hd;
        kc[i].resize(len);
        vc[i].resize(len);
        for (int h = 0; h < nkv; ++h) {
            for (unsigned row = 0; row < caps[i]; ++row) {
                for (int d = 0; d < hd; ++d) {
                    size_t at = ((size_t)h * caps[i] + row) * hd + d;
                    bool unread = row >= pos[i];  // pos's own row is written by the kernel
                    kc[i][at] = f16_bits(unread ? NAN : amp * unit(rng));
                    vc[i][at] = f16_bits(unread ? NAN : unit(rng));
                }
            }
        }
        kc0[i] = kc[i];
        vc0[i] = vc[i];
        kp[i] = (unsigned long long)kc[i].data();
        vp[i] = (unsigned long long)vc[i].data();
    }
    std::vector<float> out(q.size(), NAN), part((size_t)r * nh * splits * (hd + 2), NAN);
    // Split launches read Q, K and V as column ranges of one row per request (as the Q/K/V
    // epilogue's rows mode writes them); whole ones read them contiguous.
    const int wide = (nh + 2 * nkv) * hd;
    std::vector<float> packed((size_t)r * wide);
    for (int i = 0; i < r; ++i) {
        std::copy_n(&q[(size_t)i * nh * hd], nh * hd, &packed[(size_t)i * wide]);
        std::copy_n(&kn[(size_t)i * nkv * hd], nkv * hd, &packed[(size_t)i * wide + nh * hd]);
        std::copy_n(&vn[(size_t)i * nkv * hd], nkv * hd,
                    &packed[(size_t)i * wide + (nh + nkv) * hd]);
    }
    const bool strided = splits > 1;
    const float* qa = strided ? packed.data() : q.data();
    const float* ka = strided ? packed.data() + nh * hd : kn.data();
    const float* va = strided ? packed.data() + (nh + nkv) * hd : vn.data();
    const int ld_q = strided ? wide : nh * hd, ld_kv = strided ? wide : nkv * hd;
    dim3 grid{(unsigned)r, (unsigned)nh, (unsigned)splits};
    auto run = [&] {
        if (hd == 64) {
            decode_attention_64(qa, ka, va, kp.data(), vp.data(), caps.data(), pos.data(),
                                out.data(), part.data(), ld_q, ld_kv, nh, nkv, splits, scale);
        } else {
            decode_attention_128(qa, ka, va, kp.data(), vp.data(), caps.data(), pos.data(),
                                 out.data(), part.data(), ld_q, ld_kv, nh, nkv, splits, scale);
        }
    };
    emu::launch(grid, DA_THREADS, DA_SHARED_BYTES(hd), run);
    if (splits > 1) {
        emu::launch(dim3{(unsigned)r, (unsigned)nh, 1}, DA_THREADS, 0, [&] {
            if (hd == 64) {
                decode_merge_64(part.data(), out.data(), nh, splits);
            } else {
                decode_merge_128(part.data(), out.data(), nh, splits);
            }
        });
    }
    // The bf16 entry points (run again: the rows they write are the same): each output the
    // f32 one's rounding.
    std::vector<bf16_t> out16(q.size());
    emu::launch(grid, DA_THREADS, DA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            decode_attention_64_bf16(qa, ka, va, kp.data(), vp.data(), caps.data(), pos.data(),
                                     out16.data(), part.data(), ld_q, ld_kv, nh, nkv, splits,
                                     scale);
        } else {
            decode_attention_128_bf16(qa, ka, va, kp.data(), vp.data(), caps.data(), pos.data(),
                                      out16.data(), part.data(), ld_q, ld_kv, nh, nkv, splits,
                                      scale);
        }
    });
    if (splits > 1) {
        emu::launch(dim3{(unsigned)r, (unsigned)nh, 1}, DA_THREADS, 0, [&] {
            if (hd == 64) {
                decode_merge_64_bf16(part.data(), out16.data(), nh, splits);
            } else {
                decode_merge_128_bf16(part.data(), out16.data(), nh, splits);
            }
        });
    }
    int bad_bf16 = 0;
    for (size_t i = 0; i < out.size(); ++i) bad_bf16 += out16[i].bits != bf16_bits(out[i]);

    double max_err = 0, max_ref = 0;
    int bad_rows = 0;
    const int group = nh / nkv;
    std::vector<double> ref;
    for (int i = 0; i < r; ++i) {
        for (int h = 0; h < nkv; ++h) {
            for (unsigned row = 0; row < caps[i]; ++row) {
                for (int d = 0; d < hd; ++d) {
                    size_t at = ((size_t)h * caps[i] + row) * hd + d;
                    unsigned short want_k = kc0[i][at], want_v = vc0[i][at];
                    if (row == pos[i]) {
                        want_k = f16_bits(kn[((size_t)i * nkv + h) * hd + d]);
                        want_v = f16_bits(vn[((size_t)i * nkv + h) * hd + d]);
                    }
                    if (kc[i][at] != want_k || vc[i][at] != want_v) ++bad_rows;
                }
            }
        }
        for (int h = 0; h < nh; ++h) {
            const int kvh = h / group;
            std::vector<float> k((size_t)(pos[i] + 1) * hd), v(k.size());
            for (unsigned j = 0; j <= pos[i]; ++j) {
                for (int d = 0; d < hd; ++d) {
                    size_t at = ((size_t)kvh * caps[i] + j) * hd + d;
                    k[(size_t)j * hd + d] = emu::f16_to_f32(kc[i][at]);
                    v[(size_t)j * hd + d] = emu::f16_to_f32(vc[i][at]);
                }
            }
            reference(&q[((size_t)i * nh + h) * hd], k.data(), v.data(), pos[i], hd, scale, ref);
            for (int d = 0; d < hd; ++d) {
                double got = out[((size_t)i * nh + h) * hd + d];
                double err = std::isfinite(got) ? std::fabs(got - ref[d]) : INFINITY;
                max_err = std::max(max_err, err);
                max_ref = std::max(max_ref, std::fabs(ref[d]));
            }
        }
    }
    std::printf("max_err=%.6g max_ref=%.6g bad_cache_values=%d bad_bf16=%d\n", max_err, max_ref,
                bad_rows, bad_bf16);
    return 0;
}

// `misfit`: prints how many outputs are not NaN and how many cache values changed.
static int run_misfit(int nh, int nkv, int hd, int cap) {
    const int n = 70;
    std::vector<float> q((size_t)n * nh * hd, 0.5f), out(q.size(), 0.f);
    std::vector<unsigned short> k((size_t)nkv * cap * hd, f16_bits(0.25f)), v(k), k0(k), v0(k);
    std::vector<unsigned> pos(n);
    for (int i = 0; i < n; ++i) pos[i] = (unsigned)(i % cap);
    const float scale = 1.f / std::sqrt((float)hd);
    dim3 grid{(unsigned)((n + FA_ROWS - 1) / FA_ROWS), (unsigned)nh, 1};
    emu::launch(grid, FA_THREADS / 2, FA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            flash_attention_64(q.data(), k.data(), v.data(), pos.data(), out.data(), n, nh, nkv,
                               cap, scale);
        } else {
            flash_attention_128(q.data(), k.data(), v.data(), pos.data(), out.data(), n, nh,
                                nkv, cap, scale);
        }
    });
    int finite = 0;
    for (float x : out) finite += !std::isnan(x);
    // One request whose row is its cache's capacity: nothing may be written.
    std::vector<float> kn((size_t)nkv * hd, 1.f), vn(kn), dout((size_t)nh * hd, 0.f);
    unsigned long long kp = (unsigned long long)k.data(), vp = (unsigned long long)v.data();
    unsigned caps = (unsigned)cap, row = (unsigned)cap;
    emu::launch(dim3{1, (unsigned)nh, 1}, DA_THREADS, DA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            decode_attention_64(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                dout.data(), nullptr, nh * hd, nkv * hd, nh, nkv, 1, scale);
        } else {
            decode_attention_128(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                 dout.data(), nullptr, nh * hd, nkv * hd, nh, nkv, 1, scale);
        }
    });
    for (float x : dout) finite += !std::isnan(x);
    // The bf16 output: every value a NaN too.
    std::vector<bf16_t> dout16((size_t)nh * hd, bf16_t{0});
    emu::launch(dim3{1, (unsigned)nh, 1}, DA_THREADS, DA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            decode_attention_64_bf16(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                     dout16.data(), nullptr, nh * hd, nkv * hd, nh, nkv, 1,
                                     scale);
        } else {
            decode_attention_128_bf16(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                      dout16.data(), nullptr, nh * hd, nkv * hd, nh, nkv, 1,
                                      scale);
        }
    });
    for (auto x : dout16) finite += !std::isnan(bf16_value(x.bits));
    // The same row in three splits: every part NaN, so the merged row is too.
    std::vector<float> part((size_t)nh * 3 * (hd + 2), 0.f);
    std::fill(dout.begin(), dout.end(), 0.f);
    emu::launch(dim3{1, (unsigned)nh, 3}, DA_THREADS, DA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            decode_attention_64(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                dout.data(), part.data(), nh * hd, nkv * hd, nh, nkv, 3, scale);
        } else {
            decode_attention_128(q.data(), kn.data(), vn.data(), &kp, &vp, &caps, &row,
                                 dout.data(), part.data(), nh * hd, nkv * hd, nh, nkv, 3, scale);
        }
    });
    emu::launch(dim3{1, (unsigned)nh, 1}, DA_THREADS, 0, [&] {
        if (hd == 64) {
            decode_merge_64(part.data(), dout.data(), nh, 3);
        } else {
            decode_merge_128(part.data(), dout.data(), nh, 3);
        }
    });
    for (float x : dout) finite += !std::isnan(x);
    int changed = (k != k0) + (v != v0);
    std::printf("max_err=0 max_ref=1 finite_outputs=%d bad_cache_values=%d\n", finite, changed);
    return 0;
}

// `epilogue`: qkv_epilogue over n rows at distinct positions of a cache of `cap` rows (plus
// one row past it), inputs as column ranges of one product (row strides), biases, RoPE in both
// pair layouts; `epilogue16` the same with the product in bf16 (qkv_epilogue_bf16). Prints the
// largest difference of Q and of the cache rows from the reference (f16-rounded there), and
// how many other cache values changed, Q values of the row past the cache are not NaN, or
// values of the rows mode (Q, K, V in f32 per row) differ from the cache mode's.
static int run_epilogue(int n, int nh, int nkv, int hd, int cap, bool bf16_in,
                        std::mt19937& rng) {
    std::uniform_real_distribution<float> unit(-1.f, 1.f);
    const int half = hd / 2, total = (nh + 2 * nkv) * hd;
    double max_err = 0, max_ref = 0;
    int bad = 0;
    for (int interleaved = 0; interleaved < 2; ++interleaved) {
        std::vector<float> y((size_t)(n + 1) * total), bias(total), cs((size_t)(n + 1) * half),
            sn(cs.size());
        for (auto& x : y) x = 3.f * unit(rng);
        // A bf16 product: the kernel reads the bits, the reference their values.
        std::vector<unsigned short> y16(y.size());
        for (size_t i = 0; i < y.size(); ++i) {
            y16[i] = bf16_bits(y[i]);
            if (bf16_in) y[i] = bf16_value(y16[i]);
        }
        for (auto& x : bias) x = unit(rng);
        for (size_t i = 0; i < cs.size(); ++i) {
            float t = 6.f * unit(rng);
            cs[i] = std::cos(t);
            sn[i] = std::sin(t);
        }
        std::vector<unsigned> all(cap);
        for (int i = 0; i < cap; ++i) all[i] = (unsigned)i;
        std::shuffle(all.begin(), all.end(), rng);
        std::vector<unsigned> pos(all.begin(), all.begin() + n);
        pos.push_back((unsigned)cap);  // past the cache: nothing written, Q NaN
        std::vector<unsigned short> kc((size_t)nkv * cap * hd, f16_bits(7.f)), vc(kc), k0(kc),
            v0(kc);
        std::vector<float> q((size_t)(n + 1) * nh * hd, 0.f);
        const float* bq = bias.data();
        const float* bk = bias.data() + nh * hd;
        const float* bv = bk + nkv * hd;
        emu::launch(dim3{(unsigned)(n + 1), 1, 1}, 96, 0, [&] {
            if (bf16_in) {
                qkv_epilogue_bf16(y16.data(), y16.data() + nh * hd, y16.data() + (nh + nkv) * hd,
                                  total, total, total, bq, bk, bv, cs.data(), sn.data(),
                                  pos.data(), q.data(), nh * hd, 0, kc.data(), vc.data(), nh,
                                  nkv, hd, cap, interleaved);
            } else {
                qkv_epilogue(y.data(), y.data() + nh * hd, y.data() + (nh + nkv) * hd, total,
                             total, total, bq, bk, bv, cs.data(), sn.data(), pos.data(), q.data(),
                             nh * hd, 0, kc.data(), vc.data(), nh, nkv, hd, cap, interleaved);
            }
        });
        // Rows mode (a batched decode's rows): Q, then K and V in f32, in each output row. Q
        // must be the cache mode's bit for bit, and K and V what it wrote before rounding.
        std::vector<float> rows((size_t)n * total, NAN);
        emu::launch(dim3{(unsigned)n, 1, 1}, 96, 0, [&] {
            if (bf16_in) {
                qkv_epilogue_bf16(y16.data(), y16.data() + nh * hd, y16.data() + (nh + nkv) * hd,
                                  total, total, total, bq, bk, bv, cs.data(), sn.data(),
                                  pos.data(), rows.data(), total, 1, nullptr, nullptr, nh, nkv,
                                  hd, 0x7fffffff, interleaved);
            } else {
                qkv_epilogue(y.data(), y.data() + nh * hd, y.data() + (nh + nkv) * hd, total,
                             total, total, bq, bk, bv, cs.data(), sn.data(), pos.data(),
                             rows.data(), total, 1, nullptr, nullptr, nh, nkv, hd, 0x7fffffff,
                             interleaved);
            }
        });
        for (int r = 0; r < n; ++r) {
            const float* got = &rows[(size_t)r * total];
            for (int i = 0; i < nh * hd; ++i) {
                float want = q[(size_t)r * nh * hd + i];
                bad += std::memcmp(&got[i], &want, 4) != 0;
            }
            for (int i = 0; i < nkv * hd; ++i) {
                size_t at = ((size_t)(i / hd) * cap + pos[r]) * hd + i % hd;
                bad += f16_bits(got[nh * hd + i]) != kc[at];
                bad += f16_bits(got[(nh + nkv) * hd + i]) != vc[at];
            }
        }
        std::vector<char> k_written((size_t)nkv * cap * hd, 0), v_written(k_written);
        for (int r = 0; r <= n; ++r) {
            const float* row = &y[(size_t)r * total];
            for (int h = 0; h < nh + nkv; ++h) {
                const bool is_k = h >= nh;
                for (int m = 0; m < half; ++m) {
                    int a = interleaved ? 2 * m : m, b = interleaved ? 2 * m + 1 : m + half;
                    int at = h * hd;
                    double x = row[at + a] + bias[at + a], z = row[at + b] + bias[at + b];
                    double c = cs[(size_t)r * half + m], s = sn[(size_t)r * half + m];
                    double ra = x * c - z * s, rb = x * s + z * c;
                    if (r == n) {
                        if (!is_k) bad += !std::isnan(q[(size_t)r * nh * hd + at + a]);
                        continue;
                    }
                    if (is_k) {
                        size_t base = ((size_t)(h - nh) * cap + pos[r]) * hd;
                        double ga = emu::f16_to_f32(kc[base + a]), gb = emu::f16_to_f32(kc[base + b]);
                        max_err = std::max({max_err, std::fabs(ga - ra) / (1 + std::fabs(ra)),
                                            std::fabs(gb - rb) / (1 + std::fabs(rb))});
                        k_written[base + a] = k_written[base + b] = 1;
                    } else {
                        double ga = q[(size_t)r * nh * hd + at + a], gb = q[(size_t)r * nh * hd + at + b];
                        max_err = std::max({max_err, std::fabs(ga - ra), std::fabs(gb - rb)});
                        max_ref = std::max({max_ref, std::fabs(ra), std::fabs(rb)});
                    }
                }
            }
            if (r == n) continue;
            for (int i = 0; i < nkv * hd; ++i) {
                size_t at = ((size_t)(i / hd) * cap + pos[r]) * hd + i % hd;
                double want = row[(nh + nkv) * hd + i] + bias[(nh + nkv) * hd + i];
                double got = emu::f16_to_f32(vc[at]);
                max_err = std::max(max_err, std::fabs(got - want) / (1 + std::fabs(want)));
                v_written[at] = 1;
            }
        }
        for (size_t i = 0; i < kc.size(); ++i) {
            if (!k_written[i] && kc[i] != k0[i]) ++bad;
            if (!v_written[i] && vc[i] != v0[i]) ++bad;
        }
    }
    std::printf("max_err=%.6g max_ref=%.6g bad_cache_values=%d\n", max_err, max_ref, bad);
    return 0;
}

// `norms`: rms_norm_bf16, swiglu_bf16 and swiglu_bf16_in over N rows of CAP columns (SwiGLU's
// inputs read as column ranges of one product, f32 or bf16) against f64, rounded to bf16:
// prints the largest difference in bf16 units of the reference's magnitude, as max_err; and
// add_bf16 against the f32 sum, which it must equal bit for bit, and add_rms_norm_bf16
// against add_bf16 then rms_norm_bf16 (`bad_sums`).
static int run_norms(int n, int cols, std::mt19937& rng) {
    std::uniform_real_distribution<float> unit(-1.f, 1.f);
    std::vector<float> x((size_t)n * cols), w(cols), prod((size_t)n * 2 * cols);
    for (auto& v : x) v = 4.f * unit(rng);
    for (auto& v : w) v = 2.f * unit(rng);
    for (auto& v : prod) v = 5.f * unit(rng);
    std::vector<unsigned short> norm((size_t)n * cols), act(norm.size());
    const float eps = 1e-6f;
    emu::launch(dim3{(unsigned)n, 1, 1}, 128, 128,
                [&] { rms_norm_bf16(x.data(), w.data(), norm.data(), cols, eps); });
    emu::launch(dim3{(unsigned)n, 1, 1}, 96, 0, [&] {
        swiglu_bf16(prod.data(), prod.data() + cols, 2 * cols, 2 * cols, act.data(), cols);
    });
    // The same product as a bf16 GEMM gives it, and the residual sum.
    std::vector<unsigned short> prod16(prod.size()), act16(norm.size());
    for (size_t i = 0; i < prod.size(); ++i) prod16[i] = bf16_bits(prod[i]);
    emu::launch(dim3{(unsigned)n, 1, 1}, 96, 0, [&] {
        swiglu_bf16_in(prod16.data(), prod16.data() + cols, 2 * cols, 2 * cols, act16.data(),
                       cols);
    });
    std::vector<float> sum(x.size(), NAN);
    emu::launch(dim3{(unsigned)n, 1, 1}, 96, 0, [&] {
        add_bf16(x.data(), prod16.data() + cols, 2 * cols, sum.data(), cols);
    });
    int bad_sums = 0;
    // The add and the next RMSNorm in one launch, over a copy of the product (it writes the
    // norm over the product's own elements): the sum bit for bit as add_bf16's, the norm bit
    // for bit as rms_norm_bf16's of that sum.
    std::vector<unsigned short> fused16(prod16), fused_norm((size_t)n * cols);
    std::vector<float> fused_sum(x.size(), NAN);
    emu::launch(dim3{(unsigned)n, 1, 1}, 128, 128, [&] {
        add_rms_norm_bf16(x.data(), fused16.data() + cols, 2 * cols, w.data(), fused_sum.data(),
                          cols, eps);
    });
    emu::launch(dim3{(unsigned)n, 1, 1}, 128, 128,
                [&] { rms_norm_bf16(sum.data(), w.data(), fused_norm.data(), cols, eps); });
    for (int r = 0; r < n; ++r) {
        for (int i = 0; i < cols; ++i) {
            size_t at = (size_t)r * cols + i, in_prod = (size_t)r * 2 * cols;
            bad_sums += std::memcmp(&fused_sum[at], &sum[at], 4) != 0;
            bad_sums += fused16[in_prod + cols + i] != fused_norm[at];
            bad_sums += fused16[in_prod + i] != prod16[in_prod + i];  // the gate, untouched
        }
    }
    double max_err = 0, max_ref = 0;
    // Within one bf16 rounding of the f64 value (relative 2^-8), and a little for f32 sums.
    auto check = [&](double want, unsigned short got) {
        double g = bf16_value(got);
        double err = std::isfinite(g) ? std::fabs(g - want) / (std::fabs(want) * 0x1p-8 + 1e-6)
                                      : INFINITY;
        max_err = std::max(max_err, err);
        max_ref = std::max(max_ref, std::fabs(want));
    };
    for (int r = 0; r < n; ++r) {
        double ss = 0;
        for (int i = 0; i < cols; ++i) ss += (double)x[(size_t)r * cols + i] * x[(size_t)r * cols + i];
        double inv = 1.0 / std::sqrt(ss / cols + eps);
        for (int i = 0; i < cols; ++i) {
            check(x[(size_t)r * cols + i] * inv * w[i], norm[(size_t)r * cols + i]);
            double g = prod[(size_t)r * 2 * cols + i], u = prod[(size_t)r * 2 * cols + cols + i];
            check(g / (1 + std::exp(-g)) * u, act[(size_t)r * cols + i]);
            double g16 = bf16_value(prod16[(size_t)r * 2 * cols + i]);
            double u16 = bf16_value(prod16[(size_t)r * 2 * cols + cols + i]);
            check(g16 / (1 + std::exp(-g16)) * u16, act16[(size_t)r * cols + i]);
            float want = x[(size_t)r * cols + i] + (float)u16;
            bad_sums += sum[(size_t)r * cols + i] != want;
        }
    }
    std::printf("max_err=%.6g max_ref=%.6g bad_sums=%d\n", max_err, max_ref, bad_sums);
    return 0;
}

int main(int argc, char** argv) {
    if (argc != 9) {
        std::fprintf(stderr, "usage: driver N N_HEAD N_KV_HEAD HEAD_DIM CAP LAYOUT SEED AMP\n");
        return 2;
    }
    const int n = std::atoi(argv[1]), nh = std::atoi(argv[2]), nkv = std::atoi(argv[3]);
    const int hd = std::atoi(argv[4]), cap = std::atoi(argv[5]);
    const std::string layout = argv[6];
    std::mt19937 rng((unsigned)std::atoi(argv[7]));
    const float amp = (float)std::atof(argv[8]);
    std::uniform_real_distribution<float> unit(-1.f, 1.f);
    if (hd != 64 && hd != 128) {
        std::fprintf(stderr, "head size %d: the kernels are built for 64 and 128\n", hd);
        return 2;
    }
    if (layout == "batch") return run_batch(n, nh, nkv, hd, cap, 1, rng, amp);
    if (layout == "split") return run_batch(n, nh, nkv, hd, cap, 6, rng, amp);
    if (layout == "misfit") return run_misfit(nh, nkv, hd, cap);
    if (layout == "epilogue") return run_epilogue(n, nh, nkv, hd, cap, false, rng);
    if (layout == "epilogue16") return run_epilogue(n, nh, nkv, hd, cap, true, rng);
    if (layout == "norms") return run_norms(n, cap, rng);

    std::vector<unsigned> pos(n);
    if (layout == "prefill") {
        for (int i = 0; i < n; ++i) pos[i] = (unsigned)(cap - n + i);
    } else if (layout == "scattered") {
        std::vector<unsigned> all(cap);
        for (int i = 0; i < cap; ++i) all[i] = (unsigned)i;
        std::shuffle(all.begin(), all.end(), rng);
        std::copy(all.begin(), all.begin() + n, pos.begin());
    } else if (layout == "decode") {
        for (int i = 0; i < n; ++i) pos[i] = (unsigned)(cap - 1);
    } else {
        std::fprintf(stderr, "unknown layout %s\n", layout.c_str());
        return 2;
    }
    const unsigned last = *std::max_element(pos.begin(), pos.end());

    // The cache holds f16 (the kernel reads its bits); k and v are the values it holds.
    std::vector<float> q((size_t)n * nh * hd), k((size_t)nkv * cap * hd), v(k.size());
    std::vector<unsigned short> k16(k.size()), v16(v.size());
    for (auto& x : q) x = amp * unit(rng);
    for (int h = 0; h < nkv; ++h) {
        for (int r = 0; r < cap; ++r) {
            for (int d = 0; d < hd; ++d) {
                size_t i = ((size_t)h * cap + r) * hd + d;
                bool unread = (unsigned)r > last;
                k16[i] = f16_bits(unread ? NAN : amp * unit(rng));
                v16[i] = f16_bits(unread ? NAN : unit(rng));
                k[i] = emu::f16_to_f32(k16[i]);
                v[i] = emu::f16_to_f32(v16[i]);
            }
        }
    }
    std::vector<float> out(q.size(), NAN);
    const float scale = 1.f / std::sqrt((float)hd);
    dim3 grid{(unsigned)((n + FA_ROWS - 1) / FA_ROWS), (unsigned)nh, 1};
    auto run = [&] {
        if (hd == 64) {
            flash_attention_64(q.data(), k16.data(), v16.data(), pos.data(), out.data(), n, nh,
                               nkv, cap, scale);
        } else {
            flash_attention_128(q.data(), k16.data(), v16.data(), pos.data(), out.data(), n, nh,
                                nkv, cap, scale);
        }
    };
    emu::launch(grid, FA_THREADS, FA_SHARED_BYTES(hd), run);
    // The bf16 entry points: each output the f32 one's rounding.
    std::vector<bf16_t> out16(q.size());
    emu::launch(grid, FA_THREADS, FA_SHARED_BYTES(hd), [&] {
        if (hd == 64) {
            flash_attention_64_bf16(q.data(), k16.data(), v16.data(), pos.data(), out16.data(),
                                    n, nh, nkv, cap, scale);
        } else {
            flash_attention_128_bf16(q.data(), k16.data(), v16.data(), pos.data(), out16.data(),
                                     n, nh, nkv, cap, scale);
        }
    });
    int bad_bf16 = 0;
    for (size_t i = 0; i < out.size(); ++i) bad_bf16 += out16[i].bits != bf16_bits(out[i]);

    double max_err = 0, max_ref = 0;
    const int group = nh / nkv;
    for (int i = 0; i < n; ++i) {
        for (int h = 0; h < nh; ++h) {
            const float* qi = &q[((size_t)i * nh + h) * hd];
            const int kvh = h / group;
            std::vector<double> s(pos[i] + 1);
            double m = -INFINITY;
            for (unsigned j = 0; j <= pos[i]; ++j) {
                const float* kj = &k[((size_t)kvh * cap + j) * hd];
                double dot = 0;
                for (int d = 0; d < hd; ++d) dot += (double)qi[d] * kj[d];
                s[j] = dot * scale;
                m = std::max(m, s[j]);
            }
            double sum = 0;
            for (auto& x : s) sum += (x = std::exp(x - m));
            for (int d = 0; d < hd; ++d) {
                double ref = 0;
                for (unsigned j = 0; j <= pos[i]; ++j) {
                    ref += s[j] * v[((size_t)kvh * cap + j) * hd + d];
                }
                ref /= sum;
                double got = out[((size_t)i * nh + h) * hd + d];
                double err = std::isfinite(got) ? std::fabs(got - ref) : INFINITY;
                max_err = std::max(max_err, err);
                max_ref = std::max(max_ref, std::fabs(ref));
            }
        }
    }
    std::printf("max_err=%.6g max_ref=%.6g bad_bf16=%d\n", max_err, max_ref, bad_bf16);
    return 0;
}
