//! The version this binary reports (`lockstep status`, `lockstep --version`
//! is clap's crate version).
//!
//! The version lives in a fixed-size stamp in the binary's read-only data:
//! [`STAMP_MARKER`] followed by the version, NUL-padded to [`STAMP_LEN`]
//! bytes. A build reports the crate version; `cargo xtask image --version V`
//! overwrites the stamp in the copy of the binary it puts into the image (as
//! Go's `-ldflags -X` does), so two images of one compilation report
//! different versions without a second full release build. The stamp is read
//! through a volatile load, so the compiler cannot fold the crate version into
//! the code that reads it.

/// The bytes in front of the version in the stamp (`lockstep-version-stamp:`),
/// in two halves: code that searches for the marker joins them at run time,
/// so the whole marker occurs once in the binary, in the stamp, which is how
/// the image build finds it.
pub const STAMP_MARKER: [&[u8]; 2] = [b"lockstep-version-", b"stamp:"];

/// Length of the joined marker.
pub const STAMP_MARKER_LEN: usize = STAMP_MARKER[0].len() + STAMP_MARKER[1].len();

/// Total length of the stamp (marker, version and NUL padding).
pub const STAMP_LEN: usize = 96;

const fn initial_stamp() -> [u8; STAMP_LEN] {
    let mut out = [0u8; STAMP_LEN];
    let mut at = 0;
    let mut part = 0;
    while part < STAMP_MARKER.len() {
        let bytes = STAMP_MARKER[part];
        let mut i = 0;
        while i < bytes.len() {
            out[at] = bytes[i];
            at += 1;
            i += 1;
        }
        part += 1;
    }
    let version = env!("CARGO_PKG_VERSION").as_bytes();
    let mut j = 0;
    while j < version.len() && at < STAMP_LEN - 1 {
        out[at] = version[j];
        at += 1;
        j += 1;
    }
    out
}

#[used]
static STAMP: [u8; STAMP_LEN] = initial_stamp();

/// The version of this binary: the crate version, or what the image build
/// stamped into it.
pub fn version() -> String {
    // SAFETY: `STAMP` is a valid, aligned, initialised static; the volatile
    // read only keeps the compiler from assuming its compile-time value.
    let stamp: [u8; STAMP_LEN] = unsafe { std::ptr::read_volatile(&raw const STAMP) };
    let value = &stamp[STAMP_MARKER_LEN..];
    let end = value.iter().position(|b| *b == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

/// Why a binary could not be stamped.
#[derive(Debug, thiserror::Error)]
pub enum StampError {
    /// The marker occurs `found` times instead of once.
    #[error("the version stamp occurs {found} times in the binary, not once")]
    Marker {
        /// How often it was found.
        found: usize,
    },
    /// The version does not fit the stamp (or holds a NUL).
    #[error("version {version:?} is empty, holds a NUL or is longer than {max} bytes")]
    Version {
        /// The version asked for.
        version: String,
        /// The longest that fits.
        max: usize,
    },
}

/// Writes `version` into the stamp of `binary` (the bytes of a lockstep
/// executable), so the binary reports it. `cargo xtask image` does the same
/// (xtask does not depend on this crate; the image test checks that both
/// agree).
///
/// # Errors
/// The stamp is not found exactly once, or the version does not fit.
pub fn stamp(binary: &mut [u8], version: &str) -> Result<(), StampError> {
    let max = STAMP_LEN - STAMP_MARKER_LEN - 1;
    if version.is_empty() || version.len() > max || version.contains('\0') {
        return Err(StampError::Version {
            version: version.to_string(),
            max,
        });
    }
    let marker = STAMP_MARKER.concat();
    let at: Vec<usize> = binary
        .windows(STAMP_MARKER_LEN)
        .enumerate()
        .filter(|(_, w)| *w == marker.as_slice())
        .map(|(i, _)| i)
        .collect();
    let [at] = at[..] else {
        return Err(StampError::Marker { found: at.len() });
    };
    let value = &mut binary[at + STAMP_MARKER_LEN..at + STAMP_LEN];
    value.fill(0);
    value[..version.len()].copy_from_slice(version.as_bytes());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unstamped_build_reports_the_crate_version() {
        assert_eq!(version(), env!("CARGO_PKG_VERSION"));
    }

    #[test]
    fn stamping_replaces_the_version_and_refuses_what_does_not_fit() {
        let mut bin = b"head".to_vec();
        bin.extend_from_slice(&initial_stamp());
        bin.extend_from_slice(b"tail");
        stamp(&mut bin, "2.0.0-rc.1+abc").expect("stamp");
        let value = &bin[4 + STAMP_MARKER_LEN..4 + STAMP_LEN];
        assert!(value.starts_with(b"2.0.0-rc.1+abc\0"));
        assert!(value[14..].iter().all(|b| *b == 0));
        assert!(bin.ends_with(b"tail"));
        assert!(stamp(&mut bin, &"x".repeat(80)).is_err());
        assert!(stamp(&mut bin, "").is_err());
        let mut twice = bin.clone();
        twice.extend_from_slice(&initial_stamp());
        assert!(matches!(
            stamp(&mut twice, "1"),
            Err(StampError::Marker { found: 2 })
        ));
    }

    #[test]
    fn the_stamp_starts_with_the_marker() {
        assert_eq!(initial_stamp()[..STAMP_MARKER_LEN], STAMP_MARKER.concat());
        assert_eq!(initial_stamp()[STAMP_LEN - 1], 0, "always NUL-terminated");
    }
}
