//! What each entry of a report says ([`ReportedInstance`]), and a replica's memory of each
//! node's last report entries, parsed and checked, beside their text. A host sends every guest
//! in each complete report, in the same order, and nearly every entry is the text it sent the
//! time before: an entry whose text is the one at the same place in the node's last report is
//! that report's entry, not parsed and checked again. So a report of 10,000 guests that changes
//! one parses one. The entries are compared in order, not looked up: on a full host the
//! lookups' cache misses cost more than the parse they saved. A memo of a pure function of the
//! text, so never stale: a new text is parsed, an old one means what it meant.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex};

use serde::Deserialize;
use serde_json::value::RawValue;
use vps_domain::DomainError;

/// One instance as the host sees it.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReportedInstance {
    /// `inst_…`.
    pub id: String,
    /// `RUNNING`, `STOPPED`, `PAUSED`, `ERROR` or `UNSPECIFIED`.
    pub state: ReportedState,
    /// Why (errors, refusals).
    pub message: Option<String>,
    /// Addresses the guest has.
    #[schemars(length(max = 16))]
    pub addresses: Option<Vec<String>>,
    /// CPU seconds the guest has used since it started (SPEC §3.11).
    pub cpu_seconds: Option<f64>,
    /// A memory restore the host gave an SSH identity of its own (machine id, host keys): exec
    /// certificates name the instance itself from then on. Absent from older hosts.
    pub identity_rebound: Option<bool>,
}

/// A host-side instance state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "UPPERCASE")]
pub enum ReportedState {
    /// Running.
    Running,
    /// Stopped (or refused: `ResourcesExhausted:`).
    Stopped,
    /// Paused.
    Paused,
    /// Failed.
    Error,
    /// Not known yet: skipped.
    Unspecified,
}

/// By node id: the node's last report that parsed.
#[derive(Debug, Default)]
pub struct ReportEntries {
    nodes: Mutex<HashMap<String, Memo>>,
}

/// A report's `instances` text, and each entry: where its text is in it, and what it parsed to.
#[derive(Debug)]
struct Memo {
    text: Box<RawValue>,
    entries: Vec<(Range<usize>, Arc<ReportedInstance>)>,
}

impl ReportEntries {
    /// The entries of a report's `instances` (a JSON array), in order: each text that is the
    /// one at the same place in the node's last report is the entry it was then; any other is
    /// parsed and checked by `parse` (`i`: its index). What this report carried is what the
    /// next one is compared with. `INVALID_INPUT` naming `instances` when it is not an array
    /// or lists more than `max`.
    pub(crate) fn parse(
        &self,
        node_id: &str,
        text: Box<RawValue>,
        max: usize,
        parse: impl Fn(usize, &str) -> Result<ReportedInstance, DomainError>,
    ) -> Result<Vec<Arc<ReportedInstance>>, DomainError> {
        let all = text.get();
        let items: Vec<&RawValue> = serde_json::from_str(all)
            .map_err(|_| DomainError::invalid_input("instances", "an array of instances"))?;
        if items.len() > max {
            return Err(DomainError::invalid_input(
                "instances",
                format!("at most {max}"),
            ));
        }
        let last = self.take(node_id);
        let before = |i: usize| {
            let memo = last.as_ref()?;
            let (range, entry) = memo.entries.get(i)?;
            Some((&memo.text.get()[range.clone()], entry))
        };
        let mut entries = Vec::with_capacity(items.len());
        for (i, item) in items.iter().enumerate() {
            let here = item.get();
            let entry = match before(i) {
                Some((was, entry)) if was == here => Arc::clone(entry),
                _ => Arc::new(parse(i, here)?),
            };
            // Each item is a slice of `all`: its place in it.
            let start = here.as_ptr() as usize - all.as_ptr() as usize;
            entries.push((start..start + here.len(), entry));
        }
        let parsed = entries.iter().map(|(_, e)| Arc::clone(e)).collect();
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.insert(node_id.to_string(), Memo { text, entries });
        }
        Ok(parsed)
    }

    fn take(&self, node_id: &str) -> Option<Memo> {
        self.nodes.lock().ok()?.remove(node_id)
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    fn list(entries: &[&str]) -> Box<RawValue> {
        RawValue::from_string(format!("[{}]", entries.join(", "))).unwrap()
    }

    fn parse(
        parsed: &Cell<usize>,
    ) -> impl Fn(usize, &str) -> Result<ReportedInstance, DomainError> + '_ {
        move |i, text| {
            parsed.set(parsed.get() + 1);
            serde_json::from_str(text)
                .map_err(|e| DomainError::invalid_input(format!("instances[{i}]"), e.to_string()))
        }
    }

    const A: &str = r#"{"id":"inst_a","state":"RUNNING"}"#;
    const B: &str = r#"{"id":"inst_b","state":"RUNNING"}"#;
    const B2: &str = r#"{"id":"inst_b","state":"STOPPED"}"#;

    #[test]
    fn only_entries_that_differ_from_the_last_reports_are_parsed() {
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        let first = memo
            .parse("node_1", list(&[A, B]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 2);
        let second = memo
            .parse("node_1", list(&[A, B2]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "only the changed entry is parsed again");
        assert!(Arc::ptr_eq(&first[0], &second[0]));
        assert_eq!(second[1].state, ReportedState::Stopped);
        // Another node's report remembers nothing of this one's.
        memo.parse("node_2", list(&[A]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 4);
        // Compared in place: an entry that moved is parsed again, and so is `B`'s first text
        // (the memo holds the last report only).
        let moved = memo
            .parse("node_1", list(&[B, A]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 6);
        assert_eq!(
            (moved[0].id.as_str(), moved[1].id.as_str()),
            ("inst_b", "inst_a")
        );
    }

    #[test]
    fn a_refused_report_names_its_entry_or_its_list_and_keeps_nothing() {
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        let bad = r#"{"id":"inst_b","state":"BOGUS"}"#;
        let refused = memo
            .parse("node_1", list(&[A, bad]), 10, parse(&parsed))
            .unwrap_err();
        assert!(refused.to_string().contains("instances[1]"), "{refused}");
        memo.parse("node_1", list(&[A]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "nothing of the refused report was kept");
        for (text, message) in [("{}", "an array"), ("[1, 2, 3]", "at most 2")] {
            let text = RawValue::from_string(text.into()).unwrap();
            let refused = memo.parse("node_1", text, 2, parse(&parsed)).unwrap_err();
            assert!(refused.to_string().contains(message), "{refused}");
        }
    }
}
