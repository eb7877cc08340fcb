//! The agent's loop: long-poll the NodeSpec, converge every guest through the runtime, report.
//!
//! On start the agent re-adopts the guests of its state directory and reports them (an
//! incomplete report: it has not read its spec yet) before it converges anything, so a restart
//! never reboots a running guest. Then each pass waits for whichever comes first (a spec
//! answer, an operation finishing, the next look at the guests, a report falling due, the end
//! of a back-off), looks at the guests, starts the operations [`converge::decide`] asks for,
//! and reports when the inventory changed or the interval passed.
//!
//! Guests are converged concurrently, one operation at a time per guest: each operation is a
//! task of its own that tells the loop when it ends. A guest the spec cannot run here, or whose
//! operation failed, is reported `ERROR` with why; the loop itself never fails, and backs off
//! while the server does.

pub mod converge;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio::time::{sleep_until, Instant};
use tracing::Instrument;
use vps_seam::{
    CallError, CommandResult, DesiredState, HostCommand, InstanceSpec, NodeApi, NodeSpec,
    ReportEntry, ReportPacer, ReportState,
};

use crate::config::AgentTimings;
use crate::runtime::{
    GuestSpec, GuestState, ImageRef, NetworkMode, NetworkPolicy, NicSpec, Observed, RestoreSource,
    Runtime, SshCa, VolumeAttachment, VolumeSpec,
};
use crate::tunnel::Targets;
use converge::{Action, Decision, HostLimits, Memory};

const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// The longest wait before a failed operation is tried again.
const MAX_RETRY: Duration = Duration::from_secs(300);
/// How long a report waits for operations just started: one that ends meanwhile (a resume
/// takes a few ms) is reported done in that report, instead of the loop first sitting through
/// a round trip that only says "busy" (3-8 ms off each warm claim).
const REPORT_GRACE: Duration = Duration::from_millis(20);

type SpecPoll = Pin<Box<dyn Future<Output = Result<NodeSpec, CallError>> + Send>>;

/// What the loop needs besides the runtime.
pub struct AgentParts {
    /// The node calls.
    pub api: NodeApi,
    /// How the loop is paced.
    pub timings: AgentTimings,
    /// What one guest may have.
    pub limits: HostLimits,
    /// The bridge every tap attaches to, overriding the spec's.
    pub bridge: Option<String>,
    /// The running guests the tunnel may reach, kept up to date by the loop.
    pub targets: Arc<Targets>,
    /// Where snapshot archives wait for their upload.
    pub snapshot_dir: PathBuf,
    /// The public half of the key the tunnel logs in to guests with (`crate::guest_key`).
    pub guest_public_key: String,
}

/// Runs the loop until its task is aborted. Guests outlive it: the runtime runs them apart.
pub async fn run<R: Runtime>(runtime: Arc<R>, parts: AgentParts) {
    let (done_tx, done_rx) = mpsc::unbounded_channel();
    let (results_tx, results_rx) = mpsc::unbounded_channel();
    let mut agent = Agent {
        runtime,
        api: parts.api,
        timings: parts.timings,
        limits: parts.limits,
        bridge: parts.bridge,
        targets: parts.targets,
        specs: None,
        snapshot_dir: parts.snapshot_dir,
        guest_public_key: parts.guest_public_key,
        commands: BTreeMap::new(),
        results_tx,
        results_rx,
        generation: None,
        observed: BTreeMap::new(),
        guests: HashMap::new(),
        refusals: BTreeMap::new(),
        user_data: Arc::default(),
        volumes: Arc::default(),
        done_tx,
        done_rx,
        spec_poll: None,
        pacer: ReportPacer::new(FIRST_BACKOFF, MAX_BACKOFF),
        next_look: Instant::now(),
        report_hold: None,
    };
    agent.adopt().await;
    for pass in 0u64.. {
        let span = tracing::debug_span!("host_pass", pass);
        agent.pass().instrument(span).await;
    }
}

/// An operation that ended.
struct Done {
    id: String,
    action: Action,
    /// The spec entry it acted on.
    spec: Option<InstanceSpec>,
    result: Result<(), String>,
}

/// What the agent keeps of one guest.
#[derive(Default)]
struct Guest {
    memory: Memory,
    /// The spec entry `memory`'s hold or failure belongs to: a new entry clears them.
    pinned: Option<InstanceSpec>,
    /// When a failed operation may be tried again, and the wait after the next failure.
    retry_at: Option<Instant>,
    retry_after: Option<Duration>,
    /// The agent brought it up (or found it up): if it is found down, it went down on its own.
    up_expected: bool,
    /// Found powered off by its own doing when the agent started: `memory.ended_on_its_own`
    /// holds it down, pinned to the first spec entry the agent reads.
    pin_first_spec: bool,
}

struct Agent<R> {
    runtime: Arc<R>,
    api: NodeApi,
    timings: AgentTimings,
    limits: HostLimits,
    bridge: Option<String>,
    targets: Arc<Targets>,
    /// The spec's instances by id; `None` until the first spec.
    specs: Option<BTreeMap<String, InstanceSpec>>,
    snapshot_dir: PathBuf,
    guest_public_key: String,
    /// The spec's host commands: `None` while one runs, then its outcome, reported until the
    /// spec drops the command.
    commands: BTreeMap<String, Option<CommandResult>>,
    results_tx: mpsc::UnboundedSender<CommandResult>,
    results_rx: mpsc::UnboundedReceiver<CommandResult>,
    generation: Option<u64>,
    observed: BTreeMap<String, (GuestState, Vec<String>)>,
    guests: HashMap<String, Guest>,
    /// Spec entries this host cannot run, and why.
    refusals: BTreeMap<String, String>,
    /// Unsealed user data by instance, fetched once per agent life.
    user_data: Arc<Mutex<HashMap<String, Option<Vec<u8>>>>>,
    /// The node's volumes as the last spec lists them, by id.
    volumes: Arc<Mutex<BTreeMap<String, VolumeSpec>>>,
    done_tx: mpsc::UnboundedSender<Done>,
    done_rx: mpsc::UnboundedReceiver<Done>,
    spec_poll: Option<SpecPoll>,
    pacer: ReportPacer,
    next_look: Instant,
    /// Reports wait until then while an operation started in the meantime still runs.
    report_hold: Option<Instant>,
}

impl<R: Runtime> Agent<R> {
    /// Re-adopts the guests of the state directory and reports them before anything else.
    async fn adopt(&mut self) {
        let adopted = self.runtime.adopt().await;
        tracing::info!(guests = adopted.len(), "guests re-adopted");
        self.take_observed(adopted);
        for (id, (state, _)) in &self.observed {
            let guest = self.guests.entry(id.clone()).or_default();
            guest.up_expected = matches!(state, GuestState::Running | GuestState::Paused);
            // A guest that powered itself off while no agent ran stays off, as it would have
            // had this agent been watching: what follows is the server's to ask.
            if *state == GuestState::Stopped && self.runtime.powered_itself_off(id) {
                guest.memory.ended_on_its_own = true;
                guest.pin_first_spec = true;
            }
        }
        self.publish_targets();
        if self.observed.is_empty() {
            return;
        }
        // Incomplete: an instance placed here that the agent has not made yet is not absent.
        let entries: Vec<ReportEntry> = self
            .observed
            .iter()
            .filter_map(|(id, observed)| {
                converge::report(id, None, Some(observed), &Memory::default(), None)
            })
            .collect();
        match self.api.report(&entries, None, &[], false).await {
            Ok(_) => crate::metrics::reported(),
            Err(error) => self.failed("nodes.report", &error),
        }
    }

    async fn pass(&mut self) {
        let now = Instant::now();
        let backing_off = self.pacer.backing_off(now);
        if !backing_off && self.spec_poll.is_none() {
            self.spec_poll = Some(self.poll_spec());
        }
        let wake = self.next_wake(backing_off);
        tokio::select! {
            answer = outstanding(&mut self.spec_poll) => {
                self.spec_poll = None;
                match answer {
                    Ok(spec) => {
                        self.succeeded();
                        self.take_spec(spec);
                        // Act on the new spec before looking at every guest: a claimed warm
                        // guest's `cont` need not wait for a round trip to each QEMU. The
                        // last look is at most `observe_interval` old, and an operation
                        // checks its guest again itself.
                        self.converge();
                    }
                    Err(error) => self.failed("nodes.spec", &error),
                }
            }
            Some(done) = self.done_rx.recv() => self.take_done(done),
            Some(result) = self.results_rx.recv() => self.take_result(result),
            _ = sleep_until(wake) => {}
        }
        while let Ok(done) = self.done_rx.try_recv() {
            self.take_done(done);
        }
        while let Ok(result) = self.results_rx.try_recv() {
            self.take_result(result);
        }
        self.look().await;
        self.converge();
        self.report_if_needed().await;
    }

    fn poll_spec(&self) -> SpecPoll {
        let api = self.api.clone();
        let after = self.generation;
        let wait = self.timings.poll_wait;
        Box::pin(async move { api.spec(after, wait).await })
    }

    /// The earliest of: the next look at the guests, a report falling due, a retry coming due,
    /// the back-off ending.
    fn next_wake(&self, backing_off: bool) -> Instant {
        let report = self
            .pacer
            .wake_at(backing_off, self.timings.report_interval);
        let retries = self.guests.values().filter_map(|g| g.retry_at);
        [self.next_look]
            .into_iter()
            .chain(report)
            .chain(self.report_hold)
            .chain(retries)
            .min()
            .unwrap_or(self.next_look)
    }

    fn take_spec(&mut self, spec: NodeSpec) {
        tracing::debug!(generation = spec.generation, "spec received");
        let specs: BTreeMap<String, InstanceSpec> = spec
            .instances
            .into_iter()
            .map(|i| (i.id.clone(), i))
            .collect();
        // A changed entry is a new request: what was held or failed under the old one is over.
        for (id, guest) in &mut self.guests {
            let entry = specs.get(id);
            if guest.pin_first_spec {
                guest.pin_first_spec = false;
                guest.pinned = entry.cloned();
                continue;
            }
            if guest.pinned.is_some() && guest.pinned.as_ref() != entry {
                guest.memory.ended_on_its_own = false;
                guest.memory.failed = None;
                guest.pinned = None;
                guest.retry_at = None;
                guest.retry_after = None;
            }
        }
        // Commands the spec no longer names are settled; new ones start.
        let named: BTreeSet<&str> = spec.commands.iter().map(|c| c.id.as_str()).collect();
        self.commands.retain(|id, _| named.contains(id.as_str()));
        for command in &spec.commands {
            if !self.commands.contains_key(&command.id) {
                self.commands.insert(command.id.clone(), None);
                self.run_command(command.clone());
            }
        }
        self.specs = Some(specs);
        self.generation = Some(spec.generation);
        self.take_volumes(&spec.volumes);
    }

    fn take_result(&mut self, result: CommandResult) {
        tracing::info!(command = %result.id, ok = result.ok, reason = ?result.reason, "host command finished");
        if let Some(slot) = self.commands.get_mut(&result.id) {
            *slot = Some(result);
        }
    }

    /// Runs a host command in a task of its own: a snapshot is taken into one archive,
    /// uploaded to the command's URL with exactly its headers, and removed.
    fn run_command(&self, command: HostCommand) {
        let runtime = self.runtime.clone();
        let results = self.results_tx.clone();
        let dir = self.snapshot_dir.join(&command.id);
        let span = tracing::info_span!("host_command", command = %command.id, kind = %command.kind);
        tokio::spawn(
            async move {
                let result = match snapshot(runtime.as_ref(), &command, &dir).await {
                    Ok(result) => result,
                    Err(reason) => CommandResult::failed(&command.id, reason),
                };
                let _ = std::fs::remove_dir_all(&dir);
                // The loop outlives its commands; if it is gone, no one is left to tell.
                let _ = results.send(result);
            }
            .instrument(span),
        );
    }

    /// The outcomes of the spec's finished commands.
    fn command_results(&self) -> Vec<CommandResult> {
        self.commands.values().flatten().cloned().collect()
    }

    fn take_done(&mut self, done: Done) {
        let guest = self.guests.entry(done.id.clone()).or_default();
        guest.memory.busy = None;
        match done.result {
            Ok(()) => {
                tracing::info!(guest = %done.id, operation = done.action.as_str(), "done");
                guest.memory.failed = None;
                guest.pinned = None;
                guest.retry_at = None;
                guest.retry_after = None;
                guest.up_expected = matches!(done.action, Action::Run | Action::Pause);
                if done.action == Action::Delete {
                    self.guests.remove(&done.id);
                    lock(&self.user_data).remove(&done.id);
                }
            }
            Err(message) => {
                let wait = guest.retry_after.unwrap_or(self.timings.retry_after);
                tracing::warn!(guest = %done.id, operation = done.action.as_str(), %message,
                    retry_in_s = wait.as_secs_f64(), "operation failed");
                guest.memory.failed = Some(message);
                guest.pinned = done.spec;
                guest.retry_at = Some(Instant::now() + wait);
                guest.retry_after = Some((wait * 2).min(MAX_RETRY));
            }
        }
    }

    /// Looks at every guest, and notes those that went down on their own.
    async fn look(&mut self) {
        let observed = self.runtime.observe().await;
        self.take_observed(observed);
        self.next_look = Instant::now() + self.timings.observe_interval;
        let now = Instant::now();
        for (id, guest) in &mut self.guests {
            guest.memory.retry_due = guest.retry_at.is_some_and(|at| at <= now);
            if guest.memory.busy.is_some() || !guest.up_expected {
                continue;
            }
            let down = matches!(
                self.observed.get(id),
                Some((GuestState::Stopped | GuestState::Error(_), _))
            );
            if !down {
                continue;
            }
            guest.up_expected = false;
            let entry = self.specs.as_ref().and_then(|s| s.get(id));
            let wanted_up = entry.is_some_and(|s| {
                matches!(
                    s.desired_state,
                    DesiredState::Running | DesiredState::Paused
                )
            });
            if wanted_up {
                let state = &self.observed[id].0;
                tracing::warn!(guest = %id, ?state, "guest went down on its own");
                guest.memory.ended_on_its_own = true;
                guest.pinned = entry.cloned();
            }
        }
        self.publish_targets();
    }

    fn take_observed(&mut self, observed: Vec<Observed>) {
        self.observed = observed
            .into_iter()
            .map(|o| (o.id, (o.state, o.addresses)))
            .collect();
    }

    /// Tells the tunnel which guests run and whom each admits.
    fn publish_targets(&self) {
        let specs = self.specs.as_ref();
        let targets = self
            .observed
            .iter()
            .filter(|(_, (state, _))| *state == GuestState::Running)
            .map(|(id, _)| {
                let principal = specs
                    .and_then(|s| s.get(id))
                    .and_then(|s| s.ssh_ca.as_ref())
                    .map_or_else(|| id.clone(), |ca| ca.principal.clone());
                (id.clone(), principal)
            })
            .collect();
        self.targets.set(targets);
    }

    /// Starts the operations the guests need. Nothing happens before the first spec.
    fn converge(&mut self) {
        let Some(specs) = &self.specs else { return };
        let ids: BTreeSet<String> = specs.keys().chain(self.observed.keys()).cloned().collect();
        self.refusals.clear();
        let mut start = Vec::new();
        for id in ids {
            let spec = specs.get(&id);
            let observed = self.observed.get(&id).map(|(state, _)| state);
            let guest = self.guests.entry(id.clone()).or_default();
            match converge::decide(spec, observed, &guest.memory, &self.limits) {
                Decision::Nothing => {}
                Decision::Refuse(why) => {
                    self.refusals.insert(id, why);
                }
                Decision::Act(action) => {
                    guest.memory.busy = Some(action);
                    guest.memory.retry_due = false;
                    if action == Action::Stop || action == Action::Delete {
                        guest.up_expected = false;
                    }
                    start.push((id, action, spec.cloned()));
                }
            }
        }
        // Forget guests that are gone and that no spec names.
        let observed = &self.observed;
        self.guests.retain(|id, g| {
            g.memory.busy.is_some() || observed.contains_key(id) || specs.contains_key(id)
        });
        // Never extended: a stream of new operations delays reports by one grace at most.
        if !start.is_empty() && self.report_hold.is_none() {
            self.report_hold = Some(Instant::now() + REPORT_GRACE);
        }
        for (id, action, spec) in start {
            self.start(id, action, spec);
        }
    }

    /// Keeps the node's volumes as the spec lists them: each listed one made or grown, each
    /// no longer listed removed (one a guest still attaches stays until it does not).
    fn take_volumes(&self, listed: &[vps_seam::VolumeSpec]) {
        let wanted: BTreeMap<String, VolumeSpec> = listed
            .iter()
            .map(|v| {
                let volume = VolumeSpec {
                    id: v.id.clone(),
                    size_gib: v.size_gib,
                    serial: v.serial.clone(),
                };
                (v.id.clone(), volume)
            })
            .collect();
        *lock(&self.volumes) = wanted.clone();
        let runtime = self.runtime.clone();
        tokio::spawn(
            async move {
                for volume in wanted.values() {
                    if let Err(e) = runtime.ensure_volume(volume).await {
                        tracing::warn!(volume = %volume.id, error = %e.0, "volume not ready");
                    }
                }
                for held in runtime.volumes().await {
                    if !wanted.contains_key(&held.id) {
                        if let Err(e) = runtime.delete_volume(&held.id).await {
                            tracing::debug!(volume = %held.id, error = %e.0, "volume kept");
                        }
                    }
                }
            }
            .instrument(tracing::debug_span!("volumes")),
        );
    }

    /// Runs one operation in a task of its own; its end wakes the loop.
    fn start(&self, id: String, action: Action, spec: Option<InstanceSpec>) {
        let runtime = self.runtime.clone();
        let api = self.api.clone();
        let bridge = self.bridge.clone();
        let user_data = self.user_data.clone();
        let volumes = self.volumes.clone();
        let host_key = self.guest_public_key.clone();
        let done = self.done_tx.clone();
        let span = tracing::info_span!("operation", guest = %id, operation = action.as_str());
        tokio::spawn(
            async move {
                let started = std::time::Instant::now();
                let result = match (action, &spec) {
                    (Action::Stop, _) => runtime.stop(&id).await.map_err(|e| e.0),
                    (Action::Delete, _) => runtime.delete(&id).await.map_err(|e| e.0),
                    (Action::Run | Action::Pause, Some(spec)) => {
                        // Its volumes exist before it boots, whatever the volume task is at.
                        let attached: Vec<VolumeSpec> = {
                            let known = lock(&volumes);
                            spec.volumes.iter().filter_map(|a| known.get(&a.volume_id).cloned()).collect()
                        };
                        for volume in &attached {
                            if let Err(e) = runtime.ensure_volume(volume).await {
                                tracing::warn!(volume = %volume.id, error = %e.0, "volume not ready");
                            }
                        }
                        match guest_spec(spec, bridge.as_deref(), &host_key, &api, &user_data).await {
                            Ok(guest) => bring_up(runtime.as_ref(), spec, &guest, action).await,
                            Err(message) => Err(message),
                        }
                    }
                    (Action::Run | Action::Pause, None) => {
                        Err("no spec entry to boot from".to_string())
                    }
                };
                let seconds = started.elapsed().as_secs_f64();
                crate::metrics::operation(action.as_str(), result.is_ok(), seconds);
                // The loop outlives its operations; if it is gone, no one is left to tell.
                let _ = done.send(Done {
                    id,
                    action,
                    spec,
                    result,
                });
            }
            .instrument(span),
        );
    }

    /// The complete inventory: every guest of the spec or the runtime, in id order.
    fn entries(&self) -> Vec<ReportEntry> {
        let empty = BTreeMap::new();
        let specs = self.specs.as_ref().unwrap_or(&empty);
        let ids: BTreeSet<&String> = specs.keys().chain(self.observed.keys()).collect();
        let idle = Guest::default();
        ids.into_iter()
            .filter_map(|id| {
                let guest = self.guests.get(id).unwrap_or(&idle);
                let mut entry = converge::report(
                    id,
                    specs.get(id),
                    self.observed.get(id),
                    &guest.memory,
                    self.refusals.get(id).map(String::as_str),
                )?;
                if matches!(entry.state, ReportState::Running | ReportState::Paused) {
                    entry.cpu_seconds = self.runtime.cpu_seconds(id);
                }
                if entry.identity_rebound.is_some() && self.runtime.identity_pending(id) {
                    entry.identity_rebound = None;
                }
                Some(entry)
            })
            .collect()
    }

    /// Reports when the inventory changed or the interval passed. Nothing complete is reported
    /// before the first spec: it would tell the server that every placed instance is gone.
    async fn report_if_needed(&mut self) {
        let now = Instant::now();
        // Cleared before anything else returns, so a past hold never keeps the loop awake.
        if let Some(hold) = self.report_hold {
            let busy = self.guests.values().any(|g| g.memory.busy.is_some());
            if busy && now < hold {
                return;
            }
            self.report_hold = None;
        }
        if self.pacer.backing_off(now) || self.specs.is_none() {
            return;
        }
        let entries = self.entries();
        crate::metrics::guests_by_state(&entries);
        let applied = self.generation;
        let results = self.command_results();
        let interval = self.timings.report_interval;
        let Some(changed) = self.pacer.due(now, interval, &entries, applied, &results) else {
            return;
        };
        match self.api.report(&entries, applied, &results, true).await {
            Ok(answer) => {
                self.succeeded();
                crate::metrics::reported();
                if changed {
                    let states: Vec<(&str, ReportState)> =
                        entries.iter().map(|e| (e.id.as_str(), e.state)).collect();
                    tracing::debug!(?states, orphans = answer.orphans.len(), "reported");
                }
                self.pacer.sent(now, entries, applied, results);
            }
            Err(error) => self.failed("nodes.report", &error),
        }
    }

    fn succeeded(&mut self) {
        self.pacer.succeeded();
    }

    /// Backs off, doubling up to [`MAX_BACKOFF`]; the agent keeps going whatever the server
    /// says.
    fn failed(&mut self, call: &'static str, error: &CallError) {
        crate::metrics::server_call_failed(call);
        self.pacer.failed(call, error);
    }
}

/// Runs or pauses a guest; one to be made from a snapshot is restored first (for a guest that
/// exists, a restore is a run).
async fn bring_up<R: Runtime>(
    runtime: &R,
    spec: &InstanceSpec,
    guest: &GuestSpec,
    action: Action,
) -> Result<(), String> {
    match &spec.restore_from {
        Some(from) => {
            let source = RestoreSource {
                snapshot_id: from.snapshot_id.clone(),
                url: from.url.clone(),
                sha256: from.sha256.clone(),
            };
            runtime.restore(guest, &source).await.map_err(|e| e.0)?;
            if action == Action::Pause {
                runtime.pause(guest).await.map_err(|e| e.0)?;
            }
            Ok(())
        }
        None if action == Action::Run => runtime.run(guest).await.map_err(|e| e.0),
        None => runtime.pause(guest).await.map_err(|e| e.0),
    }
}

/// Takes and uploads one snapshot: the command's result, or why it failed.
async fn snapshot<R: Runtime>(
    runtime: &R,
    command: &HostCommand,
    dir: &std::path::Path,
) -> Result<CommandResult, String> {
    if command.kind != "snapshot" {
        return Err(format!(
            "host command kind {:?} is not supported",
            command.kind
        ));
    }
    let url = command
        .upload_url
        .as_deref()
        .ok_or("the command has no upload URL")?;
    tracing::info!(instance = %command.instance_id, "snapshot command started");
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let files = runtime
        .snapshot(&command.instance_id, command.include_memory, dir)
        .await
        .map_err(|e| e.0)?;
    let uploading = std::time::Instant::now();
    let sha256 = crate::runtime::upload(&files, url, &command.upload_headers)
        .await
        .map_err(|e| e.0)?;
    tracing::info!(
        upload_ms = uploading.elapsed().as_millis() as u64,
        "snapshot uploaded"
    );
    runtime.keep_snapshot(&files, &sha256).await;
    Ok(CommandResult {
        id: command.id.clone(),
        ok: true,
        sha256: Some(sha256),
        size_bytes: Some(files.size_bytes),
        cpu_model: files.cpu_model,
        reason: None,
    })
}

/// What the runtime needs to run `spec`: its user data unsealed (fetched once), its NICs on
/// `bridge` when the host names one, and the host's own key for its `sshd` to admit.
async fn guest_spec(
    spec: &InstanceSpec,
    bridge: Option<&str>,
    host_ssh_key: &str,
    api: &NodeApi,
    cache: &Mutex<HashMap<String, Option<Vec<u8>>>>,
) -> Result<GuestSpec, String> {
    // `converge::check` passed before any boot: these are present.
    let shape = spec.shape.ok_or("the spec names no shape")?;
    let image = spec.image.clone().unwrap_or_default();
    let cached = lock(cache).get(&spec.id).cloned();
    let user_data = match (cached, &spec.user_data_ref) {
        (Some(data), _) => data,
        (None, None) => None,
        (None, Some(reference)) => {
            let value = api
                .secret(reference)
                .await
                .map_err(|e| format!("user data unavailable: {e}"))?;
            let data = Some(value.into_bytes());
            lock(cache).insert(spec.id.clone(), data.clone());
            data
        }
    };
    let nics = spec
        .nics
        .iter()
        .map(|nic| NicSpec {
            bridge: bridge.map_or_else(|| nic.bridge.clone(), str::to_owned),
            mac: nic.mac.clone(),
            address: nic.address.clone().unwrap_or_default(),
            gateway: nic.gateway.clone(),
        })
        .collect();
    Ok(GuestSpec {
        id: spec.id.clone(),
        hostname: spec.id.replace('_', "-"),
        vcpus: shape.vcpu,
        memory_mib: u64::from(shape.memory_gib) * 1024,
        disk_gib: u64::from(shape.disk_gib),
        image: ImageRef {
            url: image.url.unwrap_or_default(),
            sha256: image.sha256.unwrap_or_default(),
            format: image.format.unwrap_or_default(),
        },
        nics,
        user_data,
        ssh_ca: spec.ssh_ca.as_ref().map(|ca| SshCa {
            public_key: ca.public_key.clone(),
            principal: ca.principal.clone(),
        }),
        host_ssh_key: Some(host_ssh_key.to_owned()),
        network: network_policy(spec),
        volumes: spec
            .volumes
            .iter()
            .map(|a| VolumeAttachment {
                volume_id: a.volume_id.clone(),
                serial: a.serial.clone(),
                mount_path: a.mount_path.clone(),
                read_only: a.read_only,
            })
            .collect(),
    })
}

/// The entry's network policy: its mode, allow-list and bounds, the defaults for what a server
/// leaves out (an older one sends the mode alone). None without a mode: the pool's network.
fn network_policy(spec: &InstanceSpec) -> Option<NetworkPolicy> {
    let mode = match spec.network_policy? {
        vps_seam::NetworkPolicy::Egress => NetworkMode::Egress,
        vps_seam::NetworkPolicy::Private => NetworkMode::Private,
        vps_seam::NetworkPolicy::None => NetworkMode::None,
    };
    let defaults = NetworkPolicy::new(mode);
    Some(NetworkPolicy {
        allow: spec.network_allow.clone(),
        bandwidth_mbit: spec
            .network_bandwidth_mbit
            .unwrap_or(defaults.bandwidth_mbit),
        max_connections: spec
            .network_max_connections
            .unwrap_or(defaults.max_connections),
        ..defaults
    })
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // The data is whole between statements: a panic elsewhere cannot leave it half-written.
    mutex.lock().unwrap_or_else(|e| e.into_inner())
}

/// The outstanding poll's answer, or never when there is none.
async fn outstanding(poll: &mut Option<SpecPoll>) -> Result<NodeSpec, CallError> {
    match poll {
        Some(poll) => poll.await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn spec(network: serde_json::Value) -> InstanceSpec {
        let mut entry = json!({ "id": "inst_a", "desiredState": "running" });
        if let (Some(entry), Some(network)) = (entry.as_object_mut(), network.as_object()) {
            entry.extend(network.clone());
        }
        serde_json::from_value(entry).unwrap()
    }

    #[test]
    fn the_entry_s_allow_list_and_bounds_reach_the_policy_with_defaults_for_the_rest() {
        assert_eq!(network_policy(&spec(json!({}))), None);
        assert_eq!(
            network_policy(&spec(json!({ "networkPolicy": "private" }))),
            Some(NetworkPolicy::new(NetworkMode::Private))
        );
        let full = spec(json!({
            "networkPolicy": "egress",
            "networkAllow": ["203.0.113.0/24", "*.example.com"],
            "networkBandwidthMbit": 20,
            "networkMaxConnections": 64,
        }));
        assert_eq!(
            network_policy(&full),
            Some(NetworkPolicy {
                mode: NetworkMode::Egress,
                allow: vec!["203.0.113.0/24".into(), "*.example.com".into()],
                bandwidth_mbit: 20,
                max_connections: 64,
            })
        );
        let bounds_only = spec(json!({ "networkPolicy": "none", "networkMaxConnections": 8 }));
        let policy = network_policy(&bounds_only);
        assert_eq!(
            policy.map(|p| (p.allow.len(), p.bandwidth_mbit, p.max_connections)),
            Some((0, crate::runtime::DEFAULT_BANDWIDTH_MBIT, 8))
        );
    }
}
