//! The fidelity study's plumbing on tiny random-weight models (not quality): every case gets
//! every configuration paired with full recompute, the sweep runs on the first cases, a run
//! resumes where it stopped, and the report has its tables.

use eval::study::{self, PromptRecord, StudyRecord};
use std::path::Path;
use std::process::{Command, Output};
use target_engine::testing::{write_tiny_gguf, TinySpec};
use target_engine::Architecture;

/// The tiny target and speculator every study test runs, written into `d`.
fn tiny_models(d: &Path) -> Result<(), Box<dyn std::error::Error>> {
    write_tiny_gguf(&d.join("target.gguf"), &TinySpec::new(Architecture::Qwen2))?;
    write_tiny_gguf(&d.join("spec.gguf"), &TinySpec::new(Architecture::Llama))?;
    Ok(())
}

fn study_cmd(models: &Path, out: &Path, cases: &str, extra: &[&str]) -> std::io::Result<Output> {
    Command::new(env!("CARGO_BIN_EXE_specrag-eval"))
        .arg("--target")
        .arg(models.join("target.gguf"))
        .arg("--speculator")
        .arg(models.join("spec.gguf"))
        .args(["--study", "--study-cases", cases, "--sweep-cases", "1"])
        .arg("--out")
        .arg(out)
        .arg("--data")
        .arg(models.join("data"))
        .args(extra)
        .output()
}

fn ok(o: &Output) -> &Output {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    o
}

#[test]
fn study_pairs_every_configuration_with_full_recompute_and_resumes(
) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    write_tiny_gguf(&d.join("target.gguf"), &TinySpec::new(Architecture::Qwen2))?;
    let mut s = TinySpec::new(Architecture::Llama);
    s.seed = 5;
    write_tiny_gguf(&d.join("spec.gguf"), &s)?;
    let out = d.join("out");
    ok(&study_cmd(d, &out, "2", &[])?);
    let recs: Vec<StudyRecord> = study::read_records(&out.join("study.jsonl"))?;
    let main: Vec<String> = study::main_configs(0.15)
        .iter()
        .map(|c| c.label())
        .collect();
    let sweep = study::subset_configs(0.15, &[0.05, 0.10, 0.25, 0.40]);
    // 2 datasets x 2 cases x the main configurations, plus the subset on the first case of each.
    assert_eq!(recs.len(), 2 * 2 * main.len() + 2 * sweep.len());
    assert_eq!(study::done_cases(&recs, &main).len(), 4);
    for r in recs.iter().filter(|r| r.label == "full_recompute") {
        assert!(r.identical && r.kl_first == 0.0 && r.kl_tf == 0.0, "{r:?}");
        assert!(r.gold_nll.is_finite() && r.gold_nll > 0.0);
    }
    for r in recs.iter().filter(|r| r.label == "oracle@0.15") {
        assert!(r.ratio > 0.0 && r.ratio < 0.25, "{}", r.ratio);
        assert!(!r.selected.is_empty(), "selections are recorded");
    }
    // Each case's prompt once, the ids the target tokenized (what llama.cpp is timed on).
    let prompts: Vec<PromptRecord> = study::read_jsonl(&out.join("prompts.jsonl"))?;
    assert_eq!(prompts.len(), 4);
    assert!(prompts
        .iter()
        .all(|p| p.target == "target.gguf" && p.ids.len() > 10));
    // Without --resume an existing study is not overwritten.
    let again = study_cmd(d, &out, "2", &[])?;
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("--resume"));
    // A torn last line (a killed run) is dropped; --resume adds only the new case.
    let path = out.join("study.jsonl");
    let mut text = std::fs::read_to_string(&path)?;
    text.push_str("{\"pairing\": \"sma");
    std::fs::write(&path, text)?;
    ok(&study_cmd(d, &out, "3", &["--resume"])?);
    let after = study::read_records(&path)?;
    assert_eq!(after.len(), recs.len() + 2 * main.len());
    let prompts: Vec<PromptRecord> = study::read_jsonl(&out.join("prompts.jsonl"))?;
    assert_eq!(prompts.len(), 6, "one line per case, also across --resume");
    // A configuration missing from a finished case is answered alone on --resume.
    let kept: Vec<String> = std::fs::read_to_string(&path)?
        .lines()
        .filter(|l| !(l.contains("\"spec_attn@0.15\"") && l.contains("\"profile-0\"")))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(&path, kept.concat())?;
    assert_eq!(study::read_records(&path)?.len(), after.len() - 1);
    ok(&study_cmd(d, &out, "3", &["--resume"])?);
    assert_eq!(study::read_records(&path)?.len(), after.len());
    let report = std::fs::read_to_string(out.join("study.md"))?;
    assert!(report.contains("## small / profiles") && report.contains("## small / records"));
    assert!(report.contains("| oracle@0.15 | 3 |"));
    // --render rewrites the same report from the answers alone (no model is named).
    let again = d.join("rendered");
    ok(&Command::new(env!("CARGO_BIN_EXE_specrag-eval"))
        .args(["--study", "--render"])
        .arg(&path)
        .arg("--out")
        .arg(&again)
        .output()?);
    assert_eq!(std::fs::read_to_string(again.join("study.md"))?, report);
    Ok(())
}

/// Each guarded configuration of a case pays for its own escalations: the full cache one
/// configuration's escalation computed is not left for the next one over the same prompt.
#[test]
fn every_guarded_configuration_pays_for_its_own_escalations(
) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    tiny_models(d)?;
    let out = d.join("out");
    let guarded = [
        "--study-configs",
        "target_probe@0.15:balanced,target_probe@0.40:balanced",
    ];
    ok(&study_cmd(d, &out, "2", &guarded)?);
    let recs: Vec<StudyRecord> = study::read_records(&out.join("study.jsonl"))?;
    let escalated: Vec<&StudyRecord> = recs
        .iter()
        .filter(|r| r.label == "target_probe@0.40:balanced")
        .filter(|r| r.guard.is_some_and(|g| g.escalated))
        .collect();
    assert!(!escalated.is_empty(), "the tiny models escalate: {recs:?}");
    for r in escalated {
        let g = r.guard.ok_or("guard")?;
        assert!(g.full_prefill_ms > 0.0, "{}: a cached full prefill", r.case);
    }
    Ok(())
}

#[test]
fn study_configs_runs_only_the_named_configurations() -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    tiny_models(d)?;
    let out = d.join("out");
    let only = ["--study-configs", "epic@0.15,target_probe@0.40,epic@0.30"];
    let o = study_cmd(d, &out, "2", &only)?;
    ok(&o);
    // The sweep configuration's smaller reach is announced.
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("target_probe@0.40, epic@0.30 run on the first --sweep-cases"),
        "{err}"
    );
    let recs: Vec<StudyRecord> = study::read_records(&out.join("study.jsonl"))?;
    let count = |l: &str| recs.iter().filter(|r| r.label == l).count();
    // The reference on every case, epic on every case, the sweep's ratio on the first one.
    assert_eq!(count("full_recompute"), 4);
    assert_eq!(count("epic@0.15"), 4);
    assert_eq!(count("target_probe@0.40"), 2);
    // A ratio outside the sweep runs like the sweep's.
    assert_eq!(count("epic@0.30"), 2);
    assert!(recs
        .iter()
        .filter(|r| r.label == "epic@0.30")
        .all(|r| r.config.ratio == 0.3));
    assert_eq!(recs.len(), 12);
    let bad = study_cmd(d, &d.join("out2"), "1", &["--study-configs", "epic@0.2"])?;
    assert!(!bad.status.success());
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        err.contains("--study-configs") && err.contains("epic@0.2"),
        "{err}"
    );
    // --study-datasets picks datasets.
    let out3 = d.join("out3");
    let only = [
        "--study-configs",
        "epic@0.15",
        "--study-datasets",
        "records",
    ];
    ok(&study_cmd(d, &out3, "1", &only)?);
    let recs = study::read_records(&out3.join("study.jsonl"))?;
    assert_eq!(recs.len(), 2);
    assert!(recs.iter().all(|r| r.dataset == "records"));
    let bad = study_cmd(d, &d.join("out4"), "1", &["--study-datasets", "recrods"])?;
    let err = String::from_utf8_lossy(&bad.stderr);
    assert!(
        !bad.status.success() && err.contains("--study-datasets"),
        "{err}"
    );
    Ok(())
}

#[test]
fn study_pairs_a_codec_with_raw_storage_and_measures_verification(
) -> Result<(), Box<dyn std::error::Error>> {
    let dir = tempfile::tempdir()?;
    let d = dir.path();
    tiny_models(d)?;
    let out = d.join("out");
    let only = [
        "--study-configs",
        "full_reuse,target_probe@0.15",
        "--study-datasets",
        "profiles",
    ];
    ok(&study_cmd(d, &out, "2", &only)?);
    let raw_data = [only.as_slice(), &["--resume"]].concat();
    let int8 = [
        raw_data.as_slice(),
        // Drafting to the end: with `full`, a tiny model's full prefill can be ready before
        // the first draft, and nothing is drafted.
        &[
            "--kv-codec",
            "int8",
            "--study-verify",
            "--study-verify-mode",
            "draft-every-2",
        ],
    ]
    .concat();
    // Same data directory: lossy chunks are keyed apart, so raw KV never stands in for int8.
    ok(&study_cmd(d, &out, "2", &int8)?);
    let path = out.join("study.jsonl");
    let recs = study::read_records(&path)?;
    let count = |l: &str| recs.iter().filter(|r| r.label == l).count();
    // Full recompute reads no stored KV: its label has no codec and the raw rows answer it.
    assert_eq!(count("full_recompute"), 2);
    assert_eq!(count("target_probe@0.15"), 2);
    assert_eq!(count("target_probe@0.15+int8"), 2);
    assert_eq!(count("full_reuse+int8"), 2);
    assert_eq!(recs.len(), 10);
    for r in &recs {
        let lossy = r.label.ends_with("+int8");
        assert_eq!(r.codec, if lossy { "int8" } else { "raw" }, "{}", r.label);
        // Verification ran on the int8 rows only, and its answers are full recompute's.
        assert_eq!(r.verify.is_some(), lossy, "{}", r.label);
        if let Some(v) = r.verify {
            assert!(
                v.drafted > 0 && v.rounds > 0 && v.accepted <= v.drafted,
                "{v:?}"
            );
            assert_eq!(r.verify_mode.as_deref(), Some("draft-every-2"));
            assert_eq!(r.verified_identical, Some(true), "{}", r.label);
            // A draft that was full recompute's answer is accepted throughout.
            assert!(!r.identical || v.corrected == 0, "{} {v:?}", r.label);
        }
    }
    let report = std::fs::read_to_string(out.join("study.md"))?;
    assert!(
        report.contains("| target_probe@0.15+int8 | 2 |"),
        "{report}"
    );
    assert!(report.contains("verified identical %"), "{report}");
    assert!(
        report.contains("| target_probe@0.15+int8 | draft-every-2 | 2 |"),
        "{report}"
    );
    // Rows written before rows named their codec read as raw.
    let first = std::fs::read_to_string(&path)?
        .lines()
        .next()
        .unwrap_or_default()
        .replace(",\"codec\":\"raw\"", "");
    assert!(!first.contains("codec"));
    let old: StudyRecord = serde_json::from_str(&first)?;
    assert_eq!(old.codec, "raw");
    Ok(())
}
