//! An agent's death withdraws its LoadBalancer routes at its lease's
//! expiry (#48 item 3, "agent SIGKILL: LB routes gone at lease expiry"):
//! the agent, BIRD and `lockstep bird-keeper` in a node namespace, FRR in
//! a neighbour; the test reads FRR's kernel table and message counters.
//!
//! - The agent restarted within `[bgp] withdraw_after` (an upgrade): the
//!   router receives not one update.
//! - The agent SIGKILLed: the route leaves the router's table once the
//!   agent has been silent for `withdraw_after`, not before; the node's
//!   pod block stays announced (the node still holds it, its pods still
//!   run) and the session stays up.
//! - The agent started again: the route is back.

use std::time::Duration;

use anyhow::{Context, ensure};
use lockstep_tests::bgp::{AgentLab, Keeper, Lab, service};
use lockstep_tests::privileged;

/// `section`'s `withdraw_after` (tests/src/bgp.rs).
const LEASE: Duration = Duration::from_secs(5);

/// The agent's pod pool (`AgentLab`), announced here.
const BLOCK: &str = "10.80.0.0/24";

fn updates(lab: &Lab) -> anyhow::Result<u64> {
    let r = &lab.routers[0];
    let n = r.frr.neighbor(&r.node_addr)?;
    n["messageStats"]["updatesRecv"]
        .as_u64()
        .with_context(|| format!("no messageStats.updatesRecv in {n}"))
}

#[test]
fn a_killed_agent_s_routes_are_withdrawn_at_its_lease_and_an_upgrade_sends_nothing()
-> anyhow::Result<()> {
    privileged!();
    let mut al = AgentLab::start_with("[bgp.pools.pods]\n")?;
    let established = al.lab.settled(0)?;
    let keeper = Keeper::start(&al.lab.node, &al.agent)?;
    let r = scenario(&mut al, established);
    if r.is_err() {
        eprintln!(
            "--- agent ---\n{}\n--- keeper ---\n{}\n--- bird ---\n{}",
            al.agent.log(),
            keeper.log(),
            al.lab.bird.log()
        );
    }
    r
}

fn scenario(al: &mut AgentLab, established: u64) -> anyhow::Result<()> {
    al.agent.lb_apply(&serde_json::json!({"pools": [
        {"name": "public", "cidrs": ["198.51.100.16/28"],
         "serviceSelector": {"matchLabels": {"pool": "public"}}}
    ]}))?;
    let view = al
        .agent
        .lb_apply(&serde_json::json!({"services": [service("shop", "web", "public")]}))?;
    let addr = view["services"]["shop/web"]["assignment"]["addresses"][0]
        .as_str()
        .with_context(|| format!("no address in {view}"))?
        .to_string();
    al.lab
        .routes_become(0, &[addr.as_str(), BLOCK], Duration::from_secs(5))?;
    let status = al.agent.json(["status", "-o", "json"])?;
    ensure!(
        status["bgp"]["blocks"] == serde_json::json!([BLOCK]),
        "status does not name the pod block: {}",
        status["bgp"]
    );
    let text = String::from_utf8(al.agent.cli(["status"])?.stdout)?;
    ensure!(
        text.contains(&format!("bgp pod blocks: {BLOCK}")),
        "status:\n{text}"
    );

    // An upgrade: killed and started again within the lease.
    let before = updates(&al.lab)?;
    let took = al.agent.restart()?;
    ensure!(
        took < LEASE,
        "the agent took {took:?} to start again, past the lease"
    );
    // Past the lease after the kill: the keeper would have acted by now.
    std::thread::sleep(LEASE + Duration::from_secs(1));
    al.lab
        .routes_become(0, &[addr.as_str(), BLOCK], Duration::ZERO)?;
    let after = updates(&al.lab)?;
    eprintln!("agent restarted in {took:?}: updates at the router {before} -> {after}");
    ensure!(
        after == before,
        "an agent restart within the lease reached the router: updates {before} -> {after}"
    );

    // SIGKILL: withdrawn once the agent has been silent for the lease;
    // the pod block stays.
    al.agent.kill9();
    let gone = al
        .lab
        .routes_become(0, &[BLOCK], LEASE + Duration::from_secs(3))?;
    eprintln!(
        "agent killed: its LB route withdrawn at the router after {gone:?} (lease {LEASE:?}), its pod block kept"
    );
    // The last beat was up to a second before the kill.
    ensure!(
        gone + Duration::from_secs(1) >= LEASE,
        "withdrawn {gone:?} after the kill, before the lease ({LEASE:?}) ran out"
    );
    ensure!(
        gone <= LEASE + Duration::from_secs(1),
        "withdrawn {gone:?} after the kill: more than a second past the lease"
    );
    ensure!(
        al.lab.established_count(0)? == established,
        "the withdrawal reset the session"
    );

    // Back: the route returns.
    al.agent.respawn()?;
    al.agent.wait_ready()?;
    let back = al
        .lab
        .routes_become(0, &[addr.as_str(), BLOCK], Duration::from_secs(5))?;
    eprintln!("agent started again: route back after {back:?} from ready");
    ensure!(
        al.lab.established_count(0)? == established,
        "the return reset the session"
    );
    Ok(())
}
