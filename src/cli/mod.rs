//! The `rulebook` command line: subcommands and their output. Everything here but
//! `run` works without a cluster.

pub mod cel_dry_run;
pub mod diff;
pub mod git_args;
pub mod observed;
pub mod release;
pub mod rollout;
pub mod roundtrip;
pub mod ruletest;
pub mod schemas;
pub mod webhook_args;

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use serde_json::Value as Json;

use crate::render::RuleSet;
use crate::render::{Limits, Scope, status};
use crate::rules;

#[derive(Parser, Debug)]
#[command(
    name = "rulebook",
    version,
    about = "A Kubernetes operator driven by rule files"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Validate the rules and templates; exit 1 listing every error.
    Check(CheckArgs),
    /// Print the children a parent would get, or the status it would get.
    Render(RenderArgs),
    /// Print the JSON Schema of the rule file format.
    Schema,
    /// Print the CustomResourceDefinitions the rules define.
    Crds(CrdsArgs),
    /// Print a least-privilege ClusterRole and ClusterRoleBinding for the rules.
    Rbac(RbacArgs),
    /// Run the operator against a cluster.
    Run(RunArgs),
    /// What the rules on disk would change in a cluster: a diff per object (dry runs only).
    Diff(diff::DiffArgs),
    /// Run the rules' tests (RuleTest files): render each step, check by subset match.
    Test(ruletest::TestArgs),
    /// Remove Rulebook's finalizer from every parent of a rule (for an uninstall):
    /// their deletion steps will not run; the garbage collector removes the children.
    Release(release::ReleaseArgs),
    /// A rule's progressive rollout in the cluster: status, pause, resume, promote, abort.
    Rollout(rollout::RolloutArgs),
}

/// `rulebook run`: the operator.
#[derive(Args, Debug, Clone)]
pub struct RunArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Kubeconfig file; default: in-cluster config, then $KUBECONFIG, then ~/.kube/config.
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Concurrent reconciles per rule.
    #[arg(long, default_value_t = 4)]
    pub concurrency: u16,
    /// Watch parents in this namespace only (default: all namespaces).
    #[arg(long)]
    pub namespace: Option<String>,
    /// Label selector on parents, e.g. `shard=a` (to run several instances side by side).
    #[arg(long)]
    pub selector: Option<String>,
    /// Address of /metrics, /healthz, /readyz and /status.
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Reload rules and templates when they change on disk.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub watch: bool,
    /// Seconds between full re-scans of the directories (backs up missed file events).
    #[arg(long, default_value_t = 60)]
    pub rescan_seconds: u64,
    /// Apply the CRDs defined in rules at start and on every rule change.
    #[arg(long)]
    pub install_crds: bool,
    /// Only the holder of a Lease reconciles.
    #[arg(long)]
    pub leader_elect: bool,
    #[arg(long, default_value = "rulebook")]
    pub lease_name: String,
    /// Namespace of the Lease (default: the pod's namespace, else `default`).
    #[arg(long, env = "POD_NAMESPACE")]
    pub lease_namespace: Option<String>,
    /// Seconds a lease stays valid without renewal.
    #[arg(long, default_value_t = 15)]
    pub lease_duration: u64,
    /// This instance's identity (default: the pod name, else the host name and pid).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    /// Check each rule's permissions (SelfSubjectAccessReview) before starting it.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pub check_permissions: bool,
    /// MiB of content (parents, children, referenced objects) cached per namespace; objects
    /// beyond it are read on demand.
    #[arg(long, default_value_t = 32)]
    pub cache_namespace_mib: usize,
    /// MiB of content (parents, children, referenced objects) cached in all.
    #[arg(long, default_value_t = 256)]
    pub cache_total_mib: usize,
    /// MiB of reconcile inputs (parents, live children, referenced objects, as cached)
    /// that all reconciles together hold at once; a reconcile waits for room before it
    /// reads its inputs.
    #[arg(long, default_value_t = 64)]
    pub inputs_in_flight_mib: usize,
    /// Objects per second at most that a storage migration rewrites (when a rule's CRD
    /// changes its storage version); 0: as fast as the API server answers.
    #[arg(long, default_value_t = 100)]
    pub migration_rate: u32,
    /// `namespace`: replicas share the parents by the hash of their namespace, each
    /// announcing itself with a Lease (`--lease-name` names the group); replaces
    /// `--leader-elect`.
    #[arg(long, default_value = "off", value_parser = ["off", "namespace"])]
    pub sharding: String,
    /// Where the shard filter is applied: `auto` (by the API server when it supports
    /// `shardSelector`, else here) or `client` (always here; for API servers whose
    /// answer cannot be trusted, and for testing the fallback).
    #[arg(long, default_value = "auto", value_parser = ["auto", "client"])]
    pub shard_filter: String,
    /// Sharded: ranges move for load alone (namespaces filling up or emptying) at most
    /// once per this many seconds; a member joining or leaving moves them at once.
    #[arg(long, default_value_t = 60)]
    pub shard_rebalance_seconds: u64,
    #[command(flatten)]
    pub webhook: Box<webhook_args::WebhookArgs>,
    #[command(flatten)]
    pub git: Box<git_args::GitArgs>,
}

impl RunArgs {
    /// What the operator needs of the command line.
    pub fn settings(&self) -> crate::operator::Settings {
        crate::operator::Settings {
            rules: self.dirs.rules.clone(),
            templates: self.dirs.templates.clone(),
            default_rollout: self.dirs.default_rollout.clone(),
            kubeconfig: self.kubeconfig.clone(),
            concurrency: self.concurrency,
            namespace: self.namespace.clone(),
            selector: self.selector.clone(),
            metrics_addr: self.metrics_addr,
            watch: self.watch,
            rescan_seconds: self.rescan_seconds,
            install_crds: self.install_crds,
            leader_elect: self.leader_elect,
            lease_name: self.lease_name.clone(),
            lease_namespace: self.lease_namespace.clone(),
            lease_duration: self.lease_duration,
            identity: self.identity.clone(),
            check_permissions: self.check_permissions,
            cache_namespace_mib: self.cache_namespace_mib,
            cache_total_mib: self.cache_total_mib,
            inputs_in_flight_mib: self.inputs_in_flight_mib,
            migration_rate: self.migration_rate,
            sharding: self.sharding == "namespace",
            shard_filter_client: self.shard_filter == "client",
            shard_rebalance_seconds: self.shard_rebalance_seconds,
            webhook: self.webhook.settings(self.lease_namespace.as_deref()),
            git: self.git.settings(),
        }
    }
}

#[derive(Args, Debug)]
pub struct CrdsArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Also print the ValidatingWebhookConfiguration and MutatingWebhookConfiguration
    /// `run` generates for the rules' `expr:` checks and defaults (without `caBundle`,
    /// which `run` fills in from its CA).
    #[arg(long)]
    pub webhooks: bool,
    /// How the API server reaches the webhooks, as `run --webhook-url`: written into the
    /// CRDs' conversion and, with `--webhooks`, the webhook configurations.
    #[arg(long, value_parser = webhook_args::url, conflicts_with = "webhook_service")]
    pub webhook_url: Option<crate::webhook::Base>,
    /// As `run --webhook-service`, likewise (with `--webhooks` and neither flag:
    /// `rulebook-system/rulebook-webhook:443`, the Service of deploy/).
    #[arg(long, value_parser = webhook_args::service)]
    pub webhook_service: Option<crate::webhook::Base>,
    /// With `--webhooks`: as `run --webhook-configuration`.
    #[arg(long, default_value = "rulebook")]
    pub webhook_configuration: String,
    /// With `--webhooks`: Rulebook's own namespace, excluded from the webhooks.
    #[arg(long, default_value = "rulebook-system")]
    pub webhook_namespace: String,
}

#[derive(Args, Debug)]
pub struct RbacArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Name of the ClusterRole and ClusterRoleBinding.
    #[arg(long, default_value = "rulebook")]
    pub name: String,
    /// The ServiceAccount to bind, as NAMESPACE/NAME.
    #[arg(long, default_value = "rulebook-system/rulebook")]
    pub service_account: String,
    /// Include what `run --install-crds` needs.
    #[arg(long)]
    pub install_crds: bool,
    /// Include what `run --leader-elect` needs.
    #[arg(long)]
    pub leader_elect: bool,
    /// Include what `run --sharding namespace` needs: every verb on Leases (each member
    /// names its own after its pod). deploy/overlays/sharded uses a namespaced Role
    /// instead.
    #[arg(long)]
    pub sharding: bool,
    /// The Lease of `run --leader-elect` (its `--lease-name`); the only Lease the role may
    /// read or update.
    #[arg(long, default_value = "rulebook")]
    pub lease_name: String,
    /// Print the role `rulebook diff` needs (read, and dry-run apply children) instead;
    /// its default name is then `rulebook-diff`.
    #[arg(long)]
    pub diff_role: bool,
    /// With `--diff-role`: a namespace whose parents' Secret references `rulebook diff`
    /// reads (the Secret part of the role is bound there only); repeat for several.
    #[arg(long = "namespace", requires = "diff_role")]
    pub diff_namespaces: Vec<String>,
    /// Include what `run --webhook-url/--webhook-service` needs: the webhook
    /// configurations by name, and a Role on the certificates' Secret in its namespace.
    #[arg(long)]
    pub webhooks: bool,
    /// With `--webhooks`: `run --webhook-configuration`.
    #[arg(long, default_value = "rulebook")]
    pub webhook_configuration: String,
    /// With `--webhooks`: `run --webhook-secret`.
    #[arg(long, default_value = "rulebook-system/rulebook-webhook", value_parser = webhook_args::namespaced)]
    pub webhook_secret: (String, String),
    /// Also a ServiceAccount, ClusterRole and ClusterRoleBinding per rule with
    /// `spec.serviceAccount` (in the namespace of `--service-account`, which must be the
    /// operator's), holding exactly what that rule needs; the operator's role then keeps
    /// the other rules' grants and `impersonate` on those accounts, by name.
    #[arg(long, conflicts_with = "diff_role")]
    pub per_rule: bool,
    /// Print the operator's roles as a values file of the Helm chart (deploy/helm/rulebook:
    /// `rbac.clusterRules`, `rbac.webhookSecretRules`, `rbac.generatedFor`) instead of
    /// manifests; the chart binds them to its own ServiceAccount.
    #[arg(long, conflicts_with_all = ["diff_role", "per_rule"])]
    pub helm_values: bool,
    /// With `--helm-values`: the rule files and templates too (`ruleset.rules`,
    /// `ruleset.templates`, by path), for the chart's ConfigMap source: the rules the
    /// chart installs and the RBAC granted for them come from one read.
    #[arg(long, requires = "helm_values")]
    pub helm_ruleset: bool,
}

#[derive(Args, Debug, Clone)]
pub struct RuleDirs {
    /// The rules directory (`*.yaml`/`*.yml`, searched recursively).
    #[arg(long, default_value = "rules", env = "RULEBOOK_RULES")]
    pub rules: PathBuf,
    /// The templates directory; a child's `template` is a path below it.
    #[arg(long, default_value = "templates", env = "RULEBOOK_TEMPLATES")]
    pub templates: PathBuf,
    /// A file holding a `spec.rollout` block (`steps`, `gate`, ...): the rollout of every
    /// rule with `spec.crd` and no `spec.rollout` of its own (docs/reference/rollout.md).
    #[arg(long, env = "RULEBOOK_DEFAULT_ROLLOUT")]
    pub default_rollout: Option<PathBuf>,
}

impl RuleDirs {
    /// Reads and validates the rule set; the warnings of the read (skipped files) are
    /// written to `err`, whatever the outcome.
    pub fn load(&self, err: &mut dyn Write) -> Result<Result<RuleSet, rules::Diagnostics>> {
        let read = rules::read(&self.rules, &self.templates)
            .with_default_rollout(self.default_rollout.as_deref());
        for w in &read.warnings {
            writeln!(err, "warning: {w}")?;
        }
        Ok(crate::render::compile_read(&read, &Limits::default()))
    }
}

#[derive(Args, Debug)]
pub struct CheckArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// Also ask this cluster's API server: a server-side dry-run apply of each rule's
    /// generated CRD and admission policies (nothing is stored); and check rendered
    /// children against its OpenAPI schemas (`/openapi/v3`) instead of the built-in ones.
    #[arg(long)]
    pub kubeconfig: Option<PathBuf>,
    #[command(flatten)]
    pub schema: schemas::SchemaArgs,
}

#[derive(Args, Debug)]
pub struct RenderArgs {
    #[command(flatten)]
    pub dirs: RuleDirs,
    /// The parent object (YAML or JSON); its apiVersion and kind pick the rule.
    #[arg(short = 'f', long = "filename")]
    pub parent: PathBuf,
    /// Live children (a multi-document YAML of objects) to render and compute status against:
    /// those labelled `rulebook.dev/child`, and those with a rendered child's apiVersion,
    /// kind and name. Every other object is ignored with a warning.
    #[arg(long)]
    pub observed: Option<PathBuf>,
    /// Print the status Rulebook would write instead of the children.
    #[arg(long)]
    pub status: bool,
    /// Print the rule's admission objects instead of the children: the admission
    /// policies its `cel:` keys generate, and the webhook configurations its `expr:` keys
    /// need (docs/reference/admission-cel.md).
    #[arg(long, conflicts_with = "status")]
    pub admission: bool,
    /// The time to stamp on conditions (RFC 3339); default: now.
    #[arg(long, hide = true)]
    pub now: Option<String>,
    #[command(flatten)]
    pub schema: schemas::SchemaArgs,
}

/// Runs a subcommand that needs no cluster. Returns the process exit code.
pub fn run_offline(command: &Command, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    match command {
        Command::Check(args) => check(args, out, err),
        Command::Render(args) => render(args, out, err),
        Command::Schema => {
            writeln!(out, "{}", schema_json()?)?;
            Ok(0)
        }
        Command::Crds(args) => crds(args, out, err),
        Command::Rbac(args) => rbac(args, out, err),
        Command::Test(args) => ruletest::run(args, out, err),
        Command::Run(_) | Command::Release(_) | Command::Diff(_) | Command::Rollout(_) => {
            bail!("this command needs the async runtime; call it from main")
        }
    }
}

/// Runs a subcommand that talks to a cluster (`diff`, `release`; others as
/// [`run_offline`]). Returns the process exit code.
pub async fn run_online(
    command: &Command,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    match command {
        // An error is exit 2, never 1 ("something would change").
        Command::Diff(args) => match diff::diff(args, out, err).await {
            Ok(code) => Ok(code),
            Err(e) => {
                writeln!(err, "rulebook diff: {e:#}")?;
                Ok(2)
            }
        },
        Command::Release(args) => release::release(args, out, err).await,
        Command::Rollout(args) => rollout::rollout(args, out, err).await,
        Command::Check(args) if args.kubeconfig.is_some() => check_online(args, out, err).await,
        Command::Test(args) if args.kubeconfig.is_some() => {
            ruletest::run_online(args, out, err).await
        }
        other => run_offline(other, out, err),
    }
}

fn load_or_report(dirs: &RuleDirs, err: &mut dyn Write) -> Result<Option<RuleSet>> {
    match dirs.load(err)? {
        Ok(set) => Ok(Some(set)),
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            Ok(None)
        }
    }
}

fn write_stream(objects: &[Json], out: &mut dyn Write) -> Result<()> {
    for (i, o) in objects.iter().enumerate() {
        if i > 0 {
            writeln!(out, "---")?;
        }
        write!(out, "{}", to_yaml(o)?)?;
    }
    Ok(())
}

fn crds(args: &CrdsArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(1);
    };
    // Given --webhook-url or --webhook-service, the CRDs' conversion and the webhook
    // configurations name that endpoint; no caBundle: `run` writes it from its CA.
    let endpoint = args
        .webhook_url
        .clone()
        .or_else(|| args.webhook_service.clone())
        .map(|base| crate::webhook::Endpoint {
            base,
            ca_bundle_pem: Vec::new(),
        });
    let mut objects = crds_of(&set, endpoint.as_ref(), err)?;
    if args.webhooks {
        objects.extend(webhook_configurations(args, &set, endpoint)?);
    }
    for o in &mut objects {
        without_empty_ca_bundle(o);
    }
    write_stream(&objects, out)?;
    Ok(0)
}

/// `o` without the `caBundle: ""` of an endpoint printed before `run` has a CA.
fn without_empty_ca_bundle(o: &mut Json) {
    fn strip(c: &mut Json) {
        if let Some(cc) = c.as_object_mut()
            && cc.get("caBundle").and_then(Json::as_str) == Some("")
        {
            cc.remove("caBundle");
        }
    }
    if let Some(c) = o.pointer_mut("/spec/conversion/webhook/clientConfig") {
        strip(c);
    }
    let hooks = o.get_mut("webhooks").and_then(Json::as_array_mut);
    for hook in hooks.into_iter().flatten() {
        if let Some(c) = hook.get_mut("clientConfig") {
            strip(c);
        }
    }
}

/// The webhook configurations `run` would apply for `set` (default endpoint: the
/// Service rulebook-system/rulebook-webhook:443 of deploy/).
fn webhook_configurations(
    args: &CrdsArgs,
    set: &RuleSet,
    endpoint: Option<crate::webhook::Endpoint>,
) -> Result<Vec<Json>> {
    let endpoint = endpoint.unwrap_or_else(|| crate::webhook::Endpoint {
        base: crate::webhook::Base::Service {
            namespace: "rulebook-system".into(),
            name: "rulebook-webhook".into(),
            port: 443,
        },
        ca_bundle_pem: Vec::new(),
    });
    let scope = crate::webhook::configs::Scope {
        name: args.webhook_configuration.clone(),
        own_namespace: Some(args.webhook_namespace.clone()),
        namespace: None,
        selector: None,
    };
    Ok(crate::webhook::configs::configurations(
        set, &endpoint, &scope,
    )?)
}

/// The CRDs of `set`; a rule converting between versions gets `endpoint`'s
/// `clientConfig` for its conversion webhook (its empty `caBundle` is dropped by the
/// caller), or without one the placeholder; either is said on `err`.
fn crds_of(
    set: &RuleSet,
    endpoint: Option<&crate::webhook::Endpoint>,
    err: &mut dyn Write,
) -> Result<Vec<Json>> {
    let mut crds = Vec::new();
    for r in set.rules.values() {
        let path = crate::rules::crd::conversion_path(&r.name);
        let client = endpoint.map(|e| e.client_config(&path));
        let Some(crd) = crate::rules::crd::crd_with_webhook(&r.rule, client.as_ref()) else {
            continue;
        };
        if crate::rules::crd::needs_conversion_webhook(&r.rule) {
            let name = crd["metadata"]["name"].as_str().unwrap_or("");
            if endpoint.is_some() {
                writeln!(
                    err,
                    "note: CRD {name} converts through Rulebook's webhook at {path}; printed \
                     without a caBundle, which `run --install-crds` writes from its CA"
                )?;
            } else {
                writeln!(
                    err,
                    "note: CRD {name} converts through Rulebook's webhook; its clientConfig is \
                     a placeholder (Service rulebook-system/rulebook-webhook, path {path}, no \
                     caBundle): give --webhook-url or --webhook-service, or let `run \
                     --install-crds` write it with the CA"
                )?;
            }
        }
        crds.push(crd);
    }
    Ok(crds)
}

fn rbac(args: &RbacArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_or_report(&args.dirs, err)? else {
        return Ok(1);
    };
    let Some((ns, name)) = args.service_account.split_once('/') else {
        bail!("--service-account takes NAMESPACE/NAME");
    };
    // The diff role must not replace the operator's role of the default name.
    let role = if args.diff_role && args.name == "rulebook" {
        "rulebook-diff".to_string()
    } else {
        args.name.clone()
    };
    let opts = crate::rbac::RbacOptions {
        name: role,
        service_account: (ns.to_string(), name.to_string()),
        install_crds: args.install_crds,
        leader_elect: args.leader_elect,
        sharding: args.sharding,
        lease_name: args.lease_name.clone(),
        diff_role: args.diff_role,
        diff_namespaces: args.diff_namespaces.clone(),
        webhooks: args.webhooks.then(|| {
            (
                args.webhook_configuration.clone(),
                args.webhook_secret.clone(),
            )
        }),
        per_rule: args.per_rule,
    };
    if args.helm_values {
        let mut values = crate::rbac::helm::values(&set, &opts)?;
        if args.helm_ruleset {
            values["ruleset"] = helm_ruleset(&args.dirs)?;
        }
        write!(out, "{}", to_yaml(&values)?)?;
        return Ok(0);
    }
    write_stream(&crate::rbac::manifests(&set, &opts), out)?;
    Ok(0)
}

/// The chart's `ruleset` values: every rule file and template by its path below its
/// directory, as the loader reads them.
fn helm_ruleset(dirs: &RuleDirs) -> Result<Json> {
    let sources = rules::Sources::read(&dirs.rules, &dirs.templates).map_err(|d| {
        anyhow::anyhow!(
            "{}",
            d.0.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        )
    })?;
    let shown_root = dirs.rules.display().to_string();
    let mut rule_files = serde_json::Map::new();
    for (shown, text) in sources.rule_files {
        let rel = shown
            .strip_prefix(&shown_root)
            .map(|r| r.trim_start_matches('/'))
            .with_context(|| format!("{shown} is not below {shown_root}"))?;
        rule_files.insert(rel.to_string(), Json::String(text));
    }
    let templates: serde_json::Map<String, Json> = sources
        .templates
        .into_iter()
        .map(|(name, (_, text))| (name, Json::String(text)))
        .collect();
    Ok(serde_json::json!({"rules": rule_files, "templates": templates}))
}

/// `rulebook check` without a cluster: rendered children checked against the schemas of
/// `--openapi DIR`, else the built-in ones.
fn check(args: &CheckArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_for_check(args, err)? else {
        return Ok(1);
    };
    let schemas = schemas::Schemas::offline(&args.schema, &set)?;
    check_loaded(args, &set, &schemas, out, err)
}

/// `rulebook check --kubeconfig`: the cluster's schemas, then the dry runs of the
/// generated CRDs and admission objects.
async fn check_online(args: &CheckArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let Some(set) = load_for_check(args, err)? else {
        return Ok(1);
    };
    let Some(kc) = &args.kubeconfig else {
        bail!("check_online needs --kubeconfig");
    };
    let schemas = schemas::Schemas::online(&args.schema, kc, &set).await?;
    match check_loaded(args, &set, &schemas, out, err)? {
        0 => cel_dry_run::dry_run(&set, kc, out, err).await,
        code => Ok(code),
    }
}

/// The rule set, or `None` with its diagnostics written (and their count).
fn load_for_check(args: &CheckArgs, err: &mut dyn Write) -> Result<Option<RuleSet>> {
    match args.dirs.load(err)? {
        Ok(set) => Ok(Some(set)),
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            writeln!(err, "{} errors", diags.0.len())?;
            Ok(None)
        }
    }
}

fn check_loaded(
    args: &CheckArgs,
    set: &RuleSet,
    schemas: &schemas::Schemas,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    // Warnings do not fail the check: standard error, exit code 0.
    for w in &set.warnings {
        writeln!(err, "{w}")?;
    }
    if !set.warnings.is_empty() {
        writeln!(err, "{} warnings", set.warnings.len())?;
    }
    for (name, rule) in &set.rules {
        writeln!(
            out,
            "ok  {name}  {} {}  ({} children, version {})",
            rule.rule.spec.parent.api_version.value,
            rule.rule.spec.parent.kind.value,
            rule.rule.spec.children.len(),
            rule.version
        )?;
        if let Some(line) = order_line(name, rule) {
            writeln!(out, "{line}")?;
        }
    }
    let trips = roundtrip::check(set, &args.dirs);
    for (rule, n) in &trips.tried {
        if *n == 0 {
            writeln!(
                err,
                "warning: rule '{rule}': no example or RuleTest parent to prove its conversions round-trip on"
            )?;
        } else {
            writeln!(out, "ok  {rule}  conversions round-trip on {n} objects")?;
        }
    }
    let rendered = schemas::check_examples(set, &args.dirs, schemas);
    report_schemas(&rendered, schemas, out, err)?;
    let problems: Vec<&String> = trips.problems.iter().chain(&rendered.problems).collect();
    if !problems.is_empty() {
        for p in &problems {
            writeln!(err, "{p}")?;
        }
        writeln!(err, "{} errors", problems.len())?;
        return Ok(1);
    }
    for line in cel_dry_run::placement_lines(set) {
        writeln!(out, "{line}")?;
    }
    writeln!(out, "{} rules valid", set.rules.len())?;
    Ok(0)
}

/// `order  <rule>  a, b, c  (b waits for a: waitFor; c waits for b: reads children.b at
/// t.yaml:4)`: the order a rule's children are created in, for a rule where one waits for
/// another (spelled or inferred, `render::deps`) or for a reference (`waitFor:
/// [refs.x]`: `c waits for refs.x: waitFor`).
fn order_line(name: &str, rule: &crate::render::CompiledRule) -> Option<String> {
    let children = rule.children();
    let deps = rule.dependencies();
    let ref_waits = rule.reference_waits();
    if deps.iter().all(|d| d.is_empty()) && ref_waits.iter().all(|w| w.is_empty()) {
        return None;
    }
    let order: Vec<&str> = rule
        .creation_order()
        .into_iter()
        .map(|i| children[i].name.as_str())
        .collect();
    let why: Vec<String> = deps
        .iter()
        .enumerate()
        .flat_map(|(i, d)| {
            d.iter().map(move |(&j, why)| {
                let on = children[j].name.as_str();
                format!(
                    "{} waits for {on}: {}",
                    children[i].name.as_str(),
                    why.describe(on)
                )
            })
        })
        .chain(ref_waits.iter().enumerate().flat_map(|(i, w)| {
            w.iter()
                .map(move |r| format!("{} waits for refs.{r}: waitFor", children[i].name.as_str()))
        }))
        .collect();
    Some(format!(
        "order  {name}  {}  ({})",
        order.join(", "),
        why.join("; ")
    ))
}

/// The schema check's lines: per rule what was checked, where the schemas came from,
/// and the notes (parents not rendered, kinds without a schema).
fn report_schemas(
    report: &schemas::Report,
    schemas: &schemas::Schemas,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<()> {
    for (rule, (parents, children, problems)) in &report.checked {
        if *problems > 0 {
            continue;
        }
        writeln!(
            out,
            "ok  {rule}  {children} children of {parents} example and test parents checked against their schemas"
        )?;
    }
    writeln!(out, "schemas: {}", schemas.origin)?;
    for note in &report.notes {
        writeln!(err, "{note}")?;
    }
    for note in schemas::unknown_notes(&report.unknown, &schemas.origin) {
        writeln!(err, "{note}")?;
    }
    Ok(())
}

fn render(args: &RenderArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
    let set = match args.dirs.load(err)? {
        Ok(set) => set,
        Err(diags) => {
            for d in &diags.0 {
                writeln!(err, "{d}")?;
            }
            return Ok(1);
        }
    };
    let parent = read_objects(&args.parent)?
        .into_iter()
        .next()
        .with_context(|| format!("{}: no object", args.parent.display()))?;
    let api_version = parent
        .get("apiVersion")
        .and_then(Json::as_str)
        .unwrap_or("");
    let kind = parent.get("kind").and_then(Json::as_str).unwrap_or("");
    let Some(rule) = rule_for(&set, api_version, kind) else {
        bail!("no rule has parent {api_version} {kind}");
    };
    if args.admission {
        write_stream(&cel_dry_run::admission_objects(&set, rule)?, out)?;
        return Ok(0);
    }
    // Read as the operator reads it: in the storage version, with the CRD schema's
    // defaults, refused where the API server would refuse it (as `rulebook test` does).
    let parent = match ruletest::as_stored(rule, &with_render_defaults(rule, parent)) {
        Ok(p) => p,
        Err(e) => {
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    // The documents after the parent in its own file count as observed objects too (an
    // example's referenced Secret and ConfigMaps, say).
    let mut objects: Vec<Json> = read_objects(&args.parent)?.into_iter().skip(1).collect();
    if let Some(p) = &args.observed {
        objects.extend(read_objects(p)?);
    }
    let scope = offline_scope(&set, rule);
    let observed::Matched {
        observed,
        desired,
        ignored,
    } = match observed::render_against(rule, &parent, objects, &scope) {
        Ok(m) => m,
        Err(e) => {
            writeln!(err, "{e}")?;
            return Ok(1);
        }
    };
    if let Some(file) = &args.observed {
        for note in &ignored {
            writeln!(err, "warning: {}: {note}", file.display())?;
        }
    }
    if !schema_checked(&set, rule, &desired, args, err)? {
        return Ok(1);
    }
    if args.status {
        let report = match rule.status(&parent, &observed, &desired) {
            Ok(r) => r,
            Err(e) => {
                writeln!(err, "{e}")?;
                return Ok(1);
            }
        };
        let now = args.now.clone().unwrap_or_else(now_rfc3339);
        let status =
            status::desired_status(&parent, &report.fields, &report.readiness.condition(), &now);
        write!(
            out,
            "{}",
            to_yaml(&serde_json::json!({ "status": status }))?
        )?;
    } else {
        let objects: Vec<Json> = desired.into_iter().map(|d| d.object).collect();
        write_stream(&objects, out)?;
    }
    Ok(0)
}

/// The rendered children checked against their kinds' schemas, as `rulebook test` checks
/// each step's: false (the problems written to `err`) when the API server would refuse one.
fn schema_checked(
    set: &RuleSet,
    rule: &crate::render::CompiledRule,
    desired: &[crate::render::DesiredChild],
    args: &RenderArgs,
    err: &mut dyn Write,
) -> Result<bool> {
    let schemas = schemas::Schemas::offline(&args.schema, set)?;
    let mut unknown = std::collections::BTreeSet::new();
    let place = args.parent.display().to_string();
    let problems = schemas.check(rule, desired, &place, &mut unknown);
    for note in schemas::unknown_notes(&unknown, &schemas.origin) {
        writeln!(err, "{note}")?;
    }
    for p in &problems {
        writeln!(err, "{p}")?;
    }
    Ok(problems.is_empty())
}

/// A parent read from a file has no UID or namespace yet; render as the API server would
/// see it (a parent of a cluster-scoped kind of the rule's CRD has no namespace).
fn with_render_defaults(rule: &crate::render::CompiledRule, mut parent: Json) -> Json {
    let cluster_scoped = crd_cluster_scoped(rule);
    if let Some(meta) = parent.get_mut("metadata").and_then(Json::as_object_mut) {
        if cluster_scoped {
            // The API server drops the namespace of a cluster-scoped object.
            meta.remove("namespace");
        } else {
            meta.entry("namespace").or_insert_with(|| "default".into());
        }
        meta.entry("uid")
            .or_insert_with(|| "00000000-0000-0000-0000-000000000000".into());
        meta.entry("generation").or_insert_with(|| 1.into());
    }
    parent
}

/// The rule whose parent is `api_version` `kind`: the same apiVersion, or, for a rule
/// listing versions (`spec.crd.versions`), any of them.
pub fn rule_for<'a>(
    set: &'a RuleSet,
    api_version: &str,
    kind: &str,
) -> Option<&'a crate::render::SharedRule> {
    let (group, version) = crate::meta::split_api_version(api_version);
    set.rules.values().find(|r| {
        let p = &r.rule.spec.parent;
        p.kind.value == kind
            && (p.api_version.value == api_version
                || (p.group_version().0 == group
                    && r.crd_versions().iter().any(|(v, _)| v == version)))
    })
}

/// The schema of the parent's `.spec` in the storage version: the storage version's
/// own, else `spec.crd.specSchema`.
pub fn storage_spec_schema(rule: &crate::render::CompiledRule) -> Option<&Json> {
    let crd = rule.rule.spec.crd.as_ref()?;
    crd.versions
        .iter()
        .find(|v| v.storage)
        .and_then(|v| v.spec_schema.as_ref())
        .or(crd.spec_schema.as_ref())
        .map(|s| &s.value)
}

/// How `rule`'s children are placed without discovery, as `run` places them once the
/// API server says: built-in cluster-scoped kinds, and the kinds of the rule set's own
/// CRDs with `scope: Cluster`, as such; everything else namespaced.
pub fn offline_scope<'a>(
    set: &'a RuleSet,
    rule: &'a crate::render::CompiledRule,
) -> impl Fn(usize) -> Scope + 'a {
    move |i: usize| match rule.children().get(i) {
        Some(c) if is_cluster_scoped_builtin(&c.api_version, &c.kind) => Scope::Cluster,
        Some(c)
            if rule_for(set, &c.api_version, &c.kind).is_some_and(|r| crd_cluster_scoped(r)) =>
        {
            Scope::Cluster
        }
        _ => Scope::Namespaced,
    }
}

/// Whether the rule's own CRD makes its parents cluster-scoped (`spec.crd.scope: Cluster`).
fn crd_cluster_scoped(rule: &crate::render::CompiledRule) -> bool {
    rule.rule
        .spec
        .crd
        .as_ref()
        .and_then(|c| c.scope.as_ref())
        .is_some_and(|s| s.value == "Cluster")
}

pub use crate::meta::is_cluster_scoped_builtin;

/// Every object of a YAML or JSON stream.
pub fn read_objects(path: &Path) -> Result<Vec<Json>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    parse_objects(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}

/// Every object of a YAML or JSON stream's text.
pub fn parse_objects(text: &str) -> std::result::Result<Vec<Json>, String> {
    let docs: Vec<Json> = serde_saphyr::from_multiple(text).map_err(|e| e.to_string())?;
    Ok(docs.into_iter().filter(|d| !d.is_null()).collect())
}

/// `o` without the annotations `keys` (and without `annotations` when none is left).
pub fn strip_annotations(o: &mut Json, keys: &[&str]) {
    if let Some(meta) = o.get_mut("metadata").and_then(Json::as_object_mut)
        && let Some(a) = meta.get_mut("annotations").and_then(Json::as_object_mut)
    {
        for k in keys {
            a.remove(*k);
        }
        if a.is_empty() {
            meta.remove("annotations");
        }
    }
}

/// A unified diff of two texts (`from` → `to`), empty when they are equal.
pub fn unified_diff(from: &str, to: &str, a: &str, b: &str) -> String {
    similar::TextDiff::from_lines(a, b)
        .unified_diff()
        .context_radius(3)
        .header(from, to)
        .to_string()
}

pub fn to_yaml(v: &Json) -> Result<String> {
    serde_saphyr::to_string(v).context("cannot write YAML")
}

pub fn now_rfc3339() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

pub fn schema_json() -> Result<String> {
    let schema = schemars::schema_for!(crate::rules::Rule);
    Ok(serde_json::to_string_pretty(&schema)?)
}
