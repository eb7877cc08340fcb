//! The emulated project: servers in memory and their status transitions.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use chrono::{DateTime, Utc};
use vps_clock::Clock;

/// A server as a test sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmulatedServer {
    /// Server id.
    pub id: u64,
    /// Server name (unique in the project).
    pub name: String,
    /// Hetzner status: `initializing`, `running`, `off`, …
    pub status: String,
    /// The `server_type` it was created with.
    pub server_type: String,
    /// The `image` it was created with.
    pub image: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The `user_data` it was created with.
    pub user_data: Option<String>,
}

pub(super) struct Cloud {
    servers: BTreeMap<u64, Server>,
    next_id: u64,
    next_action: u64,
    boot_delay: Duration,
    pub hidden_lookups: usize,
}

pub(super) struct Server {
    pub id: u64,
    pub name: String,
    pub status: &'static str,
    pub server_type: String,
    pub image: String,
    pub location: String,
    pub labels: BTreeMap<String, String>,
    pub user_data: Option<String>,
    pub created: DateTime<Utc>,
    /// The status it reaches when the running action completes (`None`: it disappears).
    pending: Option<(Instant, Option<&'static str>)>,
}

/// What `POST /servers` asks for, already validated.
pub(super) struct NewServer {
    pub name: String,
    pub server_type: String,
    pub image: String,
    pub location: String,
    pub labels: BTreeMap<String, String>,
    pub user_data: Option<String>,
}

/// An API error: status, Hetzner's code and message.
#[derive(Debug)]
pub(super) struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
}

impl Cloud {
    pub fn new(boot_delay: Duration) -> Self {
        Self {
            servers: BTreeMap::new(),
            next_id: 4_711_001,
            next_action: 1,
            boot_delay,
            hidden_lookups: 0,
        }
    }

    /// Completes every action whose time has come.
    pub fn settle(&mut self) {
        let now = Instant::now();
        let mut gone = Vec::new();
        for server in self.servers.values_mut() {
            match server.pending {
                Some((at, next)) if at <= now => {
                    server.pending = None;
                    match next {
                        Some(status) => server.status = status,
                        None => gone.push(server.id),
                    }
                }
                _ => {}
            }
        }
        for id in gone {
            self.servers.remove(&id);
        }
    }

    pub fn servers(&self) -> impl Iterator<Item = &Server> {
        self.servers.values()
    }

    pub fn action_id(&mut self) -> u64 {
        self.next_action += 1;
        self.next_action
    }

    pub fn create(&mut self, new: NewServer) -> Result<&Server, ApiError> {
        if self.servers.values().any(|s| s.name == new.name) {
            return Err(ApiError {
                status: StatusCode::CONFLICT,
                code: "uniqueness_error",
                message: "server name is already used".to_owned(),
            });
        }
        let id = self.next_id;
        self.next_id += 1;
        let server = Server {
            id,
            name: new.name,
            status: "initializing",
            server_type: new.server_type,
            image: new.image,
            location: new.location,
            labels: new.labels,
            user_data: new.user_data,
            created: Clock::system().now(),
            pending: Some((Instant::now() + self.boot_delay, Some("running"))),
        };
        Ok(self.servers.entry(id).or_insert(server))
    }

    pub fn get(&self, id: u64) -> Result<&Server, ApiError> {
        self.servers.get(&id).ok_or_else(|| not_found(id))
    }

    /// Runs a power action: `poweron`, `shutdown` or `poweroff`; answers its command name.
    pub fn power(&mut self, id: u64, action: &str) -> Result<&'static str, ApiError> {
        let delay = self.boot_delay;
        let server = self.servers.get_mut(&id).ok_or_else(|| not_found(id))?;
        if server.status == "deleting" {
            return Err(ApiError {
                status: StatusCode::LOCKED,
                code: "locked",
                message: "server is locked by a running action".to_owned(),
            });
        }
        let (command, via, to) = match action {
            "poweron" => ("start_server", "starting", "running"),
            "shutdown" => ("shutdown_server", "stopping", "off"),
            "poweroff" => ("stop_server", "stopping", "off"),
            _ => {
                return Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    code: "not_found",
                    message: format!("action '{action}' not found"),
                })
            }
        };
        // Asking for the state a server is already in (or heading to) changes nothing.
        let heading_to = server
            .pending
            .and_then(|(_, next)| next)
            .unwrap_or(server.status);
        if heading_to != to {
            server.status = via;
            server.pending = Some((Instant::now() + delay, Some(to)));
        }
        Ok(command)
    }

    pub fn delete(&mut self, id: u64) -> Result<(), ApiError> {
        let delay = self.boot_delay;
        let server = self.servers.get_mut(&id).ok_or_else(|| not_found(id))?;
        if server.status != "deleting" {
            server.status = "deleting";
            server.pending = Some((Instant::now() + delay, None));
        }
        Ok(())
    }

    pub fn remove(&mut self, id: u64) -> bool {
        self.servers.remove(&id).is_some()
    }
}

impl From<&Server> for EmulatedServer {
    fn from(server: &Server) -> Self {
        Self {
            id: server.id,
            name: server.name.clone(),
            status: server.status.to_owned(),
            server_type: server.server_type.clone(),
            image: server.image.clone(),
            labels: server.labels.clone(),
            user_data: server.user_data.clone(),
        }
    }
}

pub(super) fn not_found(id: impl std::fmt::Display) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        message: format!("server with ID '{id}' not found"),
    }
}
