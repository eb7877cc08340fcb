//! `instances.*`.

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};
use sqlx::types::Json;
use sqlx::Row;
use vps_commands::instances::{self, Change, CreateInput};
use vps_commands::Ctx;
use vps_domain::instance::Instance;
use vps_projections::views::instance_json;

use crate::error::ApiError;
use crate::rpc::{parse, Caller};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct CreateBody {
    #[serde(flatten)]
    input: CreateInput,
    wait: Option<Wait>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Wait {
    timeout_ms: u64,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct InstanceRef {
    tenant_id: String,
    instance_id: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct GetBody {
    tenant_id: String,
    instance_id: String,
    /// A cursor (`<transaction id>-<position>`) or an RFC 3339 time.
    as_of: Option<String>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ResizeBody {
    tenant_id: String,
    instance_id: String,
    flavor: String,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct ListBody {
    tenant_id: String,
    scope: Option<String>,
    state: Option<String>,
    pool_id: Option<String>,
    limit: Option<i64>,
    cursor: Option<String>,
}

/// Dispatches an `instances` method.
pub async fn handle(
    ctx: &Ctx,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    match method {
        "create" => create(ctx, caller, body).await,
        "get" => {
            let q: GetBody = parse(body)?;
            let tenant = caller.tenant(&q.tenant_id)?;
            let mut conn = ctx.pool.acquire().await?;
            let current = instances::visible(&mut conn, &tenant, &q.instance_id).await?;
            match q.as_of {
                None => Ok(instance_json(&current)),
                Some(as_of) => as_of_view(&mut conn, &q.instance_id, &as_of).await,
            }
        }
        "start" | "stop" | "delete" => {
            let q: InstanceRef = parse(body)?;
            let tenant = caller.tenant(&q.tenant_id)?;
            let change = match method {
                "start" => Change::Start,
                "stop" => Change::Stop,
                _ => Change::Delete,
            };
            Ok(instance_json(
                &instances::change(ctx, &tenant, &q.instance_id, change).await?,
            ))
        }
        "resize" => {
            let q: ResizeBody = parse(body)?;
            let tenant = caller.tenant(&q.tenant_id)?;
            Ok(instance_json(
                &instances::change(ctx, &tenant, &q.instance_id, Change::Resize(q.flavor)).await?,
            ))
        }
        "list" => list(ctx, caller, body).await,
        "history" => {
            let q: InstanceRef = parse(body)?;
            let tenant = caller.tenant(&q.tenant_id)?;
            let mut conn = ctx.pool.acquire().await?;
            instances::visible(&mut conn, &tenant, &q.instance_id).await?;
            let events =
                vps_events::read::read_stream(&mut *conn, &format!("instance-{}", q.instance_id))
                    .await?;
            let items: Vec<Value> = events
                .iter()
                .map(vps_events::envelope::cloud_event)
                .collect();
            Ok(json!({ "items": items }))
        }
        _ => Err(ApiError::new(
            "NOT_FOUND",
            format!("no method instances.{method}"),
        )),
    }
}

async fn create(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let mut q: CreateBody = parse(body)?;
    q.input.tenant_id = caller.tenant(&q.input.tenant_id)?;
    let wait = match q.wait {
        Some(w) if w.timeout_ms > 30_000 => {
            return Err(ApiError::invalid("wait.timeoutMs", "at most 30000"))
        }
        Some(w) => Duration::from_millis(w.timeout_ms),
        None => Duration::ZERO,
    };
    let mut instance = instances::create(ctx, q.input).await?;
    let deadline = Instant::now() + wait;
    while instance.state.is_settling() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50).min(deadline - Instant::now())).await;
        let mut conn = ctx.pool.acquire().await?;
        if let Some(now) = vps_projections::instances::load(&mut conn, &instance.id)
            .await
            .map_err(vps_commands::CommandError::from)?
        {
            instance = now;
        }
    }
    Ok(instance_json(&instance))
}

async fn list(ctx: &Ctx, caller: &Caller, body: &[u8]) -> Result<Value, ApiError> {
    let q: ListBody = parse(body)?;
    let tenant = caller.tenant(&q.tenant_id)?;
    let limit = q.limit.unwrap_or(50);
    if !(1..=200).contains(&limit) {
        return Err(ApiError::invalid("limit", "1 to 200"));
    }
    let owner = match q.scope.as_deref() {
        None | Some("all") => None,
        Some("mine") => Some(caller.actor.identity.clone()),
        Some(_) => return Err(ApiError::invalid("scope", "mine or all")),
    };
    if let Some(state) = &q.state {
        if serde_json::from_value::<vps_domain::state_table::InstanceState>(json!(state)).is_err() {
            return Err(ApiError::invalid("state", "not an instance state"));
        }
    }
    // The cursor is the last item's (createdAt in microseconds, id): newest first.
    let (before_micros, before_id) = match &q.cursor {
        None => (i64::MAX, String::new()),
        Some(c) => c
            .split_once('.')
            .and_then(|(t, id)| Some((t.parse::<i64>().ok()?, id.to_string())))
            .ok_or_else(|| ApiError::invalid("cursor", "not a cursor from a previous page"))?,
    };
    let rows = sqlx::query(
        "SELECT doc FROM instances
          WHERE tenant_id = $1 AND NOT warm
            AND ($2::text IS NULL OR owner_identity_id = $2)
            AND ($3::text IS NULL OR state = $3)
            AND ($4::text IS NULL OR pool_id = $4)
            AND (created_at, id) < (to_timestamp($5::float8 / 1e6), $6)
          ORDER BY created_at DESC, id DESC
          LIMIT $7",
    )
    .bind(&tenant)
    .bind(&owner)
    .bind(&q.state)
    .bind(&q.pool_id)
    .bind(before_micros as f64)
    .bind(if q.cursor.is_some() {
        before_id
    } else {
        "\u{10FFFF}".to_string()
    })
    .bind(limit + 1)
    .fetch_all(&ctx.pool)
    .await?;
    let mut items: Vec<Instance> = rows
        .iter()
        .map(|r| r.get::<Json<Instance>, _>(0).0)
        .collect();
    let more = items.len() as i64 > limit;
    items.truncate(limit as usize);
    let cursor = more
        .then(|| {
            items
                .last()
                .map(|i| format!("{}.{}", i.created_at.timestamp_micros(), i.id))
        })
        .flatten();
    Ok(json!({ "items": items.iter().map(instance_json).collect::<Vec<_>>(), "cursor": cursor }))
}

/// The instance as it was at a point of the log (time travel): its stream folded up to the
/// cursor or time. Before its creation it is `NOT_FOUND`.
async fn as_of_view(
    conn: &mut sqlx::PgConnection,
    id: &str,
    as_of: &str,
) -> Result<Value, ApiError> {
    enum Point {
        Cursor(vps_events::Cursor),
        Time(chrono::DateTime<chrono::Utc>),
    }
    let point = if let Ok(c) = as_of.parse::<vps_events::Cursor>() {
        Point::Cursor(c)
    } else if let Ok(t) = chrono::DateTime::parse_from_rfc3339(as_of) {
        Point::Time(t.with_timezone(&chrono::Utc))
    } else {
        return Err(ApiError::invalid("asOf", "a cursor or an RFC 3339 time"));
    };
    let events = vps_events::read::read_stream(&mut *conn, &format!("instance-{id}")).await?;
    let mut parsed = Vec::new();
    for e in events.iter().filter(|e| match &point {
        Point::Cursor(c) => e.cursor() <= *c,
        Point::Time(t) => e.recorded_at <= *t,
    }) {
        let event = vps_domain::instance::InstanceEvent::from_parts(&e.event_type, e.data.clone())
            .map_err(|err| ApiError::from(sqlx::Error::Decode(Box::new(err))))?;
        parsed.push((event, e.recorded_at));
    }
    let folded = vps_domain::instance::fold(parsed.iter().map(|(e, at)| (e, *at)))
        .map_err(|err| ApiError::from(sqlx::Error::Decode(Box::new(err))))?;
    folded
        .map(|i| instance_json(&i))
        .ok_or_else(|| ApiError::new("NOT_FOUND", format!("instance {id} did not exist yet")))
}
