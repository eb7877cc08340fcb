//! The host's snapshot work, as a real host does it: run each `snapshot` command of the spec
//! once (capture the domain, upload the object to the presigned URL with its SHA-256), report
//! its outcome in every report until the spec drops the command, and download and check a
//! restore's snapshot before its domain boots.

use std::collections::{BTreeMap, BTreeSet};

use sha2::{Digest, Sha256};

use vps_seam::{CommandResult, HostCommand, NodeSpec};

/// The commands in flight and finished.
#[derive(Default)]
pub(super) struct Commands {
    running: BTreeSet<String>,
    /// Finished, reported until the spec no longer lists them.
    done: BTreeMap<String, CommandResult>,
}

impl Commands {
    /// Forgets finished commands the spec dropped (the server settled them), and answers the
    /// snapshot commands to start now.
    pub fn follow(&mut self, spec: &NodeSpec) -> Vec<HostCommand> {
        let listed: BTreeSet<&str> = spec.commands.iter().map(|c| c.id.as_str()).collect();
        self.done.retain(|id, _| listed.contains(id.as_str()));
        let new: Vec<HostCommand> = spec
            .commands
            .iter()
            .filter(|c| c.kind == "snapshot")
            .filter(|c| !self.running.contains(&c.id) && !self.done.contains_key(&c.id))
            .cloned()
            .collect();
        self.running.extend(new.iter().map(|c| c.id.clone()));
        new
    }

    /// Records a command's outcome.
    pub fn finish(&mut self, result: CommandResult) {
        self.running.remove(&result.id);
        self.done.insert(result.id.clone(), result);
    }

    /// The outcomes to report.
    pub fn results(&self) -> Vec<CommandResult> {
        self.done.values().cloned().collect()
    }
}

/// The object a snapshot of `instance_id` uploads: `size` bytes, different for every
/// snapshot (a cheap generator, seeded by the ids, so a large object costs little to make).
pub(super) fn object(instance_id: &str, snapshot_id: &str, size: usize) -> Vec<u8> {
    let seed = Sha256::digest(format!("{instance_id}/{snapshot_id}").as_bytes());
    let mut state = u64::from_le_bytes(seed[..8].try_into().expect("8 bytes")) | 1;
    let mut bytes = Vec::with_capacity(size + 8);
    while bytes.len() < size {
        // xorshift64*
        state ^= state >> 12;
        state ^= state << 25;
        state ^= state >> 27;
        bytes.extend_from_slice(&state.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    bytes.truncate(size);
    bytes
}

/// The SHA-256 of `bytes`, in hex.
pub(super) fn digest(bytes: &[u8]) -> String {
    data_encoding::HEXLOWER.encode(&Sha256::digest(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(ids: &[&str]) -> NodeSpec {
        NodeSpec {
            generation: 1,
            instances: Vec::new(),
            volumes: Vec::new(),
            commands: ids
                .iter()
                .map(|id| HostCommand {
                    id: id.to_string(),
                    kind: "snapshot".into(),
                    instance_id: "inst_a".into(),
                    include_memory: true,
                    upload_url: None,
                    upload_headers: Default::default(),
                })
                .collect(),
        }
    }

    #[test]
    fn a_command_runs_once_and_is_reported_until_the_spec_drops_it() {
        let mut commands = Commands::default();
        assert_eq!(commands.follow(&spec(&["s1"])).len(), 1);
        assert!(commands.follow(&spec(&["s1"])).is_empty(), "in flight");
        commands.finish(CommandResult {
            id: "s1".into(),
            ok: true,
            sha256: None,
            size_bytes: None,
            cpu_model: None,
            reason: None,
        });
        assert!(commands.follow(&spec(&["s1"])).is_empty(), "finished");
        assert_eq!(commands.results().len(), 1);
        commands.follow(&spec(&[]));
        assert!(commands.results().is_empty());
    }

    #[test]
    fn objects_differ_per_snapshot_and_have_their_size() {
        let a = object("inst_a", "snap_1", 1000);
        assert_eq!(a.len(), 1000);
        assert_eq!(a, object("inst_a", "snap_1", 1000));
        assert_ne!(a, object("inst_a", "snap_2", 1000));
    }
}
