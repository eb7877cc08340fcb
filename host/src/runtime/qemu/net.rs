//! Guest networking with iproute2: one tap per NIC, attached to the spec's bridge; the bridge
//! is made (with the pool's gateway address) when missing.

use sha2::{Digest, Sha256};
use tokio::process::Command;

use crate::runtime::{NicSpec, RuntimeError};

/// The tap of NIC `index` of guest `id`: deterministic, so a restarted agent or a `delete`
/// without a record finds it, and at most 15 characters (`IFNAMSIZ`).
pub fn tap_name(id: &str, index: usize) -> String {
    let digest = data_encoding::HEXLOWER.encode(&Sha256::digest(id.as_bytes()));
    format!("vps{}{}", index % 10, &digest[..11])
}

/// Makes the tap for `nic` and attaches it to its bridge, making the bridge first if needed.
/// Idempotent: an existing tap is reattached and brought up.
pub async fn ensure_tap(tap: &str, nic: &NicSpec) -> Result<(), RuntimeError> {
    ensure_bridge(nic).await?;
    if !link_exists(tap) {
        ip(&["tuntap", "add", "dev", tap, "mode", "tap"]).await?;
    }
    ip(&["link", "set", "dev", tap, "master", &nic.bridge, "up"]).await
}

/// Removes a tap; a tap that does not exist is not an error.
pub async fn remove_tap(tap: &str) -> Result<(), RuntimeError> {
    if link_exists(tap) {
        ip(&["link", "del", "dev", tap]).await?;
    }
    Ok(())
}

async fn ensure_bridge(nic: &NicSpec) -> Result<(), RuntimeError> {
    let bridge = &nic.bridge;
    if bridge.is_empty() || bridge.len() > 15 {
        return Err(RuntimeError(format!(
            "bridge name {bridge:?} is not a valid interface name"
        )));
    }
    if link_exists(bridge) {
        return Ok(());
    }
    let made = async {
        ip(&["link", "add", "name", bridge, "type", "bridge"]).await?;
        if let Some(gateway) = &nic.gateway {
            ip(&[
                "addr",
                "add",
                &gateway_cidr(gateway, &nic.address),
                "dev",
                bridge,
            ])
            .await?;
        }
        ip(&["link", "set", "dev", bridge, "up"]).await
    };
    made.await
        .map_err(|e| RuntimeError(format!("cannot make bridge {bridge}: {}", e.0)))
}

/// The gateway with the lease's prefix length when it has none (`10.0.0.1` + `/24`).
fn gateway_cidr(gateway: &str, address: &str) -> String {
    if gateway.contains('/') {
        return gateway.to_owned();
    }
    match address.split_once('/') {
        Some((_, prefix)) => format!("{gateway}/{prefix}"),
        None => gateway.to_owned(),
    }
}

/// Whether the interface exists in this network namespace: a system call, not an `ip`
/// process (about 2 ms each, twice per cold boot).
fn link_exists(name: &str) -> bool {
    let Ok(name) = std::ffi::CString::new(name) else {
        return false;
    };
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    unsafe { libc::if_nametoindex(name.as_ptr()) != 0 }
}

async fn ip(args: &[&str]) -> Result<(), RuntimeError> {
    let mut ip = Command::new("ip");
    ip.args(args);
    super::tool::run(&mut ip, &format!("ip {}", args.join(" "))).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tap_names_are_short_stable_and_distinct() {
        let a = tap_name("inst_01JB0000000000000000000000", 0);
        assert!(a.len() <= 15, "{a}");
        assert_eq!(a, tap_name("inst_01JB0000000000000000000000", 0));
        assert_ne!(a, tap_name("inst_01JB0000000000000000000000", 1));
        assert_ne!(a, tap_name("inst_01JB0000000000000000000001", 0));
    }

    #[test]
    fn the_gateway_takes_the_lease_prefix() {
        assert_eq!(gateway_cidr("10.0.0.1", "10.0.0.7/24"), "10.0.0.1/24");
        assert_eq!(gateway_cidr("10.0.0.1/16", "10.0.0.7/24"), "10.0.0.1/16");
    }
}
