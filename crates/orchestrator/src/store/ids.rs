//! The ids the store keys its rows by: a call's and an approval's, each its own type so
//! that one cannot be passed where the other is meant. Both are the plain text the gate
//! chose (`call_…`, `apr_…`); on the wire and in the audit log they are that string.

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;

use serde::{Deserialize, Serialize};

macro_rules! text_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
        #[serde(transparent)]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }

            pub fn into_string(self) -> String {
                self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl From<String> for $name {
            fn from(id: String) -> Self {
                Self(id)
            }
        }

        impl From<&str> for $name {
            fn from(id: &str) -> Self {
                Self(id.to_owned())
            }
        }

        impl From<&String> for $name {
            fn from(id: &String) -> Self {
                Self(id.clone())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> Self {
                id.0
            }
        }

        // Read-only access as text (logs, messages, `json!`, comparisons with what the
        // wire sent), so callers holding a `String` need no conversion to look at one.
        impl Deref for $name {
            type Target = str;

            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &self.0 == other
            }
        }

        impl PartialEq<$name> for str {
            fn eq(&self, other: &$name) -> bool {
                self == other.0
            }
        }

        impl PartialEq<$name> for &str {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }

        impl PartialEq<$name> for String {
            fn eq(&self, other: &$name) -> bool {
                *self == other.0
            }
        }
    };
}

text_id!(
    /// A call's id (`call_…`): the key of the `calls` table, and what workers
    /// deduplicate a re-dispatched call by.
    CallId
);

text_id!(
    /// An approval's id (`apr_…`): the key of the `approvals` table and the paging
    /// cursor of `GET /v1/approvals`.
    ApprovalId
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_their_text_on_the_wire() {
        let call = CallId::from("call_1");
        assert_eq!(serde_json::to_value(&call).unwrap(), "call_1");
        let back: ApprovalId = serde_json::from_value(serde_json::json!("apr_1")).unwrap();
        assert_eq!(back.as_str(), "apr_1");
        assert_eq!(back.to_string(), "apr_1");
        assert_eq!(call, "call_1");
        assert_eq!(String::from(call), "call_1");
    }
}
