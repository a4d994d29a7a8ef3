//! Subset matching of expectations: every field an expectation writes must be in the
//! actual object with that value; fields it does not write are not looked at (so
//! Rulebook's own labels and annotations are ignored unless a test names them). Lists
//! whose expected items all have a `name` (or all a `type`, as conditions do) are matched
//! by that key, other lists by position. An expected `null` means "absent".

use serde_json::{Map, Value as Json};

/// Every way `actual` fails to hold `expected`, as `path: expected …, got …`.
pub fn mismatches(expected: &Json, actual: &Json) -> Vec<String> {
    let mut out = Vec::new();
    walk("", expected, Some(actual), &mut out);
    out
}

/// The key an expected list is matched by: `name` or `type`, when every expected item has
/// it and no value repeats in either list (else items are matched by position).
fn list_key(expected: &[Json], actual: &[Json]) -> Option<&'static str> {
    let unique = |items: &[Json], k: &str| {
        let mut seen = std::collections::HashSet::new();
        items
            .iter()
            .filter_map(|i| i.get(k))
            .all(|v| seen.insert(v.to_string()))
    };
    ["name", "type"].into_iter().find(|k| {
        !expected.is_empty()
            && expected
                .iter()
                .all(|i| i.get(*k).is_some_and(Json::is_string))
            && unique(expected, k)
            && unique(actual, k)
    })
}

fn short(v: &Json) -> String {
    let s = v.to_string();
    crate::meta::truncate(&s, 80)
}

fn walk(path: &str, expected: &Json, actual: Option<&Json>, out: &mut Vec<String>) {
    let at = |p: &str| {
        if p.is_empty() {
            "(the object)".to_string()
        } else {
            p.to_string()
        }
    };
    match (expected, actual) {
        (Json::Null, None | Some(Json::Null)) => {}
        (_, None) => out.push(format!(
            "{}: missing (expected {})",
            at(path),
            short(expected)
        )),
        (Json::Object(e), Some(Json::Object(a))) => {
            for (k, ev) in e {
                walk(&join(path, k), ev, a.get(k), out);
            }
        }
        (Json::Array(e), Some(Json::Array(a))) => match list_key(e, a) {
            Some(key) => {
                for item in e {
                    let id = &item[key];
                    let found = a.iter().find(|x| x.get(key) == Some(id));
                    let p = format!("{}[{key}={}]", at(path), id.as_str().unwrap_or(""));
                    walk(&p, item, found, out);
                }
            }
            None => {
                if e.len() != a.len() {
                    out.push(format!(
                        "{}: {} items expected, got {}",
                        at(path),
                        e.len(),
                        a.len()
                    ));
                }
                for (i, item) in e.iter().enumerate() {
                    walk(&format!("{}[{i}]", at(path)), item, a.get(i), out);
                }
            }
        },
        (e, Some(a)) if same_number(e, a) => {}
        (e, Some(a)) if e != a => out.push(format!(
            "{}: expected {}, got {}",
            at(path),
            short(e),
            short(a)
        )),
        _ => {}
    }
}

/// `1` and `1.0` are the same number; two integers are compared exactly.
fn same_number(e: &Json, a: &Json) -> bool {
    let (Json::Number(x), Json::Number(y)) = (e, a) else {
        return false;
    };
    if let (Some(i), Some(j)) = (x.as_i64(), y.as_i64()) {
        return i == j;
    }
    if let (Some(i), Some(j)) = (x.as_u64(), y.as_u64()) {
        return i == j;
    }
    let integer = |n: &serde_json::Number| n.is_i64() || n.is_u64();
    !(integer(x) && integer(y)) && x.as_f64() == y.as_f64()
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

/// `actual` cut down to the fields `expected` writes (lists matched as [`mismatches`]
/// does), for a diff that shows only what the expectation is about.
pub fn project(expected: &Json, actual: &Json) -> Json {
    match (expected, actual) {
        (Json::Object(e), Json::Object(a)) => {
            let mut out = Map::new();
            for (k, ev) in e {
                if let Some(av) = a.get(k) {
                    out.insert(k.clone(), project(ev, av));
                }
            }
            Json::Object(out)
        }
        (Json::Array(e), Json::Array(a)) => match list_key(e, a) {
            Some(key) => Json::Array(
                e.iter()
                    .filter_map(|item| {
                        let found = a.iter().find(|x| x.get(key) == item.get(key))?;
                        Some(project(item, found))
                    })
                    .collect(),
            ),
            None => Json::Array(
                a.iter()
                    .enumerate()
                    .map(|(i, av)| e.get(i).map_or_else(|| av.clone(), |ev| project(ev, av)))
                    .collect(),
            ),
        },
        (_, a) => a.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn subsets_match_and_differences_are_named() {
        let actual = json!({"kind": "Service", "metadata": {"name": "a", "labels": {"x": "1"}},
                            "spec": {"type": "NodePort", "ports": [{"port": 80}, {"port": 81}]},
                            "status": {"conditions": [{"type": "A", "status": "False"}, {"type": "Ready", "status": "True"}]}});
        assert!(mismatches(&json!({"spec": {"type": "NodePort"}}), &actual).is_empty());
        assert!(
            mismatches(
                &json!({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
                &actual
            )
            .is_empty()
        );
        assert_eq!(
            mismatches(
                &json!({"spec": {"type": "ClusterIP", "ports": [{"port": 80}]}, "data": null}),
                &actual
            ),
            vec![
                "spec.ports: 1 items expected, got 2".to_string(),
                "spec.type: expected \"ClusterIP\", got \"NodePort\"".to_string(),
            ]
        );
        assert_eq!(
            mismatches(&json!({"metadata": {"annotations": {"y": "2"}}}), &actual),
            vec!["metadata.annotations: missing (expected {\"y\":\"2\"})".to_string()]
        );
        // Two expected items of one name are not both satisfied by one actual item:
        // repeated keys are matched by position.
        let mounts = json!({"m": [{"name": "v", "path": "/a"}, {"name": "v", "path": "/b"}]});
        let both = json!({"m": [{"name": "v", "path": "/a"}, {"name": "v", "path": "/b"}]});
        let twice = json!({"m": [{"name": "v", "path": "/b"}, {"name": "v", "path": "/b"}]});
        assert!(mismatches(&both, &mounts).is_empty());
        assert!(!mismatches(&twice, &mounts).is_empty());
        // Integers are compared exactly; 1 and 1.0 are the same number.
        let big = |n: u64| json!({ "n": n });
        assert!(!mismatches(&big(9007199254740993), &big(9007199254740992)).is_empty());
        assert!(mismatches(&json!({"n": 1}), &json!({"n": 1.0})).is_empty());
        assert_eq!(
            project(
                &json!({"spec": {"type": "x"}, "status": {"conditions": [{"type": "Ready"}]}}),
                &actual
            ),
            json!({"spec": {"type": "NodePort"}, "status": {"conditions": [{"type": "Ready"}]}})
        );
    }
}
