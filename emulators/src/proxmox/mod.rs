//! An emulator of the Proxmox VE API (`/api2/json`): one node, its QEMU VMs and templates,
//! clone/start/shutdown/stop/destroy tasks, cloud-init config and the guest agent.
//!
//! Long operations answer a UPID at once and finish after the task delay; the guest agent
//! answers once a started VM has had the boot delay. Authentication is an API token
//! (`Authorization: PVEAPIToken=<tokenId>=<secret>`); anything else answers `401`.

mod node;
mod routes;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::faults::{Fault, Faults};
use crate::server::{serve, Running};
pub use node::EmulatedVm;
use node::Node;

/// How an emulator behaves.
#[derive(Clone, Debug)]
pub struct Options {
    /// The API token id requests must carry (`user@realm!name`).
    pub token_id: String,
    /// The token's secret.
    pub token_secret: String,
    /// The node's name.
    pub node: String,
    /// Templates on the node: vmid and name.
    pub templates: Vec<(u32, String)>,
    /// Storages a clone may target.
    pub storages: Vec<String>,
    /// How long a task (clone, start, shutdown, stop, destroy) runs.
    pub task_delay: Duration,
    /// How long after start the guest agent answers.
    pub boot_delay: Duration,
}

/// The Proxmox VE emulator.
pub struct Emulator;

/// Controls a running emulator; dropping it stops the server.
pub struct Handle {
    node: Arc<Mutex<Node>>,
    faults: Faults,
    options: Options,
    _server: Running,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            token_id: "root@pam!vps".to_owned(),
            token_secret: "4f1b6a2e-0c7d-4e55-9a33-1d2c3b4a5f60".to_owned(),
            node: "pve".to_owned(),
            templates: vec![(9000, "debian-12-cloudinit".to_owned())],
            storages: vec!["local-lvm".to_owned()],
            task_delay: Duration::from_millis(50),
            boot_delay: Duration::from_millis(150),
        }
    }
}

impl Emulator {
    /// Starts an emulator with default options; answers its API root
    /// (`http://127.0.0.1:<port>/api2/json`).
    pub async fn start() -> (String, Handle) {
        Self::start_with(Options::default()).await
    }

    /// Starts an emulator with `options`.
    pub async fn start_with(options: Options) -> (String, Handle) {
        let node = Arc::new(Mutex::new(Node::new(&options)));
        let faults = Faults::default();
        let authorization = format!("PVEAPIToken={}={}", options.token_id, options.token_secret);
        let router = routes::router(node.clone(), faults.clone(), authorization);
        let (address, server) = serve(router).await;
        let handle = Handle {
            node,
            faults,
            options,
            _server: server,
        };
        (format!("http://{address}/api2/json"), handle)
    }
}

impl Handle {
    /// The options the emulator runs with (token, node, templates, …).
    pub fn options(&self) -> &Options {
        &self.options
    }

    /// Makes the next `times` authenticated requests answer `fault`.
    pub fn fail_next(&self, times: usize, fault: Fault) {
        self.faults.push(fault, times);
    }

    /// Starts the clone of the next `times` clone requests, but loses the answers.
    pub fn lose_next_create_answers(&self, times: usize) {
        self.faults.lose_creates(times);
    }

    /// Every VM that is not a template, as the API would show it now.
    pub fn machines(&self) -> Vec<EmulatedVm> {
        let mut node = self.lock();
        node.settle();
        node.machines()
    }

    /// Destroys a VM behind the client's back; answers whether it existed.
    pub fn remove(&self, vmid: u32) -> bool {
        self.lock().remove(vmid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Node> {
        self.node.lock().unwrap_or_else(|e| e.into_inner())
    }
}
