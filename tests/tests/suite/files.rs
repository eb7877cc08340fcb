//! Files in and out of a sandbox over the exec path, against a real server and an emulated
//! host whose guest runs commands with the machine's `sh` (so the sandbox's paths are the
//! machine's, under a directory of the test's own): `vps sandboxes cp` both ways, for a file
//! and with `-r` for a tree, comparing bytes; the guest's own error passed through with exit
//! 1; and the MCP tools `write_file` and `read_file`.

use std::path::Path;
use std::time::Duration;

use rmcp::transport::{ConfigureCommandExt, TokioChildProcess};
use rmcp::ServiceExt;
use serde_json::json;
use vps_emulators::host::HostHandle;
use vps_tests::{quota, TestServer, ALICE};

use crate::mcp::{call, ok};

const BOOT: Duration = Duration::from_millis(50);

/// A ready sandbox of acme's on one emulated host.
async fn sandbox(t: &TestServer) -> (String, Vec<HostHandle>) {
    let (pool, hosts) = t.pool_with_hosts("10.0.0.0/24", quota(100), 1, BOOT).await;
    let template = t.sandbox_template(&pool, "files", json!({})).await;
    let s = t
        .ready_sandbox(&template["id"], "files", json!({ "ttlSeconds": 900 }))
        .await;
    (s["id"].as_str().unwrap().to_owned(), hosts)
}

struct Run {
    code: i32,
    stderr: String,
}

async fn vps(t: &TestServer, args: &[&str]) -> Run {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
        .args(args)
        .env("VPS_URL", t.server.url())
        .env("VPS_TOKEN", ALICE)
        .env("VPS_TENANT", "acme")
        .env("RUST_LOG", "off")
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .expect("the CLI runs");
    Run {
        code: out.status.code().unwrap_or(-1),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Bytes no text encoding would keep: every byte value, NULs and a lone CR included.
fn binary(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761).wrapping_add(seed) >> 13) as u8)
        .collect()
}

fn read(path: &Path) -> Vec<u8> {
    std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[tokio::test]
async fn cp_copies_files_and_trees_in_and_out_byte_for_byte() {
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (sbx, _hosts) = sandbox(&t).await;
    let local = tempfile::tempdir().unwrap();
    // The emulated guest's file system is the machine's: the sandbox's side lives here.
    let remote = tempfile::tempdir().unwrap();
    let r = remote.path().display().to_string();

    // A file in, and back out.
    let bytes = binary(300_000, 7);
    let file = local.path().join("data.bin");
    std::fs::write(&file, &bytes).unwrap();
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            file.to_str().unwrap(),
            &format!("{sbx}:{r}/in.bin"),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(read(&remote.path().join("in.bin")), bytes);
    let back = local.path().join("back.bin");
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            &format!("{sbx}:{r}/in.bin"),
            back.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(read(&back), bytes);

    // Into a directory on either side, under the source's name.
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            file.to_str().unwrap(),
            &format!("{sbx}:{r}"),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(read(&remote.path().join("data.bin")), bytes);
    let into = local.path().join("into");
    std::fs::create_dir(&into).unwrap();
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            &format!("{sbx}:{r}/in.bin"),
            into.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(read(&into.join("in.bin")), bytes);

    // A tree with -r, in and out.
    let tree = local.path().join("tree");
    std::fs::create_dir_all(tree.join("a/b")).unwrap();
    std::fs::write(tree.join("a/b/deep.bin"), binary(70_000, 1)).unwrap();
    std::fs::write(tree.join("top.txt"), "top\n").unwrap();
    std::fs::write(tree.join("a/with space.txt"), "spaced\n").unwrap();
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            "-r",
            tree.to_str().unwrap(),
            &format!("{sbx}:{r}/tree"),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    assert_eq!(
        read(&remote.path().join("tree/a/b/deep.bin")),
        binary(70_000, 1)
    );
    let out = local.path().join("out");
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            "-r",
            &format!("{sbx}:{r}/tree"),
            out.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 0, "{}", run.stderr);
    for name in ["a/b/deep.bin", "top.txt", "a/with space.txt"] {
        assert_eq!(read(&out.join(name)), read(&tree.join(name)), "{name}");
    }

    // The guest's own errors, passed through with exit 1; nothing half-written locally.
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            file.to_str().unwrap(),
            &format!("{sbx}:/proc/nope/x"),
        ],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(
        run.stderr.contains("/proc/nope/x"),
        "the guest's error: {}",
        run.stderr
    );
    let missing = local.path().join("missing.bin");
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            &format!("{sbx}:{r}/no-such-file"),
            missing.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 1, "{}", run.stderr);
    assert!(run.stderr.contains("no-such-file"), "{}", run.stderr);
    assert!(!missing.exists());
    let leftovers: Vec<_> = std::fs::read_dir(local.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("vps-partial"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Usage errors, before anything is sent.
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            tree.to_str().unwrap(),
            &format!("{sbx}:{r}/t2"),
        ],
    )
    .await;
    assert_eq!(run.code, 2, "a directory needs -r: {}", run.stderr);
    let run = vps(
        &t,
        &[
            "sandboxes",
            "cp",
            file.to_str().unwrap(),
            back.to_str().unwrap(),
        ],
    )
    .await;
    assert_eq!(run.code, 2, "{}", run.stderr);
}

#[tokio::test]
async fn the_mcp_file_tools_write_and_read_text_and_bytes() {
    let b64 = data_encoding::BASE64;
    let t = TestServer::start_with(vps_tests::fast_sandboxes).await;
    let (sbx, _hosts) = sandbox(&t).await;
    let remote = tempfile::tempdir().unwrap();
    let r = remote.path().display().to_string();
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

    let text = "héllo\nwörld\n";
    let wrote = ok(
        &agent,
        "write_file",
        json!({ "sandboxId": sbx, "path": format!("{r}/note.txt"), "content": text }),
    )
    .await;
    assert_eq!(wrote["sizeBytes"], text.len());
    assert_eq!(read(&remote.path().join("note.txt")), text.as_bytes());
    let got = ok(
        &agent,
        "read_file",
        json!({ "sandboxId": sbx, "path": format!("{r}/note.txt") }),
    )
    .await;
    assert_eq!(got["encoding"], "utf8");
    assert_eq!(got["content"], text);

    let bytes = binary(50_000, 3);
    ok(
        &agent,
        "write_file",
        json!({ "sandboxId": sbx, "path": format!("{r}/blob"), "content": b64.encode(&bytes),
                "encoding": "base64" }),
    )
    .await;
    assert_eq!(read(&remote.path().join("blob")), bytes);
    let got = ok(
        &agent,
        "read_file",
        json!({ "sandboxId": sbx, "path": format!("{r}/blob") }),
    )
    .await;
    assert_eq!(
        got["encoding"], "base64",
        "bytes that are not UTF-8 come back as base64"
    );
    assert_eq!(
        b64.decode(got["content"].as_str().unwrap().as_bytes())
            .unwrap(),
        bytes
    );
    assert_eq!(got["sizeBytes"], bytes.len());

    let (failed, error) = call(
        &agent,
        "write_file",
        json!({ "sandboxId": sbx, "path": "/proc/nope/x", "content": "x" }),
    )
    .await;
    assert!(
        failed && error.starts_with("GUEST_ERROR:") && error.contains("/proc/nope/x"),
        "{error}"
    );
    let (failed, error) = call(
        &agent,
        "read_file",
        json!({ "sandboxId": sbx, "path": format!("{r}/absent") }),
    )
    .await;
    assert!(failed && error.contains("absent"), "{error}");
    let (failed, error) = call(
        &agent,
        "write_file",
        json!({ "sandboxId": sbx, "path": "x", "content": "%%", "encoding": "base64" }),
    )
    .await;
    assert!(failed && error.starts_with("INVALID_INPUT"), "{error}");
    agent.cancel().await.expect("the server stops");
}
