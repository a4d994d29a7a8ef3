//! `rulebook check` warnings for `adopt: true` children whose object name the parent's
//! writer can choose. Adoption takes over an existing object that has no controller; if
//! the name comes from `parent.spec` (or labels, a `forEach` over the spec, ...), a
//! tenant can point it at any uncontrolled object of that kind in the namespace. The
//! parent's own `metadata.name` is chosen by its writer too: a Tenant named `payments`
//! adopts the admin's Namespace `payments` (the red team's F7), so it is no safer than
//! the spec. `adoptUnsafe: true` on the child says the risk is accepted and silences this.
//!
//! The check is static: it reads the `name:` lines under the template's top-level
//! `metadata:` and lists every variable they use, following `{% set %}` definitions in
//! the template and the `forEach` expression behind `item`. Only
//! `parent.metadata.namespace` (where a namespaced parent's author may already write),
//! `index`, `rule.*`, literals and functions are safe. Rendering with sample parents would miss spec fields the samples
//! do not vary and fails on templates that need typed spec values, so the static reading
//! is the robust one; whatever it cannot read (a name from an include or a macro, a
//! multi-line tag) is warned about too.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::LazyLock;

use minijinja::Environment;
use regex::Regex;

use super::CompiledRule;
use crate::rules::{ChildRule, Diagnostic};

/// Paths that the parent's writer cannot choose freely (the namespace it may already write
/// in), and Rulebook's own values.
const SAFE: &[&str] = &["parent.metadata.namespace", "index", "rule"];

static SET: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"(?s)\{%[-+]?\s*set\s+([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(.*?)\s*[-+]?%\}")
        .expect("static regex")
});
static INCLUDE: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"\{%[-+]?\s*(?:include|import|from|call)\b").expect("static regex")
});
static METADATA: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^metadata:\s*(.*?)\s*$").expect("static regex"));
static KEY: LazyLock<Regex> =
    LazyLock::new(|| Regex::new(r"^(\s+)([A-Za-z0-9_.-]+):\s*(.*?)\s*$").expect("static regex"));

/// What a name depends on that the parent's writer controls.
enum Inputs {
    Safe,
    Tenant(BTreeSet<String>),
    /// The name could not be read.
    Unknown(String),
}

/// One warning per `adopt: true` child whose object name is not fixed by the parent's
/// own name and namespace.
pub fn warnings(rule: &CompiledRule) -> Vec<Diagnostic> {
    let env = rule.compiled.borrow_owner();
    let globals: BTreeSet<String> = env.globals().map(|(k, _)| k.to_string()).collect();
    let mut out = Vec::new();
    for (i, c) in rule.children().iter().enumerate() {
        if !c.adopt || c.adopt_unsafe {
            continue;
        }
        let Ok(tmpl) = env.get_template(&c.template) else {
            continue;
        };
        let path = rule
            .template_files
            .get(c.template.as_str())
            .cloned()
            .unwrap_or_else(|| c.template.value.clone());
        let reader = Reader {
            sets: set_definitions(tmpl.source()),
            globals: &globals,
            child: c,
        };
        let why = match reader.name_inputs(tmpl.source()) {
            Inputs::Safe => continue,
            Inputs::Tenant(vars) => format!(
                "its metadata.name ({path}) depends on {}",
                vars.into_iter().collect::<Vec<_>>().join(", ")
            ),
            Inputs::Unknown(what) => {
                format!("Rulebook cannot tell what its metadata.name ({path}) depends on: {what}")
            }
        };
        out.push(Diagnostic::at(
            &rule.file,
            &c.name,
            format!(
                "warning: rule '{}': spec.children[{i}] '{}' has adopt: true and {why}; whoever \
                 writes the parent can then choose which existing {} without a controller \
                 Rulebook takes over. Build the name from literals and \
                 parent.metadata.namespace, drop adopt, or set adoptUnsafe: true to accept it",
                rule.name, c.name.value, c.kind.value
            ),
        ));
    }
    out
}

/// `{% set x = expr %}` definitions of a template, by variable.
fn set_definitions(source: &str) -> BTreeMap<String, Vec<String>> {
    let mut sets: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for m in SET.captures_iter(source) {
        if let (Some(n), Some(e)) = (m.get(1), m.get(2)) {
            sets.entry(n.as_str().to_string())
                .or_default()
                .push(e.as_str().to_string());
        }
    }
    sets
}

/// The values of the `name:` keys directly under each top-level `metadata:` (inline
/// content after `metadata:` counts as a value too), with their line numbers.
fn name_values(source: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_metadata = false;
    let mut child_indent: Option<usize> = None;
    for (n, line) in source.lines().enumerate() {
        let trimmed = line.trim();
        let tag_only = (trimmed.starts_with("{%") && trimmed.ends_with("%}"))
            || (trimmed.starts_with("{#") && trimmed.ends_with("#}"));
        if trimmed.is_empty() || trimmed.starts_with('#') || tag_only {
            continue;
        }
        if let Some(m) = METADATA.captures(line) {
            in_metadata = true;
            child_indent = None;
            if let Some(inline) = m.get(1).filter(|v| !v.as_str().is_empty()) {
                out.push((n + 1, inline.as_str().to_string()));
            }
            continue;
        }
        if !line.starts_with([' ', '\t']) {
            in_metadata = false;
            continue;
        }
        if !in_metadata {
            continue;
        }
        let Some(m) = KEY.captures(line) else {
            continue;
        };
        let indent = m.get(1).map_or(0, |i| i.as_str().len());
        let indent = *child_indent.get_or_insert(indent);
        if m.get(1).map_or(0, |i| i.as_str().len()) == indent
            && m.get(2).is_some_and(|k| k.as_str() == "name")
        {
            out.push((n + 1, m.get(3).map_or("", |v| v.as_str()).to_string()));
        }
    }
    out
}

struct Reader<'a> {
    sets: BTreeMap<String, Vec<String>>,
    globals: &'a BTreeSet<String>,
    child: &'a ChildRule,
}

impl Reader<'_> {
    fn name_inputs(&self, source: &str) -> Inputs {
        let values = name_values(source);
        if values.is_empty() {
            return Inputs::Unknown("no `name:` line under a top-level `metadata:`".into());
        }
        let mut tenant = BTreeSet::new();
        for (line, value) in values {
            let env = Environment::new();
            let vars = match env.template_from_str(&value) {
                Ok(t) => t.undeclared_variables(true),
                Err(_) => {
                    return Inputs::Unknown(format!(
                        "line {line} is not a complete template expression"
                    ));
                }
            };
            if INCLUDE.is_match(&value) {
                return Inputs::Unknown(format!("line {line} includes another template"));
            }
            for v in vars {
                self.collect(&v, 0, &mut tenant);
            }
        }
        if tenant.is_empty() {
            Inputs::Safe
        } else {
            Inputs::Tenant(tenant)
        }
    }

    /// Adds to `out` the tenant-controlled paths behind variable path `var`.
    fn collect(&self, var: &str, depth: usize, out: &mut BTreeSet<String>) {
        let root = var.split('.').next().unwrap_or(var);
        if SAFE.contains(&var) || SAFE.contains(&root) || self.globals.contains(root) {
            return;
        }
        if root == "item" {
            let Some(fe) = &self.child.for_each else {
                return;
            };
            let mut from = BTreeSet::new();
            self.expression(&fe.value, depth + 1, &mut from);
            if !from.is_empty() {
                let list = from.into_iter().collect::<Vec<_>>().join(", ");
                out.insert(format!("{var} (forEach over {list})"));
            }
            return;
        }
        match self.sets.get(root) {
            Some(defs) if depth < 8 => {
                for d in defs {
                    self.expression(d, depth + 1, out);
                }
            }
            _ => {
                out.insert(var.to_string());
            }
        }
    }

    fn expression(&self, source: &str, depth: usize, out: &mut BTreeSet<String>) {
        let env = Environment::new();
        match env.compile_expression(source) {
            Ok(e) => {
                for v in e.undeclared_variables(true) {
                    self.collect(&v, depth, out);
                }
            }
            Err(_) => {
                out.insert(format!("`{source}`"));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_lines_are_those_directly_under_top_level_metadata() {
        let t = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  labels:\n    name: not-me\n  \
                 name: {{ parent.metadata.name }}\n{% if x %}\n  name: other\n{% endif %}\n\
                 data:\n  name: nor-me\nspec:\n  template:\n    metadata:\n      name: nested\n";
        let names: Vec<String> = name_values(t).into_iter().map(|(_, v)| v).collect();
        // The first key sets the indentation: `labels` and `name` are both at two spaces.
        assert_eq!(names, ["{{ parent.metadata.name }}", "other"]);
        assert_eq!(name_values("metadata: {name: x}\n")[0].1, "{name: x}");
        assert!(name_values("kind: X\n{% include \"meta.yaml\" %}\n").is_empty());
    }

    /// The warnings for one child with `adopt: true`, `forEach` `for_each` and `template`.
    fn warned(template: &str, for_each: &str) -> Vec<String> {
        warned_with(template, for_each, "")
    }

    /// [`warned`] with `extra` lines added to the child.
    fn warned_with(template: &str, for_each: &str, extra: &str) -> Vec<String> {
        let mut rule = String::from(
            "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: a\nspec:\n  \
             parent:\n    apiVersion: t.rulebook.dev/v1\n    kind: A\n  children:\n    \
             - name: c\n      apiVersion: v1\n      kind: ConfigMap\n      template: t.yaml\n      \
             adopt: true\n",
        );
        if !for_each.is_empty() {
            rule.push_str(&format!("      forEach: {for_each:?}\n"));
        }
        rule.push_str(extra);
        let mut templates = BTreeMap::new();
        let head = "apiVersion: v1\nkind: ConfigMap\n";
        templates.insert(
            "t.yaml".to_string(),
            ("templates/t.yaml".to_string(), format!("{head}{template}")),
        );
        templates.insert(
            "meta.yaml".to_string(),
            (
                "templates/meta.yaml".to_string(),
                "metadata:\n  name: {{ parent.spec.n }}\n".to_string(),
            ),
        );
        let sources = crate::rules::Sources {
            default_rollout: None,
            rule_files: vec![("rules/a.yaml".to_string(), rule)],
            templates,
        };
        let set = crate::render::compile(&sources, &super::super::Limits::default())
            .unwrap_or_else(|d| panic!("{d}"));
        warnings(&set.rules["a"])
            .into_iter()
            .map(|d| d.to_string())
            .collect()
    }

    #[test]
    fn names_from_literals_the_namespace_and_rulebook_are_fine() {
        for t in [
            "metadata:\n  name: fixed\n",
            "metadata:\n  name: {{ parent.metadata.namespace }}-config\n",
            "{% set base = parent.metadata.namespace ~ \"-x\" %}\nmetadata:\n  name: {{ base }}\n  labels:\n    app: {{ parent.spec.app }}\n",
            "metadata:\n  name: {{ rule.name }}-x\ndata:\n  x: {{ parent.spec.x }}\n",
        ] {
            assert_eq!(warned(t, ""), Vec::<String>::new(), "{t}");
        }
        let each = "metadata:\n  name: fixed-{{ item }}-{{ index }}\n";
        assert_eq!(warned(each, "['a', 'b']"), Vec::<String>::new());
    }

    #[test]
    fn the_parent_s_own_name_is_chosen_by_its_writer_unless_the_risk_is_accepted() {
        // The red team's F7: a Tenant named like an admin's Namespace adopted it.
        for t in [
            "metadata:\n  name: {{ parent.metadata.name }}\n",
            "metadata:\n  name: {{ (parent.metadata.name ~ \"-\" ~ parent.metadata.namespace) | lower }}\n",
            "{% set base = parent.metadata.name ~ \"-x\" %}\nmetadata:\n  name: {{ base }}\n",
        ] {
            let w = warned(t, "");
            assert_eq!(w.len(), 1, "{t}: {w:?}");
            assert!(w[0].contains("depends on parent.metadata.name"), "{}", w[0]);
            assert!(w[0].contains("adoptUnsafe: true"), "{}", w[0]);
            let accepted = warned_with(t, "", "      adoptUnsafe: true\n");
            assert_eq!(accepted, Vec::<String>::new(), "{t}");
        }
    }

    #[test]
    fn names_the_parent_writer_chooses_are_warned_about() {
        for (t, for_each, needle) in [
            (
                "metadata:\n  name: {{ parent.spec.target }}\n",
                "",
                "depends on parent.spec.target",
            ),
            (
                "metadata:\n  name: {{ parent.metadata.labels.app }}-x\n",
                "",
                "depends on parent.metadata.labels.app",
            ),
            (
                "{% set n = parent.spec.n %}\nmetadata:\n  name: {{ n | lower }}\n",
                "",
                "depends on parent.spec.n",
            ),
            (
                "metadata:\n  name: {{ parent.metadata.name }}-{{ item.name }}\n",
                "parent.spec.items",
                "depends on item.name (forEach over parent.spec.items)",
            ),
            (
                "metadata:\n  name: {{ parent[\"spec\"][\"x\"] }}\n",
                "",
                "depends on parent",
            ),
            (
                "{% include \"meta.yaml\" %}\n",
                "",
                "cannot tell what its metadata.name",
            ),
        ] {
            let w = warned(t, for_each);
            assert_eq!(w.len(), 1, "{t}: {w:?}");
            assert!(
                w[0].starts_with(
                    "rules/a.yaml:10:13: warning: rule 'a': spec.children[0] 'c' has adopt: true"
                ),
                "{}",
                w[0]
            );
            assert!(w[0].contains(needle), "{t}: {needle:?} not in {}", w[0]);
        }
    }

    #[test]
    fn set_definitions_are_found() {
        let sets = set_definitions("{% set a = parent.spec.x %}{%- set b = a ~ \"-y\" -%}");
        assert_eq!(sets["a"], ["parent.spec.x"]);
        assert_eq!(sets["b"], ["a ~ \"-y\""]);
    }
}
