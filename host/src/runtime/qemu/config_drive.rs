//! The guest's NoCloud config drive (`serial=vps-config`), written by the guest image crate so
//! that host and guest share one definition of it (docs/guest-contract.md).

use std::net::Ipv4Addr;
use std::path::Path;

pub use vps_guest_image::config_drive::FreshIdentity;

use crate::runtime::{GuestSpec, RuntimeError};

/// Writes the config drive of `spec` at `path`. The first NIC carries the address and gateway.
/// `generation` is the guest's identity generation; `fresh` the identity the host made for a
/// restore (see `snapshots::fresh_identity`); `nameserver` the DNS server the guest asks
/// (`dns::guest_nameserver`).
pub fn write(
    spec: &GuestSpec,
    path: &Path,
    generation: u64,
    fresh: Option<FreshIdentity>,
    nameserver: Option<Ipv4Addr>,
) -> Result<(), RuntimeError> {
    let nic = spec.nics.first();
    let drive = vps_guest_image::config_drive::ConfigDrive {
        instance_id: spec.id.clone(),
        hostname: spec.hostname.clone(),
        user_data: spec.user_data.clone(),
        address: nic.map(|n| n.address.clone()),
        // The guest takes a bare gateway address; the lease gives the prefix.
        gateway: nic
            .and_then(|n| n.gateway.as_deref())
            .map(|g| g.split('/').next().unwrap_or(g).to_owned()),
        mac: nic.map(|n| n.mac.clone()),
        nameserver: nameserver.map(|n| n.to_string()),
        principal: spec.ssh_ca.as_ref().map(|c| c.principal.clone()),
        ssh_ca_public_key: spec.ssh_ca.as_ref().map(|c| c.public_key.clone()),
        host_ssh_public_key: spec.host_ssh_key.clone(),
        identity_generation: generation,
        fresh_identity: fresh,
        volumes: spec
            .volumes
            .iter()
            .map(|v| vps_guest_image::config_drive::DriveVolume {
                serial: v.serial.clone(),
                mount_path: v.mount_path.clone(),
                read_only: v.read_only,
            })
            .collect(),
    };
    vps_guest_image::config_drive::write(path, &drive)
        .map_err(|e| RuntimeError(format!("config drive: {e}")))
}

/// The kernel command line a bundle boots with.
pub const KERNEL_CMDLINE: &str = vps_guest_image::KERNEL_CMDLINE;
