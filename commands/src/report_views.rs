//! A replica's copy of each node's report views (state, conditions, addresses of the live
//! instances placed on it), so a report reads only the instances that changed since the last
//! one: a complete report of a node of 10,000 guests that changes nothing then reads no
//! instance row. What changed is what `instance_marks` (a trigger on `instances`) names for
//! writes the copy's read did not see; a replica that restarts, or whose report failed, reads
//! the node's views whole once, and so does a copy older than
//! `reads::COPY_READ_WHOLE_AFTER` (the marks of instances gone from a node are pruned after
//! `reads::MARKS_KEPT`, so no copy may be older than that).

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;

use chrono::{DateTime, Utc};
use sqlx::PgConnection;
use vps_domain::instance::ReportView;
use vps_domain::state_table::InstanceState;
use vps_projections::instances::reads::{self, MarkPoint};

use crate::report_verdicts::Applied;

/// Each node's views, by node id. A node's reports apply one at a time (its row is locked
/// first), so the copy is taken out for a report and put back when it succeeded.
#[derive(Debug, Default)]
pub struct ReportViews {
    nodes: Mutex<HashMap<String, Held>>,
    /// Each node's last report entries, parsed (the same replica's memory of its reports).
    pub(crate) entries: crate::report_entries::ReportEntries,
}

/// One node's views as of `point`: every write `point` saw is in them.
#[derive(Debug)]
pub(super) struct Held {
    point: MarkPoint,
    /// When the views were read whole (on the context's clock).
    read_at: DateTime<Utc>,
    /// By instance id.
    pub(super) views: foldhash::HashMap<String, ReportView>,
    /// The ids of the views that are `deleting` (a complete report that leaves one out
    /// releases it), kept beside the views so a complete report does not walk them all.
    pub(super) deleting: BTreeSet<String>,
    /// What the last report found with these views (taken by the report that uses them).
    pub(super) last: Option<Applied>,
}

impl ReportViews {
    fn take(&self, node_id: &str) -> Option<Held> {
        self.nodes.lock().ok()?.remove(node_id)
    }

    /// Keeps `held` as the node's copy.
    pub(super) fn put(&self, node_id: &str, held: Held) {
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.insert(node_id.to_string(), held);
        }
    }
}

/// The node's views now, in the report's transaction (after the node's row is locked): the
/// copy brought up to date with the instances marked since it was read, or a whole read. With
/// the ids of the instances marked since the copy's last report; `None`: read whole.
pub(super) async fn current(
    cache: &ReportViews,
    tx: &mut PgConnection,
    node_id: &str,
    now: DateTime<Utc>,
) -> Result<(Held, Option<Vec<String>>), sqlx::Error> {
    let fresh = |held: &Held| {
        now.signed_duration_since(held.read_at)
            .to_std()
            .is_ok_and(|age| age < reads::COPY_READ_WHOLE_AFTER)
    };
    let Some(mut held) = cache.take(node_id).filter(fresh) else {
        // The point first: what the read below sees is at least what the point saw.
        let point = reads::mark_point(tx).await?;
        let views: foldhash::HashMap<String, ReportView> =
            reads::report_rows(tx, node_id).await?.into_iter().collect();
        let deleting = views
            .iter()
            .filter(|(_, view)| view.state == InstanceState::Deleting)
            .map(|(id, _)| id.clone())
            .collect();
        let held = Held {
            point,
            read_at: now,
            views,
            deleting,
            last: None,
        };
        return Ok((held, None));
    };
    let (point, marked) = reads::marked_since(tx, node_id, &held.point).await?;
    if !marked.is_empty() {
        for id in &marked {
            held.views.remove(id);
            held.deleting.remove(id);
        }
        for (id, view) in reads::report_rows_of(tx, node_id, &marked).await? {
            if view.state == InstanceState::Deleting {
                held.deleting.insert(id.clone());
            }
            held.views.insert(id, view);
        }
    }
    held.point = point;
    Ok((held, Some(marked)))
}
