//! The device engine's run-time kernels (`src/cuda/`: fused attention and the batched decode
//! step), this very source, compiled as C++ for the CPU under `tests/cuda_emu/emu.h` (threads for CUDA
//! threads, the documented register layouts of `mma.sync` and the warp shuffle) and compared
//! with attention computed in f64 on random data: tiles of rows cut short, positions in any
//! order, grouped query heads, head sizes 64 and 128, many key tiles, decode rows. Cache rows
//! past the last position read are NaN, so a kernel that reads them fails here.
//!
//! Needs a C++20 compiler as `c++` (GCC 12 or newer; `scripts/setup-tests.sh` installs it).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// f16 inputs with f32 accumulation: the error against f64 stays near f16's rounding (a few
/// 1e-4 on outputs of magnitude 1); a wrong mask, rescale or fragment layout gives 0.1 or more.
const TOLERANCE: f64 = 5e-3;

fn driver() -> &'static Path {
    static DRIVER: OnceLock<PathBuf> = OnceLock::new();
    DRIVER.get_or_init(|| {
        let here = Path::new(env!("CARGO_MANIFEST_DIR"));
        let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("flash_attention_emulated");
        let out = Command::new("c++")
            .args(["-std=c++20", "-O1", "-pthread", "-fno-strict-aliasing"])
            .args(["-Wall", "-Wno-unknown-pragmas", "-Werror", "-o"])
            .arg(&exe)
            .arg(here.join("tests/cuda_emu/driver.cpp"))
            .output()
            .expect("running c++ (a C++20 compiler; scripts/setup-tests.sh installs g++)");
        assert!(
            out.status.success(),
            "compiling the emulated kernel failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        exe
    })
}

/// What the driver printed: the kernel's largest absolute difference from f64 attention, the
/// largest output, and (for `batch`) how many cache values differ from what the step should
/// leave.
struct Outcome {
    err: f64,
    reference: f64,
    bad: f64,
}

fn run(n: usize, n_head: usize, n_kv_head: usize, hd: usize, cap: usize, layout: &str) -> Outcome {
    let out = Command::new(driver())
        .args([n, n_head, n_kv_head, hd, cap].map(|x| x.to_string()))
        .args([layout, "7", "2.5"])
        .output()
        .expect("running the emulated kernel");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "driver failed: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| -> f64 {
        text.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no {name} in {text:?}"))
    };
    let mut bad = if matches!(
        layout,
        "batch" | "split" | "misfit" | "epilogue" | "epilogue16"
    ) {
        field("bad_cache_values=")
    } else {
        0.0
    };
    // The attention kernels' bf16 entry points, run beside: outputs that are not the f32
    // outputs' rounding.
    if matches!(
        layout,
        "batch" | "split" | "prefill" | "scattered" | "decode"
    ) {
        bad += field("bad_bf16=");
    }
    Outcome {
        err: field("max_err="),
        reference: field("max_ref="),
        bad,
    }
}

fn check(n: usize, n_head: usize, n_kv_head: usize, hd: usize, cap: usize, layout: &str) {
    let Outcome {
        err,
        reference,
        bad,
    } = run(n, n_head, n_kv_head, hd, cap, layout);
    assert!(
        reference > 0.05,
        "a degenerate case: outputs up to {reference}"
    );
    assert_eq!(bad, 0.0, "{layout}: bf16 outputs not the f32 ones rounded");
    assert!(
        err <= TOLERANCE,
        "{layout} n={n} heads={n_head}/{n_kv_head} hd={hd} cap={cap}: off by {err} (outputs up to {reference})"
    );
}

#[test]
fn prefill_rows_match_f64_attention_with_a_short_last_tile() {
    check(70, 4, 2, 64, 100, "prefill");
    check(150, 6, 2, 128, 150, "prefill");
}

#[test]
fn rows_at_any_positions_in_any_order_read_only_their_prefix() {
    check(130, 4, 1, 128, 300, "scattered");
    check(40, 8, 8, 64, 500, "scattered");
}

#[test]
fn decode_rows_read_every_key_tile() {
    check(3, 7, 1, 128, 700, "decode");
    check(1, 4, 2, 64, 65, "decode");
}

#[test]
fn a_long_prefix_of_many_key_tiles_keeps_the_online_softmax_exact() {
    check(64, 2, 1, 128, 2000, "prefill");
}

/// One decode step of several requests, each its own cache of another size and its row at its
/// own position: the new K/V rows land in each cache as f16 and nothing else in it changes;
/// each output is f64 attention over that cache's rows up to the row (f32 arithmetic on f16
/// values: within 1e-5). `split` cuts each request's keys into 6 ranges, one block each,
/// merged by `decode_merge` (with rows at small positions, some ranges are empty).
#[test]
fn a_batched_decode_step_writes_each_requests_row_and_attends_to_its_own_cache() {
    let cases = [(5, 4, 2, 64, 100), (3, 7, 1, 128, 300), (16, 8, 8, 64, 40)];
    for layout in ["batch", "split"] {
        for (r, heads, kv, hd, cap) in cases {
            let Outcome {
                err,
                reference,
                bad,
            } = run(r, heads, kv, hd, cap, layout);
            assert!(
                reference > 0.05,
                "a degenerate case: outputs up to {reference}"
            );
            assert_eq!(
                bad, 0.0,
                "{layout} r={r} hd={hd}: cache values left wrong, or bf16 outputs not the f32 \
                 ones rounded"
            );
            assert!(
                err <= 1e-5,
                "{layout} r={r} heads={heads}/{kv} hd={hd}: off by {err}"
            );
        }
    }
}

/// A launch neither layout fits (the flash kernel with half its threads; a decode row past its
/// cache, in one block and in three splits merged) writes NaN outputs and no cache value: the engine's check at load sees NaN and falls
/// back, where a trap would have left the GPU context unusable.
#[test]
fn misfit_launches_give_nan_rows_and_write_nothing() {
    for hd in [64, 128] {
        let out = Command::new(driver())
            .args(["1", "4", "2", &hd.to_string(), "80", "misfit", "1", "1"])
            .output()
            .expect("running the emulated kernel");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "driver failed: {text}");
        assert!(
            text.contains("finite_outputs=0 bad_cache_values=0"),
            "hd={hd}: {text}"
        );
    }
}

/// The Q/K/V product's epilogue (`qkv_epilogue.cu`): biases, RoPE in both pair layouts by each
/// row's angles, Q out, K and V into the f16 cache at each row's position (inputs read as
/// column ranges of one product, by row stride); nothing else in the cache changes, and a row
/// past the cache writes nothing and gets NaN. Within f16's rounding of the cache (relative
/// 5e-4) and f32's of Q; the product in f32, and as a bf16 GEMM writes it
/// (`qkv_epilogue_bf16`, read without a cast). Its rows mode (a batched decode's rows: Q, K
/// and V in f32 per row) gives Q bit for bit and K and V that round to what the cache got.
#[test]
fn the_qkv_epilogue_biases_rotates_and_writes_each_row_at_its_position() {
    for layout in ["epilogue", "epilogue16"] {
        for (n, heads, kv, hd, cap) in [(20, 4, 2, 64, 50), (9, 7, 1, 128, 300)] {
            let Outcome {
                err,
                reference,
                bad,
            } = run(n, heads, kv, hd, cap, layout);
            assert!(reference > 1.0, "a degenerate case: Q up to {reference}");
            assert_eq!(
                bad, 0.0,
                "{layout} n={n} hd={hd}: cache or Q values left wrong"
            );
            assert!(
                err <= 1e-3,
                "{layout} n={n} heads={heads}/{kv} hd={hd}: off by {err}"
            );
        }
    }
}

/// RMSNorm and SwiGLU writing the next GEMM's bf16 input (`norm_bf16.cu`): each value within
/// one bf16 rounding of f64 (the measure is in half-units of bf16's last place; f32 sums
/// add a little), SwiGLU's gate and up read as column ranges of one product, in f32 and as
/// the bf16 GEMM writes them (`swiglu_bf16_in`).
#[test]
fn rms_norm_and_swiglu_write_bf16_within_one_rounding() {
    for (rows, cols) in [(5, 300), (3, 1536)] {
        let Outcome { err, reference, .. } = run(rows, 1, 1, 64, cols, "norms");
        assert!(
            reference > 1.0,
            "a degenerate case: values up to {reference}"
        );
        assert!(
            err <= 1.5,
            "{rows} x {cols}: off by {err} half-units of bf16"
        );
    }
}

/// A bf16 GEMM's output added to the f32 residual stream (`add_bf16`, read by row stride as a
/// column range of a wider product) is the f32 sum, bit for bit; the add fused with the next
/// RMSNorm (`add_rms_norm_bf16`, the norm written over the product's own elements) gives that
/// sum and `rms_norm_bf16`'s norm of it bit for bit, and leaves the rest of the product alone.
#[test]
fn a_bf16_product_adds_to_the_residual_as_the_f32_sum() {
    for (rows, cols) in [(5, 300), (3, 1536)] {
        let out = Command::new(driver())
            .args([rows, 1, 1, 64, cols].map(|x| x.to_string()))
            .args(["norms", "7", "2.5"])
            .output()
            .expect("running the emulated kernel");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "driver failed: {text}");
        assert!(text.contains("bad_sums=0"), "{rows} x {cols}: {text}");
    }
}
