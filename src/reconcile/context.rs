//! What every reconcile of one rule shares: the resolved kinds and their caches, the
//! writer, the recorder, and the rule's [`ParentMemory`] (what is remembered per parent
//! and per child between reconciles). Built once per running rule, from what the engine
//! resolved.

use std::sync::Arc;

use crate::write::recorder::Recorder;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::reflector::{ObjectRef, Store};
use kube::{Client, ResourceExt};

use super::inflight::InputBudget;
use super::memory::{BackoffPolicy, ParentMemory};
use super::plan::is_child_of;
use super::refs::RefKind;
use crate::meta::labels;
use crate::metrics::Metrics;
use crate::render::{CompiledRule, Scope};
use crate::write::writer::Writer;

/// A kind a rule's children have, with the cache of the rule's children of that kind.
#[derive(Clone)]
pub struct ChildKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    /// The cached children, also by owner UID.
    pub store: Arc<crate::cache::store::ChildStore>,
    /// Whether any child of this kind is read past its metadata
    /// ([`CompiledRule::reads_child_content`]); if not, its cache keeps no content, and
    /// neither does the status stage's view of an apply's answer.
    pub content_read: bool,
}

impl ChildKind {
    /// The cached child at `oref` as reconciles read it (unpacked: see
    /// [`crate::cache::Packed`]).
    pub fn cached(&self, oref: &ObjectRef<DynamicObject>) -> Option<Arc<DynamicObject>> {
        self.store.get(oref)
    }

    pub fn api(&self, client: &Client, namespace: Option<&str>) -> Api<DynamicObject> {
        match (self.namespaced, namespace) {
            (true, Some(ns)) => Api::namespaced_with(client.clone(), ns, &self.ar),
            _ => Api::all_with(client.clone(), &self.ar),
        }
    }
}

/// The parent kind as the engine resolved it.
#[derive(Clone)]
pub struct ParentKind {
    pub ar: ApiResource,
    pub namespaced: bool,
    /// Whether the kind has a status subresource (else no status can be written).
    pub status_subresource: bool,
}

/// Everything the engine resolved for a rule, to build its [`RuleContext`] from.
pub struct ContextParts {
    pub rule: Arc<CompiledRule>,
    pub client: Client,
    pub parent: ParentKind,
    pub kinds: Vec<ChildKind>,
    /// Child index in the rule → index in `kinds`.
    pub kind_of_child: Vec<usize>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub writer: Writer,
    /// The parent cache, to reconcile the newest cached version of a parent.
    pub parent_store: Store<DynamicObject>,
    /// One cache per `spec.references[]` entry, in rule order.
    pub refs: Vec<RefKind>,
    /// What the rule remembers per parent (shared with the engine's watches, which tell
    /// it about parents deleted and this process's own writes arriving).
    pub memory: Arc<ParentMemory>,
    /// The process's budget of reconcile inputs in flight (one for every rule).
    pub inputs: Arc<InputBudget>,
    /// The Namespaces' metadata, for a rule whose selector reads their labels
    /// (`spec.parent.selector.namespaceSelector`); `None` for any other.
    pub namespaces: Option<Store<DynamicObject>>,
}

/// During a progressive rollout: the old version's context and the rollout state,
/// beside the new version's context (the pick per parent is `versions.rs`).
pub struct Versions {
    pub old: Arc<RuleContext>,
    pub state: Arc<parking_lot::RwLock<crate::rollout::RolloutState>>,
}

/// During a progressive rollout, what both versions' contexts know of it: the state, and
/// the number of steps of the new version's plan (for the `Rollout` condition).
#[derive(Clone)]
pub struct RolloutView {
    pub state: Arc<parking_lot::RwLock<crate::rollout::RolloutState>>,
    pub steps: usize,
}

/// Everything one rule's reconciles share.
pub struct RuleContext {
    pub rule: Arc<CompiledRule>,
    pub client: Client,
    pub parent: ParentKind,
    pub kinds: Vec<ChildKind>,
    pub kind_of_child: Vec<usize>,
    pub recorder: Recorder,
    pub metrics: Arc<Metrics>,
    pub writer: Writer,
    pub backoff: BackoffPolicy,
    pub parent_store: Store<DynamicObject>,
    pub refs: Vec<RefKind>,
    /// What is remembered per parent and per child between reconciles.
    pub memory: Arc<ParentMemory>,
    /// The process's budget of reconcile inputs in flight.
    pub(super) inputs: Arc<InputBudget>,
    /// During a progressive rollout: the old version's context and the rollout state
    /// (`versions.rs`); `None` otherwise.
    pub versions: Option<Versions>,
    /// During a progressive rollout, on both versions' contexts (`versions.rs`).
    pub rollout: Option<RolloutView>,
    /// See [`ContextParts::namespaces`].
    pub namespaces: Option<Store<DynamicObject>>,
}

impl RuleContext {
    pub fn new(p: ContextParts) -> RuleContext {
        RuleContext {
            rule: p.rule,
            client: p.client,
            parent: p.parent,
            kinds: p.kinds,
            kind_of_child: p.kind_of_child,
            recorder: p.recorder,
            metrics: p.metrics,
            writer: p.writer,
            backoff: BackoffPolicy::default(),
            parent_store: p.parent_store,
            refs: p.refs,
            memory: p.memory,
            inputs: p.inputs,
            versions: None,
            rollout: None,
            namespaces: p.namespaces,
        }
    }

    /// The same context over `rule` (another version of the same rule: the same kinds,
    /// caches, writer and memory), with `kind_of_child` for its children.
    pub fn with_rule(&self, rule: Arc<CompiledRule>, kind_of_child: Vec<usize>) -> RuleContext {
        RuleContext {
            rule,
            client: self.client.clone(),
            parent: self.parent.clone(),
            kinds: self.kinds.clone(),
            kind_of_child,
            recorder: self.recorder.clone(),
            metrics: self.metrics.clone(),
            writer: self.writer.clone(),
            backoff: self.backoff.clone(),
            parent_store: self.parent_store.clone(),
            refs: self.refs.clone(),
            memory: self.memory.clone(),
            inputs: self.inputs.clone(),
            versions: None,
            rollout: None,
            namespaces: self.namespaces.clone(),
        }
    }

    /// The labels of namespace `ns` as cached (`None`: not cached, or no cache: the
    /// rule's selector does not read them).
    pub fn namespace_labels(&self, ns: &str) -> Option<std::collections::BTreeMap<String, String>> {
        let store = self.namespaces.as_ref()?;
        let ar = ApiResource::erase::<k8s_openapi::api::core::v1::Namespace>(&());
        let o = store.get(&ObjectRef::new_with(ns, ar))?;
        Some(o.labels().clone())
    }

    /// Whether a parent's namespaced children may live outside one namespace: the
    /// parents are cluster-scoped, or namespaced with the rule's `targetNamespaces`
    /// (issue 47). Then only the namespaces a parent records (`teardown::places`), or its
    /// render places children in (`observe.rs`), hold its children.
    pub fn spreads(&self) -> bool {
        !self.parent.namespaced || self.rule.rule.spec.target_namespaces.is_some()
    }

    /// The namespaces a namespaced parent may place children in besides its own: the
    /// rule's `targetNamespaces` (none without the list; every one for a cluster-scoped
    /// parent, whose places are its record's, `teardown::places`).
    pub fn may_place_in(&self, parent_ns: Option<&str>, ns: &str) -> bool {
        if !self.parent.namespaced || parent_ns == Some(ns) {
            return true;
        }
        let targets = self.rule.rule.spec.target_namespaces.as_deref();
        targets.is_some() && crate::render::targets::allowed(targets, ns)
    }

    /// Whether the rule has a say in its parents' deletion (Rulebook's finalizer): its
    /// deletion steps or `Orphan` children, or `targetNamespaces` over namespaced
    /// parents, whose children elsewhere no garbage collector follows.
    pub fn rule_needs_finalizer(&self) -> bool {
        self.rule.rule.spec.needs_finalizer()
            || (self.parent.namespaced && self.rule.rule.spec.target_namespaces.is_some())
    }

    /// Whether parents carry Rulebook's finalizer: [`rule_needs_finalizer`](Self::rule_needs_finalizer),
    /// or children of a kind an earlier version had wait to be orphaned.
    pub fn needs_finalizer(&self) -> bool {
        self.rule_needs_finalizer() || self.memory.orphans_pending()
    }

    /// The API of the parent's kind, where `parent` lives.
    pub fn parent_api(&self, parent: &DynamicObject) -> Api<DynamicObject> {
        self.parent_api_as(parent)
    }

    /// [`RuleContext::parent_api`], decoding into `K` (the watch's own form, say).
    pub fn parent_api_as<K>(&self, parent: &DynamicObject) -> Api<K>
    where
        K: kube::Resource<DynamicType = ApiResource, Scope = kube::core::DynamicResourceScope>,
    {
        match (self.parent.namespaced, parent.namespace()) {
            (true, Some(ns)) => Api::namespaced_with(self.client.clone(), &ns, &self.parent.ar),
            _ => Api::all_with(self.client.clone(), &self.parent.ar),
        }
    }

    /// The cache of rule child `child`'s kind.
    pub fn kind_of(&self, child: usize) -> &ChildKind {
        &self.kinds[self.kind_of_child[child]]
    }

    pub fn scope(&self, child: usize) -> Scope {
        match self
            .kind_of_child
            .get(child)
            .and_then(|k| self.kinds.get(*k))
        {
            Some(k) if !k.namespaced => Scope::Cluster,
            _ => Scope::Namespaced,
        }
    }

    /// This parent's children in the caches: labelled with its UID and controlled by it,
    /// and — for a namespaced parent — in its namespace. (An object elsewhere that claims
    /// the parent's UID by an ownerReference is someone else's: ownerReferences never
    /// cross namespaces.) A namespaced parent of a rule with `targetNamespaces` also has
    /// children in the namespaces the list allows, by their claim alone: the owner label
    /// and the parent's namespace ([`claims_from`]).
    pub fn owned_children(
        &self,
        uid: &str,
        parent_ns: Option<&str>,
    ) -> Vec<(usize, Arc<DynamicObject>)> {
        let mut out = Vec::new();
        for (k, kind) in self.kinds.iter().enumerate() {
            for o in kind.store.owned_by(uid) {
                if o.labels().get(labels::OWNER).map(String::as_str) != Some(uid) {
                    continue;
                }
                let ns = o.metadata.namespace.as_deref();
                let mine = match (self.parent.namespaced && kind.namespaced, parent_ns, ns) {
                    (true, Some(home), Some(ns)) if ns != home => {
                        self.may_place_in(parent_ns, ns) && claims_from(&o.metadata, uid, home)
                    }
                    (true, _, ns) if ns != parent_ns => false,
                    _ => is_child_of(&o, uid),
                };
                if mine {
                    out.push((k, o));
                }
            }
        }
        out
    }

    /// Whether every child cache has completed its first listing.
    pub fn children_listed(&self) -> bool {
        self.kinds.iter().all(|k| k.store.listed())
    }

    /// Whether every reference cache has completed its first listing (a teardown does
    /// not wait for them: it reads no references).
    pub fn references_listed(&self) -> bool {
        self.refs.iter().all(|r| listed(&r.store))
    }

    /// Whether reference `i`'s kind is namespaced.
    pub fn ref_scope(&self, i: usize) -> Scope {
        match self.refs.get(i) {
            Some(r) if !r.namespaced => Scope::Cluster,
            _ => Scope::Namespaced,
        }
    }

    /// Sets `rulebook_teardown_oldest_deletion_seconds` for this rule.
    pub fn report_teardowns(&self, oldest: i64) {
        self.metrics
            .teardown_oldest
            .get_or_create(&crate::metrics::RuleLabel {
                rule: self.rule.name.clone(),
            })
            .set(oldest);
    }

    /// Forgets what is remembered of parents that were deleted
    /// ([`ParentMemory::forget_gone`]), reading the parent cache only after a new listing;
    /// a teardown that ended so leaves the metric of the oldest one.
    pub fn forget_gone(&self) {
        let before = self.memory.oldest_teardown();
        self.memory.forget_gone(|| {
            self.parent_store
                .state()
                .iter()
                .filter_map(|o| o.uid())
                .collect()
        });
        let after = self.memory.oldest_teardown();
        if after != before {
            self.report_teardowns(after);
        }
    }
}

fn listed(s: &Store<DynamicObject>) -> bool {
    use futures::FutureExt;
    matches!(s.wait_until_ready().now_or_never(), Some(Ok(())))
}

/// Whether `o`, in another namespace than its namespaced parent's `home`, claims that
/// parent (UID `uid`): a child placed there ([`crate::cache::wire::remote_claim`]), or an
/// `Orphan` one naming `home` as its parent's namespace.
pub fn claims_from(m: &kube::api::ObjectMeta, uid: &str, home: &str) -> bool {
    let named = (m.annotations.as_ref())
        .and_then(|a| a.get(labels::PARENT_NAMESPACE))
        .map(String::as_str);
    crate::cache::wire::remote_claim(m) == Some((uid, home))
        || (crate::cache::wire::orphan_owner(m) == Some(uid) && named == Some(home))
}
