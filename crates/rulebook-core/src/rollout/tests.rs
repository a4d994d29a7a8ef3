//! The rollout's decisions with plain values: membership, batch figures, the state
//! machine from start to its three ends.

use super::*;

fn plan() -> Plan {
    Plan {
        steps: vec![
            (Target::Parents(1), Duration::ZERO),
            (Target::Percent(10), Duration::from_secs(120)),
            (Target::Percent(100), Duration::ZERO),
        ],
        on_failure: OnFailure::Rollback,
    }
}

fn keys(n: usize) -> Vec<RankKey> {
    let mut k: Vec<RankKey> = (0..n)
        .map(|i| RankKey::of(i == 7, Some("ns"), &format!("p{i}")))
        .collect();
    k.sort();
    k
}

fn placed(mut s: RolloutState, k: &[RankKey], p: &Plan) -> RolloutState {
    s.boundary = boundary(k, p.target(s.step));
    s.boundary_step = Some(s.step);
    s
}

fn moved(s: &RolloutState, n: usize) -> usize {
    (0..n)
        .filter(|i| {
            let f = ParentFacts {
                key: RankKey::of(*i == 7, Some("ns"), &format!("p{i}")),
                status_version: None,
                created: Some(0),
            };
            on_new(s, &f)
        })
        .count()
}

#[test]
fn the_ordered_parents_go_first_and_batches_count_in_all() {
    let k = keys(50);
    assert_eq!(k[0].group, 0, "the parent `order` picks sorts first");
    let p = plan();
    let s = placed(RolloutState::settled("a", 0).next("b", 10), &k, &p);
    assert_eq!(moved(&s, 50), 1);
    // The canary is the ordered parent.
    let canary = ParentFacts {
        key: RankKey::of(true, Some("ns"), "p7"),
        status_version: None,
        created: Some(0),
    };
    assert!(on_new(&s, &canary));
    let s = placed(s.after(&Decision::Advance, 20), &k, &p);
    assert_eq!(moved(&s, 50), 5);
    let s = placed(s.after(&Decision::Advance, 30), &k, &p);
    assert_eq!(moved(&s, 50), 50);
    assert_eq!(s.steps_started, vec![10, 20, 30]);
}

#[test]
fn moved_parents_stay_moved_and_rollback_sends_every_one_back() {
    let p = plan();
    let s = placed(RolloutState::settled("a", 0).next("b", 10), &keys(50), &p);
    // A parent outside the boundary whose status already names the new version (it
    // was relabelled after it moved) stays.
    let far = ParentFacts {
        key: RankKey {
            group: 1,
            hash: u64::MAX,
        },
        status_version: Some("b"),
        created: Some(0),
    };
    assert!(on_new(&s, &far));
    let back = s.after(&Decision::Fail(OnFailure::Rollback, "x".into()), 20);
    assert_eq!(back.phase, Phase::RolledBack);
    assert!(!on_new(&back, &far));
    assert_eq!(moved(&back, 50), 0);
    let paused = s.after(&Decision::Fail(OnFailure::Pause, "x".into()), 20);
    assert_eq!(
        moved(&paused, 50),
        1,
        "a failed rollout that pauses moves nobody back"
    );
    let done = s.after(&Decision::Complete, 20);
    assert_eq!(moved(&done, 50), 50);
}

#[test]
fn parents_created_during_the_first_batch_wait_for_it() {
    let p = plan();
    let s = placed(RolloutState::settled("a", 0).next("b", 10), &keys(3), &p);
    let young = ParentFacts {
        key: RankKey { group: 0, hash: 0 },
        status_version: None,
        created: Some(11),
    };
    assert!(!on_new(&s, &young));
    let s = placed(s.after(&Decision::Advance, 20), &keys(3), &p);
    assert!(on_new(&s, &young));
}

#[test]
fn a_change_during_a_rollout_keeps_what_moved() {
    let s = RolloutState::settled("a", 0).next("b", 10);
    let again = s.next("c", 20);
    assert_eq!((again.from.as_str(), again.to.as_str()), ("a", "c"));
    assert_eq!(again.superseded, vec!["b".to_string()]);
    let on_b = ParentFacts {
        key: RankKey {
            group: 1,
            hash: u64::MAX,
        },
        status_version: Some("b"),
        created: Some(0),
    };
    assert!(on_new(&again, &on_b), "a parent on b never goes back to a");
    let done = s.after(&Decision::Complete, 15).next("c", 20);
    assert_eq!((done.from.as_str(), done.superseded.len()), ("b", 0));
    let back = s
        .after(&Decision::Fail(OnFailure::Rollback, "x".into()), 15)
        .next("c", 20);
    assert_eq!(back.from, "a");
}

#[test]
fn the_batch_figures() {
    let s = RolloutState::settled("a", 0).next("b", 100);
    let h = |on_new, reported_new, ready, since| ParentHealth {
        on_new,
        reported_new,
        ready,
        ready_since: since,
    };
    let b = batch_stats(
        &s,
        [
            h(true, true, true, Some(90)),
            h(true, true, false, Some(130)),
            h(true, false, false, None),
            h(false, false, true, None),
        ],
        160,
    );
    assert_eq!((b.total, b.ready, b.not_ready, b.parents), (3, 1, 2, 4));
    assert_eq!(b.age, 60);
    // Not yet reconciled by the new version: since the step started.
    assert_eq!(b.not_ready_for, 60);
}

#[test]
fn decisions() {
    let p = plan();
    let s = placed(RolloutState::settled("a", 0).next("b", 0), &keys(50), &p);
    let b = BatchStats::default();
    assert_eq!(decide(&s, &p, &b, Ok(true), Ok(false)), Decision::Advance);
    assert!(matches!(
        decide(&s, &p, &b, Ok(false), Ok(false)),
        Decision::Hold(Some(_))
    ));
    assert!(matches!(
        decide(&s, &p, &b, Ok(true), Ok(true)),
        Decision::Fail(OnFailure::Rollback, _)
    ));
    // An expression that fails holds; it never advances.
    assert!(matches!(
        decide(&s, &p, &b, Err("e".into()), Ok(false)),
        Decision::Hold(Some(_))
    ));
    assert!(matches!(
        decide(&s, &p, &b, Ok(true), Err("e".into())),
        Decision::Hold(Some(_))
    ));
    // The pause of step 1 (120 s) is honoured, then the gate decides.
    let s1 = placed(s.after(&Decision::Advance, 0), &keys(50), &p);
    let young = BatchStats {
        age: 119,
        ..Default::default()
    };
    assert!(matches!(
        decide(&s1, &p, &young, Ok(true), Ok(false)),
        Decision::Hold(Some(_))
    ));
    let old = BatchStats {
        age: 120,
        ..Default::default()
    };
    assert_eq!(
        decide(&s1, &p, &old, Ok(true), Ok(false)),
        Decision::Advance
    );
    let s2 = placed(s1.after(&Decision::Advance, 0), &keys(50), &p);
    assert_eq!(
        decide(&s2, &p, &old, Ok(true), Ok(false)),
        Decision::Complete
    );
    // Held by hand, or not placed yet: nothing moves.
    let held = RolloutState {
        held: true,
        ..s2.clone()
    };
    assert!(matches!(
        decide(&held, &p, &old, Ok(true), Ok(false)),
        Decision::Hold(Some(_))
    ));
    let unplaced = s2.after(&Decision::Advance, 0);
    assert!(matches!(
        decide(&unplaced, &p, &old, Ok(true), Ok(false)),
        Decision::Hold(Some(_))
    ));
    // A finished rollout decides nothing more, and holding the same changes nothing.
    let done = s2.after(&Decision::Complete, 0);
    assert_eq!(
        decide(&done, &p, &old, Ok(true), Ok(true)),
        Decision::Hold(None)
    );
    assert_eq!(done.after(&Decision::Hold(None), 99), done);
    assert!(!done.active());
}

#[test]
fn the_plan_of_batches_matches_the_boundaries_the_coordinator_sets() {
    let p = plan();
    let k = keys(50);
    let b = batches(&k, &p);
    // 1 canary (the one `order` picks), then up to 10 % (5), then the rest.
    let per: Vec<usize> = (0..3)
        .map(|i| b.iter().filter(|x| **x == i).count())
        .collect();
    assert_eq!(per, vec![1, 4, 45]);
    assert_eq!(k[0], RankKey::of(true, Some("ns"), "p7"));
    assert_eq!(b[0], 0);
    // The same parents as the state machine moves, step by step.
    let mut s = RolloutState::settled("a", 0).next("b", 0);
    for step in 0..3 {
        s.step = step;
        s = placed(s, &k, &p);
        assert_eq!(moved(&s, 50), b.iter().filter(|x| **x <= step).count());
    }
    assert!(batches(&[], &p).is_empty());
}

#[test]
fn rollout_objects_name_their_rule() {
    use super::{rule_of_object, state_name, version_name};
    assert_eq!(rule_of_object(&state_name("web")), Some("web"));
    assert_eq!(
        rule_of_object(&version_name("web-api", "3f9c2a1b7d04")),
        Some("web-api")
    );
    assert_eq!(rule_of_object(&state_name("web-api")), Some("web-api"));
    for other in [
        "rulebook-rollout-",
        "rulebook-rule-web",
        "rulebook-rule--1",
        "settings",
    ] {
        assert_eq!(rule_of_object(other), None, "{other}");
    }
}

#[test]
fn progress_counters_alone_are_no_change_of_placement() {
    let a = super::RolloutState::settled("v1", 100);
    let mut b = a.clone();
    b.moved = 7;
    b.parents = 1000;
    assert!(a.differs_only_in_progress(&b));
    let mut c = b.clone();
    c.step = 1;
    assert!(!a.differs_only_in_progress(&c));
    let mut d = a.clone();
    d.held = true;
    assert!(!a.differs_only_in_progress(&d));
    // While it runs, the gate's message is progress; once paused, the condition says it.
    let mut running = a.clone();
    running.phase = super::Phase::Progressing;
    let mut later = running.clone();
    later.message = Some("gate not passed: 37 of 100 moved parents ready".into());
    assert!(running.differs_only_in_progress(&later));
    let mut paused = running.clone();
    paused.phase = super::Phase::Paused;
    let mut paused_why = paused.clone();
    paused_why.message = Some("failWhen held".into());
    assert!(!paused.differs_only_in_progress(&paused_why));
}
