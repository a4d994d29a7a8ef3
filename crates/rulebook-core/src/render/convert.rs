//! Converting a parent between the versions of its CRD (`spec.crd.conversion`, issue 43):
//! what the conversion webhook (src/webhook/convert.rs), `rulebook test` convert steps
//! and the round-trip check of `rulebook check` run.
//!
//! A conversion template is compiled with the rule's other templates, in the same
//! sandbox: every value prints as one JSON scalar or flow collection, so no field of the
//! object can change the YAML around it, and each conversion spends from a fresh
//! [`ParentBudget`] (fuel, output, time) like one parent's render. Its variables are
//! `object` (the object in the version converted from), `parent` (the same object, for
//! templates shared with children) and `rule`.
//!
//! What the API server requires of a converted object, enforced whatever the template
//! says: `apiVersion` is the version asked for, `kind` is kept, and `metadata` is the
//! input's except `labels` and `annotations` (which the template may change; absent, they
//! are kept). `status` is what the template renders: a template that leaves it out drops
//! it. A conversion the rule does not declare goes through the storage version (two
//! templates, one budget).
//!
//! Error messages name the rule, the object, the direction and the template line; they
//! quote no field value (minijinja's errors do not, and the checks here name keys only).

use std::collections::{BTreeMap, BTreeSet};

use minijinja::value::Value;
use serde_json::{Map, Value as Json};

use super::budget::ParentBudget;
use super::compile_exprs::Diags;
use super::{CompiledRule, INCLUDE, RenderError, describe, val};
use crate::meta::split_api_version;
use crate::rules::{Conversion, Diagnostic, Rule};

impl CompiledRule {
    /// `object` in version `to` (a version name like `v1`), through the rule's
    /// conversion templates: directly, or through the storage version.
    pub fn convert(&self, object: &Json, to: &str) -> Result<Json, RenderError> {
        self.convert_within(object, to, &mut self.budget())
    }

    /// [`convert`](Self::convert), spending from `budget`.
    pub fn convert_within(
        &self,
        object: &Json,
        to: &str,
        budget: &mut ParentBudget,
    ) -> Result<Json, RenderError> {
        let from = self.version_of(object)?;
        let group = self.rule.spec.parent.group_version().0;
        let target = format!("{group}/{to}");
        if !self.has_version(to) {
            return Err(self.error(
                object,
                format!("cannot convert to {target}: not a version of the CRD"),
            ));
        }
        let mut current = object.clone();
        if from == to {
            current["apiVersion"] = Json::String(target);
            return Ok(current);
        }
        let steps = self.conversion_steps(&from, to).ok_or_else(|| {
            self.error(
                object,
                format!("no conversion from {from} to {to} (spec.crd.conversion)"),
            )
        })?;
        let _active = budget.enter();
        for (i, c) in steps {
            current = self.convert_step(&current, i, c)?;
        }
        Ok(current)
    }

    /// Converts `object` to `via` and back: `None` when the input comes back unchanged,
    /// else what differs (`spec.size: lost`, `spec.mode: changed`), at most a few places.
    pub fn round_trip(&self, object: &Json, via: &str) -> Result<Option<String>, RenderError> {
        let from = self.version_of(object)?;
        let mut budget = self.budget();
        let there = self.convert_within(object, via, &mut budget)?;
        let back = self.convert_within(&there, &from, &mut budget)?;
        let mut diffs = Vec::new();
        differences(object, &back, "", &mut diffs);
        if diffs.is_empty() {
            return Ok(None);
        }
        let more = diffs.len().saturating_sub(MAX_DIFFS);
        diffs.truncate(MAX_DIFFS);
        let mut text = diffs.join(", ");
        if more > 0 {
            text.push_str(&format!(" and {more} more"));
        }
        Ok(Some(text))
    }

    /// The versions of the rule's CRD (none without `spec.crd.versions`), storage first.
    pub fn crd_versions(&self) -> Vec<(String, bool)> {
        let Some(crd) = &self.rule.spec.crd else {
            return Vec::new();
        };
        let mut v: Vec<(String, bool)> = crd
            .versions
            .iter()
            .map(|v| (v.name.value.clone(), v.served))
            .collect();
        v.sort_by_key(|(name, _)| Some(name.as_str()) != self.storage_version());
        v
    }

    /// The storage version, when the rule lists versions.
    pub fn storage_version(&self) -> Option<&str> {
        let crd = self.rule.spec.crd.as_ref()?;
        crd.versions
            .iter()
            .find(|v| v.storage)
            .map(|v| v.name.as_str())
    }

    fn has_version(&self, name: &str) -> bool {
        match self.rule.spec.crd.as_ref() {
            Some(crd) if !crd.versions.is_empty() => {
                crd.versions.iter().any(|v| v.name.value == name)
            }
            _ => self.rule.spec.parent.group_version().1 == name,
        }
    }

    /// The version of `object`, which must be of the rule's group and kind.
    fn version_of(&self, object: &Json) -> Result<String, RenderError> {
        let parent = &self.rule.spec.parent;
        let api_version = object
            .get("apiVersion")
            .and_then(Json::as_str)
            .unwrap_or("");
        let kind = object.get("kind").and_then(Json::as_str).unwrap_or("");
        let (group, version) = split_api_version(api_version);
        if group != parent.group_version().0 || kind != parent.kind.value {
            return Err(self.error(
                object,
                format!(
                    "is a {api_version} {kind}, not a {} of the rule's group {}",
                    parent.kind.value,
                    parent.group_version().0
                ),
            ));
        }
        Ok(version.to_string())
    }

    /// The conversions from `from` to `to`: the direct one, else to and from the
    /// storage version.
    fn conversion_steps(&self, from: &str, to: &str) -> Option<Vec<(usize, &Conversion)>> {
        let list = &self.rule.spec.crd.as_ref()?.conversion;
        let find = |a: &str, b: &str| {
            list.iter()
                .enumerate()
                .find(|(_, c)| c.from.value == a && c.to.value == b)
        };
        if let Some(direct) = find(from, to) {
            return Some(vec![direct]);
        }
        let storage = self.storage_version()?;
        Some(vec![find(from, storage)?, find(storage, to)?])
    }

    /// One template: `object` in `c.from` to `c.to`, within the active budget.
    fn convert_step(&self, object: &Json, i: usize, c: &Conversion) -> Result<Json, RenderError> {
        let path = self
            .template_files
            .get(c.template.as_str())
            .cloned()
            .unwrap_or_else(|| c.template.value.clone());
        let prefix = format!(
            "rule '{}': {} {}: spec.crd.conversion[{i}] ({} → {}): ",
            self.name,
            object.get("kind").and_then(Json::as_str).unwrap_or(""),
            object_name(object),
            c.from.value,
            c.to.value
        );
        let with_prefix = |mut e: RenderError| {
            e.message = format!("{prefix}{}", e.message);
            e
        };
        let env = self.running().borrow_owner();
        let tmpl = env.get_template(&c.template).map_err(|e| {
            RenderError::new(path.clone(), None, format!("{prefix}{}", describe(&e)))
        })?;
        let value = val(object);
        let mut ctx: BTreeMap<&'static str, Value> = BTreeMap::new();
        ctx.insert("object", value.clone());
        ctx.insert("parent", value);
        ctx.insert("rule", self.rule_value.clone());
        let text = self.render_one(&tmpl, &path, &ctx).map_err(with_prefix)?;
        let rendered = super::children::parse_rendered(&text).map_err(|(line, message)| {
            RenderError::new(path.clone(), line, format!("{prefix}{message}"))
        })?;
        let group = self.rule.spec.parent.group_version().0;
        let target = if group.is_empty() {
            c.to.value.clone()
        } else {
            format!("{group}/{}", c.to.value)
        };
        finish(object, rendered, &target)
            .map_err(|message| RenderError::new(path, None, format!("{prefix}{message}")))
    }

    fn error(&self, object: &Json, message: String) -> RenderError {
        RenderError::new(
            self.file.clone(),
            None,
            format!(
                "rule '{}': {} {}: {message}",
                self.name,
                object
                    .get("kind")
                    .and_then(Json::as_str)
                    .unwrap_or("object"),
                object_name(object)
            ),
        )
    }
}

/// `namespace/name`, or `name`.
fn object_name(o: &Json) -> String {
    let s = |k: &str| o.pointer(&format!("/metadata/{k}")).and_then(Json::as_str);
    match (s("namespace"), s("name")) {
        (Some(ns), Some(n)) => format!("{ns}/{n}"),
        (None, Some(n)) => n.to_string(),
        _ => "(unnamed)".to_string(),
    }
}

/// The rendered object made what the API server accepts: `apiVersion` the target,
/// `kind` and `metadata` the input's (labels and annotations as rendered).
fn finish(input: &Json, rendered: Json, target: &str) -> Result<Json, String> {
    let Json::Object(mut out) = rendered else {
        return Err("the template must render one YAML mapping (the object)".into());
    };
    let kind = input.get("kind").cloned().unwrap_or(Json::Null);
    if let Some(k) = out.get("kind")
        && *k != kind
    {
        return Err(
            "the rendered kind differs from the object's: a conversion keeps the kind".into(),
        );
    }
    if let Some(v) = out.get("apiVersion").and_then(Json::as_str)
        && v != target
    {
        return Err(format!(
            "the template renders apiVersion {v}, but converts to {target}"
        ));
    }
    out.insert("apiVersion".into(), Json::String(target.into()));
    out.insert("kind".into(), kind);
    let mut meta = input
        .get("metadata")
        .and_then(Json::as_object)
        .cloned()
        .unwrap_or_default();
    match out.remove("metadata") {
        None => {}
        Some(Json::Object(rendered)) => keep_metadata(&mut meta, rendered)?,
        Some(_) => return Err("metadata must be a mapping".into()),
    }
    out.insert("metadata".into(), Json::Object(meta));
    Ok(Json::Object(out))
}

/// `rendered` metadata over the input's `meta`: only labels and annotations may differ.
fn keep_metadata(meta: &mut Map<String, Json>, rendered: Map<String, Json>) -> Result<(), String> {
    for (k, v) in rendered {
        match k.as_str() {
            "labels" | "annotations" => {
                if !v.is_object() && !v.is_null() {
                    return Err(format!("metadata.{k} must be a mapping"));
                }
                if v.as_object()
                    .is_some_and(|m| m.values().any(|x| !x.is_string()))
                {
                    return Err(format!("metadata.{k} values must be strings"));
                }
                if v.is_null() {
                    meta.remove(&k);
                } else {
                    meta.insert(k, v);
                }
            }
            _ if meta.get(&k) == Some(&v) => {}
            _ => {
                return Err(format!(
                    "metadata.{k} may not change in a conversion (the API server allows labels and annotations only)"
                ));
            }
        }
    }
    Ok(())
}

/// At most this many differences are named by a round trip.
const MAX_DIFFS: usize = 5;

/// The places where `back` differs from `orig`: `path: lost`, `added`, `changed`.
fn differences(orig: &Json, back: &Json, path: &str, out: &mut Vec<String>) {
    let here = |k: &str| {
        if path.is_empty() {
            k.to_string()
        } else {
            format!("{path}.{k}")
        }
    };
    match (orig, back) {
        (Json::Object(a), Json::Object(b)) => {
            let keys: BTreeSet<&String> = a.keys().chain(b.keys()).collect();
            for k in keys {
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => differences(x, y, &here(k), out),
                    (Some(_), None) => out.push(format!("{}: lost", here(k))),
                    (None, Some(_)) => out.push(format!("{}: added", here(k))),
                    (None, None) => {}
                }
            }
        }
        (Json::Array(a), Json::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(x, y, &format!("{path}[{i}]"), out);
            }
        }
        (a, b) if a == b => {}
        _ => out.push(format!(
            "{}: changed",
            if path.is_empty() { "(object)" } else { path }
        )),
    }
}

/// The conversion templates of `rule` (template names), each reported when the
/// templates directory does not have it.
pub(super) fn conversion_templates(
    rule: &Rule,
    templates: &BTreeMap<String, (String, String)>,
    at: &Diags<'_>,
    diags: &mut Vec<Diagnostic>,
) -> Vec<String> {
    let Some(crd) = &rule.spec.crd else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, c) in crd.conversion.iter().enumerate() {
        if templates.contains_key(c.template.as_str()) {
            out.push(c.template.value.clone());
        } else {
            diags.push(at.at(
                c.template.line,
                c.template.col,
                &format!("spec.crd.conversion[{i}].template"),
                format!(
                    "template '{}' not found in the templates directory",
                    c.template.value
                ),
            ));
        }
    }
    out
}

/// Of the templates a rule uses, `(children's, conversions')`: a template reached only
/// from conversion templates is a conversion's; every other (one that only a computed
/// include reaches, too) a child's.
pub(super) fn template_roles(
    rule: &Rule,
    used: &BTreeMap<String, String>,
    templates: &BTreeMap<String, (String, String)>,
) -> (BTreeSet<String>, BTreeSet<String>) {
    let conversion_roots = rule
        .spec
        .crd
        .iter()
        .flat_map(|c| c.conversion.iter().map(|c| c.template.value.clone()));
    let for_conversion = reach(conversion_roots, templates);
    let child_roots = rule.spec.children.iter().map(|c| c.template.value.clone());
    let reached_by_children = reach(child_roots, templates);
    let for_children = used
        .keys()
        .filter(|t| reached_by_children.contains(*t) || !for_conversion.contains(*t))
        .cloned()
        .collect();
    (for_children, for_conversion)
}

/// `roots` and every template they include by name.
pub(super) fn reach(
    roots: impl IntoIterator<Item = String>,
    templates: &BTreeMap<String, (String, String)>,
) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut queue: Vec<String> = roots.into_iter().collect();
    while let Some(t) = queue.pop() {
        if !seen.insert(t.clone()) {
            continue;
        }
        if let Some((_, source)) = templates.get(&t) {
            for m in INCLUDE.captures_iter(source) {
                if let Some(inc) = m.get(1).or(m.get(2)) {
                    queue.push(inc.as_str().to_string());
                }
            }
        }
    }
    seen
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::render::{Limits, compile};
    use crate::rules::Sources;
    use serde_json::json;

    const EX: &str = "../../examples/versioned";

    /// The versioned example rule (examples/versioned), with `edit` applied to a template.
    fn webapp(edit: impl Fn(&str, String) -> String) -> std::sync::Arc<CompiledRule> {
        let file = |p: &str| {
            std::fs::read_to_string(format!("{}/{EX}/{p}", env!("CARGO_MANIFEST_DIR")))
                .unwrap_or_else(|e| panic!("{p}: {e}"))
        };
        let templates = [
            "deployment.yaml",
            "v1alpha1-to-v1.yaml",
            "v1-to-v1alpha1.yaml",
        ]
        .into_iter()
        .map(|t| {
            let name = format!("webapp/{t}");
            let text = edit(&name, file(&format!("templates/{name}")));
            (name.clone(), (format!("templates/{name}"), text))
        })
        .collect();
        let sources = Sources {
            default_rollout: None,
            rule_files: vec![("rules/webapp.yaml".into(), file("rules/webapp.yaml"))],
            templates,
        };
        let set = compile(&sources, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
        set.rules["webapp"].clone()
    }

    fn alpha() -> Json {
        json!({"apiVersion": "web.example.com/v1alpha1", "kind": "WebApp",
            "metadata": {"name": "blog", "namespace": "default", "uid": "u-1",
                "resourceVersion": "7", "labels": {"team": "a"}},
            "spec": {"replicas": 2, "image": "blog:1.4", "port": 8080},
            "status": {"image": "blog:1.4"}})
    }

    #[test]
    fn converts_both_ways_keeping_metadata_and_status() {
        let rule = webapp(|_, t| t);
        let v1 = rule.convert(&alpha(), "v1").unwrap();
        assert_eq!(
            v1,
            json!({"apiVersion": "web.example.com/v1", "kind": "WebApp",
                "metadata": alpha()["metadata"],
                "spec": {"replicas": 2, "container": {"image": "blog:1.4", "port": 8080}},
                "status": {"image": "blog:1.4"}})
        );
        assert_eq!(rule.convert(&v1, "v1alpha1").unwrap(), alpha());
        assert_eq!(rule.round_trip(&alpha(), "v1").unwrap(), None);
        // The same version: only apiVersion is (re)set.
        assert_eq!(rule.convert(&alpha(), "v1alpha1").unwrap(), alpha());
        let unknown = rule.convert(&alpha(), "v2").unwrap_err();
        assert!(
            unknown.message.contains("not a version of the CRD"),
            "{unknown}"
        );
        let other = rule
            .convert(&json!({"apiVersion": "x.io/v1", "kind": "WebApp"}), "v1")
            .unwrap_err();
        assert!(
            other.message.contains("not a WebApp of the rule's group"),
            "{other}"
        );
    }

    #[test]
    fn a_lossy_conversion_names_the_field_lost() {
        let rule = webapp(|name, t| {
            if name.ends_with("v1alpha1-to-v1.yaml") {
                t.replace("    port: {{ object.spec.port }}", "    portx: 1")
            } else {
                t
            }
        });
        let lost = rule.round_trip(&alpha(), "v1").unwrap();
        assert_eq!(lost.as_deref(), Some("spec.port: lost"));
    }

    #[test]
    fn a_hostile_value_cannot_change_the_converted_structure() {
        let rule = webapp(|_, t| t);
        let mut o = alpha();
        o["spec"]["image"] = json!("x\nstatus: {hacked: true}\nkind: Secret");
        let v1 = rule.convert(&o, "v1").unwrap();
        assert_eq!(v1["spec"]["container"]["image"], o["spec"]["image"]);
        assert_eq!(v1["status"], o["status"]);
        assert_eq!(v1["kind"], "WebApp");
    }

    #[test]
    fn a_conversion_is_bounded_by_the_render_budget() {
        let rule = webapp(|name, t| {
            if name.ends_with("v1alpha1-to-v1.yaml") {
                format!(
                    "{{% for i in range(100000) %}}{{% for j in range(100000) %}}{{% endfor %}}{{% endfor %}}\n{t}"
                )
            } else {
                t
            }
        });
        let e = rule.convert(&alpha(), "v1").unwrap_err();
        assert!(e.is_budget_exceeded(), "{e}");
        assert!(
            e.to_string()
                .contains("templates/webapp/v1alpha1-to-v1.yaml")
                && e.message.contains(
                    "rule 'webapp': WebApp default/blog: spec.crd.conversion[0] (v1alpha1 → v1)"
                ),
            "{e}"
        );
    }

    #[test]
    fn a_template_error_names_the_template_line() {
        let rule = webapp(|name, t| {
            if name.ends_with("v1-to-v1alpha1.yaml") {
                t.replace(
                    "{{ object.spec.container.image }}",
                    "{{ object.spec.nothing.here }}",
                )
            } else {
                t
            }
        });
        let v1 = webapp(|_, t| t).convert(&alpha(), "v1").unwrap();
        let e = rule.convert(&v1, "v1alpha1").unwrap_err();
        assert_eq!(e.line, Some(6), "{e}");
        assert!(e.message.contains("undefined"), "{e}");
    }

    #[test]
    fn metadata_is_kept_but_labels_and_annotations() {
        let input = json!({"apiVersion": "x.io/v1alpha1", "kind": "W",
            "metadata": {"name": "a", "namespace": "n", "uid": "u", "labels": {"k": "v"}}});
        let out = finish(
            &input,
            json!({"metadata": {"name": "a", "labels": {"k": "w"}}, "spec": {"s": 1}}),
            "x.io/v1",
        )
        .unwrap();
        assert_eq!(out["apiVersion"], "x.io/v1");
        assert_eq!(out["kind"], "W");
        assert_eq!(out["metadata"]["uid"], "u");
        assert_eq!(out["metadata"]["labels"]["k"], "w");
        let renamed = finish(&input, json!({"metadata": {"name": "b"}}), "x.io/v1");
        assert!(
            renamed
                .unwrap_err()
                .contains("metadata.name may not change")
        );
        let kind = finish(&input, json!({"kind": "Other"}), "x.io/v1");
        assert!(kind.unwrap_err().contains("keeps the kind"));
        let api = finish(&input, json!({"apiVersion": "x.io/v2"}), "x.io/v1");
        assert!(api.unwrap_err().contains("converts to x.io/v1"));
    }

    #[test]
    fn differences_name_lost_added_and_changed_fields() {
        let mut d = Vec::new();
        differences(
            &json!({"spec": {"a": 1, "b": [1, 2], "c": "x"}}),
            &json!({"spec": {"a": 2, "b": [1, 3], "d": true}}),
            "",
            &mut d,
        );
        assert_eq!(
            d,
            vec![
                "spec.a: changed",
                "spec.b[1]: changed",
                "spec.c: lost",
                "spec.d: added"
            ]
        );
    }
}
