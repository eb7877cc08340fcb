//! The emulated node: VMs, templates and tasks in memory.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::http::StatusCode;
use serde_json::{json, Value};

use super::Options;

/// A VM as a test sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmulatedVm {
    /// The VM's id.
    pub vmid: u32,
    /// Its name.
    pub name: String,
    /// `running` or `stopped`.
    pub status: String,
    /// A lock held by a running task (`clone`, `destroyed`), if any.
    pub lock: Option<String>,
    /// Its configuration (`name`, `sshkeys`, `description`, …), values as stored.
    pub config: BTreeMap<String, String>,
}

pub(super) struct Node {
    pub name: String,
    vms: BTreeMap<u32, Vm>,
    tasks: HashMap<String, Task>,
    storages: Vec<String>,
    user: String,
    task_delay: Duration,
    boot_delay: Duration,
    next_pid: u32,
}

struct Vm {
    vmid: u32,
    template: bool,
    running: bool,
    lock: Option<&'static str>,
    config: BTreeMap<String, String>,
    /// When the guest agent starts answering (set on start).
    agent_ready_at: Option<Instant>,
}

struct Task {
    upid: String,
    kind: &'static str,
    vmid: u32,
    started: u64,
    done_at: Instant,
    /// What finishing does to the VM; `None` once done.
    effect: Option<Effect>,
    exitstatus: String,
}

#[derive(Clone, Copy)]
enum Effect {
    Unlock,
    Start,
    Stop,
    Destroy,
}

/// An API error: status, message, and parameter errors.
pub(super) struct PveError {
    pub status: StatusCode,
    pub message: String,
    pub errors: Option<BTreeMap<String, String>>,
}

impl Node {
    pub fn new(options: &Options) -> Self {
        let vms = options
            .templates
            .iter()
            .map(|(vmid, name)| {
                let config = BTreeMap::from([
                    ("name".to_owned(), name.clone()),
                    ("agent".to_owned(), "1".to_owned()),
                    (
                        "ide2".to_owned(),
                        "local-lvm:cloudinit,media=cdrom".to_owned(),
                    ),
                    ("template".to_owned(), "1".to_owned()),
                ]);
                let vm = Vm {
                    vmid: *vmid,
                    template: true,
                    running: false,
                    lock: None,
                    config,
                    agent_ready_at: None,
                };
                (*vmid, vm)
            })
            .collect();
        Self {
            name: options.node.clone(),
            vms,
            tasks: HashMap::new(),
            storages: options.storages.clone(),
            user: options.token_id.clone(),
            task_delay: options.task_delay,
            boot_delay: options.boot_delay,
            next_pid: 0x1000,
        }
    }

    /// Finishes every task whose time has come.
    pub fn settle(&mut self) {
        let now = Instant::now();
        let boot_delay = self.boot_delay;
        for task in self.tasks.values_mut() {
            if task.done_at > now {
                continue;
            }
            let Some(effect) = task.effect.take() else {
                continue;
            };
            let Some(vm) = self.vms.get_mut(&task.vmid) else {
                continue;
            };
            match effect {
                Effect::Unlock => vm.lock = None,
                Effect::Start => {
                    vm.running = true;
                    vm.agent_ready_at = Some(now + boot_delay);
                }
                Effect::Stop => {
                    vm.running = false;
                    vm.agent_ready_at = None;
                }
                Effect::Destroy => {
                    self.vms.remove(&task.vmid);
                }
            }
        }
    }

    pub fn machines(&self) -> Vec<EmulatedVm> {
        self.vms
            .values()
            .filter(|vm| !vm.template)
            .map(|vm| EmulatedVm {
                vmid: vm.vmid,
                name: vm.config.get("name").cloned().unwrap_or_default(),
                status: vm.status().to_owned(),
                lock: vm.lock.map(str::to_owned),
                config: vm.config.clone(),
            })
            .collect()
    }

    pub fn remove(&mut self, vmid: u32) -> bool {
        self.vms.remove(&vmid).is_some()
    }

    pub fn next_id(&self) -> u32 {
        (100..).find(|id| !self.vms.contains_key(id)).unwrap_or(100)
    }

    pub fn list(&self) -> Vec<Value> {
        self.vms
            .values()
            .map(|vm| {
                let mut entry = json!({
                    "vmid": vm.vmid,
                    "name": vm.config.get("name"),
                    "status": vm.status(),
                    "template": u8::from(vm.template),
                    "cpus": 2, "maxmem": 2_147_483_648_u64, "maxdisk": 10_737_418_240_u64,
                    "uptime": 0,
                });
                if let Some(lock) = vm.lock {
                    entry["lock"] = json!(lock);
                }
                entry
            })
            .collect()
    }

    pub fn clone_vm(
        &mut self,
        source: u32,
        params: &BTreeMap<String, String>,
    ) -> Result<String, PveError> {
        let template = self.vm(source)?;
        let newid: u32 = params
            .get("newid")
            .and_then(|id| id.parse().ok())
            .filter(|id| (100..1_000_000_000).contains(id))
            .ok_or_else(|| param_error("newid", "value does not look like a valid VM ID"))?;
        if params.get("name").is_some_and(|n| !is_dns_name(n)) {
            return Err(param_error(
                "name",
                "value does not look like a valid DNS name",
            ));
        }
        if let Some(storage) = params.get("storage") {
            if !self.storages.contains(storage) {
                return Err(server_error(format!("storage '{storage}' does not exist")));
            }
        }
        if self.vms.contains_key(&newid) {
            return Err(server_error(format!(
                "unable to create VM {newid}: config file already exists"
            )));
        }
        let mut config = template.config.clone();
        config.remove("template");
        for key in ["name", "description"] {
            if let Some(value) = params.get(key) {
                config.insert(key.to_owned(), value.clone());
            }
        }
        self.vms.insert(
            newid,
            Vm {
                vmid: newid,
                template: false,
                running: false,
                lock: Some("clone"),
                config,
                agent_ready_at: None,
            },
        );
        Ok(self.task("qmclone", newid, Effect::Unlock, "OK".to_owned()))
    }

    pub fn status(&self, vmid: u32) -> Result<Value, PveError> {
        let vm = self.vm(vmid)?;
        let mut status = json!({
            "vmid": vm.vmid,
            "name": vm.config.get("name"),
            "status": vm.status(),
            "qmpstatus": vm.status(),
            "agent": vm.config.get("agent").map(|a| a == "1").map(u8::from),
            "cpus": 2,
            "uptime": 0,
        });
        if let Some(lock) = vm.lock {
            status["lock"] = json!(lock);
        }
        Ok(status)
    }

    /// `start`, `shutdown` or `stop`: answers the task's UPID.
    pub fn power(&mut self, vmid: u32, action: &str) -> Result<String, PveError> {
        let vm = self.vm(vmid)?;
        if let Some(lock) = vm.lock {
            return Err(server_error(format!("VM is locked ({lock})")));
        }
        let running = vm.running;
        let (kind, effect, refused) = match action {
            "start" => (
                "qmstart",
                Effect::Start,
                running.then_some("already running"),
            ),
            "shutdown" => (
                "qmshutdown",
                Effect::Stop,
                (!running).then_some("not running"),
            ),
            "stop" => ("qmstop", Effect::Stop, None),
            _ => return Err(not_implemented(action)),
        };
        // The API accepts the request; the task is what fails.
        let exitstatus = match refused {
            Some(why) => format!("VM {vmid} {why}"),
            None => "OK".to_owned(),
        };
        Ok(self.task(kind, vmid, effect, exitstatus))
    }

    pub fn destroy(&mut self, vmid: u32) -> Result<String, PveError> {
        let vm = self.vm(vmid)?;
        if let Some(lock) = vm.lock {
            return Err(server_error(format!("VM is locked ({lock})")));
        }
        if vm.running {
            return Err(server_error(format!(
                "VM {vmid} is running - destroy failed"
            )));
        }
        if let Some(vm) = self.vms.get_mut(&vmid) {
            vm.lock = Some("destroyed");
        }
        Ok(self.task("qmdestroy", vmid, Effect::Destroy, "OK".to_owned()))
    }

    pub fn config(&self, vmid: u32) -> Result<Value, PveError> {
        Ok(json!(self.vm(vmid)?.config))
    }

    pub fn set_config(
        &mut self,
        vmid: u32,
        params: BTreeMap<String, String>,
    ) -> Result<(), PveError> {
        self.vm(vmid)?;
        if params.is_empty() {
            return Err(server_error("no options specified".to_owned()));
        }
        let vm = self.vms.get_mut(&vmid).expect("checked above");
        vm.config.extend(params);
        Ok(())
    }

    pub fn agent_interfaces(&self, vmid: u32) -> Result<Value, PveError> {
        let vm = self.vm(vmid)?;
        if vm.config.get("agent").map(String::as_str) != Some("1") {
            return Err(server_error("No QEMU guest agent configured".to_owned()));
        }
        let ready = vm.agent_ready_at.is_some_and(|at| at <= Instant::now());
        if !vm.running || !ready {
            return Err(server_error("QEMU guest agent is not running".to_owned()));
        }
        let host = vmid % 254 + 1;
        Ok(json!({ "result": [
            { "name": "lo", "hardware-address": "00:00:00:00:00:00", "ip-addresses": [
                { "ip-address": "127.0.0.1", "ip-address-type": "ipv4", "prefix": 8 },
                { "ip-address": "::1", "ip-address-type": "ipv6", "prefix": 128 }
            ]},
            { "name": "eth0", "hardware-address": format!("bc:24:11:00:00:{host:02x}"), "ip-addresses": [
                { "ip-address": format!("192.0.2.{host}"), "ip-address-type": "ipv4", "prefix": 24 },
                { "ip-address": format!("fe80::be24:11ff:fe00:{host:x}"), "ip-address-type": "ipv6", "prefix": 64 }
            ]}
        ]}))
    }

    pub fn task_status(&self, upid: &str) -> Result<Value, PveError> {
        let task = self
            .tasks
            .get(upid)
            .ok_or_else(|| server_error(format!("no such task '{upid}'")))?;
        let done = task.effect.is_none();
        let mut status = json!({
            "upid": task.upid,
            "node": self.name,
            "type": task.kind,
            "id": task.vmid.to_string(),
            "user": self.user,
            "starttime": task.started,
            "pid": 0,
            "status": if done { "stopped" } else { "running" },
        });
        if done {
            status["exitstatus"] = json!(task.exitstatus);
        }
        Ok(status)
    }

    fn task(
        &mut self,
        kind: &'static str,
        vmid: u32,
        effect: Effect,
        exitstatus: String,
    ) -> String {
        self.next_pid += 1;
        let started = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or_default();
        let upid = format!(
            "UPID:{}:{:08X}:{:08X}:{:08X}:{kind}:{vmid}:{}:",
            self.name,
            self.next_pid,
            self.next_pid * 7,
            started,
            self.user
        );
        // A task that fails changes nothing when it finishes.
        let effect = if exitstatus == "OK" {
            effect
        } else {
            Effect::Unlock
        };
        self.tasks.insert(
            upid.clone(),
            Task {
                upid: upid.clone(),
                kind,
                vmid,
                started,
                done_at: Instant::now() + self.task_delay,
                effect: Some(effect),
                exitstatus,
            },
        );
        upid
    }

    fn vm(&self, vmid: u32) -> Result<&Vm, PveError> {
        self.vms.get(&vmid).ok_or_else(|| {
            server_error(format!(
                "Configuration file 'nodes/{}/qemu-server/{vmid}.conf' does not exist",
                self.name
            ))
        })
    }
}

impl Vm {
    fn status(&self) -> &'static str {
        if self.running {
            "running"
        } else {
            "stopped"
        }
    }
}

pub(super) fn server_error(message: String) -> PveError {
    PveError {
        status: StatusCode::INTERNAL_SERVER_ERROR,
        message,
        errors: None,
    }
}

fn not_implemented(what: &str) -> PveError {
    PveError {
        status: StatusCode::NOT_IMPLEMENTED,
        message: format!("Method '{what}' not implemented"),
        errors: None,
    }
}

fn param_error(field: &str, problem: &str) -> PveError {
    PveError {
        status: StatusCode::BAD_REQUEST,
        message: "Parameter verification failed.".to_owned(),
        errors: Some(BTreeMap::from([(
            field.to_owned(),
            format!("invalid format - {problem}"),
        )])),
    }
}

fn is_dns_name(name: &str) -> bool {
    name.split('.').all(|label| {
        !label.is_empty()
            && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
            && !label.starts_with('-')
            && !label.ends_with('-')
    })
}
