//! `vps bench snapshot`: rounds of `sandboxes.snapshot` → `ready` → `sandboxes.create
//! { fromSnapshot }` → `ready`, over HTTP on loopback against in-process emulated hosts that
//! really upload and download the objects (`--size-mib`, 64 by default) through the `file`
//! store. The baseline of the same run: the store's own PUT and GET of one object over HTTP
//! against a plain copy of the same bytes on the same disk.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::sandbox::Client;
use super::{percentile, round, HostedServer, Scratch, TENANT};

/// Knobs.
#[derive(Debug, Clone)]
pub struct SnapshotBench {
    /// Snapshot-and-restore rounds.
    pub rounds: usize,
    /// The object's size in bytes.
    pub size: usize,
}

/// Runs the baseline and the rounds and prints the figures, JSON line last.
pub async fn run(server_url: &str, options: &SnapshotBench) -> anyhow::Result<()> {
    let scratch = Scratch::create(server_url, 20).await?;
    let dir = std::env::temp_dir().join(format!("vps-bench-snapshots-{}", std::process::id()));
    let result = phases(&scratch, &dir, options).await;
    let _ = std::fs::remove_dir_all(&dir);
    scratch.drop_database().await?;
    println!("{}", serde_json::to_string(&result?)?);
    Ok(())
}

async fn phases(scratch: &Scratch, dir: &Path, o: &SnapshotBench) -> anyhow::Result<Value> {
    let (mut config, token) = super::server_config();
    config.timings.sandbox_pass = 0.2;
    config.timings.transitional_look = 0.5;
    config.snapshots.dir = Some(dir.join("store"));
    let spec = super::BenchPool {
        nodes: 2,
        node_size: 64,
        quota: 1_000_000,
    };
    let hosted = HostedServer::start(&scratch.pool, config, &spec).await?;
    let hosts = hosted.hosts(|c| {
        c.boot_delay = Duration::from_millis(20);
        c.snapshot_bytes = o.size;
    });
    let client = Client {
        http: reqwest::Client::new(),
        url: hosted.server.url(),
        token,
    };
    let rounds = rounds(&client, &hosted.pool_id, o).await;
    let store = store_baseline(&client.http, &hosted, dir, o.size).await;
    for h in hosts {
        h.stop().await;
    }
    hosted.server.shutdown().await;
    let (snap, restore) = rounds?;
    let (put, get, copy) = store?;
    let mib = o.size as f64 / f64::from(1 << 20);
    println!(
        "snapshot to ready: p50 {:.1} ms  p99 {:.1} ms; restore to ready: p50 {:.1} ms  p99 {:.1} ms ({} rounds of {mib:.0} MiB)",
        percentile(&snap, 0.5),
        percentile(&snap, 0.99),
        percentile(&restore, 0.5),
        percentile(&restore, 0.99),
        snap.len()
    );
    println!(
        "file store over HTTP: PUT {put:.0} MiB/s, GET {get:.0} MiB/s; plain file copy {copy:.0} MiB/s (PUT ratio {:.2})",
        put / copy
    );
    Ok(json!({
        "snapshot_p50_ms": round(percentile(&snap, 0.5), 1),
        "snapshot_p99_ms": round(percentile(&snap, 0.99), 1),
        "restore_p50_ms": round(percentile(&restore, 0.5), 1),
        "restore_p99_ms": round(percentile(&restore, 0.99), 1),
        "rounds": snap.len(),
        "object_mib": round(mib, 1),
        "store_put_mib_s": round(put, 0),
        "store_get_mib_s": round(get, 0),
        "file_copy_mib_s": round(copy, 0),
        "put_ratio_to_copy": round(put / copy, 2),
    }))
}

/// One source sandbox; per round a snapshot to `ready`, then a restore of it to `ready`
/// (deleted again, so the nodes never fill). Milliseconds, sorted.
async fn rounds(
    client: &Client,
    pool: &str,
    o: &SnapshotBench,
) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let template = client.template(pool, "snap", None).await?;
    let create = |key: String, from: Option<String>| {
        let mut body = json!({ "tenantId": TENANT, "templateId": template, "ttlSeconds": 3600,
                               "idempotencyKey": key, "wait": { "timeoutMs": 30000 } });
        if let Some(snapshot) = from {
            body["fromSnapshot"] = snapshot.into();
        }
        client.call("sandboxes.create", body)
    };
    let source = create("source".into(), None).await?;
    anyhow::ensure!(
        source["state"] == "ready",
        "the source sandbox is {}",
        source["state"]
    );
    let (mut snaps, mut restores) = (Vec::new(), Vec::new());
    for i in 0..o.rounds {
        let t0 = Instant::now();
        let body = json!({ "tenantId": TENANT, "sandboxId": source["id"], "keep": true });
        let snap = client.call("sandboxes.snapshot", body).await?;
        let id = snap["id"].as_str().unwrap_or_default().to_string();
        ready(client, &id).await?;
        let t1 = Instant::now();
        let restored = create(format!("restore-{i}"), Some(id.clone())).await?;
        anyhow::ensure!(
            restored["state"] == "ready",
            "restore {i} is {}",
            restored["state"]
        );
        restores.push(t1.elapsed().as_secs_f64() * 1000.0);
        snaps.push((t1 - t0).as_secs_f64() * 1000.0);
        let done = json!({ "tenantId": TENANT, "sandboxId": restored["id"] });
        client.call("sandboxes.delete", done).await?;
        let gone = json!({ "tenantId": TENANT, "snapshotId": id });
        client.call("sandboxSnapshots.delete", gone).await?;
    }
    snaps.sort_by(f64::total_cmp);
    restores.sort_by(f64::total_cmp);
    Ok((snaps, restores))
}

/// Polls a snapshot until it is `ready` (a failure ends the bench).
async fn ready(client: &Client, id: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let body = json!({ "tenantId": TENANT, "snapshotId": id });
        let s = client.call("sandboxSnapshots.get", body).await?;
        match s["state"].as_str() {
            Some("ready") => return Ok(()),
            Some("failed") => anyhow::bail!("snapshot {id} failed: {}", s["reason"]),
            _ => {}
        }
        anyhow::ensure!(Instant::now() < deadline, "snapshot {id} is still pending");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The store's PUT and GET of one object over HTTP, and a plain copy of the same bytes on
/// the same disk, in MiB/s.
async fn store_baseline(
    http: &reqwest::Client,
    hosted: &HostedServer,
    dir: &Path,
    size: usize,
) -> anyhow::Result<(f64, f64, f64)> {
    use sha2::Digest;
    let body: Vec<u8> = (0..size).map(|i| (i * 31 % 251) as u8).collect();
    let digest = data_encoding::HEXLOWER.encode(&sha2::Sha256::digest(&body));
    let mib = size as f64 / f64::from(1 << 20);
    let store = &hosted.server.state.snapshots;
    let upload = store
        .upload("bench/baseline", Duration::from_secs(300))
        .await?;
    let t0 = Instant::now();
    let put = http
        .put(&upload.url)
        .header(vps_store::SHA256_HEADER, &digest)
        .body(body.clone())
        .send()
        .await?;
    anyhow::ensure!(
        put.status().is_success(),
        "the store refused the baseline PUT"
    );
    let put_s = t0.elapsed().as_secs_f64();
    let download = store
        .download("bench/baseline", Duration::from_secs(300))
        .await?;
    let t0 = Instant::now();
    let got = http.get(&download).send().await?.bytes().await?;
    let get_s = t0.elapsed().as_secs_f64();
    anyhow::ensure!(
        got.len() == size,
        "the baseline GET answered {} bytes",
        got.len()
    );
    let (from, to) = (dir.join("copy-from"), dir.join("copy-to"));
    std::fs::write(&from, &body)?;
    let t0 = Instant::now();
    std::fs::copy(&from, &to)?;
    std::fs::File::open(&to)?.sync_all()?;
    let copy_s = t0.elapsed().as_secs_f64();
    Ok((mib / put_s, mib / get_s, mib / copy_s))
}
