//! The rule file format, `rulebook.dev/v1alpha1` `Rule`.
//!
//! Every type here is plain data: serde for reading, schemars for `rulebook schema`.
//! Fields whose value can be wrong in ways only a later check sees (names, template
//! paths, expressions, JSONPaths) carry their source position in a [`Loc`], so every
//! error can say `file:line:col`.

use std::collections::BTreeMap;
use std::fmt;

use schemars::JsonSchema;
use serde::de::{self, MapAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};

pub const API_VERSION: &str = "rulebook.dev/v1alpha1";
pub const KIND: &str = "Rule";

/// A value together with the line and column it was read from (1-based; 0 when unknown).
#[derive(Clone, Debug, PartialEq)]
pub struct Loc<T> {
    pub value: T,
    pub line: u64,
    pub col: u64,
}

impl<T> Loc<T> {
    pub fn new(value: T) -> Self {
        Loc {
            value,
            line: 0,
            col: 0,
        }
    }
}

impl<T> std::ops::Deref for Loc<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.value
    }
}

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Loc<T> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let spanned = serde_saphyr::Spanned::<T>::deserialize(d)?;
        Ok(Loc {
            value: spanned.value,
            line: spanned.referenced.line(),
            col: spanned.referenced.column(),
        })
    }
}

impl<T: Serialize> Serialize for Loc<T> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(s)
    }
}

impl<T: JsonSchema> JsonSchema for Loc<T> {
    fn inline_schema() -> bool {
        true
    }
    fn schema_name() -> std::borrow::Cow<'static, str> {
        T::schema_name()
    }
    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        T::json_schema(generator)
    }
}

/// One rule: a watched parent kind, the children rendered for each parent, and the
/// status written back to it.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[schemars(title = "Rulebook Rule")]
pub struct Rule {
    /// Always `rulebook.dev/v1alpha1`.
    pub api_version: Loc<String>,
    /// Always `Rule`.
    pub kind: Loc<String>,
    pub metadata: RuleMetadata,
    pub spec: RuleSpec,
}

impl Rule {
    /// Whether the rule's own CRD makes its parents cluster-scoped (`spec.crd.scope:
    /// Cluster`); a built-in parent kind's scope is `meta::is_cluster_scoped_builtin`'s.
    pub fn crd_cluster_scoped(&self) -> bool {
        self.spec
            .crd
            .as_ref()
            .and_then(|c| c.scope.as_ref())
            .is_some_and(|s| s.value == "Cluster")
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleMetadata {
    /// Unique across the rule set; a DNS label (lower-case letters, digits, `-`).
    pub name: Loc<String>,
    /// Free-form, ignored by Rulebook.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    /// Free-form, ignored by Rulebook.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub annotations: BTreeMap<String, String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleSpec {
    /// The watched kind: every object of this kind is a parent.
    pub parent: KindRef,
    /// Objects the rule reads but does not own, visible as `refs.<name>`. Watched: a
    /// change to one re-reconciles the parents that use it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub references: Vec<Reference>,
    /// The objects rendered for each parent, applied in this order.
    #[serde(default)]
    pub children: Vec<ChildRule>,
    /// Fields written to the parent's `.status`, by name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub status: BTreeMap<String, Loc<StatusValue>>,
    /// Periodic re-reconcile of every parent, e.g. `30s`, `10m`, `1h`. Off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resync: Option<Loc<String>>,
    /// The parent's CustomResourceDefinition, when this rule defines it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub crd: Option<CrdSpec>,
    /// A say in the parent's deletion: a finalize step and ordered teardown. Without it
    /// (and without a child with `deletionPolicy: Orphan`) the garbage collector removes
    /// the children and Rulebook puts no finalizer on parents.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deletion: Option<Deletion>,
    /// Checks and computed defaults applied when a parent is created or updated, before
    /// it is stored. `cel:` rules are enforced by the API server itself (the CRD's
    /// `x-kubernetes-validations`, or a generated `ValidatingAdmissionPolicy`); `expr:`
    /// rules and computed defaults by Rulebook's admission webhooks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<Admission>,
    /// For a cluster-scoped parent: the namespaces (names, `*` patterns) its namespaced
    /// children, and the Namespaces it creates, may be in. A child elsewhere fails the
    /// parent's render; `kube-*` namespaces only when listed by their exact name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_namespaces: Option<Vec<Loc<String>>>,
    /// How a change of this rule reaches the parents: in health-gated batches, with
    /// automatic rollback. Without it a changed rule applies to every parent at once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<Rollout>,
    /// The identity the operator uses for this rule: a ServiceAccount in the operator's
    /// namespace. Every request made for the rule (watches, reads, applies, status,
    /// events, deletes) impersonates `system:serviceaccount:<namespace>:<name>`, so the
    /// rule can do only what that account is granted (`rulebook rbac --per-rule`).
    /// Without it the rule runs as the operator itself (docs/reference/identity.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<Loc<String>>,
}

/// `spec.rollout`: a change of the rule moves parents to the new version in batches;
/// each batch must pass `gate` before the next one moves (docs/reference/rollout.md).
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Rollout {
    /// The batches, in order; the last one is `{percent: 100}`.
    pub steps: Vec<RolloutStep>,
    /// An expression over `parent`: the parents for which it is true move first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub order: Option<Loc<String>>,
    /// An expression over `batch` (`total`, `ready`, `notReady`, `age`, `notReadyFor`,
    /// `parents`, `step`): the next batch moves once it is true. Default:
    /// `batch.ready >= batch.total`. Quoted durations (`'1m'`) read as seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gate: Option<Loc<String>>,
    /// `Rollback` (default) or `Pause`: what happens when `failWhen` is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub on_failure: Option<Loc<String>>,
    /// An expression over `batch`: the rollout has failed once it is true. Default: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fail_when: Option<Loc<String>>,
}

/// One batch of `spec.rollout.steps`: exactly one of `parents` and `percent`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RolloutStep {
    /// This many parents (in all, counting the batches before) are on the new version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parents: Option<Loc<u64>>,
    /// This share of the parents (rounded up, in all) is on the new version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub percent: Option<Loc<u64>>,
    /// The least time the batch runs before its gate may pass, e.g. `2m`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause: Option<Loc<String>>,
}

/// `spec.admission`: validation beyond types, and computed defaults.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Admission {
    /// Checks, in order; the first that fails refuses the create or update.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub validate: Vec<ValidateRule>,
    /// Fields set when absent, in order (a later default sees the earlier ones).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub default: Vec<DefaultRule>,
    /// What the API server does when no Rulebook replica answers the webhook in time:
    /// `Fail` (default: refuse the request) or `Ignore` (store it unchecked). Only for
    /// `expr:` checks and computed defaults; `cel:` rules need no webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_policy: Option<Loc<String>>,
}

/// One check of `spec.admission.validate`: exactly one of `cel` and `expr`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ValidateRule {
    /// A Kubernetes CEL expression over `self` (the object) and, on updates, `oldSelf`
    /// (a transition rule); true means allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel: Option<Loc<String>>,
    /// A minijinja expression over `parent`, `old` (on updates) and `refs`; true means
    /// allowed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expr: Option<Loc<String>>,
    /// The denial's message. For `expr:` checks a minijinja template over the same
    /// variables (rendered, redacted); for `cel:` a plain string.
    pub message: Loc<String>,
    /// The field the denial points at, e.g. `spec.replicas`. Default: the object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field_path: Option<Loc<String>>,
    /// `CREATE`, `UPDATE` or both (default: both; a rule reading `oldSelf`/`old` runs on
    /// updates only).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub operations: Vec<Loc<String>>,
}

/// One computed default of `spec.admission.default`: exactly one of `expr` and `cel`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct DefaultRule {
    /// The field to set when it is absent, as a dotted path, e.g. `spec.image`.
    pub path: Loc<String>,
    /// A minijinja expression over `parent` and `refs` giving the value (served by
    /// Rulebook's mutating webhook). Undefined leaves the field absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expr: Option<Loc<String>>,
    /// A CEL expression over `object` giving the value; compiled into a
    /// `MutatingAdmissionPolicy`, so no webhook is needed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cel: Option<Loc<String>>,
}

/// An object (or, with `selector`, a list of objects) a rule reads but does not own
/// (`spec.references[]`). Never written.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Reference {
    /// An identifier; templates and expressions see the object as `refs.<name>`.
    pub name: Loc<String>,
    pub api_version: Loc<String>,
    pub kind: Loc<String>,
    /// An expression over `parent` giving the object's name. Exactly one of
    /// `objectName` and `selector`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub object_name: Option<Loc<String>>,
    /// An expression over `parent` giving `matchLabels` (a map); `refs.<name>` is then the
    /// list of matching objects, by name.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<Loc<String>>,
    /// Where the object is. Default: the parent's namespace. A literal namespace name;
    /// only a rule whose parent is cluster-scoped may give an expression instead (a
    /// tenant must not be able to point a reference at another team's namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<Loc<String>>,
    /// A missing optional object is undefined in `refs`; a missing required one stops
    /// the parent's reconcile with `Ready=False`, reason `ReferenceMissing`.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub optional: bool,
    /// A label selector (`key=value,other`) on what Rulebook caches of this kind; objects
    /// without it cannot be referenced. Narrows the cache where `objectName` and
    /// `selector` alone cannot (a name computed from the parent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watch_selector: Option<Loc<String>>,
    /// When the referenced object counts as ready for a child's `waitFor: [refs.<name>]`:
    /// an expression over `ref` (the object; the list for a `selector`), `parent`,
    /// `refs` and `rule`. Default: the object exists (a `selector` matches one or more).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_when: Option<Loc<String>>,
}

impl Reference {
    /// The literal namespace, when `namespace` is one (a DNS label); `Err` with the
    /// expression otherwise.
    pub fn literal_namespace(&self) -> Option<Result<&str, &Loc<String>>> {
        let ns = self.namespace.as_ref()?;
        Some(if crate::meta::is_dns_label(ns.trim()) {
            Ok(ns.trim())
        } else {
            Err(ns)
        })
    }
}

/// How a parent is torn down (`spec.deletion`).
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Deletion {
    /// `reverse` (default): children are deleted in reverse rule order, each child's
    /// objects gone before the previous child's are deleted; `parallel`: all at once.
    #[serde(default)]
    pub order: DeletionOrder,
    /// A child created only when the parent is being deleted, waited for before teardown.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finalize: Option<Finalize>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum DeletionOrder {
    #[default]
    Reverse,
    Parallel,
}

/// The finalize step of a teardown (`spec.deletion.finalize`).
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Finalize {
    /// The name of a child in `spec.children`: rendered once, from the parent alone, when
    /// the parent is being deleted, and never otherwise.
    pub child: Loc<String>,
    /// An expression over `parent` and `child` (the live finalize child): teardown goes on
    /// once it is true.
    pub done_when: Loc<String>,
    /// How long to wait for `doneWhen` from the child's creation (default `10m`); then a
    /// Warning event, and teardown goes on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timeout: Option<Loc<String>>,
}

/// What happens to a child when its parent is deleted or the rule stops rendering it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize, JsonSchema)]
pub enum DeletionPolicy {
    /// Deleted (by the garbage collector, or by the teardown).
    #[default]
    Delete,
    /// Left in place, without its ownerReference and Rulebook's labels.
    Orphan,
}

impl DeletionPolicy {
    fn is_delete(&self) -> bool {
        *self == DeletionPolicy::Delete
    }

    /// The value of the `rulebook.dev/deletion-policy` annotation on a child with this
    /// policy; none for `Delete`, the default.
    pub fn annotation(self) -> Option<&'static str> {
        match self {
            DeletionPolicy::Delete => None,
            DeletionPolicy::Orphan => Some("Orphan"),
        }
    }

    /// The policy a child's `rulebook.dev/deletion-policy` annotation records: `Orphan`
    /// only for exactly that value.
    pub fn recorded(annotation: Option<&str>) -> DeletionPolicy {
        match annotation {
            Some("Orphan") => DeletionPolicy::Orphan,
            _ => DeletionPolicy::Delete,
        }
    }
}

/// A kind, by `apiVersion` (`group/version`, or `v1` for the core group) and `kind`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct KindRef {
    pub api_version: Loc<String>,
    pub kind: Loc<String>,
    /// Only on `spec.parent`: which parents of the kind the rule takes (several rules
    /// may name one kind: docs/reference/decorators.md). Without it, every parent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<ParentSelector>,
}

/// `spec.parent.selector`: the parents a rule takes. Every part given must match: the
/// parent's labels (`matchLabels`, `matchExpressions`, as a Kubernetes LabelSelector),
/// its namespace's labels (`namespaceSelector`, namespaced parents only) and `expr`, an
/// expression over `parent`.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ParentSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, Loc<String>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelRequirement>,
    /// The labels of the parent's namespace (a LabelSelector).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace_selector: Option<LabelSelector>,
    /// An expression over `parent`: the rule takes the parent while it is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expr: Option<Loc<String>>,
}

/// A Kubernetes LabelSelector: `matchLabels` and `matchExpressions`, all of which match.
#[derive(Clone, Debug, Default, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelSelector {
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub match_labels: BTreeMap<String, Loc<String>>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub match_expressions: Vec<LabelRequirement>,
}

/// One `matchExpressions` entry: `key`, `operator` (`In`, `NotIn`, `Exists`,
/// `DoesNotExist`) and `values` (for `In` and `NotIn` only).
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct LabelRequirement {
    pub key: Loc<String>,
    pub operator: Loc<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub values: Vec<String>,
}

impl ParentSelector {
    /// The label part (`matchLabels`, `matchExpressions`) as a [`LabelSelector`].
    pub fn labels(&self) -> LabelSelector {
        LabelSelector {
            match_labels: self.match_labels.clone(),
            match_expressions: self.match_expressions.clone(),
        }
    }
}

impl LabelSelector {
    /// Whether `labels` match every term.
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(&v.value))
            && self.match_expressions.iter().all(|e| e.matches(labels))
    }
}

impl LabelRequirement {
    /// Whether `labels` satisfy the requirement (an unknown operator matches nothing:
    /// `check` refuses it).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        let have = labels.get(&self.key.value);
        match self.operator.as_str() {
            "In" => have.is_some_and(|v| self.values.contains(v)),
            "NotIn" => have.is_none_or(|v| !self.values.contains(v)),
            "Exists" => have.is_some(),
            "DoesNotExist" => have.is_none(),
            _ => false,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct ChildRule {
    /// An identifier (`[a-zA-Z_][a-zA-Z0-9_]*`); expressions see the live child as `children.<name>`.
    pub name: Loc<String>,
    pub api_version: Loc<String>,
    pub kind: Loc<String>,
    /// A minijinja template, relative to the templates directory, that renders exactly one object.
    pub template: Loc<String>,
    /// An expression; the child exists only while it is true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_when: Option<Loc<String>>,
    /// Children of this rule that must exist and be ready (their `readyWhen`) before this
    /// one is first applied. Once applied, it stays when they become unready. An entry
    /// `refs.<name>` names a reference: the child is rendered only while the reference is
    /// ready (its `readyWhen`), and held as it is (never pruned) while it is not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub wait_for: Vec<Loc<String>>,
    /// An expression over `child` (the live object); default: the child exists.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready_when: Option<Loc<String>>,
    /// An expression giving a list; the template is rendered once per item (`item`, `index`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub for_each: Option<Loc<String>>,
    /// Take over an existing object of the same name that Rulebook did not create.
    /// Off by default: such an object is reported as a conflict and left alone.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt: bool,
    /// Accept adoption's risks where the parent's author chooses what is taken over: a
    /// name built from the parent (`metadata.name` included), or a cluster-scoped kind
    /// (Namespace, ClusterRole, ...). Without it such an `adopt: true` is a `check`
    /// warning (the name) or a load error (a built-in cluster-scoped kind), and the
    /// operator never adopts a cluster-scoped object.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adopt_unsafe: bool,
    /// `Delete` (default) or `Orphan`: an orphaned child outlives its parent's teardown
    /// (and a rule that stops rendering it) without ownerReference and Rulebook labels.
    /// A parent whose finalizer is released instead (rule removed, `rulebook release`)
    /// has no teardown: the garbage collector deletes its children.
    #[serde(default, skip_serializing_if = "DeletionPolicy::is_delete")]
    pub deletion_policy: DeletionPolicy,
    /// For a RoleBinding or ClusterRoleBinding child whose template computes `roleRef`:
    /// the roles it may bind (`rulebook rbac` grants `bind` on exactly these; any other
    /// rendered `roleRef` is refused). A literal `roleRef` needs no list.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allowed_role_refs: Vec<RoleRefName>,
}

/// A role a binding child may name: `kind` (`Role` or `ClusterRole`) and `name`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RoleRefName {
    pub kind: Loc<String>,
    pub name: Loc<String>,
}

/// How one status field is computed.
#[derive(Clone, Debug, PartialEq, Serialize)]
#[serde(untagged)]
pub enum StatusValue {
    /// A JSONPath (RFC 9535) over `{parent, children}`, with an optional default when nothing matches.
    JsonPath {
        #[serde(rename = "jsonPath")]
        path: String,
        #[serde(skip_serializing_if = "Option::is_none")]
        default: Option<serde_json::Value>,
        /// The list is published only when every element resolves (`allOf: true`).
        #[serde(rename = "allOf", skip_serializing_if = "std::ops::Not::not")]
        all_of: bool,
    },
    /// A minijinja expression.
    Expr { expr: String },
    /// A literal.
    Value { value: serde_json::Value },
    /// The first case whose `when` holds; a case without `when` always holds.
    Cases { cases: Vec<Case> },
}

/// One branch of a `cases` status value: a literal `value` or an `expr`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Case {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub when: Option<Loc<String>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expr: Option<Loc<String>>,
}

/// A status value written as a map.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct StatusObject {
    #[serde(default)]
    json_path: Option<String>,
    #[serde(default, deserialize_with = "present")]
    default: Option<serde_json::Value>,
    /// With `jsonPath` giving a list: publish it only when every element resolves.
    #[serde(default)]
    all_of: Option<bool>,
    #[serde(default)]
    expr: Option<String>,
    #[serde(default, deserialize_with = "present")]
    value: Option<serde_json::Value>,
    #[serde(default)]
    cases: Option<Vec<Case>>,
}

#[derive(JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // only its schema is used
enum StatusValueSchema {
    /// A JSONPath over `{parent, children}`.
    JsonPath(String),
    /// Exactly one of `jsonPath` (with optional `default` and `allOf`), `expr`, `value`, `cases`.
    Object(StatusObject),
}

/// A key that is present counts, even with a `null` value.
fn present<'de, D: Deserializer<'de>>(d: D) -> Result<Option<serde_json::Value>, D::Error> {
    serde_json::Value::deserialize(d).map(Some)
}

impl JsonSchema for StatusValue {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "StatusValue".into()
    }
    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        StatusValueSchema::json_schema(generator)
    }
}

impl<'de> Deserialize<'de> for StatusValue {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = StatusValue;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSONPath string or a map with one of jsonPath, expr, value, cases")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<StatusValue, E> {
                Ok(StatusValue::JsonPath {
                    path: v.to_string(),
                    default: None,
                    all_of: false,
                })
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<StatusValue, A::Error> {
                let o = StatusObject::deserialize(de::value::MapAccessDeserializer::new(map))?;
                let given = [
                    o.json_path.is_some(),
                    o.expr.is_some(),
                    o.value.is_some(),
                    o.cases.is_some(),
                ]
                .iter()
                .filter(|b| **b)
                .count();
                if given != 1 {
                    return Err(de::Error::custom(
                        "a status value needs exactly one of jsonPath, expr, value, cases",
                    ));
                }
                if o.default.is_some() && o.json_path.is_none() {
                    return Err(de::Error::custom("`default` goes only with `jsonPath`"));
                }
                if o.all_of.is_some() && o.json_path.is_none() {
                    return Err(de::Error::custom("`allOf` goes only with `jsonPath`"));
                }
                Ok(match (o.json_path, o.expr, o.value, o.cases) {
                    (Some(path), ..) => StatusValue::JsonPath {
                        path,
                        default: o.default,
                        all_of: o.all_of.unwrap_or(false),
                    },
                    (_, Some(expr), ..) => StatusValue::Expr { expr },
                    (_, _, Some(value), _) => StatusValue::Value { value },
                    (.., Some(cases)) => StatusValue::Cases { cases },
                    _ => unreachable!("exactly one form was checked above"),
                })
            }
        }
        d.deserialize_any(V)
    }
}

/// The parent's CustomResourceDefinition. Group, version and kind come from `spec.parent`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CrdSpec {
    /// Lower-case plural, e.g. `mywebs`. Default: the English plural of the kind in lower
    /// case, as Kubernetes guesses it (`Policy` → `policies`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub plural: Option<Loc<String>>,
    /// Default: the kind in lower case.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub singular: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub short_names: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub categories: Vec<String>,
    /// `Namespaced` (default) or `Cluster`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<Loc<String>>,
    /// Extra `kubectl get` columns; Ready and Age are always added.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub printer_columns: Vec<PrinterColumn>,
    /// OpenAPI v3 schema of `.spec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_schema: Option<Loc<serde_json::Value>>,
    /// OpenAPI v3 schema of extra `.status` properties (conditions and observedGeneration are added).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_schema: Option<Loc<serde_json::Value>>,
    /// Allow schema changes that can break stored objects (removed fields, changed types).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_breaking_changes: bool,
    /// Several versions of the kind. Without it the CRD has one version, the one of
    /// `spec.parent.apiVersion`. With it, exactly one is `storage: true`, and
    /// `spec.parent.apiVersion` names that one: the rule's templates read the storage
    /// version. `specSchema`/`statusSchema` above are the default of versions without
    /// their own.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub versions: Vec<CrdVersion>,
    /// How objects move between versions: a template per direction, served by Rulebook's
    /// conversion webhook. Every pair of served versions needs a path (direct or through
    /// the storage version).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conversion: Vec<Conversion>,
}

/// One version of `spec.crd.versions`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct CrdVersion {
    /// e.g. `v1`, `v1beta1`, `v1alpha1`.
    pub name: Loc<String>,
    /// Served by the API server (default true).
    #[serde(default = "yes")]
    pub served: bool,
    /// The version objects are stored in: exactly one version has it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub storage: bool,
    /// Served with a deprecation warning.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub deprecated: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deprecation_warning: Option<String>,
    /// OpenAPI v3 schema of this version's `.spec` (default: `spec.crd.specSchema`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec_schema: Option<Loc<serde_json::Value>>,
    /// OpenAPI v3 schema of this version's extra `.status` properties (default:
    /// `spec.crd.statusSchema`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status_schema: Option<Loc<serde_json::Value>>,
    /// Extra `kubectl get` columns for this version (default: `spec.crd.printerColumns`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub printer_columns: Vec<PrinterColumn>,
}

fn yes() -> bool {
    true
}

/// One direction of `spec.crd.conversion`.
#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Conversion {
    /// The version converted from, e.g. `v1alpha1`.
    pub from: Loc<String>,
    /// The version converted to, e.g. `v1`.
    pub to: Loc<String>,
    /// A minijinja template, relative to the templates directory, rendering the object in
    /// version `to` from `object` (the object in version `from`; `parent` is the same).
    /// As the API server requires, whatever the template says: `apiVersion` is `to`'s,
    /// `kind` is kept, and `metadata` is the input's but for `labels` and `annotations`,
    /// which the template may change. `status` is what the template renders.
    pub template: Loc<String>,
}

#[derive(Clone, Debug, Deserialize, Serialize, JsonSchema)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PrinterColumn {
    pub name: String,
    /// `string`, `integer`, `number`, `boolean` or `date`.
    #[serde(rename = "type")]
    pub type_: String,
    /// A simple JSONPath into the object, e.g. `.status.url`.
    pub json_path: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

impl RuleSpec {
    /// Whether parents carry Rulebook's finalizer: the rule has a say in their deletion.
    /// (So does `targetNamespaces` on a rule whose parents discovery finds namespaced:
    /// `reconcile::context::RuleContext::rule_needs_finalizer`.)
    pub fn needs_finalizer(&self) -> bool {
        self.deletion.is_some()
            || self
                .children
                .iter()
                .any(|c| c.deletion_policy == DeletionPolicy::Orphan)
    }

    /// The index in `children` of the finalize child, if any.
    pub fn finalize_child(&self) -> Option<usize> {
        let f = self.deletion.as_ref()?.finalize.as_ref()?;
        self.children
            .iter()
            .position(|c| c.name.value == f.child.value)
    }
}

impl KindRef {
    /// `(group, version)` of the apiVersion; the core group is `""`.
    pub fn group_version(&self) -> (&str, &str) {
        split_api_version(&self.api_version)
    }
}

pub use crate::meta::split_api_version;
