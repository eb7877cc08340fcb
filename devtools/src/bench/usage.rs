//! `vps bench usage`: meter a pre-built log of one day of `--instances` hosted instances with
//! churn (created, placed, some resized, most deleted; about 288,000 records for 1,000), and
//! compare with the same run's baseline: reading that log with a follower.

use std::time::Instant;

use chrono::{DateTime, Duration, Utc};
use serde_json::{json, Value};
use sqlx::PgPool;
use vps_domain::aggregate::Aggregate;
use vps_domain::instance::Instance;
use vps_domain::usage::Windows;
use vps_events::read::read_after;
use vps_events::{Cursor, Notifier};
use vps_reactors::usage::Metering;

use super::{round, Scratch};

/// Knobs.
#[derive(Debug, Clone)]
pub struct UsageBench {
    /// Instances over the day.
    pub instances: usize,
    /// Hours of log.
    pub hours: i64,
}

/// One pre-built event.
struct Row {
    stream: String,
    version: i64,
    event_type: &'static str,
    data: Value,
    at: DateTime<Utc>,
}

/// Builds the log, reads it (baseline), meters it, prints the figures and the JSON line.
pub async fn run(server_url: &str, o: &UsageBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(server_url, 8).await?;
    let windows = Windows::new(300_000_000).expect("positive");
    // The day ends a little before now, so every one of its windows has closed.
    let end = DateTime::from_timestamp(
        vps_clock::Clock::system().now().timestamp() / 300 * 300 - 600,
        0,
    )
    .unwrap();
    let start = end - Duration::hours(o.hours);
    let rows = churn(o, start, end);
    insert(&scratch.pool, &rows).await?;
    println!(
        "pre-built log: {} events of {} instances over {} h, 5-minute windows",
        rows.len(),
        o.instances,
        o.hours
    );
    let read_started = Instant::now();
    let read = read_all(&scratch.pool).await?;
    let read_per_s = read as f64 / read_started.elapsed().as_secs_f64();
    println!("baseline: a follower reads the log at {read_per_s:.0} events/s");

    let started = Instant::now();
    let mut metering =
        Metering::load(scratch.pool.clone(), &Notifier::local_only(), windows).await?;
    metering.catch_up().await?;
    let seconds = started.elapsed().as_secs_f64();
    let records = vps_projections::usage::record_count(&scratch.pool).await?;
    let per_s = records as f64 / seconds;
    println!(
        "metering: {records} records in {seconds:.2} s = {per_s:.0} records/s \
         (ratio to the log read: {:.3}; target ≥ 50,000 records/s)",
        per_s / read_per_s
    );
    scratch.drop_database().await?;
    println!(
        "{}",
        json!({
            "records": records,
            "seconds": round(seconds, 3),
            "records_per_s": round(per_s, 0),
            "log_events": read,
            "log_read_events_per_s": round(read_per_s, 0),
            "ratio": round(per_s / read_per_s, 3),
        })
    );
    Ok(())
}

/// A day of churn: instance `i` is placed somewhere in the first half of the day and lives
/// 6 to 18 hours (deleted if that ends inside the day); every tenth is resized halfway.
fn churn(o: &UsageBench, start: DateTime<Utc>, end: DateTime<Utc>) -> Vec<Row> {
    let span = (end - start).num_microseconds().unwrap_or(1);
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |below: i64| {
        seed = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
        ((seed >> 11) % below.max(1) as u64) as i64
    };
    let mut rows = Vec::new();
    for i in 0..o.instances {
        let id = format!("inst_bench{i:06}");
        let placed = start + Duration::microseconds(next(span / 2));
        let life = Duration::microseconds(span / 4 + next(span / 2));
        let mut version = 0;
        let mut push = |event_type: &'static str, at: DateTime<Utc>, extra: Value| {
            version += 1;
            let mut data = json!({ "instanceId": id, "tenantId": "acme", "poolId": "pool_bench",
                                   "state": "running", "desiredState": "running" });
            for (k, v) in extra.as_object().expect("object") {
                data[k] = v.clone();
            }
            rows.push(Row {
                stream: Instance::stream(&id),
                version,
                event_type,
                data,
                at,
            });
        };
        let shape = json!({ "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 });
        push(
            "instance.created",
            placed,
            json!({ "poolKind": "hosted", "shape": shape,
              "ownerIdentityId": "id_alice" }),
        );
        push(
            "instance.scheduled",
            placed,
            json!({ "nodeId": "node_bench" }),
        );
        push("instance.running", placed + Duration::seconds(2), json!({}));
        if i % 10 == 0 {
            let shape = json!({ "vcpu": 4, "memoryGiB": 8, "diskGiB": 20 });
            push(
                "instance.resized",
                placed + life / 2,
                json!({ "shape": shape }),
            );
        }
        if placed + life < end {
            push(
                "instance.deleted",
                placed + life,
                json!({ "state": "deleted" }),
            );
        }
    }
    rows.sort_by_key(|r| (r.at, r.stream.clone(), r.version));
    rows
}

/// Writes the rows as they would have been appended, with their own recorded times.
async fn insert(pool: &PgPool, rows: &[Row]) -> anyhow::Result<()> {
    for chunk in rows.chunks(5000) {
        let ids: Vec<String> = chunk
            .iter()
            .map(|_| format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()))
            .collect();
        sqlx::query(
            "INSERT INTO events (stream, version, id, type, data, recorded_at)
             SELECT * FROM unnest($1::text[], $2::bigint[], $3::text[], $4::text[], $5::jsonb[],
                                  $6::timestamptz[])",
        )
        .bind(chunk.iter().map(|r| r.stream.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| r.version).collect::<Vec<_>>())
        .bind(&ids)
        .bind(chunk.iter().map(|r| r.event_type).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| &r.data).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| r.at).collect::<Vec<_>>())
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Reads the whole log in the follower's order, as metering does; how many events.
async fn read_all(pool: &PgPool) -> anyhow::Result<u64> {
    let mut cursor = Cursor::START;
    let mut read = 0u64;
    loop {
        let page = read_after(pool, cursor, 5000).await?;
        let Some(last) = page.last() else {
            return Ok(read);
        };
        cursor = last.cursor();
        read += page.len() as u64;
    }
}
