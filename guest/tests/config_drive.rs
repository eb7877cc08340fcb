//! The config drive as a guest sees it: a FAT volume labelled `cidata` holding the NoCloud
//! files and the minimal guest's `vps/` files, readable back.

use std::io::Read;
use std::path::Path;
use std::process::Command;

use vps_guest_image::config_drive::{self, ConfigDrive};
use vps_guest_image::Error;

fn drive() -> ConfigDrive {
    ConfigDrive {
        instance_id: "inst_01JTEST".into(),
        hostname: "web-1".into(),
        user_data: Some(b"#!/bin/sh\necho hi > /data/marker\n".to_vec()),
        address: Some("10.77.0.2/24".into()),
        gateway: Some("10.77.0.1".into()),
        mac: Some("52:54:00:AB:cd:01".into()),
        nameserver: None,
        principal: Some("inst_01JTEST".into()),
        ssh_ca_public_key: Some("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample ca@vps\n".into()),
        host_ssh_public_key: None,
        identity_generation: 3,
        fresh_identity: None,
        volumes: Vec::new(),
    }
}

fn read(image: &Path, name: &str) -> Option<String> {
    let file = std::fs::File::open(image).ok()?;
    let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).ok()?;
    let mut text = String::new();
    fs.root_dir()
        .open_file(name)
        .ok()?
        .read_to_string(&mut text)
        .ok()?;
    Some(text)
}

#[test]
fn a_config_drive_holds_the_nocloud_files_and_the_guests_own() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    config_drive::write(&image, &drive()).unwrap();

    let file = std::fs::File::open(&image).unwrap();
    let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).unwrap();
    assert_eq!(fs.volume_label(), "cidata");
    drop(fs);

    assert_eq!(
        read(&image, "meta-data").unwrap(),
        "instance-id: inst_01JTEST\nlocal-hostname: web-1\n"
    );
    assert_eq!(
        read(&image, "user-data").unwrap(),
        "#!/bin/sh\necho hi > /data/marker\n"
    );
    let network = read(&image, "network-config").unwrap();
    assert!(network.starts_with("version: 2\n"), "{network}");
    assert!(
        network.contains("macaddress: \"52:54:00:ab:cd:01\""),
        "{network}"
    );
    assert!(
        network.contains("addresses: [\"10.77.0.2/24\"]"),
        "{network}"
    );
    assert!(network.contains("via: \"10.77.0.1\""), "{network}");
    assert_eq!(
        read(&image, "vps/net").unwrap(),
        "ADDRESS=10.77.0.2/24\nGATEWAY=10.77.0.1\nMAC=52:54:00:ab:cd:01\n"
    );
    assert_eq!(read(&image, "vps/principal").unwrap(), "inst_01JTEST\n");
    assert_eq!(
        read(&image, "vps/ssh-ca.pub").unwrap(),
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIExample ca@vps\n"
    );
    assert_eq!(read(&image, "vps/identity").unwrap(), "3\n");
}

#[test]
fn a_nameserver_reaches_vps_net_and_network_config() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let with = ConfigDrive {
        nameserver: Some("10.77.0.1".into()),
        ..drive()
    };
    config_drive::write(&image, &with).unwrap();
    assert_eq!(
        read(&image, "vps/net").unwrap(),
        "ADDRESS=10.77.0.2/24\nGATEWAY=10.77.0.1\nMAC=52:54:00:ab:cd:01\nNAMESERVER=10.77.0.1\n"
    );
    let network = read(&image, "network-config").unwrap();
    assert!(
        network.contains("    nameservers:\n      addresses: [\"10.77.0.1\"]\n"),
        "{network}"
    );
}

#[test]
fn blkid_finds_the_cidata_label_cloud_init_looks_for() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    config_drive::write(&image, &drive()).unwrap();
    let out = Command::new("blkid")
        .args(["-p", "-o", "export"])
        .arg(&image)
        .output()
        .expect("blkid (util-linux) runs");
    let out = String::from_utf8_lossy(&out.stdout);
    assert!(out.contains("TYPE=vfat"), "{out}");
    assert!(out.contains("LABEL=cidata"), "{out}");
}

#[test]
fn a_drive_without_user_data_or_address_has_no_user_data_file_and_asks_for_dhcp() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let bare = ConfigDrive {
        instance_id: "inst_2".into(),
        hostname: "h".into(),
        ..ConfigDrive::default()
    };
    config_drive::write(&image, &bare).unwrap();
    assert_eq!(read(&image, "user-data"), None);
    assert_eq!(read(&image, "vps/principal"), None);
    assert_eq!(read(&image, "vps/net").unwrap(), "");
    assert_eq!(read(&image, "vps/identity").unwrap(), "0\n");
    assert!(read(&image, "network-config")
        .unwrap()
        .contains("dhcp4: true"));
}

#[test]
fn the_hosts_own_key_is_a_file_of_its_own_and_checked_like_the_ca() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIHost vps-host";
    let with_key = ConfigDrive {
        host_ssh_public_key: Some(format!("{key}\n")),
        ..drive()
    };
    config_drive::write(&image, &with_key).unwrap();
    assert_eq!(
        read(&image, "vps/host-ssh.pub").unwrap(),
        format!("{key}\n")
    );
    config_drive::write(&image, &drive()).unwrap();
    assert_eq!(read(&image, "vps/host-ssh.pub"), None);
    let bad = ConfigDrive {
        host_ssh_public_key: Some(format!("{key}\nssh-rsa BBBB")),
        ..drive()
    };
    match config_drive::write(&image, &bad) {
        Err(Error::InvalidConfig { field, .. }) => assert_eq!(field, "host_ssh_public_key"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn large_user_data_fits() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let data: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
    let big = ConfigDrive {
        user_data: Some(data.clone()),
        ..drive()
    };
    config_drive::write(&image, &big).unwrap();
    let file = std::fs::File::open(&image).unwrap();
    let fs = fatfs::FileSystem::new(file, fatfs::FsOptions::new()).unwrap();
    let mut back = Vec::new();
    fs.root_dir()
        .open_file("user-data")
        .unwrap()
        .read_to_end(&mut back)
        .unwrap();
    assert_eq!(back, data);
}

#[test]
fn values_that_would_break_the_guests_shell_or_yaml_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let cases: Vec<(&str, ConfigDrive)> = vec![
        (
            "instance_id",
            ConfigDrive {
                instance_id: "inst_1\nx: y".into(),
                ..drive()
            },
        ),
        (
            "hostname",
            ConfigDrive {
                hostname: "a b".into(),
                ..drive()
            },
        ),
        (
            "address",
            ConfigDrive {
                address: Some("10.0.0.2".into()),
                ..drive()
            },
        ),
        (
            "address",
            ConfigDrive {
                address: Some("10.0.0.2/33".into()),
                ..drive()
            },
        ),
        (
            "address",
            ConfigDrive {
                address: Some("$(reboot)/24".into()),
                ..drive()
            },
        ),
        (
            "gateway",
            ConfigDrive {
                gateway: Some("10.0.0.1; reboot".into()),
                ..drive()
            },
        ),
        (
            "nameserver",
            ConfigDrive {
                nameserver: Some("10.0.0.1\nreboot".into()),
                ..drive()
            },
        ),
        (
            "mac",
            ConfigDrive {
                mac: Some("52:54:00:12:34".into()),
                ..drive()
            },
        ),
        (
            "principal",
            ConfigDrive {
                principal: Some("a,b".into()),
                ..drive()
            },
        ),
        (
            "ssh_ca_public_key",
            ConfigDrive {
                ssh_ca_public_key: Some("not a key".into()),
                ..drive()
            },
        ),
        (
            "ssh_ca_public_key",
            ConfigDrive {
                ssh_ca_public_key: Some("ssh-ed25519 AAAA\nssh-rsa BBBB".into()),
                ..drive()
            },
        ),
    ];
    for (field, bad) in cases {
        match config_drive::write(&image, &bad) {
            Err(Error::InvalidConfig { field: got, .. }) => assert_eq!(got, field, "{bad:?}"),
            other => panic!("{bad:?} gave {other:?}"),
        }
    }
}

#[test]
fn volumes_are_listed_one_line_each_and_bad_ones_refused() {
    use vps_guest_image::config_drive::DriveVolume;
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("config.img");
    let volume = |serial: &str, path: &str, read_only| DriveVolume {
        serial: serial.into(),
        mount_path: path.into(),
        read_only,
    };
    let with = ConfigDrive {
        volumes: vec![
            volume("vol-0123456789abcdef", "/data/work", false),
            volume("vol-2", "/srv/ref", true),
        ],
        ..drive()
    };
    config_drive::write(&image, &with).unwrap();
    assert_eq!(
        read(&image, "vps/volumes").unwrap(),
        "vol-0123456789abcdef /data/work rw\nvol-2 /srv/ref ro\n"
    );
    config_drive::write(&image, &drive()).unwrap();
    assert_eq!(read(&image, "vps/volumes"), None);
    for (serial, path) in [
        ("vol-1", "relative"),
        ("vol-1", "/srv/a b"),
        ("vol-1", "/srv/$(id)"),
        ("vol-1", "/srv/../etc"),
        ("vol-1", "/proc/x"),
        ("vol-1", "/data"),
        ("vol-1", "/"),
        ("vol 1", "/srv/a"),
        ("vol-0123456789abcdef0", "/srv/a"),
    ] {
        let bad = ConfigDrive {
            volumes: vec![volume(serial, path, false)],
            ..drive()
        };
        assert!(
            config_drive::write(&image, &bad).is_err(),
            "{serial:?} {path:?} must be refused"
        );
    }
}
