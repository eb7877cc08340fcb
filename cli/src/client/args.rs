//! A method's flags, read from its request schema, and the JSON body built from them. Each
//! property becomes `--kebab-name`; the resource's id is a positional argument checked for its
//! prefix before anything is sent. The reference CLI's conveniences: `--tenant` (or
//! `VPS_TENANT`), `--key` (a fresh idempotency key when absent), `--ssh-key FILE[,FILE]` (public
//! keys only), `--user-data FILE`, `--wait`, `--all` (`scope: all`), durations like `15m` for
//! any `…Seconds`, `--label KEY=VALUE` (repeated) for `labels`, and its flag names (`--pool`, `--image`, `--ttl`, `--size`, …) as aliases.
//! A required `port` is a second positional argument after the id.

use clap::{Arg, ArgAction, ArgMatches};
use schemars::generate::SchemaSettings;
use serde_json::{json, Map, Value};

use super::{kebab, UsageError};
use vps_api::registry::Method;

/// How a property is given on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Integer,
    /// A JSON number that need not be whole (`idleCpuPercent`).
    Number,
    Boolean,
    /// A list of strings: the flag repeats.
    TextList,
    /// Anything else: JSON text.
    Json,
}

/// One request property.
#[derive(Debug, Clone)]
struct Property {
    name: String,
    kind: Kind,
    required: bool,
    about: String,
}

/// The id prefix of a positional id property.
const ID_PREFIXES: &[(&str, &str)] = &[
    ("instanceId", "inst"),
    ("sandboxId", "sbx"),
    ("snapshotId", "snap"),
    ("volumeId", "vol"),
    ("templateId", "sbxt"),
    ("poolId", "pool"),
    ("nodeId", "node"),
    ("webhookId", "whk"),
];

/// The property a method's resource is named by, if it takes one: the positional argument.
fn positional(m: &Method, props: &[Property]) -> Option<String> {
    let wanted = match m.group {
        "instances" => "instanceId",
        "sandboxes" => "sandboxId",
        "sandboxSnapshots" => "snapshotId",
        "sandboxVolumes" => "volumeId",
        "sandboxTemplates" => "templateId",
        "pools" => "poolId",
        "nodes" => "nodeId",
        "webhooks" => "webhookId",
        _ => return None,
    };
    props
        .iter()
        .find(|p| p.name == wanted && p.required)
        .map(|p| p.name.clone())
}

/// The method's request schema with every subschema inlined: one self-contained object, the
/// source of the CLI's flags and of the MCP tools' input schemas.
pub fn request_schema(m: &Method) -> Value {
    let mut generator = SchemaSettings::draft2020_12()
        .with(|s| {
            s.inline_subschemas = true;
            s.meta_schema = None;
        })
        .into_generator();
    (m.request)(&mut generator).to_value()
}

/// The request's properties, from its schema with every subschema inlined.
fn properties(m: &Method) -> Vec<Property> {
    let mut out = Vec::new();
    collect(&request_schema(m), &mut out);
    out
}

fn collect(schema: &Value, out: &mut Vec<Property>) {
    let required: Vec<&str> = schema["required"]
        .as_array()
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if let Some(props) = schema["properties"].as_object() {
        for (name, p) in props {
            if out.iter().any(|o| &o.name == name) {
                continue;
            }
            out.push(Property {
                name: name.clone(),
                kind: kind(p),
                required: required.contains(&name.as_str()),
                about: p["description"].as_str().unwrap_or("").to_string(),
            });
        }
    }
    for key in ["allOf", "anyOf", "oneOf"] {
        for part in schema[key].as_array().into_iter().flatten() {
            if part["properties"].is_object() {
                collect(part, out);
            }
        }
    }
}

fn kind(p: &Value) -> Kind {
    let types: Vec<&str> = match &p["type"] {
        Value::String(t) => vec![t.as_str()],
        Value::Array(ts) => ts.iter().filter_map(Value::as_str).collect(),
        _ => {
            // `anyOf: [X, null]` for an optional X.
            let inner: Vec<&Value> = p["anyOf"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|s| s["type"] != "null")
                .collect();
            return match inner.as_slice() {
                [one] => kind(one),
                _ => Kind::Json,
            };
        }
    };
    let non_null: Vec<&str> = types.into_iter().filter(|t| *t != "null").collect();
    match non_null.as_slice() {
        ["string"] => Kind::Text,
        ["integer"] => Kind::Integer,
        ["number"] => Kind::Number,
        ["boolean"] => Kind::Boolean,
        ["array"] if p["items"]["type"] == "string" => Kind::TextList,
        _ => Kind::Json,
    }
}

/// The flag a property is given with.
fn flag(p: &Property) -> String {
    match p.name.as_str() {
        "tenantId" => "tenant".into(),
        "idempotencyKey" => "key".into(),
        "sshKeys" => "ssh-key".into(),
        "labels" => "label".into(),
        // `--url` is the server's.
        "url" => "href".into(),
        name => kebab(name),
    }
}

/// The reference product's spelling of a flag, accepted too: `--pool` for `--pool-id` (and the
/// other ids), `--size` for `--size-gib`, `--ttl` for `--ttl-seconds` (any duration).
fn reference_alias(p: &Property) -> Option<String> {
    match p.name.as_str() {
        "poolId" => Some("pool".into()),
        "imageId" => Some("image".into()),
        "templateId" => Some("template".into()),
        "volumeId" => Some("volume".into()),
        "sizeGiB" => Some("size".into()),
        "labels" => Some("labels".into()),
        name if p.kind == Kind::Integer => name.strip_suffix("Seconds").map(kebab),
        _ => None,
    }
}

/// The method's arguments.
pub fn for_method(m: &Method) -> Vec<Arg> {
    let props = properties(m);
    let id = positional(m, &props);
    let flags: Vec<String> = props.iter().map(flag).collect();
    let mut args = Vec::new();
    for p in &props {
        let about = p.about.lines().next().unwrap_or("").to_string();
        if Some(&p.name) == id.as_ref() {
            args.push(Arg::new(p.name.clone()).required(true).index(1).help(about));
            continue;
        }
        // A required port follows the id: `vps sandboxes expose sbx_… 8080`.
        if p.name == "port" && p.required && id.is_some() {
            args.push(
                Arg::new(p.name.clone())
                    .required(true)
                    .index(2)
                    .value_name("PORT")
                    .help(about),
            );
            continue;
        }
        let mut arg = Arg::new(p.name.clone()).long(flag(p)).help(about.clone());
        // An alias never takes another property's flag.
        if let Some(alias) = reference_alias(p).filter(|a| !flags.contains(a)) {
            arg = arg.visible_alias(alias);
        }
        arg = match (p.name.as_str(), p.kind) {
            ("tenantId", _) => arg.env("VPS_TENANT").required(p.required),
            // A fresh key is sent unless one is given.
            ("idempotencyKey", _) => arg.help("Idempotency key (default: a fresh one)"),
            ("wait", _) => arg
                .action(ArgAction::SetTrue)
                .help("Answer once it settles (up to 30 s)"),
            ("sshKeys", _) => arg
                .action(ArgAction::Append)
                .value_delimiter(',')
                .value_name("FILE")
                .help("OpenSSH public key files (comma-separated, or repeat the flag)"),
            ("userData", _) => arg.value_name("FILE").help("A file of user data"),
            ("labels", _) => arg
                .action(ArgAction::Append)
                .value_name("KEY=VALUE")
                .help(format!(
                    "{about} (repeat the flag; a JSON object works too)"
                )),
            (_, Kind::Boolean) => arg
                .num_args(0..=1)
                .default_missing_value("true")
                .value_parser(["true", "false"]),
            (_, Kind::TextList) => arg.action(ArgAction::Append),
            (_, Kind::Json) => arg.value_name("JSON"),
            (name, Kind::Integer) if name.ends_with("Seconds") => arg.value_name("DURATION"),
            _ => arg.required(p.required),
        };
        args.push(arg);
    }
    if props.iter().any(|p| p.name == "scope") {
        args.push(
            Arg::new("all")
                .long("all")
                .action(ArgAction::SetTrue)
                .conflicts_with("scope")
                .help("Everyone's in the tenant, not only yours (scope: all)"),
        );
    }
    args
}

/// The JSON body of a call from its flags.
pub fn body(m: &Method, matches: &ArgMatches) -> Result<Value, UsageError> {
    let props = properties(m);
    let id = positional(m, &props);
    let mut body = Map::new();
    for p in &props {
        let value = match p.name.as_str() {
            "idempotencyKey" => Some(matches.get_one::<String>(&p.name).cloned().map_or_else(
                || {
                    json!(format!(
                        "cli-{}",
                        ulid::Ulid::generate().to_string().to_lowercase()
                    ))
                },
                Value::from,
            )),
            "wait" => matches
                .get_flag("wait")
                .then(|| json!({ "timeoutMs": 30000 })),
            "sshKeys" => match matches.get_many::<String>(&p.name) {
                Some(files) => Some(Value::from(public_keys(files)?)),
                None => None,
            },
            "userData" => match matches.get_one::<String>(&p.name) {
                Some(file) => {
                    Some(Value::from(std::fs::read_to_string(file).map_err(|e| {
                        UsageError(format!("--user-data {file}: {e}"))
                    })?))
                }
                None => None,
            },
            "labels" => match matches.get_many::<String>(&p.name) {
                Some(pairs) => Some(labels(pairs)?),
                None => None,
            },
            "scope" if matches.get_flag("all") => Some(json!("all")),
            _ => value(p, matches)?,
        };
        if let Some(v) = value {
            body.insert(p.name.clone(), v);
        }
    }
    if let Some(field) = id {
        check_id(
            &field,
            body.get(&field).and_then(Value::as_str).unwrap_or(""),
        )?;
    }
    Ok(Value::Object(body))
}

fn value(p: &Property, matches: &ArgMatches) -> Result<Option<Value>, UsageError> {
    if p.kind == Kind::TextList {
        return Ok(matches
            .get_many::<String>(&p.name)
            .map(|v| Value::from(v.cloned().collect::<Vec<_>>())));
    }
    let Some(text) = matches.get_one::<String>(&p.name) else {
        return Ok(None);
    };
    let bad = |why: &str| UsageError(format!("--{} {text:?}: {why}", flag(p)));
    Ok(Some(match p.kind {
        Kind::Text => Value::from(text.clone()),
        Kind::Boolean => Value::from(text == "true"),
        Kind::Integer if p.name.ends_with("Seconds") => {
            Value::from(seconds(text).map_err(|e| bad(&e))?)
        }
        Kind::Integer => Value::from(text.parse::<i64>().map_err(|_| bad("not a whole number"))?),
        Kind::Number => Value::from(
            text.parse::<f64>()
                .ok()
                .filter(|n| n.is_finite())
                .ok_or_else(|| bad("not a number"))?,
        ),
        Kind::Json => serde_json::from_str(text).unwrap_or_else(|_| Value::from(text.clone())),
        Kind::TextList => unreachable!("handled above"),
    }))
}

/// A number of seconds, or a duration like `90s`, `15m`, `8h`, `7d`.
pub fn seconds(text: &str) -> Result<i64, String> {
    if let Ok(n) = text.parse::<i64>() {
        return Ok(n);
    }
    let delta = vps_domain::sandbox::parse_duration(text)?;
    Ok(delta.num_seconds())
}

/// The labels of `--label KEY=VALUE` flags (each may also be a JSON object), merged.
fn labels<'a>(given: impl Iterator<Item = &'a String>) -> Result<Value, UsageError> {
    let mut out = Map::new();
    for text in given {
        if let Ok(Value::Object(map)) = serde_json::from_str::<Value>(text) {
            out.extend(map);
            continue;
        }
        let (key, value) = text
            .split_once('=')
            .ok_or_else(|| UsageError(format!("--label {text:?}: KEY=VALUE")))?;
        out.insert(key.to_string(), Value::from(value));
    }
    Ok(Value::Object(out))
}

/// The public keys in `files`; a private key is refused.
fn public_keys<'a>(files: impl Iterator<Item = &'a String>) -> Result<Vec<String>, UsageError> {
    let mut keys = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(file)
            .map_err(|e| UsageError(format!("--ssh-key {file}: {e}")))?;
        if text.contains("PRIVATE KEY") {
            return Err(UsageError(format!(
                "--ssh-key {file} is a private key; give its .pub file"
            )));
        }
        keys.extend(
            text.lines()
                .map(str::trim)
                .filter(|l| !l.is_empty() && !l.starts_with('#'))
                .map(str::to_string),
        );
    }
    Ok(keys)
}

/// Refuses an id that is not of its kind (`inst_…` for an instance).
fn check_id(field: &str, id: &str) -> Result<(), UsageError> {
    let Some((_, prefix)) = ID_PREFIXES.iter().find(|(f, _)| *f == field) else {
        return Ok(());
    };
    if vps_domain::ids::is_valid_id(prefix, id) {
        Ok(())
    } else {
        Err(UsageError(format!("{id:?} is not a {prefix}_… id")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_become_seconds() {
        assert_eq!(seconds("900"), Ok(900));
        assert_eq!(seconds("15m"), Ok(900));
        assert_eq!(seconds("2h"), Ok(7200));
        assert!(seconds("soon").is_err());
    }

    #[test]
    fn ids_are_checked_by_kind() {
        assert!(check_id("instanceId", "sbx_x").is_err());
        assert!(check_id("poolId", "pool_01jzzzzzzzzzzzzzzzzzzzzzzz").is_ok());
        assert!(check_id("somethingElse", "whatever").is_ok());
    }

    #[test]
    fn the_reference_spelling_builds_the_same_body() {
        let m = vps_api::methods::registry()
            .get("sandboxes", "create")
            .unwrap();
        let command = clap::Command::new("create").args(for_method(m));
        let matches = command
            .try_get_matches_from([
                "create",
                "--tenant",
                "acme",
                "--template",
                "sbxt_x",
                "--ttl",
                "30m",
                "--key",
                "build-7",
            ])
            .unwrap();
        assert_eq!(
            body(m, &matches).unwrap(),
            json!({ "tenantId": "acme", "templateId": "sbxt_x", "ttlSeconds": 1800,
                    "idempotencyKey": "build-7" })
        );
    }

    #[test]
    fn a_number_flag_need_not_be_whole_and_an_idle_timeout_is_a_duration() {
        let m = vps_api::methods::registry()
            .get("sandboxTemplates", "update")
            .unwrap();
        let command = clap::Command::new("update").args(for_method(m));
        let parse = |cpu: &str| {
            let matches = command
                .clone()
                .try_get_matches_from([
                    "update",
                    "sbxt_01jzzzzzzzzzzzzzzzzzzzzzzz",
                    "--tenant",
                    "acme",
                    "--idle-timeout",
                    "10m",
                    "--idle-cpu-percent",
                    cpu,
                ])
                .unwrap();
            body(m, &matches)
        };
        let sent = parse("0.5").unwrap();
        assert_eq!(
            (&sent["idleTimeoutSeconds"], &sent["idleCpuPercent"]),
            (&json!(600), &json!(0.5))
        );
        assert!(parse("lots").is_err());
    }

    #[test]
    fn labels_are_given_as_repeated_key_value_flags() {
        let m = vps_api::methods::registry()
            .get("instances", "list")
            .unwrap();
        let command = clap::Command::new("list").args(for_method(m));
        let matches = command
            .try_get_matches_from([
                "list", "--tenant", "acme", "--label", "team=ml", "--label", "tier=",
            ])
            .unwrap();
        assert_eq!(
            body(m, &matches).unwrap()["labels"],
            json!({ "team": "ml", "tier": "" })
        );
    }

    #[test]
    fn every_method_has_its_properties() {
        for m in vps_api::methods::registry().methods() {
            let props = properties(m);
            let names: Vec<&str> = props.iter().map(|p| p.name.as_str()).collect();
            if m.group == "instances" && m.name == "create" {
                for wanted in ["tenantId", "poolId", "flavor", "imageId", "sshKeys", "wait"] {
                    assert!(names.contains(&wanted), "{wanted} in {names:?}");
                }
            }
        }
    }
}
