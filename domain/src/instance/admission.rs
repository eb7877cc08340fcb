//! Admission as one pure decision: given what the database says about the pool, the flavor, the
//! image, the tenant's quota, the pool's nodes and a free address ([`AdmissionFacts`]), a create
//! is a replay of an earlier one, or it is refused, or it is admitted: created, and for hosted
//! pools placed on a node with an address (or marked unschedulable), all as one list of events.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use chrono::{DateTime, Utc};

use crate::authz::InstanceDraft;
use crate::error::DomainError;
use crate::placement::{place, NodeCandidate, PlacementRequest};
use crate::quota::{charge_of, check, Amounts};
use crate::resources::Shape;

use super::{decide, fold_now, CreateInstance, Instance, InstanceCommand, InstanceEvent};
use super::{PlaceInstance, PoolKind};

/// The pool as admission sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionPool {
    /// Hosted or provider.
    pub kind: PoolKind,
    /// Hosted pools' runtime.
    pub runtime: String,
    /// Provider pools: whether an account is set.
    pub has_account: bool,
    /// Hosted pools: the IPv4 range is set.
    pub has_range: bool,
}

/// What admission reads before it decides, all in one place.
#[derive(Debug, Clone, Default)]
pub struct AdmissionFacts {
    /// The instance this idempotency key already made.
    pub existing: Option<Instance>,
    /// The pool, when it exists and is offered to the tenant.
    pub pool: Option<AdmissionPool>,
    /// The flavor's shape, when it exists in the pool and is not archived.
    pub shape: Option<Shape>,
    /// Whether the image exists and the tenant may use it.
    pub image_visible: bool,
    /// Whether that image is marked verified (policies may require it).
    pub image_verified: bool,
    /// The tenant's quota maxima in the pool.
    pub quota_max: Amounts,
    /// The tenant's usage in the pool.
    pub quota_used: Amounts,
    /// Hosted pools: the nodes with what is booked on them.
    pub nodes: Vec<NodeCandidate>,
    /// Hosted pools with a range: an address nobody leases.
    pub free_address: Option<Ipv4Addr>,
}

/// What admission decided.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// The same request was admitted before: answer that instance.
    Replay(Box<Instance>),
    /// A new instance: record these events.
    Admit(Vec<InstanceEvent>),
}

/// The policy decision on what a create would make (SPEC §3.3 step 3), given the instance's
/// id and its draft: `Err` refuses it (`ACCESS_DENIED`). Admission asks it once the create is
/// neither a replay nor names a pool, flavor or image that does not resolve, before the quota
/// and the nodes are weighed.
pub type Policy<'a> = &'a (dyn Fn(&str, &InstanceDraft) -> Result<(), DomainError> + Sync);

/// The [`Policy`] of creates whose own request was authorized before (a sandbox's instance, a
/// template's warm one): it allows every draft.
pub fn authorized_before(_: &str, _: &InstanceDraft) -> Result<(), DomainError> {
    Ok(())
}

/// Decides a create. `create.shape` and `create.pool_kind` are filled in from the facts;
/// `allocation_id` names the allocation a placement books; `policy` decides the draft.
pub fn admit(
    facts: &AdmissionFacts,
    mut create: CreateInstance,
    allocation_id: &str,
    now: DateTime<Utc>,
    policy: Policy<'_>,
) -> Result<Admission, DomainError> {
    super::decide::check_create_request(&create)?;
    if let Some(existing) = &facts.existing {
        decide(
            Some(existing),
            &InstanceCommand::Create(Box::new(create)),
            now,
        )?;
        return Ok(Admission::Replay(Box::new(existing.clone())));
    }
    let not_found = |what: String| DomainError::NotFound { what };
    let pool = facts
        .pool
        .as_ref()
        .ok_or_else(|| not_found(format!("pool {}", create.pool_id)))?;
    let shape = facts
        .shape
        .clone()
        .ok_or_else(|| not_found(format!("flavor {}", create.flavor)))?;
    // Provider pools too: the image id goes to the provider as it is, and a provider's ids
    // (snapshots above all) are account-wide, so only a registered image the tenant may use
    // is ever asked for.
    if !facts.image_visible {
        return Err(not_found(format!("image {}", create.image_id)));
    }
    policy(
        &create.id,
        &InstanceDraft {
            vcpu: shape.vcpu,
            memory_gib: shape.memory_gib,
            gpus: shape.gpu_count(),
            disk_gib: shape.disk_gib,
            image_id: create.image_id.clone(),
            image_verified: facts.image_verified,
            project_id: create.project_id.clone(),
            labels: create.labels.clone(),
        },
    )?;
    match pool.kind {
        PoolKind::Provider if !pool.has_account => {
            return Err(DomainError::invalid_state(format!(
                "pool {} has no provider account",
                create.pool_id
            )))
        }
        _ => {}
    }
    check(&facts.quota_max, &facts.quota_used, &charge_of(&shape))?;
    create.shape = shape;
    create.pool_kind = pool.kind;
    let mut events = decide(None, &InstanceCommand::Create(Box::new(create)), now)?;
    if pool.kind == PoolKind::Hosted {
        let created = fold_now(&events, now)?;
        let placement = placement(facts, pool, &created, allocation_id, now)?;
        events.extend(decide(Some(&created), &placement, now)?);
    }
    Ok(Admission::Admit(events))
}

/// The placement of a scheduling instance: a node and an address, or why nothing fits. No
/// address (no range, or every address leased) is `CAPACITY_UNAVAILABLE` for `ipv4`.
pub fn placement(
    facts: &AdmissionFacts,
    pool: &AdmissionPool,
    instance: &Instance,
    allocation_id: &str,
    now: DateTime<Utc>,
) -> Result<InstanceCommand, DomainError> {
    let excluded: BTreeSet<String> = instance.excluded_nodes(now);
    // An instance with volumes runs on their node or nowhere.
    let only: Option<BTreeSet<String>> = instance.volume_node().map(|n| [n.to_string()].into());
    let request = PlacementRequest {
        shape: &instance.shape,
        runtime: &pool.runtime,
        required_labels: &instance
            .restore_from
            .as_ref()
            .map(super::RestoreFrom::required_labels)
            .unwrap_or_default(),
        excluded: &excluded,
        only_nodes: only.as_ref(),
    };
    let node_id = match place(&request, &facts.nodes) {
        Ok(node_id) => node_id,
        Err(why) => return Ok(InstanceCommand::MarkUnschedulable(why)),
    };
    let address = facts
        .free_address
        .filter(|_| pool.has_range)
        .ok_or_else(|| DomainError::CapacityUnavailable {
            resource: "ipv4".into(),
        })?;
    Ok(InstanceCommand::Place(PlaceInstance {
        node_id,
        allocation_id: allocation_id.to_string(),
        address: address.to_string(),
    }))
}

/// The most user data one instance takes, in bytes.
pub const MAX_USER_DATA: usize = 64 * 1024;

/// Checks user data given with a create.
pub fn check_user_data(user_data: Option<&str>) -> Result<(), DomainError> {
    match user_data {
        Some(u) if u.len() > MAX_USER_DATA => {
            Err(DomainError::invalid_input("userData", "at most 64 KiB"))
        }
        _ => Ok(()),
    }
}

/// What a resize reads before it decides.
#[derive(Debug, Clone)]
pub struct ResizeFacts {
    /// The new flavor's shape, when it exists in the pool and is not archived.
    pub shape: Option<Shape>,
    /// The tenant's quota maxima in the pool.
    pub quota_max: Amounts,
    /// The tenant's usage in the pool.
    pub quota_used: Amounts,
    /// Hosted: the node's capacity and what is booked on it (this instance included).
    pub node: Option<(crate::resources::Capacity, crate::resources::Capacity)>,
}

/// Decides a resize to `flavor`: the instance's own rules first (state, pool kind, GPUs), then
/// the quota for the growth, then room on its node.
pub fn resize(
    instance: &Instance,
    flavor: &str,
    facts: &ResizeFacts,
    now: DateTime<Utc>,
) -> Result<Vec<InstanceEvent>, DomainError> {
    let shape = facts.shape.clone().ok_or_else(|| DomainError::NotFound {
        what: format!("flavor {flavor}"),
    })?;
    let command = InstanceCommand::Resize(super::ResizeInstance {
        flavor: flavor.into(),
        shape: shape.clone(),
    });
    let events = decide(Some(instance), &command, now)?;
    check(
        &facts.quota_max,
        &facts.quota_used,
        &crate::quota::resize_delta(&instance.shape, &shape),
    )?;
    if let Some((capacity, allocated)) = &facts.node {
        crate::placement::check_resize_in_place(capacity, allocated, &instance.shape, &shape)?;
    }
    Ok(events)
}

impl AdmissionFacts {
    /// The facts once `instance` is admitted on them: its charge in the quota's usage, its
    /// booking on its node, its address no longer free. Batch admission decides the next create
    /// of the batch on these.
    pub fn book(&mut self, instance: &Instance) {
        for (resource, amount) in charge_of(&instance.shape) {
            let used = self.quota_used.entry(resource).or_insert(0);
            *used = used.saturating_add(amount.max(0) as u64);
        }
        if let Some(node_id) = &instance.node_id {
            if let Some(node) = self.nodes.iter_mut().find(|n| &n.id == node_id) {
                node.allocated = node.allocated.plus(&instance.shape);
            }
        }
        let leased = instance.addresses.first().and_then(|a| a.parse().ok());
        if leased.is_some() && leased == self.free_address {
            self.free_address = None;
        }
    }
}
