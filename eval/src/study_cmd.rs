//! `specrag-eval --study`: the fidelity study's driver (cases, pairings, resume, report).

use crate::cli::{bar, file_name, load_model};
use crate::Args;
use anyhow::Context as _;
use eval::plan::PairingName;
use eval::profiles::{profile_cases, record_cases, ProfileParams, RecordParams};
use eval::run::{self, Dataset};
use eval::study::{self, PromptRecord, StudyConfig, StudyRecord};
use gateway::corpus::{Corpus, Engines};
use gateway::models::{self, Role};
use gateway::pipeline::{ChunkOrder, Pipeline, ScoreSource};
use std::collections::HashSet;
use std::io::IsTerminal as _;
use std::path::{Path, PathBuf};

/// The main ratio of the study.
const RHO: f64 = 0.15;
/// The ratios of the sweep (besides the main one).
const SWEEP: [f64; 4] = [0.05, 0.10, 0.25, 0.40];

/// The study's datasets with `n` cases each: the synthetic ones, and the real-text ones of
/// `real` (at most `n` cases each).
fn datasets(n: usize, skip: usize, seed: u64, real: &[&str]) -> anyhow::Result<Vec<Dataset>> {
    let mut sets = first_datasets(n + skip, seed, real)?;
    for ds in &mut sets {
        ds.cases.drain(..skip.min(ds.cases.len()));
    }
    Ok(sets)
}

fn first_datasets(n: usize, seed: u64, real: &[&str]) -> anyhow::Result<Vec<Dataset>> {
    let mut sets = vec![
        Dataset {
            name: "profiles".into(),
            cases: profile_cases(&ProfileParams {
                cases: n,
                documents: 5,
                seed,
            }),
            top_k: 4,
            order: ChunkOrder::Rank,
            chunk_tokens: 512,
            max_tokens: study::MAX_TOKENS,
        },
        Dataset {
            name: "records".into(),
            cases: record_cases(&RecordParams {
                cases: n,
                records: 4,
                seed,
            }),
            top_k: 4,
            order: ChunkOrder::Rank,
            chunk_tokens: 512,
            max_tokens: study::MAX_TOKENS,
        },
    ];
    for name in real {
        sets.push(eval::real::dataset(name, Some(n), study::MAX_TOKENS)?);
    }
    Ok(sets)
}

/// The pipeline a study of `target` (with `spec`) runs, its data under `dir`.
fn study_pipeline(args: &Args, target: &Path, spec: &Path, dir: &Path) -> anyhow::Result<Pipeline> {
    let engines = Engines::new(load_model(target)?, Some(load_model(spec)?))?;
    let store = gateway::corpus::StoreOptions {
        codec: args.kv_codec,
        ..Default::default()
    };
    let corpus = Corpus::open_with(dir, 1 << 30, &store)
        .with_context(|| format!("opening data directory {}", dir.display()))?;
    let mut pipeline = Pipeline::new(engines, corpus, ScoreSource::Query);
    pipeline.verify_mode = args.study_verify_mode;
    pipeline.guard = gateway::fidelity::GuardPolicy {
        margin: args.guard_margin,
        horizon: args.guard_horizon,
        phrasing_horizon: args.guard_phrasing_horizon,
        second_look: args.guard_second_look,
        confirm_gap: args.guard_confirm_gap,
        look_narrowing: args.guard_look_narrowing,
        looks: args.guard_looks,
        look: args.guard_look,
        look_cost: args.guard_look_cost,
        look_answers: None,
    };
    Ok(pipeline)
}

/// `--guard-curve`: the fidelity guard's operating curve on `label`'s rows of `from`.
pub fn guard_curve(from: &Path, label: &str, horizon: usize) -> anyhow::Result<bool> {
    let records = study::read_records(from)
        .with_context(|| format!("{} is not a study.jsonl", from.display()))?;
    let margins = [
        0.0, 0.1, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0,
        6.0,
    ];
    let curves = study::guard_curve::curve(&records, label, &margins, horizon);
    if curves.values().all(|p| p.iter().all(|p| p.cases == 0)) {
        anyhow::bail!(
            "{} has no `{label}` rows with margins paired with full recompute",
            from.display()
        );
    }
    let oracles = study::guard_curve::oracle_points(&records, label);
    print!(
        "{}",
        study::guard_curve::markdown(&curves, &oracles, label, horizon)
    );
    println!("\nAUC of each signal for an answer different from full recompute's:\n");
    for (ds, aucs) in study::guard_curve::signal_aucs(&records, label) {
        let cells: Vec<String> = aucs.iter().map(|(n, a)| format!("{n} {a:.2}")).collect();
        println!("- {ds}: {}", cells.join(", "));
    }
    let loops = study::guard_curve::loops_absent_from_full(&records, label, 6);
    println!(
        "\n`{label}` answers that repeat a run of 6 words full recompute's answer does not: {} {loops:?}",
        loops.len()
    );
    Ok(true)
}

/// `--study --render`: `<out>/study.md` from the answers in `from`, loading no model.
pub fn render(from: &Path, out: &Path, best: &str) -> anyhow::Result<bool> {
    let records = study::read_records(from)
        .with_context(|| format!("{} is not a study.jsonl", from.display()))?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let md = out.join("study.md");
    std::fs::write(&md, study::markdown(&records, best))
        .with_context(|| format!("writing {}", md.display()))?;
    eprintln!("wrote {} ({} answers)", md.display(), records.len());
    Ok(true)
}

/// Runs the study for the pairings of `args`, appending to `<out>/study.jsonl`, then writes
/// `<out>/study.md`.
pub fn run(args: &Args) -> anyhow::Result<bool> {
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let path = args.out.join("study.jsonl");
    if !args.resume && path.exists() {
        anyhow::bail!(
            "{} exists: pass --resume to continue it, or choose another --out",
            path.display()
        );
    }
    check_selection(args)?;
    study::repair(&path)?;
    let mut records = study::read_records(&path)?;
    let mut prompts = Prompts::open(&args.out)?;
    let tmp = tempfile::tempdir()?;
    let data_root = args.data.clone().unwrap_or_else(|| tmp.path().into());
    let pairings = if args.pairings.is_empty() {
        vec![PairingName::Small]
    } else {
        args.pairings.clone()
    };
    for &pairing in &pairings {
        let (target, spec) = match pairing {
            PairingName::Small => (
                models::resolve(args.target.as_deref(), Role::Target)?,
                models::resolve(args.speculator.as_deref(), Role::Speculator)?,
            ),
            PairingName::Large => (
                models::resolve(args.large_target.as_deref(), Role::LargeTarget)?,
                models::resolve(args.target.as_deref(), Role::Target)?,
            ),
        };
        let n = if pairing == PairingName::Small {
            args.study_cases
        } else {
            args.study_large_cases
        };
        prompts.target = file_name(&target);
        let pipeline = study_pipeline(args, &target, &spec, &data_root.join(pairing.name()))?;
        eprintln!(
            "study {pairing}: {} -> {}, {n} cases per dataset, chunk KV stored {}{}",
            file_name(&spec),
            file_name(&target),
            args.kv_codec,
            if args.study_verify {
                format!(", every method also verified ({})", args.study_verify_mode)
            } else {
                String::new()
            }
        );
        let wanted =
            |d: &Dataset| args.study_datasets.is_empty() || args.study_datasets.contains(&d.name);
        let real: Vec<&str> = eval::real::NAMES
            .into_iter()
            .filter(|r| args.study_datasets.iter().any(|d| d == r))
            .collect();
        for mut ds in datasets(n, args.study_skip, args.seed, &real)?
            .into_iter()
            .filter(wanted)
        {
            if let Some(order) = args
                .study_order
                .filter(|_| ds.order != ChunkOrder::Document)
            {
                ds.order = order;
            }
            run_dataset(
                &pipeline,
                pairing.name(),
                &ds,
                args,
                &mut records,
                &mut prompts,
            )?;
        }
    }
    let report = study::markdown(&records, &args.study_best);
    let md = args.out.join("study.md");
    std::fs::write(&md, report).with_context(|| format!("writing {}", md.display()))?;
    eprintln!("wrote {} ({} answers)", md.display(), records.len());
    Ok(true)
}

/// Where a run writes: `<out>/study.jsonl` (answers) and `<out>/prompts.jsonl` (each
/// answered case's prompt token ids, once per case).
struct Prompts {
    study: PathBuf,
    path: PathBuf,
    have: HashSet<(String, String, String)>,
    /// The current pairing's target file name.
    target: String,
}

impl Prompts {
    fn open(out: &Path) -> anyhow::Result<Self> {
        let path = out.join("prompts.jsonl");
        study::repair(&path)?;
        let have = study::read_jsonl::<PromptRecord>(&path)?
            .into_iter()
            .map(|p| (p.pairing, p.dataset, p.case))
            .collect();
        Ok(Self {
            study: out.join("study.jsonl"),
            path,
            have,
            target: String::new(),
        })
    }

    fn add(
        &mut self,
        pairing: &str,
        dataset: &str,
        case: &str,
        ids: Vec<u32>,
    ) -> anyhow::Result<()> {
        if !self
            .have
            .insert((pairing.into(), dataset.into(), case.into()))
        {
            return Ok(());
        }
        let prompt = PromptRecord {
            pairing: pairing.into(),
            dataset: dataset.into(),
            case: case.into(),
            target: self.target.clone(),
            ids,
        };
        study::append(&self.path, &[prompt])
    }
}

/// `--study-configs` and `--study-datasets` name only what the study has.
fn check_selection(args: &Args) -> anyhow::Result<()> {
    let known: Vec<String> = study::main_configs(RHO)
        .into_iter()
        .chain(study::subset_configs(RHO, &SWEEP))
        .map(|c| c.label())
        .collect();
    // Every label of the study's own parses too; `known` only lists them in the error.
    if let Some(bad) = args
        .study_configs
        .iter()
        .find(|l| StudyConfig::parse(l).is_none())
    {
        anyhow::bail!(
            "--study-configs: unknown configuration `{bad}` (one of {}, or any budgeted \
             method at a ratio in (0, 1] with two decimals, such as target_probe@0.30)",
            known.join(", ")
        );
    }
    let known: Vec<&str> = ["profiles", "records"]
        .into_iter()
        .chain(eval::real::NAMES)
        .collect();
    if let Some(bad) = args
        .study_datasets
        .iter()
        .find(|d| !known.contains(&d.as_str()))
    {
        anyhow::bail!(
            "--study-datasets: unknown dataset `{bad}` ({})",
            known.join(", ")
        );
    }
    // A named sweep configuration is not an error, but it runs on fewer cases than the main
    // ones: say so rather than leave a user wondering where its rows went.
    let main: Vec<String> = study::main_configs(RHO).iter().map(|c| c.label()).collect();
    let sweep_only: Vec<&str> = args
        .study_configs
        .iter()
        .filter(|l| !main.contains(l))
        .map(String::as_str)
        .collect();
    if !sweep_only.is_empty() {
        eprintln!(
            "note: {} run{} on the first --sweep-cases ({}) cases of each dataset only",
            sweep_only.join(", "),
            if sweep_only.len() == 1 { "s" } else { "" },
            args.sweep_cases
        );
    }
    Ok(())
}

/// Every case of `ds` not yet in `records`: the main configurations, and the subset's on the
/// first `sweep_cases` (only those of `only`, when given).
fn run_dataset(
    pipeline: &Pipeline,
    pairing: &str,
    ds: &Dataset,
    args: &Args,
    records: &mut Vec<StudyRecord>,
    prompts: &mut Prompts,
) -> anyhow::Result<()> {
    let path = prompts.study.clone();
    let (sweep_cases, only) = (args.sweep_cases, &args.study_configs);
    let run = study::RunOptions {
        codec: args.kv_codec,
        verify: args.study_verify,
    };
    // Full recompute (the reference) stays first whatever --study-configs keeps.
    let kept = |configs: Vec<StudyConfig>| -> Vec<StudyConfig> {
        let keep = |c: &StudyConfig| only.is_empty() || only.contains(&c.label());
        let mut it = configs.into_iter();
        it.next().into_iter().chain(it.filter(keep)).collect()
    };
    let mut with_sweep = study::main_configs(RHO);
    let main = kept(with_sweep.clone());
    with_sweep.extend(study::subset_configs(RHO, &SWEEP));
    // Configurations named outside the study's own (another ρ) join the sweep's cases.
    let extra: Vec<StudyConfig> = only
        .iter()
        .filter_map(|l| StudyConfig::parse(l))
        .filter(|c| !with_sweep.contains(c))
        .collect();
    with_sweep.extend(extra);
    let with_sweep = kept(with_sweep);
    let lines = !std::io::stderr().is_terminal();
    let b = bar(ds.cases.len() as u64, &format!("{pairing} {}", ds.name));
    let mut ingested = HashSet::new();
    for (i, case) in ds.cases.iter().enumerate() {
        b.inc(1);
        let wanted = if i < sweep_cases { &with_sweep } else { &main };
        let have: std::collections::HashSet<&str> = records
            .iter()
            .filter(|r| (r.pairing.as_str(), &r.dataset, &r.case) == (pairing, &ds.name, &case.id))
            .map(|r| r.label.as_str())
            .collect();
        // The reference runs again (its logits are not stored), then what the case lacks.
        let missing: Vec<StudyConfig> = wanted
            .iter()
            .enumerate()
            .filter(|(j, c)| *j == 0 || !have.contains(c.label_on(run.codec).as_str()))
            .map(|(_, c)| *c)
            .collect();
        if missing.len() == 1 && have.contains(missing[0].label_on(run.codec).as_str()) {
            continue;
        }
        let one = Dataset {
            cases: vec![case.clone()],
            ..ds.clone()
        };
        // A shared collection (`repo_docs`) is ingested with the first case that runs.
        if case
            .collection
            .as_ref()
            .is_none_or(|c| ingested.insert(c.clone()))
        {
            run::ingest(pipeline, pairing, &one, &mut || {})?;
        }
        let (mut recs, ids) = study::run_case(pipeline, pairing, &one, case, &missing, run)?;
        recs.retain(|r| !have.contains(r.label.as_str()));
        study::append(&path, &recs)?;
        prompts.add(pairing, &ds.name, &case.id, ids)?;
        if lines {
            let ok = |l: &str| {
                recs.iter()
                    .find(|r| r.label == l)
                    .map(|r| (r.identical, r.correct))
            };
            eprintln!(
                "{pairing} {} {}: {} answers; full_reuse (identical, correct) {:?}",
                ds.name,
                case.id,
                recs.len(),
                ok("full_reuse")
            );
        }
        records.extend(recs);
    }
    b.finish_and_clear();
    Ok(())
}
