//! Provider pools over HTTP: the real server and its reconciler drive machines on the Hetzner
//! Cloud emulator, the Proxmox VE emulator and the in-process `emulator` provider.
//!
//! Every scenario is written once (`mod scenarios`) and run against each cloud.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_api::config::{Config, IdentityConfig};
use vps_domain::state_table::InstanceState;
use vps_emulators::{hetzner, proxmox, Fault};
use vps_reactors::providers::{EmulatorConfig, EmulatorFault, EmulatorProvider};
use vps_tests::{acme_instance, eventually, TestServer, ALICE, OPERATOR, SSH_KEY};

/// How long a scenario waits for the reconciler to get somewhere.
const PATIENCE: Duration = Duration::from_secs(30);

/// A sealing key shared by a server and its restarted successor (base64 of 32 zero bytes).
const SECRETS_KEY: &str = "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=";

/// Every `emulator` account of this process shares one cloud and one fault queue: scenarios
/// on it take turns.
static EMULATOR_TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A server with fast `[timings]` on the database at `url`.
async fn server_on(url: &str, provider_retry: f64) -> TestServer {
    vps_api::telemetry::init_logging();
    let pool = vps_events::connect(
        url,
        &vps_events::DbOptions {
            max_connections: 20,
        },
    )
    .await
    .expect("connect");
    vps_events::migrate(&pool).await.expect("migrate");
    let identity = |token: &str, identity: &str, tenant: Option<&str>| IdentityConfig {
        token: token.into(),
        identity: identity.into(),
        operator: tenant.is_none(),
        tenant: tenant.map(str::to_string),
    };
    let mut config = Config::default();
    config.http.listen = "127.0.0.1:0".into();
    config.secrets.key = Some(SECRETS_KEY.into());
    config.timings.transitional_look = 0.05;
    config.timings.provider_poll = 0.2;
    config.timings.provider_retry = provider_retry;
    config.timings.lost_look = 0.2;
    config.identities = vec![
        identity(OPERATOR, "id_operator", None),
        identity(ALICE, "id_alice", Some("acme")),
    ];
    let clock = vps_clock::ManualClock::new();
    let server = vps_api::server::start_with_clock(config, pool, clock.clock())
        .await
        .expect("server starts");
    TestServer {
        server,
        http: reqwest::Client::new(),
        snapshots: tempfile::tempdir().expect("a temporary directory"),
        clock,
    }
}

/// One of the clouds a provider pool can use, and its test knobs.
enum Cloud {
    Hetzner {
        base_url: String,
        emulator: hetzner::Handle,
    },
    Proxmox {
        base_url: String,
        emulator: proxmox::Handle,
    },
    /// The process-wide in-process cloud; `before` are the machines other scenarios left.
    Emulator {
        before: Vec<String>,
        _turn: tokio::sync::MutexGuard<'static, ()>,
    },
}

impl Cloud {
    async fn hetzner() -> Cloud {
        let (base_url, emulator) = hetzner::Emulator::start().await;
        Cloud::Hetzner { base_url, emulator }
    }

    async fn proxmox() -> Cloud {
        let (base_url, emulator) = proxmox::Emulator::start().await;
        Cloud::Proxmox { base_url, emulator }
    }

    async fn emulator() -> Cloud {
        let turn = EMULATOR_TURN.lock().await;
        let before = shared_emulator()
            .machines()
            .into_iter()
            .map(|m| m.id)
            .collect();
        Cloud::Emulator {
            before,
            _turn: turn,
        }
    }

    /// `providerAccounts.create`'s `provider` and `config`, with a good or a bad credential.
    fn account(&self, good_credentials: bool) -> (&'static str, Value) {
        match self {
            Cloud::Hetzner { base_url, emulator } => {
                let token = if good_credentials {
                    emulator.token()
                } else {
                    "not-the-token"
                };
                (
                    "hetzner-cloud",
                    json!({ "baseUrl": base_url, "token": token, "location": "fsn1" }),
                )
            }
            Cloud::Proxmox { base_url, emulator } => {
                let options = emulator.options();
                let secret = if good_credentials {
                    options.token_secret.as_str()
                } else {
                    "00000000-0000-0000-0000-000000000000"
                };
                (
                    "proxmox",
                    json!({ "baseUrl": base_url, "tokenId": options.token_id, "tokenSecret": secret,
                            "node": options.node, "storage": "local-lvm" }),
                )
            }
            Cloud::Emulator { .. } => ("emulator", json!({ "bootDelayMs": 100 })),
        }
    }

    /// The secret the account's config carries, if any.
    fn secret(&self) -> Option<String> {
        match self {
            Cloud::Hetzner { emulator, .. } => Some(emulator.token().to_string()),
            Cloud::Proxmox { emulator, .. } => Some(emulator.options().token_secret.clone()),
            Cloud::Emulator { .. } => None,
        }
    }

    fn offer_id(&self) -> &'static str {
        match self {
            Cloud::Hetzner { .. } => "cx22",
            Cloud::Proxmox { .. } => "9000",
            Cloud::Emulator { .. } => "emu-small",
        }
    }

    /// The machines of this scenario: (id, status as the cloud words it).
    fn machines(&self) -> Vec<(String, String)> {
        match self {
            Cloud::Hetzner { emulator, .. } => emulator
                .machines()
                .into_iter()
                .map(|s| (s.id.to_string(), s.status))
                .collect(),
            Cloud::Proxmox { emulator, .. } => emulator
                .machines()
                .into_iter()
                .map(|vm| (vm.vmid.to_string(), vm.status))
                .collect(),
            Cloud::Emulator { before, .. } => shared_emulator()
                .machines()
                .into_iter()
                .filter(|m| !before.contains(&m.id))
                .map(|m| (m.id, m.state.to_string()))
                .collect(),
        }
    }

    /// Makes the next call answer "rate limited, retry after 1 s".
    fn rate_limit_next(&self) {
        match self {
            Cloud::Hetzner { emulator, .. } => emulator.fail_next(1, Fault::RateLimited),
            Cloud::Proxmox { emulator, .. } => emulator.fail_next(1, Fault::RateLimited),
            Cloud::Emulator { .. } => shared_emulator().inject(EmulatorFault::RateLimited, 1),
        }
    }

    /// Makes the next `times` creates happen, but their answers be lost.
    fn lose_create_answers(&self, times: usize) {
        match self {
            Cloud::Hetzner { emulator, .. } => emulator.lose_next_create_answers(times),
            Cloud::Proxmox { emulator, .. } => emulator.lose_next_create_answers(times),
            Cloud::Emulator { .. } => shared_emulator().inject(EmulatorFault::AnswerLost, times),
        }
    }

    /// Deletes a machine without the control plane knowing.
    fn remove(&self, id: &str) {
        let removed = match self {
            Cloud::Hetzner { emulator, .. } => emulator.remove(id.parse().unwrap()),
            Cloud::Proxmox { emulator, .. } => emulator.remove(id.parse().unwrap()),
            Cloud::Emulator { .. } => shared_emulator().remove(id),
        };
        assert!(removed, "machine {id} existed");
    }
}

fn shared_emulator() -> EmulatorProvider {
    EmulatorProvider::shared(EmulatorConfig::default())
}

/// A provider pool on `cloud` offered to `acme`, with a flavor `small`; answers the pool and
/// account ids.
async fn provider_pool(t: &TestServer, cloud: &Cloud, good_credentials: bool) -> (String, String) {
    let (provider, config) = cloud.account(good_credentials);
    let account = t
        .ok(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": provider, "name": "cloud", "config": config }),
        )
        .await;
    let account_id = account["id"].as_str().unwrap().to_string();
    let pool = t
        .ok(
            OPERATOR,
            "pools.create",
            json!({ "name": "cloud", "class": "provider", "providerAccountId": account_id }),
        )
        .await;
    let pool_id = pool["id"].as_str().unwrap().to_string();
    // Provider pools boot registered images only.
    t.ok(
        OPERATOR,
        "images.register",
        json!({ "imageId": "ubuntu-24.04", "url": "https://images.example/ubuntu-24.04.img",
                "sha256": "b".repeat(64), "format": "raw" }),
    )
    .await;
    t.ok(
        OPERATOR,
        "pools.offer",
        json!({ "poolId": pool_id, "tenantId": "acme",
                "quota": { "vcpu": 10, "memoryGiB": 100, "diskGiB": 1000 } }),
    )
    .await;
    t.ok(
        OPERATOR,
        "flavors.create",
        json!({ "poolId": pool_id, "name": "small", "vcpu": 2, "memoryGiB": 4, "diskGiB": 20,
                "offerId": cloud.offer_id() }),
    )
    .await;
    (pool_id, account_id)
}

/// Creates an instance in `pool_id`. Each gets an idempotency key of its own, hence an id of its
/// own: the instance id is the provider's idempotency key, and the `emulator` accounts of every
/// scenario share one cloud.
async fn create(t: &TestServer, pool_id: &str) -> Value {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let key = format!("web-{nanos}");
    t.ok(
        ALICE,
        "instances.create",
        json!({ "tenantId": "acme", "poolId": pool_id, "flavor": "small", "imageId": "ubuntu-24.04",
                "sshKeys": [SSH_KEY], "idempotencyKey": key }),
    )
    .await
}

async fn change(t: &TestServer, method: &str, id: &str) -> Value {
    t.ok(ALICE, method, acme_instance(id)).await
}

/// Waits until the instance is in `state`, failing with the last answer otherwise.
async fn until_state(t: &TestServer, id: &str, state: &str) -> Value {
    let inst = t
        .until(ALICE, "acme", id, PATIENCE, |i| i["state"] == state)
        .await;
    assert_eq!(inst["state"], state, "instance never got {state}: {inst:#}");
    inst
}

fn provider_error(inst: &Value) -> Option<&Value> {
    inst["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == "ProviderError")
}

/// Polls `done` over the cloud's machines until it holds.
async fn until_machines(cloud: &Cloud, done: impl Fn(&[(String, String)]) -> bool) {
    eventually("the cloud's machines", PATIENCE, || async {
        let machines = cloud.machines();
        if done(&machines) {
            Ok(())
        } else {
            Err(machines)
        }
    })
    .await;
}

async fn pool_db(url: &str) -> sqlx::PgPool {
    vps_events::connect(url, &vps_events::DbOptions { max_connections: 2 })
        .await
        .expect("connect")
}

async fn assert_replay_equal(t: &TestServer) {
    assert!(
        t.replay_equal().await,
        "replay differs from the live projections"
    );
}

async fn history(t: &TestServer, id: &str) -> Vec<String> {
    let answer = t.ok(ALICE, "instances.history", acme_instance(id)).await;
    answer["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_string())
        .collect()
}

mod scenarios {
    use super::*;

    pub async fn an_instance_runs_stops_starts_and_is_deleted_with_its_machine(cloud: Cloud) {
        let db = vps_pg::testing::fresh_database().await;
        let t = server_on(&db, 0.2).await;
        let (pool, _) = provider_pool(&t, &cloud, true).await;
        let created = create(&t, &pool).await;
        assert_eq!(created["state"], "scheduling");
        let id = created["id"].as_str().unwrap().to_string();

        let running = t
            .until(ALICE, "acme", &id, PATIENCE, |i| {
                i["state"] == "running" && !i["addresses"].as_array().unwrap().is_empty()
            })
            .await;
        assert_eq!(running["state"], "running", "{running:#}");
        let external_id = running["externalId"].as_str().unwrap().to_string();
        assert_eq!(cloud.machines().len(), 1);
        assert_eq!(cloud.machines()[0].0, external_id);
        assert!(provider_error(&running).is_none());
        let types = history(&t, &id).await;
        assert!(
            types.starts_with(&["instance.created".into(), "instance.provisioning".into()]),
            "{types:?}"
        );

        let stopping = change(&t, "instances.stop", &id).await;
        assert_eq!(stopping["desiredState"], "stopped");
        until_state(&t, &id, "stopped").await;
        until_machines(&cloud, |m| {
            m.len() == 1 && ["off", "stopped"].contains(&m[0].1.as_str())
        })
        .await;

        change(&t, "instances.start", &id).await;
        until_state(&t, &id, "running").await;

        change(&t, "instances.delete", &id).await;
        let deleted = until_state(&t, &id, "deleted").await;
        assert_eq!(deleted["desiredState"], "deleted");
        until_machines(&cloud, |m| m.is_empty()).await;
        let usage = t
            .ok(
                OPERATOR,
                "pools.usage",
                json!({ "poolId": pool, "tenantId": "acme" }),
            )
            .await;
        assert!(
            usage["items"]
                .as_array()
                .unwrap()
                .iter()
                .all(|i| i["used"] == 0),
            "deletion refunds the quota: {usage:#}"
        );
        assert_replay_equal(&t).await;
    }

    pub async fn a_rate_limited_call_is_waited_out_then_the_instance_runs(cloud: Cloud) {
        let db = vps_pg::testing::fresh_database().await;
        let t = server_on(&db, 0.2).await;
        let (pool, _) = provider_pool(&t, &cloud, true).await;
        cloud.rate_limit_next();
        let started = Instant::now();
        let id = create(&t, &pool).await["id"].as_str().unwrap().to_string();

        let waiting = t
            .until(ALICE, "acme", &id, PATIENCE, |i| {
                provider_error(i).is_some()
            })
            .await;
        let condition = provider_error(&waiting).expect("a ProviderError condition while waiting");
        assert_eq!(condition["reason"], "RATE_LIMITED");
        assert_eq!(waiting["state"], "scheduling");

        let running = until_state(&t, &id, "running").await;
        assert!(
            started.elapsed() >= Duration::from_secs(1),
            "the provider's Retry-After of 1 s was honoured"
        );
        assert!(provider_error(&running).is_none(), "{running:#}");
        assert_eq!(cloud.machines().len(), 1);
        assert_replay_equal(&t).await;
    }

    pub async fn a_machine_removed_behind_our_back_makes_the_instance_lost(cloud: Cloud) {
        let db = vps_pg::testing::fresh_database().await;
        let t = server_on(&db, 0.2).await;
        let (pool, _) = provider_pool(&t, &cloud, true).await;
        let id = create(&t, &pool).await["id"].as_str().unwrap().to_string();
        let running = until_state(&t, &id, "running").await;

        cloud.remove(running["externalId"].as_str().unwrap());
        until_state(&t, &id, "lost").await;
        assert!(history(&t, &id).await.contains(&"instance.lost".into()));

        // Deleting a lost instance finds nothing to delete, which completes it.
        change(&t, "instances.delete", &id).await;
        until_state(&t, &id, "deleted").await;
        assert_replay_equal(&t).await;
    }

    pub async fn a_create_whose_answer_was_lost_leaves_exactly_one_machine_across_a_restart(
        cloud: Cloud,
    ) {
        let url = vps_pg::testing::fresh_database().await;
        let first = server_on(&url, 0.2).await;
        let (pool, _) = provider_pool(&first, &cloud, true).await;
        cloud.lose_create_answers(2);
        let id = create(&first, &pool).await["id"]
            .as_str()
            .unwrap()
            .to_string();
        // Kill the server as soon as the machine exists: the create's answer was lost, so the
        // server has heard nothing of it (or, for a client that recovers within the call, only
        // just), perhaps in the middle of its next pass.
        until_machines(&cloud, |m| m.len() == 1).await;
        first.server.shutdown().await;
        let mut conn = pool_db(&url).await.acquire().await.unwrap();
        let seen = vps_projections::instances::load(&mut conn, &id)
            .await
            .unwrap()
            .unwrap();
        assert!(
            !matches!(seen.state, InstanceState::Error | InstanceState::Deleted),
            "{seen:?}"
        );
        // A killed server's lease on the item runs out after a minute; do not wait for it.
        sqlx::query("UPDATE work_items SET lease_until = NULL, due_at = now()")
            .execute(&pool_db(&url).await)
            .await
            .unwrap();

        let second = server_on(&url, 0.2).await;
        let running = until_state(&second, &id, "running").await;
        assert_eq!(cloud.machines().len(), 1, "{:?}", cloud.machines());
        assert_eq!(
            running["externalId"].as_str().unwrap(),
            cloud.machines()[0].0
        );
        assert!(provider_error(&running).is_none());
        assert_replay_equal(&second).await;
    }

    pub async fn an_invalid_token_fails_the_instance_and_is_recorded_on_the_account(cloud: Cloud) {
        let db = vps_pg::testing::fresh_database().await;
        let t = server_on(&db, 0.2).await;
        let (pool, account) = provider_pool(&t, &cloud, false).await;
        let id = create(&t, &pool).await["id"].as_str().unwrap().to_string();

        let failed = until_state(&t, &id, "error").await;
        let condition = provider_error(&failed).expect("a ProviderError condition");
        assert_eq!(condition["reason"], "INVALID_CONFIG");
        let message = condition["message"].as_str().unwrap().to_lowercase();
        assert!(
            message.contains("token") || message.contains("unauthorized"),
            "the message says what is wrong: {message}"
        );
        assert!(cloud.machines().is_empty());
        assert!(history(&t, &id).await.contains(&"instance.failed".into()));

        // Recorded on the account just after the instance's failure commits.
        eventually("the account's lastError", PATIENCE, || async {
            let seen = t
                .ok(
                    OPERATOR,
                    "providerAccounts.get",
                    json!({ "providerAccountId": account }),
                )
                .await;
            if seen["lastError"]["code"] == "INVALID_CONFIG" {
                Ok(())
            } else {
                Err(seen)
            }
        })
        .await;

        // It never got a machine, so it cannot be retried, only deleted.
        change(&t, "instances.delete", &id).await;
        until_state(&t, &id, "deleted").await;
        assert_replay_equal(&t).await;
    }
}

/// Runs each named scenario against one cloud.
macro_rules! against {
    ($cloud:ident, $start:expr; $($scenario:ident),*) => {
        mod $cloud {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $scenario() {
                    crate::provider_pools::scenarios::$scenario($start.await).await;
                }
            )*
        }
    };
}

against!(hetzner_cloud, crate::provider_pools::Cloud::hetzner();
    an_instance_runs_stops_starts_and_is_deleted_with_its_machine,
    a_rate_limited_call_is_waited_out_then_the_instance_runs,
    a_machine_removed_behind_our_back_makes_the_instance_lost,
    a_create_whose_answer_was_lost_leaves_exactly_one_machine_across_a_restart,
    an_invalid_token_fails_the_instance_and_is_recorded_on_the_account);

against!(proxmox_ve, crate::provider_pools::Cloud::proxmox();
    an_instance_runs_stops_starts_and_is_deleted_with_its_machine,
    a_rate_limited_call_is_waited_out_then_the_instance_runs,
    a_machine_removed_behind_our_back_makes_the_instance_lost,
    a_create_whose_answer_was_lost_leaves_exactly_one_machine_across_a_restart,
    an_invalid_token_fails_the_instance_and_is_recorded_on_the_account);

// The in-process emulator has no credentials, so it has no invalid-token scenario.
against!(emulator_account, crate::provider_pools::Cloud::emulator();
    an_instance_runs_stops_starts_and_is_deleted_with_its_machine,
    a_rate_limited_call_is_waited_out_then_the_instance_runs,
    a_machine_removed_behind_our_back_makes_the_instance_lost,
    a_create_whose_answer_was_lost_leaves_exactly_one_machine_across_a_restart);

#[tokio::test]
async fn a_provider_account_keeps_its_secret_out_of_the_log_and_every_answer() {
    let cloud = Cloud::hetzner().await;
    let db = vps_pg::testing::fresh_database().await;
    let t = server_on(&db, 0.2).await;
    let (_, account_id) = provider_pool(&t, &cloud, true).await;
    let secret = cloud.secret().unwrap();

    assert!(account_id.starts_with("pacct_"));
    let got = t
        .ok(
            OPERATOR,
            "providerAccounts.get",
            json!({ "providerAccountId": account_id }),
        )
        .await;
    assert_eq!(got["provider"], "hetzner-cloud");
    assert_eq!(got["config"]["location"], "fsn1");
    assert_eq!(got["secretRef"], format!("secret://{account_id}"));
    assert!(got["lastError"].is_null());
    let listed = t.ok(OPERATOR, "providerAccounts.list", json!({})).await;
    assert_eq!(listed["items"][0]["id"], account_id.as_str());
    for answer in [&got, &listed] {
        assert!(!answer.to_string().contains(&secret), "{answer}");
    }
    let events: Vec<String> =
        sqlx::query_scalar("SELECT data::text FROM events WHERE type LIKE 'provider_account.%'")
            .fetch_all(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!(events.len(), 1);
    assert!(!events[0].contains(&secret), "{}", events[0]);
    assert_replay_equal(&t).await;
}

#[tokio::test]
async fn a_provider_account_config_is_validated_naming_the_field() {
    let db = vps_pg::testing::fresh_database().await;
    let t = server_on(&db, 0.2).await;
    let refused = t
        .err(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": "hetzner-cloud", "name": "h", "config": { "location": "fsn1" } }),
        )
        .await;
    assert_eq!(refused.status, 400);
    assert_eq!(refused.body["code"], "INVALID_INPUT");
    assert_eq!(refused.body["details"]["field"], "config.token");

    let refused = t
        .err(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": "proxmox", "name": "p",
                    "config": { "baseUrl": "ftp://pve/api2/json", "tokenId": "root@pam!vps",
                                "tokenSecret": "s", "node": "pve" } }),
        )
        .await;
    assert_eq!(refused.body["details"]["field"], "config.baseUrl");

    let refused = t
        .err(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": "aws", "name": "a", "config": {} }),
        )
        .await;
    assert_eq!(refused.body["details"]["field"], "provider");

    let refused = t
        .err(
            ALICE,
            "providerAccounts.create",
            json!({ "provider": "emulator", "name": "e", "config": {} }),
        )
        .await;
    assert_eq!(refused.body["code"], "ACCESS_DENIED");

    t.ok(
        OPERATOR,
        "providerAccounts.create",
        json!({ "provider": "emulator", "name": "e", "config": {} }),
    )
    .await;
    let refused = t
        .err(
            OPERATOR,
            "providerAccounts.create",
            json!({ "provider": "emulator", "name": "e", "config": {} }),
        )
        .await;
    assert_eq!(refused.body["details"]["field"], "name");
}
