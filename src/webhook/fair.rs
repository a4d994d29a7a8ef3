//! Tenant fairness of the webhook server's review slots: each namespace (an
//! `AdmissionReview`'s `request.namespace`; cluster-scoped objects, and conversion
//! reviews, form a class each) may hold at most a share of the reviews in flight, and of
//! the evaluations on the blocking pool, so that one tenant flooding creates of its kind
//! with slow checks cannot get every other tenant's reviews a 429 or a time-out (which
//! their rule's `failurePolicy: Fail` would turn into refused writes).
//!
//! - [`Fair::enter`] admits a review of a class while the class holds fewer than `share`
//!   reviews (on top of the server's global cap, taken before the body is read); one more
//!   is refused at once ([`Refusal`]), so the API server gets a fast, clear 429 while
//!   other classes still get slots.
//! - A [`Slot`] carries its class's evaluation lane: a semaphore of `lane` permits that
//!   [`Offload::run`](super::offload::Offload::run) takes before the pool's own, so a
//!   class waits in its own queue and never fills the pool's FIFO in front of others.
//!
//! The map is bounded: tenants choose namespace names and timing, so an entry lives only
//! while its class holds a slot or an evaluation abandoned past the deadline still holds a
//! lane permit (at most the pool's permits of those); it is dropped as soon as both are
//! none. At most `global cap + pool permits` entries exist at once.
//!
//! Crates weighed: `governor` (GCRA, also keyed) limits a *rate*, not what is held at
//! once: a slow flood at a modest rate would still hold every slot. What is needed is a
//! count per key, which `tokio::sync::Semaphore` (the lanes) and a `HashMap` under a
//! `parking_lot` mutex (both already dependencies) give in a few lines.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::Semaphore;

/// Who a review is counted against.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Class {
    /// An admission review of an object in this namespace.
    Namespace(String),
    /// An admission review of a cluster-scoped object.
    Cluster,
    /// A conversion review (it names no namespace; a list may hold many).
    Conversion,
}

impl Class {
    /// The class of an `AdmissionReview` (`conversion: false`) or a `ConversionReview`.
    pub fn of(review: &serde_json::Value, conversion: bool) -> Class {
        if conversion {
            return Class::Conversion;
        }
        match review
            .pointer("/request/namespace")
            .and_then(|n| n.as_str())
        {
            Some(ns) if !ns.is_empty() => Class::Namespace(ns.to_string()),
            _ => Class::Cluster,
        }
    }

    /// How the class is named in a refusal (the namespace is the requester's own).
    pub fn describe(&self) -> String {
        match self {
            Class::Namespace(ns) => format!("namespace {ns:?}"),
            Class::Cluster => "cluster-scoped objects".into(),
            Class::Conversion => "conversion reviews".into(),
        }
    }
}

/// Why a review got no slot.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    pub class: Class,
    pub share: usize,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} already has {} reviews in flight on this replica, its fair share: refused at \
             once so that other namespaces' reviews are answered; retry later",
            self.class.describe(),
            self.share
        )
    }
}

struct Entry {
    held: usize,
    lane: Arc<Semaphore>,
}

/// The count of reviews each class holds, and its evaluation lane.
#[derive(Clone)]
pub struct Fair {
    classes: Arc<Mutex<HashMap<Class, Entry>>>,
    share: usize,
    lane: usize,
}

impl Fair {
    /// At most `share` reviews (at least 1) and `lane` evaluations (at least 1) per class.
    pub fn new(share: usize, lane: usize) -> Fair {
        Fair {
            classes: Arc::default(),
            share: share.max(1),
            lane: lane.max(1),
        }
    }

    /// A slot for a review of `class`, or why not.
    pub fn enter(&self, class: Class) -> Result<Slot, Refusal> {
        let mut classes = self.classes.lock();
        let lane = self.lane;
        // Entries left by evaluations abandoned past the deadline go once those finish.
        classes.retain(|_, e| e.held > 0 || e.lane.available_permits() < lane);
        let entry = classes.entry(class.clone()).or_insert_with(|| Entry {
            held: 0,
            lane: Arc::new(Semaphore::new(lane)),
        });
        if entry.held >= self.share {
            return Err(Refusal {
                class,
                share: self.share,
            });
        }
        entry.held += 1;
        Ok(Slot {
            lane: entry.lane.clone(),
            fair: self.clone(),
            class,
        })
    }

    /// How many classes the map holds now (for tests and the bound on the map).
    pub fn classes(&self) -> usize {
        self.classes.lock().len()
    }

    /// Reviews `class` holds now.
    pub fn held(&self, class: &Class) -> usize {
        self.classes.lock().get(class).map_or(0, |e| e.held)
    }
}

/// One review's place in its class; given back when dropped.
pub struct Slot {
    fair: Fair,
    class: Class,
    /// The class's evaluation lane.
    pub lane: Arc<Semaphore>,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut classes = self.fair.classes.lock();
        if let Some(e) = classes.get_mut(&self.class) {
            e.held = e.held.saturating_sub(1);
            if e.held == 0 && e.lane.available_permits() >= self.fair.lane {
                classes.remove(&self.class);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn ns(n: &str) -> Class {
        Class::Namespace(n.into())
    }

    #[test]
    fn a_class_over_its_share_is_refused_while_others_still_enter() {
        let fair = Fair::new(2, 1);
        let a1 = fair.enter(ns("a")).unwrap();
        let _a2 = fair.enter(ns("a")).unwrap();
        let refused = fair.enter(ns("a")).err().expect("over the share");
        assert_eq!(refused.share, 2);
        assert!(
            refused.to_string().contains(r#"namespace "a""#),
            "{refused}"
        );
        let _b = fair.enter(ns("b")).unwrap();
        let _c = fair.enter(Class::Cluster).unwrap();
        let _d = fair.enter(Class::Conversion).unwrap();
        drop(a1);
        assert_eq!(fair.held(&ns("a")), 1);
        let _a3 = fair.enter(ns("a")).expect("a slot freed");
    }

    #[test]
    fn entries_go_when_their_count_is_zero() {
        let fair = Fair::new(4, 2);
        for i in 0..1000 {
            let s = fair.enter(ns(&format!("tenant-{i}"))).unwrap();
            drop(s);
        }
        assert_eq!(
            fair.classes(),
            0,
            "no entry kept for a namespace that holds nothing"
        );
        let held: Vec<Slot> = (0..10)
            .map(|i| fair.enter(ns(&format!("t{i}"))).unwrap())
            .collect();
        assert_eq!(fair.classes(), 10);
        drop(held);
        assert_eq!(fair.classes(), 0);
    }

    #[test]
    fn an_entry_with_an_abandoned_evaluation_stays_until_it_finishes() {
        let fair = Fair::new(1, 1);
        let slot = fair.enter(ns("a")).unwrap();
        let lane = slot.lane.clone();
        let permit = lane.clone().try_acquire_owned().unwrap();
        drop(slot); // the review gave up; its evaluation still runs
        assert_eq!(fair.classes(), 1);
        let again = fair.enter(ns("a")).unwrap();
        assert!(
            again.lane.clone().try_acquire_owned().is_err(),
            "the same lane: the abandoned evaluation still counts"
        );
        drop(again);
        drop(permit);
        let _other = fair.enter(ns("b")).unwrap();
        assert_eq!(fair.classes(), 1, "swept once the evaluation finished");
    }

    #[test]
    fn the_class_of_a_review() {
        let r = json!({"request": {"namespace": "team-a", "uid": "u"}});
        assert_eq!(Class::of(&r, false), ns("team-a"));
        assert_eq!(
            Class::of(&json!({"request": {"namespace": ""}}), false),
            Class::Cluster
        );
        assert_eq!(Class::of(&json!({"request": {}}), false), Class::Cluster);
        assert_eq!(Class::of(&r, true), Class::Conversion);
    }
}
