//! The host's loop: long-poll the spec, converge, report.
//!
//! One pass waits for whichever comes first (a spec answer, a boot finishing, a report falling
//! due, a knob turned, the end of a back-off), then converges and reports if the inventory
//! changed or the interval passed. The spec poll lives across passes, so a boot finishing or a
//! knob turned is reported without waiting for the server to answer the poll.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tokio::time::{sleep_until, Instant};
use tracing::Instrument;

use super::snapshots;
use super::{HostConfig, Shared};
use vps_seam::{CallError, CommandResult, HostCommand, NodeApi, NodeSpec, ReportPacer};

const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const MAX_BACKOFF: Duration = Duration::from_secs(2);

type SpecPoll = Pin<Box<dyn Future<Output = Result<NodeSpec, CallError>> + Send>>;

/// Runs the host until its task is aborted.
pub(super) async fn run(shared: Arc<Shared>, config: HostConfig, api: NodeApi) {
    let mut agent = Agent {
        api,
        shared,
        config,
        spec_poll: None,
        pacer: ReportPacer::new(FIRST_BACKOFF, MAX_BACKOFF),
        silent: false,
    };
    for pass in 0u64.. {
        let span =
            tracing::debug_span!("emulated_host_pass", node_id = %agent.config.node_id, pass);
        agent.pass().instrument(span).await;
    }
}

struct Agent {
    api: NodeApi,
    shared: Arc<Shared>,
    config: HostConfig,
    /// The outstanding `nodes.spec` long poll.
    spec_poll: Option<SpecPoll>,
    pacer: ReportPacer,
    silent: bool,
}

impl Agent {
    async fn pass(&mut self) {
        if !self.shared.reporting.load(Ordering::SeqCst) {
            self.play_dead().await;
            return;
        }
        if self.silent {
            tracing::info!("host speaks again");
            self.silent = false;
            // Forget what was sent, so the host reports at once as a reconnecting host does.
            self.pacer.forget_sent();
        }

        let now = Instant::now();
        let backing_off = self.pacer.backing_off(now);
        if !backing_off && self.spec_poll.is_none() {
            self.spec_poll = Some(self.poll_spec());
        }
        let wake = self.next_wake(backing_off);

        let mut new_spec = None;
        tokio::select! {
            answer = outstanding(&mut self.spec_poll) => {
                self.spec_poll = None;
                match answer {
                    Ok(spec) => {
                        self.succeeded();
                        new_spec = Some(spec);
                    }
                    Err(error) => self.failed("nodes.spec", &error),
                }
            }
            _ = self.shared.wake.notified() => {}
            _ = sleep_until_opt(wake) => {}
        }

        if let Some(spec) = new_spec {
            tracing::debug!(generation = spec.generation, "spec received");
            let start = self.shared.commands().follow(&spec);
            self.shared.domains().apply_spec(spec);
            for command in start {
                self.run_command(command);
            }
        }
        self.fetch_user_data().await;
        self.fetch_restores().await;
        self.shared
            .domains()
            .converge(std::time::Instant::now(), self.config.boot_delay);
        self.report_if_needed().await;
    }

    /// A lost host: nothing reaches the server, but its domains keep booting.
    async fn play_dead(&mut self) {
        if !self.silent {
            tracing::info!("host goes silent");
            self.silent = true;
            // Dropping the poll cancels the request, as a host that lost its network would.
            self.spec_poll = None;
        }
        let wake = self.shared.domains().next_boot_at().map(Instant::from_std);
        tokio::select! {
            _ = self.shared.wake.notified() => {}
            _ = sleep_until_opt(wake) => {}
        }
        self.shared
            .domains()
            .converge(std::time::Instant::now(), self.config.boot_delay);
    }

    fn poll_spec(&self) -> SpecPoll {
        let api = self.api.clone();
        let after = self.shared.domains().applied_generation();
        let wait = self.config.poll_wait;
        Box::pin(async move { api.spec(after, wait).await })
    }

    /// The earliest of: a boot finishing, a report falling due, the back-off ending.
    fn next_wake(&self, backing_off: bool) -> Option<Instant> {
        let boot = self.shared.domains().next_boot_at().map(Instant::from_std);
        let report = self.pacer.wake_at(backing_off, self.config.report_interval);
        boot.into_iter().chain(report).min()
    }

    /// Fetches the user data new domains need, all at once. A refusal fails the instance; no
    /// answer (or a 5xx) leaves it to be asked again after the back-off.
    async fn fetch_user_data(&mut self) {
        if self.pacer.backing_off(Instant::now()) {
            return;
        }
        let wanted = self.shared.domains().user_data_wanted();
        if wanted.is_empty() {
            return;
        }
        let answers = join_all(
            wanted
                .iter()
                .map(|(_, reference)| self.api.secret(reference)),
        )
        .await;
        for ((id, _), answer) in wanted.iter().zip(answers) {
            match answer {
                Ok(value) => self.shared.domains().record_user_data(id, Ok(value)),
                Err(error) if error.is_refusal() => {
                    tracing::warn!(instance = %id, %error, "user data refused");
                    let message = format!("user data unavailable: {error}");
                    self.shared.domains().record_user_data(id, Err(message));
                }
                Err(error) => self.failed("nodes.secret", &error),
            }
        }
    }

    /// Runs a snapshot command in the background: the domain must be up; its object is
    /// uploaded with its digest, and the outcome is reported with the next report. A held
    /// host never runs it (the server times it out).
    fn run_command(&self, command: HostCommand) {
        if self.shared.hold_commands.load(Ordering::SeqCst) {
            return;
        }
        let (api, shared) = (self.api.clone(), self.shared.clone());
        let (size, cpu_model) = (self.config.snapshot_bytes, self.config.cpu_model.clone());
        tokio::spawn(async move {
            let result = snapshot(&api, &shared, &command, size, cpu_model).await;
            tracing::info!(snapshot = %command.id, ok = result.ok, "snapshot command finished");
            shared.commands().finish(result);
            shared.wake.notify_one();
        });
    }

    /// Downloads the snapshots new restores boot from and checks their digests; a download
    /// the server refuses or a digest that does not match fails the instance.
    async fn fetch_restores(&mut self) {
        let wanted = self.shared.domains().restores_wanted();
        if wanted.is_empty() {
            return;
        }
        let downloads = join_all(wanted.iter().map(|(_, r)| self.api.download(&r.url))).await;
        for ((id, restore), body) in wanted.iter().zip(downloads) {
            let outcome = match body {
                Ok(bytes) if snapshots::digest(&bytes) == restore.sha256 => {
                    Ok(restore.snapshot_id.clone())
                }
                Ok(_) => Err(format!(
                    "restore: snapshot {} does not match its SHA-256",
                    restore.snapshot_id
                )),
                Err(e) => Err(format!("restore: {e}")),
            };
            if let Err(message) = &outcome {
                tracing::warn!(instance = %id, %message, "restore failed");
            }
            self.shared.domains().record_restore(id, outcome);
        }
    }

    /// Reports the inventory when it changed or the interval passed. Nothing is reported before
    /// the first spec: an empty complete report from a host that has not read its spec would
    /// tell the server every placed instance is gone.
    async fn report_if_needed(&mut self) {
        let now = Instant::now();
        if self.pacer.backing_off(now) {
            return;
        }
        let (mut entries, applied) = {
            let mut domains = self.shared.domains();
            domains.accrue(self.config.clock.now());
            (domains.report(), domains.applied_generation())
        };
        if !self.shared.report_cpu.load(Ordering::SeqCst) {
            for entry in &mut entries {
                entry.cpu_seconds = None;
            }
        }
        let results = self.shared.commands().results();
        if applied.is_none() {
            return;
        }
        let interval = self.config.report_interval;
        if self
            .pacer
            .due(now, interval, &entries, applied, &results)
            .is_none()
        {
            return;
        }
        match self.api.report(&entries, applied, &results, true).await {
            Ok(answer) => {
                self.succeeded();
                tracing::debug!(
                    instances = entries.len(),
                    orphans = answer.orphans.len(),
                    "reported"
                );
                *self
                    .shared
                    .orphans
                    .lock()
                    .expect("the orphan list is never poisoned") = answer.orphans;
                self.shared.reports_sent.fetch_add(1, Ordering::SeqCst);
                self.pacer.sent(now, entries, applied, results);
            }
            Err(error) => self.failed("nodes.report", &error),
        }
    }

    fn succeeded(&mut self) {
        self.pacer.succeeded();
    }

    /// Backs off, doubling up to [`MAX_BACKOFF`]; the host keeps going whatever the server says.
    fn failed(&mut self, call: &str, error: &CallError) {
        self.pacer.failed(call, error);
    }
}

/// Takes one snapshot: the domain must be up; its object goes to the presigned URL with its
/// SHA-256 declared (a wrong one when uploads are corrupted, which the store refuses).
async fn snapshot(
    api: &NodeApi,
    shared: &Shared,
    command: &HostCommand,
    size: usize,
    cpu_model: Option<String>,
) -> CommandResult {
    let failed = |reason: String| CommandResult {
        id: command.id.clone(),
        ok: false,
        sha256: None,
        size_bytes: None,
        cpu_model: None,
        reason: Some(reason),
    };
    if shared.refuse_snapshots.load(Ordering::SeqCst) {
        return failed("snapshots refused by this host".into());
    }
    if !shared.domains().is_up(&command.instance_id) {
        return failed(format!(
            "instance {} is not up on this host",
            command.instance_id
        ));
    }
    let Some(url) = &command.upload_url else {
        return failed("the command has no upload URL".into());
    };
    let body = snapshots::object(&command.instance_id, &command.id, size);
    let sha256 = snapshots::digest(&body);
    let declared = match shared.corrupt_uploads.load(Ordering::SeqCst) {
        true => snapshots::digest(b"not the body"),
        false => sha256.clone(),
    };
    match api
        .upload(url, &command.upload_headers, &declared, body)
        .await
    {
        Ok(()) => CommandResult {
            id: command.id.clone(),
            ok: true,
            sha256: Some(sha256),
            size_bytes: Some(size as u64),
            cpu_model: command.include_memory.then_some(cpu_model).flatten(),
            reason: None,
        },
        Err(reason) => failed(reason),
    }
}

/// The outstanding poll's answer, or never when there is none.
async fn outstanding(poll: &mut Option<SpecPoll>) -> Result<NodeSpec, CallError> {
    match poll {
        Some(poll) => poll.await,
        None => std::future::pending().await,
    }
}

async fn sleep_until_opt(at: Option<Instant>) {
    match at {
        Some(at) => sleep_until(at).await,
        None => std::future::pending().await,
    }
}
