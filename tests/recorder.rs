//! The event recorder against the local control plane: a repeat becomes a series on the
//! same Event, and a series whose Event is gone (deleted, or its namespace recreated)
//! starts a new Event instead of failing on every repeat for six minutes.

mod common;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use kube::api::{Api, DeleteParams, ListParams};
use kube::runtime::events::{Event, EventType, Reporter};
use prometheus_client::metrics::family::Family;
use rulebook::write::outbox::{Outbox, OutboxLimits};
use rulebook::write::recorder::Recorder;

async fn events(api: &Api<K8sEvent>) -> Vec<K8sEvent> {
    api.list(&ListParams::default())
        .await
        .expect("list events")
        .items
}

#[tokio::test]
async fn a_series_whose_event_is_gone_starts_a_new_event() {
    let client = common::client().await;
    let ns = common::namespace(&client, "recorder").await;
    let recorder = Recorder::new(
        client.clone(),
        Reporter {
            controller: "rulebook-test".into(),
            instance: None,
        },
        Outbox::new(OutboxLimits::DEFAULT, Family::default()),
    );
    let about = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("ConfigMap".into()),
        namespace: Some(ns.to_string()),
        name: Some("parent".into()),
        ..Default::default()
    };
    let ev = Event {
        type_: EventType::Warning,
        reason: "RenderFailed".into(),
        note: Some("a template failed".into()),
        action: "Render".into(),
        secondary: None,
    };
    let api: Api<K8sEvent> = Api::namespaced(client.clone(), &ns);

    recorder.publish(&ev, &about).await.expect("first event");
    recorder.publish(&ev, &about).await.expect("the repeat");
    let listed = events(&api).await;
    assert_eq!(listed.len(), 1, "a repeat is a series, not a second Event");
    let first = listed[0].metadata.name.clone().unwrap_or_default();
    assert_eq!(listed[0].series.as_ref().map(|s| s.count), Some(2));

    api.delete(&first, &DeleteParams::default())
        .await
        .expect("delete the Event");
    recorder
        .publish(&ev, &about)
        .await
        .expect("a repeat after the Event is gone starts a new one");
    let listed = events(&api).await;
    assert_eq!(listed.len(), 1, "{listed:?}");
    assert_ne!(listed[0].metadata.name.as_deref(), Some(first.as_str()));
    assert!(listed[0].series.is_none(), "a new Event, not a series");

    // And that new Event is the series of the next repeat.
    recorder.publish(&ev, &about).await.expect("next repeat");
    let listed = events(&api).await;
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].series.as_ref().map(|s| s.count), Some(2));
}
