//! Volumes of the `qemu` runtime against real QEMU under TCG with the minimal guest: a volume
//! is made blank, formatted by the first guest that mounts it, grown while a guest runs with
//! it, refused to a second writer, and read by the next guest after the first is deleted.
//! Each test runs in a network namespace of its own (`common::in_netns`).
//!
//! Needs what `qemu_snapshots.rs` needs (QEMU, `qemu-img`, `ip`, `ssh`, `ssh-keygen`, the
//! minimal guest: `VPS_GUEST_IMAGE` or built once with `apt-get download`).

mod common;

use common::{in_netns, state_of, Env};
use vps_host::runtime::{GuestState, Runtime, VolumeAttachment, VolumeSpec};

const WRITER: &str = "inst_volwriter00000000000000";
const SECOND: &str = "inst_volsecond00000000000000";
const READER: &str = "inst_volreader00000000000000";
const VOLUME: &str = "vol_01JVOLTEST0000000000000000";
const SERIAL: &str = "vol-test000000000001";

fn attach(path: &str, read_only: bool) -> Vec<VolumeAttachment> {
    vec![VolumeAttachment {
        volume_id: VOLUME.into(),
        serial: SERIAL.into(),
        mount_path: path.into(),
        read_only,
    }]
}

#[test]
fn a_volume_written_by_one_guest_is_read_by_the_next_after_the_first_is_deleted() {
    // Built (with `apt-get download`) before the test leaves the machine's network.
    common::minimal_bundle();
    in_netns(|| async {
        let env = Env::new("vol", 81);
        let runtime = env.runtime();
        let volume = VolumeSpec {
            id: VOLUME.into(),
            size_gib: 1,
            serial: SERIAL.into(),
        };
        let made = runtime.ensure_volume(&volume).await.expect("ensure_volume");
        assert_eq!(made.size_gib, 1);
        assert!(
            made.allocated_bytes < 16 << 20,
            "a new volume is sparse: {made:?}"
        );
        let again = runtime.ensure_volume(&volume).await.expect("idempotent");
        assert_eq!(again.size_gib, 1);

        // A guest attaching a volume the store does not hold is refused before it boots.
        let mut stray = env.spec(SECOND, 4);
        stray.volumes = vec![VolumeAttachment {
            volume_id: "vol_missing".into(),
            serial: "vol-missing".into(),
            mount_path: "/srv/x".into(),
            read_only: false,
        }];
        let error = runtime.run(&stray).await.expect_err("no such volume");
        assert!(error.0.contains("vol_missing"), "{error}");
        runtime.delete(SECOND).await.expect("delete");

        // The first guest formats the blank volume and writes a file on it.
        let mut writer = env.spec(WRITER, 2);
        writer.volumes = attach("/srv/work", false);
        runtime.run(&writer).await.expect("run the writer");
        let seen = env.ssh_until_up(
            WRITER,
            "grep ' /srv/work ' /proc/mounts; readlink /dev/disk/by-id/virtio-vol-test000000000001; \
             echo 'written by the writer' > /srv/work/note && sync && cat /srv/work/note",
        );
        assert!(seen.contains("/srv/work ext4 rw"), "{seen}");
        assert!(seen.contains("../../vd"), "by-id link: {seen}");
        assert!(seen.contains("written by the writer"), "{seen}");

        // Grown while the writer runs: QEMU resizes the file and the guest sees the new size.
        let grown = runtime
            .ensure_volume(&VolumeSpec {
                size_gib: 2,
                ..volume.clone()
            })
            .await
            .expect("grow");
        assert_eq!(grown.size_gib, 2);
        assert_eq!(grown.attached_to, vec![WRITER.to_owned()]);
        let sectors = env
            .ssh(
                WRITER,
                "cat /sys/block/$(basename $(readlink /dev/disk/by-id/virtio-vol-test000000000001))/size",
            )
            .expect("size");
        assert_eq!(
            sectors.trim(),
            (2u64 << 30 >> 9).to_string(),
            "the guest sees 2 GiB"
        );

        // One writer: a second guest may not attach it, read-write or read-only, while the
        // writer runs; nor may the volume be deleted.
        for read_only in [false, true] {
            let mut second = env.spec(SECOND, 3);
            second.volumes = attach("/srv/other", read_only);
            let error = runtime.run(&second).await.expect_err("a second writer");
            assert!(error.0.contains("one writer"), "{error}");
            runtime.delete(SECOND).await.expect("delete");
        }
        let error = runtime.delete_volume(VOLUME).await.expect_err("attached");
        assert!(error.0.contains(WRITER), "{error}");

        // The writer goes; its volume stays, and the next guest reads what it wrote.
        runtime.delete(WRITER).await.expect("delete the writer");
        let listed = runtime.volumes().await;
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert!(listed[0].attached_to.is_empty(), "{listed:?}");
        assert!(listed[0].allocated_bytes > 0);

        let mut reader = env.spec(READER, 5);
        reader.volumes = attach("/srv/ro", true);
        runtime.run(&reader).await.expect("run the reader");
        let read = env.ssh_until_up(READER, "cat /srv/ro/note; grep ' /srv/ro ' /proc/mounts");
        assert!(read.contains("written by the writer"), "{read}");
        assert!(read.contains("/srv/ro ext4 ro"), "{read}");
        let refused = env
            .ssh(READER, "echo x > /srv/ro/other")
            .expect_err("a read-only volume refuses writes");
        assert!(refused.contains("Read-only file system"), "{refused}");
        assert_eq!(state_of(&runtime, READER).await, GuestState::Running);

        runtime.delete(READER).await.expect("delete the reader");
        runtime
            .delete_volume(VOLUME)
            .await
            .expect("delete the volume");
        assert!(runtime.volumes().await.is_empty());
        runtime
            .delete_volume(VOLUME)
            .await
            .expect("deleting a missing volume is not an error");
        env.assert_no_qemu();
    });
}
