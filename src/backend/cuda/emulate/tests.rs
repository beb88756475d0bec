//! One test per op: the planner's launch run through the emulated kernel against the CPU
//! backend (an independent implementation), compared by kernels/README.md's contract.

use fastrand::Rng;
use half::{bf16, f16};

use super::{run, run_with_block};
use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::launch::{self, RoutePtrs};
use crate::backend::{
    Backend, Placement, Precision, RouteArgs, RouteKind, RowLayout, Rows, Scoring, WeightData,
    WeightFormat, WeightPart,
};
use crate::formats::rows::RowCodec;

fn cpu() -> CpuBackend {
    CpuBackend::new(1).unwrap()
}

/// A host buffer's address, as a kernel argument (read-only use).
fn at<T>(v: &[T]) -> u64 {
    v.as_ptr() as u64
}

/// A host buffer's address for a kernel to write.
fn out<T>(v: &mut [T]) -> u64 {
    v.as_mut_ptr() as u64
}

/// Values that exercise every path: zeros of both signs, subnormals, tiny and large normals,
/// and ordinary values, magnitudes up to `max`.
fn awkward(rng: &mut Rng, n: usize, max: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let sign = if rng.bool() { -1.0 } else { 1.0 };
            sign * match rng.u32(0..16) {
                0 => 0.0,
                1 => f32::from_bits(rng.u32(1..0x80_0000)),
                2 => rng.f32() * 1e-30,
                3 => rng.f32() * max,
                _ => rng.f32() * 4.0,
            }
        })
        .collect()
}

/// Bit equality, NaNs equal to NaNs (their payloads may differ on the GPU).
fn same(a: f32, b: f32) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

#[track_caller]
fn assert_bits(what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    if let Some(i) = (0..got.len()).find(|&i| !same(got[i], want[i])) {
        panic!(
            "{what}: element {i} is {:e} ({:#010x}), the CPU's is {:e} ({:#010x})",
            got[i],
            got[i].to_bits(),
            want[i],
            want[i].to_bits()
        );
    }
}

/// Distance in units in the last place (adjacent floats are 1 apart; ±0 are 1 apart).
fn ulps(a: f32, b: f32) -> u64 {
    let key = |x: f32| {
        let k = x.to_bits() as i32;
        i64::from(k ^ ((((k >> 31) as u32) >> 1) as i32))
    };
    (key(a) - key(b)).unsigned_abs()
}

#[track_caller]
fn assert_ulps(what: &str, got: &[f32], want: &[f32], max: u64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same(g, w) || (!g.is_nan() && !w.is_nan() && ulps(g, w) <= max),
            "{what}: element {i} is {g:e}, the CPU's is {w:e}: more than {max} ulp apart"
        );
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[test]
fn an_unknown_kernel_or_mistyped_arguments_are_refused() {
    let unknown = launch::Launch {
        kernel: "no_such_kernel",
        shape: launch::Shape::GridStride { items: 1 },
        args: vec![],
    };
    assert!(std::panic::catch_unwind(|| run(&unknown)).is_err());
    // add_f32 takes (ptr, ptr, i64): an i32 count must not reach it.
    let mut wrong = launch::add(0, 0, 1);
    wrong.args[2] = launch::Arg::I32(1);
    let e = std::panic::catch_unwind(|| run(&wrong)).unwrap_err();
    let msg = e.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(msg.contains("argument kinds"), "{msg}");
}

#[test]
fn embed_f32_and_bf16_tables_match_the_cpu() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(1));
    let (vocab, cols) = (37, 45);
    let values = awkward(&mut rng, vocab * cols, 3e38);
    let bytes = f32_bytes(&values);
    let weight = WeightData::whole(WeightFormat::F32, &bytes, Vec::new(), vocab, cols);
    let ids: Vec<i32> = (0..20).map(|_| rng.i32(0..vocab as i32)).collect();
    let cpu_ids = cpu.index(&ids).unwrap();
    // The f32 table as stored, and the bf16 table the CPU keeps for Precision::Bf16 (as bits).
    let bf16_table: Vec<u16> = values
        .iter()
        .map(|&v| bf16::from_f32(v).to_bits())
        .collect();
    for (precision, table) in [
        (Precision::F32, at(&values)),
        (Precision::Bf16, at(&bf16_table)),
    ] {
        let m = cpu.matrix(&weight, precision).unwrap();
        let want = cpu.read(&cpu.embed(&m, &cpu_ids).unwrap()).unwrap();
        let mut got = vec![0.0f32; ids.len() * cols];
        let bf16 = precision == Precision::Bf16;
        run(&launch::embed(table, bf16, at(&ids), out(&mut got), ids.len(), cols, vocab).unwrap());
        assert_bits(&format!("embed {precision:?}"), &got, &want);
    }
    // An id outside the vocabulary fills its row with NaN (the CPU would panic).
    let bad = [3, vocab as i32, -1];
    let mut got = vec![0.0f32; 3 * cols];
    run(&launch::embed(at(&values), false, at(&bad), out(&mut got), 3, cols, vocab).unwrap());
    assert_bits("id 3", &got[..cols], &values[3 * cols..4 * cols]);
    assert!(
        got[cols..].iter().all(|v| v.is_nan()),
        "bad ids give NaN rows"
    );
}

#[test]
fn rms_norm_with_and_without_weight_and_in_place_is_bit_exact() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(2));
    for (vectors, dim) in [(5, 1), (3, 7), (6, 33), (4, 300)] {
        let x = awkward(&mut rng, vectors * dim, 1e30);
        let w = awkward(&mut rng, dim, 100.0);
        let xt = cpu.tensor(&x).unwrap();
        let wt = cpu.tensor(&w).unwrap();
        for weight in [false, true] {
            let want = cpu
                .read(
                    &cpu.rms_norm(&xt, vectors, dim, weight.then_some(&wt), 1e-6)
                        .unwrap(),
                )
                .unwrap();
            let wptr = weight.then(|| at(&w));
            // Out of place, with blocks of 1, a few, and more threads than values.
            for block in [1, 7, super::EMU_BLOCK] {
                let mut got = vec![0.0f32; x.len()];
                let l = launch::rms_norm(at(&x), wptr, out(&mut got), vectors, dim, 1e-6);
                run_with_block(&l.unwrap(), block);
                let what = format!("rms_norm [{vectors}, {dim}] weight {weight} block {block}");
                assert_bits(&what, &got, &want);
            }
            let mut inplace = x.clone();
            let p = out(&mut inplace);
            run(&launch::rms_norm(p, wptr, p, vectors, dim, 1e-6).unwrap());
            assert_bits(
                &format!("rms_norm in place, weight {weight}"),
                &inplace,
                &want,
            );
        }
    }
}

#[test]
fn rope_apply_is_bit_exact_with_the_cpus_table_and_close_with_its_own() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(3));
    for (rows, heads, head_dim, pairs) in [(5, 3, 10, 3), (4, 2, 8, 4), (3, 1, 64, 32)] {
        let inv_freq: Vec<f32> = (0..pairs)
            .map(|i| 10000f32.powf(-((2 * i) as f32) / (2 * pairs) as f32))
            .collect();
        let positions: Vec<i32> = (0..rows)
            .map(|r| if r == 0 { 0 } else { rng.i32(0..200_000) })
            .collect();
        let x = awkward(&mut rng, rows * heads * head_dim, 1e30);
        // The CPU's own cos/sin: (pos as f32 * f).sin_cos(), as cpu::ops::rope computes them.
        let cpu_cs: Vec<f32> = positions
            .iter()
            .flat_map(|&p| inv_freq.iter().map(move |&f| (p as f32 * f).sin_cos()))
            .flat_map(|(s, c)| [c, s])
            .collect();
        let mut dev_cs = vec![0.0f32; rows * pairs * 2];
        let l = launch::rope_cos_sin(at(&inv_freq), at(&positions), out(&mut dev_cs), rows, pairs);
        run(&l.unwrap());
        assert_ulps("rope_cos_sin vs f32::sin_cos", &dev_cs, &cpu_cs, 1);
        let (rope, pos) = (cpu.rope(&inv_freq).unwrap(), cpu.index(&positions).unwrap());
        for inverse in [false, true] {
            let mut t = cpu.tensor(&x).unwrap();
            cpu.rope_apply(&mut t, heads, head_dim, &rope, &pos, inverse)
                .unwrap();
            let want = cpu.read(&t).unwrap();
            for (cs, exact) in [(&cpu_cs, true), (&dev_cs, false)] {
                let mut got = x.clone();
                let l = launch::rope_apply(
                    out(&mut got),
                    at(cs),
                    rows,
                    heads,
                    head_dim,
                    pairs,
                    inverse,
                );
                run(&l.unwrap());
                let what = format!("rope [{rows}, {heads}×{head_dim}] inverse {inverse}");
                if exact {
                    assert_bits(&what, &got, &want);
                    continue;
                }
                // Per pair: within 2^-22 · (|a| + |b|) of the CPU, a and b the inputs.
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    let pair = i & !1;
                    let bound = (x[pair].abs() + x[pair + 1].abs()) * 2f32.powi(-22);
                    assert!(
                        same(*g, *w) || (g - w).abs() <= bound,
                        "{what}, device cos/sin: element {i} is {g:e}, the CPU's {w:e}"
                    );
                }
            }
        }
    }
}

#[test]
fn swiglu_with_and_without_limit_is_within_4_ulp() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(4));
    for (rows, inter) in [(1, 1), (7, 33), (16, 200)] {
        for limit in [0.0f32, 7.0] {
            let mut gate_up = awkward(&mut rng, rows * 2 * inter, 1e30);
            if limit > 0.0 {
                // f32::min ignores a NaN gate: it becomes the limit.
                gate_up[0] = f32::NAN;
            }
            let t = cpu.tensor(&gate_up).unwrap();
            let want = cpu
                .read(&cpu.swiglu(&t, rows, inter, limit).unwrap())
                .unwrap();
            let mut got = vec![0.0f32; rows * inter];
            run(&launch::swiglu(at(&gate_up), out(&mut got), rows, inter, limit).unwrap());
            assert_ulps(
                &format!("swiglu [{rows}, {inter}] limit {limit}"),
                &got,
                &want,
                4,
            );
        }
    }
}

#[test]
fn add_split_and_take_rows_are_bit_exact() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(5));
    let (rows, widths) = (9, [3usize, 1, 17, 0, 8]);
    let total: usize = widths.iter().sum();
    let a = awkward(&mut rng, rows * total, 3e38);
    let b = awkward(&mut rng, rows * total, 3e38);
    let mut want = cpu.tensor(&a).unwrap();
    cpu.add_assign(&mut want, &cpu.tensor(&b).unwrap()).unwrap();
    let mut got = a.clone();
    run(&launch::add(out(&mut got), at(&b), got.len()));
    assert_bits("add_f32", &got, &cpu.read(&want).unwrap());

    let parts = cpu.split(&cpu.tensor(&a).unwrap(), rows, &widths).unwrap();
    let mut start = 0;
    for (part, &width) in parts.iter().zip(&widths) {
        let mut got = vec![0.0f32; rows * width];
        run(&launch::copy_cols(
            at(&a),
            out(&mut got),
            rows,
            total,
            start,
            width,
        ));
        let what = format!("copy_cols {start}..{}", start + width);
        assert_bits(&what, &got, &cpu.read(part).unwrap());
        start += width;
    }

    let picks = [4usize, 0, 8, 4, 2];
    let want = cpu
        .take_rows(&cpu.tensor(&a).unwrap(), total, &picks)
        .unwrap();
    let index: Vec<i32> = picks.iter().map(|&r| r as i32).collect();
    let mut got = vec![0.0f32; picks.len() * total];
    run(&launch::gather_rows(
        at(&a),
        at(&index),
        out(&mut got),
        picks.len(),
        total,
    ));
    assert_bits("gather_rows", &got, &cpu.read(&want).unwrap());
}

/// Every codec at awkward widths: (codec, width).
fn codecs() -> Vec<(RowCodec, usize)> {
    vec![
        (RowCodec::F32, 5),
        (RowCodec::F32, 64),
        (RowCodec::Bf16, 7),
        (RowCodec::Bf16, 130),
        (
            RowCodec::Fp8Kv {
                nope: 448,
                rope: 64,
            },
            512,
        ),
        (RowCodec::Fp8Kv { nope: 70, rope: 3 }, 73),
        (RowCodec::Fp8Kv { nope: 5, rope: 0 }, 5),
        (RowCodec::Fp8Index, 128),
        (RowCodec::Fp8Index, 200),
        (RowCodec::Fp8Index, 5),
        (RowCodec::Fp4Index, 128),
        (RowCodec::Fp4Index, 45),
        (RowCodec::Fp4Index, 32),
    ]
}

/// Rows of an indexer-key or KV-like scale per row: blocks with very different maxima.
fn kv_values(rng: &mut Rng, rows: usize, width: usize) -> Vec<f32> {
    let mut v = awkward(rng, rows * width, 3e38);
    for (r, row) in v.chunks_mut(width).enumerate() {
        // Whole rows of tiny values too (the scale floors decide there).
        if r % 4 == 1 {
            row.iter_mut().for_each(|x| *x *= 1e-38);
        }
    }
    v
}

#[test]
fn kv_rows_write_read_and_round_trip_match_the_cpu_byte_for_byte() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(6));
    for (codec, width) in codecs() {
        let row_bytes = codec.row_bytes(width);
        for paged in [true, false] {
            let (n, x_row0) = (9, 2);
            let x = kv_values(&mut rng, x_row0 + n + 1, width);
            // Paged: 4 rows per unit behind a shuffled page table; ring: 11 rows, wrapping.
            let (offset, rows_per_unit) = (24, 4);
            let unit_bytes = offset + rows_per_unit * row_bytes + 8;
            let mut pages: Vec<i32> = (0..6).collect();
            rng.shuffle(&mut pages);
            let ring_rows = 11;
            let (bytes, first) = if paged {
                (6 * unit_bytes, 3)
            } else {
                (offset + ring_rows * row_bytes + 5, 8)
            };
            let cpu_pages = cpu.index(&pages).unwrap();
            let layout = RowLayout {
                offset,
                row_bytes,
                width,
                codec,
                placement: if paged {
                    Placement::Paged {
                        pages: &cpu_pages,
                        rows_per_unit,
                        unit_bytes,
                    }
                } else {
                    Placement::Ring { rows: ring_rows }
                },
            };
            let what = format!("{codec:?} width {width} paged {paged}");
            // Both pools start as the same garbage: only the written rows' bytes may change,
            // pad bytes included.
            let garbage: Vec<u8> = (0..bytes).map(|i| (i * 37 + 11) as u8).collect();
            let mut buf = cpu.alloc(bytes).unwrap();
            cpu.write_bytes(&mut buf, 0, &garbage).unwrap();
            cpu.write_rows(
                &mut buf,
                &layout,
                first,
                &cpu.tensor(&x).unwrap(),
                x_row0..x_row0 + n,
            )
            .unwrap();
            let mut want = vec![0u8; bytes];
            cpu.read_bytes(&buf, 0, &mut want).unwrap();
            let mut pool = garbage.clone();
            let (pool_ptr, pages_ptr) = (out(&mut pool), if paged { at(&pages) } else { 0 });
            let l = launch::kv_write(at(&x), x_row0, n, &layout, pool_ptr, pages_ptr, first);
            run(&l.unwrap());
            if let Some(i) = (0..bytes).find(|&i| pool[i] != want[i]) {
                panic!(
                    "{what}: pool byte {i} is {:#04x}, the CPU's {:#04x}",
                    pool[i], want[i]
                );
            }

            let rows = Rows {
                buffer: &buf,
                layout,
                count: first + n,
            };
            let want = cpu
                .read(&cpu.read_rows(&rows, first..first + n).unwrap())
                .unwrap();
            let mut got = vec![0.0f32; n * width];
            let l = launch::kv_read(out(&mut got), n, &layout, at(&pool), pages_ptr, first);
            run(&l.unwrap());
            assert_bits(&format!("{what}: read"), &got, &want);
        }

        let rows = 7;
        let x = kv_values(&mut rng, rows, width);
        let mut t = cpu.tensor(&x).unwrap();
        cpu.codec_round_trip(&mut t, width, codec).unwrap();
        let mut got = x.clone();
        if let Some(l) = launch::kv_round_trip(out(&mut got), rows, width, codec).unwrap() {
            run(&l);
        }
        let what = format!("{codec:?} width {width}: round trip");
        assert_bits(&what, &got, &cpu.read(&t).unwrap());
    }
}

/// Block scales: powers of two (e8m0, some giving subnormal or overflowing products) and
/// arbitrary f32 multipliers (Hugging Face checkpoints).
fn scales(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| match rng.u32(0..3) {
            0 => 2f32.powi(rng.i32(-140..=-100)),
            1 => 2f32.powi(rng.i32(-20..=127)),
            _ => rng.f32() * 3.0 + 1e-3,
        })
        .collect()
}

#[test]
fn dequant_fp8_and_fp4_parts_to_f32_and_bf16_match_the_cpu() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(7));
    let cols: usize = 200;
    // Three stored matrices, every byte value (NaN codes included), ragged edge blocks.
    let fp8_big = [128, 128];
    let fp8_small = [3, 7];
    let q_a: Vec<u8> = (0..300 * cols).map(|_| rng.u8(..)).collect();
    let q_b: Vec<u8> = (0..9 * cols / 2).map(|_| rng.u8(..)).collect();
    let q_c: Vec<u8> = (0..10 * cols).map(|_| rng.u8(..)).collect();
    let s_a = scales(&mut rng, 300usize.div_ceil(128) * cols.div_ceil(128));
    let s_b = scales(&mut rng, 9 * cols.div_ceil(32));
    let s_c = scales(&mut rng, 10usize.div_ceil(3) * cols.div_ceil(7));
    let part = |format, bytes, scales: &Vec<f32>, stored_rows, rows| WeightPart {
        format,
        bytes,
        scales: scales.clone(),
        stored_rows,
        rows,
    };
    let weight = WeightData {
        cols,
        parts: vec![
            part(
                WeightFormat::Fp8E4m3 { block: fp8_big },
                &q_a,
                &s_a,
                300,
                5..290,
            ),
            part(WeightFormat::Fp4E2m1 { block: 32 }, &q_b, &s_b, 9, 2..9),
            part(
                WeightFormat::Fp8E4m3 { block: fp8_small },
                &q_c,
                &s_c,
                10,
                1..10,
            ),
        ],
    };
    assert_eq!(weight.check(), Ok(()));
    let rows = weight.rows();
    let want_f32 = weight.to_f32();
    let bf16_matrix = cpu.matrix(&weight, Precision::Bf16).unwrap();
    let all: Vec<i32> = (0..rows as i32).collect();
    let want_bf16 = cpu
        .read(&cpu.embed(&bf16_matrix, &cpu.index(&all).unwrap()).unwrap())
        .unwrap();

    let mut got_f32 = vec![0.0f32; rows * cols];
    let mut got_bf16 = vec![0u16; rows * cols];
    let mut row = 0;
    for p in &weight.parts {
        let (q, s) = (at(p.bytes), at(&p.scales));
        let n = p.rows.len();
        // Each part's launch writes from its first output row (out passed offset).
        let (o32, o16) = (
            out(&mut got_f32[row * cols..]),
            out(&mut got_bf16[row * cols..]),
        );
        run_some(launch::dequant(
            p.format,
            q,
            s,
            o32,
            p.rows.start,
            n,
            cols,
            false,
        ));
        run_some(launch::dequant(
            p.format,
            q,
            s,
            o16,
            p.rows.start,
            n,
            cols,
            true,
        ));
        row += n;
    }
    assert_bits("dequant to f32", &got_f32, &want_f32);
    let widened: Vec<f32> = got_bf16
        .iter()
        .map(|&b| bf16::from_bits(b).to_f32())
        .collect();
    assert_bits("dequant to bf16", &widened, &want_bf16);
}

#[test]
fn float_weight_conversions_match_the_cpu() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(8));
    let (rows, cols) = (33, 31);
    let n = rows * cols;
    // Every class of value: random bit patterns (NaNs, infinities, subnormals included).
    let f32s: Vec<f32> = (0..n).map(|_| f32::from_bits(rng.u32(..))).collect();
    let halves: Vec<u16> = (0..n).map(|_| rng.u16(..)).collect();
    let all: Vec<i32> = (0..rows as i32).collect();
    let ids = cpu.index(&all).unwrap();
    let f32_bytes = f32_bytes(&f32s);
    let half_bytes: Vec<u8> = halves.iter().flat_map(|h| h.to_le_bytes()).collect();

    // f32 → bf16 (convert_f32_to_bf16, also the activations' conversion for a bf16 GEMM).
    let w = WeightData::whole(WeightFormat::F32, &f32_bytes, Vec::new(), rows, cols);
    let m = cpu.matrix(&w, Precision::Bf16).unwrap();
    let want = cpu.read(&cpu.embed(&m, &ids).unwrap()).unwrap();
    let mut got = vec![0u16; n];
    run_some(launch::dequant(
        WeightFormat::F32,
        at(&f32s),
        0,
        out(&mut got),
        0,
        rows,
        cols,
        true,
    ));
    let widened: Vec<f32> = got.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    assert_bits("f32 → bf16", &widened, &want);

    // bf16 and f16 → f32, f16 → bf16.
    for format in [WeightFormat::Bf16, WeightFormat::F16] {
        let w = WeightData::whole(format, &half_bytes, Vec::new(), rows, cols);
        let mut got = vec![0.0f32; n];
        run_some(launch::dequant(
            format,
            at(&halves),
            0,
            out(&mut got),
            0,
            rows,
            cols,
            false,
        ));
        assert_bits(&format!("{format:?} → f32"), &got, &w.to_f32());
    }
    let w = WeightData::whole(WeightFormat::F16, &half_bytes, Vec::new(), rows, cols);
    let m = cpu.matrix(&w, Precision::Bf16).unwrap();
    let want = cpu.read(&cpu.embed(&m, &ids).unwrap()).unwrap();
    let mut got = vec![0u16; n];
    run_some(launch::dequant(
        WeightFormat::F16,
        at(&halves),
        0,
        out(&mut got),
        0,
        rows,
        cols,
        true,
    ));
    let widened: Vec<f32> = got.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
    assert_bits("f16 → bf16", &widened, &want);
    // A part already in the wanted precision is a copy: no kernel (a conversion kernel would
    // write the other width into `out`).
    let none = |f, bf16| launch::dequant(f, 1, 0, 2, 0, rows, cols, bf16).is_none();
    assert!(none(WeightFormat::F32, false) && none(WeightFormat::Bf16, true));
    // The raw values too (the CPU path above goes through f32 the same way).
    let direct: Vec<f32> = halves
        .iter()
        .map(|&h| bf16::from_f32(f16::from_bits(h).to_f32()).to_f32())
        .collect();
    assert_bits("f16 → bf16 (half)", &widened, &direct);
}

/// Runs a launch the planner must have produced.
#[track_caller]
fn run_some(launch: Option<launch::Launch>) {
    run(&launch.expect("a conversion kernel"));
}

fn scoring_code(s: Scoring) -> i32 {
    match s {
        Scoring::SqrtSoftplus => 0,
        Scoring::Sigmoid => 1,
        Scoring::Softmax => 2,
    }
}

/// One row's router keys (`score + bias`) in f64, for telling whether the choice is decided
/// by more than the kernels' tolerance.
fn keys_f64(logits: &[f32], bias: Option<&[f32]>, scoring: Scoring) -> Vec<f64> {
    let x: Vec<f64> = logits.iter().map(|&v| f64::from(v)).collect();
    let scores: Vec<f64> = match scoring {
        Scoring::SqrtSoftplus => x
            .iter()
            .map(|&v| if v > 20.0 { v } else { v.exp().ln_1p() }.sqrt())
            .collect(),
        Scoring::Sigmoid => x.iter().map(|&v| 1.0 / (1.0 + (-v).exp())).collect(),
        Scoring::Softmax => {
            let m = x.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let s: f64 = x.iter().map(|&v| (v - m).exp()).sum();
            x.iter().map(|&v| (v - m).exp() / s).collect()
        }
    };
    let b = |i: usize| bias.map_or(0.0, |b| f64::from(b[i]));
    scores.iter().enumerate().map(|(i, &s)| s + b(i)).collect()
}

/// Whether the first `k + 1` keys in descending order are pairwise well apart (so the chosen
/// experts and their order do not depend on an ulp of a score).
fn decided(keys: &[f64], k: usize) -> bool {
    let mut sorted = keys.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let end = (k + 1).min(sorted.len());
    sorted[..end]
        .windows(2)
        .all(|w| w[0] - w[1] > 2f64.powi(-14) * w[0].abs().max(w[1].abs()))
}

struct RouteOut {
    experts: Vec<i32>,
    weights: Vec<f32>,
    bad_row: i32,
}

/// Runs moe_route on host buffers (outputs prefilled with sentinels).
#[allow(clippy::too_many_arguments)]
fn route_emulated(
    logits: &[f32],
    bias: Option<&[f32]>,
    hash: Option<(&[i32], &[i32])>,
    rows: usize,
    experts: usize,
    top_k: usize,
    scoring: Scoring,
    normalize: bool,
    scale: f32,
    vocab: usize,
    block: u32,
) -> RouteOut {
    let mut o = RouteOut {
        experts: vec![-7; rows * top_k],
        weights: vec![99.0; rows * top_k],
        bad_row: i32::MAX,
    };
    let p = RoutePtrs {
        logits: at(logits),
        bias: bias.map_or(0, at),
        hash_table: hash.map_or(0, |(t, _)| at(t)),
        token_ids: hash.map_or(0, |(_, ids)| at(ids)),
        experts_out: out(&mut o.experts),
        weights_out: out(&mut o.weights),
        bad_row: &mut o.bad_row as *mut i32 as u64,
    };
    let code = scoring_code(scoring);
    let l = launch::route(p, rows, experts, top_k, code, normalize, scale, vocab).unwrap();
    run_with_block(&l, block);
    o
}

#[test]
fn moe_route_top_k_matches_the_cpu_within_8_ulp() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(9));
    let (rows, experts) = (24, 64);
    let mut compared = 0;
    let mut cases = 0;
    for scoring in [Scoring::SqrtSoftplus, Scoring::Sigmoid, Scoring::Softmax] {
        // Logits spread over each function's interesting range (sqrtsoftplus: past 20 too).
        let (lo, hi) = match scoring {
            Scoring::SqrtSoftplus => (-10.0f32, 26.0),
            Scoring::Sigmoid => (-6.0, 6.0),
            Scoring::Softmax => (-8.0, 8.0),
        };
        let logits: Vec<f32> = (0..rows * experts)
            .map(|_| lo + rng.f32() * (hi - lo))
            .collect();
        let bias: Vec<f32> = (0..experts).map(|_| rng.f32() * 0.2 - 0.1).collect();
        for (with_bias, normalize, top_k, block) in [
            (false, true, 6, 32),
            (true, false, 8, 7),
            (true, true, 1, 64),
        ] {
            let b = with_bias.then_some(bias.as_slice());
            let cpu_bias = cpu.tensor(&bias).unwrap();
            let t = cpu.tensor(&logits).unwrap();
            let routing = cpu
                .route(&RouteArgs {
                    logits: &t,
                    rows,
                    experts,
                    top_k,
                    scoring,
                    normalize,
                    scale: 2.5,
                    kind: RouteKind::TopK {
                        bias: with_bias.then_some(&cpu_bias),
                    },
                })
                .unwrap();
            let want_e = cpu.read_index(&routing.experts).unwrap();
            let want_w = cpu.read(&routing.weights).unwrap();
            let got = route_emulated(
                &logits, b, None, rows, experts, top_k, scoring, normalize, 2.5, 0, block,
            );
            assert_eq!(got.bad_row, i32::MAX, "no row is bad");
            let what = format!("{scoring:?} bias {with_bias} normalize {normalize} k {top_k}");
            for r in 0..rows {
                cases += 1;
                let keys = keys_f64(&logits[r * experts..(r + 1) * experts], b, scoring);
                if !decided(&keys, top_k) {
                    continue;
                }
                compared += 1;
                let s = r * top_k..(r + 1) * top_k;
                assert_eq!(got.experts[s.clone()], want_e[s.clone()], "{what} row {r}");
                assert_ulps(
                    &format!("{what} row {r}"),
                    &got.weights[s.clone()],
                    &want_w[s],
                    8,
                );
            }
        }
    }
    // Exact ties (equal logits score equally on both sides): the lower expert id first, as
    // the CPU's stable sort orders them.
    let (experts, top_k) = (9, 4);
    let logits = [0.5f32, 3.0, 3.0, -1.0, 3.0, 0.5, 0.5, 3.0, 0.5];
    for scoring in [Scoring::SqrtSoftplus, Scoring::Sigmoid, Scoring::Softmax] {
        let t = cpu.tensor(&logits).unwrap();
        let routing = cpu
            .route(&RouteArgs {
                logits: &t,
                rows: 1,
                experts,
                top_k,
                scoring,
                normalize: true,
                scale: 1.0,
                kind: RouteKind::TopK { bias: None },
            })
            .unwrap();
        let want = cpu.read_index(&routing.experts).unwrap();
        assert_eq!(want, [1, 2, 4, 7], "the CPU's tie order");
        let got = route_emulated(
            &logits, None, None, 1, experts, top_k, scoring, true, 1.0, 0, 4,
        );
        assert_eq!(got.experts, want, "ties, {scoring:?}");
    }
    assert!(
        compared * 10 >= cases * 9,
        "only {compared} of {cases} rows were decided"
    );
}

#[test]
fn moe_route_hash_matches_the_cpu_and_flags_the_first_bad_row() {
    let (cpu, mut rng) = (cpu(), Rng::with_seed(10));
    let (rows, experts, top_k, vocab) = (12, 16, 3, 10);
    let logits: Vec<f32> = (0..rows * experts).map(|_| rng.f32() * 8.0 - 4.0).collect();
    let table: Vec<i32> = (0..vocab * top_k)
        .map(|_| rng.i32(0..experts as i32))
        .collect();
    let ids: Vec<i32> = (0..rows).map(|_| rng.i32(0..vocab as i32)).collect();
    let (cpu_table, cpu_ids) = (cpu.index(&table).unwrap(), cpu.index(&ids).unwrap());
    let cpu_route =
        |logits: &[f32], rows, ids: &crate::backend::cpu::CpuIndex, table, scoring, normalize| {
            let t = cpu.tensor(logits).unwrap();
            cpu.route(&RouteArgs {
                logits: &t,
                rows,
                experts,
                top_k,
                scoring,
                normalize,
                scale: 1.5,
                kind: RouteKind::Hash {
                    table,
                    token_ids: ids,
                },
            })
        };
    for scoring in [Scoring::SqrtSoftplus, Scoring::Sigmoid, Scoring::Softmax] {
        for normalize in [false, true] {
            let routing =
                cpu_route(&logits, rows, &cpu_ids, &cpu_table, scoring, normalize).unwrap();
            let got = route_emulated(
                &logits,
                None,
                Some((&table, &ids)),
                rows,
                experts,
                top_k,
                scoring,
                normalize,
                1.5,
                vocab,
                super::EMU_BLOCK,
            );
            let what = format!("hash {scoring:?} normalize {normalize}");
            assert_eq!(got.bad_row, i32::MAX, "{what}");
            assert_eq!(
                got.experts,
                cpu.read_index(&routing.experts).unwrap(),
                "{what}"
            );
            assert_ulps(&what, &got.weights, &cpu.read(&routing.weights).unwrap(), 8);
        }
    }

    // Token ids outside the vocabulary at rows 3 and 5: bad_row is 3, the other rows are
    // routed as on the CPU and the bad rows' outputs are left alone.
    let mut bad_ids = ids.clone();
    bad_ids[3] = vocab as i32;
    bad_ids[5] = -1;
    let got = route_emulated(
        &logits,
        None,
        Some((&table, &bad_ids)),
        rows,
        experts,
        top_k,
        Scoring::Sigmoid,
        true,
        1.5,
        vocab,
        super::EMU_BLOCK,
    );
    assert_eq!(got.bad_row, 3);
    let good = cpu_route(
        &logits[..3 * experts],
        3,
        &cpu.index(&ids[..3]).unwrap(),
        &cpu_table,
        Scoring::Sigmoid,
        true,
    )
    .unwrap();
    assert_eq!(
        got.experts[..3 * top_k],
        cpu.read_index(&good.experts).unwrap()
    );
    assert_ulps(
        "rows before the bad one",
        &got.weights[..3 * top_k],
        &cpu.read(&good.weights).unwrap(),
        8,
    );
    for r in [3, 5] {
        assert!(got.experts[r * top_k..(r + 1) * top_k]
            .iter()
            .all(|&e| e == -7));
        assert!(got.weights[r * top_k..(r + 1) * top_k]
            .iter()
            .all(|&w| w == 99.0));
    }

    // A table entry outside the experts: the CPU's model format error, the kernel's bad_row.
    let mut bad_table = table.clone();
    bad_table[ids[4] as usize * top_k + 1] = experts as i32;
    let first = ids.iter().position(|&id| id == ids[4]).unwrap();
    let cpu_bad = cpu.index(&bad_table).unwrap();
    let e = cpu_route(&logits, rows, &cpu_ids, &cpu_bad, Scoring::Sigmoid, true)
        .err()
        .expect("the CPU refuses the table");
    assert!(e.message().contains("hash router"), "{e}");
    let got = route_emulated(
        &logits,
        None,
        Some((&bad_table, &ids)),
        rows,
        experts,
        top_k,
        Scoring::Sigmoid,
        true,
        1.5,
        vocab,
        super::EMU_BLOCK,
    );
    assert_eq!(got.bad_row, first as i32);

    // top_k beyond the experts: every row is bad, the first is 0.
    let got = route_emulated(
        &logits,
        None,
        None,
        rows,
        experts,
        experts + 1,
        Scoring::Sigmoid,
        true,
        1.0,
        0,
        8,
    );
    assert_eq!(got.bad_row, 0);
}
