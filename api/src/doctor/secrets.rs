//! `vps.secrets.key`: the sealing key every replica needs.

use super::{Finding, Severity};
use crate::config::Config;

/// The check.
const KEY: &str = "vps.secrets.key";

/// `[secrets] key` is set and is base64 of 32 bytes.
pub fn key(config: &Config) -> Finding {
    match config.secret_bytes() {
        Ok(_) => Finding::ok(KEY, "[secrets] key is set"),
        Err(e) => Finding::bad(
            KEY,
            Severity::Error,
            format!("{e}"),
            "set [secrets] key to `openssl rand -base64 32`, the same on every replica (a \
             changed key cannot open what the old one sealed)",
        ),
    }
}
