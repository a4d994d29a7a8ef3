//! A test's namespace, deleted when the test is done with it, also when the test panics.
//!
//! Before this guard, each test ended with a `cleanup_namespace` call: a test that failed
//! (panicked) before it never got there and left its namespace, with its parents,
//! children and pods, on the local control plane for every later test to share the API
//! server with. A `TestNamespace` deletes its namespace in `Drop`, which runs on a panic
//! too. Its fields drop after the locals declared after it: the test's operator (declared
//! later) is stopped before its namespace goes.
//!
//! `Drop` cannot await, and a test's runtime may be single-threaded, so the deletions are
//! sent by one thread per test binary with a runtime and a client of its own; `Drop` waits
//! until the API server has accepted the deletion (background propagation: the namespace
//! controller removes the contents afterwards, as `kubectl delete namespace --wait=false`
//! does), so a test binary that exits right after its last test still deletes.
//! `RULEBOOK_TEST_KEEP_NAMESPACES=1` keeps them, to look at what a failed test left.

use std::fmt;
use std::ops::Deref;
use std::sync::Mutex;
use std::sync::mpsc::{Sender, channel};
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::Client;
use kube::api::{Api, DeleteParams, PostParams};
use serde_json::json;

use super::{kubeconfig_path, unique, wait_for};

/// A namespace this test created; deleted on drop (see the module header).
pub struct TestNamespace {
    name: String,
}

impl TestNamespace {
    /// Creates a namespace named `<prefix>-<unique suffix>` and waits for its `default`
    /// ServiceAccount (the service account controller creates it; pods need it).
    pub async fn create(client: &Client, prefix: &str) -> TestNamespace {
        TestNamespace::create_named(client, &unique(prefix)).await
    }

    /// Like [`TestNamespace::create`], with exactly this name (for a test whose scenario
    /// needs a fixed name; it must be unique to the test).
    pub async fn create_named(client: &Client, name: &str) -> TestNamespace {
        let guard = TestNamespace::create_without_pods(client, name).await;
        let sa: Api<k8s_openapi::api::core::v1::ServiceAccount> =
            Api::namespaced(client.clone(), name);
        wait_for(
            Duration::from_secs(60),
            "the default ServiceAccount",
            || async { sa.get_opt("default").await.ok().flatten() },
        )
        .await;
        guard
    }

    /// Like [`TestNamespace::create_named`], without waiting for the `default`
    /// ServiceAccount: for a namespace that will hold no pod (the sharding tests create
    /// hundreds).
    pub async fn create_without_pods(client: &Client, name: &str) -> TestNamespace {
        let api: Api<Namespace> = Api::all(client.clone());
        let ns: Namespace =
            serde_json::from_value(json!({"metadata": {"name": name}})).expect("namespace");
        api.create(&PostParams::default(), &ns)
            .await
            .unwrap_or_else(|e| panic!("create namespace {name}: {e}"));
        TestNamespace {
            name: name.to_string(),
        }
    }

    /// Deletes namespace `name` that an earlier, interrupted run left (a test with a fixed
    /// name, or one that counts every object of its kind); does not wait for it to go.
    pub async fn delete_leftover(client: &Client, name: &str) {
        delete(client, name).await;
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn as_str(&self) -> &str {
        &self.name
    }
}

impl Deref for TestNamespace {
    type Target = str;
    fn deref(&self) -> &str {
        &self.name
    }
}

impl AsRef<str> for TestNamespace {
    fn as_ref(&self) -> &str {
        &self.name
    }
}

impl fmt::Display for TestNamespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name)
    }
}

impl fmt::Debug for TestNamespace {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.name, f)
    }
}

impl PartialEq<str> for TestNamespace {
    fn eq(&self, other: &str) -> bool {
        self.name == other
    }
}

impl PartialEq<&str> for TestNamespace {
    fn eq(&self, other: &&str) -> bool {
        self.name == *other
    }
}

impl PartialEq<String> for TestNamespace {
    fn eq(&self, other: &String) -> bool {
        &self.name == other
    }
}

impl serde::Serialize for TestNamespace {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name)
    }
}

impl Drop for TestNamespace {
    fn drop(&mut self) {
        if std::env::var_os("RULEBOOK_TEST_KEEP_NAMESPACES").is_some_and(|v| v == "1") {
            eprintln!(
                "kept namespace {} (RULEBOOK_TEST_KEEP_NAMESPACES=1)",
                self.name
            );
            return;
        }
        let (done, accepted) = channel();
        if deleter().send((self.name.clone(), done)).is_ok() {
            // The deleter answers once the API server answered (or after its timeout).
            let _ = accepted.recv_timeout(Duration::from_secs(30));
        }
    }
}

/// Several namespaces, read as their names (`&[String]`); each deleted on drop.
pub struct TestNamespaces {
    names: Vec<String>,
    _guards: Vec<TestNamespace>,
}

impl TestNamespaces {
    pub fn new(guards: Vec<TestNamespace>) -> TestNamespaces {
        TestNamespaces {
            names: guards.iter().map(|g| g.name.clone()).collect(),
            _guards: guards,
        }
    }
}

impl Deref for TestNamespaces {
    type Target = [String];
    fn deref(&self) -> &[String] {
        &self.names
    }
}

impl<'a> IntoIterator for &'a TestNamespaces {
    type Item = &'a String;
    type IntoIter = std::slice::Iter<'a, String>;
    fn into_iter(self) -> Self::IntoIter {
        self.names.iter()
    }
}

type Request = (String, Sender<()>);

/// The sender of the binary's deleter thread, started on first use.
fn deleter() -> Sender<Request> {
    static DELETER: Mutex<Option<Sender<Request>>> = Mutex::new(None);
    let mut slot = DELETER.lock().unwrap_or_else(|p| p.into_inner());
    slot.get_or_insert_with(|| {
        let (tx, rx) = channel::<Request>();
        std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                eprintln!("namespace deleter: no runtime; namespaces are left behind");
                return;
            };
            rt.block_on(async move {
                let mut client: Option<Client> = None;
                while let Ok((name, done)) = rx.recv() {
                    if client.is_none() {
                        client = admin_client().await;
                    }
                    if let Some(c) = &client {
                        delete(c, &name).await;
                    }
                    let _ = done.send(());
                }
            });
        });
        tx
    })
    .clone()
}

/// A client for the cluster, without [`super::client`]'s readiness check (a test that
/// restarted the API server may end while it comes back; the deletion retries).
async fn admin_client() -> Option<Client> {
    let kc = kube::config::Kubeconfig::read_from(kubeconfig_path()).ok()?;
    let config =
        kube::Config::from_custom_kubeconfig(kc, &kube::config::KubeConfigOptions::default())
            .await
            .ok()?;
    Client::try_from(config).ok()
}

/// Deletes namespace `name`, retrying for a few seconds while the API server refuses.
async fn delete(client: &Client, name: &str) {
    let api: Api<Namespace> = Api::all(client.clone());
    for attempt in 0..10 {
        match api.delete(name, &DeleteParams::background()).await {
            Ok(_) => return,
            Err(kube::Error::Api(e)) if e.code == 404 => return,
            Err(e) if attempt == 9 => {
                eprintln!("namespace {name} was not deleted: {e}");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(500)).await,
        }
    }
}
