//! Volumes on templates and sandboxes: the mounts a template names (checked and resolved to
//! the tenant's volumes when the template is written), the attachments a sandbox's instance
//! gets from them, and the one-writer rule.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use super::{Volume, VolumeState};
use crate::error::DomainError;

/// The most volumes one template mounts.
pub const MAX_MOUNTS: usize = 8;
/// The longest mount path.
pub const MAX_PATH: usize = 255;

/// Paths a volume may never be mounted on.
pub const SYSTEM_PATHS: &[&str] = &[
    "/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/root", "/run",
    "/sbin", "/sys", "/tmp", "/usr", "/var",
];
/// Trees a volume may never be mounted inside.
pub const SYSTEM_TREES: &[&str] = &["/proc", "/sys", "/dev", "/boot"];

/// A mount as `sandboxTemplates.create/update` names it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct VolumeMount {
    /// The name of one of the tenant's `ready` volumes in the template's pool.
    pub name: String,
    /// An absolute path in the guest.
    pub mount_path: String,
    /// Mounted read-only (default false).
    #[serde(default)]
    pub read_only: bool,
}

/// A template's mount, resolved to its volume when the template was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct TemplateVolume {
    /// `vol_…`.
    pub volume_id: String,
    /// Its name when the template was written.
    pub name: String,
    /// Where the guest mounts it.
    pub mount_path: String,
    /// Mounted read-only.
    pub read_only: bool,
}

pub use crate::attachment::Attachment;

/// Checks mount paths: at most [`MAX_MOUNTS`], each absolute without `.`, `..` or empty
/// segments, never a system path nor inside `/proc`, `/sys`, `/dev` or `/boot`, and no two the
/// same or one inside another.
pub fn check_mount_paths(paths: &[&str]) -> Result<(), DomainError> {
    if paths.len() > MAX_MOUNTS {
        return Err(DomainError::invalid_input(
            "volumes",
            format!("at most {MAX_MOUNTS} volumes"),
        ));
    }
    for (i, path) in paths.iter().enumerate() {
        check_mount_path(path).map_err(|m| {
            DomainError::invalid_input(format!("volumes[{i}].mountPath"), format!("{path:?} {m}"))
        })?;
    }
    for (i, a) in paths.iter().enumerate() {
        for b in &paths[i + 1..] {
            if a == b || inside(a, b) || inside(b, a) {
                return Err(DomainError::invalid_input(
                    "volumes",
                    format!("mount paths {a} and {b} share or nest"),
                ));
            }
        }
    }
    Ok(())
}

fn check_mount_path(path: &str) -> Result<(), &'static str> {
    if !path.starts_with('/') || path.len() > MAX_PATH {
        return Err("must be an absolute path of at most 255 characters");
    }
    if path.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err("must not hold spaces or control characters");
    }
    if path[1..]
        .split('/')
        .any(|s| s.is_empty() || s == "." || s == "..")
    {
        return Err("must not hold empty, `.` or `..` segments");
    }
    if SYSTEM_PATHS.contains(&path) || SYSTEM_TREES.iter().any(|tree| inside(path, tree)) {
        return Err("is a system path");
    }
    Ok(())
}

/// Whether `path` lies strictly inside `tree`.
fn inside(path: &str, tree: &str) -> bool {
    path.strip_prefix(tree).is_some_and(|r| r.starts_with('/'))
}

/// Resolves a template's mounts (already checked by [`check_mount_paths`]) to `found`, the
/// tenant's volumes not deleted that bear the names asked for. Each must be in the template's
/// pool (`INVALID_INPUT`) and `ready` (`INVALID_STATE`), and all on one node (`INVALID_STATE`).
pub fn resolve(
    pool_id: &str,
    mounts: &[VolumeMount],
    found: &[Volume],
) -> Result<Vec<TemplateVolume>, DomainError> {
    let mut names = BTreeSet::new();
    let mut nodes = BTreeSet::new();
    let mut resolved = Vec::with_capacity(mounts.len());
    for (i, m) in mounts.iter().enumerate() {
        if !names.insert(m.name.as_str()) {
            return Err(DomainError::invalid_input(
                format!("volumes[{i}].name"),
                format!("volume {} is mounted twice", m.name),
            ));
        }
        let v = found
            .iter()
            .find(|v| v.name == m.name && v.state != VolumeState::Deleted)
            .ok_or_else(|| DomainError::NotFound {
                what: format!("volume {}", m.name),
            })?;
        if v.pool_id != pool_id {
            return Err(DomainError::invalid_input(
                format!("volumes[{i}].name"),
                format!(
                    "volume {} is in pool {}, not the template's",
                    m.name, v.pool_id
                ),
            ));
        }
        if v.state != VolumeState::Ready {
            return Err(DomainError::invalid_state(format!(
                "volume {} is {}",
                m.name,
                v.state.as_str()
            )));
        }
        nodes.insert(v.node_id.as_str());
        resolved.push(TemplateVolume {
            volume_id: v.id.clone(),
            name: v.name.clone(),
            mount_path: m.mount_path.clone(),
            read_only: m.read_only,
        });
    }
    if nodes.len() > 1 {
        return Err(DomainError::invalid_state(
            "a template's volumes must all live on one node",
        ));
    }
    Ok(resolved)
}

/// The attachments a sandbox's instance gets from its template's `mounts`, given the volumes
/// as they stand and, per volume, the `readOnly` of every live attachment it already has.
///
/// One writer: a read-write attachment takes a volume alone, read-only ones may share it, never
/// both; otherwise `CONFLICT` with `details.reason: "volume-in-use"`. A volume that is not
/// `ready` is `INVALID_STATE`.
pub fn attach(
    mounts: &[TemplateVolume],
    volumes: &[Volume],
    live: &BTreeMap<String, Vec<bool>>,
) -> Result<Vec<Attachment>, DomainError> {
    let mut out = Vec::with_capacity(mounts.len());
    for m in mounts {
        let v = volumes
            .iter()
            .find(|v| v.id == m.volume_id)
            .filter(|v| v.state == VolumeState::Ready)
            .ok_or_else(|| DomainError::invalid_state(format!("volume {} is not ready", m.name)))?;
        let others = live.get(&v.id).map_or(&[][..], Vec::as_slice);
        let shared = if m.read_only {
            others.iter().all(|ro| *ro)
        } else {
            others.is_empty()
        };
        if !shared {
            return Err(DomainError::conflict(
                format!(
                    "volume {} is attached to another live sandbox{}",
                    m.name,
                    if m.read_only { " read-write" } else { "" }
                ),
                "reason",
                "volume-in-use",
            ));
        }
        out.push(Attachment {
            volume_id: v.id.clone(),
            node_id: v.node_id.clone(),
            serial: v.serial.clone(),
            mount_path: m.mount_path.clone(),
            read_only: m.read_only,
        });
    }
    let nodes: BTreeSet<&str> = out.iter().map(|a| a.node_id.as_str()).collect();
    if nodes.len() > 1 {
        return Err(DomainError::invalid_state(
            "a template's volumes must all live on one node",
        ));
    }
    Ok(out)
}
