//! The committed blob `fixtures/kv_v1.bin` pins format version 1: it must decode to the blob
//! below, and encoding that blob must reproduce it byte for byte. If this fails after a format
//! change, bump `FORMAT_VERSION` and add a new fixture rather than editing this one.

use std::path::PathBuf;

use chunkstore::{decode, encode, KvBlob, SpecScores, FORMAT_VERSION};
use half::f16;

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/kv_v1.bin")
}

/// 2 layers, row 4, 3 tokens, values k = l + t/4 + c/16 and v = -k, with scores.
fn fixture_blob() -> KvBlob {
    let layer = |l: usize, sign: f32| -> Vec<f16> {
        (0..12)
            .map(|i| {
                f16::from_f32(sign * (l as f32 + (i / 4) as f32 / 4.0 + (i % 4) as f32 / 16.0))
            })
            .collect()
    };
    KvBlob {
        fingerprint: "fixture-model-0001".into(),
        ids: vec![151_644, 872, 13],
        base_pos: 21,
        mode: "after_prefix:4f2a".into(),
        row: 4,
        k: vec![layer(0, 1.0), layer(1, 1.0)],
        v: vec![layer(0, -1.0), layer(1, -1.0)],
        scores: Some(SpecScores {
            fingerprint: "fixture-speculator".into(),
            layers: "last_third".into(),
            offsets: vec![(0, 5), (5, 9)],
            values: vec![1.5, -0.25],
        }),
    }
}

#[test]
fn committed_fixture_decodes_to_every_field() -> TestResult {
    let bytes = std::fs::read(fixture_path())?;
    assert_eq!(FORMAT_VERSION, 1);
    let blob = decode(&bytes)?;
    assert_eq!(blob.fingerprint, "fixture-model-0001");
    assert_eq!(blob.ids, [151_644, 872, 13]);
    assert_eq!(blob.base_pos, 21);
    assert_eq!(blob.mode, "after_prefix:4f2a");
    assert_eq!(blob.row, 4);
    assert_eq!((blob.k.len(), blob.v.len()), (2, 2));
    assert_eq!(blob.k[1][5].to_f32(), 1.0 + 0.25 + 1.0 / 16.0);
    assert_eq!(blob.v[0][11].to_f32(), -(0.5 + 3.0 / 16.0));
    let scores = blob.scores.as_ref().ok_or("fixture has scores")?;
    assert_eq!(scores.fingerprint, "fixture-speculator");
    assert_eq!(scores.layers, "last_third");
    assert_eq!(scores.offsets, [(0, 5), (5, 9)]);
    assert_eq!(scores.values, [1.5, -0.25]);
    assert_eq!(blob, fixture_blob());
    Ok(())
}

#[test]
fn encoding_reproduces_the_committed_fixture() -> TestResult {
    let bytes = std::fs::read(fixture_path())?;
    assert!(
        encode(&fixture_blob()) == bytes,
        "the encoding of format version 1 changed"
    );
    Ok(())
}

/// Writes the fixture. Run once with `--ignored`; never to make the tests above pass.
#[test]
#[ignore]
fn write_fixture() -> TestResult {
    std::fs::create_dir_all(fixture_path().parent().ok_or("no parent")?)?;
    std::fs::write(fixture_path(), encode(&fixture_blob()))?;
    Ok(())
}
