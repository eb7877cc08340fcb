//! Background parts run supervised: a part that fails, or panics, is logged, counted and
//! restarted with a capped backoff, so no bug in one reactor pass can silently end a reactor
//! for the life of the process.

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use futures::FutureExt;
use tokio::task::JoinHandle;

/// The first wait before a restart; it doubles up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// The longest wait before a restart.
const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// A part that ran this long before it failed starts the backoff over: its failure is a new
/// one, not the last one repeating (else, after a few failures over days, every restart of a
/// follower would wait the longest backoff, and its subscribers with it).
const HEALTHY_RUN: Duration = Duration::from_secs(60);

/// Runs a background part until it returns `Ok`, restarting it with a capped backoff when it
/// fails or panics. Failures count in `vps_background_failures_total{part}`, panics in
/// `vps_task_panics_total{part}`.
pub fn supervise<F, Fut, E>(name: &'static str, part: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    tokio::spawn(async move {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let started = tokio::time::Instant::now();
            // The part is not used again after a panic: a fresh one is built for the restart.
            match AssertUnwindSafe(part()).catch_unwind().await {
                Ok(Ok(())) => return,
                Ok(Err(e)) => {
                    metrics::counter!("vps_background_failures_total", "part" => name).increment(1);
                    tracing::warn!(part = name, error = %e, retry_in = ?backoff, "background part failed");
                }
                Err(panic) => {
                    metrics::counter!("vps_task_panics_total", "part" => name).increment(1);
                    tracing::error!(part = name, panic = %panic_message(&*panic), retry_in = ?backoff,
                        "background part panicked; restarting it");
                }
            }
            if started.elapsed() >= HEALTHY_RUN {
                backoff = FIRST_BACKOFF;
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    })
}

/// Like [`supervise`], for a part that handles its own errors: it is restarted only after a
/// panic.
pub fn supervise_infallible<F, Fut>(name: &'static str, part: F) -> JoinHandle<()>
where
    F: Fn() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    supervise(name, move || part().map(Ok::<(), std::convert::Infallible>))
}

/// The text a panic was raised with, when it has one.
pub fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    use super::*;

    #[tokio::test]
    async fn a_part_that_panics_is_restarted_and_counted() {
        crate::telemetry::metrics_handle();
        let runs = Arc::new(AtomicUsize::new(0));
        let counted = runs.clone();
        let task = supervise("test-panicking-part", move || {
            let run = counted.fetch_add(1, Ordering::SeqCst);
            async move {
                if run < 2 {
                    panic!("a bug in pass {run}");
                }
                Ok::<(), String>(())
            }
        });
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("restarted until it returned")
            .expect("the supervisor itself never panics");
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        let metrics = crate::telemetry::metrics_handle().render();
        assert!(
            metrics.contains("vps_task_panics_total{part=\"test-panicking-part\"} 2"),
            "{metrics}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_part_that_failed_after_a_long_run_is_restarted_after_the_first_backoff() {
        let starts = Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = starts.clone();
        let task = supervise("test-failing-part", move || {
            let mut starts = seen.lock().unwrap();
            starts.push(tokio::time::Instant::now());
            let run = starts.len();
            async move {
                match run {
                    1..=3 => Err("failed at once"),
                    4 => {
                        tokio::time::sleep(HEALTHY_RUN).await;
                        Err("failed after a long run")
                    }
                    _ => Ok(()),
                }
            }
        });
        task.await.unwrap();
        let starts = starts.lock().unwrap();
        let gaps: Vec<Duration> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        let ms = Duration::from_millis;
        // Doubling while it fails at once; back to the first backoff after the long run.
        let expected = [ms(200), ms(400), ms(800), HEALTHY_RUN + ms(200)];
        assert_eq!(gaps, expected);
    }
}
