//! Network policy of the `qemu` runtime against real QEMU under TCG with the minimal guest.
//! The test's own network namespace is the host: the guests' bridge (`10.82.0.0/24`) and a
//! veth pair to a second namespace that plays "the internet", holding documentation-range
//! addresses (`198.51.100.1`, `203.0.113.1`) and a private one outside the pool
//! (`10.99.0.1`), each serving HTTP. Nothing here touches the machine's own network.
//!
//! Needs what `qemu_volumes.rs` needs, plus `nft`, `tc`, `unshare`, `nsenter` and `python3`.

mod common;

use std::process::{Command, Stdio};

use common::{in_netns, run, Env, Owned};
use vps_host::runtime::qemu::policy;
use vps_host::runtime::{NetworkMode, NetworkPolicy, Runtime};

const ALLOWED: &str = "inst_netallowed00000000000000";
const OPEN: &str = "inst_netopen0000000000000000";
const PRIVATE: &str = "inst_netprivate0000000000000";
const NONE: &str = "inst_netnone0000000000000000";

/// Serves HTTP on port 80 of every address (`GET /` answers the address it was reached at
/// and the peer it saw; `GET /big` a MiB; `POST` reads the body), holds connections open on
/// port 9000 until the client closes them; with a port argument, only HTTP on that port.
const SERVER: &str = r#"
import http.server, socket, socketserver, sys, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = (b"x" * (1 << 20)) if self.path == "/big" else (
            "hello from %s to %s\n" % (self.connection.getsockname()[0], self.client_address[0])).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def do_POST(self):
        n = int(self.headers.get("Content-Length", "0")); got = 0
        while got < n:
            chunk = self.rfile.read(min(65536, n - got))
            if not chunk: break
            got += len(chunk)
        body = ("got %d\n" % got).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
def drain(c):
    while c.recv(4096): pass
    c.close()
def hold():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("0.0.0.0", 9000)); s.listen(64)
    while True: threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
if len(sys.argv) > 1:
    S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
threading.Thread(target=hold, daemon=True).start()
S(("0.0.0.0", 80), H).serve_forever()
"#;

/// The second namespace: a process holding it, its veth, its addresses and its server.
fn the_internet(env: &Env) -> (Owned, Owned) {
    common::the_internet(
        &env.root,
        "server.py",
        SERVER,
        &["198.51.100.254/24", "203.0.113.254/24", "10.99.0.254/24"],
        &["198.51.100.1/24", "203.0.113.1/24", "10.99.0.1/24"],
    )
}

/// `GET path` of `host:port` from inside guest `id` (busybox `nc`: the guest's static busybox
/// `wget` crashes in its name-service lookups), 3 s to connect: the answer, or why not.
fn get(env: &Env, id: &str, target: &str) -> Result<String, String> {
    let (host, port) = target.split_once(':').unwrap_or((target, "80"));
    let out = env.ssh(
        id,
        &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {host} {port}"),
    )?;
    if out.contains("200 OK") {
        Ok(out)
    } else {
        Err(format!("no answer: {out:?}"))
    }
}

/// A MiB from the internet, and a MiB to it (the server answers `got 1048576`).
fn download(host: &str, port: u16) -> String {
    format!(
        "printf 'GET /big HTTP/1.0\\r\\n\\r\\n' | nc -w 120 {host} {port} | wc -c | grep -q '^10[0-9]\\{{5\\}}'"
    )
}
const UPLOAD: &str = "{ printf 'POST / HTTP/1.0\\r\\nContent-Length: 1048576\\r\\n\\r\\n'; \
     head -c 1048576 /dev/zero; } | nc -w 120 198.51.100.1 80 | grep -q 'got 1048576'";

/// Seconds guest `id` takes for `command` (measured inside the guest).
fn timed(env: &Env, id: &str, command: &str) -> u64 {
    let out = env
        .ssh(
            id,
            &format!("s=$(date +%s); {command} || echo failed; echo $(( $(date +%s) - s ))"),
        )
        .expect("timed command");
    assert!(!out.contains("failed"), "{command}: {out}");
    out.lines().last().unwrap().trim().parse().unwrap()
}

#[test]
fn each_policy_reaches_what_it_allows_and_times_out_on_the_rest() {
    common::minimal_bundle();
    in_netns(|| async {
        let env = Env::new("net", 82);
        let runtime = env.runtime();
        let (_holder, _server) = the_internet(&env);

        let mut allowed = env.spec(ALLOWED, 2);
        allowed.network = Some(NetworkPolicy {
            allow: vec!["198.51.100.1/32".into(), "example.com".into()],
            bandwidth_mbit: 1,
            ..NetworkPolicy::new(NetworkMode::Egress)
        });
        let mut open = env.spec(OPEN, 3);
        open.network = Some(NetworkPolicy {
            max_connections: 3,
            ..NetworkPolicy::new(NetworkMode::Egress)
        });
        let mut private = env.spec(PRIVATE, 4);
        private.network = Some(NetworkPolicy::new(NetworkMode::Private));
        let mut none = env.spec(NONE, 5);
        none.network = Some(NetworkPolicy::new(NetworkMode::None));
        for spec in [&allowed, &open, &private, &none] {
            runtime.run(spec).await.expect("run");
            assert!(
                policy::present(&spec.id).await,
                "{} has its tables",
                spec.id
            );
        }
        // The gateway's own server, for the pool's range.
        let _gateway = Owned(
            Command::new("python3")
                .arg(env.root.join("server.py"))
                .arg("8000")
                .stdout(Stdio::null())
                .spawn()
                .expect("python3"),
        );
        for id in [ALLOWED, OPEN, PRIVATE, NONE] {
            // The exec path reaches every guest's sshd, `none` included.
            env.ssh_until_up(id, "true");
        }
        let gateway = "10.82.0.1:8000";

        // egress with an allow-list: the allowed address, and nothing else beyond the pool.
        let body = get(&env, ALLOWED, "198.51.100.1").expect("an allowed address");
        assert!(
            body.contains("hello from 198.51.100.1 to 198.51.100.254"),
            "masqueraded: {body}"
        );
        get(&env, ALLOWED, "203.0.113.1").expect_err("not on the allow-list");
        get(&env, ALLOWED, "10.99.0.1").expect_err("not on the allow-list");
        get(&env, ALLOWED, gateway).expect("the pool's range");

        // egress without one: the internet, not private ranges beyond the pool.
        let body = get(&env, OPEN, "203.0.113.1").expect("the internet");
        assert!(body.contains("to 203.0.113.254"), "masqueraded: {body}");
        get(&env, OPEN, "10.99.0.1").expect_err("a private range");
        get(&env, OPEN, gateway).expect("the pool's range");

        // private: the pool's range only.
        get(&env, PRIVATE, gateway).expect("the pool's range");
        get(&env, PRIVATE, "198.51.100.1").expect_err("beyond the pool");

        // none: nothing, not even the gateway; the exec path still works.
        get(&env, NONE, gateway).expect_err("none reaches nothing");
        get(&env, NONE, "198.51.100.1").expect_err("none reaches nothing");
        assert_eq!(
            env.ssh(NONE, "echo exec works").unwrap().trim(),
            "exec works"
        );

        // Connections: three held open, a fourth is refused.
        env.ssh(
            OPEN,
            // Every descriptor away from the session, or ssh waits for them.
            "for i in 1 2 3; do (sleep 60 | nc 198.51.100.1 9000) < /dev/null > /dev/null 2>&1 & done; \
             sleep 2",
        )
        .expect("hold three connections");
        get(&env, OPEN, "203.0.113.1").expect_err("past max_connections");
        env.ssh(OPEN, "killall nc; sleep 1").unwrap();
        get(&env, OPEN, "203.0.113.1").expect("closed connections no longer count");

        // Bandwidth, 1 Mbit/s each way: a MiB takes more than 8 s (unbounded, under a second).
        let down = timed(&env, ALLOWED, &download("198.51.100.1", 80));
        eprintln!("a MiB down at 1 Mbit/s: {down} s");
        assert!(down >= 6, "a MiB in {down} s at 1 Mbit/s down");
        let up = timed(&env, ALLOWED, UPLOAD);
        eprintln!("a MiB up at 1 Mbit/s: {up} s");
        assert!(up >= 6, "a MiB in {up} s at 1 Mbit/s up");
        let fast = timed(&env, PRIVATE, &download("10.82.0.1", 8000));
        eprintln!("a MiB down at the default bound: {fast} s");
        assert!(
            fast < down,
            "the default bound is far above 1 Mbit/s: {fast} s"
        );

        // The rules go with the guest.
        for id in [ALLOWED, OPEN, PRIVATE, NONE] {
            runtime.delete(id).await.expect("delete");
            assert!(!policy::present(id).await, "{id}'s tables are gone");
        }
        let tables = run(&["nft", "list", "tables"]);
        assert!(!tables.contains("vps_"), "{tables}");
        env.assert_no_qemu();
    });
}
