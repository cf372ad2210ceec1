//! Writes the CRDs derived from lockstep's Rust types into `deploy/crds/`
//! (`cargo run -p lockstep --example crdgen`); a unit test of each CRD's
//! module (`kubernetes::crd`, `kubernetes::nodeipam::crd`,
//! `kubernetes::pod_pools`, `kubernetes::bgp_peers`, `kubernetes::bgp_status`) fails while the
//! committed files differ.

fn main() -> anyhow::Result<()> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/crds");
    std::fs::create_dir_all(&dir)?;
    for (file, yaml) in [
        (
            "loadbalancerippools.lockstep.io.yaml",
            lockstep::kubernetes::crd::crd_yaml(),
        ),
        (
            "nodeipams.lockstep.io.yaml",
            lockstep::kubernetes::nodeipam::crd::crd_yaml(),
        ),
        (
            "podippools.lockstep.io.yaml",
            lockstep::kubernetes::pod_pools::crd_yaml(),
        ),
        (
            "bgppeers.lockstep.io.yaml",
            lockstep::kubernetes::bgp_peers::crd_yaml(),
        ),
        (
            "bgpnodestates.lockstep.io.yaml",
            lockstep::kubernetes::bgp_status::crd_yaml(),
        ),
    ] {
        let path = dir.join(file);
        std::fs::write(&path, yaml.map_err(anyhow::Error::msg)?)?;
        println!("wrote {}", path.display());
    }
    Ok(())
}
