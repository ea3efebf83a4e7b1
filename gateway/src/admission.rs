//! Memory admission: a request runs only when the KV it will hold fits the server's KV memory
//! budget, so no prompt the limits accept can exhaust the host.
//!
//! A request's KV is what it holds at once: the reused (blended) cache of its prompt and
//! answer, the chunk KV loaded to build it, the full cache a guard's escalation or
//! verification computes beside it, and the drafter's cache when speculative decoding runs.
//! The engine thread answers one query at a time, so a request is admitted against the whole
//! budget; one that cannot fit is refused (503 with `Retry-After`, naming the budget and what
//! the request needs) before any model work, instead of being killed by the kernel's OOM
//! killer mid-prefill.

use crate::error::GatewayError;

/// The context limit every family is served with unless `--max-context-tokens` says
/// otherwise: a GGUF's own context (131,072 for Llama 3, 40,960 for Qwen3) is a ceiling, not a
/// default, because KV grows with it.
pub const DEFAULT_MAX_CONTEXT_TOKENS: usize = 32_768;

/// The context limit of a target whose file claims `model_context` tokens, unless
/// `--max-context-tokens` says otherwise.
pub fn default_context(model_context: usize) -> usize {
    model_context.min(DEFAULT_MAX_CONTEXT_TOKENS)
}

/// The KV budget when `--kv-memory-budget` is not given: this share of the host's memory.
pub const DEFAULT_BUDGET_SHARE: f64 = 0.5;

/// The budget when the host's memory cannot be read.
pub const FALLBACK_BUDGET_BYTES: u64 = 8 << 30;

/// Bytes one token's KV takes in one cache of a model: keys and values of every layer, f32
/// rows (the engine's cache dtype).
pub fn kv_bytes_per_token(c: &target_engine::ModelConfig) -> u64 {
    (c.n_layer * 2 * c.n_kv_head * c.head_dim * std::mem::size_of::<f32>()) as u64
}

/// What one request will hold, in the units the budget counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// Prompt and answer tokens.
    pub tokens: u64,
    /// Target caches of `tokens` held at once (the reused cache, the chunk KV it was built
    /// from, the full cache of an escalation or verification).
    pub caches: u64,
    /// Bytes of one token in one target cache.
    pub target_per_token: u64,
    /// Bytes of one token in the drafter's cache (0 without speculative decoding).
    pub drafter_per_token: u64,
}

impl Need {
    /// The bytes in all.
    pub fn bytes(&self) -> u64 {
        self.tokens
            .saturating_mul(self.target_per_token.saturating_mul(self.caches))
            .saturating_add(self.tokens.saturating_mul(self.drafter_per_token))
    }
}

/// Refuses `need` when it does not fit `budget` bytes.
pub fn admit(need: &Need, budget: u64) -> Result<(), GatewayError> {
    let bytes = need.bytes();
    if bytes <= budget {
        return Ok(());
    }
    Err(GatewayError::OverCapacity(format!(
        "this request's KV needs {} ({} tokens of prompt and answer in {} caches{}) and the \
         server's KV memory budget is {} (--kv-memory-budget); lower top_k, max_tokens or \
         max_context_tokens, or ask with fidelity `fast`",
        gib(bytes),
        need.tokens,
        need.caches,
        if need.drafter_per_token > 0 {
            " and the drafter's"
        } else {
            ""
        },
        gib(budget),
    )))
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / f64::from(1u32 << 30))
}

/// The default budget: [`DEFAULT_BUDGET_SHARE`] of `MemTotal` in `/proc/meminfo`, or
/// [`FALLBACK_BUDGET_BYTES`] where it cannot be read.
pub fn default_budget() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| mem_total(&t))
        .map_or(FALLBACK_BUDGET_BYTES, |b| {
            (b as f64 * DEFAULT_BUDGET_SHARE) as u64
        })
}

/// `MemTotal` of a `/proc/meminfo` text, in bytes.
fn mem_total(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemTotal:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_that_fits_is_admitted_and_one_that_does_not_is_refused_naming_the_budget() {
        // Llama 3.2 1B: 16 layers, 8 kv heads of 64: 64 KiB a token in f32.
        let per = (16 * 2 * 8 * 64 * 4) as u64;
        // Issue 88: `fidelity: exact` over the file's 131,072 tokens held ~24 GiB of KV and
        // was killed by the OOM killer on a 16 GB host.
        let whole = Need {
            tokens: 131_072,
            caches: 3,
            target_per_token: per,
            drafter_per_token: 0,
        };
        let budget = 8 << 30;
        let e = admit(&whole, budget).expect_err("over the budget");
        assert_eq!(e.fault(), crate::error::Fault::Unavailable);
        let text = e.to_string();
        assert!(
            text.contains("24.00 GiB") && text.contains("8.00 GiB"),
            "{text}"
        );
        assert!(text.contains("--kv-memory-budget"), "{text}");
        let default = Need {
            tokens: DEFAULT_MAX_CONTEXT_TOKENS as u64,
            ..whole
        };
        admit(&default, budget).expect("32k tokens fit");
    }

    /// Issue 88: Llama 3 and Qwen3 files were served at the GGUF's context (131,072 /
    /// 40,960 tokens) unless the operator said otherwise.
    #[test]
    fn every_family_defaults_to_32k_tokens_of_context() {
        assert_eq!(default_context(131_072), 32_768);
        assert_eq!(default_context(40_960), 32_768);
        assert_eq!(default_context(8_192), 8_192);
    }

    #[test]
    fn the_host_memory_is_read_from_meminfo() {
        let text = "MemTotal:       16318196 kB\nMemFree:         1000 kB\n";
        assert_eq!(mem_total(text), Some(16_318_196 * 1024));
        assert_eq!(mem_total("MemFree: 3 kB"), None);
        assert!(default_budget() > 0);
    }
}
