//! `vps mcp` driven as an agent's client drives it: rmcp's client speaking the Model Context
//! Protocol over the stdio of the `vps` binary (built for this crate as `vps-cli`), against a
//! real server with an emulated host.

use std::time::Duration;

use rmcp::model::{CallToolRequestParams, CallToolResult};
use rmcp::service::{Peer, RoleClient};
use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use rmcp::ServiceExt;
use serde_json::{json, Value};
use vps_tests::{TestServer, ALICE};

/// Calls `tool` with `arguments`; answers the result and its text.
pub(crate) async fn call(
    agent: &Peer<RoleClient>,
    tool: &'static str,
    arguments: Value,
) -> (bool, String) {
    let Value::Object(arguments) = arguments else {
        panic!("arguments are an object")
    };
    let result: CallToolResult = agent
        .call_tool(CallToolRequestParams::new(tool).with_arguments(arguments))
        .await
        .unwrap_or_else(|e| panic!("{tool}: a protocol error: {e}"));
    let text = result
        .content
        .iter()
        .filter_map(|c| c.as_text().map(|t| t.text.clone()))
        .collect::<Vec<_>>()
        .join("\n");
    (result.is_error == Some(true), text)
}

/// The JSON answer of a tool that succeeded.
pub(crate) async fn ok(agent: &Peer<RoleClient>, tool: &'static str, arguments: Value) -> Value {
    let (failed, text) = call(agent, tool, arguments).await;
    assert!(!failed, "{tool}: {text}");
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{tool}: not JSON ({e}): {text}"))
}

#[tokio::test]
async fn an_agent_creates_a_sandbox_and_runs_a_command_in_it() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        c.timings.sandbox_pass = 0.2;
    })
    .await;
    let (pool, _host) = t
        .pool_with_host("10.0.1.0/24", Duration::from_millis(20))
        .await;
    let template = t.sandbox_template(&pool, "py", json!({})).await;
    let tpl = template["id"].as_str().unwrap();

    let command = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli")).configure(|c| {
        c.arg("mcp")
            .env("VPS_URL", t.server.url())
            .env("VPS_TOKEN", ALICE)
            .env("VPS_TENANT", "acme")
            .env("RUST_LOG", "warn");
    });
    let agent =
        ().serve(TokioChildProcess::new(command).expect("vps mcp starts"))
            .await
            .expect("the MCP handshake");

    // The tools, with the API's field names in their schemas.
    let tools = agent.list_all_tools().await.expect("tools/list");
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_ref()).collect();
    for name in [
        "create_sandbox",
        "list_sandboxes",
        "extend_sandbox",
        "delete_sandbox",
        "exec_in_sandbox",
        "snapshot_sandbox",
        "create_instance",
        "list_instances",
        "get_instance",
        "delete_instance",
    ] {
        assert!(names.contains(&name), "{name} in {names:?}");
    }
    let create = tools.iter().find(|t| t.name == "create_sandbox").unwrap();
    assert!(
        create.input_schema["properties"]["templateId"].is_object(),
        "{:?}",
        create.input_schema
    );
    assert_eq!(create.input_schema["required"], json!(["templateId"]));

    // A sandbox on the emulated host, ready within the default wait.
    let sandbox = ok(
        &agent,
        "create_sandbox",
        json!({ "templateId": tpl, "ttlSeconds": 900 }),
    )
    .await;
    assert_eq!(sandbox["state"], "ready", "{sandbox}");
    let sbx = sandbox["id"].as_str().unwrap();
    let listed = ok(&agent, "list_sandboxes", json!({})).await;
    assert!(listed["items"].to_string().contains(sbx), "{listed}");
    let extended = ok(
        &agent,
        "extend_sandbox",
        json!({ "sandboxId": sbx, "by": "30m" }),
    )
    .await;
    assert_ne!(extended["expiresAt"], sandbox["expiresAt"]);

    // A command through the exec path: certificate, tunnel, the system's ssh.
    let ran = ok(
        &agent,
        "exec_in_sandbox",
        json!({ "sandboxId": sbx, "command": "echo hi" }),
    )
    .await;
    assert_eq!(ran["stdout"].as_str().unwrap().trim(), "hi", "{ran}");
    assert_eq!(ran["exitCode"], 0, "{ran}");
    let failing = ok(
        &agent,
        "exec_in_sandbox",
        json!({ "sandboxId": sbx, "command": "echo oops >&2; exit 3" }),
    )
    .await;
    assert_eq!(failing["exitCode"], 3, "{failing}");
    assert_eq!(failing["stderr"].as_str().unwrap().trim(), "oops");

    // API errors are tool errors carrying the code, never protocol errors.
    let unknown = format!("inst_{}", "a".repeat(52));
    let (failed, text) = call(&agent, "get_instance", json!({ "instanceId": unknown })).await;
    assert!(failed, "{text}");
    assert!(text.starts_with("NOT_FOUND:"), "{text}");
    let (failed, text) = call(
        &agent,
        "exec_in_sandbox",
        json!({ "sandboxId": format!("sbx_{}", "a".repeat(52)), "command": "true" }),
    )
    .await;
    assert!(failed && text.starts_with("NOT_FOUND:"), "{text}");

    let deleted = ok(&agent, "delete_sandbox", json!({ "sandboxId": sbx })).await;
    assert_eq!(deleted["state"], "deleting");
    agent.cancel().await.expect("the server stops");
}
