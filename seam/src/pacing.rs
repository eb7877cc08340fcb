//! When a host agent reports and how it backs off: the same rules for the emulated and the
//! real host, so the server sees one behaviour whichever it talks to.

use std::time::Duration;

use tokio::time::Instant;

use crate::{CallError, CommandResult, ReportEntry};

/// What a report carried: the inventory, the applied generation, the command results.
type Sent = (Vec<ReportEntry>, Option<u64>, Vec<CommandResult>);

/// Whether two inventories say the same, the guests' CPU seconds aside.
fn same_entries(a: &[ReportEntry], b: &[ReportEntry]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.same_but_cpu(y))
}

/// The pacing state of an agent's loop: the back-off after a failed server call and the
/// last report the server accepted.
#[derive(Debug)]
pub struct ReportPacer {
    first_backoff: Duration,
    max_backoff: Duration,
    backoff: Duration,
    /// While the server fails, nothing is sent before this.
    retry_at: Option<Instant>,
    /// The last inventory the server accepted, so an unchanged one waits for the interval.
    last_sent: Option<Sent>,
    last_report_at: Option<Instant>,
}

impl ReportPacer {
    /// A pacer whose back-off starts at `first_backoff` and doubles up to `max_backoff`.
    pub fn new(first_backoff: Duration, max_backoff: Duration) -> Self {
        Self {
            first_backoff,
            max_backoff,
            backoff: first_backoff,
            retry_at: None,
            last_sent: None,
            last_report_at: None,
        }
    }

    /// Whether a failed call still holds the agent back at `now`.
    pub fn backing_off(&self, now: Instant) -> bool {
        self.retry_at.is_some_and(|at| at > now)
    }

    /// When reporting wants the loop awake: the end of the back-off while backing off (a due
    /// report must not wake the loop then: it would spin until the back-off ends), else the
    /// next report falling due.
    pub fn wake_at(&self, backing_off: bool, interval: Duration) -> Option<Instant> {
        if backing_off {
            self.retry_at
        } else {
            self.last_report_at.map(|at| at + interval)
        }
    }

    /// Whether to send this report at `now`: `None` when it is unchanged and the interval has
    /// not passed, else whether it changed since the last accepted one.
    pub fn due(
        &self,
        now: Instant,
        interval: Duration,
        entries: &[ReportEntry],
        applied: Option<u64>,
        results: &[CommandResult],
    ) -> Option<bool> {
        let changed = self
            .last_sent
            .as_ref()
            .is_none_or(|(sent, generation, sent_results)| {
                !same_entries(sent, entries) || *generation != applied || sent_results != results
            });
        let due = self.last_report_at.is_none_or(|at| now >= at + interval);
        (changed || due).then_some(changed)
    }

    /// The server accepted this report, sent at `now`.
    pub fn sent(
        &mut self,
        now: Instant,
        entries: Vec<ReportEntry>,
        applied: Option<u64>,
        results: Vec<CommandResult>,
    ) {
        self.last_sent = Some((entries, applied, results));
        self.last_report_at = Some(now);
    }

    /// Forgets what was sent, so the next report goes at once (as a reconnecting host's does).
    pub fn forget_sent(&mut self) {
        self.last_sent = None;
    }

    /// A server call succeeded: the back-off starts over.
    pub fn succeeded(&mut self) {
        self.retry_at = None;
        self.backoff = self.first_backoff;
    }

    /// A server call failed: backs off, doubling up to the maximum; the agent keeps going
    /// whatever the server says.
    pub fn failed(&mut self, call: &str, error: &CallError) {
        tracing::warn!(call, %error, backoff_ms = self.backoff.as_millis() as u64, "server call failed");
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(self.max_backoff);
    }
}
