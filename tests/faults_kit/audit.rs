//! The API server's audit log (the local control plane writes one): the write requests made
//! since a mark, by user agent, namespace and object.

use super::*;

/// The API servers' audit logs of write requests (`.cluster/logs/audit.log`, and
/// `audit-nogate.log` of the second API server the sharding fallback test starts), read
/// from where each ended when [`Audit::mark`] was called, less the requests received
/// before it: a write is visible to readers before the API server has logged it, so a
/// write a test saw before the mark may be logged after it.
pub struct Audit {
    logs: Vec<(PathBuf, u64)>,
    since: jiff::Timestamp,
}

impl Audit {
    pub fn mark() -> Audit {
        let dir = kubeconfig_path()
            .parent()
            .expect("cluster dir")
            .join("logs");
        let path = dir.join("audit.log");
        let from = std::fs::metadata(&path)
            .unwrap_or_else(|e| {
                panic!(
                    "{}: {e}: the local control plane writes an audit log of write requests; \
                     restart it with `make cluster-restart`",
                    path.display()
                )
            })
            .len();
        // The second API server's log may not exist yet: all of it is new then.
        let nogate = dir.join("audit-nogate.log");
        let nogate_from = std::fs::metadata(&nogate).map(|m| m.len()).unwrap_or(0);
        Audit {
            logs: vec![(path, from), (nogate, nogate_from)],
            since: jiff::Timestamp::now(),
        }
    }

    /// The write requests (create, update, patch, delete, deletecollection) to objects in
    /// `ns` logged since the mark, as audit events (`verb`, `userAgent`, `objectRef`,
    /// `responseStatus`, `stageTimestamp`, ...), in the order of their `stageTimestamp`.
    pub fn writes(&self, ns: &str) -> Vec<Json> {
        self.requests(ns)
            .into_iter()
            .filter(|e| {
                matches!(
                    e["verb"].as_str(),
                    Some("create" | "update" | "patch" | "delete" | "deletecollection")
                )
            })
            .collect()
    }

    /// Every request to objects in `ns` logged since the mark: the writes, and in the one
    /// namespace whose reads the audit policy logs (`rulebook-audit-reads`), the GETs.
    pub fn requests(&self, ns: &str) -> Vec<Json> {
        use std::io::{Read, Seek, SeekFrom};
        let quoted = format!("\"{ns}\"");
        let mut events = Vec::new();
        for (i, (path, from)) in self.logs.iter().enumerate() {
            let mut f = match std::fs::File::open(path) {
                Ok(f) => f,
                // Only the main API server's log must be there.
                Err(_) if i > 0 => continue,
                Err(e) => panic!("audit log {}: {e}", path.display()),
            };
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            // Rotated meanwhile (500 MB): read the new file from its start.
            let from = if len < *from { 0 } else { *from };
            f.seek(SeekFrom::Start(from)).expect("seek");
            let mut text = String::new();
            f.read_to_string(&mut text).expect("read audit log");
            events.extend(
                text.lines()
                    .filter(|l| l.contains(&quoted))
                    .filter_map(|l| serde_json::from_str::<Json>(l).ok())
                    .filter(|e| e["objectRef"]["namespace"] == ns)
                    .filter(|e| {
                        e["requestReceivedTimestamp"]
                            .as_str()
                            .and_then(|t| t.parse::<jiff::Timestamp>().ok())
                            .is_none_or(|t| t >= self.since)
                    }),
            );
        }
        events.sort_by_key(audit_time);
        events
    }
}

/// An audit event's `stageTimestamp`.
pub fn audit_time(e: &Json) -> Option<jiff::Timestamp> {
    e["stageTimestamp"].as_str()?.parse().ok()
}

/// When the API server received the request of an audit event: what a "sent after the
/// process was stopped" check compares (a stopped process sends nothing new, but a write
/// it sent just before can complete, and be stamped by [`audit_time`], later).
pub fn audit_received(e: &Json) -> Option<jiff::Timestamp> {
    e["requestReceivedTimestamp"].as_str()?.parse().ok()
}

/// Rulebook's writes (user agent `rulebook/…`) in `ns` since `audit`, without events.
pub fn rulebook_writes(audit: &Audit, ns: &str) -> Vec<Json> {
    audit
        .writes(ns)
        .into_iter()
        .filter(|e| {
            e["userAgent"]
                .as_str()
                .is_some_and(|a| a.starts_with("rulebook/"))
                && e["objectRef"]["resource"] != "events"
        })
        .collect()
}

/// `verb resource/name (code, user agent)` of an audit event.
pub fn describe_audit(e: &Json) -> String {
    format!(
        "{} {} {}/{} ({}, {})",
        e["stageTimestamp"].as_str().unwrap_or(""),
        e["verb"].as_str().unwrap_or(""),
        e["objectRef"]["resource"].as_str().unwrap_or(""),
        e["objectRef"]["name"].as_str().unwrap_or(""),
        e["responseStatus"]["code"],
        e["userAgent"].as_str().unwrap_or("")
    )
}
