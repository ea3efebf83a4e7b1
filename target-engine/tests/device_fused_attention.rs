//! The device engine attending through the fused op (`DeviceAttention::Fused`) against candle
//! ops (`Ops`), on candle's CPU device, where the op runs its f32 reference: the layouts,
//! positions, grouped heads and the switch around the kernel are what a GPU runs. The kernel
//! itself is held to f64 attention in `kernels/tests/flash_attention_emulated.rs`.

use target_engine::device::{DeviceAttention, DeviceModel};
use target_engine::testing::{family_specs, write_tiny_gguf};
use target_engine::{argmax, Architecture, Engine};

/// Both attend in f32 on the CPU, summing in another order.
const CLOSE: f32 = 1e-3;

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}

fn ids(n: usize, seed: u32, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed * 97) >> 7) % (vocab as u32 - 8))
        .collect()
}

/// Each family the device runs, loaded twice from one file: attending with candle ops and
/// with the fused op.
fn pairs() -> Vec<(String, tempfile::TempDir, DeviceModel, DeviceModel)> {
    family_specs()
        .into_iter()
        .filter(|(_, s)| {
            matches!(
                s.arch,
                Architecture::Qwen2 | Architecture::Llama | Architecture::Qwen3
            ) && !s.sentencepiece
        })
        .map(|(name, spec)| {
            let dir = tempfile::tempdir().expect("tempdir");
            let path = dir.path().join("tiny.gguf");
            write_tiny_gguf(&path, &spec).expect("write");
            let cpu = candle_core::Device::Cpu;
            let ops = DeviceModel::load(&path, &cpu).expect("load");
            let mut fused = DeviceModel::load(&path, &cpu).expect("load");
            assert_eq!(ops.attention(), DeviceAttention::Ops, "the CPU default");
            fused
                .set_attention(DeviceAttention::Fused)
                .expect("fused on the CPU");
            (name.to_string(), dir, ops, fused)
        })
        .collect()
}

#[test]
fn fused_attention_answers_as_candle_ops_on_every_family() {
    for (name, _dir, ops, fused) in pairs() {
        let vocab = ops.tokenizer().vocab_size();
        let prompt = ids(45, 3, vocab);
        let (mut a, la) = ops.prefill(&prompt, 64).expect("prefill");
        let (mut b, lb) = fused.prefill(&prompt, 64).expect("prefill");
        let d = max_diff(&la, &lb);
        assert!(d < CLOSE, "{name}: first-token logits differ by {d}");
        // Rows at scattered positions in any order (a blend's recomputed rows and its
        // question), each reading only its own prefix of the cache.
        let positions = [30usize, 5, 44, 17, 50, 51];
        let rows = ids(positions.len(), 4, vocab);
        let ha = ops.forward(&rows, &positions, &mut a).expect("forward");
        let hb = fused.forward(&rows, &positions, &mut b).expect("forward");
        let (ra, rb) = (
            ops.logits(&ha).expect("logits"),
            fused.logits(&hb).expect("logits"),
        );
        for (i, (x, y)) in ra.iter().zip(&rb).enumerate() {
            let d = max_diff(x, y);
            assert!(
                d < CLOSE,
                "{name}: row {i} at {} differs by {d}",
                positions[i]
            );
        }
        // The probe: its probed layers attend with candle ops, the ones below with the op.
        let question = ids(4, 5, vocab);
        let qpos: Vec<usize> = (52..56).collect();
        let ma = ops.probe(&question, &qpos, &mut a, 1..2).expect("probe");
        let mb = fused.probe(&question, &qpos, &mut b, 1..2).expect("probe");
        let d = max_diff(&ma, &mb);
        assert!(d < CLOSE, "{name}: probe mass differs by {d}");
        // Greedy decoding, one row a step.
        let (mut a, la) = ops.prefill(&prompt, 64).expect("prefill");
        let (mut b, lb) = fused.prefill(&prompt, 64).expect("prefill");
        let ga = ops.greedy(&mut a, prompt.len(), &la, 8).expect("greedy");
        let gb = fused.greedy(&mut b, prompt.len(), &lb, 8).expect("greedy");
        assert_eq!(ga, gb, "{name}: greedy");
        assert_eq!(argmax(&la), argmax(&lb), "{name}");
    }
}

#[test]
fn fused_decode_rows_of_several_requests_get_their_tokens_alone() {
    for (name, _dir, ops, fused) in pairs() {
        let vocab = ops.tokenizer().vocab_size();
        let prompts: Vec<Vec<u32>> = (0..3)
            .map(|i| ids(18 + 9 * i, 20 + i as u32, vocab))
            .collect();
        let n = 6;
        let (mut caches, mut firsts, mut lens, mut alone) = (vec![], vec![], vec![], vec![]);
        for p in &prompts {
            let (mut cache, logits) = ops.prefill(p, p.len() + n).expect("prefill");
            alone.push(ops.greedy(&mut cache, p.len(), &logits, n).expect("greedy"));
            let (cache, logits) = fused.prefill(p, p.len() + n).expect("prefill");
            caches.push(cache);
            firsts.push(logits);
            lens.push(p.len());
        }
        let together = fused
            .greedy_batch(&mut caches, &lens, &firsts, n)
            .expect("batch");
        assert_eq!(together, alone, "{name}");
    }
}

/// KV computed with one attention is not the other's: chunk KV keyed by the fingerprint never
/// mixes them.
#[test]
fn the_fingerprint_names_the_attention() {
    for (name, _dir, ops, fused) in pairs() {
        assert_ne!(
            Engine::fingerprint(&ops),
            Engine::fingerprint(&fused),
            "{name}"
        );
    }
    let err = DeviceAttention::parse("flash")
        .expect_err("unknown")
        .to_string();
    assert!(err.contains("ops") && err.contains("fused"), "{err}");
    assert_eq!(
        DeviceAttention::parse(" fused ").ok(),
        Some(DeviceAttention::Fused)
    );
}
