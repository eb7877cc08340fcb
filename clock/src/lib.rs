//! The one place that reads the wall clock. Commands, reactors and the hosts ask a [`Clock`]
//! for the time instead of calling `Utc::now()`, so a test can move time forward instead of
//! sleeping: production runs on [`Clock::system`], tests on a [`ManualClock`] they advance.
//!
//! A manual clock runs with the system clock, ahead by what the test advanced it. It never
//! runs behind the database's `now()`, which stamps the log (`recorded_at`) and fences
//! leases, so times read from both keep their order; moving it only brings what is due
//! sooner.
//!
//! This crate depends on nothing of the workspace: the server and the host agents use it.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, TimeDelta, Utc};
use tokio::sync::Notify;

/// Where the time comes from. Cheap to clone: clones share one source.
#[derive(Clone, Default)]
pub struct Clock {
    manual: Option<ManualClock>,
}

impl Clock {
    /// The system's clock.
    pub fn system() -> Clock {
        Clock { manual: None }
    }

    /// The current time.
    pub fn now(&self) -> DateTime<Utc> {
        match &self.manual {
            None => Utc::now(),
            Some(manual) => manual.now(),
        }
    }

    /// Resolves when the clock is moved (a manual clock's [`ManualClock::advance`] or
    /// [`ManualClock::set`]); never for the system clock. Loops that wait for something to
    /// fall due wait on this too, so a test that moves time does not wait for their timers.
    pub async fn moved(&self) {
        match &self.manual {
            None => std::future::pending().await,
            Some(manual) => manual.shared.moved.notified().await,
        }
    }
}

impl std::fmt::Debug for Clock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.manual {
            None => f.write_str("Clock::system"),
            Some(manual) => write!(f, "Clock::manual({})", manual.now()),
        }
    }
}

impl From<ManualClock> for Clock {
    fn from(manual: ManualClock) -> Clock {
        Clock {
            manual: Some(manual),
        }
    }
}

/// A clock a test moves. It starts at the system's time and runs with it, ahead by what was
/// advanced. Clones share one clock.
#[derive(Clone, Default)]
pub struct ManualClock {
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    /// How far ahead of the system clock this clock is.
    ahead: Mutex<TimeDelta>,
    moved: Notify,
}

impl ManualClock {
    /// A clock at the system's time.
    pub fn new() -> ManualClock {
        ManualClock::default()
    }

    /// The current time: the system's, plus what was advanced.
    pub fn now(&self) -> DateTime<Utc> {
        Utc::now() + self.ahead()
    }

    /// Moves the clock forward by `by`, and wakes whatever waits on [`Clock::moved`].
    pub fn advance(&self, by: Duration) {
        let by = TimeDelta::from_std(by).unwrap_or(TimeDelta::MAX);
        self.shift(|ahead| ahead.checked_add(&by).unwrap_or(TimeDelta::MAX));
    }

    /// Sets the clock to `at` (from there it runs on), and wakes whatever waits on
    /// [`Clock::moved`]. A time before the database's `now()` can put the clock behind the log.
    pub fn set(&self, at: DateTime<Utc>) {
        self.shift(|_| at - Utc::now());
    }

    /// This clock as the [`Clock`] the server and hosts take.
    pub fn clock(&self) -> Clock {
        Clock::from(self.clone())
    }

    fn ahead(&self) -> TimeDelta {
        // A panic while holding the lock leaves a whole value: keep using it.
        *self.shared.ahead.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn shift(&self, f: impl FnOnce(TimeDelta) -> TimeDelta) {
        {
            let mut ahead = self.shared.ahead.lock().unwrap_or_else(|e| e.into_inner());
            *ahead = f(*ahead);
        }
        self.shared.moved.notify_waiters();
    }
}

impl std::fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ManualClock({})", self.now())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_advanced_clock_is_ahead_by_what_was_advanced() {
        let manual = ManualClock::new();
        let clock = manual.clock();
        manual.advance(Duration::from_secs(3600));
        let ahead = clock.now() - Utc::now();
        assert!(ahead > TimeDelta::seconds(3599) && ahead <= TimeDelta::seconds(3600));
    }

    #[test]
    fn a_set_clock_reads_the_time_it_was_set_to() {
        let manual = ManualClock::new();
        let at = Utc::now() + TimeDelta::days(2);
        manual.set(at);
        let read = manual.now();
        assert!(read >= at && read - at < TimeDelta::seconds(1));
    }

    #[test]
    fn the_system_clock_reads_the_system_time() {
        let before = Utc::now();
        let now = Clock::system().now();
        assert!(now >= before && now - before < TimeDelta::seconds(1));
    }

    #[tokio::test]
    async fn moving_a_manual_clock_wakes_its_waiters() {
        let manual = ManualClock::new();
        let clock = manual.clock();
        let waiter = tokio::spawn(async move { clock.moved().await });
        // Let the waiter register before the move.
        tokio::task::yield_now().await;
        tokio::time::sleep(Duration::from_millis(20)).await;
        manual.advance(Duration::from_secs(1));
        tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .expect("woken")
            .expect("no panic");
    }

    #[tokio::test]
    async fn the_system_clock_is_never_moved() {
        let moved = tokio::time::timeout(Duration::from_millis(20), Clock::system().moved()).await;
        assert!(moved.is_err());
    }
}
