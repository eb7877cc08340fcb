//! `vps bench <name>`: measure a capability and its baseline in the same run, on the
//! configured database server (in a scratch database, dropped afterwards). Human-readable
//! figures first, one JSON line last.

pub mod log;

use anyhow::Context;
use sqlx::{Connection, Executor, PgConnection, PgPool};

/// A scratch database for one benchmark run.
pub struct Scratch {
    /// Pool on the scratch database (migrated).
    pub pool: PgPool,
    /// Its URL.
    pub url: String,
    server_url: String,
    name: String,
}

impl Scratch {
    /// Creates and migrates `vps_bench_<ulid>` next to the configured database.
    pub async fn create(server_url: &str, max_connections: u32) -> anyhow::Result<Scratch> {
        let name = format!(
            "vps_bench_{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        );
        let mut admin = PgConnection::connect(server_url)
            .await
            .context("connect to the database server")?;
        admin
            .execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
        let url = vps_pg::testing::with_database(server_url, &name);
        let pool = vps_events::connect(&url, &vps_events::DbOptions { max_connections }).await?;
        vps_events::migrate(&pool).await?;
        Ok(Scratch {
            pool,
            url,
            server_url: server_url.to_string(),
            name,
        })
    }

    /// Closes the pool and drops the database.
    pub async fn drop_database(self) -> anyhow::Result<()> {
        self.pool.close().await;
        let mut admin = PgConnection::connect(&self.server_url).await?;
        admin
            .execute(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name).as_str())
            .await?;
        Ok(())
    }
}

/// Percentile of sorted samples (0.0..=1.0).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() - 1) as f64 * p).round() as usize;
    sorted[i]
}
