//! The per-group command line against a real server: the `vps` binary (built for this crate as
//! `vps-cli`) run as a user runs it, asserting on its output and exit codes.

use std::path::Path;
use std::time::Duration;

use serde_json::{json, Value};
use vps_tests::{acme_instance, acme_sandbox, TestServer, ALICE, OPERATOR};

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
    keys_at(&key);
    (
        key.display().to_string(),
        key.with_extension("pub").display().to_string(),
    )
}

/// A fresh ed25519 key pair: `key` and `key.pub`.
fn keys_at(key: &Path) {
    let made = std::process::Command::new("ssh-keygen")
        .args(["-q", "-t", "ed25519", "-N", "", "-f"])
        .arg(key)
        .status()
        .unwrap();
    assert!(made.success());
}

#[tokio::test]
async fn instances_from_the_command_line() {
    let t = TestServer::start_with(|c| c.timings.transitional_look = 0.1).await;
    let (pool, _host) = t
        .pool_with_host("10.0.0.0/24", Duration::from_millis(20))
        .await;
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
    let (pool, _host) = t
        .pool_with_host("10.0.1.0/24", Duration::from_millis(20))
        .await;
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
    let digest = data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(&bytes));

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

/// A shell for the reference's command lines: `vps` on its `PATH`, `HOME` and the working
/// directory a scratch directory (so `~/.ssh/id_ed25519.pub` and `./keys/alice.pub` are files
/// there), the server, Alice's token and the tenant `acme` in the environment.
struct Shell {
    dir: tempfile::TempDir,
    url: String,
}

impl Shell {
    fn new(t: &TestServer) -> Shell {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("bin")).unwrap();
        std::os::unix::fs::symlink(
            env!("CARGO_BIN_EXE_vps-cli"),
            dir.path().join("bin").join("vps"),
        )
        .unwrap();
        Shell {
            dir,
            url: t.server.url(),
        }
    }

    /// Runs `line` as the reference writes it (`better-compute` being `vps`), its placeholder
    /// ids (`pool_01jz…`) replaced by this run's.
    async fn run(&self, line: &str, ids: &[(&str, &str)]) -> Run {
        let line = ids
            .iter()
            .fold(line.to_string(), |l, (from, to)| l.replace(from, to));
        let path = format!(
            "{}:{}",
            self.dir.path().join("bin").display(),
            std::env::var("PATH").unwrap_or_default()
        );
        let out = tokio::process::Command::new("sh")
            .args(["-c", &line])
            .current_dir(self.dir.path())
            .env("PATH", path)
            .env("HOME", self.dir.path())
            .env("VPS_URL", &self.url)
            .env("VPS_TOKEN", ALICE)
            .env("VPS_TENANT", "acme")
            .env("RUST_LOG", "off")
            .output()
            .await
            .expect("sh runs");
        let run = Run {
            code: out.status.code().unwrap_or(-1),
            stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        };
        assert_eq!(run.code, 0, "{line}: {}", run.stderr);
        run
    }
}

/// The first id of this kind (`inst_`) a table shows.
fn id_in(text: &str, prefix: &str) -> String {
    text.split(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .find(|word| word.starts_with(prefix))
        .unwrap_or_else(|| panic!("no {prefix}… in {text}"))
        .to_string()
}

/// The instances guide's command lines, flag for flag.
#[tokio::test]
async fn the_reference_instance_command_lines_run_as_written() {
    let t = TestServer::start_with(|c| c.timings.transitional_look = 0.1).await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/24",
            0,
            json!({ "vcpu": 64, "memoryGiB": 256, "diskGiB": 2000 }),
        )
        .await;
    for (name, vcpu) in [("g1.small", 2), ("g1.large", 4)] {
        t.ok(
            OPERATOR,
            "flavors.create",
            json!({ "poolId": pool, "name": name, "vcpu": vcpu, "memoryGiB": vcpu * 2,
                    "diskGiB": 20 }),
        )
        .await;
    }
    t.ok(
        OPERATOR,
        "images.register",
        json!({ "imageId": "ubuntu-24.04", "url": "https://images.example/noble.qcow2",
                "sha256": "b".repeat(64), "format": "qcow2" }),
    )
    .await;
    let (node, token) = t.register_node(&pool, "host").await;
    let _host = t.host(&node, &token, Duration::from_millis(20));
    let sh = Shell::new(&t);
    let home = sh.dir.path();
    for key in [".ssh/id_ed25519", "keys/alice", "keys/ci"] {
        let key = home.join(key);
        std::fs::create_dir_all(key.parent().unwrap()).unwrap();
        keys_at(&key);
    }
    std::fs::write(home.join("cloud-init.yaml"), "#cloud-config\n").unwrap();
    let pool_ids = [("pool_01jz…", pool.as_str())];

    // A create with an idempotency key: run twice, one instance.
    let create = "vps instances create --tenant acme --pool pool_01jz… --flavor g1.small \
                  --image ubuntu-24.04 --ssh-key ~/.ssh/id_ed25519.pub --key build-agent-7";
    let first = id_in(&sh.run(create, &pool_ids).await.stdout, "inst_");
    let again = id_in(&sh.run(create, &pool_ids).await.stdout, "inst_");
    assert_eq!(again, first);
    let get = acme_instance(&first);
    let instance = t.ok(ALICE, "instances.get", get.clone()).await;
    assert_eq!(instance["flavor"], "g1.small", "{instance}");
    assert_eq!(instance["imageId"], "ubuntu-24.04", "{instance}");
    assert_eq!(
        instance["sshKeys"].as_array().unwrap().len(),
        1,
        "{instance}"
    );

    // Two key files, comma-separated, and a user-data file.
    let create = "vps instances create --tenant acme --pool pool_01jz… --flavor g1.small \
                  --image ubuntu-24.04 --ssh-key ./keys/alice.pub,./keys/ci.pub \
                  --user-data ./cloud-init.yaml";
    let second = id_in(&sh.run(create, &pool_ids).await.stdout, "inst_");
    assert_ne!(second, first);
    let instance = t.ok(ALICE, "instances.get", acme_instance(&second)).await;
    assert_eq!(
        instance["sshKeys"].as_array().unwrap().len(),
        2,
        "{instance}"
    );

    let running = |i: &Value| i["state"] == "running";
    t.until(ALICE, "acme", &first, Duration::from_secs(10), running)
        .await;
    let ids = [("inst_01k5w…", first.as_str())];
    let listed = sh
        .run(
            "vps instances list --tenant acme --all --state running",
            &[],
        )
        .await;
    assert!(listed.stdout.contains(&first), "{}", listed.stdout);
    let state = sh
        .run(
            "vps instances get inst_01k5w… --tenant acme --query state",
            &ids,
        )
        .await;
    assert_eq!(state.stdout.trim(), "running");

    sh.run("vps instances stop inst_01k5w… --tenant acme", &ids)
        .await;
    let stopped = |i: &Value| i["state"] == "stopped";
    let instance = t
        .until(ALICE, "acme", &first, Duration::from_secs(10), stopped)
        .await;
    assert_eq!(instance["state"], "stopped", "{instance}");
    sh.run(
        "vps instances resize inst_01k5w… --tenant acme --flavor g1.large",
        &ids,
    )
    .await;
    let instance = t.ok(ALICE, "instances.get", get.clone()).await;
    assert_eq!(instance["flavor"], "g1.large", "{instance}");
    sh.run("vps instances start inst_01k5w… --tenant acme", &ids)
        .await;
    let instance = t
        .until(ALICE, "acme", &first, Duration::from_secs(10), running)
        .await;
    assert_eq!(instance["state"], "running", "{instance}");
    sh.run("vps instances delete inst_01k5w… --tenant acme", &ids)
        .await;
    let instance = t.ok(ALICE, "instances.get", get).await;
    assert_eq!(instance["desiredState"], "deleted", "{instance}");

    // Its history over the API: the lines `vps history` prints, the events with --json.
    let history = vps(&t, &["instances", "history", &first]).await;
    assert_eq!(history.code, 0, "{}", history.stderr);
    let lines: Vec<&str> = history.stdout.lines().collect();
    let created = lines
        .iter()
        .find(|l| l.contains("instance.created"))
        .unwrap_or_else(|| panic!("{}", history.stdout));
    assert!(
        created.contains("id_alice") && created.contains("state="),
        "{created}"
    );
    assert!(
        lines.iter().any(|l| l.contains("instance.resized")),
        "{lines:?}"
    );
    assert!(lines.iter().all(|l| l.len() < 220), "{lines:?}");
    // The host may still be removing it: later events only add to the list.
    let events = json_of(&t, &["instances", "history", &first]).await;
    assert!(events["items"].as_array().unwrap().len() >= lines.len());
    assert_eq!(events["items"][0]["type"], "instance.created", "{events}");
}

/// The sandboxes guide's command lines, flag for flag, but the template's (`--warm-min` has
/// no flag here: `--warm '{"min":2}'`).
#[tokio::test]
async fn the_reference_sandbox_command_lines_run_as_written() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (pool, _host) = t
        .pool_with_host("10.0.1.0/24", Duration::from_millis(20))
        .await;
    let template = t
        .sandbox_template(&pool, "python", json!({ "maxTtlSeconds": 14400 }))
        .await;
    let tpl = template["id"].as_str().unwrap().to_string();
    let sh = Shell::new(&t);

    let created = sh
        .run(
            "vps sandbox create --template sbxt_01k5w… --ttl 30m",
            &[("sbxt_01k5w…", &tpl)],
        )
        .await;
    let sbx = id_in(&created.stdout, "sbx_");
    let get = acme_sandbox(&sbx);
    vps_tests::wait_until("the sandbox is ready", Duration::from_secs(10), || async {
        t.ok(ALICE, "sandboxes.get", get.clone()).await["state"] == "ready"
    })
    .await;
    let before = t.ok(ALICE, "sandboxes.get", get.clone()).await;
    let ids = [("sbx_01k5w…", sbx.as_str())];
    let listed = sh.run("vps sandbox list --all --format table", &[]).await;
    assert!(listed.stdout.contains(&sbx), "{}", listed.stdout);
    sh.run("vps sandbox extend sbx_01k5w… --by 30m", &ids).await;
    let after = t.ok(ALICE, "sandboxes.get", get.clone()).await;
    assert_ne!(after["expiresAt"], before["expiresAt"]);
    let uname = sh
        .run("vps sandbox exec sbx_01k5w… -- uname -a", &ids)
        .await;
    assert!(!uname.stdout.trim().is_empty(), "{}", uname.stderr);
    let snapshot = sh.run("vps sandbox snapshot sbx_01k5w… --keep", &ids).await;
    let snap = id_in(&snapshot.stdout, "snap_");
    let kept = t
        .ok(
            ALICE,
            "sandboxSnapshots.get",
            json!({ "tenantId": "acme", "snapshotId": snap }),
        )
        .await;
    assert_eq!(kept["keep"], true, "{kept}");
    sh.run("vps sandbox delete sbx_01k5w…", &ids).await;
    match t.call(ALICE, "sandboxes.get", get).await {
        Ok(deleting) => assert_ne!(deleting["state"], "ready", "{deleting}"),
        Err(gone) => assert_eq!(gone.status, 404, "{:?}", gone.body),
    }

    let volume = sh
        .run(
            "vps sandbox-volume create --pool pool_01k5w… --name agent-notes --size 20",
            &[("pool_01k5w…", &pool)],
        )
        .await;
    let vol = id_in(&volume.stdout, "vol_");
    let ids = [("vol_01k5w…", vol.as_str())];
    let listed = sh.run("vps sandbox-volume list --format table", &[]).await;
    assert!(listed.stdout.contains(&vol), "{}", listed.stdout);
    let got = sh.run("vps sandbox-volume get vol_01k5w…", &ids).await;
    assert!(got.stdout.contains("agent-notes"), "{}", got.stdout);
    sh.run("vps sandbox-volume resize vol_01k5w… --size 40", &ids)
        .await;
    let get = json!({ "tenantId": "acme", "volumeId": vol });
    let resized = t.ok(ALICE, "sandboxVolumes.get", get.clone()).await;
    assert_eq!(resized["sizeGiB"], 40, "{resized}");
    sh.run("vps sandbox-volume delete vol_01k5w…", &ids).await;
    match t.call(ALICE, "sandboxVolumes.get", get).await {
        Ok(deleting) => assert_ne!(deleting["state"], resized["state"], "{deleting}"),
        Err(gone) => assert_eq!(gone.status, 404, "{:?}", gone.body),
    }
}
