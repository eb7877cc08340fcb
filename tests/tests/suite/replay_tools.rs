//! `vps replay --verify` and `vps bench replay` as an operator runs them: the `vps` binary
//! built beside the test binaries (`cargo build -p vps`).

use serde_json::{json, Value};
use vps_tests::{TestServer, ALICE, SSH_KEY};

/// Runs the `vps` binary with the database at `database_url`; exit code, stdout, stderr.
async fn vps(database_url: &str, args: &[&str]) -> (i32, String, String) {
    let exe = std::env::current_exe().unwrap();
    let binary = exe
        .parent()
        .and_then(|deps| deps.parent())
        .map(|dir| dir.join("vps"))
        .filter(|b| b.exists())
        .expect("the vps binary beside the test binaries: `cargo build -p vps` first");
    let output = tokio::process::Command::new(binary)
        .args(args)
        .env("VPS_DATABASE_URL", database_url)
        .env_remove("VPS_NATS_URL")
        .env_remove("VPS_CONFIG")
        .env("RUST_LOG", "off")
        .output()
        .await
        .expect("vps runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    eprintln!("{stdout}{stderr}");
    (output.status.code().unwrap_or(-1), stdout, stderr)
}

/// This server's database URL.
async fn database_url(t: &TestServer) -> String {
    let name: String = sqlx::query_scalar("SELECT current_database()")
        .fetch_one(&t.server.state.pool)
        .await
        .unwrap();
    vps_pg::connect::with_database(&vps_pg::testing::server_url(), &name)
}

/// A replay equal to the live tables exits 0 and leaves no scratch schema (and sweeps one an
/// interrupted run left); an event altered behind the triggers is named by its position.
#[tokio::test]
async fn a_replay_sweeps_leftovers_and_names_the_first_altered_event() {
    let t = TestServer::start().await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/28",
            1,
            json!({ "vcpu": 8, "memoryGiB": 64, "diskGiB": 500 }),
        )
        .await;
    for key in ["a", "b"] {
        t.ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
                    "imageId": "img_ubuntu", "sshKeys": [SSH_KEY], "idempotencyKey": key }),
        )
        .await;
    }
    t.quiescent().await;
    let db = &t.server.state.pool;
    for sql in [
        "CREATE SCHEMA replay_999999",
        "CREATE TABLE replay_999999.instances (id text)",
    ] {
        sqlx::query(sql).execute(db).await.unwrap();
    }
    let url = database_url(&t).await;
    let (code, stdout, _) = vps(&url, &["replay", "--verify"]).await;
    assert_eq!(code, 0);
    assert!(stdout.contains("projections equal the log"), "{stdout}");
    assert!(stdout.contains("chain intact"), "{stdout}");
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'replay\\_%'")
            .fetch_one(db)
            .await
            .unwrap();
    assert_eq!(left, 0, "no scratch schema is left behind");

    // The run recorded its checkpoint; a run from it replays what changed since.
    let position: i64 = stdout
        .split("checkpoint recorded: position ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|p| p.parse().ok())
        .expect("a checkpoint recorded");
    let c = t
        .ok(
            ALICE,
            "instances.create",
            json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
                    "imageId": "img_ubuntu", "sshKeys": [SSH_KEY], "idempotencyKey": "c" }),
        )
        .await;
    t.quiescent().await;
    let from = position.to_string();
    let (code, stdout, _) = vps(&url, &["replay", "--verify", "--from", &from]).await;
    assert_eq!(code, 0);
    assert!(stdout.contains("not compared: "), "{stdout}");
    sqlx::query("UPDATE instances SET desired_state = 'stopped' WHERE id = $1")
        .bind(c["id"].as_str().unwrap())
        .execute(db)
        .await
        .unwrap();
    let (code, _, stderr) = vps(&url, &["replay", "--verify", "--from", &from]).await;
    assert_eq!(code, 1);
    assert!(stderr.contains("table instances differs"), "{stderr}");
    let (code, _, stderr) = vps(&url, &["replay", "--verify", "--from", "1"]).await;
    assert_eq!(code, 2, "an error, not a difference");
    assert!(
        stderr.contains("no verified checkpoint at position 1"),
        "{stderr}"
    );

    // The metadata alone: the projections still equal the log, the chain does not.
    let position: i64 = sqlx::query_scalar(
        "SELECT position FROM events WHERE type = 'instance.created' ORDER BY position LIMIT 1",
    )
    .fetch_one(db)
    .await
    .unwrap();
    sqlx::query("ALTER TABLE events DISABLE TRIGGER events_append_only")
        .execute(db)
        .await
        .unwrap();
    sqlx::query("UPDATE events SET metadata = metadata || '{\"actor\": \"id_mallory\"}' WHERE position = $1")
        .bind(position)
        .execute(db)
        .await
        .unwrap();
    let (code, _, stderr) = vps(&url, &["replay", "--verify"]).await;
    assert_eq!(code, 1);
    assert!(
        stderr.contains(&format!("chain BROKEN at position {position} ")),
        "{stderr}"
    );
}

/// `url` on connections that refuse every write, as a read replica's do.
fn read_only(url: &str) -> String {
    let join = if url.contains('?') { '&' } else { '?' };
    format!("{url}{join}options=-c%20default_transaction_read_only%3Don")
}

/// `vps replay --verify --scratch-database-url` reads the log and the live tables only (here
/// through connections that refuse every write, as a read replica's do) and builds the
/// rebuild in another database: equal projections pass, a planted difference is named by its
/// row on each side, and the scratch database keeps no scratch schema.
#[tokio::test]
async fn a_replay_reads_a_replica_builds_elsewhere_and_names_a_planted_difference() {
    let t = TestServer::start().await;
    let pool = t
        .hosted_pool(
            "10.0.0.0/28",
            1,
            json!({ "vcpu": 8, "memoryGiB": 64, "diskGiB": 500 }),
        )
        .await;
    let mut ids = Vec::new();
    for key in ["a", "b"] {
        let created = t
            .ok(
                ALICE,
                "instances.create",
                json!({ "tenantId": "acme", "poolId": pool, "flavor": "small",
                        "imageId": "img_ubuntu", "sshKeys": [SSH_KEY], "idempotencyKey": key }),
            )
            .await;
        ids.push(created["id"].as_str().unwrap().to_string());
    }
    t.quiescent().await;
    let replica = read_only(&database_url(&t).await);
    let mut probe = <sqlx::PgConnection as sqlx::Connection>::connect(&replica)
        .await
        .unwrap();
    let refused = sqlx::query("UPDATE instances SET desired_state = desired_state")
        .execute(&mut probe)
        .await
        .unwrap_err();
    assert!(
        refused.to_string().contains("read-only transaction"),
        "{refused}"
    );
    let scratch = vps_pg::testing::fresh_database().await;
    let args = ["replay", "--verify", "--scratch-database-url", &*scratch];
    let (code, stdout, stderr) = vps(&replica, &args).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(stdout.contains("projections equal the log"), "{stdout}");
    assert!(stdout.contains("chain intact"), "{stdout}");
    assert!(
        stderr.contains("the checkpoint was not recorded"),
        "a replica takes no append: {stderr}"
    );

    sqlx::query("UPDATE instances SET desired_state = 'stopped' WHERE id = $1")
        .bind(&ids[0])
        .execute(&t.server.state.pool)
        .await
        .unwrap();
    let (code, _, stderr) = vps(&replica, &args).await;
    assert_eq!(code, 1, "{stderr}");
    assert!(stderr.contains("table instances differs"), "{stderr}");
    let named = |side: &str| {
        stderr
            .lines()
            .filter(|l| l.trim_start().starts_with(side))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let (only_live, only_rebuilt) = (named("only live:"), named("only rebuilt:"));
    assert_eq!(only_live.len(), 1, "{stderr}");
    assert_eq!(only_rebuilt.len(), 1, "{stderr}");
    assert!(
        only_live[0].contains(&ids[0]) && only_live[0].contains("\"stopped\""),
        "{stderr}"
    );
    assert!(only_rebuilt[0].contains(&ids[0]), "{stderr}");
    assert!(
        !stderr.contains(&ids[1]),
        "the equal row is not named: {stderr}"
    );

    let mut scratch_db = <sqlx::PgConnection as sqlx::Connection>::connect(&scratch)
        .await
        .unwrap();
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_namespace WHERE nspname LIKE 'replay\\_%'")
            .fetch_one(&mut scratch_db)
            .await
            .unwrap();
    assert_eq!(left, 0, "no scratch schema is left behind");
}

/// `vps bench replay` at a small size: the replay finds the projections equal, the chain
/// intact, and the JSON line (last) carries every figure.
#[tokio::test]
async fn the_replay_bench_runs_small_and_reports_every_figure() {
    let url = vps_pg::testing::server_url();
    let (code, stdout, _) = vps(&url, &["bench", "replay", "--events", "20000"]).await;
    assert_eq!(code, 0);
    let line: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    for field in [
        "events",
        "replay_seconds",
        "replay_events_per_s",
        "audit_events_per_s",
        "follow_events_per_s",
        "replay_ratio",
    ] {
        assert!(
            line[field].as_f64().is_some_and(|v| v > 0.0),
            "{field}: {line}"
        );
    }
    assert!(line["events"].as_u64().unwrap() >= 20_000);
    assert_eq!(line["equal"], true);
    assert_eq!(line["chain_intact"], true);
}
