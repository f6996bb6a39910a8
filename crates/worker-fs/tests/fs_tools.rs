//! The fs tools, called the way the worker runtime calls them, on a real temp directory.
//!
//! Layout of every test:
//! ```text
//! <tmp>/ws/alice/s1/   the workspace of the calls (principal alice, session s1)
//! <tmp>/ws/alice/s2/   another session's workspace (must stay untouched)
//! <tmp>/outside/       canary files that no call may read or change
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use airlock_worker::{CallContext, CancellationToken, SessionId, ToolOutcome, ToolSet};
use airlock_worker_fs::{FsConfig, tools};
use serde_json::{Value, json};

const SECRET: &str = "top secret canary\n";

struct Env {
    tmp: tempfile::TempDir,
    set: ToolSet,
}

impl Env {
    fn new() -> Self {
        Self::with(|_| {})
    }

    fn with(adjust: impl FnOnce(&mut FsConfig)) -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let mut config = FsConfig {
            workspaces_root: tmp.path().join("ws"),
            ..FsConfig::default()
        };
        adjust(&mut config);
        std::fs::create_dir_all(tmp.path().join("ws/alice/s1")).unwrap();
        std::fs::create_dir_all(tmp.path().join("ws/alice/s2")).unwrap();
        std::fs::write(tmp.path().join("ws/alice/s2/other.txt"), "other session").unwrap();
        std::fs::create_dir_all(tmp.path().join("outside/dir")).unwrap();
        std::fs::write(tmp.path().join("outside/canary.txt"), SECRET).unwrap();
        std::fs::write(tmp.path().join("outside/dir/only-outside.txt"), SECRET).unwrap();
        Self {
            tmp,
            set: tools(config),
        }
    }

    fn ws(&self) -> PathBuf {
        self.tmp.path().join("ws/alice/s1")
    }

    fn outside(&self) -> PathBuf {
        self.tmp.path().join("outside")
    }

    fn put(&self, rel: &str, content: &str) {
        let p = self.ws().join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    fn get(&self, rel: &str) -> String {
        std::fs::read_to_string(self.ws().join(rel)).unwrap()
    }

    fn link(&self, rel: &str, target: impl AsRef<Path>) {
        symlink(target, self.ws().join(rel)).unwrap();
    }

    async fn call_as(&self, principal: &str, tool: &str, args: Value) -> ToolOutcome {
        self.call_until(
            principal,
            tool,
            args,
            Instant::now() + Duration::from_secs(30),
        )
        .await
    }

    /// A call whose deadline is `deadline`.
    async fn call_until(
        &self,
        principal: &str,
        tool: &str,
        args: Value,
        deadline: Instant,
    ) -> ToolOutcome {
        let (tx, _rx) = tokio::sync::mpsc::channel(16);
        let ctx = CallContext::new(
            "call-1".into(),
            principal.into(),
            SessionId::parse("s1").unwrap(),
            deadline,
            CancellationToken::new(),
            tx,
        );
        self.set
            .get(tool)
            .unwrap_or_else(|| panic!("no tool {tool}"))
            .execute(args, ctx)
            .await
    }

    async fn call(&self, tool: &str, args: Value) -> ToolOutcome {
        self.call_as("alice", tool, args).await
    }

    async fn ok(&self, tool: &str, args: Value) -> String {
        let out = self.call(tool, args.clone()).await;
        assert!(
            !out.is_error,
            "{tool} {args} failed: {}",
            out.content.join("\n")
        );
        out.content.join("\n")
    }

    async fn err(&self, tool: &str, args: Value) -> String {
        let out = self.call(tool, args.clone()).await;
        assert!(
            out.is_error,
            "{tool} {args} should fail but gave: {}",
            out.content.join("\n")
        );
        out.content.join("\n")
    }

    /// Everything under the temp dir except the call's own workspace: content, mtime and
    /// inode of files, targets of links, names of directories.
    fn snapshot(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        snapshot_into(self.tmp.path(), &self.ws(), &mut out);
        out
    }

    fn temp_leftovers(&self) -> Vec<PathBuf> {
        let mut found = Vec::new();
        find_temps(self.tmp.path(), &mut found);
        found
    }
}

fn snapshot_into(dir: &Path, skip: &Path, out: &mut BTreeMap<PathBuf, String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path == skip {
            continue;
        }
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let desc = if meta.file_type().is_symlink() {
            format!("link {:?}", std::fs::read_link(&path).unwrap())
        } else if meta.is_dir() {
            snapshot_into(&path, skip, out);
            "dir".to_owned()
        } else {
            format!(
                "file {:?} mtime {}.{} ino {} mode {:o}",
                std::fs::read(&path).unwrap(),
                meta.mtime(),
                meta.mtime_nsec(),
                meta.ino(),
                meta.mode()
            )
        };
        out.insert(path, desc);
    }
}

fn find_temps(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        let path = entry.path();
        if entry
            .file_name()
            .to_string_lossy()
            .starts_with(".airlock-tmp-")
        {
            found.push(path.clone());
        }
        if entry.file_type().unwrap().is_dir() {
            find_temps(&path, found);
        }
    }
}

fn lines(n: usize) -> String {
    (1..=n).map(|i| format!("line {i}\n")).collect()
}

// ---------------------------------------------------------------------------------------
// Definitions

/// Name, required arguments, all arguments, (read_only, destructive, idempotent).
type Expect = (
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    (bool, bool, bool),
);

#[test]
fn catalog_matches_the_design() {
    let set = tools(FsConfig::default());
    assert_eq!(set.group(), "fs");
    let expect: &[Expect] = &[
        (
            "read_file",
            &["path"],
            &["path", "offset", "limit"],
            (true, false, true),
        ),
        (
            "write_file",
            &["path", "content"],
            &["path", "content"],
            (false, true, true),
        ),
        (
            "edit_file",
            &["path", "edits"],
            &["path", "edits", "dry_run"],
            (false, true, false),
        ),
        (
            "list_directory",
            &["path"],
            &["path", "recursive", "max_entries"],
            (true, false, true),
        ),
        (
            "search_files",
            &["path"],
            &["path", "glob", "content_regex", "max_results"],
            (true, false, true),
        ),
        ("get_file_info", &["path"], &["path"], (true, false, true)),
        (
            "create_directory",
            &["path"],
            &["path"],
            (false, false, true),
        ),
        (
            "move_path",
            &["source", "destination"],
            &["source", "destination"],
            (false, true, false),
        ),
        (
            "delete_path",
            &["path"],
            &["path", "recursive"],
            (false, true, false),
        ),
    ];
    assert_eq!(set.definitions().len(), expect.len());
    for (name, required, props, (ro, destructive, idempotent)) in expect {
        let d = set.get(name).unwrap().definition();
        assert_eq!(d.name, *name);
        assert!(!d.title.is_empty() && d.title.chars().next().unwrap().is_uppercase());
        let schema = &d.input_schema;
        assert_eq!(schema["type"], "object");
        assert_eq!(schema["additionalProperties"], false);
        assert_eq!(schema["required"], json!(required), "{name}");
        let mut have: Vec<&str> = schema["properties"]
            .as_object()
            .unwrap()
            .keys()
            .map(String::as_str)
            .collect();
        have.sort_unstable();
        let mut want = props.to_vec();
        want.sort_unstable();
        assert_eq!(have, want, "{name}");
        for (prop, s) in schema["properties"].as_object().unwrap() {
            assert!(
                s["description"].is_string(),
                "{name}.{prop} has no description"
            );
        }
        assert_eq!(
            (
                d.annotations.read_only,
                d.annotations.destructive,
                d.annotations.idempotent
            ),
            (*ro, *destructive, *idempotent),
            "{name}"
        );
    }
    let edit = set.get("edit_file").unwrap().definition().input_schema;
    let item = &edit["properties"]["edits"]["items"];
    assert_eq!(item["additionalProperties"], false);
    assert_eq!(item["required"], json!(["old_text", "new_text"]));
    let read = set.get("read_file").unwrap().definition().input_schema;
    assert_eq!(read["properties"]["offset"]["minimum"], 1);
}

// ---------------------------------------------------------------------------------------
// read_file

#[tokio::test]
async fn read_whole_file_and_absolute_forms() {
    let env = Env::new();
    env.put("a/b.txt", "hello\nworld\n");
    assert_eq!(
        env.ok("read_file", json!({"path": "a/b.txt"})).await,
        "hello\nworld\n"
    );
    assert_eq!(
        env.ok("read_file", json!({"path": "/workspace/a/b.txt"}))
            .await,
        "hello\nworld\n"
    );
    let host = env.ws().join("a/b.txt");
    assert_eq!(
        env.ok("read_file", json!({"path": host})).await,
        "hello\nworld\n"
    );
    assert_eq!(
        env.ok("read_file", json!({"path": "a/../a/./b.txt"})).await,
        "hello\nworld\n"
    );
    env.put("empty.txt", "");
    assert_eq!(
        env.ok("read_file", json!({"path": "empty.txt"})).await,
        "[file is empty]"
    );
}

#[tokio::test]
async fn read_pages_with_a_note_on_the_first_line() {
    let env = Env::new();
    env.put("big.txt", &lines(200));
    let out = env
        .ok(
            "read_file",
            json!({"path": "big.txt", "offset": 11, "limit": 10}),
        )
        .await;
    let mut it = out.lines();
    assert_eq!(
        it.next().unwrap(),
        "[lines 11-20 of 200; call read_file with offset=21 to continue]"
    );
    assert_eq!(it.next().unwrap(), "line 11");
    assert_eq!(out.lines().last().unwrap(), "line 20");
    assert_eq!(out.lines().count(), 11);

    let out = env
        .ok("read_file", json!({"path": "big.txt", "offset": 191}))
        .await;
    assert!(
        out.starts_with("[lines 191-200 of 200]\nline 191\n"),
        "{out}"
    );

    let err = env
        .err("read_file", json!({"path": "big.txt", "offset": 500}))
        .await;
    assert!(
        err.contains("past the end") && err.contains("200 lines"),
        "{err}"
    );
}

#[tokio::test]
async fn read_is_capped_in_bytes() {
    let env = Env::with(|c| c.max_read_bytes = 100);
    env.put("big.txt", &lines(200));
    let out = env.ok("read_file", json!({"path": "big.txt"})).await;
    let first = out.lines().next().unwrap();
    // "line 1\n".."line 9\n" = 63 bytes, "line 10\n".. are 8 bytes: 63 + 32 = 95 → 13 lines.
    assert_eq!(
        first,
        "[truncated at 100 bytes: lines 1-13 of 200; call read_file with offset=14 to continue]"
    );
    let body = &out[first.len() + 1..];
    assert!(body.len() <= 100);
    assert!(body.ends_with("line 13\n"));
    let out = env
        .ok(
            "read_file",
            json!({"path": "big.txt", "offset": 14, "limit": 2}),
        )
        .await;
    assert!(out.ends_with("line 14\nline 15\n"), "{out}");

    env.put("long.txt", &format!("{}\nnext\n", "x".repeat(500)));
    let out = env.ok("read_file", json!({"path": "long.txt"})).await;
    assert!(
        out.starts_with("[line 1 of 2 is longer than 100 bytes"),
        "{out}"
    );
    assert!(out.contains("offset=2"), "{out}");
}

#[tokio::test]
async fn read_errors_say_what_to_do() {
    let env = Env::new();
    std::fs::write(env.ws().join("bin.dat"), b"abc\0def").unwrap();
    let err = env.err("read_file", json!({"path": "bin.dat"})).await;
    assert!(
        err.contains("binary file (7 bytes)") && err.contains("text only"),
        "{err}"
    );
    std::fs::write(env.ws().join("latin1.txt"), b"caf\xe9\n").unwrap();
    let err = env.err("read_file", json!({"path": "latin1.txt"})).await;
    assert!(err.contains("binary file"), "{err}");

    std::fs::create_dir(env.ws().join("dir")).unwrap();
    let err = env.err("read_file", json!({"path": "dir"})).await;
    assert!(
        err.contains("is a directory") && err.contains("list_directory"),
        "{err}"
    );

    let err = env.err("read_file", json!({"path": "missing.txt"})).await;
    assert!(
        err.contains("does not exist") && err.contains("list_directory"),
        "{err}"
    );

    let err = env.err("read_file", json!({"path": 5})).await;
    assert!(err.contains("invalid arguments"), "{err}");
    let err = env.err("read_file", json!({"path": "x", "bogus": 1})).await;
    assert!(err.contains("unknown field"), "{err}");
}

#[tokio::test]
async fn workspace_is_created_on_demand() {
    let env = Env::new();
    let out = env
        .call_as("bob", "list_directory", json!({"path": "."}))
        .await;
    assert!(!out.is_error, "{:?}", out.content);
    let dir = env.tmp.path().join("ws/bob/s1");
    assert!(dir.is_dir());
    assert_eq!(
        std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777,
        0o700
    );
    assert_eq!(
        std::fs::metadata(env.tmp.path().join("ws/bob"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o700
    );
}

// ---------------------------------------------------------------------------------------
// write_file

#[tokio::test]
async fn write_creates_replaces_and_leaves_no_temp() {
    let env = Env::new();
    let out = env
        .ok(
            "write_file",
            json!({"path": "new/deep/f.txt", "content": "one"}),
        )
        .await;
    assert!(
        out.contains("created") && out.contains("parent directories"),
        "{out}"
    );
    assert_eq!(env.get("new/deep/f.txt"), "one");
    let mode = std::fs::metadata(env.ws().join("new/deep/f.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o644);

    std::fs::set_permissions(
        env.ws().join("new/deep/f.txt"),
        PermissionsExt::from_mode(0o600),
    )
    .unwrap();
    let out = env
        .ok(
            "write_file",
            json!({"path": "new/deep/f.txt", "content": "two"}),
        )
        .await;
    assert!(out.starts_with("replaced"), "{out}");
    assert_eq!(env.get("new/deep/f.txt"), "two");
    let mode = std::fs::metadata(env.ws().join("new/deep/f.txt"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "mode of the replaced file is kept");
    assert!(env.temp_leftovers().is_empty());

    // Failure after the temp file was written: the target is a non-empty directory.
    env.put("adir/inner.txt", "x");
    let err = env
        .err("write_file", json!({"path": "adir", "content": "data"}))
        .await;
    assert!(err.contains("is a directory"), "{err}");
    assert!(
        env.temp_leftovers().is_empty(),
        "{:?}",
        env.temp_leftovers()
    );
    assert_eq!(env.get("adir/inner.txt"), "x");

    // A file in the way of a parent directory.
    let err = env
        .err(
            "write_file",
            json!({"path": "new/deep/f.txt/x", "content": "y"}),
        )
        .await;
    assert!(err.contains("not a directory"), "{err}");
    assert!(env.temp_leftovers().is_empty());

    let err = env
        .err("write_file", json!({"path": ".", "content": "y"}))
        .await;
    assert!(err.contains("workspace root"), "{err}");
}

/// `..` in a path that is written is resolved lexically, as the policy normalises it
/// and as reads resolve it (no link is followed, so both agree), before anything is
/// created: it never leaves a directory behind, and above the root it is refused.
#[tokio::test]
async fn write_paths_with_dots_are_resolved_before_anything_is_made() {
    let env = Env::new();
    let out = env
        .ok(
            "write_file",
            json!({"path": "new/../x.txt", "content": "x"}),
        )
        .await;
    assert!(out.starts_with("created new/../x.txt:"), "{out}");
    assert_eq!(env.get("x.txt"), "x");
    assert!(!env.ws().join("new").exists());
    env.ok(
        "write_file",
        json!({"path": "a/b/../../c/./y.txt", "content": "y"}),
    )
    .await;
    assert_eq!(env.get("c/y.txt"), "y");
    assert!(!env.ws().join("a").exists());
    let out = env
        .ok("create_directory", json!({"path": "tmp/../made"}))
        .await;
    assert!(out.starts_with("created"), "{out}");
    assert!(env.ws().join("made").is_dir());
    let out = env.ok("create_directory", json!({"path": "tmp/.."})).await;
    assert!(out.contains("workspace root"), "{out}");
    assert!(!env.ws().join("tmp").exists());
    // Above the root: refused, and nothing was made on the way.
    for (tool, args) in [
        (
            "write_file",
            json!({"path": "new/../../x.txt", "content": "x"}),
        ),
        ("create_directory", json!({"path": "new/../../d"})),
        ("create_directory", json!({"path": "new/../.."})),
    ] {
        let err = env.err(tool, args.clone()).await;
        assert!(
            err.contains("outside the workspace"),
            "{tool} {args}: {err}"
        );
        assert!(!env.ws().join("new").exists(), "{tool} {args}");
    }
}

#[tokio::test]
async fn write_is_capped() {
    let env = Env::with(|c| c.max_write_bytes = 10);
    let err = env
        .err("write_file", json!({"path": "f", "content": "12345678901"}))
        .await;
    assert!(
        err.contains("11 bytes") && err.contains("10 bytes"),
        "{err}"
    );
    assert!(!env.ws().join("f").exists());
    env.ok("write_file", json!({"path": "f", "content": "1234567890"}))
        .await;
}

#[tokio::test]
async fn write_replaces_a_symlink_inside_with_a_file() {
    let env = Env::new();
    env.put("target.txt", "target");
    env.link("link.txt", "target.txt");
    env.ok("write_file", json!({"path": "link.txt", "content": "new"}))
        .await;
    assert!(
        !std::fs::symlink_metadata(env.ws().join("link.txt"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert_eq!(env.get("link.txt"), "new");
    assert_eq!(env.get("target.txt"), "target");
}

// ---------------------------------------------------------------------------------------
// edit_file

#[tokio::test]
async fn edit_applies_in_order_and_returns_a_diff() {
    let env = Env::new();
    env.put("src/lib.rs", "fn a() {}\nfn b() {}\nfn c() {}\n");
    let out = env
        .ok(
            "edit_file",
            json!({"path": "src/lib.rs", "edits": [
                {"old_text": "fn b() {}", "new_text": "fn bee() {}"},
                {"old_text": "fn bee() {}\nfn c", "new_text": "fn bee() {}\nfn sea"},
            ]}),
        )
        .await;
    assert!(
        out.contains("--- a/src/lib.rs\n+++ b/src/lib.rs\n"),
        "{out}"
    );
    assert!(
        out.contains("-fn b() {}\n-fn c() {}\n+fn bee() {}\n+fn sea() {}\n"),
        "{out}"
    );
    assert_eq!(
        env.get("src/lib.rs"),
        "fn a() {}\nfn bee() {}\nfn sea() {}\n"
    );
    assert!(env.temp_leftovers().is_empty());

    let out = env
        .ok(
            "edit_file",
            json!({"path": "src/lib.rs", "edits": [
                {"old_text": "fn ", "new_text": "pub fn ", "replace_all": true}
            ]}),
        )
        .await;
    assert!(out.contains("3 replacements"), "{out}");
    assert_eq!(
        env.get("src/lib.rs"),
        "pub fn a() {}\npub fn bee() {}\npub fn sea() {}\n"
    );
}

#[tokio::test]
async fn edit_is_all_or_nothing() {
    let env = Env::new();
    let original = "alpha\nbeta\nbeta\ngamma\n";
    env.put("f.txt", original);
    let before = std::fs::metadata(env.ws().join("f.txt")).unwrap();

    let err = env
        .err(
            "edit_file",
            json!({"path": "f.txt", "edits": [
                {"old_text": "alpha", "new_text": "ALPHA"},
                {"old_text": "delta", "new_text": "DELTA"},
            ]}),
        )
        .await;
    assert!(
        err.contains("edit 2") && err.contains("not found") && err.contains("read_file"),
        "{err}"
    );

    let err = env
        .err(
            "edit_file",
            json!({"path": "f.txt", "edits": [
                {"old_text": "alpha", "new_text": "ALPHA"},
                {"old_text": "beta", "new_text": "BETA"},
            ]}),
        )
        .await;
    assert!(
        err.contains("edit 2") && err.contains("2 places") && err.contains("replace_all"),
        "{err}"
    );

    assert_eq!(env.get("f.txt"), original);
    let after = std::fs::metadata(env.ws().join("f.txt")).unwrap();
    assert_eq!(before.ino(), after.ino());
    assert_eq!(before.mtime_nsec(), after.mtime_nsec());
    assert!(env.temp_leftovers().is_empty());
}

#[tokio::test]
async fn edit_dry_run_writes_nothing() {
    let env = Env::new();
    env.put("f.txt", "one\ntwo\n");
    let out = env
        .ok(
            "edit_file",
            json!({"path": "f.txt", "dry_run": true, "edits": [{"old_text": "two", "new_text": "2"}]}),
        )
        .await;
    assert!(out.starts_with("dry run"), "{out}");
    assert!(out.contains("-two\n+2\n"), "{out}");
    assert_eq!(env.get("f.txt"), "one\ntwo\n");
}

#[tokio::test]
async fn edit_refuses_what_it_cannot_edit() {
    let env = Env::new();
    std::fs::write(env.ws().join("bin"), b"a\0b").unwrap();
    let err = env
        .err(
            "edit_file",
            json!({"path": "bin", "edits": [{"old_text": "a", "new_text": "b"}]}),
        )
        .await;
    assert!(err.contains("not UTF-8 text"), "{err}");
    let err = env
        .err(
            "edit_file",
            json!({"path": "nope", "edits": [{"old_text": "a", "new_text": "b"}]}),
        )
        .await;
    assert!(err.contains("does not exist"), "{err}");
    env.put("t.txt", "abc");
    env.link("l.txt", "t.txt");
    let err = env
        .err(
            "edit_file",
            json!({"path": "l.txt", "edits": [{"old_text": "a", "new_text": "b"}]}),
        )
        .await;
    assert!(
        err.contains("symbolic link") && err.contains("t.txt"),
        "{err}"
    );
    let err = env
        .err("edit_file", json!({"path": "t.txt", "edits": []}))
        .await;
    assert!(err.contains("at least one edit"), "{err}");
}

/// The most edits one edit_file call takes (its schema's `maxItems`).
const MAX_EDITS: usize = 1000;

fn same_edits(n: usize) -> Vec<Value> {
    (0..n)
        .map(|_| json!({"old_text": "a", "new_text": "a", "replace_all": true}))
        .collect()
}

#[tokio::test]
async fn edit_refuses_more_edits_than_it_takes() {
    let env = Env::new();
    env.put("f.txt", "a\n");
    let schema = env.set.get("edit_file").unwrap().definition().input_schema;
    assert_eq!(schema["properties"]["edits"]["maxItems"], MAX_EDITS);
    // Refused by the worker itself, whatever validated the schema before.
    let out = env
        .call(
            "edit_file",
            json!({"path": "f.txt", "edits": same_edits(MAX_EDITS + 1)}),
        )
        .await;
    let err = out.content.join("\n");
    assert!(out.is_error, "should fail but gave: {err}");
    assert!(
        err.contains("1001 edits")
            && err.contains("at most 1000")
            && err.contains("several edit_file calls"),
        "{err}"
    );
    let out = env
        .ok(
            "edit_file",
            json!({"path": "f.txt", "edits": same_edits(MAX_EDITS)}),
        )
        .await;
    assert!(out.contains("1000 edits"), "{out}");
    assert_eq!(env.get("f.txt"), "a\n");
}

/// Every edit of a 4 MiB file of `a` with `replace_all` replaces 4 Mi matches: a
/// thousand of them take many minutes. The call ends at its deadline instead, having
/// changed nothing.
#[test]
fn edit_stops_at_its_deadline() {
    let env = Env::new();
    let original = "a".repeat(4 << 20);
    env.put("f.txt", &original);
    let started = Instant::now();
    let call = env.call_until(
        "alice",
        "edit_file",
        json!({"path": "f.txt", "edits": same_edits(MAX_EDITS)}),
        started + Duration::from_secs(1),
    );
    // Only a bound for the failure: the call answers soon after its deadline. A runtime
    // of its own, left without waiting for its blocking thread, so that a call running
    // on fails this test instead of holding it for as long as it runs.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let answered =
        runtime.block_on(async { tokio::time::timeout(Duration::from_secs(20), call).await });
    runtime.shutdown_background();
    let out = answered.expect("edit_file ran on long past its deadline");
    let text = out.content.join("\n");
    assert!(out.is_error, "{text:.300}");
    assert!(
        text.contains("stopped before edit")
            && text.contains("deadline")
            && text.contains("nothing was changed"),
        "{text}"
    );
    eprintln!("edit_file stopped after {:?}", started.elapsed());
    assert_eq!(env.get("f.txt"), original);
    assert!(env.temp_leftovers().is_empty());
}

// ---------------------------------------------------------------------------------------
// list_directory

#[tokio::test]
async fn list_sorted_with_markers_and_truncation() {
    let env = Env::new();
    env.put("b.txt", "b");
    env.put("a.txt", "a");
    env.put("sub/inner/deep.txt", "d");
    env.link("link", "a.txt");
    let out = env.ok("list_directory", json!({"path": "."})).await;
    assert_eq!(out, "a.txt\nb.txt\nlink -> a.txt\nsub/");
    let out = env
        .ok("list_directory", json!({"path": "", "recursive": true}))
        .await;
    assert_eq!(
        out,
        "a.txt\nb.txt\nlink -> a.txt\nsub/\nsub/inner/\nsub/inner/deep.txt"
    );
    let out = env
        .ok("list_directory", json!({"path": "/workspace/sub"}))
        .await;
    assert_eq!(out, "inner/");
    let out = env
        .ok("list_directory", json!({"path": ".", "max_entries": 2}))
        .await;
    assert!(
        out.starts_with("a.txt\nb.txt\n[truncated: showing the first 2 entries"),
        "{out}"
    );
    std::fs::create_dir(env.ws().join("empty")).unwrap();
    let out = env.ok("list_directory", json!({"path": "empty"})).await;
    assert!(out.contains("empty directory"), "{out}");
    let err = env.err("list_directory", json!({"path": "a.txt"})).await;
    assert!(
        err.contains("not a directory") && err.contains("read_file"),
        "{err}"
    );
    let err = env.err("list_directory", json!({"path": "nope"})).await;
    assert!(err.contains("does not exist"), "{err}");
}

// ---------------------------------------------------------------------------------------
// search_files

#[tokio::test]
async fn search_by_glob_and_content() {
    let env = Env::new();
    env.put("src/main.rs", "fn main() {\n    println!(\"hi\");\n}\n");
    env.put("src/util/mod.rs", "pub fn helper() {}\n");
    env.put("README.md", "# fn in markdown\n");
    std::fs::write(env.ws().join("src/blob.rs"), b"fn \0 binary").unwrap();

    let out = env
        .ok("search_files", json!({"path": ".", "glob": "*.rs"}))
        .await;
    assert_eq!(out, "src/blob.rs\nsrc/main.rs\nsrc/util/mod.rs");
    let out = env
        .ok("search_files", json!({"path": "src", "glob": "*.rs"}))
        .await;
    assert_eq!(
        out, "src/blob.rs\nsrc/main.rs\nsrc/util/mod.rs",
        "paths are workspace-relative"
    );
    let out = env
        .ok("search_files", json!({"path": "src", "glob": "util/*.rs"}))
        .await;
    assert_eq!(out, "src/util/mod.rs");
    let out = env
        .ok("search_files", json!({"path": ".", "glob": "src/*.rs"}))
        .await;
    assert_eq!(out, "src/blob.rs\nsrc/main.rs", "* does not cross /");
    let out = env
        .ok("search_files", json!({"path": ".", "glob": "src/**/*.rs"}))
        .await;
    assert_eq!(out, "src/blob.rs\nsrc/main.rs\nsrc/util/mod.rs");

    let out = env
        .ok(
            "search_files",
            json!({"path": ".", "glob": "*.rs", "content_regex": r"fn\s+\w+\("}),
        )
        .await;
    assert_eq!(
        out,
        "src/main.rs:1: fn main() {\nsrc/util/mod.rs:1: pub fn helper() {}\n[skipped 1 binary file(s)]"
    );
    let out = env
        .ok("search_files", json!({"path": ".", "content_regex": "zzz"}))
        .await;
    assert!(out.starts_with("no lines matched"), "{out}");
    let out = env
        .ok("search_files", json!({"path": ".", "max_results": 2}))
        .await;
    assert!(out.contains("[stopped at 2 results"), "{out}");

    let err = env
        .err("search_files", json!({"path": ".", "content_regex": "("}))
        .await;
    assert!(err.contains("invalid content_regex"), "{err}");
    let err = env
        .err("search_files", json!({"path": ".", "glob": "[a"}))
        .await;
    assert!(err.contains("invalid glob"), "{err}");
    let err = env.err("search_files", json!({"path": "README.md"})).await;
    assert!(err.contains("not a directory"), "{err}");
}

#[tokio::test]
async fn search_is_bounded() {
    let env = Env::with(|c| {
        c.max_search_files = 3;
        c.max_search_file_bytes = 10;
    });
    for i in 0..5 {
        env.put(&format!("f{i}.txt"), "small");
    }
    env.put("big/large.txt", "needle needle needle");
    let out = env.ok("search_files", json!({"path": "."})).await;
    assert!(out.contains("[stopped after examining 3 files"), "{out}");
    let out = env
        .ok(
            "search_files",
            json!({"path": "big", "content_regex": "needle"}),
        )
        .await;
    assert!(
        out.contains("larger than 10 bytes were not searched"),
        "{out}"
    );
}

/// What a workspace holds decides what the tools find, never how large their answer
/// grows: names escaped to five times their length and links with 4 KiB targets are
/// listed and searched up to `[fs] max_read_bytes` of text, as `read_file` reads, and an
/// edit's diff is cut at the same bound (the edit itself is applied whole).
#[tokio::test]
async fn answers_made_of_lines_are_bounded_in_bytes() {
    const MAX: usize = 50_000;
    let env = Env::with(|c| c.max_read_bytes = MAX as u64);
    let control = "\u{1}".repeat(200);
    for i in 0..100 {
        env.put(
            &format!("deep/{i:03}{control}"),
            "needle\n".repeat(200).as_str(),
        );
    }
    for i in 0..40 {
        env.link(&format!("deep/link{i:02}"), "\u{1}".repeat(4000));
    }
    let bounded = |what: &str, out: &str| {
        assert!(
            out.len() <= MAX + 512,
            "{what}: {} bytes, over the {MAX} the answer may hold",
            out.len()
        );
        assert!(
            out.contains("[truncated: the answer reached 50000 bytes"),
            "{what}: no note in {}",
            &out[out.len().saturating_sub(300)..]
        );
    };
    for args in [
        json!({"path": "deep"}),
        json!({"path": ".", "recursive": true, "max_entries": 10000}),
    ] {
        let out = env.ok("list_directory", args.clone()).await;
        bounded(&format!("list_directory {args}"), &out);
        // Whole entries: the listing starts with the first one.
        let first = out.lines().next().unwrap_or_default();
        assert!(
            first.starts_with("000") || first == "deep/",
            "{}",
            &first[..first.len().min(200)]
        );
    }
    let out = env
        .ok("search_files", json!({"path": ".", "max_results": 100}))
        .await;
    bounded("search_files by name", &out);
    let out = env
        .ok(
            "search_files",
            json!({"path": ".", "content_regex": "needle", "max_results": 100}),
        )
        .await;
    // 100 results of a 1 KiB name each: within the result count, over the bytes.
    bounded("search_files by content", &out);

    // A 40 KB file of empty lines, each edited: its diff is twice the file and more.
    env.put("blank.txt", &"\n".repeat(40_000));
    let out = env
        .ok(
            "edit_file",
            json!({"path": "blank.txt", "edits": [{"old_text": "\n", "new_text": "x\n", "replace_all": true}]}),
        )
        .await;
    assert!(out.len() <= MAX + 512, "edit_file: {} bytes", out.len());
    assert!(
        out.contains("[diff truncated: "),
        "{}",
        &out[out.len().saturating_sub(300)..]
    );
    assert_eq!(
        env.get("blank.txt"),
        "x\n".repeat(40_000),
        "the edit is applied whole"
    );
}

// ---------------------------------------------------------------------------------------
// get_file_info

#[tokio::test]
async fn info_describes_files_dirs_and_links() {
    let env = Env::new();
    env.ok("write_file", json!({"path": "f.txt", "content": "a\nb\nc"}))
        .await;
    let out = env.ok("get_file_info", json!({"path": "f.txt"})).await;
    assert!(out.contains("type: file\n"), "{out}");
    assert!(out.contains("size: 5 bytes"), "{out}");
    assert!(out.contains("permissions: 0644"), "{out}");
    assert!(out.contains("lines: 3"), "{out}");
    let modified = out.lines().find(|l| l.starts_with("modified: ")).unwrap();
    let ts = modified.trim_start_matches("modified: ");
    assert_eq!(ts.len(), 20, "{ts}");
    assert!(ts.ends_with('Z') && ts.as_bytes()[10] == b'T', "{ts}");

    env.link("l", "f.txt");
    let out = env.ok("get_file_info", json!({"path": "l"})).await;
    assert!(
        out.contains("type: symlink") && out.contains("target: f.txt"),
        "{out}"
    );
    assert!(
        out.contains("points to: a file inside the workspace"),
        "{out}"
    );
    // A link is followed from its own directory, within the whole workspace.
    std::fs::create_dir(env.ws().join("sub")).unwrap();
    env.link("sub/l", "../f.txt");
    env.link("sub/l2", "../../etc/passwd");
    env.link("sub/l3", "../sub");
    let out = env.ok("get_file_info", json!({"path": "sub/l"})).await;
    assert!(
        out.contains("points to: a file inside the workspace"),
        "{out}"
    );
    let out = env.ok("get_file_info", json!({"path": "sub/l3"})).await;
    assert!(
        out.contains("points to: a directory inside the workspace"),
        "{out}"
    );
    let out = env.ok("get_file_info", json!({"path": "sub/l2"})).await;
    assert!(out.contains("points to: outside the workspace"), "{out}");

    let out = env.ok("get_file_info", json!({"path": "."})).await;
    assert!(
        out.contains("type: directory") && out.contains("workspace root"),
        "{out}"
    );
    let err = env.err("get_file_info", json!({"path": "nope"})).await;
    assert!(err.contains("does not exist"), "{err}");
}

// ---------------------------------------------------------------------------------------
// create_directory, move_path, delete_path

#[tokio::test]
async fn create_directory_is_idempotent() {
    let env = Env::new();
    let out = env.ok("create_directory", json!({"path": "a/b/c"})).await;
    assert!(out.starts_with("created"), "{out}");
    assert!(env.ws().join("a/b/c").is_dir());
    let out = env.ok("create_directory", json!({"path": "a/b/c"})).await;
    assert!(out.contains("already exists"), "{out}");
    env.put("file", "x");
    let err = env
        .err("create_directory", json!({"path": "file/sub"}))
        .await;
    assert!(err.contains("not a directory"), "{err}");
    let err = env.err("create_directory", json!({"path": "file"})).await;
    assert!(err.contains("not a directory"), "{err}");
}

#[tokio::test]
async fn move_never_overwrites() {
    let env = Env::new();
    env.put("a.txt", "a");
    env.put("b.txt", "b");
    env.put("d/x.txt", "x");
    let out = env
        .ok(
            "move_path",
            json!({"source": "a.txt", "destination": "d/a.txt"}),
        )
        .await;
    assert!(out.contains("moved file a.txt to d/a.txt"), "{out}");
    assert_eq!(env.get("d/a.txt"), "a");
    let err = env
        .err(
            "move_path",
            json!({"source": "b.txt", "destination": "d/a.txt"}),
        )
        .await;
    assert!(
        err.contains("already exists") && err.contains("delete_path"),
        "{err}"
    );
    assert_eq!(env.get("d/a.txt"), "a");
    assert_eq!(env.get("b.txt"), "b");
    let err = env
        .err("move_path", json!({"source": "nope", "destination": "x"}))
        .await;
    assert!(err.contains("source \"nope\" does not exist"), "{err}");
    let err = env
        .err(
            "move_path",
            json!({"source": "b.txt", "destination": "no/such/dir/b"}),
        )
        .await;
    assert!(err.contains("create_directory"), "{err}");
    let err = env
        .err(
            "move_path",
            json!({"source": "d", "destination": "d/inside"}),
        )
        .await;
    assert!(err.contains("into itself"), "{err}");
    let err = env
        .err("move_path", json!({"source": ".", "destination": "x"}))
        .await;
    assert!(err.contains("workspace root"), "{err}");
    let err = env
        .err(
            "move_path",
            json!({"source": "/workspace", "destination": "x"}),
        )
        .await;
    assert!(err.contains("workspace root"), "{err}");
    env.ok("move_path", json!({"source": "d", "destination": "e"}))
        .await;
    assert_eq!(env.get("e/x.txt"), "x");
}

#[tokio::test]
async fn delete_files_and_directories() {
    let env = Env::new();
    env.put("f.txt", "x");
    env.put("full/a/b/c.txt", "c");
    env.put("full/z.txt", "z");
    std::fs::create_dir(env.ws().join("empty")).unwrap();
    env.ok("delete_path", json!({"path": "f.txt"})).await;
    assert!(!env.ws().join("f.txt").exists());
    env.ok("delete_path", json!({"path": "empty"})).await;
    assert!(!env.ws().join("empty").exists());
    let err = env.err("delete_path", json!({"path": "full"})).await;
    assert!(
        err.contains("not empty") && err.contains("recursive=true"),
        "{err}"
    );
    assert!(env.ws().join("full/a/b/c.txt").exists());
    let out = env
        .ok("delete_path", json!({"path": "full", "recursive": true}))
        .await;
    assert!(out.contains("4 entries"), "{out}");
    assert!(!env.ws().join("full").exists());
    let err = env.err("delete_path", json!({"path": "f.txt"})).await;
    assert!(err.contains("does not exist"), "{err}");
    for root in [".", "", "/workspace", "/workspace/", "./"] {
        let err = env
            .err("delete_path", json!({"path": root, "recursive": true}))
            .await;
        assert!(err.contains("workspace root"), "{root:?}: {err}");
    }
    let err = env.err("delete_path", json!({"path": "sub/.."})).await;
    assert!(
        err.contains("must end in a file or directory name"),
        "{err}"
    );
    assert!(env.ws().is_dir());
}

/// Names are bytes on disk, not always UTF-8 (made by the shell, or cloned): they are
/// listed, searched and deleted by those bytes, and printed with the others escaped.
#[tokio::test]
async fn names_that_are_not_utf8_are_listed_and_deleted() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let env = Env::new();
    let d = env.ws().join("d");
    std::fs::create_dir_all(d.join(OsStr::from_bytes(b"sub\xfe"))).unwrap();
    std::fs::write(d.join(OsStr::from_bytes(b"\xff")), "x\n").unwrap();
    std::fs::write(d.join(OsStr::from_bytes(b"sub\xfe/a\xffb.txt")), "y\n").unwrap();
    let out = env
        .ok("list_directory", json!({"path": "d", "recursive": true}))
        .await;
    assert_eq!(out, "sub\\xFE/\nsub\\xFE/a\\xFFb.txt\n\\xFF", "{out}");
    let out = env
        .ok(
            "search_files",
            json!({"path": "d", "glob": "*.txt", "content_regex": "y"}),
        )
        .await;
    assert_eq!(out, "d/sub\\xFE/a\\xFFb.txt:1: y", "{out}");
    let out = env
        .ok("delete_path", json!({"path": "d", "recursive": true}))
        .await;
    assert!(out.contains("the 3 entries"), "{out}");
    assert!(!d.exists());
}

// ---------------------------------------------------------------------------------------
// Escapes: every attempt fails (or, for link deletion, touches only the link), and nothing
// outside the workspace is read, changed or created.

/// Runs `tool` with `args`, asserts it failed, that its text does not leak the canary, and
/// that nothing outside the workspace changed.
async fn refused(env: &Env, tool: &str, args: Value) -> String {
    let before = env.snapshot();
    let out = env.call(tool, args.clone()).await;
    let text = out.content.join("\n");
    assert!(
        out.is_error,
        "escape attempt {tool} {args} succeeded: {text}"
    );
    assert!(!text.contains("top secret"), "{tool} {args} leaked: {text}");
    assert_eq!(
        before,
        env.snapshot(),
        "{tool} {args} changed something outside"
    );
    text
}

/// The refusal names the escape: outside the workspace, or (for a path through a
/// symbolic link, which the worker never follows, escaping or not) the link.
fn outside_msg(text: &str) {
    assert!(
        text.contains("outside the workspace") || text.contains("goes through the symbolic link"),
        "{text}"
    );
}

#[tokio::test]
async fn escape_battery() {
    let env = Env::new();
    let out_dir = env.outside();
    let canary = out_dir.join("canary.txt");
    env.put("inside.txt", "inside");
    std::fs::create_dir(env.ws().join("sub")).unwrap();
    env.link("etc", "/etc");
    env.link("up", "..");
    env.link("chain1", "chain2");
    env.link("chain2", "sub/chain3");
    symlink("../../../../outside", env.ws().join("sub/chain3")).unwrap();
    env.link("abs_canary", &canary);
    env.link("outlink", &out_dir);
    env.link("rel_out", "../../../outside");

    // 1-4: plain traversal and absolute paths.
    outside_msg(
        &refused(
            &env,
            "read_file",
            json!({"path": "../../../outside/canary.txt"}),
        )
        .await,
    );
    outside_msg(&refused(&env, "read_file", json!({"path": "../../etc/passwd"})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "/etc/passwd"})).await);
    outside_msg(
        &refused(
            &env,
            "read_file",
            json!({"path": "/workspace/../../../outside/canary.txt"}),
        )
        .await,
    );
    outside_msg(&refused(&env, "list_directory", json!({"path": "/workspace/../.."})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": canary})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "sub/../../s2/other.txt"})).await);
    // 5-9: symlinks: absolute, to .., chains, to a file outside.
    outside_msg(&refused(&env, "read_file", json!({"path": "etc/passwd"})).await);
    outside_msg(&refused(&env, "list_directory", json!({"path": "up"})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "up/s2/other.txt"})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "chain1/canary.txt"})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "abs_canary"})).await);
    outside_msg(&refused(&env, "read_file", json!({"path": "rel_out/canary.txt"})).await);
    // 10-11: /proc magic links.
    outside_msg(
        &refused(
            &env,
            "read_file",
            json!({"path": "/proc/self/root/etc/passwd"}),
        )
        .await,
    );
    outside_msg(&refused(&env, "list_directory", json!({"path": "/proc/self/cwd"})).await);
    env.link("proc_root", "/proc/self/root");
    outside_msg(&refused(&env, "read_file", json!({"path": "proc_root/etc/passwd"})).await);
    // 12-14: writes through a symlinked parent, onto a link to an outside file.
    outside_msg(
        &refused(
            &env,
            "write_file",
            json!({"path": "outlink/new.txt", "content": "x"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "write_file",
            json!({"path": "outlink/canary.txt", "content": "pwned"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "write_file",
            json!({"path": "rel_out/dir/new/x.txt", "content": "x"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "write_file",
            json!({"path": out_dir.join("new.txt"), "content": "x"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "write_file",
            json!({"path": "../s2/other.txt", "content": "x"}),
        )
        .await,
    );
    refused(
        &env,
        "edit_file",
        json!({"path": "abs_canary", "edits": [{"old_text": "top", "new_text": "pwned"}]}),
    )
    .await;
    outside_msg(
        &refused(
            &env,
            "edit_file",
            json!({"path": "outlink/canary.txt", "edits": [{"old_text": "top", "new_text": "x"}]}),
        )
        .await,
    );
    // 15-16: moves into and out of a symlinked directory.
    outside_msg(
        &refused(
            &env,
            "move_path",
            json!({"source": "inside.txt", "destination": "outlink/moved.txt"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "move_path",
            json!({"source": "outlink/canary.txt", "destination": "stolen.txt"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "move_path",
            json!({"source": "inside.txt", "destination": "../../../outside/x"}),
        )
        .await,
    );
    assert_eq!(env.get("inside.txt"), "inside");
    assert!(!env.ws().join("stolen.txt").exists());
    // 17: create_directory through a link.
    outside_msg(&refused(&env, "create_directory", json!({"path": "outlink/newdir"})).await);
    outside_msg(&refused(&env, "create_directory", json!({"path": "up/newdir"})).await);
    outside_msg(
        &refused(
            &env,
            "create_directory",
            json!({"path": "../../../outside/newdir"}),
        )
        .await,
    );
    // 18: delete through links and traversal.
    outside_msg(&refused(&env, "delete_path", json!({"path": "outlink/canary.txt"})).await);
    outside_msg(
        &refused(
            &env,
            "delete_path",
            json!({"path": "../../../outside/canary.txt"}),
        )
        .await,
    );
    outside_msg(
        &refused(
            &env,
            "delete_path",
            json!({"path": "up/s2", "recursive": true}),
        )
        .await,
    );
    // 19: info, search and list through links.
    outside_msg(&refused(&env, "get_file_info", json!({"path": "outlink/canary.txt"})).await);
    outside_msg(&refused(&env, "search_files", json!({"path": "outlink"})).await);
    outside_msg(&refused(&env, "list_directory", json!({"path": "outlink"})).await);
    outside_msg(&refused(&env, "list_directory", json!({"path": "rel_out/dir"})).await);

    // Search and list see the links but never follow them.
    let before = env.snapshot();
    let out = env
        .ok(
            "search_files",
            json!({"path": ".", "content_regex": "secret"}),
        )
        .await;
    assert!(out.starts_with("no lines matched"), "{out}");
    let out = env
        .ok("search_files", json!({"path": ".", "glob": "*.txt"}))
        .await;
    assert!(
        !out.contains("canary") && !out.contains("only-outside"),
        "{out}"
    );
    let out = env
        .ok("list_directory", json!({"path": ".", "recursive": true}))
        .await;
    assert!(
        out.contains(&format!("outlink -> {}", out_dir.display())),
        "{out}"
    );
    assert!(
        !out.contains("outlink/") && !out.contains("only-outside"),
        "{out}"
    );
    let out = env.ok("get_file_info", json!({"path": "outlink"})).await;
    assert!(out.contains("points to: outside the workspace"), "{out}");

    // 20: deleting a link to outside deletes only the link.
    env.ok("delete_path", json!({"path": "outlink", "recursive": true}))
        .await;
    env.ok("delete_path", json!({"path": "abs_canary"})).await;
    env.ok("delete_path", json!({"path": "up", "recursive": true}))
        .await;
    assert!(std::fs::symlink_metadata(env.ws().join("outlink")).is_err());
    assert!(env.ws().is_dir());
    assert!(env.tmp.path().join("ws/alice/s2/other.txt").exists());
    assert_eq!(before, env.snapshot());
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), SECRET);

    // A directory holding a link to outside, deleted recursively: the outside stays.
    std::fs::create_dir(env.ws().join("holder")).unwrap();
    symlink(&out_dir, env.ws().join("holder/out")).unwrap();
    env.ok("delete_path", json!({"path": "holder", "recursive": true}))
        .await;
    assert_eq!(before, env.snapshot());
    assert!(env.temp_leftovers().is_empty());
}

#[tokio::test]
async fn hard_link_to_outside_is_never_written_through() {
    let env = Env::new();
    let canary = env.outside().join("canary.txt");
    std::fs::hard_link(&canary, env.ws().join("hl.txt")).unwrap();
    let before = env.snapshot();

    // Reading a hard-linked file is allowed.
    assert_eq!(env.ok("read_file", json!({"path": "hl.txt"})).await, SECRET);
    env.ok(
        "write_file",
        json!({"path": "hl.txt", "content": "replaced"}),
    )
    .await;
    assert_eq!(env.get("hl.txt"), "replaced");
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), SECRET);
    assert_eq!(before, env.snapshot());

    std::fs::remove_file(env.ws().join("hl.txt")).unwrap();
    std::fs::hard_link(&canary, env.ws().join("hl2.txt")).unwrap();
    let before = env.snapshot();
    env.ok(
        "edit_file",
        json!({"path": "hl2.txt", "edits": [{"old_text": "top", "new_text": "no"}]}),
    )
    .await;
    assert_eq!(env.get("hl2.txt"), "no secret canary\n");
    assert_eq!(std::fs::read_to_string(&canary).unwrap(), SECRET);
    assert_eq!(before, env.snapshot());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn racing_symlink_swaps_never_escape() {
    let env = Env::new();
    // "d" is a real directory; "swap" a link to outside. A thread exchanges them atomically.
    env.put("d/canary.txt", "inside\n");
    env.link("swap", env.outside());
    let before = env.snapshot();
    let ws = env.ws();
    let stop = Arc::new(AtomicBool::new(false));
    let racer = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let dir = rustix::fs::open(
                &ws,
                rustix::fs::OFlags::RDONLY | rustix::fs::OFlags::DIRECTORY,
                rustix::fs::Mode::empty(),
            )
            .unwrap();
            let mut swaps = 0u64;
            while !stop.load(Ordering::Relaxed) {
                rustix::fs::renameat_with(
                    &dir,
                    "d",
                    &dir,
                    "swap",
                    rustix::fs::RenameFlags::EXCHANGE,
                )
                .unwrap();
                swaps += 1;
            }
            swaps
        })
    };

    let mut ok_reads = 0;
    let mut refused_reads = 0;
    let mut ok_writes = 0;
    let started = Instant::now();
    let mut rounds = 0;
    while rounds < 300 || started.elapsed() < Duration::from_millis(500) {
        rounds += 1;
        let out = env.call("read_file", json!({"path": "d/canary.txt"})).await;
        let text = out.content.join("\n");
        assert!(!text.contains("top secret"), "read outside: {text}");
        if out.is_error {
            refused_reads += 1;
        } else {
            ok_reads += 1;
        }
        let out = env
            .call(
                "write_file",
                json!({"path": "d/canary.txt", "content": "inside\n"}),
            )
            .await;
        if !out.is_error {
            ok_writes += 1;
        }
        let out = env
            .call(
                "write_file",
                json!({"path": "d/new/file.txt", "content": "x"}),
            )
            .await;
        let _ = out;
        let out = env
            .call("list_directory", json!({"path": "d", "recursive": true}))
            .await;
        assert!(
            !out.content.join("").contains("only-outside"),
            "listed outside"
        );
        let out = env
            .call(
                "search_files",
                json!({"path": ".", "content_regex": "secret"}),
            )
            .await;
        assert!(
            !out.content.join("").contains("top secret"),
            "searched outside"
        );
        if started.elapsed() > Duration::from_secs(20) {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let swaps = racer.join().unwrap();
    assert!(swaps > 0);
    assert_eq!(
        before,
        env.snapshot(),
        "something outside changed during the race"
    );
    assert_eq!(
        std::fs::read_to_string(env.outside().join("canary.txt")).unwrap(),
        SECRET
    );
    assert!(
        env.temp_leftovers().is_empty(),
        "{:?}",
        env.temp_leftovers()
    );
    // Both states were exercised: some calls hit the real directory.
    eprintln!(
        "race: {rounds} rounds, {swaps} swaps, reads ok {ok_reads} refused {refused_reads}, writes ok {ok_writes}"
    );
    assert!(
        ok_reads + ok_writes > 0,
        "no call ever reached the real directory"
    );
    assert!(refused_reads > 0, "no call ever met the swapped-in link");
}

#[tokio::test]
async fn cancelled_calls_stop_walking() {
    let env = Env::new();
    for i in 0..50 {
        env.put(&format!("d{i}/f.txt"), "x");
    }
    let (tx, _rx) = tokio::sync::mpsc::channel(4);
    let cancel = CancellationToken::new();
    cancel.cancel();
    let ctx = CallContext::new(
        "c".into(),
        "alice".into(),
        SessionId::parse("s1").unwrap(),
        Instant::now() + Duration::from_secs(30),
        cancel,
        tx,
    );
    let out = env
        .set
        .get("search_files")
        .unwrap()
        .execute(json!({"path": "."}), ctx)
        .await;
    assert!(
        out.content.join("").contains("stopped early"),
        "{:?}",
        out.content
    );
}

// ---------------------------------------------------------------------------------------
// Memory: edit_file refuses growth before it allocates

/// What one attack may add to this process's peak resident memory. The other tests of
/// this binary run beside it in the same process, so the bound leaves them room; the
/// tight bound (64 MiB) is asserted on a worker process of its own, through `airlock up`,
/// in tests/e2e/adversarial_workers.rs. Unbounded, these attacks grew the process by
/// 293 MiB (edits) to 1144 MiB (SQLite blobs).
const MAX_GROWTH: u64 = 256 << 20;

/// The memory measurements of this binary run one at a time: each resets the process's
/// peak, which another measuring test would see.
static MEMORY_LOCK: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A field of /proc/self/status in bytes (`VmHWM`, `VmRSS`).
fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("unreadable {line:?}"));
    kib * 1024
}

/// Runs one `edit_file` call that must fail with every one of `expect` in its message,
/// while this process's peak resident memory grows by less than [`MAX_GROWTH`].
async fn refused_edit(env: &Env, args: Value, expect: &[&str]) {
    // Reset the peak to the current resident size (Linux 4.0 and later).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = status_bytes("VmRSS");
    let out = env.call("edit_file", args).await;
    let growth = status_bytes("VmHWM").saturating_sub(base);
    let text = out.content.join("\n");
    eprintln!("edit_file: peak resident memory +{} MiB", growth >> 20);
    assert!(out.is_error, "should fail: {text:.300}");
    for e in expect {
        assert!(text.contains(e), "{e:?} not in: {text}");
    }
    assert!(
        growth < MAX_GROWTH,
        "peak resident memory grew by {} MiB: {text}",
        growth >> 20
    );
}

#[tokio::test]
async fn edit_growth_is_refused_before_it_is_allocated() {
    let _one = MEMORY_LOCK.lock().await;
    let env = Env::new();
    let original = "a".repeat(1024);
    env.put("f.txt", &original);
    let doubling = |n: usize| -> Vec<Value> {
        (0..n)
            .map(|_| json!({"old_text": "a", "new_text": "aa", "replace_all": true}))
            .collect()
    };
    // The attack pass's payload: 17 doublings of 1 KiB (128 MiB, 210 MB before). The
    // 14th would pass the 10 MiB cap (1 KiB << 14 = 16 MiB) and is refused unbuilt.
    for dry_run in [true, false] {
        refused_edit(
            &env,
            json!({"path": "f.txt", "dry_run": dry_run, "edits": doubling(17)}),
            &[
                "edit 14",
                "16777216 bytes",
                "10485760 bytes",
                "nothing was changed",
            ],
        )
        .await;
    }
    // Many more doublings: still refused at the 14th, before anything larger is built.
    refused_edit(
        &env,
        json!({"path": "f.txt", "dry_run": true, "edits": doubling(64)}),
        &["edit 14"],
    )
    .await;
    // One edit: a long new_text times many matches (1024 × 1 MB = 1 GiB).
    let long = "b".repeat(1 << 20);
    refused_edit(
        &env,
        json!({"path": "f.txt", "dry_run": true, "edits": [
            {"old_text": "a", "new_text": long, "replace_all": true}
        ]}),
        &["edit 1:", "1073741824 bytes", "10485760 bytes"],
    )
    .await;
    // A shrinking edit first does not hide a later growth.
    refused_edit(
        &env,
        json!({"path": "f.txt", "dry_run": true, "edits": [
            {"old_text": "aa", "new_text": "a", "replace_all": true},
            {"old_text": "a", "new_text": "b".repeat(100_000), "replace_all": true}
        ]}),
        &["edit 2:", "51200000 bytes"],
    )
    .await;
    assert_eq!(env.get("f.txt"), original, "nothing was written");
    assert!(env.temp_leftovers().is_empty());
    // The worker still answers, and growth up to the cap is allowed.
    let out = env
        .ok(
            "edit_file",
            json!({"path": "f.txt", "dry_run": true, "edits": doubling(13)}),
        )
        .await;
    assert!(out.starts_with("dry run: 13 edits"), "{out:.200}");
    let out = env.ok("read_file", json!({"path": "f.txt"})).await;
    assert_eq!(out, original);
}

#[tokio::test]
async fn edit_cap_follows_max_write_bytes() {
    let env = Env::with(|c| c.max_write_bytes = 4096);
    env.put("f.txt", &"a".repeat(1024));
    let edit = |new: &str| {
        json!({"path": "f.txt", "edits": [
            {"old_text": "a", "new_text": new, "replace_all": true}
        ]})
    };
    // 1024 × 4 = 4096 bytes: exactly the cap.
    env.ok("edit_file", edit("bbbb")).await;
    assert_eq!(env.get("f.txt").len(), 4096);
    let err = env
        .err(
            "edit_file",
            json!({"path": "f.txt", "edits": [
                {"old_text": "b", "new_text": "cc", "replace_all": true}
            ]}),
        )
        .await;
    assert!(
        err.contains("8192 bytes") && err.contains("4096 bytes") && err.contains("write_file"),
        "{err}"
    );
}

// ---------------------------------------------------------------------------------------
// Control characters in file names

/// Names the test creates on disk, each with how the tools must print it.
const HOSTILE_NAMES: &[(&str, &str)] = &[
    ("x\nforged.txt", "x\\nforged.txt"),
    ("cr\rover.txt", "cr\\rover.txt"),
    ("esc\u{1b}[2Jclear", "esc\\u{1b}[2Jclear"),
    ("bidi\u{202e}txt.exe", "bidi\\u{202e}txt.exe"),
    ("iso\u{2066}late", "iso\\u{2066}late"),
    ("c1\u{85}next", "c1\\u{85}next"),
    ("del\u{7f}", "del\\u{7f}"),
    ("tab\tname", "tab\\tname"),
    ("back\\slash", "back\\\\slash"),
    // A real backslash and "n": distinct from the escaped newline above.
    ("x\\nforged.txt", "x\\\\nforged.txt"),
];

/// No control character (but the line breaks between entries) and no bidi control
/// reaches the result text.
fn assert_no_raw_controls(text: &str) {
    for c in text.chars() {
        assert!(
            c == '\n'
                || !(c.is_control()
                    || matches!(c, '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')),
            "raw {c:?} in {text:?}"
        );
    }
}

#[tokio::test]
async fn control_characters_in_names_are_escaped() {
    let env = Env::new();
    std::fs::create_dir(env.ws().join("d\nforged-dir")).unwrap();
    for (name, _) in HOSTILE_NAMES {
        std::fs::write(env.ws().join(name), "x\n").unwrap();
    }
    std::fs::write(env.ws().join("d\nforged-dir/in\u{7}bell"), "x\n").unwrap();
    env.link("link\u{1b}]0;title\u{7}", "t\nforged-target");

    let out = env
        .ok("list_directory", json!({"path": ".", "recursive": true}))
        .await;
    assert_no_raw_controls(&out);
    let lines: Vec<&str> = out.lines().collect();
    for (_, shown) in HOSTILE_NAMES {
        assert_eq!(
            lines.iter().filter(|l| **l == *shown).count(),
            1,
            "{shown} in:\n{out}"
        );
    }
    for shown in [
        "d\\nforged-dir/",
        "d\\nforged-dir/in\\u{7}bell",
        "link\\u{1b}]0;title\\u{7} -> t\\nforged-target",
    ] {
        assert_eq!(
            lines.iter().filter(|l| **l == shown).count(),
            1,
            "{shown} in:\n{out}"
        );
    }
    // One line per entry: nothing was forged.
    assert_eq!(lines.len(), HOSTILE_NAMES.len() + 3, "{out}");
    for forged in ["forged.txt", "forged-dir/", "over.txt", "forged-target"] {
        assert!(!lines.contains(&forged), "{forged} forged in:\n{out}");
    }

    let out = env.ok("search_files", json!({"path": "."})).await;
    assert_no_raw_controls(&out);
    let lines: Vec<&str> = out.lines().collect();
    for (_, shown) in HOSTILE_NAMES {
        assert_eq!(lines.iter().filter(|l| **l == *shown).count(), 1, "{out}");
    }
    assert!(lines.contains(&"d\\nforged-dir/in\\u{7}bell"), "{out}");
    let out = env
        .ok(
            "search_files",
            json!({"path": ".", "glob": "x*", "content_regex": "x"}),
        )
        .await;
    assert_no_raw_controls(&out);
    // Sorted by the names on disk: the newline (0x0a) before the backslash (0x5c).
    assert_eq!(out, "x\\nforged.txt:1: x\nx\\\\nforged.txt:1: x", "{out}");

    let out = env
        .ok("get_file_info", json!({"path": "esc\u{1b}[2Jclear"}))
        .await;
    assert_no_raw_controls(&out);
    assert!(out.starts_with("path: esc\\u{1b}[2Jclear\n"), "{out}");
    let out = env
        .ok("get_file_info", json!({"path": "link\u{1b}]0;title\u{7}"}))
        .await;
    assert_no_raw_controls(&out);
    assert!(out.contains("target: t\\nforged-target\n"), "{out}");

    // Errors and confirmations name paths escaped too.
    let err = env
        .err("read_file", json!({"path": "gone\u{1b}[2J\n"}))
        .await;
    assert_no_raw_controls(&err);
    assert!(err.contains("gone\\u{1b}[2J\\n"), "{err}");
    let out = env
        .ok(
            "move_path",
            json!({"source": "cr\rover.txt", "destination": "moved\u{202e}"}),
        )
        .await;
    assert_no_raw_controls(&out);
    assert!(out.contains("cr\\rover.txt to moved\\u{202e}"), "{out}");
    let out = env
        .ok(
            "delete_path",
            json!({"path": "d\nforged-dir", "recursive": true}),
        )
        .await;
    assert_no_raw_controls(&out);
    assert!(out.contains("d\\nforged-dir"), "{out}");
    let out = env
        .ok(
            "edit_file",
            json!({"path": "tab\tname", "dry_run": true, "edits": [{"old_text": "x", "new_text": "y"}]}),
        )
        .await;
    assert!(
        out.contains("--- a/tab\\tname\n+++ b/tab\\tname\n"),
        "{out}"
    );
    let out = env
        .ok("write_file", json!({"path": "new\u{1b}", "content": "z"}))
        .await;
    assert_no_raw_controls(&out);
    assert!(out.contains("new\\u{1b}"), "{out}");
}
