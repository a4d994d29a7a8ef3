//! The shared vocabulary: the names Rulebook writes on objects (labels, annotations, the
//! field manager) and the small helpers for Kubernetes names that every layer uses. A
//! leaf: it imports nothing of Rulebook's, so every other module may import it.

/// The field manager of every apply, and the `managedFields` entry the drift check reads.
pub const FIELD_MANAGER: &str = "rulebook";

/// The field manager of the status conditions a rule writes on parents of a kind whose
/// main rule is another (`rules::decorators`): its own, so that each rule's server-side
/// apply of the status removes only what that rule wrote before.
pub fn status_manager(rule: &str) -> String {
    format!("{FIELD_MANAGER}-{rule}")
}

/// The finalizer Rulebook puts on parents of rules that need a say in their deletion
/// (`spec.deletion`, or a child with `deletionPolicy: Orphan`).
pub const FINALIZER: &str = "rulebook.dev/finalizer";

/// The `.status` field where Rulebook records the rule version (content hash of the rule
/// and its templates) that last reconciled a parent — on parents of kinds the rule's
/// `spec.crd` defines (their schema has it). Children do not carry it: a rule edit
/// rewrites only the children whose content changes.
pub const STATUS_RULE_VERSION: &str = "ruleVersion";

/// Labels and annotations Rulebook puts on every child.
pub mod labels {
    /// The prefix of Rulebook's own label and annotation keys.
    pub const PREFIX: &str = "rulebook.dev/";
    pub const MANAGED_BY: &str = "app.kubernetes.io/managed-by";
    pub const MANAGED_BY_VALUE: &str = "rulebook";
    pub const RULE: &str = "rulebook.dev/rule";
    /// The UID of the parent; with the controller ownerReference (or, on a child whose
    /// `deletionPolicy` is `Orphan`, which carries none, with [`DELETION_POLICY`]), what
    /// pruning trusts.
    pub const OWNER: &str = "rulebook.dev/owner";
    /// The rule's child name (`spec.children[].name`) that produced the object.
    pub const CHILD: &str = "rulebook.dev/child";
    /// The rule version that produced the object: put on children by Rulebook before it
    /// moved to the parent's `status.ruleVersion`; removed from them by their next apply.
    pub const RULE_VERSION: &str = "rulebook.dev/rule-version";
    /// The hash of the desired object as last applied.
    pub const DESIRED_HASH: &str = "rulebook.dev/desired-hash";
    /// The annotations that change with every rule edit (not with the object's content).
    pub const PER_RULE_VERSION: &[&str] = &[RULE_VERSION, DESIRED_HASH];
    /// The `forEach` index of the object.
    pub const INDEX: &str = "rulebook.dev/index";
    /// `Orphan` on a child whose `deletionPolicy` is `Orphan`: the policy travels with the
    /// object, so that it is heeded after the rule that set it has changed (a child, or
    /// its kind, removed from the rule), also across restarts for a kind the rule still has.
    pub const DELETION_POLICY: &str = "rulebook.dev/deletion-policy";
    /// On a parent being torn down: the finalize step is over (`done`, `timed-out` or
    /// `failed`), so a restarted operator does not run it again.
    pub const FINALIZED: &str = "rulebook.dev/finalized";
    /// On a parent: `"true"` stops every write to it and its children (but one
    /// `Paused` condition) until it is removed or set to anything else.
    pub const PAUSED: &str = "rulebook.dev/paused";
    /// On a parent: the kinds of its `Orphan` children (`apiVersion/Kind`, separated by
    /// commas), so that children of a kind the rule no longer has are found and let go
    /// of from any process, after any restart (`reconcile::teardown::recorded`).
    pub const ORPHAN_KINDS: &str = "rulebook.dev/orphan-kinds";
    /// On a child whose `deletionPolicy` is `Orphan`: the name of its parent. Such a child
    /// carries no ownerReference (the garbage collector would follow it, and foreground
    /// deletion deletes every dependent whatever its policy); this is how its watch events
    /// find the parent. Its owner is [`OWNER`], as on every child.
    pub const PARENT_NAME: &str = "rulebook.dev/parent-name";
    /// On a cluster-scoped parent with Rulebook's finalizer: the namespaces its render
    /// places namespaced children in (sorted, separated by commas), recorded before any
    /// child is applied there. Its teardown looks for children nowhere else: anyone who
    /// may edit objects in some namespace can make one that claims the parent
    /// (`reconcile::teardown::places`).
    pub const CHILD_NAMESPACES: &str = "rulebook.dev/child-namespaces";
    /// On a child a namespaced parent placed in another namespace (the rule's
    /// `spec.targetNamespaces`): the parent's namespace. Such a child carries no
    /// ownerReference (a namespaced owner must be in its dependent's namespace: the
    /// garbage collector takes any other for absent and deletes the dependent); with
    /// [`PARENT_NAME`] this is how its watch events find the parent, and its owner is
    /// [`OWNER`], as on every child. Its parent carries Rulebook's finalizer: the teardown
    /// deletes it, as no garbage collector would.
    pub const PARENT_NAMESPACE: &str = "rulebook.dev/parent-namespace";

    /// Every label and annotation key Rulebook writes or reads on an object (a stub keeps
    /// these and no other: anyone may set keys with Rulebook's prefix on their objects).
    pub const OWN: &[&str] = &[
        MANAGED_BY,
        RULE,
        OWNER,
        CHILD,
        RULE_VERSION,
        DESIRED_HASH,
        INDEX,
        DELETION_POLICY,
        FINALIZED,
        PAUSED,
        ORPHAN_KINDS,
        PARENT_NAME,
        CHILD_NAMESPACES,
        PARENT_NAMESPACE,
    ];

    /// The label selector of a rule's children: `managed-by=rulebook,rule=<rule>`.
    pub fn child_selector(rule: &str) -> String {
        format!("{MANAGED_BY}={MANAGED_BY_VALUE},{RULE}={rule}")
    }
}

/// `group/version` → `(group, version)`; the core group is `""`.
/// Built-in kinds that are cluster-scoped, for rendering and checking without discovery.
pub fn is_cluster_scoped_builtin(api_version: &str, kind: &str) -> bool {
    matches!(
        (api_version, kind),
        ("v1", "Namespace" | "Node" | "PersistentVolume")
            | (
                "rbac.authorization.k8s.io/v1",
                "ClusterRole" | "ClusterRoleBinding"
            )
            | ("apiextensions.k8s.io/v1", "CustomResourceDefinition")
            | ("storage.k8s.io/v1", "StorageClass")
            | ("scheduling.k8s.io/v1", "PriorityClass")
            | (
                "admissionregistration.k8s.io/v1",
                "ValidatingWebhookConfiguration" | "MutatingWebhookConfiguration"
            )
    )
}

pub fn split_api_version(api_version: &str) -> (&str, &str) {
    match api_version.rsplit_once('/') {
        Some((g, v)) => (g, v),
        None => ("", api_version),
    }
}

/// An RFC 1123 label: lower-case alphanumerics and `-`, at most 63, not starting or
/// ending with `-`.
pub fn is_dns_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
        && !s.starts_with('-')
        && !s.ends_with('-')
}

/// An RFC 1123 subdomain: dot-separated RFC 1123 labels, at most 253 characters (the
/// names of most kinds, ServiceAccounts among them).
pub fn is_dns_subdomain(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.split('.').all(is_dns_label)
}

/// The plural Kubernetes uses for a kind it has no CRD for here (its own rule for
/// built-in kinds: lower case, `s` → `ses`, `y` → `ies`, else `s`).
pub fn guess_plural(kind: &str) -> String {
    let lower = kind.to_lowercase();
    if lower == "endpoints" {
        return lower;
    }
    if lower.ends_with('s') || lower.ends_with("ch") || lower.ends_with('x') {
        format!("{lower}es")
    } else if let Some(stem) = lower.strip_suffix('y')
        && !stem.ends_with(['a', 'e', 'i', 'o', 'u'])
    {
        format!("{stem}ies")
    } else {
        format!("{lower}s")
    }
}

/// `s` cut to at most `max` bytes (at a character boundary), ending with `…` when cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// Whether `want` is contained in `have`: every key of an object with a contained
/// value, arrays of the same length element by element, anything else equal. How the
/// writers of cluster objects (CRDs, webhook configurations, admission policies) tell an
/// object already as desired from one to write again, whatever the API server added
/// (defaults, status, managedFields).
pub fn json_subset(want: &serde_json::Value, have: &serde_json::Value) -> bool {
    use serde_json::Value as Json;
    match (want, have) {
        (Json::Object(w), Json::Object(h)) => w
            .iter()
            .all(|(k, v)| h.get(k).is_some_and(|hv| json_subset(v, hv))),
        (Json::Array(w), Json::Array(h)) => {
            w.len() == h.len() && w.iter().zip(h).all(|(a, b)| json_subset(a, b))
        }
        (w, h) => w == h,
    }
}

/// Reading a JSON object by a fixed path of keys, like `Value::pointer` without its cost:
/// `pointer` unescapes every token into a new `String` (two `replace` calls each), and the
/// render and reconcile paths read `metadata.name` and its like many times per parent.
pub trait JsonAt {
    /// The value at `path` (object keys only).
    fn at(&self, path: &[&str]) -> Option<&serde_json::Value>;
    /// The same, mutably.
    fn at_mut(&mut self, path: &[&str]) -> Option<&mut serde_json::Value>;
}

impl JsonAt for serde_json::Value {
    fn at(&self, path: &[&str]) -> Option<&serde_json::Value> {
        path.iter().try_fold(self, |v, k| v.as_object()?.get(*k))
    }

    fn at_mut(&mut self, path: &[&str]) -> Option<&mut serde_json::Value> {
        path.iter()
            .try_fold(self, |v, k| v.as_object_mut()?.get_mut(*k))
    }
}

/// How deeply `text` (JSON) nests objects and arrays, counted without parsing it
/// (brackets inside strings skipped): a cheap pass before a parse whose recursion a
/// hostile text must never reach.
pub fn nesting_depth(text: &str) -> usize {
    let (mut depth, mut max, mut in_string, mut escaped) = (0usize, 0usize, false, false);
    for b in text.bytes() {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => {
                depth += 1;
                max = max.max(depth);
            }
            b'}' | b']' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    max
}

#[cfg(test)]
mod json_at_tests {
    use super::JsonAt;
    use serde_json::json;

    #[test]
    fn reads_what_pointer_reads() {
        let mut v = json!({"metadata": {"name": "a", "labels": {"x/y": "1"}}, "list": [1]});
        for path in [
            &["metadata", "name"][..],
            &["metadata"],
            &[],
            &["nope", "name"],
        ] {
            let pointer = format!("/{}", path.join("/"));
            let pointer = if path.is_empty() {
                ""
            } else {
                pointer.as_str()
            };
            assert_eq!(v.at(path), v.pointer(pointer), "{path:?}");
        }
        // Keys with a slash need no escaping; arrays are not indexed.
        assert_eq!(v.at(&["metadata", "labels", "x/y"]), Some(&json!("1")));
        assert_eq!(v.at(&["list", "0"]), None);
        *v.at_mut(&["metadata", "name"]).unwrap() = json!("b");
        assert_eq!(v["metadata"]["name"], "b");
    }
}
