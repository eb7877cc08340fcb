//! A server's wake-ups of its own background loops, by name (a work-queue kind, the sandbox
//! reconciler's pass). Each server holds its own in its [`crate::Ctx`], so two servers in one
//! process (a test's replicas) never wake each other's loops; replicas hear each other through
//! PostgreSQL notifications instead.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;

/// Wake-up counters by name: a loop marks them seen before it looks, so one that comes while
/// it works is seen when it next waits. Clones share the counters.
#[derive(Clone, Default)]
pub struct Wakeups {
    names: Arc<Mutex<HashMap<String, watch::Sender<u64>>>>,
}

impl Wakeups {
    /// Wakes the loops that wait on `name`.
    pub fn wake(&self, name: &str) {
        self.with(name, |due| due.send_modify(|n| *n = n.wrapping_add(1)));
    }

    /// The wake-ups of `name`: `changed()` resolves after the next [`Wakeups::wake`] (or at
    /// once, if one came since the receiver last marked them seen).
    pub fn subscribe(&self, name: &str) -> watch::Receiver<u64> {
        self.with(name, watch::Sender::subscribe)
    }

    fn with<T>(&self, name: &str, f: impl FnOnce(&watch::Sender<u64>) -> T) -> T {
        // A panic elsewhere while holding the lock leaves the map whole: keep using it.
        let mut names = self.names.lock().unwrap_or_else(|e| e.into_inner());
        f(names
            .entry(name.to_string())
            .or_insert_with(|| watch::channel(0).0))
    }
}

impl std::fmt::Debug for Wakeups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wakeups")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_wake_up_before_the_wait_is_not_lost() {
        let wakeups = Wakeups::default();
        let mut rx = wakeups.subscribe("k");
        rx.borrow_and_update();
        wakeups.wake("k");
        tokio::time::timeout(std::time::Duration::from_secs(1), rx.changed())
            .await
            .expect("seen")
            .expect("open");
    }

    #[tokio::test]
    async fn two_sets_of_wake_ups_do_not_share_a_name() {
        let (a, b) = (Wakeups::default(), Wakeups::default());
        let mut rx = b.subscribe("k");
        rx.borrow_and_update();
        a.wake("k");
        let woken = tokio::time::timeout(std::time::Duration::from_millis(20), rx.changed()).await;
        assert!(woken.is_err(), "another server's wake-up reached this one");
    }
}
