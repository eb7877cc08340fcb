//! `vps call <group.method> [JSON]`: any API method from the command line, with `VPS_URL`
//! and `VPS_TOKEN`.

use anyhow::Context;
use serde_json::Value;

/// Calls the method and prints the answer; `Ok(false)` for an error answer.
pub async fn call(method: &str, body: Option<&str>, compact: bool) -> anyhow::Result<bool> {
    let (group, name) = method
        .split_once('.')
        .context("the method is `<group>.<method>`, e.g. `instances.get`")?;
    let base = std::env::var("VPS_URL").unwrap_or_else(|_| "http://127.0.0.1:8080".into());
    let token =
        std::env::var("VPS_TOKEN").context("set VPS_TOKEN to a token (`vps dev` prints them)")?;
    let body: Value = match body {
        Some(text) => serde_json::from_str(text).context("the body is not JSON")?,
        None => Value::Object(Default::default()),
    };
    let response = reqwest::Client::new()
        .post(format!(
            "{}/api/compute/{group}/{name}",
            base.trim_end_matches('/')
        ))
        .bearer_auth(token)
        .json(&body)
        .send()
        .await
        .with_context(|| format!("cannot reach {base}"))?;
    let ok = response.status().is_success();
    let answer: Value = response.json().await.context("the answer is not JSON")?;
    let text = if compact {
        answer.to_string()
    } else {
        serde_json::to_string_pretty(&answer)?
    };
    if ok {
        println!("{text}");
    } else {
        eprintln!("{text}");
    }
    Ok(ok)
}
