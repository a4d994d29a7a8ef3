//! Whose requests a rule's are: the operator's own, or, with `spec.serviceAccount: NAME`,
//! those of the ServiceAccount NAME in the operator's namespace (`--lease-namespace`,
//! from `POD_NAMESPACE` when deployed; `default` else). Such a rule gets clients of its
//! own that send `Impersonate-User: system:serviceaccount:<namespace>:<NAME>` on every
//! request made for it: discovery and the permission check (a SelfSubjectAccessReview
//! then asks about the account), the watches of its parents, children and references,
//! reads, applies, status writes, finalizer patches, deletes, events, the clean-up of
//! kinds it dropped and the release of its parents' finalizers when it is removed. The
//! API server authorizes each as that account, so a template bug or a hostile parent
//! value in that rule can do only what the account is granted (`rulebook rbac
//! --per-rule` generates exactly what the rule needs), whatever the operator itself may.
//! What stays the operator's: its Lease, the CRDs and their storage migrations, the
//! webhook and admission-policy configurations, and a rollout's state (ConfigMaps in
//! the operator's namespace).
//!
//! The name comes from the rule file, which the platform team owns; nothing a parent's
//! author writes reaches it.
//!
//! Caches: every run of a rule has caches of its own (its parents, each child kind, each
//! reference: `wiring.rs`), filled through that rule's clients. No cache or watch is
//! shared between two rules, so none is shared between two identities: a rule never
//! sees an object through another rule's identity (two accounts may be allowed to read
//! different objects, and a shared cache would hand one rule what only the other may
//! read). Rules of the same identity, or of none, could share a parent or reference
//! watch of the same kind; they do not (their child watches differ anyway, by the
//! rule's label), and if they ever do, the cache key must include the identity.
//! What rules of one identity do share is the client (connection pool, TLS set-up):
//! built once per account and kept.
//!
//! kube's own `Config::auth_info.impersonate` sends the header (its extra-headers layer),
//! so the operator's client stack (`operator/client.rs`) is built once more per account
//! with it set; there is no hand-written header code.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use kube::Client;

use crate::render::CompiledRule;
use crate::shard::watch::Sharding;

/// Why a rule's clients cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// The engine was built without a way to impersonate (never in `rulebook run`).
    #[error("spec.serviceAccount '{0}': this process cannot impersonate")]
    Unsupported(String),
    #[error("cannot build the client of {user}: {message}")]
    Build { user: String, message: String },
}

/// Builds the operator's clients for an impersonated user. `operator/client.rs`, which
/// owns the client stack, implements it.
pub trait BuildClients: Send + Sync {
    /// The gated client every request made for a rule goes through, as `user`.
    fn client(&self, user: &str) -> Result<Client, IdentityError>;
    /// The client of a sharded replica's caches over `sharding`'s share, as `user`.
    fn watch_client(&self, user: &str, sharding: &Sharding) -> Result<Client, IdentityError>;
}

/// A rule's clients, as the engine hands them to it.
#[derive(Clone)]
pub struct RuleClients {
    /// Every request made for the rule but the sharded caches'.
    pub client: Client,
    /// Sharded and impersonating: the client of its parent and child caches (else the
    /// share's own watch client).
    pub watch: Option<Client>,
    /// The impersonated user; `None`: the operator's own identity.
    pub user: Option<String>,
}

/// The identities rules run as, and their clients.
pub struct Identities {
    /// Where the rules' ServiceAccounts are: the operator's namespace.
    namespace: String,
    build: Option<Arc<dyn BuildClients>>,
    /// The gated client of each impersonated user, built once.
    clients: Mutex<BTreeMap<String, Client>>,
}

/// The user name Kubernetes gives ServiceAccount `name` of `namespace`.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

impl Identities {
    /// Rules with `spec.serviceAccount` impersonate their account in `namespace`, with
    /// clients from `build`; without `build` such a rule cannot start.
    pub fn new(namespace: String, build: Option<Arc<dyn BuildClients>>) -> Identities {
        Identities {
            namespace,
            build,
            clients: Mutex::default(),
        }
    }

    /// The user `rule`'s requests are made as, when not the operator's own.
    pub fn user_of(&self, rule: &CompiledRule) -> Option<String> {
        let sa = rule.rule.spec.service_account.as_ref()?;
        Some(service_account_user(&self.namespace, &sa.value))
    }

    /// `rule`'s clients: `operator`'s (and the share's watch client) without
    /// `spec.serviceAccount`, else its account's.
    pub fn clients_for(
        &self,
        rule: &CompiledRule,
        operator: &Client,
        shard: Option<&Sharding>,
    ) -> Result<RuleClients, IdentityError> {
        let Some(user) = self.user_of(rule) else {
            return Ok(RuleClients {
                client: operator.clone(),
                watch: None,
                user: None,
            });
        };
        let Some(build) = &self.build else {
            return Err(IdentityError::Unsupported(user));
        };
        let client = {
            let mut clients = self.clients.lock().unwrap_or_else(|p| p.into_inner());
            match clients.get(&user) {
                Some(c) => c.clone(),
                None => {
                    let c = build.client(&user)?;
                    clients.insert(user.clone(), c.clone());
                    c
                }
            }
        };
        let watch = match shard {
            Some(s) => Some(build.watch_client(&user, s)?),
            None => None,
        };
        Ok(RuleClients {
            client,
            watch,
            user: Some(user),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rule(sa: Option<&str>) -> Arc<CompiledRule> {
        let mut text = "apiVersion: rulebook.dev/v1alpha1\nkind: Rule\nmetadata:\n  name: r\nspec:\n  parent:\n    apiVersion: example.com/v1\n    kind: App\n  children:\n    - name: c\n      apiVersion: v1\n      kind: ConfigMap\n      template: t.yaml\n".to_string();
        if let Some(sa) = sa {
            text.push_str(&format!("  serviceAccount: {sa}\n"));
        }
        super::super::compiled_for_test("r", text)
    }

    #[test]
    fn the_user_is_the_account_in_the_operators_namespace() {
        let ids = Identities::new("ops".into(), None);
        assert_eq!(ids.user_of(&rule(None)), None);
        assert_eq!(
            ids.user_of(&rule(Some("low"))).as_deref(),
            Some("system:serviceaccount:ops:low")
        );
    }

    /// Without a way to impersonate, a rule with an account gets no client at all
    /// (never the operator's own in its place).
    #[tokio::test]
    async fn no_operator_client_in_place_of_an_account() {
        let ids = Identities::new("ops".into(), None);
        let (mock, _handle) = tower_test::mock::pair::<
            http::Request<kube::client::Body>,
            http::Response<kube::client::Body>,
        >();
        let operator = Client::new(mock, "default");
        assert!(ids.clients_for(&rule(None), &operator, None).is_ok());
        assert!(matches!(
            ids.clients_for(&rule(Some("low")), &operator, None),
            Err(IdentityError::Unsupported(u)) if u == "system:serviceaccount:ops:low"
        ));
    }
}
