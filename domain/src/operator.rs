//! Events of the operator's resources: pools, offers, IP ranges, nodes, flavors and images.
//! Each is the payload of one wire type; the stream is `<kind>-<id>`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::error::DomainError;
use crate::resources::{Capacity, Shape};

/// The runtimes a hosted pool or a node may name.
pub const RUNTIMES: &[&str] = &[
    "libvirt-kvm",
    "cloud-hypervisor",
    "firecracker",
    "containerd",
    "qemu",
];

/// The runtimes that take snapshots (and restore them); any other is `UNSUPPORTED`.
pub const RUNTIMES_WITH_SNAPSHOTS: &[&str] =
    &["libvirt-kvm", "cloud-hypervisor", "firecracker", "qemu"];

/// Checks a resource name: 1 to 63 letters, digits, `-`, `_` or `.`.
pub fn check_name(field: &str, name: &str) -> Result<(), DomainError> {
    let ok = !name.is_empty()
        && name.len() <= 63
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(DomainError::invalid_input(
            field,
            "1 to 63 letters, digits, '-', '_' or '.'",
        ))
    }
}

/// Refuses a name another resource of the same kind (and scope) already has.
pub fn check_name_free(
    taken: bool,
    what: &str,
    name: &str,
    scope: &str,
) -> Result<(), DomainError> {
    if taken {
        Err(DomainError::invalid_input(
            "name",
            format!("a {what} named {name} exists{scope}"),
        ))
    } else {
        Ok(())
    }
}

/// `pool.created`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolCreated {
    /// `pool_…`.
    pub pool_id: String,
    /// Unique name.
    pub name: String,
    /// `vps-host` or `provider`.
    pub class: String,
    /// Hosted pools: the runtime.
    pub runtime: Option<String>,
    /// Provider pools: the account.
    pub provider_account_id: Option<String>,
    /// Host-loss policy.
    pub policy: PoolPolicy,
}

/// A hosted pool's policy for lost hosts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolPolicy {
    /// Place a lost host's instances elsewhere.
    #[serde(default)]
    pub recreate_on_host_loss: bool,
    /// A node silent this long becomes `lost`.
    #[serde(default)]
    pub lost_after_seconds: Option<u32>,
}

/// `pool.updated`: the new name and policy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolUpdated {
    /// The pool.
    pub pool_id: String,
    /// Its name now.
    pub name: String,
    /// Its policy now.
    pub policy: PoolPolicy,
}

/// `pool.offered`: the pool is visible to a tenant with these quota maxima.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PoolOffered {
    /// The pool.
    pub pool_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Maxima by quota resource wire name (`vcpu`, `memoryGiB`, `diskGiB`, `gpu`).
    pub quota: BTreeMap<String, u64>,
}

/// `pool.ip_range.set`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct IpRangeSet {
    /// The pool.
    pub pool_id: String,
    /// IPv4 CIDR.
    pub cidr: String,
    /// The gateway (never leased).
    pub gateway: String,
}

/// `node.registered`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeRegistered {
    /// `node_…`.
    pub node_id: String,
    /// Its pool.
    pub pool_id: String,
    /// Name, unique in the pool.
    pub name: String,
    /// What it offers.
    pub capacity: Capacity,
    /// Labels for placement.
    pub labels: BTreeMap<String, String>,
    /// Runtimes it advertises.
    pub runtimes: Vec<String>,
    /// CPU model (memory snapshots restore only on the same one).
    pub cpu_model: Option<String>,
}

/// `instance.orphaned` (on the node's stream): the node holds instances no live row places
/// there. Appended only when the set changes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OrphansChanged {
    /// The node.
    pub node_id: String,
    /// The orphans, sorted, at most 100.
    pub instance_ids: Vec<String>,
}

/// `node.cordoned` / `node.uncordoned` / `node.lost` / `node.recovered`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeStateChanged {
    /// The node.
    pub node_id: String,
}

/// `flavor.created`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlavorCreated {
    /// `flv_…`.
    pub flavor_id: String,
    /// Its pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// What an instance of it gets.
    pub shape: Shape,
    /// Provider pools: the provider's offer (server type, template).
    pub offer_id: Option<String>,
}

/// `flavor.archived`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FlavorArchived {
    /// The flavor.
    pub flavor_id: String,
}

/// `image.registered`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageRegistered {
    /// `img_…` (chosen by the operator).
    pub image_id: String,
    /// Owner; `None` = public.
    pub tenant_id: Option<String>,
    /// Where hosts fetch it.
    pub url: String,
    /// Hex SHA-256 of its content.
    pub sha256: String,
    /// `raw`, `qcow2` or `iso`.
    pub format: String,
    /// Vetted by the operator (a policy attribute).
    pub verified: bool,
}

/// `image.deleted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ImageDeleted {
    /// The image.
    pub image_id: String,
}
