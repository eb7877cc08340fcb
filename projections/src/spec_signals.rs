//! Which node's spec moved, told to the long-polls of that node alone. The NodeSpec follower
//! announces each generation it commits: at once to its own replica, and to the others by
//! `pg_notify` on [`CHANNEL`] (`node_id generation` pairs). A host's long-poll wakes only when
//! its node's generation moves, not on every commit of the deployment: with a hundred hosts
//! polling, waking each on every commit cost a generation query per host per commit.
//!
//! A signal is a hint, like the log's wake-ups: a poll still reads the generation from the
//! table, and re-reads it now and then in case a notification was lost.

use sqlx::PgPool;
use std::collections::HashMap;
use std::sync::Mutex;
use tokio::sync::watch;
use vps_events::Notifier;

/// The PostgreSQL channel generations travel on.
pub const CHANNEL: &str = "vps_node_specs";

/// Per node, the newest spec generation this replica has heard of.
#[derive(Debug, Default)]
pub struct SpecSignals {
    nodes: Mutex<HashMap<String, watch::Sender<i64>>>,
}

impl SpecSignals {
    /// `node_id`'s spec is at `generation` (or later): wakes its waiting polls.
    pub fn publish(&self, node_id: &str, generation: i64) {
        self.with_sender(node_id, |sender| {
            sender.send_if_modified(|known| {
                let newer = generation > *known;
                if newer {
                    *known = generation;
                }
                newer
            });
        });
    }

    /// A receiver that changes when `node_id`'s generation moves.
    pub fn subscribe(&self, node_id: &str) -> watch::Receiver<i64> {
        self.with_sender(node_id, |sender| sender.subscribe())
    }

    fn with_sender<T>(&self, node_id: &str, f: impl FnOnce(&watch::Sender<i64>) -> T) -> T {
        // A panic elsewhere while holding the lock leaves the map whole: keep using it.
        let mut nodes = self.nodes.lock().unwrap_or_else(|e| e.into_inner());
        let sender = nodes
            .entry(node_id.to_string())
            .or_insert_with(|| watch::channel(0).0);
        f(sender)
    }
}

/// Tells this replica at once, and the others through `pg_notify` (coalesced by the
/// notifier), the generations a committed transaction moved (a follower's pass, or a command
/// that wrote an entry inline). A lost notify only delays other replicas' polls.
pub fn announce(notifier: &Notifier, signals: &SpecSignals, moved: &[(String, i64)]) {
    for (node, generation) in moved {
        signals.publish(node, *generation);
        notifier.hint(CHANNEL, &format!("{node} {generation}"));
    }
}

fn parse(payload: &str) -> impl Iterator<Item = (&str, i64)> {
    payload.split(',').filter_map(|pair| {
        let (node, generation) = pair.split_once(' ')?;
        Some((node, generation.parse().ok()?))
    })
}

/// Publishes the generations other replicas announce, for as long as the task lives.
pub async fn listen(pool: PgPool, signals: std::sync::Arc<SpecSignals>) {
    vps_events::notify::listen_to(pool, CHANNEL, |payload| {
        for (node, generation) in parse(payload) {
            signals.publish(node, generation);
        }
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_stay_under_the_limit_and_parse_back_to_every_pair() {
        let moved: Vec<(String, i64)> = (0..1000).map(|i| (format!("node_{i:026}"), i)).collect();
        let payloads = vps_events::notify::payloads(moved.iter().map(|(n, g)| format!("{n} {g}")));
        assert!(payloads.len() > 1);
        assert!(payloads
            .iter()
            .all(|p| p.len() <= vps_events::notify::MAX_PAYLOAD));
        let back: Vec<(String, i64)> = payloads
            .iter()
            .flat_map(|p| parse(p).map(|(n, g)| (n.to_string(), g)))
            .collect();
        assert_eq!(back, moved);
    }

    #[tokio::test]
    async fn a_receiver_wakes_only_for_a_newer_generation_of_its_node() {
        let signals = SpecSignals::default();
        let mut rx = signals.subscribe("node_a");
        signals.publish("node_b", 5);
        signals.publish("node_a", 0);
        assert!(!rx.has_changed().unwrap());
        signals.publish("node_a", 3);
        assert!(rx.has_changed().unwrap());
        assert_eq!(*rx.borrow_and_update(), 3);
        signals.publish("node_a", 2);
        assert!(!rx.has_changed().unwrap());
    }
}
