//! Quota math (SPEC §3.1, §3.3, §3.5): does a charge fit a tenant's quota rows in a pool?
//!
//! The caller reads the quota rows and the usage (under row locks) and passes them in; this
//! module only decides. A resource without a quota row has quota 0.

use std::collections::BTreeMap;

use crate::error::DomainError;
use crate::resources::{QuotaResource, Shape};

/// Quota rows or usage, per resource. A missing entry counts as 0.
pub type Amounts = BTreeMap<QuotaResource, u64>;

/// A change to usage per resource: positive charges, negative refunds.
pub type Delta = BTreeMap<QuotaResource, i64>;

/// What one instance of `shape` charges: vCPU, memory, disk and the GPU count.
pub fn charge_of(shape: &Shape) -> Delta {
    QuotaResource::ALL
        .into_iter()
        .map(|r| (r, shape.amount(r) as i64))
        .collect()
}

/// What resizing from `old` to `new` charges (growth positive, shrinkage negative).
pub fn resize_delta(old: &Shape, new: &Shape) -> Delta {
    QuotaResource::ALL
        .into_iter()
        .map(|r| (r, new.amount(r) as i64 - old.amount(r) as i64))
        .collect()
}

/// Checks that `delta` fits: for every resource it grows, `used + growth ≤ max`. Refunds and
/// zero entries always fit. The refusal names the first resource over, in the order `vcpu`,
/// `memoryGiB`, `diskGiB`, `gpu`.
pub fn check(max: &Amounts, used: &Amounts, delta: &Delta) -> Result<(), DomainError> {
    for resource in QuotaResource::ALL {
        let growth = delta.get(&resource).copied().unwrap_or(0);
        if growth <= 0 {
            continue;
        }
        let requested = growth as u64;
        let max = max.get(&resource).copied().unwrap_or(0);
        let used = used.get(&resource).copied().unwrap_or(0);
        if used.saturating_add(requested) > max {
            return Err(DomainError::QuotaExceeded {
                resource,
                requested,
                max,
                used,
            });
        }
    }
    Ok(())
}

/// `used` after applying `delta`, never below zero (a refund larger than usage is clamped, so a
/// replayed refund can never make usage negative).
pub fn apply(used: &Amounts, delta: &Delta) -> Amounts {
    let mut out = used.clone();
    for (resource, change) in delta {
        let current = out.get(resource).copied().unwrap_or(0) as i64;
        out.insert(*resource, (current + change).max(0) as u64);
    }
    out
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::error::ErrorCode;
    use crate::resources::Gpus;

    fn shape(vcpu: u32, memory_gib: u32, disk_gib: u32, gpus: u32) -> Shape {
        Shape {
            vcpu,
            memory_gib,
            disk_gib,
            gpus: (gpus > 0).then(|| Gpus {
                model: "l40s".into(),
                count: gpus,
            }),
        }
    }

    fn amounts(v: [u64; 4]) -> Amounts {
        QuotaResource::ALL.into_iter().zip(v).collect()
    }

    #[test]
    fn a_charge_within_every_row_fits() {
        let max = amounts([8, 32, 200, 0]);
        let used = amounts([2, 4, 20, 0]);
        assert!(check(&max, &used, &charge_of(&shape(2, 4, 20, 0))).is_ok());
    }

    #[test]
    fn the_first_resource_over_is_named_with_requested_max_and_used() {
        let max = amounts([8, 8, 10, 0]);
        let used = amounts([0, 6, 0, 0]);
        assert_eq!(
            check(&max, &used, &charge_of(&shape(2, 4, 20, 0))),
            Err(DomainError::QuotaExceeded {
                resource: QuotaResource::MemoryGib,
                requested: 4,
                max: 8,
                used: 6
            })
        );
    }

    #[test]
    fn a_resource_without_a_quota_row_has_quota_zero() {
        let max: Amounts = [
            (QuotaResource::Vcpu, 8),
            (QuotaResource::MemoryGib, 8),
            (QuotaResource::DiskGib, 100),
        ]
        .into_iter()
        .collect();
        let error = check(&max, &Amounts::new(), &charge_of(&shape(1, 1, 1, 1))).unwrap_err();
        assert_eq!(
            error,
            DomainError::QuotaExceeded {
                resource: QuotaResource::Gpu,
                requested: 1,
                max: 0,
                used: 0
            }
        );
    }

    #[test]
    fn a_shrinking_resize_refunds_and_always_fits() {
        let delta = resize_delta(&shape(4, 8, 40, 0), &shape(2, 4, 40, 0));
        assert_eq!(delta[&QuotaResource::Vcpu], -2);
        assert!(check(&Amounts::new(), &amounts([4, 8, 40, 0]), &delta).is_ok());
        assert_eq!(
            apply(&amounts([4, 8, 40, 0]), &delta),
            amounts([2, 4, 40, 0])
        );
    }

    #[test]
    fn a_growing_resize_charges_only_the_growth() {
        let delta = resize_delta(&shape(2, 4, 20, 0), &shape(4, 4, 20, 0));
        let max = amounts([4, 4, 20, 0]);
        let used = amounts([2, 4, 20, 0]);
        assert!(check(&max, &used, &delta).is_ok());
        let used = amounts([3, 4, 20, 0]);
        assert_eq!(
            check(&max, &used, &delta).unwrap_err().code(),
            ErrorCode::QuotaExceeded
        );
    }

    proptest! {
        #[test]
        fn an_accepted_charge_never_takes_usage_over_quota(
            max in prop::array::uniform4(0u64..64),
            used in prop::array::uniform4(0u64..64),
            s in (0u32..16, 0u32..16, 0u32..16, 0u32..4),
        ) {
            let (max, used) = (amounts(max), amounts(used));
            let delta = charge_of(&shape(s.0, s.1, s.2, s.3));
            if check(&max, &used, &delta).is_ok() {
                let after = apply(&used, &delta);
                for r in QuotaResource::ALL {
                    if delta[&r] > 0 {
                        prop_assert!(after[&r] <= max[&r]);
                    }
                }
            }
        }
    }
}
