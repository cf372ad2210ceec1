//! Writes the CRDs derived from lockstep's Rust types into `deploy/crds/`
//! (`cargo run -p lockstep --example crdgen`); a unit test of
//! `kubernetes::crd` fails while the committed files differ.

fn main() -> anyhow::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
    std::fs::create_dir_all(&dir)?;
    let path = dir.join("loadbalancerippools.lockstep.io.yaml");
    let yaml = lockstep::kubernetes::crd::crd_yaml().map_err(anyhow::Error::msg)?;
    std::fs::write(&path, yaml)?;
    println!("wrote {}", path.display());
    Ok(())
}
