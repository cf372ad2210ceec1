//! The seat keepers against kube-rs's mock service, which keeps Leases
//! as the API server does (create, then replace at the record's
//! `resourceVersion`) or leaves one Lease's requests unanswered.

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use tokio::sync::{Notify, watch};

use super::super::election::{LeaseDoor, elector};
use super::super::local_answers::LocalAnswers;
use super::super::tests::{Handle, mock, reply};
use super::{Links, Seat, Want};
use crate::config::ElectionConfig;

/// One write the API took: when, and the holder it named.
type Writes = Arc<Mutex<Vec<(String, Instant, Option<String>)>>>;

/// Serves `handle`: the Lease named `hung` is never answered (each
/// request waits until the client gives up); every other Lease is kept.
fn serve(mut handle: Handle, hung: &'static str) -> Writes {
    let writes: Writes = Arc::default();
    let log = writes.clone();
    tokio::spawn(async move {
        let mut kept: std::collections::BTreeMap<String, Value> = Default::default();
        let mut waiting = Vec::new();
        let mut version = 0u64;
        while let Some((req, send)) = handle.next_request().await {
            let (parts, body) = req.into_parts();
            let path = parts.uri.path().to_owned();
            let bytes = body.collect_bytes().await.expect("body");
            let mut v: Value = if bytes.is_empty() {
                Value::Null
            } else {
                serde_json::from_slice(&bytes).expect("json")
            };
            let name = match parts.method.as_str() {
                "POST" => v["metadata"]["name"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
                _ => path.rsplit('/').next().unwrap_or_default().to_owned(),
            };
            if name == hung {
                waiting.push(send);
                continue;
            }
            match parts.method.as_str() {
                "GET" => match kept.get(&name) {
                    Some(l) => reply(send, 200, l),
                    None => reply(
                        send,
                        404,
                        &json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                "reason": "NotFound", "code": 404, "message": "not found"}),
                    ),
                },
                "POST" | "PUT" => {
                    version += 1;
                    v["metadata"]["resourceVersion"] = json!(version.to_string());
                    let holder = v["spec"]["holderIdentity"].as_str().map(str::to_owned);
                    log.lock()
                        .expect("log")
                        .push((name.clone(), Instant::now(), holder));
                    kept.insert(name, v.clone());
                    reply(send, 200, &v);
                }
                m => panic!("unexpected {m} {path}"),
            }
        }
    });
    writes
}

struct Lab {
    config: ElectionConfig,
    client: kube::Client,
    answers: watch::Sender<LocalAnswers>,
    applied: watch::Sender<u64>,
    stop: watch::Sender<bool>,
    changed: Arc<Notify>,
}

impl Lab {
    fn new(client: kube::Client, config: ElectionConfig) -> Self {
        Self {
            config,
            client,
            answers: watch::channel(LocalAnswers::default()).0,
            applied: watch::channel(0).0,
            stop: watch::channel(false).0,
            changed: Arc::new(Notify::new()),
        }
    }

    fn seat(&self, lease: &str, addrs: Vec<IpAddr>) -> Seat {
        let links = Links {
            answers: self.answers.subscribe(),
            applied: self.applied.subscribe(),
            changed: self.changed.clone(),
            stop: self.stop.subscribe(),
        };
        Seat::start(
            LeaseDoor::new(self.client.clone(), &self.config, lease),
            elector(&self.config, "node-1").expect("a safe timing"),
            self.config.retry_period,
            Want { here: true, addrs },
            links,
        )
    }
}

fn of(writes: &Writes, lease: &str) -> Vec<(Instant, Option<String>)> {
    writes
        .lock()
        .expect("log")
        .iter()
        .filter(|(n, _, _)| n == lease)
        .map(|(_, t, h)| (*t, h.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_whose_requests_hang_never_delays_another_seats_renewals() {
    let (client, handle) = mock();
    let writes = serve(handle, "lockstep-lb.web.slow");
    let lab = Lab::new(client, ElectionConfig::default());
    let slow = lab.seat("lockstep-lb.web.slow", vec![]);
    let fast = lab.seat("lockstep-lb.web.fast", vec![]);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let held = fast.held();
    lab.stop.send_replace(true);
    fast.join().await;
    slow.join().await;

    let renewals: Vec<Instant> = of(&writes, "lockstep-lb.web.fast")
        .into_iter()
        .filter(|(_, h)| h.as_deref() == Some("node-1"))
        .map(|(t, _)| t)
        .collect();
    // Every retry period (250 ms) for 3 s; the slow Lease's reads each
    // wait the renew deadline (750 ms) before giving up. Renewed in the
    // same round as the slow one, the fast Lease would be renewed only
    // every 1 s: its whole duration.
    let gaps: Vec<Duration> = renewals.windows(2).map(|w| w[1] - w[0]).collect();
    let longest = gaps.iter().max().copied().unwrap_or_default();
    assert!(renewals.len() >= 6, "{} renewals in 3 s", renewals.len());
    assert!(
        longest < lab.config.renew_deadline,
        "longest gap between renewals {longest:?}"
    );
    assert!(held.until_ms.is_some(), "the fast seat held its Lease");
    assert!(of(&writes, "lockstep-lb.web.slow").is_empty());
    // The stop released the fast Lease.
    let last = of(&writes, "lockstep-lb.web.fast").pop().expect("a write");
    assert_eq!(last.1, None, "released at the stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stepping_aside_stops_acting_at_once_and_releases_once_the_datapath_dropped_the_addresses()
{
    let (client, handle) = mock();
    let writes = serve(handle, "none");
    // A long Lease, so its deadline never passes within the test: any
    // release seen is the early one.
    let lab = Lab::new(
        client,
        ElectionConfig {
            lease_duration: Duration::from_secs(20),
            renew_deadline: Duration::from_secs(15),
            ..ElectionConfig::default()
        },
    );
    let web: IpAddr = "192.0.2.7".parse().expect("address");
    let seat = lab.seat("lockstep-lb.web.a", vec![web]);
    let until = tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            if let Some(u) = seat.held().until_ms {
                return u;
            }
            lab.changed.notified().await;
        }
    })
    .await
    .expect("the seat holds in time");
    // What this node answers, as the deriving task would publish it, and
    // written into the datapath.
    lab.answers.send_modify(|a| {
        a.held.insert(web, until * 1_000_000);
        a.version = 1;
    });
    lab.applied.send_replace(1);

    // The endpoint went: the keeper stops acting at once.
    seat.ask(Want {
        here: false,
        addrs: vec![web],
    });
    tokio::time::timeout(Duration::from_secs(1), async {
        while seat.held().until_ms.is_some() {
            lab.changed.notified().await;
        }
    })
    .await
    .expect("stopped acting");
    // The datapath still answers: no release yet.
    lab.answers.send_modify(|a| {
        a.held.clear();
        a.version = 2;
    });
    tokio::time::sleep(Duration::from_millis(400)).await;
    let released = |w: &Writes| of(w, "lockstep-lb.web.a").iter().any(|(_, h)| h.is_none());
    assert!(!released(&writes), "released while the datapath answers");
    // Written into the datapath: released at once.
    let t = Instant::now();
    lab.applied.send_replace(2);
    tokio::time::timeout(Duration::from_secs(2), async {
        while !released(&writes) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .expect("released");
    assert!(
        t.elapsed() < Duration::from_secs(1),
        "released {:?} after the datapath dropped the address",
        t.elapsed()
    );
    lab.stop.send_replace(true);
    seat.join().await;
}
