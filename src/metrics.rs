//! Prometheus metrics, in OpenMetrics text format on `/metrics`.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleLabel {
    pub rule: String,
}

/// A rule and one of its versions (at most three per rule during a rollout).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RuleVersionLabels {
    pub rule: String,
    pub version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub rule: String,
    pub result: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct VerbLabels {
    pub rule: String,
    pub verb: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabels {
    pub rule: String,
    /// `parents`, `children` or `references`.
    pub cache: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheKindLabel {
    /// `parents`, `children` or `references`.
    pub cache: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ModeLabel {
    pub mode: String,
}

/// The event outbox's label and reasons (`rulebook_events_dropped_total{reason}`), defined
/// where the outbox drops events.
pub use crate::write::outbox::{DroppedLabel, EVENTS_DROPPED_REASONS};

/// The git source's live commit (`rulebook_git_commit_info`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GitCommitLabels {
    /// The remote, without credentials.
    pub url: String,
    pub reference: String,
    pub commit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReloadLabel {
    pub result: String,
}

/// `rulebook_webhook_requests_total`'s labels: the route (`validate`, `mutate`,
/// `convert`) and the HTTP status answered.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct WebhookLabels {
    pub route: String,
    pub code: String,
}

/// Why the webhook server refused a review without an answer (webhook/server.rs).
pub const WEBHOOK_REFUSED_REASONS: [&str; 5] = [
    "too_large",
    "in_flight",
    "bytes_in_flight",
    "namespace_share",
    "deadline",
];

/// `rulebook_webhook_refused_total`'s label: why ([`WEBHOOK_REFUSED_REASONS`]);
/// never the namespace, which tenants choose (unbounded).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusedLabel {
    pub reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RouteLabel {
    pub route: String,
}

/// What the webhook server (`webhook::server`) counts.
#[derive(Clone)]
pub struct WebhookMetrics {
    /// `rulebook_webhook_requests_total`.
    pub requests: Family<WebhookLabels, Counter>,
    /// `rulebook_webhook_refused_total`: reviews refused without an answer, by reason.
    pub refused: Family<RefusedLabel, Counter>,
    /// `rulebook_webhook_duration_seconds`: from the body read to the answer.
    pub duration: Family<RouteLabel, Histogram, fn() -> Histogram>,
    /// `rulebook_webhook_certificate_expiry_seconds`: when the served certificate expires
    /// (seconds since the epoch; 0 before the first).
    pub certificate_expiry: Gauge,
}

impl Default for WebhookMetrics {
    fn default() -> Self {
        WebhookMetrics {
            requests: Family::default(),
            refused: Family::default(),
            duration: Family::new_with_constructor(duration_histogram),
            certificate_expiry: Gauge::default(),
        }
    }
}

fn duration_histogram() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 16))
}

/// What the budget of reconcile inputs in flight (`reconcile::inflight`) counts.
#[derive(Clone, Default)]
pub struct InputMetrics {
    /// `rulebook_inputs_in_flight_bytes`.
    pub in_flight: Gauge,
    /// `rulebook_inputs_waits_total`: requests that could not be granted at once.
    pub waits: Counter,
    /// `rulebook_inputs_refused_total`: requests over what one may hold.
    pub refused: Counter,
}

pub struct Metrics {
    pub registry: Registry,
    pub reconciles: Family<ResultLabels, Counter>,
    pub reconcile_duration: Family<RuleLabel, Histogram, fn() -> Histogram>,
    pub in_flight: Family<RuleLabel, Gauge>,
    /// Reconciles waiting for their namespace's turn (`engine::turns`).
    pub waiting: Family<RuleLabel, Gauge>,
    /// The deletion time (Unix seconds) of the parent whose teardown this process has
    /// run longest without finishing, by rule; 0 when none runs.
    pub teardown_oldest: Family<RuleLabel, Gauge>,
    pub children_applied: Family<RuleLabel, Counter>,
    pub children_pruned: Family<RuleLabel, Counter>,
    pub api_writes: Family<VerbLabels, Counter>,
    pub render_errors: Family<RuleLabel, Counter>,
    /// Renders and status evaluations that ran on the blocking pool (`reconcile::offload`):
    /// not straight-line, too heavy for a slice, or outgrew one. Finalize steps are not
    /// counted.
    pub renders_offloaded: Family<RuleLabel, Counter>,
    /// Reconciles that stopped after observing: inputs unchanged since one that had
    /// nothing to do.
    pub reconciles_skipped: Family<RuleLabel, Counter>,
    /// Children's watch events that were the answer a reconcile awaited to its own write
    /// and brought no reconcile (`memory::Steady::expects`).
    pub child_events_awaited: Family<RuleLabel, Counter>,
    pub rule_running: Family<RuleLabel, Gauge>,
    /// Parents per rule version during a progressive rollout (the coordinator's count).
    pub rollout_parents: Family<RuleVersionLabels, Gauge>,
    pub reloads: Family<ReloadLabel, Counter>,
    pub ruleset_valid: Gauge,
    pub leader: Gauge,
    /// `--rules-git`: 1 for the live commit (labels: url, reference, commit).
    pub git_commit: Family<GitCommitLabels, Gauge>,
    /// `--rules-git`: Unix time of the last successful fetch.
    pub git_last_fetch: Gauge,
    /// `--rules-git`: 1 when the last fetch succeeded.
    pub git_fetch_ok: Gauge,
    pub git_fetch_errors: Counter,
    /// `--rules-git`: commits that did not go live, by reason (invalid, signature).
    pub git_refused: Family<ReasonLabel, Counter>,
    /// Bytes the cache budget counts (content, and metadata beyond the allowance), by
    /// cache: parents, children, references (all rules).
    pub cache_content_bytes: Family<CacheKindLabel, Gauge>,
    /// Child objects cached without their content (over the cache budget), by rule.
    pub cache_stubbed: Family<CacheLabels, Counter>,
    /// Objects decoded as unreadable (nested too deep) by rule.
    pub unreadable_objects: Family<RuleLabel, Counter>,
    /// Write requests the write gate refused because leadership had lapsed.
    pub writes_refused: Counter,
    pub events_dropped: Family<DroppedLabel, Counter>,
    /// Events posted to the event outbox and not sent yet (waiting or in flight).
    pub events_unsent: Gauge,
    pub cached_objects: Family<CacheLabels, Gauge>,
    pub shard_mode: Family<ModeLabel, Gauge>,
    pub shard_share: Gauge<f64, std::sync::atomic::AtomicU64>,
    /// The budget of reconcile inputs in flight (`reconcile::inflight`).
    pub inputs: InputMetrics,
    /// The webhook server's requests and certificate.
    pub webhook: WebhookMetrics,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut metrics = Metrics {
            registry: Registry::with_prefix("rulebook"),
            reconciles: Family::default(),
            reconcile_duration: Family::new_with_constructor(duration_histogram),
            in_flight: Family::default(),
            waiting: Family::default(),
            teardown_oldest: Family::default(),
            children_applied: Family::default(),
            children_pruned: Family::default(),
            api_writes: Family::default(),
            render_errors: Family::default(),
            renders_offloaded: Family::default(),
            reconciles_skipped: Family::default(),
            child_events_awaited: Family::default(),
            rule_running: Family::default(),
            rollout_parents: Family::default(),
            reloads: Family::default(),
            ruleset_valid: Gauge::default(),
            leader: Gauge::default(),
            git_commit: Family::default(),
            git_last_fetch: Gauge::default(),
            git_fetch_ok: Gauge::default(),
            git_fetch_errors: Counter::default(),
            git_refused: Family::default(),
            cache_content_bytes: Family::default(),
            cache_stubbed: Family::default(),
            unreadable_objects: Family::default(),
            writes_refused: Counter::default(),
            events_dropped: Family::default(),
            events_unsent: Gauge::default(),
            cached_objects: Family::default(),
            shard_mode: Family::default(),
            shard_share: Gauge::default(),
            inputs: InputMetrics::default(),
            webhook: WebhookMetrics::default(),
        };
        // The families are registered, and so listed on /metrics, in this order.
        metrics.register_reconciles();
        metrics.register_rule_set_and_leader();
        metrics.register_caches_and_writes();
        metrics.register_sharding_and_inputs();
        metrics.register_webhooks();
        metrics.register_git();
        metrics
    }

    /// Reconciles: how many, how long, and what they did (children written, pruned,
    /// renders offloaded, reconciles skipped, awaited events), and whether each rule runs.
    fn register_reconciles(&mut self) {
        self.registry.register(
            "reconciles",
            "Reconciles by rule and result (ok, render_failed, conflict, apply_failed, not_leader, error)",
            self.reconciles.clone(),
        );
        self.registry.register(
            "reconcile_duration_seconds",
            "Time of one reconcile",
            self.reconcile_duration.clone(),
        );
        self.registry.register(
            "rollout_parents",
            "Parents on each version of a rule during a progressive rollout (counted by the replica that coordinates it)",
            self.rollout_parents.clone(),
        );
        self.registry.register(
            "reconciles_in_flight",
            "Reconciles running now, by rule",
            self.in_flight.clone(),
        );
        self.registry.register(
            "teardown_oldest_deletion_seconds",
            "The deletion time (Unix seconds) of the oldest parent whose teardown (Rulebook's finalizer) has not finished, by rule; 0 when none",
            self.teardown_oldest.clone(),
        );
        self.registry.register(
            "reconciles_waiting",
            "Reconciles waiting for a turn (namespaces take turns), by rule",
            self.waiting.clone(),
        );
        self.registry.register(
            "children_applied",
            "Children created or updated by server-side apply",
            self.children_applied.clone(),
        );
        self.registry.register(
            "renders_offloaded",
            "Renders and status evaluations that ran on the blocking pool: of a rule that is not straight-line code, over inputs heavier than the slice allows, or after outgrowing their first slice on the async runtime (finalize steps, always on the pool, are not counted)",
            self.renders_offloaded.clone(),
        );
        self.registry.register(
            "children_pruned",
            "Children deleted because no rule renders them any more",
            self.children_pruned.clone(),
        );
        self.registry.register(
            "api_writes",
            "Write requests to the API server (apply, apply_status, delete, event)",
            self.api_writes.clone(),
        );
        self.registry.register(
            "render_errors",
            "Parents whose templates or expressions failed",
            self.render_errors.clone(),
        );
        self.registry.register(
            "reconciles_skipped",
            "Reconciles that stopped after observing: the parent, its children and its references unchanged since a reconcile that had nothing to do",
            self.reconciles_skipped.clone(),
        );
        self.registry.register(
            "child_events_awaited",
            "Children's watch events that carried a version this process had just written, awaited by the parent's last reconcile, and brought no reconcile",
            self.child_events_awaited.clone(),
        );
        self.registry.register(
            "rule_running",
            "1 while the rule's controller runs, 0 while it waits (missing kind, missing permission)",
            self.rule_running.clone(),
        );
    }

    /// The rule set on disk, and whether this process may write.
    fn register_rule_set_and_leader(&mut self) {
        self.registry.register(
            "ruleset_reloads",
            "Rule set reloads by result (applied, invalid, unchanged)",
            self.reloads.clone(),
        );
        self.registry.register(
            "ruleset_valid",
            "1 when the rules on disk are valid, 0 while the last good rule set still serves",
            self.ruleset_valid.clone(),
        );
        self.registry.register(
            "leader",
            "1 while this process holds the leader lease (or runs without leader election)",
            self.leader.clone(),
        );
    }

    /// The git source (`run --rules-git`).
    fn register_git(&mut self) {
        self.registry.register(
            "git_commit_info",
            "1 for the git commit whose rules serve (labels: url without credentials, reference, commit)",
            self.git_commit.clone(),
        );
        self.registry.register(
            "git_last_fetch_timestamp_seconds",
            "Unix time of the last successful fetch of the rules repository",
            self.git_last_fetch.clone(),
        );
        self.registry.register(
            "git_fetch_ok",
            "1 when the last fetch of the rules repository succeeded, 0 when it failed",
            self.git_fetch_ok.clone(),
        );
        self.registry.register(
            "git_fetch_errors",
            "Failed fetches of the rules repository",
            self.git_fetch_errors.clone(),
        );
        self.registry.register(
            "git_commits_refused",
            "Fetched commits that did not go live, by reason (invalid rules, signature)",
            self.git_refused.clone(),
        );
    }

    /// The caches (budget, stubs, unreadable objects, sizes) and the write path (refused
    /// writes, the event outbox).
    fn register_caches_and_writes(&mut self) {
        self.registry.register(
            "cache_content_bytes",
            "Bytes the cache budget counts (content, and metadata beyond 4 KiB per object), by cache: parents, children, references",
            self.cache_content_bytes.clone(),
        );
        self.registry.register(
            "cache_stubbed_objects",
            "Children cached without content because their namespace or the operator is over the cache budget",
            self.cache_stubbed.clone(),
        );
        self.registry.register(
            "unreadable_objects",
            "Parents or children Rulebook could not read (nested too deeply); each fails only its own parent",
            self.unreadable_objects.clone(),
        );
        self.registry.register(
            "writes_refused",
            "Write requests refused by the write gate (not the leader, or leadership lapsed)",
            self.writes_refused.clone(),
        );
        // Both series exist from the start, at 0, so the first drop is an increase.
        for reason in EVENTS_DROPPED_REASONS {
            let _series = self.events_dropped.get_or_create(&DroppedLabel {
                reason: reason.to_string(),
            });
        }
        self.registry.register(
            "events_dropped",
            "Events not sent because the event outbox (outbox_full: a slow or throttled API server) or one namespace's share of it (namespace_share) was full",
            self.events_dropped.clone(),
        );
        self.registry.register(
            "events_unsent",
            "Events in the event outbox, waiting to be sent or being sent",
            self.events_unsent.clone(),
        );
        self.registry.register(
            "cached_objects",
            "Objects in a rule's parent and child caches",
            self.cached_objects.clone(),
        );
    }

    /// Sharding, and the budget of reconcile inputs in flight (`reconcile::inflight`).
    fn register_sharding_and_inputs(&mut self) {
        self.registry.register(
            "shard_mode",
            "1 for the active sharding mode: server (the API server filters the watches), client (filtered here: the API server lacks ShardedListAndWatch), off",
            self.shard_mode.clone(),
        );
        self.registry.register(
            "shard_share_percent",
            "The share of the namespace hash space this replica holds (sharded), in percent",
            self.shard_share.clone(),
        );
        self.registry.register(
            "inputs_in_flight_bytes",
            "Bytes of reconcile inputs (parents, live children, referenced objects, as cached) held by the reconciles running now, all rules (run --inputs-in-flight-mib bounds them)",
            self.inputs.in_flight.clone(),
        );
        self.registry.register(
            "inputs_waits",
            "Reconciles that waited for room in the budget of inputs in flight before reading their inputs",
            self.inputs.waits.clone(),
        );
        self.registry.register(
            "inputs_refused",
            "Reconciles whose inputs weighed more than one reconcile may hold at once (the parent failed with RenderBudgetExceeded)",
            self.inputs.refused.clone(),
        );
    }

    /// The webhook server (`run --webhook-url/--webhook-service`).
    fn register_webhooks(&mut self) {
        self.registry.register(
            "webhook_requests",
            "Reviews the webhook server answered, by route (validate, mutate, convert) and HTTP status (200; 413 too large, 429 too many in flight, 504 past the deadline, 400 not a review)",
            self.webhook.requests.clone(),
        );
        for reason in WEBHOOK_REFUSED_REASONS {
            self.webhook
                .refused
                .get_or_create(&RefusedLabel {
                    reason: reason.to_string(),
                })
                .inc_by(0);
        }
        self.registry.register(
            "webhook_refused",
            "Reviews the webhook server refused without an answer, by reason: too_large (413), in_flight and bytes_in_flight (429, this replica is full), namespace_share (429, the review's namespace holds its fair share of the reviews in flight), deadline (504)",
            self.webhook.refused.clone(),
        );
        self.registry.register(
            "webhook_duration_seconds",
            "Time from a review's body to its answer, by route",
            self.webhook.duration.clone(),
        );
        self.registry.register(
            "webhook_certificate_expiry_seconds",
            "When the serving certificate this replica serves expires, in seconds since the epoch (0: none yet)",
            self.webhook.certificate_expiry.clone(),
        );
    }

    /// The verbs of `rulebook_api_writes_total`.
    pub const WRITE_VERBS: [&'static str; 4] = ["apply", "apply_status", "delete", "event"];

    /// Exposes a rule's write, apply, prune, render-error and cache-stub counters at 0 from the moment
    /// the rule starts, so that "nothing written" reads as a 0 rather than as a missing
    /// series (which a renamed metric or label would also give).
    pub fn init_rule(&self, rule: &str) {
        // `get_or_create` creates the series; the guard it returns is not needed.
        for verb in Self::WRITE_VERBS {
            let _ = self.api_writes.get_or_create(&VerbLabels {
                rule: rule.to_string(),
                verb: verb.to_string(),
            });
        }
        let label = self::rule(rule);
        let _ = self.children_applied.get_or_create(&label);
        let _ = self.children_pruned.get_or_create(&label);
        let _ = self.renders_offloaded.get_or_create(&label);
        let _ = self.render_errors.get_or_create(&label);
        let _ = self.reconciles_skipped.get_or_create(&label);
        let _ = self.child_events_awaited.get_or_create(&label);
        // The cache-budget alert (deploy/prometheus) reads `increase()` of this counter,
        // which misses the first stub of a series that starts at 1 rather than at 0.
        for cache in ["parents", "children", "references"] {
            let _ = self.cache_stubbed.get_or_create(&CacheLabels {
                rule: rule.to_string(),
                cache: cache.to_string(),
            });
        }
    }

    pub fn write(&self, rule: &str, verb: &str) {
        self.api_writes
            .get_or_create(&VerbLabels {
                rule: rule.to_string(),
                verb: verb.to_string(),
            })
            .inc();
    }

    pub fn encode(&self) -> String {
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// What the kube layer's write path counts (`rulebook_kube::counts`), in this registry.
impl rulebook_kube::counts::WriteCounts for Metrics {
    fn count_write(&self, rule: &str, verb: &str) {
        self.write(rule, verb);
    }

    fn count_refused(&self) {
        self.writes_refused.inc();
    }
}

/// What the kube layer's cache budget counts (`rulebook_kube::counts`), in this registry.
impl rulebook_kube::counts::CacheCounts for Metrics {
    fn count_stubbed(&self, rule: &str, cache: &str) {
        self.cache_stubbed
            .get_or_create(&CacheLabels {
                rule: rule.to_string(),
                cache: cache.to_string(),
            })
            .inc();
    }

    fn set_content_bytes(&self, cache: &str, bytes: i64) {
        self.cache_content_bytes
            .get_or_create(&CacheKindLabel {
                cache: cache.to_string(),
            })
            .set(bytes);
    }
}

pub fn rule(rule: &str) -> RuleLabel {
    RuleLabel {
        rule: rule.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_started_rule_counts_zero_instead_of_nothing() {
        let m = Metrics::new();
        assert!(!m.encode().contains("rule=\"r\""));
        m.init_rule("r");
        m.write("r", "apply");
        let text = m.encode();
        for verb in Metrics::WRITE_VERBS {
            let want = if verb == "apply" { 1 } else { 0 };
            let line = format!("rulebook_api_writes_total{{rule=\"r\",verb=\"{verb}\"}} {want}\n");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        for family in ["children_applied", "children_pruned", "render_errors"] {
            let line = format!("rulebook_{family}_total{{rule=\"r\"}} 0\n");
            assert!(text.contains(&line), "{line} in\n{text}");
        }
    }
}
