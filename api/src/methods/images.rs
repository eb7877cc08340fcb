//! `images.*`: operators register and delete images; tenants list their own and public ones.

use serde::Deserialize;
use vps_commands::operator::{self as ops, RegisterImage};
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
    ]
}

async fn list(c: Call, q: ImageList) -> Result<Items<ImageView>, ApiError> {
    let tenant = if c.caller.actor.operator {
        q.tenant_id
    } else {
        c.caller.actor.tenant.clone()
    };
    Ok(views::images(&c.ctx.pool, tenant.as_deref()).await?.into())
}
