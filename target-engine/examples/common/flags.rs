//! The examples' one flag form, `--name N`, shared by `#[path]` inclusion (examples are
//! separate crates).

/// The number after `name` in `args`, or `default` when the flag is absent.
pub fn number(
    args: &[String],
    name: &str,
    default: usize,
) -> Result<usize, Box<dyn std::error::Error>> {
    match args.iter().position(|a| a == name) {
        Some(i) => Ok(args
            .get(i + 1)
            .ok_or(format!("{name} needs a value"))?
            .parse()?),
        None => Ok(default),
    }
}
