//! IP address management for hosted pools (SPEC §3.1): one IPv4 range per pool, one lease per
//! placed instance, lowest free address first; network, broadcast and gateway never leased.

use std::collections::BTreeSet;
use std::fmt;
use std::net::Ipv4Addr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::DomainError;

/// The longest prefix that still leaves an address to lease: a /30 holds network, gateway, one
/// lease and broadcast. A /31 or /32 has nothing left once those are set aside.
pub const MAX_PREFIX: u8 = 30;

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

/// The lowest address of `cidr` that is neither network, broadcast, `gateway` nor in `leased`;
/// `None` when the range is full.
pub fn lowest_free(
    cidr: &Ipv4Cidr,
    gateway: Ipv4Addr,
    leased: &BTreeSet<Ipv4Addr>,
) -> Option<Ipv4Addr> {
    let first = u32::from(cidr.network()) + 1;
    let last = u32::from(cidr.broadcast()) - 1;
    // Walk the candidates and the sorted leases together, so a full /16 costs one pass.
    let mut taken = leased
        .range(Ipv4Addr::from(first)..=Ipv4Addr::from(last))
        .map(|a| u32::from(*a))
        .peekable();
    let mut candidate = first;
    while candidate <= last {
        if Ipv4Addr::from(candidate) == gateway {
            candidate += 1;
            continue;
        }
        match taken.peek() {
            Some(&t) if t < candidate => {
                taken.next();
            }
            Some(&t) if t == candidate => {
                taken.next();
                candidate += 1;
            }
            _ => return Some(Ipv4Addr::from(candidate)),
        }
    }
    None
}

/// `lowest_free`, or `CAPACITY_UNAVAILABLE` (`resource: ipv4`) when the range is full.
pub fn lease(
    cidr: &Ipv4Cidr,
    gateway: Ipv4Addr,
    leased: &BTreeSet<Ipv4Addr>,
) -> Result<Ipv4Addr, DomainError> {
    lowest_free(cidr, gateway, leased).ok_or_else(|| DomainError::CapacityUnavailable {
        resource: "ipv4".into(),
    })
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

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    #[test]
    fn a_slash_24_has_gateway_dot_one_and_leases_from_dot_two() {
        let cidr = Ipv4Cidr::parse("10.0.0.0/24").unwrap();
        assert_eq!(cidr.default_gateway(), ip("10.0.0.1"));
        assert_eq!(cidr.broadcast(), ip("10.0.0.255"));
        let gw = cidr.default_gateway();
        assert_eq!(
            lowest_free(&cidr, gw, &BTreeSet::new()),
            Some(ip("10.0.0.2"))
        );
        let leased = BTreeSet::from([ip("10.0.0.2"), ip("10.0.0.4")]);
        assert_eq!(lowest_free(&cidr, gw, &leased), Some(ip("10.0.0.3")));
        assert_eq!(cidr.with_prefix(ip("10.0.0.5")), "10.0.0.5/24");
    }

    #[test]
    fn a_gateway_elsewhere_in_the_range_is_skipped() {
        let cidr = Ipv4Cidr::parse("192.168.1.0/29").unwrap();
        let gw = ip("192.168.1.3");
        let leased = BTreeSet::from([ip("192.168.1.1"), ip("192.168.1.2")]);
        assert_eq!(lowest_free(&cidr, gw, &leased), Some(ip("192.168.1.4")));
    }

    #[test]
    fn a_full_range_has_no_free_address_and_leasing_is_capacity_unavailable() {
        let cidr = Ipv4Cidr::parse("10.0.0.0/30").unwrap();
        let gw = cidr.default_gateway();
        let leased = BTreeSet::from([ip("10.0.0.2")]);
        assert_eq!(lowest_free(&cidr, gw, &leased), None);
        assert_eq!(
            lease(&cidr, gw, &leased).unwrap_err().code(),
            "CAPACITY_UNAVAILABLE"
        );
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
        ] {
            let error = Ipv4Cidr::parse(input).unwrap_err();
            assert_eq!(error.code(), "INVALID_INPUT");
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
        #[test]
        fn the_lease_is_the_lowest_host_that_is_free(
            prefix in 24u8..=30,
            offsets in prop::collection::btree_set(0u32..256, 0..64),
            gw_offset in 1u32..255,
        ) {
            let cidr = Ipv4Cidr::parse(&format!("10.1.2.0/{prefix}")).unwrap();
            let size = 1u32 << (32 - prefix);
            let base = u32::from(cidr.network());
            let gateway = Ipv4Addr::from(base + (gw_offset % (size - 2)) + 1);
            let leased: BTreeSet<Ipv4Addr> =
                offsets.iter().map(|o| Ipv4Addr::from(base + o % size)).collect();
            let expected = (1..size - 1)
                .map(|o| Ipv4Addr::from(base + o))
                .find(|a| *a != gateway && !leased.contains(a));
            let got = lowest_free(&cidr, gateway, &leased);
            prop_assert_eq!(got, expected);
            if let Some(addr) = got {
                prop_assert!(cidr.is_host(addr));
                prop_assert_ne!(addr, gateway);
            }
        }

        #[test]
        fn leasing_until_full_hands_out_every_leasable_address_once(prefix in 26u8..=30) {
            let cidr = Ipv4Cidr::parse(&format!("172.16.0.0/{prefix}")).unwrap();
            let gateway = cidr.default_gateway();
            let mut leased = BTreeSet::new();
            while let Some(addr) = lowest_free(&cidr, gateway, &leased) {
                prop_assert!(leased.insert(addr));
            }
            prop_assert_eq!(leased.len() as u64, cidr.leasable());
        }
    }
}
