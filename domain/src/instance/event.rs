//! Instance events: one variant per wire type (SPEC §4.2), plus the condition and address
//! events the view needs so it can be rebuilt from the log alone.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::condition::{Condition, ConditionType};
use crate::network_policy::{Network, NetworkRules};
use crate::resources::Shape;
use crate::state_table::{DesiredState, InstanceState};

use super::PoolKind;

/// The fields every instance event's `data` carries: where the instance stands *after* the
/// event, and whose it is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Common {
    /// The instance (also the subject `instance/<id>`).
    pub instance_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// `state` after the event.
    pub state: InstanceState,
    /// `desiredState` after the event.
    pub desired_state: DesiredState,
    /// The sandbox that drives it, when one does.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// The template it is a warm instance of, when it is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm_template_id: Option<String>,
}

/// `instance.created`: the create was admitted (state `scheduling`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// Hosted or provider pool.
    pub pool_kind: PoolKind,
    /// The flavor name.
    pub flavor: String,
    /// The flavor's shape at admission.
    pub shape: Shape,
    /// The image as the caller named it.
    pub image_id: String,
    /// The OpenSSH public keys.
    pub ssh_keys: Vec<String>,
    /// The sealed user data's `secret://` reference (never the user data itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_ref: Option<String>,
    /// The project, when the request named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub project_id: Option<String>,
    /// Who created it.
    pub owner_identity_id: String,
    /// The create's idempotency key.
    pub idempotency_key: String,
    /// Hash of the create request (without `wait`), to tell a replay from a conflict.
    pub request_hash: String,
    /// A warm instance: the template's instance version it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub template_version: Option<u64>,
    /// A sandbox template's network rule (absent: the pool's network).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_policy: Option<Network>,
    /// A sandbox template's allow-list and bounds (absent: none, the host's default bounds).
    // Boxed: most instances have none, and it would make every event as large as this one.
    #[serde(default, skip_serializing_if = "NetworkRules::is_empty")]
    pub network_rules: Box<NetworkRules>,
    /// A restore: the snapshot it boots from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<Box<super::RestoreFrom>>,
    /// The sandbox volumes it attaches (from its template).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::attachment::Attachment>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
}

/// `instance.labeled`: the instance's labels now (they replace the earlier ones).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Labeled {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The labels.
    pub labels: crate::labels::Labels,
}

/// `instance.starting`: `start` was called, the state moved to `starting`, or a sandbox
/// claimed the warm instance (then `claimedAt` and the new owner come with it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Starting {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// A claim: when the sandbox took the warm instance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_at: Option<DateTime<Utc>>,
    /// A claim: the sandbox's owner, the instance's owner from now on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub owner_identity_id: Option<String>,
}

/// An `instance.starting` that is no claim.
pub fn starting(common: Common) -> InstanceEvent {
    InstanceEvent::Starting(Starting {
        common,
        claimed_at: None,
        owner_identity_id: None,
    })
}

/// `instance.scheduled`: a hosted instance was placed (state `provisioning`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Scheduled {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The node.
    pub node_id: String,
    /// The capacity allocation booked on it.
    pub allocation_id: String,
    /// The leased IPv4 address (without prefix).
    pub address: String,
}

/// `instance.provisioning`: the provider machine exists (state `provisioning`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Provisioning {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The provider's machine id.
    pub external_id: String,
}

/// `instance.deleting`: deletion was asked for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Deleting {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// Why, when not the tenant's own call (e.g. `tenant deleted`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
}

/// `instance.resized`: a resize finished (state `stopped`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Resized {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The new flavor name.
    pub flavor: String,
    /// The new shape.
    pub shape: Shape,
    /// The flavor before.
    pub previous_flavor: String,
    /// The shape before (what the allocation and quota held).
    pub previous_shape: Shape,
}

/// `instance.failed`: the instance entered `error`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Failed {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// `runtime-error`, `resources-exhausted`, or the provider's error code.
    pub reason: String,
    /// Detail, when there is some.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The node involved, when one is.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
}

/// `instance.lost`: its node or provider machine disappeared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Lost {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The lost node (hosted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    /// The vanished machine (provider).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub external_id: Option<String>,
}

/// Why an instance is being placed again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecreateReason {
    /// Its host kept refusing to start it for lack of resources.
    ResourcesExhausted,
    /// Its host was lost and the pool recreates on host loss.
    HostLost,
}

/// `instance.recreating`: allocation and lease released, back to `scheduling`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Recreating {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// Why.
    pub reason: RecreateReason,
    /// The node it leaves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_node_id: Option<String>,
    /// Until when scheduling must avoid `fromNodeId` (resources-exhausted only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exclude_until: Option<DateTime<Utc>>,
}

/// `instance.condition.set`: a condition now holds (replacing one of the same type).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionSet {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The condition.
    pub condition: Condition,
}

/// `instance.condition.cleared`: a condition no longer holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConditionCleared {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// Which one.
    pub condition_type: ConditionType,
}

/// `instance.addresses.changed`: the instance's address list changed (reports, provider).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct AddressesChanged {
    /// State and ownership.
    #[serde(flatten)]
    pub common: Common,
    /// The whole list after the change.
    pub addresses: Vec<String>,
}

/// Something that happened to an instance. Serialises as `{ "type": "instance.…", "data": … }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data")]
pub enum InstanceEvent {
    /// `instance.created`.
    #[serde(rename = "instance.created")]
    Created(Created),
    /// `instance.scheduled` (`nodeId`, `allocationId`, `address`).
    #[serde(rename = "instance.scheduled")]
    Scheduled(Scheduled),
    /// `instance.provisioning` (`externalId`).
    #[serde(rename = "instance.provisioning")]
    Provisioning(Provisioning),
    /// `instance.starting`: `start` was called, or state moved to `starting`.
    #[serde(rename = "instance.starting")]
    Starting(Starting),
    /// `instance.stopping`: `stop` was called.
    #[serde(rename = "instance.stopping")]
    Stopping(Common),
    /// `instance.pausing`: its sandbox asked for a pause.
    #[serde(rename = "instance.pausing")]
    Pausing(Common),
    /// `instance.deleting` (`reason?`).
    #[serde(rename = "instance.deleting")]
    Deleting(Deleting),
    /// `instance.running`.
    #[serde(rename = "instance.running")]
    Running(Common),
    /// `instance.stopped`.
    #[serde(rename = "instance.stopped")]
    Stopped(Common),
    /// `instance.paused`.
    #[serde(rename = "instance.paused")]
    Paused(Common),
    /// `instance.resized` (`flavor`).
    #[serde(rename = "instance.resized")]
    Resized(Resized),
    /// `instance.failed` (`reason`).
    #[serde(rename = "instance.failed")]
    Failed(Failed),
    /// `instance.lost`.
    #[serde(rename = "instance.lost")]
    Lost(Lost),
    /// `instance.recovered`.
    #[serde(rename = "instance.recovered")]
    Recovered(Common),
    /// `instance.recreating` (`reason`, `fromNodeId`).
    #[serde(rename = "instance.recreating")]
    Recreating(Recreating),
    /// `instance.deleted`.
    #[serde(rename = "instance.deleted")]
    Deleted(Common),
    /// `instance.condition.set`.
    #[serde(rename = "instance.condition.set")]
    ConditionSet(ConditionSet),
    /// `instance.condition.cleared`.
    #[serde(rename = "instance.condition.cleared")]
    ConditionCleared(ConditionCleared),
    /// `instance.addresses.changed`.
    #[serde(rename = "instance.addresses.changed")]
    AddressesChanged(AddressesChanged),
    /// `instance.identity.rebound`: the host gave a memory restore an SSH identity of its
    /// own; it no longer answers as the instance its memory was captured on.
    #[serde(rename = "instance.identity.rebound")]
    IdentityRebound(Common),
    /// `instance.labeled` (`labels`).
    #[serde(rename = "instance.labeled")]
    Labeled(Labeled),
}

/// Every wire type an [`InstanceEvent`] can have.
pub const EVENT_TYPES: &[&str] = &[
    "instance.created",
    "instance.scheduled",
    "instance.provisioning",
    "instance.starting",
    "instance.stopping",
    "instance.pausing",
    "instance.deleting",
    "instance.running",
    "instance.stopped",
    "instance.paused",
    "instance.resized",
    "instance.failed",
    "instance.lost",
    "instance.recovered",
    "instance.recreating",
    "instance.deleted",
    "instance.condition.set",
    "instance.condition.cleared",
    "instance.addresses.changed",
    "instance.identity.rebound",
    "instance.labeled",
];

impl InstanceEvent {
    /// The wire type, e.g. `instance.created`.
    pub fn event_type(&self) -> &'static str {
        match self {
            InstanceEvent::Created(_) => "instance.created",
            InstanceEvent::Scheduled(_) => "instance.scheduled",
            InstanceEvent::Provisioning(_) => "instance.provisioning",
            InstanceEvent::Starting(_) => "instance.starting",
            InstanceEvent::Stopping(_) => "instance.stopping",
            InstanceEvent::Pausing(_) => "instance.pausing",
            InstanceEvent::Deleting(_) => "instance.deleting",
            InstanceEvent::Running(_) => "instance.running",
            InstanceEvent::Stopped(_) => "instance.stopped",
            InstanceEvent::Paused(_) => "instance.paused",
            InstanceEvent::Resized(_) => "instance.resized",
            InstanceEvent::Failed(_) => "instance.failed",
            InstanceEvent::Lost(_) => "instance.lost",
            InstanceEvent::Recovered(_) => "instance.recovered",
            InstanceEvent::Recreating(_) => "instance.recreating",
            InstanceEvent::Deleted(_) => "instance.deleted",
            InstanceEvent::ConditionSet(_) => "instance.condition.set",
            InstanceEvent::ConditionCleared(_) => "instance.condition.cleared",
            InstanceEvent::AddressesChanged(_) => "instance.addresses.changed",
            InstanceEvent::IdentityRebound(_) => "instance.identity.rebound",
            InstanceEvent::Labeled(_) => "instance.labeled",
        }
    }

    /// The fields every instance event carries.
    pub fn common(&self) -> &Common {
        match self {
            InstanceEvent::Created(d) => &d.common,
            InstanceEvent::Scheduled(d) => &d.common,
            InstanceEvent::Provisioning(d) => &d.common,
            InstanceEvent::Starting(d) => &d.common,
            InstanceEvent::Deleting(d) => &d.common,
            InstanceEvent::Resized(d) => &d.common,
            InstanceEvent::Failed(d) => &d.common,
            InstanceEvent::Lost(d) => &d.common,
            InstanceEvent::Recreating(d) => &d.common,
            InstanceEvent::ConditionSet(d) => &d.common,
            InstanceEvent::ConditionCleared(d) => &d.common,
            InstanceEvent::AddressesChanged(d) => &d.common,
            InstanceEvent::Labeled(d) => &d.common,
            InstanceEvent::Stopping(c)
            | InstanceEvent::Pausing(c)
            | InstanceEvent::Running(c)
            | InstanceEvent::Stopped(c)
            | InstanceEvent::Paused(c)
            | InstanceEvent::Recovered(c)
            | InstanceEvent::Deleted(c)
            | InstanceEvent::IdentityRebound(c) => c,
        }
    }

    /// The instance id (the stream is `instance-<id>`, the subject `instance/<id>`).
    pub fn instance_id(&self) -> &str {
        &self.common().instance_id
    }

    /// The event's `data` as JSON (camelCase).
    pub fn data(&self) -> Value {
        // The adjacently tagged form is `{ "type": …, "data": … }`; take the data part.
        match serde_json::to_value(self) {
            Ok(Value::Object(mut map)) => map.remove("data").unwrap_or(Value::Null),
            _ => Value::Null,
        }
    }

    /// Rebuilds an event from its stored `type` and `data`.
    pub fn from_parts(event_type: &str, data: Value) -> Result<InstanceEvent, serde_json::Error> {
        serde_json::from_value(serde_json::json!({ "type": event_type, "data": data }))
    }
}
