//! The metering fold: what each hosted instance accrues over time, built from its events alone,
//! and settled into [`UsageRecord`]s window by window.
//!
//! An instance accrues while its allocation is booked: from the event that books it
//! (`instance.scheduled`) to the one that releases it (`instance.recreating`,
//! `instance.deleted`), at the events' recorded times. While its events carry
//! `warmTemplateId` it accrues only `vps.sandbox.warm`, billed to its tenant with no identity;
//! from the first event with `sandboxId` and no `warmTemplateId` (the claim) it accrues the
//! ordinary lines for `ownerIdentityId`. `instance.resized` changes the shape. While an
//! instance that is not warm is `paused` (its events' `state`) it accrues only
//! `vps.sandbox.paused.gib.hours` (the memory it holds); while it is `error` it accrues
//! nothing, from the event that failed it. Every such change
//! closes the running [`Segment`] and opens another, so a window is cut where it happened.
//! Provider-pool instances are not metered.
//!
//! A sandbox volume accrues `vps.volume.gib.hours` the same way, from its own stream: from
//! `sandbox.volume.created` (which books it) to `sandbox.volume.deleted` (which releases it),
//! its size changed by `sandbox.volume.resized`, billed to its tenant and creator.
//!
//! A stored snapshot accrues `vps.snapshot.gib.hours` from its sandbox's stream: from
//! `sandbox.snapshot.ready` (its size, rounded up to whole GiB) to `sandbox.snapshot.deleted`
//! (or `.purged`), billed to its tenant, `resourceId` the snapshot.
//!
//! Quantities are rounded on the running total of each (resource, meter): a record's quantity
//! is `round(total after it) − round(total before it)`, so any run of records of a resource sums
//! to its exact accrual rounded once, to the last decimal digit.

use std::collections::{BTreeMap, BTreeSet};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::meter::{hours, lines, paused_lines, snapshot_lines, volume_lines, Line};
use super::record::UsageRecord;
use super::window::{at, micros, Micros, Windows};
use crate::aggregate::Aggregate;
use crate::instance::Instance;
use crate::resources::Shape;
use crate::sandbox::Sandbox;
use crate::volume::Volume;

/// Who a segment's usage is billed to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Payer {
    /// The tenant.
    pub tenant_id: String,
    /// The owning identity (none for a warm instance).
    pub identity_id: Option<String>,
    /// The pool the allocation is in.
    pub pool_id: String,
    /// The resource's labels (a change of them closes the segment).
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
}

/// A stretch of time over which a resource accrued the same lines for the same payer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Segment {
    /// When it began (µs).
    pub start: Micros,
    /// When it ended; `None` while it runs.
    pub end: Option<Micros>,
    /// Who pays.
    pub payer: Payer,
    /// What it accrues.
    pub lines: Vec<Line>,
    /// Per line, the unit·µs the resource accrued on that meter before `start`.
    pub bases: Vec<Amount>,
}

/// An exact amount in unit·microseconds; stored as a decimal string (JSON numbers lose
/// precision beyond 2⁵³ in many readers).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Amount(pub i128);

impl Serialize for Amount {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0.to_string())
    }
}

impl<'de> Deserialize<'de> for Amount {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map(Amount).map_err(serde::de::Error::custom)
    }
}

/// What the ledger keeps of one metered resource: a hosted instance, or a sandbox volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InstanceMeter {
    /// A sandbox volume (its shape is its disk), not an instance.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub volume: bool,
    /// A stored snapshot (its shape's disk is its size in GiB), not an instance.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub snapshot: bool,
    /// The tenant.
    pub tenant_id: String,
    /// The pool.
    pub pool_id: String,
    /// The owning identity (after a claim: the sandbox's owner).
    pub owner_identity_id: Option<String>,
    /// The current shape.
    pub shape: Shape,
    /// Whether it is an unclaimed warm instance.
    pub warm: bool,
    /// Whether its allocation is booked.
    pub allocated: bool,
    /// Whether it is deleted (nothing more will accrue).
    pub deleted: bool,
    /// Whether its instance is paused (it accrues the paused line only).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paused: bool,
    /// Whether its instance is in error (it accrues nothing).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub errored: bool,
    /// Its labels (from its `created` and `labeled` events).
    #[serde(default, skip_serializing_if = "crate::labels::Labels::is_empty")]
    pub labels: crate::labels::Labels,
    /// The latest time a change applied at: an event recorded earlier (its transaction started
    /// before, committed after) counts as happening now, so segments never run backwards.
    pub changed_at: Micros,
    /// Segments not yet settled completely, oldest first; only the last may be running.
    pub segments: Vec<Segment>,
    /// Per meter, the unit·µs accrued up to the end of the last closed segment.
    pub accrued: BTreeMap<String, Amount>,
}

/// What an event does to a resource's accrual.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Change {
    /// Its allocation is booked.
    Book,
    /// Its allocation is released; it may be booked again.
    Release,
    /// It is gone: released for good.
    End,
    /// Its shape changed.
    Reshape,
}

/// What one event says that metering needs, read from its `data` by field name, so event
/// types added later (a claim, say) are understood by their fields.
struct Facts {
    change: Option<Change>,
    tenant_id: Option<String>,
    pool_id: Option<String>,
    warm: bool,
    owner: Option<String>,
    shape: Option<Shape>,
    /// An instance event's `state`.
    state: Option<String>,
    /// The labels, when the event carries them (`created`, `labeled`).
    labels: Option<crate::labels::Labels>,
}

/// An event's `labels`, when it carries them.
fn labels_of(data: &Value) -> Option<crate::labels::Labels> {
    data.get("labels")
        .and_then(|l| crate::labels::Labels::deserialize(l).ok())
}

impl Facts {
    fn read(event_type: &str, data: &Value) -> Facts {
        let text = |field: &str| data.get(field).and_then(Value::as_str).map(str::to_string);
        Facts {
            change: match event_type {
                "instance.scheduled" => Some(Change::Book),
                "instance.recreating" => Some(Change::Release),
                "instance.deleted" => Some(Change::End),
                "instance.resized" => Some(Change::Reshape),
                _ => None,
            },
            tenant_id: text("tenantId"),
            pool_id: text("poolId"),
            warm: data.get("warmTemplateId").is_some_and(|v| !v.is_null()),
            owner: text("ownerIdentityId"),
            shape: data.get("shape").and_then(|s| Shape::deserialize(s).ok()),
            state: text("state"),
            labels: labels_of(data),
        }
    }

    /// A volume event's facts: its size is its shape.
    fn read_volume(event_type: &str, data: &Value) -> Facts {
        let text = |field: &str| data.get(field).and_then(Value::as_str).map(str::to_string);
        let size = data.get("sizeGiB").and_then(Value::as_u64);
        Facts {
            change: match event_type {
                "sandbox.volume.created" => Some(Change::Book),
                "sandbox.volume.resized" => Some(Change::Reshape),
                "sandbox.volume.deleted" => Some(Change::End),
                _ => None,
            },
            tenant_id: text("tenantId"),
            pool_id: text("poolId"),
            warm: false,
            owner: text("ownerIdentityId"),
            shape: size
                .and_then(|s| u32::try_from(s).ok())
                .map(crate::volume::disk),
            state: None,
            labels: labels_of(data),
        }
    }
}

impl Facts {
    /// A snapshot event's facts: its stored size, in whole GiB rounded up, is its shape.
    fn read_snapshot(event_type: &str, data: &Value) -> Facts {
        let text = |field: &str| data.get(field).and_then(Value::as_str).map(str::to_string);
        let gib = data
            .get("sizeBytes")
            .and_then(Value::as_u64)
            .map(|b| b.div_ceil(1 << 30));
        Facts {
            change: match event_type {
                "sandbox.snapshot.ready" => Some(Change::Book),
                "sandbox.snapshot.deleted" | "sandbox.snapshot.purged" => Some(Change::End),
                _ => None,
            },
            tenant_id: text("tenantId"),
            pool_id: text("poolId"),
            warm: false,
            owner: None,
            shape: gib
                .and_then(|g| u32::try_from(g).ok())
                .map(crate::volume::disk),
            state: None,
            labels: None,
        }
    }
}

impl InstanceMeter {
    /// What a hosted instance's `instance.created` starts (not yet allocated).
    fn created(facts: &Facts, at: Micros) -> Option<InstanceMeter> {
        Some(InstanceMeter {
            volume: false,
            snapshot: false,
            tenant_id: facts.tenant_id.clone()?,
            pool_id: facts.pool_id.clone()?,
            owner_identity_id: facts.owner.clone(),
            shape: facts.shape.clone()?,
            warm: facts.warm,
            allocated: false,
            deleted: false,
            paused: false,
            errored: false,
            labels: facts.labels.clone().unwrap_or_default(),
            changed_at: at,
            segments: Vec::new(),
            accrued: BTreeMap::new(),
        })
    }

    /// Who pays and what accrues right now, if anything does.
    fn billing(&self) -> Option<(Payer, Vec<Line>)> {
        if !self.allocated || self.deleted || self.errored {
            return None;
        }
        let lines = match (self.volume, self.snapshot) {
            (_, true) => snapshot_lines(self.shape.disk_gib),
            (true, false) => volume_lines(self.shape.disk_gib),
            (false, false) if self.paused && !self.warm => paused_lines(&self.shape),
            (false, false) => lines(&self.shape, self.warm),
        };
        let payer = Payer {
            tenant_id: self.tenant_id.clone(),
            identity_id: (!self.warm)
                .then(|| self.owner_identity_id.clone())
                .flatten(),
            pool_id: self.pool_id.clone(),
            labels: self.labels.clone(),
        };
        (!lines.is_empty()).then_some((payer, lines))
    }

    /// Applies one event recorded at `at`.
    fn apply(&mut self, facts: Facts, at: Micros) {
        let before = self.billing();
        match facts.change {
            Some(Change::Book) => self.allocated = true,
            Some(Change::Release) => self.allocated = false,
            Some(Change::End) => {
                self.allocated = false;
                self.deleted = true;
            }
            Some(Change::Reshape) => self.shape = facts.shape.unwrap_or(self.shape.clone()),
            None => {}
        }
        self.tenant_id = facts.tenant_id.unwrap_or(self.tenant_id.clone());
        self.pool_id = facts.pool_id.unwrap_or(self.pool_id.clone());
        // A claim's event names the sandbox's owner; so may later events.
        self.owner_identity_id = facts.owner.or(self.owner_identity_id.take());
        self.warm = facts.warm;
        if let Some(labels) = facts.labels {
            self.labels = labels;
        }
        if let Some(state) = facts.state.as_deref() {
            self.paused = state == "paused";
            self.errored = state == "error";
        }
        let after = self.billing();
        let now = at.max(self.changed_at);
        self.changed_at = now;
        if before != after {
            self.close(now);
            if let Some((payer, lines)) = after {
                self.open(now, payer, lines);
            }
        }
    }

    fn close(&mut self, now: Micros) {
        let Some(last) = self.segments.last_mut().filter(|s| s.end.is_none()) else {
            return;
        };
        if now <= last.start {
            self.segments.pop();
            return;
        }
        last.end = Some(now);
        let span = i128::from(now - last.start);
        for line in &last.lines {
            self.accrued.entry(line.meter.clone()).or_default().0 += i128::from(line.rate) * span;
        }
    }

    fn open(&mut self, now: Micros, payer: Payer, lines: Vec<Line>) {
        let bases = lines
            .iter()
            .map(|l| self.accrued.get(&l.meter).copied().unwrap_or_default())
            .collect();
        self.segments.push(Segment {
            start: now,
            end: None,
            payer,
            lines,
            bases,
        });
    }

    /// Appends the records of every window piece in `[from, to)` to `out` and forgets the
    /// segments that ended by `to`. Whether anything was forgotten.
    fn settle(
        &mut self,
        resource_id: &str,
        windows: &Windows,
        (from, to): (Micros, Micros),
        out: &mut Vec<UsageRecord>,
    ) -> bool {
        for segment in &self.segments {
            let lo = segment.start.max(from);
            let hi = segment.end.unwrap_or(Micros::MAX).min(to);
            for (p0, p1) in windows.pieces(lo, hi) {
                out.extend(segment.records(resource_id, p0, p1));
            }
        }
        let before = self.segments.len();
        self.segments.retain(|s| s.end.is_none_or(|end| end > to));
        self.segments.len() != before
    }
}

impl Segment {
    /// One record per line for the piece `[p0, p1)` of this segment.
    fn records<'a>(
        &'a self,
        resource_id: &'a str,
        p0: Micros,
        p1: Micros,
    ) -> impl Iterator<Item = UsageRecord> + 'a {
        self.lines.iter().zip(&self.bases).map(move |(line, base)| {
            let total = |t: Micros| base.0 + i128::from(line.rate) * i128::from(t - self.start);
            UsageRecord {
                meter: line.meter.clone(),
                quantity: (hours(total(p1)) - hours(total(p0))).normalize(),
                unit: line.unit.clone(),
                window_start: at(p0),
                window_end: at(p1),
                tenant_id: self.payer.tenant_id.clone(),
                identity_id: self.payer.identity_id.clone(),
                resource_id: resource_id.to_string(),
                pool_id: self.payer.pool_id.clone(),
                labels: self.payer.labels.clone(),
            }
        })
    }
}

/// Every metered resource, folded from the log in read order.
#[derive(Debug, Clone)]
pub struct Ledger {
    windows: Windows,
    instances: BTreeMap<String, InstanceMeter>,
    dirty: BTreeSet<String>,
}

impl Ledger {
    /// An empty ledger (the start of the log).
    pub fn new(windows: Windows) -> Ledger {
        Ledger::restore(windows, [])
    }

    /// A ledger holding what an earlier run kept.
    pub fn restore(
        windows: Windows,
        instances: impl IntoIterator<Item = (String, InstanceMeter)>,
    ) -> Ledger {
        Ledger {
            windows,
            instances: instances.into_iter().collect(),
            dirty: BTreeSet::new(),
        }
    }

    /// The windows records are cut into.
    pub fn windows(&self) -> Windows {
        self.windows
    }

    /// What the ledger keeps of a resource.
    pub fn instance(&self, id: &str) -> Option<&InstanceMeter> {
        self.instances.get(id)
    }

    /// The earliest start of a segment not yet settled completely (`None`: nothing accrues).
    pub fn earliest_start(&self) -> Option<Micros> {
        self.instances
            .values()
            .flat_map(|m| m.segments.first())
            .map(|s| s.start)
            .min()
    }

    /// Applies one event of the log (any event: those that do not meter are ignored).
    pub fn apply(
        &mut self,
        stream: &str,
        event_type: &str,
        data: &Value,
        recorded_at: chrono::DateTime<chrono::Utc>,
    ) {
        if let Some(id) = Volume::id_of_stream(stream) {
            self.apply_volume(id, event_type, data, micros(recorded_at));
            return;
        }
        if Sandbox::id_of_stream(stream).is_some() && event_type.starts_with("sandbox.snapshot.") {
            if let Some(id) = data.get("snapshotId").and_then(Value::as_str) {
                self.apply_snapshot(id, event_type, data, micros(recorded_at));
            }
            return;
        }
        if Instance::id_of_stream(stream).is_none() {
            return;
        }
        let Some(id) = data.get("instanceId").and_then(Value::as_str) else {
            return;
        };
        let facts = Facts::read(event_type, data);
        let t = micros(recorded_at);
        if event_type == "instance.created" {
            // Provider-pool instances are billed by their provider, not metered here.
            if data.get("poolKind").and_then(Value::as_str) != Some("hosted") {
                return;
            }
            if let Some(meter) = InstanceMeter::created(&facts, t) {
                self.start(id, meter);
            }
            return;
        }
        self.follow(id, facts, t);
    }

    /// A volume's event: `created` starts its meter already booked.
    fn apply_volume(&mut self, id: &str, event_type: &str, data: &Value, t: Micros) {
        let facts = Facts::read_volume(event_type, data);
        if facts.change == Some(Change::Book) {
            if let Some(mut meter) = InstanceMeter::created(&facts, t) {
                meter.volume = true;
                meter.apply(facts, t);
                self.start(id, meter);
            }
            return;
        }
        self.follow(id, facts, t);
    }

    /// A snapshot's event: `ready` starts its meter already booked (once: a second `ready`
    /// of the same snapshot changes nothing).
    fn apply_snapshot(&mut self, id: &str, event_type: &str, data: &Value, t: Micros) {
        let facts = Facts::read_snapshot(event_type, data);
        if facts.change == Some(Change::Book) {
            if self.instances.contains_key(id) {
                return;
            }
            if let Some(mut meter) = InstanceMeter::created(&facts, t) {
                meter.snapshot = true;
                meter.apply(facts, t);
                self.start(id, meter);
            }
            return;
        }
        self.follow(id, facts, t);
    }

    /// A resource's meter starts.
    fn start(&mut self, id: &str, meter: InstanceMeter) {
        self.instances.insert(id.to_string(), meter);
        self.dirty.insert(id.to_string());
    }

    /// A metered resource's event moves its meter; others are not metered.
    fn follow(&mut self, id: &str, facts: Facts, t: Micros) {
        if let Some(meter) = self.instances.get_mut(id) {
            meter.apply(facts, t);
            self.dirty.insert(id.to_string());
        }
    }

    /// The records of every window in `[from, to)` (both window boundaries; `from` may be
    /// `Micros::MIN` for the start of the log). Call it only once every event recorded before
    /// `to` has been applied, and with `from` = the previous call's `to`.
    pub fn settle(&mut self, from: Micros, to: Micros) -> Vec<UsageRecord> {
        let mut out = Vec::new();
        let mut finished = Vec::new();
        for (id, meter) in &mut self.instances {
            if meter.settle(id, &self.windows, (from, to), &mut out) {
                self.dirty.insert(id.clone());
            }
            if meter.deleted && meter.segments.is_empty() {
                finished.push(id.clone());
            }
        }
        for id in finished {
            self.instances.remove(&id);
            self.dirty.insert(id);
        }
        out
    }

    /// The resources changed since the last call, with what to keep of each (`None`: forget it).
    pub fn take_dirty(&mut self) -> Vec<(String, Option<InstanceMeter>)> {
        std::mem::take(&mut self.dirty)
            .into_iter()
            .map(|id| {
                let kept = self.instances.get(&id).cloned();
                (id, kept)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
