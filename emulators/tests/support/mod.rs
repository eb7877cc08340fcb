//! The targets the provider tests run against, and helpers to wait on a cloud.

#![allow(dead_code)] // each test file uses part of it

use std::fmt::Debug;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use serde_json::json;
use vps_emulators::{hetzner, proxmox, Fault};
use vps_reactors::providers::{
    build, CreateMachine, EmulatorConfig, EmulatorFault, EmulatorProvider, Machine, Provider,
    ProviderConfig, ProviderError, ProviderErrorCode,
};

/// How long a test waits for a cloud (or a host) to get somewhere: generous, so a busy 2-core
/// CI machine does not flake. A passing test never waits this long.
pub const PATIENCE: Duration = Duration::from_secs(20);
const POLL: Duration = Duration::from_millis(25);

/// A provider under test and the knobs of the cloud behind it.
pub trait Target {
    /// The provider, built as the reconciler builds it.
    fn provider(&self) -> Arc<dyn Provider>;
    /// An offer id the cloud accepts.
    fn offer_id(&self) -> &'static str;
    /// A create request for `key` of an offer the cloud accepts.
    fn request(&self, key: &str) -> CreateMachine {
        create_request(key, self.offer_id())
    }
    /// The same provider with credentials the cloud refuses, if it has credentials at all.
    fn provider_with_bad_credentials(&self) -> Option<Arc<dyn Provider>>;
    /// Makes the next request answer "rate limited, retry after 1 s".
    fn rate_limit_next(&self);
    /// Makes the next create happen but its answer be lost.
    fn lose_next_create_answer(&self);
    /// How many machines the cloud holds.
    fn machine_count(&self) -> usize;
    /// Deletes a machine without the client knowing.
    fn remove_behind_the_clients_back(&self, id: &str);
}

/// The Hetzner Cloud client against the Hetzner emulator.
pub struct HetznerTarget {
    pub base_url: String,
    pub emulator: hetzner::Handle,
}

/// The Proxmox VE client against the Proxmox emulator.
pub struct ProxmoxTarget {
    pub base_url: String,
    pub emulator: proxmox::Handle,
}

/// The in-process emulator.
pub struct EmulatorTarget {
    pub provider: Arc<EmulatorProvider>,
}

/// A create for `key` of `offer` (a Hetzner server type, a Proxmox template vmid, …).
pub fn create_request(key: &str, offer: &str) -> CreateMachine {
    CreateMachine {
        idempotency_key: key.to_owned(),
        name: "web-1".to_owned(),
        offer_id: offer.to_owned(),
        image_id: "ubuntu-24.04".to_owned(),
        user_data: Some(
            "#cloud-config\nssh_authorized_keys:\n  - ssh-ed25519 AAAAC3NzaC1lZDI1NTE5 alice@example\n"
                .to_owned(),
        ),
    }
}

/// Calls `check` every [`POLL`] until it answers `Ok`; the test fails after [`PATIENCE`],
/// naming `what` and what was seen instead.
pub async fn poll_until<T, E, F, Fut>(what: &str, check: F) -> T
where
    E: Debug,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    vps_pg::testing::eventually_every(what, PATIENCE, POLL, check).await
}

/// Polls `get` until `done` holds for the machine.
pub async fn eventually(
    provider: &dyn Provider,
    id: &str,
    done: impl Fn(&Machine) -> bool,
) -> Machine {
    poll_until(&format!("machine {id} to get there"), || async {
        let machine = provider.get(id).await.expect("the machine can be read");
        if done(&machine) {
            Ok(machine)
        } else {
            Err(machine)
        }
    })
    .await
}

/// Polls `get` until the machine is `NotFound`.
pub async fn eventually_gone(provider: &dyn Provider, id: &str) -> ProviderError {
    poll_until(&format!("machine {id} to disappear"), || async {
        match provider.get(id).await {
            Err(error) if error.code == ProviderErrorCode::NotFound => Ok(error),
            other => Err(other),
        }
    })
    .await
}

fn from_account(provider: &str, config: serde_json::Value) -> Arc<dyn Provider> {
    build(ProviderConfig::parse(provider, &config).expect("the account config is valid"))
}

impl HetznerTarget {
    pub async fn start() -> Self {
        let (base_url, emulator) = hetzner::Emulator::start().await;
        Self { base_url, emulator }
    }

    fn with_token(&self, token: &str) -> Arc<dyn Provider> {
        let config = json!({ "baseUrl": self.base_url, "token": token, "location": "fsn1" });
        from_account("hetzner-cloud", config)
    }
}

impl Target for HetznerTarget {
    fn offer_id(&self) -> &'static str {
        "cx22"
    }
    fn provider(&self) -> Arc<dyn Provider> {
        self.with_token(self.emulator.token())
    }
    fn provider_with_bad_credentials(&self) -> Option<Arc<dyn Provider>> {
        Some(self.with_token("not-the-token"))
    }
    fn rate_limit_next(&self) {
        self.emulator.fail_next(1, Fault::RateLimited);
    }
    fn lose_next_create_answer(&self) {
        self.emulator.lose_next_create_answers(1);
    }
    fn machine_count(&self) -> usize {
        self.emulator.machines().len()
    }
    fn remove_behind_the_clients_back(&self, id: &str) {
        assert!(self.emulator.remove(id.parse().unwrap()));
    }
}

impl ProxmoxTarget {
    pub async fn start() -> Self {
        let (base_url, emulator) = proxmox::Emulator::start().await;
        Self { base_url, emulator }
    }

    fn with_secret(&self, secret: &str) -> Arc<dyn Provider> {
        let options = self.emulator.options();
        let config = json!({
            "baseUrl": self.base_url,
            "tokenId": options.token_id,
            "tokenSecret": secret,
            "node": options.node,
            "storage": "local-lvm",
        });
        from_account("proxmox", config)
    }
}

impl Target for ProxmoxTarget {
    fn offer_id(&self) -> &'static str {
        "9000"
    }
    fn provider(&self) -> Arc<dyn Provider> {
        self.with_secret(&self.emulator.options().token_secret)
    }
    fn provider_with_bad_credentials(&self) -> Option<Arc<dyn Provider>> {
        Some(self.with_secret("00000000-0000-0000-0000-000000000000"))
    }
    fn rate_limit_next(&self) {
        self.emulator.fail_next(1, Fault::RateLimited);
    }
    fn lose_next_create_answer(&self) {
        self.emulator.lose_next_create_answers(1);
    }
    fn machine_count(&self) -> usize {
        self.emulator.machines().len()
    }
    fn remove_behind_the_clients_back(&self, id: &str) {
        assert!(self.emulator.remove(id.parse().unwrap()));
    }
}

impl EmulatorTarget {
    pub async fn start() -> Self {
        let config = EmulatorConfig {
            boot_delay: Duration::from_millis(50),
        };
        Self {
            provider: Arc::new(EmulatorProvider::new(config)),
        }
    }
}

impl Target for EmulatorTarget {
    fn offer_id(&self) -> &'static str {
        "small"
    }
    fn provider(&self) -> Arc<dyn Provider> {
        self.provider.clone()
    }
    fn provider_with_bad_credentials(&self) -> Option<Arc<dyn Provider>> {
        None
    }
    fn rate_limit_next(&self) {
        self.provider.inject(EmulatorFault::RateLimited, 1);
    }
    fn lose_next_create_answer(&self) {
        self.provider.inject(EmulatorFault::AnswerLost, 1);
    }
    fn machine_count(&self) -> usize {
        self.provider.machines().len()
    }
    fn remove_behind_the_clients_back(&self, id: &str) {
        assert!(self.provider.remove(id));
    }
}
