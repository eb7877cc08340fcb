//! The kernel modules the minimal guest loads, and their load order. Debian's package carries
//! no `modules.dep` (depmod writes it at install), so the order comes from each module's own
//! `.modinfo` `depends=`: a module always follows what it depends on.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

use crate::{elf, Error};

/// What the guest needs, in the order the contract asks for: the virtio core, the block and
/// net drivers (after `failover`, their dependency), the transport, then file systems, and
/// the ACPI power button with the event device `acpid` reads it from. Built-in ones are
/// skipped, missing ones are an error: a guest without one of these cannot boot usefully.
pub const WANTED: &[&str] = &[
    "virtio_ring",
    "virtio",
    "failover",
    "net_failover",
    "virtio_mmio",
    "virtio_blk",
    "virtio_net",
    "virtio_rng",
    "fat",
    "vfat",
    "nls_cp437",
    "nls_ascii",
    "nls_utf8",
    "ext4",
    "evdev",
    "button",
];

/// One module to load: its name and its path under the kernel's module directory.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Module {
    /// The module's name (`virtio_mmio`).
    pub name: String,
    /// Its path relative to `lib/modules/VERSION/` (`kernel/drivers/virtio/virtio_mmio.ko`).
    pub path: String,
}

/// The modules of [`WANTED`] and their dependencies in load order, for the kernel whose module
/// directory is `dir` (`…/lib/modules/VERSION`).
pub fn resolve(dir: &Path) -> Result<Vec<Module>, Error> {
    let builtin = builtin(dir)?;
    let mut available = BTreeMap::new();
    collect(&dir.join("kernel"), dir, &mut available)?;

    let mut order = Vec::new();
    let mut seen = BTreeSet::new();
    for name in WANTED {
        visit(dir, name, &builtin, &available, &mut seen, &mut order, 0)?;
    }
    Ok(order)
}

/// A module name as the kernel compares them: '-' and '_' are the same.
fn normalize(name: &str) -> String {
    name.replace('-', "_")
}

fn builtin(dir: &Path) -> Result<BTreeSet<String>, Error> {
    let path = dir.join("modules.builtin");
    let text =
        fs::read_to_string(&path).map_err(Error::io(format!("reading {}", path.display())))?;
    Ok(text
        .lines()
        .filter_map(|line| Path::new(line).file_stem()?.to_str().map(normalize))
        .collect())
}

fn collect(folder: &Path, root: &Path, found: &mut BTreeMap<String, PathBuf>) -> Result<(), Error> {
    let context = || format!("listing {}", folder.display());
    for entry in fs::read_dir(folder).map_err(Error::io(context()))? {
        let path = entry.map_err(Error::io(context()))?.path();
        if path.is_dir() {
            collect(&path, root, found)?;
        } else if path.extension().is_some_and(|ext| ext == "ko") {
            if let (Some(stem), Ok(relative)) = (
                path.file_stem().and_then(|s| s.to_str()),
                path.strip_prefix(root),
            ) {
                found.insert(normalize(stem), relative.to_path_buf());
            }
        }
    }
    Ok(())
}

fn visit(
    dir: &Path,
    name: &str,
    builtin: &BTreeSet<String>,
    available: &BTreeMap<String, PathBuf>,
    seen: &mut BTreeSet<String>,
    order: &mut Vec<Module>,
    depth: usize,
) -> Result<(), Error> {
    let name = normalize(name);
    if builtin.contains(&name) || !seen.insert(name.clone()) {
        return Ok(());
    }
    if depth > 32 {
        return Err(Error::Packages(format!(
            "kernel module dependencies loop through {name}"
        )));
    }
    let relative = available.get(&name).ok_or_else(|| {
        Error::Packages(format!(
            "the kernel package has no module {name} and does not build it in"
        ))
    })?;
    let path = dir.join(relative);
    let data = fs::read(&path).map_err(Error::io(format!("reading {}", path.display())))?;
    let info = elf::modinfo(&path.display().to_string(), &data)?;
    let depends = info
        .iter()
        .filter(|(key, _)| key == "depends")
        .flat_map(|(_, value)| value.split(','))
        .filter(|dep| !dep.is_empty())
        .map(str::to_string)
        .collect::<Vec<_>>();
    for dep in depends {
        visit(dir, &dep, builtin, available, seen, order, depth + 1)?;
    }
    order.push(Module {
        name,
        path: relative.to_string_lossy().into_owned(),
    });
    Ok(())
}
