//! The NATS publisher against a real PostgreSQL (a fresh database per test) and a real
//! `nats-server -js` that each test starts on a free 127.0.0.1 port with its own store.

use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, consumer::AckPolicy, consumer::DeliverPolicy};
use futures::StreamExt;
use rand::Rng;
use serde_json::{json, Value};
use sqlx::PgPool;
use tokio::task::JoinHandle;
use vps_events::{append, ExpectedVersion, Metadata, NewEvent, Notifier};
use vps_reactors::nats::{run_publisher, NatsPublisherConfig, FOLLOWER};

mod support;

use support::{
    events_after_follower, eventually, eventually_ok, fresh_log, readable, PATIENCE, POLL,
};

const NATS_SERVER: &str = "/usr/sbin/nats-server";
const STREAM: &str = "VPS_EVENTS";

/// A `nats-server -js` child on a fixed port and store directory, so it can be stopped and
/// started again as the same server.
struct NatsServer {
    child: Option<Child>,
    port: u16,
    store: PathBuf,
}

impl NatsServer {
    fn start() -> NatsServer {
        // A failing test shows the publisher's warnings (a passing one hides its output).
        let _ = tracing_subscriber::fmt()
            .with_test_writer()
            .with_env_filter("vps_reactors=info")
            .try_init();
        let binary = std::env::var("VPS_NATS_SERVER").unwrap_or_else(|_| NATS_SERVER.into());
        assert!(
            std::path::Path::new(&binary).exists(),
            "these tests need a nats-server binary at {binary} (Debian: apt-get install \
             nats-server), or its path in VPS_NATS_SERVER"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let store = std::env::temp_dir().join(format!(
            "vps-nats-{}",
            ulid::Ulid::generate().to_string().to_lowercase()
        ));
        let mut server = NatsServer {
            child: None,
            port,
            store,
        };
        server.resume();
        server
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Starts the server (again) on the same port and store.
    fn resume(&mut self) {
        let binary = std::env::var("VPS_NATS_SERVER").unwrap_or_else(|_| NATS_SERVER.into());
        let child = Command::new(binary)
            .args([
                "-js",
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-sd",
            ])
            .arg(&self.store)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nats-server");
        self.child = Some(child);
        // Synchronous (no runtime here): poll the port until it answers, within the deadline.
        let deadline = Instant::now() + PATIENCE;
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(Instant::now() < deadline, "nats-server did not start");
            std::thread::sleep(POLL);
        }
    }

    /// Stops the server the way an operator would (SIGTERM), and waits for it to exit.
    fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
            // Synchronous: poll for the exit, killing the server if it outlives the deadline.
            let deadline = Instant::now() + Duration::from_secs(10);
            while child.try_wait().ok().flatten().is_none() {
                if Instant::now() > deadline {
                    let _ = child.kill();
                }
                std::thread::sleep(POLL);
            }
            let _ = child.wait();
        }
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&self.store);
    }
}

fn config(server: &NatsServer) -> NatsPublisherConfig {
    NatsPublisherConfig {
        url: server.url(),
        max_backoff: Duration::from_millis(300),
        ..NatsPublisherConfig::default()
    }
}

fn start_publisher(
    pool: &PgPool,
    notifier: &Notifier,
    config: &NatsPublisherConfig,
) -> JoinHandle<()> {
    tokio::spawn(run_publisher(
        pool.clone(),
        notifier.clone(),
        config.clone(),
    ))
}

/// Appends `per_writer` single-event transactions from each of `writers` concurrent writers,
/// over many streams of `instance`, `sandbox` and `pool` types. Transactions sleep a random
/// moment before committing, so they commit out of position order.
async fn mixed_workload(pool: &PgPool, notifier: &Notifier, writers: usize, per_writer: usize) {
    let mut tasks = Vec::new();
    for w in 0..writers {
        let pool = pool.clone();
        let notifier = notifier.clone();
        tasks.push(tokio::spawn(async move {
            for n in 0..per_writer {
                let (kind, ty) = match (w + n) % 5 {
                    0 => ("instance", "instance.created"),
                    1 => ("instance", "instance.running"),
                    2 => ("sandbox", "sandbox.ready"),
                    3 => ("sandbox", "sandbox.snapshot.ready"),
                    _ => ("pool", "pool.created"),
                };
                let stream = format!("{kind}-{kind}_{w}_{}", n % 7);
                let event = NewEvent {
                    id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
                    event_type: ty.into(),
                    data: json!({ "writer": w, "n": n }),
                    metadata: Metadata {
                        tenant_id: Some("acme".into()),
                        ..Metadata::default()
                    },
                };
                let mut tx = pool.begin().await.unwrap();
                append(&mut tx, &stream, ExpectedVersion::Any, &[event])
                    .await
                    .unwrap();
                let pause = rand::thread_rng().gen_range(0..3);
                // Part of the workload, not a wait: commits land out of position order.
                tokio::time::sleep(Duration::from_millis(pause)).await;
                tx.commit().await.unwrap();
                notifier.committed();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Every event of the log in the agreed read order, once all `n` are readable.
async fn log_order(pool: &PgPool, n: usize) -> Vec<vps_events::RecordedEvent> {
    readable(pool, n, |_| true).await
}

/// A message as a consumer received it.
#[derive(Debug)]
struct Received {
    subject: String,
    msg_id: String,
    event: Value,
}

/// Reads the stream from the start with a new consumer (filtered to `filter` if not empty)
/// until `n` messages arrived, then checks that nothing more comes.
async fn consume(url: &str, filter: &str, n: usize) -> Vec<Received> {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    let js = jetstream::new(client);
    // The publisher creates the stream when it first publishes.
    let stream = eventually_ok("the stream", PATIENCE, || js.get_stream(STREAM)).await;
    let consumer = stream
        .create_consumer(pull::Config {
            filter_subject: filter.into(),
            deliver_policy: DeliverPolicy::All,
            ack_policy: AckPolicy::None,
            ..Default::default()
        })
        .await
        .expect("create a consumer");
    let mut received = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let wanted = (n + 1).saturating_sub(received.len()).max(1);
        let expires = if received.len() >= n {
            Duration::from_millis(500)
        } else {
            Duration::from_secs(1)
        };
        let mut batch = consumer
            .fetch()
            .max_messages(wanted)
            .expires(expires)
            .messages()
            .await
            .expect("fetch");
        let before = received.len();
        while let Some(message) = batch.next().await {
            let message = message.expect("a message");
            let msg_id = message
                .headers
                .as_ref()
                .and_then(|h| h.get("Nats-Msg-Id"))
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            received.push(Received {
                subject: message.subject.to_string(),
                msg_id,
                event: serde_json::from_slice(&message.payload).expect("CloudEvent JSON"),
            });
        }
        if received.len() >= n && received.len() == before {
            return received;
        }
        if Instant::now() >= deadline {
            let stored = js
                .get_stream(STREAM)
                .await
                .map(|s| s.cached_info().state.messages);
            panic!(
                "only {} of {n} messages arrived on {filter:?}; the stream holds {stored:?}",
                received.len()
            );
        }
    }
}

/// Waits until the stream holds at least `n` messages.
async fn stream_reaches(url: &str, n: u64, within: Duration) {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    let js = jetstream::new(client);
    let what = format!("the stream holding {n} messages");
    eventually(&what, within, || async {
        match js.get_stream(STREAM).await {
            Ok(mut stream) => stream
                .info()
                .await
                .is_ok_and(|info| info.state.messages >= n),
            Err(_) => false,
        }
    })
    .await;
}

/// Waits until the publisher's checkpoint is at the head of the log: everything appended so
/// far was acknowledged by JetStream.
async fn publisher_caught_up(pool: &PgPool) {
    eventually("the publisher at the head of the log", PATIENCE, || async {
        events_after_follower(pool, FOLLOWER).await == 0
    })
    .await;
}

/// Keeps NATS down for `outage` (the scenario's outage, not a wait for a condition), checking
/// all along that the publisher acknowledges nothing: its checkpoint stays `unpublished`
/// events short of the head.
async fn hold_outage(pool: &PgPool, outage: Duration, unpublished: i64) {
    let end = Instant::now() + outage;
    while Instant::now() < end {
        let behind = events_after_follower(pool, FOLLOWER).await;
        assert_eq!(
            behind, unpublished,
            "the checkpoint moved while NATS was down"
        );
        tokio::time::sleep(POLL).await;
    }
}

async fn stream_messages(url: &str) -> u64 {
    let client = async_nats::connect(url).await.expect("connect to NATS");
    let mut stream = jetstream::new(client).get_stream(STREAM).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// Asserts that `received` is exactly `expected`, in order, each on its type's subject with
/// its id as `Nats-Msg-Id`.
fn assert_exactly_once_in_order(received: &[Received], expected: &[vps_events::RecordedEvent]) {
    let got: Vec<&str> = received
        .iter()
        .map(|r| r.event["id"].as_str().unwrap())
        .collect();
    let want: Vec<&str> = expected.iter().map(|e| e.id.as_str()).collect();
    assert_eq!(got.len(), want.len(), "message count");
    assert_eq!(got, want, "messages in log order, each once");
    for (r, e) in received.iter().zip(expected) {
        assert_eq!(r.subject, e.event_type);
        assert_eq!(r.msg_id, e.id);
        assert_eq!(r.event["type"], json!(e.event_type));
        assert_eq!(r.event["specversion"], json!("1.0"));
        assert_eq!(r.event["sequence"], json!(e.cursor().to_string()));
        assert_eq!(r.event["tenantid"], json!("acme"));
    }
}

#[tokio::test]
async fn a_jetstream_consumer_receives_every_event_of_a_mixed_workload_once_in_log_order() {
    let server = NatsServer::start();
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let publisher = start_publisher(&pool, &notifier, &config(&server));

    mixed_workload(&pool, &notifier, 8, 40).await;
    let expected = log_order(&pool, 320).await;

    let received = consume(&server.url(), "", expected.len()).await;
    assert_exactly_once_in_order(&received, &expected);

    // A subscriber to `instance.>` gets every instance event, in the same order.
    let instance_events: Vec<_> = expected
        .iter()
        .filter(|e| e.event_type.starts_with("instance."))
        .cloned()
        .collect();
    let received = consume(&server.url(), "instance.>", instance_events.len()).await;
    assert_exactly_once_in_order(&received, &instance_events);
    publisher.abort();
}

#[tokio::test]
async fn a_publisher_aborted_mid_stream_and_restarted_loses_and_repeats_nothing() {
    let server = NatsServer::start();
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let config = config(&server);
    let workload = {
        let (pool, notifier) = (pool.clone(), notifier.clone());
        tokio::spawn(async move { mixed_workload(&pool, &notifier, 6, 100).await })
    };

    let mut publisher = start_publisher(&pool, &notifier, &config);
    for round in 1..=3u64 {
        stream_reaches(&server.url(), round * 60, Duration::from_secs(30)).await;
        publisher.abort();
        let _ = publisher.await;
        publisher = start_publisher(&pool, &notifier, &config);
    }
    workload.await.unwrap();
    let expected = log_order(&pool, 600).await;
    let received = consume(&server.url(), "", expected.len()).await;
    assert_exactly_once_in_order(&received, &expected);
    publisher.abort();
}

#[tokio::test]
async fn events_appended_while_nats_is_down_are_published_in_order_when_it_is_back() {
    let mut server = NatsServer::start();
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let publisher = start_publisher(&pool, &notifier, &config(&server));

    mixed_workload(&pool, &notifier, 4, 25).await;
    stream_reaches(&server.url(), 100, Duration::from_secs(30)).await;
    publisher_caught_up(&pool).await;

    server.stop();
    mixed_workload(&pool, &notifier, 4, 25).await;
    // Quiescent: all 100 new events are readable, so the publisher is trying them.
    log_order(&pool, 200).await;
    hold_outage(&pool, Duration::from_secs(2), 100).await;
    server.resume();
    mixed_workload(&pool, &notifier, 4, 25).await;

    let expected = log_order(&pool, 300).await;
    stream_reaches(&server.url(), 300, Duration::from_secs(60)).await;
    let received = consume(&server.url(), "", expected.len()).await;
    assert_exactly_once_in_order(&received, &expected);
    assert_eq!(stream_messages(&server.url()).await, 300);
    publisher.abort();
}

#[tokio::test]
async fn a_subject_prefix_puts_every_event_under_it() {
    let server = NatsServer::start();
    let pool = fresh_log().await;
    let notifier = Notifier::local_only();
    let config = NatsPublisherConfig {
        subject_prefix: "vps".into(),
        ..config(&server)
    };
    let publisher = start_publisher(&pool, &notifier, &config);

    mixed_workload(&pool, &notifier, 2, 10).await;
    let expected = log_order(&pool, 20).await;
    let pools: Vec<_> = expected
        .iter()
        .filter(|e| e.event_type.starts_with("pool."))
        .collect();
    // The publisher first, so a slow publisher and a consumer that misses messages fail apart.
    publisher_caught_up(&pool).await;
    let received = consume(&server.url(), "vps.pool.>", pools.len()).await;
    assert_eq!(received.len(), pools.len());
    for (r, e) in received.iter().zip(pools) {
        assert_eq!(r.subject, format!("vps.{}", e.event_type));
        assert_eq!(r.msg_id, e.id);
    }
    publisher.abort();
}
