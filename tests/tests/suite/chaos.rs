//! The chaos benchmark's short version (issue 40): 60 s of random sandbox and instance churn
//! while hosts are killed or go silent, one of two replicas is killed, NATS is down for 10 s
//! and a host refuses snapshots; then nothing is transitional, nothing leaked, replay equals
//! live, usage verifies and every event reached NATS and a webhook exactly once. It runs
//! `vps bench chaos`'s own driver with small numbers, on the test database server.

use vps_devtools::bench::chaos::{run, ChaosBench};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_seconds_of_faults_leave_nothing_stuck_leaked_or_delivered_twice() {
    vps_api::telemetry::init_logging();
    let options = ChaosBench {
        sandboxes: 40,
        instances: 20,
        seconds: 60.0,
        workers: 4,
        hosts: 3,
        deadline: 10.0,
    };
    let outcome = run(&vps_pg::testing::server_url(), &options)
        .await
        .expect("the chaos run completes");
    assert!(
        outcome.faults >= 5,
        "every kind of fault struck: {outcome:?}"
    );
    assert!(outcome.operations > 0, "{outcome:?}");
    assert_eq!(outcome.transitional, 0, "{outcome:?}");
    assert_eq!(outcome.leaked, 0, "{outcome:?}");
    assert!(outcome.replay_equal, "{outcome:?}");
    assert!(outcome.usage_verified, "{outcome:?}");
    assert!(outcome.delivered_once, "{outcome:?}");
}
