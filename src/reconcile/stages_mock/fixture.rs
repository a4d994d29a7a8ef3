//! The fixture of the mock-API tests (kube-rs controller-rs's `fixtures.rs` pattern): a
//! rule's [`RuleContext`] whose client is the operator's gated client over a
//! `tower_test::mock::pair()` instead of a connection, caches filled by hand as the
//! watches would fill them, and an [`ApiServer`] that answers every request as the API
//! server would (an apply's answer carries Rulebook's managed fields) and records it, so
//! that a test asserts the exact requests a reconcile sent.

use std::collections::BTreeMap;
use std::sync::Arc;

use http::{Request, Response};
use http_body_util::BodyExt;
use kube::api::{ApiResource, DynamicObject};
use kube::client::Body;
use kube::runtime::reflector;
use kube::runtime::watcher::Event;
use parking_lot::Mutex;
use serde_json::{Value as Json, json};

use crate::cache::store::ChildStore;
use crate::cache::wire::Wire;
use crate::meta::FIELD_MANAGER;
use crate::metrics::Metrics;
use crate::reconcile::context::{ChildKind, ContextParts, ParentKind, RuleContext};
use crate::reconcile::inflight::InputBudget;
use crate::reconcile::memory::{MemoryParts, ParentMemory};
use crate::render::{CompiledRule, Limits, compile};
use crate::rules::Sources;
use crate::write::gate::{LeaseGate, WriteGate};
use crate::write::outbox::{Outbox, OutboxLimits};
use crate::write::recorder::Recorder;
use crate::write::writer::Writer;

pub const NS: &str = "team";

/// The rule under test: a `Demo` parent with one ConfigMap child. `deletion` is the
/// rule's `spec.deletion` (which makes parents carry Rulebook's finalizer), if any.
pub fn rule(deletion: Option<&str>) -> Arc<CompiledRule> {
    rule_greeting(deletion, "{{ parent.spec.greeting }}")
}

/// [`rule`] whose child's `greeting` is the template text `greeting` (another version).
pub fn rule_greeting(deletion: Option<&str>, greeting: &str) -> Arc<CompiledRule> {
    let deletion = deletion.map_or(String::new(), |d| format!("  deletion: {d}\n"));
    let yaml = format!(
        "apiVersion: rulebook.dev/v1alpha1
kind: Rule
metadata:
  name: demo
spec:
  parent:
    apiVersion: test.rulebook.dev/v1
    kind: Demo
  children:
    - name: config
      apiVersion: v1
      kind: ConfigMap
      template: demo/config.yaml
{deletion}"
    );
    let template = "apiVersion: v1
kind: ConfigMap
metadata:
  name: {{ (parent.metadata.name ~ \"-config\") }}
data:
  greeting: GREETING
"
    .replace("GREETING", greeting);
    let sources = Sources {
        default_rollout: None,
        rule_files: vec![("demo.yaml".into(), yaml)],
        templates: BTreeMap::from([(
            "demo/config.yaml".to_string(),
            ("demo/config.yaml".to_string(), template),
        )]),
    };
    let set = compile(&sources, &Limits::default()).unwrap_or_else(|d| panic!("{d}"));
    set.rules["demo"].clone()
}

pub fn parent_ar() -> ApiResource {
    ApiResource {
        group: "test.rulebook.dev".into(),
        version: "v1".into(),
        api_version: "test.rulebook.dev/v1".into(),
        kind: "Demo".into(),
        plural: "demos".into(),
    }
}

pub fn configmap_ar() -> ApiResource {
    ApiResource::erase::<k8s_openapi::api::core::v1::ConfigMap>(&())
}

/// A `Demo` parent as the API server would hold it.
pub fn parent(name: &str, uid: &str, rv: u64) -> Json {
    json!({
        "apiVersion": "test.rulebook.dev/v1", "kind": "Demo",
        "metadata": {"name": name, "namespace": NS, "uid": uid,
                     "resourceVersion": rv.to_string(), "generation": 1},
        "spec": {"greeting": "hello"},
    })
}

/// One request as the API server received it.
#[derive(Clone, Debug)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
    pub content_type: String,
    pub body: Json,
    /// What the mocked API server answered.
    pub answer: Json,
}

impl Seen {
    pub fn is_event(&self) -> bool {
        self.path.contains("/events")
    }
}

/// The mocked API server: answers each request as the real one would (see [`answer`])
/// and records it.
pub struct ApiServer {
    seen: Arc<Mutex<Vec<Seen>>>,
    /// The parents it holds, by name (a status write answers with one).
    parents: Parents,
    task: tokio::task::JoinHandle<()>,
}

type Parents = Arc<Mutex<BTreeMap<String, Json>>>;

impl ApiServer {
    /// Every request but events (which the recorder sends in the background, in its own
    /// time), in the order received.
    pub fn requests(&self) -> Vec<Seen> {
        self.seen
            .lock()
            .iter()
            .filter(|s| !s.is_event())
            .cloned()
            .collect()
    }

    /// Forgets what was received so far.
    pub fn clear(&self) {
        self.seen.lock().clear();
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

type Handle = tower_test::mock::Handle<Request<Body>, Response<Body>>;

fn serve(mut handle: Handle) -> ApiServer {
    let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
    let parents: Parents = Arc::default();
    let (log, held) = (seen.clone(), parents.clone());
    let task = tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body
                .collect()
                .await
                .map(|b| b.to_bytes())
                .unwrap_or_default();
            let query = parts
                .uri
                .query()
                .unwrap_or_default()
                .split('&')
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let content_type = parts.headers.get(http::header::CONTENT_TYPE);
            let mut s = Seen {
                method: parts.method.to_string(),
                path: parts.uri.path().to_string(),
                query,
                content_type: content_type
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_string(),
                body: serde_json::from_slice(&bytes).unwrap_or(Json::Null),
                answer: Json::Null,
            };
            let (status, answer) = answer(&s, &held);
            s.answer = answer.clone();
            log.lock().push(s);
            let response = Response::builder()
                .status(status)
                .body(Body::from(answer.to_string().into_bytes()));
            match response {
                Ok(r) => send.send_response(r),
                Err(e) => panic!("cannot build a response: {e}"),
            }
        }
    });
    ApiServer {
        seen,
        parents,
        task,
    }
}

/// The counter of resourceVersions the mocked API server hands out.
static NEXT_RV: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1000);

fn next_rv() -> String {
    NEXT_RV
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        .to_string()
}

/// What the API server answers: an apply's object with a UID, a new resourceVersion and
/// Rulebook's managed fields (every top-level field owned whole); a delete's success; a
/// merge patch's or an event's body back; a list, no items; a read of one object, 404.
fn answer(s: &Seen, parents: &Parents) -> (u16, Json) {
    let last = s.path.rsplit('/').next().unwrap_or_default();
    match s.method.as_str() {
        "PATCH" if last == "status" => {
            let name = s.path.rsplit('/').nth(1).unwrap_or_default();
            let mut p = parents.lock().get(name).cloned().unwrap_or_default();
            p["metadata"]["resourceVersion"] = json!(next_rv());
            p["status"] = s.body["status"].clone();
            (200, p)
        }
        "GET" if last == "configmaps" || last == "demos" => (
            200,
            json!({"kind": "List", "apiVersion": "v1",
                   "metadata": {"resourceVersion": next_rv()}, "items": []}),
        ),
        "PATCH" if s.query.contains_key("fieldManager") && s.query.contains_key("force") => {
            (200, applied(&s.body))
        }
        "PATCH" | "POST" => {
            let mut o = s.body.clone();
            o["metadata"]["resourceVersion"] = json!(next_rv());
            (200, o)
        }
        "DELETE" => (
            200,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Success"}),
        ),
        _ => (
            404,
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                   "reason": "NotFound", "code": 404, "message": "not found"}),
        ),
    }
}

/// The object a server-side apply of `body` leaves.
pub fn applied(body: &Json) -> Json {
    let mut o = body.clone();
    let fields: serde_json::Map<String, Json> = (o.as_object().into_iter().flatten())
        .filter(|(k, _)| *k != "apiVersion" && *k != "kind")
        .map(|(k, _)| (format!("f:{k}"), json!({})))
        .collect();
    let meta = &mut o["metadata"];
    if let Some(m) = meta.as_object_mut() {
        m.remove("resourceVersion");
    }
    meta["uid"] = json!(format!(
        "uid-of-{}",
        meta["name"].as_str().unwrap_or_default()
    ));
    meta["resourceVersion"] = json!(next_rv());
    meta["managedFields"] = json!([{
        "manager": FIELD_MANAGER, "operation": "Apply", "apiVersion": "v1",
        "fieldsType": "FieldsV1", "fieldsV1": fields,
    }]);
    o
}

/// A rule's context over the mocked API server, with its caches.
pub struct Fixture {
    pub ctx: Arc<RuleContext>,
    pub api: ApiServer,
    parents: reflector::store::Writer<DynamicObject>,
}

impl Fixture {
    pub fn new(rule: Arc<CompiledRule>) -> Fixture {
        let (service, handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
        let metrics = Arc::new(Metrics::new());
        let gate: Arc<dyn WriteGate> = Arc::new(LeaseGate::open());
        let client =
            crate::write::gate::gate_over(service, NS.into(), gate.clone(), metrics.clone())
                .build();
        let store = Arc::new(ChildStore::new(&configmap_ar()));
        store.observe(&Event::Init);
        store.observe(&Event::InitDone);
        let parents = reflector::store::Writer::new(parent_ar());
        let recorder = Recorder::new(
            client.clone(),
            kube::runtime::events::Reporter {
                controller: FIELD_MANAGER.into(),
                instance: None,
            },
            Outbox::new(OutboxLimits::DEFAULT, metrics.events_dropped.clone()),
        );
        let memory = Arc::new(ParentMemory::new(MemoryParts {
            steady: Arc::default(),
            orphans_pending: Arc::default(),
            records_version: false,
        }));
        let ctx = RuleContext::new(ContextParts {
            rule: rule.clone(),
            client,
            parent: ParentKind {
                ar: parent_ar(),
                namespaced: true,
                status_subresource: true,
            },
            kinds: vec![ChildKind {
                ar: configmap_ar(),
                namespaced: true,
                store,
                content_read: rule.reads_child_content(0),
            }],
            kind_of_child: vec![0],
            recorder,
            metrics: metrics.clone(),
            writer: Writer::new(gate, metrics.clone(), "demo"),
            parent_store: parents.as_reader(),
            refs: Vec::new(),
            memory,
            inputs: InputBudget::new(64 << 20, metrics.inputs.clone()),
            namespaces: None,
        });
        Fixture {
            ctx: Arc::new(ctx),
            api: serve(handle),
            parents,
        }
    }

    /// The parent as the parent cache holds it (and the reconcile is handed it).
    pub fn cache_parent(&mut self, parent: &Json) -> Arc<DynamicObject> {
        let name = parent["metadata"]["name"].as_str().unwrap_or_default();
        (self.api.parents.lock()).insert(name.to_string(), parent.clone());
        let mut o = packed::<false>(parent);
        crate::cache::strip_parent(&mut o);
        self.parents.apply_watcher_event(&Event::Apply(o.clone()));
        Arc::new(o)
    }

    /// A child as its watch delivers it to the cache.
    pub fn cache_child(&self, child: &Json) {
        let mut o = packed::<true>(child);
        crate::cache::strip_child(&mut o);
        self.ctx.kinds[0].store.observe(&Event::Apply(o));
    }

    /// The reconcile of `parent`, as the rule's controller runs it.
    pub async fn reconcile(
        &self,
        parent: Arc<DynamicObject>,
    ) -> Result<kube::runtime::controller::Action, crate::reconcile::error::ReconcileError> {
        crate::reconcile::reconcile(parent, self.ctx.clone()).await
    }
}

/// `o` decoded as a watch decodes it, in the cached form.
fn packed<const CHILD: bool>(o: &Json) -> DynamicObject {
    let wire: Wire<CHILD> = match serde_json::from_str(&o.to_string()) {
        Ok(w) => w,
        Err(e) => panic!("not an object: {e}"),
    };
    wire.into_packed()
}
