//! The arguments of the tools that are more than one API call (exec and files over an exec
//! session), each struct the source of its tool's input schema; the other tools take their
//! method's request ([`super::forward`]). The API's field names (camelCase); `tenantId` is
//! optional: it defaults to `VPS_TENANT`.

use schemars::JsonSchema;
use serde::Deserialize;

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
