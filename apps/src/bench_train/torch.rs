//! The PyTorch column: which Python runs it, and PyTorch's steps/s for a workload measured by
//! the embedded `scripts/torch_reference.py` on as many threads as wgpipe's CPU backend.

use super::{BenchArgs, Workload, TORCH_PYTHON_ENV};
use crate::bail;
use crate::error::{AppError, AppResult, Context};

/// The PyTorch side of the benchmark (run with `python -`, the script on stdin).
const TORCH_REFERENCE: &str = include_str!("../../../scripts/torch_reference.py");

/// The Python for the PyTorch column: `--torch-python`, else `$WGPIPE_TORCH_PYTHON`, when it
/// imports torch (a clear note on stderr when it does not).
pub(super) fn torch_python(args: &BenchArgs) -> Option<String> {
    let py = args
        .torch_python
        .clone()
        .or_else(|| std::env::var(TORCH_PYTHON_ENV).ok())
        .filter(|p| !p.trim().is_empty())?;
    let probe = std::process::Command::new(&py)
        .args([
            "-c",
            "import torch; print(int(torch.backends.mkl.is_available()))",
        ])
        .output();
    match probe
        .as_ref()
        .map(|o| (o.status.success(), o.stdout.starts_with(b"1")))
    {
        Ok((true, uses_mkl)) => {
            let amd = crate::peak::cpu_model().is_some_and(|m| m.starts_with("AuthenticAMD"));
            if uses_mkl && amd && std::env::var_os("LD_PRELOAD").is_none() {
                // MKL picks its kernels by vendor: on AMD it runs its AVX2 path even where the
                // CPU has AVX-512 (here it gave ~200 against ~470 GFLOP/s on 1024^3).
                eprintln!(
                    "note: this PyTorch uses MKL on an AMD CPU, where MKL runs its slower \
                     generic kernels; README (bench_train) shows how to measure it at full speed"
                );
            }
            Some(py)
        }
        Ok((false, _)) => {
            eprintln!("no PyTorch column: `{py} -c \"import torch\"` failed");
            None
        }
        Err(e) => {
            eprintln!("no PyTorch column: cannot run {py}: {e}");
            None
        }
    }
}

/// PyTorch's steps/s for `w` on as many threads as wgpipe's CPU backend, measured by the
/// embedded `torch_reference.py`, with `preload` in its LD_PRELOAD when given.
pub(super) fn bench_torch(
    args: &BenchArgs,
    py: &str,
    w: Workload,
    preload: Option<&str>,
) -> AppResult<f64> {
    use std::io::Write;
    let mut cmd = std::process::Command::new(py);
    if let Some(lib) = preload {
        cmd.env("LD_PRELOAD", lib);
    }
    let mut child = cmd
        .arg("-")
        .args(["--workloads", w.key()])
        .args(["--threads", &crate::tensor::cpu_threads().to_string()])
        .args(["--seconds", &args.seconds.to_string()])
        .args(["--max-steps", &args.max_steps.to_string()])
        .args(["--warmup", &args.warmup.max(1).to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context(format!("starting {py}"))?;
    child
        .stdin
        .take()
        .expect("stdin was piped")
        .write_all(TORCH_REFERENCE.as_bytes())
        .context("sending torch_reference.py")?;
    let out = child
        .wait_with_output()
        .context("running torch_reference.py")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        bail!(
            "torch_reference.py {} failed ({}): {}",
            w.key(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    stdout
        .lines()
        .find_map(|l| l.strip_prefix(w.key())?.trim().parse::<f64>().ok())
        .ok_or_else(|| {
            AppError(format!(
                "torch_reference.py printed no figure for {}: {stdout}",
                w.key()
            ))
        })
}
