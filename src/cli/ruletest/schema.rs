//! What the API server does with a parent before Rulebook sees it, from the rule's
//! `spec.crd` schema: defaults (a missing property with a `default` gets it, in present
//! objects and list items too), then validation of the common OpenAPI keywords (`type`,
//! `required`, `enum`, `minimum`/`maximum`, `minLength`/`maxLength`, `minItems`/`maxItems`,
//! `pattern`), so a test can expect the error a tenant would get from `kubectl apply`.

use serde_json::Value as Json;

pub fn apply(schema: &Json, value: &mut Json) {
    match value {
        Json::Object(map) => {
            if let Some(props) = schema.get("properties").and_then(Json::as_object) {
                for (k, s) in props {
                    if !map.contains_key(k)
                        && let Some(d) = s.get("default")
                    {
                        map.insert(k.clone(), d.clone());
                    }
                    if let Some(v) = map.get_mut(k) {
                        apply(s, v);
                    }
                }
            }
            if let Some(extra) = schema.get("additionalProperties").filter(|s| s.is_object()) {
                for v in map.values_mut() {
                    apply(extra, v);
                }
            }
        }
        Json::Array(items) => {
            if let Some(s) = schema.get("items") {
                for v in items {
                    apply(s, v);
                }
            }
        }
        _ => {}
    }
}

/// The first problem of `value` against `schema`, as `path: message` (`path` is where
/// `value` sits, e.g. `spec`).
pub fn validate(schema: &Json, value: &Json, path: &str) -> Option<String> {
    type_problem(schema, value, path)
        .or_else(|| enum_problem(schema, value, path))
        .or_else(|| number_problem(schema, value, path))
        .or_else(|| string_problem(schema, value, path))
        .or_else(|| match value {
            Json::Object(map) => object_problem(schema, map, path),
            Json::Array(items) => array_problem(schema, items, path),
            _ => None,
        })
}

/// `type` (and `x-kubernetes-int-or-string`).
fn type_problem(schema: &Json, value: &Json, path: &str) -> Option<String> {
    let type_ok = match schema.get("type").and_then(Json::as_str) {
        Some("object") => value.is_object(),
        Some("array") => value.is_array(),
        Some("string") => value.is_string(),
        Some("integer") => value.is_i64() || value.is_u64(),
        Some("number") => value.is_number(),
        Some("boolean") => value.is_boolean(),
        _ => true,
    };
    let int_or_string = schema.get("x-kubernetes-int-or-string") == Some(&Json::Bool(true));
    if !type_ok && !(int_or_string && (value.is_string() || value.is_i64() || value.is_u64())) {
        return Some(format!(
            "{path}: Invalid value: {}: {path} in body must be of type {}",
            value,
            schema["type"].as_str().unwrap_or("?")
        ));
    }
    None
}

/// `enum`.
fn enum_problem(schema: &Json, value: &Json, path: &str) -> Option<String> {
    if let Some(options) = schema.get("enum").and_then(Json::as_array)
        && !options.contains(value)
    {
        return Some(format!("{path}: Unsupported value: {value}"));
    }
    None
}

/// A numeric keyword of `schema` (`minimum`, `maximum`).
fn num(schema: &Json, k: &str) -> Option<f64> {
    schema.get(k).and_then(Json::as_f64)
}

/// A count keyword of `schema` (`minLength`, `maxItems`, ...).
fn len(schema: &Json, k: &str) -> Option<u64> {
    schema.get(k).and_then(Json::as_u64)
}

/// `minimum` and `maximum`.
fn number_problem(schema: &Json, value: &Json, path: &str) -> Option<String> {
    let v = value.as_f64()?;
    if let Some(min) = num(schema, "minimum").filter(|m| v < *m) {
        return Some(format!(
            "{path}: Invalid value: {value}: {path} in body should be greater than or equal to {min}"
        ));
    }
    if let Some(max) = num(schema, "maximum").filter(|m| v > *m) {
        return Some(format!(
            "{path}: Invalid value: {value}: {path} in body should be less than or equal to {max}"
        ));
    }
    None
}

/// `minLength`, `maxLength` and `pattern`.
fn string_problem(schema: &Json, value: &Json, path: &str) -> Option<String> {
    let text = value.as_str()?;
    let n = text.chars().count() as u64;
    if let Some(min) = len(schema, "minLength").filter(|m| n < *m) {
        return Some(format!(
            "{path}: Invalid value: {value}: {path} in body should be at least {min} chars long"
        ));
    }
    if let Some(max) = len(schema, "maxLength").filter(|m| n > *m) {
        return Some(format!(
            "{path}: Too long: may not be more than {max} bytes"
        ));
    }
    if let Some(p) = schema.get("pattern").and_then(Json::as_str)
        && let Ok(re) = regex::Regex::new(p)
        && !re.is_match(text)
    {
        return Some(format!(
            "{path}: Invalid value: {value}: {path} in body should match '{p}'"
        ));
    }
    None
}

/// `required`, then each property against its own schema (or `additionalProperties`).
fn object_problem(
    schema: &Json,
    map: &serde_json::Map<String, Json>,
    path: &str,
) -> Option<String> {
    for r in schema
        .get("required")
        .and_then(Json::as_array)
        .into_iter()
        .flatten()
    {
        if let Some(k) = r.as_str()
            && !map.contains_key(k)
        {
            return Some(format!("{path}.{k}: Required value"));
        }
    }
    let props = schema.get("properties").and_then(Json::as_object);
    for (k, v) in map {
        let sub = props
            .and_then(|p| p.get(k))
            .or_else(|| schema.get("additionalProperties").filter(|s| s.is_object()));
        if let Some(sub) = sub
            && let Some(problem) = validate(sub, v, &format!("{path}.{k}"))
        {
            return Some(problem);
        }
    }
    None
}

/// `minItems`, `maxItems`, then each item against `items`.
fn array_problem(schema: &Json, items: &[Json], path: &str) -> Option<String> {
    if let Some(min) = len(schema, "minItems").filter(|m| (items.len() as u64) < *m) {
        return Some(format!(
            "{path}: Invalid value: {path} in body should have at least {min} items"
        ));
    }
    if let Some(max) = len(schema, "maxItems").filter(|m| (items.len() as u64) > *m) {
        return Some(format!(
            "{path}: Too many: {}: must have at most {max} items",
            items.len()
        ));
    }
    let sub = schema.get("items")?;
    items
        .iter()
        .enumerate()
        .find_map(|(i, v)| validate(sub, v, &format!("{path}[{i}]")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn missing_properties_get_their_defaults_at_every_level() {
        let schema = json!({"type": "object", "properties": {
            "replicas": {"type": "integer", "default": 1},
            "port": {"type": "object", "properties": {"number": {"type": "integer", "default": 80}}},
            "hosts": {"type": "array", "items": {"type": "object", "properties": {"tls": {"type": "boolean", "default": false}}}}
        }});
        let mut spec = json!({"port": {}, "hosts": [{"name": "a"}, {"name": "b", "tls": true}]});
        apply(&schema, &mut spec);
        assert_eq!(
            spec,
            json!({"replicas": 1, "port": {"number": 80},
            "hosts": [{"name": "a", "tls": false}, {"name": "b", "tls": true}]})
        );
    }
}
