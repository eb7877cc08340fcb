//! A client of the Proxmox VE API (`https://<host>:8006/api2/json`), one node of a cluster.
//!
//! Machines are full clones of a template: the flavor's `offerId` is the template's vmid, and
//! the template fixes the shape and the disk image (the `imageId` is recorded in the VM's
//! description only). Create is:
//! 1. look the name up in `GET /nodes/{node}/qemu` (the name is [`machine_name`] of the
//!    idempotency key), so a retried create finds the first VM;
//! 2. otherwise take `GET /cluster/nextid` and `POST /nodes/{node}/qemu/{template}/clone` with
//!    `newid`, `name`, `full=1` (a full clone does not depend on the template's disk) and
//!    `storage` when configured, then wait for the clone task;
//! 3. put the user data's SSH keys into cloud-init (see `cloud_init`) and start the VM.
//!
//! Long operations answer a task id (UPID); the client polls
//! `GET /nodes/{node}/tasks/{upid}/status` until `status` is `stopped` and requires
//! `exitstatus` `OK`. A task still running after the task timeout is left to finish: the
//! reconciler reads the outcome with its next `get`. Addresses come from the QEMU guest agent
//! (`agent/network-get-interfaces`) and are empty while it does not answer.

mod cloud_init;
mod wire;

use std::time::Duration;

use async_trait::async_trait;
use reqwest::{Method, StatusCode, Url};
use serde::de::DeserializeOwned;
use tokio::time::{sleep, Instant};

use super::config::ProxmoxConfig;
use super::error::ProviderError;
use super::machine::{CreateMachine, Machine, MachineState, Power};
use super::naming::machine_name;
use super::transport::{endpoint, http_client, send_json};
use super::Provider;
use wire::{AgentInterfaces, Envelope, ErrorBody, TaskStatus, VmEntry, VmStatus};

const PROVIDER: &str = "proxmox";
/// How long a call waits for a task (clone, start, shutdown, destroy) before leaving it be.
const TASK_TIMEOUT: Duration = Duration::from_secs(120);
/// The first pause between task polls; it doubles up to [`TASK_POLL_MAX`].
const TASK_POLL_START: Duration = Duration::from_millis(100);
const TASK_POLL_MAX: Duration = Duration::from_secs(2);

/// The `proxmox` provider.
pub struct ProxmoxProvider {
    http: reqwest::Client,
    config: ProxmoxConfig,
}

/// How waiting for a task ended (a failed task is an error instead).
#[derive(Debug, PartialEq, Eq)]
enum TaskOutcome {
    /// The task stopped with `exitstatus` OK.
    Finished,
    /// The task is still running after [`TASK_TIMEOUT`].
    StillRunning,
}

impl ProxmoxProvider {
    /// A client of the API at `config.base_url`, acting on `config.node`.
    pub fn new(config: ProxmoxConfig) -> Self {
        Self {
            http: http_client(),
            config,
        }
    }

    async fn find_by_name(&self, name: &str) -> Result<Option<u32>, ProviderError> {
        let url = self.node_url(&["qemu"])?;
        let vms: Vec<VmEntry> = self.call(Method::GET, url, &[]).await?;
        Ok(vms
            .into_iter()
            .find(|vm| !vm.is_template() && vm.name.as_deref() == Some(name))
            .map(|vm| vm.vmid))
    }

    /// Clones the template into a new VM named `name`; answers its vmid.
    async fn clone_template(
        &self,
        name: &str,
        request: &CreateMachine,
    ) -> Result<(u32, TaskOutcome), ProviderError> {
        let template = template_vmid(&request.offer_id)?;
        let next: NextId = self
            .call(Method::GET, self.url(&["cluster", "nextid"])?, &[])
            .await?;
        let mut form = vec![
            ("newid", next.0.to_string()),
            ("name", name.to_owned()),
            ("full", "1".to_owned()),
            (
                "description",
                format!(
                    "vps instance {} ({}), image {}",
                    request.idempotency_key, request.name, request.image_id
                ),
            ),
        ];
        if let Some(storage) = &self.config.storage {
            form.push(("storage", storage.clone()));
        }
        let url = self.node_url(&["qemu", &template.to_string(), "clone"])?;
        match self.call::<String>(Method::POST, url, &form).await {
            Ok(upid) => Ok((next.0, self.wait_task(&upid).await?)),
            Err(error) if error.code == super::ProviderErrorCode::NotFound => {
                Err(ProviderError::invalid_config(format!(
                    "{PROVIDER}: template {template} (the flavor's offerId) does not exist on node {}",
                    self.config.node
                )))
            }
            // The answer may be lost after the clone began, or `nextid` raced another clone:
            // a VM with our name, if there is one, is ours.
            Err(error) => match self.find_by_name(name).await? {
                Some(vmid) => Ok((vmid, TaskOutcome::StillRunning)),
                None => Err(error),
            },
        }
    }

    /// Starts a freshly cloned (or found) VM, after handing it the user data's SSH keys.
    async fn boot(&self, vmid: u32, user_data: Option<&str>) -> Result<Machine, ProviderError> {
        let status = self.status(vmid).await?;
        if status.machine_state() == MachineState::Starting || status.status != "stopped" {
            // Still cloning, or already started by an earlier attempt: nothing to do now.
            return self.get(&vmid.to_string()).await;
        }
        let keys = user_data.map(cloud_init::ssh_keys).unwrap_or_default();
        if !keys.is_empty() {
            let form = [("sshkeys", cloud_init::sshkeys_option(&keys))];
            let url = self.vm_url(vmid, &["config"])?;
            self.call::<serde_json::Value>(Method::PUT, url, &form)
                .await?;
        }
        self.run_task(Method::POST, self.vm_url(vmid, &["status", "start"])?)
            .await?;
        self.get(&vmid.to_string()).await
    }

    async fn status(&self, vmid: u32) -> Result<VmStatus, ProviderError> {
        let url = self.vm_url(vmid, &["status", "current"])?;
        self.call(Method::GET, url, &[]).await
    }

    /// The guest agent's addresses, or none while the agent does not answer.
    async fn addresses(&self, vmid: u32) -> Vec<String> {
        let Ok(url) = self.vm_url(vmid, &["agent", "network-get-interfaces"]) else {
            return Vec::new();
        };
        match self.call::<AgentInterfaces>(Method::GET, url, &[]).await {
            Ok(interfaces) => wire::usable_addresses(interfaces),
            Err(error) => {
                tracing::debug!(vmid, %error, "no addresses from the guest agent");
                Vec::new()
            }
        }
    }

    async fn run_task(&self, method: Method, url: Url) -> Result<TaskOutcome, ProviderError> {
        let upid: String = self.call(method, url, &[]).await?;
        self.wait_task(&upid).await
    }

    async fn wait_task(&self, upid: &str) -> Result<TaskOutcome, ProviderError> {
        // The task runs on the node named in its UPID (`UPID:<node>:…`).
        let node = upid.split(':').nth(1).unwrap_or(&self.config.node);
        let url = self.url(&["nodes", node, "tasks", upid, "status"])?;
        let deadline = Instant::now() + TASK_TIMEOUT;
        let mut pause = TASK_POLL_START;
        loop {
            let task: TaskStatus = self.call(Method::GET, url.clone(), &[]).await?;
            if task.status == "stopped" {
                return task_result(upid, task.exitstatus.as_deref());
            }
            if Instant::now() + pause > deadline {
                tracing::info!(upid, "proxmox task still running; leaving it to finish");
                return Ok(TaskOutcome::StillRunning);
            }
            sleep(pause).await;
            pause = (pause * 2).min(TASK_POLL_MAX);
        }
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: Method,
        url: Url,
        form: &[(&str, String)],
    ) -> Result<T, ProviderError> {
        let mut request = self
            .http
            .request(method.clone(), url)
            .header("Authorization", self.authorization());
        // Parameters travel form-encoded, as the API's own clients send them.
        if matches!(method, Method::POST | Method::PUT) {
            request = request.form(form);
        }
        let answer: Envelope<T> = send_json(PROVIDER, request, |status, body, wait| {
            api_error(status, body).with_retry_after(wait)
        })
        .await?;
        Ok(answer.data)
    }

    fn authorization(&self) -> String {
        format!(
            "PVEAPIToken={}={}",
            self.config.token_id, self.config.token_secret
        )
    }

    fn url(&self, segments: &[&str]) -> Result<Url, ProviderError> {
        endpoint(&self.config.base_url, segments)
    }

    fn node_url(&self, rest: &[&str]) -> Result<Url, ProviderError> {
        let mut segments = vec!["nodes", self.config.node.as_str()];
        segments.extend_from_slice(rest);
        self.url(&segments)
    }

    fn vm_url(&self, vmid: u32, rest: &[&str]) -> Result<Url, ProviderError> {
        let vmid = vmid.to_string();
        let mut segments = vec!["qemu", vmid.as_str()];
        segments.extend_from_slice(rest);
        self.node_url(&segments)
    }
}

#[async_trait]
impl Provider for ProxmoxProvider {
    async fn create(&self, request: CreateMachine) -> Result<Machine, ProviderError> {
        let name = machine_name(&request.idempotency_key);
        let vmid = match self.find_by_name(&name).await? {
            Some(vmid) => vmid,
            None => match self.clone_template(&name, &request).await? {
                (vmid, TaskOutcome::Finished) => vmid,
                // Still cloning: report it; the reconciler powers it on once it is stopped.
                (vmid, TaskOutcome::StillRunning) => return self.get(&vmid.to_string()).await,
            },
        };
        self.boot(vmid, request.user_data.as_deref()).await
    }

    async fn get(&self, id: &str) -> Result<Machine, ProviderError> {
        let vmid = parse_vmid(id)?;
        let state = self.status(vmid).await?.machine_state();
        let addresses = match state {
            MachineState::Running => self.addresses(vmid).await,
            _ => Vec::new(),
        };
        Ok(Machine {
            id: vmid.to_string(),
            state,
            addresses,
        })
    }

    async fn power(&self, id: &str, power: Power) -> Result<(), ProviderError> {
        let vmid = parse_vmid(id)?;
        let status = self.status(vmid).await?;
        // Checked first because the API refuses to start a running VM or stop a stopped one.
        let action = match (power, status.status.as_str()) {
            (Power::On, "running") | (Power::GracefulOff, "stopped") => return Ok(()),
            (Power::On, _) if status.machine_state() == MachineState::Starting => return Ok(()),
            (Power::On, _) => "start",
            (Power::GracefulOff, _) => "shutdown",
        };
        self.run_task(Method::POST, self.vm_url(vmid, &["status", action])?)
            .await?;
        Ok(())
    }

    async fn delete(&self, id: &str) -> Result<(), ProviderError> {
        let vmid = parse_vmid(id)?;
        let status = self.status(vmid).await?;
        if let Some(lock) = &status.lock {
            // A task holds the VM (a clone still copying, say): not a broken state, just not
            // yet; retrying later deletes it.
            return Err(ProviderError::provider(format!(
                "{PROVIDER}: VM {vmid} is locked ({lock}); it can be deleted when the task ends"
            )));
        }
        if status.status == "running" {
            // The API refuses to destroy a running VM; it is going away, so no need to be gentle.
            self.run_task(Method::POST, self.vm_url(vmid, &["status", "stop"])?)
                .await?;
        }
        let mut url = self.vm_url(vmid, &[])?;
        url.query_pairs_mut()
            .append_pair("purge", "1")
            .append_pair("destroy-unreferenced-disks", "1");
        self.run_task(Method::DELETE, url).await?;
        Ok(())
    }
}

/// `GET /cluster/nextid`'s answer (a vmid as a string).
#[derive(serde::Deserialize)]
struct NextId(#[serde(deserialize_with = "wire::vmid")] u32);

fn parse_vmid(id: &str) -> Result<u32, ProviderError> {
    id.parse()
        .map_err(|_| ProviderError::not_found(format!("{PROVIDER}: no VM has id `{id}`")))
}

fn template_vmid(offer_id: &str) -> Result<u32, ProviderError> {
    offer_id.parse().map_err(|_| {
        ProviderError::invalid_config(format!(
            "{PROVIDER}: offerId `{offer_id}` must be the vmid of a template"
        ))
    })
}

fn task_result(upid: &str, exitstatus: Option<&str>) -> Result<TaskOutcome, ProviderError> {
    match exitstatus {
        Some(exit) if exit == "OK" || exit.starts_with("WARNINGS") => Ok(TaskOutcome::Finished),
        exit => {
            let exit = exit.unwrap_or("no exit status");
            let kind = upid.split(':').nth(5).unwrap_or("task");
            let code = wire::error_code(500, exit);
            Err(ProviderError::new(
                code,
                format!("{PROVIDER}: {kind} task failed: {exit}"),
            ))
        }
    }
}

fn api_error(status: StatusCode, body: &str) -> ProviderError {
    let body: ErrorBody = serde_json::from_str(body).unwrap_or_default();
    let mut detail = body.message.unwrap_or_default().trim().to_owned();
    for (field, problem) in body.errors.unwrap_or_default() {
        detail.push_str(&format!(" {field}: {}", problem.trim()));
    }
    if detail.is_empty() {
        detail = status.canonical_reason().unwrap_or("error").to_owned();
    }
    let code = wire::error_code(status.as_u16(), &detail);
    let message = match status.as_u16() {
        401 => format!(
            "{PROVIDER} rejected the API token (401 {detail}); check the account's tokenId and tokenSecret"
        ),
        403 => format!("{PROVIDER} refused the call (403 {detail}); the token lacks a privilege"),
        _ => format!("{PROVIDER}: HTTP {} {detail}", status.as_u16()),
    };
    ProviderError::new(code, message)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::providers::ProviderErrorCode;

    #[test]
    fn a_task_that_stopped_with_ok_finished() {
        assert_eq!(
            task_result("UPID:pve:1:2:3:qmstart:100:root@pam:", Some("OK")),
            Ok(TaskOutcome::Finished)
        );
    }

    #[test]
    fn a_failed_task_names_its_kind_and_exit_status() {
        let error = task_result(
            "UPID:pve:1:2:3:qmstart:100:root@pam:",
            Some("VM is locked (clone)"),
        )
        .unwrap_err();
        assert_eq!(error.code, ProviderErrorCode::InvalidState);
        assert!(error.message.contains("qmstart task failed: VM is locked"));
    }

    #[test]
    fn parameter_errors_are_invalid_config_with_the_fields() {
        let body = r#"{"data":null,"message":"Parameter verification failed.\n","errors":{"name":"invalid format"}}"#;
        let error = api_error(StatusCode::BAD_REQUEST, body);
        assert_eq!(error.code, ProviderErrorCode::InvalidConfig);
        assert!(error.message.contains("name: invalid format"));
    }
}
