//! The work queue against a real PostgreSQL: several workers (as several replicas would) never
//! hold one item at once, wake-ups during a pass are not lost, failures back off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::Utc;
use sqlx::PgPool;
use vps_reactors::work_queue::{complete, fail, take, wake, wake_all, Next};

async fn fresh() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 20).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_workers_never_hold_the_same_item_at_once() {
    let pool = fresh().await;
    let keys: Vec<String> = (0..50).map(|k| format!("k{k}")).collect();
    wake_all(&pool, "test", &keys).await.unwrap();
    let holding: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let passes: Arc<Mutex<usize>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..4 {
        let (pool, holding, passes) = (pool.clone(), holding.clone(), passes.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..40 {
                for item in take(&pool, "test", 5, Duration::from_secs(30))
                    .await
                    .unwrap()
                {
                    if let Some(other) = holding.lock().unwrap().insert(item.key.clone(), w) {
                        panic!(
                            "{} taken by worker {w} while worker {other} holds it",
                            item.key
                        );
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    holding.lock().unwrap().remove(&item.key);
                    *passes.lock().unwrap() += 1;
                    // Ask to be looked at again at once: items keep circulating between workers.
                    complete(&pool, "test", &item, Next::After(Duration::ZERO))
                        .await
                        .unwrap();
                }
            }
        }));
    }
    for w in workers {
        w.await.unwrap();
    }
    assert!(*passes.lock().unwrap() >= 50, "every item was worked on");
}

#[tokio::test]
async fn a_wake_during_a_pass_makes_the_item_due_again() {
    let pool = fresh().await;
    wake(&pool, "test", "a", Utc::now()).await.unwrap();
    let item = take(&pool, "test", 10, Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty(),
        "leased"
    );
    wake(&pool, "test", "a", Utc::now()).await.unwrap();
    complete(&pool, "test", &item, Next::WhenWoken)
        .await
        .unwrap();
    let again = take(&pool, "test", 10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "the wake-up during the pass was kept");
    complete(&pool, "test", &again[0], Next::WhenWoken)
        .await
        .unwrap();
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty(),
        "settled items are forgotten"
    );
}

#[tokio::test]
async fn a_failed_pass_backs_off() {
    let pool = fresh().await;
    wake(&pool, "test", "a", Utc::now()).await.unwrap();
    let item = take(&pool, "test", 10, Duration::from_secs(30))
        .await
        .unwrap()
        .remove(0);
    fail(&pool, "test", &item, "boom").await.unwrap();
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty(),
        "not due yet"
    );
    let (attempts, error): (i32, String) =
        sqlx::query_as("SELECT attempts, last_error FROM work_items WHERE key = 'a'")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!((attempts, error.as_str()), (1, "boom"));
}
