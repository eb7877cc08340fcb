//! `vps doctor`, the `checks` of `/readyz?verbose` and the `vps_doctor_findings` gauges, against a
//! real server: healthy first, then with findings induced the way they happen in production
//! (a host that stops reporting, a reconciler whose lease another session holds, an endpoint
//! that answers 410, a transaction left open).

use std::str::FromStr;
use std::time::Duration;

use serde_json::{json, Value};
use sqlx::postgres::PgConnectOptions;
use sqlx::{Connection, PgConnection};
use vps_tests::{eventually, quota, TestServer, ALICE, OPERATOR, PATIENCE, SSH_KEY};

/// `/readyz?verbose` as the operator: its status and body.
async fn readyz(t: &TestServer) -> (u16, Value) {
    let response = t
        .http
        .get(format!("{}/readyz?verbose", t.server.url()))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("readyz answers");
    let status = response.status().as_u16();
    (status, response.json().await.expect("JSON body"))
}

/// The finding of `check` in a `/readyz` body.
fn finding<'a>(body: &'a Value, check: &str) -> Option<&'a Value> {
    body["checks"]
        .as_array()
        .expect("a checks array")
        .iter()
        .find(|f| f["check"] == check)
}

/// Waits until `/readyz` reports `check` with `severity`; answers that finding.
async fn until_finding(t: &TestServer, check: &str, severity: &str) -> Value {
    eventually(&format!("{check} {severity}"), PATIENCE, || async {
        let (_, body) = readyz(t).await;
        match finding(&body, check) {
            Some(f) if f["severity"] == severity => Ok(f.clone()),
            other => Err(other.cloned()),
        }
    })
    .await
}

/// This server's database URL (a fresh database per test).
async fn database_url(t: &TestServer) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    vps_pg::connect::with_database(&vps_pg::testing::server_url(), &name)
}

/// A session of its own on the server's database, named so findings can name it.
async fn session(t: &TestServer, application: &str) -> PgConnection {
    let options = PgConnectOptions::from_str(&database_url(t).await)
        .unwrap()
        .application_name(application);
    PgConnection::connect_with(&options).await.unwrap()
}

/// Runs the `vps` binary built beside this test (`cargo build -p vps`) with `args` and a
/// configuration naming the server's database and sealing key; its exit code and stdout.
async fn vps(t: &TestServer, args: &[&str]) -> (i32, String) {
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("vps"))
        .filter(|b| b.exists())
        .expect("the vps binary beside the test binaries: `cargo build -p vps` first");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("vps.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n\n[secrets]\nkey = \"{}\"\n",
            database_url(t).await,
            t.server.state.config.secrets.key.as_deref().unwrap()
        ),
    )
    .unwrap();
    let output = tokio::process::Command::new(binary)
        .arg("--config")
        .arg(&config)
        .args(args)
        .env_remove("VPS_DATABASE_URL")
        .env_remove("VPS_NATS_URL")
        .env_remove("VPS_CONFIG")
        .output()
        .await
        .expect("vps runs");
    let stdout = String::from_utf8(output.stdout).unwrap();
    eprintln!("{stdout}{}", String::from_utf8_lossy(&output.stderr));
    (output.status.code().expect("an exit code"), stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_server_has_no_error_and_readyz_carries_every_check() {
    let t = TestServer::start().await;
    // The background parts take their leases within moments of the start.
    let body = eventually("no error finding", PATIENCE, || async {
        let (status, body) = readyz(&t).await;
        let errors: Vec<Value> = body["checks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|f| f["severity"] == "error")
            .cloned()
            .collect();
        if status == 200 && errors.is_empty() {
            Ok(body)
        } else {
            Err((status, errors))
        }
    })
    .await;
    assert_eq!(body["ready"], true);
    for check in [
        "vps.database.reachable",
        "vps.database.migrations",
        "vps.events.horizon",
        "vps.events.followers",
        "vps.reactors.chainer",
        "vps.reactors.sandbox-reconciler",
        "vps.reactors.instance-reconciler",
        "vps.sandboxes.expiry",
        "vps.sandboxes.warm",
        "vps.instances.deleting",
        "vps.nodes.liveness",
        "vps.nats.reachable",
        "vps.webhooks.disabled",
        "vps.secrets.key",
    ] {
        let f = finding(&body, check).unwrap_or_else(|| panic!("{check} in {body}"));
        assert!(f["message"].as_str().is_some_and(|m| !m.is_empty()), "{f}");
    }
    assert_eq!(
        finding(&body, "vps.database.migrations").unwrap()["severity"],
        "ok"
    );

    // The same checks from the command line: nothing is an error, so it exits 0.
    let (code, out) = vps(&t, &["doctor", "--json"]).await;
    assert_eq!(code, 0, "{out}");
    let report: Value = serde_json::from_str(&out).expect("JSON on stdout");
    let checks = report["checks"].as_array().unwrap();
    assert!(checks.iter().all(|f| f["severity"] != "error"), "{out}");
    assert!(checks
        .iter()
        .any(|f| f["check"] == "vps.secrets.key" && f["severity"] == "ok"));

    // And as gauges, refreshed in the background. A pool's events give the followers
    // something to read after the tail began.
    t.hosted_pool(
        "10.0.0.0/24",
        0,
        json!({ "vcpu": 1, "memoryGiB": 1, "diskGiB": 10 }),
    )
    .await;
    eventually(
        "the doctor gauges and the tail's reads",
        PATIENCE,
        || async {
            let metrics = t.metrics().await;
            let gauge = r#"vps_doctor_findings{check="vps.database.reachable",severity="ok"} 1"#;
            // The followers' reads, served by the process's shared tail of the log.
            let tail_reads = r#"vps_log_reads_total{source="tail"}"#;
            if metrics.contains(gauge) && metrics.contains(tail_reads) {
                Ok(())
            } else {
                Err("no gauge yet")
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_stops_reporting_until_lost_is_an_error_and_doctor_exits_1() {
    let t = TestServer::start_with(|c| c.timings.liveness_check = 0.1).await;
    let pool = t.hosted_pool("10.0.0.0/24", 0, quota(100)).await;
    t.ok(
        OPERATOR,
        "pools.update",
        json!({ "poolId": pool, "policy": { "lostAfterSeconds": 1 } }),
    )
    .await;
    let (node, token) = t.register_node(&pool, "host-a").await;
    let host = t.host(&node, &token, Duration::from_millis(50));
    let ok = until_finding(&t, "vps.nodes.liveness", "ok").await;
    assert_eq!(ok["message"], "1 node reporting");

    host.set_reporting(false);
    let lost = until_finding(&t, "vps.nodes.liveness", "error").await;
    let message = lost["message"].as_str().unwrap();
    assert!(message.starts_with("1 node lost: "), "{message}");
    assert!(
        message.contains(&format!("{node} (host-a, silent ")),
        "{message}"
    );
    assert!(lost["fix"]
        .as_str()
        .unwrap()
        .contains("bring the host back"));
    let (status, body) = readyz(&t).await;
    assert_eq!((status, &body["ready"]), (200, &json!(true)), "{body}");

    let (code, out) = vps(&t, &["doctor"]).await;
    assert_eq!(code, 1, "{out}");
    let line = out
        .lines()
        .find(|l| l.contains("vps.nodes.liveness"))
        .expect("a line for the node check");
    assert!(line.starts_with("error "), "{line}");
    assert!(line.contains(&node) && line.contains(" — fix: "), "{line}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("ok ") && l.contains("vps.database.migrations")),
        "{out}"
    );

    // Reporting again recovers it.
    host.set_reporting(true);
    until_finding(&t, "vps.nodes.liveness", "ok").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_left_open_past_its_expiry_is_an_error_until_the_reconciler_runs() {
    // A session that is not a working reconciler holds its lease, as a stuck replica would.
    let pool = vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 40).await;
    let mut stuck = pool.acquire().await.unwrap().detach();
    sqlx::query("SELECT pg_advisory_lock(hashtextextended($1, 0))")
        .bind(vps_reactors::sandboxes::LEASE)
        .execute(&mut stuck)
        .await
        .unwrap();
    let t = TestServer::start_on(pool, |c| {
        c.timings.transitional_look = 0.1;
        c.timings.sandbox_pass = 0.2;
    })
    .await;
    let pool_id = t.hosted_pool("10.0.0.0/24", 0, quota(100)).await;
    let (node, token) = t.register_node(&pool_id, "host-a").await;
    let _host = t.host(&node, &token, Duration::from_millis(50));
    let template = t.sandbox_template(&pool_id, "short", json!({})).await;
    let sandbox = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": template["id"], "idempotencyKey": "k",
                    "ttlSeconds": 1 }),
        )
        .await;
    let id = sandbox["id"].as_str().unwrap();
    // A warm pool nothing refills meanwhile, still within its ten minutes of grace.
    t.sandbox_template(&pool_id, "warm", json!({ "warm": { "min": 1, "max": 1 } }))
        .await;

    let overdue = until_finding(&t, "vps.sandboxes.expiry", "error").await;
    let message = overdue["message"].as_str().unwrap();
    assert!(
        message.starts_with("1 sandbox is open more than two passes"),
        "{message}"
    );
    assert!(message.ends_with(id), "{message}");
    // The lease is held, so the finding that names the cause is the expiry itself.
    let (_, body) = readyz(&t).await;
    assert_eq!(
        finding(&body, "vps.reactors.sandbox-reconciler").unwrap()["severity"],
        "ok"
    );
    assert_eq!(
        finding(&body, "vps.sandboxes.warm").unwrap(),
        &json!({ "check": "vps.sandboxes.warm", "severity": "ok",
                 "message": "1 template keeps a warm pool, none short of warm.min for 10 min" })
    );

    // The stuck session goes; a replica's reconciler takes the lease and expires the sandbox.
    stuck.close().await.unwrap();
    until_finding(&t, "vps.sandboxes.expiry", "ok").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_webhook_whose_endpoint_answers_gone_is_reported_disabled() {
    let t = TestServer::start().await;
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(|| async { axum::http::StatusCode::GONE }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    let hook = t
        .ok(
            ALICE,
            "webhooks.create",
            json!({ "url": url, "types": ["instance.created"] }),
        )
        .await;
    let hook = hook["id"].as_str().unwrap();
    until_finding(&t, "vps.webhooks.disabled", "ok").await;

    let pool = t.hosted_pool("10.0.0.0/24", 0, quota(100)).await;
    t.ok(
        ALICE,
        "instances.create",
        json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
                "sshKeys": [SSH_KEY], "idempotencyKey": "k" }),
    )
    .await;
    let disabled = until_finding(&t, "vps.webhooks.disabled", "warning").await;
    let message = disabled["message"].as_str().unwrap();
    assert!(message.contains(&format!("{hook} (acme)")), "{message}");
    assert!(message.contains("410 Gone"), "{message}");
    assert!(disabled["fix"]
        .as_str()
        .unwrap()
        .contains("webhooks.create"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_transaction_holding_the_horizon_is_named_with_its_pid() {
    let t = TestServer::start().await;
    let mut holder = session(&t, "doctor-test-holder").await;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut holder)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut holder).await.unwrap();
    sqlx::query("SELECT txid_current()")
        .execute(&mut holder)
        .await
        .unwrap();
    // An event committed after it waits behind it.
    t.ok(
        OPERATOR,
        "pools.create",
        json!({ "name": "behind", "class": "vps-host" }),
    )
    .await;

    let held = until_finding(&t, "vps.events.horizon", "warning").await;
    let message = held["message"].as_str().unwrap();
    assert!(
        message.contains(&format!("pid {pid} (application doctor-test-holder")),
        "{message}"
    );
    assert!(message.contains("committed event"), "{message}");
    assert!(held["fix"]
        .as_str()
        .unwrap()
        .contains(&format!("pg_terminate_backend({pid})")));

    sqlx::query("ROLLBACK").execute(&mut holder).await.unwrap();
    holder.close().await.unwrap();
    eventually("the horizon released", PATIENCE, || async {
        let (_, body) = readyz(&t).await;
        let f = finding(&body, "vps.events.horizon").unwrap().clone();
        // Another test's transaction may hold it meanwhile, never this one.
        if f["message"]
            .as_str()
            .unwrap()
            .contains(&format!("pid {pid} "))
        {
            Err(f)
        } else {
            Ok(())
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_nats_that_does_not_answer_is_an_error() {
    // A port nothing listens on once the probe listener is gone.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let t = TestServer::start_with(|c| {
        c.nats = Some(vps_api::config::NatsConfig {
            url: format!("nats://127.0.0.1:{port}"),
            subject_prefix: String::new(),
        })
    })
    .await;
    let down = until_finding(&t, "vps.nats.reachable", "error").await;
    let message = down["message"].as_str().unwrap();
    assert!(
        message.starts_with(&format!(
            "cannot connect to NATS at nats://127.0.0.1:{port}"
        )),
        "{message}"
    );
    assert!(down["fix"].as_str().unwrap().contains("nats-server -js"));
    // The publisher holds its lease and waits for NATS; readiness is the database's alone.
    let (status, body) = readyz(&t).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        finding(&body, "vps.reactors.nats-publisher").unwrap()["severity"],
        "ok"
    );
}
