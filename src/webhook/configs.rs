//! The `ValidatingWebhookConfiguration` and `MutatingWebhookConfiguration` that make the
//! API server call Rulebook for the rules that need it: a rule whose `spec.admission`
//! has `expr:` checks gets a validating webhook, one with `expr:` defaults a mutating
//! webhook. Pure: `rulebook crds --webhooks` and `rulebook render` print them, and
//! `apply.rs` applies them from the leader (`rulebook run`).
//!
//! One object of each kind per installation (named by `--webhook-configuration`,
//! default `rulebook`), with one webhook per rule in it, rather than an object per rule:
//! `rulebook rbac` can then grant `get`, `patch` and `delete` on exactly that name
//! (`resourceNames`), a rule that goes is removed by applying the object without its
//! webhook (server-side apply drops the entry Rulebook's field manager owned), and no
//! `list` of other owners' webhook configurations is ever needed.
//!
//! Each webhook: the rule's parent group, version and resource, CREATE and UPDATE (the
//! checks' `operations`), `matchPolicy: Equivalent` (a request in another served version
//! is converted to the rule's version first), `sideEffects: None`,
//! `admissionReviewVersions: [v1]`, `timeoutSeconds: 5` (the server answers within 4 s,
//! `server::Limits`), `failurePolicy` from `spec.admission.failurePolicy` (default
//! `Fail`), and a `namespaceSelector` that excludes `kube-system` and Rulebook's own
//! namespace (so that neither can be locked out by a webhook that does not answer) and,
//! with `run --namespace`, keeps to that namespace; `run --selector` becomes its
//! `objectSelector`. When `run --namespace` names Rulebook's own namespace (an install
//! beside its parents), excluding it as well would make a selector nothing matches, and
//! every check silently off (found by the metric-names test, whose API server never
//! called the webhook). So the webhooks of rules whose parent is a kind the rule defines
//! (`spec.crd`) judge it: Rulebook's own objects (its Deployment, Lease, certificate
//! Secret) are never of such a kind, so a webhook that does not answer cannot lock
//! Rulebook out. A rule on a built-in or foreign kind keeps the exclusion (its checks are
//! off there), and so does `kube-system`, always; [`Scope::judges_own_namespace`] and
//! [`Scope::excluded_namespace`] are what the warnings at start say.

use serde_json::{Value as Json, json};

use super::Endpoint;
use crate::meta::split_api_version;
use crate::render::{CompiledRule, RuleSet};
use crate::rules::crd::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};

/// The API server's timeout for a call to Rulebook (`timeoutSeconds`, at most 30).
pub const TIMEOUT_SECONDS: u64 = 5;

/// What the webhook configurations are named and which parents they reach.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Scope {
    /// The name of both objects.
    pub name: String,
    /// Rulebook's own namespace, excluded with `kube-system`.
    pub own_namespace: Option<String>,
    /// `run --namespace`: only parents in this namespace.
    pub namespace: Option<String>,
    /// `run --selector`: only parents with these labels.
    pub selector: Option<String>,
}

/// The namespace no webhook of Rulebook's ever judges.
const KUBE_SYSTEM: &str = "kube-system";

impl Scope {
    /// `run --namespace` is Rulebook's own namespace (not `kube-system`), which the
    /// webhooks of rules on kinds they define then judge (see the module's header).
    pub fn judges_own_namespace(&self) -> bool {
        self.own_namespace.is_some()
            && self.own_namespace == self.namespace
            && self.namespace.as_deref() != Some(KUBE_SYSTEM)
    }

    /// `run --namespace` names a namespace no webhook judges (`kube-system`): every
    /// `expr:` check and default is off there.
    pub fn excluded_namespace(&self) -> Option<&str> {
        self.namespace.as_deref().filter(|ns| *ns == KUBE_SYSTEM)
    }
}

/// A `--selector` that is not a label selector.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("--selector {0:?} is not a label selector Rulebook can pass to a webhook")]
pub struct SelectorError(String);

/// Whether a rule has `expr:` checks (a validating webhook).
pub fn validates(rule: &CompiledRule) -> bool {
    rule.rule
        .spec
        .admission
        .as_ref()
        .is_some_and(|a| a.validate.iter().any(|v| v.expr.is_some()))
}

/// Whether a rule has `expr:` defaults (a mutating webhook).
pub fn mutates(rule: &CompiledRule) -> bool {
    rule.rule
        .spec
        .admission
        .as_ref()
        .is_some_and(|a| a.default.iter().any(|d| d.expr.is_some()))
}

/// Whether any rule of `set` needs the webhook server (admission or conversion).
pub fn needed(set: &RuleSet) -> bool {
    set.rules.values().any(|r| {
        validates(r)
            || mutates(r)
            || r.rule
                .spec
                .crd
                .as_ref()
                .is_some_and(|c| !c.conversion.is_empty())
    })
}

/// The validating configuration, or `None` when no rule has `expr:` checks.
pub fn validating(
    set: &RuleSet,
    endpoint: &Endpoint,
    scope: &Scope,
) -> Result<Option<Json>, SelectorError> {
    configuration(set, endpoint, scope, Kind::Validating)
}

/// The mutating configuration, or `None` when no rule has `expr:` defaults.
pub fn mutating(
    set: &RuleSet,
    endpoint: &Endpoint,
    scope: &Scope,
) -> Result<Option<Json>, SelectorError> {
    configuration(set, endpoint, scope, Kind::Mutating)
}

/// Both, as far as the rules need them.
pub fn configurations(
    set: &RuleSet,
    endpoint: &Endpoint,
    scope: &Scope,
) -> Result<Vec<Json>, SelectorError> {
    Ok([
        validating(set, endpoint, scope)?,
        mutating(set, endpoint, scope)?,
    ]
    .into_iter()
    .flatten()
    .collect())
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Validating,
    Mutating,
}

impl Kind {
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Validating => "ValidatingWebhookConfiguration",
            Kind::Mutating => "MutatingWebhookConfiguration",
        }
    }

    pub fn plural(self) -> &'static str {
        match self {
            Kind::Validating => "validatingwebhookconfigurations",
            Kind::Mutating => "mutatingwebhookconfigurations",
        }
    }

    fn path(self) -> &'static str {
        match self {
            Kind::Validating => "validate",
            Kind::Mutating => "mutate",
        }
    }
}

fn configuration(
    set: &RuleSet,
    endpoint: &Endpoint,
    scope: &Scope,
    kind: Kind,
) -> Result<Option<Json>, SelectorError> {
    let object_selector = scope.selector.as_deref().map(label_selector).transpose()?;
    let webhooks: Vec<Json> = set
        .rules
        .values()
        .filter(|r| match kind {
            Kind::Validating => validates(r),
            Kind::Mutating => mutates(r),
        })
        .map(|r| webhook(set, r, endpoint, scope, kind, object_selector.as_ref()))
        .collect();
    if webhooks.is_empty() {
        return Ok(None);
    }
    Ok(Some(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": kind.kind(),
        "metadata": {
            "name": scope.name,
            "labels": {MANAGED_BY_LABEL: MANAGED_BY_VALUE, "app.kubernetes.io/name": "rulebook"},
        },
        "webhooks": webhooks,
    })))
}

/// The webhook's name (a fully qualified name, as the API requires).
pub fn webhook_name(rule: &str) -> String {
    format!("{rule}.rules.rulebook.dev")
}

fn webhook(
    set: &RuleSet,
    rule: &CompiledRule,
    endpoint: &Endpoint,
    scope: &Scope,
    kind: Kind,
    object_selector: Option<&Json>,
) -> Json {
    let parent = &rule.rule.spec.parent;
    let (group, version) = split_api_version(&parent.api_version);
    let plural = crate::rbac::plural_of(set, &parent.api_version, &parent.kind);
    let resource_scope = match &rule.rule.spec.crd {
        Some(crd) => crd
            .scope
            .as_ref()
            .map(|s| s.value.clone())
            .unwrap_or_else(|| "Namespaced".into()),
        None => "*".into(),
    };
    let failure_policy = rule
        .rule
        .spec
        .admission
        .as_ref()
        .and_then(|a| a.failure_policy.as_ref())
        .map(|p| p.value.clone())
        .unwrap_or_else(|| "Fail".into());
    let mut hook = json!({
        "name": webhook_name(&rule.name),
        "clientConfig": endpoint.client_config(&format!("/{}/{}", kind.path(), rule.name)),
        "rules": [{
            "apiGroups": [group],
            "apiVersions": [version],
            "resources": [plural],
            "operations": operations(rule, kind),
            "scope": resource_scope,
        }],
        "namespaceSelector": namespace_selector(scope, rule.rule.spec.crd.is_some()),
        "failurePolicy": failure_policy,
        "matchPolicy": "Equivalent",
        "sideEffects": "None",
        "timeoutSeconds": TIMEOUT_SECONDS,
        "admissionReviewVersions": ["v1"],
    });
    if let Some(s) = object_selector {
        hook["objectSelector"] = s.clone();
    }
    if kind == Kind::Mutating {
        hook["reinvocationPolicy"] = json!("Never");
    }
    hook
}

/// CREATE and UPDATE, or for checks only the operations their `operations` name.
fn operations(rule: &CompiledRule, kind: Kind) -> Vec<String> {
    let all = || vec!["CREATE".to_string(), "UPDATE".to_string()];
    let Some(admission) = &rule.rule.spec.admission else {
        return all();
    };
    if kind == Kind::Mutating {
        return all();
    }
    let mut ops: Vec<String> = Vec::new();
    for check in admission.validate.iter().filter(|v| v.expr.is_some()) {
        if check.operations.is_empty() {
            return all();
        }
        for op in &check.operations {
            let op = op.value.to_uppercase();
            if !ops.contains(&op) {
                ops.push(op);
            }
        }
    }
    ops.sort();
    if ops.is_empty() { all() } else { ops }
}

/// `kube-system` and Rulebook's own namespace left out, the latter unless it is the
/// `run --namespace` and the rule defines its parent's kind (`defines_kind`: the module's
/// header); with `run --namespace`, only that namespace.
fn namespace_selector(scope: &Scope, defines_kind: bool) -> Json {
    let judge_own = defines_kind && scope.judges_own_namespace();
    let mut excluded = vec![KUBE_SYSTEM.to_string()];
    if let Some(own) = &scope.own_namespace
        && !excluded.contains(own)
        && !judge_own
    {
        excluded.push(own.clone());
    }
    let mut expressions = vec![json!({
        "key": "kubernetes.io/metadata.name",
        "operator": "NotIn",
        "values": excluded,
    })];
    if let Some(ns) = &scope.namespace {
        expressions.push(json!({
            "key": "kubernetes.io/metadata.name",
            "operator": "In",
            "values": [ns],
        }));
    }
    json!({"matchExpressions": expressions})
}

/// A label selector's text (`a=b,c!=d,e,!f,g in (h,i),j notin (k)`) as a `LabelSelector`.
pub fn label_selector(text: &str) -> Result<Json, SelectorError> {
    let bad = || SelectorError(text.to_string());
    let mut expressions = Vec::new();
    for requirement in split_requirements(text) {
        let r = requirement.trim();
        if r.is_empty() {
            continue;
        }
        let (key, operator, values) = if let Some((k, v)) = r.split_once("!=") {
            (k, "NotIn", vec![v.trim().to_string()])
        } else if let Some((k, v)) = r.split_once("==").or_else(|| r.split_once('=')) {
            (k, "In", vec![v.trim().to_string()])
        } else if let Some(k) = r.strip_prefix('!') {
            (k, "DoesNotExist", vec![])
        } else if let Some((k, rest)) = r.split_once(" notin ") {
            (k, "NotIn", set_values(rest).ok_or_else(bad)?)
        } else if let Some((k, rest)) = r.split_once(" in ") {
            (k, "In", set_values(rest).ok_or_else(bad)?)
        } else {
            (r, "Exists", vec![])
        };
        let key = key.trim();
        if key.is_empty() || key.contains([' ', '(', ')', '=', '!']) {
            return Err(bad());
        }
        let mut e = json!({"key": key, "operator": operator});
        if !values.is_empty() {
            e["values"] = json!(values);
        }
        expressions.push(e);
    }
    Ok(json!({"matchExpressions": expressions}))
}

/// Splits at the commas outside parentheses.
fn split_requirements(text: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0usize);
    for (i, c) in text.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&text[start..]);
    out
}

fn set_values(rest: &str) -> Option<Vec<String>> {
    let inner = rest.trim().strip_prefix('(')?.strip_suffix(')')?;
    Some(
        inner
            .split(',')
            .map(|v| v.trim().to_string())
            .filter(|v| !v.is_empty())
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::webhook::Base;

    /// A rule set of `rules` (file name → text), each with a ConfigMap child.
    fn set(rules: &[(&str, &str)]) -> RuleSet {
        let dir = tempfile::tempdir().unwrap();
        let (r, t) = (dir.path().join("rules"), dir.path().join("templates"));
        std::fs::create_dir_all(&r).unwrap();
        std::fs::create_dir_all(&t).unwrap();
        std::fs::write(
            t.join("cm.yaml"),
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: x\n",
        )
        .unwrap();
        for (name, text) in rules {
            std::fs::write(r.join(format!("{name}.yaml")), text).unwrap();
        }
        let read = crate::rules::read(&r, &t);
        crate::render::compile_read(&read, &crate::render::Limits::default())
            .unwrap_or_else(|d| panic!("{d:?}"))
    }

    fn rule(name: &str, kind: &str, admission: &str) -> String {
        format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: {name}\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: {kind}\n  children:\n    - name: cm\n      apiVersion: v1\n      kind: ConfigMap\n      template: cm.yaml\n  crd:\n    specSchema:\n      type: object\n      x-kubernetes-preserve-unknown-fields: true\n{admission}"
        )
    }

    fn endpoint() -> Endpoint {
        Endpoint {
            base: Base::Service {
                namespace: "rulebook-system".into(),
                name: "rulebook-webhook".into(),
                port: 443,
            },
            ca_bundle_pem: b"CA".to_vec(),
        }
    }

    /// Each kind of configuration holds a webhook for exactly the rules that need it,
    /// with the rule's failure policy and operations.
    #[test]
    fn rules_with_expr_checks_and_defaults_get_their_webhooks() {
        let checks = "  admission:\n    failurePolicy: Ignore\n    validate:\n      - expr: \"parent.spec.a\"\n        message: m\n        operations: [UPDATE]\n      - cel: \"self.metadata.name != ''\"\n        message: m\n";
        let defaults =
            "  admission:\n    default:\n      - path: spec.image\n        expr: \"'nginx'\"\n";
        let cel_only = "  admission:\n    validate:\n      - cel: \"self.metadata.name != ''\"\n        message: m\n";
        let set = set(&[
            ("checked", &rule("checked", "Checked", checks)),
            ("defaulted", &rule("defaulted", "Defaulted", defaults)),
            ("celonly", &rule("celonly", "CelOnly", cel_only)),
            ("plain", &rule("plain", "Plain", "")),
        ]);
        let scope = Scope {
            name: "rulebook".into(),
            ..Scope::default()
        };
        let v = validating(&set, &endpoint(), &scope)
            .unwrap()
            .expect("validating");
        let hooks = v["webhooks"].as_array().unwrap();
        assert_eq!(hooks.len(), 1, "only the rule with an expr: check");
        let h = &hooks[0];
        assert_eq!(h["name"], "checked.rules.rulebook.dev");
        assert_eq!(h["failurePolicy"], "Ignore");
        assert_eq!(h["rules"][0]["operations"], json!(["UPDATE"]));
        assert_eq!(h["rules"][0]["resources"], json!(["checkeds"]));
        assert_eq!(h["clientConfig"]["service"]["path"], "/validate/checked");
        assert_eq!(h["clientConfig"]["caBundle"], "Q0E=");
        let m = mutating(&set, &endpoint(), &scope)
            .unwrap()
            .expect("mutating");
        let hooks = m["webhooks"].as_array().unwrap();
        assert_eq!(hooks.len(), 1);
        assert_eq!(hooks[0]["failurePolicy"], "Fail", "the default");
        assert_eq!(
            hooks[0]["clientConfig"]["service"]["path"],
            "/mutate/defaulted"
        );
        assert_eq!(
            hooks[0]["rules"][0]["operations"],
            json!(["CREATE", "UPDATE"])
        );
        let plain = set_without_webhooks();
        assert_eq!(
            configurations(&plain, &endpoint(), &scope).unwrap(),
            Vec::<Json>::new()
        );
        assert!(!needed(&plain) && needed(&set));
        assert_eq!(
            crate::webhook::unserved(&set)
                .iter()
                .map(|(r, _)| r.as_str())
                .collect::<Vec<_>>(),
            ["checked", "defaulted"]
        );
    }

    fn set_without_webhooks() -> RuleSet {
        set(&[("plain", &rule("plain", "Plain", ""))])
    }

    #[test]
    fn selectors_become_match_expressions() {
        let s = label_selector("shard=a, tier!=web,team in (x, y),!legacy,app").unwrap();
        let e = s["matchExpressions"].as_array().unwrap();
        assert_eq!(e.len(), 5);
        assert_eq!(
            e[0],
            json!({"key": "shard", "operator": "In", "values": ["a"]})
        );
        assert_eq!(
            e[1],
            json!({"key": "tier", "operator": "NotIn", "values": ["web"]})
        );
        assert_eq!(
            e[2],
            json!({"key": "team", "operator": "In", "values": ["x", "y"]})
        );
        assert_eq!(e[3], json!({"key": "legacy", "operator": "DoesNotExist"}));
        assert_eq!(e[4], json!({"key": "app", "operator": "Exists"}));
        assert!(label_selector("a in b").is_err());
    }

    #[test]
    fn kube_system_and_our_namespace_are_excluded() {
        let s = namespace_selector(
            &Scope {
                own_namespace: Some("rulebook-system".into()),
                namespace: Some("team-a".into()),
                ..Scope::default()
            },
            false,
        );
        assert_eq!(
            s["matchExpressions"][0]["values"],
            json!(["kube-system", "rulebook-system"])
        );
        assert_eq!(
            s["matchExpressions"][1],
            json!({"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a"]})
        );
    }

    #[test]
    fn our_namespace_is_judged_when_it_is_the_one_watched() {
        let scope = Scope {
            own_namespace: Some("team-a".into()),
            namespace: Some("team-a".into()),
            ..Scope::default()
        };
        assert!(scope.judges_own_namespace());
        let s = namespace_selector(&scope, true);
        assert_eq!(s["matchExpressions"][0]["values"], json!(["kube-system"]));
        assert_eq!(s["matchExpressions"][1]["values"], json!(["team-a"]));
        // A rule on a kind it does not define keeps the exclusion.
        let s = namespace_selector(&scope, false);
        assert_eq!(
            s["matchExpressions"][0]["values"],
            json!(["kube-system", "team-a"])
        );
        for (own, namespace) in [
            (Some("rulebook-system"), Some("team-a")),
            (Some("x"), None),
            (None, None),
            (Some("kube-system"), Some("kube-system")),
        ] {
            let scope = Scope {
                own_namespace: own.map(Into::into),
                namespace: namespace.map(Into::into),
                ..Scope::default()
            };
            assert!(!scope.judges_own_namespace(), "{scope:?}");
        }
    }
}
