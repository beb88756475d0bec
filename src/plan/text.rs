//! The plan as a table an operator reads before touching any memory. Every rounded figure sits
//! next to its exact byte count; a closing `summary` block of `key: value` lines is stable for
//! tools (examples/c/plan.c lays several plans side by side from it).

use std::fmt::Write;

use super::{bytes_both, HiCacheMode, Plan};
use crate::config::size::{grouped, human_bytes};
use crate::config::AttentionKind;

pub fn render(plan: &Plan) -> String {
    let mut out = String::new();
    let m = &plan.model;
    let p = &plan.params;
    let _ = writeln!(out, "DeepSeek V4 memory plan: {} (per rank)", m.name);
    let _ = writeln!(
        out,
        "  model    {} layers ({} SWA, {} CSA, {} HCA) + {} MTP, hidden {}, {:.1}B parameters",
        m.num_layers,
        m.count(AttentionKind::Swa),
        m.count(AttentionKind::Csa),
        m.count(AttentionKind::Hca),
        m.num_mtp_layers,
        m.hidden_size,
        plan.params_total as f64 / 1e9
    );
    let _ = writeln!(
        out,
        "  deploy   backend {}, role {}, tp {}, ep {}, page {} tokens, kv {}, indexer {}",
        json_str(&serde_json::to_value(p.backend).unwrap_or_default()),
        json_str(&serde_json::to_value(p.role).unwrap_or_default()),
        p.parallel.tp,
        p.parallel.ep,
        plan.geometry.page_size,
        super::kv_name(plan.kv_dtype),
        super::indexer_name(plan.indexer_dtype),
    );
    let weights: Vec<String> = plan
        .weights
        .iter()
        .map(|(dtype, bytes)| format!("{} {}", dtype.name(), human_bytes(*bytes)))
        .collect();
    let weight_total: u64 = plan.weights.values().sum();
    let _ = writeln!(
        out,
        "  weights  {} = {}",
        weights.join(" + "),
        bytes_both(weight_total)
    );
    let _ = writeln!(
        out,
        "  budget   device KV {} from {}",
        bytes_both(plan.budget.bytes),
        plan.budget.source
    );
    out.push('\n');

    let header = [
        "pool",
        "unit",
        "layers",
        "rows/unit",
        "row B",
        "unit B",
        "device units",
        "device B",
        "host units",
        "host B",
    ];
    let mut rows: Vec<[String; 10]> = plan
        .pools
        .iter()
        .map(|pool| {
            let s = &pool.shape;
            [
                s.id.name().to_string(),
                format!("{:?}", s.unit).to_lowercase(),
                s.layers.to_string(),
                s.rows_per_unit.to_string(),
                s.row_bytes.to_string(),
                grouped(s.unit_bytes),
                grouped(pool.device_units),
                grouped(pool.device_bytes()),
                grouped(pool.host_units),
                grouped(pool.host_bytes()),
            ]
        })
        .collect();
    rows.push([
        "total".into(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        String::new(),
        grouped(plan.device_bytes()),
        String::new(),
        grouped(plan.host_bytes()),
    ]);
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &[String]| {
        let mut s = String::from(" ");
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // Names left-aligned, numbers right-aligned.
            if i < 2 {
                let _ = write!(s, " {cell:<w$}");
            } else {
                let _ = write!(s, " {cell:>w$}");
            }
        }
        s.trim_end().to_string()
    };
    let _ = writeln!(out, "{}", line(&header.map(String::from)));
    for row in &rows {
        let _ = writeln!(out, "{}", line(row));
    }
    out.push('\n');

    let _ = writeln!(
        out,
        "  capacity device {} tokens, host {} tokens, {} request(s) of the full {}-token context \
         at once",
        grouped(plan.device_tokens()),
        grouped(plan.host_tokens()),
        grouped(plan.max_full_context_requests()),
        grouped(plan.max_context_tokens)
    );
    let hicache = match plan.hicache {
        HiCacheMode::Off => "off (hicache.enabled = false)".to_string(),
        HiCacheMode::Ratio { ratio, defaulted } => format!(
            "ratio {ratio}{} → host {}, {}",
            if defaulted { " (default)" } else { "" },
            bytes_both(plan.host_bytes()),
            json_str(&serde_json::to_value(p.hicache.write_policy).unwrap_or_default())
        ),
        HiCacheMode::Size { budget_bytes } => format!(
            "size {} → host {} = effective ratio {:.2}, {}",
            bytes_both(budget_bytes),
            bytes_both(plan.host_bytes()),
            plan.effective_ratio(),
            json_str(&serde_json::to_value(p.hicache.write_policy).unwrap_or_default())
        ),
    };
    let _ = writeln!(out, "  hicache  {hicache}");
    let n = &plan.numa;
    let node = n.node.as_ref().map_or("none".to_string(), |node| {
        format!("{} ({})", node.index, n.source)
    });
    let _ = writeln!(
        out,
        "  numa     node {node}: {} — {}",
        if n.fits { "fits" } else { "DOES NOT FIT" },
        n.reason
    );
    for note in &plan.notes {
        let _ = writeln!(out, "  note     {note}");
    }
    out.push('\n');
    let _ = writeln!(out, "summary");
    for (key, value) in summary(plan) {
        let _ = writeln!(out, "  {key}: {value}");
    }
    out
}

/// The figures an operator compares between deployments.
fn summary(plan: &Plan) -> Vec<(&'static str, String)> {
    let mode = match plan.hicache {
        HiCacheMode::Off => "off".to_string(),
        HiCacheMode::Ratio { ratio, .. } => format!("ratio {ratio}"),
        HiCacheMode::Size { budget_bytes } => format!("size {} B", grouped(budget_bytes)),
    };
    vec![
        ("hicache", mode),
        ("device KV bytes", bytes_both(plan.device_bytes())),
        ("device tokens", grouped(plan.device_tokens())),
        ("host bytes", bytes_both(plan.host_bytes())),
        ("host tokens", grouped(plan.host_tokens())),
        ("effective ratio", format!("{:.2}", plan.effective_ratio())),
        (
            "fits NUMA node",
            if plan.numa.fits { "yes" } else { "no" }.to_string(),
        ),
    ]
}

fn json_str(value: &serde_json::Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}
