//! Projectors against a real database: given a stream's events, the rows they leave.

use std::collections::BTreeMap;

use serde_json::{json, Value};
use sqlx::{PgPool, Row};
use vps_domain::aggregate::Event;
use vps_domain::flavor::FlavorEvent;
use vps_domain::image::ImageEvent;
use vps_domain::instance::{self, AdmissionFacts, AdmissionPool, CreateInstance, PoolKind};
use vps_domain::node::NodeEvent;
use vps_domain::operator::*;
use vps_domain::placement::{NodeCandidate, NodeState};
use vps_domain::pool::PoolEvent;
use vps_domain::provider_account::*;
use vps_domain::resources::{Capacity, QuotaResource, Shape};
use vps_domain::state_table::DesiredState;
use vps_events::{append, ExpectedVersion, Metadata, NewEvent};
use vps_projections::Prior;

async fn fresh() -> PgPool {
    vps_pg::testing::fresh_pool(&vps_events::db::MIGRATOR, 4).await
}

/// Appends `events` to `stream` and applies the inline projectors, as a command would.
async fn project<E: Event>(db: &PgPool, stream: &str, events: &[E]) {
    let mut tx = db.begin().await.unwrap();
    project_in(&mut tx, stream, events).await;
    tx.commit().await.unwrap();
}

/// [`project`] in the caller's transaction, left open.
async fn project_in<E: Event>(tx: &mut sqlx::PgConnection, stream: &str, events: &[E]) {
    project_given(tx, stream, events, Prior::Unknown).await
}

/// [`project_in`], telling the projectors the command's `prior` ([`Prior`]).
async fn project_given<E: Event>(
    tx: &mut sqlx::PgConnection,
    stream: &str,
    events: &[E],
    prior: Prior<'_>,
) {
    let current: Option<i64> =
        sqlx::query_scalar("SELECT max(version) FROM events WHERE stream = $1")
            .bind(stream)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    let expected = current.map_or(ExpectedVersion::NoStream, ExpectedVersion::Exact);
    let new: Vec<NewEvent> = events
        .iter()
        .map(|e| NewEvent {
            id: format!("evt_{}", ulid::Ulid::generate().to_string().to_lowercase()),
            event_type: e.event_type().into(),
            data: e.data(),
            metadata: Metadata::default(),
        })
        .collect();
    let stored = append(&mut *tx, stream, expected, &new).await.unwrap();
    vps_projections::apply_all(&mut *tx, &stored, prior)
        .await
        .unwrap();
}

async fn one<T>(db: &PgPool, sql: &str) -> T
where
    T: for<'r> sqlx::FromRow<'r, sqlx::postgres::PgRow> + Send + Unpin,
{
    sqlx::query_as(sql).fetch_one(db).await.unwrap()
}

fn capacity(vcpu: u32) -> Capacity {
    Capacity {
        vcpu,
        memory_gib: vcpu * 4,
        disk_gib: 100,
        gpus: vec![],
    }
}

fn small() -> Shape {
    Shape {
        vcpu: 2,
        memory_gib: 4,
        disk_gib: 20,
        gpus: None,
    }
}

async fn pool_with_offer(db: &PgPool) {
    let created = PoolCreated {
        pool_id: "pool_1".into(),
        name: "east".into(),
        class: "vps-host".into(),
        runtime: Some("libvirt-kvm".into()),
        provider_account_id: None,
        policy: PoolPolicy::default(),
    };
    let range = IpRangeSet {
        pool_id: "pool_1".into(),
        cidr: "10.0.0.0/29".into(),
        gateway: "10.0.0.1".into(),
    };
    let offered = PoolOffered {
        pool_id: "pool_1".into(),
        tenant_id: "acme".into(),
        quota: BTreeMap::from([("vcpu".into(), 8)]),
    };
    let events = [
        PoolEvent::Created(created),
        PoolEvent::IpRangeSet(range),
        PoolEvent::Offered(offered),
    ];
    project(db, "pool-pool_1", &events).await;
}

#[tokio::test]
async fn pool_events_make_the_pool_row_and_the_offer_makes_quota_rows() {
    let db = fresh().await;
    pool_with_offer(&db).await;
    let renamed = PoolUpdated {
        pool_id: "pool_1".into(),
        name: "west".into(),
        policy: PoolPolicy {
            recreate_on_host_loss: true,
            lost_after_seconds: Some(30),
        },
    };
    project(&db, "pool-pool_1", &[PoolEvent::Updated(renamed)]).await;
    let row = sqlx::query(
        "SELECT name, ip_cidr, ip_gateway, policy, version FROM pools WHERE id = 'pool_1'",
    )
    .fetch_one(&db)
    .await
    .unwrap();
    assert_eq!(row.get::<String, _>(0), "west");
    assert_eq!(row.get::<String, _>(1), "10.0.0.0/29");
    assert_eq!(row.get::<String, _>(2), "10.0.0.1");
    assert_eq!(row.get::<Value, _>(3)["recreateOnHostLoss"], true);
    assert_eq!(row.get::<i64, _>(4), 4);
    let quotas: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT resource, max, used FROM quotas WHERE pool_id = 'pool_1' AND tenant_id = 'acme'",
    )
    .fetch_all(&db)
    .await
    .unwrap();
    assert_eq!(quotas.len(), QuotaResource::ALL.len(), "a row per resource");
    assert!(quotas.contains(&("vcpu".into(), 8, 0)), "{quotas:?}");
    assert!(quotas.contains(&("gpu".into(), 0, 0)), "{quotas:?}");
}

#[tokio::test]
async fn node_events_set_its_state_and_orphans() {
    let db = fresh().await;
    let changed = || NodeStateChanged {
        node_id: "node_1".into(),
    };
    let sql = "SELECT state, orphans FROM nodes WHERE id = 'node_1'";
    register_node(&db).await;
    assert_eq!(one::<(String, Value)>(&db, sql).await.0, "ready");
    project(&db, "node-node_1", &[NodeEvent::Cordoned(changed())]).await;
    assert_eq!(one::<(String, Value)>(&db, sql).await.0, "cordoned");
    project(&db, "node-node_1", &[NodeEvent::Lost(changed())]).await;
    assert_eq!(one::<(String, Value)>(&db, sql).await.0, "lost");
    let orphans = OrphansChanged {
        node_id: "node_1".into(),
        instance_ids: vec!["inst_a".into()],
    };
    let events = [
        NodeEvent::Recovered(changed()),
        NodeEvent::Orphaned(orphans),
    ];
    project(&db, "node-node_1", &events).await;
    let (liveness, orphans) = one::<(String, Value)>(&db, sql).await;
    assert_eq!(liveness, "ready");
    assert_eq!(orphans, json!(["inst_a"]));
}

#[tokio::test]
async fn flavor_and_image_events_make_their_rows() {
    let db = fresh().await;
    let flavor = FlavorCreated {
        flavor_id: "flv_1".into(),
        pool_id: "pool_1".into(),
        name: "small".into(),
        shape: small(),
        offer_id: None,
    };
    let archived = FlavorArchived {
        flavor_id: "flv_1".into(),
    };
    let events = [
        FlavorEvent::Created(flavor),
        FlavorEvent::Archived(archived),
    ];
    project(&db, "flavor-flv_1", &events).await;
    let row: (String, bool) =
        one(&db, "SELECT name, archived FROM flavors WHERE id = 'flv_1'").await;
    assert_eq!(row, ("small".into(), true));

    let image = ImageRegistered {
        image_id: "img_1".into(),
        tenant_id: None,
        url: "https://images.example/a.qcow2".into(),
        sha256: "a".repeat(64),
        format: "qcow2".into(),
        verified: true,
    };
    let deleted = ImageDeleted {
        image_id: "img_1".into(),
    };
    let events = [
        ImageEvent::Registered(image.clone()),
        ImageEvent::Deleted(deleted),
    ];
    project(&db, "image-img_1", &events).await;
    let sql = "SELECT deleted, version FROM images WHERE id = 'img_1'";
    assert_eq!(one::<(bool, i64)>(&db, sql).await, (true, 2));
    project(&db, "image-img_1", &[ImageEvent::Registered(image)]).await;
    assert_eq!(
        one::<(bool, i64)>(&db, sql).await,
        (false, 3),
        "registered again"
    );
}

#[tokio::test]
async fn provider_account_events_keep_the_last_error() {
    let db = fresh().await;
    let created = ProviderAccountCreated {
        account_id: "pacct_1".into(),
        name: "cloud".into(),
        provider: "emulator".into(),
        config: json!({ "endpoint": "http://127.0.0.1:1" }),
        secret_ref: Some("secret://pacct_1".into()),
    };
    let error = ProviderAccountErrorRecorded {
        account_id: "pacct_1".into(),
        code: "INVALID_CONFIG".into(),
        message: "bad token".into(),
    };
    let events = [
        ProviderAccountEvent::Created(created),
        ProviderAccountEvent::ErrorRecorded(error),
    ];
    project(&db, "provider_account-pacct_1", &events).await;
    let sql = "SELECT last_error FROM provider_accounts WHERE id = 'pacct_1'";
    let (last,): (Option<Value>,) = one(&db, sql).await;
    assert_eq!(last.unwrap()["code"], "INVALID_CONFIG");
    let cleared = ProviderAccountErrorCleared {
        account_id: "pacct_1".into(),
    };
    let events = [ProviderAccountEvent::ErrorCleared(cleared)];
    project(&db, "provider_account-pacct_1", &events).await;
    let (last,): (Option<Value>,) = one(&db, sql).await;
    assert!(last.is_none());
}

fn admission_facts() -> AdmissionFacts {
    AdmissionFacts {
        pool: Some(AdmissionPool {
            kind: PoolKind::Hosted,
            runtime: "libvirt-kvm".into(),
            has_account: false,
            has_range: true,
        }),
        shape: Some(small()),
        image_visible: true,
        quota_max: QuotaResource::ALL.into_iter().map(|r| (r, 100)).collect(),
        nodes: vec![NodeCandidate {
            id: "node_1".into(),
            state: NodeState::Ready,
            runtimes: vec!["libvirt-kvm".into()],
            labels: BTreeMap::new(),
            capacity: capacity(16),
            allocated: Capacity::default(),
        }],
        free_address: Some("10.0.0.2".parse().unwrap()),
        ..AdmissionFacts::default()
    }
}

fn create(id: &str) -> CreateInstance {
    CreateInstance {
        id: id.into(),
        tenant_id: "acme".into(),
        pool_id: "pool_1".into(),
        pool_kind: PoolKind::Hosted,
        flavor: "small".into(),
        shape: small(),
        image_id: "img_1".into(),
        ssh_keys: vec![],
        user_data_ref: None,
        project_id: None,
        desired_state: DesiredState::Running,
        owner_identity_id: "id_alice".into(),
        idempotency_key: "k1".into(),
        request_hash: "h".into(),
        sandbox_id: None,
        warm_template_id: None,
        template_version: None,
        network_policy: None,
        network_rules: Default::default(),
        restore_from: None,
        volumes: Vec::new(),
        labels: Default::default(),
    }
}

#[tokio::test]
async fn an_admitted_instance_books_its_view_allocation_lease_and_quota() {
    let db = fresh().await;
    pool_with_offer(&db).await;
    register_node(&db).await;
    let id = vps_domain::ids::instance_id(vps_domain::ids::Origin {
        tenant: "acme",
        caller: "id_alice",
        key: "k1",
    });
    let decided = instance::admit(
        &admission_facts(),
        create(&id),
        "alloc_1",
        vps_clock::Clock::system().now(),
        &instance::authorized_before,
    );
    let Ok(instance::Admission::Admit(events)) = decided else {
        panic!("admitted: {decided:?}");
    };
    project(&db, &format!("instance-{id}"), &events).await;
    let sql = format!("SELECT state, node_id FROM instances WHERE id = '{id}'");
    let (state, node): (String, Option<String>) = one(&db, &sql).await;
    assert_eq!(state, "provisioning");
    assert_eq!(node.as_deref(), Some("node_1"));
    let sql = format!("SELECT address FROM ip_leases WHERE instance_id = '{id}'");
    assert_eq!(one::<(String,)>(&db, &sql).await.0, "10.0.0.2");
    let sql = "SELECT vcpu::bigint FROM node_allocations WHERE node_id = 'node_1'";
    assert_eq!(one::<(i64,)>(&db, sql).await.0, 2);
    let sql =
        "SELECT booked_vcpu, booked_memory_gib, booked_disk_gib FROM nodes WHERE id = 'node_1'";
    assert_eq!(
        one::<(i64, i64, i64)>(&db, sql).await,
        (2, 4, 20),
        "the node's sums"
    );
    let sql = "SELECT used FROM quotas WHERE pool_id = 'pool_1' AND resource = 'vcpu'";
    assert_eq!(one::<(i64,)>(&db, sql).await.0, 2);
}

async fn register_node(db: &PgPool) {
    let registered = NodeRegistered {
        node_id: "node_1".into(),
        pool_id: "pool_1".into(),
        name: "h1".into(),
        capacity: capacity(16),
        labels: BTreeMap::new(),
        runtimes: vec!["libvirt-kvm".into()],
        cpu_model: None,
    };
    project(db, "node-node_1", &[NodeEvent::Registered(registered)]).await;
}

/// The instance's view after `command`, as the events it decides.
async fn decided(
    db: &PgPool,
    id: &str,
    command: instance::InstanceCommand,
) -> Vec<instance::InstanceEvent> {
    let mut conn = db.acquire().await.unwrap();
    let view = vps_projections::instances::load(&mut conn, id)
        .await
        .unwrap()
        .unwrap();
    instance::decide(Some(&view), &command, vps_clock::Clock::system().now()).unwrap()
}

async fn spec_entry_desired_state(db: &PgPool, id: &str) -> String {
    let sql =
        format!("SELECT entry->>'desiredState' FROM node_spec_entries WHERE instance_id = '{id}'");
    one::<(String,)>(db, &sql).await.0
}

/// A fresh database with one admitted instance: its id and stream.
async fn one_admitted() -> (PgPool, String, String) {
    let db = fresh().await;
    pool_with_offer(&db).await;
    let id = vps_domain::ids::instance_id(vps_domain::ids::Origin {
        tenant: "acme",
        caller: "id_alice",
        key: "k1",
    });
    let stream = format!("instance-{id}");
    let Ok(instance::Admission::Admit(events)) = instance::admit(
        &admission_facts(),
        create(&id),
        "alloc_1",
        vps_clock::Clock::system().now(),
        &instance::authorized_before,
    ) else {
        panic!("admitted");
    };
    project(&db, &stream, &events).await;
    (db, id, stream)
}

/// An entry a command wrote inline is never overwritten by a NodeSpec pass that read the
/// views before that command committed: the pass waits for the node's spec row first.
#[tokio::test]
async fn a_spec_pass_never_writes_back_an_entry_older_than_one_written_inline() {
    use vps_domain::instance::{InstanceCommand, Requester};
    let (db, id, stream) = one_admitted().await;
    let notifier = vps_events::Notifier::local_only();
    let name = vps_projections::node_specs::FOLLOWER;
    let mut follower = vps_events::Follower::load(db.clone(), name, &notifier)
        .await
        .unwrap();
    // Passes until the admission is projected: the read horizon is the whole server's, so
    // other tests' open transactions may hold its events back for a moment.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let batch = follower.next_batch(100).await.unwrap();
        vps_projections::node_specs::apply_batch(
            &mut db.acquire().await.unwrap(),
            &mut follower,
            &batch,
        )
        .await
        .unwrap();
        let sql = format!("SELECT count(*) FROM node_spec_entries WHERE instance_id = '{id}'");
        if one::<(i64,)>(&db, &sql).await.0 == 1 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the admission never projected"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    assert_eq!(spec_entry_desired_state(&db, &id).await, "running");

    // A stop the follower has not passed yet, then a delete whose command writes the entry
    // inline and has not committed when the pass over the stop begins.
    let stop = InstanceCommand::Stop {
        requester: Requester::System,
    };
    project(&db, &stream, &decided(&db, &id, stop).await).await;
    let delete = InstanceCommand::Delete {
        requester: Requester::System,
        reason: None,
    };
    let delete = decided(&db, &id, delete).await;
    let mut tx = db.begin().await.unwrap();
    project_in(&mut tx, &stream, &delete).await;
    let moved = vps_projections::node_specs::write_inline(&mut tx, &id)
        .await
        .unwrap();
    assert_eq!(
        moved.len(),
        1,
        "the inline write moved the node's generation"
    );

    let batch = readable_batch(&mut follower, 1).await;
    assert_eq!(batch.len(), 1, "the pass sees the stop alone");
    let pass = tokio::spawn({
        let db = db.clone();
        async move {
            vps_projections::node_specs::apply_batch(
                &mut db.acquire().await.unwrap(),
                &mut follower,
                &batch,
            )
            .await
            .unwrap()
        }
    });
    // The pass must be waiting on a lock before the delete commits.
    lock_waiter(&db).await;
    tx.commit().await.unwrap();
    pass.await.unwrap();
    assert_eq!(spec_entry_desired_state(&db, &id).await, "deleted");
}

/// The next `n` events once they are readable (see above).
async fn readable_batch(
    follower: &mut vps_events::Follower,
    n: usize,
) -> Vec<vps_events::RecordedEvent> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let batch = follower.next_batch(100).await.unwrap();
        if batch.len() >= n {
            return batch;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} of {n} events readable",
            batch.len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// Waits (at most 10 s) until some session of the database waits on a lock.
async fn lock_waiter(db: &PgPool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let waiting: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                             WHERE datname = current_database() AND wait_event_type = 'Lock')",
        )
        .fetch_one(db)
        .await
        .unwrap();
        if waiting {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing waits on a lock"
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
}

/// A command's prior spares the projector reading the view only when it is that stream's
/// state right before the events (same instance, next version); any other prior is ignored
/// and the view read.
#[tokio::test]
async fn a_projector_takes_the_commands_prior_only_for_the_next_version_of_its_own_stream() {
    use instance::{InstanceCommand, Requester};
    let (db, id, stream) = one_admitted().await;
    // A prior carries a marker: the view shows it only if the projector folded on the prior.
    let cases = [
        ("a stale prior", -1, id.as_str(), None),
        ("another instance's prior", 0, "inst_other", None),
        (
            "the prior of the next version",
            0,
            id.as_str(),
            Some("marker"),
        ),
    ];
    for (case, version_offset, prior_id, expected) in cases {
        let mut conn = db.acquire().await.unwrap();
        let view = vps_projections::instances::load(&mut conn, &id)
            .await
            .unwrap()
            .unwrap();
        drop(conn);
        let prior = instance::Instance {
            id: prior_id.into(),
            project_id: Some("marker".into()),
            version: view.version.checked_add_signed(version_offset).unwrap(),
            ..view.clone()
        };
        let requester = Requester::System;
        let command = match view.desired_state {
            DesiredState::Stopped => InstanceCommand::Start { requester },
            _ => InstanceCommand::Stop { requester },
        };
        let events = decided(&db, &id, command).await;
        let mut tx = db.begin().await.unwrap();
        project_given(&mut tx, &stream, &events, Prior::Instance(&prior)).await;
        tx.commit().await.unwrap();
        let sql = format!("SELECT doc->>'projectId' FROM instances WHERE id = '{id}'");
        let shown = one::<(Option<String>,)>(&db, &sql).await.0;
        assert_eq!(shown.as_deref(), expected, "{case}");
    }
}

/// A usage record the metering reactor appended and has not projected yet (it projects in a
/// transaction of its own, with its settled mark) leaves the usage tables uncompared, not
/// different; once projected and marked settled they compare equal.
#[tokio::test]
async fn a_replay_skips_usage_records_logged_ahead_of_their_projection() {
    let db = fresh().await;
    let record = vps_domain::usage::UsageRecord::from_data(&json!({
        "meter": "vps.vcpu.hours", "quantity": "0.5", "unit": "vcpu-hour",
        "windowStart": "2026-12-01T10:00:00Z", "windowEnd": "2026-12-01T10:30:00Z",
        "tenantId": "acme", "resourceId": "inst_a", "poolId": "pool_a"
    }))
    .unwrap();
    let event = NewEvent {
        id: record.event_id(),
        event_type: vps_domain::usage::record::EVENT_TYPE.into(),
        data: record.data(),
        metadata: Metadata::default(),
    };
    let mut conn = db.acquire().await.unwrap();
    vps_events::append_unseen(&mut conn, &record.stream(), std::slice::from_ref(&event))
        .await
        .unwrap();

    let report = vps_projections::replay::verify(&db, |_| {}).await.unwrap();
    let usage = |skipped: &[String]| -> Vec<String> {
        skipped
            .iter()
            .filter(|t| t.starts_with("usage_"))
            .cloned()
            .collect()
    };
    assert_eq!(report.diffs, vec![]);
    assert_eq!(usage(&report.skipped), ["usage_records", "usage_rollups"]);

    vps_projections::usage::apply_records(&mut conn, &[(event.id, &record)])
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO usage_progress (name, settled_until, window_micros)
         VALUES ('usage', '2026-12-01T11:00:00Z', 3600000000)",
    )
    .execute(&mut *conn)
    .await
    .unwrap();
    let report = vps_projections::replay::verify(&db, |_| {}).await.unwrap();
    assert_eq!(report.diffs, vec![]);
    assert_eq!(usage(&report.skipped), Vec::<String>::new());
}

/// One instance event of `id` in pool_1 for acme, with `state` and `extra` fields.
fn instance_event(
    id: &str,
    event_type: &str,
    state: &str,
    extra: Value,
) -> instance::InstanceEvent {
    let mut data = json!({ "instanceId": id, "tenantId": "acme", "poolId": "pool_1",
                           "state": state, "desiredState": "running" });
    for (k, v) in extra.as_object().unwrap() {
        data[k] = v.clone();
    }
    instance::InstanceEvent::from_parts(event_type, data).unwrap()
}

/// A replay folds instance, sandbox and usage-record events in memory and writes their rows
/// in batches; on a log with address reuse, an address outside the range, recreates, resizes
/// and deletes before and after another projector's event (which writes the batches first),
/// its rows equal the event-by-event projection's. A row changed behind the projectors is
/// named.
#[tokio::test]
async fn a_batched_replay_equals_the_event_by_event_projection_and_names_a_tampered_row() {
    let db = fresh().await;
    pool_with_offer(&db).await;
    register_node(&db).await;
    let shape = |vcpu: u32| json!({ "vcpu": vcpu, "memoryGiB": 1, "diskGiB": 1 });
    let created = |id: &str| {
        instance_event(
            id,
            "instance.created",
            "scheduling",
            json!({ "poolKind": "hosted", "flavor": "small", "shape": shape(1),
                    "imageId": "img_1", "sshKeys": [], "ownerIdentityId": "id_alice",
                    "idempotencyKey": id, "requestHash": "0" }),
        )
    };
    let scheduled = |id: &str, address: &str| {
        instance_event(
            id,
            "instance.scheduled",
            "provisioning",
            json!({ "nodeId": "node_1", "allocationId": format!("alloc_{id}"),
                    "address": address }),
        )
    };
    let plain =
        |id: &str, event_type: &str, state: &str| instance_event(id, event_type, state, json!({}));
    let resized = |id: &str, from: u32, to: u32| {
        instance_event(
            id,
            "instance.resized",
            "stopped",
            json!({ "flavor": "large", "shape": shape(to), "previousFlavor": "small",
                    "previousShape": shape(from) }),
        )
    };
    let recreating = |id: &str| {
        instance_event(
            id,
            "instance.recreating",
            "scheduling",
            json!({ "reason": "host-lost", "fromNodeId": "node_1" }),
        )
    };
    let cordon = || {
        NodeEvent::Cordoned(NodeStateChanged {
            node_id: "node_1".into(),
        })
    };
    let steps: Vec<(&str, instance::InstanceEvent)> = vec![
        ("a", created("inst_a")),
        ("b", created("inst_b")),
        ("a", scheduled("inst_a", "10.0.0.2")),
        ("b", scheduled("inst_b", "10.0.0.3")),
        ("c", created("inst_c")),
        ("c", scheduled("inst_c", "10.0.0.9")),
        ("d", created("inst_d")),
        ("a", plain("inst_a", "instance.running", "running")),
        ("a", resized("inst_a", 1, 2)),
        ("a", plain("inst_a", "instance.deleted", "deleted")),
        ("b", recreating("inst_b")),
        ("b", scheduled("inst_b", "10.0.0.2")),
        ("c", plain("inst_c", "instance.deleted", "deleted")),
        ("d", plain("inst_d", "instance.deleted", "deleted")),
        ("e", created("inst_e")),
        ("e", scheduled("inst_e", "10.0.0.3")),
        ("cordon", plain("inst_b", "instance.running", "running")),
        // After another projector's event: what b and e hold was written before it.
        ("e", resized("inst_e", 1, 4)),
        ("b", recreating("inst_b")),
        ("f", created("inst_f")),
        ("f", scheduled("inst_f", "10.0.0.2")),
        ("e", plain("inst_e", "instance.deleted", "deleted")),
        ("b", scheduled("inst_b", "10.0.0.3")),
        ("f", resized("inst_f", 1, 3)),
        ("f", recreating("inst_f")),
    ];
    for (who, event) in steps {
        if who == "cordon" {
            project(&db, "node-node_1", &[cordon()]).await;
            continue;
        }
        let stream = format!("instance-inst_{who}");
        project(&db, &stream, std::slice::from_ref(&event)).await;
    }
    let record = vps_domain::usage::UsageRecord::from_data(&json!({
        "meter": "vps.vcpu.hours", "quantity": "0.5", "unit": "vcpu-hour",
        "windowStart": "2026-12-01T10:00:00Z", "windowEnd": "2026-12-01T10:30:00Z",
        "tenantId": "acme", "resourceId": "inst_a", "poolId": "pool_1"
    }))
    .unwrap();
    let event = NewEvent {
        id: record.event_id(),
        event_type: vps_domain::usage::record::EVENT_TYPE.into(),
        data: record.data(),
        metadata: Metadata::default(),
    };
    let mut conn = db.acquire().await.unwrap();
    vps_events::append_unseen(&mut conn, &record.stream(), std::slice::from_ref(&event))
        .await
        .unwrap();
    vps_projections::usage::apply_records(&mut conn, &[(event.id, &record)])
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO usage_progress (name, settled_until, window_micros)
         VALUES ('usage', '2026-12-01T11:00:00Z', 3600000000)",
    )
    .execute(&mut *conn)
    .await
    .unwrap();

    let report = vps_projections::replay::verify(&db, |_| {}).await.unwrap();
    assert_eq!(report.diffs, vec![]);
    assert!(
        report.hashes.contains_key("instances"),
        "{:?}",
        report.hashes
    );
    assert!(report.hashes.contains_key("ip_free"));
    assert!(report.hashes.contains_key("usage_rollups"));

    sqlx::query("UPDATE quotas SET used = used + 1 WHERE resource = 'vcpu'")
        .execute(&db)
        .await
        .unwrap();
    let report = vps_projections::replay::verify(&db, |_| {}).await.unwrap();
    let tables: Vec<&str> = report.diffs.iter().map(|d| d.table.as_str()).collect();
    assert_eq!(tables, ["quotas"]);
    assert_eq!(report.diffs[0].only_live.len(), 1);
}
