//! Webhook subscriptions and delivery against a real PostgreSQL (a fresh database per test)
//! and receivers served by axum on 127.0.0.1, which verify every signature the Standard
//! Webhooks way.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::serve::ListenerExt;
use axum::Router;
use data_encoding::BASE64 as STANDARD;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use sqlx::PgPool;
use tokio::task::JoinHandle;
use vps_commands::secrets::SecretKey;
use vps_commands::webhooks::{self as commands, NewWebhook, WebhookSecret};
use vps_commands::{Actor, CommandError, Ctx};
use vps_domain::network::IpCidr;
use vps_domain::webhook::WebhookState;
use vps_domain::DomainError;
use vps_events::read::read_stream;
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier, RecordedEvent};
use vps_projections::webhooks::{
    deliveries as list_deliveries, get as get_webhook, list as list_webhooks, DeliveryStatus,
    Webhook,
};
use vps_reactors::webhooks::{run_webhook_delivery, WebhookConfig, FOLLOWER};

mod support;

use support::{events_after_follower, eventually, eventually_ok, fresh_log, readable, PATIENCE};

// ---------------------------------------------------------------------------------------------
// The receiver

/// How an endpoint answers.
#[derive(Clone, Copy)]
enum Script {
    /// 200.
    Accept,
    /// 500 to the first `n` requests, then 200.
    FailFirst(usize),
    /// 503 with `Retry-After: <secs>` to the first request, then 200.
    RetryAfterOnce(u64),
    /// 410.
    Gone,
    /// Never answers in time.
    Hang,
    /// 500 while the test says the endpoint is down, then 200.
    DownWhileFlagged,
    /// 200, after taking this long to answer.
    Slow(Duration),
    /// 200 with this body, as most real endpoints answer.
    AcceptSaying(&'static str),
    /// 200 with a body that trickles in, a byte every 100 ms, for a minute.
    AcceptTrickling,
}

/// One request as the endpoint saw it.
#[derive(Debug, Clone)]
struct Request {
    event_id: String,
    event: Value,
    signature_valid: bool,
    answered: u16,
    at: Instant,
}

struct Endpoint {
    script: Script,
    secret: Option<WebhookSecret>,
    requests: Vec<Request>,
    down: bool,
}

#[derive(Clone, Default)]
struct Receiver {
    endpoints: Arc<Mutex<HashMap<String, Endpoint>>>,
    base: String,
    /// Connections accepted, by every endpoint together.
    connections: Arc<AtomicUsize>,
}

impl Receiver {
    async fn start() -> Receiver {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let receiver = Receiver {
            base: format!("http://{}", listener.local_addr().unwrap()),
            ..Receiver::default()
        };
        let app = Router::new()
            .route("/hooks/{name}", post(receive))
            .with_state(receiver.clone());
        let connections = receiver.connections.clone();
        let listener = listener.tap_io(move |_| {
            connections.fetch_add(1, Ordering::Relaxed);
        });
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        receiver
    }

    fn connections(&self) -> usize {
        self.connections.load(Ordering::Relaxed)
    }

    /// Registers endpoint `name` and returns its URL.
    fn endpoint(&self, name: &str, script: Script) -> String {
        self.endpoints.lock().unwrap().insert(
            name.into(),
            Endpoint {
                script,
                secret: None,
                requests: Vec::new(),
                down: true,
            },
        );
        format!("{}/hooks/{name}", self.base)
    }

    /// Tells endpoint `name` the secret it verifies signatures with.
    fn set_secret(&self, name: &str, secret: &WebhookSecret) {
        self.endpoints.lock().unwrap().get_mut(name).unwrap().secret = Some(secret.clone());
    }

    fn set_down(&self, name: &str, down: bool) {
        self.endpoints.lock().unwrap().get_mut(name).unwrap().down = down;
    }

    fn requests(&self, name: &str) -> Vec<Request> {
        self.endpoints.lock().unwrap()[name].requests.clone()
    }

    /// Waits until endpoint `name` has answered 2xx to at least `n` events.
    async fn wait_accepted(&self, name: &str, n: usize, within: Duration) {
        let what = format!("{n} events accepted by endpoint {name}");
        eventually(&what, within, || async { self.accepted(name).len() >= n }).await;
    }

    /// The event ids endpoint `name` answered 2xx to, in arrival order.
    fn accepted(&self, name: &str) -> Vec<String> {
        self.requests(name)
            .into_iter()
            .filter(|r| r.answered == 200)
            .map(|r| r.event_id)
            .collect()
    }
}

async fn receive(
    State(receiver): State<Receiver>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let header = |n: &str| {
        headers
            .get(n)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default()
            .to_string()
    };
    let (id, timestamp, signatures) = (
        header("webhook-id"),
        header("webhook-timestamp"),
        header("webhook-signature"),
    );
    let body = String::from_utf8(body.to_vec()).unwrap_or_default();
    let event: Value = serde_json::from_str(&body).unwrap_or(Value::Null);

    let (script, answer) = {
        let mut endpoints = receiver.endpoints.lock().unwrap();
        let endpoint = endpoints.get_mut(&name).expect("a registered endpoint");
        let signature_valid = endpoint
            .secret
            .as_ref()
            .is_some_and(|s| verify(&s.0, &id, &timestamp, &body, &signatures))
            && event["id"] == json!(id);
        let seen = endpoint.requests.len();
        let answer = match endpoint.script {
            Script::Accept
            | Script::Hang
            | Script::Slow(_)
            | Script::AcceptSaying(_)
            | Script::AcceptTrickling => 200,
            Script::FailFirst(n) if seen < n => 500,
            Script::FailFirst(_) => 200,
            Script::RetryAfterOnce(_) if seen == 0 => 503,
            Script::RetryAfterOnce(_) => 200,
            Script::Gone => 410,
            Script::DownWhileFlagged if endpoint.down => 500,
            Script::DownWhileFlagged => 200,
        };
        // A request with a bad signature is refused (and the test fails on it).
        let answer = if signature_valid { answer } else { 400 };
        endpoint.requests.push(Request {
            event_id: id,
            event,
            signature_valid,
            answered: answer,
            at: Instant::now(),
        });
        (endpoint.script, answer)
    };
    match script {
        Script::Hang => {
            // The endpoint's behaviour, not a wait: it never answers within any request timeout.
            tokio::time::sleep(Duration::from_secs(600)).await;
            StatusCode::OK.into_response()
        }
        Script::Slow(took) => {
            // The endpoint's behaviour: it takes this long over every request.
            tokio::time::sleep(took).await;
            StatusCode::from_u16(answer).unwrap().into_response()
        }
        Script::RetryAfterOnce(secs) if answer == 503 => (
            StatusCode::SERVICE_UNAVAILABLE,
            [("retry-after", secs.to_string())],
        )
            .into_response(),
        Script::AcceptSaying(body) if answer == 200 => (StatusCode::OK, body).into_response(),
        Script::AcceptTrickling if answer == 200 => {
            // The endpoint's behaviour: its body never ends within any request timeout.
            let bytes = futures::stream::unfold(0u32, |n| async move {
                tokio::time::sleep(Duration::from_millis(100)).await;
                (n < 600).then(|| (Ok::<_, std::io::Error>(Bytes::from_static(b".")), n + 1))
            });
            (StatusCode::OK, axum::body::Body::from_stream(bytes)).into_response()
        }
        _ => StatusCode::from_u16(answer).unwrap().into_response(),
    }
}

/// The Standard Webhooks verification, written from the specification (not with the code
/// under test): HMAC-SHA256 keyed with the base64-decoded secret after `whsec_`, over
/// `"{id}.{timestamp}.{body}"`, compared with each space-separated `v1,<base64>` signature,
/// and a timestamp within five minutes of now.
fn verify(secret: &str, id: &str, timestamp: &str, body: &str, signatures: &str) -> bool {
    let Some(key) = secret
        .strip_prefix("whsec_")
        .and_then(|k| STANDARD.decode(k.as_ref()).ok())
    else {
        return false;
    };
    let Ok(ts) = timestamp.parse::<i64>() else {
        return false;
    };
    if (vps_clock::Clock::system().now().timestamp() - ts).abs() > 300 {
        return false;
    }
    let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
    mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
    let expected = STANDARD.encode(&mac.finalize().into_bytes());
    signatures
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .any(|s| s == expected)
}

// ---------------------------------------------------------------------------------------------
// The log and the worker

/// The deployment key the commands seal with and the worker opens with.
const KEY: [u8; 32] = [7; 32];

/// `identity` acting on `pool`, as the API would call the webhook commands.
fn ctx(pool: &PgPool, notifier: &Notifier, identity: &str) -> Ctx {
    Ctx {
        pool: pool.clone(),
        notifier: notifier.clone(),
        spec_signals: Default::default(),
        secrets: SecretKey::new(KEY),
        actor: Actor {
            identity: identity.into(),
            tenant: None,
            operator: true,
        },
        request_id: None,
        clock: Default::default(),
        wakeups: Default::default(),
        reports: Default::default(),
    }
}

/// Subscribes as `identity`, an operator.
async fn create_webhook(
    pool: &PgPool,
    notifier: &Notifier,
    identity: &str,
    new: NewWebhook,
) -> Result<(Webhook, WebhookSecret), CommandError> {
    commands::create(&ctx(pool, notifier, identity), new).await
}

/// The receivers listen on loopback, which webhooks may reach only when the operator allows it.
fn loopback() -> Vec<IpCidr> {
    vec!["127.0.0.0/8".parse().unwrap()]
}

fn fast() -> WebhookConfig {
    WebhookConfig {
        allow_private: loopback(),
        request_timeout: Duration::from_secs(2),
        base_delay: Duration::from_millis(20),
        max_delay: Duration::from_secs(2),
        max_attempts: 20,
        poll_interval: Duration::from_millis(50),
        ..WebhookConfig::default()
    }
}

fn start_worker(pool: &PgPool, notifier: &Notifier, config: WebhookConfig) -> JoinHandle<()> {
    tokio::spawn(run_webhook_delivery(
        ctx(pool, notifier, "reactor:webhooks"),
        config,
    ))
}

async fn subscribe(
    pool: &PgPool,
    notifier: &Notifier,
    receiver: &Receiver,
    name: &str,
    script: Script,
    types: &[&str],
    tenant: Option<&str>,
) -> Webhook {
    let url = receiver.endpoint(name, script);
    let (webhook, secret) = create_webhook(
        pool,
        notifier,
        "id_test",
        NewWebhook {
            url,
            types: types.iter().map(|t| t.to_string()).collect(),
            tenant_id: tenant.map(Into::into),
            tenant_scope: None,
            allow_private: loopback(),
        },
    )
    .await
    .expect("create the webhook");
    receiver.set_secret(name, &secret);
    webhook
}

/// A fresh log, a receiver, and one subscription of its endpoint `name`.
struct Setup {
    pool: PgPool,
    notifier: Notifier,
    receiver: Receiver,
    hook: Webhook,
}

async fn one_subscription(
    name: &str,
    script: Script,
    types: &[&str],
    tenant: Option<&str>,
) -> Setup {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let receiver = Receiver::start().await;
    let hook = subscribe(&pool, &notifier, &receiver, name, script, types, tenant).await;
    Setup {
        pool,
        notifier,
        receiver,
        hook,
    }
}

/// Appends one event of `event_type` to `stream` for `tenant`, in its own transaction.
async fn emit(
    pool: &PgPool,
    notifier: &Notifier,
    stream: &str,
    event_type: &str,
    tenant: Option<&str>,
) -> RecordedEvent {
    let event = NewEvent {
        id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
        event_type: event_type.into(),
        data: json!({ "stream": stream }),
        metadata: Metadata {
            tenant_id: tenant.map(Into::into),
            actor: Some("id_test".into()),
            ..Metadata::default()
        },
    };
    let mut conn = pool.acquire().await.unwrap();
    let mut recorded = append(&mut conn, stream, ExpectedVersion::Any, &[event])
        .await
        .unwrap();
    notifier.committed();
    recorded.remove(0)
}

/// Appends one `event_type` event for each `n` of `range`, to the stream `stream(n)`, each in
/// its own transaction.
async fn emit_each(
    pool: &PgPool,
    notifier: &Notifier,
    range: std::ops::Range<usize>,
    event_type: &str,
    stream: impl Fn(usize) -> String,
) {
    for n in range {
        emit(pool, notifier, &stream(n), event_type, None).await;
    }
}

/// The ids of the log's events of these type prefixes, in read order, once `n` are readable.
async fn log_ids(pool: &PgPool, prefixes: &[&str], tenant: Option<&str>, n: usize) -> Vec<String> {
    let wanted = |e: &RecordedEvent| {
        prefixes.iter().any(|p| e.event_type.starts_with(p))
            && (tenant.is_none() || e.metadata.tenant_id.as_deref() == tenant)
    };
    let events = readable(pool, n, wanted).await;
    events.into_iter().map(|e| e.id).collect()
}

/// Waits until the fan-out has handled every event and the outbox is empty: every delivery
/// was made (or given up) and recorded, and nothing more is sent until a new event comes.
async fn deliveries_settled(pool: &PgPool) {
    eventually_ok("deliveries settled", PATIENCE, || async {
        // The fan-out first: a row it enqueues after the outbox was read is then already seen.
        let behind = events_after_follower(pool, FOLLOWER).await;
        let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_outbox")
            .fetch_one(pool)
            .await
            .unwrap();
        match (behind, queued) {
            (0, 0) => Ok(()),
            _ => Err(format!(
                "fan-out {behind} events behind, {queued} rows queued"
            )),
        }
    })
    .await;
}

fn assert_all_signed(receiver: &Receiver, name: &str) {
    for r in receiver.requests(name) {
        assert!(r.signature_valid, "bad signature on {}", r.event_id);
    }
}

// ---------------------------------------------------------------------------------------------
// The tests

#[tokio::test]
async fn failing_deliveries_are_retried_signed_recorded_and_kept_in_order() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("flaky", Script::FailFirst(3), &["instance.*"], None).await;
    let worker = start_worker(&pool, &notifier, fast());

    let expected = emit_mixed_instance_and_sandbox_events(&pool, &notifier).await;
    receiver
        .wait_accepted("flaky", 10, Duration::from_secs(20))
        .await;
    // Deliveries are recorded in runs, right after their POSTs.
    eventually(
        "every attempt recorded",
        Duration::from_secs(20),
        || async { list_deliveries(&pool, &hook.id, 100).await.unwrap().len() >= 13 },
    )
    .await;
    worker.abort();

    assert_flaky_requests_in_order(&receiver, &expected);
    assert_flaky_deliveries_recorded(&pool, &hook.id, &expected).await;
}

/// Fifteen events, ten of them on instance streams; answers the ids of those ten in log order.
async fn emit_mixed_instance_and_sandbox_events(pool: &PgPool, notifier: &Notifier) -> Vec<String> {
    for n in 0..15 {
        let (stream, ty) = match n % 3 {
            0 => (format!("instance-inst_{}", n % 4), "instance.created"),
            1 => (format!("instance-inst_{}", n % 4), "instance.running"),
            _ => (format!("sandbox-sbx_{n}"), "sandbox.ready"),
        };
        emit(pool, notifier, &stream, ty, Some("acme")).await;
    }
    log_ids(pool, &["instance."], None, 10).await
}

/// Every event once, signed, in log order, the first retried until it succeeded before the
/// second was sent at all, and nothing but instance events.
fn assert_flaky_requests_in_order(receiver: &Receiver, expected: &[String]) {
    assert_all_signed(receiver, "flaky");
    assert_eq!(
        receiver.accepted("flaky"),
        expected,
        "each once, in log order"
    );
    let requests = receiver.requests("flaky");
    let first: Vec<u16> = requests.iter().take(4).map(|r| r.answered).collect();
    assert_eq!(first, vec![500, 500, 500, 200]);
    assert!(requests.iter().take(4).all(|r| r.event_id == expected[0]));
    assert!(requests
        .iter()
        .all(|r| r.event["type"].as_str().unwrap().starts_with("instance.")));
}

/// The delivery records: three failed attempts and a success for the first event, then one
/// success each for the rest, in order.
async fn assert_flaky_deliveries_recorded(pool: &PgPool, hook_id: &str, expected: &[String]) {
    let mut deliveries = list_deliveries(pool, hook_id, 100).await.unwrap();
    deliveries.reverse(); // oldest first
    assert_eq!(deliveries.len(), 13);
    let first: Vec<_> = deliveries
        .iter()
        .take(4)
        .map(|d| (d.event_id.as_str(), d.attempt, d.status, d.response_code))
        .collect();
    assert_eq!(
        first,
        vec![
            (expected[0].as_str(), 1, DeliveryStatus::Pending, Some(500)),
            (expected[0].as_str(), 2, DeliveryStatus::Pending, Some(500)),
            (expected[0].as_str(), 3, DeliveryStatus::Pending, Some(500)),
            (
                expected[0].as_str(),
                4,
                DeliveryStatus::Delivered,
                Some(200)
            ),
        ]
    );
    let rest: Vec<&str> = deliveries[4..]
        .iter()
        .map(|d| d.event_id.as_str())
        .collect();
    assert_eq!(
        rest,
        expected[1..].iter().map(String::as_str).collect::<Vec<_>>()
    );
    assert!(deliveries[4..]
        .iter()
        .all(|d| d.attempt == 1 && d.status == DeliveryStatus::Delivered));
}

#[tokio::test]
async fn a_retry_after_answer_delays_the_next_attempt_that_long() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let receiver = Receiver::start().await;
    subscribe(
        &pool,
        &notifier,
        &receiver,
        "busy",
        Script::RetryAfterOnce(1),
        &["*"],
        None,
    )
    .await;
    let worker = start_worker(&pool, &notifier, fast());
    let event = emit(&pool, &notifier, "pool-pool_1", "pool.created", None).await;

    eventually("the event delivered", Duration::from_secs(10), || async {
        receiver.accepted("busy").len() == 1
    })
    .await;
    worker.abort();
    let requests = receiver.requests("busy");
    assert_eq!(requests.len(), 2);
    assert_eq!(requests[1].event_id, event.id);
    let gap = requests[1].at - requests[0].at;
    assert!(gap >= Duration::from_millis(950), "retried after {gap:?}");
}

#[tokio::test]
async fn an_endpoint_answering_410_gone_disables_its_subscription() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("gone", Script::Gone, &["instance.*"], Some("acme")).await;
    let worker = start_worker(&pool, &notifier, fast());
    emit(
        &pool,
        &notifier,
        "instance-inst_1",
        "instance.created",
        Some("acme"),
    )
    .await;

    eventually(
        "the subscription disabled",
        Duration::from_secs(10),
        || async {
            get_webhook(&pool, &hook.id, None)
                .await
                .unwrap()
                .unwrap()
                .state
                == WebhookState::Disabled
        },
    )
    .await;
    let history = read_stream(&pool, &format!("webhook-{}", hook.id))
        .await
        .unwrap();
    let types: Vec<&str> = history.iter().map(|e| e.event_type.as_str()).collect();
    assert_eq!(types, vec!["webhook.created", "webhook.disabled"]);
    assert_eq!(history[1].metadata.tenant_id.as_deref(), Some("acme"));
    assert_eq!(history[1].data["responseCode"], json!(410));

    let deliveries = list_deliveries(&pool, &hook.id, 10).await.unwrap();
    assert_eq!(deliveries.len(), 1);
    assert_eq!(deliveries[0].status, DeliveryStatus::Failed);
    assert_eq!(deliveries[0].response_code, Some(410));

    // Nothing more is sent to it: once the fan-out has passed the new event and nothing is
    // queued, nothing can be.
    emit(
        &pool,
        &notifier,
        "instance-inst_1",
        "instance.running",
        Some("acme"),
    )
    .await;
    deliveries_settled(&pool).await;
    worker.abort();
    assert_eq!(receiver.requests("gone").len(), 1);
    assert_all_signed(&receiver, "gone");
}

/// The fan-out keeps the subscriptions it read between batches and reads them again for a
/// batch holding an event of a subscription's stream: one made after the list was read gets
/// the events after it (none before), and one deleted meanwhile gets nothing more.
#[tokio::test]
async fn the_fan_out_sees_subscriptions_made_and_deleted_after_it_read_them() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook: first,
    } = one_subscription("first", Script::Accept, &["instance.*"], None).await;
    let worker = start_worker(&pool, &notifier, fast());
    let before = emit(
        &pool,
        &notifier,
        "instance-inst_1",
        "instance.created",
        None,
    )
    .await;
    // Delivered: the fan-out has read the subscriptions for that batch.
    receiver
        .wait_accepted("first", 1, Duration::from_secs(20))
        .await;
    subscribe(
        &pool,
        &notifier,
        &receiver,
        "second",
        Script::Accept,
        &["instance.*"],
        None,
    )
    .await;
    commands::delete(&ctx(&pool, &notifier, "id_test"), &first.id, None)
        .await
        .unwrap();
    let after = emit(
        &pool,
        &notifier,
        "instance-inst_1",
        "instance.running",
        None,
    )
    .await;
    receiver
        .wait_accepted("second", 1, Duration::from_secs(20))
        .await;
    deliveries_settled(&pool).await;
    worker.abort();
    assert_eq!(receiver.accepted("second"), vec![after.id]);
    assert_eq!(receiver.accepted("first"), vec![before.id]);
}

#[tokio::test]
async fn a_tenant_scoped_subscription_receives_no_other_tenants_event() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let receiver = Receiver::start().await;
    let types = ["instance.*", "sandbox.*"];
    subscribe(
        &pool,
        &notifier,
        &receiver,
        "acme",
        Script::Accept,
        &types,
        Some("acme"),
    )
    .await;
    subscribe(
        &pool,
        &notifier,
        &receiver,
        "all",
        Script::Accept,
        &types,
        None,
    )
    .await;
    let worker = start_worker(&pool, &notifier, fast());

    for n in 0..18 {
        let tenant = ["acme", "globex", "initech"][n % 3];
        let ty = if n % 2 == 0 {
            "instance.created"
        } else {
            "sandbox.ready"
        };
        let stream = format!("{}-{tenant}_{n}", ty.split('.').next().unwrap());
        emit(&pool, &notifier, &stream, ty, Some(tenant)).await;
    }
    emit(&pool, &notifier, "pool-pool_1", "pool.created", None).await;
    let acme = log_ids(
        &pool,
        &types.map(|t| t.trim_end_matches('*')),
        Some("acme"),
        6,
    )
    .await;
    let everyone = log_ids(&pool, &types.map(|t| t.trim_end_matches('*')), None, 18).await;

    receiver
        .wait_accepted("all", 18, Duration::from_secs(20))
        .await;
    receiver
        .wait_accepted("acme", 6, Duration::from_secs(20))
        .await;
    // Nothing more comes once the queue is empty: the counts below are final.
    deliveries_settled(&pool).await;
    worker.abort();

    assert_eq!(receiver.accepted("acme"), acme);
    assert_eq!(receiver.accepted("all"), everyone);
    assert!(receiver
        .requests("acme")
        .iter()
        .all(|r| r.event["tenantid"] == json!("acme")));
    assert_all_signed(&receiver, "acme");
    assert_all_signed(&receiver, "all");
}

#[tokio::test]
async fn a_dead_endpoint_does_not_delay_another_subscription() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let receiver = Receiver::start().await;
    let hanging = subscribe(
        &pool,
        &notifier,
        &receiver,
        "hang",
        Script::Hang,
        &["*"],
        None,
    )
    .await;
    let refused = subscribe_refusing_endpoint(&pool, &notifier).await;
    subscribe(
        &pool,
        &notifier,
        &receiver,
        "live",
        Script::Accept,
        &["instance.*"],
        None,
    )
    .await;
    let config = WebhookConfig {
        request_timeout: Duration::from_secs(5),
        ..fast()
    };
    let worker = start_worker(&pool, &notifier, config);

    let started = Instant::now();
    emit_each(&pool, &notifier, 0..20, "instance.created", |n| {
        format!("instance-inst_{}", n % 3)
    })
    .await;
    let expected = log_ids(&pool, &["instance."], None, 20).await;
    receiver
        .wait_accepted("live", 20, Duration::from_secs(4))
        .await;
    // All of it while the hanging endpoint still holds its first event.
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(receiver.accepted("live"), expected);
    assert_eq!(receiver.requests("hang").len(), 1);
    assert!(list_deliveries(&pool, &hanging.id, 10)
        .await
        .unwrap()
        .is_empty());
    assert_refusals_recorded_pending(&pool, &refused.id).await;
    worker.abort();
}

/// Subscribes, for every type, an endpoint nobody listens on: every attempt is refused.
async fn subscribe_refusing_endpoint(pool: &PgPool, notifier: &Notifier) -> Webhook {
    let closed_port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (refused, _) = create_webhook(
        pool,
        notifier,
        "id_test",
        NewWebhook {
            url: format!("http://127.0.0.1:{closed_port}/hook"),
            types: vec!["*".into()],
            tenant_id: None,
            tenant_scope: None,
            allow_private: loopback(),
        },
    )
    .await
    .unwrap();
    refused
}

/// Refused attempts are recorded, all for the first event, pending, with an error and no
/// response code.
async fn assert_refusals_recorded_pending(pool: &PgPool, hook_id: &str) {
    let refusals = list_deliveries(pool, hook_id, 100).await.unwrap();
    assert!(!refusals.is_empty());
    assert!(refusals.iter().all(|d| d.event_id == refusals[0].event_id
        && d.status == DeliveryStatus::Pending
        && d.response_code.is_none()
        && d.error.is_some()));
}

#[tokio::test]
async fn undelivered_events_survive_a_restart_of_the_worker() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("down", Script::DownWhileFlagged, &["sandbox.*"], None).await;
    let worker = start_worker(&pool, &notifier, fast());
    emit_each(&pool, &notifier, 0..5, "sandbox.created", |n| {
        format!("sandbox-sbx_{n}")
    })
    .await;
    eventually("a few failed attempts", Duration::from_secs(10), || async {
        list_deliveries(&pool, &hook.id, 10).await.unwrap().len() >= 2
    })
    .await;
    worker.abort();
    let _ = worker.await;

    // Appended while no worker runs.
    emit_each(&pool, &notifier, 5..10, "sandbox.created", |n| {
        format!("sandbox-sbx_{n}")
    })
    .await;
    receiver.set_down("down", false);
    let worker = start_worker(&pool, &notifier, fast());
    let expected = log_ids(&pool, &["sandbox."], None, 10).await;
    receiver
        .wait_accepted("down", 10, Duration::from_secs(20))
        .await;
    // Nothing more comes once the queue is empty: the list below is final.
    deliveries_settled(&pool).await;
    worker.abort();
    assert_eq!(
        receiver.accepted("down"),
        expected,
        "each once, in log order"
    );
    assert!(receiver
        .requests("down")
        .iter()
        .filter(|r| r.answered != 200)
        .all(|r| r.event_id == expected[0]));
    assert_all_signed(&receiver, "down");
}

#[tokio::test]
async fn an_event_is_given_up_after_the_last_attempt_and_the_next_one_follows() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("stubborn", Script::FailFirst(3), &["pool.*"], None).await;
    let config = WebhookConfig {
        max_attempts: 3,
        ..fast()
    };
    let worker = start_worker(&pool, &notifier, config);
    emit(&pool, &notifier, "pool-pool_1", "pool.created", None).await;
    emit(&pool, &notifier, "pool-pool_1", "pool.updated", None).await;
    let expected = log_ids(&pool, &["pool."], None, 2).await;

    eventually(
        "the second event delivered",
        Duration::from_secs(10),
        || async { receiver.accepted("stubborn") == expected[1..] },
    )
    .await;
    eventually(
        "every attempt recorded",
        Duration::from_secs(10),
        || async { list_deliveries(&pool, &hook.id, 10).await.unwrap().len() >= 4 },
    )
    .await;
    worker.abort();
    let mut deliveries = list_deliveries(&pool, &hook.id, 10).await.unwrap();
    deliveries.reverse();
    let seen: Vec<_> = deliveries
        .iter()
        .map(|d| (d.event_id.as_str(), d.attempt, d.status))
        .collect();
    assert_eq!(
        seen,
        vec![
            (expected[0].as_str(), 1, DeliveryStatus::Pending),
            (expected[0].as_str(), 2, DeliveryStatus::Pending),
            (expected[0].as_str(), 3, DeliveryStatus::Failed),
            (expected[1].as_str(), 1, DeliveryStatus::Delivered),
        ]
    );
}

#[tokio::test]
async fn creating_a_webhook_checks_its_input_and_keeps_the_secret_out_of_the_log() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    assert_bad_subscriptions_refused(&pool, &notifier).await;

    let (acme, secret) = create_webhook(
        &pool,
        &notifier,
        "id_alice",
        new_webhook("https://hooks.example.com/a", &["instance.*"], Some("acme")),
    )
    .await
    .unwrap();
    assert!(acme.id.starts_with("whk_") && acme.id.len() == 4 + 26);
    assert!(secret.0.starts_with("whsec_"));
    assert_eq!(
        STANDARD.decode(&secret.0.as_bytes()[6..]).unwrap().len(),
        24
    );
    let (global, _) = create_webhook(
        &pool,
        &notifier,
        "id_alice",
        new_webhook("http://127.0.0.1/g", &["*"], None),
    )
    .await
    .unwrap();

    assert_created_event_without_secret(&pool, &acme.id, &secret).await;
    assert_listed_by_tenant(&pool, &acme.id, &global.id).await;
    assert_only_its_tenant_deletes(&pool, &notifier, &acme.id).await;
    assert_eq!(
        webhook_ids(list_webhooks(&pool, None).await.unwrap()),
        vec![global.id]
    );
}

fn new_webhook(url: &str, types: &[&str], tenant: Option<&str>) -> NewWebhook {
    NewWebhook {
        url: url.into(),
        types: types.iter().map(|t| t.to_string()).collect(),
        tenant_id: tenant.map(Into::into),
        tenant_scope: None,
        allow_private: loopback(),
    }
}

fn webhook_ids(hooks: Vec<Webhook>) -> Vec<String> {
    hooks.into_iter().map(|h| h.id).collect()
}

/// A URL that is not http(s) or has no host, no types, or a malformed type: `INVALID_INPUT`.
async fn assert_bad_subscriptions_refused(pool: &PgPool, notifier: &Notifier) {
    for bad in [
        new_webhook("ftp://example.com/", &["*"], None),
        new_webhook("http://", &["*"], None),
        new_webhook("http://127.0.0.1/x", &[], None),
        new_webhook("http://127.0.0.1/x", &["Instance.*"], None),
    ] {
        let err = create_webhook(pool, notifier, "id_alice", bad)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CommandError::Domain(DomainError::InvalidInput { .. })),
            "{err:?}"
        );
    }
}

/// `webhook.created` records the subscription and its actor, never the secret.
async fn assert_created_event_without_secret(pool: &PgPool, id: &str, secret: &WebhookSecret) {
    let created = read_stream(pool, &format!("webhook-{id}")).await.unwrap();
    assert_eq!(created[0].event_type, "webhook.created");
    assert_eq!(
        created[0].data,
        json!({ "id": id, "url": "https://hooks.example.com/a",
                "types": ["instance.*"], "tenantId": "acme" })
    );
    assert!(!created[0].data.to_string().contains(&secret.0[6..]));
    assert_eq!(created[0].metadata.actor.as_deref(), Some("id_alice"));
}

/// The operator sees both subscriptions, acme only its own, another tenant none.
async fn assert_listed_by_tenant(pool: &PgPool, acme: &str, global: &str) {
    assert_eq!(
        webhook_ids(list_webhooks(pool, None).await.unwrap()),
        vec![acme.to_owned(), global.to_owned()]
    );
    assert_eq!(
        webhook_ids(list_webhooks(pool, Some("acme")).await.unwrap()),
        vec![acme.to_owned()]
    );
    assert!(list_webhooks(pool, Some("globex"))
        .await
        .unwrap()
        .is_empty());
}

/// Another tenant cannot delete it, and cannot tell that it exists; its own tenant can, once.
async fn assert_only_its_tenant_deletes(pool: &PgPool, notifier: &Notifier, id: &str) {
    let bob = ctx(pool, notifier, "id_bob");
    let not_found = |err| matches!(err, CommandError::Domain(DomainError::NotFound { .. }));
    let err = commands::delete(&bob, id, Some("globex"))
        .await
        .unwrap_err();
    assert!(not_found(err));
    commands::delete(&bob, id, Some("acme")).await.unwrap();
    assert!(get_webhook(pool, id, None).await.unwrap().is_none());
    let err = commands::delete(&bob, id, None).await.unwrap_err();
    assert!(not_found(err));
    let history = read_stream(pool, &format!("webhook-{id}")).await.unwrap();
    assert_eq!(history.last().unwrap().event_type, "webhook.deleted");
}

#[tokio::test]
async fn a_long_queue_is_delivered_in_order_in_bursts_without_stalling() {
    let Setup {
        pool,
        notifier,
        receiver,
        ..
    } = one_subscription("busy", Script::Accept, &["instance.*"], None).await;
    // More than one burst, so a burst's end must hand the queue back cleanly.
    emit_each(&pool, &notifier, 0..450, "instance.running", |n| {
        format!("instance-inst_{}", n % 7)
    })
    .await;
    let expected = log_ids(&pool, &["instance."], None, 450).await;
    let worker = start_worker(&pool, &notifier, fast());
    receiver
        .wait_accepted("busy", 450, Duration::from_secs(15))
        .await;
    assert_eq!(
        receiver.accepted("busy"),
        expected,
        "in log order, once each"
    );
    worker.abort();
}

#[tokio::test]
async fn an_endpoint_answering_with_a_body_gets_its_deliveries_over_kept_connections() {
    let Setup {
        pool,
        notifier,
        receiver,
        ..
    } = one_subscription(
        "talkative",
        // Longer than what comes with an answer's head, like an endpoint's HTML page.
        Script::AcceptSaying(Box::leak("ok ".repeat(40_000).into_boxed_str())),
        &["instance.*"],
        None,
    )
    .await;
    emit_each(&pool, &notifier, 0..60, "instance.running", |n| {
        format!("instance-inst_{}", n % 3)
    })
    .await;
    let worker = start_worker(&pool, &notifier, fast());
    receiver.wait_accepted("talkative", 60, PATIENCE).await;
    worker.abort();
    // An answer's body left unread closes its connection: one connection per delivery. Read
    // to the end, the connection goes back to the pool (a few more may open when a POST races
    // its return).
    let connections = receiver.connections();
    assert!(
        connections <= 10,
        "60 deliveries took {connections} connections"
    );
}

#[tokio::test]
async fn an_answer_whose_body_trickles_in_does_not_hold_the_next_delivery_back() {
    let Setup {
        pool,
        notifier,
        receiver,
        ..
    } = one_subscription("trickle", Script::AcceptTrickling, &["instance.*"], None).await;
    emit_each(&pool, &notifier, 0..4, "instance.running", |n| {
        format!("instance-inst_{n}")
    })
    .await;
    let config = fast();
    let timeout = config.request_timeout;
    let worker = start_worker(&pool, &notifier, config);
    receiver.wait_accepted("trickle", 4, PATIENCE).await;
    worker.abort();
    // The status decides the attempt; the rest of the body is waited for only briefly, never
    // for the whole request timeout.
    let requests = receiver.requests("trickle");
    for pair in requests.windows(2) {
        let gap = pair[1].at - pair[0].at;
        assert!(gap < timeout, "the next POST came {gap:?} after the last");
    }
}

/// How many events the slow-receiver test sends (the acceptance asks 100; fewer runs faster).
fn slow_receiver_events() -> usize {
    std::env::var("VPS_SLOW_RECEIVER_EVENTS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(100)
}

#[tokio::test]
async fn a_slow_receiver_gets_every_event_once_in_order_from_two_workers_with_short_leases() {
    let took = Duration::from_millis(1500);
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("slow", Script::Slow(took), &["instance.*"], None).await;
    let n = slow_receiver_events();
    emit_each(&pool, &notifier, 0..n, "instance.running", |i| {
        format!("instance-inst_{}", i % 5)
    })
    .await;
    let expected = log_ids(&pool, &["instance."], None, n).await;
    // A lease covers one request and a second: a run of many slow requests outlasts it
    // many times over, so only renewing (and fencing) it keeps the second worker out.
    let config = WebhookConfig {
        request_timeout: Duration::from_secs(2),
        lease_margin: Duration::from_secs(1),
        ..fast()
    };
    let workers = [
        start_worker(&pool, &notifier, config.clone()),
        start_worker(&pool, &notifier, config),
    ];
    eventually(
        "every event delivered",
        took * n as u32 + Duration::from_secs(30),
        || async {
            receiver.requests("slow").len() >= n && deliveries_recorded(&pool, &hook.id).await >= n
        },
    )
    .await;
    for worker in workers {
        worker.abort();
    }
    let arrived: Vec<String> = receiver
        .requests("slow")
        .into_iter()
        .map(|r| r.event_id)
        .collect();
    assert_eq!(arrived, expected, "each event once, in log order");
    let mut deliveries = list_deliveries(&pool, &hook.id, 1000).await.unwrap();
    deliveries.reverse();
    let recorded: Vec<(String, i32, DeliveryStatus)> = deliveries
        .into_iter()
        .map(|d| (d.event_id, d.attempt, d.status))
        .collect();
    let once: Vec<(String, i32, DeliveryStatus)> = expected
        .iter()
        .map(|id| (id.clone(), 1, DeliveryStatus::Delivered))
        .collect();
    assert_eq!(recorded, once, "one attempt recorded per delivery");
}

async fn deliveries_recorded(pool: &PgPool, hook: &str) -> usize {
    list_deliveries(pool, hook, 1000).await.unwrap().len()
}

#[tokio::test]
async fn a_delivery_never_connects_to_an_internal_address_it_resolves_to() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let receiver = Receiver::start().await;
    // Subscribed while loopback was allowed, under a name: at connect time it is not, as if
    // the name had been re-pointed at the control plane's own network after the check.
    let by_name = receiver
        .endpoint("rebound", Script::Accept)
        .replace("127.0.0.1", "localhost");
    let (hook, secret) = create_webhook(
        &pool,
        &notifier,
        "id_test",
        NewWebhook {
            url: by_name,
            types: vec!["pool.*".into()],
            tenant_id: None,
            tenant_scope: None,
            allow_private: loopback(),
        },
    )
    .await
    .unwrap();
    receiver.set_secret("rebound", &secret);
    let strict = WebhookConfig {
        allow_private: Vec::new(),
        ..fast()
    };
    let worker = start_worker(&pool, &notifier, strict);
    emit(&pool, &notifier, "pool-pool_1", "pool.created", None).await;
    eventually(
        "refused attempts recorded",
        Duration::from_secs(10),
        || async { deliveries_recorded(&pool, &hook.id).await >= 2 },
    )
    .await;
    worker.abort();
    assert!(
        receiver.requests("rebound").is_empty(),
        "nothing reached the receiver"
    );
    let port = receiver.base.rsplit(':').next().unwrap().to_string();
    for attempt in list_deliveries(&pool, &hook.id, 10).await.unwrap() {
        assert_eq!(attempt.status, DeliveryStatus::Pending);
        let error = attempt.error.unwrap_or_default();
        assert!(error.contains("internal network"), "{error}");
        assert!(
            !error.contains(&port) && !error.contains("127.0.0.1"),
            "{error}"
        );
    }
}

#[tokio::test]
async fn a_refused_connection_is_recorded_without_the_transports_text() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let refused = subscribe_refusing_endpoint(&pool, &notifier).await;
    let worker = start_worker(&pool, &notifier, fast());
    emit(&pool, &notifier, "pool-pool_1", "pool.created", None).await;
    eventually(
        "a refused attempt recorded",
        Duration::from_secs(10),
        || async { deliveries_recorded(&pool, &refused.id).await >= 1 },
    )
    .await;
    worker.abort();
    for attempt in list_deliveries(&pool, &refused.id, 10).await.unwrap() {
        assert_eq!(attempt.error.as_deref(), Some("cannot connect"));
    }
}

/// Batches that match no subscription do not each store the fan-out's checkpoint, but once the
/// fan-out has caught up its stored checkpoint is the last event it read, so a restart does
/// not read them all again.
#[tokio::test]
async fn a_caught_up_fan_out_stores_its_checkpoint_past_events_nobody_subscribed_to() {
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let worker = start_worker(&pool, &notifier, fast());
    let mut last = None;
    for n in 0..3 {
        let stream = format!("instance-inst_{n}");
        last = Some(emit(&pool, &notifier, &stream, "instance.created", None).await);
    }
    let last = last.unwrap();
    eventually(
        "the stored checkpoint reaches the last event",
        PATIENCE,
        || async {
            let stored: Option<(String, i64)> = sqlx::query_as(
                "SELECT transaction_id::text, position FROM follower_checkpoints WHERE name = $1",
            )
            .bind(FOLLOWER)
            .fetch_optional(&pool)
            .await
            .unwrap();
            stored == Some((last.transaction_id.to_string(), last.position))
        },
    )
    .await;
    let queued: i64 = sqlx::query_scalar("SELECT count(*) FROM webhook_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(queued, 0);
    worker.abort();
}

/// The token of the lease on subscription `hook`, if one is held.
async fn lease_token(pool: &PgPool, hook: &str) -> Option<String> {
    sqlx::query_scalar("SELECT token FROM webhook_leases WHERE webhook_id = $1")
        .bind(hook)
        .fetch_optional(pool)
        .await
        .unwrap()
}

#[tokio::test]
async fn a_worker_caught_up_keeps_its_lease_for_the_next_event_then_hands_it_back() {
    let Setup {
        pool,
        notifier,
        receiver,
        hook,
    } = one_subscription("steady", Script::Accept, &["instance.*"], None).await;
    // A linger long enough that a slow machine delivers the second event within it.
    let config = WebhookConfig {
        linger: Duration::from_secs(5),
        ..fast()
    };
    let worker = start_worker(&pool, &notifier, config);
    let mut tokens = Vec::new();
    for (n, event_type) in ["instance.created", "instance.started"].iter().enumerate() {
        emit(&pool, &notifier, "instance-inst_1", event_type, None).await;
        eventually("the event delivered", PATIENCE, || async {
            receiver.accepted("steady").len() == n + 1
        })
        .await;
        tokens.push(lease_token(&pool, &hook.id).await);
    }
    // Caught up, the worker kept its lease, and the next event went out under it: no new claim.
    assert!(tokens[0].is_some(), "the caught-up worker keeps its lease");
    assert_eq!(tokens[1], tokens[0]);

    // Idle for longer than the linger, the worker hands the subscription back.
    eventually("the lease released", PATIENCE, || async {
        lease_token(&pool, &hook.id).await.is_none()
    })
    .await;
    worker.abort();
}
