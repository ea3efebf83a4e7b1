//! Bits per stored value of chunk KV under each lossless option, on the blobs of a store:
//! raw f16, `lossless` (byte planes through zstd), int8 (lossy, for scale) and predictive
//! coding with the per-channel static model (each layer's channel mean and spread over the
//! chunk's tokens, kept beside the payload and counted: the store's `predictive` codec), and
//! `int8-predictive` (int8's codes coded the same way). Every predictive blob is decoded and
//! compared bit for bit (int8-predictive against int8's values).
//!
//! `cargo run --release -p chunkstore --example kv_bits -- DATA/kv [MAX_CHUNKS]`

use chunkstore::{predictive, Codec, KvBlob};
use half::f16;
use std::path::{Path, PathBuf};
use std::time::Instant;

fn blobs(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for e in std::fs::read_dir(dir)? {
        let p = e?.path();
        if p.is_dir() {
            blobs(&p, out)?;
        } else {
            out.push(p);
        }
    }
    Ok(())
}

#[derive(Default)]
struct Totals {
    values: usize,
    raw: usize,
    lossless: usize,
    int8: usize,
    int8_predictive: usize,
    predictive: usize,
    encode_s: f64,
    decode_s: f64,
    raw_decode_s: f64,
    int8_decode_s: f64,
    i8p_encode_s: f64,
    i8p_decode_s: f64,
    lossless_decode_s: f64,
    k_pred: usize,
    k_values: usize,
}

fn payload(blob: &KvBlob, codec: Codec, raw_total: usize, raw_payload: usize) -> usize {
    chunkstore::encode_with(blob, codec).len() - (raw_total - raw_payload)
}

/// The `int8-predictive` payload's bytes (int8 with its codes entropy-coded, the source note's
/// "on top of FP8"), after checking that it decodes to exactly int8's values.
fn int8_predictive(
    blob: &KvBlob,
    (raw_total, raw_payload): (usize, usize),
    t: &mut Totals,
) -> Result<usize, Box<dyn std::error::Error>> {
    let start = Instant::now();
    let coded = chunkstore::encode_with(blob, Codec::Int8Predictive);
    t.i8p_encode_s += start.elapsed().as_secs_f64();
    let int8_bytes = chunkstore::encode_with(blob, Codec::Int8);
    let start = Instant::now();
    let int8 = chunkstore::decode(&int8_bytes)?;
    t.int8_decode_s += start.elapsed().as_secs_f64();
    let start = Instant::now();
    let back = chunkstore::decode(&coded)?;
    t.i8p_decode_s += start.elapsed().as_secs_f64();
    let bits = |b: &KvBlob| -> Vec<u16> {
        b.k.iter()
            .chain(&b.v)
            .flatten()
            .map(|x| x.to_bits())
            .collect()
    };
    if bits(&back) != bits(&int8) {
        return Err("int8-predictive decodes to other values than int8".into());
    }
    Ok(coded.len() - (raw_total - raw_payload))
}

fn measure(blob: &KvBlob, t: &mut Totals) -> Result<(), Box<dyn std::error::Error>> {
    let row = blob.row as usize;
    let values: usize = blob.k.iter().chain(&blob.v).map(Vec::len).sum();
    let raw_total = chunkstore::encode(blob).len();
    t.values += values;
    t.raw += values * 2;
    t.lossless += payload(blob, Codec::Lossless, raw_total, values * 2);
    // Decoding raw and lossless blobs, the times predictive decoding compares with.
    for (codec, time) in [
        (Codec::Raw, &mut t.raw_decode_s),
        (Codec::Lossless, &mut t.lossless_decode_s),
    ] {
        let bytes = chunkstore::encode_with(blob, codec);
        let start = Instant::now();
        chunkstore::decode(&bytes)?;
        *time += start.elapsed().as_secs_f64();
    }
    t.int8 += payload(blob, Codec::Int8, raw_total, values * 2);
    t.int8_predictive += int8_predictive(blob, (raw_total, values * 2), t)?;
    let start = Instant::now();
    let coded = chunkstore::encode_with(blob, Codec::Predictive);
    t.encode_s += start.elapsed().as_secs_f64();
    t.predictive += coded.len() - (raw_total - values * 2);
    let start = Instant::now();
    let back = chunkstore::decode(&coded)?;
    t.decode_s += start.elapsed().as_secs_f64();
    let same = |a: &[Vec<f16>], b: &[Vec<f16>]| {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits())
            })
    };
    if !same(&back.k, &blob.k) || !same(&back.v, &blob.v) {
        return Err("predictive round trip differs".into());
    }
    // K alone, to see which side compresses.
    for layer in &blob.k {
        let stats = predictive::channel_stats(layer, row);
        let bits: Vec<u16> = layer.iter().map(|v| v.to_bits()).collect();
        t.k_pred += predictive::encode(&bits, |j| stats[j % row])?.len() + row * 8;
        t.k_values += bits.len();
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = PathBuf::from(args.next().ok_or("usage: kv_bits DATA/kv [MAX_CHUNKS]")?);
    let max: usize = args.next().map_or(Ok(usize::MAX), |s| s.parse())?;
    let mut files = Vec::new();
    blobs(&dir, &mut files)?;
    files.sort();
    let mut t = Totals::default();
    let mut chunks = 0;
    for f in files.iter().take(max) {
        let Ok(blob) = chunkstore::decode(&std::fs::read(f)?) else {
            continue;
        };
        measure(&blob, &mut t)?;
        chunks += 1;
        eprint!("\r{chunks} chunks");
    }
    eprintln!();
    let bits = |bytes: usize| bytes as f64 * 8.0 / t.values as f64;
    let mb = t.raw as f64 / 1e6;
    println!(
        "{chunks} chunks, {} values ({:.1} MB raw f16), every predictive payload decoded bit-exact\n",
        t.values, mb
    );
    println!("| codec | bits/value | ratio vs raw f16 |\n|---|---:|---:|");
    for (name, bytes) in [
        ("raw f16", t.raw),
        ("lossless (zstd byte planes)", t.lossless),
        ("predictive, static per-channel", t.predictive),
        ("int8 (lossy)", t.int8),
        (
            "int8, codes coded predictively (lossy as int8)",
            t.int8_predictive,
        ),
    ] {
        println!(
            "| {name} | {:.2} | {:.3} |",
            bits(bytes),
            t.raw as f64 / bytes as f64
        );
    }
    println!(
        "\nstatic per-channel on K alone: {:.2} bits/value, on V alone: {:.2}",
        t.k_pred as f64 * 8.0 / t.k_values as f64,
        (t.predictive - t.k_pred) as f64 * 8.0 / (t.values - t.k_values) as f64
    );
    let per = |s: f64| s * 1e3 / chunks as f64;
    println!(
        "predictive encode {:.1} MB/s, decode {:.1} MB/s ({:.0} ms / {:.0} ms per chunk); \
         decoding a blob from memory: raw {:.1} ms, lossless {:.1} ms per chunk",
        mb / t.encode_s,
        mb / t.decode_s,
        per(t.encode_s),
        per(t.decode_s),
        per(t.raw_decode_s),
        per(t.lossless_decode_s)
    );
    println!(
        "int8-predictive encode {:.0} ms, decode {:.0} ms per chunk (int8 decode {:.1} ms)",
        per(t.i8p_encode_s),
        per(t.i8p_decode_s),
        per(t.int8_decode_s)
    );
    Ok(())
}
