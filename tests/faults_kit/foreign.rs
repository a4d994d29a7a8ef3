//! Foreign objects: created by "someone else" in the test namespace, compared at the end: a
//! fault must never make the operator touch what is not its own.

use super::*;

// ---------------------------------------------------------------------------------------
// Foreign objects: created by "someone else" in the test namespace, compared at the end.

pub struct Foreign {
    objects: Vec<(Api<DynamicObject>, String, String, String)>, // api, name, uid, rv
}

impl Foreign {
    /// A plain ConfigMap, a Secret, a ConfigMap that carries the rule's labels (but no
    /// owner reference), and one named like a child of a parent that does not exist.
    pub async fn create(client: &kube::Client, ns: &str, rule: &str) -> Foreign {
        let cms = api(client, Some(ns), "v1", "ConfigMap", "configmaps");
        let secrets = api(client, Some(ns), "v1", "Secret", "secrets");
        let mut objects = Vec::new();
        let specs = [
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "foreign-plain", "namespace": ns}, "data": {"a": "b"}}),
            ),
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "foreign-lookalike", "namespace": ns, "labels": {
                    "app.kubernetes.io/managed-by": "rulebook", "rulebook.dev/rule": rule,
                    "rulebook.dev/owner": "00000000-0000-0000-0000-00000000f00d",
                    "rulebook.dev/child": "config"}},
                "data": {"rev": "foreign"}}),
            ),
            (
                &cms,
                json!({"apiVersion": "v1", "kind": "ConfigMap",
                "metadata": {"name": "ghost-config", "namespace": ns}, "data": {"rev": "x"}}),
            ),
            (
                &secrets,
                json!({"apiVersion": "v1", "kind": "Secret",
                "metadata": {"name": "foreign-secret", "namespace": ns}, "stringData": {"k": "v"}}),
            ),
        ];
        for (a, o) in specs {
            let created = to_json(&put(a, &o).await);
            objects.push((
                (*a).clone(),
                name_of(&created),
                uid_of(&created),
                rv_of(&created),
            ));
        }
        Foreign { objects }
    }

    pub fn names(&self) -> BTreeSet<String> {
        self.objects.iter().map(|(_, n, _, _)| n.clone()).collect()
    }

    /// The foreign objects whose uid or resourceVersion changed, or that are gone.
    pub async fn touched(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (a, name, uid, rv) in &self.objects {
            match get_json(a, name).await {
                Some(o) if &uid_of(&o) == uid && &rv_of(&o) == rv => {}
                Some(o) => out.push(format!(
                    "{name} (uid {uid} → {}, resourceVersion {rv} → {})",
                    uid_of(&o),
                    rv_of(&o)
                )),
                None => out.push(format!("{name} (deleted)")),
            }
        }
        out
    }
}
