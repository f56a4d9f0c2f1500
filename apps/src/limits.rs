//! The checked range of every flag, and memory estimates made from the flags before anything
//! is allocated: a huge `--batch`, `--d-model` or `--image-size` is refused with one line that
//! names the flag and the limit, instead of a failed allocation with a backtrace.

use std::fmt::Display;

use crate::error::{AppError, AppResult};

/// `Err` unless `lo <= value <= hi`: `--flag VALUE is out of range: it must be in LO..=HI`.
pub fn check_range<T: PartialOrd + Display>(flag: &str, value: T, lo: T, hi: T) -> AppResult<()> {
    if value < lo || value > hi {
        return Err(AppError(format!(
            "--{flag} {value} is out of range: it must be in {lo}..={hi}"
        )));
    }
    Ok(())
}

/// `Err` unless `value` is a finite number in `[lo, hi]` (so NaN and infinities are refused,
/// naming the flag, before any work is done).
pub fn check_real(flag: &str, value: f64, lo: f64, hi: f64) -> AppResult<()> {
    if !value.is_finite() {
        return Err(AppError(format!(
            "--{flag} {value} is not a finite number: it must be in [{lo}, {hi}]"
        )));
    }
    if value < lo || value > hi {
        return Err(AppError(format!(
            "--{flag} {value} is out of range: it must be in [{lo}, {hi}]"
        )));
    }
    Ok(())
}

/// `Err` unless `value` is finite, `> 0` and at most `hi`.
pub fn check_positive(flag: &str, value: f64, hi: f64) -> AppResult<()> {
    check_real(flag, value, 0.0, hi)?;
    if value <= 0.0 {
        return Err(AppError(format!(
            "--{flag} {value} must be positive (at most {hi})"
        )));
    }
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// The memory the examples may use: what the machine has available (`MemAvailable` on Linux),
/// else 8 GiB; a simulated cluster's devices hold at most their `--sim-memory-gib` each on top
/// of that, which the pipeline enforces itself.
pub fn memory_limit_bytes() -> f64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemAvailable:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<f64>().ok())
        })
        .map_or(8.0 * GIB, |kb| kb * 1024.0)
}

/// One part of a memory estimate: its bytes, what it is, and the flags that size it (with
/// their values and defaults, so the flag furthest above its default can be named).
pub struct MemoryPart {
    pub what: &'static str,
    pub bytes: f64,
    /// (flag, value, default)
    pub flags: Vec<(&'static str, f64, f64)>,
}

/// `Err` when the parts add up to more than `limit` bytes, naming the largest part and, of its
/// flags, the one furthest above its default: `--d-model 65536: the model would need about
/// 410.2 GiB (parameters, gradients and optimizer state); the limit is 12.0 GiB (memory
/// available on this machine); lower --d-model`.
pub fn check_memory(parts: &[MemoryPart], limit: f64, limit_what: &str) -> AppResult<()> {
    let total: f64 = parts.iter().map(|p| p.bytes).sum();
    if total <= limit {
        return Ok(());
    }
    let Some(big) = parts.iter().max_by(|a, b| a.bytes.total_cmp(&b.bytes)) else {
        return Ok(());
    };
    let flag = big
        .flags
        .iter()
        .max_by(|a, b| (a.1 / a.2.max(1e-9)).total_cmp(&(b.1 / b.2.max(1e-9))))
        .map(|f| (f.0, f.1));
    let (name, value) = flag.unwrap_or(("", 0.0));
    Err(AppError(format!(
        "--{name} {value}: {} would need about {:.1} GiB (of {:.1} GiB in all); the limit is {:.1} GiB ({limit_what}); lower --{name}",
        big.what,
        big.bytes / GIB,
        total / GIB,
        limit / GIB
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_name_the_flag() {
        assert!(check_range("batch", 0usize, 1, 10)
            .unwrap_err()
            .0
            .contains("--batch 0"));
        let e = check_real("lr", f64::NAN, 0.0, 10.0).unwrap_err().0;
        assert!(e.starts_with("--lr NaN") && e.contains("finite"), "{e}");
        assert!(check_positive("sim-gflops", 0.0, 1e9).is_err());
        assert!(check_real("dropout", 0.5, 0.0, 0.99).is_ok());
    }

    #[test]
    fn memory_names_the_biggest_flag() {
        let parts = [
            MemoryPart {
                what: "the model",
                bytes: 100.0 * GIB,
                flags: vec![("d-model", 65536.0, 64.0), ("layers", 4.0, 4.0)],
            },
            MemoryPart {
                what: "the data",
                bytes: GIB,
                flags: vec![("batch", 32.0, 32.0)],
            },
        ];
        let e = check_memory(&parts, 8.0 * GIB, "test").unwrap_err().0;
        assert!(e.starts_with("--d-model 65536: the model"), "{e}");
        assert!(e.contains("the limit is 8.0 GiB"), "{e}");
        assert!(check_memory(&parts[1..], 8.0 * GIB, "test").is_ok());
    }
}
