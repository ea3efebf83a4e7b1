//! Memory admission: a request runs only when the KV it will hold fits the server's KV memory
//! budget, so no prompt the limits accept can exhaust the host.
//!
//! A request's KV is what it holds at once: the reused (blended) cache of its prompt and
//! answer, the chunk KV loaded to build it, the full cache a guard's escalation or
//! verification computes beside it, and the drafter's cache when speculative decoding runs.
//! A request larger than the whole budget is refused (503 with `Retry-After`, naming the budget
//! and what the request needs) before any model work, instead of being killed by the kernel's
//! OOM killer mid-prefill. Requests run side by side (the engine's query threads), so each
//! one's KV is reserved in the pipeline's [`KvLedger`] before its model work starts and given
//! back when it ends; one that fits the budget but not beside the requests running now waits
//! for them (its deadline and its client still stop it).

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

/// Bytes one token's KV takes in one cache of a model on the CPU engine: keys and values of
/// every layer, f32 rows (its cache dtype).
pub fn kv_bytes_per_token(c: &target_engine::ModelConfig) -> u64 {
    kv_bytes_per_token_of(c, std::mem::size_of::<f32>())
}

/// Bytes one token's KV takes in one cache of a model on the CPU engine attending at
/// `attention`: f32 rows, and under bf16 attention their bf16 copy beside them (`KvCache`
/// keeps both, the copy filled by the first bf16 forward over the cache).
pub fn cpu_kv_bytes_per_token(
    c: &target_engine::ModelConfig,
    attention: kernels::AttentionPrecision,
) -> u64 {
    with_attention_copy(kv_bytes_per_token(c), attention)
}

/// `f32_bytes` of f32 rows and, under bf16 attention, their bf16 copy (half as many bytes).
fn with_attention_copy(f32_bytes: u64, attention: kernels::AttentionPrecision) -> u64 {
    match attention {
        kernels::AttentionPrecision::F32 => f32_bytes,
        kernels::AttentionPrecision::Bf16 => f32_bytes + f32_bytes / 2,
    }
}

/// Bytes one token's KV takes in one cache of a model whose cache holds `bytes` per value.
pub fn kv_bytes_per_token_of(c: &target_engine::ModelConfig, bytes: usize) -> u64 {
    (c.n_layer * 2 * c.n_kv_head * c.head_dim * bytes) as u64
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

/// The KV the running requests have reserved, against the budget.
#[derive(Debug, Default)]
pub struct KvLedger {
    held: std::sync::Mutex<u64>,
    freed: std::sync::Condvar,
}

/// How often a request waiting for KV memory checks its stop condition.
const WAIT_POLL: std::time::Duration = std::time::Duration::from_millis(20);

impl KvLedger {
    /// Bytes reserved now.
    pub fn held(&self) -> u64 {
        *self.held.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Reserves `need` within `budget` for as long as the returned reservation lives: refused
    /// at once when it could never fit ([`admit`]), else waits until the running requests
    /// leave room, or until this thread's stop condition (the request's deadline, its client
    /// leaving) ends the wait.
    pub fn reserve(&self, need: &Need, budget: u64) -> Result<Reservation<'_>, GatewayError> {
        admit(need, budget)?;
        let bytes = need.bytes();
        let mut held = self.held.lock().unwrap_or_else(|e| e.into_inner());
        while held.saturating_add(bytes) > budget {
            target_engine::stop::check()?;
            held = self
                .freed
                .wait_timeout(held, WAIT_POLL)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        *held += bytes;
        Ok(Reservation {
            ledger: self,
            bytes,
        })
    }
}

/// KV bytes reserved in a [`KvLedger`], given back when dropped.
#[derive(Debug)]
pub struct Reservation<'a> {
    ledger: &'a KvLedger,
    bytes: u64,
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        let mut held = self.ledger.held.lock().unwrap_or_else(|e| e.into_inner());
        *held = held.saturating_sub(self.bytes);
        self.ledger.freed.notify_all();
    }
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

/// The share of a GPU's free memory (after the weights loaded) a device target's default
/// budget takes: the rest is the passes' own working memory.
pub const DEVICE_BUDGET_SHARE: f64 = 0.8;

/// The default budget of a device target with `used` of `total` bytes of GPU memory in use
/// once its weights are loaded: the host's default or [`DEVICE_BUDGET_SHARE`] of what the GPU
/// has free, whichever is less (the device cache lives on the GPU, chunk KV on both).
pub fn device_budget(host: u64, used: u64, total: u64) -> u64 {
    let free = total.saturating_sub(used);
    host.min((free as f64 * DEVICE_BUDGET_SHARE) as u64)
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
    fn a_device_targets_budget_is_what_its_gpu_has_free_at_most() {
        let gib = 1u64 << 30;
        // An H200 with a 7B model's bf16 weights loaded: 124 GiB free, 99.2 GiB of budget
        // under a 128 GiB host's 64.
        assert_eq!(device_budget(64 * gib, 16 * gib, 140 * gib), 64 * gib);
        let small = device_budget(64 * gib, 70 * gib, 80 * gib);
        assert_eq!(small, (10.0 * gib as f64 * DEVICE_BUDGET_SHARE) as u64);
        assert_eq!(device_budget(64 * gib, 90 * gib, 80 * gib), 0);
    }

    /// Under `--attention bf16` a CPU cache holds a bf16 copy of its f32 rows: admission
    /// counted the f32 rows only, so the KV held was 1.5x what was reserved.
    #[test]
    fn bf16_attention_counts_the_copy_of_the_rows() {
        use kernels::AttentionPrecision::{Bf16, F32};
        let per = (16 * 2 * 8 * 64 * 4) as u64;
        assert_eq!(with_attention_copy(per, F32), per);
        assert_eq!(with_attention_copy(per, Bf16), per * 3 / 2);
    }

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
    fn a_request_that_fits_only_alone_waits_for_the_running_ones_and_stops_with_its_caller() {
        let need = |tokens| Need {
            tokens,
            caches: 1,
            target_per_token: 1,
            drafter_per_token: 0,
        };
        let ledger = std::sync::Arc::new(KvLedger::default());
        let first = ledger.reserve(&need(60), 100).expect("fits");
        assert_eq!(ledger.held(), 60);
        // 50 more does not fit beside the 60 held: it waits until they are given back.
        let (l, started) = (std::sync::Arc::clone(&ledger), std::time::Instant::now());
        let waiter = std::thread::spawn(move || {
            let r = l.reserve(&need(50), 100).map(|r| r.bytes);
            (r.ok(), started.elapsed())
        });
        std::thread::sleep(std::time::Duration::from_millis(150));
        assert!(
            !waiter.is_finished(),
            "admitted beside a request it does not fit beside"
        );
        drop(first);
        let (got, waited) = waiter.join().expect("no panic");
        assert_eq!(got, Some(50));
        assert!(waited >= std::time::Duration::from_millis(150));
        assert_eq!(ledger.held(), 0, "given back when dropped");
        // A waiting request whose caller stops (deadline, client gone) stops waiting.
        let _held = ledger.reserve(&need(100), 100).expect("the whole budget");
        let stop: target_engine::stop::StopFn = std::sync::Arc::new(|| true);
        let e = target_engine::stop::with_stop(Some(stop), || ledger.reserve(&need(1), 100))
            .expect_err("stopped while waiting");
        assert!(matches!(
            e,
            GatewayError::Engine(target_engine::EngineError::Stopped)
        ));
        // One larger than the whole budget never waits: refused at once.
        let e = ledger.reserve(&need(101), 100).expect_err("never fits");
        assert_eq!(e.fault(), crate::error::Fault::Unavailable);
    }

    #[test]
    fn the_host_memory_is_read_from_meminfo() {
        let text = "MemTotal:       16318196 kB\nMemFree:         1000 kB\n";
        assert_eq!(mem_total(text), Some(16_318_196 * 1024));
        assert_eq!(mem_total("MemFree: 3 kB"), None);
        assert!(default_budget() > 0);
    }
}
