//! The shared tail of the log: what it hands out equals what a read of the database answers,
//! and a follower at the head reads it instead of the database.

use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;
use vps_events::read::{read_page, Filter};
use vps_events::{
    append, Cursor, ExpectedVersion, Follower, Metadata, NewEvent, Notifier, RecordedEvent,
};

async fn fresh_log() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 30).await
}

fn event(event_type: &str, tenant: Option<&str>) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: event_type.into(),
        data: json!({}),
        metadata: Metadata {
            tenant_id: tenant.map(str::to_string),
            ..Metadata::default()
        },
    }
}

/// Appends `events` to `stream` as its first events and wakes the process's readers.
async fn append_new(pool: &PgPool, notifier: &Notifier, stream: &str, events: &[NewEvent]) {
    let mut conn = pool.acquire().await.unwrap();
    append(&mut conn, stream, ExpectedVersion::NoStream, events)
        .await
        .unwrap();
    notifier.committed();
}

/// Reads through `follower` until `n` events came (other tests' open transactions hold the
/// horizon back for a moment), moving its cursor past them.
async fn take(follower: &mut Follower, n: usize) -> Vec<RecordedEvent> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut taken = Vec::new();
    while taken.len() < n {
        assert!(
            Instant::now() < deadline,
            "{n} events never became readable"
        );
        let batch = follower.next_batch(100).await.unwrap();
        match batch.last() {
            Some(last) => follower.advance(last.cursor()),
            None => follower.wait().await,
        }
        taken.extend(batch);
    }
    taken
}

/// Waits (polling, like every wait of the tests) until `check` answers `Ok`.
async fn eventually<T, E: std::fmt::Debug>(
    what: &str,
    check: impl FnMut() -> std::future::Ready<Result<T, E>>,
) -> T {
    let (within, every) = (Duration::from_secs(30), Duration::from_millis(10));
    vps_pg::testing::eventually_every(what, within, every, check).await
}

/// Waits until the tail holds the run after `cursor`.
async fn covered(notifier: &Notifier, cursor: Cursor) {
    let tail = notifier.tail().expect("a started notifier keeps a tail");
    eventually("the tail to cover the cursor", || {
        std::future::ready(tail.after(cursor, 1).ok_or(cursor))
    })
    .await;
}

/// A pool of its own on `pool`'s database, for a follower whose database reads a test cuts
/// off by closing it.
async fn own_pool(pool: &PgPool) -> PgPool {
    PgPool::connect_with(pool.connect_options().as_ref().clone())
        .await
        .unwrap()
}

/// A notifier whose tail has begun: events appended from now on are in its run.
async fn started(pool: &PgPool) -> Notifier {
    let notifier = Notifier::start(pool.clone()).with_tail(pool.clone());
    let tail = notifier.tail().expect("a started notifier keeps a tail");
    eventually("the tail to begin", || {
        std::future::ready(tail.start().ok_or("not begun"))
    })
    .await;
    notifier
}

#[tokio::test]
async fn a_follower_at_the_head_reads_the_tail_not_the_database() {
    let pool = fresh_log().await;
    let notifier = started(&pool).await;
    // The follower's own pool, closed below: a read of the database through it fails.
    let own = own_pool(&pool).await;
    let mut follower = Follower::load(own.clone(), "at-head", &notifier)
        .await
        .unwrap();
    append_new(&pool, &notifier, "s-1", &[event("test.a", None)]).await;
    take(&mut follower, 1).await;
    covered(&notifier, follower.cursor()).await;

    own.close().await;
    let later = [event("test.b", None), event("test.c", None)];
    append_new(&pool, &notifier, "s-2", &later).await;
    let read = take(&mut follower, 2).await;
    let ids: Vec<&str> = read.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, [later[0].id.as_str(), later[1].id.as_str()]);
}

#[tokio::test]
async fn the_tails_filtered_pages_equal_the_databases() {
    let pool = fresh_log().await;
    let notifier = started(&pool).await;
    let mut follower = Follower::load(pool.clone(), "all", &notifier)
        .await
        .unwrap();
    append_new(&pool, &notifier, "s-0", &[event("test.start", None)]).await;
    let start = take(&mut follower, 1).await[0].cursor();
    let streams = [
        (
            "s-1",
            [
                event("instance.created", Some("t1")),
                event("instance.running", Some("t1")),
            ],
        ),
        (
            "s-2",
            [
                event("sandbox.created", Some("t2")),
                event("usage.recorded", Some("t2")),
            ],
        ),
        (
            "s-3",
            [
                event("instance.created", None),
                event("instance_like.x", Some("t1")),
            ],
        ),
    ];
    for (stream, events) in &streams {
        append_new(&pool, &notifier, stream, events).await;
    }
    take(&mut follower, 6).await;
    covered(&notifier, follower.cursor()).await;

    let tail = notifier.tail().expect("a started notifier keeps a tail");
    let filters = [
        Filter::default(),
        Filter {
            types: vec!["instance.*".into()],
            ..Filter::default()
        },
        Filter {
            types: vec!["usage.recorded".into(), "sandbox.*".into()],
            ..Filter::default()
        },
        Filter {
            stream: Some("s-1".into()),
            ..Filter::default()
        },
        Filter {
            tenant_id: Some("t1".into()),
            ..Filter::default()
        },
        Filter {
            types: vec!["instance.*".into()],
            tenant_id: Some("t1".into()),
            ..Filter::default()
        },
    ];
    for filter in &filters {
        for limit in [1, 2, 100] {
            let from_tail = tail
                .page(start, filter, limit)
                .expect("the tail covers the start");
            let from_database = read_page(&pool, start, filter, limit).await.unwrap();
            assert_eq!(
                from_tail.events, from_database.events,
                "{filter:?} limit {limit}"
            );
            if from_tail.events.len() as i64 >= limit {
                assert_eq!(
                    from_tail.next, from_database.next,
                    "{filter:?} limit {limit}"
                );
            } else {
                // Both are past every event read; the database may have read further since.
                assert!(
                    from_tail.next <= from_database.next,
                    "{filter:?} limit {limit}"
                );
                assert!(
                    from_tail.next >= follower.cursor(),
                    "{filter:?} limit {limit}"
                );
            }
        }
    }
}

#[tokio::test]
async fn a_follower_behind_the_kept_events_reads_the_database_and_misses_nothing() {
    let pool = fresh_log().await;
    let notifier = started(&pool).await;
    let mut follower = Follower::load(pool.clone(), "behind", &notifier)
        .await
        .unwrap();
    // More events than the tail keeps, in two commits, before the follower reads any.
    let first: Vec<NewEvent> = (0..1500).map(|_| event("test.first", None)).collect();
    let second: Vec<NewEvent> = (0..100).map(|_| event("test.second", None)).collect();
    append_new(&pool, &notifier, "s-1", &first).await;
    append_new(&pool, &notifier, "s-2", &second).await;
    let tail = notifier.tail().expect("a started notifier keeps a tail");
    let last = &second[99].id;
    let run = eventually("the tail to read both commits", || {
        let run = tail
            .start()
            .and_then(|s| tail.after(s, 2000))
            .unwrap_or_default();
        let done = run.last().is_some_and(|e| e.id == *last);
        std::future::ready(if done { Ok(run) } else { Err(run.len()) })
    })
    .await;
    // The tail dropped the oldest events: the follower's cursor is behind what it keeps.
    assert!(run.len() < 1600 && run.iter().all(|e| e.id != first[0].id));
    let read = take(&mut follower, 1600).await;
    let ids: Vec<&str> = read.iter().map(|e| e.id.as_str()).collect();
    let appended: Vec<&str> = first.iter().chain(&second).map(|e| e.id.as_str()).collect();
    assert_eq!(ids, appended);
}

#[tokio::test]
async fn a_follower_reading_alone_never_takes_the_tails_events() {
    let pool = fresh_log().await;
    let notifier = started(&pool).await;
    let own = own_pool(&pool).await;
    let mut alone = Follower::load(own.clone(), "alone", &notifier)
        .await
        .unwrap()
        .reading_alone();
    append_new(&pool, &notifier, "s-1", &[event("test.a", None)]).await;
    take(&mut alone, 1).await;
    covered(&notifier, alone.cursor()).await;
    // The tail covers its cursor, yet its reads go to the database: through a closed pool,
    // they fail.
    own.close().await;
    assert!(alone.next_batch(10).await.is_err());
    assert!(alone.next_page(&Filter::default(), 10).await.is_err());
}
