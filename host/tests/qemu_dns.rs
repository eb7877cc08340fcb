//! The domains of a network allow-list against real QEMU under TCG with the minimal guest.
//! As in `qemu_network.rs`, the test's own network namespace is the host (the guests' bridge
//! `10.83.0.0/24`) and a second namespace plays "the internet": HTTP on `198.51.100.1`,
//! `198.51.100.2` and `203.0.113.1`, and on `203.0.113.1:53` a DNS server that answers
//! `allowed.test` (198.51.100.1) and `denied.test` (198.51.100.2), over UDP only. The host's
//! resolver asks it (`dns_upstream`). Nothing here touches the machine's own network.
//!
//! Needs what `qemu_network.rs` needs.

mod common;

use std::process::Stdio;
use std::time::Duration;

use common::{in_netns, run, Env, Owned};
use hickory_proto::op::{Message, Query, ResponseCode};
use hickory_proto::rr::{RData, RecordType};
use vps_host::runtime::qemu::{policy, Qemu};
use vps_host::runtime::{NetworkMode, NetworkPolicy, Runtime};

const GUEST: &str = "inst_dnsallowed0000000000000";
/// Its list names no domain: the resolver never answers it.
const NO_NAMES: &str = "inst_dnsnonames0000000000000";

/// HTTP on port 80 of every address (`GET /` answers the address it was reached at), and a
/// DNS server on UDP `203.0.113.1:53` (A records only, TTL 60; AAAA: no records; other
/// names: NXDOMAIN). The standard library only.
const SERVERS: &str = r#"
import http.server, socket, socketserver, struct, threading
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = ("hello from %s\n" % self.connection.getsockname()[0]).encode()
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
RECORDS = {"allowed.test": "198.51.100.1", "denied.test": "198.51.100.2"}
def dns():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("203.0.113.1", 53))
    while True:
        q, peer = s.recvfrom(4096)
        try:
            i, labels = 12, []
            while q[i]:
                labels.append(q[i + 1:i + 1 + q[i]].decode().lower()); i += 1 + q[i]
            qtype = struct.unpack("!H", q[i + 1:i + 3])[0]
            question = q[12:i + 5]
        except Exception:
            continue
        name = ".".join(labels)
        answers = b""
        if name not in RECORDS:
            flags = 0x8183
        else:
            flags = 0x8180
            if qtype == 1:
                answers = struct.pack("!HHHIH", 0xC00C, 1, 1, 60, 4) + socket.inet_aton(RECORDS[name])
        header = q[:2] + struct.pack("!HHHHH", flags, 1, 1 if answers else 0, 0, 0)
        s.sendto(header + question + answers, peer)
threading.Thread(target=dns, daemon=True).start()
S(("0.0.0.0", 80), H).serve_forever()
"#;

/// The second namespace: a process holding it, its veth, its addresses and its servers.
fn the_internet(env: &Env) -> (Owned, Owned) {
    common::the_internet(
        &env.root,
        "servers.py",
        SERVERS,
        &["198.51.100.254/24", "203.0.113.254/24"],
        &["198.51.100.1/24", "198.51.100.2/24", "203.0.113.1/24"],
    )
}

/// `command` in the guest over SSH, on a blocking thread: the resolver answers on this
/// test's single-threaded runtime meanwhile.
async fn ssh(env: &Env, id: &str, command: &str) -> Result<String, String> {
    let mut ssh = env.ssh_command(id);
    ssh.arg(command).stdin(Stdio::null());
    let output = tokio::task::spawn_blocking(move || ssh.output())
        .await
        .unwrap()
        .expect("ssh runs");
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    if output.status.success() {
        Ok(stdout)
    } else {
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(format!("{}: {stdout}{stderr}", output.status))
    }
}

/// `GET /` of `address` port 80 from inside the guest (3 s to connect): the answer, or why
/// not.
async fn get(env: &Env, address: &str) -> Result<String, String> {
    let out = ssh(
        env,
        GUEST,
        &format!("printf 'GET / HTTP/1.0\\r\\n\\r\\n' | nc -w 3 {address} 80"),
    )
    .await?;
    if out.contains("200 OK") {
        Ok(out)
    } else {
        Err(format!("no answer: {out:?}"))
    }
}

/// busybox `nslookup NAME SERVER` in guest `id` (no server: the guest's `/etc/resolv.conf`
/// names it): the IPv4 addresses it printed for the name (empty when it did not resolve), and
/// its whole output.
async fn lookup_in(env: &Env, id: &str, name: &str, server: &str) -> (Vec<String>, String) {
    let command = format!("nslookup -type=a {name} {server} 2>&1; echo status=$?");
    let out = ssh(env, id, &command).await.expect("nslookup runs");
    let answer = out.split_once(name).map_or("", |(_, rest)| rest);
    let addresses = answer
        .lines()
        .filter_map(|l| l.trim().strip_prefix("Address:"))
        .map(|a| a.trim().to_owned())
        .filter(|a| a.parse::<std::net::Ipv4Addr>().is_ok())
        .collect();
    (addresses, out)
}

async fn lookup(env: &Env, name: &str, server: &str) -> (Vec<String>, String) {
    lookup_in(env, GUEST, name, server).await
}

/// An A query for `name` sent from the guest over TCP to `server` port 53 (busybox has no TCP
/// DNS client: the framed query goes through `nc`): the answer, parsed.
async fn tcp_lookup(env: &Env, name: &str, server: &str) -> Result<Message, String> {
    let mut query = Message::query();
    query.metadata.id = 0x7cb1;
    query.metadata.recursion_desired = true;
    query.add_query(Query::query(name.parse().unwrap(), RecordType::A));
    let query = query.to_vec().unwrap();
    let mut framed = u16::try_from(query.len()).unwrap().to_be_bytes().to_vec();
    framed.extend_from_slice(&query);
    let command = format!(
        "echo {} | base64 -d | nc -w 3 {server} 53 | od -An -tx1 -v",
        data_encoding::BASE64.encode(&framed)
    );
    let hex = ssh(env, GUEST, &command).await?;
    let bytes: Vec<u8> = hex
        .split_whitespace()
        .map(|b| u8::from_str_radix(b, 16).map_err(|e| format!("{b:?}: {e}")))
        .collect::<Result<_, _>>()?;
    let length = bytes
        .get(..2)
        .map(|l| usize::from(u16::from_be_bytes([l[0], l[1]])))
        .ok_or_else(|| format!("no answer over TCP: {hex:?}"))?;
    let answer = bytes
        .get(2..2 + length)
        .ok_or_else(|| format!("an answer cut short: {hex:?}"))?;
    Message::from_vec(answer).map_err(|e| format!("{e}: {hex:?}"))
}

fn host_runtime(env: &Env) -> Qemu {
    let mut runtime = env.runtime();
    runtime.dns_upstream = Some("203.0.113.1:53".parse().unwrap());
    runtime
}

#[test]
fn an_allowed_name_resolves_and_connects_and_nothing_else_does() {
    common::minimal_bundle();
    in_netns(|| async {
        let env = Env::new("dns", 83);
        let (_holder, _servers) = the_internet(&env);
        let runtime = host_runtime(&env);
        let mut spec = env.spec(GUEST, 2);
        spec.network = Some(NetworkPolicy {
            allow: vec!["allowed.test".into()],
            ..NetworkPolicy::new(NetworkMode::Egress)
        });
        let mut no_names = env.spec(NO_NAMES, 3);
        no_names.network = Some(NetworkPolicy {
            allow: vec!["203.0.113.1/32".into()],
            ..NetworkPolicy::new(NetworkMode::Egress)
        });
        for spec in [&spec, &no_names] {
            runtime.run(spec).await.expect("run");
            assert!(policy::present(&spec.id).await, "the guest has its tables");
        }
        env.ssh_until_up(GUEST, "true");
        env.ssh_until_up(NO_NAMES, "true");

        // Not resolved yet: the allowed name's address is not reached.
        get(&env, "198.51.100.1")
            .await
            .expect_err("an address not resolved yet");

        // Asked of any server, the guest's query reaches the host's resolver: the allowed name
        // resolves (the upstream's answer), and then connects.
        let (addresses, out) = lookup(&env, "allowed.test", "203.0.113.1").await;
        assert_eq!(addresses, ["198.51.100.1"], "{out}");
        let body = get(&env, "198.51.100.1")
            .await
            .expect("a resolved, allowed address");
        assert!(body.contains("hello from 198.51.100.1"), "{body}");
        let table = policy::table_name(GUEST);
        let set = run(&["nft", "list", "set", "bridge", &table, policy::RESOLVED_SET]);
        assert!(
            set.contains("198.51.100.1 timeout 1m"),
            "the record's TTL: {set}"
        );
        // The connection keeps its address in use, past the record's TTL while it lasts.
        let in_use = run(&["nft", "list", "set", "bridge", &table, policy::IN_USE_SET]);
        assert!(in_use.contains("198.51.100.1"), "{in_use}");

        // The guest is told of the resolver: a lookup that names no server resolves too.
        let resolv = ssh(&env, GUEST, "cat /etc/resolv.conf").await;
        assert_eq!(resolv.as_deref(), Ok("nameserver 10.83.0.1\n"));
        let (addresses, out) = lookup(&env, "allowed.test", "").await;
        assert_eq!(addresses, ["198.51.100.1"], "from resolv.conf: {out}");

        // Over TCP, asked of a server that only serves UDP: the resolver answers, by the same
        // list.
        let answer = tcp_lookup(&env, "allowed.test", "203.0.113.1")
            .await
            .expect("an answer over TCP");
        assert_eq!(answer.metadata.id, 0x7cb1);
        assert_eq!(answer.metadata.response_code, ResponseCode::NoError);
        let addresses: Vec<String> = answer
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0.to_string()),
                _ => None,
            })
            .collect();
        assert_eq!(addresses, ["198.51.100.1"], "{answer:?}");
        let answer = tcp_lookup(&env, "denied.test", "203.0.113.1")
            .await
            .expect("an answer over TCP");
        assert_eq!(answer.metadata.response_code, ResponseCode::NXDomain);
        assert!(answer.answers.is_empty(), "{answer:?}");

        // A denied name does not resolve, though the server asked knows it: direct DNS to
        // another server does not get past the allow-list.
        let (addresses, out) = lookup(&env, "denied.test", "203.0.113.1").await;
        assert!(addresses.is_empty(), "{out}");
        assert!(out.contains("NXDOMAIN"), "{out}");
        let (addresses, out) = lookup(&env, "denied.test", "198.51.100.2").await;
        assert!(addresses.is_empty(), "{out}");

        // Addresses that were not resolved for an allowed name time out.
        get(&env, "198.51.100.2")
            .await
            .expect_err("denied.test's address");
        get(&env, "203.0.113.1")
            .await
            .expect_err("the upstream's own address");

        // A guest whose list names no domain keeps its own DNS, and the host's resolver does
        // not answer it.
        let (addresses, out) = lookup_in(&env, NO_NAMES, "denied.test", "203.0.113.1").await;
        assert_eq!(addresses, ["198.51.100.2"], "its own server: {out}");
        let (addresses, out) = lookup_in(&env, NO_NAMES, "allowed.test", "10.83.0.1").await;
        assert!(addresses.is_empty(), "{out}");
        assert!(out.contains("timed out"), "no answer at all: {out}");
        // It is told of the upstream, which its list lets it reach.
        let resolv = ssh(&env, NO_NAMES, "cat /etc/resolv.conf").await;
        assert_eq!(resolv.as_deref(), Ok("nameserver 203.0.113.1\n"));
        let (addresses, out) = lookup_in(&env, NO_NAMES, "denied.test", "").await;
        assert_eq!(addresses, ["198.51.100.2"], "from resolv.conf: {out}");

        // A restarted agent answers the guest's names again (it re-adopts the guest).
        drop(runtime);
        tokio::time::sleep(Duration::from_millis(200)).await;
        let runtime = host_runtime(&env);
        runtime.adopt().await;
        let (addresses, out) = lookup(&env, "allowed.test", "10.83.0.1").await;
        assert_eq!(addresses, ["198.51.100.1"], "after a restart: {out}");

        // The rules and their sets go with the guest.
        for id in [GUEST, NO_NAMES] {
            runtime.delete(id).await.expect("delete");
            assert!(!policy::present(id).await, "{id}'s tables are gone");
        }
        env.assert_no_qemu();
    });
}
