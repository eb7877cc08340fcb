//! The flavor aggregate (stream `flavor-<id>`): created in a pool, archived.

use chrono::{DateTime, Utc};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::operator::{check_name, check_name_free, FlavorArchived, FlavorCreated};
use crate::resources::Shape;

crate::event_enum! {
    /// What happens to a flavor.
    pub enum FlavorEvent {
        /// `flavor.created`.
        Created(FlavorCreated) = "flavor.created",
        /// `flavor.archived`.
        Archived(FlavorArchived) = "flavor.archived",
    }
}

/// A flavor as its events leave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Flavor {
    /// `flv_…`.
    pub id: String,
    /// No new instances of it.
    pub archived: bool,
    /// Events folded.
    pub version: u64,
}

impl Aggregate for Flavor {
    type Event = FlavorEvent;
    const CATEGORY: &'static str = "flavor";

    fn create(event: &FlavorEvent, _at: DateTime<Utc>) -> Option<Self> {
        let FlavorEvent::Created(c) = event else {
            return None;
        };
        Some(Flavor {
            id: c.flavor_id.clone(),
            archived: false,
            version: 1,
        })
    }

    fn apply(&mut self, event: &FlavorEvent, _at: DateTime<Utc>) {
        if let FlavorEvent::Archived(_) = event {
            self.archived = true;
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// `flavors.create`, with the facts it needs.
#[derive(Debug, Clone)]
pub struct CreateFlavor {
    /// The new id.
    pub id: String,
    /// The pool.
    pub pool_id: String,
    /// Unique in the pool.
    pub name: String,
    /// What an instance of it gets.
    pub shape: Shape,
    /// Provider pools: the provider's offer.
    pub offer_id: Option<String>,
    /// Fact: the pool's class, when the pool exists.
    pub pool_class: Option<String>,
    /// Fact: another flavor of the pool has the name.
    pub name_taken: bool,
}

/// Decides a create.
pub fn create(c: &CreateFlavor) -> Result<Vec<FlavorEvent>, DomainError> {
    check_name("name", &c.name)?;
    let s = &c.shape;
    if s.vcpu == 0 || s.vcpu > 1024 {
        return Err(DomainError::invalid_input("vcpu", "1 to 1024"));
    }
    if s.memory_gib == 0 || s.memory_gib > 16_384 {
        return Err(DomainError::invalid_input("memoryGiB", "1 to 16384"));
    }
    if s.disk_gib > 1_048_576 {
        return Err(DomainError::invalid_input("diskGiB", "at most 1048576"));
    }
    if s.gpus
        .as_ref()
        .is_some_and(|g| g.count == 0 || g.model.is_empty())
    {
        return Err(DomainError::invalid_input(
            "gpus",
            "a model and a positive count",
        ));
    }
    let class = c
        .pool_class
        .as_deref()
        .ok_or_else(|| DomainError::NotFound {
            what: format!("pool {}", c.pool_id),
        })?;
    if class == "provider" && c.offer_id.is_none() {
        return Err(DomainError::invalid_input(
            "offerId",
            "provider pools' flavors name the provider's offer",
        ));
    }
    check_name_free(c.name_taken, "flavor", &c.name, " in this pool")?;
    Ok(vec![FlavorEvent::Created(FlavorCreated {
        flavor_id: c.id.clone(),
        pool_id: c.pool_id.clone(),
        name: c.name.clone(),
        shape: c.shape.clone(),
        offer_id: c.offer_id.clone(),
    })])
}

/// Decides an archive: archiving an archived flavor records nothing.
pub fn archive(state: Option<&Flavor>, id: &str) -> Result<Vec<FlavorEvent>, DomainError> {
    match state {
        None => Err(DomainError::NotFound {
            what: format!("flavor {id}"),
        }),
        Some(f) if f.archived => Ok(Vec::new()),
        Some(f) => Ok(vec![FlavorEvent::Archived(FlavorArchived {
            flavor_id: f.id.clone(),
        })]),
    }
}
