//! A client of the Hetzner Cloud API (`https://api.hetzner.cloud/v1`).
//!
//! Idempotency: the server's name is [`machine_name`] of the idempotency key, and Hetzner
//! names are unique per project. `create` first looks the name up (`GET /servers?name=`), so
//! a create retried after a crash or a lost answer finds the first server; if two creates race
//! past the lookup, the loser's `uniqueness_error` sends it to the lookup again.
//!
//! Power and delete start a Hetzner action and return without waiting for it: the reconciler
//! reads the outcome with its next `get`.

mod wire;

use std::collections::BTreeMap;

use async_trait::async_trait;
use reqwest::{Method, RequestBuilder, StatusCode};
use serde::de::DeserializeOwned;

use super::config::HetznerConfig;
use super::error::ProviderError;
use super::machine::{CreateMachine, Machine, Power};
use super::naming::machine_name;
use super::transport::{endpoint, http_client, send_json};
use super::Provider;
use wire::{CreateServer, ErrorEnvelope, ServerEnvelope, ServerList};

const PROVIDER: &str = "hetzner-cloud";

/// The `hetzner-cloud` provider.
pub struct HetznerProvider {
    http: reqwest::Client,
    config: HetznerConfig,
}

/// A failed call, keeping Hetzner's own error code for the cases the client handles itself.
struct Failure {
    api_code: Option<String>,
    error: ProviderError,
}

impl HetznerProvider {
    /// A client of the API at `config.base_url`.
    pub fn new(config: HetznerConfig) -> Self {
        Self {
            http: http_client(),
            config,
        }
    }

    async fn find_by_name(&self, name: &str) -> Result<Option<Machine>, Failure> {
        let url = self.url(&["servers"])?;
        let list: ServerList = self
            .send(self.request(Method::GET, url).query(&[("name", name)]))
            .await?;
        Ok(list.servers.into_iter().next().map(|s| s.into_machine()))
    }

    async fn create_server(&self, name: &str, request: &CreateMachine) -> Result<Machine, Failure> {
        let mut labels = BTreeMap::from([("managed-by", "vps".to_owned())]);
        // Label values have Hetzner's own syntax; an instance id fits it, other keys may not.
        if is_label_value(&request.idempotency_key) {
            labels.insert("vps-idempotency-key", request.idempotency_key.clone());
        }
        let body = CreateServer {
            name,
            server_type: &request.offer_id,
            image: &request.image_id,
            location: self.config.location.as_deref(),
            user_data: request.user_data.as_deref(),
            labels,
            start_after_create: true,
        };
        let url = self.url(&["servers"])?;
        let created: ServerEnvelope = self
            .send(self.request(Method::POST, url).json(&body))
            .await?;
        Ok(created.server.into_machine())
    }

    fn request(&self, method: Method, url: reqwest::Url) -> RequestBuilder {
        self.http
            .request(method, url)
            .bearer_auth(&self.config.token)
    }

    fn url(&self, segments: &[&str]) -> Result<reqwest::Url, Failure> {
        endpoint(&self.config.base_url, segments).map_err(Failure::from)
    }

    async fn send<T: DeserializeOwned>(&self, request: RequestBuilder) -> Result<T, Failure> {
        send_json(PROVIDER, request, api_failure).await
    }

    /// Sends a request whose answer body the client does not need (actions, delete).
    async fn send_action(&self, method: Method, segments: &[&str]) -> Result<(), ProviderError> {
        let url = self.url(segments)?;
        self.send::<serde_json::Value>(self.request(method, url))
            .await?;
        Ok(())
    }
}

#[async_trait]
impl Provider for HetznerProvider {
    async fn create(&self, request: CreateMachine) -> Result<Machine, ProviderError> {
        let name = machine_name(&request.idempotency_key);
        if let Some(existing) = self.find_by_name(&name).await? {
            return Ok(existing);
        }
        match self.create_server(&name, &request).await {
            Ok(machine) => Ok(machine),
            // Another create for the same key won the race: its server is ours.
            Err(failure) if failure.api_code.as_deref() == Some("uniqueness_error") => {
                self.find_by_name(&name).await?.ok_or(failure.error)
            }
            Err(failure) => Err(failure.error),
        }
    }

    async fn get(&self, id: &str) -> Result<Machine, ProviderError> {
        let id = server_id(id)?;
        let url = self.url(&["servers", &id])?;
        let found: ServerEnvelope = self.send(self.request(Method::GET, url)).await?;
        Ok(found.server.into_machine())
    }

    async fn power(&self, id: &str, power: Power) -> Result<(), ProviderError> {
        let id = server_id(id)?;
        let action = match power {
            Power::On => "poweron",
            // `shutdown` sends an ACPI request; `poweroff` would cut the power.
            Power::GracefulOff => "shutdown",
        };
        self.send_action(Method::POST, &["servers", &id, "actions", action])
            .await
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        let id = server_id(id)?;
        self.send_action(Method::DELETE, &["servers", &id]).await
    }
}

impl From<ProviderError> for Failure {
    fn from(error: ProviderError) -> Self {
        Failure {
            api_code: None,
            error,
        }
    }
}

impl From<Failure> for ProviderError {
    fn from(failure: Failure) -> Self {
        failure.error
    }
}

/// Server ids are integers; anything else names no server, so it is answered without a call.
fn server_id(id: &str) -> Result<String, ProviderError> {
    id.parse::<u64>()
        .map(|n| n.to_string())
        .map_err(|_| ProviderError::not_found(format!("{PROVIDER}: no server has id `{id}`")))
}

fn api_failure(status: StatusCode, body: &str, wait: Option<std::time::Duration>) -> Failure {
    let Ok(ErrorEnvelope { error }) = serde_json::from_str::<ErrorEnvelope>(body) else {
        // Not Hetzner's JSON (a proxy's page, say): the status is all we know.
        let code = wire::error_code(status.as_u16(), "");
        let message = format!("{PROVIDER}: HTTP {status} without an API error body");
        return ProviderError::new(code, message)
            .with_retry_after(wait)
            .into();
    };
    let code = wire::error_code(status.as_u16(), &error.code);
    let message = match error.code.as_str() {
        "unauthorized" => format!(
            "{PROVIDER} rejected the API token (unauthorized: {}); check the account's token",
            error.message
        ),
        "forbidden" | "token_readonly" => format!(
            "{PROVIDER} refused the call ({}: {}); the token needs read-write access",
            error.code, error.message
        ),
        _ => format!("{PROVIDER}: {} ({})", error.message, error.code),
    };
    Failure {
        api_code: Some(error.code),
        error: ProviderError::new(code, message).with_retry_after(wait),
    }
}

/// Hetzner label values: at most 63 characters of `[A-Za-z0-9_.-]`, alphanumeric at both ends.
fn is_label_value(value: &str) -> bool {
    let edges_ok = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    value.len() <= 63
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && edges_ok(value.chars().next())
        && edges_ok(value.chars().last())
}
