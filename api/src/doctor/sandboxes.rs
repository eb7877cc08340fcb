//! `vps.sandboxes.expiry` (open sandboxes well past their lifetime) and `vps.sandboxes.warm`
//! (warm pools short of `warm.min` with no refill).

use sqlx::PgPool;

use super::{age, count, some_ids, Finding, Severity};

/// The expiry check.
pub const EXPIRY: &str = "vps.sandboxes.expiry";
/// The warm-pool check.
pub const WARM: &str = "vps.sandboxes.warm";

/// How many sandbox passes past `expiresAt` an open sandbox may be before it is an error.
const PASSES: f64 = 2.0;
/// A pool below `warm.min` with no refill for this long is a warning.
const WARM_WARNING: f64 = 600.0;

/// Open sandboxes more than two `[timings] sandbox_pass` past `expiresAt`: the reconciler
/// expires them every pass, so it is not running, or failing.
pub async fn expiry(pool: &PgPool, sandbox_pass: f64) -> Result<Finding, sqlx::Error> {
    let grace = PASSES * sandbox_pass;
    let found = vps_projections::sandboxes::overdue(pool, grace).await?;
    let (overdue, ids, oldest) = (found.count, found.ids, found.oldest_secs);
    if overdue == 0 {
        return Ok(Finding::ok(
            EXPIRY,
            format!("no open sandbox is more than {} past expiresAt", age(grace)),
        ));
    }
    Ok(Finding::bad(
        EXPIRY,
        Severity::Error,
        format!(
            "{} open more than two passes ({}) past expiresAt, the oldest by {}: {}",
            count(overdue, "sandbox is", "sandboxes are"),
            age(grace),
            age(oldest.unwrap_or(0.0)),
            some_ids(&ids, overdue)
        ),
        "the sandbox reconciler is not running or failing: see vps.reactors.sandbox-reconciler \
         and look for `background part failed` with part=sandbox-reconciler in the log",
    ))
}

/// Live templates with `warm.min` whose settled warm instances (of the current version,
/// unclaimed) fall short, when neither a refill nor a template change happened for ten
/// minutes: quota, capacity, a vanished flavor or image, or instances that never settle.
pub async fn warm(pool: &PgPool) -> Result<Finding, sqlx::Error> {
    let rows: Vec<(String, i64, i64, f64)> = vps_projections::sandboxes::warm_pools(pool)
        .await?
        .into_iter()
        .map(|p| (p.template_id, p.min, p.settled, p.since_secs))
        .collect();
    Ok(judge_warm(&rows))
}

/// `rows`: template, `warm.min`, settled instances, seconds since the last refill or change.
fn judge_warm(rows: &[(String, i64, i64, f64)]) -> Finding {
    let short: Vec<&(String, i64, i64, f64)> = rows
        .iter()
        .filter(|(_, min, settled, since)| settled < min && *since >= WARM_WARNING)
        .collect();
    let Some((id, min, settled, since)) = short.first() else {
        return Finding::ok(
            WARM,
            match rows.len() {
                0 => "no template keeps a warm pool".to_string(),
                n => format!(
                    "{} a warm pool, none short of warm.min for {}",
                    count(n as i64, "template keeps", "templates keep"),
                    age(WARM_WARNING)
                ),
            },
        );
    };
    let ids: Vec<String> = short.iter().map(|r| r.0.clone()).collect();
    Finding::bad(
        WARM,
        Severity::Warning,
        format!(
            "{} below warm.min with no refill for {} (e.g. {id}: {settled} of {min} settled, \
             {} since the last refill): {}",
            count(short.len() as i64, "template", "templates"),
            age(WARM_WARNING),
            age(*since),
            some_ids(&ids, ids.len() as i64)
        ),
        "look for `warm sandbox instance not created` in the log: the tenant's quota, the \
         pool's capacity, or the template's flavor or image stops the refill",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_pool_is_a_warning_only_after_ten_minutes_without_a_refill() {
        let fresh = vec![("sbxt_a".to_string(), 3, 1, 30.0)];
        assert_eq!(judge_warm(&fresh).severity, Severity::Ok);
        let full = vec![("sbxt_a".to_string(), 3, 3, 3600.0)];
        assert_eq!(judge_warm(&full).severity, Severity::Ok);
        let starved = vec![("sbxt_a".to_string(), 3, 1, 900.0)];
        let found = judge_warm(&starved);
        assert_eq!(found.severity, Severity::Warning);
        assert!(
            found.message.contains("sbxt_a: 1 of 3 settled"),
            "{}",
            found.message
        );
    }
}
