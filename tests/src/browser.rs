//! A real headless Chromium (Debian's `chromium`), driven over the DevTools protocol on a pipe
//! (`--remote-debugging-pipe`: the browser reads commands on fd 3 and answers on fd 4, each
//! message one JSON text ended by a NUL byte), so no websocket client is needed.

use std::io::{BufRead, BufReader, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::sync::mpsc;

/// Where Debian installs Chromium (`VPS_CHROMIUM` names another binary).
const CHROMIUM: &str = "/usr/bin/chromium";
/// How long one protocol command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// One browser with one page.
pub struct Browser {
    child: Child,
    commands: std::io::PipeWriter,
    messages: mpsc::UnboundedReceiver<Value>,
    session: String,
    next_id: u64,
    /// Uncaught exceptions and `console.error` lines of the page, as they came.
    pub page_errors: Vec<String>,
    profile: tempfile::TempDir,
}

impl Browser {
    /// Starts Chromium headless with a fresh profile and opens a blank page of `width`×`height`.
    /// Panics, naming `.ci/run`, when Chromium is not installed.
    pub async fn launch(width: u32, height: u32) -> Browser {
        let binary = std::env::var_os("VPS_CHROMIUM")
            .map(PathBuf::from)
            .unwrap_or_else(|| CHROMIUM.into());
        assert!(
            binary.exists(),
            "{} is not installed: the console test drives a real Chromium. `.ci/run` installs it \
             (apt-get install chromium), or set VPS_CHROMIUM to a Chromium binary",
            binary.display()
        );
        let profile = tempfile::tempdir().expect("a profile directory");
        let log = std::fs::File::create(profile.path().join("chromium.log")).expect("a log file");
        let (browser_reads, commands) = std::io::pipe().expect("a pipe");
        let (answers, browser_writes) = std::io::pipe().expect("a pipe");
        let (read_fd, write_fd) = (browser_reads.as_raw_fd(), browser_writes.as_raw_fd());
        let mut command = Command::new(&binary);
        command
            .args([
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--remote-debugging-pipe",
            ])
            .arg(format!(
                "--user-data-dir={}",
                profile.path().join("data").display()
            ))
            .arg(format!("--window-size={width},{height}"))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("the log file"))
            .stderr(log);
        // SAFETY: only async-signal-safe calls between fork and exec. The pipe ends are first
        // copied above fd 10 (without close-on-exec) so that placing them at 3 and 4 cannot
        // overwrite one with the other.
        unsafe {
            command.pre_exec(move || {
                let read = libc::fcntl(read_fd, libc::F_DUPFD, 10);
                let write = libc::fcntl(write_fd, libc::F_DUPFD, 10);
                if read < 0 || write < 0 || libc::dup2(read, 3) < 0 || libc::dup2(write, 4) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = command.spawn().expect("chromium starts");
        // The browser holds its ends now; ours close so that its exit ends our reads.
        drop((browser_reads, browser_writes));
        let (tx, messages) = mpsc::unbounded_channel();
        std::thread::spawn(move || {
            let mut answers = BufReader::new(answers);
            loop {
                let mut message = Vec::new();
                match answers.read_until(0, &mut message) {
                    Ok(0) | Err(_) => return,
                    Ok(_) => {
                        message.pop_if(|b| *b == 0);
                        let Ok(value) = serde_json::from_slice(&message) else {
                            continue;
                        };
                        if tx.send(value).is_err() {
                            return;
                        }
                    }
                }
            }
        });
        let mut browser = Browser {
            child,
            commands,
            messages,
            session: String::new(),
            next_id: 0,
            page_errors: Vec::new(),
            profile,
        };
        let target = browser
            .command("Target.createTarget", json!({ "url": "about:blank" }))
            .await;
        let attached = browser
            .command(
                "Target.attachToTarget",
                json!({ "targetId": target["targetId"], "flatten": true }),
            )
            .await;
        browser.session = attached["sessionId"].as_str().expect("a session").into();
        browser.send("Page.enable", json!({})).await;
        browser.send("Runtime.enable", json!({})).await;
        browser
            .send(
                "Emulation.setDeviceMetricsOverride",
                json!({ "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false }),
            )
            .await;
        browser
    }

    /// A command to the page.
    pub async fn send(&mut self, method: &str, params: Value) -> Value {
        let session = self.session.clone();
        self.raw(method, params, Some(&session)).await
    }

    /// A command to the browser itself.
    async fn command(&mut self, method: &str, params: Value) -> Value {
        self.raw(method, params, None).await
    }

    async fn raw(&mut self, method: &str, params: Value, session: Option<&str>) -> Value {
        self.next_id += 1;
        let id = self.next_id;
        let mut message = json!({ "id": id, "method": method, "params": params });
        if let Some(session) = session {
            message["sessionId"] = json!(session);
        }
        let mut bytes = serde_json::to_vec(&message).expect("JSON");
        bytes.push(0);
        self.commands
            .write_all(&bytes)
            .unwrap_or_else(|e| panic!("{method}: the browser is gone ({e}){}", self.log()));
        let deadline = tokio::time::Instant::now() + COMMAND_TIMEOUT;
        loop {
            let message = tokio::time::timeout_at(deadline, self.messages.recv())
                .await
                .unwrap_or_else(|_| panic!("{method}: no answer in {COMMAND_TIMEOUT:?}"))
                .unwrap_or_else(|| panic!("{method}: the browser is gone{}", self.log()));
            if message["id"] == id {
                if let Some(error) = message.get("error") {
                    panic!("{method} failed: {error}");
                }
                return message["result"].clone();
            }
            self.note(&message);
        }
    }

    /// Keeps what the page reports going wrong.
    fn note(&mut self, event: &Value) {
        let params = &event["params"];
        match event["method"].as_str() {
            Some("Runtime.exceptionThrown") => {
                let details = &params["exceptionDetails"];
                let text = details["exception"]["description"]
                    .as_str()
                    .or(details["text"].as_str())
                    .unwrap_or("an exception");
                self.page_errors.push(text.to_string());
            }
            Some("Runtime.consoleAPICalled") if params["type"] == "error" => {
                let args: Vec<String> = params["args"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|a| {
                        a["value"]
                            .as_str()
                            .or(a["description"].as_str())
                            .unwrap_or("?")
                            .to_string()
                    })
                    .collect();
                self.page_errors.push(args.join(" "));
            }
            _ => {}
        }
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    pub async fn eval(&mut self, expression: &str) -> Value {
        let answer = self
            .send(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        if let Some(details) = answer.get("exceptionDetails") {
            panic!("`{expression}` threw: {details}");
        }
        answer["result"]["value"].clone()
    }

    /// Loads `url` and waits until its document is complete.
    pub async fn goto(&mut self, url: &str) {
        self.send("Page.navigate", json!({ "url": url })).await;
        self.wait_for("the page loaded", "document.readyState === 'complete'")
            .await;
    }

    /// Waits until `expression` is truthy (looked at every 100 ms, for up to 30 s); its value.
    pub async fn wait_for(&mut self, what: &str, expression: &str) -> Value {
        let deadline = Instant::now() + crate::PATIENCE;
        loop {
            let value = self.eval(expression).await;
            let truthy = !matches!(&value, Value::Null | Value::Bool(false))
                && value != json!("")
                && value != json!(0);
            if truthy {
                return value;
            }
            if Instant::now() > deadline {
                let shown = self
                    .eval("document.body ? document.body.innerText : ''")
                    .await;
                panic!(
                    "waited {:?} for {what}; the page shows:\n{}\npage errors: {:?}",
                    crate::PATIENCE,
                    shown.as_str().unwrap_or(""),
                    self.page_errors
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Clicks the middle of the element `selector` with the mouse, as a person would (the
    /// browser hit-tests the point, so a hidden or covered element is not clicked).
    pub async fn click(&mut self, selector: &str) {
        let quoted = json!(selector);
        let point = self
            .wait_for(
                &format!("{selector} to be visible"),
                &format!(
                    "(() => {{ const e = document.querySelector({quoted}); if (!e) return null; \
                     e.scrollIntoView({{ block: 'center' }}); const r = e.getBoundingClientRect(); \
                     return r.width && r.height ? [r.x + r.width / 2, r.y + r.height / 2] : null; }})()"
                ),
            )
            .await;
        for kind in ["mousePressed", "mouseReleased"] {
            self.send(
                "Input.dispatchMouseEvent",
                json!({ "type": kind, "x": point[0], "y": point[1], "button": "left", "clickCount": 1 }),
            )
            .await;
        }
    }

    /// Focuses the field `selector`, clears it and types `text` into it.
    pub async fn type_into(&mut self, selector: &str, text: &str) {
        let quoted = json!(selector);
        self.wait_for(
            &format!("{selector} to exist"),
            &format!(
                "(() => {{ const e = document.querySelector({quoted}); if (!e) return false; \
                 e.focus(); e.select(); return true; }})()"
            ),
        )
        .await;
        self.send("Input.insertText", json!({ "text": text })).await;
    }

    /// The text of the element `selector` (empty when there is none).
    pub async fn text(&mut self, selector: &str) -> String {
        let quoted = json!(selector);
        self.eval(&format!(
            "(document.querySelector({quoted}) || {{}}).textContent || ''"
        ))
        .await
        .as_str()
        .unwrap_or("")
        .trim()
        .to_string()
    }

    /// Writes a PNG of the page's viewport to `path`.
    pub async fn screenshot(&mut self, path: &Path) {
        let shot = self
            .send("Page.captureScreenshot", json!({ "format": "png" }))
            .await;
        let png = data_encoding::BASE64
            .decode(shot["data"].as_str().expect("image data").as_ref())
            .expect("base64");
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("the screenshot's directory");
        }
        std::fs::write(path, png).expect("the screenshot is written");
    }

    /// The end of Chromium's own log, for a failure message.
    fn log(&self) -> String {
        let log =
            std::fs::read_to_string(self.profile.path().join("chromium.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(20).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        format!("\nchromium's log ends:\n{}", tail.join("\n"))
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
