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

/// The key lists of `items` are matched by: `name` or `type`, when every item has it.
fn list_key(items: &[Json]) -> Option<&'static str> {
    ["name", "type"]
        .into_iter()
        .find(|k| !items.is_empty() && items.iter().all(|i| i.get(*k).is_some_and(Json::is_string)))
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
        (Json::Array(e), Some(Json::Array(a))) => match list_key(e) {
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

fn same_number(e: &Json, a: &Json) -> bool {
    match (e.as_f64(), a.as_f64()) {
        (Some(x), Some(y)) => e.is_number() && a.is_number() && x == y,
        _ => false,
    }
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
        (Json::Array(e), Json::Array(a)) => match list_key(e) {
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
        assert_eq!(
            project(
                &json!({"spec": {"type": "x"}, "status": {"conditions": [{"type": "Ready"}]}}),
                &actual
            ),
            json!({"spec": {"type": "NodePort"}, "status": {"conditions": [{"type": "Ready"}]}})
        );
    }
}
