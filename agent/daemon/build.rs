//! Builds the eBPF object (through `lockstep-ebpf-build`) and places it in
//! OUT_DIR, where `datapath` embeds it with `include_bytes_aligned!`.

use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("set by cargo"));
    let root = manifest
        .parent()
        .and_then(|p| p.parent())
        .expect("agent/daemon lives two levels below the repository root")
        .to_path_buf();
    for path in lockstep_ebpf_build::source_dirs(&root) {
        println!("cargo:rerun-if-changed={}", path.display());
    }
    let object = match lockstep_ebpf_build::build(&root) {
        Ok(object) => object,
        Err(e) => {
            // A build script's panic prints its message; keep it the first line.
            panic!("cannot build lockstep's eBPF programs: {e}");
        }
    };
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("set by cargo"));
    std::fs::copy(&object, out.join("lockstep.bpf.o")).expect("copy the eBPF object into OUT_DIR");
}
