//! A linear layer over quantized weights, with optional dense copies and bias.

use super::options::LoadOptions;
use super::quant::{requantized, Quant, Weights};
use crate::error::Result;
use crate::gguf::GgufFile;
use candle_core::quantized::QTensor;
use candle_core::{Device, Tensor};
use kernels::PackedMatrix;

/// A linear layer `y = x Wᵀ (+ b)` with quantized and optional dense weights.
#[derive(Debug)]
pub(crate) struct Linear {
    pub(crate) quant: Quant,
    dense_t: Option<Tensor>,
    bias: Option<Tensor>,
}

impl Linear {
    pub(super) fn load(
        f: &mut GgufFile,
        name: &str,
        bias: bool,
        opts: &LoadOptions,
    ) -> Result<Self> {
        let bias = if bias {
            Some(
                f.tensor(&format!("{name}.bias"))?
                    .dequantize(&Device::Cpu)?,
            )
        } else {
            None
        };
        Self::new(f.tensor(&format!("{name}.weight"))?, bias, opts)
    }

    /// A linear layer of weights `q` (as the file holds them) and an optional bias.
    pub(super) fn new(q: QTensor, bias: Option<Tensor>, opts: &LoadOptions) -> Result<Self> {
        let q = requantized(q, opts)?;
        let dense_t = if opts.dense && opts.dense_copies {
            Some(q.dequantize(&Device::Cpu)?.t()?)
        } else {
            None
        };
        let quant = Quant::new(q, opts.decode_q8, opts.packed, opts.pack_k_quants)?;
        Ok(Self {
            quant,
            dense_t,
            bias,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor, dense: bool) -> Result<Tensor> {
        let y = match (&self.dense_t, dense) {
            (Some(w), true) => x.matmul(w)?,
            (None, true) => self.quant.forward_dense(x)?,
            (_, false) => self.quant.forward(x)?,
        };
        Ok(match &self.bias {
            Some(b) => y.broadcast_add(b)?,
            None => y,
        })
    }

    /// `x Wᵢᵀ (+ bᵢ)` for several linears over the same rows (q/k/v, gate/up). On the packed
    /// weights the rows are quantized once and the products share one parallel loop, bit for
    /// bit the separate products; otherwise each runs alone.
    pub(crate) fn forward_many(ls: &[&Linear], x: &Tensor, dense: bool) -> Result<Vec<Tensor>> {
        let packed: Option<Vec<&PackedMatrix>> = ls
            .iter()
            .map(|l| match &l.quant.weights {
                Weights::Packed(p) if !(dense && l.dense_t.is_some()) => Some(p),
                _ => None,
            })
            .collect();
        let Some(mats) = packed else {
            return ls.iter().map(|l| l.forward(x, dense)).collect();
        };
        let (n, _) = x.dims2()?;
        let ys = PackedMatrix::matmul_many(&mats, &x.flatten_all()?.to_vec1::<f32>()?, n)?;
        ls.iter()
            .zip(ys)
            .map(|(l, y)| {
                let y = Tensor::from_vec(y, (n, l.quant.dims.0), &Device::Cpu)?;
                Ok(match &l.bias {
                    Some(b) => y.broadcast_add(b)?,
                    None => y,
                })
            })
            .collect()
    }
}
