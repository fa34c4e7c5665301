//! Values to and from Postgres: the result row as the decoders read it, the values as Postgres
//! binds them, and a database failure as the error an operation answers.

use relay_core::Error;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::{ToSql, Type};

use crate::store::rows::{self, Val};

/// A database failure as an internal error naming the operation and its todo. For key
/// violations the server's detail (which names the key, e.g. the todo id) is included; other
/// details can quote whole rows and are left out.
pub(crate) fn pg_err(op: &str, subject: &str, e: &tokio_postgres::Error) -> Error {
    let Some(db) = e.as_db_error() else {
        return Error::internal(format!("{op} {subject}: the Postgres store failed: {e}"));
    };
    let code = db.code();
    if *code == SqlState::EXCLUSION_VIOLATION || *code == SqlState::UNIQUE_VIOLATION {
        let what = if db.constraint() == Some("todo_attempts_one_open") {
            "a second open attempt was refused at commit (a todo has at most one open attempt)"
        } else {
            "a key is taken"
        };
        return Error::internal(format!(
            "{op} {subject}: {what}: {} ({})",
            db.message(),
            db.detail().unwrap_or("")
        ));
    }
    Error::internal(format!(
        "{op} {subject}: the Postgres store failed: {} [{}{}]",
        db.message(),
        code.code(),
        db.constraint()
            .map(|c| format!(", constraint {c}"))
            .unwrap_or_default()
    ))
}

impl rows::Row for tokio_postgres::Row {
    fn text(&self, i: usize) -> Result<Option<String>, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
    fn int(&self, i: usize) -> Result<Option<i64>, String> {
        if *self.columns()[i].type_() == Type::INT4 {
            self.try_get::<_, Option<i32>>(i)
                .map(|v| v.map(i64::from))
                .map_err(|e| e.to_string())
        } else {
            self.try_get(i).map_err(|e| e.to_string())
        }
    }
    fn boolean(&self, i: usize) -> Result<bool, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
    fn bytes(&self, i: usize) -> Result<Option<Vec<u8>>, String> {
        self.try_get(i).map_err(|e| e.to_string())
    }
}

/// A counter as the `integer` the tables store.
pub(crate) fn n32(op: &str, v: u32) -> Result<i32, Error> {
    i32::try_from(v).map_err(|_| Error::invalid(format!("{op}: count {v} is out of range")))
}

/// Values as Postgres binds them: counts as the `integer` the tables store.
pub(crate) fn pg_vals(
    op: &str,
    vals: Vec<Val>,
) -> Result<Vec<Box<dyn ToSql + Sync + Send>>, Error> {
    vals.into_iter()
        .map(|v| -> Result<Box<dyn ToSql + Sync + Send>, Error> {
            Ok(match v {
                Val::Text(t) => Box::new(t),
                Val::Count(n) => Box::new(n32(op, n)?),
                Val::Big(n) => Box::new(n),
                Val::Bool(b) => Box::new(b),
                Val::Bytes(b) => Box::new(b),
                Val::Texts(t) => Box::new(t),
            })
        })
        .collect()
}
