//! Self-checks for operators: `vps doctor`, the `checks` of `/readyz` and the
//! `vps_doctor_findings` gauges all come from [`run`].
//!
//! Each check answers one or more [`Finding`]s named `vps.<area>.<name>`, with a severity and,
//! when something is wrong, a one-line fix. One file per family: `database` (reachable,
//! migrations), `events` (the read horizon, followers), `reactors` (lease holders, due work),
//! `sandboxes` (expiry, warm pools), `instances` (stuck deletes), `nodes` (liveness), `nats`,
//! `webhooks`, `secrets`; `report` prints them, `gauges` exports them.
//!
//! Checks only read: they never write a table or take a lease.

mod database;
mod events;
pub mod gauges;
mod instances;
mod nats;
mod nodes;
mod reactors;
pub mod readiness;
pub mod report;
mod sandboxes;
mod secrets;
mod webhooks;

use std::future::Future;
use std::time::Duration;

use futures::future::{join_all, BoxFuture, FutureExt};
use serde::Serialize;
use sqlx::PgPool;
use tokio::time::Instant;

use crate::config::Config;

/// How bad a finding is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// Nothing to do.
    Ok,
    /// Degraded, or about to be: look soon.
    Warning,
    /// Broken: act now (`vps doctor` exits 1).
    Error,
}

impl Severity {
    /// Every severity, mildest first.
    pub const ALL: [Severity; 3] = [Severity::Ok, Severity::Warning, Severity::Error];

    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Severity::Ok => "ok",
            Severity::Warning => "warning",
            Severity::Error => "error",
        }
    }
}

/// What one check found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    /// `vps.<area>.<name>`.
    pub check: String,
    /// How bad it is.
    pub severity: Severity,
    /// What was seen, in one line.
    pub message: String,
    /// What an operator can do about it (absent when all is well).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Finding {
    /// All is well.
    pub fn ok(check: impl Into<String>, message: impl Into<String>) -> Finding {
        Finding {
            check: check.into(),
            severity: Severity::Ok,
            message: message.into(),
            fix: None,
        }
    }

    /// Something is wrong (`severity` is not `Ok`), and `fix` says what to do.
    pub fn bad(
        check: impl Into<String>,
        severity: Severity,
        message: impl Into<String>,
        fix: impl Into<String>,
    ) -> Finding {
        Finding {
            check: check.into(),
            severity,
            message: message.into(),
            fix: Some(fix.into()),
        }
    }
}

/// What the checks look at.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    /// The database, or why it could not be opened.
    pub pool: Result<&'a PgPool, &'a str>,
    /// The configuration in force (timings, `[nats]`, `[secrets]`).
    pub config: &'a Config,
    /// How long the checks after the database's may take in all; one still running then is
    /// answered as a warning, so a slow check never hangs its caller.
    pub budget: Duration,
}

/// Runs every check; findings come in a fixed order. The database checks come first and are
/// not bounded by the budget (they decide readiness); when the database is unreachable or
/// its schema is behind, the checks that read it are skipped.
pub async fn run(ctx: Ctx<'_>) -> Vec<Finding> {
    let mut findings = database::check(ctx.pool).await;
    let schema_ok = findings.iter().all(|f| f.severity == Severity::Ok);
    let deadline = Instant::now() + ctx.budget;
    let mut checks: Vec<(&'static str, BoxFuture<'_, anyhow::Result<Vec<Finding>>>)> = Vec::new();
    if let (Ok(pool), true) = (ctx.pool, schema_ok) {
        let parts = reactors::parts(ctx.config);
        checks.push((events::HORIZON, one(events::horizon(pool)).boxed()));
        checks.push((
            events::FOLLOWERS,
            one(events::followers(pool, reactors::followers(&parts))).boxed(),
        ));
        checks.push((reactors::AREA, reactors::check(pool, parts).boxed()));
        checks.push((
            sandboxes::EXPIRY,
            one(sandboxes::expiry(pool, ctx.config.timings.sandbox_pass)).boxed(),
        ));
        checks.push((sandboxes::WARM, one(sandboxes::warm(pool)).boxed()));
        checks.push((instances::DELETING, one(instances::deleting(pool)).boxed()));
        checks.push((nodes::LIVENESS, one(nodes::liveness(pool)).boxed()));
        checks.push((webhooks::DISABLED, one(webhooks::disabled(pool)).boxed()));
    }
    checks.push((
        nats::REACHABLE,
        one(nats::reachable(ctx.config.nats.as_ref(), deadline)).boxed(),
    ));
    let bounded = checks
        .into_iter()
        .map(|(name, check)| bounded(name, check, deadline, ctx.budget));
    for answer in join_all(bounded).await {
        findings.extend(answer);
    }
    findings.push(secrets::key(ctx.config));
    findings
}

/// Whether the database answers and every migration is applied: what `/readyz` calls ready.
/// `Err` names the first failing database check's message.
pub fn readiness(findings: &[Finding]) -> Result<(), String> {
    match findings
        .iter()
        .find(|f| f.check.starts_with(database::AREA) && f.severity != Severity::Ok)
    {
        Some(f) => Err(f.message.clone()),
        None => Ok(()),
    }
}

/// Readiness alone (the database answers, every migration applied): what anonymous `/readyz`
/// runs, two reads and nothing else.
pub async fn ready(pool: &PgPool) -> bool {
    readiness(&database::check(Ok(pool)).await).is_ok()
}

/// Wraps a check answering one finding.
async fn one<F, E>(check: F) -> anyhow::Result<Vec<Finding>>
where
    F: Future<Output = Result<Finding, E>>,
    anyhow::Error: From<E>,
{
    Ok(vec![check.await?])
}

/// Runs `check` until `deadline`; a failure or a timeout becomes a finding of its own.
async fn bounded(
    name: &'static str,
    check: impl Future<Output = anyhow::Result<Vec<Finding>>>,
    deadline: Instant,
    budget: Duration,
) -> Vec<Finding> {
    match tokio::time::timeout_at(deadline, check).await {
        Ok(Ok(findings)) => findings,
        Ok(Err(e)) => vec![Finding::bad(
            name,
            Severity::Error,
            format!("the check failed: {e:#}"),
            "read the error: the database refused a read the server needs",
        )],
        Err(_) => vec![Finding::bad(
            name,
            Severity::Warning,
            format!("the check did not finish within {budget:?}"),
            "the database is slow or a lock is held: look at pg_stat_activity",
        )],
    }
}

/// `n` items, singular or plural: `1 sandbox`, `2 sandboxes`.
fn count(n: i64, one: &str, many: &str) -> String {
    if n == 1 {
        format!("1 {one}")
    } else {
        format!("{n} {many}")
    }
}

/// Up to the first five ids, comma-separated, with `…` when there are more.
fn some_ids(ids: &[String], total: i64) -> String {
    let shown = ids.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
    if total > ids.len().min(5) as i64 {
        format!("{shown}, …")
    } else {
        shown
    }
}

/// Seconds, rounded for people: `42 s`, `12 min`, `3 h`.
fn age(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..=119 => format!("{s} s"),
        120..=7199 => format!("{} min", s / 60),
        _ => format!("{} h", s / 3600),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_read_like_a_person_would_say_them() {
        assert_eq!(age(0.4), "0 s");
        assert_eq!(age(95.0), "95 s");
        assert_eq!(age(600.0), "10 min");
        assert_eq!(age(7200.0), "2 h");
    }

    #[test]
    fn id_lists_are_cut_after_five() {
        let ids: Vec<String> = (1..=5).map(|i| format!("sbx_{i}")).collect();
        assert_eq!(some_ids(&ids[..2], 2), "sbx_1, sbx_2");
        assert_eq!(some_ids(&ids, 9), "sbx_1, sbx_2, sbx_3, sbx_4, sbx_5, …");
    }

    #[test]
    fn only_database_findings_decide_readiness() {
        let findings = vec![
            Finding::ok("vps.database.reachable", "answers"),
            Finding::bad("vps.nodes.liveness", Severity::Error, "lost", "fix"),
        ];
        assert_eq!(readiness(&findings), Ok(()));
        let findings = vec![Finding::bad(
            "vps.database.migrations",
            Severity::Error,
            "3 of 14 migrations applied",
            "fix",
        )];
        assert_eq!(
            readiness(&findings),
            Err("3 of 14 migrations applied".into())
        );
    }
}
