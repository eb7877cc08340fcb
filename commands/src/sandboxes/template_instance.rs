//! What every instance of a template is admitted with, a sandbox's cold one and a warm one
//! alike: the template's pool, flavor and image, its network rule, and user data with the
//! template's environment resolved from the tenant's secrets.

use sqlx::PgConnection;
use vps_domain::state_table::DesiredState;
use vps_domain::template::Template;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::instances::{CreateInput, Origin};
use crate::secrets;

/// The create every instance of `t` is admitted with (keyed by `key`).
pub fn instance_input(t: &Template, key: &str, desired: DesiredState) -> CreateInput {
    CreateInput {
        tenant_id: t.tenant_id.clone(),
        pool_id: t.pool_id.clone(),
        flavor: t.spec.flavor.clone(),
        image_id: t.spec.image_id.clone(),
        ssh_keys: Vec::new(),
        user_data: None,
        project_id: None,
        desired_state: Some(desired),
        idempotency_key: key.to_string(),
        labels: None,
    }
}

/// What an instance of `t` carries: its network rule and its user data, with the template's
/// environment resolved from the tenant's secrets (sealed with the instance, never logged).
pub async fn origin(
    ctx: &Ctx,
    tx: &mut PgConnection,
    t: &Template,
) -> Result<Origin, CommandError> {
    let refs: Vec<&str> = t.spec.env.values().map(String::as_str).collect();
    if let Some(missing) = secrets::foreign_refs(tx, &t.tenant_id, &refs)
        .await?
        .first()
    {
        return Err(vps_domain::DomainError::invalid_state(format!(
            "template {} names {missing}, which is no longer a secret of the tenant",
            t.id
        ))
        .into());
    }
    let mut env = Vec::new();
    for (name, reference) in &t.spec.env {
        let value = secrets::open(tx, &ctx.secrets, reference)
            .await?
            .unwrap_or_default();
        env.push((name.clone(), String::from_utf8_lossy(&value).into_owned()));
    }
    let base = match &t.spec.user_data_ref {
        Some(r) => secrets::open(tx, &ctx.secrets, r)
            .await?
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let base = String::from_utf8_lossy(&base).into_owned();
    let base = if base.is_empty() {
        "#cloud-config\n".to_string()
    } else {
        base
    };
    Ok(Origin {
        network_policy: Some(t.spec.network),
        network_rules: t.spec.network_rules.clone(),
        user_data: Some(vps_domain::cloud_config::sandbox_user_data(&base, &env)),
        ..Origin::default()
    })
}
