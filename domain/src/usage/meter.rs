//! Meters, their units, what a shape accrues, and how an amount becomes a quantity.

use rust_decimal::Decimal;
use serde::{Deserialize, Serialize};

use crate::resources::Shape;

/// vCPU hours of a placed hosted instance.
pub const VCPU_HOURS: &str = "vps.vcpu.hours";
/// GiB hours of memory of a placed hosted instance.
pub const MEMORY_GIB_HOURS: &str = "vps.memory.gib.hours";
/// vCPU hours of an unclaimed warm instance, billed to its template's tenant.
pub const SANDBOX_WARM: &str = "vps.sandbox.warm";
/// GiB hours of memory a paused sandbox's instance holds (instead of its vCPU, memory and GPU
/// lines), from `instance.paused` until it runs again.
pub const SANDBOX_PAUSED_GIB_HOURS: &str = "vps.sandbox.paused.gib.hours";
/// GiB hours of a sandbox volume, from its booking (`sandbox.volume.created`) through its
/// resizes to its release (`sandbox.volume.deleted`).
pub const VOLUME_GIB_HOURS: &str = "vps.volume.gib.hours";

/// GiB hours of a stored snapshot (its size rounded up to whole GiB), from
/// `sandbox.snapshot.ready` (stored) to `sandbox.snapshot.deleted` or `.purged`.
pub const SNAPSHOT_GIB_HOURS: &str = "vps.snapshot.gib.hours";

/// Decimal places of every quantity. The log's times are whole microseconds and an hour is
/// 3.6·10⁹ of them, so a quantity has no finite decimal form in general; it is rounded here,
/// once, on the running total (see [`hours`] and the ledger).
pub const QUANTITY_SCALE: u32 = 12;

/// The meter of whole GPUs of `model`.
pub fn gpu_meter(model: &str) -> String {
    format!("gpu.{model}.hours")
}

/// One meter a resource accrues at a constant rate.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Line {
    /// The meter (`vps.vcpu.hours`).
    pub meter: String,
    /// The unit of its quantity (`vcpu-hour`).
    pub unit: String,
    /// Units per hour (vCPUs, GiB, GPUs).
    pub rate: u32,
}

impl Line {
    fn new(meter: impl Into<String>, unit: &str, rate: u32) -> Line {
        Line {
            meter: meter.into(),
            unit: unit.to_string(),
            rate,
        }
    }
}

/// The lines an allocation of `shape` accrues: the warm line alone while it is an unclaimed
/// warm instance, else vCPU, memory and GPU lines. Zero rates accrue nothing and are left out.
pub fn lines(shape: &Shape, warm: bool) -> Vec<Line> {
    let mut lines = if warm {
        vec![Line::new(SANDBOX_WARM, "vcpu-hour", shape.vcpu)]
    } else {
        let mut ordinary = vec![
            Line::new(VCPU_HOURS, "vcpu-hour", shape.vcpu),
            Line::new(MEMORY_GIB_HOURS, "gib-hour", shape.memory_gib),
        ];
        if let Some(gpus) = &shape.gpus {
            ordinary.push(Line::new(gpu_meter(&gpus.model), "gpu-hour", gpus.count));
        }
        ordinary
    };
    lines.retain(|l| l.rate > 0);
    lines
}

/// The line a paused instance of `shape` accrues: the memory it holds.
pub fn paused_lines(shape: &Shape) -> Vec<Line> {
    let mut lines = vec![Line::new(
        SANDBOX_PAUSED_GIB_HOURS,
        "gib-hour",
        shape.memory_gib,
    )];
    lines.retain(|l| l.rate > 0);
    lines
}

/// The line a volume of `size_gib` accrues.
pub fn volume_lines(size_gib: u32) -> Vec<Line> {
    let mut lines = vec![Line::new(VOLUME_GIB_HOURS, "gib-hour", size_gib)];
    lines.retain(|l| l.rate > 0);
    lines
}

/// The line a stored snapshot of `size_gib` accrues.
pub fn snapshot_lines(size_gib: u32) -> Vec<Line> {
    let mut lines = vec![Line::new(SNAPSHOT_GIB_HOURS, "gib-hour", size_gib)];
    lines.retain(|l| l.rate > 0);
    lines
}

/// `amount` unit·microseconds as unit-hours, rounded to [`QUANTITY_SCALE`] places (to the
/// nearest; a tie cannot happen, the exact value's denominator divides 9).
pub fn hours(amount: i128) -> Decimal {
    // amount / 3.6e9 hours = amount · 10¹² / 3.6e9 units of 10⁻¹² = amount · 2500 / 9.
    let twice = amount * 5000;
    let rounded = (twice + 9).div_euclid(18);
    Decimal::from_i128_with_scale(rounded, QUANTITY_SCALE)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::Gpus;

    fn shape(gpus: Option<Gpus>) -> Shape {
        Shape {
            vcpu: 4,
            memory_gib: 8,
            disk_gib: 20,
            gpus,
        }
    }

    #[test]
    fn an_hour_of_four_vcpus_is_four_vcpu_hours() {
        assert_eq!(hours(4 * 3_600_000_000).to_string(), "4.000000000000");
        // One second of one vCPU: 1/3600 h = 0.000277777…, to the nearest 10⁻¹².
        assert_eq!(hours(1_000_000).to_string(), "0.000277777778");
        assert_eq!(hours(0), Decimal::ZERO);
    }

    #[test]
    fn a_warm_instance_accrues_only_the_warm_line_and_a_claimed_one_the_ordinary_lines() {
        let gpu = Some(Gpus {
            model: "l40s".into(),
            count: 2,
        });
        let warm: Vec<_> = lines(&shape(gpu.clone()), true)
            .into_iter()
            .map(|l| (l.meter, l.rate))
            .collect();
        assert_eq!(warm, vec![(SANDBOX_WARM.to_string(), 4)]);
        let ordinary: Vec<_> = lines(&shape(gpu), false)
            .into_iter()
            .map(|l| (l.meter, l.rate))
            .collect();
        assert_eq!(
            ordinary,
            vec![
                (VCPU_HOURS.to_string(), 4),
                (MEMORY_GIB_HOURS.to_string(), 8),
                ("gpu.l40s.hours".to_string(), 2)
            ]
        );
    }
}
