//! `write_file`: create or replace a file atomically, creating missing parent directories.

use crate::atomic::{AtomicError, write_atomic};
use crate::resolve::{Last, ResolveError, Workspace, split_last};
use crate::text::escape_name;

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    #[error(transparent)]
    Atomic(#[from] AtomicError),
    #[error(
        "content is {size} bytes, more than the {max} bytes write_file accepts; split it into \
         smaller files"
    )]
    TooLarge { size: u64, max: u64 },
}

#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WriteArgs {
    pub path: String,
    pub content: String,
}

pub fn write_file(ws: &Workspace, args: &WriteArgs, max_bytes: u64) -> Result<String, WriteError> {
    let display = args.path.as_str();
    let size = args.content.len() as u64;
    if size > max_bytes {
        return Err(WriteError::TooLarge {
            size,
            max: max_bytes,
        });
    }
    let rel = ws.relative(display)?;
    let (parent, name) = match split_last(&rel) {
        Last::Root => {
            return Err(ResolveError::Root {
                path: display.to_owned(),
                hint: "write_file needs a file path such as \"notes.txt\"",
            }
            .into());
        }
        Last::Dots => {
            return Err(ResolveError::NoName {
                path: display.to_owned(),
            }
            .into());
        }
        Last::Name { parent, name } => (parent, name),
    };
    let (dir, created_dirs) = ws.make_dirs(parent, display)?;
    let existed = write_atomic(&dir, name, args.content.as_bytes(), display)?;
    let verb = if existed { "replaced" } else { "created" };
    let dirs = if created_dirs {
        " (and its missing parent directories)"
    } else {
        ""
    };
    Ok(format!(
        "{verb} {}{dirs}: wrote {size} bytes",
        escape_name(display)
    ))
}
