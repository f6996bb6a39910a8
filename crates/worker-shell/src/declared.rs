//! Declarative command tools (DESIGN §11): `[[tools]]` entries with a `command`, and the
//! shipped packs (`tool_packs = ["dev"]`), run in the same sandbox as `execute_shell`.
//!
//! A template is an argv array. An element that is exactly `"{field}"` becomes that
//! validated argument as one whole argv element (an array: one element per item; an
//! absent optional field: no element); an element `"<option>{field}"` whose literal part
//! starts with `-` (`"--message={message}"`) becomes that option with the value attached.
//! Nothing is ever parsed by a shell. A value that starts with `-` in a `"{field}"`
//! element that no literal `"--"` precedes would reach the program as an option
//! (`--upload-pack=…` to git), so such a call is refused with an error that says so;
//! templates put `"--"` before user values that may start with `-`.

use std::sync::Arc;

use airlock_policy::{ToolDefinition, ToolOutcome};
use airlock_sandbox::{CommandSpec, Network, Sandbox};
pub use airlock_worker::declared::{DeclaredToolError, ToolEntry, ToolNetwork};
use airlock_worker::declared::{check_field, check_unique, mentions_placeholder, placeholder};
use airlock_worker::{CallContext, Tool};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::config::ShellConfig;
use crate::egress::EgressRules;
use crate::execute;

/// The `dev` pack, embedded: the same format as `[[tools]]` in `airlock.toml`.
const DEV_PACK: &str = include_str!("packs/dev.toml");
/// The packs `tool_packs` may name.
pub const PACKS: &[&str] = &["dev"];
/// Longest argv a template may produce (elements), whatever the arguments.
const MAX_ARGV: usize = 4096;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PackFile {
    tools: Vec<ToolEntry>,
}

/// The `[[tools]]` entries of the named packs, in order.
pub fn pack_entries(packs: &[String]) -> Result<Vec<ToolEntry>, DeclaredToolError> {
    let mut entries = Vec::new();
    for pack in packs {
        let text = match pack.as_str() {
            "dev" => DEV_PACK,
            other => {
                return Err(DeclaredToolError::UnknownPack {
                    pack: other.to_owned(),
                    known: PACKS.join(", "),
                });
            }
        };
        let file: PackFile = toml::from_str(text).map_err(|e| DeclaredToolError::Pack {
            pack: pack.clone(),
            reason: e.to_string(),
        })?;
        entries.extend(file.tools);
    }
    Ok(entries)
}

/// One element of a compiled template.
#[derive(Debug, Clone, PartialEq)]
enum Part {
    Literal(String),
    /// `"{field}"`; `guarded`: a literal `"--"` comes before it.
    Whole {
        field: String,
        guarded: bool,
    },
    /// `"<option>{field}"`.
    Attached {
        option: String,
        field: String,
    },
}

/// A checked command tool, ready to serve.
#[derive(Debug, Clone)]
pub struct CommandTemplate {
    definition: ToolDefinition,
    parts: Vec<Part>,
    stdin: Option<String>,
    timeout: Option<f64>,
    env: Vec<(String, String)>,
    network: ToolNetwork,
    /// `egress_allow`: the hosts this tool may reach, within `[sandbox.egress] allow`.
    egress_allow: Option<Vec<String>>,
}

impl CommandTemplate {
    /// Checks one entry: its name, schema, template and stdin; every problem is an error
    /// naming the tool and the field.
    pub fn compile(entry: &ToolEntry) -> Result<Self, DeclaredToolError> {
        let invalid = |reason: String| DeclaredToolError::Invalid {
            tool: entry.name.clone(),
            reason,
        };
        let definition = entry.definition()?;
        let properties = entry.properties()?;
        let Some(command) = &entry.command else {
            return Err(invalid(
                "no command: this entry is the http worker's".into(),
            ));
        };
        if command.is_empty() {
            return Err(invalid(
                "command is empty; give the program and its arguments".into(),
            ));
        }
        let mut parts = Vec::with_capacity(command.len());
        let mut guarded = false;
        for (index, element) in command.iter().enumerate() {
            if element.contains('\0') {
                return Err(invalid(format!("command[{index}] contains a NUL byte")));
            }
            if let Some(field) = placeholder(element) {
                if index == 0 {
                    return Err(invalid(
                        "command[0] is the program and must be literal, not an argument".into(),
                    ));
                }
                check_field(&properties, field, &format!("command[{index}]")).map_err(&invalid)?;
                parts.push(Part::Whole {
                    field: field.to_owned(),
                    guarded,
                });
                continue;
            }
            if let Some(start) = element.find('{')
                && let Some(field) = placeholder(&element[start..])
                && element.starts_with('-')
                && !mentions_placeholder(&element[..start])
            {
                check_field(&properties, field, &format!("command[{index}]")).map_err(&invalid)?;
                parts.push(Part::Attached {
                    option: element[..start].to_owned(),
                    field: field.to_owned(),
                });
                continue;
            }
            if mentions_placeholder(element) {
                return Err(invalid(format!(
                    "command[{index}] {element:?} puts a placeholder inside other text; a \
                     placeholder is a whole element (\"{{field}}\") or follows an option \
                     (\"--name={{field}}\")"
                )));
            }
            if element == "--" {
                guarded = true;
            }
            parts.push(Part::Literal(element.clone()));
        }
        let stdin = match &entry.stdin {
            None => None,
            Some(spec) => {
                let field = placeholder(spec)
                    .ok_or_else(|| invalid(format!("stdin {spec:?} must be \"{{field}}\"")))?;
                check_field(&properties, field, "stdin").map_err(&invalid)?;
                if properties.get(field).and_then(|p| p.get("type")) != Some(&json!("string")) {
                    return Err(invalid(format!(
                        "stdin names {field:?}, which must be of type \"string\""
                    )));
                }
                Some(field.to_owned())
            }
        };
        if entry.egress_allow.is_some() && entry.network != ToolNetwork::Proxy {
            return Err(invalid(
                "egress_allow narrows the proxy's hosts: it needs network = \"proxy\"".into(),
            ));
        }
        if let Some(t) = entry.timeout_seconds
            && !(t.is_finite() && t > 0.0)
        {
            return Err(invalid("timeout_seconds must be a positive number".into()));
        }
        for (name, value) in &entry.env {
            if name.is_empty() || name.contains(['=', '\0']) || value.contains('\0') {
                return Err(invalid(format!("env {name:?}: a name without '=' or NUL")));
            }
        }
        Ok(Self {
            definition,
            parts,
            stdin,
            timeout: entry.timeout_seconds,
            env: entry.env.clone().into_iter().collect(),
            network: entry.network,
            egress_allow: entry.egress_allow.clone(),
        })
    }

    /// The proxy's rules for this tool's calls: none unless it declares `network =
    /// "proxy"`; the worker's, narrowed to its `egress_allow` when it has one.
    pub fn egress_rules(
        &self,
        worker: &Arc<EgressRules>,
    ) -> Result<Option<Arc<EgressRules>>, crate::egress::EgressError> {
        if self.network != ToolNetwork::Proxy {
            return Ok(None);
        }
        match &self.egress_allow {
            None => Ok(Some(worker.clone())),
            Some(allow) => Ok(Some(Arc::new(worker.narrowed(allow)?))),
        }
    }

    pub fn name(&self) -> &str {
        &self.definition.name
    }

    /// The argv for one call's (already schema-validated) arguments.
    fn argv(&self, arguments: &Value) -> Result<Vec<String>, String> {
        let mut argv = Vec::new();
        for part in &self.parts {
            match part {
                Part::Literal(text) => argv.push(text.clone()),
                Part::Whole { field, guarded } => {
                    for value in values(arguments, field)? {
                        if value.starts_with('-') && !guarded {
                            return Err(format!(
                                "argument {field:?} starts with '-' ({value:?}): it would reach \
                                 {program} as an option, which this tool does not allow; pass a \
                                 value that does not start with '-'",
                                program = self.program()
                            ));
                        }
                        argv.push(value);
                    }
                }
                Part::Attached { option, field } => {
                    for value in values(arguments, field)? {
                        argv.push(format!("{option}{value}"));
                    }
                }
            }
            if argv.len() > MAX_ARGV {
                return Err(format!(
                    "the arguments make more than {MAX_ARGV} argv elements"
                ));
            }
        }
        if argv.iter().any(|a| a.contains('\0')) {
            return Err("arguments may not contain NUL bytes".into());
        }
        Ok(argv)
    }

    fn program(&self) -> &str {
        match self.parts.first() {
            Some(Part::Literal(program)) => program,
            _ => "the program",
        }
    }
}

/// The argv values of one argument: a scalar is one, an array one per item, an absent
/// (optional) argument none.
fn values(arguments: &Value, field: &str) -> Result<Vec<String>, String> {
    let scalar = |value: &Value| match value {
        Value::String(s) => Ok(s.clone()),
        Value::Number(n) => Ok(n.to_string()),
        Value::Bool(b) => Ok(b.to_string()),
        _ => Err(format!(
            "argument {field:?} must be a string, number, boolean or a list of them"
        )),
    };
    match arguments.get(field) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(scalar).collect(),
        Some(value) => Ok(vec![scalar(value)?]),
    }
}

/// Compiles every command entry of `[[tools]]` and the packs: a name defined twice is an
/// error naming it.
pub fn compile_all(
    entries: &[ToolEntry],
    packs: &[String],
) -> Result<Vec<CommandTemplate>, DeclaredToolError> {
    let mut all = pack_entries(packs)?;
    all.extend(entries.iter().filter(|e| e.is_command()).cloned());
    check_unique(&all)?;
    let mut compiled = Vec::with_capacity(all.len());
    for entry in &all {
        compiled.push(CommandTemplate::compile(entry)?);
    }
    Ok(compiled)
}

/// A declared command tool as the worker serves it.
pub struct CommandTool {
    template: CommandTemplate,
    config: ShellConfig,
    sandbox: Arc<Sandbox>,
    egress: Option<Arc<EgressRules>>,
}

impl CommandTool {
    pub fn new(
        template: CommandTemplate,
        config: ShellConfig,
        sandbox: Arc<Sandbox>,
        egress: Option<Arc<EgressRules>>,
    ) -> Self {
        Self {
            template,
            config,
            sandbox,
            egress,
        }
    }

    fn spec(&self, arguments: &Value, ctx: &CallContext) -> Result<CommandSpec, String> {
        if self.template.network == ToolNetwork::Proxy && self.config.network == Network::None {
            return Err(format!(
                "{} needs the network (network = \"proxy\"), and this worker's sandboxes have \
                 none: set [sandbox] network = \"proxy\" and name the hosts it may reach in \
                 [sandbox.egress] allow",
                self.template.name()
            ));
        }
        let argv = self.template.argv(arguments)?;
        let stdin = match &self.template.stdin {
            Some(field) => arguments
                .get(field)
                .and_then(Value::as_str)
                .unwrap_or_default()
                .as_bytes()
                .to_vec(),
            None => Vec::new(),
        };
        let requested = self
            .template
            .timeout
            .unwrap_or(self.config.timeout_seconds as f64);
        let (timeout, workspace) = execute::timeout_and_workspace(&self.config, ctx, requested)?;
        Ok(CommandSpec {
            argv,
            workspace,
            cwd: None,
            stdin,
            env: self.template.env.clone(),
            timeout,
        })
    }
}

#[airlock_worker::async_trait]
impl Tool for CommandTool {
    fn definition(&self) -> ToolDefinition {
        self.template.definition.clone()
    }

    async fn execute(&self, arguments: Value, ctx: CallContext) -> ToolOutcome {
        if let Err(message) = execute::ensure_volume(&self.config, &ctx).await {
            return ToolOutcome::error(message);
        }
        match self.spec(&arguments, &ctx) {
            Ok(spec) => {
                execute::run(&self.config, &self.sandbox, spec, ctx, self.egress.clone()).await
            }
            Err(message) => ToolOutcome::error(message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use airlock_worker::declared::AnnotationsEntry;
    use std::collections::BTreeMap;

    fn entry(command: &[&str], schema: Value) -> ToolEntry {
        ToolEntry {
            name: "t".into(),
            title: None,
            description: "a tool".into(),
            input_schema: schema,
            annotations: AnnotationsEntry::default(),
            approval: None,
            command: Some(command.iter().map(|s| (*s).to_owned()).collect()),
            stdin: None,
            timeout_seconds: None,
            env: BTreeMap::new(),
            network: ToolNetwork::None,
            egress_allow: None,
            http: None,
        }
    }

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "rev": {"type": "string"}, "paths": {"type": "array", "items": {"type": "string"}},
            "n": {"type": "integer"}, "msg": {"type": "string"}}})
    }

    fn error(entry: &ToolEntry) -> String {
        match CommandTemplate::compile(entry) {
            Ok(_) => panic!("{entry:?} compiled"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn whole_elements_take_values_and_arrays_expand() {
        let t = CommandTemplate::compile(&entry(
            &["git", "log", "--max-count={n}", "{rev}", "--", "{paths}"],
            schema(),
        ))
        .unwrap();
        let argv = t
            .argv(&json!({"rev": "HEAD~2", "n": 3, "paths": ["a b", "-c"]}))
            .unwrap();
        assert_eq!(
            argv,
            ["git", "log", "--max-count=3", "HEAD~2", "--", "a b", "-c"]
        );
        // Absent optional fields leave no element at all (not an empty string).
        assert_eq!(t.argv(&json!({})).unwrap(), ["git", "log", "--"]);
    }

    #[test]
    fn a_value_that_would_be_an_option_is_refused_before_the_separator() {
        let t = CommandTemplate::compile(&entry(
            &["git", "fetch", "{rev}", "--", "{paths}"],
            schema(),
        ))
        .unwrap();
        for attack in ["--upload-pack=touch /tmp/pwned", "-c", "-"] {
            let e = t.argv(&json!({"rev": attack})).unwrap_err();
            assert!(e.contains("starts with '-'") && e.contains("git"), "{e}");
        }
        // After "--" the same value is a plain operand.
        assert!(t.argv(&json!({"paths": ["--upload-pack=x"]})).is_ok());
        // Attached to an option, it is that option's value.
        let t = CommandTemplate::compile(&entry(&["git", "commit", "--message={msg}"], schema()))
            .unwrap();
        assert_eq!(
            t.argv(&json!({"msg": "--amend"})).unwrap(),
            ["git", "commit", "--message=--amend"]
        );
    }

    #[test]
    fn start_up_errors_name_the_tool_and_the_field() {
        let e = error(&entry(&["echo", "{nope}"], schema()));
        assert!(
            e.contains("[[tools]] t") && e.contains("\"nope\"") && e.contains("command[1]"),
            "{e}"
        );
        let e = error(&entry(&["echo", "x{rev}"], schema()));
        assert!(e.contains("inside other text"), "{e}");
        let e = error(&entry(&["{rev}"], schema()));
        assert!(e.contains("command[0]"), "{e}");
        let e = error(&entry(
            &["echo"],
            json!({"type": "object", "properties": {"a": {"type": 5}}}),
        ));
        assert!(e.contains("not valid JSON Schema"), "{e}");
        let e = error(&entry(&["echo"], json!({"type": "string"})));
        assert!(e.contains("\"type\": \"object\""), "{e}");
        let mut bad = entry(&["cat"], schema());
        bad.stdin = Some("{n}".into());
        assert!(error(&bad).contains("must be of type \"string\""));
        let mut bad = entry(&["cat"], schema());
        bad.name = "execute_shell".into();
        assert!(error(&bad).contains("built-in"));
        let e = compile_all(&[entry(&["a"], schema()), entry(&["b"], schema())], &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains("defined twice"), "{e}");
        assert!(
            compile_all(&[], &["nope".into()])
                .unwrap_err()
                .to_string()
                .contains("unknown pack")
        );
    }

    #[test]
    fn the_dev_pack_compiles() {
        let tools = compile_all(&[], &["dev".into()]).unwrap();
        let names: Vec<&str> = tools.iter().map(CommandTemplate::name).collect();
        assert_eq!(
            names,
            [
                "git_status",
                "git_diff",
                "git_log",
                "git_commit",
                "execute_python",
                "pip_install",
                "npm_install"
            ]
        );
        let commit = tools.iter().find(|t| t.name() == "git_commit").unwrap();
        assert!(commit.definition.annotations.destructive);
        assert!(
            tools
                .iter()
                .find(|t| t.name() == "git_status")
                .unwrap()
                .definition
                .annotations
                .read_only
        );
    }
}
