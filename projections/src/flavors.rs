//! The `flavors` table, from a flavor's stream.

use sqlx::types::Json;
use sqlx::PgConnection;
use vps_domain::flavor::FlavorEvent;
use vps_domain::resources::Shape;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one flavor event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    match crate::typed::<FlavorEvent>(e)? {
        FlavorEvent::Created(d) => {
            sqlx::query(
            "INSERT INTO flavors (id, pool_id, name, shape, offer_id, archived, created_at, version)
             VALUES ($1, $2, $3, $4, $5, false, $6, $7)",
        )
        .bind(&d.flavor_id)
        .bind(&d.pool_id)
        .bind(&d.name)
        .bind(Json(&d.shape))
        .bind(&d.offer_id)
        .bind(at)
        .bind(e.version)
        .execute(conn)
        .await?;
        }
        FlavorEvent::Archived(d) => {
            sqlx::query("UPDATE flavors SET archived = true, version = $2 WHERE id = $1")
                .bind(&d.flavor_id)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
    }
    Ok(())
}

/// The shape of a pool's flavor that is not archived.
pub async fn shape(
    tx: &mut PgConnection,
    pool_id: &str,
    flavor: &str,
) -> Result<Option<Shape>, sqlx::Error> {
    let shape: Option<Json<Shape>> = sqlx::query_scalar(
        "SELECT shape FROM flavors WHERE pool_id = $1 AND name = $2 AND NOT archived",
    )
    .bind(pool_id)
    .bind(flavor)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(shape.map(|Json(s)| s))
}

/// The provider offer a pool's flavor maps to (archived flavors too); `None` when it names
/// none or there is no such flavor.
pub async fn offer_id(
    tx: &mut PgConnection,
    pool_id: &str,
    flavor: &str,
) -> Result<Option<String>, sqlx::Error> {
    let offer: Option<Option<String>> =
        sqlx::query_scalar("SELECT offer_id FROM flavors WHERE pool_id = $1 AND name = $2")
            .bind(pool_id)
            .bind(flavor)
            .fetch_optional(&mut *tx)
            .await?;
    Ok(offer.flatten())
}
