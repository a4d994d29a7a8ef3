//! Tests of the function library: kro's values for the same inputs, and hostile
//! inputs (huge, deep, malformed, out of range) giving errors, never panics.
//!
//! kro's own tests compute their expectations with Go's standard library
//! (`hash/fnv`, `crypto/sha256`) and only check seededString's alphabet and length;
//! the literal values below were computed with Go 1.x from kro's algorithm and the
//! standard library for the inputs of kro's tests ("hello world", "", "test-seed").

use super::*;
use crate::render::ParentBudget;
use crate::render::env::environment;
use crate::render::limits::Limits;

fn render(template: &str) -> Result<String, Error> {
    let limits = Limits::default();
    let env = environment(&limits);
    let mut budget = ParentBudget::new(&limits);
    let _active = budget.enter();
    env.render_str(template, minijinja::context! {})
}

fn ok(template: &str) -> String {
    render(template).unwrap_or_else(|e| panic!("{template}: {e:#}"))
}

fn err(template: &str) -> String {
    match render(template) {
        Ok(out) => panic!("{template} rendered {out:?}"),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn digests_equal_kros_hash_library() {
    // hash.fnv64a / hash.sha256 of kro's test inputs, hex and base64.encode(...).
    assert_eq!(
        ok(r#"{{ "hello world" | fnv64a }}"#),
        r#""779a65e7023cd2e7""#
    );
    assert_eq!(ok(r#"{{ "" | fnv64a }}"#), r#""cbf29ce484222325""#);
    assert_eq!(
        ok(r#"{{ "hello world" | fnv64a(encoding="base64") }}"#),
        r#""d5pl5wI80uc=""#
    );
    assert_eq!(
        ok(r#"{{ "" | fnv64a(encoding="base64") }}"#),
        r#""y/Kc5IQiIyU=""#
    );
    assert_eq!(
        ok(r#"{{ "hello world" | sha256 }}"#),
        r#""b94d27b9934d3e08a52e52d7da7dabfac484efe37a5380ee9088f7ace2efcde9""#
    );
    assert_eq!(
        ok(r#"{{ "hello world" | sha256(encoding="base64") }}"#),
        r#""uU0nuZNNPgilLlLX2n2r+sSE7+N6U4DukIj3rOLvzek=""#
    );
    assert_eq!(
        ok(r#"{{ "" | sha256(encoding="base64") }}"#),
        r#""47DEQpj8HBSa+/TImW+5JCeuQeRkm5NMpJWZG3hSuFU=""#
    );
    assert!(err(r#"{{ "x" | sha256(encoding="rot13") }}"#).contains("hex\" or \"base64"));
    assert!(err(r#"{{ "x" | fnv64a(colour="red") }}"#).contains("colour"));
}

#[test]
fn seeded_random_string_equals_kros_seeded_string() {
    assert_eq!(
        ok(r#"{{ seeded_random_string("test-seed", 10) }}"#),
        r#""5czheg3o5c""#
    );
    assert_eq!(seeded_string(b"test-seed", 20), "5czheg3o5czheg3o5czh");
    assert_eq!(
        seeded_string(b"different-seed", 40),
        "molvf9mxmolvf9mxmolvf9mxmolvf9mxmolvf9mx"
    );
    assert_eq!(seeded_string(b"", 1), "e");
    for bad in [
        "0",
        "-1",
        "-9223372036854775808",
        "1025",
        "9223372036854775807",
    ] {
        let e = err(&format!(r#"{{{{ seeded_random_string("s", {bad}) }}}}"#));
        assert!(e.contains("between 1 and 1024"), "{bad}: {e}");
    }
    assert!(!err(r#"{{ seeded_random_string("s", "10") }}"#).is_empty());
    assert_eq!(
        ok(r#"{{ seeded_random_string("s", 1024) | length }}"#),
        "1024"
    );
}

#[test]
fn from_json_and_to_json_round_trip_and_are_bounded() {
    assert_eq!(
        ok(r#"{{ ('{"a": [1, 2, {"b": true}]}' | from_json).a[2].b }}"#),
        "true"
    );
    assert_eq!(
        ok(r#"{{ '{"a":1}' | from_json | to_json }}"#),
        r#""{\"a\":1}""#
    );
    assert_eq!(ok(r#"{{ '[1]' | from_json | tojson }}"#), "[1]");
    let e = err(r#"{{ '{"password": "hunter2"' | from_json }}"#);
    assert!(
        e.contains("not valid JSON") && !e.contains("hunter2"),
        "{e}"
    );
    // Deep: rejected before parsing, whatever the depth.
    let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
    let e = from_json_direct(&deep).unwrap_err();
    assert!(format!("{e:#}").contains("deeper than 64"), "{e:#}");
    let ok64 = format!("{}{}", "[".repeat(64), "]".repeat(64));
    assert!(from_json_direct(&ok64).is_ok());
    // Brackets inside strings do not count.
    assert!(from_json_direct(&format!("\"{}\"", "[".repeat(1000))).is_ok());
    // Huge: rejected by size.
    let huge = format!("\"{}\"", "x".repeat(MAX_JSON_INPUT));
    let e = from_json_direct(&huge).unwrap_err();
    assert!(format!("{e:#}").contains("more than the limit"), "{e:#}");
}

/// `from_json` called through a template with the text in the context.
fn from_json_direct(text: &str) -> Result<String, Error> {
    let limits = Limits::default();
    let env = environment(&limits);
    let mut budget = ParentBudget::new(&limits);
    let _active = budget.enter();
    env.render_str(
        "{{ t | from_json | length }}",
        minijinja::context! { t => text },
    )
}

#[test]
fn b64_round_trips_and_rejects_non_utf8() {
    assert_eq!(ok(r#"{{ "héllo" | b64encode | b64decode }}"#), r#""héllo""#);
    // 0xff 0xfe is valid base64 of bytes that are not UTF-8.
    assert!(err(r#"{{ "//4=" | b64decode }}"#).contains("not UTF-8"));
    assert!(err(r#"{{ "@@@" | b64decode }}"#).contains("not valid base64"));
}

#[test]
fn quantities_parse_as_kubernetes_reads_them() {
    let cases = [
        ("500m", "0.5"),
        ("2Gi", "2147483648"),
        ("1e3", "1000"),
        ("1E-3", "0.001"),
        ("1.5", "1.5"),
        ("-2k", "-2000"),
        ("128Mi", "134217728"),
        ("3", "3"),
        ("1E", "1000000000000000000"),
    ];
    for (q, want) in cases {
        assert_eq!(ok(&format!(r#"{{{{ "{q}" | quantity }}}}"#)), want, "{q}");
    }
    assert_eq!(ok(r#"{{ quantity("500m") < quantity("1") }}"#), "true");
    assert_eq!(ok(r#"{{ quantity("1Gi") > quantity("1G") }}"#), "true");
    assert_eq!(ok(r#"{{ 7 | quantity }}"#), "7");
    for bad in [
        "", "Gi", "1.2.3", "1Gb", "1e", "1e99999", "1e400", ".", "--1", "1 Gi", "m1",
    ] {
        let e = err(&format!(r#"{{{{ "{bad}" | quantity }}}}"#));
        assert!(e.contains("not a Kubernetes quantity"), "{bad:?}: {e}");
    }
    assert!(parse_quantity(&"9".repeat(10_000)).is_none());
    assert!(err(r#"{{ [1] | quantity }}"#).contains("not a string or number"));
}

#[test]
fn semver_compare_orders_by_precedence() {
    let cases = [
        ("1.2.3", "1.2.4", "-1"),
        ("1.10.0", "1.9.0", "1"),
        ("v2.0.0", "2.0.0", "0"),
        ("1.0.0-alpha", "1.0.0", "-1"),
        ("1.0.0+build.1", "1.0.0+build.2", "0"),
    ];
    for (a, b, want) in cases {
        assert_eq!(
            ok(&format!(r#"{{{{ semver_compare("{a}", "{b}") }}}}"#)),
            want,
            "{a} {b}"
        );
    }
    assert!(err(r#"{{ semver_compare("1.2", "1.2.0") }}"#).contains("first argument"));
    assert!(err(r#"{{ semver_compare("1.2.0", "latest") }}"#).contains("second argument"));
    let long = "1".repeat(10_000);
    assert!(
        err(&format!(
            r#"{{{{ semver_compare("{long}.0.0", "1.0.0") }}}}"#
        ))
        .contains("first")
    );
}

#[test]
fn range_is_minijinjas_bounded_range() {
    assert_eq!(ok("{{ range(3) | list }}"), "[0,1,2]");
    assert!(!err("{{ range(100000000) | list }}").is_empty());
}

/// The examples of docs/reference/templates.md's Functions table work as written.
#[test]
fn documented_examples_render() {
    assert_eq!(ok(r#"{{ "2Gi" | quantity > quantity("1Gi") }}"#), "true");
    assert_eq!(
        ok(r#"{% if semver_compare("v1.31.2", "1.30.0") >= 0 %}new{% endif %}"#),
        "new"
    );
    assert_eq!(ok(r#"{{ ('{"replicas": 3}' | from_json).replicas }}"#), "3");
    assert_eq!(ok("{% for i in range(2) %}{{ i }}{% endfor %}"), "01");
}
