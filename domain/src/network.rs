//! Which addresses belong to networks a tenant must not reach through the control plane:
//! loopback, link-local (169.254.0.0/16, fe80::/10), RFC 1918, unique-local (fc00::/7) and
//! their kin. A webhook posts from inside the control plane's network, so a URL that resolves
//! there would let a tenant probe (or call) the control plane's own services; the operator may
//! allow such ranges explicitly (`[webhooks] allow_private`).

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::str::FromStr;

/// An IPv4 or IPv6 network, e.g. `127.0.0.0/8` or `fd00::/8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpCidr {
    network: IpAddr,
    prefix: u8,
}

/// A string that is not `address/prefix`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not a CIDR such as 127.0.0.0/8 or fd00::/8")]
pub struct InvalidCidr(pub String);

impl FromStr for IpCidr {
    type Err = InvalidCidr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || InvalidCidr(s.to_string());
        let (address, prefix) = s.split_once('/').ok_or_else(bad)?;
        let network: IpAddr = address.parse().map_err(|_| bad())?;
        let prefix: u8 = prefix.parse().map_err(|_| bad())?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        if prefix > max {
            return Err(bad());
        }
        Ok(IpCidr {
            network: canonical(network),
            prefix,
        })
    }
}

impl fmt::Display for IpCidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl IpCidr {
    /// Whether `ip` lies in this network (an IPv4-mapped IPv6 address counts as its IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        match (self.network, canonical(ip)) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                same_prefix(&net.octets(), &ip.octets(), self.prefix)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                same_prefix(&net.octets(), &ip.octets(), self.prefix)
            }
            _ => false,
        }
    }
}

/// Whether the first `prefix` bits of `a` and `b` agree.
fn same_prefix(a: &[u8], b: &[u8], prefix: u8) -> bool {
    let (whole, rest) = (usize::from(prefix / 8), prefix % 8);
    if a[..whole] != b[..whole] {
        return false;
    }
    if rest == 0 {
        return true;
    }
    let mask = 0xffu8 << (8 - rest);
    a[whole] & mask == b[whole] & mask
}

/// An IPv4 address written as IPv6 (`::ffff:a.b.c.d`, or NAT64's `64:ff9b::a.b.c.d`) is that
/// IPv4 address: a connection to it reaches the same host.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None if is_nat64(&v6) => {
                let o = v6.octets();
                IpAddr::V4(Ipv4Addr::new(o[12], o[13], o[14], o[15]))
            }
            None => ip,
        },
        v4 => v4,
    }
}

fn is_nat64(v6: &Ipv6Addr) -> bool {
    v6.segments()[..6] == [0x64, 0xff9b, 0, 0, 0, 0]
}

/// Whether `ip` is on a network internal to wherever the control plane runs: unspecified,
/// loopback, link-local, private (RFC 1918), shared (100.64.0.0/10), benchmarking
/// (198.18.0.0/15), reserved (240.0.0.0/4, broadcast included), unique-local or multicast;
/// and the IPv6 forms that carry an IPv4 address a gateway may turn into an internal one:
/// local-use NAT64 (64:ff9b:1::/48), 6to4 (2002::/16) and IPv4-compatible (`::a.b.c.d`).
pub fn is_internal(ip: IpAddr) -> bool {
    match canonical(ip) {
        IpAddr::V4(v4) => {
            let o = v4.octets();
            o[0] == 0
                || v4.is_loopback()
                || v4.is_private()
                || v4.is_link_local()
                || (o[0] == 100 && (o[1] & 0xc0) == 64)
                || (o[0] == 198 && (o[1] & 0xfe) == 18)
                || (o[0] & 0xf0) == 240
                || v4.is_multicast()
        }
        IpAddr::V6(v6) => {
            let s = v6.segments();
            v6.is_unspecified()
                || v6.is_loopback()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || v6.is_multicast()
                || (s[0], s[1], s[2]) == (0x64, 0xff9b, 1)
                || s[0] == 0x2002
                // IPv4-compatible (::/96, deprecated): no public host has one.
                || s[..6] == [0; 6]
        }
    }
}

/// Whether a connection to `ip` may be made: it is not internal, or the operator allowed a
/// network that holds it.
pub fn reachable(ip: IpAddr, allowed: &[IpCidr]) -> bool {
    !is_internal(ip) || allowed.iter().any(|net| net.contains(ip))
}

/// Whether `host` is a name that always means this machine (RFC 6761: `localhost` and every
/// name under it), whatever a resolver answers.
pub fn is_local_name(host: &str) -> bool {
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    host == "localhost" || host.ends_with(".localhost")
}

/// `url` fit for a log line: a password becomes `***`, and so does a lone user part (NATS and
/// others take a token there): `nats://user:***@host:4222`, `nats://***@host:4222`.
pub fn redact_credentials(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    // The credentials end at the last `@` before the path.
    let authority_end = url[scheme_end..]
        .find(['/', '?', '#'])
        .map_or(url.len(), |i| scheme_end + i);
    let Some(at) = url[scheme_end..authority_end]
        .rfind('@')
        .map(|i| scheme_end + i)
    else {
        return url.to_string();
    };
    let masked = match url[scheme_end..at].split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    format!("{}{masked}{}", &url[..scheme_end], &url[at..])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn the_control_planes_own_networks_are_internal() {
        for internal in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "172.31.255.255",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "::1",
            "::",
            "fe80::1",
            "fd12:3456::1",
            "fc00::1",
            "::ffff:127.0.0.1",
            "::ffff:169.254.169.254",
            "64:ff9b::a9fe:a9fe",
            "198.18.0.1",
            "198.19.255.255",
            "240.0.0.1",
            "255.255.255.255",
            "64:ff9b:1::a00:1",
            "64:ff9b:1:ffff::1",
            "2002:a00:1::1",
            "2002:808:808::1",
            "::a00:1",
            "::808:808",
        ] {
            assert!(is_internal(ip(internal)), "{internal}");
        }
        for public in [
            "8.8.8.8",
            "172.32.0.1",
            "1.1.1.1",
            "2606:4700::1111",
            "::ffff:8.8.8.8",
            "198.17.255.255",
            "198.20.0.1",
            "223.0.0.1",
            "64:ff9b:2::1",
            "2003::1",
        ] {
            assert!(!is_internal(ip(public)), "{public}");
        }
    }

    #[test]
    fn an_allowed_network_makes_its_addresses_reachable() {
        let allowed: Vec<IpCidr> = vec!["127.0.0.0/8".parse().unwrap()];
        assert!(reachable(ip("127.0.0.1"), &allowed));
        assert!(reachable(ip("::ffff:127.0.0.9"), &allowed));
        assert!(!reachable(ip("10.0.0.1"), &allowed));
        assert!(!reachable(ip("::1"), &allowed));
        assert!(reachable(ip("8.8.8.8"), &[]));
    }

    #[test]
    fn cidrs_parse_and_contain_by_prefix() {
        let net: IpCidr = "10.32.0.0/11".parse().unwrap();
        assert!(net.contains(ip("10.63.255.255")));
        assert!(!net.contains(ip("10.64.0.0")));
        assert!("fe80::/10"
            .parse::<IpCidr>()
            .unwrap()
            .contains(ip("febf::1")));
        assert!("0.0.0.0/0"
            .parse::<IpCidr>()
            .unwrap()
            .contains(ip("9.9.9.9")));
        for bad in ["10.0.0.0", "10.0.0.0/33", "::/129", "x/8", "10.0.0.0/-1"] {
            assert!(bad.parse::<IpCidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn credentials_in_a_url_are_masked() {
        assert_eq!(
            redact_credentials("nats://user:s3cret@nats.internal:4222"),
            "nats://user:***@nats.internal:4222"
        );
        assert_eq!(
            redact_credentials("nats://t0ken@127.0.0.1:4222"),
            "nats://***@127.0.0.1:4222"
        );
        assert_eq!(
            redact_credentials("postgres://u:p@db/vps?x=a@b"),
            "postgres://u:***@db/vps?x=a@b"
        );
        assert_eq!(
            redact_credentials("nats://127.0.0.1:4222"),
            "nats://127.0.0.1:4222"
        );
    }

    #[test]
    fn localhost_names_are_local_whatever_they_resolve_to() {
        assert!(is_local_name("localhost"));
        assert!(is_local_name("LOCALHOST."));
        assert!(is_local_name("api.localhost"));
        assert!(!is_local_name("localhost.example.com"));
    }
}
