//! The validator of [`Catalog::validate`](super::Catalog::validate): one walk of the
//! value beside its schema, collecting problems as `(path, message)`.
//!
//! What it checks, as the API server would refuse it: `type` (with `nullable`, and
//! `x-kubernetes-int-or-string`), `format` (`int32`/`int64` ranges, `byte` as base64),
//! `enum`, `required`, unknown fields (an object with `properties` is closed unless it
//! says `additionalProperties` or `x-kubernetes-preserve-unknown-fields`; in a CRD's
//! structural schema every object is), `items`, `allOf` (Kubernetes wraps a `$ref` with a
//! default in one), `oneOf`/`anyOf` (one branch must fit: `IntOrString`, `Quantity`),
//! `x-kubernetes-embedded-resource` (an object with its own `apiVersion`, `kind` and
//! `metadata`), and the value limits a rule's CRD may set (`minimum`/`maximum`,
//! `minLength`/`maxLength`, `minItems`/`maxItems`, `pattern`).
//!
//! A `null` is what the API server makes of it: dropped from a CRD object unless the
//! field is `nullable`, the zero value of a built-in one; so a `null` fits any schema, and
//! counts as missing for `required`. `$ref`s are resolved within the schema's document
//! (`#/components/schemas/<name>`), at most [`MAX_REFS`] in a row without descending into
//! the value, so a document whose refs loop cannot hang the walk.

use std::fmt::Write as _;

use serde_json::{Map, Value as Json};

/// `$ref`s followed in a row at one place of the value before giving up.
const MAX_REFS: usize = 16;
/// Characters of a value quoted in a message.
const MAX_SHOWN: usize = 40;

/// One step of a JSON path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    Key(String),
    Index(usize),
}

/// One thing wrong with an object: where (`spec.replicas`) and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Problem {
    pub path: Vec<Segment>,
    pub message: String,
}

impl Problem {
    /// `spec.template.spec.containers[0].image: message`.
    pub fn describe(&self) -> String {
        format!("{}: {}", display_path(&self.path), self.message)
    }
}

/// A path as the API server writes it: `spec.containers[0].image`, a key with other
/// characters than letters, digits, `-` and `_` as `metadata.labels["app.example/x"]`.
pub fn display_path(path: &[Segment]) -> String {
    let mut out = String::new();
    for s in path {
        match s {
            Segment::Key(k) if !k.is_empty() && k.chars().all(plain) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Segment::Key(k) => {
                let _ = write!(out, "[{}]", Json::String(k.clone()));
            }
            Segment::Index(i) => {
                let _ = write!(out, "[{i}]");
            }
        }
    }
    if out.is_empty() {
        out.push_str("(the object)");
    }
    out
}

fn plain(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

pub(super) struct Validator<'a> {
    /// The document `$ref`s resolve in (none for a CRD's schema).
    pub document: Option<&'a Map<String, Json>>,
    /// A CRD's structural schema: every object without `properties` is closed too.
    pub structural: bool,
    pub problems: Vec<Problem>,
    show_values: bool,
    limit: usize,
}

impl<'a> Validator<'a> {
    pub fn new(show_values: bool, limit: usize) -> Self {
        Self {
            document: None,
            structural: false,
            problems: Vec::new(),
            show_values,
            limit,
        }
    }

    fn report(&mut self, path: &[Segment], message: String) {
        if self.problems.len() < self.limit {
            self.problems.push(Problem {
                path: path.to_vec(),
                message,
            });
        }
    }

    /// A CRD object's root: `apiVersion`, `kind` and `metadata` are the API server's,
    /// whatever the schema says; the rest as the schema says.
    pub fn check_crd_root(&mut self, schema: &'a Json, object: &Json) {
        let Some(map) = object.as_object() else {
            self.report(&[], format!("expected object, got {}", self.shown(object)));
            return;
        };
        let rest: Map<String, Json> = map
            .iter()
            .filter(|(k, _)| !matches!(k.as_str(), "apiVersion" | "kind" | "metadata"))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if let Some(meta) = map.get("metadata")
            && !meta.is_object()
        {
            let path = [Segment::Key("metadata".into())];
            self.report(&path, format!("expected object, got {}", self.shown(meta)));
        }
        self.check(schema, &Json::Object(rest), &mut Vec::new());
    }

    /// Checks `value` (at `path`) against `schema`.
    pub fn check(&mut self, schema: &'a Json, value: &Json, path: &mut Vec<Segment>) {
        let Some(schema) = self.resolve(schema, path) else {
            return;
        };
        if self.problems.len() >= self.limit {
            return;
        }
        if let Some(all) = schema.get("allOf").and_then(Json::as_array) {
            for s in all {
                self.check(s, value, path);
            }
        }
        if value.is_null() {
            return;
        }
        if !self.fits_branches(schema, value, path) || !self.fits_type(schema, value, path) {
            return;
        }
        self.check_value(schema, value, path);
        match value {
            Json::Object(map) => self.check_object(schema, map, path),
            Json::Array(items) => {
                if let Some(s) = schema.get("items") {
                    for (i, item) in items.iter().enumerate() {
                        path.push(Segment::Index(i));
                        self.check(s, item, path);
                        path.pop();
                    }
                }
            }
            _ => {}
        }
    }

    /// `schema` with its `$ref`s followed; `None` (and a problem) for a ref that names
    /// nothing or a chain too long.
    fn resolve(&mut self, mut schema: &'a Json, path: &[Segment]) -> Option<&'a Json> {
        for _ in 0..MAX_REFS {
            let Some(r) = schema.get("$ref").and_then(Json::as_str) else {
                return Some(schema);
            };
            let found = r
                .strip_prefix("#/components/schemas/")
                .and_then(|name| self.document?.get(name));
            match found {
                Some(s) => schema = s,
                None => {
                    self.report(path, format!("the schema's $ref {r} names no schema"));
                    return None;
                }
            }
        }
        self.report(path, "the schema's $refs loop".into());
        None
    }

    /// `oneOf`/`anyOf`: some branch takes the value (checked quietly).
    fn fits_branches(&mut self, schema: &'a Json, value: &Json, path: &[Segment]) -> bool {
        for key in ["oneOf", "anyOf"] {
            let Some(branches) = schema.get(key).and_then(Json::as_array) else {
                continue;
            };
            let fits = branches.iter().any(|b| {
                let mut quiet = Validator {
                    document: self.document,
                    structural: self.structural,
                    problems: Vec::new(),
                    show_values: false,
                    limit: 1,
                };
                quiet.check(b, value, &mut path.to_vec());
                quiet.problems.is_empty()
            });
            if !fits && !branches.is_empty() {
                let types: Vec<String> = branches.iter().map(|b| self.type_name(b)).collect();
                let msg = format!("expected {}, got {}", types.join(" or "), self.shown(value));
                self.report(path, msg);
                return false;
            }
        }
        true
    }

    /// The type a branch asks for, for a message.
    fn type_name(&self, schema: &Json) -> String {
        let schema = match schema.get("$ref").and_then(Json::as_str) {
            Some(r) => r
                .strip_prefix("#/components/schemas/")
                .and_then(|n| self.document?.get(n))
                .unwrap_or(schema),
            None => schema,
        };
        schema
            .get("type")
            .and_then(Json::as_str)
            .unwrap_or("a value of the schema")
            .to_string()
    }

    /// `type` (an int-or-string takes both); false (and a problem) when it does not fit.
    fn fits_type(&mut self, schema: &Json, value: &Json, path: &[Segment]) -> bool {
        let int_or_string = schema
            .get("x-kubernetes-int-or-string")
            .and_then(Json::as_bool)
            == Some(true)
            || schema.get("format").and_then(Json::as_str) == Some("int-or-string");
        if int_or_string {
            if value.is_string() || is_integer(value) {
                return true;
            }
            let msg = format!("expected integer or string, got {}", self.shown(value));
            self.report(path, msg);
            return false;
        }
        let Some(want) = schema.get("type").and_then(Json::as_str) else {
            return true;
        };
        let fits = match want {
            "object" => value.is_object(),
            "array" => value.is_array(),
            "string" => value.is_string(),
            "integer" => is_integer(value),
            "number" => value.is_number(),
            "boolean" => value.is_boolean(),
            _ => true,
        };
        if !fits {
            let msg = format!("expected {want}, got {}", self.shown(value));
            self.report(path, msg);
        }
        fits
    }

    /// `format`, `enum` and the value limits.
    fn check_value(&mut self, schema: &Json, value: &Json, path: &[Segment]) {
        let format = schema.get("format").and_then(Json::as_str);
        let range = match format {
            Some("int32") => Some((i64::from(i32::MIN), i64::from(i32::MAX))),
            Some("int64") => Some((i64::MIN, i64::MAX)),
            _ => None,
        };
        if let (Some((lo, hi)), Some(n)) = (range, value.as_number())
            && is_integer(value)
            && integer_value(n).is_none_or(|n| n < lo || n > hi)
        {
            let msg = format!(
                "{} is out of the {} range",
                self.shown(value),
                format.unwrap_or("")
            );
            self.report(path, msg);
        }
        if format == Some("byte")
            && let Some(s) = value.as_str()
        {
            use base64::Engine as _;
            if base64::engine::general_purpose::STANDARD.decode(s).is_err() {
                self.report(path, "expected base64-encoded data (format byte)".into());
            }
        }
        if let Some(allowed) = schema.get("enum").and_then(Json::as_array)
            && !allowed.contains(value)
        {
            let list: Vec<String> = allowed.iter().map(Json::to_string).collect();
            let msg = format!(
                "unsupported value {}: must be one of {}",
                self.shown(value),
                list.join(", ")
            );
            self.report(path, msg);
        }
        if let Some(m) = limit_problem(schema, value) {
            self.report(path, m);
        }
    }

    fn check_object(&mut self, schema: &'a Json, map: &Map<String, Json>, path: &mut Vec<Segment>) {
        let props = schema.get("properties").and_then(Json::as_object);
        let embedded = schema
            .get("x-kubernetes-embedded-resource")
            .and_then(Json::as_bool)
            == Some(true);
        if embedded {
            for k in ["apiVersion", "kind"] {
                if map.get(k).and_then(Json::as_str).is_none_or(str::is_empty) {
                    path.push(Segment::Key(k.into()));
                    self.report(path, "required field is missing (an embedded object names its apiVersion and kind)".into());
                    path.pop();
                }
            }
        }
        for r in schema
            .get("required")
            .and_then(Json::as_array)
            .into_iter()
            .flatten()
            .filter_map(Json::as_str)
        {
            if map.get(r).is_none_or(Json::is_null) {
                path.push(Segment::Key(r.into()));
                self.report(path, "required field is missing".into());
                path.pop();
            }
        }
        let extra = schema.get("additionalProperties");
        let open = schema
            .get("x-kubernetes-preserve-unknown-fields")
            .and_then(Json::as_bool)
            == Some(true)
            || extra.is_some_and(|e| e != &Json::Bool(false))
            || (props.is_none()
                && (!self.structural
                    || schema.get("type").and_then(Json::as_str) != Some("object")));
        for (k, v) in map {
            path.push(Segment::Key(k.clone()));
            match props.and_then(|p| p.get(k)) {
                Some(s) => self.check(s, v, path),
                None if extra.is_some_and(Json::is_object) => {
                    if let Some(e) = extra {
                        self.check(e, v, path);
                    }
                }
                None if open => {}
                None if embedded && matches!(k.as_str(), "apiVersion" | "kind" | "metadata") => {}
                None => self.report(path, "unknown field".into()),
            }
            path.pop();
        }
    }

    /// `value` for a message: its type, and the value itself when allowed (cut short).
    fn shown(&self, value: &Json) -> String {
        let kind = match value {
            Json::Null => return "null".into(),
            Json::Bool(_) => "boolean",
            Json::Number(_) if is_integer(value) => "integer",
            Json::Number(_) => "number",
            Json::String(_) => "string",
            Json::Array(_) => return "array".into(),
            Json::Object(_) => return "object".into(),
        };
        if !self.show_values {
            return kind.into();
        }
        let mut text = value.to_string();
        if text.chars().count() > MAX_SHOWN {
            text = text.chars().take(MAX_SHOWN).collect::<String>() + "…";
        }
        format!("{kind} {text}")
    }
}

/// The integer `n` stands for (a float with no fraction within ±2^53 included).
fn integer_value(n: &serde_json::Number) -> Option<i64> {
    n.as_i64().or_else(|| {
        n.as_f64()
            .filter(|f| f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15)
            .map(|f| f as i64)
    })
}

/// An integer, or a float with no fraction (`1e3` read as YAML 1.1 is 1000.0): as the
/// API server's validation (go-openapi's `IsFloat64AJSONInteger`) takes it.
fn is_integer(value: &Json) -> bool {
    value.as_i64().is_some()
        || value.as_u64().is_some()
        || value
            .as_f64()
            .is_some_and(|f| f.is_finite() && f.fract() == 0.0 && f.abs() < 9.0e15)
}

/// The first value limit `value` breaks: `minimum`/`maximum` (and their exclusive
/// forms), `minLength`/`maxLength`, `minItems`/`maxItems`, `pattern`.
fn limit_problem(schema: &Json, value: &Json) -> Option<String> {
    let num = |k: &str| schema.get(k).and_then(Json::as_f64);
    let flag = |k: &str| schema.get(k).and_then(Json::as_bool) == Some(true);
    if let Some(n) = value.as_f64() {
        if let Some(m) = num("minimum")
            && (n < m || (flag("exclusiveMinimum") && n <= m))
        {
            return Some(format!("{n} is less than the minimum {m}"));
        }
        if let Some(m) = num("maximum")
            && (n > m || (flag("exclusiveMaximum") && n >= m))
        {
            return Some(format!("{n} is more than the maximum {m}"));
        }
    }
    let count = |k: &str| schema.get(k).and_then(Json::as_u64);
    let len = match value {
        Json::String(s) => Some((s.chars().count() as u64, "Length", "characters")),
        Json::Array(a) => Some((a.len() as u64, "Items", "items")),
        _ => None,
    };
    if let Some((n, key, what)) = len {
        if let Some(m) = count(&format!("min{key}"))
            && n < m
        {
            return Some(format!("{n} {what}, fewer than the minimum {m}"));
        }
        if let Some(m) = count(&format!("max{key}"))
            && n > m
        {
            return Some(format!("{n} {what}, more than the maximum {m}"));
        }
    }
    if let (Some(p), Some(s)) = (schema.get("pattern").and_then(Json::as_str), value.as_str()) {
        let re = regex::RegexBuilder::new(p).size_limit(1 << 20).build();
        if let Ok(re) = re
            && !re.is_match(s)
        {
            return Some(format!("does not match the pattern {p:?}"));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::Catalog;
    use super::*;

    fn apps() -> Catalog {
        let mut c = Catalog::new();
        c.add_document(json!({"components": {"schemas": {
            "Deployment": {
                "type": "object",
                "properties": {
                    "apiVersion": {"type": "string"},
                    "kind": {"type": "string"},
                    "metadata": {"default": {}, "allOf": [{"$ref": "#/components/schemas/Meta"}]},
                    "spec": {"default": {}, "allOf": [{"$ref": "#/components/schemas/Spec"}]},
                },
                "x-kubernetes-group-version-kind": [{"group": "apps", "version": "v1", "kind": "Deployment"}],
            },
            "Meta": {"type": "object", "properties": {
                "name": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string", "default": ""}},
            }},
            "Spec": {"type": "object", "required": ["template"], "properties": {
                "replicas": {"type": "integer", "format": "int32"},
                "policy": {"type": "string", "enum": ["Always", "Never"]},
                "surge": {"$ref": "#/components/schemas/IntOrString"},
                "cpu": {"$ref": "#/components/schemas/Quantity"},
                "template": {"type": "object", "properties": {"image": {"type": "string"}}},
                "data": {"type": "object", "additionalProperties": {"type": "string", "format": "byte"}},
                "raw": {"type": "object"},
                "list": {"type": "array", "items": {"$ref": "#/components/schemas/Meta"}},
            }},
            "IntOrString": {"format": "int-or-string", "oneOf": [{"type": "integer"}, {"type": "string"}]},
            "Quantity": {"oneOf": [{"type": "string"}, {"type": "number"}]},
        }}}))
        .unwrap();
        c
    }

    /// The problems, sorted (the order of a map's keys is serde_json's).
    fn problems(c: &Catalog, object: Json) -> Vec<String> {
        let mut got: Vec<String> = c
            .validate(&object, true, 20)
            .expect("a known kind")
            .iter()
            .map(Problem::describe)
            .collect();
        got.sort();
        got
    }

    fn deployment(spec: Json) -> Json {
        json!({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "w"}, "spec": spec})
    }

    #[test]
    fn a_string_where_an_integer_belongs_is_named_with_its_path_and_value() {
        let got = problems(
            &apps(),
            deployment(json!({"replicas": "three", "template": {}})),
        );
        assert_eq!(
            got,
            vec![r#"spec.replicas: expected integer, got string "three""#]
        );
    }

    #[test]
    fn unknown_missing_enum_and_range_problems_are_all_reported() {
        let got = problems(
            &apps(),
            deployment(json!({"replicas": 3_000_000_000_u64, "policy": "Sometimes", "extra": 1})),
        );
        assert_eq!(
            got,
            vec![
                "spec.extra: unknown field",
                r#"spec.policy: unsupported value string "Sometimes": must be one of "Always", "Never""#,
                "spec.replicas: integer 3000000000 is out of the int32 range",
                "spec.template: required field is missing",
            ]
        );
    }

    #[test]
    fn int_or_string_quantity_null_maps_and_open_objects_fit() {
        let c = apps();
        for spec in [
            json!({"surge": 1, "cpu": "500m", "template": {"image": null}}),
            json!({"surge": "25%", "cpu": 0.5, "template": {}, "raw": {"any": [1]}}),
            json!({"template": {}, "data": {"k": "aGk="}, "list": [{"labels": {"a.b/c": "d"}}]}),
        ] {
            assert_eq!(
                problems(&c, deployment(spec.clone())),
                Vec::<String>::new(),
                "{spec}"
            );
        }
        let got = problems(
            &c,
            deployment(
                json!({"surge": true, "cpu": [], "template": null, "data": {"k": "%%"},
                "list": [{"labels": {"a.b/c": 1}}]}),
            ),
        );
        assert_eq!(
            got,
            vec![
                "spec.cpu: expected string or number, got array",
                "spec.data.k: expected base64-encoded data (format byte)",
                r#"spec.list[0].labels["a.b/c"]: expected string, got integer 1"#,
                "spec.surge: expected integer or string, got boolean true",
                "spec.template: required field is missing",
            ]
        );
    }

    #[test]
    fn a_crd_schema_is_structural_and_its_root_allows_the_api_servers_fields() {
        let mut c = Catalog::new();
        c.add_crd(&json!({"spec": {"group": "x.dev", "names": {"kind": "App"}, "versions": [
            {"name": "v1", "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                "spec": {"type": "object", "properties": {
                    "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    "size": {"x-kubernetes-int-or-string": true, "anyOf": [{"type": "integer"}, {"type": "string"}]},
                    "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true},
                    "closed": {"type": "object"},
                    "pod": {"type": "object", "x-kubernetes-embedded-resource": true,
                            "x-kubernetes-preserve-unknown-fields": true},
                    "name": {"type": "string", "nullable": true, "pattern": "^[a-z]+$"},
                }},
            }}}},
        ]}}));
        assert!(c.knows("x.dev/v1", "App"));
        let app = |spec: Json| json!({"apiVersion": "x.dev/v1", "kind": "App", "metadata": {"name": "a"}, "spec": spec});
        let ok = app(
            json!({"port": 80, "size": "1Gi", "free": {"a": 1}, "closed": {},
            "pod": {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": {}}, "name": null}),
        );
        assert_eq!(problems(&c, ok), Vec::<String>::new());
        let bad = app(json!({"port": 0, "closed": {"a": 1}, "pod": {"spec": {}}, "name": "A"}));
        assert_eq!(
            problems(&c, bad),
            vec![
                "spec.closed.a: unknown field",
                "spec.name: does not match the pattern \"^[a-z]+$\"",
                "spec.pod.apiVersion: required field is missing (an embedded object names its apiVersion and kind)",
                "spec.pod.kind: required field is missing (an embedded object names its apiVersion and kind)",
                "spec.port: 0 is less than the minimum 1",
            ]
        );
    }

    #[test]
    fn secrets_values_are_not_shown_and_unknown_kinds_are_none() {
        let c = apps();
        let got = c
            .validate(
                &deployment(json!({"replicas": "s3cret", "template": {}})),
                false,
                5,
            )
            .unwrap();
        assert_eq!(got[0].message, "expected integer, got string");
        assert!(
            c.validate(&json!({"apiVersion": "v1", "kind": "Pod"}), true, 5)
                .is_none()
        );
    }

    #[test]
    fn a_looping_ref_ends() {
        let mut c = Catalog::new();
        c.add_document(json!({"components": {"schemas": {
            "A": {"$ref": "#/components/schemas/B",
                  "x-kubernetes-group-version-kind": [{"group": "", "version": "v1", "kind": "A"}]},
            "B": {"$ref": "#/components/schemas/A"},
        }}}))
        .unwrap();
        let got = problems(&c, json!({"apiVersion": "v1", "kind": "A"}));
        assert_eq!(got, vec!["(the object): the schema's $refs loop"]);
    }
}
