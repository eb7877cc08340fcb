//! Who is acting, and the handles a command needs.

use std::sync::Arc;

use sqlx::PgPool;
use vps_clock::Clock;
use vps_events::{Metadata, Notifier};
use vps_projections::spec_signals::SpecSignals;

use crate::secrets::SecretKey;
use crate::wakeups::Wakeups;

/// The caller of a command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    /// `id_…`, or a reactor's name.
    pub identity: String,
    /// The tenant a tenant identity acts for.
    pub tenant: Option<String>,
    /// Operators may do everything.
    pub operator: bool,
}

/// Everything a handler needs.
#[derive(Clone)]
pub struct Ctx {
    /// The database.
    pub pool: PgPool,
    /// Wakes followers after commits.
    pub notifier: Notifier,
    /// Wakes this replica's spec long-polls when a command moves a node's spec itself.
    pub spec_signals: Arc<SpecSignals>,
    /// Seals user data.
    pub secrets: SecretKey,
    /// Who acts.
    pub actor: Actor,
    /// The request being served.
    pub request_id: Option<String>,
    /// What time it is: commands and reactors never read the system clock themselves.
    pub clock: Clock,
    /// This server's wake-ups of its background loops.
    pub wakeups: Wakeups,
    /// This replica's copy of each node's report views (`nodes.report`).
    pub reports: Arc<crate::report_views::ReportViews>,
}

impl Ctx {
    /// Metadata for the events this command appends.
    pub fn metadata(&self, tenant_id: Option<&str>) -> Metadata {
        Metadata {
            tenant_id: tenant_id.map(str::to_string),
            actor: Some(self.actor.identity.clone()),
            request_id: self.request_id.clone(),
            correlation_id: self.request_id.clone(),
            causation_id: None,
        }
    }
}
