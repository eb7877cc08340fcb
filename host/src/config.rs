//! `host.toml`: the `[host]` table of `vps host --config FILE` (SPEC §3.11).
//!
//! The key names are fixed (independent tooling writes them), and an unknown key is an error
//! naming it, as in `vps serve`'s configuration.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::runtime::qemu::Accel;

/// A configuration problem, naming the file, the key and what is wrong.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {key}: {problem}")]
pub struct ConfigError {
    /// The file.
    pub file: String,
    /// The key, e.g. `host.accel`, or the line when TOML itself is at fault.
    pub key: String,
    /// What is wrong.
    pub problem: String,
}

/// The runtimes this agent can run guests with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeKind {
    /// One QEMU process per guest, over QMP.
    Qemu,
}

impl RuntimeKind {
    /// The name pools and nodes use.
    pub fn as_str(self) -> &'static str {
        match self {
            RuntimeKind::Qemu => "qemu",
        }
    }
}

/// A host agent's configuration.
#[derive(Clone, Debug)]
pub struct HostConfig {
    /// The server's root, e.g. `https://vps.example` (calls go to `/api/compute/nodes/*`).
    pub server_url: String,
    /// `node_…`, as `nodes.register` answered it.
    pub node_id: String,
    /// The node token `nodes.register` answered.
    pub node_token: String,
    /// Where guests live (one directory each): the truth a restarted agent re-adopts.
    pub state_dir: PathBuf,
    /// The image cache, one file per digest.
    pub image_dir: PathBuf,
    /// The host bridge every tap attaches to; `None`: the bridge each NIC of the spec names.
    pub bridge: Option<String>,
    /// Where the exec tunnel endpoint listens (`HOST:PORT`).
    pub tunnel_listen: String,
    /// What runs guests.
    pub runtime: RuntimeKind,
    /// KVM, TCG, or KVM once a probe boot proves it works.
    pub accel: Accel,
    /// Where the agent serves its Prometheus metrics (`/metrics`); none: not served.
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Where the resolver for allow-listed domains asks (`IP` or `IP:PORT`); none: the first
    /// `nameserver` of /etc/resolv.conf.
    pub dns_upstream: Option<std::net::SocketAddr>,
    /// The image cache's budget in bytes; none: half the file system holding `image_dir`.
    pub image_cache_max_bytes: Option<u64>,
    /// How many QEMUs wait started for a memory restore; none: the runtime's default (1).
    pub restore_slots: Option<usize>,
    /// How the loop is paced: not in the file, tests shorten it.
    pub timings: AgentTimings,
}

/// How often the agent looks and speaks.
#[derive(Clone, Debug)]
pub struct AgentTimings {
    /// The longest time between two reports, changed or not (reports also mark the node alive).
    pub report_interval: Duration,
    /// How long the server may hold a `nodes.spec` long poll (`waitMs`, at most 30 s).
    pub poll_wait: Duration,
    /// How often the guests are looked at when nothing else happens (a QEMU that died, a guest
    /// that powered itself off).
    pub observe_interval: Duration,
    /// The first wait after a failed operation before it is tried again (doubling).
    pub retry_after: Duration,
}

impl Default for AgentTimings {
    fn default() -> Self {
        AgentTimings {
            report_interval: Duration::from_secs(2),
            poll_wait: Duration::from_secs(20),
            observe_interval: Duration::from_secs(1),
            retry_after: Duration::from_secs(10),
        }
    }
}

/// The default state directory.
pub const DEFAULT_STATE_DIR: &str = "/var/lib/vps/host";
/// The default tunnel endpoint: every address, a port of its own.
pub const DEFAULT_TUNNEL_LISTEN: &str = "0.0.0.0:2222";

/// The file as written.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    host: HostTable,
}

/// `[host]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct HostTable {
    server_url: String,
    node_id: String,
    node_token: String,
    state_dir: Option<PathBuf>,
    image_dir: Option<PathBuf>,
    bridge: Option<String>,
    tunnel_listen: Option<String>,
    runtime: Option<String>,
    accel: Option<String>,
    metrics_listen: Option<String>,
    dns_upstream: Option<String>,
    image_cache_max_bytes: Option<u64>,
    restore_slots: Option<usize>,
}

/// Reads and checks a `host.toml`.
pub fn load_config(path: impl AsRef<Path>) -> Result<HostConfig, ConfigError> {
    let path = path.as_ref();
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
        file: file.clone(),
        key: "(file)".into(),
        problem: format!("cannot read: {e}"),
    })?;
    parse(&text, &file)
}

/// Parses and checks TOML text; `file` names it in errors.
pub fn parse(text: &str, file: &str) -> Result<HostConfig, ConfigError> {
    let err = |key: &str, problem: String| ConfigError {
        file: file.to_owned(),
        key: key.to_owned(),
        problem,
    };
    let parsed: File = toml::from_str(text).map_err(|e| {
        // serde names the unknown or missing key in its message; the line says where.
        let at = e
            .span()
            .map(|s| format!("line {}", text[..s.start].matches('\n').count() + 1))
            .unwrap_or_else(|| "(document)".into());
        err(&at, e.message().to_owned())
    })?;
    let host = parsed.host;
    let server_url = host.server_url.trim_end_matches('/').to_owned();
    let scheme_ok = server_url.starts_with("http://") || server_url.starts_with("https://");
    if !scheme_ok || url::Url::parse(&server_url).is_err() {
        return Err(err(
            "host.server_url",
            format!("{server_url:?} is not an http(s):// URL"),
        ));
    }
    if !host.node_id.starts_with("node_") {
        return Err(err(
            "host.node_id",
            format!("{:?} is not a node id (node_…)", host.node_id),
        ));
    }
    if host.node_token.trim().is_empty() {
        return Err(err("host.node_token", "is empty".into()));
    }
    let runtime = match host.runtime.as_deref().unwrap_or("qemu") {
        "qemu" => RuntimeKind::Qemu,
        other => {
            return Err(err(
                "host.runtime",
                format!("unknown runtime {other:?}: this agent runs \"qemu\""),
            ))
        }
    };
    let accel = host
        .accel
        .as_deref()
        .unwrap_or("auto")
        .parse::<Accel>()
        .map_err(|e| err("host.accel", e))?;
    let tunnel_listen = host
        .tunnel_listen
        .unwrap_or_else(|| DEFAULT_TUNNEL_LISTEN.into());
    if tunnel_listen.parse::<std::net::SocketAddr>().is_err() {
        return Err(err(
            "host.tunnel_listen",
            format!("{tunnel_listen:?} is not an IP:PORT address"),
        ));
    }
    if let Some(bridge) = &host.bridge {
        check_interface_name(bridge).map_err(|problem| err("host.bridge", problem))?;
    }
    let metrics_listen = host
        .metrics_listen
        .map(|text| {
            text.parse::<std::net::SocketAddr>().map_err(|_| {
                err(
                    "host.metrics_listen",
                    format!("{text:?} is not an IP:PORT address"),
                )
            })
        })
        .transpose()?;
    let dns_upstream = host
        .dns_upstream
        .map(|text| {
            text.parse::<std::net::SocketAddr>()
                .or_else(|_| {
                    text.parse::<std::net::IpAddr>()
                        .map(|ip| std::net::SocketAddr::new(ip, 53))
                })
                .map_err(|_| {
                    err(
                        "host.dns_upstream",
                        format!("{text:?} is not an IP address or IP:PORT"),
                    )
                })
        })
        .transpose()?;
    let state_dir = host
        .state_dir
        .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIR));
    let image_dir = host.image_dir.unwrap_or_else(|| state_dir.join("images"));
    Ok(HostConfig {
        server_url,
        node_id: host.node_id,
        node_token: host.node_token,
        state_dir,
        image_dir,
        bridge: host.bridge,
        tunnel_listen,
        runtime,
        accel,
        metrics_listen,
        dns_upstream,
        image_cache_max_bytes: host.image_cache_max_bytes,
        restore_slots: host.restore_slots,
        timings: AgentTimings::default(),
    })
}

/// A Linux interface name: 1 to 15 bytes, no `/`, no white space.
fn check_interface_name(name: &str) -> Result<(), String> {
    let fine = !name.is_empty()
        && name.len() <= 15
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if fine {
        Ok(())
    } else {
        Err(format!(
            "{name:?} is not an interface name (1 to 15 letters, digits, '-', '_', '.')"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "[host]\nserver_url = \"http://127.0.0.1:8080/\"\n\
                           node_id = \"node_a\"\nnode_token = \"secret\"\n";

    #[test]
    fn a_minimal_file_takes_the_defaults() {
        let c = parse(MINIMAL, "host.toml").unwrap();
        assert_eq!(c.server_url, "http://127.0.0.1:8080");
        assert_eq!(c.state_dir, PathBuf::from(DEFAULT_STATE_DIR));
        assert_eq!(c.image_dir, PathBuf::from(DEFAULT_STATE_DIR).join("images"));
        assert_eq!(c.runtime, RuntimeKind::Qemu);
        assert_eq!(c.accel, Accel::Auto);
        assert_eq!(c.tunnel_listen, DEFAULT_TUNNEL_LISTEN);
        assert_eq!(c.bridge, None);
    }

    #[test]
    fn every_key_of_the_issue_is_read() {
        let text = format!(
            "{MINIMAL}state_dir = \"/s\"\nimage_dir = \"/i\"\nbridge = \"vpsbr0\"\n\
             tunnel_listen = \"10.0.0.1:7000\"\nruntime = \"qemu\"\naccel = \"tcg\"\n"
        );
        let c = parse(&text, "host.toml").unwrap();
        assert_eq!(c.state_dir, PathBuf::from("/s"));
        assert_eq!(c.image_dir, PathBuf::from("/i"));
        assert_eq!(c.bridge.as_deref(), Some("vpsbr0"));
        assert_eq!(c.tunnel_listen, "10.0.0.1:7000");
        assert_eq!(c.accel, Accel::Tcg);
    }

    #[test]
    fn metrics_are_served_only_where_the_file_says() {
        assert_eq!(parse(MINIMAL, "host.toml").unwrap().metrics_listen, None);
        let text = format!("{MINIMAL}metrics_listen = \"127.0.0.1:9101\"\n");
        let c = parse(&text, "host.toml").unwrap();
        assert_eq!(c.metrics_listen, Some("127.0.0.1:9101".parse().unwrap()));
        let text = format!("{MINIMAL}metrics_listen = \"everywhere\"\n");
        assert_eq!(
            parse(&text, "host.toml").unwrap_err().key,
            "host.metrics_listen"
        );
    }

    #[test]
    fn the_dns_upstream_takes_an_address_with_or_without_a_port() {
        assert_eq!(parse(MINIMAL, "host.toml").unwrap().dns_upstream, None);
        let text = format!("{MINIMAL}dns_upstream = \"192.0.2.53\"\n");
        let c = parse(&text, "host.toml").unwrap();
        assert_eq!(c.dns_upstream, Some("192.0.2.53:53".parse().unwrap()));
        let text = format!("{MINIMAL}dns_upstream = \"192.0.2.53:5353\"\n");
        let c = parse(&text, "host.toml").unwrap();
        assert_eq!(c.dns_upstream, Some("192.0.2.53:5353".parse().unwrap()));
        let text = format!("{MINIMAL}dns_upstream = \"resolver.example\"\n");
        assert_eq!(
            parse(&text, "host.toml").unwrap_err().key,
            "host.dns_upstream"
        );
    }

    #[test]
    fn the_image_cache_budget_is_a_byte_count_or_left_to_the_runtime() {
        assert_eq!(
            parse(MINIMAL, "host.toml").unwrap().image_cache_max_bytes,
            None
        );
        let text = format!("{MINIMAL}image_cache_max_bytes = 10737418240\n");
        let c = parse(&text, "host.toml").unwrap();
        assert_eq!(c.image_cache_max_bytes, Some(10 << 30));
        let text = format!("{MINIMAL}image_cache_max_bytes = -1\n");
        assert_eq!(parse(&text, "host.toml").unwrap_err().key, "line 5");
    }

    #[test]
    fn restore_slots_are_a_count_or_left_to_the_runtime() {
        assert_eq!(parse(MINIMAL, "host.toml").unwrap().restore_slots, None);
        let text = format!("{MINIMAL}restore_slots = 0\n");
        assert_eq!(parse(&text, "host.toml").unwrap().restore_slots, Some(0));
        let text = format!("{MINIMAL}restore_slots = -1\n");
        assert_eq!(parse(&text, "host.toml").unwrap_err().key, "line 5");
    }

    #[test]
    fn an_unknown_key_is_refused_naming_it() {
        let text = format!("{MINIMAL}bridges = \"br0\"\n");
        let e = parse(&text, "host.toml").unwrap_err();
        assert!(e.problem.contains("unknown field `bridges`"), "{e}");
        assert_eq!(e.key, "line 5");
        let e = parse(&format!("{MINIMAL}[other]\nx = 1\n"), "host.toml").unwrap_err();
        assert!(e.problem.contains("unknown field `other`"), "{e}");
    }

    #[test]
    fn a_missing_required_key_is_named() {
        let e = parse(
            "[host]\nserver_url = \"http://x\"\nnode_id = \"node_a\"\n",
            "f",
        )
        .unwrap_err();
        assert!(e.problem.contains("missing field `node_token`"), "{e}");
    }

    #[test]
    fn a_bad_accel_is_refused_naming_the_key() {
        let e = parse(&format!("{MINIMAL}accel = \"fast\"\n"), "host.toml").unwrap_err();
        assert_eq!(e.key, "host.accel");
        assert!(e.problem.contains("kvm, tcg or auto"), "{e}");
        assert!(e.to_string().starts_with("host.toml: host.accel: "), "{e}");
    }

    #[test]
    fn an_unknown_runtime_is_a_config_error() {
        let e = parse(&format!("{MINIMAL}runtime = \"firecracker\"\n"), "f").unwrap_err();
        assert_eq!(e.key, "host.runtime");
        assert!(e.problem.contains("firecracker"), "{e}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (line, key) in [
            ("tunnel_listen = \"everywhere\"", "host.tunnel_listen"),
            ("bridge = \"a bridge with spaces\"", "host.bridge"),
        ] {
            let e = parse(&format!("{MINIMAL}{line}\n"), "f").unwrap_err();
            assert_eq!(e.key, key, "{e}");
        }
        let e = parse(
            "[host]\nserver_url = \"ftp://x\"\nnode_id = \"node_a\"\nnode_token = \"t\"\n",
            "f",
        )
        .unwrap_err();
        assert_eq!(e.key, "host.server_url");
        let e = parse(
            "[host]\nserver_url = \"http://x\"\nnode_id = \"n1\"\nnode_token = \"t\"\n",
            "f",
        )
        .unwrap_err();
        assert_eq!(e.key, "host.node_id");
    }
}
