//! Property: whatever templates, sandboxes and hosts do, in whatever order, rebuilding every
//! projection from the log gives the live tables, no instance ever drives two sandboxes, and
//! no call answers 500.

use proptest::prelude::*;
use serde_json::json;
use vps_tests::{acme_sandbox, quota, Answer, TestServer, ALICE, BOB};

#[derive(Debug, Clone)]
enum Op {
    Template {
        key: u8,
        min: u8,
        max: u8,
    },
    Reshape {
        key: u8,
        large: bool,
    },
    DeleteTemplate(u8),
    Create {
        who: u8,
        template: u8,
        key: u8,
        ttl: u16,
    },
    Extend {
        key: u8,
        seconds: u16,
    },
    Delete(u8),
    Report {
        key: u8,
        state: &'static str,
    },
    Pass,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => (0..3u8, 0..3u8, 0..4u8).prop_map(|(key, min, max)| Op::Template { key, min, max }),
        1 => (0..3u8, any::<bool>()).prop_map(|(key, large)| Op::Reshape { key, large }),
        1 => (0..3u8).prop_map(Op::DeleteTemplate),
        4 => (0..2u8, 0..3u8, 0..8u8, 1..600u16).prop_map(|(who, template, key, ttl)| Op::Create { who, template, key, ttl }),
        1 => (0..8u8, 1..3600u16).prop_map(|(key, seconds)| Op::Extend { key, seconds }),
        1 => (0..8u8).prop_map(Op::Delete),
        2 => (0..8u8, prop::sample::select(vec!["RUNNING", "STOPPED", "PAUSED", "ERROR"])).prop_map(|(key, state)| Op::Report { key, state }),
        2 => Just(Op::Pass),
    ]
}

struct World<'a> {
    t: &'a TestServer,
    pool: String,
    node: (String, String),
    templates: Vec<Option<String>>,
    sandboxes: Vec<Option<(String, String)>>,
}

impl World<'_> {
    async fn apply(&mut self, op: &Op) -> Result<(), Answer> {
        let t = self.t;
        match op {
            Op::Template { key, min, max } => {
                let body = json!({ "tenantId": "acme", "name": format!("t{key}"), "poolId": self.pool, "flavor": "small",
                    "imageId": "img_ubuntu", "defaultTtlSeconds": 60, "maxTtlSeconds": 3600, "warm": { "min": min, "max": max } });
                let made = t.call(ALICE, "sandboxTemplates.create", body).await?;
                self.templates[*key as usize] = made["id"].as_str().map(str::to_string);
            }
            Op::Reshape { key, large } => {
                let Some(id) = &self.templates[*key as usize] else {
                    return Ok(());
                };
                t.call(ALICE, "sandboxTemplates.update", json!({ "tenantId": "acme", "templateId": id, "flavor": if *large { "large" } else { "small" } })).await?;
            }
            Op::DeleteTemplate(key) => {
                let Some(id) = &self.templates[*key as usize] else {
                    return Ok(());
                };
                t.call(
                    ALICE,
                    "sandboxTemplates.delete",
                    json!({ "tenantId": "acme", "templateId": id }),
                )
                .await?;
            }
            Op::Create {
                who,
                template,
                key,
                ttl,
            } => {
                let Some(tpl) = &self.templates[*template as usize] else {
                    return Ok(());
                };
                let token = if *who == 0 { ALICE } else { BOB };
                let s = t.call(token, "sandboxes.create", json!({ "tenantId": "acme", "templateId": tpl, "ttlSeconds": ttl, "idempotencyKey": format!("k{key}") })).await?;
                let ids = (
                    s["id"].as_str().unwrap().to_string(),
                    s["instanceId"].as_str().unwrap().to_string(),
                );
                self.sandboxes[*key as usize] = Some(ids);
            }
            Op::Extend { key, seconds } => {
                let Some((id, _)) = &self.sandboxes[*key as usize] else {
                    return Ok(());
                };
                t.call(
                    ALICE,
                    "sandboxes.extend",
                    json!({ "tenantId": "acme", "sandboxId": id, "by": *seconds as i64 * 1000 }),
                )
                .await?;
            }
            Op::Delete(key) => {
                let Some((id, _)) = &self.sandboxes[*key as usize] else {
                    return Ok(());
                };
                t.call(ALICE, "sandboxes.delete", acme_sandbox(id)).await?;
            }
            Op::Report { key, state } => {
                let Some((_, instance)) = &self.sandboxes[*key as usize] else {
                    return Ok(());
                };
                let (node, token) = &self.node;
                let entry =
                    json!({ "id": instance, "state": state, "message": "from the property test" });
                t.call(
                    token,
                    "nodes.report",
                    json!({ "nodeId": node, "instances": [entry], "complete": false }),
                )
                .await?;
            }
            Op::Pass => {
                let ctx = vps_api::server::reactor_ctx(&t.server.state, "property");
                let timings = vps_api::server::timings(&t.server.state.config);
                vps_reactors::sandboxes::pass(&ctx, &timings, &t.server.state.snapshots)
                    .await
                    .expect("a sandbox pass");
            }
        }
        Ok(())
    }
}

async fn run(ops: Vec<Op>) {
    let t = TestServer::start_with(|c| c.timings.sandbox_pass = 3600.0).await;
    let pool = t.hosted_pool("10.0.0.0/26", 0, quota(40)).await;
    let node = t.register_node(&pool, "n0").await;
    let mut world = World {
        t: &t,
        pool,
        node,
        templates: vec![None; 3],
        sandboxes: vec![None; 8],
    };
    for op in ops {
        if let Err(e) = world.apply(&op).await {
            assert!(
                e.status < 500 || e.body["code"] == "CAPACITY_UNAVAILABLE",
                "{op:?} answered {} {}",
                e.status,
                e.body
            );
        }
    }
    let shared: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT instance_id FROM sandboxes GROUP BY 1 HAVING count(*) > 1) d",
    )
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap();
    assert_eq!(shared, 0, "an instance drives two sandboxes");
    let crossed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM sandboxes s JOIN instances i ON i.id = s.instance_id
          WHERE i.doc->>'sandboxId' IS DISTINCT FROM s.id",
    )
    .fetch_one(&t.server.state.pool)
    .await
    .unwrap();
    assert_eq!(crossed, 0, "a sandbox's instance names another sandbox");
    t.quiescent().await;
    assert!(t.replay_equal().await, "replay differs from live");
    t.server.shutdown().await;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    #[test]
    fn sandboxes_replay_exactly_and_never_share_an_instance(ops in prop::collection::vec(op(), 5..40)) {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(run(ops));
    }
}
