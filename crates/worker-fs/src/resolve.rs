//! Confinement: every path of a call is resolved by the kernel beneath the workspace.
//!
//! The workspace directory is opened once per call; every later open is
//! `openat2(workspace_fd or a dirfd beneath it, path, RESOLVE_BENEATH |
//! RESOLVE_NO_SYMLINKS)`. The kernel refuses (`EXDEV`) any resolution that would leave
//! the starting directory, through `..` or an absolute path, and (`ELOOP`) any that
//! would go through a symbolic link, escaping or not. Refusing every link is what makes
//! the path a policy judged (lexically normalised, see
//! `airlock_policy::paths::normalize_path`) the file the kernel touches: `src/h/../config` with `src/h` a link
//! to `.git/hooks` would otherwise be judged as `src/config` and read `.git/config`.
//! Tools that act on a final name itself (delete, move, get_file_info) still see a link
//! there as a link. Containment is never decided on strings; `[fs] hidden` is (after
//! the same normalisation), which is sound only because no link is followed.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;

use crate::hidden::Hidden;

/// Where the shell sandbox mounts the workspace; absolute paths under it are accepted.
pub const SANDBOX_ROOT: &str = "/workspace";

/// How often a resolution is retried when the kernel reports a concurrent rename (`EAGAIN`).
const EAGAIN_RETRIES: usize = 32;

#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    #[error("path {path:?} is outside the workspace; use a path relative to the workspace root")]
    Outside { path: String },
    #[error("{path:?} does not exist; use list_directory or search_files to find the right path")]
    NotFound { path: String },
    #[error("a component of {path:?} is not a directory; check the path with list_directory")]
    NotADirectory { path: String },
    #[error(
        "{path:?} cannot be resolved: too many levels of symbolic links, or a symbolic link \
         where a plain file or directory is needed"
    )]
    Loop { path: String },
    #[error("path {path:?} contains a NUL byte; pass a plain relative path")]
    Nul { path: String },
    #[error("{path:?} is the workspace root; {hint}")]
    Root { path: String, hint: &'static str },
    #[error("path {path:?} must end in a file or directory name, not \".\" or \"..\"")]
    NoName { path: String },
    #[error("permission denied on {path:?}")]
    Permission { path: String },
    #[error("{path:?} exists and is not a directory; choose another path")]
    NotADirectoryAt { path: String },
    #[error(
        "{path:?} goes through the symbolic link {link:?}; the file tools do not follow \
         symbolic links inside a path, use the path of the link's target instead \
         (get_file_info on the link shows its target)"
    )]
    Symlink { path: String, link: String },
    #[error(
        "{path:?} is hidden by [fs] hidden ({hidden:?}); the file tools do not list, \
         search, read or change it"
    )]
    Hidden { path: String, hidden: String },
    #[error("cannot access {path:?}: {errno}")]
    Io { path: String, errno: Errno },
    #[error("cannot create {path:?}: {}", airlock_worker::volumes::WORKSPACE_FULL)]
    Full { path: String },
    #[error("cannot open the workspace {dir}: {reason}")]
    Workspace { dir: String, reason: String },
    #[error(
        "this kernel has no openat2 (Linux 5.6 or newer is needed); the fs worker refuses to \
         touch files without it"
    )]
    Unsupported,
}

/// Maps an errno from resolving `path` to an error the model can act on.
pub fn map_errno(errno: Errno, path: &str) -> ResolveError {
    let path = path.to_owned();
    match errno {
        Errno::XDEV => ResolveError::Outside { path },
        Errno::NOENT => ResolveError::NotFound { path },
        Errno::NOTDIR => ResolveError::NotADirectory { path },
        Errno::LOOP => ResolveError::Loop { path },
        Errno::ACCESS | Errno::PERM => ResolveError::Permission { path },
        Errno::NOSYS => ResolveError::Unsupported,
        Errno::NOSPC | Errno::DQUOT => ResolveError::Full { path },
        errno => ResolveError::Io { path, errno },
    }
}

/// The last component of a relative path, split off lexically.
#[derive(Debug, PartialEq, Eq)]
pub enum Last<'a> {
    /// The path names the starting directory itself (`""`, `"."`, `"./"`).
    Root,
    /// The path ends in `..`.
    Dots,
    /// A plain name (no `/`, not `.` or `..`) inside `parent`.
    Name { parent: &'a str, name: &'a str },
}

pub fn split_last(rel: &str) -> Last<'_> {
    let mut s = rel;
    loop {
        let t = s.trim_end_matches('/');
        if t.is_empty() || t == "." {
            return Last::Root;
        }
        match t.strip_suffix("/.") {
            Some(stripped) => s = stripped,
            None => {
                s = t;
                break;
            }
        }
    }
    let (parent, name) = match s.rsplit_once('/') {
        Some((p, n)) => (if p.is_empty() { "." } else { p }, n),
        None => (".", s),
    };
    if name == ".." {
        Last::Dots
    } else {
        Last::Name { parent, name }
    }
}

/// The workspace of one call, opened.
#[derive(Debug)]
pub struct Workspace {
    root: OwnedFd,
    host: PathBuf,
    hidden: Hidden,
}

fn resolve_flags() -> ResolveFlags {
    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS
}

/// Opens `path` beneath `dir` following symlinks that stay inside: only to describe
/// where a link points (get_file_info), never to act on or read what is there.
fn open_following(dir: impl AsFd, path: &str) -> Result<OwnedFd, Errno> {
    let dir = dir.as_fd();
    let mut attempt = 0;
    loop {
        match rustix::fs::openat2(
            dir,
            path,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
            ResolveFlags::BENEATH | ResolveFlags::NO_MAGICLINKS,
        ) {
            Err(Errno::AGAIN) if attempt < EAGAIN_RETRIES => attempt += 1,
            other => return other,
        }
    }
}

/// `openat2` beneath `dir`, retried while the kernel reports a concurrent rename.
pub fn open_beneath<P: rustix::path::Arg + Copy>(
    dir: impl AsFd,
    path: P,
    flags: OFlags,
    mode: Mode,
) -> Result<OwnedFd, Errno> {
    let dir = dir.as_fd();
    let mut attempt = 0;
    loop {
        match rustix::fs::openat2(dir, path, flags | OFlags::CLOEXEC, mode, resolve_flags()) {
            Err(Errno::AGAIN) if attempt < EAGAIN_RETRIES => attempt += 1,
            other => return other,
        }
    }
}

/// Opens a child directory by its single-component `name` (the bytes on disk, which
/// need not be UTF-8) without following a symlink.
pub fn open_child_dir<P: rustix::path::Arg + Copy>(
    dir: impl AsFd,
    name: P,
) -> Result<OwnedFd, Errno> {
    let dir = dir.as_fd();
    let mut attempt = 0;
    loop {
        match rustix::fs::openat2(
            dir,
            name,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
            Mode::empty(),
            resolve_flags() | ResolveFlags::NO_SYMLINKS,
        ) {
            Err(Errno::AGAIN) if attempt < EAGAIN_RETRIES => attempt += 1,
            other => return other,
        }
    }
}

/// Whether `segment` is one plain path component.
fn is_plain_name(segment: &str) -> bool {
    !segment.is_empty()
        && segment != "."
        && segment != ".."
        && !segment.contains('/')
        && !segment.contains('\0')
}

impl Workspace {
    /// Opens (creating on demand, mode 0700) `<root>/<principal>/<session>`; the two
    /// segments are opened beneath the root without following symlinks.
    pub fn open_session(root: &Path, principal: &str, session: &str) -> Result<Self, ResolveError> {
        let dir = root.join(principal).join(session);
        let fail = |reason: String| ResolveError::Workspace {
            dir: dir.display().to_string(),
            reason,
        };
        if !is_plain_name(principal) || !is_plain_name(session) {
            return Err(fail(
                "principal and session must be plain path segments".into(),
            ));
        }
        // Every call opens its session, and nearly always the session exists: the
        // directories are opened first and made (mode 0700) only when one is missing.
        // Three path lookups a call instead of seven (a `mkdir` answered EEXIST for the
        // root and each segment, and a `stat` of the root, before the same opens).
        let open_root = || {
            rustix::fs::open(
                root,
                OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            )
        };
        let mut fd = match open_root() {
            Err(Errno::NOENT) => {
                std::fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o700)
                    .create(root)
                    .map_err(|e| fail(e.to_string()))?;
                open_root()
            }
            opened => opened,
        }
        .map_err(|e| fail(e.to_string()))?;
        let refused = |e: Errno| match e {
            Errno::NOSYS => ResolveError::Unsupported,
            e => fail(e.to_string()),
        };
        for segment in [principal, session] {
            fd = match open_child_dir(&fd, segment) {
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(&fd, segment, Mode::from_raw_mode(0o700)) {
                        // Another call may have made it since: open it as well.
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(refused(e)),
                    }
                    open_child_dir(&fd, segment)
                }
                opened => opened,
            }
            .map_err(refused)?;
        }
        Ok(Self {
            root: fd,
            host: dir,
            hidden: Hidden::default(),
        })
    }

    /// The `[fs] hidden` patterns this call's paths and walks are checked against.
    pub fn with_hidden(mut self, hidden: Hidden) -> Self {
        self.hidden = hidden;
        self
    }

    /// Whether `[fs] hidden` names anything.
    pub fn hides_anything(&self) -> bool {
        !self.hidden.is_empty()
    }

    /// A test for the entries of a walk started at `rel` (relative to the workspace
    /// root): whether an entry, by its path relative to `rel`, is hidden itself (its
    /// ancestors were checked when the walk entered them, `rel` by [`Self::relative`]).
    pub fn hidden_beneath(&self, rel: &str) -> impl Fn(&str) -> bool + '_ {
        let base = airlock_policy::paths::normalize_path(rel, None);
        move |entry: &str| {
            if self.hidden.is_empty() {
                return false;
            }
            if base == "." {
                self.hidden.matches(entry)
            } else {
                self.hidden.matches(&format!("{base}/{entry}"))
            }
        }
    }

    /// Turns a path as the model gave it into a path relative to the workspace root
    /// (`"."` for the root), refusing it when it is or lies beneath a `[fs] hidden`
    /// path. Absolute paths are accepted under `/workspace` and under the workspace's
    /// host path (canonical when the binary starts the worker, the one spelling the
    /// policy also makes relative); the result is still resolved by the kernel, so `..`
    /// in it can never reach outside.
    pub fn relative(&self, input: &str) -> Result<String, ResolveError> {
        let rel = self.unchecked_relative(input)?;
        let normal = airlock_policy::paths::normalize_path(&rel, None);
        if let Some(hidden) = self.hidden.covering(&normal) {
            return Err(ResolveError::Hidden {
                path: input.to_owned(),
                hidden: hidden.to_owned(),
            });
        }
        Ok(rel)
    }

    fn unchecked_relative(&self, input: &str) -> Result<String, ResolveError> {
        if input.contains('\0') {
            return Err(ResolveError::Nul {
                path: input.to_owned(),
            });
        }
        if !input.starts_with('/') {
            return Ok(if input.is_empty() {
                ".".to_owned()
            } else {
                input.to_owned()
            });
        }
        let path = Path::new(input);
        let rest = path
            .strip_prefix(SANDBOX_ROOT)
            .or_else(|_| path.strip_prefix(&self.host))
            .ok()
            .map(Path::to_path_buf)
            .ok_or_else(|| ResolveError::Outside {
                path: input.to_owned(),
            })?;
        let rest = rest.to_string_lossy().into_owned();
        Ok(if rest.is_empty() {
            ".".to_owned()
        } else {
            rest
        })
    }

    /// Opens `rel` (no symlink followed anywhere in it) with `flags`.
    pub fn open(&self, rel: &str, flags: OFlags, display: &str) -> Result<OwnedFd, ResolveError> {
        open_beneath(&self.root, rel, flags, Mode::empty()).map_err(|e| match e {
            Errno::LOOP => match self.symlink_in(rel) {
                Some(link) => ResolveError::Symlink {
                    path: display.to_owned(),
                    link,
                },
                None => map_errno(e, display),
            },
            e => map_errno(e, display),
        })
    }

    /// The first prefix of `rel` that is a symbolic link, to name it in the error.
    fn symlink_in(&self, rel: &str) -> Option<String> {
        let mut prefix = String::new();
        for component in rel.split('/') {
            if component.is_empty() || component == "." {
                continue;
            }
            if !prefix.is_empty() {
                prefix.push('/');
            }
            prefix.push_str(component);
            // O_PATH | O_NOFOLLOW returns the link itself even under RESOLVE_NO_SYMLINKS.
            let fd = open_beneath(
                &self.root,
                &prefix,
                OFlags::PATH | OFlags::NOFOLLOW,
                Mode::empty(),
            )
            .ok()?;
            let st = rustix::fs::fstat(&fd).ok()?;
            if FileType::from_raw_mode(st.st_mode) == FileType::Symlink {
                return Some(prefix);
            }
        }
        None
    }

    /// Opens `rel` from the workspace root following the symbolic links that stay inside
    /// the workspace ([`open_following`]): a link is resolved from its own directory, so
    /// `sub/l -> ../f.txt` reaches `f.txt`, and never past the root. Only to describe
    /// where a link points.
    pub fn open_following(&self, rel: &str) -> Result<OwnedFd, Errno> {
        open_following(&self.root, rel)
    }

    /// Opens the directory `rel` for reading.
    pub fn open_dir(&self, rel: &str, display: &str) -> Result<OwnedFd, ResolveError> {
        self.open(rel, OFlags::RDONLY | OFlags::DIRECTORY, display)
    }

    /// Resolves `input` to its parent directory (opened beneath the workspace) and its
    /// final plain name, for operations that act on the final component itself.
    /// `root_hint` completes the error when `input` names the workspace root.
    pub fn parent_and_name(
        &self,
        input: &str,
        root_hint: &'static str,
    ) -> Result<(OwnedFd, String), ResolveError> {
        let rel = self.relative(input)?;
        match split_last(&rel) {
            Last::Root => Err(ResolveError::Root {
                path: input.to_owned(),
                hint: root_hint,
            }),
            Last::Dots => Err(ResolveError::NoName {
                path: input.to_owned(),
            }),
            Last::Name { parent, name } => {
                let fd = self.open_dir(parent, input)?;
                Ok((fd, name.to_owned()))
            }
        }
    }

    /// `mkdir -p` beneath the workspace, one component at a time on dirfds. Returns the
    /// final directory and whether any directory was created.
    ///
    /// A `..` goes back to the directory the component before it was opened from (the
    /// kernel refuses a `..` beneath a dirfd): `rel` ends where its lexical resolution
    /// ([`lexical_components`], what policy judged) ends. Every component is still opened
    /// without following a link, those a `..` takes back included, so `src/h/../x` with
    /// `src/h` a symbolic link is refused naming it, as a read of it is; and a component
    /// that a later `..` takes back is never created: `new/../x` makes nothing.
    pub fn make_dirs(&self, rel: &str, display: &str) -> Result<(OwnedFd, bool), ResolveError> {
        let parts: Vec<&str> = rel
            .split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .collect();
        // Which components a later `..` takes back.
        let mut taken_back = vec![false; parts.len()];
        let mut open: Vec<usize> = Vec::new();
        for (i, part) in parts.iter().enumerate() {
            if *part == ".." {
                match open.pop() {
                    Some(j) => taken_back[j] = true,
                    None => {
                        return Err(ResolveError::Outside {
                            path: display.to_owned(),
                        });
                    }
                }
            } else {
                open.push(i);
            }
        }
        let root = open_beneath(&self.root, ".", dir_flags(), Mode::empty())
            .map_err(|e| map_errno(e, display))?;
        // The directories walked so far; `None` for one that does not exist and that a
        // later `..` takes back (nothing beneath it is made either).
        let mut stack: Vec<(Option<OwnedFd>, usize)> = Vec::new();
        let mut created = false;
        for (i, part) in parts.iter().enumerate() {
            if *part == ".." {
                stack.pop();
                continue;
            }
            let walked = walked_path(&parts, &stack, part);
            let parent = match stack.last() {
                Some((Some(fd), _)) => fd,
                Some((None, _)) => {
                    stack.push((None, i));
                    continue;
                }
                None => &root,
            };
            let next = match open_beneath(parent, *part, dir_flags(), Mode::empty()) {
                Ok(fd) => Some(fd),
                Err(Errno::NOENT) if taken_back[i] => None,
                Err(Errno::NOENT) => {
                    match rustix::fs::mkdirat(parent, *part, Mode::from_raw_mode(0o755)) {
                        Ok(()) => created = true,
                        Err(Errno::EXIST) => {}
                        Err(e) => return Err(map_errno(e, &walked)),
                    }
                    Some(
                        open_beneath(parent, *part, dir_flags(), Mode::empty())
                            .map_err(|e| map_errno(e, &walked))?,
                    )
                }
                Err(Errno::NOTDIR) => {
                    return Err(ResolveError::NotADirectoryAt { path: walked });
                }
                // One component under RESOLVE_NO_SYMLINKS: it is the link.
                Err(Errno::LOOP) => {
                    return Err(ResolveError::Symlink {
                        path: display.to_owned(),
                        link: walked,
                    });
                }
                Err(Errno::XDEV) => {
                    return Err(ResolveError::Outside {
                        path: display.to_owned(),
                    });
                }
                Err(e) => return Err(map_errno(e, &walked)),
            };
            stack.push((next, i));
        }
        // Every component left on the stack was opened or made: one that does not exist
        // is there only while a later `..` has yet to take it back.
        match stack.pop() {
            Some((Some(fd), _)) => Ok((fd, created)),
            Some((None, _)) => Err(ResolveError::Outside {
                path: display.to_owned(),
            }),
            None => Ok((root, created)),
        }
    }
}

/// The path of `part` as walked: the components on `stack`, then `part`, for messages.
fn walked_path(parts: &[&str], stack: &[(Option<OwnedFd>, usize)], part: &str) -> String {
    let mut walked: Vec<&str> = stack.iter().map(|(_, i)| parts[*i]).collect();
    walked.push(part);
    walked.join("/")
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY
}

/// The plain components of `rel` once `.` is dropped and each `..` has taken back the
/// component before it, as the policy normalises the path it judges
/// (`airlock_policy::paths::normalize_path`); a `..` above the workspace root is refused.
/// For a path whose directories exist this is where the kernel's resolution ends too:
/// no symbolic link is followed inside a path, so `a/..` is where `a` was opened from.
/// A write also resolves components it is about to create, which the kernel cannot.
pub fn lexical_components<'a>(rel: &'a str, display: &str) -> Result<Vec<&'a str>, ResolveError> {
    let mut components = Vec::new();
    for component in rel.split('/') {
        match component {
            "" | "." => {}
            ".." => {
                if components.pop().is_none() {
                    return Err(ResolveError::Outside {
                        path: display.to_owned(),
                    });
                }
            }
            name => components.push(name),
        }
    }
    Ok(components)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_last_cases() {
        assert_eq!(split_last("."), Last::Root);
        assert_eq!(split_last(""), Last::Root);
        assert_eq!(split_last("./"), Last::Root);
        assert_eq!(split_last("./."), Last::Root);
        assert_eq!(
            split_last("a"),
            Last::Name {
                parent: ".",
                name: "a"
            }
        );
        assert_eq!(
            split_last("a/"),
            Last::Name {
                parent: ".",
                name: "a"
            }
        );
        assert_eq!(
            split_last("a/."),
            Last::Name {
                parent: ".",
                name: "a"
            }
        );
        assert_eq!(
            split_last("a/b/c"),
            Last::Name {
                parent: "a/b",
                name: "c"
            }
        );
        assert_eq!(
            split_last("a//b"),
            Last::Name {
                parent: "a/",
                name: "b"
            }
        );
        assert_eq!(split_last("a/.."), Last::Dots);
        assert_eq!(split_last(".."), Last::Dots);
        assert_eq!(
            split_last("../x"),
            Last::Name {
                parent: "..",
                name: "x"
            }
        );
    }

    #[test]
    fn write_paths_are_resolved_lexically() {
        fn ok(rel: &str) -> Vec<&str> {
            lexical_components(rel, rel).unwrap()
        }
        assert_eq!(ok("new/.."), Vec::<&str>::new());
        assert_eq!(ok("./a//b/../c/."), ["a", "c"]);
        assert_eq!(ok("."), Vec::<&str>::new());
        for escaping in ["..", "../x", "a/../..", "a/b/../../../c"] {
            assert!(
                matches!(
                    lexical_components(escaping, escaping),
                    Err(ResolveError::Outside { .. })
                ),
                "{escaping}"
            );
        }
    }

    #[test]
    fn relative_paths() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open_session(dir.path(), "alice", "s1").unwrap();
        assert_eq!(ws.relative("").unwrap(), ".");
        assert_eq!(ws.relative("a/b").unwrap(), "a/b");
        assert_eq!(ws.relative("/workspace").unwrap(), ".");
        assert_eq!(ws.relative("/workspace/a/b").unwrap(), "a/b");
        assert_eq!(ws.relative("/workspace/../x").unwrap(), "../x");
        let host = dir.path().join("alice/s1/c.txt");
        assert_eq!(ws.relative(host.to_str().unwrap()).unwrap(), "c.txt");
        assert!(matches!(
            ws.relative("/etc/passwd"),
            Err(ResolveError::Outside { .. })
        ));
        assert!(matches!(
            ws.relative("/workspaces/x"),
            Err(ResolveError::Outside { .. })
        ));
        assert!(matches!(ws.relative("a\0b"), Err(ResolveError::Nul { .. })));
    }

    /// A session is made on demand (the root too, each directory mode 0700), opened as
    /// it is afterwards, and a segment that is a symlink or a file is refused, never
    /// followed or replaced.
    #[test]
    fn sessions_are_made_on_demand_and_never_through_a_symlink() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("not/yet");
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        Workspace::open_session(&root, "alice", "s1").unwrap();
        for made in [root.clone(), root.join("alice"), root.join("alice/s1")] {
            assert_eq!(mode(&made), 0o700, "{}", made.display());
        }
        std::fs::write(root.join("alice/s1/kept.txt"), "x").unwrap();
        let again = Workspace::open_session(&root, "alice", "s1").unwrap();
        assert_eq!(again.host, root.join("alice/s1"));
        assert_eq!(
            std::fs::read_to_string(root.join("alice/s1/kept.txt")).unwrap(),
            "x"
        );
        Workspace::open_session(&root, "alice", "s2").unwrap();
        assert!(root.join("alice/s2").is_dir());

        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, root.join("mallory")).unwrap();
        std::os::unix::fs::symlink(&elsewhere, root.join("alice/s3")).unwrap();
        std::fs::write(root.join("alice/s4"), "a file").unwrap();
        for (principal, session) in [("mallory", "s1"), ("alice", "s3"), ("alice", "s4")] {
            assert!(
                matches!(
                    Workspace::open_session(&root, principal, session),
                    Err(ResolveError::Workspace { .. })
                ),
                "{principal}/{session}"
            );
        }
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);
        assert!(root.join("mallory").is_symlink());
        assert_eq!(
            std::fs::read_to_string(root.join("alice/s4")).unwrap(),
            "a file"
        );
    }

    #[test]
    fn workspace_segments_must_be_plain() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Workspace::open_session(dir.path(), "..", "s1").is_err());
        assert!(Workspace::open_session(dir.path(), "a/b", "s1").is_err());
        assert!(Workspace::open_session(dir.path(), "a", ".").is_err());
    }

    #[test]
    fn kernel_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let ws = Workspace::open_session(dir.path(), "alice", "s1").unwrap();
        let err = ws.open("../../x", OFlags::RDONLY, "../../x").unwrap_err();
        assert!(matches!(err, ResolveError::Outside { .. }), "{err}");
        std::os::unix::fs::symlink("/etc", dir.path().join("alice/s1/etc")).unwrap();
        let err = ws
            .open("etc/passwd", OFlags::RDONLY, "etc/passwd")
            .unwrap_err();
        assert!(
            matches!(&err, ResolveError::Symlink { link, .. } if link == "etc"),
            "{err}"
        );
    }
}
