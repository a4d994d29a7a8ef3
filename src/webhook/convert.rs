//! The conversion webhook's answer to a `ConversionReview` (apiextensions.k8s.io/v1):
//! each object converted to `request.desiredAPIVersion` by the rule's conversion
//! templates (`spec.crd.conversion`). The HTTPS server (webhook/server) routes
//! `POST /convert/<rule>` here, on the blocking pool.
//!
//! Placeholder until the conversion work lands: every review fails with a clear message,
//! which the API server passes on to the client; nothing is stored unconverted.

use crate::render::RuleSet;
use serde_json::{Value as Json, json};

/// The `ConversionReview` answering `review` for rule `rule`.
pub fn review(_set: &RuleSet, rule: &str, review: &Json) -> Json {
    let uid = review
        .pointer("/request/uid")
        .cloned()
        .unwrap_or(Json::String(String::new()));
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "response": {
            "uid": uid,
            "result": {
                "status": "Failure",
                "message": format!("rule {rule}: conversion is not available in this build"),
            },
        },
    })
}
