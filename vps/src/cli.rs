//! The `vps` command line.

use std::path::PathBuf;

use clap::{ArgMatches, Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use anyhow::Context;
use vps_api::config::Config;
use vps_api::database::{redact, Database};

/// vps: an event-sourced control plane for virtual machines.
#[derive(Debug, Parser)]
#[command(name = "vps", version)]
pub struct Cli {
    /// The configuration file (also `VPS_CONFIG`).
    #[arg(long, global = true)]
    pub config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run the server: API, projections, reactors and publishers.
    Serve,
    /// Run the server on the embedded database with emulated hosts and demo data.
    Dev(DevArgs),
    /// Read the log.
    #[command(subcommand)]
    Events(EventsCommand),
    /// Call an API method with `VPS_URL` (default http://127.0.0.1:8080) and `VPS_TOKEN`,
    /// e.g. `vps call instances.list '{"tenantId":"acme"}'`.
    Call {
        /// `<group>.<method>`.
        method: String,
        /// The JSON body (default `{}`).
        body: Option<String>,
        /// One line of JSON instead of pretty-printed.
        #[arg(long)]
        json: bool,
    },
    /// Print the API's OpenAPI 3.1 document (the one served at /api/compute/openapi.json).
    Openapi,
    /// Every event of a resource (inst_…, pool_…, node_…, …), oldest first.
    History {
        /// The resource id.
        id: String,
        /// CloudEvents JSON lines (the whole events) instead of one line per event.
        #[arg(long)]
        json: bool,
    },
    /// Check the log's integrity.
    #[command(subcommand)]
    Audit(AuditCommand),
    /// Rebuild every projection from the log into a scratch schema and compare it with the
    /// live one; exits 1 naming the differing rows.
    Replay {
        /// Compare with the live tables (the only mode).
        #[arg(long, default_value_t = true)]
        verify: bool,
        /// Check only what changed after the checkpoint a verified run recorded at this
        /// position (`audit.verified`): the streams with events since, and the chain from it.
        #[arg(long, value_name = "POSITION")]
        from: Option<i64>,
        /// Build the scratch tables in this database (migrated on open) instead of the
        /// configured one, which is then only read and may be a read replica.
        #[arg(long, value_name = "URL")]
        scratch_database_url: Option<String>,
    },
    /// Measure a capability against its baseline.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Usage records: export them for billing, or prove them against the log.
    #[command(subcommand)]
    Usage(UsageCommand),
    /// Open a sandboxes.exec tunnel and pipe it to standard input and output, for OpenSSH's
    /// ProxyCommand (`vps sandboxes exec` passes `--ticket-file`, so no server data reaches
    /// the shell that runs it).
    Tunnel {
        /// A file holding the answer's `tunnel` object (`{"url", "ticket"}`).
        #[arg(long, conflicts_with_all = ["url", "ticket"], required_unless_present_all = ["url", "ticket"])]
        ticket_file: Option<std::path::PathBuf>,
        /// `tunnel.url` of the sandboxes.exec answer (`tcp://host:port`).
        #[arg(long, requires = "ticket")]
        url: Option<String>,
        /// `tunnel.ticket` of the same answer (single use).
        #[arg(long, requires = "url")]
        ticket: Option<String>,
    },
    /// Print a shell completion script: `vps completions bash > /etc/bash_completion.d/vps`.
    Completions {
        /// bash, zsh or fish (also elvish, powershell).
        shell: clap_complete::Shell,
    },
    /// Serve the Model Context Protocol on stdio: sandbox and instance tools for an agent,
    /// as the identity of `VPS_TOKEN` on `VPS_URL` (tenant: `VPS_TENANT`).
    Mcp(vps_cli::mcp::McpArgs),
    /// Self-checks for operators, each with a severity and a fix; exits 1 on any error.
    Doctor {
        /// `{"checks": [...]}` instead of one line per check.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
enum UsageCommand {
    /// usage.list through the API (VPS_URL, VPS_TOKEN, VPS_TENANT): the records of [from, to).
    List {
        /// RFC 3339 start.
        #[arg(long)]
        from: chrono::DateTime<chrono::Utc>,
        /// RFC 3339 end.
        #[arg(long)]
        to: chrono::DateTime<chrono::Utc>,
        /// Only this meter (e.g. vps.vcpu.hours).
        #[arg(long)]
        meter: Option<String>,
        /// Only this resource.
        #[arg(long)]
        resource_id: Option<String>,
        /// `label:<key>`: the sums per value of that label, meter and unit (cost per label).
        #[arg(long)]
        group_by: Option<String>,
        /// The tenant (operators: any; tenants: their own).
        #[arg(long, env = "VPS_TENANT")]
        tenant: Option<String>,
        /// The server.
        #[arg(long, env = "VPS_URL", default_value = "http://127.0.0.1:8080")]
        url: String,
        /// An API token.
        #[arg(long, env = "VPS_TOKEN", hide_env_values = true)]
        token: String,
        /// The answer as JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Stream the records whose window starts in [from, to) to standard output.
    Export {
        /// RFC 3339 start (inclusive).
        #[arg(long)]
        from: chrono::DateTime<chrono::Utc>,
        /// RFC 3339 end (exclusive).
        #[arg(long)]
        to: chrono::DateTime<chrono::Utc>,
        /// Only this tenant's records.
        #[arg(long)]
        tenant: Option<String>,
        /// Output format.
        #[arg(long, value_enum, default_value = "csv")]
        format: vps_api::tools::usage::Format,
        /// `label:<key>`: the sums per value of that label, meter and unit (cost per label)
        /// instead of the records.
        #[arg(long)]
        group_by: Option<String>,
    },
    /// Recompute every window in [from, to) from the log and compare, record for record;
    /// exits 1 naming the first difference.
    Verify {
        /// RFC 3339 start (inclusive).
        #[arg(long)]
        from: chrono::DateTime<chrono::Utc>,
        /// RFC 3339 end (exclusive).
        #[arg(long)]
        to: chrono::DateTime<chrono::Utc>,
    },
}

#[derive(Debug, Args)]
struct DevArgs {
    /// How many emulated hosts to run (default 3, or 0 with --qemu).
    #[arg(long)]
    sim: Option<usize>,
    /// How many real hosts to run, guests as QEMU virtual machines (needs root and
    /// qemu-system-x86; builds the minimal guest image on first use).
    #[arg(long, default_value_t = 0)]
    qemu: usize,
}

#[derive(Debug, Subcommand)]
enum EventsCommand {
    /// One page of the log, oldest first.
    List(EventsArgs),
    /// The last events, then every new one as it is appended.
    Tail(EventsArgs),
}

#[derive(Debug, Args)]
struct EventsArgs {
    /// Start after this cursor (`<transaction id>-<position>`).
    #[arg(long)]
    after: Option<String>,
    /// Only these types (`instance.*`, `instance.created`); repeatable.
    #[arg(long = "type")]
    types: Vec<String>,
    /// Only this subject (`instance/inst_…`).
    #[arg(long)]
    subject: Option<String>,
    /// At most this many events (list).
    #[arg(long, default_value_t = 100)]
    limit: i64,
    /// JSON lines (CloudEvents) instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
enum AuditCommand {
    /// Recompute the hash chain; exits 1 and names the first altered event if it is broken.
    Verify,
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Cedar decisions per second on one core with many policies vs the baseline alone.
    Authz {
        /// Seconds per phase.
        #[arg(long, default_value_t = 2.0)]
        seconds: f64,
        /// Policies added to the baseline.
        #[arg(long, default_value_t = 100)]
        policies: usize,
    },
    /// instances.create over HTTP from concurrent clients vs single-event appends.
    Api {
        /// Seconds per phase.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Concurrent HTTP clients of each run, one run per count, in order.
        #[arg(long, value_delimiter = ',', default_value = "1,16")]
        clients: Vec<usize>,
    },
    /// Appends vs raw INSERTs, batched appends, follower reads (medians of the rounds).
    Log {
        /// Seconds per phase.
        #[arg(long, default_value_t = 5.0)]
        seconds: f64,
        /// Concurrent writers.
        #[arg(long, default_value_t = 16)]
        writers: usize,
        /// Rounds of every phase, each in a fresh scratch database.
        #[arg(long, default_value_t = 3)]
        rounds: usize,
    },
    /// Instances created over HTTP until all run on emulated hosts vs bare log appends.
    Converge {
        /// Nodes, one emulated host each.
        #[arg(long, default_value_t = 100)]
        hosts: usize,
        /// Instances to create.
        #[arg(long, default_value_t = 10_000)]
        instances: usize,
        /// How long an emulated domain boots, in ms.
        #[arg(long, default_value_t = 50)]
        boot_ms: u64,
        /// Concurrent HTTP clients (and baseline writers).
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// Stop waiting for convergence after this many seconds (then exit 1).
        #[arg(long, default_value_t = 600.0)]
        timeout: f64,
        /// The usage window in seconds (`[timings] usage_window`). A window's end is the
        /// server's largest burst of memory (a record per meter and instance); a short window
        /// puts several inside the run.
        #[arg(long, default_value_t = 300.0)]
        usage_window: f64,
    },
    /// sandboxes.create to ready: warm claims and cold creates vs one append.
    Sandbox {
        /// Warm creates (the warm pool holds this many).
        #[arg(long, default_value_t = 50)]
        warm: usize,
        /// Cold creates.
        #[arg(long, default_value_t = 20)]
        cold: usize,
        /// How long an emulated domain boots, in ms.
        #[arg(long, default_value_t = 50)]
        boot_ms: u64,
    },
    /// Snapshot to ready to restore to ready on emulated hosts, and the file store's MiB/s vs
    /// a plain file copy.
    Snapshot {
        /// Snapshot-and-restore rounds.
        #[arg(long, default_value_t = 10)]
        rounds: usize,
        /// The snapshot object's size in MiB (emulated hosts).
        #[arg(long, default_value_t = 64)]
        size_mib: usize,
        /// `emulated` (in-process emulated hosts) or `qemu` (a real guest and the real host
        /// agent, in a network namespace of the bench's own; needs root).
        #[arg(long, default_value = "emulated")]
        runtime: String,
        /// The guest bundle for `--runtime qemu` (`vps images build minimal --out FILE`).
        #[arg(long)]
        image: Option<PathBuf>,
        /// kvm, tcg, or auto, for `--runtime qemu`.
        #[arg(long, default_value = "auto")]
        accel: vps_host::runtime::qemu::Accel,
        /// QEMUs kept started for memory restores, as the host's `restore_slots` (`--runtime
        /// qemu`; 0 measures restores that start their own).
        #[arg(long, default_value_t = 1)]
        restore_slots: usize,
    },
    /// instances.list and sandboxes.list with filters and a cursor at `--rows` rows vs a
    /// plain indexed SELECT; instances.get asOf and history on that log.
    List {
        /// Sandboxes (and their instances) in the tables.
        #[arg(long, default_value_t = 100_000)]
        rows: usize,
        /// Calls measured of each query.
        #[arg(long, default_value_t = 200)]
        calls: usize,
    },
    /// One node's complete report of many guests (nothing changed, one guest changed) vs a
    /// node of 10, and each node's NodeSpec.
    Report {
        /// Guests on the big node.
        #[arg(long, default_value_t = 10_000)]
        guests: usize,
        /// Guests on the small node (the baseline).
        #[arg(long, default_value_t = 10)]
        small: usize,
        /// Reports measured of each kind.
        #[arg(long, default_value_t = 30)]
        repeats: usize,
    },
    /// The emulated hosts of `bench converge`, in their own process (internal).
    #[command(hide = true)]
    ConvergeHosts {
        /// The server's root URL.
        #[arg(long)]
        url: String,
        /// Boot delay in ms.
        #[arg(long)]
        boot_ms: u64,
    },
    /// Meter a pre-built day of instances with churn vs reading that log.
    Usage {
        /// Instances over the day (1,000: about 288,000 records).
        #[arg(long, default_value_t = 1000)]
        instances: usize,
        /// Hours of log.
        #[arg(long, default_value_t = 24)]
        hours: i64,
    },
    /// replay --verify and audit verify over a pre-built log of instances and sandboxes with
    /// churn (usage records included) vs a follower reading that log.
    Replay {
        /// Events of churn to build (the goal is set at 1,000,000).
        #[arg(long, default_value_t = 1_000_000)]
        events: u64,
    },
    /// Sandboxes and instances churned at random while hosts, a replica and NATS fail; then
    /// nothing transitional, nothing leaked, replay equal, usage verified, every event
    /// delivered once (exit 1 otherwise).
    Chaos {
        /// Sandbox slots.
        #[arg(long, default_value_t = 300)]
        sandboxes: usize,
        /// Instance slots.
        #[arg(long, default_value_t = 100)]
        instances: usize,
        /// How long the workload and the faults last.
        #[arg(long, default_value_t = 120.0)]
        seconds: f64,
        /// Concurrent workers.
        #[arg(long, default_value_t = 8)]
        workers: usize,
        /// Emulated hosts.
        #[arg(long, default_value_t = 4)]
        hosts: usize,
        /// Every `deadline_<resource>_<state>`, in seconds.
        #[arg(long, default_value_t = 20.0)]
        deadline: f64,
    },
    /// Append → JetStream and append → webhook latency vs core NATS publish → subscribe.
    Delivery {
        /// Events appended per second.
        #[arg(long, default_value_t = 1000.0)]
        rate: f64,
        /// How long to append.
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
    },
    /// Real guests on the qemu runtime: cold create to running and warm claim to ready, each
    /// beside QEMU alone doing the same, in a network namespace of its own (needs root).
    Host(HostBenchArgs),
    /// `bench host`'s measurement, inside the network namespace it made (internal).
    #[command(hide = true)]
    HostInNamespace {
        #[command(flatten)]
        args: HostBenchArgs,
        /// The bench's directory (guests' state, images, baselines).
        #[arg(long)]
        root: PathBuf,
        /// One commit's latency, measured by the parent.
        #[arg(long)]
        append_ms: f64,
    },
}

#[derive(Debug, Args)]
struct HostBenchArgs {
    /// The guest bundle (`vps images build minimal --out FILE`).
    #[arg(long)]
    image: PathBuf,
    /// Cold creates measured, each beside one boot of QEMU alone.
    #[arg(long, default_value_t = 5)]
    cold: usize,
    /// Warm claims measured, each beside one `cont` of QEMU alone.
    #[arg(long, default_value_t = 5)]
    warm: usize,
    /// kvm, tcg, or auto (KVM once a probe boot proves it works).
    #[arg(long, default_value = "auto")]
    accel: vps_host::runtime::qemu::Accel,
    /// Memory snapshot-and-restore rounds instead of boots (`bench snapshot --runtime qemu`).
    #[arg(long, default_value_t = 0, hide = true)]
    snapshots: usize,
    /// The host's `restore_slots` (`bench snapshot --runtime qemu`).
    #[arg(long, default_value_t = 1, hide = true)]
    restore_slots: usize,
}

impl HostBenchArgs {
    fn options(self) -> vps_devtools::bench::host::HostBench {
        vps_devtools::bench::host::HostBench {
            image: self.image,
            cold: self.cold.clamp(1, 100),
            warm: self.warm.clamp(1, 100),
            accel: self.accel,
            snapshots: self.snapshots.min(100),
            restore_slots: self.restore_slots,
        }
    }
}

/// The whole command line: the server's and tools' commands, and one command per API group
/// (built from the method registry).
pub fn command() -> clap::Command {
    Cli::command()
        .subcommand(host_command())
        .subcommands(vps_cli::client::commands())
}

/// `vps host`: a command of its own, as it reads its own configuration, not the server's.
fn host_command() -> clap::Command {
    clap::Command::new("host").about(
        "Run the host agent: this node's instances as QEMU virtual machines, converged from \
         its NodeSpec (--config host.toml with a [host] table; also VPS_CONFIG).",
    )
}

/// Runs what `matches` asks for; the exit code comes back as `Ok(code)`.
pub async fn run_matches(matches: ArgMatches) -> anyhow::Result<i32> {
    if let Some((name, sub)) = matches.subcommand() {
        if vps_cli::client::is_group(name) {
            return Ok(vps_cli::client::run(name, sub).await);
        }
        if name == "doctor" {
            if let Some(path) = sub
                .get_one::<PathBuf>("config")
                .filter(|p| is_host_config(p))
            {
                vps_api::telemetry::init_logging();
                return host_doctor(path, sub.get_flag("json")).await;
            }
        }
        if name == "host" {
            vps_api::telemetry::init_logging();
            return host(sub.get_one::<PathBuf>("config").cloned()).await;
        }
    }
    run(Cli::from_arg_matches(&matches)?).await
}

/// Runs the command line; the exit code comes back as `Ok(code)`.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    vps_api::telemetry::init_logging();
    let config = Config::load(cli.config.as_deref())?;
    match cli.command {
        Command::Serve => serve(config).await,
        Command::Dev(args) => {
            let sim = args.sim.unwrap_or(if args.qemu > 0 { 0 } else { 3 });
            vps_devtools::dev::run(config, sim, args.qemu).await
        }
        Command::Events(cmd) => events(&config, cmd).await,
        Command::Audit(AuditCommand::Verify) => {
            let db = Database::open(&config, 4).await?;
            Ok(exit_code(vps_api::tools::audit::verify(&db.pool).await?))
        }
        Command::Openapi => {
            let document = serde_json::to_string_pretty(vps_api::openapi::document())?;
            println!("{document}");
            Ok(0)
        }
        Command::Call { method, body, json } => Ok(exit_code(
            vps_cli::tools::call::call(&method, body.as_deref(), json).await?,
        )),
        Command::History { id, json } => {
            let db = Database::open(&config, 4).await?;
            Ok(exit_code(
                vps_api::tools::history::print(&db.pool, &id, json).await?,
            ))
        }
        Command::Replay {
            from,
            scratch_database_url: None,
            ..
        } => {
            let db = Database::open(&config, 6).await?;
            Ok(exit_code(
                vps_api::tools::replay::verify(&db.pool, &db.pool, from).await?,
            ))
        }
        Command::Replay {
            from,
            scratch_database_url: Some(scratch_url),
            ..
        } => {
            // The configured database may be a read replica: it is not migrated.
            let (url, _cluster) = vps_api::database::server_url(&config).await?;
            let options = vps_events::DbOptions { max_connections: 4 };
            let live = vps_events::connect(&url, &options)
                .await
                .with_context(|| format!("connect to the database at {}", redact(&url)))?;
            let scratch = vps_events::connect(&scratch_url, &options)
                .await
                .with_context(|| {
                    format!(
                        "connect to the scratch database at {}",
                        redact(&scratch_url)
                    )
                })?;
            vps_events::migrate(&scratch)
                .await
                .context("apply migrations to the scratch database")?;
            Ok(exit_code(
                vps_api::tools::replay::verify(&live, &scratch, from).await?,
            ))
        }
        Command::Bench(cmd) => bench(&config, cmd).await,
        Command::Usage(cmd) => usage(&config, cmd).await,
        Command::Tunnel {
            ticket_file,
            url,
            ticket,
        } => {
            use vps_cli::tools::tunnel::TicketFile;
            let tunnel = match (ticket_file, url, ticket) {
                (Some(path), _, _) => TicketFile::read(&path)?,
                (None, Some(url), Some(ticket)) => TicketFile { url, ticket },
                _ => anyhow::bail!("give --ticket-file, or --url and --ticket"),
            };
            vps_cli::tools::tunnel::run(&tunnel).await?;
            Ok(0)
        }
        Command::Completions { shell } => {
            clap_complete::generate(shell, &mut command(), "vps", &mut std::io::stdout());
            Ok(0)
        }
        Command::Doctor { json } => vps_api::doctor::report::command(&config, json).await,
        Command::Mcp(args) => vps_cli::mcp::run(args).await,
    }
}

/// Whether a configuration file is a host agent's (it has a `[host]` table).
fn is_host_config(path: &std::path::Path) -> bool {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.parse::<toml::Table>().ok())
        .is_some_and(|table| table.contains_key("host"))
}

/// `vps doctor --config host.toml`: the host's checks, printed as the server's are.
async fn host_doctor(path: &std::path::Path, json: bool) -> anyhow::Result<i32> {
    use vps_api::doctor::{Finding, Severity};
    let config = vps_host::load_config(path)?;
    let findings: Vec<Finding> = vps_host::doctor::run(&config)
        .await
        .into_iter()
        .map(|f| {
            let severity = match f.severity {
                vps_host::doctor::Severity::Ok => Severity::Ok,
                vps_host::doctor::Severity::Warning => Severity::Warning,
                vps_host::doctor::Severity::Error => Severity::Error,
            };
            match f.fix {
                None => Finding::ok(f.check, f.message),
                Some(fix) => Finding::bad(f.check, severity, f.message, fix),
            }
        })
        .collect();
    Ok(vps_api::doctor::report::print(
        &findings,
        json,
        &mut std::io::stdout().lock(),
    )?)
}

/// `vps host`: its own configuration file, not the server's.
async fn host(path: Option<PathBuf>) -> anyhow::Result<i32> {
    let path = path
        .or_else(|| std::env::var_os("VPS_CONFIG").map(PathBuf::from))
        .ok_or_else(|| anyhow::anyhow!("vps host needs --config host.toml (or VPS_CONFIG)"))?;
    let config = vps_host::load_config(&path)?;
    vps_host::run(config).await?;
    Ok(0)
}

/// 0 when the check passed, 1 when it did not.
fn exit_code(passed: bool) -> i32 {
    if passed {
        0
    } else {
        1
    }
}

/// `vps events list|tail`.
async fn events(config: &Config, cmd: EventsCommand) -> anyhow::Result<i32> {
    let (args, tail) = match cmd {
        EventsCommand::List(a) => (a, false),
        EventsCommand::Tail(a) => (a, true),
    };
    for t in &args.types {
        vps_events::pattern::validate(t).map_err(anyhow::Error::msg)?;
    }
    let options = vps_api::tools::events::ListOptions {
        after: match &args.after {
            Some(c) => c.parse()?,
            None => vps_events::Cursor::START,
        },
        types: args.types,
        subject: args.subject,
        limit: args.limit.clamp(1, 10_000),
        json: args.json,
    };
    let db = Database::open(config, 4).await?;
    if tail {
        tokio::select! {
            r = vps_api::tools::events::tail(&db.pool, &options) => r?,
            _ = vps_api::server::shutdown_signal() => {},
        }
    } else {
        vps_api::tools::events::list(&db.pool, &options).await?;
    }
    Ok(0)
}

/// `vps usage list` through the API; `export|verify` on the configured database.
async fn usage(config: &Config, cmd: UsageCommand) -> anyhow::Result<i32> {
    if let UsageCommand::List {
        from,
        to,
        meter,
        resource_id,
        group_by,
        tenant,
        url,
        token,
        json,
    } = cmd
    {
        let body = serde_json::json!({ "from": from, "to": to, "meter": meter,
                                       "resourceId": resource_id, "tenantId": tenant,
                                       "groupBy": group_by });
        let body = vps_cli::client::without_nulls(body);
        let client = vps_cli::client::Client::new(&url, &token);
        return Ok(match client.call("usage.list", &body).await {
            Ok(answer) => {
                vps_cli::client::print(&answer, json);
                0
            }
            Err(code) => code,
        });
    }
    let db = Database::open(config, 4).await?;
    match cmd {
        UsageCommand::List { .. } => unreachable!("answered above"),
        UsageCommand::Export {
            from,
            to,
            tenant,
            format,
            group_by,
        } => {
            let mut out = std::io::BufWriter::new(std::io::stdout().lock());
            match group_by {
                Some(group_by) => {
                    let key = match vps_api::methods::usage::group_key(&group_by) {
                        Ok(key) => key,
                        Err(e) => {
                            eprintln!("--group-by: {}", e.message);
                            return Ok(2);
                        }
                    };
                    let range = (from, to);
                    vps_api::tools::usage::export_groups(
                        &db.pool, range, tenant, &key, format, &mut out,
                    )
                    .await?;
                }
                None => {
                    vps_api::tools::usage::export(&db.pool, from, to, tenant, format, &mut out)
                        .await?;
                }
            }
            Ok(0)
        }
        UsageCommand::Verify { from, to } => {
            let windows = vps_api::server::usage_windows(config);
            Ok(exit_code(
                vps_api::tools::usage::verify(&db.pool, windows, from, to).await?,
            ))
        }
    }
}

/// `vps bench …`: each benchmark but `authz` (and the converge bench's host process) runs in a
/// scratch database on the configured server.
async fn bench(config: &Config, cmd: BenchCommand) -> anyhow::Result<i32> {
    match cmd {
        BenchCommand::Authz { seconds, policies } => {
            let options = vps_devtools::bench::authz::AuthzBench {
                seconds: seconds.clamp(0.1, 600.0),
                policies: policies.min(100_000),
            };
            vps_devtools::bench::authz::run(&options)?;
            Ok(0)
        }
        BenchCommand::ConvergeHosts { url, boot_ms } => {
            vps_devtools::bench::converge::hosts_process(
                &url,
                std::time::Duration::from_millis(boot_ms),
            )
            .await?;
            Ok(0)
        }
        BenchCommand::HostInNamespace {
            args,
            root,
            append_ms,
        } => {
            vps_devtools::bench::host::in_namespace(&args.options(), &root, append_ms).await?;
            Ok(0)
        }
        cmd => {
            let (url, _cluster) = vps_api::database::server_url(config).await?;
            bench_on_server(&url, cmd).await
        }
    }
}

/// The benchmarks that run in a scratch database on the server at `url`.
async fn bench_on_server(url: &str, cmd: BenchCommand) -> anyhow::Result<i32> {
    match cmd {
        BenchCommand::Api { seconds, clients } => {
            let options = vps_devtools::bench::api::ApiBench {
                clients: clients.into_iter().map(|c| c.max(1)).collect(),
                seconds: seconds.clamp(0.5, 600.0),
            };
            vps_devtools::bench::api::run(url, &options).await?;
        }
        BenchCommand::Log {
            seconds,
            writers,
            rounds,
        } => {
            let options = vps_devtools::bench::log::LogBench {
                writers: writers.max(1),
                seconds: seconds.clamp(0.5, 600.0),
                batch: 100,
                rounds: rounds.clamp(1, 100),
            };
            vps_devtools::bench::log::run(url, &options).await?;
        }
        BenchCommand::Converge {
            hosts,
            instances,
            boot_ms,
            clients,
            timeout,
            usage_window,
        } => {
            let options = vps_devtools::bench::converge::ConvergeBench {
                hosts: hosts.max(1),
                instances: instances.max(1),
                boot: std::time::Duration::from_millis(boot_ms),
                clients: clients.max(1),
                timeout: std::time::Duration::from_secs_f64(timeout.clamp(1.0, 86_400.0)),
                usage_window: usage_window.clamp(1.0, 86_400.0),
            };
            return Ok(exit_code(
                vps_devtools::bench::converge::run(url, &options).await?,
            ));
        }
        BenchCommand::Sandbox {
            warm,
            cold,
            boot_ms,
        } => {
            let options = vps_devtools::bench::sandbox::SandboxBench {
                warm: warm.clamp(1, 500),
                cold: cold.clamp(1, 500),
                boot: std::time::Duration::from_millis(boot_ms),
            };
            vps_devtools::bench::sandbox::run(url, &options).await?;
        }
        BenchCommand::Snapshot {
            runtime,
            image,
            accel,
            rounds,
            restore_slots,
            ..
        } if runtime == "qemu" => {
            let image =
                image.ok_or_else(|| anyhow::anyhow!("--runtime qemu needs --image FILE"))?;
            let options = vps_devtools::bench::host::HostBench {
                image,
                cold: 1,
                warm: 1,
                accel,
                snapshots: rounds.clamp(1, 100),
                restore_slots,
            };
            return Ok(exit_code(
                vps_devtools::bench::host::run(url, &options).await?,
            ));
        }
        BenchCommand::Snapshot {
            rounds,
            size_mib,
            runtime,
            ..
        } => {
            anyhow::ensure!(
                runtime == "emulated",
                "--runtime is emulated or qemu, not {runtime:?}"
            );
            let options = vps_devtools::bench::snapshot::SnapshotBench {
                rounds: rounds.clamp(1, 1000),
                size: size_mib.clamp(1, 4096) << 20,
            };
            vps_devtools::bench::snapshot::run(url, &options).await?;
        }
        BenchCommand::Usage { instances, hours } => {
            let options = vps_devtools::bench::usage::UsageBench {
                instances: instances.clamp(1, 1_000_000),
                hours: hours.clamp(1, 24 * 31),
            };
            vps_devtools::bench::usage::run(url, &options).await?;
        }
        BenchCommand::Replay { events } => {
            let options = vps_devtools::bench::replay::ReplayBench {
                events: events.clamp(1000, 100_000_000),
            };
            let figures = vps_devtools::bench::replay::run(url, &options).await?;
            return Ok(exit_code(figures.equal && figures.chain_intact));
        }
        BenchCommand::List { rows, calls } => {
            let options = vps_devtools::bench::list::ListBench {
                rows: rows.clamp(200, 10_000_000),
                calls: calls.clamp(1, 100_000),
            };
            vps_devtools::bench::list::run(url, &options).await?;
        }
        BenchCommand::Report {
            guests,
            small,
            repeats,
        } => {
            let options = vps_devtools::bench::report::ReportBench {
                guests: guests.clamp(1, 10_000),
                small: small.clamp(1, 10_000),
                repeats: repeats.clamp(1, 10_000),
            };
            vps_devtools::bench::report::run(url, &options).await?;
        }
        BenchCommand::Delivery { rate, seconds } => {
            let options = vps_devtools::bench::delivery::DeliveryBench {
                rate: rate.clamp(1.0, 100_000.0),
                seconds: seconds.clamp(0.5, 600.0),
            };
            vps_devtools::bench::delivery::run(url, &options).await?;
        }
        BenchCommand::Chaos {
            sandboxes,
            instances,
            seconds,
            workers,
            hosts,
            deadline,
        } => {
            let options = vps_devtools::bench::chaos::ChaosBench {
                sandboxes: sandboxes.clamp(0, 100_000),
                instances: instances.clamp(0, 100_000),
                seconds: seconds.clamp(10.0, 86_400.0),
                workers: workers.clamp(1, 256),
                hosts: hosts.clamp(2, 1000),
                deadline: deadline.clamp(1.0, 3600.0),
            };
            let outcome = vps_devtools::bench::chaos::run(url, &options).await?;
            return Ok(exit_code(outcome.passed()));
        }
        BenchCommand::Host(args) => {
            return Ok(exit_code(
                vps_devtools::bench::host::run(url, &args.options()).await?,
            ));
        }
        BenchCommand::Authz { .. }
        | BenchCommand::ConvergeHosts { .. }
        | BenchCommand::HostInNamespace { .. } => {
            anyhow::bail!("this benchmark runs without a database")
        }
    }
    Ok(0)
}

async fn serve(config: Config) -> anyhow::Result<i32> {
    let db = Database::open(&config, vps_api::database::SERVE_CONNECTIONS).await?;
    let server = vps_api::server::start(config, db.pool.clone()).await?;
    vps_api::server::shutdown_signal().await;
    tracing::info!("shutting down");
    server.shutdown().await;
    db.pool.close().await;
    Ok(0)
}

/// The process: parses its arguments, runs the command and exits with the command's code (2
/// when it failed before answering one). The `vps` binary and the tests' copy of it both run
/// this.
pub async fn run_process() -> ! {
    match run_matches(command().get_matches()).await {
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::exit(2);
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_whole_command_line_is_well_formed() {
        // clap checks every command's arguments (unique names, valid conflicts) here.
        super::command().debug_assert();
    }
}
