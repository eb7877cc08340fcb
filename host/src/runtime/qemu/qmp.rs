//! A small typed QMP client: greeting, `qmp_capabilities`, commands matched to their replies by
//! id, and the one event the runtime acts on (`SHUTDOWN`, recorded in the guest's directory).
//!
//! Not the `qapi` crates: their generated types track the newest QEMU schema and their async
//! API needs a separately driven event stream; the runtime uses five commands and one event.
//!
//! QEMU serves one QMP client per socket, so each guest has one connection, held for as long as
//! the guest runs; a reader task owns its read half. The connection closing means QEMU exited.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::UnixStream;
use tokio::sync::oneshot;

/// How long a command may take before the client gives up on it.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);

/// Why a QMP exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    /// The socket could not be reached or broke.
    #[error("QMP socket {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// QEMU closed the connection: the process exited.
    #[error("QMP connection closed (QEMU exited)")]
    Closed,
    /// QEMU said something that is not QMP.
    #[error("QMP protocol: {0}")]
    Protocol(String),
    /// QEMU refused the command.
    #[error("QMP {command}: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    /// No reply in time.
    #[error("QMP {0}: no reply within {COMMAND_TIMEOUT:?}")]
    Timeout(String),
}

/// The VM's run state as `query-status` reports it (`running`, `paused`, `shutdown`, …).
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct Status {
    pub running: bool,
    pub status: String,
}

type Pending = Arc<Mutex<HashMap<u64, oneshot::Sender<Result<Value, QmpError>>>>>;

/// One negotiated QMP connection.
pub struct Qmp {
    path: PathBuf,
    writer: tokio::sync::Mutex<OwnedWriteHalf>,
    pending: Pending,
    next_id: AtomicU64,
    closed: Arc<AtomicBool>,
    reader: tokio::task::JoinHandle<()>,
}

impl Qmp {
    /// Connects, reads the greeting and enters command mode. `shutdown_record` is where a
    /// `SHUTDOWN` event's data is written, so the reason survives the process.
    pub async fn connect(path: &Path, shutdown_record: PathBuf) -> Result<Qmp, QmpError> {
        let io = |source| QmpError::Io {
            path: path.display().to_string(),
            source,
        };
        let stream = UnixStream::connect(path).await.map_err(io)?;
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();

        let greeting = handshake_message(&mut lines).await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "expected a greeting, got {greeting}"
            )));
        }
        write_line(&mut write, &json!({ "execute": "qmp_capabilities" }))
            .await
            .map_err(io)?;
        loop {
            let reply = handshake_message(&mut lines).await?;
            if reply.get("event").is_some() {
                continue;
            }
            if let Some(error) = reply.get("error") {
                return Err(command_error("qmp_capabilities", error));
            }
            break;
        }

        let pending: Pending = Arc::default();
        let closed = Arc::new(AtomicBool::new(false));
        let reader = tokio::spawn(read_loop(
            lines,
            pending.clone(),
            closed.clone(),
            shutdown_record,
        ));
        Ok(Qmp {
            path: path.to_owned(),
            writer: tokio::sync::Mutex::new(write),
            pending,
            next_id: AtomicU64::new(1),
            closed,
            reader,
        })
    }

    /// Whether QEMU has closed the connection.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Lets the reader take in what QEMU sent before it ended (its `SHUTDOWN` event among it)
    /// and then closes. Dropping the connection instead would throw that away: on a busy host
    /// the process is seen gone before the reader has run.
    pub async fn finish(mut self, within: Duration) {
        let _ = tokio::time::timeout(within, &mut self.reader).await;
    }

    /// Runs one command and returns its `return` value. Every failure counts in
    /// `vps_host_qmp_errors_total`.
    pub async fn execute(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let result = self.execute_inner(command, arguments).await;
        if let Err(error) = &result {
            metrics::counter!("vps_host_qmp_errors_total").increment(1);
            tracing::debug!(command, %error, "QMP command failed");
        }
        result
    }

    async fn execute_inner(
        &self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        if self.is_closed() {
            return Err(QmpError::Closed);
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = oneshot::channel();
        lock(&self.pending).insert(id, tx);
        let mut message = json!({ "execute": command, "id": id });
        if let Some(arguments) = arguments {
            message["arguments"] = arguments;
        }
        {
            let mut writer = self.writer.lock().await;
            if let Err(source) = write_line(&mut writer, &message).await {
                lock(&self.pending).remove(&id);
                return Err(match source.kind() {
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset => {
                        QmpError::Closed
                    }
                    _ => QmpError::Io {
                        path: self.path.display().to_string(),
                        source,
                    },
                });
            }
        }
        // The reader may have closed between our check and the insert: it drains what it saw.
        if self.is_closed() {
            lock(&self.pending).remove(&id);
            return Err(QmpError::Closed);
        }
        match tokio::time::timeout(COMMAND_TIMEOUT, rx).await {
            Ok(Ok(reply)) => reply.map_err(|e| match e {
                QmpError::Command { class, desc, .. } => QmpError::Command {
                    command: command.to_owned(),
                    class,
                    desc,
                },
                other => other,
            }),
            Ok(Err(_)) => Err(QmpError::Closed),
            Err(_) => {
                lock(&self.pending).remove(&id);
                Err(QmpError::Timeout(command.to_owned()))
            }
        }
    }

    /// `query-status`.
    pub async fn query_status(&self) -> Result<Status, QmpError> {
        let value = self.execute("query-status", None).await?;
        serde_json::from_value(value).map_err(|e| QmpError::Protocol(format!("query-status: {e}")))
    }
}

impl Drop for Qmp {
    fn drop(&mut self) {
        self.reader.abort();
    }
}

async fn read_loop(
    mut lines: tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
    pending: Pending,
    closed: Arc<AtomicBool>,
    shutdown_record: PathBuf,
) {
    loop {
        let message = match next_message(&mut lines).await {
            Ok(message) => message,
            Err(QmpError::Protocol(what)) => {
                tracing::warn!(%what, "ignoring a QMP message");
                continue;
            }
            Err(_) => break,
        };
        if let Some(event) = message.get("event").and_then(Value::as_str) {
            if event == "SHUTDOWN" {
                let data = message.get("data").cloned().unwrap_or(Value::Null);
                if let Err(error) = std::fs::write(&shutdown_record, data.to_string()) {
                    tracing::warn!(%error, path = %shutdown_record.display(), "cannot record SHUTDOWN");
                }
            }
            continue;
        }
        let Some(id) = message.get("id").and_then(Value::as_u64) else {
            continue;
        };
        let Some(tx) = lock(&pending).remove(&id) else {
            continue;
        };
        let reply = match (message.get("return"), message.get("error")) {
            (Some(value), _) => Ok(value.clone()),
            (None, Some(error)) => Err(command_error("", error)),
            (None, None) => Err(QmpError::Protocol(format!(
                "reply without return: {message}"
            ))),
        };
        let _ = tx.send(reply);
    }
    closed.store(true, Ordering::SeqCst);
    for (_, tx) in lock(&pending).drain() {
        let _ = tx.send(Err(QmpError::Closed));
    }
}

/// The reader task waits for events for ever; only the handshake is bounded.
async fn handshake_message(
    lines: &mut tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
) -> Result<Value, QmpError> {
    tokio::time::timeout(COMMAND_TIMEOUT, next_message(lines))
        .await
        .unwrap_or_else(|_| Err(QmpError::Timeout("handshake".into())))
}

async fn next_message(
    lines: &mut tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>,
) -> Result<Value, QmpError> {
    match lines.next_line().await {
        Ok(Some(line)) => {
            serde_json::from_str(&line).map_err(|e| QmpError::Protocol(format!("{e}: {line}")))
        }
        Ok(None) => Err(QmpError::Closed),
        Err(_) => Err(QmpError::Closed),
    }
}

async fn write_line(write: &mut OwnedWriteHalf, message: &Value) -> std::io::Result<()> {
    let mut line = message.to_string();
    line.push('\n');
    write.write_all(line.as_bytes()).await
}

fn command_error(command: &str, error: &Value) -> QmpError {
    let field = |name| {
        error
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    };
    QmpError::Command {
        command: command.to_owned(),
        class: field("class"),
        desc: field("desc"),
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::AsyncReadExt;
    use tokio::net::UnixListener;

    /// A QEMU that greets, takes `qmp_capabilities`, powers off (its `SHUTDOWN` event) and exits.
    async fn qemu_that_powers_off(listener: UnixListener) {
        let (mut stream, _) = listener.accept().await.unwrap();
        stream
            .write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut asked = [0u8; 256];
        let _ = stream.read(&mut asked).await.unwrap();
        stream
            .write_all(b"{\"return\": {}}\n{\"event\": \"SHUTDOWN\", \"data\": {\"guest\": true, \"reason\": \"guest-shutdown\"}}\n")
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn finishing_keeps_the_shutdown_event_qemu_sent_before_it_ended() {
        let dir = std::env::temp_dir().join(format!("vps-qmp-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (socket, record) = (dir.join("qmp.sock"), dir.join("shutdown.json"));
        let _ = std::fs::remove_file(&socket);
        let qemu = tokio::spawn(qemu_that_powers_off(UnixListener::bind(&socket).unwrap()));

        let qmp = Qmp::connect(&socket, record.clone())
            .await
            .expect("connect");
        qemu.await.unwrap();
        // Dropping the connection here instead would abort the reader before it ran.
        qmp.finish(Duration::from_secs(5)).await;
        let recorded = std::fs::read_to_string(&record).expect("the SHUTDOWN event was recorded");
        assert!(recorded.contains("guest-shutdown"), "{recorded}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
