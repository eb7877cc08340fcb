//! `vps bench chaos`: sandboxes and instances created, paused, resumed, snapshotted, stopped,
//! started and deleted at random by concurrent workers on emulated hosts, while faults strike:
//! hosts killed and restarted or silent for a while, one of two server replicas killed and
//! restarted, NATS down for 10 s, a host refusing snapshots. Then, once the faults stop and the
//! longest deadline has passed, what issue 40 promises is checked:
//! - no resource in a transitional state;
//! - nothing leaked: no lease, allocation or quota beyond what live resources hold;
//! - `replay --verify` equal to live;
//! - `usage verify` passes;
//! - every event delivered to NATS (a durable JetStream consumer bound before the workload)
//!   and to a webhook receiver exactly once, counted by event id.
//!
//! Everything runs in this process (the two replicas on their own connection pools, the
//! hosts, the receiver) except `nats-server`, a child killed and restarted on its port and
//! store. The CI test runs [`run`] with small numbers.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, consumer::DeliverPolicy};
use futures::StreamExt;
use serde_json::{json, Value};
use sqlx::PgPool;
use vps_api::config::{Config, NatsConfig};
use vps_api::server::RunningServer;
use vps_commands::webhooks::NewWebhook;
use vps_emulators::host::{EmulatedHost, HostConfig, HostHandle};

use super::delivery::{NatsServer, Receiver, STREAM};
use super::{round, run_writers, BenchPool, HostedServer, Scratch, Stop, FLAVOR, IMAGE, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct ChaosBench {
    /// Sandbox slots the workers fill, pause, resume, snapshot and empty.
    pub sandboxes: usize,
    /// Instance slots the workers fill, stop, start and empty.
    pub instances: usize,
    /// How long the workload and the faults last.
    pub seconds: f64,
    /// Concurrent workers.
    pub workers: usize,
    /// Emulated hosts (at least 2: one is always struck while the others serve).
    pub hosts: usize,
    /// Every `deadline_<resource>_<state>` and the snapshot timeout, in seconds: short, so
    /// whatever a fault left stuck ends soon after the faults stop.
    pub deadline: f64,
}

impl Default for ChaosBench {
    fn default() -> Self {
        ChaosBench {
            sandboxes: 300,
            instances: 100,
            seconds: 120.0,
            workers: 8,
            hosts: 4,
            deadline: 20.0,
        }
    }
}

/// What the run found (the JSON line). It passed when [`Outcome::passed`].
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Instances, sandboxes and snapshots still in a transitional state at the end.
    pub transitional: u64,
    /// Leases, allocations and quota units held beyond what live resources hold, and
    /// instances of deleted sandboxes not deleted.
    pub leaked: u64,
    /// `replay --verify`: every projection equals its rebuild from the log.
    pub replay_equal: bool,
    /// `usage verify`: the usage records equal their recomputation from the log.
    pub usage_verified: bool,
    /// Every event reached the JetStream consumer and the webhook receiver, each once (a
    /// killed replica's unrecorded webhook POSTs, sent again with their `webhook-id`, aside:
    /// see [`Outcome::webhook_after_kill`]).
    pub delivered_once: bool,
    /// Faults injected.
    pub faults: u64,
    /// API calls that succeeded.
    pub operations: u64,
    /// API calls refused (4xx: e.g. a pause of a sandbox being deleted).
    pub refused: u64,
    /// API calls that failed (5xx, or no answer while a replica was down).
    pub failed: u64,
    /// Events in the log when delivery was counted.
    pub events: u64,
    /// Events missing at the JetStream consumer / stored twice in the stream.
    pub nats_missing: u64,
    pub nats_duplicates: u64,
    /// Events missing at the webhook receiver / delivered more than once.
    pub webhook_missing: u64,
    pub webhook_duplicates: u64,
    /// Of those, POSTs a killed replica made but had not recorded, made again by the replica
    /// that took the subscription over (same `webhook-id`).
    pub webhook_after_kill: u64,
    /// Events whose reason is a passed deadline (`deadline:<state>`).
    pub deadlines: u64,
    /// Seconds of faults, and from their end to the last check.
    pub fault_seconds: f64,
    pub settle_seconds: f64,
}

impl Outcome {
    /// The JSON line.
    pub fn to_json(&self) -> Value {
        json!({
            "transitional": self.transitional,
            "leaked": self.leaked,
            "replay_equal": self.replay_equal,
            "usage_verified": self.usage_verified,
            "delivered_once": self.delivered_once,
            "faults": self.faults,
            "operations": self.operations,
            "refused": self.refused,
            "failed": self.failed,
            "events": self.events,
            "nats_missing": self.nats_missing,
            "nats_duplicates": self.nats_duplicates,
            "webhook_missing": self.webhook_missing,
            "webhook_duplicates": self.webhook_duplicates,
            "webhook_after_kill": self.webhook_after_kill,
            "deadlines": self.deadlines,
            "fault_seconds": self.fault_seconds,
            "settle_seconds": self.settle_seconds,
        })
    }

    /// All five promises held.
    pub fn passed(&self) -> bool {
        self.transitional == 0
            && self.leaked == 0
            && self.replay_equal
            && self.usage_verified
            && self.delivered_once
    }
}

/// The longest wait for the system to settle after the faults (beyond the deadline): generous,
/// for a slow machine; a healthy run settles in seconds.
const SETTLE_CAP: Duration = Duration::from_secs(180);
/// The longest wait for the last deliveries once settled.
const DELIVERY_CAP: Duration = Duration::from_secs(120);
/// A worker's pause between two calls, so the workload leaves the machine to the faults and
/// the reactors.
const WORKER_PAUSE: Duration = Duration::from_millis(40);
/// The webhook's subscription.
const HOOK_TYPES: [&str; 2] = ["instance.*", "sandbox.*"];
/// The durable consumer that counts what reached NATS.
const CONSUMER: &str = "bench-chaos";

/// Runs the workload and the faults, checks, and prints the figures, JSON line last.
pub async fn run(server_url: &str, o: &ChaosBench) -> anyhow::Result<Outcome> {
    let nats = NatsServer::start()?;
    let scratch = Scratch::create(server_url, 20).await?;
    let store = std::env::temp_dir().join(format!(
        "vps-bench-chaos-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    ));
    let result = phases(&scratch, nats, &store, o).await;
    scratch.drop_database().await?;
    let _ = std::fs::remove_dir_all(&store);
    let outcome = result?;
    println!(
        "outcome: {} transitional, {} leaked, replay {}, usage verify {}, delivery {}",
        outcome.transitional,
        outcome.leaked,
        if outcome.replay_equal {
            "equal"
        } else {
            "DIFFERS"
        },
        if outcome.usage_verified {
            "passes"
        } else {
            "FAILS"
        },
        if outcome.delivered_once {
            "exactly once"
        } else {
            "NOT exactly once"
        },
    );
    println!("{}", outcome.to_json());
    Ok(outcome)
}

/// What the faults strike: the hosts, the replicas and NATS.
struct Lab {
    /// Each node's host (`None` while killed) and its configuration.
    hosts: Vec<(Option<HostHandle>, HostConfig)>,
    /// The two replicas.
    replicas: [Replica; 2],
    nats: NatsServer,
    faults: u64,
    started: Instant,
    /// When each replica kill was done (its tasks aborted, its pool closed).
    kills: Vec<Instant>,
}

/// A server replica on its own pool (`None` while killed), as a `vps serve` process is.
struct Replica {
    running: Option<(RunningServer, PgPool)>,
    /// Its configuration: after the first start, listening where it first did, so a restarted
    /// replica is where its hosts and clients look for it.
    config: Config,
    database_url: String,
}

impl Replica {
    async fn start(config: &Config, database_url: &str) -> anyhow::Result<Replica> {
        let mut replica = Replica {
            running: None,
            config: config.clone(),
            database_url: database_url.to_string(),
        };
        replica.config.http.listen = "127.0.0.1:0".into();
        replica.restart().await?;
        if let Some((server, _)) = &replica.running {
            replica.config.http.listen = server.addr.to_string();
        }
        Ok(replica)
    }

    async fn restart(&mut self) -> anyhow::Result<()> {
        let pool = vps_events::connect(
            &self.database_url,
            &vps_events::DbOptions {
                max_connections: 15,
            },
        )
        .await?;
        let server = vps_api::server::start(self.config.clone(), pool.clone())
            .await
            .context("start a replica")?;
        self.running = Some((server, pool));
        Ok(())
    }

    /// Stops its every task at once (requests in flight fail) and closes its pool, which
    /// ends the leases it held.
    async fn kill(&mut self) {
        if let Some((server, pool)) = self.running.take() {
            server.shutdown().await;
            pool.close().await;
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.config.http.listen)
    }
}

async fn phases(
    scratch: &Scratch,
    nats: NatsServer,
    store: &std::path::Path,
    o: &ChaosBench,
) -> anyhow::Result<Outcome> {
    let (mut config, token) = super::server_config();
    config.nats = Some(NatsConfig {
        url: nats.url(),
        subject_prefix: String::new(),
    });
    config.webhooks.allow_private = vec!["127.0.0.0/8".into()];
    config.snapshots.dir = Some(store.to_path_buf());
    fast_timings(&mut config, o.deadline);
    let spec = BenchPool {
        nodes: o.hosts.max(2),
        node_size: 1024,
        quota: 1_000_000,
    };
    // A server sets the pool up, then the two replicas take over.
    let HostedServer {
        server,
        pool_id,
        nodes,
    } = HostedServer::start(&scratch.pool, config.clone(), &spec).await?;
    server.shutdown().await;
    let mut lab = Lab {
        hosts: Vec::new(),
        replicas: [
            Replica::start(&config, &scratch.url).await?,
            Replica::start(&config, &scratch.url).await?,
        ],
        nats,
        faults: 0,
        started: Instant::now(),
        kills: Vec::new(),
    };
    let urls = [lab.replicas[0].url(), lab.replicas[1].url()];
    lab.hosts = nodes
        .iter()
        .enumerate()
        .map(|(k, (node, token))| {
            let mut c = HostConfig::new(&urls[k % 2], node, token);
            c.boot_delay = Duration::from_millis(200);
            c.snapshot_bytes = 4096;
            (Some(EmulatedHost::start(c.clone())), c)
        })
        .collect();
    let setup = Setup {
        db: &scratch.pool,
        config: &config,
        pool_id: &pool_id,
        urls: &urls,
        token: &token,
    };
    let result = chaos(&setup, &mut lab, o).await;
    for (host, _) in lab.hosts.drain(..) {
        if let Some(h) = host {
            h.stop().await;
        }
    }
    for replica in &mut lab.replicas {
        replica.kill().await;
    }
    result
}

/// What the run works with.
struct Setup<'a> {
    /// The scratch database, for the checks.
    db: &'a PgPool,
    /// The replicas' configuration.
    config: &'a Config,
    pool_id: &'a str,
    urls: &'a [String; 2],
    token: &'a str,
}

/// Short reactor delays and deadlines, so a short run sees the faults' effects end.
fn fast_timings(config: &mut Config, deadline: f64) {
    let t = &mut config.timings;
    t.sandbox_pass = 1.0;
    t.transitional_look = 0.5;
    t.unschedulable_retry = 1.0;
    t.liveness_check = 1.0;
    t.lost_look = 2.0;
    t.usage_window = 10.0;
    t.snapshot_timeout = deadline;
    t.deadline_sandbox_starting = deadline;
    t.deadline_sandbox_pausing = deadline;
    t.deadline_sandbox_resuming = deadline;
    t.deadline_sandbox_deleting = deadline;
    t.deadline_instance_provisioning = deadline;
    t.deadline_instance_starting = deadline;
    t.deadline_instance_stopping = deadline;
    t.deadline_instance_resizing = deadline;
    t.deadline_instance_deleting = deadline;
}

async fn chaos(setup: &Setup<'_>, lab: &mut Lab, o: &ChaosBench) -> anyhow::Result<Outcome> {
    let db = setup.db;
    let ctx = match &lab.replicas[0].running {
        Some((server, _)) => vps_api::server::reactor_ctx(&server.state, "bench"),
        None => anyhow::bail!("replica A is not running"),
    };

    // Subscribers first: the webhook receiver and a durable JetStream consumer.
    let receiver = Receiver::start().await?;
    let (_, secret) = vps_commands::webhooks::create(
        &ctx,
        NewWebhook {
            url: receiver.url.clone(),
            types: HOOK_TYPES.iter().map(|t| t.to_string()).collect(),
            tenant_id: None,
            tenant_scope: None,
            allow_private: setup.config.webhooks.allowed_networks(),
        },
    )
    .await
    .context("create the webhook subscription")?;
    let _ = receiver.secret.set(secret);
    let tally = Arc::new(Mutex::new(HashMap::<String, HashSet<u64>>::new()));
    let bound = Arc::new(AtomicBool::new(false));
    let consuming = tokio::spawn(consume(lab.nats.url(), tally.clone(), bound.clone()));
    // The publisher creates the stream with the setup's first events.
    let waiting = Instant::now();
    while !bound.load(Ordering::SeqCst) {
        anyhow::ensure!(
            waiting.elapsed() < Duration::from_secs(60),
            "the JetStream consumer could not be bound to stream {STREAM} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let api = Api {
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(30))
            .build()?,
        urls: setup.urls.clone(),
        token: setup.token.to_string(),
        counts: Arc::default(),
        last_failure: Arc::default(),
    };
    let template = api
        .call(
            "sandboxTemplates.create",
            json!({ "tenantId": TENANT, "name": "chaos", "poolId": setup.pool_id,
                    "flavor": FLAVOR, "imageId": IMAGE }),
        )
        .await
        .map_err(|e| anyhow::anyhow!("create the template: {e:?}"))?["id"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let workload = Arc::new(Workload {
        api: api.clone(),
        template,
        pool_id: setup.pool_id.to_string(),
        sandboxes: (0..o.sandboxes).map(|_| Mutex::default()).collect(),
        instances: (0..o.instances).map(|_| Mutex::default()).collect(),
    });

    println!(
        "chaos: {} sandbox and {} instance slots, {} workers, {} hosts, two replicas, {:.0} s of faults, deadlines {:.0} s",
        o.sandboxes, o.instances, o.workers, lab.hosts.len(), o.seconds, o.deadline
    );
    let duration = Duration::from_secs_f64(o.seconds);
    lab.started = Instant::now();
    let writers = {
        let workload = workload.clone();
        run_writers(o.workers, Stop::After(duration), move |_, _| {
            let workload = workload.clone();
            async move {
                workload.step().await;
                tokio::time::sleep(WORKER_PAUSE).await;
                Ok(0)
            }
        })
    };
    // A silent host stays silent past the deadlines, so what it held stuck is released by them.
    let silence = Duration::from_secs_f64(o.deadline + 5.0);
    let (ran, struck) = tokio::join!(writers, strike(lab, duration, silence));
    ran?;
    struck?;
    let fault_seconds = lab.started.elapsed().as_secs_f64();
    let [operations, refused, failed] = api.counts();
    println!(
        "workload: {operations} calls succeeded, {refused} refused, {failed} failed in {fault_seconds:.1} s; {} faults",
        lab.faults
    );
    if let Some(last) = api
        .last_failure
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .as_ref()
    {
        println!("  last failure: {last}");
    }

    // The longest deadline passes, then everything must have settled.
    let settling = Instant::now();
    tokio::time::sleep(Duration::from_secs_f64(o.deadline)).await;
    let transitional = settle(db).await?;
    print_states(db).await?;
    let deadlines: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE data->>'reason' LIKE 'deadline:%'")
            .fetch_one(db)
            .await?;
    println!("events with a deadline's reason: {deadlines}");
    let leaked = leaks(db).await?;
    let replay_equal = replay_equal(db).await?;
    let usage_verified = usage_verified(db, setup.config).await?;
    let delivery = delivered(db, &receiver, &tally, &lab.kills).await?;
    consuming.abort();
    let settle_seconds = settling.elapsed().as_secs_f64();
    Ok(Outcome {
        transitional,
        leaked,
        replay_equal,
        usage_verified,
        delivered_once: delivery.once(),
        faults: lab.faults,
        operations,
        refused,
        failed,
        events: delivery.events,
        nats_missing: delivery.nats_missing,
        nats_duplicates: delivery.nats_duplicates,
        webhook_missing: delivery.webhook_missing,
        webhook_duplicates: delivery.webhook_duplicates,
        webhook_after_kill: delivery.webhook_after_kill,
        deadlines: deadlines as u64,
        fault_seconds: round(fault_seconds, 1),
        settle_seconds: round(settle_seconds, 1),
    })
}

/// The tenant's HTTP client of both replicas: calls alternate between them, and a call a
/// replica does not answer (killed) goes to the other, as a load balancer would send it.
#[derive(Clone)]
struct Api {
    http: reqwest::Client,
    urls: [String; 2],
    token: String,
    /// Succeeded, refused, failed.
    counts: Arc<[AtomicU64; 3]>,
    /// The last failure, for the figures.
    last_failure: Arc<Mutex<Option<String>>>,
}

/// A call's failure.
#[derive(Debug)]
enum CallError {
    /// A 4xx with its error code.
    Refused(Option<String>),
    /// A 5xx, or no answer.
    Failed(String),
}

impl Api {
    async fn call(&self, method: &str, body: Value) -> Result<Value, CallError> {
        let answer = self.send(method, &body).await;
        let slot = match &answer {
            Ok(_) => 0,
            Err(CallError::Refused(_)) => 1,
            Err(CallError::Failed(_)) => 2,
        };
        self.counts[slot].fetch_add(1, Ordering::Relaxed);
        if let Err(CallError::Failed(why)) = &answer {
            *self.last_failure.lock().unwrap_or_else(|e| e.into_inner()) =
                Some(format!("{method}: {why}"));
        }
        answer
    }

    async fn send(&self, method: &str, body: &Value) -> Result<Value, CallError> {
        let (group, name) = method.split_once('.').unwrap_or_default();
        let first = rand::random::<usize>() % 2;
        let mut last = String::new();
        for k in [first, 1 - first] {
            let sent = self
                .http
                .post(format!("{}/api/compute/{group}/{name}", self.urls[k]))
                .bearer_auth(&self.token)
                .json(body)
                .send()
                .await;
            let response = match sent {
                Ok(r) => r,
                Err(e) if e.is_connect() => {
                    last = e.to_string();
                    continue;
                }
                Err(e) => return Err(CallError::Failed(e.to_string())),
            };
            let status = response.status();
            let answer: Value = response.json().await.unwrap_or(Value::Null);
            return match status.as_u16() {
                200..=299 => Ok(answer),
                400..=499 => Err(CallError::Refused(
                    answer["code"].as_str().map(str::to_string),
                )),
                _ => Err(CallError::Failed(format!("{status}: {answer}"))),
            };
        }
        Err(CallError::Failed(last))
    }

    fn counts(&self) -> [u64; 3] {
        [0, 1, 2].map(|k| self.counts[k].load(Ordering::Relaxed))
    }
}

/// A slot of the workload: the resource it holds, if any, and how many it held before (the
/// next create's idempotency key).
#[derive(Default)]
struct Slot {
    id: Option<String>,
    generation: u64,
}

struct Workload {
    api: Api,
    template: String,
    pool_id: String,
    sandboxes: Vec<Mutex<Slot>>,
    instances: Vec<Mutex<Slot>>,
}

impl Workload {
    /// One random call: on a random slot of either kind, a create when it is empty, else a
    /// random operation on what it holds.
    async fn step(&self) {
        let total = self.sandboxes.len() + self.instances.len();
        if total == 0 {
            return;
        }
        let pick = rand::random::<usize>() % total;
        let roll = rand::random::<u32>() % 100;
        if pick < self.sandboxes.len() {
            self.sandbox(pick, roll).await;
        } else {
            self.instance(pick - self.sandboxes.len(), roll).await;
        }
    }

    async fn sandbox(&self, k: usize, roll: u32) {
        let (id, generation) = read(&self.sandboxes[k]);
        let Some(id) = id else {
            let body = json!({ "tenantId": TENANT, "templateId": self.template,
                               "ttlSeconds": 3600, "idempotencyKey": format!("sbx-{k}-{generation}") });
            if let Ok(s) = self.api.call("sandboxes.create", body).await {
                fill(&self.sandboxes[k], generation, &s);
            }
            return;
        };
        let body = json!({ "tenantId": TENANT, "sandboxId": id });
        let method = match roll {
            0..30 => "sandboxes.pause",
            30..60 => "sandboxes.resume",
            60..80 => "sandboxes.snapshot",
            _ => "sandboxes.delete",
        };
        let answer = self.api.call(method, body).await;
        if method == "sandboxes.delete" && gone(&answer) {
            empty(&self.sandboxes[k], generation);
        }
    }

    async fn instance(&self, k: usize, roll: u32) {
        let (id, generation) = read(&self.instances[k]);
        let Some(id) = id else {
            let body = json!({ "tenantId": TENANT, "poolId": self.pool_id, "flavor": FLAVOR,
                               "imageId": IMAGE, "idempotencyKey": format!("inst-{k}-{generation}") });
            if let Ok(i) = self.api.call("instances.create", body).await {
                fill(&self.instances[k], generation, &i);
            }
            return;
        };
        let body = json!({ "tenantId": TENANT, "instanceId": id });
        let method = match roll {
            0..35 => "instances.stop",
            35..70 => "instances.start",
            _ => "instances.delete",
        };
        let answer = self.api.call(method, body).await;
        if method == "instances.delete" && gone(&answer) {
            empty(&self.instances[k], generation);
        }
    }
}

fn read(slot: &Mutex<Slot>) -> (Option<String>, u64) {
    let s = slot.lock().unwrap_or_else(|e| e.into_inner());
    (s.id.clone(), s.generation)
}

/// Records a create's resource, unless the slot moved on meanwhile.
fn fill(slot: &Mutex<Slot>, generation: u64, created: &Value) {
    let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
    if s.generation == generation {
        s.id = created["id"].as_str().map(str::to_string);
    }
}

/// Empties the slot after a delete, so the next call creates a new resource.
fn empty(slot: &Mutex<Slot>, generation: u64) {
    let mut s = slot.lock().unwrap_or_else(|e| e.into_inner());
    if s.generation == generation {
        s.id = None;
        s.generation += 1;
    }
}

/// A delete that took, or found nothing left to delete.
fn gone(answer: &Result<Value, CallError>) -> bool {
    match answer {
        Ok(_) => true,
        Err(CallError::Refused(code)) => code.as_deref() == Some("NOT_FOUND"),
        Err(CallError::Failed(_)) => false,
    }
}

/// The faults, one after another in a fixed rotation until `duration` has passed (the last
/// one ends after it); each restores what it broke before the next starts.
async fn strike(lab: &mut Lab, duration: Duration, silence: Duration) -> anyhow::Result<()> {
    const GAP: Duration = Duration::from_secs(2);
    let hosts = lab.hosts.len();
    let mut k = 0usize;
    while lab.started.elapsed() < duration {
        let host = (k / 5) % hosts;
        match k % 5 {
            0 => {
                lab.note("NATS down for 10 s");
                lab.nats.kill();
                tokio::time::sleep(Duration::from_secs(10)).await;
                lab.nats.restart()?;
            }
            1 => {
                let r = (k / 5) % 2;
                lab.note(&format!(
                    "replica {} killed, restarted after 5 s",
                    ["A", "B"][r]
                ));
                lab.replicas[r].kill().await;
                lab.kills.push(Instant::now());
                tokio::time::sleep(Duration::from_secs(5)).await;
                lab.replicas[r].restart().await?;
            }
            2 => {
                lab.note(&format!("host {host} killed, restarted after 3 s"));
                if let Some(h) = lab.hosts[host].0.take() {
                    h.stop().await;
                }
                tokio::time::sleep(Duration::from_secs(3)).await;
                let config = lab.hosts[host].1.clone();
                lab.hosts[host].0 = Some(EmulatedHost::start(config));
            }
            3 => {
                let host = (host + 1) % hosts;
                lab.note(&format!(
                    "host {host} silent for {:.0} s",
                    silence.as_secs_f64()
                ));
                lab.host(host, |h| h.set_reporting(false));
                tokio::time::sleep(silence).await;
                lab.host(host, |h| h.set_reporting(true));
            }
            _ => {
                let host = (host + 2) % hosts;
                lab.note(&format!("host {host} refuses snapshots for 10 s"));
                lab.host(host, |h| h.refuse_snapshots(true));
                tokio::time::sleep(Duration::from_secs(10)).await;
                lab.host(host, |h| h.refuse_snapshots(false));
            }
        }
        k += 1;
        tokio::time::sleep(GAP).await;
    }
    Ok(())
}

impl Lab {
    fn note(&mut self, fault: &str) {
        self.faults += 1;
        println!(
            "  {:>6.1} s  fault {}: {fault}",
            self.started.elapsed().as_secs_f64(),
            self.faults
        );
    }

    fn host(&self, k: usize, act: impl Fn(&HostHandle)) {
        if let Some(h) = &self.hosts[k].0 {
            act(h);
        }
    }
}

/// How many instances, sandboxes and snapshots stand in a transitional state: the states the
/// deadlines cover.
async fn transitional(db: &PgPool) -> anyhow::Result<u64> {
    let n: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM instances
                  WHERE state IN ('provisioning', 'starting', 'resizing', 'deleting')
                     OR (state IN ('running', 'paused') AND desired_state = 'stopped'))
              + (SELECT count(*) FROM sandboxes
                  WHERE state IN ('starting', 'pausing', 'resuming', 'deleting'))
              + (SELECT count(*) FROM sandbox_snapshots WHERE state = 'pending')",
    )
    .fetch_one(db)
    .await?;
    Ok(n as u64)
}

/// Waits until nothing is transitional, for [`SETTLE_CAP`] at most; the count at the end.
async fn settle(db: &PgPool) -> anyhow::Result<u64> {
    let started = Instant::now();
    let mut said = Instant::now();
    loop {
        let n = transitional(db).await?;
        if n == 0 || started.elapsed() > SETTLE_CAP {
            println!(
                "settled: {n} transitional {:.1} s after the longest deadline",
                started.elapsed().as_secs_f64()
            );
            return Ok(n);
        }
        if said.elapsed() > Duration::from_secs(10) {
            said = Instant::now();
            println!("  still transitional: {n}");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// The states everything ended in.
async fn print_states(db: &PgPool) -> anyhow::Result<()> {
    for table in ["instances", "sandboxes", "sandbox_snapshots"] {
        let rows: Vec<(String, i64)> = sqlx::query_as(&format!(
            "SELECT state, count(*) FROM {table} GROUP BY 1 ORDER BY 2 DESC"
        ))
        .fetch_all(db)
        .await?;
        let states: Vec<String> = rows.iter().map(|(s, n)| format!("{s} {n}")).collect();
        println!("{table}: {}", states.join(", "));
    }
    Ok(())
}

/// What is held beyond what live resources hold: addresses and node allocations of deleted
/// instances, quota units beyond the live instances' shapes, instances of deleted sandboxes.
async fn leaks(db: &PgPool) -> anyhow::Result<u64> {
    let leases: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM ip_leases l LEFT JOIN instances i ON i.id = l.instance_id
          WHERE i.id IS NULL OR i.state = 'deleted'",
    )
    .fetch_one(db)
    .await?;
    let allocations: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM node_allocations a LEFT JOIN instances i ON i.id = a.instance_id
          WHERE a.instance_id IS NOT NULL AND (i.id IS NULL OR i.state = 'deleted')",
    )
    .fetch_one(db)
    .await?;
    let quota: Vec<(String, i64, i64)> = sqlx::query_as(
        "WITH live AS (
             SELECT pool_id, tenant_id, r.resource, sum(r.amount) AS amount
               FROM instances,
                    LATERAL (VALUES ('vcpu', (doc->'shape'->>'vcpu')::bigint),
                                    ('memoryGiB', (doc->'shape'->>'memoryGiB')::bigint),
                                    ('diskGiB', (doc->'shape'->>'diskGiB')::bigint)) AS r(resource, amount)
              WHERE state <> 'deleted'
              GROUP BY 1, 2, 3)
         SELECT q.resource, q.used, coalesce(live.amount, 0)::bigint
           FROM quotas q LEFT JOIN live USING (pool_id, tenant_id, resource)
          WHERE q.used <> coalesce(live.amount, 0)",
    )
    .fetch_all(db)
    .await?;
    let sandbox_instances: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes s JOIN instances i ON i.id = s.instance_id
          WHERE s.state = 'deleted' AND i.state <> 'deleted'",
    )
    .fetch_one(db)
    .await?;
    let quota_units: i64 = quota
        .iter()
        .map(|(_, used, live)| (used - live).abs())
        .sum();
    for (resource, used, live) in &quota {
        println!("quota {resource}: {used} used, live instances hold {live}");
    }
    println!(
        "leaked: {leases} addresses, {allocations} node allocations, {quota_units} quota units, \
         {sandbox_instances} instances of deleted sandboxes"
    );
    Ok((leases + allocations + quota_units + sandbox_instances) as u64)
}

/// `replay --verify`'s comparison; tables a projector has not caught up with are compared
/// again a moment later.
async fn replay_equal(db: &PgPool) -> anyhow::Result<bool> {
    for _ in 0..20 {
        let report = vps_projections::replay::verify(db, |_| {}).await?;
        for diff in &report.diffs {
            println!(
                "replay: table {} differs: {} rows only live, {} only rebuilt; e.g. {:?} / {:?}",
                diff.table,
                diff.only_live.len(),
                diff.only_rebuilt.len(),
                diff.only_live.first(),
                diff.only_rebuilt.first()
            );
        }
        if !report.diffs.is_empty() {
            return Ok(false);
        }
        if report.skipped.is_empty() {
            println!(
                "replay --verify: projections equal the log ({} events)",
                report.events
            );
            return Ok(true);
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!("replay --verify: projectors never caught up");
    Ok(false)
}

/// `usage verify` over everything metered so far.
async fn usage_verified(db: &PgPool, config: &Config) -> anyhow::Result<bool> {
    let windows = vps_api::server::usage_windows(config);
    let report = vps_reactors::usage::verify::verify(
        db,
        windows,
        chrono::DateTime::<chrono::Utc>::MIN_UTC,
        chrono::Utc::now(),
    )
    .await?;
    match (&report.until, &report.first_difference) {
        (None, _) => {
            println!("usage verify: nothing metered yet");
            Ok(false)
        }
        (Some(until), None) => {
            println!(
                "usage verify: {} records up to {until} equal the log",
                report.compared
            );
            Ok(true)
        }
        (Some(_), Some(difference)) => {
            println!(
                "usage verify: {}",
                vps_api::tools::usage::describe(difference)
            );
            Ok(false)
        }
    }
}

/// Delivery counts.
struct Delivery {
    events: u64,
    nats_missing: u64,
    nats_duplicates: u64,
    webhook_missing: u64,
    webhook_duplicates: u64,
    webhook_after_kill: u64,
}

impl Delivery {
    /// Nothing missing, nothing stored twice in the stream, and no event POSTed twice except
    /// the ones a killed replica had POSTed but not yet recorded: the replica that takes the
    /// subscription over POSTs those again with the same `webhook-id`, which receivers
    /// de-duplicate by (webhooks are at-least-once across a crash; the dispatcher's doc).
    fn once(&self) -> bool {
        self.nats_missing == 0
            && self.nats_duplicates == 0
            && self.webhook_missing == 0
            && self.webhook_duplicates == self.webhook_after_kill
    }
}

/// How long before a replica's kill an event it POSTed may have gone unrecorded: the run of
/// POSTs whose outcomes are recorded together takes well under a second.
const UNRECORDED: Duration = Duration::from_secs(5);
/// How long after a kill (the moment its tasks were aborted) its last POST may still arrive:
/// one already sent when its task was cancelled.
const IN_FLIGHT: Duration = Duration::from_secs(2);

/// Whether a repeated webhook request is a killed replica's unrecorded POST sent again: the
/// first came around a kill (shortly before it, or in flight at it), the next after it.
fn after_kill(requests: &[Instant], kills: &[Instant]) -> bool {
    match requests {
        [first, again, ..] => kills.iter().any(|k| {
            *first + UNRECORDED >= *k && *first <= *k + IN_FLIGHT && *again > *k + IN_FLIGHT
        }),
        _ => false,
    }
}

/// Waits until every event of the log so far reached the JetStream consumer and every one the
/// webhook wants reached the receiver ([`DELIVERY_CAP`] at most), then counts what is missing
/// and what came twice.
async fn delivered(
    db: &PgPool,
    receiver: &Receiver,
    tally: &Mutex<HashMap<String, HashSet<u64>>>,
    kills: &[Instant],
) -> anyhow::Result<Delivery> {
    let subscribed: i64 = sqlx::query_scalar(
        "SELECT position FROM events WHERE type = 'webhook.created' ORDER BY position LIMIT 1",
    )
    .fetch_one(db)
    .await?;
    let log: Vec<(String, String, i64)> =
        sqlx::query_as("SELECT id, type, position FROM events ORDER BY position")
            .fetch_all(db)
            .await?;
    let published: Vec<(&str, &str)> = log
        .iter()
        .filter(|(_, t, _)| vps_reactors::nats::subject_for("", t).is_some())
        .map(|(id, t, _)| (id.as_str(), t.as_str()))
        .collect();
    let hooked: Vec<&str> = log
        .iter()
        .filter(|(_, t, p)| {
            *p > subscribed
                && HOOK_TYPES
                    .iter()
                    .any(|h| vps_events::pattern::matches(h, t))
        })
        .map(|(id, _, _)| id.as_str())
        .collect();
    let missing = || {
        let at_nats = tally.lock().unwrap_or_else(|e| e.into_inner());
        let at_hook = receiver.requests.lock().unwrap_or_else(|e| e.into_inner());
        (
            published
                .iter()
                .filter(|(id, _)| !at_nats.contains_key(*id))
                .count() as u64,
            hooked
                .iter()
                .filter(|id| !at_hook.contains_key(**id))
                .count() as u64,
        )
    };
    let started = Instant::now();
    let (nats_missing, webhook_missing) = loop {
        let (nats, hook) = missing();
        if (nats == 0 && hook == 0) || started.elapsed() > DELIVERY_CAP {
            break (nats, hook);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let nats_duplicates = {
        let at_nats = tally.lock().unwrap_or_else(|e| e.into_inner());
        at_nats.values().filter(|seqs| seqs.len() > 1).count() as u64
    };
    let (webhook_duplicates, webhook_after_kill) = {
        let at_hook = receiver.requests.lock().unwrap_or_else(|e| e.into_inner());
        let repeated: Vec<&Vec<Instant>> = at_hook.values().filter(|r| r.len() > 1).collect();
        let after = repeated.iter().filter(|r| after_kill(r, kills)).count();
        // The others, timed from the kill before their second request, if any.
        for r in repeated.iter().filter(|r| !after_kill(r, kills)) {
            let since = |t: &Instant| match kills.iter().rev().find(|k| *k <= t) {
                Some(k) => format!("{:+.1} s", t.duration_since(*k).as_secs_f64()),
                None => "before any kill".into(),
            };
            let times: Vec<String> = r.iter().map(since).collect();
            println!(
                "  webhook POSTed again, not after a kill: requests at {} from the last kill",
                times.join(", ")
            );
        }
        (repeated.len() as u64, after as u64)
    };
    println!(
        "delivery: {} events in the log; JetStream: {} of {} arrived, {nats_duplicates} stored twice; \
         webhook: {} of {} arrived, {webhook_duplicates} POSTed again ({webhook_after_kill} of them \
         a killed replica's unrecorded POSTs), {} bad signatures",
        log.len(),
        published.len() as u64 - nats_missing,
        published.len(),
        hooked.len() as u64 - webhook_missing,
        hooked.len(),
        receiver.bad_signatures.load(Ordering::Relaxed),
    );
    let types_missing: BTreeMap<&str, usize> = {
        let at_nats = tally.lock().unwrap_or_else(|e| e.into_inner());
        published
            .iter()
            .filter(|(id, _)| !at_nats.contains_key(*id))
            .fold(BTreeMap::new(), |mut m, (_, t)| {
                *m.entry(*t).or_default() += 1;
                m
            })
    };
    if !types_missing.is_empty() {
        println!("  missing at JetStream by type: {types_missing:?}");
    }
    Ok(Delivery {
        events: log.len() as u64,
        nats_missing,
        nats_duplicates,
        webhook_missing,
        webhook_duplicates,
        webhook_after_kill,
    })
}

/// Reads the publisher's stream through a durable pull consumer, bound before the workload and
/// kept across NATS restarts (it lives in the server's store), recording each `Nats-Msg-Id`'s
/// stream sequences: one event stored twice has two. Reconnects whenever NATS went away.
async fn consume(
    url: String,
    tally: Arc<Mutex<HashMap<String, HashSet<u64>>>>,
    bound: Arc<AtomicBool>,
) {
    loop {
        // Any error (NATS killed, the stream not there yet) starts over.
        let _ = consume_once(&url, &tally, &bound).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn consume_once(
    url: &str,
    tally: &Mutex<HashMap<String, HashSet<u64>>>,
    bound: &AtomicBool,
) -> anyhow::Result<()> {
    let client = async_nats::connect(url).await?;
    let js = jetstream::new(client);
    let stream = js
        .get_stream(STREAM)
        .await
        .map_err(|e| anyhow::anyhow!("stream {STREAM}: {e}"))?;
    let consumer: jetstream::consumer::PullConsumer = stream
        .get_or_create_consumer(
            CONSUMER,
            pull::Config {
                durable_name: Some(CONSUMER.into()),
                deliver_policy: DeliverPolicy::All,
                ack_policy: AckPolicy::Explicit,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| anyhow::anyhow!("consumer: {e}"))?;
    bound.store(true, Ordering::SeqCst);
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| anyhow::anyhow!("messages: {e}"))?;
    while let Some(message) = messages.next().await {
        let message = message.map_err(|e| anyhow::anyhow!("message: {e}"))?;
        let id = message
            .headers
            .as_ref()
            .and_then(|h| h.get("Nats-Msg-Id"))
            .map(|v| v.as_str().to_string());
        let sequence = message.info().map(|i| i.stream_sequence).ok();
        if let (Some(id), Some(sequence)) = (id, sequence) {
            tally
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .entry(id)
                .or_default()
                .insert(sequence);
        }
        let _ = message.ack().await;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeat_is_a_killed_replicas_only_when_its_first_request_came_around_the_kill() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let kills = [at(100)];
        // Shortly before the kill, again once the lease ran out.
        assert!(after_kill(&[at(97), at(140)], &kills));
        // In flight while the replica's tasks were being aborted.
        assert!(after_kill(&[at(101), at(140)], &kills));
        // Long before the kill, or both after it: a live worker's repeat.
        assert!(!after_kill(&[at(60), at(140)], &kills));
        assert!(!after_kill(&[at(110), at(150)], &kills));
        // Once is not a repeat.
        assert!(!after_kill(&[at(99)], &kills));
    }
}
