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
///
/// A connection is not pinged when it is taken from the pool, only when it goes back (sqlx
/// always does that, which also finds one a dropped query left broken). The ping on taking
/// was a round trip before every statement or transaction: in `bench api` 16 % of the
/// server's CPU. A connection that dies while idle (the database restarted) fails the one
/// query that uses it, which answers an error and closes it; idle connections are also closed
/// after a minute.
pub async fn connect(url: &str, options: &DbOptions) -> Result<PgPool, sqlx::Error> {
    let connect = PgConnectOptions::from_str(url)?
        .options([("idle_in_transaction_session_timeout", "60s")])
        .application_name("vps");
    PgPoolOptions::new()
        .max_connections(options.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .idle_timeout(Duration::from_secs(60))
        .connect_with(connect)
        .await
}
