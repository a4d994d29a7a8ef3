//! Applying the admission policies of the rules' `cel:` keys (generated, purely, by
//! `rules/policy.rs`): the one writer does it (the leader, or with `--sharding` the
//! replica whose share holds the policy's name, as for CRDs), on every rule change, with
//! server-side apply and Rulebook's field manager. Unlike a CRD a policy holds no data:
//! the policies of this installation (label `rulebook.dev/installation`, `run
//! --lease-name`) that no rule generates any more are deleted. An object of a policy's
//! name that is not Rulebook's, or is another installation's, is never changed: the rule
//! gets a problem on `/status` instead.

use std::collections::BTreeSet;

use kube::api::{Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value as Json;

use crate::meta::FIELD_MANAGER;
use crate::render::RuleSet;
use crate::rules::policy::{self, INSTALLATION_LABEL, Resource, Scope};

pub use crate::rules::policy::KINDS;

fn api(client: &kube::Client, kind: &str) -> Api<DynamicObject> {
    let plural = KINDS
        .iter()
        .find(|(k, _)| *k == kind)
        .map_or("", |(_, p)| *p);
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind);
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, plural),
    )
}

/// The parent's resource, its plural as discovery gives it (guessed when the kind is not
/// served yet).
async fn resource(client: &kube::Client, rule: &crate::rules::Rule) -> Resource {
    let mut r = Resource::of(rule);
    let gvk = GroupVersionKind::gvk(&r.group, &r.version, &rule.spec.parent.kind);
    if let Ok((ar, _)) = kube::discovery::pinned_kind(client, &gvk).await {
        r.plural = ar.plural;
    }
    r
}

/// Every policy and binding of `set`, per rule.
pub async fn desired(
    client: &kube::Client,
    set: &RuleSet,
    scope: &Scope,
) -> Vec<(String, Vec<Json>)> {
    let mut out = Vec::new();
    for rule in set.rules.values() {
        if rule.rule.spec.admission.is_none() {
            continue;
        }
        let objects = policy::policies(&rule.rule, &Resource::of(&rule.rule), scope);
        if objects.is_empty() {
            continue;
        }
        let resource = resource(client, &rule.rule).await;
        out.push((
            rule.name.clone(),
            policy::policies(&rule.rule, &resource, scope),
        ));
    }
    out
}

/// Applies the policies of `set` and deletes this installation's others. `mine` says
/// whether this replica writes the object of that name. Failures are returned per rule,
/// `(rule, message)`.
pub async fn publish(
    client: &kube::Client,
    set: &RuleSet,
    scope: &Scope,
    mine: &(dyn Fn(&str) -> bool + Sync),
) -> Vec<(String, String)> {
    let wanted = desired(client, set, scope).await;
    let mut problems = Vec::new();
    let mut keep: BTreeSet<(String, String)> = BTreeSet::new();
    for (rule, objects) in &wanted {
        for obj in objects {
            let kind = obj["kind"].as_str().unwrap_or_default().to_string();
            let name = obj["metadata"]["name"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            keep.insert((kind.clone(), name.clone()));
            if !mine(&name) {
                continue;
            }
            if let Err(message) = apply_one(client, &kind, &name, obj, scope).await {
                tracing::error!(%rule, %kind, %name, "{message}");
                problems.push((rule.clone(), message));
            }
        }
    }
    if let Err(message) = remove_others(client, scope, &keep, mine).await {
        if wanted.is_empty() {
            // No rule has a policy and none can be listed (e.g. RBAC without them): fine.
            tracing::debug!("{message}");
        } else {
            tracing::error!("{message}");
            problems.extend(wanted.iter().map(|(r, _)| (r.clone(), message.clone())));
        }
    }
    problems
}

/// An API error about a policy, with a hint when RBAC refused it.
fn describe(kind: &str, name: &str, e: kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "{kind} {name}: {}; `rulebook rbac` grants the rules' policies by name",
            s.message
        ),
        e => format!("{kind} {name}: {e}"),
    }
}

/// Why a live policy of this name is not this installation's to change, if it is not:
/// it is not Rulebook's (neither its label nor its field manager, as `crds::foreign`
/// asks of a CRD), or it is another installation's.
fn not_ours(live: &Json, scope: &Scope) -> Option<String> {
    let labelled = live
        .pointer("/metadata/labels")
        .and_then(|l| l.get(crate::rules::crd::MANAGED_BY_LABEL))
        .and_then(Json::as_str)
        == Some(crate::rules::crd::MANAGED_BY_VALUE);
    let applied = live
        .pointer("/metadata/managedFields")
        .and_then(Json::as_array)
        .is_some_and(|m| m.iter().any(|e| e["manager"] == FIELD_MANAGER));
    if !labelled && !applied {
        return Some(format!(
            "it exists and is not Rulebook's (no label {}={}, no field of Rulebook's field manager); refusing to take it over",
            crate::rules::crd::MANAGED_BY_LABEL,
            crate::rules::crd::MANAGED_BY_VALUE
        ));
    }
    match live
        .pointer("/metadata/labels")
        .and_then(|l| l.get(INSTALLATION_LABEL))
        .and_then(Json::as_str)
    {
        Some(other) if other != scope.installation => Some(format!(
            "it belongs to the Rulebook installation '{other}' (this one is '{}', run --lease-name); refusing to take it over",
            scope.installation
        )),
        _ => None,
    }
}

/// Brings one policy or binding to `desired`.
async fn apply_one(
    client: &kube::Client,
    kind: &str,
    name: &str,
    desired: &Json,
    scope: &Scope,
) -> Result<(), String> {
    let api = api(client, kind);
    let live = api
        .get_opt(name)
        .await
        .map_err(|e| describe(kind, name, e))?;
    if let Some(live) = live.map(|l| serde_json::to_value(l).unwrap_or_default()) {
        if let Some(why) = not_ours(&live, scope) {
            return Err(format!("{kind} {name}: {why}"));
        }
        if matches(desired, &live) {
            return Ok(());
        }
    }
    let params = PatchParams::apply(FIELD_MANAGER).force();
    api.patch(name, &params, &Patch::Apply(desired))
        .await
        .map_err(|e| describe(kind, name, e))?;
    tracing::info!(%kind, %name, "admission policy applied");
    Ok(())
}

/// Deletes this installation's policies and bindings that are not in `keep`.
async fn remove_others(
    client: &kube::Client,
    scope: &Scope,
    keep: &BTreeSet<(String, String)>,
    mine: &(dyn Fn(&str) -> bool + Sync),
) -> Result<(), String> {
    let selector = format!(
        "{}={},{INSTALLATION_LABEL}={}",
        crate::rules::crd::MANAGED_BY_LABEL,
        crate::rules::crd::MANAGED_BY_VALUE,
        scope.installation
    );
    for (kind, _) in KINDS {
        let api = api(client, kind);
        let live = api
            .list_metadata(&ListParams::default().labels(&selector))
            .await
            .map_err(|e| describe(kind, "(list)", e))?;
        for obj in live.items {
            let name = obj.metadata.name.unwrap_or_default();
            if keep.contains(&(kind.to_string(), name.clone())) || !mine(&name) {
                continue;
            }
            match api.delete(&name, &DeleteParams::default()).await {
                Ok(_) => tracing::info!(%kind, %name, "admission policy deleted: no rule needs it"),
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(describe(kind, &name, e)),
            }
        }
    }
    Ok(())
}

/// Whether the live object already has the desired spec and labels.
fn matches(desired: &Json, live: &Json) -> bool {
    crate::meta::json_subset(&desired["spec"], &live["spec"])
        && crate::meta::json_subset(&desired["metadata"]["labels"], &live["metadata"]["labels"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn another_installations_policy_is_not_taken_over() {
        let scope = Scope {
            installation: "a".into(),
            ..Scope::default()
        };
        let ours = json!({"metadata": {"labels": {
            "app.kubernetes.io/managed-by": "rulebook", INSTALLATION_LABEL: "a"}}});
        assert_eq!(not_ours(&ours, &scope), None);
        let theirs = json!({"metadata": {"labels": {
            "app.kubernetes.io/managed-by": "rulebook", INSTALLATION_LABEL: "b"}}});
        assert!(not_ours(&theirs, &scope).is_some_and(|w| w.contains("installation 'b'")));
        let foreign = json!({"metadata": {"managedFields": [{"manager": "kubectl"}]}});
        assert!(not_ours(&foreign, &scope).is_some());
    }
}
