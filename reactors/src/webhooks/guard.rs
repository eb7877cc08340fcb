//! Where a delivery may connect: never into the control plane's own networks (loopback,
//! link-local, private, unique-local) unless the operator allowed the range. Checked at
//! connect time, on the addresses actually dialled, so a name that resolved to a public
//! address when the subscription was created and to an internal one now (DNS rebinding) is
//! still refused. What an attempt's failure records says what kind of failure it was, never
//! the transport's own text (which can name internal addresses and ports).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use reqwest::dns::{Addrs, Name, Resolve, Resolving};
use vps_domain::network::{is_local_name, reachable, IpCidr};

/// A resolver that drops every address the operator did not allow.
#[derive(Debug, Clone)]
pub(crate) struct GuardedResolver {
    allowed: Arc<Vec<IpCidr>>,
}

/// A delivery refused because its host is on an internal network.
#[derive(Debug, thiserror::Error)]
#[error("the endpoint's address is on an internal network")]
pub(crate) struct Blocked;

impl GuardedResolver {
    /// Allows internal addresses only inside `allowed`.
    pub(crate) fn new(allowed: Vec<IpCidr>) -> GuardedResolver {
        GuardedResolver {
            allowed: Arc::new(allowed),
        }
    }

    /// Whether a connection to `ip` may be made.
    pub(crate) fn permits(&self, ip: IpAddr) -> bool {
        reachable(ip, &self.allowed)
    }
}

impl Resolve for GuardedResolver {
    fn resolve(&self, name: Name) -> Resolving {
        let guard = self.clone();
        Box::pin(async move {
            let host = name.as_str().to_string();
            let resolved: Vec<SocketAddr> =
                tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let local = is_local_name(&host);
            let permitted: Vec<SocketAddr> = resolved
                .into_iter()
                .filter(|a| guard.permits(a.ip()) && (!local || guard.permits(loopback())))
                .collect();
            if permitted.is_empty() {
                return Err(Box::new(Blocked) as Box<dyn std::error::Error + Send + Sync>);
            }
            Ok(Box::new(permitted.into_iter()) as Addrs)
        })
    }
}

fn loopback() -> IpAddr {
    IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)
}

/// What a transport failure is recorded as: its kind only.
pub(crate) fn describe(e: &reqwest::Error) -> String {
    if blocked(e) {
        return Blocked.to_string();
    }
    let kind = if e.is_timeout() {
        "timed out"
    } else if e.is_connect() {
        "cannot connect"
    } else {
        "request failed"
    };
    kind.to_string()
}

/// Whether the failure was the guard's refusal.
fn blocked(e: &reqwest::Error) -> bool {
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        if cause.is::<Blocked>() {
            return true;
        }
        source = cause.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_resolver_drops_internal_addresses_unless_allowed() {
        let strict = GuardedResolver::new(Vec::new());
        let name: Name = "localhost".parse().unwrap();
        assert!(strict.resolve(name).await.is_err());
        let lenient = GuardedResolver::new(vec!["127.0.0.0/8".parse().unwrap()]);
        let name: Name = "127.0.0.1".parse().unwrap();
        let addrs: Vec<SocketAddr> = lenient.resolve(name).await.unwrap().collect();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()) && !addrs.is_empty());
    }
}
