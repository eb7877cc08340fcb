//! A node's tunnel endpoint, `tcp://HOST:PORT` (SPEC §3.11): the one shape a `tunnelUrl` may
//! take. Clients connect to it, so HOST is held to an IP literal or an RFC 1123 host name: the
//! `url` crate alone lets shell syntax (`$ ( ) ; ' "` and backquotes) through in the opaque
//! host of a non-special scheme.

use std::fmt;

use crate::error::DomainError;

/// The longest tunnel URL.
pub const MAX_URL_LEN: usize = 256;

/// A checked `tcp://HOST:PORT`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TunnelAddress {
    /// An IP literal (IPv6 in brackets) or an RFC 1123 host name.
    pub host: String,
    pub port: u16,
}

impl fmt::Display for TunnelAddress {
    /// `host:port`, as a socket connect takes it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.host, self.port)
    }
}

/// Parses a tunnel URL; anything but `tcp://HOST:PORT` is `INVALID_INPUT` naming `field`.
pub fn parse(field: &str, text: &str) -> Result<TunnelAddress, DomainError> {
    let bad = || {
        DomainError::invalid_input(
            field,
            "a tcp://HOST:PORT URL, HOST an IP address or host name",
        )
    };
    if text.len() > MAX_URL_LEN {
        return Err(DomainError::invalid_input(
            field,
            format!("at most {MAX_URL_LEN} characters"),
        ));
    }
    let url = url::Url::parse(text).map_err(|_| bad())?;
    let bare = url.scheme() == "tcp"
        && url.username().is_empty()
        && url.password().is_none()
        && matches!(url.path(), "" | "/")
        && url.query().is_none()
        && url.fragment().is_none();
    let port = url.port().filter(|p| *p != 0);
    let host = match url.host() {
        Some(url::Host::Ipv4(ip)) => Some(ip.to_string()),
        Some(url::Host::Ipv6(ip)) => Some(format!("[{ip}]")),
        Some(url::Host::Domain(name)) if is_host_name(name) => Some(name.to_string()),
        _ => None,
    };
    match (bare, host, port) {
        (true, Some(host), Some(port)) => Ok(TunnelAddress { host, port }),
        _ => Err(bad()),
    }
}

/// RFC 1123: dot-separated labels of 1 to 63 letters, digits and inner hyphens, 253 at most.
fn is_host_name(name: &str) -> bool {
    let name = name.strip_suffix('.').unwrap_or(name);
    !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            (1..=63).contains(&label.len())
                && label
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_literals_and_host_names_pass() {
        let ok = |t: &str| parse("tunnelUrl", t).map(|a| a.to_string());
        assert_eq!(ok("tcp://127.0.0.1:2222").unwrap(), "127.0.0.1:2222");
        assert_eq!(ok("tcp://[::1]:22").unwrap(), "[::1]:22");
        assert_eq!(
            ok("tcp://host-0.hosts.example:2222").unwrap(),
            "host-0.hosts.example:2222"
        );
        assert_eq!(ok("tcp://node7:22/").unwrap(), "node7:22");
    }

    #[test]
    fn shell_syntax_and_other_shapes_are_refused_naming_the_field() {
        for text in [
            "tcp://$(touch${IFS}pwned):22",
            "tcp://`id`:22",
            "tcp://a;id:22",
            "tcp://'a':22",
            "tcp://\"a\":22",
            "tcp://{a,b}:22",
            "tcp://a|b:22",
            "tcp://a&b:22",
            "tcp://a%20b:22",
            "tcp://-oProxyCommand:22",
            "tcp://a..b:22",
            "tcp://host:0",
            "tcp://host",
            "http://host:22",
            "tcp://user@host:22",
            "tcp://host:22/path",
            "tcp://host:22?q",
        ] {
            let err = parse("tunnelUrl", text).expect_err(text);
            assert!(
                matches!(&err, DomainError::InvalidInput { field, .. } if field == "tunnelUrl"),
                "{text}: {err:?}"
            );
        }
        let long = format!("tcp://{}:22", "a.".repeat(200));
        assert!(parse("tunnelUrl", &long).is_err());
    }
}
