//! What a sandbox's guest may reach: a template's `network`, carried by its instances and
//! their NodeSpec entries (`networkPolicy`). Its own module because both the template and the
//! instance aggregates name it.

use serde::{Deserialize, Serialize};

/// What a sandbox's guest may reach (`InstanceSpec.networkPolicy`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Network {
    /// Whatever the pool's network allows.
    #[default]
    Egress,
    /// Only its own subnet and the host.
    Private,
    /// Only the host.
    None,
}

impl Network {
    /// Whether the rules are written on the NICs' addresses (the pool needs an IP range).
    pub fn needs_ip_range(self) -> bool {
        !matches!(self, Network::Egress)
    }
}

/// Most `network.allow` entries.
pub const MAX_ALLOW: usize = 64;
/// The largest `network.bandwidthMbit`.
pub const MAX_BANDWIDTH_MBIT: u32 = 100_000;
/// The largest `network.maxConnections`.
pub const MAX_CONNECTIONS: u32 = 1_000_000;

/// What narrows and bounds a guest's network beyond its [`Network`] mode: carried by a
/// template, its instances and their NodeSpec entries (`networkAllow`, `networkBandwidthMbit`,
/// `networkMaxConnections`). Empty (the default) leaves the host's defaults: no allow-list,
/// 100 Mbit/s each way, 512 connections.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NetworkRules {
    /// IPv4 addresses, IPv4 CIDRs and domains (`*.example.com`) `egress` is narrowed to.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub allow: Vec<String>,
    /// The most the guest may send, and be sent, in Mbit/s each way.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_mbit: Option<u32>,
    /// The most connections the guest may have open through the host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u32>,
}

impl NetworkRules {
    /// Whether the rules name nothing (the host's defaults apply).
    pub fn is_empty(&self) -> bool {
        *self == NetworkRules::default()
    }
}

/// `network` as `sandboxTemplates.create` / `update` take it: the mode alone, or the mode with
/// an allow-list and bounds. Checked while the request is parsed, each refusal naming its field
/// (`network.allow[3]`, `network.bandwidthMbit`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, schemars::JsonSchema)]
#[serde(untagged)]
pub enum NetworkSetting {
    /// `egress`, `private` or `none`, with no allow-list and the default bounds.
    Mode(Network),
    /// The mode (default `egress`) with an allow-list and bounds.
    Rules(NetworkObject),
}

/// `network` as an object.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct NetworkObject {
    /// `egress` (default), `private` or `none`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<Network>,
    /// Narrows `egress` to these: IPv4 addresses, IPv4 CIDRs, domain names (`*.` in front
    /// matches the names under one). At most 64; only with mode `egress`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 64))]
    pub allow: Option<Vec<String>>,
    /// The most the guest may send, and be sent, in Mbit/s each way (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 100000))]
    pub bandwidth_mbit: Option<u32>,
    /// The most connections the guest may have open through the host (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000))]
    pub max_connections: Option<u32>,
}

impl NetworkSetting {
    /// The mode and the rules it sets.
    pub fn split(&self) -> (Network, NetworkRules) {
        match self {
            NetworkSetting::Mode(mode) => (*mode, NetworkRules::default()),
            NetworkSetting::Rules(o) => (
                o.mode.unwrap_or_default(),
                NetworkRules {
                    allow: o.allow.clone().unwrap_or_default(),
                    bandwidth_mbit: o.bandwidth_mbit,
                    max_connections: o.max_connections,
                },
            ),
        }
    }

    /// Why it is refused, with the field it names (`network.allow[3]`).
    fn refusal(&self) -> Option<(String, String)> {
        let NetworkSetting::Rules(o) = self else {
            return None;
        };
        let allow = o.allow.as_deref().unwrap_or_default();
        if !allow.is_empty() && o.mode.unwrap_or_default() != Network::Egress {
            return Some(("network.allow".into(), "only with mode egress".into()));
        }
        if allow.len() > MAX_ALLOW {
            return Some((
                "network.allow".into(),
                format!("at most {MAX_ALLOW} entries"),
            ));
        }
        if let Some(i) = allow.iter().position(|e| !is_allow_entry(e)) {
            let why = if is_ipv6(&allow[i]) {
                "an IPv6 address or CIDR: guests are IPv4-only, so the list takes IPv4 addresses, \
                 IPv4 CIDRs and domain names"
            } else {
                "not an IPv4 address, an IPv4 CIDR or a domain name (`*.` in front allowed)"
            };
            return Some((format!("network.allow[{i}]"), why.into()));
        }
        if o.bandwidth_mbit
            .is_some_and(|b| !(1..=MAX_BANDWIDTH_MBIT).contains(&b))
        {
            return Some((
                "network.bandwidthMbit".into(),
                format!("must be 1..={MAX_BANDWIDTH_MBIT}"),
            ));
        }
        if o.max_connections
            .is_some_and(|c| !(1..=MAX_CONNECTIONS).contains(&c))
        {
            return Some((
                "network.maxConnections".into(),
                format!("must be 1..={MAX_CONNECTIONS}"),
            ));
        }
        None
    }
}

impl<'de> Deserialize<'de> for NetworkSetting {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        // Read as a value first so a refusal names the field, not "no variant matched".
        let value = serde_json::Value::deserialize(d)?;
        let setting = if value.is_string() {
            serde_json::from_value(value).map(NetworkSetting::Mode)
        } else {
            serde_json::from_value(value).map(NetworkSetting::Rules)
        }
        .map_err(|e| crate::bounds::in_field("network", D::Error::custom(e)))?;
        match setting.refusal() {
            Some((field, message)) => {
                Err(crate::bounds::in_field(&field, D::Error::custom(message)))
            }
            None => Ok(setting),
        }
    }
}

/// An IPv4 address, an IPv4 CIDR, or a domain (`vps_seam::host_name`: the grammar the host
/// reads the list by), `*.` in front or not.
pub fn is_allow_entry(entry: &str) -> bool {
    if let Some((address, prefix)) = entry.split_once('/') {
        return address.parse::<std::net::Ipv4Addr>().is_ok()
            && !prefix.is_empty()
            && prefix.len() <= 2
            && prefix.bytes().all(|b| b.is_ascii_digit())
            && prefix.parse::<u8>().is_ok_and(|p| p <= 32);
    }
    entry.parse::<std::net::Ipv4Addr>().is_ok() || vps_seam::host_name::is_domain_entry(entry)
}

/// Whether `entry` is an IPv6 address or CIDR (refused with its own reason).
fn is_ipv6(entry: &str) -> bool {
    let address = entry.split_once('/').map_or(entry, |(a, _)| a);
    address.parse::<std::net::Ipv6Addr>().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: serde_json::Value) -> Result<NetworkSetting, String> {
        serde_json::from_value(v).map_err(|e| e.to_string())
    }

    #[test]
    fn allow_entries_are_addresses_cidrs_and_domains() {
        for ok in [
            "203.0.113.7",
            "10.1.2.0/24",
            "0.0.0.0/0",
            "example.com",
            "*.example.com",
            "a-b.c1.io",
            "localhost",
            // `_` is part of the one grammar (vps_seam::host_name), as the host always read it.
            "a_b.com",
            "_dmarc.example.com",
        ] {
            assert!(is_allow_entry(ok), "{ok}");
        }
        for bad in [
            "",
            "10.1.2.0/33",
            "10.1.2.0/",
            "10.1.2.0/+4",
            "::1",
            "2001:db8::/32",
            "*",
            "*.",
            "a.*.com",
            "-a.com",
            "a..com",
            "1.2.3.4.5",
            "example.com.",
            " example.com",
            &"a".repeat(64),
            &format!("{}.com", vec!["a".repeat(63); 4].join(".")),
        ] {
            assert!(!is_allow_entry(bad), "{bad}");
        }
    }

    #[test]
    fn a_setting_is_a_mode_or_an_object_and_refusals_name_the_field() {
        assert_eq!(
            parse(serde_json::json!("private")).map(|s| s.split()),
            Ok((Network::Private, NetworkRules::default()))
        );
        let (mode, rules) = parse(serde_json::json!({
            "allow": ["10.0.0.0/8", "*.example.com"], "bandwidthMbit": 10, "maxConnections": 64
        }))
        .map(|s| s.split())
        .unwrap_or_default();
        assert_eq!(mode, Network::Egress);
        assert_eq!(rules.allow, ["10.0.0.0/8", "*.example.com"]);
        assert_eq!(
            (rules.bandwidth_mbit, rules.max_connections),
            (Some(10), Some(64))
        );
        let field = |v| {
            parse(v)
                .err()
                .and_then(|m| crate::bounds::field_of(&m).map(|(f, _)| f.to_string()))
        };
        use serde_json::json;
        let cases = [
            (
                json!({ "allow": ["a.com", "b.com", "c.com", "nope!"] }),
                "network.allow[3]",
            ),
            (
                json!({ "mode": "none", "allow": ["a.com"] }),
                "network.allow",
            ),
            (json!({ "allow": vec!["a.com"; 65] }), "network.allow"),
            (json!({ "bandwidthMbit": 0 }), "network.bandwidthMbit"),
            (json!({ "bandwidthMbit": 100_001 }), "network.bandwidthMbit"),
            (json!({ "maxConnections": 0 }), "network.maxConnections"),
            (
                json!({ "maxConnections": 1_000_001 }),
                "network.maxConnections",
            ),
            (json!({ "other": 1 }), "network"),
            (json!("open"), "network"),
            (json!(7), "network"),
        ];
        for (value, expected) in cases {
            assert_eq!(field(value.clone()).as_deref(), Some(expected), "{value}");
        }
    }

    #[test]
    fn an_ipv6_entry_is_refused_as_such() {
        for entry in ["2001:db8::1", "2001:db8::/32", "::1"] {
            let message = parse(serde_json::json!({ "allow": ["a.com", entry] })).unwrap_err();
            let (field, why) = crate::bounds::field_of(&message).unwrap_or_default();
            assert_eq!(field, "network.allow[1]", "{message}");
            assert!(why.contains("guests are IPv4-only"), "{message}");
        }
        let message = parse(serde_json::json!({ "allow": ["nope!"] })).unwrap_err();
        assert!(!message.contains("IPv6"), "{message}");
    }
}
