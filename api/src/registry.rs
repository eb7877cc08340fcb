//! The API as a registry: every method is declared once, with its name, its request type, who
//! may call it and its handler. `rpc::dispatch` looks methods up here, and the OpenAPI
//! document is generated from the same declarations, so the two cannot drift apart.

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::sync::Arc;

use futures::future::BoxFuture;
use futures::FutureExt;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use vps_commands::Ctx;
use vps_domain::authz::{ActionDecl, Resource};
use vps_domain::ErrorCode;

use crate::authz::{Authorizer, Guard};
use crate::error::ApiError;
use crate::request::{parse, Caller};

/// Whose resources a method acts on, which shapes the resource it is decided on (see
/// [`generic_resource`]); who may call it is then Cedar's decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// The fleet's resources (no tenant): the baseline lets operators only.
    Operator,
    /// A tenant's resources (the request's `tenantId`, or the caller's tenant).
    Tenant,
    /// A node's host methods: the node itself (its node token) or operators.
    Node,
}

impl Access {
    /// How the OpenAPI document describes it.
    pub fn describe(self) -> &'static str {
        match self {
            Access::Operator => "operators",
            Access::Tenant => "tenants (their own resources) and operators",
            Access::Node => "the node itself (its node token) or operators",
        }
    }
}

/// One call: the command context and who is calling.
pub struct Call {
    /// Handles and the acting identity.
    pub ctx: Ctx,
    /// The authenticated caller.
    pub caller: Caller,
    /// Admits creates in batches.
    pub admitter: vps_commands::instances::Admitter,
    /// Bounds on open streams and long-polls.
    pub guards: crate::guards::Guards,
    /// The rows create waits watch on this replica.
    pub watched: Arc<crate::wait::Watched>,
    /// The configuration in force.
    pub config: std::sync::Arc<crate::config::Config>,
    /// The policies in force, the principal and the method's action.
    pub guard: Guard,
    /// The authorizer (its schema validates stored policies).
    pub authz: Arc<Authorizer>,
    /// Where snapshots are kept (signs hosts' upload and download URLs).
    pub snapshots: vps_store::SnapshotStore,
    /// The sandbox CA, when one is configured.
    pub sandbox_ca: Option<Arc<vps_commands::sandboxes::exec::ca::SandboxCa>>,
    /// Where preview URLs start.
    pub preview_url: Arc<str>,
    /// This replica's copy of its nodes' spec entries.
    pub specs: Arc<vps_projections::node_specs::SpecCache>,
    /// The spec generations this replica has heard of, per node.
    pub spec_signals: Arc<vps_projections::spec_signals::SpecSignals>,
}

impl Call {
    /// Decides this method's action on `resource`, which carries the attributes the handler
    /// knows (e.g. [`Resource::sandbox_draft`]; an instance's draft is decided in its
    /// admission batch, through a `Gate`). Call it before writing anything: `ACCESS_DENIED`
    /// with `details.policyIds` when refused.
    pub fn authorize(&self, resource: &Resource) -> Result<(), ApiError> {
        self.guard.decide(&self.guard.action, resource)
    }

    /// Like [`Call::authorize`] for another action (e.g. a template's per-volume decision).
    pub fn authorize_as(&self, action: &str, resource: &Resource) -> Result<(), ApiError> {
        self.guard.decide(action, resource)
    }
}

/// An answer's JSON text. Every `Serialize` answer is written by serde, once, straight from
/// the typed answer (no intermediate `Value` tree); an answer that holds JSON text already
/// (a NodeSpec's stored entries: megabytes at 10,000) writes that text as it is.
pub trait Answer {
    /// The JSON text.
    fn to_json(&self) -> Vec<u8>;
}

impl<T: Serialize> Answer for T {
    fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("serialises")
    }
}

/// A handler answers its answer's JSON text ([`Answer`]).
type Handler =
    Box<dyn Fn(Call, &[u8]) -> BoxFuture<'static, Result<Vec<u8>, ApiError>> + Send + Sync>;

/// A method of the API.
pub struct Method {
    /// The group (`instances`).
    pub group: &'static str,
    /// The method (`create`).
    pub name: &'static str,
    /// One line for people.
    pub summary: &'static str,
    /// Whose resources it acts on.
    pub access: Access,
    /// Its Cedar action (`compute:instances:create`).
    pub action: String,
    /// The resource type it is decided on (`Instance`).
    pub resource: &'static str,
    /// Further resource types its handler decides its action on.
    pub also_on: Vec<&'static str>,
    /// The request body's schema.
    pub request: fn(&mut SchemaGenerator) -> Schema,
    /// The answer's schema.
    pub answer: fn(&mut SchemaGenerator) -> Schema,
    /// Whether the body may be left out (the request has no required field).
    pub body_optional: bool,
    /// The largest body accepted, in bytes ([`MAX_BODY`] unless the method says otherwise).
    pub max_body: usize,
    /// Decided by its handler on the parsed request ([`Method::decided_on`]), not before.
    decided_on_request: bool,
    handler: Handler,
}

/// The largest request body a method accepts unless it declares its own
/// ([`Method::max_body`]).
pub const MAX_BODY: usize = 256 * 1024;

impl Method {
    /// Declares a method whose body parses into `Req` (unknown fields refused) and whose
    /// handler answers an `Ans`.
    pub fn new<Req, Ans, F, Fut>(
        group: &'static str,
        name: &'static str,
        access: Access,
        summary: &'static str,
        handler: F,
    ) -> Method
    where
        Req: DeserializeOwned + JsonSchema + Send + 'static,
        Ans: Answer + JsonSchema,
        F: Fn(Call, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Ans, ApiError>> + Send + 'static,
    {
        Method {
            group,
            name,
            summary,
            access,
            action: match access {
                // Host methods have actions of their own, so a node token's baseline permit
                // never reaches an operator method that would share a verb.
                Access::Node => format!("compute:{group}:{name}"),
                _ => default_action(group, name),
            },
            resource: default_resource(group),
            also_on: Vec::new(),
            request: |g| g.subschema_for::<Req>(),
            answer: |g| g.subschema_for::<Ans>(),
            body_optional: parse::<Req>(b"").is_ok(),
            max_body: MAX_BODY,
            decided_on_request: false,
            handler: Box::new(move |call, body| match parse::<Req>(body) {
                Ok(request) => handler(call, request)
                    .map(|answer| answer.map(|a| a.to_json()))
                    .boxed(),
                Err(e) => futures::future::ready(Err(e)).boxed(),
            }),
        }
    }

    /// Like [`Method::new`], for a method of the fleet's (no tenant) whose requests are large
    /// and name their resource: the generic decision is made on the id `id_of` reads from the
    /// parsed request, not on a scan of the body before the parse. A host's complete report
    /// of 10,000 guests is about a megabyte, and that scan cost as much as its parse. A body
    /// that does not parse is then `INVALID_INPUT` before it is decided.
    pub fn decided_on<Req, Ans, F, Fut>(
        group: &'static str,
        name: &'static str,
        access: Access,
        summary: &'static str,
        id_of: fn(&Req) -> &str,
        handler: F,
    ) -> Method
    where
        Req: DeserializeOwned + JsonSchema + Send + 'static,
        Ans: Answer + JsonSchema,
        F: Fn(Call, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Ans, ApiError>> + Send + 'static,
    {
        assert!(
            access != Access::Tenant,
            "{group}.{name}: a tenant's method"
        );
        let resource = default_resource(group);
        let handler = move |call: Call, request: Req| {
            let resource = Resource::new(resource, id_of(&request).to_string(), None);
            let decided = call.guard.decide(&call.guard.action, &resource);
            let answer = decided.map(|()| handler(call, request));
            async move { answer?.await }
        };
        Method {
            decided_on_request: true,
            ..Method::new(group, name, access, summary, handler)
        }
    }

    /// Overrides the Cedar action (default: [`default_action`]).
    pub fn action(mut self, action: &str) -> Method {
        self.action = action.to_string();
        self
    }

    /// Overrides the resource type (default: [`default_resource`]).
    pub fn resource(mut self, kind: &'static str) -> Method {
        assert!(
            !self.decided_on_request,
            "decided on the group's own resource type"
        );
        self.resource = kind;
        self
    }

    /// Accepts bodies up to `bytes` (e.g. a host's complete report of every guest).
    pub fn max_body(mut self, bytes: usize) -> Method {
        self.max_body = bytes;
        self
    }

    /// Declares further resource types the handler decides the action on.
    pub fn also_on(mut self, kinds: &[&'static str]) -> Method {
        self.also_on.extend_from_slice(kinds);
        self
    }

    /// `group.name`.
    pub fn full_name(&self) -> String {
        format!("{}.{}", self.group, self.name)
    }

    /// Decides the call generically (the caller, the action, the resource type and tenant),
    /// refuses creates for a tenant being deleted, then parses the body and runs the handler.
    pub async fn call(&self, call: Call, body: &[u8]) -> Result<Vec<u8>, ApiError> {
        if !self.decided_on_request {
            self.admit(&call.guard, &call.caller, body)?;
        }
        (self.handler)(call, body).await
    }

    /// The generic decision alone: also for routes that serve a method outside `call` (the
    /// event stream is `events.list` kept open).
    pub fn admit(&self, guard: &Guard, caller: &Caller, body: &[u8]) -> Result<(), ApiError> {
        let resource = generic_resource(self, caller, body)?;
        guard.decide(&self.action, &resource)?;
        guard.refuse_closed_tenant(&resource)
    }
}

/// The action a method takes unless it names another: `compute:<group>:<verb>`, the verb
/// being `create`, `read`, `delete` or `update` (`exec` for exec); the sandbox groups share
/// `compute:sandboxes:*` (`manage` for templates and volumes), as the reference has it.
pub fn default_action(group: &str, name: &str) -> String {
    let verb = match name {
        "create" | "register" => "create",
        "get" | "list" | "history" | "deliveries" | "usage" | "leases" | "spec" => "read",
        "delete" | "archive" => "delete",
        "exec" => "exec",
        _ => "update",
    };
    match (group, verb) {
        ("sandboxTemplates" | "sandboxVolumes" | "sandboxSnapshots", "read") => {
            "compute:sandboxes:read".into()
        }
        ("sandboxSnapshots", _) => "compute:sandboxes:delete".into(),
        ("sandboxTemplates" | "sandboxVolumes", _) => "compute:sandboxes:manage".into(),
        _ => format!("compute:{group}:{verb}"),
    }
}

/// The resource type of a group's methods unless they name another.
pub fn default_resource(group: &str) -> &'static str {
    match group {
        "instances" => "Instance",
        "sandboxes" => "Sandbox",
        "sandboxTemplates" => "Template",
        "sandboxSnapshots" => "Snapshot",
        "sandboxVolumes" => "Volume",
        "pools" => "Pool",
        "nodes" => "Node",
        "flavors" => "Flavor",
        "images" => "Image",
        "providerAccounts" => "ProviderAccount",
        "webhooks" => "Webhook",
        "policies" => "Policy",
        "identities" | "apiKeys" => "Identity",
        _ => "Tenant",
    }
}

/// Every method, in declaration order, indexed by (group, name).
pub struct Registry {
    methods: Vec<Method>,
    index: HashMap<String, usize>,
}

impl Registry {
    /// Indexes `methods`; a method declared twice is a bug.
    pub fn new(methods: Vec<Method>) -> Registry {
        let mut index = HashMap::new();
        for (i, m) in methods.iter().enumerate() {
            let earlier = index.insert(m.full_name(), i);
            assert!(earlier.is_none(), "{} declared twice", m.full_name());
        }
        Registry { methods, index }
    }

    /// The method `group.name`.
    pub fn get(&self, group: &str, name: &str) -> Option<&Method> {
        self.index
            .get(&format!("{group}.{name}"))
            .map(|&i| &self.methods[i])
    }

    /// Every method, in declaration order.
    pub fn methods(&self) -> &[Method] {
        &self.methods
    }
}

/// The request of methods that take no parameters: `{}` (or an empty body).
#[derive(Debug, Default, serde::Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct NoParams {}

/// A page of items.
#[derive(Debug, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(rename = "Items_of_{T}")]
pub struct Items<T> {
    /// The items.
    pub items: Vec<T>,
}

impl<T> From<Vec<T>> for Items<T> {
    fn from(items: Vec<T>) -> Self {
        Items { items }
    }
}

/// The action of every method, with the resource types it is decided on.
pub fn actions(methods: &[Method]) -> Vec<ActionDecl> {
    let mut merged: HashMap<&str, ActionDecl> = HashMap::new();
    for m in methods {
        let decl = merged.entry(&m.action).or_insert_with(|| ActionDecl {
            name: m.action.clone(),
            resources: BTreeSet::new(),
            host: false,
        });
        decl.resources.insert(m.resource);
        decl.resources.extend(m.also_on.iter().copied());
        decl.host |= m.access == Access::Node;
    }
    let mut list: Vec<ActionDecl> = merged.into_values().collect();
    list.sort_by(|a, b| a.name.cmp(&b.name));
    list
}

/// The resource a method is decided on before its handler runs: its type, the id the request
/// names, and the tenant it acts within. A tenant identity naming another tenant is answered
/// `NOT_FOUND` here, never a hint that the tenant exists.
pub fn generic_resource(
    method: &Method,
    caller: &Caller,
    body: &[u8],
) -> Result<Resource, ApiError> {
    let id_name = id_field(method.resource);
    let [id, tenant] = peek(body, [&id_name, "tenantId"]);
    let id = id.unwrap_or_else(|| "*".into());
    let tenant = match method.access {
        Access::Operator | Access::Node => None,
        Access::Tenant => tenant_scope(caller, tenant)?,
    };
    let id = match (method.resource, &tenant) {
        ("Tenant", Some(t)) => t.clone(),
        _ => id,
    };
    Ok(Resource::new(method.resource, id, tenant))
}

/// The string values of the top-level fields `names` of a JSON object body (`None` for a
/// field that is absent or not a string, and for each when the body is not an object). The
/// other fields are skipped without building values: a host's report of 10,000 guests is
/// megabytes, and only its `nodeId` is wanted here.
fn peek<const N: usize>(body: &[u8], names: [&str; N]) -> [Option<String>; N] {
    use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

    struct Fields<'a, const N: usize>([&'a str; N]);

    impl<'de, const N: usize> Visitor<'de> for Fields<'_, N> {
        type Value = [Option<String>; N];

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }

        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = std::array::from_fn(|_| None);
            while let Some(key) = map.next_key::<String>()? {
                match self.0.iter().position(|n| *n == key) {
                    // The last of repeated keys wins, as it does in a parsed `Value`.
                    Some(i) => found[i] = map.next_value::<Value>()?.as_str().map(str::to_string),
                    None => {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
            }
            Ok(found)
        }
    }

    impl<'de, const N: usize> DeserializeSeed<'de> for Fields<'_, N> {
        type Value = [Option<String>; N];

        fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
            d.deserialize_map(self)
        }
    }

    let mut de = serde_json::Deserializer::from_slice(body);
    Fields(names)
        .deserialize(&mut de)
        .and_then(|found| de.end().map(|()| found))
        .unwrap_or_else(|_| std::array::from_fn(|_| None))
}

fn tenant_scope(caller: &Caller, requested: Option<String>) -> Result<Option<String>, ApiError> {
    if caller.node.is_some() || caller.actor.operator {
        return Ok(requested);
    }
    match (&caller.actor.tenant, requested) {
        (Some(own), Some(asked)) if *own != asked => Err(ApiError::new(
            ErrorCode::NotFound,
            format!("tenant {asked} not found"),
        )),
        (own, _) => Ok(own.clone()),
    }
}

/// The request field naming a resource of `kind`: `instanceId`, `poolId`, … (`id` for
/// policies, whose requests name them so).
fn id_field(kind: &str) -> String {
    if kind == "Policy" {
        return "id".into();
    }
    let mut chars = kind.chars();
    match chars.next() {
        Some(first) => format!("{}{}Id", first.to_ascii_lowercase(), chars.as_str()),
        None => "id".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::peek;

    #[test]
    fn a_peek_reads_top_level_strings_and_skips_the_rest() {
        let body = br#"{"instances":[{"id":"inst_a","nodeId":"no"}],"nodeId":"node_a","n":1}"#;
        assert_eq!(
            peek(body, ["nodeId", "tenantId", "n"]),
            [Some("node_a".into()), None, None]
        );
        let repeated = br#"{"nodeId":"node_a","nodeId":"node_b"}"#;
        assert_eq!(peek(repeated, ["nodeId"]), [Some("node_b".into())]);
        for bad in [&b"[1]"[..], b"", b"{\"nodeId\":\"a\"} x", b"{\"nodeId\":"] {
            assert_eq!(peek(bad, ["nodeId"]), [None]);
        }
    }
}
