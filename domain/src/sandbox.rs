//! The sandbox aggregate (stream `sandbox-<id>`): a short-lived hosted instance made from a
//! template, with a lifetime. Its `state` moves only along [`TABLE`]; the instance behind it is
//! an ordinary instance (with `sandboxId` set), changed through the instance aggregate.

mod event;
pub mod exec;
pub mod fork;
pub mod preview;
pub mod snapshot;
#[cfg(test)]
mod tests;

use std::collections::BTreeMap;

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::labels::Labels;

pub use event::{
    ExpiryAction, Lifecycle, SandboxCreated, SandboxDeleted, SandboxEvent, SandboxExecIssued,
    SandboxExpiry, SandboxExposed, SandboxFailed, SandboxForked, SandboxLabeled, SandboxReady,
    SandboxUnexposed, SnapshotFailed, SnapshotReady, SnapshotRef, SnapshotRequested,
};
pub use snapshot::{Snapshot, SnapshotState};

/// The longest single extension: 30 days.
pub const MAX_EXTENSION: TimeDelta = TimeDelta::days(30);
/// Longest idempotency key.
pub const MAX_IDEMPOTENCY_KEY: usize = 256;

/// Where a sandbox is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum SandboxState {
    /// Its instance has not run yet.
    Starting,
    /// Its instance ran.
    Ready,
    /// Its instance failed; it ends with its lifetime or a delete.
    Failed,
    /// Its instance is being deleted.
    Deleting,
    /// Its instance is gone.
    Deleted,
    /// Its instance is asked to pause (memory kept); its lifetime clock has stopped.
    Pausing,
    /// Its instance is paused; it ends at `expiresAt` (`pausedTtlSeconds`) unless resumed.
    Paused,
    /// Its instance is asked to run again, with a fresh lifetime.
    Resuming,
}

impl SandboxState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            SandboxState::Starting => "starting",
            SandboxState::Ready => "ready",
            SandboxState::Failed => "failed",
            SandboxState::Deleting => "deleting",
            SandboxState::Deleted => "deleted",
            SandboxState::Pausing => "pausing",
            SandboxState::Paused => "paused",
            SandboxState::Resuming => "resuming",
        }
    }

    /// Every state, in table order.
    pub const ALL: [SandboxState; 8] = [
        SandboxState::Starting,
        SandboxState::Ready,
        SandboxState::Failed,
        SandboxState::Pausing,
        SandboxState::Paused,
        SandboxState::Resuming,
        SandboxState::Deleting,
        SandboxState::Deleted,
    ];

    /// Not deleting or deleted.
    pub fn is_open(self) -> bool {
        !matches!(self, SandboxState::Deleting | SandboxState::Deleted)
    }

    /// Pausing or paused: its lifetime clock is stopped.
    pub fn is_paused(self) -> bool {
        matches!(self, SandboxState::Pausing | SandboxState::Paused)
    }
}

impl std::fmt::Display for SandboxState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What a sandbox's lifetime ending does (`onTimeout`).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum OnTimeout {
    /// Delete it (the default).
    #[default]
    Delete,
    /// Pause it (memory kept); `sandboxes.resume` brings it back.
    Pause,
}

/// An optional `onTimeout` field of a request, its errors naming the field (a flattened
/// struct's errors reach the parser without their path).
pub fn on_timeout_field<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<OnTimeout>, D::Error> {
    Option::<OnTimeout>::deserialize(d).map_err(|e| crate::bounds::in_field("onTimeout", e))
}

impl OnTimeout {
    /// Whether it is the default (left out of events and documents).
    pub fn is_delete(&self) -> bool {
        *self == OnTimeout::Delete
    }
}

/// What moves a sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verb {
    /// Its instance ran.
    Ready,
    /// Its instance failed.
    Fail,
    /// Deletion began (a delete, an expiry).
    Delete,
    /// Its instance is gone.
    Release,
    /// `sandboxes.pause`, or an expiry with `onTimeout: pause`.
    Pause,
    /// Its instance paused.
    Paused,
    /// `sandboxes.resume`.
    Resume,
    /// Its instance runs again.
    Resumed,
}

impl Verb {
    /// The name the state table's rendering uses.
    pub fn as_str(self) -> &'static str {
        match self {
            Verb::Ready => "ready",
            Verb::Fail => "fail",
            Verb::Delete => "delete",
            Verb::Release => "release",
            Verb::Pause => "pause",
            Verb::Paused => "paused",
            Verb::Resume => "resume",
            Verb::Resumed => "resumed",
        }
    }
}

/// Every legal move: (from, verb, to).
pub const TABLE: &[(SandboxState, Verb, SandboxState)] = {
    use SandboxState::*;
    &[
        (Starting, Verb::Ready, Ready),
        (Failed, Verb::Ready, Ready),
        (Starting, Verb::Pause, Pausing),
        (Ready, Verb::Pause, Pausing),
        (Resuming, Verb::Pause, Pausing),
        (Pausing, Verb::Paused, Paused),
        (Pausing, Verb::Resume, Resuming),
        (Paused, Verb::Resume, Resuming),
        (Resuming, Verb::Resumed, Ready),
        (Starting, Verb::Fail, Failed),
        (Ready, Verb::Fail, Failed),
        (Pausing, Verb::Fail, Failed),
        (Paused, Verb::Fail, Failed),
        (Resuming, Verb::Fail, Failed),
        (Starting, Verb::Delete, Deleting),
        (Ready, Verb::Delete, Deleting),
        (Failed, Verb::Delete, Deleting),
        (Pausing, Verb::Delete, Deleting),
        (Paused, Verb::Delete, Deleting),
        (Resuming, Verb::Delete, Deleting),
        (Starting, Verb::Release, Deleted),
        (Ready, Verb::Release, Deleted),
        (Failed, Verb::Release, Deleted),
        (Pausing, Verb::Release, Deleted),
        (Paused, Verb::Release, Deleted),
        (Resuming, Verb::Release, Deleted),
        (Deleting, Verb::Release, Deleted),
    ]
};

/// The sandbox table as a Mermaid `stateDiagram-v2`, one edge per row labelled with its verb.
pub fn render_mermaid() -> String {
    let mut out = String::from("stateDiagram-v2\n    [*] --> starting\n");
    for (from, verb, to) in TABLE {
        out.push_str(&format!("    {from} --> {to}: {}\n", verb.as_str()));
    }
    out.push_str("    deleted --> [*]\n");
    out
}

/// Where `verb` takes a sandbox in `from`, or `INVALID_STATE`.
pub fn transition(from: SandboxState, verb: Verb) -> Result<SandboxState, DomainError> {
    crate::state_table::step(TABLE, from, verb, || format!("a {} sandbox", from.as_str()))
}

/// A sandbox as its events leave it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    /// `sbx_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Its template.
    pub template_id: String,
    /// The instance it drives.
    pub instance_id: String,
    /// The instance's pool.
    pub pool_id: String,
    /// Where it is.
    pub state: SandboxState,
    /// Whether a warm instance was claimed for it.
    pub warm: bool,
    /// Who made it.
    pub owner_identity_id: String,
    /// The create's idempotency key.
    pub idempotency_key: String,
    /// Hash of the create request, for replay vs `CONFLICT`.
    pub request_hash: String,
    /// When it was admitted (the lifetime counts from here).
    pub created_at: DateTime<Utc>,
    /// When its instance first ran.
    pub ready_at: Option<DateTime<Utc>>,
    /// When it ends.
    pub expires_at: DateTime<Utc>,
    /// `sandbox.expiring` was published for the current `expiresAt`.
    pub expiring_sent: bool,
    /// Its lifetime ended it.
    pub expired: bool,
    /// When it was deleted.
    pub deleted_at: Option<DateTime<Utc>>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Events folded.
    pub version: u64,
    /// A restore: the snapshot it was made from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_snapshot: Option<String>,
    /// What the end of its lifetime does.
    #[serde(default, skip_serializing_if = "OnTimeout::is_delete")]
    pub on_timeout: OnTimeout,
    /// When its current lifetime began: admission, or the last resume.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lifetime_from: Option<DateTime<Utc>>,
    /// When it was last asked to pause (while pausing or paused).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub paused_at: Option<DateTime<Utc>>,
    /// Why it ended, when not a plain delete (`ttl`, `paused-ttl`, `idle`,
    /// `deadline:<state>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Why it is pausing or paused when nobody asked (`idle`); `sandbox.paused` repeats it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pause_reason: Option<String>,
    /// Its labels.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    /// When it entered its current state (`None`: at creation).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_since: Option<DateTime<Utc>>,
    /// Its snapshots, by id (deleted ones too, until the log is compacted: never). The fold
    /// holds them; the `sandboxes` projection's document does not (they have their own rows).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub snapshots: BTreeMap<String, Snapshot>,
    /// Its exposed ports and when each preview URL ends (`sandboxes.expose`); a revoked one
    /// is gone, an ended one stays until it is exposed again or revoked.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub exposures: BTreeMap<u16, DateTime<Utc>>,
    /// Its forks by idempotency key: the sandboxes each one made (`sandboxes.fork`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub forks: BTreeMap<String, Vec<String>>,
}

impl Sandbox {
    /// The ids every lifecycle event carries.
    pub fn lifecycle(&self) -> Lifecycle {
        Lifecycle {
            sandbox_id: self.id.clone(),
            tenant_id: self.tenant_id.clone(),
            template_id: self.template_id.clone(),
            instance_id: self.instance_id.clone(),
            pool_id: self.pool_id.clone(),
        }
    }

    /// What `compute:sandboxes:*` decides on for this sandbox with a lifetime of
    /// `ttl_seconds` (the current one, or an extend's new one) and its instance's `shape`.
    pub fn draft(
        &self,
        shape: Option<&crate::resources::Shape>,
        ttl_seconds: i64,
    ) -> crate::authz::SandboxDraft {
        crate::authz::SandboxDraft {
            template_id: self.template_id.clone(),
            ttl_seconds,
            warm: self.warm,
            vcpu: shape.map_or(0, |x| x.vcpu),
            memory_gib: shape.map_or(0, |x| x.memory_gib),
            gpus: shape.and_then(|x| x.gpus.as_ref()).map_or(0, |g| g.count),
            disk_gib: shape.map_or(0, |x| x.disk_gib),
            from_snapshot: None,
            labels: self.labels.clone(),
        }
    }

    /// When the running clock began: the pause (while paused), else the current lifetime's
    /// start (admission, or the last resume).
    pub fn clock_from(&self) -> DateTime<Utc> {
        match self.paused_at {
            Some(p) if self.state.is_paused() => p,
            _ => self.lifetime_from.unwrap_or(self.created_at),
        }
    }

    /// Its whole lifetime so far, from [`Sandbox::clock_from`] to `expiresAt`.
    pub fn lifetime(&self) -> TimeDelta {
        self.expires_at - self.clock_from()
    }
}

impl Aggregate for Sandbox {
    type Event = SandboxEvent;
    const CATEGORY: &'static str = "sandbox";

    fn create(event: &SandboxEvent, at: DateTime<Utc>) -> Option<Self> {
        match event {
            SandboxEvent::Created(c) => Some(from_created(c, at)),
            _ => None,
        }
    }

    fn apply(&mut self, event: &SandboxEvent, at: DateTime<Utc>) {
        let before = self.state;
        self.apply_event(event, at);
        if self.state != before {
            self.state_since = Some(at);
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

impl Sandbox {
    fn apply_event(&mut self, event: &SandboxEvent, at: DateTime<Utc>) {
        match event {
            SandboxEvent::Created(_) => {}
            SandboxEvent::Ready(_) => {
                self.state = SandboxState::Ready;
                self.ready_at.get_or_insert(at);
            }
            SandboxEvent::Failed(f) => {
                self.state = SandboxState::Failed;
                self.reason = Some(f.reason.clone());
            }
            SandboxEvent::Extended(e) => {
                self.expires_at = e.expires_at;
                self.expiring_sent = false;
            }
            SandboxEvent::Expiring(_) => self.expiring_sent = true,
            SandboxEvent::Expired(e) => {
                if e.action != Some(ExpiryAction::Paused) {
                    self.state = SandboxState::Deleting;
                    self.expired = true;
                    self.reason.clone_from(&e.reason);
                }
            }
            SandboxEvent::Pausing(e) => {
                self.state = SandboxState::Pausing;
                self.expires_at = e.expires_at;
                self.paused_at = Some(at);
                self.expiring_sent = false;
                self.pause_reason.clone_from(&e.reason);
            }
            SandboxEvent::Paused(_) => self.state = SandboxState::Paused,
            SandboxEvent::Resuming(e) => {
                self.state = SandboxState::Resuming;
                self.expires_at = e.expires_at;
                self.lifetime_from = Some(at);
                self.paused_at = None;
                self.expiring_sent = false;
                self.pause_reason = None;
            }
            SandboxEvent::Resumed(_) => self.state = SandboxState::Ready,
            SandboxEvent::Labeled(e) => self.labels.clone_from(&e.labels),
            SandboxEvent::Deleting(_) => self.state = SandboxState::Deleting,
            SandboxEvent::Deleted(_) => {
                self.state = SandboxState::Deleted;
                self.deleted_at = Some(at);
            }
            SandboxEvent::SnapshotRequested(_)
            | SandboxEvent::SnapshotReady(_)
            | SandboxEvent::SnapshotFailed(_)
            | SandboxEvent::SnapshotDeleted(_)
            | SandboxEvent::SnapshotPurged(_) => snapshot::evolve(self, event, at),
            // Entering a sandbox changes nothing about it: only the stream moves on.
            SandboxEvent::ExecIssued(_) => return,
            SandboxEvent::Exposed(e) => {
                self.exposures.insert(e.port, e.expires_at);
            }
            SandboxEvent::Unexposed(e) => {
                self.exposures.remove(&e.port);
            }
            SandboxEvent::Forked(e) => {
                self.forks
                    .insert(e.idempotency_key.clone(), e.sandbox_ids.clone());
            }
        }
        self.updated_at = at;
    }

    /// When it entered its current state.
    pub fn in_state_since(&self) -> DateTime<Utc> {
        self.state_since.unwrap_or(self.created_at)
    }

    /// Whether a deadline failed it (it stays `failed`, its instance released).
    pub fn failed_by_deadline(&self) -> bool {
        self.state == SandboxState::Failed
            && self
                .reason
                .as_deref()
                .is_some_and(|r| r.starts_with("deadline:"))
    }
}

/// How long a sandbox may stay in each transitional state (`[timings]
/// deadline_sandbox_<state>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    /// `starting`.
    pub starting: TimeDelta,
    /// `pausing`.
    pub pausing: TimeDelta,
    /// `resuming`.
    pub resuming: TimeDelta,
}

/// Decides a passed deadline at `now`: a sandbox that has stood in `starting`, `pausing` or
/// `resuming` longer than its deadline fails (`sandbox.failed`, `reason: deadline:<state>`);
/// the caller releases its instance.
pub fn deadline(s: &Sandbox, now: DateTime<Utc>, d: &Deadlines) -> Vec<SandboxEvent> {
    let limit = match s.state {
        SandboxState::Starting => d.starting,
        SandboxState::Pausing => d.pausing,
        SandboxState::Resuming => d.resuming,
        _ => return Vec::new(),
    };
    if now - s.in_state_since() < limit {
        return Vec::new();
    }
    fail(s, &format!("deadline:{}", s.state))
}

fn from_created(c: &SandboxCreated, at: DateTime<Utc>) -> Sandbox {
    Sandbox {
        id: c.ids.sandbox_id.clone(),
        tenant_id: c.ids.tenant_id.clone(),
        template_id: c.ids.template_id.clone(),
        instance_id: c.ids.instance_id.clone(),
        pool_id: c.ids.pool_id.clone(),
        state: SandboxState::Starting,
        warm: c.warm,
        owner_identity_id: c.owner_identity_id.clone(),
        idempotency_key: c.idempotency_key.clone(),
        request_hash: c.request_hash.clone(),
        created_at: at,
        ready_at: None,
        expires_at: c.expires_at,
        expiring_sent: false,
        expired: false,
        deleted_at: None,
        updated_at: at,
        version: 1,
        from_snapshot: c.from_snapshot.clone(),
        on_timeout: c.on_timeout,
        lifetime_from: None,
        paused_at: None,
        reason: None,
        pause_reason: None,
        labels: c.labels.clone(),
        state_since: None,
        snapshots: BTreeMap::new(),
        exposures: BTreeMap::new(),
        forks: BTreeMap::new(),
    }
}

/// The request part of `sandboxes.create` a decision needs.
#[derive(Debug, Clone)]
pub struct CreateSandbox {
    /// The derived id.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The template.
    pub template_id: String,
    /// The lifetime asked for (`None`: the template's default).
    pub ttl_seconds: Option<u64>,
    /// The key.
    pub idempotency_key: String,
    /// Hash of the request.
    pub request_hash: String,
    /// Who asks.
    pub owner_identity_id: String,
    /// A restore: the snapshot to boot from.
    pub from_snapshot: Option<String>,
    /// What the end of its lifetime does (`None`: the template's).
    pub on_timeout: Option<OnTimeout>,
    /// Its labels (checked by [`admit`]).
    pub labels: Labels,
}

/// Answers a create whose key already made `existing`: that sandbox when the request is the
/// same, `CONFLICT` when it differs.
pub fn replay(existing: &Sandbox, c: &CreateSandbox) -> Result<Sandbox, DomainError> {
    check_key(c)?;
    if existing.request_hash == c.request_hash {
        return Ok(existing.clone());
    }
    Err(DomainError::conflict(
        format!(
            "idempotency key already used for a different request (sandbox {})",
            existing.id
        ),
        "sandboxId",
        existing.id.clone(),
    ))
}

/// Checks a create that makes a new sandbox (its key made none yet) against the template's
/// lifetime bounds (`default_ttl`, `max_ttl`); answers the seconds it lives from admission.
pub fn admit(c: &CreateSandbox, default_ttl: u64, max_ttl: u64) -> Result<u64, DomainError> {
    check_key(c)?;
    crate::labels::check("labels", &c.labels)?;
    let ttl_seconds = c.ttl_seconds.unwrap_or(default_ttl);
    if ttl_seconds == 0 || ttl_seconds > max_ttl {
        return Err(DomainError::invalid_input(
            "ttlSeconds",
            format!("1 to the template's maxTtlSeconds ({max_ttl})"),
        ));
    }
    Ok(ttl_seconds)
}

fn check_key(c: &CreateSandbox) -> Result<(), DomainError> {
    if c.idempotency_key.trim().is_empty() || c.idempotency_key.len() > MAX_IDEMPOTENCY_KEY {
        return Err(DomainError::invalid_input(
            "idempotencyKey",
            format!("1 to {MAX_IDEMPOTENCY_KEY} characters"),
        ));
    }
    Ok(())
}

/// The `sandbox.created` event of an admitted create.
pub fn created_event(
    c: &CreateSandbox,
    ids: Lifecycle,
    warm: bool,
    ttl_seconds: u64,
    now: DateTime<Utc>,
) -> SandboxEvent {
    SandboxEvent::Created(SandboxCreated {
        ids,
        warm,
        ttl_seconds,
        expires_at: now + TimeDelta::seconds(ttl_seconds as i64),
        owner_identity_id: c.owner_identity_id.clone(),
        idempotency_key: c.idempotency_key.clone(),
        request_hash: c.request_hash.clone(),
        from_snapshot: c.from_snapshot.clone(),
        on_timeout: c.on_timeout.unwrap_or_default(),
        labels: c.labels.clone(),
    })
}

/// Decides `sandboxes.setLabels`: the labels replace the sandbox's (`sandbox.labeled`); the
/// same labels decide nothing. A deleted sandbox is `INVALID_STATE`.
pub fn set_labels(s: &Sandbox, labels: Labels) -> Result<Vec<SandboxEvent>, DomainError> {
    crate::labels::check("labels", &labels)?;
    if s.state == SandboxState::Deleted {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is deleted",
            s.id
        )));
    }
    if s.labels == labels {
        return Ok(Vec::new());
    }
    Ok(vec![SandboxEvent::Labeled(event::SandboxLabeled {
        ids: s.lifecycle(),
        labels,
    })])
}

/// How an extend moves the expiry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Extension {
    /// To this time.
    Until(DateTime<Utc>),
    /// Later by this much.
    By(TimeDelta),
}

/// The expiry an extend asks for, checked against the template's `max_ttl` (seconds) and the
/// 30-day cap. `None`: nothing to do (an `until` not later than the current expiry).
pub fn extended_expiry(
    s: &Sandbox,
    extension: Extension,
    max_ttl: u64,
) -> Result<Option<DateTime<Utc>>, DomainError> {
    if !s.state.is_open() {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is {}",
            s.id,
            s.state.as_str()
        )));
    }
    if s.state.is_paused() {
        return Err(paused_refusal(s, "extend"));
    }
    let (field, until) = match extension {
        Extension::Until(t) if t <= s.expires_at => return Ok(None),
        Extension::Until(t) => ("until", t),
        Extension::By(d) if d <= TimeDelta::zero() => {
            return Err(DomainError::invalid_input("by", "must be positive"))
        }
        Extension::By(d) if d > MAX_EXTENSION => {
            return Err(DomainError::invalid_input(
                "by",
                "at most 30 days per extend",
            ))
        }
        Extension::By(d) => ("by", s.expires_at + d),
    };
    if until - s.expires_at > MAX_EXTENSION {
        return Err(DomainError::invalid_input(
            field,
            "at most 30 days per extend",
        ));
    }
    if until - s.clock_from() > TimeDelta::seconds(max_ttl as i64) {
        return Err(DomainError::invalid_input(
            field,
            format!("the lifetime would exceed the template's maxTtlSeconds ({max_ttl})"),
        ));
    }
    Ok(Some(until))
}

/// Decides an extend to `until` (already checked by [`extended_expiry`]).
pub fn extend(s: &Sandbox, until: DateTime<Utc>) -> Vec<SandboxEvent> {
    vec![SandboxEvent::Extended(SandboxExpiry::new(
        s.lifecycle(),
        until,
    ))]
}

/// `INVALID_STATE` for a call a paused sandbox cannot take (`details.state`: its state).
pub fn paused_refusal(s: &Sandbox, call: &str) -> DomainError {
    DomainError::InvalidState {
        message: format!(
            "sandbox {} is {}; resume it before {call} (sandboxes.resume), or set the \
             template's autoResume",
            s.id,
            s.state.as_str()
        ),
        details: serde_json::json!({ "state": s.state.as_str(), "sandboxId": s.id }),
    }
}

/// Default `pausedTtlSeconds`: 7 days.
pub const DEFAULT_PAUSED_TTL_SECONDS: u64 = 7 * 86_400;
/// The longest `pausedTtlSeconds`: 30 days.
pub const MAX_PAUSED_TTL_SECONDS: u64 = 30 * 86_400;

/// Decides `sandboxes.pause` at `now`: the sandbox becomes `pausing` and its lifetime clock
/// stops; it ends `paused_ttl` later unless resumed. Idempotent: a pausing or paused sandbox
/// decides nothing. `UNSUPPORTED` when its runtime cannot pause.
pub fn pause(
    s: &Sandbox,
    can_pause: bool,
    paused_ttl: u64,
    now: DateTime<Utc>,
) -> Result<Vec<SandboxEvent>, DomainError> {
    if s.state.is_paused() {
        return Ok(Vec::new());
    }
    transition(s.state, Verb::Pause)?;
    if !can_pause {
        return Err(DomainError::unsupported(format!(
            "sandbox {}'s runtime cannot pause a guest",
            s.id
        )));
    }
    Ok(vec![SandboxEvent::Pausing(SandboxExpiry::new(
        s.lifecycle(),
        now + TimeDelta::seconds(paused_ttl as i64),
    ))])
}

/// The lifetime a resume gives: `ttl_seconds`, else the template's default, within
/// 1..=`max_ttl`.
pub fn resume_ttl(
    ttl_seconds: Option<u64>,
    default_ttl: u64,
    max_ttl: u64,
) -> Result<u64, DomainError> {
    let ttl = ttl_seconds.unwrap_or(default_ttl.min(max_ttl));
    if ttl == 0 || ttl > max_ttl {
        return Err(DomainError::invalid_input(
            "ttlSeconds",
            format!("1 to the template's maxTtlSeconds ({max_ttl})"),
        ));
    }
    Ok(ttl)
}

/// Decides `sandboxes.resume` at `now` with a fresh lifetime of `ttl` seconds. Idempotent: a
/// ready or resuming sandbox decides nothing; a deleted one is `INVALID_STATE`.
pub fn resume(s: &Sandbox, ttl: u64, now: DateTime<Utc>) -> Result<Vec<SandboxEvent>, DomainError> {
    if matches!(s.state, SandboxState::Ready | SandboxState::Resuming) {
        return Ok(Vec::new());
    }
    transition(s.state, Verb::Resume)?;
    Ok(vec![SandboxEvent::Resuming(SandboxExpiry::new(
        s.lifecycle(),
        now + TimeDelta::seconds(ttl as i64),
    ))])
}

/// Decides `sandbox.paused` once its instance paused (nothing unless it is pausing).
pub fn paused(s: &Sandbox) -> Vec<SandboxEvent> {
    if s.state != SandboxState::Pausing {
        return Vec::new();
    }
    vec![SandboxEvent::Paused(SandboxExpiry {
        reason: s.pause_reason.clone(),
        ..SandboxExpiry::new(s.lifecycle(), s.expires_at)
    })]
}

/// What ends an idle sandbox (`idleTimeoutSeconds`), as the expiry's `reason`.
pub const IDLE: &str = "idle";

/// Decides an idle sandbox at `now`: a ready one whose lifetime ends in a pause
/// (`onTimeout: pause`) is paused for `paused_ttl` (`sandbox.pausing`, then `sandbox.paused`,
/// with `reason: idle`); one that ends in a delete, or whose runtime cannot pause
/// (`paused_ttl` `None`), is expired (`sandbox.expired`, `action: deleted`, `reason: idle`).
/// Anything but a ready sandbox decides nothing.
pub fn idle(s: &Sandbox, now: DateTime<Utc>, paused_ttl: Option<TimeDelta>) -> Vec<SandboxEvent> {
    if s.state != SandboxState::Ready {
        return Vec::new();
    }
    let reason = Some(IDLE.to_string());
    match paused_ttl.filter(|_| s.on_timeout == OnTimeout::Pause) {
        Some(ttl) => vec![SandboxEvent::Pausing(SandboxExpiry {
            reason,
            ..SandboxExpiry::new(s.lifecycle(), now + ttl)
        })],
        None => vec![SandboxEvent::Expired(SandboxExpiry {
            action: Some(ExpiryAction::Deleted),
            reason,
            ..SandboxExpiry::new(s.lifecycle(), s.expires_at)
        })],
    }
}

/// Decides `sandbox.ready` once its instance runs (nothing when it already is or is ending);
/// a resuming sandbox is `sandbox.resumed` instead.
pub fn ready(s: &Sandbox) -> Vec<SandboxEvent> {
    if s.state == SandboxState::Resuming {
        return vec![SandboxEvent::Resumed(SandboxExpiry::new(
            s.lifecycle(),
            s.expires_at,
        ))];
    }
    match transition(s.state, Verb::Ready) {
        Ok(_) if s.state != SandboxState::Ready => vec![SandboxEvent::Ready(SandboxReady {
            ids: s.lifecycle(),
            warm: s.warm,
        })],
        _ => Vec::new(),
    }
}

/// Decides `sandbox.failed` when its instance failed.
pub fn fail(s: &Sandbox, reason: &str) -> Vec<SandboxEvent> {
    match transition(s.state, Verb::Fail) {
        Ok(_) => vec![SandboxEvent::Failed(SandboxFailed {
            ids: s.lifecycle(),
            reason: reason.to_string(),
        })],
        Err(_) => Vec::new(),
    }
}

/// Decides a delete: idempotent.
pub fn delete(s: &Sandbox) -> Vec<SandboxEvent> {
    match transition(s.state, Verb::Delete) {
        Ok(_) => vec![SandboxEvent::Deleting(s.lifecycle())],
        Err(_) => Vec::new(),
    }
}

/// Decides the end: its instance is gone, and its snapshots that are not kept go with it. A
/// sandbox a deadline failed stays `failed` (its instance was released on purpose) until a
/// delete or its expiry.
pub fn deleted(s: &Sandbox) -> Vec<SandboxEvent> {
    if s.failed_by_deadline() {
        return Vec::new();
    }
    match transition(s.state, Verb::Release) {
        Ok(_) => {
            let mut events = vec![SandboxEvent::Deleted(SandboxDeleted {
                ids: s.lifecycle(),
                expired: s.expired,
                reason: s.reason.clone(),
            })];
            events.extend(snapshot::delete_unkept(s));
            events
        }
        Err(_) => Vec::new(),
    }
}

/// How long before `expiresAt` a sandbox is warned: `lead`, or a quarter of its lifetime when
/// that is shorter, never under `min_lead` and never more than the lifetime.
pub fn expiring_lead(lifetime: TimeDelta, lead: TimeDelta, min_lead: TimeDelta) -> TimeDelta {
    lead.min(lifetime / 4).max(min_lead).min(lifetime)
}

/// Decides the expiry work due at `now`: `sandbox.expiring` once per expiry, `sandbox.expired`
/// once it has passed. A paused sandbox's end is its `pausedTtlSeconds` running out (deleted,
/// `reason: paused-ttl`); a running one's is its lifetime: deleted, or with `onTimeout: pause`
/// (and a runtime that can pause) paused for `paused_ttl` (`data.action: paused`).
pub fn expiry(
    s: &Sandbox,
    now: DateTime<Utc>,
    lead: TimeDelta,
    min_lead: TimeDelta,
    paused_ttl: Option<TimeDelta>,
) -> Vec<SandboxEvent> {
    if !s.state.is_open() {
        return Vec::new();
    }
    let at = SandboxExpiry::new(s.lifecycle(), s.expires_at);
    if now >= s.expires_at {
        let pause_for = paused_ttl.filter(|_| {
            s.on_timeout == OnTimeout::Pause
                && matches!(
                    s.state,
                    SandboxState::Starting | SandboxState::Ready | SandboxState::Resuming
                )
        });
        if let Some(ttl) = pause_for {
            return vec![
                SandboxEvent::Expired(SandboxExpiry {
                    action: Some(ExpiryAction::Paused),
                    reason: Some("ttl".into()),
                    ..at
                }),
                SandboxEvent::Pausing(SandboxExpiry::new(s.lifecycle(), now + ttl)),
            ];
        }
        let reason = if s.state.is_paused() {
            "paused-ttl"
        } else {
            "ttl"
        };
        return vec![SandboxEvent::Expired(SandboxExpiry {
            action: Some(ExpiryAction::Deleted),
            reason: Some(reason.into()),
            ..at
        })];
    }
    let warn_from = s.expires_at - expiring_lead(s.lifetime(), lead, min_lead);
    if !s.expiring_sent && now >= warn_from {
        return vec![SandboxEvent::Expiring(at)];
    }
    Vec::new()
}

/// Parses a duration: `30s`, `15m`, `8h`, `7d`, or a number of milliseconds.
pub fn parse_duration(text: &str) -> Result<TimeDelta, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: i64 = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a duration like 30m, 8h or 7d"))?;
    let delta = match unit {
        "" | "ms" => TimeDelta::try_milliseconds(n),
        "s" => TimeDelta::try_seconds(n),
        "m" => TimeDelta::try_minutes(n),
        "h" => TimeDelta::try_hours(n),
        "d" => TimeDelta::try_days(n),
        _ => None,
    };
    delta.ok_or_else(|| format!("{text:?} is not a duration like 30m, 8h or 7d"))
}
