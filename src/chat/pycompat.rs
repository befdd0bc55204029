//! The Python-isms that Hugging Face chat templates rely on and that minijinja does not have
//! natively: string and dict methods (`.strip()`, `.split()`, `.startswith()`, `.get()`,
//! `.items()`, ...) and the `raise_exception` global. Kept in one place so that checkpoint
//! templates (written for Python's Jinja2) render unchanged.

use minijinja::value::{Value, ValueKind};
use minijinja::{Environment, Error, ErrorKind, State};

/// Installs the method callback and `raise_exception` into `env`.
pub(crate) fn install(env: &mut Environment<'_>) {
    env.set_unknown_method_callback(call_method);
    env.add_function("raise_exception", raise_exception);
}

fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

fn call_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match value.kind() {
        ValueKind::String => string_method(value.as_str().unwrap_or_default(), method, args),
        ValueKind::Map => map_method(state, value, method, args),
        ValueKind::Seq => seq_method(value, method, args),
        _ => Err(unknown(method)),
    }
}

fn unknown(method: &str) -> Error {
    Error::new(
        ErrorKind::UnknownMethod,
        format!("no method `{method}` (python compat)"),
    )
}

fn str_arg(args: &[Value], i: usize) -> Option<&str> {
    args.get(i).and_then(|v| v.as_str())
}

/// Python's `str.strip(chars)`: with no argument, whitespace.
fn strip_with<'a>(s: &'a str, chars: Option<&str>, left: bool, right: bool) -> &'a str {
    let pred = |c: char| match chars {
        Some(set) => set.contains(c),
        None => c.is_whitespace(),
    };
    let s = if left { s.trim_start_matches(pred) } else { s };
    if right {
        s.trim_end_matches(pred)
    } else {
        s
    }
}

fn string_method(s: &str, method: &str, args: &[Value]) -> Result<Value, Error> {
    let chars = str_arg(args, 0);
    Ok(match method {
        "strip" => Value::from(strip_with(s, chars, true, true)),
        "lstrip" => Value::from(strip_with(s, chars, true, false)),
        "rstrip" => Value::from(strip_with(s, chars, false, true)),
        "upper" => Value::from(s.to_uppercase()),
        "lower" => Value::from(s.to_lowercase()),
        "title" => Value::from(title(s)),
        "capitalize" => {
            let mut c = s.chars();
            Value::from(match c.next() {
                Some(f) => f
                    .to_uppercase()
                    .chain(c.flat_map(char::to_lowercase))
                    .collect(),
                None => String::new(),
            })
        }
        "startswith" | "endswith" => {
            let prefixes: Vec<String> = match args.first() {
                Some(v) if v.kind() == ValueKind::Seq => v
                    .try_iter()?
                    .filter_map(|p| p.as_str().map(str::to_string))
                    .collect(),
                Some(v) => v.as_str().map(str::to_string).into_iter().collect(),
                None => return Err(Error::new(ErrorKind::MissingArgument, method.to_string())),
            };
            let hit = prefixes.iter().any(|p| {
                if method == "startswith" {
                    s.starts_with(p.as_str())
                } else {
                    s.ends_with(p.as_str())
                }
            });
            Value::from(hit)
        }
        "split" | "rsplit" => split(s, method == "rsplit", args),
        "splitlines" => Value::from(s.lines().map(Value::from).collect::<Vec<_>>()),
        "replace" => match (str_arg(args, 0), str_arg(args, 1)) {
            (Some(from), Some(to)) if !from.is_empty() => Value::from(s.replace(from, to)),
            (Some(_), Some(_)) => Value::from(s),
            _ => return Err(Error::new(ErrorKind::MissingArgument, "replace(old, new)")),
        },
        "find" | "rfind" | "index" => {
            let needle =
                chars.ok_or_else(|| Error::new(ErrorKind::MissingArgument, "find(sub)"))?;
            let pos = if method == "rfind" {
                s.rfind(needle)
            } else {
                s.find(needle)
            };
            match pos {
                Some(p) => Value::from(s[..p].chars().count() as i64),
                None if method == "index" => {
                    return Err(Error::new(
                        ErrorKind::InvalidOperation,
                        "substring not found",
                    ))
                }
                None => Value::from(-1),
            }
        }
        "count" => match chars {
            Some(n) if !n.is_empty() => Value::from(s.matches(n).count() as i64),
            _ => Value::from(s.chars().count() as i64 + 1),
        },
        "isdigit" | "isnumeric" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_numeric())),
        "isalpha" => Value::from(!s.is_empty() && s.chars().all(char::is_alphabetic)),
        "isalnum" => Value::from(!s.is_empty() && s.chars().all(char::is_alphanumeric)),
        "isspace" => Value::from(!s.is_empty() && s.chars().all(char::is_whitespace)),
        "islower" => {
            Value::from(s.chars().any(char::is_lowercase) && !s.chars().any(char::is_uppercase))
        }
        "isupper" => {
            Value::from(s.chars().any(char::is_uppercase) && !s.chars().any(char::is_lowercase))
        }
        "join" => {
            let items = args
                .first()
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "join(iterable)"))?;
            let parts: Vec<String> = items.try_iter()?.map(|v| v.to_string()).collect();
            Value::from(parts.join(s))
        }
        _ => return Err(unknown(method)),
    })
}

fn title(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_alpha = false;
    for c in s.chars() {
        if prev_alpha {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_alpha = c.is_alphabetic();
    }
    out
}

/// Python's `str.split(sep=None, maxsplit=-1)` and `rsplit`.
fn split(s: &str, from_right: bool, args: &[Value]) -> Value {
    let sep = str_arg(args, 0).filter(|p| !p.is_empty());
    let max = args
        .get(1)
        .and_then(|v| v.as_i64())
        .filter(|m| *m >= 0)
        .map(|m| m as usize);
    let parts: Vec<String> = match (sep, max, from_right) {
        (Some(p), None, _) => s.split(p).map(str::to_string).collect(),
        (Some(p), Some(m), false) => s
            .splitn(m.saturating_add(1), p)
            .map(str::to_string)
            .collect(),
        (Some(p), Some(m), true) => {
            let mut v: Vec<String> = s
                .rsplitn(m.saturating_add(1), p)
                .map(str::to_string)
                .collect();
            v.reverse();
            v
        }
        (None, _, _) => s.split_whitespace().map(str::to_string).collect(),
    };
    Value::from(parts.into_iter().map(Value::from).collect::<Vec<_>>())
}

fn map_method(state: &State, value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    match method {
        "get" => {
            let key = args
                .first()
                .ok_or_else(|| Error::new(ErrorKind::MissingArgument, "get(key)"))?;
            let found = value.get_item(key)?;
            Ok(if found.is_undefined() {
                args.get(1).cloned().unwrap_or(Value::from(()))
            } else {
                found
            })
        }
        "items" => state.apply_filter("items", std::slice::from_ref(value)),
        "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
        "values" => {
            let mut out = Vec::new();
            for k in value.try_iter()? {
                out.push(value.get_item(&k)?);
            }
            Ok(Value::from(out))
        }
        _ => Err(unknown(method)),
    }
}

fn seq_method(value: &Value, method: &str, args: &[Value]) -> Result<Value, Error> {
    let needle = args.first();
    match (method, needle) {
        ("count", Some(n)) => Ok(Value::from(
            value.try_iter()?.filter(|v| v == n).count() as i64
        )),
        ("index", Some(n)) => value
            .try_iter()?
            .position(|v| &v == n)
            .map(|p| Value::from(p as i64))
            .ok_or_else(|| Error::new(ErrorKind::InvalidOperation, "value not in list")),
        _ => Err(unknown(method)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str) -> String {
        let mut env = Environment::new();
        install(&mut env);
        env.render_str(
            src,
            minijinja::context! { d => minijinja::context!{ a => 1 } },
        )
        .unwrap_or_else(|e| format!("ERR {e}"))
    }

    #[test]
    fn string_methods() {
        assert_eq!(
            render("{{ '  x y '.strip() }}|{{ 'xxhixx'.strip('x') }}"),
            "x y|hi"
        );
        assert_eq!(render("{{ 'a,b,c'.split(',') }}"), r#"["a", "b", "c"]"#);
        assert_eq!(render("{{ 'a,b,c'.split(',', 1) }}"), r#"["a", "b,c"]"#);
        assert_eq!(render("{{ 'a,b,c'.rsplit(',', 1) }}"), r#"["a,b", "c"]"#);
        assert_eq!(render("{{ ' a  b '.split() }}"), r#"["a", "b"]"#);
        assert_eq!(
            render("{{ 'hello'.startswith('he') }}{{ 'hello'.endswith(('x','lo')) }}"),
            "TrueTrue"
        );
        assert_eq!(
            render("{{ 'abc'.replace('b', 'X') }}{{ 'big cat'.title() }}"),
            "aXcBig Cat"
        );
        assert_eq!(
            render("{{ 'héllo'.find('l') }}{{ 'abc'.find('z') }}"),
            "2-1"
        );
    }

    #[test]
    fn dict_methods_and_raise() {
        assert_eq!(
            render("{{ d.get('a') }}{{ d.get('b', 5) }}{{ d.get('c') is none }}"),
            "15True"
        );
        assert_eq!(
            render("{% for k, v in d.items() %}{{k}}={{v}}{% endfor %}"),
            "a=1"
        );
        assert!(render("{{ raise_exception('bad role') }}").contains("bad role"));
        assert!(render("{{ 'x'.nope() }}").starts_with("ERR"));
    }
}
