//! `vps bench list`: `instances.list` and `sandboxes.list` over HTTP with a filter and a
//! cursor (page 2), on tables of `--rows` sandboxes and as many instances (their instances),
//! beside a plain indexed `SELECT … LIMIT` on the same instances table; and `instances.get`
//! `asOf` and `instances.history` on that log.
//!
//! The log is built by bulk appends of the events a sandbox's life records (created, then
//! failed or deleted, its instance likewise), each batch applied by the same inline projectors
//! a command runs, in the same transaction: the tables are what the real path would make,
//! without a create's round trips. Rows spread over ten templates and ten `team` labels; one
//! in a hundred carries a `rare` label.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use sqlx::PgPool;
use vps_domain::aggregate::{Aggregate, Event};
use vps_domain::instance::{self, Instance, InstanceEvent, PoolKind};
use vps_domain::resources::Shape;
use vps_domain::sandbox::{self as sb, Sandbox, SandboxEvent};
use vps_domain::state_table::{DesiredState, InstanceState};
use vps_events::{Metadata, NewEvent};

use super::sandbox::Client;
use super::{percentile, round, BenchRange, Scratch, FLAVOR, IMAGE, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ListBench {
    /// Sandboxes (and instances) in the tables.
    pub rows: usize,
    /// Calls measured of each query.
    pub calls: usize,
}

/// One query's samples (milliseconds, sorted) and what its pages held.
#[derive(Debug, Clone, Default)]
pub struct Query {
    /// Its name in the output.
    pub name: String,
    /// Samples of the page-2 call.
    pub samples: Vec<f64>,
    /// Ids of page 1 then page 2, as answered.
    pub pages: (Vec<Value>, Vec<Value>),
}

/// What a run measured.
#[derive(Debug, Clone, Default)]
pub struct ListFigures {
    /// Events in the log.
    pub events: i64,
    /// Seconds the log and tables took to build.
    pub build_seconds: f64,
    /// The instance queries.
    pub instances: Vec<Query>,
    /// The sandbox queries.
    pub sandboxes: Vec<Query>,
    /// The plain indexed `SELECT … LIMIT` (milliseconds, sorted).
    pub baseline: Vec<f64>,
    /// `instances.get` with `asOf` (milliseconds, sorted).
    pub as_of: Vec<f64>,
    /// `instances.history` (milliseconds, sorted).
    pub history: Vec<f64>,
    /// The plan of a stream's read.
    pub stream_plan: String,
}

impl ListFigures {
    fn worst(queries: &[Query], pick: impl Fn(&Query) -> bool) -> f64 {
        queries
            .iter()
            .filter(|q| pick(q))
            .map(|q| percentile(&q.samples, 0.5))
            .fold(0.0, f64::max)
    }

    /// The JSON line.
    pub fn json(&self, o: &ListBench) -> Value {
        let baseline = percentile(&self.baseline, 0.5);
        let instances = Self::worst(&self.instances, |_| true);
        let sandboxes = Self::worst(&self.sandboxes, |q| !q.name.contains("label"));
        let labels = Self::worst(&self.sandboxes, |q| q.name.contains("label"));
        let mut line = json!({
            "rows": o.rows,
            "events": self.events,
            "build_seconds": round(self.build_seconds, 1),
            "instances_list_p50_ms": round(instances, 2),
            "sandboxes_list_p50_ms": round(sandboxes, 2),
            "sandboxes_label_list_p50_ms": round(labels, 2),
            "baseline_p50_ms": round(baseline, 3),
            "instances_ratio": round(instances / baseline, 1),
            "sandboxes_ratio": round(sandboxes.max(labels) / baseline, 1),
            "as_of_p50_ms": round(percentile(&self.as_of, 0.5), 2),
            "history_p50_ms": round(percentile(&self.history, 0.5), 2),
        });
        for q in self.instances.iter().chain(&self.sandboxes) {
            line[format!("{}_p50_ms", q.name)] = json!(round(percentile(&q.samples, 0.5), 2));
            line[format!("{}_p99_ms", q.name)] = json!(round(percentile(&q.samples, 0.99), 2));
        }
        line
    }
}

/// Runs the benchmark and prints the figures, JSON line last.
pub async fn run(server_url: &str, o: &ListBench) -> anyhow::Result<()> {
    let f = measure(server_url, o).await?;
    println!(
        "{} sandboxes and their instances: {} events built in {:.1} s",
        o.rows, f.events, f.build_seconds
    );
    println!(
        "baseline (plain indexed SELECT … LIMIT 51): p50 {:.3} ms",
        percentile(&f.baseline, 0.5)
    );
    for q in f.instances.iter().chain(&f.sandboxes) {
        println!(
            "{:<32} page 2: p50 {:.2} ms  p99 {:.2} ms",
            q.name,
            percentile(&q.samples, 0.5),
            percentile(&q.samples, 0.99)
        );
    }
    println!(
        "instances.get asOf p50 {:.2} ms, instances.history p50 {:.2} ms; a stream's read: {}",
        percentile(&f.as_of, 0.5),
        percentile(&f.history, 0.5),
        f.stream_plan
    );
    println!("{}", serde_json::to_string(&f.json(o))?);
    Ok(())
}

/// Sets up a scratch database and server, builds the tables, measures, and drops them.
pub async fn measure(server_url: &str, o: &ListBench) -> anyhow::Result<ListFigures> {
    let scratch = Scratch::create(server_url, 40).await?;
    let (config, token) = super::server_config();
    let result = match vps_api::server::start(config, scratch.pool.clone()).await {
        Ok(server) => {
            let client = Client {
                http: reqwest::Client::builder().no_proxy().build()?,
                url: server.url(),
                token,
            };
            let done = phases(&server, &client, o).await;
            server.shutdown().await;
            done
        }
        Err(e) => Err(e),
    };
    scratch.drop_database().await?;
    result
}

async fn phases(
    server: &vps_api::server::RunningServer,
    client: &Client,
    o: &ListBench,
) -> anyhow::Result<ListFigures> {
    let ctx = vps_api::server::reactor_ctx(&server.state, "bench");
    let range = BenchRange {
        name: "bench",
        runtime: None,
        cidr: "10.0.0.0/24",
        gateway: None,
        quota: 1_000_000_000,
    };
    let pool_id = super::pool_with_flavor(&ctx, &range).await?;
    super::register_bench_image(&ctx).await?;
    let mut templates = Vec::new();
    for t in 0..10 {
        templates.push(client.template(&pool_id, &format!("t{t}"), None).await?);
    }
    let db = &server.state.pool;
    let started = Instant::now();
    build(db, o.rows, &pool_id, &templates).await?;
    let mut f = ListFigures {
        build_seconds: started.elapsed().as_secs_f64(),
        ..ListFigures::default()
    };
    f.events = settle(db).await?;
    // As autovacuum leaves a table that took 100,000 rows: its statistics and visibility map
    // up to date (index-only plans count on the latter). Not timed.
    sqlx::query("VACUUM (ANALYZE) sandboxes, instances")
        .execute(db)
        .await?;

    let instance_queries = [
        ("instances_all", json!({})),
        ("instances_state_error", json!({ "state": "error" })),
        ("instances_state_deleted", json!({ "state": "deleted" })),
        ("instances_state_running", json!({ "state": "running" })),
        ("instances_pool", json!({ "poolId": pool_id })),
    ];
    for (name, filter) in instance_queries {
        f.instances
            .push(query(client, "instances.list", name, filter, o.calls).await?);
    }
    let sandbox_queries = [
        ("sandboxes_template", json!({ "templateId": templates[3] })),
        (
            "sandboxes_label_team",
            json!({ "labels": { "team": "t7" } }),
        ),
        (
            "sandboxes_label_rare",
            json!({ "labels": { "rare": "yes" } }),
        ),
        (
            "sandboxes_label_template",
            json!({ "templateId": templates[5], "labels": { "team": "t5" } }),
        ),
        ("sandboxes_deleted", json!({ "deleted": true })),
    ];
    for (name, filter) in sandbox_queries {
        f.sandboxes
            .push(query(client, "sandboxes.list", name, filter, o.calls).await?);
    }
    f.baseline = baseline(db, o.calls).await?;
    let ids: Vec<String> = f.instances[0].pages.0.iter().take(20).map(id_of).collect();
    let now = chrono::Utc::now().to_rfc3339();
    for n in 0..o.calls {
        let id = &ids[n % ids.len().max(1)];
        let body = json!({ "tenantId": TENANT, "instanceId": id, "asOf": now });
        f.as_of.push(timed(client, "instances.get", body).await?.1);
        let body = json!({ "tenantId": TENANT, "instanceId": id });
        f.history
            .push(timed(client, "instances.history", body).await?.1);
    }
    f.as_of.sort_by(f64::total_cmp);
    f.history.sort_by(f64::total_cmp);
    f.stream_plan = stream_plan(db, &Instance::stream(&ids[0])).await?;
    Ok(f)
}

/// The plan of `vps_events::read::read_stream`'s statement for `stream`, on one line.
async fn stream_plan(db: &PgPool, stream: &str) -> anyhow::Result<String> {
    let lines: Vec<String> =
        sqlx::query_scalar("EXPLAIN SELECT * FROM events WHERE stream = $1 ORDER BY version")
            .bind(stream)
            .fetch_all(db)
            .await?;
    Ok(lines.join(" / "))
}

/// Row `i`'s id of kind `prefix`: a well-formed 52-character body whose order is `i`'s (`i`
/// in base 26 with the letters alone, which sort as they count).
fn bench_id(prefix: &str, i: usize) -> String {
    let mut body = [b'a'; 52];
    let mut n = i;
    for b in body.iter_mut().rev().take(8) {
        *b = b'a' + (n % 26) as u8;
        n /= 26;
    }
    format!("{prefix}_{}", String::from_utf8_lossy(&body))
}

/// The `i` of a [`bench_id`].
#[cfg(test)]
fn bench_number(id: &str) -> usize {
    let body = id.split_once('_').map_or("", |(_, b)| b);
    body.bytes().fold(0, |n, b| n * 26 + usize::from(b - b'a'))
}

fn id_of(item: &Value) -> String {
    item["id"].as_str().unwrap_or_default().to_string()
}

async fn timed(client: &Client, method: &str, body: Value) -> anyhow::Result<(Value, f64)> {
    let started = Instant::now();
    let answer = client.call(method, body).await?;
    Ok((answer, started.elapsed().as_secs_f64() * 1000.0))
}

/// Page 1 of `filter`, then `calls` timed calls of page 2.
async fn query(
    client: &Client,
    method: &str,
    name: &str,
    filter: Value,
    calls: usize,
) -> anyhow::Result<Query> {
    let mut body = filter;
    body["tenantId"] = TENANT.into();
    let first = client.call(method, body.clone()).await?;
    let page1 = first["items"].as_array().cloned().unwrap_or_default();
    if let Some(cursor) = first["cursor"].as_str() {
        body["cursor"] = cursor.into();
    }
    let mut q = Query {
        name: name.to_string(),
        ..Query::default()
    };
    for _ in 0..calls {
        let (answer, ms) = timed(client, method, body.clone()).await?;
        q.samples.push(ms);
        q.pages.1 = answer["items"].as_array().cloned().unwrap_or_default();
    }
    q.pages.0 = page1;
    q.samples.sort_by(f64::total_cmp);
    Ok(q)
}

/// The plain indexed read the lists are held against: the tenant's newest 51 instances.
async fn baseline(db: &PgPool, calls: usize) -> anyhow::Result<Vec<f64>> {
    let mut samples = Vec::with_capacity(calls);
    for _ in 0..calls {
        let started = Instant::now();
        let rows = vps_projections::instances::newest_docs(db, TENANT, 51).await?;
        samples.push(started.elapsed().as_secs_f64() * 1000.0);
        anyhow::ensure!(!rows.is_empty(), "the baseline read no row");
    }
    samples.sort_by(f64::total_cmp);
    Ok(samples)
}

/// Waits until the server's chainer has hashed the whole log (its followers have then read
/// it too, give or take a batch); answers the log's length.
async fn settle(db: &PgPool) -> anyhow::Result<i64> {
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        // The log's own tables, not a projection's: how far the chainer got.
        let (events, chained): (i64, i64) = sqlx::query_as(
            "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM event_hashes)",
        )
        .fetch_one(db)
        .await?;
        if chained >= events || Instant::now() > deadline {
            tokio::time::sleep(Duration::from_secs(1)).await;
            return Ok(events);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Appends sandbox `i`'s life and its instance's, `BATCH` sandboxes a transaction, applying
/// the inline projectors to each batch in the same transaction.
async fn build(
    db: &PgPool,
    rows: usize,
    pool_id: &str,
    templates: &[String],
) -> anyhow::Result<()> {
    const BATCH: usize = 500;
    let metadata = Metadata {
        tenant_id: Some(TENANT.into()),
        actor: Some("id_bench".into()),
        ..Metadata::default()
    };
    let mut start = 0;
    while start < rows {
        let end = (start + BATCH).min(rows);
        let streams: Vec<(String, Vec<NewEvent>)> = (start..end)
            .flat_map(|i| life(i, pool_id, templates, &metadata))
            .collect();
        let mut tx = db.begin().await?;
        let recorded = vps_events::append_new_streams(&mut tx, &streams).await?;
        vps_projections::apply_all(&mut tx, &recorded, vps_projections::Prior::Unknown).await?;
        tx.commit().await?;
        start = end;
    }
    Ok(())
}

/// Sandbox `i` and its instance, as the log records them: three in four fail, the rest are
/// deleted.
fn life(
    i: usize,
    pool_id: &str,
    templates: &[String],
    metadata: &Metadata,
) -> [(String, Vec<NewEvent>); 2] {
    let instance_id = bench_id("inst", i);
    let sandbox_id = bench_id("sbx", i);
    let template_id = templates[i % templates.len()].clone();
    let deleted = i.is_multiple_of(4);
    let common = |state, desired_state| instance::Common {
        instance_id: instance_id.clone(),
        tenant_id: TENANT.into(),
        pool_id: pool_id.into(),
        state,
        desired_state,
        sandbox_id: Some(sandbox_id.clone()),
        warm_template_id: None,
    };
    let mut instance_events = vec![InstanceEvent::Created(instance::Created {
        common: common(InstanceState::Scheduling, DesiredState::Running),
        pool_kind: PoolKind::Hosted,
        flavor: FLAVOR.into(),
        shape: Shape {
            vcpu: 1,
            memory_gib: 1,
            disk_gib: 1,
            gpus: None,
        },
        image_id: IMAGE.into(),
        ssh_keys: vec![],
        user_data_ref: None,
        project_id: None,
        owner_identity_id: "id_bench".into(),
        idempotency_key: format!("sbx-{i}"),
        request_hash: "0".repeat(64),
        template_version: Some(1),
        network_policy: None,
        network_rules: Default::default(),
        restore_from: None,
        volumes: vec![],
        labels: Default::default(),
    })];
    let ids = sb::Lifecycle {
        sandbox_id: sandbox_id.clone(),
        tenant_id: TENANT.into(),
        template_id,
        instance_id: instance_id.clone(),
        pool_id: pool_id.into(),
    };
    let mut labels = vps_domain::labels::Labels::new();
    labels.insert("team".into(), format!("t{}", i % 10));
    if i % 100 == 1 {
        labels.insert("rare".into(), "yes".into());
    }
    let mut sandbox_events = vec![SandboxEvent::Created(sb::SandboxCreated {
        ids: ids.clone(),
        warm: false,
        ttl_seconds: 86_400,
        expires_at: chrono::Utc::now() + chrono::Duration::days(1),
        owner_identity_id: "id_bench".into(),
        idempotency_key: format!("sbx-{i}"),
        request_hash: "0".repeat(64),
        from_snapshot: None,
        on_timeout: Default::default(),
        labels,
    })];
    if deleted {
        instance_events.push(InstanceEvent::Deleting(instance::Deleting {
            common: common(InstanceState::Deleting, DesiredState::Deleted),
            reason: None,
        }));
        instance_events.push(InstanceEvent::Deleted(common(
            InstanceState::Deleted,
            DesiredState::Deleted,
        )));
        sandbox_events.push(SandboxEvent::Deleting(ids.clone()));
        sandbox_events.push(SandboxEvent::Deleted(sb::SandboxDeleted {
            ids,
            expired: false,
            reason: None,
        }));
    } else {
        instance_events.push(InstanceEvent::Failed(instance::Failed {
            common: common(InstanceState::Error, DesiredState::Running),
            reason: "runtime".into(),
            message: Some("the bench's guest failed".into()),
            node_id: None,
        }));
        sandbox_events.push(SandboxEvent::Failed(sb::SandboxFailed {
            ids,
            reason: "instance-failed".into(),
        }));
    }
    let new = |event_type: &str, data: Value| NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: event_type.into(),
        data,
        metadata: metadata.clone(),
    };
    [
        (
            Instance::stream(&instance_id),
            instance_events
                .iter()
                .map(|e| new(e.event_type(), e.data()))
                .collect(),
        ),
        (
            Sandbox::stream(&sandbox_id),
            sandbox_events
                .iter()
                .map(|e| new(e.event_type(), e.data()))
                .collect(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bench_ids_are_well_formed_and_sort_as_their_numbers() {
        let ids: Vec<String> = [0, 1, 25, 26, 99_999, 100_000]
            .map(|i| bench_id("inst", i))
            .into();
        for (id, i) in ids.iter().zip([0, 1, 25, 26, 99_999, 100_000]) {
            assert!(vps_domain::ids::is_valid_id("inst", id), "{id}");
            assert_eq!(bench_number(id), i);
        }
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
    }

    fn ids(items: &[Value]) -> Vec<String> {
        items.iter().map(id_of).collect()
    }

    /// A small run: each list answers the rows its filter selects, newest first, page 2 right
    /// after page 1; a stream's read is one index scan.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lists_answer_the_right_rows_in_order_at_a_small_size() {
        let Ok(url) = std::env::var("VPS_TEST_DATABASE_URL") else {
            eprintln!("VPS_TEST_DATABASE_URL is not set: skipped");
            return;
        };
        let o = ListBench {
            rows: 2000,
            calls: 3,
        };
        let f = measure(&url, &o).await.unwrap();
        assert!(f.events >= 2000 * 4 + 2000 / 4 * 2, "{}", f.events);
        let q = |name: &str| {
            f.instances
                .iter()
                .chain(&f.sandboxes)
                .find(|q| q.name == name)
                .unwrap()
        };
        // Ids are numbered in creation order, so newest first is descending ids.
        let n = bench_number;
        let check = |name: &str, want: &dyn Fn(usize, &Value) -> bool| {
            let q = q(name);
            let all: Vec<String> = ids(&q.pages.0).into_iter().chain(ids(&q.pages.1)).collect();
            assert_eq!(all.len(), 100, "{name}: two full pages");
            let numbers: Vec<usize> = all.iter().map(|id| n(id)).collect();
            assert!(
                numbers.windows(2).all(|w| w[0] > w[1]),
                "{name}: newest first {numbers:?}"
            );
            for item in q.pages.0.iter().chain(&q.pages.1) {
                assert!(want(n(&id_of(item)), item), "{name}: {item}");
            }
            numbers
        };
        let all = check("instances_all", &|_, _| true);
        assert_eq!(all[0], 1999);
        assert_eq!(all[99], 1900);
        check("instances_state_error", &|i, v| {
            i % 4 != 0 && v["state"] == "error"
        });
        check("instances_state_deleted", &|i, v| {
            i % 4 == 0 && v["state"] == "deleted"
        });
        assert!(q("instances_state_running").pages.0.is_empty());
        check("sandboxes_template", &|i, _| i % 10 == 3 && i % 4 != 0);
        check("sandboxes_label_team", &|i, v| {
            i % 10 == 7 && v["labels"]["team"] == "t7"
        });
        check("sandboxes_label_template", &|i, _| {
            i % 10 == 5 && i % 4 != 0
        });
        check("sandboxes_deleted", &|_, _| true);
        let rare = ids(&q("sandboxes_label_rare").pages.0);
        assert_eq!(rare.len(), 20, "{rare:?}");
        assert!(f.stream_plan.contains("Index"), "{}", f.stream_plan);
        assert_eq!(f.as_of.len(), 3);
    }
}
