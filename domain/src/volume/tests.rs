//! Given a volume's events and facts, when a command is decided, then these events or this
//! refusal.

use std::collections::BTreeMap;

use chrono::{TimeZone, Utc};

use super::*;
use crate::aggregate::fold;
use crate::placement::NodeState;

fn at(s: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + s, 0).unwrap()
}

fn node(id: &str, disk: u32, used: u32) -> NodeCandidate {
    NodeCandidate {
        id: id.into(),
        state: NodeState::Ready,
        runtimes: vec!["cloud-hypervisor".into()],
        labels: BTreeMap::new(),
        capacity: Capacity {
            vcpu: 16,
            memory_gib: 64,
            disk_gib: disk,
            gpus: vec![],
        },
        allocated: Capacity {
            disk_gib: used,
            ..Capacity::default()
        },
    }
}

fn facts() -> VolumeFacts {
    VolumeFacts {
        pool: Some(AdmissionPool {
            kind: PoolKind::Hosted,
            runtime: "cloud-hypervisor".into(),
            has_account: false,
            has_range: true,
        }),
        name_taken: false,
        quota_max: Amounts::from([(QuotaResource::DiskGib, 100)]),
        quota_used: Amounts::new(),
        nodes: vec![node("node_a", 500, 0), node("node_b", 500, 100)],
    }
}

fn request(size: u32) -> CreateVolume {
    CreateVolume {
        id: "vol_0123456789abcdefghijklmnop".into(),
        tenant_id: "acme".into(),
        pool_id: "pool_p".into(),
        name: "memory".into(),
        size_gib: size,
        idempotency_key: "k".into(),
        request_hash: "h".into(),
        owner_identity_id: "id_alice".into(),
        allocation_id: "alloc_1".into(),
        labels: Default::default(),
    }
}

fn events(created: VolumeCreated) -> Vec<VolumeEvent> {
    vec![VolumeEvent::Created(created)]
}

fn volume(size: u32) -> Volume {
    let created = events(super::admit(&request(size), &facts()).unwrap());
    fold::<Volume>(created.iter().map(|e| (e, at(0))))
        .unwrap()
        .unwrap()
}

fn then(v: &Volume, events: &[VolumeEvent]) -> Volume {
    let mut state = Some(v.clone());
    for e in events {
        state = Some(Volume::evolve(state, e, at(1)).unwrap());
    }
    state.unwrap()
}

#[test]
fn a_create_books_the_node_with_the_most_free_disk_and_is_ready_at_once() {
    let v = volume(50);
    assert_eq!(v.node_id, "node_a");
    assert_eq!(v.state, VolumeState::Ready);
    assert_eq!(v.serial, "vps-abcdefghijklmnop");
    assert_eq!(v.booking().disk_gib, 50);
}

#[test]
fn the_serial_is_twenty_characters_of_a_derived_id() {
    let id = crate::ids::volume_id(crate::ids::Origin {
        tenant: "acme",
        caller: "id_alice",
        key: "k",
    });
    assert_eq!(serial(&id).len(), 20);
    assert!(id.ends_with(&serial(&id)[4..]));
}

#[test]
fn a_key_replays_its_volume_and_conflicts_for_another_request() {
    let v = volume(10);
    assert_eq!(replay(&v, &request(10)).unwrap(), v);
    let mut other = request(20);
    other.request_hash = "other".into();
    let err = replay(&v, &other).unwrap_err();
    assert_eq!(err.code(), crate::error::ErrorCode::Conflict);
    assert_eq!(err.details()["volumeId"], v.id);
}

#[test]
fn sizes_pools_names_quota_and_capacity_are_checked_in_turn() {
    for size in [0, MAX_SIZE_GIB + 1] {
        let err = super::admit(&request(size), &facts()).unwrap_err();
        assert_eq!(err.code(), crate::error::ErrorCode::InvalidInput, "{size}");
    }
    let mut provider = facts();
    provider.pool.as_mut().unwrap().kind = PoolKind::Provider;
    let err = super::admit(&request(1), &provider).unwrap_err();
    assert_eq!(err.details()["field"], "poolId");
    let missing = VolumeFacts {
        pool: None,
        ..facts()
    };
    assert_eq!(
        super::admit(&request(1), &missing).unwrap_err().code(),
        crate::error::ErrorCode::NotFound
    );
    let taken = VolumeFacts {
        name_taken: true,
        ..facts()
    };
    assert_eq!(
        super::admit(&request(1), &taken).unwrap_err().code(),
        crate::error::ErrorCode::Conflict
    );
    assert_eq!(
        super::admit(&request(101), &facts()).unwrap_err().code(),
        crate::error::ErrorCode::QuotaExceeded
    );
    let mut full = facts();
    full.quota_max.insert(QuotaResource::DiskGib, 10_000);
    let err = super::admit(&request(501), &full).unwrap_err();
    assert_eq!(err.code(), crate::error::ErrorCode::CapacityUnavailable);
    assert_eq!(err.details()["resource"], "diskGiB");
}

#[test]
fn volumes_only_grow_within_quota_and_their_nodes_room() {
    let v = volume(10);
    let room = ResizeFacts {
        quota_max: Amounts::from([(QuotaResource::DiskGib, 100)]),
        quota_used: Amounts::from([(QuotaResource::DiskGib, 10)]),
        node: Some((node("n", 500, 0).capacity, node("n", 500, 490).allocated)),
    };
    assert_eq!(resize(&v, 10, &room).unwrap(), vec![]);
    assert_eq!(
        resize(&v, 9, &room).unwrap_err().code(),
        crate::error::ErrorCode::InvalidInput
    );
    assert_eq!(
        resize(&v, 101, &room).unwrap_err().code(),
        crate::error::ErrorCode::QuotaExceeded
    );
    let err = resize(&v, 21, &room).unwrap_err();
    assert_eq!(
        err.code(),
        crate::error::ErrorCode::CapacityUnavailable,
        "{err}"
    );
    let grown = resize(&v, 20, &room).unwrap();
    let after = then(&v, &grown);
    assert_eq!(after.size_gib, 20);
    assert_eq!(after.version, 2);
}

#[test]
fn a_volume_in_use_is_not_deleted_and_a_free_one_goes_through_deleting() {
    let v = volume(10);
    let attached = InUse {
        instances: vec!["inst_a".into()],
        templates: vec![],
    };
    let err = delete(&v, &attached).unwrap_err();
    assert_eq!(err.details()["reason"], "volume-attached");
    let named = InUse {
        instances: vec![],
        templates: vec!["sbxt_t".into()],
    };
    assert_eq!(
        delete(&v, &named).unwrap_err().details()["reason"],
        "volume-in-template"
    );
    let deleting = then(&v, &delete(&v, &InUse::default()).unwrap());
    assert_eq!(deleting.state, VolumeState::Deleting);
    assert_eq!(delete(&deleting, &attached).unwrap(), vec![]);
    assert_eq!(
        resize_target(&deleting, 20).unwrap_err().code(),
        crate::error::ErrorCode::InvalidState
    );
    let deleted = then(&deleting, &release(&deleting));
    assert_eq!(deleted.state, VolumeState::Deleted);
    assert!(deleted.deleted_at.is_some());
    assert_eq!(release(&deleted), vec![]);
}

#[test]
fn every_move_of_the_table_is_the_only_way_between_states() {
    use VolumeState::*;
    for from in [Creating, Ready, Deleting, Deleted] {
        for verb in [Verb::Book, Verb::Resize, Verb::Delete, Verb::Release] {
            let listed = TABLE.iter().any(|(f, v, _)| *f == from && *v == verb);
            assert_eq!(transition(from, verb).is_ok(), listed, "{from:?} {verb:?}");
        }
    }
}

#[test]
fn mount_paths_are_absolute_not_system_and_never_nest() {
    let ok = ["/workspace", "/home/agent/cache", "/data"];
    assert!(check_mount_paths(&ok).is_ok());
    for bad in [
        "workspace",
        "/",
        "/etc",
        "/var",
        "/proc/x",
        "/dev/sdb",
        "/boot/efi",
        "/a/../b",
        "/a/./b",
        "/a//b",
        "/a/",
        "/a b",
    ] {
        let err = check_mount_paths(&[bad]).unwrap_err();
        assert_eq!(err.code(), crate::error::ErrorCode::InvalidInput, "{bad}");
        assert_eq!(err.details()["field"], "volumes[0].mountPath", "{bad}");
    }
    assert!(check_mount_paths(&["/etc2", "/varx"]).is_ok());
    for pair in [["/data", "/data"], ["/data", "/data/cache"], ["/a/b", "/a"]] {
        assert!(check_mount_paths(&pair).is_err(), "{pair:?}");
    }
    let nine: Vec<String> = (0..9).map(|i| format!("/m{i}")).collect();
    let nine: Vec<&str> = nine.iter().map(String::as_str).collect();
    assert!(check_mount_paths(&nine).is_err());
}

fn mount(name: &str, path: &str, read_only: bool) -> VolumeMount {
    VolumeMount {
        name: name.into(),
        mount_path: path.into(),
        read_only,
    }
}

#[test]
fn template_mounts_resolve_to_ready_volumes_of_the_pool_on_one_node() {
    let v = volume(10);
    let resolved = resolve(
        "pool_p",
        &[mount("memory", "/workspace", false)],
        std::slice::from_ref(&v),
    );
    assert_eq!(resolved.unwrap()[0].volume_id, v.id);
    let missing = resolve(
        "pool_p",
        &[mount("other", "/w", false)],
        std::slice::from_ref(&v),
    );
    assert_eq!(
        missing.unwrap_err().code(),
        crate::error::ErrorCode::NotFound
    );
    let elsewhere = resolve(
        "pool_q",
        &[mount("memory", "/w", false)],
        std::slice::from_ref(&v),
    );
    assert_eq!(
        elsewhere.unwrap_err().code(),
        crate::error::ErrorCode::InvalidInput
    );
    let deleting = then(&v, &delete(&v, &InUse::default()).unwrap());
    let not_ready = resolve("pool_p", &[mount("memory", "/w", false)], &[deleting]);
    assert_eq!(
        not_ready.unwrap_err().code(),
        crate::error::ErrorCode::InvalidState
    );
    let mut second = v.clone();
    second.id = "vol_b".into();
    second.name = "other".into();
    second.node_id = "node_b".into();
    let two_nodes = resolve(
        "pool_p",
        &[mount("memory", "/w", false), mount("other", "/x", true)],
        &[v, second],
    );
    assert_eq!(
        two_nodes.unwrap_err().code(),
        crate::error::ErrorCode::InvalidState
    );
}

#[test]
fn one_writer_or_many_readers_never_both() {
    let v = volume(10);
    let rw = [TemplateVolume {
        volume_id: v.id.clone(),
        name: v.name.clone(),
        mount_path: "/w".into(),
        read_only: false,
    }];
    let ro = [TemplateVolume {
        read_only: true,
        ..rw[0].clone()
    }];
    let volumes = [v.clone()];
    let none = BTreeMap::new();
    let writer = BTreeMap::from([(v.id.clone(), vec![false])]);
    let readers = BTreeMap::from([(v.id.clone(), vec![true, true])]);
    let attached = attach(&rw, &volumes, &none).unwrap();
    assert_eq!(attached[0].node_id, v.node_id);
    assert_eq!(attached[0].serial, v.serial);
    for (mounts, live) in [(&rw, &writer), (&rw, &readers), (&ro, &writer)] {
        let err = attach(mounts, &volumes, live).unwrap_err();
        assert_eq!(err.code(), crate::error::ErrorCode::Conflict);
        assert_eq!(err.details()["reason"], "volume-in-use");
    }
    assert!(attach(&ro, &volumes, &readers).is_ok());
}
