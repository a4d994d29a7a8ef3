//! `rulebook check` warnings for a child whose content names a sibling child — the
//! Secret or ConfigMap its Pods read, the ServiceAccount they run as, the
//! PersistentVolumeClaim they mount, the Namespace it goes in — that it does not
//! `waitFor`.
//!
//! Such a child is applied as soon as it renders: while the sibling does not exist yet,
//! its name is free for anyone who may create objects of that kind, and a Pod would then
//! read or mount theirs. The reconcile holds every write of a parent while one of its
//! children is in conflict (`reconcile::apply_stage`), but `waitFor` says it in the rule
//! and keeps the child from being rendered at all until the sibling exists and is ready.
//!
//! The check is static, as the adoption check (`adopt.rs`) is: each child template is
//! read as YAML with its tags dropped and each `{{ expression }}` replaced by its value
//! for a sample parent when the expression reads only `parent.metadata.name` and
//! `parent.metadata.namespace` (else by a token that is the same for the same
//! expression), and what it names ([`super::mentions`]) is compared with the siblings'
//! names read the same way. A template that does not read as YAML that way (a name from
//! an include, branches that repeat a key) is not warned about.

use std::collections::{BTreeSet, HashMap};
use std::sync::LazyLock;

use minijinja::{Environment, context};
use regex::Regex;
use serde_json::Value as Json;
use sha2::Digest;

use super::CompiledRule;
use super::mentions::{Named, mentions};
use crate::meta::JsonAt;
use crate::rules::Diagnostic;

static COMMENT: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)\{#.*?#\}").expect("static regex"));
static TAG: LazyLock<Regex> = LazyLock::new(|| Regex::new(r"(?s)\{%.*?%\}").expect("static regex"));
static EXPRESSION: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"(?s)\{\{(.*?)\}\}").expect("static regex"));

/// The sample parent's name and namespace.
const SAMPLE_NAME: &str = "sample-parent";
const SAMPLE_NAMESPACE: &str = "sample-namespace";

/// One warning per child and sibling it names without waiting for it.
pub fn warnings(rule: &CompiledRule) -> Vec<Diagnostic> {
    let env = rule.compiled.borrow_owner();
    let children = rule.children();
    let objects: Vec<Option<Json>> = children
        .iter()
        .map(|c| {
            let t = env.get_template(&c.template).ok()?;
            static_object(t.source())
        })
        .collect();
    let mut named: HashMap<(Named, &str), usize> = HashMap::new();
    for (i, c) in children.iter().enumerate() {
        let name = objects[i]
            .as_ref()
            .and_then(|o| o.at(&["metadata", "name"]))
            .and_then(Json::as_str);
        if let (Some(kind), Some(name)) = (Named::of(&c.api_version, &c.kind), name) {
            named.insert((kind, name), i);
        }
    }
    let finalize = rule
        .rule
        .spec
        .deletion
        .as_ref()
        .and_then(|d| d.finalize.as_ref())
        .map(|f| f.child.as_str());
    let waits = rule.wait_for_positions();
    let mut out = Vec::new();
    for (j, c) in children.iter().enumerate() {
        // The finalize child cannot wait (it is rendered once, from the parent alone).
        let Some(object) = objects[j]
            .as_ref()
            .filter(|_| finalize != Some(c.name.as_str()))
        else {
            continue;
        };
        let mut warned = BTreeSet::new();
        for m in mentions(object) {
            let Some(&i) = named.get(&(m.kind, m.name)) else {
                continue;
            };
            if i == j || waits_for(&waits, j, i) || !warned.insert(i) {
                continue;
            }
            let sibling = &children[i].name.value;
            out.push(Diagnostic::at(
                &rule.file,
                &c.name,
                format!(
                    "warning: rule '{}': spec.children[{j}] '{}' names the {} of child '{sibling}' \
                     but does not wait for it; add `waitFor: [{sibling}]` so that it is applied \
                     only once that {} exists and is this parent's (until then the name is \
                     anyone's to take)",
                    rule.name,
                    c.name.value,
                    m.kind.kind(),
                    m.kind.kind()
                ),
            ));
        }
    }
    out
}

/// Whether child `j` waits for child `i`, directly or through others.
fn waits_for(waits: &[Vec<usize>], j: usize, i: usize) -> bool {
    let mut seen = BTreeSet::new();
    let mut stack = vec![j];
    while let Some(k) = stack.pop() {
        for &w in waits.get(k).into_iter().flatten() {
            if w == i {
                return true;
            }
            if seen.insert(w) {
                stack.push(w);
            }
        }
    }
    false
}

/// A template read as the object it renders, as far as a static reading can: comments
/// and tags dropped (a line of tags alone goes whole), expressions replaced
/// ([`placeholder`]). `None` when that is not YAML of one object.
fn static_object(source: &str) -> Option<Json> {
    const MARK: char = '\u{0}';
    let text = COMMENT.replace_all(source, "");
    let text = TAG.replace_all(&text, MARK.to_string().as_str());
    let mut lines = Vec::new();
    for line in text.lines() {
        if line.contains(MARK) && line.replace(MARK, "").trim().is_empty() {
            continue;
        }
        let line = line.replace(MARK, "");
        lines.push(
            EXPRESSION
                .replace_all(&line, |c: &regex::Captures<'_>| {
                    placeholder(c.get(1).map_or("", |m| m.as_str()))
                })
                .into_owned(),
        );
    }
    let object: Json = serde_saphyr::from_str(&lines.join("\n")).ok()?;
    object.is_object().then_some(object)
}

/// What stands for `{{ expr }}`: its value for the sample parent when it reads nothing
/// but the parent's name and namespace and gives a plain name; else a token derived from
/// the expression's text (without blanks), the same wherever the expression is written.
fn placeholder(expr: &str) -> String {
    let expr = expr.trim().trim_matches(['-', '+']).trim();
    sample_value(expr).unwrap_or_else(|| {
        let text: String = expr.split_whitespace().collect();
        let digest = sha2::Sha256::digest(text.as_bytes());
        format!("expr-{}", hex::encode(&digest[..8]))
    })
}

/// The expression's value for the sample parent. This runs at load time, outside any
/// parent's budget, so only expressions that cannot build much are evaluated: they read
/// the parent's name or namespace and nothing else, and hold no digit, `*` or `%` (no
/// width, count or repetition for a filter to build from: `"%.999999999f" | format(1)` or
/// `"x" | indent(10**9)` would allocate gigabytes), under a small fuel bound. Anything
/// else stands for a token.
fn sample_value(expr: &str) -> Option<String> {
    if expr.len() > 256
        || expr
            .chars()
            .any(|c| c.is_ascii_digit() || c == '*' || c == '%')
    {
        return None;
    }
    let mut env = Environment::new();
    env.set_fuel(Some(10_000));
    let compiled = env.compile_expression(expr).ok()?;
    let vars = compiled.undeclared_variables(true);
    let reads_only_identity = !vars.is_empty()
        && vars
            .iter()
            .all(|v| v == "parent.metadata.name" || v == "parent.metadata.namespace");
    if !reads_only_identity {
        return None;
    }
    let value = compiled
        .eval(context! {
            parent => context! {
                metadata => context! { name => SAMPLE_NAME, namespace => SAMPLE_NAMESPACE }
            }
        })
        .ok()?;
    let text = value.as_str().map(str::to_string)?;
    let plain = !text.is_empty()
        && text
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '_'));
    plain.then_some(text)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    const SECRET: &str = "apiVersion: v1\nkind: Secret\nmetadata:\n  name: {{ parent.metadata.name ~ \"-credentials\" }}\n{# a comment #}\ndata:\n  password: {{ parent.spec.password | b64encode }}\n";

    fn deployment(secret_name: &str) -> String {
        format!(
            "apiVersion: apps/v1\nkind: Deployment\nmetadata:\n  name: {{{{ parent.metadata.name }}}}\n\
             spec:\n  template:\n    spec:\n      containers:\n        - name: app\n          \
             image: {{{{ parent.spec.image }}}}\n{{% if parent.spec.debug %}}\n          args: [debug]\n\
             {{% endif %}}\n          env:\n            - name: PASSWORD\n              valueFrom:\n                \
             secretKeyRef:\n                  name: {secret_name}\n                  key: password\n"
        )
    }

    /// The warnings of a rule with a Secret child and a Deployment child (`extra` added to
    /// the Deployment's entry) whose env reads Secret `secret_name`.
    fn warned(secret_name: &str, extra: &str) -> Vec<String> {
        let rule = format!(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: p\nspec:\n  \
             parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: P\n  children:\n    \
             - name: secret\n      apiVersion: v1\n      kind: Secret\n      template: s.yaml\n    \
             - name: app\n      apiVersion: apps/v1\n      kind: Deployment\n      template: d.yaml\n{extra}"
        );
        let mut templates = BTreeMap::new();
        templates.insert(
            "s.yaml".to_string(),
            ("templates/s.yaml".to_string(), SECRET.to_string()),
        );
        templates.insert(
            "d.yaml".to_string(),
            ("templates/d.yaml".to_string(), deployment(secret_name)),
        );
        let sources = crate::rules::Sources {
            default_rollout: None,
            rule_files: vec![("rules/p.yaml".to_string(), rule)],
            templates,
        };
        let set = crate::render::compile(&sources, &super::super::Limits::default())
            .unwrap_or_else(|d| panic!("{d}"));
        warnings(&set.rules["p"])
            .into_iter()
            .map(|d| d.to_string())
            .collect()
    }

    #[test]
    fn a_child_naming_a_sibling_secret_it_does_not_wait_for_is_warned_about() {
        // The same name however the expression spells it.
        for name in [
            "{{ parent.metadata.name ~ \"-credentials\" }}",
            "{{parent.metadata.name~'-credentials'}}",
            "{{ parent.metadata.name }}-credentials",
        ] {
            let w = warned(name, "");
            assert_eq!(w.len(), 1, "{name}: {w:?}");
            assert!(
                w[0].starts_with("rules/p.yaml:14:13: warning: rule 'p': spec.children[1] 'app' names the Secret of child 'secret'"),
                "{}",
                w[0]
            );
            assert!(w[0].contains("add `waitFor: [secret]`"), "{}", w[0]);
        }
    }

    #[test]
    fn waiting_or_naming_another_secret_is_fine() {
        assert_eq!(
            warned(
                "{{ parent.metadata.name ~ \"-credentials\" }}",
                "      waitFor: [secret]\n"
            ),
            Vec::<String>::new()
        );
        assert_eq!(warned("shared-credentials", ""), Vec::<String>::new());
        assert_eq!(warned("{{ parent.spec.secret }}", ""), Vec::<String>::new());
    }

    #[test]
    fn expressions_over_the_spec_stand_for_the_same_token() {
        assert_eq!(
            placeholder(" parent.spec.x  ~ 'a' "),
            placeholder("parent.spec.x ~ 'a'")
        );
        assert_ne!(placeholder("parent.spec.x"), placeholder("parent.spec.y"));
        assert_eq!(placeholder("- parent.metadata.name -"), SAMPLE_NAME);
        assert!(static_object("a: [\n").is_none());
    }
}
