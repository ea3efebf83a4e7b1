//! The CI smoke run: `specrag-eval --quick` on the default models. It asserts the report's
//! structure and the ρ = 1 identity (every ρ = 1 configuration answers exactly as full
//! recompute), not speed.

use eval::method::Method;
use eval::plan::{ConfigKey, Group, PairingName};
use eval::report::Results;
use std::path::PathBuf;
use std::process::Command;

#[allow(
    clippy::too_many_lines,
    reason = "one quick run of the harness on the real models (minutes) checked as a whole; split tests would each pay for it"
)]
#[test]
fn quick_run_writes_a_complete_report_and_rho_one_is_full_recompute(
) -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = tempfile::tempdir()?;
    // Run from the workspace root, where `specrag models fetch` puts the default models
    // ($SPECRAG_MODELS, if set, still wins).
    let status = Command::new(env!("CARGO_BIN_EXE_specrag-eval"))
        .current_dir(&root)
        .args(["--quick", "--out"])
        .arg(out.path())
        .status()?;
    assert!(
        status.success(),
        "specrag-eval --quick failed ({status}); a missing model names `specrag models fetch`"
    );
    let res: Results =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("results.json"))?)?;
    assert!(res.meta.quick);
    assert_eq!(res.pairings.len(), 1);
    assert_eq!(res.pairings[0].name, PairingName::Small);
    let (_, configs) = &res.configs[0];
    let main: Vec<_> = configs.iter().filter(|c| c.group == Group::Main).collect();
    assert_eq!(
        main.iter().map(|c| c.method.name()).collect::<Vec<_>>(),
        [
            "full_recompute",
            "full_reuse",
            "prefix",
            "epic",
            "cacheblend",
            "speccache",
            "speccache_nospan",
            "target_probe"
        ]
    );
    // Two bridge cases and one needle case, every one answered by every configuration.
    let cases: std::collections::BTreeSet<&str> =
        res.records.iter().map(|r| r.case.as_str()).collect();
    assert_eq!(cases.len(), 3, "{cases:?}");
    assert_eq!(res.records.len(), 3 * configs.len());
    for r in &res.records {
        assert!(r.kl_first.is_finite() && r.kl_first >= 0.0, "{r:?}");
        assert!((0.0..=1.0).contains(&r.f1) && (0.0..=1.0).contains(&r.rouge_l_full));
        assert!(r.timings.ttft_ms > 0.0 && r.timings.total_ms >= r.timings.ttft_ms);
        if r.config == ConfigKey::full_recompute() {
            assert!(r.match_full && r.kl_first == 0.0);
            assert_eq!(r.reuse.ratio, 1.0);
        }
        // Every label starting `speccache@0.15` or `cacheblend@0.15`.
        if matches!(r.config.method, Method::Speccache | Method::Cacheblend)
            && r.config.ratio == Some(0.15)
        {
            assert!(
                r.reuse.ratio > 0.0 && r.reuse.ratio < 0.5,
                "{} recomputed {}",
                r.config,
                r.reuse.ratio
            );
        }
    }
    // Summary rows: every configuration over all cases and per dataset, and the ratio to full.
    for scope in ["all", "bridge", "needle"] {
        let rows = res.rows(PairingName::Small, scope);
        assert_eq!(rows.len(), configs.len(), "{scope}");
        let full = rows
            .iter()
            .find(|r| r.config.is_reference())
            .ok_or("no reference row")?;
        assert!((full.ttft_ratio - 1.0).abs() < 1e-12);
    }
    // ρ = 1 identity: speccache, cacheblend, epic and target_probe answer exactly as full
    // recompute.
    assert_eq!(res.identity.len(), 4);
    for i in &res.identity {
        assert_eq!(i.cases, 3, "{i:?}");
        assert!(i.holds, "{i:?}");
        assert_eq!(i.exact, i.cases);
    }
    // The load test went through the real server: two methods, one rate, every request answered.
    assert_eq!(res.load.len(), 2);
    for l in &res.load {
        assert_eq!((l.requests, l.ok, l.failed), (3, 3, 0), "{l:?}");
        assert!(l.throughput_rps > 0.0 && l.goodput_rps <= l.throughput_rps);
    }
    // The report names every section and every chart it links exists as an SVG.
    let md = std::fs::read_to_string(out.path().join("report.md"))?;
    for section in [
        "# specrag evaluation (quick)",
        "## Datasets",
        "### Every method, all cases",
        "### Per dataset",
        "## ρ = 1 identity",
        "## Throughput and goodput",
    ] {
        assert!(md.contains(section), "report lacks {section}");
    }
    let mut linked = 0;
    for part in md.split("](").skip(1) {
        let file = part.split(')').next().unwrap_or_default();
        if file.ends_with(".svg") {
            let svg = std::fs::read_to_string(out.path().join(file))?;
            assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
            linked += 1;
        }
    }
    assert_eq!(linked, 6, "4 charts of the pairing, goodput and throughput");
    Ok(())
}
