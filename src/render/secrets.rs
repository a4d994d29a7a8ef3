//! Secret values out of what Rulebook tells people: the values of the Secrets a parent's
//! reconcile can see (references, children as they are and as they are about to be
//! written), in every form a message may quote them, and the cleaning of a message.

use serde_json::Value as Json;

/// The values of every Secret among `objects`, as messages may quote them, so they can be
/// cleaned of them ([`redact`]): as stored (base64 in `data`) and decoded, each also
/// JSON-escaped (the API server quotes values with Go's `%q`, webhooks often in JSON),
/// and each line of a value of several lines (a PEM key, say) on its own. Longest
/// first, so a value is replaced before a part of it.
pub fn secret_values_in<'a>(objects: impl Iterator<Item = &'a Json>) -> Vec<String> {
    fn push(v: &str, out: &mut Vec<String>) {
        out.push(v.to_string());
        if let Ok(quoted) = serde_json::to_string(v)
            && let Some(escaped) = quoted.get(1..quoted.len().saturating_sub(1))
            && escaped != v
        {
            out.push(escaped.to_string());
        }
        if v.contains('\n') {
            out.extend(v.lines().map(|l| l.trim().to_string()));
        }
    }
    let mut out = Vec::new();
    for o in objects {
        if o.get("kind").and_then(Json::as_str) != Some("Secret") {
            continue;
        }
        for key in ["data", "stringData"] {
            for v in o
                .get(key)
                .and_then(Json::as_object)
                .into_iter()
                .flat_map(|m| m.values())
                .filter_map(Json::as_str)
            {
                push(v, &mut out);
                if key == "data" {
                    use base64::Engine;
                    if let Ok(bytes) = base64::engine::general_purpose::STANDARD.decode(v)
                        && let Ok(text) = String::from_utf8(bytes)
                    {
                        push(&text, &mut out);
                    }
                }
            }
        }
    }
    out.retain(|v| v.len() >= MIN_REDACTED);
    out.sort_by(|a, b| b.len().cmp(&a.len()).then_with(|| a.cmp(b)));
    out.dedup();
    out
}

/// Secret values shorter than this are not looked for in messages (they would match
/// ordinary words); a secret that short is no secret.
pub const MIN_REDACTED: usize = 4;

/// `message` with every occurrence of the `secrets` replaced by `[redacted]`.
pub fn redact(message: &str, secrets: &[String]) -> String {
    let mut out = message.to_string();
    for s in secrets {
        if out.contains(s.as_str()) {
            out = out.replace(s.as_str(), "[redacted]");
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A value is looked for as stored, decoded, escaped as the API server and JSON quote
    /// it, and line by line; a message quoting it any of those ways is cleaned.
    #[test]
    fn secret_values_are_found_as_messages_quote_them() {
        use base64::Engine;
        let pem = "-----BEGIN KEY-----\nMIIBOgIBAAJBAKj34GkxFhD9\n-----END KEY-----";
        let quoted = "pass\"word\\42";
        let data = |v: &str| base64::engine::general_purpose::STANDARD.encode(v);
        let objects = [
            serde_json::json!({"kind": "Secret", "data": {"pem": data(pem)},
                               "stringData": {"q": quoted}}),
            serde_json::json!({"kind": "ConfigMap", "data": {"not": "a-secret-value"}}),
        ];
        let secrets = secret_values_in(objects.iter());
        for message in [
            format!("Invalid value: {}", serde_json::to_string(pem).unwrap()),
            format!("Invalid value: {}", serde_json::to_string(quoted).unwrap()),
            format!("data: {}", data(pem)),
            "line 2 of the key: MIIBOgIBAAJBAKj34GkxFhD9".to_string(),
        ] {
            let clean = redact(&message, &secrets);
            assert!(
                !clean.contains("MIIBOgIBAAJBAKj34GkxFhD9") && !clean.contains("word"),
                "{message} -> {clean}"
            );
        }
        assert!(!secrets.iter().any(|s| s == "a-secret-value"));
    }
}
