//! Pools from `vps_pg::connect`: a connection that died while idle is replaced when taken,
//! not handed to a caller.

use sqlx::PgPool;
use vps_pg::connect::{connect, DbOptions, PING_IDLE};

async fn backend_pid(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("a live connection")
}

#[tokio::test]
async fn a_connection_ended_while_idle_is_replaced_when_taken() {
    let url = vps_pg::testing::fresh_database().await;
    let pool = connect(&url, &DbOptions { max_connections: 1 })
        .await
        .unwrap();
    let first = backend_pid(&pool).await;

    // The server ends the pool's only session (as a restart or an idle-session kill would).
    let other = connect(&url, &DbOptions { max_connections: 1 })
        .await
        .unwrap();
    let ended: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(first)
        .fetch_one(&other)
        .await
        .unwrap();
    assert!(ended);
    // Idle long enough to be checked when taken: the ping finds it dead, and a new session
    // answers instead of an error.
    tokio::time::sleep(PING_IDLE + std::time::Duration::from_millis(200)).await;
    assert_ne!(backend_pid(&pool).await, first);
}
