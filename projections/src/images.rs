//! The `images` table, from an image's stream.

use sqlx::PgConnection;
use vps_domain::image::ImageEvent;
use vps_events::RecordedEvent;

use crate::ProjectionError;

/// Applies one image event.
pub async fn apply(conn: &mut PgConnection, e: &RecordedEvent) -> Result<(), ProjectionError> {
    let at = e.recorded_at;
    match crate::typed::<ImageEvent>(e)? {
        ImageEvent::Registered(d) => {
            sqlx::query(
            "INSERT INTO images (id, tenant_id, url, sha256, format, verified, deleted, created_at, version)
             VALUES ($1, $2, $3, $4, $5, $6, false, $7, $8)
             ON CONFLICT (id) DO UPDATE SET tenant_id = excluded.tenant_id, url = excluded.url,
                sha256 = excluded.sha256, format = excluded.format, verified = excluded.verified,
                deleted = false, version = excluded.version",
        )
        .bind(&d.image_id)
        .bind(&d.tenant_id)
        .bind(&d.url)
        .bind(&d.sha256)
        .bind(&d.format)
        .bind(d.verified)
        .bind(at)
        .bind(e.version)
        .execute(conn)
        .await?;
        }
        ImageEvent::Deleted(d) => {
            sqlx::query("UPDATE images SET deleted = true, version = $2 WHERE id = $1")
                .bind(&d.image_id)
                .bind(e.version)
                .execute(conn)
                .await?;
        }
    }
    Ok(())
}

/// Whether an image is verified; `None` when there is no such image (deleted ones count).
pub async fn verified(tx: &mut PgConnection, image_id: &str) -> Result<Option<bool>, sqlx::Error> {
    sqlx::query_scalar("SELECT verified FROM images WHERE id = $1")
        .bind(image_id)
        .fetch_optional(&mut *tx)
        .await
}
