//! From scored answers to what users read: summary rows per configuration (means of quality,
//! medians of latency, the TTFT ratio to full recompute in the same run), the ρ = 1 identity
//! check, the Markdown report and the SVG charts.

use crate::load::LoadPoint;
use crate::method::Method;
use crate::metrics::{mean, median};
use crate::plan::{Config, ConfigKey, Group, Pairing, PairingName};
use crate::plot::{svg, Chart, Series};
use crate::run::{IngestInfo, Record};
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Where and how the run happened.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    /// UTC, `YYYY-MM-DD HH:MM`.
    pub date: String,
    pub machine: String,
    pub command: String,
    pub quick: bool,
    pub seconds: f64,
    pub seed: u64,
}

/// The summary scope over every dataset of a pairing ([`SummaryRow::dataset`]).
pub const ALL_DATASETS: &str = "all";

/// One configuration over the cases of one dataset (or [`ALL_DATASETS`]) of one pairing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SummaryRow {
    pub pairing: PairingName,
    /// A dataset's name, or [`ALL_DATASETS`].
    pub dataset: String,
    pub config: Config,
    pub n: usize,
    /// Mean recomputed share of chunk tokens actually used.
    pub ratio: f64,
    pub f1: f64,
    pub em: f64,
    pub rouge_l: f64,
    /// Share of cases whose answer equals full recompute's.
    pub match_full: f64,
    pub rouge_l_full: f64,
    pub kl_first: f64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gold_recall: Option<f64>,
    /// Medians (ms).
    pub ttft_ms: f64,
    pub retrieve_ms: f64,
    pub kv_load_ms: f64,
    pub speculate_ms: f64,
    pub align_ms: f64,
    pub prefill_ms: f64,
    pub decode_ms: f64,
    /// Median TTFT over full recompute's median TTFT, same pairing and dataset, same run.
    pub ttft_ratio: f64,
}

/// The ρ = 1 check of one configuration: every answer must equal full recompute's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct IdentityRow {
    pub pairing: PairingName,
    pub config: ConfigKey,
    pub cases: usize,
    pub exact: usize,
    pub max_kl: f64,
    pub holds: bool,
}

/// First-token KL at ρ = 1 above this means the blend is not the full prefill.
pub const IDENTITY_MAX_KL: f64 = 1e-4;

/// Everything a run produced (`results.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub meta: Meta,
    pub pairings: Vec<Pairing>,
    /// Configurations per pairing.
    pub configs: Vec<(PairingName, Vec<Config>)>,
    pub ingest: Vec<IngestInfo>,
    pub records: Vec<Record>,
    pub summary: Vec<SummaryRow>,
    pub identity: Vec<IdentityRow>,
    pub load: Vec<LoadPoint>,
    /// Notes on what the run left out, shown in the report.
    pub notes: Vec<String>,
}

fn summarize_group(
    pairing: PairingName,
    dataset: &str,
    config: &Config,
    rows: &[&Record],
    reference_ttft: f64,
) -> SummaryRow {
    let f = |g: fn(&Record) -> f64| rows.iter().map(|r| g(r)).collect::<Vec<f64>>();
    let recalls: Vec<f64> = rows.iter().filter_map(|r| r.gold_recall).collect();
    let ttft = median(&f(|r| r.timings.ttft_ms));
    SummaryRow {
        pairing,
        dataset: dataset.into(),
        config: config.clone(),
        n: rows.len(),
        ratio: mean(&f(|r| r.reuse.ratio)),
        f1: mean(&f(|r| r.f1)),
        em: mean(&f(|r| r.em)),
        rouge_l: mean(&f(|r| r.rouge_l)),
        match_full: mean(&f(|r| f64::from(u8::from(r.match_full)))),
        rouge_l_full: mean(&f(|r| r.rouge_l_full)),
        kl_first: mean(&f(|r| r.kl_first)),
        gold_recall: (!recalls.is_empty()).then(|| mean(&recalls)),
        ttft_ms: ttft,
        retrieve_ms: median(&f(|r| r.timings.retrieve_ms)),
        kv_load_ms: median(&f(|r| r.timings.kv_load_ms)),
        speculate_ms: median(&f(|r| r.timings.speculate_ms)),
        align_ms: median(&f(|r| r.timings.align_ms)),
        prefill_ms: median(&f(|r| r.timings.prefill_ms)),
        decode_ms: median(&f(|r| r.timings.decode_ms)),
        ttft_ratio: if reference_ttft > 0.0 {
            ttft / reference_ttft
        } else {
            0.0
        },
    }
}

impl Results {
    /// Fills `summary` and `identity` from `records`: per pairing, one row per configuration
    /// and dataset, and one over all datasets ([`ALL_DATASETS`]).
    pub fn summarize(&mut self) {
        let mut summary = Vec::new();
        let mut identity = Vec::new();
        for &(pairing, ref configs) in &self.configs {
            let mine: Vec<&Record> = self
                .records
                .iter()
                .filter(|r| r.pairing == pairing)
                .collect();
            let mut datasets: Vec<String> = Vec::new();
            for r in &mine {
                if !datasets.contains(&r.dataset) {
                    datasets.push(r.dataset.clone());
                }
            }
            let mut scopes = vec![ALL_DATASETS.to_string()];
            if datasets.len() > 1 {
                scopes.extend(datasets);
            }
            for scope in &scopes {
                let in_scope = |r: &&&Record| scope == ALL_DATASETS || &r.dataset == scope;
                let of = |c: &Config| -> Vec<&Record> {
                    let key = c.key();
                    mine.iter()
                        .filter(in_scope)
                        .filter(|r| r.config == key)
                        .copied()
                        .collect()
                };
                let reference = configs.iter().find(|c| c.is_reference());
                let ref_ttft = reference
                    .map(|c| median(&of(c).iter().map(|r| r.timings.ttft_ms).collect::<Vec<_>>()))
                    .unwrap_or(0.0);
                for c in configs {
                    let rows = of(c);
                    if rows.is_empty() {
                        continue;
                    }
                    summary.push(summarize_group(pairing, scope, c, &rows, ref_ttft));
                    if scope == ALL_DATASETS && c.group == Group::Identity {
                        let exact = rows.iter().filter(|r| r.match_full).count();
                        let max_kl = rows.iter().map(|r| r.kl_first).fold(0.0, f64::max);
                        let finite = rows.iter().all(|r| r.kl_first.is_finite());
                        identity.push(IdentityRow {
                            pairing,
                            config: c.key(),
                            cases: rows.len(),
                            exact,
                            max_kl,
                            holds: exact == rows.len() && finite && max_kl <= IDENTITY_MAX_KL,
                        });
                    }
                }
            }
        }
        self.summary = summary;
        self.identity = identity;
    }

    /// The summary rows of `pairing` over `dataset` (a dataset's name or [`ALL_DATASETS`]).
    pub fn rows(&self, pairing: PairingName, dataset: &str) -> Vec<&SummaryRow> {
        self.summary
            .iter()
            .filter(|r| r.pairing == pairing && r.dataset == dataset)
            .collect()
    }

    /// True when every ρ = 1 configuration answered exactly as full recompute.
    pub fn identity_holds(&self) -> bool {
        self.identity.iter().all(|i| i.holds)
    }
}

fn f2(x: f64) -> String {
    format!("{x:.2}")
}

fn ms(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

fn main_table(out: &mut String, rows: &[&SummaryRow]) {
    out.push_str(
        "| config | n | ρ used | F1 | EM | ROUGE-L | = full | ROUGE-L to full | KL first | TTFT ms | TTFT / full | retrieve | KV load | speculate | align | prefill |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.4} | {} | {} | {} | {} | {} | {} | {} |",
            r.config.label(),
            r.n,
            f2(r.ratio),
            f2(r.f1),
            f2(r.em),
            f2(r.rouge_l),
            f2(r.match_full),
            f2(r.rouge_l_full),
            r.kl_first,
            ms(r.ttft_ms),
            f2(r.ttft_ratio),
            ms(r.retrieve_ms),
            ms(r.kv_load_ms),
            ms(r.speculate_ms),
            ms(r.align_ms),
            ms(r.prefill_ms),
        );
    }
}

/// A model file name shortened for chart titles: no `.gguf`, nothing from `-instruct` on
/// (`qwen2.5-coder-0.5b-instruct-q4_k_m.gguf` -> `qwen2.5-coder-0.5b`).
pub fn short_model(file: &str) -> &str {
    let s = file.strip_suffix(".gguf").unwrap_or(file);
    s.find("-instruct").map_or(s, |i| &s[..i])
}

/// Adds `pt` to the series called `name`, starting it if it is new (legend order = first seen).
fn add_point(series: &mut Vec<Series>, name: &str, pt: (f64, f64)) {
    match series.iter_mut().find(|s| s.name == name) {
        Some(s) => s.points.push(pt),
        None => series.push(Series {
            name: name.to_string(),
            points: vec![pt],
        }),
    }
}

/// The chart files of a report: `(file name, SVG)`.
#[allow(
    clippy::too_many_lines,
    reason = "a flat list of chart definitions, one block per chart"
)]
pub fn charts(res: &Results) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for p in &res.pairings {
        let rows = res.rows(p.name, ALL_DATASETS);
        if rows.is_empty() {
            continue;
        }
        let pair = format!(
            "{} -> {}",
            short_model(&p.speculator),
            short_model(&p.target)
        );
        // TTFT vs quality, one series per method (SpecCache Fig. 5).
        let mut by_method: Vec<Series> = Vec::new();
        let mut fidelity: Vec<Series> = Vec::new();
        for r in rows
            .iter()
            .filter(|r| !matches!(r.config.group, Group::Identity | Group::Ablation))
        {
            // EPIC at a fixed k joins EPIC at a budget: one colour per method.
            let name = match r.config.group {
                Group::Main | Group::EpicK => r.config.method.name().to_string(),
                _ => r.config.label(),
            };
            add_point(&mut by_method, &name, (r.ttft_ms / 1e3, r.f1));
            add_point(&mut fidelity, &name, (r.ttft_ms / 1e3, r.rouge_l_full));
        }
        for (file, series, y_label, what) in [
            (
                "ttft_vs_f1",
                by_method,
                "F1 against gold answers",
                "quality",
            ),
            (
                "ttft_vs_fidelity",
                fidelity,
                "ROUGE-L to full recompute's answer",
                "fidelity",
            ),
        ] {
            out.push((
                format!("{file}_{}.svg", p.name),
                svg(&Chart {
                    title: format!("TTFT vs {what}, {pair}"),
                    x_label: "median TTFT (s)".into(),
                    y_label: y_label.into(),
                    series,
                    lines: false,
                }),
            ));
        }
        // Quality vs recompute ratio, lines per budgeted method.
        for (file, pick, y_label, what) in [
            (
                "f1_vs_ratio",
                (|r: &SummaryRow| r.f1) as fn(&SummaryRow) -> f64,
                "F1 against gold answers",
                "Quality",
            ),
            (
                "fidelity_vs_ratio",
                |r: &SummaryRow| r.rouge_l_full,
                "ROUGE-L to full recompute's answer",
                "Fidelity",
            ),
        ] {
            let mut series: Vec<Series> = Vec::new();
            for r in rows
                .iter()
                .filter(|r| r.config.group == Group::Main && r.config.budgeted())
            {
                add_point(
                    &mut series,
                    r.config.method.name(),
                    (r.config.ratio, pick(r)),
                );
            }
            for s in &mut series {
                s.points.sort_by(|a, b| a.0.total_cmp(&b.0));
            }
            out.push((
                format!("{file}_{}.svg", p.name),
                svg(&Chart {
                    title: format!("{what} vs ρ, {pair}"),
                    x_label: "recompute ratio ρ".into(),
                    y_label: y_label.into(),
                    series,
                    lines: true,
                }),
            ));
        }
    }
    if !res.load.is_empty() {
        for (file, pick, y_label) in [
            (
                "goodput",
                (|l: &LoadPoint| l.goodput_rps) as fn(&LoadPoint) -> f64,
                "goodput (answers with F1 ≥ γ per s)",
            ),
            (
                "throughput",
                |l: &LoadPoint| l.throughput_rps,
                "throughput (answers per s)",
            ),
        ] {
            let mut series: Vec<Series> = Vec::new();
            for l in &res.load {
                add_point(&mut series, &l.label(), (l.rate_rps, pick(l)));
            }
            out.push((
                format!("{file}.svg"),
                svg(&Chart {
                    title: format!(
                        "{} vs arrival rate (Poisson, real server)",
                        y_label.split(' ').next().unwrap_or(file)
                    ),
                    x_label: "arrival rate (requests per s)".into(),
                    y_label: y_label.into(),
                    series,
                    lines: true,
                }),
            ));
        }
    }
    out
}

/// The Markdown report. Chart files are linked by the names [`charts`] gives them.
#[allow(
    clippy::too_many_lines,
    reason = "the report template, section after section in document order"
)]
pub fn markdown(res: &Results) -> String {
    let mut out = String::new();
    let m = &res.meta;
    let _ = writeln!(
        out,
        "# specrag evaluation{}\n",
        if m.quick { " (quick)" } else { "" }
    );
    let _ = writeln!(
        out,
        "{} UTC, {}. Command: `{}`. {:.0} s in all, seed {}.\n",
        m.date, m.machine, m.command, m.seconds, m.seed
    );
    out.push_str(
        "Quality against gold answers: F1, exact match (EM) and ROUGE-L with LongBench's \
         normalization (best over the accepted answers). Against full recompute of the same \
         model and case: share of answers identical to its answer (= full), ROUGE-L to its \
         answer, and KL(full || method) of the first token's distribution. Latency: medians in \
         ms of TTFT and its parts; TTFT / full is the median TTFT over full recompute's median \
         TTFT in the same run. ρ used is the recomputed share of chunk tokens actually spent. \
         Greedy decoding.\n\n",
    );
    if !res.notes.is_empty() {
        for n in &res.notes {
            let _ = writeln!(out, "- {n}");
        }
        out.push('\n');
    }
    out.push_str("## Datasets\n\n| pairing | dataset | documents | chunks | tokens | ingest s |\n|---|---|---|---|---|---|\n");
    for i in &res.ingest {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {:.1} |",
            i.pairing, i.dataset, i.documents, i.chunks, i.tokens, i.seconds
        );
    }
    out.push('\n');
    for p in &res.pairings {
        let all = res.rows(p.name, ALL_DATASETS);
        if all.is_empty() {
            continue;
        }
        let _ = writeln!(
            out,
            "## {} -> {} (`{}` pairing)\n",
            p.speculator, p.target, p.name
        );
        let main: Vec<&SummaryRow> = all
            .iter()
            .filter(|r| matches!(r.config.group, Group::Main | Group::EpicK | Group::Ingest))
            .copied()
            .collect();
        out.push_str("### Every method, all cases\n\n");
        main_table(&mut out, &main);
        out.push('\n');
        let mut datasets: Vec<&str> = res
            .summary
            .iter()
            .filter(|r| r.pairing == p.name && r.dataset != ALL_DATASETS)
            .map(|r| r.dataset.as_str())
            .collect();
        datasets.dedup();
        if !datasets.is_empty() {
            out.push_str("### Per dataset (F1 against gold / share identical to full recompute / median TTFT ms)\n\n| config |");
            for d in &datasets {
                let _ = write!(out, " {d} |");
            }
            out.push_str("\n|---|");
            for _ in &datasets {
                out.push_str("---|");
            }
            out.push('\n');
            for r in &main {
                let _ = write!(out, "| {} |", r.config.label());
                for d in &datasets {
                    match res
                        .rows(p.name, d)
                        .into_iter()
                        .find(|x| x.config.key() == r.config.key())
                    {
                        Some(x) => {
                            let _ = write!(
                                out,
                                " {} / {} / {} |",
                                f2(x.f1),
                                f2(x.match_full),
                                ms(x.ttft_ms)
                            );
                        }
                        None => out.push_str(" - |"),
                    }
                }
                out.push('\n');
            }
            out.push('\n');
        }
        let ablation: Vec<&SummaryRow> = all
            .iter()
            .filter(|r| {
                r.config.group == Group::Ablation
                    || (r.config.group == Group::Main
                        && r.config.method == Method::Speccache
                        && (r.config.ratio - crate::plan::MAIN_RATIO).abs() < 1e-9)
            })
            .copied()
            .collect();
        if ablation.len() > 1 {
            out.push_str("### Layer-range ablation (speccache at ρ = 0.15; the default is the last third)\n\n");
            main_table(&mut out, &ablation);
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "Charts: ![TTFT vs F1](ttft_vs_f1_{0}.svg) ![TTFT vs fidelity](ttft_vs_fidelity_{0}.svg) \
             ![F1 vs ratio](f1_vs_ratio_{0}.svg) ![fidelity vs ratio](fidelity_vs_ratio_{0}.svg)\n",
            p.name
        );
    }
    if !res.identity.is_empty() {
        out.push_str("## ρ = 1 identity\n\nAt ρ = 1 every chunk token is recomputed, so the blended prefill must be the full prefill: the answer identical to full recompute's and the first-token KL ≈ 0.\n\n| pairing | config | cases | identical | max KL first | holds |\n|---|---|---|---|---|---|\n");
        for i in &res.identity {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {:.2e} | {} |",
                i.pairing,
                i.config,
                i.cases,
                i.exact,
                i.max_kl,
                if i.holds { "yes" } else { "**no**" }
            );
        }
        out.push('\n');
    }
    if !res.load.is_empty() {
        let gamma = res.load[0].gamma;
        let _ = writeln!(
            out,
            "## Throughput and goodput under Poisson arrivals\n\nThrough the real server \
             (router, engine queue of 8, pipeline) on loopback; each request a bridge-case \
             question. Rates are multiples of full recompute's service rate measured above; every \
             method gets the same seeded arrival times at a rate. \
             Goodput (SpecCache Eq. 8): answers with F1 ≥ γ per second of the whole run, γ = \
             80% of full recompute's mean F1 = {gamma:.3}. Latency is the client's (queueing \
             included) from each request's scheduled arrival; TTFT is the server's.\n"
        );
        if gamma <= 0.0 {
            out.push_str(
                "Full recompute scored 0 on these cases, so γ = 0 and goodput equals throughput: \
                 the quality side of goodput says nothing here.\n\n",
            );
        }
        out.push_str("| method | rate × | rate /s | requests | ok | 429 | failed | s | throughput /s | goodput /s | mean F1 | p50 latency s | p90 latency s | p50 TTFT ms |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
        for l in &res.load {
            let _ = writeln!(
                out,
                "| {} | {} | {:.3} | {} | {} | {} | {} | {:.1} | {:.3} | {:.3} | {} | {:.1} | {:.1} | {} |",
                l.label(),
                l.factor,
                l.rate_rps,
                l.requests,
                l.ok,
                l.rejected,
                l.failed,
                l.duration_s,
                l.throughput_rps,
                l.goodput_rps,
                f2(l.mean_score),
                l.latency_p50_s,
                l.latency_p90_s,
                ms(l.ttft_p50_ms)
            );
        }
        out.push_str("\nCharts: ![goodput](goodput.svg) ![throughput](throughput.svg)\n\n");
    }
    out.push_str("## Answers\n\nEvery answer with its scores is in `results.json` (`records`).\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{configs, identity_configs};
    use gateway::pipeline::{Reuse, Timings};
    use target_engine::FinishReason;

    fn record(config: &Config, case: &str, dataset: &str, ttft: f64, f1: f64) -> Record {
        Record {
            pairing: PairingName::Small,
            dataset: dataset.into(),
            case: case.into(),
            config: config.key(),
            answer: "x".into(),
            tokens: 1,
            finish_reason: FinishReason::Eos,
            f1,
            em: f1.floor(),
            rouge_l: f1,
            match_full: config.is_reference() || config.group == Group::Identity,
            rouge_l_full: 1.0,
            kl_first: if config.is_reference() || config.group == Group::Identity {
                0.0
            } else {
                0.01
            },
            gold_recall: Some(1.0),
            timings: Timings {
                ttft_ms: ttft,
                ..Default::default()
            },
            reuse: Reuse {
                ratio: config.ratio,
                ..Default::default()
            },
        }
    }

    fn results() -> Results {
        let mut cs = configs(&[0.15], false);
        cs.extend(identity_configs());
        let mut records = Vec::new();
        for (i, c) in cs.iter().enumerate() {
            let base = if c.is_reference() {
                1000.0
            } else {
                100.0 + i as f64
            };
            records.push(record(c, "b1", "bridge", base, 1.0));
            records.push(record(c, "b2", "bridge", base + 20.0, 0.0));
            records.push(record(c, "n1", "needle", 3.0 * base, 0.5));
        }
        let mut r = Results {
            pairings: vec![Pairing {
                name: PairingName::Small,
                speculator: "spec".into(),
                target: "target".into(),
            }],
            configs: vec![(PairingName::Small, cs)],
            records,
            ..Default::default()
        };
        r.summarize();
        r
    }

    /// `line` split before the JSON number it ends with (a trailing comma aside): the rest of
    /// the line and the number as serde_json reads it.
    fn number_at_end(line: &str) -> Option<(String, u64)> {
        let comma = line.ends_with(',');
        let body = line.strip_suffix(',').unwrap_or(line);
        let start = body.rfind(' ').map_or(0, |i| i + 1);
        let x: f64 = serde_json::from_str(&body[start..]).ok()?;
        let rest = format!("{}{}", &body[..start], if comma { "," } else { "" });
        Some((rest, x.to_bits()))
    }

    /// The committed results.json (written by `serde_json::to_string_pretty`, as
    /// `default_run::write` does) read into the typed records and written back is the same
    /// text: typed pairings, configurations and labels change nothing in the format.
    ///
    /// Byte for byte, with two allowances that have nothing to do with these types:
    /// - the file predates `reuse.guard` (gateway's `GuardReport`, read as its default when
    ///   absent and always written): while the file has no `"guard"`, each default guard
    ///   block written back is taken out before comparing (regenerating the file ends this);
    /// - serde_json's default number parser (without its `float_roundtrip` feature) reads
    ///   some long decimals 1 ulp off (`0.000049999999999999996` comes back as `0.00005`): a
    ///   line may differ in its final number only, and both numbers must read as the same f64.
    ///
    /// Every other byte (keys and their order, strings, labels, indentation) must be the
    /// committed one, and writing back what was read is stable.
    #[test]
    fn committed_results_json_round_trips() {
        let path =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/results/results.json");
        let text = std::fs::read_to_string(&path).expect("docs/results/results.json");
        let res: Results = serde_json::from_str(&text).expect("results.json reads");
        assert!(!res.records.is_empty() && !res.identity.is_empty());
        assert!(res
            .records
            .iter()
            .any(|r| r.config == ConfigKey::full_recompute() && r.pairing == PairingName::Large));
        let written = serde_json::to_string_pretty(&res).expect("results.json writes");
        let mut again = written.clone();
        if !text.contains("\"guard\"") {
            let guard = serde_json::to_string_pretty(&gateway::fidelity::GuardReport::default())
                .expect("guard writes")
                .replace('\n', "\n        ");
            again = again.replace(&format!(",\n        \"guard\": {guard}"), "");
        }
        if !text.contains("\"queue_ms\"") {
            // Written before timings carried the server's queueing (0 in process).
            again = again.replace(",\n        \"queue_ms\": 0.0", "");
        }
        assert_eq!(text.lines().count(), again.lines().count());
        assert_eq!(text.ends_with('\n'), again.ends_with('\n'));
        for (i, (a, b)) in text.lines().zip(again.lines()).enumerate() {
            if a != b {
                let (na, nb) = (number_at_end(a), number_at_end(b));
                assert!(
                    na.is_some() && na == nb,
                    "results.json line {}: `{a}` written back as `{b}`",
                    i + 1
                );
            }
        }
        let twice: Results = serde_json::from_str(&written).expect("written results.json reads");
        assert!(twice == res, "what was written reads back as what was read");
        assert_eq!(
            serde_json::to_string_pretty(&twice).expect("writes"),
            written,
            "writing back is stable"
        );
    }

    #[test]
    fn model_names_shorten_for_titles() {
        assert_eq!(
            short_model("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"),
            "qwen2.5-coder-0.5b"
        );
        assert_eq!(
            short_model("smollm2-135m-instruct-q4_1.gguf"),
            "smollm2-135m"
        );
        assert_eq!(short_model("tiny.gguf"), "tiny");
    }

    #[test]
    fn summary_takes_means_medians_and_the_ratio_to_full() {
        let r = results();
        let all = r.rows(PairingName::Small, "all");
        let full = all
            .iter()
            .find(|x| x.config.is_reference())
            .expect("reference row");
        assert_eq!(full.n, 3);
        assert_eq!(full.ttft_ms, 1020.0, "median of 1000, 1020, 3000");
        assert!((full.f1 - 0.5).abs() < 1e-12);
        assert_eq!(full.ttft_ratio, 1.0);
        let reuse = all
            .iter()
            .find(|x| x.config.key() == ConfigKey::at(Method::FullReuse, 0.0))
            .expect("full_reuse row");
        // full_reuse is config 1: TTFTs 101, 121, 303 -> median 121.
        assert!((reuse.ttft_ratio - 121.0 / 1020.0).abs() < 1e-12);
        assert!((reuse.kl_first - 0.01).abs() < 1e-12);
        assert_eq!(reuse.match_full, 0.0);
        // Per-dataset rows exist because there are two datasets.
        let needle = r.rows(PairingName::Small, "needle");
        let n_full = needle
            .iter()
            .find(|x| x.config.is_reference())
            .expect("needle reference");
        assert_eq!((n_full.n, n_full.ttft_ms), (1, 3000.0));
        assert_eq!(r.identity.len(), 4);
        assert!(r.identity_holds());
    }

    #[test]
    fn identity_fails_on_one_differing_answer() {
        let mut r = results();
        let label = r.identity[0].config;
        if let Some(x) = r.records.iter_mut().find(|x| x.config == label) {
            x.match_full = false;
        }
        r.summarize();
        assert!(!r.identity_holds());
        assert!(markdown(&r).contains("**no**"));
    }

    #[test]
    fn report_has_every_section_and_chart() {
        let mut r = results();
        r.load.push(LoadPoint {
            pairing: PairingName::Small,
            method: gateway::pipeline::Method::Speccache,
            ratio: 0.15,
            factor: 1.0,
            rate_rps: 0.2,
            requests: 3,
            ok: 3,
            rejected: 0,
            failed: 0,
            duration_s: 10.0,
            throughput_rps: 0.3,
            goodput_rps: 0.2,
            gamma: 0.4,
            mean_score: 0.5,
            latency_p50_s: 2.0,
            latency_p90_s: 3.0,
            ttft_p50_ms: 900.0,
        });
        let md = markdown(&r);
        for needle in [
            "## spec -> target",
            "| speccache@0.15 |",
            "### Per dataset",
            "## ρ = 1 identity",
            "## Throughput and goodput",
            "goodput.svg",
        ] {
            assert!(md.contains(needle), "report lacks {needle}:\n{md}");
        }
        let files: Vec<String> = charts(&r)
            .into_iter()
            .map(|(f, s)| {
                assert!(s.starts_with("<svg"), "{f}");
                f
            })
            .collect();
        for f in [
            "ttft_vs_f1_small.svg",
            "ttft_vs_fidelity_small.svg",
            "f1_vs_ratio_small.svg",
            "fidelity_vs_ratio_small.svg",
            "goodput.svg",
            "throughput.svg",
        ] {
            assert!(files.iter().any(|x| x == f), "{f} in {files:?}");
            assert!(md.contains(f), "report links {f}");
        }
    }
}
