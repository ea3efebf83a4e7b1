//! The blob format: roundtrips, each decode error, seeded random invariants, and the speed of a
//! realistic chunk (printed, not asserted).

mod common;

use chunkstore::format::{DTYPE_F16, HEADER_LEN, MAGIC};
use chunkstore::{decode, encode, encode_with, Codec, FormatError, KvBlob, SpecScores};
use common::{blob, small, TestResult};
use half::f16;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Rewrites the checksum after a deliberate edit, so that decode reaches the later checks.
fn reseal(bytes: &mut [u8]) {
    let crc = crc32fast::hash(&bytes[10..]);
    bytes[6..10].copy_from_slice(&crc.to_le_bytes());
}

/// Equality that also holds for NaN payloads.
fn same_bits(a: &KvBlob, b: &KvBlob) -> bool {
    let bits = |layers: &[Vec<f16>]| -> Vec<Vec<u16>> {
        layers
            .iter()
            .map(|l| l.iter().map(|x| x.to_bits()).collect())
            .collect()
    };
    let scores_same = match (&a.scores, &b.scores) {
        (None, None) => true,
        (Some(x), Some(y)) => {
            x.fingerprint == y.fingerprint
                && x.layers == y.layers
                && x.offsets == y.offsets
                && x.values
                    .iter()
                    .map(|v| v.to_bits())
                    .eq(y.values.iter().map(|v| v.to_bits()))
        }
        _ => false,
    };
    a.fingerprint == b.fingerprint
        && a.ids == b.ids
        && a.base_pos == b.base_pos
        && a.mode == b.mode
        && a.row == b.row
        && bits(&a.k) == bits(&b.k)
        && bits(&a.v) == bits(&b.v)
        && scores_same
}

#[test]
fn roundtrip_keeps_every_field() -> TestResult {
    let mut b = small(3);
    b.mode = "after_prefix:0123abcd".into();
    b.fingerprint = "unicode ✓ \"quoted\"".into();
    assert_eq!(decode(&encode(&b))?, b);
    b.scores = None;
    assert_eq!(decode(&encode(&b))?, b);
    Ok(())
}

#[test]
fn empty_shapes_roundtrip() -> TestResult {
    for b in [blob(0, 4, 3, 1), blob(2, 4, 0, 1), blob(2, 0, 3, 1)] {
        assert_eq!(decode(&encode(&b))?, b);
    }
    Ok(())
}

#[test]
fn encoded_size_is_header_plus_sections() {
    let b = small(1);
    let bytes = encode(&b);
    assert_eq!(&bytes[..4], &MAGIC);
    assert!(bytes.len() > HEADER_LEN + b.payload_bytes() + b.len() * 4 + 3 * 12);
    let meta_len = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]) as usize;
    assert_eq!(
        bytes.len(),
        HEADER_LEN + meta_len + b.len() * 4 + b.len() * 12 + b.payload_bytes()
    );
}

#[test]
fn foreign_magic() {
    let mut bytes = encode(&small(1));
    bytes[..4].copy_from_slice(b"\x89PNG");
    let err = decode(&bytes).err();
    assert!(
        matches!(err, Some(FormatError::ForeignMagic { found, .. }) if &found == b"\x89PNG"),
        "{err:?}"
    );
    assert!(decode(b"{\"json\": true}").is_err());
}

#[test]
fn future_version() {
    let mut bytes = encode(&small(1));
    bytes[4..6].copy_from_slice(&2u16.to_le_bytes());
    let err = decode(&bytes).err();
    assert!(
        matches!(
            err,
            Some(FormatError::UnsupportedVersion {
                found: 2,
                supported: 1
            })
        ),
        "{err:?}"
    );
    // Reported as a version problem even when the rest would not parse either.
    assert!(matches!(
        decode(&bytes[..6]),
        Err(FormatError::UnsupportedVersion { .. })
    ));
}

#[test]
fn unsupported_dtype() {
    let mut bytes = encode(&small(1));
    bytes[10..12].copy_from_slice(&7u16.to_le_bytes());
    reseal(&mut bytes);
    let err = decode(&bytes).err();
    assert!(
        matches!(
            err,
            Some(FormatError::UnsupportedDtype {
                found: 7,
                expected: DTYPE_F16
            })
        ),
        "{err:?}"
    );
}

#[test]
fn truncated_anywhere() {
    let bytes = encode(&small(1));
    for len in [
        0,
        3,
        5,
        9,
        HEADER_LEN - 1,
        HEADER_LEN,
        HEADER_LEN + 5,
        bytes.len() - 1,
    ] {
        let err = decode(&bytes[..len]).err();
        assert!(
            matches!(err, Some(FormatError::Truncated { .. })),
            "len {len}: {err:?}"
        );
    }
}

#[test]
fn trailing_bytes() {
    let mut bytes = encode(&small(1));
    bytes.push(0);
    let err = decode(&bytes).err();
    assert!(
        matches!(err, Some(FormatError::TrailingBytes { .. })),
        "{err:?}"
    );
}

#[test]
fn checksum_mismatch_in_payload_metadata_and_header() {
    let bytes = encode(&small(1));
    for at in [bytes.len() - 1, HEADER_LEN + 2, 24, 7] {
        let mut damaged = bytes.clone();
        damaged[at] ^= 0x10;
        let err = decode(&damaged).err();
        assert!(
            matches!(err, Some(FormatError::ChecksumMismatch { .. })),
            "byte {at}: {err:?}"
        );
    }
}

#[test]
fn inconsistent_payload_is_a_shape_error() {
    let mut b = small(1);
    b.k[1].push(f16::ONE);
    let err = decode(&encode(&b)).err();
    assert!(matches!(err, Some(FormatError::Shape(_))), "{err:?}");
}

#[test]
fn inconsistent_scores_are_a_shape_error() {
    let mut b = small(1);
    if let Some(s) = &mut b.scores {
        s.values.pop();
    }
    let err = decode(&encode(&b)).err();
    assert!(matches!(err, Some(FormatError::Shape(_))), "{err:?}");
}

#[test]
fn score_arrays_without_scores_metadata_are_a_shape_error() -> TestResult {
    let mut bytes = encode(&small(1));
    let meta_len = u32::from_le_bytes([bytes[28], bytes[29], bytes[30], bytes[31]]) as usize;
    let meta = std::str::from_utf8(&bytes[HEADER_LEN..HEADER_LEN + meta_len])?.to_string();
    let start = meta.find("\"scores\":").ok_or("no scores field")?;
    let replacement = format!("\"scores\":null{}", " ".repeat(meta.len() - start - 14));
    let edited = format!("{}{}}}", &meta[..start], replacement);
    assert_eq!(edited.len(), meta.len());
    bytes[HEADER_LEN..HEADER_LEN + meta_len].copy_from_slice(edited.as_bytes());
    reseal(&mut bytes);
    let err = decode(&bytes).err();
    assert!(matches!(err, Some(FormatError::Shape(_))), "{err:?}");
    Ok(())
}

#[test]
fn absurd_layer_count_is_refused_before_allocating() {
    let mut b = small(1);
    b.row = 0;
    b.k.clear();
    b.v.clear();
    let mut bytes = encode(&b);
    bytes[12..16].copy_from_slice(&u32::MAX.to_le_bytes());
    reseal(&mut bytes);
    let err = decode(&bytes).err();
    assert!(matches!(err, Some(FormatError::Shape(_))), "{err:?}");
}

#[test]
fn malformed_metadata() {
    let mut bytes = encode(&small(1));
    bytes[HEADER_LEN] = b'[';
    reseal(&mut bytes);
    let err = decode(&bytes).err();
    assert!(matches!(err, Some(FormatError::Metadata(_))), "{err:?}");
}

#[test]
fn error_messages_say_what_was_expected() {
    let mut bytes = encode(&small(1));
    bytes[4..6].copy_from_slice(&9u16.to_le_bytes());
    let msg = decode(&bytes)
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains('9') && msg.contains("version 1"), "{msg}");
    let msg = decode(b"GGUF....")
        .err()
        .map(|e| e.to_string())
        .unwrap_or_default();
    assert!(msg.contains("SRKV"), "{msg}");
}

fn random_blob(rng: &mut StdRng) -> KvBlob {
    let n_layer = rng.gen_range(0..6);
    let row = rng.gen_range(0..40);
    let n_tokens = rng.gen_range(0..30);
    let n = (row * n_tokens) as usize;
    // Raw bit patterns: NaNs, infinities and subnormals must survive too.
    let mut layers = |_| -> Vec<Vec<f16>> {
        (0..n_layer)
            .map(|_| (0..n).map(|_| f16::from_bits(rng.gen())).collect())
            .collect()
    };
    let k = layers(0);
    let v = layers(1);
    let scores = rng.gen_bool(0.5).then(|| {
        let m = rng.gen_range(0..20);
        SpecScores {
            fingerprint: format!("spec-{}", rng.gen::<u16>()),
            layers: "last_two_thirds".into(),
            offsets: (0..m)
                .map(|_| {
                    let s = rng.gen_range(0..1000);
                    (s, s + rng.gen_range(0..10))
                })
                .collect(),
            values: (0..m).map(|_| f32::from_bits(rng.gen())).collect(),
        }
    });
    KvBlob {
        fingerprint: format!("model-{}", rng.gen::<u64>()),
        ids: (0..n_tokens).map(|_| rng.gen()).collect(),
        base_pos: rng.gen(),
        mode: if rng.gen_bool(0.5) {
            "standalone".into()
        } else {
            format!("after_prefix:{:x}", rng.gen::<u64>())
        },
        row,
        k,
        v,
        scores,
    }
}

#[test]
fn random_blobs_roundtrip_bit_exactly_with_every_codec() -> TestResult {
    for codec in Codec::ALL.into_iter().filter(|c| !c.is_lossy()) {
        let mut rng = StdRng::seed_from_u64(0x5eed);
        for case in 0..300 {
            let b = random_blob(&mut rng);
            let bytes = encode_with(&b, codec);
            let back = decode(&bytes)?;
            assert!(same_bits(&b, &back), "{codec} case {case}");
            assert_eq!(
                encode_with(&back, codec),
                bytes,
                "{codec} case {case}: re-encoding changed the bytes"
            );
        }
    }
    Ok(())
}

#[test]
fn int8_predictive_blobs_decode_to_exactly_int8s_values() -> TestResult {
    let mut rng = StdRng::seed_from_u64(0x1b18);
    for case in 0..200 {
        let b = random_blob(&mut rng);
        let int8 = decode(&encode_with(&b, Codec::Int8))?;
        let coded = decode(&encode_with(&b, Codec::Int8Predictive))?;
        assert!(same_bits(&int8, &coded), "case {case}");
    }
    Ok(())
}

#[test]
fn low_bit_blobs_keep_everything_but_the_values_exact_and_stay_within_a_step() -> TestResult {
    let mut rng = StdRng::seed_from_u64(0x1b17);
    for codec in [Codec::Int8, Codec::Int4, Codec::Int8Predictive] {
        for case in 0..100 {
            let b = random_blob(&mut rng);
            let back = decode(&encode_with(&b, codec))?;
            let score_bits = |x: &chunkstore::KvBlob| {
                x.scores.as_ref().map(|s| {
                    let bits: Vec<u32> = s.values.iter().map(|v| v.to_bits()).collect();
                    (s.fingerprint.clone(), s.offsets.clone(), bits)
                })
            };
            assert_eq!(
                (
                    &back.fingerprint,
                    &back.ids,
                    back.base_pos,
                    &back.mode,
                    back.row
                ),
                (&b.fingerprint, &b.ids, b.base_pos, &b.mode, b.row),
                "{codec} case {case}"
            );
            assert_eq!(score_bits(&back), score_bits(&b), "{codec} case {case}");
            let levels = if codec == Codec::Int8 { 255.0 } else { 15.0 };
            for (x, y) in b.k.iter().chain(&b.v).zip(back.k.iter().chain(&back.v)) {
                let finite: Vec<f32> = x
                    .iter()
                    .map(|v| v.to_f32())
                    .filter(|v| v.is_finite())
                    .collect();
                if finite.len() != x.len() {
                    continue; // NaN/inf inputs: only the shape is promised
                }
                let span = finite.iter().cloned().fold(f32::MIN, f32::max)
                    - finite.iter().cloned().fold(f32::MAX, f32::min);
                for (a, c) in x.iter().zip(y) {
                    // Within a group's step; a layer's span bounds every group's.
                    let err = (a.to_f32() - c.to_f32()).abs();
                    assert!(
                        err <= span / levels + 1e-2 * span.max(1.0),
                        "{codec} case {case}: {err} (span {span})"
                    );
                }
            }
        }
    }
    Ok(())
}

#[test]
fn a_lossless_payload_that_does_not_decode_is_an_error_not_a_blob() {
    let mut bytes = encode_with(&small(1), Codec::Lossless);
    assert_eq!(u16::from_le_bytes([bytes[10], bytes[11]]), 2);
    // Damage past the checksum's reach: a resealed payload of the right length.
    let n = bytes.len();
    for b in &mut bytes[n - 16..] {
        *b = 0xAB;
    }
    reseal(&mut bytes);
    assert!(matches!(decode(&bytes), Err(FormatError::Codec(_))));
    // A raw blob relabelled lossless does not pass either.
    let mut raw = encode(&small(1));
    raw[10..12].copy_from_slice(&2u16.to_le_bytes());
    reseal(&mut raw);
    assert!(decode(&raw).is_err());
}

#[test]
fn random_damage_is_always_detected() {
    let mut rng = StdRng::seed_from_u64(42);
    for case in 0..300 {
        let codec = Codec::ALL[case % Codec::ALL.len()];
        let bytes = encode_with(&random_blob(&mut rng), codec);
        let mut damaged = bytes.clone();
        let at = rng.gen_range(0..bytes.len());
        damaged[at] ^= rng.gen_range(1..=255u8);
        assert!(
            decode(&damaged).is_err(),
            "case {case}: byte {at} changed unnoticed"
        );
        let cut = rng.gen_range(0..bytes.len());
        assert!(
            decode(&bytes[..cut]).is_err(),
            "case {case}: cut at {cut} unnoticed"
        );
    }
}

/// A chunk of 512 tokens of a 24-layer model with 2 KV heads of 64 dims (Qwen2-0.5B): 6 MiB of
/// payload. Best of a few runs, so that first-touch page faults do not dominate. Synthetic
/// values: the lossless ratio on real KV comes from `specrag-bench codec`.
#[test]
fn six_megabyte_chunk_roundtrip_speed() -> TestResult {
    for codec in Codec::ALL {
        chunk_speed(codec)?;
    }
    Ok(())
}

fn chunk_speed(codec: Codec) -> TestResult {
    let b = blob(24, 128, 512, 9);
    let mb = b.payload_bytes() as f64 / (1 << 20) as f64;
    let (mut encode_s, mut decode_s, mut crc_s) = (f64::MAX, f64::MAX, f64::MAX);
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let bytes = encode_with(&b, codec);
        encode_s = encode_s.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        let back = decode(&bytes)?;
        decode_s = decode_s.min(t.elapsed().as_secs_f64());
        let t = std::time::Instant::now();
        std::hint::black_box(crc32fast::hash(&bytes));
        crc_s = crc_s.min(t.elapsed().as_secs_f64());
        if codec.is_lossy() {
            assert_eq!(
                (back.ids.len(), back.k.len(), back.row),
                (b.ids.len(), b.k.len(), b.row)
            );
        } else {
            assert_eq!(back, b);
        }
    }
    eprintln!(
        "{codec}: {mb:.1} MiB payload: encode {:.2} ms ({:.0} MiB/s), decode {:.2} ms ({:.0} MiB/s), \
         of which crc32 {:.2} ms",
        encode_s * 1e3,
        mb / encode_s,
        decode_s * 1e3,
        mb / decode_s,
        crc_s * 1e3,
    );
    Ok(())
}
