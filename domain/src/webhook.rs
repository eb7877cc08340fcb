//! The webhook subscription aggregate: its events (the wire types and data the log already
//! holds), its state folded from the stream `webhook-<id>`, and the pure decision behind
//! `webhooks.create`, `webhooks.delete` and the delivery worker's `410 Gone`.
//!
//! The signing secret is not here: it never enters the log (commands keep it aside). The form of
//! each type pattern is checked by the caller with `vps_events::pattern::validate`, the one
//! definition subscribers are matched with; `events` sits beside this crate, not below it.

use std::net::IpAddr;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::aggregate::{parse_tagged, tagged_data, Aggregate, Event, FoldError};
use crate::network::{is_local_name, reachable, IpCidr};
use crate::DomainError;

/// The stream category: `webhook-<id>`.
pub const CATEGORY: &str = "webhook";
/// The longest URL a subscription may POST to.
pub const MAX_URL_LEN: usize = 2048;
/// The most subscriptions (not deleted) one tenant may have; operators' all-tenant ones count
/// as one more group. Every subscription costs a match per event and a delivery queue.
pub const MAX_PER_TENANT: usize = 50;
/// The most type patterns one subscription has.
pub const MAX_TYPES: usize = 64;
/// The longest type pattern.
pub const MAX_PATTERN_LEN: usize = 128;
/// Why the delivery worker disables a subscription.
pub const GONE_REASON: &str = "the endpoint answered 410 Gone";

/// `webhook.created`: `{ id, url, types, tenantId? }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Created {
    /// `whk_…`.
    pub id: String,
    /// Where deliveries are POSTed.
    pub url: String,
    /// Type patterns, duplicates removed.
    pub types: Vec<String>,
    /// When set, only this tenant's events are delivered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
}

/// `webhook.deleted`: `{ id }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deleted {
    /// The subscription.
    pub id: String,
}

/// `webhook.disabled`: `{ id, reason, responseCode }`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Disabled {
    /// The subscription.
    pub id: String,
    /// For people.
    pub reason: String,
    /// The HTTP status that disabled it.
    pub response_code: u16,
}

/// A webhook event, one variant per wire type.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", content = "data")]
pub enum WebhookEvent {
    /// Subscribed.
    #[serde(rename = "webhook.created")]
    Created(Created),
    /// Removed by its owner.
    #[serde(rename = "webhook.deleted")]
    Deleted(Deleted),
    /// The endpoint answered `410 Gone`.
    #[serde(rename = "webhook.disabled")]
    Disabled(Disabled),
}

impl WebhookEvent {
    /// The subscription the event is about.
    pub fn webhook_id(&self) -> &str {
        match self {
            WebhookEvent::Created(e) => &e.id,
            WebhookEvent::Deleted(e) => &e.id,
            WebhookEvent::Disabled(e) => &e.id,
        }
    }
}

impl Event for WebhookEvent {
    fn event_type(&self) -> &'static str {
        match self {
            WebhookEvent::Created(_) => "webhook.created",
            WebhookEvent::Deleted(_) => "webhook.deleted",
            WebhookEvent::Disabled(_) => "webhook.disabled",
        }
    }

    fn data(&self) -> Value {
        tagged_data(self)
    }

    fn from_parts(event_type: &str, data: Value) -> Result<Self, FoldError> {
        parse_tagged(event_type, data)
    }
}

/// The life of a subscription.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum WebhookState {
    /// Deliveries are made.
    Active,
    /// The endpoint answered `410 Gone`; nothing more is delivered.
    Disabled,
    /// Deleted by its owner.
    Deleted,
}

impl WebhookState {
    /// The form stored in `webhooks.state`.
    pub fn as_str(self) -> &'static str {
        match self {
            WebhookState::Active => "active",
            WebhookState::Disabled => "disabled",
            WebhookState::Deleted => "deleted",
        }
    }

    /// Reads the stored form; anything unknown counts as gone.
    pub fn parse(s: &str) -> WebhookState {
        match s {
            "active" => WebhookState::Active,
            "disabled" => WebhookState::Disabled,
            _ => WebhookState::Deleted,
        }
    }
}

/// A subscription folded from its stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Webhook {
    /// `whk_…`.
    pub id: String,
    /// Where deliveries are POSTed.
    pub url: String,
    /// Type patterns.
    pub types: Vec<String>,
    /// When set, only this tenant's events are delivered, and only it may delete it.
    pub tenant_id: Option<String>,
    /// Where it stands.
    pub state: WebhookState,
    /// When `webhook.created` was recorded.
    pub created_at: DateTime<Utc>,
    /// Events in its stream.
    pub version: u64,
}

impl Aggregate for Webhook {
    type Event = WebhookEvent;
    const CATEGORY: &'static str = CATEGORY;

    fn create(event: &WebhookEvent, at: DateTime<Utc>) -> Option<Self> {
        let WebhookEvent::Created(c) = event else {
            return None;
        };
        Some(Webhook {
            id: c.id.clone(),
            url: c.url.clone(),
            types: c.types.clone(),
            tenant_id: c.tenant_id.clone(),
            state: WebhookState::Active,
            created_at: at,
            version: 1,
        })
    }

    fn apply(&mut self, event: &WebhookEvent, _at: DateTime<Utc>) {
        match event {
            WebhookEvent::Created(_) => {}
            WebhookEvent::Deleted(_) => self.state = WebhookState::Deleted,
            // A deleted subscription stays deleted, as the projection keeps it.
            WebhookEvent::Disabled(_) => {
                if self.state != WebhookState::Deleted {
                    self.state = WebhookState::Disabled;
                }
            }
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// What may be asked of a subscription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WebhookCommand {
    /// Subscribe `url` to `types` (patterns whose form the caller has checked).
    Create {
        /// The fresh `whk_…` id.
        id: String,
        /// `http://` or `https://` with a host.
        url: String,
        /// At least one pattern.
        types: Vec<String>,
        /// The tenant asked for (operators: any or none).
        tenant_id: Option<String>,
        /// The caller's tenant (`None`: an operator).
        tenant_scope: Option<String>,
        /// Facts: where the URL's host resolves, what the operator allows, how many
        /// subscriptions the tenant already has.
        facts: CreateFacts,
    },
    /// Remove it; only its tenant (or an operator) may.
    Delete {
        /// The subscription.
        id: String,
        /// The caller's tenant (`None`: an operator).
        tenant_scope: Option<String>,
    },
    /// Stop delivering: the endpoint answered `response_code` (410).
    Disable {
        /// The subscription.
        id: String,
        /// The HTTP status.
        response_code: u16,
    },
}

/// What a create is decided on besides its request.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CreateFacts {
    /// The addresses the URL's host resolved to (empty when it is an IP literal, or when it
    /// did not resolve: delivery checks again at connect time).
    pub resolved: Vec<IpAddr>,
    /// Internal networks the operator lets webhooks reach (`[webhooks] allow_private`).
    pub allow_private: Vec<IpCidr>,
    /// The subscriptions (not deleted) of the tenant the new one would belong to.
    pub existing: usize,
}

/// Decides `command` on the subscription as it stands (`None`: its stream is empty). A command
/// that changes nothing (disabling one that is no longer active) decides no event. No rule
/// depends on the time: `createdAt` is the time the log records.
pub fn decide(
    state: Option<&Webhook>,
    command: WebhookCommand,
) -> Result<Vec<WebhookEvent>, DomainError> {
    match command {
        WebhookCommand::Create {
            id,
            url,
            types,
            tenant_id,
            tenant_scope,
            facts,
        } => {
            if state.is_some() {
                return Err(DomainError::invalid_state(format!("webhook {id} exists")));
            }
            let parsed = check_url(&url)?;
            check_target(&parsed, &facts)?;
            let types = dedup_types(types)?;
            let tenant_id = tenant_of(tenant_scope, tenant_id)?;
            if facts.existing >= MAX_PER_TENANT {
                return Err(DomainError::invalid_state(format!(
                    "{} already has {} webhooks, the most allowed; delete one first",
                    tenant_id.as_deref().unwrap_or("the operator"),
                    facts.existing
                )));
            }
            Ok(vec![WebhookEvent::Created(Created {
                id,
                url,
                types,
                tenant_id,
            })])
        }
        WebhookCommand::Delete { id, tenant_scope } => {
            visible(state, tenant_scope.as_deref(), &id)?;
            Ok(vec![WebhookEvent::Deleted(Deleted { id })])
        }
        WebhookCommand::Disable { id, response_code } => Ok(match state {
            Some(hook) if hook.state == WebhookState::Active => {
                vec![WebhookEvent::Disabled(Disabled {
                    id,
                    reason: GONE_REASON.to_string(),
                    response_code,
                })]
            }
            _ => Vec::new(),
        }),
    }
}

/// Whether the subscription exists, is not deleted, and `tenant_scope` may see it. Another
/// tenant's is `NOT_FOUND`, so tenants cannot learn which ids exist.
fn visible(
    state: Option<&Webhook>,
    tenant_scope: Option<&str>,
    id: &str,
) -> Result<(), DomainError> {
    match state {
        Some(hook)
            if hook.state != WebhookState::Deleted
                && (tenant_scope.is_none() || tenant_scope == hook.tenant_id.as_deref()) =>
        {
            Ok(())
        }
        _ => Err(DomainError::NotFound {
            what: format!("webhook {id}"),
        }),
    }
}

/// The tenant a new subscription is scoped to: a tenant's own (naming another is `NOT_FOUND`,
/// as if it did not exist); an operator's choice.
fn tenant_of(
    tenant_scope: Option<String>,
    asked: Option<String>,
) -> Result<Option<String>, DomainError> {
    match (tenant_scope, asked) {
        (Some(own), Some(asked)) if own != asked => Err(DomainError::NotFound {
            what: format!("tenant {asked}"),
        }),
        (Some(own), _) => Ok(Some(own)),
        (None, asked) => Ok(asked),
    }
}

/// An absolute `http(s)` URL with a host, at most [`MAX_URL_LEN`] long.
fn check_url(url: &str) -> Result<url::Url, DomainError> {
    let invalid = |message: String| DomainError::invalid_input("url", message);
    if url.len() > MAX_URL_LEN {
        return Err(invalid(format!("longer than {MAX_URL_LEN} characters")));
    }
    let parsed = url::Url::parse(url).map_err(|e| invalid(format!("not a URL: {e}")))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(invalid("must be an http:// or https:// URL".into()));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err(invalid("must name a host".into()));
    }
    Ok(parsed)
}

/// The URL's host as an address, when it is an IP literal.
pub fn literal_address(url: &url::Url) -> Option<IpAddr> {
    match url.host()? {
        url::Host::Ipv4(v4) => Some(IpAddr::V4(v4)),
        url::Host::Ipv6(v6) => Some(IpAddr::V6(v6)),
        url::Host::Domain(_) => None,
    }
}

/// Refuses a URL whose host is, or resolves into, a network internal to the control plane
/// that the operator did not allow.
fn check_target(url: &url::Url, facts: &CreateFacts) -> Result<(), DomainError> {
    // The refusal names neither the address nor the network: naming what a name resolved
    // to would map the control plane's split-horizon DNS for whoever asks.
    let refuse = || {
        DomainError::invalid_input(
            "url",
            "resolves to an address that is not allowed; webhooks may not target it",
        )
    };
    let loopback = IpAddr::V4(std::net::Ipv4Addr::LOCALHOST);
    let local_name = url.host_str().is_some_and(is_local_name);
    if local_name && !reachable(loopback, &facts.allow_private) {
        return Err(refuse());
    }
    let addresses = literal_address(url)
        .into_iter()
        .chain(facts.resolved.iter().copied());
    for address in addresses {
        if !reachable(address, &facts.allow_private) {
            return Err(refuse());
        }
    }
    Ok(())
}

/// At least one pattern, at most [`MAX_TYPES`]; duplicates removed (O(n log n)), order kept.
fn dedup_types(types: Vec<String>) -> Result<Vec<String>, DomainError> {
    if types.is_empty() {
        return Err(DomainError::invalid_input(
            "types",
            "at least one event type pattern is required (e.g. `instance.*`)",
        ));
    }
    check_types(&types)?;
    let mut seen = std::collections::BTreeSet::new();
    Ok(types
        .into_iter()
        .filter(|t| seen.insert(t.clone()))
        .collect())
}

/// The bound on a subscription's patterns: at most [`MAX_TYPES`], each at most
/// [`MAX_PATTERN_LEN`] characters. The API refuses more while parsing; this holds every
/// other caller to it too.
pub fn check_types(types: &[String]) -> Result<(), DomainError> {
    if types.len() > MAX_TYPES {
        return Err(DomainError::invalid_input(
            "types",
            format!("at most {MAX_TYPES} patterns"),
        ));
    }
    match types
        .iter()
        .position(|t| t.chars().count() > MAX_PATTERN_LEN)
    {
        Some(i) => Err(DomainError::invalid_input(
            format!("types[{i}]"),
            format!("longer than {MAX_PATTERN_LEN} characters"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn at() -> DateTime<Utc> {
        DateTime::from_timestamp(1_700_000_000, 0).unwrap()
    }

    fn hook(tenant: Option<&str>, state: WebhookState) -> Webhook {
        Webhook {
            id: "whk_1".into(),
            url: "https://example.com/h".into(),
            types: vec!["instance.*".into()],
            tenant_id: tenant.map(Into::into),
            state,
            created_at: at(),
            version: 1,
        }
    }

    fn create(
        url: &str,
        types: &[&str],
        asked: Option<&str>,
        scope: Option<&str>,
    ) -> WebhookCommand {
        WebhookCommand::Create {
            id: "whk_1".into(),
            url: url.into(),
            types: types.iter().map(|t| t.to_string()).collect(),
            tenant_id: asked.map(Into::into),
            tenant_scope: scope.map(Into::into),
            facts: CreateFacts {
                allow_private: vec!["127.0.0.0/8".parse().unwrap()],
                ..CreateFacts::default()
            },
        }
    }

    fn delete(scope: Option<&str>) -> WebhookCommand {
        WebhookCommand::Delete {
            id: "whk_1".into(),
            tenant_scope: scope.map(Into::into),
        }
    }

    fn created(types: &[&str], tenant: Option<&str>) -> WebhookEvent {
        WebhookEvent::Created(Created {
            id: "whk_1".into(),
            url: "https://example.com/h".into(),
            types: types.iter().map(|t| t.to_string()).collect(),
            tenant_id: tenant.map(Into::into),
        })
    }

    fn deleted() -> WebhookEvent {
        WebhookEvent::Deleted(Deleted { id: "whk_1".into() })
    }

    fn disabled() -> WebhookEvent {
        WebhookEvent::Disabled(Disabled {
            id: "whk_1".into(),
            reason: GONE_REASON.into(),
            response_code: 410,
        })
    }

    const URL: &str = "https://example.com/h";

    #[test]
    fn create_checks_the_url_the_patterns_and_the_tenant() {
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        let port = "http://127.0.0.1:8080/hook";
        type Row<'a> = (&'a str, &'a [&'a str], Option<&'a str>, Option<&'a str>);
        type Kept<'a> = Result<(&'a [&'a str], Option<&'a str>), crate::error::ErrorCode>;
        // (url, patterns, tenant asked, caller's tenant) → (patterns kept, tenant) or the code
        let cases: Vec<(Row, Kept)> = vec![
            (
                (URL, &["instance.*"], None, None),
                Ok((&["instance.*"], None)),
            ),
            ((port, &["*"], None, None), Ok((&["*"], None))),
            (
                (URL, &["a.*", "*", "a.*"], None, None),
                Ok((&["a.*", "*"], None)),
            ),
            (
                (URL, &["*"], None, Some("acme")),
                Ok((&["*"], Some("acme"))),
            ),
            (
                (URL, &["*"], Some("acme"), Some("acme")),
                Ok((&["*"], Some("acme"))),
            ),
            (
                (URL, &["*"], Some("acme"), None),
                Ok((&["*"], Some("acme"))),
            ),
            (
                (URL, &["*"], Some("globex"), Some("acme")),
                Err(crate::error::ErrorCode::NotFound),
            ),
            (
                (URL, &[], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
            (
                ("ftp://example.com/", &["*"], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
            (
                ("mailto:a@b.c", &["*"], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
            (
                ("not a url", &["*"], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
            (
                ("http://", &["*"], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
            (
                (&long, &["*"], None, None),
                Err(crate::error::ErrorCode::InvalidInput),
            ),
        ];
        for ((url, types, asked, scope), expected) in cases {
            let got = decide(None, create(url, types, asked, scope)).map_err(|e| e.code());
            let expected = expected.map(|(kept, tenant)| {
                vec![WebhookEvent::Created(Created {
                    id: "whk_1".into(),
                    url: url.into(),
                    types: kept.iter().map(|t| t.to_string()).collect(),
                    tenant_id: tenant.map(Into::into),
                })]
            });
            assert_eq!(got, expected, "{url} {types:?} {asked:?} {scope:?}");
        }
        let exists = hook(None, WebhookState::Active);
        let twice = decide(Some(&exists), create(URL, &["*"], None, None));
        assert_eq!(
            twice.unwrap_err().code(),
            crate::error::ErrorCode::InvalidState
        );
    }

    #[test]
    fn create_refuses_internal_targets_the_operator_did_not_allow() {
        let with = |url: &str, resolved: &[&str], allow: &[&str], existing: usize| {
            let mut command = create(url, &["*"], None, Some("acme"));
            if let WebhookCommand::Create { facts, .. } = &mut command {
                facts.resolved = resolved.iter().map(|a| a.parse().unwrap()).collect();
                facts.allow_private = allow.iter().map(|c| c.parse().unwrap()).collect();
                facts.existing = existing;
            }
            decide(None, command).map(|_| ()).map_err(|e| e.code())
        };
        let refused = Err(crate::error::ErrorCode::InvalidInput);
        assert_eq!(with("http://127.0.0.1:9/h", &[], &[], 0), refused);
        assert_eq!(
            with("http://127.0.0.1:9/h", &[], &["127.0.0.0/8"], 0),
            Ok(())
        );
        assert_eq!(
            with("http://169.254.169.254/latest", &[], &["127.0.0.0/8"], 0),
            refused
        );
        assert_eq!(with("http://10.0.0.8/h", &[], &[], 0), refused);
        assert_eq!(with("http://[fd00::1]/h", &[], &[], 0), refused);
        assert_eq!(with("http://[fe80::1]/h", &[], &[], 0), refused);
        assert_eq!(with("http://[::ffff:192.168.0.1]/h", &[], &[], 0), refused);
        assert_eq!(with("http://localhost:8080/h", &[], &[], 0), refused);
        assert_eq!(
            with("http://hooks.example/h", &["10.1.2.3"], &[], 0),
            refused
        );
        assert_eq!(
            with("http://hooks.example/h", &["93.184.215.14"], &[], 0),
            Ok(())
        );
        assert_eq!(with("https://93.184.215.14/h", &[], &[], 0), Ok(()));
        let full = with("https://hooks.example/h", &[], &[], MAX_PER_TENANT);
        assert_eq!(full, Err(crate::error::ErrorCode::InvalidState));
    }

    #[test]
    fn delete_and_disable_act_only_on_what_the_caller_may_see() {
        use WebhookState::*;
        let (active, global) = (hook(Some("acme"), Active), hook(None, Active));
        let (gone, off) = (hook(Some("acme"), Deleted), hook(Some("acme"), Disabled));
        let disable = WebhookCommand::Disable {
            id: "whk_1".into(),
            response_code: 410,
        };
        // (what, state, command, the events or the error code)
        type Case<'a> = (&'a str, Option<&'a Webhook>, WebhookCommand);
        let cases: Vec<(Case, Result<Vec<WebhookEvent>, crate::error::ErrorCode>)> = vec![
            (
                ("own", Some(&active), delete(Some("acme"))),
                Ok(vec![deleted()]),
            ),
            (
                ("operator", Some(&active), delete(None)),
                Ok(vec![deleted()]),
            ),
            (
                ("disabled", Some(&off), delete(Some("acme"))),
                Ok(vec![deleted()]),
            ),
            (
                ("another's", Some(&active), delete(Some("globex"))),
                Err(crate::error::ErrorCode::NotFound),
            ),
            (
                ("global", Some(&global), delete(Some("acme"))),
                Err(crate::error::ErrorCode::NotFound),
            ),
            (
                ("deleted", Some(&gone), delete(None)),
                Err(crate::error::ErrorCode::NotFound),
            ),
            (
                ("missing", None, delete(None)),
                Err(crate::error::ErrorCode::NotFound),
            ),
            (
                ("410", Some(&active), disable.clone()),
                Ok(vec![disabled()]),
            ),
            (("410 on disabled", Some(&off), disable.clone()), Ok(vec![])),
            (("410 on deleted", Some(&gone), disable.clone()), Ok(vec![])),
            (("410 on missing", None, disable), Ok(vec![])),
        ];
        for ((what, state, command), expected) in cases {
            assert_eq!(
                decide(state, command).map_err(|e| e.code()),
                expected,
                "{what}"
            );
        }
    }

    #[test]
    fn evolve_folds_each_event_and_refuses_broken_streams() {
        use WebhookState::*;
        let active = Some(hook(Some("acme"), Active));
        // (what, before, event, the state and version after, or an error)
        type Before<'a> = (&'a str, Option<Webhook>, WebhookEvent);
        type After = Option<(WebhookState, u64)>;
        let cases: Vec<(Before, After)> = vec![
            (
                ("created", None, created(&["*"], Some("acme"))),
                Some((Active, 1)),
            ),
            (("deleted", active.clone(), deleted()), Some((Deleted, 2))),
            (
                ("disabled", active.clone(), disabled()),
                Some((Disabled, 2)),
            ),
            (
                ("stays deleted", Some(hook(None, Deleted)), disabled()),
                Some((Deleted, 2)),
            ),
            (
                ("delete disabled", Some(hook(None, Disabled)), deleted()),
                Some((Deleted, 2)),
            ),
            (("not created", None, deleted()), None),
            (
                ("created twice", active.clone(), created(&["*"], None)),
                None,
            ),
        ];
        for ((what, before, event), expected) in cases {
            let got = Webhook::evolve(before, &event, at())
                .ok()
                .map(|h| (h.state, h.version));
            assert_eq!(got, expected, "{what}");
        }
        let folded = Webhook::evolve(None, &created(&["instance.*"], Some("acme")), at()).unwrap();
        assert_eq!(folded, hook(Some("acme"), Active));
    }

    #[test]
    fn events_keep_the_wire_types_and_data_the_log_holds() {
        let cases = [
            (
                created(&["instance.*"], Some("acme")),
                "webhook.created",
                json!({ "id": "whk_1", "url": URL, "types": ["instance.*"], "tenantId": "acme" }),
            ),
            (
                created(&["*"], None),
                "webhook.created",
                json!({ "id": "whk_1", "url": URL, "types": ["*"] }),
            ),
            (deleted(), "webhook.deleted", json!({ "id": "whk_1" })),
            (
                disabled(),
                "webhook.disabled",
                json!({ "id": "whk_1", "reason": "the endpoint answered 410 Gone", "responseCode": 410 }),
            ),
        ];
        for (event, wire, data) in cases {
            assert_eq!(event.event_type(), wire);
            assert_eq!(event.data(), data, "{wire}");
            assert_eq!(WebhookEvent::from_parts(wire, data).unwrap(), event);
        }
        assert!(WebhookEvent::from_parts("webhook.renamed", json!({ "id": "x" })).is_err());
    }
}
