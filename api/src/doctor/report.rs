//! How `vps doctor` prints findings: one line per check for people, or JSON.

use std::io::Write;
use std::time::Duration;

use super::{Ctx, Finding, Severity};
use crate::config::Config;

/// What all checks after the database's may take from the command line.
const BUDGET: Duration = Duration::from_secs(10);

/// `vps doctor [--json]`: opens the configured database without migrating it (a schema
/// behind is a finding), runs every check and prints them; the exit code is 1 on any error.
pub async fn command(config: &Config, json: bool) -> anyhow::Result<i32> {
    // Held until the end: an embedded cluster started here stops when it is dropped.
    let server = crate::database::server_url(config).await;
    let pool = match &server {
        Err(e) => Err(format!("{e:#}")),
        Ok((url, _)) => {
            let options = vps_events::DbOptions { max_connections: 4 };
            let url_shown = crate::database::redact(url);
            match tokio::time::timeout(BUDGET, vps_events::connect(url, &options)).await {
                Ok(Ok(pool)) => Ok(pool),
                Ok(Err(e)) => Err(format!("{url_shown} ({e})")),
                Err(_) => Err(format!("{url_shown} did not answer within {BUDGET:?}")),
            }
        }
    };
    let findings = super::run(Ctx {
        pool: pool.as_ref().map_err(String::as_str),
        config,
        budget: BUDGET,
    })
    .await;
    if let Ok(pool) = pool {
        pool.close().await;
    }
    Ok(print(&findings, json, &mut std::io::stdout().lock())?)
}

/// Writes `findings` as text (severity, check, message, then the fix when not ok) or as
/// `{"checks": [...]}`; answers the exit code: 1 when any finding is an error.
pub fn print(findings: &[Finding], json: bool, out: &mut impl Write) -> std::io::Result<i32> {
    if json {
        let document = serde_json::json!({ "checks": findings });
        writeln!(out, "{}", serde_json::to_string_pretty(&document)?)?;
    } else {
        let width = findings.iter().map(|f| f.check.len()).max().unwrap_or(0);
        for f in findings {
            write!(
                out,
                "{:<7}  {:<width$}  {}",
                f.severity.as_str(),
                f.check,
                f.message
            )?;
            match &f.fix {
                Some(fix) if f.severity != Severity::Ok => writeln!(out, " — fix: {fix}")?,
                _ => writeln!(out)?,
            }
        }
    }
    Ok(exit_code(findings))
}

/// 1 when any finding is an error, else 0.
pub fn exit_code(findings: &[Finding]) -> i32 {
    i32::from(findings.iter().any(|f| f.severity == Severity::Error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_per_check_with_the_fix_of_what_is_wrong_and_exit_1_on_an_error() {
        let findings = vec![
            Finding::ok("vps.database.reachable", "PostgreSQL 15 answers"),
            Finding::bad(
                "vps.nodes.liveness",
                Severity::Error,
                "1 node lost",
                "bring it back",
            ),
        ];
        let mut out = Vec::new();
        assert_eq!(print(&findings, false, &mut out).unwrap(), 1);
        let text = String::from_utf8(out).unwrap();
        assert_eq!(
            text,
            "ok       vps.database.reachable  PostgreSQL 15 answers\n\
             error    vps.nodes.liveness      1 node lost — fix: bring it back\n"
        );
        let mut out = Vec::new();
        assert_eq!(print(&findings[..1], true, &mut out).unwrap(), 0);
        let json: serde_json::Value = serde_json::from_slice(&out).unwrap();
        assert_eq!(json["checks"][0]["severity"], "ok");
        assert!(json["checks"][0].get("fix").is_none());
    }
}
