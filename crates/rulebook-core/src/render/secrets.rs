//! Secret values out of what Rulebook tells people: the values of the Secrets a parent's
//! reconcile can see (references, children as they are and as they are about to be
//! written), in every form a message may quote them, and the cleaning of a message.

use serde_json::Value as Json;

/// The values of every Secret among `objects`, as messages may quote them, so they can be
/// cleaned of them ([`redact`]): as stored (base64 in `data`) and decoded, each also
/// escaped as JSON does (webhooks), as Go's `%q` does (the API server quotes values so)
/// and as Go's JSON encoder does (HTML characters too), and each line of a value of
/// several lines (a PEM key, say) on its own. Longest first, so a value is replaced
/// before a part of it.
pub fn secret_values_in<'a>(objects: impl Iterator<Item = &'a Json>) -> Vec<String> {
    fn push(v: &str, out: &mut Vec<String>) {
        out.push(v.to_string());
        if let Ok(quoted) = serde_json::to_string(v)
            && let Some(escaped) = quoted.get(1..quoted.len().saturating_sub(1))
            && escaped != v
        {
            out.push(escaped.to_string());
        }
        // Most values (base64, tokens) have nothing Go escapes: no copies for them, as
        // this runs on every reconcile of a parent with Secrets.
        if v.chars()
            .any(|c| go_escapes(c) || matches!(c, '"' | '\\' | '<' | '>' | '&'))
        {
            out.push(go_quoted(v));
            out.push(go_json(v));
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

/// Whether Go's `%q` writes `c` as an escape: controls, separators but the ASCII space,
/// and the invisible format characters (Go's `unicode.IsPrint`, for the characters a
/// value is likely to hold; Go also escapes unassigned code points, which no table here
/// knows).
fn go_escapes(c: char) -> bool {
    c.is_control()
        || (c.is_whitespace() && c != ' ')
        || matches!(c, '\u{ad}' | '\u{600}'..='\u{605}' | '\u{61c}' | '\u{6dd}' | '\u{70f}'
            | '\u{180e}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}'
            | '\u{2060}'..='\u{2064}' | '\u{2066}'..='\u{206f}' | '\u{feff}'
            | '\u{fff9}'..='\u{fffb}' | '\u{e000}'..='\u{f8ff}')
}

/// `v` inside the quotes of Go's `%q` (`strconv.Quote`).
fn go_quoted(v: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\u{7}' => out.push_str("\\a"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{b}' => out.push_str("\\v"),
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c if (c as u32) < 0x20 || c == '\u{7f}' => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if go_escapes(c) && (c as u32) <= 0xffff => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if go_escapes(c) => {
                let _ = write!(out, "\\U{:08x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out
}

/// `v` inside the quotes of Go's `encoding/json`: `\n`, `\r`, `\t`, `\\` and `\"` short, other
/// controls as `\u00XX`, and `<`, `>`, `&`, U+2028, U+2029 escaped for HTML.
fn go_json(v: &str) -> String {
    use std::fmt::Write;
    let mut out = String::with_capacity(v.len());
    for c in v.chars() {
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            '"' => out.push_str("\\\""),
            c if (c as u32) < 0x20 || matches!(c, '<' | '>' | '&' | '\u{2028}' | '\u{2029}') => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
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

    /// Go quotes some characters otherwise than JSON: `%q` writes `\x01`, `\a`, `\v` and
    /// escapes DEL, C1 controls and invisible spaces that JSON leaves raw; Go's JSON
    /// encoder escapes `<`, `>` and `&`. A message quoting a value either way is cleaned.
    #[test]
    fn values_are_found_as_go_quotes_them() {
        let odd = "tok\u{1}en\u{7}\u{b}\u{7f}\u{85}\u{a0}\u{200b}\u{2028}x";
        let html = "a<b>&c";
        let objects =
            [serde_json::json!({"kind": "Secret", "stringData": {"odd": odd, "html": html}})];
        let secrets = secret_values_in(objects.iter());
        for message in [
            // strconv.Quote(odd), as Go writes it
            "metadata.labels: Invalid value: \"tok\\x01en\\a\\v\\x7f\\u0085\\u00a0\\u200b\\u2028x\"".to_string(),
            // json.Marshal(html), as Go writes it
            "webhook said: {\"v\":\"a\\u003cb\\u003e\\u0026c\"}".to_string(),
        ] {
            let clean = redact(&message, &secrets);
            assert!(clean.contains("[redacted]"), "{message} -> {clean}");
            assert!(!clean.contains("tok") && !clean.contains("u003cb"), "{message} -> {clean}");
        }
    }
}
