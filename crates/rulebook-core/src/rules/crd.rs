//! CustomResourceDefinitions from rules' `spec.crd` sections. Pure: builds and checks the
//! objects; `rulebook crds` prints them and `rulebook run --install-crds` applies them
//! (the I/O is in `src/crds.rs`).

use serde_json::{Value as Json, json};

/// The label on every CRD Rulebook generates. With the field manager `rulebook`, it is
/// how `--install-crds` tells a CRD it may change from one somebody else owns.
pub const MANAGED_BY_LABEL: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY_VALUE: &str = "rulebook";

use super::{CrdSpec, Rule};
use crate::meta::split_api_version;

/// The CRD's plural: given, or the kind in lower case plus `s`.
pub fn plural(crd: &CrdSpec, kind: &str) -> String {
    match &crd.plural {
        Some(p) => p.value.clone(),
        None => crate::meta::guess_plural(kind),
    }
}

/// The name of the CRD a rule defines (`PLURAL.GROUP`), if it has a `spec.crd` section.
pub fn crd_name(rule: &Rule) -> Option<String> {
    let crd = rule.spec.crd.as_ref()?;
    let parent = &rule.spec.parent;
    let (group, _) = split_api_version(&parent.api_version);
    Some(format!("{}.{group}", plural(crd, &parent.kind)))
}

/// The CRD of a rule that has a `spec.crd` section. A rule with conversions
/// (`spec.crd.conversion`) gets the conversion stanza with a placeholder `clientConfig`
/// ([`placeholder_client_config`]); [`crd_with_webhook`] takes the real one.
pub fn crd_for(rule: &Rule) -> Option<Json> {
    crd_with_webhook(rule, None)
}

/// The path of a rule's conversion webhook on Rulebook's webhook server.
pub fn conversion_path(rule: &str) -> String {
    format!("/convert/{rule}")
}

/// Whether the rule's CRD converts through Rulebook's webhook (it declares conversions).
pub fn needs_conversion_webhook(rule: &Rule) -> bool {
    rule.spec
        .crd
        .as_ref()
        .is_some_and(|c| !c.versions.is_empty() && !c.conversion.is_empty())
}

/// The `clientConfig` written when none is given: the Service of `deploy/`, without a
/// CA bundle (`rulebook crds` says so on standard error).
pub fn placeholder_client_config(rule: &str) -> Json {
    json!({"service": {
        "namespace": "rulebook-system",
        "name": "rulebook-webhook",
        "port": 443,
        "path": conversion_path(rule),
    }})
}

/// [`crd_for`], with `client_config` (the conversion webhook's `clientConfig`, for the
/// path [`conversion_path`]) in the conversion stanza of a rule that converts. Pure: the
/// operator builds the `clientConfig` from how the API server reaches it.
pub fn crd_with_webhook(rule: &Rule, client_config: Option<&Json>) -> Option<Json> {
    let crd = rule.spec.crd.as_ref()?;
    let parent = &rule.spec.parent;
    let (group, version) = split_api_version(&parent.api_version);
    let kind = parent.kind.as_str();
    let plural = plural(crd, kind);
    let singular = crd.singular.clone().unwrap_or_else(|| kind.to_lowercase());
    let mut names = json!({
        "kind": kind,
        "listKind": format!("{kind}List"),
        "plural": plural,
        "singular": singular,
    });
    if !crd.short_names.is_empty() {
        names["shortNames"] = json!(crd.short_names);
    }
    if !crd.categories.is_empty() {
        names["categories"] = json!(crd.categories);
    }
    let scope = crd
        .scope
        .as_ref()
        .map(|s| s.value.clone())
        .unwrap_or_else(|| "Namespaced".into());
    let mut out = json!({
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": format!("{plural}.{group}"),
            "labels": {
                (MANAGED_BY_LABEL): MANAGED_BY_VALUE,
                "rulebook.dev/rule": rule.metadata.name.value,
            },
        },
        "spec": {
            "group": group,
            "names": names,
            "scope": scope,
            "versions": versions(crd, version),
        },
    });
    if needs_conversion_webhook(rule) {
        let name = rule.metadata.name.as_str();
        let client = client_config
            .cloned()
            .unwrap_or_else(|| placeholder_client_config(name));
        out["spec"]["conversion"] = json!({
            "strategy": "Webhook",
            "webhook": {
                "clientConfig": client,
                "conversionReviewVersions": ["v1"],
            },
        });
    }
    super::policy::add_crd_validations(rule, &mut out);
    Some(out)
}

/// `spec.versions` of the CRD: the parent's version alone, or each of
/// `spec.crd.versions` with its own schema and columns (the top-level ones by default).
fn versions(crd: &CrdSpec, parent_version: &str) -> Json {
    let spec_default = crd.spec_schema.as_ref().map(|s| &s.value);
    let status_default = crd.status_schema.as_ref().map(|s| &s.value);
    if crd.versions.is_empty() {
        let entry = version_entry(
            parent_version,
            &crd.printer_columns,
            spec_default,
            status_default,
        );
        return json!([entry]);
    }
    let entries: Vec<Json> = crd
        .versions
        .iter()
        .map(|v| {
            let columns = if v.printer_columns.is_empty() {
                &crd.printer_columns
            } else {
                &v.printer_columns
            };
            let spec = v.spec_schema.as_ref().map(|s| &s.value).or(spec_default);
            let status = v
                .status_schema
                .as_ref()
                .map(|s| &s.value)
                .or(status_default);
            let mut entry = version_entry(&v.name, columns, spec, status);
            entry["served"] = json!(v.served);
            entry["storage"] = json!(v.storage);
            if v.deprecated {
                entry["deprecated"] = json!(true);
                if let Some(w) = &v.deprecation_warning {
                    entry["deprecationWarning"] = json!(w);
                }
            }
            entry
        })
        .collect();
    Json::Array(entries)
}

/// One entry of `spec.versions`: served, stored, with the status subresource.
fn version_entry(
    name: &str,
    columns: &[super::PrinterColumn],
    spec_schema: Option<&Json>,
    status_schema: Option<&Json>,
) -> Json {
    let spec_schema = spec_schema
        .cloned()
        .unwrap_or_else(|| json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}));
    json!({
        "name": name,
        "served": true,
        "storage": true,
        "subresources": {"status": {}},
        "additionalPrinterColumns": printer_columns(columns),
        "schema": {"openAPIV3Schema": {
            "type": "object",
            "properties": {
                "apiVersion": {"type": "string"},
                "kind": {"type": "string"},
                "metadata": {"type": "object"},
                "spec": spec_schema,
                "status": status_schema_of(status_schema),
            },
        }},
    })
}

/// The printer columns a rule names, then Ready and Age.
fn printer_columns(columns: &[super::PrinterColumn]) -> Vec<Json> {
    let mut columns: Vec<Json> = columns
        .iter()
        .map(|c| {
            let mut col = json!({"name": c.name, "type": c.type_, "jsonPath": c.json_path});
            if let Some(d) = &c.description {
                col["description"] = json!(d);
            }
            if let Some(p) = c.priority {
                col["priority"] = json!(p);
            }
            col
        })
        .collect();
    columns.push(json!({
        "name": "Ready",
        "type": "string",
        "jsonPath": ".status.conditions[?(@.type==\"Ready\")].status",
    }));
    columns.push(json!({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}));
    columns
}

/// The status schema: the rule's fields, and those Rulebook writes itself (conditions,
/// observedGeneration, the rule version).
fn status_schema_of(schema: Option<&Json>) -> Json {
    let mut status_props = schema
        .and_then(|s| s.get("properties").cloned())
        .and_then(|p| p.as_object().cloned())
        .unwrap_or_default();
    status_props.insert(
        "observedGeneration".into(),
        json!({"type": "integer", "format": "int64"}),
    );
    status_props.insert("conditions".into(), conditions_schema());
    status_props.insert(
        crate::meta::STATUS_RULE_VERSION.into(),
        json!({"type": "string", "description": "The version of the Rulebook rule (a hash of the rule and its templates) that last reconciled this object"}),
    );
    let mut status_schema = json!({"type": "object", "properties": status_props});
    if schema.is_none() {
        status_schema["x-kubernetes-preserve-unknown-fields"] = json!(true);
    }
    status_schema
}

/// `status.conditions` per the API conventions (metav1.Condition), a list map keyed by type.
fn conditions_schema() -> Json {
    json!({
        "type": "array",
        "x-kubernetes-list-type": "map",
        "x-kubernetes-list-map-keys": ["type"],
        "items": {
            "type": "object",
            "required": ["type", "status", "lastTransitionTime", "reason", "message"],
            "properties": {
                "type": {"type": "string", "maxLength": 316},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "reason": {"type": "string", "maxLength": 1024},
                "message": {"type": "string", "maxLength": 32768},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0},
            },
        },
    })
}

/// How to make an incompatible schema change without breaking stored objects: a new
/// version beside the current one, with conversions, as a one-line snippet for the
/// breaking-change refusal.
pub fn add_version_hint(rule: &Rule) -> String {
    let (group, current) = split_api_version(&rule.spec.parent.api_version);
    let current = rule
        .spec
        .crd
        .as_ref()
        .and_then(|c| c.versions.iter().find(|v| v.storage))
        .map_or(current, |v| v.name.as_str());
    let next = next_version(current);
    let dir = rule.metadata.name.as_str();
    format!(
        "to change the schema incompatibly, add a version instead: spec.parent.apiVersion: \
         {group}/{next}; spec.crd.versions: [{{name: {next}, storage: true, specSchema: <the new \
         schema>}}, {{name: {current}, deprecated: true, specSchema: <the old schema>}}]; \
         spec.crd.conversion: [{{from: {current}, to: {next}, template: \
         {dir}/{current}-to-{next}.yaml}}, {{from: {next}, to: {current}, template: \
         {dir}/{next}-to-{current}.yaml}}] (docs/reference/crd.md#versions)"
    )
}

/// The version after `v`: `v1` → `v2`, `v1beta1` → `v1beta2`, `v2alpha3` → `v2alpha4`.
fn next_version(v: &str) -> String {
    let digits = v.len() - v.trim_end_matches(|c: char| c.is_ascii_digit()).len();
    let (head, n) = v.split_at(v.len() - digits);
    match n.parse::<u64>() {
        Ok(n) if !head.is_empty() => format!("{head}{}", n + 1),
        _ => format!("{v}2"),
    }
}

/// Schema changes that could break objects already stored: a removed property, a
/// changed type, a new required field, tighter bounds, fewer enum values, stricter
/// patterns or formats. `path` names the place, e.g. `spec.replicas`.
pub fn breaking_changes(old: &Json, new: &Json, path: &str, out: &mut Vec<String>) {
    let here = if path.is_empty() {
        "(root)".to_string()
    } else {
        path.to_string()
    };
    let get = |v: &Json, k: &str| v.get(k).cloned();
    if get(old, "type") != get(new, "type") && get(old, "type").is_some() {
        out.push(format!(
            "{here}: type changes from {} to {}",
            get(old, "type").unwrap_or(Json::Null),
            get(new, "type").unwrap_or(Json::Null)
        ));
        return;
    }
    let old_preserves = old.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
    let new_preserves = new.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
    if old_preserves && !new_preserves {
        out.push(format!(
            "{here}: no longer preserves unknown fields (stored fields outside the schema would be pruned)"
        ));
    }
    if let Some(old_props) = old.get("properties").and_then(Json::as_object) {
        let new_props = new.get("properties").and_then(Json::as_object);
        let preserves = new.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
        for (k, v) in old_props {
            let child = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            match new_props.and_then(|p| p.get(k)) {
                Some(nv) => breaking_changes(v, nv, &child, out),
                None if !preserves => {
                    out.push(format!("{child}: removed (stored values would be pruned)"))
                }
                None => {}
            }
        }
    }
    if let (Some(oi), Some(ni)) = (old.get("items"), new.get("items")) {
        breaking_changes(oi, ni, &format!("{here}[]"), out);
    }
    let old_req: Vec<&str> = old
        .get("required")
        .and_then(Json::as_array)
        .map(|a| a.iter().filter_map(Json::as_str).collect())
        .unwrap_or_default();
    if let Some(new_req) = new.get("required").and_then(Json::as_array) {
        for r in new_req.iter().filter_map(Json::as_str) {
            if !old_req.contains(&r) {
                out.push(format!("{here}: '{r}' becomes required"));
            }
        }
    }
    tightened(old, new, &here, out);
}

/// The constraints of one schema node that `new` makes stricter than `old`: bounds,
/// enum values, patterns and formats.
fn tightened(old: &Json, new: &Json, here: &str, out: &mut Vec<String>) {
    for (k, tighter_if_greater) in [
        ("minimum", true),
        ("minLength", true),
        ("minItems", true),
        ("minProperties", true),
        ("maximum", false),
        ("maxLength", false),
        ("maxItems", false),
        ("maxProperties", false),
    ] {
        let (o, n) = (
            old.get(k).and_then(Json::as_f64),
            new.get(k).and_then(Json::as_f64),
        );
        let tighter = match (o, n) {
            (None, Some(_)) => true,
            (Some(o), Some(n)) => {
                if tighter_if_greater {
                    n > o
                } else {
                    n < o
                }
            }
            _ => false,
        };
        if tighter {
            out.push(format!(
                "{here}: {k} tightens ({} → {})",
                o.map_or("none".into(), |v| v.to_string()),
                n.map_or("none".into(), |v| v.to_string())
            ));
        }
    }
    if let Some(new_enum) = new.get("enum").and_then(Json::as_array) {
        match old.get("enum").and_then(Json::as_array) {
            None => out.push(format!("{here}: enum added")),
            Some(old_enum) => {
                for v in old_enum {
                    if !new_enum.contains(v) {
                        out.push(format!("{here}: enum value {v} removed"));
                    }
                }
            }
        }
    }
    for k in ["pattern", "format"] {
        if new.get(k).is_some() && new.get(k) != old.get(k) {
            out.push(format!("{here}: {k} changes"));
        }
    }
}

/// Problems the API server would reject in a CRD section, as `(key, message)`:
/// scope and names, and the structural-schema rules for `specSchema`/`statusSchema`.
pub fn validate(rule: &Rule) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let Some(crd) = &rule.spec.crd else {
        return out;
    };
    let parent = &rule.spec.parent;
    let (group, _) = split_api_version(&parent.api_version);
    if group.is_empty() || !group.contains('.') {
        out.push((
            "spec.crd".into(),
            format!(
                "a CRD needs a group with a dot (e.g. example.com); spec.parent.apiVersion is '{}'",
                parent.api_version.value
            ),
        ));
    }
    if let Some(scope) = &crd.scope
        && !matches!(scope.as_str(), "Namespaced" | "Cluster")
    {
        out.push((
            "spec.crd.scope".into(),
            format!("'{}' is not Namespaced or Cluster", scope.value),
        ));
    }
    let plural = plural(crd, &parent.kind);
    if !crate::meta::is_dns_label(&plural) {
        out.push((
            "spec.crd.plural".into(),
            format!("'{plural}' is not a lower-case DNS label"),
        ));
    }
    for (key, value) in [("singular", crd.singular.as_deref())] {
        if let Some(v) = value
            && !crate::meta::is_dns_label(v)
        {
            out.push((
                format!("spec.crd.{key}"),
                format!("'{v}' is not a lower-case DNS label"),
            ));
        }
    }
    for s in &crd.short_names {
        if !crate::meta::is_dns_label(s) {
            out.push((
                "spec.crd.shortNames".into(),
                format!("'{s}' is not a lower-case DNS label"),
            ));
        }
    }
    for (i, c) in crd.printer_columns.iter().enumerate() {
        for (key, problem) in column_problems(c) {
            out.push((format!("spec.crd.printerColumns[{i}].{key}"), problem));
        }
    }
    for (key, schema) in [
        ("specSchema", &crd.spec_schema),
        ("statusSchema", &crd.status_schema),
    ] {
        if let Some(s) = schema {
            if s.value.get("type").and_then(Json::as_str) != Some("object") {
                out.push((format!("spec.crd.{key}"), "must be `type: object`".into()));
            }
            let mut problems = Vec::new();
            structural(&s.value, "", &mut problems);
            out.extend(problems.into_iter().map(|p| (format!("spec.crd.{key}"), p)));
        }
    }
    // Status fields the schema does not declare would be pruned by the API server.
    if let Some(s) = &crd.status_schema {
        let preserves =
            s.value.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
        let props = s.value.get("properties").and_then(Json::as_object);
        for field in rule.spec.status.keys() {
            if !preserves && !props.is_some_and(|p| p.contains_key(field)) {
                out.push((
                    format!("spec.status.{field}"),
                    "is not declared in spec.crd.statusSchema.properties; the API server would drop it".into(),
                ));
            }
        }
    }
    out
}

/// What the API server would refuse in one printer column, as `(key, message)`.
pub(super) fn column_problems(c: &super::PrinterColumn) -> Vec<(&'static str, String)> {
    let mut out = Vec::new();
    if !matches!(
        c.type_.as_str(),
        "string" | "integer" | "number" | "boolean" | "date"
    ) {
        out.push((
            "type",
            format!(
                "'{}' is not one of string, integer, number, boolean, date",
                c.type_
            ),
        ));
    }
    if !c.json_path.starts_with('.') {
        out.push(("jsonPath", format!("'{}' must start with '.'", c.json_path)));
    }
    out
}

const UNSUPPORTED: &[&str] = &[
    "$ref",
    "$schema",
    "definitions",
    "dependencies",
    "patternProperties",
    "additionalItems",
    "id",
];

/// The structural-schema rules of apiextensions.k8s.io/v1.
pub(super) fn structural(s: &Json, path: &str, out: &mut Vec<String>) {
    let here = if path.is_empty() {
        "(root)".to_string()
    } else {
        path.to_string()
    };
    let Some(obj) = s.as_object() else {
        out.push(format!("{here}: a schema must be a mapping"));
        return;
    };
    for k in UNSUPPORTED {
        if obj.contains_key(*k) {
            out.push(format!("{here}: '{k}' is not supported in a CRD schema"));
        }
    }
    if obj.get("uniqueItems") == Some(&Json::Bool(true)) {
        out.push(format!("{here}: uniqueItems: true is not supported"));
    }
    let preserve = obj.get("x-kubernetes-preserve-unknown-fields") == Some(&Json::Bool(true));
    let int_or_string = obj.get("x-kubernetes-int-or-string") == Some(&Json::Bool(true));
    match obj.get("type").and_then(Json::as_str) {
        Some("object" | "array" | "string" | "integer" | "number" | "boolean") => {}
        Some(other) => out.push(format!("{here}: type '{other}' is not an OpenAPI type")),
        None if preserve || int_or_string => {}
        None => out.push(format!(
            "{here}: every schema needs a type (or x-kubernetes-preserve-unknown-fields / x-kubernetes-int-or-string)"
        )),
    }
    if obj.contains_key("properties") && obj.contains_key("additionalProperties") {
        out.push(format!(
            "{here}: properties and additionalProperties cannot be used together"
        ));
    }
    if obj.get("type").and_then(Json::as_str) == Some("array") && !obj.contains_key("items") {
        out.push(format!("{here}: an array needs items"));
    }
    if let Some(items) = obj.get("items") {
        if items.is_array() {
            out.push(format!("{here}: items must be one schema, not a list"));
        } else {
            structural(items, &format!("{here}[]"), out);
        }
    }
    if let Some(props) = obj.get("properties").and_then(Json::as_object) {
        for (k, v) in props {
            let child = if path.is_empty() {
                k.clone()
            } else {
                format!("{path}.{k}")
            };
            structural(v, &child, out);
        }
    }
    if let Some(ap) = obj.get("additionalProperties")
        && ap.is_object()
    {
        structural(ap, &format!("{here}.*"), out);
    }
    for junctor in ["allOf", "anyOf", "oneOf"] {
        if let Some(list) = obj.get(junctor).and_then(Json::as_array) {
            for (i, sub) in list.iter().enumerate() {
                for forbidden in [
                    "type",
                    "default",
                    "description",
                    "nullable",
                    "additionalProperties",
                ] {
                    if sub.get(forbidden).is_some() {
                        out.push(format!(
                            "{here}.{junctor}[{i}]: '{forbidden}' is not allowed inside {junctor}"
                        ));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn changes(old: Json, new: Json) -> Vec<String> {
        let mut out = Vec::new();
        breaking_changes(&old, &new, "", &mut out);
        out
    }

    fn webapp() -> Rule {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../examples/versioned/rules/webapp.yaml"
        );
        let text = std::fs::read_to_string(path).unwrap();
        crate::rules::parse_file("webapp.yaml", &text).unwrap()[0]
            .rule
            .clone()
    }

    #[test]
    fn every_version_with_its_schema_columns_and_flags() {
        let crd = crd_for(&webapp()).unwrap();
        let versions = crd["spec"]["versions"].as_array().unwrap();
        assert_eq!(versions.len(), 2);
        let (v1, alpha) = (&versions[0], &versions[1]);
        assert_eq!(
            (&v1["name"], &v1["served"], &v1["storage"]),
            (&json!("v1"), &json!(true), &json!(true))
        );
        assert!(v1.get("deprecated").is_none());
        assert_eq!(
            (&alpha["name"], &alpha["served"], &alpha["storage"]),
            (&json!("v1alpha1"), &json!(true), &json!(false))
        );
        assert_eq!(alpha["deprecated"], true);
        assert!(
            alpha["deprecationWarning"]
                .as_str()
                .unwrap()
                .contains("deprecated")
        );
        let spec = |v: &Json| v["schema"]["openAPIV3Schema"]["properties"]["spec"].clone();
        assert!(spec(v1)["properties"].get("container").is_some());
        assert!(spec(alpha)["properties"].get("image").is_some());
        // The top-level statusSchema is every version's default.
        for v in versions {
            let status = &v["schema"]["openAPIV3Schema"]["properties"]["status"]["properties"];
            assert!(status.get("image").is_some() && status.get("conditions").is_some());
            assert_eq!(v["subresources"], json!({"status": {}}));
        }
        assert_eq!(
            v1["additionalPrinterColumns"][0]["jsonPath"],
            ".spec.container.image"
        );
        assert_eq!(
            alpha["additionalPrinterColumns"][0]["jsonPath"],
            ".spec.image"
        );
        assert_eq!(alpha["additionalPrinterColumns"][1]["name"], "Ready");
    }

    #[test]
    fn the_conversion_stanza_takes_the_client_config_or_a_placeholder() {
        let rule = webapp();
        let given = json!({"url": "https://127.0.0.1:9443/convert/webapp", "caBundle": "UEVN"});
        let crd = crd_with_webhook(&rule, Some(&given)).unwrap();
        assert_eq!(
            crd["spec"]["conversion"],
            json!({"strategy": "Webhook", "webhook": {
                "clientConfig": given, "conversionReviewVersions": ["v1"]}})
        );
        let placeholder = crd_for(&rule).unwrap();
        assert_eq!(
            placeholder["spec"]["conversion"]["webhook"]["clientConfig"]["service"]["path"],
            "/convert/webapp"
        );
        // One version, no conversions: no stanza, one served stored version.
        let mut single = rule.clone();
        let c = single.spec.crd.as_mut().unwrap();
        c.versions.clear();
        c.conversion.clear();
        let crd = crd_for(&single).unwrap();
        assert!(crd["spec"].get("conversion").is_none());
        assert_eq!(crd["spec"]["versions"].as_array().unwrap().len(), 1);
        assert_eq!(crd["spec"]["versions"][0]["name"], "v1");
    }

    #[test]
    fn the_hint_names_the_next_version() {
        assert_eq!(next_version("v1"), "v2");
        assert_eq!(next_version("v1beta1"), "v1beta2");
        assert_eq!(next_version("v2alpha9"), "v2alpha10");
        let hint = add_version_hint(&webapp());
        assert!(
            hint.contains("web.example.com/v2")
                && hint.contains("{from: v1, to: v2, template: webapp/v1-to-v2.yaml}"),
            "{hint}"
        );
    }

    #[test]
    fn additive_changes_are_not_breaking() {
        let old = json!({"type": "object", "properties": {"a": {"type": "string"}}});
        let new = json!({"type": "object", "properties": {"a": {"type": "string", "maxLength": 10}, "b": {"type": "integer"}}});
        assert_eq!(
            changes(
                old.clone(),
                json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}})
            ),
            Vec::<String>::new()
        );
        assert_eq!(
            changes(old, new),
            vec!["a: maxLength tightens (none → 10)".to_string()]
        );
    }

    #[test]
    fn removals_type_changes_and_required_are_breaking() {
        let old = json!({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer", "enum": [1, 2]}}});
        let new =
            json!({"type": "object", "required": ["b"], "properties": {"b": {"type": "string"}}});
        let c = changes(old, new);
        assert!(
            c.iter()
                .any(|m| m == "a: removed (stored values would be pruned)"),
            "{c:?}"
        );
        assert!(c.iter().any(|m| m.starts_with("b: type changes")), "{c:?}");
        assert!(
            c.iter().any(|m| m == "(root): 'b' becomes required"),
            "{c:?}"
        );
    }
}
