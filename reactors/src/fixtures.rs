//! Instances for the reconcilers' pure step tests.

use chrono::{DateTime, TimeZone, Utc};
use vps_domain::condition::{Condition, ConditionStatus, ConditionType};
use vps_domain::instance::{Instance, PoolKind};
use vps_domain::resources::Shape;
use vps_domain::state_table::{DesiredState, InstanceState};

/// A fixed "now" for the tables.
pub fn now() -> DateTime<Utc> {
    Utc.with_ymd_and_hms(2026, 12, 1, 12, 0, 0).unwrap()
}

/// An instance of `kind` in `state`, wanting `desired`, last changed a minute before [`now`].
pub fn instance(kind: PoolKind, state: InstanceState, desired: DesiredState) -> Instance {
    Instance {
        id: "inst_1".into(),
        tenant_id: "ten_1".into(),
        pool_id: "pool_1".into(),
        pool_kind: kind,
        state,
        desired_state: desired,
        flavor: "small".into(),
        shape: Shape {
            vcpu: 1,
            memory_gib: 1,
            disk_gib: 10,
            gpus: None,
        },
        image_id: "debian-12".into(),
        ssh_keys: Vec::new(),
        user_data_ref: None,
        addresses: Vec::new(),
        conditions: Vec::new(),
        node_id: None,
        allocation_id: None,
        external_id: None,
        project_id: None,
        owner_identity_id: "id_1".into(),
        idempotency_key: "idem".into(),
        request_hash: "hash".into(),
        sandbox_id: None,
        warm_template_id: None,
        template_version: None,
        network_policy: None,
        network_rules: Default::default(),
        restore_from: None,
        volumes: Vec::new(),
        labels: Default::default(),
        state_since: None,
        desired_since: None,
        claimed_at: None,
        starts: 0,
        created_at: now() - chrono::TimeDelta::hours(1),
        updated_at: now() - chrono::TimeDelta::minutes(1),
        version: 3,
        refusals: Vec::new(),
    }
}

/// The same instance carrying a `condition_type` condition with `reason`, standing since `since`.
pub fn with_condition(
    mut inst: Instance,
    condition_type: ConditionType,
    reason: &str,
    since: DateTime<Utc>,
) -> Instance {
    inst.conditions.push(Condition {
        condition_type,
        status: ConditionStatus::True,
        reason: reason.into(),
        message: String::new(),
        since,
    });
    inst
}
