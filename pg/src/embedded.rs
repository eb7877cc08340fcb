//! A private PostgreSQL cluster run from the server binaries already on the machine.
//!
//! `vps` uses it when no database URL is configured: `initdb` once, then `pg_ctl start` on every
//! run, data kept under the data directory across restarts, stopped when the handle drops.
//! PostgreSQL refuses to run as root, so as root the cluster belongs to the `postgres` user.

use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// What can go wrong while preparing or starting the embedded cluster. Every message names
/// what to install or set.
#[derive(Debug, thiserror::Error)]
pub enum EmbeddedError {
    /// No directory holds `initdb`, `pg_ctl` and `postgres` together.
    #[error(
        "no PostgreSQL server binaries found (looked for initdb, pg_ctl and postgres on PATH and in \
         /usr/lib/postgresql/*/bin): install the server (`apt-get install postgresql`) or set \
         [database] url / VPS_DATABASE_URL"
    )]
    BinariesMissing,
    /// Running as root and there is no unprivileged user to own the cluster.
    #[error(
        "PostgreSQL refuses to run as root and there is no `postgres` user to run it as: create \
         one (`useradd -r postgres`) or set [database] url / VPS_DATABASE_URL"
    )]
    NoUnprivilegedUser,
    /// A file-system step failed.
    #[error("embedded PostgreSQL: {action} {path}: {source}")]
    Io {
        /// What was being done.
        action: &'static str,
        /// The path involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// `initdb` or `pg_ctl` exited with an error.
    #[error("embedded PostgreSQL: `{command}` failed: {detail}\nhint: {hint}")]
    Command {
        /// The command that failed.
        command: String,
        /// Its output, or the server log's tail.
        detail: String,
        /// What to try.
        hint: String,
    },
}

/// Where and how to run the cluster.
#[derive(Debug, Clone)]
pub struct EmbeddedOptions {
    /// The data directory (`.vps/pg` for `vps`).
    pub data_dir: PathBuf,
    /// Trade durability for speed (fsync off): for test clusters only.
    pub throwaway: bool,
}

/// A running embedded cluster. Dropping the handle stops the server if this handle started it.
#[derive(Debug)]
pub struct EmbeddedCluster {
    data_dir: PathBuf,
    bin_dir: PathBuf,
    owner: Option<(u32, u32)>,
    port: u16,
    started_here: bool,
}

impl EmbeddedCluster {
    /// Initialises the data directory if needed and starts the server unless it already runs.
    /// Blocking: call it before the async runtime gets busy, or from `spawn_blocking`.
    pub fn start(options: &EmbeddedOptions) -> Result<Self, EmbeddedError> {
        let bin_dir = find_bin_dir().ok_or(EmbeddedError::BinariesMissing)?;
        let owner = if running_as_root() {
            Some(lookup_user("postgres").ok_or(EmbeddedError::NoUnprivilegedUser)?)
        } else {
            None
        };
        let data_dir = absolute(&options.data_dir)?;
        create_dir(&data_dir, owner)?;
        // Several processes (parallel test binaries) may race to initialise one directory.
        let lock_path = data_dir.with_extension("lock");
        let lock = File::create(&lock_path).map_err(io("create", &lock_path))?;
        lock.lock().map_err(io("lock", &lock_path))?;

        let mut cluster = EmbeddedCluster {
            data_dir,
            bin_dir,
            owner,
            port: 0,
            started_here: false,
        };
        if !cluster.data_dir.join("PG_VERSION").exists() {
            cluster.init(options.throwaway)?;
        }
        cluster.port = cluster.read_port()?;
        if !cluster.is_running() {
            cluster.run_start()?;
            cluster.started_here = true;
        }
        Ok(cluster)
    }

    /// The connection URL of the cluster's `postgres` database.
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Lets the server outlive this handle (shared test clusters).
    pub fn detach(mut self) {
        self.started_here = false;
    }

    fn init(&self, throwaway: bool) -> Result<(), EmbeddedError> {
        let pgdata = self.data_dir.join("data");
        let out = self
            .command("initdb")
            .args([
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--no-instructions",
                "-D",
            ])
            .arg(&pgdata)
            .output()
            .map_err(io("run", &self.bin_dir.join("initdb")))?;
        check(
            "initdb",
            &out,
            "the data directory and its parents must be writable/reachable by the cluster's user",
        )?;
        let port = free_port().map_err(io("pick a port for", &self.data_dir))?;
        let mut settings = format!(
            "\n# vps embedded cluster\nport = {port}\nlisten_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{}'\nmax_connections = 300\nshared_buffers = 256MB\n",
            pgdata.display()
        );
        if throwaway {
            settings.push_str("fsync = off\nsynchronous_commit = off\nfull_page_writes = off\n");
        }
        let conf = pgdata.join("postgresql.conf");
        OpenOptions::new()
            .append(true)
            .open(&conf)
            .and_then(|mut f| f.write_all(settings.as_bytes()))
            .map_err(io("write", &conf))?;
        // Written last: its presence means the directory is complete.
        fs::write(self.data_dir.join("PG_VERSION"), "vps\n")
            .map_err(io("write", &self.data_dir.join("PG_VERSION")))
    }

    fn read_port(&self) -> Result<u16, EmbeddedError> {
        let conf = self.data_dir.join("data/postgresql.conf");
        let text = fs::read_to_string(&conf).map_err(io("read", &conf))?;
        text.lines()
            .rev()
            .filter_map(|l| l.trim().strip_prefix("port = "))
            .find_map(|p| p.trim().parse().ok())
            .ok_or_else(|| EmbeddedError::Command {
                command: "read port".into(),
                detail: format!("{} has no `port = N` line", conf.display()),
                hint: format!("remove {} to re-initialise", self.data_dir.display()),
            })
    }

    fn is_running(&self) -> bool {
        self.pg_ctl(&["status"])
            .map(|o| o.status.success())
            .unwrap_or(false)
    }

    fn run_start(&self) -> Result<(), EmbeddedError> {
        let log = self.data_dir.join("server.log");
        let out = self.pg_ctl(&["-w", "-t", "60", "-l", &log.to_string_lossy(), "start"])?;
        if out.status.success() {
            return Ok(());
        }
        let tail = fs::read_to_string(&log)
            .map(|t| {
                t.lines()
                    .rev()
                    .take(8)
                    .collect::<Vec<_>>()
                    .into_iter()
                    .rev()
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .unwrap_or_default();
        Err(EmbeddedError::Command {
            command: "pg_ctl start".into(),
            detail: format!("{}{tail}", String::from_utf8_lossy(&out.stderr)),
            hint: format!(
                "see {}; another server may hold port {} (set [database] url to use it)",
                log.display(),
                self.port
            ),
        })
    }

    fn pg_ctl(&self, args: &[&str]) -> Result<Output, EmbeddedError> {
        self.command("pg_ctl")
            .arg("-D")
            .arg(self.data_dir.join("data"))
            .args(args)
            .output()
            .map_err(io("run", &self.bin_dir.join("pg_ctl")))
    }

    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new(self.bin_dir.join(program));
        cmd.current_dir("/");
        if let Some((uid, gid)) = self.owner {
            cmd.uid(uid).gid(gid);
        }
        cmd
    }
}

impl Drop for EmbeddedCluster {
    fn drop(&mut self) {
        if self.started_here {
            let _ = self.pg_ctl(&["-m", "fast", "-w", "stop"]);
        }
    }
}

fn find_bin_dir() -> Option<PathBuf> {
    let has_all = |d: &Path| {
        ["initdb", "pg_ctl", "postgres"]
            .iter()
            .all(|b| d.join(b).is_file())
    };
    let from_path = std::env::var_os("PATH")
        .map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .unwrap_or_default();
    let mut versioned: Vec<PathBuf> = fs::read_dir("/usr/lib/postgresql")
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path().join("bin"))
                .collect()
        })
        .unwrap_or_default();
    // Newest major version first.
    versioned.sort_by_key(|p| {
        std::cmp::Reverse(
            p.parent()
                .and_then(|v| v.file_name())
                .and_then(|v| v.to_str())
                .and_then(|v| v.parse::<u32>().ok())
                .unwrap_or(0),
        )
    });
    from_path.into_iter().chain(versioned).find(|d| has_all(d))
}

fn running_as_root() -> bool {
    fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// `(uid, gid)` of a user from `/etc/passwd`.
fn lookup_user(name: &str) -> Option<(u32, u32)> {
    let passwd = fs::read_to_string("/etc/passwd").ok()?;
    passwd.lines().find_map(|line| {
        let mut f = line.split(':');
        (f.next()? == name).then_some(())?;
        let _password = f.next()?;
        Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
    })
}

fn absolute(path: &Path) -> Result<PathBuf, EmbeddedError> {
    std::path::absolute(path).map_err(io("resolve", path))
}

fn create_dir(dir: &Path, owner: Option<(u32, u32)>) -> Result<(), EmbeddedError> {
    fs::create_dir_all(dir).map_err(io("create", dir))?;
    if let Some((uid, gid)) = owner {
        std::os::unix::fs::chown(dir, Some(uid), Some(gid)).map_err(io("chown", dir))?;
    }
    Ok(())
}

fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

fn check(command: &str, out: &Output, hint: &str) -> Result<(), EmbeddedError> {
    if out.status.success() {
        return Ok(());
    }
    Err(EmbeddedError::Command {
        command: command.into(),
        detail: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        hint: hint.into(),
    })
}

fn io(action: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> EmbeddedError {
    let path = path.to_path_buf();
    move |source| EmbeddedError::Io {
        action,
        path,
        source,
    }
}
