//! Byte sizes as operators write them: an integer number of bytes, or a string with a decimal
//! (`"150GB"` = 150·10⁹) or binary (`"140GiB"` = 140·2³⁰) unit. Reports always state exact bytes
//! next to any rounded figure, so a unit mix-up (SGLang's `--hicache-size` is decimal GB per rank)
//! is visible at a glance.

use serde_json::Value;

const UNITS: &[(&str, u64)] = &[
    ("B", 1),
    ("KB", 1_000),
    ("MB", 1_000_000),
    ("GB", 1_000_000_000),
    ("TB", 1_000_000_000_000),
    ("PB", 1_000_000_000_000_000),
    ("KiB", 1 << 10),
    ("MiB", 1 << 20),
    ("GiB", 1 << 30),
    ("TiB", 1 << 40),
    ("PiB", 1 << 50),
];

const HOW_TO_WRITE: &str =
    "write an integer number of bytes or a string like \"150GB\" (10^9) or \"140GiB\" (2^30)";

/// Parses a size value. `Ok(bytes)` is always > 0; the error text says what is wrong and how to
/// write it instead (the caller prefixes the key).
pub fn parse_size(value: &Value) -> Result<u64, String> {
    match value {
        Value::Number(n) => {
            if let Some(bytes) = n.as_u64() {
                positive(bytes, &n.to_string())
            } else if let Some(i) = n.as_i64() {
                Err(format!("{i} is negative: sizes must be > 0 bytes"))
            } else {
                // 150e9 arrives as a float; accept it when it is a whole number of bytes.
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f <= 0.0 {
                    Err(format!("{n} is not positive: sizes must be > 0 bytes"))
                } else if f.fract() != 0.0 || f >= u64::MAX as f64 {
                    Err(format!(
                        "{n} is not a whole number of bytes: {HOW_TO_WRITE}"
                    ))
                } else {
                    positive(f as u64, &n.to_string())
                }
            }
        }
        Value::String(s) => parse_size_str(s),
        other => Err(format!(
            "expected a size, got {}: {HOW_TO_WRITE}",
            describe(other)
        )),
    }
}

fn positive(bytes: u64, shown: &str) -> Result<u64, String> {
    if bytes == 0 {
        Err(format!("{shown} is zero: sizes must be > 0 bytes"))
    } else {
        Ok(bytes)
    }
}

fn parse_size_str(text: &str) -> Result<u64, String> {
    // Messages quote the caller's text shortened: it may be megabytes long.
    let shown = shorten(text);
    let s = text.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '-' || c == '+'))
        .unwrap_or(s.len());
    let (number, unit) = (s[..split].trim(), s[split..].trim());
    if number.is_empty() {
        return Err(format!("\"{shown}\" has no number: {HOW_TO_WRITE}"));
    }
    let multiplier = if unit.is_empty() {
        1
    } else {
        match UNITS
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(unit))
        {
            Some((_, m)) => *m,
            None => {
                return Err(format!(
                    "unknown unit `{}` in \"{shown}\": use B, KB, MB, GB, TB (powers of 10) \
                     or KiB, MiB, GiB, TiB (powers of 2)",
                    shorten(unit)
                ))
            }
        }
    };
    let value: f64 = number
        .parse()
        .map_err(|_| format!("\"{shown}\" is not a number followed by a unit: {HOW_TO_WRITE}"))?;
    if !value.is_finite() || value <= 0.0 {
        return Err(format!(
            "\"{shown}\" is not positive: sizes must be > 0 bytes"
        ));
    }
    // Integers are computed exactly; fractions ("1.5GiB") round down to whole bytes.
    let bytes = match number.parse::<u64>() {
        Ok(whole) => whole.checked_mul(multiplier),
        Err(_) => {
            let b = value * multiplier as f64;
            (b < u64::MAX as f64).then_some(b.floor() as u64)
        }
    };
    match bytes {
        None => Err(format!("\"{shown}\" does not fit in 64 bits of bytes")),
        Some(0) => Err(format!("\"{shown}\" is less than one byte")),
        Some(b) => Ok(b),
    }
}

/// How a JSON value is named in messages: its type and, for scalars, the value itself.
pub fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string \"{}\"", shorten(s)),
        Value::Array(_) => "an array".to_string(),
        Value::Object(_) => "an object".to_string(),
    }
}

/// Text from the caller as messages quote it: whole when short, else its first 40 bytes and its
/// length. A hostile document can hold a 100 MB key or value; echoing it would make the error
/// message itself the problem (and hide the sentence that says what to do).
pub fn shorten(text: &str) -> std::borrow::Cow<'_, str> {
    const WHOLE: usize = 64;
    const SHOWN: usize = 40;
    if text.len() <= WHOLE {
        return text.into();
    }
    let mut cut = SHOWN;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}… ({} bytes)", &text[..cut], text.len()).into()
}

/// `150000000000` → `"139.70 GiB"`: binary units, two decimals, for human-readable columns. The
/// exact byte count is always printed next to it.
pub fn human_bytes(bytes: u64) -> String {
    const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < NAMES.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", NAMES[unit])
    }
}

/// `1234567` → `"1,234,567"`: exact integers that stay readable in tables.
pub fn grouped(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::with_capacity(digits.len() + digits.len() / 3);
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn decimal_and_binary_units_are_exact() {
        assert_eq!(parse_size(&json!("150GB")), Ok(150_000_000_000));
        assert_eq!(parse_size(&json!("140GiB")), Ok(140 * (1u64 << 30)));
        assert_eq!(parse_size(&json!("140 gib")), Ok(140 * (1u64 << 30)));
        assert_eq!(parse_size(&json!("2TB")), Ok(2_000_000_000_000));
        assert_eq!(parse_size(&json!("1.5GiB")), Ok(1_610_612_736));
        assert_eq!(parse_size(&json!("4096")), Ok(4096));
        assert_eq!(parse_size(&json!("512 B")), Ok(512));
    }

    #[test]
    fn integers_and_whole_floats_are_bytes() {
        assert_eq!(parse_size(&json!(1024)), Ok(1024));
        assert_eq!(parse_size(&json!(150e9)), Ok(150_000_000_000));
    }

    #[test]
    fn bad_sizes_say_why() {
        for (value, needle) in [
            (json!(0), "zero"),
            (json!(-5), "negative"),
            (json!(1.5), "whole number"),
            (json!("150GBs"), "unknown unit `GBs`"),
            (json!("150G"), "unknown unit `G`"),
            (json!("GB"), "no number"),
            (json!("-3GB"), "not positive"),
            (json!("0GiB"), "not positive"),
            (json!("99999999999PB"), "64 bits"),
            (json!(true), "boolean true"),
            (json!("1.2.3GB"), "not a number"),
        ] {
            let err = parse_size(&value).unwrap_err();
            assert!(err.contains(needle), "{value}: {err}");
        }
    }

    #[test]
    fn long_text_is_quoted_by_its_start_and_length() {
        assert_eq!(shorten("write_policy"), "write_policy");
        let long = "é".repeat(1000);
        let shown = shorten(&long);
        assert!(shown.starts_with(&"é".repeat(20)), "{shown}");
        assert!(shown.ends_with("… (2000 bytes)"), "{shown}");
        let described = describe(&json!("x".repeat(10_000_000)));
        assert!(described.len() < 100, "{described}");
    }

    #[test]
    fn human_and_grouped_forms() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(150_000_000_000), "139.70 GiB");
        assert_eq!(grouped(0), "0");
        assert_eq!(grouped(999), "999");
        assert_eq!(grouped(1000), "1,000");
        assert_eq!(grouped(150_000_000_000), "150,000,000,000");
    }
}
