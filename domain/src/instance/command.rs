//! What the API, the reconciler and host reports ask of an instance.
//!
//! Commands carry facts the caller already resolved (the flavor's shape, the chosen node, the
//! leased address, a quota check that passed); `decide` only judges them against the instance.

use chrono::{DateTime, Utc};

use crate::condition::ConditionType;
use crate::placement::Unschedulable;
use crate::resources::Shape;
use crate::state_table::{DesiredState, InstanceState};

use super::PoolKind;

/// A request to an instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InstanceCommand {
    /// Admit a new instance (`instances.create`, a cold sandbox create, a warm refill). Boxed:
    /// it is by far the largest command.
    Create(Box<CreateInstance>),
    /// A hosted instance got a node, an allocation and an address.
    Place(PlaceInstance),
    /// Placement found nothing; record why (`Unschedulable` condition).
    MarkUnschedulable(Unschedulable),
    /// The provider answered a create: the machine exists.
    Provisioned {
        /// The provider's machine id.
        external_id: String,
        /// Its addresses (they replace the instance's list).
        addresses: Vec<String>,
    },
    /// `instances.start`: want it running.
    Start {
        /// Who asks.
        requester: Requester,
    },
    /// `instances.stop`: want it stopped.
    Stop {
        /// Who asks.
        requester: Requester,
    },
    /// A sandbox's pause: want it paused (memory kept). Only its sandbox asks.
    Pause {
        /// Who asks.
        requester: Requester,
    },
    /// `instances.delete`, a sandbox delete, a tenant teardown: want it deleted.
    Delete {
        /// Who asks.
        requester: Requester,
        /// Why, when not the tenant's own call (e.g. `tenant deleted`).
        reason: Option<String>,
    },
    /// `instances.resize` to a flavor whose quota and node room the caller already checked.
    Resize(ResizeInstance),
    /// A sandbox claims this warm instance: it becomes the sandbox's, wanted running.
    Claim {
        /// The claiming sandbox.
        sandbox_id: String,
        /// The sandbox's owner.
        owner_identity_id: String,
    },
    /// The host (or provider) reports the instance in this state: walk `state` there when it is
    /// what is desired (one event per table move), recover a lost instance, clear conditions.
    Observe(Observed),
    /// The runtime or provider reports a failure: `error` and `instance.failed`.
    Fail(Failure),
    /// The host refused to start it for lack of resources (`STOPPED` with `ResourcesExhausted:`).
    ReportResourcesExhausted {
        /// The refusing node (must be the instance's node).
        node_id: String,
        /// The host's words.
        message: String,
    },
    /// Record a condition (e.g. a retryable `ProviderError`); re-asserting the same reason keeps
    /// its `since`, and an identical one appends nothing.
    SetCondition {
        /// The kind.
        condition_type: ConditionType,
        /// Its reason.
        reason: String,
        /// Its message (cut to the type's cap).
        message: String,
    },
    /// Remove a condition; nothing happens when it is absent.
    ClearCondition(ConditionType),
    /// Record reported addresses.
    RecordAddresses {
        /// The addresses.
        addresses: Vec<String>,
        /// Add to the list (host reports) or replace it (provider answers).
        mode: AddressMode,
    },
    /// Its host gave this memory restore an SSH identity of its own (`identityRebound`).
    ReboundIdentity,
    /// Release node, allocation and lease and schedule again.
    Recreate(RecreateCause),
    /// Its node (or machine) is gone.
    Lose,
    /// Its node came back and reports it in this state.
    Recover(Observed),
    /// Teardown finished (complete host report without it, provider delete done).
    Release,
    /// `instances.setLabels`: the labels replace the instance's.
    SetLabels(crate::labels::Labels),
    /// Its transitional `state` (see [`super::Instance::transitional`]) stood past its
    /// deadline: it fails (`instance.failed`, `reason: deadline:<state>`) and is released at
    /// once like a force delete; one past `deleting` is released. A settled instance, or one
    /// in another transitional state by now, changes nothing.
    PastDeadline {
        /// The state whose deadline passed.
        state: String,
    },
    /// A force delete (`delete { force: true }`, or a deadline past in `deleting`): the control
    /// plane stops waiting for the host and releases everything at once (`instance.deleting`
    /// with `reason`, then `instance.deleted`). A host that still holds it reports it as an
    /// orphan and is told to let it go. Provider-pool instances are deleted as usual: their
    /// machine must be deleted at the provider.
    ForceDelete {
        /// Who asks.
        requester: Requester,
        /// Why (`force`, `deadline:deleting`).
        reason: String,
    },
}

/// Everything an admitted create needs, already validated and resolved by the caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CreateInstance {
    /// The derived id ([`crate::ids::instance_id`]).
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// Hosted or provider pool.
    pub pool_kind: PoolKind,
    /// The flavor name.
    pub flavor: String,
    /// The flavor's shape.
    pub shape: Shape,
    /// The image as named.
    pub image_id: String,
    /// OpenSSH public keys.
    pub ssh_keys: Vec<String>,
    /// The sealed user data reference (`secret://…`).
    pub user_data_ref: Option<String>,
    /// The project.
    pub project_id: Option<String>,
    /// What it should become (`running` by default; `paused` for warm pools).
    pub desired_state: DesiredState,
    /// The caller's identity.
    pub owner_identity_id: String,
    /// The idempotency key.
    pub idempotency_key: String,
    /// Hash of the request without `wait`.
    pub request_hash: String,
    /// The sandbox that drives it.
    pub sandbox_id: Option<String>,
    /// The template it is a warm instance of.
    pub warm_template_id: Option<String>,
    /// A warm instance: the template's instance version.
    pub template_version: Option<u64>,
    /// A sandbox template's network rule.
    pub network_policy: Option<crate::network_policy::Network>,
    /// A sandbox template's allow-list and bounds.
    pub network_rules: crate::network_policy::NetworkRules,
    /// A restore: the snapshot it boots from.
    pub restore_from: Option<super::RestoreFrom>,
    /// A sandbox's volumes, from its template.
    pub volumes: Vec<crate::attachment::Attachment>,
    /// Its labels.
    pub labels: crate::labels::Labels,
}

/// A placement the caller made (node chosen, allocation booked, address leased).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlaceInstance {
    /// The node.
    pub node_id: String,
    /// The allocation id.
    pub allocation_id: String,
    /// The leased IPv4 address, without prefix.
    pub address: String,
}

/// A resize to another flavor of the pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResizeInstance {
    /// The new flavor name.
    pub flavor: String,
    /// Its shape.
    pub shape: Shape,
}

/// Who asks for a desired-state change. Sandbox- and warm-owned instances move only for
/// [`Requester::System`] (their sandbox or template machinery, a tenant teardown).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Requester {
    /// A caller of `instances.*`.
    Api,
    /// The control plane itself on behalf of the instance's owner.
    System,
}

/// A settled state a host or provider can report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Observed {
    /// `RUNNING`.
    Running,
    /// `STOPPED`.
    Stopped,
    /// `PAUSED`.
    Paused,
}

/// A failure report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Failure {
    /// The host's runtime (or the provider's machine) is in error. Adds `RuntimeError`.
    Runtime {
        /// Its words.
        message: String,
    },
    /// A provider call failed with a code retrying will not fix. Adds `ProviderError`.
    Provider {
        /// The error code (`UNSUPPORTED`, `INVALID_STATE`, `INVALID_CONFIG`).
        code: String,
        /// Its message.
        message: String,
    },
}

/// Why (and how) to place an instance again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecreateCause {
    /// Its host refused to start it; avoid that host until `exclude_until`. After
    /// [`super::MAX_EXHAUSTED_REPLACEMENTS`] re-placements this fails the instance instead.
    ResourcesExhausted {
        /// Until when scheduling must avoid the refusing node.
        exclude_until: DateTime<Utc>,
    },
    /// Its host was lost and the pool's policy recreates on host loss.
    HostLost,
}

/// How reported addresses combine with the instance's list.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AddressMode {
    /// Append the ones not yet listed (host reports).
    Add,
    /// Replace the list (provider answers).
    Replace,
}

impl Observed {
    /// The instance state this observation corresponds to.
    pub fn as_state(self) -> InstanceState {
        match self {
            Observed::Running => InstanceState::Running,
            Observed::Stopped => InstanceState::Stopped,
            Observed::Paused => InstanceState::Paused,
        }
    }
}

/// What a host report needs of an instance to tell that the report changes nothing, without
/// the whole instance: its state, whether it has conditions, and its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportView {
    /// The instance's state.
    pub state: InstanceState,
    /// Whether any condition is set (an observation may clear one).
    pub has_conditions: bool,
    /// Its addresses.
    pub addresses: Vec<String>,
    /// A memory restore that still answers as the instance its memory was captured on.
    pub shares_principal: bool,
    /// A sandbox drives it (its guest's CPU seconds may decide an idle pause).
    pub drives_sandbox: bool,
}

impl ReportView {
    /// Whether observing `observed` with `reported` addresses decides no event: the instance
    /// is in that state already, has no condition to clear, and has every address. Most
    /// entries of a complete report are such; the report path loads and locks only the rest.
    pub fn unchanged_by(&self, observed: Observed, reported: &[String]) -> bool {
        self.state == observed.as_state()
            && !self.has_conditions
            && reported.iter().all(|a| self.addresses.contains(a))
    }

    /// Whether a report that says the guest's identity was rebound decides an event: only for
    /// a memory restore that still shares its source's.
    pub fn rebinds(&self, identity_rebound: bool) -> bool {
        identity_rebound && self.shares_principal
    }
}
