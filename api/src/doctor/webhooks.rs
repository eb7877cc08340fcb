//! `vps.webhooks.disabled`: subscriptions whose endpoint answered 410 Gone.

use sqlx::PgPool;

use super::{count, some_ids, Finding, Severity};

/// The check.
pub const DISABLED: &str = "vps.webhooks.disabled";

/// Disabled subscriptions receive nothing until they are subscribed again.
pub async fn disabled(pool: &PgPool) -> Result<Finding, sqlx::Error> {
    let disabled = vps_projections::webhooks::disabled(pool).await?;
    let (n, ids) = (disabled.count, disabled.some);
    if n == 0 {
        return Ok(Finding::ok(DISABLED, "no webhook subscription is disabled"));
    }
    Ok(Finding::bad(
        DISABLED,
        Severity::Warning,
        format!(
            "{} disabled (the endpoint answered 410 Gone), nothing is delivered to it: {}",
            count(n, "webhook subscription is", "webhook subscriptions are"),
            some_ids(&ids, n)
        ),
        "its owner fixes the endpoint, subscribes again (webhooks.create) and deletes the \
         disabled one (webhooks.delete)",
    ))
}
