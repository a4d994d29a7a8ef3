//! Publishing Events (events.k8s.io/v1) with kube-runtime's semantics — a repeat of the
//! same event within six minutes patches its series instead of creating another — at a
//! bounded cost.
//!
//! kube-runtime 5's `Recorder` keeps every event it published in the last six minutes
//! and sweeps that whole cache on every publish: after a converge of N parents each
//! event costs O(N) (the benchmark's profile showed the sweep as the hottest function of
//! the reconciler at 1,000 parents), and the cache holds a full Event object per parent.
//! This one keeps, per event key, only the Event's name, its count and when it was last
//! seen, under a 128-bit keyed digest of the key (the key's strings — reason, action,
//! the object's apiVersion, kind, namespace and name — were most of an entry); sweeps
//! when the cache has doubled since the last sweep or a series window has passed since
//! it (so a quiet operator holds none); and holds at most
//! [`MAX_KEYS`] keys (past that, it forgets them all: the next repeat creates a new
//! Event instead of patching a series, which loses nothing a person reads).
//!
//! Events are sent in the background through one bounded [`Outbox`] per process (see
//! `outbox.rs`), each given [`SEND_TIMEOUT`]. Each rule run has its own series cache, as
//! before the outbox; only the outbox is shared.

use std::collections::HashMap;
use std::hash::{BuildHasher, RandomState};
use std::sync::{Arc, Mutex};

use jiff::{SignedDuration, Timestamp};
use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::{Event as K8sEvent, EventSeries};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::runtime::events::{Event, EventType, Reporter};
use serde_json::json;

use super::outbox::Outbox;
use super::send::send_as;

/// How long a published event can still become a series (kube-runtime's figure).
const SERIES_WINDOW: SignedDuration = SignedDuration::from_mins(6);
/// Keys remembered at most.
pub const MAX_KEYS: usize = 20_000;
/// How long one event's request may take before its sender moves on (a hung request
/// must not hold a sender for the client's whole read timeout).
pub const SEND_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(15);

/// An object reference as a key: apiVersion, kind, namespace, name.
type RefKey = (
    Option<String>,
    Option<String>,
    Option<String>,
    Option<String>,
);

/// What identifies "the same event": kube-runtime's key.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Key {
    type_: &'static str,
    action: String,
    reason: String,
    regarding: RefKey,
    related: Option<RefKey>,
}

#[derive(Clone, Debug)]
struct Seen {
    name: String,
    count: i32,
    last: Timestamp,
}

#[derive(Default)]
struct Cache {
    seen: HashMap<u128, Seen>,
    /// Two independently keyed hashers (random per process, so no one can make two keys
    /// collide on purpose) for the key's 128-bit digest.
    digest: (RandomState, RandomState),
    /// The cache's size after the last sweep, and when it was.
    swept_at: usize,
    swept: Option<Timestamp>,
}

impl Cache {
    fn digest(&self, key: &Key) -> u128 {
        (u128::from(self.digest.0.hash_one(key)) << 64) | u128::from(self.digest.1.hash_one(key))
    }

    /// The same event seen within the series window, if any.
    fn repeat_of(&self, key: &Key, now: Timestamp) -> Option<Seen> {
        self.seen
            .get(&self.digest(key))
            .filter(|s| s.last + SERIES_WINDOW > now && !s.name.is_empty())
            .cloned()
    }

    fn remember(&mut self, key: Key, seen: Seen, now: Timestamp) {
        let digest = self.digest(&key);
        self.seen.insert(digest, seen);
        // Amortised: a sweep once the cache has doubled since the last one, or a series
        // window after it.
        if self.seen.len() >= 2 * self.swept_at.max(64)
            || self.swept.is_none_or(|t| t + SERIES_WINDOW <= now)
        {
            self.seen.retain(|_, s| s.last + SERIES_WINDOW > now);
            self.swept_at = self.seen.len();
            self.swept = Some(now);
        }
        if self.seen.len() > MAX_KEYS {
            self.seen.clear();
            self.swept_at = 0;
        }
    }
}

/// Why an event posted to the outbox was not sent.
#[derive(Debug, thiserror::Error)]
pub enum Unsent {
    #[error("{0}")]
    Api(#[from] kube::Error),
    #[error("no answer within {}s", SEND_TIMEOUT.as_secs())]
    TimedOut,
}

/// Publishes events for Rulebook's parents; cheap to clone (clones share its series
/// cache and the process's outbox).
#[derive(Clone)]
pub struct Recorder {
    client: Client,
    reporter: Reporter,
    cache: Arc<Mutex<Cache>>,
    outbox: Outbox,
}

fn reference_key(r: &ObjectReference) -> RefKey {
    (
        r.api_version.clone(),
        r.kind.clone(),
        r.namespace.clone(),
        r.name.clone(),
    )
}

fn type_name(t: EventType) -> &'static str {
    match t {
        EventType::Normal => "Normal",
        EventType::Warning => "Warning",
    }
}

impl Recorder {
    pub fn new(client: Client, reporter: Reporter, outbox: Outbox) -> Recorder {
        Recorder {
            client,
            reporter,
            cache: Arc::default(),
            outbox,
        }
    }

    /// [`Recorder::publish`] in the background, through the outbox, within
    /// [`SEND_TIMEOUT`]; `done` gets its result. False (`done` not called) when the
    /// outbox, or the namespace's share of it, is full and the event dropped.
    pub fn post(
        &self,
        ev: Event,
        regarding: ObjectReference,
        done: impl FnOnce(Result<(), Unsent>) + Send + 'static,
    ) -> bool {
        let recorder = self.clone();
        let namespace = regarding.namespace.clone().unwrap_or_default();
        self.outbox
            .post(&namespace, async move {
                let sent = tokio::time::timeout(SEND_TIMEOUT, recorder.publish(&ev, &regarding));
                done(match sent.await {
                    Ok(Ok(())) => Ok(()),
                    Ok(Err(e)) => Err(Unsent::Api(e)),
                    Err(_) => Err(Unsent::TimedOut),
                });
            })
            .is_ok()
    }

    /// Creates the event, or patches the series of the same event published within the
    /// last six minutes. Cluster-scoped objects' events go to `default`.
    pub async fn publish(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
    ) -> Result<(), kube::Error> {
        let now = Timestamp::now();
        let key = Key {
            type_: type_name(ev.type_),
            action: ev.action.clone(),
            reason: ev.reason.clone(),
            regarding: reference_key(regarding),
            related: ev.secondary.as_ref().map(reference_key),
        };
        let repeat = self.repeat_of(&key, now);
        let namespace = regarding
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_string());
        let events: Api<K8sEvent> = Api::namespaced(self.client.clone(), &namespace);
        // A series whose Event is gone (deleted, or its namespace recreated) starts over.
        let repeat = match repeat {
            Some(mut seen) => {
                seen.count += 1;
                seen.last = now;
                let patch = json!({"series": EventSeries {
                    count: seen.count,
                    last_observed_time: MicroTime(now),
                }});
                match events
                    .patch(&seen.name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Some(seen),
                    Err(kube::Error::Api(s)) if s.code == 404 => None,
                    Err(e) => return Err(e),
                }
            }
            None => None,
        };
        let seen = match repeat {
            Some(seen) => seen,
            None => {
                let event = self.event(ev, regarding, &namespace, now);
                Seen {
                    name: create(&events, &event).await?,
                    count: 1,
                    last: now,
                }
            }
        };
        self.remember(key, seen, now);
        Ok(())
    }

    fn repeat_of(&self, key: &Key, now: Timestamp) -> Option<Seen> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.repeat_of(key, now)
    }

    fn remember(&self, key: Key, seen: Seen, now: Timestamp) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.remember(key, seen, now);
    }

    fn event(
        &self,
        ev: &Event,
        regarding: &ObjectReference,
        namespace: &str,
        now: Timestamp,
    ) -> K8sEvent {
        let reporter = &self.reporter;
        K8sEvent {
            action: Some(ev.action.clone()),
            reason: Some(ev.reason.clone()),
            event_time: Some(MicroTime(now)),
            regarding: Some(regarding.clone()),
            related: ev.secondary.clone(),
            note: ev.note.clone(),
            metadata: ObjectMeta {
                namespace: Some(namespace.to_string()),
                name: Some(format!(
                    "{}.{:x}",
                    regarding.name.as_ref().unwrap_or(&reporter.controller),
                    now.as_nanosecond()
                )),
                ..Default::default()
            },
            reporting_controller: Some(reporter.controller.clone()),
            reporting_instance: Some(
                reporter
                    .instance
                    .clone()
                    .unwrap_or_else(|| reporter.controller.clone()),
            ),
            type_: Some(type_name(ev.type_).to_string()),
            ..Default::default()
        }
    }
}

/// Creates `event`, as `Api::create` does, and reads of the answer only the name the
/// series needs (the Event is written often and read back for nothing else).
async fn create(events: &Api<K8sEvent>, event: &K8sEvent) -> Result<String, kube::Error> {
    #[derive(serde::Deserialize)]
    struct Named {
        metadata: Name,
    }
    #[derive(serde::Deserialize)]
    struct Name {
        name: Option<String>,
    }
    let body = serde_json::to_vec(event).map_err(kube::Error::SerdeError)?;
    let req = kube::core::Request::new(events.resource_url())
        .create(&PostParams::default(), body)
        .map_err(kube::Error::BuildRequest)?;
    let created: Named = send_as(events, req, "create").await?;
    Ok(created.metadata.name.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(name: &str) -> Key {
        Key {
            type_: "Normal",
            action: "Reconcile".into(),
            reason: "Created".into(),
            regarding: (
                None,
                Some("Bench".into()),
                Some("ns".into()),
                Some(name.into()),
            ),
            related: None,
        }
    }

    fn seen(at: Timestamp) -> Seen {
        Seen {
            name: "e".into(),
            count: 1,
            last: at,
        }
    }

    #[test]
    fn a_repeat_within_six_minutes_is_a_series_and_later_a_new_event() {
        let t0 = Timestamp::UNIX_EPOCH + SignedDuration::from_hours(1000);
        let mut c = Cache::default();
        c.remember(key("a"), seen(t0), t0);
        assert!(
            c.repeat_of(&key("a"), t0 + SignedDuration::from_mins(5))
                .is_some()
        );
        assert!(
            c.repeat_of(&key("a"), t0 + SignedDuration::from_mins(7))
                .is_none()
        );
        assert!(c.repeat_of(&key("b"), t0).is_none());
    }

    #[test]
    fn the_cache_is_swept_when_it_doubles_and_never_outgrows_its_bound() {
        let t0 = Timestamp::UNIX_EPOCH + SignedDuration::from_hours(1000);
        let mut c = Cache::default();
        for i in 0..100 {
            c.remember(key(&format!("old-{i}")), seen(t0), t0);
        }
        // Ten minutes later, the old keys are swept on the way.
        let later = t0 + SignedDuration::from_mins(10);
        for i in 0..100 {
            c.remember(key(&format!("new-{i}")), seen(later), later);
        }
        assert!(c.seen.len() < 200, "{} keys", c.seen.len());
        assert!(c.repeat_of(&key("new-99"), later).is_some());
        assert!(c.repeat_of(&key("old-99"), later).is_none());
        // A quiet cache is swept by the next event a series window on, however small.
        let quiet = later + SERIES_WINDOW;
        c.remember(key("alone"), seen(quiet), quiet);
        assert_eq!(c.seen.len(), 1);
        for i in 0..MAX_KEYS + 10 {
            c.remember(key(&format!("k-{i}")), seen(later), later);
            assert!(c.seen.len() <= MAX_KEYS);
        }
    }
}
