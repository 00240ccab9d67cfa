//! The metadata layer's errors: the store (redb) failing, and records or
//! pages that cannot be right. Callers match on the kind; the message names
//! what is wrong.

/// An error of the metadata store, the page caches over it, or a decoder.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// The metadata store failed: I/O under it, or its own checks (boxed:
    /// redb's error is large, and errors travel on the data path's
    /// `Result`s).
    #[error("metadata store: {0}")]
    Store(Box<redb::Error>),
    /// A stored record or page that cannot be right (the message names it).
    #[error("corrupt metadata: {0}")]
    Corrupt(String),
    /// A metadata operation that failed for another reason (the message
    /// says which).
    #[error("{0}")]
    Failed(String),
}

/// redb reports each operation's failure with its own type; all of them
/// are store failures.
macro_rules! from_redb {
    ($($kind:ident),*) => {$(
        impl From<redb::$kind> for MetaError {
            fn from(error: redb::$kind) -> Self {
                MetaError::Store(Box::new(error.into()))
            }
        }
    )*};
}

from_redb!(
    Error,
    DatabaseError,
    TransactionError,
    TableError,
    StorageError,
    CommitError
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redb_failures_become_store_errors_that_keep_their_message() {
        let error: MetaError = redb::StorageError::Corrupted("page 7".into()).into();
        assert!(matches!(error, MetaError::Store(_)));
        assert!(error.to_string().contains("page 7"), "{error}");
        assert_eq!(
            MetaError::Corrupt("map page".into()).to_string(),
            "corrupt metadata: map page"
        );
    }
}
