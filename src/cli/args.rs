//! The command line's argument types (clap derives): one struct per subcommand, and the
//! rule directories every offline subcommand reads. What a subcommand does with them is in
//! its own module; `RunArgs::settings` turns `run`'s flags into the operator's settings.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Parser, Subcommand};

use super::{diff, git_args, release, rollout, ruletest, schemas, webhook_args};
use crate::render::{Limits, RuleSet};
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
    /// Seconds a lease stays valid without renewal (at most an hour: a Lease holds an
    /// int32, and the renewal deadlines are computed from it).
    #[arg(long, default_value_t = 15, value_parser = clap::value_parser!(u64).range(..=3600))]
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
    /// changes its storage version); 0: as fast as the API server answers. At most
    /// 1,000,000 (a pace of a microsecond: beyond, the pace's period would be 0).
    #[arg(long, default_value_t = 100, value_parser = clap::value_parser!(u32).range(..=1_000_000))]
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

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::{Cli, Command};

    fn run(extra: &[&str]) -> Result<Cli, clap::Error> {
        let mut argv = vec!["rulebook", "run", "--rules", "r", "--templates", "t"];
        argv.extend_from_slice(extra);
        Cli::try_parse_from(argv)
    }

    /// Flags whose values become deadlines or paces are bounded where they are read: a
    /// lease of more than an hour, or a migration pace under a microsecond, would
    /// overflow or panic later.
    #[test]
    fn lease_duration_and_migration_rate_are_bounded() {
        let ok = run(&["--lease-duration", "3600", "--migration-rate", "1000000"]);
        let Ok(Cli {
            command: Command::Run(args),
        }) = ok
        else {
            panic!("{ok:?}");
        };
        assert_eq!(
            (args.lease_duration, args.migration_rate),
            (3600, 1_000_000)
        );
        assert!(run(&["--lease-duration", "3601"]).is_err());
        assert!(run(&["--migration-rate", "1000001"]).is_err());
    }
}
