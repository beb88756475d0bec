//! Checks a params document against the schema and collects every problem, each naming the key,
//! the value and the fix.

use std::collections::HashSet;

use serde_json::{Map, Value};

use super::schema::{self, KeySpec, Kind, ALIASES, KEYS, SECTIONS};
use crate::config::size::{describe, parse_size, shorten};

// Input size caps (docs/params.md, "Limits"). Each is far above any real document, and together
// they keep validation linear in the input: nothing here is quadratic in a caller's size.

/// The largest params document accepted, in bytes. Real ones are under 4 KiB.
pub const MAX_DOCUMENT_BYTES: usize = 1 << 20;
/// Longer keys and enum values get no "did you mean": every known name is under 32 characters,
/// so nothing longer is a typo of one.
pub const MAX_SUGGEST_CHARS: usize = 64;
/// The most entries `devices` may list (a node has at most a few dozen GPUs).
pub const MAX_DEVICES: usize = 1024;
/// Most entries of a host list (`pd.allowed_peers`).
const MAX_HOSTS: usize = 256;
/// The longest `model_path`, in bytes: Linux's PATH_MAX.
pub const MAX_PATH_BYTES: usize = 4096;
/// The most `metrics.labels`: every exported series repeats all of them.
pub const MAX_LABELS: usize = 64;
/// The longest label value, in bytes (for the same reason).
pub const MAX_LABEL_VALUE_BYTES: usize = 1024;
/// Label names `metrics.labels` may not use, because a scraped series would then carry the name
/// twice: every label the exposition (`engine/prometheus.rs`) puts on its own series (promtool rejects a sample
/// with a repeated label and Prometheus drops the scrape), then `job` and `instance`, which
/// Prometheus itself sets on every series it scrapes (it would rename or overwrite ours). A
/// label added to the exposition must be added here; a test renders every family and checks.
pub const RESERVED_LABELS: &[&str] = &[
    "pool",
    "tier",
    "reason",
    "finish_reason",
    "cache_source",
    "outcome",
    "le",
    "side",
    "version",
    "backend",
    "role",
    "node",
    "job",
    "instance",
];

/// Problems found so far; each is one self-contained sentence.
#[derive(Default)]
pub struct Problems(pub Vec<String>);

impl Problems {
    pub fn push(&mut self, text: impl Into<String>) {
        self.0.push(text.into());
    }
}

/// Walks the caller's document (before defaults are merged): unknown keys, wrong types, ranges.
pub fn check_document(doc: &Map<String, Value>, problems: &mut Problems) {
    walk(doc, "", problems);
}

fn walk(obj: &Map<String, Value>, prefix: &str, problems: &mut Problems) {
    for (name, value) in obj {
        let path = if prefix.is_empty() {
            name.clone()
        } else {
            format!("{prefix}.{name}")
        };
        if schema::is_section(&path) {
            match value {
                Value::Object(inner) => walk(inner, &path, problems),
                other => {
                    let keys: Vec<&str> = KEYS
                        .iter()
                        .filter(|k| k.section() == path)
                        .map(|k| k.leaf())
                        .collect();
                    let alias = ALIASES
                        .iter()
                        .find(|(alias, _)| *alias == path)
                        .map(|(_, target)| format!(" (did you mean `{target}`?)"))
                        .unwrap_or_default();
                    problems.push(format!(
                        "`{path}` must be an object with keys {}, got {}{alias}",
                        keys.join(", "),
                        describe(other)
                    ));
                }
            }
        } else if let Some(spec) = schema::find(&path) {
            if let Err(why) = check_value(spec, value) {
                problems.push(why);
            }
        } else {
            problems.push(unknown_key(&path, prefix));
        }
    }
}

/// Checks one value against its key's kind. `Err` is the full sentence.
pub fn check_value(spec: &KeySpec, value: &Value) -> Result<(), String> {
    let path = spec.path;
    let hint = if spec.hint.is_empty() {
        String::new()
    } else {
        format!(": {}", spec.hint)
    };
    let shown = describe(value);
    match spec.kind {
        Kind::Choice(choices) => match value.as_str() {
            Some(s) if choices.contains(&s) => Ok(()),
            Some(s) => {
                let suggestion = closest(s, choices.iter().copied())
                    .map(|c| format!(" — did you mean \"{c}\"?"))
                    .unwrap_or_default();
                Err(format!(
                    "`{path}` = \"{}\" is not one of {}{suggestion}",
                    shorten(s),
                    choices.join(", ")
                ))
            }
            None => Err(format!(
                "`{path}` must be one of {}, got {shown}",
                choices.join(", ")
            )),
        },
        Kind::Text { nullable } => match value {
            Value::String(s) if s.len() > MAX_PATH_BYTES => Err(format!(
                "`{path}` = \"{}\" is longer than {MAX_PATH_BYTES} bytes, the longest path \
                 the operating system accepts: give the checkpoint's directory",
                shorten(s)
            )),
            Value::String(s) if !s.is_empty() => Ok(()),
            Value::Null if nullable => Ok(()),
            Value::String(_) => Err(format!("`{path}` must not be empty")),
            _ => Err(format!("`{path}` must be a string, got {shown}")),
        },
        Kind::Int { min, max, nullable } => {
            if value.is_null() && nullable {
                return Ok(());
            }
            let unit = if spec.unit.is_empty() {
                String::new()
            } else {
                format!(" {}", spec.unit)
            };
            match value.as_u64() {
                Some(n) if n < min => Err(format!(
                    "`{path}` = {n} is below the minimum {min}{unit}{hint}"
                )),
                Some(n) if n > max => Err(format!(
                    "`{path}` = {n} is above the maximum {max}{unit}{hint}"
                )),
                Some(_) => Ok(()),
                None if value.as_i64().is_some() => Err(format!(
                    "`{path}` = {value} is negative: it must be at least {min}{unit}{hint}"
                )),
                None => {
                    let fix = match value {
                        Value::String(s) if s.trim().parse::<u64>().is_ok() => {
                            format!(": write {} without quotes", s.trim())
                        }
                        _ => String::new(),
                    };
                    Err(format!(
                        "`{path}` must be an integer{}, got {shown}{fix}",
                        if nullable { " or null" } else { "" }
                    ))
                }
            }
        }
        Kind::Float {
            min,
            min_open,
            max,
            max_open,
            nullable,
        } => {
            if value.is_null() && nullable {
                return Ok(());
            }
            let Some(x) = value.as_f64() else {
                return Err(format!(
                    "`{path}` must be a number{}, got {shown}",
                    if nullable { " or null" } else { "" }
                ));
            };
            let low_ok = if min_open { x > min } else { x >= min };
            let high_ok = if max_open { x < max } else { x <= max };
            if low_ok && high_ok {
                Ok(())
            } else {
                let (lo, hi) = (
                    if min_open { ">" } else { "≥" },
                    if max_open { "<" } else { "≤" },
                );
                Err(format!(
                    "`{path}` = {value} is out of range: it must be {lo} {min} and {hi} {max}{hint}"
                ))
            }
        }
        Kind::Bool => match value {
            Value::Bool(_) => Ok(()),
            _ => Err(format!("`{path}` must be true or false, got {shown}")),
        },
        Kind::Size { nullable } => {
            if value.is_null() && nullable {
                return Ok(());
            }
            parse_size(value)
                .map(|_| ())
                .map_err(|why| format!("`{path}`: {why}"))
        }
        Kind::Devices => {
            let Some(items) = value.as_array() else {
                return Err(format!(
                    "`{path}` must be a list of GPU indices such as [0, 1], got {shown}"
                ));
            };
            if items.len() > MAX_DEVICES {
                return Err(format!(
                    "`{path}` lists {} entries; at most {MAX_DEVICES} are accepted: list the GPUs \
                     this engine uses, each once",
                    items.len()
                ));
            }
            let mut seen = HashSet::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                match item.as_u64() {
                    Some(n) if n > u64::from(u32::MAX) => {
                        return Err(format!(
                            "`{path}[{i}]` = {n} is not a GPU index (at most {}): use the index \
                             nvidia-smi shows",
                            u32::MAX
                        ))
                    }
                    Some(n) if !seen.insert(n) => {
                        return Err(format!("`{path}` lists GPU {n} twice: list each GPU once"))
                    }
                    Some(_) => {}
                    None => {
                        return Err(format!(
                            "`{path}[{i}]` must be a GPU index (a non-negative integer), got {}",
                            describe(item)
                        ))
                    }
                }
            }
            Ok(())
        }
        Kind::Endpoint {
            nullable,
            connectable,
        } => {
            let text = match value {
                Value::Null if nullable => return Ok(()),
                Value::String(s) => s,
                _ => {
                    return Err(format!(
                        "`{path}` must be a string such as \"tcp://10.0.0.5:7000\", got {shown}"
                    ))
                }
            };
            let e = super::Endpoint::parse(text).map_err(|e| format!("`{path}` = {e}"))?;
            if connectable && (e.port == 0 || e.host == "0.0.0.0" || e.host == "::") {
                return Err(format!(
                    "`{path}` = {} is not an address a peer can connect to: give the host and \
                     port peers should use (port 0 and the wildcard host only make sense in \
                     `pd.listen`)",
                    shorten(text)
                ));
            }
            Ok(())
        }
        Kind::Hosts => {
            let Some(items) = value.as_array() else {
                return Err(format!(
                    "`{path}` must be a list of hosts or host:port entries such as \
                     [\"10.0.0.5\", \"prefill-1:7000\"], got {shown}"
                ));
            };
            if items.len() > MAX_HOSTS {
                return Err(format!(
                    "`{path}` lists {} entries; at most {MAX_HOSTS} are accepted",
                    items.len()
                ));
            }
            for (i, item) in items.iter().enumerate() {
                match item.as_str() {
                    Some(h) if !h.is_empty() && h.len() <= 255 && !h.contains("://") => {}
                    _ => {
                        return Err(format!(
                            "`{path}[{i}]` must be a host or host:port (no scheme), such as \
                             \"10.0.0.5\" or \"prefill-1:7000\", got {}",
                            describe(item)
                        ))
                    }
                }
            }
            Ok(())
        }
        Kind::Labels => {
            let Some(labels) = value.as_object() else {
                return Err(format!(
                    "`{path}` must be an object of label names to string values, such as \
                     {{\"cluster\": \"eu-1\"}}, got {shown}"
                ));
            };
            if labels.len() > MAX_LABELS {
                return Err(format!(
                    "`{path}` has {} labels; at most {MAX_LABELS} are accepted (every exported \
                     series repeats them all): keep the ones your dashboards select on",
                    labels.len()
                ));
            }
            for (name, label_value) in labels {
                if !valid_label_name(name) {
                    return Err(format!(
                        "`{path}` label name \"{}\" is not a valid Prometheus label name: use \
                         letters, digits and _, not starting with a digit or __",
                        shorten(name)
                    ));
                }
                if RESERVED_LABELS.contains(&name.as_str()) {
                    return Err(format!(
                        "`{path}` label name \"{name}\" is reserved: dsv4's series already \
                         carry it or, for job and instance, Prometheus sets it on every series it \
                         scrapes, so a series would have it twice (promtool rejects such an \
                         exposition; Prometheus drops the scrape or renames the label): rename \
                         it, e.g. \"cluster_{name}\" (reserved: {})",
                        RESERVED_LABELS.join(", ")
                    ));
                }
                match label_value {
                    Value::String(v) if v.len() > MAX_LABEL_VALUE_BYTES => {
                        return Err(format!(
                            "`{path}.{}` is {} bytes long; label values are at most \
                             {MAX_LABEL_VALUE_BYTES} bytes (every exported series repeats it): \
                             shorten it",
                            shorten(name),
                            v.len()
                        ))
                    }
                    Value::String(_) => {}
                    other => {
                        return Err(format!(
                            "`{path}.{}` must be a string, got {}",
                            shorten(name),
                            describe(other)
                        ))
                    }
                }
            }
            Ok(())
        }
        Kind::NumaNode => match value {
            Value::String(s) if s == "auto" => Ok(()),
            v if v.as_u64().is_some_and(|n| n <= 4096) => Ok(()),
            _ => Err(format!(
                "`{path}` must be \"auto\" (the GPU's NUMA node) or a node index, got {shown}"
            )),
        },
    }
}

fn valid_label_name(name: &str) -> bool {
    let mut chars = name.chars();
    let first_ok = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    first_ok
        && !name.starts_with("__")
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// "unknown key `hicache.write_polcy` — did you mean `hicache.write_policy`?"
fn unknown_key(path: &str, section: &str) -> String {
    let leaf = path.rsplit('.').next().unwrap_or(path);
    // The key may be megabytes long: quote its start and length only.
    let path = shorten(path);
    if let Some((_, target)) = ALIASES
        .iter()
        .find(|(alias, _)| *alias == leaf || *alias == path)
    {
        return format!("unknown key `{path}` — did you mean `{target}`?");
    }
    // Prefer a near-miss among the same section's keys, then the same name in another section.
    let siblings = KEYS
        .iter()
        .filter(|k| k.section() == section)
        .map(|k| k.path)
        .chain(SECTIONS.iter().copied().filter(|_| section.is_empty()));
    let near_sibling = closest(
        leaf,
        siblings.clone().map(|p| p.rsplit('.').next().unwrap_or(p)),
    )
    .and_then(|name| {
        siblings
            .clone()
            .find(|p| p.rsplit('.').next() == Some(name))
    });
    let elsewhere = || {
        KEYS.iter()
            .find(|k| k.leaf() == leaf)
            .map(|k| k.path)
            .or_else(|| {
                closest(leaf, KEYS.iter().map(|k| k.leaf()))
                    .and_then(|name| KEYS.iter().find(|k| k.leaf() == name).map(|k| k.path))
            })
    };
    match near_sibling.or_else(elsewhere) {
        Some(target) => format!("unknown key `{path}` — did you mean `{target}`?"),
        None => {
            let known: Vec<&str> = KEYS
                .iter()
                .filter(|k| k.section() == section)
                .map(|k| k.leaf())
                .chain(SECTIONS.iter().copied().filter(|_| section.is_empty()))
                .collect();
            let place = if section.is_empty() {
                "the top level".to_string()
            } else {
                format!("`{section}`")
            };
            format!(
                "unknown key `{path}`: the keys of {place} are {} (docs/params.md lists them all)",
                known.join(", ")
            )
        }
    }
}

/// The candidate within a small edit distance of `word`, if any. Linear in `word`: words longer
/// than [`MAX_SUGGEST_CHARS`] are nobody's typo and get no suggestion, and each distance stops
/// as soon as it exceeds the limit.
pub fn closest<'a>(word: &str, candidates: impl Iterator<Item = &'a str>) -> Option<&'a str> {
    // Bytes bound chars from above, so this check alone caps the work below.
    if word.len() > 4 * MAX_SUGGEST_CHARS || word.chars().count() > MAX_SUGGEST_CHARS {
        return None;
    }
    let limit = match word.chars().count() {
        0..=3 => 1,
        4..=8 => 2,
        _ => 3,
    };
    let word: Vec<char> = word.to_ascii_lowercase().chars().collect();
    candidates
        .filter_map(|c| {
            let candidate: Vec<char> = c.to_ascii_lowercase().chars().collect();
            edit_distance_within(&word, &candidate, limit).map(|d| (d, c))
        })
        .min_by_key(|&(d, _)| d)
        .map(|(_, c)| c)
}

/// Optimal string alignment distance (insertions, deletions, substitutions, adjacent swaps) when
/// it is at most `limit`, else `None`. Keeps three rows, not the full matrix, and gives up as
/// soon as a whole row exceeds the limit (the distance never decreases from row to row).
fn edit_distance_within(a: &[char], b: &[char], limit: usize) -> Option<usize> {
    if a.len().abs_diff(b.len()) > limit {
        return None;
    }
    let mut before: Vec<usize> = vec![0; b.len() + 1];
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    let mut row: Vec<usize> = vec![0; b.len() + 1];
    for i in 1..=a.len() {
        row[0] = i;
        for j in 1..=b.len() {
            let cost = usize::from(a[i - 1] != b[j - 1]);
            row[j] = (prev[j] + 1).min(row[j - 1] + 1).min(prev[j - 1] + cost);
            if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                row[j] = row[j].min(before[j - 2] + 1);
            }
        }
        // A swap reaches back two rows, so a row over the limit can still be undercut by one
        // more step only through `before`; cutting on two consecutive rows is exact.
        if row.iter().min().is_some_and(|&m| m > limit)
            && prev.iter().min().is_some_and(|&m| m > limit)
        {
            return None;
        }
        std::mem::swap(&mut before, &mut prev);
        std::mem::swap(&mut prev, &mut row);
    }
    Some(prev[b.len()]).filter(|&d| d <= limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn distance(a: &str, b: &str, limit: usize) -> Option<usize> {
        let (a, b): (Vec<char>, Vec<char>) = (a.chars().collect(), b.chars().collect());
        edit_distance_within(&a, &b, limit)
    }

    #[test]
    fn edit_distance_counts_swaps_once() {
        assert_eq!(distance("write_polcy", "write_policy", 3), Some(1));
        assert_eq!(distance("ratoi", "ratio", 3), Some(1));
        assert_eq!(distance("abc", "abc", 3), Some(0));
        assert_eq!(distance("", "abc", 3), Some(3));
        assert_eq!(distance("ca", "abc", 3), Some(3));
    }

    #[test]
    fn edit_distance_gives_up_past_the_limit() {
        assert_eq!(distance("", "abcd", 3), None);
        assert_eq!(distance("abcdefgh", "zyxwvuts", 3), None);
        assert_eq!(distance("kv_page_size", "page_size", 3), Some(3));
        assert_eq!(distance("kv_page_size", "page_size", 2), None);
    }

    /// The cut-off must never change an answer: compare with the full matrix on every pair of
    /// short strings over a small alphabet (where swaps and cut-offs interact most).
    #[test]
    fn edit_distance_cut_off_agrees_with_the_full_matrix() {
        fn full(a: &[char], b: &[char]) -> usize {
            let mut d = vec![vec![0usize; b.len() + 1]; a.len() + 1];
            for (i, row) in d.iter_mut().enumerate() {
                row[0] = i;
            }
            for (j, cell) in d[0].iter_mut().enumerate() {
                *cell = j;
            }
            for i in 1..=a.len() {
                for j in 1..=b.len() {
                    let cost = usize::from(a[i - 1] != b[j - 1]);
                    d[i][j] = (d[i - 1][j] + 1)
                        .min(d[i][j - 1] + 1)
                        .min(d[i - 1][j - 1] + cost);
                    if i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1] {
                        d[i][j] = d[i][j].min(d[i - 2][j - 2] + 1);
                    }
                }
            }
            d[a.len()][b.len()]
        }
        let words: Vec<Vec<char>> = (0..3u32.pow(5))
            .flat_map(|n| {
                (0..=5).map(move |len| {
                    (0..len)
                        .map(|k| ['a', 'b', 'c'][(n / 3u32.pow(k)) as usize % 3])
                        .collect()
                })
            })
            .collect();
        for a in words.iter().step_by(7) {
            for b in words.iter().step_by(5) {
                let exact = full(a, b);
                for limit in 0..4 {
                    let expected = (exact <= limit).then_some(exact);
                    assert_eq!(edit_distance_within(a, b, limit), expected, "{a:?} {b:?}");
                }
            }
        }
    }

    #[test]
    fn huge_words_get_no_suggestion() {
        let key = "write_policy".repeat(1 << 20);
        assert_eq!(closest(&key, ["write_policy"].into_iter()), None);
        let message = unknown_key(&format!("hicache.{key}"), "hicache");
        assert!(message.len() < 1000, "{} bytes", message.len());
        assert!(
            message.starts_with("unknown key `hicache.write_policy"),
            "{message}"
        );
        assert!(
            message.contains("the keys of `hicache` are enabled"),
            "{message}"
        );
    }

    #[test]
    fn unknown_keys_get_the_nearest_known_key() {
        assert_eq!(
            unknown_key("hicache.write_polcy", "hicache"),
            "unknown key `hicache.write_polcy` — did you mean `hicache.write_policy`?"
        );
        assert_eq!(
            unknown_key("page_size", ""),
            "unknown key `page_size` — did you mean `kv.page_size`?"
        );
        assert_eq!(
            unknown_key("kv.write_policy", "kv"),
            "unknown key `kv.write_policy` — did you mean `hicache.write_policy`?"
        );
        assert_eq!(
            unknown_key("hicache.hicache_ratio", "hicache"),
            "unknown key `hicache.hicache_ratio` — did you mean `hicache.ratio`?"
        );
        assert_eq!(
            unknown_key("hicahce", ""),
            "unknown key `hicahce` — did you mean `hicache`?"
        );
        let far = unknown_key("admission.zzzzzzzz", "admission");
        assert!(
            far.contains("the keys of `admission` are max_queued_requests"),
            "{far}"
        );
    }

    #[test]
    fn label_names_follow_prometheus_rules() {
        assert!(valid_label_name("cluster"));
        assert!(valid_label_name("_x1"));
        assert!(!valid_label_name("1x"));
        assert!(!valid_label_name("__reserved"));
        assert!(!valid_label_name("a-b"));
        assert!(!valid_label_name(""));
    }
}
