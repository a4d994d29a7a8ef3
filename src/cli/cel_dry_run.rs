//! What `rulebook check` says of the rules' `cel:` keys: where each is enforced (the
//! CRD's `x-kubernetes-validations`, a `ValidatingAdmissionPolicy`, a
//! `MutatingAdmissionPolicy`), and, with `--kubeconfig`, the API server's own verdict on
//! the generated objects: a server-side dry-run apply of each rule's CRD and policies,
//! which compiles every expression as the API server will (syntax, and for CRD rules
//! types against the schema and the cost limits; a policy's type errors show later in
//! its `status.typeChecking`). Nothing is stored.

use std::io::Write;

use anyhow::Result;
use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::core::{ApiResource, GroupVersionKind};
use serde_json::Value as Json;

use crate::render::RuleSet;
use crate::rules::policy::{self, Placement, Resource, Scope, placements};

/// One line per `cel:` key: where it is enforced.
pub fn placement_lines(set: &RuleSet) -> Vec<String> {
    let mut out = Vec::new();
    for (name, rule) in &set.rules {
        for p in placements(&rule.rule) {
            let key = format!("spec.admission.validate[{}]", p.index);
            let line = match &p.placement {
                Placement::Crd => format!(
                    "cel {name}  {key}: the CRD's x-kubernetes-validations{}",
                    if p.transition {
                        " (transition rule)"
                    } else {
                        ""
                    }
                ),
                Placement::Policy(why) => format!(
                    "cel {name}  {key}: ValidatingAdmissionPolicy {} ({why})",
                    policy::policy_name(name, &p.operations)
                ),
            };
            out.push(line);
        }
        if let Some(a) = &rule.rule.spec.admission {
            for (i, d) in a.default.iter().enumerate() {
                if d.cel.is_some() {
                    out.push(format!(
                        "cel {name}  spec.admission.default[{i}]: MutatingAdmissionPolicy {}",
                        policy::policy_name(name, &["CREATE", "UPDATE"])
                    ));
                }
            }
        }
    }
    out
}

/// The CRD and policies of every rule with `cel:` keys, as `(rule, object)`.
fn generated(set: &RuleSet) -> Vec<(String, Json)> {
    let mut out = Vec::new();
    for (name, rule) in &set.rules {
        let r = &rule.rule;
        if placements(r).is_empty()
            && !r
                .spec
                .admission
                .as_ref()
                .is_some_and(|a| a.default.iter().any(|d| d.cel.is_some()))
        {
            continue;
        }
        if let Some(crd) = crate::rules::crd::crd_for(r) {
            out.push((name.clone(), crd));
        }
        for obj in policy::policies(r, &Resource::of(r), &Scope::default()) {
            out.push((name.clone(), obj));
        }
    }
    out
}

/// The line of the `cel:` key the API server's refusal of a generated object names
/// (`x-kubernetes-validations[i]`, `validations[i]`, `mutations[i]`), if it names one.
fn blamed_line(r: &crate::rules::Rule, kind: &str, name: &str, message: &str) -> Option<u64> {
    let index = |key: &str| -> Option<usize> {
        let rest = &message[message.find(key)? + key.len()..];
        rest[..rest.find(']')?].parse().ok()
    };
    let placed = placements(r);
    let lines: Vec<u64> = match kind {
        "CustomResourceDefinition" => {
            let i = index("x-kubernetes-validations[")?;
            return placed
                .iter()
                .filter(|p| p.placement == Placement::Crd)
                .nth(i)
                .and_then(|p| p.check.cel.as_ref().map(|c| c.line));
        }
        "ValidatingAdmissionPolicy" => placed
            .iter()
            .filter(|p| {
                matches!(p.placement, Placement::Policy(_))
                    && policy::policy_name(&r.metadata.name, &p.operations) == name
            })
            .filter_map(|p| p.check.cel.as_ref().map(|c| c.line))
            .collect(),
        "MutatingAdmissionPolicy" => r
            .spec
            .admission
            .iter()
            .flat_map(|a| a.default.iter())
            .filter_map(|d| d.cel.as_ref().map(|c| c.line))
            .collect(),
        _ => return None,
    };
    let i = index("validations[").or_else(|| index("mutations["))?;
    lines.get(i).copied()
}

/// Dry-runs the generated objects against the cluster of `kubeconfig`: 0 when the API
/// server accepts every one, 1 otherwise (each refusal on `err`, with the rule's file).
pub async fn dry_run(
    set: &RuleSet,
    kubeconfig: &std::path::Path,
    out: &mut dyn Write,
    err: &mut dyn Write,
) -> Result<i32> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig)?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await?;
    let client = kube::Client::try_from(config)?;
    let params = PatchParams::apply("rulebook-check").force().dry_run();
    let mut refused = 0;
    for (rule, obj) in generated(set) {
        let (group, version) =
            crate::meta::split_api_version(obj["apiVersion"].as_str().unwrap_or(""));
        let kind = obj["kind"].as_str().unwrap_or("").to_string();
        let name = obj["metadata"]["name"].as_str().unwrap_or("").to_string();
        let plural = match kind.as_str() {
            "CustomResourceDefinition" => "customresourcedefinitions".to_string(),
            k => crate::policies::KINDS
                .iter()
                .find(|(kk, _)| *kk == k)
                .map_or_else(String::new, |(_, p)| (*p).to_string()),
        };
        let gvk = GroupVersionKind::gvk(group, version, &kind);
        let api: Api<DynamicObject> = Api::all_with(
            client.clone(),
            &ApiResource::from_gvk_with_plural(&gvk, &plural),
        );
        let Some(compiled) = set.rules.get(&rule) else {
            continue;
        };
        match api.patch(&name, &params, &Patch::Apply(&obj)).await {
            Ok(_) => writeln!(
                out,
                "ok  {rule}  {kind} {name}: the API server accepts it (dry run)"
            )?,
            Err(kube::Error::Api(s)) => {
                refused += 1;
                let line = blamed_line(&compiled.rule, &kind, &name, &s.message)
                    .map_or_else(String::new, |l| format!(":{l}"));
                writeln!(
                    err,
                    "{}{line}: rule '{rule}': the API server refuses the generated {kind} {name}: {}",
                    compiled.file, s.message
                )?;
            }
            Err(e) => anyhow::bail!("{kind} {name}: {e}"),
        }
    }
    if refused > 0 {
        writeln!(err, "{refused} errors")?;
        return Ok(1);
    }
    Ok(0)
}

/// What `rulebook render --admission` prints for `rule`: its generated policies and
/// bindings, then the webhook configurations the API server would call Rulebook by for
/// it (`webhook::configs`, only this rule's webhooks, for the Service of deploy/).
pub fn admission_objects(set: &RuleSet, rule: &crate::render::CompiledRule) -> Result<Vec<Json>> {
    let r = &rule.rule;
    let mut objects = policy::policies(r, &Resource::of(r), &Scope::default());
    let endpoint = crate::webhook::Endpoint::deploy_service();
    let scope = crate::webhook::configs::Scope {
        name: "rulebook".into(),
        ..Default::default()
    };
    let hook = crate::webhook::configs::webhook_name(&rule.name);
    for mut config in crate::webhook::configs::configurations(set, &endpoint, &scope)? {
        if let Some(hooks) = config.get_mut("webhooks").and_then(Json::as_array_mut) {
            hooks.retain(|h| h["name"] == hook.as_str());
            if hooks.is_empty() {
                continue;
            }
            objects.push(config);
        }
    }
    Ok(objects)
}
