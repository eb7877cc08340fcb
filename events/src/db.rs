//! Connection pools and the schema.

use sqlx::PgPool;

/// The migrations of the single schema (`migrations/` at the workspace root).
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

pub use vps_pg::connect::{connect, DbOptions};

/// Applies every pending migration.
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    MIGRATOR.run(pool).await
}
