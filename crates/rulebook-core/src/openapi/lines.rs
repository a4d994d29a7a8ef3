//! Which template line a rendered field most likely comes from, for a schema problem's
//! `file:line`.
//!
//! The renderer keeps no source map: minijinja knows the template line of an error it
//! raises (an undefined value printed, a failed filter), not which template line wrote
//! which output byte. So this reads the template's text as the YAML it mostly is: each
//! line `key:` (or `- key:`) gets the path of keys above it by indentation, and the
//! problem's path (its list indices dropped) is looked up. A key written as an
//! expression (`{{ name }}:`) matches any key; lines that are only template tags,
//! comments or a block scalar's text are skipped. The exact path's first line wins;
//! without one, the line of its longest prefix (for a missing field, the object that
//! lacks it); without any, line 1. A template that builds its YAML in a macro or an
//! include gets the nearest line its own text has.

use super::Segment;

/// One `key:` line of a template: its 1-based line and the keys down to it.
#[derive(Debug)]
struct KeyLine {
    line: u64,
    keys: Vec<String>,
}

/// The template line of `path` (see the module doc); 1 when nothing matches.
pub fn line_of(template: &str, path: &[Segment]) -> u64 {
    let want: Vec<&str> = path
        .iter()
        .filter_map(|s| match s {
            Segment::Key(k) => Some(k.as_str()),
            Segment::Index(_) => None,
        })
        .collect();
    let lines = key_lines(template);
    for n in (1..=want.len()).rev() {
        if let Some(l) = lines
            .iter()
            .find(|l| l.keys.len() == n && matches(&l.keys, &want[..n]))
        {
            return l.line;
        }
    }
    1
}

fn matches(keys: &[String], want: &[&str]) -> bool {
    keys.iter()
        .zip(want)
        .all(|(k, w)| k == w || k.contains("{{"))
}

/// Every `key:` line with its path of keys.
fn key_lines(template: &str) -> Vec<KeyLine> {
    let mut out = Vec::new();
    // (column of the key, key)
    let mut stack: Vec<(usize, String)> = Vec::new();
    // Inside a block scalar: lines indented more than this are its text.
    let mut block: Option<usize> = None;
    for (i, raw) in template.lines().enumerate() {
        let text = raw.trim_end();
        let body = text.trim_start();
        let indent = text.len() - body.len();
        if body.is_empty() {
            continue;
        }
        if let Some(b) = block {
            if indent > b {
                continue;
            }
            block = None;
        }
        if is_only_tags(body) || body.starts_with('#') {
            continue;
        }
        // `- - key:` and `- key:`: the key's column is after the dashes.
        let mut col = indent;
        let mut rest = body;
        while let Some(r) = rest.strip_prefix("- ") {
            let trimmed = r.trim_start();
            col += rest.len() - trimmed.len();
            rest = trimmed;
        }
        let Some((key, value)) = split_key(rest) else {
            // A list item's block scalar (`- |`): its text is indented past the dash.
            if rest.starts_with('|') || rest.starts_with('>') {
                block = Some(indent);
            }
            continue;
        };
        while stack.last().is_some_and(|(c, _)| *c >= col) {
            stack.pop();
        }
        stack.push((col, key));
        out.push(KeyLine {
            line: i as u64 + 1,
            keys: stack.iter().map(|(_, k)| k.clone()).collect(),
        });
        let v = value.trim();
        if v.starts_with('|') || v.starts_with('>') {
            block = Some(col);
        }
    }
    out
}

/// A line of nothing but `{% … %}` and `{# … #}` tags.
fn is_only_tags(body: &str) -> bool {
    let mut rest = body;
    while !rest.is_empty() {
        let close = if rest.starts_with("{%") {
            "%}"
        } else if rest.starts_with("{#") {
            "#}"
        } else {
            return false;
        };
        match rest.find(close) {
            Some(end) => rest = rest[end + 2..].trim_start(),
            None => return true,
        }
    }
    true
}

/// `key: value` or `key:` → (key without quotes, value); `None` for anything else (a
/// list item's scalar, a flow collection, a line continuing a scalar).
fn split_key(rest: &str) -> Option<(String, &str)> {
    let (key, value) = if let Some(q) = rest.strip_prefix('"') {
        let end = q.find('"')?;
        let after = q[end + 1..].strip_prefix(':')?;
        (q[..end].to_string(), after)
    } else if let Some(q) = rest.strip_prefix('\'') {
        let end = q.find('\'')?;
        let after = q[end + 1..].strip_prefix(':')?;
        (q[..end].to_string(), after)
    } else {
        // The first `: ` (or a final `:`) outside an expression.
        let mut depth = 0i32;
        let bytes = rest.as_bytes();
        let mut split = None;
        for (i, &b) in bytes.iter().enumerate() {
            match b {
                b'{' => depth += 1,
                b'}' => depth -= 1,
                b':' if depth <= 0 && (i + 1 == bytes.len() || bytes[i + 1] == b' ') => {
                    split = Some(i);
                    break;
                }
                _ => {}
            }
        }
        let i = split?;
        (rest[..i].trim().to_string(), &rest[i + 1..])
    };
    if key.is_empty() || (key.starts_with(['{', '[']) && !key.starts_with("{{")) {
        return None;
    }
    if !value.is_empty() && !value.starts_with(' ') {
        return None;
    }
    Some((key, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(p: &str) -> Vec<Segment> {
        p.split('.')
            .map(|s| match s.parse::<usize>() {
                Ok(i) => Segment::Index(i),
                Err(_) => Segment::Key(s.to_string()),
            })
            .collect()
    }

    const DEPLOYMENT: &str = "\
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ parent.metadata.name }}
  labels:
    {{ key }}: x
spec:
  replicas: {{ parent.spec.replicas }}
  template:
    spec:
      containers:
        {% for c in parent.spec.containers %}
        - name: {{ c.name }}
          image: \"{{ c.image }}\"
          command:
          - sh
          - -c
          - |
            echo image: nope
            exit 1
          env:
            - name: A
        {% endfor %}
  selector: {}
";

    #[test]
    fn a_field_is_found_at_its_key() {
        assert_eq!(line_of(DEPLOYMENT, &path("spec.replicas")), 8);
        assert_eq!(
            line_of(DEPLOYMENT, &path("spec.template.spec.containers.0.image")),
            14
        );
        assert_eq!(
            line_of(
                DEPLOYMENT,
                &path("spec.template.spec.containers.0.env.0.name")
            ),
            22
        );
        assert_eq!(line_of(DEPLOYMENT, &path("spec.selector")), 24);
    }

    #[test]
    fn an_expression_key_matches_any_and_a_missing_field_points_at_its_object() {
        assert_eq!(line_of(DEPLOYMENT, &path("metadata.labels.app")), 6);
        assert_eq!(line_of(DEPLOYMENT, &path("spec.strategy")), 7);
        assert_eq!(
            line_of(DEPLOYMENT, &path("spec.template.spec.containers.0.ports")),
            11
        );
        assert_eq!(line_of(DEPLOYMENT, &path("status.replicas")), 1);
    }

    #[test]
    fn block_scalars_and_tags_are_not_keys() {
        let lines = key_lines(DEPLOYMENT);
        assert!(
            lines
                .iter()
                .all(|l| !l.keys.contains(&"echo image".to_string()))
        );
        assert!(is_only_tags("{% if x %}{# c #}"));
        assert!(!is_only_tags("{{ x }}: 1"));
        assert_eq!(split_key("\"a.b/c\": d").map(|k| k.0), Some("a.b/c".into()));
        assert_eq!(split_key("http://x"), None);
    }
}
