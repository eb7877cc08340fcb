//! `vps.database.reachable` and `vps.database.migrations`: what `/readyz` calls ready.

use std::collections::BTreeSet;

use sqlx::PgPool;

use super::{Finding, Severity};

/// The prefix of this family's checks.
pub const AREA: &str = "vps.database.";
const REACHABLE: &str = "vps.database.reachable";
const MIGRATIONS: &str = "vps.database.migrations";

/// Both database findings (only the first when the database does not answer).
pub async fn check(pool: Result<&PgPool, &str>) -> Vec<Finding> {
    let unreachable = |why: &str| {
        vec![Finding::bad(
            REACHABLE,
            Severity::Error,
            format!("database unreachable: {why}"),
            "check [database] url (or VPS_DATABASE_URL) and that PostgreSQL accepts \
             connections (pg_isready)",
        )]
    };
    let pool = match pool {
        Ok(pool) => pool,
        Err(why) => return unreachable(why),
    };
    let version: String = match sqlx::query_scalar("SHOW server_version")
        .fetch_one(pool)
        .await
    {
        Ok(v) => v,
        Err(e) => return unreachable(&e.to_string()),
    };
    vec![
        Finding::ok(REACHABLE, format!("PostgreSQL {version} answers")),
        migrations(pool).await,
    ]
}

/// Every migration this binary knows is applied.
async fn migrations(pool: &PgPool) -> Finding {
    let wanted: BTreeSet<i64> = vps_events::db::MIGRATOR
        .iter()
        .filter(|m| !m.migration_type.is_down_migration())
        .map(|m| m.version)
        .collect();
    let applied: Vec<i64> =
        match sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
            .fetch_all(pool)
            .await
        {
            Ok(v) => v,
            // No migration table: nothing was ever applied here.
            Err(sqlx::Error::Database(e)) if e.code().as_deref() == Some("42P01") => Vec::new(),
            Err(e) => {
                return Finding::bad(
                    MIGRATIONS,
                    Severity::Error,
                    format!("cannot read the applied migrations: {e}"),
                    "check that the configured role may read _sqlx_migrations",
                )
            }
        };
    let applied: BTreeSet<i64> = applied.into_iter().collect();
    let missing: Vec<String> = wanted.difference(&applied).map(|v| v.to_string()).collect();
    if missing.is_empty() {
        Finding::ok(
            MIGRATIONS,
            format!("all {} migrations applied", wanted.len()),
        )
    } else {
        Finding::bad(
            MIGRATIONS,
            Severity::Error,
            format!(
                "{} of {} migrations applied (missing {})",
                wanted.len() - missing.len(),
                wanted.len(),
                super::some_ids(&missing, missing.len() as i64)
            ),
            "start `vps serve` of this version once: it applies pending migrations at start",
        )
    }
}
