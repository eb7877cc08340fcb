//! The real host end to end: a `vps` server on PostgreSQL, the host agent (`vps-host`) with the
//! real `qemu` runtime under TCG, and the minimal guest image (`vps images build minimal`).
//! Nothing here is emulated: every instance is a QEMU process, every exec an OpenSSH session
//! with the guest's own `sshd` through the agent's tunnel endpoint.
//!
//! Each test runs in a network namespace of its own ([`in_netns`]): a thread that unshares its
//! network namespace, then runs the server, the agent and every QEMU, `ip` and `ssh` they start
//! on a tokio runtime whose threads inherit that namespace. Bridges, taps and guest addresses
//! never touch the machine's network. PostgreSQL stays outside: the test reaches it over a unix
//! socket (`VPS_TEST_PG_SOCKET_DIR`, the cluster's socket directory, with the port of
//! `VPS_TEST_DATABASE_URL`; else a socket this process forwards to the cluster's TCP port).
//!
//! The guest image is `VPS_GUEST_IMAGE`, or the minimal bundle built once per version of the
//! guest crate's sources under the target directory (it needs `apt-get` with package lists).
//! Needs root, `qemu-system-x86_64`, `qemu-img`, `ip`, `setsid`, `ssh` and `ssh-keygen`.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use vps_host::runtime::qemu::{Accel, Qemu};
use vps_host::{AgentTimings, HostConfig, HostHandle, RuntimeKind};
use vps_tests::{TestServer, ALICE, OPERATOR};

/// Boot to `running` (and to a first SSH login) under TCG on a busy two-core machine.
const BOOT: Duration = Duration::from_secs(240);
/// A state change the agent makes without a boot (stop, delete, a crash noticed).
const CHANGE: Duration = Duration::from_secs(90);
/// The pool's addresses; the bridge takes the gateway, `.1`.
const CIDR: &str = "10.78.0.0/24";
const GATEWAY: &str = "10.78.0.1/24";
/// The bridge the server names in every NIC (`node_specs::BRIDGE`).
const BRIDGE: &str = "br0";
/// The user-data script of every guest here: it proves it ran, once, on the root disk.
const USER_DATA: &str =
    "#!/bin/sh\necho \"user data ran on $(cat /proc/sys/kernel/random/boot_id)\" >> /data/hello\n";

/// Two guests at once is what two cores under TCG carry: the tests that boot run one at a time.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

#[test]
fn a_sandbox_is_a_real_guest_that_execs_and_outlives_an_agent_restart() {
    in_netns(|database| async move {
        let lab = Lab::new("sandbox", &database).await;
        let mut host = Some(lab.start_host().await);
        let template = lab.template(Some(USER_DATA)).await;

        // Boot → ready; exec reaches the guest's own kernel, address and MAC.
        let a = lab.sandbox(&template, "a").await;
        let a_instance = a["instanceId"].as_str().unwrap().to_string();
        let keys = Keys::new(&lab.root).await;
        let grant = lab.exec_grant(&a, &keys, None).await;
        let out = ssh_until_up(&keys, &grant, "cat /proc/cmdline; ip -br addr; ip -br link; uname -r; cat /proc/sys/kernel/random/boot_id; cat /data/hello", &lab).await;
        let instance = lab.instance(&a_instance).await;
        let address = instance["addresses"][0].as_str().unwrap().to_string();
        let spec = lab.spec_entry(&a_instance).await;
        let mac = spec["nics"][0]["mac"].as_str().unwrap().to_string();
        let lines: Vec<&str> = out.lines().collect();
        assert!(lines[0].contains("console=ttyS0"), "{out}");
        let nic = lines
            .iter()
            .find(|l| l.contains(&format!("{address}/")))
            .unwrap_or_else(|| panic!("the leased address {address} is not on a NIC: {out}"));
        let nic_name = nic.split_whitespace().next().unwrap();
        assert!(
            lines
                .iter()
                .any(|l| l.starts_with(nic_name) && l.contains(&mac)),
            "{nic_name} does not carry the spec's MAC {mac}: {out}"
        );
        let host_release = String::from_utf8(run("uname", &["-r"]).await.stdout).unwrap();
        let release = lines[lines.len() - 3];
        assert!(release.contains("cloud"), "{out}");
        assert_ne!(
            release,
            host_release.trim(),
            "the guest runs the host's kernel"
        );
        let a_boot = lines[lines.len() - 2].to_string();
        assert_eq!(
            lines[lines.len() - 1],
            format!("user data ran on {a_boot}"),
            "{out}"
        );

        // Through the host's SSH relay: `vps sandboxes exec` prints the guest's kernel; `vps
        // sandboxes cp` carries a file and a tree in and out byte for byte; a pty session
        // (pty-req, then exec) gets a terminal.
        let sbx = a["id"].as_str().unwrap();
        let out = vps_cli(&lab, &["sandboxes", "exec", sbx, "--", "uname", "-r"]).await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            release,
            "exec ran elsewhere"
        );
        let local = lab.root.join("cp");
        std::fs::create_dir_all(local.join("tree/sub")).unwrap();
        let bytes: Vec<u8> = (0..400_000u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        std::fs::write(local.join("data.bin"), &bytes).unwrap();
        std::fs::write(local.join("tree/sub/deep.txt"), "deep\n").unwrap();
        let copies: [(String, String, bool); 4] = [
            (
                local.join("data.bin").display().to_string(),
                format!("{sbx}:/data/in.bin"),
                false,
            ),
            (
                format!("{sbx}:/data/in.bin"),
                local.join("back.bin").display().to_string(),
                false,
            ),
            (
                local.join("tree").display().to_string(),
                format!("{sbx}:/data/tree"),
                true,
            ),
            (
                format!("{sbx}:/data/tree"),
                local.join("tree-back").display().to_string(),
                true,
            ),
        ];
        for (from, to, recursive) in &copies {
            let mut args = vec!["sandboxes", "cp", from.as_str(), to.as_str()];
            if *recursive {
                args.push("-r");
            }
            let out = vps_cli(&lab, &args).await;
            assert!(
                out.status.success(),
                "cp {from} {to}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!(
            std::fs::read(local.join("back.bin")).unwrap() == bytes,
            "the file came back changed"
        );
        let deep = std::fs::read_to_string(local.join("tree-back/sub/deep.txt")).unwrap();
        assert_eq!(deep, "deep\n");
        let pty = ssh_with(
            &keys,
            &lab.exec_grant(&a, &keys, None).await,
            "tty",
            &["-tt"],
        )
        .await;
        assert!(pty.ok && pty.stdout.contains("/dev/pts/"), "{pty:?}");

        // Refused exec: a used ticket, an ended certificate, another instance's principal. The
        // host refuses each itself, so a's sshd never sees them: it logs every connection it
        // accepts on a's console (`LogLevel VERBOSE`), and counts none of these.
        let a_console = lab
            .state
            .join("guests")
            .join(&a_instance)
            .join("console.log");
        let seen_before = sshd_connections(&a_console);
        assert!(
            seen_before >= 1,
            "a's sshd logs no connection: {}",
            tail(&a_console)
        );
        let again = ssh(&keys, &grant, "echo in").await;
        assert!(
            !again.ok && again.stdout.is_empty(),
            "a used ticket opened: {again:?}"
        );
        let short = lab.exec_grant(&a, &keys, Some(1)).await;
        let ends: chrono::DateTime<chrono::Utc> =
            serde_json::from_value(short["validBefore"].clone()).unwrap();
        let ended_now = wait_for(CHANGE, || vps_clock::Clock::system().now() >= ends).await;
        assert!(ended_now, "the certificate never ended: {short}");
        let ended = ssh(&keys, &short, "echo in").await;
        assert!(
            !ended.ok && ended.stdout.is_empty(),
            "an ended certificate opened: {ended:?}"
        );
        let b = lab.sandbox(&template, "b").await;
        let b_instance = b["instanceId"].as_str().unwrap().to_string();
        let for_b = lab.exec_grant(&b, &keys, None).await;
        let ticket_for_a = lab.exec_grant(&a, &keys, None).await;
        let mut crossed = ticket_for_a.clone();
        crossed["certificate"] = for_b["certificate"].clone();
        let refused = ssh(&keys, &crossed, "echo in").await;
        assert!(
            !refused.ok && refused.stdout.is_empty(),
            "b's certificate opened a: {refused:?}"
        );
        // One exec that gets in: a's sshd logs it, and only it, since the three refused ones.
        let in_again = ssh(&keys, &lab.exec_grant(&a, &keys, None).await, "echo in").await;
        assert!(
            in_again.ok && in_again.stdout.trim() == "in",
            "{in_again:?}"
        );
        let logged = wait_for(CHANGE, || sshd_connections(&a_console) > seen_before).await;
        assert!(
            logged,
            "a's sshd did not log the exec: {}",
            tail(&a_console)
        );
        assert_eq!(
            sshd_connections(&a_console),
            seen_before + 1,
            "a refused exec reached a's sshd: {}",
            tail(&a_console)
        );
        let b_boot = ssh_until_up(
            &keys,
            &lab.exec_grant(&b, &keys, None).await,
            "cat /proc/sys/kernel/random/boot_id",
            &lab,
        )
        .await;

        // The agent dies without a word (its task aborted, as a kill -9 would leave it) and
        // comes back: both guests run on, never rebooted, and no second QEMU starts.
        let before = qemu_pids(&lab.state);
        assert_eq!(before.len(), 2, "{before:?}");
        host.take().unwrap().stop().await;
        // Not a wait for a condition: the outage under test, that the guests run through.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let host = lab.start_host().await;
        let reports = lab.reports_after(vps_clock::Clock::system().now()).await;
        assert!(reports, "the restarted agent reports");
        for (sandbox, boot) in [(&a, &a_boot), (&b, &b_boot)] {
            let grant = lab.exec_grant(sandbox, &keys, None).await;
            let now = ssh(&keys, &grant, "cat /proc/sys/kernel/random/boot_id").await;
            assert!(now.ok, "{now:?}");
            assert_eq!(now.stdout.trim(), boot.trim(), "the guest rebooted");
        }
        assert_eq!(qemu_pids(&lab.state), before, "a QEMU was started or ended");

        // A guest that powers itself off stays off: the agent reports it STOPPED and leaves
        // what follows to the server (it never boots it again on its own).
        let grant = lab.exec_grant(&b, &keys, None).await;
        let _ = ssh(&keys, &grant, "poweroff").await;
        let down = wait_for(CHANGE, || qemu_pids(&lab.state).len() == 1).await;
        assert!(down, "b's QEMU did not end: {:?}", qemu_pids(&lab.state));
        let reported = lab.reports_guests("stopped", 1).await;
        assert!(
            reported,
            "b is not reported STOPPED: {}",
            lab.t.metrics().await
        );
        assert!(lab.passes().await, "the agent reports on");
        assert_eq!(qemu_pids(&lab.state).len(), 1, "the agent booted b again");
        // The reference's reconciler: a report that disagrees with `desiredState` waits, so
        // the instance neither fails nor moves until someone asks for something.
        let b_now = lab.instance(&b_instance).await;
        assert_eq!(b_now["state"], "running", "{b_now}");
        assert_eq!(b_now["desiredState"], "running", "{b_now}");
        // An agent that starts while b is off keeps it off too: it never boots a guest that
        // powered itself off, restarted or not.
        host.stop().await;
        let since = vps_clock::Clock::system().now();
        let _host = lab.start_host().await;
        assert!(
            lab.reports_after(since).await,
            "the restarted agent reports"
        );
        assert!(lab.passes().await, "the agent reports on");
        assert_eq!(
            qemu_pids(&lab.state).len(),
            1,
            "the new agent booted b again"
        );
        let reported = lab.reports_guests("stopped", 1).await;
        assert!(
            reported,
            "b is not reported STOPPED: {}",
            lab.t.metrics().await
        );

        // Delete: QEMU, tap, overlay and config drive go, and the instance is deleted.
        lab.ok(
            ALICE,
            "sandboxes.delete",
            json!({ "tenantId": "acme", "sandboxId": a["id"] }),
        )
        .await;
        let gone = lab
            .wait_instance(&a_instance, CHANGE, |i| i["state"] == "deleted")
            .await;
        assert_eq!(gone["state"], "deleted", "{gone}");
        assert!(!lab.state.join("guests").join(&a_instance).exists());
        assert_eq!(qemu_pids(&lab.state).len(), 0, "b powered off, a deleted");
        let links = String::from_utf8(run("ip", &["-br", "link"]).await.stdout).unwrap();
        let a_tap = tap_of(&a_instance);
        assert!(!links.contains(&a_tap), "a's tap {a_tap} is left: {links}");
    });
}

#[test]
fn an_instance_stops_starts_on_the_same_disk_crashes_to_error_and_leaves_nothing_when_deleted() {
    in_netns(|database| async move {
        let lab = Lab::new("instance", &database).await;
        let _host = lab.start_host().await;
        let id = lab.instance_create(&lab.image_id, Some(USER_DATA)).await;
        let running = lab
            .wait_instance(&id, BOOT, |i| i["state"] == "running")
            .await;
        assert_eq!(running["state"], "running", "{running}");
        let console = lab.state.join("guests").join(&id).join("console.log");
        let up = wait_for(BOOT, || {
            std::fs::read_to_string(&console).is_ok_and(|c| ends_with_ready(&c))
        })
        .await;
        let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
        assert!(up, "the guest's init did not finish: {}", read_console());
        let first_console = std::fs::read_to_string(&console).unwrap();
        assert!(
            first_console.contains("first boot: making an ext4"),
            "{first_console}"
        );
        assert!(
            first_console.contains("running the user-data script"),
            "{first_console}"
        );

        // Stop → stopped, and no QEMU is left.
        lab.ok(
            ALICE,
            "instances.stop",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await;
        let stopped = lab
            .wait_instance(&id, CHANGE, |i| i["state"] == "stopped")
            .await;
        assert_eq!(stopped["state"], "stopped", "{stopped}");
        assert!(qemu_pids(&lab.state).is_empty());

        // Start → running on the same disk: no new file system, no second user-data run.
        lab.starts_again_on_its_disk(&id, &console, &first_console)
            .await;

        // QEMU killed from outside → ERROR, with a message.
        let pids = qemu_pids(&lab.state);
        assert_eq!(pids.len(), 1, "{pids:?}");
        // SAFETY: kill(2) on a pid this test found running its own QEMU.
        unsafe { libc::kill(pids[0], libc::SIGKILL) };
        let failed = lab
            .wait_instance(&id, CHANGE, |i| i["state"] == "error")
            .await;
        assert_eq!(failed["state"], "error", "{failed}");
        let why = failed["conditions"][0]["message"]
            .as_str()
            .unwrap_or_default();
        assert!(why.contains("QEMU") && why.contains("signal 9"), "{failed}");

        // Delete → deleted, with no QEMU, tap, overlay or config drive left.
        lab.ok(
            ALICE,
            "instances.delete",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await;
        let gone = lab
            .wait_instance(&id, CHANGE, |i| i["state"] == "deleted")
            .await;
        assert_eq!(gone["state"], "deleted", "{gone}");
        assert!(!lab.state.join("guests").join(&id).exists());
        assert!(qemu_pids(&lab.state).is_empty());
        let links = String::from_utf8(run("ip", &["-br", "link"]).await.stdout).unwrap();
        assert!(
            !links.lines().any(|l| l.starts_with("vps")),
            "a tap is left: {links}"
        );
    });
}

#[test]
fn a_guest_that_powers_itself_off_is_reported_stopped_stays_off_and_starts_again_on_its_disk() {
    in_netns(|database| async move {
        let lab = Lab::new("poweroff", &database).await;
        let _host = lab.start_host().await;
        // The guest powers itself off from within, once: its first boot's user data runs
        // `poweroff` a little after the boot, as a tenant's `poweroff` through exec would.
        let script =
            "#!/bin/sh\necho \"ran on $(cat /proc/sys/kernel/random/boot_id)\" >> /data/hello\n\
                      sync\n(sleep 15; poweroff) > /dev/null 2>&1 &\n";
        let id = lab.instance_create(&lab.image_id, Some(script)).await;
        let running = lab
            .wait_instance(&id, BOOT, |i| i["state"] == "running")
            .await;
        assert_eq!(running["state"], "running", "{running}");
        let console = lab.state.join("guests").join(&id).join("console.log");
        let read_console = || std::fs::read_to_string(&console).unwrap_or_default();
        let off = wait_for(BOOT, || qemu_pids(&lab.state).is_empty()).await;
        assert!(off, "the guest did not power off: {}", read_console());
        assert!(
            read_console().contains("running the user-data script"),
            "{}",
            read_console()
        );

        // Reported STOPPED, not ERROR; never booted again by the agent; and, as the reference
        // has it, the instance waits while the report disagrees with `desiredState`.
        let reported = lab.reports_guests("stopped", 1).await;
        assert!(reported, "not reported STOPPED: {}", lab.t.metrics().await);
        assert!(lab.passes().await, "the agent reports on");
        assert!(
            qemu_pids(&lab.state).is_empty(),
            "the agent booted it again"
        );
        let waiting = lab.instance(&id).await;
        assert_eq!(waiting["state"], "running", "{waiting}");
        assert_eq!(waiting["desiredState"], "running", "{waiting}");

        // Stop settles it at once (the report already says stopped); start boots it again on
        // the same disk: no new file system, no second user-data run (so no second poweroff).
        lab.ok(
            ALICE,
            "instances.stop",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await;
        let stopped = lab
            .wait_instance(&id, CHANGE, |i| i["state"] == "stopped")
            .await;
        assert_eq!(stopped["state"], "stopped", "{stopped}");
        assert!(qemu_pids(&lab.state).is_empty());
        // The start follows at once, whether or not the agent read the stop: the entry's
        // `startGeneration` moves, so the guest that ended on its own is booted again.
        let first_console = read_console();
        lab.starts_again_on_its_disk(&id, &console, &first_console)
            .await;
        assert_eq!(qemu_pids(&lab.state).len(), 1);
    });
}

#[test]
fn a_wrong_image_digest_ends_in_error_naming_both_digests_and_nothing_boots() {
    in_netns(|database| async move {
        let lab = Lab::new("digest", &database).await;
        let _host = lab.start_host().await;
        let wrong = "0".repeat(64);
        lab.ok(
            OPERATOR,
            "images.register",
            json!({ "imageId": "img_wrong", "url": format!("file://{}", lab.bundle.display()),
                    "sha256": wrong, "format": "bundle" }),
        )
        .await;
        let id = lab.instance_create("img_wrong", None).await;
        let failed = lab
            .wait_instance(&id, CHANGE, |i| i["state"] == "error")
            .await;
        assert_eq!(failed["state"], "error", "{failed}");
        let text = failed.to_string();
        assert!(
            text.contains(&wrong) && text.contains(&lab.digest),
            "{text}"
        );
        assert!(qemu_pids(&lab.state).is_empty(), "something booted");
    });
}

#[test]
fn a_warm_instance_waits_paused_and_a_claim_resumes_it_without_a_boot() {
    in_netns(|database| async move {
        let lab = Lab::new("warm", &database).await;
        let host = lab.start_host().await;
        let template = lab
            .template_with(json!({ "warm": { "min": 1, "max": 1 } }))
            .await;
        let paused = lab.warm_paused(&template).await;
        let dir = lab.state.join("guests").join(&paused);
        let console = dir.join("console.log");
        let pids = qemu_pids(&lab.state);
        assert_eq!(pids.len(), 1, "{pids:?}");
        // QEMU itself says the guest is paused. It serves one QMP client, the agent's: ask
        // while the agent is away, which also proves a restart leaves a paused guest paused.
        host.stop().await;
        let status = qmp(&dir.join("qmp.sock"), "query-status").await;
        assert_eq!(status["return"]["status"], "paused", "{status}");
        let host = lab.start_host().await;
        let boots_before = std::fs::read_to_string(&console).unwrap_or_default();

        let s = lab.sandbox(&template, "claim").await;
        assert_eq!(
            s["instanceId"],
            paused.as_str(),
            "the claim took another instance: {s}"
        );
        assert_eq!(s["warm"], true, "{s}");
        assert_eq!(
            qemu_pids(&lab.state),
            pids,
            "the claim started another QEMU"
        );
        let keys = Keys::new(&lab.root).await;
        let grant = lab.exec_grant(&s, &keys, None).await;
        let out = ssh_until_up(&keys, &grant, "cat /proc/uptime", &lab).await;
        assert!(!out.is_empty());
        host.stop().await;
        let status = qmp(&dir.join("qmp.sock"), "query-status").await;
        assert_eq!(status["return"]["status"], "running", "{status}");
        // One boot only: the console was neither started again nor rotated for a new boot.
        let after = std::fs::read_to_string(&console).unwrap_or_default();
        assert!(after.starts_with(&boots_before), "the console restarted");
        assert!(
            !dir.join("console.log.1").exists(),
            "the guest booted again"
        );
    });
}

#[test]
fn a_memory_snapshot_through_the_api_restores_a_sandbox_with_its_memory_and_files_under_a_new_identity(
) {
    in_netns(|database| async move {
        let lab = Lab::new("snapshot", &database).await;
        let _host = lab.start_host().await;
        let template = lab.template(None).await;
        let source = lab.sandbox(&template, "source").await;
        let keys = Keys::new(&lab.root).await;
        let grant = lab.exec_grant(&source, &keys, None).await;
        // A counter that lives only in the guest's memory, and a file on its disk.
        let before = ssh_until_up(
            &keys,
            &grant,
            "echo kept > /data/kept && sync && \
             setsid sh -c 'i=0; while :; do i=$((i+1)); echo $i > /run/counter; sleep 1; done' \
               </dev/null >/dev/null 2>&1 & \
             cat /proc/sys/kernel/random/boot_id /etc/machine-id",
            &lab,
        )
        .await;
        tokio::time::sleep(Duration::from_secs(3)).await;
        let counted = ssh(
            &keys,
            &lab.exec_grant(&source, &keys, None).await,
            "cat /run/counter",
        )
        .await;
        let counted: u64 = counted.stdout.trim().parse().expect("a count");

        let snap = lab
            .ok(
                ALICE,
                "sandboxes.snapshot",
                json!({ "tenantId": "acme", "sandboxId": source["id"], "includeMemory": true }),
            )
            .await;
        let deadline = Instant::now() + BOOT;
        let ready = loop {
            let s = lab
                .ok(
                    ALICE,
                    "sandboxSnapshots.get",
                    json!({ "tenantId": "acme", "snapshotId": snap["id"] }),
                )
                .await;
            if s["state"] != "pending" || Instant::now() > deadline {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        };
        assert_eq!(ready["state"], "ready", "{ready}");
        assert_eq!(ready["cpuModel"], "tcg:max", "{ready}");

        let restored = lab
            .sandbox_with(&template, "restored", json!({ "fromSnapshot": snap["id"] }))
            .await;
        // Ready as soon as its guest runs; while its source lives, exec waits for the identity
        // its host gives it beside that.
        let early = lab
            .t
            .call(
                ALICE,
                "sandboxes.exec",
                json!({ "tenantId": "acme", "sandboxId": restored["id"],
                        "publicKey": keys.public() }),
            )
            .await;
        match early {
            // Only once the host reported it (rare: the guest outran this test).
            Ok(_) => assert_eq!(
                lab.instance(restored["instanceId"].as_str().unwrap()).await["identityRebound"],
                true
            ),
            Err(refused) => assert_eq!(
                (refused.status_code(), &refused.body["details"]["reason"]),
                (
                    (409, Some("INVALID_STATE")),
                    &json!("restore-shares-identity")
                ),
                "{}",
                refused.body
            ),
        }
        lab.rebound(&restored).await;
        // Reported only once the guest had taken it, never at its resume.
        let console = lab
            .state
            .join("guests")
            .join(restored["instanceId"].as_str().unwrap())
            .join("console.log");
        let console = std::fs::read_to_string(console).unwrap_or_default();
        assert!(
            console.contains("restored: identity 1,"),
            "identityRebound before the guest took its identity:\n{console}"
        );
        let grant = lab.exec_grant(&restored, &keys, None).await;
        let after = ssh_until_up(
            &keys,
            &grant,
            "cat /data/kept /run/counter /proc/sys/kernel/random/boot_id /etc/machine-id",
            &lab,
        )
        .await;
        let before: Vec<&str> = before.lines().collect();
        let after: Vec<&str> = after.lines().collect();
        assert_eq!(after[0], "kept", "the file survives: {after:?}");
        let count: u64 = after[1].trim().parse().expect("a count");
        assert!(
            count >= counted,
            "the counter goes on from {counted}, not from zero: {count}"
        );
        assert_eq!(after[2], before[0], "the same boot: no reboot");
        assert_ne!(after[3], before[1], "the restore has its own machine id");
        let (a, b) = (
            lab.instance(source["instanceId"].as_str().unwrap()).await,
            lab.instance(restored["instanceId"].as_str().unwrap()).await,
        );
        assert_ne!(a["addresses"], b["addresses"], "each at its own address");
    });
}

#[test]
fn a_preview_url_serves_a_page_of_the_guests_httpd_and_a_forged_token_does_not() {
    in_netns(|database| async move {
        let lab = Lab::new("preview", &database).await;
        let _host = lab.start_host().await;
        let template = lab.template(None).await;
        let s = lab.sandbox(&template, "web").await;
        let id = s["id"].as_str().unwrap().to_string();
        let keys = Keys::new(&lab.root).await;
        let grant = lab.exec_grant(&s, &keys, None).await;
        // busybox's httpd daemonizes: the exec ends, the server stays.
        let started = ssh_until_up(
            &keys,
            &grant,
            &format!(
                "mkdir -p /tmp/www && echo 'hello from {id}' > /tmp/www/index.html && \
                 busybox httpd -p 8080 -h /tmp/www && echo started"
            ),
            &lab,
        )
        .await;
        assert!(started.contains("started"), "{started}");

        let exposed = lab
            .ok(
                ALICE,
                "sandboxes.expose",
                json!({ "tenantId": "acme", "sandboxId": id, "port": 8080, "ttlSeconds": 600 }),
            )
            .await;
        let url = exposed["url"].as_str().unwrap().to_string();
        // `vps serve` proxies it: a tunnel ticket to the agent, which connects the tunnel to the
        // guest's port 8080, where the guest's own httpd answers.
        for path in ["", "index.html"] {
            let response = lab.t.http.get(format!("{url}{path}")).send().await.unwrap();
            let status = response.status().as_u16();
            let page = response.text().await.unwrap();
            assert_eq!(status, 200, "{url}{path}: {page}");
            assert_eq!(page, format!("hello from {id}\n"));
        }
        let missing = lab
            .t
            .http
            .get(format!("{url}nothing"))
            .send()
            .await
            .unwrap();
        assert_eq!(missing.status().as_u16(), 404, "the guest's own 404");

        // A forged token opens nothing, and neither does the real one once revoked.
        let token = url.trim_end_matches('/').rsplit('/').next().unwrap();
        let (payload, mac) = token.split_once('.').unwrap();
        let flipped = if mac.starts_with('0') { "1" } else { "0" };
        let forged = format!(
            "{}/preview/{payload}.{flipped}{}/",
            lab.t.server.url(),
            &mac[1..]
        );
        let response = lab.t.http.get(&forged).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 404);
        assert_eq!(response.text().await.unwrap(), "no such preview\n");
        lab.ok(
            ALICE,
            "sandboxes.unexpose",
            json!({ "tenantId": "acme", "sandboxId": id, "port": 8080 }),
        )
        .await;
        let response = lab.t.http.get(&url).send().await.unwrap();
        assert_eq!(response.status().as_u16(), 404);
        assert_eq!(response.text().await.unwrap(), "no such preview\n");
    });
}

#[test]
fn a_fork_of_three_makes_three_guests_with_their_own_addresses_and_identities_holding_the_source_file(
) {
    in_netns(|database| async move {
        let lab = Lab::new("fork", &database).await;
        let _host = lab.start_host().await;
        let template = lab.template(None).await;
        let source = lab.sandbox(&template, "source").await;
        let keys = Keys::new(&lab.root).await;
        let grant = lab.exec_grant(&source, &keys, None).await;
        let identity = "cat /data/kept /etc/machine-id /etc/ssh/ssh_host_ed25519_key.pub";
        let before = ssh_until_up(
            &keys,
            &grant,
            &format!("echo kept > /data/kept && sync && {identity}"),
            &lab,
        )
        .await;
        let forked = lab
            .ok(
                ALICE,
                "sandboxes.fork",
                json!({ "tenantId": "acme", "sandboxId": source["id"], "count": 3,
                        "idempotencyKey": "fork-1" }),
            )
            .await;
        let made: Vec<String> = forked["sandboxes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["id"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(made.len(), 3, "{forked}");
        let mut identities = vec![before.lines().skip(1).collect::<Vec<_>>().join("\n")];
        let mut addresses =
            vec![lab.instance(source["instanceId"].as_str().unwrap()).await["addresses"].clone()];
        for id in &made {
            let s = lab.ready(id).await;
            lab.rebound(&s).await;
            let grant = lab.exec_grant(&s, &keys, None).await;
            let out = ssh_until_up(&keys, &grant, identity, &lab).await;
            let lines: Vec<&str> = out.lines().collect();
            assert_eq!(lines[0], "kept", "the source's file is in {id}: {out}");
            identities.push(lines[1..].join("\n"));
            addresses
                .push(lab.instance(s["instanceId"].as_str().unwrap()).await["addresses"].clone());
        }
        let distinct = |v: &[String]| v.iter().collect::<std::collections::HashSet<_>>().len();
        assert_eq!(
            distinct(&identities),
            4,
            "machine ids and host keys: {identities:?}"
        );
        let addresses: Vec<String> = addresses.iter().map(Value::to_string).collect();
        assert_eq!(distinct(&addresses), 4, "addresses: {addresses:?}");
    });
}

/// Runs `test` in a network namespace of its own (see the module's doc), one booting test at a
/// time. `test` gets the URL of a fresh database it can reach from there.
fn in_netns<F, Fut>(test: F)
where
    F: FnOnce(String) -> Fut + Send + 'static,
    Fut: Future<Output = ()>,
{
    let _one = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    // The guard drops the database once the test is over, from this (the machine's) namespace.
    let (_guard, database) = database_from_a_namespace();
    let thread = std::thread::spawn(move || {
        // SAFETY: unshare(2) with CLONE_NEWNET changes only this thread's network namespace;
        // the threads it starts from now on inherit it.
        let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
        assert_eq!(
            rc,
            0,
            "unshare(CLONE_NEWNET): {}",
            std::io::Error::last_os_error()
        );
        let status = std::process::Command::new("ip")
            .args(["link", "set", "lo", "up"])
            .status()
            .expect("ip runs");
        assert!(status.success());
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        runtime.block_on(test(database));
        // The guests of this namespace end with it: no QEMU outlives the test.
        runtime.shutdown_timeout(Duration::from_secs(5));
    });
    let outcome = thread.join();
    kill_leftover_qemus();
    if let Err(panic) = outcome {
        std::panic::resume_unwind(panic);
    }
}

/// A fresh database (dropped with the guard returned first), and a URL for it that works from
/// any network namespace: a unix socket.
fn database_from_a_namespace() -> (vps_pg::testing::TestDatabase, String) {
    let outer = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let tcp_url = outer.block_on(vps_pg::testing::fresh_database());
    let url = url_of(&tcp_url);
    let database = url.path().trim_start_matches('/').to_string();
    let user = if url.username().is_empty() {
        "postgres"
    } else {
        url.username()
    };
    if let Ok(dir) = std::env::var("VPS_TEST_PG_SOCKET_DIR") {
        let port = url.port().unwrap_or(5432);
        let url = format!("postgres://{user}@localhost/{database}?host={dir}&port={port}");
        return (tcp_url, url);
    }
    let dir = forward_postgres(&tcp_url);
    let url = format!(
        "postgres://{user}@localhost/{database}?host={}&port=5432",
        dir.display()
    );
    (tcp_url, url)
}

fn url_of(text: &str) -> reqwest::Url {
    reqwest::Url::parse(text).unwrap_or_else(|e| panic!("database URL {text}: {e}"))
}

/// A unix socket (`<dir>/.s.PGSQL.5432`) forwarded to the cluster's TCP port by a thread of
/// the machine's namespace. One per process.
fn forward_postgres(tcp_url: &str) -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| {
        let url = url_of(tcp_url);
        let target = format!(
            "{}:{}",
            url.host_str().unwrap_or("127.0.0.1"),
            url.port().unwrap_or(5432)
        );
        let dir = std::env::temp_dir().join(format!("vps-real-host-pg-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = std::os::unix::net::UnixListener::bind(dir.join(".s.PGSQL.5432")).unwrap();
        std::thread::spawn(move || {
            for client in listener.incoming().flatten() {
                let Ok(server) = std::net::TcpStream::connect(&target) else {
                    continue;
                };
                let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
                let (mut c, mut s) = (client, server);
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut c, &mut s);
                    let _ = s.shutdown(std::net::Shutdown::Write);
                });
                std::thread::spawn(move || {
                    let _ = std::io::copy(&mut s2, &mut c2);
                    let _ = c2.shutdown(std::net::Shutdown::Write);
                });
            }
        });
        dir
    })
    .clone()
}

/// One test's world: the server, its pool and node, the agent's directories.
struct Lab {
    t: TestServer,
    pool_id: String,
    root: PathBuf,
    state: PathBuf,
    images: PathBuf,
    node_id: String,
    node_token: String,
    bundle: PathBuf,
    digest: String,
    image_id: String,
}

impl Lab {
    async fn new(name: &str, database: &str) -> Lab {
        let pool = vps_pg::connect::connect(
            database,
            &vps_pg::connect::DbOptions {
                max_connections: 20,
            },
        )
        .await
        .unwrap_or_else(|e| panic!("connect to {database}: {e}"));
        vps_events::db::MIGRATOR.run(&pool).await.expect("migrate");
        let t = TestServer::start_on(pool, vps_tests::fast_sandboxes).await;
        let root = std::env::temp_dir().join(format!("vrh-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        let bundle = bundle().to_path_buf();
        let digest = sha256_file(&bundle);

        let pool = t
            .ok(
                OPERATOR,
                "pools.create",
                json!({ "name": "real", "class": "vps-host", "runtime": "qemu" }),
            )
            .await;
        let pool_id = pool["id"].as_str().unwrap().to_string();
        t.ok(
            OPERATOR,
            "pools.setIpPool",
            json!({ "poolId": pool_id, "cidr": CIDR }),
        )
        .await;
        let quota = json!({ "vcpu": 8, "memoryGiB": 8, "diskGiB": 100 });
        t.ok(
            OPERATOR,
            "pools.offer",
            json!({ "poolId": pool_id, "tenantId": "acme", "quota": quota }),
        )
        .await;
        t.ok(
            OPERATOR,
            "flavors.create",
            json!({ "poolId": pool_id, "name": "tiny", "vcpu": 1, "memoryGiB": 1, "diskGiB": 1 }),
        )
        .await;
        let image_id = "img_minimal".to_string();
        t.ok(
            OPERATOR,
            "images.register",
            json!({ "imageId": image_id, "url": format!("file://{}", bundle.display()),
                    "sha256": digest, "format": "bundle" }),
        )
        .await;
        let node = t
            .ok(
                OPERATOR,
                "nodes.register",
                json!({ "poolId": pool_id, "name": "real-0",
                "capacity": { "vcpu": 8, "memoryGiB": 8, "diskGiB": 50 }, "runtimes": ["qemu"],
                "cpuModel": "tcg:max" }),
            )
            .await;
        // The bridge with the pool's gateway, as the agent makes it when the spec names the
        // gateway; made here too so the tunnel reaches guests whatever the server sends.
        for args in [
            vec!["link", "add", "name", BRIDGE, "type", "bridge"],
            vec!["addr", "add", GATEWAY, "dev", BRIDGE],
            vec!["link", "set", "dev", BRIDGE, "up"],
        ] {
            let out = run("ip", &args).await;
            assert!(
                out.status.success(),
                "ip {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Lab {
            t,
            pool_id,
            state: root.join("s"),
            images: root.join("i"),
            root,
            node_id: node["node"]["id"].as_str().unwrap().to_string(),
            node_token: node["nodeToken"].as_str().unwrap().to_string(),
            bundle,
            digest,
            image_id,
        }
    }

    /// Starts the agent with the real qemu runtime under TCG, at a test's pace.
    async fn start_host(&self) -> HostHandle {
        let config = HostConfig {
            server_url: self.t.server.url(),
            node_id: self.node_id.clone(),
            node_token: self.node_token.clone(),
            state_dir: self.state.clone(),
            image_dir: self.images.clone(),
            bridge: None,
            tunnel_listen: "127.0.0.1:0".into(),
            runtime: RuntimeKind::Qemu,
            accel: Accel::Tcg,
            metrics_listen: None,
            dns_upstream: None,
            image_cache_max_bytes: None,
            restore_slots: None,
            timings: AgentTimings {
                report_interval: Duration::from_millis(300),
                poll_wait: Duration::from_secs(1),
                observe_interval: Duration::from_millis(300),
                retry_after: Duration::from_secs(2),
            },
        };
        let mut runtime =
            Qemu::new(&self.state, &self.images, Accel::Tcg).expect("the qemu runtime");
        // A clean power-off under TCG on a loaded two-core machine can take longer than the
        // default wait before QEMU is quit, and a quit guest may lose its last writes.
        runtime.stop_timeout = Duration::from_secs(60);
        vps_host::start(config, runtime)
            .await
            .expect("the agent starts")
    }

    async fn ok(&self, token: &str, method: &str, body: Value) -> Value {
        self.t.ok(token, method, body).await
    }

    async fn template_with(&self, settings: Value) -> String {
        let mut body = json!({ "tenantId": "acme", "name": "warm", "poolId": self.pool_id,
                               "flavor": "tiny", "imageId": self.image_id });
        for (key, value) in settings.as_object().unwrap() {
            body[key] = value.clone();
        }
        let template = self.ok(ALICE, "sandboxTemplates.create", body).await;
        template["id"].as_str().unwrap().to_string()
    }

    /// The template's warm instance, once the host reports it paused.
    async fn warm_paused(&self, template: &str) -> String {
        let deadline = Instant::now() + BOOT;
        loop {
            let found: Option<String> = sqlx::query_scalar(
                "SELECT id FROM instances WHERE warm_template_id = $1 AND state = 'paused'",
            )
            .bind(template)
            .fetch_optional(&self.t.server.state.pool)
            .await
            .unwrap();
            if let Some(id) = found {
                return id;
            }
            assert!(Instant::now() < deadline, "no paused warm instance in time");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    async fn template(&self, user_data: Option<&str>) -> String {
        let mut body = json!({ "tenantId": "acme", "name": "real", "poolId": self.pool_id,
                               "flavor": "tiny", "imageId": self.image_id });
        if let Some(user_data) = user_data {
            body["userData"] = user_data.into();
        }
        let template = self.ok(ALICE, "sandboxTemplates.create", body).await;
        template["id"].as_str().unwrap().to_string()
    }

    async fn sandbox(&self, template: &str, key: &str) -> Value {
        self.sandbox_with(template, key, json!({})).await
    }

    /// The sandbox `id` once it is `ready`.
    async fn ready(&self, id: &str) -> Value {
        let deadline = Instant::now() + BOOT;
        loop {
            let s = self
                .ok(
                    ALICE,
                    "sandboxes.get",
                    json!({ "tenantId": "acme", "sandboxId": id }),
                )
                .await;
            if s["state"] == "ready" {
                return s;
            }
            assert!(Instant::now() < deadline, "sandbox {id} not ready: {s}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }

    /// A sandbox created with `extra` fields in its create (`fromSnapshot`), once `ready`.
    async fn sandbox_with(&self, template: &str, key: &str, extra: Value) -> Value {
        let mut body = json!({ "tenantId": "acme", "templateId": template, "idempotencyKey": key,
                               "ttlSeconds": 3600, "wait": { "timeoutMs": 1000 } });
        if let (Some(body), Some(extra)) = (body.as_object_mut(), extra.as_object()) {
            body.extend(extra.clone());
        }
        let s = self.ok(ALICE, "sandboxes.create", body).await;
        self.ready(s["id"].as_str().unwrap()).await
    }

    /// A memory restore, once its host reported it under an SSH identity of its own (it is
    /// `ready` from its resume; exec while its source lives waits for that).
    async fn rebound(&self, sandbox: &Value) {
        let instance = sandbox["instanceId"].as_str().unwrap();
        let view = self
            .wait_instance(instance, CHANGE, |i| i["identityRebound"] == true)
            .await;
        assert_eq!(view["identityRebound"], true, "{view}");
    }

    async fn instance_create(&self, image: &str, user_data: Option<&str>) -> String {
        let mut body = json!({ "tenantId": "acme", "poolId": self.pool_id, "flavor": "tiny",
                               "imageId": image, "idempotencyKey": image });
        if let Some(user_data) = user_data {
            body["userData"] = user_data.into();
        }
        let i = self.ok(ALICE, "instances.create", body).await;
        i["id"].as_str().unwrap().to_string()
    }

    async fn instance(&self, id: &str) -> Value {
        self.ok(
            ALICE,
            "instances.get",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await
    }

    async fn wait_instance(
        &self,
        id: &str,
        within: Duration,
        done: impl Fn(&Value) -> bool,
    ) -> Value {
        self.t.until(ALICE, "acme", id, within, done).await
    }

    /// The instance's entry of the node's spec, as the agent reads it.
    async fn spec_entry(&self, id: &str) -> Value {
        let spec = self
            .t
            .call(
                &self.node_token,
                "nodes.spec",
                json!({ "nodeId": self.node_id }),
            )
            .await
            .unwrap_or_else(|a| panic!("nodes.spec: {a:?}"));
        spec["instances"]
            .as_array()
            .unwrap()
            .iter()
            .find(|i| i["id"] == id)
            .cloned()
            .unwrap_or_else(|| panic!("{id} is not in the spec: {spec}"))
    }

    /// Whether the node reports again after `since`.
    async fn reports_after(&self, since: chrono::DateTime<chrono::Utc>) -> bool {
        let deadline = Instant::now() + CHANGE;
        while Instant::now() < deadline {
            let last: Option<chrono::DateTime<chrono::Utc>> =
                sqlx::query_scalar("SELECT last_report_at FROM node_heartbeats WHERE node_id = $1")
                    .bind(&self.node_id)
                    .fetch_one(&self.t.server.state.pool)
                    .await
                    .ok()
                    .flatten();
            if last.is_some_and(|at| at > since) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }

    /// `instances.start` of a stopped instance: it runs again, and its console after
    /// `first_console` shows a boot on the same disk (no new file system, no second run of
    /// its user data).
    async fn starts_again_on_its_disk(&self, id: &str, console: &Path, first_console: &str) {
        self.ok(
            ALICE,
            "instances.start",
            json!({ "tenantId": "acme", "instanceId": id }),
        )
        .await;
        let again = self
            .wait_instance(id, BOOT, |i| i["state"] == "running")
            .await;
        assert_eq!(again["state"], "running", "{again}");
        let read_console = || std::fs::read_to_string(console).unwrap_or_default();
        // The console log of this boot: what follows the first boot's, or a new file.
        let second_boot = || {
            let all = read_console();
            match all.strip_prefix(first_console) {
                Some(rest) => rest.to_owned(),
                None => all,
            }
        };
        let up = wait_for(BOOT, || ends_with_ready(&second_boot())).await;
        assert!(
            up,
            "the second boot's init did not finish: {}",
            read_console()
        );
        let second = second_boot();
        assert!(second.contains("root disk mounted"), "{second}");
        assert!(
            !second.contains("first boot"),
            "the disk was made again: {second}"
        );
        assert!(
            !second.contains("user-data script"),
            "user data ran twice: {second}"
        );
    }

    /// Waits until the agent has reported twice more: it has made a whole pass since now, so
    /// what it has not done by then (boot a guest again) it is not about to do.
    async fn passes(&self) -> bool {
        for _ in 0..2 {
            if !self.reports_after(vps_clock::Clock::system().now()).await {
                return false;
            }
        }
        true
    }

    /// Whether the agent's report counts `count` guests in `state` (`vps_host_guests`, which
    /// the agent sets from each report it sends) within [`CHANGE`].
    async fn reports_guests(&self, state: &str, count: u32) -> bool {
        let line = format!("vps_host_guests{{state=\"{state}\"}} {count}");
        let deadline = Instant::now() + CHANGE;
        while Instant::now() < deadline {
            if self.t.metrics().await.lines().any(|l| l.trim() == line) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        false
    }

    async fn exec_grant(&self, sandbox: &Value, keys: &Keys, ttl: Option<u64>) -> Value {
        let mut body =
            json!({ "tenantId": "acme", "sandboxId": sandbox["id"], "publicKey": keys.public() });
        if let Some(ttl) = ttl {
            body["ttlSeconds"] = ttl.into();
        }
        self.ok(ALICE, "sandboxes.exec", body).await
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

/// An ed25519 key pair made by `ssh-keygen`.
struct Keys {
    dir: PathBuf,
}

impl Keys {
    async fn new(root: &Path) -> Keys {
        let dir = root.join("keys");
        std::fs::create_dir_all(&dir).unwrap();
        let out = run(
            "ssh-keygen",
            &[
                "-q",
                "-t",
                "ed25519",
                "-N",
                "",
                "-C",
                "real-host",
                "-f",
                dir.join("key").to_str().unwrap(),
            ],
        )
        .await;
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Keys { dir }
    }

    fn public(&self) -> String {
        std::fs::read_to_string(self.dir.join("key.pub")).unwrap()
    }
}

#[derive(Debug)]
struct Ssh {
    ok: bool,
    stdout: String,
    stderr: String,
}

/// `vps` (the CLI) as alice of acme against the lab's server.
async fn vps_cli(lab: &Lab, args: &[&str]) -> std::process::Output {
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_vps-cli"))
        .args(args)
        .env("VPS_URL", lab.t.server.url())
        .env("VPS_TOKEN", ALICE)
        .env("VPS_TENANT", "acme")
        .env("RUST_LOG", "off")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .expect("the CLI ends")
        .expect("the CLI runs")
}

/// The system's `ssh` through `vps tunnel` with the grant's ticket and certificate.
async fn ssh(keys: &Keys, grant: &Value, command: &str) -> Ssh {
    ssh_with(keys, grant, command, &[]).await
}

/// [`ssh`] with more of ssh's options (`-tt`).
async fn ssh_with(keys: &Keys, grant: &Value, command: &str, options: &[&str]) -> Ssh {
    let cert = keys.dir.join("key-cert.pub");
    std::fs::write(
        &cert,
        format!("{}\n", grant["certificate"].as_str().unwrap()),
    )
    .unwrap();
    let proxy = format!(
        "{} tunnel --url {} --ticket {}",
        env!("CARGO_BIN_EXE_vps-cli"),
        grant["tunnel"]["url"].as_str().unwrap(),
        grant["tunnel"]["ticket"].as_str().unwrap()
    );
    let out = tokio::process::Command::new("ssh")
        .args(["-F", "/dev/null", "-i"])
        .arg(keys.dir.join("key"))
        .arg("-o")
        .arg(format!("CertificateFile={}", cert.display()))
        .args(["-o", "IdentitiesOnly=yes", "-o", "StrictHostKeyChecking=no"])
        .args(["-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes"])
        .args(["-o", "LogLevel=ERROR", "-o", "ConnectTimeout=30"])
        .args(["-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"])
        .arg("-o")
        .arg(format!("ProxyCommand={proxy}"))
        .args(options)
        .arg(format!("sandbox@{}", grant["instanceId"].as_str().unwrap()))
        .arg(command)
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), out)
        .await
        .expect("ssh ends")
        .expect("ssh runs");
    Ssh {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Runs `command` with fresh grants until the guest's `sshd` answers (a sandbox is `ready`
/// once QEMU runs, a little before its `sshd` does).
async fn ssh_until_up(keys: &Keys, first: &Value, command: &str, lab: &Lab) -> String {
    let deadline = Instant::now() + BOOT;
    let mut grant = first.clone();
    loop {
        let out = ssh(keys, &grant, command).await;
        if out.ok {
            return out.stdout;
        }
        assert!(Instant::now() < deadline, "no exec in time: {}", out.stderr);
        tokio::time::sleep(Duration::from_secs(1)).await;
        let sandbox = json!({ "id": grant["sandboxId"] });
        grant = lab.exec_grant(&sandbox, keys, None).await;
    }
}

/// The connections a guest's `sshd` accepted, as its console logs them.
fn sshd_connections(console: &Path) -> usize {
    std::fs::read_to_string(console)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("Connection from"))
        .count()
}

/// The last lines of a console, for a failure's message.
fn tail(console: &Path) -> String {
    let text = std::fs::read_to_string(console).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(30)..].join("\n")
}

/// Whether the last `vps-init` line of a console says `ready`.
fn ends_with_ready(console: &str) -> bool {
    console
        .lines()
        .rfind(|l| l.contains("vps-init"))
        .is_some_and(|l| l.trim_end().ends_with("ready"))
}

/// One QMP command on a guest's socket, after the greeting and `qmp_capabilities`.
async fn qmp(socket: &Path, command: &str) -> Value {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
    type Lines = tokio::io::Lines<BufReader<tokio::net::unix::OwnedReadHalf>>;
    // Events may come between: only the greeting and answers count.
    async fn answer(lines: &mut Lines) -> Value {
        loop {
            let line = lines.next_line().await.unwrap().expect("QMP answers");
            let value: Value = serde_json::from_str(&line).unwrap();
            if value.get("event").is_none() {
                return value;
            }
        }
    }
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", socket.display()));
    let talk = async move {
        let (read, mut write) = stream.into_split();
        let mut lines = BufReader::new(read).lines();
        answer(&mut lines).await;
        let capabilities = b"{\"execute\":\"qmp_capabilities\"}\n";
        write.write_all(capabilities).await.unwrap();
        answer(&mut lines).await;
        let line = format!("{{\"execute\":\"{command}\"}}\n");
        write.write_all(line.as_bytes()).await.unwrap();
        answer(&mut lines).await
    };
    tokio::time::timeout(Duration::from_secs(10), talk)
        .await
        .expect("QMP answers within 10 s (is another client connected?)")
}

/// Waits until `condition` holds; whether it did within `within`.
async fn wait_for(within: Duration, condition: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while !condition() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    true
}

async fn run(program: &str, args: &[&str]) -> std::process::Output {
    tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
        .unwrap_or_else(|e| panic!("{program}: {e}"))
}

/// The QEMU processes whose command line names `state` (the guests of one agent).
fn qemu_pids(state: &Path) -> Vec<i32> {
    let needle = state.display().to_string();
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            text.starts_with("qemu-system") || text.contains("/qemu-system")
        })
        .filter(|pid| {
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            String::from_utf8_lossy(&cmdline).contains(&needle)
        })
        .collect();
    pids.sort_unstable();
    pids
}

/// Ends the QEMUs of this process's tests, whatever the test left (a failed assertion).
fn kill_leftover_qemus() {
    let prefix = std::env::temp_dir()
        .join(format!("vrh-{}-", std::process::id()))
        .display()
        .to_string();
    for pid in qemu_pids(Path::new(&prefix)) {
        // SAFETY: kill(2) on a QEMU whose command line names this process's test directory.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
}

/// The guest bundle under test: `VPS_GUEST_IMAGE`, or the minimal one built once per version
/// of the guest crate's sources (the same cache the guest crate's tests use).
fn bundle() -> &'static Path {
    static BUNDLE: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUNDLE.get_or_init(|| {
        if let Some(path) = std::env::var_os("VPS_GUEST_IMAGE") {
            return PathBuf::from(path);
        }
        let guest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../guest");
        let cache = Path::new(env!("CARGO_TARGET_TMPDIR")).join("vps-guest-image");
        let out = cache.join(format!("minimal-{:016x}.tar", sources_fingerprint(&guest)));
        if !out.exists() {
            std::fs::create_dir_all(&cache).unwrap();
            let partial = cache.join(format!("building-{}.tar", std::process::id()));
            let work = cache.join(format!("work-{}", std::process::id()));
            vps_guest_image::build_minimal(&partial, &work, |step| {
                eprintln!("build_minimal: {step}")
            })
            .unwrap_or_else(|e| panic!("building the minimal guest: {e}"));
            std::fs::rename(&partial, &out).unwrap();
            let _ = std::fs::remove_dir_all(&work);
        }
        out
    })
}

/// FNV-1a over the guest crate's `src/` and `assets/`, as its own tests compute it.
fn sources_fingerprint(root: &Path) -> u64 {
    fn walk(dir: &Path, files: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, files);
            } else {
                files.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root.join("src"), &mut files);
    walk(&root.join("assets"), &mut files);
    files.sort();
    let mut hash = 0xcbf2_9ce4_8422_2325u64;
    for file in files {
        let name = file.strip_prefix(root).unwrap().display().to_string();
        for byte in name.bytes().chain(std::fs::read(&file).unwrap()) {
            hash = (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The tap of a guest's first NIC, as the qemu runtime names it (`vps0` and 11 hex digits of
/// the SHA-256 of the instance id).
fn tap_of(instance: &str) -> String {
    use sha2::{Digest, Sha256};
    format!(
        "vps0{}",
        &data_encoding::HEXLOWER.encode(&Sha256::digest(instance.as_bytes()))[..11]
    )
}

fn sha256_file(path: &Path) -> String {
    use sha2::{Digest, Sha256};
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    data_encoding::HEXLOWER.encode(&Sha256::digest(&bytes))
}
