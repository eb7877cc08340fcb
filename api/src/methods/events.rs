//! `events.list` and `GET /api/compute/events/stream` (server-sent events): the log as
//! CloudEvents, tenants seeing only their own events.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use vps_events::envelope::{cloud_event, stream_of};
use vps_events::read::{read_filtered, Filter};
use vps_events::Cursor;

use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Method};
use crate::request::{authenticate, Caller};
use crate::state::AppState;

/// `events.list`.
#[derive(Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListEvents {
    /// Start after this cursor.
    after: Option<String>,
    /// Type patterns (`instance.*`).
    #[serde(default)]
    types: Vec<String>,
    /// Only this subject (`instance/inst_…`).
    subject: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<i64>,
}

/// A page of the log.
#[derive(Serialize, schemars::JsonSchema)]
pub struct EventPage {
    /// CloudEvents, in log order.
    items: Vec<Value>,
    /// Where the next page starts.
    cursor: String,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![Method::new(
        "events",
        "list",
        Tenant,
        "One page of the log as CloudEvents.",
        list,
    )]
}

/// The tenant whose events a caller sees: its own, or everything for operators.
pub fn scope(caller: &Caller) -> Result<Option<String>, ApiError> {
    match (&caller.actor.tenant, caller.actor.operator) {
        (_, true) => Ok(None),
        (Some(t), false) => Ok(Some(t.clone())),
        (None, false) => Err(ApiError::new("ACCESS_DENIED", "nodes do not read events")),
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

async fn list(c: Call, q: ListEvents) -> Result<EventPage, ApiError> {
    let limit = q.limit.unwrap_or(100);
    if !(1..=1000).contains(&limit) {
        return Err(ApiError::invalid("limit", "1 to 1000"));
    }
    let after = cursor("after", q.after.as_deref())?;
    let filter = filter(&c.caller, q.types, q.subject)?;
    let events = read_filtered(&c.ctx.pool, after, &filter, limit).await?;
    let next = events.last().map(|e| e.cursor()).unwrap_or(after);
    Ok(EventPage {
        items: events.iter().map(cloud_event).collect(),
        cursor: next.to_string(),
    })
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
