//! A write request sent through an `Api`'s client and its answer read in part: the
//! writer's applies (a status apply reads the parent's metadata and status, a child apply
//! decodes its answer as the caches decode a watched object) and the recorder's Event
//! creates (only the name). `Api::patch` and `Api::create` would read the whole object.
//!
//! Below both `writer` and `recorder`, which the writer uses to publish events.

use kube::api::Api;

/// Sends `req` through `api`'s client, tagged with `verb` as kube-client tags its own,
/// reading the answer into `T` (the writes whose answers are read in part).
pub(crate) async fn send_as<T: serde::de::DeserializeOwned, K: kube::Resource + Clone>(
    api: &Api<K>,
    mut req: http::Request<Vec<u8>>,
    verb: &'static str,
) -> Result<T, kube::Error> {
    req.extensions_mut().insert(verb);
    api.clone().into_client().request(req).await
}
