//! The agent's Prometheus metrics (`metrics` crate; the binary installs the recorder and
//! serves it). The runtime adds its own: `vps_host_boot_seconds`, `vps_host_qmp_errors_total`,
//! `vps_host_image_cache_{hits,misses}_total`, `vps_host_image_cache_bytes`,
//! `vps_host_image_cache_evictions_total{kind}`, and its resolver `vps_host_dns_queries_total`.

use std::collections::BTreeMap;

use vps_seam::{ReportEntry, ReportState};

/// Every state a guest is counted in, so a state with no guest reads 0 rather than stale.
const STATES: [(ReportState, &str); 5] = [
    (ReportState::Running, "running"),
    (ReportState::Stopped, "stopped"),
    (ReportState::Paused, "paused"),
    (ReportState::Error, "error"),
    (ReportState::Unspecified, "booting"),
];

/// `vps_host_guests{state}`: the guests of the last report, by state.
pub fn guests_by_state(entries: &[ReportEntry]) {
    let mut counts: BTreeMap<&str, u32> = STATES.iter().map(|(_, name)| (*name, 0)).collect();
    for entry in entries {
        if let Some((_, name)) = STATES.iter().find(|(state, _)| *state == entry.state) {
            *counts.entry(name).or_default() += 1;
        }
    }
    for (state, count) in counts {
        metrics::gauge!("vps_host_guests", "state" => state).set(f64::from(count));
    }
}

/// `vps_host_operations_total{operation, outcome}` and `vps_host_operation_seconds{operation}`.
pub fn operation(operation: &'static str, ok: bool, seconds: f64) {
    let outcome = if ok { "ok" } else { "failed" };
    metrics::counter!("vps_host_operations_total", "operation" => operation, "outcome" => outcome)
        .increment(1);
    metrics::histogram!("vps_host_operation_seconds", "operation" => operation).record(seconds);
}

/// `vps_host_server_call_failures_total{call}`: node calls that failed (the agent backs off).
pub fn server_call_failed(call: &'static str) {
    metrics::counter!("vps_host_server_call_failures_total", "call" => call).increment(1);
}

/// `vps_host_reports_total`: reports the server accepted.
pub fn reported() {
    metrics::counter!("vps_host_reports_total").increment(1);
}

/// `vps_host_tunnels_total{outcome}`: exec tunnels opened or refused.
pub fn tunnel(opened: bool) {
    let outcome = if opened { "opened" } else { "refused" };
    metrics::counter!("vps_host_tunnels_total", "outcome" => outcome).increment(1);
}

/// `vps_host_dns_queries_total{outcome}`: guests' DNS queries for the domains of their
/// allow-lists: `answered` (forwarded upstream), `refused` (not allowed: NXDOMAIN), `failed`
/// (SERVFAIL: the upstream did not answer), `dropped` (too many at once).
pub fn dns_query(outcome: &'static str) {
    metrics::counter!("vps_host_dns_queries_total", "outcome" => outcome).increment(1);
}

/// `vps_host_info{runtime, accel, cpu_model}`: 1, naming what this host runs guests with.
pub fn info(runtime: &'static str, accel: &str, cpu_model: &str) {
    metrics::gauge!("vps_host_info", "runtime" => runtime, "accel" => accel.to_owned(),
        "cpu_model" => cpu_model.to_owned())
    .set(1.0);
}
