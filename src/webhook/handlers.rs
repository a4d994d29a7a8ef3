//! Which handler answers each route of the webhook server, in one small place: the
//! operator's wiring (`run.rs`) calls [`handlers`]: admission by the rule's `expr:`
//! checks and defaults (admission.rs), conversion by its templates (convert.rs). Every
//! handler evaluates on the blocking pool through [`Offload`] (offload.rs), in the lane of
//! the review's class (fair.rs) that the server hands it.

use std::sync::Arc;

use serde_json::{Value as Json, json};
use tokio::sync::watch;

use super::admission::RefReader;
pub use super::offload::Offload;
use super::{Answer, Handler, Handlers};
use crate::render::RuleSet;
use crate::render::admission::Phase;

/// The rule set the handlers judge with: the one that serves, once one is loaded.
pub type Rules = watch::Receiver<Option<Arc<RuleSet>>>;

/// The handlers `rulebook run` serves: admission by the rule's `expr:` checks
/// (`/validate`) and defaults (`/mutate`) with its references read by `reader`
/// (webhook/admission.rs), conversion by its templates (webhook/convert.rs).
pub fn handlers(rules: Rules, offload: Offload, reader: RefReader) -> Handlers {
    Handlers {
        validate: admission(
            rules.clone(),
            offload.clone(),
            reader.clone(),
            Phase::Validate,
        ),
        mutate: admission(rules.clone(), offload.clone(), reader, Phase::Mutate),
        convert: on_pool(rules, offload, |set, rule, review| {
            super::convert::review(set, rule, review)
        }),
    }
}

/// An admission handler for `phase`.
fn admission(rules: Rules, offload: Offload, reader: RefReader, phase: Phase) -> Handler {
    Arc::new(move |rule: String, review: Json, lane| -> Answer {
        let set = rules.borrow().clone();
        let (offload, reader) = (offload.in_lane(lane), reader.clone());
        Box::pin(async move {
            match set {
                Some(set) => {
                    super::admission::review(set, reader, offload, phase, rule, review).await
                }
                None => admission_answer(&review, false, "no rule set is loaded yet", None),
            }
        })
    })
}

/// A handler that answers with `judge(rule set, rule, review)` on the pool.
fn on_pool(rules: Rules, offload: Offload, judge: fn(&RuleSet, &str, &Json) -> Json) -> Handler {
    Arc::new(move |rule: String, review: Json, lane| -> Answer {
        let set = rules.borrow().clone();
        let offload = offload.in_lane(lane);
        Box::pin(async move {
            match set {
                Some(set) => offload
                    .run(move || judge(&set, &rule, &review))
                    .await
                    .unwrap_or(Json::Null),
                None => admission_answer(&review, false, "no rule set is loaded yet", None),
            }
        })
    })
}

/// An `AdmissionReview` answer for `review`.
pub fn admission_answer(
    review: &Json,
    allowed: bool,
    message: &str,
    patch: Option<&[Json]>,
) -> Json {
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
