//! Free space on the host's file systems (the doctor's check, a failed snapshot's reason)
//! and their size (the image cache's default budget).

use std::path::Path;

/// The bytes an unprivileged writer may still use on the file system holding `dir`.
pub fn free_bytes(dir: &Path) -> Option<u64> {
    statvfs(dir).map(|stat| stat.f_bavail * stat.f_frsize)
}

/// The size of the file system holding `dir`.
pub fn total_bytes(dir: &Path) -> Option<u64> {
    statvfs(dir).map(|stat| stat.f_blocks * stat.f_frsize)
}

fn statvfs(dir: &Path) -> Option<libc::statvfs> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    // SAFETY: statvfs is plain old data; all zeroes is a valid value of it.
    let mut stat: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `path` is a NUL-terminated string and `stat` a valid out-parameter.
    let rc = unsafe { libc::statvfs(path.as_ptr(), &mut stat) };
    (rc == 0).then_some(stat)
}

/// Below this, a failed write is most likely a full disk: the reason says how much was free.
pub const NEARLY_FULL: u64 = 64 << 20;

/// `error` with the free space of `dir` added when its file system is nearly full, so a
/// failure that a full disk caused says so even when the tool that failed did not.
pub fn explain_full(error: String, dir: &Path) -> String {
    match free_bytes(dir) {
        Some(free) if free < NEARLY_FULL => format!(
            "{error} (the disk is nearly full: {} KiB free in {})",
            free / 1024,
            dir.display()
        ),
        _ => error,
    }
}
