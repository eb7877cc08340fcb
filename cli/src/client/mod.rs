//! The per-group command line (`vps instances list`, `vps sandboxes create …`), built from the
//! method registry: every API method a person calls has a command, its flags come from the
//! method's request schema, so the CLI cannot drift from the API. It talks to `VPS_URL` (or
//! `--url`) with `VPS_TOKEN` (or `--token`); the tenant comes from `--tenant` or `VPS_TENANT`.
//!
//! Exit codes: 0 ok; 1 an API error (code and message on stderr) or no answer; 2 a usage error
//! found before anything is sent (a malformed id, a private key given as `--ssh-key`, …).
//!
//! - [`args`]: flags from a request schema, and the JSON body from the flags.
//! - [`output`]: tables for people (a history: one line per event), JSON with `--json` (or
//!   `--format json`), one field with `--query`.
//! - [`exec`]: `vps sandboxes exec`, a shell through the system's `ssh`.
//! - [`cp`]: `vps sandboxes cp`, files in and out over the same path.

mod args;
pub(crate) mod cp;
pub(crate) mod exec;
mod images;
pub(crate) mod output;

pub use args::request_schema;
pub use output::print;

/// `body` without its null fields (absent flags).
pub fn without_nulls(mut body: Value) -> Value {
    if let Some(fields) = body.as_object_mut() {
        fields.retain(|_, v| !v.is_null());
    }
    body
}

use clap::{Arg, ArgAction, ArgMatches, Command};
use serde_json::Value;

use vps_api::registry::{Access, Method};
use vps_domain::ErrorCode;

/// Command names of the groups that differ from the API's.
const RENAMED: &[(&str, &str)] = &[
    ("sandboxTemplates", "templates"),
    ("sandboxSnapshots", "snapshots"),
    ("sandboxVolumes", "volumes"),
    ("providerAccounts", "provider-accounts"),
    ("apiKeys", "api-keys"),
];

/// The reference product's names of groups, accepted too (`vps sandbox create …`).
const REFERENCE_NAMES: &[(&str, &str)] = &[
    ("sandboxes", "sandbox"),
    ("templates", "sandbox-template"),
    ("volumes", "sandbox-volume"),
    ("snapshots", "sandbox-snapshot"),
];

/// Groups whose name a database-side command already takes (`vps events`, `vps usage`): their
/// API methods get their commands there or through `vps call`.
const NOT_HERE: &[&str] = &["events", "usage"];

/// A usage error: exit 2, nothing sent.
#[derive(Debug)]
pub struct UsageError(pub String);

/// The command name of an API group.
pub fn command_name(group: &str) -> String {
    RENAMED
        .iter()
        .find(|(g, _)| *g == group)
        .map_or_else(|| kebab(group), |(_, name)| name.to_string())
}

/// `setIpPool` → `set-ip-pool`, `sizeGiB` → `size-gib`.
pub fn kebab(name: &str) -> String {
    let mut out = String::new();
    for c in name.replace("GiB", "Gib").chars() {
        if c.is_ascii_uppercase() {
            out.push('-');
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// The methods people call, by group, in registry order.
fn groups() -> Vec<(String, Vec<&'static Method>)> {
    let mut groups: Vec<(String, Vec<&'static Method>)> = Vec::new();
    for m in vps_api::methods::registry().methods() {
        if m.access == Access::Node || NOT_HERE.contains(&m.group) {
            continue;
        }
        let name = command_name(m.group);
        match groups.iter_mut().find(|(g, _)| *g == name) {
            Some((_, methods)) => methods.push(m),
            None => groups.push((name, vec![m])),
        }
    }
    groups
}

/// One subcommand per group, one sub-subcommand per method.
pub fn commands() -> Vec<Command> {
    groups()
        .into_iter()
        .map(|(name, methods)| {
            let about = format!("The {} methods of the API.", methods[0].group);
            let subcommands = methods.iter().map(|m| method_command(m));
            let aliases = REFERENCE_NAMES
                .iter()
                .filter(|(group, _)| *group == name)
                .map(|(_, alias)| *alias);
            Command::new(name.clone())
                .about(about)
                .visible_aliases(aliases)
                .subcommand_required(true)
                .arg_required_else_help(true)
                .subcommands(subcommands)
                .subcommands(local_commands(&name))
        })
        .collect()
}

/// A group's commands that are more (or less) than one call: `images build`, `images import`.
fn local_commands(group: &str) -> Vec<Command> {
    match group {
        "images" => vec![
            images::build_command(),
            images::import_command().args(connection_args()),
        ],
        "sandboxes" => vec![cp::command().args(connection_args())],
        _ => Vec::new(),
    }
}

fn method_command(m: &Method) -> Command {
    if m.group == "sandboxes" && m.name == "exec" {
        return exec::command().args(connection_args());
    }
    let args = args::for_method(m);
    let taken = |long: &str| args.iter().any(|a| a.get_long() == Some(long));
    // The reference's output flags, unless the request has a field of that name.
    let format = (!taken("format")).then(|| {
        Arg::new(OUTPUT_FORMAT)
            .long("format")
            .value_parser(["table", "json"])
            .conflicts_with("json")
            .help("table (default) or json")
    });
    let query = (!taken("query")).then(|| {
        Arg::new(OUTPUT_QUERY)
            .long("query")
            .value_name("PATH")
            .help("Print only this field of the answer (`state`, `shape.vcpu`, `items.0.id`)")
    });
    Command::new(kebab(m.name))
        .about(m.summary)
        .args(args)
        .args(connection_args())
        .arg(
            Arg::new("json")
                .long("json")
                .action(ArgAction::SetTrue)
                .help("Print the answer as JSON instead of a table"),
        )
        .args(format)
        .args(query)
}

/// The ids of `--format` and `--query`, apart from any request field's.
const OUTPUT_FORMAT: &str = "--format";
const OUTPUT_QUERY: &str = "--query";

fn connection_args() -> Vec<Arg> {
    vec![
        Arg::new("vps_url")
            .long("url")
            .env("VPS_URL")
            .default_value("http://127.0.0.1:8080")
            .help("The server"),
        Arg::new("vps_token")
            .long("token")
            .env("VPS_TOKEN")
            .hide_env_values(true)
            .help("An API token"),
    ]
}

/// Whether `name` is one of the group commands.
pub fn is_group(name: &str) -> bool {
    groups().iter().any(|(g, _)| g == name)
}

/// Runs `vps <group> <method> …`; answers the exit code.
pub async fn run(group: &str, matches: &ArgMatches) -> i32 {
    let Some((name, sub)) = matches.subcommand() else {
        return 2;
    };
    if (group, name) == ("images", "build") {
        return images::run_build(sub);
    }
    if (group, name) == ("images", "import") {
        return match Client::from(sub) {
            Ok(client) => images::run_import(&client, sub).await,
            Err(UsageError(e)) => usage(&e),
        };
    }
    if (group, name) == ("sandboxes", "cp") {
        return match Client::from(sub) {
            Ok(client) => cp::run(&client, sub).await,
            Err(UsageError(e)) => usage(&e),
        };
    }
    let Some(method) = groups()
        .into_iter()
        .find(|(g, _)| g == group)
        .and_then(|(_, methods)| methods.into_iter().find(|m| kebab(m.name) == name))
    else {
        return 2;
    };
    let client = match Client::from(sub) {
        Ok(c) => c,
        Err(UsageError(e)) => return usage(&e),
    };
    if method.group == "sandboxes" && method.name == "exec" {
        return exec::run(&client, sub).await;
    }
    let body = match args::body(method, sub) {
        Ok(body) => body,
        Err(UsageError(e)) => return usage(&e),
    };
    let waiting = body.get("wait").is_some();
    let answer = client
        .call_with_progress(&format!("{}.{}", method.group, method.name), &body, waiting)
        .await;
    match answer {
        Ok(value) => {
            let format = sub.try_get_one::<String>(OUTPUT_FORMAT).ok().flatten();
            let json = sub.get_flag("json") || format.is_some_and(|f| f == "json");
            let query = sub.try_get_one::<String>(OUTPUT_QUERY).ok().flatten();
            match (query, method.name, json) {
                (Some(path), _, _) => output::print_field(&value, path),
                (None, "history", false) => output::print_events(&value),
                // `vps sandboxes expose` prints the URL alone, for a browser or a pipe.
                (None, "expose", false) => output::print_field(&value, "url"),
                (None, _, json) => output::print(&value, json),
            }
            0
        }
        Err(code) => code,
    }
}

fn usage(message: &str) -> i32 {
    eprintln!("error: {message}");
    2
}

/// Prints a failed call for people: `CODE: message` (and its details) on stderr.
fn report(failure: &ApiFailure) {
    if failure.code == FailureCode::Unreachable {
        eprintln!("error: {}", failure.message);
        return;
    }
    eprintln!("{failure}");
    if let Some(details) = &failure.details {
        eprintln!("details: {details}");
    }
}

/// An HTTP client of one server, as one identity.
pub struct Client {
    http: reqwest::Client,
    url: String,
    token: String,
}

/// Why a call brought no answer: the API's error code and message, or
/// [`FailureCode::Unreachable`] when the server did not answer at all.
#[derive(Debug, Clone)]
pub struct ApiFailure {
    /// `NOT_FOUND`, `INVALID_INPUT`, … (the API's `code`), or no answer.
    pub code: FailureCode,
    /// The API's `message`.
    pub message: String,
    /// The API's `details`, when it sent any.
    pub details: Option<Value>,
}

impl ApiFailure {
    /// The process's exit code for this failure.
    pub fn exit_code(&self) -> i32 {
        exit_code(self.code)
    }
}

/// What a failed call's code is: one of the API's, or no answer at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCode {
    /// The server answered with this error code (a code this client does not know reads as
    /// `INTERNAL`).
    Api(ErrorCode),
    /// The server did not answer.
    Unreachable,
}

impl std::fmt::Display for FailureCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FailureCode::Api(code) => write!(f, "{code}"),
            FailureCode::Unreachable => f.write_str("UNREACHABLE"),
        }
    }
}

/// The exit code of a failed call (the module's doc): every API error and no answer exit 1.
/// The match names every code so that a new one has to decide its own.
pub fn exit_code(code: FailureCode) -> i32 {
    match code {
        FailureCode::Api(
            ErrorCode::InvalidInput
            | ErrorCode::Unauthenticated
            | ErrorCode::AccessDenied
            | ErrorCode::NotFound
            | ErrorCode::Conflict
            | ErrorCode::InvalidState
            | ErrorCode::QuotaExceeded
            | ErrorCode::CapacityUnavailable
            | ErrorCode::Unsupported
            | ErrorCode::RateLimited
            | ErrorCode::Internal,
        )
        | FailureCode::Unreachable => 1,
    }
}

impl std::fmt::Display for ApiFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.message)
    }
}

impl Client {
    /// A client of the server at `url` calling with `token`.
    pub fn new(url: &str, token: &str) -> Client {
        Client {
            http: reqwest::Client::new(),
            url: url.trim_end_matches('/').to_string(),
            token: token.to_string(),
        }
    }

    fn from(m: &ArgMatches) -> Result<Client, UsageError> {
        let token = m
            .get_one::<String>("vps_token")
            .ok_or_else(|| UsageError("set VPS_TOKEN (or --token) to an API token".into()))?;
        let url = m.get_one::<String>("vps_url").map_or("", String::as_str);
        Ok(Client::new(url, token))
    }

    /// Calls `group.method`: the answer, or the API's error code and message.
    pub async fn request(&self, method: &str, body: &Value) -> Result<Value, ApiFailure> {
        let (group, name) = method.split_once('.').unwrap_or_default();
        let response = self
            .http
            .post(format!("{}/api/compute/{group}/{name}", self.url))
            .bearer_auth(&self.token)
            .json(body)
            .send()
            .await
            .map_err(|e| ApiFailure {
                code: FailureCode::Unreachable,
                message: format!("cannot reach {}: {e}", self.url),
                details: None,
            })?;
        let ok = response.status().is_success();
        let answer: Value = response.json().await.unwrap_or(Value::Null);
        if ok {
            return Ok(answer);
        }
        Err(ApiFailure {
            code: FailureCode::Api(
                answer["code"]
                    .as_str()
                    .and_then(|c| c.parse().ok())
                    .unwrap_or(ErrorCode::Internal),
            ),
            message: answer["message"].as_str().unwrap_or("no message").into(),
            details: answer["details"]
                .as_object()
                .filter(|d| !d.is_empty())
                .map(|d| Value::Object(d.clone())),
        })
    }

    /// Calls `group.method`; an error answer or no answer is printed to stderr and answered
    /// as exit code 1.
    pub async fn call(&self, method: &str, body: &Value) -> Result<Value, i32> {
        self.request(method, body).await.map_err(|failure| {
            report(&failure);
            failure.exit_code()
        })
    }

    /// Like [`Client::call`], with a spinner on a terminal while the server waits.
    async fn call_with_progress(
        &self,
        method: &str,
        body: &Value,
        waiting: bool,
    ) -> Result<Value, i32> {
        let spinner =
            (waiting && std::io::IsTerminal::is_terminal(&std::io::stderr())).then(|| {
                let bar = indicatif::ProgressBar::new_spinner();
                bar.set_message(format!("{method}: waiting until it settles"));
                bar.enable_steady_tick(std::time::Duration::from_millis(100));
                bar
            });
        let answer = self.call(method, body).await;
        if let Some(bar) = spinner {
            bar.finish_and_clear();
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn groups_and_methods_are_named_for_people() {
        assert_eq!(super::command_name("sandboxTemplates"), "templates");
        assert_eq!(super::kebab("setIpPool"), "set-ip-pool");
        assert_eq!(super::kebab("sizeGiB"), "size-gib");
    }

    /// Every API code, and no answer, exits with a failure that is not a usage error (2).
    #[test]
    fn every_error_code_has_an_exit_code() {
        use super::{exit_code, ErrorCode, FailureCode};
        for code in ErrorCode::ALL {
            assert_eq!(exit_code(FailureCode::Api(code)), 1, "{code}");
        }
        assert_eq!(exit_code(FailureCode::Unreachable), 1);
    }

    /// Aliases and output flags never clash with a request's own flags.
    #[test]
    fn every_command_line_is_well_formed() {
        clap::Command::new("vps")
            .subcommands(super::commands())
            .debug_assert();
    }
}
