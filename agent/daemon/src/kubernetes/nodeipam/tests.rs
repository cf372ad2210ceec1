//! The NodeIPAM pass on an in-memory object and an in-memory allocator
//! (the core's pool manager): what is created, patched and recorded, and
//! what the allocator serves. The door end to end, with agents, the CNI
//! plugin and the API double, is `tests/tests/kubernetes_nodeipam.rs`.

use std::sync::{Arc, Mutex};

use lockstep_core::cidr::Family;
use lockstep_core::manager::{ManagerConfig, PoolManager, StaticPools};
use lockstep_core::owner::Owner;

use super::crd::{NodeIPAMStatus, PoolOffer};
use super::*;

#[derive(Default)]
struct MemApi {
    obj: Mutex<Option<NodeIPAM>>,
    /// Every write: (what, body).
    writes: Mutex<Vec<(&'static str, Value)>>,
    /// The object changes (a new resourceVersion) right before the next
    /// status write, as an operator's write racing the agent's would.
    race: Mutex<bool>,
}

impl MemApi {
    fn offer(&self, pools: &[(&str, &[&str])]) {
        let mut g = self.obj.lock().unwrap();
        let o = g.as_mut().expect("object");
        let status = o.status.get_or_insert_with(NodeIPAMStatus::default);
        status.pools = Some(
            pools
                .iter()
                .map(|(n, c)| PoolOffer {
                    name: (*n).into(),
                    ipv4: c.iter().map(|s| (*s).to_string()).collect(),
                    ipv6: Vec::new(),
                })
                .collect(),
        );
        bump(o);
    }

    fn spec(&self) -> NodeIPAMSpec {
        self.obj
            .lock()
            .unwrap()
            .as_ref()
            .expect("object")
            .spec
            .clone()
    }

    fn condition(&self, t: &str) -> (String, String, String) {
        let g = self.obj.lock().unwrap();
        let c = g
            .as_ref()
            .and_then(|o| o.status.as_ref())
            .and_then(|s| s.conditions.iter().find(|c| c.type_ == t).cloned())
            .expect("condition");
        (c.status, c.reason, c.message)
    }

    fn writes(&self) -> usize {
        self.writes.lock().unwrap().len()
    }
}

fn bump(o: &mut NodeIPAM) {
    let rv: u64 = o
        .metadata
        .resource_version
        .as_deref()
        .unwrap_or("0")
        .parse()
        .unwrap();
    o.metadata.resource_version = Some((rv + 1).to_string());
}

fn conflict() -> KubeError {
    KubeError::Api {
        what: "patch".into(),
        source: Box::new(kube::Error::Api(
            kube::core::Status::failure("changed", "Conflict")
                .with_code(409)
                .boxed(),
        )),
    }
}

impl NodeIpamApi for Arc<MemApi> {
    async fn ready(&self) {}

    async fn changed(&self) {
        std::future::pending::<()>().await;
    }

    fn current(&self) -> Option<NodeIPAM> {
        self.obj.lock().unwrap().clone()
    }

    async fn create(&self, spec: NodeIPAMSpec) -> Result<(), KubeError> {
        self.writes
            .lock()
            .unwrap()
            .push(("create", serde_json::to_value(&spec).unwrap()));
        let mut o = NodeIPAM::new("node-1", spec);
        o.metadata.resource_version = Some("1".into());
        *self.obj.lock().unwrap() = Some(o);
        Ok(())
    }

    async fn patch_spec(&self, patch: Value) -> Result<NodeIPAM, KubeError> {
        self.writes.lock().unwrap().push(("spec", patch.clone()));
        let mut g = self.obj.lock().unwrap();
        let o = g.as_mut().expect("object");
        // A merge patch replaces arrays whole: `pools` is the agent's.
        o.spec = serde_json::from_value(patch["spec"].clone()).unwrap();
        bump(o);
        Ok(o.clone())
    }

    async fn patch_status(&self, patch: Value) -> Result<(), KubeError> {
        let mut g = self.obj.lock().unwrap();
        let o = g.as_mut().expect("object");
        if std::mem::take(&mut *self.race.lock().unwrap()) {
            bump(o);
        }
        if patch["metadata"]["resourceVersion"].as_str() != o.metadata.resource_version.as_deref() {
            return Err(conflict());
        }
        self.writes.lock().unwrap().push(("status", patch.clone()));
        let status = o.status.get_or_insert_with(NodeIPAMStatus::default);
        status.conditions = serde_json::from_value(patch["status"]["conditions"].clone()).unwrap();
        bump(o);
        Ok(())
    }
}

struct MemAlloc {
    configured: Vec<PoolSpec>,
    manager: PoolManager<StaticPools>,
}

impl MemAlloc {
    fn new(configured: Vec<PoolSpec>, start: Vec<PoolSpec>) -> Arc<Mutex<Self>> {
        let mut all = configured.clone();
        all.extend(start);
        let mut manager = PoolManager::new(StaticPools(all), ManagerConfig::default()).unwrap();
        assert!(manager.sync().errors.is_empty());
        Arc::new(Mutex::new(Self {
            configured,
            manager,
        }))
    }

    fn add(&mut self, pool: &str, id: &str) -> Result<IpAddr, String> {
        self.manager
            .allocate_next(pool, Family::V4, Owner::endpoint(id, "eth0"))
            .map(|a| a.address)
            .map_err(|e| e.to_string())
    }

    fn del(&mut self, pool: &str, id: &str) {
        let o = Owner::endpoint(id, "eth0");
        let g = self.manager.get(pool, Family::V4, &o).unwrap().generation;
        self.manager.release(pool, Family::V4, &o, g).unwrap();
    }
}

use std::net::IpAddr;

impl Allocator for MemAlloc {
    fn usage(&self, cidrs: &[IpNet]) -> Vec<u64> {
        cidrs
            .iter()
            .map(|c| {
                self.manager
                    .allocations()
                    .filter(|a| c.contains(&a.address))
                    .count() as u64
            })
            .collect()
    }

    fn configured(&self) -> Vec<PoolSpec> {
        self.configured.clone()
    }

    fn set_pools(&mut self, specs: Vec<PoolSpec>) -> Result<(), String> {
        let mut all = self.configured.clone();
        all.extend(specs);
        self.manager.source_mut().0 = all;
        let r = self.manager.sync();
        if r.errors.is_empty() {
            Ok(())
        } else {
            Err(format!("{:?}", r.errors))
        }
    }
}

impl AgentSlot for Arc<Mutex<MemAlloc>> {
    async fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce(&mut dyn Allocator) -> T + Send + 'static,
    ) -> Result<T, KubeError> {
        Ok(f(&mut *self.lock().unwrap()))
    }
}

fn pools() -> Vec<NodePool> {
    vec![
        NodePool {
            name: "eni".into(),
            allow_first_last: true,
            skip_masquerade: false,
            mode: DemandMode::Linear,
            pre_allocate: 2,
        },
        NodePool {
            name: "burst".into(),
            allow_first_last: true,
            skip_masquerade: false,
            mode: DemandMode::Ceil { block_size: 16 },
            pre_allocate: 2,
        },
    ]
}

struct Rig {
    api: Arc<MemApi>,
    alloc: Arc<Mutex<MemAlloc>>,
    sync: NodeIpamSync<Arc<MemApi>, Arc<Mutex<MemAlloc>>>,
    dir: tempfile::TempDir,
}

fn rig() -> Rig {
    let dir = tempfile::tempdir().unwrap();
    let api = Arc::new(MemApi::default());
    let configured = vec![PoolSpec::new("local").with_cidr("10.244.0.0/16".parse().unwrap())];
    let alloc = MemAlloc::new(configured, Vec::new());
    let sync = NodeIpamSync::new(
        api.clone(),
        alloc.clone(),
        pools(),
        dir.path().to_path_buf(),
        Duration::from_secs(1),
    )
    .unwrap();
    Rig {
        api,
        alloc,
        sync,
        dir,
    }
}

fn requested(spec: &NodeIPAMSpec) -> Vec<(String, u64, Vec<String>)> {
    spec.pools
        .iter()
        .map(|p| (p.name.clone(), p.requested, p.cidrs.clone()))
        .collect()
}

fn s(v: &[&str]) -> Vec<String> {
    v.iter().map(|x| (*x).to_string()).collect()
}

#[tokio::test]
async fn the_object_is_made_and_requested_follows_demand_in_both_modes() {
    let mut r = rig();
    r.sync.pass().await.unwrap();
    // No object: made with the demand of nothing in use.
    assert_eq!(
        requested(&r.api.spec()),
        [("eni".into(), 2, vec![]), ("burst".into(), 16, vec![])]
    );
    assert_eq!(r.api.spec().pools[1].block_size, Some(16));
    r.api.offer(&[
        ("eni", &["10.9.0.0/28", "10.9.0.16/28"]),
        ("burst", &["10.9.1.0/28"]),
    ]);
    r.sync.pass().await.unwrap();
    assert_eq!(r.api.condition("Accepted").0, "True");
    for i in 0..17 {
        r.alloc
            .lock()
            .unwrap()
            .add("eni", &format!("e{i}"))
            .unwrap();
    }
    for i in 0..15 {
        r.alloc
            .lock()
            .unwrap()
            .add("burst", &format!("b{i}"))
            .unwrap();
    }
    r.sync.pass().await.unwrap();
    // linear: 17 + 2; ceil: 15 + 2 rounded up to 16s.
    assert_eq!(
        requested(&r.api.spec()),
        [
            ("eni".into(), 19, s(&["10.9.0.0/28", "10.9.0.16/28"])),
            ("burst".into(), 32, s(&["10.9.1.0/28"]))
        ]
    );
    for i in 0..10 {
        r.alloc.lock().unwrap().del("eni", &format!("e{i}"));
        r.alloc.lock().unwrap().del("burst", &format!("b{i}"));
    }
    r.sync.pass().await.unwrap();
    assert_eq!(r.api.spec().pools[0].requested, 9);
    assert_eq!(r.api.spec().pools[1].requested, 16);
    // Nothing changed: nothing written.
    let writes = r.api.writes();
    r.sync.pass().await.unwrap();
    assert_eq!(r.api.writes(), writes);
}

#[tokio::test]
async fn a_bad_status_is_refused_whole_and_nothing_held_changes() {
    let mut r = rig();
    r.sync.pass().await.unwrap();
    r.api.offer(&[("eni", &["10.9.0.0/28", "10.9.0.16/28"])]);
    r.sync.pass().await.unwrap();
    for i in 0..20 {
        r.alloc
            .lock()
            .unwrap()
            .add("eni", &format!("e{i}"))
            .unwrap();
    }
    r.sync.pass().await.unwrap();
    let record = std::fs::read(r.dir.path().join(RECORD)).unwrap();
    let spec = r.api.spec();
    // The operator's next status drops 10.9.0.16/28 (in use) but is bad:
    // an overlap with a configured pool and a CIDR that is none.
    r.api
        .offer(&[("eni", &["10.9.0.0/28", "10.244.3.0/28", "10.9.2.0/33"])]);
    r.sync.pass().await.unwrap();
    let (status, reason, message) = r.api.condition("Accepted");
    assert_eq!((status.as_str(), reason.as_str()), ("False", "Refused"));
    assert!(
        message.contains("10.244.3.0/28 overlaps 10.244.0.0/16 of the configured pool local")
            && message.contains("\"10.9.2.0/33\" is not a CIDR"),
        "{message}"
    );
    // Nothing drained, nothing recorded, the spec as it was.
    assert_eq!(std::fs::read(r.dir.path().join(RECORD)).unwrap(), record);
    assert_eq!(r.api.spec(), spec);
    assert_eq!(r.api.condition("Draining").0, "False");
    r.alloc.lock().unwrap().add("eni", "e20").unwrap();
}

#[tokio::test]
async fn a_withdrawn_cidr_drains_and_leaves_the_spec_once_empty() {
    let mut r = rig();
    r.sync.pass().await.unwrap();
    r.api.offer(&[("eni", &["10.9.0.0/28", "10.9.0.16/28"])]);
    r.sync.pass().await.unwrap();
    for i in 0..20 {
        r.alloc
            .lock()
            .unwrap()
            .add("eni", &format!("e{i}"))
            .unwrap();
    }
    r.api.offer(&[("eni", &["10.9.0.0/28"])]);
    r.sync.pass().await.unwrap();
    let (status, reason, message) = r.api.condition("Draining");
    assert_eq!((status.as_str(), reason.as_str()), ("True", "Withdrawn"));
    assert!(
        message.starts_with("10.9.0.16/28 of pool eni: 4 address(es) still in use"),
        "{message}"
    );
    // Still held (listed), still counted; nothing new from it.
    assert_eq!(
        requested(&r.api.spec())[0],
        ("eni".into(), 22, s(&["10.9.0.0/28", "10.9.0.16/28"]))
    );
    assert!(r.alloc.lock().unwrap().add("eni", "new").is_err());
    assert_eq!(load_record(r.dir.path()).unwrap().of("eni").len(), 2);
    // Its endpoints go: released, gone from the spec and the record.
    for i in 16..20 {
        r.alloc.lock().unwrap().del("eni", &format!("e{i}"));
    }
    r.sync.pass().await.unwrap();
    assert_eq!(
        requested(&r.api.spec())[0],
        ("eni".into(), 18, s(&["10.9.0.0/28"]))
    );
    assert_eq!(r.api.condition("Draining").0, "False");
    assert_eq!(
        load_record(r.dir.path()).unwrap().of("eni"),
        vec!["10.9.0.0/28".parse::<IpNet>().unwrap()]
    );
}

#[tokio::test]
async fn conditions_never_land_on_an_offer_they_do_not_describe() {
    let mut r = rig();
    r.sync.pass().await.unwrap();
    r.api.offer(&[("eni", &["10.9.0.0/28"])]);
    *r.api.race.lock().unwrap() = true;
    // The object changed under the pass: the guarded write is refused
    // (409), the pass is not an error, and the next one writes.
    r.sync.pass().await.unwrap();
    assert!(
        r.api
            .obj
            .lock()
            .unwrap()
            .as_ref()
            .unwrap()
            .status
            .as_ref()
            .unwrap()
            .conditions
            .is_empty()
    );
    r.sync.pass().await.unwrap();
    assert_eq!(r.api.condition("Accepted").0, "True");
}

#[tokio::test]
async fn a_restart_serves_the_recorded_cidrs_before_the_api_answers() {
    let mut r = rig();
    r.sync.pass().await.unwrap();
    r.api.offer(&[("eni", &["10.9.0.0/28", "10.9.0.16/28"])]);
    r.sync.pass().await.unwrap();
    for i in 0..20 {
        r.alloc
            .lock()
            .unwrap()
            .add("eni", &format!("e{i}"))
            .unwrap();
    }
    r.api.offer(&[("eni", &["10.9.0.0/28"])]);
    r.sync.pass().await.unwrap();
    let stored: Vec<_> = r
        .alloc
        .lock()
        .unwrap()
        .manager
        .allocations()
        .cloned()
        .collect();
    let generation = r.alloc.lock().unwrap().manager.generation();
    // A new agent: the pools from the record alone, then the store.
    let configured = r.alloc.lock().unwrap().configured.clone();
    let specs = start_specs(r.dir.path(), &pools(), &configured).unwrap();
    let mut all = configured.clone();
    all.extend(specs);
    let mut m = PoolManager::new(StaticPools(all), ManagerConfig::default()).unwrap();
    assert!(m.sync().errors.is_empty());
    let (outcome, _kept) = m.restore_keeping(generation, stored.clone());
    assert!(outcome.rejected.is_empty(), "{:?}", outcome.rejected);
    assert_eq!(m.allocations().count(), 20);
    // The serving /28 is full, the draining one gives nothing new.
    assert!(
        m.allocate_next("eni", Family::V4, Owner::endpoint("new", "eth0"))
            .is_err()
    );
    // A record the configuration now overlaps refuses to start.
    let clash = vec![PoolSpec::new("local").with_cidr("10.9.0.0/24".parse().unwrap())];
    let e = start_specs(r.dir.path(), &pools(), &clash).unwrap_err();
    assert!(
        e.contains("10.9.0.0/28 overlaps 10.9.0.0/24 of the configured pool local"),
        "{e}"
    );
    // An unreadable one too, naming the file.
    std::fs::write(r.dir.path().join(RECORD), b"{").unwrap();
    let e = start_specs(r.dir.path(), &pools(), &configured).unwrap_err();
    assert!(e.contains("nodeipam.json is unreadable"), "{e}");
}
