//! One error type for everything the loader can refuse. Each variant names the file involved so
//! that the one-line message a CLI prints is enough to find the problem.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The file's contents break the format's rules (header, ranges, dtypes, shapes).
    #[error("{path}: {msg}")]
    Invalid { path: PathBuf, msg: String },
    /// An object store refused or failed a request (after retries, where they apply).
    #[error("{url}: {msg}")]
    Remote { url: String, msg: String },
    /// A tensor the caller requires is absent or has the wrong shape or dtype.
    #[error("{path}: {msg}")]
    Tensor { path: PathBuf, msg: String },
}

impl LoadError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        LoadError::Io {
            path: path.into(),
            source,
        }
    }
    pub fn invalid(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        LoadError::Invalid {
            path: path.into(),
            msg: msg.into(),
        }
    }
    pub fn tensor(path: impl Into<PathBuf>, msg: impl Into<String>) -> Self {
        LoadError::Tensor {
            path: path.into(),
            msg: msg.into(),
        }
    }
}
