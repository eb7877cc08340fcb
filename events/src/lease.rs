//! Leases for followers that must run once across replicas (the chainer, each publisher):
//! a session-level advisory lock held on a dedicated connection. If the holder dies, its
//! connection closes, the lock is released and another replica takes over.

use std::time::Duration;

use sqlx::pool::PoolConnection;
use sqlx::{PgPool, Postgres};

/// A held lease; dropping it releases the lock (the connection is closed).
pub struct Lease {
    _conn: sqlx::PgConnection,
}

impl Lease {
    /// Takes the lease called `name` if nobody holds it.
    pub async fn try_acquire(pool: &PgPool, name: &str) -> Result<Option<Lease>, sqlx::Error> {
        let mut conn: PoolConnection<Postgres> = pool.acquire().await?;
        let got: bool = sqlx::query_scalar("SELECT pg_try_advisory_lock(hashtextextended($1, 0))")
            .bind(name)
            .fetch_one(&mut *conn)
            .await?;
        // Detached: the lock lives exactly as long as this connection.
        Ok(got.then(|| Lease {
            _conn: conn.detach(),
        }))
    }

    /// Waits until the lease called `name` is ours, retrying every `every`.
    pub async fn acquire(pool: &PgPool, name: &str, every: Duration) -> Lease {
        loop {
            match Lease::try_acquire(pool, name).await {
                Ok(Some(lease)) => return lease,
                Ok(None) => {}
                Err(e) => tracing::warn!(lease = name, error = %e, "cannot take lease"),
            }
            tokio::time::sleep(every).await;
        }
    }
}
