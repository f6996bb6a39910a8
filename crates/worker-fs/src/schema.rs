//! JSON Schema (2020-12) helpers for the tools' argument objects.

use serde_json::{Value, json};

/// Longest path accepted (Linux `PATH_MAX`).
pub const MAX_PATH_LEN: u64 = 4096;

/// An object schema that allows only the listed properties.
pub fn object(properties: Value, required: &[&str]) -> Value {
    json!({
        "type": "object",
        "properties": properties,
        "required": required,
        "additionalProperties": false,
    })
}

pub fn path(description: &str) -> Value {
    json!({ "type": "string", "maxLength": MAX_PATH_LEN, "description": description })
}

pub fn file_path(description: &str) -> Value {
    json!({
        "type": "string",
        "minLength": 1,
        "maxLength": MAX_PATH_LEN,
        "description": description,
    })
}

pub fn boolean(description: &str) -> Value {
    json!({ "type": "boolean", "default": false, "description": description })
}

pub fn integer(minimum: u64, maximum: Option<u64>, description: &str) -> Value {
    let mut v = json!({ "type": "integer", "minimum": minimum, "description": description });
    if let (Some(max), Some(obj)) = (maximum, v.as_object_mut()) {
        obj.insert("maximum".into(), json!(max));
    }
    v
}

pub fn string(description: &str) -> Value {
    json!({ "type": "string", "description": description })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn object_shape() {
        let s = object(json!({ "path": path("p") }), &["path"]);
        assert_eq!(s["type"], "object");
        assert_eq!(s["additionalProperties"], false);
        assert_eq!(s["required"], json!(["path"]));
        assert_eq!(integer(1, Some(5), "n")["maximum"], 5);
        assert!(integer(1, None, "n").get("maximum").is_none());
    }
}
