//! The `tenants` table, from the `tenant-<id>` streams (teardown), and the reads behind it.

use sqlx::{PgConnection, PgExecutor};
use vps_domain::tenant::{TenantEvent, TenantState};
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one `tenant.*` event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let (tenant, state) = match crate::typed::<TenantEvent>(e)? {
        TenantEvent::Deleting(t) => (t.tenant_id, TenantState::Deleting),
        TenantEvent::Deleted(t) => (t.tenant_id, TenantState::Deleted),
    };
    sqlx::query(
        "INSERT INTO tenants (id, state, position, updated_at) VALUES ($1, $2, $3, $4)
         ON CONFLICT (id) DO UPDATE SET state = $2, position = $3, updated_at = $4",
    )
    .bind(&tenant)
    .bind(state.as_str())
    .bind(e.position)
    .bind(e.recorded_at)
    .execute(conn)
    .await?;
    Ok(())
}

/// Tenants deleted or being deleted: they take no new work.
pub async fn deleted<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM tenants ORDER BY id")
        .fetch_all(db)
        .await
}

/// Tenants whose teardown is under way.
pub async fn deleting<'e>(db: impl PgExecutor<'e>) -> Result<Vec<String>, sqlx::Error> {
    sqlx::query_scalar("SELECT id FROM tenants WHERE state = 'deleting' ORDER BY id")
        .fetch_all(db)
        .await
}

/// What one step of a tenant's teardown sweeps, in a table of its family: the ids it acts on
/// next (`$1` the tenant, `$2` a pass's share) and how many are not gone yet. The statements
/// live here, beside the teardown's table, one pair per step.
pub struct Leftovers {
    due: &'static str,
    left: &'static str,
}

impl Leftovers {
    /// Up to `limit` ids the step acts on next.
    pub async fn due<'e>(
        &self,
        db: impl PgExecutor<'e>,
        tenant_id: &str,
        limit: i64,
    ) -> Result<Vec<String>, sqlx::Error> {
        sqlx::query_scalar(self.due)
            .bind(tenant_id)
            .bind(limit)
            .fetch_all(db)
            .await
    }

    /// How many the step still waits for.
    pub async fn left<'e>(
        &self,
        db: impl PgExecutor<'e>,
        tenant_id: &str,
    ) -> Result<i64, sqlx::Error> {
        sqlx::query_scalar(self.left)
            .bind(tenant_id)
            .fetch_one(db)
            .await
    }
}

/// Identities that still hold API keys.
pub const IDENTITIES_WITH_KEYS: Leftovers = Leftovers {
    due: "SELECT id FROM identities WHERE tenant_id = $1 AND keys > 0 ORDER BY id LIMIT $2",
    left: "SELECT count(*) FROM identities WHERE tenant_id = $1 AND keys > 0",
};

/// Webhooks not deleted.
pub const WEBHOOKS: Leftovers = Leftovers {
    due: "SELECT id FROM webhooks WHERE tenant_id = $1 AND state <> 'deleted' LIMIT $2",
    left: "SELECT count(*) FROM webhooks WHERE tenant_id = $1 AND state <> 'deleted'",
};

/// Live sandbox templates.
pub const TEMPLATES: Leftovers = Leftovers {
    due: "SELECT id FROM sandbox_templates WHERE tenant_id = $1 AND NOT deleted LIMIT $2",
    left: "SELECT count(*) FROM sandbox_templates WHERE tenant_id = $1 AND NOT deleted",
};

/// Sandboxes not asked to go yet; those not gone.
pub const SANDBOXES: Leftovers = Leftovers {
    due:
        "SELECT id FROM sandboxes WHERE tenant_id = $1 AND state IN ('starting', 'ready', 'failed')
           ORDER BY id LIMIT $2",
    left: "SELECT count(*) FROM sandboxes WHERE tenant_id = $1 AND state <> 'deleted'",
};

/// Live snapshots, kept ones included.
pub const SNAPSHOTS: Leftovers = Leftovers {
    due:
        "SELECT id FROM sandbox_snapshots WHERE tenant_id = $1 AND NOT deleted ORDER BY id LIMIT $2",
    left: "SELECT count(*) FROM sandbox_snapshots WHERE tenant_id = $1 AND NOT deleted",
};

/// Instances not asked to be deleted yet; those not gone.
pub const INSTANCES: Leftovers = Leftovers {
    due: "SELECT id FROM instances WHERE tenant_id = $1 AND desired_state <> 'deleted'
           ORDER BY id LIMIT $2",
    left: "SELECT count(*) FROM instances WHERE tenant_id = $1 AND state <> 'deleted'",
};

/// Volumes that can still be deleted; those not released yet.
pub const VOLUMES: Leftovers = Leftovers {
    due: "SELECT id FROM sandbox_volumes WHERE tenant_id = $1 AND state IN ('creating', 'ready')
           ORDER BY id LIMIT $2",
    left: "SELECT count(*) FROM sandbox_volumes WHERE tenant_id = $1 AND state <> 'deleted'",
};
