//! `rulebook run`'s webhook flags (docs/cli.md, "Webhooks"): where the server listens,
//! how the API server reaches it, where its certificates live. Giving `--webhook-url` or
//! `--webhook-service` turns the server on, on every replica, whether or not a rule needs
//! it yet (rules reload; a CRD with conversion needs it the moment it is installed).
//! Values are checked as the command line is parsed.

use std::net::IpAddr;
use std::time::Duration;

use clap::Args;

use crate::webhook::Base;
use crate::webhook::run::Settings;

#[derive(Args, Debug, Clone)]
pub struct WebhookArgs {
    /// Serve webhooks, called by the API server at this URL: `https://HOST:PORT`, for an
    /// API server outside the cluster (e.g. the local control plane calling 127.0.0.1).
    #[arg(long, value_parser = url, conflicts_with = "webhook_service")]
    pub webhook_url: Option<Base>,
    /// Serve webhooks, called by the API server through this Service:
    /// `NAMESPACE/NAME[:PORT]` (port 443 by default).
    #[arg(long, value_parser = service)]
    pub webhook_service: Option<Base>,
    /// Address the webhook server listens on.
    #[arg(long, default_value = "0.0.0.0")]
    pub webhook_bind: IpAddr,
    /// Port the webhook server listens on (HTTPS).
    #[arg(long, default_value_t = 9443)]
    pub webhook_port: u16,
    /// The Secret holding the webhooks' CA and serving certificate, shared by every
    /// replica: `NAMESPACE/NAME` (default: the pod's namespace, else `default`,
    /// `/rulebook-webhook`). Rulebook creates it.
    #[arg(long, value_parser = namespaced)]
    pub webhook_secret: Option<(String, String)>,
    /// The name of the ValidatingWebhookConfiguration and MutatingWebhookConfiguration
    /// Rulebook generates (one of each, a webhook per rule).
    #[arg(long, default_value = "rulebook")]
    pub webhook_configuration: String,
    /// Lifetime of a serving certificate; a new one is made at two thirds of it.
    #[arg(long, default_value = "2160h", value_parser = duration)]
    pub webhook_cert_validity: Duration,
    /// Lifetime of the CA; a new one is made at two thirds of it, trusted beside the old
    /// one until every replica serves a certificate from it.
    #[arg(long, default_value = "26280h", value_parser = duration)]
    pub webhook_ca_validity: Duration,
    /// How often each replica reads the certificates' Secret; a CA rotation waits three
    /// times this, plus 5 s, between its steps.
    #[arg(long, default_value = "10s", value_parser = duration)]
    pub webhook_refresh: Duration,
}

impl WebhookArgs {
    /// The server's settings, or `None` when webhooks are off.
    pub fn settings(&self, pod_namespace: Option<&str>) -> Option<Settings> {
        let base = self.webhook_url.clone().or(self.webhook_service.clone())?;
        let secret = self.webhook_secret.clone().unwrap_or_else(|| {
            (
                pod_namespace.unwrap_or("default").to_string(),
                "rulebook-webhook".to_string(),
            )
        });
        Some(Settings {
            bind: self.webhook_bind,
            port: self.webhook_port,
            base,
            secret,
            configuration: self.webhook_configuration.clone(),
            cert_validity: self.webhook_cert_validity,
            ca_validity: self.webhook_ca_validity,
            refresh: self.webhook_refresh,
            own_namespace: pod_namespace.map(str::to_string),
            evaluations: 4,
        })
    }
}

pub fn duration(s: &str) -> Result<Duration, String> {
    crate::rules::parse_duration(s).map_err(|e| e.to_string())
}

/// `https://HOST[:PORT]`, without a path.
pub fn url(s: &str) -> Result<Base, String> {
    let rest = s
        .strip_prefix("https://")
        .ok_or_else(|| format!("{s:?}: the API server calls webhooks over https://"))?;
    let host = rest.trim_end_matches('/');
    if host.is_empty() || host.contains(['/', '?', '#', '@']) {
        return Err(format!("{s:?}: give https://HOST:PORT, without a path"));
    }
    Ok(Base::Url(format!("https://{host}")))
}

/// `NAMESPACE/NAME[:PORT]`.
pub fn service(s: &str) -> Result<Base, String> {
    let (ns, rest) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?}: give NAMESPACE/NAME[:PORT]"))?;
    let (name, port) = match rest.split_once(':') {
        Some((n, p)) => (
            n,
            p.parse::<u16>()
                .map_err(|_| format!("{s:?}: bad port {p:?}"))?,
        ),
        None => (rest, 443),
    };
    if !crate::rules::is_dns_label(ns) || !crate::rules::is_dns_label(name) {
        return Err(format!("{s:?}: namespace and name must be DNS labels"));
    }
    Ok(Base::Service {
        namespace: ns.to_string(),
        name: name.to_string(),
        port,
    })
}

/// `NAMESPACE/NAME`.
pub fn namespaced(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name))
            if crate::rules::is_dns_label(ns) && !name.is_empty() && !name.contains('/') =>
        {
            Ok((ns.to_string(), name.to_string()))
        }
        _ => Err(format!("{s:?}: give NAMESPACE/NAME")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_read_from_the_command_line() {
        assert_eq!(
            url("https://127.0.0.1:9443/"),
            Ok(Base::Url("https://127.0.0.1:9443".into()))
        );
        assert!(url("http://127.0.0.1:9443").is_err());
        assert!(url("https://127.0.0.1:9443/validate").is_err());
        assert_eq!(
            service("rulebook-system/rulebook-webhook"),
            Ok(Base::Service {
                namespace: "rulebook-system".into(),
                name: "rulebook-webhook".into(),
                port: 443
            })
        );
        assert!(matches!(
            service("a/b:8443"),
            Ok(Base::Service { port: 8443, .. })
        ));
        assert!(service("a/b:x").is_err() && service("ab").is_err());
        assert_eq!(namespaced("ns/s"), Ok(("ns".into(), "s".into())));
        assert!(namespaced("s").is_err());
    }
}
