//! The image aggregate (stream `image-<id>`): registered (again), deleted.

use chrono::{DateTime, Utc};

use crate::aggregate::Aggregate;
use crate::error::DomainError;
use crate::operator::{check_name, ImageDeleted, ImageRegistered};

crate::event_enum! {
    /// What happens to an image.
    pub enum ImageEvent {
        /// `image.registered`.
        Registered(ImageRegistered) = "image.registered",
        /// `image.deleted`.
        Deleted(ImageDeleted) = "image.deleted",
    }
}

/// An image as its events leave it.
#[derive(Debug, Clone, PartialEq)]
pub struct Image {
    /// The id.
    pub id: String,
    /// Deleted (a later registration brings it back).
    pub deleted: bool,
    /// Events folded.
    pub version: u64,
}

impl Aggregate for Image {
    type Event = ImageEvent;
    const CATEGORY: &'static str = "image";

    // A registration may come again: it replaces the image.
    const RECREATABLE: bool = true;

    fn create(event: &ImageEvent, _at: DateTime<Utc>) -> Option<Self> {
        let ImageEvent::Registered(r) = event else {
            return None;
        };
        Some(Image {
            id: r.image_id.clone(),
            deleted: false,
            version: 1,
        })
    }

    fn apply(&mut self, event: &ImageEvent, _at: DateTime<Utc>) {
        if let ImageEvent::Deleted(_) = event {
            self.deleted = true;
        }
    }

    fn version(&self) -> u64 {
        self.version
    }

    fn version_mut(&mut self) -> &mut u64 {
        &mut self.version
    }
}

/// Decides a registration (a first one, or one that replaces the image).
pub fn register(r: &ImageRegistered) -> Result<Vec<ImageEvent>, DomainError> {
    check_name("imageId", &r.image_id)?;
    if !["http://", "https://", "file://"]
        .iter()
        .any(|s| r.url.starts_with(s))
    {
        return Err(DomainError::invalid_input(
            "url",
            "an http(s):// or file:// URL",
        ));
    }
    if r.sha256.len() != 64 || !r.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(DomainError::invalid_input("sha256", "64 hex characters"));
    }
    if !["raw", "qcow2", "iso", "bundle"].contains(&r.format.as_str()) {
        return Err(DomainError::invalid_input("format", "raw, qcow2, iso or bundle"));
    }
    Ok(vec![ImageEvent::Registered(ImageRegistered {
        sha256: r.sha256.to_lowercase(),
        ..r.clone()
    })])
}

/// Decides a deletion: deleting a deleted image records nothing.
pub fn delete(state: Option<&Image>, id: &str) -> Result<Vec<ImageEvent>, DomainError> {
    match state {
        None => Err(DomainError::NotFound {
            what: format!("image {id}"),
        }),
        Some(i) if i.deleted => Ok(Vec::new()),
        Some(i) => Ok(vec![ImageEvent::Deleted(ImageDeleted {
            image_id: i.id.clone(),
        })]),
    }
}
