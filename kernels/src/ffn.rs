//! The gated feed-forward's element-wise step, SwiGLU: `silu(g) · u`, on this crate's thread
//! pool.
//!
//! candle computes the same two ops (`silu`, then `mul`) exactly as here, but from 64k elements
//! up (a checking pass of 8 rows of the 1.5B target: 8 x 8960) it runs them on its own barrier
//! pool, whose workers then spin ~25k iterations waiting for more work, on the cores the next
//! matrix product runs on: a checking pass of 8 rows took 1.45x one of 7 (65 against 45 ms,
//! `examples/check_rows`). Here it stays on the pool the products use.

use rayon::prelude::*;

/// Elements per parallel task (below it, one task: the call is a few microseconds).
const CHUNK: usize = 16 * 1024;

/// `silu(g[i]) · u[i]` with candle's f32 SiLU, `g / (1 + exp(−g))`, bit for bit candle's
/// `g.silu()? * u`. Panics if the lengths differ (the caller's shapes are the model's).
pub fn swiglu(g: &[f32], u: &[f32]) -> Vec<f32> {
    assert_eq!(g.len(), u.len(), "swiglu: gate and up differ in length");
    let mut out = vec![0f32; g.len()];
    let run = |(o, (g, u)): (&mut [f32], (&[f32], &[f32]))| {
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
    };
    if g.len() <= CHUNK {
        run((&mut out, (g, u)));
    } else {
        out.par_chunks_mut(CHUNK)
            .zip(g.par_chunks(CHUNK).zip(u.par_chunks(CHUNK)))
            .for_each(run);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    #[test]
    fn swiglu_is_candles_silu_times_up_bit_for_bit() -> candle_core::Result<()> {
        // Above and below the parallel size, with values where exp over- and underflows.
        for n in [7, CHUNK + 5, 3 * CHUNK] {
            let g: Vec<f32> = [f32::MAX, f32::MIN, 0.0, -0.0, 88.8, -104.0]
                .into_iter()
                .chain((0..n).map(|i| ((i * 7919 % 2001) as f32 - 1000.0) / 9.0))
                .take(n)
                .collect();
            let u: Vec<f32> = (0..n)
                .map(|i| ((i * 31 % 200) as f32 - 100.0) / 37.0)
                .collect();
            let gt = Tensor::from_vec(g.clone(), n, &Device::Cpu)?;
            let ut = Tensor::from_vec(u.clone(), n, &Device::Cpu)?;
            let want = (gt.silu()? * ut)?.to_vec1::<f32>()?;
            let got = swiglu(&g, &u);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                    "element {i}: {a} vs candle's {b}"
                );
            }
        }
        Ok(())
    }
}
