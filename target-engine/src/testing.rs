//! Tiny random-weight models written as real GGUF files, for fast tests of everything that
//! loads a model (this crate's and, later, the speculator's and the gateway's).
//!
//! The files go through the same loader as the default models, so a tiny model exercises GGUF
//! parsing, the tokenizer metadata and both weight paths in milliseconds.

use crate::config::Architecture;
use crate::error::Result;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::path::Path;

/// Shape of a tiny model.
#[derive(Debug, Clone)]
pub struct TinySpec {
    pub arch: Architecture,
    pub n_layer: usize,
    pub n_embd: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub n_ff: usize,
    pub seed: u64,
    /// A head dimension other than `n_embd / n_head` (written as `attention.key_length`
    /// and `value_length`, as Qwen3 files do).
    pub head_dim: Option<usize>,
    /// Llama 3.x-style RoPE frequency factors (`rope_freqs.weight`, `head_dim / 2` values).
    pub rope_freqs: Option<Vec<f32>>,
    /// A separate LM head (`output.weight`) instead of the tied embedding, scaled so that the
    /// logits spread over several units: the next token then depends on the whole forward,
    /// not mostly on the embedding of the token before it.
    pub output_head: bool,
    /// The pre-tokenizer (`tokenizer.ggml.pre`); by default `qwen2` for the Qwen families and
    /// `smollm` for Llama.
    pub pre: Option<&'static str>,
    /// Whole-word tokens after the merges that no merge leads to (byte-level text, `Ġ` for
    /// a space): only a pre-tokenizer that takes whole pieces (Llama 3's) reaches them.
    pub words: Vec<&'static str>,
    /// Scale of the Q and K weights (1: unit-variance rows): larger makes attention sharper,
    /// so that positions and what RoPE does to them weigh more in the output.
    pub qk_scale: f32,
    /// A SentencePiece vocabulary (`<0xXX>` byte tokens, scored `▁` pieces, a space prefix)
    /// instead of the byte-level BPE one; the same ChatML specials last.
    pub sentencepiece: bool,
    /// Extra metadata entries (to test rejection of unsupported files).
    pub extra: Vec<(String, Value)>,
    /// A model of a real shape: the embedding and LM head get this many rows (a real
    /// vocabulary; the tiny tokenizer uses the first few), and every matrix is written as
    /// random Q8_0 blocks generated in parallel, so a 7B shape takes seconds, not minutes.
    pub real_vocab: Option<usize>,
    /// Named as a Phi-3 file (`tiny-phi3`): llama.cpp then drops the whitespace after special
    /// tokens, by the name (and needs `<unk>`, `<s>`, `</s>` and `<|endoftext|>` in the
    /// vocabulary: the SentencePiece one has them).
    pub phi3_name: bool,
    /// The format of a real shape's matrices: Q8_0 (the default) or Q4_K, the format most
    /// of a real Q4_K_M file is in.
    pub real_format: GgmlDType,
    /// A GGUF file whose tokenizer (every `tokenizer.*` entry: vocabulary, merges, special
    /// ids, chat template) the model carries instead of the tiny vocabulary: a random-weight
    /// model that reads text as the real one does ([`write_tokenizer_gguf`] keeps just those).
    pub tokenizer_from: Option<std::path::PathBuf>,
}

impl TinySpec {
    /// Two layers, 64-wide, grouped-query attention.
    pub fn new(arch: Architecture) -> Self {
        Self {
            arch,
            n_layer: 2,
            n_embd: 64,
            n_head: 4,
            n_kv_head: 2,
            n_ff: 128,
            seed: 1,
            head_dim: None,
            rope_freqs: None,
            output_head: false,
            pre: None,
            words: Vec::new(),
            qk_scale: 1.0,
            sentencepiece: false,
            extra: Vec::new(),
            real_vocab: None,
            phi3_name: false,
            real_format: GgmlDType::Q8_0,
            tokenizer_from: None,
        }
    }

    /// A random-weight model of a real Qwen2.5 shape (`0.5b`, `1.5b`, `7b`), or of a small
    /// shape of the same build (`small`: 4 layers, 256 wide, a 4096-row vocabulary) for a
    /// quick run on a CPU; `None` for another name.
    pub fn qwen2_shape(name: &str) -> Option<Self> {
        // (layers, width, heads, kv heads, ffn, vocabulary rows) of the Hugging Face configs.
        let (n_layer, n_embd, n_head, n_kv_head, n_ff, vocab) = match name {
            "small" => (4, 256, 4, 2, 768, 4096),
            "0.5b" => (24, 896, 14, 2, 4864, 151_936),
            "1.5b" => (28, 1536, 12, 2, 8960, 151_936),
            "7b" => (28, 3584, 28, 4, 18944, 152_064),
            _ => return None,
        };
        Some(Self {
            n_layer,
            n_embd,
            n_head,
            n_kv_head,
            n_ff,
            output_head: true,
            real_vocab: Some(vocab),
            ..Self::new(Architecture::Qwen2)
        })
    }
}

/// Random weights for [`write_tiny_gguf`]: one SplitMix64 stream for everything (tiny
/// models, whose bytes the llama.cpp fixtures pin), or, for real shapes, matrices as Q8_0
/// blocks drawn in parallel from their own streams.
struct Draw {
    seed: u64,
    fast: bool,
    format: GgmlDType,
    matrices: u64,
}

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Draw {
    /// Uniform values in `[-scale, scale)` from the shared stream.
    fn values(&mut self, shape: (usize, usize), scale: f32) -> Result<Tensor> {
        let v = (0..shape.0 * shape.1)
            .map(|_| {
                ((splitmix(&mut self.seed) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        Ok(Tensor::from_vec(v, shape, &Device::Cpu)?)
    }

    /// A matrix of values in about `[-scale, scale]`: Q8_0 from the shared stream, or, for
    /// real shapes, random blocks of `format` (Q8_0: uniform int8 with one scale; Q4_K: random
    /// 6-bit sub-block scales and minimums and 4-bit values, the minimums centring them).
    fn matrix(&mut self, shape: (usize, usize), scale: f32) -> Result<QTensor> {
        if !self.fast {
            return Ok(QTensor::quantize(
                &self.values(shape, scale)?,
                GgmlDType::Q8_0,
            )?);
        }
        use rayon::prelude::*;
        self.matrices += 1;
        let stream = self.seed ^ self.matrices.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let (format, head) = match self.format {
            GgmlDType::Q4K => {
                // w = d·sc·q - dmin·m with sc, m in 0..64 and q in 0..16: dmin = 7.5 d centres
                // them, and |w| stays below 945 d.
                let d = half::f16::from_f32(scale / 472.0);
                let dmin = half::f16::from_f32(scale / 472.0 * 7.5);
                (
                    GgmlDType::Q4K,
                    [d.to_le_bytes(), dmin.to_le_bytes()].concat(),
                )
            }
            _ => (
                GgmlDType::Q8_0,
                half::f16::from_f32(scale / 127.0).to_le_bytes().to_vec(),
            ),
        };
        let size = format.type_size();
        let blocks = shape.0 * shape.1 / format.block_size();
        let int8 = format == GgmlDType::Q8_0;
        let mut bytes = vec![0u8; blocks * size];
        bytes
            .par_chunks_mut(size)
            .enumerate()
            .for_each(|(b, block)| {
                let mut state = stream ^ (b as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                block[..head.len()].copy_from_slice(&head);
                for chunk in block[head.len()..].chunks_mut(8) {
                    let r = splitmix(&mut state).to_le_bytes();
                    for (q, x) in chunk.iter_mut().zip(r) {
                        *q = if int8 {
                            ((i32::from(x) % 255) - 127) as i8 as u8
                        } else {
                            x
                        };
                    }
                }
            });
        let storage = candle_core::quantized::QStorage::from_data(
            std::borrow::Cow::Owned(bytes),
            &Device::Cpu,
            format,
        )?;
        Ok(QTensor::new(storage, shape)?)
    }
}

/// The tiny model of each family that llama.cpp's outputs are committed for
/// (`tests/fixtures/families.jsonl`, written by `scripts/family_fixtures.py`): its name and
/// spec. Each family's own part is exercised: Qwen2's biases, Llama's interleaved RoPE,
/// Qwen3's per-head Q/K norms and a head dimension other than `n_embd / n_head`, Llama 3's
/// RoPE frequency factors (large enough to move a short prompt's logits) and pre-tokenizer,
/// Phi-3's fused Q/K/V and gate/up matrices, a SentencePiece vocabulary (as Llama 2, Mistral and
/// Gemma files have), and a Phi-3-named SentencePiece file (whitespace after special tokens
/// dropped, by the name, as llama.cpp does).
pub fn family_specs() -> Vec<(&'static str, TinySpec)> {
    let with_head = |arch| TinySpec {
        output_head: true,
        qk_scale: 3.0,
        ..TinySpec::new(arch)
    };
    let mut qwen3 = with_head(Architecture::Qwen3);
    qwen3.head_dim = Some(32);
    qwen3.seed = 7;
    let mut llama3 = with_head(Architecture::Llama);
    llama3.rope_freqs = Some(vec![1.0, 4.0, 8.0, 16.0, 32.0, 64.0, 64.0, 64.0]);
    llama3.seed = 11;
    llama3.pre = Some("llama-bpe");
    llama3.words = vec!["123", "456", "186", "Ġof", "Ġrow"];
    let mut llama = with_head(Architecture::Llama);
    llama.seed = 5;
    let mut phi3 = with_head(Architecture::Phi3);
    phi3.seed = 13;
    // Gemma 3 with a window of 8 on its first layer, the second attending to everything.
    let mut gemma3 = with_head(Architecture::Gemma3);
    gemma3.sentencepiece = true;
    gemma3.head_dim = Some(32);
    gemma3.seed = 19;
    gemma3.extra = vec![
        ("gemma3.attention.sliding_window".into(), Value::U32(8)),
        (
            "gemma3.attention.sliding_window_pattern".into(),
            Value::U32(2),
        ),
    ];
    let mut spm = with_head(Architecture::Llama);
    spm.sentencepiece = true;
    spm.seed = 17;
    let mut phi3_spm = with_head(Architecture::Phi3);
    phi3_spm.sentencepiece = true;
    phi3_spm.phi3_name = true;
    phi3_spm.seed = 23;
    vec![
        ("tiny-qwen2", with_head(Architecture::Qwen2)),
        ("tiny-llama", llama),
        ("tiny-qwen3", qwen3),
        ("tiny-llama3", llama3),
        ("tiny-phi3", phi3),
        ("tiny-llama-spm", spm),
        ("tiny-gemma3", gemma3),
        ("tiny-phi3-spm", phi3_spm),
    ]
}

/// A vocabulary's tokens and its `tokenizer.*` metadata entries.
type TokenizerMeta = (Vec<String>, Vec<(String, Value)>);

/// The tokens and every `tokenizer.*` entry of the GGUF file at `path`.
fn tokenizer_of(path: &Path) -> Result<TokenizerMeta> {
    let mut reader = std::io::BufReader::new(std::fs::File::open(path)?);
    let content = gguf_file::Content::read(&mut reader)?;
    let mut meta: Vec<(String, Value)> = content
        .metadata
        .into_iter()
        .filter(|(k, _)| k.starts_with("tokenizer."))
        .collect();
    meta.sort_by(|a, b| a.0.cmp(&b.0));
    let tokens = meta
        .iter()
        .find(|(k, _)| k == "tokenizer.ggml.tokens")
        .and_then(|(_, v)| v.to_vec().ok())
        .map(|v| {
            v.iter()
                .filter_map(|t| t.to_string().ok().cloned())
                .collect()
        })
        .unwrap_or_default();
    Ok((tokens, meta))
}

/// Writes to `dst` a GGUF file holding only the tokenizer of the GGUF file at `src` (every
/// `tokenizer.*` entry, no tensors): what [`TinySpec::tokenizer_from`] reads, a few MB.
pub fn write_tokenizer_gguf(src: &Path, dst: &Path) -> Result<()> {
    let (_, meta) = tokenizer_of(src)?;
    let refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let mut file = std::fs::File::create(dst)?;
    gguf_file::write(&mut file, &refs, &[])?;
    Ok(())
}

/// The tiny vocabulary and its `tokenizer.ggml.*` entries (but EOS and BOS use): byte-level
/// BPE (256 byte symbols, a few merges, `words`) or SentencePiece; ChatML specials last.
fn tiny_vocab(spec: &TinySpec) -> (Vec<String>, Vec<(String, Value)>) {
    let strings = |v: &[String]| Value::Array(v.iter().map(|t| Value::String(t.clone())).collect());
    let (tokens, types, mut meta) = if spec.sentencepiece {
        spm_vocab()
    } else {
        bpe_vocab(spec)
    };
    meta.push(("tokenizer.ggml.tokens".into(), strings(&tokens)));
    meta.push((
        "tokenizer.ggml.token_type".into(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    ));
    (tokens, meta)
}

type Vocab = (Vec<String>, Vec<i32>, Vec<(String, Value)>);

/// A SentencePiece vocabulary: `<unk>`, `<s>`, `</s>`, the 256 byte tokens, then `▁` pieces
/// scored best first, the ChatML specials last.
fn spm_vocab() -> Vocab {
    let s = |x: &str| Value::String(x.to_string());
    let mut meta = Vec::new();
    let mut tokens: Vec<String>;
    let mut types: Vec<i32>;
    // <unk>, <s>, </s>, the 256 byte tokens, then pieces scored best first.
    tokens = vec!["<unk>".into(), "<s>".into(), "</s>".into()];
    types = vec![2, 3, 3];
    tokens.extend((0..=255u8).map(|b| format!("<0x{b:02X}>")));
    types.extend([6; 256]);
    let pieces = [
        "\u{2581}",
        "\u{2581}t",
        "he",
        "\u{2581}the",
        "in",
        "\u{2581}a",
        "an",
        "nt",
        "ant",
        "\u{2581}ant",
        "\u{2581}in",
        "en",
        "te",
        "ea",
        "\u{2581}te",
        "\u{2581}tea",
        "me",
        "\u{2581}them",
        "nd",
        "\u{2581}sa",
        "\u{2581}sand",
        "at",
        "ra",
        "\u{2581}ran",
        "ow",
        "\u{2581}row",
        "\u{2581}of",
        "ür",
        "Zür",
        "ty",
        "thi",
        "\u{2581}thi",
        "re",
        "e",
        "t",
        "h",
        "a",
        "n",
        "i",
        "s",
        "o",
        "r",
        "w",
        "d",
        "m",
    ];
    let mut scores = vec![0f32; tokens.len()];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push((*p).to_string());
        types.push(1);
        scores.push(-(i as f32));
    }
    for t in TINY_SPECIALS {
        tokens.push(t.to_string());
        types.push(3);
        scores.push(0.0);
    }
    meta.push(("tokenizer.ggml.model".into(), s("llama")));
    meta.push((
        "tokenizer.ggml.scores".into(),
        Value::Array(scores.into_iter().map(Value::F32).collect()),
    ));
    meta.push(("tokenizer.ggml.add_space_prefix".into(), Value::Bool(true)));
    meta.push(("tokenizer.ggml.bos_token_id".into(), Value::U32(1)));
    (tokens, types, meta)
}

/// The byte-level BPE vocabulary: 256 byte symbols, a few merges, `spec.words`, the ChatML
/// specials last.
fn bpe_vocab(spec: &TinySpec) -> Vocab {
    let s = |x: &str| Value::String(x.to_string());
    let mut meta = Vec::new();
    let mut tokens: Vec<String>;
    let mut types: Vec<i32>;
    tokens = crate::tokenizer::byte_alphabet()
        .iter()
        .map(|c| c.to_string())
        .collect();
    let merges = ["t h", "th e", "Ġ t", "Ġt he", "i n", "a n", "Ġ a"];
    tokens.extend(merges.iter().map(|m| m.replace(' ', "")));
    tokens.extend(spec.words.iter().map(|w| w.to_string()));
    types = vec![1i32; tokens.len()];
    for t in TINY_SPECIALS {
        tokens.push(t.to_string());
        types.push(3);
    }
    meta.push(("tokenizer.ggml.model".into(), s("gpt2")));
    let pre = spec.pre.unwrap_or(match spec.arch {
        Architecture::Qwen2 | Architecture::Qwen3 => "qwen2",
        Architecture::Llama | Architecture::Phi3 | Architecture::Gemma3 => "smollm",
    });
    meta.push(("tokenizer.ggml.pre".into(), s(pre)));
    let merges: Vec<String> = merges.iter().map(|m| m.to_string()).collect();
    let merges = Value::Array(merges.into_iter().map(Value::String).collect());
    meta.push(("tokenizer.ggml.merges".into(), merges));
    (tokens, types, meta)
}

/// Special tokens of the tiny vocabulary, after the 256 byte symbols and the merges.
pub const TINY_SPECIALS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Writes a tiny random model with a byte-level vocabulary (256 bytes, a few merges, ChatML
/// specials) to `path`.
#[allow(
    clippy::too_many_lines,
    reason = "writes a GGUF file field by field in the order the format lays them out"
)]
pub fn write_tiny_gguf(path: &Path, spec: &TinySpec) -> Result<()> {
    let dev = Device::Cpu;
    let a = spec.arch.as_str();
    let (tokens, tokenizer_meta) = match &spec.tokenizer_from {
        Some(file) => tokenizer_of(file)?,
        None => tiny_vocab(spec),
    };
    let vocab = tokens.len();
    let eos = (vocab - 1) as u32; // <|im_end|>
    let s = |x: &str| Value::String(x.to_string());
    let u = |x: usize| Value::U32(x as u32);
    let mut meta: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(a)),
        // Not "tiny-phi3": llama.cpp applies Phi-3's tokenizer quirks (and looks for `</s>`)
        // by the name, and this vocabulary is byte-level BPE, not Phi-3's.
        (
            "general.name".into(),
            if spec.phi3_name {
                s("tiny-phi3")
            } else {
                s(&format!("tiny-{}", a.replace("phi3", "phi-three")))
            },
        ),
        (format!("{a}.block_count"), u(spec.n_layer)),
        (format!("{a}.context_length"), u(4096)),
        (format!("{a}.embedding_length"), u(spec.n_embd)),
        (format!("{a}.feed_forward_length"), u(spec.n_ff)),
        (format!("{a}.attention.head_count"), u(spec.n_head)),
        (format!("{a}.attention.head_count_kv"), u(spec.n_kv_head)),
        (
            format!("{a}.rope.freq_base"),
            // Gemma 3's global layers use a base of their own (the sliding ones 10000).
            Value::F32(if spec.arch == Architecture::Gemma3 {
                1_000_000.0
            } else {
                10_000.0
            }),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-6),
        ),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(eos)),
        ("tokenizer.ggml.add_bos_token".into(), Value::Bool(false)),
    ];
    // A borrowed tokenizer brings its own special ids.
    meta.retain(|(k, _)| !tokenizer_meta.iter().any(|(t, _)| t == k));
    meta.extend(tokenizer_meta);
    if let Some(d) = spec.head_dim {
        meta.push((format!("{a}.attention.key_length"), u(d)));
        meta.push((format!("{a}.attention.value_length"), u(d)));
    }
    meta.extend(spec.extra.iter().cloned());

    let mut draw = Draw {
        seed: spec.seed,
        fast: spec.real_vocab.is_some(),
        format: spec.real_format,
        matrices: 0,
    };
    let rows = spec.real_vocab.unwrap_or(vocab).max(vocab);
    let (e, f) = (spec.n_embd, spec.n_ff);
    let hd = spec.head_dim.unwrap_or(spec.n_embd / spec.n_head);
    let (qw, kv) = (spec.n_head * hd, spec.n_kv_head * hd);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let f32q = |t: Tensor| QTensor::quantize(&t, GgmlDType::F32);
    tensors.push(("token_embd.weight".into(), draw.matrix((rows, e), 1.0)?));
    tensors.push((
        "output_norm.weight".into(),
        f32q((draw.values((1, e), 0.1)? + 1.0)?.squeeze(0)?)?,
    ));
    if let Some(factors) = &spec.rope_freqs {
        let n = factors.len();
        let t = Tensor::from_vec(factors.clone(), n, &dev)?;
        tensors.push(("rope_freqs.weight".into(), f32q(t)?));
    }
    if spec.output_head {
        let head = draw.matrix((rows, e), 4.0 / (e as f32).sqrt())?;
        tensors.push(("output.weight".into(), head));
    }
    let ws = 1.0 / (e as f32).sqrt();
    for l in 0..spec.n_layer {
        let p = format!("blk.{l}");
        tensors.push((
            format!("{p}.attn_norm.weight"),
            f32q((draw.values((1, e), 0.1)? + 1.0)?.squeeze(0)?)?,
        ));
        tensors.push((
            format!("{p}.ffn_norm.weight"),
            f32q((draw.values((1, e), 0.1)? + 1.0)?.squeeze(0)?)?,
        ));
        let fused = spec.arch == Architecture::Phi3;
        // Phi-3 keeps Q, K and V in one matrix (in that order) and gate and up in another.
        let projections: &[(&str, usize, usize)] = if fused {
            &[("attn_qkv", qw + 2 * kv, e), ("attn_output", e, qw)]
        } else {
            &[
                ("attn_q", qw, e),
                ("attn_k", kv, e),
                ("attn_v", kv, e),
                ("attn_output", e, qw),
            ]
        };
        for &(name, out, inp) in projections {
            let sharp = if matches!(name, "attn_q" | "attn_k" | "attn_qkv") {
                spec.qk_scale
            } else {
                1.0
            };
            let scale = sharp / (inp as f32).sqrt();
            tensors.push((
                format!("{p}.{name}.weight"),
                draw.matrix((out, inp), scale)?,
            ));
        }
        if spec.arch == Architecture::Gemma3 {
            for name in ["post_attention_norm", "post_ffw_norm"] {
                tensors.push((
                    format!("{p}.{name}.weight"),
                    f32q((draw.values((1, e), 0.1)? + 1.0)?.squeeze(0)?)?,
                ));
            }
        }
        if spec.arch.qk_norm() {
            for name in ["attn_q_norm", "attn_k_norm"] {
                tensors.push((
                    format!("{p}.{name}.weight"),
                    f32q((draw.values((1, hd), 0.1)? + 1.0)?.squeeze(0)?)?,
                ));
            }
        }
        if spec.arch.qkv_bias() {
            for (name, out) in [("attn_q", qw), ("attn_k", kv), ("attn_v", kv)] {
                tensors.push((
                    format!("{p}.{name}.bias"),
                    f32q(draw.values((1, out), 0.1)?.squeeze(0)?)?,
                ));
            }
        }
        if fused {
            tensors.push((format!("{p}.ffn_up.weight"), draw.matrix((2 * f, e), ws)?));
        } else {
            tensors.push((format!("{p}.ffn_gate.weight"), draw.matrix((f, e), ws)?));
            tensors.push((format!("{p}.ffn_up.weight"), draw.matrix((f, e), ws)?));
        }
        tensors.push((
            format!("{p}.ffn_down.weight"),
            draw.matrix((e, f), 1.0 / (f as f32).sqrt())?,
        ));
    }
    let meta_refs: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut file = std::fs::File::create(path)?;
    gguf_file::write(&mut file, &meta_refs, &tensor_refs)?;
    Ok(())
}

/// A prefill of `ids` run in pieces cut at `cuts` (strictly increasing, inside `ids`), each
/// piece attending to the cache the ones before it left: the cache and the last position's
/// logits. Against [`crate::Model::prefill`] it shows whether this CPU's kernels give a row
/// the same numbers whatever batch computes it, which every "bit for bit after a split"
/// claim (a stored first chunk, an escalation's kept rows) rests on.
pub fn prefill_in_pieces(
    m: &crate::Model,
    ids: &[u32],
    cuts: &[usize],
) -> Result<(crate::KvCache, Vec<f32>)> {
    let mut bounds = vec![0];
    bounds.extend_from_slice(cuts);
    bounds.push(ids.len());
    if bounds.windows(2).any(|w| w[0] >= w[1]) {
        return Err(crate::error::EngineError::InvalidInput(format!(
            "cuts {cuts:?} must increase strictly inside 0..{}",
            ids.len()
        )));
    }
    let mut cache = m.new_cache();
    let mut last = None;
    for w in bounds.windows(2) {
        let positions: Vec<usize> = (w[0]..w[1]).collect();
        last = Some(m.forward(&ids[w[0]..w[1]], &positions, &mut cache, false)?);
    }
    let logits = match last {
        Some(out) => m.last_logits(&out)?,
        None => Vec::new(),
    };
    Ok((cache, logits))
}

/// Writes the tiny model of `spec` to `path` and loads it with every projection on the
/// dense path (`dense_min_rows: 1`), as the blend tests run it.
pub fn load_tiny(path: &Path, spec: &TinySpec) -> Result<crate::Model> {
    write_tiny_gguf(path, spec)?;
    crate::Model::load(
        path,
        &crate::LoadOptions {
            dense_min_rows: 1,
            ..Default::default()
        },
    )
}

/// Three short documents in the tiny vocabulary's letters, and a question over them.
pub const TINY_DOCS: [&str; 3] = [
    "the thin ant ran in the sand and then the ant sat",
    "an ant and the other ant than the thing in a tin",
    "a hint: the antenna is in the attic near the tent",
];
/// The question asked over [`TINY_DOCS`].
pub const TINY_QUESTION: &str = "where is the antenna?";

/// A RAG prompt of [`TINY_DOCS`] under the default template, with its prefix KV and each
/// chunk's KV precomputed both ways (alone, and after the prefix).
pub struct TinyRag {
    pub asm: crate::Assembly,
    pub prefix: crate::PrefixKv,
    pub standalone: Vec<crate::ChunkKv>,
    pub after_prefix: Vec<crate::ChunkKv>,
}

impl TinyRag {
    /// The prompt of every document of [`TINY_DOCS`] on `m`.
    pub fn new(m: &crate::Model) -> Result<Self> {
        Self::of(m, &TINY_DOCS)
    }

    /// The prompt of `docs` and [`TINY_QUESTION`] on `m`.
    pub fn of(m: &crate::Model, docs: &[&str]) -> Result<Self> {
        use crate::reuse::chunk::Precompute;
        let asm = crate::RagTemplate::default().assemble(m.tokenizer(), docs, TINY_QUESTION);
        let prefix = m.prefix_kv(&asm.ids[asm.prefix_range()])?;
        let chunk_ids: Vec<&[u32]> = asm.chunks().map(|s| &asm.ids[s.ids.clone()]).collect();
        let standalone = chunk_ids
            .iter()
            .map(|ids| m.precompute(ids, None))
            .collect::<Result<_>>()?;
        let after_prefix = chunk_ids
            .iter()
            .map(|ids| m.precompute(ids, Some(&prefix)))
            .collect::<Result<_>>()?;
        Ok(Self {
            asm,
            prefix,
            standalone,
            after_prefix,
        })
    }
}

/// The largest absolute difference between two equally long slices (panics on a length
/// mismatch: a test's bug).
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "compared slices differ in length");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max)
}
