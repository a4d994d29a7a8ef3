//! Rendered children checked against the OpenAPI v3 schemas of their kinds (issue 44,
//! part 1): `rulebook check` and `rulebook test` find a template that renders
//! `replicas: "three"`, an unknown field or a missing required field before the API
//! server refuses it for every parent at once.
//!
//! A [`Catalog`] holds the schemas: OpenAPI v3 documents as the API server serves them
//! (`/openapi/v3/apis/<group>/<version>`, `/openapi/v3/api/v1`; each schema names its
//! kinds in `x-kubernetes-group-version-kind`), and the rules' own CRDs (generated from
//! `spec.crd`). [`Catalog::validate`] gives every problem of one object as a JSON path
//! and a message; [`lines::line_of`] finds the template line a path most likely comes
//! from.
//!
//! Why a purpose-built validator and not the `jsonschema` crate: Kubernetes' schemas are
//! OpenAPI 3.0 structural schemas, not JSON Schema. What matters here is what the crate
//! does not know: `nullable` (and a `null` the API server prunes as if absent), the
//! `x-kubernetes-*` extensions (`int-or-string`, `preserve-unknown-fields`,
//! `embedded-resource`), `format: int32`/`int64` ranges and `byte`, and that a built-in
//! kind's object with `properties` is closed although its schema never says
//! `additionalProperties: false` (the API server's strict field validation refuses an
//! unknown field by decoding into the Go type). Using the crate would mean rewriting every
//! schema tree into JSON Schema first and still checking the extensions by hand, for a
//! dependency tree (fancy-regex, ahash, referencing, uuid, …) that costs build time on
//! the project's 2 cores. The keywords the API server's schemas use are few (counted in
//! the v1.36 documents: `type`, `properties`, `items`, `additionalProperties`,
//! `required`, `enum`, `format`, `allOf` around `$ref`, `oneOf` for `IntOrString` and
//! `Quantity`): the validator below is about 300 lines, pure, and names paths the way
//! the API server's errors do (`spec.template.spec.containers[0].image`).

pub mod lines;
mod validate;

use std::collections::BTreeMap;

use serde_json::{Map, Value as Json};

pub use validate::{Problem, Segment, display_path};

/// Where a kind's schema is: a schema of an OpenAPI document, or a CRD version's.
#[derive(Debug, Clone)]
enum Target {
    /// Document index and schema name (`io.k8s.api.apps.v1.Deployment`).
    Document(usize, String),
    /// A CRD version's `openAPIV3Schema` (the rules' own kinds).
    Crd(Json),
}

/// The schemas of the kinds `check` and `test` know, by `(apiVersion, kind)`.
#[derive(Debug, Default)]
pub struct Catalog {
    /// Each document's `components.schemas`.
    documents: Vec<Map<String, Json>>,
    kinds: BTreeMap<(String, String), Target>,
}

/// Why a document could not be read.
#[derive(Debug, thiserror::Error)]
pub enum CatalogError {
    #[error("not an OpenAPI v3 document: it has no components.schemas mapping")]
    NoSchemas,
}

impl Catalog {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds an OpenAPI v3 document (`components.schemas`): every schema naming kinds in
    /// `x-kubernetes-group-version-kind` becomes theirs. A kind already known keeps the
    /// schema it had (a rule's own CRD first, then documents in the order added).
    pub fn add_document(&mut self, document: Json) -> Result<(), CatalogError> {
        let Json::Object(mut doc) = document else {
            return Err(CatalogError::NoSchemas);
        };
        let Some(Json::Object(mut components)) = doc.remove("components") else {
            return Err(CatalogError::NoSchemas);
        };
        let Some(Json::Object(schemas)) = components.remove("schemas") else {
            return Err(CatalogError::NoSchemas);
        };
        let at = self.documents.len();
        for (name, schema) in &schemas {
            let gvks = schema
                .get("x-kubernetes-group-version-kind")
                .and_then(Json::as_array);
            for gvk in gvks.into_iter().flatten() {
                let s = |k: &str| gvk.get(k).and_then(Json::as_str).unwrap_or("");
                let key = (api_version(s("group"), s("version")), s("kind").to_string());
                self.kinds
                    .entry(key)
                    .or_insert_with(|| Target::Document(at, name.clone()));
            }
        }
        self.documents.push(schemas);
        Ok(())
    }

    /// Adds the kinds of a CustomResourceDefinition object (each version with an
    /// `openAPIV3Schema`); they take precedence over a document's schema of the same kind.
    pub fn add_crd(&mut self, crd: &Json) {
        let group = crd.pointer("/spec/group").and_then(Json::as_str);
        let kind = crd.pointer("/spec/names/kind").and_then(Json::as_str);
        let (Some(group), Some(kind)) = (group, kind) else {
            return;
        };
        let versions = crd.pointer("/spec/versions").and_then(Json::as_array);
        for v in versions.into_iter().flatten() {
            let (Some(name), Some(schema)) = (
                v.get("name").and_then(Json::as_str),
                v.pointer("/schema/openAPIV3Schema"),
            ) else {
                continue;
            };
            self.kinds.insert(
                (api_version(group, name), kind.to_string()),
                Target::Crd(schema.clone()),
            );
        }
    }

    /// Whether a schema of `api_version` `kind` is known.
    pub fn knows(&self, api_version: &str, kind: &str) -> bool {
        self.kinds
            .contains_key(&(api_version.to_string(), kind.to_string()))
    }

    /// How many kinds the catalog knows.
    pub fn len(&self) -> usize {
        self.kinds.len()
    }

    pub fn is_empty(&self) -> bool {
        self.kinds.is_empty()
    }

    /// Every problem of `object` against its kind's schema (by its own `apiVersion` and
    /// `kind`), at most `limit`; `None` when the catalog has no schema of its kind.
    /// `show_values` puts the offending value in messages (never for a Secret's).
    pub fn validate(&self, object: &Json, show_values: bool, limit: usize) -> Option<Vec<Problem>> {
        let s = |k: &str| object.get(k).and_then(Json::as_str).unwrap_or("");
        let target = self
            .kinds
            .get(&(s("apiVersion").to_string(), s("kind").to_string()))?;
        let mut v = validate::Validator::new(show_values, limit);
        match target {
            Target::Document(at, name) => {
                let doc = &self.documents[*at];
                let schema = doc.get(name).unwrap_or(&Json::Null);
                v.structural = false;
                v.document = Some(doc);
                v.check(schema, object, &mut Vec::new());
            }
            Target::Crd(schema) => {
                v.structural = true;
                v.check_crd_root(schema, object);
            }
        }
        Some(v.problems)
    }
}

/// `group/version`, or `version` alone for the core group.
fn api_version(group: &str, version: &str) -> String {
    if group.is_empty() {
        version.to_string()
    } else {
        format!("{group}/{version}")
    }
}
