//! What `instances.doc` holds: the stored form of an instance, a type of its own.
//!
//! The row is the instance view and the aggregate's snapshot, so it outlives any one build.
//! Its field names are spelled here, not derived from the domain's `Instance`: renaming a
//! domain field is a compile error in the conversions below, not a silent change of the rows
//! already stored. The nested values keep the domain's serde form; the fixture test
//! (`tests/instance_doc.rs`) pins that form as a whole.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use sqlx::types::Json;
use vps_domain::attachment::Attachment;
use vps_domain::condition::Condition;
use vps_domain::instance::{Instance, PoolKind, Refusal, RestoreFrom};
use vps_domain::labels::Labels;
use vps_domain::network_policy::{Network, NetworkRules};
use vps_domain::resources::Shape;
use vps_domain::state_table::{DesiredState, InstanceState};

/// One `instances.doc` value. Keys are camelCase; SQL reads some of them (`doc->'addresses'`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceDoc {
    id: String,
    tenant_id: String,
    pool_id: String,
    pool_kind: PoolKind,
    state: InstanceState,
    desired_state: DesiredState,
    flavor: String,
    shape: Shape,
    image_id: String,
    ssh_keys: Vec<String>,
    user_data_ref: Option<String>,
    addresses: Vec<String>,
    conditions: Vec<Condition>,
    node_id: Option<String>,
    allocation_id: Option<String>,
    external_id: Option<String>,
    project_id: Option<String>,
    owner_identity_id: String,
    idempotency_key: String,
    request_hash: String,
    sandbox_id: Option<String>,
    warm_template_id: Option<String>,
    // Added after the first rows were stored: absent in those.
    #[serde(default)]
    template_version: Option<u64>,
    #[serde(default)]
    claimed_at: Option<DateTime<Utc>>,
    #[serde(default)]
    starts: u64,
    #[serde(default)]
    network_policy: Option<Network>,
    #[serde(default, skip_serializing_if = "NetworkRules::is_empty")]
    network_rules: NetworkRules,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    restore_from: Option<RestoreFrom>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    volumes: Vec<Attachment>,
    // The `labels` column is generated from this key (a `list` filter's GIN index).
    #[serde(default, skip_serializing_if = "Labels::is_empty")]
    labels: Labels,
    // Deadlines read `stateSince` in SQL.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    state_since: Option<DateTime<Utc>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    desired_since: Option<DateTime<Utc>>,
    created_at: DateTime<Utc>,
    updated_at: DateTime<Utc>,
    version: u64,
    refusals: Vec<Refusal>,
}

impl From<&Instance> for InstanceDoc {
    fn from(i: &Instance) -> Self {
        let i = i.clone();
        InstanceDoc {
            id: i.id,
            tenant_id: i.tenant_id,
            pool_id: i.pool_id,
            pool_kind: i.pool_kind,
            state: i.state,
            desired_state: i.desired_state,
            flavor: i.flavor,
            shape: i.shape,
            image_id: i.image_id,
            ssh_keys: i.ssh_keys,
            user_data_ref: i.user_data_ref,
            addresses: i.addresses,
            conditions: i.conditions,
            node_id: i.node_id,
            allocation_id: i.allocation_id,
            external_id: i.external_id,
            project_id: i.project_id,
            owner_identity_id: i.owner_identity_id,
            idempotency_key: i.idempotency_key,
            request_hash: i.request_hash,
            sandbox_id: i.sandbox_id,
            warm_template_id: i.warm_template_id,
            template_version: i.template_version,
            claimed_at: i.claimed_at,
            starts: i.starts,
            network_policy: i.network_policy,
            network_rules: i.network_rules,
            restore_from: i.restore_from,
            volumes: i.volumes,
            labels: i.labels,
            state_since: i.state_since,
            desired_since: i.desired_since,
            created_at: i.created_at,
            updated_at: i.updated_at,
            version: i.version,
            refusals: i.refusals,
        }
    }
}

impl From<InstanceDoc> for Instance {
    fn from(d: InstanceDoc) -> Self {
        Instance {
            id: d.id,
            tenant_id: d.tenant_id,
            pool_id: d.pool_id,
            pool_kind: d.pool_kind,
            state: d.state,
            desired_state: d.desired_state,
            flavor: d.flavor,
            shape: d.shape,
            image_id: d.image_id,
            ssh_keys: d.ssh_keys,
            user_data_ref: d.user_data_ref,
            addresses: d.addresses,
            conditions: d.conditions,
            node_id: d.node_id,
            allocation_id: d.allocation_id,
            external_id: d.external_id,
            project_id: d.project_id,
            owner_identity_id: d.owner_identity_id,
            idempotency_key: d.idempotency_key,
            request_hash: d.request_hash,
            sandbox_id: d.sandbox_id,
            warm_template_id: d.warm_template_id,
            template_version: d.template_version,
            claimed_at: d.claimed_at,
            starts: d.starts,
            network_policy: d.network_policy,
            network_rules: d.network_rules,
            restore_from: d.restore_from,
            volumes: d.volumes,
            labels: d.labels,
            state_since: d.state_since,
            desired_since: d.desired_since,
            created_at: d.created_at,
            updated_at: d.updated_at,
            version: d.version,
            refusals: d.refusals,
        }
    }
}

/// The value to bind for `instances.doc`.
pub fn stored(i: &Instance) -> Json<InstanceDoc> {
    Json(InstanceDoc::from(i))
}

/// The instance a `doc` column (or `jsonb_agg` of them) holds.
pub fn instance(Json(doc): Json<InstanceDoc>) -> Instance {
    doc.into()
}

/// The instances a `jsonb_agg(doc)` holds.
pub fn instances(Json(docs): Json<Vec<InstanceDoc>>) -> Vec<Instance> {
    docs.into_iter().map(Instance::from).collect()
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;
    use serde_json::Value;
    use vps_domain::condition::{ConditionStatus, ConditionType};
    use vps_domain::resources::Gpus;

    use super::*;

    /// An instance with every field set, so the fixture shows every key.
    fn every_field() -> Instance {
        let at = |s: i64| {
            Utc.timestamp_opt(1_780_000_000 + s, 0)
                .single()
                .unwrap_or_default()
        };
        Instance {
            id: "inst_1".into(),
            tenant_id: "acme".into(),
            pool_id: "pool_1".into(),
            pool_kind: PoolKind::Hosted,
            state: InstanceState::Running,
            desired_state: DesiredState::Running,
            flavor: "g1.small".into(),
            shape: Shape {
                vcpu: 2,
                memory_gib: 4,
                disk_gib: 20,
                gpus: Some(Gpus {
                    model: "l40s".into(),
                    count: 1,
                }),
            },
            image_id: "img_1".into(),
            ssh_keys: vec!["ssh-ed25519 AAAA k".into()],
            user_data_ref: Some("sec_1".into()),
            addresses: vec!["10.0.0.2".into()],
            conditions: vec![Condition {
                condition_type: ConditionType::RuntimeError,
                status: ConditionStatus::True,
                reason: "QemuExited".into(),
                message: "exit 1".into(),
                since: at(1),
            }],
            node_id: Some("node_1".into()),
            allocation_id: Some("alloc_1".into()),
            external_id: Some("i-1".into()),
            project_id: Some("proj".into()),
            owner_identity_id: "id_1".into(),
            idempotency_key: "build-7".into(),
            request_hash: "abc".into(),
            sandbox_id: Some("sbx_1".into()),
            warm_template_id: Some("tpl_1".into()),
            template_version: Some(3),
            claimed_at: Some(at(2)),
            starts: 2,
            network_policy: Some(Network::Egress),
            network_rules: NetworkRules {
                allow: vec!["10.1.0.0/16".into(), "*.example.com".into()],
                bandwidth_mbit: Some(20),
                max_connections: Some(64),
            },
            restore_from: Some(RestoreFrom {
                snapshot_id: "snap_1".into(),
                sha256: "00ff".into(),
                include_memory: true,
                cpu_model: Some("EPYC".into()),
                principal_instance_id: Some("inst_0".into()),
            }),
            volumes: vec![Attachment {
                volume_id: "vol_1".into(),
                node_id: "node_1".into(),
                serial: "vps-vol_1".into(),
                mount_path: "/data".into(),
                read_only: false,
            }],
            labels: Default::default(),
            state_since: None,
            desired_since: None,
            created_at: at(0),
            updated_at: at(3),
            version: 7,
            refusals: vec![Refusal {
                node_id: "node_0".into(),
                at: at(4),
                exclude_until: at(5),
            }],
        }
    }

    fn fixture() -> Value {
        serde_json::from_str(include_str!("../tests/fixtures/instance_doc.json"))
            .unwrap_or(Value::Null)
    }

    #[test]
    fn an_instance_is_stored_exactly_as_the_fixture_spells_it() {
        let stored = serde_json::to_value(InstanceDoc::from(&every_field())).ok();
        assert_eq!(stored, Some(fixture()));
    }

    #[test]
    fn a_stored_row_reads_back_as_the_instance_it_was() {
        let doc: Option<InstanceDoc> = serde_json::from_value(fixture()).ok();
        assert_eq!(doc.map(Instance::from), Some(every_field()));
    }

    #[test]
    fn a_row_stored_before_the_later_fields_still_reads() {
        let mut old = fixture();
        for key in [
            "templateVersion",
            "claimedAt",
            "starts",
            "networkPolicy",
            "networkRules",
            "restoreFrom",
            "volumes",
        ] {
            old.as_object_mut().map(|o| o.remove(key));
        }
        let doc: Result<InstanceDoc, _> = serde_json::from_value(old);
        let instance = doc.map(Instance::from).ok();
        assert_eq!(instance.as_ref().map(|i| i.template_version), Some(None));
        assert_eq!(instance.map(|i| i.volumes.len()), Some(0));
    }
}
