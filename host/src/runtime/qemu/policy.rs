//! A guest's network policy (`InstanceSpec.networkPolicy`) as nftables rules and a `tc`
//! shaper on its taps, applied before QEMU starts and removed with the guest.
//!
//! Each guest has two tables of its own, named from its id (`vps_<hash>`), so applying is one
//! atomic `nft -f` transaction that replaces both and removing is deleting both; no rule of
//! one guest can touch another's or the host's own.
//! - `bridge` table, on frames from the tap (prerouting), stateless: the guest sends only from
//!   its MAC and address (ARP included), only IPv4 and ARP, at most its bandwidth (an nft
//!   policer: this kernel has no `tc` police action), and only to destinations its mode
//!   allows. Frames to the tap from the host (output) or another port (forward): `none` takes
//!   only ARP and TCP to port 22 from the host (the exec path); `private`/`egress` take ARP
//!   and the pool's range from other ports.
//! - `inet` table, stateful, on what reaches the host's IP layer: a guest's new connections are
//!   bounded (`ct count`); `none` may not open any to the host (the exec path's replies are
//!   `established`); nothing from outside the pool opens a connection to the guest; `egress`
//!   is masqueraded behind the host beyond the pool's range.
//! - `tc tbf` on the tap shapes what the guest is sent to its bandwidth.
//!
//! Modes, by destination of what the guest sends: `none`: only replies from its `sshd` (TCP
//! from port 22, never a SYN); `private`: the pool's range (its network, which holds the
//! gateway); `egress`: the pool's range, then the allow-list when there is one, else anything
//! but [`PRIVATE_RANGES`].
//!
//! An allow-list names IPv4 addresses or CIDRs, which go straight into the bridge rules, and
//! domains (`example.com`, `*.example.com`), served by the host's resolver (`dns`):
//! - the guest's DNS (UDP and TCP port 53, to any address) passes the bridge and is DNATed by
//!   its `inet` table to the resolver on its NIC's gateway, which answers by this guest's list;
//!   DNS forwarded past the host is dropped all the same, so no server but the resolver is
//!   ever asked;
//! - the addresses the resolver answers for an allowed name go into the bridge table's
//!   [`RESOLVED_SET`] for the record's TTL (at least `dns::MIN_TTL`), and the guest may send
//!   to them;
//! - an address of that set the guest sends to is also kept in [`IN_USE_SET`] until
//!   [`IN_USE_IDLE`] passes without a frame to it, so a connection outlives its record's TTL
//!   while it carries traffic (the bridge has no connection tracking to tell otherwise).
//!
//! Both sets live in the guest's own table, so they go with it. A NIC without a gateway has no
//! resolver; what is neither an IPv4 network nor a domain (IPv6) allows nothing, with a
//! warning (the list still narrows).

use std::fmt::Write as _;
use std::net::Ipv4Addr;

use tokio::io::AsyncWriteExt;
use tokio::process::Command;

use super::net::tap_name;
use crate::runtime::{NetworkMode, NetworkPolicy, RuntimeError};

/// What `egress` never reaches unless allowed: RFC 1918, shared (CGNAT), loopback,
/// link-local (cloud metadata services), "this network", IETF protocol assignments,
/// benchmarking, multicast and reserved space.
pub const PRIVATE_RANGES: &[&str] = &[
    "0.0.0.0/8",
    "10.0.0.0/8",
    "100.64.0.0/10",
    "127.0.0.0/8",
    "169.254.0.0/16",
    "172.16.0.0/12",
    "192.0.0.0/24",
    "192.168.0.0/16",
    "198.18.0.0/15",
    "224.0.0.0/4",
    "240.0.0.0/4",
];

/// The bridge table's set of addresses the resolver answered for allowed names.
pub const RESOLVED_SET: &str = "resolved";
/// The bridge table's set of resolved addresses the guest keeps sending to.
pub const IN_USE_SET: &str = "in_use";
/// How long an address of [`IN_USE_SET`] stays allowed after the guest's last frame to it.
pub const IN_USE_IDLE: &str = "10m";
/// The most addresses [`IN_USE_SET`] holds per guest.
const IN_USE_MAX: u32 = 4096;

/// One NIC as the rules see it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyNic {
    pub tap: String,
    /// Lower case, `52:54:00:…`.
    pub mac: String,
    pub address: Ipv4Addr,
    /// The pool's range: the lease's network (`10.0.0.0/24`).
    pub pool: String,
    /// The gateway on the host (the resolver listens there); none: no resolver for this NIC.
    pub gateway: Option<Ipv4Addr>,
}

impl PolicyNic {
    /// From a NIC's tap, MAC and leased address (CIDR form).
    pub fn new(tap: &str, mac: &str, cidr: &str) -> Result<PolicyNic, RuntimeError> {
        let bad = || RuntimeError(format!("network policy: {cidr:?} is not an IPv4 CIDR"));
        let (address, prefix) = cidr.split_once('/').ok_or_else(bad)?;
        let address: Ipv4Addr = address.parse().map_err(|_| bad())?;
        let prefix: u32 = prefix.parse().map_err(|_| bad())?;
        if prefix > 32 {
            return Err(bad());
        }
        let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
        let network = Ipv4Addr::from(u32::from(address) & mask);
        let mac = mac.to_ascii_lowercase();
        let mac_ok = mac.len() == 17
            && mac
                .split(':')
                .all(|b| b.len() == 2 && b.bytes().all(|c| c.is_ascii_hexdigit()));
        if !mac_ok {
            return Err(RuntimeError(format!(
                "network policy: {mac:?} is not a MAC address"
            )));
        }
        if !valid_ifname(tap) {
            return Err(RuntimeError(format!(
                "network policy: {tap:?} is not an interface name"
            )));
        }
        Ok(PolicyNic {
            tap: tap.to_owned(),
            mac,
            address,
            pool: format!("{network}/{prefix}"),
            gateway: None,
        })
    }

    /// With the gateway `gateway` (an address, with or without a prefix length).
    pub fn with_gateway(mut self, gateway: Option<&str>) -> Result<PolicyNic, RuntimeError> {
        self.gateway = gateway
            .map(|g| {
                let bare = g.split('/').next().unwrap_or(g);
                bare.parse::<Ipv4Addr>().map_err(|_| {
                    RuntimeError(format!(
                        "network policy: gateway {g:?} is not an IPv4 address"
                    ))
                })
            })
            .transpose()?;
        Ok(self)
    }
}

/// The name of guest `id`'s two tables (`bridge` and `inet`).
pub fn table_name(id: &str) -> String {
    // The tap's hash: deterministic, so `remove` needs no record.
    let tap = tap_name(id, 0);
    format!("vps_{}", &tap[4..])
}

/// The allow-list's IPv4 networks; what is not one (a domain, IPv6) is answered apart.
pub fn allowed_networks(allow: &[String]) -> (Vec<String>, Vec<String>) {
    let mut networks = Vec::new();
    let mut skipped = Vec::new();
    for entry in allow {
        let entry = entry.trim();
        let parsed = match entry.split_once('/') {
            Some((address, prefix)) => address
                .parse::<Ipv4Addr>()
                .ok()
                .zip(prefix.parse::<u32>().ok().filter(|p| *p <= 32))
                .map(|(address, prefix)| {
                    let mask = u32::MAX.checked_shl(32 - prefix).unwrap_or(0);
                    format!("{}/{prefix}", Ipv4Addr::from(u32::from(address) & mask))
                }),
            None => entry.parse::<Ipv4Addr>().ok().map(|a| a.to_string()),
        };
        match parsed {
            Some(network) => networks.push(network),
            None => skipped.push(entry.to_owned()),
        }
    }
    (networks, skipped)
}

/// The `nft -f` script that replaces guest `id`'s tables with `policy`'s rules.
pub fn ruleset(id: &str, nics: &[PolicyNic], policy: &NetworkPolicy) -> String {
    let table = table_name(id);
    let (allowed, _) = allowed_networks(&policy.allow);
    let restricted = !policy.allow.is_empty();
    // Names on the list: the resolver answers them, its answers fill the sets.
    let dns = resolving(policy);
    let mbit = policy.bandwidth_mbit.max(1);
    // nft's kbytes are KiB: Mbit/s × 10⁶ / 8 / 1024.
    let rate_kbytes = (u64::from(mbit) * 1_000_000 / 8 / 1024).max(1);
    let burst_kbytes = (rate_kbytes / 10).max(64);
    let private = PRIVATE_RANGES.join(", ");

    let mut s = String::new();
    // `table … {}` then `delete`: replacing works whether or not the table exists.
    let _ = writeln!(s, "table bridge {table} {{}}\ndelete table bridge {table}");
    let _ = writeln!(s, "table bridge {table} {{");
    if dns {
        let _ = writeln!(
            s,
            "  set {RESOLVED_SET} {{\n    type ipv4_addr; flags timeout;\n  }}\n  \
             set {IN_USE_SET} {{\n    type ipv4_addr; size {IN_USE_MAX}; flags dynamic,timeout; \
             timeout {IN_USE_IDLE};\n  }}"
        );
    }
    let _ = writeln!(
        s,
        "  chain g_pre {{\n    type filter hook prerouting priority -200; policy accept;"
    );
    for (i, nic) in nics.iter().enumerate() {
        let _ = writeln!(s, "    iifname \"{}\" jump g_from_{i}", nic.tap);
    }
    let _ = writeln!(s, "  }}");
    let _ = writeln!(
        s,
        "  chain g_out {{\n    type filter hook output priority 0; policy accept;"
    );
    for (i, nic) in nics.iter().enumerate() {
        let _ = writeln!(s, "    oifname \"{}\" jump g_host_to_{i}", nic.tap);
    }
    let _ = writeln!(s, "  }}");
    let _ = writeln!(
        s,
        "  chain g_fwd {{\n    type filter hook forward priority 0; policy accept;"
    );
    for (i, nic) in nics.iter().enumerate() {
        let _ = writeln!(s, "    oifname \"{}\" jump g_port_to_{i}", nic.tap);
    }
    let _ = writeln!(s, "  }}");
    for (i, nic) in nics.iter().enumerate() {
        let (mac, address, pool) = (&nic.mac, nic.address, &nic.pool);
        // What the guest sends.
        let _ = writeln!(s, "  chain g_from_{i} {{");
        let _ = writeln!(s, "    ether saddr != {mac} drop");
        let _ = writeln!(
            s,
            "    ether type arp arp saddr ip != {{ {address}, 0.0.0.0 }} drop"
        );
        let _ = writeln!(s, "    ether type arp accept");
        let _ = writeln!(s, "    ether type != ip drop");
        let _ = writeln!(s, "    ip saddr != {address} drop");
        let _ = writeln!(
            s,
            "    limit rate over {rate_kbytes} kbytes/second burst {burst_kbytes} kbytes drop"
        );
        match policy.mode {
            NetworkMode::None => {
                let _ = writeln!(s, "    tcp sport 22 tcp flags & (syn | ack) != syn accept");
            }
            NetworkMode::Private => {
                let _ = writeln!(s, "    ip daddr {pool} accept");
            }
            NetworkMode::Egress => {
                let _ = writeln!(s, "    ip daddr {pool} accept");
                if restricted {
                    if !allowed.is_empty() {
                        let _ = writeln!(s, "    ip daddr {{ {} }} accept", allowed.join(", "));
                    }
                    if dns && nic.gateway.is_some() {
                        // DNS goes up to the host, whose inet table hands it to the resolver.
                        let _ = writeln!(s, "    meta l4proto {{ tcp, udp }} th dport 53 accept");
                        let _ = writeln!(
                            s,
                            "    ip daddr @{IN_USE_SET} update @{IN_USE_SET} {{ ip daddr }} accept"
                        );
                        let _ = writeln!(
                            s,
                            "    ip daddr @{RESOLVED_SET} update @{IN_USE_SET} {{ ip daddr }} accept"
                        );
                    }
                } else {
                    let _ = writeln!(s, "    ip daddr {{ {private} }} drop");
                    let _ = writeln!(s, "    accept");
                }
            }
        }
        let _ = writeln!(s, "    drop\n  }}");
        // What the host sends it (its own traffic and what it routes).
        let _ = writeln!(s, "  chain g_host_to_{i} {{\n    ether type arp accept");
        if policy.mode == NetworkMode::None {
            let _ = writeln!(s, "    ip daddr {address} tcp dport 22 accept\n    drop");
        }
        let _ = writeln!(s, "  }}");
        // What other ports of the bridge (other guests) send it.
        let _ = writeln!(s, "  chain g_port_to_{i} {{");
        if policy.mode != NetworkMode::None {
            let _ = writeln!(
                s,
                "    ether type arp accept\n    ip saddr {pool} ip daddr {address} accept"
            );
        }
        let _ = writeln!(s, "    drop\n  }}");
    }
    let _ = writeln!(s, "}}");

    let _ = writeln!(s, "table inet {table} {{}}\ndelete table inet {table}");
    let _ = writeln!(s, "table inet {table} {{");
    let _ = writeln!(
        s,
        "  chain g_pre {{\n    type filter hook prerouting priority 0; policy accept;"
    );
    for nic in nics {
        let _ = writeln!(
            s,
            "    ip saddr {} ct state new ct count over {} drop",
            nic.address,
            policy.max_connections.max(1)
        );
    }
    let _ = writeln!(s, "  }}");
    let _ = writeln!(
        s,
        "  chain g_input {{\n    type filter hook input priority 0; policy accept;"
    );
    if policy.mode == NetworkMode::None {
        for nic in nics {
            let a = nic.address;
            let _ = writeln!(
                s,
                "    ip saddr {a} ct state established,related accept\n    ip saddr {a} drop"
            );
        }
    }
    let _ = writeln!(s, "  }}");
    let _ = writeln!(
        s,
        "  chain g_forward {{\n    type filter hook forward priority 0; policy accept;"
    );
    for nic in nics {
        let (a, pool) = (nic.address, &nic.pool);
        let _ = writeln!(s, "    ip daddr {a} ct state established,related accept");
        if policy.mode != NetworkMode::None {
            let _ = writeln!(s, "    ip daddr {a} ip saddr {pool} accept");
        }
        let _ = writeln!(s, "    ip daddr {a} drop");
        if policy.mode == NetworkMode::None {
            let _ = writeln!(s, "    ip saddr {a} drop");
        }
        if dns {
            // Only the resolver answers this guest's DNS: none is routed past the host.
            let _ = writeln!(
                s,
                "    ip saddr {a} meta l4proto {{ tcp, udp }} th dport 53 drop"
            );
        }
    }
    let _ = writeln!(s, "  }}");
    if dns {
        let _ = writeln!(
            s,
            "  chain g_dns {{\n    type nat hook prerouting priority dstnat; policy accept;"
        );
        for nic in nics {
            if let Some(gateway) = nic.gateway {
                for proto in ["udp", "tcp"] {
                    let _ = writeln!(
                        s,
                        "    ip saddr {} {proto} dport 53 dnat ip to {gateway}:{}",
                        nic.address,
                        super::allow::DNS_PORT
                    );
                }
            }
        }
        let _ = writeln!(s, "  }}");
    }
    if policy.mode == NetworkMode::Egress {
        let _ = writeln!(
            s,
            "  chain g_nat {{\n    type nat hook postrouting priority 100; policy accept;"
        );
        for nic in nics {
            let _ = writeln!(
                s,
                "    ip saddr {} ip daddr != {} masquerade",
                nic.address, nic.pool
            );
        }
        let _ = writeln!(s, "  }}");
    }
    let _ = writeln!(s, "}}");
    s
}

/// Whether `policy`'s guest has its DNS answered by the resolver: `egress` narrowed by a list
/// that names domains.
pub fn resolving(policy: &NetworkPolicy) -> bool {
    policy.mode == NetworkMode::Egress && !super::allow::domains(&policy.allow).is_empty()
}

/// Applies `policy` to guest `id`'s NICs: its tables (replaced atomically), a shaper on each
/// tap and, for `egress`, IPv4 forwarding. Idempotent.
pub async fn apply(
    id: &str,
    nics: &[PolicyNic],
    policy: &NetworkPolicy,
) -> Result<(), RuntimeError> {
    let (_, skipped) = allowed_networks(&policy.allow);
    let unusable: Vec<&String> = skipped
        .iter()
        .filter(|e| super::allow::DomainPattern::parse(e).is_none())
        .collect();
    if !unusable.is_empty() {
        tracing::warn!(guest = %id, ?unusable,
            "network allow-list entries that are neither IPv4 addresses, CIDRs nor domains allow nothing");
    }
    if resolving(policy) && nics.iter().any(|n| n.gateway.is_none()) {
        tracing::warn!(guest = %id,
            "a NIC without a gateway has no DNS resolver: the allow-list's domains allow nothing there");
    }
    nft(&ruleset(id, nics, policy)).await?;
    for nic in nics {
        shape(&nic.tap, policy.bandwidth_mbit.max(1)).await?;
    }
    if policy.mode == NetworkMode::Egress {
        enable_forwarding().await?;
    }
    Ok(())
}

/// Removes guest `id`'s tables; tables that do not exist are not an error. (The shaper goes
/// with the tap.)
pub async fn remove(id: &str) -> Result<(), RuntimeError> {
    // No nft on this host: no policy was ever applied here.
    if !nft_installed().await {
        return Ok(());
    }
    let table = table_name(id);
    let script = format!(
        "table bridge {table} {{}}\ndelete table bridge {table}\n\
         table inet {table} {{}}\ndelete table inet {table}\n"
    );
    nft(&script).await
}

/// Whether guest `id` has tables (for tests and the doctor).
pub async fn present(id: &str) -> bool {
    let table = table_name(id);
    let Ok(output) = Command::new("nft").args(["list", "tables"]).output().await else {
        return false;
    };
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .any(|line| line.split_whitespace().last() == Some(table.as_str()))
}

async fn nft_installed() -> bool {
    Command::new("nft")
        .arg("--version")
        .output()
        .await
        .is_ok_and(|o| o.status.success())
}

/// `tc tbf` on the tap: what the guest is sent, at most `mbit` Mbit/s.
async fn shape(tap: &str, mbit: u32) -> Result<(), RuntimeError> {
    // A burst of at least a tick's worth at HZ=100, and never less than a few frames.
    let burst = (u64::from(mbit) * 1_000_000 / 8 / 100).max(32 * 1024);
    let output = Command::new("tc")
        .args(["qdisc", "replace", "dev", tap, "root", "tbf", "rate"])
        .arg(format!("{mbit}mbit"))
        .arg("burst")
        .arg(burst.to_string())
        .args(["latency", "100ms"])
        .output()
        .await
        .map_err(|e| RuntimeError(format!("network policy: cannot run tc: {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    Err(RuntimeError(format!(
        "network policy: tc qdisc on {tap}: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}

/// `egress` is routed through the host: IPv4 forwarding on (in the agent's network namespace).
async fn enable_forwarding() -> Result<(), RuntimeError> {
    const PATH: &str = "/proc/sys/net/ipv4/ip_forward";
    if tokio::fs::read_to_string(PATH)
        .await
        .is_ok_and(|v| v.trim() == "1")
    {
        return Ok(());
    }
    tracing::info!("enabling IPv4 forwarding for guests with egress");
    tokio::fs::write(PATH, b"1")
        .await
        .map_err(|e| RuntimeError(format!("network policy: cannot enable {PATH}: {e}")))
}

/// Runs `script` with `nft -f -`.
pub(super) async fn nft(script: &str) -> Result<(), RuntimeError> {
    let mut child = Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| {
            RuntimeError(format!(
                "network policy: cannot run nft (is nftables installed?): {e}"
            ))
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .await
            .map_err(|e| RuntimeError(format!("network policy: writing to nft: {e}")))?;
    }
    let output = child
        .wait_with_output()
        .await
        .map_err(|e| RuntimeError(format!("network policy: nft: {e}")))?;
    if output.status.success() {
        return Ok(());
    }
    Err(RuntimeError(format!(
        "network policy: nft: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}

fn valid_ifname(name: &str) -> bool {
    vps_guest_image::is_plain_name(name, 15)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nic() -> PolicyNic {
        PolicyNic::new("vps0abc", "52:54:00:AA:00:02", "10.80.0.7/24").unwrap()
    }

    #[test]
    fn the_pool_is_the_leases_network() {
        let nic = nic();
        assert_eq!(nic.pool, "10.80.0.0/24");
        assert_eq!(nic.mac, "52:54:00:aa:00:02");
        assert!(PolicyNic::new("t", "52:54:00:aa:00:02", "10.0.0.1").is_err());
        assert!(PolicyNic::new("t", "52:54:00:aa:00:02", "10.0.0.1/33").is_err());
        assert!(PolicyNic::new("t;x", "52:54:00:aa:00:02", "10.0.0.1/24").is_err());
        assert!(PolicyNic::new("t", "52:54:00:aa:00:0\"", "10.0.0.1/24").is_err());
    }

    #[test]
    fn an_allow_list_keeps_ipv4_networks_and_sets_the_rest_apart() {
        let allow = [
            "198.51.100.7",
            "203.0.113.9/24",
            "example.com",
            "2001:db8::/32",
            "1.2.3.4/40",
        ]
        .map(String::from);
        let (networks, skipped) = allowed_networks(&allow);
        assert_eq!(networks, ["198.51.100.7", "203.0.113.0/24"]);
        assert_eq!(skipped, ["example.com", "2001:db8::/32", "1.2.3.4/40"]);
    }

    #[test]
    fn modes_write_their_rules() {
        let mut policy = NetworkPolicy::new(NetworkMode::Egress);
        let open = ruleset("inst_a", &[nic()], &policy);
        assert!(open.contains("10.0.0.0/8"), "{open}");
        assert!(open.contains("masquerade"));
        policy.allow = vec!["example.com".into()];
        let narrowed = ruleset("inst_a", &[nic()], &policy);
        // A list of only domains still narrows: nothing beyond the pool.
        assert!(!narrowed.contains("10.0.0.0/8"), "{narrowed}");
        assert!(!narrowed.contains("    accept\n    drop"), "{narrowed}");
        let none = ruleset("inst_a", &[nic()], &NetworkPolicy::new(NetworkMode::None));
        assert!(none.contains("tcp sport 22"), "{none}");
        assert!(!none.contains("masquerade"));
        assert_eq!(table_name("inst_a"), table_name("inst_a"));
        assert_ne!(table_name("inst_a"), table_name("inst_b"));
    }

    #[test]
    fn domains_on_the_list_send_the_guests_dns_to_the_resolver() {
        let nic = nic().with_gateway(Some("10.80.0.1/24")).unwrap();
        assert_eq!(nic.gateway, Some(Ipv4Addr::new(10, 80, 0, 1)));
        let policy = NetworkPolicy {
            allow: vec!["198.51.100.1/32".into(), "allowed.test".into()],
            ..NetworkPolicy::new(NetworkMode::Egress)
        };
        assert!(resolving(&policy));
        let rules = ruleset("inst_a", std::slice::from_ref(&nic), &policy);
        if std::env::var_os("VPS_PRINT_RULES").is_some() {
            eprintln!("{rules}");
        }
        for wanted in [
            "set resolved {\n    type ipv4_addr; flags timeout;",
            "set in_use {\n    type ipv4_addr; size 4096; flags dynamic,timeout; timeout 10m;",
            "    ip daddr { 198.51.100.1/32 } accept\n    meta l4proto { tcp, udp } th dport 53 accept\n",
            "    ip daddr @in_use update @in_use { ip daddr } accept\n",
            "    ip daddr @resolved update @in_use { ip daddr } accept\n    drop\n",
            "type nat hook prerouting priority dstnat;",
            "    ip saddr 10.80.0.7 udp dport 53 dnat ip to 10.80.0.1:53\n",
            "    ip saddr 10.80.0.7 tcp dport 53 dnat ip to 10.80.0.1:53\n",
            "    ip saddr 10.80.0.7 meta l4proto { tcp, udp } th dport 53 drop\n",
        ] {
            assert!(rules.contains(wanted), "{wanted:?} in\n{rules}");
        }

        // Without a domain, or in another mode, DNS is the guest's own business.
        for policy in [
            NetworkPolicy {
                allow: vec!["198.51.100.1/32".into()],
                ..NetworkPolicy::new(NetworkMode::Egress)
            },
            NetworkPolicy::new(NetworkMode::Egress),
            NetworkPolicy {
                allow: vec!["allowed.test".into()],
                ..NetworkPolicy::new(NetworkMode::Private)
            },
        ] {
            assert!(!resolving(&policy));
            let rules = ruleset("inst_a", std::slice::from_ref(&nic), &policy);
            assert!(!rules.contains("dport 53"), "{rules}");
            assert!(!rules.contains("resolved"), "{rules}");
        }
    }
}
