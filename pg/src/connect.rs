//! Connection pools with the session settings every `vps` connection needs.

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

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

/// How long a pooled connection may sit idle before it is checked when taken.
pub const PING_IDLE: Duration = Duration::from_secs(1);

/// Opens a pool. Every session gets an idle-in-transaction timeout: an abandoned transaction
/// holds the read horizon back for every follower, so it must not live long.
///
/// A connection is pinged when it is taken from the pool only if it sat idle for
/// [`PING_IDLE`] or longer: one in steady use answered a statement moments ago. sqlx's own
/// ping on taking was a round trip before every statement or transaction, 16 % of the server's
/// CPU in `bench api`. It also pings every connection that goes back to the pool, which finds
/// one a dropped query left broken. After the database restarts, an idle connection is found
/// dead on taking and replaced, as before.
pub async fn connect(url: &str, options: &DbOptions) -> Result<PgPool, sqlx::Error> {
    let connect = PgConnectOptions::from_str(url)?
        .options([("idle_in_transaction_session_timeout", "60s")])
        .application_name("vps");
    PgPoolOptions::new()
        .max_connections(options.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        .test_before_acquire(false)
        .before_acquire(|conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IDLE {
                    conn.ping().await?;
                }
                Ok(true)
            })
        })
        .connect_with(connect)
        .await
}

/// `BEGIN` for a hot-path transaction whose statements find every row by key: the
/// admission batch and the NodeSpec pass, once per create. Each statement is planned once per
/// connection and the plan kept (`plan_cache_mode = force_generic_plan`), with sequential
/// scans ruled out (`enable_seqscan = off`) for the transaction.
///
/// PostgreSQL plans these statements anew at every execution otherwise: an `= ANY($1)` array
/// makes a generic plan look dearer than a custom one, so the cached plan is never used.
/// Planning was a third of their time (`pg_stat_statements`: 0.7 ms per create at 1 client).
/// A kept plan is made once, on the tables as they are then; made on near-empty tables it
/// would seq-scan them for good (until an `ANALYZE`), which is why sequential scans are off:
/// for lookups by key an index scan is right at every size. Both settings end with the
/// transaction, and the one `BEGIN` round trip carries them.
pub const BEGIN_KEYED: &str =
    "BEGIN; SET LOCAL plan_cache_mode = force_generic_plan; SET LOCAL enable_seqscan = off";

/// `url` with its database name replaced.
pub fn with_database(url: &str, database: &str) -> String {
    let (base, query) = match url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (url, None),
    };
    // The path starts at the first '/' after the authority.
    let authority_end = base
        .find("://")
        .map(|i| i + 3)
        .and_then(|start| base[start..].find('/').map(|j| start + j))
        .unwrap_or(base.len());
    let mut out = format!("{}/{}", &base[..authority_end], database);
    if let Some(q) = query {
        out.push('?');
        out.push_str(q);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://u:p@h:5/postgres?sslmode=disable", "t_1"),
            "postgres://u:p@h:5/t_1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    }
}
