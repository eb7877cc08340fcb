//! The usage read models, projections of `usage.recorded` events (stream `tenant-<id>`):
//! `usage_records` (one row per record, behind `usage.list` and `vps usage export`) and
//! `usage_rollups` (per tenant, meter and UTC day: the sum of each hour by window start, and of
//! the day). Sums are exact `numeric` additions, so a replay in any batching rebuilds them
//! exactly.

use std::collections::{BTreeMap, HashSet};

use chrono::{DateTime, NaiveDate, Timelike, Utc};
use rust_decimal::Decimal;
use serde::Serialize;
use sqlx::postgres::PgArguments;
use sqlx::{Arguments, PgConnection, PgExecutor};
use vps_domain::usage::UsageRecord;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Most records one [`list`] call returns.
pub const MAX_PAGE: i64 = 1000;

/// Applies one `usage.recorded` event.
pub async fn apply(conn: &mut PgConnection, event: &RecordedEvent) -> Result<(), ProjectionError> {
    let record = UsageRecord::from_data(&event.data).map_err(|err| ProjectionError::Malformed {
        event_id: event.id.clone(),
        event_type: event.event_type.clone(),
        message: err.to_string(),
    })?;
    apply_records(conn, &[(event.id.clone(), &record)]).await
}

/// Applies many records, each with its event's id, with one statement per table (the metering
/// reactor records thousands at a time, and has them in hand: nothing is parsed back).
///
/// Idempotent: a record already projected is skipped, and only the records this call inserts
/// are added to the rollups. The metering reactor projects its records in a transaction of
/// their own, beside the append, and applies them again after a crash between the two.
pub async fn apply_records(
    conn: &mut PgConnection,
    records: &[(String, &UsageRecord)],
) -> Result<(), ProjectionError> {
    if records.is_empty() {
        return Ok(());
    }
    let ids: Vec<&str> = records.iter().map(|(id, _)| id.as_str()).collect();
    let all: Vec<&UsageRecord> = records.iter().map(|(_, r)| *r).collect();
    let inserted = insert_records(conn, &ids, &all).await?;
    let new: Vec<&UsageRecord> = records
        .iter()
        .filter(|(id, _)| inserted.contains(id.as_str()))
        .map(|(_, r)| *r)
        .collect();
    add_to_rollups(conn, &new).await?;
    Ok(())
}

/// [`apply_records`] into a table no record of `records` is in yet (a replay's scratch
/// table, whose records are the log's, each once): the records are copied, not upserted.
pub(crate) async fn copy_records(
    conn: &mut PgConnection,
    records: &[(String, &UsageRecord)],
) -> Result<(), ProjectionError> {
    if records.is_empty() {
        return Ok(());
    }
    const COLUMNS: [&str; 11] = [
        "id",
        "tenant_id",
        "meter",
        "resource_id",
        "pool_id",
        "identity_id",
        "unit",
        "quantity",
        "window_start",
        "window_end",
        "labels",
    ];
    vps_pg::copy::copy_rows(conn, "usage_records", &COLUMNS, records, |row, (id, r)| {
        row.field(&id.as_str())?;
        row.field(&r.tenant_id.as_str())?;
        row.field(&r.meter.as_str())?;
        row.field(&r.resource_id.as_str())?;
        row.field(&r.pool_id.as_str())?;
        row.field(&r.identity_id.as_deref())?;
        row.field(&r.unit.as_str())?;
        row.field(&r.quantity)?;
        row.field(&r.window_start)?;
        row.field(&r.window_end)?;
        row.jsonb(&r.labels)
    })
    .await?;
    let all: Vec<&UsageRecord> = records.iter().map(|(_, r)| *r).collect();
    add_to_rollups(conn, &all).await?;
    Ok(())
}

/// Inserts the records not projected yet; answers the ids it inserted.
async fn insert_records(
    conn: &mut PgConnection,
    ids: &[&str],
    records: &[&UsageRecord],
) -> Result<HashSet<String>, sqlx::Error> {
    let column = |f: fn(&UsageRecord) -> &str| records.iter().map(|r| f(r)).collect::<Vec<_>>();
    sqlx::query_scalar(
        "INSERT INTO usage_records (id, tenant_id, meter, resource_id, pool_id, identity_id, unit,
                                    quantity, window_start, window_end, labels)
         SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[],
                              $6::text[], $7::text[], $8::numeric[], $9::timestamptz[],
                              $10::timestamptz[], $11::jsonb[])
         ON CONFLICT DO NOTHING
         RETURNING id",
    )
    .bind(ids)
    .bind(column(|r| &r.tenant_id))
    .bind(column(|r| &r.meter))
    .bind(column(|r| &r.resource_id))
    .bind(column(|r| &r.pool_id))
    .bind(
        records
            .iter()
            .map(|r| r.identity_id.as_deref())
            .collect::<Vec<_>>(),
    )
    .bind(column(|r| &r.unit))
    .bind(records.iter().map(|r| r.quantity).collect::<Vec<_>>())
    .bind(records.iter().map(|r| r.window_start).collect::<Vec<_>>())
    .bind(records.iter().map(|r| r.window_end).collect::<Vec<_>>())
    .bind(
        records
            .iter()
            .map(|r| sqlx::types::Json(&r.labels))
            .collect::<Vec<_>>(),
    )
    .fetch_all(conn)
    .await
    .map(HashSet::from_iter)
}

/// Per (tenant, meter, day): the 24 hourly sums and the daily sum of `records`.
type Rollups = BTreeMap<(String, String, NaiveDate), ([Decimal; 24], Decimal)>;

fn rollups(records: &[&UsageRecord]) -> Rollups {
    let mut sums = Rollups::new();
    for r in records {
        let key = (
            r.tenant_id.clone(),
            r.meter.clone(),
            r.window_start.date_naive(),
        );
        let (hourly, daily) = sums.entry(key).or_default();
        hourly[r.window_start.hour() as usize] += r.quantity;
        *daily += r.quantity;
    }
    sums
}

async fn add_to_rollups(
    conn: &mut PgConnection,
    records: &[&UsageRecord],
) -> Result<(), sqlx::Error> {
    if records.is_empty() {
        return Ok(());
    }
    let sums = rollups(records);
    let keys: Vec<_> = sums.keys().collect();
    // The hourly sums of every row, flattened; row k takes elements 24(k-1)+1 ..= 24k.
    let hourly: Vec<Decimal> = sums.values().flat_map(|(h, _)| h.iter().copied()).collect();
    sqlx::query(
        "INSERT INTO usage_rollups (tenant_id, meter, day, hourly, daily)
         SELECT u.tenant_id, u.meter, u.day, ($4::numeric[])[(u.k - 1) * 24 + 1 : u.k * 24],
                u.daily
           FROM unnest($1::text[], $2::text[], $3::date[], $5::numeric[])
                WITH ORDINALITY AS u(tenant_id, meter, day, daily, k)
         ON CONFLICT (tenant_id, meter, day) DO UPDATE
            SET hourly = ARRAY(SELECT a + b
                                 FROM unnest(usage_rollups.hourly, excluded.hourly)
                                      WITH ORDINALITY AS x(a, b, i)
                                ORDER BY i),
                daily = usage_rollups.daily + excluded.daily",
    )
    .bind(keys.iter().map(|k| k.0.as_str()).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.1.as_str()).collect::<Vec<_>>())
    .bind(keys.iter().map(|k| k.2).collect::<Vec<_>>())
    .bind(&hourly)
    .bind(sums.values().map(|(_, d)| *d).collect::<Vec<_>>())
    .execute(conn)
    .await?;
    Ok(())
}

/// Which records a read wants.
#[derive(Debug, Clone)]
pub struct UsageQuery {
    /// One tenant's, or every tenant's (operators).
    pub tenant_id: Option<String>,
    /// Records whose window starts at or after this…
    pub from: DateTime<Utc>,
    /// …and before this.
    pub to: DateTime<Utc>,
    /// Only this meter.
    pub meter: Option<String>,
    /// Only this resource.
    pub resource_id: Option<String>,
    /// Only records after this one (its window start and id), in the read order.
    pub after: Option<(DateTime<Utc>, String)>,
    /// At most this many.
    pub limit: i64,
}

/// One record as `usage.list` answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageItem {
    /// The `usage.recorded` event's id.
    pub id: String,
    /// The meter (`vps.vcpu.hours`).
    pub meter: String,
    /// Exact decimal quantity, as a string.
    pub quantity: String,
    /// Its unit (`vcpu-hour`).
    pub unit: String,
    /// Start of the span the quantity covers.
    pub window_start: DateTime<Utc>,
    /// Its end.
    pub window_end: DateTime<Utc>,
    /// Who pays.
    pub tenant_id: String,
    /// The owning identity (absent for warm instances).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub identity_id: Option<String>,
    /// The metered resource.
    pub resource_id: String,
    /// Its pool.
    pub pool_id: String,
    /// The resource's labels while it accrued this.
    #[sqlx(json)]
    pub labels: vps_domain::labels::Labels,
}

/// Usage summed per value of one label key (cost per label), meter and unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UsageGroup {
    /// The label key grouped by.
    pub label: String,
    /// Its value; absent for the records of resources without the label.
    pub value: Option<String>,
    /// The meter.
    pub meter: String,
    /// Its unit.
    pub unit: String,
    /// The exact sum, as a string.
    pub quantity: String,
    /// How many records it sums.
    pub records: i64,
}

/// The `WHERE` clause of a [`UsageQuery`]: `$1` tenant, `$2`/`$3` window start range, `$4`
/// meter, `$5` resource.
const MATCHING: &str = "WHERE ($1::text IS NULL OR tenant_id = $1)
            AND window_start >= $2 AND window_start < $3
            AND ($4::text IS NULL OR meter = $4)
            AND ($5::text IS NULL OR resource_id = $5)";

/// The arguments `$1` to `$5` of [`MATCHING`] for `q`, to which a statement adds its own.
fn matching(q: &UsageQuery) -> Result<PgArguments, sqlx::Error> {
    let mut args = PgArguments::default();
    let encode = sqlx::Error::Encode;
    args.add(&q.tenant_id).map_err(encode)?;
    args.add(q.from).map_err(encode)?;
    args.add(q.to).map_err(encode)?;
    args.add(&q.meter).map_err(encode)?;
    args.add(&q.resource_id).map_err(encode)?;
    Ok(args)
}

/// Records matching `q`, by window start then id.
pub async fn list<'e>(
    db: impl PgExecutor<'e>,
    q: &UsageQuery,
) -> Result<Vec<UsageItem>, sqlx::Error> {
    let (after_start, after_id) = q.after.clone().unzip();
    let sql = format!(
        "SELECT id, meter, quantity::text, unit, window_start, window_end, tenant_id,
                identity_id, resource_id, pool_id, labels
           FROM usage_records {MATCHING}
            AND ($6::timestamptz IS NULL OR (window_start, id) > ($6, $7))
          ORDER BY window_start, id
          LIMIT $8"
    );
    sqlx::query_as_with(&sql, matching(q)?)
        .bind(after_start)
        .bind(after_id)
        .bind(q.limit)
        .fetch_all(db)
        .await
}

/// The records matching `q` (its `after` and `limit` aside) summed per value of label `key`,
/// meter and unit: by value (resources without the label last), then meter.
pub async fn group_by_label<'e>(
    db: impl PgExecutor<'e>,
    q: &UsageQuery,
    key: &str,
) -> Result<Vec<UsageGroup>, sqlx::Error> {
    let sql = format!(
        "SELECT $6::text AS label, labels->>$6 AS value, meter, unit, sum(quantity)::text AS quantity,
                count(*) AS records
           FROM usage_records {MATCHING}
          GROUP BY labels->>$6, meter, unit
          ORDER BY labels->>$6 NULLS LAST, meter, unit"
    );
    sqlx::query_as_with(&sql, matching(q)?)
        .bind(key)
        .fetch_all(db)
        .await
}

/// How many records match `q` (its `after` and `limit` aside).
pub async fn count<'e>(db: impl PgExecutor<'e>, q: &UsageQuery) -> Result<i64, sqlx::Error> {
    let sql = format!("SELECT count(*) FROM usage_records {MATCHING}");
    sqlx::query_scalar_with(&sql, matching(q)?)
        .fetch_one(db)
        .await
}

/// How many usage records there are (the metering bench's throughput).
pub async fn record_count<'e>(db: impl PgExecutor<'e>) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar("SELECT count(*) FROM usage_records")
        .fetch_one(db)
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_roll_up_by_the_hour_and_day_of_their_window_start() {
        let record = |start: i64, quantity: &str| UsageRecord {
            meter: "vps.vcpu.hours".into(),
            quantity: quantity.parse().unwrap(),
            unit: "vcpu-hour".into(),
            window_start: DateTime::from_timestamp(start, 0).unwrap(),
            window_end: DateTime::from_timestamp(start + 300, 0).unwrap(),
            tenant_id: "acme".into(),
            identity_id: None,
            resource_id: "inst_a".into(),
            pool_id: "pool_a".into(),
            labels: Default::default(),
        };
        let day = 1_800_000_000 - 1_800_000_000 % 86_400;
        let records = [
            record(day, "0.5"),
            record(day + 300, "0.25"),
            record(day + 3600, "1"),
            record(day + 86_400, "2"),
        ];
        let sums = rollups(&records.iter().collect::<Vec<_>>());
        assert_eq!(sums.len(), 2);
        let (hourly, daily) = sums.values().next().unwrap();
        assert_eq!(hourly[0], "0.75".parse().unwrap());
        assert_eq!(hourly[1], Decimal::ONE);
        assert_eq!(*daily, "1.75".parse().unwrap());
    }
}
