//! `vps bench log`: single-event appends by 16 concurrent writers against plain single-row
//! INSERT transactions by 16 writers (the baseline), batched appends, and a full read by a
//! follower.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::json;
use sqlx::PgPool;
use vps_events::{append, ExpectedVersion, Follower, Metadata, NewEvent, Notifier};

use super::Scratch;

/// Knobs.
#[derive(Debug, Clone)]
pub struct LogBench {
    /// Concurrent writers.
    pub writers: usize,
    /// How long each write phase runs.
    pub seconds: f64,
    /// Events per batched append.
    pub batch: usize,
}

pub(super) fn new_event(n: u64) -> NewEvent {
    NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: "bench.appended".into(),
        data: json!({ "n": n, "state": "running", "tenantId": "bench" }),
        metadata: Metadata {
            actor: Some("id_bench".into()),
            tenant_id: Some("bench".into()),
            ..Metadata::default()
        },
    }
}

/// Runs every phase and prints the figures, JSON line last.
pub async fn run(server_url: &str, options: &LogBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(server_url, options.writers as u32 + 4).await?;
    let result = phases(&scratch.pool, options).await;
    scratch.drop_database().await?;
    let figures = result?;
    println!("{}", serde_json::to_string(&figures)?);
    Ok(())
}

async fn phases(pool: &PgPool, o: &LogBench) -> anyhow::Result<serde_json::Value> {
    sqlx::query(
        "CREATE TABLE bench_raw (id bigserial PRIMARY KEY, stream text NOT NULL,
             version bigint NOT NULL, event_id text NOT NULL UNIQUE, type text NOT NULL,
             data jsonb NOT NULL, metadata jsonb NOT NULL, recorded_at timestamptz DEFAULT now())",
    )
    .execute(pool)
    .await?;
    let duration = Duration::from_secs_f64(o.seconds);
    let notifier = Notifier::start(pool.clone());

    let raw = run_writers(o.writers, duration, {
        let pool = pool.clone();
        move |w, n| {
            let pool = pool.clone();
            async move {
                let e = new_event(n);
                let mut tx = pool.begin().await?;
                sqlx::query(
                    "INSERT INTO bench_raw (stream, version, event_id, type, data, metadata)
                     VALUES ($1, $2, $3, $4, $5, $6)",
                )
                .bind(format!("raw-{w}"))
                .bind(n as i64 + 1)
                .bind(&e.id)
                .bind(&e.event_type)
                .bind(&e.data)
                .bind(serde_json::to_value(&e.metadata)?)
                .execute(&mut *tx)
                .await?;
                tx.commit().await?;
                Ok(1)
            }
        }
    })
    .await?;
    let raw_tps = raw.per_second();
    println!(
        "raw INSERT transactions ({} writers): {raw_tps:>10.0} tx/s",
        o.writers
    );

    let appended = single_appends(pool, &notifier, o.writers, duration).await?;
    let append_tps = appended.per_second();
    println!(
        "single-event appends ({} writers):  {append_tps:>10.0} tx/s",
        o.writers
    );

    let batch = o.batch as u64;
    let batched = run_writers(o.writers, duration, {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        move |w, n| {
            let (pool, notifier) = (pool.clone(), notifier.clone());
            async move {
                let events: Vec<NewEvent> = (0..batch).map(|i| new_event(n * batch + i)).collect();
                let mut tx = pool.begin().await?;
                let expected = if n == 0 {
                    ExpectedVersion::NoStream
                } else {
                    ExpectedVersion::Exact((n * batch) as i64)
                };
                append(&mut tx, &format!("batch-{w}"), expected, &events).await?;
                tx.commit().await?;
                notifier.committed();
                Ok(batch)
            }
        }
    })
    .await?;
    let batched_eps = batched.per_second();
    println!(
        "batched appends ({} per append):    {batched_eps:>10.0} events/s",
        o.batch
    );

    // Let every writer's transaction end so the whole log is below the horizon.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let mut follower = Follower::load(pool.clone(), "bench-follower", &notifier).await?;
    let started = Instant::now();
    let mut read = 0u64;
    loop {
        let page = follower.next_batch(5000).await?;
        let Some(last) = page.last() else { break };
        follower.advance(last.cursor());
        read += page.len() as u64;
    }
    let follow_eps = read as f64 / started.elapsed().as_secs_f64();
    println!("follower full read ({read} events):  {follow_eps:>10.0} events/s");

    let ratio = append_tps / raw_tps;
    println!("ratio append/raw: {ratio:.2}");
    Ok(json!({
        "append_tps": append_tps.round(),
        "raw_insert_tps": raw_tps.round(),
        "ratio": (ratio * 1000.0).round() / 1000.0,
        "batched_events_per_s": batched_eps.round(),
        "follow_events_per_s": follow_eps.round(),
        "writers": o.writers,
        "seconds_per_phase": o.seconds,
    }))
}

/// `writers` writers appending one event per transaction, each to its own stream, for
/// `duration`: what the log alone sustains (the baseline of other benchmarks too).
pub(super) async fn single_appends(
    pool: &PgPool,
    notifier: &Notifier,
    writers: usize,
    duration: Duration,
) -> anyhow::Result<Rate> {
    let (pool, notifier) = (pool.clone(), notifier.clone());
    run_writers(writers, duration, move |w, n| {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        async move {
            let mut tx = pool.begin().await?;
            let expected = if n == 0 {
                ExpectedVersion::NoStream
            } else {
                ExpectedVersion::Exact(n as i64)
            };
            append(&mut tx, &format!("single-{w}"), expected, &[new_event(n)]).await?;
            tx.commit().await?;
            notifier.committed();
            Ok(1)
        }
    })
    .await
}

/// Runs `writers` loops of `op(writer, iteration)` for `duration`; returns the summed counts.
pub(super) async fn run_writers<F, Fut>(
    writers: usize,
    duration: Duration,
    op: F,
) -> anyhow::Result<Rate>
where
    F: Fn(usize, u64) -> Fut + Clone + Send + 'static,
    Fut: std::future::Future<Output = anyhow::Result<u64>> + Send,
{
    let total = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    let deadline = Instant::now() + duration;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (op, total) = (op.clone(), total.clone());
        tasks.push(tokio::spawn(async move {
            let mut n = 0;
            while Instant::now() < deadline {
                total.fetch_add(op(w, n).await?, Ordering::Relaxed);
                n += 1;
            }
            anyhow::Ok(())
        }));
    }
    for t in tasks {
        t.await??;
    }
    Ok(Rate {
        count: total.load(Ordering::Relaxed),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// A count over the time it took.
pub(super) struct Rate {
    count: u64,
    seconds: f64,
}

impl Rate {
    pub(super) fn per_second(&self) -> f64 {
        self.count as f64 / self.seconds
    }
}
