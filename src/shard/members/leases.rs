//! A member's own Lease (created, renewed with the generation it applied, or found
//! gone: fenced) and the assignment Lease the coordinator writes (a compare-and-swap on
//! the version it read).

use std::collections::BTreeMap;

use k8s_openapi::api::coordination::v1::{Lease, LeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use kube::ResourceExt;
use kube::api::{ObjectMeta, PostParams};
use tracing::debug;

use super::{ACKED, ASSIGNMENT, GROUP_LABEL, Membership, ROLE_LABEL, RULES, Renewal, Stored};
use crate::shard::Assignment;

impl Membership {
    /// Creates or renews this member's Lease, with the generation it has applied.
    pub(super) async fn renew(&mut self, fingerprint: &str, acked: u64) -> Renewal {
        let stamp = MicroTime(jiff::Timestamp::now());
        let mut annotations = BTreeMap::new();
        annotations.insert(RULES.to_string(), fingerprint.to_string());
        annotations.insert(ACKED.to_string(), acked.to_string());
        let existing = match self.api.get_opt(&self.lease_name).await {
            Ok(None) if self.has_lease => return Renewal::Fenced,
            Ok(l) => l,
            Err(e) => {
                debug!(error = %e, "cannot read the member Lease");
                return Renewal::Failed;
            }
        };
        let result = match existing {
            Some(mut l) => {
                l.metadata.annotations = Some(annotations);
                let spec = l.spec.get_or_insert_with(LeaseSpec::default);
                spec.holder_identity = Some(self.identity.clone());
                spec.lease_duration_seconds = Some(self.duration.as_secs() as i32);
                spec.renew_time = Some(stamp);
                self.api
                    .replace(&self.lease_name, &PostParams::default(), &l)
                    .await
                    .map(|_| ())
            }
            None => self
                .api
                .create(
                    &PostParams::default(),
                    &Lease {
                        metadata: ObjectMeta {
                            name: Some(self.lease_name.clone()),
                            labels: Some(self.labels("member")),
                            annotations: Some(annotations),
                            ..Default::default()
                        },
                        spec: Some(LeaseSpec {
                            holder_identity: Some(self.identity.clone()),
                            lease_duration_seconds: Some(self.duration.as_secs() as i32),
                            acquire_time: Some(stamp.clone()),
                            renew_time: Some(stamp),
                            ..Default::default()
                        }),
                    },
                )
                .await
                .map(|_| ()),
        };
        match result {
            Ok(()) => {
                self.has_lease = true;
                Renewal::Renewed
            }
            Err(kube::Error::Api(e)) if e.code == 404 && self.has_lease => Renewal::Fenced,
            Err(e) => {
                debug!(error = %e, "member Lease renewal failed");
                Renewal::Failed
            }
        }
    }

    /// Writes `next` over the assignment Lease as read (a compare-and-swap).
    pub(super) async fn publish(&self, read: Option<Lease>, next: &Assignment) -> bool {
        let stored = Stored {
            generation: next.generation,
            owners: next
                .owners
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
            target: next
                .target
                .iter()
                .map(|(k, v)| (k.clone(), v.encode()))
                .collect(),
        };
        let Ok(text) = serde_json::to_string(&stored) else {
            return false;
        };
        let name = format!("{}-assignment", self.group);
        let result = match read {
            Some(mut l) => {
                l.annotations_mut().insert(ASSIGNMENT.to_string(), text);
                self.api.replace(&name, &PostParams::default(), &l).await
            }
            None => {
                let mut annotations = BTreeMap::new();
                annotations.insert(ASSIGNMENT.to_string(), text);
                self.api
                    .create(
                        &PostParams::default(),
                        &Lease {
                            metadata: ObjectMeta {
                                name: Some(name),
                                labels: Some(self.labels("assignment")),
                                annotations: Some(annotations),
                                ..Default::default()
                            },
                            spec: Some(LeaseSpec::default()),
                        },
                    )
                    .await
            }
        };
        result
            .map_err(
                |e| debug!(error = %e, "the assignment was not published (another coordinator?)"),
            )
            .is_ok()
    }

    pub(super) fn labels(&self, role: &str) -> BTreeMap<String, String> {
        BTreeMap::from([
            (GROUP_LABEL.to_string(), self.group.clone()),
            (ROLE_LABEL.to_string(), role.to_string()),
        ])
    }
}
