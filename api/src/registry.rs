//! The API as a registry: every method is declared once, with its name, its request type, who
//! may call it and its handler. `rpc::dispatch` looks methods up here, and the OpenAPI
//! document is generated from the same declarations, so the two cannot drift apart.

use std::collections::HashMap;
use std::future::Future;

use futures::future::BoxFuture;
use futures::FutureExt;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use vps_commands::Ctx;

use crate::error::ApiError;
use crate::request::{parse, Caller};

/// Who may call a method. Finer rules (a tenant acts only for itself, a node only for its own
/// node) are checked by the handler, which knows the ids in the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Access {
    /// Operators only.
    Operator,
    /// Tenant identities and operators; node tokens are refused.
    Tenant,
    /// A node (for itself) or an operator.
    Node,
}

impl Access {
    /// Refuses a caller this method is not for.
    pub fn check(self, caller: &Caller) -> Result<(), ApiError> {
        match self {
            Access::Operator => caller.operator(),
            Access::Tenant if caller.node.is_some() => Err(ApiError::new(
                "ACCESS_DENIED",
                "a node token may call only its own node's methods",
            )),
            Access::Node if caller.node.is_none() => caller.operator(),
            Access::Tenant | Access::Node => Ok(()),
        }
    }

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
    /// The configuration in force.
    pub config: std::sync::Arc<crate::config::Config>,
}

type Handler =
    Box<dyn Fn(Call, &[u8]) -> BoxFuture<'static, Result<Value, ApiError>> + Send + Sync>;

/// A method of the API.
pub struct Method {
    /// The group (`instances`).
    pub group: &'static str,
    /// The method (`create`).
    pub name: &'static str,
    /// One line for people.
    pub summary: &'static str,
    /// Who may call it.
    pub access: Access,
    /// The request body's schema.
    pub request: fn(&mut SchemaGenerator) -> Schema,
    /// The answer's schema.
    pub answer: fn(&mut SchemaGenerator) -> Schema,
    /// Whether the body may be left out (the request has no required field).
    pub body_optional: bool,
    handler: Handler,
}

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
        Ans: Serialize + JsonSchema,
        F: Fn(Call, Req) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Ans, ApiError>> + Send + 'static,
    {
        Method {
            group,
            name,
            summary,
            access,
            request: |g| g.subschema_for::<Req>(),
            answer: |g| g.subschema_for::<Ans>(),
            body_optional: parse::<Req>(b"").is_ok(),
            handler: Box::new(move |call, body| match parse::<Req>(body) {
                Ok(request) => handler(call, request)
                    .map(|answer| answer.map(|a| serde_json::to_value(a).expect("serialises")))
                    .boxed(),
                Err(e) => futures::future::ready(Err(e)).boxed(),
            }),
        }
    }

    /// `group.name`.
    pub fn full_name(&self) -> String {
        format!("{}.{}", self.group, self.name)
    }

    /// Checks the caller, parses the body and runs the handler.
    pub async fn call(&self, call: Call, body: &[u8]) -> Result<Value, ApiError> {
        self.access.check(&call.caller)?;
        (self.handler)(call, body).await
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
