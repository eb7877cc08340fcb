//! `vps bench replay`: build a log of `--events` events (instances and sandboxes with churn,
//! usage records included), then run `replay --verify` and `audit verify` over it and compare
//! both rates with the same run's follower read of that log.
//!
//! The log is genuine: a pool, its nodes, flavor and image come from the operator commands;
//! the churn is appended in large batches as the commands' events would be (the same types,
//! data and stream versions), chained by the chainer, and projected into the live tables.

use std::sync::Arc;
use std::time::Instant;

use chrono::{DateTime, TimeDelta, Utc};
use serde_json::{json, Value};
use sqlx::{Connection, PgPool};
use vps_domain::usage::UsageRecord;
use vps_events::{Cursor, Follower, Notifier};

use super::{round, BenchRange, Scratch, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ReplayBench {
    /// Events of churn to build (besides the setup's few).
    pub events: u64,
}

/// The figures of one run.
#[derive(Debug, Clone)]
pub struct ReplayFigures {
    /// Events in the log.
    pub events: u64,
    /// Seconds `replay --verify` took.
    pub replay_seconds: f64,
    /// Its events per second.
    pub replay_events_per_s: f64,
    /// `audit verify`'s events per second.
    pub audit_events_per_s: f64,
    /// A follower's read of the same log, events per second.
    pub follow_events_per_s: f64,
    /// Whether the replay found every compared projection equal.
    pub equal: bool,
    /// Whether the chain verified intact.
    pub chain_intact: bool,
}

/// Builds the log, measures, prints the figures and the JSON line last; answers the figures.
pub async fn run(server_url: &str, o: &ReplayBench) -> anyhow::Result<ReplayFigures> {
    let scratch = Scratch::create(server_url, 8).await?;
    let result = measure(&scratch, o).await;
    scratch.drop_database().await?;
    let f = result?;
    println!(
        "log: {} events; follower read {:.0} events/s",
        f.events, f.follow_events_per_s
    );
    println!(
        "replay --verify: {:.2} s = {:.0} events/s (ratio to the follower: {:.3}; target ≥ 0.25), \
         projections {}",
        f.replay_seconds,
        f.replay_events_per_s,
        f.replay_events_per_s / f.follow_events_per_s,
        if f.equal { "equal" } else { "DIFFER" }
    );
    println!(
        "audit verify: {:.0} events/s (ratio to the follower: {:.3}), chain {}",
        f.audit_events_per_s,
        f.audit_events_per_s / f.follow_events_per_s,
        if f.chain_intact { "intact" } else { "BROKEN" }
    );
    println!(
        "{}",
        json!({
            "events": f.events,
            "replay_seconds": round(f.replay_seconds, 3),
            "replay_events_per_s": round(f.replay_events_per_s, 0),
            "audit_events_per_s": round(f.audit_events_per_s, 0),
            "follow_events_per_s": round(f.follow_events_per_s, 0),
            "replay_ratio": round(f.replay_events_per_s / f.follow_events_per_s, 3),
            "audit_ratio": round(f.audit_events_per_s / f.follow_events_per_s, 3),
            "equal": f.equal,
            "chain_intact": f.chain_intact,
        })
    );
    Ok(f)
}

async fn measure(scratch: &Scratch, o: &ReplayBench) -> anyhow::Result<ReplayFigures> {
    let pool = &scratch.pool;
    let built = Instant::now();
    let setup = setup(pool).await?;
    let setup_end = last_cursor(pool).await?;
    let churn = churn(&setup, o.events);
    insert(pool, &churn.rows).await?;
    settle_usage(pool, churn.last_window_end).await?;
    chain_all(pool).await?;
    project_live(pool, setup_end).await?;
    println!(
        "built the log in {:.1} s ({} instances, {} sandboxes, {} usage records)",
        built.elapsed().as_secs_f64(),
        churn.instances,
        churn.sandboxes,
        churn.records
    );

    let started = Instant::now();
    let events = follow_all(pool).await?;
    let follow_events_per_s = events as f64 / started.elapsed().as_secs_f64();

    let started = Instant::now();
    let report = vps_projections::replay::verify(pool, |_| {}).await?;
    let replay_seconds = started.elapsed().as_secs_f64();
    if !report.diffs.is_empty() {
        eprintln!("{:#?}", report.diffs);
    }
    println!("replay profile: {}", report.timings);

    let started = Instant::now();
    let audit = vps_events::chain::verify(pool, |_, _| {}).await?;
    let audit_events_per_s = audit.verified as f64 / started.elapsed().as_secs_f64();

    Ok(ReplayFigures {
        events,
        replay_seconds,
        replay_events_per_s: report.events as f64 / replay_seconds,
        audit_events_per_s,
        follow_events_per_s,
        equal: report.diffs.is_empty() && report.skipped.is_empty(),
        chain_intact: audit.first_break.is_none() && audit.unchained == 0,
    })
}

/// What the setup made.
struct Setup {
    pool_id: String,
    nodes: Vec<String>,
}

/// A pool with a /16 range, [`TENANT`]'s quota, the bench flavor and image, and 16 nodes, all
/// through the operator commands.
async fn setup(pool: &PgPool) -> anyhow::Result<Setup> {
    use vps_commands::operator::{self as ops, RegisterNode};
    let ctx = vps_commands::Ctx {
        pool: pool.clone(),
        notifier: Notifier::local_only(),
        spec_signals: Arc::default(),
        secrets: vps_commands::secrets::SecretKey::new(rand::random()),
        actor: vps_commands::Actor {
            identity: "id_bench_operator".into(),
            tenant: None,
            operator: true,
        },
        request_id: None,
        clock: vps_clock::Clock::system(),
        wakeups: Default::default(),
        reports: Arc::default(),
    };
    let range = BenchRange {
        name: "replay",
        runtime: None,
        cidr: "10.0.0.0/16",
        gateway: None,
        quota: 1_000_000_000,
    };
    let pool_id = super::pool_with_flavor(&ctx, &range).await?;
    super::register_bench_image(&ctx).await?;
    let mut nodes = Vec::new();
    for n in 0..16 {
        let capacity = vps_domain::resources::Capacity {
            vcpu: 4096,
            memory_gib: 65_536,
            disk_gib: 1_048_576,
            gpus: vec![],
        };
        let registered = ops::register_node(
            &ctx,
            RegisterNode {
                pool_id: pool_id.parse()?,
                name: format!("replay-{n}"),
                capacity,
                labels: Default::default(),
                runtimes: None,
                cpu_model: Some("emulated".into()),
            },
        )
        .await?;
        nodes.push(registered.node.id);
    }
    Ok(Setup { pool_id, nodes })
}

/// One event to append.
struct Row {
    stream: String,
    version: i64,
    id: String,
    event_type: &'static str,
    data: Value,
}

/// The churn: its events in log order, and what they hold.
struct Churn {
    rows: Vec<Row>,
    instances: u64,
    sandboxes: u64,
    records: u64,
    last_window_end: DateTime<Utc>,
}

/// Concurrent lives: each slot runs one instance (every fifth: a sandbox and its instance)
/// after another, on its own address, so addresses are released and leased again.
const SLOTS: usize = 4000;

/// `events` events of churn: the slots take turns, one event each, until there are enough.
fn churn(setup: &Setup, events: u64) -> Churn {
    let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move |below: u64| {
        seed = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (seed >> 33) % below.max(1)
    };
    let epoch = DateTime::from_timestamp(1_767_225_600, 0).unwrap_or_default();
    let mut out = Churn {
        rows: Vec::with_capacity(events as usize + SLOTS * 16),
        instances: 0,
        sandboxes: 0,
        records: 0,
        last_window_end: epoch,
    };
    let mut versions = std::collections::HashMap::<String, i64>::new();
    let mut lives: Vec<std::collections::VecDeque<(String, &'static str, Value)>> =
        vec![Default::default(); SLOTS];
    let mut serial = 0u64;
    while (out.rows.len() as u64) < events {
        for (slot, life) in lives.iter_mut().enumerate() {
            if life.is_empty() {
                serial += 1;
                *life = one_life(setup, slot, serial, &mut next, &mut out);
            }
            let Some((stream, event_type, data)) = life.pop_front() else {
                continue;
            };
            let version = versions.entry(stream.clone()).or_insert(0);
            *version += 1;
            out.rows.push(Row {
                id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
                stream,
                version: *version,
                event_type,
                data,
            });
        }
    }
    out
}

/// The events of one life in slot `slot`: an instance created, placed, running, maybe stopped
/// and started or resized, metered, deleted; every fifth slot a sandbox drives it.
fn one_life(
    setup: &Setup,
    slot: usize,
    serial: u64,
    next: &mut impl FnMut(u64) -> u64,
    out: &mut Churn,
) -> std::collections::VecDeque<(String, &'static str, Value)> {
    let id = format!(
        "inst_{}",
        ulid::Ulid::from(serial as u128).to_string().to_lowercase()
    );
    let sandbox = slot.is_multiple_of(5).then(|| {
        format!(
            "sbx_{}",
            ulid::Ulid::from(serial as u128).to_string().to_lowercase()
        )
    });
    let host = slot + 10;
    let address = format!("10.0.{}.{}", host >> 8, host & 255);
    let node = &setup.nodes[slot % setup.nodes.len()];
    let small = json!({ "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 });
    let large = json!({ "vcpu": 2, "memoryGiB": 2, "diskGiB": 2 });
    let stream = format!("instance-{id}");
    let mut events = std::collections::VecDeque::new();
    let common = |state: &str, desired: &str| {
        let mut c = json!({ "instanceId": id, "tenantId": TENANT, "poolId": setup.pool_id,
                            "state": state, "desiredState": desired });
        if let Some(s) = &sandbox {
            c["sandboxId"] = json!(s);
        }
        c
    };
    let with = |mut base: Value, extra: Value| {
        for (k, v) in extra.as_object().into_iter().flatten() {
            base[k] = v.clone();
        }
        base
    };
    let ids = sandbox.as_ref().map(|s| {
        json!({ "sandboxId": s, "tenantId": TENANT, "templateId": "tpl_bench",
                "instanceId": id, "poolId": setup.pool_id })
    });
    let at = DateTime::from_timestamp(1_767_225_600 + serial as i64 * 60, 0).unwrap_or_default();
    if let (Some(s), Some(ids)) = (&sandbox, &ids) {
        out.sandboxes += 1;
        events.push_back((
            format!("sandbox-{s}"),
            "sandbox.created",
            with(
                ids.clone(),
                json!({ "warm": false, "ttlSeconds": 3600, "expiresAt": at + TimeDelta::hours(1),
                        "ownerIdentityId": "id_bench", "idempotencyKey": s,
                        "requestHash": "0" }),
            ),
        ));
    }
    out.instances += 1;
    events.push_back((
        stream.clone(),
        "instance.created",
        with(
            common("scheduling", "running"),
            json!({ "poolKind": "hosted", "flavor": super::FLAVOR, "shape": small,
                    "imageId": super::IMAGE, "sshKeys": [], "ownerIdentityId": "id_bench",
                    "idempotencyKey": id, "requestHash": "0" }),
        ),
    ));
    events.push_back((
        stream.clone(),
        "instance.scheduled",
        with(
            common("provisioning", "running"),
            json!({ "nodeId": node, "allocationId": format!("alloc_{}", &id[5..]),
                    "address": address }),
        ),
    ));
    events.push_back((
        stream.clone(),
        "instance.starting",
        common("starting", "running"),
    ));
    events.push_back((
        stream.clone(),
        "instance.running",
        common("running", "running"),
    ));
    if let Some(ids) = &ids {
        events.push_back((
            format!("sandbox-{}", sandbox.as_deref().unwrap_or_default()),
            "sandbox.ready",
            with(ids.clone(), json!({ "warm": false })),
        ));
    }
    match next(10) {
        0 => {
            events.push_back((
                stream.clone(),
                "instance.stopping",
                common("running", "stopped"),
            ));
            events.push_back((
                stream.clone(),
                "instance.stopped",
                common("stopped", "stopped"),
            ));
            events.push_back((
                stream.clone(),
                "instance.resized",
                with(
                    common("stopped", "stopped"),
                    json!({ "flavor": "large", "shape": large, "previousFlavor": super::FLAVOR,
                            "previousShape": small }),
                ),
            ));
        }
        1..=3 => {
            events.push_back((
                stream.clone(),
                "instance.stopping",
                common("running", "stopped"),
            ));
            events.push_back((
                stream.clone(),
                "instance.stopped",
                common("stopped", "stopped"),
            ));
            events.push_back((
                stream.clone(),
                "instance.starting",
                common("starting", "running"),
            ));
            events.push_back((
                stream.clone(),
                "instance.running",
                common("running", "running"),
            ));
        }
        _ => {}
    }
    for n in 0..1 + next(3) {
        let start = at + TimeDelta::minutes(5 * n as i64);
        let end = start + TimeDelta::minutes(5);
        let Ok(record) = UsageRecord::from_data(&json!({
            "meter": "vps.vcpu.hours", "quantity": "0.083", "unit": "vcpu-hour",
            "windowStart": start, "windowEnd": end, "tenantId": TENANT,
            "identityId": "id_bench", "resourceId": id, "poolId": setup.pool_id,
        })) else {
            continue;
        };
        out.records += 1;
        out.last_window_end = out.last_window_end.max(end);
        events.push_back((record.stream(), "usage.recorded", record.data()));
    }
    if let (Some(s), Some(ids)) = (&sandbox, &ids) {
        events.push_back((format!("sandbox-{s}"), "sandbox.deleting", ids.clone()));
    }
    events.push_back((
        stream.clone(),
        "instance.deleting",
        common("deleting", "deleted"),
    ));
    events.push_back((stream, "instance.deleted", common("deleted", "deleted")));
    if let (Some(s), Some(ids)) = (&sandbox, &ids) {
        events.push_back((
            format!("sandbox-{s}"),
            "sandbox.deleted",
            with(ids.clone(), json!({ "expired": false })),
        ));
    }
    events
}

/// Appends the rows in order, 20,000 to a transaction, as one statement each.
async fn insert(pool: &PgPool, rows: &[Row]) -> anyhow::Result<()> {
    let metadata = serde_json::to_value(vps_events::Metadata {
        actor: Some("id_bench".into()),
        tenant_id: Some(TENANT.into()),
        ..Default::default()
    })?;
    for chunk in rows.chunks(20_000) {
        sqlx::query(
            "INSERT INTO events (stream, version, id, type, data, metadata)
             SELECT s, v, i, t, d, $6 FROM unnest($1::text[], $2::bigint[], $3::text[],
                                                  $4::text[], $5::jsonb[])
                  WITH ORDINALITY AS u(s, v, i, t, d, ord)
              ORDER BY ord",
        )
        .bind(chunk.iter().map(|r| r.stream.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| r.version).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| r.id.as_str()).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| r.event_type).collect::<Vec<_>>())
        .bind(chunk.iter().map(|r| &r.data).collect::<Vec<_>>())
        .bind(&metadata)
        .execute(pool)
        .await?;
    }
    Ok(())
}

/// Marks the metering settled past every record, as the metering reactor does once it has
/// projected them: the replay then compares the usage tables too.
async fn settle_usage(pool: &PgPool, until: DateTime<Utc>) -> anyhow::Result<()> {
    sqlx::query(
        "INSERT INTO usage_progress (name, settled_until, window_micros)
         VALUES ('usage', $1, 300000000)",
    )
    .bind(until)
    .execute(pool)
    .await?;
    Ok(())
}

/// Runs the chainer until the whole log is chained. Another database's open transaction on
/// the same server holds the read horizon back for a while (README, "The log"): it waits.
async fn chain_all(pool: &PgPool) -> anyhow::Result<()> {
    let notifier = Notifier::local_only();
    let mut chainer = Follower::load(pool.clone(), vps_events::chain::CHAINER, &notifier).await?;
    let total = event_count(pool).await?;
    let mut chained = 0;
    while chained < total {
        match vps_events::chain::chain_batch(pool, &mut chainer, 20_000).await? {
            0 => tokio::time::sleep(std::time::Duration::from_millis(5)).await,
            n => chained += n as u64,
        }
    }
    Ok(())
}

async fn event_count(pool: &PgPool) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM events")
        .fetch_one(pool)
        .await?;
    Ok(n as u64)
}

/// The cursor of the log's last event (every append has committed).
async fn last_cursor(pool: &PgPool) -> anyhow::Result<Cursor> {
    let last: Option<(String, i64)> = sqlx::query_as(
        "SELECT transaction_id::text, position FROM events
          ORDER BY transaction_id DESC, position DESC LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(match last {
        Some((txid, position)) => Cursor {
            transaction_id: txid.parse()?,
            position,
        },
        None => Cursor::START,
    })
}

/// Projects the churn (everything after `after`) into the live tables as the inline
/// projectors do, then the NodeSpecs, and marks the NodeSpec follower caught up.
async fn project_live(pool: &PgPool, after: Cursor) -> anyhow::Result<()> {
    let mut conn = pool.acquire().await?;
    let mut tx = conn.begin().await?;
    let last = vps_projections::replay::project_after(&mut tx, after).await?;
    vps_projections::node_specs::refresh_all(&mut tx).await?;
    vps_events::follower::save_checkpoint(&mut *tx, vps_projections::node_specs::FOLLOWER, last)
        .await?;
    tx.commit().await?;
    Ok(())
}

/// Reads the whole log as a follower does; how many events.
async fn follow_all(pool: &PgPool) -> anyhow::Result<u64> {
    let notifier = Notifier::local_only();
    let mut follower = Follower::load(pool.clone(), "bench-follower", &notifier).await?;
    let total = event_count(pool).await?;
    let mut read = 0u64;
    while read < total {
        let page = follower.next_batch(5000).await?;
        let Some(last) = page.last() else {
            // Held back by another database's open transaction (see `chain_all`).
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            continue;
        };
        follower.advance(last.cursor());
        read += page.len() as u64;
    }
    Ok(read)
}
