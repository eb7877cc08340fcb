//! The embedded cluster: initialised once, started, data kept across a stop and a start.

use sqlx::{Connection, Executor, PgConnection};
use vps_pg::{EmbeddedCluster, EmbeddedOptions};

#[tokio::test]
async fn an_embedded_cluster_keeps_its_data_across_restarts_and_stops_on_drop() {
    // Under the temp dir: the cluster's user (postgres, when root runs the tests) must reach
    // it, whatever folder the checkout is in.
    let dir = std::env::temp_dir().join(format!(
        "vps-embedded-{}",
        ulid::Ulid::generate().to_string().to_lowercase()
    ));
    let options = EmbeddedOptions {
        data_dir: dir.clone(),
        throwaway: true,
    };

    let cluster = tokio::task::spawn_blocking({
        let options = options.clone();
        move || EmbeddedCluster::start(&options)
    })
    .await
    .unwrap()
    .expect("the machine's PostgreSQL binaries start a cluster");
    let url = cluster.url();
    let mut conn = PgConnection::connect(&url).await.unwrap();
    conn.execute("CREATE TABLE kept (n int); INSERT INTO kept VALUES (42)")
        .await
        .unwrap();
    conn.close().await.unwrap();
    tokio::task::spawn_blocking(move || drop(cluster))
        .await
        .unwrap();
    assert!(
        PgConnection::connect(&url).await.is_err(),
        "dropping the handle stops the server"
    );

    let again = tokio::task::spawn_blocking(move || EmbeddedCluster::start(&options))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(again.url(), url, "the same port, from the same directory");
    let mut conn = PgConnection::connect(&again.url()).await.unwrap();
    let n: i32 = sqlx::query_scalar("SELECT n FROM kept")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(n, 42);
    conn.close().await.unwrap();
    tokio::task::spawn_blocking(move || drop(again))
        .await
        .unwrap();
    let _ = std::fs::remove_dir_all(dir);
}
