//! Authorization with Cedar (SPEC §9): every call is decided on (principal, action, resource
//! with attributes) by the `cedar-policy` crate; nothing here evaluates a rule by hand.
//!
//! - [`AuthzSchema`]: the Cedar schema. Entity types and their attributes are fixed here;
//!   the actions come from the API's registry (each method names its action and resource
//!   type), so a method added later is declared without touching this file.
//! - The built-in baseline ([`AuthzSchema::baseline`]) is itself a Cedar policy set: an
//!   operator may do everything, a tenant member everything within its tenant, a node token
//!   only its own node's host methods, and nobody but the node reads a node's secrets.
//! - [`PolicyBook`]: the baseline plus the stored and file policies, compiled and indexed by
//!   action (and by tenant for tenant-scoped policies), deciding one request at a time.
//!
//! Pure: no I/O. Policies come in as text; the caller reads them from the log's projection.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::str::FromStr;
use std::sync::{Arc, LazyLock, RwLock};

use cedar_policy as cedar;
use cedar_policy::{
    ActionConstraint, Authorizer, Context, Entities, Entity, EntityId, EntityTypeName, EntityUid,
    Policy, PolicyId, PolicySet, Request, RestrictedExpression, ValidationMode, Validator,
};

use crate::DomainError;

/// Every entity type and the attributes policies can test, in Cedar schema syntax. `tenant`
/// is the tenant a resource belongs to (absent for the fleet's own resources: pools, nodes,
/// flavors, public images, provider accounts). Attributes a handler supplies (the draft's
/// shape) are required, so policies test them without `has`. Instances, sandboxes, templates
/// and volumes carry their labels as Cedar tags: `resource.hasTag("team") &&
/// resource.getTag("team") == "ml"` (a record of arbitrary keys cannot pass strict validation).
pub const ENTITY_TYPES: &str = r#"
entity Identity = { operator: Bool, tenant?: String };
entity Node;
entity Tenant = { tenant?: String };
entity Instance = {
  tenant?: String, vcpu: Long, memoryGiB: Long, gpus: Long, diskGiB: Long,
  imageId: String, imageVerified: Bool, projectId?: String
} tags String;
entity Sandbox = {
  tenant?: String, templateId: String, ttlSeconds: Long, warm: Bool,
  vcpu: Long, memoryGiB: Long, gpus: Long, diskGiB: Long, fromSnapshot?: String
} tags String;
entity Template = { tenant?: String } tags String;
entity Snapshot = { tenant?: String };
entity Volume = { tenant?: String, sizeGiB: Long } tags String;
entity Pool = { tenant?: String };
entity Flavor = { tenant?: String };
entity Image = { tenant?: String };
entity ProviderAccount = { tenant?: String };
entity Webhook = { tenant?: String };
entity Policy = { tenant?: String };
"#;

/// The entity types a resource may have (those of [`ENTITY_TYPES`] a method can act on).
pub const RESOURCE_TYPES: &[&str] = &[
    "Identity",
    "Node",
    "Tenant",
    "Instance",
    "Sandbox",
    "Template",
    "Snapshot",
    "Volume",
    "Pool",
    "Flavor",
    "Image",
    "ProviderAccount",
    "Webhook",
    "Policy",
];

/// Ids of stored policies may not take these prefixes: they name built-in and file policies.
pub const RESERVED_PREFIXES: &[&str] = &["baseline.", "file:"];

/// One action as the registry declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionDecl {
    /// `compute:instances:create`.
    pub name: String,
    /// The resource types methods decide it on.
    pub resources: BTreeSet<&'static str>,
    /// A host method: a node token may call it for its own node.
    pub host: bool,
}

/// The Cedar schema of this build's API, and the validator stored policies pass through.
pub struct AuthzSchema {
    validator: Validator,
    host_actions: Vec<String>,
    text: String,
}

impl AuthzSchema {
    /// The schema declaring [`ENTITY_TYPES`] and `actions` (merged by name).
    pub fn new(actions: &[ActionDecl]) -> Result<AuthzSchema, String> {
        let mut merged: BTreeMap<&str, (BTreeSet<&'static str>, bool)> = BTreeMap::new();
        for a in actions {
            let entry = merged.entry(a.name.as_str()).or_default();
            entry.0.extend(a.resources.iter().copied());
            entry.1 |= a.host;
        }
        let mut text = ENTITY_TYPES.to_string();
        for (name, (resources, host)) in &merged {
            if let Some(bad) = resources.iter().find(|r| !RESOURCE_TYPES.contains(r)) {
                return Err(format!("{name}: unknown resource type {bad}"));
            }
            let principals = if *host { "Identity, Node" } else { "Identity" };
            let resources = resources.iter().copied().collect::<Vec<_>>().join(", ");
            text.push_str(&format!(
                "action \"{name}\" appliesTo {{ principal: [{principals}], resource: [{resources}], context: {{}} }};\n"
            ));
        }
        let (schema, _warnings) =
            cedar::Schema::from_cedarschema_str(&text).map_err(|e| e.to_string())?;
        let host_actions = merged
            .iter()
            .filter(|(_, (_, host))| *host)
            .map(|(name, _)| name.to_string())
            .collect();
        Ok(AuthzSchema {
            validator: Validator::new(schema),
            host_actions,
            text,
        })
    }

    /// The schema in Cedar syntax (for people, and for `cedar validate`).
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The built-in baseline as Cedar policies, `(id, text)`.
    pub fn baseline(&self) -> Vec<(String, String)> {
        let mut policies = vec![
            (
                "baseline.operator".to_string(),
                "permit (principal is Identity, action, resource) when { principal.operator };"
                    .to_string(),
            ),
            (
                "baseline.tenant-member".to_string(),
                "permit (principal is Identity, action, resource) when { \
                   principal has tenant && resource has tenant && \
                   principal.tenant == resource.tenant };"
                    .to_string(),
            ),
        ];
        if !self.host_actions.is_empty() {
            let list = self
                .host_actions
                .iter()
                .map(|a| format!("Action::\"{a}\""))
                .collect::<Vec<_>>()
                .join(", ");
            policies.push((
                "baseline.node".to_string(),
                format!(
                    "permit (principal is Node, action in [{list}], resource is Node) \
                     when {{ principal == resource }};"
                ),
            ));
        }
        if self.host_actions.iter().any(|a| a == NODE_SECRET_ACTION) {
            // User data is the tenant's: only the node the instance is placed on reads it.
            policies.push((
                "baseline.node-secrets".to_string(),
                format!(
                    "forbid (principal is Identity, action == Action::\"{NODE_SECRET_ACTION}\", resource);"
                ),
            ));
        }
        policies
    }

    /// Parses and validates `text` (one or more Cedar policies, no templates) against the
    /// schema. The policies are named `id`, or `id#2`, `id#3`, … after the first.
    pub fn parse(&self, id: &str, text: &str) -> Result<Vec<Policy>, DomainError> {
        let invalid = |message: String| DomainError::invalid_input("text", message);
        let parsed = PolicySet::from_str(text).map_err(|e| invalid(e.to_string()))?;
        if parsed.templates().next().is_some() {
            return Err(invalid(
                "policy templates (with slots) are not supported".into(),
            ));
        }
        let mut set = PolicySet::new();
        let mut policies = Vec::new();
        for (n, policy) in parsed.policies().enumerate() {
            let name = match n {
                0 => id.to_string(),
                n => format!("{id}#{}", n + 1),
            };
            let policy = policy.new_id(PolicyId::new(name));
            set.add(policy.clone())
                .map_err(|e| invalid(e.to_string()))?;
            policies.push(policy);
        }
        if policies.is_empty() {
            return Err(invalid("holds no policy".into()));
        }
        let result = self.validator.validate(&set, ValidationMode::Strict);
        if !result.validation_passed() {
            let messages: Vec<String> = result.validation_errors().map(|e| e.to_string()).collect();
            return Err(invalid(messages.join("; ")));
        }
        Ok(policies)
    }
}

/// The action only a node may take: reading its instances' sealed secrets.
pub const NODE_SECRET_ACTION: &str = "compute:nodes:secret";

/// Checks a stored policy's id: 1 to 128 of `A-Z a-z 0-9 _ - . :`, not reserved.
pub fn check_policy_id(id: &str) -> Result<(), DomainError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.:".contains(c));
    if !ok {
        return Err(DomainError::invalid_input(
            "id",
            "1 to 128 characters of A-Z a-z 0-9 _ - . :",
        ));
    }
    if let Some(p) = RESERVED_PREFIXES.iter().find(|p| id.starts_with(**p)) {
        return Err(DomainError::invalid_input(
            "id",
            format!("ids starting with {p} are reserved"),
        ));
    }
    Ok(())
}

/// Who calls.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A configured or stored identity.
    Identity {
        /// `id_…`.
        id: String,
        /// The tenant a tenant identity acts for.
        tenant: Option<String>,
        /// Operators may do everything the baseline allows them.
        operator: bool,
    },
    /// A host calling with its node token.
    Node {
        /// `node_…`.
        id: String,
    },
}

impl Principal {
    /// The tenant it acts for.
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Principal::Identity { tenant, .. } => tenant.as_deref(),
            Principal::Node { .. } => None,
        }
    }
}

/// A value a resource attribute holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attr {
    /// A 64-bit integer (Cedar has no fractions).
    Long(i64),
    /// A boolean.
    Bool(bool),
    /// A string.
    Text(String),
}

/// What a call acts on: its type, id, tenant and the attributes policies test.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resource {
    /// One of [`RESOURCE_TYPES`].
    pub kind: &'static str,
    /// Its id (`inst_…`), or what stands for it (`new`, the tenant for a list).
    pub id: String,
    /// The tenant it belongs to (`None`: the fleet's).
    pub tenant: Option<String>,
    /// Further attributes.
    pub attrs: Vec<(&'static str, Attr)>,
    /// Its labels, as Cedar tags (only the labeled kinds declare tags).
    pub labels: crate::labels::Labels,
}

/// An instance being created, as `compute:instances:create` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceDraft {
    /// The flavor's vCPUs.
    pub vcpu: u32,
    /// The flavor's memory.
    pub memory_gib: u32,
    /// The flavor's GPU count.
    pub gpus: u32,
    /// The flavor's disk.
    pub disk_gib: u32,
    /// The image asked for.
    pub image_id: String,
    /// Whether the image resolved is marked verified.
    pub image_verified: bool,
    /// The project, when given.
    pub project_id: Option<String>,
    /// Its labels (the create's, or the instance's).
    pub labels: crate::labels::Labels,
}

/// A sandbox being created or extended, as `compute:sandboxes:create|update` sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SandboxDraft {
    /// Its template.
    pub template_id: String,
    /// Its whole lifetime in seconds (for an extend: from creation to the new expiry).
    pub ttl_seconds: i64,
    /// Whether a warm instance serves it.
    pub warm: bool,
    /// The template flavor's vCPUs.
    pub vcpu: u32,
    /// The template flavor's memory.
    pub memory_gib: u32,
    /// The template flavor's GPU count.
    pub gpus: u32,
    /// The template flavor's disk.
    pub disk_gib: u32,
    /// The snapshot it restores, when any.
    pub from_snapshot: Option<String>,
    /// Its labels.
    pub labels: crate::labels::Labels,
}

impl Resource {
    /// A resource with no attributes beyond its tenant.
    pub fn new(kind: &'static str, id: impl Into<String>, tenant: Option<String>) -> Resource {
        Resource {
            kind,
            id: id.into(),
            tenant,
            attrs: Vec::new(),
            labels: crate::labels::Labels::new(),
        }
    }

    /// Sets its labels (Cedar tags).
    pub fn labeled(mut self, labels: &crate::labels::Labels) -> Resource {
        self.labels.clone_from(labels);
        self
    }

    /// Adds an attribute.
    pub fn with(mut self, name: &'static str, value: Attr) -> Resource {
        self.attrs.push((name, value));
        self
    }

    /// The `Instance` an `instances.create` would make, or an `instances.resize` would leave.
    pub fn instance_draft(id: &str, tenant: &str, d: &InstanceDraft) -> Resource {
        let r = Resource::new("Instance", id, Some(tenant.to_string()))
            .with("vcpu", Attr::Long(d.vcpu.into()))
            .with("memoryGiB", Attr::Long(d.memory_gib.into()))
            .with("gpus", Attr::Long(d.gpus.into()))
            .with("diskGiB", Attr::Long(d.disk_gib.into()))
            .with("imageId", Attr::Text(d.image_id.clone()))
            .with("imageVerified", Attr::Bool(d.image_verified))
            .labeled(&d.labels);
        match &d.project_id {
            Some(p) => r.with("projectId", Attr::Text(p.clone())),
            None => r,
        }
    }

    /// The `Sandbox` a `sandboxes.create` would make, or an extend would leave.
    pub fn sandbox_draft(id: &str, tenant: &str, d: &SandboxDraft) -> Resource {
        let r = Resource::new("Sandbox", id, Some(tenant.to_string()))
            .with("templateId", Attr::Text(d.template_id.clone()))
            .with("ttlSeconds", Attr::Long(d.ttl_seconds))
            .with("warm", Attr::Bool(d.warm))
            .with("vcpu", Attr::Long(d.vcpu.into()))
            .with("memoryGiB", Attr::Long(d.memory_gib.into()))
            .with("gpus", Attr::Long(d.gpus.into()))
            .with("diskGiB", Attr::Long(d.disk_gib.into()))
            .labeled(&d.labels);
        match &d.from_snapshot {
            Some(s) => r.with("fromSnapshot", Attr::Text(s.clone())),
            None => r,
        }
    }

    /// A `Volume` of `size_gib` (a create, or a resize's new size).
    pub fn volume(id: &str, tenant: &str, size_gib: i64) -> Resource {
        Resource::new("Volume", id, Some(tenant.to_string())).with("sizeGiB", Attr::Long(size_gib))
    }
}

/// What a decision answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Allowed.
    Allow,
    /// Refused: the `forbid` policies that refused (empty when no `permit` applied).
    Deny {
        /// Policy ids, as stored (`id`, not `id#2`).
        policy_ids: Vec<String>,
    },
}

/// One policy source: a stored policy, or a file's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PolicySource {
    /// Its id.
    pub id: String,
    /// When set, it applies only to decisions within this tenant.
    pub tenant_id: Option<String>,
    /// Cedar text.
    pub text: String,
}

/// One set of policies as a decision evaluates it: in full, and its two-policy fast path.
#[derive(Clone, Default)]
struct Compiled {
    full: PolicySet,
    fast: Option<PolicySet>,
}

impl Compiled {
    fn new(policies: &[&Policy]) -> Compiled {
        let mut full = PolicySet::new();
        for p in policies {
            // Ids are unique: every source's policies are named after it.
            let _ = full.add((*p).clone());
        }
        Compiled {
            full,
            fast: combine::fast_set(policies),
        }
    }
}

/// The sets compiled for different requests' slices that one action's index keeps.
const SLICES_KEPT: usize = 256;

/// The policies whose scope can name one action, each with its guards (see [`slice`]); the
/// set Cedar evaluates for a request is compiled once per distinct slice and kept.
#[derive(Default)]
struct ActionPolicies {
    policies: Vec<(Policy, Vec<slice::Atom>)>,
    compiled: RwLock<HashMap<Vec<bool>, Arc<Compiled>>>,
}

impl ActionPolicies {
    fn new(policies: Vec<&Policy>) -> ActionPolicies {
        let policies = policies
            .into_iter()
            .map(|p| {
                let atoms = p
                    .to_json()
                    .map(|est| slice::atoms(&est))
                    .unwrap_or_default();
                (p.clone(), atoms)
            })
            .collect();
        ActionPolicies {
            policies,
            compiled: RwLock::default(),
        }
    }

    /// The compiled set of the policies that can apply to this request.
    fn for_request(&self, principal: &Principal, resource: &Resource) -> Arc<Compiled> {
        let slice: Vec<bool> = self
            .policies
            .iter()
            .map(|(_, atoms)| atoms.iter().all(|a| a.may_hold(principal, resource)))
            .collect();
        if let Some(c) = self.compiled.read().expect("not poisoned").get(&slice) {
            return c.clone();
        }
        let chosen: Vec<&Policy> = self
            .policies
            .iter()
            .zip(&slice)
            .filter(|(_, keep)| **keep)
            .map(|((p, _), _)| p)
            .collect();
        let compiled = Arc::new(Compiled::new(&chosen));
        let mut kept = self.compiled.write().expect("not poisoned");
        if kept.len() >= SLICES_KEPT {
            kept.clear();
        }
        kept.insert(slice, compiled.clone());
        compiled
    }
}

/// Policies compiled for deciding, indexed by action: a decision evaluates only the policies
/// whose scope can name its action.
#[derive(Clone, Default)]
struct ActionIndex {
    by_action: HashMap<String, Arc<ActionPolicies>>,
    any_action: Arc<ActionPolicies>,
}

impl ActionIndex {
    fn build(policies: &[Policy]) -> ActionIndex {
        let mut named: HashMap<String, Vec<&Policy>> = HashMap::new();
        let mut any = Vec::new();
        for p in policies {
            match p.action_constraint() {
                ActionConstraint::Any => any.push(p),
                ActionConstraint::Eq(a) => named
                    .entry(a.id().unescaped().to_string())
                    .or_default()
                    .push(p),
                ActionConstraint::In(list) => {
                    for a in list {
                        named
                            .entry(a.id().unescaped().to_string())
                            .or_default()
                            .push(p);
                    }
                }
            }
        }
        let by_action = named
            .into_iter()
            .map(|(action, listed)| {
                let mut all = any.clone();
                all.extend(listed);
                (action, Arc::new(ActionPolicies::new(all)))
            })
            .collect();
        ActionIndex {
            by_action,
            any_action: Arc::new(ActionPolicies::new(any)),
        }
    }

    fn for_action(&self, action: &str) -> &ActionPolicies {
        self.by_action.get(action).unwrap_or(&self.any_action)
    }
}

/// The policies in force, ready to decide.
#[derive(Clone, Default)]
pub struct PolicyBook {
    everyone: ActionIndex,
    tenants: HashMap<String, ActionIndex>,
    count: usize,
}

/// A policy source that no longer passes the schema (a method it names was removed).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skipped {
    /// The policy.
    pub id: String,
    /// Cedar's message.
    pub message: String,
}

impl PolicyBook {
    /// The baseline plus `sources`. A source that fails the schema is left out and named.
    pub fn build(schema: &AuthzSchema, sources: &[PolicySource]) -> (PolicyBook, Vec<Skipped>) {
        let mut everyone = Vec::new();
        for (id, text) in schema.baseline() {
            let policies = schema.parse(&id, &text);
            everyone.extend(policies.expect("the baseline passes the schema"));
        }
        let mut by_tenant: HashMap<&str, Vec<Policy>> = HashMap::new();
        let mut skipped = Vec::new();
        let mut count = everyone.len();
        for s in sources {
            match schema.parse(&s.id, &s.text) {
                Ok(policies) => {
                    count += policies.len();
                    match &s.tenant_id {
                        None => everyone.extend(policies),
                        Some(t) => by_tenant.entry(t).or_default().extend(policies),
                    }
                }
                Err(e) => skipped.push(Skipped {
                    id: s.id.clone(),
                    message: e.to_string(),
                }),
            }
        }
        let tenants = by_tenant
            .into_iter()
            .map(|(t, own)| {
                let mut all = everyone.clone();
                all.extend(own);
                (t.to_string(), ActionIndex::build(&all))
            })
            .collect();
        let book = PolicyBook {
            everyone: ActionIndex::build(&everyone),
            tenants,
            count,
        };
        (book, skipped)
    }

    /// How many policies (baseline included) are in force.
    pub fn len(&self) -> usize {
        self.count
    }

    /// Whether no policy is in force (never, once built: the baseline is always there).
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Decides `action` by `principal` on `resource`. Policies naming an attribute the
    /// resource does not carry are skipped, as Cedar skips any policy that errors; handlers
    /// that know a resource's attributes decide again with them.
    pub fn decide(&self, principal: &Principal, action: &str, resource: &Resource) -> Decision {
        let tenant = resource.tenant.as_deref().or(principal.tenant());
        let index = tenant
            .and_then(|t| self.tenants.get(t))
            .unwrap_or(&self.everyone);
        let policies = index.for_action(action).for_request(principal, resource);
        let (request, entities) = match request(principal, action, resource) {
            Ok(r) => r,
            Err(_) => return Decision::Deny { policy_ids: vec![] },
        };
        let authorizer = Authorizer::new();
        if let Some(fast) = &policies.fast {
            let quick = authorizer.is_authorized(&request, fast, &entities);
            if quick.decision() == cedar::Decision::Allow
                && quick.diagnostics().errors().next().is_none()
            {
                return Decision::Allow;
            }
        }
        decision_of(&authorizer.is_authorized(&request, &policies.full, &entities))
    }
}

/// Cedar's answer as ours: a refusal names the stored policies that refused.
fn decision_of(response: &cedar::Response) -> Decision {
    match response.decision() {
        cedar::Decision::Allow => Decision::Allow,
        cedar::Decision::Deny => {
            let mut ids: Vec<String> = response
                .diagnostics()
                .reason()
                .map(|id| stored_id(id.as_ref()).to_string())
                .collect();
            ids.sort();
            ids.dedup();
            Decision::Deny { policy_ids: ids }
        }
    }
}

/// The stored policy a compiled one came from (`id#2` → `id`).
fn stored_id(id: &str) -> &str {
    id.split_once('#').map_or(id, |(stored, _)| stored)
}

static TYPE_NAMES: LazyLock<HashMap<&'static str, EntityTypeName>> = LazyLock::new(|| {
    RESOURCE_TYPES
        .iter()
        .chain(["Action"].iter())
        .map(|t| (*t, EntityTypeName::from_str(t).expect("a type name")))
        .collect()
});

fn uid(kind: &str, id: &str) -> EntityUid {
    EntityUid::from_type_name_and_id(TYPE_NAMES[kind].clone(), EntityId::new(id))
}

fn request(
    principal: &Principal,
    action: &str,
    resource: &Resource,
) -> Result<(Request, Entities), String> {
    let (principal_uid, principal_entity) = principal_entity(principal)?;
    let resource_uid = uid(resource.kind, &resource.id);
    let mut entities = vec![principal_entity];
    if resource_uid != principal_uid {
        entities.push(resource_entity(resource_uid.clone(), resource)?);
    }
    let request = Request::new(
        principal_uid,
        uid("Action", action),
        resource_uid,
        Context::empty(),
        None,
    )
    .map_err(|e| e.to_string())?;
    let entities = Entities::from_entities(entities, None).map_err(|e| e.to_string())?;
    Ok((request, entities))
}

fn principal_entity(principal: &Principal) -> Result<(EntityUid, Entity), String> {
    match principal {
        Principal::Identity {
            id,
            tenant,
            operator,
        } => {
            let uid = uid("Identity", id);
            let mut attrs = HashMap::from([(
                "operator".to_string(),
                RestrictedExpression::new_bool(*operator),
            )]);
            if let Some(t) = tenant {
                attrs.insert("tenant".into(), RestrictedExpression::new_string(t.clone()));
            }
            let entity =
                Entity::new(uid.clone(), attrs, HashSet::new()).map_err(|e| e.to_string())?;
            Ok((uid, entity))
        }
        Principal::Node { id } => {
            let uid = uid("Node", id);
            Ok((uid.clone(), Entity::new_no_attrs(uid, HashSet::new())))
        }
    }
}

fn resource_entity(uid: EntityUid, resource: &Resource) -> Result<Entity, String> {
    let mut attrs = HashMap::new();
    if let Some(t) = &resource.tenant {
        attrs.insert(
            "tenant".to_string(),
            RestrictedExpression::new_string(t.clone()),
        );
    }
    for (name, value) in &resource.attrs {
        let value = match value {
            Attr::Long(n) => RestrictedExpression::new_long(*n),
            Attr::Bool(b) => RestrictedExpression::new_bool(*b),
            Attr::Text(s) => RestrictedExpression::new_string(s.clone()),
        };
        attrs.insert(name.to_string(), value);
    }
    let tags = resource
        .labels
        .iter()
        .map(|(k, v)| (k.clone(), RestrictedExpression::new_string(v.clone())));
    Entity::new_with_tags(uid, attrs, HashSet::new(), tags).map_err(|e| e.to_string())
}

mod combine;
mod slice;
#[cfg(test)]
mod tests;
