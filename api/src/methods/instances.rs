//! `instances.*`: a tenant's instances (operators: any tenant's). Another tenant's instance is
//! `NOT_FOUND`, never `ACCESS_DENIED`.

use std::sync::Arc;
use std::time::Duration;

use super::common::Wait;
use chrono::{DateTime, Datelike, Utc};
use serde::{Deserialize, Serialize};
use vps_commands::instances::{self, Change, CreateInput};
use vps_domain::aggregate::Aggregate;
use vps_domain::authz::Resource;
use vps_domain::instance::Instance;
use vps_domain::state_table::InstanceState;
use vps_domain::ErrorCode;
use vps_events::envelope::{cloud_event, CloudEvent};
use vps_projections::instances::InstanceFilter;
use vps_projections::views::InstanceView;

use crate::error::ApiError;
use crate::registry::{Access::Tenant, Call, Items, Method};
use vps_domain::ids::{InstanceId, PoolId};

/// `instances.create`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateBody {
    #[serde(flatten)]
    input: CreateInput,
    /// Answer once the instance settles, or after the timeout.
    wait: Option<Wait>,
}

/// An instance by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceRef {
    /// The tenant.
    tenant_id: String,
    /// `inst_…`.
    instance_id: InstanceId,
}

/// `instances.delete`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct DeleteBody {
    /// The tenant.
    tenant_id: String,
    /// `inst_…`.
    instance_id: InstanceId,
    /// Delete at once without waiting for the host: everything is released now, and a host
    /// that still holds the instance is told to let it go.
    force: Option<bool>,
}

/// `instances.get`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GetBody {
    /// The tenant.
    tenant_id: String,
    /// `inst_…`.
    instance_id: InstanceId,
    /// A cursor (`<transaction id>-<position>`) or an RFC 3339 time: the instance as it was.
    as_of: Option<String>,
}

/// `instances.resize`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ResizeBody {
    /// The tenant.
    tenant_id: String,
    /// `inst_…`.
    instance_id: InstanceId,
    /// The new flavor's name.
    flavor: String,
}

/// `instances.list`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ListBody {
    /// The tenant.
    tenant_id: String,
    /// `mine` or `all` (default).
    scope: Option<String>,
    /// Only in this state.
    state: Option<InstanceState>,
    /// Only in this pool.
    pool_id: Option<PoolId>,
    /// 1 to 200 (default 50).
    limit: Option<i64>,
    /// The previous page's cursor.
    cursor: Option<String>,
    /// Only instances carrying every one of these labels (at most 32 pairs).
    labels: Option<vps_domain::labels::Labels>,
}

/// `instances.setLabels`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SetLabelsBody {
    /// The tenant.
    tenant_id: String,
    /// `inst_…`.
    instance_id: InstanceId,
    /// The labels (they replace the instance's): at most 32, Kubernetes label syntax.
    labels: vps_domain::labels::Labels,
}

/// A page of instances, newest first.
#[derive(Serialize, schemars::JsonSchema)]
pub struct InstancePage {
    /// The instances.
    items: Vec<InstanceView>,
    /// Present when there are more.
    cursor: Option<String>,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "instances",
            "create",
            Tenant,
            "Creates an instance (idempotent by key).",
            create,
        ),
        Method::new(
            "instances",
            "get",
            Tenant,
            "One instance, now or as it was (`asOf`).",
            get,
        ),
        Method::new(
            "instances",
            "list",
            Tenant,
            "A tenant's instances, newest first.",
            list,
        ),
        Method::new(
            "instances",
            "start",
            Tenant,
            "Wants the instance running.",
            |c: Call, q: InstanceRef| change(c, q, Change::Start),
        ),
        Method::new(
            "instances",
            "stop",
            Tenant,
            "Wants the instance stopped.",
            |c: Call, q: InstanceRef| change(c, q, Change::Stop),
        ),
        Method::new(
            "instances",
            "delete",
            Tenant,
            "Deletes the instance (`force`: at once, without waiting for the host).",
            |c: Call, q: DeleteBody| {
                let how = match q.force {
                    Some(true) => Change::ForceDelete,
                    _ => Change::Delete,
                };
                let r = InstanceRef {
                    tenant_id: q.tenant_id,
                    instance_id: q.instance_id,
                };
                change(c, r, how)
            },
        ),
        Method::new(
            "instances",
            "resize",
            Tenant,
            "Moves the instance to another flavor.",
            |c: Call, q: ResizeBody| {
                change(
                    c,
                    InstanceRef {
                        tenant_id: q.tenant_id,
                        instance_id: q.instance_id,
                    },
                    Change::Resize(q.flavor),
                )
            },
        ),
        Method::new(
            "instances",
            "setLabels",
            Tenant,
            "Replaces an instance's labels.",
            set_labels,
        ),
        Method::new(
            "instances",
            "history",
            Tenant,
            "Every event of the instance.",
            history,
        ),
    ]
}

async fn create(c: Call, mut q: CreateBody) -> Result<InstanceView, ApiError> {
    q.input.tenant_id = c.caller.tenant(&q.input.tenant_id)?;
    let wait = q.wait.as_ref().map_or(Ok(Duration::ZERO), Wait::duration)?;
    // Decided in the admission batch, on the facts it reads (no read of its own).
    let (guard, tenant) = (c.guard.clone(), q.input.tenant_id.clone());
    let gate: instances::Gate = Arc::new(move |id, draft| {
        let draft = Resource::instance_draft(id, &tenant, draft);
        guard.refusal(&guard.action, &draft)
    });
    let created = c.admitter.create(&c.ctx, q.input, gate).await?;
    let id = created.id.clone();
    let settled = |i: &Instance| !i.state.is_settling();
    let load = vps_projections::instances::load;
    let row = (crate::wait::Table::Instances, id.as_str());
    let instance = crate::wait::settled(
        &c.ctx,
        (&c.guards, &c.watched),
        wait,
        created,
        row,
        settled,
        load,
    )
    .await?;
    Ok(InstanceView::from(&instance))
}

async fn get(c: Call, q: GetBody) -> Result<InstanceView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let mut conn = c.ctx.pool.acquire().await?;
    let current = instances::visible(&mut conn, &tenant, &q.instance_id).await?;
    match q.as_of {
        None => Ok(InstanceView::from(&current)),
        Some(as_of) => as_of_view(&mut conn, &q.instance_id, &as_of).await,
    }
}

async fn change(c: Call, q: InstanceRef, change: Change) -> Result<InstanceView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    // A resize is decided on the shape it leaves, read in its own transaction.
    let guard = &c.guard;
    let policy = |id: &str, draft: &vps_domain::authz::InstanceDraft| {
        guard.refusal(&guard.action, &Resource::instance_draft(id, &tenant, draft))
    };
    let instance =
        instances::change_deciding(&c.ctx, &tenant, &q.instance_id, change, &policy).await?;
    Ok(InstanceView::from(&instance))
}

async fn set_labels(c: Call, q: SetLabelsBody) -> Result<InstanceView, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    // Decided on the labels the instance would carry.
    let labeled = Resource::new("Instance", q.instance_id.as_str(), Some(tenant.clone()));
    c.authorize(&labeled.labeled(&q.labels))?;
    let instance = instances::set_labels(&c.ctx, &tenant, &q.instance_id, q.labels).await?;
    Ok(InstanceView::from(&instance))
}

async fn history(c: Call, q: InstanceRef) -> Result<Items<CloudEvent>, ApiError> {
    let tenant = c.caller.tenant(&q.tenant_id)?;
    let mut conn = c.ctx.pool.acquire().await?;
    instances::visible(&mut conn, &tenant, &q.instance_id).await?;
    let events =
        vps_events::read::read_stream(&mut *conn, &Instance::stream(&q.instance_id)).await?;
    Ok(events.iter().map(cloud_event).collect::<Vec<_>>().into())
}

async fn list(c: Call, q: ListBody) -> Result<InstancePage, ApiError> {
    let tenant_id = c.caller.tenant(&q.tenant_id)?;
    let limit = super::page_limit(q.limit)?;
    let owner = super::scope_owner(&c, q.scope.as_deref(), super::Scope::All)?;
    let filter = InstanceFilter {
        tenant_id,
        owner,
        state: q.state.map(|s| s.as_str().to_string()),
        pool_id: q.pool_id.map(String::from),
        before: q.cursor.as_deref().map(parse_cursor).transpose()?,
        labels: super::common::label_filter(q.labels)?,
    };
    let items = vps_projections::instances::page(&c.ctx.pool, &filter, limit + 1)
        .await
        .map_err(vps_commands::CommandError::from)?;
    let (items, cursor) = super::split_page(items, limit, page_cursor);
    Ok(InstancePage {
        items: items.iter().map(InstanceView::from).collect(),
        cursor,
    })
}

/// A page's cursor: its last item's (createdAt in microseconds, id); pages run newest first.
fn page_cursor(i: &Instance) -> String {
    format!("{}.{}", i.created_at.timestamp_micros(), i.id)
}

fn parse_cursor(cursor: &str) -> Result<(DateTime<Utc>, String), ApiError> {
    cursor
        .split_once('.')
        .and_then(|(micros, id)| {
            let at = DateTime::from_timestamp_micros(micros.parse().ok()?)?;
            // Only times an instance can have been created at (and PostgreSQL can hold).
            (1970..=9999)
                .contains(&at.year())
                .then(|| (at, id.to_string()))
        })
        .ok_or_else(|| ApiError::invalid("cursor", "not a cursor from a previous page"))
}

/// The instance as it was at a point of the log (time travel): its stream folded up to the
/// cursor or time. Before its creation it is `NOT_FOUND`.
async fn as_of_view(
    conn: &mut sqlx::PgConnection,
    id: &str,
    as_of: &str,
) -> Result<InstanceView, ApiError> {
    enum Point {
        Cursor(vps_events::Cursor),
        Time(DateTime<Utc>),
    }
    let point = if let Ok(c) = as_of.parse::<vps_events::Cursor>() {
        Point::Cursor(c)
    } else if let Ok(t) = DateTime::parse_from_rfc3339(as_of) {
        Point::Time(t.with_timezone(&Utc))
    } else {
        return Err(ApiError::invalid("asOf", "a cursor or an RFC 3339 time"));
    };
    let events = vps_events::read::read_stream(&mut *conn, &Instance::stream(id)).await?;
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
    folded.map(|i| InstanceView::from(&i)).ok_or_else(|| {
        ApiError::new(
            ErrorCode::NotFound,
            format!("instance {id} did not exist yet"),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_create_body_refuses_unknown_keys_beside_its_flattened_input() {
        let body = serde_json::json!({
            "tenantId": "acme", "poolId": "pool_1", "flavor": "small", "imageId": "img_1",
            "idempotencyKey": "k", "wait": { "timeoutMs": 5 },
        });
        assert!(serde_json::from_value::<CreateBody>(body.clone()).is_ok());
        let mut extra = body;
        extra["bogus"] = 1.into();
        let refused = serde_json::from_value::<CreateBody>(extra).err().unwrap();
        assert!(
            refused.to_string().contains("unknown field `bogus`"),
            "{refused}"
        );
    }
}
