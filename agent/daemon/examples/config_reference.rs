//! Writes the configuration reference generated from the config types into
//! `docs/configuration.md` (`cargo xtask config-reference` runs this); the
//! unit test `config::reference::tests` fails while the committed file
//! differs.

fn main() -> anyhow::Result<()> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(lockstep::config::reference::PATH);
    std::fs::write(&path, lockstep::config::reference::markdown())?;
    println!("wrote {}", path.display());
    Ok(())
}
