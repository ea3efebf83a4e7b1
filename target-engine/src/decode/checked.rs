//! Greedy decoding on any [`Engine`], plain or verified token for token: drafts decoded on an
//! approximate (reused) cache, checked in one pass each on the exact (full-prefill) cache.
//! What the device engine answers with; the CPU engine's served verification
//! ([`crate::decode::verify`]) adds streaming, sampling and its checking batches' exact decode
//! path on top of the same rule.

use crate::engine::Engine;
use crate::error::{EngineError, Result};
use crate::sampling::argmax;

/// What [`verified_greedy`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Verified {
    /// The answer: greedy decoding on the exact cache, token for token.
    pub tokens: Vec<u32>,
    /// Drafted tokens the exact cache accepted.
    pub accepted: usize,
    /// Checking passes run on the exact cache.
    pub rounds: usize,
}

/// The last row's logits of a one-token pass.
fn step<E: Engine>(engine: &E, cache: &mut E::Cache, id: u32, at: usize) -> Result<Vec<f32>> {
    engine
        .pass(&[id], &[at], cache, false)?
        .pop()
        .ok_or_else(|| EngineError::Internal("a pass returned no logits".into()))
}

/// `n` greedy tokens after a cache filled up to `len` whose next-token logits are `logits`,
/// one row per step (the cache grown to hold them).
pub fn greedy<E: Engine>(
    engine: &E,
    cache: &mut E::Cache,
    len: usize,
    logits: &[f32],
    n: usize,
) -> Result<Vec<u32>> {
    engine.reserve_cache(cache, n)?;
    let mut out = Vec::with_capacity(n);
    let mut next = argmax(logits);
    for i in 0..n {
        out.push(next);
        if i + 1 < n {
            next = argmax(&step(engine, cache, next, len + i)?);
        }
    }
    Ok(out)
}

/// Lossless verification: `n` greedy tokens after position `len`, drafted `depth` at a time on
/// the approximate cache `draft` (next-token logits `draft_logits`) and checked in one pass
/// each on the exact cache `exact` (`exact_logits`); the first disagreement is replaced by the
/// exact cache's token. The answer is what greedy decoding on `exact` gives, up to the
/// rounding of a checking pass of several rows against one-row steps.
#[allow(
    clippy::too_many_arguments,
    reason = "two caches with their logits, where they end, and the budget of the answer"
)]
pub fn verified_greedy<E: Engine>(
    engine: &E,
    exact: &mut E::Cache,
    exact_logits: &[f32],
    draft: &mut E::Cache,
    draft_logits: &[f32],
    len: usize,
    n: usize,
    depth: usize,
) -> Result<Verified> {
    let depth = depth.max(1);
    engine.reserve_cache(exact, n + depth)?;
    engine.reserve_cache(draft, n + depth)?;
    let mut out = Verified::default();
    let (mut pos, mut want) = (len, argmax(exact_logits));
    let mut guess = argmax(draft_logits);
    while out.tokens.len() < n {
        let m = depth.min(n - out.tokens.len());
        let mut drafted = Vec::with_capacity(m);
        for i in 0..m {
            drafted.push(guess);
            guess = argmax(&step(engine, draft, guess, pos + i)?);
        }
        let positions: Vec<usize> = (pos..pos + m).collect();
        let rows = engine.pass(&drafted, &positions, exact, true)?;
        out.rounds += 1;
        let mut targets = vec![want];
        targets.extend(rows.iter().take(m - 1).map(|r| argmax(r)));
        let agree = drafted
            .iter()
            .zip(&targets)
            .take_while(|(a, b)| a == b)
            .count();
        out.accepted += agree;
        if agree == m {
            out.tokens.extend(&drafted);
            want = argmax(&rows[m - 1]);
            pos += m;
            continue;
        }
        out.tokens.extend(&drafted[..agree]);
        let fix = targets[agree];
        out.tokens.push(fix);
        let at = pos + agree;
        want = argmax(&step(engine, exact, fix, at)?);
        guess = argmax(&step(engine, draft, fix, at)?);
        pos = at + 1;
    }
    out.tokens.truncate(n);
    Ok(out)
}
