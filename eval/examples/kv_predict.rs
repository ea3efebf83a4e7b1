//! Issue 43, predictor (b): how well the speculator's chunk KV predicts the target's, and what
//! that buys the predictive codec. Both models precompute the same chunks of this repository's
//! docs; per target layer and K/V, a linear map from the speculator's layer at the same depth
//! (its K and V, keys with RoPE undone; 257 features with the bias) to the target's (RoPE undone,
//! mapped, RoPE redone) is fitted by ridge least squares on calibration chunks, and the held-out
//! chunks are coded with it (`chunkstore::predictive`, sigma = each channel's calibration
//! residual) next to the per-channel static model the store uses.
//!
//! Predictor (a), with `--requantize`: the target's own weights requantized to each listed
//! format (`LoadOptions::requantize`) precompute the same chunks; their KV is the prediction
//! as it is (sigma again each channel's calibration residual), and each forward is timed
//! against the target's.
//!
//! `cargo run --release -p eval --example kv_predict -- TARGET.gguf SPECULATOR.gguf [CHUNKS]`
//! `cargo run --release -p eval --example kv_predict -- --requantize Q8_0,Q4_0,Q3_K,Q2_K TARGET.gguf [CHUNKS]`

use chunkstore::predictive;
use half::f16;
use std::path::PathBuf;
use std::time::Instant;
use target_engine::prelude::*;
use target_engine::{ChunkKv, GgmlDType, LoadOptions, Model};

const CHUNK: usize = 256;
const FEATURES: usize = 257;

/// The repository's docs, as the demo corpus ingests them, tokenized and cut into chunks.
fn chunks(m: &Model, max: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    let mut files = vec![PathBuf::from("README.md"), PathBuf::from("ARCHITECTURE.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir("docs")?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    files.extend(docs);
    let mut out = Vec::new();
    for f in files {
        let ids = m
            .tokenizer()
            .encode(&std::fs::read_to_string(&f)?, false)
            .ids;
        out.extend(ids.chunks_exact(CHUNK).map(<[u32]>::to_vec));
    }
    // Spread over the documents: every k-th chunk.
    let step = (out.len() / max).max(1);
    Ok(out.into_iter().step_by(step).take(max).collect())
}

/// A layer's keys (`tokens x row`) as f32 with RoPE undone (`m`'s rotation, base position 0).
fn unrotated(m: &Model, layer: &[f16], row: usize, undo: bool) -> anyhow::Result<Vec<f32>> {
    let mut x: Vec<f32> = layer.iter().map(|v| v.to_f32()).collect();
    if undo {
        let tokens = x.len() / row;
        let deltas: Vec<i64> = (0..tokens as i64).map(|t| -t).collect();
        let heads = row / m.config().head_dim;
        m.rope()
            .rotate_by(&mut x, heads, &deltas)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(x)
}

/// The speculator's features of every token for target layer `l`: its layer at the same
/// depth, K (RoPE undone) and V, and a bias.
fn features(
    spec: &Model,
    kv: &ChunkKv,
    l: usize,
    target_layers: usize,
) -> anyhow::Result<Vec<[f64; FEATURES]>> {
    let s = (l * (kv.k.len() - 1) + (target_layers - 1) / 2) / (target_layers - 1);
    let k = unrotated(spec, &kv.k[s], kv.row, true)?;
    let v = unrotated(spec, &kv.v[s], kv.row, false)?;
    let tokens = kv.len();
    Ok((0..tokens)
        .map(|t| {
            let mut f = [0f64; FEATURES];
            for j in 0..kv.row {
                f[j] = f64::from(k[t * kv.row + j]);
                f[kv.row + j] = f64::from(v[t * kv.row + j]);
            }
            f[FEATURES - 1] = 1.0;
            f
        })
        .collect())
}

/// Solves `a x = b` for symmetric positive definite `a` (n x n) by Cholesky, `b` n x m.
fn solve(mut a: Vec<f64>, mut b: Vec<f64>, n: usize, m: usize) -> Vec<f64> {
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        let d = d.max(1e-12).sqrt();
        a[j * n + j] = d;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / d;
        }
    }
    for c in 0..m {
        for i in 0..n {
            let mut s = b[i * m + c];
            for k in 0..i {
                s -= a[i * n + k] * b[k * m + c];
            }
            b[i * m + c] = s / a[i * n + i];
        }
        for i in (0..n).rev() {
            let mut s = b[i * m + c];
            for k in i + 1..n {
                s -= a[k * n + i] * b[k * m + c];
            }
            b[i * m + c] = s / a[i * n + i];
        }
    }
    b
}

struct Pair {
    target: ChunkKv,
    spec: ChunkKv,
}

/// One fitted map: weights (FEATURES x row) and each channel's residual spread.
struct Map {
    w: Vec<f64>,
    sigma: Vec<f32>,
}

fn predict(m: &Map, f: &[[f64; FEATURES]], row: usize) -> Vec<f32> {
    let mut out = vec![0f32; f.len() * row];
    for (t, x) in f.iter().enumerate() {
        for c in 0..row {
            let mut s = 0.0;
            for (j, xj) in x.iter().enumerate() {
                s += xj * m.w[j * row + c];
            }
            out[t * row + c] = s as f32;
        }
    }
    out
}

/// The prediction of target layer `l` (K when `keys`) in the stored (rotated) space.
fn predicted(
    target: &Model,
    m: &Map,
    f: &[[f64; FEATURES]],
    row: usize,
    keys: bool,
) -> anyhow::Result<Vec<f32>> {
    let mut p = predict(m, f, row);
    if keys {
        let deltas: Vec<i64> = (0..f.len() as i64).collect();
        target
            .rope()
            .rotate_by(&mut p, row / target.config().head_dim, &deltas)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(p)
}

fn fit(target: &Model, spec: &Model, cal: &[Pair], l: usize, keys: bool) -> anyhow::Result<Map> {
    let row = cal[0].target.row;
    let mut xtx = vec![0f64; FEATURES * FEATURES];
    let mut xty = vec![0f64; FEATURES * row];
    let mut samples = Vec::new();
    for p in cal {
        let f = features(spec, &p.spec, l, p.target.k.len())?;
        let y = if keys {
            unrotated(target, &p.target.k[l], row, true)?
        } else {
            unrotated(target, &p.target.v[l], row, false)?
        };
        for (t, x) in f.iter().enumerate() {
            for i in 0..FEATURES {
                for j in 0..FEATURES {
                    xtx[i * FEATURES + j] += x[i] * x[j];
                }
                for c in 0..row {
                    xty[i * row + c] += x[i] * f64::from(y[t * row + c]);
                }
            }
        }
        samples.push(f);
    }
    let ridge = 1e-3 * (0..FEATURES).map(|i| xtx[i * FEATURES + i]).sum::<f64>() / FEATURES as f64;
    for i in 0..FEATURES - 1 {
        xtx[i * FEATURES + i] += ridge;
    }
    let w = solve(xtx, xty, FEATURES, row);
    let mut map = Map {
        w,
        sigma: vec![0.0; row],
    };
    let mut sq = vec![0f64; row];
    let mut n = 0usize;
    for (p, f) in cal.iter().zip(&samples) {
        let actual = if keys { &p.target.k[l] } else { &p.target.v[l] };
        let pred = predicted(target, &map, f, row, keys)?;
        for (i, (a, b)) in actual.iter().zip(&pred).enumerate() {
            sq[i % row] += (f64::from(a.to_f32()) - f64::from(*b)).powi(2);
        }
        n += f.len();
    }
    map.sigma = sq
        .iter()
        .map(|s| (s / n.max(1) as f64).sqrt() as f32)
        .collect();
    Ok(map)
}

#[derive(Default)]
struct Bits {
    values: usize,
    predicted: usize,
    fixed: usize,
    rel: (f64, f64),
}

/// Fits every layer's map on `cal` and codes `eval` with it and with the static model.
fn code_all(
    target: &Model,
    spec: &Model,
    cal: &[Pair],
    eval: &[Pair],
) -> anyhow::Result<[Bits; 2]> {
    let row = cal[0].target.row;
    let layers = cal[0].target.k.len();
    let mut out = [Bits::default(), Bits::default()];
    for l in 0..layers {
        for (kind, keys) in [(0, true), (1, false)] {
            let map = fit(target, spec, cal, l, keys)?;
            for p in eval {
                let f = features(spec, &p.spec, l, layers)?;
                let pred = predicted(target, &map, &f, row, keys)?;
                let actual = if keys { &p.target.k[l] } else { &p.target.v[l] };
                let bits: Vec<u16> = actual.iter().map(|v| v.to_bits()).collect();
                let coded = predictive::encode(&bits, |i| (pred[i], map.sigma[i % row]))?;
                let back =
                    predictive::decode(&coded, bits.len(), |i| (pred[i], map.sigma[i % row]))?;
                anyhow::ensure!(back == bits, "round trip");
                let stats = predictive::channel_stats(actual, row);
                let fixed = predictive::encode(&bits, |i| stats[i % row])?.len() + row * 8;
                let b = &mut out[kind];
                b.values += bits.len();
                b.predicted += coded.len();
                b.fixed += fixed;
                for (i, a) in actual.iter().enumerate() {
                    let a = f64::from(a.to_f32());
                    b.rel.0 += (a - f64::from(pred[i])).powi(2);
                    b.rel.1 += (a - f64::from(stats[i % row].0)).powi(2);
                }
            }
        }
        eprint!("\rlayer {l} fitted");
    }
    eprintln!();
    Ok(out)
}

/// A weight format by its GGUF name.
fn format(name: &str) -> anyhow::Result<GgmlDType> {
    Ok(match name {
        "Q8_0" => GgmlDType::Q8_0,
        "Q5_0" => GgmlDType::Q5_0,
        "Q4_0" => GgmlDType::Q4_0,
        "Q6_K" => GgmlDType::Q6K,
        "Q5_K" => GgmlDType::Q5K,
        "Q4_K" => GgmlDType::Q4K,
        "Q3_K" => GgmlDType::Q3K,
        "Q2_K" => GgmlDType::Q2K,
        _ => anyhow::bail!("--requantize: unknown format {name} (Q8_0, Q5_0, Q4_0, Q6_K .. Q2_K)"),
    })
}

/// Every chunk's KV under `m`, and the mean milliseconds one precompute took.
fn precompute_all(m: &Model, all: &[Vec<u32>]) -> anyhow::Result<(Vec<ChunkKv>, f64)> {
    let t = Instant::now();
    let kv = all
        .iter()
        .map(|ids| m.precompute(ids, None))
        .collect::<Result<Vec<_>, _>>()?;
    Ok((
        kv,
        t.elapsed().as_secs_f64() * 1e3 / all.len().max(1) as f64,
    ))
}

/// Bits of the held-out chunks (`target[half..]`) coded under `pred`'s KV as the prediction,
/// sigma each channel's residual over the calibration chunks (`target[..half]`): K then V.
fn code_requantized(target: &[ChunkKv], pred: &[ChunkKv]) -> anyhow::Result<[Bits; 2]> {
    let half = target.len() / 2;
    let row = target[0].row;
    let mut out = [Bits::default(), Bits::default()];
    for l in 0..target[0].k.len() {
        for (kind, pick) in [(0, true), (1, false)] {
            let layer = |c: &ChunkKv| if pick { c.k[l].clone() } else { c.v[l].clone() };
            let mut sq = vec![0f64; row];
            let mut n = 0usize;
            for (a, p) in target[..half].iter().zip(&pred[..half]) {
                for (i, (x, y)) in layer(a).iter().zip(&layer(p)).enumerate() {
                    sq[i % row] += (f64::from(x.to_f32()) - f64::from(y.to_f32())).powi(2);
                }
                n += a.len();
            }
            let sigma: Vec<f32> = sq
                .iter()
                .map(|s| (s / n.max(1) as f64).sqrt() as f32)
                .collect();
            for (a, p) in target[half..].iter().zip(&pred[half..]) {
                let (actual, guess) = (layer(a), layer(p));
                let mu: Vec<f32> = guess.iter().map(|v| v.to_f32()).collect();
                let bits: Vec<u16> = actual.iter().map(|v| v.to_bits()).collect();
                let at = |i: usize| (mu[i], sigma[i % row]);
                let coded = predictive::encode(&bits, at)?;
                anyhow::ensure!(
                    predictive::decode(&coded, bits.len(), at)? == bits,
                    "round trip"
                );
                let stats = predictive::channel_stats(&actual, row);
                let fixed = predictive::encode(&bits, |i| stats[i % row])?.len() + row * 8;
                let b = &mut out[kind];
                b.values += bits.len();
                b.predicted += coded.len();
                b.fixed += fixed;
                for (i, x) in actual.iter().enumerate() {
                    let x = f64::from(x.to_f32());
                    b.rel.0 += (x - f64::from(mu[i])).powi(2);
                    b.rel.1 += (x - f64::from(stats[i % row].0)).powi(2);
                }
            }
        }
    }
    Ok(out)
}

/// Predictor (a): one table row per requantized format.
fn requantize_main(formats: &str, tp: &str, n: usize) -> anyhow::Result<()> {
    let target = Model::load(&PathBuf::from(tp), &LoadOptions::default())?;
    let all = chunks(&target, n)?;
    let (kv, ms) = precompute_all(&target, &all)?;
    drop(target);
    println!(
        "{} calibration and {} held-out chunks of {CHUNK} tokens; the target precomputes one in {ms:.0} ms",
        all.len() / 2,
        all.len() - all.len() / 2
    );
    println!("| predictor | forward ms/chunk (x target) | K bits/value | V bits/value | both (ratio vs f16) | static per-channel | residual/static rms K, V |\n|---|---:|---:|---:|---:|---:|---:|");
    for name in formats.split(',') {
        let opts = LoadOptions {
            requantize: Some(format(name)?),
            ..LoadOptions::default()
        };
        let m = Model::load(&PathBuf::from(tp), &opts)?;
        let (pred, pms) = precompute_all(&m, &all)?;
        drop(m);
        let out = code_requantized(&kv, &pred)?;
        let values: usize = out.iter().map(|b| b.values).sum();
        let bits = |bytes: usize, v: usize| bytes as f64 * 8.0 / v as f64;
        let both = bits(out.iter().map(|b| b.predicted).sum(), values);
        println!(
            "| target at {name} | {pms:.0} ({:.2}x) | {:.2} | {:.2} | {both:.2} ({:.3}x) | {:.2} | {:.2}, {:.2} |",
            pms / ms,
            bits(out[0].predicted, out[0].values),
            bits(out[1].predicted, out[1].values),
            16.0 / both,
            bits(out.iter().map(|b| b.fixed).sum(), values),
            (out[0].rel.0 / out[0].rel.1).sqrt(),
            (out[1].rel.0 / out[1].rel.1).sqrt(),
        );
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    if std::env::args().nth(1).as_deref() == Some("--requantize") {
        let formats = args.nth(1).unwrap_or_default();
        let tp = args.next().unwrap_or_default();
        let n: usize = args.next().map_or(Ok(24), |s| s.parse())?;
        return requantize_main(&formats, &tp, n);
    }
    let (tp, sp) = (
        args.next().unwrap_or_default(),
        args.next().unwrap_or_default(),
    );
    let n: usize = args.next().map_or(Ok(24), |s| s.parse())?;
    let target = Model::load(&PathBuf::from(tp), &LoadOptions::default())?;
    let spec = Model::load(&PathBuf::from(sp), &LoadOptions::default())?;
    let all = chunks(&target, n)?;
    let (mut t_target, mut t_spec) = (0.0, 0.0);
    let mut pairs = Vec::new();
    for ids in &all {
        let t = Instant::now();
        let tk = target.precompute(ids, None)?;
        t_target += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let sk = spec.precompute(ids, None)?;
        t_spec += t.elapsed().as_secs_f64();
        pairs.push(Pair {
            target: tk,
            spec: sk,
        });
        eprint!("\r{} chunks computed", pairs.len());
    }
    eprintln!();
    let eval: Vec<Pair> = pairs.split_off(pairs.len() / 2);
    let cal = pairs;
    let out = code_all(&target, &spec, &cal, &eval)?;
    println!(
        "{} calibration and {} held-out chunks of {CHUNK} tokens; precompute: target {:.0} ms, speculator {:.0} ms per chunk",
        cal.len(),
        eval.len(),
        t_target * 1e3 / all.len() as f64,
        t_spec * 1e3 / all.len() as f64
    );
    println!("| | static per-channel bits/value | speculator map bits/value | residual/static rms |\n|---|---:|---:|---:|");
    for (name, b) in ["K", "V"].iter().zip(&out) {
        let per = |bytes: usize| bytes as f64 * 8.0 / b.values as f64;
        println!(
            "| {name} | {:.2} | {:.2} | {:.2} |",
            per(b.fixed),
            per(b.predicted),
            (b.rel.0 / b.rel.1).sqrt()
        );
    }
    let values: usize = out.iter().map(|b| b.values).sum();
    let fixed: usize = out.iter().map(|b| b.fixed).sum();
    let pred: usize = out.iter().map(|b| b.predicted).sum();
    println!(
        "| both | {:.2} ({:.3}x) | {:.2} ({:.3}x) | |",
        fixed as f64 * 8.0 / values as f64,
        values as f64 * 16.0 / (fixed as f64 * 8.0),
        pred as f64 * 8.0 / values as f64,
        values as f64 * 16.0 / (pred as f64 * 8.0)
    );
    Ok(())
}
