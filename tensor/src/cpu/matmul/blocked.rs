//! A blocked f32 product `C = A · B` (Goto's and BLIS's loops: `B` packed a `KC x NC` block at
//! a time into 16-column panels, `A` an `MC x KC` block at a time into 6-row panels, a 6 x 16
//! micro-kernel over each pair, or with AVX-512 a 12 x 16 one over two panels of `A`), run by
//! default on CPUs with AVX2 and FMA but no AVX-512. Beside the `gemm` crate's AVX2 path,
//! alternating on a 2-core Zen 3 (`bench_against_the_gemm_crate` below): square products about
//! equal (both ~90% of a core's FMA peak on one thread), products with a transposed operand,
//! which this packs through 8 x 8 register transposes, up to 1.2x ahead (a decoder block's
//! Q/K/V 150 against 125 GFLOP/s on two threads), and the threads share a product out with one
//! fork and join.
//!
//! On a 2-core Zen 4 (AVX-512 on 256-bit units; 3 rounds, medians, GFLOP/s on two threads)
//! the 12 x 16 kernel brings it to the `gemm` crate's AVX-512 path on square products (1024:
//! 197 against 200, 2048: 199 against 198) and ahead where an operand is transposed (Q/K/V
//! `w.t()` 189 against 177, its weight gradient `dy.t()` 199 against 178), behind on `dy @ w`
//! of an MLP layer (185 against 195). Where `B` is at most [`DIRECT_PANELS`] panels wide, whole
//! 12-row tiles read `A` where it lies: packing it for so few panels had cost ~15% of such a
//! product (the main job's `dy @ w`, FFN2 and projection, `n = 64`, ran at 148-181 against the
//! crate's 177-205; now `dy @ w` of 2048 x 256 x 64 runs at 110 against 111 on one thread).
//! Whole steps (`bench_train`, `WGPIPE_CPU_MATMUL` below, alternating, three runs of each):
//! the MLP and both decoder blocks at parity, the main job's model at 0.82 and 0.96 of the
//! crate's in two runs. Timing each product inside the main job's steps showed where: its
//! narrow and batched products (64 x 2048 x 64 weight gradients, 128 heads of 64 x 16 x 64)
//! run slower here than in the crate, its wide ones with a transposed operand faster. So with
//! AVX-512 this runs the big products with a transposed operand only (see [`chosen`]).
//!
//! Operands are read through any strides while they are packed, so transposed views cost no
//! copy. Every element of `C` sums its `k` products in the same order whatever the threads, the
//! blocking of `m` and `n` or the batch: results do not depend on how the work is shared out.

use std::cell::Cell;

use rayon::prelude::*;

use super::avx2::{MR, NR};
use crate::cpu::simd::{cpu_runs, Level};

/// Depth of a packed block: a `KC x NR` panel of `B` (16 KiB) stays in L1 while the micro-kernel
/// runs down a block of `A`. 512 (each tile of `C` read and written half as often where `k` is
/// larger) was tried on a Zen 4: 2-5% ahead on warm-cache products with `k` of 1024 or 2048,
/// but in whole steps (three alternations) the block's `dy.t() @ x` products were 2-11% slower
/// and the rest within the noise; kept at 256.
const KC: usize = 256;
/// Rows of a packed block of `A` at most (`MC x KC` = 144 KiB, in L2).
const MC: usize = 144;
/// Columns of a packed block of `B` at most (`KC x NC` = 3 MiB, in L3).
const NC: usize = 3072;

/// An operand read through its strides: element `(i, j)` is at `ptr + i * rs + j * cs`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Strided {
    pub ptr: *const f32,
    pub rs: usize,
    pub cs: usize,
}

// SAFETY: the operands are only read, while `gemm` runs (its caller keeps them alive).
unsafe impl Send for Strided {}
unsafe impl Sync for Strided {}

impl Strided {
    /// The operand whose element `(0, 0)` is this one's `(i, j)`.
    ///
    /// # Safety
    /// `(i, j)` must be inside the operand.
    unsafe fn from(self, i: usize, j: usize) -> Strided {
        Strided {
            ptr: self.ptr.add(i * self.rs + j * self.cs),
            ..self
        }
    }
}

/// The row-major output: element `(i, j)` at `ptr + i * ldc + j`, written by parts that each own
/// a different set of its tiles.
#[derive(Clone, Copy)]
pub(crate) struct Out {
    pub ptr: *mut f32,
    pub ldc: usize,
}

// SAFETY: parts write disjoint tiles (see `gemm`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The output whose element `(0, 0)` is this one's `(i, j)`.
    ///
    /// # Safety
    /// `(i, j)` must be inside the output.
    unsafe fn from(self, i: usize, j: usize) -> Out {
        Out {
            ptr: self.ptr.add(i * self.ldc + j),
            ..self
        }
    }
}

/// Whether matmul should run [`gemm`] for a product; `on_avx512`: it does so on AVX-512 CPUs
/// too (`blocked_on_avx512` in `matmul`: at least [`BIG_SIDE`] rows and columns wide with an
/// operand whose `k` axis is the wrong one for its packing, `w.t()`, `dy.t()`, an attention's
/// `k.t()`, or a single `x @ w.t()` of any size). On CPUs with AVX2 and FMA but no AVX-512 it
/// runs every product; with AVX-512 those only, where it packs the transposed operand through
/// register transposes and the `gemm` crate packs it element by element or after a transposing
/// copy (`matmul_by_panels`), and the crate's 16-lane kernels run the rest (ahead on the narrow
/// and batched products of the main job's model: its 64 x 2048 x 64 weight gradients take the
/// crate ~100 us, this ~200). Timed inside whole steps on a Zen 4: a decoder block's
/// `q @ k.t()` (32 heads of 128 x 64 x 128) 386-458 us here against 530-566 in the crate. `WGPIPE_CPU_MATMUL` overrides that, to compare the two on one machine:
/// `gemm-crate` asks for the `gemm` crate everywhere, `blocked` for this product wherever AVX2
/// and FMA are.
pub(crate) fn chosen(on_avx512: bool) -> bool {
    static ASKED: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
    match ASKED
        .get_or_init(|| std::env::var("WGPIPE_CPU_MATMUL").ok())
        .as_deref()
    {
        Some("gemm-crate") => false,
        Some("blocked") => supported(),
        // The CPU's own features (as `WGPIPE_CPU_SIMD` leaves them), not the level tests cap
        // the other kernels to: the `gemm` crate and this product sum in different orders,
        // and the choice must not change while another test's products run.
        _ => supported() && (on_avx512 || !cpu_runs(Level::Avx512)),
    }
}

/// The fewest rows and columns of a product with a transposed operand that runs here on
/// AVX-512 CPUs (see [`chosen`]; a single `x @ w.t()` runs here at any size).
pub(crate) const BIG_SIDE: usize = 128;

/// Whether [`gemm`] can run here at all: the CPU has AVX2 and FMA (whatever build level tests
/// cap the other kernels' dispatch to meanwhile).
pub(crate) fn supported() -> bool {
    cpu_runs(Level::Avx2)
}

/// `C = A · B` for `m x k` `A`, `k x n` `B` and row-major `C`, over up to
/// `threads` rayon threads. `k` must be at least 1.
///
/// Threads share the product out as whole sub-products (ranges of rows and of columns, see
/// [`grid`]), each packing its own operands: one fork and join per product. Sharing
/// one packed block of `B` instead (BLIS's way) needs two joins per `KC` step: a first version
/// that did ran a 256 x 1024 x 1024 product at 95 GFLOP/s on two threads against the `gemm`
/// crate's 105 (alternating); with one join, 101 against 93 (a later sitting, as noisy).
///
/// # Safety
/// [`supported`] must be true; every element `(i, p)` of `A` for `i < m, p < k`, and `(p, j)`
/// of `B` for `j < n`, must be readable; `C`'s `m` rows of `n` values must be writable and not
/// read or written by anyone else meanwhile.
pub(crate) unsafe fn gemm(
    m: usize,
    n: usize,
    k: usize,
    a: Strided,
    b: Strided,
    out: Out,
    threads: usize,
) {
    assert!(k > 0 && supported());
    // Chosen once: every part must split the rows by the same tile.
    let tiles = Tiles::here();
    let depth = depth_parts(m, n, k);
    if depth > 1 {
        by_depth(m, n, k, a, b, out, (tiles, depth, threads));
        return;
    }
    let (row_parts, col_parts) = grid(m, n, threads);
    if row_parts * col_parts == 1 {
        serial(m, n, k, a, b, out, tiles);
        return;
    }
    (0..row_parts * col_parts).into_par_iter().for_each(|t| {
        let (i0, i1) = share(m, tiles.rows(), row_parts, t / col_parts);
        let (j0, j1) = share(n, NR, col_parts, t % col_parts);
        let (sub_a, sub_b, sub_c) = (a.from(i0, 0), b.from(0, j0), out.from(i0, j0));
        serial(i1 - i0, j1 - j0, k, sub_a, sub_b, sub_c, tiles);
    });
}

/// Part `index` of `parts` of `0..len`: whole tiles of `tile`, shared out as evenly as tiles go
/// (only the product's own edge tile is partial), so that equal threads finish together.
fn share(len: usize, tile: usize, parts: usize, index: usize) -> (usize, usize) {
    let tiles = len.div_ceil(tile);
    let at = |i: usize| (i * tiles / parts * tile).min(len);
    (at(index), at(index + 1))
}

/// How many ranges of rows and of columns the threads share out: one part per thread, each at
/// least [`MIN_PART`] long where it splits, and of such splits the one that packs least (each
/// part packs the rows of `A` and the columns of `B` it covers). Mid-sized products, too small
/// for that, get parts down to 64 long (packing then costs more per multiply, but an idle
/// thread costs more).
///
/// Up to four parts per thread (a first version, so that a thread slowed by another process
/// would leave its later parts to the others) packed more: on 2 threads of a Zen 3, alternating
/// four times each in a quiet moment, square 1024 ran at 169 against 180 GFLOP/s with one part
/// per thread, 512 at 165 against 177, a weight gradient's `dy.t() @ x` (1024 x 256 x 1024) at
/// 159 against 174. A part count that was not a multiple of the threads (3 x 3 on two) left one
/// idle: a block's Q/K/V weight gradient (768 x 256 x 1024) ran at 132 GFLOP/s before, 175 now.
fn grid(m: usize, n: usize, threads: usize) -> (usize, usize) {
    if threads <= 1 {
        return (1, 1);
    }
    let split = |min: usize| {
        (1..=threads)
            .filter(|rows| threads.is_multiple_of(*rows))
            .map(|rows| (rows, threads / rows))
            .filter(|&(rows, cols)| {
                (rows == 1 || m >= rows * min) && (cols == 1 || n >= cols * min)
            })
            .min_by_key(|&(rows, cols)| m / rows + n / cols)
    };
    split(MIN_PART).or_else(|| split(64)).unwrap_or((1, 1))
}

/// How many parts of `k` [`gemm`] cuts a product into (1: none): products too narrow for the
/// threads to share by rows or columns (see [`grid`]) with a deep `k`, such as the main job's
/// 64 x 2048 x 64 weight gradients, which one thread ran alone at ~80 GFLOP/s on a Zen 4
/// without AVX-512 (`WGPIPE_CPU_SIMD=avx2`), as on a Zen 3. Decided from the shape alone,
/// never from the threads, so the result's bits do not depend on them.
fn depth_parts(m: usize, n: usize, k: usize) -> usize {
    if grid(m, n, 2) != (1, 1) {
        return 1;
    }
    (k / DEPTH_PART).clamp(1, MAX_DEPTH_PARTS)
}

/// The least depth of a part of `k` (two `KC` blocks: each part adds its own `m x n` sum).
const DEPTH_PART: usize = 2 * KC;
/// Parts of `k` at most.
const MAX_DEPTH_PARTS: usize = 4;

/// [`gemm`] with `k` cut into `parts` ranges of whole `KC` blocks, run side by side over up to
/// `threads` threads: the first range's product into `C`, the others' into buffers of their own,
/// added to `C` in range order afterwards.
///
/// # Safety
/// As [`gemm`]'s.
unsafe fn by_depth(
    m: usize,
    n: usize,
    k: usize,
    a: Strided,
    b: Strided,
    out: Out,
    (tiles, parts, threads): (Tiles, usize, usize),
) {
    let len = k.div_ceil(parts).next_multiple_of(KC);
    let ranges: Vec<(usize, usize)> = (0..parts)
        .map(|p| ((p * len).min(k), ((p + 1) * len).min(k)))
        .filter(|(k0, k1)| k0 < k1)
        .collect();
    // Every value is written (each range's first `KC` block stores, not adds).
    let mut sums = crate::host_pool::take_for_overwrite((ranges.len() - 1) * m * n);
    let outs: Vec<Out> = std::iter::once(out)
        .chain(sums.chunks_mut(m * n).map(|s| Out {
            ptr: s.as_mut_ptr(),
            ldc: n,
        }))
        .collect();
    let part = |(&(k0, k1), &o): (&(usize, usize), &Out)| {
        // SAFETY: as the caller's; each range reads its own columns of `A` and rows of `B`, and
        // writes its own output.
        unsafe { serial(m, n, k1 - k0, a.from(0, k0), b.from(k0, 0), o, tiles) }
    };
    if threads > 1 {
        let per_thread = ranges.len().div_ceil(threads);
        let jobs = ranges.par_iter().zip(outs.par_iter());
        jobs.with_min_len(per_thread).for_each(part);
    } else {
        ranges.iter().zip(&outs).for_each(part);
    }
    for sum in sums.chunks(m * n) {
        for (i, row) in sum.chunks(n).enumerate() {
            let c = std::slice::from_raw_parts_mut(out.ptr.add(i * out.ldc), n);
            c.iter_mut().zip(row).for_each(|(c, s)| *c += s);
        }
    }
    crate::host_pool::give(sums);
}

/// The narrowest range of rows or columns a part has where the grid has more than one: it packs
/// the other operand's whole `k` for it, about `16 / MIN_PART` of its multiply time per packed
/// value.
const MIN_PART: usize = 256;

/// [`gemm`] on the calling thread.
///
/// # Safety
/// As [`gemm`]'s.
unsafe fn serial(m: usize, n: usize, k: usize, a: Strided, b: Strided, out: Out, tiles: Tiles) {
    // Blocks of `A` of equal height (a multiple of the tile's).
    let blocks_m = m.div_ceil(MC);
    let mc = m.div_ceil(blocks_m).next_multiple_of(tiles.rows());
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let panels = nc.div_ceil(NR);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            with_buffer(&B_PACK, panels * kc * NR, |bp| {
                let group = B_PANELS_TOGETHER * kc * NR;
                for (g, dst) in bp.chunks_mut(group).enumerate() {
                    let j = jc + g * B_PANELS_TOGETHER * NR;
                    pack_b(dst, b, pc, j, kc, (B_PANELS_TOGETHER * NR).min(jc + nc - j));
                }
                // A few panels of `B`: whole 12-row tiles read `A` where it lies, the rows
                // left over are packed as usual.
                let direct_rows = if tiles == Tiles::Wide && panels <= DIRECT_PANELS {
                    m / (2 * MR) * (2 * MR)
                } else {
                    0
                };
                let direct = Block {
                    ap: &[], // its tiles read `A` in place
                    bp,
                    kc,
                    accumulate: pc > 0,
                    tiles,
                };
                for i in (0..direct_rows).step_by(2 * MR) {
                    for jp in 0..panels {
                        let j = jc + jp * NR;
                        direct.direct_tile(out, a.from(i, pc), i, jp, j, NR.min(n - j));
                    }
                }
                for i0 in (direct_rows..m).step_by(mc) {
                    let rows = mc.min(m - i0);
                    with_buffer(&A_PACK, rows.div_ceil(MR) * kc * MR + 2, |ap| {
                        pack_a(ap, a, i0, rows, pc, kc);
                        let block = Block {
                            ap,
                            bp,
                            kc,
                            accumulate: pc > 0,
                            tiles,
                        };
                        for jp in 0..panels {
                            let j = jc + jp * NR;
                            block.row_of_tiles(out, i0, rows, jp, j, NR.min(n - j));
                        }
                    });
                }
            });
        }
    }
}

/// Panels of `B` (of [`NR`] columns) up to which the AVX-512 kernel reads `A` unpacked: each
/// value of `A` is then used at most this many times, and packing it cost ~15% of such a
/// product (the main job's `n = 64` products on a Zen 4). Reading every row-major `A` unpacked
/// was tried: an MLP layer's products (`A` 1024 wide) ran 26-45% slower, the tile's twelve rows
/// 4 KiB apart falling in one set of L1.
const DIRECT_PANELS: usize = 4;

/// The packed blocks of one `kc` step.
struct Block<'a> {
    ap: &'a [f32],
    bp: &'a [f32],
    kc: usize,
    accumulate: bool,
    tiles: Tiles,
}

impl Block<'_> {
    /// The tiles of panel `jp` of `B` (columns `j..j + cols` of `C`) with every panel of the
    /// packed block of `A` (rows `i0..i0 + rows`).
    ///
    /// # Safety
    /// As [`gemm`]'s: the tiles are inside `C` and this task's own.
    unsafe fn row_of_tiles(
        &self,
        out: Out,
        i0: usize,
        rows: usize,
        jp: usize,
        j: usize,
        cols: usize,
    ) {
        let kc = self.kc;
        let b = self.bp[jp * kc * NR..].as_ptr();
        let panel = |ip: usize| self.ap[ip * kc * MR..].as_ptr();
        let wide = cols == NR && self.tiles == Tiles::Wide;
        let mut ip = 0;
        while ip < rows.div_ceil(MR) {
            let i = i0 + ip * MR;
            let c = out.ptr.add(i * out.ldc + j);
            if wide && rows >= (ip + 2) * MR {
                let (a0, a1) = (panel(ip), panel(ip + 1));
                super::avx512::kernel_12x16(kc, a0, a1, b, c, out.ldc, self.accumulate);
                ip += 2;
                continue;
            }
            let a = panel(ip);
            let h = MR.min(rows - ip * MR);
            ip += 1;
            if h == MR && cols == NR {
                super::avx2::kernel_6x16(kc, a, b, c, out.ldc, self.accumulate);
            } else {
                // An edge tile: the full tile into a scratch one, then its valid part (added in
                // the same order as the kernel adds).
                let mut tile = Tile([0.0; 2 * MR * NR]);
                super::avx2::kernel_6x16(kc, a, b, tile.0.as_mut_ptr(), NR, false);
                write_part(&tile.0, c, out.ldc, h, cols, self.accumulate);
            }
        }
    }

    /// The 12 x 16 tile at rows `i..i + 12`, columns `j..j + cols` of `C` from `A` unpacked (`a`
    /// at row `i`, column `pc` of the block) and panel `jp` of `B`.
    ///
    /// # Safety
    /// As [`gemm`]'s: the tile's rows are inside `A` and `C`, and this task's own.
    unsafe fn direct_tile(&self, out: Out, a: Strided, i: usize, jp: usize, j: usize, cols: usize) {
        let b = self.bp[jp * self.kc * NR..].as_ptr();
        let c = out.ptr.add(i * out.ldc + j);
        let rows = std::array::from_fn(|r| a.ptr.add(r * a.rs));
        let kernel = |c: *mut f32, ldc: usize, accumulate: bool| {
            super::avx512::kernel_12x16_direct(self.kc, &rows, a.cs, b, c, ldc, accumulate)
        };
        if cols == NR {
            kernel(c, out.ldc, self.accumulate);
            return;
        }
        let mut tile = Tile([0.0; 2 * MR * NR]);
        kernel(tile.0.as_mut_ptr(), NR, false);
        write_part(&tile.0, c, out.ldc, 2 * MR, cols, self.accumulate);
    }
}

/// The first `rows x cols` values of an edge tile computed in scratch (rows [`NR`] apart) into
/// `C` at `c`, or added to it, in the order the kernels add.
///
/// # Safety
/// `c` must have `rows` rows of `cols` writable values `ldc` apart, this task's own.
unsafe fn write_part(
    tile: &[f32],
    c: *mut f32,
    ldc: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
) {
    for r in 0..rows {
        let dst = std::slice::from_raw_parts_mut(c.add(r * ldc), cols);
        let src = &tile[r * NR..r * NR + cols];
        if accumulate {
            dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
        } else {
            dst.copy_from_slice(src);
        }
    }
}

/// The micro-kernel for full tiles: the AVX2 one (6 x 16), or, where the CPU has AVX-512 (and
/// tests have not capped the kernels' level below it), the AVX-512 one (12 x 16, two panels of
/// `A` at a time; the odd panel and the edges still go through the AVX2 kernel). Both give the
/// same bits.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tiles {
    Avx2,
    Wide,
}

impl Tiles {
    fn here() -> Tiles {
        if super::super::simd::has_avx512() {
            Tiles::Wide
        } else {
            Tiles::Avx2
        }
    }

    /// Rows of a full tile.
    fn rows(self) -> usize {
        match self {
            Tiles::Avx2 => MR,
            Tiles::Wide => 2 * MR,
        }
    }
}

/// A scratch tile for either kernel (the AVX2 one fills its first half), aligned as their
/// stores like.
#[repr(align(64))]
struct Tile([f32; 2 * MR * NR]);

/// Packs rows `i0..i0 + rows`, columns `pc..pc + kc` of `A` into 6-row panels: panel `ip` holds
/// `kc` groups of six values (column `p` of its rows), rows past the block zero.
///
/// # Safety
/// The block must be inside `A`.
unsafe fn pack_a(dst: &mut [f32], a: Strided, i0: usize, rows: usize, pc: usize, kc: usize) {
    // Row-major blocks pack with 8-lane stores, which write two values past each panel: `dst`
    // has room for them (see `serial`), and the next panel overwrites them.
    assert!(dst.len() >= rows.div_ceil(MR) * kc * MR + 2);
    let base = a.ptr.add(i0 * a.rs + pc * a.cs);
    if a.rs == 1 && a.cs != 1 {
        // Column-major (a transposed view): a few panels at a time, a column of all of them
        // before the next column.
        for r0 in (0..rows).step_by(A_PANELS_TOGETHER * MR) {
            let group = (A_PANELS_TOGETHER * MR).min(rows - r0);
            let at = dst[r0 * kc..].as_mut_ptr();
            super::avx2::pack_a_columns(at, base.add(r0), a.cs, group, kc);
        }
        return;
    }
    for ip in 0..rows.div_ceil(MR) {
        let panel = &mut dst[ip * kc * MR..];
        let h = MR.min(rows - ip * MR);
        let base = base.add(ip * MR * a.rs);
        if a.cs == 1 {
            super::avx2::pack_a_rows(panel.as_mut_ptr(), base, a.rs, h, kc);
        } else {
            for (p, group) in panel[..kc * MR].chunks_exact_mut(MR).enumerate() {
                let col = base.add(p * a.cs);
                for (r, v) in group.iter_mut().enumerate() {
                    *v = if r < h { *col.add(r * a.rs) } else { 0.0 };
                }
            }
        }
    }
}

/// Panels of `A` packed together where `A` is column-major (see [`super::avx2::pack_a_columns`]):
/// 48 rows, three whole 64-byte lines of each column. Medians of 200 on a Zen 4, warm caches: a
/// 144 x 256 block of a `dy.t()` packed in 7.6-8.0 us a panel at a time where `dy` is 256 or 768
/// wide and 28.6 us where it is 1024 wide (its columns 4 KiB apart), 13.6-13.9 us all 24 panels
/// at a time (24 streams of stores), 4.0-4.3 us eight at a time, 4.2-4.8 us four at a time.
const A_PANELS_TOGETHER: usize = 8;

/// Panels of `B` packed together where `B` is row-major (see [`super::avx2::pack_b_rows`]): a
/// run of 256 bytes per row. Measured as [`A_PANELS_TOGETHER`]: a 256 x 256 block packed in
/// 8.0-8.1 us a panel at a time from a `B` 256 or 768 wide, 20.4 us from one 1024 wide; 6.2-6.5
/// us four at a time, 6.9-8.8 eight at a time; a 256 x 1024 block in 89 us a panel at a time,
/// 32 four at a time, 45 sixteen at a time.
const B_PANELS_TOGETHER: usize = 4;

/// Packs rows `pc..pc + kc`, columns `j..j + cols` of `B` into `cols.div_ceil(NR)` panels, `kc *
/// NR` values apart: each `kc` groups of sixteen values (row `p` of its columns), columns past
/// `cols` zero.
///
/// # Safety
/// The block must be inside `B`.
unsafe fn pack_b(dst: &mut [f32], b: Strided, pc: usize, j: usize, kc: usize, cols: usize) {
    let panels = cols.div_ceil(NR);
    assert!(dst.len() >= panels * kc * NR && dst.as_ptr().align_offset(32) == 0);
    let base = b.ptr.add(pc * b.rs + j * b.cs);
    if b.cs == 1 {
        super::avx2::pack_b_rows(dst.as_mut_ptr(), base, b.rs, cols, kc);
        return;
    }
    for (jp, dst) in dst.chunks_exact_mut(kc * NR).take(panels).enumerate() {
        let base = base.add(jp * NR * b.cs);
        let cols = NR.min(cols - jp * NR);
        if b.rs == 1 {
            // Column-major (a transposed weight): each column read along `k`.
            super::avx2::pack_b_columns(dst.as_mut_ptr(), base, b.cs, cols, kc);
        } else {
            for (p, group) in dst.chunks_exact_mut(NR).enumerate() {
                for (c, v) in group.iter_mut().enumerate() {
                    *v = if c < cols {
                        *base.add(p * b.rs + c * b.cs)
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

thread_local! {
    /// This thread's packing buffers, kept between products.
    static A_PACK: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    static B_PACK: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// Runs `f` on `len` values of a buffer taken from `cell` (aligned to 64 bytes; contents stale)
/// and puts it back. Taken, not borrowed: should `f` ever reach another product on this thread
/// (a wait inside rayon runs other tasks), that one finds the cell empty and makes its own
/// buffer instead of panicking on a second borrow.
fn with_buffer<R>(
    cell: &'static std::thread::LocalKey<Cell<Vec<f32>>>,
    len: usize,
    f: impl FnOnce(&mut [f32]) -> R,
) -> R {
    const ALIGN: usize = 16; // values: 64 bytes
    let mut buf = cell.with(Cell::take);
    if buf.len() < len + ALIGN {
        buf = vec![0.0; len + ALIGN];
    }
    let skip = buf.as_ptr().align_offset(64).min(ALIGN);
    let r = f(&mut buf[skip..skip + len]);
    cell.with(|c| c.set(buf));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `A · B` summed in f64 straight from the strides.
    fn naive(
        m: usize,
        n: usize,
        k: usize,
        a: &[f32],
        la: (usize, usize),
        b: &[f32],
        lb: (usize, usize),
    ) -> Vec<f32> {
        let mut c = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|p| a[i * la.0 + p * la.1] as f64 * b[p * lb.0 + j * lb.1] as f64)
                    .sum();
                c[i * n + j] = s as f32;
            }
        }
        c
    }

    fn values(len: usize, seed: u32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                (x as f32 / u32::MAX as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Strides of a `rows x cols` operand: row-major, column-major, or every other value of a
    /// row-major matrix twice as wide (neither stride 1).
    fn strides(kind: usize, rows: usize, cols: usize) -> ((usize, usize), usize) {
        match kind {
            0 => ((cols, 1), rows * cols),
            1 => ((1, rows), rows * cols),
            _ => ((2 * cols, 2), 2 * rows * cols),
        }
    }

    fn run(
        m: usize,
        n: usize,
        k: usize,
        ka: usize,
        kb: usize,
        threads: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (la, a_len) = strides(ka, m, k);
        let (lb, b_len) = strides(kb, k, n);
        let a = values(a_len, 1 + m as u32);
        let b = values(b_len, 2 + n as u32);
        // A row stride wider than n: the tiles must not write between rows.
        let ldc = n + 3;
        let mut c = vec![f32::NAN; m * ldc];
        let sa = Strided {
            ptr: a.as_ptr(),
            rs: la.0,
            cs: la.1,
        };
        let sb = Strided {
            ptr: b.as_ptr(),
            rs: lb.0,
            cs: lb.1,
        };
        // SAFETY: the operands hold exactly the strided extents; `c` m rows of ldc values.
        unsafe {
            gemm(
                m,
                n,
                k,
                sa,
                sb,
                Out {
                    ptr: c.as_mut_ptr(),
                    ldc,
                },
                threads,
            )
        };
        for row in c.chunks(ldc) {
            assert!(
                row[n..].iter().all(|v| v.is_nan()),
                "a value past column {n} was written"
            );
        }
        let got = c.chunks(ldc).flat_map(|r| r[..n].to_vec()).collect();
        (got, naive(m, n, k, &a, la, &b, lb))
    }

    /// The parts cover the product once, on whole tiles, as evenly as tiles go; there is one per
    /// thread (or one, for a product too small to share), and the products of an MLP and a
    /// decoder block split as worked out by hand.
    #[test]
    fn products_split_into_even_parts_one_per_thread() {
        for (len, tile, parts) in [(1024, MR, 4), (768, MR, 2), (257, NR, 3), (5, MR, 2)] {
            let ranges: Vec<_> = (0..parts).map(|i| share(len, tile, parts, i)).collect();
            assert_eq!(ranges[0].0, 0);
            assert_eq!(ranges[parts - 1].1, len);
            for pair in ranges.windows(2) {
                assert_eq!(pair[0].1, pair[1].0, "{len}/{parts}: {ranges:?}");
            }
            let tiles: Vec<_> = ranges.iter().map(|r| (r.1 - r.0).div_ceil(tile)).collect();
            let (least, most) = (tiles.iter().min().unwrap(), tiles.iter().max().unwrap());
            assert!(most - least <= 1, "{len}/{parts}: uneven {ranges:?}");
            assert!(ranges.iter().all(|r| r.0 % tile == 0), "{ranges:?}");
        }
        // (m, n, threads) -> (row parts, column parts)
        let cases = [
            ((256, 1024, 2), (1, 2)),   // an MLP layer: columns of 512
            ((1024, 768, 2), (2, 1)),   // a block's Q/K/V: the split that packs less
            ((768, 256, 2), (2, 1)),    // its weight gradient: 2 parts, not 3
            ((256, 256, 2), (1, 2)),    // mid-sized: one part of 128 per thread
            ((100, 100, 2), (1, 1)),    // too small to share
            ((4096, 4096, 1), (1, 1)),  // one thread
            ((1024, 4096, 16), (2, 8)), // many threads: a grid that packs least
        ];
        for ((m, n, threads), want) in cases {
            let got = grid(m, n, threads);
            assert_eq!(got, want, "{m} x {n} on {threads} threads");
            assert!(got == (1, 1) || got.0 * got.1 == threads);
        }
        // (m, n, k) -> parts of k: only products the grid cannot share, at least 512 deep each.
        let cases = [
            ((64, 64, 2048), 4),   // the main job's weight gradients
            ((28, 64, 2048), 4),   // its head's
            ((64, 64, 8192), 4),   // at most four
            ((64, 64, 1023), 1),   // too shallow for two
            ((127, 127, 1024), 2), // the widest that is cut
            ((128, 64, 4096), 1),  // the grid shares it by rows
        ];
        for ((m, n, k), want) in cases {
            assert_eq!(depth_parts(m, n, k), want, "{m} x {k} x {n}");
        }
    }

    /// Against the f64 product, over shapes that leave edge tiles in both directions and cross
    /// the `KC`, `MC` and `NC` blocks, every operand layout, one and several threads; the
    /// threads never change a bit.
    #[test]
    fn blocked_product_matches_the_naive_one_for_every_layout_and_thread_count() {
        if !supported() {
            eprintln!("skipped: this CPU has no AVX2 + FMA, so the blocked product never runs");
            return;
        }
        let shapes = [
            (1, 1, 1),
            (5, 15, 3),
            (6, 16, 256),
            (7, 17, 257),
            (13, 40, 600),
            (150, 33, 70),
            (300, 100, 20),
            (4, NC + 20, 9),
            // Cut along k: four parts of 512; two, the second shorter.
            (64, 64, 2048),
            (20, 30, 1100),
        ];
        for &(m, n, k) in &shapes {
            for ka in 0..3 {
                for kb in 0..3 {
                    let (one, want) = run(m, n, k, ka, kb, 1);
                    let tol = 2e-6 * (k as f32).sqrt().max(1.0) * 4.0;
                    for (i, (g, w)) in one.iter().zip(&want).enumerate() {
                        assert!(
                            (g - w).abs() <= tol,
                            "{m}x{k}x{n} layouts {ka}/{kb}: value {i} is {g}, the f64 product {w}"
                        );
                    }
                    for threads in [2, 3] {
                        let (several, _) = run(m, n, k, ka, kb, threads);
                        assert!(
                            one.iter()
                                .zip(&several)
                                .all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{m}x{k}x{n} layouts {ka}/{kb}: {threads} threads changed the result"
                        );
                    }
                }
            }
        }
    }

    /// Checks packed panels of `width` lanes (`MR` rows of `A` or `NR` columns of `B`), `kc`
    /// deep: lane `l` of step `p` of panel `q` holds `value(q * width + l, p)` for the first
    /// `len` lanes of the block and zero past them, and everything after the panels is still
    /// `sentinel`.
    fn check_panels(
        what: &str,
        packed: &[f32],
        (width, len, kc): (usize, usize, usize),
        sentinel: f32,
        value: impl Fn(usize, usize) -> f32,
    ) {
        let panels = len.div_ceil(width);
        for q in 0..panels {
            for p in 0..kc {
                for l in 0..width {
                    let i = q * width + l;
                    let want = if i < len { value(i, p) } else { 0.0 };
                    let got = packed[q * kc * width + p * width + l];
                    assert_eq!(got, want, "{what}: lane {i} (of {len}), step {p}");
                }
            }
        }
        assert!(
            packed[panels * kc * width..].iter().all(|&v| v == sentinel),
            "{what}: written past its panels"
        );
    }

    /// The packing loops against the layout written out value by value: several panels per
    /// call, rows and columns that are not whole panels or whole groups, operands 4 KiB wide
    /// (the case the grouping is for); the padding is zero and nothing is written past the
    /// panels the block needs.
    #[test]
    fn packed_panels_hold_the_blocks_values_and_zeros_past_them() {
        if !supported() {
            eprintln!("skipped: this CPU has no AVX2 + FMA, so the packing loops never run");
            return;
        }
        let sentinel = -7.5f32;
        // (rows of A or columns of B, kc, the operand's width): each packed both ways.
        let blocks: [(usize, usize, usize); 9] = [
            (1, 1, 1),
            (7, 9, 7),
            (13, 256, 1024),
            (17, 3, 20),
            (48, 5, 50),
            (64, 256, 1024),
            (70, 2, 75),
            (100, 7, 1024),
            (145, 33, 151),
        ];
        for (len, kc, ld) in blocks {
            let v = values(kc * ld, len as u32);
            // Column-major A: element (i, p) at p * ld + i (`dy.t()` of a `dy` `ld` wide).
            let mut dst = vec![sentinel; len.div_ceil(MR) * kc * MR + 2 + 64];
            let sa = Strided {
                ptr: v.as_ptr(),
                rs: 1,
                cs: ld,
            };
            // SAFETY: the block is inside `v`; `dst` has the room `pack_a` asks for.
            unsafe { pack_a(&mut dst, sa, 0, len, 0, kc) };
            let what = format!("A {len}x{kc} (ld {ld})");
            check_panels(&what, &dst, (MR, len, kc), sentinel, |i, p| v[p * ld + i]);
            // Row-major B: element (p, j) at p * ld + j.
            let mut buf = vec![sentinel; len.div_ceil(NR) * kc * NR + 64 + 16];
            let skip = buf.as_ptr().align_offset(64);
            let sb = Strided {
                ptr: v.as_ptr(),
                rs: ld,
                cs: 1,
            };
            // SAFETY: the block is inside `v`; the buffer is aligned and holds its panels.
            unsafe { pack_b(&mut buf[skip..], sb, 0, 0, kc, len) };
            let what = format!("B {kc}x{len} (ld {ld})");
            check_panels(&what, &buf[skip..], (NR, len, kc), sentinel, |j, p| {
                v[p * ld + j]
            });
        }
    }

    /// The AVX-512 kernel's tile is the AVX2 kernel's two tiles, bit for bit, and so is the one
    /// that reads `A` unpacked: written over and added to, for `kc` of one step, an odd count
    /// and a whole block, rows farther apart than a tile is wide.
    #[test]
    fn wide_kernel_gives_the_bits_of_two_avx2_tiles() {
        if !(supported() && std::arch::is_x86_feature_detected!("avx512f")) {
            eprintln!("skipped: this CPU has no AVX-512, so the 12 x 16 kernel never runs");
            return;
        }
        let ldc = NR + 5;
        for kc in [1, 7, KC] {
            let a = values(2 * kc * MR, kc as u32);
            let mut b = vec![0.0f32; kc * NR + 16];
            let skip = b.as_ptr().align_offset(64);
            b[skip..skip + kc * NR].copy_from_slice(&values(kc * NR, 3));
            let b = &b[skip..];
            for accumulate in [false, true] {
                let start = values(2 * MR * ldc, 4);
                let (mut wide, mut narrow) = (start.clone(), start.clone());
                let (a0, a1) = (a.as_ptr(), a[kc * MR..].as_ptr());
                // SAFETY: AVX-512 (checked above); each panel holds kc * MR values, `b` kc * NR
                // from a 64-byte boundary, the tiles twelve (six) rows `ldc` apart.
                unsafe {
                    crate::cpu::matmul::avx512::kernel_12x16(
                        kc,
                        a0,
                        a1,
                        b.as_ptr(),
                        wide.as_mut_ptr(),
                        ldc,
                        accumulate,
                    );
                    let c = narrow.as_mut_ptr();
                    super::super::avx2::kernel_6x16(kc, a0, b.as_ptr(), c, ldc, accumulate);
                    let c = c.add(MR * ldc);
                    super::super::avx2::kernel_6x16(kc, a1, b.as_ptr(), c, ldc, accumulate);
                }
                assert!(
                    wide.iter()
                        .zip(&narrow)
                        .all(|(w, n)| w.to_bits() == n.to_bits()),
                    "kc {kc}, accumulate {accumulate}: the 12 x 16 kernel differs"
                );
                assert_ne!(wide, start, "kc {kc}: the kernel wrote nothing");
                // The same twelve rows read where they lie: row-major (rows `kc + 3` apart)
                // and column-major (columns 12 + 5 apart).
                let (lda, ldt) = (kc + 3, 2 * MR + 5);
                let mut rows = vec![0.0f32; 2 * MR * lda];
                let mut cols = vec![0.0f32; kc * ldt];
                for i in 0..2 * MR {
                    for p in 0..kc {
                        let v = a[(i / MR) * kc * MR + p * MR + i % MR];
                        rows[i * lda + p] = v;
                        cols[p * ldt + i] = v;
                    }
                }
                for (name, src, rs, cs) in [("rows", &rows, lda, 1), ("columns", &cols, 1, ldt)] {
                    let mut direct = start.clone();
                    let starts = std::array::from_fn(|i| src[i * rs..].as_ptr());
                    // SAFETY: as above; elements (i, p) for i < 12, p < kc lie inside `src`.
                    unsafe {
                        crate::cpu::matmul::avx512::kernel_12x16_direct(
                            kc,
                            &starts,
                            cs,
                            b.as_ptr(),
                            direct.as_mut_ptr(),
                            ldc,
                            accumulate,
                        );
                    }
                    assert!(
                        direct
                            .iter()
                            .zip(&wide)
                            .all(|(d, w)| d.to_bits() == w.to_bits()),
                        "kc {kc}, accumulate {accumulate}: A read in {name} differs from packed"
                    );
                }
            }
        }
    }

    /// GFLOP/s of this product against the `gemm` crate's on the shapes of an MLP layer's three
    /// products and square ones, alternating (run: `cargo test -p wgpipe-tensor --release --lib
    /// blocked::tests::bench -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn bench_against_the_gemm_crate() {
        if !supported() {
            eprintln!("skipped: no AVX2 + FMA");
            return;
        }
        let threads = rayon::current_num_threads();
        // (name, m, k, n, A column-major, B column-major)
        let shapes = [
            ("square 512", 512, 512, 512, false, false),
            ("square 1024", 1024, 1024, 1024, false, false),
            ("square 2048", 2048, 2048, 2048, false, false),
            ("x @ w.t() 256x1024x1024", 256, 1024, 1024, false, true),
            ("dy @ w 256x1024x1024", 256, 1024, 1024, false, false),
            ("dy.t() @ x 1024x256x1024", 1024, 256, 1024, true, false),
            ("qkv 1024x256x768 (w.t())", 1024, 256, 768, false, true),
            ("dW qkv 768x1024x256 (dy.t())", 768, 1024, 256, true, false),
            ("head 128x64x128 (k.t())", 128, 64, 128, false, true),
            ("n = 64: 2048x256x64 (dy @ w)", 2048, 256, 64, false, false),
            ("n = 64: dW 192x2048x64 (dy.t)", 192, 2048, 64, true, false),
            ("mid 256x256x256", 256, 256, 256, false, false),
            ("lm ffn1 2048x64x256 (w.t())", 2048, 64, 256, false, true),
            ("lm dW 64x2048x64 (dy.t())", 64, 2048, 64, true, false),
            ("lm att q @ k.t() 64x16x64", 64, 16, 64, false, true),
            // The main job's micro-batches: one sequence of 64, d 64.
            ("mb qkv 64x64x192 (w.t())", 64, 64, 192, false, true),
            ("mb ffn1 64x64x256 (w.t())", 64, 64, 256, false, true),
            ("mb ffn2 64x256x64 (w.t())", 64, 256, 64, false, true),
            ("mb proj 64x64x64 (w.t())", 64, 64, 64, false, true),
            ("mb head 64x64x28 (w.t())", 64, 64, 28, false, true),
            ("mb dx 64x256x64 (dy @ w)", 64, 256, 64, false, false),
            ("mb dx 64x64x256 (dy @ w)", 64, 64, 256, false, false),
            ("mb dW 256x64x64 (dy.t())", 256, 64, 64, true, false),
            ("mb dW 192x64x64 (dy.t())", 192, 64, 64, true, false),
            ("few rows 16x1024x1024 (w.t())", 16, 1024, 1024, false, true),
            ("few rows 64x1024x1024 (w.t())", 64, 1024, 1024, false, true),
            ("few rows 96x256x768 (w.t())", 96, 256, 768, false, true),
        ];
        // `BENCH_SHAPES=x@w` runs only the shapes whose names contain it.
        let only = std::env::var("BENCH_SHAPES").unwrap_or_default();
        for (name, m, k, n, ta, tb) in shapes {
            if !name.contains(&only) {
                continue;
            }
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let mut c = vec![0.0f32; m * n];
            let (ars, acs) = if ta { (1, m) } else { (k, 1) };
            let (brs, bcs) = if tb { (1, k) } else { (n, 1) };
            let flops = 2.0 * (m * n * k) as f64;
            let reps = ((3e9 / flops) as usize).clamp(3, 2000);
            for t in [1, threads] {
                let mut ours = Vec::new();
                let mut crate_ = Vec::new();
                for _ in 0..5 {
                    let s = std::time::Instant::now();
                    for _ in 0..reps {
                        let sa = Strided {
                            ptr: a.as_ptr(),
                            rs: ars,
                            cs: acs,
                        };
                        let sb = Strided {
                            ptr: b.as_ptr(),
                            rs: brs,
                            cs: bcs,
                        };
                        unsafe {
                            gemm(
                                m,
                                n,
                                k,
                                sa,
                                sb,
                                Out {
                                    ptr: c.as_mut_ptr(),
                                    ldc: n,
                                },
                                t,
                            )
                        };
                    }
                    ours.push(flops * reps as f64 / s.elapsed().as_secs_f64() / 1e9);
                    let par = if t > 1 {
                        ::gemm::Parallelism::Rayon(0)
                    } else {
                        ::gemm::Parallelism::None
                    };
                    let s = std::time::Instant::now();
                    for _ in 0..reps {
                        unsafe {
                            ::gemm::gemm(
                                m,
                                n,
                                k,
                                c.as_mut_ptr(),
                                1,
                                n as isize,
                                false,
                                a.as_ptr(),
                                acs as isize,
                                ars as isize,
                                b.as_ptr(),
                                bcs as isize,
                                brs as isize,
                                0.0,
                                1.0,
                                false,
                                false,
                                false,
                                par,
                            )
                        };
                    }
                    crate_.push(flops * reps as f64 / s.elapsed().as_secs_f64() / 1e9);
                }
                ours.sort_by(f64::total_cmp);
                crate_.sort_by(f64::total_cmp);
                println!(
                    "{name:28} {t} thread(s): blocked {:6.1} GFLOP/s, gemm crate {:6.1} (medians of 5)",
                    ours[2], crate_[2]
                );
            }
        }
    }
}
