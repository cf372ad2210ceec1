//! Fuzzes `lockstep::cni::parse_invocation`: it must never panic, whatever
//! the environment and stdin, and what it accepts must serialise and read
//! back consistently.
//!
//! Input layout: up to seven parts separated by 0xFF (a byte that never occurs
//! in UTF-8, so JSON seeds stay readable):
//! `CNI_COMMAND 0xFF CNI_CONTAINERID 0xFF CNI_NETNS 0xFF CNI_IFNAME 0xFF
//! CNI_ARGS 0xFF CNI_PATH 0xFF stdin`. An empty part leaves the variable
//! unset; a one-byte command part 0–5 selects ADD, DEL, CHECK, GC, STATUS,
//! VERSION so the fuzzer reaches every command cheaply. Variable values are
//! raw bytes, so non-UTF-8 values are exercised too.

#![no_main]

use std::ffi::OsStr;
use std::os::unix::ffi::OsStrExt;

use libfuzzer_sys::fuzz_target;
use lockstep::cni::{
    CniResult, CniVersion, Command, ErrorCode, Invocation, IpamResult, MAX_STDIN_BYTES,
    error_version, parse_invocation,
};

const NAMES: [&str; 6] = [
    "CNI_COMMAND",
    "CNI_CONTAINERID",
    "CNI_NETNS",
    "CNI_IFNAME",
    "CNI_ARGS",
    "CNI_PATH",
];

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(NAMES.len() + 1, |b| *b == 0xFF);
    let mut env: Vec<(&OsStr, &OsStr)> = Vec::new();
    for name in NAMES {
        let Some(mut value) = parts.next() else { break };
        if name == "CNI_COMMAND" && value.len() == 1 && usize::from(value[0]) < Command::ALL.len() {
            value = Command::ALL[usize::from(value[0])].as_str().as_bytes();
        }
        if !value.is_empty() {
            env.push((OsStr::new(name), OsStr::from_bytes(value)));
        }
    }
    let stdin = parts.next().unwrap_or_default();
    check(env, stdin);
    check_ipam_result(stdin);
});

/// The plugin also reads IPAM results (host-local's output in delegated
/// mode): read any `prevResult` in stdin as one, and check its round trip.
fn check_ipam_result(stdin: &[u8]) {
    let Ok(document) = serde_json::from_slice::<serde_json::Value>(stdin) else {
        return;
    };
    let Some(prev) = document.get("prevResult") else {
        return;
    };
    for version in CniVersion::SUPPORTED {
        let Ok(ipam) = IpamResult::from_json(prev, "prevResult", version) else {
            continue;
        };
        // Lossless in 1.1.0, which has every field; older versions drop the
        // 1.1.0-only route attributes by design, so there only idempotence
        // holds.
        let latest = ipam.to_json(CniVersion::LATEST);
        let back = IpamResult::from_json(&latest, "result", CniVersion::LATEST)
            .expect("a written 1.1.0 IPAM result reads back");
        assert_eq!(back, ipam, "1.1.0 IPAM round trip changed the result");
        let written = ipam.to_json(version);
        let reread = IpamResult::from_json(&written, "result", version)
            .expect("a written IPAM result reads back in its own version");
        assert_eq!(
            reread.to_json(version),
            written,
            "{version} IPAM round trip is not idempotent"
        );
        let full = CniResult::from_ipam(ipam, Vec::new(), 0);
        let _ = full.to_json(version);
    }
}

fn check(env: Vec<(&OsStr, &OsStr)>, stdin: &[u8]) {
    match parse_invocation(env, stdin) {
        Err(e) => {
            let version = error_version(stdin);
            let object = e.to_json(version.as_str());
            assert_eq!(object["code"], e.code().as_u32());
            assert!(!object["msg"].as_str().unwrap_or_default().is_empty());
            assert!(matches!(
                e.code(),
                ErrorCode::IncompatibleVersion
                    | ErrorCode::UnsupportedField
                    | ErrorCode::InvalidEnvironment
                    | ErrorCode::IoFailure
                    | ErrorCode::DecodingFailure
                    | ErrorCode::InvalidNetworkConfig
            ));
            assert!(
                stdin.len() <= MAX_STDIN_BYTES
                    || e.code() == ErrorCode::IoFailure
                    || e.code() == ErrorCode::InvalidEnvironment
            );
        }
        Ok(invocation) => {
            let version = invocation.cni_version();
            match &invocation {
                Invocation::Version(request) => {
                    let _ = request.response().to_json();
                }
                Invocation::Add(request)
                | Invocation::Del(request)
                | Invocation::Check(request) => {
                    if invocation.command() == Command::Check {
                        assert!(request.prev_result.is_some(), "CHECK without prevResult");
                    }
                    if matches!(invocation.command(), Command::Add | Command::Check) {
                        assert!(request.netns.is_some(), "ADD/CHECK without netns");
                    }
                    if let Some(prev) = &request.prev_result {
                        round_trip(prev, version);
                    }
                }
                Invocation::Gc(_) | Invocation::Status(_) => {}
            }
        }
    }
}

/// Writing a result and reading it back loses nothing in 1.1.0 (which has
/// every field), and is idempotent in the version in use.
fn round_trip(result: &CniResult, version: CniVersion) {
    let latest = result.to_json(CniVersion::LATEST);
    let back = CniResult::from_json(&latest, "prevResult", CniVersion::LATEST)
        .expect("a written 1.1.0 result reads back");
    assert_eq!(&back, result, "1.1.0 round trip changed the result");

    let written = result.to_json(version);
    let reread = CniResult::from_json(&written, "prevResult", version)
        .expect("a written result reads back in its own version");
    assert_eq!(
        reread.to_json(version),
        written,
        "{version} round trip is not idempotent"
    );
}
