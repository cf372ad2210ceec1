//! The durability model of `lossyfs`: an in-memory file system that keeps
//! what was made durable apart from what was only written, and can lose the
//! difference the way a machine losing power does.
//!
//! Harsh on purpose, like LazyFS (used to test etcd this way):
//!
//! - A file has a *durable* image and a *current* one. Reads see the current
//!   image; `fsync` and `fdatasync` make the file's current content and size
//!   durable, nothing else.
//! - Every directory has durable and current entries. Creating, unlinking,
//!   renaming and `mkdir` change the current entries; only an `fsync` of the
//!   directory itself makes them durable (all of that directory's entries:
//!   the names, not the unsynced data of the files they name). An `fsync` of
//!   a new file does not make its name durable.
//! - A [`Cut`] reverts every file and directory to its durable state. A torn
//!   cut first keeps a random subset of the unsynced writes, each split into
//!   4 KiB-aligned pieces that are kept or lost independently (a disk that
//!   persisted some of the unsynced sectors, in any order); size changes are
//!   kept or lost as a whole.
//! - A cut invalidates every open handle: a process that still holds one
//!   (the kernel releases a killed process's files later) gets `EIO` and can
//!   never write dropped data back.
//!
//! Pure: no FUSE, no syscalls; the `lossyfs` binary puts it behind FUSE.
//! Errors are `errno` values.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::time::SystemTime;

/// An `errno` value.
pub type Errno = i32;

/// Piece size of a torn cut: what a disk writes atomically.
pub const SECTOR: u64 = 4096;
/// The root directory's inode number (FUSE's).
pub const ROOT: u64 = 1;
const NAME_MAX: usize = 255;

/// How power is cut.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cut {
    /// Everything not durable is lost.
    Drop,
    /// Each 4 KiB piece of each unsynced write survives or not, at random
    /// (splitmix64 from this seed); each unsynced size change as a whole.
    Torn(u64),
}

impl Cut {
    /// Parses `drop` or `torn SEED` (the words after `cut`).
    ///
    /// # Errors
    /// Anything else; the message says what is accepted.
    pub fn parse<'a>(mut words: impl Iterator<Item = &'a str>) -> Result<Self, String> {
        match (words.next(), words.next(), words.next()) {
            (Some("drop"), None, _) => Ok(Self::Drop),
            (Some("torn"), Some(seed), None) => seed
                .parse()
                .map(Self::Torn)
                .map_err(|_| format!("bad seed {seed:?}")),
            _ => Err("expected 'drop' or 'torn SEED'".into()),
        }
    }
}

impl std::fmt::Display for Cut {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Drop => write!(f, "drop"),
            Self::Torn(seed) => write!(f, "torn {seed}"),
        }
    }
}

/// What kind of inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A regular file.
    File,
    /// A directory.
    Dir,
}

/// Attributes of an inode, as `getattr` reports them.
#[derive(Clone, Copy, Debug)]
pub struct Attr {
    /// Inode number.
    pub ino: u64,
    /// File or directory.
    pub kind: Kind,
    /// Current size.
    pub size: u64,
    /// Permission bits.
    pub perm: u16,
    /// Current names (files), 2 + subdirectories (directories).
    pub nlink: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Last access.
    pub atime: SystemTime,
    /// Last modification.
    pub mtime: SystemTime,
    /// Last change.
    pub ctime: SystemTime,
}

/// An unsynced change to a file's content, in the order it was made.
#[derive(Clone, Debug)]
enum Op {
    Write { offset: u64, data: Vec<u8> },
    SetLen(u64),
}

fn apply(image: &mut Vec<u8>, op: &Op) {
    match op {
        Op::Write { offset, data } => {
            let (start, end) = (*offset as usize, *offset as usize + data.len());
            if image.len() < end {
                image.resize(end, 0);
            }
            image[start..end].copy_from_slice(data);
        }
        Op::SetLen(len) => image.resize(*len as usize, 0),
    }
}

#[derive(Debug)]
enum Node {
    File {
        current: Vec<u8>,
        durable: Vec<u8>,
        /// What turns `durable` into `current`.
        pending: Vec<Op>,
    },
    Dir {
        current: BTreeMap<OsString, u64>,
        durable: BTreeMap<OsString, u64>,
        parent: u64,
    },
}

#[derive(Debug)]
struct Inode {
    node: Node,
    perm: u16,
    uid: u32,
    gid: u32,
    atime: SystemTime,
    mtime: SystemTime,
    ctime: SystemTime,
    /// The name it was last given (what an armed kill matches).
    name: OsString,
    /// Open handles.
    open: u32,
    /// Current names (recounted after namespace changes).
    nlink: u32,
}

impl Inode {
    fn new(node: Node, perm: u16, uid: u32, gid: u32, name: &OsStr) -> Self {
        let now = SystemTime::now();
        Self {
            node,
            perm,
            uid,
            gid,
            atime: now,
            mtime: now,
            ctime: now,
            name: name.to_os_string(),
            open: 0,
            nlink: 0,
        }
    }

    fn kind(&self) -> Kind {
        match self.node {
            Node::File { .. } => Kind::File,
            Node::Dir { .. } => Kind::Dir,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Handle {
    ino: u64,
}

/// Counters, as `stats` reports them.
#[derive(Clone, Copy, Debug, Default)]
pub struct Stats {
    /// Write requests.
    pub writes: u64,
    /// Bytes written.
    pub bytes_written: u64,
    /// File syncs (`fsync`, `fdatasync`).
    pub fsyncs: u64,
    /// Directory syncs.
    pub fsyncdirs: u64,
    /// Power cuts.
    pub cuts: u64,
    /// Unsynced bytes lost in cuts.
    pub dropped_bytes: u64,
    /// Unsynced bytes a torn cut kept.
    pub kept_bytes: u64,
    /// Unsynced namespace changes lost in cuts (directories whose entries
    /// reverted).
    pub dropped_dirs: u64,
    /// Armed kills that fired.
    pub kills: u64,
    /// Armed sync failures that fired.
    pub failed_syncs: u64,
}

impl std::fmt::Display for Stats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "writes={} bytes_written={} fsyncs={} fsyncdirs={} cuts={} dropped_bytes={} kept_bytes={} dropped_dirs={} kills={} failed_syncs={}",
            self.writes,
            self.bytes_written,
            self.fsyncs,
            self.fsyncdirs,
            self.cuts,
            self.dropped_bytes,
            self.kept_bytes,
            self.dropped_dirs,
            self.kills,
            self.failed_syncs
        )
    }
}

/// An armed kill: the `k`-th write to a file named `name` kills its writer,
/// then `cut` (if any) happens.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Armed {
    /// The file name (last component) to watch.
    pub name: OsString,
    /// Which write fires (1 = the first after arming).
    pub k: u64,
    /// Writes seen so far.
    pub seen: u64,
    /// The cut after the kill; `None`: a plain crash, the page cache intact.
    pub cut: Option<Cut>,
}

/// The kill trigger's state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Trigger {
    /// Nothing armed.
    #[default]
    Idle,
    /// Waiting for its write.
    Armed(Armed),
    /// Fired: the writer's process id.
    Fired {
        /// The killed process (thread group id).
        pid: u32,
    },
}

/// What a write request does.
#[derive(Debug, PartialEq, Eq)]
pub enum WriteOutcome {
    /// Applied; this many bytes.
    Written(u32),
    /// Not applied: the armed trigger fires on it. The caller kills the
    /// writer, performs the cut (if any) and calls [`Fs::fired`].
    Fire(Option<Cut>),
}

/// An armed sync failure: the `k`-th `fsync`/`fdatasync` of a file named
/// `name` fails with `EIO`, as a disk's write error reaches the syncer on
/// Linux: what it had not made durable is never made durable (the pages
/// are marked clean, a later sync does not write them), but stays readable
/// until the power is cut.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SyncFault {
    /// The file name (last component) to watch.
    pub name: OsString,
    /// Which sync fails (1 = the first after arming).
    pub k: u64,
    /// Syncs seen so far.
    pub seen: u64,
}

/// The file system.
#[derive(Debug)]
pub struct Fs {
    inodes: HashMap<u64, Inode>,
    next_ino: u64,
    handles: HashMap<u64, Handle>,
    next_fh: u64,
    stats: Stats,
    trigger: Trigger,
    sync_fault: Option<SyncFault>,
}

/// splitmix64, for torn cuts.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn coin(&mut self) -> bool {
        self.next() & 1 == 1
    }
}

impl Default for Fs {
    fn default() -> Self {
        Self::new(0, 0)
    }
}

impl Fs {
    /// An empty file system whose root belongs to `uid`/`gid`; the root
    /// directory itself is durable.
    pub fn new(uid: u32, gid: u32) -> Self {
        let root = Inode::new(
            Node::Dir {
                current: BTreeMap::new(),
                durable: BTreeMap::new(),
                parent: ROOT,
            },
            0o755,
            uid,
            gid,
            OsStr::new("/"),
        );
        let mut fs = Self {
            inodes: HashMap::from([(ROOT, root)]),
            next_ino: ROOT + 1,
            handles: HashMap::new(),
            next_fh: 1,
            stats: Stats::default(),
            trigger: Trigger::Idle,
            sync_fault: None,
        };
        fs.relink();
        fs
    }

    /// The counters.
    pub fn stats(&self) -> Stats {
        self.stats
    }

    fn inode(&self, ino: u64) -> Result<&Inode, Errno> {
        self.inodes.get(&ino).ok_or(libc::ENOENT)
    }

    fn inode_mut(&mut self, ino: u64) -> Result<&mut Inode, Errno> {
        self.inodes.get_mut(&ino).ok_or(libc::ENOENT)
    }

    fn attr_of(&self, ino: u64, i: &Inode) -> Attr {
        let size = match &i.node {
            Node::File { current, .. } => current.len() as u64,
            Node::Dir { current, .. } => current.len() as u64,
        };
        Attr {
            ino,
            kind: i.kind(),
            size,
            perm: i.perm,
            nlink: i.nlink,
            uid: i.uid,
            gid: i.gid,
            atime: i.atime,
            mtime: i.mtime,
            ctime: i.ctime,
        }
    }

    /// Attributes of `ino`.
    ///
    /// # Errors
    /// `ENOENT`: no such inode (any more).
    pub fn getattr(&self, ino: u64) -> Result<Attr, Errno> {
        Ok(self.attr_of(ino, self.inode(ino)?))
    }

    fn entries(&self, dir: u64) -> Result<&BTreeMap<OsString, u64>, Errno> {
        match &self.inode(dir)?.node {
            Node::Dir { current, .. } => Ok(current),
            Node::File { .. } => Err(libc::ENOTDIR),
        }
    }

    fn entries_mut(&mut self, dir: u64) -> Result<&mut BTreeMap<OsString, u64>, Errno> {
        match &mut self.inode_mut(dir)?.node {
            Node::Dir { current, .. } => Ok(current),
            Node::File { .. } => Err(libc::ENOTDIR),
        }
    }

    /// The inode `name` in `parent` names now.
    ///
    /// # Errors
    /// `ENOENT`, `ENOTDIR`.
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Attr, Errno> {
        let ino = *self.entries(parent)?.get(name).ok_or(libc::ENOENT)?;
        self.getattr(ino)
    }

    fn check_name(name: &OsStr) -> Result<(), Errno> {
        if name.len() > NAME_MAX {
            return Err(libc::ENAMETOOLONG);
        }
        if name.is_empty() || name == "." || name == ".." || name.as_encoded_bytes().contains(&b'/')
        {
            return Err(libc::EINVAL);
        }
        Ok(())
    }

    fn add(
        &mut self,
        parent: u64,
        name: &OsStr,
        node: Node,
        perm: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        Self::check_name(name)?;
        if self.entries(parent)?.contains_key(name) {
            return Err(libc::EEXIST);
        }
        let ino = self.next_ino;
        self.next_ino += 1;
        self.inodes
            .insert(ino, Inode::new(node, perm, uid, gid, name));
        self.entries_mut(parent)?.insert(name.to_os_string(), ino);
        self.touch_dir(parent);
        self.relink();
        self.getattr(ino)
    }

    fn touch_dir(&mut self, dir: u64) {
        if let Some(i) = self.inodes.get_mut(&dir) {
            let now = SystemTime::now();
            i.mtime = now;
            i.ctime = now;
        }
    }

    /// Creates an empty regular file (its name not durable yet, its durable
    /// content empty).
    ///
    /// # Errors
    /// `EEXIST`, `ENOENT`, `ENOTDIR`, `ENAMETOOLONG`, `EINVAL`.
    pub fn mknod(
        &mut self,
        parent: u64,
        name: &OsStr,
        perm: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        let node = Node::File {
            current: Vec::new(),
            durable: Vec::new(),
            pending: Vec::new(),
        };
        self.add(parent, name, node, perm, uid, gid)
    }

    /// Creates a directory (its name not durable yet).
    ///
    /// # Errors
    /// As [`Fs::mknod`].
    pub fn mkdir(
        &mut self,
        parent: u64,
        name: &OsStr,
        perm: u16,
        uid: u32,
        gid: u32,
    ) -> Result<Attr, Errno> {
        let node = Node::Dir {
            current: BTreeMap::new(),
            durable: BTreeMap::new(),
            parent,
        };
        self.add(parent, name, node, perm, uid, gid)
    }

    /// Removes a file's name (the file lives on while open or while a
    /// durable entry still names it).
    ///
    /// # Errors
    /// `ENOENT`, `EISDIR`, `ENOTDIR`.
    pub fn unlink(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        let ino = *self.entries(parent)?.get(name).ok_or(libc::ENOENT)?;
        if self.inode(ino)?.kind() == Kind::Dir {
            return Err(libc::EISDIR);
        }
        self.entries_mut(parent)?.remove(name);
        self.touch_dir(parent);
        if let Ok(i) = self.inode_mut(ino) {
            i.ctime = SystemTime::now();
        }
        self.collect();
        Ok(())
    }

    /// Removes an empty directory.
    ///
    /// # Errors
    /// `ENOENT`, `ENOTDIR`, `ENOTEMPTY`.
    pub fn rmdir(&mut self, parent: u64, name: &OsStr) -> Result<(), Errno> {
        let ino = *self.entries(parent)?.get(name).ok_or(libc::ENOENT)?;
        if !self.entries(ino)?.is_empty() {
            return Err(libc::ENOTEMPTY);
        }
        self.entries_mut(parent)?.remove(name);
        self.touch_dir(parent);
        self.collect();
        Ok(())
    }

    /// Renames (replacing the target unless `noreplace`).
    ///
    /// # Errors
    /// `ENOENT`, `EEXIST` (`noreplace`), `EISDIR`, `ENOTDIR`, `ENOTEMPTY`,
    /// `EINVAL`.
    pub fn rename(
        &mut self,
        parent: u64,
        name: &OsStr,
        new_parent: u64,
        new_name: &OsStr,
        noreplace: bool,
    ) -> Result<(), Errno> {
        Self::check_name(new_name)?;
        let ino = *self.entries(parent)?.get(name).ok_or(libc::ENOENT)?;
        let kind = self.inode(ino)?.kind();
        if let Some(&target) = self.entries(new_parent)?.get(new_name) {
            if target == ino {
                return Ok(());
            }
            if noreplace {
                return Err(libc::EEXIST);
            }
            match (kind, self.inode(target)?.kind()) {
                (Kind::File, Kind::Dir) => return Err(libc::EISDIR),
                (Kind::Dir, Kind::File) => return Err(libc::ENOTDIR),
                (Kind::Dir, Kind::Dir) if !self.entries(target)?.is_empty() => {
                    return Err(libc::ENOTEMPTY);
                }
                _ => {}
            }
        }
        if kind == Kind::Dir {
            // Not into itself or its own subtree.
            let mut at = new_parent;
            loop {
                if at == ino {
                    return Err(libc::EINVAL);
                }
                match &self.inode(at)?.node {
                    Node::Dir { parent, .. } if at != ROOT => at = *parent,
                    _ => break,
                }
            }
        }
        self.entries_mut(parent)?.remove(name);
        self.entries_mut(new_parent)?
            .insert(new_name.to_os_string(), ino);
        self.touch_dir(parent);
        self.touch_dir(new_parent);
        let i = self.inode_mut(ino)?;
        i.name = new_name.to_os_string();
        i.ctime = SystemTime::now();
        if let Node::Dir { parent, .. } = &mut i.node {
            *parent = new_parent;
        }
        self.collect();
        Ok(())
    }

    /// Opens `ino` (a file, or with `dir` a directory); returns the handle.
    ///
    /// # Errors
    /// `ENOENT`, `EISDIR` (a directory opened as a file), `ENOTDIR`.
    pub fn open(&mut self, ino: u64, dir: bool) -> Result<u64, Errno> {
        let i = self.inode_mut(ino)?;
        match (i.kind(), dir) {
            (Kind::Dir, false) => return Err(libc::EISDIR),
            (Kind::File, true) => return Err(libc::ENOTDIR),
            _ => {}
        }
        i.open += 1;
        let fh = self.next_fh;
        self.next_fh += 1;
        self.handles.insert(fh, Handle { ino });
        Ok(fh)
    }

    /// The inode behind a live handle. Handles from before a cut are gone:
    /// `EIO`, so a dead process's descriptor cannot bring back what the cut
    /// dropped.
    fn handle(&self, fh: u64, ino: u64) -> Result<u64, Errno> {
        match self.handles.get(&fh) {
            Some(h) if h.ino == ino => Ok(ino),
            Some(_) => Err(libc::EBADF),
            None => Err(libc::EIO),
        }
    }

    /// Closes a handle (also one a cut made stale).
    pub fn release(&mut self, fh: u64) {
        if let Some(h) = self.handles.remove(&fh) {
            if let Some(i) = self.inodes.get_mut(&h.ino) {
                i.open = i.open.saturating_sub(1);
            }
            self.collect();
        }
    }

    /// What `close` asks: `EIO` on a stale handle, else nothing to do.
    ///
    /// # Errors
    /// `EIO`: the handle is from before a cut.
    pub fn flush(&self, ino: u64, fh: u64) -> Result<(), Errno> {
        self.handle(fh, ino).map(|_| ())
    }

    fn file_mut(&mut self, ino: u64) -> Result<(&mut Vec<u8>, &mut Vec<Op>), Errno> {
        match &mut self.inode_mut(ino)?.node {
            Node::File {
                current, pending, ..
            } => Ok((current, pending)),
            Node::Dir { .. } => Err(libc::EISDIR),
        }
    }

    /// Reads from the current image.
    ///
    /// # Errors
    /// `EIO` (stale handle), `EISDIR`.
    pub fn read(&mut self, ino: u64, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, Errno> {
        self.handle(fh, ino)?;
        let i = self.inode_mut(ino)?;
        i.atime = SystemTime::now();
        let Node::File { current, .. } = &i.node else {
            return Err(libc::EISDIR);
        };
        let start = (offset as usize).min(current.len());
        let end = (offset as usize)
            .saturating_add(size as usize)
            .min(current.len());
        Ok(current[start..end].to_vec())
    }

    /// A write request from process `pid` (only for the counters' sake
    /// here): applied to the current image, or, when it is the armed
    /// trigger's, not applied and reported as [`WriteOutcome::Fire`].
    ///
    /// # Errors
    /// `EIO` (stale handle), `EISDIR`, `EFBIG`.
    pub fn write(
        &mut self,
        ino: u64,
        fh: u64,
        offset: u64,
        data: &[u8],
    ) -> Result<WriteOutcome, Errno> {
        self.handle(fh, ino)?;
        if offset
            .checked_add(data.len() as u64)
            .is_none_or(|end| end > 1 << 40)
        {
            return Err(libc::EFBIG);
        }
        self.stats.writes += 1;
        if let Trigger::Armed(armed) = &mut self.trigger
            && self.inodes.get(&ino).is_some_and(|i| i.name == armed.name)
        {
            armed.seen += 1;
            if armed.seen >= armed.k {
                return Ok(WriteOutcome::Fire(armed.cut));
            }
        }
        let (current, pending) = self.file_mut(ino)?;
        let op = Op::Write {
            offset,
            data: data.to_vec(),
        };
        apply(current, &op);
        pending.push(op);
        self.stats.bytes_written += data.len() as u64;
        let i = self.inode_mut(ino)?;
        let now = SystemTime::now();
        i.mtime = now;
        i.ctime = now;
        Ok(WriteOutcome::Written(data.len() as u32))
    }

    /// Truncates or extends (`truncate`, `ftruncate`; `fh` when there is
    /// one, which must be live).
    ///
    /// # Errors
    /// `EIO` (stale handle), `EISDIR`, `EFBIG`.
    pub fn set_len(&mut self, ino: u64, fh: Option<u64>, len: u64) -> Result<(), Errno> {
        if let Some(fh) = fh {
            self.handle(fh, ino)?;
        }
        if len > 1 << 40 {
            return Err(libc::EFBIG);
        }
        let (current, pending) = self.file_mut(ino)?;
        if current.len() as u64 != len {
            let op = Op::SetLen(len);
            apply(current, &op);
            pending.push(op);
        }
        let i = self.inode_mut(ino)?;
        let now = SystemTime::now();
        i.mtime = now;
        i.ctime = now;
        Ok(())
    }

    /// Changes mode, owner or times (not modelled as durable or not).
    ///
    /// # Errors
    /// `ENOENT`.
    pub fn set_meta(
        &mut self,
        ino: u64,
        perm: Option<u16>,
        uid: Option<u32>,
        gid: Option<u32>,
        atime: Option<SystemTime>,
        mtime: Option<SystemTime>,
    ) -> Result<(), Errno> {
        let i = self.inode_mut(ino)?;
        if let Some(p) = perm {
            i.perm = p & 0o7777;
        }
        if let Some(u) = uid {
            i.uid = u;
        }
        if let Some(g) = gid {
            i.gid = g;
        }
        if let Some(t) = atime {
            i.atime = t;
        }
        if let Some(t) = mtime {
            i.mtime = t;
        }
        i.ctime = SystemTime::now();
        Ok(())
    }

    /// `fallocate`: mode 0 extends the size (zeros), `FALLOC_FL_KEEP_SIZE`
    /// changes nothing visible; other modes are not supported.
    ///
    /// # Errors
    /// `EIO` (stale handle), `EOPNOTSUPP`, `EISDIR`, `EFBIG`.
    pub fn fallocate(
        &mut self,
        ino: u64,
        fh: u64,
        offset: u64,
        len: u64,
        mode: i32,
    ) -> Result<(), Errno> {
        self.handle(fh, ino)?;
        let end = offset.checked_add(len).ok_or(libc::EFBIG)?;
        match mode {
            0 => {
                let size = self.getattr(ino)?.size;
                if end > size {
                    self.set_len(ino, Some(fh), end)?;
                }
                Ok(())
            }
            libc::FALLOC_FL_KEEP_SIZE => Ok(()),
            _ => Err(libc::EOPNOTSUPP),
        }
    }

    /// `fsync`/`fdatasync` of a file: its current content and size become
    /// durable (its name does not).
    ///
    /// # Errors
    /// `EIO` (stale handle), `EISDIR`.
    pub fn fsync(&mut self, ino: u64, fh: u64) -> Result<(), Errno> {
        self.handle(fh, ino)?;
        self.stats.fsyncs += 1;
        let fails = match &mut self.sync_fault {
            Some(fault) if self.inodes.get(&ino).is_some_and(|i| i.name == fault.name) => {
                fault.seen += 1;
                fault.seen >= fault.k
            }
            _ => false,
        };
        if fails {
            self.sync_fault = None;
            self.stats.failed_syncs += 1;
            if let Node::File { pending, .. } = &mut self.inode_mut(ino)?.node {
                pending.clear();
            }
            return Err(libc::EIO);
        }
        match &mut self.inode_mut(ino)?.node {
            Node::File {
                durable, pending, ..
            } => {
                for op in pending.drain(..) {
                    apply(durable, &op);
                }
                Ok(())
            }
            Node::Dir { .. } => Err(libc::EISDIR),
        }
    }

    /// `fsync` of a directory: all its current entries become durable (the
    /// names, not the data of the files they name).
    ///
    /// # Errors
    /// `EIO` (stale handle), `ENOTDIR`.
    pub fn fsyncdir(&mut self, ino: u64, fh: u64) -> Result<(), Errno> {
        self.handle(fh, ino)?;
        self.stats.fsyncdirs += 1;
        match &mut self.inode_mut(ino)?.node {
            Node::Dir {
                current, durable, ..
            } => durable.clone_from(current),
            Node::File { .. } => return Err(libc::ENOTDIR),
        }
        self.collect();
        Ok(())
    }

    /// Directory entries from `offset` on (`.` and `..` first), each with the
    /// offset of the next.
    ///
    /// # Errors
    /// `EIO` (stale handle), `ENOTDIR`.
    pub fn readdir(
        &self,
        ino: u64,
        fh: u64,
        offset: u64,
    ) -> Result<Vec<(u64, u64, Kind, OsString)>, Errno> {
        self.handle(fh, ino)?;
        let Node::Dir {
            current, parent, ..
        } = &self.inode(ino)?.node
        else {
            return Err(libc::ENOTDIR);
        };
        let mut all = vec![
            (ino, Kind::Dir, OsString::from(".")),
            (*parent, Kind::Dir, OsString::from("..")),
        ];
        for (name, child) in current {
            let kind = self.inode(*child).map(Inode::kind).unwrap_or(Kind::File);
            all.push((*child, kind, name.clone()));
        }
        Ok(all
            .into_iter()
            .enumerate()
            .skip(offset as usize)
            .map(|(n, (ino, kind, name))| (ino, n as u64 + 1, kind, name))
            .collect())
    }

    /// Inodes and bytes, for `statfs`.
    pub fn usage(&self) -> (u64, u64) {
        let bytes = self
            .inodes
            .values()
            .map(|i| match &i.node {
                Node::File { current, .. } => current.len() as u64,
                Node::Dir { .. } => 0,
            })
            .sum();
        (self.inodes.len() as u64, bytes)
    }

    /// Cuts the power: every file and directory reverts to its durable state
    /// (with [`Cut::Torn`], plus a random part of the unsynced writes), which
    /// is then both durable and current; every handle goes stale. Returns
    /// the bytes lost and kept.
    pub fn cut(&mut self, how: Cut) -> (u64, u64) {
        let mut rng = Rng(match how {
            Cut::Drop => 0,
            Cut::Torn(seed) => seed,
        });
        let (mut dropped, mut kept) = (0u64, 0u64);
        let mut inos: Vec<u64> = self.inodes.keys().copied().collect();
        // The same seed tears the same way.
        inos.sort_unstable();
        for ino in inos {
            let Some(i) = self.inodes.get_mut(&ino) else {
                continue;
            };
            i.open = 0;
            match &mut i.node {
                Node::File {
                    current,
                    durable,
                    pending,
                } => {
                    for op in pending.drain(..) {
                        match (&op, how) {
                            (Op::Write { data, .. }, Cut::Drop) => dropped += data.len() as u64,
                            (Op::SetLen(_), Cut::Drop) => {}
                            (Op::Write { offset, data }, Cut::Torn(_)) => {
                                let mut at = 0usize;
                                while at < data.len() {
                                    let abs = offset + at as u64;
                                    let next = ((abs / SECTOR + 1) * SECTOR - offset) as usize;
                                    let end = next.min(data.len());
                                    if rng.coin() {
                                        let piece = Op::Write {
                                            offset: abs,
                                            data: data[at..end].to_vec(),
                                        };
                                        apply(durable, &piece);
                                        kept += (end - at) as u64;
                                    } else {
                                        dropped += (end - at) as u64;
                                    }
                                    at = end;
                                }
                            }
                            (Op::SetLen(_), Cut::Torn(_)) => {
                                if rng.coin() {
                                    apply(durable, &op);
                                }
                            }
                        }
                    }
                    current.clone_from(durable);
                }
                Node::Dir {
                    current, durable, ..
                } => {
                    if current != durable {
                        self.stats.dropped_dirs += 1;
                        current.clone_from(durable);
                    }
                }
            }
        }
        self.handles.clear();
        self.collect();
        // Directories' parents as the durable tree has them.
        let mut stack = vec![ROOT];
        let mut parents = Vec::new();
        while let Some(dir) = stack.pop() {
            if let Some(Inode {
                node: Node::Dir { current, .. },
                ..
            }) = self.inodes.get(&dir)
            {
                for child in current.values() {
                    if matches!(self.inodes.get(child).map(Inode::kind), Some(Kind::Dir)) {
                        parents.push((*child, dir));
                        stack.push(*child);
                    }
                }
            }
        }
        for (child, dir) in parents {
            if let Some(Inode {
                node: Node::Dir { parent, .. },
                ..
            }) = self.inodes.get_mut(&child)
            {
                *parent = dir;
            }
        }
        self.stats.cuts += 1;
        self.stats.dropped_bytes += dropped;
        self.stats.kept_bytes += kept;
        (dropped, kept)
    }

    /// Forgets inodes nothing can reach any more: not open and not named by
    /// a current or durable entry of a directory reachable from the root or
    /// from an open inode. Then recounts links.
    fn collect(&mut self) {
        let mut seen: HashSet<u64> = HashSet::new();
        let mut stack: Vec<u64> = vec![ROOT];
        stack.extend(
            self.inodes
                .iter()
                .filter(|(_, i)| i.open > 0)
                .map(|(n, _)| *n),
        );
        while let Some(ino) = stack.pop() {
            if !seen.insert(ino) {
                continue;
            }
            if let Some(Inode {
                node: Node::Dir {
                    current, durable, ..
                },
                ..
            }) = self.inodes.get(&ino)
            {
                stack.extend(current.values().chain(durable.values()).copied());
            }
        }
        self.inodes.retain(|ino, _| seen.contains(ino));
        self.relink();
    }

    fn relink(&mut self) {
        let mut links: HashMap<u64, u32> = HashMap::new();
        for i in self.inodes.values() {
            if let Node::Dir { current, .. } = &i.node {
                for child in current.values() {
                    *links.entry(*child).or_default() += 1;
                }
            }
        }
        let subdirs: HashMap<u64, u32> = self
            .inodes
            .iter()
            .filter_map(|(n, i)| match &i.node {
                Node::Dir { current, .. } => Some((
                    *n,
                    current
                        .values()
                        .filter(|c| matches!(self.inodes.get(c).map(Inode::kind), Some(Kind::Dir)))
                        .count() as u32,
                )),
                Node::File { .. } => None,
            })
            .collect();
        for (n, i) in &mut self.inodes {
            i.nlink = match i.kind() {
                Kind::File => links.get(n).copied().unwrap_or(0),
                Kind::Dir => 2 + subdirs.get(n).copied().unwrap_or(0),
            };
        }
    }

    /// Arms a kill: see [`Armed`]. Replaces whatever was armed or fired.
    pub fn arm(&mut self, name: &OsStr, k: u64, cut: Option<Cut>) {
        self.trigger = Trigger::Armed(Armed {
            name: name.to_os_string(),
            k: k.max(1),
            seen: 0,
            cut,
        });
    }

    /// Arms a sync failure: see [`SyncFault`]. Replaces one armed before.
    pub fn fail_sync(&mut self, name: &OsStr, k: u64) {
        self.sync_fault = Some(SyncFault {
            name: name.to_os_string(),
            k: k.max(1),
            seen: 0,
        });
    }

    /// Records that the armed kill fired on process `pid`.
    pub fn fired(&mut self, pid: u32) {
        self.stats.kills += 1;
        self.trigger = Trigger::Fired { pid };
    }

    /// The trigger's state.
    pub fn trigger(&self) -> &Trigger {
        &self.trigger
    }

    /// Returns the trigger's state and sets it idle (a waiter consumed a
    /// firing, or a test disarms).
    pub fn take_trigger(&mut self) -> Trigger {
        std::mem::take(&mut self.trigger)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> &OsStr {
        OsStr::new(s)
    }

    fn written(fs: &mut Fs, ino: u64, fh: u64, offset: u64, data: &[u8]) {
        assert_eq!(
            fs.write(ino, fh, offset, data),
            Ok(WriteOutcome::Written(data.len() as u32))
        );
    }

    fn content(fs: &mut Fs, path: &str) -> Option<Vec<u8>> {
        let ino = fs.lookup(ROOT, name(path)).ok()?.ino;
        let fh = fs.open(ino, false).ok()?;
        let data = fs.read(ino, fh, 0, u32::MAX).ok();
        fs.release(fh);
        data
    }

    fn root_fsync(fs: &mut Fs) {
        let d = fs.open(ROOT, true).unwrap();
        fs.fsyncdir(ROOT, d).unwrap();
        fs.release(d);
    }

    #[test]
    fn synced_data_and_names_survive_a_cut_and_nothing_else() {
        let mut fs = Fs::new(0, 0);
        let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
        let fh = fs.open(a, false).unwrap();
        written(&mut fs, a, fh, 0, b"durable");
        fs.fsync(a, fh).unwrap();
        root_fsync(&mut fs);
        written(&mut fs, a, fh, 7, b" and lost");
        fs.mknod(ROOT, name("b"), 0o644, 0, 0).unwrap();
        fs.rename(ROOT, name("a"), ROOT, name("c"), false).unwrap();
        assert_eq!(fs.cut(Cut::Drop), (9, 0));
        assert_eq!(content(&mut fs, "a").as_deref(), Some(&b"durable"[..]));
        assert!(fs.lookup(ROOT, name("b")).is_err());
        assert!(fs.lookup(ROOT, name("c")).is_err());
        // The old handle is dead.
        assert_eq!(fs.write(a, fh, 0, b"x"), Err(libc::EIO));
        assert_eq!(fs.fsync(a, fh), Err(libc::EIO));
    }

    #[test]
    fn a_file_fsync_does_not_make_its_name_durable_and_a_dir_fsync_not_its_data() {
        let mut fs = Fs::new(0, 0);
        let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
        let fh = fs.open(a, false).unwrap();
        written(&mut fs, a, fh, 0, b"data");
        fs.fsync(a, fh).unwrap();
        fs.cut(Cut::Drop);
        assert!(fs.lookup(ROOT, name("a")).is_err());

        let b = fs.mknod(ROOT, name("b"), 0o644, 0, 0).unwrap().ino;
        let fh = fs.open(b, false).unwrap();
        written(&mut fs, b, fh, 0, b"data");
        root_fsync(&mut fs);
        fs.cut(Cut::Drop);
        assert_eq!(content(&mut fs, "b").as_deref(), Some(&b""[..]));
    }

    #[test]
    fn torn_cut_keeps_whole_aligned_pieces_and_is_seeded() {
        let image = |seed| {
            let mut fs = Fs::new(0, 0);
            let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
            let fh = fs.open(a, false).unwrap();
            written(&mut fs, a, fh, 0, &vec![0u8; 64 * 1024]);
            fs.fsync(a, fh).unwrap();
            root_fsync(&mut fs);
            // Unaligned: pieces are [100, 4096), then whole sectors, then a tail.
            written(&mut fs, a, fh, 100, &vec![1u8; 40 * 1024]);
            let (dropped, kept) = fs.cut(Cut::Torn(seed));
            assert_eq!(dropped + kept, 40 * 1024);
            content(&mut fs, "a").unwrap()
        };
        let one = image(7);
        assert_eq!(one, image(7));
        assert_eq!(one.len(), 64 * 1024);
        let mut kinds = HashSet::new();
        let pieces = [(100usize, 4096usize)]
            .into_iter()
            .chain((1..10).map(|s| (s * 4096, (s + 1) * 4096)))
            .chain([(40960, 100 + 40 * 1024)]);
        for (start, end) in pieces {
            let piece = &one[start..end];
            assert!(
                piece.iter().all(|b| *b == piece[0]),
                "piece {start}..{end} is itself torn"
            );
            kinds.insert(piece[0]);
        }
        assert_eq!(
            kinds.len(),
            2,
            "a torn cut keeps some pieces and drops others"
        );
        assert!(one[..100].iter().all(|b| *b == 0));
    }

    #[test]
    fn the_armed_kill_fires_on_the_kth_write_to_its_file_only() {
        let mut fs = Fs::new(0, 0);
        let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
        let b = fs.mknod(ROOT, name("b"), 0o644, 0, 0).unwrap().ino;
        let (fa, fb) = (fs.open(a, false).unwrap(), fs.open(b, false).unwrap());
        fs.arm(name("a"), 2, Some(Cut::Drop));
        written(&mut fs, a, fa, 0, b"1");
        written(&mut fs, b, fb, 0, b"1");
        assert_eq!(
            fs.write(a, fa, 1, b"2"),
            Ok(WriteOutcome::Fire(Some(Cut::Drop)))
        );
        fs.fired(42);
        assert_eq!(fs.take_trigger(), Trigger::Fired { pid: 42 });
        assert_eq!(fs.take_trigger(), Trigger::Idle);
    }

    #[test]
    fn an_armed_sync_failure_loses_what_that_sync_was_to_make_durable() {
        let mut fs = Fs::new(0, 0);
        let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
        let b = fs.mknod(ROOT, name("b"), 0o644, 0, 0).unwrap().ino;
        let (fa, fb) = (fs.open(a, false).unwrap(), fs.open(b, false).unwrap());
        root_fsync(&mut fs);
        fs.fail_sync(name("a"), 2);
        written(&mut fs, a, fa, 0, b"1");
        fs.fsync(a, fa).unwrap();
        written(&mut fs, b, fb, 0, b"b");
        fs.fsync(b, fb).unwrap();
        written(&mut fs, a, fa, 1, b"2");
        assert_eq!(fs.fsync(a, fa), Err(libc::EIO), "the second sync of a");
        assert_eq!(fs.read(a, fa, 0, 10), Ok(b"12".to_vec()), "still readable");
        fs.fsync(a, fa).unwrap();
        assert_eq!(fs.stats().failed_syncs, 1);
        fs.cut(Cut::Drop);
        assert_eq!(
            content(&mut fs, "a").as_deref(),
            Some(&b"1"[..]),
            "a later sync did not make the failed write durable"
        );
        assert_eq!(content(&mut fs, "b").as_deref(), Some(&b"b"[..]));
    }

    #[test]
    fn unlinked_files_live_while_open_and_come_back_if_their_name_was_durable() {
        let mut fs = Fs::new(0, 0);
        let a = fs.mknod(ROOT, name("a"), 0o644, 0, 0).unwrap().ino;
        let fh = fs.open(a, false).unwrap();
        written(&mut fs, a, fh, 0, b"x");
        fs.fsync(a, fh).unwrap();
        root_fsync(&mut fs);
        fs.unlink(ROOT, name("a")).unwrap();
        assert!(fs.lookup(ROOT, name("a")).is_err());
        assert_eq!(fs.read(a, fh, 0, 10), Ok(b"x".to_vec()));
        fs.release(fh);
        fs.cut(Cut::Drop);
        assert_eq!(content(&mut fs, "a").as_deref(), Some(&b"x"[..]));
        fs.unlink(ROOT, name("a")).unwrap();
        root_fsync(&mut fs);
        fs.cut(Cut::Drop);
        assert!(fs.lookup(ROOT, name("a")).is_err());
        assert_eq!(fs.usage().0, 1, "only the root is left");
    }
}
