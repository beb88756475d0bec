//! Reads every tensor the config implies, checks dtype and shape, and decodes it to f32
//! (dequantising FP8/FP4). Problems are collected, each naming the tensor and what was
//! expected against what was found, and reported together.

use std::collections::BTreeSet;

use half::{bf16, f16};
use safetensors::tensor::Dtype as StDtype;

use super::checkpoint::{Checkpoint, RawTensor};
use super::names::{locate, Location, Naming};
use crate::backend::{WeightData, WeightFormat, WeightPart};
use crate::config::model::{DenseFormat, ExpertFormat};
use crate::config::tensors::{Storage, TensorSpec};
use crate::config::ModelConfig;
use crate::error::{Error, ErrorKind, Result};

/// Reads tensors by official name and remembers which stored tensors were used.
pub struct Loader<'a> {
    ckpt: &'a Checkpoint,
    pub naming: Naming,
    config: &'a ModelConfig,
    problems: Vec<String>,
    used: BTreeSet<String>,
}

impl<'a> Loader<'a> {
    pub fn new(ckpt: &'a Checkpoint, config: &'a ModelConfig) -> Self {
        Self {
            ckpt,
            naming: Naming::detect(ckpt.names()),
            config,
            problems: Vec::new(),
            used: BTreeSet::new(),
        }
    }

    /// The tensor's values in f32 (logical shape), or `None` after recording why not.
    pub fn floats(&mut self, spec: &TensorSpec) -> Option<Vec<f32>> {
        match self.read_floats(spec) {
            Ok(v) => Some(v),
            Err(problem) => {
                self.problems.push(problem);
                None
            }
        }
    }

    /// The tensor as stored (raw bytes in its checkpoint format) and its column count, or
    /// `None` after recording why not: for matrices the backend may keep in their format.
    pub fn part(&mut self, spec: &TensorSpec) -> Option<(WeightPart<'a>, usize)> {
        match self.read_part(spec) {
            Ok(v) => Some(v),
            Err(problem) => {
                self.problems.push(problem);
                None
            }
        }
    }

    /// [`Self::floats`] for a small tensor that every token reads (norm weights, biases,
    /// sinks, hyper-connection parameters): also refused when any value is NaN or infinite,
    /// since one such value turns every logit into NaN. The scan costs one pass over values
    /// already decoded; the large matrices are not scanned at load (the engine's diagnostic
    /// re-run names them when their output turns non-finite).
    pub fn finite_floats(&mut self, spec: &TensorSpec) -> Option<Vec<f32>> {
        let values = self.floats(spec)?;
        match first_nonfinite(&values) {
            None => Some(values),
            Some((i, v)) => {
                let stored = self
                    .location(spec)
                    .map_or_else(|_| spec.name.clone(), |loc| loc.name);
                self.problems.push(format!(
                    "{}: element {} is {}: {CORRUPT}",
                    self.shown(spec, &stored),
                    index_in(&spec.shape, i),
                    describe(v)
                ));
                None
            }
        }
    }

    /// An integer table (the hash router's `tid2eid`), values checked to be in `0..limit`.
    pub fn indices(&mut self, spec: &TensorSpec, limit: usize) -> Option<Vec<i32>> {
        let result = (|| {
            let loc = self.location(spec)?;
            let raw = self.fetch(spec, &loc.name)?;
            self.expect_shape(spec, &raw, &spec.shape)?;
            let values: Vec<i64> = match raw.dtype {
                StDtype::I64 => raw
                    .bytes
                    .chunks_exact(8)
                    .map(|b| i64::from_le_bytes(b.try_into().unwrap_or_default()))
                    .collect(),
                StDtype::I32 => raw
                    .bytes
                    .chunks_exact(4)
                    .map(|b| i64::from(i32::from_le_bytes(b.try_into().unwrap_or_default())))
                    .collect(),
                other => return Err(self.wrong_dtype(spec, &raw, other, "I64 or I32")),
            };
            if let Some((i, v)) = values
                .iter()
                .enumerate()
                .find(|(_, &v)| v < 0 || v as usize >= limit)
            {
                return Err(format!(
                    "{}: entry {i} (token {}) routes to expert {v}, but the model has {limit} \
                     experts",
                    self.shown(spec, &loc.name),
                    i / spec.shape.get(1).copied().unwrap_or(1).max(1)
                ));
            }
            Ok(values.into_iter().map(|v| v as i32).collect())
        })();
        match result {
            Ok(v) => Some(v),
            Err(p) => {
                self.problems.push(p);
                None
            }
        }
    }

    /// Whether a tensor exists (MTP blocks are optional).
    pub fn has(&self, spec: &TensorSpec) -> bool {
        self.location(spec)
            .is_ok_and(|loc| self.ckpt.get(&loc.name).is_some())
    }

    /// How many problems are recorded so far.
    pub fn problem_count(&self) -> usize {
        self.problems.len()
    }

    /// Removes and returns the problems recorded after the first `mark`.
    pub fn take_problems_since(&mut self, mark: usize) -> Vec<String> {
        self.problems.split_off(mark.min(self.problems.len()))
    }

    /// Fails with every problem found, including stored tensors nothing asked for (outside
    /// `ignored_prefixes`).
    pub fn finish(mut self, ignored_prefixes: &[&str]) -> Result<()> {
        let unexpected: Vec<String> = self
            .ckpt
            .names()
            .filter(|n| !self.used.contains(*n))
            .filter(|n| !ignored_prefixes.iter().any(|p| n.starts_with(p)))
            .map(|n| {
                let t = self.ckpt.get(n);
                let (dtype, shape) = t.map_or((String::new(), Vec::new()), |t| {
                    (format!("{:?}", t.dtype), t.shape.to_vec())
                });
                format!(
                    "unexpected tensor `{n}` ({dtype} {shape:?}): this config does not use it; \
                     is config.json from another checkpoint?"
                )
            })
            .collect();
        self.problems.extend(unexpected);
        // A stacked expert tensor is read once per expert, so a problem with it (a NaN in its
        // shared scale) is found once per expert: report it once.
        let mut seen = BTreeSet::new();
        self.problems.retain(|p| seen.insert(p.clone()));
        if self.problems.is_empty() {
            return Ok(());
        }
        const SHOWN: usize = 20;
        let total = self.problems.len();
        if total > SHOWN {
            self.problems.truncate(SHOWN);
            self.problems.push(format!("… and {} more", total - SHOWN));
        }
        Err(Error::from_problems(
            ErrorKind::ModelFormat,
            "checkpoint",
            &self.problems,
        ))
    }

    fn location(&self, spec: &TensorSpec) -> Result<Location, String> {
        locate(&spec.name, self.naming, self.config.moe_intermediate_size)
            .ok_or_else(|| format!("`{}` has no name in this checkpoint's scheme", spec.name))
    }

    /// "`layers.0.attn.wq_a.weight` (stored as `model.layers.0.self_attn.q_a_proj.weight`)".
    fn shown(&self, spec: &TensorSpec, stored: &str) -> String {
        if stored == spec.name {
            format!("`{}`", spec.name)
        } else {
            format!("`{}` (stored as `{stored}`)", spec.name)
        }
    }

    fn fetch(&mut self, spec: &TensorSpec, stored: &str) -> Result<RawTensor<'a>, String> {
        match self.ckpt.get(stored) {
            Some(t) => {
                self.used.insert(stored.to_string());
                Ok(t)
            }
            None => Err(format!(
                "missing tensor {}: expected {:?} {}",
                self.shown(spec, stored),
                spec.shape,
                storage_name(spec.storage)
            )),
        }
    }

    fn expect_shape(
        &self,
        spec: &TensorSpec,
        raw: &RawTensor,
        shape: &[usize],
    ) -> Result<(), String> {
        if raw.shape == shape {
            Ok(())
        } else {
            Err(format!(
                "{}: expected shape {shape:?}, found {:?} ({:?})",
                self.shown(spec, raw.name),
                raw.shape,
                raw.dtype
            ))
        }
    }

    fn wrong_dtype(
        &self,
        spec: &TensorSpec,
        raw: &RawTensor,
        found: StDtype,
        expected: &str,
    ) -> String {
        format!(
            "{}: expected dtype {expected}, found {found:?} {:?}",
            self.shown(spec, raw.name),
            raw.shape
        )
    }

    fn read_floats(&mut self, spec: &TensorSpec) -> Result<Vec<f32>, String> {
        let (part, cols) = self.read_part(spec)?;
        Ok(WeightData {
            cols,
            parts: vec![part],
        }
        .to_f32())
    }

    /// The tensor as stored (raw bytes in its checkpoint format, scales decoded), checked, with
    /// its column count: a matrix `[rows, cols]`, anything else as `[elements, 1]`.
    fn read_part(&mut self, spec: &TensorSpec) -> Result<(WeightPart<'a>, usize), String> {
        let loc = self.location(spec)?;
        let raw = self.fetch(spec, &loc.name)?;
        let (rows, cols) = match spec.shape.as_slice() {
            [r, c] => (*r, *c),
            other => (other.iter().product(), 1),
        };
        // A stacked expert tensor [E, R, C]: take expert e's [R, C] matrix, then the rows asked.
        let (matrix_rows, expert) = match &loc.slice {
            Some(s) => {
                let stacked_rows = if s.rows.end == usize::MAX {
                    rows
                } else {
                    2 * rows
                };
                (stacked_rows, Some(s.expert))
            }
            None => (rows, None),
        };
        let row_range = match &loc.slice {
            Some(s) if s.rows.end != usize::MAX => s.rows.clone(),
            _ => 0..rows,
        };
        let stack = |shape: Vec<usize>| -> Vec<usize> {
            match expert {
                Some(_) => {
                    let mut full = vec![self.config.n_routed_experts];
                    full.extend(shape);
                    full
                }
                None => shape,
            }
        };
        let float_shape = if spec.shape.len() == 2 || expert.is_some() {
            stack(vec![matrix_rows, cols])
        } else {
            spec.shape.clone()
        };
        let part = |format, bytes, scales| WeightPart {
            format,
            bytes,
            scales,
            stored_rows: matrix_rows,
            rows: row_range.clone(),
        };
        let experts = self.config.n_routed_experts;
        let part = match raw.dtype {
            StDtype::F32 | StDtype::BF16 | StDtype::F16 => {
                self.expect_shape(spec, &raw, &float_shape)?;
                let format = match raw.dtype {
                    StDtype::F32 => WeightFormat::F32,
                    StDtype::BF16 => WeightFormat::Bf16,
                    _ => WeightFormat::F16,
                };
                let (values, _, _) = expert_part(expert, experts, raw.bytes, Vec::new());
                part(format, values, Vec::new())
            }
            StDtype::F8_E4M3 if matches!(spec.storage, Storage::Linear | Storage::Expert) => {
                self.expect_shape(spec, &raw, &float_shape)?;
                let block = match self.config.dense_format {
                    DenseFormat::Fp8Block { block } => block,
                    _ => [128, 128],
                };
                let scale_shape = stack(vec![
                    matrix_rows.div_ceil(block[0]),
                    cols.div_ceil(block[1]),
                ]);
                let scales = self.scales(spec, &loc.scale, &scale_shape)?;
                let (values, scales, offset) = expert_part(expert, experts, raw.bytes, scales);
                let block_rows =
                    row_range.start / block[0]..(row_range.end.max(1) - 1) / block[0] + 1;
                self.check_scales(
                    spec,
                    &loc.scale,
                    &scale_shape,
                    &scales,
                    offset,
                    block_rows,
                    cols.div_ceil(block[1]),
                )?;
                part(WeightFormat::Fp8E4m3 { block }, values, scales)
            }
            StDtype::I8 | StDtype::U8 if spec.storage == Storage::Expert => {
                let block = match self.config.expert_format {
                    ExpertFormat::Fp4 { block } => block,
                    ExpertFormat::Dense => 32,
                };
                if cols % 2 != 0 || cols % block != 0 {
                    return Err(format!(
                        "{}: FP4 experts need an input width that is a multiple of {block}, the \
                         config gives {cols}",
                        self.shown(spec, raw.name)
                    ));
                }
                self.expect_shape(spec, &raw, &stack(vec![matrix_rows, cols / 2]))?;
                let scale_shape = stack(vec![matrix_rows, cols / block]);
                let scales = self.scales(spec, &loc.scale, &scale_shape)?;
                let (values, scales, offset) = expert_part(expert, experts, raw.bytes, scales);
                // One scale row per weight row.
                self.check_scales(
                    spec,
                    &loc.scale,
                    &scale_shape,
                    &scales,
                    offset,
                    row_range.clone(),
                    cols / block,
                )?;
                part(WeightFormat::Fp4E2m1 { block }, values, scales)
            }
            other => {
                let expected = match spec.storage {
                    Storage::Linear => "F32, BF16, F16 or F8_E4M3 (+ scale)",
                    Storage::Expert => {
                        "F32, BF16, F16, F8_E4M3 (+ scale) or I8 packed FP4 (+ scale)"
                    }
                    Storage::Unquantized | Storage::Float32 => "F32, BF16 or F16",
                    Storage::Index => "I64",
                };
                return Err(self.wrong_dtype(spec, &raw, other, expected));
            }
        };
        // The checks above tie bytes and scales to the shapes; this guards the arithmetic.
        part.check(cols)
            .map_err(|e| format!("{}: weight {e}", self.shown(spec, raw.name)))?;
        Ok((part, cols))
    }

    /// The scale tensor of a quantised weight, decoded to f32 multipliers.
    fn scales(
        &mut self,
        spec: &TensorSpec,
        stored: &str,
        shape: &[usize],
    ) -> Result<Vec<f32>, String> {
        let raw = self.ckpt.get(stored).ok_or_else(|| {
            format!(
                "missing scale `{stored}` for quantised {}: expected F8_E8M0 {shape:?}",
                self.shown(spec, stored)
            )
        })?;
        self.used.insert(stored.to_string());
        if raw.shape != shape {
            return Err(format!(
                "scale `{stored}`: expected shape {shape:?}, found {:?}",
                raw.shape
            ));
        }
        let scales = match raw.dtype {
            StDtype::F8_E8M0 => raw
                .bytes
                .iter()
                .map(|&b| crate::formats::e8m0_decode(b))
                .collect(),
            StDtype::F32 | StDtype::BF16 | StDtype::F16 => floats(&raw),
            other => {
                return Err(format!(
                    "scale `{stored}`: expected dtype F8_E8M0 (or F32), found {other:?}"
                ))
            }
        };
        Ok(scales)
    }

    /// Refuses a NaN or infinite scale (e8m0 byte 0xff is NaN) among the scale rows `rows` of
    /// `scales` (`cols` per row), which start at flat index `offset` of the stored tensor of
    /// `shape`. Each scale multiplies a whole block of weights, so one bad scale poisons a
    /// block of outputs; scales are small, so they are always scanned. Only the rows this
    /// weight uses are looked at, so a stacked tensor shared by several weights reports each
    /// bad scale once, under the weight that reads it.
    #[allow(clippy::too_many_arguments)]
    fn check_scales(
        &self,
        spec: &TensorSpec,
        stored: &str,
        shape: &[usize],
        scales: &[f32],
        offset: usize,
        rows: std::ops::Range<usize>,
        cols: usize,
    ) -> Result<(), String> {
        let used =
            &scales[(rows.start * cols).min(scales.len())..(rows.end * cols).min(scales.len())];
        match first_nonfinite(used) {
            None => Ok(()),
            Some((i, v)) => Err(format!(
                "scale `{stored}` of `{}`: block {} is {}: {CORRUPT}",
                spec.name,
                index_in(shape, offset + rows.start * cols + i),
                describe(v)
            )),
        }
    }
}

/// What to do about a non-finite value in a checkpoint.
const CORRUPT: &str = "the checkpoint is corrupt (one such value makes every logit NaN); \
                       download it again, or convert it again from the original release";

/// The first NaN or infinite value and its flat index.
fn first_nonfinite(values: &[f32]) -> Option<(usize, f32)> {
    values
        .iter()
        .position(|v| !v.is_finite())
        .map(|i| (i, values[i]))
}

/// A flat index as a multi-dimensional one: 17 in [4, 8] → "[2, 1]".
fn index_in(shape: &[usize], flat: usize) -> String {
    let mut rest = flat;
    let mut parts = vec![0; shape.len().max(1)];
    for (d, &extent) in shape.iter().enumerate().rev() {
        parts[d] = rest % extent.max(1);
        rest /= extent.max(1);
    }
    if shape.is_empty() {
        parts[0] = flat;
    }
    let parts: Vec<String> = parts.iter().map(usize::to_string).collect();
    format!("[{}]", parts.join(", "))
}

fn describe(v: f32) -> String {
    if v.is_nan() {
        "NaN".into()
    } else {
        format!("{v}")
    }
}

fn floats(raw: &RawTensor) -> Vec<f32> {
    match raw.dtype {
        StDtype::F32 => raw
            .bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        StDtype::BF16 => raw
            .bytes
            .chunks_exact(2)
            .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        StDtype::F16 => raw
            .bytes
            .chunks_exact(2)
            .map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => Vec::new(),
    }
}

fn storage_name(storage: Storage) -> &'static str {
    match storage {
        Storage::Linear => "linear weight",
        Storage::Expert => "expert weight",
        Storage::Unquantized => "float tensor",
        Storage::Float32 => "f32 tensor",
        Storage::Index => "I64 table",
    }
}

/// One expert's quantised values and scales out of a stacked tensor (all of it for `None`),
/// with the offset of its first scale in the stacked scale tensor.
fn expert_part(
    expert: Option<usize>,
    experts: usize,
    values: &[u8],
    scales: Vec<f32>,
) -> (&[u8], Vec<f32>, usize) {
    match expert {
        Some(e) => {
            let (nv, ns) = (values.len() / experts.max(1), scales.len() / experts.max(1));
            (
                &values[e * nv..(e + 1) * nv],
                scales[e * ns..(e + 1) * ns].to_vec(),
                e * ns,
            )
        }
        None => (values, scales, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw<'a>(dtype: StDtype, bytes: &'a [u8]) -> RawTensor<'a> {
        RawTensor {
            name: "t",
            dtype,
            shape: &[],
            bytes,
        }
    }

    #[test]
    fn flat_indices_are_named_by_dimension() {
        assert_eq!(index_in(&[4, 8], 17), "[2, 1]");
        assert_eq!(index_in(&[160], 5), "[5]");
        assert_eq!(index_in(&[6, 160, 1], 161), "[1, 1, 0]");
        assert_eq!(index_in(&[], 0), "[0]");
        assert_eq!(describe(f32::NEG_INFINITY), "-inf");
        assert_eq!(
            first_nonfinite(&[1.0, f32::NAN, f32::INFINITY]).unwrap().0,
            1
        );
    }

    #[test]
    fn half_precision_floats_decode_exactly() {
        // 1.5, -2.0 and the smallest normal of each format, little-endian.
        let f16_bytes = [0x00, 0x3e, 0x00, 0xc0, 0x00, 0x04];
        assert_eq!(
            floats(&raw(StDtype::F16, &f16_bytes)),
            vec![1.5, -2.0, 2f32.powi(-14)]
        );
        let bf16_bytes = [0xc0, 0x3f, 0x00, 0xc0, 0x80, 0x00];
        assert_eq!(
            floats(&raw(StDtype::BF16, &bf16_bytes)),
            vec![1.5, -2.0, 2f32.powi(-126)]
        );
        let f32_bytes = 0.1f32.to_le_bytes();
        assert_eq!(floats(&raw(StDtype::F32, &f32_bytes)), vec![0.1]);
    }
}
