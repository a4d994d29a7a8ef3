//! `rulebook diff`: what the rule set on disk (a pull request's checkout) would do to the
//! objects in a cluster now. For every existing parent of every rule: its live children
//! (listed once per kind), a render against them, a server-side **dry-run** apply of each
//! rendered child (so the API server's defaulting and admission decide what the object
//! would become), and a unified diff of each object that would change, be created, be
//! pruned or orphaned, and of the parent's status. Secret values are never printed.
//!
//! Read-only by construction: the client's write gate never opens, so only reads and dry
//! runs reach the API server. Exit 0 when nothing would change, 1 when something would,
//! 2 on an error (a parent that does not render counts as one).

mod compare;
mod refs;

use std::collections::{BTreeSet, HashMap};
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::Args;
use futures::StreamExt;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams};
use kube::{Client, ResourceExt};
use serde::Serialize;
use serde_json::Value as Json;

use super::{RuleDirs, load_or_report, to_yaml, unified_diff};
use crate::engine::{kind_api, resolve_kind};
use crate::meta::{FIELD_MANAGER, labels};
use crate::metrics::Metrics;
use crate::reconcile::gate::LeaseGate;
use crate::reconcile::plan::{is_child_of, may_adopt, owner_description};
use crate::reconcile::writer::apply_body;
use crate::render::redact as redact_secrets;
use crate::render::{CompiledRule, Observed, Scope};
use crate::rules::DeletionPolicy;
use compare::{normalize, redact, status_diff};

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
    pub diff: String,
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
}

impl RuleReport {
    fn changes(&self) -> bool {
        self.changed + self.created + self.pruned + self.orphaned + self.status_changed > 0
    }
}

/// Runs `rulebook diff`; returns the exit code.
pub async fn diff(args: &DiffArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(2);
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
    let mut failed = false;
    for rule in rules {
        match diff_rule(&client, rule, args, err).await {
            Ok(r) => reports.push(r),
            Err(e) => {
                writeln!(err, "rule '{}': {e:#}", rule.name)?;
                failed = true;
            }
        }
    }
    if args.output == "json" {
        writeln!(out, "{}", serde_json::to_string_pretty(&reports)?)?;
    } else {
        for r in &reports {
            print_report(r, out)?;
        }
    }
    let errors = failed || reports.iter().any(|r| !r.errors.is_empty());
    Ok(if errors {
        2
    } else if reports.iter().any(RuleReport::changes) {
        1
    } else {
        0
    })
}

fn print_report(r: &RuleReport, out: &mut dyn Write) -> Result<()> {
    for o in &r.objects {
        writeln!(out, "# {} of {}: {}", o.change, o.parent, o.kind)?;
        write!(out, "{}", o.diff)?;
    }
    for (parent, d) in &r.statuses {
        writeln!(out, "# status of {parent}")?;
        write!(out, "{d}")?;
    }
    for (parent, e) in &r.errors {
        writeln!(out, "# error: {parent}: {e}")?;
    }
    writeln!(
        out,
        "rule {}: {} parents; children: {} unchanged, {} changed, {} created, {} pruned, {} orphaned \
         ({} re-applied for Rulebook's annotations only); status: {} changed; errors: {}",
        r.rule,
        r.parents,
        r.unchanged,
        r.changed,
        r.created,
        r.pruned,
        r.orphaned,
        r.annotations_only,
        r.status_changed,
        r.errors.len()
    )?;
    Ok(())
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
}

async fn diff_rule(
    client: &Client,
    rule: &CompiledRule,
    args: &DiffArgs,
    err: &mut dyn Write,
) -> Result<RuleReport> {
    let p = &rule.rule.spec.parent;
    let parent = resolve_kind(client, "parent", &p.api_version, &p.kind).await?;
    let mut children: Vec<(ApiResource, bool)> = Vec::new();
    let mut of_child = Vec::new();
    for c in rule.children() {
        let found = children
            .iter()
            .position(|(ar, _)| ar.api_version == c.api_version.value && ar.kind == c.kind.value);
        let i = match found {
            Some(i) => i,
            None => {
                children.push(resolve_kind(client, "child", &c.api_version, &c.kind).await?);
                children.len() - 1
            }
        };
        of_child.push(i);
    }
    let kinds = Kinds {
        parent,
        children,
        of_child,
        refs: refs::resolve(client, rule).await?,
    };
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
    // The rule's live children, listed once per kind, by owner UID.
    let selector = labels::child_selector(&rule.name);
    let mut owned: HashMap<String, Vec<(usize, DynamicObject)>> = HashMap::new();
    let within = if kinds.parent.1 {
        args.namespace.as_deref()
    } else {
        None
    };
    for (k, (ar, namespaced)) in kinds.children.iter().enumerate() {
        let api = kind_api(
            client,
            ar,
            *namespaced,
            if *namespaced { within } else { None },
        );
        for o in list_all(&api, Some(&selector)).await? {
            if let Some(uid) = o.labels().get(labels::OWNER).cloned()
                && is_child_of(&o, &uid)
            {
                owned.entry(uid).or_default().push((k, o));
            }
        }
    }
    let mut report = RuleReport {
        rule: rule.name.clone(),
        parents: parents.len(),
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
            diff_parent(client, rule, kinds, p, live).await
        })
        .buffer_unordered(args.concurrency.max(1));
    let mut done = 0;
    while let Some(one) = results.next().await {
        done += 1;
        if progress {
            write!(err, "\r{}: {done}/{total} parents", rule.name)?;
        }
        report.unchanged += one.unchanged;
        report.annotations_only += one.annotations_only;
        for o in one.objects {
            match o.change {
                "created" => report.created += 1,
                "changed" => report.changed += 1,
                "pruned" => report.pruned += 1,
                _ => report.orphaned += 1,
            }
            report.objects.push(o);
        }
        if let Some(s) = one.status {
            report.status_changed += 1;
            report.statuses.push(s);
        }
        report.errors.extend(one.error.map(|e| (one.parent, e)));
    }
    if progress && total > 0 {
        writeln!(err)?;
    }
    let key = |o: &ObjectChange| (o.parent.clone(), o.kind.clone(), o.name.clone());
    report.objects.sort_by_key(key);
    report.statuses.sort();
    report.errors.sort();
    Ok(report)
}

/// Every object of `api` (with the label selector), a page at a time.
async fn list_all(api: &Api<DynamicObject>, selector: Option<&str>) -> Result<Vec<DynamicObject>> {
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

/// What one parent would see.
struct ParentDiff {
    parent: String,
    unchanged: usize,
    annotations_only: usize,
    objects: Vec<ObjectChange>,
    status: Option<(String, String)>,
    error: Option<String>,
}

async fn diff_parent(
    client: &Client,
    rule: &CompiledRule,
    kinds: &Kinds,
    parent: &DynamicObject,
    live: &[(usize, DynamicObject)],
) -> ParentDiff {
    let ns = parent.namespace();
    let name = match &ns {
        Some(ns) => format!("{} {ns}/{}", kinds.parent.0.kind, parent.name_any()),
        None => format!("{} {}", kinds.parent.0.kind, parent.name_any()),
    };
    let mut d = ParentDiff {
        parent: name,
        unchanged: 0,
        annotations_only: 0,
        objects: Vec::new(),
        status: None,
        error: None,
    };
    if parent.metadata.deletion_timestamp.is_some() {
        return d; // the operator renders nothing for a parent being deleted
    }
    let uid = parent.uid().unwrap_or_default();
    // With its apiVersion and kind (list items of built-in kinds come without them).
    let Some(parent_json) = typed(parent, &kinds.parent.0) else {
        d.error = Some("the parent cannot be read".into());
        return d;
    };
    // As the operator reads them: a namespaced parent's children only in its namespace
    // (an object elsewhere claiming its UID is someone else's); a cluster-scoped parent's
    // only in the namespaces its render places children in.
    let mut live: Vec<&(usize, DynamicObject)> = live
        .iter()
        .filter(|(k, o)| !kinds.parent.1 || !kinds.children[*k].1 || o.namespace() == ns)
        .collect();
    let scope = |i: usize| match kinds.of_child.get(i).map(|k| kinds.children[*k].1) {
        Some(false) => Scope::Cluster,
        _ => Scope::Namespaced,
    };
    let found = match refs::dereference(client, rule, kinds, &parent_json).await {
        Ok(found) => found,
        Err(e) => {
            d.error = Some(e);
            return d;
        }
    };
    let render = |live: &[&(usize, DynamicObject)]| {
        let objects = live
            .iter()
            .filter_map(|(k, o)| typed(o, &kinds.children[*k].0));
        let mut observed = Observed::from_objects(objects);
        observed.refs = found.clone();
        let desired = rule.render(&parent_json, &observed, &scope);
        (observed, desired)
    };
    let (mut observed, mut desired) = render(&live);
    if !kinds.parent.1
        && let Ok(rendered) = &desired
    {
        let places: BTreeSet<String> = rendered
            .iter()
            .filter_map(|c| {
                c.object
                    .pointer("/metadata/namespace")
                    .and_then(Json::as_str)
            })
            .map(str::to_string)
            .collect();
        let before = live.len();
        live.retain(|(k, o)| {
            !kinds.children[*k].1 || o.namespace().is_some_and(|n| places.contains(&n))
        });
        if live.len() != before {
            (observed, desired) = render(&live);
        }
    }
    // Error lines go to CI logs: Secret values the parent's objects hold (references,
    // children as they are and as they would be) are taken out, as the operator takes
    // them out of conditions and events.
    let desired = match desired {
        Ok(desired) => desired,
        Err(e) => {
            d.error = Some(redact_secrets(&e.to_string(), &observed.secret_values()));
            return d;
        }
    };
    let secrets = observed.secret_values_with(&desired);
    let mut wanted = BTreeSet::new();
    for child in &desired {
        let (ar, namespaced) = &kinds.children[kinds.of_child[child.child]];
        let child_ns = namespaced.then(|| {
            child
                .object
                .pointer("/metadata/namespace")
                .and_then(Json::as_str)
                .map(str::to_string)
                .or(ns.clone())
        });
        let child_ns = child_ns.flatten();
        let child_name = child.object_name().to_string();
        wanted.insert((
            kinds.of_child[child.child],
            child_ns.clone(),
            child_name.clone(),
        ));
        let api = kind_api(client, ar, *namespaced, child_ns.as_deref());
        let current = match live.iter().find(|(k, o)| {
            *k == kinds.of_child[child.child]
                && o.namespace() == child_ns
                && o.name_any() == child_name
        }) {
            Some((_, o)) => Some(o.clone()),
            None => match api.get_opt(&child_name).await {
                // Someone else's object: the operator leaves it alone (a conflict), unless
                // the child may adopt it.
                Ok(Some(o))
                    if !is_child_of(&o, &uid)
                        && !may_adopt(rule.children()[child.child].adopt, &o, &uid) =>
                {
                    d.error = Some(format!(
                        "conflict: {} {child_name} {}; Rulebook would leave it alone",
                        ar.kind,
                        owner_description(&o)
                    ));
                    continue;
                }
                Ok(o) => o,
                Err(e) => {
                    d.error = Some(format!("reading {} {child_name}: {e}", ar.kind));
                    return d;
                }
            },
        };
        let params = PatchParams::apply(FIELD_MANAGER).force().dry_run();
        let after = match api
            .patch(
                &child_name,
                &params,
                &Patch::Apply(apply_body(&child.object)),
            )
            .await
        {
            Ok(o) => o,
            Err(e) => {
                let e = redact_secrets(&e.to_string(), &secrets);
                d.error = Some(format!("dry-run apply of {} {child_name}: {e}", ar.kind));
                return d;
            }
        };
        let before = current.as_ref().and_then(|o| typed(o, ar));
        let after = serde_json::to_value(&after).ok();
        let (b, a) = (
            before.as_ref().map(normalize),
            after.as_ref().map(normalize),
        );
        if b.is_some() && b == a {
            d.unchanged += 1;
            if before.as_ref().map(|o| &o["metadata"]["annotations"])
                != after.as_ref().map(|o| &o["metadata"]["annotations"])
            {
                d.annotations_only += 1;
            }
            continue;
        }
        let (b, a) = redact(b.as_ref(), a.as_ref());
        let what = display(&ar.kind, child_ns.as_deref(), &child_name);
        let text = |o: &Option<Json>| o.as_ref().and_then(|o| to_yaml(o).ok()).unwrap_or_default();
        let change = if b.is_some() { "changed" } else { "created" };
        d.objects.push(ObjectChange {
            parent: d.parent.clone(),
            change,
            kind: ar.kind.clone(),
            namespace: child_ns.clone(),
            name: child_name.clone(),
            diff: unified_diff(
                &format!("{what} (live)"),
                &format!("{what} (rendered)"),
                &text(&b),
                &text(&a),
            ),
        });
    }
    // Live children no longer rendered: pruned, or orphaned by their policy.
    for (k, o) in live.iter().copied() {
        let key = (*k, o.namespace(), o.name_any());
        if wanted.contains(&key) {
            continue;
        }
        let orphan = o
            .labels()
            .get(labels::CHILD)
            .and_then(|c| rule.children().iter().find(|x| &x.name.value == c))
            .is_some_and(|c| c.deletion_policy == DeletionPolicy::Orphan);
        let (ar, _) = &kinds.children[*k];
        let json = typed(o, ar).map(|j| normalize(&j));
        let (b, _) = redact(json.as_ref(), None);
        let what = display(&ar.kind, o.namespace().as_deref(), &o.name_any());
        let before = b.as_ref().and_then(|o| to_yaml(o).ok()).unwrap_or_default();
        d.objects.push(ObjectChange {
            parent: d.parent.clone(),
            change: if orphan { "orphaned" } else { "pruned" },
            kind: ar.kind.clone(),
            namespace: o.namespace(),
            name: o.name_any(),
            diff: unified_diff(&format!("{what} (live)"), "/dev/null", &before, ""),
        });
    }
    match status_diff(rule, &parent_json, &observed, &desired, &d.parent) {
        Ok(s) => d.status = s,
        Err(e) => d.error = d.error.take().or(Some(redact_secrets(&e, &secrets))),
    }
    d
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
