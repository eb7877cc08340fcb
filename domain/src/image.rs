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

/// The scheme of an image kept in the deployment's object store (`vps images import`): hosts
/// get a download URL signed when their spec is served.
pub const STORE_SCHEME: &str = "store://";

/// The object key an imported image is kept under: one per content digest.
pub fn store_key(sha256: &str) -> String {
    format!("images/{}", sha256.to_lowercase())
}

fn is_store_key(key: &str) -> bool {
    key.strip_prefix("images/")
        .is_some_and(|d| d.len() == 64 && d.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Decides a registration (a first one, or one that replaces the image).
pub fn register(r: &ImageRegistered) -> Result<Vec<ImageEvent>, DomainError> {
    check_name("imageId", &r.image_id)?;
    let stored = r.url.strip_prefix(STORE_SCHEME).is_some_and(is_store_key);
    if !stored
        && !["http://", "https://", "file://"]
            .iter()
            .any(|s| r.url.starts_with(s))
    {
        return Err(DomainError::invalid_input(
            "url",
            "an http(s)://, file:// or store://images/<sha256> URL",
        ));
    }
    if r.sha256.len() != 64 || !r.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(DomainError::invalid_input("sha256", "64 hex characters"));
    }
    if !["raw", "qcow2", "iso", "bundle"].contains(&r.format.as_str()) {
        return Err(DomainError::invalid_input(
            "format",
            "raw, qcow2, iso or bundle",
        ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn image(url: &str, format: &str) -> ImageRegistered {
        ImageRegistered {
            image_id: "img_minimal".into(),
            tenant_id: None,
            url: url.into(),
            sha256: "AB".repeat(32),
            format: format.into(),
            verified: true,
        }
    }

    #[test]
    fn an_imported_bundle_names_its_object_by_digest() {
        let url = format!("{STORE_SCHEME}{}", store_key(&"ab".repeat(32)));
        let events = register(&image(&url, "bundle")).unwrap();
        let [ImageEvent::Registered(r)] = events.as_slice() else {
            panic!("{events:?}");
        };
        assert_eq!(r.sha256, "ab".repeat(32));
        assert_eq!(r.url, format!("store://images/{}", "ab".repeat(32)));
    }

    #[test]
    fn other_urls_and_formats_are_refused_naming_the_field() {
        for (url, format, field) in [
            ("store://other/key", "bundle", "url"),
            ("store://images/../../etc", "bundle", "url"),
            ("ftp://x/y", "qcow2", "url"),
            ("https://x/y", "vmdk", "format"),
        ] {
            let err = register(&image(url, format)).unwrap_err();
            assert!(
                matches!(&err, DomainError::InvalidInput { field: f, .. } if f == field),
                "{url} {format}: {err:?}"
            );
        }
    }
}
