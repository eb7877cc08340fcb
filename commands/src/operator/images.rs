//! `images.register` and `images.delete`.

use serde::Deserialize;
use vps_domain::image::{self, Image};
use vps_domain::operator::ImageRegistered;
use vps_projections::operator_views::{self as views, ImageView};

use crate::context::Ctx;
use crate::error::CommandError;
use crate::pipeline::{change, transaction};
use crate::Deleted;

/// `images.register`.
#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct RegisterImage {
    /// The id (`img_…` or any name of letters, digits, `-_.`).
    pub image_id: String,
    /// Owner; absent = public.
    pub tenant_id: Option<String>,
    /// Where hosts fetch it.
    pub url: String,
    /// Hex SHA-256.
    pub sha256: String,
    /// `raw`, `qcow2` or `iso`.
    pub format: String,
    /// Vetted by the operator.
    #[serde(default)]
    pub verified: bool,
}

/// Registers (or re-registers) an image.
pub async fn register_image(ctx: &Ctx, input: RegisterImage) -> Result<ImageView, CommandError> {
    let registered = ImageRegistered {
        image_id: input.image_id.clone(),
        tenant_id: input.tenant_id.clone(),
        url: input.url.clone(),
        sha256: input.sha256.clone(),
        format: input.format.clone(),
        verified: input.verified,
    };
    let events = image::register(&registered)?;
    let tenant = input.tenant_id.as_deref();
    transaction(ctx, &input.image_id, async |tx| {
        let decided = Ok(events.clone());
        change::<Image>(ctx, tx, &input.image_id, tenant, |_| decided).await?;
        views::image(&mut *tx, &input.image_id)
            .await?
            .ok_or_else(|| CommandError::not_found(format!("image {}", input.image_id)))
    })
    .await
}

/// Deletes an image (instances already created from it keep running).
pub async fn delete_image(ctx: &Ctx, image_id: &str) -> Result<Deleted, CommandError> {
    transaction(ctx, image_id, async |tx| {
        change::<Image>(ctx, tx, image_id, None, |i| image::delete(i, image_id)).await?;
        Ok(())
    })
    .await?;
    Ok(Deleted::of(image_id))
}
