//! The conversion webhook's answer to a `ConversionReview` (apiextensions.k8s.io/v1):
//! each object converted to `request.desiredAPIVersion` by the rule's conversion
//! templates (`spec.crd.conversion`, through [`CompiledRule::convert`]). The HTTPS server
//! (webhook/server) routes `POST /convert/<rule>` here, on the blocking pool.
//!
//! The answer lists `convertedObjects` in the order of `request.objects`, with `uid`
//! echoed. Any failure fails the whole review (`result: {status: Failure, message}`), as
//! the API server requires: it then answers its client with that message, and stores
//! nothing unconverted. The message names the rule, the object, the direction and the
//! template line; the converted objects are parents of the rule (never Secrets), and the
//! render errors quote no field value (render/convert.rs).
//!
//! Each object gets its own render budget (fuel, output, time), so a review of many
//! objects costs at most that many budgets, and the server's request-size limit bounds
//! how many.

use serde_json::{Value as Json, json};

use crate::render::{CompiledRule, RuleSet};

/// The `ConversionReview` answering `review` for rule `rule`.
pub fn review(set: &RuleSet, rule: &str, review: &Json) -> Json {
    let uid = review
        .pointer("/request/uid")
        .cloned()
        .unwrap_or(Json::String(String::new()));
    let response = match set.rules.get(rule) {
        None => Err(format!(
            "rule {rule}: no such rule in the rule set this replica serves"
        )),
        Some(compiled) => convert_all(compiled, review),
    };
    let response = match response {
        Ok(objects) => json!({
            "uid": uid,
            "convertedObjects": objects,
            "result": {"status": "Success"},
        }),
        Err(message) => json!({
            "uid": uid,
            "result": {"status": "Failure", "message": message},
        }),
    };
    json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "ConversionReview",
        "response": response,
    })
}

/// Every object of the review's request, converted; the first failure's message.
fn convert_all(rule: &CompiledRule, review: &Json) -> Result<Vec<Json>, String> {
    let name = &rule.name;
    let request = review
        .get("request")
        .ok_or_else(|| format!("rule {name}: the ConversionReview has no request"))?;
    let desired = request
        .get("desiredAPIVersion")
        .and_then(Json::as_str)
        .ok_or_else(|| format!("rule {name}: the ConversionReview names no desiredAPIVersion"))?;
    let (group, version) = crate::meta::split_api_version(desired);
    let own_group = rule.rule.spec.parent.group_version().0;
    if group != own_group {
        return Err(format!(
            "rule {name}: cannot convert to {desired}: the rule's kind is in group {own_group}"
        ));
    }
    let objects = request
        .get("objects")
        .and_then(Json::as_array)
        .ok_or_else(|| format!("rule {name}: the ConversionReview has no objects"))?;
    objects
        .iter()
        .map(|o| rule.convert(o, version).map_err(|e| e.to_string()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::Limits;
    use crate::rules::Sources;

    fn set() -> RuleSet {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/examples/versioned");
        crate::render::load(
            &std::path::Path::new(root).join("rules"),
            &std::path::Path::new(root).join("templates"),
            &Limits::default(),
        )
        .unwrap_or_else(|d| panic!("{d}"))
    }

    fn alpha(name: &str) -> Json {
        json!({"apiVersion": "web.example.com/v1alpha1", "kind": "WebApp",
            "metadata": {"name": name, "namespace": "default", "uid": format!("uid-{name}")},
            "spec": {"image": format!("{name}:1"), "port": 80}})
    }

    fn request(objects: Vec<Json>, to: &str) -> Json {
        json!({"apiVersion": "apiextensions.k8s.io/v1", "kind": "ConversionReview",
            "request": {"uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
                "desiredAPIVersion": to, "objects": objects}})
    }

    #[test]
    fn converts_every_object_in_order_and_echoes_the_uid() {
        let answer = review(
            &set(),
            "webapp",
            &request(vec![alpha("a"), alpha("b")], "web.example.com/v1"),
        );
        assert_eq!(answer["kind"], "ConversionReview");
        let r = &answer["response"];
        assert_eq!(r["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(r["result"]["status"], "Success");
        let out = r["convertedObjects"].as_array().unwrap();
        let names: Vec<&str> = out
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["a", "b"]);
        assert!(out.iter().all(|o| o["apiVersion"] == "web.example.com/v1"));
        assert_eq!(out[1]["spec"]["container"], json!({"image": "b:1", "port": 80}));
        assert_eq!(out[1]["metadata"]["uid"], "uid-b");
    }

    #[test]
    fn a_failure_fails_the_review_naming_rule_object_and_template_line() {
        let mut broken = alpha("broken");
        broken["spec"].as_object_mut().unwrap().remove("image");
        let answer = review(
            &set(),
            "webapp",
            &request(vec![alpha("a"), broken], "web.example.com/v1"),
        );
        let r = &answer["response"];
        assert_eq!(r["uid"], "705ab4f5-6393-11e8-b7cc-42010a800002");
        assert_eq!(r["result"]["status"], "Failure");
        assert!(r.get("convertedObjects").is_none());
        let m = r["result"]["message"].as_str().unwrap();
        assert!(
            m.contains("v1alpha1-to-v1.yaml:")
                && m.contains("rule 'webapp': WebApp default/broken: spec.crd.conversion[0] (v1alpha1 → v1)"),
            "{m}"
        );
    }

    #[test]
    fn a_review_for_an_unknown_rule_or_group_fails_clearly() {
        let answer = review(
            &set(),
            "nothing",
            &request(vec![alpha("a")], "web.example.com/v1"),
        );
        assert_eq!(answer["response"]["result"]["status"], "Failure");
        assert!(
            answer["response"]["result"]["message"]
                .as_str()
                .unwrap()
                .contains("rule nothing: no such rule")
        );
        let answer = review(&set(), "webapp", &request(vec![alpha("a")], "other.io/v1"));
        let m = answer["response"]["result"]["message"].as_str().unwrap();
        assert!(m.contains("group web.example.com"), "{m}");
        let answer = review(&set(), "webapp", &json!({"kind": "ConversionReview"}));
        assert_eq!(answer["response"]["uid"], "");
        assert_eq!(answer["response"]["result"]["status"], "Failure");
    }

    #[test]
    fn an_empty_sources_set_has_no_rule() {
        let set = crate::render::compile(&Sources::default(), &Limits::default()).unwrap();
        let answer = review(&set, "webapp", &request(vec![], "web.example.com/v1"));
        assert_eq!(answer["response"]["result"]["status"], "Failure");
    }
}
