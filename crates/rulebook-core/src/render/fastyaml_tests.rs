//! The fast reader against the full parser: hand-picked cases both ways, and documents
//! generated from the pieces templates and tenants produce (`render::fastyaml`).

use super::*;
use serde_json::json;

/// What the full parser (with the render budget) makes of `text`: one document.
fn full(text: &str) -> Option<Json> {
    let docs: Vec<Json> = serde_saphyr::from_multiple_with_options(
        text,
        super::super::children::rendered_yaml_options(),
    )
    .ok()?;
    let mut docs: Vec<Json> = docs.into_iter().filter(|d| !d.is_null()).collect();
    (docs.len() == 1).then(|| docs.remove(0))
}

/// Where the fast reader answers, the full parser agrees; returns whether it answered.
fn agrees(text: &str) -> bool {
    match parse(text) {
        None => false,
        Some(fast) => {
            assert_eq!(
                Some(&fast),
                full(text).as_ref(),
                "fast reader differs on:\n{text}"
            );
            true
        }
    }
}

#[test]
fn plain_templates_are_read_fast_and_as_the_full_parser_reads_them() {
    for text in [
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: \"web-config\"\n  labels:\n    app: \"web\"\ndata:\n  size: \"3\"\n  data: \"x\\ny\"\n",
        "apiVersion: v1\nkind: Service\nmetadata:\n  name: \"x\"\nspec:\n  # headless\n  clusterIP: None\n  ports:\n    - name: http\n      port: 80\n      targetPort: 8080\n    - {name: b, port: -1}\n",
        "a:\n- 1\n- two\n- [x, \"y\", {z: 0}]\nb: {\"k\":\"v\",\"n\":[1,2]}   # comment\nc:\nd: null\ne: true\nf: false\n",
        "  indented: top\n  list:\n  - a\n  -\n    nested: map\n  - - skipped\n",
        "spec:\n  replicas: 3\n  selector: { matchLabels: { app: \"web\" } }\n  template:\n    metadata: { labels: { app: \"web\" } }\n    spec: { containers: [ { name: app, image: \"nginx:1.25\" } ] }\n",
        "k: 'it''s'\n'q k': \"\\u00e9\\u0085\\t\\\"\\\\\\/\"\nempty: \"\"\nsp: a b c\n",
    ] {
        // The one with `- - skipped` is for the full parser; the others are read fast.
        assert_eq!(agrees(text), !text.contains("- - "), "{text}");
    }
}

#[test]
fn what_yaml_reads_otherwise_is_left_to_the_full_parser() {
    for text in [
        "a: yes\n",
        "a: No\n",
        "a: ON\n",
        "a: ~\n",
        "a: True\n",
        "a: 1.5\n",
        "a: 1e3\n",
        "a: 0x1f\n",
        "a: 0o17\n",
        "a: 012\n",
        "a: -0\n",
        "a: .inf\n",
        "a: inf\n",
        "a: 12:30\n",
        "a: 99999999999999999999\n",
        "a: &x 1\nb: *x\n",
        "a: !!str 1\n",
        "a: |\n  text\n",
        "a: >\n  text\n",
        "a: \"multi\n  line\"\n",
        "a: plain\n  more\n",
        "a: 1\na: 2\n",
        "---\na: 1\n",
        "a: 1\n---\nb: 2\n",
        "? a\n: b\n",
        "a: \"\\x41\"\n",
        "a: \"\\ud83d\\ude00\"\n",
        "a: \"\\N\"\n",
        "a:\tb\n",
        "a: b\r\n",
        "a: b\u{85}c\n",
        "a: \u{feff}b\n",
        "a: [1, 2, ]\n",
        "a: {b}\n",
        "a: {b:c}\n",
        "a: [1,\n  2]\n",
        "80: x\n",
        "true: x\n",
        "a: %x\n",
        "a: @x\n",
        "a: `x\n",
        "a: x#y\n",
        "a: it's\n",
        "- a\n- b\n",
        "\"just a string\"\n",
        "a: 1\n b: 2\n",
    ] {
        assert!(parse(text).is_none(), "read fast: {text:?}");
    }
}

/// A small deterministic generator (xorshift) of YAML-ish documents from pieces that
/// templates and tenants produce, tricky words among them.
struct Gen(u64);

impl Gen {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[(self.next() % items.len() as u64) as usize]
    }
    fn scalar(&mut self) -> String {
        const WORDS: &[&str] = &[
            "a",
            "web",
            "a b",
            "a  b",
            "yes",
            "no",
            "on",
            "Off",
            "y",
            "N",
            "~",
            "null",
            "Null",
            "true",
            "False",
            "TRUE",
            "0",
            "7",
            "-3",
            "01",
            "-0",
            "1.5",
            "1e3",
            "0x1F",
            "0o7",
            ".inf",
            "-.inf",
            ".NaN",
            "inf",
            "nan",
            "12:30",
            "a:b",
            "a: b",
            "x#y",
            "x #y",
            "-x",
            "@x",
            "!x",
            "&x",
            "*x",
            "%x",
            "|",
            ">",
            "it's",
            "/path/x",
            "_u",
            "v1.2.3",
            "nginx:1.25",
            "9223372036854775807",
            "9223372036854775808",
            "a/b-c_d.e",
        ];
        match self.next() % 4 {
            0 => {
                // A value as the template engine prints it: one JSON scalar.
                let s: String = (0..(self.next() % 6))
                    .map(|_| {
                        let c = self.pick(&[
                            "a", " ", "\"", "\\", "\n", "\t", "\u{0}", "\u{1b}", "é", "\u{85}",
                            "\u{2028}", "\u{feff}", "😀", ":", "#", "'", "{", "]", "- ", "\u{7f}",
                        ]);
                        c.to_string()
                    })
                    .collect();
                crate::render::yaml_safe(&serde_json::to_string(&s).unwrap_or_default())
                    .into_owned()
            }
            1 => format!("'{}'", self.pick(WORDS).replace('\'', "''")),
            _ => self.pick(WORDS).to_string(),
        }
    }
    fn flow(&mut self, depth: usize) -> String {
        match (self.next() % 5, depth < 3) {
            (0, true) => {
                let items: Vec<String> =
                    (0..self.next() % 3).map(|_| self.flow(depth + 1)).collect();
                format!("[{}]", items.join(self.pick(&[", ", ",", " , "])))
            }
            (1, true) => {
                let items: Vec<String> = (0..self.next() % 3)
                    .map(|i| {
                        let key = self.pick(&["k", "\"q\"", "a b", "yes", "1", "'s'"]);
                        format!(
                            "{key}{i}{}{}",
                            self.pick(&[": ", ":", " : "]),
                            self.flow(depth + 1)
                        )
                    })
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            _ => self.scalar(),
        }
    }
    fn block(&mut self, indent: usize, depth: usize, out: &mut String) {
        let pad = " ".repeat(indent);
        let seq = depth > 0 && self.next().is_multiple_of(3);
        for i in 0..1 + self.next() % 4 {
            let head = if seq {
                format!("{pad}-{}", self.pick(&[" ", "  "]))
            } else {
                let key = self.pick(&[
                    "key",
                    "app.kubernetes.io/name",
                    "\"quoted key\"",
                    "k",
                    "yes",
                    "80",
                    "dup",
                ]);
                format!("{pad}{key}{i}:")
            };
            match (self.next() % 4, depth < 4) {
                (1, true) if seq => {
                    // A compact mapping: `- a: x` with its other keys under `a`.
                    let inner = indent + head.len() - pad.len();
                    let mut nested = String::new();
                    self.block(inner, depth + 1, &mut nested);
                    let nested = nested.get(inner..).unwrap_or_default();
                    out.push_str(&format!("{head}{nested}"));
                }
                (0, true) => {
                    out.push_str(head.trim_end());
                    out.push('\n');
                    let step = self.pick(&["2", "4", "1"]).parse::<usize>().unwrap_or(2);
                    self.block(indent + step, depth + 1, out);
                }
                _ => {
                    let sep = if seq { "" } else { " " };
                    out.push_str(&format!("{head}{sep}{}", self.flow(0)));
                    if self.next().is_multiple_of(5) {
                        out.push_str(self.pick(&[" # note", "#not", "  # x: y"]));
                    }
                    out.push('\n');
                }
            }
        }
    }
}

#[test]
fn generated_documents_read_fast_as_the_full_parser_reads_them() {
    // FASTYAML_SEED and FASTYAML_DOCS run other and longer series by hand.
    let seed = std::env::var("FASTYAML_SEED")
        .ok()
        .and_then(|s| s.parse().ok());
    let mut g = Gen(seed.unwrap_or(0x9e37_79b9_7f4a_7c15));
    let mut fast = 0;
    let total = std::env::var("FASTYAML_DOCS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20_000);
    for _ in 0..total {
        let mut text = String::new();
        g.block(0, 0, &mut text);
        if agrees(&text) {
            fast += 1;
        }
    }
    // The generator is tricky on purpose, but a good share must still be read fast,
    // or this test would pass with a reader that never answers.
    eprintln!("{fast} of {total} generated documents read fast");
    assert!(fast > total / 10, "only {fast} of {total} read fast");
}

/// The full parser's own limits (found by a review): a key over 1,024 characters, nesting
/// past 64 through compact mappings, more than 32 comments in a row, more than its
/// 250,000 events. The fast reader leaves each of them to it.
#[test]
fn the_full_parsers_limits_are_left_to_it() {
    let long = "a".repeat(1023);
    let mut deep = String::from("a:\n");
    for i in 0..40 {
        deep += &format!("{}- k:\n", "  ".repeat(i));
    }
    let many_keys: String = (0..84_000).map(|i| format!("\"k{i}\": {{}}\n")).collect();
    for text in [
        format!("\"{long}\": 1\n"),
        format!("x: 1\n{long}: 1\n"),
        format!("x: {{\"{long}\":1}}\n"),
        format!("l:\n- \"{long}\": v\n"),
        deep,
        format!("spec:\n{}  replicas: 1\n", "  # doc\n".repeat(33)),
        format!("spec: # one\n{}  replicas: 1\n", "  # doc\n".repeat(32)),
        many_keys,
    ] {
        assert!(parse(&text).is_none(), "read fast: {:.80}", text);
    }
    // Below the limits, still fast and the same.
    let short = "a".repeat(400);
    assert!(agrees(&format!("\"{short}\": 1\nx: {{\"{short}\":1}}\n")));
    assert!(agrees(&format!(
        "spec:\n{}  replicas: 1\n",
        "  # doc\n".repeat(10)
    )));
}

#[test]
fn the_byte_scan_finds_exactly_the_unusual_characters() {
    let samples = [
        "a: b\n",
        "tab\there",
        "cr\r",
        "del\u{7f}",
        "nel\u{85}",
        "c1\u{9f}",
        "nbsp\u{a0}",
        "ls\u{2028}",
        "ps\u{2029}",
        "euro\u{20ac}",
        "dash\u{2013}",
        "bom\u{feff}",
        "fffe\u{fffe}",
        "ffff\u{ffff}",
        "repl\u{fffd}",
        "e\u{e9}",
        "emoji\u{1f600}",
        "nul\u{0}",
        "bell\u{7}",
        "\u{ff5e}wide",
        "",
    ];
    for s in samples {
        assert_eq!(has_unusual(s), s.chars().any(unusual), "{s:?}");
    }
}

/// Plain scalars whose YAML 1.1 reading (kubectl's, through `sigs.k8s.io/yaml`) differs
/// from YAML 1.2's, or might: the full parser reads them as kubectl does
/// (tests/kubectl_yaml.rs compares with kubectl itself).
#[test]
fn rendered_scalars_read_as_kubectl_reads_them() {
    for (s, want) in [
        ("0400", json!(256)),
        ("0755", json!(493)),
        ("-010", json!(-8)),
        ("0800", json!(800.0)),
        ("yes", json!(true)),
        ("No", json!(false)),
        ("on", json!(true)),
        ("OFF", json!(false)),
        ("y", json!(true)),
        ("0x1F", json!(31)),
        ("1e3", json!(1000.0)),
        ("0o17", json!(15)),
        ("0b101", json!(5)),
        ("190:20:30", json!("190:20:30")),
        ("~", json!(null)),
    ] {
        let doc = format!("a: {s}\n");
        assert_eq!(
            full(&doc).map(|j| j["a"].clone()),
            Some(want.clone()),
            "{s}"
        );
        // The fast reader leaves every one of them to the full parser, or agrees.
        agrees(&doc);
    }
}
