//! Writes the tiny model of every family [`target_engine::testing::family_specs`] names to
//! `DIR/<name>.gguf`, for `scripts/family_fixtures.py` to run through llama.cpp.
//!
//! `cargo run --release -p target-engine --example write_families -- DIR`
use target_engine::testing::{family_specs, write_tiny_gguf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = std::env::args().nth(1).ok_or("usage: write_families DIR")?;
    let dir = std::path::Path::new(&dir);
    std::fs::create_dir_all(dir)?;
    for (name, spec) in family_specs() {
        let path = dir.join(format!("{name}.gguf"));
        write_tiny_gguf(&path, &spec)?;
        println!("{}", path.display());
    }
    Ok(())
}
