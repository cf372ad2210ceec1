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
//! # Minimum kernel version
//! TCX links need Linux 6.6; older kernels fall back to clsact + netlink
//! filters, which cannot be pinned (they are re-attached on every start).
//! Batch map updates need 5.6.

pub mod events;
pub mod maps;
pub mod owner;
pub mod pins;
pub mod sys;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};

use aya::maps::{MapData, MapInfo, MapType};
use aya::programs::links::{FdLink, LinkOrder, PinnedLink};
use aya::programs::tc::{NlOptions, SchedClassifierLink, TcAttachOptions, TcHandle};
use aya::programs::{ProgramError, SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader};
use lockstep_common::{
    Counter, EndpointSlot, EndpointValue, IpcacheValue, L2RespSlot, L2RespValue, LPM_V4_KEY_SIZE,
    LPM_V6_KEY_SIZE, MasqSkipValue, map_names, max_entries, program_names,
};

pub use maps::PinnedMaps;
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

/// The definition of a map, as checked against an existing pin.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MapDefinition {
    /// Kernel map type.
    pub map_type: MapType,
    /// Key size in bytes.
    pub key_size: u32,
    /// Value size in bytes.
    pub value_size: u32,
    /// Capacity.
    pub max_entries: u32,
}

impl fmt::Display for MapDefinition {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?} key {} B value {} B max_entries {}",
            self.map_type, self.key_size, self.value_size, self.max_entries
        )
    }
}

impl MapDefinition {
    fn of_info(info: &MapInfo) -> Result<Self, aya::maps::MapError> {
        Ok(Self {
            map_type: info.map_type()?,
            key_size: info.key_size(),
            value_size: info.value_size(),
            max_entries: info.max_entries(),
        })
    }

    /// Whether entries can be copied byte for byte from a map of `other`'s
    /// definition into one of this definition.
    pub fn same_layout(&self, other: &MapDefinition) -> bool {
        self.map_type == other.map_type
            && self.key_size == other.key_size
            && self.value_size == other.value_size
    }
}

/// Capacities of the resizable maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapCapacities {
    /// Each IPCACHE map (tries and host hashes).
    pub ipcache: u32,
    /// MASQ_SKIP_V4 and MASQ_SKIP_V6.
    pub masq_skip: u32,
    /// ENDPOINTS.
    pub endpoints: u32,
    /// L2_RESP_V4.
    pub l2_resp: u32,
}

impl Default for MapCapacities {
    fn default() -> Self {
        Self {
            ipcache: max_entries::IPCACHE,
            masq_skip: max_entries::MASQ_SKIP,
            endpoints: max_entries::ENDPOINTS,
            l2_resp: max_entries::L2_RESP,
        }
    }
}

/// The definition of every map this build uses, by name.
pub fn expected_definitions(caps: &MapCapacities) -> BTreeMap<&'static str, MapDefinition> {
    let lpm = |key_size: usize, value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::LpmTrie,
        key_size: key_size as u32,
        value_size: value_size as u32,
        max_entries,
    };
    let hash = |key_size: usize, value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::Hash,
        key_size: key_size as u32,
        value_size: value_size as u32,
        max_entries,
    };
    let array = |value_size: usize, max_entries: u32| MapDefinition {
        map_type: MapType::Array,
        key_size: 4,
        value_size: value_size as u32,
        max_entries,
    };
    BTreeMap::from([
        (
            map_names::IPCACHE_V4,
            lpm(LPM_V4_KEY_SIZE, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_V6,
            lpm(LPM_V6_KEY_SIZE, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_HOST_V4,
            hash(4, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::IPCACHE_HOST_V6,
            hash(16, size_of::<IpcacheValue>(), caps.ipcache),
        ),
        (
            map_names::MASQ_SKIP_V4,
            lpm(LPM_V4_KEY_SIZE, size_of::<MasqSkipValue>(), caps.masq_skip),
        ),
        (
            map_names::MASQ_SKIP_V6,
            lpm(LPM_V6_KEY_SIZE, size_of::<MasqSkipValue>(), caps.masq_skip),
        ),
        (
            map_names::ENDPOINTS,
            hash(4, size_of::<EndpointValue>(), caps.endpoints),
        ),
        (
            map_names::L2_RESP_V4,
            hash(4, size_of::<L2RespValue>(), caps.l2_resp),
        ),
        (
            map_names::ENDPOINT_SLOTS,
            array(size_of::<EndpointSlot>(), max_entries::ENDPOINT_SLOTS),
        ),
        (
            map_names::L2_RESP_SLOTS,
            array(size_of::<L2RespSlot>(), max_entries::L2_RESP_SLOTS),
        ),
        (
            map_names::COUNTERS,
            MapDefinition {
                map_type: MapType::PerCpuArray,
                key_size: 4,
                value_size: 8,
                max_entries: Counter::COUNT,
            },
        ),
        (map_names::DATAPATH_DEBUG, array(size_of::<u32>(), 1)),
    ])
}

/// Checks an existing pin's definition against the expected one.
///
/// # Errors
/// [`DatapathError::PinIncompatible`] naming the pin and both definitions.
pub fn check_pin(
    pin: &Path,
    expected: &MapDefinition,
    found: &MapDefinition,
) -> Result<(), DatapathError> {
    if expected == found {
        Ok(())
    } else {
        Err(DatapathError::PinIncompatible {
            pin: pin.to_path_buf(),
            expected: *expected,
            found: *found,
        })
    }
}

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
    owner: Option<owner::OwnerGuard>,
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
            Some(me) => Some(owner::claim(&opts.pin_root, me, opts.take_over_pin_root)?),
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
                copy_entries(name, &old, &new, &new_def)?;
            }
            migrated.push(name.to_string());
        }
        Ok(Self {
            ebpf,
            opts,
            loaded: BTreeSet::new(),
            migrated,
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
        self.owner.as_ref()
    }

    /// Every map pin that does not name the map the programs use: removed,
    /// replaced by another object, or unreadable.
    pub fn pin_faults(&self) -> Vec<PinFault> {
        pins::faults(&self.held, &self.opts.maps_dir())
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
        Ok((result.return_value as i32, result.duration))
    }

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

fn copy_entries(
    name: &str,
    old: &MapData,
    new: &MapData,
    def: &MapDefinition,
) -> Result<(), DatapathError> {
    let migrate = |source| DatapathError::Migrate {
        map: name.to_string(),
        source,
    };
    if def.map_type == MapType::PerCpuArray {
        // Per-CPU counters restart from zero; they are rates, not state.
        return Ok(());
    }
    let entries =
        sys::dump_raw(old.fd(), def.key_size as usize, def.value_size as usize).map_err(migrate)?;
    for (k, v) in entries {
        sys::update_raw(new.fd(), &k, &v).map_err(migrate)?;
    }
    Ok(())
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

    #[test]
    fn expected_definitions_follow_the_shared_types() {
        let defs = expected_definitions(&MapCapacities::default());
        assert_eq!(defs.len(), map_names::ALL.len());
        for name in map_names::ALL {
            assert!(defs.contains_key(name), "{name} has no definition");
        }
        let v4 = defs[map_names::IPCACHE_V4];
        assert_eq!(v4.map_type, MapType::LpmTrie);
        assert_eq!(v4.key_size, 8);
        assert_eq!(v4.value_size, 32);
        assert_eq!(defs[map_names::IPCACHE_V6].key_size, 20);
        assert_eq!(defs[map_names::ENDPOINTS].value_size, 48);
        assert_eq!(defs[map_names::L2_RESP_V4].value_size, 16);
        assert_eq!(defs[map_names::COUNTERS].max_entries, Counter::COUNT);
    }

    #[test]
    fn capacities_change_only_max_entries() {
        let caps = MapCapacities {
            ipcache: 16,
            ..MapCapacities::default()
        };
        let small = expected_definitions(&caps);
        let default = expected_definitions(&MapCapacities::default());
        let (a, b) = (small[map_names::IPCACHE_V4], default[map_names::IPCACHE_V4]);
        assert_eq!(a.max_entries, 16);
        assert!(a.same_layout(&b));
        assert_ne!(a, b);
    }

    #[test]
    fn pin_check_accepts_equal_definitions() {
        let def = expected_definitions(&MapCapacities::default())[map_names::ENDPOINTS];
        assert!(check_pin(Path::new("/x"), &def, &def).is_ok());
    }

    #[test]
    fn pin_check_names_the_pin_and_both_definitions() {
        let want = expected_definitions(&MapCapacities::default())[map_names::IPCACHE_V4];
        for found in [
            MapDefinition {
                value_size: 16,
                ..want
            },
            MapDefinition {
                key_size: 20,
                ..want
            },
            MapDefinition {
                max_entries: 7,
                ..want
            },
            MapDefinition {
                map_type: MapType::Hash,
                ..want
            },
        ] {
            let err = check_pin(Path::new("/sys/fs/bpf/t/maps/IPCACHE_V4"), &want, &found)
                .expect_err("a differing definition must be refused");
            let text = err.to_string();
            assert!(text.contains("/sys/fs/bpf/t/maps/IPCACHE_V4"), "{text}");
            assert!(text.contains(&want.to_string()), "{text}");
            assert!(text.contains(&found.to_string()), "{text}");
        }
    }

    #[test]
    fn layout_sameness_ignores_capacity_only() {
        let want = expected_definitions(&MapCapacities::default())[map_names::ENDPOINTS];
        assert!(want.same_layout(&MapDefinition {
            max_entries: 1,
            ..want
        }));
        assert!(!want.same_layout(&MapDefinition {
            value_size: 56,
            ..want
        }));
    }

    #[test]
    fn netlink_slots_differ_per_program() {
        let slots: BTreeSet<u16> = program_names::ALL
            .iter()
            .map(|p| netlink_slot(p).0)
            .collect();
        assert_eq!(slots.len(), program_names::ALL.len());
    }
}
