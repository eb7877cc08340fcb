//! Property: address leasing under concurrency. Whatever mix of concurrent creates (fresh and
//! repeated idempotency keys) and deletes runs against a small range, the pool's addresses are
//! accounted for exactly, and a create is refused only for want of addresses or quota.
//!
//! Each case starts a server, a hosted pool with a /28 (13 leasable addresses) or a /27 (29),
//! a random vCPU quota of 3 to 32 small instances (so addresses are the scarce resource in some
//! cases and the quota in others), and enough nodes that placement always fits: node capacity
//! is never what refuses. Every node has an emulated host attached (`TestServer::host`), so a
//! delete runs to completion: the host destroys the domain, reports it gone, the instance
//! becomes `deleted` and its address goes back to the free list, which the next round leases
//! again. Each round fires 1–24 concurrent `instances.create` (a quarter of them repeat a key
//! already used, in an earlier round or the same one) together with `instances.delete` of
//! random live instances, then waits (on conditions) until every delete asked for is
//! `deleted`.
//!
//! The invariant, read in one snapshot of the database (`REPEATABLE READ`) while each round
//! is in flight, after it, and at the end:
//! - the leases are exactly the placed, not-`deleted` instances (`node_id` set, `state <>
//!   'deleted'`), each holding one lease, its first address. A `deleting` instance keeps its
//!   lease: the projector (`projections/src/instances.rs`) releases it only on
//!   `instance.deleted` and `instance.recreating`;
//! - no address is leased twice, and none is the network, broadcast or gateway address;
//! - `ip_leases` and `ip_free` are disjoint, and together exactly
//!   `vps_domain::ipam::leasable_addresses` of the range;
//! - every node's booked sums (`nodes.booked_*`, which placement reads) are the sums of its
//!   allocations.
//!
//! And of the answers: a refusal is only `CAPACITY_UNAVAILABLE` (resource `ipv4`) or
//! `QUOTA_EXCEEDED` (resource `vcpu`), never a 5xx; a key that created an instance answers that
//! same instance ever after; every delete succeeds. In a round with no delete (so nothing is
//! released while it runs, and free addresses and quota only shrink) a refusal is never
//! spurious: after an `ipv4` refusal the free list is empty, after a quota refusal another
//! small instance does not fit the quota. At the end, once every instance is `running` or
//! `deleted` and the hosts are stopped (so no report lands during the replay), replaying the
//! log rebuilds every projection exactly.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;

use futures::future::join_all;
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use vps_domain::ipam::{leasable_addresses, Ipv4Cidr};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_instance, eventually, Answer, TestServer, ALICE, PATIENCE, SSH_KEY};

/// vCPU of the `small` flavor every create asks for.
const SMALL_VCPU: i64 = 2;
/// How long an emulated host takes to boot a domain.
const BOOT: std::time::Duration = std::time::Duration::from_millis(50);

#[derive(Debug, Clone)]
struct Case {
    cidr: &'static str,
    /// The quota, in small instances.
    quota: u32,
    rounds: Vec<Round>,
}

#[derive(Debug, Clone)]
struct Round {
    /// One create each: a fresh key (`None`) or a key already used (`Some`).
    creates: Vec<Option<Index>>,
    /// Live instances (at the round's start) to delete.
    deletes: Vec<Index>,
}

fn round() -> impl Strategy<Value = Round> {
    let deletes = prop_oneof![
        Just(Vec::new()),
        prop::collection::vec(any::<Index>(), 1..=6)
    ];
    (
        prop::collection::vec(prop::option::weighted(0.25, any::<Index>()), 1..=24),
        deletes,
    )
        .prop_map(|(creates, deletes)| Round { creates, deletes })
}

fn case() -> impl Strategy<Value = Case> {
    (
        prop::sample::select(vec!["10.0.0.0/28", "10.0.0.0/27"]),
        3..=32u32,
        prop::collection::vec(round(), 2..=4),
    )
        .prop_map(|(cidr, quota, rounds)| Case {
            cidr,
            quota,
            rounds,
        })
}

/// What one round's answers came to.
#[derive(Debug, Default)]
struct Tally {
    created: usize,
    ipv4_refusals: usize,
    quota_refusals: usize,
    deletes: usize,
}

/// The server, the pool, its hosts, and what the test knows of the instances.
struct World<'a> {
    t: &'a TestServer,
    pool: String,
    hosts: Vec<HostHandle>,
    /// Every idempotency key used so far, in order.
    keys: Vec<String>,
    /// The instance each key created.
    ids: BTreeMap<String, String>,
    /// Instances created and not asked to be deleted.
    live: BTreeSet<String>,
    /// Instances asked to be deleted.
    deleted: BTreeSet<String>,
}

async fn run(case: Case) {
    let t = TestServer::start().await;
    let quota = SMALL_VCPU * i64::from(case.quota);
    let pool = t
        .hosted_pool(
            case.cidr,
            0,
            json!({ "vcpu": quota, "memoryGiB": 10000, "diskGiB": 100000 }),
        )
        .await;
    let mut world = World {
        t: &t,
        pool,
        hosts: Vec::new(),
        keys: Vec::new(),
        ids: BTreeMap::new(),
        live: BTreeSet::new(),
        deleted: BTreeSet::new(),
    };
    world.attach_hosts(case.cidr).await;
    for round in &case.rounds {
        let tally = world.play(round).await;
        world.deletes_done().await;
        check_leases(&t, &world.pool).await;
        if tally.deletes == 0 {
            check_refusals_not_spurious(&t, &world.pool, &tally).await;
        }
    }
    // Let every instance come to rest, then silence the hosts, so no report lands while the
    // log is replayed.
    world.settled().await;
    for host in world.hosts.drain(..) {
        host.stop().await;
    }
    t.quiescent().await;
    check_leases(&t, &world.pool).await;
    assert!(t.replay_equal().await, "replay differs from live");
    t.server.shutdown().await;
}

impl World<'_> {
    /// Registers enough 16-vCPU nodes that every address of the range fits on them (eight
    /// small instances a node), each with an emulated host.
    async fn attach_hosts(&mut self, cidr: &str) {
        let leasable = Ipv4Cidr::parse(cidr).unwrap().leasable() as i64;
        let per_node = 16 / SMALL_VCPU;
        let nodes = (leasable + per_node - 1) / per_node;
        for n in 0..nodes {
            let (node, token) = self.t.register_node(&self.pool, &format!("n{n}")).await;
            self.hosts.push(self.t.host(&node, &token, BOOT));
        }
    }

    /// The key of each create of `round`: fresh, or one already used (earlier in this round
    /// too).
    fn keys_for(&mut self, round: &Round) -> Vec<String> {
        let mut keys = Vec::with_capacity(round.creates.len());
        for pick in &round.creates {
            let key = match pick {
                Some(i) if !self.keys.is_empty() => self.keys[i.index(self.keys.len())].clone(),
                _ => {
                    let key = format!("k{}", self.keys.len());
                    self.keys.push(key.clone());
                    key
                }
            };
            keys.push(key);
        }
        keys
    }

    /// Fires the round's creates and deletes at once (checking the invariant while they run)
    /// and judges every answer.
    async fn play(&mut self, round: &Round) -> Tally {
        let keys = self.keys_for(round);
        let live: Vec<String> = self.live.iter().cloned().collect();
        let doomed: BTreeSet<String> = match live.is_empty() {
            true => BTreeSet::new(),
            false => round
                .deletes
                .iter()
                .map(|i| live[i.index(live.len())].clone())
                .collect(),
        };
        let (t, pool) = (self.t, self.pool.as_str());
        let creates = join_all(
            keys.iter()
                .map(|key| t.call(ALICE, "instances.create", create_body(pool, key))),
        );
        let deletes = join_all(
            doomed
                .iter()
                .map(|id| t.call(ALICE, "instances.delete", acme_instance(id))),
        );
        let (created, deleted, ()) = tokio::join!(creates, deletes, check_leases(t, pool));
        let mut tally = self.judge_creates(&keys, created);
        for (id, answer) in doomed.iter().zip(deleted) {
            if let Err(a) = answer {
                panic!("deleting {id} answered {} {}", a.status, a.body);
            }
            self.live.remove(id);
            self.deleted.insert(id.clone());
            tally.deletes += 1;
        }
        tally
    }

    /// Checks each create's answer against its key's history and records what it created.
    fn judge_creates(&mut self, keys: &[String], answers: Vec<Result<Value, Answer>>) -> Tally {
        let known_before: BTreeSet<String> = self.ids.keys().cloned().collect();
        let mut tally = Tally::default();
        for (key, answer) in keys.iter().zip(answers) {
            let inst = match answer {
                Ok(inst) => inst,
                Err(a) => {
                    assert!(
                        !known_before.contains(key),
                        "key {key} created {} before, yet a repeat answered {} {}",
                        self.ids[key],
                        a.status,
                        a.body
                    );
                    match refusal(&a) {
                        Refusal::Ipv4 => tally.ipv4_refusals += 1,
                        Refusal::Quota => tally.quota_refusals += 1,
                    }
                    continue;
                }
            };
            let id = inst["id"].as_str().expect("an id").to_string();
            let first = self.ids.entry(key.clone()).or_insert_with(|| id.clone());
            assert_eq!(*first, id, "key {key} answered two different instances");
            if !self.deleted.contains(&id) {
                self.live.insert(id);
            }
            tally.created += 1;
        }
        tally
    }

    /// Waits until every instance asked to be deleted is `deleted` (its host reported it
    /// gone), so its address is back on the free list.
    async fn deletes_done(&self) {
        let ids: Vec<String> = self.deleted.iter().cloned().collect();
        eventually("every delete asked for done", PATIENCE, || async {
            let left: Vec<(String, String)> = sqlx::query_as(
                "SELECT id, state FROM instances WHERE id = ANY($1) AND state <> 'deleted'",
            )
            .bind(&ids)
            .fetch_all(&self.t.server.state.pool)
            .await
            .unwrap();
            if left.is_empty() {
                Ok(())
            } else {
                Err(left)
            }
        })
        .await;
    }
}

impl World<'_> {
    /// Waits until every instance of the pool is `running` or `deleted`: nothing is left for
    /// its host to do.
    async fn settled(&self) {
        eventually("every instance running or deleted", PATIENCE, || async {
            let busy: Vec<(String, String)> = sqlx::query_as(
                "SELECT id, state FROM instances
                  WHERE pool_id = $1 AND state NOT IN ('running', 'deleted')",
            )
            .bind(&self.pool)
            .fetch_all(&self.t.server.state.pool)
            .await
            .unwrap();
            if busy.is_empty() {
                Ok(())
            } else {
                Err(busy)
            }
        })
        .await;
    }
}

fn create_body(pool: &str, key: &str) -> Value {
    json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_ubuntu",
            "sshKeys": [SSH_KEY], "idempotencyKey": key })
}

enum Refusal {
    Ipv4,
    Quota,
}

/// The kind of an allowed refusal; any other answer fails the test.
fn refusal(a: &Answer) -> Refusal {
    let code = a.body["code"].as_str();
    let resource = a.body["details"]["resource"].as_str();
    match (a.status, code, resource) {
        (503, Some("CAPACITY_UNAVAILABLE"), Some("ipv4")) => Refusal::Ipv4,
        (422, Some("QUOTA_EXCEEDED"), Some("vcpu")) => Refusal::Quota,
        _ => panic!("a create was refused with {} {}", a.status, a.body),
    }
}

/// The pool's leases, free list, lease holders and range, read in one snapshot.
struct Snapshot {
    /// (address, instance) of every lease.
    leases: Vec<(String, String)>,
    free: Vec<String>,
    /// (instance, first address) of every placed instance that is not `deleted`.
    holders: Vec<(String, Option<String>)>,
    /// Nodes whose booked sums are not the sums of their allocations: `(node, booked, summed)`.
    misbooked: Vec<(String, Vec<i64>, Vec<i64>)>,
    cidr: Ipv4Cidr,
    gateway: Ipv4Addr,
}

async fn snapshot(t: &TestServer, pool: &str) -> Snapshot {
    let mut tx = t.server.state.pool.begin().await.unwrap();
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        .execute(&mut *tx)
        .await
        .unwrap();
    let leases = sqlx::query_as("SELECT address, instance_id FROM ip_leases WHERE pool_id = $1")
        .bind(pool)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let free = sqlx::query_scalar("SELECT address FROM ip_free WHERE pool_id = $1")
        .bind(pool)
        .fetch_all(&mut *tx)
        .await
        .unwrap();
    let holders = sqlx::query_as(
        "SELECT id, doc->'addresses'->>0 FROM instances
          WHERE pool_id = $1 AND node_id IS NOT NULL AND state <> 'deleted'",
    )
    .bind(pool)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    let misbooked = sqlx::query_as(
        "SELECT id, booked, summed FROM (
             SELECT n.id, ARRAY[n.booked_vcpu, n.booked_memory_gib, n.booked_disk_gib] AS booked,
                    ARRAY[coalesce(sum(a.vcpu), 0), coalesce(sum(a.memory_gib), 0),
                          coalesce(sum(a.disk_gib), 0)]::bigint[] AS summed
               FROM nodes n LEFT JOIN node_allocations a ON a.node_id = n.id
              WHERE n.pool_id = $1
              GROUP BY n.id) sums
          WHERE booked <> summed",
    )
    .bind(pool)
    .fetch_all(&mut *tx)
    .await
    .unwrap();
    let (cidr, gateway): (String, Option<String>) =
        sqlx::query_as("SELECT ip_cidr, ip_gateway FROM pools WHERE id = $1")
            .bind(pool)
            .fetch_one(&mut *tx)
            .await
            .unwrap();
    tx.commit().await.unwrap();
    let cidr = Ipv4Cidr::parse(&cidr).unwrap();
    let gateway = gateway
        .and_then(|g| g.parse().ok())
        .unwrap_or(cidr.default_gateway());
    Snapshot {
        leases,
        free,
        holders,
        misbooked,
        cidr,
        gateway,
    }
}

/// The invariant of the header, on one snapshot of the database.
async fn check_leases(t: &TestServer, pool: &str) {
    let s = snapshot(t, pool).await;
    let ip = |a: &String| -> Ipv4Addr { a.parse().expect("an IPv4 address") };
    let leased: BTreeSet<Ipv4Addr> = s.leases.iter().map(|(a, _)| ip(a)).collect();
    assert_eq!(
        leased.len(),
        s.leases.len(),
        "an address leased twice: {:?}",
        s.leases
    );
    for a in &leased {
        assert!(
            s.cidr.is_host(*a) && *a != s.gateway,
            "{a} leased: not a leasable address of {}",
            s.cidr
        );
    }
    let by_instance: BTreeMap<String, Ipv4Addr> =
        s.leases.iter().map(|(a, i)| (i.clone(), ip(a))).collect();
    assert_eq!(
        by_instance.len(),
        s.leases.len(),
        "an instance with two leases: {:?}",
        s.leases
    );
    let holders: BTreeMap<String, Ipv4Addr> = s
        .holders
        .iter()
        .map(|(i, a)| {
            let a = a
                .as_ref()
                .unwrap_or_else(|| panic!("placed {i} has no address"));
            (i.clone(), ip(a))
        })
        .collect();
    assert_eq!(
        by_instance, holders,
        "the leases (left) are not the placed, not-deleted instances' first addresses (right)"
    );
    let free: BTreeSet<Ipv4Addr> = s.free.iter().map(ip).collect();
    assert!(
        free.is_disjoint(&leased),
        "leased yet free: {:?}",
        free.intersection(&leased).collect::<Vec<_>>()
    );
    let leasable: BTreeSet<Ipv4Addr> = leasable_addresses(&s.cidr, s.gateway).collect();
    let accounted: BTreeSet<Ipv4Addr> = free.union(&leased).copied().collect();
    assert_eq!(
        accounted, leasable,
        "leases and free list together (left) are not the leasable range (right)"
    );
    assert!(
        s.misbooked.is_empty(),
        "booked sums (vCPU, memory, disk) that are not the allocations' sums: {:?}",
        s.misbooked
    );
}

/// In a round that released nothing, free addresses and quota only shrank while it ran: a
/// refusal for either must still hold at its end.
async fn check_refusals_not_spurious(t: &TestServer, pool: &str, tally: &Tally) {
    let db = &t.server.state.pool;
    if tally.ipv4_refusals > 0 {
        let free: i64 = sqlx::query_scalar("SELECT count(*) FROM ip_free WHERE pool_id = $1")
            .bind(pool)
            .fetch_one(db)
            .await
            .unwrap();
        assert_eq!(free, 0, "{tally:?}: refused for ipv4 with addresses free");
    }
    if tally.quota_refusals > 0 {
        let (used, max): (i64, i64) = sqlx::query_as(
            "SELECT used, max FROM quotas WHERE pool_id = $1 AND tenant_id = 'acme' AND resource = 'vcpu'",
        )
        .bind(pool)
        .fetch_one(db)
        .await
        .unwrap();
        assert!(
            used + SMALL_VCPU > max,
            "{tally:?}: refused for quota with {used} of {max} vCPU used"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 6, ..ProptestConfig::default() })]

    #[test]
    fn concurrent_creates_and_deletes_account_for_every_address(case in case()) {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
            .block_on(run(case));
    }
}
