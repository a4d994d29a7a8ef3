//! The test file format, `rulebook.dev/v1alpha1` `RuleTest`: a parent, and steps that
//! change it, show the rule live objects, and say what must come out. Expectations keep
//! their source line, so a failure can say `file:line`.

use serde::Deserialize;
use serde_json::Value as Json;

use crate::rules::Loc;

pub const KIND: &str = "RuleTest";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct RuleTest {
    /// Always `rulebook.dev/v1alpha1`.
    pub api_version: Loc<String>,
    /// Always `RuleTest` (other files are not tests).
    #[allow(dead_code)] // read before the whole file is
    pub kind: Loc<String>,
    pub metadata: Metadata,
    pub spec: Spec,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metadata {
    pub name: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Spec {
    /// The parent: a file (relative to the test file) or an inline object.
    pub parent: Source,
    /// The rule to test; default: the rule whose parent kind the parent has.
    #[serde(default)]
    pub rule: Option<Loc<String>>,
    pub steps: Vec<Step>,
}

/// An object (or a stream of them): `file:` relative to the test file, or `object:`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Source {
    #[serde(default)]
    pub file: Option<Loc<String>>,
    #[serde(default)]
    pub object: Option<Loc<Json>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Step {
    pub name: Loc<String>,
    /// A change to the parent, kept for the following steps.
    #[serde(default)]
    pub parent: Option<ParentChange>,
    /// The live children (and other objects) of this step, as `render --observed` reads them.
    #[serde(default)]
    pub observed: Vec<Source>,
    #[serde(default)]
    pub expect: Option<Expect>,
    /// A file (relative to the test file) holding the children and status this step
    /// renders; compared, or written with `--update`.
    #[serde(default)]
    pub snapshot: Option<Loc<String>>,
    /// Instead of rendering: the parent (in the version it is written in) converted to
    /// another version of its CRD by the rule's conversion templates; `expect.object`
    /// (or `expect.error`) says what must come out.
    #[serde(default)]
    pub convert: Option<ConvertStep>,
    /// Instead of rendering: the parent judged as an admission request (the rule's
    /// `spec.admission`, offline); `expect.allowed`/`message`/`object` say the answer.
    #[serde(default)]
    pub admission: Option<AdmissionStep>,
}

/// `admission: {operation: UPDATE, old: {...}}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdmissionStep {
    /// `CREATE` or `UPDATE`.
    pub operation: Loc<String>,
    /// The stored object of an UPDATE; default: the parent before this step's change.
    #[serde(default)]
    pub old: Option<Json>,
}

/// `convert: {to: v1}`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvertStep {
    /// The version converted to, e.g. `v1`.
    pub to: Loc<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParentChange {
    /// A JSON merge patch (RFC 7386) of the parent.
    pub patch: Json,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expect {
    /// Each must match one rendered child (subset match).
    #[serde(default)]
    pub children: Vec<Loc<Json>>,
    /// How many children are rendered.
    #[serde(default)]
    pub count: Option<Loc<usize>>,
    /// A subset of the status Rulebook would write.
    #[serde(default)]
    pub status: Option<Loc<Json>>,
    /// The render (or status) fails with a message containing this.
    #[serde(default)]
    pub error: Option<Loc<String>>,
    /// A `convert` step: the converted object; an `admission` step: the admitted
    /// (defaulted) object (subset match).
    #[serde(default)]
    pub object: Option<Loc<Json>>,
    /// An `admission` step: whether the request is admitted.
    #[serde(default)]
    pub allowed: Option<Loc<bool>>,
    /// An `admission` step: a text the denial contains.
    #[serde(default)]
    pub message: Option<Loc<String>>,
}
