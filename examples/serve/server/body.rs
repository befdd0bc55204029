//! Request bodies: JSON parsed strictly, with the position of the first error.
//!
//! JSON is parsed as RFC 8259 says: an invalid escape such as `\s` inside a string (often
//! seen in regular expressions of tool schemas written by hand) is **rejected** with a 400
//! whose code is `invalid_json` and whose message gives the line and column of the bad
//! escape. Nothing is guessed: a lenient parser would have to choose between `\s` and `s`,
//! and the client's intent is unknowable. Write `\\s` to send a backslash. The same holds
//! for `NaN` and `Infinity`, which are not JSON: a temperature of NaN is a 400 `invalid_json`.

use serde::de::DeserializeOwned;

use super::error::ApiError;

/// Parses a request body into `T`.
///
/// # Errors
/// 400 `invalid_json` with the line and column of the first syntax error, or with the path
/// of the field whose value has the wrong type.
pub fn parse<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(bytes).map_err(|e| {
        let what = if e.is_data() {
            "the body does not have the request's shape"
        } else {
            "invalid JSON body"
        };
        ApiError::bad_json(format!("{what}: {e}"))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_escape_is_rejected_with_its_position() {
        let err = parse::<serde_json::Value>(br#"{"pattern": "\s+"}"#).unwrap_err();
        assert_eq!(err.code.as_deref(), Some("invalid_json"));
        assert!(err.message.contains("line 1 column"), "{}", err.message);
    }
}
