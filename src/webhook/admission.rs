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
//! label-selected list (in pages, up to the rule's `max_for_each` objects and
//! `parent_reference_bytes`, as a reconcile) — is right on every replica;
//! it runs under the server's deadline, and its cost is in docs/benchmarks.md
//! (admission latency). An object outside a reference's `watchSelector` is not found,
//! as the reconcile's caches would not hold it. The reads use the operator's identity, which can read only the
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

use super::offload::Offload;
use crate::meta::split_api_version;
use crate::render::admission::{AdmitRequest, Operation, Phase, Verdict};
use crate::render::{CompiledRule, Observed, RefSelect, RefTarget, RuleSet, Scope};
use crate::rules::Reference;

/// `(apiVersion, kind)` → the API resource and its scope, as discovered.
type Discovered = HashMap<(String, String), (ApiResource, Scope)>;

/// Reads a rule's references for an admission request: the kinds discovered once.
#[derive(Clone)]
pub struct RefReader {
    client: Option<Client>,
    kinds: Arc<Mutex<Discovered>>,
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

    /// What `target` of `reference` finds: the object (or the list, for a selector),
    /// `None` when nothing is there. What the reconcile's caches would not hold is not
    /// found here either: an object outside the reference's `watchSelector`. Every
    /// object read is charged to `left` (the bytes the request may still read), and a
    /// selector matching more than `max` objects is an error, not a silent cut.
    async fn read(
        &self,
        ar: &ApiResource,
        reference: &Reference,
        target: &RefTarget,
        left: &mut usize,
        max: usize,
    ) -> Result<Option<Json>, String> {
        let Some(client) = &self.client else {
            return Ok(None);
        };
        let api: Api<DynamicObject> = match &target.namespace {
            Some(ns) => Api::namespaced_with(client.clone(), ns, ar),
            None => Api::all_with(client.clone(), ar),
        };
        let watched = reference.watch_selector.as_ref().map(|w| w.value.as_str());
        match &target.select {
            RefSelect::Name(name) => {
                let found = api.get_opt(name).await.map_err(|e| e.to_string())?;
                match found.filter(|o| watched.is_none_or(|w| selects(w, &o.metadata.labels))) {
                    Some(o) => Ok(Some(charged(o, left, reference)?)),
                    None => Ok(None),
                }
            }
            RefSelect::Labels(want) => {
                // A tenant's values that are no label cannot match (and could change the
                // selector's meaning): nothing is listed for them, as in a reconcile.
                let Some(mut selector) = crate::reconcile::refs::label_selector(want) else {
                    return Ok(Some(Json::Array(Vec::new())));
                };
                if let Some(w) = watched {
                    selector = format!("{selector},{w}");
                }
                let list = list_all(&api, &selector, left, max, reference).await?;
                Ok(Some(Json::Array(list)))
            }
        }
    }
}

/// Objects per page of a selector's list: a page is read whole before it is charged.
const LIST_PAGE: u32 = 25;

/// Every object `selector` matches, a page at a time, each charged to `left`; an error
/// once more than `max` match.
async fn list_all(
    api: &Api<DynamicObject>,
    selector: &str,
    left: &mut usize,
    max: usize,
    reference: &Reference,
) -> Result<Vec<Json>, String> {
    let mut params = ListParams::default().labels(selector).limit(LIST_PAGE);
    let mut out = Vec::new();
    loop {
        let page = api.list(&params).await.map_err(|e| e.to_string())?;
        for o in page.items {
            out.push(charged(o, left, reference)?);
        }
        if out.len() > max {
            return Err(format!(
                "refs.{}: more than {max} objects match, the limit per parent",
                reference.name.value
            ));
        }
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => params = params.continue_token(&c),
            None => return Ok(out),
        }
    }
}

/// `o` as the templates see it (without `managedFields`), charged to `left`.
fn charged(o: DynamicObject, left: &mut usize, reference: &Reference) -> Result<Json, String> {
    let mut j = serde_json::to_value(o).unwrap_or(Json::Null);
    if let Some(Json::Object(meta)) = j.get_mut("metadata") {
        meta.remove("managedFields");
    }
    let bytes = json_bytes(&j);
    *left = left.checked_sub(bytes).ok_or_else(|| {
        format!(
            "refs.{}: the objects read take more than the limit per parent",
            reference.name.value
        )
    })?;
    Ok(j)
}

/// Bytes of `j` as compact JSON, counted without building the text.
fn json_bytes(j: &Json) -> usize {
    struct Counted(usize);
    impl std::io::Write for Counted {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 = self.0.saturating_add(buf.len());
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut n = Counted(0);
    serde_json::to_writer(&mut n, j).map_or(usize::MAX, |()| n.0)
}

/// Whether `labels` satisfy the label selector `selector` (a reference's
/// `watchSelector`, checked by `rulebook check`); one that does not parse selects none.
fn selects(selector: &str, labels: &Option<std::collections::BTreeMap<String, String>>) -> bool {
    let Ok(terms) = crate::rules::parse_label_selector(selector) else {
        return false;
    };
    let get = |k: &str| labels.as_ref().and_then(|l| l.get(k));
    terms.iter().all(|(k, v, negated)| match (v, negated) {
        (Some(v), false) => get(k) == Some(v),
        (Some(v), true) => get(k) != Some(v),
        (None, false) => get(k).is_some(),
        (None, true) => get(k).is_none(),
    })
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
    let mut object = review
        .pointer("/request/object")
        .filter(|o| o.is_object())
        .cloned()
        .ok_or("the review has no object")?;
    // The namespace is the request's, which the API server has checked (an object may
    // leave it out, e.g. with `generateName` or `kubectl create -n`): the references of
    // a namespaced parent are found there, never where the object says otherwise.
    if let Some(ns) = review.pointer("/request/namespace").and_then(Json::as_str)
        && !ns.is_empty()
        && let Some(meta) = object
            .as_object_mut()
            .map(|o| o.entry("metadata").or_insert_with(|| json!({})))
            .and_then(Json::as_object_mut)
    {
        meta.insert("namespace".into(), json!(ns));
    }
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
            // An error may quote what the expression was working on: no Secret value
            // of the references leaves in it either.
            compiled.admit_with_warnings(&request).map_err(|e| {
                let secrets =
                    crate::render::secret_values_in(refs.values().flat_map(|o| match o {
                        Json::Array(list) => list.iter().collect::<Vec<_>>(),
                        o => vec![o],
                    }));
                crate::render::redact(&e.to_string(), &secrets)
            })
        })
        .await;
    match judged {
        Some(Ok((v, warnings))) => with_warnings(answer(&review, Ok(v)), warnings),
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
            let mut budget = c.admission_budget();
            c.reference_targets(&o, &Observed::default(), &|i| scopes[i], &mut budget)
                .map_err(|e| e.to_string())
        })
        .await
        .ok_or("the references' targets were not computed")??;
    let limits = compiled.limits();
    let mut left = limits.parent_reference_bytes;
    for t in targets {
        let (Some((ar, _)), Some(r)) = (kinds.get(t.reference), declared.get(t.reference)) else {
            continue;
        };
        if let Some(found) = reader
            .read(ar, r, &t, &mut left, limits.max_for_each)
            .await?
        {
            out.insert(r.name.value.clone(), found);
        }
    }
    Ok(out)
}

/// The denial of an admission review whose body does not parse as JSON within serde's
/// nesting limit (128 levels: an object nested deeper than the webhook reads), when its
/// `request.uid` can still be read (skipping over values, which is not recursive);
/// `None` when it cannot (then the server answers 400).
pub fn unreadable(body: &[u8], rule: &str, error: &str) -> Option<Json> {
    #[derive(serde::Deserialize)]
    struct Shallow {
        request: ShallowRequest,
    }
    #[derive(serde::Deserialize)]
    struct ShallowRequest {
        uid: String,
    }
    let uid = serde_json::from_slice::<Shallow>(body).ok()?.request.uid;
    let review = json!({"request": {"uid": uid}});
    Some(answer(
        &review,
        Err(format!(
            "rule {rule}: the object cannot be judged: {error} (objects nested deeper than about 120 levels are refused)"
        )),
    ))
}

/// `answer` with `warnings` (fields, never values), which `kubectl` prints.
fn with_warnings(mut answer: Json, warnings: Vec<String>) -> Json {
    if !warnings.is_empty()
        && let Some(r) = answer.get_mut("response").and_then(Json::as_object_mut)
    {
        r.insert("warnings".into(), json!(warnings));
    }
    answer
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

    /// A review whose object is nested past serde's limit still gets a denial by its
    /// uid (a 400 would be a failed call, which `failurePolicy: Ignore` lets through).
    #[test]
    fn a_review_too_deep_to_read_is_denied_by_its_uid() {
        let deep = format!("{}1{}", "[".repeat(500), "]".repeat(500));
        let body = format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u-9","operation":"CREATE","object":{{"spec":{deep}}}}}}}"#
        );
        let e = serde_json::from_slice::<Json>(body.as_bytes()).unwrap_err();
        let denial = unreadable(body.as_bytes(), "app", &e.to_string()).expect("a denial");
        assert_eq!(denial["response"]["uid"], "u-9");
        assert_eq!(denial["response"]["allowed"], false);
        let message = denial["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(
            message.contains("rule app: the object cannot be judged: recursion limit exceeded"),
            "{message}"
        );
        assert!(unreadable(b"not json", "app", "x").is_none());
    }

    /// A rule without references: a check, a message reading the object, a default.
    fn rule_set() -> Arc<RuleSet> {
        let rule = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata: {name: app}
spec:
  parent: {apiVersion: example.com/v1, kind: App}
  admission:
    validate:
      - expr: "(parent.spec.replicas | default(1)) <= 3"
        message: "replicas {{ parent.spec.replicas }} is more than 3"
        fieldPath: spec.replicas
    default:
      - path: spec.size
        expr: "'small' if (parent.spec.replicas | default(1)) < 2 else 'large'"
      - path: spec.owner
        expr: "parent.metadata.annotations.owner"
"#;
        let sources = crate::rules::Sources {
            default_rollout: None,
            rule_files: vec![("rules/app.yaml".into(), rule.into())],
            templates: Default::default(),
        };
        let set = crate::render::compile(&sources, &crate::render::Limits::default())
            .unwrap_or_else(|d| panic!("{d}"));
        Arc::new(set)
    }

    async fn judge(phase: Phase, rule: &str, body: Json) -> Json {
        let reader = RefReader::new(None);
        review(
            rule_set(),
            reader,
            Offload::new(1),
            phase,
            rule.into(),
            body,
        )
        .await
    }

    /// A review in, the review out: the uid echoed, a denial with 403, the message and
    /// its field as a cause; defaults as a base64 JSON patch on /mutate only.
    #[tokio::test]
    async fn a_review_in_gives_its_answer_out() {
        let app = |replicas: i64| {
            json!({"apiVersion": "example.com/v1", "kind": "App",
            "metadata": {"name": "a", "namespace": "n"}, "spec": {"replicas": replicas}})
        };
        let denied = judge(Phase::Validate, "app", review_of("CREATE", app(5), None)).await;
        let r = &denied["response"];
        assert_eq!(denied["kind"], "AdmissionReview");
        assert_eq!(r["uid"], "u-1");
        assert_eq!(r["allowed"], false);
        assert_eq!(r["status"]["code"], 403);
        assert_eq!(r["status"]["message"], "replicas 5 is more than 3");
        assert_eq!(
            r["status"]["details"]["causes"][0]["field"],
            "spec.replicas"
        );
        // The mutating phase does not judge the checks; it patches.
        let mutated = judge(Phase::Mutate, "app", review_of("CREATE", app(1), None)).await;
        let r = &mutated["response"];
        assert_eq!(r["allowed"], true, "{mutated}");
        assert_eq!(r["patchType"], "JSONPatch");
        use base64::Engine as _;
        let patch = base64::engine::general_purpose::STANDARD
            .decode(r["patch"].as_str().unwrap_or_default())
            .unwrap();
        assert_eq!(
            serde_json::from_slice::<Json>(&patch).unwrap(),
            json!([{"op": "add", "path": "/spec/size", "value": "small"}])
        );
        assert_eq!(
            r["warnings"],
            json!(["rule app: spec.owner not defaulted: its expression is undefined"])
        );
        let allowed = judge(
            Phase::Validate,
            "app",
            review_of("UPDATE", app(2), Some(app(1))),
        )
        .await;
        assert_eq!(allowed["response"]["allowed"], true, "{allowed}");
        assert!(allowed["response"].get("patch").is_none());
        // An unknown rule is a denial that says so, never an allow.
        let unknown = judge(Phase::Validate, "other", review_of("CREATE", app(1), None)).await;
        assert_eq!(unknown["response"]["allowed"], false);
        let message = unknown["response"]["status"]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(message.contains("no rule other"), "{message}");
    }

    #[test]
    fn a_watch_selector_narrows_what_a_reference_finds() {
        let labels = |pairs: &[(&str, &str)]| {
            Some(
                pairs
                    .iter()
                    .map(|(k, v)| (k.to_string(), v.to_string()))
                    .collect(),
            )
        };
        let referable = "rulebook.dev/referable=true";
        assert!(selects(
            referable,
            &labels(&[("rulebook.dev/referable", "true")])
        ));
        assert!(!selects(
            referable,
            &labels(&[("rulebook.dev/referable", "no")])
        ));
        assert!(!selects(referable, &None));
        assert!(selects("tier!=gold,!secret,app", &labels(&[("app", "x")])));
        assert!(!selects("tier!=gold", &labels(&[("tier", "gold")])));
        assert!(!selects("app", &labels(&[("tier", "gold")])));
        assert!(!selects("not a selector!!", &labels(&[])));
    }

    #[test]
    fn objects_read_are_charged_and_refused_past_the_limit() {
        let r: Reference = serde_saphyr::from_str(
            "{name: plan, apiVersion: v1, kind: ConfigMap, objectName: \"'p'\"}",
        )
        .unwrap();
        let o: DynamicObject = serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "p", "managedFields": [{"manager": "kubectl"}]},
            "data": {"big": "x".repeat(1000)},
        }))
        .unwrap();
        let mut left = 10_000;
        let j = charged(o.clone(), &mut left, &r).unwrap();
        assert!(j.pointer("/metadata/managedFields").is_none(), "{j}");
        assert_eq!(10_000 - left, json_bytes(&j));
        assert!(left < 9_000);
        let mut left = 500;
        let e = charged(o, &mut left, &r).unwrap_err();
        assert!(
            e.starts_with("refs.plan: the objects read take more than"),
            "{e}"
        );
    }

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
        let mut r = review_of("CREATE", json!({"metadata": {"namespace": "other"}}), None);
        r["request"]["namespace"] = json!("team-a");
        let ok = parse(&r).unwrap();
        assert_eq!(
            ok.object["metadata"]["namespace"], "team-a",
            "the request's namespace"
        );
        let ok = parse(&review_of("UPDATE", json!({"a": 1}), Some(json!({"a": 0})))).unwrap();
        assert_eq!(ok.operation, Operation::Update);
        assert_eq!(ok.old, Some(json!({"a": 0})));
    }
}
