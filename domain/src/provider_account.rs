//! The provider account aggregate (stream `provider_account-<id>`): created with its public
//! configuration (credentials are sealed elsewhere, only referenced), and the last error a
//! call with it met, recorded and cleared.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::operator::{check_name, check_name_free};

/// `provider_account.created`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderAccountCreated {
    /// `pacct_…`.
    pub account_id: String,
    /// Unique name.
    pub name: String,
    /// `hetzner-cloud`, `proxmox` or `emulator`.
    pub provider: String,
    /// The account's configuration without its secret fields.
    pub config: Value,
    /// Where the secret fields are sealed (`secret://pacct_…`), when there are any.
    pub secret_ref: Option<String>,
}

/// `provider_account.error_recorded`: a call with this account's credentials was refused.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderAccountErrorRecorded {
    /// `pacct_…`.
    pub account_id: String,
    /// The provider error code (`INVALID_CONFIG`).
    pub code: String,
    /// The provider's words (no secrets).
    pub message: String,
}

/// `provider_account.error_cleared`: a later call with the account succeeded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProviderAccountErrorCleared {
    /// `pacct_…`.
    pub account_id: String,
}

crate::event_enum! {
    /// What happens to a provider account.
    pub enum ProviderAccountEvent {
        /// `provider_account.created`.
        Created(ProviderAccountCreated) = "provider_account.created",
        /// `provider_account.error_recorded`.
        ErrorRecorded(ProviderAccountErrorRecorded) = "provider_account.error_recorded",
        /// `provider_account.error_cleared`.
        ErrorCleared(ProviderAccountErrorCleared) = "provider_account.error_cleared",
    }
}

/// A provider account as its events leave it.
#[derive(Debug, Clone, PartialEq)]
pub struct ProviderAccount {
    /// `pacct_…`.
    pub id: String,
    /// The standing error: (code, message).
    pub last_error: Option<(String, String)>,
    /// Events folded.
    pub version: u64,
}

impl Aggregate for ProviderAccount {
    type Event = ProviderAccountEvent;
    const CATEGORY: &'static str = "provider_account";

    fn create(event: &ProviderAccountEvent, _at: DateTime<Utc>) -> Option<Self> {
        let ProviderAccountEvent::Created(c) = event else {
            return None;
        };
        Some(ProviderAccount {
            id: c.account_id.clone(),
            last_error: None,
            version: 1,
        })
    }

    fn apply(&mut self, event: &ProviderAccountEvent, _at: DateTime<Utc>) {
        match event {
            ProviderAccountEvent::Created(_) => {}
            ProviderAccountEvent::ErrorRecorded(e) => {
                self.last_error = Some((e.code.clone(), e.message.clone()))
            }
            ProviderAccountEvent::ErrorCleared(_) => self.last_error = None,
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// Decides a create; `name_taken` is the fact that another account has the name.
pub fn create(
    created: ProviderAccountCreated,
    name_taken: bool,
) -> Result<Vec<ProviderAccountEvent>, DomainError> {
    check_name("name", &created.name)?;
    check_name_free(name_taken, "provider account", &created.name, "")?;
    Ok(vec![ProviderAccountEvent::Created(created)])
}

/// Records an error unless the same one already stands.
pub fn record_error(
    account: &ProviderAccount,
    code: &str,
    message: &str,
) -> Vec<ProviderAccountEvent> {
    if account
        .last_error
        .as_ref()
        .is_some_and(|(c, m)| c == code && m == message)
    {
        return Vec::new();
    }
    vec![ProviderAccountEvent::ErrorRecorded(
        ProviderAccountErrorRecorded {
            account_id: account.id.clone(),
            code: code.into(),
            message: message.into(),
        },
    )]
}

/// Clears the standing error, if any.
pub fn clear_error(account: &ProviderAccount) -> Vec<ProviderAccountEvent> {
    match account.last_error {
        None => Vec::new(),
        Some(_) => vec![ProviderAccountEvent::ErrorCleared(
            ProviderAccountErrorCleared {
                account_id: account.id.clone(),
            },
        )],
    }
}
