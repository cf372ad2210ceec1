//! `lossyfs`: a FUSE file system for power-loss tests. It keeps every write
//! that `fsync`/`fdatasync` has not made durable, and every directory change
//! that an `fsync` of the directory has not, in memory only, and throws them
//! away when a test cuts the power (the way LazyFS is used to test etcd).
//! The durability model is `lockstep_tests::lossyfs::model`; the control
//! protocol is in the docs of `lockstep_tests::lossyfs`.
//!
//! ```text
//! lossyfs --control SOCKET [--verbose] MOUNTPOINT
//! ```
//!
//! FUSE as this serves it:
//!
//! - No writeback cache is negotiated and every file is opened `direct_io`:
//!   each `write` reaches this process before the syscall returns, and each
//!   `read` is served from the model, so the kernel's page cache can neither
//!   hide a write from a cut nor show a dropped one afterwards. Attributes
//!   and names are cached for 0 s for the same reason.
//! - `fsync` is implemented: were it answered `ENOSYS`, the kernel would
//!   take every later `fsync` as a success without asking. A write through
//!   an `O_SYNC`/`O_DSYNC` descriptor is durable when it returns.
//! - Locks (`flock`, `fcntl`) are not implemented, so the kernel keeps them
//!   locally, as on a local file system (redb locks its file).
//! - One request at a time, so a cut never races a write.
//! - An armed kill SIGKILLs the writer's whole process (the request carries
//!   the thread id; its `Tgid` names the process) inside the write request,
//!   then cuts, then fails the write with `EIO`. Requests that the killed
//!   process's other threads had queued and that still arrive are failed
//!   with `EIO` unapplied: nothing the process did after the crash point
//!   reaches the model.
//! - Mounted through `fusermount3` with `auto_unmount`, so the mount goes
//!   away even if this process is killed. SIGTERM, SIGINT and `quit` unmount
//!   cleanly (this process unmounts itself: fusermount3 only unmounts a file
//!   system whose daemon is gone).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc::{Sender, channel};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context, bail};
use fuser::{
    BsdFileFlags, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, Generation,
    INodeNo, KernelConfig, LockOwner, MountOption, OpenFlags, RenameFlags, ReplyAttr, ReplyCreate,
    ReplyData, ReplyDirectory, ReplyEmpty, ReplyEntry, ReplyOpen, ReplyStatfs, ReplyWrite, Request,
    SessionACL, TimeOrNow, WriteFlags,
};
use lockstep_tests::lossyfs::model::{self, Attr, Cut, Fs, Kind, Trigger, WriteOutcome};

/// Names and attributes are never cached: after a cut they change under the
/// kernel's feet.
const TTL: Duration = Duration::ZERO;

struct State {
    fs: Mutex<Fs>,
    /// Signalled when an armed kill fires.
    fired: Condvar,
    /// Threads of killed processes (thread id → start time, so a reused id
    /// is not mistaken for one of them).
    doomed: Mutex<HashMap<u32, u64>>,
    verbose: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl State {
    fn fs(&self) -> MutexGuard<'_, Fs> {
        lock(&self.fs)
    }

    /// Whether `pid` (a thread id) belongs to a process an armed kill hit.
    fn doomed(&self, pid: u32) -> bool {
        let mut doomed = lock(&self.doomed);
        let Some(&started) = doomed.get(&pid) else {
            return false;
        };
        if start_time(&format!("/proc/{pid}/stat")) == Some(started) {
            return true;
        }
        doomed.remove(&pid);
        false
    }

    /// SIGKILLs the process whose thread `tid` sent the request; returns its
    /// thread group id. Never this process.
    fn kill_writer(&self, tid: u32) -> u32 {
        let tgid = tgid_of(tid).unwrap_or(tid);
        if tgid == std::process::id() || tgid <= 1 {
            eprintln!("lossyfs: refusing to kill process {tgid}");
            return tgid;
        }
        let mut doomed = lock(&self.doomed);
        doomed.extend(threads(tgid));
        // SAFETY: plain kill(2).
        let rc = unsafe { libc::kill(tgid as i32, libc::SIGKILL) };
        if rc != 0 {
            eprintln!("lossyfs: kill {tgid}: {}", std::io::Error::last_os_error());
        }
        // Threads that were being made as the signal came.
        doomed.extend(threads(tgid));
        if self.verbose {
            eprintln!("lossyfs: killed process {tgid} (thread {tid})");
        }
        tgid
    }
}

/// The start time (clock ticks since boot) in a `/proc/.../stat` file.
fn start_time(path: &str) -> Option<u64> {
    let stat = std::fs::read_to_string(path).ok()?;
    // Fields after the command name, which is in parentheses and may hold
    // anything: state is field 3, start time field 22.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

fn tgid_of(tid: u32) -> Option<u32> {
    let status = std::fs::read_to_string(format!("/proc/{tid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("Tgid:"))?
        .trim()
        .parse()
        .ok()
}

/// Thread ids of process `tgid`, with their start times.
fn threads(tgid: u32) -> Vec<(u32, u64)> {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{tgid}/task")) else {
        return Vec::new();
    };
    dir.filter_map(Result::ok)
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|tid| Some((tid, start_time(&format!("/proc/{tgid}/task/{tid}/stat"))?)))
        .collect()
}

fn attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.atime,
        mtime: a.mtime,
        ctime: a.ctime,
        crtime: a.ctime,
        kind: kind(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: model::SECTOR as u32,
        flags: 0,
    }
}

fn kind(k: Kind) -> FileType {
    match k {
        Kind::File => FileType::RegularFile,
        Kind::Dir => FileType::Directory,
    }
}

fn errno(e: model::Errno) -> Errno {
    Errno::from_i32(e)
}

fn time(t: TimeOrNow) -> SystemTime {
    match t {
        TimeOrNow::SpecificTime(t) => t,
        TimeOrNow::Now => SystemTime::now(),
    }
}

struct LossyFs(Arc<State>);

impl LossyFs {
    fn entry(&self, r: Result<Attr, model::Errno>, reply: ReplyEntry) {
        match r {
            Ok(a) => reply.entry(&TTL, &attr(&a), Generation(0)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn empty(&self, r: Result<(), model::Errno>, reply: ReplyEmpty) {
        match r {
            Ok(()) => reply.ok(),
            Err(e) => reply.error(errno(e)),
        }
    }
}

impl Filesystem for LossyFs {
    fn init(&mut self, _req: &Request, _config: &mut KernelConfig) -> std::io::Result<()> {
        // fuser asks for neither writeback caching nor POSIX/flock locks:
        // writes go through, locks stay in the kernel.
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let r = self.0.fs().lookup(parent.0, name);
        self.entry(r, reply);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.0.fs().getattr(ino.0) {
            Ok(a) => reply.attr(&TTL, &attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn setattr(
        &self,
        req: &Request,
        ino: INodeNo,
        mode: Option<u32>,
        uid: Option<u32>,
        gid: Option<u32>,
        size: Option<u64>,
        atime: Option<TimeOrNow>,
        mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let mut fs = self.0.fs();
        let r = (|| {
            if let Some(len) = size {
                fs.set_len(ino.0, fh.map(|f| f.0), len)?;
            }
            fs.set_meta(
                ino.0,
                mode.map(|m| (m & 0o7777) as u16),
                uid,
                gid,
                atime.map(time),
                mtime.map(time),
            )?;
            fs.getattr(ino.0)
        })();
        match r {
            Ok(a) => reply.attr(&TTL, &attr(&a)),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn mknod(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        if mode & libc::S_IFMT != libc::S_IFREG && mode & libc::S_IFMT != 0 {
            return reply.error(Errno::EPERM);
        }
        let perm = (mode & !umask & 0o7777) as u16;
        let r = self
            .0
            .fs()
            .mknod(parent.0, name, perm, req.uid(), req.gid());
        self.entry(r, reply);
    }

    fn mkdir(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        reply: ReplyEntry,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let perm = (mode & !umask & 0o7777) as u16;
        let r = self
            .0
            .fs()
            .mkdir(parent.0, name, perm, req.uid(), req.gid());
        self.entry(r, reply);
    }

    fn unlink(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let r = self.0.fs().unlink(parent.0, name);
        self.empty(r, reply);
    }

    fn rmdir(&self, req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEmpty) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let r = self.0.fs().rmdir(parent.0, name);
        self.empty(r, reply);
    }

    fn rename(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        newparent: INodeNo,
        newname: &OsStr,
        flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        if flags.intersects(RenameFlags::RENAME_EXCHANGE | RenameFlags::RENAME_WHITEOUT) {
            return reply.error(Errno::EINVAL);
        }
        let noreplace = flags.contains(RenameFlags::RENAME_NOREPLACE);
        let r = self
            .0
            .fs()
            .rename(parent.0, name, newparent.0, newname, noreplace);
        self.empty(r, reply);
    }

    fn open(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.0.fs().open(ino.0, false) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::FOPEN_DIRECT_IO),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn create(
        &self,
        req: &Request,
        parent: INodeNo,
        name: &OsStr,
        mode: u32,
        umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let perm = (mode & !umask & 0o7777) as u16;
        let mut fs = self.0.fs();
        let r = fs
            .mknod(parent.0, name, perm, req.uid(), req.gid())
            .and_then(|a| Ok((a, fs.open(a.ino, false)?)));
        match r {
            Ok((a, fh)) => reply.created(
                &TTL,
                &attr(&a),
                Generation(0),
                FileHandle(fh),
                FopenFlags::FOPEN_DIRECT_IO,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        match self.0.fs().read(ino.0, fh.0, offset, size) {
            Ok(data) => reply.data(&data),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn write(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        data: &[u8],
        _write_flags: WriteFlags,
        flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let mut fs = self.0.fs();
        match fs.write(ino.0, fh.0, offset, data) {
            // O_SYNC, O_DSYNC (or RWF_DSYNC): durable when it returns.
            Ok(WriteOutcome::Written(n)) if flags.0 & (libc::O_SYNC | libc::O_DSYNC) != 0 => {
                match fs.fsync(ino.0, fh.0) {
                    Ok(()) => reply.written(n),
                    Err(e) => reply.error(errno(e)),
                }
            }
            Ok(WriteOutcome::Written(n)) => reply.written(n),
            Ok(WriteOutcome::Fire(cut)) => {
                let pid = self.0.kill_writer(req.pid());
                if let Some(cut) = cut {
                    let (dropped, kept) = fs.cut(cut);
                    if self.0.verbose {
                        eprintln!("lossyfs: cut {cut}: {dropped} bytes dropped, {kept} kept");
                    }
                }
                fs.fired(pid);
                self.0.fired.notify_all();
                reply.error(Errno::EIO);
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn flush(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        let r = self.0.fs().flush(ino.0, fh.0);
        self.empty(r, reply);
    }

    fn release(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        self.0.fs().release(fh.0);
        reply.ok();
    }

    fn fsync(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let r = self.0.fs().fsync(ino.0, fh.0);
        self.empty(r, reply);
    }

    fn opendir(&self, _req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.0.fs().open(ino.0, true) {
            Ok(fh) => reply.opened(FileHandle(fh), FopenFlags::empty()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.0.fs().readdir(ino.0, fh.0, offset) {
            Ok(entries) => {
                for (child, next, k, name) in entries {
                    if reply.add(INodeNo(child), next, kind(k), name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.0.fs().release(fh.0);
        reply.ok();
    }

    fn fsyncdir(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let r = self.0.fs().fsyncdir(ino.0, fh.0);
        self.empty(r, reply);
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        let (files, bytes) = self.0.fs().usage();
        let blocks: u64 = 1 << 22; // 16 GiB of 4 KiB blocks
        let used = bytes.div_ceil(model::SECTOR);
        let free = blocks.saturating_sub(used);
        reply.statfs(
            blocks,
            free,
            free,
            files,
            1 << 20,
            model::SECTOR as u32,
            255,
            model::SECTOR as u32,
        );
    }

    fn access(&self, _req: &Request, _ino: INodeNo, _mask: fuser::AccessFlags, reply: ReplyEmpty) {
        reply.ok();
    }

    fn fallocate(
        &self,
        req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        length: u64,
        mode: i32,
        reply: ReplyEmpty,
    ) {
        if self.0.doomed(req.pid()) {
            return reply.error(Errno::EIO);
        }
        let r = self.0.fs().fallocate(ino.0, fh.0, offset, length, mode);
        self.empty(r, reply);
    }
}

enum Event {
    Quit,
    Signal(i32),
    Ended(Option<std::io::Error>),
}

/// Answers one control line.
fn command(state: &State, line: &str, events: &Sender<Event>) -> String {
    let mut words = line.split_whitespace();
    match words.next() {
        Some("cut") => match Cut::parse(words) {
            Ok(cut) => {
                let (dropped, kept) = state.fs().cut(cut);
                if state.verbose {
                    eprintln!("lossyfs: cut {cut}: {dropped} bytes dropped, {kept} kept");
                }
                format!("ok dropped={dropped} kept={kept}")
            }
            Err(e) => format!("error: cut: {e}"),
        },
        Some("stats") => state.fs().stats().to_string(),
        Some("arm-kill") => {
            let (Some(name), Some(k)) = (words.next(), words.next()) else {
                return "error: arm-kill NAME K drop|none|torn SEED".into();
            };
            let Ok(k) = k.parse::<u64>() else {
                return format!("error: arm-kill: bad count {k:?}");
            };
            let rest: Vec<&str> = words.collect();
            let cut = if rest == ["none"] {
                None
            } else {
                match Cut::parse(rest.into_iter()) {
                    Ok(c) => Some(c),
                    Err(e) => return format!("error: arm-kill: {e} or 'none'"),
                }
            };
            state.fs().arm(OsStr::new(name), k, cut);
            "armed".into()
        }
        Some("fail-sync") => {
            let (Some(name), Some(k)) = (words.next(), words.next()) else {
                return "error: fail-sync NAME K".into();
            };
            let Ok(k) = k.parse::<u64>() else {
                return format!("error: fail-sync: bad count {k:?}");
            };
            state.fs().fail_sync(OsStr::new(name), k);
            "armed".into()
        }
        Some("wait-trigger") => {
            let limit = match words.next().map(str::parse::<u64>) {
                None => None,
                Some(Ok(ms)) => Some(Instant::now() + Duration::from_millis(ms)),
                Some(Err(_)) => return "error: wait-trigger [MS]".into(),
            };
            let mut fs = state.fs();
            loop {
                match fs.trigger() {
                    Trigger::Idle => return "not-fired".into(),
                    Trigger::Fired { .. } => {
                        let Trigger::Fired { pid } = fs.take_trigger() else {
                            unreachable!("checked above")
                        };
                        return format!("fired pid={pid}");
                    }
                    Trigger::Armed(_) => {}
                }
                fs = match limit {
                    None => state.fired.wait(fs).unwrap_or_else(PoisonError::into_inner),
                    Some(deadline) => {
                        let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                            return "not-fired".into();
                        };
                        state
                            .fired
                            .wait_timeout(fs, left)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0
                    }
                };
            }
        }
        Some("disarm") => match state.fs().take_trigger() {
            Trigger::Idle => "idle".into(),
            Trigger::Armed(_) => "disarmed".into(),
            Trigger::Fired { pid } => format!("fired pid={pid}"),
        },
        Some("ping") => "pong".into(),
        Some("quit") => {
            let _ = events.send(Event::Quit);
            "bye".into()
        }
        _ => format!("error: unknown command {line:?}"),
    }
}

fn serve(state: &State, stream: UnixStream, events: &Sender<Event>) -> std::io::Result<()> {
    let mut line = String::new();
    BufReader::new(&stream).read_line(&mut line)?;
    let answer = command(state, line.trim(), events);
    let mut stream = stream;
    writeln!(stream, "{answer}")
}

struct Args {
    control: PathBuf,
    mountpoint: PathBuf,
    verbose: bool,
}

fn args() -> anyhow::Result<Args> {
    let mut control = None;
    let mut mountpoint = None;
    let mut verbose = false;
    let mut it = std::env::args_os().skip(1);
    while let Some(a) = it.next() {
        match a.to_str() {
            Some("--control") => {
                control = Some(PathBuf::from(it.next().context("--control PATH")?))
            }
            Some("--verbose") => verbose = true,
            Some(flag) if flag.starts_with('-') => bail!("unknown flag {flag}"),
            _ if mountpoint.is_none() => mountpoint = Some(PathBuf::from(a)),
            _ => bail!("usage: lossyfs --control SOCKET [--verbose] MOUNTPOINT"),
        }
    }
    Ok(Args {
        control: control.context("usage: lossyfs --control SOCKET [--verbose] MOUNTPOINT")?,
        mountpoint: mountpoint.context("usage: lossyfs --control SOCKET [--verbose] MOUNTPOINT")?,
        verbose,
    })
}

/// Blocks the termination signals in this thread and every thread started
/// after, so one thread can take them with `sigwait`.
fn block_signals() -> anyhow::Result<libc::sigset_t> {
    // SAFETY: sigset_t is plain data, initialised by sigemptyset.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        for sig in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
            libc::sigaddset(&mut set, sig);
        }
        let rc = libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        if rc != 0 {
            bail!("pthread_sigmask: {}", std::io::Error::from_raw_os_error(rc));
        }
        Ok(set)
    }
}

/// Unmounts: plainly, or lazily when something still holds a file open (the
/// session ends once the kernel lets go).
fn unmount(path: &std::path::Path) {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return;
    };
    // SAFETY: a valid C string.
    if unsafe { libc::umount2(c.as_ptr(), 0) } == 0 {
        return;
    }
    let e = std::io::Error::last_os_error();
    // SAFETY: as above.
    if e.raw_os_error() == Some(libc::EBUSY)
        && unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) } == 0
    {
        return;
    }
    eprintln!("lossyfs: unmounting {}: {e}", path.display());
}

fn run() -> anyhow::Result<()> {
    let mut args = args()?;
    args.mountpoint = args
        .mountpoint
        .canonicalize()
        .with_context(|| format!("mount point {}", args.mountpoint.display()))?;
    let signals = block_signals()?;
    // SAFETY: no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let state = Arc::new(State {
        fs: Mutex::new(Fs::new(uid, gid)),
        fired: Condvar::new(),
        doomed: Mutex::new(HashMap::new()),
        verbose: args.verbose,
    });
    let mut config = fuser::Config::default();
    config.mount_options = vec![
        MountOption::FSName("lossyfs".into()),
        MountOption::Subtype("lossyfs".into()),
        // fusermount3 stays behind and unmounts when this process dies.
        MountOption::AutoUnmount,
    ];
    config.acl = SessionACL::RootAndOwner;
    config.n_threads = Some(1);
    let mut session = fuser::Session::new(LossyFs(state.clone()), &args.mountpoint, &config)
        .with_context(|| {
            format!(
                "mounting on {} (needs /dev/fuse and fusermount3 from Debian's fuse3: cargo xtask setup)",
                args.mountpoint.display()
            )
        })?;
    let mut unmounter = session.unmount_callable();
    let (events, rx) = channel();
    {
        let events = events.clone();
        std::thread::Builder::new()
            .name("session".into())
            .spawn(move || {
                let _ = events.send(Event::Ended(session.run().err()));
            })?;
    }
    {
        let events = events.clone();
        std::thread::Builder::new()
            .name("signals".into())
            .spawn(move || {
                let mut sig = 0;
                // SAFETY: a valid, blocked set and an out-pointer.
                if unsafe { libc::sigwait(&signals, &mut sig) } == 0 {
                    let _ = events.send(Event::Signal(sig));
                }
            })?;
    }
    let _ = std::fs::remove_file(&args.control);
    let listener = UnixListener::bind(&args.control)
        .with_context(|| format!("binding {}", args.control.display()))?;
    {
        let (state, events) = (state.clone(), events.clone());
        std::thread::Builder::new()
            .name("control".into())
            .spawn(move || {
                for stream in listener.incoming().flatten() {
                    let (state, events) = (state.clone(), events.clone());
                    let _ = std::thread::Builder::new()
                        .name("control-conn".into())
                        .spawn(move || serve(&state, stream, &events));
                }
            })?;
    }
    drop(events);
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "mounted")?;
        out.flush()?;
    }
    let ended = match rx.recv() {
        Ok(Event::Ended(e)) => Some(e),
        Ok(Event::Quit) => None,
        Ok(Event::Signal(sig)) => {
            if args.verbose {
                eprintln!("lossyfs: signal {sig}; unmounting");
            }
            None
        }
        Err(_) => None,
    };
    let result = match ended {
        Some(e) => e,
        None => {
            unmount(&args.mountpoint);
            // Closes the socket fusermount3 waits on; it unmounts only a
            // file system whose daemon is gone, so the unmount above is ours.
            if let Err(e) = unmounter.unmount() {
                eprintln!("lossyfs: unmount: {e}");
            }
            // The session ends once the kernel has let go of the mount.
            let deadline = Instant::now() + Duration::from_secs(5);
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match rx.recv_timeout(left) {
                    Ok(Event::Ended(e)) => break e,
                    Ok(_) => continue,
                    Err(_) => {
                        eprintln!("lossyfs: the session did not end within 5 s of unmounting");
                        break None;
                    }
                }
            }
        }
    };
    let _ = std::fs::remove_file(&args.control);
    if let Some(e) = result {
        bail!("session: {e}");
    }
    Ok(())
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("lossyfs: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_time_skips_a_command_name_with_spaces_and_parentheses() {
        let dir = std::env::temp_dir().join(format!("lossyfs-stat-{}", std::process::id()));
        let fields: Vec<String> = (3..=22).map(|n| n.to_string()).collect();
        std::fs::write(&dir, format!("42 (a) b (c) {}", fields.join(" "))).unwrap();
        assert_eq!(start_time(dir.to_str().unwrap()), Some(22));
        std::fs::remove_file(&dir).unwrap();
    }
}
