//! Rows written with a binary `COPY ... FROM STDIN` (the log's batch appends, a replay's new
//! rows): the fields take the binary forms sqlx sends for bound parameters, so a copied row
//! equals one an `INSERT` of the same values writes. The rows are sent in chunks as they are
//! encoded, so the server inserts one chunk while the next is encoded.

use serde::Serialize;
use sqlx::encode::IsNull;
use sqlx::postgres::{PgArgumentBuffer, PgCopyIn};
use sqlx::{Encode, PgConnection, Postgres};

/// Bytes encoded before they are sent.
const CHUNK: usize = 1 << 20;

/// The most bytes sent in one message: the connection's write buffer grows to the largest
/// message it sends and keeps that size for the pool's lifetime, so a whole chunk per message
/// would leave a megabyte behind on every connection that ever copied one.
const PIECE: usize = 64 * 1024;

/// One `COPY` in progress: [`CopyIn::row`], its fields, [`CopyIn::sent`] per row, then
/// [`CopyIn::finish`].
pub struct CopyIn<'c> {
    copy: Option<PgCopyIn<&'c mut PgConnection>>,
    buf: PgArgumentBuffer,
    columns: i16,
}

impl<'c> CopyIn<'c> {
    /// Starts `COPY table (columns) FROM STDIN` in binary form. `table` and `columns` are
    /// named by the code, never input.
    pub async fn begin(
        conn: &'c mut PgConnection,
        table: &str,
        columns: &[&str],
    ) -> Result<CopyIn<'c>, sqlx::Error> {
        let statement = format!(
            "COPY {table} ({}) FROM STDIN (FORMAT binary)",
            columns.join(", ")
        );
        let copy = conn.copy_in_raw(&statement).await?;
        let mut buf = PgArgumentBuffer::default();
        // The signature, no flags, no header extension.
        buf.extend_from_slice(b"PGCOPY\n\xff\r\n\0");
        buf.extend_from_slice(&0i32.to_be_bytes());
        buf.extend_from_slice(&0i32.to_be_bytes());
        let columns = i16::try_from(columns.len())
            .map_err(|_| sqlx::Error::Protocol("too many columns to copy".into()))?;
        Ok(CopyIn {
            copy: Some(copy),
            buf,
            columns,
        })
    }

    /// Starts a row: its fields follow, one per column, in the columns' order.
    pub fn row(&mut self) {
        self.buf.extend_from_slice(&self.columns.to_be_bytes());
    }

    /// A field in sqlx's binary form of `value` (`None`: NULL).
    pub fn field<'q, T: Encode<'q, Postgres>>(&mut self, value: &T) -> Result<(), sqlx::Error> {
        let at = self.length_slot();
        match value
            .encode_by_ref(&mut self.buf)
            .map_err(sqlx::Error::Encode)?
        {
            IsNull::Yes => {
                self.buf.truncate(at + 4);
                self.buf[at..at + 4].copy_from_slice(&(-1i32).to_be_bytes());
                Ok(())
            }
            IsNull::No => self.close_length(at),
        }
    }

    /// A `jsonb` field: the format version, then the JSON text.
    pub fn jsonb(&mut self, value: &impl Serialize) -> Result<(), sqlx::Error> {
        let at = self.length_slot();
        self.buf.push(1);
        serde_json::to_writer(&mut *self.buf, value).map_err(|e| sqlx::Error::Encode(e.into()))?;
        self.close_length(at)
    }

    /// Ends a row: sends what is encoded once it fills a chunk.
    pub async fn sent(&mut self) -> Result<(), sqlx::Error> {
        if self.buf.len() >= CHUNK {
            self.send().await?;
        }
        Ok(())
    }

    /// Sends the rest and ends the `COPY`; answers the rows copied.
    pub async fn finish(mut self) -> Result<u64, sqlx::Error> {
        self.buf.extend_from_slice(&(-1i16).to_be_bytes());
        self.send().await?;
        match self.copy.take() {
            Some(copy) => copy.finish().await,
            None => Ok(0),
        }
    }

    /// Ends the `COPY` without its rows (after a field failed to encode), so the connection
    /// answers the next statement; answers `error`.
    pub async fn abort(mut self, error: sqlx::Error) -> sqlx::Error {
        if let Some(copy) = self.copy.take() {
            if let Err(e) = copy.abort(error.to_string()).await {
                return e;
            }
        }
        error
    }

    async fn send(&mut self) -> Result<(), sqlx::Error> {
        if let Some(copy) = self.copy.as_mut() {
            for piece in self.buf.chunks(PIECE) {
                copy.send(piece).await?;
            }
        }
        self.buf.clear();
        Ok(())
    }

    /// Reserves a field's length; answers where it is.
    fn length_slot(&mut self) -> usize {
        let at = self.buf.len();
        self.buf.extend_from_slice(&[0; 4]);
        at
    }

    fn close_length(&mut self, at: usize) -> Result<(), sqlx::Error> {
        let length = i32::try_from(self.buf.len() - at - 4)
            .map_err(|_| sqlx::Error::Protocol("a field too long to copy".into()))?;
        self.buf[at..at + 4].copy_from_slice(&length.to_be_bytes());
        Ok(())
    }
}

/// Copies `rows` into `table`: `encode` writes one row's fields (after [`CopyIn::row`]).
pub async fn copy_rows<R>(
    conn: &mut PgConnection,
    table: &str,
    columns: &[&str],
    rows: impl IntoIterator<Item = R>,
    mut encode: impl FnMut(&mut CopyIn<'_>, R) -> Result<(), sqlx::Error>,
) -> Result<u64, sqlx::Error> {
    let mut copy = CopyIn::begin(conn, table, columns).await?;
    for row in rows {
        copy.row();
        if let Err(e) = encode(&mut copy, row) {
            return Err(copy.abort(e).await);
        }
        copy.sent().await?;
    }
    copy.finish().await
}
