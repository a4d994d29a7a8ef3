//! Injection corpus: hostile parent field values must never change the structure of a
//! rendered child, and must come out exactly as they went in.
//!
//! Every payload is placed in `parent.spec.payload` and rendered through one rule whose
//! templates print it in many positions (a plain mapping value, a list item, a flow
//! sequence, a flow mapping, a nested map, a label, an annotation, a `data:` value, a
//! `forEach` item, a concatenation and a mapping key). For every payload the rendered
//! objects must have the same shape as for a benign value, with the payload positions
//! taken as leaves, and every position must hold exactly the payload.
// A scenario test (or the benchmark driver) reads top to bottom as one story: set up,
// act, wait, assert. The function size limit (clippy.toml, issue 42) is for the product
// code in src/ and crates/; here a long function is allowed, with helpers in common/.
#![allow(clippy::too_many_lines)]

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use rulebook::render::{CompiledRule, DesiredChild, Limits, Observed, RenderError, Scope};
use rulebook::rules::Sources;
use serde_json::{Value as Json, json};

const RULE: &str = r#"apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: injection
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Injection
  children:
    - name: probe
      apiVersion: test.rulebook.dev/v1
      kind: Probe
      template: probe.yaml
    - name: each
      apiVersion: v1
      kind: ConfigMap
      template: each.yaml
      forEach: "[parent.spec.payload, parent.spec.payload]"
    - name: strings
      apiVersion: v1
      kind: ConfigMap
      template: strings.yaml
      includeWhen: "parent.spec.payload is string"
"#;

const PROBE: &str = r#"apiVersion: test.rulebook.dev/v1
kind: Probe
metadata:
  name: {{ parent.metadata.name }}
  labels:
    payload: {{ parent.spec.payload }}
    after: fixed
  annotations:
    payload: {{ parent.spec.payload }}
spec:
  plain: {{ parent.spec.payload }}
  list:
    - first
    - {{ parent.spec.payload }}
    - last
  flow: [{{ parent.spec.payload }}, {{ parent.spec.payload }}]
  inline: {value: {{ parent.spec.payload }}, after: fixed}
  nested:
    deeper:
      value: {{ parent.spec.payload }}
      sibling: fixed
  {% set p = parent.spec.payload %}
  viaSet: {{ p }}
  tail: fixed
data:
  payload: {{ parent.spec.payload }}
  after: fixed
"#;

const EACH: &str = r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-each-" ~ index }}
data:
  item: {{ item }}
  index: {{ index }}
"#;

const STRINGS: &str = r#"apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ parent.metadata.name ~ "-strings" }}
data:
  concat: {{ "pre-" ~ parent.spec.payload ~ "-post" }}
  length: {{ parent.spec.payload | length }}
  b64: {{ parent.spec.payload | b64encode }}
keyed:
{% for k, v in parent.spec.keyed | default({}) | items %}
  {{ k }}: {{ v }}
{% endfor %}
  after: fixed
"#;

/// JSON pointers where `probe` and `each` hold the payload itself.
const PROBE_POSITIONS: &[&str] = &[
    "/metadata/labels/payload",
    "/metadata/annotations/payload",
    "/spec/plain",
    "/spec/list/1",
    "/spec/flow/0",
    "/spec/flow/1",
    "/spec/inline/value",
    "/spec/nested/deeper/value",
    "/spec/viaSet",
    "/data/payload",
];
const EACH_POSITIONS: &[&str] = &["/data/item"];

/// The output cap for this test: large enough for a 1 MiB payload printed in every
/// position, so that the over-cap payload below is the only one that hits it.
const OUTPUT_CAP: usize = 16 << 20;

/// Strings at least this long are not tried as a mapping key.
const KEY_MAX: usize = 1000;

fn sources() -> Sources {
    let mut templates = BTreeMap::new();
    for (name, text) in [
        ("probe.yaml", PROBE),
        ("each.yaml", EACH),
        ("strings.yaml", STRINGS),
    ] {
        templates.insert(
            name.to_string(),
            (format!("templates/{name}"), text.to_string()),
        );
    }
    Sources {
        default_rollout: None,
        rule_files: vec![("rules/injection.yaml".into(), RULE.into())],
        templates,
    }
}

fn compile(limits: &Limits) -> Arc<CompiledRule> {
    let set = rulebook::render::compile(&sources(), limits).unwrap_or_else(|d| panic!("{d}"));
    set.rules["injection"].clone()
}

/// The per-parent budget is raised too: a 1 MiB payload printed in every position is
/// more than the default budget allows (and slow in a debug build), and this test is
/// about structure, not budgets (tests/hostile_templates.rs covers those).
fn test_limits() -> Limits {
    Limits {
        max_output_bytes: OUTPUT_CAP,
        parent_output_bytes: 8 * OUTPUT_CAP,
        parent_time: std::time::Duration::from_secs(300),
        ..Limits::default()
    }
}

fn parent(payload: &Json) -> Json {
    let mut spec = json!({ "payload": payload });
    // A YAML implicit key is at most 1024 characters long, so only shorter strings are
    // tried as a key (a longer one fails to render, cleanly).
    if let Some(s) = payload.as_str().filter(|s| s.len() < KEY_MAX) {
        let mut keyed = serde_json::Map::new();
        keyed.insert(s.to_string(), json!("fixed"));
        spec["keyed"] = Json::Object(keyed);
    }
    json!({
        "apiVersion": "test.rulebook.dev/v1",
        "kind": "Injection",
        "metadata": {
            "name": "victim",
            "namespace": "default",
            "uid": "00000000-0000-0000-0000-000000000001",
            "generation": 1,
        },
        "spec": spec,
    })
}

fn render(rule: &CompiledRule, payload: &Json) -> Result<Vec<DesiredChild>, RenderError> {
    rule.render(&parent(payload), &Observed::default(), &|_| {
        Scope::Namespaced
    })
}

/// The shape of an object: every JSON pointer with the type found there; the payload
/// positions are leaves whatever the payload is.
fn shape(v: &Json, at: &str, leaves: &[&str], out: &mut BTreeSet<String>) {
    if leaves.contains(&at) {
        out.insert(format!("{at} = <payload>"));
        return;
    }
    let escape = |k: &str| k.replace('~', "~0").replace('/', "~1");
    match v {
        Json::Object(m) => {
            out.insert(format!("{at} = object"));
            for (k, v) in m {
                shape(v, &format!("{at}/{}", escape(k)), leaves, out);
            }
        }
        Json::Array(a) => {
            out.insert(format!("{at} = array"));
            for (i, v) in a.iter().enumerate() {
                shape(v, &format!("{at}/{i}"), leaves, out);
            }
        }
        Json::String(_) => {
            out.insert(format!("{at} = string"));
        }
        Json::Number(_) => {
            out.insert(format!("{at} = number"));
        }
        Json::Bool(_) => {
            out.insert(format!("{at} = bool"));
        }
        Json::Null => {
            out.insert(format!("{at} = null"));
        }
    }
}

/// `(child label, shape)` of every child that exists for every payload (`strings`
/// exists for string payloads only and is checked on its own).
fn shapes(children: &[DesiredChild]) -> Vec<(String, BTreeSet<String>)> {
    children
        .iter()
        .filter(|c| c.name != "strings")
        .map(|c| {
            let leaves = if c.name == "probe" {
                PROBE_POSITIONS
            } else {
                EACH_POSITIONS
            };
            let mut s = BTreeSet::new();
            shape(&c.object, "", leaves, &mut s);
            (c.label(), s)
        })
        .collect()
}

fn strings_shape(children: &[DesiredChild]) -> Option<BTreeSet<String>> {
    let c = children.iter().find(|c| c.name == "strings")?;
    let mut s = BTreeSet::new();
    shape(
        &c.object,
        "",
        &["/data/concat", "/data/length", "/data/b64", "/keyed"],
        &mut s,
    );
    Some(s)
}

fn b64(s: &str) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(s.as_bytes())
}

fn short(p: &Json) -> String {
    let s = p.to_string();
    if s.len() > 80 {
        let mut end = 80;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}… ({} bytes)", &s[..end], s.len())
    } else {
        s
    }
}

/// Checks one payload; every problem is described.
fn check(
    rule: &CompiledRule,
    payload: &Json,
    benign: &[(String, BTreeSet<String>)],
    benign_strings: &BTreeSet<String>,
) -> Vec<String> {
    let name = short(payload);
    let children = match render(rule, payload) {
        Ok(c) => c,
        Err(e) => return vec![format!("{name}: rendering failed: {e}")],
    };
    let mut problems = Vec::new();
    let got = shapes(&children);
    if got != benign {
        let want: BTreeSet<_> = benign
            .iter()
            .flat_map(|(l, s)| s.iter().map(move |p| format!("{l}{p}")))
            .collect();
        let have: BTreeSet<_> = got
            .iter()
            .flat_map(|(l, s)| s.iter().map(move |p| format!("{l}{p}")))
            .collect();
        problems.push(format!(
            "{name}: STRUCTURE CHANGED: extra {:?}, missing {:?}",
            have.difference(&want).take(8).collect::<Vec<_>>(),
            want.difference(&have).take(8).collect::<Vec<_>>()
        ));
    }
    for c in &children {
        let positions: &[&str] = match c.name.as_str() {
            "probe" => PROBE_POSITIONS,
            "each" => EACH_POSITIONS,
            _ => &[],
        };
        for p in positions {
            match c.object.pointer(p) {
                Some(v) if v == payload => {}
                other => problems.push(format!(
                    "{name}: {}{p} is {:?}, not the payload",
                    c.label(),
                    other.map(short)
                )),
            }
        }
        if c.name == "each" && c.object.pointer("/data/index") != Some(&json!(c.index.unwrap())) {
            problems.push(format!("{name}: {} has the wrong index", c.label()));
        }
    }
    match payload.as_str() {
        Some(s) => {
            let c = children.iter().find(|c| c.name == "strings");
            let c = c.map(|c| &c.object);
            let want = json!({
                "concat": format!("pre-{s}-post"),
                "length": s.chars().count(),
                "b64": b64(s),
            });
            let data = c.and_then(|o| o.get("data")).cloned();
            if data.as_ref() != Some(&want) {
                problems.push(format!(
                    "{name}: strings.data is {:?}",
                    data.map(|d| short(&d))
                ));
            }
            let keyed = c.and_then(|o| o.get("keyed"));
            let mut want_keyed = serde_json::Map::new();
            if s.len() < KEY_MAX {
                want_keyed.insert(s.to_string(), json!("fixed"));
            }
            want_keyed.insert("after".to_string(), json!("fixed"));
            if keyed != Some(&Json::Object(want_keyed)) {
                problems.push(format!(
                    "{name}: the payload as a mapping key gave {:?}",
                    keyed.map(short)
                ));
            }
            if strings_shape(&children).as_ref() != Some(benign_strings) {
                problems.push(format!("{name}: STRUCTURE CHANGED in the strings child"));
            }
        }
        None => {
            if children.iter().any(|c| c.name == "strings") {
                problems.push(format!(
                    "{name}: includeWhen `is string` held for a non-string"
                ));
            }
        }
    }
    problems
}

fn payloads() -> Vec<Json> {
    let mut strings: Vec<String> = [
        // line structure
        "line one\nline two",
        "\n",
        "trailing newline\n",
        "\n\nleading newlines",
        "---",
        "a\n---\nkind: Secret\nmetadata: {name: stolen}",
        "...",
        "end\n...\n",
        "--- !!python/object/apply:os.system ['id']",
        // block and flow syntax
        "key: value",
        "a: b\nc: d",
        "  nested: deeper\n  more: x",
        "- item",
        "- a\n- b",
        "{a: 1}",
        "{\"a\": 1}",
        "[1, 2, 3]",
        "[",
        "}",
        "? complex key\n: value",
        ": starts with a colon",
        ", comma",
        // anchors, aliases, merges, tags
        "&a anchored",
        "*a",
        "<<: *a",
        "<<",
        "!!python/object:os.system",
        "!!binary aGVsbG8=",
        "!<tag:yaml.org,2002:str> x",
        "!custom value",
        "!",
        "%YAML 1.2",
        "%TAG ! tag:evil.example.com,2000:",
        // quoting and escaping
        "'single quoted'",
        "\"double quoted\"",
        "it's",
        "say \"hi\"",
        "back\\slash",
        "\\n \\t \\u0041 \\x41 \\",
        "\\\"",
        // comments and block indicators
        "# a comment",
        "value # trailing comment",
        "#",
        "|",
        "|\n  literal block",
        ">-\n  folded block",
        "|+",
        // whitespace
        "",
        " ",
        "   leading spaces",
        "trailing spaces   ",
        "\ttab",
        "tab\tinside",
        "a\rb",
        "\r\n",
        "\r",
        // control and special characters
        "nul\0byte",
        "\u{1}\u{2}\u{3}\u{4}\u{5}\u{6}\u{7}\u{8}\u{b}\u{c}\u{e}\u{f}\u{10}\u{11}\u{12}\u{13}\u{14}\u{15}\u{16}\u{17}\u{18}\u{19}\u{1a}\u{1b}\u{1c}\u{1d}\u{1e}\u{1f}",
        "\u{1b}[31mred\u{1b}[0m",
        "\u{7f} DEL",
        "\u{80}\u{81}\u{9f} C1 controls",
        "NEL\u{85}inside",
        "\u{85}",
        "LS\u{2028}inside",
        "PS\u{2029}inside",
        "\u{feff}BOM first",
        "BOM\u{feff}inside",
        "\u{202e}RTL override\u{202c}",
        "zero\u{200b}width",
        "\u{fffe}\u{ffff} non-characters",
        "\u{d7ff}\u{e000}\u{fffd}",
        "emoji 😀 and astral 𝄞 \u{10ffff}",
        // template syntax
        "{{ 7*7 }}",
        "{% raw %}{{ x }}{% endraw %}",
        "{% for i in range(10) %}x{% endfor %}",
        "{# comment #}",
        "${HOME} $(id) `id`",
        // JSON-looking
        "{\"json\": [1, 2, {\"k\": null}]}",
        "[\"a\", \"b\"]",
        "\"\"",
        // scalars YAML would resolve to other types
        "0x10",
        "0o17",
        "017",
        "1e3",
        "1_000",
        "+1",
        "-0",
        ".5",
        ".inf",
        "-.inf",
        ".nan",
        ".NaN",
        "yes",
        "no",
        "on",
        "off",
        "y",
        "n",
        "True",
        "FALSE",
        "true",
        "null",
        "Null",
        "~",
        "2026-01-01",
        "2026-01-01T00:00:00Z",
        "12:30:45",
        "=",
        "@at",
        "`backtick",
        "%percent",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // every C0 control on its own, but NUL, which is above
    strings.extend((1u8..0x20).map(|b| format!("<{}>", b as char)));
    // a long hostile string, 1 MiB, below the (test) output cap: lines of text with
    // YAML structure sprinkled in
    let chunk = "line\n---\n- x: *a\n  <<: {k: \"v\"}\n'\"\\\t\u{85}\u{2028}#|>\n";
    let filler = "lorem ipsum dolor sit amet consectetur adipiscing elit ".repeat(8);
    let mut long = String::new();
    while long.len() < 1 << 20 {
        long.push_str(chunk);
        long.push_str(&filler);
    }
    let mut end = 1 << 20;
    while !long.is_char_boundary(end) {
        end -= 1;
    }
    long.truncate(end);
    strings.push(long);
    let mut payloads: Vec<Json> = strings.into_iter().map(Json::String).collect();
    payloads.extend([
        json!({"a": 1, "b": "x: y"}),
        json!([1, "two", null, {"k": "v"}, [true]]),
        json!({
            "---": "...\n---\nkind: Secret",
            "<<": "*a",
            "&a": "!!str",
            "- k": ["- z", "*a", "{{ 7*7 }}", "\u{85}\u{2028}"],
            "": {"nested": {"deeper": "key: value\n- item"}},
            "a\nb": "multi-line key",
            "#": "# comment",
        }),
        json!({}),
        json!([]),
        json!([[[[[[[[[["deep"]]]]]]]]]]),
        json!(42),
        json!(-7),
        json!(0),
        json!(3.5),
        json!(1e300),
        json!(-2.5e-300),
        json!(u64::MAX),
        json!(i64::MIN),
        json!(true),
        json!(false),
        Json::Null,
    ]);
    payloads
}

#[test]
fn hostile_values_never_change_the_structure() {
    let rule = compile(&test_limits());
    let benign_children = render(&rule, &json!("benign")).expect("benign render");
    let benign = shapes(&benign_children);
    let benign_strings = strings_shape(&benign_children).expect("strings child for a string");
    assert_eq!(benign.len(), 3, "probe and two forEach items");
    let payloads = payloads();
    assert!(payloads.len() >= 45);
    let mut problems = Vec::new();
    let mut changed = 0;
    for p in &payloads {
        let mine = check(&rule, p, &benign, &benign_strings);
        if mine
            .iter()
            .any(|m| m.contains("STRUCTURE CHANGED") || m.contains("rendering failed"))
        {
            changed += 1;
        }
        problems.extend(mine);
    }
    println!(
        "injection: {changed} of {} payloads changed structure ({} problems in all)",
        payloads.len(),
        problems.len()
    );
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn a_payload_over_the_output_cap_fails_cleanly() {
    let rule = compile(&test_limits());
    // One position alone is over the cap.
    let huge = Json::String("\"".repeat(OUTPUT_CAP / 2 + 1));
    let err = render(&rule, &huge).expect_err("over the output cap");
    assert_eq!(err.file, "templates/probe.yaml", "{err}");
    assert!(
        err.message.contains("larger than the limit"),
        "not a clear message: {err}"
    );
    assert!(
        err.to_string().len() < 1000,
        "the error repeats the payload: {err:.200}"
    );
}

#[test]
fn the_default_output_cap_rejects_a_value_over_it() {
    // Under the default limits a single 2 MiB value fails with the same clear error.
    let rule = compile(&Limits::default());
    let err = rule
        .render(
            &parent(&Json::String("x".repeat(2 << 20))),
            &Observed::default(),
            &|_| Scope::Namespaced,
        )
        .expect_err("over the default cap");
    assert!(
        err.to_string().starts_with("templates/probe.yaml")
            && err
                .message
                .contains("larger than the limit of 1048576 bytes"),
        "{err}"
    );
}
