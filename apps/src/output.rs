//! What the examples show and write: the progress bar, the per-stage table and schedule grid,
//! the Chrome trace and the SVG timeline; and the check that an output path can be written,
//! made before training so that a bad path is not found after it.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::bail;
use crate::error::{AppResult, Context};
use crate::pipeline::{Pipeline, StepReport};

/// Whether this process prints and writes files: false on every rank but 0 of an MPI job.
static ROOT: AtomicBool = AtomicBool::new(true);

pub fn is_root() -> bool {
    ROOT.load(Ordering::Relaxed)
}

/// Makes this process silent (an MPI rank other than 0).
pub fn set_root(root: bool) {
    ROOT.store(root, Ordering::Relaxed);
}

/// `println!` on the process that reports (rank 0 of an MPI job; always in one process).
#[macro_export]
macro_rules! say {
    ($($t:tt)*) => {
        if $crate::output::is_root() {
            println!($($t)*);
        }
    };
}

/// `print!` on the process that reports.
#[macro_export]
macro_rules! say_part {
    ($($t:tt)*) => {
        if $crate::output::is_root() {
            print!($($t)*);
        }
    };
}

/// A progress bar over `total` steps starting at `start` (hidden with `quiet`).
pub fn progress_bar(start: u64, total: u64, quiet: bool) -> ProgressBar {
    let pb = ProgressBar::with_draw_target(
        Some(total),
        if quiet || !is_root() {
            ProgressDrawTarget::hidden()
        } else {
            ProgressDrawTarget::stderr()
        },
    );
    pb.set_style(
        ProgressStyle::with_template(
            "{spinner} [{elapsed_precise}] [{bar:30.cyan/blue}] step {pos}/{len} {msg}",
        )
        .expect("valid template")
        .progress_chars("=> "),
    );
    pb.set_position(start);
    pb
}

/// `Err` naming `--flag` unless a file can be written at `path`: not a folder, and its folder
/// exists (or can be created) and takes a new file. Checked by creating and removing a probe
/// file, so nothing is left behind.
pub fn check_writable(flag: &str, path: &Path) -> AppResult<()> {
    if path.is_dir() {
        bail!("--{flag} {}: a folder, not a file", path.display());
    }
    if path.file_name().is_none() {
        bail!("--{flag} {}: not a file path", path.display());
    }
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if let Err(e) = std::fs::create_dir_all(&dir) {
        bail!(
            "--{flag} {}: cannot create the folder {}: {e}",
            path.display(),
            dir.display()
        );
    }
    let probe = dir.join(format!(".wgpipe-probe-{}", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(e) => bail!(
            "--{flag} {}: cannot write in {}: {e}",
            path.display(),
            dir.display()
        ),
    }
}

/// Creates the folder `path` goes in.
pub fn create_parent(path: &Path) -> AppResult<()> {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).context(format!("creating {}", dir.display()))?;
    }
    Ok(())
}

/// Writes the Chrome trace and the SVG timeline of `report`.
pub fn write_pictures(
    report: &StepReport,
    label: &str,
    trace: &Path,
    timeline: &Path,
) -> AppResult<()> {
    // The report labels its own clock (simulated in simulated mode, else wall clock).
    let title = format!("{label} — step {}", report.step);
    create_parent(trace)?;
    std::fs::write(trace, report.chrome_trace_json(&title))
        .context(format!("writing {}", trace.display()))?;
    create_parent(timeline)?;
    std::fs::write(timeline, report.svg_timeline(&title))
        .context(format!("writing {}", timeline.display()))?;
    Ok(())
}

/// `path` or the default under `target/wgpipe/`.
pub fn out_path(path: &Option<PathBuf>, default: &str) -> PathBuf {
    path.clone()
        .unwrap_or_else(|| PathBuf::from("target/wgpipe").join(default))
}

/// After training: the per-stage table of the last step, the schedule grid (for M <= 12), and
/// the trace and SVG timeline.
pub fn report_outputs(
    pipe: &Pipeline,
    report: &StepReport,
    label: &str,
    trace: &Path,
    timeline: &Path,
) -> AppResult<()> {
    if !is_root() {
        return Ok(());
    }
    println!("\nlast step, per device:\n{}", report.stage_table());
    if pipe.num_micro_batches() <= 12 {
        println!("schedule (one column per clock tick):\n{}", pipe.schedule());
    }
    write_pictures(report, label, trace, timeline)?;
    println!(
        "wrote the Chrome trace of step {} to {} (open it in https://ui.perfetto.dev) and its timeline to {}",
        report.step,
        trace.display(),
        timeline.display()
    );
    Ok(())
}
