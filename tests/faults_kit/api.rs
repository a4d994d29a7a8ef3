//! API helpers that ride out an API server or etcd restart (each request retried for two
//! minutes), and what the scenarios read of parents and of the operator.

use super::*;

// ---------------------------------------------------------------------------------------
// API helpers that ride out an API server or etcd restart.

pub const RETRY_FOR: Duration = Duration::from_secs(120);

/// Retries `f` on any error for up to [`RETRY_FOR`] (an API server restart takes ~5 s).
pub async fn retry<T, F, Fut>(what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, kube::Error>>,
{
    let start = Instant::now();
    loop {
        match f().await {
            Ok(v) => return v,
            Err(e) if start.elapsed() < RETRY_FOR => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Err(e) => panic!("{what}: {e}"),
        }
    }
}

/// Server-side apply (field manager `test`), retried.
pub async fn put(a: &Api<DynamicObject>, obj: &Json) -> DynamicObject {
    let name = obj["metadata"]["name"].as_str().expect("name").to_string();
    let o: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    retry(&format!("apply {name}"), || async {
        a.patch(
            &name,
            &PatchParams::apply("test").force(),
            &Patch::Apply(&o),
        )
        .await
    })
    .await
}

/// Creates with a JSON POST, retried.
pub async fn create(a: &Api<DynamicObject>, obj: &Json) -> DynamicObject {
    let name = obj["metadata"]["name"].as_str().expect("name").to_string();
    let o: DynamicObject = serde_json::from_value(obj.clone()).expect("object");
    retry(&format!("create {name}"), || async {
        a.create(&PostParams::default(), &o).await
    })
    .await
}

/// A JSON merge patch, retried.
pub async fn merge(a: &Api<DynamicObject>, name: &str, body: Json) -> DynamicObject {
    retry(&format!("patch {name}"), || async {
        a.patch(name, &PatchParams::default(), &Patch::Merge(&body))
            .await
    })
    .await
}

/// Applies many objects, `concurrency` at a time.
pub async fn put_all(a: &Api<DynamicObject>, objs: Vec<Json>, concurrency: usize) {
    futures::stream::iter(objs)
        .map(|o| async move {
            put(a, &o).await;
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
}

/// Deletes, retried; a missing object is fine.
pub async fn remove(a: &Api<DynamicObject>, name: &str) {
    retry(&format!("delete {name}"), || async {
        match a.delete(name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    })
    .await
}

pub async fn list(a: &Api<DynamicObject>, selector: Option<&str>) -> Vec<Json> {
    let lp = match selector {
        Some(s) => ListParams::default().labels(s),
        None => ListParams::default(),
    };
    retry("list", || a.list(&lp))
        .await
        .items
        .iter()
        .map(to_json)
        .collect()
}

pub async fn get_json(a: &Api<DynamicObject>, name: &str) -> Option<Json> {
    retry(&format!("get {name}"), || a.get_opt(name))
        .await
        .map(|o| to_json(&o))
}

pub fn parent(kind: &str, ns: &str, name: &str, spec: Json) -> Json {
    json!({"apiVersion": API_VERSION, "kind": kind,
           "metadata": {"name": name, "namespace": ns}, "spec": spec})
}

/// The parent API of `kind`, once its CRD is served.
pub async fn kind_api(
    client: &kube::Client,
    ns: &str,
    kind: &str,
    timeout: Duration,
) -> Api<DynamicObject> {
    let a = api(client, Some(ns), API_VERSION, kind, &plural(kind));
    wait_for(timeout, &format!("the {kind} CRD to be served"), || async {
        a.list(&ListParams::default().limit(1))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    a
}

/// Ready=True for the current generation.
pub fn is_ready(o: &Json) -> bool {
    ready_condition(o).is_some_and(|(s, _, _)| s == "True")
        && o.pointer("/metadata/generation") == o.pointer("/status/observedGeneration")
}

pub fn name_of(o: &Json) -> String {
    o["metadata"]["name"].as_str().unwrap_or("").to_string()
}

pub fn uid_of(o: &Json) -> String {
    o["metadata"]["uid"].as_str().unwrap_or("").to_string()
}

pub fn rv_of(o: &Json) -> String {
    o["metadata"]["resourceVersion"]
        .as_str()
        .unwrap_or("")
        .to_string()
}

/// Waits until every parent named in `names` is Ready for its current generation.
pub async fn wait_all_ready(a: &Api<DynamicObject>, names: &BTreeSet<String>, timeout: Duration) {
    let what = format!("{} parents to be Ready", names.len());
    wait_for(timeout, &what, || async {
        let items = a.list(&ListParams::default()).await.ok()?;
        let ready = items
            .items
            .iter()
            .map(to_json)
            .filter(|o| names.contains(&name_of(o)) && is_ready(o))
            .count();
        (ready == names.len()).then_some(())
    })
    .await
}

pub async fn status(op: &Operator) -> Json {
    serde_json::from_str(&op.get("/status").await).expect("/status is JSON")
}

/// The API server's count of ConfigMap watchers it closed because they did not keep up
/// (`apiserver_terminated_watchers_total{resource="configmaps"}`); `None` while it has
/// closed none (the series appears with the first one) or `/metrics` cannot be read.
pub async fn terminated_watchers(client: &kube::Client) -> Option<f64> {
    let text = client
        .request_text(http::Request::get("/metrics").body(vec![]).ok()?)
        .await
        .ok()?;
    let values: Vec<f64> = text
        .lines()
        .filter(|l| {
            l.starts_with("apiserver_terminated_watchers_total{")
                && l.contains("resource=\"configmaps\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}
