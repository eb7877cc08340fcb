//! What a node's report found each of its entries to be (an instance not placed there, one the
//! report leaves as it is, one it may change), kept with the node's report views for the next
//! report. A verdict is a function of the entry and the instance's view alone, so the next
//! report finds it again for every entry it did not edit (see `report_entries`) whose
//! instance was not marked since (see `report_views`): a report of 10,000 guests that changes
//! one judges one, where looking up each entry's view cost more than all the rest of the
//! report (the lookups miss the cache: the views were last touched a report ago).

use std::collections::{BTreeSet, HashMap};

use vps_domain::instance::ReportView;
use vps_domain::DomainError;

use crate::report_entries::{Memo, ReportedInstance};

/// What an entry is, against the view of the instance it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Verdict {
    found: Found,
    /// A sandbox's guest reporting CPU seconds (idle pause samples them).
    sample: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Found {
    /// No live instance is placed there by that id.
    Orphan,
    /// The entry surely decides no event.
    Unchanged,
    /// The entry may decide one: its instance is locked, loaded and decided.
    Candidate,
}

/// The last report the views were used for: its number, where each id is in it, and each
/// entry's verdict, in order. Each id keeps a slot while it stays in the reports, and only the
/// slots' places move when guests come or go before them: an array walk, where moving the ids
/// in the index would cost a cache miss each.
#[derive(Debug)]
pub(crate) struct Applied {
    seq: u64,
    /// By id: its slot.
    index: foldhash::HashMap<String, u32>,
    /// By place in the report: the entry's slot.
    slots: Vec<u32>,
    /// By slot: its place in the report (meaningless for a free slot).
    places: Vec<u32>,
    /// Slots no id holds.
    free: Vec<u32>,
    /// By place.
    verdicts: Vec<Verdict>,
}

impl Applied {
    /// Where the report lists `id`.
    fn place(&self, id: &str) -> Option<usize> {
        let slot = *self.index.get(id)?;
        Some(self.places[slot as usize] as usize)
    }

    /// The report's entry for `id`.
    pub(crate) fn entry<'m>(&self, memo: &'m Memo, id: &str) -> Option<&'m ReportedInstance> {
        self.place(id).map(|at| &memo.entries()[at])
    }

    /// Whether the report lists `id`.
    pub(crate) fn lists(&self, id: &str) -> bool {
        self.index.contains_key(id)
    }
}

/// What a report's entries ask.
#[derive(Debug, Default)]
pub(crate) struct Sorted {
    /// Instances to lock, load and decide, in id order (the lock order).
    pub candidates: BTreeSet<String>,
    /// Ids no live instance on the node has, in the report's order.
    pub orphans: Vec<String>,
    /// Sandbox guests' CPU seconds.
    pub samples: Vec<(String, f64)>,
}

/// Sorts `memo`'s entries against `views`, finding again the verdicts of `last` (the views'
/// last report) for the entries the report did not edit and whose instances are not in
/// `marked` (`None`: the views were read whole). `unchanged` is the rule for an entry that has
/// a view. `INVALID_INPUT` when an instance is listed twice.
pub(crate) fn sort(
    views: &HashMap<String, ReportView, foldhash::fast::RandomState>,
    last: Option<Applied>,
    memo: &Memo,
    marked: Option<&[String]>,
    unchanged: impl Fn(&ReportedInstance, &ReportView) -> bool,
) -> Result<(Applied, Sorted), DomainError> {
    let entries = memo.entries();
    let judge = |entry: &ReportedInstance| match views.get(&entry.id) {
        None => Verdict {
            found: Found::Orphan,
            sample: false,
        },
        Some(view) => Verdict {
            found: match unchanged(entry, view) {
                true => Found::Unchanged,
                false => Found::Candidate,
            },
            sample: view.drives_sandbox && entry.cpu_seconds.is_some(),
        },
    };
    let kept = match (last, &memo.edit, marked) {
        // Every entry but the edited ones is the last report's.
        (Some(last), Some(edit), Some(marked)) if last.seq == edit.based_on => {
            Some((last, edit, marked))
        }
        _ => None,
    };
    let applied = match kept {
        Some((mut last, edit, marked)) => {
            let (at, inserted) = (edit.at, edit.inserted);
            for id in &edit.removed {
                if let Some(slot) = last.index.remove(id) {
                    last.free.push(slot);
                }
            }
            let mut slots = Vec::with_capacity(inserted);
            for entry in &entries[at..at + inserted] {
                let slot = last.free.pop().unwrap_or_else(|| {
                    last.places.push(0);
                    (last.places.len() - 1) as u32
                });
                if last.index.insert(entry.id.clone(), slot).is_some() {
                    return Err(listed_twice());
                }
                slots.push(slot);
            }
            let removed = at..at + edit.removed.len();
            last.slots.splice(removed.clone(), slots);
            last.verdicts
                .splice(removed, entries[at..at + inserted].iter().map(judge));
            // The places of the edited entries, and of every one after them if they moved.
            let moved = match edit.removed.len() == inserted {
                true => at + inserted,
                false => entries.len(),
            };
            for (place, &slot) in last.slots.iter().enumerate().take(moved).skip(at) {
                last.places[slot as usize] = place as u32;
            }
            let stale: Vec<usize> = marked.iter().filter_map(|id| last.place(id)).collect();
            for at in stale {
                last.verdicts[at] = judge(&entries[at]);
            }
            Applied {
                seq: memo.seq,
                ..last
            }
        }
        None => {
            let mut index =
                foldhash::HashMap::with_capacity_and_hasher(entries.len(), Default::default());
            for (at, entry) in entries.iter().enumerate() {
                if index.insert(entry.id.clone(), at as u32).is_some() {
                    return Err(listed_twice());
                }
            }
            let slots: Vec<u32> = (0..entries.len() as u32).collect();
            Applied {
                seq: memo.seq,
                index,
                places: slots.clone(),
                slots,
                free: Vec::new(),
                verdicts: entries.iter().map(judge).collect(),
            }
        }
    };
    debug_assert_eq!(applied.verdicts.len(), entries.len());
    debug_assert_eq!(applied.slots.len(), entries.len());
    let mut sorted = Sorted::default();
    for (verdict, entry) in applied.verdicts.iter().zip(entries) {
        // Nearly every entry: nothing to read of it.
        if verdict.found == Found::Unchanged && !verdict.sample {
            continue;
        }
        match verdict.found {
            Found::Orphan => sorted.orphans.push(entry.id.clone()),
            Found::Candidate => {
                sorted.candidates.insert(entry.id.clone());
            }
            Found::Unchanged => {}
        }
        if let Some(cpu_seconds) = entry.cpu_seconds.filter(|_| verdict.sample) {
            sorted.samples.push((entry.id.clone(), cpu_seconds));
        }
    }
    Ok((applied, sorted))
}

fn listed_twice() -> DomainError {
    DomainError::invalid_input("instances", "an instance is listed twice")
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use serde_json::value::RawValue;
    use vps_domain::state_table::InstanceState;

    use super::*;
    use crate::report_entries::ReportEntries;

    fn view(drives_sandbox: bool) -> ReportView {
        ReportView {
            state: InstanceState::Running,
            has_conditions: false,
            addresses: Vec::new(),
            shares_principal: false,
            drives_sandbox,
        }
    }

    fn entry(id: &str, state: &str) -> String {
        format!(r#"{{"id":"{id}","state":"{state}","cpuSeconds":1.5}}"#)
    }

    fn report(memo: &ReportEntries, entries: &[String]) -> std::sync::Arc<Memo> {
        let text = RawValue::from_string(format!("[{}]", entries.join(","))).unwrap();
        memo.parse("node_1", text, 100, |_, text| {
            Ok(serde_json::from_str(text).unwrap())
        })
        .unwrap()
    }

    #[test]
    fn only_edited_and_marked_entries_are_judged_again() {
        let views: HashMap<String, ReportView, _> = [
            ("inst_a".to_string(), view(false)),
            ("inst_b".to_string(), view(true)),
            ("inst_c".to_string(), view(false)),
        ]
        .into_iter()
        .collect();
        let judged = Cell::new(0);
        // Unchanged when running.
        let rule = |entry: &ReportedInstance, _: &ReportView| {
            judged.set(judged.get() + 1);
            entry.state == crate::report_entries::ReportedState::Running
        };
        let memos = ReportEntries::default();
        let running = ["inst_a", "inst_b", "inst_c", "inst_x"].map(|id| entry(id, "RUNNING"));
        let memo = report(&memos, &running);
        let (applied, sorted) = sort(&views, None, &memo, None, rule).unwrap();
        assert_eq!(
            judged.get(),
            3,
            "a first report judges every entry with a view"
        );
        assert_eq!(sorted.orphans, ["inst_x"]);
        assert!(sorted.candidates.is_empty());
        assert_eq!(sorted.samples, [("inst_b".to_string(), 1.5)]);
        drop(memo);

        // `inst_c` stopped: only it is judged; the orphan and the sample are found again.
        let mut stopped = running.clone();
        stopped[2] = entry("inst_c", "STOPPED");
        let memo = report(&memos, &stopped);
        let (applied, sorted) = sort(&views, Some(applied), &memo, Some(&[]), rule).unwrap();
        assert_eq!(judged.get(), 4);
        assert_eq!(sorted.orphans, ["inst_x"]);
        assert_eq!(
            sorted.candidates.into_iter().collect::<Vec<_>>(),
            ["inst_c"]
        );
        assert_eq!(sorted.samples.len(), 1);
        assert_eq!(
            applied.entry(&memo, "inst_c").unwrap().cpu_seconds,
            Some(1.5)
        );
        drop(memo);

        // The same report again, `inst_a` marked since: only it is judged.
        let memo = report(&memos, &stopped);
        let marked = ["inst_a".to_string()];
        let (applied, _) = sort(&views, Some(applied), &memo, Some(&marked), rule).unwrap();
        assert_eq!(judged.get(), 5);
        drop(memo);

        // Views read whole (`None`): every entry again.
        let memo = report(&memos, &stopped);
        let (applied, _) = sort(&views, Some(applied), &memo, None, rule).unwrap();
        assert_eq!(judged.get(), 8);
        drop(memo);

        // A guest that comes before the others, and one that goes: only the new one is judged,
        // and every id is found at its new place.
        let mut grown = vec![entry("inst_0", "RUNNING")];
        grown.extend(stopped.iter().cloned());
        let memo = report(&memos, &grown);
        let (applied, sorted) = sort(&views, Some(applied), &memo, Some(&[]), rule).unwrap();
        assert_eq!(
            judged.get(),
            8,
            "the new guest is an orphan: no view, no rule"
        );
        assert_eq!(sorted.orphans, ["inst_0", "inst_x"]);
        assert_eq!(
            sorted.candidates.into_iter().collect::<Vec<_>>(),
            ["inst_c"]
        );
        for id in ["inst_0", "inst_a", "inst_b", "inst_c", "inst_x"] {
            assert_eq!(applied.entry(&memo, id).unwrap().id, id);
        }
        drop(memo);
        let mut shrunk = grown.clone();
        shrunk.remove(2);
        let memo = report(&memos, &shrunk);
        let marked = ["inst_c".to_string()];
        let (applied, sorted) = sort(&views, Some(applied), &memo, Some(&marked), rule).unwrap();
        assert_eq!(judged.get(), 9, "only the marked guest is judged");
        assert!(!applied.lists("inst_b"));
        assert_eq!(applied.entry(&memo, "inst_x").unwrap().id, "inst_x");
        assert_eq!(sorted.samples.len(), 0, "the sampled guest left");
        drop(memo);

        // An edit that lists `inst_a` twice is refused.
        let mut twice = shrunk.clone();
        twice[2] = entry("inst_a", "RUNNING");
        let memo = report(&memos, &twice);
        let refused = sort(&views, Some(applied), &memo, Some(&[]), rule).unwrap_err();
        assert!(refused.to_string().contains("listed twice"), "{refused}");
    }

    #[test]
    fn after_any_edits_every_id_is_found_at_its_place_and_judged_as_a_whole_read_would() {
        let views: HashMap<String, ReportView, _> = (0..400)
            .filter(|id| id % 3 != 0)
            .map(|id| (format!("inst_{id}"), view(id % 2 == 0)))
            .collect();
        let rule = |entry: &ReportedInstance, _: &ReportView| {
            entry.state == crate::report_entries::ReportedState::Running
        };
        let memos = ReportEntries::default();
        let mut current: Vec<(u32, bool)> = (0..20).map(|id| (id, true)).collect();
        let mut fresh = 20;
        let mut seed = 11u32;
        let mut next = |bound: u32| {
            seed = seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
            (seed >> 16) % bound
        };
        let mut last = None;
        for round in 0..200 {
            let at = next(current.len() as u32 + 1) as usize;
            match next(3) {
                0 if at < current.len() => current[at].1 = !current[at].1,
                1 if fresh < 400 => {
                    current.insert(at, (fresh, true));
                    fresh += 1;
                }
                _ if at < current.len() && current.len() > 1 => {
                    current.remove(at);
                }
                _ => {}
            }
            let texts: Vec<String> = current
                .iter()
                .map(|&(id, running)| {
                    entry(
                        &format!("inst_{id}"),
                        if running { "RUNNING" } else { "STOPPED" },
                    )
                })
                .collect();
            let memo = report(&memos, &texts);
            assert!(
                round == 0 || memo.edit.is_some(),
                "round {round} is an edit"
            );
            let (applied, sorted) = sort(&views, last.take(), &memo, Some(&[]), rule).unwrap();
            let (_, whole) = sort(&views, None, &memo, None, rule).unwrap();
            assert_eq!(sorted.candidates, whole.candidates, "round {round}");
            assert_eq!(sorted.orphans, whole.orphans, "round {round}");
            assert_eq!(sorted.samples, whole.samples, "round {round}");
            for &(id, _) in &current {
                let id = format!("inst_{id}");
                assert_eq!(
                    applied.entry(&memo, &id).map(|e| e.id.as_str()),
                    Some(id.as_str())
                );
            }
            last = Some(applied);
        }
    }
}
