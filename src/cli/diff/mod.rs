//! `rulebook diff`: what the rule set on disk (a pull request's checkout) would do to the
//! objects in a cluster now. For every existing parent of every rule: its live children
//! (listed once per kind), a render against them, a server-side **dry-run** apply of each
//! rendered child (so the API server's defaulting and admission decide what the object
//! would become), and a unified diff of each object that would change, be created, be
//! pruned or orphaned, and of the parent's status.
//!
//! A pull request's rules are untrusted code run with the diff's credential, so:
//! everything printed is cleaned of every Secret value the run saw ([`clean`]); with
//! `--base-rules`, a reference may only read what the base branch's rule of the same name
//! reads for the same parent ([`base`]), and no Secret child is read at all (its values
//! would reach the templates); the role `rulebook rbac --diff-role` prints grants no Secret
//! read beyond the references' ([`crate::rbac`]).
//!
//! Read-only by construction: the client's write gate never opens, so only reads and dry
//! runs reach the API server. Exit 0 when nothing would change, 1 when something would,
//! 2 on an error (a parent that does not render, a conflict, a refused reference).

mod base;
mod clean;
mod compare;
mod parent;
mod plan;
mod refs;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::Value as Json;

use super::{RuleDirs, load_or_report};
use crate::cache::wire::remote_owner;
use crate::engine::{kind_api, resolve_kind};
use crate::meta::labels;
use crate::metrics::Metrics;
use crate::reconcile::plan::is_child_of;
use crate::render::{CompiledRule, RuleSet};
use crate::write::gate::LeaseGate;
use clean::Redactor;

#[derive(Args, Debug)]
pub struct DiffArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Only this rule (default: every rule).
    #[arg(long)]
    pub rule: Option<String>,
    /// Only parents in this namespace (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Only parents with these labels.
    #[arg(long)]
    pub selector: Option<String>,
    /// `text` (diffs and a summary per rule) or `json`.
    #[arg(short = 'o', long, default_value = "text", value_parser = ["text", "json"])]
    pub output: String,
    /// Parents evaluated at once.
    #[arg(long, default_value_t = 16)]
    pub concurrency: usize,
    /// The rules directory of the base branch (a checkout of it): each reference may only
    /// read what the base rule of the same name reads for the same parent, and no Secret
    /// child is read. For pull requests from people who may not read what the diff's
    /// credential can.
    #[arg(long)]
    pub base_rules: Option<PathBuf>,
    /// The base branch's templates directory (default: `templates` beside `--base-rules`).
    #[arg(long, requires = "base_rules")]
    pub base_templates: Option<PathBuf>,
    /// With `--base-rules`: read references the base rules do not read (and Secret parents)
    /// all the same. Secret children are still not read.
    #[arg(long, requires = "base_rules")]
    pub allow_new_references: bool,
}

/// A rendered child that was not compared (a Secret `diff` does not read).
#[derive(Debug, Serialize)]
pub struct NotCompared {
    pub parent: String,
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
    pub why: String,
}

/// One object that would change.
#[derive(Debug, Serialize)]
pub struct ObjectChange {
    /// `Kind namespace/name` of the parent.
    pub parent: String,
    /// `created`, `changed`, `pruned` or `orphaned`.
    pub change: &'static str,
    pub kind: String,
    pub namespace: Option<String>,
    pub name: String,
    /// Filled in when the output is printed, from `sides`.
    pub diff: String,
    #[serde(skip)]
    sides: compare::Sides,
}

/// What would happen to one rule's parents and children.
#[derive(Debug, Default, Serialize)]
pub struct RuleReport {
    pub rule: String,
    pub parents: usize,
    pub unchanged: usize,
    /// Unchanged but for Rulebook's own annotations (rule version, desired hash): the
    /// operator re-applies these after the change.
    pub annotations_only: usize,
    pub changed: usize,
    pub created: usize,
    pub pruned: usize,
    pub orphaned: usize,
    pub status_changed: usize,
    /// `(parent, error)`: parents that would not render, or whose dry run failed.
    pub errors: Vec<(String, String)>,
    pub objects: Vec<ObjectChange>,
    /// `(parent, diff)` of the status Rulebook would write.
    pub statuses: Vec<(String, String)>,
    /// Rendered children not compared: Secrets `diff` does not read.
    pub not_compared: Vec<NotCompared>,
    /// With `spec.rollout`, when parents would change version: who moves in which batch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout: Option<plan::RolloutPlan>,
    /// Every Secret value read or rendered, for cleaning the output.
    #[serde(skip)]
    seen: BTreeSet<String>,
    /// `statuses`, until the output is printed.
    #[serde(skip)]
    status_sides: Vec<(String, compare::Sides)>,
}

impl RuleReport {
    fn changes(&self) -> bool {
        self.changed + self.created + self.pruned + self.orphaned + self.status_changed > 0
    }
}

/// Runs `rulebook diff`; returns the exit code. Everything it prints, on standard output
/// and standard error, is cleaned of the Secret values the run read or rendered first.
pub async fn diff(args: &DiffArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(2);
    };
    let base = match load_base(args, err)? {
        Base::Unchecked => None,
        Base::Loaded(base) => Some(base),
        Base::Invalid => return Ok(2),
    };
    let config = crate::operator::client_config(args.kubeconfig.as_ref(), "diff").await?;
    // A gate that never opens: only reads and dry runs pass the client.
    let client = crate::operator::gated_client(
        config,
        Arc::new(LeaseGate::leased()),
        Arc::new(Metrics::new()),
    )
    .context("cannot build the API client")?;
    let rules: Vec<&Arc<CompiledRule>> = match &args.rule {
        Some(name) => match set.rules.get(name) {
            Some(r) => vec![r],
            None => anyhow::bail!("no rule named '{name}'"),
        },
        None => set.rules.values().collect(),
    };
    let mut reports = Vec::new();
    let mut failures = Vec::new();
    for rule in rules {
        let base = base.as_ref().map(|b| b.rules.get(&rule.name).cloned());
        match diff_rule(&client, rule, base, args, err).await {
            Ok(r) => reports.push(r),
            Err(e) => failures.push(format!("rule '{}': {e:#}", rule.name)),
        }
    }
    let errors = !failures.is_empty() || reports.iter().any(|r| !r.errors.is_empty());
    let changes = reports.iter().any(RuleReport::changes);
    print(reports, &failures, args, out, err)?;
    Ok(if errors {
        2
    } else if changes {
        1
    } else {
        0
    })
}

/// `--base-rules`, read.
enum Base {
    /// None given.
    Unchecked,
    Loaded(RuleSet),
    /// Given, and not valid (its errors printed).
    Invalid,
}

fn load_base(args: &DiffArgs, err: &mut dyn Write) -> Result<Base> {
    let Some(rules) = &args.base_rules else {
        writeln!(
            err,
            "rulebook diff: references are not checked against a base (no --base-rules): \
             the rules read whatever this credential can; run it only on rules you trust"
        )?;
        return Ok(Base::Unchecked);
    };
    // As `RuleDirs` defaults them: `templates` beside the rules.
    let templates = args
        .base_templates
        .clone()
        .unwrap_or_else(|| rules.parent().unwrap_or(Path::new("")).join("templates"));
    let dirs = RuleDirs {
        rules: rules.clone(),
        templates,
        // The base is read with the head's default rollout: what changes is the rules.
        default_rollout: args.dirs.default_rollout.clone(),
    };
    Ok(match load_or_report(&dirs, err)? {
        Some(base) => Base::Loaded(base),
        None => {
            writeln!(
                err,
                "rulebook diff: the base rules ({}) do not load",
                rules.display()
            )?;
            Base::Invalid
        }
    })
}

/// The reports and the rules that failed, on `out` and `err`, cleaned of every Secret
/// value any report saw: the objects and statuses before they become YAML, then all of
/// the text.
fn print(
    mut reports: Vec<RuleReport>,
    failures: &[String],
    args: &DiffArgs,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<()> {
    let seen: BTreeSet<String> = reports
        .iter()
        .flat_map(|r| r.seen.iter().cloned())
        .collect();
    let clean = Redactor::new(&seen);
    for r in &mut reports {
        for o in &mut r.objects {
            o.diff = o.sides.diff(&clean);
        }
        r.statuses = r
            .status_sides
            .iter()
            .map(|(parent, s)| (parent.clone(), s.diff(&clean)))
            .collect();
    }
    for f in failures {
        writeln!(err, "{}", clean.text(f))?;
    }
    if args.output == "json" {
        let json = clean.json(serde_json::to_value(&reports)?);
        writeln!(out, "{}", serde_json::to_string_pretty(&json)?)?;
    } else {
        let mut text = String::new();
        for r in &reports {
            print_report(r, &mut text);
        }
        write!(out, "{}", clean.text(&text))?;
    }
    Ok(())
}

fn print_report(r: &RuleReport, out: &mut String) {
    use std::fmt::Write;
    for o in &r.objects {
        let _ = writeln!(out, "# {} of {}: {}", o.change, o.parent, o.kind);
        out.push_str(&o.diff);
    }
    for (parent, d) in &r.statuses {
        let _ = writeln!(out, "# status of {parent}");
        out.push_str(d);
    }
    for (parent, e) in &r.errors {
        let _ = writeln!(out, "# error: {parent}: {e}");
    }
    if let Some(p) = &r.rollout {
        plan::print(&r.rule, p, out);
    }
    let _ = writeln!(
        out,
        "rule {}: {} parents; children: {} unchanged, {} changed, {} created, {} pruned, {} orphaned, \
         {} not compared ({} re-applied for Rulebook's annotations only); status: {} changed; errors: {}",
        r.rule,
        r.parents,
        r.unchanged,
        r.changed,
        r.created,
        r.pruned,
        r.orphaned,
        r.not_compared.len(),
        r.annotations_only,
        r.status_changed,
        r.errors.len()
    );
}

/// A rule's kinds, as discovery has them.
struct Kinds {
    parent: (ApiResource, bool),
    /// Distinct child kinds.
    children: Vec<(ApiResource, bool)>,
    /// Child index in the rule → index in `children`.
    of_child: Vec<usize>,
    /// Each reference's kind, in rule order.
    refs: Vec<(ApiResource, bool)>,
    /// Child kinds (index in `children`) whose objects are not read, with why: Secrets,
    /// in a pull request's diff or when the credential may not list them.
    not_read: BTreeMap<usize, String>,
    /// `--base-rules` (without `--allow-new-references`): what the references are
    /// checked against.
    base: Option<refs::Base>,
}

impl Kinds {
    /// Whether child kind `k` is `v1` `Secret`.
    fn is_secret(&self, k: usize) -> bool {
        self.children.get(k).is_some_and(|(ar, _)| is_secret(ar))
    }

    async fn resolve(client: &Client, rule: &CompiledRule) -> Result<Kinds> {
        let p = &rule.rule.spec.parent;
        let parent = resolve_kind(client, "parent", &p.api_version, &p.kind).await?;
        let mut children: Vec<(ApiResource, bool)> = Vec::new();
        let mut of_child = Vec::new();
        for c in rule.children() {
            let found = children.iter().position(|(ar, _)| {
                ar.api_version == c.api_version.value && ar.kind == c.kind.value
            });
            let i = match found {
                Some(i) => i,
                None => {
                    children.push(resolve_kind(client, "child", &c.api_version, &c.kind).await?);
                    children.len() - 1
                }
            };
            of_child.push(i);
        }
        Ok(Kinds {
            parent,
            children,
            of_child,
            refs: refs::resolve(client, rule).await?,
            not_read: BTreeMap::new(),
            base: None,
        })
    }
}

fn is_secret(ar: &ApiResource) -> bool {
    ar.group.is_empty() && ar.kind == "Secret"
}

/// Why a pull request's diff reads no Secret child.
const NOT_READ_IN_PR: &str = "a pull request's diff (--base-rules) never reads a Secret child: its templates could print the values";

/// `base`: with `--base-rules`, the base branch's rule of this name (`None` inside: new
/// in the pull request).
async fn diff_rule(
    client: &Client,
    rule: &CompiledRule,
    base: Option<Option<Arc<CompiledRule>>>,
    args: &DiffArgs,
    err: &mut dyn Write,
) -> Result<RuleReport> {
    let mut kinds = Kinds::resolve(client, rule).await?;
    if let Some(base_rule) = base {
        if !args.allow_new_references {
            let base_parent = base_rule.as_ref().map(|b| &b.rule.spec.parent);
            let same_parent = base_parent.is_some_and(|b| {
                b.api_version.value == rule.rule.spec.parent.api_version.value
                    && b.kind.value == rule.rule.spec.parent.kind.value
            });
            if is_secret(&kinds.parent.0) && !same_parent {
                anyhow::bail!(
                    "its parents are Secrets, which the base rules do not read; refused (--allow-new-references)"
                );
            }
            kinds.base = Some(refs::Base::resolve(client, base_rule).await);
        }
        for k in 0..kinds.children.len() {
            if kinds.is_secret(k) {
                kinds.not_read.insert(k, NOT_READ_IN_PR.to_string());
            }
        }
    }
    let parents = list_all(
        &kind_api(
            client,
            &kinds.parent.0,
            kinds.parent.1,
            args.namespace.as_deref(),
        ),
        args.selector.as_deref(),
    )
    .await?;
    let owned = list_children(client, rule, &mut kinds, args).await?;
    let mut report = RuleReport {
        rule: rule.name.clone(),
        parents: parents.len(),
        rollout: plan::plan(rule, &parents),
        ..RuleReport::default()
    };
    let total = parents.len();
    let progress = std::io::stderr().is_terminal();
    let kinds = &kinds;
    let owned = &owned;
    let mut results = futures::stream::iter(parents.iter())
        .map(|p| async move {
            let uid = p.uid().unwrap_or_default();
            let live = owned.get(&uid).map(Vec::as_slice).unwrap_or(&[]);
            parent::diff_parent(client, rule, kinds, p, live).await
        })
        .buffer_unordered(args.concurrency.max(1));
    let mut done = 0;
    while let Some(one) = results.next().await {
        done += 1;
        if progress {
            write!(err, "\r{}: {done}/{total} parents", rule.name)?;
        }
        report.add(one);
    }
    if progress && total > 0 {
        writeln!(err)?;
    }
    let key = |o: &ObjectChange| (o.parent.clone(), o.kind.clone(), o.name.clone());
    report.objects.sort_by_key(key);
    report.status_sides.sort_by(|a, b| a.0.cmp(&b.0));
    report.errors.sort();
    report
        .not_compared
        .sort_by(|a, b| (&a.parent, &a.name).cmp(&(&b.parent, &b.name)));
    Ok(report)
}

impl RuleReport {
    fn add(&mut self, one: parent::ParentDiff) {
        self.unchanged += one.unchanged;
        self.annotations_only += one.annotations_only;
        for o in one.objects {
            match o.change {
                "created" => self.created += 1,
                "changed" => self.changed += 1,
                "pruned" => self.pruned += 1,
                _ => self.orphaned += 1,
            }
            self.objects.push(o);
        }
        if let Some(s) = one.status {
            self.status_changed += 1;
            self.status_sides.push((one.parent.clone(), s));
        }
        self.not_compared.extend(one.not_compared);
        self.seen.extend(one.seen);
        self.errors.extend(one.error.map(|e| (one.parent, e)));
    }
}

/// The rule's live children, listed once per kind, by owner UID. A Secret kind the
/// credential may not list is not read (`kinds.not_read`), nor compared.
async fn list_children(
    client: &Client,
    rule: &CompiledRule,
    kinds: &mut Kinds,
    args: &DiffArgs,
) -> Result<HashMap<String, Vec<(usize, DynamicObject)>>> {
    let selector = labels::child_selector(&rule.name);
    let mut owned: HashMap<String, Vec<(usize, DynamicObject)>> = HashMap::new();
    let within = if kinds.parent.1 {
        args.namespace.as_deref()
    } else {
        None
    };
    for k in 0..kinds.children.len() {
        if kinds.not_read.contains_key(&k) {
            continue;
        }
        let (ar, namespaced) = &kinds.children[k];
        let api = kind_api(
            client,
            ar,
            *namespaced,
            if *namespaced { within } else { None },
        );
        let objects = match list_all(&api, Some(&selector)).await {
            Ok(objects) => objects,
            Err(kube::Error::Api(e)) if e.code == 403 && kinds.is_secret(k) => {
                kinds.not_read.insert(
                    k,
                    "the credential may not list Secrets (the diff role grants none)".into(),
                );
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        for o in objects {
            if let Some(uid) = o.labels().get(labels::OWNER).cloned()
                && (is_child_of(&o, &uid) || remote_owner(&o.metadata) == Some(uid.as_str()))
            {
                owned.entry(uid).or_default().push((k, o));
            }
        }
    }
    Ok(owned)
}

/// Every object of `api` (with the label selector), a page at a time.
async fn list_all(
    api: &Api<DynamicObject>,
    selector: Option<&str>,
) -> Result<Vec<DynamicObject>, kube::Error> {
    let mut params = ListParams::default().limit(500);
    if let Some(s) = selector {
        params = params.labels(s);
    }
    let mut all = Vec::new();
    loop {
        let page = api.list(&params).await?;
        all.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(all),
        }
    }
}

/// `o` as JSON with its apiVersion and kind (items of a list come without them).
/// The object as the operator's reconcile gives it to a rule: with its `apiVersion` and
/// `kind`, without `metadata.managedFields`.
fn typed(o: &DynamicObject, ar: &ApiResource) -> Option<Json> {
    let mut j = serde_json::to_value(o).ok()?;
    let map = j.as_object_mut()?;
    if let Some(Json::Object(meta)) = map.get_mut("metadata") {
        meta.remove("managedFields");
    }
    map.insert("apiVersion".into(), Json::from(ar.api_version.clone()));
    map.insert("kind".into(), Json::from(ar.kind.clone()));
    Some(j)
}

fn display(kind: &str, ns: Option<&str>, name: &str) -> String {
    match ns {
        Some(ns) => format!("{kind} {ns}/{name}"),
        None => format!("{kind} {name}"),
    }
}
