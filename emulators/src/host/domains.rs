//! The domains a host holds and the rules that move them toward the spec.
//!
//! No I/O and no clock reads (callers pass `now`), so the agent loop stays a thin shell around
//! these rules: fetch what [`Domains::user_data_wanted`] asks for, then [`Domains::converge`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::{Domain, DomainState};
use vps_seam::{DesiredState, InstanceSpec, NodeSpec, ReportEntry, ReportState, RestoreFrom};

/// Runtimes whose `RuntimeTraits.pause` is false in the reference.
const RUNTIMES_WITHOUT_PAUSE: &[&str] = &["containerd"];

const PAUSE_UNSUPPORTED: &str = "pause unsupported";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Power {
    Off,
    Booting { ready_at: Instant },
    On,
    Paused,
}

#[derive(Clone, Debug)]
enum Fault {
    /// `fail_instance`: holds until the spec deletes the instance.
    Injected(String),
    /// The server refused the user data at spec `generation`; a newer spec may fix it, so it
    /// is asked again then (and not before, so the server sees one steady ERROR).
    UserData { message: String, generation: u64 },
}

#[derive(Clone, Debug)]
struct Record {
    power: Power,
    fault: Option<Fault>,
    /// Host admission refused its first start: the `ResourcesExhausted: …` message.
    refused: Option<String>,
    /// The spec asks for a state this runtime cannot reach.
    unsupported: bool,
    /// Once started it is no longer "new", so `refuse_new` leaves it alone.
    started_once: bool,
    user_data: Option<String>,
    addresses: Vec<String>,
    /// Added by a test as a leak: kept when no spec lists it.
    stray: bool,
    /// A restore: the snapshot it booted from, once downloaded and its digest checked.
    restored: Option<String>,
    /// CPU seconds used since it started, accrued at its rate while it runs.
    cpu_seconds: f64,
}

impl Record {
    fn new() -> Self {
        Self {
            power: Power::Off,
            fault: None,
            refused: None,
            unsupported: false,
            started_once: false,
            user_data: None,
            addresses: Vec::new(),
            stray: false,
            restored: None,
            cpu_seconds: 0.0,
        }
    }

    fn state(&self) -> DomainState {
        if self.fault.is_some() || self.unsupported {
            return DomainState::Error;
        }
        match self.power {
            Power::Off => DomainState::Stopped,
            Power::Booting { .. } => DomainState::Booting,
            Power::On => DomainState::Running,
            Power::Paused => DomainState::Paused,
        }
    }

    fn message(&self) -> Option<String> {
        match &self.fault {
            Some(Fault::Injected(message)) | Some(Fault::UserData { message, .. }) => {
                Some(message.clone())
            }
            None if self.unsupported => Some(PAUSE_UNSUPPORTED.to_owned()),
            None => self.refused.clone(),
        }
    }

    /// Addresses exist for the server once the guest is up.
    fn reported_addresses(&self) -> Vec<String> {
        match self.power {
            Power::On | Power::Paused => self.addresses.clone(),
            Power::Off | Power::Booting { .. } => Vec::new(),
        }
    }
}

/// Every domain of one host, the spec it follows and its admission knob.
#[derive(Default)]
pub(super) struct Domains {
    records: BTreeMap<String, Record>,
    /// `None` until the first spec: nothing is destroyed before the host knows what is wanted.
    spec: Option<NodeSpec>,
    refuse_new: Option<String>,
    /// Set rates by domain id (kept for domains not made yet); others use `default_cpu_rate`.
    cpu_rates: BTreeMap<String, f64>,
    default_cpu_rate: f64,
    /// Until when CPU seconds are accrued (the host's clock).
    accrued_to: Option<chrono::DateTime<chrono::Utc>>,
}

impl Domains {
    /// Follows `spec` from now on.
    pub fn apply_spec(&mut self, spec: NodeSpec) {
        self.spec = Some(spec);
    }

    pub fn applied_generation(&self) -> Option<u64> {
        self.spec.as_ref().map(|spec| spec.generation)
    }

    /// The volumes the spec followed asks the host to keep.
    pub fn volumes(&self) -> Vec<vps_seam::VolumeSpec> {
        self.spec
            .as_ref()
            .map(|spec| spec.volumes.clone())
            .unwrap_or_default()
    }

    /// The `(instance id, secret reference)` pairs whose user data must be fetched before the
    /// instance can boot.
    pub fn user_data_wanted(&self) -> Vec<(String, String)> {
        let Some(spec) = &self.spec else {
            return Vec::new();
        };
        spec.instances
            .iter()
            .filter(|instance| wants_boot(instance))
            .filter_map(|instance| {
                let reference = instance.user_data_ref.as_ref()?;
                let record = self.records.get(&instance.id);
                let fetched = record.is_some_and(|record| record.user_data.is_some());
                let blocked = record.is_some_and(|record| match &record.fault {
                    Some(Fault::Injected(_)) => true,
                    Some(Fault::UserData { generation, .. }) => *generation >= spec.generation,
                    None => false,
                });
                let started = record.is_some_and(|record| record.started_once);
                // A refused new instance is asked for its user data once it may boot.
                let refused = self.refuse_new.is_some() && !started;
                (!fetched && !blocked && !refused).then(|| (instance.id.clone(), reference.clone()))
            })
            .collect()
    }

    /// The restores whose snapshot must be downloaded and checked before the instance boots.
    pub fn restores_wanted(&self) -> Vec<(String, RestoreFrom)> {
        let Some(spec) = &self.spec else {
            return Vec::new();
        };
        spec.instances
            .iter()
            .filter(|instance| wants_boot(instance) && self.refuse_new.is_none())
            .filter_map(|instance| {
                let restore = instance.restore_from.as_ref()?;
                let record = self.records.get(&instance.id);
                let done = record.is_some_and(|r| r.restored.is_some() || r.fault.is_some());
                (!done).then(|| (instance.id.clone(), restore.clone()))
            })
            .collect()
    }

    /// Records a restore's download: the snapshot booted from, or why it cannot be (a digest
    /// that does not match fails the instance until the spec deletes it).
    pub fn record_restore(&mut self, id: &str, outcome: Result<String, String>) {
        let record = self
            .records
            .entry(id.to_owned())
            .or_insert_with(Record::new);
        match outcome {
            Ok(snapshot_id) => record.restored = Some(snapshot_id),
            Err(message) => record.fault = Some(Fault::Injected(message)),
        }
    }

    /// Whether the domain of `id` is up (running or paused): what a snapshot needs.
    pub fn is_up(&self, id: &str) -> bool {
        self.records
            .get(id)
            .is_some_and(|r| r.fault.is_none() && matches!(r.power, Power::On | Power::Paused))
    }

    /// Records what `nodes.secret` answered for `id`: the value, or the refusal's message.
    pub fn record_user_data(&mut self, id: &str, answer: Result<String, String>) {
        let generation = self.applied_generation().unwrap_or_default();
        let record = self
            .records
            .entry(id.to_owned())
            .or_insert_with(Record::new);
        if matches!(record.fault, Some(Fault::Injected(_))) {
            return;
        }
        match answer {
            Ok(value) => {
                record.user_data = Some(value);
                record.fault = None;
            }
            Err(message) => {
                record.fault = Some(Fault::UserData {
                    message,
                    generation,
                })
            }
        }
    }

    /// Finishes the boots that are due, then moves every domain toward the spec.
    pub fn converge(&mut self, now: Instant, boot_delay: Duration) {
        for record in self.records.values_mut() {
            if matches!(record.power, Power::Booting { ready_at } if ready_at <= now) {
                record.power = Power::On;
            }
        }
        let Some(spec) = self.spec.take() else {
            return;
        };
        for instance in &spec.instances {
            self.converge_one(instance, spec.generation, now + boot_delay);
        }
        self.records.retain(|id, record| {
            record.stray || spec.instances.iter().any(|instance| &instance.id == id)
        });
        self.spec = Some(spec);
    }

    fn converge_one(&mut self, instance: &InstanceSpec, generation: u64, ready_at: Instant) {
        let id = &instance.id;
        match instance.desired_state {
            DesiredState::Deleted => {
                self.records.remove(id);
                return;
            }
            DesiredState::Unknown => return,
            DesiredState::Running | DesiredState::Stopped | DesiredState::Paused => {}
        }
        // A new instance that needs user data gets its domain once the data is fetched, so it
        // is never reported STOPPED on its way to booting.
        if wants_boot(instance)
            && self.refuse_new.is_none()
            && instance.user_data_ref.is_some()
            && !self.records.contains_key(id)
        {
            return;
        }
        let refuse_new = self.refuse_new.clone();
        let record = self.records.entry(id.clone()).or_insert_with(Record::new);
        record.addresses = addresses(instance);
        match &record.fault {
            Some(Fault::Injected(_)) => return,
            Some(Fault::UserData {
                generation: failed_at,
                ..
            }) if *failed_at >= generation => return,
            Some(Fault::UserData { .. }) | None => {}
        }
        record.unsupported = instance.desired_state == DesiredState::Paused
            && RUNTIMES_WITHOUT_PAUSE.contains(&instance.runtime.as_str());
        if record.unsupported {
            return;
        }
        if instance.desired_state == DesiredState::Stopped {
            record.power = Power::Off;
            record.refused = None;
            return;
        }
        let wants_paused = instance.desired_state == DesiredState::Paused;
        match record.power {
            Power::Off => {
                if !record.started_once {
                    if let Some(reason) = refuse_new {
                        record.refused = Some(format!("ResourcesExhausted: {reason}"));
                        return;
                    }
                }
                record.refused = None;
                if instance.restore_from.is_some() && record.restored.is_none() {
                    // Its snapshot is not downloaded and checked yet: next pass.
                    return;
                }
                if record.user_data.is_none() {
                    if instance.user_data_ref.is_some() {
                        // Not fetched yet (the refusal was just lifted): next pass.
                        return;
                    }
                    record.user_data = Some(String::new());
                }
                record.fault = None;
                record.started_once = true;
                record.power = Power::Booting { ready_at };
            }
            // A paused spec boots first and pauses once up, as the server's lifecycle walks.
            Power::Booting { .. } => {}
            Power::On if wants_paused => record.power = Power::Paused,
            Power::Paused if !wants_paused => record.power = Power::On,
            Power::On | Power::Paused => {}
        }
    }

    /// When the next boot finishes, so the loop wakes to report it.
    pub fn next_boot_at(&self) -> Option<Instant> {
        self.records
            .values()
            .filter_map(|record| match record.power {
                Power::Booting { ready_at } => Some(ready_at),
                _ => None,
            })
            .min()
    }

    /// The complete inventory, in id order.
    pub fn report(&self) -> Vec<ReportEntry> {
        self.records
            .iter()
            .map(|(id, record)| ReportEntry {
                id: id.clone(),
                state: match record.state() {
                    DomainState::Booting => ReportState::Unspecified,
                    DomainState::Running => ReportState::Running,
                    DomainState::Stopped => ReportState::Stopped,
                    DomainState::Paused => ReportState::Paused,
                    DomainState::Error => ReportState::Error,
                },
                message: record.message(),
                addresses: record.reported_addresses(),
                // A memory restore here keeps its source's identity (no fresh host keys).
                identity_rebound: None,
                cpu_seconds: matches!(record.power, Power::On | Power::Paused)
                    .then_some(record.cpu_seconds),
            })
            .collect()
    }

    pub fn snapshot(&self) -> BTreeMap<String, Domain> {
        self.records
            .iter()
            .map(|(id, record)| {
                let domain = Domain {
                    state: record.state(),
                    message: record.message(),
                    addresses: record.reported_addresses(),
                    user_data: record.user_data.clone(),
                    restored_from: record.restored.clone(),
                };
                (id.clone(), domain)
            })
            .collect()
    }

    pub fn fail(&mut self, id: &str, message: &str) {
        let record = self
            .records
            .entry(id.to_owned())
            .or_insert_with(Record::new);
        record.fault = Some(Fault::Injected(message.to_owned()));
    }

    pub fn refuse_new(&mut self, reason: Option<String>) {
        self.refuse_new = reason;
    }

    pub fn add_stray(&mut self, id: &str) {
        let record = self
            .records
            .entry(id.to_owned())
            .or_insert_with(Record::new);
        record.stray = true;
        record.started_once = true;
        record.power = Power::On;
        record.user_data.get_or_insert_with(String::new);
    }

    pub fn remove(&mut self, id: &str) {
        self.records.remove(id);
    }

    /// Sets the CPU seconds per second a domain uses while it runs (`None`: every domain
    /// without a rate of its own).
    pub fn set_cpu_rate(&mut self, id: Option<&str>, rate: f64) {
        match id {
            Some(id) => {
                self.cpu_rates.insert(id.to_owned(), rate);
            }
            None => self.default_cpu_rate = rate,
        }
    }

    /// Accrues each running domain's CPU seconds up to `now` (the host's clock) at its rate.
    pub fn accrue(&mut self, now: chrono::DateTime<chrono::Utc>) {
        let since = self.accrued_to.replace(now).unwrap_or(now);
        let seconds = (now - since).num_milliseconds().max(0) as f64 / 1e3;
        for (id, record) in &mut self.records {
            let rate = self
                .cpu_rates
                .get(id)
                .copied()
                .unwrap_or(self.default_cpu_rate);
            match record.power {
                Power::On => record.cpu_seconds += rate * seconds,
                // A guest that boots again counts from zero, as a new QEMU process does.
                Power::Off | Power::Booting { .. } => record.cpu_seconds = 0.0,
                Power::Paused => {}
            }
        }
    }
}

/// Whether the spec asks this instance to be up (a runtime that cannot pause is not booted
/// for a pause).
fn wants_boot(instance: &InstanceSpec) -> bool {
    match instance.desired_state {
        DesiredState::Running => true,
        DesiredState::Paused => !RUNTIMES_WITHOUT_PAUSE.contains(&instance.runtime.as_str()),
        DesiredState::Stopped | DesiredState::Deleted | DesiredState::Unknown => false,
    }
}

/// The NICs' addresses without their prefix length, as a guest would report them.
fn addresses(instance: &InstanceSpec) -> Vec<String> {
    instance
        .nics
        .iter()
        .filter_map(|nic| nic.address.as_deref())
        .map(|cidr| cidr.split('/').next().unwrap_or(cidr).to_owned())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(generation: u64, instances: serde_json::Value) -> NodeSpec {
        serde_json::from_value(serde_json::json!({
            "nodeId": "node_1", "generation": generation, "instances": instances
        }))
        .unwrap()
    }

    fn state(domains: &Domains, id: &str) -> Option<DomainState> {
        domains.snapshot().get(id).map(|domain| domain.state)
    }

    #[test]
    fn a_running_instance_without_user_data_boots_then_runs_after_the_delay() {
        let mut domains = Domains::default();
        let now = Instant::now();
        let delay = Duration::from_secs(1);
        domains.apply_spec(spec(
            1,
            serde_json::json!([{ "id": "inst_a", "desiredState": "running", "runtime": "libvirt-kvm",
                "nics": [{ "address": "10.0.0.2/24" }] }]),
        ));

        domains.converge(now, delay);
        assert_eq!(state(&domains, "inst_a"), Some(DomainState::Booting));
        assert_eq!(domains.report()[0].state, ReportState::Unspecified);
        assert!(domains.report()[0].addresses.is_empty());

        domains.converge(now + delay, delay);
        assert_eq!(state(&domains, "inst_a"), Some(DomainState::Running));
        assert_eq!(domains.report()[0].addresses, vec!["10.0.0.2".to_owned()]);
    }

    #[test]
    fn a_running_domain_reports_the_cpu_seconds_it_accrues_at_its_rate() {
        let mut domains = Domains::default();
        let now = Instant::now();
        let delay = Duration::from_secs(1);
        let two = serde_json::json!([
            { "id": "inst_a", "desiredState": "running", "runtime": "qemu" },
            { "id": "inst_b", "desiredState": "running", "runtime": "qemu" }
        ]);
        domains.apply_spec(spec(1, two));
        domains.set_cpu_rate(None, 0.25);
        domains.set_cpu_rate(Some("inst_b"), 1.0);
        let t0 = chrono::Utc::now();
        domains.converge(now, delay);
        domains.accrue(t0);
        let cpu = |d: &Domains| d.report().iter().map(|e| e.cpu_seconds).collect::<Vec<_>>();
        assert_eq!(cpu(&domains), vec![None, None], "booting: nothing to say");
        domains.converge(now + delay, delay);
        domains.accrue(t0);
        assert_eq!(
            cpu(&domains),
            vec![Some(0.0), Some(0.0)],
            "it ran for no time yet"
        );
        domains.accrue(t0 + chrono::TimeDelta::seconds(8));
        assert_eq!(cpu(&domains), vec![Some(2.0), Some(8.0)]);
    }

    #[test]
    fn an_instance_with_user_data_waits_for_it_before_it_has_a_domain() {
        let mut domains = Domains::default();
        let now = Instant::now();
        domains.apply_spec(spec(
            1,
            serde_json::json!([{ "id": "inst_a", "desiredState": "running",
                "userDataRef": "secret://inst_a" }]),
        ));

        assert_eq!(
            domains.user_data_wanted(),
            vec![("inst_a".to_owned(), "secret://inst_a".to_owned())]
        );
        domains.converge(now, Duration::ZERO);
        assert_eq!(state(&domains, "inst_a"), None);

        domains.record_user_data("inst_a", Ok("#cloud-config".to_owned()));
        domains.converge(now, Duration::from_secs(1));
        assert_eq!(state(&domains, "inst_a"), Some(DomainState::Booting));
        assert!(domains.user_data_wanted().is_empty());
    }

    #[test]
    fn refused_user_data_is_an_error_until_a_newer_spec() {
        let mut domains = Domains::default();
        let instances = serde_json::json!([{ "id": "inst_a", "desiredState": "running",
            "userDataRef": "secret://inst_a" }]);
        domains.apply_spec(spec(1, instances.clone()));
        domains.record_user_data("inst_a", Err("NOT_FOUND (404): gone".to_owned()));
        domains.converge(Instant::now(), Duration::ZERO);

        assert_eq!(state(&domains, "inst_a"), Some(DomainState::Error));
        assert!(domains.user_data_wanted().is_empty());

        domains.apply_spec(spec(2, instances));
        assert_eq!(domains.user_data_wanted().len(), 1);
    }

    #[test]
    fn a_paused_containerd_instance_is_an_error_and_others_pause_once_up() {
        let mut domains = Domains::default();
        let now = Instant::now();
        domains.apply_spec(spec(
            1,
            serde_json::json!([
                { "id": "inst_c", "desiredState": "paused", "runtime": "containerd" },
                { "id": "inst_k", "desiredState": "paused", "runtime": "libvirt-kvm" },
            ]),
        ));
        domains.converge(now, Duration::ZERO);
        domains.converge(now, Duration::ZERO);

        let snapshot = domains.snapshot();
        assert_eq!(snapshot["inst_c"].state, DomainState::Error);
        assert_eq!(
            snapshot["inst_c"].message.as_deref(),
            Some("pause unsupported")
        );
        assert_eq!(snapshot["inst_k"].state, DomainState::Paused);
    }

    #[test]
    fn domains_missing_from_the_spec_are_destroyed_but_strays_stay() {
        let mut domains = Domains::default();
        domains.add_stray("inst_stray");
        domains.fail("inst_gone", "boom");
        domains.apply_spec(spec(1, serde_json::json!([])));
        domains.converge(Instant::now(), Duration::ZERO);

        assert_eq!(
            domains.snapshot().keys().collect::<Vec<_>>(),
            vec!["inst_stray"]
        );
    }
}
