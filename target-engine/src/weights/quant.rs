//! A weight matrix's quantized blocks and the kernels that multiply them.

use super::options::LoadOptions;
use crate::error::{EngineError, Result};
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use kernels::{Isa, PackedMatrix, QMatrix, QType};
use std::borrow::Cow;
use std::sync::Arc;

/// `q` in `opts.requantize`'s format when one is asked for and its rows fit the format's
/// blocks; otherwise `q` as the file has it.
pub(super) fn requantized(q: QTensor, opts: &LoadOptions) -> Result<QTensor> {
    match opts.requantize {
        Some(ty)
            if ty != q.dtype()
                && q.shape()
                    .dims()
                    .last()
                    .is_some_and(|c| c % ty.block_size() == 0) =>
        {
            Ok(QTensor::quantize(&q.dequantize(&Device::Cpu)?, ty)?)
        }
        _ => Ok(q),
    }
}

/// A loaded tensor's blocks, read in place by [`QMatrix`] (no copy).
struct TensorBytes(Arc<QTensor>);

impl AsRef<[u8]> for TensorBytes {
    fn as_ref(&self) -> &[u8] {
        match self.0.data() {
            Ok(Cow::Borrowed(b)) => b,
            // CPU storage always lends its bytes; anything else was refused at load.
            _ => &[],
        }
    }
}

/// Quantized weights and the ways of multiplying them.
///
/// With AVX-512 VNNI or AVX2, Q8_0, Q5_0, Q4_1, Q4_K and Q6_K weights are repacked at load into a
/// [`PackedMatrix`] (the file's bit width, the original bytes dropped; the k-quants only with
/// `LoadOptions::pack_k_quants`): one int8 GEMM for every row count, each row's result
/// independent of the batch, the same values on both ISAs; on VNNI 2-4x QMatrix for few rows
/// and ~2x the f32 panels for many, on a par with candle's k-quant GEMM; on AVX2 the 1.5B target
/// decodes in ~0.7x the time it took on candle's k-quants and QMatrix (docs/performance.md).
/// Otherwise few rows (decode, blended prefill's small recompute, verification) multiply the blocks with int8 activations:
/// [`QMatrix`] for Q8_0, Q5_0 and Q4_1 (candle has only a scalar loop for the last two),
/// candle's kernels for the k-quants (Q4_K, Q6_K: the 1.5B target decodes 1.3x faster on them
/// than on QMatrix). Many rows run either the same int8 kernels (a model made only of packed
/// formats and k-quants) or dense f32 GEMM on panels of weight rows dequantized into cache
/// ([`QMatrix::matmul_dense`]), so no dense copy of the weights is kept (`Model::load` picks).
#[derive(Debug)]
pub(crate) struct Quant {
    /// `(rows, cols)`.
    pub(super) dims: (usize, usize),
    /// The block format the weights are multiplied in (after any re-quantization).
    dtype: GgmlDType,
    pub(super) weights: Weights,
}

#[derive(Debug)]
pub(super) enum Weights {
    /// Repacked for the int8 GEMM.
    Packed(PackedMatrix),
    /// The file's blocks.
    File {
        tensor: Arc<QTensor>,
        /// The same bytes, for QMatrix's kernels (`None` for a format it does not know).
        blocks: Option<QMatrix>,
        candle: QMatMul,
        /// Few-row products on QMatrix's int8 kernels rather than on candle's.
        own_kernels: bool,
    },
}

impl Quant {
    /// Wraps `q`; re-quantizes a format without a SIMD kernel here to Q8_0 when `to_q8` is set;
    /// repacks it for the int8 GEMM when `pack` is set and the CPU and format allow.
    pub(super) fn new(q: QTensor, to_q8: bool, pack: bool, pack_k_quants: bool) -> Result<Self> {
        let (rows, cols) = q.shape().dims2()?;
        // candle's formats without an AVX kernel that QMatrix does not take either.
        let slow = matches!(q.dtype(), GgmlDType::Q5_1 | GgmlDType::Q8_1);
        let q = if to_q8 && slow && cols.is_multiple_of(32) {
            QTensor::quantize(&q.dequantize(&Device::Cpu)?, GgmlDType::Q8_0)?
        } else {
            q
        };
        let ty = match q.dtype() {
            GgmlDType::Q8_0 => Some(QType::Q8_0),
            GgmlDType::Q5_0 => Some(QType::Q5_0),
            GgmlDType::Q4_1 => Some(QType::Q4_1),
            GgmlDType::Q4K => Some(QType::Q4K),
            GgmlDType::Q6K => Some(QType::Q6K),
            _ => None,
        };
        if !matches!(q.data()?, Cow::Borrowed(_)) {
            return Err(EngineError::Internal(
                "quantized weights are not in CPU memory".into(),
            ));
        }
        let tensor = Arc::new(q);
        let blocks = match ty {
            Some(ty) => Some(QMatrix::new(
                ty,
                rows,
                cols,
                Arc::new(TensorBytes(tensor.clone())),
            )?),
            None => None,
        };
        let k_quant = matches!(ty, Some(QType::Q4K | QType::Q6K));
        if pack && (pack_k_quants || !k_quant) && Isa::best() != Isa::Portable {
            if let Some(p) = blocks.as_ref().and_then(QMatrix::pack) {
                return Ok(Self {
                    dims: (rows, cols),
                    dtype: tensor.dtype(),
                    weights: Weights::Packed(p),
                });
            }
        }
        Ok(Self {
            dims: (rows, cols),
            dtype: tensor.dtype(),
            weights: Weights::File {
                candle: QMatMul::from_arc(tensor.clone())?,
                own_kernels: matches!(ty, Some(QType::Q8_0 | QType::Q5_0 | QType::Q4_1)),
                tensor,
                blocks,
            },
        })
    }

    /// Whether the few-row kernel is also fast for many rows and exact per row: the packed
    /// GEMM, or candle's tiled k-quant GEMM.
    pub(crate) fn int8_for_many_rows(&self) -> bool {
        match &self.weights {
            Weights::Packed(_) => true,
            Weights::File {
                own_kernels,
                tensor,
                ..
            } => !own_kernels && matches!(tensor.dtype(), GgmlDType::Q4K | GgmlDType::Q6K),
        }
    }

    /// `(rows, cols)`.
    pub(crate) fn dims(&self) -> Result<(usize, usize)> {
        Ok(self.dims)
    }

    /// `kernel:format`: which kernel multiplies these weights, and their block format.
    pub(crate) fn form(&self) -> String {
        let kernel = match &self.weights {
            Weights::Packed(_) => "packed",
            Weights::File {
                own_kernels: true, ..
            } => "qmatrix",
            Weights::File { .. } => "candle",
        };
        format!("{kernel}:{:?}", self.dtype)
    }

    /// Rows `ids` of the matrix, dequantized: an embedding lookup `(ids.len(), cols)`.
    pub(crate) fn lookup(&self, ids: &[u32]) -> Result<Tensor> {
        let cols = self.dims.1;
        let rows = |get: &dyn Fn(usize) -> kernels::Result<Vec<f32>>| -> Result<Tensor> {
            let mut out = Vec::with_capacity(ids.len() * cols);
            for &id in ids {
                out.extend(get(id as usize)?);
            }
            Ok(Tensor::from_vec(out, (ids.len(), cols), &Device::Cpu)?)
        };
        match &self.weights {
            Weights::Packed(p) => rows(&|j| p.dequantize_rows(j..j + 1)),
            Weights::File {
                blocks: Some(m), ..
            } => rows(&|j| m.dequantize_rows(j..j + 1)),
            Weights::File { tensor, .. } => Ok(tensor.embedding(&Tensor::new(ids, &Device::Cpu)?)?),
        }
    }

    /// `x Wᵀ` for rows `x` `(n, cols)` on the few-row kernels: each row's result independent
    /// of the others.
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let y = match &self.weights {
            Weights::Packed(p) => p.matmul(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File {
                blocks: Some(m),
                own_kernels: true,
                ..
            } => m.matmul(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File { .. } => return self.candle_forward(x),
        };
        Ok(Tensor::from_vec(y, (n, self.dims.0), &Device::Cpu)?)
    }

    /// `x Wᵀ` for many rows: the packed GEMM, dense f32 GEMM on dequantized panels, or
    /// candle's kernels for a format QMatrix does not know.
    pub(super) fn forward_dense(&self, x: &Tensor) -> Result<Tensor> {
        let (n, _) = x.dims2()?;
        let y = match &self.weights {
            Weights::Packed(_) => return self.forward(x),
            Weights::File {
                blocks: Some(m), ..
            } => m.matmul_dense(&x.flatten_all()?.to_vec1::<f32>()?, n)?,
            Weights::File { .. } => return self.candle_forward(x),
        };
        Ok(Tensor::from_vec(y, (n, self.dims.0), &Device::Cpu)?)
    }

    /// candle's product, kept independent of the row count: its Q6_K kernel takes a compact
    /// path for one row and repacked tiles for more, which round differently (up to ~1e-5),
    /// so a single row runs as two. Without this a blend at ρ = 1 is not the full prefill and
    /// verification could disagree with one-token decode on a near tie. (The tiled path was
    /// also faster for one row in `examples/qmatmul`-style timing.)
    fn candle_forward(&self, x: &Tensor) -> Result<Tensor> {
        let Weights::File { tensor, candle, .. } = &self.weights else {
            return self.forward(x);
        };
        if tensor.dtype() == GgmlDType::Q6K && x.dims2()?.0 == 1 {
            let two = Tensor::cat(&[x, x], 0)?;
            return Ok(candle.forward(&two)?.narrow(0, 0, 1)?);
        }
        Ok(candle.forward(x)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i + seed) * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect()
    }

    /// A row's product must not depend on which other rows share the call, within each path
    /// (few rows: exactly; many rows: up to f32 rounding): the ρ = 1 blend identity and
    /// verification rely on it.
    #[test]
    fn each_format_gives_a_row_the_same_result_in_any_batch() -> Result<()> {
        let (rows, cols) = (64, 512);
        let w = Tensor::from_vec(values(rows * cols, 0), (rows, cols), &Device::Cpu)?;
        let x = Tensor::from_vec(values(400 * cols, 3), (400, cols), &Device::Cpu)?;
        let x = &x;
        let formats = [
            GgmlDType::Q8_0,
            GgmlDType::Q5_0,
            GgmlDType::Q4_1,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
            GgmlDType::Q5_1,
        ];
        // Repacked (where the CPU allows) and as in the file.
        for (g, pack) in formats.into_iter().flat_map(|g| [(g, true), (g, false)]) {
            let q = Quant::new(QTensor::quantize(&w, g)?, true, pack, pack)?;
            if pack {
                // The packed matrix dequantizes to the file's weights.
                let file = Quant::new(QTensor::quantize(&w, g)?, true, false, false)?;
                let ids = [0, 17, 63];
                assert_eq!(
                    q.lookup(&ids)?.to_vec2::<f32>()?,
                    file.lookup(&ids)?.to_vec2::<f32>()?,
                    "{g:?}"
                );
            }
            // Every row of a batch of n against the same row of the largest batch.
            let check = |sizes: &[usize], dense: bool| -> Result<()> {
                let run = |n: usize| -> Result<Vec<Vec<f32>>> {
                    let x = x.narrow(0, 0, n)?;
                    let y = if dense {
                        q.forward_dense(&x)?
                    } else {
                        q.forward(&x)?
                    };
                    Ok(y.to_vec2::<f32>()?)
                };
                let reference = run(*sizes.last().expect("sizes"))?;
                let scale = reference.iter().flatten().fold(0f32, |m, v| m.max(v.abs()));
                for &n in sizes {
                    for (r, (y, want)) in run(n)?.iter().zip(&reference).enumerate() {
                        let d = y
                            .iter()
                            .zip(want)
                            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
                        // Few rows exactly; many rows up to f32 rounding (dense GEMM's
                        // blocking follows the batch; int8 activation rounding may not).
                        let tol = if dense { 1e-6 * scale } else { 0.0 };
                        assert!(
                            d <= tol,
                            "{g:?}: row {r} of {n} differs by {d} (scale {scale}, dense {dense})"
                        );
                    }
                }
                Ok(())
            };
            check(&[1, 2, 3, 5, 7, 40, 129, 400], false)?;
            check(&[8, 9, 13, 17, 40], true)?;
        }
        Ok(())
    }
}
