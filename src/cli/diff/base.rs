//! `rulebook diff --base-rules`: a pull request's references may read only what the rules
//! of its base branch read. `diff` runs with a credential that can read what the deployed
//! rules read, Secrets among them; a pull request that adds a reference (or widens one:
//! another namespace, another name, a looser selector) would otherwise have that
//! credential read anything it can, and its templates print it.
//!
//! For each parent, every target the pull request's rule computes must be *covered* by a
//! target the base rule of the same name computes for the same parent: the same kind in
//! the same namespace, and the same name, or a selector that selects no more (every
//! label term of the base's, its `watchSelector` included, is among the pull request's).
//! A name is never covered by a selector: which objects a selector selects is only known
//! by reading them.

use std::collections::BTreeSet;

use crate::render::{CacheFilter, RefSelect};

/// One label term: key, value (`None`: the key exists), negated.
type Term = (String, Option<String>, bool);

/// What one reference target of one parent reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reach {
    pub group: String,
    pub kind: String,
    /// `None` for a cluster-scoped kind.
    pub namespace: Option<String>,
    pub select: RefSelect,
    /// The terms the objects must also carry (`watchSelector`, or the literal keys of a
    /// selector), beyond a selector's own.
    pub watch: BTreeSet<Term>,
}

impl Reach {
    pub fn new(
        group: &str,
        kind: &str,
        namespace: Option<String>,
        select: RefSelect,
        filter: &CacheFilter,
    ) -> Reach {
        let watch = filter
            .labels
            .as_deref()
            .and_then(|s| crate::rules::parse_label_selector(s).ok())
            .unwrap_or_default()
            .into_iter()
            .collect();
        Reach {
            group: group.to_string(),
            kind: kind.to_string(),
            namespace,
            select,
            watch,
        }
    }

    /// Every label term an object this reads must carry.
    fn terms(&self) -> BTreeSet<Term> {
        let mut t = self.watch.clone();
        if let RefSelect::Labels(l) = &self.select {
            t.extend(l.iter().map(|(k, v)| (k.clone(), Some(v.clone()), false)));
        }
        t
    }

    /// Whether everything this reads, `base` reads too.
    pub fn within(&self, base: &Reach) -> bool {
        let same_place =
            self.group == base.group && self.kind == base.kind && self.namespace == base.namespace;
        same_place
            && match (&self.select, &base.select) {
                (RefSelect::Name(a), RefSelect::Name(b)) => a == b,
                (RefSelect::Labels(_), RefSelect::Labels(_)) => true,
                _ => false,
            }
            && {
                let mine = self.terms();
                base.terms().iter().all(|t| implied(&mine, t))
            }
    }

    /// `Secret kube-system/cloud-creds`, `ConfigMap objects labelled team=a in team-a`.
    pub fn describe(&self) -> String {
        match (&self.select, &self.namespace) {
            (RefSelect::Name(n), Some(ns)) => format!("{} {ns}/{n}", self.kind),
            (RefSelect::Name(n), None) => format!("{} {n}", self.kind),
            (RefSelect::Labels(l), ns) => {
                let labels: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
                let place = ns
                    .as_ref()
                    .map(|ns| format!(" in {ns}"))
                    .unwrap_or_default();
                format!("{} objects labelled {}{place}", self.kind, labels.join(","))
            }
        }
    }
}

/// Whether objects carrying every term of `terms` carry `t`: it is among them, or it asks
/// only that a key exist and one of them gives that key a value.
fn implied(terms: &BTreeSet<Term>, t: &Term) -> bool {
    terms.contains(t)
        || match t {
            (k, None, false) => terms
                .iter()
                .any(|(k2, v, neg)| k2 == k && v.is_some() && !neg),
            _ => false,
        }
}

/// The message for reference `name` of a parent, reading `reach`, when no base target
/// covers it.
pub fn refused(name: &str, reach: &Reach) -> String {
    format!(
        "refs.{name}: reads {}, which the base rules do not read; refused (--allow-new-references)",
        reach.describe()
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn named(ns: &str, name: &str) -> Reach {
        Reach::new(
            "",
            "Secret",
            Some(ns.into()),
            RefSelect::Name(name.into()),
            &CacheFilter::default(),
        )
    }

    fn labelled(ns: &str, labels: &[(&str, &str)], watch: Option<&str>) -> Reach {
        let l: BTreeMap<String, String> = labels
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let filter = CacheFilter {
            labels: watch.map(str::to_string),
            ..CacheFilter::default()
        };
        Reach::new(
            "",
            "ConfigMap",
            Some(ns.into()),
            RefSelect::Labels(l),
            &filter,
        )
    }

    #[test]
    fn names_must_match_in_kind_namespace_and_name() {
        let base = named("team-a", "db");
        assert!(named("team-a", "db").within(&base));
        assert!(!named("kube-system", "db").within(&base));
        assert!(!named("team-a", "cloud-creds").within(&base));
        let mut cm = named("team-a", "db");
        cm.kind = "ConfigMap".into();
        assert!(!cm.within(&base));
        assert!(!labelled("team-a", &[("team", "a")], None).within(&base));
    }

    #[test]
    fn a_selector_may_narrow_but_not_widen() {
        let base = labelled("team-a", &[("team", "a")], Some("team"));
        assert!(labelled("team-a", &[("team", "a")], Some("team")).within(&base));
        assert!(labelled("team-a", &[("team", "a"), ("tier", "x")], Some("team")).within(&base));
        // `team=a` implies the watchSelector's `team`; a selector without it does not.
        assert!(labelled("team-a", &[("team", "a")], None).within(&base));
        assert!(!labelled("team-a", &[("tier", "x")], None).within(&base));
        assert!(!labelled("team-a", &[("team", "b")], Some("team")).within(&base));
        assert!(!labelled("team-b", &[("team", "a")], Some("team")).within(&base));
        let mut watched = named("team-a", "db");
        watched.watch.insert(("team".into(), None, false));
        assert!(!named("team-a", "db").within(&watched));
        assert!(watched.within(&named("team-a", "db")));
    }

    #[test]
    fn the_refusal_names_what_would_be_read() {
        assert_eq!(
            refused("stolen", &named("kube-system", "cloud-creds")),
            "refs.stolen: reads Secret kube-system/cloud-creds, which the base rules do not read; refused (--allow-new-references)"
        );
    }
}
