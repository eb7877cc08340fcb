//! An in-process cloud: machines in memory, for `vps dev` and tests. No network.
//!
//! A machine boots (and shuts down) after the configured delay; its state is worked out from
//! the clock when read, so no background task is needed. Addresses come from TEST-NET-2
//! (`198.51.100.0/24`), which is never routed.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::config::EmulatorConfig;
use super::error::ProviderError;
use super::machine::{CreateMachine, Machine, MachineState, Power};
use super::Provider;

/// The `emulator` provider.
#[derive(Clone)]
pub struct EmulatorProvider {
    cloud: Arc<Mutex<Cloud>>,
    boot_delay: Duration,
}

/// A failure the emulator answers instead of doing the next call, for tests.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EmulatorFault {
    /// Answer `RATE_LIMITED` with a one-second `retry_after`.
    RateLimited,
    /// Answer `PROVIDER_ERROR`.
    ProviderError,
    /// Do the call, then answer `PROVIDER_ERROR` as if the answer were lost on the way.
    AnswerLost,
}

#[derive(Default)]
struct Cloud {
    machines: HashMap<String, Record>,
    by_key: HashMap<String, String>,
    created: u64,
    faults: VecDeque<EmulatorFault>,
}

struct Record {
    id: String,
    address: String,
    /// Where the machine is heading and when it gets there.
    target: MachineState,
    settles_at: Instant,
}

/// The cloud every emulator account of this process shares (see [`super::build`]).
static SHARED: OnceLock<Arc<Mutex<Cloud>>> = OnceLock::new();

impl EmulatorProvider {
    /// An emulator with a cloud of its own, empty.
    pub fn new(config: EmulatorConfig) -> Self {
        Self {
            cloud: Arc::default(),
            boot_delay: config.boot_delay,
        }
    }

    /// An emulator on the process-wide cloud, so machines outlive the provider value.
    pub fn shared(config: EmulatorConfig) -> Self {
        Self {
            cloud: SHARED.get_or_init(Arc::default).clone(),
            boot_delay: config.boot_delay,
        }
    }

    /// Makes the next `times` calls answer `fault`.
    pub fn inject(&self, fault: EmulatorFault, times: usize) {
        self.lock().faults.extend(std::iter::repeat_n(fault, times));
    }

    /// Every machine of the cloud, as `get` would report it, sorted by id.
    pub fn machines(&self) -> Vec<Machine> {
        let now = Instant::now();
        let cloud = self.lock();
        let mut machines: Vec<_> = cloud.machines.values().map(|r| r.machine(now)).collect();
        machines.sort_by(|a, b| a.id.cmp(&b.id));
        machines
    }

    /// Removes a machine without being asked, as an operator using the provider's console
    /// would; answers whether it existed.
    pub fn remove(&self, id: &str) -> bool {
        let mut cloud = self.lock();
        cloud.by_key.retain(|_, machine| machine != id);
        cloud.machines.remove(id).is_some()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Cloud> {
        // A panic while holding the lock leaves plain data behind; keep serving it.
        self.cloud.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `call` on the cloud unless a fault is due.
    fn serve<T>(
        &self,
        call: impl FnOnce(&mut Cloud) -> Result<T, ProviderError>,
    ) -> Result<T, ProviderError> {
        let mut cloud = self.lock();
        match cloud.faults.pop_front() {
            None => call(&mut cloud),
            Some(EmulatorFault::RateLimited) => Err(ProviderError::rate_limited(
                "emulator: rate limit exceeded",
                Some(Duration::from_secs(1)),
            )),
            Some(EmulatorFault::ProviderError) => {
                Err(ProviderError::provider("emulator: injected failure"))
            }
            Some(EmulatorFault::AnswerLost) => {
                call(&mut cloud)?;
                Err(ProviderError::provider("emulator: the answer was lost"))
            }
        }
    }
}

#[async_trait]
impl Provider for EmulatorProvider {
    async fn create(&self, request: CreateMachine) -> Result<Machine, ProviderError> {
        let boot_delay = self.boot_delay;
        self.serve(|cloud| {
            let now = Instant::now();
            if let Some(record) = cloud
                .by_key
                .get(&request.idempotency_key)
                .and_then(|id| cloud.machines.get(id))
            {
                return Ok(record.machine(now));
            }
            cloud.created += 1;
            let record = Record {
                id: format!("emu-{}", cloud.created),
                address: format!("198.51.100.{}", (cloud.created - 1) % 254 + 1),
                target: MachineState::Running,
                settles_at: now + boot_delay,
            };
            let machine = record.machine(now);
            cloud
                .by_key
                .insert(request.idempotency_key, record.id.clone());
            cloud.machines.insert(record.id.clone(), record);
            Ok(machine)
        })
    }

    async fn get(&self, id: &str) -> Result<Machine, ProviderError> {
        self.serve(|cloud| Ok(cloud.find(id)?.machine(Instant::now())))
    }

    async fn power(&self, id: &str, power: Power) -> Result<(), ProviderError> {
        let boot_delay = self.boot_delay;
        self.serve(|cloud| {
            let record = cloud.find_mut(id)?;
            let target = match power {
                Power::On => MachineState::Running,
                Power::GracefulOff => MachineState::Stopped,
            };
            if record.target != target {
                record.target = target;
                record.settles_at = Instant::now() + boot_delay;
            }
            Ok(())
        })
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        self.serve(|cloud| {
            cloud.find(id)?;
            cloud.by_key.retain(|_, machine| machine != id);
            cloud.machines.remove(id);
            Ok(())
        })
    }
}

impl Cloud {
    fn find(&self, id: &str) -> Result<&Record, ProviderError> {
        self.machines.get(id).ok_or_else(|| not_found(id))
    }

    fn find_mut(&mut self, id: &str) -> Result<&mut Record, ProviderError> {
        self.machines.get_mut(id).ok_or_else(|| not_found(id))
    }
}

impl Record {
    fn machine(&self, now: Instant) -> Machine {
        let state = match (self.target, now >= self.settles_at) {
            (target, true) => target,
            (MachineState::Running, false) => MachineState::Starting,
            // Shutting down: still up until the guest is off.
            (_, false) => MachineState::Running,
        };
        let addresses = match state {
            MachineState::Running => vec![self.address.clone()],
            _ => Vec::new(),
        };
        Machine {
            id: self.id.clone(),
            state,
            addresses,
        }
    }
}

fn not_found(id: &str) -> ProviderError {
    ProviderError::not_found(format!("emulator: no machine has id `{id}`"))
}
