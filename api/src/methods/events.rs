//! `events.list` and `GET /api/compute/events/stream` (server-sent events): the log as
//! CloudEvents, tenants seeing only their own events.

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use futures::Stream;
use serde::{Deserialize, Serialize};
use vps_domain::ErrorCode;
use vps_events::envelope::{cloud_event, stream_of, CloudEvent};
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
    /// Type patterns (`instance.*`): at most 64, each at most 128 characters.
    #[serde(
        default,
        deserialize_with = "vps_domain::bounds::strings::<_, MAX_TYPES, MAX_PATTERN>"
    )]
    #[schemars(length(max = 64), inner(length(max = 128)))]
    types: Vec<String>,
    /// Only this subject (`instance/inst_…`).
    subject: Option<String>,
    /// 1 to 1000 (default 100).
    limit: Option<i64>,
}

/// The most type patterns a list or a stream filters on.
const MAX_TYPES: usize = 64;
/// The longest type pattern.
const MAX_PATTERN: usize = 128;

/// A page of the log.
#[derive(Serialize, schemars::JsonSchema)]
pub struct EventPage {
    /// CloudEvents, in log order.
    items: Vec<CloudEvent>,
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
        (None, false) => Err(ApiError::new(
            ErrorCode::AccessDenied,
            "nodes do not read events",
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
    // A stream is `events.list` held open: the same Cedar decision, on the same resource.
    let list = crate::methods::registry()
        .get("events", "list")
        .expect("events.list is registered");
    let guard = crate::authz::Guard {
        snapshot: state.authz.snapshot(),
        principal: caller.principal(),
        action: list.action.clone(),
    };
    list.admit(&guard, &caller, b"{}")?;
    let types: Vec<String> = q
        .types
        .map(|t| {
            t.split(',')
                .take(MAX_TYPES + 1)
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default();
    if types.len() > MAX_TYPES {
        return Err(ApiError::invalid(
            "types",
            format!("at most {MAX_TYPES} patterns"),
        ));
    }
    if let Some(i) = types.iter().position(|t| t.chars().count() > MAX_PATTERN) {
        return Err(ApiError::invalid(
            &format!("types[{i}]"),
            format!("longer than {MAX_PATTERN} characters"),
        ));
    }
    let filter = filter(&caller, types, q.subject)?;
    let resume = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_string)
        .or(q.after);
    let after = cursor("Last-Event-ID", resume.as_deref())?;
    let slot = state.guards.stream(&stream_owner(&caller))?;
    let (pool, notifier) = (state.pool.clone(), state.notifier.clone());
    let events = async_stream(move |tx| async move {
        // Held for as long as the task runs: the stream counts until it is really gone.
        let _slot = slot;
        follow(pool, notifier, filter, after, tx).await;
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// Whose allowance an event stream counts against: its tenant, or an operator identity's own.
fn stream_owner(caller: &Caller) -> String {
    match &caller.actor.tenant {
        Some(tenant) if !caller.actor.operator => tenant.clone(),
        _ => format!("identity:{}", caller.actor.identity),
    }
}

/// Events read per page of the stream.
const STREAM_PAGE: i64 = 500;

/// Sends the events after `after` that pass `filter`, then each new one, until the client goes
/// away: also while nothing matches, since waiting for a wake-up watches the client too. Each
/// read starts where the last one got to, matching or not.
async fn follow(
    pool: sqlx::PgPool,
    notifier: vps_events::Notifier,
    filter: Filter,
    mut after: Cursor,
    tx: Sender,
) {
    let mut wake = notifier.subscribe_readable();
    loop {
        wake.borrow_and_update();
        let pause = match notifier.read_page(&pool, after, &filter, STREAM_PAGE).await {
            Ok(page) => {
                for e in &page.events {
                    let event = Event::default()
                        .id(e.cursor().to_string())
                        .event(e.event_type.clone())
                        .data(cloud_event(e).to_string());
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                after = page.next;
                // A full page means more is readable now.
                (page.events.len() < STREAM_PAGE as usize).then_some(Duration::from_millis(500))
            }
            Err(e) => {
                tracing::warn!(error = %e, "event stream read failed");
                Some(Duration::from_secs(1))
            }
        };
        if let Some(pause) = pause {
            tokio::select! {
                () = tx.closed() => return,
                _ = tokio::time::timeout(pause, wake.changed()) => {}
            }
        }
    }
}

type Sender = tokio::sync::mpsc::Sender<Result<Event, Infallible>>;

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
