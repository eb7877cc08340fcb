//! Pools from `vps_pg::connect`: a connection that died while idle is replaced when taken,
//! not handed to a caller, and one whose `begin` was cancelled comes back outside any
//! transaction.

use std::future::Future;
use std::task::{Context, Waker};

use sqlx::PgPool;
use vps_pg::connect::{connect, DbOptions, PING_IDLE};

/// A pool of one connection, so the next borrower gets the connection the last one used.
async fn one_connection(url: &str) -> PgPool {
    connect(url, &DbOptions { max_connections: 1 })
        .await
        .unwrap()
}

async fn backend_pid(pool: &PgPool) -> i32 {
    sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(pool)
        .await
        .expect("a live connection")
}

#[tokio::test]
async fn a_connection_ended_while_idle_is_replaced_when_taken() {
    let url = vps_pg::testing::fresh_database().await;
    let pool = one_connection(&url).await;
    let first = backend_pid(&pool).await;

    // The server ends the pool's only session (as a restart or an idle-session kill would).
    let other = one_connection(&url).await;
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

#[tokio::test]
async fn a_transaction_cancelled_while_it_begins_leaves_no_transaction_to_the_next_borrower() {
    let url = vps_pg::testing::fresh_database().await;
    let pool = one_connection(&url).await;
    sqlx::query("CREATE TABLE marks (n int)")
        .execute(&pool)
        .await
        .unwrap();

    // Polled once, `begin` has sent its BEGIN and waits for the answer; then it is dropped,
    // as a request handler is when its client goes away. (A fast server may answer within
    // that one poll: then the transaction is whole and dropped, and the test tries again.)
    let mut cancelled = false;
    for _ in 0..1000 {
        let mut conn = pool.acquire().await.unwrap();
        let mut begin = std::pin::pin!(sqlx::Connection::begin(&mut *conn));
        let mut cx = Context::from_waker(Waker::noop());
        if begin.as_mut().poll(&mut cx).is_pending() {
            cancelled = true;
            break;
        }
    }
    assert!(cancelled, "every BEGIN was answered within its first poll");

    // The pool's only connection, taken again: a statement of its own commits at once.
    sqlx::query("INSERT INTO marks VALUES (1)")
        .execute(&pool)
        .await
        .unwrap();
    let other = one_connection(&url).await;
    let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM marks")
        .fetch_one(&other)
        .await
        .unwrap();
    assert_eq!(seen, 1, "the insert ran inside the cancelled transaction");
}
