//! A provider account's configuration, parsed from the `provider` and `config` the operator
//! gave `providerAccounts.create` (SPEC §5.1), and validated before any call is made.

use std::fmt;
use std::time::Duration;

use reqwest::Url;
use serde_json::{Map, Value};

use super::error::ProviderError;

/// How to reach one provider account.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ProviderConfig {
    /// `hetzner-cloud`: the Hetzner Cloud API.
    HetznerCloud(HetznerConfig),
    /// `proxmox`: one node of a Proxmox VE cluster.
    Proxmox(ProxmoxConfig),
    /// `emulator`: the in-process cloud of `vps dev`.
    Emulator(EmulatorConfig),
}

/// `hetzner-cloud` account settings.
#[derive(Clone, PartialEq, Eq)]
pub struct HetznerConfig {
    /// API root without a trailing slash (default `https://api.hetzner.cloud/v1`).
    pub base_url: String,
    /// Project API token, sent as `Authorization: Bearer`.
    pub token: String,
    /// Location for new servers (`fsn1`, `nbg1`, …); absent lets Hetzner choose.
    pub location: Option<String>,
}

/// `proxmox` account settings.
#[derive(Clone, PartialEq, Eq)]
pub struct ProxmoxConfig {
    /// API root without a trailing slash, ending in `/api2/json`.
    pub base_url: String,
    /// API token id, `user@realm!tokenname`.
    pub token_id: String,
    /// API token secret (a UUID).
    pub token_secret: String,
    /// The node that holds the templates and the machines.
    pub node: String,
    /// Target storage for full clones; absent keeps the template's storage.
    pub storage: Option<String>,
}

/// `emulator` account settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmulatorConfig {
    /// How long a machine takes to boot or shut down (`bootDelayMs`, default 1000).
    pub boot_delay: Duration,
}

/// Why an account's configuration was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The `provider` names no implementation.
    #[error("unknown provider `{0}` (expected hetzner-cloud, proxmox or emulator)")]
    UnknownProvider(String),
    /// `config` is not a JSON object.
    #[error("{provider} config must be a JSON object")]
    NotAnObject {
        /// The provider whose config it is.
        provider: &'static str,
    },
    /// A required field is absent or empty.
    #[error("{provider} config is missing `{field}`")]
    MissingField {
        /// The provider whose config it is.
        provider: &'static str,
        /// The camelCase field name.
        field: &'static str,
    },
    /// A field is present but ill-formed.
    #[error("{provider} config field `{field}` is invalid: {reason}")]
    InvalidField {
        /// The provider whose config it is.
        provider: &'static str,
        /// The camelCase field name.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// A field this provider does not know (usually a typo, so it is refused, not ignored).
    #[error("{provider} config has unknown field `{field}`")]
    UnknownField {
        /// The provider whose config it is.
        provider: &'static str,
        /// The field as given.
        field: String,
    },
}

const HETZNER: &str = "hetzner-cloud";
const PROXMOX: &str = "proxmox";
const EMULATOR: &str = "emulator";
const HETZNER_DEFAULT_URL: &str = "https://api.hetzner.cloud/v1";
const EMULATOR_DEFAULT_BOOT_DELAY: Duration = Duration::from_secs(1);

impl ProviderConfig {
    /// Parses and validates an account's `provider` name and `config` object.
    pub fn parse(provider: &str, config: &Value) -> Result<Self, ConfigError> {
        match provider {
            HETZNER => Ok(ProviderConfig::HetznerCloud(parse_hetzner(config)?)),
            PROXMOX => Ok(ProviderConfig::Proxmox(parse_proxmox(config)?)),
            EMULATOR => Ok(ProviderConfig::Emulator(parse_emulator(config)?)),
            other => Err(ConfigError::UnknownProvider(other.to_owned())),
        }
    }

    /// The account's `provider` name.
    pub fn provider(&self) -> &'static str {
        match self {
            ProviderConfig::HetznerCloud(_) => HETZNER,
            ProviderConfig::Proxmox(_) => PROXMOX,
            ProviderConfig::Emulator(_) => EMULATOR,
        }
    }
}

impl Default for EmulatorConfig {
    fn default() -> Self {
        Self {
            boot_delay: EMULATOR_DEFAULT_BOOT_DELAY,
        }
    }
}

impl From<ConfigError> for ProviderError {
    /// A bad account configuration is `INVALID_CONFIG`: retrying will not fix it.
    fn from(error: ConfigError) -> Self {
        ProviderError::invalid_config(error.to_string())
    }
}

// Secrets stay out of logs: Debug shows that a token is set, never its value.
impl fmt::Debug for HetznerConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("HetznerConfig")
            .field("base_url", &self.base_url)
            .field("token", &"<redacted>")
            .field("location", &self.location)
            .finish()
    }
}

impl fmt::Debug for ProxmoxConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ProxmoxConfig")
            .field("base_url", &self.base_url)
            .field("token_id", &self.token_id)
            .field("token_secret", &"<redacted>")
            .field("node", &self.node)
            .field("storage", &self.storage)
            .finish()
    }
}

fn parse_hetzner(config: &Value) -> Result<HetznerConfig, ConfigError> {
    let fields = Fields::of(HETZNER, config, &["baseUrl", "token", "location"])?;
    Ok(HetznerConfig {
        base_url: fields.base_url("baseUrl", Some(HETZNER_DEFAULT_URL))?,
        token: fields.required("token")?,
        location: fields.optional("location")?,
    })
}

fn parse_proxmox(config: &Value) -> Result<ProxmoxConfig, ConfigError> {
    let fields = Fields::of(
        PROXMOX,
        config,
        &["baseUrl", "tokenId", "tokenSecret", "node", "storage"],
    )?;
    let token_id = fields.required("tokenId")?;
    if !token_id.contains('@') || !token_id.contains('!') {
        return Err(fields.invalid("tokenId", "expected `user@realm!tokenname`"));
    }
    Ok(ProxmoxConfig {
        base_url: fields.base_url("baseUrl", None)?,
        token_id,
        token_secret: fields.required("tokenSecret")?,
        node: fields.required("node")?,
        storage: fields.optional("storage")?,
    })
}

fn parse_emulator(config: &Value) -> Result<EmulatorConfig, ConfigError> {
    // An absent config is as good as `{}` for the emulator.
    if config.is_null() {
        return Ok(EmulatorConfig::default());
    }
    let fields = Fields::of(EMULATOR, config, &["bootDelayMs"])?;
    let boot_delay = match fields.map.get("bootDelayMs") {
        None => EMULATOR_DEFAULT_BOOT_DELAY,
        Some(value) => Duration::from_millis(
            value
                .as_u64()
                .ok_or_else(|| fields.invalid("bootDelayMs", "expected milliseconds"))?,
        ),
    };
    Ok(EmulatorConfig { boot_delay })
}

/// Reads one provider's config object, naming the provider and field in every error.
struct Fields<'a> {
    provider: &'static str,
    map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    fn of(provider: &'static str, config: &'a Value, known: &[&str]) -> Result<Self, ConfigError> {
        let map = config
            .as_object()
            .ok_or(ConfigError::NotAnObject { provider })?;
        if let Some(field) = map.keys().find(|key| !known.contains(&key.as_str())) {
            return Err(ConfigError::UnknownField {
                provider,
                field: field.clone(),
            });
        }
        Ok(Self { provider, map })
    }

    fn optional(&self, field: &'static str) -> Result<Option<String>, ConfigError> {
        match self.map.get(field) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s.trim().is_empty() => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.trim().to_owned())),
            Some(_) => Err(self.invalid(field, "expected a string")),
        }
    }

    fn required(&self, field: &'static str) -> Result<String, ConfigError> {
        self.optional(field)?.ok_or(ConfigError::MissingField {
            provider: self.provider,
            field,
        })
    }

    fn base_url(&self, field: &'static str, default: Option<&str>) -> Result<String, ConfigError> {
        let raw = match (self.optional(field)?, default) {
            (Some(raw), _) => raw,
            (None, Some(default)) => default.to_owned(),
            (None, None) => return Err(self.required(field).unwrap_err()),
        };
        let url = Url::parse(&raw).map_err(|e| self.invalid(field, e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(self.invalid(field, "expected an http or https URL"));
        }
        if url.query().is_some() || url.fragment().is_some() || url.cannot_be_a_base() {
            return Err(self.invalid(field, "expected an API root without query or fragment"));
        }
        Ok(raw.trim_end_matches('/').to_owned())
    }

    fn invalid(&self, field: &'static str, reason: impl Into<String>) -> ConfigError {
        ConfigError::InvalidField {
            provider: self.provider,
            field,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn a_hetzner_config_without_base_url_uses_the_public_api() {
        let config = ProviderConfig::parse(HETZNER, &json!({ "token": "t" })).unwrap();
        let ProviderConfig::HetznerCloud(config) = config else {
            panic!("expected hetzner")
        };
        assert_eq!(config.base_url, "https://api.hetzner.cloud/v1");
        assert_eq!(config.location, None);
    }

    #[test]
    fn a_hetzner_config_without_token_is_refused() {
        let error = ProviderConfig::parse(HETZNER, &json!({ "location": "fsn1" })).unwrap_err();
        assert_eq!(
            error,
            ConfigError::MissingField {
                provider: HETZNER,
                field: "token"
            }
        );
    }

    #[test]
    fn a_proxmox_config_needs_a_well_formed_token_id() {
        let config = json!({
            "baseUrl": "https://pve:8006/api2/json/",
            "tokenId": "root-vps",
            "tokenSecret": "s",
            "node": "pve",
        });
        let error = ProviderConfig::parse(PROXMOX, &config).unwrap_err();
        assert!(matches!(
            error,
            ConfigError::InvalidField {
                field: "tokenId",
                ..
            }
        ));
    }

    #[test]
    fn a_proxmox_config_keeps_its_base_url_without_trailing_slash() {
        let config = json!({
            "baseUrl": "https://pve:8006/api2/json/",
            "tokenId": "root@pam!vps",
            "tokenSecret": "s",
            "node": "pve",
        });
        let ProviderConfig::Proxmox(config) = ProviderConfig::parse(PROXMOX, &config).unwrap()
        else {
            panic!("expected proxmox")
        };
        assert_eq!(config.base_url, "https://pve:8006/api2/json");
        assert!(!format!("{config:?}").contains("\"s\""));
    }

    #[test]
    fn a_misspelled_field_is_refused_rather_than_ignored() {
        let error = ProviderConfig::parse(HETZNER, &json!({ "token": "t", "locaton": "x" }));
        assert!(matches!(error, Err(ConfigError::UnknownField { .. })));
    }

    #[test]
    fn a_base_url_must_be_http() {
        let error = ProviderConfig::parse(HETZNER, &json!({ "token": "t", "baseUrl": "ftp://x" }));
        assert!(matches!(
            error,
            Err(ConfigError::InvalidField {
                field: "baseUrl",
                ..
            })
        ));
    }

    #[test]
    fn an_unknown_provider_is_refused() {
        let error = ProviderConfig::parse("aws", &json!({})).unwrap_err();
        assert_eq!(error, ConfigError::UnknownProvider("aws".into()));
    }

    #[test]
    fn an_empty_emulator_config_boots_in_a_second() {
        let config = ProviderConfig::parse(EMULATOR, &json!({})).unwrap();
        assert_eq!(config, ProviderConfig::Emulator(EmulatorConfig::default()));
    }
}
