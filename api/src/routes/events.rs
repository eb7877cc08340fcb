//! `webhooks.*`, `events.list` and the server-sent event stream.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde::Deserialize;
use serde_json::{json, Value};
use vps_commands::Ctx;
use vps_events::envelope::{cloud_event, stream_of};
use vps_events::read::{read_filtered, Filter};
use vps_events::Cursor;
use vps_reactors::webhooks::{self, DeleteWebhook, NewWebhook, WebhookError};

use crate::error::ApiError;
use crate::rpc::{authenticate, parse, Caller};
use crate::server::AppState;

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateWebhook {
    url: String,
    types: Vec<String>,
    tenant_id: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct WebhookRef {
    webhook_id: String,
    limit: Option<i64>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListEvents {
    after: Option<String>,
    #[serde(default)]
    types: Vec<String>,
    subject: Option<String>,
    limit: Option<i64>,
}

impl From<WebhookError> for ApiError {
    fn from(e: WebhookError) -> Self {
        match e {
            WebhookError::Invalid { field, message } => ApiError::invalid(field, message),
            WebhookError::NotFound(what) => ApiError::new("NOT_FOUND", format!("{what} not found")),
            other => {
                tracing::error!(error = %other, "webhook command failed");
                ApiError::new("INTERNAL", "internal error; see the server log")
            }
        }
    }
}

/// The tenant whose events a caller sees: its own, or everything for operators.
fn scope(caller: &Caller) -> Result<Option<String>, ApiError> {
    match (&caller.actor.tenant, caller.actor.operator) {
        (_, true) => Ok(None),
        (Some(t), false) => Ok(Some(t.clone())),
        (None, false) => Err(ApiError::new("ACCESS_DENIED", "nodes do not read events")),
    }
}

/// Dispatches `webhooks.*`.
pub async fn webhooks(
    ctx: &Ctx,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    let tenant_scope = scope(caller)?;
    match method {
        "create" => {
            let q: CreateWebhook = parse(body)?;
            let tenant_id = match (&tenant_scope, q.tenant_id) {
                (Some(own), Some(asked)) if own != &asked => {
                    return Err(ApiError::new(
                        "NOT_FOUND",
                        format!("tenant {asked} not found"),
                    ))
                }
                (Some(own), _) => Some(own.clone()),
                (None, asked) => asked,
            };
            let (hook, secret) = webhooks::create_webhook(
                &ctx.pool,
                &ctx.notifier,
                NewWebhook {
                    url: q.url,
                    types: q.types,
                    tenant_id,
                    actor: ctx.actor.identity.clone(),
                },
            )
            .await?;
            let mut view = serde_json::to_value(&hook).expect("serialises");
            view["secret"] = json!(secret.0);
            Ok(view)
        }
        "list" => {
            let _: Value = parse(body)?;
            Ok(
                json!({ "items": webhooks::list_webhooks(&ctx.pool, tenant_scope.as_deref()).await? }),
            )
        }
        "delete" => {
            let q: WebhookRef = parse(body)?;
            webhooks::delete_webhook(
                &ctx.pool,
                &ctx.notifier,
                DeleteWebhook {
                    id: q.webhook_id.clone(),
                    tenant_scope,
                    actor: ctx.actor.identity.clone(),
                },
            )
            .await?;
            Ok(json!({ "id": q.webhook_id, "deleted": true }))
        }
        "deliveries" => {
            let q: WebhookRef = parse(body)?;
            webhooks::get_webhook(&ctx.pool, &q.webhook_id, tenant_scope.as_deref())
                .await?
                .ok_or_else(|| {
                    ApiError::new("NOT_FOUND", format!("webhook {} not found", q.webhook_id))
                })?;
            let limit = q.limit.unwrap_or(100);
            if !(1..=1000).contains(&limit) {
                return Err(ApiError::invalid("limit", "1 to 1000"));
            }
            Ok(
                json!({ "items": webhooks::list_deliveries(&ctx.pool, &q.webhook_id, limit).await? }),
            )
        }
        _ => Err(ApiError::new(
            "NOT_FOUND",
            format!("no method webhooks.{method}"),
        )),
    }
}

fn filter(
    caller: &Caller,
    types: Vec<String>,
    subject: Option<String>,
) -> Result<Filter, ApiError> {
    for (i, t) in types.iter().enumerate() {
        vps_events::pattern::validate(t)
            .map_err(|m| ApiError::invalid(&format!("types[{i}]"), m))?;
    }
    Ok(Filter {
        types,
        stream: subject.as_deref().map(stream_of),
        tenant_id: scope(caller)?,
        whole_snapshot: false,
    })
}

fn cursor(field: &str, value: Option<&str>) -> Result<Cursor, ApiError> {
    match value {
        None | Some("") => Ok(Cursor::START),
        Some(c) => c
            .parse()
            .map_err(|_| ApiError::invalid(field, "not a cursor from this API")),
    }
}

/// `events.list`.
pub async fn list(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let q: ListEvents = parse(body)?;
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit", "1 to 1000"));
    }
    let after = cursor("after", q.after.as_deref())?;
    let filter = filter(caller, q.types, q.subject)?;
    let events = read_filtered(&ctx.pool, after, &filter, limit).await?;
    let next = events.last().map(|e| e.cursor()).unwrap_or(after);
    Ok(
        json!({ "items": events.iter().map(cloud_event).collect::<Vec<_>>(), "cursor": next.to_string() }),
    )
}

/// Query parameters of the stream.
#[derive(Deserialize, Default)]
pub struct StreamQuery {
    /// Comma-separated type patterns.
    types: Option<String>,
    /// Only this subject.
    subject: Option<String>,
    /// Start after this cursor (`Last-Event-ID` wins).
    after: Option<String>,
}

/// `GET /api/compute/events/stream`: the log as server-sent events; `id` is the cursor, and
/// `Last-Event-ID` resumes exactly after it.
pub async fn stream(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<StreamQuery>,
) -> Result<Sse<impl Stream<Item = Result<Event, Infallible>>>, ApiError> {
    let caller = authenticate(&state, &headers).await?;
    let types = q
        .types
        .map(|t| t.split(',').map(str::to_string).collect())
        .unwrap_or_default();
    let filter = filter(&caller, types, q.subject)?;
    let resume = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.after);
    let mut after = cursor("Last-Event-ID", resume.as_deref())?;
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    let events = async_stream(move |tx| async move {
        let mut wake = notifier.subscribe();
        loop {
            wake.borrow_and_update();
            let page = match read_filtered(&pool, after, &filter, 500).await {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(error = %e, "event stream read failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            for e in &page {
                let event = Event::default()
                    .id(e.cursor().to_string())
                    .event(e.event_type.clone())
                    .data(cloud_event(e).to_string());
                if tx.send(Ok(event)).await.is_err() {
                    return;
                }
                after = e.cursor();
            }
            if page.is_empty() {
                let _ = tokio::time::timeout(Duration::from_millis(500), wake.changed()).await;
            }
        }
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// A stream fed by a task; the task ends when the client goes away.
fn async_stream<F, Fut>(produce: F) -> impl Stream<Item = Result<Event, Infallible>>
where
    F: FnOnce(tokio::sync::mpsc::Sender<Result<Event, Infallible>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    tokio::spawn(produce(tx));
    futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    })
}
