//! `vps mcp`: the Model Context Protocol over stdio (rmcp), so an agent can drive sandboxes
//! and instances. It is a client of the HTTP API like the CLI, acting as its token's identity:
//! every tool is one API call (exec and files: `sandboxes.exec` and the system's `ssh`), and Cedar
//! decides it on the server as for any other caller.
//!
//! A tool answers the API's JSON, pretty-printed; an API error comes back as a tool error
//! (`isError: true`) reading `CODE: message`, which the model sees and can act on. Standard
//! output is the protocol: logs go to standard error.
//!
//! - [`forward`]: the tools that are one method each (create, list, get, extend, snapshot,
//!   delete): the method's request schema from the registry is their input schema.
//! - [`params`]: the arguments of the tools that are more than one call (exec, files).

mod forward;
mod params;

use std::process::Stdio;
use std::time::Duration;

use rmcp::handler::server::{router::tool::ToolRouter, wrapper::Parameters};
use rmcp::model::{CallToolResult, Content, JsonObject};
use rmcp::{tool, tool_handler, tool_router, ServerHandler, ServiceExt};
use serde_json::{json, Value};
use tracing::Instrument;

use crate::client::exec::{session, SessionError};
use crate::client::{ApiFailure, Client};
use params::*;

/// `vps mcp`'s connection: the same variables as the CLI's.
#[derive(Debug, clap::Args)]
pub struct McpArgs {
    /// The server.
    #[arg(long, env = "VPS_URL", default_value = "http://127.0.0.1:8080")]
    url: String,
    /// An API token: the tools act as its identity.
    #[arg(long, env = "VPS_TOKEN", hide_env_values = true)]
    token: String,
    /// The tenant of tools called without `tenantId`.
    #[arg(long, env = "VPS_TENANT")]
    tenant: Option<String>,
}

/// Serves the tools on standard input and output until the client closes them.
pub async fn run(args: McpArgs) -> anyhow::Result<i32> {
    let server = Vps {
        client: Client::new(&args.url, &args.token),
        tenant: args.tenant,
        tool_router: Vps::tool_router(),
    };
    tracing::info!(url = %args.url, "serving MCP on stdio");
    let running = server.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(0)
}

/// `exec_in_sandbox`'s default and longest timeouts, in seconds.
const DEFAULT_EXEC_TIMEOUT: u64 = 60;
const MAX_EXEC_TIMEOUT: u64 = 600;
/// How long `write_file` and `read_file` may take, in seconds.
const FILE_TIMEOUT: u64 = 120;
/// The largest file `read_file` answers (its content travels in one JSON message).
const MAX_READ_BYTES: usize = 8 << 20;

/// The MCP server: one API client, as one identity.
struct Vps {
    client: Client,
    tenant: Option<String>,
    tool_router: ToolRouter<Self>,
}

#[tool_handler(
    router = self.tool_router,
    name = "vps",
    instructions = "Sandboxes (short-lived VMs from templates: create, run commands, snapshot, \
                    extend, delete) and instances (VMs) of a vps tenant. Tools answer the API's \
                    JSON; errors read `CODE: message`."
)]
impl ServerHandler for Vps {}

#[tool_router]
impl Vps {
    /// Creates a sandbox from a template and waits (up to `waitSeconds`) until it is ready;
    /// answers the sandbox.
    #[tool(input_schema = forward::input_schema("sandboxes.create"))]
    async fn create_sandbox(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("sandboxes.create", args).await
    }

    /// Lists the tenant's live sandboxes, newest first (`scope`: `mine` by default, or `all`).
    #[tool(input_schema = forward::input_schema("sandboxes.list"))]
    async fn list_sandboxes(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("sandboxes.list", args).await
    }

    /// Pushes a sandbox's expiry later by `by` (`30m`, `8h`, …) or to `until`; answers the
    /// sandbox.
    #[tool(input_schema = forward::input_schema("sandboxes.extend"))]
    async fn extend_sandbox(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("sandboxes.extend", args).await
    }

    /// Deletes a sandbox (its VM and its unkept snapshots go with it).
    #[tool(input_schema = forward::input_schema("sandboxes.delete"))]
    async fn delete_sandbox(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("sandboxes.delete", args).await
    }

    /// Runs a shell command in a ready sandbox over SSH; answers `{ stdout, stderr, exitCode }`.
    #[tool]
    async fn exec_in_sandbox(&self, Parameters(p): Parameters<ExecInSandbox>) -> CallToolResult {
        let Some(tenant) = self.tenant(p.tenant_id) else {
            return no_tenant();
        };
        let timeout = p.timeout_seconds.unwrap_or(DEFAULT_EXEC_TIMEOUT);
        if !(1..=MAX_EXEC_TIMEOUT).contains(&timeout) {
            return error(&format!(
                "INVALID_INPUT: timeoutSeconds is 1 to {MAX_EXEC_TIMEOUT}"
            ));
        }
        let (dir, mut ssh) = match session(&self.client, &tenant, &p.sandbox_id, None).await {
            Ok(s) => s,
            Err(SessionError::Api(failure)) => return api_error(&failure),
            Err(SessionError::Local(e)) => return error(&format!("INTERNAL: {e}")),
        };
        // One argument: sshd hands it to the guest's `sh -c` as it is.
        ssh.arg(&p.command);
        let mut ssh = tokio::process::Command::from(ssh);
        // Standard input is the protocol: ssh must never read it.
        ssh.stdin(Stdio::null()).kill_on_drop(true);
        let ran = tokio::time::timeout(Duration::from_secs(timeout), ssh.output()).await;
        // The key and certificate go with the directory.
        drop(dir);
        match ran {
            Err(_) => error(&format!(
                "TIMEOUT: the command ran past {timeout} s and was stopped"
            )),
            Ok(Err(e)) => error(&format!("INTERNAL: cannot run ssh: {e}")),
            Ok(Ok(out)) => success(&json!({
                "stdout": String::from_utf8_lossy(&out.stdout),
                "stderr": String::from_utf8_lossy(&out.stderr),
                "exitCode": out.status.code(),
            })),
        }
    }

    /// Writes a file in a ready sandbox over SSH (made or replaced; `content` as UTF-8 text, or
    /// base64 with `encoding: "base64"`); answers `{ path, sizeBytes }`. The guest's own
    /// error (a path the account may not write) comes back as the tool error.
    #[tool]
    async fn write_file(&self, Parameters(p): Parameters<WriteFile>) -> CallToolResult {
        let Some(tenant) = self.tenant(p.tenant_id) else {
            return no_tenant();
        };
        let bytes = match p.encoding.as_deref().unwrap_or("utf8") {
            "utf8" => p.content.into_bytes(),
            "base64" => match data_encoding::BASE64.decode(p.content.trim().as_ref()) {
                Ok(bytes) => bytes,
                Err(e) => return error(&format!("INVALID_INPUT: content is not base64: {e}")),
            },
            other => {
                return error(&format!(
                    "INVALID_INPUT: encoding {other:?} is not utf8 or base64"
                ))
            }
        };
        let Some(quoted) = quoted_path(&p.path) else {
            return error("INVALID_INPUT: path is empty or cannot be quoted");
        };
        let size = bytes.len();
        match self
            .ssh(
                &tenant,
                &p.sandbox_id,
                &format!("cat > {quoted}"),
                Some(bytes),
            )
            .await
        {
            Ok(_) => success(&json!({ "path": p.path, "sizeBytes": size })),
            Err(result) => result,
        }
    }

    /// Reads a file in a ready sandbox over SSH (at most 8 MiB); answers `{ path, encoding,
    /// content, sizeBytes }`, `content` as UTF-8 text or base64.
    #[tool]
    async fn read_file(&self, Parameters(p): Parameters<ReadFile>) -> CallToolResult {
        let Some(tenant) = self.tenant(p.tenant_id) else {
            return no_tenant();
        };
        if let Some(other) = p
            .encoding
            .as_deref()
            .filter(|e| !["utf8", "base64"].contains(e))
        {
            return error(&format!(
                "INVALID_INPUT: encoding {other:?} is not utf8 or base64"
            ));
        }
        let Some(quoted) = quoted_path(&p.path) else {
            return error("INVALID_INPUT: path is empty or cannot be quoted");
        };
        // One byte past the bound tells a file that is too large.
        let command = format!("head -c {} -- {quoted}", MAX_READ_BYTES + 1);
        let bytes = match self.ssh(&tenant, &p.sandbox_id, &command, None).await {
            Ok(bytes) => bytes,
            Err(result) => return result,
        };
        if bytes.len() > MAX_READ_BYTES {
            return error(&format!(
                "TOO_LARGE: {} is larger than {MAX_READ_BYTES} bytes (use `vps sandboxes cp`)",
                p.path
            ));
        }
        let size = bytes.len();
        let (encoding, content) = match (p.encoding.as_deref(), String::from_utf8(bytes)) {
            (Some("base64"), Ok(text)) => ("base64", encode64(text.as_bytes())),
            (_, Ok(text)) => ("utf8", text),
            (Some("utf8"), Err(_)) => {
                return error(&format!(
                    "INVALID_INPUT: {} is not UTF-8 text (ask for base64)",
                    p.path
                ))
            }
            (_, Err(e)) => ("base64", encode64(e.as_bytes())),
        };
        success(&json!({
            "path": p.path,
            "encoding": encoding,
            "content": content,
            "sizeBytes": size,
        }))
    }

    /// Takes a snapshot of a sandbox (disk and, by default, memory); answers the snapshot,
    /// `pending` until its node has uploaded it.
    #[tool(input_schema = forward::input_schema("sandboxes.snapshot"))]
    async fn snapshot_sandbox(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("sandboxes.snapshot", args).await
    }

    /// Creates an instance (a VM) and waits (up to `waitSeconds`) until it settles; answers
    /// the instance.
    #[tool(input_schema = forward::input_schema("instances.create"))]
    async fn create_instance(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("instances.create", args).await
    }

    /// Lists the tenant's instances, newest first (`scope`: `all` by default, or `mine`).
    #[tool(input_schema = forward::input_schema("instances.list"))]
    async fn list_instances(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("instances.list", args).await
    }

    /// One instance of the tenant (`asOf`: as it was then).
    #[tool(input_schema = forward::input_schema("instances.get"))]
    async fn get_instance(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("instances.get", args).await
    }

    /// Deletes an instance; answers it, `deleting` until its host has removed it.
    #[tool(input_schema = forward::input_schema("instances.delete"))]
    async fn delete_instance(&self, Parameters(args): Parameters<JsonObject>) -> CallToolResult {
        self.forward("instances.delete", args).await
    }
}

impl Vps {
    /// Runs `command` in the sandbox over an exec session, `input` on its standard input:
    /// its standard output, or the tool error (the guest's standard error when it failed).
    async fn ssh(
        &self,
        tenant: &str,
        sandbox: &str,
        command: &str,
        input: Option<Vec<u8>>,
    ) -> Result<Vec<u8>, CallToolResult> {
        use tokio::io::AsyncWriteExt;
        let (dir, mut ssh) = match session(&self.client, tenant, sandbox, None).await {
            Ok(s) => s,
            Err(SessionError::Api(failure)) => return Err(api_error(&failure)),
            Err(SessionError::Local(e)) => return Err(error(&format!("INTERNAL: {e}"))),
        };
        // One argument: sshd hands it to the guest's `sh -c` as it is.
        ssh.arg(command);
        let mut ssh = tokio::process::Command::from(ssh);
        // Standard input is the protocol: ssh reads only what is given here.
        ssh.stdin(if input.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true);
        let ran = tokio::time::timeout(Duration::from_secs(FILE_TIMEOUT), async {
            let mut child = ssh.spawn()?;
            if let (Some(bytes), Some(mut stdin)) = (input, child.stdin.take()) {
                // A guest that refuses the file closes early: its error says why.
                let _ = stdin.write_all(&bytes).await;
                drop(stdin);
            }
            child.wait_with_output().await
        })
        .await;
        // The key and certificate go with the directory.
        drop(dir);
        match ran {
            Err(_) => Err(error(&format!(
                "TIMEOUT: the copy ran past {FILE_TIMEOUT} s and was stopped"
            ))),
            Ok(Err(e)) => Err(error(&format!("INTERNAL: cannot run ssh: {e}"))),
            Ok(Ok(out)) if out.status.success() => Ok(out.stdout),
            Ok(Ok(out)) => Err(error(&format!(
                "GUEST_ERROR: {} (exit {})",
                String::from_utf8_lossy(&out.stderr).trim(),
                out.status
                    .code()
                    .map_or("by a signal".into(), |c| c.to_string())
            ))),
        }
    }

    /// The tool's tenant, or the server's.
    fn tenant(&self, given: Option<String>) -> Option<String> {
        given.or_else(|| self.tenant.clone())
    }

    /// The tool that is `method`: its arguments, with [`forward`]'s conveniences, as the body.
    async fn forward(&self, method: &str, args: JsonObject) -> CallToolResult {
        match forward::body(method, args, self.tenant.as_deref()) {
            Ok(body) => self.call(method, body).await,
            Err(text) => error(text),
        }
    }

    /// One API call as a tool result.
    async fn call(&self, method: &str, body: Value) -> CallToolResult {
        let span = tracing::info_span!("mcp.tool", method);
        match self.client.request(method, &body).instrument(span).await {
            Ok(answer) => success(&answer),
            Err(failure) => api_error(&failure),
        }
    }
}

/// A sandbox path quoted for the guest's `sh`.
fn quoted_path(path: &str) -> Option<String> {
    if path.is_empty() {
        return None;
    }
    shlex::try_quote(path).ok().map(|q| q.into_owned())
}

fn encode64(bytes: &[u8]) -> String {
    data_encoding::BASE64.encode(bytes)
}

fn success(answer: &Value) -> CallToolResult {
    let text = serde_json::to_string_pretty(answer).unwrap_or_else(|_| answer.to_string());
    CallToolResult::success(vec![Content::text(text)])
}

fn error(text: &str) -> CallToolResult {
    CallToolResult::error(vec![Content::text(text)])
}

/// `CODE: message`, and the details on the next line when the API sent any.
fn api_error(failure: &ApiFailure) -> CallToolResult {
    match &failure.details {
        Some(details) => error(&format!("{failure}\ndetails: {details}")),
        None => error(&failure.to_string()),
    }
}

fn no_tenant() -> CallToolResult {
    error(forward::NO_TENANT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn every_tool_names_its_arguments() {
        for tool in super::Vps::tool_router().list_all() {
            let properties = tool.input_schema.get("properties");
            assert!(
                properties
                    .and_then(|p| p.as_object())
                    .is_some_and(|p| !p.is_empty()),
                "{}: {:?}",
                tool.name,
                tool.input_schema
            );
        }
    }
}
