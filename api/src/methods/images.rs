//! `images.*`: operators register and delete images; tenants list their own and public ones.

use std::collections::BTreeMap;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use vps_commands::operator::{self as ops, RegisterImage};
use vps_domain::image::{store_key, STORE_SCHEME};
use vps_projections::operator_views::{self as views, ImageView};

use crate::error::ApiError;
use crate::registry::{Access, Call, Items, Method};

/// An image by id.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageRef {
    /// The image id.
    pub image_id: String,
}

/// `images.list`.
#[derive(Deserialize, Default, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageList {
    /// Operators: only this tenant's and public images. Tenants always see their own.
    pub tenant_id: Option<String>,
}

/// The methods of the group.
pub fn methods() -> Vec<Method> {
    use Access::{Operator, Tenant};
    vec![
        Method::new(
            "images",
            "register",
            Operator,
            "Registers an image (public or a tenant's).",
            |c: Call, q: RegisterImage| async move { Ok(ops::register_image(&c.ctx, q).await?) },
        ),
        Method::new(
            "images",
            "delete",
            Operator,
            "Deletes an image.",
            |c: Call, q: ImageRef| async move { Ok(ops::delete_image(&c.ctx, &q.image_id).await?) },
        ),
        Method::new("images", "list", Tenant, "Images the caller can use.", list),
        Method::new(
            "images",
            "upload",
            Operator,
            "Where to PUT an image's bytes in the deployment's object store (vps images import).",
            upload,
        ),
    ]
}

/// `images.upload`.
#[derive(Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ImageUpload {
    /// The SHA-256 (hex) of the bytes to be uploaded: the object is kept under it.
    pub sha256: String,
}

/// Where to upload, and the URL to register the image with once uploaded.
#[derive(Serialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct UploadTarget {
    /// A presigned URL to `PUT` the bytes to, for an hour.
    pub upload_url: String,
    /// The headers the `PUT` must carry.
    pub upload_headers: BTreeMap<String, String>,
    /// `store://images/<sha256>`: the `url` for `images.register`. Hosts are given a download
    /// URL signed when their spec is served.
    pub url: String,
}

/// How long an image upload URL lives: a bundle is a few megabytes, a disk image gigabytes.
const UPLOAD_TTL: Duration = Duration::from_secs(3600);

async fn upload(c: Call, q: ImageUpload) -> Result<UploadTarget, ApiError> {
    if q.sha256.len() != 64 || !q.sha256.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(ApiError::invalid("sha256", "64 hex characters"));
    }
    let key = store_key(&q.sha256);
    let target = c
        .snapshots
        .upload(&key, UPLOAD_TTL)
        .await
        .map_err(|e| crate::error::internal(&e))?;
    Ok(UploadTarget {
        upload_url: target.url,
        upload_headers: target.headers,
        url: format!("{STORE_SCHEME}{key}"),
    })
}

async fn list(c: Call, q: ImageList) -> Result<Items<ImageView>, ApiError> {
    let tenant = if c.caller.actor.operator {
        q.tenant_id
    } else {
        c.caller.actor.tenant.clone()
    };
    Ok(views::images(&c.ctx.pool, tenant.as_deref()).await?.into())
}
