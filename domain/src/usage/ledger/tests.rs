//! Given instance events, when windows are settled, then these records.

use chrono::{DateTime, Utc};
use rust_decimal::Decimal;
use serde_json::{json, Value};

use super::*;
use crate::usage::meter::{MEMORY_GIB_HOURS, SANDBOX_WARM, VCPU_HOURS};

const W: Micros = 300_000_000;
const T0: Micros = 1_800_000_000_000_000 - 1_800_000_000_000_000 % W;

fn time(us: Micros) -> DateTime<Utc> {
    at(us)
}

fn shape(vcpu: u32, memory: u32) -> Value {
    json!({ "vcpu": vcpu, "memoryGiB": memory, "diskGiB": 20 })
}

fn common(extra: Value) -> Value {
    let mut data = json!({
        "instanceId": "inst_a", "tenantId": "acme", "poolId": "pool_h",
        "state": "running", "desiredState": "running",
    });
    for (k, v) in extra.as_object().unwrap() {
        data[k] = v.clone();
    }
    data
}

struct Given {
    ledger: Ledger,
}

fn given() -> Given {
    Given {
        ledger: Ledger::new(Windows::new(W).unwrap()),
    }
}

impl Given {
    fn event(mut self, event_type: &str, at: Micros, extra: Value) -> Given {
        self.ledger
            .apply("instance-inst_a", event_type, &common(extra), time(at));
        self
    }

    fn created(self, at: Micros, extra: Value) -> Given {
        let mut data =
            json!({ "poolKind": "hosted", "shape": shape(2, 4), "ownerIdentityId": "id_alice" });
        for (k, v) in extra.as_object().unwrap() {
            data[k] = v.clone();
        }
        self.event("instance.created", at, data)
    }

    fn settled(mut self, to: Micros) -> Vec<UsageRecord> {
        self.ledger.settle(Micros::MIN, to)
    }
}

fn only(records: &[UsageRecord], meter: &str) -> Vec<UsageRecord> {
    records
        .iter()
        .filter(|r| r.meter == meter)
        .cloned()
        .collect()
}

/// Whether a record's quantity is `exact` to within the one unit in the last place that rounding
/// the running total may move it.
fn about(quantity: Decimal, exact: Decimal) -> bool {
    (quantity - exact).abs() <= Decimal::new(1, 12)
}

fn sum(records: &[UsageRecord]) -> Decimal {
    records.iter().map(|r| r.quantity).sum()
}

#[test]
fn three_and_a_half_windows_sum_exactly_to_vcpus_times_the_seconds_run() {
    let start = T0 + 123_457; // mid-window, an awkward number of microseconds
    let end = start + 3 * W + W / 2 + 1;
    let records = given()
        .created(start - 10, json!({}))
        .event("instance.scheduled", start, json!({ "nodeId": "node_a" }))
        .event("instance.running", start + 5_000_000, json!({}))
        .event("instance.deleted", end, json!({ "state": "deleted" }))
        .settled(T0 + 10 * W);
    let vcpu = only(&records, VCPU_HOURS);
    assert_eq!(vcpu.len(), 4, "{vcpu:#?}");
    // 2 vCPUs for (end − start) µs, in hours, rounded once to 12 places.
    let exact = Decimal::from(2 * (end - start)) / Decimal::from(3_600_000_000i64);
    assert_eq!(sum(&vcpu), exact.round_dp(12));
    assert_eq!(
        sum(&only(&records, MEMORY_GIB_HOURS)),
        (exact * Decimal::TWO).round_dp(12)
    );
    assert_eq!(vcpu[0].window_start, time(start));
    assert_eq!(vcpu[1].window_start, time(T0 + W));
    assert_eq!(vcpu[3].window_end, time(end));
    assert!(vcpu
        .iter()
        .all(|r| r.identity_id.as_deref() == Some("id_alice")));
}

#[test]
fn settling_window_by_window_gives_the_records_of_settling_at_once() {
    let build = || {
        given()
            .created(T0, json!({}))
            .event("instance.scheduled", T0 + 7, json!({}))
            .event(
                "instance.resized",
                T0 + W + 11,
                json!({ "shape": shape(8, 16) }),
            )
            .event("instance.deleted", T0 + 4 * W + 13, json!({}))
    };
    let at_once = build().settled(T0 + 6 * W);
    let mut stepwise = build();
    let mut records = Vec::new();
    let mut from = Micros::MIN;
    for k in 1..=6 {
        records.extend(stepwise.ledger.settle(from, T0 + k * W));
        from = T0 + k * W;
    }
    assert_eq!(records, at_once);
    assert!(
        stepwise.ledger.instance("inst_a").is_none(),
        "a finished instance is forgotten"
    );
}

#[test]
fn a_resize_mid_window_splits_the_window_at_the_change() {
    let change = T0 + W + 100_000_000;
    let records = given()
        .created(T0, json!({}))
        .event("instance.scheduled", T0, json!({}))
        .event("instance.stopped", change - 1_000, json!({}))
        .event("instance.resized", change, json!({ "shape": shape(8, 16) }))
        .settled(T0 + 3 * W);
    let second: Vec<_> = only(&records, VCPU_HOURS)
        .into_iter()
        .filter(|r| r.window_start >= time(T0 + W) && r.window_end <= time(T0 + 2 * W))
        .collect();
    assert_eq!(second.len(), 2, "{second:#?}");
    assert_eq!(
        (second[0].window_start, second[0].window_end),
        (time(T0 + W), time(change))
    );
    assert_eq!(
        (second[1].window_start, second[1].window_end),
        (time(change), time(T0 + 2 * W))
    );
    // 2 vCPUs for 100 s, then 8 vCPUs for 200 s.
    let hours = |vcpu_seconds: i64| Decimal::from(vcpu_seconds) / Decimal::from(3600);
    assert!(about(second[0].quantity, hours(2 * 100)), "{second:#?}");
    assert!(about(second[1].quantity, hours(8 * 200)), "{second:#?}");
    // Every record of the instance: 2 vCPUs for 400 s, then 8 for 500 s, rounded once.
    let all = only(&records, VCPU_HOURS);
    assert_eq!(sum(&all), hours(2 * 400 + 8 * 500).round_dp(12));
    assert_ne!(second[0].event_id(), second[1].event_id());
}

#[test]
fn a_warm_instance_bills_warm_to_its_tenant_until_the_claim_then_the_owner() {
    let claim = T0 + 200_000_000;
    let warm = json!({ "warmTemplateId": "sbxt_a" });
    let records = given()
        .created(T0, json!({ "warmTemplateId": "sbxt_a", "ownerIdentityId": "reactor:sandboxes" }))
        .event("instance.scheduled", T0 + 1_000_000, warm.clone())
        .event("instance.paused", T0 + 50_000_000, warm)
        .event(
            "instance.starting",
            claim,
            json!({ "sandboxId": "sbx_a", "ownerIdentityId": "id_bob", "claimedAt": "2027-01-15T08:00:00Z" }),
        )
        .event("instance.running", claim + 5_000_000, json!({ "sandboxId": "sbx_a" }))
        .settled(T0 + W);
    let warm_records = only(&records, SANDBOX_WARM);
    assert_eq!(warm_records.len(), 1);
    assert_eq!(warm_records[0].window_end, time(claim));
    assert_eq!(warm_records[0].identity_id, None);
    assert_eq!(warm_records[0].tenant_id, "acme");
    assert_eq!(
        warm_records[0].quantity,
        (Decimal::from(2 * 199) / Decimal::from(3600)).round_dp(12)
    );
    let owned = only(&records, VCPU_HOURS);
    assert_eq!(owned.len(), 1);
    assert_eq!(owned[0].window_start, time(claim));
    assert_eq!(owned[0].identity_id.as_deref(), Some("id_bob"));
    assert_eq!(
        owned[0].quantity,
        (Decimal::from(2 * 100) / Decimal::from(3600)).round_dp(12)
    );
    assert_eq!(only(&records, MEMORY_GIB_HOURS).len(), 1);
}

#[test]
fn a_provider_pool_instance_is_not_metered() {
    let records = given()
        .created(T0, json!({ "poolKind": "provider" }))
        .event("instance.scheduled", T0, json!({}))
        .settled(T0 + 2 * W);
    assert!(records.is_empty());
}

#[test]
fn a_recreated_instance_accrues_only_while_an_allocation_is_booked() {
    let records = given()
        .created(T0, json!({}))
        .event("instance.scheduled", T0, json!({}))
        .event(
            "instance.recreating",
            T0 + 60_000_000,
            json!({ "state": "scheduling" }),
        )
        .event("instance.scheduled", T0 + 90_000_000, json!({}))
        .settled(T0 + W);
    let vcpu = only(&records, VCPU_HOURS);
    assert_eq!(vcpu.len(), 2);
    assert_eq!(
        sum(&vcpu),
        (Decimal::from(2 * 270) / Decimal::from(3600)).round_dp(12)
    );
}

#[test]
fn an_event_recorded_before_the_last_change_counts_from_the_last_change() {
    let records = given()
        .created(T0, json!({}))
        .event("instance.scheduled", T0 + 10_000_000, json!({}))
        // Its transaction started earlier but committed later: read after, applied as "now".
        .event("instance.deleted", T0 + 5_000_000, json!({}))
        .settled(T0 + W);
    assert!(records.is_empty(), "{records:#?}");
}

fn volume(size: u32, extra: Value) -> Value {
    let mut data = json!({
        "volumeId": "vol_a", "tenantId": "acme", "poolId": "pool_h", "nodeId": "node_a",
        "sizeGiB": size,
    });
    for (k, v) in extra.as_object().unwrap() {
        data[k] = v.clone();
    }
    data
}

#[test]
fn a_volume_accrues_its_size_from_created_through_resizes_to_deleted() {
    use crate::usage::meter::VOLUME_GIB_HOURS;
    let mut ledger = Ledger::new(Windows::new(W).unwrap());
    let apply = |ledger: &mut Ledger, event_type: &str, at: Micros, data: Value| {
        ledger.apply("volume-vol_a", event_type, &data, time(at));
    };
    let owner = json!({ "ownerIdentityId": "id_alice", "name": "mem" });
    apply(
        &mut ledger,
        "sandbox.volume.created",
        T0 + 10,
        volume(10, owner),
    );
    apply(
        &mut ledger,
        "sandbox.volume.resized",
        T0 + W / 2,
        volume(30, json!({ "previousSizeGiB": 10 })),
    );
    // Deleting keeps the disk booked: it still accrues.
    apply(
        &mut ledger,
        "sandbox.volume.deleting",
        T0 + W,
        volume(30, json!({})),
    );
    apply(
        &mut ledger,
        "sandbox.volume.deleted",
        T0 + 2 * W,
        volume(30, json!({})),
    );
    let records = ledger.settle(Micros::MIN, T0 + 4 * W);
    assert!(records.iter().all(|r| r.meter == VOLUME_GIB_HOURS
        && r.unit == "gib-hour"
        && r.resource_id == "vol_a"
        && r.tenant_id == "acme"
        && r.identity_id.as_deref() == Some("id_alice")));
    // The resize cuts the first window; the second is whole.
    let spans: Vec<_> = records
        .iter()
        .map(|r| (r.window_start, r.window_end))
        .collect();
    assert_eq!(
        spans,
        vec![
            (time(T0 + 10), time(T0 + W / 2)),
            (time(T0 + W / 2), time(T0 + W)),
            (time(T0 + W), time(T0 + 2 * W)),
        ]
    );
    let gib_us = 10 * i128::from(W / 2 - 10) + 30 * i128::from(W / 2) + 30 * i128::from(W);
    let exact = Decimal::from_i128_with_scale(gib_us, 0) / Decimal::from(3_600_000_000i64);
    assert_eq!(sum(&records), exact.round_dp(12));
    assert!(
        ledger.instance("vol_a").is_none(),
        "a deleted volume is forgotten"
    );
}

#[test]
fn a_stored_snapshot_accrues_its_gib_from_ready_to_deleted() {
    use crate::usage::meter::SNAPSHOT_GIB_HOURS;
    let mut ledger = Ledger::new(Windows::new(W).unwrap());
    let snapshot = |size_bytes: Option<u64>| {
        let mut data = json!({
            "sandboxId": "sbx_a", "tenantId": "acme", "templateId": "sbxt_a",
            "instanceId": "inst_a", "poolId": "pool_h", "snapshotId": "snap_a",
            "includeMemory": false,
        });
        if let Some(b) = size_bytes {
            data["sizeBytes"] = json!(b);
            data["sha256"] = json!("0".repeat(64));
        }
        data
    };
    // Requested: nothing stored yet, nothing accrues.
    ledger.apply(
        "sandbox-sbx_a",
        "sandbox.snapshot.requested",
        &snapshot(None),
        time(T0),
    );
    // 2.5 GiB stored: billed as 3 GiB for the whole window it is kept.
    let size = 5 * (1u64 << 30) / 2;
    ledger.apply(
        "sandbox-sbx_a",
        "sandbox.snapshot.ready",
        &snapshot(Some(size)),
        time(T0),
    );
    ledger.apply(
        "sandbox-sbx_a",
        "sandbox.snapshot.deleted",
        &snapshot(None),
        time(T0 + W),
    );
    // Deleted ends it; the purge after changes nothing.
    ledger.apply(
        "sandbox-sbx_a",
        "sandbox.snapshot.purged",
        &snapshot(None),
        time(T0 + 2 * W),
    );
    let records = ledger.settle(Micros::MIN, T0 + 4 * W);
    assert_eq!(records.len(), 1, "{records:#?}");
    let r = &records[0];
    assert_eq!(
        (
            r.meter.as_str(),
            r.unit.as_str(),
            r.resource_id.as_str(),
            r.tenant_id.as_str()
        ),
        (SNAPSHOT_GIB_HOURS, "gib-hour", "snap_a", "acme")
    );
    // 3 GiB for one five-minute window: a quarter of a GiB-hour.
    assert_eq!(W, 300_000_000);
    assert_eq!(r.quantity, Decimal::new(25, 2));
    assert!(
        ledger.instance("snap_a").is_none(),
        "a settled, deleted snapshot is forgotten"
    );
}
