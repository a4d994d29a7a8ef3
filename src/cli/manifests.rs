//! `rulebook crds` and `rulebook rbac`: the manifests a rule set needs installed, printed
//! as a YAML stream (the CRDs with their conversion webhooks and the admission
//! configurations; the least-privilege RBAC, or the Helm chart's values holding it).

use std::io::Write;

use anyhow::{Context, Result, bail};
use serde_json::Value as Json;

use super::{CrdsArgs, RbacArgs, RuleDirs, load_or_report, to_yaml, write_stream};
use crate::render::RuleSet;
use crate::rules;

pub(super) fn crds(args: &CrdsArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
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
    let endpoint = endpoint.unwrap_or_else(crate::webhook::Endpoint::deploy_service);
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

pub(super) fn rbac(args: &RbacArgs, out: &mut dyn Write, err: &mut dyn Write) -> Result<i32> {
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
