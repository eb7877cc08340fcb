//! The node calls (`nodes.spec`, `nodes.report`, `nodes.secret`, `nodes.redeemTicket`) as a
//! host agent makes them, authenticated with its node token.

use std::collections::BTreeMap;
use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::spec::{CommandResult, NodeSpec, ReportEntry};

/// How long the server may take beyond a long poll's `waitMs`, and to answer any other call.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long an object's transfer (a snapshot, an image) may take.
const OBJECT_TIMEOUT: Duration = Duration::from_secs(300);

/// Who the client calls as, and where.
#[derive(Clone, Debug)]
pub struct NodeApiOptions {
    /// The server's root, e.g. `http://127.0.0.1:8080` (calls go to `/api/compute/nodes/*`).
    pub base_url: String,
    /// `node_…`.
    pub node_id: String,
    /// The node token, sent as a bearer token.
    pub token: String,
    /// Where this host accepts exec tunnels (`tcp://HOST:PORT`), stated in every report.
    pub tunnel_url: Option<String>,
    /// How long an idle pooled connection is kept: twice the report interval (see
    /// [`NodeApi::new`]).
    pub idle_timeout: Duration,
    /// What the host runs on, stated in every report.
    pub facts: Option<HostFacts>,
}

/// A report's statement of the host itself: the CPU model guests run with (memory snapshots
/// restore only on the same one) and the runtimes it can run.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct HostFacts {
    pub cpu_model: String,
    pub runtimes: Vec<String>,
}

/// What `nodes.report` answers.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ReportAnswer {
    /// Instances the host holds that no live row places there.
    pub orphans: Vec<String>,
}

#[derive(Deserialize)]
struct SecretAnswer {
    value: String,
}

/// What `nodes.redeemTicket` answers: what the tunnel opens, and the CA to check with.
#[derive(Clone, Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Redeemed {
    /// The instance the tunnel reaches.
    pub instance_id: String,
    /// The principal the client's certificate names.
    pub principal: String,
    /// When the client's certificate ends: a tunnel is refused after it.
    #[serde(default)]
    pub valid_before: Option<DateTime<Utc>>,
    /// The CA the certificate must be signed by.
    #[serde(default)]
    pub ca_public_key: Option<String>,
    /// A preview URL's tunnel (`sandboxes.expose`): the guest port to connect the stream to,
    /// as plain TCP with no SSH session. Absent (a server before preview URLs, or an exec
    /// ticket): the guest's `sshd`, as before.
    #[serde(default)]
    pub port: Option<u16>,
}

/// The server's error body, `{ code, message, details }`.
#[derive(Default, Deserialize)]
#[serde(default)]
struct ErrorBody {
    code: String,
    message: String,
}

/// Why a node call failed.
#[derive(Debug)]
pub enum CallError {
    /// No answer, or one that is not the expected JSON.
    Transport(reqwest::Error),
    /// A non-200 answer.
    Api {
        /// The HTTP status.
        status: u16,
        /// The SPEC's error code (`NOT_FOUND`, …).
        code: String,
        /// The server's message.
        message: String,
    },
}

impl CallError {
    /// A 4xx: asking again will not help (a 5xx or no answer may).
    pub fn is_refusal(&self) -> bool {
        matches!(self, CallError::Api { status, .. } if (400..500).contains(status))
    }
}

impl fmt::Display for CallError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CallError::Transport(error) => write!(f, "{error}"),
            CallError::Api {
                status,
                code,
                message,
            } => write!(f, "{code} ({status}): {message}"),
        }
    }
}

/// A client of the node calls, authenticated as one node. Cheap to clone.
#[derive(Clone)]
pub struct NodeApi {
    http: reqwest::Client,
    base_url: String,
    node_id: String,
    token: String,
    /// Where this host accepts exec tunnels, stated in every report.
    tunnel_url: Option<String>,
    facts: Option<HostFacts>,
}

impl NodeApi {
    /// A client for `options`.
    pub fn new(options: NodeApiOptions) -> Self {
        let http = reqwest::Client::builder()
            // The server is local: an HTTP(S)_PROXY in the environment must not capture it.
            .no_proxy()
            .connect_timeout(Duration::from_secs(5))
            // A pooled connection goes back to the pool a moment after its answer is read, and
            // a request sent in that moment races a new connection against it. The spare
            // connections such races leave behind each hold a task and buffers on the server
            // (about 15 a host over a busy minute, a third of the server's peak memory with
            // 100 hosts), so they close once idle for two report intervals; the connections in
            // use carry a report at least once an interval.
            .pool_idle_timeout(options.idle_timeout)
            .build()
            .expect("a plain HTTP client builds");
        Self {
            http,
            base_url: options.base_url.trim_end_matches('/').to_owned(),
            node_id: options.node_id,
            token: options.token,
            tunnel_url: options.tunnel_url,
            facts: options.facts,
        }
    }

    /// `nodes.spec`: the current spec, held by the server up to `wait` until it is newer than
    /// `after`.
    pub async fn spec(&self, after: Option<u64>, wait: Duration) -> Result<NodeSpec, CallError> {
        let wait_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
        let mut body = json!({ "nodeId": self.node_id, "waitMs": wait_ms });
        if let Some(after) = after {
            body["afterGeneration"] = after.into();
        }
        self.call("spec", body, wait + ANSWER_TIMEOUT).await
    }

    /// `nodes.report`: the inventory (`complete`: all of it; an incomplete one touches only
    /// the instances it lists), with the host commands that finished.
    pub async fn report(
        &self,
        instances: &[ReportEntry],
        applied_generation: Option<u64>,
        command_results: &[CommandResult],
        complete: bool,
    ) -> Result<ReportAnswer, CallError> {
        let mut body = json!({
            "nodeId": self.node_id,
            "instances": instances,
            "complete": complete,
        });
        if !command_results.is_empty() {
            body["commandResults"] = json!(command_results);
        }
        if let Some(generation) = applied_generation {
            body["appliedGeneration"] = generation.into();
        }
        if let Some(url) = &self.tunnel_url {
            body["tunnelUrl"] = url.as_str().into();
        }
        if let Some(facts) = &self.facts {
            body["cpuModel"] = facts.cpu_model.as_str().into();
            body["runtimes"] = json!(facts.runtimes);
        }
        self.call("report", body, ANSWER_TIMEOUT).await
    }

    /// `nodes.redeemTicket`: consumes a client's exec ticket (a second redeem is refused).
    pub async fn redeem_ticket(&self, ticket: &str) -> Result<Redeemed, CallError> {
        let body = json!({ "nodeId": self.node_id, "ticket": ticket });
        self.call("redeemTicket", body, ANSWER_TIMEOUT).await
    }

    /// `nodes.secret`: the value behind a `secret://` reference of an instance on this node.
    pub async fn secret(&self, reference: &str) -> Result<String, CallError> {
        let body = json!({ "nodeId": self.node_id, "ref": reference });
        let answer: SecretAnswer = self.call("secret", body, ANSWER_TIMEOUT).await?;
        Ok(answer.value)
    }

    /// `PUT`s a snapshot object to its presigned URL, declaring its digest. Answers why the
    /// store refused it, if it did.
    pub async fn upload(
        &self,
        url: &str,
        headers: &BTreeMap<String, String>,
        sha256: &str,
        body: Vec<u8>,
    ) -> Result<(), String> {
        let mut request = self
            .http
            .put(url)
            .timeout(OBJECT_TIMEOUT)
            .header("x-content-sha256", sha256)
            .body(body);
        for (name, value) in headers {
            request = request.header(name, value);
        }
        let response = request
            .send()
            .await
            .map_err(|e| format!("upload failed: {e}"))?;
        match response.status() {
            s if s.is_success() => Ok(()),
            s => Err(format!("upload refused ({})", s.as_u16())),
        }
    }

    /// `GET`s a snapshot object from its presigned URL.
    pub async fn download(&self, url: &str) -> Result<Vec<u8>, String> {
        let response = self
            .http
            .get(url)
            .timeout(OBJECT_TIMEOUT)
            .send()
            .await
            .map_err(|e| format!("download failed: {e}"))?;
        if !response.status().is_success() {
            return Err(format!("download refused ({})", response.status().as_u16()));
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| format!("download failed: {e}"))?;
        Ok(bytes.to_vec())
    }

    async fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        body: Value,
        timeout: Duration,
    ) -> Result<T, CallError> {
        let url = format!("{}/api/compute/nodes/{method}", self.base_url);
        let response = self
            .http
            .post(url)
            .bearer_auth(&self.token)
            .timeout(timeout)
            .json(&body)
            .send()
            .await
            .map_err(CallError::Transport)?;
        let status = response.status();
        if status.is_success() {
            return response.json().await.map_err(CallError::Transport);
        }
        // An error without the JSON body (a proxy, a crash) still says its status.
        let error: ErrorBody = response.json().await.unwrap_or_default();
        Err(CallError::Api {
            status: status.as_u16(),
            code: error.code,
            message: error.message,
        })
    }
}
