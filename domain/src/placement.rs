//! Placement of a hosted instance on a node (SPEC §3.4), and in-place resize on its node.
//!
//! Pure and deterministic: the same candidates always give the same node, so a retried decision
//! (after a concurrency conflict) lands where the first attempt would have.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};

use crate::error::DomainError;
use crate::resources::{Capacity, Shape};

/// A node's liveness as placement sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeState {
    /// Reporting; schedulable.
    Ready,
    /// Missed reports; its instances wait for it.
    Unreachable,
    /// Gone for longer than the pool's `lostAfterSeconds`.
    Lost,
    /// Taken out of scheduling by an operator.
    Cordoned,
}

/// One node of the pool, with what is already booked on it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeCandidate {
    /// The node id.
    pub id: String,
    /// Its liveness.
    pub state: NodeState,
    /// The runtimes it advertises.
    pub runtimes: Vec<String>,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// What it offers in total.
    pub capacity: Capacity,
    /// What allocations already book on it.
    pub allocated: Capacity,
}

/// What is being placed and under which constraints.
#[derive(Debug, Clone, Copy)]
pub struct PlacementRequest<'a> {
    /// The flavor's shape.
    pub shape: &'a Shape,
    /// The pool's runtime; a node must advertise it.
    pub runtime: &'a str,
    /// Labels a node must carry with exactly these values.
    pub required_labels: &'a BTreeMap<String, String>,
    /// Nodes never to use (e.g. hosts that refused this instance recently).
    pub excluded: &'a BTreeSet<String>,
    /// When set, only these nodes may be used.
    pub only_nodes: Option<&'a BTreeSet<String>>,
}

/// Why nothing was chosen; becomes the `Unschedulable` condition's reason and message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unschedulable {
    /// Eligible nodes exist but none has room for the shape.
    #[error("no node has room for the flavor")]
    NoFit,
    /// No eligible node advertises the pool's runtime.
    #[error("no ready node advertises runtime {runtime}")]
    MissingRuntime {
        /// The runtime asked for.
        runtime: String,
    },
    /// No eligible node carries a required label.
    #[error("no ready node carries label {key}={value}")]
    MissingLabel {
        /// The label key.
        key: String,
        /// The value required.
        value: String,
    },
}

impl Unschedulable {
    /// The condition's `reason`: `NoFit`, `MissingRuntime` or `MissingLabel`.
    pub fn reason(&self) -> &'static str {
        match self {
            Unschedulable::NoFit => "NoFit",
            Unschedulable::MissingRuntime { .. } => "MissingRuntime",
            Unschedulable::MissingLabel { .. } => "MissingLabel",
        }
    }
}

/// Chooses the node for `request` among `nodes`: best fit (the least free vCPU left after
/// placement), ties broken by node id.
///
/// A node is a candidate when it is `ready` (so not cordoned, unreachable or lost), not excluded,
/// in `only_nodes` when that is set, advertises the runtime, carries every required label, and has
/// room for the shape: vCPU, memory, disk and whole GPUs of the flavor's model. When none is, the
/// error says why, first naming a missing runtime, then the first missing label (by key), else
/// `NoFit`.
pub fn place(
    request: &PlacementRequest<'_>,
    nodes: &[NodeCandidate],
) -> Result<String, Unschedulable> {
    fitting(request, nodes)?
        .into_iter()
        .min_by(|a, b| {
            free_vcpu_after(a, request.shape)
                .cmp(&free_vcpu_after(b, request.shape))
                .then_with(|| a.id.cmp(&b.id))
        })
        .map(|n| n.id.clone())
        .ok_or(Unschedulable::NoFit)
}

/// The candidates of `nodes` that could take `request` (see [`place`] for the rules), before
/// any preference among them; why none could when a runtime or label is what is missing.
/// Others choose among them by their own measure (a volume by free disk).
pub fn fitting<'a>(
    request: &PlacementRequest<'_>,
    nodes: &'a [NodeCandidate],
) -> Result<Vec<&'a NodeCandidate>, Unschedulable> {
    let eligible: Vec<&NodeCandidate> = nodes
        .iter()
        .filter(|n| n.state == NodeState::Ready)
        .filter(|n| !request.excluded.contains(&n.id))
        .filter(|n| request.only_nodes.is_none_or(|only| only.contains(&n.id)))
        .collect();

    let with_runtime: Vec<&NodeCandidate> = eligible
        .iter()
        .copied()
        .filter(|n| n.runtimes.iter().any(|r| r == request.runtime))
        .collect();
    // No schedulable node at all is plain `NoFit`: the runtime is not what is missing.
    if eligible.is_empty() {
        return Err(Unschedulable::NoFit);
    }
    if with_runtime.is_empty() {
        return Err(Unschedulable::MissingRuntime {
            runtime: request.runtime.to_owned(),
        });
    }

    let mut labelled = with_runtime;
    for (key, value) in request.required_labels {
        labelled.retain(|n| n.labels.get(key) == Some(value));
        if labelled.is_empty() {
            return Err(Unschedulable::MissingLabel {
                key: key.clone(),
                value: value.clone(),
            });
        }
    }

    labelled.retain(|n| n.capacity.lacks(&n.allocated, request.shape).is_none());
    Ok(labelled)
}

/// Checks that the node can hold `new` instead of `old` for an in-place resize; the refusal names
/// the resource that ran out (`CAPACITY_UNAVAILABLE` with `details.resource`).
pub fn check_resize_in_place(
    capacity: &Capacity,
    allocated: &Capacity,
    old: &Shape,
    new: &Shape,
) -> Result<(), DomainError> {
    // The instance's own booking is freed first: only the growth needs room.
    let without_it = allocated.minus(old);
    match capacity.lacks(&without_it, new) {
        None => Ok(()),
        Some(resource) => Err(DomainError::CapacityUnavailable {
            resource: resource.as_str().to_owned(),
        }),
    }
}

fn free_vcpu_after(node: &NodeCandidate, shape: &Shape) -> u32 {
    node.capacity
        .vcpu
        .saturating_sub(node.allocated.vcpu)
        .saturating_sub(shape.vcpu)
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::resources::Gpus;

    fn node(id: &str, vcpu: u32) -> NodeCandidate {
        NodeCandidate {
            id: id.into(),
            state: NodeState::Ready,
            runtimes: vec!["cloud-hypervisor".into()],
            labels: BTreeMap::new(),
            capacity: Capacity {
                vcpu,
                memory_gib: 64,
                disk_gib: 500,
                gpus: vec![],
            },
            allocated: Capacity::default(),
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

    fn place_on(shape: &Shape, nodes: &[NodeCandidate]) -> Result<String, Unschedulable> {
        let labels = BTreeMap::new();
        let excluded = BTreeSet::new();
        place(
            &PlacementRequest {
                shape,
                runtime: "cloud-hypervisor",
                required_labels: &labels,
                excluded: &excluded,
                only_nodes: None,
            },
            nodes,
        )
    }

    #[test]
    fn the_node_left_with_the_least_free_vcpu_wins() {
        let nodes = [node("node_a", 16), node("node_b", 4), node("node_c", 8)];
        assert_eq!(place_on(&small(), &nodes).unwrap(), "node_b");
    }

    #[test]
    fn equal_fits_are_broken_by_node_id() {
        let nodes = [node("node_b", 8), node("node_a", 8)];
        assert_eq!(place_on(&small(), &nodes).unwrap(), "node_a");
    }

    #[test]
    fn cordoned_unreachable_and_lost_nodes_are_never_chosen() {
        let mut nodes = [node("node_a", 8), node("node_b", 8), node("node_c", 8)];
        nodes[0].state = NodeState::Cordoned;
        nodes[1].state = NodeState::Unreachable;
        nodes[2].state = NodeState::Lost;
        assert!(place_on(&small(), &nodes).is_err());
    }

    #[test]
    fn a_pool_whose_runtime_no_node_advertises_is_unschedulable_naming_it() {
        let mut n = node("node_a", 8);
        n.runtimes = vec!["firecracker".into()];
        assert_eq!(
            place_on(&small(), &[n]),
            Err(Unschedulable::MissingRuntime {
                runtime: "cloud-hypervisor".into()
            })
        );
    }

    #[test]
    fn a_missing_required_label_is_named() {
        let labels = BTreeMap::from([("zone".to_string(), "fra1".to_string())]);
        let excluded = BTreeSet::new();
        let error = place(
            &PlacementRequest {
                shape: &small(),
                runtime: "cloud-hypervisor",
                required_labels: &labels,
                excluded: &excluded,
                only_nodes: None,
            },
            &[node("node_a", 8)],
        )
        .unwrap_err();
        assert_eq!(error.reason(), "MissingLabel");
        assert_eq!(error.to_string(), "no ready node carries label zone=fra1");
    }

    #[test]
    fn excluded_nodes_and_nodes_outside_only_nodes_are_skipped() {
        let labels = BTreeMap::new();
        let excluded = BTreeSet::from(["node_a".to_string()]);
        let only = BTreeSet::from(["node_a".to_string(), "node_c".to_string()]);
        let nodes = [node("node_a", 4), node("node_b", 4), node("node_c", 16)];
        let chosen = place(
            &PlacementRequest {
                shape: &small(),
                runtime: "cloud-hypervisor",
                required_labels: &labels,
                excluded: &excluded,
                only_nodes: Some(&only),
            },
            &nodes,
        );
        assert_eq!(chosen.unwrap(), "node_c");
    }

    #[test]
    fn gpus_must_be_whole_and_of_the_flavors_model() {
        let shape = Shape {
            gpus: Some(Gpus {
                model: "l40s".into(),
                count: 2,
            }),
            ..small()
        };
        let mut a = node("node_a", 8);
        a.capacity.gpus = vec![Gpus {
            model: "a100".into(),
            count: 8,
        }];
        let mut b = node("node_b", 8);
        b.capacity.gpus = vec![Gpus {
            model: "l40s".into(),
            count: 2,
        }];
        b.allocated.gpus = vec![Gpus {
            model: "l40s".into(),
            count: 1,
        }];
        assert_eq!(
            place_on(&shape, &[a.clone(), b.clone()]),
            Err(Unschedulable::NoFit)
        );
        b.allocated.gpus.clear();
        assert_eq!(place_on(&shape, &[a, b]).unwrap(), "node_b");
    }

    #[test]
    fn a_resize_needs_room_only_for_the_growth() {
        let capacity = Capacity {
            vcpu: 8,
            memory_gib: 16,
            disk_gib: 100,
            gpus: vec![],
        };
        let old = small();
        let allocated = Capacity::default().plus(&old).plus(&old).plus(&old);
        let bigger = Shape { vcpu: 4, ..small() };
        assert!(check_resize_in_place(&capacity, &allocated, &old, &bigger).is_ok());
        let too_big = Shape {
            memory_gib: 12,
            ..small()
        };
        assert_eq!(
            check_resize_in_place(&capacity, &allocated, &old, &too_big),
            Err(DomainError::CapacityUnavailable {
                resource: "memoryGiB".into()
            })
        );
    }

    fn arb_node() -> impl Strategy<Value = NodeCandidate> {
        (
            0u32..20,
            prop::sample::select(vec![
                NodeState::Ready,
                NodeState::Ready,
                NodeState::Cordoned,
                NodeState::Lost,
            ]),
            1u32..64,
            0u32..64,
            1u32..128,
            0u32..128,
            0u32..4,
            0u32..4,
        )
            .prop_map(
                |(id, state, vcpu, used_vcpu, mem, used_mem, gpus, used_gpus)| NodeCandidate {
                    id: format!("node_{id:02}"),
                    state,
                    runtimes: vec!["cloud-hypervisor".into()],
                    labels: BTreeMap::new(),
                    capacity: Capacity {
                        vcpu,
                        memory_gib: mem,
                        disk_gib: 1000,
                        gpus: vec![Gpus {
                            model: "l40s".into(),
                            count: gpus,
                        }],
                    },
                    allocated: Capacity {
                        vcpu: used_vcpu.min(vcpu),
                        memory_gib: used_mem.min(mem),
                        disk_gib: 0,
                        gpus: vec![Gpus {
                            model: "l40s".into(),
                            count: used_gpus.min(gpus),
                        }],
                    },
                },
            )
    }

    /// Candidates with distinct ids (a pool never lists a node twice).
    fn arb_nodes() -> impl Strategy<Value = Vec<NodeCandidate>> {
        prop::collection::vec(arb_node(), 0..8).prop_map(|mut nodes| {
            let mut seen = BTreeSet::new();
            nodes.retain(|n| seen.insert(n.id.clone()));
            nodes
        })
    }

    fn arb_shape() -> impl Strategy<Value = Shape> {
        (1u32..16, 1u32..64, 0u32..3).prop_map(|(vcpu, mem, gpus)| Shape {
            vcpu,
            memory_gib: mem,
            disk_gib: 10,
            gpus: (gpus > 0).then(|| Gpus {
                model: "l40s".into(),
                count: gpus,
            }),
        })
    }

    proptest! {
        #[test]
        fn the_chosen_node_is_ready_has_room_and_no_other_fits_better(
            nodes in arb_nodes(),
            shape in arb_shape(),
        ) {
            match place_on(&shape, &nodes) {
                Ok(id) => {
                    let chosen = nodes.iter().find(|n| n.id == id).unwrap();
                    prop_assert_eq!(chosen.state, NodeState::Ready);
                    prop_assert!(chosen.capacity.lacks(&chosen.allocated, &shape).is_none());
                    let best = free_vcpu_after(chosen, &shape);
                    for other in nodes.iter().filter(|n| n.state == NodeState::Ready) {
                        if other.capacity.lacks(&other.allocated, &shape).is_none() {
                            let theirs = free_vcpu_after(other, &shape);
                            prop_assert!(best < theirs || (best == theirs && chosen.id <= other.id));
                        }
                    }
                }
                Err(_) => {
                    prop_assert!(nodes.iter().all(|n| n.state != NodeState::Ready
                        || n.capacity.lacks(&n.allocated, &shape).is_some()));
                }
            }
        }

        #[test]
        fn placement_ignores_the_order_of_the_candidates(
            nodes in arb_nodes(),
            shape in arb_shape(),
        ) {
            let mut reversed = nodes.clone();
            reversed.reverse();
            prop_assert_eq!(place_on(&shape, &nodes), place_on(&shape, &reversed));
        }
    }
}
