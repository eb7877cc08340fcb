//! `decide`: judge a command against an instance and say what happens.

use chrono::{DateTime, Utc};

use crate::condition::{truncate_chars, ConditionType};
use crate::error::DomainError;
use crate::ids::{self, prefix};
use crate::placement::Unschedulable;
use crate::ssh_keys::validate_ssh_public_key;
use crate::state_table::{
    self, transition, transition_to, walk, DesiredState, InstanceState, Verb, CONVERGE_VERBS,
};

use super::command::{
    AddressMode, CreateInstance, Failure, InstanceCommand, Observed, PlaceInstance, RecreateCause,
    Requester, ResizeInstance,
};
use super::event::{starting, Starting};
use super::event::{
    AddressesChanged, Common, ConditionCleared, ConditionSet, Created, Deleting, Failed,
    InstanceEvent, Labeled, Lost, Provisioning, RecreateReason, Recreating, Resized, Scheduled,
};
use super::{apply, Instance, PoolKind, MAX_EXHAUSTED_REPLACEMENTS};

/// The events `cmd` produces on `state` at `now`, or why it is refused (and then nothing
/// happens). `state` is `None` for an instance that does not exist yet; only `Create` applies
/// to it, anything else is `NOT_FOUND`.
///
/// Repeating a command whose effect already holds (a second `delete`, a report of a state the
/// instance is already in) returns no events rather than an error, so retries and periodic
/// reports are harmless.
pub fn decide(
    state: Option<&Instance>,
    cmd: &InstanceCommand,
    now: DateTime<Utc>,
) -> Result<Vec<InstanceEvent>, DomainError> {
    let inst = match (state, cmd) {
        (existing, InstanceCommand::Create(create)) => return create_instance(existing, create),
        (None, _) => {
            return Err(DomainError::NotFound {
                what: "instance".into(),
            })
        }
        (Some(inst), _) => inst,
    };
    let mut d = Draft {
        inst: inst.clone(),
        now,
        events: Vec::new(),
    };
    match cmd {
        InstanceCommand::Create(_) => unreachable!("handled above"),
        InstanceCommand::Place(p) => place(&mut d, p)?,
        InstanceCommand::MarkUnschedulable(u) => mark_unschedulable(&mut d, u)?,
        InstanceCommand::Provisioned {
            external_id,
            addresses,
        } => provisioned(&mut d, external_id, addresses)?,
        InstanceCommand::Start { requester } => start(&mut d, *requester)?,
        InstanceCommand::Stop { requester } => stop(&mut d, *requester)?,
        InstanceCommand::Pause { requester } => pause(&mut d, *requester)?,
        InstanceCommand::Delete { requester, reason } => delete(&mut d, *requester, reason)?,
        InstanceCommand::Resize(r) => resize(&mut d, r)?,
        InstanceCommand::Claim {
            sandbox_id,
            owner_identity_id,
        } => claim(&mut d, sandbox_id, owner_identity_id)?,
        InstanceCommand::Observe(o) => observe(&mut d, *o)?,
        InstanceCommand::Fail(f) => fail(&mut d, f)?,
        InstanceCommand::ReportResourcesExhausted { node_id, message } => {
            resources_exhausted(&mut d, node_id, message)?
        }
        InstanceCommand::SetCondition {
            condition_type,
            reason,
            message,
        } => {
            refuse_if_deleted(&d)?;
            d.set_condition(*condition_type, reason, message)?;
        }
        InstanceCommand::ClearCondition(condition_type) => {
            refuse_if_deleted(&d)?;
            d.clear_condition(*condition_type)?;
        }
        InstanceCommand::RecordAddresses { addresses, mode } => {
            if d.inst.state != InstanceState::Deleted {
                d.record_addresses(addresses, *mode)?;
            }
        }
        InstanceCommand::ReboundIdentity => rebound_identity(&mut d)?,
        InstanceCommand::Recreate(cause) => recreate(&mut d, cause)?,
        InstanceCommand::Lose => lose(&mut d)?,
        InstanceCommand::Recover(o) => recover(&mut d, *o)?,
        InstanceCommand::Release => release(&mut d)?,
        InstanceCommand::SetLabels(labels) => set_labels(&mut d, labels)?,
        InstanceCommand::PastDeadline { state } => past_deadline(&mut d, state)?,
        InstanceCommand::ForceDelete { requester, reason } => {
            force_delete(&mut d, *requester, reason)?
        }
    }
    Ok(d.events)
}

/// Decides `commands` in turn, each on the state the previous ones left. A command the state
/// table refuses (`INVALID_STATE`) is skipped: a report that no longer applies to the
/// instance's state changes nothing. Any other refusal refuses the whole list.
pub fn decide_all(
    state: &Instance,
    commands: &[InstanceCommand],
    now: DateTime<Utc>,
) -> Result<Vec<InstanceEvent>, DomainError> {
    let mut current = state.clone();
    let mut events = Vec::new();
    for command in commands {
        match decide(Some(&current), command, now) {
            Ok(decided) => {
                for event in &decided {
                    apply(&mut current, event, now);
                }
                events.extend(decided);
            }
            Err(DomainError::InvalidState { .. }) => continue,
            Err(other) => return Err(other),
        }
    }
    Ok(events)
}

/// The instance as the decision goes, and the events so far. Each event is applied as it is
/// emitted, so later events carry the state the earlier ones left.
struct Draft {
    inst: Instance,
    now: DateTime<Utc>,
    events: Vec<InstanceEvent>,
}

impl Draft {
    fn common(&self, state: InstanceState, desired_state: DesiredState) -> Common {
        Common {
            instance_id: self.inst.id.clone(),
            tenant_id: self.inst.tenant_id.clone(),
            pool_id: self.inst.pool_id.clone(),
            state,
            desired_state,
            sandbox_id: self.inst.sandbox_id.clone(),
            warm_template_id: self.inst.warm_template_id.clone(),
        }
    }

    /// Emits an event leaving the instance in `state` / `desired_state`. A change of state that is
    /// no row of the table is refused here too, as a last line of defence.
    fn emit(
        &mut self,
        state: InstanceState,
        desired_state: DesiredState,
        make: impl FnOnce(Common) -> InstanceEvent,
    ) -> Result<(), DomainError> {
        let from = self.inst.state;
        if from != state && !state_table::allows(from, state) {
            return Err(DomainError::invalid_state(format!(
                "no move leads from {from} to {state}"
            )));
        }
        let event = make(self.common(state, desired_state));
        apply(&mut self.inst, &event, self.now);
        self.events.push(event);
        Ok(())
    }

    /// Emits an event that leaves state and desired state as they are.
    fn emit_same(&mut self, make: impl FnOnce(Common) -> InstanceEvent) -> Result<(), DomainError> {
        self.emit(self.inst.state, self.inst.desired_state, make)
    }

    /// Sets a condition unless the same one already holds; re-asserting the same reason keeps the
    /// original `since`.
    fn set_condition(
        &mut self,
        condition_type: ConditionType,
        reason: &str,
        message: &str,
    ) -> Result<(), DomainError> {
        let message = truncate_chars(message, condition_type.message_cap());
        let since = match self.inst.condition(condition_type) {
            Some(c) if c.reason == reason && c.message == message => return Ok(()),
            Some(c) if c.reason == reason => c.since,
            _ => self.now,
        };
        let condition = crate::condition::Condition::new(condition_type, reason, &message, since);
        self.emit_same(|common| InstanceEvent::ConditionSet(ConditionSet { common, condition }))
    }

    fn clear_condition(&mut self, condition_type: ConditionType) -> Result<(), DomainError> {
        if self.inst.condition(condition_type).is_none() {
            return Ok(());
        }
        self.emit_same(|common| {
            InstanceEvent::ConditionCleared(ConditionCleared {
                common,
                condition_type,
            })
        })
    }

    fn record_addresses(
        &mut self,
        reported: &[String],
        mode: AddressMode,
    ) -> Result<(), DomainError> {
        let mut addresses = match mode {
            AddressMode::Add => self.inst.addresses.clone(),
            AddressMode::Replace => Vec::new(),
        };
        for a in reported {
            if !addresses.contains(a) && addresses.len() < super::MAX_ADDRESSES {
                addresses.push(a.clone());
            }
        }
        if addresses == self.inst.addresses {
            return Ok(());
        }
        self.emit_same(|common| {
            InstanceEvent::AddressesChanged(AddressesChanged { common, addresses })
        })
    }

    /// `INVALID_STATE` naming the sandbox or template when an API caller tries to move an
    /// instance someone else drives.
    fn refuse_if_owned(&self, requester: Requester) -> Result<(), DomainError> {
        if requester == Requester::System {
            return Ok(());
        }
        let id = &self.inst.id;
        if let Some(sandbox) = &self.inst.sandbox_id {
            return Err(DomainError::invalid_state(format!(
                "instance {id} is managed by sandbox {sandbox}; use sandboxes.* instead"
            )));
        }
        if let Some(template) = &self.inst.warm_template_id {
            return Err(DomainError::invalid_state(format!(
                "instance {id} is a warm instance of sandbox template {template}; \
                 use sandboxTemplates.* instead"
            )));
        }
        Ok(())
    }

    fn refuse_if_being_deleted(&self) -> Result<(), DomainError> {
        let inst = &self.inst;
        if matches!(inst.state, InstanceState::Deleting | InstanceState::Deleted)
            || inst.desired_state == DesiredState::Deleted
        {
            return Err(DomainError::invalid_state(format!(
                "instance {} is {}",
                inst.id,
                if inst.state == InstanceState::Deleted {
                    "deleted"
                } else {
                    "being deleted"
                }
            )));
        }
        Ok(())
    }
}

fn refuse_if_deleted(d: &Draft) -> Result<(), DomainError> {
    if d.inst.state == InstanceState::Deleted {
        return Err(DomainError::invalid_state(format!(
            "instance {} is deleted",
            d.inst.id
        )));
    }
    Ok(())
}

fn create_instance(
    existing: Option<&Instance>,
    c: &CreateInstance,
) -> Result<Vec<InstanceEvent>, DomainError> {
    check_create_request(c)?;
    if let Some(inst) = existing {
        // Same key: the same request is a replay (no new events), a different one a conflict.
        return if inst.request_hash == c.request_hash {
            Ok(Vec::new())
        } else {
            Err(DomainError::Conflict {
                instance_id: inst.id.clone(),
            })
        };
    }
    if c.shape.vcpu == 0 || c.shape.memory_gib == 0 {
        return Err(DomainError::invalid_input(
            "flavor",
            "a flavor needs at least one vCPU and 1 GiB of memory",
        ));
    }
    let state = transition(InstanceState::Pending, Verb::Admit)?;
    Ok(vec![InstanceEvent::Created(Created {
        common: Common {
            instance_id: c.id.clone(),
            tenant_id: c.tenant_id.clone(),
            pool_id: c.pool_id.clone(),
            state,
            desired_state: c.desired_state,
            sandbox_id: c.sandbox_id.clone(),
            warm_template_id: c.warm_template_id.clone(),
        },
        pool_kind: c.pool_kind,
        flavor: c.flavor.clone(),
        shape: c.shape.clone(),
        image_id: c.image_id.clone(),
        ssh_keys: c.ssh_keys.clone(),
        user_data_ref: c.user_data_ref.clone(),
        project_id: c.project_id.clone(),
        owner_identity_id: c.owner_identity_id.clone(),
        idempotency_key: c.idempotency_key.clone(),
        request_hash: c.request_hash.clone(),
        template_version: c.template_version,
        network_policy: c.network_policy,
        network_rules: Box::new(c.network_rules.clone()),
        restore_from: c.restore_from.clone().map(Box::new),
        volumes: c.volumes.clone(),
        labels: c.labels.clone(),
    })])
}

/// `instances.setLabels`: the labels replace the instance's; the same labels decide nothing.
fn set_labels(d: &mut Draft, labels: &crate::labels::Labels) -> Result<(), DomainError> {
    crate::labels::check("labels", labels)?;
    refuse_if_deleted(d)?;
    if d.inst.labels == *labels {
        return Ok(());
    }
    let labels = labels.clone();
    d.emit_same(|common| InstanceEvent::Labeled(Labeled { common, labels }))
}

fn place(d: &mut Draft, p: &PlaceInstance) -> Result<(), DomainError> {
    if d.inst.pool_kind != PoolKind::Hosted {
        return Err(DomainError::invalid_state(format!(
            "instance {} is in a provider pool and is never placed on a node",
            d.inst.id
        )));
    }
    let to = transition(d.inst.state, Verb::Place)?;
    d.clear_condition(ConditionType::Unschedulable)?;
    let desired = d.inst.desired_state;
    d.emit(to, desired, |common| {
        InstanceEvent::Scheduled(Scheduled {
            common,
            node_id: p.node_id.clone(),
            allocation_id: p.allocation_id.clone(),
            address: p.address.clone(),
        })
    })
}

fn mark_unschedulable(d: &mut Draft, why: &Unschedulable) -> Result<(), DomainError> {
    if d.inst.state != InstanceState::Scheduling {
        return Err(DomainError::invalid_state(format!(
            "instance {} is {}, not scheduling",
            d.inst.id, d.inst.state
        )));
    }
    d.set_condition(ConditionType::Unschedulable, why.reason(), &why.to_string())
}

fn provisioned(d: &mut Draft, external_id: &str, addresses: &[String]) -> Result<(), DomainError> {
    if d.inst.pool_kind != PoolKind::Provider {
        return Err(DomainError::invalid_state(format!(
            "instance {} is hosted and has no provider machine",
            d.inst.id
        )));
    }
    // A later answer about the machine it already has only refreshes the addresses.
    if d.inst.external_id.as_deref() != Some(external_id) {
        let to = transition(d.inst.state, Verb::Create)?;
        let desired = d.inst.desired_state;
        d.emit(to, desired, |common| {
            InstanceEvent::Provisioning(Provisioning {
                common,
                external_id: external_id.to_owned(),
            })
        })?;
    }
    d.record_addresses(addresses, AddressMode::Replace)
}

fn start(d: &mut Draft, requester: Requester) -> Result<(), DomainError> {
    d.refuse_if_owned(requester)?;
    d.refuse_if_being_deleted()?;
    if d.inst.state == InstanceState::Error {
        // A failed instance with a host or machine is retried; one that never got either has
        // nothing to retry on.
        if !d.inst.has_host_or_machine() {
            return Err(DomainError::invalid_state(format!(
                "instance {} failed before it was placed; delete it and create a new one",
                d.inst.id
            )));
        }
        let to = transition(InstanceState::Error, Verb::Start)?;
        return d.emit(to, DesiredState::Running, starting);
    }
    if d.inst.desired_state == DesiredState::Running {
        return Ok(());
    }
    // `start` changes only what is wanted; the reconciler moves `state` from reports.
    let state = d.inst.state;
    d.emit(state, DesiredState::Running, starting)
}

fn claim(d: &mut Draft, sandbox_id: &str, owner: &str) -> Result<(), DomainError> {
    if !d.inst.claimable() {
        return Err(DomainError::invalid_state(format!(
            "instance {} is not a settled warm instance (state {}, desiredState {})",
            d.inst.id, d.inst.state, d.inst.desired_state
        )));
    }
    // The claim moves ownership: the events from here on carry the sandbox, not the template.
    d.inst.sandbox_id = Some(sandbox_id.to_owned());
    d.inst.warm_template_id = None;
    let (state, now) = (d.inst.state, d.now);
    d.emit(state, DesiredState::Running, |common| {
        InstanceEvent::Starting(Starting {
            common,
            claimed_at: Some(now),
            owner_identity_id: Some(owner.to_owned()),
        })
    })
}

/// A memory restore's host regenerated its identity: exec certificates name its own id from
/// now on. Anything else (not a memory restore, rebound already, deleted) appends nothing.
fn rebound_identity(d: &mut Draft) -> Result<(), DomainError> {
    let shares = d
        .inst
        .restore_from
        .as_ref()
        .is_some_and(|r| r.principal_instance_id.is_some());
    if !shares || d.inst.state == InstanceState::Deleted {
        return Ok(());
    }
    d.emit_same(InstanceEvent::IdentityRebound)
}

fn stop(d: &mut Draft, requester: Requester) -> Result<(), DomainError> {
    d.refuse_if_owned(requester)?;
    d.refuse_if_being_deleted()?;
    if d.inst.desired_state == DesiredState::Stopped {
        return Ok(());
    }
    let state = d.inst.state;
    d.emit(state, DesiredState::Stopped, InstanceEvent::Stopping)
}

fn pause(d: &mut Draft, requester: Requester) -> Result<(), DomainError> {
    d.refuse_if_owned(requester)?;
    if requester == Requester::Api {
        // Only a sandbox pauses its instance (SPEC §3.12); `instances.*` has no pause.
        return Err(DomainError::unsupported(
            "instances are not paused through the API",
        ));
    }
    d.refuse_if_being_deleted()?;
    if d.inst.desired_state == DesiredState::Paused {
        return Ok(());
    }
    let state = d.inst.state;
    d.emit(state, DesiredState::Paused, InstanceEvent::Pausing)
}

fn delete(d: &mut Draft, requester: Requester, reason: &Option<String>) -> Result<(), DomainError> {
    d.refuse_if_owned(requester)?;
    let before = d.inst.state;
    if matches!(before, InstanceState::Deleting | InstanceState::Deleted) {
        return Ok(());
    }
    let to = transition(before, Verb::Delete)?;
    d.emit(to, DesiredState::Deleted, |common| {
        InstanceEvent::Deleting(Deleting {
            common,
            reason: reason.clone(),
        })
    })?;
    // A hosted instance that no host holds (never placed, or its host is lost) has nobody to
    // wait for: deletion finishes at once.
    let nobody_holds_it = d.inst.node_id.is_none() || before == InstanceState::Lost;
    if d.inst.pool_kind == PoolKind::Hosted && nobody_holds_it {
        release(d)?;
    }
    Ok(())
}

fn past_deadline(d: &mut Draft, state: &str) -> Result<(), DomainError> {
    if d.inst.transitional().map(|(s, _)| s) != Some(state) {
        return Ok(());
    }
    let reason = format!("deadline:{state}");
    if d.inst.state != InstanceState::Deleting {
        let to = transition(d.inst.state, Verb::Fail)?;
        let desired = d.inst.desired_state;
        let node_id = d.inst.node_id.clone();
        let message = format!("it stood in {state} past its deadline");
        d.emit(to, desired, |common| {
            InstanceEvent::Failed(Failed {
                common,
                reason: reason.clone(),
                message: Some(message),
                node_id,
            })
        })?;
    }
    force_delete(d, Requester::System, &reason)
}

fn force_delete(d: &mut Draft, requester: Requester, reason: &str) -> Result<(), DomainError> {
    d.refuse_if_owned(requester)?;
    if d.inst.pool_kind == PoolKind::Provider {
        // Its machine is deleted at the provider first; nothing may leak there.
        return delete(d, requester, &Some(reason.to_string()));
    }
    let to = match d.inst.state {
        InstanceState::Deleted => return Ok(()),
        InstanceState::Deleting => InstanceState::Deleting,
        from => transition(from, Verb::Delete)?,
    };
    let reason = Some(reason.to_string());
    d.emit(to, DesiredState::Deleted, |common| {
        InstanceEvent::Deleting(Deleting { common, reason })
    })?;
    release(d)
}

fn resize(d: &mut Draft, r: &ResizeInstance) -> Result<(), DomainError> {
    d.refuse_if_owned(Requester::Api)?;
    let inst = &d.inst;
    if inst.pool_kind == PoolKind::Provider {
        return Err(DomainError::unsupported(
            "resize is not supported for instances in provider pools",
        ));
    }
    if inst.shape.gpus != r.shape.gpus {
        return Err(DomainError::unsupported(format!(
            "a resize cannot change the GPUs (from {} to {}); create a new instance",
            describe_gpus(&inst.shape),
            describe_gpus(&r.shape)
        )));
    }
    if inst.state != InstanceState::Stopped || inst.desired_state != DesiredState::Stopped {
        return Err(DomainError::invalid_state(format!(
            "instance {} must be stopped to resize (state {}, desiredState {})",
            inst.id, inst.state, inst.desired_state
        )));
    }
    if inst.allocation_id.is_none() {
        return Err(DomainError::invalid_state(format!(
            "instance {} holds no allocation to resize",
            inst.id
        )));
    }
    if inst.flavor == r.flavor && inst.shape == r.shape {
        return Ok(());
    }
    // The resize passes through `resizing` inside this one decision and lands on `stopped`.
    let resizing = transition(inst.state, Verb::Resize)?;
    let to = transition(resizing, Verb::Resized)?;
    let (previous_flavor, previous_shape) = (inst.flavor.clone(), inst.shape.clone());
    d.emit(to, DesiredState::Stopped, |common| {
        InstanceEvent::Resized(Resized {
            common,
            flavor: r.flavor.clone(),
            shape: r.shape.clone(),
            previous_flavor,
            previous_shape,
        })
    })
}

fn describe_gpus(shape: &crate::resources::Shape) -> String {
    match &shape.gpus {
        Some(g) => format!("{} × {}", g.count, g.model),
        None => "none".into(),
    }
}

fn observe(d: &mut Draft, observed: Observed) -> Result<(), DomainError> {
    match d.inst.state {
        InstanceState::Lost => return recover(d, observed),
        // Not on a host yet, already failed (only `start` retries), or on its way out: a report
        // of a settled state changes nothing.
        InstanceState::Pending
        | InstanceState::Scheduling
        | InstanceState::Resizing
        | InstanceState::Error
        | InstanceState::Deleting
        | InstanceState::Deleted => return Ok(()),
        InstanceState::Provisioning
        | InstanceState::Starting
        | InstanceState::Running
        | InstanceState::Stopped
        | InstanceState::Paused
        | InstanceState::Rebooting => {}
    }
    // Any report other than a refusal ends a refusal.
    d.clear_condition(ConditionType::HostResourcesExhausted)?;
    let target = observed.as_state();
    if target != d.inst.desired_state.as_state() {
        // The host has not caught up with what is wanted yet; wait for the next report.
        return Ok(());
    }
    let path = walk(d.inst.state, target, CONVERGE_VERBS).ok_or_else(|| {
        DomainError::invalid_state(format!(
            "no way from {} to {} for instance {}",
            d.inst.state, target, d.inst.id
        ))
    })?;
    let desired = d.inst.desired_state;
    for row in path {
        let make = state_event(row.to)?;
        d.emit(row.to, desired, make)?;
    }
    for settled in [
        ConditionType::RuntimeError,
        ConditionType::ProviderError,
        ConditionType::ExhaustedHosts,
    ] {
        d.clear_condition(settled)?;
    }
    Ok(())
}

/// The event named after a state a report can walk to.
fn state_event(state: InstanceState) -> Result<fn(Common) -> InstanceEvent, DomainError> {
    match state {
        InstanceState::Starting => Ok(starting),
        InstanceState::Running => Ok(InstanceEvent::Running),
        InstanceState::Stopped => Ok(InstanceEvent::Stopped),
        InstanceState::Paused => Ok(InstanceEvent::Paused),
        other => Err(DomainError::invalid_state(format!(
            "no event announces a move to {other}"
        ))),
    }
}

fn fail(d: &mut Draft, failure: &Failure) -> Result<(), DomainError> {
    let (condition, condition_reason, event_reason, message) = match failure {
        Failure::Runtime { message } => (
            ConditionType::RuntimeError,
            "ERROR",
            "runtime-error",
            message,
        ),
        Failure::Provider { code, message } => (
            ConditionType::ProviderError,
            code.as_str(),
            code.as_str(),
            message,
        ),
    };
    match d.inst.state {
        // Already failed, or gone: a repeated report adds nothing.
        InstanceState::Error | InstanceState::Deleted => Ok(()),
        // Teardown never fails: record why it is slow and keep going.
        InstanceState::Deleting => d.set_condition(condition, condition_reason, message),
        from => {
            let to = transition(from, Verb::Fail)?;
            d.set_condition(condition, condition_reason, message)?;
            let desired = d.inst.desired_state;
            let node_id = d.inst.node_id.clone();
            d.emit(to, desired, |common| {
                InstanceEvent::Failed(Failed {
                    common,
                    reason: event_reason.to_owned(),
                    message: Some(truncate_chars(message, condition.message_cap())),
                    node_id,
                })
            })
        }
    }
}

fn resources_exhausted(d: &mut Draft, node_id: &str, message: &str) -> Result<(), DomainError> {
    if matches!(
        d.inst.state,
        InstanceState::Deleting | InstanceState::Deleted
    ) {
        return Ok(());
    }
    if d.inst.node_id.as_deref() != Some(node_id) {
        return Err(DomainError::invalid_state(format!(
            "instance {} is not placed on node {node_id}",
            d.inst.id
        )));
    }
    d.set_condition(ConditionType::HostResourcesExhausted, node_id, message)
}

fn recreate(d: &mut Draft, cause: &RecreateCause) -> Result<(), DomainError> {
    if d.inst.pool_kind != PoolKind::Hosted {
        return Err(DomainError::invalid_state(format!(
            "instance {} is in a provider pool and is never re-placed",
            d.inst.id
        )));
    }
    let from_node = d.inst.node_id.clone();
    let desired = d.inst.desired_state;
    match cause {
        RecreateCause::HostLost => {
            if d.inst.state != InstanceState::Lost {
                return Err(DomainError::invalid_state(format!(
                    "instance {} is {}, not lost",
                    d.inst.id, d.inst.state
                )));
            }
            let to = transition(d.inst.state, Verb::Recreate)?;
            d.emit(to, desired, |common| {
                InstanceEvent::Recreating(Recreating {
                    common,
                    reason: RecreateReason::HostLost,
                    from_node_id: from_node,
                    exclude_until: None,
                })
            })
        }
        RecreateCause::ResourcesExhausted { exclude_until } => {
            let inst = &d.inst;
            let movable = match inst.state {
                InstanceState::Provisioning => true,
                // Only a warm (or not yet ready sandbox) instance is moved while stopped; a
                // tenant's stopped instance stays where its disk is.
                InstanceState::Stopped => {
                    inst.warm_template_id.is_some() || inst.sandbox_id.is_some()
                }
                _ => false,
            };
            let Some(node) = from_node.filter(|_| movable) else {
                return Err(DomainError::invalid_state(format!(
                    "instance {} ({}) cannot be moved off its host",
                    inst.id, inst.state
                )));
            };
            if inst.refusals.len() >= MAX_EXHAUSTED_REPLACEMENTS {
                return give_up(d, node);
            }
            let to = transition(inst.state, Verb::Recreate)?;
            let mut hosts: Vec<String> = Vec::new();
            for refusing in inst.refusals.iter().map(|r| &r.node_id).chain([&node]) {
                if !hosts.contains(refusing) {
                    hosts.push(refusing.clone());
                }
            }
            let exclude_until = *exclude_until;
            d.emit(to, desired, |common| {
                InstanceEvent::Recreating(Recreating {
                    common,
                    reason: RecreateReason::ResourcesExhausted,
                    from_node_id: Some(node),
                    exclude_until: Some(exclude_until),
                })
            })?;
            d.clear_condition(ConditionType::HostResourcesExhausted)?;
            d.set_condition(
                ConditionType::ExhaustedHosts,
                "ResourcesExhausted",
                &hosts.join(","),
            )
        }
    }
}

/// The refusal after the last allowed re-placement fails the instance.
fn give_up(d: &mut Draft, node: String) -> Result<(), DomainError> {
    let to = transition(d.inst.state, Verb::Fail)?;
    let desired = d.inst.desired_state;
    let message = d
        .inst
        .condition(ConditionType::HostResourcesExhausted)
        .map(|c| c.message.clone());
    d.emit(to, desired, |common| {
        InstanceEvent::Failed(Failed {
            common,
            reason: "resources-exhausted".into(),
            message,
            node_id: Some(node),
        })
    })
}

fn lose(d: &mut Draft) -> Result<(), DomainError> {
    match d.inst.state {
        InstanceState::Lost | InstanceState::Deleted => Ok(()),
        // Nothing will ever report a deleting instance on a lost host gone: finish deletion.
        InstanceState::Deleting => release(d),
        from => {
            let to = transition(from, Verb::Lose)?;
            let desired = d.inst.desired_state;
            let (node_id, external_id) = (d.inst.node_id.clone(), d.inst.external_id.clone());
            d.emit(to, desired, |common| {
                InstanceEvent::Lost(Lost {
                    common,
                    node_id,
                    external_id,
                })
            })
        }
    }
}

fn recover(d: &mut Draft, observed: Observed) -> Result<(), DomainError> {
    if d.inst.state != InstanceState::Lost {
        return Err(DomainError::invalid_state(format!(
            "instance {} is {}, not lost",
            d.inst.id, d.inst.state
        )));
    }
    let to = transition_to(d.inst.state, Verb::Recover, observed.as_state())?;
    let desired = d.inst.desired_state;
    d.emit(to, desired, InstanceEvent::Recovered)
}

fn release(d: &mut Draft) -> Result<(), DomainError> {
    if d.inst.state == InstanceState::Deleted {
        return Ok(());
    }
    let to = transition(d.inst.state, Verb::Release)?;
    d.emit(to, DesiredState::Deleted, InstanceEvent::Deleted)
}

/// The most SSH keys one instance takes.
pub const MAX_SSH_KEYS: usize = 32;

/// The longest idempotency key, in bytes.
pub const MAX_IDEMPOTENCY_KEY: usize = 200;

/// Checks a create's own fields (not whether the pool, flavor or image exist).
pub(super) fn check_create_request(c: &CreateInstance) -> Result<(), DomainError> {
    if !ids::is_valid_id(prefix::INSTANCE, &c.id) {
        return Err(DomainError::invalid_input(
            "id",
            format!("{:?} is not an instance id", c.id),
        ));
    }
    for (field, value) in [
        ("tenantId", &c.tenant_id),
        ("poolId", &c.pool_id),
        ("flavor", &c.flavor),
        ("imageId", &c.image_id),
        ("idempotencyKey", &c.idempotency_key),
        ("ownerIdentityId", &c.owner_identity_id),
    ] {
        if value.trim().is_empty() {
            return Err(DomainError::invalid_input(field, "must not be empty"));
        }
    }
    crate::labels::check("labels", &c.labels)?;
    if c.idempotency_key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(DomainError::invalid_input(
            "idempotencyKey",
            format!("1 to {MAX_IDEMPOTENCY_KEY} characters"),
        ));
    }
    match c.desired_state {
        DesiredState::Running | DesiredState::Stopped => {}
        DesiredState::Paused if c.warm_template_id.is_some() => {}
        _ => {
            return Err(DomainError::invalid_input(
                "desiredState",
                "running or stopped",
            ))
        }
    }
    if c.sandbox_id.is_some() && c.warm_template_id.is_some() {
        return Err(DomainError::invalid_input(
            "sandboxId",
            "an instance belongs to a sandbox or is a warm instance of a template, never both",
        ));
    }
    if c.ssh_keys.len() > MAX_SSH_KEYS {
        return Err(DomainError::invalid_input(
            "sshKeys",
            format!("at most {MAX_SSH_KEYS} keys"),
        ));
    }
    for (i, key) in c.ssh_keys.iter().enumerate() {
        validate_ssh_public_key(key).map_err(|e| match e {
            DomainError::InvalidInput { message, .. } => {
                DomainError::invalid_input(format!("sshKeys[{i}]"), message)
            }
            other => other,
        })?;
    }
    Ok(())
}
