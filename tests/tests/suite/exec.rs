//! `sandboxes.exec` end to end: the system's OpenSSH client, with a certificate the server
//! signed, reaches a sandbox's emulated guest through the `vps tunnel` ProxyCommand and the
//! host's tunnel endpoint, which redeems the single-use ticket and checks the certificate.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde_json::{json, Value};
use vps_emulators::host::HostHandle;
use vps_tests::{acme_sandbox, quota, TestServer, ALICE, EVE, OPERATOR};

const BOOT: Duration = Duration::from_millis(50);

async fn server() -> TestServer {
    TestServer::start_with(vps_tests::fast_sandboxes).await
}

/// A pool with `nodes` emulated hosts (tunnel endpoints included) and a template of acme's.
async fn setup(t: &TestServer, nodes: usize) -> (String, String, Vec<HostHandle>) {
    let (pool, hosts) = t
        .pool_with_hosts("10.0.0.0/24", quota(100), nodes, BOOT)
        .await;
    let template = t.sandbox_template(&pool, "py", json!({})).await;
    (pool, template["id"].as_str().unwrap().to_string(), hosts)
}

async fn sandbox(t: &TestServer, template: &str, key: &str, ttl: u64) -> Value {
    let s = t
        .ready_sandbox(&template, key, json!({ "ttlSeconds": ttl }))
        .await;
    s
}

async fn exec(t: &TestServer, sandbox: &Value, public_key: &str, ttl: Option<u64>) -> Value {
    let mut body =
        json!({ "tenantId": "acme", "sandboxId": sandbox["id"], "publicKey": public_key });
    if let Some(ttl) = ttl {
        body["ttlSeconds"] = ttl.into();
    }
    t.ok(ALICE, "sandboxes.exec", body).await
}

fn refusal(answer: Result<Value, vps_tests::Answer>) -> (String, Value) {
    let err = answer.expect_err("a refusal");
    (err.body["code"].as_str().unwrap().to_string(), err.body)
}

/// A scratch directory with an ed25519 key pair made by `ssh-keygen`.
struct Keys {
    dir: PathBuf,
}

impl Keys {
    async fn new(name: &str) -> Keys {
        // Test names are unique in a process, and processes have their own ids.
        let dir = std::env::temp_dir().join(format!("vps-exec-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let keys = Keys { dir };
        keys.generate("key", "ed25519").await;
        keys
    }

    async fn generate(&self, name: &str, kind: &str) {
        let out = tokio::process::Command::new("ssh-keygen")
            .args(["-q", "-t", kind, "-N", "", "-C", "test@exec", "-f"])
            .arg(self.dir.join(name))
            .output()
            .await
            .expect("ssh-keygen runs");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn public(&self, name: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("{name}.pub"))).unwrap()
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// Writes a certificate beside the key, as `key-cert.pub`.
    fn certify(&self, certificate: &str) -> PathBuf {
        let path = self.dir.join("key-cert.pub");
        std::fs::write(&path, format!("{certificate}\n")).unwrap();
        path
    }
}

impl Drop for Keys {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What an `ssh` run answered.
struct Ssh {
    ok: bool,
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

/// Runs the system's `ssh` through `vps tunnel` with the grant's tunnel.
async fn ssh(key: &Path, certificate: &Path, grant: &Value, command: &str) -> Ssh {
    // As `vps sandboxes exec` does it: the tunnel goes in a file, never into the shell command.
    let ticket_file = key.with_extension("tunnel.json");
    std::fs::write(&ticket_file, grant["tunnel"].to_string()).unwrap();
    let proxy = format!(
        "{} tunnel --ticket-file {}",
        env!("CARGO_BIN_EXE_vps-cli"),
        ticket_file.display()
    );
    let out = tokio::process::Command::new("ssh")
        .arg("-F")
        .arg("/dev/null")
        .arg("-i")
        .arg(key)
        .arg("-o")
        .arg(format!("CertificateFile={}", certificate.display()))
        .args([
            "-o",
            "IdentitiesOnly=yes",
            "-o",
            "StrictHostKeyChecking=no",
            "-o",
            "UserKnownHostsFile=/dev/null",
            "-o",
            "BatchMode=yes",
            "-o",
            "LogLevel=ERROR",
            "-o",
            "ConnectTimeout=20",
        ])
        .arg("-o")
        .arg(format!("ProxyCommand={proxy}"))
        .arg(format!(
            "{}@{}",
            grant["account"].as_str().unwrap(),
            grant["instanceId"].as_str().unwrap()
        ))
        .arg(command)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("ssh ends")
        .expect("ssh runs");
    Ssh {
        ok: out.status.success(),
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openssh_runs_a_command_in_a_sandbox_with_a_short_certificate() {
    let t = server().await;
    let (_, template, _hosts) = setup(&t, 1).await;
    let s = sandbox(&t, &template, "a", 3600).await;
    let keys = Keys::new("e2e").await;
    let grant = exec(&t, &s, &keys.public("key"), Some(600)).await;
    assert_eq!(grant["principal"], s["instanceId"]);
    assert_eq!(grant["instanceId"], s["instanceId"]);
    assert_eq!(grant["account"], "sandbox");
    assert!(grant["tunnel"]["url"]
        .as_str()
        .unwrap()
        .starts_with("tcp://127.0.0.1:"));
    assert!(grant["caPublicKey"]
        .as_str()
        .unwrap()
        .starts_with("ssh-ed25519 "));
    let serial = grant["serial"].as_u64().unwrap();
    assert_eq!(
        grant["keyId"],
        format!("vps:acme:{}:{serial}", s["id"].as_str().unwrap())
    );
    let cert = keys.certify(grant["certificate"].as_str().unwrap());

    // ssh-keygen reads the certificate: a user certificate for the instance, ten minutes long.
    let listing = tokio::process::Command::new("ssh-keygen")
        .arg("-L")
        .arg("-f")
        .arg(&cert)
        .output()
        .await
        .unwrap();
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    assert!(listing.contains("user certificate"), "{listing}");
    let principal = s["instanceId"].as_str().unwrap();
    let lines: Vec<&str> = listing.lines().map(str::trim).collect();
    let principals = lines.iter().position(|l| *l == "Principals:").unwrap();
    assert_eq!(lines[principals + 1], principal, "{listing}");
    assert!(
        lines.contains(&format!("Serial: {serial}").as_str()),
        "{listing}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.starts_with("Valid: from ") && l.contains(" to ")),
        "{listing}"
    );
    let valid_before: chrono::DateTime<chrono::Utc> =
        grant["validBefore"].as_str().unwrap().parse().unwrap();
    let lifetime = valid_before - t.clock.now();
    assert!(
        lifetime <= chrono::TimeDelta::seconds(600) && lifetime > chrono::TimeDelta::seconds(590),
        "{lifetime}"
    );

    let run = ssh(&keys.path("key"), &cert, &grant, "echo hi").await;
    assert!(run.ok, "ssh failed: {}", run.stderr);
    assert_eq!(run.stdout, "hi\n");

    // Another grant: stderr and the exit status come back too, in a scratch directory.
    let grant = exec(&t, &s, &keys.public("key"), None).await;
    let cert = keys.certify(grant["certificate"].as_str().unwrap());
    let run = ssh(
        &keys.path("key"),
        &cert,
        &grant,
        "echo out; echo err >&2; echo $USER; test -w . && exit 3",
    )
    .await;
    assert_eq!(run.code, Some(3), "{}", run.stderr);
    assert_eq!(run.stdout, "out\nsandbox\n");
    assert!(run.stderr.contains("err"), "{}", run.stderr);

    // The ticket was used: the same grant opens nothing again.
    let again = ssh(&keys.path("key"), &cert, &grant, "echo hi").await;
    assert!(!again.ok && again.stdout.is_empty(), "{}", again.stdout);

    // The log names each certificate (serial, key id, principal, end), never the certificate.
    t.settle().await;
    let events = t
        .ok(
            ALICE,
            "events.list",
            json!({ "types": ["sandbox.exec.issued"], "subject": format!("sandbox/{}", s["id"].as_str().unwrap()) }),
        )
        .await;
    let items = events["items"].as_array().unwrap();
    assert_eq!(items.len(), 2, "{events}");
    let first = &items[0]["data"];
    assert_eq!(first["serial"], serial);
    assert_eq!(
        first["keyId"],
        format!("vps:acme:{}:{serial}", s["id"].as_str().unwrap())
    );
    assert_eq!(first["principal"], principal);
    assert!(first["validBefore"].is_string());
    assert!(first.get("certificate").is_none(), "{first}");
    let everything = t
        .ok(OPERATOR, "events.list", json!({ "limit": 1000 }))
        .await
        .to_string();
    let body = grant["certificate"]
        .as_str()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap();
    assert!(!everything.contains(body), "a certificate is in the log");
    assert!(!everything.contains(grant["tunnel"]["ticket"].as_str().unwrap()));
    // The sandbox itself did not change, and replay rebuilds what the log says.
    let after = t.ok(ALICE, "sandboxes.get", acme_sandbox(&s["id"])).await;
    assert_eq!(after["state"], "ready");
    assert_eq!(after["expiresAt"], s["expiresAt"]);
    assert!(t.replay_equal().await);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ticket_is_redeemed_exactly_once_by_its_own_node() {
    let t = server().await;
    let (pool, template, hosts) = setup(&t, 1).await;
    let s = sandbox(&t, &template, "a", 3600).await;
    let keys = Keys::new("redeem").await;
    let node = hosts[0].node_id().to_string();
    let (other, other_token) = t.register_node(&pool, "idle").await;

    let grant = exec(&t, &s, &keys.public("key"), None).await;
    let ticket = grant["tunnel"]["ticket"].as_str().unwrap();
    // Another node's token may not redeem for this node, nor this node's ticket as itself.
    let denied = t
        .call(
            &other_token,
            "nodes.redeemTicket",
            json!({ "nodeId": node, "ticket": ticket }),
        )
        .await;
    assert_eq!(refusal(denied).0, "ACCESS_DENIED");
    let elsewhere = t
        .call(
            &other_token,
            "nodes.redeemTicket",
            json!({ "nodeId": other, "ticket": ticket }),
        )
        .await;
    assert_eq!(refusal(elsewhere).0, "NOT_FOUND");
    // A tenant is no node.
    let tenant = t
        .call(
            ALICE,
            "nodes.redeemTicket",
            json!({ "nodeId": node, "ticket": ticket }),
        )
        .await;
    assert_eq!(refusal(tenant).0, "ACCESS_DENIED");

    // Many redeems at once, across two replicas: exactly one wins.
    let replica = t.replica().await;
    let client = reqwest::Client::new();
    let attempts = (0..12).map(|n| {
        let url = if n % 2 == 0 {
            t.server.url()
        } else {
            replica.url()
        };
        let request = client
            .post(format!("{url}/api/compute/nodes/redeemTicket"))
            .bearer_auth(OPERATOR)
            .json(&json!({ "nodeId": node, "ticket": ticket }))
            .send();
        async move {
            let answer = request.await.unwrap();
            (
                answer.status().as_u16(),
                answer.json::<Value>().await.unwrap(),
            )
        }
    });
    let answers = futures::future::join_all(attempts).await;
    let won: Vec<&Value> = answers
        .iter()
        .filter(|(status, _)| *status == 200)
        .map(|(_, body)| body)
        .collect();
    assert_eq!(won.len(), 1, "{answers:?}");
    assert_eq!(won[0]["instanceId"], s["instanceId"]);
    assert_eq!(won[0]["principal"], s["instanceId"]);
    assert_eq!(won[0]["validBefore"], grant["validBefore"]);
    assert_eq!(won[0]["caPublicKey"], grant["caPublicKey"]);
    assert!(answers
        .iter()
        .filter(|(status, _)| *status != 200)
        .all(|(status, body)| *status == 404 && body["code"] == "NOT_FOUND"));
    let second = t
        .call(
            OPERATOR,
            "nodes.redeemTicket",
            json!({ "nodeId": node, "ticket": ticket }),
        )
        .await;
    assert_eq!(refusal(second).0, "NOT_FOUND");

    // An expired ticket is refused, and swept.
    let grant = exec(&t, &s, &keys.public("key"), None).await;
    sqlx::query("UPDATE exec_tickets SET expires_at = now() - interval '1 second'")
        .execute(&t.server.state.pool)
        .await
        .unwrap();
    let expired = t
        .call(
            OPERATOR,
            "nodes.redeemTicket",
            json!({ "nodeId": node, "ticket": grant["tunnel"]["ticket"] }),
        )
        .await;
    assert_eq!(refusal(expired).0, "NOT_FOUND");
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM exec_tickets")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    replica.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_refuses_an_expired_certificate_and_one_for_another_instance() {
    let t = server().await;
    let (_, template, _hosts) = setup(&t, 2).await;
    let a = sandbox(&t, &template, "a", 3600).await;
    let b = sandbox(&t, &template, "b", 3600).await;
    let keys = Keys::new("refused").await;

    // A's certificate through B's ticket: the principal names another instance.
    let for_a = exec(&t, &a, &keys.public("key"), None).await;
    let for_b = exec(&t, &b, &keys.public("key"), None).await;
    let cert_a = keys.certify(for_a["certificate"].as_str().unwrap());
    let run = ssh(&keys.path("key"), &cert_a, &for_b, "echo hi").await;
    assert!(!run.ok, "another instance's certificate let ssh in");
    assert!(run.stderr.contains("Permission denied"), "{}", run.stderr);
    // The same certificate through its own ticket works.
    let run = ssh(&keys.path("key"), &cert_a, &for_a, "echo hi").await;
    assert_eq!(run.stdout, "hi\n", "{}", run.stderr);

    // A one-second certificate, used once it has ended (its ticket is still good).
    let short = exec(&t, &a, &keys.public("key"), Some(1)).await;
    let cert = keys.certify(short["certificate"].as_str().unwrap());
    t.advance(Duration::from_millis(2500));
    let run = ssh(&keys.path("key"), &cert, &short, "echo hi").await;
    assert!(!run.ok, "an expired certificate let ssh in");
    assert!(run.stderr.contains("Permission denied"), "{}", run.stderr);

    // A key the CA never certified, and a certificate another CA signed, get nowhere either.
    keys.generate("rogue-ca", "ed25519").await;
    let grant = exec(&t, &a, &keys.public("key"), None).await;
    let out = tokio::process::Command::new("ssh-keygen")
        .arg("-q")
        .arg("-s")
        .arg(keys.path("rogue-ca"))
        .args(["-I", "rogue", "-n"])
        .arg(a["instanceId"].as_str().unwrap())
        .args(["-V", "-1m:+10m"])
        .arg(keys.path("key.pub"))
        .output()
        .await
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let run = ssh(
        &keys.path("key"),
        &keys.path("key-cert.pub"),
        &grant,
        "echo hi",
    )
    .await;
    assert!(!run.ok, "another CA's certificate let ssh in");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exec_refuses_what_it_cannot_certify() {
    let t = server().await;
    let (pool, template, hosts) = setup(&t, 1).await;
    let keys = Keys::new("refusals").await;
    keys.generate("rsa", "rsa").await;
    let key = keys.public("key");
    let ready = sandbox(&t, &template, "ready", 3600).await;
    let call = |body: Value| t.call(ALICE, "sandboxes.exec", body);

    // Bad keys and lifetimes.
    for bad in [
        keys.public("rsa"),
        "ssh-ed25519 AAAA".to_string(),
        "not a key".to_string(),
        std::fs::read_to_string(keys.path("key")).unwrap(),
    ] {
        let (code, body) = refusal(
            call(json!({ "tenantId": "acme", "sandboxId": ready["id"], "publicKey": bad })).await,
        );
        assert_eq!(code, "INVALID_INPUT", "{body}");
        assert_eq!(body["details"]["field"], "publicKey");
    }
    for ttl in [0, 901] {
        let (code, body) = refusal(
            call(json!({ "tenantId": "acme", "sandboxId": ready["id"], "publicKey": key, "ttlSeconds": ttl }))
                .await,
        );
        assert_eq!(code, "INVALID_INPUT", "{body}");
        assert_eq!(body["details"]["field"], "ttlSeconds");
    }
    // Another tenant's sandbox does not exist for globex.
    let other = t
        .call(
            EVE,
            "sandboxes.exec",
            json!({ "tenantId": "globex", "sandboxId": ready["id"], "publicKey": key }),
        )
        .await;
    assert_eq!(refusal(other).0, "NOT_FOUND");
    let other = t
        .call(
            EVE,
            "sandboxes.exec",
            json!({ "tenantId": "acme", "sandboxId": ready["id"], "publicKey": key }),
        )
        .await;
    assert_eq!(refusal(other).0, "NOT_FOUND");

    // A sandbox ending within a minute: extend it first.
    let ending = sandbox(&t, &template, "ending", 50).await;
    let (code, body) = refusal(
        call(json!({ "tenantId": "acme", "sandboxId": ending["id"], "publicKey": key })).await,
    );
    assert_eq!(code, "INVALID_STATE", "{body}");
    assert_eq!(body["details"]["reason"], "sandbox-expiring");

    // A deleted sandbox, and one whose instance has not run yet (no room on any node).
    t.ok(ALICE, "sandboxes.delete", acme_sandbox(&ending["id"]))
        .await;
    let (code, body) = refusal(
        call(json!({ "tenantId": "acme", "sandboxId": ending["id"], "publicKey": key })).await,
    );
    assert_eq!(code, "INVALID_STATE", "{body}");
    t.ok(
        OPERATOR,
        "nodes.cordon",
        json!({ "nodeId": hosts[0].node_id() }),
    )
    .await;
    let starting = t
        .ok(
            ALICE,
            "sandboxes.create",
            json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": "starting" }),
        )
        .await;
    assert_eq!(starting["state"], "starting");
    let (code, body) = refusal(
        call(json!({ "tenantId": "acme", "sandboxId": starting["id"], "publicKey": key })).await,
    );
    assert_eq!(code, "INVALID_STATE", "{body}");

    // A node's tunnelUrl must be tcp://HOST:PORT, HOST an IP literal or an RFC 1123 name:
    // shell syntax in the host, which the url crate lets through, is refused naming the field.
    let (node, token) = t.register_node(&pool, "stating").await;
    for url in [
        "http://x:1/path",
        "tcp://$(touch${IFS}/tmp/pwned):22",
        "tcp://`id`:22",
        "tcp://a;id:22",
    ] {
        let bad = t
            .call(
                &token,
                "nodes.report",
                json!({ "nodeId": node, "instances": [], "tunnelUrl": url }),
            )
            .await;
        let (code, body) = refusal(bad);
        assert_eq!(code, "INVALID_INPUT", "{url}: {body}");
        assert_eq!(body["details"]["field"], "tunnelUrl", "{url}: {body}");
    }

    // Nothing was recorded for any refusal.
    t.settle().await;
    let issued = t
        .ok(
            OPERATOR,
            "events.list",
            json!({ "types": ["sandbox.exec.issued"] }),
        )
        .await;
    assert_eq!(issued["items"].as_array().unwrap().len(), 0, "{issued}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_sandbox_ca_exec_is_unsupported() {
    let t = TestServer::start_with(|c| c.sandbox_exec.ca_key = None).await;
    let (code, body) = refusal(
        t.call(
            ALICE,
            "sandboxes.exec",
            // A well-formed id that names nothing: the missing CA is refused before the lookup.
            json!({ "tenantId": "acme", "sandboxId": format!("sbx_{}", "a".repeat(52)),
                    "publicKey": vps_tests::SSH_KEY }),
        )
        .await,
    );
    assert_eq!(code, "UNSUPPORTED", "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_configured_tunnel_url_overrides_what_nodes_state() {
    let t = TestServer::start_with(|c| {
        c.timings.transitional_look = 0.1;
        c.sandbox_exec.tunnel_url = Some("tcp://{nodeName}.hosts.example:2222".into());
    })
    .await;
    let (_, template, _hosts) = setup(&t, 1).await;
    let s = sandbox(&t, &template, "a", 3600).await;
    let grant = exec(&t, &s, vps_tests::SSH_KEY, None).await;
    assert_eq!(grant["tunnel"]["url"], "tcp://host-0.hosts.example:2222");
}

/// `vps tunnel --ticket-file`, run through `/bin/sh -c` as OpenSSH runs a ProxyCommand, with a
/// file whose URL carries shell syntax: the URL is refused before any connect and no command
/// in it runs.
#[test]
fn a_hostile_ticket_file_runs_no_command() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("pwned");
    let file = dir.path().join("tunnel.json");
    let tunnel = json!({
        "url": format!("tcp://$(touch {}):22", marker.display()),
        "ticket": format!("xt_{}", "ab".repeat(32)),
    });
    std::fs::write(&file, tunnel.to_string()).unwrap();
    let proxy = format!(
        "{} tunnel --ticket-file {}",
        env!("CARGO_BIN_EXE_vps-cli"),
        file.display()
    );
    let out = std::process::Command::new("/bin/sh")
        .arg("-c")
        .arg(&proxy)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("tunnel.url"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!marker.exists(), "a command in the URL ran");
}
