//! The instance state table (SPEC §3.2): the single list of legal `(from, verb) → to` moves.
//!
//! The table is data, not code, so it can be rendered (`render_mermaid`), compared with the SPEC
//! in a test, and searched (`walk`). Every state change a decision makes goes through
//! [`transition`] or [`transition_to`]; a move that is not a row here is `INVALID_STATE`.
//! The sandbox's and the volume's smaller tables are `(from, verb, to)` rows, moved along by
//! [`step`].

use std::collections::{BTreeSet, VecDeque};
use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::error::DomainError;

/// Where an instance actually is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum InstanceState {
    /// Admitted as a draft, not decided yet.
    Pending,
    /// Waiting for a node (hosted) or for the provider machine (provider).
    Scheduling,
    /// Placed on a node, or the provider machine exists; not booted yet.
    Provisioning,
    /// Booting.
    Starting,
    /// Running.
    Running,
    /// Stopped; the node allocation is kept.
    Stopped,
    /// vCPUs stopped, memory resident (warm sandbox instances).
    Paused,
    /// Rebooting.
    Rebooting,
    /// Changing flavor in place (only inside a resize decision).
    Resizing,
    /// Being torn down.
    Deleting,
    /// Gone; still readable.
    Deleted,
    /// Failed; needs `start` (or `delete`).
    Error,
    /// Its node or machine disappeared.
    Lost,
}

/// What the tenant (or a sandbox) wants the instance to be.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum DesiredState {
    /// Running.
    Running,
    /// Stopped.
    Stopped,
    /// Paused (only warm pools ask for it).
    Paused,
    /// Deleted.
    Deleted,
}

/// The name of a move in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Verb {
    /// The create was admitted.
    Admit,
    /// A hosted instance got a node.
    Place,
    /// A provider machine was created.
    Create,
    /// The runtime began booting it.
    Boot,
    /// Release the node and schedule again.
    Recreate,
    /// It came up.
    Run,
    /// It stopped.
    Stop,
    /// It is asked to start again.
    Start,
    /// A resize began.
    Resize,
    /// A resize finished.
    Resized,
    /// It paused.
    Pause,
    /// It resumed.
    Resume,
    /// A reboot began.
    Reboot,
    /// A reboot finished.
    Rebooted,
    /// Deletion was asked for.
    Delete,
    /// Everything it held was released.
    Release,
    /// It failed.
    Fail,
    /// Its node or machine disappeared.
    Lose,
    /// Its node or machine came back.
    Recover,
}

/// One legal move.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Row {
    /// The state the move starts from.
    pub from: InstanceState,
    /// The move.
    pub verb: Verb,
    /// The state it ends in.
    pub to: InstanceState,
}

use InstanceState as S;
use Verb as V;

const fn row(from: InstanceState, verb: Verb, to: InstanceState) -> Row {
    Row { from, verb, to }
}

/// The table. The SPEC's shorthand rows are written out state by state:
///
/// - "any but deleting/deleted → delete": every other state, `error` and `lost` included, since a
///   broken or lost instance must still be removable (the reference lets every state except
///   `deleting` and `deleted` enter `deleting`).
/// - "any live state → fail": every state that is neither settled in failure (`error`) nor on
///   its way out (`deleting`, `deleted`). `deleting` is left out on purpose: a failure during
///   teardown is recorded as a condition and retried, so deletion always ends by releasing.
///   `lost` is in, so a host that comes back reporting `ERROR` can put the instance in `error`.
/// - "placed/provisioned states → lose": every state in which a node or a provider machine holds
///   the instance, `error` included (an instance that failed on a host still sits there).
///   `scheduling` and `pending` hold nothing to lose; `deleting` on a lost host releases instead.
pub const TABLE: &[Row] = &[
    row(S::Pending, V::Admit, S::Scheduling),
    row(S::Scheduling, V::Place, S::Provisioning),
    row(S::Scheduling, V::Create, S::Provisioning),
    row(S::Provisioning, V::Boot, S::Starting),
    row(S::Provisioning, V::Recreate, S::Scheduling),
    row(S::Stopped, V::Recreate, S::Scheduling),
    row(S::Starting, V::Run, S::Running),
    row(S::Running, V::Stop, S::Stopped),
    row(S::Stopped, V::Start, S::Starting),
    row(S::Error, V::Start, S::Starting),
    row(S::Stopped, V::Resize, S::Resizing),
    row(S::Resizing, V::Resized, S::Stopped),
    row(S::Running, V::Pause, S::Paused),
    row(S::Paused, V::Resume, S::Running),
    row(S::Paused, V::Stop, S::Stopped),
    row(S::Running, V::Reboot, S::Rebooting),
    row(S::Rebooting, V::Rebooted, S::Running),
    // any but deleting/deleted → deleting
    row(S::Pending, V::Delete, S::Deleting),
    row(S::Scheduling, V::Delete, S::Deleting),
    row(S::Provisioning, V::Delete, S::Deleting),
    row(S::Starting, V::Delete, S::Deleting),
    row(S::Running, V::Delete, S::Deleting),
    row(S::Stopped, V::Delete, S::Deleting),
    row(S::Paused, V::Delete, S::Deleting),
    row(S::Rebooting, V::Delete, S::Deleting),
    row(S::Resizing, V::Delete, S::Deleting),
    row(S::Error, V::Delete, S::Deleting),
    row(S::Lost, V::Delete, S::Deleting),
    row(S::Deleting, V::Release, S::Deleted),
    // any live state → error
    row(S::Pending, V::Fail, S::Error),
    row(S::Scheduling, V::Fail, S::Error),
    row(S::Provisioning, V::Fail, S::Error),
    row(S::Starting, V::Fail, S::Error),
    row(S::Running, V::Fail, S::Error),
    row(S::Stopped, V::Fail, S::Error),
    row(S::Paused, V::Fail, S::Error),
    row(S::Rebooting, V::Fail, S::Error),
    row(S::Resizing, V::Fail, S::Error),
    row(S::Lost, V::Fail, S::Error),
    // placed/provisioned states → lost
    row(S::Provisioning, V::Lose, S::Lost),
    row(S::Starting, V::Lose, S::Lost),
    row(S::Running, V::Lose, S::Lost),
    row(S::Stopped, V::Lose, S::Lost),
    row(S::Paused, V::Lose, S::Lost),
    row(S::Rebooting, V::Lose, S::Lost),
    row(S::Resizing, V::Lose, S::Lost),
    row(S::Error, V::Lose, S::Lost),
    row(S::Lost, V::Recover, S::Running),
    row(S::Lost, V::Recover, S::Stopped),
    row(S::Lost, V::Recover, S::Paused),
    row(S::Lost, V::Recreate, S::Scheduling),
];

/// The verbs a host's or provider's report may walk an instance along toward its desired state
/// (the reconciler's "one table transition per event").
pub const CONVERGE_VERBS: &[Verb] = &[
    Verb::Boot,
    Verb::Run,
    Verb::Stop,
    Verb::Start,
    Verb::Pause,
    Verb::Resume,
    Verb::Rebooted,
];

/// The state `verb` leads to from `from`, or `INVALID_STATE`.
///
/// `recover` has several targets; use [`transition_to`] for it.
pub fn transition(from: InstanceState, verb: Verb) -> Result<InstanceState, DomainError> {
    let mut targets = TABLE
        .iter()
        .filter(|r| r.from == from && r.verb == verb)
        .map(|r| r.to);
    match (targets.next(), targets.next()) {
        (Some(to), None) => Ok(to),
        (None, _) => Err(illegal(from, verb)),
        (Some(_), Some(_)) => Err(DomainError::invalid_state(format!(
            "{verb} from {from} needs a target state"
        ))),
    }
}

/// `to`, when `(from, verb, to)` is a row of the table; else `INVALID_STATE`.
pub fn transition_to(
    from: InstanceState,
    verb: Verb,
    to: InstanceState,
) -> Result<InstanceState, DomainError> {
    if TABLE.contains(&row(from, verb, to)) {
        Ok(to)
    } else {
        Err(DomainError::invalid_state(format!(
            "cannot {verb} an instance from {from} to {to}"
        )))
    }
}

/// Where `verb` takes `from` in a table of `(from, verb, to)` rows, or `INVALID_STATE`:
/// "`what` cannot `verb`", `what` naming the resource in its state (`a ready volume`).
pub fn step<S: Copy + PartialEq, V: Copy + PartialEq + fmt::Debug>(
    table: &[(S, V, S)],
    from: S,
    verb: V,
    what: impl FnOnce() -> String,
) -> Result<S, DomainError> {
    table
        .iter()
        .find(|(f, v, _)| *f == from && *v == verb)
        .map(|(_, _, to)| *to)
        .ok_or_else(|| DomainError::invalid_state(format!("{} cannot {verb:?}", what())))
}

/// Whether some row leads from `from` to `to`.
pub fn allows(from: InstanceState, to: InstanceState) -> bool {
    TABLE.iter().any(|r| r.from == from && r.to == to)
}

/// The shortest sequence of moves from `from` to `to` using only `verbs` (ties broken by table
/// order), or `None` when there is none. An empty path means `from == to`.
pub fn walk(from: InstanceState, to: InstanceState, verbs: &[Verb]) -> Option<Vec<Row>> {
    let mut queue = VecDeque::from([(from, Vec::new())]);
    let mut seen = BTreeSet::from([from]);
    while let Some((at, path)) = queue.pop_front() {
        if at == to {
            return Some(path);
        }
        for r in TABLE
            .iter()
            .filter(|r| r.from == at && verbs.contains(&r.verb))
        {
            if seen.insert(r.to) {
                let mut next = path.clone();
                next.push(*r);
                queue.push_back((r.to, next));
            }
        }
    }
    None
}

/// The table as a Mermaid `stateDiagram-v2`, one edge per row labelled with its verb.
pub fn render_mermaid() -> String {
    let mut out = String::from("stateDiagram-v2\n");
    out.push_str("    [*] --> pending\n");
    for r in TABLE {
        out.push_str(&format!("    {} --> {}: {}\n", r.from, r.to, r.verb));
    }
    out.push_str("    deleted --> [*]\n");
    out
}

fn illegal(from: InstanceState, verb: Verb) -> DomainError {
    DomainError::invalid_state(format!("cannot {verb} an instance that is {from}"))
}

impl InstanceState {
    /// Every state, in declaration order.
    pub const ALL: [InstanceState; 13] = [
        S::Pending,
        S::Scheduling,
        S::Provisioning,
        S::Starting,
        S::Running,
        S::Stopped,
        S::Paused,
        S::Rebooting,
        S::Resizing,
        S::Deleting,
        S::Deleted,
        S::Error,
        S::Lost,
    ];

    /// The wire name (`running`, `deleting`, …).
    pub fn as_str(self) -> &'static str {
        match self {
            S::Pending => "pending",
            S::Scheduling => "scheduling",
            S::Provisioning => "provisioning",
            S::Starting => "starting",
            S::Running => "running",
            S::Stopped => "stopped",
            S::Paused => "paused",
            S::Rebooting => "rebooting",
            S::Resizing => "resizing",
            S::Deleting => "deleting",
            S::Deleted => "deleted",
            S::Error => "error",
            S::Lost => "lost",
        }
    }

    /// Whether a `wait` on create keeps holding the answer in this state (SPEC §3.3).
    pub fn is_settling(self) -> bool {
        matches!(
            self,
            S::Pending | S::Scheduling | S::Provisioning | S::Starting
        )
    }
}

impl DesiredState {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            DesiredState::Running => "running",
            DesiredState::Stopped => "stopped",
            DesiredState::Paused => "paused",
            DesiredState::Deleted => "deleted",
        }
    }

    /// The instance state that satisfies this wish.
    pub fn as_state(self) -> InstanceState {
        match self {
            DesiredState::Running => S::Running,
            DesiredState::Stopped => S::Stopped,
            DesiredState::Paused => S::Paused,
            DesiredState::Deleted => S::Deleted,
        }
    }
}

impl Verb {
    /// Every verb, in declaration order.
    pub const ALL: [Verb; 19] = [
        V::Admit,
        V::Place,
        V::Create,
        V::Boot,
        V::Recreate,
        V::Run,
        V::Stop,
        V::Start,
        V::Resize,
        V::Resized,
        V::Pause,
        V::Resume,
        V::Reboot,
        V::Rebooted,
        V::Delete,
        V::Release,
        V::Fail,
        V::Lose,
        V::Recover,
    ];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            V::Admit => "admit",
            V::Place => "place",
            V::Create => "create",
            V::Boot => "boot",
            V::Recreate => "recreate",
            V::Run => "run",
            V::Stop => "stop",
            V::Start => "start",
            V::Resize => "resize",
            V::Resized => "resized",
            V::Pause => "pause",
            V::Resume => "resume",
            V::Reboot => "reboot",
            V::Rebooted => "rebooted",
            V::Delete => "delete",
            V::Release => "release",
            V::Fail => "fail",
            V::Lose => "lose",
            V::Recover => "recover",
        }
    }
}

impl fmt::Display for InstanceState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for DesiredState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Verb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_small_table_moves_along_its_rows_and_names_a_refused_move() {
        use crate::volume::{transition, Verb, VolumeState};
        assert_eq!(
            transition(VolumeState::Ready, Verb::Delete),
            Ok(VolumeState::Deleting)
        );
        let refused = transition(VolumeState::Deleted, Verb::Resize).unwrap_err();
        assert_eq!(
            refused,
            DomainError::invalid_state("a deleted volume cannot Resize")
        );
    }

    /// SPEC §3.2's table, written out: `(from states, verb, to states)`.
    fn spec_rows() -> BTreeSet<Row> {
        // Every state but the two of a deletion, and of those, the ones not in error.
        let live_but_deleting: Vec<_> = S::ALL
            .into_iter()
            .filter(|s| !matches!(s, S::Deleting | S::Deleted))
            .collect();
        let live: Vec<_> = live_but_deleting
            .iter()
            .copied()
            .filter(|s| *s != S::Error)
            .collect();
        // The states a placed instance can be in: neither before its placement nor lost.
        let placed: Vec<_> = live_but_deleting
            .iter()
            .copied()
            .filter(|s| !matches!(s, S::Pending | S::Scheduling | S::Lost))
            .collect();
        let spec: Vec<(Vec<InstanceState>, Verb, Vec<InstanceState>)> = vec![
            (vec![S::Pending], V::Admit, vec![S::Scheduling]),
            (vec![S::Scheduling], V::Place, vec![S::Provisioning]),
            (vec![S::Scheduling], V::Create, vec![S::Provisioning]),
            (vec![S::Provisioning], V::Boot, vec![S::Starting]),
            (
                vec![S::Provisioning, S::Stopped],
                V::Recreate,
                vec![S::Scheduling],
            ),
            (vec![S::Starting], V::Run, vec![S::Running]),
            (vec![S::Running], V::Stop, vec![S::Stopped]),
            (vec![S::Stopped, S::Error], V::Start, vec![S::Starting]),
            (vec![S::Stopped], V::Resize, vec![S::Resizing]),
            (vec![S::Resizing], V::Resized, vec![S::Stopped]),
            (vec![S::Running], V::Pause, vec![S::Paused]),
            (vec![S::Paused], V::Resume, vec![S::Running]),
            (vec![S::Paused], V::Stop, vec![S::Stopped]),
            (vec![S::Running], V::Reboot, vec![S::Rebooting]),
            (vec![S::Rebooting], V::Rebooted, vec![S::Running]),
            (live_but_deleting.to_vec(), V::Delete, vec![S::Deleting]),
            (vec![S::Deleting], V::Release, vec![S::Deleted]),
            (live.to_vec(), V::Fail, vec![S::Error]),
            (placed.to_vec(), V::Lose, vec![S::Lost]),
            (
                vec![S::Lost],
                V::Recover,
                vec![S::Running, S::Stopped, S::Paused],
            ),
            (vec![S::Lost], V::Recreate, vec![S::Scheduling]),
        ];
        spec.into_iter()
            .flat_map(|(froms, verb, tos)| {
                froms.into_iter().flat_map(move |from| {
                    tos.clone().into_iter().map(move |to| row(from, verb, to))
                })
            })
            .collect()
    }

    #[test]
    fn the_table_is_exactly_the_spec_list_written_out() {
        let table: BTreeSet<Row> = TABLE.iter().copied().collect();
        assert_eq!(table.len(), TABLE.len(), "no duplicate rows");
        let missing: Vec<_> = spec_rows().difference(&table).copied().collect();
        let extra: Vec<_> = table.difference(&spec_rows()).copied().collect();
        assert!(missing.is_empty(), "rows of the SPEC missing: {missing:?}");
        assert!(extra.is_empty(), "rows beyond the SPEC: {extra:?}");
    }

    #[test]
    fn nothing_leaves_deleted_and_deleting_only_releases() {
        assert!(TABLE.iter().all(|r| r.from != S::Deleted));
        let from_deleting: Vec<_> = TABLE.iter().filter(|r| r.from == S::Deleting).collect();
        assert_eq!(
            from_deleting,
            vec![&row(S::Deleting, V::Release, S::Deleted)]
        );
    }

    #[test]
    fn recover_is_the_only_verb_with_several_targets() {
        for from in InstanceState::ALL {
            for verb in Verb::ALL {
                let targets = TABLE
                    .iter()
                    .filter(|r| r.from == from && r.verb == verb)
                    .count();
                if targets > 1 {
                    assert_eq!((from, verb), (S::Lost, V::Recover));
                }
            }
        }
        assert!(transition(S::Lost, V::Recover).is_err());
        assert_eq!(
            transition_to(S::Lost, V::Recover, S::Paused).unwrap(),
            S::Paused
        );
    }

    #[test]
    fn an_illegal_move_is_invalid_state_naming_the_state_and_verb() {
        let error = transition(S::Deleted, V::Start).unwrap_err();
        assert_eq!(error.code(), crate::error::ErrorCode::InvalidState);
        assert_eq!(
            error.to_string(),
            "cannot start an instance that is deleted"
        );
    }

    #[test]
    fn every_state_is_reachable_from_pending() {
        let all: Vec<Verb> = Verb::ALL.to_vec();
        for state in InstanceState::ALL {
            assert!(walk(S::Pending, state, &all).is_some(), "{state}");
        }
    }

    #[test]
    fn a_report_walks_provisioning_through_starting_to_running() {
        let path = walk(S::Provisioning, S::Running, CONVERGE_VERBS).unwrap();
        let verbs: Vec<_> = path.iter().map(|r| r.verb).collect();
        assert_eq!(verbs, vec![V::Boot, V::Run]);
    }

    #[test]
    fn wire_names_match_serde() {
        for state in InstanceState::ALL {
            assert_eq!(
                serde_json::to_value(state).unwrap(),
                serde_json::json!(state.as_str())
            );
        }
        for verb in Verb::ALL {
            assert_eq!(
                serde_json::to_value(verb).unwrap(),
                serde_json::json!(verb.as_str())
            );
        }
    }

    #[test]
    fn the_rendering_has_one_edge_per_row() {
        let text = render_mermaid();
        assert!(text.starts_with("stateDiagram-v2\n"));
        assert!(text.contains("    lost --> paused: recover\n"));
        assert_eq!(text.lines().count(), TABLE.len() + 3);
    }

    #[test]
    fn docs_state_table_md_holds_the_current_rendering() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/state-table.md");
        let expected = state_table_doc();
        if std::env::var("UPDATE_DOCS").as_deref() == Ok("1") {
            std::fs::write(path, &expected).unwrap();
        }
        let actual = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            actual == expected,
            "docs/state-table.md is stale; regenerate with \
             UPDATE_DOCS=1 cargo test -p vps-domain docs_state_table"
        );
    }

    fn state_table_doc() -> String {
        let mut doc = String::from(
            "# Instance state table\n\n\
             Generated from `domain/src/state_table.rs` by the test \
             `docs_state_table_md_holds_the_current_rendering`; do not edit by hand \
             (`UPDATE_DOCS=1 cargo test -p vps-domain docs_state_table` rewrites it).\n\n\
             Every state change of an instance is one of these rows; any other move is \
             `INVALID_STATE` and appends nothing.\n\n```mermaid\n",
        );
        doc.push_str(&render_mermaid());
        doc.push_str("```\n\n| from | verb | to |\n| --- | --- | --- |\n");
        for r in TABLE {
            doc.push_str(&format!("| {} | {} | {} |\n", r.from, r.verb, r.to));
        }
        doc.push_str(
            "\n# Sandbox state table\n\n\
             Generated from `domain/src/sandbox.rs` (`TABLE`) by the same test. A sandbox's \
             state moves only along these rows; its instance moves along the instance table \
             (a pause sets the instance's `desiredState: paused`, a resume `running`).\n\n\
             ```mermaid\n",
        );
        doc.push_str(&crate::sandbox::render_mermaid());
        doc.push_str("```\n\n| from | verb | to |\n| --- | --- | --- |\n");
        for (from, verb, to) in crate::sandbox::TABLE {
            doc.push_str(&format!("| {from} | {} | {to} |\n", verb.as_str()));
        }
        doc
    }

    fn any_state() -> impl Strategy<Value = InstanceState> {
        proptest::sample::select(InstanceState::ALL.to_vec())
    }

    fn any_verb() -> impl Strategy<Value = Verb> {
        proptest::sample::select(Verb::ALL.to_vec())
    }

    proptest! {
        #[test]
        fn transition_succeeds_exactly_for_rows_of_the_table(from in any_state(), verb in any_verb()) {
            let rows: Vec<_> = TABLE.iter().filter(|r| r.from == from && r.verb == verb).collect();
            match transition(from, verb) {
                Ok(to) => {
                    prop_assert_eq!(rows.len(), 1);
                    prop_assert_eq!(rows[0].to, to);
                }
                Err(error) => {
                    prop_assert_eq!(error.code(), crate::error::ErrorCode::InvalidState);
                    prop_assert!(rows.len() != 1);
                }
            }
        }

        #[test]
        fn any_sequence_of_verbs_stays_inside_the_table(verbs in proptest::collection::vec(any_verb(), 0..40)) {
            let mut state = S::Pending;
            for verb in verbs {
                if let Ok(to) = transition(state, verb) {
                    prop_assert!(allows(state, to));
                    state = to;
                }
            }
            // Whatever happened, deletion is always still possible or already done.
            prop_assert!(
                matches!(state, S::Deleting | S::Deleted) || transition(state, V::Delete).is_ok()
            );
        }

        #[test]
        fn every_walk_follows_rows_and_ends_where_asked(from in any_state(), to in any_state()) {
            if let Some(path) = walk(from, to, CONVERGE_VERBS) {
                let mut at = from;
                for r in &path {
                    prop_assert_eq!(r.from, at);
                    prop_assert!(TABLE.contains(r));
                    at = r.to;
                }
                prop_assert_eq!(at, to);
            }
        }
    }
}
