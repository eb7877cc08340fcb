//! What a QEMU is started with, shared by a boot's command line and a warm restore slot's:
//! the machine and its console, QMP socket and pid file, and the NICs.

use std::path::PathBuf;

use super::accel::Chosen;
use super::config_drive;
use super::images::Cached;
use super::process::GuestDir;

/// The machine, the QEMU device models of its disks and of its NICs: bundles boot directly on
/// microvm (virtio-mmio); a disk image needs firmware and PCI.
pub fn devices(image: &Cached) -> (&'static str, &'static str, &'static str) {
    match image {
        Cached::Bundle { .. } => ("microvm", "virtio-blk-device", "virtio-net-device"),
        Cached::Qcow2 { .. } => ("q35", "virtio-blk-pci", "virtio-net-pci"),
    }
}

/// Everything of a QEMU command line but its disks and NICs: the machine, its console, QMP
/// socket and pid file under `dir`, and a bundle's kernel.
pub fn machine_args(
    name: &str,
    vcpus: u32,
    memory_mib: u64,
    image: &Cached,
    accel: Chosen,
    dir: &GuestDir,
) -> Vec<String> {
    let path = |p: PathBuf| p.to_string_lossy().into_owned();
    let mut args: Vec<String> = vec![
        "-name".into(),
        format!("guest={name}"),
        "-M".into(),
        devices(image).0.into(),
    ];
    args.extend(accel.args().map(String::from));
    args.extend([
        "-smp".into(),
        vcpus.max(1).to_string(),
        "-m".into(),
        format!("{memory_mib}M"),
        "-nodefaults".into(),
        "-no-user-config".into(),
        "-nographic".into(),
        "-no-reboot".into(),
        "-chardev".into(),
        format!("file,id=console,path={}", path(dir.console())),
        "-serial".into(),
        "chardev:console".into(),
        "-qmp".into(),
        format!("unix:{},server=on,wait=off", path(dir.qmp())),
        "-pidfile".into(),
        path(dir.pid()),
    ]);
    if let Cached::Bundle { kernel, initrd, .. } = image {
        args.extend([
            "-kernel".into(),
            path(kernel.clone()),
            "-initrd".into(),
            path(initrd.clone()),
            "-append".into(),
            config_drive::KERNEL_CMDLINE.into(),
        ]);
    }
    args
}

/// One tap netdev `net{i}` and its NIC per `(tap, mac)`.
pub fn nic_args<'a>(image: &Cached, nics: impl Iterator<Item = (&'a str, &'a str)>) -> Vec<String> {
    let nic = devices(image).2;
    let mut args = Vec::new();
    for (i, (tap, mac)) in nics.enumerate() {
        args.extend([
            "-netdev".into(),
            format!("tap,id=net{i},ifname={tap},script=no,downscript=no"),
            "-device".into(),
            format!("{nic},netdev=net{i},mac={mac}"),
        ]);
    }
    args
}
