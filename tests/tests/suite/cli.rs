//! The per-group command line against a real server: the `vps` binary (built for this crate as
//! `vps-cli`) run as a user runs it, asserting on its output and exit codes.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{TestServer, ALICE, OPERATOR};

/// What a run of the CLI ended with.
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

async fn vps(t: &TestServer, args: &[&str]) -> Run {
    vps_as(t, ALICE, args).await
}

async fn vps_as(t: &TestServer, token: &str, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
        .args(args)
        .env("VPS_URL", t.server.url())
        .env("VPS_TOKEN", token)
        .env("VPS_TENANT", "acme")
        .env("RUST_LOG", "off")
        .output()
        .await
        .expect("the CLI runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

async fn json_of(t: &TestServer, args: &[&str]) -> Value {
    let mut all = args.to_vec();
    all.push("--json");
    let run = vps(t, &all).await;
    assert_eq!(run.code, 0, "{args:?}: {}", run.stderr);
    serde_json::from_str(&run.stdout).expect("JSON")
}

fn keys(dir: &Path) -> (String, String) {
    let key = dir.join("id");
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(&key)
        .status()
        .unwrap();
    assert!(made.success());
    (
        key.display().to_string(),
        key.with_extension("pub").display().to_string(),
    )
}

#[tokio::test]
async fn instances_from_the_command_line() {
    let t = TestServer::start_with(|c| c.timings.transitional_look = 0.1).await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/24",
            0,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    let (node, token) = t.register_node(&pool, "host").await;
    let _host = t.host(&node, &token, Duration::from_millis(20));
    let dir = tempfile::tempdir().unwrap();
    let (private, public) = keys(dir.path());

    // A private key is refused before anything is sent.
    let run = vps(
        &t,
        &[
            "instances",
            "create",
            "--pool-id",
            &pool,
            "--flavor",
            "small",
            "--image-id",
            "img_ubuntu",
            "--ssh-key",
            &private,
        ],
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("private key"), "{}", run.stderr);

    // A create with a key file waits until it runs; a fresh idempotency key each time.
    let created = json_of(
        &t,
        &[
            "instances",
            "create",
            "--pool-id",
            &pool,
            "--flavor",
            "small",
            "--image-id",
            "img_ubuntu",
            "--ssh-key",
            &public,
            "--wait",
        ],
    )
    .await;
    assert_eq!(created["state"], "running", "{created}");
    assert_eq!(created["sshKeys"].as_array().unwrap().len(), 1);
    let again = json_of(
        &t,
        &[
            "instances",
            "create",
            "--pool-id",
            &pool,
            "--flavor",
            "small",
            "--image-id",
            "img_ubuntu",
        ],
    )
    .await;
    assert_ne!(again["id"], created["id"]);
    let id = created["id"].as_str().unwrap();

    // Tables for people.
    let list = vps(&t, &["instances", "list"]).await;
    assert_eq!(list.code, 0, "{}", list.stderr);
    assert!(
        list.stdout.contains(id) && list.stdout.contains("running"),
        "{}",
        list.stdout
    );
    let got = vps(&t, &["instances", "get", id]).await;
    assert!(got.stdout.contains("desiredState"), "{}", got.stdout);
    let flavors = vps(&t, &["flavors", "list", "--pool-id", &pool]).await;
    assert_eq!(flavors.code, 0, "{}", flavors.stderr);
    assert!(flavors.stdout.contains("small") && flavors.stdout.contains("large"));

    // Usage errors exit 2, API errors 1 with the code on stderr.
    let bad = vps(&t, &["instances", "get", "sbx_nope"]).await;
    assert_eq!(bad.code, 2);
    assert!(bad.stderr.contains("inst_"), "{}", bad.stderr);
    let unknown = format!("inst_{}", "a".repeat(52));
    let missing = vps(&t, &["instances", "get", &unknown]).await;
    assert_eq!(missing.code, 1);
    assert!(
        missing.stderr.starts_with("NOT_FOUND:"),
        "{}",
        missing.stderr
    );
    // Its history: one readable line per event, the whole events with --json.
    let db = t.server.state.pool.connect_options();
    let url = format!(
        "postgres://{}:postgres@{}:{}/{}",
        db.get_username(),
        db.get_host(),
        db.get_port(),
        db.get_database().unwrap_or("postgres")
    );
    let history = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
        .args(["history", id])
        .env("VPS_DATABASE_URL", &url)
        .env("RUST_LOG", "off")
        .output()
        .await
        .unwrap();
    let lines = String::from_utf8_lossy(&history.stdout).into_owned();
    assert!(
        history.status.success(),
        "{}",
        String::from_utf8_lossy(&history.stderr)
    );
    let created = lines
        .lines()
        .find(|l| l.contains("instance.created"))
        .expect(&lines);
    assert!(
        created.contains("id_alice") && created.contains("state="),
        "{created}"
    );
    assert!(lines.lines().all(|l| l.len() < 220), "{lines}");
    let stopped = json_of(&t, &["instances", "stop", id]).await;
    assert_eq!(stopped["desiredState"], "stopped");
    let deleted = json_of(&t, &["instances", "delete", id]).await;
    assert_eq!(deleted["desiredState"], "deleted");
    // Usage through the API, as a table or JSON.
    let usage = json_of(
        &t,
        &[
            "usage",
            "list",
            "--from",
            "2026-01-01T00:00:00Z",
            "--to",
            "2099-01-01T00:00:00Z",
        ],
    )
    .await;
    assert!(usage["items"].is_array(), "{usage}");
}

#[tokio::test]
async fn sandboxes_from_the_command_line_with_a_shell_inside() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        c.timings.sandbox_pass = 0.2;
    })
    .await;
    let pool = t
        .hosted_pool(
            "10.0.1.0/24",
            0,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    let (node, token) = t.register_node(&pool, "host").await;
    let _host = t.host(&node, &token, Duration::from_millis(20));
    let template = json_of(
        &t,
        &[
            "templates",
            "create",
            "--name",
            "py",
            "--pool-id",
            &pool,
            "--flavor",
            "small",
            "--image-id",
            "img_ubuntu",
            "--max-ttl-seconds",
            "2h",
        ],
    )
    .await;
    let tpl = template["id"].as_str().unwrap();
    assert_eq!(template["maxTtlSeconds"], 7200);
    let sandbox = json_of(
        &t,
        &[
            "sandboxes",
            "create",
            "--template-id",
            tpl,
            "--ttl-seconds",
            "15m",
            "--wait",
        ],
    )
    .await;
    assert_eq!(sandbox["state"], "ready", "{sandbox}");
    let sbx = sandbox["id"].as_str().unwrap();
    let extended = json_of(&t, &["sandboxes", "extend", sbx, "--by", "30m"]).await;
    assert_ne!(extended["expiresAt"], sandbox["expiresAt"]);

    // A command in the sandbox, through the system's ssh.
    let run = vps(&t, &["sandboxes", "exec", sbx, "--", "echo", "hi"]).await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(run.stdout.trim(), "hi");
    let failing = vps(&t, &["sandboxes", "exec", sbx, "--", "exit", "3"]).await;
    assert_eq!(failing.code, 3, "ssh's exit code is the command's");

    let listed = vps(&t, &["sandboxes", "list", "--all"]).await;
    assert!(listed.stdout.contains(sbx), "{}", listed.stdout);
    let deleted = json_of(&t, &["sandboxes", "delete", sbx]).await;
    assert_eq!(deleted["state"], "deleting");
    let completions = vps(&t, &["completions", "bash"]).await;
    assert_eq!(completions.code, 0);
    assert!(completions.stdout.contains("sandboxes"));
}

/// `vps images import`: the file lands in the object store under its digest, the image is
/// registered as `store://images/<sha256>`, and a host's spec carries a signed URL that serves
/// exactly those bytes.
#[tokio::test]
async fn an_imported_image_reaches_hosts_through_a_signed_url() {
    use sha2::Digest;
    let t = TestServer::start_with(|c| c.timings.transitional_look = 0.1).await;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("guest.tar");
    let bytes: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    std::fs::write(&file, &bytes).unwrap();
    let digest = hex::encode(sha2::Sha256::digest(&bytes));

    // A tenant may not import.
    let file_arg = file.to_str().unwrap();
    let refused = vps(&t, &["images", "import", file_arg, "--image-id", "img_min"]).await;
    assert_eq!(refused.code, 1, "{}", refused.stderr);
    let run = vps_as(
        &t,
        OPERATOR,
        &[
            "images", "import", file_arg, "--image", "img_min", "--format", "bundle",
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    let images = t.ok(OPERATOR, "images.list", json!({})).await;
    let image = images["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["id"] == "img_min")
        .cloned()
        .expect("registered");
    assert_eq!(image["url"], format!("store://images/{digest}"), "{image}");
    assert_eq!(image["format"], "bundle");

    let pool = t
        .hosted_pool(
            "10.0.0.0/24",
            0,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    let (node, token) = t.register_node(&pool, "host").await;
    let _host = t.host(&node, &token, Duration::from_millis(20));
    t.ok(
        ALICE,
        "instances.create",
        json!({ "tenantId": "acme", "poolId": pool, "flavor": "small", "imageId": "img_min",
                "idempotencyKey": "imported", "wait": { "timeoutMs": 10000 } }),
    )
    .await;
    let spec = t.ok(&token, "nodes.spec", json!({ "nodeId": node })).await;
    let url = spec["instances"][0]["image"]["url"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(url.starts_with("http"), "{spec}");
    assert_eq!(spec["instances"][0]["image"]["sha256"], digest);
    let served = reqwest::get(&url).await.unwrap();
    assert!(served.status().is_success(), "{}", served.status());
    assert_eq!(served.bytes().await.unwrap().as_ref(), bytes.as_slice());

    // A file that is not there is a usage error, and nothing is registered.
    let run = vps_as(
        &t,
        OPERATOR,
        &["images", "import", "/nonexistent", "--image-id", "img_x"],
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
}
