//! What each entry of a report says ([`ReportedInstance`]), and a replica's memory of each
//! node's last report, parsed and checked, beside its text. A host sends every guest in each
//! complete report, in the same order, and nearly all of the text is what it sent the time
//! before. So a report is compared with the node's last one byte for byte, from the front and
//! from the back, and only the entries between the common prefix and the common suffix are
//! split, parsed and checked: a report of 10,000 guests that changes one reads one entry, and
//! the rest of it is two `memcmp`s. What changed is said ([`Edit`]), so the report's pass can
//! keep what it found of the other entries (see `report_verdicts`). A memo of a pure function
//! of the text, so never stale: a new text is parsed, an old one means what it meant.
//!
//! Why the suffix can be trusted: JSON is read left to right, so the common prefix reads as it
//! did before. The bytes between (the edit) are parsed on their own, between two stand-in
//! neighbours; that they parse, ending where the first entry of the common suffix begins,
//! shows the reader is at the same point there as it was in the last report (about to read an
//! entry), and from there the same bytes read the same. When they do not parse, the whole list
//! is split as if there were no memo.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
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
    nodes: Mutex<HashMap<String, Arc<Memo>>>,
    /// The number of the last report parsed on this replica.
    last_seq: AtomicU64,
}

/// A report's `instances`: its text, and each entry's place in it and what it parsed to.
#[derive(Debug)]
pub struct Memo {
    /// Numbers the report among those parsed on this replica.
    pub(crate) seq: u64,
    /// How it differs from the report it was compared with; `None`: it was read whole.
    pub(crate) edit: Option<Edit>,
    text: Box<RawValue>,
    places: Vec<Range<usize>>,
    entries: Vec<ReportedInstance>,
}

/// How a report differs from the last one: the last one's entries at
/// `at..at + removed.len()` are replaced by `inserted` entries; every other entry is the one
/// it was (those after the edit moved by `inserted - removed.len()` places).
#[derive(Debug)]
pub struct Edit {
    /// The report compared with ([`Memo::seq`]).
    pub(crate) based_on: u64,
    /// Where the edit starts.
    pub(crate) at: usize,
    /// The ids of the entries it replaced.
    pub(crate) removed: Vec<String>,
    /// How many entries it put in their place.
    pub(crate) inserted: usize,
}

impl Memo {
    /// The report's entries, in order.
    pub(crate) fn entries(&self) -> &[ReportedInstance] {
        &self.entries
    }
}

impl ReportEntries {
    /// The entries of a report's `instances` (a JSON array): only the ones between the text it
    /// shares with the node's last report at its start and at its end are parsed and checked
    /// by `parse` (`i`: the entry's index), unless the last report is unknown here. What this
    /// report carried is what the next one is compared with. `INVALID_INPUT` naming
    /// `instances` when it is not an array or lists more than `max`.
    pub(crate) fn parse(
        &self,
        node_id: &str,
        text: Box<RawValue>,
        max: usize,
        parse: impl Fn(usize, &str) -> Result<ReportedInstance, DomainError>,
    ) -> Result<Arc<Memo>, DomainError> {
        let seq = self.last_seq.fetch_add(1, Ordering::Relaxed) + 1;
        // Unless another report of the node still reads it (then this one is read whole).
        let last = self
            .take(node_id)
            .and_then(|memo| Arc::try_unwrap(memo).ok());
        let memo = match last.and_then(|last| span(&last, text.get()).map(|span| (last, span))) {
            Some((last, span)) => edited(last, span, text, seq, max, &parse)?,
            None => whole(text, seq, max, &parse)?,
        };
        let memo = Arc::new(memo);
        if let Ok(mut nodes) = self.nodes.lock() {
            nodes.insert(node_id.to_string(), Arc::clone(&memo));
        }
        Ok(memo)
    }

    fn take(&self, node_id: &str) -> Option<Arc<Memo>> {
        self.nodes.lock().ok()?.remove(node_id)
    }
}

fn too_many(max: usize) -> DomainError {
    DomainError::invalid_input("instances", format!("at most {max}"))
}

/// Splits and parses the whole list.
fn whole(
    text: Box<RawValue>,
    seq: u64,
    max: usize,
    parse: &impl Fn(usize, &str) -> Result<ReportedInstance, DomainError>,
) -> Result<Memo, DomainError> {
    let all = text.get();
    let items: Vec<&RawValue> = serde_json::from_str(all)
        .map_err(|_| DomainError::invalid_input("instances", "an array of instances"))?;
    if items.len() > max {
        return Err(too_many(max));
    }
    let mut places = Vec::with_capacity(items.len());
    let mut entries = Vec::with_capacity(items.len());
    for (i, item) in items.iter().enumerate() {
        let here = item.get();
        entries.push(parse(i, here)?);
        // Each item is a slice of `all`: its place in it.
        let start = here.as_ptr() as usize - all.as_ptr() as usize;
        places.push(start..start + here.len());
    }
    drop(items);
    Ok(Memo {
        seq,
        edit: None,
        text,
        places,
        entries,
    })
}

/// Where a new text differs from the last report's: its entries `first..end` are replaced by
/// the entries at `places` of the new text, and the entries after them moved by `shift` bytes.
#[derive(Debug, PartialEq)]
struct Span {
    first: usize,
    end: usize,
    places: Vec<Range<usize>>,
    shift: isize,
}

/// The span of `new` that differs from `last`'s text, or `None` when its bytes do not read as
/// entries on their own (see the module's comment).
fn span(last: &Memo, new: &str) -> Option<Span> {
    let (old, bytes) = (last.text.get().as_bytes(), new.as_bytes());
    if old == bytes {
        return Some(Span {
            first: 0,
            end: 0,
            places: Vec::new(),
            shift: 0,
        });
    }
    let prefix = common_prefix(old, bytes);
    // The suffix is found on its own first: it may overlap the prefix (`[A, B]` to
    // `[A, C, B]` shares `B`'s `"id":"inst_` at both ends). Only when that leaves the edit
    // nothing to stand on is it cut to what follows the prefix.
    let whole_suffix = common_suffix(old, bytes);
    let cut_suffix = whole_suffix.min(old.len().min(bytes.len()) - prefix);
    // Both are arrays (`[` and `]` are shared), or the new one is read whole.
    if prefix == 0 || cut_suffix == 0 || bytes.first() != Some(&b'[') {
        return None;
    }
    let shift = bytes.len() as isize - old.len() as isize;
    let first = last.places.partition_point(|r| r.end <= prefix);
    // The edit's bytes: from the end of the last entry before it (or the `[`) to the start of
    // the first entry after it (or the `]`).
    let from = match first {
        0 => 1,
        _ => last.places[first - 1].end,
    };
    let (end, to) = [whole_suffix, cut_suffix].into_iter().find_map(|suffix| {
        let end = last
            .places
            .partition_point(|r| r.start < old.len() - suffix);
        let to = match last.places.get(end) {
            Some(next) => next.start.checked_add_signed(shift)?,
            None => bytes.len() - 1,
        };
        (end >= first && to >= from).then_some((end, to))
    })?;
    // Entries are objects: `{}` stands in for the neighbours.
    let before = if first > 0 { "{}" } else { "" };
    let after = if end < last.places.len() { "{}" } else { "" };
    let wrapped = format!("[{before}{}{after}]", new.get(from..to)?);
    let items: Vec<&RawValue> = serde_json::from_str(&wrapped).ok()?;
    let skip = usize::from(first > 0);
    let inner = items.get(
        skip..items
            .len()
            .checked_sub(usize::from(end < last.places.len()))?,
    )?;
    let base = wrapped.as_ptr() as usize + 1 + before.len();
    let places = inner
        .iter()
        .map(|item| {
            let start = item.get().as_ptr() as usize - base + from;
            start..start + item.get().len()
        })
        .collect();
    Some(Span {
        first,
        end,
        places,
        shift,
    })
}

/// The last report with `span` of it replaced by the new text's entries there.
fn edited(
    mut last: Memo,
    span: Span,
    text: Box<RawValue>,
    seq: u64,
    max: usize,
    parse: &impl Fn(usize, &str) -> Result<ReportedInstance, DomainError>,
) -> Result<Memo, DomainError> {
    let Span {
        first,
        end,
        places,
        shift,
    } = span;
    if last.entries.len() - (end - first) + places.len() > max {
        return Err(too_many(max));
    }
    let new = text.get();
    let parsed = places
        .iter()
        .enumerate()
        .map(|(j, place)| parse(first + j, &new[place.clone()]))
        .collect::<Result<Vec<_>, _>>()?;
    let inserted = parsed.len();
    let removed = last
        .entries
        .splice(first..end, parsed)
        .map(|entry| entry.id)
        .collect();
    last.places.splice(first..end, places);
    if shift != 0 {
        for place in &mut last.places[first + inserted..] {
            *place = place.start.wrapping_add_signed(shift)..place.end.wrapping_add_signed(shift);
        }
    }
    Ok(Memo {
        seq,
        edit: Some(Edit {
            based_on: last.seq,
            at: first,
            removed,
            inserted,
        }),
        text,
        places: last.places,
        entries: last.entries,
    })
}

/// Compared a block at a time: each block is one `memcmp`.
const BLOCK: usize = 256;

fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let len = a.len().min(b.len());
    let mut at = 0;
    while at + BLOCK <= len && a[at..at + BLOCK] == b[at..at + BLOCK] {
        at += BLOCK;
    }
    at + a[at..len]
        .iter()
        .zip(&b[at..len])
        .take_while(|(x, y)| x == y)
        .count()
}

fn common_suffix(a: &[u8], b: &[u8]) -> usize {
    let len = a.len().min(b.len());
    let (a, b) = (&a[a.len() - len..], &b[b.len() - len..]);
    let mut n = 0;
    while n + BLOCK <= len && a[len - n - BLOCK..len - n] == b[len - n - BLOCK..len - n] {
        n += BLOCK;
    }
    n + a[..len - n]
        .iter()
        .rev()
        .zip(b[..len - n].iter().rev())
        .take_while(|(x, y)| x == y)
        .count()
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

    fn ids(memo: &Memo) -> Vec<&str> {
        memo.entries().iter().map(|e| e.id.as_str()).collect()
    }

    /// Each entry's place holds the text of that entry.
    fn placed_right(memo: &Memo) {
        for (place, entry) in memo.places.iter().zip(memo.entries()) {
            let text: ReportedInstance =
                serde_json::from_str(&memo.text.get()[place.clone()]).unwrap();
            assert_eq!(text.id, entry.id);
            assert_eq!(text.state, entry.state);
        }
    }

    const A: &str = r#"{"id":"inst_a","state":"RUNNING"}"#;
    const B: &str = r#"{"id":"inst_b","state":"RUNNING"}"#;
    const B2: &str = r#"{"id":"inst_b","state":"STOPPED"}"#;
    const C: &str = r#"{"id":"inst_c","state":"RUNNING","addresses":["10.0.0.3"]}"#;

    #[test]
    fn only_the_entries_that_differ_from_the_last_report_are_parsed() {
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        let first = memo
            .parse("node_1", list(&[A, B]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 2);
        assert!(first.edit.is_none(), "the first report is read whole");
        drop(first);

        let changed = memo
            .parse("node_1", list(&[A, B2]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "only the changed entry is parsed again");
        let edit = changed.edit.as_ref().unwrap();
        assert_eq!((edit.at, edit.inserted), (1, 1));
        assert_eq!(edit.removed, ["inst_b"]);
        assert_eq!(changed.entries()[1].state, ReportedState::Stopped);
        placed_right(&changed);
        let seq = changed.seq;
        drop(changed);

        let same = memo
            .parse("node_1", list(&[A, B2]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "an unchanged report parses nothing");
        let edit = same.edit.as_ref().unwrap();
        assert_eq!(
            (edit.based_on, edit.inserted, edit.removed.len()),
            (seq, 0, 0)
        );
        drop(same);

        // Another node's report remembers nothing of this one's.
        drop(
            memo.parse("node_2", list(&[A]), 10, parse(&parsed))
                .unwrap(),
        );
        assert_eq!(parsed.get(), 4);
    }

    #[test]
    fn a_guest_that_comes_or_goes_in_the_middle_is_the_whole_edit() {
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        drop(
            memo.parse("node_1", list(&[A, B]), 10, parse(&parsed))
                .unwrap(),
        );
        let grown = memo
            .parse("node_1", list(&[A, C, B]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "only the new entry is parsed");
        assert_eq!(ids(&grown), ["inst_a", "inst_c", "inst_b"]);
        let edit = grown.edit.as_ref().unwrap();
        assert_eq!((edit.at, edit.inserted, edit.removed.len()), (1, 1, 0));
        placed_right(&grown);
        drop(grown);
        let shrunk = memo
            .parse("node_1", list(&[A, B]), 10, parse(&parsed))
            .unwrap();
        assert_eq!(parsed.get(), 3, "a guest gone parses nothing");
        assert_eq!(shrunk.edit.as_ref().unwrap().removed, ["inst_c"]);
        assert_eq!(ids(&shrunk), ["inst_a", "inst_b"]);
        placed_right(&shrunk);
    }

    #[test]
    fn edits_anywhere_keep_every_entry_and_its_place() {
        // Edits of every kind at every place, checked against a whole read of the same text.
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        let entry = |id: u32, n: u32| {
            let state = ["RUNNING", "STOPPED", "PAUSED"][(n % 3) as usize];
            let cpu = if n.is_multiple_of(2) {
                String::new()
            } else {
                format!(",\"cpuSeconds\":{n}.5")
            };
            format!(r#"{{"id":"inst_{id}","state":"{state}"{cpu}}}"#)
        };
        let mut current: Vec<(u32, u32)> = (0..8).map(|id| (id, 0)).collect();
        let mut seed = 7u32;
        let mut next = |bound: u32| {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (seed >> 16) % bound
        };
        let mut fresh = 100;
        for round in 0..300 {
            let at = next(current.len() as u32 + 1) as usize;
            match next(4) {
                0 if at < current.len() => current[at].1 += 1 + next(5),
                1 => {
                    fresh += 1;
                    current.insert(at, (fresh, round));
                }
                2 if at < current.len() && current.len() > 1 => {
                    current.remove(at);
                }
                _ => {}
            }
            let texts: Vec<String> = current.iter().map(|&(id, n)| entry(id, n)).collect();
            let texts: Vec<&str> = texts.iter().map(String::as_str).collect();
            let memo = memo
                .parse("node_1", list(&texts), 100, parse(&parsed))
                .unwrap();
            let want: Vec<String> = current.iter().map(|(id, _)| format!("inst_{id}")).collect();
            assert_eq!(ids(&memo), want, "round {round}");
            placed_right(&memo);
        }
        assert!(
            parsed.get() < 8 + 300 * 2,
            "{} entries parsed",
            parsed.get()
        );
    }

    #[test]
    fn bytes_that_do_not_read_as_entries_between_their_neighbours_are_not_an_edit() {
        let memo = ReportEntries::default();
        let parsed = Cell::new(0);
        let last = memo
            .parse("node_1", list(&[A, B]), 10, parse(&parsed))
            .unwrap();
        // Not valid as a whole either: the report's parse refuses such a text before it gets
        // here, and the memo reads a text it cannot place whole.
        let new = format!("[{A}, 1 2, {B}]");
        assert_eq!(span(&last, &new), None);
        let new = format!("[{A}, {B}]");
        assert_eq!(
            span(&last, &new).unwrap().places,
            Vec::<Range<usize>>::new()
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
        drop(
            memo.parse("node_1", list(&[A]), 10, parse(&parsed))
                .unwrap(),
        );
        assert_eq!(parsed.get(), 3, "nothing of the refused report was kept");
        // A bad entry in an edit is named at its place in the new report.
        let refused = memo
            .parse("node_1", list(&[A, B, bad]), 10, parse(&parsed))
            .unwrap_err();
        assert!(refused.to_string().contains("instances[2]"), "{refused}");
        for (text, message) in [("{}", "an array"), ("[1, 2, 3]", "at most 2")] {
            let text = RawValue::from_string(text.into()).unwrap();
            let refused = memo.parse("node_1", text, 2, parse(&parsed)).unwrap_err();
            assert!(refused.to_string().contains(message), "{refused}");
        }
        // Too many after an edit, too.
        drop(
            memo.parse("node_1", list(&[A, B]), 2, parse(&parsed))
                .unwrap(),
        );
        let refused = memo
            .parse("node_1", list(&[A, C, B]), 2, parse(&parsed))
            .unwrap_err();
        assert!(refused.to_string().contains("at most 2"), "{refused}");
    }
}
