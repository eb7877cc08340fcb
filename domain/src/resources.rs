//! Shapes, node capacity and quota resources: the quantities placement, quota and resize count.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Whole GPUs of one model.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Gpus {
    /// The GPU model, e.g. `l40s`.
    pub model: String,
    /// How many.
    pub count: u32,
}

/// What a flavor asks for: the resources one instance books.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Shape {
    /// Virtual CPUs.
    pub vcpu: u32,
    /// Memory in GiB.
    #[serde(rename = "memoryGiB")]
    pub memory_gib: u32,
    /// Disk in GiB.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u32,
    /// Whole GPUs of one model, when the flavor has any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<Gpus>,
}

/// What a node offers, or what is booked on it (the same four quantities).
#[derive(
    Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// Virtual CPUs.
    pub vcpu: u32,
    /// Memory in GiB.
    #[serde(rename = "memoryGiB")]
    pub memory_gib: u32,
    /// Disk in GiB.
    #[serde(rename = "diskGiB")]
    pub disk_gib: u32,
    /// GPUs per model; a model appears at most once (at most 16 models).
    #[serde(default, deserialize_with = "crate::bounds::list::<_, Gpus, 16>")]
    #[schemars(length(max = 16))]
    pub gpus: Vec<Gpus>,
}

/// A resource a tenant's quota in a pool limits, with its wire name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum QuotaResource {
    /// `vcpu`.
    #[serde(rename = "vcpu")]
    Vcpu,
    /// `memoryGiB`.
    #[serde(rename = "memoryGiB")]
    MemoryGib,
    /// `diskGiB`.
    #[serde(rename = "diskGiB")]
    DiskGib,
    /// `gpu` (whole GPUs of any model).
    #[serde(rename = "gpu")]
    Gpu,
}

impl Shape {
    /// How many GPUs the shape books (0 without GPUs).
    pub fn gpu_count(&self) -> u32 {
        self.gpus.as_ref().map_or(0, |g| g.count)
    }

    /// The amount of `resource` one instance of this shape uses.
    pub fn amount(&self, resource: QuotaResource) -> u64 {
        u64::from(match resource {
            QuotaResource::Vcpu => self.vcpu,
            QuotaResource::MemoryGib => self.memory_gib,
            QuotaResource::DiskGib => self.disk_gib,
            QuotaResource::Gpu => self.gpu_count(),
        })
    }
}

impl Capacity {
    /// GPUs of `model` in this capacity.
    pub fn gpus_of(&self, model: &str) -> u32 {
        self.gpus
            .iter()
            .filter(|g| g.model == model)
            .map(|g| g.count)
            .sum()
    }

    /// This capacity with `shape` booked on top (what an allocation adds to a node).
    pub fn plus(&self, shape: &Shape) -> Capacity {
        self.combined(shape, u32::saturating_add)
    }

    /// This capacity with `shape` released (never below zero).
    pub fn minus(&self, shape: &Shape) -> Capacity {
        self.combined(shape, u32::saturating_sub)
    }

    /// Each quantity of this capacity combined with the shape's by `op`.
    fn combined(&self, shape: &Shape, op: fn(u32, u32) -> u32) -> Capacity {
        let mut out = Capacity {
            vcpu: op(self.vcpu, shape.vcpu),
            memory_gib: op(self.memory_gib, shape.memory_gib),
            disk_gib: op(self.disk_gib, shape.disk_gib),
            gpus: self.gpus.clone(),
        };
        if let Some(g) = &shape.gpus {
            out.adjust_gpus(&g.model, |n| op(n, g.count));
        }
        out
    }

    /// The first resource `shape` does not fit in, given this capacity with `allocated` booked;
    /// `None` when it fits. GPUs count only those of the shape's model.
    pub fn lacks(&self, allocated: &Capacity, shape: &Shape) -> Option<QuotaResource> {
        let free = |total: u32, used: u32| total.saturating_sub(used);
        if free(self.vcpu, allocated.vcpu) < shape.vcpu {
            return Some(QuotaResource::Vcpu);
        }
        if free(self.memory_gib, allocated.memory_gib) < shape.memory_gib {
            return Some(QuotaResource::MemoryGib);
        }
        if free(self.disk_gib, allocated.disk_gib) < shape.disk_gib {
            return Some(QuotaResource::DiskGib);
        }
        match &shape.gpus {
            Some(g) if free(self.gpus_of(&g.model), allocated.gpus_of(&g.model)) < g.count => {
                Some(QuotaResource::Gpu)
            }
            _ => None,
        }
    }

    /// Whether bookings of `allocated` stay within this capacity (GPUs per model).
    pub fn holds(&self, allocated: &Capacity) -> bool {
        allocated.vcpu <= self.vcpu
            && allocated.memory_gib <= self.memory_gib
            && allocated.disk_gib <= self.disk_gib
            && allocated
                .gpus
                .iter()
                .all(|g| g.count <= self.gpus_of(&g.model))
    }

    fn adjust_gpus(&mut self, model: &str, f: impl Fn(u32) -> u32) {
        match self.gpus.iter_mut().find(|g| g.model == model) {
            Some(g) => g.count = f(g.count),
            None => self.gpus.push(Gpus {
                model: model.to_owned(),
                count: f(0),
            }),
        }
        // Keep bookings canonical: no empty rows, models in order.
        self.gpus.retain(|g| g.count > 0);
        self.gpus.sort();
    }
}

impl QuotaResource {
    /// Every quota resource, in the order checks report them.
    pub const ALL: [QuotaResource; 4] = [
        QuotaResource::Vcpu,
        QuotaResource::MemoryGib,
        QuotaResource::DiskGib,
        QuotaResource::Gpu,
    ];

    /// The wire name: `vcpu`, `memoryGiB`, `diskGiB` or `gpu`.
    pub fn as_str(self) -> &'static str {
        match self {
            QuotaResource::Vcpu => "vcpu",
            QuotaResource::MemoryGib => "memoryGiB",
            QuotaResource::DiskGib => "diskGiB",
            QuotaResource::Gpu => "gpu",
        }
    }

    /// Parses a wire name.
    pub fn parse(s: &str) -> Option<QuotaResource> {
        QuotaResource::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for QuotaResource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_capacity_holds_bookings_up_to_and_including_itself() {
        let cap = Capacity {
            vcpu: 4,
            memory_gib: 8,
            disk_gib: 10,
            gpus: vec![Gpus {
                model: "l40s".into(),
                count: 1,
            }],
        };
        let mut booked = cap.clone();
        assert!(cap.holds(&booked));
        booked.vcpu = 5;
        assert!(!cap.holds(&booked));
        booked.vcpu = 1;
        booked.gpus = vec![Gpus {
            model: "h100".into(),
            count: 1,
        }];
        assert!(!cap.holds(&booked), "a GPU model the node lacks");
    }

    use serde_json::json;

    use super::*;

    fn gpu_shape() -> Shape {
        Shape {
            vcpu: 8,
            memory_gib: 32,
            disk_gib: 100,
            gpus: Some(Gpus {
                model: "l40s".into(),
                count: 1,
            }),
        }
    }

    #[test]
    fn a_shape_uses_the_wire_names_of_the_spec() {
        assert_eq!(
            serde_json::to_value(gpu_shape()).unwrap(),
            json!({ "vcpu": 8, "memoryGiB": 32, "diskGiB": 100, "gpus": { "model": "l40s", "count": 1 } })
        );
        let plain: Shape =
            serde_json::from_value(json!({ "vcpu": 2, "memoryGiB": 4, "diskGiB": 20 })).unwrap();
        assert_eq!(plain.gpus, None);
    }

    #[test]
    fn quota_resources_serialise_to_their_wire_names() {
        for r in QuotaResource::ALL {
            assert_eq!(serde_json::to_value(r).unwrap(), json!(r.as_str()));
            assert_eq!(QuotaResource::parse(r.as_str()), Some(r));
        }
    }

    #[test]
    fn booking_and_releasing_a_shape_round_trips() {
        let empty = Capacity::default();
        let booked = empty.plus(&gpu_shape());
        assert_eq!(booked.gpus_of("l40s"), 1);
        assert_eq!(booked.minus(&gpu_shape()), empty);
    }

    #[test]
    fn a_node_lacking_gpus_of_the_model_does_not_fit() {
        let node = Capacity {
            vcpu: 64,
            memory_gib: 256,
            disk_gib: 2000,
            gpus: vec![Gpus {
                model: "a100".into(),
                count: 4,
            }],
        };
        assert_eq!(
            node.lacks(&Capacity::default(), &gpu_shape()),
            Some(QuotaResource::Gpu)
        );
    }
}
