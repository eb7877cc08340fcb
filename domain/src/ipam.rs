//! IP address management for hosted pools (SPEC §3.1): one IPv4 range per pool, one lease per
//! placed instance, any free address (kept as a free list); network, broadcast and gateway
//! never leased.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::DomainError;

/// The longest prefix that still leaves an address to lease: a /30 holds network, gateway, one
/// lease and broadcast. A /31 or /32 has nothing left once those are set aside.
pub const MAX_PREFIX: u8 = 30;

/// The shortest prefix a pool's range may have: a /16 holds 65,534 addresses, and every free
/// one is kept as a row so concurrent creates can each claim a different one.
pub const MIN_PREFIX: u8 = 16;

/// An IPv4 network in CIDR notation, host bits zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Cidr {
    network: Ipv4Addr,
    prefix: u8,
}

impl Ipv4Cidr {
    /// Parses `a.b.c.d/n`. Refuses malformed text, host bits set, and prefixes longer than
    /// [`MAX_PREFIX`], each as `INVALID_INPUT` on field `cidr`.
    pub fn parse(s: &str) -> Result<Ipv4Cidr, DomainError> {
        let bad = |message: String| DomainError::invalid_input("cidr", message);
        let (addr, prefix) = s
            .split_once('/')
            .ok_or_else(|| bad(format!("{s:?} is not in a.b.c.d/prefix form")))?;
        let addr = Ipv4Addr::from_str(addr)
            .map_err(|_| bad(format!("{addr:?} is not an IPv4 address")))?;
        let prefix: u8 = prefix
            .parse()
            .ok()
            .filter(|p| *p <= 32)
            .ok_or_else(|| bad(format!("prefix {prefix:?} is not a number from 0 to 32")))?;
        if prefix < MIN_PREFIX {
            return Err(bad(format!(
                "a /{prefix} is larger than a pool's range may be; use /{MIN_PREFIX} or longer"
            )));
        }
        if prefix > MAX_PREFIX {
            return Err(bad(format!(
                "a /{prefix} holds no address to lease once network, broadcast and gateway \
                 are set aside; use /{MAX_PREFIX} or shorter"
            )));
        }
        let cidr = Ipv4Cidr {
            network: Ipv4Addr::from(u32::from(addr) & mask(prefix)),
            prefix,
        };
        if cidr.network != addr {
            return Err(bad(format!("{s} has host bits set; the network is {cidr}")));
        }
        Ok(cidr)
    }

    /// The network address.
    pub fn network(&self) -> Ipv4Addr {
        self.network
    }

    /// The prefix length.
    pub fn prefix(&self) -> u8 {
        self.prefix
    }

    /// The broadcast address.
    pub fn broadcast(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) | !mask(self.prefix))
    }

    /// The default gateway: the first host address.
    pub fn default_gateway(&self) -> Ipv4Addr {
        Ipv4Addr::from(u32::from(self.network) + 1)
    }

    /// Whether `addr` lies in the network (network and broadcast included).
    pub fn contains(&self, addr: Ipv4Addr) -> bool {
        u32::from(addr) & mask(self.prefix) == u32::from(self.network)
    }

    /// Whether `addr` is a host address of the network (neither network nor broadcast).
    pub fn is_host(&self, addr: Ipv4Addr) -> bool {
        self.contains(addr) && addr != self.network && addr != self.broadcast()
    }

    /// Checks an operator-given gateway: it must be a host address of the network.
    pub fn check_gateway(&self, gateway: Ipv4Addr) -> Result<(), DomainError> {
        if self.is_host(gateway) {
            Ok(())
        } else {
            Err(DomainError::invalid_input(
                "gateway",
                format!("{gateway} is not a host address of {self}"),
            ))
        }
    }

    /// How many addresses can be leased (hosts minus the gateway).
    pub fn leasable(&self) -> u64 {
        (1u64 << (32 - self.prefix)) - 3
    }

    /// `addr` with this network's prefix, the form a NIC is configured with (`10.0.0.5/24`).
    pub fn with_prefix(&self, addr: Ipv4Addr) -> String {
        format!("{addr}/{}", self.prefix)
    }
}

/// Every address of `cidr` that may be leased: the hosts other than `gateway`, in order. A
/// pool keeps these, minus the leased ones, as its free list.
pub fn leasable_addresses(cidr: &Ipv4Cidr, gateway: Ipv4Addr) -> impl Iterator<Item = Ipv4Addr> {
    let first = u32::from(cidr.network()) + 1;
    let last = u32::from(cidr.broadcast()) - 1;
    (first..=last)
        .map(Ipv4Addr::from)
        .filter(move |a| *a != gateway)
}

/// Leases `candidate`, any free address the caller found (SPEC §3.1: any free address may be
/// chosen), after checking it may be leased: a host of the range, not the gateway, not already
/// leased. `None` (no free address found) is `CAPACITY_UNAVAILABLE` for `ipv4`.
pub fn lease(
    cidr: &Ipv4Cidr,
    gateway: Ipv4Addr,
    leased: &BTreeSet<Ipv4Addr>,
    candidate: Option<Ipv4Addr>,
) -> Result<Ipv4Addr, DomainError> {
    let full = || DomainError::CapacityUnavailable {
        resource: "ipv4".into(),
    };
    let address = candidate.ok_or_else(full)?;
    if !cidr.is_host(address) || address == gateway || leased.contains(&address) {
        return Err(DomainError::invalid_state(format!(
            "{address} cannot be leased from {cidr}"
        )));
    }
    Ok(address)
}

fn mask(prefix: u8) -> u32 {
    if prefix == 0 {
        0
    } else {
        u32::MAX << (32 - prefix)
    }
}

impl FromStr for Ipv4Cidr {
    type Err = DomainError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ipv4Cidr::parse(s)
    }
}

impl fmt::Display for Ipv4Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl Serialize for Ipv4Cidr {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Ipv4Cidr {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let s = String::deserialize(deserializer)?;
        Ipv4Cidr::parse(&s).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::error::ErrorCode;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn a_slash_24_has_gateway_dot_one_and_every_other_host_leasable() {
        let cidr = Ipv4Cidr::parse("10.0.0.0/24").unwrap();
        assert_eq!(cidr.default_gateway(), ip("10.0.0.1"));
        assert_eq!(cidr.broadcast(), ip("10.0.0.255"));
        let all: Vec<_> = leasable_addresses(&cidr, cidr.default_gateway()).collect();
        assert_eq!(all.first(), Some(&ip("10.0.0.2")));
        assert_eq!(all.last(), Some(&ip("10.0.0.254")));
        assert_eq!(all.len() as u64, cidr.leasable());
        assert_eq!(cidr.with_prefix(ip("10.0.0.5")), "10.0.0.5/24");
    }

    #[test]
    fn a_gateway_elsewhere_in_the_range_is_never_leasable() {
        let cidr = Ipv4Cidr::parse("192.168.1.0/29").unwrap();
        let gw = ip("192.168.1.3");
        assert!(!leasable_addresses(&cidr, gw).any(|a| a == gw));
        let refused = lease(&cidr, gw, &BTreeSet::new(), Some(gw)).unwrap_err();
        assert_eq!(refused.code(), ErrorCode::InvalidState);
    }

    #[test]
    fn no_free_address_is_capacity_unavailable_and_a_leased_one_is_refused() {
        let cidr = Ipv4Cidr::parse("10.0.0.0/30").unwrap();
        let gw = cidr.default_gateway();
        let leased = BTreeSet::from([ip("10.0.0.2")]);
        let full = lease(&cidr, gw, &leased, None).unwrap_err();
        assert_eq!(full.code(), ErrorCode::CapacityUnavailable);
        let twice = lease(&cidr, gw, &leased, Some(ip("10.0.0.2"))).unwrap_err();
        assert_eq!(twice.code(), ErrorCode::InvalidState);
    }

    #[test]
    fn bad_cidrs_are_refused_with_a_clear_message() {
        for (input, needle) in [
            ("10.0.0.0", "a.b.c.d/prefix"),
            ("10.0.0/24", "not an IPv4 address"),
            ("10.0.0.0/33", "0 to 32"),
            ("10.0.0.0/x", "0 to 32"),
            ("10.0.0.0/31", "no address to lease"),
            ("10.0.0.1/32", "no address to lease"),
            ("10.0.0.5/24", "host bits set; the network is 10.0.0.0/24"),
            ("10.0.0.0/8", "larger than a pool's range may be"),
        ] {
            let error = Ipv4Cidr::parse(input).unwrap_err();
            assert_eq!(error.code(), ErrorCode::InvalidInput);
            assert!(error.to_string().contains(needle), "{input}: {error}");
        }
    }

    #[test]
    fn a_gateway_must_be_a_host_of_the_range() {
        let cidr = Ipv4Cidr::parse("10.0.0.0/24").unwrap();
        assert!(cidr.check_gateway(ip("10.0.0.254")).is_ok());
        assert!(cidr.check_gateway(ip("10.0.0.0")).is_err());
        assert!(cidr.check_gateway(ip("10.0.0.255")).is_err());
        assert!(cidr.check_gateway(ip("10.0.1.1")).is_err());
    }

    #[test]
    fn a_cidr_round_trips_through_serde_as_a_string() {
        let cidr = Ipv4Cidr::parse("10.8.0.0/16").unwrap();
        let json = serde_json::to_value(cidr).unwrap();
        assert_eq!(json, serde_json::json!("10.8.0.0/16"));
        assert_eq!(serde_json::from_value::<Ipv4Cidr>(json).unwrap(), cidr);
    }

    proptest! {
        /// SPEC §3.1: any free address may be leased, never network, broadcast, gateway or
        /// an address already leased; whichever free address each lease picks, leasing until
        /// full hands out every leasable address exactly once.
        #[test]
        fn any_free_address_is_leased_once_until_the_range_is_full(
            prefix in 24u8..=30,
            gw_offset in 1u32..255,
            picks in prop::collection::vec(any::<prop::sample::Index>(), 256),
        ) {
            let cidr = Ipv4Cidr::parse(&format!("10.1.2.0/{prefix}")).unwrap();
            let size = 1u32 << (32 - prefix);
            let gateway = Ipv4Addr::from(u32::from(cidr.network()) + (gw_offset % (size - 2)) + 1);
            let mut free: Vec<Ipv4Addr> = leasable_addresses(&cidr, gateway).collect();
            let mut leased = BTreeSet::new();
            for pick in &picks {
                if free.is_empty() {
                    break;
                }
                let candidate = free.swap_remove(pick.index(free.len()));
                let addr = lease(&cidr, gateway, &leased, Some(candidate)).unwrap();
                prop_assert!(cidr.is_host(addr));
                prop_assert_ne!(addr, gateway);
                prop_assert!(leased.insert(addr), "leased twice: {}", addr);
            }
            if free.is_empty() {
                prop_assert_eq!(leased.len() as u64, cidr.leasable());
                prop_assert_eq!(
                    lease(&cidr, gateway, &leased, None).unwrap_err().code(),
                    ErrorCode::CapacityUnavailable
                );
            }
        }
    }
}
