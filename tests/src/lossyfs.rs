//! `lossyfs`: a FUSE file system that loses what was not made durable when
//! a test cuts the power, and the guard that mounts it for a test.
//!
//! The model (what is durable when) is in [`model`]; the binary
//! (`tests/src/bin/lossyfs.rs`) serves it over FUSE and takes commands on a
//! control socket, one line each, one line answered:
//!
//! | command | answer |
//! | --- | --- |
//! | `cut drop` | `ok dropped=N kept=0`: everything not durable is gone |
//! | `cut torn SEED` | `ok dropped=N kept=M`: random 4 KiB pieces of unsynced writes survive |
//! | `stats` | `writes=N bytes_written=N fsyncs=N fsyncdirs=N cuts=N dropped_bytes=N kept_bytes=N dropped_dirs=N kills=N failed_syncs=N` |
//! | `fail-sync NAME K` | `armed`: the K-th sync of a file named NAME fails with `EIO`, and what it had to make durable never is (it stays readable until a cut) |
//! | `arm-kill NAME K drop\|none\|torn SEED` | `armed`: the K-th write to a file named NAME SIGKILLs its writer, then cuts (or not: `none`), and fails with `EIO` |
//! | `wait-trigger [MS]` | `fired pid=N`, or `not-fired` (nothing armed, or MS passed) |
//! | `disarm` | `disarmed`, `idle`, or `fired pid=N` if it fired first |
//! | `quit` | `bye`, then it unmounts and exits |
//!
//! [`LossyFs`] starts it on a fresh directory and, on drop, makes sure the
//! mount is gone whatever happened (`quit`, then SIGKILL, `fusermount3 -u
//! -z`, `umount -l`).

pub mod model;

pub use model::{Cut, Stats};

use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

use crate::TempDir;

/// A mounted `lossyfs`, unmounted (and its directory removed) on drop.
#[derive(Debug)]
pub struct LossyFs {
    child: Option<Child>,
    mountpoint: PathBuf,
    control: PathBuf,
    // Held, not read: dropped last, so removed once nothing is mounted in it.
    _dir: TempDir,
}

impl LossyFs {
    /// Mounts `lossyfs` (the binary at `bin`: a test passes
    /// `env!("CARGO_BIN_EXE_lossyfs")`) on a fresh directory and waits until
    /// it serves. The daemon gets SIGTERM if the thread that mounted it dies
    /// (`PR_SET_PDEATHSIG`), so even a test killed outright leaves no mount.
    ///
    /// # Errors
    /// It could not be started or did not report "mounted" within 20 s.
    pub fn mount(bin: &Path) -> anyhow::Result<Self> {
        let dir = TempDir::new("lossyfs")?;
        let mountpoint = dir.path().join("mnt");
        std::fs::create_dir(&mountpoint)?;
        let control = dir.path().join("control.sock");
        let mut cmd = Command::new(bin);
        cmd.arg("--control")
            .arg(&control)
            .arg(&mountpoint)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // SAFETY: prctl is async-signal-safe and touches only the child.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        let stdout = child.stdout.take().context("no stdout")?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let mut fs = Self {
            child: Some(child),
            mountpoint,
            control,
            _dir: dir,
        };
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) if line.trim() == "mounted" => Ok(fs),
            Ok(line) => {
                let status = fs.child.as_mut().and_then(|c| c.try_wait().ok().flatten());
                bail!("lossyfs did not mount: printed {line:?}, exit {status:?}")
            }
            Err(_) => bail!("lossyfs did not report 'mounted' within 20 s"),
        }
    }

    /// The mount point.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// The daemon's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends one control line and returns the answer; an answer starting
    /// with `error` is an error.
    ///
    /// # Errors
    /// No connection, no answer, or an error answer.
    pub fn command(&self, line: &str) -> anyhow::Result<String> {
        let mut s = UnixStream::connect(&self.control)
            .with_context(|| format!("connecting to {}", self.control.display()))?;
        writeln!(s, "{line}")?;
        let mut answer = String::new();
        BufReader::new(&s).read_line(&mut answer)?;
        let answer = answer.trim().to_string();
        if answer.is_empty() || answer.starts_with("error") {
            bail!("lossyfs {line:?}: {answer:?}");
        }
        Ok(answer)
    }

    /// Cuts the power; returns (bytes lost, bytes a torn cut kept).
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn cut(&self, how: Cut) -> anyhow::Result<(u64, u64)> {
        let answer = self.command(&format!("cut {how}"))?;
        let fields = fields(&answer);
        Ok((field(&fields, "dropped")?, field(&fields, "kept")?))
    }

    /// The counters.
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn stats(&self) -> anyhow::Result<Stats> {
        let answer = self.command("stats")?;
        let f = fields(&answer);
        Ok(Stats {
            writes: field(&f, "writes")?,
            bytes_written: field(&f, "bytes_written")?,
            fsyncs: field(&f, "fsyncs")?,
            fsyncdirs: field(&f, "fsyncdirs")?,
            cuts: field(&f, "cuts")?,
            dropped_bytes: field(&f, "dropped_bytes")?,
            kept_bytes: field(&f, "kept_bytes")?,
            dropped_dirs: field(&f, "dropped_dirs")?,
            kills: field(&f, "kills")?,
            failed_syncs: field(&f, "failed_syncs")?,
        })
    }

    /// Arms a kill: the `k`-th write to a file named `name` SIGKILLs the
    /// writing process, then `cut` happens (`None`: no cut, a plain crash).
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn arm_kill(&self, name: &str, k: u64, cut: Option<Cut>) -> anyhow::Result<()> {
        let how = cut.map_or_else(|| "none".to_string(), |c| c.to_string());
        self.command(&format!("arm-kill {name} {k} {how}"))?;
        Ok(())
    }

    /// Arms a sync failure: the `k`-th `fsync`/`fdatasync` of a file named
    /// `name` fails with `EIO`, and what it was to make durable never is.
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn fail_sync(&self, name: &str, k: u64) -> anyhow::Result<()> {
        self.command(&format!("fail-sync {name} {k}"))?;
        Ok(())
    }

    /// Waits up to `limit` for the armed kill; returns the killed process,
    /// or `None` (nothing armed, or not yet fired: it stays armed).
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn wait_trigger(&self, limit: Duration) -> anyhow::Result<Option<u32>> {
        let answer = self.command(&format!("wait-trigger {}", limit.as_millis()))?;
        fired(&answer)
    }

    /// Disarms; returns the killed process if it fired first.
    ///
    /// # Errors
    /// See [`LossyFs::command`].
    pub fn disarm(&self) -> anyhow::Result<Option<u32>> {
        let answer = self.command("disarm")?;
        fired(&answer)
    }

    /// Whether the mount point is still a mount (in /proc/self/mountinfo).
    pub fn mounted(&self) -> bool {
        is_mounted(&self.mountpoint)
    }

    /// Unmounts: `quit`, and if the daemon has not gone within 10 s, SIGKILL
    /// and forced unmounts. Idempotent; drop calls it.
    pub fn unmount(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = self.command("quit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Ok(None) = child.try_wait() {
            eprintln!("lossyfs did not quit within 10 s; killing it");
            let _ = child.kill();
            let _ = child.wait();
        }
        if is_mounted(&self.mountpoint) {
            let _ = Command::new("fusermount3")
                .args(["-u", "-z"])
                .arg(&self.mountpoint)
                .output();
        }
        if is_mounted(&self.mountpoint) {
            let _ = Command::new("umount")
                .arg("-l")
                .arg(&self.mountpoint)
                .output();
        }
    }
}

impl Drop for LossyFs {
    fn drop(&mut self) {
        self.unmount();
    }
}

/// Whether `path` is a mount point of this mount namespace.
pub fn is_mounted(path: &Path) -> bool {
    let Ok(info) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return false;
    };
    let want = path.to_string_lossy();
    info.lines()
        .filter_map(|l| l.split(' ').nth(4))
        .any(|m| m == want)
}

fn fields(answer: &str) -> Vec<(&str, &str)> {
    answer
        .split_whitespace()
        .filter_map(|w| w.split_once('='))
        .collect()
}

fn field(fields: &[(&str, &str)], name: &str) -> anyhow::Result<u64> {
    fields
        .iter()
        .find(|(k, _)| *k == name)
        .with_context(|| format!("no {name} in lossyfs's answer"))?
        .1
        .parse()
        .with_context(|| format!("{name} is not a number"))
}

fn fired(answer: &str) -> anyhow::Result<Option<u32>> {
    if answer.starts_with("fired") {
        return Ok(Some(field(&fields(answer), "pid")? as u32));
    }
    if answer == "not-fired" || answer == "disarmed" || answer == "idle" {
        return Ok(None);
    }
    bail!("unexpected lossyfs answer {answer:?}")
}
