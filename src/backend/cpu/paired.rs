//! A decode step's few inputs against a matrix's rows two at a time: each pair of rows is
//! decoded (FP8) or widened (bf16) in registers once for up to eight inputs. The inputs are
//! interleaved by 16 columns first, once per product, so a kernel walks all of them with one
//! pointer: with a pointer per input the kernels ran out of general registers and the
//! compiler kept some of the 16 sums on the stack.

/// Inputs this many at a time share one pass over a pair of rows (16 sums in registers).
pub(super) const CHUNK: usize = 8;

/// A product's inputs, in chunks of up to [`CHUNK`], each chunk interleaved by 16 columns:
/// columns `16c..16c + 16` of the chunk's input `i` at `(c · len + i) · 16`.
pub(super) struct Interleaved {
    chunks: Vec<(usize, Vec<f32>)>,
    inputs: usize,
}

impl Interleaved {
    /// `inputs`, each at least `cols` floats; `cols` a multiple of 16.
    pub(super) fn new(inputs: &[&[f32]], cols: usize) -> Self {
        assert!(cols.is_multiple_of(16), "columns in whole vectors");
        let chunks = inputs
            .chunks(CHUNK)
            .map(|chunk| {
                let mut out = Vec::with_capacity(chunk.len() * cols);
                for c in (0..cols).step_by(16) {
                    for x in chunk {
                        out.extend_from_slice(&x[c..c + 16]);
                    }
                }
                (chunk.len(), out)
            })
            .collect();
        Self {
            chunks,
            inputs: inputs.len(),
        }
    }

    /// Products with rows `j0..j1` (an even count), two at a time: `pair(j, n, xi)` gives rows
    /// `j` and `j + 1` against the `n` inputs interleaved in `xi` (its first `n` entries);
    /// they land at `out[(j - j0) · inputs + input]`.
    pub(super) fn for_pairs(
        &self,
        (j0, j1): (usize, usize),
        out: &mut [f32],
        mut pair: impl FnMut(usize, usize, &[f32]) -> [[f32; 2]; CHUNK],
    ) {
        let n = self.inputs;
        assert!((j1 - j0).is_multiple_of(2) && out.len() >= (j1 - j0) * n);
        for j in (j0..j1).step_by(2) {
            let (first, second) = out[(j - j0) * n..(j + 2 - j0) * n].split_at_mut(n);
            for (c, (len, xi)) in self.chunks.iter().enumerate() {
                let d = pair(j, *len, xi);
                for (i, d) in d.iter().take(*len).enumerate() {
                    first[CHUNK * c + i] = d[0];
                    second[CHUNK * c + i] = d[1];
                }
            }
        }
    }
}

/// A kernel's `N` results as [`Interleaved::for_pairs`] takes them.
pub(super) fn widen<const N: usize>(d: [[f32; 2]; N]) -> [[f32; 2]; CHUNK] {
    let mut out = [[0.0; 2]; CHUNK];
    out[..N].copy_from_slice(&d);
    out
}

/// `$kernel::<N $(, $extra)*>($args)` for `N` = `$n` in 1..=8, through [`widen`].
macro_rules! by_inputs {
    ($n:expr, $($kernel:ident)::+, [$($extra:expr),*], ($($args:expr),*)) => {
        match $n {
            1 => $crate::backend::cpu::paired::widen($($kernel)::+::<1 $(, $extra)*>($($args),*)),
            2 => $crate::backend::cpu::paired::widen($($kernel)::+::<2 $(, $extra)*>($($args),*)),
            3 => $crate::backend::cpu::paired::widen($($kernel)::+::<3 $(, $extra)*>($($args),*)),
            4 => $crate::backend::cpu::paired::widen($($kernel)::+::<4 $(, $extra)*>($($args),*)),
            5 => $crate::backend::cpu::paired::widen($($kernel)::+::<5 $(, $extra)*>($($args),*)),
            6 => $crate::backend::cpu::paired::widen($($kernel)::+::<6 $(, $extra)*>($($args),*)),
            7 => $crate::backend::cpu::paired::widen($($kernel)::+::<7 $(, $extra)*>($($args),*)),
            _ => $crate::backend::cpu::paired::widen($($kernel)::+::<8 $(, $extra)*>($($args),*)),
        }
    };
}
pub(super) use by_inputs;

#[cfg(test)]
mod tests {
    use super::*;

    /// The interleaved layout holds every input's every column where `for_pairs`' kernels
    /// look for it, and results land at their row and input.
    #[test]
    fn interleaved_inputs_reach_their_rows_and_inputs() {
        let cols = 48;
        let xs: Vec<Vec<f32>> = (0..11)
            .map(|i| (0..cols).map(|c| (i * 1000 + c) as f32).collect())
            .collect();
        let inputs: Vec<&[f32]> = xs.iter().map(Vec::as_slice).collect();
        let il = Interleaved::new(&inputs, cols);
        let mut out = vec![f32::NAN; 4 * inputs.len()];
        let mut calls = 0;
        il.for_pairs((6, 10), &mut out, |j, n, xi| {
            calls += 1;
            assert_eq!(xi.len(), n * cols);
            let mut d = [[0.0; 2]; CHUNK];
            for (i, d) in d.iter_mut().take(n).enumerate() {
                // Column c of this chunk's input i, read back from the layout.
                let x = |c: usize| xi[(c / 16 * n + i) * 16 + c % 16];
                assert!((0..cols).all(|c| x(c) == x(0) + c as f32));
                *d = [
                    x(0) + (j * 100_000) as f32,
                    x(5) + ((j + 1) * 100_000) as f32,
                ];
            }
            d
        });
        assert_eq!(calls, 2 * 2, "two pairs of rows, two chunks of inputs");
        for r in 0..4 {
            for i in 0..inputs.len() {
                let (j, c) = (6 + r, if r % 2 == 0 { 0 } else { 5 });
                assert_eq!(
                    out[r * inputs.len() + i],
                    xs[i][c] + (j * 100_000) as f32,
                    "row {j} input {i}"
                );
            }
        }
    }
}
