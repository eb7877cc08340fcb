//! Property: whatever operators and tenants do, in whatever order, rebuilding every
//! projection from the log gives exactly the live tables, and no call answers 500.

use proptest::prelude::*;
use serde_json::json;
use vps_tests::{acme_instance, Answer, TestServer, ALICE, BOB, OPERATOR, SSH_KEY};

#[derive(Debug, Clone)]
enum Op {
    Create {
        who: u8,
        key: u8,
        large: bool,
    },
    Stop(u8),
    Start(u8),
    Delete(u8),
    Resize {
        key: u8,
        large: bool,
    },
    Report {
        node: u8,
        key: u8,
        state: &'static str,
    },
    Cordon {
        node: u8,
        on: bool,
    },
    Offer {
        vcpu: u8,
    },
    AddNode,
    ArchiveLarge,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..2u8, 0..12u8, any::<bool>()).prop_map(|(who, key, large)| Op::Create { who, key, large }),
        1 => (0..12u8).prop_map(Op::Stop),
        1 => (0..12u8).prop_map(Op::Start),
        1 => (0..12u8).prop_map(Op::Delete),
        1 => (0..12u8, any::<bool>()).prop_map(|(key, large)| Op::Resize { key, large }),
        3 => (0..3u8, 0..12u8, prop::sample::select(vec!["RUNNING", "STOPPED", "PAUSED", "ERROR"]))
            .prop_map(|(node, key, state)| Op::Report { node, key, state }),
        1 => (0..3u8, any::<bool>()).prop_map(|(node, on)| Op::Cordon { node, on }),
        1 => (4..40u8).prop_map(|vcpu| Op::Offer { vcpu }),
        1 => Just(Op::AddNode),
        1 => Just(Op::ArchiveLarge),
    ]
}

async fn run(ops: Vec<Op>) {
    let t = TestServer::start().await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/27",
            0,
            json!({ "vcpu": 24, "memoryGiB": 200, "diskGiB": 2000 }),
        )
        .await;
    let mut world = World {
        t: &t,
        pool,
        nodes: Vec::new(),
        ids: vec![None; 12],
    };
    for n in 0..2 {
        world
            .nodes
            .push(t.register_node(&world.pool, &format!("n{n}")).await);
    }
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
    // Compare once the reconciler and every follower are done with what the ops started.
    t.quiescent().await;
    assert!(t.replay_equal().await, "replay differs from live");
    t.server.shutdown().await;
}

/// What the ops act on: the server, the pool, its nodes and the instances by key.
struct World<'a> {
    t: &'a TestServer,
    pool: String,
    nodes: Vec<(String, String)>,
    ids: Vec<Option<String>>,
}

impl World<'_> {
    /// Calls what `op` stands for; an op on an instance never created does nothing.
    async fn apply(&mut self, op: &Op) -> Result<(), Answer> {
        let (t, pool, ids) = (self.t, &self.pool, &mut self.ids);
        let nodes = &mut self.nodes;
        match op {
            Op::Create { who, key, large } => {
                let token = if *who == 0 { ALICE } else { BOB };
                let r = t
                    .call(token, "instances.create", json!({ "tenantId": "acme", "poolId": pool, "imageId": "img_ubuntu",
                        "flavor": if *large { "large" } else { "small" }, "sshKeys": [SSH_KEY], "idempotencyKey": format!("k{key}") }))
                    .await;
                if let Ok(i) = &r {
                    ids[*key as usize] = i["id"].as_str().map(str::to_string);
                }
                r.map(|_| ())
            }
            Op::Stop(k) | Op::Start(k) | Op::Delete(k) => {
                let Some(id) = &ids[*k as usize] else { return Ok(()) };
                let method = match op {
                    Op::Stop(_) => "instances.stop",
                    Op::Start(_) => "instances.start",
                    _ => "instances.delete",
                };
                t.call(ALICE, method, acme_instance(id)).await.map(|_| ())
            }
            Op::Resize { key, large } => {
                let Some(id) = &ids[*key as usize] else { return Ok(()) };
                t.call(ALICE, "instances.resize", json!({ "tenantId": "acme", "instanceId": id, "flavor": if *large { "large" } else { "small" } }))
                    .await
                    .map(|_| ())
            }
            Op::Report { node, key, state } => {
                let Some((node_id, token)) = nodes.get(*node as usize % nodes.len()) else { return Ok(()) };
                let instances: Vec<_> = ids[*key as usize].iter().map(|id| json!({ "id": id, "state": state, "message": "from the property test" })).collect();
                t.call(token, "nodes.report", json!({ "nodeId": node_id, "instances": instances, "complete": true })).await.map(|_| ())
            }
            Op::Cordon { node, on } => {
                let (node_id, _) = &nodes[*node as usize % nodes.len()];
                t.call(OPERATOR, if *on { "nodes.cordon" } else { "nodes.uncordon" }, json!({ "nodeId": node_id })).await.map(|_| ())
            }
            Op::Offer { vcpu } => t
                .call(OPERATOR, "pools.offer", json!({ "poolId": pool, "tenantId": "acme", "quota": { "vcpu": vcpu, "memoryGiB": 200, "diskGiB": 2000 } }))
                .await
                .map(|_| ()),
            Op::AddNode => {
                let n = nodes.len();
                nodes.push(t.register_node(pool, &format!("n{n}")).await);
                Ok(())
            }
            Op::ArchiveLarge => {
                let flavors = t.ok(OPERATOR, "flavors.list", json!({ "poolId": pool })).await;
                let large = flavors["items"].as_array().unwrap().iter().find(|f| f["name"] == "large").unwrap()["id"].clone();
                t.call(OPERATOR, "flavors.archive", json!({ "flavorId": large })).await.map(|_| ())
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    #[test]
    fn replaying_the_log_rebuilds_every_projection_exactly(ops in prop::collection::vec(op(), 5..40)) {
        tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap().block_on(run(ops));
    }
}
