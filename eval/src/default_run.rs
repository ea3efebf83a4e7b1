//! The default run (not `--study`): the datasets of each pairing, every configuration answering
//! every case, the load test, and the report with its charts.

use crate::cli::{bar, file_name, load_model};
use crate::Args;
use anyhow::Context as _;
use eval::datasets::{self, BridgeParams, Case, NeedleParams};
use eval::load::{self, LoadPlan};
use eval::method::Method;
use eval::plan::{self, Budget, Config, ConfigKey, Pairing, PairingName};
use eval::report::{self, Meta, Results};
use eval::run::{self, Dataset, Record};
use gateway::corpus::{Corpus, Engines};
use gateway::models::{self, Role};
use gateway::pipeline::{ChunkOrder, Pipeline, ScoreSource};
use std::io::IsTerminal as _;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The synthetic datasets of a budget.
pub(crate) fn synthetic(b: &Budget, seed: u64) -> Vec<Dataset> {
    vec![
        Dataset {
            name: datasets::BRIDGE.into(),
            cases: datasets::bridge_cases(&BridgeParams {
                cases: b.bridge_cases,
                distractors: b.bridge_distractors,
                filler_words: b.bridge_filler_words,
                seed,
            }),
            top_k: 4,
            order: ChunkOrder::Rank,
            chunk_tokens: 256,
            max_tokens: 24,
        },
        Dataset {
            name: datasets::NEEDLE.into(),
            cases: datasets::needle_cases(&NeedleParams {
                lengths: b.needle_lengths.clone(),
                depths: b.needle_depths.clone(),
                // One document per haystack; ingestion cuts it into chunks.
                doc_words: 100_000,
                seed,
            }),
            // Enough for the longest haystack: the whole of it is read, in order.
            top_k: 16,
            order: ChunkOrder::Document,
            chunk_tokens: 128,
            max_tokens: 16,
        },
    ]
}

/// Ingests `sets` and answers each of their cases with `configs` (plus the ρ = 1 identity
/// configurations on the first `identity_cases` cases of each set).
pub(crate) fn evaluate(
    pipeline: &Pipeline,
    pairing: PairingName,
    sets: &[Dataset],
    configs: &[Config],
    identity_cases: usize,
    res: &mut Results,
) -> anyhow::Result<()> {
    for ds in sets {
        let b = bar(ds.cases.len() as u64, &format!("ingest {}", ds.name));
        let info = run::ingest(pipeline, pairing.name(), ds, &mut || b.inc(1))?;
        b.finish_and_clear();
        eprintln!(
            "{pairing}: ingested {} ({} documents, {} chunks, {} tokens) in {:.1} s",
            ds.name, info.documents, info.chunks, info.tokens, info.seconds
        );
        res.ingest.push(info);
    }
    // Warm-up (not recorded): the first forward of a freshly loaded model pays page faults.
    if let Some((ds, case)) = sets.iter().find_map(|d| d.cases.first().map(|c| (d, c))) {
        let (q, knobs) = run::query(ds, case, &Config::full_recompute());
        pipeline
            .query_with(&q, &knobs, &mut |_| true)
            .map_err(|e| anyhow::anyhow!("warm-up query: {e}"))?;
    }
    let identity = plan::identity_configs();
    let total: usize = sets
        .iter()
        .map(|d| d.cases.len() * configs.len() + d.cases.len().min(identity_cases) * identity.len())
        .sum();
    let b = bar(total as u64, &format!("{pairing} answers"));
    // Without a terminal the bar is hidden: a line per case shows progress instead.
    let lines = !std::io::stderr().is_terminal();
    let started = Instant::now();
    for ds in sets {
        for (i, case) in ds.cases.iter().enumerate() {
            let mut cs = configs.to_vec();
            if i < identity_cases {
                cs.extend(identity.iter().cloned());
            }
            let recs: Vec<Record> =
                run::run_case(pipeline, pairing, ds, case, &cs, &mut |label| {
                    b.set_message(format!("{} {label}", case.id));
                    b.inc(1);
                })?;
            res.records.extend(recs);
            if lines {
                eprintln!(
                    "{pairing}: {} answered ({}/{total} answers, {:.0} s)",
                    case.id,
                    b.position(),
                    started.elapsed().as_secs_f64()
                );
            }
        }
    }
    b.finish_and_clear();
    Ok(())
}

/// The Poisson load of the small pairing over the bridge cases.
pub(crate) fn load_test(
    pipeline: Arc<Pipeline>,
    pairing: PairingName,
    bridge: &Dataset,
    b: &Budget,
    seed: u64,
    res: &mut Results,
) -> anyhow::Result<()> {
    let full: Vec<&Record> = res
        .records
        .iter()
        .filter(|r| {
            r.pairing == pairing
                && r.dataset == bridge.name
                && r.config == ConfigKey::full_recompute()
                && bridge.cases.iter().any(|c| c.id == r.case)
        })
        .collect();
    if full.is_empty() {
        return Ok(());
    }
    let gamma = 0.8 * eval::metrics::mean(&full.iter().map(|r| r.f1).collect::<Vec<_>>());
    let service_ms =
        eval::metrics::median(&full.iter().map(|r| r.timings.total_ms).collect::<Vec<_>>());
    let rates = b
        .load_factors
        .iter()
        .map(|f| (*f, f * 1000.0 / service_ms.max(1.0)))
        .collect();
    let lp = LoadPlan {
        pairing,
        methods: b
            .load_methods
            .iter()
            .map(|m| {
                let ratio = if m.is_full() { 1.0 } else { plan::MAIN_RATIO };
                (*m, ratio)
            })
            .collect(),
        rates,
        requests: b.load_requests,
        gamma,
        seed,
    };
    let pb = bar((lp.methods.len() * lp.rates.len()) as u64, "poisson load");
    let lines = !std::io::stderr().is_terminal();
    let points = load::run(pipeline, bridge, &lp, &mut |p| {
        pb.set_message(format!("{} at {:.3}/s", p.method, p.rate_rps));
        pb.inc(1);
        if lines {
            eprintln!(
                "{pairing}: load {} at {:.3}/s: {}/{} answered in {:.1} s",
                p.method, p.rate_rps, p.ok, p.requests, p.duration_s
            );
        }
    })?;
    pb.finish_and_clear();
    res.load = points;
    Ok(())
}

pub(crate) fn limited(mut cases: Vec<Case>, limit: Option<u32>) -> Vec<Case> {
    if let Some(n) = limit {
        cases.truncate(n as usize);
    }
    cases
}

/// `--render`: the report and charts of an earlier run, from its results.json.
pub(crate) fn render(from: &Path, out: &Path) -> anyhow::Result<bool> {
    let text =
        std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
    let mut res: Results = serde_json::from_str(&text)
        .with_context(|| format!("{} is not a specrag-eval results.json", from.display()))?;
    res.summarize();
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    write_report(out, &res)?;
    eprintln!("wrote {}", out.join("report.md").display());
    Ok(res.identity_holds())
}

pub(crate) fn run_all(args: Args) -> anyhow::Result<bool> {
    if let Some(from) = &args.render {
        return render(from, &args.out);
    }
    let started = Instant::now();
    let budget = if args.quick {
        Budget::quick()
    } else {
        Budget::default_run()
    };
    let pairings: Vec<PairingName> = if args.pairings.is_empty() {
        if args.quick {
            vec![PairingName::Small]
        } else {
            vec![PairingName::Small, PairingName::Large]
        }
    } else {
        args.pairings.clone()
    };
    // Every input is read before any model is loaded, so a bad file fails at once.
    let (sets, queries) = read_datasets(&args, &budget)?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let tmp = tempfile::tempdir()?;
    let data_root = args
        .data
        .clone()
        .unwrap_or_else(|| tmp.path().to_path_buf());

    let small_target = models::resolve(args.target.as_deref(), Role::Target)?;
    let small_spec = models::resolve(args.speculator.as_deref(), Role::Speculator)?;
    let large_target = if pairings.contains(&PairingName::Large) {
        Some(models::resolve(
            args.large_target.as_deref(),
            Role::LargeTarget,
        )?)
    } else {
        None
    };

    let mut res = new_results(&args);

    let run = PairingRun {
        args: &args,
        budget: &budget,
        sets: &sets,
        queries: queries.as_ref(),
        small: (&small_target, &small_spec),
        large: large_target.as_deref(),
        data_root: &data_root,
    };
    for &pairing in &pairings {
        run.run(pairing, &mut res)?;
    }
    add_notes(&mut res, &args, &pairings, &budget);
    res.summarize();
    res.meta.seconds = started.elapsed().as_secs_f64();
    write(&args.out, &res)?;
    let ok = res.identity_holds();
    eprintln!(
        "wrote {} ({} answers, {:.0} s)",
        args.out.join("report.md").display(),
        res.records.len(),
        res.meta.seconds
    );
    if !ok {
        eprintln!("error: a ρ = 1 configuration did not answer exactly as full recompute (see the report's identity table)");
    }
    Ok(ok)
}

/// Every dataset of the run (the synthetic ones unless `--no-synthetic`, LongBench files) and
/// the query file's, checked before any model loads: a bad file fails at once.
pub(crate) fn read_datasets(
    args: &Args,
    budget: &Budget,
) -> anyhow::Result<(Vec<Dataset>, Option<Dataset>)> {
    let mut sets = if args.no_synthetic {
        Vec::new()
    } else {
        synthetic(budget, args.seed)
    };
    for f in &args.longbench {
        sets.push(Dataset {
            name: format!("longbench:{}", file_name(f)),
            cases: limited(datasets::load_longbench(f)?, args.limit),
            top_k: args.top_k as usize,
            order: ChunkOrder::Document,
            chunk_tokens: args.chunk_tokens as usize,
            max_tokens: args.max_tokens as usize,
        });
    }
    for name in &args.datasets {
        sets.push(eval::real::dataset(
            name,
            args.limit.map(|n| n as usize),
            args.max_tokens as usize,
        )?);
    }
    let queries = match &args.queries {
        Some(f) => Some(Dataset {
            name: format!("queries:{}", file_name(f)),
            cases: limited(datasets::load_queries(f, &args.collection)?, args.limit),
            top_k: args.top_k as usize,
            order: ChunkOrder::Rank,
            chunk_tokens: args.chunk_tokens as usize,
            max_tokens: args.max_tokens as usize,
        }),
        None => None,
    };
    if sets.is_empty() && queries.is_none() {
        anyhow::bail!(
            "nothing to evaluate: --no-synthetic without --datasets, --longbench or --queries"
        );
    }
    let all_sets = || sets.iter().chain(queries.as_ref());
    if all_sets().all(|d| d.cases.is_empty()) {
        anyhow::bail!("nothing to evaluate: the dataset files hold no case");
    }
    // Each case has its own collection (named after its id): two cases with one id would
    // answer from each other's documents.
    let mut seen = std::collections::HashMap::new();
    for d in all_sets() {
        for c in d.cases.iter().filter(|c| c.collection.is_none()) {
            if let Some(other) = seen.insert(run::collection_of(c), &d.name) {
                anyhow::bail!(
                    "case id `{}` appears in {other} and in {} (or twice in one file); give \
                     every LongBench line a distinct `_id`",
                    c.id,
                    d.name
                );
            }
        }
    }
    if let Some(dir) = &args.queries_data {
        if !dir.join("index").is_dir() {
            anyhow::bail!(
                "--queries-data {}: no index there; point it at a data directory filled by \
                 `specrag ingest --data DIR`",
                dir.display()
            );
        }
    }
    Ok((sets, queries))
}

/// What one pairing's part of the default run needs.
pub(crate) struct PairingRun<'a> {
    args: &'a Args,
    budget: &'a Budget,
    sets: &'a [Dataset],
    queries: Option<&'a Dataset>,
    /// The small pairing's target and speculator.
    small: (&'a Path, &'a Path),
    /// The large pairing's target, when it runs.
    large: Option<&'a Path>,
    data_root: &'a Path,
}

impl PairingRun<'_> {
    /// The configurations, datasets and ρ = 1 identity cases of `pairing`.
    fn plan(&self, pairing: PairingName) -> (Vec<Config>, Vec<Dataset>, usize) {
        if pairing == PairingName::Small {
            let mut c = plan::configs(&self.budget.ratios, self.budget.extras);
            if self.args.quick {
                // Every method at the one ratio, nothing else.
                c.retain(|c| c.group == plan::Group::Main);
            }
            (c, self.sets.to_vec(), if self.args.quick { 3 } else { 2 })
        } else {
            let c: Vec<Config> = plan::configs(&[plan::MAIN_RATIO], false)
                .into_iter()
                .filter(|c| c.method != Method::Prefix)
                .collect();
            // The large target is ~3x slower: its bridge cases only, fewer of them.
            let s: Vec<Dataset> = self
                .sets
                .iter()
                .filter(|d| d.name != datasets::NEEDLE)
                .map(|d| Dataset {
                    cases: if d.name == datasets::BRIDGE {
                        d.cases
                            .iter()
                            .take(self.budget.large_cases.max(1))
                            .cloned()
                            .collect()
                    } else {
                        d.cases.clone()
                    },
                    ..d.clone()
                })
                .collect();
            (c, s, 1)
        }
    }

    /// Loads the pairing's models and answers its datasets (and the load test on the small
    /// pairing) into `res`.
    fn run(&self, pairing: PairingName, res: &mut Results) -> anyhow::Result<()> {
        let (target_path, spec_path) = match pairing {
            PairingName::Small => (self.small.0.to_path_buf(), self.small.1.to_path_buf()),
            PairingName::Large => (
                self.large.unwrap_or(self.small.0).to_path_buf(),
                self.small.0.to_path_buf(),
            ),
        };
        let target = load_model(&target_path)?;
        let spec = load_model(&spec_path)?;
        res.pairings.push(Pairing {
            name: pairing,
            speculator: file_name(&spec_path),
            target: file_name(&target_path),
        });
        let engines = Engines::new(target.clone(), Some(spec.clone()))?;
        let dir = self.data_root.join(pairing.name());
        let store = gateway::corpus::StoreOptions {
            codec: self.args.kv_codec,
            ..Default::default()
        };
        let corpus = Corpus::open_with(&dir, 1 << 30, &store)
            .with_context(|| format!("opening data directory {}", dir.display()))?;
        let pipeline = Arc::new(Pipeline::new(engines, corpus, ScoreSource::Query));
        let (configs, my_sets, identity_cases) = self.plan(pairing);
        let mut listed = configs.clone();
        listed.extend(plan::identity_configs());
        res.configs.push((pairing, listed));
        evaluate(&pipeline, pairing, &my_sets, &configs, identity_cases, res)?;
        if let Some(q) = self.queries {
            let qdir = self.args.queries_data.clone().unwrap_or_default();
            let qp = Pipeline::new(
                Engines::new(target.clone(), Some(spec.clone()))?,
                Corpus::open(&qdir, 1 << 30)
                    .with_context(|| format!("opening data directory {}", qdir.display()))?,
                ScoreSource::Query,
            );
            evaluate(&qp, pairing, std::slice::from_ref(q), &configs, 0, res)?;
        }
        let bridge = my_sets.iter().find(|d| d.name == datasets::BRIDGE);
        if pairing == PairingName::Small && !self.args.no_load && self.budget.load_requests > 0 {
            if let Some(bridge) = bridge {
                let mut load_set = bridge.clone();
                load_set.cases.truncate(self.budget.load_requests.max(1));
                load_test(
                    pipeline,
                    pairing,
                    &load_set,
                    self.budget,
                    self.args.seed,
                    res,
                )?;
            }
        }
        Ok(())
    }
}

/// An empty result set with the run's metadata.
pub(crate) fn new_results(args: &Args) -> Results {
    Results {
        meta: Meta {
            quick: args.quick,
            seed: args.seed,
            command: std::iter::once("specrag-eval".to_string())
                .chain(std::env::args().skip(1))
                .collect::<Vec<_>>()
                .join(" "),
            machine: eval::sysinfo::machine(),
            date: eval::sysinfo::utc_now(),
            seconds: 0.0,
        },
        ..Default::default()
    }
}

/// The notes every report carries: what this run left out.
pub(crate) fn add_notes(res: &mut Results, args: &Args, pairings: &[PairingName], budget: &Budget) {
    if args.quick {
        res.notes.push(
            "Quick run: a smoke test of the harness (3 cases, one ratio, small pairing). Its \
             numbers are too few to compare methods; see the default run."
                .into(),
        );
    }
    if !pairings.contains(&PairingName::Large) {
        res.notes
            .push("The large pairing (Qwen-0.5B -> Qwen-1.5B) was not run.".into());
    } else {
        res.notes.push(format!(
            "The large pairing (the 1.5B target is ~3x slower on this machine) runs at ρ = {} \
             only, without the needle cases and with at most {} bridge cases.",
            plan::MAIN_RATIO,
            budget.large_cases.max(1)
        ));
    }
    if res.load.is_empty() {
        res.notes.push(
            "No load test: it runs with the small pairing over the bridge cases, unless \
             --no-load."
                .into(),
        );
    }
}

pub(crate) fn write(out: &Path, res: &Results) -> anyhow::Result<()> {
    let p = out.join("results.json");
    std::fs::write(&p, serde_json::to_string_pretty(res)?)
        .with_context(|| format!("writing {}", p.display()))?;
    write_report(out, res)
}

/// report.md and the charts.
pub(crate) fn write_report(out: &Path, res: &Results) -> anyhow::Result<()> {
    let put = |name: &str, text: &str| -> anyhow::Result<()> {
        let p = out.join(name);
        std::fs::write(&p, text).with_context(|| format!("writing {}", p.display()))
    };
    put("report.md", &report::markdown(res))?;
    for (name, svg) in report::charts(res) {
        put(&name, &svg)?;
    }
    Ok(())
}
