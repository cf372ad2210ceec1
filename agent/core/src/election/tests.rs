use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const DURATION: u64 = 1000;
const DEADLINE: u64 = 750;

fn lease(holder: Option<&str>, version: &str) -> Observed {
    Observed {
        holder: holder.map(str::to_owned),
        version: version.into(),
        duration_ms: DURATION,
        transitions: 0,
    }
}

fn elector(me: &str) -> Elector {
    Elector::new(me, DURATION, DEADLINE).expect("a valid election")
}

#[test]
fn a_deadline_not_shorter_than_the_duration_is_refused() {
    let e = Elector::new("a", 1000, 1000).expect_err("equal is refused");
    assert!(e.to_string().contains("must be shorter"), "{e}");
    assert!(Elector::new("a", 1000, 0).is_err());
}

#[test]
fn no_record_is_created_and_held_until_the_deadline_after_sending() {
    let mut a = elector("a");
    let step = a.observe(None, 100);
    assert_eq!(
        step,
        Step::Write(Write {
            holder: Some("a".into()),
            version: None,
            acquire: true,
            transitions: 0,
        })
    );
    assert_eq!(a.holds(120), None, "not before the write landed");
    a.written("w");
    assert_eq!(a.holds(120), Some(100 + DEADLINE));
    assert_eq!(a.holds(100 + DEADLINE), None, "the deadline ends it");
}

#[test]
fn another_holder_is_followed_until_its_record_stops_changing_for_a_duration() {
    let mut b = elector("b");
    assert_eq!(
        b.observe(Some(lease(Some("a"), "1")), 0),
        Step::Follow { holder: "a".into() }
    );
    // Renewed: the clock starts again from when b saw the new version.
    assert!(matches!(
        b.observe(Some(lease(Some("a"), "2")), 900),
        Step::Follow { .. }
    ));
    assert!(matches!(
        b.observe(Some(lease(Some("a"), "2")), 1899),
        Step::Follow { .. }
    ));
    let Step::Write(w) = b.observe(Some(lease(Some("a"), "2")), 1900) else {
        panic!("expired after a whole duration unchanged");
    };
    assert_eq!(w.version.as_deref(), Some("2"), "guarded by what was read");
    assert!(w.acquire);
    assert_eq!(w.transitions, 1);
}

#[test]
fn a_released_record_is_taken_at_once() {
    let mut b = elector("b");
    let Step::Write(w) = b.observe(Some(lease(None, "5")), 0) else {
        panic!("released: taken");
    };
    assert!(w.acquire);
    let mut c = elector("c");
    assert!(matches!(
        c.observe(Some(lease(Some(""), "5")), 0),
        Step::Write(_)
    ));
}

#[test]
fn a_holder_renews_and_a_failed_renewal_keeps_only_the_old_deadline() {
    let mut a = elector("a");
    a.observe(Some(lease(Some("a"), "3")), 0);
    a.written("w");
    assert_eq!(a.holds(10), Some(DEADLINE));
    a.observe(Some(lease(Some("a"), "4")), 500);
    a.failed();
    assert_eq!(a.holds(600), Some(DEADLINE), "the old deadline stands");
    assert_eq!(a.holds(DEADLINE), None);
}

#[test]
fn seeing_another_holder_stops_acting_at_once() {
    let mut a = elector("a");
    a.observe(Some(lease(Some("a"), "3")), 0);
    a.written("w");
    a.observe(Some(lease(Some("b"), "4")), 100);
    assert_eq!(a.holds(100), None);
}

#[test]
fn release_stops_acting_and_writes_no_holder_only_when_held() {
    let mut a = elector("a");
    assert_eq!(a.release(), None, "never read: nothing to release");
    a.observe(Some(lease(Some("a"), "7")), 0);
    a.written("8");
    let w = a.release().expect("held: released");
    assert_eq!(w.holder, None);
    assert_eq!(
        w.version.as_deref(),
        Some("8"),
        "guarded by the version its own renewal wrote"
    );
    assert_eq!(a.holds(1), None);
    let mut b = elector("b");
    b.observe(Some(lease(Some("a"), "7")), 0);
    assert_eq!(b.release(), None);
}

/// The API server as the election relies on it: one record, a version
/// that grows with every write, writes guarded by the version read.
#[derive(Default)]
struct Server {
    record: Option<(Option<String>, u64, i32)>,
    next: u64,
}

impl Server {
    fn read(&self) -> Option<Observed> {
        self.record.as_ref().map(|(h, v, t)| Observed {
            holder: h.clone(),
            version: v.to_string(),
            duration_ms: DURATION,
            transitions: *t,
        })
    }

    /// The new version, or `None` when refused (409).
    fn write(&mut self, w: &Write) -> Option<String> {
        let current = self.record.as_ref().map(|(_, v, _)| v.to_string());
        if w.version != current {
            return None;
        }
        self.next += 1;
        self.record = Some((w.holder.clone(), self.next, w.transitions));
        Some(self.next.to_string())
    }
}

/// One agent's next event, in the model's time.
#[derive(Clone, Debug)]
enum Next {
    /// Reads; the answer (a snapshot taken now) arrives after `delay`.
    Read,
    /// The answer to a read arrives.
    Answer(Option<Observed>),
    /// The write reaches the server.
    Apply(Write),
    /// The write's answer arrives (`None`: lost; `Some(None)`: refused).
    Reply(Option<Option<String>>),
}

/// One step of the schedule: which agent moves, its network delay, its
/// pause before the next round, and whether a reply is lost.
#[derive(Clone, Debug)]
struct Move {
    agent: usize,
    delay: u64,
    lost: bool,
    stop: bool,
    /// The agent's candidacy flips (its Node cordoned or uncordoned).
    flip: bool,
}

fn moves() -> impl Strategy<Value = Vec<Move>> {
    prop::collection::vec(
        (
            0usize..3,
            prop_oneof![0u64..50, 0u64..3 * DURATION],
            prop::bool::weighted(0.1),
            prop::bool::weighted(0.03),
            prop::bool::weighted(0.05),
        )
            .prop_map(|(agent, delay, lost, stop, flip)| Move {
                agent,
                delay,
                lost,
                stop,
                flip,
            }),
        1..400,
    )
}

/// Runs a schedule: each move advances one agent's next event by its
/// delay; events happen in time order. After each, at most one agent may
/// act. Returns how many times some agent held.
fn run(schedule: &[Move]) -> Result<usize, TestCaseError> {
    let names = ["a", "b", "c"];
    let mut agents: Vec<Elector> = names.iter().map(|n| elector(n)).collect();
    let mut server = Server::default();
    // Each agent's pending event and when it happens.
    let mut next: Vec<(u64, Next)> = vec![(0, Next::Read); 3];
    let mut stopped = [false; 3];
    let mut candidate = [true; 3];
    let mut now = 0u64;
    let mut held = 0usize;
    let mut queue: BTreeMap<(u64, usize), Next> = BTreeMap::new();
    for (i, n) in next.drain(..).enumerate() {
        queue.insert((n.0, i), n.1);
    }
    for m in schedule {
        let Some(((at, i), ev)) = queue.pop_first() else {
            break;
        };
        prop_assert!(at >= now);
        now = at;
        // Which agent's parameters apply: the scheduled move's, when it
        // names this agent; otherwise small ones.
        let (delay, lost, stop) = if m.agent == i {
            (m.delay, m.lost, m.stop)
        } else {
            (m.delay % 50, false, false)
        };
        if m.flip {
            candidate[m.agent] = !candidate[m.agent];
            agents[m.agent].set_candidate(candidate[m.agent], now);
            // Half the time the daemon confirms at once that it stopped
            // answering (`Elector::stopped`): released early.
            if !candidate[m.agent] && m.delay % 2 == 0 {
                agents[m.agent].stopped();
            }
        }
        let follow = match ev {
            Next::Read if stopped[i] => None,
            Next::Read => Some(Next::Answer(server.read())),
            Next::Answer(lease) => match agents[i].observe(lease, now) {
                Step::Write(w) => Some(Next::Apply(w)),
                Step::Follow { .. } => Some(Next::Read),
            },
            Next::Apply(w) => {
                let answer = server.write(&w);
                Some(Next::Reply((!lost).then_some(answer)))
            }
            Next::Reply(outcome) => {
                match outcome {
                    Some(Some(version)) => agents[i].written(&version),
                    _ => agents[i].failed(),
                }
                if stop {
                    stopped[i] = true;
                    if let Some(w) = agents[i].release() {
                        // The release goes out after acting stopped.
                        server.write(&w);
                    }
                }
                Some(Next::Read)
            }
        };
        if let Some(f) = follow {
            queue.insert((now + delay, i), f);
        }
        let holding: Vec<&str> = agents
            .iter()
            .filter(|a| a.holds(now).is_some())
            .map(Elector::me)
            .collect();
        prop_assert!(
            holding.len() <= 1,
            "at {now} ms more than one agent acts as the writer: {holding:?}"
        );
        for (a, c) in agents.iter().zip(candidate) {
            prop_assert!(
                c || a.holds(now).is_none(),
                "at {now} ms {} acts though not a candidate",
                a.me()
            );
        }
        held += holding.len();
    }
    Ok(held)
}

#[test]
fn with_prompt_answers_someone_holds() {
    let schedule: Vec<Move> = (0..60)
        .map(|k| Move {
            agent: k % 3,
            delay: 10,
            lost: false,
            stop: false,
            flip: false,
        })
        .collect();
    let held = run(&schedule).expect("safe");
    assert!(held > 0, "nobody ever held the lease");
}

proptest! {
    #![proptest_config(crate::testing::cases(512))]

    /// Whatever the delays, lost replies and stops, two agents never act
    /// as the writer at the same moment.
    #[test]
    fn never_two_writers_at_once(schedule in moves()) {
        run(&schedule)?;
    }
}

#[test]
fn a_holder_that_may_no_longer_hold_stops_at_once_and_releases_after_its_deadline() {
    let mut a = elector("a");
    a.observe(Some(lease(Some("a"), "3")), 0);
    a.written("4");
    assert_eq!(a.holds(100), Some(DEADLINE));
    a.set_candidate(false, 100);
    assert_eq!(a.holds(100), None, "stops acting at once");
    // Before its deadline: not released yet (its entries still answer).
    assert_eq!(
        a.observe(Some(lease(Some("a"), "4")), 200),
        Step::Follow { holder: "a".into() }
    );
    let Step::Write(w) = a.observe(Some(lease(Some("a"), "4")), DEADLINE) else {
        panic!("released after the deadline");
    };
    assert_eq!(w.holder, None);
    a.written("5");
    assert_eq!(a.holds(DEADLINE + 1), None);
    // Not a candidate: an expired or missing record is not taken.
    assert!(matches!(
        a.observe(Some(lease(None, "5")), 5000),
        Step::Follow { .. }
    ));
    assert!(matches!(a.observe(None, 6000), Step::Follow { .. }));
    // A candidate again: takes it.
    a.set_candidate(true, 7000);
    assert!(matches!(
        a.observe(Some(lease(None, "5")), 7000),
        Step::Write(_)
    ));
}

#[test]
fn a_renewal_landing_after_stepping_aside_makes_no_writer() {
    let mut a = elector("a");
    a.observe(Some(lease(Some("a"), "3")), 0);
    a.written("4");
    // A renewal in flight...
    assert!(matches!(
        a.observe(Some(lease(Some("a"), "4")), 300),
        Step::Write(_)
    ));
    a.set_candidate(false, 310);
    a.written("5");
    assert_eq!(a.holds(320), None);
}

#[test]
fn a_holder_that_stopped_answering_releases_on_its_next_round() {
    let mut a = elector("a");
    let Step::Write(w) = a.observe(None, 0) else {
        panic!("a creates the record")
    };
    assert!(w.acquire);
    a.written("1");
    assert!(a.holds(10).is_some());
    a.stopped();
    assert!(a.holds(10).is_some(), "a candidate is not stopped");
    a.set_candidate(false, 10);
    // Without the confirmation the release waits for the deadline.
    assert!(matches!(
        a.clone().observe(Some(lease(Some("a"), "1")), 20),
        Step::Follow { .. }
    ));
    a.stopped();
    let Step::Write(r) = a.observe(Some(lease(Some("a"), "1")), 20) else {
        panic!("released at once")
    };
    assert_eq!(r.holder, None);
    assert_eq!(a.holds(20), None);
}
