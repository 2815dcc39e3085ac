//! The runtime's error type: each message is one line that names the file or input at fault.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum RuntimeError {
    #[error(transparent)]
    Load(#[from] thaw_loader::LoadError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("convert: {0}")]
    Convert(String),
    #[error("fetch: {0}")]
    Fetch(String),
    #[error("invalid request: {0}")]
    Request(String),
    #[error("serve: {0}")]
    Serve(String),
}

impl RuntimeError {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        RuntimeError::Io {
            path: path.into(),
            source,
        }
    }
}
