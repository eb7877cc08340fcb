//! Bounds on what one caller can hold open in this process: server-sent event streams per
//! tenant and `nodes.spec` long-polls per node. Past a bound the answer is `RATE_LIMITED`, so
//! no tenant or host can pin the server's tasks and connections. Create and claim waits are
//! bounded per replica; past that bound a call answers at once, as a wait that timed out does.
//! A held slot is a value ([`Slot`]) that gives itself back when dropped, however its holder
//! ends.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use vps_domain::ErrorCode;

use crate::config::LimitsConfig;
use crate::error::ApiError;

/// The bounds of this process, shared by every request.
#[derive(Clone, Debug)]
pub struct Guards {
    streams: Counter,
    long_polls: Counter,
    waits: Counter,
}

/// Open holders per key, up to a bound.
#[derive(Clone, Debug)]
struct Counter {
    what: &'static str,
    max: usize,
    open: Arc<Mutex<HashMap<String, usize>>>,
    /// The gauge that counts every open holder, if any.
    gauge: Option<&'static str>,
}

/// One held place; dropping it gives it back.
#[derive(Debug)]
pub struct Slot {
    counter: Counter,
    key: String,
}

impl Guards {
    /// Bounds from `[limits]`.
    pub fn new(limits: &LimitsConfig) -> Guards {
        Guards {
            streams: Counter::new(
                "event streams open for this tenant",
                limits.sse_streams_per_tenant,
                Some("vps_sse_streams"),
            ),
            long_polls: Counter::new(
                "spec long-polls open for this node",
                limits.long_polls_per_node,
                None,
            ),
            waits: Counter::new("waits on this replica", limits.waits, Some("vps_waits")),
        }
    }

    /// A place for one more create or claim `wait` on this replica; none past `[limits] waits`.
    pub fn wait(&self) -> Option<Slot> {
        self.waits.take("replica").ok()
    }

    /// A place for one more event stream of `tenant` (operators: their identity).
    pub fn stream(&self, tenant: &str) -> Result<Slot, ApiError> {
        self.streams.take(tenant)
    }

    /// A place for one more long-poll of `node`.
    pub fn long_poll(&self, node: &str) -> Result<Slot, ApiError> {
        self.long_polls.take(node)
    }
}

impl Counter {
    fn new(what: &'static str, max: usize, gauge: Option<&'static str>) -> Counter {
        Counter {
            what,
            max,
            open: Arc::new(Mutex::new(HashMap::new())),
            gauge,
        }
    }

    fn take(&self, key: &str) -> Result<Slot, ApiError> {
        let mut open = self
            .open
            .lock()
            .expect("the counter's lock is never poisoned");
        let held = open.entry(key.to_string()).or_insert(0);
        if *held >= self.max {
            let mut error = ApiError::new(
                ErrorCode::RateLimited,
                format!("{}: at most {}; close one first", self.what, self.max),
            );
            error.details = serde_json::json!({ "max": self.max });
            return Err(error);
        }
        *held += 1;
        if let Some(gauge) = self.gauge {
            metrics::gauge!(gauge).increment(1.0);
        }
        Ok(Slot {
            counter: self.clone(),
            key: key.to_string(),
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self
            .counter
            .open
            .lock()
            .expect("the counter's lock is never poisoned");
        if let Some(held) = open.get_mut(&self.key) {
            *held -= 1;
            if *held == 0 {
                open.remove(&self.key);
            }
        }
        if let Some(gauge) = self.counter.gauge {
            metrics::gauge!(gauge).decrement(1.0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_slot_is_given_back_when_dropped() {
        let guards = Guards::new(&LimitsConfig {
            sse_streams_per_tenant: 2,
            long_polls_per_node: 1,
            waits: 1,
            ..LimitsConfig::default()
        });
        let a = guards.stream("acme").unwrap();
        let _b = guards.stream("acme").unwrap();
        assert_eq!(
            guards.stream("acme").unwrap_err().code,
            ErrorCode::RateLimited
        );
        assert!(guards.stream("globex").is_ok());
        drop(a);
        assert!(guards.stream("acme").is_ok());
        let _poll = guards.long_poll("node_1").unwrap();
        assert!(guards.long_poll("node_1").is_err());
        let wait = guards.wait().unwrap();
        assert!(guards.wait().is_none());
        drop(wait);
        assert!(guards.wait().is_some());
    }
}
