//! The guest side of the QEMU host (`docs/guest-contract.md`): the kernel command line the host
//! boots a bundle with, the config drive it hands every guest, and the builder of the minimal
//! guest bundle (`vps images build minimal`).
//!
//! Layout:
//! - [`config_drive`]: writes the NoCloud config drive (a FAT image labelled `cidata`).
//! - [`build_minimal`] (`build.rs`): fetches Debian's packages with `apt-get download`, unpacks
//!   them with `dpkg-deb -x`, and writes the bundle. It leans on `debian.rs` (apt and dpkg),
//!   `elf.rs` (the libraries a binary needs, a kernel module's dependencies), `modules.rs` (which
//!   kernel modules, in which order) and `initrd.rs` (the gzip'd newc cpio).
//! - `assets/`: the guest's `/init`, `inittab`, `sshd_config` and the other files it boots with.
//!
//! This crate never starts a guest and never touches the network configuration of the machine
//! it runs on; the only external programs it runs are `apt-get` and `dpkg-deb`.

mod build;
pub mod config_drive;
mod debian;
mod elf;
mod initrd;
mod modules;

pub use build::build_minimal;

/// Whether `text` is 1 to `max` ASCII letters, digits, `_` or `-`: the one shape of the names
/// that become guest directories, drive ids, disk serials and config-drive values.
pub fn is_plain_name(text: &str, max: usize) -> bool {
    (1..=max).contains(&text.len())
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// What the host passes with `-append` when it boots a bundle; QEMU then adds its own
/// `virtio_mmio.device=…` entries.
///
/// - `console=ttyS0`: the serial console is the guest's log the host keeps.
/// - `tsc_early_khz=2000000`: microvm has no HPET or PM timer, and under TCG the kernel then
///   sometimes hangs calibrating the TSC; a given frequency skips the calibration.
/// - `panic=-1`: a panic reboots at once, and the host's `-no-reboot` turns that into an exit
///   it reports, instead of a guest that hangs for ever.
/// - `reboot=t`: microvm has no keyboard controller or reset register to reboot through; a
///   triple fault always works, so `reboot` ends QEMU under `-no-reboot` too.
/// - `quiet`: every console byte is a slow exit under TCG; warnings and errors still show.
/// - `rdinit=/init`: the bundle's init, named so that a kernel default never matters.
pub const KERNEL_CMDLINE: &str =
    "console=ttyS0 tsc_early_khz=2000000 panic=-1 reboot=t quiet rdinit=/init";

/// What went wrong writing a config drive or building a bundle.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file or directory could not be read or written.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, naming the path.
        context: String,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A config drive field holds a value the guest cannot use safely.
    #[error("config drive: {field} {reason}")]
    InvalidConfig {
        /// The field of [`config_drive::ConfigDrive`].
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// An external program (`apt-get`, `dpkg-deb`) could not run or failed.
    #[error("`{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status and the end of its standard error.
        detail: String,
    },
    /// Debian's packages lack something the guest needs, or hold it in an unexpected form.
    #[error("{0}")]
    Packages(String),
}

impl Error {
    pub(crate) fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
        let context = context.into();
        move |source| Error::Io { context, source }
    }
}
