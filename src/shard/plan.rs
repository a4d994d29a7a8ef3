//! The coordinator's decision, as a pure function of what it observed: the current
//! assignment, the live members (with the generation each acknowledged and the rule set
//! each runs) and the load (parents per namespace hash). See the module header of
//! [`super`] for why a move takes two generations.

use std::collections::BTreeMap;

use super::{Ranges, TOP};

/// A live replica as the coordinator sees it in its Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: String,
    /// The fingerprint of the rule set it runs.
    pub rules: String,
    /// The last assignment generation it has fully applied.
    pub acked: u64,
}

/// Who holds which ranges, and where the moves in progress are heading.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    pub generation: u64,
    /// What each member may write now.
    pub owners: BTreeMap<String, Ranges>,
    /// Where the ranges are heading (equal to `owners` once no move is in progress).
    pub target: BTreeMap<String, Ranges>,
}

/// What the coordinator should do.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Plan {
    /// The next assignment to publish, if anything changes.
    pub next: Option<Assignment>,
    /// Members that have not acknowledged the current generation yet (nothing moves
    /// until they have, or until their Lease expires).
    pub waiting_for: Vec<String>,
    /// Namespace hashes whose load alone exceeds one member's fair share: a namespace
    /// cannot be split, so its member carries more than the others.
    pub oversized: Vec<(u64, u64)>,
}

/// How uneven the target may become before load alone moves ranges (max / fair share).
pub const IMBALANCE: f64 = 1.25;

/// The next step from `current` towards a balanced assignment of `live` members.
/// `load` holds (namespace hash, parents) pairs; `rebalance` allows moving ranges for
/// load alone (the caller bounds how often); a change of the eligible members always
/// recomputes the target.
pub fn plan(current: &Assignment, live: &[Member], load: &[(u64, u64)], rebalance: bool) -> Plan {
    let mut out = Plan::default();
    let points = merged(load);
    let eligible = eligible(live);
    let n = eligible.len().max(1) as u64;
    let total: u64 = points.iter().map(|p| p.1).sum();
    if eligible.len() > 1 {
        out.oversized = points
            .iter()
            .filter(|p| p.1.saturating_mul(n) > total)
            .copied()
            .collect();
    }
    if current.generation > 0 {
        out.waiting_for = live
            .iter()
            .filter(|m| m.acked < current.generation)
            .map(|m| m.id.clone())
            .collect();
        if !out.waiting_for.is_empty() {
            return out;
        }
    }
    let same_members = current.target.keys().eq(eligible.iter());
    let only_left = !current.target.is_empty()
        && !eligible.is_empty()
        && eligible.iter().all(|m| current.target.contains_key(m));
    let uneven = rebalance && imbalance(&current.target, &points, total) > IMBALANCE;
    let target = if uneven || !(same_members || only_left) {
        quantile_target(&eligible, &points, total)
    } else if same_members {
        current.target.clone()
    } else {
        // Members left and none joined: their ranges go to a neighbour, and nothing
        // else moves (load evens out later, at the rebalance pace).
        absorb(&current.target, &eligible)
    };
    let mut owners = BTreeMap::new();
    for m in live {
        let mine = target.get(&m.id).cloned().unwrap_or_default();
        let held = current.owners.get(&m.id).cloned().unwrap_or_default();
        let others = live
            .iter()
            .filter(|o| o.id != m.id)
            .filter_map(|o| current.owners.get(&o.id))
            .fold(Ranges::none(), |acc, r| acc.union(r));
        let next = held.intersect(&mine).union(&mine.minus(&others));
        if !next.is_empty() {
            owners.insert(m.id.clone(), next);
        }
    }
    if owners != current.owners || target != current.target {
        out.next = Some(Assignment {
            generation: current.generation.saturating_add(1),
            owners,
            target,
        });
    }
    out
}

/// The members that may hold ranges: those running the rule set most members run (ties
/// go to the greatest fingerprint), so two rule versions never share the work during a
/// rolling update; the others hold nothing until they run it too.
fn eligible(live: &[Member]) -> Vec<String> {
    let mut votes: BTreeMap<&str, usize> = BTreeMap::new();
    // A member without a valid rule set neither votes nor holds anything.
    for m in live.iter().filter(|m| !m.rules.is_empty()) {
        *votes.entry(m.rules.as_str()).or_default() += 1;
    }
    let Some(winner) = votes
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)))
        .map(|(k, _)| *k)
    else {
        return Vec::new();
    };
    let mut ids: Vec<String> = live
        .iter()
        .filter(|m| m.rules == winner)
        .map(|m| m.id.clone())
        .collect();
    ids.sort();
    ids.dedup();
    ids
}

/// Load points sorted by hash, one per hash.
fn merged(load: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut map: BTreeMap<u64, u64> = BTreeMap::new();
    for (h, c) in load {
        *map.entry(*h).or_default() += c;
    }
    map.into_iter().collect()
}

/// Contiguous ranges, one per member in id order, cut where the cumulative load is
/// closest to each member's fair share; whole namespaces only. Without load, equal
/// slices.
fn quantile_target(
    members: &[String],
    points: &[(u64, u64)],
    total: u64,
) -> BTreeMap<String, Ranges> {
    let n = members.len() as u128;
    let mut cuts: Vec<u128> = vec![0];
    if total == 0 {
        cuts.extend((1..n).map(|k| k * TOP / n));
    } else {
        // cum[j] = load of the first j points.
        let mut cum = Vec::with_capacity(points.len() + 1);
        cum.push(0u128);
        for p in points {
            cum.push(cum.last().copied().unwrap_or(0) + u128::from(p.1));
        }
        let mut j = 0usize;
        for k in 1..n {
            let want = k * u128::from(total);
            // The cut (number of points left of it) with cum closest to k/n of the load.
            let dist = |j: usize| (cum[j] * n).abs_diff(want);
            while j + 1 < cum.len() && dist(j + 1) <= dist(j) {
                j += 1;
            }
            cuts.push(points.get(j).map_or(TOP, |p| u128::from(p.0)));
        }
    }
    cuts.push(TOP);
    members
        .iter()
        .zip(cuts.windows(2))
        .map(|(m, w)| (m.clone(), Ranges::of([(w[0], w[1])])))
        .collect()
}

/// `target` without the members not in `keep`: each range of theirs joins the member
/// whose range ends where it starts (else the one starting where it ends, else the
/// first member).
fn absorb(target: &BTreeMap<String, Ranges>, keep: &[String]) -> BTreeMap<String, Ranges> {
    let mut out: BTreeMap<String, Ranges> = target
        .iter()
        .filter(|(m, _)| keep.contains(m))
        .map(|(m, r)| (m.clone(), r.clone()))
        .collect();
    let orphans: Vec<(u128, u128)> = target
        .iter()
        .filter(|(m, _)| !keep.contains(m))
        .flat_map(|(_, r)| r.spans().to_vec())
        .collect();
    for (start, end) in orphans {
        let heir = out
            .iter()
            .find(|(_, r)| r.spans().iter().any(|s| s.1 == start))
            .or_else(|| {
                out.iter()
                    .find(|(_, r)| r.spans().iter().any(|s| s.0 == end))
            })
            .map(|(m, _)| m.clone())
            .or_else(|| keep.first().cloned());
        if let Some(heir) = heir
            && let Some(r) = out.get_mut(&heir)
        {
            *r = r.union(&Ranges::of([(start, end)]));
        }
    }
    out
}

/// The largest member load over the fair share.
fn imbalance(target: &BTreeMap<String, Ranges>, points: &[(u64, u64)], total: u64) -> f64 {
    if total == 0 || target.is_empty() {
        return 1.0;
    }
    let max = target
        .values()
        .map(|r| {
            points
                .iter()
                .filter(|p| r.contains(p.0))
                .map(|p| p.1)
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    max as f64 * target.len() as f64 / total as f64
}

#[cfg(test)]
mod tests {
    use super::super::fnv1a;
    use super::*;

    fn member(id: &str, acked: u64) -> Member {
        Member {
            id: id.into(),
            rules: "v1".into(),
            acked,
        }
    }

    fn teams(n: usize, each: u64) -> Vec<(u64, u64)> {
        (0..n)
            .map(|i| (fnv1a(&format!("team-{i}")), each))
            .collect()
    }

    /// `live`, every member having acknowledged `generation`.
    fn all_acked(live: &[Member], generation: u64) -> Vec<Member> {
        live.iter()
            .map(|m| Member {
                acked: generation,
                ..m.clone()
            })
            .collect()
    }

    /// Runs the protocol to a fixed point with every member acknowledging at once.
    fn settle(mut a: Assignment, live: &[Member], load: &[(u64, u64)]) -> (Assignment, u32) {
        let mut steps = 0;
        loop {
            let acked = all_acked(live, a.generation);
            match plan(&a, &acked, load, false).next {
                Some(next) => {
                    check_disjoint(&next);
                    a = next;
                    steps += 1;
                    assert!(steps < 10, "does not settle");
                }
                None => return (a, steps),
            }
        }
    }

    fn check_disjoint(a: &Assignment) {
        let all: Vec<&Ranges> = a.owners.values().collect();
        for (i, x) in all.iter().enumerate() {
            for y in &all[i + 1..] {
                assert!(x.intersect(y).is_empty(), "two owners of one range: {a:?}");
            }
        }
    }

    fn loads(a: &Assignment, load: &[(u64, u64)]) -> Vec<u64> {
        a.owners
            .values()
            .map(|r| load.iter().filter(|p| r.contains(p.0)).map(|p| p.1).sum())
            .collect()
    }

    #[test]
    fn alike_names_are_balanced_by_load_not_by_slices() {
        let load = teams(300, 10);
        let live = [member("a", 0), member("b", 0), member("c", 0)];
        let (a, _) = settle(Assignment::default(), &live, &load);
        let l = loads(&a, &load);
        assert_eq!(l.iter().sum::<u64>(), 3000);
        assert!(l.iter().all(|x| *x <= 1200), "each at most 40 %: {l:?}");
        // Equal slices would not: the busiest third of the space.
        let thirds = (0..3u128)
            .map(|k| {
                let r = Ranges::of([(k * TOP / 3, (k + 1) * TOP / 3)]);
                load.iter().filter(|p| r.contains(p.0)).count()
            })
            .max()
            .unwrap_or(0);
        assert!(thirds > 120, "the hash clusters: {thirds}");
    }

    #[test]
    fn a_range_is_released_before_it_is_given_away() {
        let load = teams(300, 10);
        let three = [member("a", 0), member("b", 0), member("c", 0)];
        let (a, _) = settle(Assignment::default(), &three, &load);
        let four = [
            member("a", a.generation),
            member("b", a.generation),
            member("c", a.generation),
            member("d", a.generation),
        ];
        let step = plan(&a, &four, &load, false).next.expect("d joins");
        // The first step only takes away; nothing held in `a` is given to another.
        for (id, r) in &step.owners {
            for (other, held) in &a.owners {
                if other != id {
                    assert!(
                        r.intersect(held).is_empty(),
                        "{id} got {other}'s range at once"
                    );
                }
            }
        }
        // Nothing more happens until everyone acknowledged.
        let lagging = [
            member("a", step.generation),
            member("b", a.generation),
            member("c", step.generation),
            member("d", step.generation),
        ];
        let waiting = plan(&step, &lagging, &load, false);
        assert_eq!(waiting.next, None);
        assert_eq!(waiting.waiting_for, vec!["b".to_string()]);
        let (done, steps) = settle(step, &four, &load);
        assert!(steps >= 1);
        assert_eq!(done.owners, done.target);
        assert_eq!(done.owners.len(), 4);
        let all = done
            .owners
            .values()
            .fold(Ranges::none(), |acc, r| acc.union(r));
        assert_eq!(all, Ranges::all());
    }

    #[test]
    fn a_dead_members_ranges_go_to_a_neighbour_and_nothing_else_moves() {
        let load = teams(300, 10);
        let three = [member("a", 0), member("b", 0), member("c", 0)];
        let (a, _) = settle(Assignment::default(), &three, &load);
        let survivors = [member("a", a.generation), member("c", a.generation)];
        let (after, steps) = settle(a.clone(), &survivors, &load);
        assert_eq!(
            steps, 1,
            "one generation: the dead member's ranges are free"
        );
        assert_eq!(after.owners.len(), 2);
        assert_eq!(loads(&after, &load).iter().sum::<u64>(), 3000);
        for id in ["a", "c"] {
            let before = &a.owners[id];
            assert_eq!(
                after.owners[id].intersect(before),
                *before,
                "{id} kept its ranges"
            );
        }
        // Later, at the rebalance pace, load evens out.
        let acked = all_acked(&survivors, after.generation);
        let p = plan(&after, &acked, &load, true);
        assert!(p.next.is_some(), "2:1 is over the imbalance bound");
    }

    #[test]
    fn a_rolling_update_does_not_split_the_work_between_rule_versions() {
        let load = teams(30, 1);
        let mut live = vec![member("a", 0), member("b", 0), member("c", 0)];
        live[2].rules = "v2".into();
        let (a, _) = settle(Assignment::default(), &live, &load);
        assert!(!a.owners.contains_key("c"));
        live[0].rules = "v2".into();
        let (b, _) = settle(a, &live, &load);
        assert_eq!(b.owners.keys().collect::<Vec<_>>(), vec!["a", "c"]);
    }

    #[test]
    fn one_huge_namespace_is_reported() {
        let mut load = teams(10, 1);
        load.push((fnv1a("big"), 1000));
        let live = [member("a", 0), member("b", 0)];
        let p = plan(&Assignment::default(), &live, &load, false);
        assert_eq!(p.oversized, vec![(fnv1a("big"), 1000)]);
    }

    #[test]
    fn steady_state_publishes_nothing() {
        let load = teams(100, 3);
        let live = [member("a", 0), member("b", 0)];
        let (a, _) = settle(Assignment::default(), &live, &load);
        let acked = all_acked(&live, a.generation);
        // Even when rebalancing is allowed, a balanced target stays.
        assert_eq!(plan(&a, &acked, &load, true).next, None);
    }
}
