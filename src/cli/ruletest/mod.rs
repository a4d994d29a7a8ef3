//! `rulebook test [PATH...]`: the rules repo's own tests. Each `RuleTest` file names a
//! parent and steps; each step renders the parent (as `rulebook render` does, with the
//! step's live objects as `--observed`) and checks what it says about the children, the
//! status or the error, by subset match. Output is one line per step, a diff for each
//! failure with the `file:line` of the expectation, and `N passed, M failed`.
//!
//! The parent is given the defaults of the rule's `spec.crd` schema and checked against
//! it, as the API server would; parent changes (`parent.patch`, a JSON merge patch) carry over to later steps;
//! status conditions are stamped with a fixed time ([`NOW`]) so snapshots are stable.
//! Every child a step renders is checked against its kind's OpenAPI schema
//! (`super::schemas`): a problem fails the step with the template's `file:line`.

mod admission;
mod convert;
mod matching;
mod model;
mod paths;
mod schema;

use std::cell::RefCell;
use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Result;
use clap::Args;
use serde_json::Value as Json;

use super::schemas::{SchemaArgs, Schemas};
use super::{RuleDirs, load_or_report, observed, parse_objects, to_yaml, with_render_defaults};
use crate::render::status::desired_status;
use crate::render::{CompiledRule, RuleSet};
pub use convert::in_storage_version;
use model::{Expect, RuleTest, Source, Step};

/// The time on conditions in a test.
pub const NOW: &str = "2000-01-01T00:00:00Z";

#[derive(Args, Debug)]
pub struct TestArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Test files, or directories searched for them (`*.yaml`/`*.yml` of kind RuleTest);
    /// default: `tests/` beside the rules directory.
    pub paths: Vec<PathBuf>,
    /// Write each step's `snapshot:` file from what it renders, instead of comparing.
    #[arg(long)]
    pub update: bool,
    /// The repository a test file's paths must stay in (fixtures, snapshots); default:
    /// the nearest directory above the test file holding `.git`, else the file's own.
    #[arg(long)]
    pub root: Option<PathBuf>,
    #[command(flatten)]
    pub schema: SchemaArgs,
    /// Check rendered children against this cluster's OpenAPI schemas (`/openapi/v3`)
    /// instead of the built-in ones (docs/reference/schemas.md).
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
}

/// What every step of a run shares: the schemas its rendered children are checked
/// against, and the kinds met without one (said once, at the end).
struct SchemaCheck<'a> {
    /// The rule set: its own kinds' scopes.
    set: &'a RuleSet,
    schemas: &'a Schemas,
    unknown: RefCell<BTreeSet<String>>,
}

/// What one step rendered: its children and status, or its error.
type Outcome = std::result::Result<(Vec<Json>, Json), String>;

/// One failed expectation.
struct Failure {
    line: u64,
    message: String,
    diff: Option<String>,
}

/// `rulebook test` without a cluster: the schemas of `--openapi DIR`, else the built-in.
pub fn run(args: &TestArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(1);
    };
    let schemas = Schemas::offline(&args.schema, &set)?;
    run_loaded(args, &set, &schemas, out, err)
}

/// `rulebook test --kubeconfig`: the cluster's schemas.
pub async fn run_online(args: &TestArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(1);
    };
    let schemas = match &args.kubeconfig {
        Some(kc) => Schemas::online(&args.schema, kc, &set).await?,
        None => Schemas::offline(&args.schema, &set)?,
    };
    run_loaded(args, &set, &schemas, out, err)
}

fn run_loaded(
    args: &TestArgs,
    set: &RuleSet,
    schemas: &Schemas,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    let checks = SchemaCheck {
        set,
        schemas,
        unknown: RefCell::default(),
    };
    let roots = if args.paths.is_empty() {
        let base = args.dirs.rules.parent().unwrap_or(Path::new("."));
        vec![base.join("tests")]
    } else {
        args.paths.clone()
    };
    let mut files = Vec::new();
    for root in &roots {
        collect(root, root == &roots[0] && args.paths.is_empty(), &mut files)?;
    }
    files.sort();
    let (mut passed, mut failed) = (0usize, 0usize);
    for file in &files {
        let text = std::fs::read_to_string(file)?;
        let shown = file.display().to_string();
        let peek: Json = serde_saphyr::from_str(&text).unwrap_or(Json::Null);
        // A test file that does not parse fails; other YAML files are not tests.
        let says_test = text
            .lines()
            .any(|l| l.trim_start().starts_with("kind:") && l.contains(model::KIND));
        if peek.get("kind").and_then(Json::as_str) != Some(model::KIND) {
            if says_test || args.paths.iter().any(|p| p == file) {
                writeln!(out, "{shown}: not a {} file", model::KIND)?;
                failed += 1;
            }
            continue;
        }
        let test: RuleTest = match serde_saphyr::from_str(&text) {
            Ok(t) => t,
            Err(e) => {
                writeln!(out, "{shown}: {}", crate::rules::yaml_message(&e))?;
                failed += 1;
                continue;
            }
        };
        writeln!(out, "{shown}: {}", test.metadata.name)?;
        if test.api_version.value != crate::rules::API_VERSION {
            writeln!(
                out,
                "  FAIL  {shown}:{}: apiVersion must be {}",
                test.api_version.line,
                crate::rules::API_VERSION
            )?;
            failed += 1;
            continue;
        }
        let (p, f) = run_steps(set, &test, file, (args, &checks), out)?;
        passed += p;
        failed += f;
    }
    if passed + failed == 0 {
        writeln!(
            err,
            "no RuleTest files under {}",
            roots
                .iter()
                .map(|r| r.display().to_string())
                .collect::<Vec<_>>()
                .join(", ")
        )?;
        writeln!(out, "0 passed, 0 failed")?;
        return Ok(1);
    }
    for note in super::schemas::unknown_notes(&checks.unknown.borrow(), &schemas.origin) {
        writeln!(err, "{note}")?;
    }
    writeln!(err, "rendered children checked against {}", schemas.origin)?;
    writeln!(out, "{passed} passed, {failed} failed")?;
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Runs one test file's steps, printing a line per step; returns (passed, failed).
fn run_steps(
    set: &RuleSet,
    test: &RuleTest,
    file: &Path,
    (args, checks): (&TestArgs, &SchemaCheck<'_>),
    out: &mut dyn Write,
) -> Result<(usize, usize)> {
    let shown = file.display().to_string();
    let dir = file.parent().unwrap_or(Path::new("."));
    let confined = match paths::Confined::for_test(file, args.root.as_deref()) {
        Ok(c) => c,
        Err(message) => {
            writeln!(out, "  FAIL (setup): {message}")?;
            return Ok((0, 1));
        }
    };
    let at = Place {
        dir,
        confined: &confined,
    };
    let (rule, mut parent) = match prepare(set, test, &at) {
        Ok(prepared) => prepared,
        Err(message) => {
            writeln!(out, "  FAIL (setup): {}", located(&shown, &message))?;
            return Ok((0, 1));
        }
    };
    let (mut passed, mut failed) = (0, 0);
    for step in &test.spec.steps {
        let failures = run_step(rule, &mut parent, step, (&at, checks), args.update);
        if failures.is_empty() {
            writeln!(out, "  ok    {}", step.name.value)?;
            passed += 1;
            continue;
        }
        writeln!(out, "  FAIL  {}", step.name.value)?;
        for f in failures {
            writeln!(out, "    {shown}:{}: {}", f.line, f.message)?;
            for l in f.diff.iter().flat_map(|d| d.lines()) {
                writeln!(out, "      {l}")?;
            }
        }
        failed += 1;
    }
    Ok((passed, failed))
}

/// `file:N: rest` for a message `line N: rest`, so that a setup failure names its place
/// as a step's failure does; other messages as they are.
fn located(file: &str, message: &str) -> String {
    let line = message
        .strip_prefix("line ")
        .and_then(|m| m.split_once(": "))
        .filter(|(n, _)| n.parse::<u64>().is_ok());
    match line {
        Some((n, rest)) => format!("{file}:{n}: {rest}"),
        None => message.to_string(),
    }
}

/// The YAML files under `root` (or `root` itself); a missing default directory is empty.
fn collect(root: &Path, default: bool, files: &mut Vec<PathBuf>) -> Result<()> {
    if root.is_file() {
        files.push(root.to_path_buf());
        return Ok(());
    }
    if !root.is_dir() {
        if default {
            return Ok(());
        }
        anyhow::bail!("{}: no such file or directory", root.display());
    }
    for entry in std::fs::read_dir(root)? {
        let path = entry?.path();
        if path.is_dir() {
            collect(&path, false, files)?;
        } else if path.extension().is_some_and(|e| e == "yaml" || e == "yml") {
            files.push(path);
        }
    }
    Ok(())
}

/// The parent of every `RuleTest` under `tests/` beside the rules directory, with the
/// place that names it (`file:line`): the fixtures `rulebook check` proves conversions
/// round-trip on. Files that are not tests, or whose parent cannot be read, are left to
/// `rulebook test` to report.
pub fn fixture_parents(dirs: &RuleDirs) -> Vec<(String, Json)> {
    let base = dirs.rules.parent().unwrap_or(Path::new("."));
    let mut files = Vec::new();
    if collect(&base.join("tests"), true, &mut files).is_err() {
        return Vec::new();
    }
    files.sort();
    let mut out = Vec::new();
    for file in files {
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        if !text.contains(model::KIND) {
            continue;
        }
        let Ok(test) = serde_saphyr::from_str::<RuleTest>(&text) else {
            continue;
        };
        let Ok(confined) = paths::Confined::for_test(&file, None) else {
            continue;
        };
        let at = Place {
            dir: file.parent().unwrap_or(Path::new(".")),
            confined: &confined,
        };
        let source = &test.spec.parent;
        let line = source
            .file
            .as_ref()
            .map(|f| f.line)
            .or(source.object.as_ref().map(|o| o.line))
            .unwrap_or(0);
        if let Ok(objects) = objects_of(source, &at)
            && let Some(parent) = objects.into_iter().next()
        {
            out.push((format!("{}:{line}", file.display()), parent));
        }
    }
    out
}

/// Where a test file's relative paths start, and what they must stay in.
struct Place<'a> {
    dir: &'a Path,
    confined: &'a paths::Confined,
}

/// The test's rule and its parent, with the API server's defaults.
fn prepare<'a>(
    set: &'a RuleSet,
    test: &RuleTest,
    at: &Place,
) -> std::result::Result<(&'a CompiledRule, Json), String> {
    let parent = objects_of(&test.spec.parent, at)?
        .into_iter()
        .next()
        .ok_or("spec.parent: no object")?;
    let rule = match &test.spec.rule {
        Some(name) => set
            .rules
            .get(&name.value)
            .ok_or_else(|| format!("line {}: no rule named '{}'", name.line, name.value))?,
        None => {
            let s = |p: &str| {
                parent
                    .pointer(p)
                    .and_then(Json::as_str)
                    .unwrap_or("")
                    .to_string()
            };
            let (av, kind) = (s("/apiVersion"), s("/kind"));
            super::rule_for(set, &av, &kind)
                .ok_or_else(|| format!("no rule has parent {av} {kind}"))?
        }
    };
    Ok((rule, with_render_defaults(rule, parent)))
}

/// The objects of a source: a file's stream (relative to the test file, inside the
/// repository) or the object.
fn objects_of(source: &Source, at: &Place) -> std::result::Result<Vec<Json>, String> {
    match (&source.file, &source.object) {
        (Some(f), None) => {
            let text = at.confined.read(at.dir, f)?;
            parse_objects(&text).map_err(|e| format!("line {}: {}: {e}", f.line, f.value))
        }
        (None, Some(o)) => Ok(vec![o.value.clone()]),
        _ => Err("give exactly one of file and object".into()),
    }
}

/// RFC 7386: `patch` merged into `target`.
fn merge_patch(target: &mut Json, patch: &Json) {
    match patch {
        Json::Object(p) => {
            if !target.is_object() {
                *target = Json::Object(Default::default());
            }
            if let Some(t) = target.as_object_mut() {
                for (k, v) in p {
                    if v.is_null() {
                        t.remove(k);
                    } else {
                        merge_patch(t.entry(k.clone()).or_insert(Json::Null), v);
                    }
                }
            }
        }
        other => *target = other.clone(),
    }
}

/// The parent as the operator reads it: in the storage version, with the defaults of
/// the rule's CRD schema; an error when the API server would refuse it.
pub fn as_stored(rule: &CompiledRule, parent: &Json) -> std::result::Result<Json, String> {
    let mut parent = convert::in_storage_version(rule, parent)?;
    if let Some(schema) = super::storage_spec_schema(rule) {
        if let Some(spec) = parent.get_mut("spec") {
            schema::apply(schema, spec);
        }
        if let Some(spec) = parent.get("spec")
            && let Some(problem) = schema::validate(schema, spec, "spec")
        {
            return Err(format!("the API server would refuse the parent: {problem}"));
        }
    }
    Ok(parent)
}

/// One step's render: its outcome, and the rendered children's schema problems.
fn evaluate(
    rule: &CompiledRule,
    parent: &Json,
    objects: Vec<Json>,
    checks: &SchemaCheck<'_>,
    place: &str,
) -> (Outcome, Vec<String>) {
    let parent = match as_stored(rule, parent) {
        Ok(p) => p,
        Err(e) => return (Err(e), Vec::new()),
    };
    let parent = &parent;
    let scope = super::offline_scope(checks.set, rule);
    let m = match observed::render_against(rule, parent, objects, &scope) {
        Ok(m) => m,
        Err(e) => return (Err(e.to_string()), Vec::new()),
    };
    let findings = {
        let mut unknown = checks.unknown.borrow_mut();
        checks.schemas.check(rule, &m.desired, place, &mut unknown)
    };
    let report = match rule.status(parent, &m.observed, &m.desired) {
        Ok(r) => r,
        Err(e) => return (Err(e.to_string()), findings),
    };
    let status = desired_status(parent, &report.fields, &report.readiness.condition(), NOW);
    (
        Ok((m.desired.into_iter().map(|d| d.object).collect(), status)),
        findings,
    )
}

fn run_step(
    rule: &CompiledRule,
    parent: &mut Json,
    step: &Step,
    (place, checks): (&Place, &SchemaCheck<'_>),
    update: bool,
) -> Vec<Failure> {
    let mut failures = Vec::new();
    let at = step.name.line;
    let before = parent.clone();
    if let Some(change) = &step.parent {
        merge_patch(parent, &change.patch);
    }
    let mut objects = Vec::new();
    for s in &step.observed {
        match objects_of(s, place) {
            Ok(o) => objects.extend(o),
            Err(message) => failures.push(Failure {
                line: s.file.as_ref().map_or(at, |f| f.line),
                message,
                diff: None,
            }),
        }
    }
    if !failures.is_empty() {
        return failures;
    }
    if let Some(c) = &step.convert {
        return convert::run(rule, parent, c, step.expect.as_ref(), at);
    }
    if let Some(a) = &step.admission {
        return admission::run(rule, parent, &before, a, step.expect.as_ref(), at);
    }
    let shown = format!("step '{}'", step.name.value);
    let (outcome, findings) = evaluate(rule, parent, objects, checks, &shown);
    // A child the API server would refuse fails the step, whatever it expects.
    failures.extend(findings.into_iter().map(|message| Failure {
        line: at,
        message,
        diff: None,
    }));
    if let Some(expect) = &step.expect {
        check(expect, &outcome, at, &mut failures);
    } else if let Err(e) = &outcome {
        failures.push(Failure {
            line: at,
            message: format!("unexpected error: {e}"),
            diff: None,
        });
    }
    if let Some(snap) = &step.snapshot {
        failures.extend(compare_snapshot(snap, &outcome, place, update));
    }
    failures
}

/// A step's snapshot: compared with what the step rendered, or written with `--update`;
/// only where the test's repository allows.
fn compare_snapshot(
    snap: &crate::rules::Loc<String>,
    outcome: &Outcome,
    at: &Place,
    update: bool,
) -> Option<Failure> {
    let text = match outcome {
        Ok((children, status)) => {
            let mut docs: Vec<String> = children
                .iter()
                .filter_map(|c| to_yaml(&without_own_annotations(c)).ok())
                .collect();
            docs.push(to_yaml(&serde_json::json!({"status": status})).unwrap_or_default());
            docs.join("---\n")
        }
        Err(e) => format!("# error\n{e}\n"),
    };
    let failure = |message| {
        Some(Failure {
            line: snap.line,
            message,
            diff: None,
        })
    };
    if update {
        let path = match at.confined.writable(at.dir, snap) {
            Ok(p) => p,
            Err(message) => return failure(message),
        };
        return match std::fs::write(&path, &text) {
            Ok(()) => None,
            Err(e) => failure(format!("cannot write {}: {e}", snap.value)),
        };
    }
    // A snapshot not written yet compares as empty; one the repository does not allow is
    // refused, and its text never printed.
    let old = match at.confined.read(at.dir, snap) {
        Ok(old) => old,
        Err(_) if at.confined.writable(at.dir, snap).is_ok() => String::new(),
        Err(message) => return failure(message),
    };
    (old != text).then(|| Failure {
        line: snap.line,
        message: format!(
            "differs from the snapshot {} (rulebook test --update writes it)",
            snap.value
        ),
        diff: Some(super::unified_diff("expected", "actual", &old, &text)),
    })
}

fn check(expect: &Expect, outcome: &Outcome, at: u64, failures: &mut Vec<Failure>) {
    let (children, status) = match (outcome, &expect.error) {
        (Err(e), Some(want)) => {
            if !e.contains(&want.value) {
                failures.push(Failure {
                    line: want.line,
                    message: format!("expected an error containing {:?}, got: {e}", want.value),
                    diff: None,
                });
            }
            return;
        }
        (Err(e), None) => {
            failures.push(Failure {
                line: at,
                message: format!("unexpected error: {e}"),
                diff: None,
            });
            return;
        }
        (Ok(_), Some(want)) => {
            failures.push(Failure {
                line: want.line,
                message: format!(
                    "expected an error containing {:?}, but the step rendered",
                    want.value
                ),
                diff: None,
            });
            return;
        }
        (Ok((c, s)), None) => (c, s),
    };
    if let Some(count) = &expect.count
        && children.len() != count.value
    {
        let names: Vec<String> = children.iter().map(display).collect();
        failures.push(Failure {
            line: count.line,
            message: format!(
                "expected {} children, got {}: {}",
                count.value,
                children.len(),
                names.join(", ")
            ),
            diff: None,
        });
    }
    for want in &expect.children {
        failures.extend(check_child(want, children));
    }
    if let Some(want) = &expect.status {
        let problems = matching::mismatches(&want.value, status);
        if !problems.is_empty() {
            failures.push(Failure {
                line: want.line,
                message: format!("status: {}", problems.join("; ")),
                diff: Some(super::unified_diff(
                    "expected",
                    "actual",
                    &to_yaml(&want.value).unwrap_or_default(),
                    &to_yaml(&matching::project(&want.value, status)).unwrap_or_default(),
                )),
            });
        }
    }
}

/// An expected child no rendered child matches: the closest one's differences (same kind,
/// and name if the expectation has one; fewest differences), or that none is like it.
fn check_child(want: &crate::rules::Loc<Json>, children: &[Json]) -> Option<Failure> {
    if children
        .iter()
        .any(|c| matching::mismatches(&want.value, c).is_empty())
    {
        return None;
    }
    let same = |c: &&Json| {
        ["kind", "apiVersion"]
            .iter()
            .all(|k| want.value.get(*k).is_none_or(|v| c.get(*k) == Some(v)))
            && want
                .value
                .pointer("/metadata/name")
                .is_none_or(|n| c.pointer("/metadata/name") == Some(n))
    };
    let best = children
        .iter()
        .filter(same)
        .min_by_key(|c| matching::mismatches(&want.value, c).len());
    Some(match best {
        Some(c) => Failure {
            line: want.line,
            message: format!(
                "{}: {}",
                display(c),
                matching::mismatches(&want.value, c).join("; ")
            ),
            diff: Some(super::unified_diff(
                "expected",
                "actual",
                &to_yaml(&want.value).unwrap_or_default(),
                &to_yaml(&matching::project(&want.value, c)).unwrap_or_default(),
            )),
        },
        None => {
            let names: Vec<String> = children.iter().map(display).collect();
            Failure {
                line: want.line,
                message: format!(
                    "no rendered child is {}; rendered: {}",
                    display(&want.value),
                    names.join(", ")
                ),
                diff: None,
            }
        }
    })
}

/// `Kind/name` of an object.
fn display(o: &Json) -> String {
    format!(
        "{}/{}",
        o.get("kind").and_then(Json::as_str).unwrap_or("?"),
        o.pointer("/metadata/name")
            .and_then(Json::as_str)
            .unwrap_or("?")
    )
}

/// `o` without the annotations that change with every rule edit (rule version, desired
/// hash), so a snapshot changes only when the object does.
fn without_own_annotations(o: &Json) -> Json {
    let mut o = o.clone();
    super::strip_annotations(&mut o, crate::meta::labels::PER_RULE_VERSION);
    o
}
