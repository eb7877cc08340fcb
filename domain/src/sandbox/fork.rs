//! `sandboxes.fork`: one memory snapshot of a ready sandbox, restored `count` times. Each fork
//! is an ordinary restore (its own sandbox, address, identity and lifetime); this decides the
//! request's bounds, the keys that make every step idempotent, and the `sandbox.forked` event
//! that names the source.

use super::{Sandbox, SandboxEvent, SandboxForked, SandboxState, MAX_IDEMPOTENCY_KEY};
use crate::error::DomainError;

/// The most sandboxes one fork makes.
pub const MAX_COUNT: u64 = 10;

/// A fork's `count` and `idempotencyKey`, checked: 1 to [`MAX_COUNT`], and a key of 1 to
/// [`MAX_IDEMPOTENCY_KEY`] characters, else `INVALID_INPUT` naming the field.
pub fn check(count: u64, key: &str) -> Result<usize, DomainError> {
    if !(1..=MAX_COUNT).contains(&count) {
        return Err(DomainError::invalid_input(
            "count",
            format!("1 to {MAX_COUNT}"),
        ));
    }
    // The derived keys add a prefix and a suffix: keep them within the limit too.
    if key.trim().is_empty() || key.len() + 16 > MAX_IDEMPOTENCY_KEY {
        return Err(DomainError::invalid_input(
            "idempotencyKey",
            format!("1 to {} characters", MAX_IDEMPOTENCY_KEY - 16),
        ));
    }
    Ok(count as usize)
}

/// What a fork of `s` with `key` is, before anything is taken: a replay of the sandboxes the key
/// already made (`CONFLICT` for another `count`), or a new fork of a ready sandbox.
pub fn start(s: &Sandbox, count: usize, key: &str) -> Result<Option<Vec<String>>, DomainError> {
    if let Some(made) = s.forks.get(key) {
        if made.len() == count {
            return Ok(Some(made.clone()));
        }
        return Err(DomainError::conflict(
            format!(
                "idempotency key already forked sandbox {} {} times",
                s.id,
                made.len()
            ),
            "sandboxId",
            s.id.clone(),
        ));
    }
    if s.state != SandboxState::Ready {
        return Err(DomainError::invalid_state(format!(
            "sandbox {} is {}; a fork needs a ready sandbox",
            s.id,
            s.state.as_str()
        )));
    }
    Ok(None)
}

/// The key of the fork's memory snapshot.
pub fn snapshot_key(key: &str) -> String {
    format!("fork:{key}")
}

/// The key of the fork's `index`th restore.
pub fn restore_key(key: &str, index: usize) -> String {
    format!("fork:{key}:{index}")
}

/// Records a finished fork on the source's stream (nothing when the key is recorded already).
pub fn forked(
    s: &Sandbox,
    snapshot_id: &str,
    sandbox_ids: Vec<String>,
    key: &str,
) -> Vec<SandboxEvent> {
    if s.forks.contains_key(key) {
        return Vec::new();
    }
    vec![SandboxEvent::Forked(SandboxForked {
        ids: s.lifecycle(),
        source_sandbox_id: s.id.clone(),
        snapshot_id: snapshot_id.to_string(),
        sandbox_ids,
        idempotency_key: key.to_string(),
    })]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn a_count_outside_1_to_10_is_invalid_input_on_count() {
        for bad in [0, 11, 1000] {
            let e = check(bad, "k").unwrap_err();
            assert_eq!(e.code(), ErrorCode::InvalidInput);
            assert_eq!(e.details()["field"], "count", "{e:?}");
        }
        assert_eq!(check(10, "k").unwrap(), 10);
        assert_eq!(
            check(1, "").unwrap_err().details()["field"],
            "idempotencyKey"
        );
    }
}
