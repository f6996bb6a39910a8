//! Step 4 and the "needs approval?" half of step 5 of the gate (DESIGN §3): Cedar policy.
//!
//! # Model
//!
//! - **principal** `Airlock::Principal::"<name>"`, a member of `Airlock::Role::"<role>"`
//!   for each of its roles (`agent`, `approver`, `admin`).
//! - **action** `Airlock::Action::"<tool name>"`: one action per tool, so "action = the
//!   tool" as DESIGN §3 says. Each action is a member of its worker group
//!   (`Action::"fs"`, …) and of its annotation groups (`Action::"destructive"`, …), so
//!   `action in Airlock::Action::"destructive"` works. Actions are declared in the
//!   embedded schema (`deploy/policies/schema.cedarschema`), which is what makes strict
//!   validation useful: each action has its *own* context type, so
//!   `context.arguments.path` type-checks for `write_file` and a typo such as
//!   `context.arguments.pth` is refused at load with file, line and a "did you mean"
//!   hint. (With a single `call` action and the tool as the resource, the arguments
//!   would have to be an untyped open record and such typos would only ever fail
//!   silently at run time.) The cost: a tool the schema does not declare is denied and
//!   invisible, whatever the policy — fail closed; adding a tool means adding it to the
//!   schema and to the table in `catalog.rs`.
//! - **resource** `Airlock::Tool::"<tool name>"` with attributes `group`, `read_only`,
//!   `destructive`, `idempotent`, `open_world` taken from the worker's
//!   [`ToolDefinition`] (the action groups follow the catalog of DESIGN §4 instead).
//! - **context** `{ session_id, arguments, … }`, see the schema's header for the
//!   normalisation of paths and URLs and the derived `program`/`shell`/`env_names`/`url`.
//!
//! # Decisions
//!
//! Forbid wins over everything; no satisfied permit means deny. A forbid policy that
//! fails to evaluate denies too (Cedar itself would skip it). When the call is allowed,
//! it needs approval if the `[approvals] tools` knob says so *or* if any satisfied permit
//! carries `@approval("required")` (such a permit also grants the call: "may call, with
//! a human's approval"). Policies can add approvals, never remove the knob's.
//!
//! Policies are named by their `@id("…")` annotation (else Cedar's `policy<N>`); an
//! optional `@reason("…")` is quoted in denial and approval reasons.
#![forbid(unsafe_code)]

mod approval;
mod catalog;
mod declared;
mod extension;
mod source;

use std::borrow::Cow;
use std::collections::{HashMap, HashSet};
use std::fmt;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use cedar_policy as cedar;
use serde::Serialize;
use serde_json::Value;

pub use approval::{
    ApprovalKnob, DEFAULT_APPROVAL_TOOLS, METHOD_OVERRIDE_HEADERS, SAFE_HTTP_METHODS,
};
pub use catalog::{ArgumentError, NOT_IN_CONTEXT};
pub use declared::{ANNOTATION_GROUPS, check_tool, expected_input_schema};
pub use extension::{BUILT_IN_GROUPS, ExtensionError, ToolExtension, ToolExtensions};

use crate::tool::ToolDefinition;

/// The entity schema every policy is validated against.
pub const SCHEMA_SOURCE: &str = include_str!("../../../../deploy/policies/schema.cedarschema");

/// The policy `airlock up` uses when no `[policy]` file is configured.
pub const DEFAULT_POLICY_SOURCE: &str = include_str!("../../../../deploy/policies/default.cedar");

/// The name under which errors in [`DEFAULT_POLICY_SOURCE`] are reported.
pub const DEFAULT_POLICY_FILE_NAME: &str = "<embedded>/deploy/policies/default.cedar";

/// Why a policy file cannot be loaded. Lines and columns are 1-based; columns count
/// characters.
#[derive(Debug, thiserror::Error)]
pub enum PolicyError {
    // The io error is in the message, so it is not also the `source()`: a printed chain
    // would show it twice.
    #[error("cannot read policy file {file}: {error}")]
    Read { file: String, error: std::io::Error },
    #[error("{file}:{line}:{column}: syntax error: {message}")]
    Parse {
        file: String,
        line: usize,
        column: usize,
        message: String,
    },
    #[error(
        "{file}:{line}:{column}: policy `{policy_id}` does not validate against the schema: {message}"
    )]
    Validation {
        file: String,
        line: usize,
        column: usize,
        policy_id: String,
        message: String,
    },
    #[error("{file}:{line}:{column}: policy `{policy_id}`: {message}")]
    Annotation {
        file: String,
        line: usize,
        column: usize,
        policy_id: String,
        message: String,
    },
    #[error("the embedded policy schema is invalid: {message}")]
    Schema { message: String },
}

impl PolicyError {
    /// The file, line and column the error points at, when it points at one.
    pub fn location(&self) -> Option<(&str, usize, usize)> {
        match self {
            Self::Parse {
                file, line, column, ..
            }
            | Self::Validation {
                file, line, column, ..
            }
            | Self::Annotation {
                file, line, column, ..
            } => Some((file, *line, *column)),
            Self::Read { .. } | Self::Schema { .. } => None,
        }
    }
}

/// The most distinct approvers `@quorum` may ask for: more would be a typo, and a call
/// nobody can ever run.
pub const MAX_QUORUM: u32 = 16;

/// The outcome of [`Authorizer::decide`]. Strictest wins: deny, then approval, then
/// allow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "decision", rename_all = "snake_case")]
pub enum Decision {
    Allow,
    RequireApproval {
        reasons: Vec<String>,
        /// How many distinct approvers must approve: the largest of `[approvals]
        /// quorum` for the tool and the `@quorum` of the policies that asked (at least 1).
        quorum: u32,
    },
    Deny {
        reasons: Vec<String>,
    },
}

impl Decision {
    /// The reasons of an approval or a denial (none for `Allow`).
    pub fn reasons(&self) -> &[String] {
        match self {
            Self::Allow => &[],
            Self::RequireApproval { reasons, .. } | Self::Deny { reasons } => reasons,
        }
    }

    pub fn is_deny(&self) -> bool {
        matches!(self, Self::Deny { .. })
    }

    fn deny(reason: String) -> Self {
        Self::Deny {
            reasons: vec![reason],
        }
    }
}

/// Who is calling: the authenticated principal and its roles (never the model).
#[derive(Debug, Clone, Copy)]
pub struct PrincipalRef<'a> {
    pub name: &'a str,
    pub roles: &'a [String],
}

/// One call to authorise, after its arguments passed the tool's JSON Schema.
#[derive(Debug, Clone, Copy)]
pub struct CallRequest<'a> {
    pub principal: &'a str,
    pub roles: &'a [String],
    pub tool: &'a ToolDefinition,
    pub arguments: &'a Value,
    pub session_id: &'a str,
    /// The call's workspace directory on the host, if known: absolute fs paths inside
    /// it are made relative before policies see them (so a path rule cannot be dodged
    /// by spelling the path absolutely).
    pub workspace: Option<&'a Path>,
}

impl CallRequest<'_> {
    pub fn principal_ref(&self) -> PrincipalRef<'_> {
        PrincipalRef {
            name: self.principal,
            roles: self.roles,
        }
    }
}

#[derive(Debug)]
struct PolicyMeta {
    forbid: bool,
    approval: bool,
    /// `@quorum("N")`: the distinct approvers the calls it holds need.
    quorum: Option<u32>,
    reason: Option<String>,
}

#[derive(Debug)]
struct Types {
    principal: cedar::EntityTypeName,
    role: cedar::EntityTypeName,
    tool: cedar::EntityTypeName,
    action: cedar::EntityTypeName,
}

impl Types {
    fn new() -> Result<Self, PolicyError> {
        let parse = |name: &str| {
            cedar::EntityTypeName::from_str(name).map_err(|error| PolicyError::Schema {
                message: format!("bad entity type name {name}: {error}"),
            })
        };
        Ok(Self {
            principal: parse("Airlock::Principal")?,
            role: parse("Airlock::Role")?,
            tool: parse("Airlock::Tool")?,
            action: parse("Airlock::Action")?,
        })
    }

    fn uid(ty: &cedar::EntityTypeName, id: &str) -> cedar::EntityUid {
        cedar::EntityUid::from_type_name_and_id(ty.clone(), cedar::EntityId::new(id))
    }
}

/// A loaded, validated policy plus the approval knob. Immutable, `Send + Sync`: share it
/// behind an `Arc` and swap the `Arc` on reload.
pub struct Authorizer {
    file: String,
    /// The policy text, kept to validate it again when the catalog's tools change.
    source: String,
    policies: cedar::PolicySet,
    meta: HashMap<cedar::PolicyId, PolicyMeta>,
    schema: cedar::Schema,
    types: Types,
    approvals: ApprovalKnob,
    extensions: Arc<ToolExtensions>,
    warnings: Vec<String>,
    /// The entities of calls decided so far (see [`Authorizer::call_entities`]).
    entities_memo: std::sync::Mutex<HashMap<EntitiesKey, Arc<cedar::Entities>>>,
}

/// What a call's entities are built from: the principal and its roles, and the tool and
/// its annotations (the tool's group comes from the policy's own tables).
type EntitiesKey = (String, Vec<String>, String, crate::tool::ToolAnnotations);

/// Remembered entity sets before the memo starts over.
const ENTITIES_MEMO: usize = 10_000;

/// What a policy is validated and decided against besides its own text: the approval
/// knob and the tools that are not built in.
#[derive(Debug, Clone, Default)]
pub struct PolicyInputs {
    pub approvals: ApprovalKnob,
    pub extensions: Arc<ToolExtensions>,
}

impl From<ApprovalKnob> for PolicyInputs {
    fn from(approvals: ApprovalKnob) -> Self {
        Self {
            approvals,
            extensions: Arc::default(),
        }
    }
}

impl fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authorizer")
            .field("file", &self.file)
            .field("policies", &self.meta.len())
            .field("approvals", &self.approvals)
            .finish_non_exhaustive()
    }
}

impl Authorizer {
    /// Parses `policy_text` (named `policy_file_name` in errors) and validates it against
    /// the embedded schema in strict mode.
    pub fn from_sources(
        policy_text: &str,
        policy_file_name: &str,
        inputs: impl Into<PolicyInputs>,
    ) -> Result<Self, PolicyError> {
        let PolicyInputs {
            approvals,
            extensions,
        } = inputs.into();
        let file = policy_file_name;
        let schema = schema(&extensions)?;
        let types = Types::new()?;
        let at = |offset: usize| source::line_column(policy_text, offset);

        let parsed = cedar::PolicySet::from_str(policy_text).map_err(|errors| {
            let (line, column) = source::first_offset(&errors).map_or((1, 1), at);
            PolicyError::Parse {
                file: file.to_owned(),
                line,
                column,
                message: source::message(&errors),
            }
        })?;
        if parsed.templates().next().is_some() {
            let offset = ["?principal", "?resource"]
                .iter()
                .filter_map(|slot| policy_text.find(slot))
                .min()
                .unwrap_or(0);
            let (line, column) = at(offset);
            return Err(PolicyError::Annotation {
                file: file.to_owned(),
                line,
                column,
                policy_id: "template".to_owned(),
                message: "templates (?principal, ?resource) are not supported".to_owned(),
            });
        }

        let (policies, meta, offsets) = rename_policies(&parsed, policy_text, file)?;

        let validator = cedar::Validator::new(schema.clone());
        let result = validator.validate(&policies, cedar::ValidationMode::Strict);
        let located = |id: &cedar::PolicyId, diagnostic: &dyn miette::Diagnostic| {
            source::first_offset(diagnostic)
                .or_else(|| offsets.get(id).copied())
                .unwrap_or(0)
        };
        let mut errors: Vec<(usize, &cedar::ValidationError)> = result
            .validation_errors()
            .map(|error| (located(error.policy_id(), error), error))
            .collect();
        errors.sort_by_key(|(offset, _)| *offset);
        if let Some((offset, error)) = errors.first() {
            let (line, column) = at(*offset);
            let policy_id = error.policy_id().to_string();
            let mut message = source::message(*error);
            // Cedar starts with "for policy `x`, ", which the error already says.
            if let Some(rest) = message.strip_prefix(&format!("for policy `{policy_id}`, ")) {
                message = rest.to_owned();
            }
            if errors.len() > 1 {
                message.push_str(&format!(
                    " (and {} more validation errors)",
                    errors.len() - 1
                ));
            }
            return Err(PolicyError::Validation {
                file: file.to_owned(),
                line,
                column,
                policy_id,
                message,
            });
        }
        let warnings = result
            .validation_warnings()
            .map(|warning| {
                let (line, column) = at(located(warning.policy_id(), warning));
                format!("{file}:{line}:{column}: {}", source::message(warning))
            })
            .collect();

        Ok(Self {
            file: file.to_owned(),
            source: policy_text.to_owned(),
            policies,
            meta,
            schema,
            types,
            approvals,
            extensions,
            warnings,
            entities_memo: std::sync::Mutex::default(),
        })
    }

    /// Reads and loads a policy file. On error the caller keeps its previous
    /// `Authorizer` (reload) or refuses to start.
    pub fn load_file(path: &Path, inputs: impl Into<PolicyInputs>) -> Result<Self, PolicyError> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| PolicyError::Read {
            file: file.clone(),
            error,
        })?;
        Self::from_sources(&text, &file, inputs)
    }

    /// The embedded default policy of `airlock up` (`deploy/policies/default.cedar`).
    pub fn default_policy(inputs: impl Into<PolicyInputs>) -> Result<Self, PolicyError> {
        Self::from_sources(DEFAULT_POLICY_SOURCE, DEFAULT_POLICY_FILE_NAME, inputs)
    }

    /// The file the policy was loaded from (as given).
    pub fn file(&self) -> &str {
        &self.file
    }

    /// The policy text as loaded: its digest identifies the policy a decision was
    /// taken under.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The approval knob in force.
    pub fn approvals(&self) -> &ApprovalKnob {
        &self.approvals
    }

    /// Validator warnings (`file:line:column: message`), e.g. a policy that can never
    /// apply; worth logging at load.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// The ids of the loaded policies, sorted.
    pub fn policy_ids(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.meta.keys().map(ToString::to_string).collect();
        ids.sort();
        ids
    }

    /// Decides one call: deny, require approval, or allow.
    pub fn decide(&self, request: &CallRequest<'_>) -> Decision {
        let tool = request.tool.name.as_str();
        let extension = self.extensions.get(tool);
        // The arguments as the worker's own schema defines them (`ListTools`).
        let (spec, fields) = match (catalog::spec(tool), extension) {
            (Some(spec), _) => match catalog::fields(spec, &request.tool.input_schema) {
                Ok(fields) => (spec, Cow::Owned(fields)),
                Err(problems) => {
                    return Decision::deny(format!(
                        "the policy cannot see every argument of `{tool}`: {}",
                        problems.join("; ")
                    ));
                }
            },
            (None, Some(extended)) => {
                // The arguments were typed from the declared definition; a worker that
                // serves another one is refused by the catalog, and denied here too.
                if extended.definition.input_schema != request.tool.input_schema {
                    return Decision::deny(format!(
                        "`{tool}` is served with another input schema than policies were built from"
                    ));
                }
                (&extended.spec, Cow::Borrowed(extended.fields.as_slice()))
            }
            (None, None) => {
                return Decision::deny(format!(
                    "tool `{tool}` is not declared in the policy schema"
                ));
            }
        };
        let network = match extension {
            Some(extended) if catalog::spec(tool).is_none() => extended.network.as_deref(),
            _ if spec.extra == catalog::Extra::Shell => Some(self.extensions.shell_network()),
            _ => None,
        };
        let context = match catalog::context_json(
            spec,
            &fields,
            request.arguments,
            request.session_id,
            request.workspace,
            network,
        ) {
            Ok(context) => context,
            Err(error) => return Decision::deny(error.to_string()),
        };
        let principal = Types::uid(&self.types.principal, request.principal);
        let action = Types::uid(&self.types.action, tool);
        let resource = Types::uid(&self.types.tool, tool);
        // Built directly rather than parsed from JSON against the schema: the parse tries
        // every value as an extension value first and builds an error each time, which
        // cost more than the rest of the decision. The schema still has its say:
        // `Request::new` below checks the context against the action's context type.
        let context = match cedar_context(context) {
            Ok(context) => context,
            Err(error) => {
                return Decision::deny(format!(
                    "the arguments of `{tool}` cannot be checked by policy: {error}"
                ));
            }
        };
        let cedar_request =
            match cedar::Request::new(principal, action, resource, context, Some(&self.schema)) {
                Ok(request) => request,
                Err(error) => {
                    return Decision::deny(format!(
                        "the call cannot be checked by policy: {error}"
                    ));
                }
            };
        let entities = match self.call_entities(&request.principal_ref(), request.tool) {
            Ok(entities) => entities,
            Err(error) => return Decision::deny(error),
        };
        let response =
            cedar::Authorizer::new().is_authorized(&cedar_request, &self.policies, &entities);
        let diagnostics = response.diagnostics();

        let mut denials = Vec::new();
        let mut approvals = Vec::new();
        for error in diagnostics.errors() {
            let cedar::AuthorizationError::PolicyEvaluationError(error) = error;
            let id = error.policy_id();
            match self.meta.get(id) {
                Some(meta) if meta.forbid => denials.push(format!(
                    "forbid policy `{id}` failed to evaluate ({}), so the call is denied",
                    error.inner()
                )),
                Some(meta) if meta.approval => approvals.push(format!(
                    "approval policy `{id}` failed to evaluate ({}), so approval is required",
                    error.inner()
                )),
                _ => {}
            }
        }

        if response.decision() == cedar::Decision::Deny {
            for id in diagnostics.reason() {
                denials.push(self.describe(id, "forbidden by policy"));
            }
            if denials.is_empty() || diagnostics.reason().next().is_none() {
                denials.push(format!(
                    "no policy permits principal `{}` to call `{tool}`",
                    request.principal
                ));
            }
            return Decision::Deny { reasons: denials };
        }
        if !denials.is_empty() {
            return Decision::Deny { reasons: denials };
        }
        if let Some(reason) = self.approvals.requires(tool, request.arguments) {
            approvals.insert(0, reason);
        }
        if let Some(reason) = extension.and_then(|extended| extended.approval.as_ref()) {
            approvals.insert(0, reason.clone());
        }
        let mut quorum = self.approvals.quorum(tool);
        for id in diagnostics.reason() {
            if let Some(meta) = self.meta.get(id).filter(|meta| meta.approval) {
                approvals.push(self.describe(id, "approval required by policy"));
                quorum = quorum.max(meta.quorum.unwrap_or(1));
            }
        }
        if approvals.is_empty() {
            Decision::Allow
        } else {
            Decision::RequireApproval {
                reasons: approvals,
                quorum,
            }
        }
    }

    /// Whether `tool` belongs in `principal`'s catalog: `false` only when no call of the
    /// tool can be allowed for this principal whatever its arguments and session — a
    /// forbid applies unconditionally, or no permit can apply. Decided by Cedar partial
    /// evaluation with the context unknown: policies whose conditions read the context
    /// stay residual and keep the tool visible (a tool undeclared in the schema is never
    /// visible).
    pub fn visible(&self, principal: &PrincipalRef<'_>, tool: &ToolDefinition) -> bool {
        if self.spec(&tool.name).is_none() {
            return false;
        }
        let Ok(entities) = self.entities(principal, tool) else {
            return false;
        };
        let request = cedar::Request::builder()
            .principal(Types::uid(&self.types.principal, principal.name))
            .action(Types::uid(&self.types.action, &tool.name))
            .resource(Types::uid(&self.types.tool, &tool.name))
            .build();
        let response =
            cedar::Authorizer::new().is_authorized_partial(&request, &self.policies, &entities);
        response.decision() != Some(cedar::Decision::Deny)
    }

    /// The same policy validated again with other extension tools (an external worker
    /// listed new ones): the new authorizer, or why the policy no longer validates.
    pub fn with_extensions(&self, extensions: Arc<ToolExtensions>) -> Result<Self, PolicyError> {
        Self::from_sources(
            &self.source,
            &self.file,
            PolicyInputs {
                approvals: self.approvals.clone(),
                extensions,
            },
        )
    }

    /// The tools that are not built in, as this authorizer was built with them.
    pub fn extensions(&self) -> &Arc<ToolExtensions> {
        &self.extensions
    }

    /// What policies know of `tool`: a built-in's table entry or an extension's.
    fn spec(&self, tool: &str) -> Option<&catalog::ToolSpec> {
        catalog::spec(tool).or_else(|| self.extensions.get(tool).map(|e| &e.spec))
    }

    fn describe(&self, id: &cedar::PolicyId, what: &str) -> String {
        match self.meta.get(id).and_then(|meta| meta.reason.as_deref()) {
            Some(reason) => format!("{what} `{id}`: {reason}"),
            None => format!("{what} `{id}`"),
        }
    }

    /// [`Authorizer::entities`], remembered: they depend only on the key's parts and on
    /// this authorizer (a reloaded policy is a new authorizer with an empty memo), and
    /// building and validating them against the schema is a good part of a decision.
    fn call_entities(
        &self,
        principal: &PrincipalRef<'_>,
        tool: &ToolDefinition,
    ) -> Result<Arc<cedar::Entities>, String> {
        let key: EntitiesKey = (
            principal.name.to_owned(),
            principal.roles.to_vec(),
            tool.name.clone(),
            tool.annotations,
        );
        if let Some(known) = self.remembered_entities().get(&key) {
            return Ok(Arc::clone(known));
        }
        let entities = Arc::new(self.entities(principal, tool)?);
        let mut remembered = self.remembered_entities();
        if remembered.len() >= ENTITIES_MEMO {
            remembered.clear();
        }
        remembered.insert(key, Arc::clone(&entities));
        Ok(entities)
    }

    /// The memo of [`Authorizer::call_entities`]; a panic while it was held left it whole
    /// (each change is one insert or one clear).
    fn remembered_entities(
        &self,
    ) -> std::sync::MutexGuard<'_, HashMap<EntitiesKey, Arc<cedar::Entities>>> {
        match self.entities_memo.lock() {
            Ok(guard) => guard,
            Err(poisoned) => poisoned.into_inner(),
        }
    }

    /// The principal, its roles and the tool as Cedar entities (the schema adds the
    /// action entities and their groups).
    fn entities(
        &self,
        principal: &PrincipalRef<'_>,
        tool: &ToolDefinition,
    ) -> Result<cedar::Entities, String> {
        let group = self.spec(&tool.name).map_or("", |spec| &*spec.group);
        let roles: HashSet<cedar::EntityUid> = principal
            .roles
            .iter()
            .map(|role| Types::uid(&self.types.role, role))
            .collect();
        let mut entities: Vec<cedar::Entity> = roles
            .iter()
            .map(|role| cedar::Entity::new_no_attrs(role.clone(), HashSet::new()))
            .collect();
        entities.push(cedar::Entity::new_no_attrs(
            Types::uid(&self.types.principal, principal.name),
            roles,
        ));
        let annotations = tool.annotations;
        let attributes = HashMap::from([
            (
                "group".to_owned(),
                cedar::RestrictedExpression::new_string(group.to_owned()),
            ),
            (
                "read_only".to_owned(),
                cedar::RestrictedExpression::new_bool(annotations.read_only),
            ),
            (
                "destructive".to_owned(),
                cedar::RestrictedExpression::new_bool(annotations.destructive),
            ),
            (
                "idempotent".to_owned(),
                cedar::RestrictedExpression::new_bool(annotations.idempotent),
            ),
            (
                "open_world".to_owned(),
                cedar::RestrictedExpression::new_bool(annotations.open_world),
            ),
        ]);
        let tool_entity = cedar::Entity::new(
            Types::uid(&self.types.tool, &tool.name),
            attributes,
            HashSet::new(),
        )
        .map_err(|error| format!("tool `{}` cannot be given to policy: {error}", tool.name))?;
        entities.push(tool_entity);
        cedar::Entities::from_entities(entities, Some(&self.schema))
            .map_err(|error| format!("the call cannot be checked by policy: {error}"))
    }
}

/// A call's context (as [`catalog::context_json`] builds it: strings, integers, booleans,
/// and sets and records of them) as a Cedar context. Anything else is refused, so the
/// call is denied.
fn cedar_context(context: Value) -> Result<cedar::Context, String> {
    let Value::Object(attributes) = context else {
        return Err("the context is not a record".to_owned());
    };
    let pairs = attributes
        .into_iter()
        .map(|(name, value)| Ok((name, restricted_expression(value)?)))
        .collect::<Result<Vec<_>, String>>()?;
    cedar::Context::from_pairs(pairs).map_err(|error| error.to_string())
}

fn restricted_expression(value: Value) -> Result<cedar::RestrictedExpression, String> {
    Ok(match value {
        Value::Bool(flag) => cedar::RestrictedExpression::new_bool(flag),
        Value::String(text) => cedar::RestrictedExpression::new_string(text),
        Value::Number(number) => match number.as_i64() {
            Some(long) => cedar::RestrictedExpression::new_long(long),
            None => return Err(format!("{number} is not a Cedar integer")),
        },
        Value::Array(items) => cedar::RestrictedExpression::new_set(
            items
                .into_iter()
                .map(restricted_expression)
                .collect::<Result<Vec<_>, _>>()?,
        ),
        Value::Object(fields) => cedar::RestrictedExpression::new_record(
            fields
                .into_iter()
                .map(|(name, value)| Ok((name, restricted_expression(value)?)))
                .collect::<Result<Vec<_>, String>>()?,
        )
        .map_err(|error| error.to_string())?,
        Value::Null => return Err("null has no Cedar value".to_owned()),
    })
}

/// The embedded schema, plus a fragment declaring the extension tools when there are
/// any.
fn schema(extensions: &ToolExtensions) -> Result<cedar::Schema, PolicyError> {
    if extensions.is_empty() {
        return cedar::Schema::from_cedarschema_str(SCHEMA_SOURCE)
            .map(|(schema, _warnings)| schema)
            .map_err(|error| PolicyError::Schema {
                message: source::message(&error),
            });
    }
    let fragment = |text: &str, what: &str| {
        cedar::SchemaFragment::from_cedarschema_str(text)
            .map(|(fragment, _warnings)| fragment)
            .map_err(|error| PolicyError::Schema {
                message: format!("{what}: {}", source::message(&error)),
            })
    };
    let base = fragment(SCHEMA_SOURCE, "the embedded schema")?;
    let extended = fragment(
        &extensions.cedar_schema(),
        "the schema of the declared tools",
    )?;
    cedar::Schema::from_schema_fragments([base, extended]).map_err(|error| PolicyError::Schema {
        message: format!(
            "the declared tools do not fit the embedded schema: {}",
            source::message(&error)
        ),
    })
}

/// The whole Cedar schema policies are validated against, as text: the embedded one and
/// the fragment of the extension tools (`airlock policy schema`).
pub fn schema_text(extensions: &ToolExtensions) -> String {
    if extensions.is_empty() {
        SCHEMA_SOURCE.to_owned()
    } else {
        format!("{SCHEMA_SOURCE}\n{}", extensions.cedar_schema())
    }
}

type Renamed = (
    cedar::PolicySet,
    HashMap<cedar::PolicyId, PolicyMeta>,
    HashMap<cedar::PolicyId, usize>,
);

/// Gives each policy the id of its `@id` annotation and checks the annotations Airlock
/// reads. Returns the renamed set, each policy's metadata and its byte offset in the
/// file.
fn rename_policies(
    parsed: &cedar::PolicySet,
    text: &str,
    file: &str,
) -> Result<Renamed, PolicyError> {
    // Cedar numbers policies `policy0`, `policy1`, … in file order; each policy's text is
    // the exact slice of the file it came from, which locates it.
    let mut ordered: Vec<&cedar::Policy> = parsed.policies().collect();
    ordered.sort_by_key(|policy| {
        policy
            .id()
            .to_string()
            .strip_prefix("policy")
            .and_then(|n| n.parse::<usize>().ok())
            .unwrap_or(usize::MAX)
    });
    let mut cursor = 0;
    let mut policies = cedar::PolicySet::new();
    let mut meta = HashMap::new();
    let mut offsets = HashMap::new();
    for policy in ordered {
        let offset = policy
            .to_cedar()
            .and_then(|slice| {
                let start = cursor + text.get(cursor..)?.find(&slice)?;
                cursor = start + slice.len();
                Some(start)
            })
            .unwrap_or(cursor);
        let fail = |id: &str, message: String| {
            let (line, column) = source::line_column(text, offset);
            PolicyError::Annotation {
                file: file.to_owned(),
                line,
                column,
                policy_id: id.to_owned(),
                message,
            }
        };
        let id = match policy.annotation("id") {
            Some(id) if id.trim().is_empty() => {
                return Err(fail(
                    policy.id().as_ref(),
                    "@id must not be empty".to_owned(),
                ));
            }
            Some(id) => id.to_owned(),
            None => policy.id().to_string(),
        };
        let policy_id = cedar::PolicyId::new(&id);
        if meta.contains_key(&policy_id) {
            return Err(fail(
                &id,
                format!("@id(\"{id}\") names more than one policy"),
            ));
        }
        let forbid = policy.effect() == cedar::Effect::Forbid;
        let approval = match policy.annotation("approval") {
            None => false,
            Some("required") if !forbid => true,
            Some("required") => {
                return Err(fail(
                    &id,
                    "@approval(\"required\") belongs on a permit policy; a forbid policy denies"
                        .to_owned(),
                ));
            }
            Some(other) => {
                return Err(fail(
                    &id,
                    format!("@approval must be \"required\", not \"{other}\""),
                ));
            }
        };
        // `@quorum("N")` asks for N distinct approvers; it implies `@approval("required")`
        // since a quorum of approvers only means something for a held call.
        let quorum = match policy.annotation("quorum") {
            None => None,
            Some(_) if forbid => {
                return Err(fail(
                    &id,
                    "@quorum belongs on a permit policy; a forbid policy denies".to_owned(),
                ));
            }
            Some(n) => match n.trim().parse::<u32>() {
                Ok(n) if (1..=MAX_QUORUM).contains(&n) => Some(n),
                _ => {
                    return Err(fail(
                        &id,
                        format!(
                            "@quorum must be a number of approvers from 1 to {MAX_QUORUM}, not \"{n}\""
                        ),
                    ));
                }
            },
        };
        let approval = approval || quorum.is_some();
        let reason = policy.annotation("reason").map(str::to_owned);
        policies
            .add(policy.new_id(policy_id.clone()))
            .map_err(|error| fail(&id, source::message(&error)))?;
        offsets.insert(policy_id.clone(), offset);
        meta.insert(
            policy_id,
            PolicyMeta {
                forbid,
                approval,
                quorum,
                reason,
            },
        );
    }
    Ok((policies, meta, offsets))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assert_send_sync<T: Send + Sync>() {}

    #[test]
    fn authorizer_is_shareable() {
        assert_send_sync::<Authorizer>();
    }

    /// `decide` builds the context without the schema, so the request's own check must
    /// still refuse one that does not fit the action's context type.
    #[test]
    fn a_context_that_does_not_fit_the_schema_is_refused() {
        let schema = schema(&ToolExtensions::default()).unwrap();
        let types = Types::new().unwrap();
        let request = |context: Value| {
            cedar::Request::new(
                Types::uid(&types.principal, "p"),
                Types::uid(&types.action, "read_file"),
                Types::uid(&types.tool, "read_file"),
                cedar_context(context).unwrap(),
                Some(&schema),
            )
            .map(drop)
            .map_err(|error| error.to_string())
        };
        let fits =
            serde_json::json!({"session_id": "s", "paths": ["a"], "arguments": {"path": "a"}});
        request(fits).unwrap();
        let wrong_type =
            serde_json::json!({"session_id": 5, "paths": ["a"], "arguments": {"path": "a"}});
        assert!(request(wrong_type).is_err());
        let extra = serde_json::json!({"session_id": "s", "paths": ["a"], "arguments": {"path": "a"}, "more": true});
        assert!(request(extra).is_err());
        assert!(cedar_context(serde_json::json!({"session_id": null})).is_err());
    }

    #[test]
    fn the_schema_accepts_every_tool_s_maximal_and_minimal_context() {
        let schema = schema(&ToolExtensions::default()).unwrap();
        let types = Types::new().unwrap();
        let full = serde_json::json!({
            "command": "ls", "argv": ["ls", "-l"], "cwd": "src", "stdin": "", "env": {"A": "1"},
            "timeout_seconds": 5, "path": "src/a", "offset": 1, "limit": 2, "content": "x",
            "edits": [{"old_text": "a", "new_text": "b", "replace_all": true}], "dry_run": false,
            "recursive": true, "max_entries": 3, "glob": "*.rs", "content_regex": "x",
            "max_results": 4, "source": "a", "destination": "b", "method": "get",
            "url": "https://example.com/x", "max_response_bytes": 5, "format": "text",
            "start_index": 0, "max_length": 9, "database": "main", "table": "t",
            "sql": "select 1", "max_rows": 10
        });
        for spec in catalog::TOOLS {
            let input_schema = declared::expected_input_schema(&spec.name).unwrap();
            let fields = catalog::fields(spec, &input_schema).unwrap();
            let action = Types::uid(&types.action, &spec.name);
            let network = (spec.extra == catalog::Extra::Shell).then_some("proxy");
            let context = catalog::context_json(spec, &fields, &full, "s", None, network).unwrap();
            cedar::Context::from_json_value(context.clone(), Some((&schema, &action)))
                .unwrap_or_else(|error| panic!("{}: {error}", spec.name));
            // Built directly, as `decide` builds it, it passes the request's schema check.
            let principal = Types::uid(&types.principal, "p");
            let resource = Types::uid(&types.tool, &spec.name);
            let direct = cedar_context(context.clone()).unwrap();
            cedar::Request::new(principal, action.clone(), resource, direct, Some(&schema))
                .unwrap_or_else(|error| panic!("{} (direct): {error}", spec.name));
            // The required fields alone are enough too.
            let mut minimal = serde_json::Map::new();
            for field in fields.iter().filter(|field| field.required) {
                minimal.insert(field.name.clone(), full[&field.name].clone());
            }
            let context =
                catalog::context_json(spec, &fields, &Value::Object(minimal), "s", None, network)
                    .unwrap();
            cedar::Context::from_json_value(context, Some((&schema, &action)))
                .unwrap_or_else(|error| panic!("{} (minimal): {error}", spec.name));
        }
    }
}
