//! The AVX2 + FMA form of the tile's primitives ([`Lanes`]), with the same fixed order of
//! operations as the portable one, and the tile run on it. x86_64 only.

use super::tile::{Lanes, Tile};
use std::arch::x86_64::*;

/// AVX2 + FMA: only called from `#[target_feature(enable = "avx2,fma")]` code.
pub(super) struct Avx2;

impl Lanes for Avx2 {
    #[inline(always)]
    fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n16 = a.len() / 16 * 16;
        // SAFETY: reads stay below n16 <= a.len() and b.len() (callers pass equal
        // lengths); the CPU features are the caller's target features.
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut i = 0;
            while i < n16 {
                lo = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i)),
                    _mm256_loadu_ps(b.as_ptr().add(i)),
                    lo,
                );
                hi = _mm256_fmadd_ps(
                    _mm256_loadu_ps(a.as_ptr().add(i + 8)),
                    _mm256_loadu_ps(b.as_ptr().add(i + 8)),
                    hi,
                );
                i += 16;
            }
            // w = 8, 4, 2, 1 of the portable reduction.
            let s8 = _mm256_add_ps(lo, hi);
            let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
            a[n16..]
                .iter()
                .zip(&b[n16..])
                .fold(_mm_cvtss_f32(s1), |s, (&x, &y)| x.mul_add(y, s))
        }
    }

    #[inline(always)]
    fn dot4(a: &[f32], b: [&[f32]; 4]) -> [f32; 4] {
        let n = a.len();
        assert!(b.iter().all(|b| b.len() == n));
        let n16 = n / 16 * 16;
        // SAFETY: reads stay below n16 <= n, the length of every slice.
        unsafe {
            let mut lo = [_mm256_setzero_ps(); 4];
            let mut hi = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < n16 {
                let a0 = _mm256_loadu_ps(a.as_ptr().add(i));
                let a1 = _mm256_loadu_ps(a.as_ptr().add(i + 8));
                for t in 0..4 {
                    lo[t] = _mm256_fmadd_ps(a0, _mm256_loadu_ps(b[t].as_ptr().add(i)), lo[t]);
                    hi[t] = _mm256_fmadd_ps(a1, _mm256_loadu_ps(b[t].as_ptr().add(i + 8)), hi[t]);
                }
                i += 16;
            }
            let mut out = [0f32; 4];
            for t in 0..4 {
                let s8 = _mm256_add_ps(lo[t], hi[t]);
                let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
                let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
                let s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1));
                let mut x = _mm_cvtss_f32(s1);
                for (&ai, &bi) in a[n16..].iter().zip(&b[t][n16..]) {
                    x = ai.mul_add(bi, x);
                }
                out[t] = x;
            }
            out
        }
    }

    #[inline(always)]
    fn axpy16<const N: usize>(acc: &mut [[f32; 16]; N], p: [f32; N], v: &[f32]) {
        assert!(v.len() >= 16);
        // SAFETY: 16 values of `v` and of each accumulator row.
        unsafe {
            let v0 = _mm256_loadu_ps(v.as_ptr());
            let v1 = _mm256_loadu_ps(v.as_ptr().add(8));
            for (a, &pr) in acc.iter_mut().zip(&p) {
                let pb = _mm256_set1_ps(pr);
                let a0 = _mm256_fmadd_ps(pb, v0, _mm256_loadu_ps(a.as_ptr()));
                let a1 = _mm256_fmadd_ps(pb, v1, _mm256_loadu_ps(a.as_ptr().add(8)));
                _mm256_storeu_ps(a.as_mut_ptr(), a0);
                _mm256_storeu_ps(a.as_mut_ptr().add(8), a1);
            }
        }
    }
}

/// [`Tile::compute`] on AVX2 + FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_fma(tile: &Tile<'_>, out: &mut [f32]) {
    tile.compute::<Avx2>(out)
}
