//! What every handler can reach: the pool, the wake-up notifier, the configuration and the
//! sealing key. Its own module so routes and the server both depend on it, not on each other.

use std::sync::Arc;

use sqlx::PgPool;
use vps_events::Notifier;

use crate::config::Config;

/// What every handler can reach.
#[derive(Clone)]
pub struct AppState {
    /// The database.
    pub pool: PgPool,
    /// Wakes followers after appends.
    pub notifier: Notifier,
    /// The configuration in force.
    pub config: Arc<Config>,
    /// Seals user data.
    pub secrets: vps_commands::secrets::SecretKey,
    /// Admits this process's creates in batches (one commit per batch).
    pub admitter: vps_commands::instances::Admitter,
    /// Bounds on open streams and long-polls.
    pub guards: crate::guards::Guards,
    /// The rows create waits watch, read once per commit for all of them.
    pub watched: Arc<crate::wait::Watched>,
    /// The Cedar policies in force on this replica.
    pub authz: Arc<crate::authz::Authorizer>,
    /// Where snapshots are kept.
    pub snapshots: vps_store::SnapshotStore,
    /// `[sandbox_exec] ca_key`, loaded (absent: `sandboxes.exec` is `UNSUPPORTED`).
    pub sandbox_ca: Option<Arc<vps_commands::sandboxes::exec::ca::SandboxCa>>,
    /// Where preview URLs start (`[preview] public_url`, else this server's address).
    pub preview_url: Arc<str>,
    /// This replica's copy of its nodes' spec entries.
    pub specs: Arc<vps_projections::node_specs::SpecCache>,
    /// The spec generations this replica has heard of, per node (long-polls wait on them).
    pub spec_signals: Arc<vps_projections::spec_signals::SpecSignals>,
    /// Anonymous `/readyz`'s cached answer.
    pub readiness: Arc<crate::doctor::readiness::Readiness>,
    /// What time it is for commands and reactors.
    pub clock: vps_clock::Clock,
    /// This server's wake-ups of its background loops.
    pub wakeups: vps_commands::wakeups::Wakeups,
    /// This replica's copy of each node's report views.
    pub reports: Arc<vps_commands::report_views::ReportViews>,
}

/// A context for background parts acting as `reactor:<name>`.
pub fn reactor_ctx(state: &AppState, name: &str) -> vps_commands::Ctx {
    vps_commands::Ctx {
        pool: state.pool.clone(),
        notifier: state.notifier.clone(),
        spec_signals: state.spec_signals.clone(),
        secrets: state.secrets.clone(),
        actor: vps_commands::Actor {
            identity: format!("reactor:{name}"),
            tenant: None,
            operator: true,
        },
        request_id: None,
        clock: state.clock.clone(),
        wakeups: state.wakeups.clone(),
        reports: state.reports.clone(),
    }
}
