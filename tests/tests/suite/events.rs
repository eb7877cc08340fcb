//! The read side over HTTP: events.list, the SSE stream, webhooks, history.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::http::HeaderMap;
use axum::routing::post;
use hmac::{Hmac, Mac};
use serde_json::{json, Value};
use sha2::Sha256;
use vps_tests::{
    acme_instance, eventually, quota, wait_until, TestServer, ALICE, EVE, OPERATOR, PATIENCE,
};

async fn some_instances(t: &TestServer, n: usize) -> String {
    let pool = t.hosted_pool("10.0.0.0/24", 1, quota(100)).await;
    for k in 0..n {
        t.ok(ALICE, "instances.create", json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu", "idempotencyKey": format!("e{k}") })).await;
    }
    pool
}

/// Every event a caller can list, paging by cursor.
async fn all_events(t: &TestServer, token: &str, types: Value) -> Vec<Value> {
    let mut out = Vec::new();
    let mut after = Value::Null;
    loop {
        let page = t
            .ok(
                token,
                "events.list",
                json!({ "after": after, "types": types, "limit": 7 }),
            )
            .await;
        let items = page["items"].as_array().unwrap().clone();
        if items.is_empty() {
            return out;
        }
        after = page["cursor"].clone();
        out.extend(items);
    }
}

#[tokio::test]
async fn tenants_list_only_their_own_events_and_pages_neither_skip_nor_repeat() {
    let t = TestServer::start().await;
    some_instances(&t, 5).await;
    t.settle().await;
    let operator = all_events(&t, OPERATOR, json!([])).await;
    let alice = all_events(&t, ALICE, json!(["instance.*"])).await;
    let eve = all_events(&t, EVE, json!([])).await;
    assert_eq!(alice.len(), 10, "five created and five scheduled");
    assert!(alice
        .iter()
        .all(|e| e["tenantid"] == "acme" && e["specversion"] == "1.0"));
    assert!(eve.is_empty(), "another tenant sees nothing of acme's");
    assert!(operator.len() > alice.len());
    let ids: std::collections::HashSet<_> =
        operator.iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), operator.len(), "no repeats across pages");
    let err = t
        .err(ALICE, "events.list", json!({ "types": ["Instance*"] }))
        .await;
    assert_eq!(err.body["code"], "INVALID_INPUT");
}

/// Reads `want` events from the SSE stream, resuming after `last_id`; returns (id, event id).
async fn read_sse(t: &TestServer, last_id: Option<&str>, want: usize) -> Vec<(String, String)> {
    let mut request = t
        .http
        .get(format!("{}/api/compute/events/stream", t.server.url()))
        .bearer_auth(OPERATOR);
    if let Some(id) = last_id {
        request = request.header("Last-Event-ID", id);
    }
    let mut response = request.send().await.unwrap();
    assert_eq!(response.status().as_u16(), 200);
    let mut buffer = String::new();
    let mut out = Vec::new();
    while out.len() < want {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("stream stalls")
            .unwrap()
            .expect("stream ends");
        buffer.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(end) = buffer.find("\n\n") {
            let frame: String = buffer.drain(..end + 2).collect();
            let id = frame
                .lines()
                .find_map(|l| l.strip_prefix("id:"))
                .map(|s| s.trim().to_string());
            let data = frame
                .lines()
                .find_map(|l| l.strip_prefix("data:"))
                .map(|s| s.trim().to_string());
            if let (Some(id), Some(data)) = (id, data) {
                let event: Value = serde_json::from_str(&data).unwrap();
                out.push((id, event["id"].as_str().unwrap().to_string()));
            }
        }
    }
    out.truncate(want);
    out
}

#[tokio::test]
async fn the_event_stream_resumes_after_last_event_id_without_gap_or_repeat() {
    let t = TestServer::start().await;
    some_instances(&t, 4).await;
    t.settle().await;
    let everything = all_events(&t, OPERATOR, json!([])).await;
    let first = read_sse(&t, None, 5).await;
    let rest = read_sse(&t, Some(&first.last().unwrap().0), everything.len() - 5).await;
    let streamed: Vec<String> = first
        .iter()
        .chain(&rest)
        .map(|(_, id)| id.clone())
        .collect();
    let listed: Vec<String> = everything
        .iter()
        .map(|e| e["id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(streamed, listed);
}

type Received = Arc<Mutex<Vec<(HeaderMap, String)>>>;

/// A webhook endpoint on 127.0.0.1: its URL, and the requests it received.
async fn receiver() -> (String, Received) {
    let received: Received = Arc::default();
    let sink = received.clone();
    let app = axum::Router::new().route(
        "/hook",
        post(move |headers: HeaderMap, body: String| {
            let sink = sink.clone();
            async move {
                sink.lock().unwrap().push((headers, body));
                "ok"
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, received)
}

/// Asserts that each request is an `instance.created` of acme, signed with `secret`.
fn assert_signed_instance_created(got: &[(HeaderMap, String)], secret: &str) {
    let key = data_encoding::BASE64
        .decode(secret.trim_start_matches("whsec_").as_ref())
        .unwrap();
    for (headers, body) in got {
        let id = headers["webhook-id"].to_str().unwrap();
        let timestamp = headers["webhook-timestamp"].to_str().unwrap();
        let mut mac = Hmac::<Sha256>::new_from_slice(&key).unwrap();
        mac.update(format!("{id}.{timestamp}.{body}").as_bytes());
        let expected = format!(
            "v1,{}",
            data_encoding::BASE64.encode(&mac.finalize().into_bytes())
        );
        assert!(
            headers["webhook-signature"]
                .to_str()
                .unwrap()
                .split(' ')
                .any(|s| s == expected),
            "bad signature"
        );
        let event: Value = serde_json::from_str(body).unwrap();
        assert_eq!(
            (event["type"].as_str(), event["tenantid"].as_str()),
            (Some("instance.created"), Some("acme"))
        );
    }
}

/// Waits until `webhooks.deliveries` lists `n` delivered attempts of `hook`.
async fn delivered(t: &TestServer, hook: &Value, n: usize) {
    eventually("the deliveries listed", PATIENCE, || async {
        let deliveries = t
            .ok(ALICE, "webhooks.deliveries", json!({ "webhookId": hook }))
            .await;
        let delivered = deliveries["items"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|d| d["status"] == "delivered")
            .count();
        if delivered == n {
            Ok(())
        } else {
            Err(deliveries)
        }
    })
    .await;
}

#[tokio::test]
async fn a_tenant_webhook_receives_signed_deliveries_of_its_own_events_only() {
    let t = TestServer::start().await;
    let (url, received) = receiver().await;

    let hook = t
        .ok(
            ALICE,
            "webhooks.create",
            json!({ "url": url, "types": ["instance.created"] }),
        )
        .await;
    assert_eq!(hook["tenantId"], "acme");
    let secret = hook["secret"].as_str().unwrap().to_string();
    assert!(secret.starts_with("whsec_"));
    assert!(
        t.ok(ALICE, "webhooks.list", json!({}))
            .await
            .to_string()
            .find(&secret)
            .is_none(),
        "the secret is shown once"
    );
    let err = t
        .err(
            EVE,
            "webhooks.deliveries",
            json!({ "webhookId": hook["id"] }),
        )
        .await;
    assert_eq!(err.body["code"], "NOT_FOUND");

    some_instances(&t, 2).await;
    wait_until("two webhook POSTs", PATIENCE, || async {
        received.lock().unwrap().len() >= 2
    })
    .await;
    let got = received.lock().unwrap().clone();
    assert_eq!(got.len(), 2, "one delivery per instance.created");
    assert_signed_instance_created(&got, &secret);
    // Deliveries are recorded right after their POSTs, in runs.
    delivered(&t, &hook["id"], 2).await;
}

#[tokio::test]
async fn an_instance_can_be_read_as_it_was_at_an_earlier_point_of_the_log() {
    let t = TestServer::start().await;
    let pool = some_instances(&t, 0).await;
    let inst = t.ok(ALICE, "instances.create", json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu", "idempotencyKey": "tt" })).await;
    let req = acme_instance(&inst["id"]);
    let history = t.ok(ALICE, "instances.history", req.clone()).await;
    let created_cursor = history["items"][0]["sequence"].clone();
    t.ok(ALICE, "instances.stop", req.clone()).await;
    let then = t
        .ok(
            ALICE,
            "instances.get",
            json!({ "tenantId": "acme", "instanceId": inst["id"], "asOf": created_cursor }),
        )
        .await;
    assert_eq!(
        (then["state"].as_str(), then["version"].as_u64()),
        (Some("scheduling"), Some(1))
    );
    let now = t.ok(ALICE, "instances.get", req.clone()).await;
    assert_eq!(now["desiredState"], "stopped");
    let err = t
        .err(
            ALICE,
            "instances.get",
            json!({ "tenantId": "acme", "instanceId": inst["id"], "asOf": "yesterday" }),
        )
        .await;
    assert_eq!(err.body["code"], "INVALID_INPUT");
}
