//! Guest networking: one tap per NIC, attached to the spec's bridge; the bridge is made (with
//! the pool's gateway address) with iproute2 when missing. Taps are made on every boot and
//! restore, so they are made in this process (see [`tap`]), with `ip` as the fallback.

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
    match tap::ensure(tap, &nic.bridge) {
        Ok(()) => Ok(()),
        // An odd state (a tap enslaved elsewhere, a kernel without the bridge ioctls): iproute2
        // knows more cases, and says what is wrong in its own words.
        Err(error) => {
            tracing::debug!(%error, tap, "making the tap in process failed; using ip");
            if !link_exists(tap) {
                ip(&["tuntap", "add", "dev", tap, "mode", "tap"]).await?;
            }
            ip(&["link", "set", "dev", tap, "master", &nic.bridge, "up"]).await
        }
    }
}

/// Gives the tap a warm QEMU opened (`from`, down and on no bridge) the name `to` of the
/// guest that takes that QEMU; a leftover `to` (a failed start of that guest) goes first. QEMU
/// holds the tap by its file descriptor, not its name.
pub async fn rename_tap(from: &str, to: &str) -> Result<(), RuntimeError> {
    remove_tap(to).await?;
    tap::rename(from, to).map_err(|e| RuntimeError(format!("renaming tap {from} to {to}: {e}")))
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
    link_index(name).is_some()
}

/// Taps with ioctls, as `ip tuntap add mode tap` and `ip link set master … up` make them: two
/// `ip` processes cost a boot or a restore about 5 ms, these calls microseconds.
mod tap {
    use std::io::{Error, Result};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// `SIOCBRADDIF` (linux/sockios.h), which the libc crate defines only for Android.
    const SIOCBRADDIF: libc::c_ulong = 0x89a2;

    /// Makes `tap` (persistent) if it is missing, puts it on `bridge` and brings it up.
    pub fn ensure(tap: &str, bridge: &str) -> Result<()> {
        if !super::link_exists(tap) {
            let tun = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open("/dev/net/tun")?;
            let mut request = ifreq(tap)?;
            request.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
            ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut request)?;
            // SAFETY: TUNSETPERSIST takes its argument by value; `tun` is an open tun device.
            checked(unsafe {
                libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong)
            })?;
        }
        let socket = socket()?;
        let index = super::link_index(tap).ok_or_else(|| Error::other("the tap is gone"))?;
        // A tap already on a bridge (this one, when a guest is started again) answers EBUSY,
        // and the caller falls back to `ip`, which sets the master whatever it was.
        let mut request = ifreq(bridge)?;
        request.ifr_ifru.ifru_ifindex = index as libc::c_int;
        ioctl(socket.as_raw_fd(), SIOCBRADDIF, &mut request)?;
        let mut request = ifreq(tap)?;
        ioctl(socket.as_raw_fd(), libc::SIOCGIFFLAGS, &mut request)?;
        // SAFETY: SIOCGIFFLAGS has just filled in the flags member of the union.
        unsafe { request.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
        ioctl(socket.as_raw_fd(), libc::SIOCSIFFLAGS, &mut request)
    }

    /// Renames a tap that is down (the kernel refuses to rename an interface that is up).
    pub fn rename(from: &str, to: &str) -> Result<()> {
        let socket = socket()?;
        let mut request = ifreq(from)?;
        let new_name = ifreq(to)?.ifr_name;
        request.ifr_ifru.ifru_newname = new_name;
        ioctl(socket.as_raw_fd(), libc::SIOCSIFNAME, &mut request)
    }

    fn ifreq(name: &str) -> Result<libc::ifreq> {
        // SAFETY: an all-zero ifreq is a valid value (an empty name and a zero union).
        let mut request: libc::ifreq = unsafe { std::mem::zeroed() };
        if name.is_empty() || name.len() >= request.ifr_name.len() || name.contains('\0') {
            return Err(Error::other(format!("{name:?} is not an interface name")));
        }
        for (to, from) in request.ifr_name.iter_mut().zip(name.bytes()) {
            *to = from as libc::c_char;
        }
        Ok(request)
    }

    fn socket() -> Result<OwnedFd> {
        // SAFETY: plain socket(2); the descriptor is owned by the OwnedFd at once.
        let fd = checked(unsafe {
            libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0)
        })?;
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    fn ioctl(fd: libc::c_int, request: libc::c_ulong, ifr: &mut libc::ifreq) -> Result<()> {
        // SAFETY: each request used here reads or writes one `struct ifreq`, which `ifr` is.
        checked(unsafe { libc::ioctl(fd, request, ifr as *mut libc::ifreq) }).map(drop)
    }

    /// A system call's return value, or the error it left in `errno`.
    fn checked(returned: libc::c_int) -> Result<libc::c_int> {
        if returned < 0 {
            return Err(Error::last_os_error());
        }
        Ok(returned)
    }
}

/// The interface's index in this network namespace, if it exists.
fn link_index(name: &str) -> Option<u32> {
    let name = std::ffi::CString::new(name).ok()?;
    // SAFETY: `name` is a valid NUL-terminated string that outlives the call.
    let index = unsafe { libc::if_nametoindex(name.as_ptr()) };
    (index != 0).then_some(index)
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
