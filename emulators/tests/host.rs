//! The emulated host against a stub of the three node calls: what it reports as the spec changes
//! and as tests turn its knobs. (The stub stands in for the server only to test the emulator.)

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::routing::post;
use axum::{Json, Router};
use serde_json::{json, Value};
use tokio::task::JoinHandle;
use vps_emulators::host::{DomainState, EmulatedHost, HostConfig, HostHandle};

mod support;

use support::poll_until;

const TOKEN: &str = "node-token";
const NODE: &str = "node_test";
const BOOT_DELAY: Duration = Duration::from_millis(300);
const REPORT_INTERVAL: Duration = Duration::from_millis(200);

/// What the stub serves and what it received.
#[derive(Default)]
struct Served {
    generation: u64,
    instances: BTreeMap<String, Value>,
    secrets: HashMap<String, String>,
    reports: Vec<Value>,
    secret_requests: usize,
    /// The next calls answered `500`.
    failures: usize,
}

/// A stub of `nodes.spec`, `nodes.report` and `nodes.secret` on 127.0.0.1.
struct Stub {
    served: Arc<Mutex<Served>>,
    base_url: String,
    task: JoinHandle<()>,
}

impl Stub {
    async fn start() -> Self {
        let served = Arc::new(Mutex::new(Served::default()));
        let router = Router::new()
            .route("/api/compute/nodes/{method}", post(node_call))
            .with_state(served.clone());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base_url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            axum::serve(listener, router).await.unwrap();
        });
        Self {
            served,
            base_url,
            task,
        }
    }

    fn host(&self) -> HostHandle {
        EmulatedHost::start(HostConfig {
            base_url: self.base_url.clone(),
            node_id: NODE.to_owned(),
            token: TOKEN.to_owned(),
            boot_delay: BOOT_DELAY,
            report_interval: REPORT_INTERVAL,
            poll_wait: Duration::from_millis(500),
            tunnel_listen: None,
        })
    }

    fn served(&self) -> MutexGuard<'_, Served> {
        self.served.lock().unwrap()
    }

    /// Places `id` on the node with `desired_state` and its user data, as the server would.
    fn place(&self, id: &str, desired_state: &str, runtime: &str) {
        let mut served = self.served();
        let n = served.instances.len() + 2;
        served.instances.insert(
            id.to_owned(),
            json!({
                "id": id,
                "desiredState": desired_state,
                "runtime": runtime,
                "shape": { "vcpu": 1, "memoryGiB": 1, "diskGiB": 10 },
                "image": { "url": "https://images.test/u.qcow2", "sha256": "00", "format": "qcow2" },
                "userDataRef": format!("secret://{id}"),
                "allocationId": format!("alloc_{id}"),
                "gpus": [],
                "nics": [{ "bridge": "br0", "mac": "02:00:00:00:00:01", "address": format!("10.0.0.{n}/24") }],
                "somethingNew": true,
            }),
        );
        served
            .secrets
            .insert(format!("secret://{id}"), format!("#cloud-config for {id}"));
        served.generation += 1;
    }

    fn set_desired(&self, id: &str, desired_state: &str) {
        let mut served = self.served();
        served.instances.get_mut(id).unwrap()["desiredState"] = json!(desired_state);
        served.generation += 1;
    }

    fn unplace(&self, id: &str) {
        let mut served = self.served();
        served.instances.remove(id);
        served.generation += 1;
    }

    fn report_count(&self) -> usize {
        self.served().reports.len()
    }

    /// `(state, message)` of `id` in the last report, if listed.
    fn reported(&self, id: &str) -> Option<(String, Option<String>)> {
        let served = self.served();
        let entry = served.reports.last()?["instances"]
            .as_array()?
            .iter()
            .find(|entry| entry["id"] == id)?
            .clone();
        Some((
            entry["state"].as_str()?.to_owned(),
            entry["message"].as_str().map(str::to_owned),
        ))
    }

    fn reported_state(&self, id: &str) -> Option<String> {
        self.reported(id).map(|(state, _)| state)
    }

    /// The spec generation the last report says the host converged to.
    fn reported_generation(&self) -> Option<u64> {
        self.served().reports.last()?["appliedGeneration"].as_u64()
    }

    /// Waits for `condition`, failing with the last report when it never holds.
    async fn eventually(&self, what: &str, condition: impl Fn(&Stub) -> bool) {
        poll_until(what, || async {
            if condition(self) {
                Ok(())
            } else {
                Err(self.served().reports.last().cloned())
            }
        })
        .await
    }

    /// Waits until every report the stub received was acknowledged to the host: none is
    /// half-delivered, so the two counts agree and are final until the host reports again.
    async fn reports_settled(&self, host: &HostHandle) {
        self.eventually("the host heard every answer", |stub| {
            stub.report_count() as u64 == host.reports_sent()
        })
        .await;
    }
}

impl Drop for Stub {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn node_call(
    State(served): State<Arc<Mutex<Served>>>,
    Path(method): Path<String>,
    headers: HeaderMap,
    Json(body): Json<Value>,
) -> (StatusCode, Json<Value>) {
    let authorized = headers
        .get("authorization")
        .is_some_and(|value| value == format!("Bearer {TOKEN}").as_str());
    if !authorized || body["nodeId"] != NODE {
        return error(StatusCode::UNAUTHORIZED, "UNAUTHENTICATED");
    }
    {
        let mut served = served.lock().unwrap();
        if served.failures > 0 {
            served.failures -= 1;
            return error(StatusCode::INTERNAL_SERVER_ERROR, "INTERNAL");
        }
    }
    match method.as_str() {
        "spec" => spec(&served, &body).await,
        "report" => report(&served, body),
        "secret" => secret(&served, &body),
        _ => error(StatusCode::NOT_FOUND, "NOT_FOUND"),
    }
}

/// Holds the answer until the generation passes `afterGeneration` or `waitMs` runs out.
async fn spec(served: &Mutex<Served>, body: &Value) -> (StatusCode, Json<Value>) {
    let after = body["afterGeneration"].as_u64();
    let wait = Duration::from_millis(body["waitMs"].as_u64().unwrap_or(0));
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        {
            let served = served.lock().unwrap();
            let newer = after.is_none_or(|after| served.generation > after);
            if newer || tokio::time::Instant::now() >= deadline {
                let instances: Vec<Value> = served.instances.values().cloned().collect();
                let answer = json!({ "nodeId": NODE, "generation": served.generation, "instances": instances });
                return (StatusCode::OK, Json(answer));
            }
        }
        // The stub's side of the long poll (not a test's wait): look again until `waitMs`.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

fn report(served: &Mutex<Served>, body: Value) -> (StatusCode, Json<Value>) {
    let mut served = served.lock().unwrap();
    let ids: Vec<String> = body["instances"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|entry| entry["id"].as_str().map(str::to_owned))
        .collect();
    let mut orphans: Vec<&String> = ids
        .iter()
        .filter(|id| !served.instances.contains_key(*id))
        .collect();
    orphans.sort();
    let answer = json!({ "updated": ids.len() - orphans.len(), "orphans": orphans });
    served.reports.push(body);
    (StatusCode::OK, Json(answer))
}

fn secret(served: &Mutex<Served>, body: &Value) -> (StatusCode, Json<Value>) {
    let mut served = served.lock().unwrap();
    served.secret_requests += 1;
    match body["ref"]
        .as_str()
        .and_then(|reference| served.secrets.get(reference))
    {
        Some(value) => (StatusCode::OK, Json(json!({ "value": value }))),
        None => error(StatusCode::NOT_FOUND, "NOT_FOUND"),
    }
}

fn error(status: StatusCode, code: &str) -> (StatusCode, Json<Value>) {
    let body = json!({ "code": code, "message": format!("stub says {code}"), "details": {} });
    (status, Json(body))
}

#[tokio::test]
async fn a_running_instance_is_reported_booting_then_running_after_the_boot_delay() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();

    stub.eventually("inst_a is running", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("RUNNING")
    })
    .await;

    let served = stub.served();
    let states: Vec<&str> = served
        .reports
        .iter()
        .filter_map(|report| report["instances"][0]["state"].as_str())
        .collect();
    assert_eq!(
        states.first(),
        Some(&"UNSPECIFIED"),
        "it boots first: {states:?}"
    );
    let last = served.reports.last().unwrap();
    assert_eq!(last["complete"], true);
    assert_eq!(last["appliedGeneration"], served.generation);
    assert_eq!(last["instances"][0]["addresses"], json!(["10.0.0.2"]));
    assert_eq!(served.secret_requests, 1);
    drop(served);
    let domain = host.domain("inst_a").unwrap();
    assert_eq!(
        domain.user_data.as_deref(),
        Some("#cloud-config for inst_a")
    );
    assert_eq!(host.applied_generation(), Some(1));
}

#[tokio::test]
async fn an_instance_wanted_stopped_is_reported_stopped() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    stub.eventually("inst_a is running", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("RUNNING")
    })
    .await;

    stub.set_desired("inst_a", "stopped");

    stub.eventually("inst_a is stopped", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("STOPPED")
    })
    .await;
    assert_eq!(host.domains()["inst_a"], DomainState::Stopped);
}

#[tokio::test]
async fn a_deleted_instance_disappears_from_the_reports() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    stub.eventually("inst_a is reported", |stub| {
        stub.reported_state("inst_a").is_some()
    })
    .await;

    stub.set_desired("inst_a", "deleted");

    stub.eventually("inst_a is gone", |stub| {
        stub.reported_state("inst_a").is_none()
    })
    .await;
    assert!(host.domains().is_empty());
}

#[tokio::test]
async fn an_instance_no_longer_in_the_spec_is_destroyed() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    stub.eventually("inst_a is reported", |stub| {
        stub.reported_state("inst_a").is_some()
    })
    .await;

    stub.unplace("inst_a");

    stub.eventually("inst_a is gone", |stub| {
        stub.reported_state("inst_a").is_none()
    })
    .await;
    assert!(host.domains().is_empty());
}

#[tokio::test]
async fn a_failed_instance_is_reported_in_error_with_its_message_until_it_is_deleted() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    stub.eventually("inst_a is running", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("RUNNING")
    })
    .await;

    host.fail_instance("inst_a", "qemu crashed");
    stub.eventually("inst_a is in error", |stub| {
        stub.reported("inst_a") == Some(("ERROR".to_owned(), Some("qemu crashed".to_owned())))
    })
    .await;

    // A new spec that still wants it running does not heal it: once the host has converged to
    // that spec and reported so, a heal would already show (a boot starts in that pass).
    stub.set_desired("inst_a", "running");
    let generation = stub.served().generation;
    stub.eventually("the host converged to the new spec", |stub| {
        stub.reported_generation() == Some(generation)
    })
    .await;
    assert_eq!(host.domains()["inst_a"], DomainState::Error);

    stub.set_desired("inst_a", "deleted");
    stub.eventually("inst_a is gone", |stub| {
        stub.reported_state("inst_a").is_none()
    })
    .await;
}

#[tokio::test]
async fn a_refused_new_instance_is_reported_stopped_with_resources_exhausted_then_boots_once_allowed(
) {
    let stub = Stub::start().await;
    let host = stub.host();
    host.refuse_new(Some("no hugepages left".to_owned()));
    stub.place("inst_a", "running", "libvirt-kvm");

    stub.eventually("inst_a is refused", |stub| {
        stub.reported("inst_a")
            == Some((
                "STOPPED".to_owned(),
                Some("ResourcesExhausted: no hugepages left".to_owned()),
            ))
    })
    .await;
    assert_eq!(stub.served().secret_requests, 0);

    host.refuse_new(None);

    stub.eventually("inst_a is running", |stub| {
        stub.reported("inst_a") == Some(("RUNNING".to_owned(), None))
    })
    .await;
}

#[tokio::test]
async fn a_silent_host_sends_no_reports_until_it_speaks_again() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    stub.eventually("inst_a is running", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("RUNNING")
    })
    .await;

    // Go silent just after a report was answered, so the next is an interval away and none is
    // on its way; then let any report already sent be answered.
    let sent = host.reports_sent();
    stub.eventually("a report answered", |_| host.reports_sent() > sent)
        .await;
    host.set_reporting(false);
    stub.reports_settled(&host).await;
    let before = stub.report_count();
    let sent = host.reports_sent();
    // Not a wait for a condition: the negative under test, no report for five intervals.
    tokio::time::sleep(REPORT_INTERVAL * 5).await;
    assert_eq!(stub.report_count(), before);
    assert_eq!(host.reports_sent(), sent);

    host.set_reporting(true);
    stub.eventually("the host reports again", |stub| {
        stub.report_count() > before
    })
    .await;
}

#[tokio::test]
async fn a_stray_domain_is_reported_as_an_orphan_and_stays_until_removed() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    let host = stub.host();
    host.add_stray_domain("inst_leak");

    stub.eventually("the stray is reported", |stub| {
        stub.reported_state("inst_leak").as_deref() == Some("RUNNING")
    })
    .await;
    stub.eventually("the host heard it is an orphan", |_| {
        host.last_orphans() == vec!["inst_leak".to_owned()]
    })
    .await;

    stub.unplace("inst_a");
    stub.eventually("inst_a is gone", |stub| {
        stub.reported_state("inst_a").is_none()
    })
    .await;
    assert_eq!(stub.reported_state("inst_leak").as_deref(), Some("RUNNING"));

    host.remove_domain("inst_leak");
    stub.eventually("the stray is gone", |stub| {
        stub.reported_state("inst_leak").is_none()
    })
    .await;
}

#[tokio::test]
async fn a_paused_instance_is_paused_except_on_containerd() {
    let stub = Stub::start().await;
    stub.place("inst_vm", "paused", "libvirt-kvm");
    stub.place("inst_ctr", "paused", "containerd");
    let _host = stub.host();

    stub.eventually("the vm is paused", |stub| {
        stub.reported_state("inst_vm").as_deref() == Some("PAUSED")
    })
    .await;
    assert_eq!(
        stub.reported("inst_ctr"),
        Some(("ERROR".to_owned(), Some("pause unsupported".to_owned())))
    );

    stub.set_desired("inst_vm", "running");
    stub.eventually("the vm resumes", |stub| {
        stub.reported_state("inst_vm").as_deref() == Some("RUNNING")
    })
    .await;
}

#[tokio::test]
async fn user_data_the_server_refuses_is_reported_as_an_error() {
    let stub = Stub::start().await;
    stub.place("inst_a", "running", "libvirt-kvm");
    stub.served().secrets.clear();
    let host = stub.host();

    stub.eventually("inst_a is in error", |stub| {
        stub.reported("inst_a").is_some_and(|(state, message)| {
            state == "ERROR" && message.is_some_and(|message| message.contains("NOT_FOUND"))
        })
    })
    .await;
    assert_eq!(host.domains()["inst_a"], DomainState::Error);
}

#[tokio::test]
async fn the_host_keeps_going_through_server_errors() {
    let stub = Stub::start().await;
    stub.served().failures = 3;
    stub.place("inst_a", "running", "libvirt-kvm");
    let _host = stub.host();

    stub.eventually("inst_a is running", |stub| {
        stub.reported_state("inst_a").as_deref() == Some("RUNNING")
    })
    .await;
}

#[tokio::test]
async fn an_unchanged_host_still_reports_every_interval() {
    let stub = Stub::start().await;
    let host = stub.host();
    stub.eventually("a first report", |stub| stub.report_count() >= 1)
        .await;

    // Not a wait for a condition: the window the report rate is measured over.
    tokio::time::sleep(REPORT_INTERVAL * 5).await;
    stub.reports_settled(&host).await;

    let count = stub.report_count();
    assert!(
        (2..=10).contains(&count),
        "{count} reports in about a second"
    );
    assert_eq!(host.reports_sent(), count as u64);
}

#[tokio::test]
async fn a_stopped_host_sends_nothing_more() {
    let stub = Stub::start().await;
    let host = stub.host();
    stub.eventually("a first report", |stub| stub.report_count() >= 1)
        .await;

    host.stop().await;
    let count = stub.report_count();
    // Not a wait for a condition: the negative under test, nothing for three intervals after
    // `stop` returned (it waits for the loop to end, so nothing is on its way).
    tokio::time::sleep(REPORT_INTERVAL * 3).await;

    assert_eq!(stub.report_count(), count);
}
