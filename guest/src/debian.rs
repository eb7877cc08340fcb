//! Debian's packages, fetched with `apt-get download` (no root file system is touched, nothing
//! is installed) and unpacked with `dpkg-deb -x` into one tree.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use crate::Error;

/// The kernel's meta package; it depends on exactly one versioned image package.
pub const KERNEL_META: &str = "linux-image-cloud-amd64";

/// Downloads `package` into `dir` and returns the `.deb` it wrote.
pub fn download(dir: &Path, package: &str) -> Result<PathBuf, Error> {
    let before = debs(dir)?;
    // apt's sandbox user cannot write into a directory root made; the download needs no
    // sandbox, and without this option apt warns on every package.
    run(Command::new("apt-get")
        .args(["-q", "-o", "APT::Sandbox::User=root", "download", package])
        .current_dir(dir))
    .map_err(|err| match err {
        Error::Command { command, detail } => Error::Command {
            command,
            detail: format!(
                "{detail} (are the package lists current? `apt-get update` fetches them)"
            ),
        },
        other => other,
    })?;
    // apt-get names the file `NAME_VERSION_ARCH.deb`, with the epoch's ':' escaped: find it
    // by its package name rather than rebuilding that name.
    let prefix = format!("{package}_");
    debs(dir)?
        .into_iter()
        .filter(|deb| {
            deb.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(&prefix))
        })
        .max_by_key(|deb| !before.contains(deb))
        .ok_or_else(|| Error::Packages(format!("apt-get download {package} wrote no .deb")))
}

/// The versioned kernel image package the meta package `deb` depends on
/// (`linux-image-6.1.0-57-cloud-amd64`).
pub fn kernel_package(meta_deb: &Path) -> Result<String, Error> {
    let depends = run(Command::new("dpkg-deb")
        .arg("-f")
        .arg(meta_deb)
        .arg("Depends"))?;
    depends
        .split([',', '|'])
        .map(|dep| dep.split_whitespace().next().unwrap_or_default())
        .find(|name| name.starts_with("linux-image-") && *name != KERNEL_META)
        .map(str::to_string)
        .ok_or_else(|| {
            Error::Packages(format!(
                "{KERNEL_META} depends on no versioned linux-image package: {depends:?}"
            ))
        })
}

/// Unpacks `deb` into `root`.
pub fn extract(deb: &Path, root: &Path) -> Result<(), Error> {
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root)).map(drop)
}

fn debs(dir: &Path) -> Result<Vec<PathBuf>, Error> {
    let context = || format!("listing {}", dir.display());
    let mut debs = Vec::new();
    for entry in fs::read_dir(dir).map_err(Error::io(context()))? {
        let path = entry.map_err(Error::io(context()))?.path();
        if path.extension().is_some_and(|ext| ext == "deb") {
            debs.push(path);
        }
    }
    debs.sort();
    Ok(debs)
}

/// Runs `command` and returns its standard output; a failure carries the end of its stderr.
fn run(command: &mut Command) -> Result<String, Error> {
    let line = format!("{command:?}").replace('"', "");
    let output = command.output().map_err(|err| Error::Command {
        command: line.clone(),
        detail: format!("could not start it: {err}"),
    })?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        return Err(Error::Command {
            command: line,
            detail: format!("{}: {}", output.status, tail.join(" / ")),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}
