//! `vps.nats.reachable`: when `[nats]` is configured, the server answers and JetStream is on
//! (the publisher needs it). It connects with the client the publisher uses.

use std::time::Duration;

use tokio::time::Instant;
use vps_domain::network::redact_credentials;

use super::{Finding, Severity};
use crate::config::NatsConfig;

/// The check.
pub const REACHABLE: &str = "vps.nats.reachable";

/// Connects as the publisher does, with what is left of the budget, and asks for the
/// JetStream account.
pub async fn reachable(nats: Option<&NatsConfig>, deadline: Instant) -> anyhow::Result<Finding> {
    let Some(nats) = nats else {
        return Ok(Finding::ok(REACHABLE, "[nats] is not configured"));
    };
    let url = redact_credentials(&nats.url);
    // Leave a little of the budget so a refusal is reported as such, not as a timeout.
    let left = deadline
        .saturating_duration_since(Instant::now())
        .saturating_sub(Duration::from_millis(100))
        .max(Duration::from_millis(100));
    let fix = "check [nats] url (or VPS_NATS_URL) and that nats-server runs with JetStream \
               (nats-server -js); events wait in the log until it answers";
    let connected = tokio::time::timeout(
        left,
        async_nats::ConnectOptions::new()
            .name("vps-doctor")
            .connection_timeout(left)
            .connect(nats.url.as_str()),
    )
    .await;
    let client = match connected {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => {
            return Ok(Finding::bad(
                REACHABLE,
                Severity::Error,
                format!("cannot connect to NATS at {url}: {e}"),
                fix,
            ))
        }
        Err(_) => {
            return Ok(Finding::bad(
                REACHABLE,
                Severity::Error,
                format!("NATS at {url} did not answer within {left:?}"),
                fix,
            ))
        }
    };
    // The JetStream API's account request, read as plain JSON: the typed answer of the client
    // does not parse every server version's reply.
    let left = deadline.saturating_duration_since(Instant::now());
    let reply =
        tokio::time::timeout(left, client.request("$JS.API.INFO", Default::default())).await;
    let problem = match reply {
        Ok(Ok(message)) => match serde_json::from_slice::<serde_json::Value>(&message.payload) {
            Ok(answer) => answer
                .get("error")
                .map(|e| e["description"].as_str().unwrap_or("an error").to_string()),
            Err(e) => Some(format!("an unreadable answer ({e})")),
        },
        Ok(Err(e)) if e.kind() == async_nats::RequestErrorKind::NoResponders => {
            Some("nothing answers the JetStream API (started without -js?)".to_string())
        }
        Ok(Err(e)) => Some(e.to_string()),
        Err(_) => Some("no answer in time".to_string()),
    };
    Ok(match problem {
        None => Finding::ok(REACHABLE, format!("NATS at {url} answers, JetStream on")),
        Some(problem) => Finding::bad(
            REACHABLE,
            Severity::Error,
            format!("NATS at {url} answers but JetStream does not: {problem}"),
            fix,
        ),
    })
}
