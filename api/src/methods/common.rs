//! Request parts that several method groups share: a create's `wait`, a list's label filter.

use std::time::Duration;

use serde::Deserialize;

use crate::error::ApiError;

/// How long a create may wait for its instance to settle.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Wait {
    /// At most 30000.
    timeout_ms: u64,
}

impl Wait {
    /// The wait, checked (at most 30 s).
    pub fn duration(&self) -> Result<Duration, ApiError> {
        if self.timeout_ms > 30_000 {
            return Err(ApiError::invalid("wait.timeoutMs", "at most 30000"));
        }
        Ok(Duration::from_millis(self.timeout_ms))
    }
}

/// A `list` call's label filter, checked like labels (at most 32 pairs).
pub(crate) fn label_filter(
    labels: Option<vps_domain::labels::Labels>,
) -> Result<vps_domain::labels::Labels, ApiError> {
    let labels = labels.unwrap_or_default();
    vps_domain::labels::check("labels", &labels).map_err(vps_commands::CommandError::from)?;
    Ok(labels)
}
