//! `build_minimal`: the minimal guest bundle from Debian's packages. The kernel is Debian's
//! cloud kernel; the initramfs holds busybox, the kernel modules the guest needs, OpenSSH's
//! `sshd` and `ssh-keygen`, `mke2fs`, every library they link, and the guest's `/init`.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use crate::initrd::Tree;
use crate::{debian, elf, modules, Error};

/// The packages besides the kernel. `libwrap0` (and its `libnsl2`, `libtirpc3`) is what `sshd`
/// links that a machine without `openssh-server` usually lacks; every other library `sshd`,
/// `ssh-keygen` and `mke2fs` need comes from these packages first and the machine second.
const PACKAGES: &[&str] = &[
    "busybox-static",
    "openssh-server",
    "openssh-client",
    "e2fsprogs",
    "iproute2",
    "dash",
    "libwrap0",
    "libnsl2",
    "libtirpc3",
];

/// The dynamically linked programs the guest runs: (path in the packages, path in the guest).
/// Each is where busybox would link its applet of the same name, so that busybox leaves it be.
const PROGRAMS: &[(&str, &str)] = &[
    ("usr/sbin/sshd", "/usr/sbin/sshd"),
    ("usr/bin/ssh-keygen", "/usr/bin/ssh-keygen"),
    ("sbin/mke2fs", "/sbin/mke2fs"),
    // iproute2's, not busybox's: `ip -br addr` and the rest of what people type.
    ("bin/ip", "/sbin/ip"),
    // busybox-static's own shell runs its applets before anything on PATH (so `ip` would be
    // busybox's); dash looks commands up on PATH like any shell.
    ("bin/dash", "/bin/dash"),
];

/// Where libraries are looked up, under the unpacked packages and then on this machine.
const LIBRARY_DIRS: &[&str] = &["lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu"];

/// Where the guest keeps its libraries.
const GUEST_LIBRARY_DIR: &str = "/lib/x86_64-linux-gnu";

/// The guest's own files: (path in the guest, mode, contents).
const ASSETS: &[(&str, u32, &str)] = &[
    ("/init", 0o755, include_str!("../assets/init")),
    ("/etc/inittab", 0o644, include_str!("../assets/inittab")),
    (
        "/etc/ssh/sshd_config",
        0o644,
        include_str!("../assets/sshd_config"),
    ),
    ("/etc/passwd", 0o644, include_str!("../assets/passwd")),
    ("/etc/group", 0o644, include_str!("../assets/group")),
    ("/etc/shadow", 0o600, include_str!("../assets/shadow")),
    (
        "/etc/nsswitch.conf",
        0o644,
        include_str!("../assets/nsswitch.conf"),
    ),
    (
        "/etc/acpi/PWRF/00000080",
        0o755,
        include_str!("../assets/power-button"),
    ),
    (
        "/etc/vps-shutdown",
        0o755,
        include_str!("../assets/shutdown"),
    ),
    (
        "/etc/vps-restore-watch",
        0o755,
        include_str!("../assets/restore-watch"),
    ),
    (
        "/etc/vps-reidentify",
        0o755,
        include_str!("../assets/reidentify"),
    ),
];

/// Builds the minimal guest bundle at `out`: an uncompressed tar holding `vmlinuz` and
/// `initrd`. `work_dir` holds the downloaded and unpacked packages (its `debs/` and `root/`
/// are replaced); `progress` hears one line per step.
///
/// Needs `apt-get` with current package lists (`apt-get update`) and `dpkg-deb`; it installs
/// nothing on this machine.
pub fn build_minimal(out: &Path, work_dir: &Path, progress: impl Fn(&str)) -> Result<(), Error> {
    let debs = work_dir.join("debs");
    let root = work_dir.join("root");
    for dir in [&debs, &root] {
        if dir.exists() {
            fs::remove_dir_all(dir).map_err(Error::io(format!("emptying {}", dir.display())))?;
        }
        fs::create_dir_all(dir).map_err(Error::io(format!("creating {}", dir.display())))?;
    }

    progress(&format!("downloading {}", debian::KERNEL_META));
    let meta = debian::download(&debs, debian::KERNEL_META)?;
    let kernel = debian::kernel_package(&meta)?;
    let mut packages = vec![kernel.clone()];
    packages.extend(PACKAGES.iter().map(|p| p.to_string()));
    for package in &packages {
        progress(&format!("downloading and unpacking {package}"));
        let deb = debian::download(&debs, package)?;
        debian::extract(&deb, &root)?;
    }

    let release = kernel.trim_start_matches("linux-image-");
    let vmlinuz = read(&root.join(format!("boot/vmlinuz-{release}")))?;

    progress("assembling the initramfs");
    let mut tree = Tree::default();
    for (path, mode, text) in ASSETS {
        tree.file(path, *mode, text.as_bytes().to_vec());
    }
    for (path, mode) in [
        ("/dev", 0o755),
        ("/proc", 0o555),
        ("/sys", 0o555),
        ("/run", 0o755),
        ("/tmp", 0o1777),
        ("/root", 0o700),
        ("/data", 0o755),
        ("/mnt/config", 0o755),
        ("/var/empty", 0o755),
        ("/etc/ssh", 0o755),
        ("/var/log", 0o755),
    ] {
        tree.dir(path, mode);
    }
    tree.file("/bin/busybox", 0o755, read(&root.join("bin/busybox"))?);
    // `/bin/sh` (dash) is every script's interpreter and the accounts' shell; `/init` links
    // busybox's applets at boot (`busybox --install -s`), where no real program is.
    tree.symlink("/bin/sh", "dash");
    tree.file(
        "/etc/mke2fs.conf",
        0o644,
        read(&root.join("etc/mke2fs.conf"))?,
    );
    tree.file("/etc/hostname", 0o644, b"localhost\n".to_vec());

    let mut libraries = BTreeSet::new();
    for (source, target) in PROGRAMS {
        let data = read(&root.join(source))?;
        add_needs(&mut tree, &root, target, &data, &mut libraries)?;
        tree.file(target, 0o755, data);
    }
    tree.symlink("/sbin/mkfs.ext4", "mke2fs");
    tree.symlink("/bin/ip", "/sbin/ip");

    let module_dir = root.join("lib/modules").join(release);
    let wanted = modules::resolve(&module_dir)?;
    let mut list = String::new();
    for module in &wanted {
        let guest_path = format!("/lib/modules/{release}/{}", module.path);
        tree.file(&guest_path, 0o644, read(&module_dir.join(&module.path))?);
        list.push_str(&format!("{} {guest_path}\n", module.name));
    }
    tree.file("/etc/vps-modules", 0o644, list.into_bytes());

    progress("writing the bundle");
    let initrd = tree
        .write_gz(Vec::new())
        .map_err(Error::io("compressing the initramfs"))?;
    write_bundle(out, &[("vmlinuz", &vmlinuz), ("initrd", &initrd)])?;
    progress(&format!(
        "wrote {} (kernel {release}, {} KiB kernel, {} KiB initramfs)",
        out.display(),
        vmlinuz.len() / 1024,
        initrd.len() / 1024
    ));
    Ok(())
}

/// Adds the interpreter and the libraries `data` (the guest's `what`) needs, recursively.
fn add_needs(
    tree: &mut Tree,
    root: &Path,
    what: &str,
    data: &[u8],
    done: &mut BTreeSet<String>,
) -> Result<(), Error> {
    let needs = elf::needs(what, data)?;
    if let Some(interpreter) = needs.interpreter {
        if !tree.contains(&interpreter) {
            let name = file_name(&interpreter);
            let real = format!("{GUEST_LIBRARY_DIR}/{name}");
            tree.file(&real, 0o755, read(&find_library(root, &name)?)?);
            if real != interpreter {
                tree.symlink(&interpreter, &real);
            }
            done.insert(name);
        }
    }
    for soname in needs.libraries {
        if !done.insert(soname.clone()) {
            continue;
        }
        let library = read(&find_library(root, &soname)?)?;
        add_needs(tree, root, &soname, &library, done)?;
        tree.file(&format!("{GUEST_LIBRARY_DIR}/{soname}"), 0o644, library);
    }
    Ok(())
}

/// The library `soname`: from the unpacked packages if they hold it, else from this machine.
fn find_library(root: &Path, soname: &str) -> Result<PathBuf, Error> {
    let machine = Path::new("/");
    [root, machine]
        .iter()
        .flat_map(|base| {
            LIBRARY_DIRS
                .iter()
                .map(move |dir| base.join(dir).join(soname))
        })
        .find(|path| path.exists())
        .ok_or_else(|| {
            Error::Packages(format!(
                "no package downloaded and nothing on this machine provides {soname}; add its \
                 package to the build's list"
            ))
        })
}

fn file_name(path: &str) -> String {
    path.rsplit('/').next().unwrap_or(path).to_string()
}

fn read(path: &Path) -> Result<Vec<u8>, Error> {
    fs::read(path).map_err(Error::io(format!("reading {}", path.display())))
}

/// An uncompressed tar of `files`, root-owned, dated 0, written next to `out` and renamed, so a
/// reader never sees half a bundle (nor two builders one file).
fn write_bundle(out: &Path, files: &[(&str, &[u8])]) -> Result<(), Error> {
    let partial = out.with_extension(format!("partial-{}", std::process::id()));
    let context = || format!("writing {}", partial.display());
    let file = fs::File::create(&partial).map_err(Error::io(context()))?;
    let mut builder = tar::Builder::new(std::io::BufWriter::new(file));
    for (name, data) in files {
        let mut header = tar::Header::new_gnu();
        header.set_size(data.len() as u64);
        header.set_mode(0o644);
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        header.set_entry_type(tar::EntryType::Regular);
        builder
            .append_data(&mut header, name, *data)
            .map_err(Error::io(context()))?;
    }
    let writer = builder.into_inner().map_err(Error::io(context()))?;
    let file = writer
        .into_inner()
        .map_err(|err| Error::io(context())(err.into_error()))?;
    file.sync_all().map_err(Error::io(context()))?;
    fs::rename(&partial, out).map_err(Error::io(format!("writing {}", out.display())))
}
