//! The operator's resources: pools (with offers and IP ranges), nodes, flavors and images.
//! Each command reads its facts, lets the resource's pure `decide` in `vps_domain` judge them,
//! and records the events through [`crate::pipeline::change`]; the answer is the resource's
//! view as the API shows it.

mod flavors;
mod images;
mod nodes;
mod pools;

pub use flavors::{archive_flavor, create_flavor, CreateFlavor};
pub use images::{delete_image, register_image, RegisterImage};
pub use nodes::{register_node, rotate_token, set_cordon, token_hash, RegisterNode};
pub use pools::{
    create_pool, offer_pool, set_ip_pool, update_pool, CreatePool, OfferPool, SetIpPool, UpdatePool,
};

use sqlx::PgConnection;

use crate::error::CommandError;

/// Whether another row of `table` (within `pool_id` when given, other than `except`) has
/// `name`: the fact behind every "names are unique" rule.
pub(crate) async fn name_taken(
    tx: &mut PgConnection,
    table: &'static str,
    pool_id: Option<&str>,
    name: &str,
    except: Option<&str>,
) -> Result<bool, CommandError> {
    // Pools and provider accounts are unique overall, nodes and flavors within their pool.
    let scope = match pool_id {
        Some(_) => "pool_id = $3",
        None => "$3::text IS NULL",
    };
    let sql = format!(
        "SELECT EXISTS (SELECT 1 FROM {table}
          WHERE name = $1 AND ($2::text IS NULL OR id <> $2) AND {scope})"
    );
    Ok(sqlx::query_scalar(&sql)
        .bind(name)
        .bind(except)
        .bind(pool_id)
        .fetch_one(&mut *tx)
        .await?)
}
