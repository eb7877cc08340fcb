//! What hosts send: status reports (`nodes.report`), and what the control plane decides
//! from node liveness (`node.lost` and its instances). Every instance change is an ordinary
//! decision on the instance's stream.

use std::collections::BTreeMap;

use chrono::Utc;
use serde::Deserialize;
use serde_json::value::RawValue;
use sqlx::PgConnection;
use vps_domain::instance::{AddressMode, Failure, Instance, InstanceCommand, Observed, ReportView};
use vps_domain::node::{decide, Node, NodeCommand, NodeLiveness};
use vps_domain::state_table::InstanceState;
use vps_domain::DomainError;

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{apply_commands, record_events, transaction};
use vps_domain::ids::NodeId;

use crate::report_entries::Memo;
pub use crate::report_entries::{ReportedInstance, ReportedState};
use crate::report_verdicts::{self as verdicts, Sorted};
use crate::report_views as views;

pub use vps_domain::instance::MAX_ADDRESSES;
pub use vps_domain::node::MAX_ORPHANS;

/// `nodes.report`.
#[derive(Debug, Clone, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Report {
    /// The reporting node.
    pub node_id: NodeId,
    /// What its runtime holds: [`ReportedInstance`]s, the list kept as its text until
    /// [`report`] parses each entry, or finds it in the node's last report (see
    /// [`crate::report_entries`]).
    #[serde(default = "no_instances")]
    #[schemars(length(max = 10000), with = "Vec<ReportedInstance>")]
    pub instances: Box<RawValue>,
    /// The list is the node's whole inventory.
    #[serde(default)]
    pub complete: bool,
    /// The NodeSpec generation the host has applied.
    pub applied_generation: Option<i64>,
    /// The outcomes of the spec's host commands (snapshots) the host finished.
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub command_results: Vec<vps_domain::sandbox::snapshot::CommandResult>,
    /// Where the node accepts sandbox exec tunnels (`tcp://host:port`); absent: unchanged.
    pub tunnel_url: Option<String>,
    /// The CPU model the host's guests run with, as it states it (SPEC §3.11).
    pub cpu_model: Option<String>,
    /// The runtimes the host can run, as it states them.
    #[schemars(length(max = 16))]
    pub runtimes: Option<Vec<String>>,
    /// What the snapshot store holds for the objects of this report's successful snapshot
    /// results, by command id (see [`uploaded_objects`]). Filled by the server, which holds
    /// the store, before [`report`]; never read from the wire. A result with no entry is
    /// settled on the host's word.
    #[serde(skip)]
    #[schemars(skip)]
    pub stored: BTreeMap<String, crate::sandboxes::snapshots::StoredObject>,
}

/// The most instances a report may list.
pub const MAX_ENTRIES: usize = 10_000;

fn no_instances() -> Box<RawValue> {
    RawValue::from_string("[]".into()).expect("an empty list is JSON")
}

/// What a report changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportOutcome {
    /// Instances whose state or data changed.
    pub updated: usize,
    /// Instances the node holds that no live row places there, sorted.
    pub orphans: Vec<String>,
    /// Instances that changed (for waking the reconciler).
    pub changed: Vec<String>,
}

/// The prefix of a host's refusal to start an instance for lack of resources.
pub const RESOURCES_EXHAUSTED: &str = "ResourcesExhausted:";

/// The store objects the successful snapshot results of `report` name, as (command id, object
/// key): only this node's pending snapshots. Read before [`report`]'s transaction, so the
/// server can look at the store (plan, call, apply) and fill [`Report::stored`].
pub async fn uploaded_objects(
    ctx: &Ctx,
    report: &Report,
) -> Result<Vec<(String, String)>, CommandError> {
    let ids: Vec<&str> = report
        .command_results
        .iter()
        .filter(|r| r.ok)
        .take(1_000)
        .map(|r| r.id.as_str())
        .collect();
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    let owned =
        vps_projections::sandboxes::pending_tenants_on_node(&ctx.pool, &ids, &report.node_id)
            .await?;
    Ok(owned
        .into_iter()
        .map(|snap| {
            let key = vps_domain::sandbox::snapshot::object_key(&snap.tenant_id, &snap.id);
            (snap.id, key)
        })
        .collect())
}

/// The host's statement of itself and its guests' CPU use: shapes only. What a node may run
/// is what it registered; a differing statement is logged for the operator.
fn check_facts(report: &Report) -> Result<(), DomainError> {
    if let Some(model) = &report.cpu_model {
        if model.is_empty() || model.len() > 128 || model.chars().any(char::is_control) {
            return Err(DomainError::invalid_input(
                "cpuModel",
                "1 to 128 printable characters",
            ));
        }
    }
    if let Some(runtimes) = &report.runtimes {
        if runtimes.len() > 16 {
            return Err(DomainError::invalid_input("runtimes", "at most 16"));
        }
        if let Some(bad) = runtimes
            .iter()
            .find(|r| !vps_domain::operator::RUNTIMES.contains(&r.as_str()))
        {
            return Err(DomainError::invalid_input(
                "runtimes",
                format!("unknown runtime {bad:?}"),
            ));
        }
    }
    Ok(())
}

/// One entry of a report, parsed and checked; `i`, its index, names the field an error
/// points at. Read straight into the entry; one that does not fit is read again through a
/// `Value`, so the error names the field and no position in the entry's text.
fn parse_entry(i: usize, text: &str) -> Result<ReportedInstance, DomainError> {
    let mut entry: ReportedInstance = match serde_json::from_str(text) {
        Ok(entry) => entry,
        Err(_) => {
            let value: serde_json::Value = serde_json::from_str(text).map_err(|e| {
                DomainError::invalid_input(format!("instances[{i}]"), e.to_string())
            })?;
            serde_path_to_error::deserialize(value).map_err(|e| {
                let field = match e.path().to_string().as_str() {
                    "." => format!("instances[{i}]"),
                    path => format!("instances[{i}].{path}"),
                };
                DomainError::invalid_input(field, e.inner().to_string())
            })?
        }
    };
    if let Some(addresses) = entry.addresses.as_mut() {
        check_addresses(i, addresses)?;
    }
    if entry.cpu_seconds.is_some_and(|s| !s.is_finite() || s < 0.0) {
        return Err(DomainError::invalid_input(
            format!("instances[{i}].cpuSeconds"),
            "a non-negative number",
        ));
    }
    Ok(entry)
}

/// Applies a node's report. Only instances placed on that node are touched.
pub async fn report(ctx: &Ctx, mut report: Report) -> Result<ReportOutcome, CommandError> {
    if report.command_results.len() > 1_000 {
        return Err(DomainError::invalid_input("commandResults", "at most 1000").into());
    }
    if let Some(url) = &report.tunnel_url {
        vps_domain::tunnel_url::parse("tunnelUrl", url)?;
    }
    check_facts(&report)?;
    let text = std::mem::replace(&mut report.instances, no_instances());
    let memo = ctx
        .reports
        .entries
        .parse(&report.node_id, text, MAX_ENTRIES, parse_entry)?;
    transaction(ctx, &report.node_id, async |tx| {
        report_in(ctx, tx, &report, &memo).await
    })
    .await
}

async fn report_in(
    ctx: &Ctx,
    tx: &mut PgConnection,
    report: &Report,
    memo: &Memo,
) -> Result<ReportOutcome, CommandError> {
    let now = ctx.clock.now();
    let node_id = &report.node_id;
    let node = Some(lock_node(tx, node_id, Some((now, report.applied_generation))).await?);
    if let Some(url) = &report.tunnel_url {
        crate::sandboxes::exec::tunnel::advertise(tx, node_id, url, now).await?;
    }
    let recovered = decide(node.as_ref(), &NodeCommand::Recover)?;
    let node = record_events(ctx, tx, node_id, node.as_ref(), recovered, None).await?;

    // Sorted first on light views (state, conditions, addresses), unlocked: most entries of a
    // complete report change nothing, and loading every instance of the node made each report
    // cost the node's size, while locking them all would make each claim or change on it wait
    // for the whole report. Only the rest are locked, loaded and decided. The views are this
    // replica's copy, brought up to date with what changed since the node's last report, and
    // so are the verdicts of that report (only the entries it did not carry, and those whose
    // instances changed since, are looked at again).
    let (mut held, marked) = views::current(&ctx.reports, tx, node_id, now).await?;
    let last = held.last.take();
    let (applied, sorted) = verdicts::sort(&held.views, last, memo, marked.as_deref(), unchanged)?;
    let Sorted {
        mut candidates,
        mut orphans,
        samples,
    } = sorted;
    if report.complete {
        // Gone from a complete report while being deleted: the host let it go.
        candidates.extend(
            held.deleting
                .iter()
                .filter(|id| !applied.lists(id))
                .cloned(),
        );
    }
    let ids: Vec<String> = candidates.into_iter().collect();
    let mut changed = Vec::new();
    for instance in lock_placed(tx, node_id, &ids).await? {
        let commands = match applied.entry(memo, &instance.id) {
            Some(entry) => commands_for(entry, &instance, node_id),
            None if instance.state == InstanceState::Deleting => vec![InstanceCommand::Release],
            None => continue,
        };
        if apply_commands(ctx, tx, &instance, &commands, now)
            .await?
            .is_some()
        {
            changed.push(instance.id.clone());
        }
    }
    crate::sandboxes::activity::sample(tx, &samples, now).await?;
    let record = NodeCommand::RecordOrphans {
        orphans: orphans.clone(),
        complete: report.complete,
    };
    let announced = decide(node.as_ref(), &record)?;
    record_events(ctx, tx, node_id, node.as_ref(), announced, None).await?;
    crate::sandboxes::snapshots::settle(ctx, tx, node_id, &report.command_results, &report.stored)
        .await?;
    held.last = Some(applied);
    ctx.reports.put(node_id, held);
    orphans.sort();
    orphans.truncate(MAX_ORPHANS);
    Ok(ReportOutcome {
        updated: changed.len(),
        orphans,
        changed,
    })
}

/// The state a report entry observes; `None` for what is not an observation (an error, a
/// refusal for lack of resources, `UNSPECIFIED`).
fn observed(entry: &ReportedInstance) -> Option<Observed> {
    match (entry.state, entry.message.as_deref()) {
        (ReportedState::Running, _) => Some(Observed::Running),
        (ReportedState::Paused, _) => Some(Observed::Paused),
        (ReportedState::Stopped, Some(m)) if m.starts_with(RESOURCES_EXHAUSTED) => None,
        (ReportedState::Stopped, _) => Some(Observed::Stopped),
        (ReportedState::Error | ReportedState::Unspecified, _) => None,
    }
}

/// Whether an entry surely decides no event on the instance `view` describes.
fn unchanged(entry: &ReportedInstance, view: &ReportView) -> bool {
    if view.rebinds(entry.identity_rebound == Some(true)) {
        return false;
    }
    match (entry.state, observed(entry)) {
        // Asks nothing.
        (ReportedState::Unspecified, _) => true,
        (_, Some(o)) => view.unchanged_by(o, entry.addresses.as_deref().unwrap_or_default()),
        (_, None) => false,
    }
}

/// What one entry of a report asks of the instance it names: an observed state (a recovery
/// when the instance was lost), a failure, a refusal for lack of resources, and the guest's
/// addresses. `UNSPECIFIED` asks nothing.
fn commands_for(
    entry: &ReportedInstance,
    instance: &Instance,
    node_id: &str,
) -> Vec<InstanceCommand> {
    let mut commands = Vec::new();
    match (entry.state, entry.message.as_deref(), observed(entry)) {
        (ReportedState::Unspecified, _, _) => return commands,
        (_, _, Some(observed)) => commands.push(match instance.state {
            InstanceState::Lost => InstanceCommand::Recover(observed),
            _ => InstanceCommand::Observe(observed),
        }),
        (ReportedState::Error, m, None) => commands.push(InstanceCommand::Fail(Failure::Runtime {
            message: m.unwrap_or("the runtime reported an error").to_string(),
        })),
        (_, m, None) => commands.push(InstanceCommand::ReportResourcesExhausted {
            node_id: node_id.to_string(),
            message: m.unwrap_or_default().to_string(),
        }),
    }
    if let Some(addresses) = entry.addresses.clone().filter(|a| !a.is_empty()) {
        commands.push(InstanceCommand::RecordAddresses {
            addresses,
            mode: AddressMode::Add,
        });
    }
    if entry.identity_rebound == Some(true) {
        commands.push(InstanceCommand::ReboundIdentity);
    }
    commands
}

/// Holds a reported instance's addresses to a shape, in place: each an IPv4 or IPv6 address
/// (a `/prefix` suffix is dropped, IPv6 is written in its canonical form), at most
/// [`MAX_ADDRESSES`] of them. A host's word is recorded in the log and shown to the tenant.
fn check_addresses(entry: usize, addresses: &mut [String]) -> Result<(), DomainError> {
    let field = || format!("instances[{entry}].addresses");
    if addresses.len() > MAX_ADDRESSES {
        return Err(DomainError::invalid_input(
            field(),
            format!("at most {MAX_ADDRESSES} addresses"),
        ));
    }
    for a in addresses {
        let (ip, prefix) = a.split_once('/').unwrap_or((a, ""));
        let parsed: std::net::IpAddr = ip.parse().map_err(|_| {
            DomainError::invalid_input(field(), "each must be an IPv4 or IPv6 address")
        })?;
        let max = if parsed.is_ipv4() { 32 } else { 128 };
        if !prefix.is_empty() && prefix.parse::<u8>().map_or(true, |p| p > max) {
            return Err(DomainError::invalid_input(field(), "a bad prefix length"));
        }
        // The IPv4 parser takes only the canonical dotted quad: such an entry (nearly every
        // one) is kept as it came, without a new string.
        if !(parsed.is_ipv4() && prefix.is_empty()) {
            *a = parsed.to_string();
        }
    }
    Ok(())
}

/// Locks a node's row to commit, so one node's reports and liveness decisions apply one at a
/// time, and answers the node as its row holds it (the projection doubles as the aggregate's
/// snapshot; it moves only with the node's events, inline). `NOT_FOUND` when there is no such
/// node.
///
/// With `beat` (a report's time and applied generation), the same statement notes when the
/// node last reported (liveness reads it) and the spec generation it applied (a deleting volume
/// is released once its host applied a spec without it). Not events: they change every few
/// seconds and nothing is decided from their history.
async fn lock_node(
    tx: &mut PgConnection,
    node_id: &str,
    beat: Option<(chrono::DateTime<Utc>, Option<i64>)>,
) -> Result<Node, CommandError> {
    let row: Option<(String, String, sqlx::types::Json<Vec<String>>, i64)> = sqlx::query_as(
        "WITH node AS (SELECT pool_id, state, orphans, version FROM nodes WHERE id = $1
                        FOR UPDATE),
              beat AS (INSERT INTO node_heartbeats (node_id, last_report_at, applied_generation)
                       SELECT $1, $2, $3 FROM node WHERE $4
                       ON CONFLICT (node_id) DO UPDATE
                          SET last_report_at = excluded.last_report_at,
                              applied_generation = coalesce(excluded.applied_generation,
                                                            node_heartbeats.applied_generation))
         SELECT pool_id, state, orphans, version FROM node",
    )
    .bind(node_id)
    .bind(beat.map(|(at, _)| at))
    .bind(beat.and_then(|(_, generation)| generation))
    .bind(beat.is_some())
    .fetch_optional(&mut *tx)
    .await?;
    let Some((pool_id, state, orphans, version)) = row else {
        return Err(DomainError::NotFound {
            what: format!("node {node_id}"),
        }
        .into());
    };
    let liveness = NodeLiveness::from_column(&state)
        .ok_or_else(|| DomainError::invalid_state(format!("node {node_id} is {state}")))?;
    Ok(Node {
        id: node_id.to_string(),
        pool_id,
        liveness,
        orphans: orphans.0,
        version: version as u64,
    })
}

/// Live instances placed on a node, by id, their rows locked in id order (the lock order).
async fn lock_all_placed(
    tx: &mut PgConnection,
    node_id: &str,
) -> Result<BTreeMap<String, Instance>, CommandError> {
    let rows = vps_projections::instances::reads::lock_all_placed(tx, node_id).await?;
    Ok(rows.into_iter().map(|i| (i.id.clone(), i)).collect())
}

/// Locks the rows of `ids` still live on `node_id`, in id order, and answers them as locked.
async fn lock_placed(
    tx: &mut PgConnection,
    node_id: &str,
    ids: &[String],
) -> Result<Vec<Instance>, CommandError> {
    if ids.is_empty() {
        return Ok(Vec::new());
    }
    Ok(vps_projections::instances::reads::lock_placed(tx, node_id, ids).await?)
}

/// Marks a silent node lost and its instances lost (`node.lost`, `instance.lost`). Returns the
/// instances that changed.
pub async fn mark_node_lost(ctx: &Ctx, node_id: &str) -> Result<Vec<String>, CommandError> {
    transaction(ctx, node_id, async |tx| {
        let now = ctx.clock.now();
        let before = Some(lock_node(tx, node_id, None).await?);
        let events = decide(before.as_ref(), &NodeCommand::Lose)?;
        if events.is_empty() {
            return Ok(Vec::new());
        }
        record_events(ctx, tx, node_id, before.as_ref(), events, None).await?;
        let mut changed = Vec::new();
        for (id, instance) in lock_all_placed(tx, node_id).await? {
            if apply_commands(ctx, tx, &instance, &[InstanceCommand::Lose], now)
                .await?
                .is_some()
            {
                changed.push(id);
            }
        }
        Ok(changed)
    })
    .await
}

/// The sealed user data of an instance placed on `node_id`; `NOT_FOUND` for anything else.
pub async fn node_secret(
    ctx: &Ctx,
    node_id: &str,
    reference: &str,
) -> Result<String, CommandError> {
    let not_found = || {
        CommandError::Domain(DomainError::NotFound {
            what: format!("secret {reference}"),
        })
    };
    let instance_id = reference.strip_prefix("secret://").ok_or_else(not_found)?;
    let mut conn = ctx.pool.acquire().await?;
    let placed =
        vps_projections::instances::reads::placed_on(&mut conn, instance_id, node_id).await?;
    if !placed {
        return Err(not_found());
    }
    let value = crate::secrets::open(&mut conn, &ctx.secrets, reference)
        .await?
        .ok_or_else(not_found)?;
    String::from_utf8(value).map_err(|_| not_found())
}

#[cfg(test)]
mod tests {
    use super::check_addresses;

    #[test]
    fn addresses_lose_their_prefix_and_take_their_canonical_form() {
        let mut addresses: Vec<String> = ["10.0.0.5", "10.0.0.6/24", "FD00:0::1/64", "fd00::2"]
            .map(String::from)
            .to_vec();
        check_addresses(0, &mut addresses).unwrap();
        assert_eq!(addresses, ["10.0.0.5", "10.0.0.6", "fd00::1", "fd00::2"]);
    }

    #[test]
    fn a_malformed_address_or_prefix_is_refused_naming_the_entry() {
        for bad in ["010.0.0.5", "10.0.0.5/33", "fd00::1/129", "host"] {
            let mut addresses = vec![bad.to_string()];
            let refused = check_addresses(3, &mut addresses).unwrap_err();
            assert!(
                refused.to_string().contains("instances[3].addresses"),
                "{bad}: {refused}"
            );
        }
    }
}
