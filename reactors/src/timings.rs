//! Every reactor delay (SPEC §3.6), configurable so tests and demos run the real reactors fast.
//!
//! This is the one `Timings`: `vps.toml`'s `[timings]` section deserializes into it (seconds,
//! fractions allowed) and the reactors read each delay as a [`Duration`]. Each key, its default
//! and its doc are written once, in the list below.

use std::time::Duration;

use serde::Deserialize;

/// Declares the keys: the struct of seconds, its defaults, a `Duration` accessor per key and
/// the list of every key with its value (for validation).
macro_rules! timings {
    ($($(#[doc = $doc:literal])+ $key:ident = $default:literal,)+) => {
        /// `[timings]`: every reactor delay, in seconds (fractions allowed, so tests run fast).
        #[derive(Debug, Clone, PartialEq, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct Timings {
            $($(#[doc = $doc])+ pub $key: f64,)+
        }

        impl Default for Timings {
            fn default() -> Self {
                Timings { $($key: $default,)+ }
            }
        }

        impl Timings {
            $($(#[doc = $doc])+ pub fn $key(&self) -> Duration {
                seconds(self.$key)
            })+

            /// Every key with its value in seconds, in the order of the list.
            pub fn entries(&self) -> Vec<(&'static str, f64)> {
                vec![$((stringify!($key), self.$key),)+]
            }
        }
    };
}

timings! {
    /// Next look at an instance nothing fits yet.
    unschedulable_retry = 30.0,
    /// Next look at a provider machine on its way, and at a refusal left standing because the
    /// tenant runs on that node (a hosted instance on its way waits for its host's report).
    transitional_look = 10.0,
    /// Drift polling of a steady provider instance.
    provider_poll = 60.0,
    /// Retry after a failed provider call.
    provider_retry = 30.0,
    /// Next look at a lost instance.
    lost_look = 60.0,
    /// How long a `ResourcesExhausted` refusal stands before re-placement.
    replacement_wait = 60.0,
    /// How long a refusing node is excluded from placement.
    refusing_node_exclusion = 600.0,
    /// How often node liveness is checked.
    liveness_check = 5.0,
    /// How often the sandbox reconciler passes.
    sandbox_pass = 15.0,
    /// How long before its expiry a sandbox is warned (`sandbox.expiring`).
    sandbox_expiring_lead = 300.0,
    /// The shortest warning.
    sandbox_expiring_min_lead = 30.0,
    /// The usage metering window, aligned to the epoch (SPEC §3.9).
    usage_window = 300.0,
    /// How long a snapshot's host command may take before the snapshot fails (`timeout`).
    snapshot_timeout = 3600.0,
    /// How long a sandbox may stay `starting` before it fails (`reason: deadline:starting`).
    deadline_sandbox_starting = 600.0,
    /// How long a sandbox may stay `pausing`.
    deadline_sandbox_pausing = 300.0,
    /// How long a sandbox may stay `resuming`.
    deadline_sandbox_resuming = 300.0,
    /// How long a sandbox may stay `deleting` before its instance is released without its host.
    deadline_sandbox_deleting = 600.0,
    /// How long an instance may stay `provisioning` before it fails (`reason:
    /// deadline:provisioning`) and is released.
    deadline_instance_provisioning = 600.0,
    /// How long an instance may stay `starting`.
    deadline_instance_starting = 600.0,
    /// How long an instance may stay `stopping` (running or paused, wanted stopped).
    deadline_instance_stopping = 300.0,
    /// How long an instance may stay `resizing`.
    deadline_instance_resizing = 600.0,
    /// How long an instance may stay `deleting` before it is released without its host.
    deadline_instance_deleting = 600.0,
}

/// Seconds as a duration. The configuration is validated at load (positive, at most a day); a
/// value that is not a duration at all reads as zero rather than panicking a reactor.
fn seconds(value: f64) -> Duration {
    Duration::try_from_secs_f64(value).unwrap_or_default()
}
