//! Usage metering, as pure math over the log (SPEC §3.9): which meters an instance accrues,
//! the epoch-aligned windows they are cut into, and the exact quantities of the
//! `usage.recorded` records. The metering reactor and `vps usage verify` both fold the log
//! through the same [`Ledger`], so a re-computation can only agree with what was recorded or
//! show a real difference.
//!
//! - [`window`]: microsecond times and windows `[k·w, (k+1)·w)`.
//! - [`meter`]: meter names, units, the lines a shape accrues, and quantity rounding.
//! - [`record`]: a `usage.recorded` record and its deterministic event id.
//! - [`ledger`]: per-instance segments folded from instance events, settled into records.

pub mod ledger;
pub mod meter;
pub mod record;
pub mod window;

pub use ledger::{InstanceMeter, Ledger, Payer, Segment};
pub use meter::{hours, Line};
pub use record::UsageRecord;
pub use window::{Micros, Windows};
