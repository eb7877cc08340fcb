//! The log against a real PostgreSQL server, each test on its own fresh database.

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use serde_json::json;
use sqlx::PgPool;
use vps_events::chain::{chain_batch, verify, CHAINER};
use vps_events::follower::save_checkpoint;
use vps_events::read::read_stream;
use vps_events::{
    append, append_unseen, AppendError, ExpectedVersion, Follower, Metadata, NewEvent, Notifier,
};

async fn fresh_log() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 30).await
}

fn event(n: usize) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: "test.happened".into(),
        data: json!({ "n": n }),
        metadata: Metadata {
            actor: Some("id_test".into()),
            ..Metadata::default()
        },
    }
}

/// Appends `event(n)` as the first event of the new stream `stream`.
async fn new_stream(conn: &mut sqlx::PgConnection, stream: &str, n: usize) {
    append(conn, stream, ExpectedVersion::NoStream, &[event(n)])
        .await
        .unwrap();
}

/// The next `n` events. Other tests share the server, and their open transactions hold the
/// horizon back for a moment, so this waits until all `n` are readable.
async fn next_exactly(follower: &mut Follower, n: usize) -> Vec<vps_events::RecordedEvent> {
    for _ in 0..1000 {
        let batch = follower.next_batch(n as i64).await.unwrap();
        if batch.len() == n {
            return batch;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("{n} events never became readable");
}

async fn sequence_value(pool: &PgPool) -> i64 {
    sqlx::query_scalar("SELECT last_value FROM events_position_seq")
        .fetch_one(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_wrong_expected_version_is_a_concurrency_error_that_burns_no_position() {
    let pool = fresh_log().await;
    let mut conn = pool.acquire().await.unwrap();
    new_stream(&mut conn, "s-1", 1).await;
    let before = sequence_value(&pool).await;

    for expected in [ExpectedVersion::NoStream, ExpectedVersion::Exact(5)] {
        let err = append(&mut conn, "s-1", expected, &[event(2)])
            .await
            .unwrap_err();
        assert!(
            matches!(err, AppendError::Concurrency { actual: 1, .. }),
            "got {err:?}"
        );
    }
    assert_eq!(
        sequence_value(&pool).await,
        before,
        "a losing writer took a position"
    );

    let stored = append(
        &mut conn,
        "s-1",
        ExpectedVersion::Exact(1),
        &[event(2), event(3)],
    )
    .await
    .unwrap();
    assert_eq!(
        stored.iter().map(|e| e.version).collect::<Vec<_>>(),
        vec![2, 3]
    );
    assert_eq!(stored[0].position, before + 1);
}

#[tokio::test]
async fn appending_the_same_event_ids_again_returns_the_stored_events() {
    let pool = fresh_log().await;
    let mut conn = pool.acquire().await.unwrap();
    let events = vec![event(1), event(2)];
    let first = append(&mut conn, "s-1", ExpectedVersion::NoStream, &events)
        .await
        .unwrap();
    let again = append(&mut conn, "s-1", ExpectedVersion::NoStream, &events)
        .await
        .unwrap();
    assert_eq!(first, again);
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 2);
    // One event alone takes its own statement: a retry of it is answered the same way.
    let one = [event(3)];
    let first = append(&mut conn, "s-1", ExpectedVersion::Exact(2), &one)
        .await
        .unwrap();
    let again = append(&mut conn, "s-1", ExpectedVersion::Exact(2), &one)
        .await
        .unwrap();
    assert_eq!((first.len(), first[0].version), (1, 3));
    assert_eq!(first, again);
    // The same id in another stream is not a retry.
    let err = append(&mut conn, "s-2", ExpectedVersion::Any, &events[..1])
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::IdReused(_)), "got {err:?}");
    // Nor is a stored id after a new one: the append writes nothing.
    let mixed = [event(4), events[1].clone()];
    let err = append(&mut conn, "s-3", ExpectedVersion::NoStream, &mixed)
        .await
        .unwrap_err();
    assert!(matches!(err, AppendError::IdReused(_)), "got {err:?}");
    let count: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(count, 3);
}

#[tokio::test]
async fn append_unseen_skips_the_ids_the_log_holds_and_leaves_no_gap_in_versions() {
    let pool = fresh_log().await;
    let events: Vec<NewEvent> = (1..=5).map(event).collect();
    let mut tx = pool.begin().await.unwrap();
    // All new: one insert.
    assert_eq!(
        append_unseen(&mut tx, "t-1", &events[..2]).await.unwrap(),
        2
    );
    // Two of four already there (a second worker, a restart): the other two follow on.
    assert_eq!(
        append_unseen(&mut tx, "t-1", &events[..4]).await.unwrap(),
        2
    );
    // Nothing new.
    assert_eq!(
        append_unseen(&mut tx, "t-1", &events[..4]).await.unwrap(),
        0
    );
    assert_eq!(
        append_unseen(&mut tx, "t-1", &events[4..]).await.unwrap(),
        1
    );
    tx.commit().await.unwrap();
    let stored = read_stream(&pool, "t-1").await.unwrap();
    let versions: Vec<i64> = stored.iter().map(|e| e.version).collect();
    assert_eq!(versions, [1, 2, 3, 4, 5]);
    let ids: Vec<&str> = stored.iter().map(|e| e.id.as_str()).collect();
    let expected: Vec<&str> = events.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(ids, expected);
    for (stored, event) in stored.iter().zip(&events) {
        assert_eq!(
            (&stored.data, &stored.metadata),
            (&event.data, &event.metadata)
        );
    }
}

#[tokio::test]
async fn several_streams_can_be_appended_in_one_transaction() {
    let pool = fresh_log().await;
    let mut tx = pool.begin().await.unwrap();
    new_stream(&mut tx, "a-1", 1).await;
    new_stream(&mut tx, "b-1", 2).await;
    tx.rollback().await.unwrap();
    assert!(read_stream(&pool, "a-1").await.unwrap().is_empty());

    let mut tx = pool.begin().await.unwrap();
    new_stream(&mut tx, "a-1", 1).await;
    new_stream(&mut tx, "b-1", 2).await;
    tx.commit().await.unwrap();
    assert_eq!(read_stream(&pool, "a-1").await.unwrap().len(), 1);
    assert_eq!(read_stream(&pool, "b-1").await.unwrap().len(), 1);
}

#[tokio::test]
async fn the_log_refuses_updates_deletes_and_truncation() {
    let pool = fresh_log().await;
    let mut conn = pool.acquire().await.unwrap();
    new_stream(&mut conn, "s-1", 1).await;
    for sql in [
        "UPDATE events SET type = 'x'",
        "DELETE FROM events",
        "TRUNCATE events",
    ] {
        let err = sqlx::query(sql).execute(&pool).await.unwrap_err();
        assert!(err.to_string().contains("append-only"), "{sql}: {err}");
    }
    assert_eq!(read_stream(&pool, "s-1").await.unwrap().len(), 1);
}

#[tokio::test]
async fn a_follower_resumes_after_its_checkpoint_when_loaded_again() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let mut conn = pool.acquire().await.unwrap();
    for n in 0..10 {
        new_stream(&mut conn, &format!("s-{n}"), n).await;
    }
    let mut follower = Follower::load(pool.clone(), "f", &notifier).await.unwrap();
    let batch = next_exactly(&mut follower, 4).await;
    save_checkpoint(&pool, "f", batch[3].cursor())
        .await
        .unwrap();
    drop(follower);

    let mut again = Follower::load(pool.clone(), "f", &notifier).await.unwrap();
    let rest = next_exactly(&mut again, 6).await;
    assert_eq!(rest[0].data["n"], 4);
}

#[tokio::test]
async fn audit_verify_names_the_first_event_altered_behind_the_triggers_back() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let mut conn = pool.acquire().await.unwrap();
    for n in 0..20 {
        append(&mut conn, "s-1", ExpectedVersion::Any, &[event(n)])
            .await
            .unwrap();
    }
    let mut chainer = Follower::load(pool.clone(), CHAINER, &notifier)
        .await
        .unwrap();
    // Other tests' open transactions on the same server may hold the horizon back a while.
    let mut chained = 0;
    while chained < 20 {
        chained += chain_batch(&pool, &mut chainer, 7).await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let clean = verify(&pool, |_, _| {}).await.unwrap();
    assert_eq!(
        (clean.verified, clean.unchained, clean.first_break),
        (20, 0, None)
    );

    let target = &read_stream(&pool, "s-1").await.unwrap()[12];
    sqlx::query("ALTER TABLE events DISABLE TRIGGER events_append_only")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("UPDATE events SET data = '{\"n\": 999}' WHERE id = $1")
        .bind(&target.id)
        .execute(&pool)
        .await
        .unwrap();
    let report = verify(&pool, |_, _| {}).await.unwrap();
    let broken = report.first_break.expect("the alteration is found");
    assert_eq!(broken.event_id.as_deref(), Some(target.id.as_str()));
    assert_eq!(report.verified, 12);

    sqlx::query("DELETE FROM events WHERE version = 3")
        .execute(&pool)
        .await
        .unwrap();
    let report = verify(&pool, |_, _| {}).await.unwrap();
    assert_eq!(report.first_break.unwrap().reason, "the event was removed");
}

/// The ARCHITECTURE.md acceptance for reading without skipping: concurrent writers that hold
/// their transactions open for random times and sometimes roll back, and followers reading
/// all the while.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_follower_sees_every_committed_event_once_in_one_order() {
    const WRITERS: usize = 16;
    const EVENTS: usize = 10_000;
    const FOLLOWERS: usize = 3;
    let pool = fresh_log().await;
    // Through a shared tail, as in the server: followers at the head read it, followers
    // behind it (at the start, after a long pass) the database.
    let notifier = Notifier::start(pool.clone()).with_tail(pool.clone());
    // How many events the followers must see; known once the writers are done.
    let expected = Arc::new(AtomicUsize::new(usize::MAX));
    let followers: Vec<_> = (0..FOLLOWERS)
        .map(|f| tokio::spawn(follow(pool.clone(), notifier.clone(), f, expected.clone())))
        .collect();
    let outcomes = Arc::new(std::sync::Mutex::new(Outcomes::default()));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let outcomes = outcomes.clone();
            tokio::spawn(write(
                pool.clone(),
                notifier.clone(),
                w,
                EVENTS / WRITERS,
                outcomes,
            ))
        })
        .collect();
    for w in writers {
        w.await.unwrap();
    }
    let outcomes = outcomes.lock().unwrap().clone();
    expected.store(outcomes.committed.len(), Ordering::SeqCst);
    let mut orders = Vec::new();
    for f in followers {
        let seen = tokio::time::timeout(Duration::from_secs(120), f)
            .await
            .unwrap()
            .unwrap();
        orders.push(check_seen(&seen, &outcomes));
    }
    assert!(
        orders.windows(2).all(|w| w[0] == w[1]),
        "followers disagree on the order"
    );
    assert!(outcomes.committed.len() > EVENTS / 2);
}

/// Which writers' events committed and which rolled back.
#[derive(Debug, Clone, Default)]
struct Outcomes {
    committed: HashSet<String>,
    rolled_back: HashSet<String>,
}

/// A follower reading until it has seen `expected` events, then once more: anything beyond
/// (a repeat, a rolled-back event) shows as `late`. Each entry is `id cursor …`.
async fn follow(
    pool: PgPool,
    notifier: Notifier,
    f: usize,
    expected: Arc<AtomicUsize>,
) -> Vec<String> {
    let mut follower = Follower::load(pool.clone(), &format!("f{f}"), &notifier)
        .await
        .unwrap();
    let mut seen = Vec::new();
    while seen.len() < expected.load(Ordering::SeqCst) {
        let batch = follower.next_batch(250).await.unwrap();
        let Some(last) = batch.last() else {
            follower.wait().await;
            continue;
        };
        let before = follower.cursor();
        save_checkpoint(&pool, follower.name(), last.cursor())
            .await
            .unwrap();
        follower.advance(last.cursor());
        let n = batch.len();
        seen.extend(
            batch
                .into_iter()
                .map(|e| format!("{} {} after={before} n={n}", e.id, e.cursor())),
        );
    }
    // A bounded look past the end, not a wait for a condition: nothing more may arrive.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let late = follower.next_batch(250).await.unwrap();
    seen.extend(
        late.into_iter()
            .map(|e| format!("{} {} late", e.id, e.cursor())),
    );
    seen
}

/// A writer appending `count` events to its own stream, each in a transaction held open for
/// a random time and rolled back one time in twenty.
async fn write(
    pool: PgPool,
    notifier: Notifier,
    w: usize,
    count: usize,
    outcomes: Arc<std::sync::Mutex<Outcomes>>,
) {
    let mut version = 0;
    for n in 0..count {
        let e = event(n);
        let mut tx = pool.begin().await.unwrap();
        let events = std::slice::from_ref(&e);
        append(
            &mut tx,
            &format!("w-{w}"),
            ExpectedVersion::Exact(version),
            events,
        )
        .await
        .unwrap();
        let (hold, roll_back) = {
            let mut rng = rand::thread_rng();
            (rng.gen_range(0..3000u64), rng.gen_ratio(1, 20))
        };
        tokio::time::sleep(Duration::from_micros(hold)).await;
        if roll_back {
            tx.rollback().await.unwrap();
            outcomes.lock().unwrap().rolled_back.insert(e.id);
        } else {
            tx.commit().await.unwrap();
            notifier.committed();
            outcomes.lock().unwrap().committed.insert(e.id);
            version += 1;
        }
    }
}

/// Checks one follower saw every committed event once and nothing else; answers the ids in
/// the order it saw them.
fn check_seen(seen: &[String], outcomes: &Outcomes) -> Vec<String> {
    let ids: Vec<String> = seen
        .iter()
        .map(|s| s.split(' ').next().unwrap().to_string())
        .collect();
    let mut entries = std::collections::HashMap::<&str, Vec<(usize, &str)>>::new();
    for (i, (id, full)) in ids.iter().zip(seen).enumerate() {
        entries.entry(id).or_default().push((i, full));
    }
    let dups: Vec<_> = entries.values().filter(|v| v.len() > 1).collect();
    let unique: HashSet<String> = ids.iter().cloned().collect();
    assert_eq!(
        unique.len(),
        ids.len(),
        "a follower received an event twice: {dups:?}"
    );
    assert_eq!(
        unique, outcomes.committed,
        "a follower missed a committed event or saw a rolled-back one"
    );
    assert!(unique.is_disjoint(&outcomes.rolled_back));
    ids
}

#[tokio::test]
async fn a_transaction_older_than_the_streams_last_writer_must_retry() {
    let pool = fresh_log().await;
    let mut older = pool.begin().await.unwrap();
    // Takes its transaction id now, before the other writer appends.
    sqlx::query("SELECT pg_current_xact_id()")
        .execute(&mut *older)
        .await
        .unwrap();
    let mut conn = pool.acquire().await.unwrap();
    new_stream(&mut conn, "s-1", 1).await;
    let err = append(&mut older, "s-1", ExpectedVersion::Any, &[event(2)])
        .await
        .unwrap_err();
    assert!(
        matches!(err, AppendError::Concurrency { actual: 1, .. }),
        "got {err:?}"
    );
    older.rollback().await.unwrap();
    // A new transaction is newer than every writer so far.
    append(&mut conn, "s-1", ExpectedVersion::Exact(1), &[event(2)])
        .await
        .unwrap();
}

#[tokio::test]
async fn a_paced_follower_takes_a_busy_moments_wake_ups_in_one_read() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let pace = std::time::Duration::from_millis(300);
    let mut paced = Follower::load(pool.clone(), "paced", &notifier)
        .await
        .unwrap()
        .paced(pace);
    let mut eager = Follower::load(pool.clone(), "eager", &notifier)
        .await
        .unwrap();
    assert!(eager.next_batch(10).await.unwrap().is_empty());
    let read = std::time::Instant::now();
    assert!(paced.next_batch(10).await.unwrap().is_empty());
    notifier.committed();
    // Woken at once, the unpaced one returns well before the poll interval …
    eager.wait().await;
    assert!(read.elapsed() < vps_events::follower::POLL_INTERVAL);
    // … and the paced one not before its pace since its last read.
    paced.wait().await;
    assert!(read.elapsed() >= pace, "{:?}", read.elapsed());
}

#[tokio::test]
async fn after_a_short_batch_a_follower_reads_again_only_when_woken_after_a_full_one_at_once() {
    let (pool, notifier, mut follower) = local_follower("short").await;
    let mut conn = pool.acquire().await.unwrap();
    let three = [event(1), event(2), event(3)];
    append(&mut conn, "s-1", ExpectedVersion::NoStream, &three)
        .await
        .unwrap();
    let patience = Duration::from_millis(200);

    // A full batch: more may be waiting, so no wait.
    let batch = next_exactly(&mut follower, 2).await;
    follower.advance(batch[1].cursor());
    tokio::time::timeout(patience, follower.wait_unless_full())
        .await
        .expect("no wait after a full batch");

    // A short batch held everything readable: no read again until a wake-up …
    assert!(follower.next_batch(10).await.unwrap().len() <= 1);
    let waited = tokio::time::timeout(patience, follower.wait_unless_full()).await;
    assert!(waited.is_err(), "a short batch is not read again at once");
    // … and a wake-up that came during the pass ends the wait at once.
    follower.next_batch(10).await.unwrap();
    notifier.committed();
    tokio::time::timeout(patience, follower.wait_unless_full())
        .await
        .expect("a wake-up during the pass is not lost");
}

/// A fresh log, a notifier of this process only, and a follower `name` of the log.
async fn local_follower(name: &str) -> (PgPool, Notifier, Follower) {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let follower = Follower::load(pool.clone(), name, &notifier).await.unwrap();
    (pool, notifier, follower)
}

/// The checkpoint `name` as stored.
async fn stored_checkpoint(pool: &PgPool, name: &str) -> vps_events::Cursor {
    vps_events::follower::load_checkpoint(pool, name)
        .await
        .unwrap()
}

#[tokio::test]
async fn events_passed_over_are_stored_when_the_log_falls_quiet_not_per_batch() {
    let (pool, notifier, mut follower) = local_follower("passing").await;
    let mut conn = pool.acquire().await.unwrap();
    append(
        &mut conn,
        "s-1",
        ExpectedVersion::NoStream,
        &[event(1), event(2)],
    )
    .await
    .unwrap();
    let last = next_exactly(&mut follower, 2).await[1].cursor();

    // Passed over (by a follower loaded just now): it reads on from there, and nothing is
    // stored yet.
    let mut follower = Follower::load(pool.clone(), "passing", &notifier)
        .await
        .unwrap();
    follower.pass_over(last).await.unwrap();
    assert_eq!(follower.cursor(), last);
    assert!(follower.next_batch(10).await.unwrap().is_empty());
    assert_eq!(
        stored_checkpoint(&pool, "passing").await,
        vps_events::Cursor::START
    );

    // A wait that no wake-up ends (the log is quiet) stores it.
    follower.wait().await;
    assert_eq!(stored_checkpoint(&pool, "passing").await, last);

    // While wake-ups keep coming, a checkpoint a second old is stored at the next pass.
    append(&mut conn, "s-1", ExpectedVersion::Exact(2), &[event(3)])
        .await
        .unwrap();
    let later = next_exactly(&mut follower, 1).await[0].cursor();
    tokio::time::sleep(Duration::from_millis(1100)).await;
    follower.pass_over(later).await.unwrap();
    assert_eq!(stored_checkpoint(&pool, "passing").await, later);
}

#[tokio::test]
async fn under_commits_as_often_as_the_poll_interval_each_pass_is_stored_before_the_next() {
    let (pool, notifier, mut follower) = local_follower("steady").await;
    let mut conn = pool.acquire().await.unwrap();
    for n in 1..=3 {
        append(&mut conn, "s-1", ExpectedVersion::Any, &[event(n)])
            .await
            .unwrap();
        notifier.committed();
        let passed = next_exactly(&mut follower, 1).await[0].cursor();
        follower.pass_over(passed).await.unwrap();
        // The next commit comes before a poll interval is over, as a steady stream's do.
        let next_commit = {
            let notifier = notifier.clone();
            tokio::spawn(async move {
                tokio::time::sleep(vps_events::follower::POLL_INTERVAL * 3 / 5).await;
                notifier.committed();
            })
        };
        follower.wait().await;
        next_commit.await.unwrap();
        assert_eq!(
            stored_checkpoint(&pool, "steady").await,
            passed,
            "pass {n} is stored by the wait the next commit ends"
        );
    }
}

/// Hints for other processes pushed within one notify gap reach a listener as one payload,
/// each part once, however often it was pushed; a channel's hints never ride on another's.
#[tokio::test]
async fn hints_pushed_together_arrive_as_one_payload_with_each_part_once() {
    let pool = fresh_log().await;
    let heard = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    tokio::spawn({
        let (pool, heard) = (pool.clone(), heard.clone());
        async move {
            vps_events::notify::listen_to(pool, "hint_test", |payload| {
                heard.lock().unwrap().push(payload.to_string())
            })
            .await
        }
    });
    let notifier = Notifier::start(pool.clone());
    // The listener is up once a hint comes back through it.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while heard.lock().unwrap().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the listener hears hints"
        );
        notifier.hint("hint_test", "probe");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    heard.lock().unwrap().clear();

    for part in ["node_b 2", "node_a 1", "node_b 2", "node_a 1"] {
        notifier.hint("hint_test", part);
    }
    notifier.hint("other_channel", "not here");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while heard.lock().unwrap().is_empty() {
        assert!(std::time::Instant::now() < deadline, "the hints arrive");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        *heard.lock().unwrap(),
        vec!["node_a 1,node_b 2".to_string()]
    );
}
