//! `vps.reactors.<part>`: every background part that runs once across replicas has a holder
//! of its lease (a session advisory lock, `vps_events::lease`), and the parts that share a
//! work queue take their due items. The part names are those of `server.rs` (and of
//! `vps_background_failures_total{part}`).

use sqlx::PgPool;

use super::{age, count, some_ids, Finding, Severity};
use crate::config::Config;

/// The family's name, for a check that failed as a whole.
pub const AREA: &str = "vps.reactors";

/// Due work nobody took for this long is a warning (a backlog)...
const BACKLOG_WARNING: f64 = 60.0;
/// ... and this long an error.
const BACKLOG_ERROR: f64 = 600.0;
/// A work-item lease that ran out this long ago without being taken over: its holder stopped
/// renewing and no replica works the queue.
const ABANDONED_ERROR: f64 = 60.0;

/// A background part held by one replica at a time.
pub struct Part {
    /// As `server.rs` names it.
    pub name: &'static str,
    /// Its lease.
    pub lease: &'static str,
    /// Its durable follower, when it follows the log.
    pub follower: Option<&'static str>,
}

/// The lease-holding parts this configuration runs.
pub fn parts(config: &Config) -> Vec<Part> {
    let part = |name, lease, follower| Part {
        name,
        lease,
        follower,
    };
    let chainer = vps_events::chain::CHAINER;
    let specs = vps_projections::node_specs::FOLLOWER;
    let waker = vps_reactors::waker::NAME;
    let mut parts = vec![
        part("chainer", chainer, Some(chainer)),
        part("node-specs", specs, Some(specs)),
        part("instance-waker", waker, Some(waker)),
        part(
            "usage-metering",
            vps_reactors::usage::LEASE,
            Some(vps_reactors::usage::FOLLOWER),
        ),
        part("node-liveness", vps_reactors::liveness::LEASE, None),
        part("sandbox-reconciler", vps_reactors::sandboxes::LEASE, None),
        part(
            "webhook-fanout",
            vps_reactors::webhooks::LEASE,
            Some(vps_reactors::webhooks::FOLLOWER),
        ),
    ];
    if config.nats.is_some() {
        parts.push(part(
            "nats-publisher",
            vps_reactors::nats::LEASE,
            Some(vps_reactors::nats::FOLLOWER),
        ));
    }
    parts
}

/// The followers of `parts`.
pub fn followers(parts: &[Part]) -> Vec<&'static str> {
    parts.iter().filter_map(|p| p.follower).collect()
}

/// The work queues, by the part that works them.
const QUEUES: [(&str, &str); 2] = [
    ("instance-reconciler", vps_reactors::instances::KIND),
    ("tenant-teardown", vps_reactors::teardown::KIND),
];

/// One finding per lease-holding part, then one per work queue.
pub async fn check(pool: &PgPool, parts: Vec<Part>) -> anyhow::Result<Vec<Finding>> {
    let leases: Vec<&str> = parts.iter().map(|p| p.lease).collect();
    let holders: Vec<(String, Option<i32>, Option<String>)> = sqlx::query_as(
        "SELECT n.name, l.pid, a.application_name
           FROM unnest($1::text[]) AS n(name)
           LEFT JOIN pg_locks l
             ON l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
            AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
            AND l.classid::bigint = ((hashtextextended(n.name, 0) >> 32) & 4294967295)
            AND l.objid::bigint = (hashtextextended(n.name, 0) & 4294967295)
           LEFT JOIN pg_stat_activity a ON a.pid = l.pid",
    )
    .bind(&leases)
    .fetch_all(pool)
    .await?;
    let mut findings: Vec<Finding> = parts
        .iter()
        .map(|part| {
            let holder = holders
                .iter()
                .find(|(lease, pid, _)| lease == part.lease && pid.is_some());
            judge_lease(
                part,
                holder.map(|(_, pid, app)| (pid.unwrap_or(0), app.clone())),
            )
        })
        .collect();
    let kinds: Vec<&str> = QUEUES.iter().map(|(_, kind)| *kind).collect();
    let queues: Vec<Queue> = sqlx::query_as(
        "SELECT k.kind,
                count(w.key) AS due,
                max(extract(epoch FROM now() - greatest(w.due_at, w.lease_until)))::float8 AS waited,
                coalesce((array_agg(w.key ORDER BY w.due_at) FILTER (WHERE w.key IS NOT NULL))[1:5],
                         '{}'::text[]) AS keys,
                max(extract(epoch FROM now() - w.lease_until))::float8 AS abandoned
           FROM unnest($1::text[]) AS k(kind)
           LEFT JOIN work_items w
             ON w.kind = k.kind AND w.due_at <= now()
            AND (w.lease_until IS NULL OR w.lease_until < now())
          GROUP BY k.kind",
    )
    .bind(&kinds)
    .fetch_all(pool)
    .await?;
    for (part, kind) in QUEUES {
        let queue = queues.iter().find(|q| q.kind == kind);
        findings.push(judge_queue(part, queue.unwrap_or(&Queue::default())));
    }
    Ok(findings)
}

fn check_name(part: &str) -> String {
    format!("{AREA}.{part}")
}

fn judge_lease(part: &Part, holder: Option<(i32, Option<String>)>) -> Finding {
    match holder {
        Some((pid, application)) => Finding::ok(
            check_name(part.name),
            format!(
                "lease {} held by pid {pid} ({})",
                part.lease,
                application
                    .filter(|a| !a.is_empty())
                    .unwrap_or_else(|| "unnamed".into())
            ),
        ),
        None => Finding::bad(
            check_name(part.name),
            Severity::Error,
            format!(
                "no replica holds lease {}: {} is not running",
                part.lease, part.name
            ),
            format!(
                "start `vps serve` (every replica runs every part; one holds each lease), or \
                 look in its log for `background part failed` with part={}",
                part.name
            ),
        ),
    }
}

/// A work queue's items that are due and that nobody holds.
#[derive(Debug, Default, sqlx::FromRow)]
struct Queue {
    /// The work kind.
    kind: String,
    /// How many.
    due: i64,
    /// The longest any of them has waited (since due, or since its lease ran out), seconds.
    waited: Option<f64>,
    /// The first few keys, longest due first.
    keys: Vec<String>,
    /// Seconds since the earliest run-out lease among them ran out (taken, then abandoned).
    abandoned: Option<f64>,
}

fn judge_queue(part: &str, queue: &Queue) -> Finding {
    let name = check_name(part);
    let (due, keys, abandoned) = (queue.due, &queue.keys, queue.abandoned);
    let waited = queue.waited.unwrap_or(0.0);
    if due == 0 || waited < BACKLOG_WARNING {
        return Finding::ok(
            name,
            match due {
                0 => "no due work waiting".to_string(),
                n => format!(
                    "{} due, taken within {}",
                    count(n, "item", "items"),
                    age(waited)
                ),
            },
        );
    }
    let fix = format!(
        "check that a `vps serve` replica runs and its log has no `background part failed` with \
         part={part}; a backlog that only grows needs more replicas"
    );
    match abandoned.filter(|a| *a >= ABANDONED_ERROR) {
        Some(since) => Finding::bad(
            name,
            Severity::Error,
            format!(
                "a work-item lease ran out {} ago and nobody took it over ({} due: {}): \
                 its holder stopped renewing and no replica works the queue",
                age(since),
                count(due, "item", "items"),
                some_ids(keys, due)
            ),
            fix,
        ),
        None => Finding::bad(
            name,
            if waited >= BACKLOG_ERROR {
                Severity::Error
            } else {
                Severity::Warning
            },
            format!(
                "{} due and not taken for up to {} ({})",
                count(due, "item", "items"),
                age(waited),
                some_ids(keys, due)
            ),
            fix,
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_without_a_holder_is_an_error() {
        let part = Part {
            name: "sandbox-reconciler",
            lease: "sandboxes",
            follower: None,
        };
        let held = judge_lease(&part, Some((12, Some("vps".into()))));
        assert_eq!(held.severity, Severity::Ok);
        assert_eq!(held.check, "vps.reactors.sandbox-reconciler");
        let free = judge_lease(&part, None);
        assert_eq!(free.severity, Severity::Error);
        assert!(free.message.contains("no replica holds lease sandboxes"));
    }

    #[test]
    fn due_work_is_a_backlog_until_a_lease_is_abandoned() {
        let queue = |waited: f64, abandoned: Option<f64>| Queue {
            kind: "instance".into(),
            due: 3,
            waited: Some(waited),
            keys: vec!["inst_1".into()],
            abandoned,
        };
        let judge = |q: Queue| judge_queue("instance-reconciler", &q);
        assert_eq!(judge(Queue::default()).severity, Severity::Ok);
        assert_eq!(judge(queue(0.2, None)).severity, Severity::Ok);
        assert_eq!(judge(queue(90.0, None)).severity, Severity::Warning);
        assert_eq!(judge(queue(900.0, None)).severity, Severity::Error);
        let abandoned = judge(queue(90.0, Some(75.0)));
        assert_eq!(abandoned.severity, Severity::Error);
        assert!(abandoned.message.contains("stopped renewing"));
    }
}
