//! The Cedar gate (`airlock_policy::authz`): decisions, approvals, visibility, errors.
#![cfg(feature = "cedar")]
#![allow(clippy::unwrap_used, clippy::expect_used, reason = "test code")]

use std::path::{Path, PathBuf};

use airlock_policy::authz::{
    ApprovalKnob, Authorizer, CallRequest, DEFAULT_POLICY_SOURCE, Decision, PolicyError,
    PrincipalRef,
};
use airlock_policy::{ToolAnnotations, ToolDefinition};
use serde_json::{Value, json};

fn tool(name: &str) -> ToolDefinition {
    let (read_only, destructive, idempotent, open_world) = match name {
        "read_file" | "list_directory" | "search_files" | "get_file_info" | "list_databases"
        | "list_tables" | "describe_table" | "query_database" => (true, false, true, false),
        "fetch_url" => (true, false, true, true),
        "http_request" => (false, false, false, true),
        "create_directory" => (false, false, true, false),
        _ => (false, true, false, false),
    };
    ToolDefinition {
        name: name.to_owned(),
        title: name.to_owned(),
        description: String::new(),
        // As the worker would define it: the policy derives the call's context from it.
        input_schema: airlock_policy::authz::expected_input_schema(name)
            .unwrap_or_else(|| json!({"type": "object"})),
        annotations: ToolAnnotations {
            read_only,
            destructive,
            idempotent,
            open_world,
        },
    }
}

fn roles(names: &[&str]) -> Vec<String> {
    names.iter().map(|&name| name.to_owned()).collect()
}

fn load(policy: &str, knob: ApprovalKnob) -> Authorizer {
    Authorizer::from_sources(policy, "test.cedar", knob).unwrap_or_else(|error| panic!("{error}"))
}

/// The default policy followed by `extra`.
fn with_default(extra: &str) -> String {
    format!("{DEFAULT_POLICY_SOURCE}\n{extra}")
}

struct Call<'a> {
    principal: &'a str,
    roles: Vec<String>,
    tool: ToolDefinition,
    arguments: Value,
    session: &'a str,
    workspace: Option<&'a Path>,
}

fn call<'a>(
    principal: &'a str,
    role_names: &[&str],
    tool_name: &str,
    arguments: Value,
) -> Call<'a> {
    Call {
        principal,
        roles: roles(role_names),
        tool: tool(tool_name),
        arguments,
        session: "s1",
        workspace: None,
    }
}

fn decide(authorizer: &Authorizer, call: &Call<'_>) -> Decision {
    authorizer.decide(&CallRequest {
        principal: call.principal,
        roles: &call.roles,
        tool: &call.tool,
        arguments: &call.arguments,
        session_id: call.session,
        workspace: call.workspace,
    })
}

fn agent(tool_name: &str, arguments: Value) -> Call<'static> {
    call("alice", &["agent"], tool_name, arguments)
}

#[track_caller]
fn assert_allow(decision: &Decision) {
    assert_eq!(decision, &Decision::Allow);
}

#[track_caller]
fn assert_approval(decision: &Decision, reason_part: &str) {
    match decision {
        Decision::RequireApproval { reasons, .. } => assert!(
            reasons.iter().any(|reason| reason.contains(reason_part)),
            "no reason contains {reason_part:?}: {reasons:?}"
        ),
        other => panic!("expected approval ({reason_part}), got {other:?}"),
    }
}

#[track_caller]
fn assert_deny(decision: &Decision, reason_part: &str) {
    match decision {
        Decision::Deny { reasons } => assert!(
            reasons.iter().any(|reason| reason.contains(reason_part)),
            "no reason contains {reason_part:?}: {reasons:?}"
        ),
        other => panic!("expected deny ({reason_part}), got {other:?}"),
    }
}

fn examples_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy/policies/examples")
}

fn example(name: &str) -> String {
    std::fs::read_to_string(examples_dir().join(name)).unwrap()
}

// ---------------------------------------------------------------- decisions

#[test]
fn forbid_wins_over_permit() {
    let authorizer = load(
        r#"
        @id("all") permit (principal, action, resource);
        @id("no-read") forbid (principal, action == Airlock::Action::"read_file", resource);
        "#,
        ApprovalKnob::off(),
    );
    assert_deny(
        &decide(&authorizer, &agent("read_file", json!({"path": "a"}))),
        "forbidden by policy `no-read`",
    );
    assert_allow(&decide(
        &authorizer,
        &agent("list_directory", json!({"path": "."})),
    ));
}

#[test]
fn forbid_wins_over_an_approval_permit() {
    let authorizer = load(
        r#"
        @id("with-approval") @approval("required")
        permit (principal, action, resource);
        @id("no-sql") @reason("no sql today")
        forbid (principal, action == Airlock::Action::"execute_sql", resource);
        "#,
        ApprovalKnob::default(),
    );
    let decision = decide(
        &authorizer,
        &agent(
            "execute_sql",
            json!({"database": "main", "sql": "delete from t"}),
        ),
    );
    assert_deny(&decision, "forbidden by policy `no-sql`: no sql today");
    assert_eq!(decision.reasons().len(), 1, "{decision:?}");
}

#[test]
fn no_permit_means_deny() {
    let authorizer = load(
        r#"@id("agents") permit (principal in Airlock::Role::"agent", action, resource);"#,
        ApprovalKnob::off(),
    );
    let decision = decide(
        &authorizer,
        &call("bob", &["approver"], "read_file", json!({"path": "a"})),
    );
    assert_deny(
        &decision,
        "no policy permits principal `bob` to call `read_file`",
    );
    let empty = load("// nothing\n", ApprovalKnob::off());
    assert_deny(
        &decide(&empty, &agent("read_file", json!({"path": "a"}))),
        "no policy permits principal `alice`",
    );
}

#[test]
fn default_policy_permits_agents_and_admins_but_not_bare_approvers() {
    let authorizer = Authorizer::default_policy(ApprovalKnob::off()).unwrap();
    let read = json!({"path": "src/main.rs"});
    assert_allow(&decide(
        &authorizer,
        &call("a", &["agent"], "read_file", read.clone()),
    ));
    assert_allow(&decide(
        &authorizer,
        &call("b", &["admin"], "read_file", read.clone()),
    ));
    assert_allow(&decide(
        &authorizer,
        &call("c", &["approver", "agent"], "read_file", read.clone()),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &call("d", &["approver"], "read_file", read.clone()),
        ),
        "no policy permits principal `d`",
    );
    assert_deny(
        &decide(&authorizer, &call("e", &[], "read_file", read)),
        "no policy permits",
    );
    assert!(
        authorizer.warnings().is_empty(),
        "{:?}",
        authorizer.warnings()
    );
}

#[test]
fn role_and_principal_rules() {
    let authorizer = load(&with_default(&example("roles.cedar")), ApprovalKnob::off());
    // agents never delete, admins may
    assert_deny(
        &decide(&authorizer, &agent("delete_path", json!({"path": "src/x"}))),
        "agents-never-delete",
    );
    assert_allow(&decide(
        &authorizer,
        &call(
            "root",
            &["agent", "admin"],
            "delete_path",
            json!({"path": "src/x"}),
        ),
    ));
    // a bare approver may read, not write
    assert_allow(&decide(
        &authorizer,
        &call("ann", &["approver"], "read_file", json!({"path": "x"})),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &call(
                "ann",
                &["approver"],
                "write_file",
                json!({"path": "x", "content": ""}),
            ),
        ),
        "no policy permits",
    );
    // a named principal limited to read-only tools
    assert_allow(&decide(
        &authorizer,
        &call(
            "reviewer",
            &["agent"],
            "query_database",
            json!({"database": "m", "sql": "select 1"}),
        ),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &call(
                "reviewer",
                &["agent"],
                "execute_sql",
                json!({"database": "m", "sql": "x"}),
            ),
        ),
        "reviewer-read-only",
    );
    // the worker-reported annotation as a resource attribute
    assert_deny(
        &decide(
            &authorizer,
            &call(
                "ci-bot",
                &["agent"],
                "create_directory",
                json!({"path": "x"}),
            ),
        ),
        "ci-bot-read-only",
    );
    // session rule
    let mut scratch = agent("write_file", json!({"path": "src/a", "content": ""}));
    scratch.session = "sandbox-7";
    assert_deny(
        &decide(&authorizer, &scratch),
        "sandbox-sessions-scratch-only",
    );
    scratch.arguments = json!({"path": "scratch/a", "content": ""});
    assert_allow(&decide(&authorizer, &scratch));
}

#[test]
fn path_prefix_rules_on_fs_arguments() {
    let authorizer = load(
        &with_default(&example("fs-paths.cedar")),
        ApprovalKnob::off(),
    );
    let write = |path: &str| agent("write_file", json!({"path": path, "content": "x"}));
    assert_allow(&decide(&authorizer, &write("src/lib.rs")));
    assert_allow(&decide(&authorizer, &write("./src//deep/../lib.rs")));
    assert_deny(
        &decide(&authorizer, &write("README.md")),
        "forbidden by policy `fs-writes-only-under-src`: files may only be changed under src/",
    );
    assert_deny(
        &decide(&authorizer, &write("src/../Cargo.toml")),
        "fs-writes-only-under-src",
    );
    assert_deny(
        &decide(&authorizer, &write("/etc/passwd")),
        "fs-writes-only-under-src",
    );
    // an absolute path inside the workspace counts as relative to it
    let workspace = Path::new("/data/workspaces/alice/s1");
    let mut absolute = write("/data/workspaces/alice/s1/src/lib.rs");
    absolute.workspace = Some(workspace);
    assert_allow(&decide(&authorizer, &absolute));
    absolute.arguments = json!({"path": "/data/workspaces/alice/s1/notes.txt", "content": ""});
    assert_deny(&decide(&authorizer, &absolute), "fs-writes-only-under-src");

    // moves: both ends
    assert_allow(&decide(
        &authorizer,
        &agent(
            "move_path",
            json!({"source": "src/a", "destination": "src/b"}),
        ),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &agent("move_path", json!({"source": "src/a", "destination": "b"})),
        ),
        "fs-moves-only-under-src",
    );

    // .env is never read, however it is spelled
    let read = |path: &str| decide(&authorizer, &agent("read_file", json!({"path": path})));
    assert_allow(&read("src/main.rs"));
    for secret in [".env", "./.env", "config/.env", "src/../.env", ".env.local"] {
        assert_deny(&read(secret), "fs-no-dotenv");
    }
    assert_allow(&read("src/env.rs"));
    assert_deny(
        &decide(
            &authorizer,
            &agent("list_directory", json!({"path": ".git/objects"})),
        ),
        "fs-no-git-internals",
    );

    // recursive deletion needs approval even with the knob off
    assert_allow(&decide(
        &authorizer,
        &agent("delete_path", json!({"path": "src/a"})),
    ));
    assert_approval(
        &decide(
            &authorizer,
            &agent("delete_path", json!({"path": "src/a", "recursive": true})),
        ),
        "approval required by policy `fs-recursive-delete-needs-approval`",
    );
}

#[test]
fn host_rules_on_http_urls() {
    // the raw-URL form of the brief
    let authorizer = load(
        r#"
        @id("agents") permit (principal in Airlock::Role::"agent", action, resource);
        @id("api-only")
        forbid (principal, action == Airlock::Action::"http_request", resource)
        unless { context.arguments.url like "https://api.example.com/*" };
        "#,
        ApprovalKnob::default(),
    );
    let request = |method: &str, url: &str| {
        decide(
            &authorizer,
            &agent("http_request", json!({"method": method, "url": url})),
        )
    };
    assert_allow(&request("GET", "https://api.example.com/v1/items"));
    assert_deny(&request("GET", "https://evil.test/"), "api-only");
    assert_deny(
        &request("GET", "https://api.example.com.evil.test/"),
        "api-only",
    );
    assert_approval(&request("POST", "https://api.example.com/v1/items"), "POST");

    // the parsed-host form of the example
    let authorizer = load(
        &with_default(&example("http-hosts.cedar")),
        ApprovalKnob::default(),
    );
    let request = |method: &str, url: &str| {
        decide(
            &authorizer,
            &agent("http_request", json!({"method": method, "url": url})),
        )
    };
    assert_allow(&request("GET", "https://api.example.com/v1/x"));
    assert_allow(&request("get", "https://WWW.Example.COM/"));
    assert_deny(
        &request("GET", "https://api.example.com@evil.test/"),
        "http-only-company-api",
    );
    assert_deny(
        &request("GET", "http://www.example.com/"),
        "http-only-company-api",
    );
    assert_deny(
        &request("GET", "https://api.example.com/v2/x"),
        "http-api-prefix",
    );
    assert_deny(
        &request("post", "https://payments.example.com/charge"),
        "http-payments-read-only",
    );
    assert_allow(&request("GET", "https://payments.example.com/charges"));
    // The same host spelled with trailing dots, in capitals or behind whitespace is the
    // host the worker reaches (DNS, SNI and `Host` drop the dots): the rules hold.
    for spelled in [
        "https://payments.example.com./charge",
        "https://PAYMENTS.example.com../charge",
        " https://payments.example.com./charge\t",
    ] {
        assert_deny(&request("POST", spelled), "http-payments-read-only");
    }
    assert_deny(
        &request("GET", "https://api.example.com./v2/x"),
        "http-api-prefix",
    );
    assert_approval(
        &request("GET", "https://www.example.com:8443/"),
        "http-odd-port-needs-approval",
    );
    assert_deny(&request("GET", "not a url"), "not a valid absolute url");
    assert_allow(&decide(
        &authorizer,
        &agent("fetch_url", json!({"url": "https://docs.example.com/a"})),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &agent("fetch_url", json!({"url": "https://example.org/"})),
        ),
        "http-only-company-api",
    );
}

#[test]
fn database_rules() {
    let authorizer = load(
        &with_default(&example("databases.cedar")),
        ApprovalKnob::off(),
    );
    let sql = |tool_name: &str, database: &str, sql: &str| {
        decide(
            &authorizer,
            &agent(tool_name, json!({"database": database, "sql": sql})),
        )
    };
    assert_deny(
        &sql("execute_sql", "prod", "insert into t values (1)"),
        "forbidden by policy `db-no-writes-to-prod`: the prod database is read-only for agents",
    );
    assert_allow(&sql("execute_sql", "main", "insert into t values (1)"));
    assert_allow(&sql("query_database", "prod", "select 1"));
    assert_deny(&sql("query_database", "hr", "select 1"), "db-no-hr");
    assert_deny(
        &decide(
            &authorizer,
            &agent("list_tables", json!({"database": "hr"})),
        ),
        "db-no-hr",
    );
    assert_allow(&decide(&authorizer, &agent("list_databases", json!({}))));
    assert_approval(
        &sql("execute_sql", "main", "DROP TABLE t"),
        "db-ddl-needs-approval",
    );
}

#[test]
fn shell_program_rules() {
    let authorizer = load(&with_default(&example("shell.cedar")), ApprovalKnob::off());
    let argv = |args: &[&str]| decide(&authorizer, &agent("execute_shell", json!({"argv": args})));
    assert_allow(&argv(&["ls", "-l"]));
    assert_deny(&argv(&["curl", "https://x.test"]), "shell-no-downloaders");
    assert_deny(&argv(&["/usr/bin/wget", "x"]), "shell-no-downloaders");
    assert_approval(&argv(&["rm", "-rf", "build"]), "shell-rm-needs-approval");
    assert_approval(&argv(&["/bin/rm", "x"]), "shell-rm-needs-approval");

    // agents must use argv; admins may use shell strings, still without downloaders
    assert_deny(
        &decide(
            &authorizer,
            &agent("execute_shell", json!({"command": "ls -l"})),
        ),
        "shell-argv-only",
    );
    let admin = |command: &str| {
        decide(
            &authorizer,
            &call(
                "root",
                &["agent", "admin"],
                "execute_shell",
                json!({"command": command}),
            ),
        )
    };
    assert_allow(&admin("ls -l | wc -l"));
    assert_deny(&admin("curl https://x.test"), "shell-no-downloaders");
    assert_deny(&admin("cd src && wget x"), "shell-no-downloaders");

    // env names and cwd
    assert_deny(
        &decide(
            &authorizer,
            &agent(
                "execute_shell",
                json!({"argv": ["ls"], "env": {"GITHUB_TOKEN": "x"}}),
            ),
        ),
        "shell-no-token-env",
    );
    assert_allow(&decide(
        &authorizer,
        &agent(
            "execute_shell",
            json!({"argv": ["ls"], "env": {"LANG": "C"}, "cwd": "./src/a/"}),
        ),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &agent("execute_shell", json!({"argv": ["ls"], "cwd": "src/../.."})),
        ),
        "shell-cwd-in-src",
    );
}

// ---------------------------------------------------------------- approvals

#[test]
fn approval_knob_defaults() {
    let authorizer = Authorizer::default_policy(ApprovalKnob::default()).unwrap();
    assert_approval(
        &decide(
            &authorizer,
            &agent("write_file", json!({"path": "a", "content": ""})),
        ),
        "[approvals] tools lists `write_file`",
    );
    assert_allow(&decide(
        &authorizer,
        &agent("read_file", json!({"path": "a"})),
    ));
    let http = |method: &str| {
        decide(
            &authorizer,
            &agent(
                "http_request",
                json!({"method": method, "url": "https://x.test/"}),
            ),
        )
    };
    assert_allow(&http("GET"));
    assert_allow(&http("head"));
    assert_allow(&http("Options"));
    assert_approval(&http("POST"), "method is POST");
    assert_approval(&http("delete"), "method is DELETE");
    for (tool_name, arguments) in [
        (
            "edit_file",
            json!({"path": "a", "edits": [{"old_text": "a", "new_text": "b"}]}),
        ),
        ("move_path", json!({"source": "a", "destination": "b"})),
        ("delete_path", json!({"path": "a"})),
        (
            "execute_sql",
            json!({"database": "main", "sql": "delete from t"}),
        ),
        ("execute_shell", json!({"command": "true"})),
    ] {
        assert_approval(
            &decide(&authorizer, &agent(tool_name, arguments)),
            tool_name,
        );
    }
    for (tool_name, arguments) in [
        ("create_directory", json!({"path": "a"})),
        ("fetch_url", json!({"url": "https://x.test/"})),
        (
            "query_database",
            json!({"database": "main", "sql": "select 1"}),
        ),
    ] {
        assert_allow(&decide(&authorizer, &agent(tool_name, arguments)));
    }
}

#[test]
fn an_empty_knob_turns_approvals_off_but_cedar_can_still_require_them() {
    let off = Authorizer::default_policy(ApprovalKnob::off()).unwrap();
    assert_allow(&decide(
        &off,
        &agent("write_file", json!({"path": "a", "content": ""})),
    ));
    assert_allow(&decide(
        &off,
        &agent(
            "http_request",
            json!({"method": "POST", "url": "https://x.test/"}),
        ),
    ));

    let policy = with_default(
        r#"
        @id("writes-need-a-human") @reason("someone reviews every write")
        @approval("required")
        permit (principal, action == Airlock::Action::"write_file", resource);
        "#,
    );
    let authorizer = load(&policy, ApprovalKnob::off());
    assert_approval(
        &decide(
            &authorizer,
            &agent("write_file", json!({"path": "a", "content": ""})),
        ),
        "approval required by policy `writes-need-a-human`: someone reviews every write",
    );
    assert_allow(&decide(
        &authorizer,
        &agent("read_file", json!({"path": "a"})),
    ));

    // with the knob on, both reasons are given
    let both = load(&policy, ApprovalKnob::default());
    let decision = decide(
        &both,
        &agent("write_file", json!({"path": "a", "content": ""})),
    );
    assert_approval(&decision, "[approvals] tools");
    assert_approval(&decision, "writes-need-a-human");

    // a policy never removes the knob's approvals: a custom knob list
    let custom = load(
        &policy,
        ApprovalKnob {
            tools: vec!["read_file".to_owned()],
            ..ApprovalKnob::default()
        },
    );
    assert_approval(
        &decide(&custom, &agent("read_file", json!({"path": "a"}))),
        "[approvals] tools lists `read_file`",
    );
}

#[test]
fn an_approval_permit_alone_grants_the_call_with_approval() {
    let authorizer = load(
        r#"
        @id("ask-first") @approval("required")
        permit (principal in Airlock::Role::"approver", action == Airlock::Action::"read_file", resource);
        "#,
        ApprovalKnob::off(),
    );
    assert_approval(
        &decide(
            &authorizer,
            &call("ann", &["approver"], "read_file", json!({"path": "a"})),
        ),
        "ask-first",
    );
}

// ---------------------------------------------------------------- visibility

#[test]
fn visibility_follows_unconditional_denials_only() {
    let authorizer = load(
        &with_default(
            r#"
            @id("agents-never-delete")
            forbid (principal in Airlock::Role::"agent", action == Airlock::Action::"delete_path", resource);
            @id("writes-only-under-src")
            forbid (principal, action == Airlock::Action::"write_file", resource)
            unless { context.arguments.path like "src/*" };
            @id("agents-no-db")
            forbid (principal in Airlock::Role::"agent", action in Airlock::Action::"db", resource)
            unless { principal in Airlock::Role::"admin" };
            "#,
        ),
        ApprovalKnob::default(),
    );
    let agent_roles = roles(&["agent"]);
    let alice = PrincipalRef {
        name: "alice",
        roles: &agent_roles,
    };
    assert!(!authorizer.visible(&alice, &tool("delete_path")));
    assert!(
        authorizer.visible(&alice, &tool("write_file")),
        "argument-dependent forbid"
    );
    assert!(authorizer.visible(&alice, &tool("read_file")));
    assert!(!authorizer.visible(&alice, &tool("execute_sql")));
    assert!(!authorizer.visible(&alice, &tool("list_databases")));

    let admin_roles = roles(&["agent", "admin"]);
    let root = PrincipalRef {
        name: "root",
        roles: &admin_roles,
    };
    assert!(authorizer.visible(&root, &tool("execute_sql")));

    // no permit at all: nothing visible
    let approver_roles = roles(&["approver"]);
    let ann = PrincipalRef {
        name: "ann",
        roles: &approver_roles,
    };
    assert!(!authorizer.visible(&ann, &tool("read_file")));

    // a conditional permit keeps the tool visible
    let conditional = load(
        r#"
        @id("src-reads") permit (principal, action == Airlock::Action::"read_file", resource)
        when { context.arguments.path like "src/*" };
        "#,
        ApprovalKnob::off(),
    );
    assert!(conditional.visible(&ann, &tool("read_file")));
    assert!(!conditional.visible(&ann, &tool("write_file")));

    // tools the schema does not declare are neither visible nor allowed
    assert!(!authorizer.visible(&root, &tool("launch_missiles")));
    assert_deny(
        &decide(
            &authorizer,
            &call("root", &["admin"], "launch_missiles", json!({})),
        ),
        "not declared in the policy schema",
    );
}

// ---------------------------------------------------------------- loading

#[test]
fn a_syntax_error_names_file_line_and_cause() {
    let text = "// line 1\n\
                @id(\"ok\")\n\
                permit (\n\
                  principal,\n\
                  action,\n\
                  resource\n\
                ) when { context.session_id == };\n";
    let dir = tempfile_dir();
    let path = dir.join("broken.cedar");
    std::fs::write(&path, text).unwrap();
    let error = Authorizer::load_file(&path, ApprovalKnob::default()).unwrap_err();
    let PolicyError::Parse {
        file,
        line,
        message,
        ..
    } = &error
    else {
        panic!("expected a parse error, got {error:?}");
    };
    assert_eq!(line, &7, "{error}");
    assert!(file.ends_with("broken.cedar"), "{error}");
    assert!(!message.is_empty());
    let shown = error.to_string();
    assert!(shown.contains("broken.cedar:7:"), "{shown}");
    assert!(shown.contains("syntax error"), "{shown}");
    assert_eq!(error.location().map(|(_, line, _)| line), Some(7));

    let missing =
        Authorizer::load_file(&dir.join("nope.cedar"), ApprovalKnob::default()).unwrap_err();
    assert!(matches!(missing, PolicyError::Read { .. }), "{missing:?}");
    assert!(missing.to_string().contains("nope.cedar"), "{missing}");
    std::fs::remove_dir_all(dir).unwrap();
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "airlock-authz-test-{}-{:?}",
        std::process::id(),
        std::thread::current().id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn unknown_attributes_and_entity_types_fail_validation() {
    let typo = "@id(\"a\") permit (principal, action, resource);\n\
                \n\
                @id(\"typo\")\n\
                forbid (principal, action == Airlock::Action::\"write_file\", resource)\n\
                when { context.arguments.pth like \"src/*\" };\n";
    let error = Authorizer::from_sources(typo, "typo.cedar", ApprovalKnob::default()).unwrap_err();
    let PolicyError::Validation {
        file,
        line,
        policy_id,
        message,
        ..
    } = &error
    else {
        panic!("expected a validation error, got {error:?}");
    };
    assert_eq!(file, "typo.cedar");
    assert_eq!(*line, 5, "{error}");
    assert_eq!(policy_id, "typo");
    assert!(message.contains("pth"), "{error}");
    assert!(error.to_string().contains("typo.cedar:5:"), "{error}");

    let entity = "@id(\"users\") permit (principal in Airlock::User::\"x\", action, resource);\n";
    let error =
        Authorizer::from_sources(entity, "entity.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(
        matches!(error, PolicyError::Validation { line: 1, .. }),
        "{error:?}"
    );
    assert!(error.to_string().contains("Airlock::User"), "{error}");

    let action = "permit (principal, action == Airlock::Action::\"rm_rf\", resource);\n";
    let error =
        Authorizer::from_sources(action, "action.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(matches!(error, PolicyError::Validation { .. }), "{error:?}");
    assert!(error.to_string().contains("rm_rf"), "{error}");

    // an argument of another tool
    let wrong_tool = "forbid (principal, action == Airlock::Action::\"read_file\", resource)\n\
                      when { context.arguments.database == \"prod\" };\n";
    let error =
        Authorizer::from_sources(wrong_tool, "w.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(
        matches!(error, PolicyError::Validation { line: 2, .. }),
        "{error:?}"
    );

    // an optional argument read without `has`
    let unsafe_access = "forbid (principal, action == Airlock::Action::\"delete_path\", resource)\n\
                         when { context.arguments.recursive };\n";
    let error =
        Authorizer::from_sources(unsafe_access, "u.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(
        matches!(error, PolicyError::Validation { line: 2, .. }),
        "{error:?}"
    );
}

#[test]
fn bad_annotations_are_refused() {
    let duplicate = "@id(\"x\") permit (principal, action, resource);\n\
                     @id(\"x\") forbid (principal, action, resource);\n";
    let error =
        Authorizer::from_sources(duplicate, "d.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(
        matches!(&error, PolicyError::Annotation { line: 2, policy_id, .. } if policy_id == "x"),
        "{error:?}"
    );

    let bad_value = "\n\n@approval(\"yes\") permit (principal, action, resource);\n";
    let error =
        Authorizer::from_sources(bad_value, "b.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(
        matches!(error, PolicyError::Annotation { line: 3, .. }),
        "{error:?}"
    );
    assert!(
        error.to_string().contains("@approval must be \"required\""),
        "{error}"
    );

    let on_forbid = "@approval(\"required\") forbid (principal, action, resource);\n";
    let error =
        Authorizer::from_sources(on_forbid, "f.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(matches!(error, PolicyError::Annotation { .. }), "{error:?}");

    let template = "permit (principal == ?principal, action, resource);\n";
    let error = Authorizer::from_sources(template, "t.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(error.to_string().contains("templates"), "{error}");
}

#[test]
fn every_example_parses_and_validates_alone_and_after_the_default_policy() {
    let mut seen = 0;
    for entry in std::fs::read_dir(examples_dir()).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().and_then(|ext| ext.to_str()) != Some("cedar") {
            continue;
        }
        seen += 1;
        let authorizer = Authorizer::load_file(&path, ApprovalKnob::default())
            .unwrap_or_else(|error| panic!("{error}"));
        assert!(!authorizer.policy_ids().is_empty(), "{}", path.display());
        for id in authorizer.policy_ids() {
            assert!(
                !id.starts_with("policy"),
                "{}: policy without @id",
                path.display()
            );
        }
        let text = std::fs::read_to_string(&path).unwrap();
        Authorizer::from_sources(
            &with_default(&text),
            "combined.cedar",
            ApprovalKnob::default(),
        )
        .unwrap_or_else(|error| panic!("{} after the default: {error}", path.display()));
    }
    assert!(seen >= 5, "only {seen} examples");
}

#[test]
fn wrongly_typed_arguments_are_denied_not_skipped() {
    let authorizer = Authorizer::default_policy(ApprovalKnob::off()).unwrap();
    assert_deny(
        &decide(&authorizer, &agent("read_file", json!({"path": 7}))),
        "argument `path` of `read_file` must be a string",
    );
    assert_deny(
        &decide(&authorizer, &agent("write_file", json!({"path": "a"}))),
        "argument `content` of `write_file` is missing",
    );
    assert_deny(
        &decide(&authorizer, &agent("read_file", json!("a"))),
        "not a JSON object",
    );
}

#[test]
fn authorizer_is_cheap_to_share() {
    let authorizer =
        std::sync::Arc::new(Authorizer::default_policy(ApprovalKnob::default()).unwrap());
    let handles: Vec<_> = (0..2)
        .map(|_| {
            let authorizer = std::sync::Arc::clone(&authorizer);
            std::thread::spawn(move || {
                let agent_roles = roles(&["agent"]);
                let principal = PrincipalRef {
                    name: "alice",
                    roles: &agent_roles,
                };
                authorizer.visible(&principal, &tool("read_file"))
            })
        })
        .collect();
    for handle in handles {
        assert!(handle.join().unwrap());
    }
}

#[test]
fn a_forbid_that_fails_to_evaluate_denies() {
    let authorizer = load(
        &with_default(
            r#"
            @id("overflowing")
            forbid (principal, action == Airlock::Action::"read_file", resource)
            when { context.arguments has limit && context.arguments.limit + 9223372036854775807 < 0 };
            "#,
        ),
        ApprovalKnob::off(),
    );
    assert_allow(&decide(
        &authorizer,
        &agent("read_file", json!({"path": "a", "limit": 0})),
    ));
    assert_deny(
        &decide(
            &authorizer,
            &agent("read_file", json!({"path": "a", "limit": 5})),
        ),
        "forbid policy `overflowing` failed to evaluate",
    );
}

/// Repeated decisions on one authorizer give one answer. The cost of a decision is a
/// figure printed for the reader (a benchmark number), never a pass/fail threshold.
#[test]
fn repeated_decisions_agree_and_report_their_cost() {
    let authorizer = load(
        &with_default(&example("fs-paths.cedar")),
        ApprovalKnob::default(),
    );
    let call = agent("write_file", json!({"path": "src/lib.rs", "content": "x"}));
    let first = decide(&authorizer, &call);
    assert!(!first.is_deny(), "{first:?}");
    let started = std::time::Instant::now();
    for _ in 0..200 {
        assert_eq!(decide(&authorizer, &call), first);
    }
    let per_call = started.elapsed() / 200;
    eprintln!("decide: {per_call:?} per call (measured, not asserted)");
}

/// The context is derived from the worker's own schema: an argument the worker adds
/// that policies cannot see is never silently dropped; the call is denied, naming it.
#[test]
fn a_call_with_an_argument_the_policy_cannot_see_is_denied_naming_it() {
    let authorizer = load(&with_default(""), ApprovalKnob::off());
    assert_allow(&decide(
        &authorizer,
        &agent("read_file", json!({"path": "a"})),
    ));
    // Cedar cannot type it: refused before Cedar is asked.
    let mut untyped = agent("read_file", json!({"path": "a", "meta": {"x": 1}}));
    untyped.tool.input_schema["properties"]["meta"] = json!({"type": "object"});
    assert_deny(&decide(&authorizer, &untyped), "`read_file.meta`");
    // Typed, but not in the Cedar schema's context: refused by Cedar's own check.
    let mut undeclared = agent("read_file", json!({"path": "a", "follow": true}));
    undeclared.tool.input_schema["properties"]["follow"] = json!({"type": "boolean"});
    assert_deny(
        &decide(&authorizer, &undeclared),
        "cannot be checked by policy",
    );
    // The worker's schema says what is required: one that drops `path` from its
    // required list cannot make policies read a missing path as present.
    let mut optional = agent("read_file", json!({"offset": 3}));
    optional.tool.input_schema["required"] = json!([]);
    assert_deny(
        &decide(&authorizer, &optional),
        "cannot be checked by policy",
    );
}

// ---------------------------------------------------------------- declared tools

fn declared_commit() -> airlock_policy::authz::ToolExtension {
    airlock_policy::authz::ToolExtension {
        group: "shell".into(),
        definition: ToolDefinition {
            name: "git_commit".into(),
            title: String::new(),
            description: "commit".into(),
            input_schema: json!({"type": "object", "required": ["message"], "properties": {
                "message": {"type": "string"},
                "paths": {"type": "array", "items": {"type": "string"}}}}),
            annotations: ToolAnnotations {
                destructive: true,
                ..ToolAnnotations::default()
            },
        },
        approval: Some("`git_commit` is destructive".into()),
        network: Some("none".into()),
    }
}

fn with_declared(policy: &str, approval: Option<&str>) -> Result<Authorizer, PolicyError> {
    let mut commit = declared_commit();
    commit.approval = approval.map(str::to_owned);
    let extensions = airlock_policy::authz::ToolExtensions::new(&[commit]).unwrap();
    Authorizer::from_sources(
        policy,
        "declared.cedar",
        airlock_policy::authz::PolicyInputs {
            approvals: ApprovalKnob::off(),
            extensions: std::sync::Arc::new(extensions),
        },
    )
}

fn commit_call(message: &str) -> Call<'static> {
    Call {
        tool: declared_commit().definition,
        ..agent(
            "git_commit",
            json!({"message": message, "paths": ["src/a.rs"]}),
        )
    }
}

#[test]
fn a_policy_names_a_declared_tool_and_its_arguments() {
    let policy = with_default(
        r#"
        @id("no-wip") @reason("commit messages say what changed")
        forbid (principal, action == Airlock::Action::"git_commit", resource)
        when { context.arguments.message like "WIP*" };
        @id("no-secrets") forbid (principal, action in Airlock::Action::"shell", resource)
        when { context has arguments.paths && context.arguments.paths.contains(".env") };
        "#,
    );
    let authorizer = with_declared(&policy, None).unwrap();
    assert_allow(&decide(&authorizer, &commit_call("Fix the parser")));
    assert_deny(
        &decide(&authorizer, &commit_call("WIP: later")),
        "commit messages say what changed",
    );
    // Without the declared tool the same policy does not load: the action is unknown.
    let error = load_error(&policy);
    assert!(error.contains("git_commit"), "{error}");
    // A misspelt argument of the declared tool is refused at load, with its place.
    let typo = with_default(
        r#"forbid (principal, action == Airlock::Action::"git_commit", resource)
        when { context.arguments.mesage == "x" };"#,
    );
    let error = with_declared(&typo, None).unwrap_err().to_string();
    assert!(error.starts_with("declared.cedar:"), "{error}");
    assert!(error.contains("mesage"), "{error}");
}

fn load_error(policy: &str) -> String {
    Authorizer::from_sources(policy, "plain.cedar", ApprovalKnob::off())
        .unwrap_err()
        .to_string()
}

#[test]
fn a_declared_tool_that_needs_approval_needs_it_whatever_the_knob() {
    let authorizer =
        with_declared(DEFAULT_POLICY_SOURCE, Some("`git_commit` is destructive")).unwrap();
    assert_approval(
        &decide(&authorizer, &commit_call("Fix")),
        "`git_commit` is destructive",
    );
    let authorizer = with_declared(DEFAULT_POLICY_SOURCE, None).unwrap();
    assert_allow(&decide(&authorizer, &commit_call("Fix")));
    // Served with another schema than policies were built from: denied.
    let mut call = commit_call("Fix");
    call.tool.input_schema["properties"]["message"] = json!({"type": "integer"});
    assert_deny(&decide(&authorizer, &call), "another input schema");
    // Unknown to policy altogether: denied and invisible.
    let mut unknown = commit_call("Fix");
    unknown.tool.name = "git_push".into();
    assert_deny(&decide(&authorizer, &unknown), "not declared");
    let principal = PrincipalRef {
        name: "alice",
        roles: &unknown.roles,
    };
    assert!(!authorizer.visible(&principal, &unknown.tool));
    assert!(authorizer.visible(&principal, &call.tool));
}

#[test]
fn the_printed_schema_holds_the_declared_tools() {
    let extensions = airlock_policy::authz::ToolExtensions::new(&[declared_commit()]).unwrap();
    let text = airlock_policy::authz::schema_text(&extensions);
    assert!(text.starts_with(airlock_policy::authz::SCHEMA_SOURCE));
    assert!(text.contains("action \"git_commit\""), "{text}");
    // The printed text is itself a schema Cedar reads (as two fragments).
    let plain = airlock_policy::authz::schema_text(&Default::default());
    assert_eq!(plain, airlock_policy::authz::SCHEMA_SOURCE);
}

// ------------------------------------------------------- the network a sandbox has

/// `policy` with the declared `git_commit` in a sandbox of `commit_network`, and
/// execute_shell's sandboxes on `shell_network`.
fn with_networks(policy: &str, shell_network: &str, commit_network: &str) -> Authorizer {
    let mut commit = declared_commit();
    commit.network = Some(commit_network.to_owned());
    commit.approval = None;
    let extensions = airlock_policy::authz::ToolExtensions::new(&[commit])
        .unwrap()
        .with_shell_network(shell_network);
    Authorizer::from_sources(
        policy,
        "network.cedar",
        airlock_policy::authz::PolicyInputs {
            approvals: ApprovalKnob::off(),
            extensions: std::sync::Arc::new(extensions),
        },
    )
    .unwrap_or_else(|error| panic!("{error}"))
}

#[test]
fn policies_see_the_network_a_sandbox_has() {
    let policy = with_default(
        r#"
        @id("no-fetch-behind-proxy") @reason("downloads go through pip_install")
        forbid (principal, action == Airlock::Action::"execute_shell", resource)
        when { context.network != "none" && context.program == "curl" };
        @id("commits-offline") @reason("commits never need the network")
        forbid (principal, action == Airlock::Action::"git_commit", resource)
        when { context.network != "none" };
        "#,
    );
    let curl = agent("execute_shell", json!({"argv": ["curl", "https://x.test"]}));
    let ls = agent("execute_shell", json!({"argv": ["ls"]}));
    let proxied = with_networks(&policy, "proxy", "proxy");
    assert_deny(&decide(&proxied, &curl), "downloads go through pip_install");
    assert_allow(&decide(&proxied, &ls));
    assert_deny(
        &decide(&proxied, &commit_call("Fix the parser")),
        "commits never need the network",
    );
    let offline = with_networks(&policy, "none", "none");
    assert_allow(&decide(&offline, &curl));
    assert_allow(&decide(&offline, &commit_call("Fix the parser")));
    // A misspelt attribute does not load: the context is typed.
    let error = Authorizer::from_sources(
        &with_default(
            r#"forbid (principal, action == Airlock::Action::"execute_shell", resource)
            when { context.netwrk == "proxy" };"#,
        ),
        "typo.cedar",
        ApprovalKnob::off(),
    )
    .unwrap_err()
    .to_string();
    assert!(error.contains("netwrk"), "{error}");
}

#[test]
fn a_quorum_comes_from_the_knob_or_a_quorum_annotation_and_the_largest_wins() {
    let quorum_of = |decision: &Decision| match decision {
        Decision::RequireApproval { quorum, .. } => *quorum,
        other => panic!("expected approval, got {other:?}"),
    };
    let write = || agent("write_file", json!({"path": "a", "content": ""}));
    // An ordinary approval needs one approver.
    let plain = Authorizer::default_policy(ApprovalKnob::default()).unwrap();
    assert_eq!(quorum_of(&decide(&plain, &write())), 1);

    // `[approvals] quorum` alone holds the tool (it is not in `tools`) for N approvers.
    let knob = ApprovalKnob {
        tools: Vec::new(),
        quorum: [("write_file".to_owned(), 2)].into_iter().collect(),
    };
    let by_knob = Authorizer::default_policy(knob.clone()).unwrap();
    let decision = decide(&by_knob, &write());
    assert_approval(&decision, "[approvals] quorum");
    assert_eq!(quorum_of(&decision), 2);
    assert_allow(&decide(&by_knob, &agent("read_file", json!({"path": "a"}))));

    // `@quorum("3")` on a permit asks for approval by three, and beats the knob's 2.
    let policy = with_default(
        r#"
        @id("three-for-writes") @quorum("3")
        permit (principal, action == Airlock::Action::"write_file", resource);
        "#,
    );
    let annotated = load(&policy, ApprovalKnob::off());
    let decision = decide(&annotated, &write());
    assert_approval(&decision, "three-for-writes");
    assert_eq!(quorum_of(&decision), 3);
    assert_eq!(quorum_of(&decide(&load(&policy, knob), &write())), 3);

    // Not a number in range, or on a forbid: refused at load with the line.
    for bad in ["0", "two", "17"] {
        let text = format!("\n@quorum(\"{bad}\") permit (principal, action, resource);\n");
        let error =
            Authorizer::from_sources(&text, "q.cedar", ApprovalKnob::default()).unwrap_err();
        assert!(
            matches!(error, PolicyError::Annotation { line: 2, .. }),
            "{bad}: {error:?}"
        );
        assert!(error.to_string().contains("@quorum must be"), "{error}");
    }
    let on_forbid = "@quorum(\"2\") forbid (principal, action, resource);\n";
    let error =
        Authorizer::from_sources(on_forbid, "f.cedar", ApprovalKnob::default()).unwrap_err();
    assert!(matches!(error, PolicyError::Annotation { .. }), "{error:?}");
}
