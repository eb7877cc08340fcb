//! The statement of a list's page of documents, newest first. For a filter by a label, the
//! page is found on ids and creation times first and only its documents are read after: the
//! rows may come from a bitmap of the labels' GIN index (sorted after, and sorting the
//! documents themselves cost twice as much at 100,000 rows with a label on 1 % of them: 1,000
//! documents copied to keep 51), or from an index-only walk of a listing index that includes
//! the labels, which only a statement that reads no document can take.

use sqlx::{Postgres, QueryBuilder};

/// `SELECT doc FROM {table} WHERE ` (the caller adds the conditions, then [`close`]).
pub(crate) fn open<'q>(table: &str, ids_first: bool) -> QueryBuilder<'q, Postgres> {
    QueryBuilder::new(match ids_first {
        false => format!("SELECT doc FROM {table} WHERE "),
        true => format!("SELECT page_doc.doc FROM (SELECT id, created_at FROM {table} WHERE "),
    })
}

/// Orders the page newest first, cuts it at `limit` and, ids first, reads its documents.
pub(crate) fn close(q: &mut QueryBuilder<'_, Postgres>, table: &str, ids_first: bool, limit: i64) {
    q.push(" ORDER BY created_at DESC, id DESC LIMIT ")
        .push_bind(limit);
    if ids_first {
        q.push(format!(
            ") page JOIN {table} page_doc ON page_doc.id = page.id
              ORDER BY page.created_at DESC, page.id DESC"
        ));
    }
}
