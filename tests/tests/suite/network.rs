//! A template's network allow-list and bounds (issue 39): checked on create and update, shown
//! on the template, captured by its sandboxes' instances and carried to their NodeSpec entries.

use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{eventually, quota, TestServer, ALICE, PATIENCE};

async fn server() -> TestServer {
    TestServer::start_with(vps_tests::fast_sandboxes).await
}

/// The NodeSpec entry of the sandbox `key` of `template`, once its instance has one.
async fn entry_of_new_sandbox(t: &TestServer, template: &str, key: &str) -> Value {
    let s = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": key,
                    "ttlSeconds": 600 }),
        )
        .await;
    let instance = s["instanceId"].as_str().unwrap().to_string();
    eventually("the instance's NodeSpec entry", PATIENCE, || async {
        let entry: Option<Value> =
            sqlx::query_scalar("SELECT entry FROM node_spec_entries WHERE instance_id = $1")
                .bind(&instance)
                .fetch_optional(&t.server.state.pool)
                .await
                .unwrap();
        entry.ok_or("no entry yet")
    })
    .await
}

fn network_of(entry: &Value) -> Value {
    json!({
        "networkPolicy": entry["networkPolicy"],
        "networkAllow": entry["networkAllow"],
        "networkBandwidthMbit": entry["networkBandwidthMbit"],
        "networkMaxConnections": entry["networkMaxConnections"],
    })
}

#[tokio::test]
async fn a_template_s_allow_list_and_bounds_reach_its_sandboxes_node_spec_entries() {
    let t = server().await;
    let (pool, _hosts) = t
        .pool_with_hosts("10.0.0.0/22", quota(1000), 1, Duration::from_millis(50))
        .await;
    let narrowed = t
        .sandbox_template(
            &pool,
            "narrowed",
            json!({ "network": { "allow": ["203.0.113.0/24", "198.51.100.7", "*.example.com"],
                                 "bandwidthMbit": 20, "maxConnections": 64 } }),
        )
        .await;
    assert_eq!(narrowed["network"], "egress", "the mode stays a string");
    assert_eq!(
        narrowed["networkAllow"],
        json!(["203.0.113.0/24", "198.51.100.7", "*.example.com"])
    );
    assert_eq!(
        (
            &narrowed["networkBandwidthMbit"],
            &narrowed["networkMaxConnections"]
        ),
        (&json!(20), &json!(64))
    );
    let id = narrowed["id"].as_str().unwrap();
    let entry = entry_of_new_sandbox(&t, id, "narrowed-1").await;
    assert_eq!(
        network_of(&entry),
        json!({ "networkPolicy": "egress",
                "networkAllow": ["203.0.113.0/24", "198.51.100.7", "*.example.com"],
                "networkBandwidthMbit": 20, "networkMaxConnections": 64 })
    );

    // The string form is as before: no allow-list, no bounds, on the template or the entry.
    let plain = t
        .sandbox_template(&pool, "plain", json!({ "network": "egress" }))
        .await;
    for key in [
        "networkAllow",
        "networkBandwidthMbit",
        "networkMaxConnections",
    ] {
        assert!(plain.get(key).is_none(), "{key} in {plain}");
    }
    let entry = entry_of_new_sandbox(&t, plain["id"].as_str().unwrap(), "plain-1").await;
    assert_eq!(
        network_of(&entry),
        json!({ "networkPolicy": "egress", "networkAllow": null,
                "networkBandwidthMbit": null, "networkMaxConnections": null })
    );

    // An update changes what new sandboxes get; the mode alone clears the list and bounds.
    let updated = t
        .ok(
            ALICE,
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": id,
                    "network": { "mode": "egress", "allow": ["192.0.2.1"] } }),
        )
        .await;
    assert_eq!(updated["networkAllow"], json!(["192.0.2.1"]));
    assert!(updated.get("networkBandwidthMbit").is_none(), "{updated}");
    let entry = entry_of_new_sandbox(&t, id, "narrowed-2").await;
    assert_eq!(
        network_of(&entry),
        json!({ "networkPolicy": "egress", "networkAllow": ["192.0.2.1"],
                "networkBandwidthMbit": null, "networkMaxConnections": null })
    );
    let cleared = t
        .ok(
            ALICE,
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": id, "network": "egress" }),
        )
        .await;
    assert!(cleared.get("networkAllow").is_none(), "{cleared}");
    let entry = entry_of_new_sandbox(&t, id, "narrowed-3").await;
    assert!(entry.get("networkAllow").is_none(), "{entry}");
    // The templates, instances and entries with their rules rebuild exactly from the log.
    t.quiescent().await;
    assert!(t.replay_equal().await, "replay differs from live");
}

#[tokio::test]
async fn bad_allow_entries_and_bounds_are_refused_naming_the_field() {
    let t = server().await;
    let (pool, _hosts) = t
        .pool_with_hosts("10.0.0.0/22", quota(1000), 1, Duration::from_millis(50))
        .await;
    let base = json!({ "tenantId": "acme", "name": "bad", "poolId": pool, "flavor": "small",
                       "imageId": "img_ubuntu" });
    let with = |network: Value| vps_tests::merged(base.clone(), json!({ "network": network }));
    let too_many: Vec<String> = (0..65).map(|i| format!("10.0.{i}.0/24")).collect();
    let cases = [
        (
            json!({ "allow": ["a.example", "10.0.0.0/8", "1.2.3.4", "not a name"] }),
            "network.allow[3]",
        ),
        (json!({ "allow": ["10.0.0.0/33"] }), "network.allow[0]"),
        (json!({ "allow": ["2001:db8::/32"] }), "network.allow[0]"),
        (json!({ "allow": ["a.*.example"] }), "network.allow[0]"),
        (json!({ "allow": too_many }), "network.allow"),
        (
            json!({ "mode": "private", "allow": ["10.0.0.0/8"] }),
            "network.allow",
        ),
        (json!({ "bandwidthMbit": 0 }), "network.bandwidthMbit"),
        (json!({ "bandwidthMbit": 100_001 }), "network.bandwidthMbit"),
        (json!({ "maxConnections": 0 }), "network.maxConnections"),
        (
            json!({ "maxConnections": 1_000_001 }),
            "network.maxConnections",
        ),
        (json!({ "bandwidthMbit": "fast" }), "network"),
        (json!({ "colour": "blue" }), "network"),
        (json!("open"), "network"),
    ];
    for (network, field) in cases {
        let err = t
            .call(ALICE, "sandboxTemplates.create", with(network.clone()))
            .await
            .expect_err("a refusal");
        assert_eq!(err.body["code"], "INVALID_INPUT", "{network}: {}", err.body);
        assert_eq!(
            err.body["details"]["field"], field,
            "{network}: {}",
            err.body
        );
    }
    // An IPv6 entry is refused saying why: guests are IPv4-only.
    let err = t
        .call(
            ALICE,
            "sandboxTemplates.create",
            with(json!({ "allow": ["a.example", "2001:db8::1"] })),
        )
        .await
        .expect_err("a refusal");
    assert_eq!(
        err.body["details"]["field"], "network.allow[1]",
        "{}",
        err.body
    );
    let message = err.body["message"].as_str().unwrap_or_default();
    assert!(message.contains("guests are IPv4-only"), "{}", err.body);
    // `_` is part of a domain (vps_seam::host_name), as the host always read it.
    let underscore = t
        .ok(
            ALICE,
            "sandboxTemplates.create",
            vps_tests::merged(
                base.clone(),
                json!({ "name": "underscore", "network": { "allow": ["_dmarc.example", "my_host.example"] } }),
            ),
        )
        .await;
    assert_eq!(
        underscore["networkAllow"],
        json!(["_dmarc.example", "my_host.example"])
    );
    // Nothing was written: the name is still free.
    let made = t
        .ok(
            ALICE,
            "sandboxTemplates.create",
            with(json!({ "mode": "none", "maxConnections": 16 })),
        )
        .await;
    assert_eq!(made["network"], "none");
    assert_eq!(made["networkMaxConnections"], 16);
    // An update is checked the same way and changes nothing when refused.
    let id = made["id"].as_str().unwrap();
    let err = t
        .call(
            ALICE,
            "sandboxTemplates.update",
            json!({ "tenantId": "acme", "templateId": id,
                    "network": { "allow": ["ok.example", "bad-.example"] } }),
        )
        .await
        .expect_err("a refusal");
    assert_eq!(
        err.body["details"]["field"], "network.allow[1]",
        "{}",
        err.body
    );
    let got = t
        .ok(
            ALICE,
            "sandboxTemplates.get",
            json!({ "tenantId": "acme", "templateId": id }),
        )
        .await;
    assert_eq!(
        (&got["version"], &got["network"]),
        (&json!(1), &json!("none"))
    );
}
