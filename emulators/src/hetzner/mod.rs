//! An emulator of the Hetzner Cloud API (`/v1`): servers, their power actions and deletion.
//!
//! Servers are created `initializing` and become `running` after the boot delay; `shutdown`
//! passes through `stopping` to `off`, `poweron` through `starting` to `running`, and a deleted
//! server is `deleting` until it disappears. A wrong bearer token answers `401 unauthorized`.

mod cloud;
mod routes;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::faults::{Fault, Faults};
use crate::server::{serve, Running};
use cloud::Cloud;
pub use cloud::EmulatedServer;

/// How an emulator behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// The API token requests must carry.
    pub token: String,
    /// How long boots, shutdowns and deletions take.
    pub boot_delay: Duration,
}

/// The Hetzner Cloud emulator.
pub struct Emulator;

/// Controls a running emulator; dropping it stops the server.
pub struct Handle {
    cloud: Arc<Mutex<Cloud>>,
    faults: Faults,
    token: String,
    _server: Running,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            token: "hetzner-emulator-token".to_owned(),
            boot_delay: Duration::from_millis(100),
        }
    }
}

impl Emulator {
    /// Starts an emulator with default options; answers its API root (`http://127.0.0.1:<port>/v1`).
    pub async fn start() -> (String, Handle) {
        Self::start_with(Options::default()).await
    }

    /// Starts an emulator with `options`.
    pub async fn start_with(options: Options) -> (String, Handle) {
        let cloud = Arc::new(Mutex::new(Cloud::new(options.boot_delay)));
        let faults = Faults::default();
        let router = routes::router(cloud.clone(), faults.clone(), options.token.clone());
        let (address, server) = serve(router).await;
        let handle = Handle {
            cloud,
            faults,
            token: options.token,
            _server: server,
        };
        (format!("http://{address}/v1"), handle)
    }
}

impl Handle {
    /// The token the emulator accepts.
    pub fn token(&self) -> &str {
        &self.token
    }

    /// Makes the next `times` authenticated requests answer `fault`.
    pub fn fail_next(&self, times: usize, fault: Fault) {
        self.faults.push(fault, times);
    }

    /// Creates the server of the next `times` `POST /servers`, but loses the answers.
    pub fn lose_next_create_answers(&self, times: usize) {
        self.faults.lose_creates(times);
    }

    /// Makes the next `times` name lookups (`GET /servers?name=`) miss, as a lagging read
    /// would, so two creates can race to `POST /servers`.
    pub fn hide_next_name_lookups(&self, times: usize) {
        self.lock().hidden_lookups += times;
    }

    /// Every server, as the API would show it now.
    pub fn machines(&self) -> Vec<EmulatedServer> {
        let mut cloud = self.lock();
        cloud.settle();
        cloud.servers().map(EmulatedServer::from).collect()
    }

    /// Deletes a server behind the client's back; answers whether it existed.
    pub fn remove(&self, id: u64) -> bool {
        self.lock().remove(id)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cloud> {
        self.cloud.lock().unwrap_or_else(|e| e.into_inner())
    }
}
