//! Every fs tool through the orchestrator, checked against the disk.

use serde_json::json;

use crate::support::Airlock;

#[tokio::test]
async fn write_read_edit_list_search_move_delete() {
    let airlock = Airlock::start().await;
    let ws = airlock.workspace("work");
    let call = |tool: &'static str, input| {
        let airlock = &airlock;
        async move { airlock.call_in("work", tool, input).await }
    };

    let (err, text, _) = call("create_directory", json!({"path": "src/app"})).await;
    assert!(!err, "{text}");
    assert!(ws.join("src/app").is_dir());

    let (err, text, _) = call(
        "write_file",
        json!({"path": "src/app/main.txt", "content": "alpha\nbeta\ngamma\n"}),
    )
    .await;
    assert!(!err, "{text}");
    assert_eq!(
        std::fs::read_to_string(ws.join("src/app/main.txt")).expect("file"),
        "alpha\nbeta\ngamma\n"
    );

    let (err, text, _) = call("read_file", json!({"path": "src/app/main.txt"})).await;
    assert!(!err);
    assert_eq!(text, "alpha\nbeta\ngamma\n");

    // Absolute paths inside the workspace, as the shell sandbox sees it, are accepted.
    let (err, text, _) = call("read_file", json!({"path": "/workspace/src/app/main.txt"})).await;
    assert!(!err, "{text}");
    assert!(text.contains("beta"));

    let (err, text, _) = call(
        "read_file",
        json!({"path": "src/app/main.txt", "offset": 2, "limit": 1}),
    )
    .await;
    assert!(!err, "{text}");
    assert!(
        text.contains("beta") && !text.contains("alpha") && !text.contains("gamma"),
        "{text}"
    );

    let (err, diff, _) = call(
        "edit_file",
        json!({"path": "src/app/main.txt", "edits": [{"old_text": "beta", "new_text": "BETA"}], "dry_run": true}),
    )
    .await;
    assert!(!err, "{diff}");
    assert!(diff.contains("-beta") && diff.contains("+BETA"), "{diff}");
    assert!(
        std::fs::read_to_string(ws.join("src/app/main.txt"))
            .expect("file")
            .contains("beta"),
        "dry run wrote"
    );

    let (err, diff, _) = call(
        "edit_file",
        json!({"path": "src/app/main.txt", "edits": [{"old_text": "beta", "new_text": "BETA"}, {"old_text": "gamma", "new_text": "GAMMA"}]}),
    )
    .await;
    assert!(!err, "{diff}");
    assert!(diff.contains("+BETA") && diff.contains("+GAMMA"));
    assert_eq!(
        std::fs::read_to_string(ws.join("src/app/main.txt")).expect("file"),
        "alpha\nBETA\nGAMMA\n"
    );

    // All or nothing: the second edit does not match, so the first is not applied either.
    let (err, text, _) = call(
        "edit_file",
        json!({"path": "src/app/main.txt", "edits": [{"old_text": "alpha", "new_text": "ALPHA"}, {"old_text": "delta", "new_text": "x"}]}),
    )
    .await;
    assert!(err, "{text}");
    assert_eq!(
        std::fs::read_to_string(ws.join("src/app/main.txt")).expect("file"),
        "alpha\nBETA\nGAMMA\n"
    );

    let (err, text, _) = call("list_directory", json!({"path": ".", "recursive": true})).await;
    assert!(!err);
    assert!(text.contains("src") && text.contains("main.txt"), "{text}");

    let (err, text, _) = call(
        "search_files",
        json!({"path": ".", "content_regex": "GAM+A"}),
    )
    .await;
    assert!(!err);
    assert!(text.contains("main.txt"), "{text}");
    let (err, text, _) = call("search_files", json!({"path": ".", "glob": "*.txt"})).await;
    assert!(!err);
    assert!(text.contains("main.txt"), "{text}");

    let (err, text, _) = call("get_file_info", json!({"path": "src/app/main.txt"})).await;
    assert!(!err, "{text}");
    // "alpha\nBETA\nGAMMA\n": 17 bytes in 3 lines.
    assert!(text.lines().any(|l| l == "size: 17 bytes"), "{text}");
    assert!(text.lines().any(|l| l == "type: file"), "{text}");

    let (err, text, _) = call(
        "move_path",
        json!({"source": "src/app/main.txt", "destination": "moved.txt"}),
    )
    .await;
    assert!(!err, "{text}");
    assert!(ws.join("moved.txt").is_file() && !ws.join("src/app/main.txt").exists());

    // Moving onto an existing path fails and changes nothing.
    std::fs::write(ws.join("other.txt"), "keep").expect("write");
    let (err, _, _) = call(
        "move_path",
        json!({"source": "moved.txt", "destination": "other.txt"}),
    )
    .await;
    assert!(err);
    assert_eq!(
        std::fs::read_to_string(ws.join("other.txt")).expect("file"),
        "keep"
    );

    let (err, text, _) = call("delete_path", json!({"path": "src"})).await;
    assert!(err, "non-empty directory needs recursive: {text}");
    assert!(ws.join("src").exists());
    let (err, text, _) = call("delete_path", json!({"path": "src", "recursive": true})).await;
    assert!(!err, "{text}");
    assert!(!ws.join("src").exists());

    // No temporary files were left behind by the atomic writes.
    let leftovers: Vec<_> = std::fs::read_dir(&ws)
        .expect("workspace")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("tmp"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[tokio::test]
async fn sessions_have_separate_workspaces_and_binary_files_are_refused() {
    let airlock = Airlock::start().await;
    let (err, _, _) = airlock
        .call_in(
            "one",
            "write_file",
            json!({"path": "x.txt", "content": "one"}),
        )
        .await;
    assert!(!err);
    let (err, text, _) = airlock
        .call_in("two", "read_file", json!({"path": "x.txt"}))
        .await;
    assert!(err, "session two saw session one's file: {text}");
    assert!(airlock.workspace("one").join("x.txt").is_file());

    std::fs::write(
        airlock.workspace("one").join("blob.bin"),
        [0u8, 159, 146, 150, 0, 1],
    )
    .expect("write");
    let (err, text, _) = airlock
        .call_in("one", "read_file", json!({"path": "blob.bin"}))
        .await;
    assert!(err);
    assert!(text.contains("binary"), "{text}");
}

#[tokio::test]
async fn large_reads_are_capped_with_a_note() {
    let airlock = Airlock::start().await;
    let ws = airlock.workspace("default");
    std::fs::create_dir_all(&ws).expect("workspace");
    let line = "x".repeat(99) + "\n";
    std::fs::write(ws.join("big.txt"), line.repeat(10_000)).expect("write"); // ~1 MB
    let (err, text, _) = airlock.call("read_file", json!({"path": "big.txt"})).await;
    assert!(!err);
    assert!(
        text.len() <= 262_144 + 1024,
        "read_file returned {} bytes",
        text.len()
    );
    let first_line = text.lines().next().expect("first line");
    assert!(
        first_line.contains("offset"),
        "truncation note in the first line: {first_line}"
    );
}
