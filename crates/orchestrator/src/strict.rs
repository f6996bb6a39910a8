//! OpenAI strict mode: the strict variant of a tool's schema, and the way back.
//!
//! OpenAI's strict function calling (`"strict": true`) accepts only a subset of JSON
//! Schema: every object closed (`additionalProperties: false`) with every property
//! listed in `required`, no `oneOf` or constraint-only keywords, no `default`, no free-form
//! maps. The tools' own schemas are richer, so `GET /v1/tools?format=openai&strict=true`
//! serves a variant derived here, and every call is brought back to the tool's own
//! spelling by [`normalize_input`] before the gate validates it against the full schema:
//!
//! - An optional property becomes required and nullable; `null` then means "absent".
//! - A map (`{"type": "object", "additionalProperties": {...}}`, e.g. `env`, `headers`)
//!   becomes a list of `{"name", "value"}` pairs.
//! - Keywords strict mode does not take (`minLength`, `maxLength`, `default`, `oneOf` of
//!   `required` lists, `not`, `if`/`then`/`else`, ...) are left out of the variant; the
//!   gate still enforces them, so a call that breaks one gets an error result that says
//!   which. A dropped `default` is kept in words in the description.
//!
//! The normalisation runs on every call, from any front door: a strict client and a
//! non-strict one that sent the tool's own spelling end up with the same arguments.

use serde_json::{Map, Value, json};

#[derive(Debug, thiserror::Error)]
pub enum StrictError {
    /// The schema has a construct strict mode cannot express without changing which
    /// arguments it accepts (a free-form object, `patternProperties`, a root union, ...).
    #[error("{at}: {reason}")]
    NotExpressible { at: String, reason: String },
}

/// Keywords copied into the strict variant as they are (besides the structural ones,
/// which are rebuilt).
const KEPT: &[&str] = &[
    "title",
    "description",
    "enum",
    "const",
    "pattern",
    "multipleOf",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minItems",
    "maxItems",
];

/// `format` values strict mode understands.
const FORMATS: &[&str] = &[
    "date-time",
    "time",
    "date",
    "duration",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "uuid",
];

/// Keywords that change which properties or items exist; dropping them would change
/// the shape of the arguments, not just loosen a constraint.
const SHAPE_CHANGING: &[&str] = &[
    "patternProperties",
    "prefixItems",
    "additionalItems",
    "dependentSchemas",
    "unevaluatedItems",
];

/// Keywords that may appear in a `oneOf`/`anyOf` branch that only says which properties
/// must be present (e.g. "`command` or `argv`"); such unions are dropped.
const PRESENCE_ONLY: &[&str] = &[
    "required",
    "not",
    "description",
    "minProperties",
    "maxProperties",
    "dependentRequired",
];

/// How deep a schema may nest before it is refused (keeps the recursion bounded).
const MAX_DEPTH: usize = 64;

/// The strict variant of a tool's input schema.
pub fn strict_schema(schema: &Value) -> Result<Value, StrictError> {
    let mut out = convert(schema, schema, "#", 0)?;
    let is_object = out.get("type").and_then(Value::as_str) == Some("object");
    if !is_object {
        return Err(not_expressible(
            "#",
            "the root must be an object with properties",
        ));
    }
    // `$defs` stay where `$ref`s expect them.
    if let Some(defs) = schema.get("$defs").and_then(Value::as_object) {
        let mut converted = Map::new();
        for (name, def) in defs {
            converted.insert(
                name.clone(),
                convert(def, schema, &format!("#/$defs/{name}"), 1)?,
            );
        }
        out["$defs"] = Value::Object(converted);
    }
    Ok(out)
}

fn not_expressible(at: &str, reason: &str) -> StrictError {
    StrictError::NotExpressible {
        at: at.to_owned(),
        reason: reason.to_owned(),
    }
}

fn convert(node: &Value, root: &Value, at: &str, depth: usize) -> Result<Value, StrictError> {
    if depth > MAX_DEPTH {
        return Err(not_expressible(at, "the schema nests too deeply"));
    }
    let Some(node) = node.as_object() else {
        return Err(not_expressible(
            at,
            "boolean schemas have no strict equivalent",
        ));
    };
    if let Some(keyword) = SHAPE_CHANGING.iter().find(|k| node.contains_key(**k)) {
        return Err(not_expressible(
            at,
            &format!("`{keyword}` has no strict equivalent"),
        ));
    }
    if let Some(reference) = node.get("$ref") {
        // A reference stays a reference; strict mode allows a description beside it.
        let mut out = Map::new();
        out.insert("$ref".into(), reference.clone());
        copy(node, &mut out, &["description"]);
        return Ok(Value::Object(out));
    }
    let mut out = Map::new();
    copy(node, &mut out, KEPT);
    if let Some(format) = node.get("format")
        && format.as_str().is_some_and(|f| FORMATS.contains(&f))
    {
        out.insert("format".into(), format.clone());
    }
    if let Some(default) = node.get("default") {
        describe_default(&mut out, default);
    }

    let types = type_names(node);
    let has_properties = node.get("properties").is_some_and(Value::is_object);
    let is_object = types.contains(&"object") || (types.is_empty() && has_properties);
    if is_object {
        if let Some(values) = map_values(node) {
            return map_as_pairs(node, values, root, at, depth, out);
        }
        object(node, root, at, depth, &mut out)?;
    } else if types.contains(&"array") {
        out.insert("type".into(), type_value(node));
        let Some(items) = node.get("items").filter(|i| i.is_object()) else {
            return Err(not_expressible(
                at,
                "an array needs an `items` schema in strict mode",
            ));
        };
        out.insert(
            "items".into(),
            convert(items, root, &format!("{at}/items"), depth + 1)?,
        );
    } else if !types.is_empty() {
        out.insert("type".into(), type_value(node));
    } else if !out.contains_key("enum") && !out.contains_key("const") && !has_union(node) {
        return Err(not_expressible(
            at,
            "a schema without a type accepts anything, which strict mode cannot express",
        ));
    }
    unions(node, root, at, depth, &mut out)?;
    Ok(Value::Object(out))
}

/// Closes an object: every property required (optional ones nullable), nothing else
/// allowed.
fn object(
    node: &Map<String, Value>,
    root: &Value,
    at: &str,
    depth: usize,
    out: &mut Map<String, Value>,
) -> Result<(), StrictError> {
    match node.get("additionalProperties") {
        None | Some(Value::Bool(false)) => {}
        Some(_) if node.get("properties").is_some() => {
            return Err(not_expressible(
                at,
                "an object with declared properties that also allows others has no strict equivalent",
            ));
        }
        Some(_) => {}
    }
    let properties = node
        .get("properties")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    if properties.is_empty() && node.get("additionalProperties") != Some(&Value::Bool(false)) {
        return Err(not_expressible(
            at,
            "an object without declared properties accepts anything, which strict mode cannot express",
        ));
    }
    let required = required_names(node);
    let mut strict_properties = Map::new();
    for (name, schema) in &properties {
        let converted = convert(schema, root, &format!("{at}/properties/{name}"), depth + 1)?;
        let converted = if required.contains(&name.as_str()) {
            converted
        } else {
            nullable(converted)
        };
        strict_properties.insert(name.clone(), converted);
    }
    out.insert("type".into(), json!("object"));
    out.insert(
        "required".into(),
        Value::Array(properties.keys().map(|k| json!(k)).collect()),
    );
    out.insert("properties".into(), Value::Object(strict_properties));
    out.insert("additionalProperties".into(), json!(false));
    Ok(())
}

/// A map becomes a list of `{"name", "value"}` pairs, which [`normalize_input`] folds back.
fn map_as_pairs(
    node: &Map<String, Value>,
    values: &Value,
    root: &Value,
    at: &str,
    depth: usize,
    mut out: Map<String, Value>,
) -> Result<Value, StrictError> {
    let mut name = json!({"type": "string"});
    if let Some(pattern) = node.get("propertyNames").and_then(|p| p.get("pattern")) {
        name["pattern"] = pattern.clone();
    }
    let value = convert(
        values,
        root,
        &format!("{at}/additionalProperties"),
        depth + 1,
    )?;
    let note = "In this strict form, give it as a list of {\"name\", \"value\"} pairs rather than an object.";
    let description = match out.get("description").and_then(Value::as_str) {
        Some(d) => format!("{d} {note}"),
        None => note.to_owned(),
    };
    out.insert("description".into(), json!(description));
    out.insert("type".into(), json!("array"));
    if let Some(max) = node.get("maxProperties") {
        out.insert("maxItems".into(), max.clone());
    }
    if let Some(min) = node.get("minProperties") {
        out.insert("minItems".into(), min.clone());
    }
    out.insert(
        "items".into(),
        json!({
            "type": "object",
            "properties": {"name": name, "value": value},
            "required": ["name", "value"],
            "additionalProperties": false,
        }),
    );
    Ok(Value::Object(out))
}

/// `oneOf`/`anyOf`/`allOf`: unions that only say which properties must be present are
/// dropped (said in words instead); nested unions of real alternatives become `anyOf`.
fn unions(
    node: &Map<String, Value>,
    root: &Value,
    at: &str,
    depth: usize,
    out: &mut Map<String, Value>,
) -> Result<(), StrictError> {
    for keyword in ["oneOf", "anyOf", "allOf"] {
        let Some(branches) = node.get(keyword) else {
            continue;
        };
        let Some(branches) = branches.as_array() else {
            return Err(not_expressible(
                at,
                &format!("`{keyword}` must be an array"),
            ));
        };
        if branches.iter().all(presence_only) {
            if let Some(note) = presence_note(keyword, branches) {
                let description = match out.get("description").and_then(Value::as_str) {
                    Some(d) => format!("{d} {note}"),
                    None => note,
                };
                out.insert("description".into(), json!(description));
            }
            continue;
        }
        if keyword == "allOf" || at == "#" || out.contains_key("properties") {
            return Err(not_expressible(
                at,
                &format!("`{keyword}` here has no strict equivalent"),
            ));
        }
        let converted = branches
            .iter()
            .enumerate()
            .map(|(i, b)| convert(b, root, &format!("{at}/{keyword}/{i}"), depth + 1))
            .collect::<Result<Vec<_>, _>>()?;
        let any_of = out.entry("anyOf").or_insert_with(|| json!([]));
        if let Some(list) = any_of.as_array_mut() {
            list.extend(converted);
        }
    }
    Ok(())
}

fn presence_only(branch: &Value) -> bool {
    branch
        .as_object()
        .is_some_and(|b| b.keys().all(|k| PRESENCE_ONLY.contains(&k.as_str())))
}

/// "Give exactly one of: command, argv." for `oneOf: [{required: [command]}, {required:
/// [argv]}]`, and the like.
fn presence_note(keyword: &str, branches: &[Value]) -> Option<String> {
    let alternatives: Vec<String> = branches
        .iter()
        .filter_map(|b| b.get("required").and_then(Value::as_array))
        .map(|names| {
            names
                .iter()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join(" and ")
        })
        .filter(|s| !s.is_empty())
        .collect();
    if alternatives.is_empty() {
        return None;
    }
    let list = alternatives.join(", ");
    Some(match keyword {
        "oneOf" => format!("Give exactly one of: {list} (leave the others null)."),
        "anyOf" => format!("Give at least one of: {list}."),
        _ => format!("Give all of: {list}."),
    })
}

/// The value schema of a map: an object that declares no properties of its own but
/// gives `additionalProperties` a schema (`env`, `headers`).
fn map_values(node: &Map<String, Value>) -> Option<&Value> {
    let declares_properties = node
        .get("properties")
        .and_then(Value::as_object)
        .is_some_and(|p| !p.is_empty());
    node.get("additionalProperties")
        .filter(|v| v.is_object() && !declares_properties)
}

fn has_union(node: &Map<String, Value>) -> bool {
    node.contains_key("anyOf") || node.contains_key("oneOf")
}

fn copy(from: &Map<String, Value>, to: &mut Map<String, Value>, keys: &[&str]) {
    for key in keys {
        if let Some(v) = from.get(*key) {
            to.insert((*key).to_owned(), v.clone());
        }
    }
}

/// Strict mode refuses `default`; the model still learns it from the description.
fn describe_default(out: &mut Map<String, Value>, default: &Value) {
    let existing = out
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_owned();
    if existing.to_ascii_lowercase().contains("default") || default.is_null() {
        return;
    }
    let note = format!("Default: {default}.");
    let description = if existing.is_empty() {
        note
    } else {
        format!("{existing} {note}")
    };
    out.insert("description".into(), json!(description));
}

fn type_names(node: &Map<String, Value>) -> Vec<&str> {
    match node.get("type") {
        Some(Value::String(t)) => vec![t.as_str()],
        Some(Value::Array(ts)) => ts.iter().filter_map(Value::as_str).collect(),
        _ => Vec::new(),
    }
}

fn type_value(node: &Map<String, Value>) -> Value {
    node.get("type").cloned().unwrap_or(Value::Null)
}

fn required_names(node: &Map<String, Value>) -> Vec<&str> {
    node.get("required")
        .and_then(Value::as_array)
        .map(|r| r.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

/// The same schema, also accepting `null`.
fn nullable(mut schema: Value) -> Value {
    if accepts_null(&schema, &schema, 0) {
        return schema;
    }
    let Some(object) = schema.as_object_mut() else {
        return schema;
    };
    let plain_type = object.contains_key("type")
        && !object.contains_key("anyOf")
        && !object.contains_key("const");
    if plain_type {
        let types = match object.get("type") {
            Some(Value::String(t)) => vec![json!(t), json!("null")],
            Some(Value::Array(ts)) => {
                let mut ts = ts.clone();
                ts.push(json!("null"));
                ts
            }
            _ => vec![json!("null")],
        };
        object.insert("type".into(), Value::Array(types));
        if let Some(Value::Array(values)) = object.get_mut("enum") {
            values.push(Value::Null);
        }
        return schema;
    }
    // `$ref`s, `const`s and unions: wrap, keeping the description outside.
    let description = object.remove("description");
    let mut wrapped = json!({"anyOf": [schema, {"type": "null"}]});
    if let Some(d) = description {
        wrapped["description"] = d;
    }
    wrapped
}

/// Whether `schema` accepts `null` (conservatively: unknown means yes, so a meaningful
/// `null` is never thrown away).
fn accepts_null(schema: &Value, root: &Value, hops: usize) -> bool {
    let Some(node) = schema.as_object() else {
        return schema.as_bool().unwrap_or(true);
    };
    if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
        return match resolve(root, reference) {
            Some(target) if hops < MAX_REF_HOPS => accepts_null(target, root, hops + 1),
            _ => true,
        };
    }
    if node.contains_key("type") {
        return type_names(node).contains(&"null");
    }
    if let Some(values) = node.get("enum").and_then(Value::as_array) {
        return values.contains(&Value::Null);
    }
    if let Some(value) = node.get("const") {
        return value.is_null();
    }
    for keyword in ["anyOf", "oneOf"] {
        if let Some(branches) = node.get(keyword).and_then(Value::as_array) {
            return branches.iter().any(|b| accepts_null(b, root, hops));
        }
    }
    true
}

/// Longest chain of `$ref`s followed for one value.
const MAX_REF_HOPS: usize = 8;

/// A local reference (`#/$defs/x`) into `root`.
fn resolve<'a>(root: &'a Value, reference: &str) -> Option<&'a Value> {
    let pointer = reference.strip_prefix('#')?;
    root.pointer(pointer)
}

/// The call's arguments in the tool's own spelling, or `None` when they already are.
///
/// Walks the arguments along the schema (properties, items, local `$ref`s): an optional
/// property whose value is `null` and whose schema does not accept `null` is removed,
/// and a list of `{"name", "value"}` pairs where the schema wants a map becomes that map.
/// Anything else is left for the schema validation to judge.
pub fn normalize_input(schema: &Value, input: &Value) -> Option<Value> {
    let mut value = input.clone();
    normalize(schema, schema, &mut value, 0).then_some(value)
}

/// Returns whether anything changed.
fn normalize(schema: &Value, root: &Value, value: &mut Value, hops: usize) -> bool {
    let Some(node) = schema.as_object() else {
        return false;
    };
    if let Some(reference) = node.get("$ref").and_then(Value::as_str) {
        return match resolve(root, reference) {
            Some(target) if hops < MAX_REF_HOPS => normalize(target, root, value, hops + 1),
            _ => false,
        };
    }
    let mut changed = false;
    match value {
        Value::Object(fields) => {
            let properties = node.get("properties").and_then(Value::as_object);
            let required = required_names(node);
            let before = fields.len();
            fields.retain(|name, v| {
                !(v.is_null()
                    && !required.contains(&name.as_str())
                    && properties
                        .and_then(|p| p.get(name))
                        .is_some_and(|s| !accepts_null(s, root, 0)))
            });
            changed |= fields.len() != before;
            for (name, v) in fields.iter_mut() {
                let child = properties.and_then(|p| p.get(name)).or_else(|| {
                    node.get("additionalProperties")
                        .filter(|a| a.is_object())
                        .filter(|_| properties.is_none())
                });
                if let Some(child) = child {
                    changed |= fold_pairs(child, root, v);
                    changed |= normalize(child, root, v, 0);
                }
            }
        }
        Value::Array(items) => {
            if let Some(item_schema) = node.get("items").filter(|i| i.is_object()) {
                for item in items.iter_mut() {
                    changed |= normalize(item_schema, root, item, 0);
                }
            }
        }
        _ => {}
    }
    changed
}

/// `[{"name": "A", "value": "1"}]` → `{"A": "1"}` where `schema` is a map; names must be
/// distinct, or the list is left for validation to refuse.
fn fold_pairs(schema: &Value, root: &Value, value: &mut Value) -> bool {
    let schema = match schema.get("$ref").and_then(Value::as_str) {
        Some(reference) => match resolve(root, reference) {
            Some(target) => target,
            None => return false,
        },
        None => schema,
    };
    let Some(node) = schema.as_object() else {
        return false;
    };
    let Some(pairs) = value.as_array().filter(|_| map_values(node).is_some()) else {
        return false;
    };
    let mut map = Map::new();
    for pair in pairs {
        let Some(pair) = pair.as_object().filter(|p| p.len() == 2) else {
            return false;
        };
        let (Some(Value::String(name)), Some(v)) = (pair.get("name"), pair.get("value")) else {
            return false;
        };
        if map.insert(name.clone(), v.clone()).is_some() {
            return false;
        }
    }
    *value = Value::Object(map);
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shell_schema() -> Value {
        json!({
            "type": "object",
            "additionalProperties": false,
            "properties": {
                "command": {"type": "string", "minLength": 1, "maxLength": 10, "description": "Shell command line."},
                "argv": {"type": "array", "minItems": 1, "items": {"type": "string", "maxLength": 5}},
                "cwd": {"type": "string", "maxLength": 4096},
                "env": {"type": "object", "maxProperties": 64, "additionalProperties": {"type": "string", "maxLength": 4096}, "description": "Variables."},
                "timeout_seconds": {"type": "number", "exclusiveMinimum": 0, "maximum": 600}
            },
            "oneOf": [{"required": ["command"]}, {"required": ["argv"]}]
        })
    }

    #[test]
    fn optional_fields_become_required_and_nullable() {
        let strict = strict_schema(&shell_schema()).unwrap();
        assert_eq!(
            strict["required"],
            json!(["command", "argv", "cwd", "env", "timeout_seconds"])
        );
        assert_eq!(strict["additionalProperties"], false);
        assert!(strict.get("oneOf").is_none());
        assert!(
            strict["description"]
                .as_str()
                .unwrap()
                .contains("exactly one of: command, argv")
        );
        let command = &strict["properties"]["command"];
        assert_eq!(command["type"], json!(["string", "null"]));
        assert!(command.get("minLength").is_none() && command.get("maxLength").is_none());
        assert_eq!(strict["properties"]["timeout_seconds"]["maximum"], 600);
        let env = &strict["properties"]["env"];
        assert_eq!(env["type"], json!(["array", "null"]));
        assert_eq!(env["maxItems"], 64);
        assert_eq!(env["items"]["required"], json!(["name", "value"]));
        assert_eq!(env["items"]["additionalProperties"], false);
    }

    #[test]
    fn enums_defaults_and_nested_objects() {
        let schema = json!({
            "type": "object",
            "properties": {
                "format": {"type": "string", "enum": ["markdown", "text"], "default": "markdown"},
                "edits": {"type": "array", "items": {
                    "type": "object", "additionalProperties": false,
                    "properties": {"old_text": {"type": "string"}, "replace_all": {"type": "boolean", "default": false}},
                    "required": ["old_text"]}}
            },
            "required": ["edits"],
            "additionalProperties": false
        });
        let strict = strict_schema(&schema).unwrap();
        let format = &strict["properties"]["format"];
        assert_eq!(format["enum"], json!(["markdown", "text", null]));
        assert!(format.get("default").is_none());
        assert_eq!(format["description"], "Default: \"markdown\".");
        let item = &strict["properties"]["edits"]["items"];
        assert_eq!(item["required"], json!(["old_text", "replace_all"]));
        assert_eq!(
            item["properties"]["replace_all"]["type"],
            json!(["boolean", "null"])
        );
        assert_eq!(strict["properties"]["edits"]["type"], "array");
    }

    #[test]
    fn free_form_shapes_are_refused() {
        for schema in [
            json!({"type": "object"}),
            json!({"type": "object", "properties": {"x": {}}}),
            json!({"type": "object", "properties": {"x": {"type": "string"}}, "additionalProperties": true}),
            json!({"type": "object", "properties": {"x": {"type": "array"}}}),
            json!({"type": "object", "patternProperties": {"^a": {"type": "string"}}}),
            json!({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}),
        ] {
            assert!(strict_schema(&schema).is_err(), "{schema}");
        }
    }

    #[test]
    fn nulls_and_pairs_are_brought_back() {
        let schema = shell_schema();
        let input = json!({"command": "ls", "argv": null, "cwd": null, "env": [{"name": "LANG", "value": "C"}], "timeout_seconds": null});
        let normalized = normalize_input(&schema, &input).unwrap();
        assert_eq!(normalized, json!({"command": "ls", "env": {"LANG": "C"}}));
        // Already in the tool's spelling: nothing to do.
        assert!(normalize_input(&schema, &normalized).is_none());
        // Duplicate names are left for validation to refuse.
        let dup = json!({"command": "ls", "env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]});
        assert!(normalize_input(&schema, &dup).is_none());
    }

    #[test]
    fn meaningful_nulls_and_required_nulls_stay() {
        let schema = json!({
            "type": "object",
            "properties": {
                "a": {"type": "string"},
                "b": {"type": ["string", "null"]},
                "items": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer"}}}}
            },
            "required": ["a"]
        });
        let input = json!({"a": null, "b": null, "items": [{"x": null}, {"x": 1}]});
        let normalized = normalize_input(&schema, &input).unwrap();
        assert_eq!(
            normalized,
            json!({"a": null, "b": null, "items": [{}, {"x": 1}]})
        );
    }
}
