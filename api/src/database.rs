//! Opening the configured database: a URL, or the embedded cluster under `.vps/pg`.

use std::path::PathBuf;

use anyhow::Context;
use sqlx::PgPool;
use vps_pg::{EmbeddedCluster, EmbeddedOptions};

use crate::config::Config;

/// An open, migrated database. Holds the embedded cluster (if any) so it stops on drop.
pub struct Database {
    /// The pool.
    pub pool: PgPool,
    /// The server URL in use.
    pub url: String,
    _cluster: Option<EmbeddedCluster>,
}

/// The server URL from the config, starting the embedded cluster when there is none.
pub async fn server_url(config: &Config) -> anyhow::Result<(String, Option<EmbeddedCluster>)> {
    if let Some(url) = &config.database.url {
        return Ok((url.clone(), None));
    }
    let data_dir = config
        .database
        .data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from(".vps/pg"));
    let options = EmbeddedOptions {
        data_dir,
        throwaway: false,
    };
    let cluster = tokio::task::spawn_blocking(move || EmbeddedCluster::start(&options))
        .await
        .context("embedded PostgreSQL start task")??;
    let admin = cluster.url();
    // The product's data lives in its own database inside the cluster.
    ensure_database(&admin, "vps").await?;
    Ok((vps_pg::connect::with_database(&admin, "vps"), Some(cluster)))
}

async fn ensure_database(admin_url: &str, name: &str) -> anyhow::Result<()> {
    use sqlx::{Connection, Executor};
    let mut conn = sqlx::PgConnection::connect(admin_url)
        .await
        .with_context(|| format!("connect to embedded PostgreSQL at {admin_url}"))?;
    let exists: bool =
        sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
            .bind(name)
            .fetch_one(&mut conn)
            .await?;
    if !exists {
        conn.execute(format!("CREATE DATABASE {name}").as_str())
            .await?;
    }
    Ok(())
}

/// The connections a serving process (`vps serve`, `vps dev`) opens; benchmarks that measure
/// the server give it as many, so they see its pool as it is.
pub const SERVE_CONNECTIONS: u32 = 30;

impl Database {
    /// Connects (starting the embedded cluster if needed) and applies migrations.
    pub async fn open(config: &Config, max_connections: u32) -> anyhow::Result<Database> {
        let (url, cluster) = server_url(config).await?;
        let pool = vps_events::connect(&url, &vps_events::DbOptions { max_connections })
            .await
            .with_context(|| format!("connect to the database at {}", redact(&url)))?;
        vps_events::migrate(&pool)
            .await
            .context("apply migrations")?;
        Ok(Database {
            pool,
            url,
            _cluster: cluster,
        })
    }
}

/// A URL with its password hidden, for messages.
pub fn redact(url: &str) -> String {
    vps_domain::network::redact_credentials(url)
}
