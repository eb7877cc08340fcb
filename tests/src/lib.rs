//! Black-box test support: a real `vps` server on a fresh database, driven over HTTP.

pub mod browser;

use std::fmt::Debug;
use std::future::Future;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_api::config::{Config, IdentityConfig};
use vps_api::server::RunningServer;

/// How long a wait on background work lasts before the test fails: generous, so a busy
/// 2-core CI machine does not flake. A passing test never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(30);
/// How often a wait looks again.
pub const POLL: Duration = Duration::from_millis(50);

/// The operator's token in every test server.
pub const OPERATOR: &str = "operator-token";
/// Tenant `acme`'s token (identity `id_alice`).
pub const ALICE: &str = "alice-token";
/// Tenant `acme`'s second identity (`id_bob`).
pub const BOB: &str = "bob-token";
/// Tenant `globex`'s token (identity `id_eve`).
pub const EVE: &str = "eve-token";

/// A server on its own fresh database, and a client for it.
pub struct TestServer {
    /// The running server.
    pub server: RunningServer,
    /// HTTP client.
    pub http: reqwest::Client,
    /// The `file` snapshot store's directory (removed with the server).
    pub snapshots: tempfile::TempDir,
    /// The server's clock, shared with its replicas and emulated hosts: a test moves it
    /// ([`TestServer::advance`]) instead of sleeping until something is due.
    pub clock: vps_clock::ManualClock,
}

/// An error answer: status and body.
#[derive(Debug)]
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: Value,
}

impl Answer {
    /// The status and the error code, to compare in one assert.
    pub fn status_code(&self) -> (u16, Option<&str>) {
        (self.status, self.body["code"].as_str())
    }
}

/// A quota of `vcpu` vCPU with room to match: 10 GiB of memory and 100 GiB of disk a vCPU.
pub fn quota(vcpu: i64) -> Value {
    json!({ "vcpu": vcpu, "memoryGiB": vcpu * 10, "diskGiB": vcpu * 100 })
}

/// The body that names tenant `acme`'s instance `id`.
pub fn acme_instance(id: impl serde::Serialize) -> Value {
    json!({ "tenantId": "acme", "instanceId": id })
}

/// The body that names tenant `acme`'s sandbox `id`.
pub fn acme_sandbox(id: impl serde::Serialize) -> Value {
    json!({ "tenantId": "acme", "sandboxId": id })
}

/// `base` with the fields of `extra` added (an `extra` field replaces `base`'s): a request
/// body a test adjusts. Both must be JSON objects.
pub fn merged(mut base: Value, extra: Value) -> Value {
    let (Some(fields), Value::Object(more)) = (base.as_object_mut(), extra) else {
        panic!("merged takes two JSON objects");
    };
    fields.extend(more);
    base
}

/// The timings the sandbox tests run on: instances looked at again within a tenth of a second,
/// the sandbox reconciler passing every 0.2 s.
pub fn fast_sandboxes(c: &mut Config) {
    c.timings.transitional_look = 0.1;
    c.timings.unschedulable_retry = 0.2;
    c.timings.sandbox_pass = 0.2;
}

impl TestServer {
    /// Starts a server on a fresh database with the four test identities.
    pub async fn start() -> TestServer {
        TestServer::start_with(|_| {}).await
    }

    /// Like `start`, letting the test adjust the configuration (e.g. `[timings]`).
    pub async fn start_with(adjust: impl FnOnce(&mut Config)) -> TestServer {
        let pool = vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 40).await;
        TestServer::start_on(pool, adjust).await
    }

    /// Like `start_with`, on a database the test prepared (a fresh, migrated one), e.g. to hold
    /// a lease before the server's parts can take it.
    pub async fn start_on(pool: sqlx::PgPool, adjust: impl FnOnce(&mut Config)) -> TestServer {
        vps_api::telemetry::init_logging();
        let identity = |token: &str, identity: &str, tenant: Option<&str>| IdentityConfig {
            token: token.into(),
            identity: identity.into(),
            operator: tenant.is_none(),
            tenant: tenant.map(str::to_string),
        };
        let mut config = Config::default();
        config.http.listen = "127.0.0.1:0".into();
        config.identities = vec![
            identity(OPERATOR, "id_operator", None),
            identity(ALICE, "id_alice", Some("acme")),
            identity(BOB, "id_bob", Some("acme")),
            identity(EVE, "id_eve", Some("globex")),
        ];
        // Every replica must seal and open with the same key.
        config.secrets.key = Some("MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY=".into());
        // Test receivers listen on loopback.
        config.webhooks.allow_private = vec!["127.0.0.0/8".into()];
        let snapshots = tempfile::tempdir().expect("a temporary directory");
        config.snapshots.dir = Some(snapshots.path().to_path_buf());
        config.sandbox_exec.ca_key = Some(sandbox_ca().to_path_buf());
        adjust(&mut config);
        let clock = vps_clock::ManualClock::new();
        let server = vps_api::server::start_with_clock(config, pool, clock.clock())
            .await
            .expect("server starts");
        TestServer {
            server,
            http: reqwest::Client::new(),
            snapshots,
            clock,
        }
    }

    /// Moves the server's clock (and its replicas' and hosts') forward by `by`: what falls due
    /// in that time is due now, and the loops that wait for it look at once.
    pub fn advance(&self, by: Duration) {
        self.clock.advance(by);
    }

    /// Calls `group.method` with `token`; the JSON body or the error answer.
    pub async fn call(&self, token: &str, method: &str, body: Value) -> Result<Value, Answer> {
        self.call_at(&self.server.url(), token, method, body).await
    }

    /// Like [`TestServer::call`], on the server at `base_url` (a replica's).
    pub async fn call_at(
        &self,
        base_url: &str,
        token: &str,
        method: &str,
        body: Value,
    ) -> Result<Value, Answer> {
        let (group, name) = method.split_once('.').expect("group.method");
        let response = self
            .http
            .post(format!("{base_url}/api/compute/{group}/{name}"))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .expect("request");
        let status = response.status().as_u16();
        let body: Value = response.json().await.expect("JSON answer");
        if status == 200 {
            Ok(body)
        } else {
            Err(Answer { status, body })
        }
    }

    /// Like `call`, panicking on an error answer.
    pub async fn ok(&self, token: &str, method: &str, body: Value) -> Value {
        match self.call(token, method, body).await {
            Ok(v) => v,
            Err(a) => panic!("{method} failed: {} {}", a.status, a.body),
        }
    }

    /// Like `call`, panicking on success: the error answer.
    pub async fn err(&self, token: &str, method: &str, body: Value) -> Answer {
        match self.call(token, method, body).await {
            Ok(v) => panic!("{method} succeeded where a refusal was expected: {v}"),
            Err(a) => a,
        }
    }

    /// `instances.get` of `acme`'s instance `id` as `token`.
    pub async fn instance(&self, token: &str, id: impl serde::Serialize) -> Value {
        self.ok(token, "instances.get", acme_instance(id)).await
    }

    /// Alice creates `acme`'s sandbox template `name` in `pool`, of flavor `small` and image
    /// `img_ubuntu`, with the fields of `extra`: the template.
    pub async fn sandbox_template(&self, pool: &str, name: &str, extra: Value) -> Value {
        let body = json!({ "tenantId": "acme", "name": name, "poolId": pool,
                           "flavor": "small", "imageId": "img_ubuntu" });
        self.ok(ALICE, "sandboxTemplates.create", merged(body, extra))
            .await
    }

    /// Alice creates `acme`'s sandbox of `template` with key `key` and the fields of `extra`,
    /// waiting up to 20 s for it: the sandbox, which must be ready.
    pub async fn ready_sandbox(
        &self,
        template: impl serde::Serialize,
        key: &str,
        extra: Value,
    ) -> Value {
        let body = json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": key,
                           "wait": { "timeoutMs": 20000 } });
        let sandbox = self
            .ok(ALICE, "sandboxes.create", merged(body, extra))
            .await;
        assert_eq!(sandbox["state"], "ready", "{sandbox}");
        sandbox
    }

    /// A hosted pool offered to `acme` with `quota`, an IP range, `nodes` nodes of 16 vCPU /
    /// 64 GiB, flavors `small` (2 vCPU) and `large` (8 vCPU), and a public image `img_ubuntu`.
    pub async fn hosted_pool(&self, cidr: &str, nodes: usize, quota: Value) -> String {
        let pool = self
            .ok(
                OPERATOR,
                "pools.create",
                json!({ "name": "hosted", "class": "vps-host" }),
            )
            .await;
        let pool_id = pool["id"].as_str().unwrap().to_string();
        self.ok(
            OPERATOR,
            "pools.setIpPool",
            json!({ "poolId": pool_id, "cidr": cidr }),
        )
        .await;
        self.ok(
            OPERATOR,
            "pools.offer",
            json!({ "poolId": pool_id, "tenantId": "acme", "quota": quota }),
        )
        .await;
        for n in 0..nodes {
            self.ok(
                OPERATOR,
                "nodes.register",
                json!({ "poolId": pool_id, "name": format!("host-{n}"), "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 } }),
            )
            .await;
        }
        for (name, vcpu) in [("small", 2), ("large", 8)] {
            self.ok(OPERATOR, "flavors.create", json!({ "poolId": pool_id, "name": name, "vcpu": vcpu, "memoryGiB": vcpu * 2, "diskGiB": 20 })).await;
        }
        self.ok(
            OPERATOR,
            "images.register",
            json!({ "imageId": "img_ubuntu", "url": "https://images.example/ubuntu.qcow2", "sha256": "a".repeat(64), "format": "qcow2" }),
        )
        .await;
        pool_id
    }

    /// `GET /metrics` as text.
    pub async fn metrics(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.server.url()))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// Waits until every event appended so far is readable by followers and `events.list`:
    /// open transactions anywhere on the server (other tests' too) hold the horizon back.
    pub async fn settle(&self) {
        wait_until("every event readable", PATIENCE, || async {
            let pending: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM events WHERE transaction_id >= (SELECT pg_snapshot_xmin(pg_current_snapshot())))",
            )
            .fetch_one(&self.server.state.pool)
            .await
            .unwrap();
            !pending
        })
        .await;
    }

    /// Waits until the reactors have had their turn: every event readable ([`Self::settle`])
    /// and no work item due or held. A test that asserts something did *not* happen waits
    /// here instead of sleeping.
    pub async fn quiet(&self) {
        self.settle().await;
        wait_until("no reactor work due", PATIENCE, || async {
            let busy: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM work_items
                                 WHERE due_at <= now() OR lease_until > now())",
            )
            .fetch_one(&self.server.state.pool)
            .await
            .unwrap();
            !busy
        })
        .await;
    }

    /// A second server on the same database, as another replica would be.
    pub async fn replica(&self) -> RunningServer {
        let mut config = (*self.server.state.config).clone();
        config.http.listen = "127.0.0.1:0".into();
        vps_api::server::start_with_clock(
            config,
            self.server.state.pool.clone(),
            self.clock.clock(),
        )
        .await
        .expect("replica starts")
    }

    /// A hosted pool in `cidr` offered to `acme` with `quota` (see [`TestServer::hosted_pool`]),
    /// whose nodes are `nodes` emulated hosts that boot in `boot`.
    pub async fn pool_with_hosts(
        &self,
        cidr: &str,
        quota: Value,
        nodes: usize,
        boot: Duration,
    ) -> (String, Vec<vps_emulators::host::HostHandle>) {
        let pool = self.hosted_pool(cidr, 0, quota).await;
        let hosts = self.hosts(&pool, nodes, boot).await;
        (pool, hosts)
    }

    /// A hosted pool in `cidr` offered to `acme` with 64 vCPU, 256 GiB of memory and 2000 GiB
    /// of disk, whose one node `host` is an emulated host that boots in `boot`.
    pub async fn pool_with_host(
        &self,
        cidr: &str,
        boot: Duration,
    ) -> (String, vps_emulators::host::HostHandle) {
        let quota = json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 });
        let pool = self.hosted_pool(cidr, 0, quota).await;
        let (node, token) = self.register_node(&pool, "host").await;
        let host = self.host(&node, &token, boot);
        (pool, host)
    }

    /// Registers a 16 vCPU / 64 GiB node in `pool_id`; returns its id and token.
    pub async fn register_node(&self, pool_id: &str, name: &str) -> (String, String) {
        let answer = self
            .ok(OPERATOR, "nodes.register", json!({ "poolId": pool_id, "name": name, "capacity": { "vcpu": 16, "memoryGiB": 64, "diskGiB": 500 } }))
            .await;
        (
            answer["node"]["id"].as_str().unwrap().to_string(),
            answer["nodeToken"].as_str().unwrap().to_string(),
        )
    }

    /// Registers `n` nodes (`host-0`, `host-1`, …) in `pool_id`, each with a running emulated
    /// host that boots in `boot`.
    pub async fn hosts(
        &self,
        pool_id: &str,
        n: usize,
        boot: Duration,
    ) -> Vec<vps_emulators::host::HostHandle> {
        let mut hosts = Vec::with_capacity(n);
        for i in 0..n {
            let (node, token) = self.register_node(pool_id, &format!("host-{i}")).await;
            hosts.push(self.host(&node, &token, boot));
        }
        hosts
    }

    /// Starts an emulated host for a node, talking to this server over HTTP.
    pub fn host(
        &self,
        node_id: &str,
        token: &str,
        boot_delay: std::time::Duration,
    ) -> vps_emulators::host::HostHandle {
        let mut config = vps_emulators::host::HostConfig::new(
            self.server.url(),
            node_id.to_string(),
            token.to_string(),
        );
        config.boot_delay = boot_delay;
        config.report_interval = std::time::Duration::from_millis(200);
        config.poll_wait = std::time::Duration::from_millis(1000);
        config.tunnel_listen = Some("127.0.0.1:0".into());
        config.clock = self.clock.clock();
        vps_emulators::host::EmulatedHost::start(config)
    }

    /// Polls `instances.get` until `done(instance)` or `timeout`; the last answer.
    pub async fn until(
        &self,
        token: &str,
        tenant: &str,
        id: &str,
        timeout: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + timeout;
        loop {
            let inst = self
                .ok(
                    token,
                    "instances.get",
                    json!({ "tenantId": tenant, "instanceId": id }),
                )
                .await;
            if done(&inst) || Instant::now() > deadline {
                return inst;
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until the async NodeSpec projector has applied every event appended so far.
    pub async fn specs_caught_up(&self) {
        self.follower_caught_up(vps_projections::node_specs::FOLLOWER)
            .await;
    }

    /// Waits until the durable follower `name` has handled every event appended so far (a
    /// follower that has not started yet is not caught up).
    pub async fn follower_caught_up(&self, name: &str) {
        let what = format!("follower {name} at the head of the log");
        let check = || async {
            let left: i64 = sqlx::query_scalar(
                "SELECT count(*) FROM events e
                  WHERE (e.transaction_id, e.position) > (
                        coalesce((SELECT transaction_id FROM follower_checkpoints WHERE name = $1), '0'),
                        coalesce((SELECT position FROM follower_checkpoints WHERE name = $1), 0))",
            )
            .bind(name)
            .fetch_one(&self.server.state.pool)
            .await
            .unwrap();
            if left == 0 {
                Ok(())
            } else {
                Err(format!("{left} events to go"))
            }
        };
        let explain = || async {
            let ahead = self.events_after_checkpoint(name).await;
            let open = self.long_transactions().await.unwrap_or_default();
            Some(format!("{ahead}; {open}"))
        };
        eventually_explained(&what, PATIENCE, POLL, check, explain).await;
    }

    /// The follower `name`'s stored checkpoint, the log's read horizon and the first events
    /// after the checkpoint: what a follower that stopped short of the head has not stored.
    async fn events_after_checkpoint(&self, name: &str) -> String {
        let found: Result<Option<String>, _> = sqlx::query_scalar(
            "SELECT format('checkpoint %s/%s, horizon %s, next: %s', c.transaction_id, c.position,
                           pg_snapshot_xmin(pg_current_snapshot()),
                           (SELECT string_agg(format('%s %s %s/%s at %s', e.type, e.stream,
                                                     e.transaction_id, e.position, e.recorded_at), ', ')
                              FROM (SELECT * FROM events e
                                     WHERE (e.transaction_id, e.position) > (c.transaction_id, c.position)
                                     ORDER BY e.transaction_id, e.position LIMIT 10) e))
               FROM follower_checkpoints c WHERE c.name = $1",
        )
        .bind(name)
        .fetch_one(&self.server.state.pool)
        .await;
        match found {
            Ok(found) => found.unwrap_or_else(|| "no checkpoint".into()),
            Err(e) => format!("cannot read the events after the checkpoint: {e}"),
        }
    }

    /// The cluster's transactions open for more than 5 s that hold back the log's read
    /// horizon: followers read only below the oldest transaction id still running, in any
    /// database of the cluster, so one left open anywhere stalls every follower.
    async fn long_transactions(&self) -> Option<String> {
        let open: Result<Option<String>, _> = sqlx::query_scalar(
            "SELECT string_agg(format('%s pid %s %s for %s s: %s', datname, pid, state,
                                      round(extract(epoch FROM now() - xact_start)),
                                      left(query, 120)), '; ' ORDER BY xact_start)
               FROM pg_stat_activity
              WHERE (backend_xid IS NOT NULL OR backend_xmin IS NOT NULL)
                AND xact_start < now() - interval '5 seconds'",
        )
        .fetch_one(&self.server.state.pool)
        .await;
        Some(match open {
            Ok(open) => format!(
                "transactions open over 5 s in the cluster: {}",
                open.as_deref().unwrap_or("none")
            ),
            Err(e) => format!("cannot list the cluster's transactions: {e}"),
        })
    }

    /// Waits until the server is quiescent: every follower (waker, NodeSpecs, chainer,
    /// webhook fan-out, …) has handled every event appended so far, and no work item is being
    /// worked on or due. Until something comes due or a host speaks, nothing more happens.
    pub async fn quiescent(&self) {
        let check = || async {
            let behind = self.followers_behind().await;
            // Due on the server's clock; leased on the database's.
            let busy: Vec<(String, String)> = sqlx::query_as(
                "SELECT kind, key FROM work_items WHERE due_at <= $1 OR lease_until > now()",
            )
            .bind(self.clock.now())
            .fetch_all(&self.server.state.pool)
            .await
            .unwrap();
            if behind.is_empty() && busy.is_empty() {
                Ok(())
            } else {
                Err(format!(
                    "followers behind: {behind:?}; work items due or leased: {busy:?}"
                ))
            }
        };
        let explain = || self.long_transactions();
        eventually_explained("a quiescent server", PATIENCE, POLL, check, explain).await;
    }

    /// The followers with events after their checkpoint, and how many.
    async fn followers_behind(&self) -> Vec<(String, i64)> {
        sqlx::query_as(
            "SELECT c.name, (SELECT count(*) FROM events e
                              WHERE (e.transaction_id, e.position) > (c.transaction_id, c.position))
               FROM follower_checkpoints c
              WHERE EXISTS (SELECT 1 FROM events e
                             WHERE (e.transaction_id, e.position) > (c.transaction_id, c.position))",
        )
        .fetch_all(&self.server.state.pool)
        .await
        .unwrap()
    }

    /// Calls `tenants.delete` until nothing of `tenant` remains.
    pub async fn teardown_done(&self, tenant: &str) {
        eventually("the teardown done", PATIENCE, || async {
            let again = self
                .ok(OPERATOR, "tenants.delete", json!({ "tenantId": tenant }))
                .await;
            match again["remaining"].as_u64() {
                Some(0) => Ok(()),
                other => Err(other),
            }
        })
        .await;
    }

    /// `vps replay --verify` on this server's database: `true` when every projection equals
    /// its rebuild.
    pub async fn replay_equal(&self) -> bool {
        // A background part may append after the NodeSpec follower caught up; its tables are
        // then skipped, not different: catch up and compare again.
        for attempt in 0..10 {
            self.specs_caught_up().await;
            let report = vps_projections::replay::verify(&self.server.state.pool, |_| {})
                .await
                .expect("replay");
            if !report.diffs.is_empty() {
                eprintln!("{:#?}", report.diffs);
                return false;
            }
            if report.skipped.is_empty() {
                return true;
            }
            eprintln!(
                "not compared (async projector behind, attempt {attempt}): {:?}",
                report.skipped
            );
            tokio::time::sleep(POLL).await;
        }
        false
    }
}

/// The sandbox CA key file every test server of this process signs exec certificates with.
/// A process cannot remove its own at exit (statics are not dropped), so each removes those of
/// processes that have ended.
pub fn sandbox_ca() -> &'static std::path::Path {
    static PATH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        remove_ended_processes_cas();
        let path = std::env::temp_dir().join(format!("{CA_PREFIX}{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        vps_commands::sandboxes::exec::ca::SandboxCa::load_or_generate(&path)
            .expect("a test sandbox CA");
        path
    })
}

const CA_PREFIX: &str = "vps-test-ca-";

fn remove_ended_processes_cas() {
    // Which processes live is read from /proc; without it, nothing is removed.
    let proc = std::path::Path::new("/proc");
    if !proc.join("self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let pid = name.to_str().and_then(|n| n.strip_prefix(CA_PREFIX));
        if pid.is_some_and(|pid| !proc.join(pid).exists()) {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

pub use vps_pg::testing::{eventually_every, eventually_explained};

/// [`eventually_every`] at the usual [`POLL`].
pub async fn eventually<T, E, F, Fut>(what: &str, within: Duration, check: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    eventually_every(what, within, POLL, check).await
}

/// Waits until `condition` holds, failing the test naming `what` after `within`.
pub async fn wait_until<F, Fut>(what: &str, within: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    eventually(what, within, || {
        let holds = condition();
        async move { holds.await.then_some(()).ok_or("not yet") }
    })
    .await
}

/// The spec entry of `instance`: its `desiredState`, and whether the transaction that wrote it
/// last is the one that began `stream` (its version 1): a command that wrote the entry inline,
/// with no follower's pass rewriting it since. `None` when it has no entry.
pub async fn spec_entry_written_with(
    pool: &sqlx::PgPool,
    instance: &str,
    stream: &str,
) -> Option<(String, bool)> {
    sqlx::query_as(
        "SELECT e.entry->>'desiredState',
                e.xmin::text = (SELECT (transaction_id::text::bigint % 4294967296)::text
                                  FROM events WHERE stream = $2 AND version = 1)
           FROM node_spec_entries e WHERE e.instance_id = $1",
    )
    .bind(instance)
    .bind(stream)
    .fetch_optional(pool)
    .await
    .expect("reading the spec entry")
}

/// A valid OpenSSH public key for tests.
pub const SSH_KEY: &str =
    "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGq0Ql3mXyv+Wr7o9Rj2hBkoMBZk8mK6X3b4d0s3xBeA test@example";

#[cfg(test)]
mod ca_sweep_tests {
    use super::*;

    #[test]
    fn the_ca_files_of_ended_processes_go_and_a_live_ones_stays() {
        if !std::path::Path::new("/proc/self").exists() {
            return;
        }
        let dir = std::env::temp_dir();
        // Above any pid Linux hands out (pid_max is at most 2^22).
        let ended = dir.join(format!("{CA_PREFIX}{}", 1u64 << 40));
        let live = dir.join(format!("{CA_PREFIX}{}", std::process::id()));
        std::fs::write(&ended, "key").unwrap();
        std::fs::write(&live, "key").unwrap();
        remove_ended_processes_cas();
        assert!(!ended.exists(), "an ended process's file is removed");
        assert!(live.exists(), "a live process's file stays");
        let _ = std::fs::remove_file(live);
    }
}
