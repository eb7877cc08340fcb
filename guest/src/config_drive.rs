//! The config drive: a FAT image labelled `cidata` that the host attaches read-only with
//! `serial=vps-config`. Its NoCloud files (`meta-data`, `user-data`, `network-config`) serve
//! cloud-init images unchanged; its `vps/` files serve the minimal guest's `/init`, which
//! sources `vps/net` as shell, so every value written there is validated first.

use std::fmt::Write as _;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::net::IpAddr;
use std::path::Path;

use crate::Error;

/// The volume label NoCloud looks for.
pub const LABEL: &str = "cidata";

/// What one guest learns at boot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfigDrive {
    /// The instance id (`inst_…`): NoCloud's `instance-id`.
    pub instance_id: String,
    /// The guest's host name (RFC 1123).
    pub hostname: String,
    /// The instance's user data, written verbatim; a `#!` script runs once at first boot.
    pub user_data: Option<Vec<u8>>,
    /// The guest's address with its prefix length (`10.0.0.2/24`).
    pub address: Option<String>,
    /// The default gateway (`10.0.0.1`).
    pub gateway: Option<String>,
    /// The MAC address of the NIC the address belongs on (`52:54:00:12:34:56`).
    pub mac: Option<String>,
    /// The DNS server the guest asks (its `/etc/resolv.conf`); none: the guest has none.
    pub nameserver: Option<String>,
    /// The one SSH certificate principal the guest's `sshd` admits.
    pub principal: Option<String>,
    /// The deployment's sandbox CA public key, one OpenSSH line.
    pub ssh_ca_public_key: Option<String>,
    /// The host's own public key, one OpenSSH line (`vps/host-ssh.pub`): the host's tunnel
    /// checks each client's certificate, then logs in to the guest's `sshd` with this key.
    pub host_ssh_public_key: Option<String>,
    /// Bumped whenever the guest must take a new identity (a restore or a fork): a new machine
    /// id, new SSH host keys, a reseeded random pool.
    pub identity_generation: u64,
    /// The new identity itself, made by the host when it bumps the generation for a restore.
    /// A guest resumed from a memory snapshot runs with its source's random state, so what it
    /// generated itself right away could equal what its siblings generate: the host's CSPRNG
    /// is the one source each clone surely gets apart.
    pub fresh_identity: Option<FreshIdentity>,
    /// The volumes to mount (`vps/volumes`), each found by its disk's virtio serial.
    pub volumes: Vec<DriveVolume>,
}

/// A volume the guest mounts: one `SERIAL MOUNT_PATH ro|rw` line of `vps/volumes`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DriveVolume {
    /// The disk's virtio serial (`/sys/block/vd*/serial`).
    pub serial: String,
    /// An absolute path ([`check_mount_path`]).
    pub mount_path: String,
    pub read_only: bool,
}

/// A guest identity made by the host (`vps/machine-id`, `vps/seed`, `vps/ssh_host_*`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FreshIdentity {
    /// 32 lower-case hex digits (`/etc/machine-id`).
    pub machine_id: String,
    /// Hex bytes the guest mixes into its random pool and keeps as its random seed.
    pub seed: String,
    /// SSH host keys as (type, OpenSSH private key, public key line), type `ed25519` or
    /// `ecdsa`.
    pub ssh_host_keys: Vec<(String, String, String)>,
}

/// Writes `drive` as a config drive image at `path`, replacing any file there.
pub fn write(path: &Path, drive: &ConfigDrive) -> Result<(), Error> {
    let files = files(drive)?;
    let payload: usize = files.iter().map(|(_, data)| data.len()).sum();
    // A FAT12 volume of a few MiB has room for the files, their clusters and the tables.
    let size = (2 * MIB + payload as u64).div_ceil(MIB) * MIB;

    let context = || format!("writing config drive {}", path.display());
    let mut image = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(path)
        .map_err(Error::io(context()))?;
    image.set_len(size).map_err(Error::io(context()))?;

    let mut label = [b' '; 11];
    label[..LABEL.len()].copy_from_slice(LABEL.as_bytes());
    let options = fatfs::FormatVolumeOptions::new()
        .volume_label(label)
        // A volume id from the contents, not a random one: the same drive, the same bytes.
        .volume_id(fnv1a(drive.instance_id.as_bytes()) ^ drive.identity_generation as u32);
    fatfs::format_volume(&mut image, options).map_err(Error::io(context()))?;

    let fs = fatfs::FileSystem::new(&mut image, fatfs::FsOptions::new())
        .map_err(Error::io(context()))?;
    fs.root_dir()
        .create_dir("vps")
        .map_err(Error::io(context()))?;
    for (name, data) in &files {
        let mut file = fs
            .root_dir()
            .create_file(name)
            .map_err(Error::io(format!("{}: {name}", context())))?;
        file.truncate().map_err(Error::io(context()))?;
        file.write_all(data)
            .map_err(Error::io(format!("{}: {name}", context())))?;
    }
    fs.unmount().map_err(Error::io(context()))?;
    image.sync_all().map_err(Error::io(context()))
}

const MIB: u64 = 1024 * 1024;

/// The drive's files, validated, in the order they are written.
fn files(drive: &ConfigDrive) -> Result<Vec<(&'static str, Vec<u8>)>, Error> {
    check_instance_id(&drive.instance_id)?;
    check_hostname(&drive.hostname)?;
    let address = drive.address.as_deref().map(check_address).transpose()?;
    let gateway = drive.gateway.as_deref().map(check_gateway).transpose()?;
    let mac = drive.mac.as_deref().map(check_mac).transpose()?;
    let nameserver = drive
        .nameserver
        .as_deref()
        .map(|n| check_ip("nameserver", n))
        .transpose()?;
    if let Some(principal) = &drive.principal {
        check_principal(principal)?;
    }
    let ca = drive
        .ssh_ca_public_key
        .as_deref()
        .map(|key| check_key_line("ssh_ca_public_key", key))
        .transpose()?;
    let host_key = drive
        .host_ssh_public_key
        .as_deref()
        .map(|key| check_key_line("host_ssh_public_key", key))
        .transpose()?;

    let mut files = vec![
        (
            "meta-data",
            format!(
                "instance-id: {}\nlocal-hostname: {}\n",
                drive.instance_id, drive.hostname
            )
            .into_bytes(),
        ),
        (
            "network-config",
            network_config(
                address.as_deref(),
                gateway.as_deref(),
                mac.as_deref(),
                nameserver.as_deref(),
            )
            .into_bytes(),
        ),
    ];
    if let Some(user_data) = &drive.user_data {
        files.push(("user-data", user_data.clone()));
    }

    let mut net = String::new();
    for (key, value) in [
        ("ADDRESS", &address),
        ("GATEWAY", &gateway),
        ("MAC", &mac),
        ("NAMESERVER", &nameserver),
    ] {
        if let Some(value) = value {
            let _ = writeln!(net, "{key}={value}");
        }
    }
    files.push(("vps/net", net.into_bytes()));
    if let Some(principal) = &drive.principal {
        files.push(("vps/principal", format!("{principal}\n").into_bytes()));
    }
    if let Some(ca) = ca {
        files.push(("vps/ssh-ca.pub", format!("{ca}\n").into_bytes()));
    }
    if let Some(key) = host_key {
        files.push(("vps/host-ssh.pub", format!("{key}\n").into_bytes()));
    }
    if !drive.volumes.is_empty() {
        let mut lines = String::new();
        for volume in &drive.volumes {
            check_serial(&volume.serial)?;
            check_mount_path(&volume.mount_path)?;
            let mode = if volume.read_only { "ro" } else { "rw" };
            let _ = writeln!(lines, "{} {} {mode}", volume.serial, volume.mount_path);
        }
        files.push(("vps/volumes", lines.into_bytes()));
    }
    files.push((
        "vps/identity",
        format!("{}\n", drive.identity_generation).into_bytes(),
    ));
    if let Some(fresh) = &drive.fresh_identity {
        check_hex("fresh_identity.machine_id", &fresh.machine_id, 32, 32)?;
        check_hex("fresh_identity.seed", &fresh.seed, 32, 1024)?;
        files.push((
            "vps/machine-id",
            format!("{}\n", fresh.machine_id).into_bytes(),
        ));
        files.push(("vps/seed", format!("{}\n", fresh.seed).into_bytes()));
        for (kind, private, public) in &fresh.ssh_host_keys {
            let (private_name, public_name) = match kind.as_str() {
                "ed25519" => ("vps/ssh_host_ed25519_key", "vps/ssh_host_ed25519_key.pub"),
                "ecdsa" => ("vps/ssh_host_ecdsa_key", "vps/ssh_host_ecdsa_key.pub"),
                other => {
                    return Err(invalid(
                        "fresh_identity.ssh_host_keys",
                        format!("{other:?} is not ed25519 or ecdsa"),
                    ))
                }
            };
            if !private.starts_with("-----BEGIN OPENSSH PRIVATE KEY-----") {
                return Err(invalid(
                    "fresh_identity.ssh_host_keys",
                    "not an OpenSSH private key",
                ));
            }
            files.push((private_name, private.clone().into_bytes()));
            files.push((public_name, format!("{}\n", public.trim()).into_bytes()));
        }
    }
    Ok(files)
}

/// NoCloud network config version 2: the static address and route when there is one, DHCP
/// otherwise; matched by MAC when the MAC is known; the nameserver when there is one.
fn network_config(
    address: Option<&str>,
    gateway: Option<&str>,
    mac: Option<&str>,
    nameserver: Option<&str>,
) -> String {
    let mut out = String::from("version: 2\nethernets:\n  nic0:\n");
    match mac {
        Some(mac) => {
            let _ = write!(
                out,
                "    match:\n      macaddress: \"{mac}\"\n    set-name: eth0\n"
            );
        }
        None => out.push_str("    match:\n      name: \"e*\"\n"),
    }
    match address {
        Some(address) => {
            let _ = writeln!(out, "    addresses: [\"{address}\"]");
            if let Some(gateway) = gateway {
                let default = if gateway.contains(':') {
                    "::/0"
                } else {
                    "0.0.0.0/0"
                };
                let _ = write!(
                    out,
                    "    routes:\n      - to: \"{default}\"\n        via: \"{gateway}\"\n"
                );
            }
        }
        None => out.push_str("    dhcp4: true\n"),
    }
    if let Some(nameserver) = nameserver {
        let _ = write!(
            out,
            "    nameservers:\n      addresses: [\"{nameserver}\"]\n"
        );
    }
    out
}

fn invalid(field: &'static str, reason: impl Into<String>) -> Error {
    Error::InvalidConfig {
        field,
        reason: reason.into(),
    }
}

/// A volume's mount path as the guest's `/init` takes it unquoted: absolute, at most 200 bytes
/// of letters, digits, `_ . - /`, no `.` or `..` component, and not a directory the guest
/// itself needs (`/`, `/data` itself, `/proc`, `/sys`, `/dev`, `/run`, `/etc`, the binaries).
pub fn check_mount_path(path: &str) -> Result<(), Error> {
    let bad = |why: &str| invalid("volumes.mount_path", format!("{path:?} {why}"));
    if !path.starts_with('/') || path.len() > 200 {
        return Err(bad("is not an absolute path of at most 200 bytes"));
    }
    let plain = path
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || b"_.-/".contains(&b));
    if !plain {
        return Err(bad("holds a byte other than A-Z a-z 0-9 _ . - /"));
    }
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    if parts.iter().any(|p| *p == "." || *p == "..") {
        return Err(bad("has a . or .. component"));
    }
    const RESERVED: &[&str] = &[
        "proc", "sys", "dev", "run", "etc", "bin", "sbin", "lib", "usr", "mnt",
    ];
    match parts.first() {
        None => Err(bad("is the root")),
        Some(first) if RESERVED.contains(first) => Err(bad("is in a directory the guest needs")),
        Some(&"data") if parts.len() == 1 => Err(bad("is the root disk's mount")),
        Some(_) => Ok(()),
    }
}

fn check_serial(serial: &str) -> Result<(), Error> {
    if crate::is_plain_name(serial, 20) {
        Ok(())
    } else {
        Err(invalid(
            "volumes.serial",
            format!("{serial:?} is not 1–20 letters, digits, '_' or '-'"),
        ))
    }
}

fn check_hex(field: &'static str, value: &str, min: usize, max: usize) -> Result<(), Error> {
    let ok = (min..=max).contains(&value.len())
        && value
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            field,
            format!("not {min} to {max} lower-case hex digits"),
        ))
    }
}

fn check_instance_id(id: &str) -> Result<(), Error> {
    if crate::is_plain_name(id, 128) {
        Ok(())
    } else {
        Err(invalid(
            "instance_id",
            format!("{id:?} is not 1–128 letters, digits, '_' or '-'"),
        ))
    }
}

fn check_hostname(name: &str) -> Result<(), Error> {
    let label_ok = |label: &str| {
        !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if name.len() <= 253 && name.split('.').all(label_ok) {
        Ok(())
    } else {
        Err(invalid(
            "hostname",
            format!("{name:?} is not an RFC 1123 host name"),
        ))
    }
}

/// Returns the address in its canonical form.
fn check_address(cidr: &str) -> Result<String, Error> {
    let bad = || invalid("address", format!("{cidr:?} is not ADDRESS/PREFIX"));
    let (ip, prefix) = cidr.split_once('/').ok_or_else(bad)?;
    let ip: IpAddr = ip.parse().map_err(|_| bad())?;
    let prefix: u8 = prefix.parse().map_err(|_| bad())?;
    let max = if ip.is_ipv4() { 32 } else { 128 };
    if prefix > max {
        return Err(bad());
    }
    Ok(format!("{ip}/{prefix}"))
}

fn check_gateway(gateway: &str) -> Result<String, Error> {
    check_ip("gateway", gateway)
}

/// Returns the address in its canonical form.
fn check_ip(field: &'static str, ip: &str) -> Result<String, Error> {
    ip.parse::<IpAddr>()
        .map(|ip| ip.to_string())
        .map_err(|_| invalid(field, format!("{ip:?} is not an IP address")))
}

/// Returns the MAC in lower case, as Linux shows it under `/sys/class/net/*/address`.
fn check_mac(mac: &str) -> Result<String, Error> {
    let parts: Vec<&str> = mac.split(':').collect();
    let ok = parts.len() == 6
        && parts
            .iter()
            .all(|p| p.len() == 2 && p.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(mac.to_ascii_lowercase())
    } else {
        Err(invalid(
            "mac",
            format!("{mac:?} is not six ':'-separated hex octets"),
        ))
    }
}

fn check_principal(principal: &str) -> Result<(), Error> {
    let ok = !principal.is_empty()
        && principal.len() <= 256
        && principal
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"_-.@".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(invalid(
            "principal",
            format!("{principal:?} is not 1–256 letters, digits, '_', '-', '.' or '@'"),
        ))
    }
}

/// Returns the key line without surrounding white space.
fn check_key_line(field: &'static str, key: &str) -> Result<String, Error> {
    let key = key.trim();
    let mut fields = key.split_ascii_whitespace();
    let kind = fields.next().unwrap_or_default();
    let body = fields.next().unwrap_or_default();
    let known = kind.starts_with("ssh-") || kind.starts_with("ecdsa-") || kind.starts_with("sk-");
    if known && !body.is_empty() && !key.contains(['\n', '\r']) {
        Ok(key.to_string())
    } else {
        Err(invalid(
            field,
            "is not one OpenSSH public key line (TYPE BASE64 [COMMENT])",
        ))
    }
}

/// FNV-1a: a stable, dependency-free hash for the volume id.
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5, |hash, &b| {
        (hash ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}
