//! Optional timing of the CPU backend's products, by shape, operand layouts and kernel: where a
//! training step's matmul time goes, product by product, measured inside the step
//! (`bench_train --matmul-times` prints it). Off by default; a product then pays one relaxed
//! atomic load.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::backend::{MatDims, MatLayout};

/// How an operand of a product lies in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum OperandLayout {
    /// Its rows contiguous (`x`, `w`, a head's `q` inside a wider row).
    RowMajor,
    /// Its columns contiguous: a transposed view (`w.t()`, `dy.t()`, `k.t()`).
    Transposed,
    /// Neither.
    Strided,
}

impl OperandLayout {
    fn of(l: MatLayout) -> OperandLayout {
        if l.col_stride == 1 {
            OperandLayout::RowMajor
        } else if l.row_stride == 1 {
            OperandLayout::Transposed
        } else {
            OperandLayout::Strided
        }
    }
}

/// The products of one kind the CPU backend ran while timing was on: `batch` products of
/// `m x k` by `k x n` each call, with these operand layouts, on `kernel`.
#[derive(Debug, Clone, PartialEq)]
pub struct MatmulTime {
    pub batch: usize,
    pub m: usize,
    pub k: usize,
    pub n: usize,
    pub a: OperandLayout,
    pub b: OperandLayout,
    /// The kernel that ran them: `blocked` (wgpipe's own), `gemm crate`, or `gemm crate, B
    /// copied` (a column-major right operand copied to row-major first).
    pub kernel: &'static str,
    pub calls: u64,
    /// Wall time over all the calls.
    pub seconds: f64,
}

impl MatmulTime {
    /// The rate the calls ran at, counting `2 m k n` per product.
    pub fn gflops(&self) -> f64 {
        let flops = 2.0 * (self.batch * self.m * self.k * self.n) as f64 * self.calls as f64;
        flops / self.seconds.max(f64::MIN_POSITIVE) / 1e9
    }
}

type Key = (
    usize,
    usize,
    usize,
    usize,
    OperandLayout,
    OperandLayout,
    &'static str,
);

static ON: AtomicBool = AtomicBool::new(false);
static TIMES: Mutex<BTreeMap<Key, (u64, Duration)>> = Mutex::new(BTreeMap::new());

/// Starts (`true`) or stops timing the CPU backend's products, process-wide. What was timed
/// stays until [`take_cpu_matmul_times`].
pub fn time_cpu_matmuls(on: bool) {
    ON.store(on, Ordering::Relaxed);
}

/// The products timed since the last call, the most time first, and forgets them.
pub fn take_cpu_matmul_times() -> Vec<MatmulTime> {
    let taken = std::mem::take(&mut *TIMES.lock().unwrap_or_else(|e| e.into_inner()));
    let mut times: Vec<MatmulTime> = taken
        .into_iter()
        .map(|((batch, m, k, n, a, b, kernel), (calls, t))| MatmulTime {
            batch,
            m,
            k,
            n,
            a,
            b,
            kernel,
            calls,
            seconds: t.as_secs_f64(),
        })
        .collect();
    times.sort_by(|x, y| y.seconds.total_cmp(&x.seconds));
    times
}

/// Whether products are being timed.
pub(super) fn on() -> bool {
    ON.load(Ordering::Relaxed)
}

/// Adds one call's time.
pub(super) fn record(d: MatDims, la: MatLayout, lb: MatLayout, kernel: &'static str, t: Duration) {
    let key = (
        d.batch,
        d.m,
        d.k,
        d.n,
        OperandLayout::of(la),
        OperandLayout::of(lb),
        kernel,
    );
    let mut times = TIMES.lock().unwrap_or_else(|e| e.into_inner());
    let entry = times.entry(key).or_insert((0, Duration::ZERO));
    entry.0 += 1;
    entry.1 += t;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Device, Result, Tensor};

    /// Products count by shape and layouts while timing is on, not before or after, and are
    /// forgotten once taken.
    #[test]
    fn products_are_timed_by_shape_and_layout_while_on() -> Result<()> {
        let dev = Device::new_cpu("timing-test");
        // A shape no other test multiplies, so that their products (timed too while this runs)
        // do not count here.
        let a = Tensor::from_vec(vec![0.5; 2 * 3 * 17], &[2, 3, 17], &dev)?;
        let b = Tensor::from_vec(vec![0.25; 2 * 19 * 17], &[2, 19, 17], &dev)?;
        let product = || a.matmul(&b.t()?);
        let mine = |t: &MatmulTime| (t.m, t.k, t.n) == (3, 17, 19);
        product()?;
        time_cpu_matmuls(true);
        for _ in 0..3 {
            product()?;
        }
        time_cpu_matmuls(false);
        product()?;
        let times: Vec<_> = take_cpu_matmul_times().into_iter().filter(mine).collect();
        assert_eq!(times.len(), 1, "{times:?}");
        let t = &times[0];
        assert_eq!(
            (t.batch, t.calls, t.a, t.b),
            (2, 3, OperandLayout::RowMajor, OperandLayout::Transposed)
        );
        assert!(t.seconds > 0.0 && t.gflops() > 0.0, "{t:?}");
        assert!(
            !take_cpu_matmul_times().iter().any(mine),
            "the times were not forgotten"
        );
        Ok(())
    }
}
