//! `vps.nodes.liveness`: nodes `lost` (an error) or unreachable (a warning): in state
//! `unreachable`, or `ready`/`cordoned` without a report for a minute.

use sqlx::PgPool;

use super::{age, count, some_ids, Finding, Severity};

/// The check.
pub const LIVENESS: &str = "vps.nodes.liveness";

/// A node silent this long is unreachable, whether or not its pool has `lostAfterSeconds`.
const SILENT: f64 = 60.0;

/// The nodes that are lost or unreachable.
pub async fn liveness(pool: &PgPool) -> Result<Finding, sqlx::Error> {
    let rows = vps_projections::nodes::unwell(pool, SILENT).await?;
    let total = vps_projections::nodes::count(pool).await?;
    Ok(judge(total, &rows))
}

/// `rows`: id, name, state and seconds since the last report of each node found.
fn judge(total: i64, rows: &[(String, String, String, f64)]) -> Finding {
    let named = |state_is_lost: bool| -> Vec<String> {
        rows.iter()
            .filter(|r| (r.2 == "lost") == state_is_lost)
            .map(|(id, name, _, silent)| format!("{id} ({name}, silent {})", age(*silent)))
            .collect()
    };
    let (lost, unreachable) = (named(true), named(false));
    if lost.is_empty() && unreachable.is_empty() {
        return Finding::ok(
            LIVENESS,
            match total {
                0 => "no node registered".to_string(),
                n => format!("{} reporting", count(n, "node", "nodes")),
            },
        );
    }
    let mut parts = Vec::new();
    if !lost.is_empty() {
        parts.push(format!(
            "{} lost: {}",
            count(lost.len() as i64, "node", "nodes"),
            some_ids(&lost, lost.len() as i64)
        ));
    }
    if !unreachable.is_empty() {
        parts.push(format!(
            "{} unreachable: {}",
            count(unreachable.len() as i64, "node", "nodes"),
            some_ids(&unreachable, unreachable.len() as i64)
        ));
    }
    Finding::bad(
        LIVENESS,
        if lost.is_empty() {
            Severity::Warning
        } else {
            Severity::Error
        },
        parts.join("; "),
        "bring the host back: its next report recovers the node and its instances (which wait \
         meanwhile, or move to other nodes where the pool sets recreateOnHostLoss)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lost_nodes_are_errors_and_silent_ones_warnings() {
        assert_eq!(judge(3, &[]).severity, Severity::Ok);
        let silent = vec![("node_a".into(), "host-a".into(), "ready".into(), 75.0)];
        let found = judge(3, &silent);
        assert_eq!(found.severity, Severity::Warning);
        assert!(found
            .message
            .contains("1 node unreachable: node_a (host-a, silent 75 s)"));
        let lost = vec![
            ("node_a".into(), "host-a".into(), "ready".into(), 75.0),
            ("node_b".into(), "host-b".into(), "lost".into(), 3.0),
        ];
        let found = judge(3, &lost);
        assert_eq!(found.severity, Severity::Error);
        assert!(
            found.message.starts_with("1 node lost: node_b"),
            "{}",
            found.message
        );
    }
}
