//! The tools' arguments: the API's field names (camelCase), each struct the source of its
//! tool's input schema. `tenantId` is optional everywhere: it defaults to `VPS_TENANT`.

use schemars::JsonSchema;
use serde::Deserialize;

/// `create_sandbox`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateSandbox {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// The template, `sbxt_…`.
    pub template_id: String,
    /// The lifetime in seconds: 1 to the template's `maxTtlSeconds` (default: its
    /// `defaultTtlSeconds`).
    pub ttl_seconds: Option<u64>,
    /// Makes the create idempotent: a retry with the same key answers the same sandbox
    /// (default: a fresh key).
    pub idempotency_key: Option<String>,
    /// Seconds to wait for the sandbox to leave `starting`, 0 to 30 (default 20).
    pub wait_seconds: Option<u64>,
}

/// `list_sandboxes` and `list_instances`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct List {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `mine` (the caller's) or `all` (everyone's in the tenant).
    pub scope: Option<String>,
    /// 1 to 200 (default 50).
    pub limit: Option<i64>,
    /// The previous page's `cursor`.
    pub cursor: Option<String>,
}

/// `extend_sandbox`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExtendSandbox {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…`.
    pub sandbox_id: String,
    /// Added to the current expiry: `"30m"`, `"8h"`, `"7d"` (at most 30 days).
    pub by: String,
}

/// `delete_sandbox`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SandboxRef {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…`.
    pub sandbox_id: String,
}

/// `exec_in_sandbox`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ExecInSandbox {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…` (a `ready` sandbox).
    pub sandbox_id: String,
    /// A shell command line, run by `sh -c` in the sandbox.
    pub command: String,
    /// Stop the command after this many seconds, 1 to 600 (default 60).
    pub timeout_seconds: Option<u64>,
}

/// `snapshot_sandbox`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SnapshotSandbox {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…`.
    pub sandbox_id: String,
    /// With the guest's memory (default true).
    pub include_memory: Option<bool>,
    /// Outlives the sandbox (default false: deleted with it).
    pub keep: Option<bool>,
}

/// `create_instance`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CreateInstance {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// The pool, `pool_…`.
    pub pool_id: String,
    /// The flavor's name in the pool (e.g. `small`).
    pub flavor: String,
    /// The image, `img_…`.
    pub image_id: String,
    /// OpenSSH public key lines.
    pub ssh_keys: Option<Vec<String>>,
    /// Makes the create idempotent (default: a fresh key).
    pub idempotency_key: Option<String>,
    /// Seconds to wait for the instance to settle, 0 to 30 (default 20).
    pub wait_seconds: Option<u64>,
}

/// `get_instance` and `delete_instance`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct InstanceRef {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `inst_…`.
    pub instance_id: String,
}

/// `write_file`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct WriteFile {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…` (a `ready` sandbox).
    pub sandbox_id: String,
    /// The file in the sandbox (relative: under the account's home); made or replaced.
    pub path: String,
    /// What the file holds: text, or base64 when `encoding` is `base64`.
    pub content: String,
    /// `utf8` (default) or `base64`.
    pub encoding: Option<String>,
}

/// `read_file`.
#[derive(Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReadFile {
    /// The tenant (default: the server's `VPS_TENANT`).
    pub tenant_id: Option<String>,
    /// `sbx_…` (a `ready` sandbox).
    pub sandbox_id: String,
    /// The file in the sandbox (relative: under the account's home).
    pub path: String,
    /// `utf8` or `base64` (default: `utf8` when the file is valid UTF-8, else `base64`).
    pub encoding: Option<String>,
}
