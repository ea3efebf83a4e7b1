//! The transformer (qwen2, llama, qwen3, phi3, gemma3): a loaded [`Model`] and its forward
//! passes, written over candle ops with an external KV cache, explicit positions, optional
//! per-layer hidden states and a separate LM head.
//!
//! Loading keeps each weight matrix quantized on the kernels the CPU allows (the crate's
//! `weights` module); `forward.rs` holds the forward entry points and the layer loop, `ops.rs`
//! the norms, gated activations and windowed attention, `identity.rs` what names the model's
//! numerics in its fingerprint. Every pass runs on the kernels' thread pool
//! ([`kernels::in_pool`]). A row's result never depends on the other rows of its forward
//! beyond f32 rounding in the dense panels, and not at all on the int8 paths and in
//! attention: the ρ = 1 blend identity needs it. See docs/performance.md.

mod forward;
mod identity;
mod ops;

pub use crate::weights::LoadOptions;

use crate::chat::ChatFormat;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;
use crate::kv::KvCache;
use crate::tokenizer::Tokenizer;
use crate::weights::{load_embeddings, load_layers, load_norm, load_rope, Layer, Quant};
use candle_core::Tensor;
pub(crate) use identity::identity;
use identity::{weight_forms, ManyRows, Numerics};
use kernels::{AttentionShape, Rope};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Most rows one [`Model::forward_decode_path`] pass checks: verification and speculative
/// decoding cap their checking batches here, where every row is still bit-identical to a
/// one-token decode step.
pub const MAX_VERIFY_ROWS: usize = 16;

/// The attention head layout of a model.
fn shape_of(c: &ModelConfig) -> AttentionShape {
    AttentionShape {
        n_head: c.n_head,
        n_kv_head: c.n_kv_head,
        head_dim: c.head_dim,
    }
}

/// What a forward returns.
#[derive(Debug)]
pub struct ForwardOutput {
    /// Final-normed hidden states `(n, n_embd)`, ready for [`Model::logits`].
    pub hidden: Tensor,
    /// Residual stream after each layer `(n, n_embd)`, when requested.
    pub layers: Vec<Tensor>,
}

/// A loaded model: weights, tokenizer and identity. Holds no per-request state.
#[derive(Debug)]
pub struct Model {
    config: ModelConfig,
    tokenizer: Tokenizer,
    chat: ChatFormat,
    fingerprint: String,
    numerics: String,
    path: PathBuf,
    rope: Rope,
    /// The sliding layers' RoPE (their own base), where the model has such layers.
    rope_swa: Option<Rope>,
    embed: Arc<Quant>,
    layers: Vec<Layer>,
    output_norm: Tensor,
    lm_head: Arc<Quant>,
    dense_min_rows: usize,
    has_dense: bool,
    rope_ok: bool,
    /// Attention runs on bf16 products (the load option, where the CPU and head size allow).
    bf16_attention: bool,
}

impl Model {
    /// The precision its attention runs at (bf16 only where the load option asked for it and
    /// the CPU and head size allow).
    pub fn attention(&self) -> kernels::AttentionPrecision {
        if self.bf16_attention {
            kernels::AttentionPrecision::Bf16
        } else {
            kernels::AttentionPrecision::F32
        }
    }

    /// Loads a qwen2 or llama GGUF file.
    pub fn load(path: &Path, opts: &LoadOptions) -> Result<Self> {
        if !opts.attention.supported() {
            return Err(EngineError::InvalidInput(format!(
                "attention precision {:?} needs a CPU with AVX-512 BF16; this one has none",
                opts.attention
            )));
        }
        let mut f = GgufFile::open(path)?;
        let config = ModelConfig::from_gguf(&f)?;
        let tokenizer = Tokenizer::from_gguf(&f)?;
        let chat = ChatFormat::for_tokenizer(&tokenizer, f.chat_template(), config.arch);
        let file_fingerprint = f.fingerprint();
        let (rope, rope_swa) = load_rope(&mut f, &config)?;
        let layers = load_layers(&mut f, &config, opts)?;
        let (embed, lm_head) = load_embeddings(&mut f, opts)?;
        let output_norm = load_norm(&mut f, "output_norm.weight")?;
        // Many-row forwards stay on int8 when every layer's format has a tiled int8 kernel
        // that is exact per row (the k-quants): ~2x the f32 panels' prefill speed on the 1.5B
        // target. A model with any other format keeps f32 panels for all of them, because
        // mixing the two breaks the ρ = 1 identity: panel GEMM rounds a row differently in a
        // different batch (~1e-6), and the int8 activation rounding downstream turns that
        // into whole quantization steps (first-token KL 2.9e-4 on the 0.5B target).
        let int8_everywhere = layers.iter().all(|l| {
            [&l.wq, &l.wk, &l.wv, &l.wo, &l.gate, &l.up, &l.down]
                .iter()
                .all(|x| x.quant.int8_for_many_rows())
        });
        let (vocab, dim) = embed.dims()?;
        if dim != config.n_embd || vocab < tokenizer.vocab_size() {
            return Err(EngineError::BadGguf {
                path: path.to_path_buf(),
                reason: format!(
                    "token_embd is {vocab}x{dim}, expected {}x{}",
                    tokenizer.vocab_size(),
                    config.n_embd
                ),
            });
        }
        let bf16_attention = opts.attention == kernels::AttentionPrecision::Bf16
            && kernels::Bf16Kv::handles(shape_of(&config));
        let has_dense = opts.dense && !int8_everywhere;
        let numerics = Numerics {
            attention: if bf16_attention { "bf16" } else { "f32" },
            requantize: opts.requantize,
            many_rows: match (has_dense, opts.dense_copies) {
                (false, _) => ManyRows::Int8,
                (true, false) => ManyRows::DensePanels(opts.dense_min_rows.max(1)),
                (true, true) => ManyRows::DenseCopies(opts.dense_min_rows.max(1)),
            },
            weights: weight_forms(&layers, &embed, &lm_head),
        }
        .describe();
        let fingerprint = identity(&file_fingerprint, &numerics);
        let model = Self {
            config,
            tokenizer,
            chat,
            fingerprint,
            numerics,
            path: path.to_path_buf(),
            rope,
            rope_swa,
            embed,
            layers,
            output_norm,
            lm_head,
            dense_min_rows: opts.dense_min_rows.max(1),
            has_dense,
            rope_ok: false,
            bf16_attention,
        };
        let mut model = model;
        model.rope_ok = model.rope_self_test()?;
        if !model.rope_ok {
            tracing::warn!(
                "positional recovery failed its self-test for {}: blended prefill will recompute every chunk token",
                path.display()
            );
        }
        if opts.warmup {
            model.warmup()?;
        }
        Ok(model)
    }

    /// LMCache-style check at load: layer-0 keys computed at offset 0 and rotated by 1000
    /// positions (through f16, as stored) must equal the keys computed at offset 1000.
    fn rope_self_test(&self) -> Result<bool> {
        let ids: Vec<u32> = (0..4u32)
            .map(|i| (i * 37 + 11) % self.config.vocab_size as u32)
            .collect();
        let at0 = self.layer0_keys(&ids, &[0, 1, 2, 3])?;
        let want = self.layer0_keys(&ids, &[1000, 1001, 1002, 1003])?;
        let mut got: Vec<f32> = at0
            .iter()
            .map(|&x| half::f16::from_f32(x).to_f32())
            .collect();
        self.rope_at(0)
            .rotate_by(&mut got, self.config.n_kv_head, &[1000; 4])?;
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        Ok(err <= 2e-3 * scale)
    }

    /// Whether positional recovery passed its self-test at load (blending is refused if not).
    pub fn rope_recovery_ok(&self) -> bool {
        self.rope_ok
    }

    /// Whether forwards over many rows run dense f32 GEMM (dequantized panels or copies);
    /// `false` when every weight has an int8 kernel exact per row (packed formats and
    /// k-quants), which then serves every row count.
    pub fn dense_forwards(&self) -> bool {
        self.has_dense
    }

    /// Runs both weight paths once so one-time repacking happens now.
    fn warmup(&self) -> Result<()> {
        let n = self.dense_min_rows.max(2);
        let ids = vec![0u32; n];
        let pos: Vec<usize> = (0..n).collect();
        let mut cache = KvCache::new(&self.config);
        let out = self.forward(&ids, &pos, &mut cache, false)?;
        self.logits(&out.hidden.narrow(0, n - 1, 1)?)?;
        let out = self.forward(&[0], &[n], &mut cache, false)?;
        self.logits(&out.hidden)?;
        Ok(())
    }

    /// The chat format prompts are written in: the file's template, or ChatML.
    pub fn chat(&self) -> &ChatFormat {
        &self.chat
    }

    /// Hyper-parameters.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The tokenizer built from this file.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The identity every cache of this model is bound to (stored chunk KV, prefix hashes,
    /// speculator scores): sha256 of the file's metadata and tensor table and of
    /// [`Model::numerics`], the load choices that change the numbers a forward produces. Two
    /// models with the same fingerprint write the same KV bytes for the same input.
    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    /// The load choices (and the CPU paths they led to) that change this model's numbers:
    /// attention precision, re-quantized weights, how many-row products run, and which
    /// kernel each weight matrix multiplies on (repacked int8 with AVX-512 VNNI, QMatrix,
    /// candle's k-quant kernels), e.g. `attention=f32;kv=f16;requantize=none;many_rows=int8;weights=packed:Q8_0x168`.
    pub fn numerics(&self) -> &str {
        &self.numerics
    }

    /// Path the model was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The model's rotary embedding (of its layers that attend to everything).
    pub fn rope(&self) -> &Rope {
        &self.rope
    }

    /// Layer `l`'s rotary embedding: a sliding layer's has its own base (Gemma 3).
    pub fn rope_at(&self, l: usize) -> &Rope {
        match &self.rope_swa {
            Some(r) if self.config.window_of(l).is_some() => r,
            _ => &self.rope,
        }
    }

    /// A fresh, empty cache for this model.
    pub fn new_cache(&self) -> KvCache {
        KvCache::new(&self.config)
    }
}
