//! Fresh databases for tests: one per test, on a shared server, so tests run in parallel.
//!
//! The server is `VPS_TEST_DATABASE_URL` when set (CI points it at the machine's cluster);
//! otherwise a throw-away embedded cluster under `$TMPDIR/vps-test-pg`, shared by every test
//! process and left running for the next one.

use std::fmt::Debug;
use std::future::Future;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sqlx::{Connection, Executor, PgConnection, PgPool};

use crate::embedded::{EmbeddedCluster, EmbeddedOptions};

/// The URL of the server tests create their databases on.
pub fn server_url() -> String {
    static URL: OnceLock<String> = OnceLock::new();
    URL.get_or_init(|| {
        if let Ok(url) = std::env::var("VPS_TEST_DATABASE_URL") {
            return url;
        }
        // In the temp dir, which the cluster's user can always reach (the checkout may sit
        // under a home directory it cannot).
        let data_dir = std::env::temp_dir().join("vps-test-pg");
        let cluster = EmbeddedCluster::start(&EmbeddedOptions {
            data_dir,
            throwaway: true,
        })
        .unwrap_or_else(|e| panic!("test database server: {e}"));
        let url = cluster.url();
        cluster.detach();
        url
    })
    .clone()
}

/// Creates an empty database with a unique name and returns its URL.
pub async fn fresh_database() -> String {
    let server = server_url();
    let name = format!("t_{}", ulid::Ulid::generate().to_string().to_lowercase());
    let mut admin = PgConnection::connect(&server)
        .await
        .unwrap_or_else(|e| panic!("connect to test server {server}: {e}"));
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    with_database(&server, &name)
}

/// A pool on a fresh database with `migrator`'s schema applied.
pub async fn fresh_pool(migrator: &sqlx::migrate::Migrator, max_connections: u32) -> PgPool {
    let url = fresh_database().await;
    let pool = crate::connect::connect(&url, &crate::connect::DbOptions { max_connections })
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    migrator
        .run(&pool)
        .await
        .expect("migrate the test database");
    pool
}

/// Calls `check` every `every` until it answers `Ok`, and returns that value: how tests wait for
/// background work instead of sleeping. After `within` the test fails, naming `what` and the
/// last `Err` (what was seen instead).
pub async fn eventually_every<T, E, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut check: F,
) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                panic!("timed out after {within:?} waiting for {what}; last seen: {last:?}")
            }
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

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
    use super::with_database;

    #[test]
    fn with_database_replaces_only_the_path() {
        assert_eq!(
            with_database("postgres://u:p@h:5/postgres?sslmode=disable", "t_1"),
            "postgres://u:p@h:5/t_1?sslmode=disable"
        );
        assert_eq!(with_database("postgres://h", "x"), "postgres://h/x");
    }
}
