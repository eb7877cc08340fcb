//! What to do with one guest, and how to report it: pure functions of the spec's entry, what
//! the runtime sees and what the agent remembers. No I/O, so every case is a table test.

use vps_seam::{DesiredState, InstanceSpec, ReportEntry, ReportState};

use crate::runtime::GuestState;

/// One runtime operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Boot, or resume a paused guest.
    Run,
    /// Clean shutdown; the disk stays.
    Stop,
    /// Freeze (booting first if need be).
    Pause,
    /// Kill and remove everything.
    Delete,
}

impl Action {
    /// The operation's name in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Run => "run",
            Action::Stop => "stop",
            Action::Pause => "pause",
            Action::Delete => "delete",
        }
    }
}

/// What the agent does with a guest this pass.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Nothing to do.
    Nothing,
    /// Ask the runtime for this.
    Act(Action),
    /// The spec cannot be run here: report `ERROR` with this message, and touch nothing.
    Refuse(String),
}

/// What this host can give one guest.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostLimits {
    /// The runtime's name (`qemu`).
    pub runtime: &'static str,
    /// The host's CPUs.
    pub vcpus: u32,
    /// The host's memory.
    pub memory_mib: u64,
}

/// What the agent remembers of a guest beyond what the runtime sees.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    /// The guest ended on its own (powered off, or its QEMU died) while the spec wanted it up:
    /// it stays as it is until its spec entry changes. The server decides what follows.
    pub ended_on_its_own: bool,
    /// The last operation failed: it is tried again only once its back-off ends or its spec
    /// entry changes, and the guest is reported `ERROR` with this message meanwhile.
    pub failed: Option<String>,
    /// The failed operation may be tried again now.
    pub retry_due: bool,
    /// An operation runs on the guest now.
    pub busy: Option<Action>,
}

/// Decides what to do with one guest: `spec` is its entry in the NodeSpec (`None`: not in
/// it), `observed` what the runtime sees (`None`: the runtime holds nothing of it).
pub fn decide(
    spec: Option<&InstanceSpec>,
    observed: Option<&GuestState>,
    memory: &Memory,
    limits: &HostLimits,
) -> Decision {
    if memory.busy.is_some() {
        return Decision::Nothing;
    }
    let Some(spec) = spec else {
        // Placed here by no spec entry (deleted while the agent was away, or never ours).
        return match observed {
            Some(_) => Decision::Act(Action::Delete),
            None => Decision::Nothing,
        };
    };
    if spec.desired_state == DesiredState::Deleted {
        return match observed {
            Some(_) => Decision::Act(Action::Delete),
            None => Decision::Nothing,
        };
    }
    if spec.desired_state == DesiredState::Unknown {
        return Decision::Nothing;
    }
    // An existing guest is not checked again: it runs already, whatever changed since.
    if observed.is_none() {
        if let Err(why) = check(spec, limits) {
            return Decision::Refuse(why);
        }
    }
    let wanted = match (spec.desired_state, observed) {
        (DesiredState::Running, Some(GuestState::Running)) => return Decision::Nothing,
        (DesiredState::Running, Some(GuestState::Paused)) => Action::Run,
        (DesiredState::Running, _) => Action::Run,
        (DesiredState::Paused, Some(GuestState::Paused)) => return Decision::Nothing,
        (DesiredState::Paused, _) => Action::Pause,
        (DesiredState::Stopped, Some(GuestState::Running | GuestState::Paused)) => Action::Stop,
        // An errored guest is stopped so that nothing of it runs, and it reads `STOPPED`.
        (DesiredState::Stopped, Some(GuestState::Error(_))) => Action::Stop,
        (DesiredState::Stopped, Some(GuestState::Stopped) | None) => return Decision::Nothing,
        (DesiredState::Deleted | DesiredState::Unknown, _) => return Decision::Nothing,
    };
    let comes_back = matches!(wanted, Action::Run | Action::Pause)
        && matches!(observed, Some(GuestState::Stopped | GuestState::Error(_)));
    if comes_back && memory.ended_on_its_own {
        return Decision::Nothing;
    }
    if memory.failed.is_some() && !memory.retry_due {
        return Decision::Nothing;
    }
    Decision::Act(wanted)
}

/// Whether this host can run `spec` at all: its runtime, its size, its image.
pub fn check(spec: &InstanceSpec, limits: &HostLimits) -> Result<(), String> {
    if !spec.runtime.is_empty() && spec.runtime != limits.runtime {
        return Err(format!(
            "unknown runtime {:?}: this host runs {:?}",
            spec.runtime, limits.runtime
        ));
    }
    let Some(shape) = spec.shape else {
        return Err("the spec names no shape (vcpu, memoryGiB, diskGiB)".into());
    };
    let memory_mib = u64::from(shape.memory_gib) * 1024;
    if shape.vcpu == 0 || memory_mib == 0 {
        return Err(format!(
            "the flavor has {} vCPU and {} GiB of memory: both must be at least 1",
            shape.vcpu, shape.memory_gib
        ));
    }
    if shape.vcpu > limits.vcpus || memory_mib > limits.memory_mib {
        return Err(format!(
            "the flavor ({} vCPU, {} GiB) is larger than this host ({} vCPU, {} MiB)",
            shape.vcpu, shape.memory_gib, limits.vcpus, limits.memory_mib
        ));
    }
    let image = spec.image.clone().unwrap_or_default();
    let (Some(url), Some(sha256)) = (image.url.as_deref(), image.sha256.as_deref()) else {
        return Err("the image has no url or no sha256: nothing can be fetched and checked".into());
    };
    if url.is_empty() || sha256.len() != 64 || !sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(format!(
            "the image's url {url:?} or sha256 {sha256:?} is not usable (a URL and 64 hex digits)"
        ));
    }
    match image.format.as_deref() {
        Some("bundle" | "qcow2") => {}
        other => {
            return Err(format!(
                "image format {other:?} is not supported: bundle or qcow2"
            ))
        }
    }
    if spec.nics.iter().any(|nic| nic.address.is_none()) {
        return Err("a NIC has no address".into());
    }
    Ok(())
}

/// One guest's report line, or `None` when the report leaves it out (deleted and gone).
pub fn report(
    id: &str,
    spec: Option<&InstanceSpec>,
    observed: Option<&(GuestState, Vec<String>)>,
    memory: &Memory,
    refusal: Option<&str>,
) -> Option<ReportEntry> {
    // A memory restore is given a fresh machine id and host keys as it resumes (its links
    // stay down until the guest has taken them): its identity is its own, unless the runtime
    // says it is still pending (`Runtime::identity_pending`, checked by the caller).
    let restored = spec
        .and_then(|s| s.restore_from.as_ref())
        .is_some_and(|r| r.include_memory);
    let entry = |state, message: Option<String>, addresses: Vec<String>| ReportEntry {
        id: id.to_owned(),
        identity_rebound: (restored && matches!(state, ReportState::Running | ReportState::Paused))
            .then_some(true),
        state,
        message,
        addresses,
        cpu_seconds: None,
    };
    if let Some(why) = refusal {
        return Some(entry(ReportState::Error, Some(why.to_owned()), Vec::new()));
    }
    if let Some(message) = &memory.failed {
        return Some(entry(ReportState::Error, Some(message.clone()), Vec::new()));
    }
    let desired = spec.map(|s| s.desired_state);
    let Some((state, addresses)) = observed else {
        return match desired {
            // Nothing made yet: a guest never booted is stopped.
            Some(DesiredState::Stopped) => Some(entry(ReportState::Stopped, None, Vec::new())),
            Some(DesiredState::Running | DesiredState::Paused) => {
                Some(entry(ReportState::Unspecified, None, Vec::new()))
            }
            Some(DesiredState::Deleted | DesiredState::Unknown) | None => None,
        };
    };
    // While a boot or a resume runs, what the runtime saw before it is not news.
    let arriving = matches!(memory.busy, Some(Action::Run | Action::Pause));
    let line = match state {
        GuestState::Running => entry(ReportState::Running, None, addresses.clone()),
        GuestState::Paused if memory.busy == Some(Action::Run) => {
            entry(ReportState::Unspecified, None, Vec::new())
        }
        GuestState::Paused => entry(ReportState::Paused, None, addresses.clone()),
        _ if arriving => entry(ReportState::Unspecified, None, Vec::new()),
        GuestState::Stopped => entry(ReportState::Stopped, None, Vec::new()),
        GuestState::Error(message) => entry(ReportState::Error, Some(message.clone()), Vec::new()),
    };
    Some(line)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn limits() -> HostLimits {
        HostLimits {
            runtime: "qemu",
            vcpus: 2,
            memory_mib: 4096,
        }
    }

    fn spec(desired: &str) -> InstanceSpec {
        serde_json::from_value(json!({
            "id": "inst_a", "desiredState": desired, "runtime": "qemu",
            "shape": { "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 },
            "image": { "url": "http://images/min.tar", "sha256": "a".repeat(64), "format": "bundle" },
            "nics": [{ "bridge": "br0", "mac": "02:00:00:00:00:01", "address": "10.0.0.2/24" }]
        }))
        .unwrap()
    }

    fn error() -> GuestState {
        GuestState::Error("qemu exited with status 9".into())
    }

    #[test]
    fn each_desired_state_meets_each_observed_state() {
        use Action::*;
        use Decision::{Act, Nothing};
        let idle = Memory::default();
        let table: Vec<(&str, Option<GuestState>, Decision)> = vec![
            ("running", None, Act(Run)),
            ("running", Some(GuestState::Running), Nothing),
            ("running", Some(GuestState::Paused), Act(Run)),
            ("running", Some(GuestState::Stopped), Act(Run)),
            ("running", Some(error()), Act(Run)),
            ("paused", None, Act(Pause)),
            ("paused", Some(GuestState::Running), Act(Pause)),
            ("paused", Some(GuestState::Paused), Nothing),
            ("paused", Some(GuestState::Stopped), Act(Pause)),
            ("stopped", None, Nothing),
            ("stopped", Some(GuestState::Running), Act(Stop)),
            ("stopped", Some(GuestState::Paused), Act(Stop)),
            ("stopped", Some(GuestState::Stopped), Nothing),
            ("stopped", Some(error()), Act(Stop)),
            ("deleted", None, Nothing),
            ("deleted", Some(GuestState::Running), Act(Delete)),
            ("deleted", Some(GuestState::Stopped), Act(Delete)),
            ("hibernated", Some(GuestState::Running), Nothing),
            ("hibernated", None, Nothing),
        ];
        for (desired, observed, expected) in table {
            let got = decide(Some(&spec(desired)), observed.as_ref(), &idle, &limits());
            assert_eq!(got, expected, "{desired} / {observed:?}");
        }
    }

    #[test]
    fn a_guest_no_spec_names_is_deleted() {
        let idle = Memory::default();
        let running = GuestState::Running;
        assert_eq!(
            decide(None, Some(&running), &idle, &limits()),
            Decision::Act(Action::Delete)
        );
        assert_eq!(decide(None, None, &idle, &limits()), Decision::Nothing);
    }

    #[test]
    fn a_busy_guest_waits_for_its_operation() {
        let busy = Memory {
            busy: Some(Action::Stop),
            ..Memory::default()
        };
        let running = GuestState::Running;
        let s = spec("deleted");
        assert_eq!(
            decide(Some(&s), Some(&running), &busy, &limits()),
            Decision::Nothing
        );
    }

    #[test]
    fn a_guest_that_ended_on_its_own_is_left_until_its_spec_changes() {
        let ended = Memory {
            ended_on_its_own: true,
            ..Memory::default()
        };
        for observed in [GuestState::Stopped, error()] {
            let got = decide(Some(&spec("running")), Some(&observed), &ended, &limits());
            assert_eq!(got, Decision::Nothing, "{observed:?}");
        }
        // Asked to stop, it is stopped (an errored QEMU is cleaned up).
        let got = decide(Some(&spec("stopped")), Some(&error()), &ended, &limits());
        assert_eq!(got, Decision::Act(Action::Stop));
    }

    #[test]
    fn a_failed_operation_waits_for_its_retry() {
        let mut failed = Memory {
            failed: Some("download failed".into()),
            ..Memory::default()
        };
        let s = spec("running");
        assert_eq!(
            decide(Some(&s), None, &failed, &limits()),
            Decision::Nothing
        );
        failed.retry_due = true;
        assert_eq!(
            decide(Some(&s), None, &failed, &limits()),
            Decision::Act(Action::Run)
        );
    }

    #[test]
    fn a_spec_this_host_cannot_run_is_refused_with_why() {
        let idle = Memory::default();
        let refused = |s: InstanceSpec| match decide(Some(&s), None, &idle, &limits()) {
            Decision::Refuse(why) => why,
            other => panic!("not refused: {other:?}"),
        };
        let mut s = spec("running");
        s.runtime = "firecracker".into();
        assert!(refused(s).contains("unknown runtime \"firecracker\""));
        let mut s = spec("running");
        s.shape.as_mut().unwrap().vcpu = 64;
        assert!(refused(s).contains("larger than this host"));
        let mut s = spec("running");
        s.shape.as_mut().unwrap().memory_gib = 5;
        assert!(refused(s).contains("larger than this host"));
        let mut s = spec("stopped");
        s.image.as_mut().unwrap().sha256 = Some("abc".into());
        assert!(refused(s).contains("64 hex digits"));
        let mut s = spec("paused");
        s.image.as_mut().unwrap().format = Some("vmdk".into());
        assert!(refused(s).contains("\"vmdk\""));
        // A guest that exists is not checked again.
        let mut s = spec("running");
        s.shape.as_mut().unwrap().vcpu = 64;
        let paused = GuestState::Paused;
        assert_eq!(
            decide(Some(&s), Some(&paused), &idle, &limits()),
            Decision::Act(Action::Run)
        );
    }

    #[test]
    fn report_lines_follow_the_runtime_and_the_agent_memory() {
        let idle = Memory::default();
        let addresses = vec!["10.0.0.2/24".to_string()];
        let running = (GuestState::Running, addresses.clone());
        let line = report(
            "inst_a",
            Some(&spec("running")),
            Some(&running),
            &idle,
            None,
        )
        .unwrap();
        assert_eq!(line.state, ReportState::Running);
        assert_eq!(line.addresses, addresses);

        // Not made yet: booting is UNSPECIFIED, never booted and stopped is STOPPED.
        let line = report("inst_a", Some(&spec("running")), None, &idle, None).unwrap();
        assert_eq!(line.state, ReportState::Unspecified);
        let line = report("inst_a", Some(&spec("stopped")), None, &idle, None).unwrap();
        assert_eq!(line.state, ReportState::Stopped);
        // Deleted and gone: left out, so the complete report completes the deletion.
        assert_eq!(
            report("inst_a", Some(&spec("deleted")), None, &idle, None),
            None
        );

        // A boot in flight is not reported stopped.
        let booting = Memory {
            busy: Some(Action::Run),
            ..Memory::default()
        };
        let stopped = (GuestState::Stopped, addresses.clone());
        let line = report(
            "inst_a",
            Some(&spec("running")),
            Some(&stopped),
            &booting,
            None,
        );
        assert_eq!(line.unwrap().state, ReportState::Unspecified);

        // A crash says why; a failed operation and a refusal too.
        let crashed = (error(), addresses.clone());
        let line = report(
            "inst_a",
            Some(&spec("running")),
            Some(&crashed),
            &idle,
            None,
        )
        .unwrap();
        assert_eq!(
            (line.state, line.message.as_deref()),
            (ReportState::Error, Some("qemu exited with status 9"))
        );
        let failed = Memory {
            failed: Some("image digest mismatch".into()),
            ..Memory::default()
        };
        let line = report("inst_a", Some(&spec("running")), None, &failed, None).unwrap();
        assert_eq!(line.message.as_deref(), Some("image digest mismatch"));
        let line = report(
            "inst_a",
            Some(&spec("running")),
            None,
            &idle,
            Some("too big"),
        );
        assert_eq!(line.unwrap().state, ReportState::Error);
    }
}
