//! `vps.events.horizon` (a transaction holding the read horizon back) and
//! `vps.events.followers` (durable followers that stopped moving).
//!
//! Followers read only below the oldest running transaction of the whole PostgreSQL server
//! (`vps_events::read`), so one long transaction anywhere delays every follower: the finding
//! names it.

use sqlx::PgPool;

use super::{age, count, Finding, Severity};

/// The horizon check.
pub const HORIZON: &str = "vps.events.horizon";
/// The follower check.
pub const FOLLOWERS: &str = "vps.events.followers";

/// A transaction holding the horizon this long is a warning: `vps` keeps its own transactions
/// to milliseconds.
const HORIZON_WARNING: f64 = 10.0;
/// ... and this long an error: every follower has been stalled for minutes.
const HORIZON_ERROR: f64 = 300.0;
/// A follower with events to read that has not moved for this long is a warning...
const FOLLOWER_WARNING: f64 = 30.0;
/// ... and this long an error.
const FOLLOWER_ERROR: f64 = 300.0;
/// Counting stops here, so a far-behind follower costs a bounded read.
const COUNT_LIMIT: i64 = 10_000;

/// The oldest transaction with a transaction id (the one the horizon waits for) and the
/// committed events waiting behind the horizon.
pub async fn horizon(pool: &PgPool) -> Result<Finding, sqlx::Error> {
    let waiting: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM events
                                WHERE transaction_id >= pg_snapshot_xmin(pg_current_snapshot())
                                LIMIT $1) w",
    )
    .bind(COUNT_LIMIT + 1)
    .fetch_one(pool)
    .await?;
    let holder: Option<(i32, Option<String>, Option<String>, f64)> = sqlx::query_as(
        "SELECT pid, datname::text, application_name,
                extract(epoch FROM clock_timestamp() - xact_start)::float8
           FROM pg_stat_activity
          WHERE backend_xid IS NOT NULL AND xact_start IS NOT NULL AND pid <> pg_backend_pid()
          ORDER BY xact_start
          LIMIT 1",
    )
    .fetch_optional(pool)
    .await?;
    Ok(judge_horizon(waiting, holder))
}

fn judge_horizon(
    waiting: i64,
    holder: Option<(i32, Option<String>, Option<String>, f64)>,
) -> Finding {
    let waiting_text = match waiting {
        0 => "no committed event waits behind it".to_string(),
        n if n > COUNT_LIMIT => format!("over {COUNT_LIMIT} committed events wait behind it"),
        n => format!(
            "{} wait{} behind it",
            count(n, "committed event", "committed events"),
            if n == 1 { "s" } else { "" }
        ),
    };
    match holder {
        Some((pid, database, application, seconds)) if seconds >= HORIZON_WARNING => {
            let severity = if seconds >= HORIZON_ERROR {
                Severity::Error
            } else {
                Severity::Warning
            };
            let application = application
                .filter(|a| !a.is_empty())
                .unwrap_or_else(|| "unnamed".into());
            let database = database.unwrap_or_else(|| "?".into());
            Finding::bad(
                HORIZON,
                severity,
                format!(
                    "a transaction of pid {pid} (application {application}, database {database}) \
                     has been open for {} and holds the read horizon back for every follower; {waiting_text}",
                    age(seconds)
                ),
                format!(
                    "commit or roll back that session's transaction, or end it: \
                     SELECT pg_terminate_backend({pid})"
                ),
            )
        }
        Some((_, _, _, seconds)) => Finding::ok(
            HORIZON,
            format!(
                "no transaction holds the read horizon back (the oldest open one is {} old)",
                age(seconds)
            ),
        ),
        None => Finding::ok(HORIZON, "no open transaction holds the read horizon"),
    }
}

/// Each follower's position against the events it can read: one that has some to read and
/// has not moved for a while is stuck.
pub async fn followers(pool: &PgPool, names: Vec<&'static str>) -> Result<Finding, sqlx::Error> {
    let rows: Vec<(String, i64, Option<f64>)> = sqlx::query_as(
        "WITH h AS MATERIALIZED (SELECT pg_snapshot_xmin(pg_current_snapshot()) AS xmin)
         SELECT c.name,
                (SELECT count(*) FROM (SELECT 1 FROM events e
                                        WHERE (e.transaction_id, e.position) > (c.transaction_id, c.position)
                                          AND e.transaction_id < h.xmin
                                        LIMIT $2) p),
                extract(epoch FROM now() - greatest(c.updated_at,
                    (SELECT e.recorded_at FROM events e
                      WHERE (e.transaction_id, e.position) > (c.transaction_id, c.position)
                        AND e.transaction_id < h.xmin
                      ORDER BY e.transaction_id, e.position LIMIT 1)))::float8
           FROM follower_checkpoints c, h
          WHERE c.name = ANY($1)
          ORDER BY c.name",
    )
    .bind(&names)
    .bind(COUNT_LIMIT + 1)
    .fetch_all(pool)
    .await?;
    Ok(judge_followers(&rows))
}

/// `rows`: each follower, the events it can read and has not handled, and for how long it
/// has stood still with events to read.
fn judge_followers(rows: &[(String, i64, Option<f64>)]) -> Finding {
    let stuck = rows
        .iter()
        .filter(|(_, pending, _)| *pending > 0)
        .filter_map(|(name, pending, still)| Some((name, *pending, (*still)?)))
        .filter(|(_, _, still)| *still >= FOLLOWER_WARNING)
        .max_by(|a, b| a.2.total_cmp(&b.2));
    let behind = |n: i64| {
        if n > COUNT_LIMIT {
            format!("over {COUNT_LIMIT} events")
        } else {
            count(n, "event", "events")
        }
    };
    match stuck {
        Some((name, pending, still)) => Finding::bad(
            FOLLOWERS,
            if still >= FOLLOWER_ERROR {
                Severity::Error
            } else {
                Severity::Warning
            },
            format!(
                "follower {name} has {} to read and has not moved for {}",
                behind(pending),
                age(still)
            ),
            format!(
                "see vps.reactors.* for the part that follows as {name}; a holder that does not \
                 move is failing: look for `background part failed` in its replica's log"
            ),
        ),
        None => {
            let furthest = rows.iter().max_by_key(|(_, pending, _)| *pending);
            let message = match furthest {
                Some((name, pending, _)) if *pending > 0 => format!(
                    "{} moving (furthest behind: {name}, {})",
                    count(rows.len() as i64, "follower", "followers"),
                    behind(*pending)
                ),
                _ => format!(
                    "{} at the read horizon",
                    count(rows.len() as i64, "follower", "followers")
                ),
            };
            Finding::ok(FOLLOWERS, message)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_transaction_is_no_finding_and_a_long_one_is_named() {
        assert_eq!(judge_horizon(0, None).severity, Severity::Ok);
        let short = judge_horizon(2, Some((7, Some("vps".into()), Some("vps".into()), 1.5)));
        assert_eq!(short.severity, Severity::Ok);
        let long = judge_horizon(
            3,
            Some((4242, Some("vps".into()), Some("psql".into()), 42.0)),
        );
        assert_eq!(long.severity, Severity::Warning);
        assert!(
            long.message.contains("pid 4242 (application psql"),
            "{}",
            long.message
        );
        assert!(
            long.message.contains("3 committed events wait"),
            "{}",
            long.message
        );
        assert!(long.fix.unwrap().contains("pg_terminate_backend(4242)"));
        let ancient = judge_horizon(0, Some((1, None, None, 3600.0)));
        assert_eq!(ancient.severity, Severity::Error);
    }

    #[test]
    fn a_follower_is_stuck_only_when_it_has_events_to_read_and_stands_still() {
        let idle = vec![("chainer".to_string(), 0, None)];
        assert_eq!(judge_followers(&idle).severity, Severity::Ok);
        let moving = vec![("webhooks".to_string(), 12, Some(0.3))];
        let found = judge_followers(&moving);
        assert_eq!(found.severity, Severity::Ok);
        assert!(
            found.message.contains("webhooks, 12 events"),
            "{}",
            found.message
        );
        let stuck = vec![
            ("nats".to_string(), 5, Some(45.0)),
            ("usage".to_string(), 1, Some(900.0)),
        ];
        let found = judge_followers(&stuck);
        assert_eq!(found.severity, Severity::Error);
        assert!(
            found.message.starts_with("follower usage has 1 event"),
            "{}",
            found.message
        );
    }
}
