//! Preview URLs end to end on emulated hosts: `sandboxes.expose` answers a URL, `vps serve`
//! proxies it through a tunnel ticket to the host, which connects the tunnel to the guest's
//! port (the emulated guest's service there names the instance and echoes after an upgrade).
//! A forged, expired or revoked token is 404.

use std::time::Duration;

use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_sandbox, quota, TestServer, ALICE, EVE};

const BOOT: Duration = Duration::from_millis(50);

async fn setup(t: &TestServer) -> (Value, Vec<HostHandle>) {
    let (pool, hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let template = t.sandbox_template(&pool, "web", json!({})).await;
    let sandbox = t
        .ready_sandbox(&template["id"], "web-1", json!({ "ttlSeconds": 600 }))
        .await;
    (sandbox, hosts)
}

fn expose_body(s: &Value, port: u64, ttl: Option<u64>) -> Value {
    let mut body = json!({ "tenantId": "acme", "sandboxId": s["id"], "port": port });
    if let Some(ttl) = ttl {
        body["ttlSeconds"] = ttl.into();
    }
    body
}

async fn get(t: &TestServer, url: &str) -> (u16, String) {
    let response = t.http.get(url).send().await.expect("an answer");
    let status = response.status().as_u16();
    (status, response.text().await.unwrap_or_default())
}

/// The event types the log holds for the sandbox, in order.
async fn preview_events(t: &TestServer, s: &Value) -> Vec<Value> {
    t.settle().await;
    let subject = format!("sandbox/{}", s["id"].as_str().unwrap());
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.exposed", "sandbox.unexposed"], "subject": subject }),
        )
        .await;
    events["items"].as_array().unwrap().clone()
}

#[tokio::test]
async fn a_preview_url_reaches_the_guest_port_until_it_is_revoked_or_ends() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (s, _hosts) = setup(&t).await;
    let exposed = t
        .ok(ALICE, "sandboxes.expose", expose_body(&s, 8080, None))
        .await;
    let url = exposed["url"].as_str().unwrap().to_string();
    assert!(
        url.starts_with(&format!("{}/preview/", t.server.url())),
        "{url}"
    );
    assert!(url.ends_with('/'), "{url}");
    assert_eq!(exposed["port"], 8080);
    assert!(exposed["expiresAt"].is_string(), "{exposed}");

    // The guest's port answers, path and query as sent, as often as asked.
    let instance = s["instanceId"].as_str().unwrap();
    for _ in 0..2 {
        let (status, page) = get(&t, &format!("{url}hello/there?x=1")).await;
        assert_eq!(status, 200, "{url}: {page:?}");
        assert_eq!(
            page,
            format!("emulated guest {instance} port 8080: GET /hello/there?x=1\n")
        );
    }
    let posted = t.http.post(&url).body("a body").send().await.unwrap();
    assert_eq!(posted.status().as_u16(), 200);
    assert!(posted.text().await.unwrap().ends_with("POST /\n"));

    // A forged token, an edited one, another port's: 404 alike.
    let token = url
        .trim_end_matches('/')
        .rsplit('/')
        .next()
        .unwrap()
        .to_string();
    let (payload, mac) = token.split_once('.').unwrap();
    let flipped = if mac.starts_with('0') { "1" } else { "0" };
    let forged = [
        format!("{payload}.{flipped}{}", &mac[1..]),
        format!("{payload}00.{mac}"),
        "nothing".to_string(),
        String::new(),
    ];
    for token in forged {
        let (status, _) = get(&t, &format!("{}/preview/{token}/", t.server.url())).await;
        assert_eq!(status, 404, "{token}");
    }

    // Revoked: the signature still holds, the exposure does not.
    let revoked = t
        .ok(
            ALICE,
            "sandboxes.unexpose",
            json!({ "tenantId": "acme", "sandboxId": s["id"], "port": 8080 }),
        )
        .await;
    assert_eq!(revoked["revoked"], true);
    assert_eq!(get(&t, &url).await.0, 404);
    let again = t
        .ok(
            ALICE,
            "sandboxes.unexpose",
            json!({ "tenantId": "acme", "sandboxId": s["id"], "port": 8080 }),
        )
        .await;
    assert_eq!(again["revoked"], false);

    // Exposed again for a minute: a new URL, which ends with its minute.
    let short = t
        .ok(ALICE, "sandboxes.expose", expose_body(&s, 8080, Some(60)))
        .await;
    let short_url = short["url"].as_str().unwrap();
    assert_ne!(short_url, url);
    assert_eq!(get(&t, &url).await.0, 404, "the revoked URL stays revoked");
    assert_eq!(get(&t, short_url).await.0, 200);
    t.advance(Duration::from_secs(61));
    assert_eq!(get(&t, short_url).await.0, 404);

    // Each exposure and revocation is an event; none carries the URL or its token.
    let events = preview_events(&t, &s).await;
    let kinds: Vec<&str> = events.iter().map(|e| e["type"].as_str().unwrap()).collect();
    assert_eq!(
        kinds,
        ["sandbox.exposed", "sandbox.unexposed", "sandbox.exposed"]
    );
    assert_eq!(events[0]["data"]["port"], 8080);
    assert_eq!(events[0]["data"]["expiresAt"], exposed["expiresAt"]);
    let text = serde_json::to_string(&events).unwrap();
    assert!(!text.contains(&token), "{text}");
    assert!(t.replay_equal().await);
}

#[tokio::test]
async fn a_websocket_upgrade_passes_bytes_both_ways() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (s, _hosts) = setup(&t).await;
    let exposed = t
        .ok(ALICE, "sandboxes.expose", expose_body(&s, 3000, None))
        .await;
    let url = exposed["url"].as_str().unwrap();
    let path = url.strip_prefix(&t.server.url()).unwrap();
    let mut stream = tokio::net::TcpStream::connect(t.server.addr).await.unwrap();
    let handshake = format!(
        "GET {path}socket HTTP/1.1\r\nHost: {}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n",
        t.server.addr
    );
    stream.write_all(handshake.as_bytes()).await.unwrap();
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        stream.read_exact(&mut byte).await.unwrap();
        head.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&head).to_string();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    assert!(
        head.to_ascii_lowercase().contains("upgrade: websocket"),
        "{head}"
    );
    // After the switch, what goes in comes back, several times over.
    for message in ["first frame", "second, longer frame of bytes \u{1F600}"] {
        stream.write_all(message.as_bytes()).await.unwrap();
        let mut back = vec![0u8; message.len()];
        tokio::time::timeout(Duration::from_secs(10), stream.read_exact(&mut back))
            .await
            .expect("the echo in time")
            .unwrap();
        assert_eq!(back, message.as_bytes());
    }
}

#[tokio::test]
async fn expose_refuses_bad_ports_long_ttls_other_tenants_and_sandboxes_not_ready() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (s, _hosts) = setup(&t).await;
    for port in [0, 65_536] {
        let e = t
            .err(ALICE, "sandboxes.expose", expose_body(&s, port, None))
            .await;
        assert_eq!(e.body["code"], "INVALID_INPUT", "{}", e.body);
        assert_eq!(e.body["details"]["field"], "port", "{}", e.body);
    }
    let e = t
        .err(ALICE, "sandboxes.expose", expose_body(&s, 80, Some(601)))
        .await;
    assert_eq!(e.body["code"], "INVALID_INPUT", "{}", e.body);
    assert_eq!(e.body["details"]["field"], "ttlSeconds", "{}", e.body);
    for body in [
        json!({ "tenantId": "globex", "sandboxId": s["id"], "port": 80 }),
        acme_sandbox(&s["id"]),
    ] {
        let mut body = body;
        body["port"] = 80.into();
        let e = t.err(EVE, "sandboxes.expose", body).await;
        assert!(
            ["NOT_FOUND", "ACCESS_DENIED"].contains(&e.body["code"].as_str().unwrap()),
            "{}",
            e.body
        );
    }
    let e = t
        .err(
            EVE,
            "sandboxes.expose",
            json!({ "tenantId": "globex", "sandboxId": s["id"], "port": 80 }),
        )
        .await;
    assert_eq!(e.body["code"], "NOT_FOUND", "{}", e.body);
    let exposed = t
        .ok(ALICE, "sandboxes.expose", expose_body(&s, 80, None))
        .await;
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&s["id"]))
        .await;
    let e = t
        .err(ALICE, "sandboxes.expose", expose_body(&s, 80, None))
        .await;
    assert_eq!(e.body["code"], "INVALID_STATE", "{}", e.body);
    // A deleted sandbox's URL answers nothing.
    assert_eq!(get(&t, exposed["url"].as_str().unwrap()).await.0, 404);
}

#[tokio::test]
async fn the_cli_exposes_a_port_printing_the_url_and_unexposes_it() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (s, _hosts) = setup(&t).await;
    let id = s["id"].as_str().unwrap();
    let cli = |args: Vec<&str>| {
        tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
            .args(args)
            .env("VPS_URL", t.server.url())
            .env("VPS_TOKEN", ALICE)
            .env("VPS_TENANT", "acme")
            .env("RUST_LOG", "off")
            .output()
    };
    let out = cli(vec!["sandboxes", "expose", id, "8080", "--ttl", "5m"])
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let url = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(url.starts_with("http://"), "{url}");
    let (status, page) = get(&t, &url).await;
    assert_eq!(status, 200, "{page}");
    let out = cli(vec!["sandboxes", "unexpose", id, "8080"])
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(get(&t, &url).await.0, 404);
    let out = cli(vec!["sandboxes", "expose", id, "0"]).await.unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("port"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
