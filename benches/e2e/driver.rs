//! The driver's own requests: parents created and updated for a workload, and the API
//! server's limit measured with a plain client.

use super::*;

impl Bench {
    pub(crate) fn parent_api(&self, kind: Kind, ns: &str) -> Api<DynamicObject> {
        cluster::api(
            &self.client,
            Some(ns),
            kind.parent_api_version(),
            "Bench",
            "benches",
        )
    }

    pub(crate) fn parent(kind: Kind, ns: &str, i: usize, version: u32) -> Json {
        let data = if version == 1 {
            format!("payload-{i:05}-").repeat(6)
        } else {
            format!("updated-{i:05}-v{version}-").repeat(5)
        };
        json!({
            "apiVersion": kind.parent_api_version(), "kind": "Bench",
            "metadata": {"name": format!("b-{i:05}"), "namespace": ns},
            "spec": {"size": i, "data": data},
        })
    }

    /// Creates parents `0..n` with the driver's concurrency (POST).
    pub(crate) async fn create_parents(&self, kind: Kind, ns: &str, n: usize) -> Result<()> {
        let api = self.parent_api(kind, ns);
        let results: Vec<Result<(), kube::Error>> = futures::stream::iter(0..n)
            .map(|i| {
                let api = api.clone();
                async move {
                    let o: DynamicObject =
                        serde_json::from_value(Self::parent(kind, ns, i, 1)).expect("parent");
                    api.create(&PostParams::default(), &o).await.map(|_| ())
                }
            })
            .buffer_unordered(self.cfg.driver_concurrency)
            .collect()
            .await;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            bail!("creating parents: {e}");
        }
        Ok(())
    }

    /// Changes every parent's spec (merge PATCH).
    pub(crate) async fn update_parents(&self, kind: Kind, ns: &str, n: usize) -> Result<()> {
        let api = self.parent_api(kind, ns);
        let results: Vec<Result<(), kube::Error>> = futures::stream::iter(0..n)
            .map(|i| {
                let api = api.clone();
                async move {
                    let spec = Self::parent(kind, ns, i, 2)["spec"].clone();
                    api.patch(
                        &format!("b-{i:05}"),
                        &PatchParams::default(),
                        &Patch::Merge(json!({"spec": spec})),
                    )
                    .await
                    .map(|_| ())
                }
            })
            .buffer_unordered(self.cfg.driver_concurrency)
            .collect()
            .await;
        if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
            bail!("updating parents: {e}");
        }
        Ok(())
    }

    /// The same 3N objects the controllers write, server-side applied as fast as a
    /// plain client can, at each concurrency level.
    pub(crate) async fn api_limit(&mut self) -> Result<Vec<Json>> {
        let n = self.cfg.n;
        let mut out = Vec::new();
        for &c in &self.cfg.api_concurrency.clone() {
            let ns = format!("bench-api-c{c}-{}", self.run_id);
            cluster::create_namespace(&self.client, &ns).await?;
            let objects: Vec<(usize, Json)> = (0..n)
                .flat_map(|i| {
                    let name = format!("b-{i:05}");
                    let data = format!("payload-{i:05}-").repeat(6);
                    let meta = |child: String| json!({"name": child, "namespace": ns,
                        "labels": {"app": name, "app.kubernetes.io/managed-by": "bench-api-limit"},
                        "annotations": {"bench.rulebook.dev/desired-hash": "0123456789abcdef"}});
                    [
                        (0, json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta(format!("{name}-config")),
                                   "data": {"size": i.to_string(), "data": data}})),
                        (1, json!({"apiVersion": "v1", "kind": "Service", "metadata": meta(name.clone()),
                                   "spec": {"clusterIP": "None", "ports": [{"name": "http", "port": 80, "targetPort": 8080}]}})),
                        (2, json!({"apiVersion": "v1", "kind": "Secret", "metadata": meta(format!("{name}-secret")),
                                   "type": "Opaque", "data": {"token": "Yi0wMDAwMDpwYXlsb2Fk"}})),
                    ]
                })
                .collect();
            let apis = [
                cluster::api(&self.client, Some(&ns), "v1", "ConfigMap", "configmaps"),
                cluster::api(&self.client, Some(&ns), "v1", "Service", "services"),
                cluster::api(&self.client, Some(&ns), "v1", "Secret", "secrets"),
            ];
            let total = objects.len();
            let apiserver0 = self
                .apiserver_pid
                .map(|p| procs::usage_of(p).cpu_seconds)
                .unwrap_or(0.0);
            let start = Instant::now();
            let results: Vec<Result<(), kube::Error>> = futures::stream::iter(objects)
                .map(|(k, o)| {
                    let api = apis[k].clone();
                    async move {
                        let name = o["metadata"]["name"]
                            .as_str()
                            .unwrap_or_default()
                            .to_string();
                        let o: DynamicObject = serde_json::from_value(o).expect("object");
                        api.patch(
                            &name,
                            &PatchParams::apply("bench-api-limit").force(),
                            &Patch::Apply(&o),
                        )
                        .await
                        .map(|_| ())
                    }
                })
                .buffer_unordered(c)
                .collect()
                .await;
            let secs = start.elapsed().as_secs_f64();
            let apiserver_cpu = self
                .apiserver_pid
                .map(|p| procs::usage_of(p).cpu_seconds)
                .unwrap_or(0.0)
                - apiserver0;
            let failed = results.iter().filter(|r| r.is_err()).count();
            if let Some(Err(e)) = results.iter().find(|r| r.is_err()) {
                self.notes.push(format!(
                    "API limit at concurrency {c}: {failed} requests failed, e.g. {e}"
                ));
            }
            eprintln!(
                "bench: API limit, concurrency {c}: {total} objects in {secs:.2} s = {:.0} objects/s",
                total as f64 / secs
            );
            out.push(json!({"concurrency": c, "objects": total, "seconds": secs,
                            "objects_per_second": (total - failed) as f64 / secs, "failed": failed,
                            "apiserver_cpu_seconds": apiserver_cpu}));
            cluster::delete_namespace(&self.client, &ns, Duration::from_secs(600)).await?;
        }
        Ok(out)
    }
}
