//! `vps events list|tail`: the log, as a table for people or JSON lines for scripts.

use std::time::Duration;

use comfy_table::Table;
use sqlx::PgPool;
use vps_events::envelope::{cloud_event, subject};
use vps_events::read::{read_filtered, Filter};
use vps_events::{Cursor, RecordedEvent};

/// What to show.
pub struct ListOptions {
    /// Start after this cursor.
    pub after: Cursor,
    /// Type patterns.
    pub types: Vec<String>,
    /// Only this subject (`instance/inst_…`).
    pub subject: Option<String>,
    /// At most this many (list only).
    pub limit: i64,
    /// JSON lines instead of a table.
    pub json: bool,
}

fn filter(options: &ListOptions) -> Filter {
    Filter {
        types: options.types.clone(),
        stream: options
            .subject
            .as_deref()
            .map(vps_events::envelope::stream_of),
        tenant_id: None,
        whole_snapshot: false,
    }
}

/// Prints one page of the log.
pub async fn list(pool: &PgPool, options: &ListOptions) -> anyhow::Result<()> {
    let events = read_filtered(pool, options.after, &filter(options), options.limit).await?;
    if options.json {
        print_json(&events);
    } else {
        let mut table = Table::new();
        table.set_header(["cursor", "time", "type", "subject", "actor"]);
        for e in &events {
            table.add_row(row(e));
        }
        println!("{table}");
        if let Some(last) = events.last() {
            println!("next: --after {}", last.cursor());
        }
    }
    Ok(())
}

/// Prints the last few events, then every new one as it is appended, until interrupted.
pub async fn tail(pool: &PgPool, options: &ListOptions) -> anyhow::Result<()> {
    let filter = filter(options);
    let mut cursor = options.after;
    if cursor == Cursor::START {
        cursor = start_of_tail(pool, &filter).await?;
    }
    loop {
        let events = read_filtered(pool, cursor, &filter, 500).await?;
        if let Some(last) = events.last() {
            cursor = last.cursor();
        }
        if options.json {
            print_json(&events);
        } else {
            for e in &events {
                println!("{}", row(e).join("  "));
            }
        }
        if events.is_empty() {
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// The cursor just before the last 10 matching events.
async fn start_of_tail(pool: &PgPool, filter: &Filter) -> anyhow::Result<Cursor> {
    let mut cursor = Cursor::START;
    let mut recent: std::collections::VecDeque<Cursor> = Default::default();
    loop {
        let page = read_filtered(pool, cursor, filter, 5000).await?;
        let Some(last) = page.last() else { break };
        cursor = last.cursor();
        for e in page {
            recent.push_back(e.cursor());
            if recent.len() > 11 {
                recent.pop_front();
            }
        }
    }
    Ok(if recent.len() > 10 {
        recent[0]
    } else {
        Cursor::START
    })
}

fn row(e: &RecordedEvent) -> Vec<String> {
    vec![
        e.cursor().to_string(),
        e.recorded_at
            .to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
        e.event_type.clone(),
        subject(&e.stream),
        e.metadata.actor.clone().unwrap_or_default(),
    ]
}

fn print_json(events: &[RecordedEvent]) {
    for e in events {
        println!("{}", cloud_event(e));
    }
}
