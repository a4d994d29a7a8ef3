//! Installing the rules' CRDs (`rulebook run --install-crds`): the I/O half of CRD
//! support, kept apart from the pure generation and checks in `rules/crd.rs`. It changes only
//! CRDs that are Rulebook's: a CRD of the same name that somebody else installed is
//! refused, never taken over (a rule file must not be able to rewrite another
//! operator's API). It never deletes a CRD.

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams};
use serde_json::Value as Json;

use crate::meta::FIELD_MANAGER;
use crate::rules::crd::{
    MANAGED_BY_LABEL, MANAGED_BY_VALUE, add_version_hint, breaking_changes, crd_with_webhook,
    needs_conversion_webhook,
};

/// The storage version's schema of a CRD object.
fn schema_of(crd: &Json) -> Option<&Json> {
    crd.pointer("/spec/versions")?
        .as_array()?
        .iter()
        .find(|v| v.get("storage") == Some(&Json::Bool(true)))?
        .pointer("/schema/openAPIV3Schema")
}

/// The schema of version `name` of a CRD object.
fn version_schema<'a>(crd: &'a Json, name: &str) -> Option<&'a Json> {
    crd.pointer("/spec/versions")?
        .as_array()?
        .iter()
        .find(|v| v.get("name").and_then(Json::as_str) == Some(name))?
        .pointer("/schema/openAPIV3Schema")
}

/// What `desired` breaks of the live CRD: per version both have (each version's objects
/// are read and validated in it), and a version dropped while objects may still be
/// stored in it (`status.storedVersions`). A single-version CRD whose version changes
/// name compares storage schemas, as before versions existed.
pub fn breaking(live: &Json, desired: &Json) -> Vec<String> {
    let names = |crd: &Json| -> Vec<String> {
        crd.pointer("/spec/versions")
            .and_then(Json::as_array)
            .map(|a| {
                a.iter()
                    .filter_map(|v| v.get("name").and_then(Json::as_str).map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    };
    let (old, new) = (names(live), names(desired));
    let mut changes = Vec::new();
    let shared: Vec<&String> = old.iter().filter(|n| new.contains(n)).collect();
    if shared.is_empty() {
        if let (Some(o), Some(n)) = (schema_of(live), schema_of(desired)) {
            breaking_changes(o, n, "", &mut changes);
        }
        return changes;
    }
    for name in shared {
        if let (Some(o), Some(n)) = (version_schema(live, name), version_schema(desired, name)) {
            let mut here = Vec::new();
            breaking_changes(o, n, "", &mut here);
            let prefix = if old.len() > 1 || new.len() > 1 {
                format!("{name}: ")
            } else {
                String::new()
            };
            changes.extend(here.into_iter().map(|c| format!("{prefix}{c}")));
        }
    }
    let stored: Vec<&str> = live
        .pointer("/status/storedVersions")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    for name in old.iter().filter(|n| !new.contains(n)) {
        if stored.contains(&name.as_str()) {
            changes.push(format!(
                "version {name} removed while objects may be stored in it (status.storedVersions); keep it until the storage migration has dropped it"
            ));
        }
    }
    changes
}

/// Why the live CRD `live` is not Rulebook's to change, or `None` when it is: Rulebook
/// applied it (its field manager `rulebook` owns fields of it), or it carries the label
/// `app.kubernetes.io/managed-by: rulebook` (e.g. from `rulebook crds | kubectl apply
/// -f -`, or set by hand to hand a CRD over to Rulebook).
pub fn foreign(live: &Json) -> Option<String> {
    let labelled = live
        .pointer("/metadata/labels")
        .and_then(|l| l.get(MANAGED_BY_LABEL))
        .and_then(Json::as_str)
        == Some(MANAGED_BY_VALUE);
    let mut managers: Vec<&str> = live
        .pointer("/metadata/managedFields")
        .and_then(Json::as_array)
        .map(|entries| {
            entries
                .iter()
                .filter_map(|e| e.get("manager").and_then(Json::as_str))
                .collect()
        })
        .unwrap_or_default();
    managers.sort_unstable();
    managers.dedup();
    if labelled || managers.contains(&FIELD_MANAGER) {
        return None;
    }
    let managed_by = if managers.is_empty() {
        "no recorded field manager".to_string()
    } else {
        format!("field managers {}", managers.join(", "))
    };
    Some(format!(
        "it exists and was not installed by Rulebook ({managed_by}; no label \
         {MANAGED_BY_LABEL}={MANAGED_BY_VALUE}); refusing to take it over. Give spec.parent \
         another group or kind, or drop spec.crd to use the CRD as it is; to hand it to \
         Rulebook, label it {MANAGED_BY_LABEL}={MANAGED_BY_VALUE}"
    ))
}

/// An API error about CRD `name`, with a hint when RBAC refused it.
fn describe(name: &str, e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 403 => format!(
            "CRD {name}: {}; `rulebook rbac --install-crds` grants access to the CRDs the \
             rules define, by name: regenerate the RBAC when a rule adds a CRD",
            s.message
        ),
        e => format!("CRD {name}: {e}"),
    }
}

/// Applies the CRDs of `set` (server-side apply, field manager `rulebook`), refusing
/// CRDs Rulebook does not own ([`foreign`]) and breaking schema changes unless the rule
/// allows them, and waits until each is Established. Failures are reported per rule
/// (`(rule, message)`); the others go on. Never deletes a CRD. Only the CRDs whose name
/// `mine` accepts are written (a sharded replica writes those whose name hashes into
/// its share; the others wait until they are Established).
pub async fn install(
    client: &kube::Client,
    set: &crate::render::RuleSet,
    mine: &(dyn Fn(&str) -> bool + Sync),
) -> Vec<(String, String)> {
    install_with(client, set, mine, None).await
}

/// The conversion webhook's `clientConfig` for a path (`/convert/<rule>`): the webhook
/// server's `Endpoint::client_config`, with its current CA.
pub type ClientConfig<'a> = &'a (dyn Fn(&str) -> Json + Sync);

/// [`install`], with the conversion webhook's `clientConfig` in the CRDs of rules that
/// convert between versions. Without one, such a CRD is not applied: a CRD whose
/// conversion webhook nobody serves makes its kind unreadable.
pub async fn install_with(
    client: &kube::Client,
    set: &crate::render::RuleSet,
    mine: &(dyn Fn(&str) -> bool + Sync),
    conversion: Option<ClientConfig<'_>>,
) -> Vec<(String, String)> {
    let api: Api<CustomResourceDefinition> = Api::all(client.clone());
    let mut failures = Vec::new();
    for rule in set.rules.values() {
        let converts = needs_conversion_webhook(&rule.rule);
        let client_config = conversion.map(|c| c(&crate::rules::crd::conversion_path(&rule.name)));
        let Some(desired) = crd_with_webhook(&rule.rule, client_config.as_ref()) else {
            continue;
        };
        let name = desired
            .pointer("/metadata/name")
            .and_then(Json::as_str)
            .unwrap_or("")
            .to_string();
        if converts && client_config.is_none() {
            failures.push((rule.name.clone(), unserved_conversion(&name)));
            continue;
        }
        let allow_breaking = rule
            .rule
            .spec
            .crd
            .as_ref()
            .is_some_and(|c| c.allow_breaking_changes);
        match api.get_opt(&name).await {
            Ok(Some(live)) => {
                let live = serde_json::to_value(&live).unwrap_or_default();
                if let Some(why) = foreign(&live) {
                    let msg = format!("CRD {name}: {why}");
                    tracing::error!(rule = %rule.name, "{msg}");
                    failures.push((rule.name.clone(), msg));
                    continue;
                }
                if !allow_breaking {
                    let changes = breaking(&live, &desired);
                    if !changes.is_empty() {
                        let msg = format!(
                            "CRD {name}: refusing breaking schema changes ({}); {}; or set spec.crd.allowBreakingChanges: true to apply them",
                            changes.join("; "),
                            add_version_hint(&rule.rule)
                        );
                        tracing::error!(rule = %rule.name, "{msg}");
                        failures.push((rule.name.clone(), msg));
                        continue;
                    }
                }
                // Unchanged: no write.
                if crd_matches(&live, &desired) {
                    continue;
                }
            }
            Ok(None) => {}
            Err(e) => {
                failures.push((rule.name.clone(), describe(&name, &e)));
                continue;
            }
        }
        if !mine(&name) {
            continue;
        }
        // Forced: Rulebook owns this CRD (checked above), so it takes back fields another
        // manager changed. A CRD created between the read and this write by somebody else
        // is the one gap; creating CRDs is a cluster-admin's business.
        let params = PatchParams::apply(FIELD_MANAGER).force();
        if let Err(e) = api.patch(&name, &params, &Patch::Apply(&desired)).await {
            let msg = describe(&name, &e);
            tracing::error!(rule = %rule.name, "{msg}");
            failures.push((rule.name.clone(), msg));
            continue;
        }
        tracing::info!(rule = %rule.name, crd = %name, "CRD applied");
        let established = kube::runtime::wait::await_condition(
            api.clone(),
            &name,
            kube::runtime::conditions::is_crd_established(),
        );
        if tokio::time::timeout(std::time::Duration::from_secs(30), established)
            .await
            .is_err()
        {
            failures.push((
                rule.name.clone(),
                format!("CRD {name} is not Established after 30s"),
            ));
        }
    }
    failures
}

/// Why the CRD `name` of a rule with conversions is not applied without the webhook
/// server's endpoint.
fn unserved_conversion(name: &str) -> String {
    format!(
        "CRD {name}: not applied: the rule converts between versions (spec.crd.conversion) \
         through Rulebook's webhook server, which is off or has no certificate yet (run with \
         --webhook-url or --webhook-service); a CRD whose conversion nobody serves makes its \
         kind unreadable"
    )
}

/// Whether the live CRD already carries everything in `desired`.
fn crd_matches(live: &Json, desired: &Json) -> bool {
    crate::meta::json_subset(&desired["spec"], &live["spec"])
        && crate::meta::json_subset(&desired["metadata"]["labels"], &live["metadata"]["labels"])
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn a_crd_is_rulebooks_by_field_manager_or_label() {
        let by_manager = json!({"metadata": {"managedFields": [
            {"manager": "kube-apiserver", "operation": "Update"},
            {"manager": "rulebook", "operation": "Apply"},
        ]}});
        assert_eq!(foreign(&by_manager), None);
        let by_label = json!({"metadata": {
            "labels": {"app.kubernetes.io/managed-by": "rulebook"},
            "managedFields": [{"manager": "kubectl-client-side-apply"}],
        }});
        assert_eq!(foreign(&by_label), None);
    }

    #[test]
    fn a_crd_of_somebody_else_is_refused_with_the_reason() {
        let helm = json!({"metadata": {
            "labels": {"app.kubernetes.io/managed-by": "Helm"},
            "managedFields": [
                {"manager": "helm", "operation": "Update"},
                {"manager": "kube-apiserver", "operation": "Update"},
                {"manager": "helm", "operation": "Update", "subresource": "status"},
            ],
        }});
        let why = foreign(&helm).expect("refused");
        assert!(
            why.contains("not installed by Rulebook")
                && why.contains("field managers helm, kube-apiserver;"),
            "{why}"
        );
        assert!(why.contains("refusing to take it over"), "{why}");
        assert!(
            foreign(&json!({"metadata": {}}))
                .is_some_and(|w| w.contains("no recorded field manager")),
            "no managedFields, no label: not Rulebook's"
        );
    }
}
