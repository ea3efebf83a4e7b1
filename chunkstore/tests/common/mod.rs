//! Blobs and keys shared by the integration tests.
#![allow(dead_code)] // each test file uses a different subset

use chunkstore::{ChunkKey, KvBlob, SpecScores};
use half::f16;

/// Result of a test body.
pub type TestResult = Result<(), Box<dyn std::error::Error>>;

/// A consistent blob whose values depend on every index and on `seed`.
pub fn blob(n_layer: usize, row: u32, n_tokens: usize, seed: u32) -> KvBlob {
    let n = n_tokens * row as usize;
    let values = |layer: usize, which: u32| -> Vec<f16> {
        (0..n)
            .map(|i| {
                let x = (seed as usize * 7919 + layer * 131 + which as usize * 17 + i) % 251;
                f16::from_f32(x as f32 / 64.0 - 2.0)
            })
            .collect()
    };
    KvBlob {
        fingerprint: format!("target-model-{seed}"),
        ids: (0..n_tokens as u32).map(|i| i * 3 + seed).collect(),
        base_pos: 7,
        mode: "standalone".into(),
        row,
        k: (0..n_layer).map(|l| values(l, 0)).collect(),
        v: (0..n_layer).map(|l| values(l, 1)).collect(),
        scores: Some(SpecScores {
            fingerprint: "speculator".into(),
            layers: "last_third".into(),
            offsets: (0..n_tokens as u32).map(|i| (i * 4, i * 4 + 3)).collect(),
            values: (0..n_tokens)
                .map(|i| i as f32 * 0.25 + seed as f32)
                .collect(),
        }),
    }
}

/// A small blob.
pub fn small(seed: u32) -> KvBlob {
    blob(2, 4, 3, seed)
}

/// A distinct key per `i`.
pub fn key(i: u32) -> ChunkKey {
    ChunkKey::new("target-model", "docs", "standalone", &[i, i + 1])
}
