//! Attaching programs to interfaces: TCX links (pinned under
//! `<pin_root>/links/`, so they outlive the agent), the netlink/clsact
//! fallback, replacing an attached program in place, detaching and
//! uninstalling.
//!
//! Kept apart from [`super::Datapath::open`] because attaching is per
//! interface and runs for the whole life of the agent (also without the
//! `Datapath`, through a [`ProgramPin`]), while loading happens once.

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{SchedClassifier, TcAttachType};
use lockstep_common::program_names;

use super::{Datapath, DatapathError, fs_err, owner};

/// Where a program is attached on an interface.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Hook {
    /// Packets received by the interface.
    Ingress,
    /// Packets sent by the interface.
    Egress,
}

impl fmt::Display for Hook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Hook::Ingress => "ingress",
            Hook::Egress => "egress",
        })
    }
}

impl Hook {
    fn tc(self) -> TcAttachType {
        match self {
            Hook::Ingress => TcAttachType::Ingress,
            Hook::Egress => TcAttachType::Egress,
        }
    }
}

/// How programs are attached.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AttachMode {
    /// TCX where the kernel has it, netlink otherwise.
    #[default]
    Auto,
    /// TCX links only (pinned; survive the agent).
    Tcx,
    /// clsact + netlink filters only (not pinnable; re-attached on start).
    Netlink,
}

/// How an attach was carried out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attached {
    /// A new TCX link was created and pinned.
    TcxNew,
    /// An existing pinned TCX link now runs the new program (no gap).
    TcxReplaced,
    /// A netlink filter was created.
    NetlinkNew,
    /// An existing netlink filter was replaced in place.
    NetlinkReplaced,
}

impl Datapath {
    /// Path of the link pin of `program` on the interface with `ifindex`.
    pub fn link_pin(&self, program: &str, hook: Hook, ifindex: u32) -> PathBuf {
        link_pin_in(&self.opts.links_dir(), program, hook, ifindex)
    }

    /// Attaches `program` to `iface`, or replaces the program of an existing
    /// attachment in place.
    ///
    /// # Errors
    /// Unknown interface or program, verifier refusal, attach failure.
    ///
    /// # Minimum kernel version
    /// 6.6 for TCX; netlink otherwise.
    pub fn attach(
        &mut self,
        program: &str,
        iface: &str,
        hook: Hook,
    ) -> Result<Attached, DatapathError> {
        let links = self.opts.links_dir();
        let mode = self.opts.attach_mode;
        let prog = self.program(program)?;
        attach_with(prog, &links, mode, program, iface, hook)
    }

    /// Loads `program` and pins it under `<pin_root>/progs/`, so it can be
    /// attached by [`ProgramPin::attach`] from any thread without this
    /// `Datapath` (attaching waits for an RCU grace period in the kernel;
    /// concurrent attaches share one instead of queueing behind a lock).
    /// A pin from an older agent is replaced: new attachments get this
    /// build's program. `mode` is how [`ProgramPin::attach`] attaches.
    ///
    /// # Errors
    /// The program does not load or cannot be pinned.
    pub fn pin_program(
        &mut self,
        program: &str,
        mode: AttachMode,
    ) -> Result<ProgramPin, DatapathError> {
        let dir = self.opts.pin_root.join("progs");
        std::fs::create_dir_all(&dir).map_err(fs_err("create", &dir))?;
        let path = dir.join(program);
        if path.exists() {
            std::fs::remove_file(&path).map_err(fs_err("remove", &path))?;
        }
        let prog = self.program(program)?;
        prog.pin(&path).map_err(|e| DatapathError::LinkPin {
            action: "pin program at",
            path: path.clone(),
            source: Box::new(e),
        })?;
        Ok(ProgramPin {
            path,
            program: program.to_string(),
            links_dir: self.opts.links_dir(),
            mode,
        })
    }

    /// Detaches `program` from `iface`: removes its link pin (TCX) or its
    /// filter (netlink). Already detached is success.
    ///
    /// # Errors
    /// The pin exists but cannot be removed.
    pub fn detach(&self, program: &str, iface: &str, hook: Hook) -> Result<(), DatapathError> {
        let ifindex = match ifindex_of(iface) {
            Ok(i) => i,
            // The interface is gone and took its attachments with it.
            Err(_) => return Ok(()),
        };
        let pin = self.link_pin(program, hook, ifindex);
        unpin_link(&pin)?;
        if self.opts.attach_mode != AttachMode::Tcx {
            let _not_attached = aya::programs::tc::qdisc_detach_program(iface, hook.tc(), program);
        }
        Ok(())
    }

    /// Detaches `program` from the interface with `ifindex` (it may be gone
    /// already): removes its link pin. Already detached is success.
    ///
    /// # Errors
    /// The pin exists but cannot be removed.
    pub fn detach_index(
        &self,
        program: &str,
        ifindex: u32,
        hook: Hook,
    ) -> Result<(), DatapathError> {
        unpin_link(&self.link_pin(program, hook, ifindex))
    }

    /// Detaches every pinned link and removes every pin under `pin_root`;
    /// netlink filters are removed from the interfaces named in `ifaces`.
    /// Missing pins are not an error.
    ///
    /// # Errors
    /// A pin that exists but cannot be removed.
    pub fn uninstall(pin_root: &Path, ifaces: &[String]) -> Result<usize, DatapathError> {
        let mut removed = owner::remove(pin_root)?;
        let links = pin_root.join("links");
        if links.exists() {
            for entry in std::fs::read_dir(&links).map_err(fs_err("read", &links))? {
                let entry = entry.map_err(fs_err("read", &links))?;
                unpin_link(&entry.path())?;
                removed += 1;
            }
            std::fs::remove_dir(&links).map_err(fs_err("remove", &links))?;
        }
        for iface in ifaces {
            for name in program_names::ALL {
                for hook in [Hook::Ingress, Hook::Egress] {
                    let _not_attached =
                        aya::programs::tc::qdisc_detach_program(iface, hook.tc(), name);
                }
            }
        }
        let progs = pin_root.join("progs");
        if progs.exists() {
            for entry in std::fs::read_dir(&progs).map_err(fs_err("read", &progs))? {
                let path = entry.map_err(fs_err("read", &progs))?.path();
                std::fs::remove_file(&path).map_err(fs_err("remove", &path))?;
                removed += 1;
            }
            std::fs::remove_dir(&progs).map_err(fs_err("remove", &progs))?;
        }
        let maps = pin_root.join("maps");
        if maps.exists() {
            for entry in std::fs::read_dir(&maps).map_err(fs_err("read", &maps))? {
                let path = entry.map_err(fs_err("read", &maps))?.path();
                std::fs::remove_file(&path).map_err(fs_err("remove", &path))?;
                removed += 1;
            }
            std::fs::remove_dir(&maps).map_err(fs_err("remove", &maps))?;
        }
        if pin_root.exists() {
            std::fs::remove_dir(pin_root).map_err(fs_err("remove", pin_root))?;
        }
        Ok(removed)
    }
}

/// A program pinned by [`Datapath::pin_program`], attachable without the
/// `Datapath`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramPin {
    path: PathBuf,
    program: String,
    links_dir: PathBuf,
    mode: AttachMode,
}

impl ProgramPin {
    /// Attaches the pinned program to `iface` (or replaces an existing
    /// attachment's program in place).
    ///
    /// # Errors
    /// As [`Datapath::attach`].
    pub fn attach(&self, iface: &str, hook: Hook) -> Result<Attached, DatapathError> {
        let mut prog =
            SchedClassifier::from_pin(&self.path).map_err(|source| DatapathError::ProgramLoad {
                name: self.program.clone(),
                source: Box::new(source),
            })?;
        attach_with(
            &mut prog,
            &self.links_dir,
            self.mode,
            &self.program,
            iface,
            hook,
        )
    }

    /// The interface indexes this program has pinned links for on `hook`
    /// (the interfaces may be gone).
    ///
    /// # Errors
    /// The links directory cannot be read.
    pub fn linked_indexes(&self, hook: Hook) -> Result<Vec<u32>, DatapathError> {
        let prefix = format!("{}-{hook}-", self.program);
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.links_dir) {
            Ok(e) => e,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(fs_err("read", &self.links_dir)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(fs_err("read", &self.links_dir))?;
            if let Some(index) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(&prefix))
                .and_then(|i| i.parse().ok())
            {
                out.push(index);
            }
        }
        Ok(out)
    }

    /// Removes the link of this program on the interface with `ifindex`
    /// (which may be gone). Already detached is success.
    ///
    /// # Errors
    /// The pin exists but cannot be removed.
    pub fn detach_index(&self, ifindex: u32, hook: Hook) -> Result<(), DatapathError> {
        unpin_link(&link_pin_in(&self.links_dir, &self.program, hook, ifindex))
    }
}

fn link_pin_in(links_dir: &Path, program: &str, hook: Hook, ifindex: u32) -> PathBuf {
    links_dir.join(format!("{program}-{hook}-{ifindex}"))
}

/// Attaches a loaded program: replaces the program of a pinned TCX link in
/// place, or creates and pins a new link, or falls back to netlink.
fn attach_with(
    prog: &mut SchedClassifier,
    links_dir: &Path,
    mode: AttachMode,
    program: &str,
    iface: &str,
    hook: Hook,
) -> Result<Attached, DatapathError> {
    let ifindex = ifindex_of(iface)?;
    let pin = link_pin_in(links_dir, program, hook, ifindex);
    let attach_err = |source| DatapathError::Attach {
        program: program.to_string(),
        iface: iface.to_string(),
        hook,
        source: Box::new(source),
    };
    // An existing pinned TCX link is updated in place whatever the mode, so
    // switching modes never stacks a second program on an interface.
    if pin.exists() {
        let link_err = |source: Box<dyn std::error::Error + Send + Sync>| DatapathError::LinkPin {
            action: "open",
            path: pin.clone(),
            source,
        };
        let pinned = PinnedLink::from_pin(&pin).map_err(|e| link_err(Box::new(e)))?;
        let link = SchedClassifierLink::try_from(FdLink::from(pinned))
            .map_err(|e| link_err(Box::new(e)))?;
        let id = prog.attach_to_link(link).map_err(attach_err)?;
        // The pin keeps the link (and now the new program) alive; closing
        // our fd changes nothing.
        drop(prog.take_link(id).map_err(attach_err)?);
        return Ok(Attached::TcxReplaced);
    }
    if mode != AttachMode::Netlink {
        match prog.attach_with_options(
            iface,
            hook.tc(),
            TcAttachOptions::TcxOrder(LinkOrder::default()),
        ) {
            Ok(id) => {
                let link = prog.take_link(id).map_err(attach_err)?;
                let fd_link = FdLink::try_from(link).map_err(|e| DatapathError::LinkPin {
                    action: "convert",
                    path: pin.clone(),
                    source: Box::new(e),
                })?;
                fd_link.pin(&pin).map_err(|e| DatapathError::LinkPin {
                    action: "create",
                    path: pin.clone(),
                    source: Box::new(e),
                })?;
                return Ok(Attached::TcxNew);
            }
            Err(e) if mode == AttachMode::Tcx => return Err(attach_err(e)),
            Err(e) => {
                tracing::warn!(error = %e, iface, program, "TCX attach failed, falling back to netlink");
            }
        }
    }
    attach_netlink(prog, program, iface, hook)
}

fn attach_netlink(
    prog: &mut SchedClassifier,
    program: &str,
    iface: &str,
    hook: Hook,
) -> Result<Attached, DatapathError> {
    let attach_err = |source| DatapathError::Attach {
        program: program.to_string(),
        iface: iface.to_string(),
        hook,
        source: Box::new(source),
    };
    // Adding clsact twice is harmless; any real problem shows up below.
    let _already_there = aya::programs::tc::qdisc_add_clsact(iface);
    let (priority, handle) = netlink_slot(program);
    let options = NlOptions {
        priority,
        handle,
        ..Default::default()
    };
    let (id, how) =
        match prog.attach_with_options(iface, hook.tc(), TcAttachOptions::Netlink(options)) {
            Ok(id) => (id, Attached::NetlinkNew),
            Err(_) => {
                let existing =
                    SchedClassifierLink::attached(iface, hook.tc(), priority, handle, None)
                        .map_err(|source| DatapathError::NoInterface {
                            iface: iface.to_string(),
                            source,
                        })?;
                (
                    prog.attach_to_link(existing).map_err(attach_err)?,
                    Attached::NetlinkReplaced,
                )
            }
        };
    // Dropping a netlink link removes the filter; the filter must outlive
    // this process, so the handle is deliberately leaked.
    std::mem::forget(prog.take_link(id).map_err(attach_err)?);
    Ok(how)
}

/// A fixed netlink priority and handle per program, so a restarted agent finds
/// (and replaces) its own filter instead of stacking a second one.
fn netlink_slot(program: &str) -> (u16, TcHandle) {
    let index = program_names::ALL
        .iter()
        .position(|p| *p == program)
        .unwrap_or(program_names::ALL.len()) as u16;
    (0x4c00 + index, TcHandle::new(0, 0x4c53))
}

fn unpin_link(pin: &Path) -> Result<(), DatapathError> {
    match PinnedLink::from_pin(pin) {
        Ok(link) => {
            let fd_link = link.unpin().map_err(|e| DatapathError::LinkPin {
                action: "remove",
                path: pin.to_path_buf(),
                source: Box::new(e),
            })?;
            // Last reference: closing it detaches the program.
            drop(fd_link);
            Ok(())
        }
        Err(_) if !pin.exists() => Ok(()),
        Err(e) => Err(DatapathError::LinkPin {
            action: "open",
            path: pin.to_path_buf(),
            source: Box::new(e),
        }),
    }
}

/// The index of `iface` in the current network namespace.
///
/// # Errors
/// [`DatapathError::NoInterface`].
pub fn ifindex_of(iface: &str) -> Result<u32, DatapathError> {
    let no_iface = |source| DatapathError::NoInterface {
        iface: iface.to_string(),
        source,
    };
    let c = std::ffi::CString::new(iface)
        .map_err(|_| no_iface(io::Error::from(io::ErrorKind::InvalidInput)))?;
    // SAFETY: NUL-terminated string.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if index == 0 {
        Err(no_iface(io::Error::last_os_error()))
    } else {
        Ok(index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;
    #[test]
    fn netlink_slots_differ_per_program() {
        let slots: BTreeSet<u16> = program_names::ALL
            .iter()
            .map(|p| netlink_slot(p).0)
            .collect();
        assert_eq!(slots.len(), program_names::ALL.len());
    }
}
