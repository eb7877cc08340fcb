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

use crate::connect::with_database;
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

/// Test databases older than this are left over from finished runs (no test lasts this long).
const STALE_AFTER: Duration = Duration::from_secs(6 * 3600);

/// A test's own database, dropped when this value is (at the end of the test), so a
/// developer's cluster does not fill up with them. Derefs to its URL.
pub struct TestDatabase {
    url: String,
    name: String,
}

impl std::ops::Deref for TestDatabase {
    type Target = str;
    fn deref(&self) -> &str {
        &self.url
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        drop_database(&self.name);
    }
}

/// Creates an empty database with a unique name, dropped with the returned value. The first
/// call of a process also drops the test databases that runs which did not end (a killed
/// process drops nothing) left behind.
pub async fn fresh_database() -> TestDatabase {
    static SWEPT: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    let server = server_url();
    let name = format!("t_{}", ulid::Ulid::generate().to_string().to_lowercase());
    let mut admin = PgConnection::connect(&server)
        .await
        .unwrap_or_else(|e| panic!("connect to test server {server}: {e}"));
    if !SWEPT.swap(true, std::sync::atomic::Ordering::SeqCst) {
        drop_stale(&mut admin).await;
    }
    admin
        .execute(format!("CREATE DATABASE {name}").as_str())
        .await
        .expect("create test database");
    TestDatabase {
        url: with_database(&server, &name),
        name,
    }
}

/// Drops the database `name` (closing its connections), best effort. On a thread of its own
/// with its own runtime: it runs from `Drop`, maybe inside a runtime that is shutting down.
fn drop_database(name: &str) {
    let (server, name) = (server_url(), name.to_string());
    let dropped = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        runtime.block_on(async {
            let mut admin = PgConnection::connect(&server)
                .await
                .map_err(|e| e.to_string())?;
            let drop = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
            admin
                .execute(drop.as_str())
                .await
                .map_err(|e| format!("{name}: {e}"))?;
            Ok::<_, String>(())
        })
    })
    .join();
    match dropped {
        Ok(Ok(())) => {}
        Ok(Err(e)) => eprintln!("left test database {e}"),
        Err(_) => eprintln!("dropping a test database panicked"),
    }
}

/// Drops the `t_<ulid>` databases whose ULID (their creation time) is older than
/// [`STALE_AFTER`]. Best effort: a database that cannot be dropped is left for the next run.
async fn drop_stale(admin: &mut PgConnection) {
    let names: Vec<String> =
        sqlx::query_scalar("SELECT datname FROM pg_database WHERE datname LIKE 't\\_%'")
            .fetch_all(&mut *admin)
            .await
            .unwrap_or_default();
    let now = std::time::SystemTime::now();
    for name in names {
        let created = ulid::Ulid::from_string(&name[2..].to_uppercase()).map(|u| u.datetime());
        let stale = created.is_ok_and(|t| now.duration_since(t).is_ok_and(|age| age > STALE_AFTER));
        if stale {
            let drop = format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)");
            if let Err(e) = admin.execute(drop.as_str()).await {
                eprintln!("left stale test database {name}: {e}");
            }
        }
    }
}

/// A pool on a fresh database with `migrator`'s schema applied. The database is dropped when
/// the test's runtime ends (its guard waits in a task of that runtime, dropped at shutdown),
/// so a test needs nothing to clean up.
pub async fn fresh_pool(migrator: &sqlx::migrate::Migrator, max_connections: u32) -> PgPool {
    let database = fresh_database().await;
    let url = &*database;
    let pool = crate::connect::connect(url, &crate::connect::DbOptions { max_connections })
        .await
        .unwrap_or_else(|e| panic!("connect to {url}: {e}"));
    migrator
        .run(&pool)
        .await
        .expect("migrate the test database");
    tokio::spawn(async move {
        let _dropped_at_shutdown = database;
        std::future::pending::<()>().await
    });
    pool
}

/// Calls `check` every `every` until it answers `Ok`, and returns that value: how tests wait for
/// background work instead of sleeping. After `within` the test fails, naming `what` and the
/// last `Err` (what was seen instead).
pub async fn eventually_every<T, E, F, Fut>(
    what: &str,
    within: Duration,
    every: Duration,
    check: F,
) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    eventually_explained(what, within, every, check, || async { None }).await
}

/// Like [`eventually_every`]; a failure also names what `explain` finds then (asked only
/// once, at the timeout: what may explain a wait that never ended).
pub async fn eventually_explained<T, E, F, Fut, X, XFut>(
    what: &str,
    within: Duration,
    every: Duration,
    mut check: F,
    explain: X,
) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
    X: FnOnce() -> XFut,
    XFut: Future<Output = Option<String>>,
{
    let deadline = Instant::now() + within;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                let more = explain()
                    .await
                    .map(|m| format!("; {m}"))
                    .unwrap_or_default();
                panic!("timed out after {within:?} waiting for {what}; last seen: {last:?}{more}")
            }
            Err(_) => tokio::time::sleep(every).await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    #[should_panic(expected = "last seen: \"not yet\"; the lock was held")]
    async fn a_wait_that_times_out_names_what_explain_found() {
        let never = || async { Err::<(), _>("not yet") };
        let explain = || async { Some("the lock was held".to_string()) };
        let (within, every) = (Duration::from_millis(20), Duration::from_millis(5));
        eventually_explained("never", within, every, never, explain).await;
    }

    #[test]
    fn a_pools_database_is_dropped_when_its_tests_runtime_ends() {
        let runtime = || tokio::runtime::Runtime::new().unwrap();
        let name = runtime().block_on(async {
            let pool = fresh_pool(&sqlx::migrate::Migrator::DEFAULT, 1).await;
            sqlx::query_scalar::<_, String>("SELECT current_database()")
                .fetch_one(&pool)
                .await
                .unwrap()
        });
        let exists = runtime().block_on(async {
            let mut admin = PgConnection::connect(&server_url()).await.unwrap();
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
            )
            .bind(&name)
            .fetch_one(&mut admin)
            .await
            .unwrap()
        });
        assert!(
            !exists,
            "{name} outlived the runtime of the test that made it"
        );
    }

    #[tokio::test]
    async fn stale_test_databases_are_swept_and_each_test_drops_its_own() {
        let server = server_url();
        let mut admin = PgConnection::connect(&server).await.unwrap();
        let old = ulid::Ulid::from_datetime(
            std::time::SystemTime::now() - STALE_AFTER - Duration::from_secs(60),
        );
        let old = format!("t_{}", old.to_string().to_lowercase());
        admin
            .execute(format!("CREATE DATABASE {old}").as_str())
            .await
            .unwrap();
        let new = fresh_database().await;
        drop_stale(&mut admin).await;
        let exists = |name: String| {
            sqlx::query_scalar::<_, bool>(
                "SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)",
            )
            .bind(name)
        };
        assert!(!exists(old).fetch_one(&mut admin).await.unwrap());
        let new_name = new.rsplit('/').next().unwrap();
        let new_name = new_name.split('?').next().unwrap().to_string();
        assert!(exists(new_name.clone())
            .fetch_one(&mut admin)
            .await
            .unwrap());
        drop(new);
        assert!(
            !exists(new_name).fetch_one(&mut admin).await.unwrap(),
            "a test's database is dropped with its value"
        );
    }
}
