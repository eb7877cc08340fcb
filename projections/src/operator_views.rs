//! Pools, nodes, flavors and images as the API shows them: typed, so their answer schemas are
//! documented like every other answer's.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Serialize;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::{FromRow, PgExecutor, Row};
use vps_domain::operator::PoolPolicy;
use vps_domain::resources::{Capacity, Shape};

/// A pool (SPEC §5.1 `Pool`).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolView {
    /// `pool_…`.
    pub id: String,
    /// Unique name.
    pub name: String,
    /// `vps-host` or `provider`.
    pub class: String,
    /// A hosted pool's runtime.
    pub runtime: Option<String>,
    /// Host-loss policy.
    pub policy: PoolPolicy,
    /// A provider pool's account.
    pub provider_account_id: Option<String>,
    /// A hosted pool's IPv4 range, once set.
    pub ip_pool: Option<IpPool>,
    /// When it was created.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
    /// Its stream version.
    pub version: i64,
}

/// A pool's IPv4 range.
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
pub struct IpPool {
    /// The range (`10.0.0.0/24`).
    pub cidr: String,
    /// The gateway address.
    pub gateway: Option<String>,
}

/// A pool, or `None`.
pub async fn pool<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<Option<PoolView>, sqlx::Error> {
    one(db, &format!("{POOL_SELECT} WHERE id = $1"), id).await
}

/// Every pool, by name.
pub async fn pools<'e>(db: impl PgExecutor<'e>) -> Result<Vec<PoolView>, sqlx::Error> {
    let sql = format!("{POOL_SELECT} ORDER BY name");
    all(db, &sql, &[]).await
}

const POOL_SELECT: &str = "SELECT id, name, class, runtime, policy, provider_account_id, ip_cidr, ip_gateway, created_at, updated_at, version FROM pools";

/// Its IPv4 range (two columns) makes one field, present once its CIDR is set.
impl FromRow<'_, PgRow> for PoolView {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        let cidr: Option<String> = r.try_get(6)?;
        Ok(PoolView {
            id: r.try_get(0)?,
            name: r.try_get(1)?,
            class: r.try_get(2)?,
            runtime: r.try_get(3)?,
            policy: json(r, 4)?,
            provider_account_id: r.try_get(5)?,
            ip_pool: match cidr {
                Some(cidr) => Some(IpPool {
                    cidr,
                    gateway: r.try_get(7)?,
                }),
                None => None,
            },
            created_at: r.try_get(8)?,
            updated_at: r.try_get(9)?,
            version: r.try_get(10)?,
        })
    }
}

/// A node with what is booked on it (SPEC §5.1 `Node`).
#[derive(Debug, Clone, Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct NodeView {
    /// `node_…`.
    pub id: String,
    /// Its hosted pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// `ready`, `cordoned`, `lost`, …
    pub state: String,
    /// What it offers.
    pub capacity: Capacity,
    /// What its allocations book.
    pub allocated: Capacity,
    /// Placement labels.
    pub labels: BTreeMap<String, String>,
    /// Runtimes it advertises.
    pub runtimes: Vec<String>,
    /// CPU model.
    pub cpu_model: Option<String>,
    /// When its host last reported.
    pub last_report_at: Option<DateTime<Utc>>,
    /// Instances its host runs that the control plane does not know, as last announced.
    pub orphans: Vec<String>,
}

/// A node with what is allocated on it, or `None`.
pub async fn node<'e>(db: impl PgExecutor<'e>, id: &str) -> Result<Option<NodeView>, sqlx::Error> {
    one(db, &format!("{NODE_SELECT} WHERE n.id = $1"), id).await
}

/// Nodes, optionally of one pool, by name.
pub async fn nodes<'e>(
    db: impl PgExecutor<'e>,
    pool_id: Option<&str>,
) -> Result<Vec<NodeView>, sqlx::Error> {
    let sql =
        format!("{NODE_SELECT} WHERE ($1::text IS NULL OR n.pool_id = $1) ORDER BY n.name, n.id");
    all(db, &sql, &[pool_id]).await
}

const NODE_SELECT: &str = "SELECT n.id, n.pool_id, n.name, n.state, n.capacity, n.labels, n.runtimes, n.cpu_model, (SELECT h.last_report_at FROM node_heartbeats h WHERE h.node_id = n.id),
        n.booked_vcpu, n.booked_memory_gib, n.booked_disk_gib,
        coalesce((SELECT jsonb_agg(jsonb_build_object('model', a.gpu_model, 'count', a.gpus))
                    FROM node_allocations a WHERE a.node_id = n.id AND a.gpus > 0), '[]'),
        n.orphans
   FROM nodes n";

/// What is allocated on it is made of the booked columns and the GPU models' sums.
impl FromRow<'_, PgRow> for NodeView {
    fn from_row(r: &PgRow) -> Result<Self, sqlx::Error> {
        let booked = |i: usize| -> Result<u32, sqlx::Error> {
            Ok(u32::try_from(r.try_get::<i64, _>(i)?).unwrap_or(u32::MAX))
        };
        Ok(NodeView {
            id: r.try_get(0)?,
            pool_id: r.try_get(1)?,
            name: r.try_get(2)?,
            state: r.try_get(3)?,
            capacity: json(r, 4)?,
            labels: json(r, 5)?,
            runtimes: json(r, 6)?,
            cpu_model: r.try_get(7)?,
            last_report_at: r.try_get(8)?,
            allocated: Capacity {
                vcpu: booked(9)?,
                memory_gib: booked(10)?,
                disk_gib: booked(11)?,
                gpus: json(r, 12)?,
            },
            orphans: json(r, 13)?,
        })
    }
}

/// A flavor (SPEC §5.1 `Flavor`): its shape's fields beside its own.
#[derive(Debug, Clone, Serialize, FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FlavorView {
    /// `flv_…`.
    pub id: String,
    /// Its pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// What one instance books.
    #[serde(flatten)]
    #[sqlx(json)]
    pub shape: Shape,
    /// The provider offer it maps to.
    pub offer_id: Option<String>,
    /// No new instances of it.
    pub archived: bool,
    /// When it was created.
    pub created_at: DateTime<Utc>,
}

/// Flavors of a pool, by name.
pub async fn flavors<'e>(
    db: impl PgExecutor<'e>,
    pool_id: &str,
) -> Result<Vec<FlavorView>, sqlx::Error> {
    let sql = format!("{FLAVOR_SELECT} WHERE pool_id = $1 ORDER BY name");
    all(db, &sql, &[Some(pool_id)]).await
}

/// One flavor by id.
pub async fn flavor<'e>(
    db: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<FlavorView>, sqlx::Error> {
    one(db, &format!("{FLAVOR_SELECT} WHERE id = $1"), id).await
}

const FLAVOR_SELECT: &str =
    "SELECT id, pool_id, name, shape, offer_id, archived, created_at FROM flavors";

/// An image (SPEC §5.1 `Image`).
#[derive(Debug, Clone, Serialize, FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ImageView {
    /// The id it was registered under.
    pub id: String,
    /// Its tenant; absent for a public image.
    pub tenant_id: Option<String>,
    /// Every tenant may use it.
    pub public: bool,
    /// Where hosts fetch it.
    pub url: String,
    /// Its SHA-256 (hex).
    pub sha256: String,
    /// `qcow2`, `raw`, …
    pub format: String,
    /// Vetted by the operator.
    pub verified: bool,
    /// When it was (last) registered.
    pub created_at: DateTime<Utc>,
}

/// Images a caller can see: a tenant's own and public ones (operators: all), not deleted.
pub async fn images<'e>(
    db: impl PgExecutor<'e>,
    tenant_id: Option<&str>,
) -> Result<Vec<ImageView>, sqlx::Error> {
    let sql = format!(
        "{IMAGE_SELECT} WHERE NOT deleted AND ($1::text IS NULL OR tenant_id = $1 OR tenant_id IS NULL) ORDER BY id"
    );
    all(db, &sql, &[tenant_id]).await
}

/// One image by id, deleted or not.
pub async fn image<'e>(
    db: impl PgExecutor<'e>,
    id: &str,
) -> Result<Option<ImageView>, sqlx::Error> {
    one(db, &format!("{IMAGE_SELECT} WHERE id = $1"), id).await
}

const IMAGE_SELECT: &str = "SELECT id, tenant_id, tenant_id IS NULL AS public, url, sha256, format, verified, created_at FROM images";

/// The row `sql` selects with `$1` = `id`, decoded; `None` when there is none.
pub(crate) async fn one<'e, T>(
    db: impl PgExecutor<'e>,
    sql: &str,
    id: &str,
) -> Result<Option<T>, sqlx::Error>
where
    T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
{
    sqlx::query_as(sql).bind(id).fetch_optional(db).await
}

/// The rows `sql` selects with `params` as `$1`, `$2`, … (texts, possibly null), decoded.
pub(crate) async fn all<'e, T>(
    db: impl PgExecutor<'e>,
    sql: &str,
    params: &[Option<&str>],
) -> Result<Vec<T>, sqlx::Error>
where
    T: for<'r> FromRow<'r, PgRow> + Send + Unpin,
{
    let query = params
        .iter()
        .fold(sqlx::query_as(sql), |query, param| query.bind(*param));
    query.fetch_all(db).await
}

/// A `jsonb` column decoded into its type.
fn json<T: DeserializeOwned>(r: &PgRow, i: usize) -> Result<T, sqlx::Error> {
    Ok(r.try_get::<Json<T>, _>(i)?.0)
}
