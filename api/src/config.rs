//! `vps.toml` (SPEC §6) and the environment variables that override it.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;

/// `[timings]`: every reactor delay, in seconds; declared once, with its defaults, where the
/// reactors read it.
pub use vps_reactors::timings::Timings;

/// The whole configuration.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// Where the database is.
    #[serde(default)]
    pub database: DatabaseConfig,
    /// Where the API listens.
    #[serde(default)]
    pub http: HttpConfig,
    /// NATS publication (absent: none).
    #[serde(default)]
    pub nats: Option<NatsConfig>,
    /// The secret store.
    #[serde(default)]
    pub secrets: SecretsConfig,
    /// Every reactor delay.
    #[serde(default)]
    pub timings: Timings,
    /// Bearer tokens and who they are.
    #[serde(default)]
    pub identities: Vec<IdentityConfig>,
    /// Where webhooks may deliver.
    #[serde(default)]
    pub webhooks: WebhooksConfig,
    /// What one tenant or node may hold open.
    #[serde(default)]
    pub limits: LimitsConfig,
    /// Cedar policies loaded at start.
    #[serde(default)]
    pub policies: PoliciesConfig,
    /// Where snapshots are kept.
    #[serde(default)]
    pub snapshots: SnapshotsConfig,
    /// `sandboxes.exec`: the sandbox CA and where tunnels go.
    #[serde(default)]
    pub sandbox_exec: SandboxExecConfig,
    /// Preview URLs (`sandboxes.expose`).
    #[serde(default)]
    pub preview: PreviewConfig,
}

/// `[preview]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PreviewConfig {
    /// Where browsers reach this server's `/preview/…` route, e.g. `https://vps.example`
    /// (default: `http://` and the address it listens on).
    pub public_url: Option<String>,
}

/// `[sandbox_exec]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SandboxExecConfig {
    /// An OpenSSH private key file (ssh-ed25519 or ecdsa-sha2-nistp256, unencrypted) that signs
    /// sandbox user certificates; absent: `sandboxes.exec` is `UNSUPPORTED`.
    pub ca_key: Option<PathBuf>,
    /// Where clients reach a node's tunnel endpoint, e.g. `tcp://{nodeName}.hosts.example:2222`
    /// (`{nodeId}` and `{nodeName}` are replaced); absent: the `tunnelUrl` nodes report.
    pub tunnel_url: Option<String>,
}

impl SandboxExecConfig {
    /// The configured CA, loaded and checked (`None` without `ca_key`).
    pub fn load_ca(&self) -> Result<Option<vps_commands::sandboxes::exec::ca::SandboxCa>, String> {
        self.ca_key
            .as_deref()
            .map(vps_commands::sandboxes::exec::ca::SandboxCa::load)
            .transpose()
    }
}

/// `[snapshots]`: the snapshot store (SPEC §6).
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SnapshotsConfig {
    /// `file` (default) or `s3`.
    #[serde(default)]
    pub store: SnapshotBackend,
    /// `file`: the directory (default `.vps/snapshots`, beside the embedded database).
    pub dir: Option<PathBuf>,
    /// `file`: this server's URL as hosts reach it (default `http://` + `[http] listen`).
    pub public_url: Option<String>,
    /// `s3`: the bucket.
    pub bucket: Option<String>,
    /// `s3`: the API endpoint.
    pub endpoint: Option<String>,
    /// `s3`: the region (default `us-east-1`).
    pub region: Option<String>,
    /// `s3`: the access key id.
    pub access_key_id: Option<String>,
    /// `s3`: the secret access key.
    pub secret_access_key: Option<String>,
}

/// `[snapshots] store`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SnapshotBackend {
    /// Objects under a directory, served by vps.
    #[default]
    File,
    /// An S3 bucket.
    S3,
}

/// `[webhooks]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhooksConfig {
    /// CIDRs a webhook may target although they are loopback, link-local or private.
    #[serde(default)]
    pub allow_private: Vec<String>,
}

impl WebhooksConfig {
    /// The allowed networks, parsed (`validate` has checked them).
    pub fn allowed_networks(&self) -> Vec<vps_domain::network::IpCidr> {
        self.allow_private
            .iter()
            .filter_map(|c| c.parse().ok())
            .collect()
    }
}

/// `[limits]`: per-process bounds on what one caller holds open.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct LimitsConfig {
    /// Server-sent event streams one tenant (or operator identity) may hold open.
    pub sse_streams_per_tenant: usize,
    /// `nodes.spec` long-polls that may wait at once for one node.
    pub long_polls_per_node: usize,
    /// Create and claim `wait`s that may be waiting at once on this replica; past it a call
    /// answers at once, as a wait that timed out does.
    pub waits: usize,
    /// Live sandbox templates one tenant may have.
    pub templates_per_tenant: usize,
    /// Kept snapshots (`keep: true`, not deleted) one tenant may have.
    pub snapshots_per_tenant: usize,
    /// GiB of kept snapshots one tenant may store.
    pub snapshot_gib_per_tenant: u64,
}

impl Default for LimitsConfig {
    fn default() -> Self {
        LimitsConfig {
            sse_streams_per_tenant: 16,
            long_polls_per_node: 4,
            waits: 1024,
            templates_per_tenant: 200,
            snapshots_per_tenant: 100,
            snapshot_gib_per_tenant: 1000,
        }
    }
}

/// `[policies]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoliciesConfig {
    /// A directory of `*.cedar` files, loaded at start besides the stored policies.
    pub dir: Option<PathBuf>,
}

/// `[database]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseConfig {
    /// A PostgreSQL URL; absent: the embedded cluster under `data_dir`.
    pub url: Option<String>,
    /// Where the embedded cluster keeps its data (default `.vps/pg`).
    pub data_dir: Option<PathBuf>,
}

/// `[http]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpConfig {
    /// `host:port`.
    #[serde(default = "default_listen")]
    pub listen: String,
}

impl Default for HttpConfig {
    fn default() -> Self {
        HttpConfig {
            listen: default_listen(),
        }
    }
}

fn default_listen() -> String {
    "127.0.0.1:8080".into()
}

/// `[nats]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NatsConfig {
    /// `nats://host:port`.
    pub url: String,
    /// Prepended to every subject (`""` publishes `instance.created`).
    #[serde(default)]
    pub subject_prefix: String,
}

/// `[secrets]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SecretsConfig {
    /// Base64 of 32 random bytes; seals user data.
    pub key: Option<String>,
}

/// One `[[identities]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IdentityConfig {
    /// The bearer token.
    pub token: String,
    /// `id_…`.
    pub identity: String,
    /// Operators may call every method.
    #[serde(default)]
    pub operator: bool,
    /// The tenant a tenant identity acts for.
    pub tenant: Option<String>,
}

/// A configuration problem, naming the file, the key and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {problem}")]
pub struct ConfigError {
    /// The file (or `environment`).
    pub file: String,
    /// The key, e.g. `http.listen`.
    pub key: String,
    /// What is wrong.
    pub problem: String,
}

impl Config {
    /// Reads `path` (when given, or `VPS_CONFIG`), applies the environment overrides and
    /// validates the result.
    pub fn load(path: Option<&Path>) -> Result<Config, ConfigError> {
        let path = path
            .map(Path::to_path_buf)
            .or_else(|| std::env::var_os("VPS_CONFIG").map(PathBuf::from));
        let (mut config, file) = match &path {
            Some(p) => {
                let file = p.display().to_string();
                let text = std::fs::read_to_string(p).map_err(|e| ConfigError {
                    file: file.clone(),
                    key: "(file)".into(),
                    problem: format!("cannot read: {e}"),
                })?;
                (Config::parse(&text, &file)?, file)
            }
            None => (Config::default(), "(defaults)".to_string()),
        };
        config.apply_env();
        config.validate(&file)?;
        Ok(config)
    }

    /// Parses TOML text; `file` names it in errors.
    pub fn parse(text: &str, file: &str) -> Result<Config, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            key: e
                .span()
                .map(|s| format!("line {}", text[..s.start].matches('\n').count() + 1))
                .unwrap_or_else(|| "(document)".into()),
            problem: e.message().to_string(),
        })
    }

    fn apply_env(&mut self) {
        if let Ok(url) = std::env::var("VPS_DATABASE_URL") {
            self.database.url = Some(url);
        }
        if let Ok(listen) = std::env::var("VPS_LISTEN") {
            self.http.listen = listen;
        }
        if let Ok(url) = std::env::var("VPS_NATS_URL") {
            let prefix = self
                .nats
                .take()
                .map(|n| n.subject_prefix)
                .unwrap_or_default();
            self.nats = Some(NatsConfig {
                url,
                subject_prefix: prefix,
            });
        }
    }

    /// Checks what serde cannot.
    pub fn validate(&self, file: &str) -> Result<(), ConfigError> {
        let err = |key: &str, problem: String| ConfigError {
            file: file.to_string(),
            key: key.to_string(),
            problem,
        };
        self.listen_addr().map_err(|_| {
            err(
                "http.listen",
                format!("`{}` is not host:port", self.http.listen),
            )
        })?;
        if let Some(url) = &self.database.url {
            if !(url.starts_with("postgres://") || url.starts_with("postgresql://")) {
                return Err(err("database.url", "must start with postgres://".into()));
            }
        }
        if let Some(nats) = &self.nats {
            if !nats.url.starts_with("nats://") {
                return Err(err("nats.url", "must start with nats://".into()));
            }
        }
        if let Some(key) = &self.secrets.key {
            let bytes = data_encoding::BASE64
                .decode(key.as_ref())
                .map_err(|_| err("secrets.key", "is not base64".into()))?;
            if bytes.len() != 32 {
                return Err(err(
                    "secrets.key",
                    format!("decodes to {} bytes, not 32", bytes.len()),
                ));
            }
        }
        self.validate_webhooks_and_limits(&err)?;
        self.validate_snapshots(&err)?;
        self.sandbox_exec
            .load_ca()
            .map_err(|e| err("sandbox_exec.ca_key", e))?;
        if let Some(template) = &self.sandbox_exec.tunnel_url {
            let sample = vps_commands::sandboxes::exec::tunnel::render(template, "node_x", "x");
            vps_domain::tunnel_url::parse("tunnel_url", &sample).map_err(|_| {
                err(
                    "sandbox_exec.tunnel_url",
                    format!("`{template}` is not a tcp://host:port URL (with {{nodeId}} or {{nodeName}})"),
                )
            })?;
        }
        if let Some(url) = &self.preview.public_url {
            if !(url.starts_with("http://") || url.starts_with("https://")) {
                return Err(err(
                    "preview.public_url",
                    "must start with http:// or https://".into(),
                ));
            }
        }
        self.validate_timings(&err)?;
        self.validate_identities(&err)
    }

    /// `[timings]`: every duration positive and at most a day.
    fn validate_timings(
        &self,
        err: &dyn Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let timings = self.timings.entries();
        let a_day_at_most = |v: f64| v.is_finite() && v > 0.0 && v <= 86_400.0;
        all_within(
            err,
            "timings",
            &timings,
            a_day_at_most,
            "0 and 86400 seconds",
        )
    }

    /// `[[identities]]`: unique tokens of a fair length, a name, and a tenant unless operator.
    fn validate_identities(
        &self,
        err: &dyn Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let mut tokens = std::collections::HashSet::new();
        for (i, id) in self.identities.iter().enumerate() {
            let key = |k: &str| format!("identities[{i}].{k}");
            if id.token.len() < 8 {
                return Err(err(&key("token"), "must be at least 8 characters".into()));
            }
            if !tokens.insert(&id.token) {
                return Err(err(&key("token"), "is used by another identity".into()));
            }
            if id.identity.is_empty() {
                return Err(err(&key("identity"), "must not be empty".into()));
            }
            if !id.operator && id.tenant.as_deref().unwrap_or("").is_empty() {
                return Err(err(
                    &key("tenant"),
                    "a non-operator identity needs a tenant".into(),
                ));
            }
        }
        Ok(())
    }

    /// `[webhooks]` and `[limits]`: parsable networks, sane bounds.
    fn validate_webhooks_and_limits(
        &self,
        err: &dyn Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        for (i, cidr) in self.webhooks.allow_private.iter().enumerate() {
            if let Err(e) = cidr.parse::<vps_domain::network::IpCidr>() {
                return Err(err(&format!("webhooks.allow_private[{i}]"), e.to_string()));
            }
        }
        let limits = [
            ("sse_streams_per_tenant", self.limits.sse_streams_per_tenant),
            ("long_polls_per_node", self.limits.long_polls_per_node),
            ("waits", self.limits.waits),
            ("templates_per_tenant", self.limits.templates_per_tenant),
            ("snapshots_per_tenant", self.limits.snapshots_per_tenant),
        ];
        let fair = |v| (1..=10_000).contains(&v);
        all_within(err, "limits", &limits, fair, "1 and 10000")?;
        let gib = [(
            "snapshot_gib_per_tenant",
            self.limits.snapshot_gib_per_tenant,
        )];
        all_within(
            err,
            "limits",
            &gib,
            |v| (1..=10_000_000).contains(&v),
            "1 and 10000000",
        )
    }

    /// `[snapshots]`: an `s3` store names its bucket, endpoint and credentials.
    fn validate_snapshots(
        &self,
        err: &dyn Fn(&str, String) -> ConfigError,
    ) -> Result<(), ConfigError> {
        let s = &self.snapshots;
        if s.store == SnapshotBackend::S3 {
            for (key, v) in [
                ("bucket", &s.bucket),
                ("endpoint", &s.endpoint),
                ("access_key_id", &s.access_key_id),
                ("secret_access_key", &s.secret_access_key),
            ] {
                if v.as_deref().unwrap_or("").is_empty() {
                    return Err(err(
                        &format!("snapshots.{key}"),
                        "is required with store = \"s3\"".into(),
                    ));
                }
            }
        }
        for (key, v) in [("endpoint", &s.endpoint), ("public_url", &s.public_url)] {
            if let Some(url) = v {
                if !(url.starts_with("http://") || url.starts_with("https://")) {
                    return Err(err(
                        &format!("snapshots.{key}"),
                        "must start with http:// or https://".into(),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The snapshot store this configuration names; `secret` signs the `file` store's URLs,
    /// which expire on `clock`. `addr` is where this server listens (the `file` store's
    /// default URL).
    pub fn snapshot_store(
        &self,
        secret: &[u8],
        addr: SocketAddr,
        clock: vps_clock::Clock,
    ) -> Result<vps_store::SnapshotStore, ConfigError> {
        let s = &self.snapshots;
        match s.store {
            SnapshotBackend::File => {
                let dir = s
                    .dir
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(".vps/snapshots"));
                let public = s
                    .public_url
                    .clone()
                    .unwrap_or_else(|| format!("http://{addr}"));
                Ok(vps_store::SnapshotStore::File(vps_store::FileStore::new(
                    dir, &public, secret, clock,
                )))
            }
            SnapshotBackend::S3 => {
                let config = vps_store::S3Config {
                    bucket: s.bucket.clone().unwrap_or_default(),
                    endpoint: s.endpoint.clone().unwrap_or_default(),
                    region: s.region.clone().unwrap_or_else(|| "us-east-1".into()),
                    access_key_id: s.access_key_id.clone().unwrap_or_default(),
                    secret_access_key: s.secret_access_key.clone().unwrap_or_default(),
                };
                vps_store::S3Store::new(&config)
                    .map(vps_store::SnapshotStore::S3)
                    .map_err(|e| ConfigError {
                        file: String::new(),
                        key: "snapshots".into(),
                        problem: e.to_string(),
                    })
            }
        }
    }

    /// `[secrets] key`, decoded.
    pub fn secret_bytes(&self) -> anyhow::Result<[u8; 32]> {
        let key = self.secrets.key.as_ref().ok_or_else(|| {
            anyhow::anyhow!(
                "[secrets] key is required: base64 of 32 random bytes (openssl rand -base64 32); \
                 every replica needs the same one"
            )
        })?;
        let bytes = data_encoding::BASE64
            .decode(key.as_ref())
            .ok()
            .and_then(|b| <[u8; 32]>::try_from(b.as_slice()).ok())
            .ok_or_else(|| anyhow::anyhow!("[secrets] key: not base64 of 32 bytes"))?;
        Ok(bytes)
    }

    /// Where preview URLs start: `[preview] public_url`, else `http://` and `addr` (where this
    /// server listens).
    pub fn preview_url(&self, addr: SocketAddr) -> String {
        self.preview
            .public_url
            .clone()
            .unwrap_or_else(|| format!("http://{addr}"))
            .trim_end_matches('/')
            .to_string()
    }

    /// The parsed listen address.
    pub fn listen_addr(&self) -> Result<SocketAddr, std::net::AddrParseError> {
        self.http.listen.parse()
    }
}

/// The first of `values` (keys of `section`) that `within` refuses, as an error at
/// `section.key` saying the value `is not between {between}`.
fn all_within<T: Copy + std::fmt::Display>(
    err: &dyn Fn(&str, String) -> ConfigError,
    section: &str,
    values: &[(&str, T)],
    within: impl Fn(T) -> bool,
    between: &str,
) -> Result<(), ConfigError> {
    match values.iter().find(|(_, v)| !within(*v)) {
        Some((key, v)) => Err(err(
            &format!("{section}.{key}"),
            format!("{v} is not between {between}"),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_key_is_named_with_its_file() {
        let err = Config::parse("[http]\nlisen = \"x\"\n", "vps.toml").unwrap_err();
        let text = err.to_string();
        assert!(text.starts_with("vps.toml: line 2"), "{text}");
        assert!(text.contains("lisen"), "{text}");
    }

    #[test]
    fn a_bad_listen_address_names_the_key() {
        let config = Config::parse("[http]\nlisten = \"nowhere\"\n", "vps.toml").unwrap();
        let err = config.validate("vps.toml").unwrap_err();
        assert_eq!(err.key, "http.listen");
    }

    #[test]
    fn a_tenant_identity_without_a_tenant_is_refused() {
        let config = Config::parse(
            "[[identities]]\ntoken = \"12345678\"\nidentity = \"id_a\"\n",
            "vps.toml",
        )
        .unwrap();
        assert_eq!(
            config.validate("f").unwrap_err().key,
            "identities[0].tenant"
        );
    }

    #[test]
    fn a_bad_allowed_network_names_its_key() {
        let config = Config::parse(
            "[webhooks]\nallow_private = [\"127.0.0.0/8\", \"10.0.0.0\"]\n",
            "f",
        )
        .unwrap();
        let err = config.validate("f").unwrap_err();
        assert_eq!(err.key, "webhooks.allow_private[1]");
        assert!(Config::parse("[limits]\nsse_streams = 3\n", "f").is_err());
    }

    #[test]
    fn a_bad_sandbox_ca_or_tunnel_url_names_its_key() {
        let dir = std::env::temp_dir().join(format!("vps-config-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let bad = dir.join("bad-ca");
        std::fs::write(&bad, "not a key").unwrap();
        let text = format!("[sandbox_exec]\nca_key = {:?}\n", bad.display().to_string());
        let err = Config::parse(&text, "f")
            .unwrap()
            .validate("f")
            .unwrap_err();
        assert_eq!(err.key, "sandbox_exec.ca_key");
        let good = dir.join("good-ca");
        let _ = std::fs::remove_file(&good);
        vps_commands::sandboxes::exec::ca::SandboxCa::load_or_generate(&good).unwrap();
        let text = format!(
            "[sandbox_exec]\nca_key = {:?}\n",
            good.display().to_string()
        );
        Config::parse(&text, "f").unwrap().validate("f").unwrap();
        let text = "[sandbox_exec]\ntunnel_url = \"http://{nodeName}:22\"\n";
        let err = Config::parse(text, "f").unwrap().validate("f").unwrap_err();
        assert_eq!(err.key, "sandbox_exec.tunnel_url");
        let text = "[sandbox_exec]\ntunnel_url = \"tcp://{nodeName}.hosts.example:2222\"\n";
        Config::parse(text, "f").unwrap().validate("f").unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_timing_or_limit_out_of_range_names_its_key_and_bounds() {
        let err = Config::parse("[timings]\nlost_look = 90000.0\n", "f")
            .unwrap()
            .validate("f")
            .unwrap_err();
        assert_eq!(err.key, "timings.lost_look");
        assert_eq!(err.problem, "90000 is not between 0 and 86400 seconds");
        let err = Config::parse("[limits]\nlong_polls_per_node = 0\n", "f")
            .unwrap()
            .validate("f")
            .unwrap_err();
        assert_eq!(err.key, "limits.long_polls_per_node");
        assert_eq!(err.problem, "0 is not between 1 and 10000");
    }

    #[test]
    fn timings_default_to_the_spec_values() {
        let config = Config::parse("[timings]\ntransitional_look = 0.5\n", "f").unwrap();
        assert_eq!(config.timings.transitional_look, 0.5);
        assert_eq!(config.timings.unschedulable_retry, 30.0);
    }
}
