//! The datapath: the only module that uses aya.
//!
//! It loads lockstep's eBPF object, pins every map under
//! `<bpffs>/lockstep/maps/`, attaches programs with TCX (netlink/clsact as a
//! fallback) and pins the links under `<bpffs>/lockstep/links/`, so packets keep
//! flowing through the programs while the agent restarts or upgrades.
//!
//! aya reuses an existing pin without checking it, so [`Datapath::open`] first
//! compares every pin's type, key size, value size and max entries with what
//! this build expects and refuses a mismatch with an error naming the pin and
//! both definitions. [`DatapathOptions::migrate`] replaces such a map instead,
//! copying the entries over when their layout is unchanged (a capacity change);
//! when the layout changed the new map starts empty and reconcile refills it
//! from the store.
//!
//! Before any of that, an agent claims the pin root for its store
//! ([`owner`]): a pin root owned by another agent's store is refused unless
//! taken over explicitly. The agent reads and writes its maps only through
//! the descriptors it loaded the programs with, and checks that each pin
//! still names that map ([`pins`]; repaired by re-pinning).
//!
//! Re-attaching a program to an interface whose link is already pinned updates
//! the link in place (`BPF_LINK_UPDATE`), so an upgrade has no detach gap.
//!
//! The parts: `defs` (what each map looks like, the pin check, the
//! migration copy), `attach` (TCX/netlink attach, link pins, replacing a
//! program in place), [`maps`] (typed access), [`pins`] and [`owner`] (pin
//! integrity and ownership), [`sys`] (raw bpf syscalls aya lacks), [`events`].
//! This module holds the [`Datapath`] itself: loading and opening.
//!
//! # Minimum kernel version
//! TCX links need Linux 6.6; older kernels fall back to clsact + netlink
//! filters, which cannot be pinned (they are re-attached on every start).
//! Batch map updates need 5.6.

mod attach;
mod defs;
pub mod events;
pub mod maps;
mod nat;
pub mod owner;
pub mod pins;
pub mod sys;
mod tunnel;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use aya::maps::{MapData, MapInfo};
use aya::programs::{ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfLoader};

pub use attach::{AttachMode, Attached, Hook, ProgramPin, ifindex_of};
pub use defs::{MapCapacities, MapDefinition, check_pin, expected_definitions};
pub use maps::PinnedMaps;
pub use nat::NatSweep;
pub use owner::PinOwner;
pub use pins::PinFault;

/// The eBPF object built by `ebpf/programs`, embedded at build time.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/lockstep.bpf.o"));

/// `statfs` magic of a BPF filesystem.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// Errors of the datapath module.
#[derive(Debug, thiserror::Error)]
pub enum DatapathError {
    /// The pin directory is not on a BPF filesystem.
    #[error("{path} is not on a bpf filesystem (mount one with `mount -t bpf bpf /sys/fs/bpf`)")]
    NotBpffs {
        /// The directory checked.
        path: PathBuf,
    },
    /// A filesystem operation on the pin directory failed.
    #[error("{action} {path}")]
    Fs {
        /// What was being done.
        action: &'static str,
        /// The path.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// An existing pin does not match this build's map definition.
    #[error(
        "pinned map {pin} is incompatible: it is {found}, this agent expects {expected}; \
         start with the migrate option to replace it, or uninstall first"
    )]
    PinIncompatible {
        /// The pin.
        pin: PathBuf,
        /// What this build expects.
        expected: MapDefinition,
        /// What the pin holds.
        found: MapDefinition,
    },
    /// Reading a pinned map's definition failed.
    #[error("cannot read the definition of pinned map {pin}")]
    PinInfo {
        /// The pin.
        pin: PathBuf,
        /// aya's error.
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// Opening a pinned map failed.
    #[error("cannot open pinned map {pin}")]
    OpenPin {
        /// The pin.
        pin: PathBuf,
        /// aya's error.
        #[source]
        source: Box<aya::maps::MapError>,
    },
    /// A map has no room for another entry (the kernel's `E2BIG`).
    #[error("map {map} is full")]
    MapFull {
        /// The map.
        map: &'static str,
    },
    /// Reading or writing entries of a map failed.
    #[error("cannot {action} {map}")]
    MapAccess {
        /// What was being done.
        action: &'static str,
        /// The map.
        map: &'static str,
        /// The cause.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Loading the object (and creating or reusing the maps) failed.
    #[error("cannot load the eBPF object")]
    Load {
        /// aya's error.
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The object has no program of that name (a build mismatch).
    #[error("the eBPF object has no program named {name}")]
    NoProgram {
        /// The program name.
        name: String,
    },
    /// Loading a program into the kernel failed (verifier).
    #[error("the kernel refused program {name}")]
    ProgramLoad {
        /// The program name.
        name: String,
        /// aya's error (holds the verifier log).
        #[source]
        source: Box<ProgramError>,
    },
    /// Attaching a program failed.
    #[error("cannot attach {program} to {iface} {hook}")]
    Attach {
        /// The program name.
        program: String,
        /// The interface.
        iface: String,
        /// Ingress or egress.
        hook: Hook,
        /// aya's error.
        #[source]
        source: Box<ProgramError>,
    },
    /// A pinned link could not be opened, pinned or removed.
    #[error("cannot {action} link pin {path}")]
    LinkPin {
        /// What was being done.
        action: &'static str,
        /// The pin.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Copying entries into a migrated map failed.
    #[error("cannot migrate entries of {map}")]
    Migrate {
        /// The map name.
        map: String,
        /// The syscall error.
        #[source]
        source: sys::SysError,
    },
    /// The pin root belongs to another store, or its owner record failed.
    #[error(transparent)]
    Owner(#[from] owner::OwnerError),
    /// The interface does not exist in this network namespace.
    #[error("interface {iface} not found")]
    NoInterface {
        /// The interface.
        iface: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
}

/// Options of [`Datapath::open`].
#[derive(Clone, Debug)]
pub struct DatapathOptions {
    /// Root of lockstep's pins, e.g. `/sys/fs/bpf/lockstep`.
    pub pin_root: PathBuf,
    /// Map capacities.
    pub capacities: MapCapacities,
    /// Replace pinned maps whose definition differs instead of refusing.
    pub migrate: bool,
    /// How to attach programs.
    pub attach_mode: AttachMode,
    /// The store claiming the pin root ([`owner::claim`]); `None` (the
    /// low-level `lockstep datapath` tools) claims nothing.
    pub owner: Option<PinOwner>,
    /// Take the pin root over from another store's agent.
    pub take_over_pin_root: bool,
}

impl DatapathOptions {
    /// Options with default capacities, no migration, automatic attach and
    /// no owner.
    pub fn new(pin_root: impl Into<PathBuf>) -> Self {
        Self {
            pin_root: pin_root.into(),
            capacities: MapCapacities::default(),
            migrate: false,
            attach_mode: AttachMode::Auto,
            owner: None,
            take_over_pin_root: false,
        }
    }

    /// Directory of map pins.
    pub fn maps_dir(&self) -> PathBuf {
        self.pin_root.join("maps")
    }

    /// Directory of link pins.
    pub fn links_dir(&self) -> PathBuf {
        self.pin_root.join("links")
    }
}

/// The loaded object with its pinned maps.
pub struct Datapath {
    ebpf: Ebpf,
    opts: DatapathOptions,
    loaded: BTreeSet<String>,
    migrated: Vec<String>,
    /// The maps the programs use, by descriptor.
    held: pins::HeldMaps,
    /// The claim on the pin root, when opened for a store.
    owner: Option<Arc<owner::OwnerGuard>>,
    /// The pin root's check, shared with readers on other threads.
    probe: Arc<pins::PinProbe>,
}

impl fmt::Debug for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Datapath")
            .field("pin_root", &self.opts.pin_root)
            .field("loaded", &self.loaded)
            .field("migrated", &self.migrated)
            .finish()
    }
}

fn fs_err(action: &'static str, path: &Path) -> impl FnOnce(io::Error) -> DatapathError {
    let path = path.to_path_buf();
    move |source| DatapathError::Fs {
        action,
        path,
        source,
    }
}

/// Checks that `dir` (or its nearest existing ancestor) is on a bpffs.
fn check_bpffs(dir: &Path) -> Result<(), DatapathError> {
    let mut probe = dir;
    while !probe.exists() {
        probe = probe.parent().unwrap_or(Path::new("/"));
    }
    let c = std::ffi::CString::new(probe.as_os_str().as_encoded_bytes()).map_err(|_| {
        DatapathError::NotBpffs {
            path: dir.to_path_buf(),
        }
    })?;
    // SAFETY: `statfs` is plain data; the kernel fills it for a valid path.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` is writable.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut st) };
    if rc != 0 {
        return Err(fs_err("statfs", probe)(io::Error::last_os_error()));
    }
    if st.f_type as i64 != BPF_FS_MAGIC {
        return Err(DatapathError::NotBpffs {
            path: probe.to_path_buf(),
        });
    }
    Ok(())
}

impl Datapath {
    /// Loads the object, creating the pinned maps or reusing compatible ones.
    ///
    /// # Errors
    /// The pin root is not on bpffs; an existing pin is incompatible (without
    /// `migrate`); the kernel refuses the object.
    ///
    /// # Minimum kernel version
    /// 5.6 (BTF maps, batch operations).
    pub fn open(opts: DatapathOptions) -> Result<Self, DatapathError> {
        check_bpffs(&opts.pin_root)?;
        let maps_dir = opts.maps_dir();
        std::fs::create_dir_all(&opts.pin_root).map_err(fs_err("create", &opts.pin_root))?;
        // The claim comes before anything under the pin root is opened,
        // created or migrated.
        let owner = match &opts.owner {
            Some(me) => Some(Arc::new(owner::claim(
                &opts.pin_root,
                me,
                opts.take_over_pin_root,
            )?)),
            None => None,
        };
        for dir in [&maps_dir, &opts.links_dir()] {
            std::fs::create_dir_all(dir).map_err(fs_err("create", dir))?;
        }
        pins::sweep_repair_temps(&maps_dir)?;
        let expected = expected_definitions(&opts.capacities);
        // Maps being replaced: their old contents, kept open until copied.
        let mut replaced: Vec<(&'static str, MapDefinition, MapData)> = Vec::new();
        for (name, want) in &expected {
            let pin = maps_dir.join(name);
            if !pin.exists() {
                continue;
            }
            let info = MapInfo::from_pin(&pin).map_err(|source| DatapathError::PinInfo {
                pin: pin.clone(),
                source: Box::new(source),
            })?;
            let found = MapDefinition::of_info(&info).map_err(|source| DatapathError::PinInfo {
                pin: pin.clone(),
                source: Box::new(source),
            })?;
            match check_pin(&pin, want, &found) {
                Ok(()) => {}
                Err(e) if !opts.migrate => return Err(e),
                Err(_) => {
                    let old = MapData::from_pin(&pin).map_err(|source| DatapathError::OpenPin {
                        pin: pin.clone(),
                        source: Box::new(source),
                    })?;
                    std::fs::remove_file(&pin).map_err(fs_err("remove", &pin))?;
                    tracing::warn!(map = name, %found, expected = %want, "replacing incompatible pinned map");
                    replaced.push((name, found, old));
                }
            }
        }
        let mut loader = EbpfLoader::new();
        let pins: Vec<(&'static str, PathBuf)> = expected
            .keys()
            .map(|name| (*name, maps_dir.join(name)))
            .collect();
        for (name, pin) in &pins {
            loader.map_pin_path(name, pin.as_path());
        }
        for (name, def) in &expected {
            loader.map_max_entries(name, def.max_entries);
        }
        let mut ebpf = loader.load(OBJECT).map_err(|source| DatapathError::Load {
            source: Box::new(source),
        })?;
        // Taken out of the object and kept open for its whole life: the
        // programs were relocated against these very descriptors.
        let mut held = BTreeMap::new();
        for name in expected.keys() {
            let map = ebpf
                .take_map(name)
                .ok_or_else(|| DatapathError::MapAccess {
                    action: "find",
                    map: name,
                    source: "the eBPF object has no such map".into(),
                })?;
            held.insert(*name, pins::map_data(name, map)?);
        }
        let held = pins::HeldMaps::new(held)?;
        let mut migrated = Vec::new();
        for (name, old_def, old) in replaced {
            let new_def = expected[name];
            if new_def.same_layout(&old_def) {
                let pin = maps_dir.join(name);
                let new = MapData::from_pin(&pin).map_err(|source| DatapathError::OpenPin {
                    pin,
                    source: Box::new(source),
                })?;
                defs::copy_entries(name, &old, &new, &new_def)?;
            }
            migrated.push(name.to_string());
        }
        let probe = Arc::new(pins::PinProbe::new(
            owner.clone(),
            held.ids(),
            opts.maps_dir(),
        ));
        Ok(Self {
            ebpf,
            opts,
            loaded: BTreeSet::new(),
            migrated,
            probe,
            held,
            owner,
        })
    }

    /// The maps the programs use, held by descriptor.
    pub fn held(&self) -> &pins::HeldMaps {
        &self.held
    }

    /// The claim on the pin root (`None` when opened without an owner).
    pub fn owner(&self) -> Option<&owner::OwnerGuard> {
        self.owner.as_deref()
    }

    /// Every map pin that does not name the map the programs use: removed,
    /// replaced by another object, or unreadable.
    pub fn pin_faults(&self) -> Vec<PinFault> {
        self.probe.faults()
    }

    /// The pin root's check, for a reader that must not wait for the
    /// agent (status).
    pub fn pin_probe(&self) -> Arc<pins::PinProbe> {
        self.probe.clone()
    }

    /// Pins the programs' map at the path of each fault again (replacing an
    /// impostor); returns the maps repaired.
    ///
    /// # Errors
    /// A pin could not be made or moved into place.
    pub fn repair_pins(&self, faults: &[PinFault]) -> Result<Vec<String>, DatapathError> {
        pins::repair(&self.held, &self.opts.maps_dir(), faults)
    }

    /// Maps replaced by migration during [`Datapath::open`].
    pub fn migrated(&self) -> &[String] {
        &self.migrated
    }

    /// The options this datapath was opened with.
    pub fn options(&self) -> &DatapathOptions {
        &self.opts
    }

    /// Opens the maps the programs use for typed access, through the
    /// descriptors held (never by path: a pin can be removed or replaced).
    ///
    /// # Errors
    /// A descriptor cannot be duplicated or a map is of the wrong type.
    pub fn maps(&self) -> Result<PinnedMaps, DatapathError> {
        PinnedMaps::open_held(&self.held)
    }

    fn program(&mut self, name: &str) -> Result<&mut SchedClassifier, DatapathError> {
        let no_program = || DatapathError::NoProgram {
            name: name.to_string(),
        };
        let prog: &mut SchedClassifier = self
            .ebpf
            .program_mut(name)
            .ok_or_else(no_program)?
            .try_into()
            .map_err(|_| no_program())?;
        if !self.loaded.contains(name) {
            prog.load().map_err(|source| DatapathError::ProgramLoad {
                name: name.to_string(),
                source: Box::new(source),
            })?;
            self.loaded.insert(name.to_string());
        }
        Ok(prog)
    }

    /// Runs `program` `repeat` times over `packet` with `BPF_PROG_TEST_RUN`, as
    /// if it arrived on the interface with `ifindex` (1 = loopback, always
    /// present). Returns the program's verdict and the kernel-measured mean
    /// time per run. The kernel reuses one skb for all repeats, so a program
    /// that rewrites the packet sees its own output from the second run on.
    ///
    /// # Errors
    /// Unknown program, verifier refusal, or the syscall failed.
    ///
    /// # Minimum kernel version
    /// 4.12; setting the ifindex through the context needs 5.10.
    pub fn test_run(
        &mut self,
        program: &str,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(i32, std::time::Duration), DatapathError> {
        self.test_run_inner(program, packet, ifindex, repeat)
            .map(|(ret, took, _)| (ret, took))
    }

    /// One [`Self::test_run`] that also returns the packet as the program
    /// left it (a reply written in place, a translated header).
    ///
    /// # Errors
    /// As [`Self::test_run`].
    pub fn test_run_packet(
        &mut self,
        program: &str,
        packet: &[u8],
        ifindex: u32,
    ) -> Result<(i32, Vec<u8>), DatapathError> {
        self.test_run_inner(program, packet, ifindex, 1)
            .map(|(ret, _, out)| (ret, out))
    }

    fn test_run_inner(
        &mut self,
        program: &str,
        packet: &[u8],
        ifindex: u32,
        repeat: u32,
    ) -> Result<(i32, std::time::Duration, Vec<u8>), DatapathError> {
        use aya::programs::{TestRun, TestRunOptions};
        /// `sizeof(struct __sk_buff)` and the offset of its `ifindex` field.
        const SKB_CTX_SIZE: usize = 192;
        const SKB_IFINDEX: usize = 40;
        let mut ctx = [0u8; SKB_CTX_SIZE];
        ctx[SKB_IFINDEX..SKB_IFINDEX + 4].copy_from_slice(&ifindex.to_ne_bytes());
        let mut out = vec![0u8; packet.len() + 256];
        let prog = self.program(program)?;
        let result = prog
            .test_run(TestRunOptions {
                data_in: Some(packet),
                data_out: Some(&mut out),
                ctx_in: Some(&ctx),
                repeat,
                ..Default::default()
            })
            .map_err(|source| DatapathError::ProgramLoad {
                name: program.to_string(),
                source: Box::new(source),
            })?;
        out.truncate(result.data_size_out as usize);
        Ok((result.return_value as i32, result.duration, out))
    }
}
