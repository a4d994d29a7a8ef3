//! `rulebook render --observed`: which object of the file is which child.
//!
//! The operator only ever sees children it labelled (`rulebook.dev/child`), but a file
//! written by hand usually has no labels. So an object counts as a child when its label
//! names a child of the rule, or when it has the apiVersion, kind and name (and, if it
//! says, the namespace) of a rendered child; it is then labelled (and annotated with the
//! `forEach` index) as the operator would have it. Anything else is ignored, and said so:
//! silently ignoring a fixture turns into a puzzling `missing: …`.
//!
//! Render and observation are circular (templates may read `children.<name>`, so the
//! rendered names may depend on the live objects): render, match, and render again with
//! the newly matched objects until no unlabeled object matches any more. Every round
//! matches at least one more object, so this ends.

use serde_json::{Map, Value as Json};

use crate::render::{CompiledRule, DesiredChild, Observed, RenderError, Scope, labels};

/// The outcome of rendering against the objects of an `--observed` file.
#[derive(Debug)]
pub struct Matched {
    /// The live children, as the operator would have them (labelled).
    pub observed: Observed,
    /// The children rendered against `observed`.
    pub desired: Vec<DesiredChild>,
    /// One line per object that matched no child, in file order: `Kind/name: ignored: why`.
    pub ignored: Vec<String>,
}

/// Renders `parent` against `objects` (see the module doc): the matched objects, the
/// desired children, and a note for every object ignored.
pub fn render_against(
    rule: &CompiledRule,
    parent: &Json,
    objects: Vec<Json>,
    scope: &dyn Fn(usize) -> Scope,
) -> Result<Matched, RenderError> {
    let mut children = Vec::new();
    // (position in the file, object)
    let mut unlabeled = Vec::new();
    let mut ignored = Vec::new();
    let (refs, objects) = references(rule, parent, objects)?;
    for (at, o) in objects {
        match child_label(&o) {
            Some(name) if rule.children().iter().any(|c| c.name.as_str() == name) => {
                children.push(o)
            }
            Some(name) => ignored.push((
                at,
                format!(
                    "{}: ignored: labelled {}={name}, but rule '{}' has no child '{name}'",
                    display(&o),
                    labels::CHILD,
                    rule.name
                ),
            )),
            None => unlabeled.push((at, o)),
        }
    }
    let mut observed = Observed::from_objects(children.clone());
    observed.refs = refs.clone();
    let mut desired = rule.render(parent, &observed, scope)?;
    loop {
        let before = children.len();
        let mut rest = Vec::new();
        for (at, mut o) in unlabeled {
            match desired.iter().find(|d| is_object_of(d, &o)) {
                Some(d) if attach(&mut o, d) => children.push(o),
                Some(d) => ignored.push((
                    at,
                    format!(
                        "{}: ignored: it is child '{}', but its metadata.labels or \
                         metadata.annotations is not a mapping",
                        display(&o),
                        d.label()
                    ),
                )),
                None => rest.push((at, o)),
            }
        }
        unlabeled = rest;
        if children.len() == before {
            break;
        }
        observed = Observed::from_objects(children.clone());
        observed.refs = refs.clone();
        desired = rule.render(parent, &observed, scope)?;
    }
    for (at, o) in &unlabeled {
        ignored.push((
            *at,
            format!(
                "{}: ignored: no {} label, and no rendered child of rule '{}' has its \
                 apiVersion, kind, name and namespace{}",
                display(o),
                labels::CHILD,
                rule.name,
                near_miss(&desired, o)
            ),
        ));
    }
    ignored.sort();
    Ok(Matched {
        observed,
        desired,
        ignored: ignored.into_iter().map(|(_, note)| note).collect(),
    })
}

/// The objects of the file that the parent's references point at (by apiVersion, kind
/// and name, or labels; and namespace when the object says), as `refs`; and the rest
/// with their positions. A required reference with no object is an error, as the
/// operator would stop there (`ReferenceMissing`).
#[allow(clippy::type_complexity)]
fn references(
    rule: &CompiledRule,
    parent: &Json,
    objects: Vec<Json>,
) -> Result<(std::collections::BTreeMap<String, Json>, Vec<(usize, Json)>), RenderError> {
    let spec = &rule.rule.spec.references;
    let indexed: Vec<(usize, Json)> = objects.into_iter().enumerate().collect();
    if spec.is_empty() {
        return Ok((Default::default(), indexed));
    }
    let scope = |i: usize| match spec.get(i) {
        Some(r) if super::is_cluster_scoped_builtin(&r.api_version, &r.kind) => Scope::Cluster,
        _ => Scope::Namespaced,
    };
    let targets =
        rule.reference_targets(parent, &Observed::default(), &scope, &mut rule.budget())?;
    let mut found: std::collections::BTreeMap<String, Json> = Default::default();
    let mut rest = Vec::new();
    let mut lists: std::collections::BTreeMap<String, Vec<Json>> = Default::default();
    'objects: for (at, o) in indexed {
        if child_label(&o).is_none() {
            for t in &targets {
                let r = &spec[t.reference];
                let same_kind = text(&o, "/apiVersion") == Some(r.api_version.as_str())
                    && text(&o, "/kind") == Some(r.kind.as_str());
                let ns_ok = match (text(&o, "/metadata/namespace"), &t.namespace) {
                    (Some(have), Some(want)) => have == want,
                    _ => true,
                };
                if !same_kind || !ns_ok {
                    continue;
                }
                let hit = match &t.select {
                    crate::render::RefSelect::Name(n) => {
                        text(&o, "/metadata/name") == Some(n.as_str())
                    }
                    crate::render::RefSelect::Labels(_) => {
                        let labels: std::collections::BTreeMap<String, String> = o
                            .pointer("/metadata/labels")
                            .and_then(|l| serde_json::from_value(l.clone()).ok())
                            .unwrap_or_default();
                        t.selects_labels(&labels)
                    }
                };
                if hit {
                    match &t.select {
                        crate::render::RefSelect::Name(_) => {
                            found.insert(r.name.value.clone(), o);
                        }
                        crate::render::RefSelect::Labels(_) => {
                            lists.entry(r.name.value.clone()).or_default().push(o)
                        }
                    }
                    continue 'objects;
                }
            }
        }
        rest.push((at, o));
    }
    for t in &targets {
        let r = &spec[t.reference];
        match &t.select {
            crate::render::RefSelect::Labels(_) => {
                let mut list = lists.remove(r.name.as_str()).unwrap_or_default();
                list.sort_by(|a, b| text(a, "/metadata/name").cmp(&text(b, "/metadata/name")));
                found.insert(r.name.value.clone(), Json::Array(list));
            }
            crate::render::RefSelect::Name(_)
                if !r.optional && !found.contains_key(r.name.as_str()) =>
            {
                return Err(RenderError::new(
                    rule.file.clone(),
                    Some(r.name.line),
                    format!(
                        "rule '{}': refs.{}: {} not found among the observed objects (a required reference: the operator would set Ready=False, reason ReferenceMissing)",
                        rule.name,
                        r.name.value,
                        t.describe(&r.kind.value)
                    ),
                ));
            }
            crate::render::RefSelect::Name(_) => {}
        }
    }
    Ok((found, rest))
}

fn child_label(o: &Json) -> Option<&str> {
    o.pointer("/metadata/labels")
        .and_then(|l| l.get(labels::CHILD))
        .and_then(Json::as_str)
}

fn text<'a>(o: &'a Json, pointer: &str) -> Option<&'a str> {
    o.pointer(pointer).and_then(Json::as_str)
}

/// `Kind/name`, as the warnings name an object.
fn display(o: &Json) -> String {
    format!(
        "{}/{}",
        text(o, "/kind").unwrap_or("<no kind>"),
        text(o, "/metadata/name").unwrap_or("<no name>")
    )
}

/// Whether `o` is the object `d` would be: same apiVersion, kind and name, and the same
/// namespace unless `o` leaves it out.
fn is_object_of(d: &DesiredChild, o: &Json) -> bool {
    text(o, "/apiVersion") == Some(d.api_version())
        && text(o, "/kind") == Some(d.kind())
        && text(o, "/metadata/name") == Some(d.object_name())
        && match text(o, "/metadata/namespace") {
            None => true,
            Some(ns) => text(&d.object, "/metadata/namespace") == Some(ns),
        }
}

/// Why a rendered child of the same kind and name did not match, if there is one.
fn near_miss(desired: &[DesiredChild], o: &Json) -> String {
    let Some(d) = desired.iter().find(|d| {
        text(o, "/kind") == Some(d.kind()) && text(o, "/metadata/name") == Some(d.object_name())
    }) else {
        return String::new();
    };
    let api_version = text(o, "/apiVersion").unwrap_or("");
    if api_version != d.api_version() {
        return format!(
            " (child '{}' has apiVersion {}, not {api_version})",
            d.label(),
            d.api_version()
        );
    }
    let want = text(&d.object, "/metadata/namespace").unwrap_or("<none>");
    let got = text(o, "/metadata/namespace").unwrap_or("<none>");
    format!(" (child '{}' is in namespace {want}, not {got})", d.label())
}

/// Labels `o` as the child `d` (and its `forEach` index), as the operator would have it;
/// false when its labels or annotations are not a mapping.
fn attach(o: &mut Json, d: &DesiredChild) -> bool {
    // A matched object has a name, so `metadata` is a mapping.
    let Some(meta) = o.get_mut("metadata").and_then(Json::as_object_mut) else {
        return false;
    };
    let Some(l) = mapping(meta, "labels") else {
        return false;
    };
    l.insert(labels::CHILD.into(), d.name.clone().into());
    match d.index {
        Some(i) => match mapping(meta, "annotations") {
            Some(a) => {
                a.insert(labels::INDEX.into(), i.to_string().into());
                true
            }
            None => false,
        },
        None => true,
    }
}

/// `meta[key]` as a mapping, created when absent (or null); `None` when it is something else.
fn mapping<'a>(meta: &'a mut Map<String, Json>, key: &str) -> Option<&'a mut Map<String, Json>> {
    let v = meta.entry(key).or_insert_with(|| Json::Object(Map::new()));
    if v.is_null() {
        *v = Json::Object(Map::new());
    }
    v.as_object_mut()
}
