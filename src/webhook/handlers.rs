//! Which handler answers each route of the webhook server, in one small place: the
//! operator's wiring calls [`handlers`], and the admission and conversion work replace
//! the two functions below with theirs.
//!
//! Every handler evaluates on the blocking pool through [`Offload`], whose permits bound
//! how many evaluations run at once (beside the reconciles' own): a hostile object
//! spends its rule's budgets there, never this runtime's worker threads, and a burst of
//! reviews waits for a permit (within the server's deadline) instead of taking every
//! blocking thread.

use std::sync::Arc;

use serde_json::{Value as Json, json};
use tokio::sync::{Semaphore, watch};

use super::{Answer, Handler, Handlers};
use crate::render::RuleSet;
use crate::render::admission::{AdmitRequest, Operation, Verdict};

/// The rule set the handlers judge with: the one that serves, once one is loaded.
pub type Rules = watch::Receiver<Option<Arc<RuleSet>>>;

/// Runs evaluations on the blocking pool, at most `permits` at once.
#[derive(Clone)]
pub struct Offload {
    permits: Arc<Semaphore>,
}

impl Offload {
    pub fn new(permits: usize) -> Offload {
        Offload {
            permits: Arc::new(Semaphore::new(permits.max(1))),
        }
    }

    /// `work` on the blocking pool once a permit is free. A caller that gives up (the
    /// server's deadline) leaves the evaluation to finish under its rule's budgets,
    /// still holding its permit, so abandoned work is bounded too.
    pub async fn run(&self, work: impl FnOnce() -> Json + Send + 'static) -> Json {
        let Ok(permit) = self.permits.clone().acquire_owned().await else {
            return json!(null);
        };
        tokio::task::spawn_blocking(move || {
            let _permit = permit;
            work()
        })
        .await
        .unwrap_or(Json::Null)
    }
}

/// The handlers `rulebook run` serves.
pub fn handlers(rules: Rules, offload: Offload) -> Handlers {
    Handlers {
        validate: on_pool(rules.clone(), offload.clone(), admission_review),
        mutate: on_pool(rules.clone(), offload.clone(), admission_review),
        convert: on_pool(rules, offload, |set, rule, review| {
            super::convert::review(set, rule, review)
        }),
    }
}

/// A handler that answers with `judge(rule set, rule, review)` on the pool.
fn on_pool(
    rules: Rules,
    offload: Offload,
    judge: fn(&RuleSet, &str, &Json) -> Json,
) -> Handler {
    Arc::new(move |rule: String, review: Json| -> Answer {
        let set = rules.borrow().clone();
        let offload = offload.clone();
        Box::pin(async move {
            match set {
                Some(set) => offload.run(move || judge(&set, &rule, &review)).await,
                None => admission_answer(&review, false, "no rule set is loaded yet", None),
            }
        })
    })
}

/// An `AdmissionReview` answer for `review`.
pub fn admission_answer(review: &Json, allowed: bool, message: &str, patch: Option<&[Json]>) -> Json {
    let uid = review.pointer("/request/uid").cloned().unwrap_or(json!(""));
    let mut response = json!({"uid": uid, "allowed": allowed});
    if !allowed {
        response["status"] = json!({"code": 403, "reason": "Forbidden", "message": message});
    }
    if let Some(p) = patch.filter(|p| !p.is_empty()) {
        use base64::Engine as _;
        let bytes = serde_json::to_vec(p).unwrap_or_default();
        response["patchType"] = json!("JSONPatch");
        response["patch"] = json!(base64::engine::general_purpose::STANDARD.encode(bytes));
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": response})
}

/// Placeholder until the admission work lands: judges with `CompiledRule::admit` and no
/// references.
fn admission_review(set: &RuleSet, rule: &str, review: &Json) -> Json {
    let Some(compiled) = set.rules.get(rule) else {
        return admission_answer(review, false, &format!("no rule {rule} is loaded"), None);
    };
    let operation = match review.pointer("/request/operation").and_then(Json::as_str) {
        Some("UPDATE") => Operation::Update,
        _ => Operation::Create,
    };
    let object = review.pointer("/request/object").cloned().unwrap_or(Json::Null);
    let old = review.pointer("/request/oldObject").filter(|o| !o.is_null());
    let refs = serde_json::Map::new();
    let request = AdmitRequest {
        operation,
        object: &object,
        old,
        refs: &refs,
    };
    match compiled.admit(&request) {
        Ok(Verdict::Allowed { patch }) => admission_answer(review, true, "", Some(&patch)),
        Ok(Verdict::Denied { message, .. }) => admission_answer(review, false, &message, None),
        Err(e) => admission_answer(review, false, &format!("rule {rule}: {}", e.message), None),
    }
}
