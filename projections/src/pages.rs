//! The statement of a list's page of documents, newest first. A filter served by a bitmap (a
//! label's GIN index) finds its rows in no order: they are sorted and the page cut on their
//! ids and creation times alone, and only the page's documents are read after. Sorting the
//! documents themselves cost twice as much at 100,000 rows with a label on 1 % of them (1,000
//! documents copied to keep 51: 5.3–6 ms against 2.3–2.9 ms).

use sqlx::{Postgres, QueryBuilder};

/// `SELECT doc FROM {table} WHERE ` (the caller adds the conditions, then [`close`]).
pub(crate) fn open<'q>(table: &str, by_bitmap: bool) -> QueryBuilder<'q, Postgres> {
    QueryBuilder::new(match by_bitmap {
        false => format!("SELECT doc FROM {table} WHERE "),
        true => format!("SELECT page_doc.doc FROM (SELECT id, created_at FROM {table} WHERE "),
    })
}

/// Orders the page newest first, cuts it at `limit` and, after a bitmap, reads its documents.
pub(crate) fn close(q: &mut QueryBuilder<'_, Postgres>, table: &str, by_bitmap: bool, limit: i64) {
    q.push(" ORDER BY created_at DESC, id DESC LIMIT ")
        .push_bind(limit);
    if by_bitmap {
        q.push(format!(
            ") page JOIN {table} page_doc ON page_doc.id = page.id
              ORDER BY page.created_at DESC, page.id DESC"
        ));
    }
}
