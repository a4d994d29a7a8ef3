//! Applying the generated webhook configurations (`configs.rs`): the one writer does it
//! (the leader, or with `--sharding` the replica whose share holds the name, as for
//! CRDs), through the gated client, with server-side apply and Rulebook's field manager,
//! on every rule change and every change of the trusted CA bundle. A configuration that
//! is no longer needed is deleted. An object of that name that is not Rulebook's (no
//! label `app.kubernetes.io/managed-by: rulebook` and no field of Rulebook's field
//! manager) is never changed or deleted: the rules that need it get a problem on
//! `/status` instead.

use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value as Json;

use super::Endpoint;
use super::configs::{self, Kind, Scope};
use crate::meta::FIELD_MANAGER;
use crate::render::RuleSet;
use crate::rules::crd::{MANAGED_BY_LABEL, MANAGED_BY_VALUE};

/// Whether the live object is Rulebook's: its label, or a field of its field manager.
fn ours(live: &Json) -> bool {
    let labelled = live
        .pointer("/metadata/labels")
        .and_then(|l| l.get(MANAGED_BY_LABEL))
        .and_then(Json::as_str)
        == Some(MANAGED_BY_VALUE);
    let managed = live
        .pointer("/metadata/managedFields")
        .and_then(Json::as_array)
        .is_some_and(|m| m.iter().any(|e| e["manager"] == FIELD_MANAGER));
    labelled || managed
}

fn api(client: &kube::Client, kind: Kind) -> Api<DynamicObject> {
    let gvk = GroupVersionKind::gvk("admissionregistration.k8s.io", "v1", kind.kind());
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk, kind.plural()),
    )
}

/// The rules a configuration of `kind` serves.
fn served(set: &RuleSet, kind: Kind) -> Vec<String> {
    set.rules
        .values()
        .filter(|r| match kind {
            Kind::Validating => configs::validates(r),
            Kind::Mutating => configs::mutates(r),
        })
        .map(|r| r.name.clone())
        .collect()
}

/// Applies (or deletes) both configurations for `set`; `mine` says whether this replica
/// writes the object of that name. Failures are returned per rule, `(rule, message)`.
pub async fn publish(
    client: &kube::Client,
    set: &RuleSet,
    endpoint: &Endpoint,
    scope: &Scope,
    mine: &(dyn Fn(&str) -> bool + Sync),
) -> Vec<(String, String)> {
    let mut problems = Vec::new();
    if !mine(&scope.name) {
        return problems;
    }
    for kind in [Kind::Validating, Kind::Mutating] {
        let rules = served(set, kind);
        let desired = match kind {
            Kind::Validating => configs::validating(set, endpoint, scope),
            Kind::Mutating => configs::mutating(set, endpoint, scope),
        };
        let outcome = match desired {
            Ok(desired) => one(client, kind, &scope.name, desired.as_ref()).await,
            Err(e) => Err(e.to_string()),
        };
        if let Err(message) = outcome {
            tracing::error!(kind = kind.kind(), name = %scope.name, "{message}");
            problems.extend(rules.into_iter().map(|r| (r, message.clone())));
        }
    }
    problems
}

/// Brings one configuration to `desired` (`None`: absent).
async fn one(
    client: &kube::Client,
    kind: Kind,
    name: &str,
    desired: Option<&Json>,
) -> Result<(), String> {
    let api = api(client, kind);
    let describe = |e: kube::Error| match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "{} {name}: {}; `rulebook rbac --webhooks` grants it by name",
            kind.kind(),
            s.message
        ),
        e => format!("{} {name}: {e}", kind.kind()),
    };
    let live = api.get_opt(name).await.map_err(describe)?;
    let live = live.map(|l| serde_json::to_value(l).unwrap_or_default());
    if let Some(l) = &live
        && !ours(l)
    {
        return Err(format!(
            "{} {name}: it exists and is not Rulebook's (no label {MANAGED_BY_LABEL}={MANAGED_BY_VALUE}, \
             no field of field manager {FIELD_MANAGER}); refusing to change or delete it: name \
             another with run --webhook-configuration",
            kind.kind()
        ));
    }
    match (desired, live) {
        (Some(d), Some(l)) if matches(d, &l) => Ok(()),
        (Some(d), _) => {
            let params = PatchParams::apply(FIELD_MANAGER).force();
            api.patch(name, &params, &Patch::Apply(d))
                .await
                .map_err(describe)?;
            tracing::info!(kind = kind.kind(), %name, "webhook configuration applied");
            Ok(())
        }
        (None, Some(_)) => {
            match api.delete(name, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(s)) if s.code == 404 => {}
                Err(e) => return Err(describe(e)),
            }
            tracing::info!(kind = kind.kind(), %name, "webhook configuration deleted: no rule needs it");
            Ok(())
        }
        (None, None) => Ok(()),
    }
}

/// Whether the live object already has the desired webhooks and labels: an unchanged
/// configuration is not written again.
fn matches(desired: &Json, live: &Json) -> bool {
    crate::meta::json_subset(&desired["webhooks"], &live["webhooks"])
        && crate::meta::json_subset(&desired["metadata"]["labels"], &live["metadata"]["labels"])
}
