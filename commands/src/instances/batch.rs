//! Batch admission (group commit): one admitter task takes every create waiting at that moment
//! and admits them in one transaction with one commit, like Nomad's plan applier. Facts are
//! read once per batch (per pool, flavor, image and tenant; the first read also takes the
//! pool's nodes, a run of free addresses and the instances the batch's ids already name), each
//! create is decided by the same pure `admit` on the facts the creates before it left, the
//! booked nodes are locked and checked once before the writes, and the quota is confirmed on
//! the rows the charge itself answers. A batch of one costs seven round trips with `BEGIN`
//! and `COMMIT`. Each caller gets its own answer: a refused create never
//! fails the others. If the batch as a whole fails (a race with another replica, a database
//! error), every create in it is admitted again on its own.
//!
//! The admitter keeps the node rows it read, with its own bookings on them, for the next
//! batches (up to [`NODES_KEPT`]): a pool's 64 nodes were most of a lone create's read. Other
//! writers change nodes meanwhile, so what the kept rows decide is checked on the locked rows
//! before the writes (a node no longer as it was, or fuller than the batch thinks, fails the
//! batch), and a create they leave unplaced (room freed elsewhere may not be in them) sends the
//! batch back to be decided on rows read afresh; so does any failure of a batch decided on
//! kept rows.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::mem::take;
use std::net::Ipv4Addr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sqlx::pool::PoolConnection;
use sqlx::{Connection, PgConnection, Postgres};
use tokio::sync::{mpsc, oneshot};
use tracing::Instrument;
use vps_domain::aggregate::Aggregate;
use vps_domain::authz::InstanceDraft;
use vps_domain::instance::{
    self as domain, Admission, AdmissionFacts, AdmissionPool, Instance, InstanceEvent,
};
use vps_domain::placement::NodeCandidate;
use vps_domain::quota::{charge_of, Amounts};
use vps_domain::resources::Shape;
use vps_domain::DomainError;
use vps_events::NewEvent;
use vps_projections::instances::{admission, ChargedQuota};

use super::{create_command, facts, CreateInput};
use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::commit;
use crate::record::new_id;
use crate::secrets;
use crate::stream::fold_onto;

/// The most creates one batch admits.
pub const MAX_BATCH: usize = 128;

/// How long the admitter decides on node rows it read before: new nodes and other writers'
/// bookings reach its placements within this.
pub const NODES_KEPT: Duration = Duration::from_secs(1);

/// The node rows of each pool the admitter read (with its own bookings on them since), and
/// when it read them.
#[derive(Default)]
struct KeptNodes {
    read: HashMap<String, Instant>,
    rows: HashMap<String, Vec<NodeCandidate>>,
}

impl KeptNodes {
    /// Hands a batch the rows read less than [`NODES_KEPT`] ago. They are the batch's now: it
    /// gives them back, with its bookings, through [`KeptNodes::keep`] once it committed.
    fn take(&mut self) -> HashMap<String, Vec<NodeCandidate>> {
        self.read.retain(|_, at| at.elapsed() < NODES_KEPT);
        let read = &self.read;
        std::mem::take(&mut self.rows)
            .into_iter()
            .filter(|(pool, _)| read.contains_key(pool))
            .collect()
    }

    /// Keeps a committed batch's rows. A pool's read time stays that of its rows: the batch
    /// that started at `started` read those it was not handed.
    fn keep(&mut self, started: Instant, rows: HashMap<String, Vec<NodeCandidate>>) {
        self.read.retain(|pool, _| rows.contains_key(pool));
        for pool in rows.keys() {
            self.read.entry(pool.clone()).or_insert(started);
        }
        self.rows = rows;
    }

    /// Forgets every row (a batch failed on them, or failed outright).
    fn forget(&mut self) {
        self.read.clear();
        self.rows.clear();
    }
}

/// Hands creates to the admitter task. Cheap to clone.
#[derive(Clone)]
pub struct Admitter {
    jobs: mpsc::Sender<Job>,
}

struct Job {
    ctx: Ctx,
    id: String,
    input: CreateInput,
    gate: Gate,
    reply: oneshot::Sender<Result<Instance, CommandError>>,
}

/// The caller's policy decision on a create's draft, made in the batch on the facts it read
/// (see [`domain::Policy`]): one read serves the decision and the admission.
pub type Gate = Arc<dyn Fn(&str, &InstanceDraft) -> Result<(), DomainError> + Send + Sync>;

impl Admitter {
    /// Starts the admitter task (it ends when every `Admitter` is dropped).
    pub fn start() -> Admitter {
        let (jobs, queue) = mpsc::channel(4 * MAX_BATCH);
        tokio::spawn(run(queue));
        Admitter { jobs }
    }

    /// Admits an instance (or answers the one this idempotency key already made), in the next
    /// batch, if `gate` allows its draft.
    pub async fn create(
        &self,
        ctx: &Ctx,
        input: CreateInput,
        gate: Gate,
    ) -> Result<Instance, CommandError> {
        domain::check_user_data(input.user_data.as_deref())?;
        let id = super::instance_id(ctx, &input);
        let (reply, answer) = oneshot::channel();
        let job = Job {
            ctx: ctx.clone(),
            id,
            input: input.clone(),
            gate: gate.clone(),
            reply,
        };
        if self.jobs.send(job).await.is_err() {
            return super::create(ctx, input, &*gate).await;
        }
        match answer.await {
            Ok(answer) => answer,
            Err(_) => super::create(ctx, input, &*gate).await,
        }
    }
}

async fn run(mut queue: mpsc::Receiver<Job>) {
    let mut own = None;
    let mut kept = KeptNodes::default();
    while let Some(first) = queue.recv().await {
        let mut batch = vec![first];
        while batch.len() < MAX_BATCH {
            match queue.try_recv() {
                Ok(job) => batch.push(job),
                Err(_) => break,
            }
        }
        let span = tracing::info_span!("admit_batch", creates = batch.len());
        metrics::histogram!("vps_admission_batch_size").record(batch.len() as f64);
        admit(batch, &mut own, &mut kept).instrument(span).await;
    }
}

/// Admits a batch; creates that share an id with an earlier one of the batch, and every create
/// of a batch that failed as a whole, are admitted on their own. A batch decided on kept node
/// rows that failed is decided once more on rows read afresh first.
async fn admit(batch: Vec<Job>, own: &mut Option<PoolConnection<Postgres>>, kept: &mut KeptNodes) {
    let mut seen = HashSet::new();
    let (first, again): (Vec<Job>, Vec<Job>) = batch
        .into_iter()
        .partition(|job| seen.insert(job.id.clone()));
    let given = kept.take();
    let started = Instant::now();
    let decided_on_kept = !given.is_empty();
    let mut outcome = admit_together(&first, own, given).await;
    if outcome.is_err() && decided_on_kept {
        kept.forget();
        outcome = admit_together(&first, own, HashMap::new()).await;
    }
    let alone = match outcome {
        Ok((answers, nodes)) => {
            kept.keep(started, nodes);
            for (job, answer) in first.into_iter().zip(answers) {
                let _ = job.reply.send(answer);
            }
            again
        }
        Err(e) => {
            // The connection may be the cause (the database restarted): the next batch takes
            // another.
            *own = None;
            kept.forget();
            tracing::debug!(error = %e, "batch admission failed; admitting one by one");
            first.into_iter().chain(again).collect()
        }
    };
    for job in alone {
        tokio::spawn(async move {
            let answer = super::create(&job.ctx, job.input, &*job.gate).await;
            let _ = job.reply.send(answer);
        });
    }
}

/// Every create's answer, and the batch's node rows with its bookings on them.
type Admitted = (
    Vec<Result<Instance, CommandError>>,
    HashMap<String, Vec<NodeCandidate>>,
);

/// One transaction for the whole batch, placing on `nodes` (rows read before, per pool) where
/// given; `Err` when it must be admitted again.
async fn admit_together(
    jobs: &[Job],
    own: &mut Option<PoolConnection<Postgres>>,
    nodes: HashMap<String, Vec<NodeCandidate>>,
) -> Result<Admitted, CommandError> {
    let ctx = &jobs[0].ctx;
    let conn = match own {
        Some(conn) => conn,
        None => own.insert(ctx.pool.acquire().await?),
    };
    let mut tx = conn.begin_with(vps_pg::connect::BEGIN_KEYED).await?;
    let now = ctx.clock.now();
    let kept_pools: HashSet<String> = nodes.keys().cloned().collect();
    let mut known = Known::new(jobs.iter().map(|j| j.id.clone()).collect());
    known.nodes = nodes;
    let mut decided = Vec::with_capacity(jobs.len());
    for job in jobs {
        let facts = known.facts(&mut tx, &job.id, &job.input).await?;
        let create = create_command(&job.ctx, &job.id, &job.input, &Default::default());
        let admitted = domain::admit(&facts, create, &new_id("alloc"), now, &*job.gate);
        decided.push(match admitted {
            Err(refused) => {
                known.give_back(&job.input, facts);
                Decided::Answer(Box::new(Err(refused.into())))
            }
            Ok(Admission::Replay(existing)) => {
                known.give_back(&job.input, facts);
                Decided::Answer(Box::new(Ok(*existing)))
            }
            Ok(Admission::Admit(events)) => {
                let instance = domain::fold_now(&events, now)?;
                known.keep(&job.input, &instance, facts);
                Decided::Record(events)
            }
        });
    }
    known.placed_on_kept(&kept_pools)?;
    // Placement changes only the kept rows' bookings, which the check reads afresh.
    let seen: Vec<&NodeCandidate> = kept_pools
        .iter()
        .filter_map(|pool| known.nodes.get(pool))
        .flatten()
        .collect();
    facts::confirm_bookings_seen(&mut tx, &known.bookings(), &seen).await?;
    let (answers, charged) = record(&mut tx, jobs, decided).await?;
    known.confirm_quotas(&mut tx, &charged).await?;
    commit(ctx, tx).await?;
    Ok((answers, known.rows_to_keep()))
}

/// What the batch decided for one create.
enum Decided {
    /// Answered without recording anything (a refusal, a replay).
    Answer(Box<Result<Instance, CommandError>>),
    /// A new instance's events.
    Record(Vec<InstanceEvent>),
}

/// Seals the new instances' user data, appends their streams and projects them, each with one
/// statement for the whole batch; answers every create, new instances folded with their
/// recorded times, and the quota rows the projection charged.
async fn record(
    tx: &mut PgConnection,
    jobs: &[Job],
    decided: Vec<Decided>,
) -> Result<(Vec<Result<Instance, CommandError>>, Vec<ChargedQuota>), CommandError> {
    let new: Vec<(&Job, &Vec<InstanceEvent>)> = jobs
        .iter()
        .zip(&decided)
        .filter_map(|(job, d)| match d {
            Decided::Record(events) => Some((job, events)),
            Decided::Answer(_) => None,
        })
        .collect();
    if !new.is_empty() {
        let data: Vec<(String, String)> = new
            .iter()
            .map(|(job, _)| {
                (
                    secrets::user_data_ref(&job.id),
                    super::user_data(&job.id, &job.input),
                )
            })
            .collect();
        let sealed: Vec<(&str, &str, &[u8])> = new
            .iter()
            .zip(&data)
            .map(|((job, _), (r, u))| (r.as_str(), job.id.as_str(), u.as_bytes()))
            .collect();
        secrets::seal_many(tx, &jobs[0].ctx.secrets, &sealed).await?;
    }
    let streams: Vec<(String, Vec<NewEvent>)> = new
        .iter()
        .map(|(job, events)| {
            let metadata = job.ctx.metadata(Some(&job.input.tenant_id));
            let stream = Instance::stream(&job.id);
            (
                stream,
                events.iter().map(|e| new_event(e, &metadata)).collect(),
            )
        })
        .collect();
    let stored = match streams.is_empty() {
        true => Vec::new(),
        false => vps_events::append_new_streams(tx, &streams).await?,
    };
    let mut runs: Vec<&[vps_events::RecordedEvent]> = Vec::new();
    let mut rest = stored.as_slice();
    for (_, events) in &new {
        let (run, later) = rest.split_at(events.len());
        runs.push(run);
        rest = later;
    }
    let charged = vps_projections::instances::apply_new(tx, &runs).await?;
    Ok((answers(decided, &runs)?, charged))
}

fn new_event(event: &InstanceEvent, metadata: &vps_events::Metadata) -> NewEvent {
    NewEvent {
        id: crate::record::event_id(),
        event_type: event.event_type().to_string(),
        data: event.data(),
        metadata: metadata.clone(),
    }
}

/// Every create's answer: new instances folded once from their recorded events.
fn answers(
    decided: Vec<Decided>,
    runs: &[&[vps_events::RecordedEvent]],
) -> Result<Vec<Result<Instance, CommandError>>, CommandError> {
    let mut runs = runs.iter();
    decided
        .into_iter()
        .map(|d| match d {
            Decided::Answer(answer) => Ok(*answer),
            Decided::Record(events) => {
                let id = events.first().map_or("", |e| e.instance_id());
                // `record` cut one run per new instance: a missing run folds to NOT_FOUND.
                let run = runs.next().copied().unwrap_or_default();
                let times = run.iter().map(|r| r.recorded_at);
                fold_onto::<Instance>(id, None, events.iter().zip(times)).map(Ok)
            }
        })
        .collect()
}

/// What the batch has read so far, kept up to date with what it admitted.
#[derive(Default)]
pub(super) struct Known {
    /// The instances the batch's ids already name (replays and conflicts).
    existing: HashMap<String, Instance>,
    /// The batch's ids whose instances are not read yet.
    unread: Vec<String>,
    pools: HashMap<(String, String), Option<AdmissionPool>>,
    shapes: HashMap<(String, String), Option<Shape>>,
    /// Images the tenant may use: whether each is verified.
    images: HashMap<(String, String), Option<bool>>,
    quotas: HashMap<(String, String), (Amounts, Amounts)>,
    nodes: HashMap<String, Vec<NodeCandidate>>,
    addresses: HashMap<String, VecDeque<Ipv4Addr>>,
    /// How many creates the batch holds: at most that many addresses are claimed at once.
    creates: usize,
    /// Every address the batch claimed, per pool (its locks do not hide them from it).
    held: HashMap<String, Vec<String>>,
    /// Instances admitted, for the confirmations.
    admitted: Vec<Instance>,
}

impl Known {
    /// What the creates of `ids` start from: nothing read yet (the instances those ids already
    /// name come with the first create's facts).
    pub(super) fn new(ids: Vec<String>) -> Known {
        Known {
            creates: ids.len(),
            unread: ids,
            ..Known::default()
        }
    }

    /// The facts of one create, read where the batch has not read them yet.
    pub(super) async fn facts(
        &mut self,
        tx: &mut PgConnection,
        id: &str,
        input: &CreateInput,
    ) -> Result<AdmissionFacts, CommandError> {
        let (pool_id, tenant) = (input.pool_id.clone(), input.tenant_id.clone());
        let key = (pool_id.clone(), input.flavor.clone());
        let image = (input.image_id.clone(), tenant.clone());
        let offer = (pool_id.clone(), tenant.clone());
        let known = self.pools.contains_key(&offer)
            && self.shapes.contains_key(&key)
            && self.images.contains_key(&image)
            && self.quotas.contains_key(&offer);
        if !known || !self.unread.is_empty() {
            self.read(tx, input).await?;
        }
        let existing = self.existing.remove(id);
        if existing.is_some() {
            return Ok(AdmissionFacts {
                existing,
                ..AdmissionFacts::default()
            });
        }
        let pool = self.pools[&offer].clone();
        let (quota_max, quota_used) = self.quotas[&offer].clone();
        let mut facts = AdmissionFacts {
            shape: self.shapes[&key].clone(),
            image_visible: self.images[&image].is_some(),
            image_verified: self.images[&image] == Some(true),
            quota_max,
            quota_used,
            ..AdmissionFacts::default()
        };
        if let Some(p) = pool.as_ref().filter(|p| p.kind == domain::PoolKind::Hosted) {
            facts.nodes = self.nodes(tx, &pool_id).await?;
            if p.has_range {
                facts.free_address = self.address(tx, &pool_id).await?;
            }
        }
        facts.pool = pool;
        Ok(facts)
    }

    /// Reads `input`'s facts in one statement, with the pool's nodes and a run of its free
    /// addresses where the batch holds none yet, and (once) the instances the batch's ids
    /// name. What the batch already holds (its bookings on the quota and the nodes) is kept.
    async fn read(
        &mut self,
        tx: &mut PgConnection,
        input: &CreateInput,
    ) -> Result<(), CommandError> {
        let pool_id = &input.pool_id;
        let offer = (pool_id.clone(), input.tenant_id.clone());
        let held = self.held.get(pool_id).cloned().unwrap_or_default();
        let claimed = self.addresses.get(pool_id).is_some_and(|a| !a.is_empty());
        let reads = facts::PoolReads {
            nodes: !self.nodes.contains_key(pool_id),
            addresses: if claimed {
                0
            } else {
                self.creates.max(1) as i64
            },
            held: &held,
            instances: &std::mem::take(&mut self.unread),
        };
        let read = facts::create_facts(tx, input, reads).await?;
        self.existing
            .extend(read.existing.into_iter().map(|i| (i.id.clone(), i)));
        if reads.nodes {
            self.nodes.insert(pool_id.clone(), read.nodes);
        }
        self.held
            .entry(pool_id.clone())
            .or_default()
            .extend(read.addresses.iter().map(|a| a.to_string()));
        self.addresses
            .entry(pool_id.clone())
            .or_default()
            .extend(read.addresses);
        self.pools.entry(offer.clone()).or_insert(read.pool);
        self.shapes
            .entry((pool_id.clone(), input.flavor.clone()))
            .or_insert(read.shape);
        self.images
            .entry((input.image_id.clone(), input.tenant_id.clone()))
            .or_insert(read.image);
        self.quotas.entry(offer).or_insert(read.quota);
        Ok(())
    }

    /// The pool's node rows, lent to one create's facts: [`Known::keep`] or
    /// [`Known::give_back`] returns them before the next create's facts are read.
    async fn nodes(
        &mut self,
        tx: &mut PgConnection,
        pool_id: &str,
    ) -> Result<Vec<NodeCandidate>, CommandError> {
        match self.nodes.remove(pool_id) {
            Some(rows) => Ok(rows),
            None => Ok(admission::candidates(tx, pool_id, None).await?),
        }
    }

    /// Returns the node rows a create's facts borrowed (a hosted pool's), as they are.
    fn give_back(&mut self, input: &CreateInput, facts: AdmissionFacts) {
        if facts
            .pool
            .as_ref()
            .is_some_and(|p| p.kind == domain::PoolKind::Hosted)
        {
            self.nodes.insert(input.pool_id.clone(), facts.nodes);
        }
    }

    /// A free address of the pool: claimed in runs (a run per batch, usually), each locked to
    /// the batch's commit.
    async fn address(
        &mut self,
        tx: &mut PgConnection,
        pool_id: &str,
    ) -> Result<Option<Ipv4Addr>, CommandError> {
        let held = self.held.entry(pool_id.to_string()).or_default();
        let claimed = self.addresses.entry(pool_id.to_string()).or_default();
        if claimed.is_empty() {
            let more =
                admission::free_addresses(tx, pool_id, self.creates.max(1) as i64, held).await?;
            held.extend(more.iter().map(|a| a.to_string()));
            claimed.extend(more);
        }
        Ok(claimed.front().copied())
    }

    /// Keeps what admitting `instance` changed: its quota charge, its node's booking, its
    /// address.
    fn keep(&mut self, input: &CreateInput, instance: &Instance, mut facts: AdmissionFacts) {
        facts.book(instance);
        let quota = (input.pool_id.clone(), input.tenant_id.clone());
        self.quotas.insert(
            quota,
            (take(&mut facts.quota_max), take(&mut facts.quota_used)),
        );
        if facts.free_address.is_none() {
            if let Some(claimed) = self.addresses.get_mut(&input.pool_id) {
                claimed.pop_front();
            }
        }
        self.admitted.push(instance.clone());
        self.give_back(input, facts);
    }

    /// The hosted creates the batch admitted without a node: nothing fit.
    fn unplaced(&self) -> impl Iterator<Item = &Instance> {
        self.admitted
            .iter()
            .filter(|i| i.pool_kind == domain::PoolKind::Hosted && i.node_id.is_none())
    }

    /// `Err` when a create in a pool placed on kept rows (`kept_pools`) found no node: room
    /// freed since they were read is not in them, so the batch is decided again afresh.
    fn placed_on_kept(&self, kept_pools: &HashSet<String>) -> Result<(), CommandError> {
        match self.unplaced().find(|i| kept_pools.contains(&i.pool_id)) {
            Some(i) => Err(CommandError::Raced(format!(
                "no kept node of pool {} fits; reading them afresh",
                i.pool_id
            ))),
            None => Ok(()),
        }
    }

    /// The node rows worth keeping for the next batches: not those of a pool where a create
    /// found no node (on fresh rows), so a full pool's next creates read fresh rows at once
    /// instead of failing on kept ones first.
    fn rows_to_keep(self) -> HashMap<String, Vec<NodeCandidate>> {
        let full: HashSet<String> = self.unplaced().map(|i| i.pool_id.clone()).collect();
        let mut nodes = self.nodes;
        nodes.retain(|pool, _| !full.contains(pool));
        nodes
    }

    /// The shapes the batch booked on each node.
    fn bookings(&self) -> BTreeMap<String, Vec<&Shape>> {
        let mut booked: BTreeMap<String, Vec<&Shape>> = BTreeMap::new();
        for i in &self.admitted {
            if let Some(node_id) = &i.node_id {
                booked.entry(node_id.clone()).or_default().push(&i.shape);
            }
        }
        booked
    }

    /// Confirms that every quota charged still fits, each once: on the rows the projection
    /// answered (`charged`, locked to commit), or read again where it answered none.
    async fn confirm_quotas(
        &self,
        tx: &mut PgConnection,
        charged: &[ChargedQuota],
    ) -> Result<(), CommandError> {
        let mut deltas: HashMap<(&str, &str), vps_domain::quota::Delta> = HashMap::new();
        for i in &self.admitted {
            let delta = deltas.entry((&i.pool_id, &i.tenant_id)).or_default();
            for (resource, amount) in charge_of(&i.shape) {
                *delta.entry(resource).or_insert(0) += amount;
            }
        }
        for ((pool_id, tenant_id), delta) in deltas {
            let rows: Vec<(String, i64, i64)> = charged
                .iter()
                .filter(|c| c.0 == pool_id && c.1 == tenant_id)
                .map(|c| (c.2.clone(), c.3, c.4))
                .collect();
            if rows.is_empty() {
                facts::confirm_quota(tx, pool_id, tenant_id, &delta).await?;
            } else {
                facts::check_charged(rows, &delta)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(pool: &str) -> HashMap<String, Vec<NodeCandidate>> {
        let node = NodeCandidate {
            id: format!("{pool}-node"),
            state: vps_domain::placement::NodeState::Ready,
            runtimes: vec!["libvirt-kvm".into()],
            labels: BTreeMap::new(),
            capacity: Default::default(),
            allocated: Default::default(),
        };
        HashMap::from([(pool.to_string(), vec![node])])
    }

    /// Rows handed to a batch and given back keep the time they were read, so a pool's rows
    /// expire [`NODES_KEPT`] after their read however many batches used them; rows a batch
    /// read itself are dated at its start.
    #[test]
    fn kept_rows_expire_a_while_after_their_read_not_after_their_last_use() {
        let mut kept = KeptNodes::default();
        let long_ago = Instant::now() - NODES_KEPT;
        kept.keep(long_ago, rows("old"));
        assert!(
            kept.take().is_empty(),
            "rows read too long ago are handed out"
        );

        let read = Instant::now();
        kept.keep(read, rows("p"));
        let handed = kept.take();
        assert!(handed.contains_key("p"));
        assert!(
            kept.take().is_empty(),
            "handed rows stay with the kept ones"
        );
        // The batch that used them gives them back along with rows it read itself.
        let mut back = handed;
        back.extend(rows("q"));
        kept.keep(read + Duration::from_millis(500), back);
        assert_eq!(kept.read["p"], read, "using rows makes them no younger");
        assert_eq!(kept.read["q"], read + Duration::from_millis(500));
    }

    #[test]
    fn forgotten_rows_are_not_handed_out() {
        let mut kept = KeptNodes::default();
        kept.keep(Instant::now(), rows("p"));
        kept.forget();
        assert!(kept.take().is_empty());
    }
}
