//! The node aggregate (stream `node-<id>`): registered in a hosted pool, cordoned and
//! uncordoned by operators, lost when silent and recovered when it reports again, and the
//! set of orphans it holds.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::operator::{
    check_name, check_name_free, NodeRegistered, NodeStateChanged, OrphansChanged, RUNTIMES,
};
use crate::resources::Capacity;

/// The most orphans one `instance.orphaned` event names.
pub const MAX_ORPHANS: usize = 100;

crate::event_enum! {
    /// What happens to a node.
    pub enum NodeEvent {
        /// `node.registered`.
        Registered(NodeRegistered) = "node.registered",
        /// `node.cordoned`.
        Cordoned(NodeStateChanged) = "node.cordoned",
        /// `node.uncordoned`.
        Uncordoned(NodeStateChanged) = "node.uncordoned",
        /// `node.lost`.
        Lost(NodeStateChanged) = "node.lost",
        /// `node.recovered`.
        Recovered(NodeStateChanged) = "node.recovered",
        /// `instance.orphaned`: the set of instances it holds that nothing places there.
        Orphaned(OrphansChanged) = "instance.orphaned",
        /// `node.tokenRotated`: a new node token replaced the old one (neither is in the log).
        TokenRotated(NodeStateChanged) = "node.tokenRotated",
    }
}

/// Whether a node takes placements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeLiveness {
    /// Placements go there.
    Ready,
    /// An operator stopped placements.
    Cordoned,
    /// It went silent.
    Lost,
}

impl NodeLiveness {
    /// The projection's `state` column.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeLiveness::Ready => "ready",
            NodeLiveness::Cordoned => "cordoned",
            NodeLiveness::Lost => "lost",
        }
    }

    /// Reads the projection's `state` column back.
    pub fn from_column(state: &str) -> Option<NodeLiveness> {
        [
            NodeLiveness::Ready,
            NodeLiveness::Cordoned,
            NodeLiveness::Lost,
        ]
        .into_iter()
        .find(|l| l.as_str() == state)
    }
}

/// A node as its events leave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Node {
    /// `node_…`.
    pub id: String,
    /// Its pool.
    pub pool_id: String,
    /// Ready, cordoned or lost.
    pub liveness: NodeLiveness,
    /// The orphans last announced, sorted.
    pub orphans: Vec<String>,
    /// Events folded.
    pub version: u64,
}

impl Aggregate for Node {
    type Event = NodeEvent;
    const CATEGORY: &'static str = "node";

    fn create(event: &NodeEvent, _at: DateTime<Utc>) -> Option<Self> {
        let NodeEvent::Registered(r) = event else {
            return None;
        };
        Some(Node {
            id: r.node_id.clone(),
            pool_id: r.pool_id.clone(),
            liveness: NodeLiveness::Ready,
            orphans: Vec::new(),
            version: 1,
        })
    }

    fn apply(&mut self, event: &NodeEvent, _at: DateTime<Utc>) {
        match event {
            NodeEvent::Registered(_) | NodeEvent::TokenRotated(_) => {}
            NodeEvent::Cordoned(_) => self.liveness = NodeLiveness::Cordoned,
            NodeEvent::Lost(_) => self.liveness = NodeLiveness::Lost,
            NodeEvent::Uncordoned(_) | NodeEvent::Recovered(_) => {
                self.liveness = NodeLiveness::Ready
            }
            NodeEvent::Orphaned(o) => self.orphans = o.instance_ids.clone(),
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// `nodes.register`, with the facts it needs.
#[derive(Debug, Clone)]
pub struct RegisterNode {
    /// The new id.
    pub id: String,
    /// The pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// What it offers.
    pub capacity: Capacity,
    /// Placement labels.
    pub labels: BTreeMap<String, String>,
    /// Runtimes it advertises (default: the pool's).
    pub runtimes: Option<Vec<String>>,
    /// Its CPU model.
    pub cpu_model: Option<String>,
    /// Fact: the pool's class and runtime, when the pool exists.
    pub pool: Option<(String, Option<String>)>,
    /// Fact: another node of the pool has the name.
    pub name_taken: bool,
}

/// What can be asked of a node.
#[derive(Debug, Clone)]
pub enum NodeCommand {
    /// Register it.
    Register(Box<RegisterNode>),
    /// Stop placing on it.
    Cordon,
    /// Place on it again.
    Uncordon,
    /// It went silent.
    Lose,
    /// It reported while lost.
    Recover,
    /// Its token was replaced.
    RotateToken,
    /// What it holds that nothing places there; `complete` when its report was a full
    /// inventory (then an empty set clears the announced one).
    RecordOrphans {
        /// The orphans.
        orphans: Vec<String>,
        /// A full inventory.
        complete: bool,
    },
}

/// The events `command` produces on `state`. Repeating a change that holds records nothing.
pub fn decide(state: Option<&Node>, command: &NodeCommand) -> Result<Vec<NodeEvent>, DomainError> {
    let node = match (state, command) {
        (None, NodeCommand::Register(r)) => return register(r).map(|e| vec![e]),
        (Some(_), NodeCommand::Register(_)) => {
            return Err(DomainError::invalid_state("the node exists"))
        }
        (None, _) => {
            return Err(DomainError::NotFound {
                what: "node".into(),
            })
        }
        (Some(node), _) => node,
    };
    let changed = NodeStateChanged {
        node_id: node.id.clone(),
    };
    let event = match command {
        NodeCommand::Register(_) => unreachable!("handled above"),
        NodeCommand::Cordon if node.liveness != NodeLiveness::Cordoned => {
            NodeEvent::Cordoned(changed)
        }
        NodeCommand::Uncordon if node.liveness == NodeLiveness::Cordoned => {
            NodeEvent::Uncordoned(changed)
        }
        NodeCommand::Lose if node.liveness != NodeLiveness::Lost => NodeEvent::Lost(changed),
        NodeCommand::Recover if node.liveness == NodeLiveness::Lost => {
            NodeEvent::Recovered(changed)
        }
        NodeCommand::RotateToken => NodeEvent::TokenRotated(changed),
        NodeCommand::RecordOrphans { orphans, complete } => {
            let mut orphans = orphans.clone();
            orphans.sort();
            orphans.dedup();
            orphans.truncate(MAX_ORPHANS);
            if orphans == node.orphans || (!complete && orphans.is_empty()) {
                return Ok(Vec::new());
            }
            NodeEvent::Orphaned(OrphansChanged {
                node_id: node.id.clone(),
                instance_ids: orphans,
            })
        }
        _ => return Ok(Vec::new()),
    };
    Ok(vec![event])
}

fn register(r: &RegisterNode) -> Result<NodeEvent, DomainError> {
    check_name("name", &r.name)?;
    let c = &r.capacity;
    // A sandbox host runs thousands of microVMs of a vCPU each (issue 41): up to 65,536.
    if c.vcpu == 0
        || c.memory_gib == 0
        || c.vcpu > 65_536
        || c.memory_gib > 65_536
        || c.disk_gib > 1_048_576
    {
        return Err(DomainError::invalid_input(
            "capacity",
            "vcpu and memoryGiB must be positive and in range",
        ));
    }
    let (class, pool_runtime) = r.pool.clone().ok_or_else(|| DomainError::NotFound {
        what: format!("pool {}", r.pool_id),
    })?;
    if class != "vps-host" {
        return Err(DomainError::invalid_input(
            "poolId",
            "nodes belong to hosted (vps-host) pools",
        ));
    }
    check_name_free(r.name_taken, "node", &r.name, " in this pool")?;
    let runtimes = r
        .runtimes
        .clone()
        .unwrap_or_else(|| vec![pool_runtime.unwrap_or_else(|| "libvirt-kvm".into())]);
    if let Some(bad) = runtimes.iter().find(|r| !RUNTIMES.contains(&r.as_str())) {
        return Err(DomainError::invalid_input(
            "runtimes",
            format!("unknown runtime {bad}"),
        ));
    }
    Ok(NodeEvent::Registered(NodeRegistered {
        node_id: r.id.clone(),
        pool_id: r.pool_id.clone(),
        name: r.name.clone(),
        capacity: r.capacity.clone(),
        labels: r.labels.clone(),
        runtimes,
        cpu_model: r.cpu_model.clone(),
    }))
}

#[cfg(test)]
mod tests {
    use super::NodeLiveness;

    #[test]
    fn a_liveness_reads_back_from_its_column_and_nothing_else_does() {
        for l in [
            NodeLiveness::Ready,
            NodeLiveness::Cordoned,
            NodeLiveness::Lost,
        ] {
            assert_eq!(NodeLiveness::from_column(l.as_str()), Some(l));
        }
        assert_eq!(NodeLiveness::from_column("deleted"), None);
    }
}
