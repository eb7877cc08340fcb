//! Connection pools with the session settings every `vps` connection needs.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

/// How to size a pool.
#[derive(Debug, Clone)]
pub struct DbOptions {
    /// Upper bound of open connections.
    pub max_connections: u32,
}

impl Default for DbOptions {
    fn default() -> Self {
        DbOptions {
            max_connections: 20,
        }
    }
}

/// Opens a pool. Every session gets an idle-in-transaction timeout: an abandoned transaction
/// holds the read horizon back for every follower, so it must not live long.
pub async fn connect(url: &str, options: &DbOptions) -> Result<PgPool, sqlx::Error> {
    let connect = PgConnectOptions::from_str(url)?
        .options([("idle_in_transaction_session_timeout", "60s")])
        .application_name("vps");
    PgPoolOptions::new()
        .max_connections(options.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .connect_with(connect)
        .await
}
