//! Chunk reuse on the device: chunk KV precomputed once and kept in host memory (f16), the
//! fused cache built from it (one upload per chunk and layer, RoPE recovery on the device),
//! `target_probe`'s selection from the question's attention over the fused cache, the blended
//! prefill over the selected tokens and the question, and lossless verification of a greedy
//! answer decoded on the fused cache against the full-prefill cache. The same steps as the CPU
//! engine's `reuse` and `decode::verify`, on [`DeviceModel`].

use super::forward::PassHooks;
use super::{DeviceCache, DeviceModel, HostKv};
use crate::error::{EngineError, Result};
use std::ops::Range;
use std::time::Instant;

/// A RAG prompt's token layout: an exact prefix (system text), the retrieved chunks, and the
/// question (with whatever follows it), in that order.
#[derive(Debug, Clone)]
pub struct RagPrompt {
    pub prefix: Vec<u32>,
    pub chunks: Vec<Vec<u32>>,
    pub question: Vec<u32>,
}

impl RagPrompt {
    /// Every token in order.
    pub fn ids(&self) -> Vec<u32> {
        let mut ids = self.prefix.clone();
        self.chunks.iter().for_each(|c| ids.extend(c));
        ids.extend(&self.question);
        ids
    }

    /// Tokens in the prompt.
    pub fn len(&self) -> usize {
        self.prefix.len() + self.chunks.iter().map(Vec::len).sum::<usize>() + self.question.len()
    }

    /// True for a prompt without tokens.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Positions of each chunk.
    pub fn chunk_ranges(&self) -> Vec<Range<usize>> {
        let mut at = self.prefix.len();
        self.chunks
            .iter()
            .map(|c| {
                at += c.len();
                at - c.len()..at
            })
            .collect()
    }

    /// Every chunk position, in order.
    pub fn chunk_positions(&self) -> Vec<usize> {
        self.chunk_ranges().into_iter().flatten().collect()
    }

    /// Positions of the question.
    pub fn question_positions(&self) -> Range<usize> {
        self.len() - self.question.len()..self.len()
    }
}

/// Milliseconds spent in each part of a blended prefill, the device synchronized after each.
#[derive(Debug, Clone, Copy, Default)]
pub struct BlendTimes {
    /// Chunk and prefix KV from host memory into the fused cache (RoPE recovery included).
    pub load_ms: f64,
    /// The question's pass over the fused cache (target_probe's probe).
    pub probe_ms: f64,
    /// The forward over the selected tokens and the question.
    pub prefill_ms: f64,
}

/// What [`DeviceModel::verified_greedy`] did.
#[derive(Debug, Clone, Default)]
pub struct Verified {
    /// The answer: greedy decoding on the exact cache, token for token.
    pub tokens: Vec<u32>,
    /// Drafted tokens the exact cache accepted.
    pub accepted: usize,
    /// Checking passes run on the exact cache.
    pub rounds: usize,
}

/// How [`DeviceModel::blend_probe_timed`] blends: the share of chunk tokens the probe
/// recomputes, and whether the reused rows shift with the recomputed ones.
#[derive(Debug, Clone, Copy)]
pub struct ProbeBlend {
    /// The share of chunk tokens recomputed.
    pub ratio: f64,
    /// Whether the reused rows move as the recomputed rows did.
    pub shift: bool,
}

impl ProbeBlend {
    /// Recomputing `ratio` of the chunk tokens, the rest as stored.
    pub fn plain(ratio: f64) -> Self {
        Self {
            ratio,
            shift: false,
        }
    }

    /// Recomputing `ratio` of the chunk tokens, the rest shifted with them.
    pub fn shifted(ratio: f64) -> Self {
        Self { ratio, shift: true }
    }
}

impl DeviceModel {
    fn sync(&self) -> Result<()> {
        Ok(self.device().synchronize()?)
    }

    /// A chunk's KV computed on its own at positions `0..len` and copied to host memory in
    /// f16: what ingestion stores for it.
    pub fn precompute(&self, ids: &[u32]) -> Result<HostKv> {
        let (cache, _) = self.prefill(ids, ids.len())?;
        self.download(&cache, 0..ids.len())
    }

    /// The fused cache of `prompt`: the prefix's exact rows (copied on the device from
    /// `prefix`, the prefix's own cache, f16 values as every cache row), then
    /// each chunk's stored rows rotated to its place; room for `capacity` positions.
    pub fn fused(
        &self,
        prompt: &RagPrompt,
        prefix: &DeviceCache,
        chunks: &[HostKv],
        capacity: usize,
    ) -> Result<DeviceCache> {
        let ranges = prompt.chunk_ranges();
        if chunks.len() != ranges.len() || prefix.capacity < prompt.prefix.len() {
            return Err(EngineError::InvalidInput(format!(
                "{} chunk KVs and a prefix cache of {} rows for {} chunks and a prefix of {}",
                chunks.len(),
                prefix.capacity,
                ranges.len(),
                prompt.prefix.len()
            )));
        }
        let mut cache = self.new_cache(capacity.max(prompt.len()))?;
        cache.copy_rows(prefix, 0..prompt.prefix.len())?;
        for (kv, range) in chunks.iter().zip(ranges) {
            if kv.len != range.len() {
                return Err(EngineError::InvalidInput(format!(
                    "a chunk KV of {} rows for a chunk of {}",
                    kv.len,
                    range.len()
                )));
            }
            self.place(&mut cache, kv, range.start)?;
        }
        Ok(cache)
    }

    /// target_probe: the question runs over the fused cache through the deeper half of the
    /// layers; the `ceil(ratio × chunk tokens)` chunk positions it attends to most are
    /// returned, in order. The probe's K/V rows of the question are left in `cache` (the
    /// blended prefill rewrites them).
    pub fn select_probe(
        &self,
        prompt: &RagPrompt,
        cache: &mut DeviceCache,
        ratio: f64,
    ) -> Result<Vec<usize>> {
        let n_layer = self.config().n_layer;
        let candidates = prompt.chunk_positions();
        // `ceil(ρ × n)`, as the CPU selectors count it (reuse's `budget`; the wings stay apart).
        let n = candidates.len();
        let k = ((ratio.clamp(0.0, 1.0) * n as f64).ceil() as usize).min(n);
        if k == 0 {
            return Ok(Vec::new());
        }
        let positions: Vec<usize> = prompt.question_positions().collect();
        let mass = self.probe(&prompt.question, &positions, cache, n_layer / 2..n_layer)?;
        let mut order = candidates;
        let score = |p: usize| mass.get(p).copied().unwrap_or(0.0);
        order.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
        order.truncate(k);
        order.sort_unstable();
        Ok(order)
    }

    /// The blended prefill: the chunk tokens at `recompute` and the question run through every
    /// layer over the fused cache (their rows overwritten layer by layer); returns the last
    /// position's logits.
    pub fn blend(
        &self,
        prompt: &RagPrompt,
        cache: &mut DeviceCache,
        recompute: &[usize],
    ) -> Result<Vec<f32>> {
        self.blend_on(prompt, cache, recompute, false)
    }

    /// [`DeviceModel::blend`] with each chunk's reused rows moved at every layer as the
    /// chunk's recomputed rows moved, weighted by key similarity (`target_probe_shift`, the
    /// gateway's default method; the CPU engine's `Blend::blend_prefill_shift` with
    /// similarity weighting). A chunk without a recomputed token keeps its rows.
    pub fn blend_shift(
        &self,
        prompt: &RagPrompt,
        cache: &mut DeviceCache,
        recompute: &[usize],
    ) -> Result<Vec<f32>> {
        self.blend_on(prompt, cache, recompute, true)
    }

    /// [`DeviceModel::blend`], with `shift` [`DeviceModel::blend_shift`].
    fn blend_on(
        &self,
        prompt: &RagPrompt,
        cache: &mut DeviceCache,
        recompute: &[usize],
        shift: bool,
    ) -> Result<Vec<f32>> {
        let (rows, positions) = blend_rows(prompt, recompute)?;
        let shift = match shift {
            true => Some(self.shift_groups(&positions, &prompt.chunk_ranges())?),
            false => None,
        };
        let n_layer = self.config().n_layer;
        let hooks = PassHooks {
            probe: None,
            shift: shift.as_ref(),
        };
        let (x, _) = self.run(&rows, &positions, cache, 0..n_layer, hooks)?;
        let hidden = super::forward::fused_rms_norm(&x, &self.output_norm, self.config().rms_eps)?;
        self.last_logits(&hidden)
    }

    /// [`DeviceModel::fused`], [`DeviceModel::select_probe`] at `how.ratio` and
    /// [`DeviceModel::blend`] (with `how.shift`, [`DeviceModel::blend_shift`]:
    /// `target_probe_shift`) in a row, timed part by part: the fused cache, the recomputed
    /// positions, the logits and the times.
    pub fn blend_probe_timed(
        &self,
        prompt: &RagPrompt,
        prefix: &DeviceCache,
        chunks: &[HostKv],
        how: ProbeBlend,
        capacity: usize,
    ) -> Result<(DeviceCache, Vec<usize>, Vec<f32>, BlendTimes)> {
        let ProbeBlend { ratio, shift } = how;
        let ms = |t: Instant| t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut cache = self.fused(prompt, prefix, chunks, capacity)?;
        self.sync()?;
        let load_ms = ms(t);
        let t = Instant::now();
        let recompute = self.select_probe(prompt, &mut cache, ratio)?;
        self.sync()?;
        let probe_ms = ms(t);
        let t = Instant::now();
        let logits = self.blend_on(prompt, &mut cache, &recompute, shift)?;
        self.sync()?;
        let times = BlendTimes {
            load_ms,
            probe_ms,
            prefill_ms: ms(t),
        };
        Ok((cache, recompute, logits, times))
    }

    /// Lossless verification: `n` greedy tokens after position `len`, drafted `depth` at a
    /// time on the approximate cache `draft` (next-token logits `draft_logits`) and checked in
    /// one pass each on the exact cache `exact` (`exact_logits`); the first disagreement is
    /// replaced by the exact cache's token. The answer is what greedy decoding on `exact`
    /// gives, up to the rounding of a checking pass of several rows against one-row steps.
    #[allow(
        clippy::too_many_arguments,
        reason = "two caches with their logits, where they end, and the budget of the answer"
    )]
    pub fn verified_greedy(
        &self,
        exact: &mut DeviceCache,
        exact_logits: &[f32],
        draft: &mut DeviceCache,
        draft_logits: &[f32],
        len: usize,
        n: usize,
        depth: usize,
    ) -> Result<Verified> {
        let depth = depth.max(1);
        let mut out = Verified::default();
        let (mut pos, mut want) = (len, crate::argmax(exact_logits));
        let mut guess = crate::argmax(draft_logits);
        while out.tokens.len() < n {
            let m = depth.min(n - out.tokens.len());
            let mut drafted = Vec::with_capacity(m);
            for i in 0..m {
                drafted.push(guess);
                let h = self.forward(&[guess], &[pos + i], draft)?;
                guess = crate::argmax(&self.last_logits(&h)?);
            }
            let positions: Vec<usize> = (pos..pos + m).collect();
            let rows = self.logits(&self.forward(&drafted, &positions, exact)?)?;
            out.rounds += 1;
            let mut targets = vec![want];
            targets.extend(rows.iter().take(m - 1).map(|r| crate::argmax(r)));
            let agree = drafted
                .iter()
                .zip(&targets)
                .take_while(|(a, b)| a == b)
                .count();
            out.accepted += agree;
            if agree == m {
                out.tokens.extend(&drafted);
                want = crate::argmax(&rows[m - 1]);
                pos += m;
                continue;
            }
            out.tokens.extend(&drafted[..agree]);
            let fix = targets[agree];
            out.tokens.push(fix);
            let at = pos + agree;
            want = crate::argmax(&self.last_logits(&self.forward(&[fix], &[at], exact)?)?);
            guess = crate::argmax(&self.last_logits(&self.forward(&[fix], &[at], draft)?)?);
            pos = at + 1;
        }
        out.tokens.truncate(n);
        Ok(out)
    }
}

/// The token ids and positions a blended prefill of `prompt` runs: the chunk tokens at
/// `recompute` and the question, sorted.
fn blend_rows(prompt: &RagPrompt, recompute: &[usize]) -> Result<(Vec<u32>, Vec<usize>)> {
    let ids = prompt.ids();
    let mut positions = recompute.to_vec();
    positions.extend(prompt.question_positions());
    positions.sort_unstable();
    positions.dedup();
    if let Some(&bad) = positions.iter().find(|&&p| p >= ids.len()) {
        return Err(EngineError::InvalidInput(format!(
            "position {bad} is beyond the prompt's {} tokens",
            ids.len()
        )));
    }
    let rows = positions.iter().map(|&p| ids[p]).collect();
    Ok((rows, positions))
}
