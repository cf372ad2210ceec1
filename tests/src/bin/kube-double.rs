//! The Kubernetes API double (`lockstep_tests::kubeapi`) as a process, for
//! `cargo xtask demo --kubernetes`: serves on the address given (default
//! `127.0.0.1:18080`) until killed. Objects are created with plain HTTP
//! (`curl -X POST -H 'Content-Type: application/json'`).

fn main() -> anyhow::Result<()> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "127.0.0.1:18080".into())
        .parse()?;
    let api = lockstep_tests::kubeapi::ApiDouble::start_at(
        addr,
        lockstep_tests::kubeapi::BOOKMARK_EVERY,
    )?;
    eprintln!("kubernetes API double on http://{}", api.addr());
    loop {
        std::thread::park();
    }
}
