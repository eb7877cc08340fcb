//! Running the host's command-line tools (`qemu-img`, `cp`, `ip`) the one way the runtime does.

use tokio::process::Command;

use crate::runtime::RuntimeError;

/// Runs `command` to its end and answers its standard output. A tool that cannot be started
/// is `cannot run TOOL: …`; one that fails is `WHAT: its standard error`.
pub(super) async fn run(command: &mut Command, what: &str) -> Result<Vec<u8>, RuntimeError> {
    let tool = command
        .as_std()
        .get_program()
        .to_string_lossy()
        .into_owned();
    let output = command
        .output()
        .await
        .map_err(|e| RuntimeError(format!("cannot run {tool}: {e}")))?;
    if output.status.success() {
        return Ok(output.stdout);
    }
    Err(RuntimeError(format!(
        "{what}: {}",
        String::from_utf8_lossy(&output.stderr).trim()
    )))
}
