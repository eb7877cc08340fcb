//! The instance aggregate: its state ([`Instance`]), what can be asked of it
//! ([`InstanceCommand`]), what happens to it ([`InstanceEvent`]), [`decide`] and [`evolve`].
//!
//! `decide` judges a command against the folded state and returns events (or a refusal and no
//! events); every state change in it goes through [`crate::state_table`]. `evolve` applies one
//! event; folding a stream with it rebuilds the instance exactly, so the view needs nothing but
//! the log.

mod admission;
mod command;
mod decide;
mod event;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet};

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::condition::{Condition, ConditionType};
use crate::error::DomainError;
use crate::resources::Shape;
use crate::state_table::{DesiredState, InstanceState};

/// The most addresses an instance lists: its lease first, then what its host or provider
/// reported, in the order first seen.
pub const MAX_ADDRESSES: usize = 16;

pub use admission::{
    admit, authorized_before, check_user_data, placement, resize, Admission, AdmissionFacts,
    AdmissionPool, Policy, ResizeFacts,
};
pub use command::{
    AddressMode, CreateInstance, Failure, InstanceCommand, Observed, PlaceInstance, RecreateCause,
    ReportView, Requester, ResizeInstance,
};
pub use decide::{decide, decide_all, MAX_IDEMPOTENCY_KEY, MAX_SSH_KEYS};
pub use event::starting;
pub use event::{
    AddressesChanged, Common, ConditionCleared, ConditionSet, Created, Deleting, Failed,
    InstanceEvent, Labeled, Lost, Provisioning, RecreateReason, Recreating, Resized, Scheduled,
    Starting, EVENT_TYPES,
};

/// After this many re-placements away from refusing hosts, the next refusal fails the instance.
pub const MAX_EXHAUSTED_REPLACEMENTS: usize = 3;

/// Where an instance's pool runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PoolKind {
    /// A `vps-host` pool: on registered nodes.
    Hosted,
    /// A `provider` pool: on a provider account's cloud.
    Provider,
}

/// A host that refused to start the instance and was left for another.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Refusal {
    /// The refusing node.
    pub node_id: String,
    /// When the instance was moved off it.
    pub at: DateTime<Utc>,
    /// Until when scheduling avoids it for this instance.
    pub exclude_until: DateTime<Utc>,
}

/// The snapshot a restored instance boots from. A memory snapshot resumes only on a node of
/// the CPU model it was taken on, and keeps the SSH identity of the instance it was taken of.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RestoreFrom {
    /// `snap_…`.
    pub snapshot_id: String,
    /// The stored object's SHA-256 (hex); the host checks it before use.
    pub sha256: String,
    /// Whether the snapshot holds the guest's memory.
    pub include_memory: bool,
    /// A memory snapshot: the CPU model it needs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_model: Option<String>,
    /// A memory snapshot: the instance whose SSH identity the guest still answers to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal_instance_id: Option<String>,
}

impl RestoreFrom {
    /// The node labels a placement of this restore requires: a memory snapshot's CPU model.
    pub fn required_labels(&self) -> BTreeMap<String, String> {
        match (&self.cpu_model, self.include_memory) {
            (Some(model), true) => BTreeMap::from([(CPU_MODEL_LABEL.to_string(), model.clone())]),
            _ => BTreeMap::new(),
        }
    }
}

/// The label placement reads a node's CPU model under (from `nodes.register`'s `cpuModel`).
pub const CPU_MODEL_LABEL: &str = "cpu.model";

/// An instance as its events leave it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Instance {
    /// `inst_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// Hosted or provider.
    pub pool_kind: PoolKind,
    /// Where it is.
    pub state: InstanceState,
    /// What it should become.
    pub desired_state: DesiredState,
    /// The flavor name.
    pub flavor: String,
    /// The flavor's shape (what its allocation and quota charge hold).
    pub shape: Shape,
    /// The image as named.
    pub image_id: String,
    /// OpenSSH public keys.
    pub ssh_keys: Vec<String>,
    /// The sealed user data reference.
    pub user_data_ref: Option<String>,
    /// The IPAM lease first (hosted), then reported addresses.
    pub addresses: Vec<String>,
    /// Why it is not where it should be; at most one per type, in the order they appeared.
    pub conditions: Vec<Condition>,
    /// Hosted: its node.
    pub node_id: Option<String>,
    /// Hosted: its capacity allocation.
    pub allocation_id: Option<String>,
    /// Provider: the machine id.
    pub external_id: Option<String>,
    /// The project.
    pub project_id: Option<String>,
    /// Who created it.
    pub owner_identity_id: String,
    /// The create's idempotency key.
    pub idempotency_key: String,
    /// Hash of the create request, for replay vs `CONFLICT`.
    pub request_hash: String,
    /// The sandbox that drives it.
    pub sandbox_id: Option<String>,
    /// The template it is a warm instance of.
    pub warm_template_id: Option<String>,
    /// A warm instance: the template's instance version it was made from.
    #[serde(default)]
    pub template_version: Option<u64>,
    /// When a sandbox claimed it from its template's warm pool.
    #[serde(default)]
    pub claimed_at: Option<DateTime<Utc>>,
    /// How many times it was asked to start (`instance.starting` events): a host tells a new
    /// start from the one it already carried out by it (`InstanceSpec.startGeneration`).
    #[serde(default)]
    pub starts: u64,
    /// A sandbox template's network rule (`InstanceSpec.networkPolicy`).
    #[serde(default)]
    pub network_policy: Option<crate::network_policy::Network>,
    /// A sandbox template's allow-list and bounds (`InstanceSpec.networkAllow`, …).
    #[serde(
        default,
        skip_serializing_if = "crate::network_policy::NetworkRules::is_empty"
    )]
    pub network_rules: crate::network_policy::NetworkRules,
    /// A restore: the snapshot it boots from (`InstanceSpec.restoreFrom`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub restore_from: Option<RestoreFrom>,
    /// The sandbox volumes it attaches (`InstanceSpec.volumes`); it runs only on their node.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::attachment::Attachment>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
    /// When it entered its current state (`None`: at creation); deadlines count from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_since: Option<DateTime<Utc>>,
    /// When its desired state last changed (`None`: at creation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub desired_since: Option<DateTime<Utc>>,
    /// When it was created (the `instance.created` event's time).
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// The number of events folded: its stream version.
    pub version: u64,
    /// Hosts that refused it for lack of resources, oldest first (one per re-placement).
    pub refusals: Vec<Refusal>,
}

/// The instance `events` make from nothing, each applied at `now` (for deciding further
/// commands in the same decision; the recorded times come with the append).
pub fn fold_now(events: &[InstanceEvent], now: DateTime<Utc>) -> Result<Instance, DomainError> {
    fold(events.iter().map(|e| (e, now)))
        .map_err(|e| DomainError::invalid_state(e.to_string()))?
        .ok_or_else(|| DomainError::invalid_state("no events to fold"))
}

/// A stream that cannot be folded: a bug or a damaged log, never a user error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// The first event of the stream is not `instance.created`.
    #[error("instance stream starts with {event_type}, not instance.created")]
    NotCreated {
        /// The event found.
        event_type: &'static str,
    },
    /// `instance.created` appears after the stream began.
    #[error("instance {instance_id} is created twice")]
    CreatedTwice {
        /// The instance.
        instance_id: String,
    },
}

impl Instance {
    /// The condition of `condition_type`, when it holds.
    pub fn condition(&self, condition_type: ConditionType) -> Option<&Condition> {
        self.conditions
            .iter()
            .find(|c| c.condition_type == condition_type)
    }

    /// Whether a node or a provider machine holds it (what `start` from `error` needs).
    pub fn has_host_or_machine(&self) -> bool {
        self.node_id.is_some() || self.external_id.is_some()
    }

    /// Nodes scheduling must avoid for this instance at `now`.
    pub fn excluded_nodes(&self, now: DateTime<Utc>) -> BTreeSet<String> {
        self.refusals
            .iter()
            .filter(|r| r.exclude_until > now)
            .map(|r| r.node_id.clone())
            .collect()
    }

    /// The refusing node, when a `HostResourcesExhausted` refusal has stood for at least `wait`
    /// at `now` (the reconciler then considers moving it).
    pub fn refusal_standing(&self, now: DateTime<Utc>, wait: TimeDelta) -> Option<&str> {
        self.condition(ConditionType::HostResourcesExhausted)
            .filter(|c| now - c.since >= wait)
            .map(|c| c.reason.as_str())
    }

    /// Whether its node's NodeSpec lists it (SPEC §3.7): placed, and neither `pending`,
    /// `scheduling` nor `deleted`. A deleting instance is listed, with `desiredState: deleted`.
    pub fn listed_in_node_spec(&self) -> bool {
        self.node_id.is_some()
            && !matches!(
                self.state,
                InstanceState::Pending | InstanceState::Scheduling | InstanceState::Deleted
            )
    }

    /// Whether a sandbox may claim it: a warm instance that has settled (`stopped` or
    /// `paused`) and is not being deleted.
    pub fn claimable(&self) -> bool {
        self.warm_template_id.is_some()
            && matches!(self.state, InstanceState::Stopped | InstanceState::Paused)
            && self.desired_state != DesiredState::Deleted
    }

    /// Whether it attaches a volume read-write (a memory snapshot of it is refused: the
    /// restored guest's memory would not match the disk it wrote since).
    pub fn writes_volume(&self) -> bool {
        self.volumes.iter().any(|a| !a.read_only)
    }

    /// The node it must run on, when it attaches volumes (they live on one node).
    pub fn volume_node(&self) -> Option<&str> {
        self.volumes.first().map(|a| a.node_id.as_str())
    }

    /// When it entered its current state.
    pub fn in_state_since(&self) -> DateTime<Utc> {
        self.state_since.unwrap_or(self.created_at)
    }

    /// The transitional state a deadline applies to, and since when it stands: `provisioning`,
    /// `starting`, `resizing`, `deleting`, and `stopping` (running or paused, wanted
    /// stopped). `None` for a settled instance.
    pub fn transitional(&self) -> Option<(&'static str, DateTime<Utc>)> {
        let since = self.in_state_since();
        Some(match self.state {
            InstanceState::Provisioning => ("provisioning", since),
            InstanceState::Starting => ("starting", since),
            InstanceState::Resizing => ("resizing", since),
            InstanceState::Deleting => ("deleting", since),
            InstanceState::Running | InstanceState::Paused
                if self.desired_state == DesiredState::Stopped =>
            {
                ("stopping", since.max(self.desired_since.unwrap_or(since)))
            }
            _ => return None,
        })
    }

    /// Whether `instances.list` hides it (warm instances are hidden).
    pub fn is_warm(&self) -> bool {
        self.warm_template_id.is_some()
    }
}

/// Applies one event recorded at `at` to the instance (`None` before `instance.created`).
///
/// State, desired state, version and `updatedAt` come from every event. Conditions change only by
/// the condition events, except `instance.deleted`, which drops them with everything else the
/// instance held (allocation, lease addresses); `instance.recreating` likewise releases node,
/// allocation and addresses.
pub fn evolve(
    state: Option<Instance>,
    event: &InstanceEvent,
    at: DateTime<Utc>,
) -> Result<Instance, StreamError> {
    if let (Some(inst), InstanceEvent::Created(_)) = (&state, event) {
        return Err(StreamError::CreatedTwice {
            instance_id: inst.id.clone(),
        });
    }
    // Created twice is ruled out above, and an instance event always parses: the fold can
    // only find a stream that does not start with `instance.created`.
    <Instance as Aggregate>::evolve(state, event, at).map_err(|_| StreamError::NotCreated {
        event_type: event.event_type(),
    })
}

/// Applies a non-creating event in place (what `evolve` does once the instance exists, but for
/// counting the version).
pub(crate) fn apply(inst: &mut Instance, event: &InstanceEvent, at: DateTime<Utc>) {
    let common = event.common();
    if inst.state != common.state {
        inst.state_since = Some(at);
    }
    if inst.desired_state != common.desired_state {
        inst.desired_since = Some(at);
    }
    inst.state = common.state;
    inst.desired_state = common.desired_state;
    inst.sandbox_id.clone_from(&common.sandbox_id);
    inst.warm_template_id.clone_from(&common.warm_template_id);
    inst.updated_at = at;
    match event {
        // Creation is handled by `evolve`; a created event never reaches here.
        InstanceEvent::Created(_) => {}
        InstanceEvent::Scheduled(d) => {
            inst.node_id = Some(d.node_id.clone());
            inst.allocation_id = Some(d.allocation_id.clone());
            inst.addresses = vec![d.address.clone()];
        }
        InstanceEvent::Provisioning(d) => inst.external_id = Some(d.external_id.clone()),
        InstanceEvent::IdentityRebound(_) => {
            if let Some(restore) = inst.restore_from.as_mut() {
                restore.principal_instance_id = None;
            }
        }
        InstanceEvent::Starting(d) => {
            inst.starts += 1;
            if let Some(owner) = &d.owner_identity_id {
                inst.owner_identity_id.clone_from(owner);
                inst.claimed_at = Some(at);
            }
        }
        InstanceEvent::Resized(d) => {
            inst.flavor.clone_from(&d.flavor);
            inst.shape = d.shape.clone();
        }
        InstanceEvent::Recreating(d) => {
            inst.node_id = None;
            inst.allocation_id = None;
            inst.addresses.clear();
            if let (RecreateReason::ResourcesExhausted, Some(node), Some(until)) =
                (d.reason, &d.from_node_id, d.exclude_until)
            {
                inst.refusals.push(Refusal {
                    node_id: node.clone(),
                    at,
                    exclude_until: until,
                });
            }
        }
        InstanceEvent::Deleted(_) => {
            inst.allocation_id = None;
            inst.addresses.clear();
            inst.conditions.clear();
        }
        InstanceEvent::ConditionSet(d) => {
            match inst
                .conditions
                .iter_mut()
                .find(|c| c.condition_type == d.condition.condition_type)
            {
                Some(existing) => *existing = d.condition.clone(),
                None => inst.conditions.push(d.condition.clone()),
            }
        }
        InstanceEvent::ConditionCleared(d) => inst
            .conditions
            .retain(|c| c.condition_type != d.condition_type),
        InstanceEvent::AddressesChanged(d) => inst.addresses.clone_from(&d.addresses),
        InstanceEvent::Labeled(d) => inst.labels.clone_from(&d.labels),
        InstanceEvent::Stopping(_)
        | InstanceEvent::Pausing(_)
        | InstanceEvent::Deleting(_)
        | InstanceEvent::Running(_)
        | InstanceEvent::Stopped(_)
        | InstanceEvent::Paused(_)
        | InstanceEvent::Failed(_)
        | InstanceEvent::Lost(_)
        | InstanceEvent::Recovered(_) => {}
    }
}

/// Folds a stream of `(event, recorded_at)` into the instance; `None` for an empty stream.
pub fn fold<'a>(
    events: impl IntoIterator<Item = (&'a InstanceEvent, DateTime<Utc>)>,
) -> Result<Option<Instance>, StreamError> {
    let mut state = None;
    for (event, at) in events {
        state = Some(evolve(state, event, at)?);
    }
    Ok(state)
}

fn from_created(d: &Created, at: DateTime<Utc>) -> Instance {
    Instance {
        id: d.common.instance_id.clone(),
        tenant_id: d.common.tenant_id.clone(),
        pool_id: d.common.pool_id.clone(),
        pool_kind: d.pool_kind,
        state: d.common.state,
        desired_state: d.common.desired_state,
        flavor: d.flavor.clone(),
        shape: d.shape.clone(),
        image_id: d.image_id.clone(),
        ssh_keys: d.ssh_keys.clone(),
        user_data_ref: d.user_data_ref.clone(),
        addresses: Vec::new(),
        conditions: Vec::new(),
        node_id: None,
        allocation_id: None,
        external_id: None,
        project_id: d.project_id.clone(),
        owner_identity_id: d.owner_identity_id.clone(),
        idempotency_key: d.idempotency_key.clone(),
        request_hash: d.request_hash.clone(),
        sandbox_id: d.common.sandbox_id.clone(),
        warm_template_id: d.common.warm_template_id.clone(),
        template_version: d.template_version,
        claimed_at: None,
        starts: 0,
        network_policy: d.network_policy,
        network_rules: (*d.network_rules).clone(),
        restore_from: d.restore_from.as_deref().cloned(),
        volumes: d.volumes.clone(),
        labels: d.labels.clone(),
        state_since: None,
        desired_since: None,
        created_at: at,
        updated_at: at,
        version: 1,
        refusals: Vec::new(),
    }
}

impl crate::aggregate::Event for InstanceEvent {
    fn event_type(&self) -> &'static str {
        InstanceEvent::event_type(self)
    }

    fn data(&self) -> serde_json::Value {
        InstanceEvent::data(self)
    }

    fn from_parts(
        event_type: &str,
        data: serde_json::Value,
    ) -> Result<Self, crate::aggregate::FoldError> {
        crate::aggregate::parse_tagged(event_type, data)
    }
}

impl Aggregate for Instance {
    type Event = InstanceEvent;
    const CATEGORY: &'static str = "instance";

    fn create(event: &InstanceEvent, at: DateTime<Utc>) -> Option<Self> {
        match event {
            InstanceEvent::Created(created) => Some(from_created(created, at)),
            _ => None,
        }
    }

    fn apply(&mut self, event: &InstanceEvent, at: DateTime<Utc>) {
        apply(self, event, at);
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}
