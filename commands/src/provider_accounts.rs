//! Provider accounts (`providerAccounts.create`) and what the reconciler learns about them
//! (a credential refused, then accepted again). Each change is one event on the account's
//! stream `provider_account-<id>`.
//!
//! Secrets never reach the log: the fields in [`SECRET_FIELDS`] are sealed in the secret store
//! under `secret://<account id>`, and the event keeps only that reference and the rest of the
//! configuration.

use serde::Deserialize;
use serde_json::{Map, Value};
use sqlx::PgConnection;
use vps_domain::provider_account::{
    self as domain, ProviderAccount as Account, ProviderAccountCreated, ProviderAccountEvent,
};
use vps_domain::DomainError;
use vps_projections::provider_accounts::{self as accounts, ProviderAccountView};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::operator::name_taken;
use crate::pipeline::{change, transaction};
use crate::record::new_id;
use crate::secrets;

/// Configuration fields that are credentials: sealed, never logged, never shown.
pub const SECRET_FIELDS: &[&str] = &["token", "tokenSecret"];

/// `providerAccounts.create`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateProviderAccount {
    /// `hetzner-cloud`, `proxmox` or `emulator`.
    pub provider: String,
    /// Unique name.
    pub name: String,
    /// The provider's settings, credentials included.
    #[serde(default)]
    pub config: Value,
}

/// The reference an account's sealed credentials are stored under.
pub fn secret_ref(account_id: &str) -> String {
    format!("secret://{account_id}")
}

/// Creates an account and answers it as the API shows it (without secrets).
///
/// The caller has validated `config` for `provider` (the provider clients, which know what a
/// valid configuration is, live in `vps_reactors`, above this crate).
pub async fn create(
    ctx: &Ctx,
    input: CreateProviderAccount,
) -> Result<ProviderAccountView, CommandError> {
    let (public, secret) = split(&input.config)?;
    transaction(ctx, &input.name, async |tx| {
        create_in(ctx, tx, &input, &public, &secret).await
    })
    .await
}

async fn create_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    input: &CreateProviderAccount,
    public: &Value,
    secret: &Map<String, Value>,
) -> Result<ProviderAccountView, CommandError> {
    let name_taken = name_taken(tx, "provider_accounts", None, &input.name, None).await?;
    let id = new_id("pacct");
    let secret_ref = if secret.is_empty() {
        None
    } else {
        let reference = secret_ref(&id);
        // A `Value`'s text is its compact JSON, with no failure to handle.
        let sealed = Value::Object(secret.clone()).to_string().into_bytes();
        secrets::seal(tx, &ctx.secrets, &reference, &id, &sealed).await?;
        Some(reference)
    };
    let created = ProviderAccountCreated {
        account_id: id.clone(),
        name: input.name.clone(),
        provider: input.provider.clone(),
        config: public.clone(),
        secret_ref,
    };
    let decided = domain::create(created, name_taken);
    change::<Account>(ctx, tx, &id, None, |_| decided).await?;
    accounts::load(&mut *tx, &id)
        .await?
        .ok_or_else(|| CommandError::not_found(format!("provider account {id}")))
}

/// An account's whole configuration, its sealed credentials opened and merged back in, for
/// building its provider. `None` when the credentials do not open under this deployment's key
/// (the server was restarted with another `[secrets] key`).
pub async fn full_config(
    conn: &mut PgConnection,
    key: &secrets::SecretKey,
    account: &ProviderAccountView,
) -> Result<Option<Value>, sqlx::Error> {
    let mut config = match &account.config {
        Value::Object(map) => map.clone(),
        _ => Map::new(),
    };
    if let Some(reference) = &account.secret_ref {
        let Some(sealed) = secrets::open(conn, key, reference).await? else {
            return Ok(None);
        };
        let Ok(Value::Object(secret)) = serde_json::from_slice::<Value>(&sealed) else {
            return Ok(None);
        };
        config.extend(secret);
    }
    Ok(Some(Value::Object(config)))
}

/// Records that the provider refused a call made with the account's configuration (shown as
/// the account's `lastError`). Repeating the error that already stands records nothing.
pub async fn record_error(
    ctx: &Ctx,
    account_id: &str,
    code: &str,
    message: &str,
) -> Result<(), CommandError> {
    note(ctx, account_id, |a| domain::record_error(a, code, message)).await
}

/// Clears the account's `lastError` after a call with it succeeded; nothing when none stands.
pub async fn clear_error(ctx: &Ctx, account_id: &str) -> Result<(), CommandError> {
    note(ctx, account_id, domain::clear_error).await
}

/// Records what `decide` says of an existing account; a missing account records nothing.
async fn note(
    ctx: &Ctx,
    account_id: &str,
    decide: impl Fn(&Account) -> Vec<ProviderAccountEvent>,
) -> Result<(), CommandError> {
    transaction(ctx, account_id, async |tx| {
        change::<Account>(ctx, tx, account_id, None, |a| {
            Ok(a.map(&decide).unwrap_or_default())
        })
        .await?;
        Ok(())
    })
    .await
}

/// Splits a configuration into what may be logged and shown, and the credentials.
fn split(config: &Value) -> Result<(Value, Map<String, Value>), CommandError> {
    let map = match config {
        Value::Null => Map::new(),
        Value::Object(map) => map.clone(),
        _ => return Err(invalid("config", "must be a JSON object")),
    };
    let (secret, public): (Map<String, Value>, Map<String, Value>) = map
        .into_iter()
        .partition(|(field, _)| SECRET_FIELDS.contains(&field.as_str()));
    Ok((Value::Object(public), secret))
}

fn invalid(field: &str, message: impl Into<String>) -> CommandError {
    CommandError::Domain(DomainError::InvalidInput {
        field: field.into(),
        message: message.into(),
    })
}
