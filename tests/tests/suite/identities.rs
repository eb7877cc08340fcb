//! Identities and API keys created at run time, and node tokens: keys work at once, are
//! refused on every replica within a second of their revocation, and never enter the log.

use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_tests::{eventually, TestServer, ALICE, OPERATOR, PATIENCE};

async fn status(url: &str, token: &str, method: &str, body: Value) -> u16 {
    let (group, name) = method.split_once('.').unwrap();
    reqwest::Client::new()
        .post(format!("{url}/api/compute/{group}/{name}"))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

async fn log_text(t: &TestServer) -> String {
    let rows: Vec<String> = sqlx::query_scalar("SELECT data::text || metadata::text FROM events")
        .fetch_all(&t.server.state.pool)
        .await
        .unwrap();
    rows.join("\n")
}

#[tokio::test]
async fn an_api_key_acts_for_its_tenant_and_a_revoked_one_is_refused_on_every_replica() {
    let t = TestServer::start().await;
    let replica = t.replica().await;
    let created = t
        .ok(
            OPERATOR,
            "identities.create",
            json!({ "tenantId": "acme", "name": "ci" }),
        )
        .await;
    let key = created["apiKey"].as_str().unwrap().to_string();
    let id = created["identity"]["id"].as_str().unwrap().to_string();
    assert_eq!(created["identity"]["tenantId"], "acme");
    assert_eq!(created["identity"]["operator"], false);

    let listed = t.ok(&key, "webhooks.list", json!({})).await;
    assert_eq!(listed["items"], json!([]));
    let other = t
        .err(&key, "instances.list", json!({ "tenantId": "globex" }))
        .await;
    assert_eq!(other.body["code"], "NOT_FOUND");
    let operator_only = t.err(&key, "pools.list", json!({})).await;
    assert_eq!(operator_only.body["code"], "ACCESS_DENIED");
    assert_eq!(
        status(&replica.url(), &key, "webhooks.list", json!({})).await,
        200
    );

    // The configuration's identities first (their tokens change only there), then this one.
    let identities = t.ok(OPERATOR, "identities.list", json!({})).await;
    let items = identities["items"].as_array().unwrap();
    let ids: Vec<&str> = items.iter().map(|i| i["id"].as_str().unwrap()).collect();
    assert_eq!(
        ids,
        ["id_operator", "id_alice", "id_bob", "id_eve", id.as_str()]
    );
    assert_eq!(items[1]["source"], "config");
    assert_eq!(items[1]["tenantId"], "acme");
    assert_eq!(items[4]["source"], "api");
    assert_eq!(items[4]["keys"], 1);
    let configured = t
        .err(
            OPERATOR,
            "apiKeys.revoke",
            json!({ "identityId": "id_alice" }),
        )
        .await;
    assert_eq!(configured.body["code"], "INVALID_STATE");

    let revoked = t
        .ok(OPERATOR, "apiKeys.revoke", json!({ "identityId": id }))
        .await;
    assert_eq!(
        revoked,
        json!({ "identityId": id, "revoked": 1, "signedOut": false })
    );
    let at = Instant::now();
    for url in [t.server.url(), replica.url()] {
        eventually("the key refused", PATIENCE, || async {
            match status(&url, &key, "webhooks.list", json!({})).await {
                401 => Ok(()),
                other => Err(other),
            }
        })
        .await;
    }
    assert!(at.elapsed() < Duration::from_secs(1), "{:?}", at.elapsed());
    let log = log_text(&t).await;
    let secret = key.rsplit('_').next().unwrap();
    assert!(
        !log.contains(secret),
        "the key's secret never enters the log"
    );
    let revocations: i64 =
        sqlx::query_scalar("SELECT count(*) FROM events WHERE type = 'identity.keys.revoked'")
            .fetch_one(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!(revocations, 1, "the revocation is in the log");
    assert!(t.replay_equal().await);
    replica.shutdown().await;
}

#[tokio::test]
async fn a_wrong_or_forged_key_is_unauthenticated() {
    let t = TestServer::start().await;
    let created = t
        .ok(
            OPERATOR,
            "identities.create",
            json!({ "operator": true, "name": "ops" }),
        )
        .await;
    let key = created["apiKey"].as_str().unwrap();
    t.ok(key, "pools.list", json!({})).await;
    let forged = format!("{}0", &key[..key.len() - 1]);
    let forged = if forged == key {
        format!("{}1", &key[..key.len() - 1])
    } else {
        forged
    };
    assert_eq!(t.err(&forged, "pools.list", json!({})).await.status, 401);
    assert_eq!(
        t.err("vpk_nothing_here", "pools.list", json!({}))
            .await
            .status,
        401
    );
    let bad = t
        .err(
            OPERATOR,
            "identities.create",
            json!({ "name": "no tenant" }),
        )
        .await;
    assert_eq!(bad.body["code"], "INVALID_INPUT");
    let denied = t
        .err(
            ALICE,
            "identities.create",
            json!({ "tenantId": "acme", "name": "x" }),
        )
        .await;
    assert_eq!(denied.body["code"], "ACCESS_DENIED");
}

#[tokio::test]
async fn a_node_token_rotates_never_enters_the_log_and_reaches_only_its_own_node() {
    let t = TestServer::start().await;
    let pool = t.hosted_pool("10.0.0.0/28", 0, json!({ "vcpu": 4 })).await;
    let (node, token) = t.register_node(&pool, "a").await;
    let (other, _) = t.register_node(&pool, "b").await;
    t.ok(&token, "nodes.spec", json!({ "nodeId": node })).await;
    for (method, body) in [
        ("nodes.spec", json!({ "nodeId": other })),
        ("images.list", json!({})),
        ("flavors.list", json!({ "poolId": pool })),
        ("events.list", json!({})),
        ("nodes.list", json!({})),
    ] {
        let refused = t.err(&token, method, body).await;
        assert_eq!(
            refused.body["code"], "ACCESS_DENIED",
            "{method}: {}",
            refused.body
        );
    }

    let rotated = t
        .ok(OPERATOR, "nodes.rotateToken", json!({ "nodeId": node }))
        .await;
    let fresh = rotated["nodeToken"].as_str().unwrap();
    assert_ne!(fresh, token);
    assert_eq!(
        t.err(&token, "nodes.spec", json!({ "nodeId": node }))
            .await
            .status,
        401
    );
    t.ok(fresh, "nodes.spec", json!({ "nodeId": node })).await;

    let log = log_text(&t).await;
    assert!(!log.contains("tokenHash"), "no event carries a token hash");
    let hash = vps_commands_token_hash(fresh);
    assert!(!log.contains(&hash));
    let history: Vec<String> =
        sqlx::query_scalar("SELECT type FROM events WHERE stream = $1 ORDER BY version")
            .bind(format!("node-{node}"))
            .fetch_all(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!(history, ["node.registered", "node.tokenRotated"]);
    // A rotation stamps the node's row and leaves its state as it was.
    let (state, version): (String, i64) =
        sqlx::query_as("SELECT state, version FROM nodes WHERE id = $1")
            .bind(&node)
            .fetch_one(&t.server.state.pool)
            .await
            .unwrap();
    assert_eq!((state.as_str(), version), ("ready", 2));
    assert!(t.replay_equal().await);
}

fn vps_commands_token_hash(token: &str) -> String {
    use sha2::Digest;
    hex_encode(&sha2::Sha256::digest(token.as_bytes()))
}

fn hex_encode(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
