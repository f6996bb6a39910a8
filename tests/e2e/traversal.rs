//! Escape attempts through every path-taking fs tool. Each must fail, and nothing outside
//! the workspace may be read or changed.

use std::collections::BTreeSet;
use std::os::unix::fs::symlink;

use serde_json::{Value, json};

use crate::support::{Airlock, snapshot};

const SECRET: &str = "TOP-SECRET-CANARY";

#[tokio::test]
async fn traversal_battery() {
    let airlock = Airlock::start().await;
    let ws = airlock.workspace("default");
    std::fs::create_dir_all(&ws).expect("workspace");
    // The outside world: a canary directory beside the workspaces, and a sibling session.
    let outside = airlock.data_dir().join("outside");
    std::fs::create_dir_all(&outside).expect("outside");
    std::fs::write(outside.join("secret.txt"), SECRET).expect("canary");
    let sibling = airlock.workspace("other");
    std::fs::create_dir_all(&sibling).expect("sibling");
    std::fs::write(sibling.join("secret.txt"), SECRET).expect("canary");

    // Traps planted inside the workspace.
    symlink(&outside, ws.join("link_out")).expect("symlink");
    symlink("../../../outside", ws.join("rel_out")).expect("symlink");
    symlink(outside.join("secret.txt"), ws.join("file_link")).expect("symlink");
    symlink("/etc", ws.join("etc_link")).expect("symlink");
    symlink("chain2", ws.join("chain1")).expect("symlink");
    symlink("link_out/secret.txt", ws.join("chain2")).expect("symlink");
    symlink("/proc/self/root", ws.join("proc_root")).expect("symlink");
    std::fs::hard_link(outside.join("secret.txt"), ws.join("hard.txt")).expect("hard link");

    let before_outside = snapshot(&outside);
    let before_sibling = snapshot(&sibling);
    let before_etc = std::fs::read("/etc/passwd").expect("passwd");

    let attempts: Vec<(&str, Value)> = vec![
        ("read_file", json!({"path": "../other/secret.txt"})),
        ("read_file", json!({"path": "../../../outside/secret.txt"})),
        ("read_file", json!({"path": "/etc/passwd"})),
        ("read_file", json!({"path": "/workspace/../../etc/passwd"})),
        ("read_file", json!({"path": "link_out/secret.txt"})),
        ("read_file", json!({"path": "rel_out/secret.txt"})),
        ("read_file", json!({"path": "file_link"})),
        ("read_file", json!({"path": "etc_link/passwd"})),
        ("read_file", json!({"path": "chain1"})),
        ("read_file", json!({"path": "proc_root/etc/passwd"})),
        ("read_file", json!({"path": "/proc/self/root/etc/passwd"})),
        (
            "read_file",
            json!({"path": "/proc/self/cwd/../outside/secret.txt"}),
        ),
        (
            "write_file",
            json!({"path": "../other/secret.txt", "content": "pwned"}),
        ),
        (
            "write_file",
            json!({"path": "link_out/secret.txt", "content": "pwned"}),
        ),
        (
            "write_file",
            json!({"path": "link_out/new.txt", "content": "pwned"}),
        ),
        (
            "write_file",
            json!({"path": "/tmp/airlock-escape.txt", "content": "pwned"}),
        ),
        (
            "edit_file",
            json!({"path": "file_link", "edits": [{"old_text": "TOP", "new_text": "PWN"}]}),
        ),
        (
            "edit_file",
            json!({"path": "rel_out/secret.txt", "edits": [{"old_text": "TOP", "new_text": "PWN"}]}),
        ),
        ("list_directory", json!({"path": ".."})),
        ("list_directory", json!({"path": "link_out"})),
        ("list_directory", json!({"path": "/"})),
        (
            "search_files",
            json!({"path": "link_out", "content_regex": "SECRET"}),
        ),
        (
            "search_files",
            json!({"path": "..", "content_regex": "SECRET"}),
        ),
        ("get_file_info", json!({"path": "link_out/secret.txt"})),
        ("get_file_info", json!({"path": "../../outside"})),
        ("create_directory", json!({"path": "link_out/newdir"})),
        ("create_directory", json!({"path": "../../escape_dir"})),
        (
            "move_path",
            json!({"source": "link_out/secret.txt", "destination": "stolen.txt"}),
        ),
        (
            "move_path",
            json!({"source": "../other/secret.txt", "destination": "stolen.txt"}),
        ),
        (
            "move_path",
            json!({"source": "hard.txt", "destination": "../other/planted.txt"}),
        ),
        ("delete_path", json!({"path": "link_out/secret.txt"})),
        (
            "delete_path",
            json!({"path": "../other", "recursive": true}),
        ),
        ("delete_path", json!({"path": "/etc/passwd"})),
    ];
    // The battery covers every tool that takes a workspace path (`path`, or `source` and
    // `destination`), as the catalog lists them.
    let (status, catalog) = airlock.get("/v1/tools").await;
    assert_eq!(status, 200, "{catalog}");
    let path_tools: BTreeSet<&str> = catalog["tools"]
        .as_array()
        .expect("tools")
        .iter()
        .filter(|t| {
            let properties = &t["input_schema"]["properties"];
            ["path", "source", "destination"]
                .iter()
                .any(|p| properties.get(*p).is_some())
        })
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    let attempted: BTreeSet<&str> = attempts.iter().map(|(tool, _)| *tool).collect();
    assert_eq!(
        attempted, path_tools,
        "every path-taking tool gets escape attempts"
    );
    for (tool, input) in &attempts {
        let (is_error, text, _) = airlock.call(tool, input.clone()).await;
        assert!(is_error, "{tool} {input} succeeded: {text}");
        assert!(
            !text.contains(SECRET),
            "{tool} {input} leaked the secret: {text}"
        );
        assert!(
            !text.contains("root:x:0:0"),
            "{tool} {input} leaked /etc/passwd: {text}"
        );
    }

    // Search that starts inside does not follow the symlink out either.
    let (is_error, text, _) = airlock
        .call(
            "search_files",
            json!({"path": ".", "content_regex": "SECRET"}),
        )
        .await;
    assert!(!is_error, "{text}");
    assert!(
        !text.contains("link_out/secret.txt"),
        "search followed a symlink out: {text}"
    );
    // The one match is the hard link planted in the workspace (a name of its own there);
    // none comes through link_out, rel_out, file_link, chain1 or proc_root.
    assert_eq!(text, "hard.txt:1: TOP-SECRET-CANARY", "{text}");

    // Writing to a hard-linked file replaces the workspace's name, not the shared inode.
    let (is_error, text, _) = airlock
        .call("write_file", json!({"path": "hard.txt", "content": "mine"}))
        .await;
    assert!(!is_error, "{text}");
    assert_eq!(
        std::fs::read_to_string(ws.join("hard.txt")).expect("read"),
        "mine"
    );

    // Deleting a symlink removes the link, never its target.
    let (is_error, text, _) = airlock
        .call("delete_path", json!({"path": "link_out"}))
        .await;
    assert!(!is_error, "{text}");
    assert!(!ws.join("link_out").exists());

    assert_eq!(
        snapshot(&outside),
        before_outside,
        "something outside the workspace changed"
    );
    assert_eq!(
        snapshot(&sibling),
        before_sibling,
        "another session's workspace changed"
    );
    assert_eq!(std::fs::read("/etc/passwd").expect("passwd"), before_etc);
    assert!(!std::path::Path::new("/tmp/airlock-escape.txt").exists());
    assert!(!airlock.data_dir().join("escape_dir").exists());
    assert!(!airlock.data_dir().join("workspaces/escape_dir").exists());
}
