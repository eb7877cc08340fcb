//! Every reactor delay (SPEC §3.6), configurable so tests and demos run the real reactors fast.

use std::time::Duration;

/// The delays the reconcilers and liveness checks use.
#[derive(Debug, Clone, PartialEq)]
pub struct Timings {
    /// Next look at an instance nothing fits yet.
    pub unschedulable_retry: Duration,
    /// Next look at a provider machine on its way, and at a refusal left standing because the
    /// tenant runs on that node (a hosted instance on its way waits for its host's report).
    pub transitional_look: Duration,
    /// Drift polling of a steady provider instance.
    pub provider_poll: Duration,
    /// Retry after a failed provider call.
    pub provider_retry: Duration,
    /// Next look at a lost instance.
    pub lost_look: Duration,
    /// How long a `ResourcesExhausted` refusal stands before re-placement.
    pub replacement_wait: Duration,
    /// How long a refusing node is excluded.
    pub refusing_node_exclusion: Duration,
    /// How often node liveness is checked.
    pub liveness_check: Duration,
    /// How often the sandbox reconciler passes.
    pub sandbox_pass: Duration,
    /// How long before its expiry a sandbox is warned.
    pub sandbox_expiring_lead: Duration,
    /// The shortest warning.
    pub sandbox_expiring_min_lead: Duration,
    /// How long a snapshot's host command may take before the snapshot fails.
    pub snapshot_timeout: Duration,
    /// How long a sandbox may stay `starting`.
    pub deadline_sandbox_starting: Duration,
    /// How long a sandbox may stay `pausing`.
    pub deadline_sandbox_pausing: Duration,
    /// How long a sandbox may stay `resuming`.
    pub deadline_sandbox_resuming: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            unschedulable_retry: Duration::from_secs(30),
            transitional_look: Duration::from_secs(10),
            provider_poll: Duration::from_secs(60),
            provider_retry: Duration::from_secs(30),
            lost_look: Duration::from_secs(60),
            replacement_wait: Duration::from_secs(60),
            refusing_node_exclusion: Duration::from_secs(600),
            liveness_check: Duration::from_secs(5),
            sandbox_pass: Duration::from_secs(15),
            sandbox_expiring_lead: Duration::from_secs(300),
            sandbox_expiring_min_lead: Duration::from_secs(30),
            snapshot_timeout: Duration::from_secs(3600),
            deadline_sandbox_starting: Duration::from_secs(600),
            deadline_sandbox_pausing: Duration::from_secs(300),
            deadline_sandbox_resuming: Duration::from_secs(300),
        }
    }
}
