//! TLS to etcd (#12 item 1): a 3-member etcd serving clients over TLS only
//! and checking client certificates. The door with the CA and a client
//! certificate works (and so does the CLI); without the certificate, or
//! trusting another CA, every request is refused and nothing is written;
//! options that cannot work are refused before dialling, naming the option
//! and the file.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context, ensure};
use ipnet::IpNet;
use lockstep::cluster::{Claim, ClusterStoreError, Door, DoorOptions, TlsFiles};
use lockstep_tests::etcd::EtcdCluster;
use lockstep_tests::lockstep_bin;

fn rt() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn opts(endpoints: Vec<String>, tls: Option<TlsFiles>) -> DoorOptions {
    let mut o = DoorOptions::new(endpoints);
    o.prefix = "/tls/".into();
    o.timeout = Duration::from_secs(2);
    o.tls = tls;
    o
}

fn files(ca: &Path, cert: Option<&Path>, key: Option<&Path>) -> TlsFiles {
    TlsFiles {
        ca: ca.to_path_buf(),
        cert: cert.map(Path::to_path_buf),
        key: key.map(Path::to_path_buf),
    }
}

fn block() -> IpNet {
    "10.91.0.0/26".parse().expect("net")
}

/// The error of connecting and claiming `block()` with `o`.
async fn claim_err(o: DoorOptions) -> Option<ClusterStoreError> {
    match Door::connect(o).await {
        Err(e) => Some(e),
        Ok(mut d) => d.claim_block("p", block(), "intruder").await.err(),
    }
}

#[test]
fn the_door_speaks_tls_with_a_client_certificate_and_nothing_less_gets_in() -> anyhow::Result<()> {
    let cluster = EtcdCluster::start_tls(3)?;
    let pki = cluster.pki().context("pki")?.clone();
    let eps = cluster.endpoints();
    ensure!(eps.iter().all(|e| e.starts_with("https://")), "{eps:?}");
    let good = files(&pki.ca, Some(&pki.client_cert), Some(&pki.client_key));
    let rt = rt()?;
    rt.block_on(async {
        // No client certificate: etcd refuses the handshake.
        let e = claim_err(opts(eps.clone(), Some(files(&pki.ca, None, None))))
            .await
            .context("a claim without a client certificate succeeded")?;
        ensure!(
            matches!(e, ClusterStoreError::Unavailable { .. }),
            "without a client certificate: {e}"
        );
        // Trusting another CA: the client refuses etcd's certificate.
        let other = files(&pki.other_ca, Some(&pki.client_cert), Some(&pki.client_key));
        let e = claim_err(opts(eps.clone(), Some(other)))
            .await
            .context("a claim trusting the wrong CA succeeded")?;
        ensure!(
            matches!(e, ClusterStoreError::Unavailable { .. }),
            "with the wrong CA: {e}"
        );

        // With both: a claim, read back by a second door.
        let mut d = Door::connect(opts(eps.clone(), Some(good.clone()))).await?;
        let (blocks, _) = d.blocks().await?;
        ensure!(
            blocks.is_empty(),
            "the refused claims wrote nothing: {blocks:?}"
        );
        let got = d.claim_block("p", block(), "node-a").await?;
        ensure!(matches!(got, Claim::Claimed { .. }), "{got:?}");
        let mut d2 = Door::connect(opts(eps.clone(), Some(good.clone()))).await?;
        let (blocks, _) = d2.blocks().await?;
        ensure!(
            blocks.len() == 1 && blocks[0].node == "node-a" && blocks[0].cidr == block(),
            "{blocks:?}"
        );
        anyhow::Ok(())
    })?;

    // The CLI with --cacert/--cert/--key.
    let out = Command::new(lockstep_bin())
        .args(["cluster", "--etcd", &eps.join(","), "--prefix", "/tls/"])
        .arg("--cacert")
        .arg(&pki.ca)
        .arg("--cert")
        .arg(&pki.client_cert)
        .arg("--key")
        .arg(&pki.client_key)
        .args(["blocks", "-o", "json"])
        .output()?;
    ensure!(
        out.status.success(),
        "cli: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let blocks: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    ensure!(blocks[0]["node"] == "node-a", "{blocks}");
    // Without --cacert the https endpoint is refused, naming it.
    let out = Command::new(lockstep_bin())
        .args(["cluster", "--etcd", &eps[0], "blocks"])
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success() && err.contains(&eps[0]) && err.contains("cluster.tls.ca"),
        "{err}"
    );
    Ok(())
}

#[test]
fn unusable_tls_options_are_refused_before_dialling_naming_the_option() -> anyhow::Result<()> {
    // No etcd needed: nothing is dialled.
    let dir = lockstep_tests::TempDir::new("tls-opts")?;
    let pki = lockstep_tests::etcd::Pki::make(&dir.path().join("pki"))?;
    let https = vec!["https://127.0.0.1:1".to_string()];
    let rt = rt()?;
    let refused = |o: DoorOptions| -> anyhow::Result<String> {
        match rt.block_on(Door::connect(o)) {
            Err(ClusterStoreError::Invalid(why)) => Ok(why),
            Err(e) => anyhow::bail!("not an option error: {e}"),
            Ok(_) => anyhow::bail!("accepted"),
        }
    };
    let missing = dir.path().join("nope.pem");
    let why = refused(opts(https.clone(), Some(files(&missing, None, None))))?;
    ensure!(
        why.contains("cluster.tls.ca") && why.contains("nope.pem"),
        "{why}"
    );
    // A key where a certificate belongs.
    let why = refused(opts(
        https.clone(),
        Some(files(&pki.client_key, None, None)),
    ))?;
    ensure!(
        why.contains("cluster.tls.ca") && why.contains("no PEM CERTIFICATE"),
        "{why}"
    );
    let why = refused(opts(
        https.clone(),
        Some(files(&pki.ca, Some(&pki.client_cert), None)),
    ))?;
    ensure!(
        why.contains("cluster.tls.cert is given without cluster.tls.key"),
        "{why}"
    );
    let why = refused(opts(
        https.clone(),
        Some(files(
            &pki.ca,
            Some(&pki.client_cert),
            Some(&pki.client_cert),
        )),
    ))?;
    ensure!(
        why.contains("cluster.tls.key") && why.contains("no PEM PRIVATE KEY"),
        "{why}"
    );
    // Scheme and TLS disagree.
    let why = refused(opts(
        vec!["http://127.0.0.1:1".into()],
        Some(files(&pki.ca, None, None)),
    ))?;
    ensure!(
        why.contains("http://127.0.0.1:1") && why.contains("https://"),
        "{why}"
    );
    let why = refused(opts(https, None))?;
    ensure!(why.contains("cluster.tls.ca"), "{why}");
    Ok(())
}
