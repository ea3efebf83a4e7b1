//! The disk budget's eviction policies on a skewed query stream: `queries` queries, each
//! reading `top_k` chunks drawn from a Zipf distribution over `chunks` chunks of equal size,
//! with a budget of a quarter of the corpus (the corpus's KV exceeds it 4x). Prints the hit
//! rate of each policy over the same stream. Only the policy runs here (the budget ledger in a
//! temporary directory, no KV): what a hit saves is a chunk's prefill.
//!
//! `cargo run --release -p chunkstore --example budget_zipf [chunks] [queries] [zipf_s] [seed]`

use chunkstore::{ChunkKey, DiskBudget, Eviction};
use rand::{Rng, SeedableRng};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |i: usize, d: f64| args.get(i).and_then(|a| a.parse().ok()).unwrap_or(d);
    let (chunks, queries, s, seed) = (
        arg(1, 2000.0) as usize,
        arg(2, 500.0) as usize,
        arg(3, 1.0),
        arg(4, 1.0) as u64,
    );
    let top_k = 4;
    // Zipf over chunk ranks: P(rank r) proportional to 1 / r^s; a fixed random rank->chunk map.
    let weights: Vec<f64> = (1..=chunks).map(|r| 1.0 / (r as f64).powf(s)).collect();
    let total: f64 = weights.iter().sum();
    let cdf: Vec<f64> = weights
        .iter()
        .scan(0.0, |acc, w| {
            *acc += w / total;
            Some(*acc)
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut stream = Vec::with_capacity(queries * top_k);
    for _ in 0..queries * top_k {
        let u: f64 = rng.gen();
        stream.push(cdf.partition_point(|&c| c < u).min(chunks - 1));
    }
    let key = |i: usize| ChunkKey::new("zipf", "c", "m", &[i as u32]);
    let index: std::collections::HashMap<ChunkKey, usize> =
        (0..chunks).map(|i| (key(i), i)).collect();
    let size = 1 << 20;
    let budget = (chunks as u64 * size) / 4;
    println!(
        "{chunks} chunks, {queries} queries x {top_k} chunks, zipf s = {s}, budget = corpus / 4"
    );
    for policy in [Eviction::Lru, Eviction::TinyLfu] {
        let dir = tempfile::tempdir()?;
        let (b, _) = DiskBudget::open(dir.path(), budget, policy)?;
        let mut hits = 0usize;
        let mut stored = std::collections::HashSet::new();
        for &c in &stream {
            if stored.contains(&c) {
                hits += 1;
                b.touch(&key(c));
            } else {
                stored.insert(c);
                let gone = b.admit("docs", &key(c), size);
                for k in &gone {
                    if let Some(g) = index.get(k) {
                        stored.remove(g);
                    }
                }
                b.dropped(&gone);
            }
        }
        println!(
            "{policy}: hit rate {:.1}% ({hits} of {} chunk reads), {} entries kept",
            100.0 * hits as f64 / stream.len() as f64,
            stream.len(),
            b.keys().len()
        );
    }
    Ok(())
}
