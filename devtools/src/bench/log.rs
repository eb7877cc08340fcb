//! `vps bench log`: single-event appends by 16 concurrent writers against plain single-row
//! INSERT transactions by 16 writers (the baseline), batched appends, and a full read by a
//! follower; `--rounds` rounds (3), each in a fresh scratch database, and the median of each
//! figure over the rounds.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sqlx::PgPool;
use vps_events::{append, ExpectedVersion, Follower, NewEvent, Notifier};

use super::{median, new_event, round, run_writers, single_appends, Scratch, Stop};

/// Knobs.
#[derive(Debug, Clone)]
pub struct LogBench {
    /// Concurrent writers.
    pub writers: usize,
    /// How long each write phase runs.
    pub seconds: f64,
    /// Events per batched append.
    pub batch: usize,
    /// Rounds of every phase; the figures reported are their medians.
    pub rounds: usize,
}

/// One round's figures.
#[derive(Debug, Clone, Copy)]
struct Figures {
    append_tps: f64,
    raw_insert_tps: f64,
    /// `append_tps / raw_insert_tps` of the same round.
    ratio: f64,
    batched_events_per_s: f64,
    follow_events_per_s: f64,
}

impl Figures {
    fn print(&self, label: &str) {
        println!(
            "{label:<8} appends {:>6.0} tx/s  raw INSERTs {:>6.0} tx/s  ratio {:.2}  \
             batched {:>7.0} events/s  follower {:>7.0} events/s",
            self.append_tps,
            self.raw_insert_tps,
            self.ratio,
            self.batched_events_per_s,
            self.follow_events_per_s
        );
    }

    fn json(&self) -> Value {
        json!({
            "append_tps": round(self.append_tps, 0),
            "raw_insert_tps": round(self.raw_insert_tps, 0),
            "ratio": round(self.ratio, 3),
            "batched_events_per_s": round(self.batched_events_per_s, 0),
            "follow_events_per_s": round(self.follow_events_per_s, 0),
        })
    }

    /// Each figure's median over `rounds` (the ratio too: the median of the rounds' ratios).
    fn medians(rounds: &[Figures]) -> Figures {
        let of = |f: fn(&Figures) -> f64| median(&rounds.iter().map(f).collect::<Vec<_>>());
        Figures {
            append_tps: of(|r| r.append_tps),
            raw_insert_tps: of(|r| r.raw_insert_tps),
            ratio: of(|r| r.ratio),
            batched_events_per_s: of(|r| r.batched_events_per_s),
            follow_events_per_s: of(|r| r.follow_events_per_s),
        }
    }
}

/// Runs every round and prints each round's figures and the medians, JSON line last.
pub async fn run(server_url: &str, o: &LogBench) -> anyhow::Result<()> {
    println!(
        "{} writers, {} s per phase, {} events per batched append, {} rounds",
        o.writers, o.seconds, o.batch, o.rounds
    );
    let mut rounds = Vec::with_capacity(o.rounds);
    for r in 1..=o.rounds {
        let scratch = Scratch::create(server_url, o.writers as u32 + 4).await?;
        let result = phases(&scratch.pool, o).await;
        scratch.drop_database().await?;
        let figures = result?;
        figures.print(&format!("round {r}"));
        rounds.push(figures);
    }
    let medians = Figures::medians(&rounds);
    medians.print("median");
    let mut line = medians.json();
    line["rounds"] = rounds.iter().map(Figures::json).collect();
    line["writers"] = json!(o.writers);
    line["seconds_per_phase"] = json!(o.seconds);
    println!("{}", serde_json::to_string(&line)?);
    Ok(())
}

async fn phases(pool: &PgPool, o: &LogBench) -> anyhow::Result<Figures> {
    sqlx::query(
        "CREATE TABLE bench_raw (id bigserial PRIMARY KEY, stream text NOT NULL,
             version bigint NOT NULL, event_id text NOT NULL UNIQUE, type text NOT NULL,
             data jsonb NOT NULL, metadata jsonb NOT NULL, recorded_at timestamptz DEFAULT now())",
    )
    .execute(pool)
    .await?;
    let duration = Duration::from_secs_f64(o.seconds);
    let notifier = Notifier::start(pool.clone());

    let raw = run_writers(o.writers, Stop::After(duration), {
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

    let appended = single_appends(pool, &notifier, o.writers, duration, "single").await?;

    let batch = o.batch as u64;
    let batched = run_writers(o.writers, Stop::After(duration), {
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

    Ok(Figures {
        append_tps: appended.per_second(),
        raw_insert_tps: raw.per_second(),
        ratio: appended.per_second() / raw.per_second(),
        batched_events_per_s: batched.per_second(),
        follow_events_per_s: follow_eps,
    })
}
