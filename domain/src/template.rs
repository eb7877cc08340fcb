//! The sandbox template aggregate (stream `template-<id>`): what a tenant's sandboxes run, their
//! lifetime bounds, their warm pool and the volumes they attach. `version` rises with every
//! update; `instance_version` only with a change to what the guest runs (flavor, image, user
//! data, env, network, volumes), so warm instances of an older shape are never claimed and get
//! drained.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::instance::{AdmissionPool, PoolKind};
use crate::operator::{check_name, check_name_free};

use crate::labels::Labels;
pub use crate::network_policy::{Network, NetworkRules, NetworkSetting};
pub use crate::sandbox::OnTimeout;

/// Default `defaultTtlSeconds`.
pub const DEFAULT_TTL_SECONDS: u64 = 3600;
/// Default `maxTtlSeconds`.
pub const DEFAULT_MAX_TTL_SECONDS: u64 = 86_400;
/// The longest lifetime a template may allow: 30 days.
pub const MAX_TTL_LIMIT: u64 = 30 * 86_400;
/// The largest warm pool a template may keep.
pub const MAX_WARM: u32 = 100;
/// Runtimes that can pause a booted guest: their warm instances wait `paused`, the others
/// `stopped`.
pub const PAUSING_RUNTIMES: &[&str] = &["libvirt-kvm", "cloud-hypervisor", "firecracker", "qemu"];
/// Most `env` entries.
pub const MAX_ENV: usize = 64;

/// A warm pool's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Warm {
    /// Settled instances kept ready.
    pub min: u32,
    /// At most this many.
    pub max: u32,
}

/// What a template makes: everything `update` may change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateSpec {
    /// The flavor's name in the pool.
    pub flavor: String,
    /// The image.
    pub image_id: String,
    /// The sealed user data's reference, when the template has user data.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_data_ref: Option<String>,
    /// `NAME` → `secret://…` reference (never a value).
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// What the guest may reach.
    pub network: Network,
    /// The allow-list and bounds beside `network` (absent: none, the host's default bounds).
    #[serde(default, skip_serializing_if = "NetworkRules::is_empty")]
    pub network_rules: NetworkRules,
    /// A sandbox's lifetime when the create names none.
    pub default_ttl_seconds: u64,
    /// The longest lifetime, extensions included.
    pub max_ttl_seconds: u64,
    /// The warm pool, when the template keeps one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warm: Option<Warm>,
    /// The volumes its sandboxes attach, resolved when the template was written.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub volumes: Vec<crate::volume::TemplateVolume>,
    /// How long a paused sandbox is kept before it is deleted (`reason: paused-ttl`).
    #[serde(default = "default_paused_ttl")]
    pub paused_ttl_seconds: u64,
    /// What the end of a sandbox's lifetime does when its create names nothing.
    #[serde(default, skip_serializing_if = "OnTimeout::is_delete")]
    pub on_timeout: OnTimeout,
    /// `exec` and `snapshot` on a paused sandbox resume it first instead of refusing.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub auto_resume: bool,
    /// A ready sandbox idle this long is paused (or, with `onTimeout: delete`, expired);
    /// `None`: never.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub idle_timeout_seconds: Option<u64>,
    /// Below this share of one vCPU its guest counts as idle.
    #[serde(default, skip_serializing_if = "CpuPercent::is_default")]
    pub idle_cpu_percent: CpuPercent,
}

fn default_paused_ttl() -> u64 {
    crate::sandbox::DEFAULT_PAUSED_TTL_SECONDS
}

/// The shortest `idleTimeoutSeconds`: a minute.
pub const MIN_IDLE_TIMEOUT_SECONDS: u64 = 60;
/// The longest `idleTimeoutSeconds`: 7 days.
pub const MAX_IDLE_TIMEOUT_SECONDS: u64 = 7 * 86_400;
/// The smallest `idleCpuPercent`.
pub const MIN_IDLE_CPU_PERCENT: f64 = 0.1;
/// The largest `idleCpuPercent`: a whole vCPU.
pub const MAX_IDLE_CPU_PERCENT: f64 = 100.0;

/// A share of one vCPU in percent (`idleCpuPercent`, default 2): CPU seconds per second of
/// wall time, times 100, as `top` shows a process. A finite number once checked, so it
/// compares as an equivalence.
#[derive(Debug, Clone, Copy, PartialEq, PartialOrd, Serialize, Deserialize)]
#[serde(transparent)]
pub struct CpuPercent(pub f64);

impl Eq for CpuPercent {}

impl Default for CpuPercent {
    fn default() -> Self {
        CpuPercent(2.0)
    }
}

impl CpuPercent {
    /// Whether it is the default (left out of events and documents).
    pub fn is_default(&self) -> bool {
        *self == CpuPercent::default()
    }

    /// CPU seconds per second at this share.
    pub fn rate(self) -> f64 {
        self.0 / 100.0
    }
}

/// Whether `runtime` can pause a booted guest.
pub fn can_pause(runtime: &str) -> bool {
    PAUSING_RUNTIMES.contains(&runtime)
}

impl TemplateSpec {
    /// Whether `other` changes what the guest runs (and so the instance version).
    pub fn reshapes(&self, other: &TemplateSpec) -> bool {
        self.flavor != other.flavor
            || self.image_id != other.image_id
            || self.user_data_ref != other.user_data_ref
            || self.env != other.env
            || self.network != other.network
            || self.network_rules != other.network_rules
            || self.volumes != other.volumes
    }
}

/// `template.created`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateCreated {
    /// `sbxt_…`.
    pub template_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Unique among the tenant's live templates.
    pub name: String,
    /// The hosted pool.
    pub pool_id: String,
    /// The pool's runtime.
    pub runtime: String,
    /// Who made it (warm instances are owned by this identity).
    pub owner_identity_id: String,
    /// What it makes.
    #[serde(flatten)]
    pub spec: TemplateSpec,
    /// Its labels.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
}

/// `template.labeled`: the template's labels now.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateLabeled {
    /// `sbxt_…`.
    pub template_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The labels (they replace the earlier ones).
    pub labels: Labels,
}

/// `template.updated`: the spec after the update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateUpdated {
    /// `sbxt_…`.
    pub template_id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The instance version after the update.
    pub instance_version: u64,
    /// What it makes now.
    #[serde(flatten)]
    pub spec: TemplateSpec,
}

/// `template.deleted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TemplateDeleted {
    /// `sbxt_…`.
    pub template_id: String,
    /// The tenant.
    pub tenant_id: String,
}

crate::event_enum! {
    /// What happens to a template (in the log and the audit tools; not published).
    pub enum TemplateEvent {
        /// `template.created`.
        Created(TemplateCreated) = "template.created",
        /// `template.updated`.
        Updated(TemplateUpdated) = "template.updated",
        /// `template.deleted`.
        Deleted(TemplateDeleted) = "template.deleted",
        /// `template.labeled`.
        Labeled(TemplateLabeled) = "template.labeled",
    }
}

/// A template as its events leave it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Template {
    /// `sbxt_…`.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// Its name.
    pub name: String,
    /// The hosted pool.
    pub pool_id: String,
    /// The pool's runtime when it was made.
    pub runtime: String,
    /// Who made it.
    pub owner_identity_id: String,
    /// What it makes.
    #[serde(flatten)]
    pub spec: TemplateSpec,
    /// Rises with every update.
    pub version: u64,
    /// Rises with every change to what the guest runs.
    pub instance_version: u64,
    /// Hidden, its name free.
    pub deleted: bool,
    /// Its labels.
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    pub labels: Labels,
    /// When it was made.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl Aggregate for Template {
    type Event = TemplateEvent;
    const CATEGORY: &'static str = "template";

    fn create(event: &TemplateEvent, at: DateTime<Utc>) -> Option<Self> {
        let TemplateEvent::Created(c) = event else {
            return None;
        };
        Some(Template {
            id: c.template_id.clone(),
            tenant_id: c.tenant_id.clone(),
            name: c.name.clone(),
            pool_id: c.pool_id.clone(),
            runtime: c.runtime.clone(),
            owner_identity_id: c.owner_identity_id.clone(),
            spec: c.spec.clone(),
            version: 1,
            instance_version: 1,
            deleted: false,
            labels: c.labels.clone(),
            created_at: at,
            updated_at: at,
        })
    }

    fn apply(&mut self, event: &TemplateEvent, at: DateTime<Utc>) {
        match event {
            TemplateEvent::Created(_) => {}
            TemplateEvent::Updated(u) => {
                self.spec = u.spec.clone();
                self.instance_version = u.instance_version;
            }
            TemplateEvent::Deleted(_) => self.deleted = true,
            TemplateEvent::Labeled(l) => self.labels.clone_from(&l.labels),
        }
        self.updated_at = at;
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// What a template's pool, flavor, image and secrets are, read before deciding.
#[derive(Debug, Clone, Default)]
pub struct TemplateFacts {
    /// The pool, when it exists and is offered to the tenant.
    pub pool: Option<AdmissionPool>,
    /// The flavor exists (not archived) in the pool.
    pub flavor_exists: bool,
    /// The image resolves for the tenant.
    pub image_exists: bool,
    /// `env` references that name no secret of the tenant.
    pub missing_secrets: Vec<String>,
    /// Another live template of the tenant has the name.
    pub name_taken: bool,
}

/// `sandboxTemplates.create`.
#[derive(Debug, Clone)]
pub struct CreateTemplate {
    /// The new id.
    pub id: String,
    /// The tenant.
    pub tenant_id: String,
    /// The name.
    pub name: String,
    /// The pool.
    pub pool_id: String,
    /// Who asks.
    pub owner_identity_id: String,
    /// What it makes.
    pub spec: TemplateSpec,
    /// Its labels.
    pub labels: Labels,
}

/// Decides a create.
pub fn create(c: CreateTemplate, facts: &TemplateFacts) -> Result<Vec<TemplateEvent>, DomainError> {
    check_name("name", &c.name)?;
    crate::labels::check("labels", &c.labels)?;
    let pool = check_spec(&c.pool_id, &c.spec, facts)?;
    check_name_free(facts.name_taken, "template", &c.name, "")?;
    Ok(vec![TemplateEvent::Created(TemplateCreated {
        template_id: c.id,
        tenant_id: c.tenant_id,
        name: c.name,
        pool_id: c.pool_id,
        runtime: pool.runtime.clone(),
        owner_identity_id: c.owner_identity_id,
        spec: c.spec,
        labels: c.labels,
    })])
}

/// Decides `sandboxTemplates.setLabels`: the labels replace the template's; the same labels
/// decide nothing.
pub fn set_labels(
    state: Option<&Template>,
    tenant_id: &str,
    id: &str,
    labels: Labels,
) -> Result<Vec<TemplateEvent>, DomainError> {
    let t = live(state, tenant_id, id)?;
    crate::labels::check("labels", &labels)?;
    if t.labels == labels {
        return Ok(Vec::new());
    }
    Ok(vec![TemplateEvent::Labeled(TemplateLabeled {
        template_id: t.id.clone(),
        tenant_id: t.tenant_id.clone(),
        labels,
    })])
}

/// Decides an update to `spec` (the whole spec after the change).
pub fn update(
    state: Option<&Template>,
    tenant_id: &str,
    id: &str,
    spec: TemplateSpec,
    facts: &TemplateFacts,
) -> Result<Vec<TemplateEvent>, DomainError> {
    let t = live(state, tenant_id, id)?;
    check_spec(&t.pool_id, &spec, facts)?;
    let instance_version = t.instance_version + u64::from(t.spec.reshapes(&spec));
    Ok(vec![TemplateEvent::Updated(TemplateUpdated {
        template_id: t.id.clone(),
        tenant_id: t.tenant_id.clone(),
        instance_version,
        spec,
    })])
}

/// Decides a delete (a deleted template is `NOT_FOUND`).
pub fn delete(
    state: Option<&Template>,
    tenant_id: &str,
    id: &str,
) -> Result<Vec<TemplateEvent>, DomainError> {
    let t = live(state, tenant_id, id)?;
    Ok(vec![TemplateEvent::Deleted(TemplateDeleted {
        template_id: t.id.clone(),
        tenant_id: t.tenant_id.clone(),
    })])
}

/// The tenant's live template, or `NOT_FOUND`.
pub fn live<'a>(
    state: Option<&'a Template>,
    tenant_id: &str,
    id: &str,
) -> Result<&'a Template, DomainError> {
    state
        .filter(|t| t.tenant_id == tenant_id && !t.deleted)
        .ok_or_else(|| DomainError::NotFound {
            what: format!("template {id}"),
        })
}

fn check_spec<'a>(
    pool_id: &str,
    spec: &TemplateSpec,
    facts: &'a TemplateFacts,
) -> Result<&'a AdmissionPool, DomainError> {
    check_bounds(spec)?;
    let pool = facts.pool.as_ref().ok_or_else(|| DomainError::NotFound {
        what: format!("pool {pool_id}"),
    })?;
    if pool.kind != PoolKind::Hosted {
        return Err(DomainError::invalid_input(
            "poolId",
            "sandboxes run only on hosted pools",
        ));
    }
    if !facts.flavor_exists {
        return Err(DomainError::NotFound {
            what: format!("flavor {}", spec.flavor),
        });
    }
    if !facts.image_exists {
        return Err(DomainError::NotFound {
            what: format!("image {}", spec.image_id),
        });
    }
    if let Some(missing) = facts.missing_secrets.first() {
        return Err(DomainError::invalid_input(
            "env",
            format!("{missing} names no secret of the tenant"),
        ));
    }
    if spec.on_timeout == OnTimeout::Pause && !can_pause(&pool.runtime) {
        return Err(DomainError::invalid_input(
            "onTimeout",
            format!(
                "the pool's runtime {} cannot pause a guest; use delete",
                pool.runtime
            ),
        ));
    }
    if spec.network.needs_ip_range() && !pool.has_range {
        return Err(DomainError::invalid_state(format!(
            "network {:?} needs the pool's IP range (pools.setIpPool)",
            spec.network
        )));
    }
    Ok(pool)
}

/// The lifetime, warm and env rules that need no facts.
pub fn check_bounds(spec: &TemplateSpec) -> Result<(), DomainError> {
    if spec.max_ttl_seconds == 0 || spec.max_ttl_seconds > MAX_TTL_LIMIT {
        return Err(DomainError::invalid_input(
            "maxTtlSeconds",
            format!("1 to {MAX_TTL_LIMIT}"),
        ));
    }
    if spec.default_ttl_seconds == 0 || spec.default_ttl_seconds > spec.max_ttl_seconds {
        return Err(DomainError::invalid_input(
            "defaultTtlSeconds",
            "1 to maxTtlSeconds",
        ));
    }
    let max_paused = crate::sandbox::MAX_PAUSED_TTL_SECONDS;
    if spec.paused_ttl_seconds == 0 || spec.paused_ttl_seconds > max_paused {
        return Err(DomainError::invalid_input(
            "pausedTtlSeconds",
            format!("1 to {max_paused}"),
        ));
    }
    let (min_idle, max_idle) = (MIN_IDLE_TIMEOUT_SECONDS, MAX_IDLE_TIMEOUT_SECONDS);
    if spec
        .idle_timeout_seconds
        .is_some_and(|t| !(min_idle..=max_idle).contains(&t))
    {
        return Err(DomainError::invalid_input(
            "idleTimeoutSeconds",
            format!("{min_idle} to {max_idle}"),
        ));
    }
    let cpu = spec.idle_cpu_percent.0;
    if !(cpu.is_finite() && (MIN_IDLE_CPU_PERCENT..=MAX_IDLE_CPU_PERCENT).contains(&cpu)) {
        return Err(DomainError::invalid_input(
            "idleCpuPercent",
            format!("{MIN_IDLE_CPU_PERCENT} to {MAX_IDLE_CPU_PERCENT}"),
        ));
    }
    if let Some(w) = spec.warm {
        if w.min > w.max || w.max > MAX_WARM {
            return Err(DomainError::invalid_input(
                "warm",
                format!("min ≤ max ≤ {MAX_WARM}"),
            ));
        }
    }
    let paths: Vec<&str> = spec.volumes.iter().map(|v| v.mount_path.as_str()).collect();
    crate::volume::check_mount_paths(&paths)?;
    // A warm instance would hold the volumes (and one writer would block every claim).
    if !spec.volumes.is_empty() && spec.warm.is_some_and(|w| w.max > 0) {
        return Err(DomainError::invalid_input(
            "warm",
            "a template with volumes keeps no warm pool: warm.max must be 0",
        ));
    }
    if spec.env.len() > MAX_ENV {
        return Err(DomainError::invalid_input(
            "env",
            format!("at most {MAX_ENV} entries"),
        ));
    }
    for (name, reference) in &spec.env {
        let valid_name = !name.is_empty()
            && name.len() <= 128
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !valid_name {
            return Err(DomainError::invalid_input(
                "env",
                format!("{name:?} is not a shell variable name"),
            ));
        }
        if !reference.starts_with("secret://") {
            return Err(DomainError::invalid_input(
                "env",
                format!("{name}: values are secret:// references only"),
            ));
        }
    }
    Ok(())
}

/// A warm instance of a template, as the warm-pool upkeep sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmMember {
    /// `inst_…`.
    pub id: String,
    /// The template instance version it was made from.
    pub template_version: u64,
    /// Where it is.
    pub state: crate::state_table::InstanceState,
    /// Made at (claims take the oldest).
    pub created_at: DateTime<Utc>,
}

/// What a warm-pool pass does for one template.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WarmPlan {
    /// Instances to delete: a deleted template's, an older instance version's, failed or lost
    /// ones, then those beyond `warm.max`, newest first.
    pub drain: Vec<String>,
    /// How many to make.
    pub create: usize,
}

/// Plans a pass over a template's warm instances that are not being deleted (`template`
/// `None`: the template is gone). At most `max_refill` are made per pass.
pub fn warm_plan(
    template: Option<&Template>,
    members: &[WarmMember],
    max_refill: usize,
) -> WarmPlan {
    use crate::state_table::InstanceState::{Error, Lost};
    let live = template.filter(|t| !t.deleted);
    let (min, max) = live
        .and_then(|t| t.spec.warm)
        .map_or((0, 0), |w| (w.min as usize, w.max as usize));
    let current = live.map(|t| t.instance_version);
    let (mut keep, mut drain): (Vec<&WarmMember>, Vec<&WarmMember>) = members
        .iter()
        .partition(|m| Some(m.template_version) == current && !matches!(m.state, Error | Lost));
    keep.sort_by_key(|m| (m.created_at, m.id.clone()));
    if keep.len() > max {
        drain.extend(keep.split_off(max).into_iter().rev());
    }
    WarmPlan {
        drain: drain.into_iter().map(|m| m.id.clone()).collect(),
        create: min.saturating_sub(keep.len()).min(max_refill),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state_table::InstanceState;
    use chrono::TimeZone;

    fn template(min: u32, max: u32, instance_version: u64) -> Template {
        let at = Utc.timestamp_opt(1_800_000_000, 0).unwrap();
        Template {
            id: "sbxt_t".into(),
            tenant_id: "acme".into(),
            name: "py".into(),
            pool_id: "pool_p".into(),
            runtime: "cloud-hypervisor".into(),
            owner_identity_id: "id_alice".into(),
            spec: TemplateSpec {
                flavor: "small".into(),
                image_id: "img".into(),
                user_data_ref: None,
                env: BTreeMap::new(),
                network: Network::Egress,
                network_rules: NetworkRules::default(),
                default_ttl_seconds: 60,
                max_ttl_seconds: 600,
                warm: Some(Warm { min, max }),
                volumes: Vec::new(),
                paused_ttl_seconds: crate::sandbox::DEFAULT_PAUSED_TTL_SECONDS,
                on_timeout: OnTimeout::Delete,
                auto_resume: false,
                idle_timeout_seconds: None,
                idle_cpu_percent: CpuPercent::default(),
            },
            version: 1,
            instance_version,
            deleted: false,
            labels: Labels::new(),
            created_at: at,
            updated_at: at,
        }
    }

    fn member(id: &str, version: u64, state: InstanceState, age: i64) -> WarmMember {
        WarmMember {
            id: id.into(),
            template_version: version,
            state,
            created_at: Utc.timestamp_opt(1_800_000_000 + age, 0).unwrap(),
        }
    }

    #[test]
    fn idle_settings_out_of_bounds_are_refused_naming_the_field() {
        let spec = |timeout: Option<u64>, cpu: f64| TemplateSpec {
            idle_timeout_seconds: timeout,
            idle_cpu_percent: CpuPercent(cpu),
            ..template(0, 0, 1).spec
        };
        let field = |spec: TemplateSpec| match check_bounds(&spec) {
            Err(DomainError::InvalidInput { field, .. }) => Some(field),
            _ => None,
        };
        assert_eq!(field(spec(None, 2.0)), None);
        assert_eq!(field(spec(Some(60), 0.1)), None);
        assert_eq!(field(spec(Some(7 * 86_400), 100.0)), None);
        for (timeout, cpu, named) in [
            (Some(59), 2.0, "idleTimeoutSeconds"),
            (Some(7 * 86_400 + 1), 2.0, "idleTimeoutSeconds"),
            (Some(600), 0.05, "idleCpuPercent"),
            (Some(600), 100.5, "idleCpuPercent"),
            (None, f64::NAN, "idleCpuPercent"),
        ] {
            assert_eq!(field(spec(timeout, cpu)).as_deref(), Some(named));
        }
        // The default stays out of the template's events.
        let json = serde_json::to_value(spec(None, 2.0)).unwrap();
        assert!(json.get("idleCpuPercent").is_none() && json.get("idleTimeoutSeconds").is_none());
    }

    #[test]
    fn a_pool_below_min_is_refilled_at_most_four_at_a_time() {
        let t = template(6, 8, 1);
        let plan = warm_plan(Some(&t), &[member("a", 1, InstanceState::Paused, 0)], 4);
        assert_eq!(
            plan,
            WarmPlan {
                drain: vec![],
                create: 4
            }
        );
    }

    #[test]
    fn old_versions_failed_ones_and_the_newest_beyond_max_are_drained() {
        let t = template(1, 2, 2);
        let members = [
            member("old", 1, InstanceState::Paused, 0),
            member("lost", 2, InstanceState::Lost, 1),
            member("a", 2, InstanceState::Paused, 2),
            member("b", 2, InstanceState::Paused, 3),
            member("c", 2, InstanceState::Provisioning, 4),
            member("d", 2, InstanceState::Paused, 5),
        ];
        let plan = warm_plan(Some(&t), &members, 4);
        assert_eq!(plan.drain, vec!["old", "lost", "d", "c"]);
        assert_eq!(plan.create, 0);
    }

    #[test]
    fn a_deleted_template_drains_everything() {
        let mut t = template(2, 2, 1);
        t.deleted = true;
        let plan = warm_plan(Some(&t), &[member("a", 1, InstanceState::Paused, 0)], 4);
        assert_eq!(
            plan,
            WarmPlan {
                drain: vec!["a".into()],
                create: 0
            }
        );
        assert_eq!(warm_plan(None, &[], 4), WarmPlan::default());
    }
}
