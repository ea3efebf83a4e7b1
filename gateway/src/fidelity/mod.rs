//! How much answer quality a request may trade for speed (`fidelity`), and what the fidelity
//! guard measured and decided for it (`reuse.guard`).
//!
//! A fixed ρ cannot promise quality for the request in front of the user. The guard watches
//! the request itself, with two free signals: a decode from the reused cache that falls into
//! a loop (a run of [`target_engine::decode::repetition::DEFAULT_LOOP_TOKENS`] tokens repeated, as
//! the README's demo question did under reuse and not under full recompute), and a token
//! chosen by a top-2 logit gap under [`GuardPolicy::margin`] (where reuse's small change to
//! the logits can flip greedy's choice; docs/fidelity-guard.md measures it). A doubted token
//! first gets a second look ([`GuardPolicy::second_look`]): a share more of the chunk tokens
//! recomputed and the answer decoded again from that cache; where it chooses the same
//! tokens (the doubted one by at least [`GuardPolicy::confirm_gap`]), decoding goes on from
//! it, still guarded; with [`GuardPolicy::look_answers`] set, the look's own tokens answer,
//! each held to that gap. When a loop is seen, or the second look chooses otherwise or doubts again,
//! the full prefill of the same prompt is computed, the tokens decoded so far are checked
//! against it, the agreeing prefix is kept and decoding goes on from the full cache, so the
//! answer is the full-recompute answer and the user never sees a loop full recompute would
//! not have produced.
//!
//! This file holds the policy (what a request asks for, when the guard doubts, what it
//! reports); `drive.rs` runs it over a query's decode.

pub(crate) mod drive;

use serde::{Deserialize, Serialize};

/// The quality a request asks for (`fidelity` in the API, `--fidelity` on the command line).
#[derive(
    Debug,
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    clap::ValueEnum,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum Fidelity {
    /// Reuse as the method selects; no guard.
    Fast,
    /// Reuse, guarded: a decode that chooses a token by a top-2 logit gap under the guard's
    /// margin is decoded again with more chunk tokens recomputed, and goes on from there where
    /// that chooses the same tokens; one that falls into a loop, or that the second look does
    /// not confirm, moves to the full cache and answers as full recompute would (the
    /// default).
    #[default]
    Balanced,
    /// Verified decoding: token for token the full-recompute answer (`verify: true`).
    Exact,
}

impl Fidelity {
    /// Every level, in the order of the API's documentation.
    pub const ALL: [Fidelity; 3] = [Self::Fast, Self::Balanced, Self::Exact];

    /// The API's name.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Fast => "fast",
            Self::Balanced => "balanced",
            Self::Exact => "exact",
        }
    }

    /// The level an API or CLI name stands for.
    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == s)
    }
}

/// What the fidelity guard measured and decided for one request (`reuse.guard`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize, utoipa::ToSchema)]
pub struct GuardReport {
    /// The request's fidelity.
    pub fidelity: Fidelity,
    /// The decode from the reused cache fell into a loop.
    pub loop_detected: bool,
    /// A token decoded from the reused cache was chosen by less than the guard's margin
    /// (and no loop was seen first).
    pub uncertain: bool,
    /// The smallest top-2 logit gap among the tokens decoded from the reused cache (absent
    /// when nothing was: full recompute, verified decoding).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_margin: Option<f32>,
    /// The top-2 gap under which the guard escalated this request: the server's
    /// `--guard-margin`, else the method's own (absent where no gap was watched: `fast`,
    /// `exact`, full recompute).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub margin: Option<f32>,
    /// A second look ran: more chunk tokens recomputed and the answer so far checked on
    /// that cache (where it agreed, decoding went on from it; where not, the request
    /// escalated).
    #[serde(default)]
    pub second_look: bool,
    /// Second looks that ran (`--guard-looks` bounds them; 0 without one).
    #[serde(default)]
    pub second_looks: u32,
    /// Chunk tokens the second looks recomputed on top of the method's, all looks together.
    #[serde(default)]
    pub second_look_tokens: usize,
    /// Time of the second looks' recompute, all together (0 without one).
    #[serde(default)]
    pub second_look_ms: f64,
    /// The guard doubted a token but ran no second look: an escalation after one was
    /// estimated to cost more than `--guard-look-cost` times full recompute's prefill
    /// ([`LookCost`]), so the request escalated at once.
    #[serde(default)]
    pub second_look_skipped: bool,
    /// The top-2 logit gap by which the last second look chose its doubted token again: it
    /// kept the token where this reached `--guard-confirm-gap` (absent where no look ran, or
    /// it chose another token first).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second_look_gap: Option<f32>,
    /// The second look chose other tokens than the first decode and the answer is the
    /// look's (`--guard-look-answers`); the first decode's tokens after the two parted are
    /// counted in `withdrawn_tokens`.
    #[serde(default)]
    pub second_look_answered: bool,
    /// The request moved to the full cache (its answer is full recompute's).
    pub escalated: bool,
    /// Tokens decoded from the reused cache that the full cache agreed with and were kept.
    pub kept_tokens: usize,
    /// Tokens decoded from the reused cache that were withdrawn.
    pub withdrawn_tokens: usize,
    /// Time of the full prefill the escalation ran (0 without one, or from the context cache).
    pub full_prefill_ms: f64,
    /// Leading prompt rows that full prefill kept from the reused cache instead of computing:
    /// the template prefix and the first chunk, precomputed after it (0: it computed every
    /// row, or none ran).
    #[serde(default)]
    pub full_prefill_kept_rows: usize,
}

/// When the guard of a `balanced` request escalates besides a loop: a token among the first
/// `horizon` decoded from the reused cache whose top-2 logit gap is below `margin`. Reuse
/// moves the logits a little; where the model was nearly undecided, a little is enough to
/// choose another token than full recompute would (docs/fidelity-guard.md measures it).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GuardPolicy {
    /// Top-2 logit gap under which a token counts as uncertain (0: loops only); `None`: the
    /// request's method's own ([`default_margin`]).
    pub margin: Option<f32>,
    /// How many of the answer's first tokens are watched for it.
    pub horizon: usize,
    /// How many of the answer's first tokens are doubted at any near tie; after them (up to
    /// `horizon`) only a tie either side of which holds a digit or an uppercase letter is
    /// ([`holds_substance`]: a name, a number, a date, chosen or lost to a plain word). Later
    /// in an answer a near tie between two phrasings is full recompute's own as often as
    /// reuse's, and escalating it changes nothing the fidelity target counts
    /// (docs/fidelity-guard.md, *Why each default*).
    pub phrasing_horizon: usize,
    /// Where a token's gap fell below the margin (not a loop), the share of the chunk tokens
    /// a second look recomputes on top of the method's picks (which ones: [`GuardPolicy::look`]),
    /// before anything escalates: decoding restarts from that cache, and where it chooses the
    /// tokens chosen so far (the doubted one included) it goes on from there, still guarded;
    /// where it does not, the request escalates (0: escalate at once). A selector that ranks
    /// nothing, or a request drafting its tokens, escalates at once.
    pub second_look: f64,
    /// The top-2 gap the second look must choose the doubted token by to keep it: a look
    /// that chooses the same token by less is as undecided as the first decode and
    /// escalates (0: the same token is enough).
    pub confirm_gap: f32,
    /// The most a second look may narrow the doubted token's top-2 gap (the first decode's
    /// less the look's) and keep it: recomputing more rows moved the choice toward the
    /// other token, so full recompute, which recomputes them all, may choose it (a large
    /// value: [`GuardPolicy::confirm_gap`] alone decides).
    pub look_narrowing: f32,
    /// The most second looks one request may take. After a look kept the doubted token,
    /// a later doubt takes another look (the next share of the chunk tokens after the rows
    /// exact by then; [`LookRows::Extend`] only) instead of escalating, until this many
    /// have run; a look that does not confirm escalates whatever is left (1: one look).
    pub looks: u32,
    /// Which chunk tokens the second look recomputes.
    pub look: LookRows,
    /// The most an escalation after a second look may be estimated to cost, as a multiple of
    /// full recompute's prefill of the same prompt ([`LookCost::after_look`]); where the
    /// estimate is higher, a doubted token escalates at once instead of taking the look.
    pub look_cost: f64,
    /// Where set, a second look answers: its decode replaces the first's (the client's text
    /// replaced where it differs), each of its tokens held to this top-2 gap instead of
    /// the margin, and the request escalates only where one falls under it (or loops). The
    /// look recomputes more chunk tokens than the first decode had, but over the cache the
    /// first blend left: on CacheBlend's 2WikiMultihopQA it escalated half as often and kept
    /// fewer of full recompute's answers (docs/evaluation.md). `None` (the default): the
    /// look must choose the first decode's tokens ([`GuardPolicy::confirm_gap`]) or the
    /// request escalates.
    pub look_answers: Option<f32>,
}

/// What a request has spent and would spend, in its own prefill's rate, should the guard's
/// second look run and the request escalate after it: the basis of
/// [`GuardPolicy::look_cost`]. Prefill on these CPUs is bound by the matrix products, so a
/// pass costs about its rows times the rate this request's blended prefill ran at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LookCost {
    /// Time the reused path has taken so far beyond what full recompute spends: loading KV,
    /// selection, the blended prefill and the decode up to the doubted token.
    pub spent_ms: f64,
    /// Time of the blended prefill alone, and the rows it computed (recomputed chunk tokens
    /// and the question).
    pub blend_ms: f64,
    pub blend_rows: usize,
    /// Rows of the prompt, the leading ones an escalation keeps ([`exact_rows`]), and the
    /// question's (a second look recomputes them again).
    ///
    /// [`exact_rows`]: crate::pipeline
    pub prompt_rows: usize,
    pub exact_rows: usize,
    pub question_rows: usize,
    /// Chunk tokens the look would recompute, and whether an escalation after it keeps them
    /// ([`LookRows::Extend`] after exact rows).
    pub look_rows: usize,
    pub look_kept: bool,
}

impl LookCost {
    /// The estimated cost of look-then-escalate ÷ full recompute's prefill: what was spent,
    /// plus the look's rows and the question's, plus every row after the kept ones, all at
    /// the blend's rate, over the prompt's rows at that rate. `None` where the blend gives
    /// no rate (nothing timed or no rows).
    pub fn after_look(&self) -> Option<f64> {
        if self.blend_rows == 0 || self.blend_ms <= 0.0 || self.prompt_rows == 0 {
            return None;
        }
        let rate = self.blend_ms / self.blend_rows as f64;
        let lost = if self.look_kept { 0 } else { self.look_rows };
        let after = self.prompt_rows.saturating_sub(self.exact_rows);
        let rows = self.question_rows + lost + after;
        Some((self.spent_ms + rate * rows as f64) / (rate * self.prompt_rows as f64))
    }
}

/// Which chunk tokens a second look recomputes ([`GuardPolicy::look`]; `--guard-look`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "snake_case")]
#[value(rename_all = "snake_case")]
pub enum LookRows {
    /// The next the method ranked, wherever they are: rows lost when the request escalates
    /// after all, so an escalation after the look pays for them twice.
    Ranked,
    /// The chunk tokens right after the rows already exact (the prefix and the first chunk),
    /// in order: computed over exact rows, they are the full prefill's own, so an escalation
    /// after the look keeps them and its full prefill starts after them. Where nothing is
    /// exact (the first chunk was recomputed, or stored lossily) they are recomputed all the
    /// same and an escalation keeps nothing. The default: on 130 real questions its
    /// escalations cost at most 1.15x full recompute's request against 1.22-1.33x for
    /// `ranked`, for two answers fewer identical, both near ties of full recompute's own
    /// (docs/fidelity-guard.md, *Why each default*).
    #[default]
    Extend,
}

impl LookRows {
    /// Every kind, in `--help`'s order.
    pub const ALL: [LookRows; 2] = [Self::Ranked, Self::Extend];

    /// The name the command line and the study's labels use.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ranked => "ranked",
            Self::Extend => "extend",
        }
    }

    /// The kind `name` names.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|l| l.name() == name)
    }
}

/// The margin of methods without one of their own ([`default_margin`]): the point of
/// `target_probe`'s operating curve on 200 real multi-hop questions nearest 95% identity
/// with full recompute (docs/fidelity-guard.md).
pub const DEFAULT_GUARD_MARGIN: f32 = 0.5;
/// The margin of the default method, `target_probe_shift`: on its operating curve (135 real
/// multi-hop questions), the smallest gap reaching 97% identity with full recompute; its
/// closer approximation leaves fewer near-ties that flip, so it needs less (0.5 would
/// escalate a third of requests for the same answers).
pub const SHIFT_GUARD_MARGIN: f32 = 0.3;
/// The default [`GuardPolicy::horizon`].
pub const DEFAULT_GUARD_HORIZON: usize = 1024;
/// The default [`GuardPolicy::phrasing_horizon`]: every confident split of the recorded
/// unguarded answers stands within the first 8 tokens or at a token with a digit or a
/// capital letter (docs/fidelity-guard.md, *Why each default*).
pub const DEFAULT_GUARD_PHRASING_HORIZON: usize = 8;
/// The default [`GuardPolicy::second_look`]: at ρ 0.25 + 0.10 the answers that reuse changes
/// differ from the default's own, so agreement there says the doubted token was the model's
/// own uncertainty rather than reuse's (docs/fidelity-guard.md, *Why each default*).
pub const DEFAULT_GUARD_SECOND_LOOK: f64 = 0.10;
/// The default [`GuardPolicy::confirm_gap`]: on the docs questions the second look was
/// chosen on, the smallest gap that escalates the one kept answer full recompute did not
/// give (its look chose the doubted token by 0.099), at two needless escalations in 40
/// (docs/fidelity-guard.md, *Why each default*).
pub const DEFAULT_GUARD_CONFIRM_GAP: f32 = 0.1;
/// The logit gap under which two engines' greedy answers may split and still count as the
/// same computation (shared/DESIGN.md's fidelity target): numerics treated as equal (bf16
/// against f32 attention, f16 against f32 cache rows) flip full recompute's answer only at
/// such gaps; the family fixtures and the GPU parity checks use the same bound.
pub const NEAR_TIE_GAP: f32 = 0.15;
/// The default [`GuardPolicy::look_narrowing`]: the recorded looks the confirm gap kept that
/// kept a confident split had narrowed the gap by 0.024, 0.032 (the demo's question) and
/// 0.013 (held-out 2WikiMultihopQA, seen before this value was set); 0.01 escalates all
/// three, one near tie and seven needless ones in 470 requests (docs/fidelity-guard.md,
/// *Why each default*).
pub const DEFAULT_GUARD_LOOK_NARROWING: f32 = 0.01;
/// The default [`GuardPolicy::looks`].
pub const DEFAULT_GUARD_LOOKS: u32 = 1;
/// The default [`GuardPolicy::look_cost`]: none (every look runs). The estimate read
/// 0.01-0.11 below the measured cost of look-then-escalate on 223 recorded requests, and on
/// 50 held-out MuSiQue questions a bound of 1.05 still let a 1.28x escalation through while
/// raising escalations to 18% and the mean request to 0.56 of full recompute's
/// (docs/fidelity-guard.md, *The look's cost bound*).
pub const DEFAULT_GUARD_LOOK_COST: f64 = f64::INFINITY;

/// Whether a token's bytes hold a digit or an uppercase letter: part of a name, a number or
/// a date, where a split changes what an answer says rather than how it says it.
pub fn holds_substance(token: &[u8]) -> bool {
    String::from_utf8_lossy(token)
        .chars()
        .any(|c| c.is_numeric() || c.is_uppercase())
}

/// The margin a `balanced` request under `method` escalates at unless the server sets one.
pub fn default_margin(method: crate::method::Method) -> f32 {
    match method {
        crate::method::Method::TargetProbeShift => SHIFT_GUARD_MARGIN,
        _ => DEFAULT_GUARD_MARGIN,
    }
}

impl Default for GuardPolicy {
    fn default() -> Self {
        Self {
            margin: None,
            horizon: DEFAULT_GUARD_HORIZON,
            phrasing_horizon: DEFAULT_GUARD_PHRASING_HORIZON,
            second_look: DEFAULT_GUARD_SECOND_LOOK,
            confirm_gap: DEFAULT_GUARD_CONFIRM_GAP,
            look_narrowing: DEFAULT_GUARD_LOOK_NARROWING,
            looks: DEFAULT_GUARD_LOOKS,
            look: LookRows::default(),
            look_cost: DEFAULT_GUARD_LOOK_COST,
            look_answers: None,
        }
    }
}

impl GuardPolicy {
    /// The margin this policy applies to a request under `method`.
    pub fn margin_for(&self, method: crate::method::Method) -> f32 {
        self.margin.unwrap_or_else(|| default_margin(method))
    }

    /// Whether the `n`th generated token (1-based) of a request under `method`, chosen with
    /// top-2 gap `gap`, is too uncertain to keep decoding from the reused cache.
    pub fn doubts(&self, method: crate::method::Method, n: usize, gap: f32) -> bool {
        n <= self.horizon && gap < self.margin_for(method)
    }

    /// Whether the guard watches the `n`th generated token (1-based), whose bytes are
    /// `token`, for a near tie with `rival` (the bytes of the other of its row's two most
    /// likely tokens): any of the first [`GuardPolicy::phrasing_horizon`], and after them a
    /// tie either side of which [`holds_substance`] (a name chosen, or lost to a plain word).
    pub fn watches(&self, n: usize, token: &[u8], rival: Option<&[u8]>) -> bool {
        n <= self.phrasing_horizon || holds_substance(token) || rival.is_some_and(holds_substance)
    }

    /// Whether the `n`th token (1-based) a second look that answers
    /// ([`GuardPolicy::look_answers`]) decoded, chosen with top-2 gap `gap`, sends the
    /// request to the full cache.
    pub fn doubts_look(&self, n: usize, gap: f32) -> bool {
        self.look_answers
            .is_some_and(|keep| n <= self.horizon && gap < keep)
    }

    /// Whether a second look that chose the doubted token again, by top-2 gap `gap`, keeps
    /// it: by at least the confirm gap, and the first decode's gap (`first`, where known)
    /// narrowed by at most [`GuardPolicy::look_narrowing`].
    pub fn confirms(&self, first: Option<f32>, gap: f32) -> bool {
        gap >= self.confirm_gap && first.is_none_or(|f| gap >= f - self.look_narrowing)
    }

    /// Whether a request that took `taken` second looks, the last of which kept its doubted
    /// token, takes another where the guard doubts a later one (instead of escalating):
    /// while fewer than [`GuardPolicy::looks`] ran, for looks that extend the exact rows and
    /// must choose the first decode's tokens.
    pub fn looks_again(&self, taken: u32) -> bool {
        taken < self.looks && self.look == LookRows::Extend && self.look_answers.is_none()
    }

    /// Whether a second look may run for a request whose costs are `cost`: where the
    /// estimate of an escalation after it is within [`GuardPolicy::look_cost`] (or there is
    /// no estimate).
    pub fn affords_look(&self, cost: &LookCost) -> bool {
        cost.after_look().is_none_or(|c| c <= self.look_cost)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_through_parse_serde_and_clap() {
        use clap::ValueEnum;
        for f in Fidelity::ALL {
            assert_eq!(Fidelity::parse(f.name()), Some(f));
            assert_eq!(
                serde_json::to_string(&f).ok(),
                Some(format!("\"{}\"", f.name()))
            );
            let pv = f.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(pv.as_deref(), Some(f.name()));
        }
        assert_eq!(Fidelity::parse("lossless"), None);
        assert_eq!(Fidelity::default(), Fidelity::Balanced);
    }

    #[test]
    fn after_the_phrasing_horizon_only_names_numbers_and_dates_are_watched() {
        for t in ["1", " 1808", " Jennings", "Le", " December", "É", "٣"] {
            assert!(holds_substance(t.as_bytes()), "{t:?}");
        }
        for t in [" discuss", " are", ",", " the", " é", "", "\n"] {
            assert!(!holds_substance(t.as_bytes()), "{t:?}");
        }
        // A token cut inside a character still reads what it holds.
        assert!(!holds_substance(&[0xC3]));
        let p = GuardPolicy {
            phrasing_horizon: 2,
            ..GuardPolicy::default()
        };
        let plain = Some(&b" were"[..]);
        assert!(p.watches(1, b" are", plain) && p.watches(2, b" are", None));
        assert!(
            !p.watches(3, b" are", plain) && !p.watches(3, b" are", None),
            "a phrasing tie past the horizon"
        );
        assert!(p.watches(3, b" Paula", plain) && p.watches(300, b"17", None));
        assert!(
            p.watches(3, b" the", Some(b" Paula")) && p.watches(9, b" in", Some(b" 1758")),
            "a name or a number lost to a plain word"
        );
        let every = GuardPolicy {
            phrasing_horizon: usize::MAX,
            ..GuardPolicy::default()
        };
        assert!(every.watches(1000, b" are", plain));
        assert_eq!(
            GuardPolicy::default().phrasing_horizon,
            DEFAULT_GUARD_PHRASING_HORIZON
        );
    }

    #[test]
    fn the_policy_doubts_only_small_gaps_within_its_horizon() {
        use crate::method::Method;
        let m = Method::TargetProbe;
        let p = GuardPolicy {
            margin: Some(1.5),
            horizon: 4,
            phrasing_horizon: 4,
            second_look: 0.0,
            confirm_gap: 0.0,
            look_narrowing: 100.0,
            looks: 1,
            look: LookRows::Ranked,
            look_cost: DEFAULT_GUARD_LOOK_COST,
            look_answers: None,
        };
        assert!(p.doubts(m, 1, 1.0));
        assert!(p.doubts(m, 4, 1.49));
        assert!(!p.doubts(m, 4, 1.5));
        assert!(!p.doubts(m, 5, 0.1));
        assert!(
            p.doubts(Method::TargetProbeShift, 1, 1.0),
            "a set margin holds for all"
        );
        let off = GuardPolicy {
            margin: Some(0.0),
            horizon: usize::MAX,
            phrasing_horizon: usize::MAX,
            second_look: 0.0,
            confirm_gap: 0.0,
            look_narrowing: 100.0,
            looks: 1,
            look: LookRows::Ranked,
            look_cost: DEFAULT_GUARD_LOOK_COST,
            look_answers: None,
        };
        assert!(!off.doubts(m, 1, 0.0));
        assert!(!p.doubts_look(1, 0.0), "no look answers unless asked");
        let answers = GuardPolicy {
            look_answers: Some(0.1),
            ..p
        };
        assert!(answers.doubts_look(1, 0.09));
        assert!(!answers.doubts_look(1, 0.1));
        assert!(!answers.doubts_look(5, 0.0), "beyond the horizon");
    }

    #[test]
    fn a_second_look_confirms_only_by_the_confirm_gap_and_without_narrowing_it() {
        let p = GuardPolicy::default();
        assert!(!p.confirms(None, DEFAULT_GUARD_CONFIRM_GAP - 0.01));
        assert!(p.confirms(None, DEFAULT_GUARD_CONFIRM_GAP));
        let any = GuardPolicy {
            confirm_gap: 0.0,
            look_narrowing: 100.0,
            ..p
        };
        assert!(any.confirms(Some(5.0), 0.0), "0: the same token is enough");
        // The demo's question: the first decode chose ` this` by 0.177, the look by 0.145,
        // and full recompute went on to answer otherwise.
        assert!(!p.confirms(Some(0.177), 0.145), "narrowed by 0.032");
        assert!(!p.confirms(Some(0.198), 0.185), "narrowed by 0.013");
        assert!(p.confirms(Some(0.152), 0.145), "narrowed by 0.007");
        assert!(p.confirms(Some(0.05), 0.145), "widened");
        assert!(
            !p.confirms(Some(0.05), 0.09),
            "widened, under the confirm gap"
        );
    }

    #[test]
    fn later_doubts_look_again_only_within_the_bound_and_for_extending_looks() {
        let one = GuardPolicy::default();
        assert_eq!(one.looks, DEFAULT_GUARD_LOOKS);
        assert!(!one.looks_again(1), "one look: a later doubt escalates");
        let three = GuardPolicy { looks: 3, ..one };
        assert!(three.looks_again(1) && three.looks_again(2));
        assert!(!three.looks_again(3));
        let ranked = GuardPolicy {
            look: LookRows::Ranked,
            ..three
        };
        assert!(!ranked.looks_again(1), "ranked looks run once");
        let answers = GuardPolicy {
            look_answers: Some(0.05),
            ..three
        };
        assert!(!answers.looks_again(1), "a look that answers runs once");
    }

    #[test]
    fn the_look_cost_counts_the_spent_time_and_every_row_an_escalation_still_computes() {
        // A short prompt: 400 rows, 150 exact; the blend ran 100 + 30 rows in 650 ms (5 ms a
        // row), and 900 ms went to KV, selection, the blend and a decode step.
        let short = LookCost {
            spent_ms: 900.0,
            blend_ms: 650.0,
            blend_rows: 130,
            prompt_rows: 400,
            exact_rows: 150,
            question_rows: 30,
            look_rows: 40,
            look_kept: true,
        };
        // (900 + 5 x (30 + 250)) / (5 x 400) = 2300 / 2000.
        let c = short.after_look().unwrap_or(f64::NAN);
        assert!((c - 1.15).abs() < 1e-12, "{c}");
        // Rows the escalation does not keep are paid twice.
        let lost = LookCost {
            look_kept: false,
            ..short
        };
        let c = lost.after_look().unwrap_or(f64::NAN);
        assert!((c - 1.25).abs() < 1e-12, "{c}");
        // A long prompt with the same spend leaves room for the look.
        let long = LookCost {
            prompt_rows: 2000,
            exact_rows: 500,
            ..short
        };
        let c = long.after_look().unwrap_or(f64::NAN);
        assert!(c < 0.9, "{c}");
        let p = GuardPolicy::default();
        assert!(p.affords_look(&short), "the default bounds nothing");
        let p = GuardPolicy {
            look_cost: 1.05,
            ..p
        };
        assert!(!p.affords_look(&short), "1.15 is above 1.05");
        assert!(p.affords_look(&long));
        let any = GuardPolicy {
            look_cost: 2.0,
            ..p
        };
        assert!(
            any.affords_look(&short)
                && !any.affords_look(&LookCost {
                    spent_ms: 3000.0,
                    ..short
                })
        );
        // No rate, no estimate: the look runs as before.
        let untimed = LookCost {
            blend_ms: 0.0,
            ..short
        };
        assert_eq!(untimed.after_look(), None);
        assert!(p.affords_look(&untimed));
    }

    #[test]
    fn look_kinds_round_trip_through_parse_serde_and_clap() {
        use clap::ValueEnum;
        for l in LookRows::ALL {
            assert_eq!(LookRows::parse(l.name()), Some(l));
            let json = serde_json::to_string(&l).ok();
            assert_eq!(json, Some(format!("\"{}\"", l.name())));
            let pv = l.to_possible_value().map(|v| v.get_name().to_string());
            assert_eq!(pv.as_deref(), Some(l.name()));
        }
        assert_eq!(LookRows::parse("prefix"), None);
    }

    #[test]
    fn unset_the_margin_is_the_methods_own() {
        use crate::method::Method;
        let p = GuardPolicy::default();
        assert_eq!(p.margin_for(Method::TargetProbeShift), SHIFT_GUARD_MARGIN);
        assert_eq!(p.margin_for(Method::TargetProbe), DEFAULT_GUARD_MARGIN);
        assert!(p.doubts(Method::TargetProbe, 1, 0.4));
        assert!(!p.doubts(Method::TargetProbeShift, 1, 0.4));
        assert!(p.doubts(Method::TargetProbeShift, 1, 0.29));
    }
}
