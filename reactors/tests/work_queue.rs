//! The work queue against a real PostgreSQL: several workers (as several replicas would) never
//! hold one item at once, wake-ups during a pass are not lost, failures back off, a stale
//! holder changes nothing, and the retry time stays on the item.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use sqlx::PgPool;
use vps_reactors::work_queue::{
    complete, complete_all, extend, fail, holding, take, wake, wake_all, Next, Pass, Taken,
};

fn now() -> DateTime<Utc> {
    vps_clock::Clock::system().now()
}

async fn fresh() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 20).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_workers_never_hold_the_same_item_at_once() {
    let pool = fresh().await;
    let keys: Vec<String> = (0..50).map(|k| format!("k{k}")).collect();
    wake_all(&pool, "test", &keys, now()).await.unwrap();
    let holding: Arc<Mutex<HashMap<String, usize>>> = Arc::default();
    let passes: Arc<Mutex<usize>> = Arc::default();
    let mut workers = Vec::new();
    for w in 0..4 {
        let (pool, holding, passes) = (pool.clone(), holding.clone(), passes.clone());
        workers.push(tokio::spawn(async move {
            for _ in 0..40 {
                for item in take(&pool, "test", 5, Duration::from_secs(30), now())
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
                    let done = complete(
                        &pool,
                        "test",
                        &item,
                        Next::After(Duration::ZERO).into(),
                        now(),
                    )
                    .await
                    .unwrap();
                    assert!(done, "{} was still ours", item.key);
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
    wake(&pool, "test", "a", now()).await.unwrap();
    let item = take(&pool, "test", 10, Duration::from_secs(30), now())
        .await
        .unwrap()
        .remove(0);
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30), now())
            .await
            .unwrap()
            .is_empty(),
        "leased"
    );
    wake(&pool, "test", "a", now()).await.unwrap();
    assert!(
        complete(&pool, "test", &item, Next::WhenWoken.into(), now())
            .await
            .unwrap()
    );
    let again = take(&pool, "test", 10, Duration::from_secs(30), now())
        .await
        .unwrap();
    assert_eq!(again.len(), 1, "the wake-up during the pass was kept");
    assert!(
        complete(&pool, "test", &again[0], Next::WhenWoken.into(), now())
            .await
            .unwrap()
    );
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30), now())
            .await
            .unwrap()
            .is_empty(),
        "settled items are forgotten"
    );
}

#[tokio::test]
async fn a_failed_pass_backs_off() {
    let pool = fresh().await;
    wake(&pool, "test", "a", now()).await.unwrap();
    let item = take(&pool, "test", 10, Duration::from_secs(30), now())
        .await
        .unwrap()
        .remove(0);
    assert!(fail(&pool, "test", &item, "boom", now()).await.unwrap());
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30), now())
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

/// Takes the one due item, leased for `lease`.
async fn take_a(pool: &PgPool, lease: Duration) -> Taken {
    let mut items = take(pool, "test", 10, lease, now()).await.unwrap();
    assert_eq!(items.len(), 1, "{items:?}");
    items.remove(0)
}

async fn row_of_a(pool: &PgPool) -> (i32, Option<String>, Option<chrono::DateTime<Utc>>) {
    sqlx::query_as("SELECT attempts, last_error, retry_at FROM work_items WHERE key = 'a'")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_stale_holder_cannot_complete_reschedule_fail_or_renew_a_retaken_item() {
    let pool = fresh().await;
    wake(&pool, "test", "a", now()).await.unwrap();
    let stale = take_a(&pool, Duration::from_millis(50)).await;
    // The stale holder stalls past its lease; another holder takes the item.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let current = take_a(&pool, Duration::from_secs(30)).await;
    assert_ne!(stale.lease_id, current.lease_id);

    let later = Pass {
        next: Next::After(Duration::from_secs(3600)),
        retry_at: Some(now() + chrono::TimeDelta::hours(1)),
    };
    assert!(
        !complete(&pool, "test", &stale, Next::WhenWoken.into(), now())
            .await
            .unwrap()
    );
    assert!(!complete(&pool, "test", &stale, later, now()).await.unwrap());
    assert!(!fail(&pool, "test", &stale, "stale", now()).await.unwrap());
    assert_eq!(
        extend(
            &pool,
            "test",
            std::slice::from_ref(&stale),
            Duration::from_secs(60)
        )
        .await
        .unwrap(),
        0
    );
    assert_eq!(
        row_of_a(&pool).await,
        (0, None, None),
        "the stale holder changed nothing"
    );
    assert!(
        take(&pool, "test", 10, Duration::from_secs(30), now())
            .await
            .unwrap()
            .is_empty(),
        "the current holder still holds it"
    );

    // The current holder's pass is recorded, and after it the stale lease still counts for nothing.
    assert!(complete(
        &pool,
        "test",
        &current,
        Next::After(Duration::ZERO).into(),
        now()
    )
    .await
    .unwrap());
    assert!(!fail(&pool, "test", &stale, "stale", now()).await.unwrap());
    assert_eq!(take_a(&pool, Duration::from_secs(30)).await.attempts, 0);
}

#[tokio::test]
async fn the_retry_time_rides_on_the_item_and_a_failed_pass_keeps_it() {
    let pool = fresh().await;
    wake(&pool, "test", "a", now()).await.unwrap();
    let item = take_a(&pool, Duration::from_secs(30)).await;
    assert_eq!(item.retry_at, None);
    let retry_at = now() + chrono::TimeDelta::seconds(90);
    let pass = Pass {
        next: Next::After(Duration::ZERO),
        retry_at: Some(retry_at),
    };
    assert!(complete(&pool, "test", &item, pass, now()).await.unwrap());
    let item = take_a(&pool, Duration::from_secs(30)).await;
    let micros = |t: chrono::DateTime<Utc>| t.timestamp_micros();
    assert_eq!(item.retry_at.map(micros), Some(micros(retry_at)));
    assert!(fail(&pool, "test", &item, "boom", now()).await.unwrap());
    assert_eq!(row_of_a(&pool).await.2.map(micros), Some(micros(retry_at)));
}

#[tokio::test]
async fn holding_keeps_a_slow_pass_leased_past_its_lease() {
    let pool = fresh().await;
    wake(&pool, "test", "a", now()).await.unwrap();
    let lease = Duration::from_millis(600);
    let items = vec![take_a(&pool, lease).await];
    let slow = async {
        // Two leases long: without renewal another holder could take it meanwhile.
        for _ in 0..6 {
            tokio::time::sleep(lease / 3).await;
            assert!(
                take(&pool, "test", 10, lease, now())
                    .await
                    .unwrap()
                    .is_empty(),
                "taken from a holder that still works on it"
            );
        }
    };
    holding(&pool, "test", &items, lease, slow).await;
    assert!(
        complete(&pool, "test", &items[0], Next::WhenWoken.into(), now())
            .await
            .unwrap()
    );
}

/// An idle loop waits for an announcement or its kind's next due time, whichever is first:
/// another replica's announcement (a `pg_notify` heard by `listen`) wakes it at once, and an
/// item due soon ends the wait when it falls due, both well before the one-second fallback.
#[tokio::test]
async fn an_idle_loop_wakes_on_another_replicas_announcement_and_on_the_next_due_time() {
    use vps_reactors::work_queue::{idle, listen, subscribe, MAX_IDLE};
    let pool = fresh().await;
    let ctx = vps_commands::Ctx {
        pool: pool.clone(),
        notifier: vps_events::Notifier::start(pool.clone()),
        spec_signals: Default::default(),
        secrets: vps_commands::secrets::SecretKey::new([7; 32]),
        actor: vps_commands::Actor {
            identity: "reactor:test".into(),
            tenant: None,
            operator: true,
        },
        request_id: None,
        clock: Default::default(),
        wakeups: Default::default(),
        reports: Default::default(),
    };
    tokio::spawn(listen(pool.clone(), ctx.wakeups.clone()));
    let notify = || async {
        // As another replica would: the notification alone, without this process's own bump.
        sqlx::query("SELECT pg_notify($1, 'idle-test')")
            .bind(vps_reactors::work_queue::CHANNEL)
            .execute(&pool)
            .await
            .unwrap();
    };
    let mut signal = subscribe(&ctx, "idle-test");
    // The listener is up once a notification comes back through it.
    let mut up = false;
    for _ in 0..100 {
        notify().await;
        if tokio::time::timeout(Duration::from_millis(100), signal.changed())
            .await
            .is_ok()
        {
            up = true;
            break;
        }
    }
    assert!(up, "the listener hears notifications");
    signal.borrow_and_update();
    let mut unrelated = subscribe(&ctx, "another-kind");
    notify().await;
    signal.changed().await.unwrap();
    assert!(
        !unrelated.has_changed().unwrap(),
        "another kind's loop sleeps on"
    );
    // Kinds announced together arrive in one payload, comma-separated: each loop wakes.
    sqlx::query("SELECT pg_notify($1, 'another-kind,idle-test')")
        .bind(vps_reactors::work_queue::CHANNEL)
        .execute(&pool)
        .await
        .unwrap();
    signal.changed().await.unwrap();
    unrelated.changed().await.unwrap();

    let waiting = tokio::spawn({
        let ctx = ctx.clone();
        async move {
            let started = std::time::Instant::now();
            idle(&ctx, "idle-test", &mut signal).await;
            started.elapsed()
        }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    notify().await;
    let waited = waiting.await.unwrap();
    assert!(
        waited < MAX_IDLE / 2,
        "woken by the notification after {waited:?}"
    );

    let due = now() + chrono::TimeDelta::milliseconds(200);
    wake(&pool, "idle-test", "k", due).await.unwrap();
    let mut quiet = subscribe(&ctx, "idle-test");
    quiet.borrow_and_update();
    let started = std::time::Instant::now();
    idle(&ctx, "idle-test", &mut quiet).await;
    let waited = started.elapsed();
    assert!(
        waited >= Duration::from_millis(100) && waited < MAX_IDLE / 2,
        "the item due in 200 ms ended the wait after {waited:?}"
    );
}

/// A batch's passes are recorded with one statement: a settled item is forgotten, one woken
/// during its pass is due again at once, one that asked for a later look waits for it, and one
/// whose lease another holder took meanwhile is answered as lost and stays that holder's.
#[tokio::test]
async fn a_batch_of_passes_is_recorded_at_once_and_names_the_lost_leases() {
    let pool = fresh().await;
    wake(&pool, "test", "retaken", now()).await.unwrap();
    let stale = take_a(&pool, Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let keys = ["settled", "woken", "later"].map(String::from);
    wake_all(&pool, "test", &keys, now()).await.unwrap();
    let taken = take(&pool, "test", 10, Duration::from_secs(30), now())
        .await
        .unwrap();
    assert_eq!(taken.len(), 4, "the lapsed lease is taken again: {taken:?}");
    let held = |key: &str| taken.iter().find(|i| i.key == key).unwrap();
    wake(&pool, "test", "woken", now()).await.unwrap();

    let lost = complete_all(
        &pool,
        "test",
        &[
            (held("settled"), Next::WhenWoken.into()),
            (held("woken"), Next::WhenWoken.into()),
            (held("later"), Next::After(Duration::from_secs(60)).into()),
            (&stale, Next::After(Duration::ZERO).into()),
        ],
        now(),
    )
    .await
    .unwrap();
    assert_eq!(lost, ["retaken"]);
    let due: Vec<String> = take(&pool, "test", 10, Duration::from_secs(30), now())
        .await
        .unwrap()
        .into_iter()
        .map(|i| i.key)
        .collect();
    assert_eq!(
        due,
        ["woken"],
        "settled forgotten, later not due, retaken still held"
    );
    assert!(complete(
        &pool,
        "test",
        held("retaken"),
        Next::WhenWoken.into(),
        now()
    )
    .await
    .unwrap());
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM work_items WHERE kind = 'test'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(rows, 2, "woken and later remain");
}
