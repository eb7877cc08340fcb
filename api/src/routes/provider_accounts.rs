//! `providerAccounts.*` (operators only): create, list, get. Answers never carry a secret.

use serde::Deserialize;
use serde_json::{json, Value};
use vps_commands::provider_accounts::{self as accounts, CreateProviderAccount};
use vps_commands::Ctx;
use vps_projections::provider_accounts as views;
use vps_reactors::providers::{ConfigError, ProviderConfig};

use crate::error::ApiError;
use crate::rpc::{parse, Caller};

#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct AccountRef {
    provider_account_id: String,
}

/// Dispatches a `providerAccounts` method.
pub async fn handle(
    ctx: &Ctx,
    caller: &Caller,
    method: &str,
    body: &[u8],
) -> Result<Value, ApiError> {
    caller.operator()?;
    match method {
        "create" => {
            let input: CreateProviderAccount = parse(body)?;
            ProviderConfig::parse(&input.provider, &input.config).map_err(refusal)?;
            Ok(accounts::create(ctx, input).await?)
        }
        "get" => {
            let q: AccountRef = parse(body)?;
            views::view(&ctx.pool, &q.provider_account_id)
                .await?
                .ok_or_else(|| {
                    ApiError::new(
                        "NOT_FOUND",
                        format!("provider account {} not found", q.provider_account_id),
                    )
                })
        }
        "list" => {
            let _: Value = parse(body)?;
            Ok(json!({ "items": views::list(&ctx.pool).await? }))
        }
        _ => Err(ApiError::new(
            "NOT_FOUND",
            format!("no method providerAccounts.{method}"),
        )),
    }
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
