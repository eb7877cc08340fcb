//! `providerAccounts.*` (operators only): create, list, get. Answers never carry a secret.

use serde::Deserialize;
use vps_commands::provider_accounts::{self as accounts, CreateProviderAccount};
use vps_projections::provider_accounts::{self as views, ProviderAccountView};
use vps_reactors::providers::{ConfigError, ProviderConfig};

use super::missing;
use crate::error::ApiError;
use crate::registry::{Access::Operator, Call, Items, Method, NoParams};

/// A provider account by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountRef {
    /// `pa_…`.
    pub provider_account_id: String,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    vec![
        Method::new(
            "providerAccounts",
            "create",
            Operator,
            "Creates a provider account (credentials sealed).",
            create,
        ),
        Method::new(
            "providerAccounts",
            "get",
            Operator,
            "One account, without secrets.",
            get,
        ),
        Method::new(
            "providerAccounts",
            "list",
            Operator,
            "Every account, without secrets.",
            |c: Call, _: NoParams| async move { Ok(Items::from(views::list(&c.ctx.pool).await?)) },
        ),
    ]
}

async fn create(c: Call, input: CreateProviderAccount) -> Result<ProviderAccountView, ApiError> {
    ProviderConfig::parse(&input.provider, &input.config).map_err(refusal)?;
    Ok(accounts::create(&c.ctx, input).await?)
}

async fn get(c: Call, q: AccountRef) -> Result<ProviderAccountView, ApiError> {
    views::load(&c.ctx.pool, &q.provider_account_id)
        .await?
        .ok_or_else(|| missing("provider account", &q.provider_account_id))
}

/// A refused configuration, naming the field at fault (`provider`, `config`, `config.<field>`).
fn refusal(error: ConfigError) -> ApiError {
    let field = match &error {
        ConfigError::UnknownProvider(_) => "provider".to_string(),
        ConfigError::NotAnObject { .. } => "config".to_string(),
        ConfigError::MissingField { field, .. } | ConfigError::InvalidField { field, .. } => {
            format!("config.{field}")
        }
        ConfigError::UnknownField { field, .. } => format!("config.{field}"),
    };
    ApiError::invalid(&field, error.to_string())
}
