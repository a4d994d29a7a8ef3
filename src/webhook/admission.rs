//! The admission webhooks' answer to an `AdmissionReview` (admission.k8s.io/v1) for a
//! rule's `expr:` checks and computed defaults: `POST /validate/<rule>` and
//! `/mutate/<rule>` (webhook/server.rs routes them here through webhook/handlers.rs).
//!
//! The steps, each bounded: the rule's references are resolved for the object (their
//! targets computed in the rule's sandbox on the blocking pool, as a reconcile's
//! dereference stage does), read, then the checks and defaults run on the pool
//! ([`CompiledRule::admit`]) within one budget.
//!
//! Why references are read from the API server here, not from a reconcile's caches:
//! every replica answers webhooks, and a sharded replica caches only its share of the
//! namespaces (and a standby caches nothing), so a cache would answer "missing" for
//! most objects on most replicas. A read per reference and request — by name, or a
//! label-selected list capped at [`MAX_LISTED`] objects — is right on every replica;
//! it runs under the server's deadline, and its cost is in docs/benchmarks.md
//! (admission latency). The reads use the operator's identity, which can read only the
//! kinds the rules reference (`rulebook rbac`), and stay in the object's namespace
//! unless the rule names another literally (render/refs.rs): a tenant cannot point a
//! check at another team's objects.
//!
//! A failure to judge (an expression error, the budget spent, a read that failed) is a
//! denial that says so — never a silent allow; the API server's `failurePolicy` only
//! applies when no replica answers at all.

use std::collections::HashMap;
use std::sync::Arc;

use kube::Client;
use kube::api::{Api, DynamicObject, ListParams};
use kube::core::discovery::Scope as KubeScope;
use kube::discovery::ApiResource;
use parking_lot::Mutex;
use serde_json::{Map, Value as Json, json};

use super::handlers::Offload;
use crate::meta::split_api_version;
use crate::render::admission::{AdmitRequest, Operation, Phase, Verdict};
use crate::render::{CompiledRule, Observed, RefSelect, RefTarget, RuleSet, Scope};

/// At most this many objects of a label-selected reference are read per request.
pub const MAX_LISTED: u32 = 100;

/// Reads a rule's references for an admission request: the kinds discovered once.
#[derive(Clone)]
pub struct RefReader {
    client: Option<Client>,
    kinds: Arc<Mutex<HashMap<(String, String), (ApiResource, Scope)>>>,
}

impl RefReader {
    /// A reader on `client`; `None` reads nothing (every reference is missing), for
    /// tests and `rulebook test`.
    pub fn new(client: Option<Client>) -> RefReader {
        RefReader {
            client,
            kinds: Arc::default(),
        }
    }

    /// The API resource and scope of `api_version`/`kind`, discovered once.
    async fn kind(&self, api_version: &str, kind: &str) -> Result<(ApiResource, Scope), String> {
        let key = (api_version.to_string(), kind.to_string());
        if let Some(found) = self.kinds.lock().get(&key) {
            return Ok(found.clone());
        }
        let Some(client) = &self.client else {
            return Err("no cluster".into());
        };
        let (group, version) = split_api_version(api_version);
        let gvk = kube::api::GroupVersionKind::gvk(group, version, kind);
        let (ar, caps) = kube::discovery::pinned_kind(client, &gvk)
            .await
            .map_err(|e| format!("{api_version} {kind}: {e}"))?;
        let scope = match caps.scope {
            KubeScope::Namespaced => Scope::Namespaced,
            KubeScope::Cluster => Scope::Cluster,
        };
        self.kinds.lock().insert(key, (ar.clone(), scope));
        Ok((ar, scope))
    }

    /// What `target` finds: the object (or the list, for a selector), `None` when
    /// nothing is there.
    async fn read(&self, ar: &ApiResource, target: &RefTarget) -> Result<Option<Json>, String> {
        let Some(client) = &self.client else {
            return Ok(None);
        };
        let api: Api<DynamicObject> = match &target.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
            None => Api::all_with(client.clone(), ar),
        };
        let lean = |o: DynamicObject| {
            let mut j = serde_json::to_value(o).unwrap_or(Json::Null);
            if let Some(Json::Object(meta)) = j.get_mut("metadata") {
                meta.remove("managedFields");
            }
            j
        };
        match &target.select {
            RefSelect::Name(name) => match api.get_opt(name).await {
                Ok(found) => Ok(found.map(lean)),
                Err(e) => Err(e.to_string()),
            },
            RefSelect::Labels(labels) => {
                let selector = labels
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(",");
                let lp = ListParams::default().labels(&selector).limit(MAX_LISTED);
                match api.list(&lp).await {
                    Ok(list) => Ok(Some(Json::Array(
                        list.items.into_iter().map(lean).collect(),
                    ))),
                    Err(e) => Err(e.to_string()),
                }
            }
        }
    }
}

/// The request's parts, as the review holds them.
struct Review {
    operation: Operation,
    object: Json,
    old: Option<Json>,
}

fn parse(review: &Json) -> Result<Review, String> {
    let operation = match review.pointer("/request/operation").and_then(Json::as_str) {
        Some("CREATE") => Operation::Create,
        Some("UPDATE") => Operation::Update,
        other => return Err(format!("operation {other:?} is not judged")),
    };
    let object = review
        .pointer("/request/object")
        .filter(|o| o.is_object())
        .cloned()
        .ok_or("the review has no object")?;
    let old = review
        .pointer("/request/oldObject")
        .filter(|o| o.is_object())
        .cloned();
    Ok(Review {
        operation,
        object,
        old,
    })
}

/// The answer to `review` for rule `rule`: allowed (with the defaults' patch on
/// `/mutate`), or denied with the check's message and field.
pub async fn review(
    set: Arc<RuleSet>,
    reader: RefReader,
    offload: Offload,
    phase: Phase,
    rule: String,
    review: Json,
) -> Json {
    let Some(compiled) = set.rules.get(&rule).cloned() else {
        return answer(&review, Err(format!("no rule {rule} is loaded")));
    };
    let parts = match parse(&review) {
        Ok(p) => p,
        Err(e) => return answer(&review, Err(e)),
    };
    let refs = match references(&compiled, &reader, &offload, &parts.object).await {
        Ok(r) => r,
        Err(e) => return answer(&review, Err(format!("rule {rule}: {e}"))),
    };
    let judged = offload
        .run(move || {
            let request = AdmitRequest {
                phase,
                operation: parts.operation,
                object: &parts.object,
                old: parts.old.as_ref(),
                refs: &refs,
            };
            compiled.admit(&request).map_err(|e| e.to_string())
        })
        .await;
    match judged {
        Some(Ok(v)) => answer(&review, Ok(v)),
        Some(Err(e)) => answer(&review, Err(e)),
        None => answer(
            &review,
            Err(format!("rule {rule}: the evaluation did not finish")),
        ),
    }
}

/// The object's references, read: name → object or list; a missing one is absent.
async fn references(
    compiled: &Arc<CompiledRule>,
    reader: &RefReader,
    offload: &Offload,
    object: &Json,
) -> Result<Map<String, Json>, String> {
    let declared = &compiled.rule.spec.references;
    let mut out = Map::new();
    if declared.is_empty() {
        return Ok(out);
    }
    let mut kinds = Vec::with_capacity(declared.len());
    for r in declared {
        kinds.push(reader.kind(&r.api_version, &r.kind).await?);
    }
    let scopes: Vec<Scope> = kinds.iter().map(|(_, s)| *s).collect();
    let (c, o) = (compiled.clone(), object.clone());
    let targets = offload
        .run(move || {
            let mut budget = c.budget();
            c.reference_targets(&o, &Observed::default(), &|i| scopes[i], &mut budget)
                .map_err(|e| e.to_string())
        })
        .await
        .ok_or("the references' targets were not computed")??;
    for t in targets {
        let (ar, _) = &kinds[t.reference];
        if let Some(found) = reader.read(ar, &t).await? {
            out.insert(declared[t.reference].name.value.clone(), found);
        }
    }
    Ok(out)
}

/// The `AdmissionReview` answer: a verdict, or a failure to judge (a denial).
fn answer(review: &Json, verdict: Result<Verdict, String>) -> Json {
    let uid = review.pointer("/request/uid").cloned().unwrap_or(json!(""));
    let mut response = json!({"uid": uid, "allowed": true});
    match verdict {
        Ok(Verdict::Allowed { patch }) => {
            if !patch.is_empty() {
                use base64::Engine as _;
                let bytes = serde_json::to_vec(&patch).unwrap_or_default();
                response["patchType"] = json!("JSONPatch");
                response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
            }
        }
        Ok(Verdict::Denied { message, field, .. }) => {
            response["allowed"] = json!(false);
            let mut status = json!({"code": 403, "reason": "Forbidden", "message": message});
            if let Some(f) = field {
                status["details"] = json!({"causes": [{"field": f, "message": message, "reason": "FieldValueInvalid"}]});
            }
            response["status"] = status;
        }
        Err(message) => {
            response["allowed"] = json!(false);
            response["status"] =
                json!({"code": 500, "reason": "InternalError", "message": message});
        }
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review_of(op: &str, object: Json, old: Option<Json>) -> Json {
        json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "operation": op, "object": object, "oldObject": old}})
    }

    #[test]
    fn a_denial_carries_the_uid_message_and_field() {
        let r = review_of("CREATE", json!({}), None);
        let a = answer(
            &r,
            Ok(Verdict::Denied {
                index: 0,
                message: "plan gold does not exist".into(),
                field: Some("spec.plan".into()),
            }),
        );
        assert_eq!(a["response"]["uid"], "u-1");
        assert_eq!(a["response"]["allowed"], false);
        assert_eq!(
            a["response"]["status"]["message"],
            "plan gold does not exist"
        );
        assert_eq!(
            a["response"]["status"]["details"]["causes"][0]["field"],
            "spec.plan"
        );
    }

    #[test]
    fn defaults_travel_as_a_base64_json_patch_and_failures_deny() {
        use base64::Engine as _;
        let r = review_of("CREATE", json!({}), None);
        let patch = vec![json!({"op": "add", "path": "/spec/image", "value": "x"})];
        let a = answer(
            &r,
            Ok(Verdict::Allowed {
                patch: patch.clone(),
            }),
        );
        assert_eq!(a["response"]["allowed"], true);
        assert_eq!(a["response"]["patchType"], "JSONPatch");
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(a["response"]["patch"].as_str().unwrap_or(""))
            .unwrap();
        assert_eq!(serde_json::from_slice::<Vec<Json>>(&bytes).unwrap(), patch);
        let none = answer(&r, Ok(Verdict::Allowed { patch: vec![] }));
        assert!(none["response"].get("patch").is_none());
        let failed = answer(&r, Err("rule x: budget".into()));
        assert_eq!(failed["response"]["allowed"], false);
        assert_eq!(failed["response"]["status"]["code"], 500);
    }

    #[test]
    fn a_review_without_an_object_or_with_delete_is_not_judged() {
        assert!(parse(&review_of("DELETE", json!({"a": 1}), None)).is_err());
        assert!(parse(&json!({"request": {"operation": "CREATE"}})).is_err());
        let ok = parse(&review_of("UPDATE", json!({"a": 1}), Some(json!({"a": 0})))).unwrap();
        assert_eq!(ok.operation, Operation::Update);
        assert_eq!(ok.old, Some(json!({"a": 0})));
    }
}
