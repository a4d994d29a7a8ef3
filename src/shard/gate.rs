//! The write gate of a sharded replica: this replica may write while its member Lease
//! is fresh (the same deadline as leadership, see [`LeaseGate`]) and only where its
//! claimed hash ranges reach: the namespaces whose hash they hold, and the rules with
//! cluster-scoped parents whose name hashes into them.
//!
//! The wire check ([`WriteGate::may_send`], in the client's gate layer) sees only a
//! request's path: a write into a namespace outside the claims is refused there, unless
//! this replica owns a rule with cluster-scoped parents (whose children may live in any
//! namespace). CRDs, webhook configurations and admission policies, which the writer
//! publishes for the whole rule set, are written by the replica whose claims hold the
//! hash of their name. The precise per-rule check is the rule's own gate ([`RuleGate`]), which
//! each reconcile's writer asks before every write.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};

use crate::shard::{Ranges, fnv1a};
use crate::write::gate::{LeaseGate, WriteGate};

const CRDS: &str = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/";
const ADMISSION: &str = "/apis/admissionregistration.k8s.io/";
/// The cluster-scoped kinds the writer publishes besides CRDs: the webhook
/// configurations (`webhook::apply`) and the admission policies of `cel:` rules
/// (`policies`), each by the replica whose share holds its name.
const PUBLISHED: &[&str] = &[
    "validatingwebhookconfigurations",
    "mutatingwebhookconfigurations",
    "validatingadmissionpolicies",
    "validatingadmissionpolicybindings",
    "mutatingadmissionpolicies",
    "mutatingadmissionpolicybindings",
];

/// The name of the webhook configuration or admission policy a write path names (its
/// subresources too), if it names one.
fn published_name(path: &str) -> Option<&str> {
    let rest = path.strip_prefix(ADMISSION)?;
    let mut parts = rest.split('/');
    let (_version, resource, name) = (parts.next()?, parts.next()?, parts.next()?);
    (PUBLISHED.contains(&resource) && !name.is_empty()).then_some(name)
}

pub struct ShardGate {
    lease: LeaseGate,
    claims: RwLock<Ranges>,
    /// Whether any rule with cluster-scoped parents is owned here (see the header).
    cluster_rules: AtomicBool,
    /// Bumped by every fence: a change computed before one is stale and not applied.
    epoch: AtomicU64,
}

impl Default for ShardGate {
    fn default() -> Self {
        ShardGate {
            lease: LeaseGate::leased(),
            claims: RwLock::new(Ranges::none()),
            cluster_rules: AtomicBool::new(false),
            epoch: AtomicU64::new(0),
        }
    }
}

impl ShardGate {
    /// The member Lease's deadline, renewed by the membership loop.
    pub fn lease(&self) -> &LeaseGate {
        &self.lease
    }

    /// The member was counted dead (its Lease is gone): nothing may be written from now
    /// on, and whatever was computed before this is stale ([`ShardGate::epoch`]).
    pub fn fence(&self) {
        let mut claims = self.claims.write().unwrap_or_else(|p| p.into_inner());
        self.epoch.fetch_add(1, Ordering::SeqCst);
        *claims = Ranges::none();
        self.cluster_rules.store(false, Ordering::SeqCst);
        self.lease.revoke();
    }

    /// The current fence epoch: read it before computing a change, and pass it to the
    /// `*_if` setters.
    pub fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::SeqCst)
    }

    /// Like [`ShardGate::set_claims`], unless a fence came after `epoch` was read.
    /// Returns whether it applied.
    pub fn set_claims_if(&self, epoch: u64, ranges: Ranges, owns_cluster_rules: bool) -> bool {
        let mut claims = self.claims.write().unwrap_or_else(|p| p.into_inner());
        if self.epoch.load(Ordering::SeqCst) != epoch {
            return false;
        }
        *claims = ranges;
        self.cluster_rules
            .store(owns_cluster_rules, Ordering::SeqCst);
        true
    }

    /// Replaces the claimed ranges. Shrinking takes effect for the very next request.
    pub fn set_claims(&self, ranges: Ranges, owns_cluster_rules: bool) {
        *self.claims.write().unwrap_or_else(|p| p.into_inner()) = ranges;
        self.cluster_rules
            .store(owns_cluster_rules, Ordering::SeqCst);
    }

    pub fn claims(&self) -> Ranges {
        self.claims
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Sets whether a rule with cluster-scoped parents is owned here, unless a fence
    /// came after `epoch` was read.
    pub fn set_cluster_rules_if(&self, epoch: u64, owns: bool) {
        let _claims = self.claims.write().unwrap_or_else(|p| p.into_inner());
        if self.epoch.load(Ordering::SeqCst) == epoch {
            self.cluster_rules.store(owns, Ordering::SeqCst);
        }
    }

    pub fn owns_cluster_rules(&self) -> bool {
        self.cluster_rules.load(Ordering::SeqCst)
    }

    pub fn holds(&self, hash: u64) -> bool {
        self.claims
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains(hash)
    }

    /// The gate of one rule: by namespace (at the wire) for namespaced parents; by the
    /// rule's name for cluster-scoped ones.
    pub fn for_rule(self: &Arc<Self>, rule: &str, cluster_scoped: bool) -> Arc<dyn WriteGate> {
        Arc::new(RuleGate {
            shard: self.clone(),
            key: cluster_scoped.then(|| fnv1a(rule)),
        })
    }
}

impl WriteGate for ShardGate {
    fn may_write(&self) -> bool {
        self.lease.may_write()
    }

    fn may_send(&self, path: &str) -> bool {
        if !self.lease.may_write() {
            return false;
        }
        // A CRD is written by the replica whose share holds its name.
        if let Some(crd) = path.strip_prefix(CRDS) {
            return self.holds(fnv1a(crd.split('/').next().unwrap_or(crd)));
        }
        // So is a webhook configuration or an admission policy (`operator::publish_objects`
        // decides so); a replica owning a rule with cluster-scoped parents (below) may
        // write any, as its children may be of any kind.
        if let Some(name) = published_name(path)
            && self.holds(fnv1a(name))
        {
            return true;
        }
        if self.cluster_rules.load(Ordering::SeqCst) {
            return true;
        }
        match namespace_of(path) {
            Some(ns) => self.holds(fnv1a(ns)),
            // Cluster-scoped objects are written only by rules with cluster-scoped parents.
            None => false,
        }
    }
}

/// The gate of the client a coordinator writes its rules' rollout objects with (the
/// state and the stored versions, ConfigMaps in the operator's namespace, which may hash
/// into another replica's share): the member Lease fresh, and only ConfigMaps there. An
/// update or a delete names its object, and passes only where this replica holds the
/// hash of the object's rule (the coordinator's test, now at the wire). A create names
/// none; it passes, as it cannot overwrite (the API server refuses a name that exists;
/// the state is created once, a version's copy is immutable).
pub struct RolloutStoreGate {
    pub shard: Arc<ShardGate>,
    /// The operator's namespace (`--lease-namespace`).
    pub namespace: String,
}

impl WriteGate for RolloutStoreGate {
    fn may_write(&self) -> bool {
        self.shard.may_write()
    }

    fn may_send(&self, path: &str) -> bool {
        let Some(rest) = path
            .strip_prefix("/api/v1/namespaces/")
            .and_then(|r| r.strip_prefix(self.namespace.as_str()))
            .and_then(|r| r.strip_prefix("/configmaps"))
        else {
            return false;
        };
        if !self.shard.may_write() {
            return false;
        }
        match rest.strip_prefix('/') {
            None => rest.is_empty(),
            Some(named) => named
                .split('/')
                .next()
                .and_then(crate::rollout::rule_of_object)
                .is_some_and(|rule| self.shard.holds(fnv1a(rule))),
        }
    }
}

struct RuleGate {
    shard: Arc<ShardGate>,
    key: Option<u64>,
}

impl WriteGate for RuleGate {
    fn may_write(&self) -> bool {
        self.shard.may_write() && self.key.is_none_or(|k| self.shard.holds(k))
    }

    fn may_send(&self, path: &str) -> bool {
        self.may_write() && self.shard.may_send(path)
    }
}

/// The namespace a request path writes into, if it names a namespaced object:
/// `/api/v1/namespaces/NS/KIND…` or `/apis/GROUP/VERSION/namespaces/NS/KIND…`.
/// (`/api/v1/namespaces/NS` itself, and its `status` and `finalize`, are the
/// cluster-scoped Namespace.)
pub fn namespace_of(path: &str) -> Option<&str> {
    let rest = path.strip_prefix("/api/v1/namespaces/").or_else(|| {
        let rest = path.strip_prefix("/apis/")?;
        let mut parts = rest.splitn(3, '/');
        let (_, _, rest) = (parts.next()?, parts.next()?, parts.next()?);
        rest.strip_prefix("namespaces/")
    })?;
    let (ns, tail) = rest.split_once('/')?;
    let kind = tail.split('/').next().unwrap_or("");
    (!ns.is_empty() && !kind.is_empty() && kind != "status" && kind != "finalize").then_some(ns)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    #[test]
    fn a_change_computed_before_a_fence_is_not_applied() {
        let gate = ShardGate::default();
        gate.lease()
            .grant_until(Instant::now() + Duration::from_secs(30));
        let before = gate.epoch();
        assert!(gate.set_claims_if(before, Ranges::all(), false));
        let stale = gate.epoch();
        gate.fence();
        assert!(
            !gate.may_send("/api/v1/namespaces/a/configmaps/x"),
            "a fence closes the gate"
        );
        assert!(!gate.set_claims_if(stale, Ranges::all(), true));
        gate.set_cluster_rules_if(stale, true);
        assert_eq!(gate.claims(), Ranges::none());
        assert!(!gate.owns_cluster_rules());
        // A change computed after the fence applies.
        assert!(gate.set_claims_if(gate.epoch(), Ranges::all(), false));
    }

    #[test]
    fn published_objects_are_written_by_the_holder_of_their_name() {
        let gate = ShardGate::default();
        gate.lease()
            .grant_until(Instant::now() + Duration::from_secs(30));
        let h = u128::from(fnv1a("hooks"));
        gate.set_claims(Ranges::of([(h, h + 1)]), false);
        for path in [
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/hooks",
            "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations/hooks",
            "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/hooks",
            "/apis/admissionregistration.k8s.io/v1/mutatingadmissionpolicybindings/hooks",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/hooks",
            "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/hooks/status",
        ] {
            assert!(gate.may_send(path), "{path}");
            assert!(!gate.may_send(&path.replace("hooks", "other")), "{path}");
        }
        // Not a published kind: a cluster-scoped write outside any rule.
        assert!(!gate.may_send("/apis/admissionregistration.k8s.io/v1/hooks/hooks"));
        assert!(
            !gate.may_send("/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations")
        );
        gate.lease().revoke();
        assert!(!gate.may_send(
            "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations/hooks"
        ));
    }

    #[test]
    fn rollout_objects_are_written_by_the_holder_of_their_rules_hash() {
        let shard = Arc::new(ShardGate::default());
        // The operator's namespace is in nobody's share here: the rule's hash decides.
        let h = u128::from(fnv1a("web"));
        shard.set_claims(Ranges::of([(h, h + 1)]), false);
        let gate = RolloutStoreGate {
            shard: shard.clone(),
            namespace: "ops".into(),
        };
        let cm = |name: &str| format!("/api/v1/namespaces/ops/configmaps/{name}");
        assert!(!gate.may_send(&cm("rulebook-rollout-web")), "no lease yet");
        shard
            .lease()
            .grant_until(Instant::now() + Duration::from_secs(30));
        assert!(
            !shard.may_send(&cm("rulebook-rollout-web")),
            "the plain gate refuses"
        );
        assert!(gate.may_send(&cm("rulebook-rollout-web")));
        assert!(gate.may_send(&cm("rulebook-rule-web-3f9c2a1b7d04")));
        assert!(
            gate.may_send("/api/v1/namespaces/ops/configmaps"),
            "a create"
        );
        // Another rule's objects, any other object, any other namespace: refused.
        assert!(!gate.may_send(&cm("rulebook-rollout-api")));
        assert!(!gate.may_send(&cm("rulebook-rule-api-3f9c2a1b7d04")));
        assert!(!gate.may_send(&cm("settings")));
        assert!(!gate.may_send("/api/v1/namespaces/ops/secrets/rulebook-rollout-web"));
        assert!(!gate.may_send("/api/v1/namespaces/ops2/configmaps/rulebook-rollout-web"));
        assert!(!gate.may_send("/api/v1/namespaces/other/configmaps"));
        shard.lease().revoke();
        assert!(!gate.may_send(&cm("rulebook-rollout-web")));
        assert!(!gate.may_send("/api/v1/namespaces/ops/configmaps"));
    }

    #[test]
    fn paths_name_their_namespace() {
        assert_eq!(namespace_of("/api/v1/namespaces/a/configmaps/x"), Some("a"));
        assert_eq!(namespace_of("/api/v1/namespaces/a/configmaps"), Some("a"));
        assert_eq!(
            namespace_of("/apis/apps/v1/namespaces/b/deployments/d/status"),
            Some("b")
        );
        assert_eq!(
            namespace_of("/apis/events.k8s.io/v1/namespaces/c/events"),
            Some("c")
        );
        assert_eq!(namespace_of("/api/v1/namespaces/a"), None);
        assert_eq!(namespace_of("/api/v1/namespaces/a/status"), None);
        assert_eq!(namespace_of("/api/v1/namespaces/a/finalize"), None);
        assert_eq!(namespace_of("/apis/example.com/v1/tenants/t"), None);
        assert_eq!(namespace_of("/api/v1/nodes/n"), None);
    }

    #[test]
    fn writes_reach_only_the_claimed_namespaces_while_the_lease_holds() {
        let gate = Arc::new(ShardGate::default());
        let mine = "team-1";
        let h = u128::from(fnv1a(mine));
        gate.set_claims(Ranges::of([(h, h + 1)]), false);
        let path = |ns: &str| format!("/api/v1/namespaces/{ns}/configmaps/x");
        // No lease yet: nothing.
        assert!(!gate.may_send(&path(mine)));
        gate.lease()
            .grant_until(Instant::now() + Duration::from_secs(30));
        assert!(gate.may_send(&path(mine)));
        assert!(!gate.may_send(&path("team-2")));
        assert!(!gate.may_send("/api/v1/namespaces/x"));
        // A cluster-scoped rule's gate follows its name's hash.
        let tenant = gate.for_rule("tenant", true);
        assert_eq!(tenant.may_write(), gate.holds(fnv1a("tenant")));
        let r = u128::from(fnv1a("tenant"));
        gate.set_claims(Ranges::of([(h, h + 1), (r, r + 1)]), true);
        assert!(tenant.may_write());
        assert!(tenant.may_send("/api/v1/namespaces/anywhere/configmaps/x"));
        // Released: refused at once.
        gate.set_claims(Ranges::none(), false);
        assert!(!tenant.may_write());
        assert!(!gate.may_send(&path(mine)));
        gate.lease().revoke();
        gate.set_claims(Ranges::all(), true);
        assert!(!gate.may_send(&path(mine)));
    }
}
