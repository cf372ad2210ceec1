//! `lossyfs`, the file system of the power-loss tests, shown to keep its
//! model (`lockstep_tests::lossyfs::model`) through the kernel: what fsync
//! made durable survives a cut, nothing else does; a directory fsync keeps
//! names, not data; a torn cut keeps whole 4 KiB pieces; an armed kill kills
//! a real writer at its k-th write; locks work; and nothing stays mounted.

use std::fs::{File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::lossyfs::{Cut, LossyFs, is_mounted};
use lockstep_tests::privileged;

fn mount() -> anyhow::Result<LossyFs> {
    LossyFs::mount(Path::new(env!("CARGO_BIN_EXE_lossyfs")))
}

fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

fn write_synced(path: &Path, data: &[u8]) -> anyhow::Result<File> {
    let mut f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)?;
    f.write_all(data)?;
    f.sync_data()?;
    Ok(f)
}

#[test]
fn fsynced_data_survives_a_cut_and_unsynced_changes_vanish() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let root = fs.path();
    let a = root.join("a");
    let mut f = write_synced(&a, b"durable")?;
    sync_dir(root)?;
    // Unsynced: more data, a file whose data (not name) was synced, a
    // rename, a directory.
    f.write_all(b" and lost")?;
    drop(write_synced(
        &root.join("b"),
        b"synced data, unsynced name",
    )?);
    std::fs::rename(&a, root.join("c"))?;
    std::fs::create_dir(root.join("d"))?;
    let stale = OpenOptions::new().write(true).open(root.join("c"))?;
    ensure!(std::fs::read(root.join("c"))? == b"durable and lost");

    let (dropped, kept) = fs.cut(Cut::Drop)?;
    // Only " and lost" was written and never synced.
    ensure!((dropped, kept) == (9, 0), "dropped {dropped}, kept {kept}");
    ensure!(
        std::fs::read(&a)? == b"durable",
        "a: {:?}",
        std::fs::read(&a)
    );
    for gone in ["b", "c", "d"] {
        ensure!(!root.join(gone).exists(), "{gone} survived the cut");
    }
    // A descriptor from before the cut cannot write dropped data back.
    let err = stale
        .write_at(b"zombie", 0)
        .expect_err("a write through a handle from before the cut");
    ensure!(err.raw_os_error() == Some(libc::EIO), "{err}");
    ensure!(std::fs::read(&a)? == b"durable");
    let stats = fs.stats()?;
    ensure!(
        stats.cuts == 1 && stats.fsyncs >= 2 && stats.fsyncdirs == 1,
        "{stats:?}"
    );
    Ok(())
}

#[test]
fn a_write_through_an_o_dsync_descriptor_is_durable_when_it_returns() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let path = fs.path().join("dsync");
    drop(write_synced(&path, b"")?);
    sync_dir(fs.path())?;
    let f = OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_DSYNC)
        .open(&path)?;
    f.write_all_at(b"synchronous", 0)?;
    fs.cut(Cut::Drop)?;
    ensure!(std::fs::read(&path)? == b"synchronous");
    Ok(())
}

#[test]
fn a_directory_fsync_keeps_names_but_not_the_data_behind_them() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let root = fs.path();
    std::fs::create_dir(root.join("sub"))?;
    std::fs::write(root.join("sub/e"), b"unsynced data")?;
    // The subdirectory's own entries, then its name in the root.
    sync_dir(&root.join("sub"))?;
    sync_dir(root)?;
    // A file's fsync alone does not make its name durable.
    drop(write_synced(&root.join("sub/f"), b"data")?);
    fs.cut(Cut::Drop)?;
    ensure!(std::fs::read(root.join("sub/e"))?.is_empty());
    ensure!(!root.join("sub/f").exists(), "f's name was never synced");
    Ok(())
}

#[test]
fn a_torn_cut_keeps_whole_4k_pieces_of_unsynced_writes() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let path = fs.path().join("t");
    let mut mixed = false;
    for seed in 1..=4u64 {
        drop(write_synced(&path, &vec![0u8; 64 * 1024])?);
        sync_dir(fs.path())?;
        let f = OpenOptions::new().write(true).open(&path)?;
        // Unaligned: [100, 4096) is the first piece, then whole sectors, then
        // [40960, 41060).
        f.write_all_at(&vec![0xab; 40 * 1024], 100)?;
        drop(f);
        let (dropped, kept) = fs.cut(Cut::Torn(seed))?;
        ensure!(dropped + kept == 40 * 1024, "{dropped} + {kept}");
        let image = std::fs::read(&path)?;
        ensure!(image.len() == 64 * 1024);
        ensure!(image[..100].iter().all(|b| *b == 0));
        let bounds: Vec<usize> = std::iter::once(100)
            .chain((1..=10).map(|s| s * 4096))
            .chain(std::iter::once(100 + 40 * 1024))
            .collect();
        let mut kinds = Vec::new();
        for w in bounds.windows(2) {
            let piece = &image[w[0]..w[1]];
            ensure!(
                piece.iter().all(|b| *b == piece[0]),
                "seed {seed}: piece {}..{} is torn inside",
                w[0],
                w[1]
            );
            kinds.push(piece[0]);
        }
        let kept_bytes: usize = bounds
            .windows(2)
            .zip(&kinds)
            .filter(|(_, k)| **k == 0xab)
            .map(|(w, _)| w[1] - w[0])
            .sum();
        ensure!(
            kept_bytes as u64 == kept,
            "seed {seed}: {kept_bytes} vs {kept}"
        );
        mixed |= kinds.contains(&0) && kinds.contains(&0xab);
    }
    ensure!(mixed, "no seed kept some pieces and dropped others");
    Ok(())
}

#[test]
fn an_armed_kill_kills_the_writer_at_its_kth_write() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let dd = |name: &str, count: usize| {
        Command::new("dd")
            .arg("if=/dev/zero")
            .arg(format!("of={}", fs.path().join(name).display()))
            .args(["bs=4096", &format!("count={count}"), "conv=fsync"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
    };

    // With a cut: the file's name was never synced, so it is gone.
    fs.arm_kill("victim", 5, Some(Cut::Drop))?;
    let mut child = dd("victim", 1000)?;
    let status = child.wait()?;
    ensure!(status.signal() == Some(libc::SIGKILL), "dd: {status}");
    let pid = fs.wait_trigger(Duration::from_secs(5))?;
    ensure!(
        pid == Some(child.id()),
        "fired on {pid:?}, dd was {}",
        child.id()
    );
    ensure!(!fs.path().join("victim").exists());

    // Without a cut (a plain crash): the four writes before stay visible.
    fs.arm_kill("crash", 5, None)?;
    let mut child = dd("crash", 1000)?;
    let status = child.wait()?;
    ensure!(status.signal() == Some(libc::SIGKILL), "dd: {status}");
    ensure!(fs.wait_trigger(Duration::from_secs(5))? == Some(child.id()));
    let len = std::fs::metadata(fs.path().join("crash"))?.len();
    ensure!(len == 4 * 4096, "{len} bytes after four writes");

    // Other files' writes do not count; an unfired trigger can be disarmed.
    fs.arm_kill("elsewhere", 1, Some(Cut::Drop))?;
    let status = dd("other", 3)?.wait()?;
    ensure!(status.success(), "dd: {status}");
    ensure!(fs.wait_trigger(Duration::from_millis(50))?.is_none());
    ensure!(fs.disarm()?.is_none());
    ensure!(fs.stats()?.kills == 2);
    Ok(())
}

#[test]
fn flock_and_record_locks_work_as_on_a_local_file_system() -> anyhow::Result<()> {
    privileged!();
    let fs = mount()?;
    let path = fs.path().join("locked");
    let one = write_synced(&path, b"x")?;
    let two = OpenOptions::new().read(true).write(true).open(&path)?;
    // SAFETY: flock on open descriptors.
    let rc = unsafe { libc::flock(one.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    ensure!(rc == 0, "flock: {}", std::io::Error::last_os_error());
    // SAFETY: as above.
    let rc = unsafe { libc::flock(two.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    let err = std::io::Error::last_os_error();
    ensure!(
        rc != 0 && err.kind() == ErrorKind::WouldBlock,
        "second flock: {rc} {err}"
    );
    // Open-file-description record locks, as redb takes them.
    let lock = |f: &File| {
        // SAFETY: a zeroed flock is valid; fields set below.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_WRLCK as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        fl.l_len = 0;
        // SAFETY: F_OFD_SETLK with a valid struct.
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &fl) }
    };
    ensure!(lock(&one) == 0, "{}", std::io::Error::last_os_error());
    ensure!(lock(&two) != 0, "a second OFD write lock was granted");
    // Released by an explicit unlock, not by closing `one`: a close
    // releases it only with the last reference to the open file
    // description, and a process another test spawns at that moment
    // holds one between its fork and its exec (on any file system; CI
    // once met the lock still held there).
    let unlock = |f: &File| {
        // SAFETY: as above.
        let mut fl: libc::flock = unsafe { std::mem::zeroed() };
        fl.l_type = libc::F_UNLCK as i16;
        fl.l_whence = libc::SEEK_SET as i16;
        // SAFETY: F_OFD_SETLK with a valid struct.
        unsafe { libc::fcntl(f.as_raw_fd(), libc::F_OFD_SETLK, &fl) }
    };
    ensure!(unlock(&one) == 0, "{}", std::io::Error::last_os_error());
    ensure!(lock(&two) == 0, "{}", std::io::Error::last_os_error());
    Ok(())
}

#[test]
fn nothing_stays_mounted_after_the_guard_or_the_daemon_goes() -> anyhow::Result<()> {
    privileged!();
    let path = {
        let fs = mount()?;
        ensure!(fs.mounted());
        std::fs::write(fs.path().join("f"), b"x")?;
        fs.path().to_path_buf()
    };
    ensure!(!is_mounted(&path), "{} still mounted", path.display());
    ensure!(!path.exists(), "{} not removed", path.display());

    // A daemon killed outright leaves a dead mount; the guard clears it.
    let path = {
        let fs = mount()?;
        let pid = fs.pid().context("no daemon")?;
        // SAFETY: plain kill(2) of our own child.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        std::thread::sleep(Duration::from_millis(100));
        fs.path().to_path_buf()
    };
    ensure!(!is_mounted(&path), "{} still mounted", path.display());
    ensure!(!path.exists(), "{} not removed", path.display());
    Ok(())
}
