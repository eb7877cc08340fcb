//! `vps usage export|verify`: usage records for a billing import, and their proof against the
//! log.

use std::io::Write;

use chrono::{DateTime, Utc};
use indicatif::{ProgressBar, ProgressStyle};
use sqlx::PgPool;
use vps_domain::usage::Windows;
use vps_projections::usage::{self as views, UsageItem, UsageQuery};
use vps_reactors::usage::verify::{self, Difference};

/// How `export` writes records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// A header line, then one comma-separated line per record.
    Csv,
    /// One JSON object per line (the `usage.list` item).
    Jsonl,
}

/// The CSV columns, in order.
const COLUMNS: &[&str] = &[
    "id",
    "tenantId",
    "meter",
    "quantity",
    "unit",
    "windowStart",
    "windowEnd",
    "identityId",
    "resourceId",
    "poolId",
];

/// Streams every record whose window starts in `[from, to)` to `out`, page by page, with a
/// progress bar on standard error when it is a terminal. Returns how many were written.
pub async fn export(
    pool: &PgPool,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
    tenant_id: Option<String>,
    format: Format,
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let mut query = UsageQuery {
        tenant_id,
        from,
        to,
        meter: None,
        resource_id: None,
        after: None,
        limit: 5000,
    };
    let total = views::count(pool, &query).await?;
    let bar = ProgressBar::new(total as u64).with_style(
        ProgressStyle::with_template("exporting {bar:40} {pos}/{len} records ({per_sec})")
            .expect("static template"),
    );
    if format == Format::Csv {
        writeln!(out, "{}", COLUMNS.join(","))?;
    }
    let mut written = 0u64;
    loop {
        let page = views::list(pool, &query).await?;
        for item in &page {
            match format {
                Format::Csv => writeln!(out, "{}", csv_line(item))?,
                Format::Jsonl => writeln!(out, "{}", serde_json::to_string(item)?)?,
            }
        }
        written += page.len() as u64;
        bar.set_position(written);
        match page.last() {
            Some(last) if page.len() as i64 == query.limit => {
                query.after = Some((last.window_start, last.id.clone()));
            }
            _ => break,
        }
    }
    out.flush()?;
    bar.finish_and_clear();
    Ok(written)
}

/// Writes the records whose window starts in `[from, to)` summed per value of label `key`,
/// meter and unit (cost per label): CSV `label,value,meter,unit,quantity,records`, or one
/// JSON object per line. Returns how many groups were written.
pub async fn export_groups(
    pool: &PgPool,
    (from, to): (DateTime<Utc>, DateTime<Utc>),
    tenant_id: Option<String>,
    key: &str,
    format: Format,
    out: &mut impl Write,
) -> anyhow::Result<u64> {
    let query = UsageQuery {
        tenant_id,
        from,
        to,
        meter: None,
        resource_id: None,
        after: None,
        limit: 0,
    };
    let groups = views::group_by_label(pool, &query, key).await?;
    if format == Format::Csv {
        writeln!(out, "label,value,meter,unit,quantity,records")?;
    }
    for g in &groups {
        match format {
            Format::Csv => {
                let fields = [
                    g.label.clone(),
                    g.value.clone().unwrap_or_default(),
                    g.meter.clone(),
                    g.unit.clone(),
                    g.quantity.clone(),
                    g.records.to_string(),
                ];
                let line: Vec<String> = fields.iter().map(|f| csv_field(f)).collect();
                writeln!(out, "{}", line.join(","))?;
            }
            Format::Jsonl => writeln!(out, "{}", serde_json::to_string(g)?)?,
        }
    }
    out.flush()?;
    Ok(groups.len() as u64)
}

fn csv_line(item: &UsageItem) -> String {
    let time = |t: DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::AutoSi, true);
    [
        item.id.clone(),
        item.tenant_id.clone(),
        item.meter.clone(),
        item.quantity.clone(),
        item.unit.clone(),
        time(item.window_start),
        time(item.window_end),
        item.identity_id.clone().unwrap_or_default(),
        item.resource_id.clone(),
        item.pool_id.clone(),
    ]
    .iter()
    .map(|field| csv_field(field))
    .collect::<Vec<_>>()
    .join(",")
}

/// A field quoted when it holds a comma, a quote or a line break (RFC 4180).
fn csv_field(field: &str) -> String {
    if field.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", field.replace('"', "\"\""))
    } else {
        field.to_string()
    }
}

/// Recomputes the records of `[from, to)` from the log and compares; `Ok(false)` (exit 1) when
/// they differ, naming the first difference.
pub async fn verify(
    pool: &PgPool,
    windows: Windows,
    from: DateTime<Utc>,
    to: DateTime<Utc>,
) -> anyhow::Result<bool> {
    let report = verify::verify(pool, windows, from, to).await?;
    let Some(until) = report.until else {
        println!("nothing metered yet: the metering reactor has not settled a window");
        return Ok(true);
    };
    match report.first_difference {
        None => {
            println!(
                "usage records equal the log: {} records of windows from {from} to {until} recomputed",
                report.compared
            );
            Ok(true)
        }
        Some(difference) => {
            eprintln!(
                "usage records differ from the log: {}",
                describe(&difference)
            );
            Ok(false)
        }
    }
}

/// One line naming a difference.
pub fn describe(difference: &Difference) -> String {
    let json = |r| serde_json::to_string(r).expect("serialises");
    match difference {
        Difference::Missing(r) => {
            format!("missing from the log: {} {}", r.event_id(), json(&r.data()))
        }
        Difference::Extra(id, r) => {
            format!("in the log but not recomputed: {id} {}", json(&r.data()))
        }
        Difference::Changed {
            id,
            recorded,
            recomputed,
        } => format!(
            "{id} differs: the log has {}, the recomputation {}",
            json(&recorded.data()),
            json(&recomputed.data())
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_csv_field_is_quoted_only_when_it_must_be() {
        assert_eq!(csv_field("vps.vcpu.hours"), "vps.vcpu.hours");
        assert_eq!(csv_field("a,b"), "\"a,b\"");
        assert_eq!(csv_field("say \"hi\""), "\"say \"\"hi\"\"\"");
    }
}
